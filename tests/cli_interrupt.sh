#!/usr/bin/env bash
# ctest: Ctrl-C during `halfgrad train-lm` stops after the step under way, writes the training checkpoint, says how
# to resume and exits 130; the same command with --resume finishes the run.   cli_interrupt.sh HALFGRAD WORK_DIR
set -u
halfgrad=$1
dir=$2
mkdir -p "$dir" && cd "$dir" || exit 1
rm -f run.safetensors first.log second.log
args=(train-lm --emsize 8 --nhid 8 --epochs 1 --limit-tokens 30000 --log-interval 1 --save "" --train-checkpoint
      run.safetensors)
"$halfgrad" "${args[@]}" > first.log 2>&1 &
pid=$!
for _ in $(seq 600); do grep -q 'batches' first.log && break; sleep 0.1; done  # the first step is done
kill -INT "$pid"
wait "$pid"
rc=$?
cat first.log
[[ $rc == 130 ]] || { echo "FAIL: exit status $rc after SIGINT, want 130"; exit 1; }
grep -q 'interrupted; run.safetensors holds the run where it stopped' first.log || { echo "FAIL: no resume line"; exit 1; }
"$halfgrad" "${args[@]}" --resume run.safetensors > second.log 2>&1
rc=$?
cat second.log
[[ $rc == 0 ]] || { echo "FAIL: the resumed run exited $rc"; exit 1; }
grep -q 'test perplexity' second.log || { echo "FAIL: the resumed run did not finish"; exit 1; }
echo "PASS: interrupted with 130 and resumed"

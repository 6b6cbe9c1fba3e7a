#!/usr/bin/env bash
# ctest (GPU): tools/trace_kernels.cpp under a program that starts others, as a shell, `timeout` or torch.compile (its
# compile workers) do. Here a shell with no kernels of its own runs train-lm twice: the first train-lm writes
# TRACE_KERNELS_OUT (an earlier run's records in it gone), the second TRACE_KERNELS_OUT.<pid>, every line a whole
# record. All the processes once truncated and wrote the one file, which came back with megabytes of zero bytes.
#   gpu_trace_processes.sh LIBTRACE_KERNELS HALFGRAD WORK_DIR
set -u
lib=$1
halfgrad=$2
dir=$3
root=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "$dir" && mkdir -p "$dir" && cd "$dir" || exit 1
fail() { echo "FAIL: $*"; exit 1; }
"$halfgrad" info | grep -q "GPU 0: " || { echo "no GPU visible: skipped"; exit 77; }

train="'$halfgrad' train-lm --device cuda --emsize 8 --nhid 8 --epochs 1 --dry-run --limit-tokens 4000 --save ''"
printf 'an earlier run\n' > run.csv
TRACE_KERNELS_OUT=$dir/run.csv LD_PRELOAD=$lib sh -c "$train > one.log 2>&1 && $train > two.log 2>&1" ||
  { cat one.log two.log 2>/dev/null; fail "train-lm failed under the tracer"; }
shopt -s nullglob
others=(run.csv.*)
(( ${#others[@]} == 1 )) || fail "expected one more file, for the second train-lm, got: ${others[*]}"
for f in run.csv "${others[@]}"; do
  [[ -s $f ]] || fail "$f has no records"
  bad=$(LC_ALL=C grep -avcE '^[0-9]+,[0-9]+,[0-9]+,[0-9]+,(kernel|memset|memcpy),.' "$f")
  (( bad == 0 )) || fail "$f has $bad lines that are not whole records (an earlier run's among them?)"
  [[ $(tr -d '\000' < "$f" | wc -c) == $(wc -c < "$f") ]] || fail "$f has zero bytes"
done
python3 "$root/tools/trace_kernels.py" run.csv > summary.txt 2>&1 || { cat summary.txt; fail "trace_kernels.py could not read run.csv"; }
echo "PASS: each program wrote its own whole records ($(wc -l < run.csv) and $(wc -l < "${others[0]}") lines)"

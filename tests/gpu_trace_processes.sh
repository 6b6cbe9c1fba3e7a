#!/usr/bin/env bash
# ctest (GPU): tools/trace_kernels.cpp under programs that start others, as a shell, `timeout` or torch.compile (its
# compile workers) do. The processes of a run once all truncated and wrote the one file, which came back with
# megabytes of zero bytes. Now, each case with train-lm (a few kernels, then exit):
#   a shell running two one after the other: the first writes TRACE_KERNELS_OUT, the second
#     TRACE_KERNELS_OUT.pid<N>; an earlier run's records and per-process files are gone, a file of the user's stays;
#   bash running two in another folder (bash has its own getenv and setenv): the same, in the first folder;
#   a shell running two at once: one file each, whole records, no zero bytes;
#   train-lm traced itself: TRACE_KERNELS_OUT only.
#   gpu_trace_processes.sh LIBTRACE_KERNELS HALFGRAD PYTHON WORK_DIR
set -u
fail() { echo "FAIL: $*"; exit 1; }
(( $# == 4 )) && [[ -n $4 ]] || fail "usage: gpu_trace_processes.sh LIBTRACE_KERNELS HALFGRAD PYTHON WORK_DIR"
lib=$(realpath "$1") && halfgrad=$(realpath "$2") && python=$3 && dir=$(realpath -m "$4") || fail "bad arguments: $*"
root=$(cd "$(dirname "$0")/.." && pwd)
# The loader splits LD_PRELOAD at spaces and colons.
[[ $lib != *[\ :]* ]] || fail "LD_PRELOAD cannot name $lib (a space or colon in the path); build elsewhere"
rm -rf "$dir" && mkdir -p "$dir" && cd "$dir" || exit 1
"$halfgrad" info | grep -q "GPU 0: " || { echo "no GPU visible: skipped"; exit 77; }

train=(train-lm --device cuda --emsize 8 --nhid 8 --epochs 1 --dry-run --limit-tokens 4000 --save '')
traced() { TRACE_KERNELS_OUT=run.csv LD_PRELOAD=$lib "$@"; }
# whole FILE...: each file has records, every line a whole one, and no zero bytes.
whole() {
  local f bad
  for f in "$@"; do
    [[ -s $f ]] || fail "$f has no records"
    bad=$(LC_ALL=C grep -avcE '^[0-9]+,[0-9]+,[0-9]+,[0-9]+,(kernel|memset|memcpy),.' "$f")
    (( bad == 0 )) || fail "$f has $bad lines that are not whole records (an earlier run's among them?)"
    [[ $(tr -d '\000' < "$f" | wc -c) == $(wc -c < "$f") ]] || fail "$f has zero bytes"
  done
}
shopt -s nullglob

printf 'an earlier run\n' > run.csv
printf 'an earlier process\n' > run.csv.pid2147483646  # no such process
printf "the user's\n" > run.csv.20261206
traced sh -c '"$0" "$@" > one.log 2>&1 && "$0" "$@" > two.log 2>&1' "$halfgrad" "${train[@]}" 2> shell.err ||
  { cat one.log two.log shell.err 2>/dev/null; fail "train-lm failed under the tracer, one after the other"; }
[[ -f run.csv.20261206 ]] || fail "a file of the user's, run.csv.20261206, was removed"
others=(run.csv.pid*)
(( ${#others[@]} == 1 )) && [[ ${others[0]} != run.csv.pid2147483646 ]] ||
  fail "one after the other: expected run.csv and the second train-lm's file, got run.csv ${others[*]}"
whole run.csv "${others[0]}"
grep -qF "go to $dir/${others[0]}" two.log || { cat two.log; fail "the second train-lm said nothing of ${others[0]}"; }
"$python" "$root/tools/trace_kernels.py" "${others[0]}" > summary.txt 2>&1 ||
  { cat summary.txt; fail "trace_kernels.py could not read ${others[0]}"; }

rm -f run.csv* && mkdir -p sub
traced bash -c 'cd sub && "$0" "$@" > ../one.log 2>&1 && "$0" "$@" > ../two.log 2>&1' "$halfgrad" "${train[@]}" \
  2> shell.err || { cat one.log two.log shell.err; fail "train-lm failed under the tracer, from bash in another folder"; }
others=(run.csv.pid*)
(( ${#others[@]} == 1 )) && [[ ! -e sub/run.csv ]] ||
  fail "bash in another folder: expected run.csv and one more file here, got run.csv ${others[*]} $(ls sub)"
whole run.csv "${others[0]}"

rm -f run.csv*
traced sh -c '"$0" "$@" > one.log 2>&1 & a=$!; "$0" "$@" > two.log 2>&1 & b=$!; wait $a && wait $b' \
  "$halfgrad" "${train[@]}" 2> shell.err || { cat one.log two.log shell.err; fail "train-lm failed under the tracer, at once"; }
others=(run.csv.pid*)
(( ${#others[@]} == 1 )) || fail "at once: expected run.csv and one more file, got run.csv ${others[*]}"
whole run.csv "${others[0]}"

rm -f run.csv*
traced "$halfgrad" "${train[@]}" > self.log 2>&1 || { cat self.log; fail "train-lm failed under the tracer"; }
others=(run.csv.pid*)
(( ${#others[@]} == 0 )) || fail "traced itself: expected run.csv alone, got run.csv ${others[*]}"
whole run.csv
"$python" "$root/tools/trace_kernels.py" run.csv > summary.txt 2>&1 || { cat summary.txt; fail "trace_kernels.py could not read run.csv"; }
echo "PASS: one file per traced program with kernels, whole records only ($(wc -l < run.csv) records traced itself)"

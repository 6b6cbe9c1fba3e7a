#!/usr/bin/env bash
# compute-sanitizer over every GPU test case of halfgrad_tests, each case in a process of its own, several at a time.
#
#   bash tools/gpu_sanitize.sh memcheck  [tests binary] [log folder]   # out-of-bounds and misaligned accesses
#   bash tools/gpu_sanitize.sh racecheck [tests binary] [log folder]   # shared-memory hazards in halfgrad's kernels
#   SANITIZE_JOBS=8 SANITIZE_CASE_TIMEOUT=150 SANITIZE_CASES='*rnn*' ...  # processes at a time, seconds a case, which
#
# One process a case: a fault in one case (or the sanitizer's own failure inside a library kernel) loses that case
# only, and the cases run side by side. The GPU cases are those whose names say cuda, CUDA or GPU, and the loss
# scaler's min_scale case.
#
# memcheck runs with the CUDA allocator's caching off (HALFGRAD_CUDA_NO_CACHING=1, core/cuda_allocator.h): every
# tensor is then its own cudaMalloc of its exact size, so a kernel that reads past a tensor's end is reported; with
# the cache it would read another block of the same segment unseen. Cases that need the cache keep it: CUDA graphs
# (their replays write the blocks kept for them), the allocator's own tests, the memory limit, bench max-batch, the >2^31-element
# op. The out-of-memory case fails a cudaMalloc on purpose, so API errors are not reported for it.
#
# racecheck instruments halfgrad's kernels only (--kernel-name kns=halfgrad): cuBLAS's and cuDNN's Hopper kernels
# synchronise through mbarriers, which racecheck does not follow, and the sanitizer stops with an internal error in
# some of them; a case where that happened is listed as "stopped in a library kernel" (what ran before was checked).
#
# Prints one line a case and a count; exits 1 if a case reported an error or a hazard or its test failed.
set -uo pipefail
tool=${1:?usage: gpu_sanitize.sh memcheck|racecheck [tests binary] [log folder]}
[[ $tool == memcheck || $tool == racecheck ]] || { echo "gpu_sanitize: the tool is memcheck or racecheck, not '$tool'"; exit 2; }
tests=${2:-build-gpu/halfgrad_tests}
logs=${3:-build-gpu/logs/$tool}
[[ -x $tests ]] || { echo "gpu_sanitize: no test binary at $tests"; exit 2; }
command -v compute-sanitizer >/dev/null || { echo "gpu_sanitize: compute-sanitizer is not on PATH"; exit 2; }
mkdir -p "$logs"

"$tests" --list-test-cases ${SANITIZE_CASES:+--test-case="$SANITIZE_CASES"} | grep -v '^\[doctest\]' | grep -v '^====' \
  | grep -iE 'cuda|gpu|min_scale' > "$logs/cases.txt"
echo "gpu_sanitize: $tool over $(wc -l < "$logs/cases.txt") test cases, ${SANITIZE_JOBS:-8} at a time; logs in $logs"

one_case() {  # $1: index, $2: the test case's name
  local index=$1 name=$2 log="$logs/$1.log"
  local args=(--tool "$tool" --error-exitcode 3 --print-limit 20) env=(HALFGRAD_CUDA_NO_CACHING=0)
  if [[ $tool == racecheck ]]; then
    args+=(--kernel-name kns=halfgrad)
  else
    env=(HALFGRAD_CUDA_NO_CACHING=1)
    case "$name" in
      *graph*|*allocator*|*caching*|*"memory limit"*|*max-batch*|*2^31*) env=(HALFGRAD_CUDA_NO_CACHING=0) ;;
      *"out of memory"*) env=(HALFGRAD_CUDA_NO_CACHING=0); args+=(--report-api-errors no) ;;
    esac
  fi
  # doctest's filter separates patterns at commas: a comma in a name becomes the one-character wildcard.
  env "${env[@]}" timeout -k 10 "${SANITIZE_CASE_TIMEOUT:-150}" compute-sanitizer "${args[@]}" "$tests" \
    --test-case="${name//,/?}" > "$log" 2>&1
  local rc=$? verdict
  local found; found=$(grep -hE '(ERROR|RACECHECK) SUMMARY' "$log" | tail -n 1 | sed 's/^=* *//')
  local errors; errors=$(sed -nE 's/.*SUMMARY: ([0-9]+) (errors?|hazards?).*/\1/p' <<< "$found")
  # The sanitizer's own failure counts as one error (and fails the test after it): more than one is a finding.
  if grep -q 'Internal Sanitizer Error' "$log" && (( ${errors:-0} <= 1 )); then verdict="stopped in a library kernel"
  elif grep -q 'terminated before first instrumented API call' "$log" && grep -q 'Status: SUCCESS' "$log"; then
    verdict="clean (no CUDA work)"
  elif [[ $rc -eq 124 ]]; then verdict="TIMEOUT"
  elif [[ $rc -eq 0 ]]; then verdict="clean"
  else verdict="FAILED (rc $rc)"; fi
  printf '%s | %s | %s | %s\n' "$index" "$verdict" "${found:-no summary}" "$name"
}
export -f one_case; export tool tests logs

awk '{ printf "%d\t%s\n", NR, $0 }' "$logs/cases.txt" \
  | xargs -r -d '\n' -P "${SANITIZE_JOBS:-8}" -n 1 bash -c 'one_case "${1%%	*}" "${1#*	}"' _ \
  | sort -t '|' -k1,1n | tee "$logs/summary.txt"
clean=$(grep -c '| clean' "$logs/summary.txt")
stopped=$(grep -c '| stopped in a library kernel' "$logs/summary.txt")
bad=$(grep -cE '\| (FAILED|TIMEOUT)' "$logs/summary.txt")
echo "gpu_sanitize: $tool: $clean clean, $stopped stopped in a library kernel, $bad failed or timed out"
[[ $bad -eq 0 ]]

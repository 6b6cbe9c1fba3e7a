#!/usr/bin/env bash
# Runs each libFuzzer target of tests/fuzz/ for a bounded time on a working copy of its seed corpus, and prints
# what it did. `make fuzz` builds the targets first (clang, ASan + UBSan) and calls this.
#
#   tools/run_fuzz.sh BUILD_DIR [SECONDS_PER_TARGET] [TARGET ...]
#   FUZZ_RUNS=1000000 tools/run_fuzz.sh BUILD_DIR 0 fuzz_text    # a number of executions instead of a time
#
# A crash, a sanitizer report or an exception other than halfgrad::Error stops that target with libFuzzer's report
# and the input that caused it (BUILD_DIR/fuzz-out/<target>/crash-*); the script then exits non-zero.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build=${1:?usage: tools/run_fuzz.sh BUILD_DIR [SECONDS_PER_TARGET] [TARGET ...]}
seconds=${2:-60}
shift $(( $# >= 2 ? 2 : $# ))
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(fuzz_checkpoint fuzz_cifar fuzz_text)
failed=0
for t in "${targets[@]}"; do
  exe=$build/$t
  [[ -x $exe ]] || { echo "run_fuzz: $exe not built (make fuzz builds it)" >&2; exit 2; }
  seeds=tests/fuzz/corpus/${t#fuzz_}
  work=$build/fuzz-out/$t
  mkdir -p "$work/corpus"
  # The corpus grows in the build tree; the seeds in the repository stay as they are.
  log=$work/log.txt
  limit=(-max_total_time="$seconds")
  [[ -n ${FUZZ_RUNS:-} ]] && limit=(-runs="$FUZZ_RUNS")
  start=$SECONDS
  (cd "$work" && ASAN_OPTIONS=detect_leaks=1 "$OLDPWD/$exe" "${limit[@]}" -print_final_stats=1 \
      -timeout=10 -rss_limit_mb=4096 corpus "$OLDPWD/$seeds") >"$log" 2>&1
  rc=$?
  runs=$(grep -oP 'stat::number_of_executed_units:\s*\K[0-9]+' "$log" || echo "?")
  echo "$t: ${runs} executions in $((SECONDS - start)) s, corpus $(ls "$work/corpus" | wc -l) inputs, exit ${rc}"
  if [[ $rc -ne 0 ]]; then
    failed=1
    grep -E 'ERROR|SUMMARY|uncaught|Test unit written' "$log" | head -n 10
  fi
done
exit $failed

#!/usr/bin/env bash
# Every number-valued option of halfgrad's commands, given hostile text: each run must end with an exit status and,
# when it fails, a message; never a signal (an abort, a segfault), an uncaught exception or a sanitizer's report.
# Values past a type's range, nan, inf, hex, exponents, signs and words are refused when the command line is parsed;
# values that are accepted meet a missing data folder or checkpoint, so every run ends within a second.
#
#   tests/cli_hostile_numbers.sh build/halfgrad
set -uo pipefail
cli=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
none=$work/none  # a folder or file that does not exist

values=(-1 0 1 1.5 1e400 nan inf -inf 0x10 1e3 010 08 abc "" 2147483648 9223372036854775808
        18446744073709551616 99999999999999999999)

# The fewest numeric options --help must list per command: fewer means the listing's format changed and options
# would go untested.
declare -A at_least=([train-classifier]=13 [sweep-classifier]=13 [train-lm]=14 [generate]=4 [bench]=9)

# Each command with settings under which an accepted value ends fast (demo is left out: it trains on the shipped
# corpus, and its two options use the validators the others test). The option under test is never in its command's
# base (CLI11 refuses a single-valued option given twice).
declare -A base=(
  [train-classifier]="--data-dir $none --device cpu"
  [sweep-classifier]="--data-dir $none --device cpu"
  [train-lm]="--data-dir $none --device cpu"
  [generate]="--checkpoint $none --device cpu"
  [bench]="resnet --device cpu --models resnet18 --batch 1 --epochs 1 --data-dir $none"
)

# Refused when the command line is parsed, naming the option: not a number, not finite; for integers also fractions,
# hex, exponents and values past their type's range (INT: int64_t or int, UINT: uint64_t).
refused_always=(1e400 nan inf -inf abc "")
refused_integer=(1.5 0x10 1e3 010 08 99999999999999999999)
refused_int=(9223372036854775808)

check_command() {
  local command=$1 failures=0 runs=0
  # The options whose value is a number, as --help lists them ("--epochs INT:...", "--lr FLOAT:...").
  # The options whose value is a number and their bounds, as --help lists them: "--epochs INT:INTEGER >= 1=30",
  # "--dropout FLOAT:FINITE in [0, 0.99]=0.2" -> "--epochs INT >= 1", "--dropout FLOAT in 0 0.99".
  local listed
  listed=$("$cli" "$command" --help </dev/null |
           sed -nE 's/^ +(--[a-z-]+)(,--[a-z_]+)? +(INT|UINT|FLOAT)(:[A-Z]+ (>=|>|in) \[?([-0-9.e]+)(, ([-0-9.e]+)\])?)?.*/\1 \3 \5 \6 \8/p')
  if (($(grep -c . <<<"$listed") < at_least[$command])); then
    echo "FAIL: $command --help lists $(grep -c . <<<"$listed") numeric options, expected at least ${at_least[$command]}"
    return 1
  fi
  while read -r option type relation low high; do
    local args kept=() i
    read -ra args <<<"${base[$command]}"
    for ((i = 0; i < ${#args[@]}; i++)); do  # the option under test (and its value) out of the base
      if [[ ${args[i]} == "$option" ]]; then ((i++)); else kept+=("${args[i]}"); fi
    done
    local refused=("${refused_always[@]}")
    [[ $type != FLOAT ]] && refused+=("${refused_integer[@]}")
    [[ $type == INT ]] && refused+=("${refused_int[@]}")
    # Just past each bound the option states: below ">= low", at "> low", outside "in [low, high]".
    local bounds=()
    case $relation in
      ">=") bounds+=("$(awk -v x="$low" 'BEGIN { print x - 1 }')") ;;
      ">") bounds+=("$low") ;;
      in) bounds+=("$(awk -v x="$low" 'BEGIN { print x - 1 }')" "$(awk -v x="$high" 'BEGIN { print x + 1 }')") ;;
    esac
    refused+=("${bounds[@]}")
    for value in "${values[@]}" "${bounds[@]}"; do
      runs=$((runs + 1))
      local output rc what
      output=$(timeout 20 "$cli" "$command" "${kept[@]}" "$option" "$value" 2>&1 </dev/null)
      rc=$?
      what="$command $option '$value' (status $rc)"
      if ((rc >= 124)); then
        echo "FAIL: $what: a signal or a timeout"; echo "$output" | tail -n 3; failures=$((failures + 1))
      elif ((rc != 0)) && [[ -z $output ]]; then
        echo "FAIL: $what: failed without a message"; failures=$((failures + 1))
      elif grep -qE 'terminate called|runtime error:|Sanitizer|Segmentation|Aborted' <<<"$output"; then
        echo "FAIL: $what:"; echo "$output" | tail -n 3; failures=$((failures + 1))
      else
        local must
        for must in "${refused[@]}"; do
          if [[ $value == "$must" ]] && ! { ((rc != 0)) && grep -q -- "^$option: " <<<"$output"; }; then
            echo "FAIL: $what: not refused when parsed, naming $option:"; echo "$output" | head -n 2
            failures=$((failures + 1))
          fi
        done
      fi
    done
  done <<<"$listed"
  echo "$command: $runs runs, $failures failures"
  ((failures == 0))
}

# The commands side by side (each run is mostly process start-up).
pids=()
for command in "${!base[@]}"; do
  check_command "$command" >"$work/$command.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
cat "$work"/*.log
exit $status

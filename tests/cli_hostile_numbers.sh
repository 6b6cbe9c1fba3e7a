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

# Every value is tried on the first option of each kind (its type and bounds, as --help states them: 9 kinds among
# 55 options); the other options of a kind, which share its validators, get `brief` (and their bounds): enough to
# show that each has a validator and names itself. All values on all options took 77 s of CI's 2 cores (~1,000
# process starts, most of each the CUDA libraries' initialisation); this takes under half of that.
brief=(abc nan)
brief_integer=(1.5 2147483648 9223372036854775808)

# The options whose value is a number and their bounds, as --help lists them: "--epochs INT:INTEGER >= 1=30",
# "--dropout FLOAT:FINITE in [0, 0.99]=0.2" -> "--epochs INT >= 1", "--dropout FLOAT in 0 0.99"; each line led by
# `all` or `brief` (what it is tried with), into $work/<command>.options.
list_options() {
  local command kind
  declare -A seen=()
  for command in $(printf '%s\n' "${!base[@]}" | sort); do
    "$cli" "$command" --help </dev/null |
      sed -nE 's/^ +(--[a-z-]+)(,--[a-z_]+)? +(INT|UINT|FLOAT)(:[A-Z]+ (>=|>|in) \[?([-0-9.e]+)(, ([-0-9.e]+)\])?)?.*/\1 \3 \5 \6 \8/p' \
      >"$work/$command.listed"
    local count
    count=$(grep -c . "$work/$command.listed")
    if ((count < at_least[$command])); then
      echo "FAIL: $command --help lists $count numeric options, expected at least ${at_least[$command]}"
      return 1
    fi
    while read -r option kind; do
      if [[ -z ${seen[$kind]:-} ]]; then seen[$kind]=1; echo "all $option $kind"; else echo "brief $option $kind"; fi
    done <"$work/$command.listed" >"$work/$command.options"
  done
}

check_command() {
  local command=$1 failures=0 runs=0
  while read -r tried option type relation low high; do
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
    local tries=("${values[@]}")
    if [[ $tried == brief ]]; then
      tries=("${brief[@]}")
      [[ $type != FLOAT ]] && tries+=("${brief_integer[@]}")
    fi
    for value in "${tries[@]}" "${bounds[@]}"; do
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
  done <"$work/$command.options"
  echo "$command: $runs runs, $failures failures"
  ((failures == 0))
}

list_options || exit 1

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

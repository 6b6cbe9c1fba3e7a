#!/usr/bin/env bash
# The two-GPU run (issue 18) in one command, on a machine with two GPUs (the device tool's nvidia-h200-x2), after a
# build (tools/gpu_check.sh or cmake --build build-gpu):
#
#   bash tools/two_gpu_run.sh [build folder, default build-gpu]    # logs and JSON lines to $OUT (else <build>/logs)
#
# 1. Scaling: `halfgrad bench` in one process on one GPU, then under `halfgrad launch` with two ranks, one GPU each:
#    ResNet-50 amp at batch 256 a GPU, and the word language model LSTM 650x2 at batch 20 a GPU in fp32 and amp. The
#    two-GPU line's throughput is the group's; over the one-GPU line's, the scaling.
# 2. Overlap: the two-GPU lines' "overlap" (tools/bench.h): backward with and without the gradients' all-reduces, the
#    all-reduces alone, and the share backward hid.
# 3. Replicas: each bench line's "replicas_agree", and the parity run below with --check-replicas 10.
# 4. Parity: train-lm (no dropout, one epoch of 100 steps of 20 columns: --limit-tokens 70000) as 2 ranks of 10
#    columns against one process of 20, twice alone to show the GPU's own run-to-run spread (its embedding backward adds
#    with atomics); the losses of the two-rank run against the first one-process run, next to that spread.
#
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0): the device notes say why. TWO_GPU_RANKS=1 runs the "two-GPU" side
# with one rank too, on a one-GPU machine: a check of this script, not a measurement of scaling.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."  # the build folder and a relative $OUT are the repository's
build=${1:-build-gpu}
logs=${OUT:-$build/logs}/two-gpu
mkdir -p "$logs"
halfgrad=$build/halfgrad
[[ -x $halfgrad ]] || { echo "two_gpu_run: no halfgrad at $halfgrad (build first)"; exit 2; }
ranks=${TWO_GPU_RANKS:-2}
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
((gpus >= ranks)) || { echo "two_gpu_run: this machine has $gpus GPU(s); the run needs $ranks"; exit 2; }
[[ -d .deps/usr/lib/x86_64-linux-gnu ]] &&
  export LD_LIBRARY_PATH="$PWD/.deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NVLS_ENABLE=0
failed=0
note() { echo "two_gpu_run: $*" | tee -a "$logs/summary.txt"; }

bench_pair() {  # $1: name; the rest: bench's arguments
  local name=$1
  shift
  rm -f "$logs/$name-1.jsonl" "$logs/$name-2.jsonl"  # bench appends: no lines of an earlier run
  # One GPU as a user trains on one: one process, no data-parallel wrapper.
  "$halfgrad" bench "$@" --device cuda --out "$logs/$name-1.jsonl" > "$logs/$name-1.log" 2>&1 ||
    { note "$name on one GPU FAILED"; tail -n 20 "$logs/$name-1.log"; failed=1; }
  "$halfgrad" launch --nproc-per-node "$ranks" -- bench "$@" --device cuda --out "$logs/$name-2.jsonl" \
    > "$logs/$name-2.log" 2>&1 || { note "$name on $ranks GPU(s) FAILED"; tail -n 20 "$logs/$name-2.log"; failed=1; }
  python3 - "$logs/$name-1.jsonl" "$logs/$name-2.jsonl" <<'PY' | tee -a "$logs/summary.txt" || failed=1
import json, sys
one, two = ([json.loads(l) for l in open(p)] for p in sys.argv[1:3])
assert one and len(one) == len(two), f"{len(one)} one-GPU lines against {len(two)}"
agree = True
for a, b in zip(one, two):
    assert not a["out_of_memory"] and not b["out_of_memory"], (a.get("error"), b.get("error"))
    agree = agree and b["replicas_agree"]
    unit = "images_per_second" if "images_per_second" in a else "tokens_per_second"
    o = b["overlap"]
    print(f"{b['model']} {b['precision']} batch {b['batch']} a GPU: {a[unit]:,.0f} -> {b[unit]:,.0f} {unit.split('_')[0]}/s,"
          f" {b[unit] / a[unit]:.3f}x on {b['world_size']} GPU(s); replicas agree: {b['replicas_agree']}; backward"
          f" {o['backward_ms']:.2f} ms with the all-reduces, {o['backward_no_sync_ms']:.2f} without, all-reduces alone"
          f" {o['all_reduce_ms']:.2f} ms in {o['buckets']} buckets, {100 * o['hidden']:.0f}% hidden")
sys.exit(0 if agree else "the ranks' replicas differ")
PY
}

bench_pair resnet50 resnet --models resnet50 --precisions amp --batch 256
bench_pair lstm650 lm --models lstm-650x2 --precisions fp32,amp --batch 20

lm=(train-lm --device cuda --dropout 0 --epochs 1 --limit-tokens 70000 --log-interval 0 --save "")
rm -f "$logs"/parity-*.jsonl
"$halfgrad" "${lm[@]}" --batch-size 20 --jsonl "$logs/parity-one-a.jsonl" > "$logs/parity-one-a.log" 2>&1 || failed=1
"$halfgrad" "${lm[@]}" --batch-size 20 --jsonl "$logs/parity-one-b.jsonl" > "$logs/parity-one-b.log" 2>&1 || failed=1
"$halfgrad" launch --nproc-per-node "$ranks" -- "${lm[@]}" --batch-size $((20 / ranks)) --check-replicas 10 \
  --jsonl "$logs/parity-two.jsonl" > "$logs/parity-two.log" 2>&1 || { note "parity run on $ranks GPU(s) FAILED"; failed=1; }
python3 - "$logs"/parity-one-a.jsonl "$logs"/parity-one-b.jsonl "$logs"/parity-two.jsonl <<'PY' | tee -a "$logs/summary.txt" || failed=1
import json, sys
runs = [{k: v for l in map(json.loads, open(p)) for k, v in l.items() if k.endswith("_loss")} for p in sys.argv[1:4]]
one, again, two = runs
keys = sorted(k for k in one if k in two and k in again)
assert keys, "no losses to compare"
spread = max(abs(one[k] - again[k]) / abs(one[k]) for k in keys)
gap = max(abs(one[k] - two[k]) / abs(one[k]) for k in keys)
print(f"parity, 100 steps of 20 columns: the ranks' run against one process, largest relative difference of {keys}:"
      f" {gap:.2e}; one process against itself: {spread:.2e}")
PY
note "logs in $logs"
exit $failed

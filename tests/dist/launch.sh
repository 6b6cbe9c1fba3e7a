#!/usr/bin/env bash
# `halfgrad launch` end to end, on the CPU (gloo). Prints "PASS: <case>" when the case holds.
#
#   bash tests/dist/launch.sh build/halfgrad lm_equals_one_process
#       2 ranks of train-lm, 4 columns each, give the figures one process gives with 8 columns (no dropout: the same
#       arithmetic, but summed in another order; to 1e-4, as two epochs amplify rounding: 1.2e-5 in the ASan build),
#       and only rank 0 prints and writes files
#   bash tests/dist/launch.sh build/halfgrad classifier_runs
#       2 ranks of train-classifier on CIFAR-10 files: each trains its shard and evaluates its slice of the test split,
#       and rank 0 prints the group's figures: training images per epoch and test images as one process counts them
#   bash tests/dist/launch.sh build/halfgrad environment
#       the second node of two, 2 ranks each: every rank is told its place (RANK, LOCAL_RANK, WORLD_SIZE, ...)
#   bash tests/dist/launch.sh build/halfgrad bench_data_parallel
#       2 ranks of bench lm and bench resnet on the CPU: rank 0 writes one line per configuration with the group's
#       throughput, the replicas found equal, and the overlap figures; --check-replicas in a 2-rank train-lm, and
#       refused without launch
#   bash tests/dist/launch.sh build/halfgrad ranks_disagree
#       2 ranks started by hand, as on two nodes, with other options (train-lm's --batch-size) or other data (rank 1's
#       CIFAR file holds fewer images), or with a file missing on one node: both stop at once, before any step, with
#       the same error naming what differs or why the one rank failed
#   bash tests/dist/launch.sh build/halfgrad killed_rank
#       a rank killed mid-run: the launcher names it, stops the other within its grace period and fails
set -uo pipefail
halfgrad=$1 case=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
port=$(python3 "$(dirname "$0")/free_port.py")
export OMP_NUM_THREADS=1
lm=(train-lm --emsize 8 --nhid 8 --nlayers 1 --dropout 0 --bptt 5 --limit-tokens 3000 --log-interval 0 --save "")

case $case in
lm_equals_one_process)
  "$halfgrad" "${lm[@]}" --epochs 2 --batch-size 8 --jsonl "$dir/one.jsonl" > "$dir/one.log" 2>&1 ||
    { cat "$dir/one.log"; exit 1; }
  "$halfgrad" launch --nproc-per-node 2 --master-port "$port" -- "${lm[@]}" --epochs 2 --batch-size 4 \
    --jsonl "$dir/two.jsonl" > "$dir/two.log" 2>&1 || { cat "$dir/two.log"; exit 1; }
  cat "$dir/two.log"
  grep -q "data parallel over 2 ranks (gloo): batch 4 a rank" "$dir/two.log" || { echo "no data-parallel header"; exit 1; }
  [[ $(grep -c "^test loss" "$dir/two.log") == 1 ]] || { echo "not only rank 0 printed"; exit 1; }
  python3 - "$dir/one.jsonl" "$dir/two.jsonl" <<'PY' || exit 1
import json, sys
def lines(path):
    return [json.loads(l) for l in open(path)]
one, two = lines(sys.argv[1]), lines(sys.argv[2])
assert [l["event"] for l in one] == [l["event"] for l in two], ("events differ", one, two)
for a, b in zip(one, two):
    for key in ("train_loss", "valid_loss", "lr", "test_loss"):
        if key in a:
            assert abs(a[key] - b[key]) <= 1e-4 * abs(a[key]), (key, a[key], b[key])
print("one process and 2 ranks agree:", [(l.get("valid_loss"), l.get("test_loss")) for l in two])
PY
  echo "PASS: $case"
  ;;
classifier_runs)
  # 96 training and 50 test images in the official format, a label byte then 3,072 pixel bytes each.
  python3 - "$dir" <<'PY'
import os, random, sys
random.seed(1)
def write(name, n):
    with open(os.path.join(sys.argv[1], name), "wb") as f:
        for _ in range(n):
            f.write(bytes([random.randrange(10)]) + os.urandom(3072))
write("data_batch_1.bin", 96)
write("test_batch.bin", 50)
PY
  "$halfgrad" launch --nproc-per-node 2 --master-port "$port" -- train-classifier --data-dir "$dir" --device cpu \
    --model resnet18 --epochs 1 --batch-size 16 --workers 0 --log-interval 0 --jsonl "$dir/two.jsonl" \
    > "$dir/two.log" 2>&1 || { cat "$dir/two.log"; exit 1; }
  cat "$dir/two.log"
  grep -q "data parallel over 2 ranks (gloo): batch 16 a rank" "$dir/two.log" || { echo "no data-parallel header"; exit 1; }
  python3 - "$dir/two.jsonl" <<'PY' || exit 1
import json, sys
epochs = [l for l in map(json.loads, open(sys.argv[1])) if l["event"] == "epoch"]
assert len(epochs) == 1, epochs
e = epochs[0]
# 96 images in 2 shards of 48: 3 steps of 16 a rank; the test split's 50 images in slices of 25: accuracy in 50ths.
assert abs(e["images_per_second"] * e["seconds"] - 96) < 1e-6, e
assert abs(e["test_accuracy"] * 50 - round(e["test_accuracy"] * 50)) < 1e-9, e
assert abs(e["train_accuracy"] * 96 - round(e["train_accuracy"] * 96)) < 1e-9, e
print("the group's figures:", e)
PY
  echo "PASS: $case"
  ;;
environment)
  "$halfgrad" launch --nnodes 2 --node-rank 1 --nproc-per-node 2 --master-addr 10.1.2.3 --master-port 4567 -- info \
    > "$dir/info.log" 2>&1 || { cat "$dir/info.log"; exit 1; }
  cat "$dir/info.log"
  for expected in "rank 2 of 4 (local rank 0 of 2), rendezvous at 10.1.2.3:4567" \
                  "rank 3 of 4 (local rank 1 of 2), rendezvous at 10.1.2.3:4567"; do
    grep -qF "this process: $expected" "$dir/info.log" || { echo "missing: $expected"; exit 1; }
  done
  for other in launch sweep-classifier generate; do  # not ranks of one run: N copies of one job
    "$halfgrad" launch --nproc-per-node 2 -- $other > "$dir/other.log" 2>&1 && { echo "launch ran $other"; exit 1; }
    grep -q "\`$other\` does not run data-parallel" "$dir/other.log" || { cat "$dir/other.log"; exit 1; }
  done
  echo "PASS: $case"
  ;;
bench_data_parallel)
  "$halfgrad" launch --nproc-per-node 2 --master-port "$port" -- bench lm --models lstm-8x1 --precisions fp32 \
    --batch 4 --device cpu --vocab 50 --bptt 5 --steps 3 --warmup 1 --out "$dir/lines.jsonl" > "$dir/lm.log" 2>&1 ||
    { cat "$dir/lm.log"; exit 1; }
  "$halfgrad" launch --nproc-per-node 2 --master-port "$port" -- bench resnet --models resnet18 --precisions fp32 \
    --batch 2 --device cpu --steps 2 --warmup 1 --out "$dir/lines.jsonl" > "$dir/resnet.log" 2>&1 ||
    { cat "$dir/resnet.log"; exit 1; }
  cat "$dir/lines.jsonl"
  python3 - "$dir/lines.jsonl" <<'PY' || exit 1
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
assert [l["suite"] for l in lines] == ["lm", "resnet"], "rank 0 alone writes, a line per configuration: %s" % lines
for l, items, unit in ((lines[0], 5 * 4, "tokens_per_second"), (lines[1], 2, "images_per_second")):
    assert l["world_size"] == 2 and l["global_batch"] == 2 * l["batch"], l
    assert l["replicas_agree"] is True and "replicas_differ" not in l, l
    # the group's throughput: both ranks' items a step
    assert abs(l[unit] - 2 * items / (l["ms"]["median"] / 1e3)) <= 1e-9 * l[unit], (l[unit], l["ms"])
    o = l["overlap"]
    assert o["buckets"] >= 1 and 0 <= o["hidden"] <= 1, o
    for key in ("backward_ms", "backward_no_sync_ms", "all_reduce_ms"):
        assert o[key] > 0, (key, o)
print("data-parallel bench lines:", [(l["suite"], l["overlap"]) for l in lines])
PY
  "$halfgrad" launch --nproc-per-node 2 --master-port "$port" -- "${lm[@]}" --epochs 1 --batch-size 4 \
    --check-replicas 2 > "$dir/checked.log" 2>&1 || { cat "$dir/checked.log"; exit 1; }
  "$halfgrad" "${lm[@]}" --epochs 1 --batch-size 4 --check-replicas 2 > "$dir/alone.log" 2>&1 &&
    { echo "--check-replicas ran without launch"; exit 1; }
  grep -q "check-replicas compares the ranks of a data-parallel run" "$dir/alone.log" || { cat "$dir/alone.log"; exit 1; }
  echo "PASS: $case"
  ;;
ranks_disagree)
  # Each rank as `halfgrad launch` would start it on a node of its own.
  two_ranks() {  # name, rank 0's arguments, "--", rank 1's
    local name=$1 zero=() one=() p0 p1 s0 s1
    shift
    while [[ $1 != -- ]]; do zero+=("$1"); shift; done
    shift
    one=("$@")
    local free
    free=$(python3 "$(dirname "$0")/free_port.py")
    local env=(WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$free)
    local start=$SECONDS
    timeout 60 env "${env[@]}" RANK=0 "$halfgrad" "${zero[@]}" > "$dir/$name.0.log" 2>&1 & p0=$!
    timeout 60 env "${env[@]}" RANK=1 "$halfgrad" "${one[@]}" > "$dir/$name.1.log" 2>&1 & p1=$!
    wait $p0; s0=$?
    wait $p1; s1=$?
    cat "$dir/$name.0.log" "$dir/$name.1.log"
    # 1: halfgrad's error. Gloo's abort would be 134, a wait for the collectives' 60 s timeout 124 or over 30 s.
    ((s0 == 1 && s1 == 1)) || { echo "$name: the ranks exited $s0 and $s1, not 1 and 1"; exit 1; }
    ((SECONDS - start <= 30)) || { echo "$name: the ranks took $((SECONDS - start)) s to stop"; exit 1; }
    ! grep -q "^epoch " "$dir/$name.0.log" || { echo "$name: rank 0 trained"; exit 1; }
  }
  expect() {  # name, the error every rank must print
    for r in 0 1; do
      grep -qF "$2" "$dir/$1.$r.log" || { echo "$1: rank $r did not say: $2"; exit 1; }
    done
  }
  # train-lm with another batch: the ranks' step counts differ.
  two_ranks lm "${lm[@]}" --epochs 1 --batch-size 4 -- "${lm[@]}" --epochs 1 --batch-size 3
  expect lm "train-lm: the ranks of this data-parallel run differ in --batch-size (4 on rank 0; 3 on rank 1); every"
  # train-classifier on two nodes' files, rank 1's with fewer images: 3 steps of 16 against 2.
  python3 - "$dir" <<'PY'
import os, random, sys
random.seed(2)
for node, n in (("node0", 96), ("node1", 64)):
    os.makedirs(os.path.join(sys.argv[1], node))
    for name, count in (("data_batch_1.bin", n), ("test_batch.bin", 20)):
        with open(os.path.join(sys.argv[1], node, name), "wb") as f:
            for _ in range(count):
                f.write(bytes([random.randrange(10)]) + os.urandom(3072))
PY
  classifier=(train-classifier --device cpu --model resnet18 --epochs 1 --batch-size 16 --workers 0 --log-interval 0)
  two_ranks cifar "${classifier[@]}" --data-dir "$dir/node0" -- "${classifier[@]}" --data-dir "$dir/node1"
  expect cifar "differ in training images (96 on rank 0; 64 on rank 1); every rank"
  # A node without the test split: its rank fails alone, and both stop with its reason.
  mkdir "$dir/node2" && cp "$dir/node0/data_batch_1.bin" "$dir/node2/"
  two_ranks missing "${classifier[@]}" --data-dir "$dir/node0" -- "${classifier[@]}" --data-dir "$dir/node2"
  expect missing "train-classifier: rank 1 of this data-parallel run could not start: "
  expect missing "test_batch.bin"
  echo "PASS: $case"
  ;;
killed_rank)
  "$halfgrad" launch --nproc-per-node 2 --master-port "$port" --grace-seconds 3 -- "${lm[@]}" --epochs 1000 \
    --batch-size 4 > "$dir/launch.log" 2>&1 &
  launcher=$!
  sleep 3
  victim=$(pgrep -P "$launcher" | tail -1)
  [[ -n $victim ]] || { echo "no rank running"; cat "$dir/launch.log"; exit 1; }
  start=$SECONDS
  kill -9 "$victim"
  wait "$launcher"
  status=$?
  cat "$dir/launch.log"
  ((status != 0)) || { echo "the launcher exited 0 after a rank was killed"; exit 1; }
  ((SECONDS - start <= 15)) || { echo "the other rank took $((SECONDS - start)) s to stop"; exit 1; }
  grep -qE "halfgrad launch: rank [01] \(local rank [01], pid $victim\) was killed by signal 9 \(Killed\); stopping the other ranks" \
    "$dir/launch.log" || { echo "the launcher did not name the killed rank"; exit 1; }
  echo "PASS: $case"
  ;;
*)
  echo "unknown case $case"
  exit 1
  ;;
esac

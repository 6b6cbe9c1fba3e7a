#!/usr/bin/env bash
# Starts N ranks of a process-group test on this machine, as a launcher would: RANK 0..N-1, WORLD_SIZE N,
# MASTER_ADDR 127.0.0.1 and a free MASTER_PORT, each running WORKER SCENARIO (tests/dist/worker.cpp). Prints every
# rank's output and "PASS: N ranks" when all of them exit 0.
#
#   bash tests/dist/run.sh build/halfgrad_dist_worker 3 collectives [gloo|nccl]
set -uo pipefail
worker=$1 n=$2 scenario=$3 backend=${4:-gloo}
port=$(python3 "$(dirname "$0")/free_port.py")
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
pids=()
for ((rank = 0; rank < n; rank++)); do
  RANK=$rank WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port OMP_NUM_THREADS=1 \
    "$worker" "$scenario" "$backend" > "$dir/rank$rank.log" 2>&1 &
  pids+=($!)
done
failed=0
for ((rank = 0; rank < n; rank++)); do
  wait "${pids[$rank]}"
  status=$?
  echo "--- rank $rank: exit $status"
  cat "$dir/rank$rank.log"
  ((status == 0)) || failed=1
done
if ((failed == 0)); then
  grep -qh "^SKIP:" "$dir"/rank*.log && echo "SKIPPED: $n ranks" || echo "PASS: $n ranks"
fi
exit $failed

#pragma once
// `halfgrad launch`: the processes of a data-parallel run on this machine, as torchrun starts them, and the other
// side: a halfgrad command that finds itself started so (WORLD_SIZE set) joins its process group.
//
//   halfgrad launch --nproc-per-node 2 -- train-classifier --device cuda --data-dir cifar-10-batches-bin
//   halfgrad launch --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr 10.0.0.1 -- train-lm --device cuda
#include <memory>
#include <string>
#include <vector>

#include "core/device.h"
#include "dist/process_group.h"

namespace halfgrad::cli {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1, node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  double grace_seconds = 10;  // after a rank fails: how long the others get to stop on SIGTERM before SIGKILL
};

// Starts nproc_per_node copies of this program running `command` (a halfgrad command and its options), each with
// RANK (node_rank * nproc_per_node + its local rank), LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and
// MASTER_PORT set, and waits for them. SIGINT and SIGTERM are passed on to every rank. When a rank fails (a non-zero
// exit or a signal), the launcher says which and how, sends the others SIGTERM, then SIGKILL after grace_seconds.
// Returns 0 when every rank exits 0, else the first failure's status (128 + the signal for a signal).
int launch(const LaunchOptions& options, const std::vector<std::string>& command);

// For a command started by a launcher (WORLD_SIZE is set): joins the run's process group, the nccl backend on
// cuda:LOCAL_RANK when `device` is CUDA (`device` becomes that GPU: each rank its own), gloo on the CPU; a rank other
// than 0 then writes nothing to stdout. Null when not launched (WORLD_SIZE unset): one process, `device` as it was.
std::shared_ptr<dist::ProcessGroup> join_launched_group(Device& device, const char* command);

// What a launcher told this process: "rank 3 of 4 (local rank 1 of 2), rendezvous at 127.0.0.1:29500"; empty when
// not launched (WORLD_SIZE unset).
std::string launched_environment();

}  // namespace halfgrad::cli

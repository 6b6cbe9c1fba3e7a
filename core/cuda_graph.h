#pragma once
// Whole-step CUDA graphs: a training step recorded once and replayed with one launch, so the host's time per step
// no longer grows with the number of kernels (a language model's step launches ~700; a ResNet's ~1,000).
//
//   cuda::Graph graph;
//   graph.capture(device, [&] { train_step(static_x, static_y); });  // records the work; runs nothing
//   for (auto [x, y] : batches) {
//     static_x.copy_(x);                                             // new data at the captured addresses
//     static_y.copy_(y);
//     graph.replay();
//   }
// or, for a training loop, CapturedStep below (eager warm-up steps, then capture, then replays).
//
// What a captured step needs, and what halfgrad does for it:
//   addresses   A replay launches the captured kernels with the captured pointers. The tensors the work allocates
//               come from blocks private to the graph (the caching allocator reuses a block only on the stream it
//               was made on, and keeps the graph's stream's blocks while the graph lives), so a replay finds them
//               where the capture left them. Tensors it reads from outside (parameters, the static inputs) must
//               stay alive and be written in place; tensors it returns are overwritten by every replay.
//   no host     item(), a copy to the CPU or a synchronisation inside the capture fail (the error says which
//   sync        call and what to do). The loss scaler, SGD and clip_grad_norm_ decide on the device.
//   host values A captured kernel keeps the values it was launched with. Code that reads a host value which
//               changes from step to step registers before_each_replay(update), which writes the value into
//               device memory the kernel reads: the random generator's seed and offset (dropout, so each replay
//               draws new masks from the same stream eager steps would), SGD's learning rate and momentum (so
//               schedulers keep working).
//   first-time  Autotuning (conv2d, batch_norm, the rnn op), cuBLAS's set-up and optimizer state created on a
//   work        first step must have happened: run the step eagerly first (CapturedStep does, `warmup` times).
//   shapes      A graph is one shape; a batch of another shape (the last, partial one) runs eagerly.
//
// Before the graph is instantiated, its small memset nodes (cuDNN queues one before most of its convolutions and
// batch norms) become kernel nodes that write the same bytes, around which a replay idles less (core/graph_memsets.h).
// HALFGRAD_CUDA_GRAPH_KEEP_MEMSETS=1 keeps them as captured.
#include <cstdint>
#include <functional>
#include <vector>

#include "core/cuda.h"
#include "core/tensor.h"

typedef struct CUgraphExec_st* cudaGraphExec_t;

namespace halfgrad::cuda {

class Graph {
 public:
  Graph() = default;
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  // Records the work `work` queues on `device` (which becomes its stream's work for the duration). Runs nothing:
  // replay() does. Throws halfgrad::Error, and leaves the graph empty, when the work cannot be captured
  // (OutOfMemory when the work ran out of memory).
  void capture(Device device, const std::function<void()>& work);
  // Runs the recorded work once, after the work queued so far on the device's current stream and before any
  // queued after it.
  void replay();
  bool captured() const { return exec_ != nullptr; }
  // Random counters one replay consumes (dropout's), advanced on the host generator at every replay.
  uint64_t random_counters() const { return random_counters_; }

 private:
  void release();

  int device_ = -1;
  cudaStream_t stream_ = nullptr;  // private to this graph: its blocks in the caching allocator are its pool
  cudaStream_t ambient_ = nullptr; // the stream current when the capture began
  cudaGraphExec_t exec_ = nullptr;
  Tensor random_state_;            // int64 [seed, offset] on the device, written before each replay
  uint64_t random_counters_ = 0;
  std::vector<std::function<void()>> before_replay_;
  friend void before_each_replay(std::function<void()> update);
  friend Tensor replay_input(const Shape& shape, TensorOptions options);
};

// Whether a Graph's capture is under way on this thread and on the device's current stream: work queued now runs at
// every replay, and what may call before_each_replay (a capture of the stream alone, as cuda::run_as_graph's, is not
// one; a CPU tensor's work runs now, once).
bool capturing_graph(Device device);
// Inside Graph::capture: `update` runs on the host before every replay of the graph being captured, with the graph's
// stream current, to write into device memory the host values that captured kernels read, or to do the host's
// bookkeeping of what a replay writes (version counters, autocast's kept casts, O2's synchronised versions). Hooks run
// in the order they were registered. An error outside a capture.
void before_each_replay(std::function<void()> update);
// Inside Graph::capture: an uninitialised tensor for such an update to write, allocated outside the graph's pool. (The
// update writes before the whole replay; memory of the pool may be reused by kernels earlier in the graph than the
// one that reads the value.) Keep it alive in the update.
Tensor replay_input(const Shape& shape, TensorOptions options);

// Autotuning's timer for work that runs inside captured steps: `run` once eagerly (its first-time work: nested
// autotuning, set-up), then `calls` runs captured into one graph, whose replays are timed with CUDA events (the
// median of 3); ms a run. The GPU's time alone, without the host's launches, which a replayed step does not pay
// (median_run_ms in core/cuda.h times eager calls, host included). Not inside another capture. It is median_run_ms
// where nothing can be captured: the allocator's caching off, or HALFGRAD_CUDA_LAUNCH_BLOCKING=1. Throws what the
// capture throws (OutOfMemory where the graph's pool, which cannot reuse the ambient stream's cached blocks, finds
// no memory at a step's peak).
float median_graph_ms(Device device, const std::function<void()>& run, const char* op, int calls);

// A training step for a loop: the first `warmup` calls run `step` eagerly, the next one captures it and every call
// from then on replays it. `step` reads its inputs from tensors the caller refills in place before each call.
class CapturedStep {
 public:
  CapturedStep(Device device, std::function<void()> step, int warmup = 3);
  void operator()();
  bool captured() const { return graph_.captured(); }

 private:
  Device device_;
  std::function<void()> step_;
  int warmup_;
  int calls_ = 0;
  Graph graph_;
};

}  // namespace halfgrad::cuda

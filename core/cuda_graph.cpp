// cuda::Graph and CapturedStep (core/cuda_graph.h). Compiled in every build; without CUDA they throw.
#include "core/cuda_graph.h"

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "core/cuda_allocator.h"
#include "core/error.h"
#include "core/log.h"
#include "core/random.h"

#if HALFGRAD_WITH_CUDA
#include <cuda_runtime.h>

#include "core/graph_memsets.h"
#endif

namespace halfgrad::cuda {

#if HALFGRAD_WITH_CUDA

namespace {

thread_local Graph* capturing = nullptr;  // the graph whose capture is under way on this thread

// HALFGRAD_CUDA_GRAPH_KEEP_MEMSETS=1 (read once): a captured graph keeps its memset nodes (for comparison).
bool keep_memsets() {
  static const bool keep = [] {
    const char* v = std::getenv("HALFGRAD_CUDA_GRAPH_KEEP_MEMSETS");
    return v && v[0] == '1';
  }();
  return keep;
}

// Orders `after` behind the work queued so far on `before` (both on the current device).
void order(cudaStream_t before, cudaStream_t after) {
  if (before == after) return;
  cudaEvent_t event = nullptr;
  HG_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cuda graph");
  HG_CUDA_CHECK(cudaEventRecord(event, before), "cuda graph");
  const cudaError_t waited = cudaStreamWaitEvent(after, event, 0);
  cudaEventDestroy(event);
  HG_CUDA_CHECK(waited, "cuda graph");
}

}  // namespace

Graph::~Graph() {
  try {
    release();
  } catch (...) {  // a destructor must not throw; the driver is the one to report a broken device
  }
}

void Graph::release() {
  if (stream_) {
    DeviceGuard guard(device_);
    HG_CUDA_CHECK(cudaStreamSynchronize(stream_), "cuda graph");
    if (exec_) cudaGraphExecDestroy(exec_);
    release_stream_blocks(device_, stream_);
    cudaStreamDestroy(stream_);
  }
  exec_ = nullptr;
  stream_ = nullptr;
  before_replay_.clear();
  random_state_ = Tensor();
}

void Graph::capture(Device device, const std::function<void()>& work) {
  HG_CHECK(device.is_cuda(), "cuda::Graph::capture: a CUDA device is needed, got {}", device.str());
  check_device(device.index, "cuda::Graph::capture");
  HG_CHECK(!captured(), "cuda::Graph::capture: this graph holds a capture already; use a new Graph");
  HG_CHECK(capturing == nullptr, "cuda::Graph::capture: another graph is being captured on this thread");
  HG_CHECK(caching(), "cuda::Graph::capture: the CUDA allocator's caching is off (HALFGRAD_CUDA_NO_CACHING or "
           "cuda::set_caching(false)), and a graph needs its blocks kept for its replays (the graph pool); turn "
           "caching on to capture");
  device_ = device.index;
  DeviceGuard guard(device_);
  const cudaStream_t ambient = current_stream(device_);
  ambient_ = ambient;
  // A blocking stream: it also keeps order with the legacy default stream, where eager work runs.
  HG_CUDA_CHECK(cudaStreamCreate(&stream_), "cuda graph");
  hold_stream_blocks(device_, stream_);
  random_state_ = zeros({2}, {.dtype = kInt64, .device = device});
  order(ambient, stream_);

  GraphGenerator generator{.device_state = reinterpret_cast<const uint64_t*>(random_state_.data_ptr())};
  cudaGraph_t graph = nullptr;
  {
    StreamGuard on_stream(device_, stream_);
    // Relaxed: the caching allocator may cudaMalloc a segment for the graph's pool during the capture (the other
    // modes refuse it); work queued on the capturing stream that waits for the GPU still fails.
    const cudaError_t began = cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed);
    if (began != cudaSuccess) {  // (an earlier asynchronous error, say) nothing is left pointing at this graph
      release();
      HG_CUDA_CHECK(began, "cuda graph");
    }
    capturing = this;
    set_graph_generator(&generator);
    auto abandon = [&] {
      cudaStreamEndCapture(stream_, &graph);
      if (graph) cudaGraphDestroy(graph);
      (void)cudaGetLastError();
      capturing = nullptr;
      set_graph_generator(nullptr);
    };
    try {
      work();
    } catch (const OutOfMemory& e) {  // still OutOfMemory: callers that search for the batch that fits catch it
      abandon();
      release();
      throw OutOfMemory(fmt::format("cuda::Graph::capture: out of memory while capturing: {}", e.what()));
    } catch (const Error& e) {
      abandon();
      release();
      throw Error(fmt::format(
          "cuda::Graph::capture: the work could not be captured: {}\nWork inside a capture must not wait for the "
          "GPU or read results on the host (item(), a copy to the CPU, synchronize), must not make random tensors "
          "on the host, and must have run eagerly once (autotuning, optimizer state). Run that part outside the "
          "capture, or run the step eagerly.",
          e.what()));
    } catch (...) {
      abandon();
      release();
      throw;
    }
    capturing = nullptr;
    set_graph_generator(nullptr);
    const cudaError_t ended = cudaStreamEndCapture(stream_, &graph);
    if (ended != cudaSuccess) {
      (void)cudaGetLastError();
      release();
      HG_CUDA_CHECK(ended, "cuda graph (the capture was invalidated: some work in it cannot be captured)");
    }
  }
  if (!keep_memsets()) {
    try {
      const MemsetsRewritten rewritten = memsets_as_kernels(graph);
      if (rewritten.nodes > 0) {
        logger().debug("cuda graph: {} memset nodes rewritten as kernel nodes ({} bytes)", rewritten.nodes,
                       rewritten.bytes);
      }
    } catch (const Error& e) {
      cudaGraphDestroy(graph);
      release();
      throw Error(fmt::format("{}\n(HALFGRAD_CUDA_GRAPH_KEEP_MEMSETS=1 captures without this rewrite)", e.what()));
    } catch (...) {
      cudaGraphDestroy(graph);
      release();
      throw;
    }
  }
  const cudaError_t instantiated = cudaGraphInstantiate(&exec_, graph, 0);
  cudaGraphDestroy(graph);
  if (instantiated != cudaSuccess) {
    exec_ = nullptr;
    release();
    HG_CUDA_CHECK(instantiated, "cuda graph");
  }
  random_counters_ = generator.used;
  order(stream_, ambient);
}

void Graph::replay() {
  HG_CHECK(captured(), "cuda::Graph::replay: nothing captured");
  DeviceGuard guard(device_);
  const cudaStream_t ambient = current_stream(device_);
  order(ambient, stream_);
  {
    StreamGuard on_stream(device_, stream_);
    if (random_counters_ > 0) {
      // This replay's counters: where the generator stands now; then the generator moves past them.
      const GeneratorState now = next_random_counters(random_counters_);
      // Fills (the values travel as kernel arguments): no staging buffer to wait for, unlike a copy from the host.
      random_state_.narrow(0, 0, 1).fill_(int64_t(now.seed));
      random_state_.narrow(0, 1, 1).fill_(int64_t(now.offset));
    }
    for (const auto& update : before_replay_) update();
    HG_CUDA_CHECK(cudaGraphLaunch(exec_, stream_), "cuda graph");
  }
  order(stream_, ambient);
}

bool capturing_graph(Device device) { return capturing != nullptr && is_capturing(device); }

void before_each_replay(std::function<void()> update) {
  HG_CHECK(capturing != nullptr, "cuda::before_each_replay: called outside a cuda::Graph capture");
  capturing->before_replay_.push_back(std::move(update));
}

Tensor replay_input(const Shape& shape, TensorOptions options) {
  HG_CHECK(capturing != nullptr, "cuda::replay_input: called outside a cuda::Graph capture");
  HG_CHECK(options.device.is_cuda() && options.device.index == capturing->device_,
           "cuda::replay_input: the graph is captured on cuda:{}, not on {}", capturing->device_, options.device.str());
  StreamGuard outside(capturing->device_, capturing->ambient_);  // a block of the ambient stream: not the pool's
  return empty(shape, options);
}

float median_graph_ms(Device device, const std::function<void()>& run, const char* op, int calls) {
  calls = std::max(calls, 1);
  // Where nothing can be captured: no graph pool without caching, a synchronising launch check.
  if (!caching() || launch_blocking()) return median_run_ms(device.index, run, op, calls);
  run();
  Graph graph;
  graph.capture(device, [&] {
    for (int i = 0; i < calls; ++i) run();
  });
  return median_run_ms(device.index, [&] { graph.replay(); }, op) / float(calls);
}

#else  // no CUDA in this build

Graph::~Graph() = default;
void Graph::release() {}
void Graph::capture(Device device, const std::function<void()>&) {
  HG_CHECK(device.is_cuda(), "cuda::Graph::capture: a CUDA device is needed, got {}", device.str());
  check_device(device.index, "cuda::Graph::capture");  // throws: this build has no CUDA
}
void Graph::replay() { throw Error("cuda::Graph::replay: this build of halfgrad has no CUDA"); }
bool capturing_graph(Device) { return false; }
void before_each_replay(std::function<void()>) {
  throw Error("cuda::before_each_replay: called outside a cuda::Graph capture (this build of halfgrad has no CUDA)");
}
Tensor replay_input(const Shape&, TensorOptions) {
  throw Error("cuda::replay_input: called outside a cuda::Graph capture (this build of halfgrad has no CUDA)");
}
float median_graph_ms(Device, const std::function<void()>&, const char*, int) {
  throw Error("cuda::median_graph_ms: this build of halfgrad has no CUDA");
}

#endif

CapturedStep::CapturedStep(Device device, std::function<void()> step, int warmup)
    : device_(device), step_(std::move(step)), warmup_(warmup) {
  HG_CHECK(device.is_cuda(), "cuda::CapturedStep: CUDA graphs need a CUDA device, got {}", device.str());
  check_device(device.index, "cuda::CapturedStep");
  HG_CHECK(warmup >= 1, "cuda::CapturedStep: at least one eager warm-up step is needed (got {})", warmup);
}

void CapturedStep::operator()() {
  if (calls_ < warmup_) {
    ++calls_;
    step_();
    return;
  }
  if (!graph_.captured()) graph_.capture(device_, step_);
  graph_.replay();
}

}  // namespace halfgrad::cuda

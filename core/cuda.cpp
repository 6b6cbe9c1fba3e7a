// The CUDA runtime layer (core/cuda.h): devices, streams, cuBLAS and cuDNN handles, timing, error checks.
// Compiled in every build; without HALFGRAD_WITH_CUDA it reports that no GPU is available.
#include "core/cuda.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <vector>

#include "core/error.h"

#if HALFGRAD_WITH_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>
#endif

namespace halfgrad::cuda {

namespace {
std::atomic<uint64_t> host_synchronization_count{0};
}  // namespace

uint64_t host_synchronizations() { return host_synchronization_count.load(); }
void detail::count_host_synchronization() { host_synchronization_count.fetch_add(1, std::memory_order_relaxed); }

namespace detail {
namespace {
// "CUDA error in exp: <name> (<text>) from <call> at <file>:<line>"
[[noreturn]] void throw_formatted(const char* library, const std::string& status, const char* call, const char* file,
                                  int line, const char* op) {
  std::string in_op = op ? fmt::format(" in {}", op) : std::string();
  HG_FAIL("{} error{}: {} from {} at {}:{}", library, in_op, status, call, file, line);
}
}  // namespace
}  // namespace detail

#if HALFGRAD_WITH_CUDA

namespace {
constexpr size_t kCublasWorkspaceBytes = size_t(32) << 20;  // cuBLAS's recommendation for Hopper

std::atomic<bool> tf32_allowed{false};

int count_devices() {
  static const int count = [] {
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // no driver / no device: not an error for the caller, just no GPU
      return 0;
    }
    return n;
  }();
  return count;
}

void require_a_device(const char* what) {
  HG_CHECK(count_devices() > 0, "{}: no CUDA device is available (no GPU or no driver)", what);
}

// The current stream of each device, per host thread; nullptr is the device's legacy default stream.
std::vector<cudaStream_t>& thread_streams() {
  thread_local std::vector<cudaStream_t> streams;
  if (streams.empty()) streams.assign(size_t(std::max(count_devices(), 1)), nullptr);
  return streams;
}

struct CublasState {
  cublasHandle_t handle = nullptr;
  cudaStream_t bound_stream = nullptr;
  void* workspace = nullptr;
};
}  // namespace

bool launch_blocking() {
  static const bool blocking = [] {
    const char* v = std::getenv("HALFGRAD_CUDA_LAUNCH_BLOCKING");
    return v && v[0] == '1';
  }();
  return blocking;
}

bool is_available() { return count_devices() > 0; }
int device_count() { return count_devices(); }

void check_device(int device, const char* op) {
  require_a_device(op);
  const int n = count_devices();
  HG_CHECK(device >= 0 && device < n, "{}: CUDA device {} does not exist ({} device{} visible)", op, device, n,
           n == 1 ? "" : "s");
}

Versions versions() {
  auto version = [](int v) { return fmt::format("{}.{}", v / 1000, v % 1000 / 10); };
  int driver = 0, runtime = 0;
  (void)cudaDriverGetVersion(&driver);
  (void)cudaRuntimeGetVersion(&runtime);
  const size_t dnn = cudnnGetVersion();
  return {driver > 0 ? version(driver) : "none", version(runtime),
          fmt::format("{}.{}.{}", dnn / 10000, dnn % 10000 / 100, dnn % 100)};
}

std::vector<std::string> describe_devices() {
  const Versions v = versions();
  std::vector<std::string> lines{fmt::format("CUDA driver {}, runtime {}, cuDNN {}", v.driver, v.runtime, v.cudnn)};
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess || n == 0) {
    (void)cudaGetLastError();
    lines.push_back(err != cudaSuccess ? fmt::format("GPUs: none visible ({}: {})", cudaGetErrorName(err),
                                                     cudaGetErrorString(err))
                                       : "GPUs: none visible");
    return lines;
  }
  for (int d = 0; d < n; ++d) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, d) != cudaSuccess) {
      (void)cudaGetLastError();
      lines.push_back(fmt::format("GPU {}: its properties could not be read", d));
      continue;
    }
    lines.push_back(fmt::format("GPU {}: {}, {:.1f} GiB, compute capability {}.{}, {} SMs", d, prop.name,
                                double(prop.totalGlobalMem) / double(1ull << 30), prop.major, prop.minor,
                                prop.multiProcessorCount));
  }
  return lines;
}

int current_device() {
  require_a_device("cuda::current_device");
  int d = 0;
  HG_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

void set_device(int device) {
  check_device(device, "cuda::set_device");
  HG_CUDA_CHECK(cudaSetDevice(device));
}

std::string device_name(int device) {
  check_device(device, "cuda::device_name");
  cudaDeviceProp prop{};
  HG_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return prop.name;
}

namespace {
int device_attribute(int device, cudaDeviceAttr attribute) {
  thread_local std::map<std::pair<int, cudaDeviceAttr>, int> values;
  const std::pair key{device, attribute};
  if (auto it = values.find(key); it != values.end()) return it->second;
  check_device(device, "cuda::device_attribute");
  int value = 0;
  HG_CUDA_CHECK(cudaDeviceGetAttribute(&value, attribute, device));
  return values.emplace(key, value).first->second;
}
}  // namespace

int multiprocessor_count(int device) { return device_attribute(device, cudaDevAttrMultiProcessorCount); }
int compute_capability(int device) {
  return device_attribute(device, cudaDevAttrComputeCapabilityMajor) * 10 +
         device_attribute(device, cudaDevAttrComputeCapabilityMinor);
}

void synchronize() {
  require_a_device("cuda::synchronize");
  detail::count_host_synchronization();
  HG_CUDA_CHECK(cudaDeviceSynchronize());
}

void synchronize(int device) {
  check_device(device, "cuda::synchronize");  // the guard would pass over a negative index, and name itself
  DeviceGuard guard(device);
  detail::count_host_synchronization();
  HG_CUDA_CHECK(cudaDeviceSynchronize());
}

DeviceGuard::DeviceGuard(int device) {
  if (device < 0) return;
  int current = 0;
  const cudaError_t got = cudaGetDevice(&current);
  // Checked only off the common path (a guard per op): no driver or GPU is named as such, not by the driver's code.
  if (got != cudaSuccess) check_device(device, "cuda::DeviceGuard");
  HG_CUDA_CHECK(got);
  if (current != device) {
    check_device(device, "cuda::DeviceGuard");
    HG_CUDA_CHECK(cudaSetDevice(device));
    previous_ = current;
  }
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) (void)cudaSetDevice(previous_);  // destructors must not throw
}

cudaStream_t current_stream(int device) {
  check_device(device, "cuda::current_stream");
  return thread_streams()[size_t(device)];
}

void set_stream(int device, cudaStream_t stream) {
  check_device(device, "cuda::set_stream");
  thread_streams()[size_t(device)] = stream;
}

void synchronize_stream(int device) {
  check_device(device, "cuda::synchronize_stream");
  DeviceGuard guard(device);
  detail::count_host_synchronization();
  HG_CUDA_CHECK(cudaStreamSynchronize(current_stream(device)));
}

bool is_capturing(int device) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  // Asking about the legacy default stream fails while another thread captures in global mode; that stream is
  // not being captured itself.
  if (cudaStreamIsCapturing(current_stream(device), &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return status != cudaStreamCaptureStatusNone;
}

StreamGuard::StreamGuard(int device, cudaStream_t stream) : device_(device), previous_(current_stream(device)) {
  set_stream(device, stream);
}
StreamGuard::~StreamGuard() { thread_streams()[size_t(device_)] = previous_; }

cublasHandle_t cublas_handle(int device) {
  check_device(device, "cuda::cublas_handle");
  // One handle per device and host thread: cuBLAS handles must not be shared by threads that use them at
  // the same time. They live until the process exits (destroying them at exit races the driver's teardown).
  thread_local std::vector<CublasState> states;
  if (states.empty()) states.resize(size_t(count_devices()));
  CublasState& s = states[size_t(device)];
  cudaStream_t stream = current_stream(device);
  if (!s.handle) {
    HG_CUBLAS_CHECK(cublasCreate(&s.handle));
    // float16/bfloat16 products accumulate in float32 all the way: no split-K reduction in half precision.
    // (TF32 for float32 is chosen per call through the compute type, see ops/matmul.cu.)
    HG_CUBLAS_CHECK(cublasSetMathMode(s.handle, cublasMath_t(CUBLAS_DEFAULT_MATH |
                                                             CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
    HG_CUDA_CHECK(cudaMalloc(&s.workspace, kCublasWorkspaceBytes), "cublas workspace");
    s.bound_stream = reinterpret_cast<cudaStream_t>(-1);  // forces the binding below
  }
  if (s.bound_stream != stream) {
    HG_CUBLAS_CHECK(cublasSetStream(s.handle, stream));
    // cublasSetStream resets the workspace to cuBLAS's own pool: set ours again after every change.
    HG_CUBLAS_CHECK(cublasSetWorkspace(s.handle, s.workspace, kCublasWorkspaceBytes));
    s.bound_stream = stream;
  }
  return s.handle;
}

cudnnHandle_t cudnn_handle(int device) {
  check_device(device, "cuda::cudnn_handle");
  // As cuBLAS's: one per device and host thread, never destroyed.
  thread_local std::vector<cudnnHandle_t> handles;
  if (handles.empty()) handles.resize(size_t(count_devices()));
  cudnnHandle_t& handle = handles[size_t(device)];
  if (!handle) HG_CUDNN_CHECK(cudnnCreate(&handle));
  HG_CUDNN_CHECK(cudnnSetStream(handle, current_stream(device)));
  return handle;
}

namespace {
// A CUDA event, destroyed with its owner (also when the timed call throws).
struct Event {
  cudaEvent_t event = nullptr;
  explicit Event(const char* op) { HG_CUDA_CHECK(cudaEventCreate(&event), op); }
  ~Event() { cudaEventDestroy(event); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
};
}  // namespace

float median_run_ms(int device, const std::function<void()>& run, const char* op, int calls) {
  calls = std::max(calls, 1);
  const cudaStream_t stream = current_stream(device);
  run();
  const Event start(op), stop(op);
  std::array<float, 3> ms{};
  for (float& t : ms) {
    HG_CUDA_CHECK(cudaEventRecord(start.event, stream), op);
    for (int i = 0; i < calls; ++i) run();
    HG_CUDA_CHECK(cudaEventRecord(stop.event, stream), op);
    detail::count_host_synchronization();
    HG_CUDA_CHECK(cudaEventSynchronize(stop.event), op);
    HG_CUDA_CHECK(cudaEventElapsedTime(&t, start.event, stop.event), op);
  }
  std::sort(ms.begin(), ms.end());
  return ms[1] / float(calls);
}

namespace {

struct CachedGraph {
  cudaGraphExec_t exec = nullptr;
  uint64_t last_use = 0;
};

// Per host thread, never destroyed (as the handles: destroying at exit races the driver's teardown); so a thread
// that ends leaves its graphs (at most kMaxCachedGraphs) and capture streams behind.
struct GraphCache {
  std::map<std::pair<int, std::vector<uint64_t>>, CachedGraph> graphs;
  uint64_t uses = 0;
  std::vector<cudaStream_t> capture_streams;  // per device: the legacy default stream cannot be captured
};

constexpr size_t kMaxCachedGraphs = 64;

cudaGraphExec_t capture(int device, const std::function<void()>& launches, GraphCache& cache) {
  if (cache.capture_streams.empty()) cache.capture_streams.resize(size_t(count_devices()), nullptr);
  cudaStream_t& side = cache.capture_streams[size_t(device)];
  if (!side) HG_CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), "cuda graph");
  cudaGraph_t graph = nullptr;
  {
    StreamGuard on_side(device, side);
    HG_CUDA_CHECK(cudaStreamBeginCapture(side, cudaStreamCaptureModeThreadLocal), "cuda graph");
    try {
      launches();
    } catch (...) {
      cudaStreamEndCapture(side, &graph);
      if (graph) cudaGraphDestroy(graph);
      (void)cudaGetLastError();
      throw;
    }
    HG_CUDA_CHECK(cudaStreamEndCapture(side, &graph), "cuda graph");
  }
  cudaGraphExec_t exec = nullptr;
  const cudaError_t instantiated = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  HG_CUDA_CHECK(instantiated, "cuda graph");
  return exec;
}

}  // namespace

void run_as_graph(int device, const std::vector<uint64_t>& key, const std::function<void()>& launches) {
  DeviceGuard guard(device);
  const cudaStream_t stream = current_stream(device);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  // Asking fails on the legacy default stream while another thread captures in global mode: run directly then.
  const bool asked = cudaStreamIsCapturing(stream, &status) == cudaSuccess;
  if (!asked) (void)cudaGetLastError();
  if (!asked || status != cudaStreamCaptureStatusNone || launch_blocking()) return launches();
  static thread_local GraphCache& cache = *new GraphCache;
  auto it = cache.graphs.find({device, key});
  if (it == cache.graphs.end()) {
    cudaGraphExec_t exec = nullptr;
    try {
      exec = capture(device, launches, cache);
    } catch (const Error&) {
      // Work that cannot be captured (a library call the capture refuses) still runs, uncaptured; nothing ran
      // during the failed capture. If the work itself is at fault, this raises its error again.
      (void)cudaGetLastError();
      return launches();
    }
    if (cache.graphs.size() >= kMaxCachedGraphs) {
      auto by_use = [](const auto& a, const auto& b) { return a.second.last_use < b.second.last_use; };
      auto oldest = std::min_element(cache.graphs.begin(), cache.graphs.end(), by_use);
      cudaGraphExecDestroy(oldest->second.exec);
      cache.graphs.erase(oldest);
    }
    it = cache.graphs.emplace(std::pair{device, key}, CachedGraph{exec, 0}).first;
  }
  it->second.last_use = ++cache.uses;
  HG_CUDA_CHECK(cudaGraphLaunch(it->second.exec, stream), "cuda graph");
}

void set_allow_tf32(bool allow) { tf32_allowed = allow; }
bool allow_tf32() { return tf32_allowed; }

namespace detail {

void throw_cuda_error(int status, const char* call, const char* file, int line, const char* op) {
  auto e = static_cast<cudaError_t>(status);
  // Reset the runtime's last error: a non-sticky error the caller catches must not resurface at the next
  // launch check, attributed to another op. (A sticky error, a crashed kernel, stays: the context is dead.)
  (void)cudaGetLastError();
  throw_formatted("CUDA", fmt::format("{} ({})", cudaGetErrorName(e), cudaGetErrorString(e)), call, file, line, op);
}

void throw_cublas_error(int status, const char* call, const char* file, int line, const char* op) {
  auto s = static_cast<cublasStatus_t>(status);
  throw_formatted("cuBLAS", fmt::format("{} ({})", cublasGetStatusName(s), cublasGetStatusString(s)), call, file,
                  line, op);
}

void throw_cudnn_error(int status, const char* call, const char* file, int line, const char* op) {
  auto s = static_cast<cudnnStatus_t>(status);
  throw_formatted("cuDNN", fmt::format("{} ({})", cudnnGetErrorString(s), status), call, file, line, op);
}

void check_launch(const char* file, int line, const char* op) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw_cuda_error(int(err), "kernel launch", file, line, op);
  if (launch_blocking()) {
    err = cudaDeviceSynchronize();
    if (err != cudaSuccess) throw_cuda_error(int(err), "kernel execution (HALFGRAD_CUDA_LAUNCH_BLOCKING)", file, line, op);
  }
}

}  // namespace detail

#else  // no CUDA in this build

namespace {
[[noreturn]] void no_cuda(const char* what) {
  HG_FAIL("{}: halfgrad was built without CUDA (configure with -DHALFGRAD_CUDA=ON on a machine with nvcc)", what);
}
}  // namespace

bool is_available() { return false; }
int device_count() { return 0; }
void check_device(int, const char* op) { no_cuda(op); }
std::vector<std::string> describe_devices() { return {"CUDA backend: not compiled in", "GPUs: none visible"}; }
Versions versions() { return {"none", "none", "none"}; }
int current_device() { no_cuda("cuda::current_device"); }
void set_device(int) { no_cuda("cuda::set_device"); }
std::string device_name(int) { no_cuda("cuda::device_name"); }
int multiprocessor_count(int) { no_cuda("cuda::multiprocessor_count"); }
int compute_capability(int) { no_cuda("cuda::compute_capability"); }
void synchronize() { no_cuda("cuda::synchronize"); }
void synchronize(int) { no_cuda("cuda::synchronize"); }
DeviceGuard::DeviceGuard(int device) {
  if (device >= 0) no_cuda("cuda::DeviceGuard");
}
DeviceGuard::~DeviceGuard() = default;
cudaStream_t current_stream(int) { no_cuda("cuda::current_stream"); }
void set_stream(int, cudaStream_t) { no_cuda("cuda::set_stream"); }
void synchronize_stream(int) { no_cuda("cuda::synchronize_stream"); }
bool is_capturing(int) { return false; }
StreamGuard::StreamGuard(int, cudaStream_t) : device_(0), previous_(nullptr) { no_cuda("cuda::StreamGuard"); }
StreamGuard::~StreamGuard() = default;
cublasHandle_t cublas_handle(int) { no_cuda("cuda::cublas_handle"); }
cudnnHandle_t cudnn_handle(int) { no_cuda("cuda::cudnn_handle"); }
float median_run_ms(int, const std::function<void()>&, const char*, int) { no_cuda("cuda::median_run_ms"); }
bool launch_blocking() { return false; }
void run_as_graph(int, const std::vector<uint64_t>&, const std::function<void()>&) { no_cuda("cuda::run_as_graph"); }
void set_allow_tf32(bool) {}
bool allow_tf32() { return false; }

namespace detail {
void throw_cuda_error(int status, const char* call, const char* file, int line, const char* op) {
  throw_formatted("CUDA", fmt::format("error {}", status), call, file, line, op);
}
void throw_cublas_error(int status, const char* call, const char* file, int line, const char* op) {
  throw_formatted("cuBLAS", fmt::format("status {}", status), call, file, line, op);
}
void throw_cudnn_error(int status, const char* call, const char* file, int line, const char* op) {
  throw_formatted("cuDNN", fmt::format("status {}", status), call, file, line, op);
}
void check_launch(const char*, int, const char*) {}
}  // namespace detail

#endif

}  // namespace halfgrad::cuda

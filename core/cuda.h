#pragma once
// The CUDA runtime layer: devices, the current stream of each device, the cuBLAS and cuDNN handles of each
// device, timing for autotuning, and checked calls.
//
// This header includes no CUDA header, so any file may include it, in a build with or without CUDA. In a
// build without CUDA (HALFGRAD_WITH_CUDA undefined) is_available() is false, device_count() is 0 and
// the other functions throw halfgrad::Error.
//
// Every CUDA, cuBLAS and cuDNN call in halfgrad goes through a check, and so does every kernel launch:
//
//   HG_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, stream));
//   HG_CUBLAS_CHECK(cublasGemmStridedBatchedEx(...), "matmul");   // the op's name is optional
//   my_kernel<<<grid, block, 0, stream>>>(...);
//   HG_CUDA_CHECK_LAUNCH("exp");                                   // after every launch
//
// A failure throws halfgrad::Error naming the call, file:line, the op (when given) and the error, e.g.
//   "CUDA error in exp: cudaErrorInvalidConfiguration (invalid configuration argument) from kernel launch
//    at ops/elementwise.cu:212"
// Kernel errors surface asynchronously, at a later call; with the environment variable
// HALFGRAD_CUDA_LAUNCH_BLOCKING=1 every launch check synchronizes, so the error names the right kernel.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/device.h"

// The handle types, declared the way the CUDA headers declare them (a repeated identical typedef is
// legal C++), so that this header needs none of them.
typedef struct CUstream_st* cudaStream_t;
typedef struct cublasContext* cublasHandle_t;
typedef struct cudnnContext* cudnnHandle_t;

namespace halfgrad::cuda {

// ---- devices
bool is_available();  // built with CUDA, a driver is loaded and at least one GPU is visible
int device_count();   // 0 without a driver or GPU; never throws
// HALFGRAD_CUDA_LAUNCH_BLOCKING=1 (read once): every launch check waits for its kernel, which no capture allows.
bool launch_blocking();
// An error naming `op` unless GPU `device` is there: none without a driver or a GPU, or an index past those visible.
void check_device(int device, const char* op);
int current_device();
void set_device(int device);
std::string device_name(int device);  // "NVIDIA H200"
// Asked once per device and host thread, then cached: kernels size their grids by the SM count on every launch.
int multiprocessor_count(int device);  // 132 on an H200
int compute_capability(int device);    // major * 10 + minor: 90 on an H200
// Synchronizes the whole device (every stream): the host waits until all work queued on it is done.
void synchronize();            // the current device
void synchronize(int device);

// What `halfgrad info` prints about CUDA: the driver, runtime and cuDNN versions, then a line per visible GPU (its
// index, name, memory, compute capability and SMs), or why none is visible. Never throws.
std::vector<std::string> describe_devices();
// The versions describe_devices() starts with: "13.0", "13.0", "9.14.0" ("none" where there is no driver, or no CUDA
// in this build). Never throws.
struct Versions {
  std::string driver, runtime, cudnn;
};
Versions versions();

// Sets the current device for a scope and restores the previous one (does nothing for a CPU device).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  explicit DeviceGuard(Device device) : DeviceGuard(device.is_cuda() ? device.index : -1) {}
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// ---- streams
// Each device has a current stream, per host thread, on which every kernel, copy and library call for
// that device is queued. It starts as the device's default (legacy) stream, nullptr.
cudaStream_t current_stream(int device);
inline cudaStream_t current_stream(Device device) { return current_stream(device.index); }
void set_stream(int device, cudaStream_t stream);
inline void set_stream(Device device, cudaStream_t stream) { set_stream(device.index, stream); }
// The host waits for the work queued so far on the current stream of `device` (not the other streams).
void synchronize_stream(int device);
// How many times halfgrad has made the host wait for a GPU so far in this process: synchronize, synchronize_stream,
// every copy to the host (item() included) and autotuning's timings. For tests and benchmarks that check a training
// loop waits for nothing (a replayed CUDA graph, the loss scaler's device-side decisions).
uint64_t host_synchronizations();
namespace detail {
void count_host_synchronization();
}
// Whether the current stream of `device` is being captured into a CUDA graph (cuda::Graph): work queued now is
// recorded, not run, so nothing may wait for it or read its results on the host. False for a CPU device.
bool is_capturing(int device);
inline bool is_capturing(Device device) { return device.is_cuda() && is_capturing(device.index); }

// Makes `stream` current on `device` for a scope.
class StreamGuard {
 public:
  StreamGuard(int device, cudaStream_t stream);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  int device_;
  cudaStream_t previous_;
};

// ---- cuBLAS
// The cuBLAS handle of `device` (created on first use, one per device and host thread), bound to the
// device's current stream and with its workspace set. The caller must have made `device` current.
cublasHandle_t cublas_handle(int device);

// ---- cuDNN
// The cuDNN handle of `device` (created on first use, one per device and host thread), bound to the device's
// current stream. The caller must have made `device` current.
cudnnHandle_t cudnn_handle(int device);

// ---- autotuning
// The milliseconds one call of `run` takes on the current stream of `device`: one warm-up call, then the
// median of three samples, each `calls` back-to-back calls between two CUDA events (several calls per sample
// when one call is short enough for the host's launch jitter to show). Waits for the stream. Throws what
// `run` throws. Used where a problem has several implementations and the fastest is kept (conv2d; batch_norm
// times graph replays instead: cuda::median_graph_ms in core/cuda_graph.h).
float median_run_ms(int device, const std::function<void()>& run, const char* op, int calls = 1);

// ---- graphs
// Runs `launches` (work queued on the current stream of `device`: kernels and cuBLAS calls, no allocation, no
// synchronisation, no host-side effect) as one CUDA graph: the first time `key` is met on this host thread the work
// is captured and instantiated, later it is replayed with one launch. The key must name everything the work depends
// on: sizes, dtypes and every device pointer, since a replay launches the captured kernels with the captured
// arguments (values are read when the graph runs, so new data at the same addresses is fine). Used where many
// small launches repeat from step to step (the time loop of ops/rnn.cpp), where the launches, not the GPU, bound
// the time. The 64 graphs used last are kept per thread. The work runs directly, uncaptured, when the stream is
// already being captured (it then joins that graph) or with HALFGRAD_CUDA_LAUNCH_BLOCKING=1.
void run_as_graph(int device, const std::vector<uint64_t>& key, const std::function<void()>& launches);

// float32 matmul precision: false (the default) computes in full float32; true lets cuBLAS use TF32
// tensor cores (10-bit mantissa products, float32 accumulation), several times faster on Ampere+.
void set_allow_tf32(bool allow);
bool allow_tf32();

// ---- error checking (the macros below call these on failure only)
namespace detail {
[[noreturn]] void throw_cuda_error(int status, const char* call, const char* file, int line, const char* op);
[[noreturn]] void throw_cublas_error(int status, const char* call, const char* file, int line, const char* op);
[[noreturn]] void throw_cudnn_error(int status, const char* call, const char* file, int line, const char* op);
// After a kernel launch: throws on a launch error; with HALFGRAD_CUDA_LAUNCH_BLOCKING=1 also synchronizes
// and throws on an execution error.
void check_launch(const char* file, int line, const char* op);
constexpr const char* op_name() { return nullptr; }
constexpr const char* op_name(const char* op) { return op; }
}  // namespace detail

}  // namespace halfgrad::cuda

// HG_CUDA_CHECK(call) or HG_CUDA_CHECK(call, op_name): throws halfgrad::Error unless call returns cudaSuccess.
#define HG_CUDA_CHECK(call, ...)                                                                          \
  do {                                                                                                    \
    auto hg_status_ = (call);                                                                             \
    if (static_cast<int>(hg_status_) != 0)                                                                \
      ::halfgrad::cuda::detail::throw_cuda_error(static_cast<int>(hg_status_), #call, __FILE__, __LINE__, \
                                                 ::halfgrad::cuda::detail::op_name(__VA_ARGS__));         \
  } while (0)

// As HG_CUDA_CHECK, for calls that return a cublasStatus_t.
#define HG_CUBLAS_CHECK(call, ...)                                                                          \
  do {                                                                                                      \
    auto hg_status_ = (call);                                                                               \
    if (static_cast<int>(hg_status_) != 0)                                                                  \
      ::halfgrad::cuda::detail::throw_cublas_error(static_cast<int>(hg_status_), #call, __FILE__, __LINE__, \
                                                   ::halfgrad::cuda::detail::op_name(__VA_ARGS__));         \
  } while (0)

// As HG_CUDA_CHECK, for calls that return a cudnnStatus_t.
#define HG_CUDNN_CHECK(call, ...)                                                                          \
  do {                                                                                                     \
    auto hg_status_ = (call);                                                                              \
    if (static_cast<int>(hg_status_) != 0)                                                                 \
      ::halfgrad::cuda::detail::throw_cudnn_error(static_cast<int>(hg_status_), #call, __FILE__, __LINE__, \
                                                  ::halfgrad::cuda::detail::op_name(__VA_ARGS__));         \
  } while (0)

// Right after every kernel launch: HG_CUDA_CHECK_LAUNCH("exp").
#define HG_CUDA_CHECK_LAUNCH(op) ::halfgrad::cuda::detail::check_launch(__FILE__, __LINE__, op)

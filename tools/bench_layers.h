#pragma once
// What the layer benchmarks (bench_conv, bench_batch_norm) share: their common options, the loop over dtypes and
// layouts, and step timing (CUDA events around each step on the current stream, medians). Header-only.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/cuda.h"
#include "core/error.h"
#include "core/tensor.h"

#if HALFGRAD_WITH_CUDA
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>
#endif

namespace halfgrad::bench {

struct LayerSettings {
  int64_t batch = 256;
  int iters = 50;
  int warmup = 10;
  std::string net = "all", dtype = "all", layout = "all";
};

inline void add_layer_options(CLI::App& app, LayerSettings& s) {
  app.add_option("--batch", s.batch, "batch size")->check(CLI::PositiveNumber);
  app.add_option("--iters", s.iters, "timed steps per row (the median is printed)")->check(CLI::PositiveNumber);
  app.add_option("--warmup", s.warmup, "untimed steps before timing (the first one autotunes cuDNN)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--net", s.net, "resnet18, resnet50 or all")->check(CLI::IsMember({"all", "resnet18", "resnet50"}));
  app.add_option("--dtype", s.dtype, "fp32, fp16 or all")->check(CLI::IsMember({"all", "fp32", "fp16"}));
  app.add_option("--layout", s.layout, "nchw, nhwc or all")->check(CLI::IsMember({"all", "nchw", "nhwc"}));
}

// Calls fn(dtype, "fp32"/"fp16", format, "NCHW"/"NHWC") for the cases the settings select, in the rows' order.
template <typename Fn> void for_each_case(const LayerSettings& s, Fn&& fn) {
  for (DType dtype : {kFloat32, kFloat16}) {
    const char* dname = dtype == kFloat32 ? "fp32" : "fp16";
    if (s.dtype != "all" && s.dtype != dname) continue;
    for (MemoryFormat format : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
      const bool nchw = format == MemoryFormat::Contiguous;
      if (s.layout != "all" && s.layout != (nchw ? "nchw" : "nhwc")) continue;
      fn(dtype, dname, format, nchw ? "NCHW" : "NHWC");
    }
  }
}

// main's last step: run() when a GPU is there (its errors printed as "<program>: <what>", exit code 1); 1 when
// there is none or halfgrad was built without its CUDA backend.
template <typename Run> int run_on_gpu(const char* program, Run&& run) {
  if (!cuda::is_available()) {
#if HALFGRAD_WITH_CUDA
    fmt::print(stderr, "{}: no CUDA GPU is visible (cuda::device_count() = {}); this benchmark needs one.\n", program,
               cuda::device_count());
#else
    fmt::print(stderr, "{}: this halfgrad was built without the CUDA backend (HALFGRAD_CUDA=OFF or no CUDA toolkit/cuDNN "
               "found); this benchmark needs a CUDA build and a GPU.\n", program);
#endif
    return 1;
  }
  try {
    return run();
  } catch (const Error& e) {
    fmt::print(stderr, "{}: {}\n", program, e.what());
    return 1;
  }
}

#if HALFGRAD_WITH_CUDA

struct StepTimes {
  double ms = 0;       // median, between the events around a step
  double host_ms = 0;  // median wall time the host took to issue one step (its launches, not their work)
};

// Runs `step` `warmup` times, then `iters` times between two events each. Steps are not synchronized one by
// one, so the events time a step by its kernels when the host issues them faster than they run, and by the host
// when it cannot keep the GPU fed: `ms` is the larger of the two, host_ms says which one it was. The timed steps
// are the profiler's range: `ncu --profile-from-start off` (or nsys's --capture-range=cudaProfilerApi) sees only them.
template <typename Step> StepTimes time_steps(Step&& step, int warmup, int iters) {
  const cudaStream_t stream = cuda::current_stream(0);
  auto check = [](cudaError_t status, const char* what) {
    HG_CHECK(status == cudaSuccess, "bench: {} failed: {}", what, cudaGetErrorString(status));
  };
  for (int i = 0; i < warmup; ++i) step();
  cuda::synchronize();
  std::vector<cudaEvent_t> start(static_cast<size_t>(iters)), stop(static_cast<size_t>(iters));
  for (int i = 0; i < iters; ++i) {
    check(cudaEventCreate(&start[size_t(i)]), "cudaEventCreate");
    check(cudaEventCreate(&stop[size_t(i)]), "cudaEventCreate");
  }
  std::vector<double> host(static_cast<size_t>(iters)), gpu(static_cast<size_t>(iters));
  check(cudaProfilerStart(), "cudaProfilerStart");
  for (int i = 0; i < iters; ++i) {
    check(cudaEventRecord(start[size_t(i)], stream), "cudaEventRecord");
    const auto t0 = std::chrono::steady_clock::now();
    step();
    host[size_t(i)] = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    check(cudaEventRecord(stop[size_t(i)], stream), "cudaEventRecord");
  }
  cuda::synchronize();
  check(cudaProfilerStop(), "cudaProfilerStop");
  for (int i = 0; i < iters; ++i) {
    float t = 0;
    check(cudaEventElapsedTime(&t, start[size_t(i)], stop[size_t(i)]), "cudaEventElapsedTime");
    gpu[size_t(i)] = t;
    cudaEventDestroy(start[size_t(i)]);
    cudaEventDestroy(stop[size_t(i)]);
  }
  auto median = [](std::vector<double>& v) {
    std::nth_element(v.begin(), v.begin() + std::ptrdiff_t(v.size() / 2), v.end());
    return v[v.size() / 2];
  };
  return {median(gpu), median(host)};
}
#endif  // HALFGRAD_WITH_CUDA

}  // namespace halfgrad::bench

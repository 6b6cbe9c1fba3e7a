// bench_optim: the fused optimizer step over ResNet-50's parameters (161 tensors, 25,557,032 elements).
// A benchmark program, not a test: it prints a table. tools/bench_optim_torch.py prints the same rows for
// PyTorch's foreach and fused implementations on the same GPU (docs/benchmarks.md has both).
//
//   bench_optim [--device cuda|cpu] [--dtype float32|float16|bfloat16] [--repeats 100]
//
// Each row is the median over `--repeats` steps (after warm-up steps) of one optimizer.step() (or one
// clip_grad_norm_), timed on the GPU with CUDA events around the call: the figure includes whatever the
// host adds (argument packing, launch latency) when the GPU waits for it. GB/s counts the bytes the step
// must move: SGD with momentum reads p, g, b and writes p, b (5 accesses per element); Adam/AdamW read p, g,
// m, v and write p, m, v (7); RMSprop p, g, square_avg (5), centered with momentum also grad_avg and b (9); Adagrad
// p, g, sum (5); clip_grad_norm_ reads g twice and writes it once (3).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/cuda.h"
#include "halfgrad.h"
#include "optim/adagrad.h"
#include "optim/adam.h"
#include "optim/clip_grad.h"
#include "optim/rmsprop.h"
#include "optim/sgd.h"
#include "tools/cli_checks.h"

#if HALFGRAD_WITH_CUDA
#include <cuda_runtime.h>
#endif

using namespace halfgrad;

namespace {

// ResNet-50's parameters in torchvision's order (conv weights without bias, then BatchNorm weight and
// bias), written out from the architecture: a 7x7 stem, then stages of [3, 4, 6, 3] bottleneck blocks
// (1x1 reduce, 3x3, 1x1 expand by 4; a 1x1 projection shortcut in each stage's first block), then the
// 2048 -> 1000 classifier.
std::vector<Shape> resnet50_parameter_shapes() {
  std::vector<Shape> shapes;
  auto conv_bn = [&](int64_t out, int64_t in, int64_t k) {
    shapes.push_back({out, in, k, k});  // conv.weight
    shapes.push_back({out});            // bn.weight
    shapes.push_back({out});            // bn.bias
  };
  conv_bn(64, 3, 7);  // conv1, bn1
  int64_t in = 64;
  const int64_t blocks[] = {3, 4, 6, 3};
  const int64_t widths[] = {64, 128, 256, 512};
  for (int stage = 0; stage < 4; ++stage) {
    const int64_t width = widths[stage], out = 4 * width;
    for (int64_t b = 0; b < blocks[stage]; ++b) {
      conv_bn(width, in, 1);     // conv1 / bn1
      conv_bn(width, width, 3);  // conv2 / bn2
      conv_bn(out, width, 1);    // conv3 / bn3
      if (b == 0) conv_bn(out, in, 1);  // downsample.0 / downsample.1
      in = out;
    }
  }
  shapes.push_back({1000, 2048});  // fc.weight
  shapes.push_back({1000});        // fc.bias
  return shapes;
}

// Median milliseconds of fn over `repeats` runs after `warmup` runs.
double median_ms(Device device, const std::function<void()>& fn, int repeats, int warmup) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> times;
#if HALFGRAD_WITH_CUDA
  if (device.is_cuda()) {
    cudaEvent_t start, stop;
    HG_CUDA_CHECK(cudaEventCreate(&start));
    HG_CUDA_CHECK(cudaEventCreate(&stop));
    cudaStream_t stream = cuda::current_stream(device);
    for (int i = 0; i < repeats; ++i) {
      cuda::synchronize_stream(device.index);
      HG_CUDA_CHECK(cudaEventRecord(start, stream));
      fn();
      HG_CUDA_CHECK(cudaEventRecord(stop, stream));
      HG_CUDA_CHECK(cudaEventSynchronize(stop));
      float ms = 0;
      HG_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
      times.push_back(ms);
    }
    HG_CUDA_CHECK(cudaEventDestroy(start));
    HG_CUDA_CHECK(cudaEventDestroy(stop));
  }
#endif
  if (device.is_cpu()) {
    for (int i = 0; i < repeats; ++i) {
      auto start = std::chrono::steady_clock::now();
      fn();
      times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    }
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

void row(const std::string& name, double ms, double bytes) {
  fmt::print("{:<44} {:>10.3f} ms {:>9.1f} GB/s\n", name, ms, bytes / (ms * 1e-3) / 1e9);
}

}  // namespace

int main(int argc, char** argv) {
  std::string device_name = cuda::is_available() ? "cuda" : "cpu";
  std::string dtype_name_arg = "float32";
  int repeats = 100, warmup = 10;
  CLI::App app{"halfgrad fused optimizer step over ResNet-50's parameters"};
  app.add_option("--device", device_name, "cuda or cpu")->check(CLI::IsMember({"cuda", "cpu"}));
  app.add_option("--dtype", dtype_name_arg, "parameter dtype")->check(CLI::IsMember({"float32", "float16", "bfloat16"}));
  app.add_option("--repeats", repeats, "timed steps per row (the median is printed)")->check(cli::integer_in<int>(1));
  app.add_option("--warmup", warmup, "untimed steps first");
  CLI11_PARSE(app, argc, argv);

  const Device device = device_name == "cuda" ? Device::cuda(0) : Device::cpu();
  const DType dtype = dtype_name_arg == "float16" ? kFloat16 : dtype_name_arg == "bfloat16" ? kBFloat16 : kFloat32;
  if (device.is_cuda() && !cuda::is_available()) {
    fmt::print("bench_optim: no GPU (or halfgrad built without CUDA); try --device cpu\n");
    return 1;
  }

  const std::vector<Shape> shapes = resnet50_parameter_shapes();
  manual_seed(0);
  TensorList params;
  int64_t numel = 0;
  for (const Shape& s : shapes) {
    Tensor p = (randn(s) * 0.01).to(device, dtype).requires_grad_();
    p.set_grad((randn(s) * 1e-3).to(device, dtype));
    numel += p.numel();
    params.push_back(p);
  }
  const double element = double(element_size(dtype));
  fmt::print("optimizer step over ResNet-50's parameters: {} tensors, {} elements, {}, {}\n", params.size(), numel,
             dtype_name(dtype), device.is_cuda() ? cuda::device_name(device.index) : std::string("cpu"));
  fmt::print("{:<44} {:>13} {:>14}\n", "", "median", "bandwidth");

  {
    optim::SGD opt(params, {.lr = 0.1, .momentum = 0.9});
    row("halfgrad SGD momentum=0.9 (fused)", median_ms(device, [&] { opt.step(); }, repeats, warmup),
        5 * element * double(numel));
  }
  {
    optim::SGD opt(params, {.lr = 0.1, .momentum = 0.9, .weight_decay = 5e-4, .nesterov = true});
    row("halfgrad SGD nesterov, weight_decay (fused)", median_ms(device, [&] { opt.step(); }, repeats, warmup),
        5 * element * double(numel));
  }
  {
    optim::Adam opt(params, {.lr = 1e-3});
    row("halfgrad Adam (fused)", median_ms(device, [&] { opt.step(); }, repeats, warmup),
        7 * element * double(numel));
  }
  {
    optim::AdamW opt(params, {.lr = 1e-3, .weight_decay = 1e-2});
    row("halfgrad AdamW (fused)", median_ms(device, [&] { opt.step(); }, repeats, warmup),
        7 * element * double(numel));
  }
  {
    optim::RMSprop opt(params, {.lr = 1e-3});
    row("halfgrad RMSprop (fused)", median_ms(device, [&] { opt.step(); }, repeats, warmup),
        5 * element * double(numel));
  }
  {
    optim::RMSprop opt(params, {.lr = 1e-3, .momentum = 0.9, .centered = true});
    row("halfgrad RMSprop centered, momentum (fused)", median_ms(device, [&] { opt.step(); }, repeats, warmup),
        9 * element * double(numel));
  }
  {
    optim::Adagrad opt(params, {.lr = 1e-2});
    row("halfgrad Adagrad (fused)", median_ms(device, [&] { opt.step(); }, repeats, warmup),
        5 * element * double(numel));
  }
  // A huge max_norm: the gradients are multiplied by exactly 1 and stay the same from run to run.
  row("halfgrad clip_grad_norm_ (2-norm)",
      median_ms(device, [&] { optim::clip_grad_norm_(params, 1e30); }, repeats, warmup), 3 * element * double(numel));
  return 0;
}

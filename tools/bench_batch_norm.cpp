// bench_batch_norm: batch_norm forward + backward (training mode) on the GPU for every BatchNorm shape of ResNet-18
// and ResNet-50 on CIFAR (32x32 images, batch 256), in float32 and float16 (float16 activations with float32
// weight, bias and running statistics: what autocast and apex O2 hand BatchNorm), NCHW and NHWC (channels_last).
// A benchmark program, not a test: it prints a table. tools/bench_batch_norm_torch.py prints the same rows for
// PyTorch on the same GPU.
//
//   one step    y = batch_norm(x, running_mean, running_var, weight, bias, training); y.backward(dy): batch
//               statistics, running-statistics update, normalisation, then grad input, grad weight, grad bias;
//               gradients reset before each step
//   timing      CUDA events around each step, the median of --iters steps after --warmup (tools/bench_layers.h);
//               "host ms" is the host's time to issue a step (close to "ms": bound by the host)
//   --backend   which implementation runs (ops/batch_norm.h, BatchNormBackend): auto (the default: the faster,
//               measured at the first step), own, or cudnn (cuDNN's kernels, which PyTorch calls)
//   GB/s        the fewest bytes a step must move over its time: x read and y written by the forward, x and dy
//               read and dx written by the backward (5 passes over an activation); the statistics' reads are
//               extra passes this count leaves out, so 100% of copy bandwidth is not reachable
#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/cuda.h"
#include "halfgrad.h"
#include "ops/batch_norm.h"
#include "ops/conv.h"

#include "tools/bench_layers.h"

using namespace halfgrad;

namespace {

// The distinct (channels, size) of the BatchNorm layers; the same list, in the same order, is in
// tools/bench_batch_norm_torch.py.
struct Shape2 {
  const char* net;
  int64_t channels, size;
};

const std::vector<Shape2> kShapes = {
    {"resnet18", 64, 32},  {"resnet18", 128, 16},  {"resnet18", 256, 8},   {"resnet18", 512, 4},
    {"resnet50", 64, 32},  {"resnet50", 256, 32},  {"resnet50", 128, 32}, {"resnet50", 128, 16},
    {"resnet50", 512, 16}, {"resnet50", 256, 16},  {"resnet50", 256, 8},  {"resnet50", 1024, 8},
    {"resnet50", 512, 8},  {"resnet50", 512, 4},   {"resnet50", 2048, 4},
};

struct Settings : bench::LayerSettings {
  Settings() { iters = 100; }
  std::string backend = "auto";
};

#if HALFGRAD_WITH_CUDA

Tensor random_gpu(const halfgrad::Shape& shape, DType dtype, MemoryFormat format) {
  NoGradGuard no_grad;
  return contiguous(randn(shape).to(Device::cuda(0), dtype), format);
}

bench::StepTimes run_shape(const Shape2& b, DType dtype, MemoryFormat format, const Settings& s) {
  const Device gpu = Device::cuda(0);
  Tensor x = random_gpu({s.batch, b.channels, b.size, b.size}, dtype, format).requires_grad_();
  Tensor dy = random_gpu({s.batch, b.channels, b.size, b.size}, dtype, format);
  // Parameters and statistics in float32 whatever the activations' dtype.
  Tensor weight = (rand({b.channels}) + 0.5).to(gpu).requires_grad_();
  Tensor bias = randn({b.channels}).to(gpu).requires_grad_();
  Tensor running_mean = zeros({b.channels}, {.device = gpu});
  Tensor running_var = ones({b.channels}, {.device = gpu});
  return bench::time_steps(
      [&] {
        x.set_grad(Tensor());
        weight.set_grad(Tensor());
        bias.set_grad(Tensor());
        Tensor y = batch_norm(x, running_mean, running_var, weight, bias, /*training=*/true);
        y.backward(dy);
      },
      s.warmup, s.iters);
}

int run(const Settings& s) {
  set_batch_norm_backend(s.backend == "own"     ? BatchNormBackend::Own
                         : s.backend == "cudnn" ? BatchNormBackend::Cudnn
                                                : BatchNormBackend::Auto);
  fmt::print("bench_batch_norm: halfgrad batch_norm forward + backward (training) on {}, batch {}, median of {} "
             "steps after {} warm-up steps; parameters and statistics in float32; backend {}\n",
             cuda::device_name(0), s.batch, s.iters, s.warmup, s.backend);
  fmt::print("{:<9} {:<20} {:<8} {:<6} {:>10} {:>9} {:>8}\n", "net", "shape (N, C, HxW)", "dtype", "layout", "ms",
             "GB/s", "host ms");
  for (const Shape2& b : kShapes) {
    if (s.net != "all" && s.net != b.net) continue;
    bench::for_each_case(s, [&](DType dtype, const char* dname, MemoryFormat format, const char* lname) {
      const bench::StepTimes t = run_shape(b, dtype, format, s);
      const double bytes = 5.0 * double(s.batch * b.channels * b.size * b.size) * double(element_size(dtype));
      const std::string shape = fmt::format("{}, {}, {}x{}", s.batch, b.channels, b.size, b.size);
      fmt::print("{:<9} {:<20} {:<8} {:<6} {:>10.3f} {:>9.0f} {:>8.3f}\n", b.net, shape, dname, lname, t.ms,
                 bytes / (t.ms * 1e-3) / 1e9, t.host_ms);
      std::fflush(stdout);
    });
  }
  return 0;
}

#endif  // HALFGRAD_WITH_CUDA

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{"batch_norm forward + backward on the GPU for the ResNet-18/50 CIFAR shapes (compare with "
               "tools/bench_batch_norm_torch.py)"};
  bench::add_layer_options(app, s);
  app.add_option("--backend", s.backend, "implementation: auto, own or cudnn")
      ->check(CLI::IsMember({"auto", "own", "cudnn"}));
  CLI11_PARSE(app, argc, argv);
#if HALFGRAD_WITH_CUDA
  return bench::run_on_gpu("bench_batch_norm", [&] { return run(s); });
#else
  return bench::run_on_gpu("bench_batch_norm", [] { return 1; });
#endif
}

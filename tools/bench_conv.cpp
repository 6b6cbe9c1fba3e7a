// bench_conv: conv2d forward + backward on the GPU for every convolution shape of ResNet-18 and ResNet-50 on
// CIFAR (32x32 images, batch 256), in float32 and float16, NCHW and NHWC (channels_last).
// A benchmark program, not a test: it prints a table. tools/bench_conv_torch.py prints the same rows for
// PyTorch on the same GPU (torch.backends.cudnn.benchmark = True), so the two outputs compare line by line.
//
//   one step    y = conv2d(x, w); y.backward(dy)  — the forward, grad input (not for the 3-channel stem,
//               whose input is the data) and grad weight; the gradients are reset before each step, so no
//               accumulation is timed. --direct times the three kernels' ops without autograd instead.
//   timing      CUDA events around each step on the current stream, after --warmup steps (the first one
//               autotunes cuDNN's engines for the shape); the median of --iters steps (tools/bench_layers.h).
//               "host ms" is the median time the host took to issue a step: when it is close to "ms", the
//               step is bound by the host, not by the GPU.
//   TFLOP/s     2 * N * O * OH * OW * (C / groups) * kH * kW per product, times 3 (forward, grad input,
//               grad weight), or 2 for the stem
//   data        random normal inputs; weights scaled by 1/sqrt(fan_in) so that float16 stays finite
//   float32     may use TF32 tensor cores, as PyTorch's default (torch.backends.cudnn.allow_tf32); --tf32 off
//               for full float32 (then run the PyTorch script with --no-tf32 too)
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/cuda.h"
#include "halfgrad.h"
#include "ops/conv.h"

#include "tools/bench_layers.h"

using namespace halfgrad;

namespace {

// One convolution of the networks: padding is kernel / 2 (3x3: 1, 1x1: 0), as in torchvision's ResNets.
// The same list, in the same order, is in tools/bench_conv_torch.py.
struct Layer {
  const char* net;
  const char* name;
  int64_t in_channels, out_channels, kernel, stride, size;  // size: input height = width
};

const std::vector<Layer> kLayers = {
    // ResNet-18 (CIFAR stem: 3x3 conv, no max pool), BasicBlocks [2, 2, 2, 2]
    {"resnet18", "stem 3x3", 3, 64, 3, 1, 32},
    {"resnet18", "layer1 3x3", 64, 64, 3, 1, 32},
    {"resnet18", "layer2.0 3x3 s2", 64, 128, 3, 2, 32},
    {"resnet18", "layer2 3x3", 128, 128, 3, 1, 16},
    {"resnet18", "layer2.0 down 1x1 s2", 64, 128, 1, 2, 32},
    {"resnet18", "layer3.0 3x3 s2", 128, 256, 3, 2, 16},
    {"resnet18", "layer3 3x3", 256, 256, 3, 1, 8},
    {"resnet18", "layer3.0 down 1x1 s2", 128, 256, 1, 2, 16},
    {"resnet18", "layer4.0 3x3 s2", 256, 512, 3, 2, 8},
    {"resnet18", "layer4 3x3", 512, 512, 3, 1, 4},
    {"resnet18", "layer4.0 down 1x1 s2", 256, 512, 1, 2, 8},
    // ResNet-50 (CIFAR stem), Bottlenecks [3, 4, 6, 3], stride on the 3x3 (torchvision v1.5)
    {"resnet50", "stem 3x3", 3, 64, 3, 1, 32},
    {"resnet50", "layer1.0 1x1 in", 64, 64, 1, 1, 32},
    {"resnet50", "layer1 3x3", 64, 64, 3, 1, 32},
    {"resnet50", "layer1 1x1 out", 64, 256, 1, 1, 32},
    {"resnet50", "layer1.0 down 1x1", 64, 256, 1, 1, 32},
    {"resnet50", "layer1 1x1 in", 256, 64, 1, 1, 32},
    {"resnet50", "layer2.0 1x1 in", 256, 128, 1, 1, 32},
    {"resnet50", "layer2.0 3x3 s2", 128, 128, 3, 2, 32},
    {"resnet50", "layer2 1x1 out", 128, 512, 1, 1, 16},
    {"resnet50", "layer2.0 down 1x1 s2", 256, 512, 1, 2, 32},
    {"resnet50", "layer2 1x1 in", 512, 128, 1, 1, 16},
    {"resnet50", "layer2 3x3", 128, 128, 3, 1, 16},
    {"resnet50", "layer3.0 1x1 in", 512, 256, 1, 1, 16},
    {"resnet50", "layer3.0 3x3 s2", 256, 256, 3, 2, 16},
    {"resnet50", "layer3 1x1 out", 256, 1024, 1, 1, 8},
    {"resnet50", "layer3.0 down 1x1 s2", 512, 1024, 1, 2, 16},
    {"resnet50", "layer3 1x1 in", 1024, 256, 1, 1, 8},
    {"resnet50", "layer3 3x3", 256, 256, 3, 1, 8},
    {"resnet50", "layer4.0 1x1 in", 1024, 512, 1, 1, 8},
    {"resnet50", "layer4.0 3x3 s2", 512, 512, 3, 2, 8},
    {"resnet50", "layer4 1x1 out", 512, 2048, 1, 1, 4},
    {"resnet50", "layer4.0 down 1x1 s2", 1024, 2048, 1, 2, 8},
    {"resnet50", "layer4 1x1 in", 2048, 512, 1, 1, 4},
    {"resnet50", "layer4 3x3", 512, 512, 3, 1, 4},
};

struct Settings : bench::LayerSettings {
  bool tf32 = true;
  bool direct = false;
};

#if HALFGRAD_WITH_CUDA

// Random normal values of `shape` on the GPU, scaled, in `dtype` and `format`.
Tensor random_gpu(const Shape& shape, DType dtype, MemoryFormat format, double scale = 1.0) {
  NoGradGuard no_grad;
  Tensor t = (randn(shape) * scale).to(Device::cuda(0), dtype);
  return contiguous(t, format);
}

bench::StepTimes run_layer(const Layer& l, DType dtype, MemoryFormat format, const Settings& s) {
  const Conv2dOptions options{.stride = {l.stride, l.stride}, .padding = {l.kernel / 2, l.kernel / 2}};
  const bool input_grad = l.in_channels != 3;  // the stem's input is the data
  Tensor x = random_gpu({s.batch, l.in_channels, l.size, l.size}, dtype, format);
  Tensor w = random_gpu({l.out_channels, l.in_channels, l.kernel, l.kernel}, dtype, format,
                        1.0 / std::sqrt(double(l.in_channels * l.kernel * l.kernel)));
  const int64_t out_size = conv_output_size(l.size, l.kernel, l.stride, l.kernel / 2, 1);
  Tensor dy = random_gpu({s.batch, l.out_channels, out_size, out_size}, dtype, format);
  if (input_grad) x.requires_grad_();
  w.requires_grad_();

  if (s.direct) {
    return bench::time_steps(
        [&] {
          NoGradGuard no_grad;
          Tensor y = conv2d(x, w, {}, options);
          if (input_grad) conv2d_backward_input(dy, w, x.shape(), options);
          conv2d_backward_weight(dy, x, w.shape(), options);
        },
        s.warmup, s.iters);
  }
  return bench::time_steps(
      [&] {
        if (input_grad) x.set_grad(Tensor());
        w.set_grad(Tensor());
        Tensor y = conv2d(x, w, {}, options);
        y.backward(dy);
      },
      s.warmup, s.iters);
}

int run(const Settings& s) {
  set_conv_allow_tf32(s.tf32);
  fmt::print("bench_conv: halfgrad conv2d forward + backward on {}, batch {}, median of {} steps after {} warm-up "
             "steps; float32 TF32 {}; {}\n",
             cuda::device_name(0), s.batch, s.iters, s.warmup, s.tf32 ? "allowed" : "off",
             s.direct ? "direct op calls (no autograd)" : "through autograd");
  fmt::print("{:<9} {:<22} {:<26} {:<8} {:<6} {:>10} {:>9} {:>8}\n", "net", "layer", "shape (C->O, k, s, HxW)",
             "dtype", "layout", "ms", "TFLOP/s", "host ms");
  for (const Layer& l : kLayers) {
    if (s.net != "all" && s.net != l.net) continue;
    bench::for_each_case(s, [&](DType dtype, const char* dname, MemoryFormat format, const char* lname) {
      const bench::StepTimes t = run_layer(l, dtype, format, s);
      const int64_t out = conv_output_size(l.size, l.kernel, l.stride, l.kernel / 2, 1);
      const double flops = 2.0 * double(s.batch) * double(l.out_channels) * double(out * out) *
                           double(l.in_channels * l.kernel * l.kernel) * (l.in_channels == 3 ? 2 : 3);
      const std::string shape = fmt::format("{}->{}, {}x{}, s{}, {}x{}", l.in_channels, l.out_channels, l.kernel,
                                            l.kernel, l.stride, l.size, l.size);
      fmt::print("{:<9} {:<22} {:<26} {:<8} {:<6} {:>10.3f} {:>9.1f} {:>8.3f}\n", l.net, l.name, shape, dname,
                 lname, t.ms, flops / (t.ms * 1e-3) / 1e12, t.host_ms);
      std::fflush(stdout);
    });
  }
  return 0;
}

#endif  // HALFGRAD_WITH_CUDA

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{"conv2d forward + backward on the GPU for the ResNet-18/50 CIFAR shapes (compare with "
               "tools/bench_conv_torch.py)"};
  bench::add_layer_options(app, s);
  app.add_option("--tf32", s.tf32, "let float32 convolutions use TF32 tensor cores (PyTorch's default: true)");
  app.add_flag("--direct", s.direct, "time conv2d + conv2d_backward_input + conv2d_backward_weight without autograd");
  CLI11_PARSE(app, argc, argv);
#if HALFGRAD_WITH_CUDA
  return bench::run_on_gpu("bench_conv", [&] { return run(s); });
#else
  return bench::run_on_gpu("bench_conv", [] { return 1; });
#endif
}

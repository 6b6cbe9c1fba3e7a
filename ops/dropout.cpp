// dropout: the public op with its backward next to it, and the CPU kernel.
#include "ops/dropout.h"

#include <omp.h>

#include "core/autocast.h"
#include "core/autograd.h"
#include "ops/elementwise.h"

namespace halfgrad {

constinit KernelTable<DropoutKernel> dropout_kernel("dropout");

namespace {
// x times the mask and scale of the counters `state`: dropout's forward, its backward (the same mask on the gradient,
// regenerated) and that one's backward, each the other's: linear in x, so differentiable to any order. `name`: the
// node's.
Tensor masked_by_counters(const Tensor& x, double p, GeneratorState state, const char* name) {
  Tensor out = empty(x.shape(), {.dtype = x.dtype(), .device = x.device()});
  if (x.numel() > 0) dropout_kernel[x.device()](out, x.detach().contiguous(), p, state);
  if (!any_requires_grad({&x})) return out;  // (a plain backward pass: no closure to build)
  record(name, {x}, {out}, [p, state](const GradContext& g) -> TensorList {
    return {masked_by_counters(g[0], p, state, "DropoutBackwardBackward")};
  }, DoubleBackward::Supported);
  return out;
}
}  // namespace

Tensor dropout(const Tensor& x, double p, bool training) {
  HG_AUTOCAST(dropout, x, p, training);
  HG_CHECK(x.defined(), "dropout: the input is an undefined tensor");
  HG_CHECK(p >= 0.0 && p <= 1.0, "dropout: probability has to be between 0 and 1, got {} (input {})", p, x.meta());
  HG_CHECK(x.is_floating_point(), "dropout: expected a floating-point input, got {}", x.meta());
  if (!training || p == 0.0) return x;
  if (p == 1.0) return x * 0.0;  // everything dropped: times 0, as the kernel drops (ops/dropout.h)

  return masked_by_counters(x, p, next_random_counters(uint64_t((x.numel() + 3) / 4)), "DropoutBackward");
}

Tensor dropout_masked(const Tensor& x, double p, GeneratorState state) {
  HG_CHECK(x.defined() && x.is_floating_point() && p > 0.0 && p < 1.0,
           "dropout_masked: expected a floating-point input and 0 < p < 1, got {} and p = {}", x.meta(), p);
  return masked_by_counters(x, p, state, "DropoutBackward");
}

// ---- CPU kernel: threads take runs of whole counters (4 elements each).
namespace {

template <typename T> void dropout_typed(T* out, const T* in, int64_t n, double p, GeneratorState state) {
  using A = opmath_t<T>;
  const float keep = float(1.0 - p);  // compared in float32, as the CUDA kernel does
  const A scale = A(1.0 / (1.0 - p));
  const int64_t counters = (n + 3) / 4;
#pragma omp parallel for schedule(static) if (n >= 65536)
  for (int64_t c = 0; c < counters; ++c) {
    const Philox::U4 r = Philox::generate(state.seed, state.offset + uint64_t(c));
    for (int k = 0; k < 4; ++k) {
      const int64_t i = c * 4 + k;
      if (i < n) out[i] = T(A(in[i]) * dropout_factor(Philox::uniform(r.x[k]), keep, scale));
    }
  }
}

void dropout_cpu(const Tensor& out, const Tensor& in, double p, GeneratorState state) {
  HG_CHECK(!state.graph_state, "dropout: a CPU tensor {} inside a CUDA graph capture", in.meta());
  dispatch_floating(in.dtype(), "dropout", [&]<typename T>() {
    dropout_typed(out.data<T>(), in.data<T>(), in.numel(), p, state);
  });
}

}  // namespace

HG_REGISTER_KERNEL(dropout_kernel, CPU, dropout_cpu);

}  // namespace halfgrad

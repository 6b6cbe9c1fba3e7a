// The fused optimizer kernels on CUDA (optim/fused.h says what each computes), on multi-tensor apply
// (ops/multi_tensor.cuh): a ResNet-50 step (161 tensors, 25.6M elements) is 3 launches for SGD with momentum and
// for Adam.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/cuda.h"
#include "optim/fused.h"
#include "ops/multi_tensor.cuh"
#include "optim/update_rules.h"

namespace halfgrad::optim {
namespace {

using namespace multi_tensor;

// A step's multi-tensor launch over `lists` (the first two are a.params and a.grads), writing operand 0's new values
// rounded into a.param_casts too where a parameter has one (float32 parameters, casts of one dtype: optim/fused.h).
template <typename T, int DEPTH, typename Extra, typename ExtraOf, typename Op>
void launch_step(const char* name, const StepTensors& a, const std::array<const TensorList*, DEPTH>& lists,
                 const ExtraOf& extra_of, const Op& op, const float* skip = nullptr) {
  const Device device = a.params[0].device();
  if constexpr (std::is_same_v<T, float>) {
    const auto first = std::find_if(a.param_casts.begin(), a.param_casts.end(), [](const Tensor& c) { return c.defined(); });
    if (first != a.param_casts.end()) {
      auto launch = [&]<typename C>() {
        auto with_cast = [&](size_t i) {
          return WithCast<C, Extra>{extra_of(i), a.param_casts[i].defined() ? a.param_casts[i].template data<C>() : nullptr};
        };
        launch_multi_tensor<T, DEPTH, WithCast<C, Extra>>(name, device, lists, with_cast, op, skip);
      };
      if (first->dtype() == kFloat16)
        launch.template operator()<Half>();
      else
        launch.template operator()<BFloat16>();
      return;
    }
  }
  launch_multi_tensor<T, DEPTH, Extra>(name, device, lists, extra_of, op, skip);
}

// ---- SGD: operands p, g[, b]

struct SGDExtra {
  int32_t first_step;
};

template <typename M> struct SGDOp {
  SGDScalars<M> scalars;
  bool nesterov;
  const double* hyperparameters;  // nullptr, or [lr, momentum] to read instead of lr and momentum
  const float* grad_scale;        // nullptr, or the factor each gradient is read with
  static constexpr __device__ bool writes(int d) { return d != 1; }  // not the gradient
  // Without momentum or weight decay a gradient of +0 moves nothing: p - lr (scale * +0) is p, -0 and NaN included,
  // where lr and the scale are finite and not negative (else the step could be NaN or -0).
  static constexpr int kUnchangedWhereZero = 1;
  template <int DEPTH> __device__ bool unchanged_where_zero() const {
    const M lr = step_scalars().lr, scale = grad_scale ? M(*grad_scale) : M(1);
    return DEPTH == 2 && scalars.weight_decay == M(0) && isfinite(lr) && isfinite(scale) && !signbit(lr) &&
           !signbit(scale);
  }
  // The scalars this step uses: lr and momentum from `hyperparameters` where given.
  __device__ __forceinline__ SGDScalars<M> step_scalars() const {
    SGDScalars<M> s = scalars;
    if (hyperparameters) s.lr = M(hyperparameters[0]), s.momentum = M(hyperparameters[1]);
    return s;
  }
  template <int DEPTH> __device__ __forceinline__ void operator()(M (&r)[DEPTH], const SGDExtra& extra) const {
    const SGDScalars<M> s = step_scalars();
    const M g = grad_scale ? M(*grad_scale) * r[1] : r[1];
    const bool decay = s.weight_decay != M(0);
    if constexpr (DEPTH == 3) {  // with momentum: r[2] is the buffer
      r[0] = sgd_update(r[0], g, r[2], s, true, extra.first_step != 0, nesterov, decay);
    } else {
      M no_buffer = 0;
      r[0] = sgd_update(r[0], g, no_buffer, s, false, false, nesterov, decay);
    }
  }
};

void sgd_step_cuda(const SGDStepArgs& a) {
  if (a.params.empty()) return;
  dispatch_floating(a.params[0].dtype(), "SGD.step", [&]<typename T>() {
    using M = opmath_t<T>;
    const SGDOp<M> op{{M(a.lr), M(a.momentum), M(1 - a.dampening), M(a.weight_decay)}, a.nesterov,
                      a.hyperparameters.defined() ? a.hyperparameters.data<double>() : nullptr,
                      a.grad_scale.defined() ? a.grad_scale.data<float>() : nullptr};
    auto extra_of = [&](size_t i) { return SGDExtra{a.momentum != 0 && a.first_step[i] ? 1 : 0}; };
    const float* skip = a.found_inf.defined() ? a.found_inf.data<float>() : nullptr;
    if (a.momentum != 0) {
      launch_step<T, 3, SGDExtra>("SGD.step", a, {&a.params, &a.grads, &a.momentum_buffers}, extra_of, op, skip);
    } else {
      launch_step<T, 2, SGDExtra>("SGD.step", a, {&a.params, &a.grads}, extra_of, op, skip);
    }
  });
}

// ---- Adam / AdamW: operands p, g, m, v[, v_max]

struct AdamExtra {
  double step_size, bias_correction2_sqrt;
};

template <typename M> struct AdamOp {
  AdamScalars<M> scalars;
  bool decoupled;
  static constexpr __device__ bool writes(int d) { return d != 1; }
  template <int DEPTH> __device__ __forceinline__ void operator()(M (&r)[DEPTH], const AdamExtra& extra) const {
    const M step_size = M(extra.step_size), bias_correction2_sqrt = M(extra.bias_correction2_sqrt);
    const bool decay = scalars.weight_decay != M(0);
    if constexpr (DEPTH == 5) {  // amsgrad: r[4] is the largest second moment
      r[0] = adam_update(r[0], r[1], r[2], r[3], r[4], step_size, bias_correction2_sqrt, scalars, true, decoupled,
                         decay);
    } else {
      M no_max = 0;
      r[0] = adam_update(r[0], r[1], r[2], r[3], no_max, step_size, bias_correction2_sqrt, scalars, false, decoupled,
                         decay);
    }
  }
};

void adam_step_cuda(const AdamStepArgs& a) {
  if (a.params.empty()) return;
  dispatch_floating(a.params[0].dtype(), "Adam.step", [&]<typename T>() {
    using M = opmath_t<T>;
    const AdamOp<M> op{{M(a.beta1), M(1 - a.beta1), M(a.beta2), M(1 - a.beta2), M(a.eps), M(a.weight_decay),
                        M(1 - a.lr * a.weight_decay)},
                       a.decoupled_weight_decay};
    auto extra_of = [&](size_t i) { return AdamExtra{a.step_sizes[i], a.bias_correction2_sqrts[i]}; };
    if (a.amsgrad) {
      launch_step<T, 5, AdamExtra>("Adam.step", a,
                                   {&a.params, &a.grads, &a.exp_avgs, &a.exp_avg_sqs, &a.max_exp_avg_sqs}, extra_of,
                                   op);
    } else {
      launch_step<T, 4, AdamExtra>("Adam.step", a, {&a.params, &a.grads, &a.exp_avgs, &a.exp_avg_sqs}, extra_of, op);
    }
  });
}

// ---- RMSprop: operands p, g, square_avg[, grad_avg][, b]

// kCentered a template flag: which operand r[3] is (grad_avg or the momentum buffer) is then known at compile time,
// and the operands stay in registers (chosen at run time, they went through a local stack frame).
template <typename M, bool kCentered> struct RMSpropOp {
  RMSpropScalars<M> scalars;
  static constexpr __device__ bool writes(int d) { return d != 1; }
  template <int DEPTH> __device__ __forceinline__ void operator()(M (&r)[DEPTH], const NoExtra&) const {
    static_assert(DEPTH == 3 + kCentered || DEPTH == 4 + kCentered, "p, g, square_avg[, grad_avg][, buffer]");
    constexpr bool kMomentum = DEPTH == (kCentered ? 5 : 4);
    M unused_mean = 0, unused_buffer = 0;
    M* grad_avg = &unused_mean;
    M* buffer = &unused_buffer;
    if constexpr (kCentered) grad_avg = &r[3];
    if constexpr (kMomentum) buffer = &r[DEPTH - 1];
    r[0] = rmsprop_update(r[0], r[1], r[2], *grad_avg, *buffer, scalars, kCentered, kMomentum,
                          scalars.weight_decay != M(0));
  }
};

void rmsprop_step_cuda(const RMSpropStepArgs& a) {
  if (a.params.empty()) return;
  dispatch_floating(a.params[0].dtype(), "RMSprop.step", [&]<typename T>() {
    using M = opmath_t<T>;
    const RMSpropScalars<M> s{M(a.lr), M(a.alpha), M(1 - a.alpha), M(a.eps), M(a.weight_decay), M(a.momentum)};
    const RMSpropOp<M, true> centered{s};
    const RMSpropOp<M, false> plain{s};
    auto no_extra = [](size_t) { return NoExtra{}; };
    const char* name = "RMSprop.step";
    if (a.centered && a.momentum != 0) {
      launch_step<T, 5, NoExtra>(name, a, {&a.params, &a.grads, &a.square_avgs, &a.grad_avgs, &a.momentum_buffers},
                                 no_extra, centered);
    } else if (a.centered) {
      launch_step<T, 4, NoExtra>(name, a, {&a.params, &a.grads, &a.square_avgs, &a.grad_avgs}, no_extra, centered);
    } else if (a.momentum != 0) {
      launch_step<T, 4, NoExtra>(name, a, {&a.params, &a.grads, &a.square_avgs, &a.momentum_buffers}, no_extra, plain);
    } else {
      launch_step<T, 3, NoExtra>(name, a, {&a.params, &a.grads, &a.square_avgs}, no_extra, plain);
    }
  });
}

// ---- Adagrad: operands p, g, sum

struct AdagradExtra {
  double clr;
};

template <typename M> struct AdagradOp {
  M eps, weight_decay;
  static constexpr __device__ bool writes(int d) { return d != 1; }
  __device__ __forceinline__ void operator()(M (&r)[3], const AdagradExtra& extra) const {
    r[0] = adagrad_update(r[0], r[1], r[2], M(extra.clr), eps, weight_decay, weight_decay != M(0));
  }
};

void adagrad_step_cuda(const AdagradStepArgs& a) {
  if (a.params.empty()) return;
  dispatch_floating(a.params[0].dtype(), "Adagrad.step", [&]<typename T>() {
    using M = opmath_t<T>;
    launch_step<T, 3, AdagradExtra>("Adagrad.step", a, {&a.params, &a.grads, &a.sums},
                                    [&](size_t i) { return AdagradExtra{a.clrs[i]}; },
                                    AdagradOp<M>{M(a.eps), M(a.weight_decay)});
  });
}

// ---- scale: x *= coefficient, the coefficient read on the device

template <typename A> struct ScaleOp {
  const A* coefficient;
  static constexpr __device__ bool writes(int) { return true; }
  template <typename M> __device__ __forceinline__ void operator()(M (&r)[1], const NoExtra&) const {
    r[0] = r[0] * M(__ldg(coefficient));
  }
};

void scale_cuda(const TensorList& tensors, const Tensor& coefficient) {
  if (tensors.empty()) return;
  const Device device = tensors[0].device();
  HG_CHECK(coefficient.device() == device && coefficient.dtype() == accumulation_dtype(tensors[0].dtype()),
           "scale: coefficient {} for {} tensors", coefficient.meta(), tensors[0].meta());
  dispatch_floating(tensors[0].dtype(), "scale", [&]<typename T>() {
    using A = opmath_t<T>;  // float, or double for float64: the accumulate dtype
    launch_multi_tensor<T, 1, NoExtra>("scale", device, {&tensors}, [](size_t) { return NoExtra{}; },
                                       ScaleOp<A>{coefficient.data<A>()});
  });
}

// ---- norm: sum |x|^p (or max |x|) over all tensors; per-block partials, then one block combines them

enum class NormKind { One, Two, P, Inf };

template <NormKind K, typename A> __device__ __forceinline__ A norm_combine(A a, A b) {
  if constexpr (K == NormKind::Inf) {
    return (a != a || a > b) ? a : b;  // nan wins
  } else {
    return a + b;
  }
}

template <NormKind K, typename A> __device__ __forceinline__ A norm_term(A x, A p) {
  if constexpr (K == NormKind::Two) return x * x;
  if constexpr (K == NormKind::P) return pow(fabs(x), p);
  return fabs(x);
}

// The combination of every thread's value, in thread 0 (a fixed order: deterministic).
template <NormKind K, typename A> __device__ A block_combine(A v) {
  __shared__ A warp_results[kBlock / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = norm_combine<K>(v, __shfl_down_sync(0xffffffffu, v, offset));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_results[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < int(blockDim.x / 32) ? warp_results[lane] : A(0);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = norm_combine<K>(v, __shfl_down_sync(0xffffffffu, v, offset));
  }
  return v;
}

template <typename T, NormKind K, typename A>
__global__ void __launch_bounds__(kBlock)
    norm_partials_kernel(const HG_GRID_CONSTANT TensorBatch<1, NoExtra> batch, A p, A* partials) {
  A acc = 0;
  for (int64_t chunk = blockIdx.x; chunk < batch.num_chunks; chunk += gridDim.x) {
    const TensorEntry<1, NoExtra>& e = entry_of_chunk(batch, chunk);
    const int64_t begin = (chunk - e.first_chunk) * kChunk;
    const int64_t n = min(kChunk, e.numel - begin);
    const T* x = static_cast<const T*>(e.ptr[0]) + begin;
    int64_t done = 0;
    if (reinterpret_cast<uintptr_t>(x) % (sizeof(T) * kVec) == 0) {
      const int64_t vectors = n / kVec;
      for (int64_t v = threadIdx.x; v < vectors; v += blockDim.x) {
        const Vec<T, kVec> xv = reinterpret_cast<const Vec<T, kVec>*>(x)[v];
#pragma unroll
        for (int k = 0; k < kVec; ++k) acc = norm_combine<K>(acc, norm_term<K>(A(xv.v[k]), p));
      }
      done = vectors * kVec;
    }
    for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) acc = norm_combine<K>(acc, norm_term<K>(A(x[i]), p));
  }
  acc = block_combine<K>(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

template <NormKind K, typename A> __global__ void __launch_bounds__(kBlock)
    norm_finish_kernel(const A* partials, int64_t count, A* out) {
  A acc = 0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) acc = norm_combine<K>(acc, partials[i]);
  acc = block_combine<K>(acc);
  if (threadIdx.x == 0) *out = acc;
}

constexpr int64_t kMaxNormBlocks = 1024;  // per launch: bounds the partials buffer

void norm_cuda(const TensorList& tensors, double norm_type, const Tensor& out) {
  const Device device = out.device();
  cuda::DeviceGuard guard(device);
  cudaStream_t stream = cuda::current_stream(device);
  const NormKind kind = std::isinf(norm_type) ? NormKind::Inf
                        : norm_type == 1      ? NormKind::One
                        : norm_type == 2      ? NormKind::Two
                                              : NormKind::P;
  dispatch_floating(out.dtype(), "grad norm", [&]<typename A>() {
    if constexpr (std::is_same_v<A, float> || std::is_same_v<A, double>) {
      auto with_kind = [&](auto launch) {
        switch (kind) {
          case NormKind::One: launch(std::integral_constant<NormKind, NormKind::One>{}); break;
          case NormKind::Two: launch(std::integral_constant<NormKind, NormKind::Two>{}); break;
          case NormKind::P: launch(std::integral_constant<NormKind, NormKind::P>{}); break;
          case NormKind::Inf: launch(std::integral_constant<NormKind, NormKind::Inf>{}); break;
        }
      };
      if (tensors.empty()) {
        HG_CUDA_CHECK(cudaMemsetAsync(out.data_ptr(), 0, sizeof(A), stream), "grad norm");
        return;
      }
      dispatch_floating(tensors[0].dtype(), "grad norm", [&]<typename T>() {
        // The batches first, to size the partials buffer; then all launches, then one block combines.
        std::vector<TensorBatch<1, NoExtra>> batches;
        for_each_batch<1, NoExtra>({&tensors}, [](size_t) { return NoExtra{}; },
                                   [&](const TensorBatch<1, NoExtra>& b) { batches.push_back(b); });
        int64_t count = 0;
        for (const auto& b : batches) count += std::min(b.num_chunks, kMaxNormBlocks);
        Tensor partials = empty({std::max<int64_t>(count, 1)}, {.dtype = out.dtype(), .device = device});
        with_kind([&](auto kind_constant) {
          constexpr NormKind K = decltype(kind_constant)::value;
          A* dst = partials.data<A>();
          for (const auto& b : batches) {
            const int64_t blocks = std::min(b.num_chunks, kMaxNormBlocks);
            norm_partials_kernel<T, K, A><<<unsigned(blocks), kBlock, 0, stream>>>(b, A(norm_type), dst);
            HG_CUDA_CHECK_LAUNCH("grad norm");
            dst += blocks;
          }
          if (count == 0) {
            HG_CUDA_CHECK(cudaMemsetAsync(out.data_ptr(), 0, sizeof(A), stream), "grad norm");
            return;
          }
          norm_finish_kernel<K, A><<<1, kBlock, 0, stream>>>(partials.data<A>(), count, out.data<A>());
          HG_CUDA_CHECK_LAUNCH("grad norm");
        });
      });
    } else {
      HG_FAIL("grad norm: output must be float32 or float64, got {}", out.meta());
    }
  });
}

}  // namespace

HG_REGISTER_KERNEL(sgd_step_kernel, CUDA, sgd_step_cuda);
HG_REGISTER_KERNEL(adam_step_kernel, CUDA, adam_step_cuda);
HG_REGISTER_KERNEL(rmsprop_step_kernel, CUDA, rmsprop_step_cuda);
HG_REGISTER_KERNEL(adagrad_step_kernel, CUDA, adagrad_step_cuda);
HG_REGISTER_KERNEL(norm_kernel, CUDA, norm_cuda);
HG_REGISTER_KERNEL(scale_kernel, CUDA, scale_cuda);

}  // namespace halfgrad::optim

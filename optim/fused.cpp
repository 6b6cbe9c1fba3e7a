// The fused optimizer kernels on the CPU (optim/fused.h says what each computes).
//
// The elements of all the tensors of a call are cut into chunks of kChunk; OpenMP threads take chunks
// dynamically, so one large tensor and many small ones both keep every core busy. Inside a chunk the update
// is one loop over contiguous arrays, with the options turned into template flags so that the loop has no
// branches and vectorises (AVX-512 with -march=native) for float32 and float64.
// NOTE: the Adam loop vectorises only when compiled with -fno-math-errno: otherwise std::sqrt carries a
// branch that sets errno for negative arguments, and GCC keeps such a loop scalar (a function attribute or
// `#pragma GCC optimize` does not reach it; the command-line flag does).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "core/half.h"
#include "optim/fused.h"
#include "optim/update_rules.h"

namespace halfgrad::optim {
namespace {

constexpr int64_t kChunk = 16384;            // elements per unit of work
constexpr int64_t kParallelMin = 1 << 16;    // a call with fewer elements runs on one thread

struct Chunk {
  size_t tensor;
  int64_t begin, end;
};

std::vector<Chunk> chunks_of(const TensorList& tensors, int64_t* total) {
  std::vector<Chunk> chunks;
  *total = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const int64_t n = tensors[t].numel();
    *total += n;
    for (int64_t begin = 0; begin < n; begin += kChunk) chunks.push_back({t, begin, std::min(n, begin + kChunk)});
  }
  return chunks;
}

// body(chunk index, chunk) for every chunk, on several threads when the call is large enough.
template <typename Body> void for_each_chunk(const TensorList& tensors, const Body& body) {
  int64_t total = 0;
  const std::vector<Chunk> chunks = chunks_of(tensors, &total);
  const int64_t n = int64_t(chunks.size());
  if (total < kParallelMin || omp_get_max_threads() == 1) {
    for (int64_t i = 0; i < n; ++i) body(i, chunks[size_t(i)]);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) body(i, chunks[size_t(i)]);
}

template <typename T> T* ptr(const Tensor& t) { return static_cast<T*>(t.data_ptr()); }

// After a chunk's update: its new parameter values, rounded, into the parameter's kept cast where the step has one
// (StepTensors::param_casts), while they are in cache.
template <typename T> void write_cast(const StepTensors& a, const Chunk& c) {
  if constexpr (std::is_same_v<T, float>) {  // the only parameters with casts (Optimizer::step_items)
    if (a.param_casts.empty() || !a.param_casts[c.tensor].defined()) return;
    const Tensor& cast = a.param_casts[c.tensor];
    const float* p = ptr<float>(a.params[c.tensor]) + c.begin;
    const int64_t n = c.end - c.begin;
    if (cast.dtype() == kFloat16) {
      float_to_half(p, ptr<Half>(cast) + c.begin, n);
    } else {
      BFloat16* __restrict out = ptr<BFloat16>(cast) + c.begin;
      for (int64_t i = 0; i < n; ++i) out[i] = BFloat16(p[i]);
    }
  }
}

// ---- SGD (the rule: optim/update_rules.h)

template <typename T, bool kMomentum, bool kFirst, bool kNesterov, bool kDecay>
void sgd_loop(T* __restrict p, const T* __restrict g, T* __restrict b, int64_t n, const SGDScalars<opmath_t<T>> s,
              const opmath_t<T> grad_scale) {
  using M = opmath_t<T>;
  for (int64_t i = 0; i < n; ++i) {
    M buffer = kMomentum && !kFirst ? M(b[i]) : M(0);
    p[i] = T(sgd_update(M(p[i]), grad_scale * M(g[i]), buffer, s, kMomentum, kFirst, kNesterov, kDecay));
    if constexpr (kMomentum) b[i] = T(buffer);
  }
}

void sgd_step_cpu(const SGDStepArgs& a) {
  if (a.params.empty() || (a.found_inf.defined() && a.found_inf.item<float>() != 0)) return;
  dispatch_floating(a.params[0].dtype(), "SGD.step", [&]<typename T>() {
    using M = opmath_t<T>;
    const SGDScalars<M> s{M(a.lr), M(a.momentum), M(1 - a.dampening), M(a.weight_decay)};
    const M grad_scale = a.grad_scale.defined() ? M(a.grad_scale.item<float>()) : M(1);
    const bool momentum = a.momentum != 0;
    for_each_chunk(a.params, [&](int64_t, const Chunk& c) {
      const size_t t = c.tensor;
      T* p = ptr<T>(a.params[t]) + c.begin;
      const T* g = ptr<T>(a.grads[t]) + c.begin;
      T* b = momentum ? ptr<T>(a.momentum_buffers[t]) + c.begin : nullptr;
      const bool first = momentum && a.first_step[t];
      with_bools(
          [&](auto kMomentum, auto kFirst, auto kNesterov, auto kDecay) {
            sgd_loop<T, kMomentum, kFirst, kNesterov, kDecay>(p, g, b, c.end - c.begin, s, grad_scale);
          },
          momentum, first, momentum && a.nesterov, a.weight_decay != 0);
      write_cast<T>(a, c);
    });
  });
}

// ---- Adam / AdamW (the rule: optim/update_rules.h)

template <typename T, bool kAmsgrad, bool kDecoupled, bool kDecay>
void adam_loop(T* __restrict p, const T* __restrict g, T* __restrict m, T* __restrict v, T* __restrict v_max,
               int64_t n, const AdamScalars<opmath_t<T>> s, const opmath_t<T> step_size,
               const opmath_t<T> bias_correction2_sqrt) {
  using M = opmath_t<T>;
  for (int64_t i = 0; i < n; ++i) {
    M exp_avg = M(m[i]), exp_avg_sq = M(v[i]), max_exp_avg_sq = kAmsgrad ? M(v_max[i]) : M(0);
    p[i] = T(adam_update(M(p[i]), M(g[i]), exp_avg, exp_avg_sq, max_exp_avg_sq, step_size, bias_correction2_sqrt, s,
                         kAmsgrad, kDecoupled, kDecay));
    m[i] = T(exp_avg);
    v[i] = T(exp_avg_sq);
    if constexpr (kAmsgrad) v_max[i] = T(max_exp_avg_sq);
  }
}

void adam_step_cpu(const AdamStepArgs& a) {
  if (a.params.empty()) return;
  dispatch_floating(a.params[0].dtype(), "Adam.step", [&]<typename T>() {
    using M = opmath_t<T>;
    const AdamScalars<M> s{M(a.beta1), M(1 - a.beta1), M(a.beta2),       M(1 - a.beta2),
                           M(a.eps),   M(a.weight_decay), M(1 - a.lr * a.weight_decay)};
    for_each_chunk(a.params, [&](int64_t, const Chunk& c) {
      const size_t t = c.tensor;
      T* v_max = a.amsgrad ? ptr<T>(a.max_exp_avg_sqs[t]) + c.begin : nullptr;
      with_bools(
          [&](auto kAmsgrad, auto kDecoupled, auto kDecay) {
            adam_loop<T, kAmsgrad, kDecoupled, kDecay>(
                ptr<T>(a.params[t]) + c.begin, ptr<T>(a.grads[t]) + c.begin, ptr<T>(a.exp_avgs[t]) + c.begin,
                ptr<T>(a.exp_avg_sqs[t]) + c.begin, v_max, c.end - c.begin, s, M(a.step_sizes[t]),
                M(a.bias_correction2_sqrts[t]));
          },
          a.amsgrad, a.decoupled_weight_decay, a.weight_decay != 0);
      write_cast<T>(a, c);
    });
  });
}

// ---- RMSprop (the rule: optim/update_rules.h)

template <typename T, bool kCentered, bool kMomentum, bool kDecay>
void rmsprop_loop(T* __restrict p, const T* __restrict g, T* __restrict square_avg, T* __restrict grad_avg,
                  T* __restrict b, int64_t n, const RMSpropScalars<opmath_t<T>> s) {
  using M = opmath_t<T>;
  for (int64_t i = 0; i < n; ++i) {
    M squares = M(square_avg[i]), mean = kCentered ? M(grad_avg[i]) : M(0), buffer = kMomentum ? M(b[i]) : M(0);
    p[i] = T(rmsprop_update(M(p[i]), M(g[i]), squares, mean, buffer, s, kCentered, kMomentum, kDecay));
    square_avg[i] = T(squares);
    if constexpr (kCentered) grad_avg[i] = T(mean);
    if constexpr (kMomentum) b[i] = T(buffer);
  }
}

void rmsprop_step_cpu(const RMSpropStepArgs& a) {
  if (a.params.empty()) return;
  dispatch_floating(a.params[0].dtype(), "RMSprop.step", [&]<typename T>() {
    using M = opmath_t<T>;
    const RMSpropScalars<M> s{M(a.lr), M(a.alpha), M(1 - a.alpha), M(a.eps), M(a.weight_decay), M(a.momentum)};
    const bool momentum = a.momentum != 0;
    for_each_chunk(a.params, [&](int64_t, const Chunk& c) {
      const size_t t = c.tensor;
      T* grad_avg = a.centered ? ptr<T>(a.grad_avgs[t]) + c.begin : nullptr;
      T* b = momentum ? ptr<T>(a.momentum_buffers[t]) + c.begin : nullptr;
      with_bools(
          [&](auto kCentered, auto kMomentum, auto kDecay) {
            rmsprop_loop<T, kCentered, kMomentum, kDecay>(ptr<T>(a.params[t]) + c.begin, ptr<T>(a.grads[t]) + c.begin,
                                                          ptr<T>(a.square_avgs[t]) + c.begin, grad_avg, b,
                                                          c.end - c.begin, s);
          },
          a.centered, momentum, a.weight_decay != 0);
      write_cast<T>(a, c);
    });
  });
}

// ---- Adagrad (the rule: optim/update_rules.h)

template <typename T, bool kDecay>
void adagrad_loop(T* __restrict p, const T* __restrict g, T* __restrict sum, int64_t n, const opmath_t<T> clr,
                  const opmath_t<T> eps, const opmath_t<T> weight_decay) {
  using M = opmath_t<T>;
  for (int64_t i = 0; i < n; ++i) {
    M s = M(sum[i]);
    p[i] = T(adagrad_update(M(p[i]), M(g[i]), s, clr, eps, weight_decay, kDecay));
    sum[i] = T(s);
  }
}

void adagrad_step_cpu(const AdagradStepArgs& a) {
  if (a.params.empty()) return;
  dispatch_floating(a.params[0].dtype(), "Adagrad.step", [&]<typename T>() {
    using M = opmath_t<T>;
    for_each_chunk(a.params, [&](int64_t, const Chunk& c) {
      const size_t t = c.tensor;
      with_bools(
          [&](auto kDecay) {
            adagrad_loop<T, kDecay>(ptr<T>(a.params[t]) + c.begin, ptr<T>(a.grads[t]) + c.begin,
                                    ptr<T>(a.sums[t]) + c.begin, c.end - c.begin, M(a.clrs[t]), M(a.eps),
                                    M(a.weight_decay));
          },
          a.weight_decay != 0);
      write_cast<T>(a, c);
    });
  });
}

// ---- norms and scaling (clip_grad_norm_)

enum class NormKind { One, Two, P, Inf };

// NaN-propagating max: a gradient with a nan has a nan norm.
template <typename A> A nan_max(A a, A b) { return (a > b || a != a) ? a : b; }

// |x|^p summed (or |x| maxed) over one chunk. kLanes independent accumulators let the compiler vectorise
// a reduction it may not reorder.
template <NormKind K, typename T, typename A> A norm_chunk(const T* x, int64_t n, A p) {
  constexpr int kLanes = 16;
  A acc[kLanes] = {};
  auto term = [&](A a) -> A {
    if constexpr (K == NormKind::One || K == NormKind::Inf) return std::abs(a);
    if constexpr (K == NormKind::Two) return a * a;
    return std::pow(std::abs(a), p);
  };
  auto combine = [](A s, A t) {
    if constexpr (K == NormKind::Inf) return nan_max(s, t);
    return s + t;
  };
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int k = 0; k < kLanes; ++k) acc[k] = combine(acc[k], term(A(x[i + k])));
  for (; i < n; ++i) acc[0] = combine(acc[0], term(A(x[i])));
  A r = acc[0];
  for (int k = 1; k < kLanes; ++k) r = combine(r, acc[k]);
  return r;
}

void norm_cpu(const TensorList& tensors, double norm_type, const Tensor& out) {
  const NormKind kind = std::isinf(norm_type) ? NormKind::Inf
                        : norm_type == 1      ? NormKind::One
                        : norm_type == 2      ? NormKind::Two
                                              : NormKind::P;
  HG_CHECK(out.dtype() == kFloat32 || out.dtype() == kFloat64, "grad norm: output must be float32 or float64, got {}",
           out.meta());
  auto run = [&]<typename A>() {
    A result = 0;
    if (!tensors.empty()) {
      dispatch_floating(tensors[0].dtype(), "grad norm", [&]<typename T>() {
        int64_t total = 0;
        std::vector<A> partial(chunks_of(tensors, &total).size());
        for_each_chunk(tensors, [&](int64_t i, const Chunk& c) {
          const T* x = ptr<T>(tensors[c.tensor]) + c.begin;
          const int64_t n = c.end - c.begin;
          switch (kind) {
            case NormKind::One: partial[size_t(i)] = norm_chunk<NormKind::One, T, A>(x, n, A(norm_type)); break;
            case NormKind::Two: partial[size_t(i)] = norm_chunk<NormKind::Two, T, A>(x, n, A(norm_type)); break;
            case NormKind::P: partial[size_t(i)] = norm_chunk<NormKind::P, T, A>(x, n, A(norm_type)); break;
            case NormKind::Inf: partial[size_t(i)] = norm_chunk<NormKind::Inf, T, A>(x, n, A(norm_type)); break;
          }
        });
        // Combined in chunk order: the same bits whatever the thread count.
        for (A v : partial) result = kind == NormKind::Inf ? nan_max(result, v) : result + v;
      });
    }
    *ptr<A>(out) = result;
  };
  if (out.dtype() == kFloat64)
    run.template operator()<double>();
  else
    run.template operator()<float>();
}

void scale_cpu(const TensorList& tensors, const Tensor& coefficient) {
  if (tensors.empty()) return;
  dispatch_floating(tensors[0].dtype(), "scale", [&]<typename T>() {
    using M = opmath_t<T>;
    const M c = M(coefficient.item<double>());
    for_each_chunk(tensors, [&](int64_t, const Chunk& chunk) {
      T* __restrict x = ptr<T>(tensors[chunk.tensor]) + chunk.begin;
      for (int64_t i = 0, n = chunk.end - chunk.begin; i < n; ++i) x[i] = T(M(x[i]) * c);
    });
  });
}

}  // namespace

KernelTable<SGDStepKernel> sgd_step_kernel("SGD.step");
KernelTable<AdamStepKernel> adam_step_kernel("Adam.step");
KernelTable<RMSpropStepKernel> rmsprop_step_kernel("RMSprop.step");
KernelTable<AdagradStepKernel> adagrad_step_kernel("Adagrad.step");
KernelTable<NormKernel> norm_kernel("grad norm");
KernelTable<ScaleKernel> scale_kernel("scale");

HG_REGISTER_KERNEL(sgd_step_kernel, CPU, sgd_step_cpu);
HG_REGISTER_KERNEL(adam_step_kernel, CPU, adam_step_cpu);
HG_REGISTER_KERNEL(rmsprop_step_kernel, CPU, rmsprop_step_cpu);
HG_REGISTER_KERNEL(adagrad_step_kernel, CPU, adagrad_step_cpu);
HG_REGISTER_KERNEL(norm_kernel, CPU, norm_cpu);
HG_REGISTER_KERNEL(scale_kernel, CPU, scale_cpu);

}  // namespace halfgrad::optim

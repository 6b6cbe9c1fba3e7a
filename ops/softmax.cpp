// softmax and log_softmax: the public ops with their backward next to them, and the CPU kernels.
#include "ops/softmax.h"

#include <omp.h>

#include <Eigen/Core>
#include <algorithm>
#include <type_traits>
#include <cmath>
#include <limits>
#include <vector>

#include "core/autocast.h"
#include "core/autograd.h"
#include "ops/elementwise.h"

namespace halfgrad {

constinit KernelTable<SoftmaxKernel> softmax_kernel("softmax");
constinit KernelTable<SoftmaxBackwardKernel> softmax_backward_kernel("softmax_backward");

namespace {

// x seen as [outer, size, inner] around dim d.
SoftmaxShape softmax_shape(const Shape& shape, int64_t d) {
  SoftmaxShape s;
  for (int64_t k = 0; k < int64_t(shape.size()); ++k) {
    if (k < d) s.outer *= shape[size_t(k)];
    if (k == d) s.size = shape[size_t(k)];
    if (k > d) s.inner *= shape[size_t(k)];
  }
  return s;
}

Tensor softmax_impl(const Tensor& x, int64_t dim, bool log) {
  const char* name = log ? "log_softmax" : "softmax";
  HG_CHECK(x.defined(), "{}: the input is an undefined tensor", name);
  HG_CHECK(x.is_floating_point(), "{}: expected a floating-point input, got {} (convert it with .to(kFloat32))",
           name, x.meta());
  const int64_t d = wrap_dim(dim, std::max<int64_t>(x.dim(), 1), name);  // a 0-d input is a row of one
  const SoftmaxShape s = softmax_shape(x.shape(), d);
  Tensor out = empty(x.shape(), {.dtype = x.dtype(), .device = x.device()});
  if (x.numel() > 0) softmax_kernel[x.device()](out, x.detach().contiguous(), s, log);

  // backward, from the output y alone (x is not kept):
  //   softmax:     dx = y * (g - sum_j g_j y_j)
  //   log_softmax: dx = g - softmax(x) * sum_j g_j = g - exp(y) * sum_j g_j
  // one kernel; in a pass with create_graph (grad mode on), the same formulas in ops that record.
  record(backward_name(name), {x}, {out},
         [saved = SavedTensor::output(out, name), s, d, log](const GradContext& g) -> TensorList {
           const Tensor y = saved.get();
           const Tensor gy = g[0].to(y.dtype());
           if (GradMode::is_enabled())
             return {log ? gy - exp(y) * gy.sum({d}, true) : y * (gy - (gy * y).sum({d}, true))};
           Tensor grad_in = empty(y.shape(), {.dtype = y.dtype(), .device = y.device()});
           if (y.numel() > 0) softmax_backward_kernel[y.device()](grad_in, gy.contiguous(), y, s, log);
           return {grad_in};
         }, DoubleBackward::Supported);
  return out;
}

}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) {
  HG_AUTOCAST(softmax, x, dim);
  return softmax_impl(x, dim, /*log=*/false);
}

Tensor log_softmax(const Tensor& x, int64_t dim) {
  HG_AUTOCAST(log_softmax, x, dim);
  return softmax_impl(x, dim, /*log=*/true);
}

// ---- CPU kernels
//
// inner == 1 (softmax over the last dim, the common case): threads take whole rows; each row is read
// three times (max, sum of exponentials, write), from cache for all but huge rows.
// inner > 1: threads take [size, kColumns] tiles of one outer index and keep kColumns running maxima and
// sums, so the inner loops run over contiguous columns and vectorise.
namespace {

constexpr int64_t kColumns = 64;
constexpr int64_t kParallelGrain = 16384;  // elements; smaller problems run on one thread

template <typename A> A negative_infinity() { return -std::numeric_limits<A>::infinity(); }
// max that lets a nan through only as "not bigger": a row with a nan becomes all nan through the sum.
template <typename A> A larger(A m, A v) { return v > m ? v : m; }

// One row at a time, in the accumulation type A, on Eigen arrays: Eigen's exp is vectorized (AVX-512 here), where
// std::exp is a scalar call per element (a quarter of a language model's CPU step went into it, over 33,278-word
// rows).
template <typename T> void softmax_rows(T* y, const T* x, SoftmaxShape s, bool log) {
  using A = opmath_t<T>;
  using Row = Eigen::Array<A, Eigen::Dynamic, 1>;
  const int64_t n = s.size;
  if (n == 0) return;
#pragma omp parallel if (s.outer * n >= kParallelGrain)
  {
    Row widened(std::is_same_v<T, A> ? 0 : n), out(n);
#pragma omp for schedule(static)
    for (int64_t o = 0; o < s.outer; ++o) {
      const T* xr = x + o * n;
      if constexpr (!std::is_same_v<T, A>) {
        for (int64_t j = 0; j < n; ++j) widened[j] = A(xr[j]);
      }
      const Eigen::Map<const Row> row(std::is_same_v<T, A> ? reinterpret_cast<const A*>(xr) : widened.data(), n);
      // The largest value, NaNs ignored (they reach the output through exp anyway); -inf for an all -inf row.
      const A m = row.template maxCoeff<Eigen::PropagateNumbers>();
      if (log) {
        const A log_sum = std::log((row - m).exp().sum());  // (x - m) - log_sum: x - m is exact, m + log_sum would round
        out = (row - m) - log_sum;
      } else {
        out = (row - m).exp();
        out *= A(1) / out.sum();
      }
      T* yr = y + o * n;
      for (int64_t j = 0; j < n; ++j) yr[j] = T(out[j]);
    }
  }
}

template <typename T> void softmax_columns(T* y, const T* x, SoftmaxShape s, bool log) {
  using A = opmath_t<T>;
  const int64_t tiles = (s.inner + kColumns - 1) / kColumns;
#pragma omp parallel for schedule(static) if (s.outer * s.size * s.inner >= kParallelGrain)
  for (int64_t task = 0; task < s.outer * tiles; ++task) {
    const int64_t o = task / tiles, i0 = (task % tiles) * kColumns, w = std::min(kColumns, s.inner - i0);
    const T* xb = x + o * s.size * s.inner + i0;
    T* yb = y + o * s.size * s.inner + i0;
    A m[kColumns], sum[kColumns];
    for (int64_t k = 0; k < w; ++k) {
      m[k] = negative_infinity<A>();
      sum[k] = 0;
    }
    for (int64_t j = 0; j < s.size; ++j)
      for (int64_t k = 0; k < w; ++k) m[k] = larger(m[k], A(xb[j * s.inner + k]));
    for (int64_t j = 0; j < s.size; ++j)
      for (int64_t k = 0; k < w; ++k) sum[k] += std::exp(A(xb[j * s.inner + k]) - m[k]);
    if (log) {
      for (int64_t k = 0; k < w; ++k) sum[k] = std::log(sum[k]);
      for (int64_t j = 0; j < s.size; ++j)
        for (int64_t k = 0; k < w; ++k) yb[j * s.inner + k] = T((A(xb[j * s.inner + k]) - m[k]) - sum[k]);
    } else {
      for (int64_t k = 0; k < w; ++k) sum[k] = A(1) / sum[k];
      for (int64_t j = 0; j < s.size; ++j)
        for (int64_t k = 0; k < w; ++k) yb[j * s.inner + k] = T(std::exp(A(xb[j * s.inner + k]) - m[k]) * sum[k]);
    }
  }
}

void softmax_cpu(const Tensor& out, const Tensor& in, SoftmaxShape s, bool log) {
  dispatch_floating(in.dtype(), log ? "log_softmax" : "softmax", [&]<typename T>() {
    if (s.inner == 1) {
      softmax_rows(out.data<T>(), in.data<T>(), s, log);
    } else {
      softmax_columns(out.data<T>(), in.data<T>(), s, log);
    }
  });
}

// The row's reduction r = sum(g * y) (softmax) or sum(g) (log_softmax), then
//   softmax: dx = y * (g - r);   log_softmax: dx = g - exp(y) * r.
template <typename T> void softmax_backward_rows(T* dx, const T* g, const T* y, SoftmaxShape s, bool log) {
  using A = opmath_t<T>;
  const int64_t n = s.size;
#pragma omp parallel for schedule(static) if (s.outer * n >= kParallelGrain)
  for (int64_t o = 0; o < s.outer; ++o) {
    const T *gr = g + o * n, *yr = y + o * n;
    T* dr = dx + o * n;
    A r = 0;
    if (log) {
      for (int64_t j = 0; j < n; ++j) r += A(gr[j]);
      if constexpr (std::is_same_v<T, A>) {  // Eigen's vectorized exp (see softmax_rows)
        using Row = Eigen::Array<A, Eigen::Dynamic, 1>;
        Eigen::Map<Row>(dr, n) = Eigen::Map<const Row>(gr, n) - Eigen::Map<const Row>(yr, n).exp() * r;
      } else {
        for (int64_t j = 0; j < n; ++j) dr[j] = T(A(gr[j]) - std::exp(A(yr[j])) * r);
      }
    } else {
      for (int64_t j = 0; j < n; ++j) r += A(gr[j]) * A(yr[j]);
      for (int64_t j = 0; j < n; ++j) dr[j] = T(A(yr[j]) * (A(gr[j]) - r));
    }
  }
}

template <typename T> void softmax_backward_columns(T* dx, const T* g, const T* y, SoftmaxShape s, bool log) {
  using A = opmath_t<T>;
  const int64_t tiles = (s.inner + kColumns - 1) / kColumns;
#pragma omp parallel for schedule(static) if (s.outer * s.size * s.inner >= kParallelGrain)
  for (int64_t task = 0; task < s.outer * tiles; ++task) {
    const int64_t o = task / tiles, i0 = (task % tiles) * kColumns, w = std::min(kColumns, s.inner - i0);
    const int64_t base = o * s.size * s.inner + i0;
    A r[kColumns] = {};
    for (int64_t j = 0; j < s.size; ++j) {
      const int64_t at = base + j * s.inner;
      for (int64_t k = 0; k < w; ++k) r[k] += log ? A(g[at + k]) : A(g[at + k]) * A(y[at + k]);
    }
    for (int64_t j = 0; j < s.size; ++j) {
      const int64_t at = base + j * s.inner;
      if (log) {
        for (int64_t k = 0; k < w; ++k) dx[at + k] = T(A(g[at + k]) - std::exp(A(y[at + k])) * r[k]);
      } else {
        for (int64_t k = 0; k < w; ++k) dx[at + k] = T(A(y[at + k]) * (A(g[at + k]) - r[k]));
      }
    }
  }
}

void softmax_backward_cpu(const Tensor& grad_in, const Tensor& grad_out, const Tensor& out, SoftmaxShape s, bool log) {
  dispatch_floating(out.dtype(), log ? "log_softmax_backward" : "softmax_backward", [&]<typename T>() {
    if (s.inner == 1) {
      softmax_backward_rows(grad_in.data<T>(), grad_out.data<T>(), out.data<T>(), s, log);
    } else {
      softmax_backward_columns(grad_in.data<T>(), grad_out.data<T>(), out.data<T>(), s, log);
    }
  });
}

}  // namespace

HG_REGISTER_KERNEL(softmax_kernel, CPU, softmax_cpu);
HG_REGISTER_KERNEL(softmax_backward_kernel, CPU, softmax_backward_cpu);

}  // namespace halfgrad

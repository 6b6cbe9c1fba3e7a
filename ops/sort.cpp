// sort, argsort, topk: the public ops and the CPU kernel. Their gradients are gather's (ops/gather.h).
#include "ops/sort.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <type_traits>

#include "ops/gather.h"

namespace halfgrad {

constinit KernelTable<SortKernel> sort_kernel("sort");
constinit KernelTable<TopKernel> top_kernel("topk");

namespace {

// The first k (k < 0: all) positions along dim (int64, contiguous) of x's slices in order: sort_kernel's, or
// top_kernel's where k is given.
Tensor sorted_positions(const char* op, const Tensor& x, int64_t dim, bool descending, int64_t k = -1) {
  HG_CHECK(x.defined(), "{}: the input is an undefined tensor", op);
  const Tensor source = x.dim() == 0 ? x.detach().view({1}) : x.detach();
  const int64_t d = wrap_dim(dim, source.dim(), op);
  // dim last, as rows of the kernel; the indices back to dim's place after.
  const Tensor rows = source.transpose(d, -1).contiguous();
  const int64_t n = rows.size(-1), count = rows.numel(), kept = k < 0 ? n : k;
  Shape kept_shape = rows.shape();
  kept_shape.back() = kept;
  Tensor order = empty(kept_shape, {.dtype = kInt64, .device = x.device()});
  if (count > 0 && kept > 0) {
    const Tensor keys = rows.view({count / n, n}), out = order.view({count / n, kept});
    if (k < 0) {
      sort_kernel[x.device()](out, keys, descending);
    } else {
      top_kernel[x.device()](out, keys, descending);
    }
  }
  const Tensor placed = order.transpose(d, -1).contiguous();
  return x.dim() == 0 ? placed.view({}) : placed;
}

}  // namespace

std::pair<Tensor, Tensor> sort(const Tensor& x, int64_t dim, bool descending, bool /*stable: always*/) {
  const Tensor indices = sorted_positions("sort", x, dim, descending);
  return {x.gather(dim, indices), indices};
}

Tensor argsort(const Tensor& x, int64_t dim, bool descending, bool /*stable: always*/) {
  return sorted_positions("argsort", x, dim, descending);
}

std::pair<Tensor, Tensor> topk(const Tensor& x, int64_t k, int64_t dim, bool largest, bool /*sorted: always*/) {
  HG_CHECK(x.defined(), "topk: the input is an undefined tensor");
  const Tensor source = x.dim() == 0 ? x.view({1}) : x;
  const int64_t d = wrap_dim(dim, source.dim(), "topk");
  if (x.dim() == 0) {  // one element: k 1 gives it back 0-d
    HG_CHECK(k == 0 || k == 1, "topk: k {} is out of range for the one element of {}; k must be 0 or 1", k, x.meta());
    if (k == 1) return sort(x, 0, largest);
  }
  HG_CHECK(k >= 0 && k <= source.size(d), "topk: k {} is out of range for dim {} of size {} of {}; k must be in [0, "
           "{}]", k, d, source.size(d), x.meta(), source.size(d));
  const Tensor top = sorted_positions("topk", source, d, largest, k);
  return {source.gather(d, top), top};
}

std::pair<Tensor, Tensor> Tensor::sort(int64_t dim, bool descending, bool stable) const {
  return halfgrad::sort(*this, dim, descending, stable);
}
Tensor Tensor::argsort(int64_t dim, bool descending, bool stable) const {
  return halfgrad::argsort(*this, dim, descending, stable);
}
std::pair<Tensor, Tensor> Tensor::topk(int64_t k, int64_t dim, bool largest, bool sorted) const {
  return halfgrad::topk(*this, k, dim, largest, sorted);
}

// ---- CPU kernel
namespace {

// PyTorch's order: NaN above every number; -0.0 and 0.0 compare equal as numbers do.
template <typename A> bool before(A a, A b, bool descending) {
  if constexpr (std::is_floating_point_v<A>) {
    if (std::isnan(a) || std::isnan(b)) return descending ? !std::isnan(b) : !std::isnan(a);
  }
  return descending ? b < a : a < b;
}

// top_kernel's CPU side: each row's positions partially sorted by (value in sort's order, position), the first k
// in order: the first k of a stable sort, in n log k.
void top_cpu(const Tensor& top, const Tensor& keys, bool largest) {
  const int64_t rows = keys.size(0), n = keys.size(1), k = top.size(1);
  dispatch_all(keys.dtype(), "topk", [&]<typename T>() {
    using A = opmath_t<T>;
    const T* v = keys.data<T>();
    int64_t* out = top.data<int64_t>();
#pragma omp parallel for schedule(dynamic, 1) if (rows > 1 && rows * n >= 32768)
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = v + r * n;
      std::vector<int64_t> order(static_cast<size_t>(n));
      std::iota(order.begin(), order.end(), int64_t(0));
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
        const A va = A(row[a]), vb = A(row[b]);
        return before<A>(va, vb, largest) || (!before<A>(vb, va, largest) && a < b);
      });
      std::copy(order.begin(), order.begin() + k, out + r * k);
    }
  });
}

void sort_cpu(const Tensor& indices, const Tensor& keys, bool descending) {
  const int64_t rows = keys.size(0), n = keys.size(1);
  dispatch_all(keys.dtype(), "sort", [&]<typename T>() {
    using A = opmath_t<T>;  // float16/bfloat16 compared as float
    const T* k = keys.data<T>();
    int64_t* out = indices.data<int64_t>();
#pragma omp parallel for schedule(dynamic, 1) if (rows > 1 && rows * n >= 32768)
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = k + r * n;
      int64_t* order = out + r * n;
      std::iota(order, order + n, int64_t(0));
      std::stable_sort(order, order + n,
                       [&](int64_t a, int64_t b) { return before<A>(A(row[a]), A(row[b]), descending); });
    }
  });
}

}  // namespace

HG_REGISTER_KERNEL(sort_kernel, CPU, sort_cpu);
HG_REGISTER_KERNEL(top_kernel, CPU, top_cpu);

}  // namespace halfgrad

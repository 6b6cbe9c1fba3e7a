// linear_cross_entropy's CUDA kernels (ops/linear_cross_entropy.h says what the padded path computes): the copies
// into and out of the padded operands, and one pass per row of the padded logits that leaves the loss and, in
// place, the gradient of the summed loss. The products between them are cuBLAS's (gemm_dense), called by the op.
#include <cuda_runtime.h>

#include <cstdio>
#include <type_traits>

#include "core/cuda.h"
#include "ops/copy_matrix.cuh"
#include "ops/linear_cross_entropy.h"
#include "ops/log_sum_exp.cuh"

namespace halfgrad {
namespace {

// Element (r, c) of a padded copy: see PaddedCopyKernel.
template <typename Src, typename Dst> struct PaddedElement {
  using A = opmath_t<Src>;
  const Src* src;
  int64_t src_rows, src_cols, src_ld;
  int64_t extra_index;
  const Src* extra;  // nullptr: ones
  __device__ Dst operator()(int64_t r, int64_t c) const {
    if (r >= src_rows) return Dst(0);
    if (c < src_cols) return Dst(A(src[r * src_ld + c]));
    if (c == extra_index) return extra ? Dst(extra[r]) : Dst(1);
    return Dst(0);
  }
};

void padded_copy_cuda(const Tensor& dst, const Tensor& src, int64_t extra_index, const Tensor& extra) {
  HG_CHECK(dst.dim() == 2 && dst.is_contiguous() && src.dim() == 2 && src.stride(1) == 1,
           "linear_cross_entropy: padded copy of {} into {}: a dense destination and unit column stride expected",
           src.meta(), dst.meta());
  HG_CHECK(!extra.defined() || (extra.dtype() == src.dtype() && extra.is_contiguous() && extra.numel() >= src.size(0)),
           "linear_cross_entropy: padded copy's extra column {} does not match {}", extra.meta(), src.meta());
  if (dst.numel() == 0) return;
  cuda::DeviceGuard guard(dst.device());
  cudaStream_t stream = cuda::current_stream(dst.device());
  dispatch_floating(src.dtype(), "linear_cross_entropy", [&]<typename Src>() {
    dispatch_floating(dst.dtype(), "linear_cross_entropy", [&]<typename Dst>() {
      const PaddedElement<Src, Dst> element{src.data<Src>(), src.size(0), src.size(1), src.stride(0), extra_index,
                                            extra.defined() ? extra.data<Src>() : nullptr};
      launch_copy_matrix(dst.data<Dst>(), dst.size(0), dst.size(1), dst.size(1), element, stream);
      HG_CUDA_CHECK_LAUNCH("linear_cross_entropy");
    });
  });
}

constexpr int kRowThreads = 512;

// One block per row of the padded logits x [ld] (16-byte aligned, ld a whole number of vectors).
template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    lce_rows_cuda_kernel(T* logits, int64_t ld, int64_t classes, const T* bias, const int64_t* target,
                         int64_t ignore_index, opmath_t<T>* row_loss, opmath_t<T>* row_count,
                         opmath_t<T> grad_factor) {
  using A = opmath_t<T>;
  using namespace log_sum_exp;
  constexpr int V = Vec16<T>::kSize;
  const int64_t row = blockIdx.x, c = target[row], vectors = ld / V;
  const bool ignored = c == ignore_index;
  Vec16<T>* x = reinterpret_cast<Vec16<T>*>(logits + row * ld);
  if (threadIdx.x == 0 && !ignored && (c < 0 || c >= classes)) {
    printf("linear_cross_entropy: target %lld at row %lld is out of range for %lld classes\n", (long long)c,
           (long long)row, (long long)classes);
    __assert_fail("target in [0, classes) or ignore_index", __FILE__, __LINE__, __func__);
  }
  // Logit j with the bias (j < classes).
  auto logit = [&](const Vec16<T>& in, int k, int64_t j) { return bias ? A(in.v[k]) + A(bias[j]) : A(in.v[k]); };
  // Read before row_reduce's barrier: past it the row is overwritten by the gradient.
  const A picked =
      threadIdx.x == 0 && !ignored ? A(logits[row * ld + c]) + (bias ? A(bias[c]) : A(0)) : A(0);
  MaxSum<A> st{-INFINITY, A(0)};
  for (int64_t v = threadIdx.x; v < vectors; v += blockDim.x) {
    const Vec16<T> in = x[v];
#pragma unroll
    for (int k = 0; k < V; ++k)
      if (v * V + k < classes) st = add_element(st, logit(in, k, v * V + k));
  }
  st = row_reduce<kRowThreads>(st, MergeOp{});
  const A log_sum = device_log(st.s);  // log-probabilities as (x - m) - log_sum: x - m is exact, m + log_sum rounds
  if (threadIdx.x == 0) {
    row_loss[row] = ignored ? A(0) : log_sum - (picked - st.m);
    row_count[row] = ignored ? A(0) : A(1);
  }
  if (grad_factor == A(0)) return;
  for (int64_t v = threadIdx.x; v < vectors; v += blockDim.x) {
    const Vec16<T> in = x[v];
    Vec16<T> out;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int64_t j = v * V + k;
      const A g =
          ignored || j >= classes ? A(0) : device_exp((logit(in, k, j) - st.m) - log_sum) - (j == c ? A(1) : A(0));
      out.v[k] = T(grad_factor * g);
    }
    x[v] = out;
  }
}

void lce_rows_cuda(const Tensor& logits, int64_t classes, const Tensor& bias, const Tensor& target,
                   int64_t ignore_index, const Tensor& row_loss, const Tensor& row_count, double grad_factor) {
  const int64_t rows = logits.size(0), ld = logits.size(1);
  HG_CHECK(logits.is_contiguous() && ld * int64_t(element_size(logits.dtype())) % 16 == 0 &&
               reinterpret_cast<uintptr_t>(logits.data_ptr()) % 16 == 0 && classes <= ld &&
               target.dtype() == kInt64 && target.is_contiguous() && target.numel() == rows &&
               (!bias.defined() || (bias.dtype() == logits.dtype() && bias.is_contiguous() &&
                                    bias.numel() == classes && bias.device() == logits.device())),
           "linear_cross_entropy: padded logits {} with {} classes, bias {} and target {}", logits.meta(), classes,
           bias.defined() ? bias.meta() : "none", target.meta());
  if (rows == 0) return;
  cuda::DeviceGuard guard(logits.device());
  cudaStream_t stream = cuda::current_stream(logits.device());
  dispatch_floating(logits.dtype(), "linear_cross_entropy", [&]<typename T>() {
    using A = opmath_t<T>;
    lce_rows_cuda_kernel<T><<<unsigned(rows), kRowThreads, 0, stream>>>(logits.data<T>(), ld, classes,
                                                                         bias.defined() ? bias.data<T>() : nullptr,
                                                                         target.data<int64_t>(), ignore_index,
                                                                         row_loss.data<A>(), row_count.data<A>(),
                                                                         A(grad_factor));
    HG_CUDA_CHECK_LAUNCH("linear_cross_entropy");
  });
}

}  // namespace

HG_REGISTER_KERNEL(padded_copy_kernel, CUDA, padded_copy_cuda);
HG_REGISTER_KERNEL(lce_rows_kernel, CUDA, lce_rows_cuda);

}  // namespace halfgrad

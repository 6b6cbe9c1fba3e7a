// cumsum: the public op with its backward next to it, and the CPU kernel.
#include "ops/cumsum.h"

#include <algorithm>
#include <array>

#include "core/autocast.h"
#include "core/autograd.h"
#include "ops/copy.h"
#include "ops/elementwise_math.h"
#include "ops/inplace.h"

namespace halfgrad {

constinit KernelTable<CumsumKernel> cumsum_kernel("cumsum");

namespace {
// t's running sums in `dtype` along the middle dim of [outer, length, inner], from the end where `reverse`: cumsum
// (from the start) and its backward (from the end), each the other's transpose and so its backward: differentiable to
// any order. `name`: the node's.
Tensor running_sums(const Tensor& t, DType dtype, int64_t outer, int64_t length, int64_t inner, bool reverse,
                    const char* name) {
  Tensor out = empty(t.shape(), {.dtype = dtype, .device = t.device()});
  if (out.numel() > 0) {
    cumsum_kernel[t.device()](out, cast_nograd(t.detach(), dtype).contiguous(), outer, length, inner, reverse);
  }
  if (!any_requires_grad({&t})) return out;  // (a plain backward pass: no closure to build)
  record(name, {t}, {out}, [outer, length, inner, reverse, input = t.dtype()](const GradContext& g) -> TensorList {
    return {running_sums(g[0], input, outer, length, inner, !reverse, "CumsumBackwardBackward")};
  }, DoubleBackward::Supported);
  return out;
}
}  // namespace

Tensor cumsum(const Tensor& x, int64_t dim, std::optional<DType> dtype) {
  HG_AUTOCAST(cumsum, x, dim, dtype);
  HG_CHECK(x.defined(), "cumsum: the input is an undefined tensor");
  const DType result = dtype ? *dtype : sum_dtype(x.dtype());
  HG_CHECK(result != kBool, "cumsum: running sums cannot be held in bool; got dtype bool for {}", x.meta());
  const int64_t d = wrap_dim(dim, std::max<int64_t>(x.dim(), 1), "cumsum");
  // x as [outer, length, inner] around dim d
  int64_t outer = 1, length = 1, inner = 1;
  for (int64_t k = 0; k < x.dim(); ++k) (k < d ? outer : k == d ? length : inner) *= x.size(k);
  // backward: x[i] reaches every out[k] with k >= i, so its gradient is the output's gradient summed from the end, in
  // x's dtype (as PyTorch's: a narrower result's dtype would overflow the sums).
  return running_sums(x, result, outer, length, inner, /*reverse=*/false, "CumsumBackward");
}

Tensor Tensor::cumsum(int64_t dim, std::optional<DType> dtype) const { return halfgrad::cumsum(*this, dim, dtype); }
Tensor& Tensor::cumsum_(int64_t dim) {
  HG_CHECK(defined(), "cumsum_: the tensor is undefined");
  HG_CHECK(dtype() != kBool, "cumsum_: running sums cannot be held in bool; got {}", meta());
  return apply_in_place(*this, "cumsum_", {}, [&](const Tensor& s) { return halfgrad::cumsum(s, dim, dtype()); });
}

// ---- CPU kernel
namespace {

// Threads take (outer index, block of up to kColumns inner columns) pairs; each walks its columns down the length in
// order, adding a row of them at a time (contiguous, so the adds vectorise), or a whole row where inner is 1.
constexpr int64_t kColumns = 256;

template <typename T>
void cumsum_typed(T* out, const T* x, int64_t outer, int64_t length, int64_t inner, bool reverse) {
  using A = opmath_t<T>;  // float for float16/bfloat16
  const int64_t blocks = (inner + kColumns - 1) / kColumns;
#pragma omp parallel for schedule(static) if (outer * length * inner >= 32768)
  for (int64_t item = 0; item < outer * blocks; ++item) {
    const int64_t o = item / blocks, c0 = (item % blocks) * kColumns, c1 = std::min(inner, c0 + kColumns);
    std::array<A, kColumns> sums;
    std::fill_n(sums.begin(), c1 - c0, A(0));
    for (int64_t k = 0; k < length; ++k) {
      const int64_t i = reverse ? length - 1 - k : k;
      const int64_t at = (o * length + i) * inner;
      for (int64_t c = c0; c < c1; ++c) {
        A& s = sums[size_t(c - c0)];
        s = binary_math<BinaryOp::Add>(s, A(x[at + c]));  // integers wrap
        out[at + c] = T(s);
      }
    }
  }
}

void cumsum_cpu(const Tensor& out, const Tensor& x, int64_t outer, int64_t length, int64_t inner, bool reverse) {
  dispatch_numeric(out.dtype(), "cumsum", [&]<typename T>() {
    cumsum_typed<T>(out.data<T>(), x.data<T>(), outer, length, inner, reverse);
  });
}

}  // namespace

HG_REGISTER_KERNEL(cumsum_kernel, CPU, cumsum_cpu);

}  // namespace halfgrad

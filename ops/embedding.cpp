// embedding: the public op with its backward next to it, and the CPU kernels.
#include "ops/embedding.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "core/autocast.h"
#include "core/autograd.h"
#include "ops/copy.h"

namespace halfgrad {

constinit KernelTable<EmbeddingKernel> embedding_kernel("embedding");
constinit KernelTable<EmbeddingBackwardKernel> embedding_backward_kernel("embedding_backward");

namespace {
// Every index of `indices` (int64, on the CPU) in [0, rows), or an error naming the first that is not.
void check_indices(const Tensor& indices, const Tensor& weight) {
  const int64_t rows = weight.size(0), n = indices.numel();
  const int64_t* index = indices.data<int64_t>();
  for (int64_t k = 0; k < n; ++k) {
    HG_CHECK(index[k] >= 0 && index[k] < rows,
             "embedding: index {} at position {} is out of range for a weight of {} rows ({}); indices must be in "
             "[0, {})", index[k], k, rows, weight.meta(), rows);
  }
}
}  // namespace

Tensor embedding(const Tensor& indices, const Tensor& weight, std::optional<int64_t> padding_idx) {
  HG_AUTOCAST(embedding, indices, weight, padding_idx);
  HG_CHECK(indices.defined() && weight.defined(), "embedding: got an undefined tensor (indices {}, weight {})",
           indices.meta(), weight.meta());
  HG_CHECK(weight.dim() == 2 && weight.is_floating_point(),
           "embedding: expected a floating-point weight of shape [V, D], got {}", weight.meta());
  HG_CHECK(is_integral(indices.dtype()), "embedding: expected integer indices (int64, int32 or uint8), got {}",
           indices.meta());
  HG_CHECK(indices.device() == weight.device(), "embedding: indices {} and weight {} are on different devices",
           indices.meta(), weight.meta());
  const int64_t rows = weight.size(0), dim = weight.size(1);
  int64_t pad = -1;
  if (padding_idx) {
    HG_CHECK(*padding_idx >= -rows && *padding_idx < rows,
             "embedding: padding_idx {} is out of range for a weight of {} rows ({})", *padding_idx, rows, weight.meta());
    pad = *padding_idx < 0 ? *padding_idx + rows : *padding_idx;
  }

  Tensor index = cast_nograd(indices.detach(), kInt64).contiguous();
  const int64_t n = index.numel();
  Shape out_shape = indices.shape();
  out_shape.push_back(dim);
  Tensor out = empty(out_shape, {.dtype = weight.dtype(), .device = weight.device()});
  if (n > 0 && dim == 0 && !index.is_cpu()) {
    // No output element for a device kernel to check its index by: checked here, as on the CPU (a copy of the indices
    // and a synchronisation, for a weight with no columns).
    check_indices(index.cpu(), weight);
  } else if (n > 0) {
    embedding_kernel[weight.device()](out.view({n, dim}), weight.detach().contiguous(), index.view({n}));
  }

  // backward: each output row's gradient is added into the weight row it was read from (repeated indices
  // add up); the padding row gets nothing.
  record("EmbeddingBackward", {weight}, {out},
         [saved_index = SavedTensor(index, "embedding"), rows, dim, n, pad](const GradContext& g) -> TensorList {
           const Tensor& index_ = saved_index.get();
           Tensor grad = g[0].contiguous().view({n, dim});
           const DType acc = grad.dtype() == kFloat64 ? kFloat64 : kFloat32;
           Tensor grad_weight = zeros({rows, dim}, {.dtype = acc, .device = grad.device()});
           if (n > 0 && dim > 0) embedding_backward_kernel[grad.device()](grad_weight, grad, index_.view({n}), pad);
           return {grad_weight};  // cast to the weight's dtype by the engine
         });
  return out;
}

// ---- CPU kernels
namespace {

void embedding_cpu(const Tensor& out, const Tensor& weight, const Tensor& indices) {
  check_indices(indices, weight);
  const int64_t n = indices.numel();
  const int64_t* index = indices.data<int64_t>();
  const size_t row_bytes = size_t(weight.size(1)) * element_size(weight.dtype());
  if (row_bytes == 0) return;  // a weight of no columns: nothing to copy, and no buffers (memcpy of null is undefined)
  const char* src = static_cast<const char*>(weight.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
#pragma omp parallel for schedule(static) if (int64_t(row_bytes) * n >= (int64_t(1) << 18))
  for (int64_t k = 0; k < n; ++k) std::memcpy(dst + size_t(k) * row_bytes, src + size_t(index[k]) * row_bytes, row_bytes);
}

// Threads own disjoint column ranges of grad_weight and each walks every index, so repeated indices never
// race; the inner loop runs over contiguous columns and vectorises.
void embedding_backward_cpu(const Tensor& grad_weight, const Tensor& grad, const Tensor& indices, int64_t padding_idx) {
  const int64_t n = indices.numel(), dim = grad.size(1);
  const int64_t* index = indices.data<int64_t>();
  dispatch_floating(grad.dtype(), "embedding_backward", [&]<typename T>() {
    using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
    A* gw = grad_weight.data<A>();
    const T* g = grad.data<T>();
    constexpr int64_t kMinColumns = 64;  // per thread
    const int threads = int(std::clamp<int64_t>(std::min<int64_t>(dim / kMinColumns, n * dim / 32768), 1,
                                                omp_get_max_threads()));
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t chunk = (dim + nt - 1) / nt, d0 = std::min(dim, t * chunk), d1 = std::min(dim, d0 + chunk);
      for (int64_t k = 0; k < n; ++k) {
        if (index[k] == padding_idx) continue;
        A* dst = gw + index[k] * dim;
        const T* src = g + k * dim;
        for (int64_t d = d0; d < d1; ++d) dst[d] += A(src[d]);
      }
    }
  });
}

}  // namespace

HG_REGISTER_KERNEL(embedding_kernel, CPU, embedding_cpu);
HG_REGISTER_KERNEL(embedding_backward_kernel, CPU, embedding_backward_cpu);

}  // namespace halfgrad

// embedding: the public op with its backward next to it, and the CPU kernels.
#include "ops/embedding.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>

#include "core/autocast.h"
#include "core/autograd.h"
#include "ops/copy.h"
#include "ops/gather.h"
#include "ops/stack.h"

namespace halfgrad {

constinit KernelTable<EmbeddingKernel> embedding_kernel("embedding");
constinit KernelTable<EmbeddingBackwardKernel> embedding_backward_kernel("embedding_backward");

namespace {
// Every index of `indices` (int64, on the CPU) in [0, rows), or an error naming the op, the first that is not, and
// what it indexes (`of`: "a weight of 10 rows (...)").
template <typename Of> void check_indices(const Tensor& indices, int64_t rows, const char* op, Of&& of) {
  const int64_t n = indices.numel();
  const int64_t* index = indices.data<int64_t>();
  for (int64_t k = 0; k < n; ++k) {
    HG_CHECK(index[k] >= 0 && index[k] < rows, "{}: index {} at position {} is out of range for {}; indices must be in "
             "[0, {})", op, index[k], k, of(), rows);
  }
}
void check_embedding_indices(const Tensor& indices, const Tensor& weight) {
  check_indices(indices, weight.size(0), "embedding",
                [&] { return fmt::format("a weight of {} rows ({})", weight.size(0), weight.meta()); });
}

Tensor gathered_rows(const Tensor& table, const SavedTensor& index, int64_t padding_idx);

// The gradient of rows gathered at `index` [n] (int64, contiguous): grad [n, D] added into zeros [rows, D] of the
// accumulation dtype (float32, or float64 for float64), skipping padding_idx (-1: none). It and gathered_rows are each
// the other's backward: linear in grad with the index fixed, so differentiable to any order.
Tensor scattered_rows(const Tensor& grad, const SavedTensor& index, int64_t rows, int64_t padding_idx) {
  const int64_t n = grad.size(0), dim = grad.size(1);
  const DType acc = accumulation_dtype(grad.dtype());
  Tensor grad_weight = zeros({rows, dim}, {.dtype = acc, .device = grad.device()});
  if (n > 0 && dim > 0) {
    embedding_backward_kernel[grad.device()](grad_weight, grad.detach().contiguous(), index.get(), padding_idx);
  }
  if (!any_requires_grad({&grad})) return grad_weight;  // (a plain backward pass: no closure to build)
  record("EmbeddingBackwardBackward", {grad}, {grad_weight}, [index, padding_idx](const GradContext& g) -> TensorList {
    return {gathered_rows(g[0], index, padding_idx)};
  }, DoubleBackward::Supported);
  return grad_weight;
}

// Rows of table [rows, D] at `index` [n] (int64, contiguous), zero where the index is padding_idx (-1: none), which
// took no gradient: the transpose of scattered_rows.
Tensor gathered_rows(const Tensor& table, const SavedTensor& index, int64_t padding_idx) {
  const Tensor at = index.get();
  const int64_t n = at.numel(), rows = table.size(0), dim = table.size(1);
  Tensor out = empty({n, dim}, {.dtype = table.dtype(), .device = table.device()});
  if (n > 0 && dim > 0) {
    embedding_kernel[table.device()](out, table.detach().contiguous(), at);
    NoGradGuard no_grad;
    if (padding_idx >= 0) out.masked_fill_(at.eq(padding_idx).view({n, 1}), 0);
  }
  record("EmbeddingGatherBackward", {table}, {out}, [index, rows, padding_idx](const GradContext& g)
      -> TensorList { return {scattered_rows(g[0], index, rows, padding_idx)}; }, DoubleBackward::Supported);
  return out;
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
    check_embedding_indices(index.cpu(), weight);
  } else if (n > 0) {
    embedding_kernel[weight.device()](out.view({n, dim}), weight.detach().contiguous(), index.view({n}));
  }

  // backward: each output row's gradient is added into the weight row it was read from (repeated indices
  // add up); the padding row gets nothing.
  record("EmbeddingBackward", {weight}, {out},
         [saved_index = SavedTensor(index.view({n}), "embedding"), rows, dim, n, pad](const GradContext& g)
             -> TensorList {
           // cast to the weight's dtype by the engine
           return {scattered_rows(g[0].reshape({n, dim}), saved_index, rows, pad)};
         }, DoubleBackward::Supported);
  return out;
}

Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index) {
  HG_CHECK(x.defined() && index.defined(), "index_select: got an undefined tensor (input {}, index {})", x.meta(),
           index.meta());
  HG_CHECK(index.dim() <= 1 && (index.dtype() == kInt64 || index.dtype() == kInt32),
           "index_select: expected a 1-D int64 or int32 index, got {}", index.meta());
  HG_CHECK(index.device() == x.device(), "index_select: input {} and index {} are on different devices", x.meta(),
           index.meta());
  const int64_t n = index.numel();
  HG_CHECK(x.dim() > 0 || n == 1, "index_select: the index of a 0-d input must hold one value, got {}", index.meta());
  const Tensor source = x.dim() == 0 ? x.view({1}) : x;
  const int64_t d = wrap_dim(dim, source.dim(), "index_select");
  // The output, as [n, columns] with dim first: for dim 0 embedding's row gather (the rows of x as a table) writes it;
  // for another dim gather's kernel (ops/gather.h) reads x where it lies, the index spread along dim, no copy of x. The
  // backward takes the gradient with dim first: `to_front` and its inverse `back` are the two permutations.
  Dims to_front{d}, back(size_t(source.dim()));
  for (int64_t k = 0; k < source.dim(); ++k)
    if (k != d) to_front.push_back(k);
  for (size_t k = 0; k < to_front.size(); ++k) back[size_t(to_front[k])] = int64_t(k);
  const int64_t rows = source.size(d);
  Shape gathered_shape{n};  // the output's shape with dim first
  for (size_t k = 1; k < to_front.size(); ++k) gathered_shape.push_back(source.size(to_front[k]));
  const int64_t columns = numel_of(Shape(gathered_shape.begin() + 1, gathered_shape.end()));
  const Tensor flat_index = cast_nograd(index.detach(), kInt64).contiguous().view({n});
  Shape out_shape = x.shape();
  if (x.dim() > 0) out_shape[size_t(d)] = n;
  Tensor out = empty(out_shape, {.dtype = x.dtype(), .device = x.device()});
  // Checked here on the CPU, to name this op (the kernels' own checks name embedding and gather), and for no columns on
  // a device, where no element's thread would check its index.
  if (n > 0 && (flat_index.is_cpu() || columns == 0)) {
    check_indices(flat_index.cpu(), rows, "index_select",
                  [&] { return fmt::format("dim {} of size {} of {}", d, rows, x.meta()); });
  }
  if (n > 0 && columns > 0) {
    if (d == 0) {
      embedding_kernel[x.device()](out.view({n, columns}), source.detach().contiguous().view({rows, columns}),
                                   flat_index);
    } else {
      Shape spread(size_t(source.dim()), 1);  // the index along dim, the same for every other coordinate
      spread[size_t(d)] = n;
      indexed_kernel[x.device()](IndexedOp::Gather, source.detach(), d, flat_index.view(spread).expand(out_shape),
                                 out);
    }
  }

  // backward: each selected slice's gradient added into the slice it came from (embedding's scatter).
  record("IndexSelectBackward", {x}, {out},
         [saved_index = SavedTensor(flat_index, "index_select"), to_front, back, gathered_shape, rows, columns,
          shape = x.shape()](const GradContext& g) -> TensorList {
           const Tensor grad = (shape.empty() ? g[0].view({1}) : g[0]).permute(to_front).contiguous();
           Shape front_shape = gathered_shape;
           front_shape[0] = rows;
           const Tensor scattered = scattered_rows(grad.view({gathered_shape[0], columns}), saved_index, rows, -1);
           return {scattered.view(front_shape).permute(back).reshape(shape)};  // cast to x's dtype by the engine
         }, DoubleBackward::Supported);
  return out;
}

Tensor Tensor::index_select(int64_t dim, const Tensor& index) const {
  return halfgrad::index_select(*this, dim, index);
}

Tensor one_hot(const Tensor& indices, int64_t num_classes) {
  HG_CHECK(indices.defined(), "one_hot: the indices are an undefined tensor");
  HG_CHECK(indices.dtype() == kInt64, "one_hot: expected int64 indices (class labels), got {}", indices.meta());
  HG_CHECK(num_classes >= -1, "one_hot: num_classes must be -1 (from the data) or >= 0, got {}", num_classes);
  if (indices.numel() > 0) {
    const Tensor bounds = stack({indices.min(), indices.max()}).cpu();  // one read back to the host
    const int64_t low = bounds.data<int64_t>()[0], high = bounds.data<int64_t>()[1];
    HG_CHECK(low >= 0, "one_hot: index {} of {} is negative", low, indices.meta());
    if (num_classes == -1) {
      HG_CHECK(high < std::numeric_limits<int64_t>::max(), "one_hot: index {} of {} leaves no number of classes",
               high, indices.meta());
      num_classes = high + 1;
    }
    HG_CHECK(high < num_classes, "one_hot: index {} of {} is out of range for {} classes", high, indices.meta(),
             num_classes);
  } else {
    HG_CHECK(num_classes > 0, "one_hot: num_classes cannot be inferred from the empty indices {}; give it (> 0)",
             indices.meta());
  }
  const Tensor classes = arange(0, num_classes, 1, {.dtype = kInt64, .device = indices.device()});
  return indices.unsqueeze(-1).eq(classes).to(kInt64);
}

// ---- CPU kernels
namespace {

void embedding_cpu(const Tensor& out, const Tensor& weight, const Tensor& indices) {
  check_embedding_indices(indices, weight);
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

#pragma once
// sort, argsort and topk: ordering along one dim (torch.sort, torch.argsort, torch.topk).
#include <cstdint>
#include <utility>

#include "core/dispatch.h"
#include "core/tensor.h"

namespace halfgrad {

// (values, indices) with x's slices along dim in ascending order (descending: descending), indices int64 positions
// along dim; both contiguous, x's shape. The order is PyTorch's: NaN above every number (last ascending, first
// descending), -0.0 and 0.0 equal; ties keep their order (a stable sort, whether or not `stable` asks for one).
// values are x gathered at indices (ops/gather.h), so their gradient goes back to the positions they came from.
// A 0-d x is one element. Any dtype (bool: false before true). Autocast: not cast (no row of its own; the gather of
// the values is unchanged). Where there are few long rows, the CUDA kernel sorts them one at a time, each with all
// the GPU (ops/sort.cu).
std::pair<Tensor, Tensor> sort(const Tensor& x, int64_t dim = -1, bool descending = false, bool stable = false);
// sort's indices alone.
Tensor argsort(const Tensor& x, int64_t dim = -1, bool descending = false, bool stable = false);
// The k largest (largest = false: smallest) of x along dim as (values, indices), in sort's order whether or not
// `sorted` asks for it (equal values by position, NaN above every number); 0 <= k <= size of dim. Gradient as
// sort's. The kernels select before they sort: the CPU's a partial sort of each slice (n log k), CUDA's a radix
// selection (ops/sort.cu) where k is at most half the slice and at most 1,024, then a sort of the k.
std::pair<Tensor, Tensor> topk(const Tensor& x, int64_t k, int64_t dim = -1, bool largest = true, bool sorted = true);

// ---- kernels
// indices [rows, n] (int64, contiguous) = for each row of keys [rows, n] (contiguous, any dtype) the positions of its
// values in order (stable; NaN above every number, -0.0 equal to 0.0), ascending or descending.
using SortKernel = void (*)(const Tensor& indices, const Tensor& keys, bool descending);
extern KernelTable<SortKernel> sort_kernel;
// top [rows, k] (int64, contiguous) = for each row of keys [rows, n] (contiguous, any dtype, k <= n) the positions of
// its k largest (largest = false: smallest) values in sort's order: the first k of sort_kernel's with descending =
// largest.
using TopKernel = void (*)(const Tensor& top, const Tensor& keys, bool largest);
extern KernelTable<TopKernel> top_kernel;

}  // namespace halfgrad

#pragma once
// gather, scatter and scatter_add: indexing element by element along one dim (torch.gather, torch.scatter,
// torch.scatter_add and their in-place Tensor methods), on one kernel per device.
//
// For every position p of index's shape, let q be p with dim's coordinate replaced by index[p]:
//   gather:      out[p] = x[q]                      out has index's shape
//   scatter:     out = self; out[q] = src[p]         (where index repeats a q, one of its writes wins)
//   scatter_add: out = self; out[q] += src[p]        (repeated q's add up)
// index: int64 or int32, as many dims as x (self); in every dim no larger than src's (the scatters) and than x's
// (self's) in every dim but dim; an empty index's dtype, dims and sizes are not checked (as PyTorch's), and it changes
// nothing. A 0-d tensor counts as one dim of size 1. Every value in [0, size of dim):
// out of range is an error naming the op, the value and its position on the CPU, and a device-side assertion on CUDA
// (the kernel prints the value and the size; the CUDA context is lost, as in PyTorch): reproduce on the CPU, or with
// HALFGRAD_CUDA_LAUNCH_BLOCKING=1, to locate it. All operands on one device; src has self's dtype; any strides.
// Autocast (core/autocast.h): gather and scatter unchanged; scatter_add promotes self and src to the wider of their
// floating dtypes (as PyTorch's: float16 src into float32 self), but as for the other promote ops a 0-d self beside a
// src with dims counts as a number (PyTorch would promote it too). Gradients (floating dtypes):
//   gather:      x gets each out[p]'s gradient added at q (float32 sums for float16/bfloat16; on CUDA atomically, so
//                float sums of repeated q's may differ in the last bits from run to run);
//   scatter:     self gets out's gradient but at the q's written (0 there); src[p] gets out's gradient at q;
//   scatter_add: self gets out's gradient; src[p] gets out's gradient at q.
// src elements outside index's shape take no part, and get a zero gradient. With repeated q's, scatter's gradient
// reaches every src[p] that wrote there, the one that won and the others (as PyTorch's).
#include <cstdint>

#include "core/dispatch.h"
#include "core/tensor.h"

namespace halfgrad {

Tensor gather(const Tensor& x, int64_t dim, const Tensor& index);
Tensor scatter(const Tensor& self, int64_t dim, const Tensor& index, const Tensor& src);
// src a number: value converted to self's dtype (an error where it does not fit), as fill_ converts it.
Tensor scatter(const Tensor& self, int64_t dim, const Tensor& index, const Scalar& value);
// scatter_add: numeric dtypes (not bool). On CUDA the additions are atomic: float sums of repeated q's may differ in
// the last bits from run to run; on the CPU each q's additions run in p's order.
Tensor scatter_add(const Tensor& self, int64_t dim, const Tensor& index, const Tensor& src);

// ---- kernel
// The one loop behind the ops, for every position p of index's shape (q as above, index[p] known to be in range on the
// CPU, asserted on CUDA):
enum class IndexedOp : uint8_t {
  Gather,      // dense[p] = indexed[q]
  Scatter,     // indexed[q] = dense[p]
  ScatterAdd,  // indexed[q] += dense[p]   (numeric dtypes; float16/bfloat16 sums rounded at each addition)
};
const char* indexed_op_name(IndexedOp op);  // "gather", "scatter", "scatter_add"
// indexed and dense of one dtype; index int64; dense and index of one shape, with indexed's number of dims and no
// larger than indexed in any dim but dim. Any strides; none 0-d (the op views a 0-d tensor as [1]). On the CPU the
// scatters' positions that differ only in dim's coordinate run in order on one thread, so no two threads write one
// element; gather's positions are split among threads in dense's order.
using IndexedKernel = void (*)(IndexedOp op, const Tensor& indexed, int64_t dim, const Tensor& index,
                               const Tensor& dense);
extern KernelTable<IndexedKernel> indexed_kernel;

}  // namespace halfgrad

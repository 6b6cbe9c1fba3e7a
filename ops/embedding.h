#pragma once
// embedding: a lookup table. Row i of weight [V, D] is the vector of index i; out[..., :] = weight[indices[...], :].
// index_select: the same gather along any dim of any tensor: along dim 0 on embedding's kernels, along another on
// gather's (ops/gather.h), which reads x where it lies.
#include <cstdint>
#include <optional>

#include "core/dispatch.h"
#include "core/tensor.h"

namespace halfgrad {

// Autocast category: "unchanged" (the result has the weight's dtype).
// indices: int64 (other integer dtypes are converted), any shape [...]; weight: [V, D] floating; the
// result is [..., D]. padding_idx (negative counts from V, as in PyTorch): that row receives no gradient.
// An index outside [0, V) is an error naming the index and V on the CPU; on CUDA it is a device-side
// assertion (the kernel prints the index and V, and the CUDA context is lost, as in PyTorch): reproduce on
// the CPU, or with HALFGRAD_CUDA_LAUNCH_BLOCKING=1, to locate it.
// The gradient of weight is dense ([V, D], zero in rows no index selected); indices get none.
Tensor embedding(const Tensor& indices, const Tensor& weight, std::optional<int64_t> padding_idx = std::nullopt);

// torch.index_select: x's slices at `index` along dim, in index's order (repeats allowed): out has x's shape with
// dim's size len(index), contiguous, x's dtype (any). index: 1-D (or 0-d) int64 or int32 (PyTorch's two) on x's
// device, each in [0, size of dim); out of range is an error naming index_select on the CPU, embedding's (dim 0) or
// gather's device-side assertion on CUDA. A 0-d x is one element along dim 0. Gradient (a floating x): each selected slice's gradient added
// into the slice it came from. Autocast: not cast (a gather).
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index);

// torch.nn.functional.one_hot: int64 [..., num_classes], 1 at each index of `indices` (int64, as PyTorch's) and 0
// elsewhere. num_classes -1: the largest index + 1. An index outside [0, num_classes) is an error: the smallest and
// largest index are read back to the host (one synchronisation on CUDA, where PyTorch's reads only when it infers
// num_classes and otherwise leaves a bad index to its kernel's device-side assertion).
Tensor one_hot(const Tensor& indices, int64_t num_classes = -1);

// ---- kernels
// Forward: out [n, D] = weight [V, D] rows at indices [n] (int64); all contiguous, out in weight's dtype (any dtype:
// index_select gathers integers too).
// Indices out of [0, V) are an error (CPU) or a device-side assertion (CUDA).
using EmbeddingKernel = void (*)(const Tensor& out, const Tensor& weight, const Tensor& indices);
// Backward: grad_weight [V, D] (float32 for float16/bfloat16/float32 gradients, float64 for float64;
// zeroed by the caller) += grad [n, D] rows scattered to `indices` [n], skipping padding_idx (-1: none).
// All contiguous. The CUDA kernel adds with atomics: sums of repeated indices may differ in the last bits
// from run to run.
using EmbeddingBackwardKernel = void (*)(const Tensor& grad_weight, const Tensor& grad, const Tensor& indices,
                                         int64_t padding_idx);
extern KernelTable<EmbeddingKernel> embedding_kernel;
extern KernelTable<EmbeddingBackwardKernel> embedding_backward_kernel;

}  // namespace halfgrad

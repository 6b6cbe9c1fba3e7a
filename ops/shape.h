#pragma once
// View ops (shape.cpp): the public ones are Tensor methods (core/tensor.h). These helpers build views
// without recording autograd, for kernels and for other ops' internals.
#include "core/tensor.h"

namespace halfgrad {

// A view of t's storage with the given geometry (no checks beyond what the caller guarantees).
Tensor make_view(const Tensor& t, Shape shape, Shape strides, int64_t offset);
// t viewed to `shape` by broadcasting (stride 0 on new or size-1 dims); throws if not broadcastable.
Tensor broadcast_view(const Tensor& t, const Shape& shape, const char* op);

// The format t's storage is laid out in: Contiguous when t is contiguous, ChannelsLast when it is a 4-D NHWC tensor
// that is not also contiguous, AlignedRows when it is an aligned-rows matrix (is_aligned_rows); none for a tensor
// with gaps or repeats that no format has (a slice, a transpose, a broadcast).
std::optional<MemoryFormat> storage_format(const Tensor& t);
// A tensor laid out in some format (storage_format) as a 1-D view of its storage in memory order, an aligned-rows
// matrix's zero padding included: what the kernels over contiguous arrays (the optimizers', the gradient norm's,
// unscaling's) take, whatever the layout. The views of two tensors of one shape and dtype laid out in one format
// correspond element for element.
Tensor flat_storage_view(const Tensor& t);

// Joins along dim; sizes must match elsewhere. An input of shape [0] joins any shape (PyTorch's legacy empty tensor: a
// list grown from empty({0})). ops/shape.cpp
Tensor cat(const TensorList& tensors, int64_t dim = 0);

}  // namespace halfgrad

#pragma once
// View ops (shape.cpp): the public ones are Tensor methods (core/tensor.h). These helpers build views
// without recording autograd, for kernels and for other ops' internals.
#include "core/tensor.h"

namespace halfgrad {

// A view of t's storage with the given geometry (no checks beyond what the caller guarantees).
Tensor make_view(const Tensor& t, Shape shape, Shape strides, int64_t offset);
// t viewed to `shape` by broadcasting (stride 0 on new or size-1 dims); throws if not broadcastable.
Tensor broadcast_view(const Tensor& t, const Shape& shape, const char* op);

Tensor cat(const TensorList& tensors, int64_t dim = 0);  // ops/shape.cpp

}  // namespace halfgrad

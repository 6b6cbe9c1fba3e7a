#pragma once
// stack: joins tensors of one shape along a new dim.
#include <cstdint>

#include "core/tensor.h"

namespace halfgrad {

// stack({a, b, c}, dim) has shape a.shape() with a new dim of size 3 inserted at `dim` (in [-(ndim + 1),
// ndim]; negative counts from the end of the result). Every tensor must have the same shape and device.
// Mixed dtypes are promoted as cat promotes them. Differentiable in every input. Autocast category:
// "promote". Built as cat of the unsqueezed inputs (ops/shape.cpp's cat).
Tensor stack(const TensorList& tensors, int64_t dim = 0);

}  // namespace halfgrad

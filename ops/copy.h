#pragma once
// Copies and casts (copy.cpp): Tensor::to, Tensor::copy_, contiguous(), clone().
#include "core/dispatch.h"
#include "core/tensor.h"

namespace halfgrad {

// dst and src on the same device; any dtypes (the kernel converts); src viewed to dst's shape.
using CopyKernel = void (*)(const Tensor& dst, const Tensor& src);
extern KernelTable<CopyKernel> copy_kernel;
// Between the host and a device, or two devices: registered by the device backend (CUDA slot).
// dst and src have the same dtype and shape and are contiguous.
extern KernelTable<CopyKernel> transfer_kernel;

// Casts without recording autograd: for ops that convert their inputs internally.
Tensor cast_nograd(const Tensor& t, DType dtype);

}  // namespace halfgrad

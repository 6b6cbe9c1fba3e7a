#pragma once
// Copies and casts (copy.cpp): Tensor::to, Tensor::copy_, contiguous(), clone(), copy_each_, cast_each.
#include "core/dispatch.h"
#include "core/tensor.h"

namespace halfgrad {

// dst and src on the same device; any dtypes (the kernel converts); src viewed to dst's shape.
using CopyKernel = void (*)(const Tensor& dst, const Tensor& src);
extern KernelTable<CopyKernel> copy_kernel;
// Between the host and a device, or two devices: registered by the device backend (CUDA slot).
// dst and src have the same dtype and shape and are contiguous.
extern KernelTable<CopyKernel> transfer_kernel;

// Casts without recording autograd: for ops that convert their inputs internally. The result keeps t's layout
// (kept_memory_format).
Tensor cast_nograd(const Tensor& t, DType dtype);
// `values`, t's values already cast to another floating dtype, as t.to(values.dtype()) returns them: an alias of
// values with the cast's backward recorded (where t requires grad). How autocast hands out a kept cast (core/autocast.h).
Tensor as_cast_of(const Tensor& t, const Tensor& values);

// A 2-D t as an aligned-rows matrix (MemoryFormat::AlignedRows): itself when it is one, else a copy
// (differentiable, like contiguous()).
Tensor contiguous_aligned_rows(const Tensor& t);

// dst[i].copy_(src[i]) for every i, without autograd (torch._foreach_copy_): every pair the same shape and device,
// any dtypes. The pairs both contiguous or both channels_last whose dtypes copy_each_kernel_takes go to
// copy_each_kernel, which on CUDA copies them in batches (multi-tensor apply, ops/multi_tensor.cuh), a launch each,
// where a copy each would cost a launch each (a ResNet-50's 161 gradients into DistributedDataParallel's buckets and
// back: ~0.8 ms of tiny copies a step); the other pairs are copied one by one. No destination may overlap another
// pair's tensors (the copies are not ordered). Lists of different lengths, or a pair of different shapes or devices,
// is an error naming the pair, before anything is copied; so is a pair whose destination shares part of its memory
// with its source, and a destination that autograd forbids writing (a leaf that requires grad, while grad mode is on).
void copy_each_(const TensorList& dst, const TensorList& src);
// tensors[i] cast to dtypes[i] for every i, each into a new tensor as cast_nograd makes it (its layout kept), without
// autograd: those for which casts_in_batches holds in batches, as copy_each_ copies, the others one by one. The
// autograd engine casts a backward's float16 weight gradients to float32 with it (ResNet-18: 22 in one launch).
TensorList cast_each(const TensorList& tensors, const std::vector<DType>& dtypes);
// Whether cast_each casts t to `dtype` in a batch: float32 from or to float16 or bfloat16, t contiguous or
// channels_last.
bool casts_in_batches(const Tensor& t, DType dtype);
// The dtypes copy_each_kernel takes: one dtype, or float32 and float16 or bfloat16 either way.
bool copy_each_kernel_takes(DType dst, DType src);
// 1-D pairs on one device, none empty, all of one destination dtype and one source dtype that it takes.
using CopyEachKernel = void (*)(const TensorList& dst, const TensorList& src);
extern KernelTable<CopyEachKernel> copy_each_kernel;

}  // namespace halfgrad

#pragma once
// cumsum: running sums along one dim (torch.cumsum, Tensor.cumsum, Tensor.cumsum_).
#include <cstdint>
#include <optional>

#include "core/dispatch.h"
#include "core/tensor.h"

namespace halfgrad {

// out[..., i, ...] = x[..., 0, ...] + ... + x[..., i, ...] along dim (a 0-d x counts as one dim of 1). The result
// has `dtype` where given, else x's for floating x and int64 for integral and bool x (PyTorch's: running sums of
// int32 or uint8 overflow soon); x is converted to it first, and its sums are kept in it (float16 and bfloat16 in
// float32, each output rounded once; integers wrapping). The CPU adds in order along dim, as CUDA does for short rows
// and for many or short columns; CUDA's scans of longer rows and of few long columns (block-wide, or device-wide for
// few long rows) add in another order, so float sums may differ in the last bits between the devices. Gradient: the
// output's gradient cast to x's dtype and summed from the end (the reversed running sums; a narrower dtype would
// overflow them). Autocast: float32, as PyTorch's.
Tensor cumsum(const Tensor& x, int64_t dim, std::optional<DType> dtype = std::nullopt);

// ---- kernel
// out = the running sums of x along the middle dim of [outer, length, inner], from its start or (reverse) from its end.
// out and x contiguous, of one numeric dtype (not bool); length >= 1.
using CumsumKernel = void (*)(const Tensor& out, const Tensor& x, int64_t outer, int64_t length, int64_t inner,
                              bool reverse);
extern KernelTable<CumsumKernel> cumsum_kernel;

}  // namespace halfgrad

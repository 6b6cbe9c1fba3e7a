#pragma once
// What the row-wise CUDA ops (sort and topk in ops/sort.cu, cumsum in ops/cumsum.cu) share about cub's device-wide
// algorithms: when a row gets all the GPU, and cub's two-step call.
#include <cstddef>
#include <cstdint>

#include "core/cuda.h"
#include "core/tensor.h"

namespace halfgrad {

// Few long rows (up to 64 rows of 2^16 or more) are handed one at a time to a device-wide algorithm, all the GPU on
// each, where a block a row would leave most of it idle.
inline bool few_long_rows(int64_t rows, int64_t length) { return rows <= 64 && length >= (int64_t(1) << 16); }

// cub's device-wide calls size their scratch when given none: call(nullptr, bytes, 0) does that, then
// call(scratch, bytes, r) runs for r in [0, calls). `call` returns cub's cudaError_t.
template <typename Call> void run_with_cub_scratch(Device device, int64_t calls, Call call) {
  size_t bytes = 0;
  HG_CUDA_CHECK(call(nullptr, bytes, int64_t(0)));
  Tensor scratch = empty({int64_t(bytes)}, {.dtype = kUInt8, .device = device});
  for (int64_t r = 0; r < calls; ++r) HG_CUDA_CHECK(call(scratch.data_ptr(), bytes, r));
}

}  // namespace halfgrad

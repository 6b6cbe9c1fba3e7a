#pragma once
// The copy of one row-major matrix into another of any shape, shared by the products that run on padded operands:
// matmul's zero-padded copies (ops/matmul.cu) and linear_cross_entropy's casts into padded operands and its copies out
// of them (ops/linear_cross_entropy.cu), and by Tensor::copy_ between matrices' rows (ops/copy.cu). Each caller says
// what element (r, c) of the destination is.
//
// A warp copies a tile of one row, 32 x kCopyPerLane elements: each lane kCopyPerLane elements 32 apart, loads first,
// so that every load and store of the warp is one coalesced run and a lane has kCopyPerLane loads in flight. (A lane
// with one 2-byte load at a time ran at a tenth of the bandwidth; 16-byte stores 16 bytes apart across the lanes at a
// third.) Any leading dimension and address: nothing needs alignment.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "core/cuda.h"

namespace halfgrad {

constexpr int kCopyPerLane = 8;
constexpr int kCopyWarps = 8;  // a block's warps

// dst [rows, cols] (leading dimension dst_ld): dst[r, c] = element(r, c).
template <typename Dst, typename Element>
__global__ void copy_matrix_kernel(Dst* dst, int64_t rows, int64_t cols, int64_t dst_ld, Element element) {
  constexpr int64_t kTile = 32 * kCopyPerLane;
  const int64_t tiles_per_row = (cols + kTile - 1) / kTile, tiles = rows * tiles_per_row;
  const int lane = threadIdx.x % 32;
  for (int64_t t = int64_t(blockIdx.x) * kCopyWarps + threadIdx.x / 32; t < tiles; t += int64_t(gridDim.x) * kCopyWarps) {
    const int64_t r = t / tiles_per_row, c0 = (t - r * tiles_per_row) * kTile + lane;
    Dst v[kCopyPerLane];
#pragma unroll
    for (int u = 0; u < kCopyPerLane; ++u) v[u] = element(r, c0 + 32 * u);
    Dst* out = dst + r * dst_ld;
#pragma unroll
    for (int u = 0; u < kCopyPerLane; ++u)
      if (c0 + 32 * u < cols) out[c0 + 32 * u] = v[u];
  }
}

template <typename Dst, typename Element>
void launch_copy_matrix(Dst* dst, int64_t rows, int64_t cols, int64_t dst_ld, Element element, cudaStream_t stream) {
  const int64_t tiles = rows * ((cols + 32 * kCopyPerLane - 1) / (32 * kCopyPerLane));
  const unsigned blocks = unsigned(std::clamp<int64_t>((tiles + kCopyWarps - 1) / kCopyWarps, 1, 1 << 20));
  copy_matrix_kernel<<<blocks, 32 * kCopyWarps, 0, stream>>>(dst, rows, cols, dst_ld, element);
}

// The copy most callers want: dst [rows, cols] (leading dimension dst_ld) takes src [src_rows, src_cols] (leading
// dimension src_ld) where it reaches, zeros beyond. Matmul's padded products use it three ways: a zero-padded copy
// (dst larger), the corner of a padded C copied back (dst smaller), and bias rows (src_ld 0: one row for all);
// Tensor::copy_ for rows of one matrix into rows of another (the same size).
template <typename T> struct ZeroPadded {
  const T* src;
  int64_t src_rows, src_cols, src_ld;
  __device__ T operator()(int64_t r, int64_t c) const {
    return r < src_rows && c < src_cols ? src[r * src_ld + c] : T(0);
  }
};

struct MatrixRef {
  const void* data;
  int64_t rows, cols, ld;
};

// ZeroPadded's copy of elements of `element_size` bytes (moved as raw bits); `op` names the caller in a launch error.
inline void copy_matrix(size_t element_size, void* dst, int64_t rows, int64_t cols, int64_t dst_ld, MatrixRef src,
                        cudaStream_t stream, const char* op) {
  auto launch = [&]<typename T>() {
    launch_copy_matrix(static_cast<T*>(dst), rows, cols, dst_ld,
                       ZeroPadded<T>{static_cast<const T*>(src.data), src.rows, src.cols, src.ld}, stream);
    HG_CUDA_CHECK_LAUNCH(op);
  };
  switch (element_size) {
    case 1: launch.template operator()<uint8_t>(); break;
    case 2: launch.template operator()<uint16_t>(); break;
    case 4: launch.template operator()<uint32_t>(); break;
    default: launch.template operator()<uint64_t>(); break;
  }
}

}  // namespace halfgrad

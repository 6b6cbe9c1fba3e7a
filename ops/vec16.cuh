#pragma once
// The 16-byte vector CUDA kernels load and store a run of elements in: the softmax family's row kernels
// (ops/log_sum_exp.cuh) and global average pooling's backward (ops/pool.cu).

namespace halfgrad {

// kSize elements of T in one 16-byte load or store.
template <typename T> struct alignas(16) Vec16 {
  static constexpr int kSize = int(16 / sizeof(T));
  T v[kSize];
};

}  // namespace halfgrad

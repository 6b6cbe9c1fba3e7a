#pragma once
// How an elementwise loop walks its operands, planned once for both backends (the CPU loops of ops/loops.h and the
// CUDA kernels of ops/cuda_loops.cuh): the dims are ordered by the output's strides, innermost (smallest) first,
// so that a channels-last or otherwise permuted output is walked in its memory order; then a dim is merged into
// the one inside it when every operand steps over both contiguously, so that a dense problem whose operands share a
// layout (contiguous, channels last) or a simply broadcast one becomes one flat run.
#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace halfgrad {

// The dims of a tensor with these strides from the outermost in memory to the innermost: by stride, ties in their
// logical order.
inline Dims dims_in_memory_order(const Shape& strides) {
  Dims order(strides.size());
  for (size_t d = 0; d < order.size(); ++d) order[d] = int64_t(d);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return strides[size_t(a)] > strides[size_t(b)]; });
  return order;
}

// The merged dims, innermost first: their sizes and each operand's stride over them in bytes.
template <int N> struct CoalescedDims {
  std::vector<int64_t> sizes;
  std::vector<std::array<int64_t, N>> byte_strides;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : sizes) n *= s;
    return n;
  }
};

// Operand 0 is the output; operand k has `shape` with strides *strides[k] in elements of element_sizes[k] bytes,
// or is a scalar (strides[k] null: stride 0 everywhere). Size-1 dims are dropped; a single element is one dim of 1.
template <int N>
CoalescedDims<N> coalesce_dims(const Shape& shape, const std::array<const Shape*, N>& strides,
                               const std::array<int64_t, N>& element_sizes) {
  CoalescedDims<N> c;
  const Dims order = dims_in_memory_order(*strides[0]);
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    const size_t d = size_t(*it);
    if (shape[d] == 1) continue;
    std::array<int64_t, N> s;
    for (int k = 0; k < N; ++k) s[k] = strides[k] ? (*strides[k])[d] * element_sizes[k] : 0;
    bool merge = !c.sizes.empty();
    for (int k = 0; k < N && merge; ++k) merge = s[k] == c.byte_strides.back()[k] * c.sizes.back();
    if (merge) {
      c.sizes.back() *= shape[d];
    } else {
      c.sizes.push_back(shape[d]);
      c.byte_strides.push_back(s);
    }
  }
  if (c.sizes.empty()) {
    c.sizes.push_back(1);
    c.byte_strides.push_back({});
  }
  return c;
}

}  // namespace halfgrad

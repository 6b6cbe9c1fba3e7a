#pragma once
// CPU loops over strided operands: the machinery behind every elementwise kernel on the CPU.
//
// An elementwise op has N operands (the output first) already viewed to one common shape (broadcast
// inputs have stride 0). The loop walks the dims as ops/coalesce.h orders and merges them (a dense problem whose
// operands share one layout becomes one flat run the compiler vectorises), and splits the elements into ranges
// that OpenMP threads walk independently.
#include <omp.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "ops/coalesce.h"

namespace halfgrad::cpu {

template <int N> struct StridedLoop {
  Shape shape;                          // coalesced, outermost first
  std::array<Shape, N> byte_strides;    // per operand, per coalesced dim
  std::array<char*, N> base;
  int64_t numel = 0;

  explicit StridedLoop(const std::array<Tensor, N>& operands) {
    const Shape& full = operands[0].shape();
    numel = numel_of(full);
    std::array<const Shape*, N> strides;
    std::array<int64_t, N> element_sizes;
    for (int k = 0; k < N; ++k) {
      base[k] = static_cast<char*>(operands[k].data_ptr());
      strides[k] = &operands[k].strides();
      element_sizes[k] = int64_t(element_size(operands[k].dtype()));
    }
    const CoalescedDims<N> dims = coalesce_dims<N>(full, strides, element_sizes);  // innermost first
    shape.assign(dims.sizes.rbegin(), dims.sizes.rend());
    for (auto it = dims.byte_strides.rbegin(); it != dims.byte_strides.rend(); ++it)
      for (int k = 0; k < N; ++k) byte_strides[k].push_back((*it)[k]);
  }

  // Calls inner(ptrs, strides, n) for runs of n elements along the innermost dim; `inner` must handle any
  // stride (kernels check for the contiguous case themselves). Threads take disjoint ranges of elements.
  template <typename Inner> void run(Inner inner, int64_t grain = 32768) const {
    if (numel == 0) return;
    const int64_t inner_size = shape.back();
    std::array<int64_t, N> inner_strides;
    for (int k = 0; k < N; ++k) inner_strides[k] = byte_strides[k].back();
    auto run_range = [&](int64_t begin, int64_t end) {
      // Position of `begin` as (outer multi-index, inner index).
      const int64_t ndim = int64_t(shape.size());
      Shape index(size_t(ndim), 0);
      int64_t rest = begin;
      for (int64_t d = ndim - 1; d >= 0; --d) {
        index[d] = rest % shape[d];
        rest /= shape[d];
      }
      std::array<char*, N> ptrs;
      for (int k = 0; k < N; ++k) {
        ptrs[k] = base[k];
        for (int64_t d = 0; d < ndim; ++d) ptrs[k] += index[d] * byte_strides[k][d];
      }
      int64_t pos = begin;
      while (pos < end) {
        int64_t n = std::min(inner_size - index[ndim - 1], end - pos);
        inner(ptrs, inner_strides, n);
        pos += n;
        // Advance to the start of the next row (carry through the outer dims).
        for (int k = 0; k < N; ++k) ptrs[k] += n * inner_strides[k];
        index[ndim - 1] += n;
        for (int64_t d = ndim - 1; d > 0 && index[d] == shape[d]; --d) {
          index[d] = 0;
          ++index[d - 1];
          for (int k = 0; k < N; ++k) ptrs[k] += byte_strides[k][d - 1] - shape[d] * byte_strides[k][d];
        }
      }
    };
    int threads = numel >= 2 * grain ? omp_get_max_threads() : 1;
    if (threads <= 1) {
      run_range(0, numel);
      return;
    }
#pragma omp parallel num_threads(threads)
    {
      int t = omp_get_thread_num(), nt = omp_get_num_threads();
      int64_t chunk = (numel + nt - 1) / nt;
      chunk = (chunk + 63) / 64 * 64;  // ranges start on cache-line-friendly element counts
      int64_t begin = std::min(numel, t * chunk), end = std::min(numel, begin + chunk);
      if (begin < end) run_range(begin, end);
    }
  }
};

// N copies of one value, for a broadcast operand in a contiguous run (see map). Left uninitialised until filled:
// the user-provided constructor keeps std::tuple from zeroing it.
template <typename T, int64_t N> struct Repeated {
  T values[N];
  Repeated() {}
  const T* fill(T v, int64_t count) {  // the first `count` (at most N): a run may be shorter than a block
    for (int64_t i = 0; i < count; ++i) values[i] = v;
    return values;
  }
};

// float16 values are handed to the functor as float in contiguous runs (see map).
template <typename T> using widened_t = std::conditional_t<std::is_same_v<T, Half>, float, T>;

// p[0..n) as widened_t<T>: converted into `buffer` for float16, else p itself.
template <typename T> const widened_t<T>* widen(const T* p, int64_t n, float* buffer) {
  if constexpr (std::is_same_v<T, Half>) {
    half_to_float(p, buffer, n);
    return buffer;
  } else {
    return p;
  }
}

// out[i] = f(in0[i], in1[i], ...) with the storage types given; f computes on loaded values.
// Contiguous runs (and runs where an input is a broadcast scalar) get a plain indexed loop that vectorises. In a
// contiguous run with float16 operands, blocks of them are widened to float (and the result narrowed) by the bulk
// F16C conversions of core/half.h, so f sees float there and its loop vectorises too; one value at a time, a
// float16 conversion is several instructions and f's selects become branches. f must therefore take its float16
// operands as float or auto (a functor that takes Half gets exact float16 values either way).
template <typename Out, typename... In, typename F>
void map(const Tensor& out, F f, const std::array<Tensor, sizeof...(In)>& inputs) {
  constexpr int N = 1 + int(sizeof...(In));
  std::array<Tensor, N> operands;
  operands[0] = out;
  for (int k = 1; k < N; ++k) operands[k] = inputs[size_t(k - 1)];
  StridedLoop<N> loop(operands);
  loop.run([&](const std::array<char*, N>& p, const std::array<int64_t, N>& s, int64_t n) {
    [&]<size_t... K>(std::index_sequence<K...>) {
      Out* o = reinterpret_cast<Out*>(p[0]);
      bool contiguous = s[0] == int64_t(sizeof(Out)) && ((s[K + 1] == int64_t(sizeof(In))) && ...);
      if (contiguous) {
        std::tuple<const In*...> in{reinterpret_cast<const In*>(p[K + 1])...};
        if constexpr (std::is_same_v<Out, Half> || (std::is_same_v<In, Half> || ...)) {
          constexpr int64_t kBlock = 512;
          // Left uninitialised: a run may be a few values long.
          float wide_in[std::max<size_t>(sizeof...(In), 1)][kBlock], wide_out[kBlock];
          for (int64_t b = 0; b < n; b += kBlock) {
            const int64_t len = std::min(kBlock, n - b);
            std::tuple<const widened_t<In>*...> w{widen(std::get<K>(in) + b, len, wide_in[K])...};
            if constexpr (std::is_same_v<Out, Half>) {
              for (int64_t i = 0; i < len; ++i) wide_out[i] = f(std::get<K>(w)[i]...);
              float_to_half(wide_out, o + b, len);
            } else {
              for (int64_t i = 0; i < len; ++i) o[b + i] = f(std::get<K>(w)[i]...);
            }
          }
          return;
        }
        for (int64_t i = 0; i < n; ++i) o[i] = f(std::get<K>(in)[i]...);
        return;
      }
      // A contiguous run where some inputs are broadcast (stride 0, e.g. a scalar): each such value is repeated
      // into a block of its own once, so that the loop reads every operand contiguously and still vectorises.
      if ((s[0] == int64_t(sizeof(Out))) && ((s[K + 1] == int64_t(sizeof(In)) || s[K + 1] == 0) && ...)) {
        constexpr int64_t kBlock = 512;
        [[maybe_unused]] const int64_t filled = std::min(kBlock, n);  // unused by ops without inputs (fill)
        std::tuple<Repeated<In, kBlock>...> repeated;
        std::tuple<const In*...> src{
            (s[K + 1] == 0 ? std::get<K>(repeated).fill(*reinterpret_cast<const In*>(p[K + 1]), filled)
                           : reinterpret_cast<const In*>(p[K + 1]))...};
        for (int64_t b = 0; b < n; b += kBlock) {
          const int64_t len = std::min(kBlock, n - b);
          std::tuple<const In*...> at{(s[K + 1] == 0 ? std::get<K>(src) : std::get<K>(src) + b)...};
          for (int64_t i = 0; i < len; ++i) o[b + i] = f(std::get<K>(at)[i]...);
        }
        return;
      }
      {
        for (int64_t i = 0; i < n; ++i)
          *reinterpret_cast<Out*>(p[0] + i * s[0]) = f(*reinterpret_cast<const In*>(p[K + 1] + i * s[K + 1])...);
      }
    }(std::index_sequence_for<In...>{});
  });
}

}  // namespace halfgrad::cpu

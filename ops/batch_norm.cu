// batch_norm on CUDA: the kernels behind batch_norm_forward_kernel and batch_norm_backward_kernel
// (ops/batch_norm.h), for both layouts (planes = NCHW, rows = channels last: NHWC and [N, C]).
//
// Forward (training): 1. per-channel partial statistics, 2. finalize, 3. apply.
//   1. reduce: the M = N * S values of each channel are cut into `splits` ranges so that there are enough
//      blocks to fill the GPU; each block reduces its range and writes one partial state per channel.
//        planes: block (256 threads) per (channel, split); a channel is N planes of S contiguous values.
//        rows:   block (tx channel vectors x ty rows) per (channel tile, split); neighbouring threads read
//                neighbouring channels of a row (coalesced).
//      Statistics are sums shifted by a value of the channel (ShiftedSums: count, sum of x - K, sum of
//      (x - K)^2), which merge by addition and do not cancel when the mean is large next to the spread.
//   2. finalize (one warp per channel): merges the splits, writes mean and invstd (saved for backward),
//      updates the running statistics in place, and writes scale = invstd * weight, shift = bias.
//   3. apply: y = (x - mean[c]) * scale[c] + shift[c], elementwise; batch_norm_relu adds the residual and takes
//      relu before the store, and stores relu's mask (y > 0) as bits unless the op keeps y instead (ReluSaved).
// Forward (eval): 2'. mean, invstd, scale, shift from the running statistics, 3. apply.
// Backward: 1. per-channel sums of g and g * (x - mean) (same reduction kernels), 2. finalize: grad_weight,
// grad_bias and three per-channel coefficients, 3. apply: grad_input = g * alpha + (x - mean) * beta + gamma.
// After batch_norm_relu, 1. and 3. read relu's mask too and take g only where its bit is set; 3. writes that masked
// g as the residual's gradient. Where the op kept y instead of the mask, a pass makes the mask from y first (reading
// y in both passes cost more: session 44, docs/benchmarks.md); the masked-gradient pass (before cuDNN's kernels, or
// for the residual's gradient alone) reads y itself.
//
// 4. cuDNN's kernels (the ones PyTorch calls), the second implementation of training, and the choice between
//    the two per problem (BatchNormBackend in ops/batch_norm.h).
//
// Loads and stores are 16 bytes wide (8 float16/bfloat16, 4 float32, 2 float64 values) when the contiguous
// dimension (S for planes, C for rows) is a multiple of that and the data are 16-byte aligned; otherwise one
// value at a time. Inputs are float16/bfloat16/float32 (statistics in float32) or float64 (in float64).
#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <climits>
#include <compare>
#include <cstdint>
#include <map>
#include <numeric>
#include <optional>
#include <type_traits>
#include <utility>

#include "core/cuda.h"
#include "core/cuda_graph.h"
#include "core/int_divider.h"
#include "core/log.h"
#include "ops/batch_norm.h"
#include "ops/cuda_loops.cuh"
#include "ops/elementwise_math.h"

namespace halfgrad {
namespace {

using cuda::Vec;

constexpr int kThreads = 256;
constexpr int kUnroll = 4;                // vectors in flight per thread
constexpr int64_t kMinVectorsPerThread = 8;  // a split leaves each thread at least this many vectors

template <typename T> using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;
template <typename T> constexpr int kVector = int(16 / sizeof(T));  // values per 16-byte access

// (halfgrad::min, the reduction, would hide CUDA's min wherever ops/reduce.h is visible)
template <typename I> __host__ __device__ __forceinline__ I smaller(I a, I b) { return a < b ? a : b; }

template <typename T, int V> __device__ __forceinline__ Vec<T, V> load(const T* p) {
  return *reinterpret_cast<const Vec<T, V>*>(p);
}
template <typename T, int V> __device__ __forceinline__ void store(T* p, const Vec<T, V>& v) {
  *reinterpret_cast<Vec<T, V>*>(p) = v;
}

// ---- relu's mask (ReluMask, ops/batch_norm.h): bit i % 32 of word i / 32 for element i.

// The V bits of the vector that starts at element e (e a multiple of V, V dividing 32: one word holds them).
template <int V> __device__ __forceinline__ uint32_t mask_bits(const int32_t* mask, int64_t e) {
  return (uint32_t(mask[e / 32]) >> (e % 32)) & ((1u << V) - 1u);
}

// g where its mask bit is set, else 0: bit e of bits for value e.
template <typename T, int V> __device__ __forceinline__ Vec<T, V> masked(Vec<T, V> g, uint32_t bits) {
#pragma unroll
  for (int e = 0; e < V; ++e) g.v[e] = (bits >> e) & 1u ? g.v[e] : T(0);
  return g;
}

// The mask bits of a vector of relu's results.
template <typename T, int V> __device__ __forceinline__ uint32_t positive_bits(const Vec<T, V>& y) {
  uint32_t bits = 0;
#pragma unroll
  for (int e = 0; e < V; ++e) bits |= uint32_t(acc_t<T>(y.v[e]) > acc_t<T>(0)) << e;
  return bits;
}

// Which values of batch_norm_relu's output passed relu, for a pass that reads them once: the bits of relu's mask
// (ReluSaved::Mask), or the signs of the output itself (ReluSaved::Output), which spares making the bits first.
template <typename T> struct ReluGate {
  const int32_t* mask = nullptr;  // exactly one of the two is set
  const T* y = nullptr;
  // The bits of the V values from element e of the whole tensor (e a multiple of V).
  template <int V> __device__ __forceinline__ uint32_t bits(int64_t e) const {
    return y != nullptr ? positive_bits<T, V>(load<T, V>(y + e)) : mask_bits<V>(mask, e);
  }
};

// Stores the bits of a warp's 32 consecutive vectors: lane L holds the V bits of the vector at element e0 + L V, e0
// a multiple of 32. The lanes of each word OR their bits together by shuffles and the first of them stores the
// word: one 4-byte store for 32 elements, and no word shared between warps. Every lane of the warp calls it; words
// at or past words_end are not stored.
template <int V>
__device__ __forceinline__ void store_mask_bits(int32_t* mask, int64_t e0, uint32_t bits, int64_t words_end) {
  constexpr int kLanes = 32 / V;  // lanes whose bits make one word
  const int lane = int(threadIdx.x % 32);
  uint32_t word = bits << ((lane % kLanes) * V);
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) word |= __shfl_xor_sync(0xffffffffu, word, offset);
  const int64_t w = e0 / 32 + lane / kLanes;
  if (lane % kLanes == 0 && w < words_end) mask[w] = int32_t(word);
}

// ---- reducers: what a channel's values are reduced to. Each takes chunks: v[input][0..k) are the chunk's
// values of its inputs (k >= 1), all of channel c, and bits[u] relu's mask bits of the chunk's vector u (R::kMasked
// reducers only; the kernels load them).

// The statistics as shifted sums: with K a value of the channel (its first: the element of sample 0 at position 0),
// s1 = sum (x - K) and s2 = sum (x - K)^2 over n values give mean = K + s1 / n and var = s2 / n - (s1 / n)^2. Shifted
// by a value of the data, s1 / n is within a few deviations of 0, so the difference does not cancel when the mean is
// large next to the spread (what plain sums of x and x^2 do). Partial states merge by addition: the reduction costs
// a subtraction, an add and a fused multiply-add a value, and the finalize adds its splits up. (Welford states
// merged by Chan's formula, chunk by chunk, took ~17 instructions a value: ncu gave the float16 statistics pass of a
// 33.5 MB activation 16 us from L2, compute-bound, against ~7 for reading it.)
template <typename A> struct ShiftedSums {
  A s1, s2;
  uint32_t n;  // 32-bit: reduce_channels checks that a channel has fewer than 2^31 values
};

template <typename T> struct StatsReducer {
  using Input = T;
  using A = acc_t<T>;
  using State = ShiftedSums<A>;
  static constexpr int kInputs = 1;
  const T* in[kInputs];
  // K of channel c is shift[c * shift_stride]: x[c] in rows (sample 0's row), x[c * S] in planes (its plane's first).
  const T* shift;
  int64_t shift_stride;

  __device__ static State identity() { return {A(0), A(0), 0}; }
  __device__ static State merge(const State& a, const State& b) { return {a.s1 + b.s1, a.s2 + b.s2, a.n + b.n}; }
  static constexpr bool kMasked = false;
  template <int N, int U>
  __device__ __forceinline__ void add(State& s, const A (&v)[kInputs][N], int k, int64_t c,
                                      const uint32_t (&)[U]) const {
    const A shift_c = A(shift[c * shift_stride]);
#pragma unroll
    for (int e = 0; e < N; ++e) {
      if (e < k) {
        const A d = v[0][e] - shift_c;
        s.s1 += d;
        s.s2 += d * d;
      }
    }
    s.n += uint32_t(k);
  }

  // Rows: the V lanes of a thread (V neighbouring channels) see the same rows, so they share one count.
  template <int V> struct Lanes {
    A s1[V], s2[V];
    uint32_t n;
  };
  template <int V> __device__ static Lanes<V> lanes_identity() {
    Lanes<V> s;
#pragma unroll
    for (int e = 0; e < V; ++e) s.s1[e] = s.s2[e] = A(0);
    s.n = 0;
    return s;
  }
  template <int V> __device__ static State lane(const Lanes<V>& s, int e) { return {s.s1[e], s.s2[e], s.n}; }
  // v[0][u]: the chunk's row u (u < k, k >= 1), lane e's value at .v[e]; kept as loaded (half the registers of
  // float16 values widened up front) and widened where used. In rows shift_stride is 1: the V shifts are one
  // vector at c0 (16-byte aligned as the rows are).
  template <int V, int U>
  __device__ __forceinline__ void add_rows(Lanes<V>& s, const Vec<T, V> (&v)[kInputs][U], int k, int64_t c0,
                                           const uint32_t (&)[U]) const {
    const Vec<T, V> shift_v = load<T, V>(shift + c0);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const A shift_c = A(shift_v.v[e]);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (u < k) {
          const A d = A(v[0][u].v[e]) - shift_c;
          s.s1[e] += d;
          s.s2[e] += d * d;
        }
      }
    }
    s.n += uint32_t(k);
  }
};

// sum(g) and sum(g * (x - mean[c])); kMasked: of the g that passes relu, g where relu's mask is set (batch_norm_relu).
template <typename T, bool kMasked_ = false> struct GradSumsReducer {
  using Input = T;
  using A = acc_t<T>;
  struct State {
    A dy, dy_xmu;
  };
  static constexpr bool kMasked = kMasked_;
  static constexpr int kInputs = 2;
  const T* in[kInputs];  // g, x
  const A* mean;
  const int32_t* mask;   // kMasked: relu's mask

  __device__ static State identity() { return {A(0), A(0)}; }
  __device__ static State merge(const State& a, const State& b) { return {a.dy + b.dy, a.dy_xmu + b.dy_xmu}; }
  // v[j][e]: element e % (N / U) of vector e / (N / U).
  template <int N, int U>
  __device__ __forceinline__ void add(State& s, const A (&v)[kInputs][N], int k, int64_t c,
                                      const uint32_t (&bits)[U]) const {
    constexpr int kPer = N / U;
    const A m = mean[c];
#pragma unroll
    for (int e = 0; e < N; ++e) {
      if (e < k) {
        A g = v[0][e];
        if constexpr (kMasked) g = (bits[e / kPer] >> (e % kPer)) & 1u ? g : A(0);
        s.dy += g;
        s.dy_xmu += g * (v[1][e] - m);
      }
    }
  }

  // Rows: one state per lane (the sums need no shared count).
  template <int V> struct Lanes {
    State s[V];
  };
  template <int V> __device__ static Lanes<V> lanes_identity() {
    Lanes<V> s;
#pragma unroll
    for (int e = 0; e < V; ++e) s.s[e] = identity();
    return s;
  }
  template <int V> __device__ static State lane(const Lanes<V>& s, int e) { return s.s[e]; }
  template <int V, int U>
  __device__ __forceinline__ void add_rows(Lanes<V>& s, const Vec<T, V> (&v)[kInputs][U], int k, int64_t c0,
                                           const uint32_t (&bits)[U]) const {
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const A m = mean[c0 + e];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (u < k) {
          A g = A(v[0][u].v[e]);
          if constexpr (kMasked) g = (bits[u] >> e) & 1u ? g : A(0);
          s.s[e].dy += g;
          s.s[e].dy_xmu += g * (A(v[1][u].v[e]) - m);
        }
      }
    }
  }
};

// ---- 1. reduction kernels: one partial state per (channel, split), at partial[c * splits + split]

// planes: vector q of a channel is vector q % (S / V) of plane (q / (S / V), c).
template <typename R, int V>
__global__ void __launch_bounds__(kThreads)
    reduce_planes_kernel(R r, uint32_t channels, IntDivider plane_vectors, uint32_t vectors, uint32_t chunk,
                         typename R::State* partial) {
  using T = typename R::Input;
  using A = typename R::A;
  using State = typename R::State;
  const uint32_t c = blockIdx.x;
  const uint32_t lo = blockIdx.y * chunk, hi = smaller(vectors, lo + chunk);
  const int64_t plane = int64_t(plane_vectors.divisor) * V;
  State s = R::identity();
  for (uint32_t q0 = lo + threadIdx.x; q0 < hi; q0 += kThreads * kUnroll) {
    A v[R::kInputs][kUnroll * V];
    uint32_t bits[kUnroll];
    int k = 0;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t q = q0 + u * kThreads;
      if (q < hi) {  // the valid vectors are a prefix: q grows with u
        const uint32_t n = plane_vectors.div(q), i = q - n * plane_vectors.divisor;
        const int64_t at = (int64_t(n) * channels + c) * plane + int64_t(i) * V;
#pragma unroll
        for (int j = 0; j < R::kInputs; ++j) {
          const Vec<T, V> x = load<T, V>(r.in[j] + at);
#pragma unroll
          for (int e = 0; e < V; ++e) v[j][u * V + e] = A(x.v[e]);
        }
        if constexpr (R::kMasked) bits[u] = mask_bits<V>(r.mask, at);
        k += V;
      }
    }
    r.add(s, v, k, c, bits);
  }
  __shared__ alignas(16) unsigned char raw[kThreads * sizeof(State)];
  State* states = reinterpret_cast<State*>(raw);
  states[threadIdx.x] = s;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (int(threadIdx.x) < stride) states[threadIdx.x] = R::merge(states[threadIdx.x], states[threadIdx.x + stride]);
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[int64_t(c) * gridDim.y + blockIdx.y] = states[0];
}

// rows: thread (x, y) of a block reads channels [V * (blockIdx.x * blockDim.x + x), + V) of rows lo + y,
// lo + y + blockDim.y, ...; blockDim.x * blockDim.y == kThreads, both powers of two.
// At most 64 registers: 4 blocks per multiprocessor, the loads in flight a memory-bound pass needs.
template <typename R, int V>
__global__ void __launch_bounds__(kThreads, 4)
    reduce_rows_kernel(R r, int64_t channels, int64_t rows, int64_t chunk, typename R::State* partial) {
  using T = typename R::Input;
  using State = typename R::State;
  const int64_t c0 = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V;
  const int64_t lo = int64_t(blockIdx.y) * chunk, hi = smaller(rows, lo + chunk);
  // About kUnroll vectors in flight per thread whatever the number of inputs: the two-input gradient sums hold half
  // as many rows (107 registers with 8 lanes x 2 inputs x 4 rows; 2 blocks per multiprocessor).
  constexpr int kRowsUnroll = kUnroll / R::kInputs > 0 ? kUnroll / R::kInputs : 1;
  auto s = R::template lanes_identity<V>();
  if (c0 < channels) {
    for (int64_t m0 = lo + threadIdx.y; m0 < hi; m0 += int64_t(blockDim.y) * kRowsUnroll) {
      Vec<T, V> v[R::kInputs][kRowsUnroll];
      uint32_t bits[kRowsUnroll];
      int k = 0;
#pragma unroll
      for (int u = 0; u < kRowsUnroll; ++u) {
        const int64_t m = m0 + int64_t(u) * blockDim.y;
        if (m < hi) {
#pragma unroll
          for (int j = 0; j < R::kInputs; ++j) v[j][u] = load<T, V>(r.in[j] + m * channels + c0);
          if constexpr (R::kMasked) bits[u] = mask_bits<V>(r.mask, m * channels + c0);
          ++k;
        }
      }
      if (k > 0) r.add_rows(s, v, k, c0, bits);
    }
  }
  __shared__ alignas(16) unsigned char raw[kThreads * V * sizeof(State)];
  State* states = reinterpret_cast<State*>(raw);
  const unsigned me = threadIdx.y * blockDim.x + threadIdx.x;
#pragma unroll
  for (int e = 0; e < V; ++e) states[me * V + e] = R::lane(s, e);
  __syncthreads();
  for (unsigned stride = blockDim.y / 2; stride > 0; stride /= 2) {
    if (threadIdx.y < stride) {
      const unsigned other = me + stride * blockDim.x;
#pragma unroll
      for (int e = 0; e < V; ++e) states[me * V + e] = R::merge(states[me * V + e], states[other * V + e]);
    }
    __syncthreads();
  }
  if (threadIdx.y == 0 && c0 < channels) {
#pragma unroll
    for (int e = 0; e < V; ++e) partial[(c0 + e) * gridDim.y + blockIdx.y] = states[threadIdx.x * V + e];
  }
}

// Blocks of kThreads threads of `kernel` that a multiprocessor holds at once (the first device asked decides: the
// answer depends on the architecture, the same for every GPU of a machine in practice).
template <typename Kernel> int64_t resident_blocks_per_sm(Kernel kernel) {
  static const int per_sm = [&] {
    int n = 0;
    HG_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, 0), "batch_norm");
    return std::max(n, 1);
  }();
  return per_sm;
}

// 16-byte accesses when the contiguous dimension is a multiple of the vector and every pointer is aligned (the
// per-channel arrays are our own allocations, whose alignment the caching allocator guarantees).
template <typename T> int vector_width(const BatchNormShape& s, std::initializer_list<const void*> pointers) {
  const int64_t contiguous = s.channels_last ? s.channels : s.spatial;
  if (contiguous % kVector<T> != 0) return 1;
  for (const void* p : pointers)
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return 1;
  return kVector<T>;
}

// Runs the reduction of `r` over every channel; returns the partial states ([C, splits]) in `workspace`.
template <typename R, int V>
typename R::State* reduce_channels_vec(const R& r, const BatchNormShape& s, Device device, cudaStream_t stream,
                                       Tensor& workspace, int& splits_out) {
  using State = typename R::State;
  const int64_t C = s.channels, M = s.per_channel();
  const int64_t target = 4 * int64_t(cuda::multiprocessor_count(device.index));
  int64_t splits = 1, chunk = 0;
  dim3 grid, block;
  HG_CHECK(M < (int64_t(1) << 31) && C < (int64_t(1) << 31),
           "batch_norm: {} values per channel ({} channels) are more than the CUDA kernels handle (2^31); split the "
           "batch", M, C);
  if (!s.channels_last) {
    const int64_t vectors = M / V;  // S % V == 0
    splits = std::clamp<int64_t>((target + C - 1) / C, 1,
                                 std::max<int64_t>(1, vectors / (kThreads * kMinVectorsPerThread)));
    chunk = (vectors + splits - 1) / splits;
    splits = (vectors + chunk - 1) / chunk;
    grid = dim3(unsigned(C), unsigned(splits));
    block = dim3(kThreads);
  } else {
    const int64_t channel_vectors = C / V;  // C % V == 0
    int64_t tx = 1;
    while (tx < 32 && tx < channel_vectors) tx *= 2;
    const int64_t ty = kThreads / tx, tiles = (channel_vectors + tx - 1) / tx;
    // One full wave of blocks: with 4 blocks per multiprocessor asked for and 2-3 fitting, the last third of a
    // wave ran alone (ncu: 27% of warps active in the float16 NHWC reductions).
    const int64_t wave =
        resident_blocks_per_sm(reduce_rows_kernel<R, V>) * int64_t(cuda::multiprocessor_count(device.index));
    splits = std::clamp<int64_t>(wave / tiles, 1, std::max<int64_t>(1, M / (ty * kMinVectorsPerThread)));
    chunk = (M + splits - 1) / splits;
    splits = (M + chunk - 1) / chunk;
    grid = dim3(unsigned(tiles), unsigned(splits));
    block = dim3(unsigned(tx), unsigned(ty));
  }
  workspace = empty({C * splits * int64_t(sizeof(State))}, {.dtype = kUInt8, .device = device});
  State* partial = static_cast<State*>(workspace.data_ptr());
  if (!s.channels_last) {
    reduce_planes_kernel<R, V><<<grid, block, 0, stream>>>(r, uint32_t(C), IntDivider(uint32_t(s.spatial / V)),
                                                           uint32_t(M / V), uint32_t(chunk), partial);
  } else {
    reduce_rows_kernel<R, V><<<grid, block, 0, stream>>>(r, C, M, chunk, partial);
  }
  HG_CUDA_CHECK_LAUNCH("batch_norm");
  splits_out = int(splits);
  return partial;
}

template <typename R>
typename R::State* reduce_channels(const R& r, const BatchNormShape& s, Device device, cudaStream_t stream,
                                   Tensor& workspace, int& splits) {
  using T = typename R::Input;
  int v = 1;
  if constexpr (R::kInputs == 1) {
    v = vector_width<T>(s, {r.in[0]});
  } else if constexpr (R::kInputs == 2) {
    v = vector_width<T>(s, {r.in[0], r.in[1]});
  } else {
    v = vector_width<T>(s, {r.in[0], r.in[1], r.in[2]});
  }
  if (v == kVector<T>) return reduce_channels_vec<R, kVector<T>>(r, s, device, stream, workspace, splits);
  return reduce_channels_vec<R, 1>(r, s, device, stream, workspace, splits);
}

// ---- 2. finalize kernels, one warp per channel: the lanes merge the channel's splits (neighbouring lanes read
// neighbouring partial states), then a shuffle tree merges the lanes. (One thread per channel walking hundreds of
// splits one dependent load at a time took 0.15 ms for a 128-channel NHWC layer.) `affine` is [2C]: scale, then
// shift, for the apply pass.

constexpr int kWarpsPerBlock = kThreads / 32;

template <typename S> __device__ __forceinline__ S shuffle_down(const S& s, int offset) {
  static_assert(sizeof(S) % sizeof(int) == 0, "states are made of 32-bit words");
  int words[sizeof(S) / sizeof(int)];
  memcpy(words, &s, sizeof(S));
#pragma unroll
  for (int& w : words) w = __shfl_down_sync(0xffffffffu, w, offset);
  S out;
  memcpy(&out, words, sizeof(S));
  return out;
}

// The merge of partial[c * splits + 0 .. splits), in lane 0 of the calling warp. Each lane loads kBatch states
// before merging any, so that the loads overlap: a loop of load-then-merge can wait out one L2 latency per state.
template <typename R>
__device__ __forceinline__ typename R::State merge_splits(const typename R::State* partial, int splits, int64_t c) {
  constexpr int kBatch = 8;
  typename R::State s = R::identity();
  for (int k0 = int(threadIdx.x % 32); k0 < splits; k0 += 32 * kBatch) {
    typename R::State b[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int k = k0 + 32 * j;
      b[j] = k < splits ? partial[c * splits + k] : R::identity();
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) s = R::merge(s, b[j]);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) s = R::merge(s, shuffle_down(s, offset));
  return s;
}

__device__ __forceinline__ int64_t warp_channel() {
  return int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    finalize_stats_kernel(const typename StatsReducer<T>::State* partial, int splits, int64_t channels,
                          const T* shift, int64_t shift_stride, const acc_t<T>* weight, const acc_t<T>* bias, acc_t<T>* save_mean, acc_t<T>* save_invstd,
                          acc_t<T>* running_mean, acc_t<T>* running_var, int64_t* batches_tracked,
                          acc_t<T>* affine, double momentum, double eps) {
  using A = acc_t<T>;
  const int64_t c = warp_channel();
  if (c >= channels) return;  // whole warps leave together
  const auto s = merge_splits<StatsReducer<T>>(partial, splits, c);
  if (threadIdx.x % 32 != 0) return;
  if (batches_tracked && c == 0) ++*batches_tracked;  // nn::BatchNorm2d's count, without a launch of its own
  const A shifted_mean = s.s1 / A(s.n);
  const A mean = A(shift[c * shift_stride]) + shifted_mean;
  const A var = max(s.s2 / A(s.n) - shifted_mean * shifted_mean, A(0));  // biased: what normalises the batch
  const A invstd = A(1) / ::sqrt(var + A(eps));
  save_mean[c] = mean;
  save_invstd[c] = invstd;
  affine[c] = invstd * (weight ? weight[c] : A(1));
  affine[channels + c] = bias ? bias[c] : A(0);
  if (running_mean) {
    const A m = A(momentum);
    running_mean[c] = (A(1) - m) * running_mean[c] + m * mean;
    running_var[c] = (A(1) - m) * running_var[c] + m * var * A(s.n) / A(s.n - 1);  // unbiased
  }
}

__global__ void count_batch_kernel(int64_t* batches_tracked) { ++*batches_tracked; }

// ReluMaskValuesKernel: one thread an element (create_graph's backward only, not a step's hot path).
__global__ void __launch_bounds__(kThreads) unpack_relu_mask_kernel(bool* passes, const int32_t* mask, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += int64_t(gridDim.x) * kThreads)
    passes[i] = ReluMask::bit(mask, i);
}

template <typename A>
__global__ void __launch_bounds__(kThreads)
    eval_stats_kernel(int64_t channels, const A* running_mean, const A* running_var, const A* weight, const A* bias,
                      A* save_mean, A* save_invstd, A* affine, double eps) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  const A invstd = A(1) / ::sqrt(running_var[c] + A(eps));
  save_mean[c] = running_mean[c];
  save_invstd[c] = invstd;
  affine[c] = invstd * (weight ? weight[c] : A(1));
  affine[channels + c] = bias ? bias[c] : A(0);
}

// coef[c] = alpha, coef[C + c] = beta, coef[2C + c] = gamma (ops/batch_norm.cpp's CPU kernel says why).
template <typename R>
__global__ void __launch_bounds__(kThreads)
    finalize_grad_kernel(const typename R::State* partial, int splits, int64_t channels, const typename R::A* invstd,
                         const typename R::A* weight, typename R::A* grad_weight, typename R::A* grad_bias,
                         typename R::A* coef, int64_t count, bool training) {
  using A = typename R::A;
  const int64_t c = warp_channel();
  if (c >= channels) return;
  const auto s = partial ? merge_splits<R>(partial, splits, c) : R::identity();
  if (threadIdx.x % 32 != 0) return;
  const A is = invstd[c];
  if (grad_weight) grad_weight[c] = s.dy_xmu * is;
  if (grad_bias) grad_bias[c] = s.dy;
  if (coef) {
    const A k = is * (weight ? weight[c] : A(1));
    coef[c] = k;
    coef[channels + c] = training ? -k * is * is * s.dy_xmu / A(count) : A(0);
    coef[2 * channels + c] = training ? -k * s.dy / A(count) : A(0);
  }
}

// ---- 3. elementwise kernels over one piece of fewer than 2^31 elements (whole samples)

struct ChannelOf {  // the channel of element i of a piece
  IntDivider spatial, channels;
  bool channels_last;
  __device__ __forceinline__ uint32_t operator()(uint32_t i) const {
    const uint32_t q = channels_last ? i : spatial.div(i);
    return q - channels.div(q) * channels.divisor;
  }
};

// The per-channel constants of the V values of a vector starting at channel c: in rows the lanes are channels
// c .. c + V - 1 (one vector load from a [C] array, whose 16-byte-aligned allocation and c % V == 0 keep it
// aligned), in planes all lanes are channel c.
template <typename A, int V, bool kRows> struct PerChannel {
  A v[V];
  __device__ __forceinline__ PerChannel(const A* p, uint32_t c) {
    if constexpr (kRows) {
      const Vec<A, V> x = load<A, V>(p + c);
#pragma unroll
      for (int e = 0; e < V; ++e) v[e] = x.v[e];
    } else {
      const A x = p[c];
#pragma unroll
      for (int e = 0; e < V; ++e) v[e] = x;
    }
  }
};

// Runs body(q) for every vector q < vectors of the grid's stride loop with whole warps in step, so that relu's mask
// can be stored word by word: body returns the vector's mask bits (0 for a vector past the end), stored when mask is
// not null at element mask_first + q V of the whole tensor (mask_first, the piece's first element, a multiple of 32:
// for_each_piece). The grid is whole blocks of whole warps, so a warp's first vector is a multiple of 32.
template <int V, typename Body>
__device__ __forceinline__ void for_each_vector(uint32_t vectors, int32_t* mask, int64_t mask_first,
                                                int64_t mask_words, const Body& body) {
  const uint32_t lane = threadIdx.x % 32;
  for (uint32_t q0 = blockIdx.x * kThreads + threadIdx.x - lane; q0 < vectors; q0 += gridDim.x * kThreads) {
    const uint32_t q = q0 + lane;
    const uint32_t bits = q < vectors ? body(q) : 0u;
    if (mask != nullptr) store_mask_bits<V>(mask, mask_first + int64_t(q0) * V, bits, mask_words);
  }
}

// Rows: the launch makes the grid's stride a multiple of C / V vectors (for_each_piece), so every vector a
// thread visits starts at the same channel and the thread loads its per-channel constants once; loading them per
// vector moved more bytes through L1 than the data (float32 constants for float16 values). Planes: one channel
// per vector, looked up each time.
// kRelu: batch_norm_relu's epilogue, y = relu(normalised + z) with z (the residual) or without (z null), and relu's
// mask.
template <typename T, int V, bool kRows, bool kRelu>
__global__ void __launch_bounds__(kThreads)
    apply_forward_kernel(T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ z, uint32_t vectors,
                         ChannelOf channel_of, const acc_t<T>* __restrict__ mean, const acc_t<T>* __restrict__ affine,
                         uint32_t channels, int32_t* __restrict__ mask, int64_t mask_first, int64_t mask_words) {
  using A = acc_t<T>;
  uint32_t c = channel_of((blockIdx.x * kThreads + threadIdx.x) * V);
  PerChannel<A, V, kRows> m(mean, c), scale(affine, c), shift(affine + channels, c);
  for_each_vector<V>(vectors, kRelu ? mask : nullptr, mask_first, mask_words, [&](uint32_t q) {
    const uint32_t i = q * V;
    if constexpr (!kRows) {
      c = channel_of(i);
      m = PerChannel<A, V, kRows>(mean, c);
      scale = PerChannel<A, V, kRows>(affine, c);
      shift = PerChannel<A, V, kRows>(affine + channels, c);
    }
    const Vec<T, V> xv = load<T, V>(x + i);
    Vec<T, V> zv;
    if constexpr (kRelu) {
      if (z != nullptr) zv = load<T, V>(z + i);
    }
    Vec<T, V> out;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      A v = (A(xv.v[e]) - m.v[e]) * scale.v[e] + shift.v[e];
      if constexpr (kRelu) {
        if (z != nullptr) v += A(zv.v[e]);
        v = unary_math<UnaryOp::Relu>(v);
      }
      out.v[e] = T(v);
    }
    store<T, V>(y + i, out);
    return kRelu ? positive_bits<T, V>(out) : 0u;
  });
}

// kMasked: after batch_norm_relu, g passes where relu's mask is set (element mask_first + i of the whole tensor for
// element i of the piece); that gradient is also the residual's, written to grad_residual unless it is null.
template <typename T, int V, bool kRows, bool kMasked>
__global__ void __launch_bounds__(kThreads)
    apply_backward_kernel(T* __restrict__ grad_input, T* __restrict__ grad_residual, const T* __restrict__ g,
                          const T* __restrict__ x, const int32_t* __restrict__ mask, int64_t mask_first,
                          uint32_t vectors, ChannelOf channel_of, const acc_t<T>* __restrict__ mean,
                          const acc_t<T>* __restrict__ coef, uint32_t channels) {
  using A = acc_t<T>;
  const uint32_t first = blockIdx.x * kThreads + threadIdx.x;
  if (first >= vectors) return;
  uint32_t c = channel_of(first * V);
  PerChannel<A, V, kRows> m(mean, c), alpha(coef, c), beta(coef + channels, c), gamma(coef + 2 * channels, c);
  for (uint32_t q = first; q < vectors; q += gridDim.x * kThreads) {
    const uint32_t i = q * V;
    if constexpr (!kRows) {
      c = channel_of(i);
      m = PerChannel<A, V, kRows>(mean, c);
      alpha = PerChannel<A, V, kRows>(coef, c);
      beta = PerChannel<A, V, kRows>(coef + channels, c);
      gamma = PerChannel<A, V, kRows>(coef + 2 * channels, c);
    }
    Vec<T, V> gv = load<T, V>(g + i);
    const Vec<T, V> xv = load<T, V>(x + i);
    if constexpr (kMasked) {
      gv = masked(gv, mask_bits<V>(mask, mask_first + i));
      if (grad_residual != nullptr) store<T, V>(grad_residual + i, gv);
    }
    Vec<T, V> out;
#pragma unroll
    for (int e = 0; e < V; ++e)
      out.v[e] = T(A(gv.v[e]) * alpha.v[e] + (A(xv.v[e]) - m.v[e]) * beta.v[e] + gamma.v[e]);
    store<T, V>(grad_input + i, out);
  }
}

// ---- relu's epilogue and mask as passes of their own: what batch_norm_relu adds to cuDNN's kernels when they are
// the faster (cuDNN's own fused forms need a reserve space and take fewer problems), the mask from a kept y, and the
// residual's gradient alone when the input's is not wanted. y = relu(y + z) (z null: relu(y)) in place, with the
// mask unless it is null.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    relu_epilogue_kernel(T* y, const T* __restrict__ z, uint32_t vectors, int32_t* __restrict__ mask,
                         int64_t mask_first, int64_t mask_words) {
  for_each_vector<V>(vectors, mask, mask_first, mask_words, [&](uint32_t q) {
    const uint32_t i = q * V;
    const Vec<T, V> yv = load<T, V>(y + i);
    Vec<T, V> zv;
    if (z != nullptr) zv = load<T, V>(z + i);
    Vec<T, V> out;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      acc_t<T> v = acc_t<T>(yv.v[e]);
      if (z != nullptr) v += acc_t<T>(zv.v[e]);
      out.v[e] = T(unary_math<UnaryOp::Relu>(v));
    }
    store<T, V>(y + i, out);
    return positive_bits<T, V>(out);
  });
}

// relu's mask of y (ReluSaved::Output's backward).
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    relu_mask_kernel(const T* __restrict__ y, uint32_t vectors, int32_t* __restrict__ mask, int64_t mask_first,
                     int64_t mask_words) {
  for_each_vector<V>(vectors, mask, mask_first, mask_words,
                     [&](uint32_t q) { return positive_bits<T, V>(load<T, V>(y + int64_t(q) * V)); });
}

// out = g where relu let it pass, else 0 (element piece_first + i of the whole tensor for element i of the piece).
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    masked_gradient_kernel(T* __restrict__ out, const T* __restrict__ g, uint32_t vectors, ReluGate<T> relu,
                           int64_t piece_first) {
  for (uint32_t q = blockIdx.x * kThreads + threadIdx.x; q < vectors; q += gridDim.x * kThreads) {
    const uint32_t i = q * V;
    store<T, V>(out + i, masked(load<T, V>(g + i), relu.template bits<V>(piece_first + i)));
  }
}

// Calls launch(first_element, count, blocks) for runs of whole samples of fewer than 2^31 elements; blocks
// covers count / v vectors. In rows, blocks * kThreads is a multiple of the C / v vectors of a row (the apply
// kernels rely on it): whole samples start at channel 0, and a stride of whole rows keeps every thread on its
// channels. writes_mask: every piece starts at a multiple of 32 elements, so that each word of relu's mask is one
// piece's (for_each_vector).
template <typename Launch>
void for_each_piece(const BatchNormShape& s, Device device, int v, bool writes_mask, const Launch& launch) {
  const int64_t sample = s.channels * s.spatial;
  HG_CHECK(sample < (int64_t(1) << 31), "batch_norm: one sample of {} elements is more than the CUDA kernels handle "
           "(2^31)", sample);
  int64_t per_piece = std::max<int64_t>(1, ((int64_t(1) << 31) - 1) / sample);
  if (writes_mask && per_piece < s.batch) {
    const int64_t whole = 32 / std::gcd(sample, int64_t(32));  // samples that end on a word
    HG_CHECK(per_piece >= whole, "batch_norm_relu: {} samples of {} elements are more than the CUDA kernels' relu "
             "mask handles (2^31 elements, in runs of whole 32-element words)", s.batch, sample);
    per_piece = per_piece / whole * whole;
  }
  const int64_t max_blocks = 16 * int64_t(cuda::multiprocessor_count(device.index));
  const int64_t row_vectors = s.channels / v;
  const int64_t period = s.channels_last ? row_vectors / std::gcd(row_vectors, int64_t(kThreads)) : 1;
  for (int64_t n0 = 0; n0 < s.batch; n0 += per_piece) {
    const int64_t count = std::min(per_piece, s.batch - n0) * sample;
    const int64_t blocks = std::min<int64_t>(max_blocks, (count / v + kThreads - 1) / kThreads);
    const int64_t rounded = (blocks + period - 1) / period * period;
    // The kernels' stride (blocks * kThreads) is 32-bit; only a channels-last input with an odd channel count near
    // 2^24 or more could need more.
    HG_CHECK(rounded * kThreads < (int64_t(1) << 32), "batch_norm: {} channels in the channels-last layout need a "
             "grid the CUDA kernels cannot launch; use the NCHW layout", s.channels);
    launch(n0 * sample, uint32_t(count), unsigned(rounded));
  }
}

// Calls fn.template operator()<V, kRows>() for the vector width v and the layout.
template <typename T, typename Fn> void with_vector_and_layout(int v, bool rows, const Fn& fn) {
  if (v == kVector<T>) {
    rows ? fn.template operator()<kVector<T>, true>() : fn.template operator()<kVector<T>, false>();
  } else {
    rows ? fn.template operator()<1, true>() : fn.template operator()<1, false>();
  }
}

template <typename T> const acc_t<T>* ptr(const Tensor& t) { return t.defined() ? t.data<acc_t<T>>() : nullptr; }
template <typename T> acc_t<T>* mutable_ptr(const Tensor& t) { return t.defined() ? t.data<acc_t<T>>() : nullptr; }

unsigned channel_blocks(int64_t channels) { return unsigned((channels + kThreads - 1) / kThreads); }
unsigned warp_channel_blocks(int64_t channels) { return unsigned((channels + kWarpsPerBlock - 1) / kWarpsPerBlock); }

ChannelOf channel_of(const BatchNormShape& s) {
  return {IntDivider(uint32_t(s.spatial)), IntDivider(uint32_t(s.channels)), s.channels_last};
}

template <typename T> void forward_typed(const BatchNormForwardArgs& a) {
  using A = acc_t<T>;
  const BatchNormShape& s = a.shape;
  const Device device = a.input.device();
  cuda::DeviceGuard guard(device);
  cudaStream_t stream = cuda::current_stream(device);
  const T* x = a.input.data<T>();
  A* save_mean = a.save_mean.data<A>();
  A* save_invstd = a.save_invstd.data<A>();
  // Freed when this returns; later work on the stream is ordered after the kernels.
  Tensor workspace, affine = empty({2 * s.channels}, {.dtype = a.save_mean.dtype(), .device = device});
  if (a.training) {
    int splits = 1;
    const int64_t shift_stride = s.channels_last ? 1 : s.spatial;
    auto* partial = reduce_channels(StatsReducer<T>{{x}, x, shift_stride}, s, device, stream, workspace, splits);
    finalize_stats_kernel<T><<<warp_channel_blocks(s.channels), kThreads, 0, stream>>>(
        partial, splits, s.channels, x, shift_stride, ptr<T>(a.weight), ptr<T>(a.bias), save_mean, save_invstd,
        mutable_ptr<T>(a.running_mean), mutable_ptr<T>(a.running_var),
        a.batches_tracked.defined() ? a.batches_tracked.data<int64_t>() : nullptr, affine.data<A>(), a.momentum, a.eps);
  } else {
    eval_stats_kernel<A><<<channel_blocks(s.channels), kThreads, 0, stream>>>(
        s.channels, ptr<T>(a.running_mean), ptr<T>(a.running_var), ptr<T>(a.weight), ptr<T>(a.bias), save_mean,
        save_invstd, affine.data<A>(), a.eps);
  }
  HG_CUDA_CHECK_LAUNCH("batch_norm");

  T* y = a.output.data<T>();
  const T* z = a.residual.defined() ? a.residual.data<T>() : nullptr;
  int32_t* mask = a.relu_mask.defined() ? a.relu_mask.data<int32_t>() : nullptr;
  const int v = vector_width<T>(s, {x, y, z});
  with_vector_and_layout<T>(v, s.channels_last, [&]<int V, bool kRows>() {
    for_each_piece(s, device, V, mask != nullptr, [&](int64_t first, uint32_t count, unsigned blocks) {
      auto launch = [&]<bool kRelu>() {
        apply_forward_kernel<T, V, kRows, kRelu><<<blocks, kThreads, 0, stream>>>(
            y + first, x + first, z ? z + first : nullptr, count / V, channel_of(s), save_mean, affine.data<A>(),
            uint32_t(s.channels), mask, first, mask ? a.relu_mask.numel() : 0);
      };
      a.relu ? launch.template operator()<true>() : launch.template operator()<false>();
      HG_CUDA_CHECK_LAUNCH("batch_norm");
    });
  });
}

// After cuDNN's normalisation into y: y = relu(y + z) (z undefined: relu(y)) in place, and relu's mask unless it is
// undefined.
template <typename T> void relu_epilogue(const BatchNormShape& s, const Tensor& y, const Tensor& z, const Tensor& mask) {
  const Device device = y.device();
  cudaStream_t stream = cuda::current_stream(device);
  const T* zp = z.defined() ? z.data<T>() : nullptr;
  int32_t* bits = mask.defined() ? mask.data<int32_t>() : nullptr;
  with_vector_and_layout<T>(vector_width<T>(s, {y.data_ptr(), zp}), s.channels_last, [&]<int V, bool>() {
    for_each_piece(s, device, V, bits != nullptr, [&](int64_t first, uint32_t count, unsigned blocks) {
      relu_epilogue_kernel<T, V><<<blocks, kThreads, 0, stream>>>(y.data<T>() + first, zp ? zp + first : nullptr,
                                                                  count / V, bits, first, bits ? mask.numel() : 0);
      HG_CUDA_CHECK_LAUNCH("batch_norm_relu");
    });
  });
}

// relu's mask of batch_norm_relu's output y (ReluMask), for a backward that kept y instead (ReluSaved::Output).
template <typename T> Tensor relu_mask_of(const BatchNormShape& s, const Tensor& y) {
  const Device device = y.device();
  cudaStream_t stream = cuda::current_stream(device);
  Tensor mask = empty({ReluMask::words(y.numel())}, {.dtype = kInt32, .device = device});
  with_vector_and_layout<T>(vector_width<T>(s, {y.data_ptr()}), s.channels_last, [&]<int V, bool>() {
    for_each_piece(s, device, V, true, [&](int64_t first, uint32_t count, unsigned blocks) {
      relu_mask_kernel<T, V><<<blocks, kThreads, 0, stream>>>(y.data<T>() + first, count / V, mask.data<int32_t>(),
                                                              first, mask.numel());
      HG_CUDA_CHECK_LAUNCH("batch_norm_relu backward");
    });
  });
  return mask;
}

// Where batch_norm_relu's backward finds which values passed relu: the mask, or the output kept in its place.
template <typename T> ReluGate<T> relu_gate(const BatchNormBackwardArgs& a) {
  return {a.relu_mask.defined() ? a.relu_mask.data<int32_t>() : nullptr,
          a.output.defined() ? a.output.data<T>() : nullptr};
}

// out = g where relu let it pass, else 0: the gradient batch_norm_relu's normalisation receives (the residual's,
// or a scratch tensor in the layout of g). One pass, which reads y itself where the op kept y.
template <typename T> void masked_gradient(const BatchNormShape& s, const Tensor& out, const Tensor& g,
                                           ReluGate<T> relu) {
  const Device device = g.device();
  cudaStream_t stream = cuda::current_stream(device);
  with_vector_and_layout<T>(vector_width<T>(s, {out.data_ptr(), g.data_ptr(), relu.y}), s.channels_last,
                            [&]<int V, bool>() {
    for_each_piece(s, device, V, false, [&](int64_t first, uint32_t count, unsigned blocks) {
      masked_gradient_kernel<T, V><<<blocks, kThreads, 0, stream>>>(out.data<T>() + first, g.data<T>() + first,
                                                                    count / V, relu, first);
      HG_CUDA_CHECK_LAUNCH("batch_norm_relu backward");
    });
  });
}

template <typename T, bool kMasked> void backward_typed(const BatchNormBackwardArgs& a) {
  using A = acc_t<T>;
  using R = GradSumsReducer<T, kMasked>;
  const BatchNormShape& s = a.shape;
  const Device device = a.input.device();
  cuda::DeviceGuard guard(device);
  cudaStream_t stream = cuda::current_stream(device);
  const T* g = a.grad_output.data<T>();
  const T* x = a.input.data<T>();
  const A* mean = a.save_mean.data<A>();
  T* gz = a.grad_residual.defined() ? a.grad_residual.data<T>() : nullptr;
  if (gz && !a.grad_input.defined()) masked_gradient<T>(s, a.grad_residual, a.grad_output, relu_gate<T>(a));

  const bool need_sums = a.grad_weight.defined() || a.grad_bias.defined() || (a.grad_input.defined() && a.training);
  if (!need_sums && !a.grad_input.defined()) return;  // only the residual's gradient was wanted
  // The passes below (the sums, the apply) read relu's bits: made here where the op kept y. (Where the residual's and
  // the parameters' gradients are wanted but not the input's, y is then read twice; no model in models/ asks for that.)
  const Tensor mask_tensor = kMasked && !a.relu_mask.defined() ? relu_mask_of<T>(s, a.output) : a.relu_mask;
  const int32_t* mask = kMasked ? mask_tensor.data<int32_t>() : nullptr;
  Tensor workspace, coef;
  const typename R::State* partial = nullptr;
  int splits = 0;
  if (need_sums) {
    R r{};
    r.in[0] = g;
    r.in[1] = x;
    r.mean = mean;
    if constexpr (kMasked) r.mask = mask;
    partial = reduce_channels(r, s, device, stream, workspace, splits);
  }
  if (a.grad_input.defined()) coef = empty({3 * s.channels}, {.dtype = a.save_mean.dtype(), .device = device});
  finalize_grad_kernel<R><<<warp_channel_blocks(s.channels), kThreads, 0, stream>>>(
      partial, splits, s.channels, a.save_invstd.data<A>(), ptr<T>(a.weight), mutable_ptr<T>(a.grad_weight),
      mutable_ptr<T>(a.grad_bias), coef.defined() ? coef.data<A>() : nullptr, s.per_channel(), a.training);
  HG_CUDA_CHECK_LAUNCH("batch_norm_backward");
  if (!a.grad_input.defined()) return;

  T* gi = a.grad_input.data<T>();
  const int v = vector_width<T>(s, {gi, g, x, gz});
  with_vector_and_layout<T>(v, s.channels_last, [&]<int V, bool kRows>() {
    for_each_piece(s, device, V, false, [&](int64_t first, uint32_t count, unsigned blocks) {
      apply_backward_kernel<T, V, kRows, kMasked><<<blocks, kThreads, 0, stream>>>(
          gi + first, gz ? gz + first : nullptr, g + first, x + first, mask, first, count / V, channel_of(s), mean,
          coef.data<A>(), uint32_t(s.channels));
      HG_CUDA_CHECK_LAUNCH("batch_norm_backward");
    });
  });
}

// ---- 4. cuDNN's kernels, through the legacy batch normalization API (what reaches them; PyTorch calls the same
// functions with the same modes). Channels last: CUDNN_BATCHNORM_SPATIAL_PERSISTENT, one kernel per direction
// that keeps each block's share of the activation on chip between the statistics and the normalisation, so the
// activation is read once, not twice. Planes: CUDNN_BATCHNORM_SPATIAL, whose single-read kernels do the same for
// small planes. On larger shapes cuDNN's kernels are slower than ours. Same semantics as ours: biased variance to
// normalise, unbiased for the running variance, saved mean and 1 / sqrt(var + eps).
// batch_norm_relu: in float16 channels last, cuDNN's fused operations (CUDNN_BATCHNORM_OPS_BN_ACTIVATION, and
// ..._BN_ADD_ACTIVATION with the residual) add and clamp inside its kernels, y rounded once as ours; with the
// residual the forward writes relu's mask into a reserve buffer that the backward reads (without, it reads y), and
// the backward writes the residual's gradient.
// Elsewhere cuDNN's kernels normalise and passes of ours add the residual and clamp after the forward, and mask the
// gradient before the backward. PyTorch calls only the plain operation.

cudnnBatchNormMode_t cudnn_mode(const BatchNormShape& s) {
  return s.channels_last ? CUDNN_BATCHNORM_SPATIAL_PERSISTENT : CUDNN_BATCHNORM_SPATIAL;
}

bool aligned16(const Tensor& t) { return !t.defined() || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// What cuDNN's kernels take (ops/batch_norm.h, BatchNormBackend::Cudnn). The 16-byte conditions are ours: its
// kernels load vectors, and misaligned channels-last data stopped the GPU with cudaErrorMisalignedAddress. They
// cover every operand, the per-channel ones too (a caller's float32 weight may be a view at any offset).
bool cudnn_takes(const BatchNormShape& s, DType dtype, std::initializer_list<const Tensor*> operands) {
  if (s.spatial <= 1 || (dtype != DType::Float16 && dtype != DType::Float32)) return false;
  const int64_t row = s.channels_last ? s.channels : s.spatial;  // the contiguous run of one (n, s) or (n, c)
  if (s.batch * s.channels * s.spatial > INT_MAX || row * int64_t(element_size(dtype)) % 16 != 0) return false;
  return std::all_of(operands.begin(), operands.end(), [](const Tensor* t) { return aligned16(*t); });
}

// Whether cuDNN's fused kernels take batch_norm_relu (they run float16 channels last only); the caller also needs
// y kept for the backward that cuDNN's fused kernel does not run (ours reads where y > 0 from y, not from cuDNN's
// reserve).
bool cudnn_fuses(const BatchNormShape& s, DType dtype, bool relu, bool keeps_mask) {
  return relu && !keeps_mask && s.channels_last && dtype == DType::Float16;
}

struct CudnnTensor {
  cudnnTensorDescriptor_t desc = nullptr;
  CudnnTensor() { HG_CUDNN_CHECK(cudnnCreateTensorDescriptor(&desc), "batch_norm"); }
  ~CudnnTensor() { cudnnDestroyTensorDescriptor(desc); }
  CudnnTensor(const CudnnTensor&) = delete;
  CudnnTensor& operator=(const CudnnTensor&) = delete;
};

struct CudnnRelu {
  cudnnActivationDescriptor_t desc = nullptr;
  CudnnRelu() {
    HG_CUDNN_CHECK(cudnnCreateActivationDescriptor(&desc), "batch_norm_relu");
    HG_CUDNN_CHECK(cudnnSetActivationDescriptor(desc, CUDNN_ACTIVATION_RELU, CUDNN_PROPAGATE_NAN, 0.0),
                   "batch_norm_relu");
  }
  ~CudnnRelu() { cudnnDestroyActivationDescriptor(desc); }
  CudnnRelu(const CudnnRelu&) = delete;
  CudnnRelu& operator=(const CudnnRelu&) = delete;
};

// One call's cuDNN setting: the handle, the operation (batch norm alone, or fused with relu and maybe the residual
// add), the activation as [N, C, S, 1] (NHWC or NCHW), the [1, C, 1, 1] float32 parameters cuDNN derives from it,
// and the size of the reserve the fused operations hand from the forward to the backward. Batch norm alone must
// need none: halfgrad keeps only the saved mean and invstd between its two directions.
struct CudnnProblem {
  cudnnHandle_t handle;
  cudnnBatchNormMode_t mode;
  cudnnBatchNormOps_t ops;
  CudnnTensor x, param;
  std::optional<CudnnRelu> relu;
  size_t reserve_bytes = 0;
  CudnnProblem(const BatchNormShape& s, const Tensor& input, bool fused, bool residual, const char* op)
      : handle(cuda::cudnn_handle(input.device().index)),
        mode(cudnn_mode(s)),
        ops(!fused ? CUDNN_BATCHNORM_OPS_BN
                   : residual ? CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION : CUDNN_BATCHNORM_OPS_BN_ACTIVATION) {
    HG_CUDNN_CHECK(cudnnSetTensor4dDescriptor(x.desc, s.channels_last ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW,
                                              input.dtype() == DType::Float16 ? CUDNN_DATA_HALF : CUDNN_DATA_FLOAT,
                                              int(s.batch), int(s.channels), int(s.spatial), 1),
                   op);
    HG_CUDNN_CHECK(cudnnDeriveBNTensorDescriptor(param.desc, x.desc, mode), op);
    if (fused) relu.emplace();
    HG_CUDNN_CHECK(cudnnGetBatchNormalizationTrainingExReserveSpaceSize(handle, mode, ops, activation(), x.desc,
                                                                        &reserve_bytes),
                   op);
    HG_CHECK(fused || reserve_bytes == 0,
             "{} (cuda): cuDNN asks for {} bytes of reserve space, which halfgrad does not keep", op, reserve_bytes);
  }
  cudnnActivationDescriptor_t activation() const { return relu ? relu->desc : nullptr; }
  cudnnTensorDescriptor_t residual_desc() const {
    return ops == CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION ? x.desc : nullptr;
  }
};

void* data_or_null(const Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

// The workspace cuDNN asks for, from the caching allocator.
Tensor cudnn_workspace(size_t bytes, Device device) {
  return bytes ? empty({int64_t(bytes)}, {.dtype = kUInt8, .device = device}) : Tensor();
}

// An uninitialised per-element tensor of t's shape and dtype in the call's layout.
Tensor like_activation(const Tensor& t, const BatchNormShape& s) {
  return batch_norm_empty(t.shape(), t.dtype(), t.device(), s.channels_last);
}

// weight and bias, which cuDNN needs: the caller's, or 1 and 0.
Tensor or_filled(const Tensor& t, int64_t channels, Device device, float value) {
  if (t.defined()) return t;
  Tensor filled = empty({channels}, {.dtype = DType::Float32, .device = device});
  filled.fill_(value);
  return filled;
}

// The fused operations where they take the call (cudnn_fuses), else batch norm alone and our relu epilogue.
void cudnn_forward(const BatchNormForwardArgs& a) {
  const BatchNormShape& s = a.shape;
  const Device device = a.input.device();
  const bool fused = cudnn_fuses(s, a.input.dtype(), a.relu, a.relu_mask.defined());
  const CudnnProblem p(s, a.input, fused, a.residual.defined(), "batch_norm");
  size_t bytes = 0;
  HG_CUDNN_CHECK(cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize(p.handle, p.mode, p.ops, p.x.desc,
                                                                          p.residual_desc(), p.x.desc, p.param.desc,
                                                                          p.activation(), &bytes),
                 "batch_norm");
  const Tensor workspace = cudnn_workspace(bytes, device);
  const Tensor reserve = cudnn_workspace(p.reserve_bytes, device);
  const Tensor weight = or_filled(a.weight, s.channels, device, 1), bias = or_filled(a.bias, s.channels, device, 0);
  const float one = 1, zero = 0;
  HG_CUDNN_CHECK(cudnnBatchNormalizationForwardTrainingEx(
                     p.handle, p.mode, p.ops, &one, &zero, p.x.desc, a.input.data_ptr(), p.residual_desc(),
                     p.residual_desc() ? a.residual.data_ptr() : nullptr, p.x.desc, a.output.data_ptr(),
                     p.param.desc, weight.data_ptr(), bias.data_ptr(), a.momentum, data_or_null(a.running_mean),
                     data_or_null(a.running_var), a.eps, a.save_mean.data_ptr(), a.save_invstd.data_ptr(),
                     p.activation(), data_or_null(workspace), bytes, data_or_null(reserve), p.reserve_bytes),
                 "batch_norm");
  a.cudnn_fused = {.ran = fused, .reserve = reserve};
  if (a.batches_tracked.defined()) {  // cuDNN does not count batches
    count_batch_kernel<<<1, 1, 0, cuda::current_stream(device)>>>(a.batches_tracked.data<int64_t>());
    HG_CUDA_CHECK_LAUNCH("batch_norm");
  }
  if (!a.relu || fused) return;
  dispatch_floating(a.input.dtype(), "batch_norm_relu",
                    [&]<typename T>() { relu_epilogue<T>(s, a.output, a.residual, a.relu_mask); });
}

// The fused operation where the forward ran it, else our masked gradient and batch norm alone.
void cudnn_backward(const BatchNormBackwardArgs& a) {
  const BatchNormShape& s = a.shape;
  const Device device = a.input.device();
  const bool fused = a.cudnn_fused.ran;
  const CudnnProblem p(s, a.input, fused, a.residual_added, "batch_norm_backward");
  const Tensor& reserve = a.cudnn_fused.reserve;
  const int64_t reserve_bytes = reserve.defined() ? reserve.numel() : 0;
  HG_CHECK(!fused || reserve_bytes == int64_t(p.reserve_bytes),
           "batch_norm_backward (cuda): the forward's cuDNN reserve has {} bytes where cuDNN asks for {}",
           reserve_bytes, p.reserve_bytes);
  // The residual's gradient: the caller's where wanted, else a scratch one where something must be written.
  auto residual_gradient = [&] {
    return a.grad_residual.defined() ? a.grad_residual : like_activation(a.grad_output, s);
  };
  // The gradient cuDNN normalises: grad_output, or after batch_norm_relu the masked gradient, which is also the
  // residual's (the fused backward masks it itself and writes it where the residual was added).
  Tensor g = a.grad_output, grad_residual;
  if (fused) {
    if (a.residual_added) grad_residual = residual_gradient();
  } else if (a.after_relu()) {
    g = residual_gradient();
    dispatch_floating(a.input.dtype(), "batch_norm_relu",
                      [&]<typename T>() { masked_gradient<T>(s, g, a.grad_output, relu_gate<T>(a)); });
  }
  size_t bytes = 0;
  HG_CUDNN_CHECK(cudnnGetBatchNormalizationBackwardExWorkspaceSize(
                     p.handle, p.mode, p.ops, p.x.desc, fused ? p.x.desc : nullptr, p.x.desc, p.residual_desc(),
                     p.x.desc, p.param.desc, p.activation(), &bytes),
                 "batch_norm_backward");
  const Tensor workspace = cudnn_workspace(bytes, device);
  const Tensor weight = or_filled(a.weight, s.channels, device, 1);
  const Tensor bias = fused ? or_filled(a.bias, s.channels, device, 0) : Tensor();
  // cuDNN always writes both parameter gradients.
  auto gradient = [&](const Tensor& t) {
    return t.defined() ? t : empty({s.channels}, {.dtype = DType::Float32, .device = device});
  };
  const Tensor grad_weight = gradient(a.grad_weight), grad_bias = gradient(a.grad_bias);
  const float one = 1, zero = 0;
  HG_CUDNN_CHECK(cudnnBatchNormalizationBackwardEx(
                     p.handle, p.mode, p.ops, &one, &zero, &one, &zero, p.x.desc, a.input.data_ptr(),
                     fused ? p.x.desc : nullptr, fused ? a.output.data_ptr() : nullptr, p.x.desc, g.data_ptr(),
                     p.residual_desc(), data_or_null(grad_residual), p.x.desc, a.grad_input.data_ptr(), p.param.desc,
                     weight.data_ptr(), data_or_null(bias), grad_weight.data_ptr(), grad_bias.data_ptr(), a.eps,
                     a.save_mean.data_ptr(), a.save_invstd.data_ptr(), p.activation(), data_or_null(workspace), bytes,
                     data_or_null(reserve), p.reserve_bytes),
                 "batch_norm_backward");
}

// ---- the choice between ours and cuDNN's, per problem and host thread (as conv2d's algorithm choice)
struct ChoiceKey {
  int device;
  DType dtype;
  bool channels_last, backward;
  int epilogue;  // batch_norm_relu: 0 none, 1 relu, 2 forward with a residual / backward with its gradient wanted
  // batch_norm_relu with ReluSaved::Mask: the forward writes relu's mask (~10% more in our apply kernel); the backward
  // reads it, where with y kept ours first makes the mask and cuDNN's path reads y.
  bool mask;
  int64_t batch, channels, spatial;
  auto operator<=>(const ChoiceKey&) const = default;
};
thread_local std::map<ChoiceKey, bool> t_cudnn_chosen;

// Whether cuDNN runs a problem it takes. Auto times both the first time, as graph replays of 8 calls: the GPU's
// time, which is what a captured step pays (timed eagerly, a cuDNN call's host work, its descriptors and size
// queries, counted too). Where a capture runs out of memory (the graph's pool at a step's peak), both are timed
// eagerly instead, as before graphs. A cuDNN failure there means ours.
bool choose_cudnn(const ChoiceKey& key, const std::function<void()>& own, const std::function<void()>& cudnn,
                  const char* op) {
  switch (batch_norm_backend()) {
    case BatchNormBackend::Own: return false;
    case BatchNormBackend::Cudnn: return true;
    case BatchNormBackend::Auto: break;
  }
  if (auto it = t_cudnn_chosen.find(key); it != t_cudnn_chosen.end()) return it->second;
  constexpr int kCalls = 8;
  auto time_both = [&](bool graphs) {
    auto time = [&](const std::function<void()>& run) {
      return graphs ? cuda::median_graph_ms(Device::cuda(key.device), run, op, kCalls)
                    : cuda::median_run_ms(key.device, run, op, kCalls);
    };
    const float own_ms = time(own);
    float cudnn_ms = -1;
    auto failed = [&](const Error& e) {
      logger().debug("{} (cuda): cuDNN failed to run [{}, {}, {}] ({}); ours is used", op, key.batch, key.channels,
                     key.spatial, e.what());
    };
    try {
      cudnn_ms = time(cudnn);
    } catch (const OutOfMemory& e) {
      if (graphs) throw;
      failed(e);
    } catch (const Error& e) {
      failed(e);
    }
    return std::pair{own_ms, cudnn_ms};
  };
  std::pair<float, float> ms;
  try {
    ms = time_both(true);
  } catch (const OutOfMemory&) {
    ms = time_both(false);
  }
  const auto [own_ms, cudnn_ms] = ms;
  const bool chosen = cudnn_ms >= 0 && cudnn_ms < own_ms;
  logger().debug("{} (cuda): {} {} [{}, {}, {}] ours {:.4f} ms, cuDNN {:.4f} ms -> {}", op, dtype_name(key.dtype),
                 key.channels_last ? "channels last" : "planes", key.batch, key.channels, key.spatial, own_ms, cudnn_ms,
                 chosen ? "cuDNN" : "ours");
  return t_cudnn_chosen.emplace(key, chosen).first->second;
}

void own_forward(const BatchNormForwardArgs& a) {
  dispatch_floating(a.input.dtype(), "batch_norm", [&]<typename T>() { forward_typed<T>(a); });
}

void own_backward(const BatchNormBackwardArgs& a) {
  dispatch_floating(a.input.dtype(), "batch_norm_backward", [&]<typename T>() {
    a.after_relu() ? backward_typed<T, true>(a) : backward_typed<T, false>(a);
  });
}

void batch_norm_backward_cuda(const BatchNormBackwardArgs& a);

// The backward of a forward call, on buffers of its own, for Auto's timing of the two directions together: the
// gradient of y is taken to be the input (values of its shape and dtype, not zeros), and the residual's gradient is
// wanted where the forward added one, as inside a ResNet.
BatchNormBackwardArgs backward_for_timing(const BatchNormForwardArgs& f) {
  const Device device = f.input.device();
  auto per_channel = [&](const Tensor& t) {
    return t.defined() ? empty({f.shape.channels}, {.dtype = t.dtype(), .device = device}) : Tensor();
  };
  BatchNormBackwardArgs b;
  b.shape = f.shape;
  b.grad_output = f.input;
  b.input = f.input;
  b.output = f.output;
  b.grad_residual = f.residual.defined() ? like_activation(f.input, f.shape) : Tensor();
  b.weight = f.weight;
  b.bias = f.bias;
  b.save_mean = f.save_mean;
  b.save_invstd = f.save_invstd;
  b.grad_input = like_activation(f.input, f.shape);
  b.grad_weight = per_channel(f.weight);
  b.grad_bias = per_channel(f.bias);
  b.eps = f.eps;
  b.residual_added = f.residual.defined();
  return b;
}

void batch_norm_forward_cuda(const BatchNormForwardArgs& a) {
  const BatchNormShape& s = a.shape;
  if (!a.training || !cudnn_takes(s, a.input.dtype(),
                                  {&a.input, &a.output, &a.residual, &a.weight, &a.bias, &a.running_mean,
                                   &a.running_var, &a.save_mean, &a.save_invstd})) {
    return own_forward(a);
  }
  cuda::DeviceGuard guard(a.input.device());
  // The timing runs leave the running statistics and the count alone: only the real call below updates them.
  BatchNormForwardArgs timed = a;
  timed.running_mean = timed.running_var = timed.batches_tracked = Tensor();
  const ChoiceKey key{a.input.device().index, a.input.dtype(), s.channels_last, false,
                      a.relu ? 1 + int(a.residual.defined()) : 0, a.relu_mask.defined(), s.batch, s.channels,
                      s.spatial};
  bool chosen;
  if (cudnn_fuses(s, a.input.dtype(), a.relu, a.relu_mask.defined())) {
    // cuDNN's fused backward needs its forward's reserve: the pairs are timed, ours with the backward's own choice.
    std::optional<BatchNormBackwardArgs> b;
    auto backward = [&]() -> const BatchNormBackwardArgs& { return b ? *b : b.emplace(backward_for_timing(timed)); };
    auto ours = [&] {
      own_forward(timed);
      batch_norm_backward_cuda(backward());
    };
    auto cudnns = [&] {
      const BatchNormForwardArgs forward = timed;  // its reserve freed within the call (the timing graph's pool)
      cudnn_forward(forward);
      BatchNormBackwardArgs after_fused = backward();
      after_fused.cudnn_fused = forward.cudnn_fused;
      cudnn_backward(after_fused);
    };
    chosen = choose_cudnn(key, ours, cudnns, "batch_norm_relu");
  } else {
    chosen = choose_cudnn(key, [&] { own_forward(timed); }, [&] { cudnn_forward(timed); }, "batch_norm");
  }
  chosen ? cudnn_forward(a) : own_forward(a);
}

void relu_mask_values_cuda(const Tensor& passes, const Tensor& mask) {
  cuda::DeviceGuard guard(passes.device());
  const int64_t n = passes.numel();
  const unsigned blocks = unsigned(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535));
  unpack_relu_mask_kernel<<<blocks, kThreads, 0, cuda::current_stream(passes.device())>>>(
      static_cast<bool*>(passes.data_ptr()), mask.data<int32_t>(), n);
  HG_CUDA_CHECK_LAUNCH("batch_norm_relu mask values");
}

void batch_norm_backward_cuda(const BatchNormBackwardArgs& a) {
  const BatchNormShape& s = a.shape;
  if (!a.training || !a.grad_input.defined() ||
      !cudnn_takes(s, a.input.dtype(),
                   {&a.input, &a.grad_output, &a.output, &a.grad_input, &a.grad_residual, &a.weight, &a.bias,
                    &a.save_mean, &a.save_invstd, &a.grad_weight, &a.grad_bias})) {
    return own_backward(a);
  }
  cuda::DeviceGuard guard(a.input.device());
  // Chosen with the forward, which ran cuDNN's fused kernel; ours still can (it reads y), as Own asks.
  if (a.cudnn_fused.ran) return batch_norm_backend() == BatchNormBackend::Own ? own_backward(a) : cudnn_backward(a);
  const ChoiceKey key{a.input.device().index, a.input.dtype(), s.channels_last, true,
                      a.after_relu() ? 1 + int(a.grad_residual.defined()) : 0,
                      a.relu_mask.defined(), s.batch, s.channels, s.spatial};
  if (choose_cudnn(key, [&] { own_backward(a); }, [&] { cudnn_backward(a); }, "batch_norm_backward")) {
    cudnn_backward(a);
  } else {
    own_backward(a);
  }
}

}  // namespace

HG_REGISTER_KERNEL(batch_norm_forward_kernel, CUDA, batch_norm_forward_cuda);
HG_REGISTER_KERNEL(batch_norm_backward_kernel, CUDA, batch_norm_backward_cuda);
HG_REGISTER_KERNEL(relu_mask_values_kernel, CUDA, relu_mask_values_cuda);

}  // namespace halfgrad

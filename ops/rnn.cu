// rnn on CUDA: the loop kernels behind rnn_loop_forward_kernel / rnn_loop_backward_kernel (ops/rnn.h), one layer's
// T steps each, in one of two ways; both run the cell arithmetic of ops/rnn_cell.h. ops/rnn.cpp drives them.
//
//   persistent   one cooperative launch for the whole loop. Block k owns `units` consecutive hidden units j (the
//                units spread over every SM) for one group of batch rows (Partition: from a batch of 16 up the
//                batch is split in two, each block with twice the units; batch_groups below) and keeps the part of
//                W_hh its units need in shared memory for all T steps: forward, the G rows g H + j (the recurrent
//                products of its own gates), backward, the columns j (the recurrent gradient reaching its own
//                units). Per step every block copies its group's rows of the previous step's h (all units) from L2
//                into shared memory (forward) or reads those rows of the next step's pre-activation gradients from
//                L2 (backward), computes its products on CUDA cores (a warp: 4 or 5 batch rows by as many rows, or
//                2-4 batch rows by the block's units, the lanes over the reduction, then a shuffle reduction; a
//                float16/bfloat16 forward of kTensorCoreHidden units and more on tensor cores, below), runs the cell
//                of its own units and rows, and waits at a grid-wide barrier (about 1 µs on an H200). Measured on
//                the H200 (LM shapes, batch 20, 35 steps): 4-9 µs a step, where cuBLAS's GEMM of a batch of 20 by a
//                650-unit LSTM's W_hh alone takes ~10 µs in float32 (latency, not arithmetic) and ~6 µs in float16.
//                Taken when the blocks fit on the GPU at once (one per SM), the slices fit in shared memory and,
//                backward, a block has at most 12 units (H <= 12 x the SMs / the groups).
//   steps        per step a cuBLAS GEMM (gemm_dense) and cell_kernel, one thread per (row, unit); the T steps
//                are captured once as a CUDA graph and replayed while the buffers repeat (cuda::run_as_graph).
//                Where the persistent kernel does not fit, or is slower.
//   choosing     RnnCudaLoop::Fastest (ops/rnn.h): the first forward of a problem on a thread runs both and keeps the
//                faster for the problem's forward and backward (HALFGRAD_LOG=debug prints the times).
//
// The persistent kernels accumulate each product in A (float32, float64 for float64) in a different order than
// cuBLAS: the two ways agree to rounding.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <map>
#include <type_traits>
#include <vector>

#include "core/cuda.h"
#include "core/log.h"
#include "ops/matmul.h"
#include "ops/rnn.h"
#include "ops/rnn_cell.h"

namespace halfgrad {
namespace {

namespace cg = cooperative_groups;

cudaStream_t stream_of(Device device) { return cuda::current_stream(device); }

// ---- steps: cuBLAS + a cell kernel per step, replayed as a graph

constexpr int kCellThreads = 256;

unsigned grid_for(int64_t n) { return unsigned(std::min<int64_t>((n + kCellThreads - 1) / kCellThreads, 65535)); }

template <RnnKind K, typename Cell>
__global__ void __launch_bounds__(kCellThreads) cell_kernel(Cell cell, int64_t n, int64_t H) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x)
    cell.template operator()<K>(e / H, e % H);
}

template <typename Cell>
void launch_cell(const Cell& cell, RnnKind kind, int64_t B, int64_t H, Device device, const char* op) {
  const int64_t n = B * H;
  if (n == 0) return;
  rnn_cell::dispatch_kind(kind, [&]<RnnKind K>() {
    cell_kernel<K><<<grid_for(n), kCellThreads, 0, stream_of(device)>>>(cell, n, H);
    HG_CUDA_CHECK_LAUNCH(op);
  });
}

// The graph's key: the direction, the sizes, the float32 GEMMs' TF32 setting (read by gemm_kernel when the work is
// captured) and every buffer the loop touches (null for those it leaves alone).
template <typename Args>
std::vector<uint64_t> graph_key(const Args& a, bool forward, std::initializer_list<const void*> buffers) {
  std::vector<uint64_t> key{uint64_t(forward),  uint64_t(a.kind),   uint64_t(a.storage),
                            uint64_t(a.steps), uint64_t(a.batch), uint64_t(a.hidden), uint64_t(cuda::allow_tf32())};
  for (const void* b : buffers) key.push_back(reinterpret_cast<uintptr_t>(b));
  return key;
}

void forward_steps(const RnnLoopForwardArgs& a) {
  const int64_t G = rnn_gates(a.kind), GH = G * a.hidden;
  const auto key = graph_key(a, true, {a.w_hh, a.gi, a.gh, a.b_ih, a.b_hh, a.h0, a.out, a.cells, a.gates, a.hn});
  cuda::run_as_graph(a.device.index, key, [&] {
    dispatch_floating(a.storage, "rnn", [&]<typename S>() {
      for (int64_t t = 0; t < a.steps; ++t) {
        const rnn_cell::Forward<S> cell(a, G, t);
        gemm_dense(a.device, a.storage, accumulation_dtype(a.storage), a.batch, GH, a.hidden, cell.h_prev, Trans::No,
                   a.w_hh, Trans::Yes, a.gh, 0.0);
        launch_cell(cell, a.kind, a.batch, a.hidden, a.device, "rnn");
      }
    });
  });
}

void backward_steps(const RnnLoopBackwardArgs& a) {
  const int64_t G = rnn_gates(a.kind), GH = G * a.hidden;
  const auto key = graph_key(a, false, {a.w_hh, a.dy, a.dh, a.dc, a.gates, a.cells, a.h0, a.out, a.hn, a.dgi, a.dgh});
  cuda::run_as_graph(a.device.index, key, [&] {
    dispatch_floating(a.storage, "rnn backward", [&]<typename S>() {
      for (int64_t t = a.steps - 1; t >= 0; --t) {
        if (t + 1 < a.steps) {
          const rnn_cell::Backward<S> next(a, G, t + 1);
          gemm_dense(a.device, a.storage, accumulation_dtype(a.storage), a.batch, a.hidden, GH,
                     next.recurrent_gradient(), Trans::No, a.w_hh, Trans::No, a.dh, 1.0);
        }
        launch_cell(rnn_cell::Backward<S>(a, G, t), a.kind, a.batch, a.hidden, a.device, "rnn backward");
      }
    });
  });
}

// ---- persistent: the whole loop in one cooperative launch

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
// A warp's share of a step's products: TILE batch rows by TILE W_hh rows (forward; TILE 4 or 5, forward_tile below)
// or kTile batch rows by all the block's units (backward; 2 rows for 12 units), each lane summing over every 32nd
// 16-byte chunk (forward) or element (backward) of the reduction.
constexpr int kTile = 4;

// How a layer is shared out: block k owns `units` consecutive hidden units, from unit (k / groups) units, for the
// `rows` consecutive batch rows of group k % groups, from row (k % groups) rows (the last group may have fewer, or
// none). Each step a block reads only its group's rows of h (forward) or of the gate gradients (backward).
struct Partition {
  int units = 0, rows = 0, groups = 1;
};
struct BlockShare {
  int j0, U, b0, rows;  // the block's first unit and its count, its first batch row and its count
  __device__ BlockShare(const Partition& p, int H, int B) {
    const int group = int(blockIdx.x) % p.groups;
    j0 = int(blockIdx.x) / p.groups * p.units;
    U = min(p.units, H - j0);
    b0 = group * p.rows;
    rows = max(0, min(p.rows, B - b0));
  }
};

using rnn_cell::kGates;
template <typename S> constexpr int kVec = 16 / int(sizeof(S));  // elements in a 16-byte load

HG_HOST_DEVICE inline int round_up(int x, int multiple) { return (x + multiple - 1) / multiple * multiple; }

// A load that bypasses L1: the data was written by other blocks during this launch.
template <typename S> __device__ S load_cg(const S* p) {
  S s;
  if constexpr (sizeof(S) == 2) {
    const unsigned short v = __ldcg(reinterpret_cast<const unsigned short*>(p));
    memcpy(&s, &v, 2);
  } else if constexpr (sizeof(S) == 4) {
    const unsigned v = __ldcg(reinterpret_cast<const unsigned*>(p));
    memcpy(&s, &v, 4);
  } else if constexpr (sizeof(S) == 8) {
    const unsigned long long v = __ldcg(reinterpret_cast<const unsigned long long*>(p));
    memcpy(&s, &v, 8);
  } else {
    static_assert(sizeof(S) == 16, "loads of 2, 4, 8 or 16 bytes");
    const int4 v = __ldcg(reinterpret_cast<const int4*>(p));
    memcpy(&s, &v, 16);
  }
  return s;
}

// N consecutive elements of shared memory (N sizeof(S) bytes, aligned to that size when it is 8 or 16 bytes and up)
// widened to A, with the fewest loads.
template <typename S, int N, typename A> __device__ void load_widened(const S* p, A (&out)[N]) {
  S s[N];
  constexpr int kBytes = N * int(sizeof(S));
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int c = 0; c < kBytes / 16; ++c) {
      const int4 v = reinterpret_cast<const int4*>(p)[c];
      memcpy(reinterpret_cast<char*>(s) + 16 * c, &v, 16);
    }
  } else if constexpr (kBytes % 8 == 0) {
#pragma unroll
    for (int c = 0; c < kBytes / 8; ++c) {
      const int2 v = reinterpret_cast<const int2*>(p)[c];
      memcpy(reinterpret_cast<char*>(s) + 8 * c, &v, 8);
    }
  } else {
#pragma unroll
    for (int v = 0; v < N; ++v) s[v] = p[v];
  }
#pragma unroll
  for (int v = 0; v < N; ++v) out[v] = A(s[v]);
}

// One level of warp_sum: lanes `offset` apart swap halves of the first n values and add them. Written as a template
// so that every index is a constant and the values stay in registers.
template <int n, int offset, int N, typename A> __device__ void warp_sum_level(A (&v)[N], int lane) {
  if constexpr (n > 1) {
    const bool upper = lane & offset;
#pragma unroll
    for (int k = 0; k < n / 2; ++k) {
      const A give = upper ? v[k] : v[k + n / 2];
      const A keep = upper ? v[k + n / 2] : v[k];
      v[k] = keep + __shfl_xor_sync(0xffffffffu, give, offset);
    }
    warp_sum_level<n / 2, offset / 2>(v, lane);
  }
}

// Sums each of N values (up to 32) over the warp's 32 lanes with P shuffles instead of 5 N, P = 16 for N <= 16, else
// 32 (the values padded with zeros): at each level a lane keeps half its values and adds its partner's copies of
// them. Afterwards lane l holds the total of value warp_sum_value<N>(l).
template <int N> constexpr int kWarpSumSlots = N <= 16 ? 16 : 32;
template <int N> __device__ int warp_sum_value(int lane) { return kWarpSumSlots<N> == 32 ? lane : lane / 2; }
template <int N> __device__ bool warp_sum_writer(int lane) {
  return (kWarpSumSlots<N> == 32 || lane % 2 == 0) && warp_sum_value<N>(lane) < N;  // one lane per value
}
template <int N, typename A> __device__ A warp_sum(const A (&values)[N]) {
  static_assert(N <= 32, "at most one value a lane");
  constexpr int P = kWarpSumSlots<N>;
  A v[P];
#pragma unroll
  for (int i = 0; i < P; ++i) v[i] = i < N ? values[i] : A(0);
  warp_sum_level<P, 16>(v, int(threadIdx.x % 32));
  return P == 32 ? v[0] : v[0] + __shfl_xor_sync(0xffffffffu, v[0], 1);
}

// Copies `rows` rows of `cols` elements from global memory (written by other blocks during this launch) into shared
// rows of `stride` elements, kDepth loads per thread in flight at a time. Element e0 + d kThreads of the sequence
// is (row, col) of the rows, followed step by step rather than divided.
template <int kDepth, typename T> __device__ void copy_rows(T* dst, int stride, const T* src, int rows, int cols) {
  const int n = rows * cols, row_step = kThreads / cols, col_step = kThreads % cols;
  int row = int(threadIdx.x) / cols, col = int(threadIdx.x) % cols;
  for (int e0 = threadIdx.x; e0 < n; e0 += kThreads * kDepth) {
    T v[kDepth];
#pragma unroll
    for (int d = 0; d < kDepth; ++d)
      if (e0 + d * kThreads < n) v[d] = load_cg(src + e0 + d * kThreads);
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      if (e0 + d * kThreads < n) dst[row * stride + col] = v[d];
      row += row_step, col += col_step;
      if (col >= cols) col -= cols, ++row;
    }
  }
}

// h_prev into shared memory in the widest loads (16, 8 or 4 bytes) that the rows, their padding and the source's
// alignment allow: a layer of 650 float16 units and a batch of 20 in one round trip.
template <typename S> __device__ void stage_rows(S* dst, int stride, const S* src, int rows, int cols) {
  auto fits = [&](int bytes) {
    return (cols * int(sizeof(S))) % bytes == 0 && (stride * int(sizeof(S))) % bytes == 0 &&
           reinterpret_cast<uintptr_t>(src) % bytes == 0;
  };
  auto copy_as = [&]<typename W>() {
    constexpr int k = int(sizeof(W) / sizeof(S));
    copy_rows<8>(reinterpret_cast<W*>(dst), stride / k, reinterpret_cast<const W*>(src), rows, cols / k);
  };
  if (fits(16)) return copy_as.template operator()<int4>();
  if constexpr (sizeof(S) < 8) {
    if (fits(8)) return copy_as.template operator()<int2>();
  }
  if constexpr (sizeof(S) < 4) {
    if (fits(4)) return copy_as.template operator()<int>();
  }
  copy_rows<32>(dst, stride, src, rows, cols);
}

// The forward's float16 and bfloat16 products run on tensor cores (WMMA 16x16x16 tiles, float32 sums) from
// kTensorCoreHidden units up; float32, float64 and smaller layers on CUDA cores. Measured on the H200 (a layer's
// forward, LSTM, batch 20, 35 steps): 650 units 241 µs on tensor cores against 335 on CUDA cores, 200 units 168
// against 154 (there a step is latency: the barrier, h from L2, the cell). float32 stays on CUDA cores even where
// TF32 is allowed: on TF32 WMMA tiles (16x16x8, twice float16's bytes to stage and load) LSTM 650's forward took 382
// µs against 345 (2026-12-02).
template <typename S> constexpr bool kTensorCores = std::is_same_v<S, Half> || std::is_same_v<S, BFloat16>;
constexpr int64_t kTensorCoreHidden = 256;
template <typename S> using WmmaType = std::conditional_t<std::is_same_v<S, Half>, __half, __nv_bfloat16>;
constexpr int kMma = 16;  // a WMMA tile's side

// The forward's shared memory, in elements of S: w [rows][stride], row g U + u = W_hh's row g H + j0 + u (U the
// block's units), then h_prev [h_rows][stride] (the group's batch rows); rows and columns padded with zeros to whole
// tiles (`tile`, 16 on tensor cores) and 16-byte chunks, so the products need no bounds. On tensor cores a row has
// an odd number of 16-byte chunks (the 8 rows a tile load reads at once fall in different banks); then, after the
// rows, one float32 16 x 16 tile per warp for the products' partial sums. Last, in A, what the cells use of the block's
// units and rows: the step's products gh [rows][G U] and, LSTM, the cell states [rows][U], kept from step to step.
struct ForwardLayout {
  int stride, rows, h_rows, partials, cell_values;
  HG_HOST_DEVICE ForwardLayout(int64_t G, const Partition& p, int64_t H, int vec, int tile) {
    const bool tensor_cores = tile == kMma;
    const int k = round_up(int(H), tensor_cores ? kMma : vec);
    stride = tensor_cores && (k / vec) % 2 == 0 ? k + vec : k;
    rows = round_up(int(G * p.units), tile);
    h_rows = round_up(p.rows, tile);
    partials = tensor_cores ? kWarps * kMma * kMma : 0;
    cell_values = p.rows * int(G + 1) * p.units;
  }
  HG_HOST_DEVICE size_t w_elements() const { return size_t(rows) * stride; }
  HG_HOST_DEVICE size_t elements() const { return w_elements() + size_t(h_rows) * stride; }
  template <typename S> HG_HOST_DEVICE size_t partials_offset() const {
    return round_up(int(elements() * sizeof(S)), 128);
  }
  template <typename S> HG_HOST_DEVICE size_t cells_offset() const {
    return partials_offset<S>() + size_t(partials) * sizeof(float);
  }
  template <typename S> HG_HOST_DEVICE size_t bytes() const {
    return cells_offset<S>() + size_t(cell_values) * sizeof(opmath_t<S>);
  }
};

// One step's products on tensor cores: gh[b][g U + u] = sum_k h[b][k] w[g U + u][k] for the block's rows. The
// output tiles (batch tiles by row tiles) are shared out with the reduction's k tiles split among the warps, so every
// warp works; each warp's float32 tile goes to `partials`, and the threads then add a tile's splits.
template <typename S>
__device__ void tensor_core_products(const S* w, const S* h, float* partials, float* gh, const ForwardLayout& layout,
                                     int G, int H, const BlockShare& my) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  if constexpr (std::is_same_v<S, BFloat16>) {  // bfloat16 WMMA needs sm_80: the host does not choose it below
    __trap();
  } else
#endif
  {
  namespace wmma = nvcuda::wmma;
  using M = WmmaType<S>;
  const int warp = threadIdx.x / 32, stride = layout.stride;
  const int n_tiles = layout.rows / kMma, tiles = (layout.h_rows / kMma) * n_tiles;
  const int k_tiles = (H + kMma - 1) / kMma, splits = max(1, kWarps / tiles);
  const int per_split = (k_tiles + splits - 1) / splits;
  for (int task = warp; task < tiles * splits; task += kWarps) {
    const int tile = task % tiles, split = task / tiles;
    const int mt = tile / n_tiles, nt = tile % n_tiles;
    wmma::fragment<wmma::accumulator, kMma, kMma, kMma, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    const int k_end = min(k_tiles, (split + 1) * per_split);
    for (int kt = split * per_split; kt < k_end; ++kt) {
      wmma::fragment<wmma::matrix_a, kMma, kMma, kMma, M, wmma::row_major> a;
      wmma::fragment<wmma::matrix_b, kMma, kMma, kMma, M, wmma::col_major> b;
      wmma::load_matrix_sync(a, reinterpret_cast<const M*>(h + mt * kMma * stride + kt * kMma), stride);
      wmma::load_matrix_sync(b, reinterpret_cast<const M*>(w + nt * kMma * stride + kt * kMma), stride);
      wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(partials + (task % kWarps) * kMma * kMma, acc, kMma, wmma::mem_row_major);
  }
  __syncthreads();
  // With tiles > kWarps a warp kept only its last tile: the plan allows tiles * splits <= kWarps here.
  const int U = my.U, R = G * U;
  for (int e = threadIdx.x; e < my.rows * R; e += kThreads) {
    const int b = e / R, r = e % R, tile = (b / kMma) * n_tiles + r / kMma, at = (b % kMma) * kMma + r % kMma;
    float sum = 0;
    for (int split = 0; split < splits; ++split) sum += partials[(split * tiles + tile) * kMma * kMma + at];
    gh[b * R + r] = sum;
  }
  }
}

// TILE: the CUDA-core products' tile (4 or 5), or kMma for the products on tensor cores.
template <typename S, RnnKind K, int TILE>
__global__ void __launch_bounds__(kThreads) persistent_forward_kernel(RnnLoopForwardArgs a, Partition p) {
  using A = opmath_t<S>;
  constexpr int G = kGates<K>, V = kVec<S>;
  constexpr bool TC = TILE == kMma;
  extern __shared__ __align__(128) unsigned char shared[];
  const int H = int(a.hidden), B = int(a.batch), T = int(a.steps);
  const BlockShare my(p, H, B);
  const int j0 = my.j0, U = my.U, R = G * U;
  const ForwardLayout layout(G, p, H, V, TILE);
  const int stride = layout.stride;
  S* w = reinterpret_cast<S*>(shared);
  S* h = w + layout.w_elements();
  float* partials = reinterpret_cast<float*>(shared + layout.partials_offset<S>());
  A* gh = reinterpret_cast<A*>(shared + layout.cells_offset<S>());  // [rows][R]
  A* c_state = gh + my.rows * R;                                     // [rows][U]
  const S* w_hh = static_cast<const S*>(a.w_hh);
#pragma unroll 8
  for (int e = threadIdx.x; e < layout.rows * stride; e += kThreads) {
    const int r = e / stride, k = e % stride;
    w[e] = r < R && k < H ? w_hh[size_t((r / U) * H + j0 + r % U) * H + k] : S(A(0));
  }
  for (int e = threadIdx.x; e < layout.h_rows * stride; e += kThreads) h[e] = S(A(0));
  if constexpr (K == RnnKind::LSTM) {
    for (int e = threadIdx.x; e < my.rows * U; e += kThreads)
      c_state[e] = static_cast<const A*>(a.cells)[(my.b0 + e / U) * H + j0 + e % U];  // c0
  }
  __syncthreads();
  // Where each of the block's units and rows has a thread of its own, the cell's input terms (W_ih x + b_ih) are
  // loaded at the start of the step, so that the loads overlap the copy of h and the products.
  const bool early = my.rows * U <= kThreads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr int kT = TC ? 1 : TILE;  // (the CUDA-core loop below is not compiled for tensor cores)
  const int chunks = stride / V, b_tiles = layout.h_rows / kT, r_tiles = layout.rows / kT;
  const cg::grid_group grid = cg::this_grid();
  for (int t = 0; t < T; ++t) {
    const rnn_cell::Forward<S> cell(a, G, t);
    A input_terms[G] = {};
    if (early && threadIdx.x < my.rows * U) {
#pragma unroll
      for (int k = 0; k < G; ++k)
        input_terms[k] = cell.input_term(my.b0 + threadIdx.x / U, k, j0 + threadIdx.x % U);
    }
    stage_rows(h, stride, cell.h_prev + size_t(my.b0) * H, my.rows, H);
    __syncthreads();
    if constexpr (TC) tensor_core_products(w, h, partials, gh, layout, G, H, my);
    for (int task = warp; !TC && task < b_tiles * r_tiles; task += kWarps) {
      const int b0 = (task / r_tiles) * kT, r0 = (task % r_tiles) * kT;
      const S* h_rows = h + b0 * stride;
      const S* w_rows = w + r0 * stride;
      A acc[kT * kT] = {};
      for (int c = lane; c < chunks; c += 32) {
        A hv[kT][V], wv[kT][V];
#pragma unroll
        for (int i = 0; i < kT; ++i) load_widened<S, V>(h_rows + i * stride + c * V, hv[i]);
#pragma unroll
        for (int q = 0; q < kT; ++q) load_widened<S, V>(w_rows + q * stride + c * V, wv[q]);
#pragma unroll
        for (int i = 0; i < kT; ++i)
#pragma unroll
          for (int q = 0; q < kT; ++q)
#pragma unroll
            for (int v = 0; v < V; ++v) acc[i * kT + q] += hv[i][v] * wv[q][v];
      }
      const A sum = warp_sum<kT * kT>(acc);
      const int value = warp_sum_value<kT * kT>(lane), b = b0 + value / kT, r = r0 + value % kT;
      if (warp_sum_writer<kT * kT>(lane) && b < my.rows && r < R) gh[b * R + r] = sum;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < my.rows * U; e += kThreads) {
      const int b = e / U, u = e % U, j = j0 + u;
      rnn_cell::ForwardInputs<A> x;
#pragma unroll
      for (int k = 0; k < G; ++k) {
        x.in[k] = early ? input_terms[k] : cell.input_term(my.b0 + b, k, j);
        x.rec[k] = cell.recurrent_term_of(gh[b * R + k * U + u], k, j);
      }
      if constexpr (K == RnnKind::LSTM) x.c_prev = c_state[e];
      if constexpr (K == RnnKind::GRU) x.h_prev = A(h[b * stride + j]);
      const A c = cell.template apply<K>(my.b0 + b, j, x);
      if constexpr (K == RnnKind::LSTM) c_state[e] = c;
    }
    grid.sync();
  }
}

// The backward's shared memory: w (A-aligned) holds w[r][u] = W_hh[r][j0 + u] (zero for u >= U) in chunks of
// kChunk<S, UP> units (the most that divide UP and take at most 16 bytes), chunk by chunk: [UP / chunk][G H][chunk].
// Lanes read consecutive rows, so a warp's loads of one chunk are consecutive (one row of UP float32 units, 32 bytes,
// read row by row, cost each load twice the shared-memory wavefronts: ncu counted 49% of them excess, 2026-12-02).
// Then, in A, the step's sums [rows][UP], to which the warps sharing a batch tile add their parts, and the gradients
// the cells carry from step to step for the block's units and rows, dh and dc [rows][U] each: backward_carry_values.
template <typename S> constexpr int chunk_units(int up) {
  int c = kVec<S>;
  while (up % c != 0) c /= 2;
  return c;
}
template <typename S, int UP> constexpr int kChunk = chunk_units<S>(UP);
// A warp's batch rows in the backward's products: its kTile-by-UP sums stay in 32 registers at most.
template <int UP> constexpr int kBackwardRows = 32 / UP < kTile ? 32 / UP : kTile;
template <typename S, typename A> HG_HOST_DEVICE size_t backward_weights_bytes(int64_t G, int64_t H, int up) {
  return (size_t(G * H * up) * sizeof(S) + sizeof(A) - 1) / sizeof(A) * sizeof(A);
}
HG_HOST_DEVICE inline int backward_carry_values(const Partition& p) { return 2 * p.rows * p.units; }

template <typename S, RnnKind K, int UP>
__global__ void __launch_bounds__(kThreads) persistent_backward_kernel(RnnLoopBackwardArgs a, Partition p) {
  using A = opmath_t<S>;
  constexpr int G = kGates<K>, kR = kBackwardRows<UP>;
  extern __shared__ __align__(128) unsigned char shared[];
  const int H = int(a.hidden), B = int(a.batch), T = int(a.steps), GH = G * H;
  const BlockShare my(p, H, B);
  const int j0 = my.j0, U = my.U, rows = my.rows;
  S* w = reinterpret_cast<S*>(shared);
  A* sums = reinterpret_cast<A*>(shared + backward_weights_bytes<S, A>(G, H, UP));  // [rows][UP]
  A* carried_dh = sums + p.rows * UP;                                                 // [rows][U]
  A* carried_dc = carried_dh + rows * U;                                              // [rows][U]
  const S* w_hh = static_cast<const S*>(a.w_hh);
  constexpr int kC = kChunk<S, UP>;
  static_assert(UP % kC == 0, "a row of units is whole chunks");
#pragma unroll 8
  for (int e = threadIdx.x; e < GH * UP; e += kThreads) {
    const int r = e / UP, u = e % UP;
    w[((u / kC) * GH + r) * kC + u % kC] = u < U ? w_hh[size_t(r) * H + j0 + u] : S(A(0));
  }
  // dh and dc of the block's units and rows stay on chip from step to step: no other block reads them.
  A* dh = static_cast<A*>(a.dh);
  A* dc = static_cast<A*>(a.dc);
  auto at = [&](int e) { return (my.b0 + e / U) * H + j0 + e % U; };
  for (int e = threadIdx.x; e < rows * U; e += kThreads) {
    carried_dh[e] = dh[at(e)];
    carried_dc[e] = K == RnnKind::LSTM ? dc[at(e)] : A(0);
  }
  // Where each of the block's units and rows has a thread of its own, the cell's inputs are loaded at the start of
  // the step, so that the loads overlap the products.
  const bool early = rows * U <= kThreads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Batch tiles by slices of the reduction: enough tasks for every warp.
  const int b_tiles = (rows + kR - 1) / kR, splits = max(1, kWarps / max(1, b_tiles));
  const int slice = round_up((GH + splits - 1) / splits, 32);
  const cg::grid_group grid = cg::this_grid();
  for (int t = T - 1; t >= 0; --t) {
    const rnn_cell::Backward<S> cell(a, G, t);
    rnn_cell::BackwardInputs<A> early_inputs;
    if (early && threadIdx.x < rows * U)
      early_inputs = cell.template inputs<K>(my.b0 + threadIdx.x / U, j0 + threadIdx.x % U);
    for (int e = threadIdx.x; e < rows * UP; e += kThreads) sums[e] = A(0);
    if (t + 1 < T) {
      __syncthreads();
      const S* next = rnn_cell::Backward<S>(a, G, t + 1).recurrent_gradient() + size_t(my.b0) * GH;
      for (int task = warp; task < b_tiles * splits; task += kWarps) {
        const int b0 = (task / splits) * kR, r_begin = (task % splits) * slice, r_end = min(GH, r_begin + slice);
        const S* grad_rows[kR];  // rows past the group's read its last row; their sums are dropped
#pragma unroll
        for (int i = 0; i < kR; ++i) grad_rows[i] = next + size_t(min(b0 + i, rows - 1)) * GH;
        A acc[kR * UP] = {};
        // The gradients come from L2: kDepth elements' loads are issued before their products.
        constexpr int kDepth = 4;
        for (int r0 = r_begin + lane; r0 < r_end; r0 += 32 * kDepth) {
          A dv[kDepth][kR];
#pragma unroll
          for (int d = 0; d < kDepth; ++d)
#pragma unroll
            for (int i = 0; i < kR; ++i)
              dv[d][i] = r0 + 32 * d < r_end ? A(load_cg(grad_rows[i] + r0 + 32 * d)) : A(0);
#pragma unroll
          for (int d = 0; d < kDepth; ++d) {
            const int r = min(r0 + 32 * d, r_end - 1);  // beyond the end dv is 0
            A wv[UP];
#pragma unroll
            for (int q = 0; q < UP / kC; ++q) {
              A part[kC];
              load_widened<S, kC>(w + (q * GH + r) * kC, part);
#pragma unroll
              for (int v = 0; v < kC; ++v) wv[q * kC + v] = part[v];
            }
#pragma unroll
            for (int i = 0; i < kR; ++i)
#pragma unroll
              for (int u = 0; u < UP; ++u) acc[i * UP + u] += dv[d][i] * wv[u];
          }
        }
        const A sum = warp_sum<kR * UP>(acc);
        const int value = warp_sum_value<kR * UP>(lane), b = b0 + value / UP, u = value % UP;
        if (warp_sum_writer<kR * UP>(lane) && b < rows && u < U) atomicAdd(&sums[b * UP + u], sum);
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < rows * U; e += kThreads) {
      const int b = my.b0 + e / U, j = j0 + e % U;
      const rnn_cell::BackwardInputs<A> x = early ? early_inputs : cell.template inputs<K>(b, j);
      const rnn_cell::BackwardCarry<A> out =
          cell.template apply<K>(b, j, x, {carried_dh[e] + sums[(e / U) * UP + e % U], carried_dc[e]});
      carried_dh[e] = out.dh;
      carried_dc[e] = out.dc;
    }
    grid.sync();
  }
  for (int e = threadIdx.x; e < rows * U; e += kThreads) {
    dh[at(e)] = carried_dh[e];
    if constexpr (K == RnnKind::LSTM) dc[at(e)] = carried_dc[e];
  }
}

// A kernel's launch: the partition, its blocks and shared memory; blocks == 0 when the kernel cannot run the problem.
struct Plan {
  int blocks = 0;
  Partition part;
  size_t smem = 0;
};

// The partition into `groups` groups of batch rows: the hidden units spread over every SM, units * groups a block.
Partition partition(int device, int64_t H, int64_t B, int groups) {
  const int64_t sms = cuda::multiprocessor_count(device);
  return {.units = int((H * groups + sms - 1) / sms), .rows = int((B + groups - 1) / groups), .groups = groups};
}

// The batch groups to try, first choice first: set_rnn_batch_groups's, or 2 from a batch of 16 up (half the rows
// of h or of the gate gradients from L2 a step), then 1 (where 2 groups' slices do not fit).
std::vector<int> batch_groups(int64_t B) {
  if (const int set = rnn_batch_groups(); set > 0) return {set};
  return B >= 16 ? std::vector<int>{2, 1} : std::vector<int>{1};
}

// Computed once per kernel, device and problem: the shared memory and co-residency checks query the device.
template <typename Kernel>
Plan plan_for(Kernel kernel, int device, const Partition& part, size_t smem, int64_t H) {
  using Key = std::array<int64_t, 6>;
  thread_local std::map<std::pair<const void*, Key>, Plan> plans;
  const std::pair<const void*, Key> key{reinterpret_cast<const void*>(kernel),
                                        {device, part.units, part.rows, part.groups, int64_t(smem), H}};
  const auto found = plans.find(key);
  if (found != plans.end()) return found->second;
  const int sms = cuda::multiprocessor_count(device);
  int max_smem = 0;
  HG_CUDA_CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "rnn");
  Plan plan;
  if (smem <= size_t(max_smem)) {
    // The kernel's shared-memory limit only grows: the plans of other sizes made earlier (a training batch after an
    // evaluation one) keep launching.
    thread_local std::map<std::pair<const void*, int>, size_t> raised;
    size_t& limit = raised[{reinterpret_cast<const void*>(kernel), device}];
    if (smem > limit) {
      HG_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)), "rnn");
      limit = smem;
    }
    int per_sm = 0;
    HG_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem), "rnn");
    const int64_t blocks = (H + part.units - 1) / part.units * part.groups;
    if (blocks <= int64_t(per_sm) * sms) plan = {int(blocks), part, smem};
  }
  plans[key] = plan;
  return plan;
}

template <typename Args> bool persistent_allowed(const Args& a) {
  return rnn_cuda_loop() != RnnCudaLoop::Steps && a.batch > 0 && a.hidden > 0 &&
         a.batch * a.hidden * rnn_gates(a.kind) * 8 <= INT32_MAX && a.steps <= INT32_MAX;
}

template <typename Args> void launch_cooperative(void (*kernel)(Args, Partition), const Args& a, const Plan& plan,
                                                 const char* op) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(plan.blocks));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = plan.smem;
  config.stream = stream_of(a.device);
  cudaLaunchAttribute cooperative;
  cooperative.id = cudaLaunchAttributeCooperative;
  cooperative.val.cooperative = 1;
  config.attrs = &cooperative;
  config.numAttrs = 1;
  HG_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, a, plan.part), op);
  HG_CUDA_CHECK_LAUNCH(op);
}

// The CUDA-core forward's tile (kTile or 5): the one whose products take the fewest shared-memory loads on the
// busiest warp, a round of tasks over the warps loading 2 TILE vectors a chunk (LSTM 650 at batch 20 in one group: 25
// tasks of 4 x 4, two rounds for some warps, against 16 of 5 x 5 in one; in two groups, 30 against 16).
int forward_tile(int64_t G, const Partition& p) {
  auto busiest = [&](int tile) {
    const int64_t tasks = (p.rows + tile - 1) / tile * ((G * p.units + tile - 1) / tile);
    return (tasks + kWarps - 1) / kWarps * 2 * tile;
  };
  return busiest(5) < busiest(kTile) ? 5 : kTile;
}

// The forward kernel with TILE's plan; blocks == 0 when the problem does not fit it.
template <typename S, RnnKind K, int TILE> Plan forward_plan(const RnnLoopForwardArgs& a, const Partition& part) {
  const ForwardLayout layout(kGates<K>, part, a.hidden, kVec<S>, TILE);
  if (TILE == kMma && (layout.h_rows / kMma) * (layout.rows / kMma) > kWarps) return {};  // a tile per warp at most
  return plan_for(persistent_forward_kernel<S, K, TILE>, a.device.index, part, layout.bytes<S>(), a.hidden);
}

template <typename S, RnnKind K, int UP>
bool backward_persistent_up(const RnnLoopBackwardArgs& a, const Partition& part, bool launch) {
  using A = opmath_t<S>;
  const size_t smem = backward_weights_bytes<S, A>(kGates<K>, a.hidden, UP) +
                      size_t(part.rows * UP + backward_carry_values(part)) * sizeof(A);
  const Plan plan = plan_for(persistent_backward_kernel<S, K, UP>, a.device.index, part, smem, a.hidden);
  if (plan.blocks == 0) return false;
  if (launch) launch_cooperative(persistent_backward_kernel<S, K, UP>, a, plan, "rnn backward");
  return true;
}

// The backward kernel holds all of a block's units in registers: 4, 8 or 12 of them.
template <typename S, RnnKind K> bool backward_persistent(const RnnLoopBackwardArgs& a, bool launch) {
  if (!persistent_allowed(a)) return false;
  for (const int groups : batch_groups(a.batch)) {
    const Partition part = partition(a.device.index, a.hidden, a.batch, groups);
    if (part.units <= 4 && backward_persistent_up<S, K, 4>(a, part, launch)) return true;
    if (part.units > 4 && part.units <= 8 && backward_persistent_up<S, K, 8>(a, part, launch)) return true;
    if (part.units > 8 && part.units <= 12 && backward_persistent_up<S, K, 12>(a, part, launch)) return true;
  }
  return false;
}

// ---- choosing per problem, as conv2d and batch_norm do: the first time a thread meets a forward problem that the
// persistent kernel takes, both ways run on the real buffers (the forward loop only writes its outputs and scratch,
// so running it again changes nothing) and the faster is kept for the problem's forward and backward. With the
// groups chosen, a problem the forward kernel does not take runs the steps both ways: the backward kernel alone,
// where it fits, was measured slower there (LSTM 1500, batch 64, float16: 11.1 ms a training step against 6.3,
// 2026-12-03).

using ChoiceKey = std::array<int64_t, 7>;
template <typename Args> ChoiceKey choice_key(const Args& a) {
  return {a.device.index, int64_t(a.kind), int64_t(a.storage), a.steps, a.batch, a.hidden, int64_t(cuda::allow_tf32())};
}
thread_local std::map<ChoiceKey, bool> t_persistent_chosen;

bool choose_persistent(const RnnLoopForwardArgs& a, const std::function<void()>& persistent) {
  if (rnn_cuda_loop() == RnnCudaLoop::Persistent) return true;
  const ChoiceKey key = choice_key(a);
  if (auto it = t_persistent_chosen.find(key); it != t_persistent_chosen.end()) return it->second;
  const float persistent_ms = cuda::median_run_ms(a.device.index, persistent, "rnn");
  const float steps_ms = cuda::median_run_ms(a.device.index, [&] { forward_steps(a); }, "rnn");
  const bool chosen = persistent_ms < steps_ms;
  logger().debug("rnn (cuda): {} {} T {} B {} H {}: persistent {:.4f} ms, steps {:.4f} ms -> {}", rnn_kind_name(a.kind),
                 dtype_name(a.storage), a.steps, a.batch, a.hidden, persistent_ms, steps_ms,
                 chosen ? "persistent" : "steps");
  return t_persistent_chosen.emplace(key, chosen).first->second;
}

// Calls fn.template operator()<S, K>() with the storage type and the kind as template arguments.
template <typename Fn> void dispatch_loop(DType storage, RnnKind kind, const char* op, Fn&& fn) {
  dispatch_floating(storage, op, [&]<typename S>() {
    rnn_cell::dispatch_kind(kind, [&]<RnnKind K>() { fn.template operator()<S, K>(); });
  });
}

void rnn_loop_forward_cuda(const RnnLoopForwardArgs& a) {
  cuda::DeviceGuard guard(a.device);
  dispatch_loop(a.storage, a.kind, "rnn", [&]<typename S, RnnKind K>() {
    auto run = [&]<int TILE>(const Plan& plan) {
      auto persistent = [&] { launch_cooperative(persistent_forward_kernel<S, K, TILE>, a, plan, "rnn"); };
      if (choose_persistent(a, persistent))
        persistent();
      else
        forward_steps(a);
    };
    for (const int groups : persistent_allowed(a) ? batch_groups(a.batch) : std::vector<int>{}) {
      const Partition part = partition(a.device.index, a.hidden, a.batch, groups);
      if constexpr (kTensorCores<S>) {
        // (WMMA: float16 from sm_70, bfloat16 from sm_80)
        const int major = cuda::compute_capability(a.device.index) / 10;
        if (a.hidden >= kTensorCoreHidden && major >= (std::is_same_v<S, Half> ? 7 : 8)) {
          if (const Plan plan = forward_plan<S, K, kMma>(a, part); plan.blocks > 0)
            return run.template operator()<kMma>(plan);
        }
      }
      // (5 x 5 tiles pad more rows: where they do not fit, 4 x 4 may)
      if (forward_tile(kGates<K>, part) == 5) {
        if (const Plan plan = forward_plan<S, K, 5>(a, part); plan.blocks > 0) return run.template operator()<5>(plan);
      }
      if (const Plan plan = forward_plan<S, K, kTile>(a, part); plan.blocks > 0)
        return run.template operator()<kTile>(plan);
    }
    // Chosen, not measured: only where the kernel was allowed and the chosen groups found no plan (a forced loop or a
    // forced group count must not leave the choice behind for later calls).
    if (rnn_cuda_loop() == RnnCudaLoop::Fastest && rnn_batch_groups() == 0 && persistent_allowed(a))
      t_persistent_chosen.emplace(choice_key(a), false);
    forward_steps(a);
  });
}

void rnn_loop_backward_cuda(const RnnLoopBackwardArgs& a) {
  cuda::DeviceGuard guard(a.device);
  dispatch_loop(a.storage, a.kind, "rnn backward", [&]<typename S, RnnKind K>() {
    // The forward's choice for the same problem (steps where the forward kernel did not fit); a backward without
    // one (another thread ran the forward) takes the persistent kernel where it fits.
    const auto it = t_persistent_chosen.find(choice_key(a));
    const bool steps_chosen = rnn_cuda_loop() == RnnCudaLoop::Fastest && it != t_persistent_chosen.end() && !it->second;
    if (!steps_chosen && backward_persistent<S, K>(a, true)) return;
    backward_steps(a);
  });
}

}  // namespace

HG_REGISTER_KERNEL(rnn_loop_forward_kernel, CUDA, rnn_loop_forward_cuda);
HG_REGISTER_KERNEL(rnn_loop_backward_kernel, CUDA, rnn_loop_backward_cuda);

}  // namespace halfgrad

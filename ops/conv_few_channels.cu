// conv2d's forward and weight gradient on tensor cores for windows of at most 32 values (ops/conv_few_channels.h).
//
// A block takes 128 output pixels (flattened over N, OH, OW: the rows of the NHWC output) and up to 64 output
// channels. Its threads gather each pixel's window into a shared-memory row (im2col, k = (kh kW + kw) C + c, the
// order of a channels_last weight; zeros in the padding and past C kH kW), then its four warps multiply on tensor
// cores, with mma.sync m16n8k16 fed by ldmatrix:
//   forward          y [pixels, O]  = window [pixels, 32] w^T [32, O]        a warp: 32 pixels x the block's outputs
//   weight gradient  dw [O, 32]    += dy^T [O, pixels] window [pixels, 32]  a warp: 16 outputs x 32, each tile's
//                                     128 pixels the reduction; a block loops over tiles and keeps its sums
// Row strides in shared memory are odd multiples of 16 bytes, so the 8 rows one ldmatrix reads fall in different
// banks. The weight gradient's blocks (one wave of them) write float32 partial sums, added up in a fixed order by a
// second kernel that also rounds and scatters them into the weight's layout.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <type_traits>

#include "core/cuda.h"
#include "core/error.h"
#include "ops/conv_few_channels.h"

namespace halfgrad {
namespace {

constexpr int kThreads = 128;        // four warps
constexpr int kTilePixels = 128;     // output pixels a block takes at a time
constexpr int kWindow = 32;          // the reduction of one pixel: C kH kW, padded with zeros
constexpr int kWindowStride = 40;    // shared-memory row of a window, in 16-bit values (80 bytes)
constexpr int kOutputChunk = 64;     // output channels a block takes
constexpr int kOutputStride = 72;    // shared-memory row of 64 channels (144 bytes)
constexpr int kReduceGroups = 8;     // warps that split the partial sums of one output channel

// Sizes of one problem, in the forward's roles. x and y are dense NHWC; the weight is read through its strides.
struct Geometry {
  int N, C, H, W, O, OH, OW, kH, kW, sH, sW, pH, pW, dH, dW;
  int window;  // C kH kW
  int pixels;  // N OH OW
  int64_t w_stride[4];  // the weight's strides in (o, c, kh, kw)
};

// Where value k of a window comes from, k = (kh kW + kw) C + c: a block's table, made once, so that the gathers do
// no division. c < 0 past the window.
struct Taps {
  int kh[kWindow], kw[kWindow], c[kWindow];

  __device__ void make(const Geometry& g) {  // by threads 0-31; the block synchronises before use
    if (threadIdx.x < kWindow) {
      const int k = int(threadIdx.x), tap = k / g.C;
      const bool inside = k < g.window;
      kh[k] = inside ? tap / g.kW : 0;
      kw[k] = inside ? tap % g.kW : 0;
      c[k] = inside ? k % g.C : -1;
    }
  }
  __device__ int64_t weight_offset(const Geometry& g, int o, int k) const {
    return o * g.w_stride[0] + c[k] * g.w_stride[1] + kh[k] * g.w_stride[2] + kw[k] * g.w_stride[3];
  }
};

Geometry geometry_of(const Tensor& x, const Tensor& w, const Tensor& y, const Conv2dParams& p) {
  Geometry g{};
  g.N = int(x.size(0)), g.C = int(x.size(1)), g.H = int(x.size(2)), g.W = int(x.size(3));
  g.O = int(w.size(0)), g.kH = int(w.size(2)), g.kW = int(w.size(3));
  g.OH = int(y.size(2)), g.OW = int(y.size(3));
  g.sH = int(p.stride[0]), g.sW = int(p.stride[1]), g.pH = int(p.padding[0]), g.pW = int(p.padding[1]);
  g.dH = int(p.dilation[0]), g.dW = int(p.dilation[1]);
  g.window = g.C * g.kH * g.kW;
  g.pixels = g.N * g.OH * g.OW;
  for (int d = 0; d < 4; ++d) g.w_stride[d] = w.stride(d);
  return g;
}

// ---- the tensor-core instructions (sm_80 and newer; the host offers these kernels only there)

// Four 8x8 matrices of 16-bit values; lane l gives the address of row l % 8 of matrix l / 8.
template <bool kTransposed> __device__ __forceinline__ void load_matrices(uint32_t (&r)[4], const uint16_t* row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const auto address = uint32_t(__cvta_generic_to_shared(row));
  if constexpr (kTransposed) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
  }
#else
  __trap();
#endif
}

// d += a b for one 16x8 tile, a 16x16 (row-major fragments) and b 16x8 (column-major), float32 accumulation.
template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, Half>) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#else
  __trap();
#endif
}

// Two floats rounded to T (to nearest, ties to even, as T(float)), packed low first.
template <typename T> __device__ __forceinline__ uint32_t pack(float lo, float hi) {
  return uint32_t(T(lo).bits) | (uint32_t(T(hi).bits) << 16);
}

// ---- the window gather (both kernels): row `row` (32 values, 16-byte aligned) of output pixel p, zeros outside the
// input, past the window, and for p past the last pixel. Every load is made, from the image's first value where
// the window is outside, and its value then dropped: a load under a condition becomes a branch, and 32 branches
// wait for 32 loads one after another (ncu: 41 µs for the stem's forward at batch 256, DRAM 4% busy). So the loads
// are in flight together; a warp's threads read neighbouring pixels, so each load touches a few sectors.
__device__ void gather_window(uint16_t* row, const uint16_t* __restrict__ x, const Geometry& g, const Taps& taps,
                              int p) {
  uint32_t pairs[kWindow / 2] = {};
  if (p < g.pixels) {
    const int ow = p % g.OW, rest = p / g.OW, oh = rest % g.OH, n = rest / g.OH;
    const int ih0 = oh * g.sH - g.pH, iw0 = ow * g.sW - g.pW;
    const uint16_t* image = x + int64_t(n) * g.H * g.W * g.C;
#pragma unroll
    for (int k = 0; k < kWindow; ++k) {
      const int ih = ih0 + taps.kh[k] * g.dH, iw = iw0 + taps.kw[k] * g.dW, c = taps.c[k];
      const bool inside = c >= 0 && ih >= 0 && ih < g.H && iw >= 0 && iw < g.W;
      const uint32_t v = __ldg(image + (inside ? (ih * g.W + iw) * g.C + c : 0));
      pairs[k / 2] |= (inside ? v : 0u) << (16 * (k % 2));
    }
  }
#pragma unroll
  for (int i = 0; i < kWindow / 8; ++i) {
    reinterpret_cast<uint4*>(row)[i] = make_uint4(pairs[4 * i], pairs[4 * i + 1], pairs[4 * i + 2], pairs[4 * i + 3]);
  }
}

// ---- forward: grid (pixel tiles, output chunks)

template <typename T>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(uint16_t* __restrict__ y, const uint16_t* __restrict__ x, const uint16_t* __restrict__ w,
                   Geometry g) {
  __shared__ alignas(16) uint16_t windows[kTilePixels * kWindowStride];
  __shared__ alignas(16) uint16_t weights[kOutputChunk * kWindowStride];  // [o][k]: the B operand, column-major
  __shared__ alignas(16) uint16_t staged[kTilePixels * kOutputStride];    // the output tile, rounded
  __shared__ Taps taps;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int p0 = int(blockIdx.x) * kTilePixels, o0 = int(blockIdx.y) * kOutputChunk;
  const int outputs = min(kOutputChunk, g.O - o0);  // a multiple of 8

  taps.make(g);
  __syncthreads();
  constexpr int kWeightsPerThread = kOutputChunk * kWindow / kThreads;
  uint16_t values[kWeightsPerThread];  // all loaded (unconditionally, as in gather_window), then stored
#pragma unroll
  for (int j = 0; j < kWeightsPerThread; ++j) {
    const int i = int(threadIdx.x) + j * kThreads, o = i / kWindow, k = i % kWindow;
    const bool used = (o < outputs) & (taps.c[k] >= 0);
    const uint16_t v = __ldg(w + (used ? taps.weight_offset(g, o0 + o, k) : 0));
    values[j] = used ? v : uint16_t(0);
  }
#pragma unroll
  for (int j = 0; j < kWeightsPerThread; ++j) {
    const int i = int(threadIdx.x) + j * kThreads;
    weights[(i / kWindow) * kWindowStride + i % kWindow] = values[j];
  }
  gather_window(windows + threadIdx.x * kWindowStride, x, g, taps, p0 + int(threadIdx.x));
  __syncthreads();

  // lane l addresses row l % 8 of matrix l / 8: for A (pixels x k) matrices go rows 0-7, rows 8-15 at k 0-7, then
  // at k 8-15; for B (k x outputs, stored [o][k]) outputs 0-7 at k 0-7 and k 8-15, then outputs 8-15.
  const int matrix = lane / 8, r = lane % 8;
  float acc[2][8][4] = {};
#pragma unroll
  for (int ks = 0; ks < kWindow / 16; ++ks) {
    uint32_t a[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const int row = warp * 32 + mt * 16 + r + (matrix & 1) * 8;
      load_matrices<false>(a[mt], windows + row * kWindowStride + ks * 16 + (matrix >> 1) * 8);
    }
#pragma unroll
    for (int nt = 0; nt < 8; nt += 2) {
      if (nt * 8 >= outputs) break;
      uint32_t b[4];
      const int o = nt * 8 + r + (matrix >> 1) * 8;
      load_matrices<false>(b, weights + o * kWindowStride + ks * 16 + (matrix & 1) * 8);
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        mma<T>(acc[mt][nt], a[mt], b[0], b[1]);
        mma<T>(acc[mt][nt + 1], a[mt], b[2], b[3]);
      }
    }
  }

  // The warp's 32 rows through shared memory, so that each thread stores whole 16-byte pieces of output rows.
  const int g_row = lane / 4, g_col = 2 * (lane % 4);  // an accumulator's place in its 16x8 tile
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      uint16_t* at = staged + (warp * 32 + mt * 16 + g_row) * kOutputStride + nt * 8 + g_col;
      *reinterpret_cast<uint32_t*>(at) = pack<T>(acc[mt][nt][0], acc[mt][nt][1]);
      *reinterpret_cast<uint32_t*>(at + 8 * kOutputStride) = pack<T>(acc[mt][nt][2], acc[mt][nt][3]);
    }
  }
  __syncwarp();
  const int pieces = outputs / 8;
  for (int i = lane; i < 32 * pieces; i += 32) {
    const int row = warp * 32 + i / pieces, piece = i % pieces, p = p0 + row;
    if (p < g.pixels) {
      *reinterpret_cast<uint4*>(y + int64_t(p) * g.O + o0 + piece * 8) =
          *reinterpret_cast<const uint4*>(staged + row * kOutputStride + piece * 8);
    }
  }
}

// ---- weight gradient: grid (blocks, output chunks); block b takes tiles b, b + blocks, ...

template <typename T>
__global__ void __launch_bounds__(kThreads)
    weight_partials_kernel(float* __restrict__ partials, const uint16_t* __restrict__ dy,
                           const uint16_t* __restrict__ x, Geometry g, int tiles) {
  __shared__ alignas(16) uint16_t windows[kTilePixels * kWindowStride];  // [pixel][k]: B, row-major
  __shared__ alignas(16) uint16_t grads[kTilePixels * kOutputStride];    // [pixel][o]: A transposed
  __shared__ Taps taps;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int o0 = int(blockIdx.y) * kOutputChunk;
  const int outputs = min(kOutputChunk, g.O - o0);
  const int matrix = lane / 8, r = lane % 8;
  float acc[4][4] = {};  // outputs warp * 16 + [0, 16) by k in four 8-wide tiles
  taps.make(g);
  __syncthreads();

  for (int tile = int(blockIdx.x); tile < tiles; tile += int(gridDim.x)) {
    const int p0 = tile * kTilePixels;
    gather_window(windows + threadIdx.x * kWindowStride, x, g, taps, p0 + int(threadIdx.x));
#pragma unroll
    for (int j = 0; j < kTilePixels * (kOutputChunk / 8) / kThreads; ++j) {
      const int i = int(threadIdx.x) + j * kThreads;
      const int row = i / (kOutputChunk / 8), piece = i % (kOutputChunk / 8), p = p0 + row;
      const bool used = p < g.pixels && piece * 8 < outputs;  // loaded either way, as in gather_window
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(dy + (used ? int64_t(p) * g.O + o0 + piece * 8 : 0)));
      *reinterpret_cast<uint4*>(grads + row * kOutputStride + piece * 8) = used ? v : make_uint4(0, 0, 0, 0);
    }
    __syncthreads();
    // Transposed loads: A[o][pixel] from rows of pixels (matrices: outputs 0-7, 8-15 at pixels 0-7, then at
    // pixels 8-15), B[pixel][k] likewise (pixels 0-7 and 8-15 of k tile nt, then of nt + 1).
#pragma unroll
    for (int ks = 0; ks < kTilePixels / 16; ++ks) {
      uint32_t a[4];
      load_matrices<true>(a, grads + (ks * 16 + r + (matrix >> 1) * 8) * kOutputStride + warp * 16 + (matrix & 1) * 8);
#pragma unroll
      for (int nt = 0; nt < 4; nt += 2) {
        uint32_t b[4];
        load_matrices<true>(b, windows + (ks * 16 + r + (matrix & 1) * 8) * kWindowStride + nt * 8 + (matrix >> 1) * 8);
        mma<T>(acc[nt], a, b[0], b[1]);
        mma<T>(acc[nt + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();
  }

  float* out = partials + (int64_t(blockIdx.y) * gridDim.x + blockIdx.x) * (kOutputChunk * kWindow);
  const int g_row = lane / 4, g_col = 2 * (lane % 4);
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    float* at = out + (warp * 16 + g_row) * kWindow + nt * 8 + g_col;
    *reinterpret_cast<float2*>(at) = make_float2(acc[nt][0], acc[nt][1]);
    *reinterpret_cast<float2*>(at + 8 * kWindow) = make_float2(acc[nt][2], acc[nt][3]);
  }
}

// grid O, block kReduceGroups x 32: output o's 32 sums over the partials' blocks, in a fixed order.
template <typename T>
__global__ void __launch_bounds__(kReduceGroups * 32)
    weight_sum_kernel(uint16_t* __restrict__ dw, const float* __restrict__ partials, int blocks, Geometry g) {
  __shared__ float sums[kReduceGroups][kWindow];
  __shared__ Taps taps;
  taps.make(g);
  const int o = int(blockIdx.x), k = int(threadIdx.x) % 32, group = int(threadIdx.x) / 32;
  const float* in = partials + int64_t(o / kOutputChunk) * blocks * (kOutputChunk * kWindow) +
                    (o % kOutputChunk) * kWindow + k;
  float s = 0;
  for (int b = group; b < blocks; b += kReduceGroups) s += in[int64_t(b) * (kOutputChunk * kWindow)];
  sums[group][k] = s;
  __syncthreads();
  if (group == 0 && k < g.window) {
    float total = 0;
#pragma unroll
    for (int i = 0; i < kReduceGroups; ++i) total += sums[i][k];
    dw[taps.weight_offset(g, o, k)] = T(total).bits;
  }
}

// ---- host side

int tiles_of(const Geometry& g) { return (g.pixels + kTilePixels - 1) / kTilePixels; }
int chunks_of(const Geometry& g) { return (g.O + kOutputChunk - 1) / kOutputChunk; }
// The weight gradient's partial sums: one block's [kOutputChunk][kWindow] float32, per block and output chunk.
int64_t partials_bytes(const Geometry& g, int blocks) {
  return int64_t(chunks_of(g)) * blocks * kOutputChunk * kWindow * int64_t(sizeof(float));
}

// One wave of the weight gradient's blocks (each loops over tiles), at most one per tile.
template <typename T> int weight_blocks(const Geometry& g, int device) {
  thread_local std::map<int, int> resident;  // blocks an SM holds, per device
  auto it = resident.find(device);
  if (it == resident.end()) {
    cuda::DeviceGuard guard(device);  // the occupancy is the current device's
    int per_sm = 0;
    HG_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, weight_partials_kernel<T>, kThreads, 0),
                  "conv2d backward (weight)");
    it = resident.emplace(device, std::max(per_sm, 1)).first;
  }
  const int wave = it->second * cuda::multiprocessor_count(device) / chunks_of(g);
  return std::max(1, std::min(tiles_of(g), wave));
}

// fn.template operator()<T>() with T the storage type of a float16 or bfloat16 dtype.
template <typename Fn> void dispatch_half_type(DType dtype, Fn&& fn) {
  if (dtype == kFloat16)
    fn.template operator()<Half>();
  else
    fn.template operator()<BFloat16>();
}

const uint16_t* bits_of(const Tensor& t) { return static_cast<const uint16_t*>(t.data_ptr()); }
uint16_t* mutable_bits_of(const Tensor& t) { return static_cast<uint16_t*>(t.data_ptr()); }

}  // namespace

bool few_channels_conv_takes(const Tensor& x, const Tensor& w, const Tensor& y, const Conv2dParams& params) {
  if (!x.device().is_cuda() || !is_half(x.dtype()) || w.dtype() != x.dtype() || y.dtype() != x.dtype()) return false;
  if (x.numel() == 0 || w.numel() == 0 || y.numel() == 0) return false;  // the gathers load from x's first value
  if (params.groups != 1 || w.dim() != 4 || w.size(1) * w.size(2) * w.size(3) > kWindow || w.size(0) % 8 != 0) {
    return false;
  }
  // Dense NHWC x and y (is_channels_last is also false for anything but 4-D).
  if (!is_channels_last(x) || !is_channels_last(y) || reinterpret_cast<uintptr_t>(y.data_ptr()) % 16 != 0) {
    return false;
  }
  if (x.numel() > INT32_MAX || y.numel() > INT32_MAX) return false;
  return cuda::compute_capability(x.device().index) >= 80;
}

namespace {
// The entry points' own check, so that a caller that skipped few_channels_conv_takes gets an error, not a fault.
void check_takes(const char* op, const Tensor& x, const Tensor& w, const Tensor& y, const Conv2dParams& params) {
  HG_CHECK(few_channels_conv_takes(x, w, y, params),
           "{} (few-channels kernel): does not take input {}, weight {}, output {} with groups {} (see "
           "few_channels_conv_takes: half types on sm_80+, C kH kW <= 32, O a multiple of 8, NHWC x and y)", op,
           x.meta(), w.meta(), y.meta(), params.groups);
}
}  // namespace

void few_channels_conv_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Conv2dParams& params) {
  if (y.numel() == 0) return;
  check_takes("conv2d", x, w, y, params);
  const Geometry g = geometry_of(x, w, y, params);
  cuda::DeviceGuard guard(x.device());
  const cudaStream_t stream = cuda::current_stream(x.device());
  const dim3 grid(unsigned(tiles_of(g)), unsigned(chunks_of(g)));
  dispatch_half_type(x.dtype(), [&]<typename T>() {
    forward_kernel<T><<<grid, kThreads, 0, stream>>>(mutable_bits_of(y), bits_of(x), bits_of(w), g);
    HG_CUDA_CHECK_LAUNCH("conv2d");
  });
}

int64_t few_channels_weight_workspace(const Tensor& x, const Tensor& w, const Tensor& y) {
  const Geometry g = geometry_of(x, w, y, {});
  int blocks = 0;
  dispatch_half_type(x.dtype(), [&]<typename T>() { blocks = weight_blocks<T>(g, x.device().index); });
  return partials_bytes(g, blocks);
}

void few_channels_conv_backward_weight(const Tensor& grad_weight, const Tensor& grad_output, const Tensor& x,
                                       const Conv2dParams& params, const Tensor& workspace) {
  if (grad_output.numel() == 0) {  // no pixels: a zero gradient
    Tensor(grad_weight).zero_();
    return;
  }
  check_takes("conv2d backward (weight)", x, grad_weight, grad_output, params);
  const Geometry g = geometry_of(x, grad_weight, grad_output, params);
  cuda::DeviceGuard guard(x.device());
  const cudaStream_t stream = cuda::current_stream(x.device());
  dispatch_half_type(x.dtype(), [&]<typename T>() {
    const int blocks = weight_blocks<T>(g, x.device().index);
    HG_CHECK(workspace.numel() >= partials_bytes(g, blocks),
             "conv2d backward (weight): a workspace of {} bytes is too small for {}", workspace.numel(),
             grad_weight.meta());
    auto* partials = static_cast<float*>(workspace.data_ptr());
    weight_partials_kernel<T><<<dim3(unsigned(blocks), unsigned(chunks_of(g))), kThreads, 0, stream>>>(
        partials, bits_of(grad_output), bits_of(x), g, tiles_of(g));
    HG_CUDA_CHECK_LAUNCH("conv2d backward (weight)");
    weight_sum_kernel<T><<<unsigned(g.O), kReduceGroups * 32, 0, stream>>>(mutable_bits_of(grad_weight), partials,
                                                                           blocks, g);
    HG_CUDA_CHECK_LAUNCH("conv2d backward (weight)");
  });
}

}  // namespace halfgrad

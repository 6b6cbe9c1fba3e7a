// Pooling on CUDA: max_pool2d, avg_pool2d, adaptive_avg_pool2d, forward and backward (and max pooling's gather, the
// backward of its backward).
//
// One thread per output element in the forward kernels; one thread per input element in the backward ones,
// gathering from the outputs whose windows cover it (no atomics: deterministic, and exact for float16). Max pooling
// over windows that tile a channels-last input (VGG's 2 x 2, stride 2) has kernels of its own: a thread per output
// position and 16-byte vector of channels, forward and backward (max_pool_tiled_*).
// Elements are numbered in the order of the output's memory format (N, C, H, W or N, H, W, C), so that
// neighbouring threads touch neighbouring addresses in both layouts; every operand of the general kernels is
// addressed through its own strides (the tiled ones take dense NHWC operands only). Sums are accumulated in opmath_t
// (float for float16/bfloat16) and rounded once. Max pooling and adaptive average pooling, in every CNN's step, index
// in 32 bits where every offset fits (fits_int32).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <optional>
#include <type_traits>

#include "core/cuda.h"
#include "ops/pool.h"
#include "ops/vec16.cuh"

namespace halfgrad {
namespace {

constexpr int kBlock = 256;

// The 4-D geometry a kernel needs: sizes of the input and output planes and everyone's strides, in the index type
// I of its arithmetic (int32_t where every offset fits, see fits_int32).
template <typename I = int64_t> struct Geometry {
  I N, C, H, W, OH, OW;
  I in[4], out[4], aux[4];  // strides: input (or grad_input), output (or grad_output), indices
  bool channels_last;       // number the threads' elements in NHWC order
};

int64_t stride_of(const Tensor& t, int d) { return t.defined() ? t.stride(d) : 0; }

template <typename I = int64_t>
Geometry<I> geometry(const Tensor& input, const Tensor& output, const Tensor& aux, const Tensor& ordered_by) {
  Geometry<I> g{I(input.size(0)), I(input.size(1)), I(input.size(2)), I(input.size(3)), I(output.size(2)),
                I(output.size(3)), {}, {}, {}, suggest_memory_format(ordered_by) == MemoryFormat::ChannelsLast};
  for (int d = 0; d < 4; ++d) {
    g.in[d] = I(input.stride(d));
    g.out[d] = I(output.stride(d));
    g.aux[d] = I(stride_of(aux, d));
  }
  return g;
}

// Whether every element count and offset of the tensors fits an int32_t, with window parameters small enough
// (under 2^14) that their products do too: then the kernels index in 32 bits, whose divisions cost a fraction of
// 64-bit ones (max_pool2d's backward at VGG16's first layer, batch 512, took 630 µs with 64-bit indices).
bool fits_int32(std::initializer_list<const Tensor*> tensors, const Pool2dParams& p) {
  for (int d = 0; d < 2; ++d)
    for (int64_t v : {p.kernel[d], p.stride[d], p.padding[d], p.dilation[d]})
      if (v >= (int64_t(1) << 14)) return false;
  for (const Tensor* t : tensors) {
    if (!t->defined()) continue;
    int64_t last = 0;
    for (int64_t d = 0; d < t->dim(); ++d) last += (t->size(d) - 1) * std::abs(t->stride(d));
    // Half the range: a grid-stride loop's index may pass the total by a grid's width before it stops.
    if (t->numel() >= INT32_MAX / 2 || last >= INT32_MAX / 2) return false;
  }
  return true;
}

// Calls launch.template operator()<I>() with I = int32_t when the problem fits it, else int64_t.
template <typename Launch> void with_index_type(bool fits_int32, const Launch& launch) {
  if (fits_int32)
    launch.template operator()<int32_t>();
  else
    launch.template operator()<int64_t>();
}

// Element `i` of a [N, C, P, Q] grid numbered in NCHW or NHWC order.
template <typename I> struct Index4 {
  I n, c, p, q;
};
template <typename I> __device__ __forceinline__ Index4<I> unflatten(I i, I C, I P, I Q, bool channels_last) {
  Index4<I> r;
  if (channels_last) {
    r.c = i % C;
    i /= C;
    r.q = i % Q;
    i /= Q;
    r.p = i % P;
    r.n = i / P;
  } else {
    r.q = i % Q;
    i /= Q;
    r.p = i % P;
    i /= P;
    r.c = i % C;
    r.n = i / C;
  }
  return r;
}

template <typename I> __device__ __forceinline__ I offset(const I (&s)[4], I n, I c, I h, I w) {
  return n * s[0] + c * s[1] + h * s[2] + w * s[3];
}

// A pooling window's parameters in the index type.
template <typename I> struct Window {
  I kernel[2], stride[2], padding[2], dilation[2];
  explicit Window(const Pool2dParams& p) {
    for (int d = 0; d < 2; ++d) {
      kernel[d] = I(p.kernel[d]);
      stride[d] = I(p.stride[d]);
      padding[d] = I(p.padding[d]);
      dilation[d] = I(p.dilation[d]);
    }
  }
};

// Element i of `total`, in the index type I, over every thread of the grid.
#define HG_GRID_STRIDE_LOOP(I, i, total) \
  for (I i = I(blockIdx.x) * I(blockDim.x) + I(threadIdx.x); i < (total); i += I(gridDim.x) * I(blockDim.x))

unsigned grid_for(int64_t total) {
  return unsigned(std::min<int64_t>((total + kBlock - 1) / kBlock, int64_t(1) << 20));
}

// ---- max

// S: int64_t (flat indices) or uint8_t (window positions), MaxPool2dKernel's `indices`.
template <typename T, typename I, typename S>
__global__ void max_pool_kernel(const T* x, T* y, S* indices, Geometry<I> g, Window<I> p, I total) {
  using Acc = opmath_t<T>;
  HG_GRID_STRIDE_LOOP(I, i, total) {
    const Index4<I> o = unflatten(i, g.C, g.OH, g.OW, g.channels_last);
    Acc best = -std::numeric_limits<Acc>::infinity();
    I best_index = -1, best_position = kNoWindowPosition;
    for (I kh = 0; kh < p.kernel[0]; ++kh) {
      const I ih = window_input(p, 0, o.p, kh);
      if (ih < 0 || ih >= g.H) continue;
      for (I kw = 0; kw < p.kernel[1]; ++kw) {
        const I iw = window_input(p, 1, o.q, kw);
        if (iw < 0 || iw >= g.W) continue;
        const Acc v = Acc(x[offset(g.in, o.n, o.c, ih, iw)]);
        if (best_index < 0 || v > best || v != v) {  // first element, then larger; nan wins (as the CPU)
          best = v;
          best_index = ih * g.W + iw;
          best_position = kh * p.kernel[1] + kw;
        }
      }
    }
    y[offset(g.out, o.n, o.c, o.p, o.q)] = T(best);
    indices[offset(g.aux, o.n, o.c, o.p, o.q)] = S(std::is_same_v<S, uint8_t> ? best_position : best_index);
  }
}

// The outputs along one dim whose windows (span = dilation (kernel - 1) + 1) can cover input position i.
template <typename I>
__device__ __forceinline__ void covering(I i, I pad, I stride, I span, I count, I& first, I& last) {
  first = i + pad < span ? 0 : (i + pad - span) / stride + 1;
  last = (i + pad) / stride + 1;
  last = last < count ? last : count;
}

template <typename T, typename I, typename S>
__global__ void max_pool_backward_kernel(T* dx, const T* dy, const S* indices, Geometry<I> g, Window<I> p, I total) {
  using Acc = opmath_t<T>;
  const I span_h = p.dilation[0] * (p.kernel[0] - 1) + 1, span_w = p.dilation[1] * (p.kernel[1] - 1) + 1;
  HG_GRID_STRIDE_LOOP(I, i, total) {
    const Index4<I> e = unflatten(i, g.C, g.H, g.W, g.channels_last);
    const int64_t me = int64_t(e.p) * g.W + e.q;
    I h0, h1, w0, w1;
    covering(e.p, p.padding[0], p.stride[0], span_h, g.OH, h0, h1);
    covering(e.q, p.padding[1], p.stride[1], span_w, g.OW, w0, w1);
    Acc sum = 0;
    for (I oh = h0; oh < h1; ++oh) {
      for (I ow = w0; ow < w1; ++ow) {
        const S saved = indices[offset(g.aux, e.n, e.c, oh, ow)];
        bool here;
        if constexpr (std::is_same_v<S, uint8_t>) {  // a window position: this element's own within (oh, ow)?
          const I k = I(saved);
          here = saved != kNoWindowPosition && window_position_input(p, 0, oh, k) == e.p &&
                 window_position_input(p, 1, ow, k) == e.q;
        } else {
          here = saved == me;
        }
        if (here) sum += Acc(dy[offset(g.out, e.n, e.c, oh, ow)]);
      }
    }
    dx[offset(g.in, e.n, e.c, e.p, e.q)] = T(sum);
  }
}

// The transpose of the backward (MaxPool2dGatherKernel): a thread an output element reads the source at its maximum.
template <typename T, typename I, typename S>
__global__ void max_pool_gather_kernel(T* out, const T* source, const S* indices, Geometry<I> g, Window<I> p,
                                       I total) {
  HG_GRID_STRIDE_LOOP(I, i, total) {
    const Index4<I> o = unflatten(i, g.C, g.OH, g.OW, g.channels_last);
    const S saved = indices[offset(g.aux, o.n, o.c, o.p, o.q)];
    I ih = -1, iw = 0;  // none: a window with no input element
    if constexpr (std::is_same_v<S, uint8_t>) {  // a window position: its row and column in the plane
      if (saved != kNoWindowPosition) {
        ih = window_position_input(p, 0, o.p, I(saved));
        iw = window_position_input(p, 1, o.q, I(saved));
      }
    } else if (saved >= 0) {
      ih = I(saved / g.W);
      iw = I(saved % g.W);
    }
    out[offset(g.out, o.n, o.c, o.p, o.q)] = ih < 0 ? T(0) : source[offset(g.in, o.n, o.c, ih, iw)];
  }
}

// ---- max over windows that tile a channels-last input: stride = kernel, no padding or dilation, H = OH KH and
// W = OW KW, every tensor dense NHWC, C a whole number of 16-byte vectors, window positions kept. A thread takes one
// output position and one vector of channels: it reads the window's KH KW vectors and writes the maximum's vector
// and its V positions (V bytes) forward; backward it reads those and writes the window's vectors, each lane dy where
// the position is its own and 0 elsewhere (every input element lies in exactly one window). The general kernels spent
// a dozen divisions an element and, backward, read each output's index once for each element of its window: at
// VGG16 batch 2048 in float16, 3,110 µs for the five backward passes (docs/benchmarks.md).
template <int V> struct alignas(V) Positions {
  uint8_t k[V];
};

struct Tiling {
  int32_t C, W, OH, OW, KH, KW, vectors;  // vectors: N OH OW C / V, one per thread
};

// The offset in x (or dx) of the window's first element, (n, oh KH, ow KW, c), for thread i.
template <typename T>
__device__ __forceinline__ int32_t tiled_window_start(int32_t i, const Tiling& t) {
  constexpr int V = Vec16<T>::kSize;
  const int32_t CV = t.C / V, cv = i % CV, r = i / CV, ow = r % t.OW, r2 = r / t.OW, oh = r2 % t.OH, n = r2 / t.OH;
  return ((n * t.OH * t.KH + oh * t.KH) * t.W + ow * t.KW) * t.C + cv * V;
}

template <typename T>
__global__ void max_pool_tiled_kernel(const T* x, T* y, uint8_t* positions, Tiling t) {
  using Acc = opmath_t<T>;
  constexpr int V = Vec16<T>::kSize;
  const int32_t step = int32_t(gridDim.x * blockDim.x);
  for (int32_t i = int32_t(blockIdx.x * blockDim.x + threadIdx.x); i < t.vectors; i += step) {
    const T* window = x + tiled_window_start<T>(i, t);
    Acc best[V];
    Positions<V> at;
    for (int32_t kh = 0; kh < t.KH; ++kh) {
      for (int32_t kw = 0; kw < t.KW; ++kw) {
        const Vec16<T> v = *reinterpret_cast<const Vec16<T>*>(window + (kh * t.W + kw) * t.C);
        const int32_t k = kh * t.KW + kw;
#pragma unroll
        for (int lane = 0; lane < V; ++lane) {
          const Acc a = Acc(v.v[lane]);
          if (k == 0 || a > best[lane] || a != a) {  // first element, then larger; nan wins (as max_pool_kernel)
            best[lane] = a;
            at.k[lane] = uint8_t(k);
          }
        }
      }
    }
    Vec16<T> out;
#pragma unroll
    for (int lane = 0; lane < V; ++lane) out.v[lane] = T(best[lane]);
    reinterpret_cast<Vec16<T>*>(y)[i] = out;  // dense NHWC: output vector i is thread i's
    reinterpret_cast<Positions<V>*>(positions)[i] = at;
  }
}

template <typename T>
__global__ void max_pool_tiled_backward_kernel(T* dx, const T* dy, const uint8_t* positions, Tiling t) {
  using Acc = opmath_t<T>;
  constexpr int V = Vec16<T>::kSize;
  const int32_t step = int32_t(gridDim.x * blockDim.x);
  for (int32_t i = int32_t(blockIdx.x * blockDim.x + threadIdx.x); i < t.vectors; i += step) {
    const Vec16<T> g = reinterpret_cast<const Vec16<T>*>(dy)[i];
    const Positions<V> at = reinterpret_cast<const Positions<V>*>(positions)[i];
    T* window = dx + tiled_window_start<T>(i, t);
    for (int32_t kh = 0; kh < t.KH; ++kh) {
      for (int32_t kw = 0; kw < t.KW; ++kw) {
        const int32_t k = kh * t.KW + kw;
        Vec16<T> out;
#pragma unroll
        for (int lane = 0; lane < V; ++lane) out.v[lane] = at.k[lane] == k ? g.v[lane] : T(Acc(0));
        *reinterpret_cast<Vec16<T>*>(window + (kh * t.W + kw) * t.C) = out;
      }
    }
  }
}

// ---- avg

template <typename T> __global__ void avg_pool_kernel(const T* x, T* y, Geometry<> g, Pool2dParams p, int64_t total) {
  using Acc = opmath_t<T>;
  HG_GRID_STRIDE_LOOP(int64_t, i, total) {
    const auto o = unflatten(i, g.C, g.OH, g.OW, g.channels_last);
    const AvgWindow wh = avg_window(o.p, g.H, p.kernel[0], p.stride[0], p.padding[0]);
    const AvgWindow ww = avg_window(o.q, g.W, p.kernel[1], p.stride[1], p.padding[1]);
    const int64_t divisor = avg_divisor(p, wh, ww);
    Acc sum = 0;
    for (int64_t ih = wh.start; ih < wh.end; ++ih) {
      for (int64_t iw = ww.start; iw < ww.end; ++iw) sum += Acc(x[offset(g.in, o.n, o.c, ih, iw)]);
    }
    y[offset(g.out, o.n, o.c, o.p, o.q)] = T(divisor != 0 ? sum / Acc(divisor) : Acc(0));
  }
}

template <typename T>
__global__ void avg_pool_backward_kernel(T* dx, const T* dy, Geometry<> g, Pool2dParams p, int64_t total) {
  using Acc = opmath_t<T>;
  HG_GRID_STRIDE_LOOP(int64_t, i, total) {
    const auto e = unflatten(i, g.C, g.H, g.W, g.channels_last);
    int64_t h0, h1, w0, w1;
    covering(e.p, p.padding[0], p.stride[0], p.kernel[0], g.OH, h0, h1);
    covering(e.q, p.padding[1], p.stride[1], p.kernel[1], g.OW, w0, w1);
    Acc sum = 0;
    for (int64_t oh = h0; oh < h1; ++oh) {
      const AvgWindow wh = avg_window(oh, g.H, p.kernel[0], p.stride[0], p.padding[0]);
      for (int64_t ow = w0; ow < w1; ++ow) {
        const AvgWindow ww = avg_window(ow, g.W, p.kernel[1], p.stride[1], p.padding[1]);
        const int64_t divisor = avg_divisor(p, wh, ww);
        if (divisor != 0) sum += Acc(dy[offset(g.out, e.n, e.c, oh, ow)]) / Acc(divisor);
      }
    }
    dx[offset(g.in, e.n, e.c, e.p, e.q)] = T(sum);
  }
}

// ---- adaptive avg

template <typename T, typename I>
__global__ void adaptive_avg_pool_kernel(const T* x, T* y, Geometry<I> g, I total) {
  using Acc = opmath_t<T>;
  HG_GRID_STRIDE_LOOP(I, i, total) {
    const Index4<I> o = unflatten(i, g.C, g.OH, g.OW, g.channels_last);
    const I h0 = adaptive_start(o.p, g.H, g.OH), h1 = adaptive_end(o.p, g.H, g.OH);
    const I w0 = adaptive_start(o.q, g.W, g.OW), w1 = adaptive_end(o.q, g.W, g.OW);
    Acc sum = 0;
    for (I ih = h0; ih < h1; ++ih) {
      for (I iw = w0; iw < w1; ++iw) sum += Acc(x[offset(g.in, o.n, o.c, ih, iw)]);
    }
    y[offset(g.out, o.n, o.c, o.p, o.q)] = T(sum / Acc((h1 - h0) * (w1 - w0)));
  }
}

template <typename T, typename I>
__global__ void adaptive_avg_pool_backward_kernel(T* dx, const T* dy, Geometry<I> g, I total) {
  using Acc = opmath_t<T>;
  HG_GRID_STRIDE_LOOP(I, i, total) {
    const Index4<I> e = unflatten(i, g.C, g.H, g.W, g.channels_last);
    // Cells [floor(h OH / H), ceil((h + 1) OH / H)) are the only candidates; each is checked exactly.
    const I oh0 = (e.p * g.OH) / g.H, oh_end = ((e.p + 1) * g.OH + g.H - 1) / g.H;
    const I ow0 = (e.q * g.OW) / g.W, ow_end = ((e.q + 1) * g.OW + g.W - 1) / g.W;
    const I oh1 = oh_end < g.OH ? oh_end : g.OH, ow1 = ow_end < g.OW ? ow_end : g.OW;
    Acc sum = 0;
    for (I oh = oh0; oh < oh1; ++oh) {
      const I h0 = adaptive_start(oh, g.H, g.OH), h1 = adaptive_end(oh, g.H, g.OH);
      if (e.p < h0 || e.p >= h1) continue;
      for (I ow = ow0; ow < ow1; ++ow) {
        const I w0 = adaptive_start(ow, g.W, g.OW), w1 = adaptive_end(ow, g.W, g.OW);
        if (e.q < w0 || e.q >= w1) continue;
        sum += Acc(dy[offset(g.out, e.n, e.c, oh, ow)]) / Acc((h1 - h0) * (w1 - w0));
      }
    }
    dx[offset(g.in, e.n, e.c, e.p, e.q)] = T(sum);
  }
}

#undef HG_GRID_STRIDE_LOOP

// The backward of global average pooling (a 1 x 1 output, every CNN's head): dx[n, c, h, w] = dy[n, c] / (H W), in
// 16-byte vectors of dx's memory order. NHWC with C a whole number of vectors: a vector runs along c and reads
// dy's values of its channels; NCHW with H W a whole number of vectors: a vector lies in one plane and takes one
// value. The same quotient as the general kernel's (0 + dy / (H W)), where that kernel spends a dozen divisions an
// element finding the windows that cover it: 27.6 µs for ResNet-18's head at batch 256 in float16.
template <typename T, bool kChannelsLast>
__global__ void global_avg_pool_backward_kernel(T* dx, const T* dy, int32_t C, int32_t HW, int32_t dy_n, int32_t dy_c,
                                                int32_t vectors) {
  using Acc = opmath_t<T>;
  constexpr int V = Vec16<T>::kSize;
  const Acc area = Acc(HW);
  for (int32_t i = int32_t(blockIdx.x * blockDim.x + threadIdx.x); i < vectors; i += int32_t(gridDim.x * blockDim.x)) {
    const int32_t e = i * V;  // the vector's first element, in dx's memory order
    Vec16<T> out;
    if constexpr (kChannelsLast) {
      const int32_t c = e % C, n = e / (C * HW);
#pragma unroll
      for (int k = 0; k < V; ++k) out.v[k] = T(Acc(dy[n * dy_n + (c + k) * dy_c]) / area);
    } else {
      const int32_t plane = e / HW, n = plane / C, c = plane - n * C;
      const T value = T(Acc(dy[n * dy_n + c * dy_c]) / area);
#pragma unroll
      for (int k = 0; k < V; ++k) out.v[k] = value;
    }
    reinterpret_cast<Vec16<T>*>(dx)[i] = out;
  }
}

// ---- launchers

template <typename T> T* ptr(const Tensor& t) { return static_cast<T*>(t.data_ptr()); }

template <typename Launch> void launch_floating(DType dtype, const char* op, Device device, Launch&& launch) {
  cuda::DeviceGuard guard(device);
  cudaStream_t stream = cuda::current_stream(device);
  dispatch_floating(dtype, op, [&]<typename T>() { launch.template operator()<T>(stream); });
  HG_CUDA_CHECK_LAUNCH(op);
}

// The tiling of max_pool_tiled_kernel's conditions (above) for input (or grad_input) and output (or grad_output), or
// nothing where one fails.
std::optional<Tiling> tiling(const Tensor& input, const Tensor& output, const Tensor& indices, const Pool2dParams& p) {
  const int64_t per_vector = 16 / int64_t(element_size(input.dtype()));
  const int64_t C = input.size(1), H = input.size(2), W = input.size(3), OH = output.size(2), OW = output.size(3);
  const bool tiles = indices.dtype() == kUInt8 && p.stride == p.kernel && p.padding == Pair2d{0, 0} &&
                     p.dilation == Pair2d{1, 1} && H == OH * p.kernel[0] && W == OW * p.kernel[1] &&
                     C % per_vector == 0;
  if (!tiles || !is_channels_last(input) || !is_channels_last(output) || !is_channels_last(indices) ||
      reinterpret_cast<uintptr_t>(input.data_ptr()) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(output.data_ptr()) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(indices.data_ptr()) % per_vector != 0 || !fits_int32({&input, &output}, p))
    return std::nullopt;
  return Tiling{int32_t(C), int32_t(W), int32_t(OH), int32_t(OW), int32_t(p.kernel[0]), int32_t(p.kernel[1]),
                int32_t(output.numel() / per_vector)};
}

void max_pool2d_cuda(const Tensor& out, const Tensor& indices, const Tensor& input, const Pool2dParams& p) {
  if (const std::optional<Tiling> t = tiling(input, out, indices, p)) {
    launch_floating(input.dtype(), "max_pool2d", input.device(), [&]<typename T>(cudaStream_t stream) {
      max_pool_tiled_kernel<T><<<grid_for(t->vectors), kBlock, 0, stream>>>(ptr<const T>(input), ptr<T>(out),
                                                                             ptr<uint8_t>(indices), *t);
    });
    return;
  }
  const int64_t total = out.numel();
  auto launch = [&]<typename I>() {
    const Geometry<I> g = geometry<I>(input, out, indices, out);
    launch_floating(input.dtype(), "max_pool2d", input.device(), [&]<typename T>(cudaStream_t stream) {
      dispatch_max_pool_indices(indices, [&]<typename S>() {
        max_pool_kernel<T, I, S><<<grid_for(total), kBlock, 0, stream>>>(ptr<const T>(input), ptr<T>(out),
                                                                          ptr<S>(indices), g, Window<I>(p), I(total));
      });
    });
  };
  with_index_type(fits_int32({&input, &out, &indices}, p), launch);
}

void max_pool2d_backward_cuda(const Tensor& grad_input, const Tensor& grad_output, const Tensor& indices,
                              const Pool2dParams& p) {
  if (const std::optional<Tiling> t = tiling(grad_input, grad_output, indices, p)) {
    launch_floating(grad_input.dtype(), "max_pool2d backward", grad_input.device(), [&]<typename T>(cudaStream_t s) {
      max_pool_tiled_backward_kernel<T><<<grid_for(t->vectors), kBlock, 0, s>>>(
          ptr<T>(grad_input), ptr<const T>(grad_output), ptr<const uint8_t>(indices), *t);
    });
    return;
  }
  const int64_t total = grad_input.numel();
  auto launch = [&]<typename I>() {
    const Geometry<I> g = geometry<I>(grad_input, grad_output, indices, grad_input);
    launch_floating(grad_input.dtype(), "max_pool2d backward", grad_input.device(), [&]<typename T>(cudaStream_t s) {
      dispatch_max_pool_indices(indices, [&]<typename S>() {
        max_pool_backward_kernel<T, I, S><<<grid_for(total), kBlock, 0, s>>>(
            ptr<T>(grad_input), ptr<const T>(grad_output), ptr<const S>(indices), g, Window<I>(p), I(total));
      });
    });
  };
  with_index_type(fits_int32({&grad_input, &grad_output, &indices}, p), launch);
}

void max_pool2d_gather_cuda(const Tensor& out, const Tensor& source, const Tensor& indices, const Pool2dParams& p) {
  const int64_t total = out.numel();
  auto launch = [&]<typename I>() {
    const Geometry<I> g = geometry<I>(source, out, indices, out);
    launch_floating(out.dtype(), "max_pool2d gather", out.device(), [&]<typename T>(cudaStream_t s) {
      dispatch_max_pool_indices(indices, [&]<typename S>() {
        max_pool_gather_kernel<T, I, S><<<grid_for(total), kBlock, 0, s>>>(
            ptr<T>(out), ptr<const T>(source), ptr<const S>(indices), g, Window<I>(p), I(total));
      });
    });
  };
  with_index_type(fits_int32({&source, &out, &indices}, p), launch);
}

void avg_pool2d_cuda(const Tensor& out, const Tensor& input, const Pool2dParams& p) {
  const Geometry<> g = geometry(input, out, Tensor(), out);
  const int64_t total = out.numel();
  launch_floating(input.dtype(), "avg_pool2d", input.device(), [&]<typename T>(cudaStream_t stream) {
    avg_pool_kernel<T><<<grid_for(total), kBlock, 0, stream>>>(ptr<const T>(input), ptr<T>(out), g, p, total);
  });
}

void avg_pool2d_backward_cuda(const Tensor& grad_input, const Tensor& grad_output, const Pool2dParams& p) {
  const Geometry<> g = geometry(grad_input, grad_output, Tensor(), grad_input);
  const int64_t total = grad_input.numel();
  launch_floating(grad_input.dtype(), "avg_pool2d backward", grad_input.device(), [&]<typename T>(cudaStream_t s) {
    avg_pool_backward_kernel<T><<<grid_for(total), kBlock, 0, s>>>(ptr<T>(grad_input), ptr<const T>(grad_output), g,
                                                                   p, total);
  });
}

// adaptive_avg_pool2d indexes in 32 bits where fits_int32 says so and the window bounds' products (o + 1) * in do
// too: its backward at ResNet-18's head (a 256 x 512 x 4 x 4 float16 gradient) took 69 µs with 64-bit divisions.
bool adaptive_fits_int32(const Tensor& in, const Tensor& out) {
  return fits_int32({&in, &out}, Pool2dParams{}) && (out.size(2) + 1) * in.size(2) < INT32_MAX / 2 &&
         (out.size(3) + 1) * in.size(3) < INT32_MAX / 2 && (in.size(2) + 1) * out.size(2) < INT32_MAX / 2 &&
         (in.size(3) + 1) * out.size(3) < INT32_MAX / 2;
}

void adaptive_avg_pool2d_cuda(const Tensor& out, const Tensor& input) {
  const int64_t total = out.numel();
  auto launch = [&]<typename I>() {
    const Geometry<I> g = geometry<I>(input, out, Tensor(), out);
    launch_floating(input.dtype(), "adaptive_avg_pool2d", input.device(), [&]<typename T>(cudaStream_t stream) {
      adaptive_avg_pool_kernel<T, I><<<grid_for(total), kBlock, 0, stream>>>(ptr<const T>(input), ptr<T>(out), g,
                                                                              I(total));
    });
  };
  with_index_type(adaptive_fits_int32(input, out), launch);
}

// global_avg_pool_backward_kernel where it applies: a 1 x 1 output, grad_input contiguous with H W a whole number of
// 16-byte vectors or channels_last with C a whole number of them, aligned, and every offset within 32 bits. Returns
// false elsewhere.
bool global_avg_pool_backward_cuda(const Tensor& grad_input, const Tensor& grad_output) {
  if (grad_output.size(2) != 1 || grad_output.size(3) != 1) return false;
  const int64_t per_vector = 16 / int64_t(element_size(grad_input.dtype()));
  const int64_t C = grad_input.size(1), HW = grad_input.size(2) * grad_input.size(3);
  const bool nchw = grad_input.is_contiguous() && HW % per_vector == 0;
  const bool nhwc = !nchw && is_channels_last(grad_input) && C % per_vector == 0;
  if ((!nchw && !nhwc) || reinterpret_cast<uintptr_t>(grad_input.data_ptr()) % 16 != 0 ||
      !fits_int32({&grad_input, &grad_output}, Pool2dParams{}))
    return false;
  const int64_t vectors = grad_input.numel() / per_vector;
  const unsigned blocks = unsigned(std::min<int64_t>((vectors + kBlock - 1) / kBlock, 65535));
  launch_floating(grad_input.dtype(), "adaptive_avg_pool2d backward", grad_input.device(),
                  [&]<typename T>(cudaStream_t s) {
                    auto kernel = nhwc ? global_avg_pool_backward_kernel<T, true>
                                       : global_avg_pool_backward_kernel<T, false>;
                    kernel<<<blocks, kBlock, 0, s>>>(ptr<T>(grad_input), ptr<const T>(grad_output), int32_t(C),
                                                     int32_t(HW), int32_t(grad_output.stride(0)),
                                                     int32_t(grad_output.stride(1)), int32_t(vectors));
                  });
  return true;
}

void adaptive_avg_pool2d_backward_cuda(const Tensor& grad_input, const Tensor& grad_output) {
  if (global_avg_pool_backward_cuda(grad_input, grad_output)) return;
  const int64_t total = grad_input.numel();
  auto launch = [&]<typename I>() {
    const Geometry<I> g = geometry<I>(grad_input, grad_output, Tensor(), grad_input);
    launch_floating(grad_input.dtype(), "adaptive_avg_pool2d backward", grad_input.device(),
                    [&]<typename T>(cudaStream_t s) {
                      adaptive_avg_pool_backward_kernel<T, I><<<grid_for(total), kBlock, 0, s>>>(
                          ptr<T>(grad_input), ptr<const T>(grad_output), g, I(total));
                    });
  };
  with_index_type(adaptive_fits_int32(grad_input, grad_output), launch);
}

}  // namespace

HG_REGISTER_KERNEL(max_pool2d_kernel, CUDA, max_pool2d_cuda);
HG_REGISTER_KERNEL(max_pool2d_backward_kernel, CUDA, max_pool2d_backward_cuda);
HG_REGISTER_KERNEL(max_pool2d_gather_kernel, CUDA, max_pool2d_gather_cuda);
HG_REGISTER_KERNEL(avg_pool2d_kernel, CUDA, avg_pool2d_cuda);
HG_REGISTER_KERNEL(avg_pool2d_backward_kernel, CUDA, avg_pool2d_backward_cuda);
HG_REGISTER_KERNEL(adaptive_avg_pool2d_kernel, CUDA, adaptive_avg_pool2d_cuda);
HG_REGISTER_KERNEL(adaptive_avg_pool2d_backward_kernel, CUDA, adaptive_avg_pool2d_backward_cuda);

}  // namespace halfgrad

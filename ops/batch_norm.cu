// batch_norm on CUDA: the kernels behind batch_norm_forward_kernel and batch_norm_backward_kernel
// (ops/batch_norm.h), for both layouts (planes = NCHW, channels last = NHWC and [N, C]).
//
// Forward (training): 1. per-channel partial statistics, 2. finalize, 3. apply.
//   1. reduce: the M = N * S values of each channel are cut into `splits` ranges so that there are enough
//      blocks to fill the GPU; each block reduces its range with Welford's algorithm per thread and Chan's
//      merge across threads, and writes one partial state.
//        planes:        block (256) per (channel, split); element m of channel c is (m / S, c, m % S).
//        channels last: block (32 channels x 8 rows) per (32-channel tile, split); neighbouring threads
//                       read neighbouring channels of a row (coalesced).
//   2. finalize (one thread per channel): merges the splits, writes mean and invstd (saved for backward)
//      and updates the running statistics in place.
//   3. apply: y = (x - mean[c]) * invstd[c] * weight[c] + bias[c], elementwise.
// Forward (eval): 2'. invstd from the running variance, 3. apply.
// Backward: 1. per-channel sums of g and g * (x - mean) (same reduction kernels), 2. finalize: grad_weight,
// grad_bias and three per-channel coefficients, 3. apply: grad_input = g * alpha + (x - mean) * beta + gamma.
// Inputs are float16/bfloat16/float32 (statistics in float32) or float64 (in float64).
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "core/cuda.h"
#include "ops/batch_norm.h"
#include "ops/cuda_loops.cuh"

namespace halfgrad {
namespace {

constexpr int kThreads = 256;
constexpr int kTileChannels = 32, kTileRows = 8;  // channels-last reduction block
constexpr int64_t kMinPerThread = 16;             // a split leaves each thread at least this many elements

template <typename T> using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// (halfgrad::min, the reduction, would hide CUDA's min wherever ops/reduce.h is visible)
template <typename I> __device__ __forceinline__ I smaller(I a, I b) { return a < b ? a : b; }

int multiprocessors(int device) {
  static int cached[64] = {};
  if (device < 0 || device >= 64) return 132;
  if (cached[device] == 0) {
    int count = 0;
    HG_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device), "batch_norm");
    cached[device] = std::max(count, 1);
  }
  return cached[device];
}

// ---- reducers: what a channel's elements are reduced to

// Welford: count, mean and sum of squared deviations; Chan et al.'s formula merges two.
template <typename T> struct StatsReducer {
  using A = acc_t<T>;
  struct State {
    A mean, m2;
    int64_t n;
  };
  const T* x;

  __device__ static State identity() { return {A(0), A(0), 0}; }
  __device__ void add(State& s, int64_t at, int64_t) const {
    const A v = A(x[at]);
    s.n += 1;
    const A d = v - s.mean;
    s.mean += d / A(s.n);
    s.m2 += d * (v - s.mean);
  }
  __device__ static State merge(State a, const State& b) {
    if (b.n == 0) return a;
    if (a.n == 0) return b;
    const int64_t n = a.n + b.n;
    const A d = b.mean - a.mean, fb = A(b.n) / A(n);
    return {a.mean + d * fb, a.m2 + b.m2 + d * d * A(a.n) * fb, n};
  }
};

// sum(g) and sum(g * (x - mean[c])).
template <typename T> struct GradSumsReducer {
  using A = acc_t<T>;
  struct State {
    A dy, dy_xmu;
  };
  const T* g;
  const T* x;
  const A* mean;

  __device__ static State identity() { return {A(0), A(0)}; }
  __device__ void add(State& s, int64_t at, int64_t c) const {
    const A dy = A(g[at]);
    s.dy += dy;
    s.dy_xmu += dy * (A(x[at]) - mean[c]);
  }
  __device__ static State merge(State a, const State& b) { return {a.dy + b.dy, a.dy_xmu + b.dy_xmu}; }
};

// ---- 1. reduction kernels: one partial state per (channel, split), at partial[c * splits + split]

template <typename R>
__global__ void __launch_bounds__(kThreads)
    reduce_planes_kernel(R r, int64_t channels, cuda::IntDivider spatial, uint32_t per_channel, uint32_t chunk,
                         typename R::State* partial) {
  using State = typename R::State;
  const int64_t c = blockIdx.x;
  const uint32_t lo = blockIdx.y * chunk, hi = smaller(per_channel, lo + chunk);
  State s = R::identity();
  for (uint32_t m = lo + threadIdx.x; m < hi; m += kThreads) {
    const uint32_t n = spatial.div(m), i = m - n * spatial.divisor;
    r.add(s, (int64_t(n) * channels + c) * int64_t(spatial.divisor) + i, c);
  }
  __shared__ alignas(16) unsigned char raw[kThreads * sizeof(State)];
  State* states = reinterpret_cast<State*>(raw);
  states[threadIdx.x] = s;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (int(threadIdx.x) < stride) states[threadIdx.x] = R::merge(states[threadIdx.x], states[threadIdx.x + stride]);
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[c * gridDim.y + blockIdx.y] = states[0];
}

template <typename R>
__global__ void __launch_bounds__(kTileChannels * kTileRows)
    reduce_rows_kernel(R r, int64_t channels, int64_t rows, int64_t chunk, typename R::State* partial) {
  using State = typename R::State;
  const int64_t c = int64_t(blockIdx.x) * kTileChannels + threadIdx.x;
  const int64_t lo = int64_t(blockIdx.y) * chunk, hi = smaller(rows, lo + chunk);
  State s = R::identity();
  if (c < channels)
    for (int64_t m = lo + threadIdx.y; m < hi; m += kTileRows) r.add(s, m * channels + c, c);
  __shared__ alignas(16) unsigned char raw[kTileChannels * kTileRows * sizeof(State)];
  State* states = reinterpret_cast<State*>(raw);
  states[threadIdx.y * kTileChannels + threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < channels) {
    for (int y = 1; y < kTileRows; ++y) s = R::merge(s, states[y * kTileChannels + threadIdx.x]);
    partial[c * gridDim.y + blockIdx.y] = s;
  }
}

// Runs the reduction of `r` over every channel; returns the partial states ([C, splits]) in `workspace`.
template <typename R>
typename R::State* reduce_channels(const R& r, const BatchNormShape& s, Device device, cudaStream_t stream,
                                   Tensor& workspace, int& splits_out) {
  using State = typename R::State;
  const int64_t C = s.channels, M = s.per_channel();
  const int64_t target = 4 * int64_t(multiprocessors(device.index));
  dim3 grid, block;
  int64_t chunk = 0, splits = 1;
  if (!s.channels_last) {
    HG_CHECK(M < (int64_t(1) << 31) && s.spatial < (int64_t(1) << 31),
             "batch_norm: {} values per channel are more than the CUDA kernel handles (2^31)", M);
    splits = std::clamp<int64_t>((target + C - 1) / C, 1, std::max<int64_t>(1, M / (kThreads * kMinPerThread)));
    chunk = (M + splits - 1) / splits;
    splits = (M + chunk - 1) / chunk;
    grid = dim3(unsigned(C), unsigned(splits));
    block = dim3(kThreads);
  } else {
    const int64_t tiles = (C + kTileChannels - 1) / kTileChannels;
    splits = std::clamp<int64_t>((target + tiles - 1) / tiles, 1, std::max<int64_t>(1, M / (kTileRows * kMinPerThread)));
    chunk = (M + splits - 1) / splits;
    splits = (M + chunk - 1) / chunk;
    grid = dim3(unsigned(tiles), unsigned(splits));
    block = dim3(kTileChannels, kTileRows);
  }
  workspace = empty({C * splits * int64_t(sizeof(State))}, {.dtype = kUInt8, .device = device});
  State* partial = static_cast<State*>(workspace.data_ptr());
  if (!s.channels_last) {
    reduce_planes_kernel<R><<<grid, block, 0, stream>>>(r, C, cuda::IntDivider(uint32_t(s.spatial)), uint32_t(M),
                                                        uint32_t(chunk), partial);
  } else {
    reduce_rows_kernel<R><<<grid, block, 0, stream>>>(r, C, M, chunk, partial);
  }
  HG_CUDA_CHECK_LAUNCH("batch_norm");
  splits_out = int(splits);
  return partial;
}

// ---- 2. finalize kernels, one thread per channel

template <typename T>
__global__ void __launch_bounds__(kThreads)
    finalize_stats_kernel(const typename StatsReducer<T>::State* partial, int splits, int64_t channels,
                          acc_t<T>* save_mean, acc_t<T>* save_invstd, acc_t<T>* running_mean, acc_t<T>* running_var,
                          double momentum, double eps) {
  using A = acc_t<T>;
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  auto s = partial[c * splits];
  for (int k = 1; k < splits; ++k) s = StatsReducer<T>::merge(s, partial[c * splits + k]);
  const A var = s.m2 / A(s.n);  // biased: what normalises the batch
  save_mean[c] = s.mean;
  save_invstd[c] = A(1) / ::sqrt(var + A(eps));
  if (running_mean) {
    const A m = A(momentum);
    running_mean[c] = (A(1) - m) * running_mean[c] + m * s.mean;
    running_var[c] = (A(1) - m) * running_var[c] + m * var * A(s.n) / A(s.n - 1);  // unbiased
  }
}

template <typename A>
__global__ void __launch_bounds__(kThreads)
    eval_stats_kernel(int64_t channels, const A* running_mean, const A* running_var, A* save_mean, A* save_invstd,
                      double eps) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  save_mean[c] = running_mean[c];
  save_invstd[c] = A(1) / ::sqrt(running_var[c] + A(eps));
}

// coef[c] = alpha, coef[C + c] = beta, coef[2C + c] = gamma (ops/batch_norm.cpp's CPU kernel says why).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    finalize_grad_kernel(const typename GradSumsReducer<T>::State* partial, int splits, int64_t channels,
                         const acc_t<T>* invstd, const acc_t<T>* weight, acc_t<T>* grad_weight, acc_t<T>* grad_bias,
                         acc_t<T>* coef, int64_t count, bool training) {
  using A = acc_t<T>;
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  typename GradSumsReducer<T>::State s = GradSumsReducer<T>::identity();
  if (partial)
    for (int k = 0; k < splits; ++k) s = GradSumsReducer<T>::merge(s, partial[c * splits + k]);
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
  cuda::IntDivider spatial, channels;
  bool channels_last;
  __device__ __forceinline__ uint32_t operator()(uint32_t i) const {
    const uint32_t q = channels_last ? i : spatial.div(i);
    return q - channels.div(q) * channels.divisor;
  }
};

template <typename T>
__global__ void __launch_bounds__(kThreads)
    apply_forward_kernel(T* y, const T* x, uint32_t count, ChannelOf channel_of, const acc_t<T>* mean,
                         const acc_t<T>* invstd, const acc_t<T>* weight, const acc_t<T>* bias) {
  using A = acc_t<T>;
  for (uint32_t i = blockIdx.x * kThreads + threadIdx.x; i < count; i += gridDim.x * kThreads) {
    const uint32_t c = channel_of(i);
    const A scale = invstd[c] * (weight ? weight[c] : A(1));
    y[i] = T((A(x[i]) - mean[c]) * scale + (bias ? bias[c] : A(0)));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    apply_backward_kernel(T* grad_input, const T* g, const T* x, uint32_t count, ChannelOf channel_of,
                          const acc_t<T>* mean, const acc_t<T>* coef, int64_t channels) {
  using A = acc_t<T>;
  for (uint32_t i = blockIdx.x * kThreads + threadIdx.x; i < count; i += gridDim.x * kThreads) {
    const uint32_t c = channel_of(i);
    grad_input[i] = T(A(g[i]) * coef[c] + (A(x[i]) - mean[c]) * coef[channels + c] + coef[2 * channels + c]);
  }
}

// Calls launch(first_element, count, blocks) for runs of whole samples of fewer than 2^31 elements.
template <typename Launch> void for_each_piece(const BatchNormShape& s, Device device, const Launch& launch) {
  const int64_t sample = s.channels * s.spatial;
  HG_CHECK(sample < (int64_t(1) << 31), "batch_norm: one sample of {} elements is more than the CUDA kernels handle "
           "(2^31)", sample);
  const int64_t per_piece = std::max<int64_t>(1, ((int64_t(1) << 31) - 1) / sample);
  const int64_t max_blocks = 16 * int64_t(multiprocessors(device.index));
  for (int64_t n0 = 0; n0 < s.batch; n0 += per_piece) {
    const int64_t count = std::min(per_piece, s.batch - n0) * sample;
    launch(n0 * sample, uint32_t(count), unsigned(std::min<int64_t>(max_blocks, (count + kThreads - 1) / kThreads)));
  }
}

template <typename T> const acc_t<T>* ptr(const Tensor& t) { return t.defined() ? t.data<acc_t<T>>() : nullptr; }
template <typename T> acc_t<T>* mutable_ptr(const Tensor& t) { return t.defined() ? t.data<acc_t<T>>() : nullptr; }

unsigned channel_blocks(int64_t channels) { return unsigned((channels + kThreads - 1) / kThreads); }

template <typename T> void forward_typed(const BatchNormForwardArgs& a) {
  const BatchNormShape& s = a.shape;
  const Device device = a.input.device();
  cuda::DeviceGuard guard(device);
  cudaStream_t stream = cuda::current_stream(device);
  const T* x = a.input.data<T>();
  acc_t<T>* save_mean = a.save_mean.data<acc_t<T>>();
  acc_t<T>* save_invstd = a.save_invstd.data<acc_t<T>>();

  Tensor workspace;  // freed when this returns; later work on the stream is ordered after the kernels
  if (a.training) {
    int splits = 1;
    auto* partial = reduce_channels(StatsReducer<T>{x}, s, device, stream, workspace, splits);
    finalize_stats_kernel<T><<<channel_blocks(s.channels), kThreads, 0, stream>>>(
        partial, splits, s.channels, save_mean, save_invstd, mutable_ptr<T>(a.running_mean),
        mutable_ptr<T>(a.running_var), a.momentum, a.eps);
  } else {
    eval_stats_kernel<acc_t<T>><<<channel_blocks(s.channels), kThreads, 0, stream>>>(
        s.channels, ptr<T>(a.running_mean), ptr<T>(a.running_var), save_mean, save_invstd, a.eps);
  }
  HG_CUDA_CHECK_LAUNCH("batch_norm");

  const ChannelOf channel_of{cuda::IntDivider(uint32_t(s.spatial)), cuda::IntDivider(uint32_t(s.channels)),
                             s.channels_last};
  T* y = a.output.data<T>();
  for_each_piece(s, device, [&](int64_t first, uint32_t count, unsigned blocks) {
    apply_forward_kernel<T><<<blocks, kThreads, 0, stream>>>(y + first, x + first, count, channel_of, save_mean,
                                                             save_invstd, ptr<T>(a.weight), ptr<T>(a.bias));
    HG_CUDA_CHECK_LAUNCH("batch_norm");
  });
}

template <typename T> void backward_typed(const BatchNormBackwardArgs& a) {
  using A = acc_t<T>;
  const BatchNormShape& s = a.shape;
  const Device device = a.input.device();
  cuda::DeviceGuard guard(device);
  cudaStream_t stream = cuda::current_stream(device);
  const T* g = a.grad_output.data<T>();
  const T* x = a.input.data<T>();
  const A* mean = a.save_mean.data<A>();

  const bool need_sums = a.grad_weight.defined() || a.grad_bias.defined() || (a.grad_input.defined() && a.training);
  Tensor workspace, coef;
  const typename GradSumsReducer<T>::State* partial = nullptr;
  int splits = 0;
  if (need_sums) partial = reduce_channels(GradSumsReducer<T>{g, x, mean}, s, device, stream, workspace, splits);
  if (a.grad_input.defined()) coef = empty({3 * s.channels}, {.dtype = a.save_mean.dtype(), .device = device});
  finalize_grad_kernel<T><<<channel_blocks(s.channels), kThreads, 0, stream>>>(
      partial, splits, s.channels, a.save_invstd.data<A>(), ptr<T>(a.weight), mutable_ptr<T>(a.grad_weight),
      mutable_ptr<T>(a.grad_bias), coef.defined() ? coef.data<A>() : nullptr, s.per_channel(), a.training);
  HG_CUDA_CHECK_LAUNCH("batch_norm_backward");
  if (!a.grad_input.defined()) return;

  const ChannelOf channel_of{cuda::IntDivider(uint32_t(s.spatial)), cuda::IntDivider(uint32_t(s.channels)),
                             s.channels_last};
  T* gi = a.grad_input.data<T>();
  for_each_piece(s, device, [&](int64_t first, uint32_t count, unsigned blocks) {
    apply_backward_kernel<T><<<blocks, kThreads, 0, stream>>>(gi + first, g + first, x + first, count, channel_of,
                                                              mean, coef.data<A>(), s.channels);
    HG_CUDA_CHECK_LAUNCH("batch_norm_backward");
  });
}

void batch_norm_forward_cuda(const BatchNormForwardArgs& a) {
  dispatch_floating(a.input.dtype(), "batch_norm", [&]<typename T>() { forward_typed<T>(a); });
}

void batch_norm_backward_cuda(const BatchNormBackwardArgs& a) {
  dispatch_floating(a.input.dtype(), "batch_norm_backward", [&]<typename T>() { backward_typed<T>(a); });
}

}  // namespace

HG_REGISTER_KERNEL(batch_norm_forward_kernel, CUDA, batch_norm_forward_cuda);
HG_REGISTER_KERNEL(batch_norm_backward_kernel, CUDA, batch_norm_backward_cuda);

}  // namespace halfgrad

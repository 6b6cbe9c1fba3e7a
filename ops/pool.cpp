// Pooling: max_pool2d, avg_pool2d, adaptive_avg_pool2d — checks, forward, backward and the CPU kernels.
// The CUDA kernels are in ops/pool.cu.
//
// Backward formulas (g: the gradient of the output, x: input positions):
//   max:       dx[i] = sum of g[o] over the outputs o whose maximum lies at i (flat index or window position); its
//              own backward (a pass with create_graph) reads gg at each maximum: d(g)[o] = gg[i(o)]
//   avg:       dx[i] = sum of g[o] / divisor(o) over the windows o that contain i
//   adaptive:  dx[i] = sum of g[o] / area(o) over the cells o whose window contains i
#include "ops/pool.h"

#include <omp.h>

#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "core/autocast.h"
#include "core/autograd.h"

namespace halfgrad {

KernelTable<MaxPool2dKernel> max_pool2d_kernel("max_pool2d");
KernelTable<MaxPool2dBackwardKernel> max_pool2d_backward_kernel("max_pool2d backward");
KernelTable<MaxPool2dGatherKernel> max_pool2d_gather_kernel("max_pool2d gather");
KernelTable<AvgPool2dKernel> avg_pool2d_kernel("avg_pool2d");
KernelTable<AvgPool2dBackwardKernel> avg_pool2d_backward_kernel("avg_pool2d backward");
KernelTable<AdaptiveAvgPool2dKernel> adaptive_avg_pool2d_kernel("adaptive_avg_pool2d");
KernelTable<AdaptiveAvgPool2dBackwardKernel> adaptive_avg_pool2d_backward_kernel("adaptive_avg_pool2d backward");

int64_t pool_output_size(int64_t in, int64_t kernel, int64_t stride, int64_t pad, int64_t dilation, bool ceil_mode) {
  const int64_t span = in + 2 * pad - dilation * (kernel - 1) - 1 + (ceil_mode ? stride - 1 : 0);
  int64_t out = (span >= 0 ? span / stride : -((-span + stride - 1) / stride)) + 1;  // floor division
  // With ceil_mode the last window must start inside the input or the left padding.
  if (ceil_mode && out > 0 && (out - 1) * stride >= in + pad) --out;
  return out;
}

namespace {

void check_input(const char* op, const Tensor& input) {
  HG_CHECK(input.dim() == 4, "{}: expected a 4-D input [N, C, H, W] (or 3-D [C, H, W]), got {}", op, input.meta());
  HG_CHECK(input.is_floating_point(), "{}: expected a floating-point input, got {}", op, input.meta());
  HG_CHECK(input.size(2) > 0 && input.size(3) > 0, "{}: the input's spatial dims must be non-empty, got {}", op,
           input.meta());
}

// Resolves the defaults (stride 0 = kernel) and checks the window parameters of max and avg pooling.
Pool2dParams window_params(const char* op, const Tensor& input, Pair2d kernel, Pair2d stride, Pair2d padding,
                           Pair2d dilation) {
  Pool2dParams p{kernel, stride, padding, dilation};
  if (stride[0] == 0 && stride[1] == 0) p.stride = kernel;
  for (int d = 0; d < 2; ++d) {
    // As PyTorch's (which takes them as int): a window's arithmetic (dilation * (kernel - 1)) then fits 64 bits.
    constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
    HG_CHECK(kernel[d] <= kMax && p.stride[d] <= kMax && padding[d] <= kMax && dilation[d] <= kMax,
             "{}: kernel size {}, stride {}, padding {} and dilation {} must each be below 2^31 (input {})", op,
             pair_str(kernel), pair_str(p.stride), pair_str(padding), pair_str(dilation), input.meta());
    HG_CHECK(kernel[d] >= 1, "{}: kernel size must be positive, got {} (input {})", op, pair_str(kernel), input.meta());
    HG_CHECK(p.stride[d] >= 1, "{}: stride must be positive, got {} (input {})", op, pair_str(stride), input.meta());
    HG_CHECK(dilation[d] >= 1, "{}: dilation must be positive, got {} (input {})", op, pair_str(dilation),
             input.meta());
    HG_CHECK(padding[d] >= 0 && padding[d] <= kernel[d] / 2,
             "{}: padding {} must be non-negative and at most half the kernel size {} (input {})", op,
             pair_str(padding), pair_str(kernel), input.meta());
  }
  return p;
}

Shape pooled_shape(const char* op, const Tensor& input, const Pool2dParams& p, bool ceil_mode) {
  Shape out{input.size(0), input.size(1), 0, 0};
  for (int d = 0; d < 2; ++d) {
    out[2 + d] = pool_output_size(input.size(2 + d), p.kernel[d], p.stride[d], p.padding[d], p.dilation[d], ceil_mode);
  }
  HG_CHECK(out[2] >= 1 && out[3] >= 1,
           "{}: the output would be empty ({}x{}): the kernel {} with dilation {} is larger than the input {} with "
           "padding {}", op, out[2], out[3], pair_str(p.kernel), pair_str(p.dilation), input.meta(),
           pair_str(p.padding));
  return out;
}

TensorOptions like(const Tensor& t, DType dtype) { return {.dtype = dtype, .device = t.device()}; }

// An unbatched [C, H, W] input runs as a batch of one; an error then names the caller's tensor, not the [1, C, H, W]
// view it never passed.
template <typename Run> auto as_batch_of_one(const Tensor& input, Run run) {
  const Tensor batch = input.unsqueeze(0);
  try {
    return run(batch);
  } catch (const OutOfMemory&) {
    throw;
  } catch (const Error& e) {
    std::string what = e.what();
    const std::string batch_meta = batch.meta(), own = input.meta();
    for (size_t at = what.find(batch_meta); at != std::string::npos; at = what.find(batch_meta, at + own.size()))
      what.replace(at, batch_meta.size(), own);
    throw Error(what);
  }
}

}  // namespace

// ---- max_pool2d. Autocast category: "unchanged".

namespace {

Tensor max_unpooled(const Tensor& g, const SavedTensor& indices, const Shape& input_shape, const Pool2dParams& p,
                    MemoryFormat format);
Tensor max_gathered(const Tensor& source, const SavedTensor& indices, const Shape& shape, const Pool2dParams& p,
                    MemoryFormat format);

// max_pool2d and max_pool2d_with_indices: `flat` asks for the flat indices, else window positions are kept where
// the window is small enough (MaxPool2dKernel's `indices`).
std::pair<Tensor, Tensor> max_pool2d_impl(const Tensor& input, Pair2d kernel_size, const MaxPool2dOptions& options,
                                          bool flat) {
  HG_CHECK(input.defined(), "max_pool2d: got an undefined input");
  if (input.dim() == 3) {  // unbatched
    auto [out, indices] = as_batch_of_one(
        input, [&](const Tensor& batch) { return max_pool2d_impl(batch, kernel_size, options, flat); });
    return {out.squeeze(0), indices.squeeze(0)};
  }
  check_input("max_pool2d", input);
  const Pool2dParams p =
      window_params("max_pool2d", input, kernel_size, options.stride, options.padding, options.dilation);
  const Shape shape = pooled_shape("max_pool2d", input, p, options.ceil_mode);
  const MemoryFormat format = suggest_memory_format(input);
  Tensor out = empty(shape, like(input, input.dtype()), format);
  const bool positions = !flat && p.kernel[0] * p.kernel[1] <= kMaxWindowPositions;
  Tensor indices = empty(shape, like(input, positions ? kUInt8 : kInt64), format);
  if (out.numel() > 0) max_pool2d_kernel[input.device()](out, indices, input, p);

  if (!any_requires_grad({&input})) return {out, indices};
  record("MaxPool2dBackward", {input}, {out},
         [saved = SavedTensor(indices, "max_pool2d"), input_shape = input.shape(), p,
          format](const GradContext& ctx) -> TensorList {
           return {max_unpooled(ctx[0], saved, input_shape, p, format)};
         }, DoubleBackward::Supported);
  return {out, indices};
}

// The backward's scatter of g to the maxima (`indices`) and its transpose, the gather of what lies at them, each the
// other's backward: linear in g with the indices fixed, so differentiable to any order.
Tensor max_unpooled(const Tensor& g, const SavedTensor& indices, const Shape& input_shape, const Pool2dParams& p,
                    MemoryFormat format) {
  Tensor grad_input = empty(input_shape, like(g, g.dtype()), format);
  if (grad_input.numel() > 0) max_pool2d_backward_kernel[g.device()](grad_input, g, indices.get(), p);
  if (!any_requires_grad({&g})) return grad_input;  // (a plain backward pass: no closure to build)
  record("MaxPool2dBackwardBackward", {g}, {grad_input},
         [indices, shape = g.shape(), p, format = suggest_memory_format(g)](const GradContext& ctx) -> TensorList {
           return {max_gathered(ctx[0], indices, shape, p, format)};
         }, DoubleBackward::Supported);
  return grad_input;
}

Tensor max_gathered(const Tensor& source, const SavedTensor& indices, const Shape& shape, const Pool2dParams& p,
                    MemoryFormat format) {
  Tensor out = empty(shape, like(source, source.dtype()), format);
  if (out.numel() > 0) max_pool2d_gather_kernel[source.device()](out, source, indices.get(), p);
  if (!any_requires_grad({&source})) return out;
  record("MaxPool2dGatherBackward", {source}, {out},
         [indices, shape = source.shape(), p, format = suggest_memory_format(source)](const GradContext& ctx)
             -> TensorList { return {max_unpooled(ctx[0], indices, shape, p, format)}; },
         DoubleBackward::Supported);
  return out;
}

}  // namespace

std::pair<Tensor, Tensor> max_pool2d_with_indices(const Tensor& input, Pair2d kernel_size,
                                                  const MaxPool2dOptions& options) {
  return max_pool2d_impl(input, kernel_size, options, /*flat=*/true);
}

Tensor max_pool2d(const Tensor& input, Pair2d kernel_size, const MaxPool2dOptions& options) {
  HG_AUTOCAST(max_pool2d, input, kernel_size, options);
  return max_pool2d_impl(input, kernel_size, options, /*flat=*/false).first;
}

// ---- avg_pool2d. Autocast category: "unchanged".

namespace {
Tensor avg_unpooled(const Tensor& g, const Shape& input_shape, const Pool2dParams& p, MemoryFormat format);

// The pooling (the kernel, a `shape` result laid out as `format`) and its transpose, each the other's backward: linear,
// so differentiable to any order (a pass with create_graph records the transpose).
Tensor avg_pooled(const Tensor& input, const Shape& shape, const Pool2dParams& p, MemoryFormat format) {
  Tensor out = empty(shape, like(input, input.dtype()), format);
  if (out.numel() > 0) avg_pool2d_kernel[input.device()](out, input, p);
  record("AvgPool2dBackward", {input}, {out},
         [input_shape = input.shape(), p, format](const GradContext& ctx) -> TensorList {
           return {avg_unpooled(ctx[0], input_shape, p, format)};
         }, DoubleBackward::Supported);
  return out;
}

Tensor avg_unpooled(const Tensor& g, const Shape& input_shape, const Pool2dParams& p, MemoryFormat format) {
  Tensor grad_input = empty(input_shape, like(g, g.dtype()), format);
  if (grad_input.numel() > 0) avg_pool2d_backward_kernel[g.device()](grad_input, g, p);
  record("AvgPool2dBackwardBackward", {g}, {grad_input},
         [shape = g.shape(), p, format = suggest_memory_format(g)](const GradContext& ctx) -> TensorList {
           return {avg_pooled(ctx[0], shape, p, format)};
         }, DoubleBackward::Supported);
  return grad_input;
}
}  // namespace

Tensor avg_pool2d(const Tensor& input, Pair2d kernel_size, const AvgPool2dOptions& options) {
  HG_AUTOCAST(avg_pool2d, input, kernel_size, options);
  HG_CHECK(input.defined(), "avg_pool2d: got an undefined input");
  if (input.dim() == 3)
    return as_batch_of_one(input, [&](const Tensor& batch) { return avg_pool2d(batch, kernel_size, options); }).squeeze(0);
  check_input("avg_pool2d", input);
  Pool2dParams p = window_params("avg_pool2d", input, kernel_size, options.stride, options.padding, {1, 1});
  p.count_include_pad = options.count_include_pad;
  if (options.divisor_override) {
    HG_CHECK(*options.divisor_override != 0, "avg_pool2d: divisor_override must not be 0 (input {})", input.meta());
    p.divisor_override = *options.divisor_override;
  }
  const Shape shape = pooled_shape("avg_pool2d", input, p, options.ceil_mode);
  return avg_pooled(input, shape, p, suggest_memory_format(input));
}

// ---- adaptive_avg_pool2d. Autocast category: "unchanged".

namespace {
Tensor adaptive_avg_unpooled(const Tensor& g, const Shape& input_shape, MemoryFormat format);

// As avg_pooled and avg_unpooled: the pooling and its transpose, each the other's backward.
Tensor adaptive_avg_pooled(const Tensor& input, const Shape& shape, MemoryFormat format) {
  Tensor out = empty(shape, like(input, input.dtype()), format);
  if (out.numel() > 0) adaptive_avg_pool2d_kernel[input.device()](out, input);
  record("AdaptiveAvgPool2dBackward", {input}, {out},
         [input_shape = input.shape(), format](const GradContext& ctx) -> TensorList {
           return {adaptive_avg_unpooled(ctx[0], input_shape, format)};
         }, DoubleBackward::Supported);
  return out;
}

Tensor adaptive_avg_unpooled(const Tensor& g, const Shape& input_shape, MemoryFormat format) {
  Tensor grad_input = empty(input_shape, like(g, g.dtype()), format);
  if (grad_input.numel() > 0) {
    if (g.numel() == 0) {
      grad_input.zero_();
    } else {
      adaptive_avg_pool2d_backward_kernel[g.device()](grad_input, g);
    }
  }
  record("AdaptiveAvgPool2dBackwardBackward", {g}, {grad_input},
         [shape = g.shape(), format = suggest_memory_format(g)](const GradContext& ctx) -> TensorList {
           return {adaptive_avg_pooled(ctx[0], shape, format)};
         }, DoubleBackward::Supported);
  return grad_input;
}
}  // namespace

Tensor adaptive_avg_pool2d(const Tensor& input, Pair2d output_size) {
  HG_AUTOCAST(adaptive_avg_pool2d, input, output_size);
  HG_CHECK(input.defined(), "adaptive_avg_pool2d: got an undefined input");
  if (input.dim() == 3)
    return as_batch_of_one(input, [&](const Tensor& batch) { return adaptive_avg_pool2d(batch, output_size); }).squeeze(0);
  check_input("adaptive_avg_pool2d", input);
  HG_CHECK(output_size[0] >= 0 && output_size[1] >= 0,
           "adaptive_avg_pool2d: output_size must be non-negative, got {} (input {})", pair_str(output_size),
           input.meta());
  const Shape shape{input.size(0), input.size(1), output_size[0], output_size[1]};
  return adaptive_avg_pooled(input, shape, suggest_memory_format(input));
}

// ---- CPU kernels: OpenMP over the N*C planes; each plane addressed through the tensors' strides.

namespace {

// A 4-D strided operand: element (n, c, h, w) at data[n s0 + c s1 + h s2 + w s3].
template <typename T> struct Strided4 {
  T* data;
  int64_t s[4];
  explicit Strided4(const Tensor& t)
      : data(static_cast<T*>(t.data_ptr())), s{t.stride(0), t.stride(1), t.stride(2), t.stride(3)} {}
  T* plane(int64_t n, int64_t c) const { return data + n * s[0] + c * s[1]; }
};

// Runs fn(n, c) for every plane, in parallel when there is enough work (`work_per_plane` elements touched).
template <typename Fn> void for_each_plane(int64_t N, int64_t C, int64_t work_per_plane, Fn&& fn) {
  const bool parallel = N * C > 1 && N * C * work_per_plane > (1 << 15);
#pragma omp parallel for collapse(2) schedule(static) if (parallel)
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t c = 0; c < C; ++c) fn(n, c);
  }
}

template <typename T, typename S>
void max_pool_cpu_typed(const Tensor& out, const Tensor& indices, const Tensor& input, const Pool2dParams& p) {
  using Acc = opmath_t<T>;
  const int64_t N = input.size(0), C = input.size(1), H = input.size(2), W = input.size(3);
  const int64_t OH = out.size(2), OW = out.size(3);
  const Strided4<const T> x(input);
  const Strided4<T> y(out);
  const Strided4<S> idx(indices);
  for_each_plane(N, C, OH * OW * p.kernel[0] * p.kernel[1], [&](int64_t n, int64_t c) {
    const T* xp = x.plane(n, c);
    T* yp = y.plane(n, c);
    S* ip = idx.plane(n, c);
    for (int64_t oh = 0; oh < OH; ++oh) {
      for (int64_t ow = 0; ow < OW; ++ow) {
        Acc best = -std::numeric_limits<Acc>::infinity();
        int64_t best_index = -1, best_position = kNoWindowPosition;
        for (int64_t kh = 0; kh < p.kernel[0]; ++kh) {
          const int64_t ih = window_input(p, 0, oh, kh);
          if (ih < 0 || ih >= H) continue;
          for (int64_t kw = 0; kw < p.kernel[1]; ++kw) {
            const int64_t iw = window_input(p, 1, ow, kw);
            if (iw < 0 || iw >= W) continue;
            const Acc v = Acc(xp[ih * x.s[2] + iw * x.s[3]]);
            // The first element of the window, then strictly larger ones; nan wins (PyTorch's rule).
            if (best_index < 0 || v > best || std::isnan(v)) {
              best = v;
              best_index = ih * W + iw;
              best_position = kh * p.kernel[1] + kw;
            }
          }
        }
        yp[oh * y.s[2] + ow * y.s[3]] = T(best);
        ip[oh * idx.s[2] + ow * idx.s[3]] = S(std::is_same_v<S, uint8_t> ? best_position : best_index);
      }
    }
  });
}

// A backward pass that adds contributions into an input plane: accumulates in a float32 (float64) scratch
// plane per thread, then rounds into grad_input once per element.
template <typename T, typename Scatter>
void scatter_backward(const Tensor& grad_input, int64_t work_per_plane, Scatter&& scatter) {
  using Acc = opmath_t<T>;
  const int64_t N = grad_input.size(0), C = grad_input.size(1), H = grad_input.size(2), W = grad_input.size(3);
  const Strided4<T> dx(grad_input);
  const bool parallel = N * C > 1 && N * C * (work_per_plane + H * W) > (1 << 15);
#pragma omp parallel if (parallel)
  {
    std::vector<Acc> acc(size_t(H * W));  // one scratch plane per thread
#pragma omp for collapse(2) schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t c = 0; c < C; ++c) {
        std::fill(acc.begin(), acc.end(), Acc(0));
        scatter(n, c, acc.data());
        T* dp = dx.plane(n, c);
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t w = 0; w < W; ++w) dp[h * dx.s[2] + w * dx.s[3]] = T(acc[size_t(h * W + w)]);
        }
      }
    }
  }
}

template <typename T, typename S>
void max_pool_backward_cpu_typed(const Tensor& grad_input, const Tensor& grad_output, const Tensor& indices,
                                 const Pool2dParams& p) {
  using Acc = opmath_t<T>;
  const int64_t OH = grad_output.size(2), OW = grad_output.size(3), W = grad_input.size(3);
  const Strided4<const T> g(grad_output);
  const Strided4<const S> idx(indices);
  scatter_backward<T>(grad_input, OH * OW, [&](int64_t n, int64_t c, Acc* acc) {
    const T* gp = g.plane(n, c);
    const S* ip = idx.plane(n, c);
    for (int64_t oh = 0; oh < OH; ++oh) {
      for (int64_t ow = 0; ow < OW; ++ow) {
        const int64_t saved = int64_t(ip[oh * idx.s[2] + ow * idx.s[3]]);
        int64_t i = saved;
        if constexpr (std::is_same_v<S, uint8_t>) {  // a window position: its row and column in the plane
          if (saved == kNoWindowPosition) continue;
          i = window_position_input(p, 0, oh, saved) * W + window_position_input(p, 1, ow, saved);
        }
        if (i >= 0) acc[i] += Acc(gp[oh * g.s[2] + ow * g.s[3]]);
      }
    }
  });
}

template <typename T, typename S>
void max_pool_gather_cpu_typed(const Tensor& out, const Tensor& source, const Tensor& indices, const Pool2dParams& p) {
  const int64_t N = out.size(0), C = out.size(1), W = source.size(3);
  const int64_t OH = out.size(2), OW = out.size(3);
  const Strided4<const T> x(source);
  const Strided4<const S> idx(indices);
  const Strided4<T> y(out);
  for_each_plane(N, C, OH * OW, [&](int64_t n, int64_t c) {
    const T* xp = x.plane(n, c);
    const S* ip = idx.plane(n, c);
    T* yp = y.plane(n, c);
    for (int64_t oh = 0; oh < OH; ++oh) {
      for (int64_t ow = 0; ow < OW; ++ow) {
        const int64_t saved = int64_t(ip[oh * idx.s[2] + ow * idx.s[3]]);
        int64_t ih = -1, iw = 0;  // none: a window with no input element
        if constexpr (std::is_same_v<S, uint8_t>) {  // a window position: its row and column in the plane
          if (saved != kNoWindowPosition) {
            ih = window_position_input(p, 0, oh, saved);
            iw = window_position_input(p, 1, ow, saved);
          }
        } else if (saved >= 0) {
          ih = saved / W;
          iw = saved % W;
        }
        yp[oh * y.s[2] + ow * y.s[3]] = ih < 0 ? T(0) : xp[ih * x.s[2] + iw * x.s[3]];
      }
    }
  });
}

template <typename T> void avg_pool_cpu_typed(const Tensor& out, const Tensor& input, const Pool2dParams& p) {
  using Acc = opmath_t<T>;
  const int64_t N = input.size(0), C = input.size(1), H = input.size(2), W = input.size(3);
  const int64_t OH = out.size(2), OW = out.size(3);
  const Strided4<const T> x(input);
  const Strided4<T> y(out);
  for_each_plane(N, C, OH * OW * p.kernel[0] * p.kernel[1], [&](int64_t n, int64_t c) {
    const T* xp = x.plane(n, c);
    T* yp = y.plane(n, c);
    for (int64_t oh = 0; oh < OH; ++oh) {
      const AvgWindow wh = avg_window(oh, H, p.kernel[0], p.stride[0], p.padding[0]);
      for (int64_t ow = 0; ow < OW; ++ow) {
        const AvgWindow ww = avg_window(ow, W, p.kernel[1], p.stride[1], p.padding[1]);
        const int64_t divisor = avg_divisor(p, wh, ww);
        Acc sum = 0;
        for (int64_t ih = wh.start; ih < wh.end; ++ih) {
          for (int64_t iw = ww.start; iw < ww.end; ++iw) sum += Acc(xp[ih * x.s[2] + iw * x.s[3]]);
        }
        yp[oh * y.s[2] + ow * y.s[3]] = T(divisor != 0 ? sum / Acc(divisor) : Acc(0));
      }
    }
  });
}

template <typename T> void avg_pool_backward_cpu_typed(const Tensor& grad_input, const Tensor& grad_output,
                                                       const Pool2dParams& p) {
  using Acc = opmath_t<T>;
  const int64_t H = grad_input.size(2), W = grad_input.size(3);
  const int64_t OH = grad_output.size(2), OW = grad_output.size(3);
  const Strided4<const T> g(grad_output);
  scatter_backward<T>(grad_input, OH * OW * p.kernel[0] * p.kernel[1], [&](int64_t n, int64_t c, Acc* acc) {
    const T* gp = g.plane(n, c);
    for (int64_t oh = 0; oh < OH; ++oh) {
      const AvgWindow wh = avg_window(oh, H, p.kernel[0], p.stride[0], p.padding[0]);
      for (int64_t ow = 0; ow < OW; ++ow) {
        const AvgWindow ww = avg_window(ow, W, p.kernel[1], p.stride[1], p.padding[1]);
        const int64_t divisor = avg_divisor(p, wh, ww);
        if (divisor == 0) continue;
        const Acc share = Acc(gp[oh * g.s[2] + ow * g.s[3]]) / Acc(divisor);
        for (int64_t ih = wh.start; ih < wh.end; ++ih) {
          for (int64_t iw = ww.start; iw < ww.end; ++iw) acc[ih * W + iw] += share;
        }
      }
    }
  });
}

template <typename T> void adaptive_avg_pool_cpu_typed(const Tensor& out, const Tensor& input) {
  using Acc = opmath_t<T>;
  const int64_t N = input.size(0), C = input.size(1), H = input.size(2), W = input.size(3);
  const int64_t OH = out.size(2), OW = out.size(3);
  const Strided4<const T> x(input);
  const Strided4<T> y(out);
  for_each_plane(N, C, H * W + OH * OW, [&](int64_t n, int64_t c) {
    const T* xp = x.plane(n, c);
    T* yp = y.plane(n, c);
    for (int64_t oh = 0; oh < OH; ++oh) {
      const int64_t h0 = adaptive_start(oh, H, OH), h1 = adaptive_end(oh, H, OH);
      for (int64_t ow = 0; ow < OW; ++ow) {
        const int64_t w0 = adaptive_start(ow, W, OW), w1 = adaptive_end(ow, W, OW);
        Acc sum = 0;
        for (int64_t ih = h0; ih < h1; ++ih) {
          for (int64_t iw = w0; iw < w1; ++iw) sum += Acc(xp[ih * x.s[2] + iw * x.s[3]]);
        }
        yp[oh * y.s[2] + ow * y.s[3]] = T(sum / Acc((h1 - h0) * (w1 - w0)));
      }
    }
  });
}

template <typename T> void adaptive_avg_pool_backward_cpu_typed(const Tensor& grad_input, const Tensor& grad_output) {
  using Acc = opmath_t<T>;
  const int64_t H = grad_input.size(2), W = grad_input.size(3);
  const int64_t OH = grad_output.size(2), OW = grad_output.size(3);
  const Strided4<const T> g(grad_output);
  scatter_backward<T>(grad_input, H * W + OH * OW, [&](int64_t n, int64_t c, Acc* acc) {
    const T* gp = g.plane(n, c);
    for (int64_t oh = 0; oh < OH; ++oh) {
      const int64_t h0 = adaptive_start(oh, H, OH), h1 = adaptive_end(oh, H, OH);
      for (int64_t ow = 0; ow < OW; ++ow) {
        const int64_t w0 = adaptive_start(ow, W, OW), w1 = adaptive_end(ow, W, OW);
        const Acc share = Acc(gp[oh * g.s[2] + ow * g.s[3]]) / Acc((h1 - h0) * (w1 - w0));
        for (int64_t ih = h0; ih < h1; ++ih) {
          for (int64_t iw = w0; iw < w1; ++iw) acc[ih * W + iw] += share;
        }
      }
    }
  });
}

void max_pool2d_cpu(const Tensor& out, const Tensor& indices, const Tensor& input, const Pool2dParams& p) {
  dispatch_floating(input.dtype(), "max_pool2d", [&]<typename T>() {
    dispatch_max_pool_indices(indices, [&]<typename S>() { max_pool_cpu_typed<T, S>(out, indices, input, p); });
  });
}
void max_pool2d_backward_cpu(const Tensor& grad_input, const Tensor& grad_output, const Tensor& indices,
                             const Pool2dParams& p) {
  dispatch_floating(grad_input.dtype(), "max_pool2d backward", [&]<typename T>() {
    dispatch_max_pool_indices(indices, [&]<typename S>() {
      max_pool_backward_cpu_typed<T, S>(grad_input, grad_output, indices, p);
    });
  });
}
void max_pool2d_gather_cpu(const Tensor& out, const Tensor& source, const Tensor& indices, const Pool2dParams& p) {
  dispatch_floating(out.dtype(), "max_pool2d gather", [&]<typename T>() {
    dispatch_max_pool_indices(indices, [&]<typename S>() { max_pool_gather_cpu_typed<T, S>(out, source, indices, p); });
  });
}
void avg_pool2d_cpu(const Tensor& out, const Tensor& input, const Pool2dParams& p) {
  dispatch_floating(input.dtype(), "avg_pool2d", [&]<typename T>() { avg_pool_cpu_typed<T>(out, input, p); });
}
void avg_pool2d_backward_cpu(const Tensor& grad_input, const Tensor& grad_output, const Pool2dParams& p) {
  dispatch_floating(grad_input.dtype(), "avg_pool2d backward",
                    [&]<typename T>() { avg_pool_backward_cpu_typed<T>(grad_input, grad_output, p); });
}
void adaptive_avg_pool2d_cpu(const Tensor& out, const Tensor& input) {
  dispatch_floating(input.dtype(), "adaptive_avg_pool2d",
                    [&]<typename T>() { adaptive_avg_pool_cpu_typed<T>(out, input); });
}
void adaptive_avg_pool2d_backward_cpu(const Tensor& grad_input, const Tensor& grad_output) {
  dispatch_floating(grad_input.dtype(), "adaptive_avg_pool2d backward",
                    [&]<typename T>() { adaptive_avg_pool_backward_cpu_typed<T>(grad_input, grad_output); });
}

}  // namespace

HG_REGISTER_KERNEL(max_pool2d_kernel, CPU, max_pool2d_cpu);
HG_REGISTER_KERNEL(max_pool2d_backward_kernel, CPU, max_pool2d_backward_cpu);
HG_REGISTER_KERNEL(max_pool2d_gather_kernel, CPU, max_pool2d_gather_cpu);
HG_REGISTER_KERNEL(avg_pool2d_kernel, CPU, avg_pool2d_cpu);
HG_REGISTER_KERNEL(avg_pool2d_backward_kernel, CPU, avg_pool2d_backward_cpu);
HG_REGISTER_KERNEL(adaptive_avg_pool2d_kernel, CPU, adaptive_avg_pool2d_cpu);
HG_REGISTER_KERNEL(adaptive_avg_pool2d_backward_kernel, CPU, adaptive_avg_pool2d_backward_cpu);

}  // namespace halfgrad

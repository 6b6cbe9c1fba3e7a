// conv2d: checks, forward, backward and the CPU kernels (im2col + gemm_kernel); the channels_last helpers.
// The CUDA kernels (cuDNN) are in ops/conv.cu.
//
// The convolution as matrix products (one sample, one group; K = C/groups * kH * kW, L = OH * OW):
//   col    [K, L]       im2col(x): column l holds the input patch under output pixel l (zeros in padding)
//   out    [O/g, L]  =  W [O/g, K] col                                          (+ bias per row)
//   dcol   [K, L]    =  W^T dout          dx = col2im(dcol): each column added back where it came from
//   dW     [O/g, K] +=  dout col^T        summed over the batch
//   db     [O]       =  dout summed over N, OH, OW
// 1x1 convolutions with stride 1 and one group skip im2col: they are GEMMs over the input itself, in either
// layout (conv2d_pointwise_*, shared with the CUDA kernels, which use them for float16/bfloat16).
#include "ops/conv.h"

#include <omp.h>

#include <Eigen/Core>
#include <algorithm>
#include <atomic>
#include <vector>

#include "core/autocast.h"
#include "core/autograd.h"
#include "ops/copy.h"
#include "ops/elementwise.h"
#include "ops/matmul.h"
#include "ops/reduce.h"
#include "ops/shape.h"

namespace halfgrad {

KernelTable<Conv2dForwardKernel> conv2d_forward_kernel("conv2d");
KernelTable<Conv2dBackwardInputKernel> conv2d_backward_input_kernel("conv2d backward (input)");
KernelTable<Conv2dBackwardWeightKernel> conv2d_backward_weight_kernel("conv2d backward (weight)");

// ---- memory format

Tensor contiguous_channels_last(const Tensor& t) {
  HG_CHECK(t.defined() && t.dim() == 4, "contiguous_channels_last: expected a 4-D [N, C, H, W] tensor, got {}",
           t.defined() ? t.meta() : "an undefined tensor");
  if (is_channels_last(t)) return t;
  // [N, H, W, C] made contiguous is NHWC memory; permuted back it reads as [N, C, H, W]. Both permutes are
  // views and contiguous() is a differentiable copy, so the gradient flows back through all three.
  return t.permute({0, 2, 3, 1}).contiguous().permute({0, 3, 1, 2});
}

Tensor contiguous(const Tensor& t, MemoryFormat format) {
  switch (format) {
    case MemoryFormat::ChannelsLast: return contiguous_channels_last(t);
    case MemoryFormat::AlignedRows: return contiguous_aligned_rows(t);
    case MemoryFormat::Contiguous: break;
  }
  return t.contiguous();
}

// ---- conv2d

std::string pair_str(const Pair2d& p) { return fmt::format("({}, {})", p[0], p[1]); }

namespace {

std::atomic<bool> g_conv_allow_tf32{true};
std::atomic<bool> g_conv_benchmark{true};
std::atomic<bool> g_conv_knob_search{ConvKnobSearch{}.enabled};  // the defaults, written once in ops/conv.h
std::atomic<double> g_conv_knob_required_gain{ConvKnobSearch{}.required_gain};

Conv2dParams params_of(const Conv2dOptions& o) {
  return {o.stride, o.padding, o.dilation, o.groups, g_conv_allow_tf32.load(std::memory_order_relaxed)};
}

void check_options(const char* op, const Conv2dOptions& o) {
  for (int d = 0; d < 2; ++d) {
    HG_CHECK(o.stride[d] >= 1, "{}: stride must be positive, got {}", op, pair_str(o.stride));
    // Bounded so that a padded size cannot overflow (no tensor dim comes near 2^62).
    HG_CHECK(o.padding[d] >= 0 && o.padding[d] <= (int64_t(1) << 60), "{}: padding must be in [0, 2^60], got {}", op,
             pair_str(o.padding));
    HG_CHECK(o.dilation[d] >= 1, "{}: dilation must be positive, got {}", op, pair_str(o.dilation));
  }
  HG_CHECK(o.groups >= 1, "{}: groups must be positive, got {}", op, o.groups);
}

// Checks input [N, C, H, W] against weight [O, C/groups, kH, kW] and returns the output shape.
Shape conv2d_output_shape(const char* op, const Tensor& input, const Tensor& weight, const Conv2dOptions& o) {
  HG_CHECK(input.dim() == 4, "{}: expected a 4-D input [N, C, H, W] (or 3-D [C, H, W]), got {}", op, input.meta());
  HG_CHECK(weight.dim() == 4, "{}: weight must be 4-D [out_channels, in_channels / groups, kH, kW], got {}", op,
           weight.meta());
  check_options(op, o);
  const int64_t C = input.size(1), O = weight.size(0);
  HG_CHECK(C % o.groups == 0, "{}: the input's {} channels are not divisible by groups = {} (input {})", op, C,
           o.groups, input.meta());
  HG_CHECK(O % o.groups == 0, "{}: the weight's {} output channels are not divisible by groups = {} (weight {})", op,
           O, o.groups, weight.meta());
  HG_CHECK(weight.size(1) * o.groups == C,
           "{}: input {} has {} channels, but weight {} expects {} (in_channels / groups = {} with groups = {})", op,
           input.meta(), C, weight.meta(), weight.size(1) * o.groups, weight.size(1), o.groups);
  HG_CHECK(weight.size(2) >= 1 && weight.size(3) >= 1, "{}: the kernel must be at least 1x1, got weight {}", op,
           weight.meta());
  Shape out{input.size(0), O, 0, 0};
  for (int d = 0; d < 2; ++d) {
    const int64_t in = input.size(2 + d), k = weight.size(2 + d);
    const int64_t padded = in + 2 * o.padding[d];
    // dilation (k - 1) + 1 <= padded, without the product: a huge dilation would overflow it
    HG_CHECK(padded >= 1 && (k == 1 || o.dilation[d] <= (padded - 1) / (k - 1)),
             "{}: the kernel ({}x{} with dilation {}) spans more than the padded input ({}x{}: input {} with padding "
             "{}); weight {}", op, weight.size(2), weight.size(3), pair_str(o.dilation),
             input.size(2) + 2 * o.padding[0], input.size(3) + 2 * o.padding[1], input.meta(), pair_str(o.padding),
             weight.meta());
    out[2 + d] = conv_output_size(in, k, o.stride[d], o.padding[d], o.dilation[d]);
  }
  return out;
}

void check_operand(const char* op, const char* what, const Tensor& t, const Tensor& input) {
  HG_CHECK(t.dtype() == input.dtype(), "{}: {} {} and input {} must have the same dtype (convert one with .to(dtype))",
           op, what, t.meta(), input.meta());
  HG_CHECK(t.device() == input.device(), "{}: {} {} and input {} must be on the same device", op, what, t.meta(),
           input.meta());
}

// The kernels' operands: 4-D tensors dense in `format` (no copy when they already are). No autograd.
Tensor dense(const Tensor& t, MemoryFormat format) {
  NoGradGuard no_grad;
  return contiguous(t, format);
}

Tensor conv2d_forward(const Tensor& input, const Tensor& weight, const Tensor& bias, const Shape& out_shape,
                      const Conv2dParams& params, MemoryFormat format) {
  NoGradGuard no_grad;
  Tensor out = empty(out_shape, {.dtype = input.dtype(), .device = input.device()}, format);
  if (out.numel() == 0) return out;
  if (input.size(1) == 0) {  // no input channels: only the bias is left
    if (bias.defined()) {
      out.copy_(bias.view({1, -1, 1, 1}));
    } else {
      out.zero_();
    }
    return out;
  }
  conv2d_forward_kernel[input.device()](out, dense(input, format), dense(weight, format),
                                        bias.defined() ? bias.contiguous() : Tensor(), params);
  return out;
}

// The input's gradient: a `shape` tensor in grad_output's dtype and device, laid out as `format`; zero when
// grad_output has no elements. With `sum` (the input's gradient so far, of that shape, dtype and layout:
// GradContext::accumulated) the kernel adds into it, and it is the result.
Tensor input_gradient(const Tensor& grad_output, const Tensor& weight, const Shape& shape, const Conv2dParams& params,
                      MemoryFormat format, const Tensor& sum = Tensor()) {
  NoGradGuard no_grad;
  Tensor grad = sum.defined() ? sum : empty(shape, {.dtype = grad_output.dtype(), .device = grad_output.device()}, format);
  if (grad.numel() == 0) return grad;
  if (grad_output.numel() == 0) return sum.defined() ? grad : grad.zero_();
  conv2d_backward_input_kernel[grad_output.device()](grad, dense(grad_output, format), dense(weight, format), params,
                                                     sum.defined());
  return grad;
}

// The weight's gradient: a `shape` tensor in grad_output's dtype and device, laid out as `format`; zero when
// grad_output has no elements.
Tensor weight_gradient(const Tensor& grad_output, const Tensor& input, const Shape& shape, const Conv2dParams& params,
                       MemoryFormat format) {
  NoGradGuard no_grad;
  Tensor grad = empty(shape, {.dtype = grad_output.dtype(), .device = grad_output.device()}, format);
  if (grad.numel() == 0) return grad;
  if (grad_output.numel() == 0) return grad.zero_();
  conv2d_backward_weight_kernel[grad_output.device()](grad, dense(grad_output, format), dense(input, format), params);
  return grad;
}

}  // namespace

void set_conv_allow_tf32(bool allow) { g_conv_allow_tf32.store(allow); }
bool conv_allow_tf32() { return g_conv_allow_tf32.load(); }
void set_conv_benchmark(bool benchmark) { g_conv_benchmark.store(benchmark); }
bool conv_benchmark() { return g_conv_benchmark.load(); }
void set_conv_knob_search(const ConvKnobSearch& search) {
  HG_CHECK(search.required_gain < 1,
           "set_conv_knob_search: required_gain is a share of the engine's own time, below 1; got {}",
           search.required_gain);
  g_conv_knob_search.store(search.enabled);
  g_conv_knob_required_gain.store(search.required_gain);
}
ConvKnobSearch conv_knob_search() { return {g_conv_knob_search.load(), g_conv_knob_required_gain.load()}; }

int64_t conv_output_size(int64_t in, int64_t kernel, int64_t stride, int64_t pad, int64_t dilation) {
  const int64_t span = in + 2 * pad - dilation * (kernel - 1) - 1;
  return span < 0 ? 0 : span / stride + 1;
}

Tensor conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias, const Conv2dOptions& options) {
  HG_AUTOCAST(conv2d, input, weight, bias, options);
  HG_CHECK(input.defined() && weight.defined(), "conv2d: got an undefined tensor (input {}, weight {})",
           input.defined() ? input.meta() : "undefined", weight.defined() ? weight.meta() : "undefined");
  if (input.dim() == 3) return conv2d(input.unsqueeze(0), weight, bias, options).squeeze(0);  // unbatched

  HG_CHECK(input.is_floating_point(), "conv2d: expected a floating-point input, got {}", input.meta());
  check_operand("conv2d", "weight", weight, input);
  Shape out_shape = conv2d_output_shape("conv2d", input, weight, options);
  if (bias.defined()) {
    check_operand("conv2d", "bias", bias, input);
    HG_CHECK(bias.dim() == 1 && bias.size(0) == weight.size(0),
             "conv2d: bias {} does not match weight {} (expected a 1-D bias of {} elements)", bias.meta(),
             weight.meta(), weight.size(0));
  }

  const Conv2dParams params = params_of(options);
  const MemoryFormat format = suggest_memory_format(input);
  Tensor out = conv2d_forward(input, weight, bias, out_shape, params, format);

  if (any_requires_grad({&input, &weight, &bias})) {
    // Each gradient needs the other operand: keep only what the requested gradients read.
    SavedTensor saved_input(weight.requires_grad() ? input : Tensor(), "Conv2dBackward");
    SavedTensor saved_weight(input.requires_grad() ? weight : Tensor(), "Conv2dBackward");
    record("Conv2dBackward", {input, weight, bias}, {out},
           [saved_input, saved_weight, input_shape = input.shape(), weight_shape = weight.shape(), options, params,
            format](const GradContext& ctx) -> TensorList {
             const Tensor& g = ctx[0];  // [N, O, OH, OW]
             Tensor grad_input, grad_weight, grad_bias;
             if (ctx.needs(2)) grad_bias = g.sum({0, 2, 3});
             if (GradMode::is_enabled()) {  // a pass with create_graph: the two halves as the ops that record
               if (ctx.needs(0)) grad_input = conv2d_backward_input(g, saved_weight.get(), input_shape, options);
               if (ctx.needs(1)) grad_weight = conv2d_backward_weight(g, saved_input.get(), weight_shape, options);
               return {grad_input, grad_weight, grad_bias};
             }
             if (ctx.needs(0)) {
               // The input's gradient from its other consumers (a residual block's shortcut), where the engine hands
               // it over in this layout: the kernel adds into it, which spares the engine's add of the two.
               const Tensor& sum = ctx.accumulated(0);
               const bool add_into = sum.defined() && sum.shape() == input_shape && sum.dtype() == g.dtype() &&
                                     sum.device() == g.device() && storage_format(sum) == format;
               if (add_into) ctx.take_accumulated(0);
               grad_input =
                   input_gradient(g, saved_weight.get(), input_shape, params, format, add_into ? sum : Tensor());
             }
             if (ctx.needs(1)) grad_weight = weight_gradient(g, saved_input.get(), weight_shape, params, format);
             return {grad_input, grad_weight, grad_bias};
           }, DoubleBackward::Supported);
  }
  return out;
}

namespace {
// A tensor of `shape` (like `like`'s dtype and device) that holds one element: conv2d_output_shape reads shapes only,
// and its errors then name the caller's shape.
Tensor shape_only(const char* op, const Shape& shape, const Tensor& like) {
  int64_t elements = 1;
  for (int64_t size : shape) {
    HG_CHECK(size >= 0, "{}: the shape {} has a negative size", op, shape_str(shape));
    HG_CHECK(!__builtin_mul_overflow(elements, size, &elements), "{}: the shape {} has more elements than an int64 "
             "counts", op, shape_str(shape));
  }
  return empty({1, 1, 1, 1}, {.dtype = like.dtype(), .device = like.device()}).expand(shape);
}
}  // namespace

Tensor conv2d_backward_input(const Tensor& grad_output, const Tensor& weight, const Shape& input_shape,
                             const Conv2dOptions& options) {
  HG_CHECK(grad_output.defined() && weight.defined() && grad_output.dim() == 4 && input_shape.size() == 4,
           "conv2d_backward_input: expected a 4-D grad_output and weight and a 4-D input shape, got {}, {} and {}",
           grad_output.meta(), weight.meta(), shape_str(input_shape));
  HG_CHECK(grad_output.is_floating_point(), "conv2d_backward_input: expected a floating grad_output, got {}",
           grad_output.meta());
  check_operand("conv2d_backward_input", "weight", weight, grad_output);
  const char* op = "conv2d_backward_input";
  Shape expected = conv2d_output_shape(op, shape_only(op, input_shape, weight), weight, options);
  HG_CHECK(grad_output.shape() == expected,
           "conv2d_backward_input: grad_output {} does not match the output {} of input {} with weight {}",
           grad_output.meta(), shape_str(expected), shape_str(input_shape), weight.meta());
  Tensor grad =
      input_gradient(grad_output, weight, input_shape, params_of(options), suggest_memory_format(grad_output));
  // backward: linear in each operand, <h, dx(g, w)> = <conv2d(h, w), g> = <w, dw(g, h)>.
  record(backward_name(op), {grad_output, weight}, {grad},
         [saved_g = SavedTensor(weight.requires_grad() ? grad_output : Tensor(), op),
          saved_w = SavedTensor(grad_output.requires_grad() ? weight : Tensor(), op), weight_shape = weight.shape(),
          options](const GradContext& ctx) -> TensorList {
           const Tensor& h = ctx[0];  // input-shaped
           return {ctx.needs(0) ? conv2d(h, saved_w.get(), Tensor(), options) : Tensor(),
                   ctx.needs(1) ? conv2d_backward_weight(saved_g.get(), h, weight_shape, options) : Tensor()};
         }, DoubleBackward::Supported);
  return grad;
}

Tensor conv2d_backward_weight(const Tensor& grad_output, const Tensor& input, const Shape& weight_shape,
                              const Conv2dOptions& options) {
  HG_CHECK(grad_output.defined() && input.defined() && grad_output.dim() == 4 && weight_shape.size() == 4,
           "conv2d_backward_weight: expected a 4-D grad_output and input and a 4-D weight shape, got {}, {} and {}",
           grad_output.meta(), input.meta(), shape_str(weight_shape));
  HG_CHECK(grad_output.is_floating_point(), "conv2d_backward_weight: expected a floating grad_output, got {}",
           grad_output.meta());
  check_operand("conv2d_backward_weight", "input", input, grad_output);
  const char* op = "conv2d_backward_weight";
  Shape expected = conv2d_output_shape(op, input, shape_only(op, weight_shape, input), options);
  HG_CHECK(grad_output.shape() == expected,
           "conv2d_backward_weight: grad_output {} does not match the output {} of input {} with weight shape {}",
           grad_output.meta(), shape_str(expected), input.meta(), shape_str(weight_shape));
  Tensor grad = weight_gradient(grad_output, input, weight_shape, params_of(options), suggest_memory_format(input));
  // backward: linear in each operand, <H, dw(g, x)> = <conv2d(x, H), g> = <x, dx(g, H)>.
  record(backward_name(op), {grad_output, input}, {grad},
         [saved_g = SavedTensor(input.requires_grad() ? grad_output : Tensor(), op),
          saved_x = SavedTensor(grad_output.requires_grad() ? input : Tensor(), op), input_shape = input.shape(),
          options](const GradContext& ctx) -> TensorList {
           const Tensor& h = ctx[0];  // weight-shaped
           return {ctx.needs(0) ? conv2d(saved_x.get(), h, Tensor(), options) : Tensor(),
                   ctx.needs(1) ? conv2d_backward_input(saved_g.get(), h, input_shape, options) : Tensor()};
         }, DoubleBackward::Supported);
  return grad;
}

// ---- pointwise convolutions as GEMMs (used by the CPU and the CUDA kernels)

bool conv2d_is_pointwise(const Shape& weight_shape, const Conv2dParams& p) {
  return p.groups == 1 && weight_shape[2] == 1 && weight_shape[3] == 1 && p.stride == Pair2d{1, 1} &&
         p.padding == Pair2d{0, 0};
}

namespace {
GemmArgs gemm_args(const Tensor& out) {
  GemmArgs g;
  g.ab_dtype = g.c_dtype = out.dtype();
  g.device = out.device();
  return g;
}
}  // namespace

void conv2d_pointwise_forward(const Tensor& out, const Tensor& input, const Tensor& weight) {
  const int64_t N = input.size(0), C = input.size(1), HW = input.size(2) * input.size(3), O = weight.size(0);
  GemmArgs g = gemm_args(out);
  if (is_channels_last(out) && is_channels_last(input)) {
    // y [N*HW, O] = x [N*HW, C] w^T, w stored [O, C]
    g.m = N * HW, g.n = O, g.k = C;
    g.a = input.data_ptr(), g.lda = C;
    g.b = weight.data_ptr(), g.ldb = C, g.trans_b = Trans::Yes;
    g.c = out.data_ptr(), g.ldc = O;
  } else {
    // y[n] [O, HW] = w [O, C] x[n] [C, HW], for each sample n
    g.batch = N, g.m = O, g.n = HW, g.k = C;
    g.a = weight.data_ptr(), g.lda = C, g.stride_a = 0;
    g.b = input.data_ptr(), g.ldb = HW, g.stride_b = C * HW;
    g.c = out.data_ptr(), g.ldc = HW, g.stride_c = O * HW;
  }
  gemm_kernel[out.device()](g);
}

void conv2d_pointwise_backward_input(const Tensor& grad_input, const Tensor& grad_output, const Tensor& weight,
                                     bool accumulate) {
  const int64_t N = grad_input.size(0), C = grad_input.size(1), HW = grad_input.size(2) * grad_input.size(3);
  const int64_t O = weight.size(0);
  GemmArgs g = gemm_args(grad_input);
  if (is_channels_last(grad_input) && is_channels_last(grad_output)) {
    // dx [N*HW, C] = dy [N*HW, O] w [O, C]
    g.m = N * HW, g.n = C, g.k = O;
    g.a = grad_output.data_ptr(), g.lda = O;
    g.b = weight.data_ptr(), g.ldb = C;
    g.c = grad_input.data_ptr(), g.ldc = C;
  } else {
    // dx[n] [C, HW] = w^T [C, O] dy[n] [O, HW]
    g.batch = N, g.m = C, g.n = HW, g.k = O;
    g.a = weight.data_ptr(), g.lda = C, g.trans_a = Trans::Yes, g.stride_a = 0;
    g.b = grad_output.data_ptr(), g.ldb = HW, g.stride_b = O * HW;
    g.c = grad_input.data_ptr(), g.ldc = HW, g.stride_c = C * HW;
  }
  g.beta = accumulate ? 1.0 : 0.0;
  gemm_kernel[grad_input.device()](g);
}

void conv2d_pointwise_backward_weight(const Tensor& grad_weight, const Tensor& grad_output, const Tensor& input) {
  HG_CHECK(is_channels_last(grad_output) && is_channels_last(input),
           "conv2d backward (weight): the pointwise GEMM needs channels_last operands, got {} and {}",
           grad_output.meta(), input.meta());
  const int64_t M = input.size(0) * input.size(2) * input.size(3), C = input.size(1), O = grad_weight.size(0);
  // dw [O, C] = dy^T [O, N*HW] x [N*HW, C], dy stored [N*HW, O]
  GemmArgs g = gemm_args(grad_weight);
  g.m = O, g.n = C, g.k = M;
  g.a = grad_output.data_ptr(), g.lda = O, g.trans_a = Trans::Yes;
  g.b = input.data_ptr(), g.ldb = C;
  g.c = grad_weight.data_ptr(), g.ldc = C;
  gemm_kernel[grad_weight.device()](g);
}

// ---- CPU kernels

namespace {

// One convolution problem in NCHW terms, with the matrix sizes of the GEMM formulation (top of file).
struct Geometry {
  int64_t N, C, H, W;    // input
  int64_t O, kH, kW;     // weight [O, C / groups, kH, kW]
  int64_t OH, OW;        // output
  int64_t groups, Cg, Og;
  int64_t K, L;          // K = Cg kH kW rows of col, L = OH OW columns
  Conv2dParams p;
  bool col_is_input;     // 1x1 kernel, stride 1, no padding: col is the input itself, no im2col needed

  Geometry(const Shape& in, const Shape& w, const Shape& out, const Conv2dParams& params)
      : N(in[0]), C(in[1]), H(in[2]), W(in[3]), O(w[0]), kH(w[2]), kW(w[3]), OH(out[2]), OW(out[3]),
        groups(params.groups), Cg(in[1] / params.groups), Og(w[0] / params.groups), K(Cg * kH * kW),
        L(out[2] * out[3]), p(params) {
    col_is_input = kH == 1 && kW == 1 && p.stride[0] == 1 && p.stride[1] == 1 && p.padding[0] == 0 &&
                   p.padding[1] == 0;
  }
  int64_t plane() const { return H * W; }
};

template <typename T> using Matrix = Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
template <typename T> using ConstVector = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>>;

// The outputs o in [0, count) whose input position o * stride + offset lies inside [0, size).
std::pair<int64_t, int64_t> inside_range(int64_t offset, int64_t stride, int64_t size, int64_t count) {
  int64_t lo = offset >= 0 ? 0 : (-offset + stride - 1) / stride;
  int64_t hi = size - 1 - offset < 0 ? 0 : (size - 1 - offset) / stride + 1;
  lo = std::min(lo, count);
  hi = std::clamp(hi, lo, count);
  return {lo, hi};
}

// col [K, L] from one sample's group of channels x [Cg, H, W]:
//   col[(c kH + kh) kW + kw][oh OW + ow] = x[c][oh sH - pH + kh dH][ow sW - pW + kw dW], 0 in the padding.
template <typename T> void im2col(const T* x, T* col, const Geometry& g) {
  const auto [sH, sW] = g.p.stride;
  const auto [pH, pW] = g.p.padding;
  const auto [dH, dW] = g.p.dilation;
  for (int64_t c = 0; c < g.Cg; ++c) {
    for (int64_t kh = 0; kh < g.kH; ++kh) {
      for (int64_t kw = 0; kw < g.kW; ++kw) {
        T* row = col + ((c * g.kH + kh) * g.kW + kw) * g.L;
        const int64_t w_offset = kw * dW - pW;
        const auto [lo, hi] = inside_range(w_offset, sW, g.W, g.OW);
        for (int64_t oh = 0; oh < g.OH; ++oh) {
          T* r = row + oh * g.OW;
          const int64_t ih = oh * sH - pH + kh * dH;
          if (ih < 0 || ih >= g.H) {
            std::fill(r, r + g.OW, T(0));
            continue;
          }
          const T* x_row = x + (c * g.H + ih) * g.W;
          std::fill(r, r + lo, T(0));
          if (sW == 1) {
            std::copy(x_row + lo + w_offset, x_row + hi + w_offset, r + lo);
          } else {
            for (int64_t ow = lo; ow < hi; ++ow) r[ow] = x_row[ow * sW + w_offset];
          }
          std::fill(r + hi, r + g.OW, T(0));
        }
      }
    }
  }
}

// The adjoint of im2col: adds each entry of col [K, L] to the input position it was read from (dx [Cg, H, W]
// must be zeroed first; positions covered by several windows receive several contributions).
template <typename T> void col2im(const T* col, T* dx, const Geometry& g) {
  const auto [sH, sW] = g.p.stride;
  const auto [pH, pW] = g.p.padding;
  const auto [dH, dW] = g.p.dilation;
  for (int64_t c = 0; c < g.Cg; ++c) {
    for (int64_t kh = 0; kh < g.kH; ++kh) {
      for (int64_t kw = 0; kw < g.kW; ++kw) {
        const T* row = col + ((c * g.kH + kh) * g.kW + kw) * g.L;
        const int64_t w_offset = kw * dW - pW;
        const auto [lo, hi] = inside_range(w_offset, sW, g.W, g.OW);
        for (int64_t oh = 0; oh < g.OH; ++oh) {
          const int64_t ih = oh * sH - pH + kh * dH;
          if (ih < 0 || ih >= g.H) continue;
          const T* r = row + oh * g.OW;
          T* dx_row = dx + (c * g.H + ih) * g.W;
          if (sW == 1) {
            for (int64_t ow = lo; ow < hi; ++ow) dx_row[ow + w_offset] += r[ow];
          } else {
            for (int64_t ow = lo; ow < hi; ++ow) dx_row[ow * sW + w_offset] += r[ow];
          }
        }
      }
    }
  }
}

// Threads for a loop over the batch: one per sample up to the OpenMP limit. With fewer samples than threads
// (and so one thread), the loop runs serially and each GEMM spreads over the threads instead.
int batch_threads(int64_t N) {
  const int max_threads = omp_get_max_threads();
  return N >= max_threads ? max_threads : 1;
}

// Row-major C [m x n] = op(A) op(B), or += when accumulating, in the calling thread's share of the work: through
// gemm_kernel, so float32 gets our AVX-512 GEMM where it suits (ops/matmul.cpp), Eigen's otherwise.
template <typename T>
void product(T* c, int64_t m, int64_t n, int64_t k, const T* a, Trans ta, const T* b, Trans tb, bool accumulate) {
  gemm_dense(Device::cpu(), dtype_of<T>(), dtype_of<T>(), m, n, k, a, ta, b, tb, c, accumulate ? 1.0 : 0.0);
}

template <typename T> void forward_typed(T* out, const T* x, const T* w, const T* bias, const Geometry& g) {
  auto sample = [&](int64_t n, std::vector<T>& col) {
    for (int64_t gr = 0; gr < g.groups; ++gr) {
      const T* xg = x + (n * g.C + gr * g.Cg) * g.plane();
      const T* cols = xg;
      if (!g.col_is_input) {
        im2col(xg, col.data(), g);
        cols = col.data();
      }
      T* y = out + (n * g.O + gr * g.Og) * g.L;  // [Og, L] = w [Og, K] cols [K, L]
      product(y, g.Og, g.L, g.K, w + gr * g.Og * g.K, Trans::No, cols, Trans::No, false);
      if (bias) Matrix<T>(y, g.Og, g.L).colwise() += ConstVector<T>(bias + gr * g.Og, g.Og);
    }
  };
  const int threads = batch_threads(g.N);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<T> col(g.col_is_input ? 0 : size_t(g.K * g.L));  // one buffer per thread, reused per sample
#pragma omp for schedule(static)
    for (int64_t n = 0; n < g.N; ++n) sample(n, col);
  }
}

template <typename T> void backward_input_typed(T* dx, const T* dy, const T* w, const Geometry& g) {
  auto sample = [&](int64_t n, std::vector<T>& col) {
    for (int64_t gr = 0; gr < g.groups; ++gr) {
      T* dxg = dx + (n * g.C + gr * g.Cg) * g.plane();
      const T* wg = w + gr * g.Og * g.K;                   // [Og, K]
      const T* dyg = dy + (n * g.O + gr * g.Og) * g.L;     // [Og, L]
      T* cols = g.col_is_input ? dxg : col.data();         // [K, L] = w^T dy
      product(cols, g.K, g.L, g.Og, wg, Trans::Yes, dyg, Trans::No, false);
      if (!g.col_is_input) {
        std::fill(dxg, dxg + g.Cg * g.plane(), T(0));
        col2im(col.data(), dxg, g);
      }
    }
  };
  const int threads = batch_threads(g.N);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<T> col(g.col_is_input ? 0 : size_t(g.K * g.L));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < g.N; ++n) sample(n, col);
  }
}

template <typename T> void backward_weight_typed(T* dw, const T* dy, const T* x, const Geometry& g) {
  const int64_t weight_numel = g.O * g.K;
  // Each thread sums its samples into its own copy of dW (thread 0 into dw itself); the copies are added
  // at the end. Threads are capped so that the copies stay within a memory budget.
  constexpr int64_t kPartialBudgetBytes = int64_t(256) << 20;
  const int64_t affordable = 1 + kPartialBudgetBytes / std::max<int64_t>(1, weight_numel * int64_t(sizeof(T)));
  const int threads = int(std::min<int64_t>(batch_threads(g.N), affordable));
  std::vector<std::vector<T>> partial(size_t(threads > 1 ? threads - 1 : 0));
  std::fill(dw, dw + weight_numel, T(0));

  auto sample = [&](int64_t n, std::vector<T>& col, T* acc) {
    for (int64_t gr = 0; gr < g.groups; ++gr) {
      const T* xg = x + (n * g.C + gr * g.Cg) * g.plane();
      const T* cols = xg;
      if (!g.col_is_input) {
        im2col(xg, col.data(), g);
        cols = col.data();
      }
      // acc [Og, K] += dy [Og, L] cols^T, cols stored [K, L]
      product(acc + gr * g.Og * g.K, g.Og, g.K, g.L, dy + (n * g.O + gr * g.Og) * g.L, Trans::No, cols, Trans::Yes,
              true);
    }
  };
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int tid = omp_get_thread_num();
    T* acc = dw;
    if (tid > 0) {
      partial[size_t(tid - 1)].assign(size_t(weight_numel), T(0));
      acc = partial[size_t(tid - 1)].data();
    }
    std::vector<T> col(g.col_is_input ? 0 : size_t(g.K * g.L));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < g.N; ++n) sample(n, col, acc);
  }
  for (const std::vector<T>& p : partial) {
    for (int64_t i = 0; i < weight_numel; ++i) dw[i] += p[size_t(i)];
  }
}

// The CPU kernels compute on NCHW-contiguous operands in float32 (float16/bfloat16 widened, so that
// products accumulate in float32) or float64. Operands that are not so are converted first, and a result
// computed elsewhere is copied (and rounded) into the output once at the end.
DType compute_dtype(DType t) { return t == kFloat64 ? kFloat64 : kFloat32; }

Tensor prepared(const Tensor& t, DType compute) { return cast_nograd(t, compute).contiguous(); }

template <typename Fn> void with_computed_output(const Tensor& out, DType compute, Fn&& fn) {
  const bool direct = out.dtype() == compute && out.is_contiguous();
  Tensor target = direct ? out : empty(out.shape(), {.dtype = compute});
  fn(target);
  if (!direct) copy_kernel[Device::cpu()](out, target);
}

template <typename T> const T* ptr(const Tensor& t) { return t.defined() ? static_cast<const T*>(t.data_ptr()) : nullptr; }
template <typename T> T* mut(const Tensor& t) { return static_cast<T*>(t.data_ptr()); }

void conv2d_forward_cpu(const Tensor& out, const Tensor& input, const Tensor& weight, const Tensor& bias,
                        const Conv2dParams& params) {
  NoGradGuard no_grad;
  if (conv2d_is_pointwise(weight.shape(), params)) {  // a GEMM in either layout, no im2col, no conversion
    conv2d_pointwise_forward(out, input, weight);
    if (bias.defined()) Tensor(out).add_(bias.view({1, -1, 1, 1}));  // a handle copy: the same tensor
    return;
  }
  const DType compute = compute_dtype(out.dtype());
  const Geometry g(input.shape(), weight.shape(), out.shape(), params);
  Tensor x = prepared(input, compute), w = prepared(weight, compute);
  Tensor b = bias.defined() ? prepared(bias, compute) : Tensor();
  with_computed_output(out, compute, [&](const Tensor& y) {
    dispatch_floating(compute, "conv2d", [&]<typename T>() {
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
        forward_typed<T>(mut<T>(y), ptr<T>(x), ptr<T>(w), ptr<T>(b), g);
      }
    });
  });
}

void conv2d_backward_input_cpu(const Tensor& grad_input, const Tensor& grad_output, const Tensor& weight,
                               const Conv2dParams& params, bool accumulate) {
  NoGradGuard no_grad;
  if (conv2d_is_pointwise(weight.shape(), params)) {
    conv2d_pointwise_backward_input(grad_input, grad_output, weight, accumulate);
    return;
  }
  if (accumulate) {  // the column buffer's scatter writes: computed apart, then added
    const Tensor part = empty(grad_input.shape(), {.dtype = grad_input.dtype()}, suggest_memory_format(grad_input));
    conv2d_backward_input_cpu(part, grad_output, weight, params, false);
    Tensor(grad_input).add_(part);
    return;
  }
  const DType compute = compute_dtype(grad_input.dtype());
  const Geometry g(grad_input.shape(), weight.shape(), grad_output.shape(), params);
  Tensor dy = prepared(grad_output, compute), w = prepared(weight, compute);
  with_computed_output(grad_input, compute, [&](const Tensor& dx) {
    dispatch_floating(compute, "conv2d backward", [&]<typename T>() {
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
        backward_input_typed<T>(mut<T>(dx), ptr<T>(dy), ptr<T>(w), g);
      }
    });
  });
}

void conv2d_backward_weight_cpu(const Tensor& grad_weight, const Tensor& grad_output, const Tensor& input,
                                const Conv2dParams& params) {
  NoGradGuard no_grad;
  if (conv2d_is_pointwise(grad_weight.shape(), params) && is_channels_last(grad_output) && is_channels_last(input)) {
    conv2d_pointwise_backward_weight(grad_weight, grad_output, input);
    return;
  }
  const DType compute = compute_dtype(grad_weight.dtype());
  const Geometry g(input.shape(), grad_weight.shape(), grad_output.shape(), params);
  Tensor dy = prepared(grad_output, compute), x = prepared(input, compute);
  with_computed_output(grad_weight, compute, [&](const Tensor& dw) {
    dispatch_floating(compute, "conv2d backward", [&]<typename T>() {
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
        backward_weight_typed<T>(mut<T>(dw), ptr<T>(dy), ptr<T>(x), g);
      }
    });
  });
}

}  // namespace

HG_REGISTER_KERNEL(conv2d_forward_kernel, CPU, conv2d_forward_cpu);
HG_REGISTER_KERNEL(conv2d_backward_input_kernel, CPU, conv2d_backward_input_cpu);
HG_REGISTER_KERNEL(conv2d_backward_weight_kernel, CPU, conv2d_backward_weight_cpu);

}  // namespace halfgrad

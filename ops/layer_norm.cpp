// layer_norm: the public op with its backward next to it, and the CPU kernels.
#include "ops/layer_norm.h"

#include <algorithm>
#include <cmath>

#include "core/autocast.h"
#include "core/autograd.h"
#include "ops/elementwise.h"

namespace halfgrad {

constinit KernelTable<LayerNormForwardKernel> layer_norm_forward_kernel("layer_norm");
constinit KernelTable<LayerNormBackwardKernel> layer_norm_backward_kernel("layer_norm_backward");

namespace {


void check_parameter(const Tensor& p, const char* what, const Tensor& input, const Shape& normalized_shape) {
  if (!p.defined()) return;
  HG_CHECK(p.shape() == normalized_shape && p.dtype() == input.dtype() && p.device() == input.device(),
           "layer_norm: {} must have normalized_shape {} and the input's dtype and device (input {}), got {}", what,
           shape_str(normalized_shape), input.meta(), p.meta());
}

// The input seen as [rows, cols], after the checks every argument gets.
LayerNormShape checked_shape(const Tensor& input, const Shape& normalized_shape, const Tensor& weight,
                             const Tensor& bias, double eps) {
  HG_CHECK(input.defined(), "layer_norm: the input is an undefined tensor");
  HG_CHECK(input.is_floating_point(), "layer_norm: expected a floating-point input, got {} (convert it with "
           ".to(kFloat32))", input.meta());
  const int64_t k = int64_t(normalized_shape.size()), offset = input.dim() - k;
  HG_CHECK(k > 0, "layer_norm: normalized_shape is empty: give the sizes of the last dims to normalise over");
  HG_CHECK(offset >= 0 && Shape(input.shape().begin() + offset, input.shape().end()) == normalized_shape,
           "layer_norm: normalized_shape {} must be the last dims of the input's shape, got input {}",
           shape_str(normalized_shape), input.meta());
  check_parameter(weight, "weight", input, normalized_shape);
  check_parameter(bias, "bias", input, normalized_shape);
  HG_CHECK(eps >= 0, "layer_norm: eps must be a number >= 0, got {}", eps);
  LayerNormShape s{.rows = 1, .cols = 1};
  for (int64_t d = 0; d < input.dim(); ++d) (d < offset ? s.rows : s.cols) *= input.size(d);
  return s;
}

// layer_norm's gradients in ops that record, for a pass with create_graph (the kernel otherwise), over each row, with
// gw = g * weight (g without one): dx as normalization_input_gradient, dweight = sum over rows of g x^, dbias = sum
// over rows of g.
TensorList layer_norm_backward_recorded(const GradContext& g, const Tensor& input, const Tensor& weight,
                                        const LayerNormShape& shape, const Shape& normalized_shape, double eps) {
  const Shape rows_cols{shape.rows, shape.cols};
  const DType acc = accumulation_dtype(input.dtype());
  const Normalization n = normalization_recorded(input.to(acc).reshape(rows_cols), {1}, eps);
  const Tensor grad = g[0].to(acc).reshape(rows_cols);
  const Tensor gw = weight.defined() ? grad * weight.to(acc).reshape({1, shape.cols}) : grad;
  Tensor grad_input, grad_weight, grad_bias;
  if (g.needs(0)) {
    grad_input = normalization_input_gradient(gw, n, {1}).to(input.dtype()).reshape(input.shape());
  }
  if (g.needs(1)) grad_weight = (grad * n.normalized).sum({0}).to(input.dtype()).reshape(normalized_shape);
  if (g.needs(2)) grad_bias = grad.sum({0}).to(input.dtype()).reshape(normalized_shape);
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace

Normalization normalization_recorded(const Tensor& x, const Dims& dims, double eps) {
  const Tensor centred = x - x.mean(dims, true);
  const Tensor invstd = rsqrt((centred * centred).mean(dims, true) + eps);
  return {centred * invstd, invstd};
}

Tensor normalization_input_gradient(const Tensor& gw, const Normalization& n, const Dims& dims) {
  return n.invstd * (gw - gw.mean(dims, true) - n.normalized * (gw * n.normalized).mean(dims, true));
}

Tensor layer_norm(const Tensor& input, const Shape& normalized_shape, const Tensor& weight, const Tensor& bias,
                  double eps) {
  HG_AUTOCAST(layer_norm, input, normalized_shape, weight, bias, eps);
  const LayerNormShape shape = checked_shape(input, normalized_shape, weight, bias, eps);
  const Device device = input.device();
  const TensorOptions statistics{.dtype = accumulation_dtype(input.dtype()), .device = device};
  LayerNormForwardArgs a;
  a.shape = shape;
  a.input = input.detach().contiguous();
  if (weight.defined()) a.weight = weight.detach().contiguous();
  if (bias.defined()) a.bias = bias.detach().contiguous();
  a.output = empty(input.shape(), {.dtype = input.dtype(), .device = device});
  a.mean = empty({shape.rows}, statistics);
  a.rstd = empty({shape.rows}, statistics);
  a.eps = eps;
  if (input.numel() > 0) layer_norm_forward_kernel[device](a);

  // backward: the kept input (an alias of the caller's when it was contiguous, so an in-place change to it is
  // caught) and weight, with their histories (for a pass with create_graph), and the row statistics.
  constexpr const char* op = "layer_norm";
  record("NativeLayerNormBackward", {input, weight, bias}, {a.output},
         [x = SavedTensor(input, a.input, op), w = SavedTensor(weight, a.weight, op), mean = a.mean, rstd = a.rstd,
          shape, normalized_shape, eps](const GradContext& g) -> TensorList {
           if (GradMode::is_enabled())
             return layer_norm_backward_recorded(g, x.get(), w.get(), shape, normalized_shape, eps);
           LayerNormBackwardArgs b;
           b.shape = shape;
           b.input = x.get();
           b.weight = w.get();
           b.mean = mean;
           b.rstd = rstd;
           b.grad_output = g[0].to(b.input.dtype()).contiguous();
           const TensorOptions like{.dtype = b.input.dtype(), .device = b.input.device()};
           if (g.needs(0)) b.grad_input = empty(b.input.shape(), like);
           // (zeros: with no rows the kernel does not run and the sums are empty)
           if (g.needs(1)) b.grad_weight = zeros(normalized_shape, like);
           if (g.needs(2)) b.grad_bias = zeros(normalized_shape, like);
           if (b.input.numel() > 0) layer_norm_backward_kernel[b.input.device()](b);
           return {b.grad_input, b.grad_weight, b.grad_bias};
         }, DoubleBackward::Supported);
  return a.output;
}

// ---- CPU kernels
//
// Threads take whole rows; each row's sums run in double whatever T (as var's CPU kernel: a long float32 row summed
// in float32 would lose ~log2(cols) bits). The parameters' gradients are sums over rows: threads take blocks of
// kColumns columns and walk every row, so each sum has one fixed order (the same bits on any thread count).
namespace {

constexpr int64_t kColumns = 64;
constexpr int64_t kParallelGrain = 16384;  // elements; smaller problems run on one thread

template <typename T> void forward_cpu(const LayerNormForwardArgs& a) {
  using A = opmath_t<T>;
  const int64_t rows = a.shape.rows, cols = a.shape.cols;
  const T* x = a.input.data<T>();
  const T* w = a.weight.defined() ? a.weight.data<T>() : nullptr;
  const T* b = a.bias.defined() ? a.bias.data<T>() : nullptr;
  T* y = a.output.data<T>();
  A* mean = a.mean.data<A>();
  A* rstd = a.rstd.data<A>();
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelGrain)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    double sum = 0;
    for (int64_t j = 0; j < cols; ++j) sum += double(A(xr[j]));
    const double m = sum / double(cols);
    double squares = 0;
    for (int64_t j = 0; j < cols; ++j) {
      const double d = double(A(xr[j])) - m;
      squares += d * d;
    }
    const A mr = A(m), rs = A(1.0 / std::sqrt(squares / double(cols) + a.eps));
    mean[r] = mr;
    rstd[r] = rs;
    T* yr = y + r * cols;
    for (int64_t j = 0; j < cols; ++j) {
      A v = (A(xr[j]) - mr) * rs;
      if (w) v *= A(w[j]);
      if (b) v += A(b[j]);
      yr[j] = T(v);
    }
  }
}

template <typename T> void backward_cpu(const LayerNormBackwardArgs& a) {
  using A = opmath_t<T>;
  const int64_t rows = a.shape.rows, cols = a.shape.cols;
  const T* x = a.input.data<T>();
  const T* g = a.grad_output.data<T>();
  const T* w = a.weight.defined() ? a.weight.data<T>() : nullptr;
  const A* mean = a.mean.data<A>();
  const A* rstd = a.rstd.data<A>();
  if (a.grad_input.defined()) {
    T* dx = a.grad_input.data<T>();
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelGrain)
    for (int64_t r = 0; r < rows; ++r) {
      const T *xr = x + r * cols, *gr = g + r * cols;
      const A m = mean[r], rs = rstd[r];
      double sum_gw = 0, sum_gw_xhat = 0;
      for (int64_t j = 0; j < cols; ++j) {
        const A gw = w ? A(gr[j]) * A(w[j]) : A(gr[j]);
        sum_gw += double(gw);
        sum_gw_xhat += double(gw) * double((A(xr[j]) - m) * rs);
      }
      const A mean_gw = A(sum_gw / double(cols)), mean_gw_xhat = A(sum_gw_xhat / double(cols));
      T* dr = dx + r * cols;
      for (int64_t j = 0; j < cols; ++j) {
        const A gw = w ? A(gr[j]) * A(w[j]) : A(gr[j]);
        dr[j] = T(rs * (gw - mean_gw - (A(xr[j]) - m) * rs * mean_gw_xhat));
      }
    }
  }
  if (!a.grad_weight.defined() && !a.grad_bias.defined()) return;
  T* dw = a.grad_weight.defined() ? a.grad_weight.data<T>() : nullptr;
  T* db = a.grad_bias.defined() ? a.grad_bias.data<T>() : nullptr;
  const int64_t blocks = (cols + kColumns - 1) / kColumns;
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelGrain)
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t c0 = block * kColumns, width = std::min(kColumns, cols - c0);
    double sum_w[kColumns] = {}, sum_b[kColumns] = {};
    for (int64_t r = 0; r < rows; ++r) {
      const T *xr = x + r * cols + c0, *gr = g + r * cols + c0;
      const A m = mean[r], rs = rstd[r];
      for (int64_t k = 0; k < width; ++k) {
        sum_w[k] += double(A(gr[k]) * ((A(xr[k]) - m) * rs));
        sum_b[k] += double(A(gr[k]));
      }
    }
    for (int64_t k = 0; k < width; ++k) {
      if (dw) dw[c0 + k] = T(A(sum_w[k]));
      if (db) db[c0 + k] = T(A(sum_b[k]));
    }
  }
}

void layer_norm_forward_cpu(const LayerNormForwardArgs& a) {
  dispatch_floating(a.input.dtype(), "layer_norm", [&]<typename T>() { forward_cpu<T>(a); });
}
void layer_norm_backward_cpu(const LayerNormBackwardArgs& a) {
  dispatch_floating(a.input.dtype(), "layer_norm_backward", [&]<typename T>() { backward_cpu<T>(a); });
}

}  // namespace

HG_REGISTER_KERNEL(layer_norm_forward_kernel, CPU, layer_norm_forward_cpu);
HG_REGISTER_KERNEL(layer_norm_backward_kernel, CPU, layer_norm_backward_cpu);

}  // namespace halfgrad

// Parameter initialisers. See nn/init.h.
#include "nn/init.h"

#include <cmath>

#include "core/autograd.h"
#include "ops/elementwise.h"

namespace halfgrad::nn::init {

namespace {
DType draw_dtype(const Tensor& t) { return t.dtype() == kFloat64 ? kFloat64 : kFloat32; }

void check_floating(const Tensor& t, const char* op) {
  HG_CHECK(t.defined(), "nn::init::{}: the tensor is undefined", op);
  HG_CHECK(t.is_floating_point(), "nn::init::{}: expected a floating-point tensor, got {}", op, t.meta());
}

// Writes `values` (CPU, float32/64) into t under no-grad: t keeps its identity, dtype and device.
Tensor assign(Tensor t, const Tensor& values) {
  NoGradGuard no_grad;
  t.copy_(values);
  return t;
}
}  // namespace

double calculate_gain(Nonlinearity nonlinearity, double param) {
  switch (nonlinearity) {
    case Nonlinearity::Linear:
    case Nonlinearity::Conv:
    case Nonlinearity::Sigmoid: return 1.0;
    case Nonlinearity::Tanh: return 5.0 / 3.0;
    case Nonlinearity::ReLU: return std::sqrt(2.0);
    case Nonlinearity::LeakyReLU: return std::sqrt(2.0 / (1.0 + param * param));
    case Nonlinearity::SELU: return 3.0 / 4.0;
  }
  return 1.0;
}

std::pair<int64_t, int64_t> fan_in_and_fan_out(const Tensor& weight) {
  HG_CHECK(weight.dim() >= 2, "nn::init: fan in and fan out need a tensor with at least 2 dims, got {}",
           weight.meta());
  int64_t receptive = 1;
  for (int64_t d = 2; d < weight.dim(); ++d) receptive *= weight.size(d);
  return {weight.size(1) * receptive, weight.size(0) * receptive};
}

Tensor uniform_(Tensor t, double low, double high) {
  check_floating(t, "uniform_");
  HG_CHECK(low <= high && std::isfinite(high - low),
           "nn::init::uniform_: expected low <= high, a finite range, got low {} and high {}", low, high);
  // As PyTorch's check_uniform_bounds: a bound, or the span between them, past the dtype's range would draw
  // infinities (and nan where a draw is 0).
  HG_CHECK(fits_dtype(low, t.dtype()) && fits_dtype(high, t.dtype()) && fits_dtype(high - low, t.dtype()),
           "nn::init::uniform_: low {} and high {}, and the span between them, must lie within {}'s range", low, high,
           t.meta());
  NoGradGuard no_grad;
  // Scaled in float32 (float64), rounded to the tensor's dtype: the rounding can reach high (float16 on [1, 2): the
  // largest draw rounds to 2), which then goes to low, as PyTorch's CUDA kernel does, so that values stay in [low, high).
  // The comparison reads high in the tensor's dtype (float16's 0.1 is 0.0999755859375), as that kernel does.
  const Tensor drawn = (rand(t.shape(), {.dtype = draw_dtype(t)}) * (high - low) + low).to(t.dtype());
  return assign(t, where(drawn.ge(high), low, drawn));
}

Tensor normal_(Tensor t, double mean, double std) {
  check_floating(t, "normal_");
  HG_CHECK(std >= 0, "nn::init::normal_: expected std >= 0, got {}", std);
  NoGradGuard no_grad;
  return assign(t, randn(t.shape(), {.dtype = draw_dtype(t)}) * std + mean);
}

Tensor constant_(Tensor t, double value) {
  HG_CHECK(t.defined(), "nn::init::constant_: the tensor is undefined");
  NoGradGuard no_grad;
  t.fill_(value);
  return t;
}

Tensor zeros_(Tensor t) { return constant_(t, 0); }
Tensor ones_(Tensor t) { return constant_(t, 1); }

Tensor xavier_uniform_(Tensor t, double gain) {
  auto [fan_in, fan_out] = fan_in_and_fan_out(t);
  double a = gain * std::sqrt(6.0 / double(fan_in + fan_out));
  return uniform_(t, -a, a);
}

Tensor xavier_normal_(Tensor t, double gain) {
  auto [fan_in, fan_out] = fan_in_and_fan_out(t);
  return normal_(t, 0, gain * std::sqrt(2.0 / double(fan_in + fan_out)));
}

namespace {
double kaiming_std(const Tensor& t, double a, FanMode mode, Nonlinearity nonlinearity, const char* op) {
  auto [fan_in, fan_out] = fan_in_and_fan_out(t);
  int64_t fan = mode == FanMode::FanIn ? fan_in : fan_out;
  HG_CHECK(fan > 0, "nn::init::{}: the fan of {} is 0", op, t.meta());
  return calculate_gain(nonlinearity, a) / std::sqrt(double(fan));
}
}  // namespace

// A tensor with no elements is left as it is (PyTorch: "Initializing zero-element tensors is a no-op"): a Linear(0, n)
// or a Conv2d of no input channels has nothing to initialise.
Tensor kaiming_uniform_(Tensor t, double a, FanMode mode, Nonlinearity nonlinearity) {
  if (t.numel() == 0) return t;
  double bound = std::sqrt(3.0) * kaiming_std(t, a, mode, nonlinearity, "kaiming_uniform_");
  return uniform_(t, -bound, bound);
}

Tensor kaiming_normal_(Tensor t, double a, FanMode mode, Nonlinearity nonlinearity) {
  if (t.numel() == 0) return t;
  return normal_(t, 0, kaiming_std(t, a, mode, nonlinearity, "kaiming_normal_"));
}

void default_linear_init_(Tensor weight, Tensor bias) {
  kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias.defined()) {
    int64_t fan_in = fan_in_and_fan_out(weight).first;
    double bound = fan_in > 0 ? 1.0 / std::sqrt(double(fan_in)) : 0.0;
    uniform_(bias, -bound, bound);
  }
}

}  // namespace halfgrad::nn::init

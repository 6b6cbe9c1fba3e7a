#pragma once
// Parameter initialisers, as torch.nn.init. Each fills its tensor in place and returns it; the tensor is taken by
// value, as libtorch's are (a handle to the same storage), so a view fills what it sees: uniform_(w.narrow(0, 0, 2))
// draws w's first two rows. Each runs under NoGradGuard (so it may fill a parameter that requires grad) and draws
// from the global generator, so manual_seed(s) makes initialisation reproducible. Random values are drawn in float32
// (float64 for float64 tensors) on the CPU, then converted to the tensor's dtype and device: the same seed gives the
// same model on every device.
//
// Fans: for a weight [out, in, k1, k2, ...], fan_in = in * k1 * k2 * ... and fan_out = out * k1 * k2 * ...
// (a Linear weight [out, in] is the case without kernel dims).
#include <utility>

#include "core/tensor.h"

namespace halfgrad::nn::init {

enum class Nonlinearity { Linear, Conv, Sigmoid, Tanh, ReLU, LeakyReLU, SELU };
enum class FanMode { FanIn, FanOut };

// torch.nn.init.calculate_gain: the factor that keeps activations' variance steady through the nonlinearity.
// Linear/Conv/Sigmoid 1, Tanh 5/3, ReLU sqrt(2), LeakyReLU sqrt(2 / (1 + slope^2)) (slope = param, default
// 0.01), SELU 3/4.
double calculate_gain(Nonlinearity nonlinearity, double param = 0.01);
// (fan_in, fan_out) of a weight with at least 2 dims.
std::pair<int64_t, int64_t> fan_in_and_fan_out(const Tensor& weight);

Tensor uniform_(Tensor t, double low = 0, double high = 1);  // U(low, high)
Tensor normal_(Tensor t, double mean = 0, double std = 1);   // N(mean, std^2)
Tensor constant_(Tensor t, double value);
Tensor zeros_(Tensor t);
Tensor ones_(Tensor t);

// Glorot & Bengio: U(-a, a) with a = gain * sqrt(6 / (fan_in + fan_out)); N(0, std^2) with std = gain *
// sqrt(2 / (fan_in + fan_out)).
Tensor xavier_uniform_(Tensor t, double gain = 1);
Tensor xavier_normal_(Tensor t, double gain = 1);

// He et al.: std = gain / sqrt(fan) with gain = calculate_gain(nonlinearity, a); uniform draws U(-b, b) with
// b = sqrt(3) * std. `a` is the negative slope of a leaky ReLU (0 for ReLU). PyTorch's defaults.
Tensor kaiming_uniform_(Tensor t, double a = 0, FanMode mode = FanMode::FanIn,
                       Nonlinearity nonlinearity = Nonlinearity::LeakyReLU);
Tensor kaiming_normal_(Tensor t, double a = 0, FanMode mode = FanMode::FanIn,
                       Nonlinearity nonlinearity = Nonlinearity::LeakyReLU);

// PyTorch's default for Linear and Conv (their reset_parameters): weight kaiming_uniform_ with a = sqrt(5),
// which is U(-1/sqrt(fan_in), 1/sqrt(fan_in)); bias (if defined) U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
void default_linear_init_(Tensor weight, Tensor bias);

}  // namespace halfgrad::nn::init

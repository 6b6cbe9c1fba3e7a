#pragma once
// Layers: Modules around the functional ops, with PyTorch's parameter names, shapes and default
// initialisation, so a halfgrad model and the same PyTorch model have the same state_dict keys.
//
//   auto model = nn::sequential({
//       std::make_shared<nn::Conv2d>(3, 16, 3, nn::Conv2dOptions{.padding = {1, 1}}),  // (N, 16, H, W)
//       std::make_shared<nn::BatchNorm2d>(16),
//       std::make_shared<nn::ReLU>(),
//       std::make_shared<nn::AdaptiveAvgPool2d>(1),                                    // (N, 16, 1, 1)
//       std::make_shared<nn::Flatten>(),                                               // (N, 16)
//       std::make_shared<nn::Linear>(16, 10),                                          // (N, 10)
//   });
//
// Each layer's parameters and buffers are public references into its registry (nn/module.h explains why).
#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "nn/module.h"
#include "ops/batch_norm.h"
#include "ops/conv.h"
#include "ops/pad.h"
#include "ops/pool.h"

namespace halfgrad::nn {

// The functional ops' option structs, also spelled nn::MaxPool2dOptions etc. next to the layers that take them, and
// the types they and the layers share.
using ::halfgrad::AvgPool2dOptions;
using ::halfgrad::MaxPool2dOptions;
using ::halfgrad::PadMode;
using ::halfgrad::Pair2d;

// nn.Conv2d's options: the functional conv2d's (ops/conv.h) and how the layer pads its input, as PyTorch's module
// (libtorch's torch::nn::Conv2dOptions beside the functional Conv2dFuncOptions).
struct Conv2dOptions {
  Pair2d stride = {1, 1};
  Pair2d padding = {0, 0};  // on each side, in padding_mode
  Pair2d dilation = {1, 1};
  int64_t groups = 1;
  // PyTorch's padding_mode: Constant is "zeros" (the convolution's own padding); Reflect, Replicate and Circular pad
  // the input with pad() (ops/pad.h) and convolve it without padding.
  PadMode padding_mode = PadMode::Constant;
  // PyTorch's padding="same": the output as large as the input (stride 1 only); dilation * (kernel - 1) elements a
  // dim, the odd one on the right. In place of `padding`, which must then stay {0, 0}.
  bool padding_same = false;
};

// y = x W^T + b. x (..., in_features) -> (..., out_features).
// weight (out_features, in_features) and bias (out_features): U(-1/sqrt(in_features), 1/sqrt(in_features)).
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true, TensorOptions options = {});
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "Linear"; }
  std::string extra_repr() const override;

  const int64_t in_features, out_features;
  Tensor& weight;
  Tensor& bias;  // undefined without bias
};

// 2-D convolution. x (N, in_channels, H, W) -> (N, out_channels, OH, OW) (ops/conv.h gives OH, OW).
// weight (out_channels, in_channels / groups, kH, kW) and bias (out_channels):
// U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = in_channels / groups * kH * kW.
class Conv2d : public Module {
 public:
  Conv2d(int64_t in_channels, int64_t out_channels, Pair2d kernel_size, Conv2dOptions options = {},
         bool bias = true, TensorOptions tensor_options = {});
  Conv2d(int64_t in_channels, int64_t out_channels, int64_t kernel_size, Conv2dOptions options = {},
         bool bias = true, TensorOptions tensor_options = {})
      : Conv2d(in_channels, out_channels, Pair2d{kernel_size, kernel_size}, options, bias, tensor_options) {}
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "Conv2d"; }
  std::string extra_repr() const override;

  // The convolution as forward runs it, in two steps (Sequential runs them with the bias elsewhere): x padded where
  // conv2d's own zeros do not do it (another padding_mode, or the odd element of padding "same"), and conv2d's
  // options for that input.
  Tensor padded_input(const Tensor& x) const;
  const ::halfgrad::Conv2dOptions& conv_options() const { return conv_options_; }

  const int64_t in_channels, out_channels;
  const Pair2d kernel_size;
  const Conv2dOptions options;
  Tensor& weight;
  Tensor& bias;  // undefined without bias

 private:
  std::vector<int64_t> input_padding_;  // pad()'s (left, right, top, bottom); empty where conv2d pads
  ::halfgrad::Conv2dOptions conv_options_;
};

struct BatchNormOptions {
  double eps = 1e-5;
  // Weight of the new batch statistic in the running average; nullopt: a cumulative average over all
  // batches seen (1 / num_batches_tracked), as PyTorch's momentum=None.
  std::optional<double> momentum = 0.1;
  bool affine = true;               // learnable weight (1) and bias (0)
  bool track_running_stats = true;  // keep running_mean/var and use them in eval mode
};

// Batch normalisation over (N, H, W) per channel. x (N, C, H, W) -> same shape.
// Training: normalises with the batch statistics and updates running_mean/var (unbiased variance) and
// num_batches_tracked (the op counts the batch in its kernels: one the op refuses is not counted, where PyTorch's
// module has counted it before the op's checks). Eval: normalises with running_mean/var (or batch statistics
// without running stats).
// Parameters weight, bias (C); buffers running_mean (C, zeros), running_var (C, ones), num_batches_tracked
// (0-d int64). Half inputs work with float32 parameters and statistics (keep BatchNorm in float32 under O2).
class BatchNorm2d : public Module {
 public:
  explicit BatchNorm2d(int64_t num_features, BatchNormOptions options = {}, TensorOptions tensor_options = {});
  Tensor forward(const Tensor& x) override;
  // relu(forward(x) + residual) (residual undefined: relu(forward(x))) as one op, batch_norm_relu: what a ResNet
  // block does after its convolutions, without the separate passes of the add and the relu. saved: what the backward
  // keeps to know where the result is positive; ReluSaved::Output where the next op is a convolution, which keeps
  // the result anyway (ops/batch_norm.h).
  Tensor forward_relu(const Tensor& x, const Tensor& residual = Tensor(), ReluSaved saved = ReluSaved::Mask);
  // forward(x + input_bias) (relu after it when `relu`) with the per-channel input_bias folded into the op
  // (batch_norm's input_bias): a convolution's bias before this layer, its add and its gradient's sum skipped.
  Tensor forward_with_input_bias(const Tensor& x, const Tensor& input_bias, bool relu);
  // Whether forward normalises with the batch's statistics: in training, or without running statistics.
  bool uses_batch_stats() const;
  std::string type_name() const override { return "BatchNorm2d"; }
  std::string extra_repr() const override;
  bool may_be_missing(const std::string& name) const override { return name == "num_batches_tracked"; }
  void reset_running_stats();

  const int64_t num_features;
  const BatchNormOptions options;
  Tensor& weight;               // undefined unless affine
  Tensor& bias;                 // undefined unless affine
  Tensor& running_mean;         // undefined unless track_running_stats
  Tensor& running_var;          // undefined unless track_running_stats
  Tensor& num_batches_tracked;  // undefined unless track_running_stats

 private:
  Tensor normalise(const Tensor& x, bool relu, const Tensor& residual, const Tensor& input_bias, ReluSaved saved);
};

struct LayerNormOptions {
  double eps = 1e-5;
  bool elementwise_affine = true;  // learnable weight (ones) and bias (zeros) of normalized_shape
  bool bias = true;                // with elementwise_affine: false keeps the weight alone (PyTorch's bias=False)
};

// Layer normalisation over the last dims, layer_norm (ops/layer_norm.h): x (*, *normalized_shape) -> same shape, each
// sample normalised with its own statistics in training and eval alike (no running statistics).
class LayerNorm : public Module {
 public:
  explicit LayerNorm(Shape normalized_shape, LayerNormOptions options = {}, TensorOptions tensor_options = {});
  explicit LayerNorm(int64_t normalized_size, LayerNormOptions options = {}, TensorOptions tensor_options = {})
      : LayerNorm(Shape{normalized_size}, options, tensor_options) {}
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "LayerNorm"; }
  std::string extra_repr() const override;

  const Shape normalized_shape;
  const LayerNormOptions options;
  Tensor& weight;  // undefined unless elementwise_affine
  Tensor& bias;    // undefined unless elementwise_affine and bias
};

class ReLU : public Module {
 public:
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "ReLU"; }
};

// approximate: "none" or "tanh" (gelu's, ops/elementwise.h); checked at construction.
class GELU : public Module {
 public:
  explicit GELU(std::string approximate = "none");
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "GELU"; }
  std::string extra_repr() const override;

  const std::string approximate;
};

class SiLU : public Module {
 public:
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "SiLU"; }
};

class Tanh : public Module {
 public:
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "Tanh"; }
};

class Sigmoid : public Module {
 public:
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "Sigmoid"; }
};

// x (N, C, H, W) -> (N, C, OH, OW).
class MaxPool2d : public Module {
 public:
  explicit MaxPool2d(Pair2d kernel_size, MaxPool2dOptions options = {});
  explicit MaxPool2d(int64_t kernel_size, MaxPool2dOptions options = {})
      : MaxPool2d(Pair2d{kernel_size, kernel_size}, options) {}
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "MaxPool2d"; }
  std::string extra_repr() const override;

  const Pair2d kernel_size;
  const MaxPool2dOptions options;
};

class AvgPool2d : public Module {
 public:
  explicit AvgPool2d(Pair2d kernel_size, AvgPool2dOptions options = {});
  explicit AvgPool2d(int64_t kernel_size, AvgPool2dOptions options = {})
      : AvgPool2d(Pair2d{kernel_size, kernel_size}, options) {}
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "AvgPool2d"; }
  std::string extra_repr() const override;

  const Pair2d kernel_size;
  const AvgPool2dOptions options;
};

// x (N, C, H, W) -> (N, C, output_size[0], output_size[1]); {1, 1} is global average pooling.
class AdaptiveAvgPool2d : public Module {
 public:
  explicit AdaptiveAvgPool2d(Pair2d output_size);
  explicit AdaptiveAvgPool2d(int64_t output_size) : AdaptiveAvgPool2d(Pair2d{output_size, output_size}) {}
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "AdaptiveAvgPool2d"; }
  std::string extra_repr() const override;

  const Pair2d output_size;
};

// Zeroes each element with probability p in training mode and scales the rest by 1 / (1 - p); the identity
// in eval mode. Masks come from the seeded generator.
class Dropout : public Module {
 public:
  explicit Dropout(double p = 0.5);
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "Dropout"; }
  std::string extra_repr() const override;

  const double p;
};

// A lookup table: int64 indices (any shape) -> (..., embedding_dim). weight (num_embeddings, embedding_dim)
// ~ N(0, 1); the row at padding_idx (if given) starts at zero and receives no gradient.
class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t embedding_dim, std::optional<int64_t> padding_idx = std::nullopt,
            TensorOptions options = {});
  Tensor forward(const Tensor& indices) override;
  std::string type_name() const override { return "Embedding"; }
  std::string extra_repr() const override;

  const int64_t num_embeddings, embedding_dim;
  const std::optional<int64_t> padding_idx;
  Tensor& weight;
};

// Flattens dims start_dim..end_dim into one: (N, C, H, W) -> (N, C*H*W) with the defaults.
class Flatten : public Module {
 public:
  explicit Flatten(int64_t start_dim = 1, int64_t end_dim = -1) : start_dim(start_dim), end_dim(end_dim) {}
  Tensor forward(const Tensor& x) override { return x.flatten(start_dim, end_dim); }
  std::string type_name() const override { return "Flatten"; }
  std::string extra_repr() const override;

  const int64_t start_dim, end_dim;
};

class Identity : public Module {
 public:
  Tensor forward(const Tensor& x) override { return x; }
  std::string type_name() const override { return "Identity"; }
};

// The padding layers: pad() (ops/pad.h) with the layer's padding, one number for every side or (left, right) for
// each padded dim from the last, as PyTorch's:
//   nn::ReflectionPad2d(2), nn::ReplicationPad1d({1, 3}), nn::ZeroPad2d({1, 1, 2, 0}), nn::ConstantPad3d(1, 3.5),
//   nn::CircularPad2d(1)
// A Dims-d layer pads the last Dims dims of its input; pad's rules say which inputs each mode takes.
class Pad : public Module {
 public:
  Tensor forward(const Tensor& x) override { return pad(x, padding, mode, value); }
  std::string type_name() const override { return name_; }
  std::string extra_repr() const override;

  const std::vector<int64_t> padding;  // pad()'s: (before, after) pairs from the last dim
  const PadMode mode;
  const std::optional<double> value;  // Constant only

 protected:
  Pad(std::string name, std::vector<int64_t> padding, PadMode mode, std::optional<double> value, bool zero);

 private:
  std::string name_;
  bool zero_;  // a ZeroPad: constant 0, which its repr leaves out
};

// Zero: the ZeroPad layers (constant 0, no value argument). The names are PyTorch's: ZeroPad2d, ReflectionPad1d, ...
template <int Dims, PadMode Mode, bool Zero = false> class PadLayer : public Pad {
  static_assert(Dims >= 1 && Dims <= 3 && (!Zero || Mode == PadMode::Constant));
  static constexpr bool kTakesValue = Mode == PadMode::Constant && !Zero;
  static std::string name() {
    const char* stem = Zero ? "ZeroPad" : Mode == PadMode::Constant ? "ConstantPad" : Mode == PadMode::Reflect
                       ? "ReflectionPad" : Mode == PadMode::Replicate ? "ReplicationPad" : "CircularPad";
    return std::string(stem) + std::to_string(Dims) + "d";
  }
  static std::vector<int64_t> every_side(int64_t padding) { return std::vector<int64_t>(2 * Dims, padding); }

 public:
  explicit PadLayer(int64_t padding) requires(!kTakesValue) : PadLayer(every_side(padding), zero_value()) {}
  explicit PadLayer(const std::array<int64_t, 2 * Dims>& padding) requires(!kTakesValue)
      : PadLayer({padding.begin(), padding.end()}, zero_value()) {}
  PadLayer(int64_t padding, double value) requires(kTakesValue) : PadLayer(every_side(padding), value) {}
  PadLayer(const std::array<int64_t, 2 * Dims>& padding, double value) requires(kTakesValue)
      : PadLayer({padding.begin(), padding.end()}, value) {}

 private:
  static std::optional<double> zero_value() { return Zero ? std::optional<double>(0.0) : std::nullopt; }
  PadLayer(std::vector<int64_t> padding, std::optional<double> value)
      : Pad(name(), std::move(padding), Mode, value, Zero) {}
};
using ZeroPad1d = PadLayer<1, PadMode::Constant, true>;
using ZeroPad2d = PadLayer<2, PadMode::Constant, true>;
using ZeroPad3d = PadLayer<3, PadMode::Constant, true>;
using ConstantPad1d = PadLayer<1, PadMode::Constant>;
using ConstantPad2d = PadLayer<2, PadMode::Constant>;
using ConstantPad3d = PadLayer<3, PadMode::Constant>;
using ReflectionPad1d = PadLayer<1, PadMode::Reflect>;
using ReflectionPad2d = PadLayer<2, PadMode::Reflect>;
using ReflectionPad3d = PadLayer<3, PadMode::Reflect>;
using ReplicationPad1d = PadLayer<1, PadMode::Replicate>;
using ReplicationPad2d = PadLayer<2, PadMode::Replicate>;
using ReplicationPad3d = PadLayer<3, PadMode::Replicate>;
using CircularPad1d = PadLayer<1, PadMode::Circular>;
using CircularPad2d = PadLayer<2, PadMode::Circular>;
using CircularPad3d = PadLayer<3, PadMode::Circular>;

// Runs its children in order, each one's output the next one's input, except that a BatchNorm2d followed by a ReLU
// runs as one op, BatchNorm2d::forward_relu (the ReLU module's forward is not called), and that a Conv2d with a bias
// followed by a BatchNorm2d that uses batch statistics runs as conv2d without the bias (Conv2d::forward is not
// called), which the batch norm takes as its input_bias (BatchNorm2d::forward_with_input_bias). Children are named
// "0", "1", ... (PyTorch's names, so "features.0.weight" matches).
class Sequential : public Module {
 public:
  Sequential() = default;
  Sequential(std::initializer_list<ModulePtr> modules);
  // Appends a module, named by its position.
  template <typename M> std::shared_ptr<M> push_back(std::shared_ptr<M> module) {
    return register_module(std::to_string(registered_children().size()), std::move(module));
  }
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "Sequential"; }

  size_t size() const { return registered_children().size(); }
  const ModulePtr& operator[](size_t index) const;
};

// A shared Sequential from a braced list (std::make_shared cannot forward one).
std::shared_ptr<Sequential> sequential(std::initializer_list<ModulePtr> modules);

}  // namespace halfgrad::nn

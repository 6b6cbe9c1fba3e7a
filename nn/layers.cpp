// Layers: construction (parameters, buffers, PyTorch's default initialisation) and forward through the
// functional ops. See nn/layers.h.
#include "nn/layers.h"

#include <typeinfo>

#include <fmt/ranges.h>

#include "core/autograd.h"
#include "nn/init.h"
#include "ops/batch_norm.h"
#include "ops/dropout.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/layer_norm.h"
#include "ops/matmul.h"

namespace halfgrad::nn {

namespace {
TensorOptions param_options(TensorOptions o) { return {.dtype = o.dtype, .device = o.device}; }
// A layer's size argument, checked where the member is initialised: before the parameters are allocated from it,
// whose own error would name neither the layer nor the argument.
int64_t size_argument(const char* layer, const char* name, int64_t value, int64_t at_least = 0) {
  HG_CHECK(value >= at_least, "{}: {} must be at least {}, got {}", layer, name, at_least, value);
  return value;
}
}  // namespace

// ---- Linear

Linear::Linear(int64_t in_features, int64_t out_features, bool bias, TensorOptions options)
    : in_features(size_argument("Linear", "in_features", in_features)),
      out_features(size_argument("Linear", "out_features", out_features)),
      weight(register_parameter("weight", empty({out_features, in_features}, param_options(options)))),
      bias(register_parameter("bias", bias ? empty({out_features}, param_options(options)) : Tensor())) {
  init::default_linear_init_(weight, this->bias);
}

Tensor Linear::forward(const Tensor& x) { return linear(x, weight, bias); }

std::string Linear::extra_repr() const {
  return fmt::format("in_features={}, out_features={}, bias={}", in_features, out_features, repr_bool(bias.defined()));
}

// ---- Conv2d

Conv2d::Conv2d(int64_t in_channels, int64_t out_channels, Pair2d kernel_size, Conv2dOptions options, bool bias,
               TensorOptions tensor_options)
    : in_channels(size_argument("Conv2d", "in_channels", in_channels)),
      out_channels(size_argument("Conv2d", "out_channels", out_channels)),
      kernel_size({size_argument("Conv2d", "kernel_size[0]", kernel_size[0], 1),
                   size_argument("Conv2d", "kernel_size[1]", kernel_size[1], 1)}),
      options(options),
      weight(register_parameter(
          "weight", empty({out_channels, options.groups > 0 ? in_channels / options.groups : 0, kernel_size[0],
                           kernel_size[1]}, param_options(tensor_options)))),
      bias(register_parameter("bias", bias ? empty({out_channels}, param_options(tensor_options)) : Tensor())) {
  HG_CHECK(options.groups > 0, "Conv2d: groups must be a positive integer, got {}", options.groups);
  HG_CHECK(in_channels % options.groups == 0 && out_channels % options.groups == 0,
           "Conv2d: in_channels {} and out_channels {} must be divisible by groups {}", in_channels, out_channels,
           options.groups);
  HG_CHECK(options.padding[0] >= 0 && options.padding[1] >= 0, "Conv2d: padding must be >= 0, got {}",
           pair_str(options.padding));
  HG_CHECK(options.dilation[0] >= 1 && options.dilation[1] >= 1, "Conv2d: dilation must be >= 1, got {}",
           pair_str(options.dilation));
  HG_CHECK(!options.padding_same || (options.stride == Pair2d{1, 1} && options.padding == Pair2d{0, 0}),
           "Conv2d: padding \"same\" takes stride 1 and no padding of its own (PyTorch's rule), got stride {} and "
           "padding {}", pair_str(options.stride), pair_str(options.padding));
  // Each dim's (before, after): padding "same" adds dilation * (kernel - 1), the odd one after (PyTorch's split).
  Pair2d before = options.padding, after = options.padding;
  for (int d = 0; d < 2 && options.padding_same; ++d) {
    const int64_t total = options.dilation[d] * (this->kernel_size[size_t(d)] - 1);
    before[size_t(d)] = total / 2;
    after[size_t(d)] = total - total / 2;
  }
  conv_options_ = {.stride = options.stride, .padding = {0, 0}, .dilation = options.dilation, .groups = options.groups};
  if (options.padding_mode == PadMode::Constant) {  // "zeros": conv2d's own, and pad() only for an odd "same"
    conv_options_.padding = before;
    if (after != before) input_padding_ = {0, after[1] - before[1], 0, after[0] - before[0]};
  } else if (before != Pair2d{0, 0} || after != Pair2d{0, 0}) {
    input_padding_ = {before[1], after[1], before[0], after[0]};
  }
  init::default_linear_init_(weight, this->bias);
}

Tensor Conv2d::padded_input(const Tensor& x) const {
  return input_padding_.empty() ? x : pad(x, input_padding_, options.padding_mode);
}

Tensor Conv2d::forward(const Tensor& x) { return conv2d(padded_input(x), weight, bias, conv_options_); }

std::string Conv2d::extra_repr() const {
  std::string s = fmt::format("{}, {}, kernel_size={}, stride={}", in_channels, out_channels, pair_str(kernel_size),
                              pair_str(options.stride));
  if (options.padding_same) s += ", padding=same";
  if (options.padding != Pair2d{0, 0}) s += ", padding=" + pair_str(options.padding);
  if (options.dilation != Pair2d{1, 1}) s += ", dilation=" + pair_str(options.dilation);
  if (options.groups != 1) s += fmt::format(", groups={}", options.groups);
  if (!bias.defined()) s += ", bias=False";
  if (options.padding_mode != PadMode::Constant) {
    s += fmt::format(", padding_mode={}", pad_mode_name(options.padding_mode));
  }
  return s;
}

// ---- the padding layers

Pad::Pad(std::string name, std::vector<int64_t> padding, PadMode mode, std::optional<double> value, bool zero)
    : padding(std::move(padding)), mode(mode), value(value), name_(std::move(name)), zero_(zero) {}

// PyTorch's: the padding as a tuple, and the value of a ConstantPad (not of a ZeroPad, whose value is always 0).
std::string Pad::extra_repr() const {
  const std::string tuple = fmt::format("({})", fmt::join(padding, ", "));
  if (mode != PadMode::Constant || zero_) return tuple;
  return fmt::format("padding={}, value={}", tuple, repr_float(*value));
}

// ---- BatchNorm2d

BatchNorm2d::BatchNorm2d(int64_t num_features, BatchNormOptions options, TensorOptions tensor_options)
    : num_features(size_argument("BatchNorm2d", "num_features", num_features, 1)),
      options(options),
      weight(register_parameter("weight", options.affine ? ones({num_features}, param_options(tensor_options))
                                                         : Tensor())),
      bias(register_parameter("bias", options.affine ? zeros({num_features}, param_options(tensor_options))
                                                     : Tensor())),
      running_mean(register_buffer("running_mean", options.track_running_stats
                                                       ? zeros({num_features}, param_options(tensor_options))
                                                       : Tensor())),
      running_var(register_buffer("running_var", options.track_running_stats
                                                     ? ones({num_features}, param_options(tensor_options))
                                                     : Tensor())),
      num_batches_tracked(register_buffer(
          "num_batches_tracked",
          options.track_running_stats ? zeros({}, {.dtype = kInt64, .device = tensor_options.device}) : Tensor())) {}

void BatchNorm2d::reset_running_stats() {
  if (!options.track_running_stats) return;
  NoGradGuard no_grad;
  running_mean.zero_();
  running_var.fill_(1);
  num_batches_tracked.zero_();
}

// As PyTorch's _BatchNorm.forward: batch statistics in training, or whenever there are no running stats.
bool BatchNorm2d::uses_batch_stats() const { return is_training() || !options.track_running_stats; }

Tensor BatchNorm2d::forward(const Tensor& x) {
  return normalise(x, /*relu=*/false, Tensor(), Tensor(), ReluSaved::Mask);
}

Tensor BatchNorm2d::forward_relu(const Tensor& x, const Tensor& residual, ReluSaved saved) {
  return normalise(x, /*relu=*/true, residual, Tensor(), saved);
}

Tensor BatchNorm2d::forward_with_input_bias(const Tensor& x, const Tensor& input_bias, bool relu) {
  return normalise(x, relu, Tensor(), input_bias, ReluSaved::Mask);
}

Tensor BatchNorm2d::normalise(const Tensor& x, bool relu, const Tensor& residual, const Tensor& input_bias,
                              ReluSaved saved) {
  HG_CHECK(x.dim() == 4, "BatchNorm2d: expected a 4-D input (N, C, H, W), got {}", x.meta());
  HG_CHECK(x.size(1) == num_features, "BatchNorm2d: expected {} channels, got {}", num_features, x.meta());
  bool use_batch_stats = uses_batch_stats();
  double momentum = options.momentum.value_or(0.0);
  // The op adds this batch to the count in its own kernels.
  const Tensor counter = is_training() && options.track_running_stats ? num_batches_tracked : Tensor();
  if (counter.defined() && !options.momentum) {
    // momentum = None: the running stats are the average over all batches so far, this one included.
    momentum = 1.0 / double(num_batches_tracked.item<int64_t>() + 1);
  }
  // Running stats are updated only while training; in eval they are read (or absent).
  Tensor mean = options.track_running_stats ? running_mean : Tensor();
  Tensor var = options.track_running_stats ? running_var : Tensor();
  if (relu) {
    return batch_norm_relu(x, mean, var, weight, bias, use_batch_stats, momentum, options.eps, residual, input_bias,
                           saved, counter);
  }
  return batch_norm(x, mean, var, weight, bias, use_batch_stats, momentum, options.eps, input_bias, counter);
}

std::string BatchNorm2d::extra_repr() const {
  return fmt::format("{}, eps={}, momentum={}, affine={}, track_running_stats={}", num_features,
                     repr_float(options.eps), options.momentum ? repr_float(*options.momentum) : "None",
                     repr_bool(options.affine), repr_bool(options.track_running_stats));
}

// ---- LayerNorm

namespace {
Shape checked_normalized_shape(Shape shape) {
  HG_CHECK(!shape.empty(), "LayerNorm: normalized_shape is empty: give the sizes of the last dims to normalise over");
  for (int64_t& size : shape) size = size_argument("LayerNorm", "normalized_shape", size, 0);
  return shape;
}
}  // namespace

LayerNorm::LayerNorm(Shape normalized_shape, LayerNormOptions options, TensorOptions tensor_options)
    : normalized_shape(checked_normalized_shape(std::move(normalized_shape))),
      options(options),
      weight(register_parameter("weight", options.elementwise_affine
                                              ? ones(this->normalized_shape, param_options(tensor_options))
                                              : Tensor())),
      bias(register_parameter("bias", options.elementwise_affine && options.bias
                                          ? zeros(this->normalized_shape, param_options(tensor_options))
                                          : Tensor())) {}

Tensor LayerNorm::forward(const Tensor& x) { return layer_norm(x, normalized_shape, weight, bias, options.eps); }

// PyTorch's: "(8,), eps=1e-05, elementwise_affine=True" (a Python tuple).
std::string LayerNorm::extra_repr() const {
  const std::string sizes = normalized_shape.size() == 1 ? fmt::format("({},)", normalized_shape[0])
                                                         : fmt::format("({})", fmt::join(normalized_shape, ", "));
  return fmt::format("{}, eps={}, elementwise_affine={}", sizes, repr_float(options.eps),
                     repr_bool(options.elementwise_affine));
}

// ---- activations, pooling, dropout

Tensor ReLU::forward(const Tensor& x) { return relu(x); }

GELU::GELU(std::string approximate) : approximate(std::move(approximate)) {
  check_gelu_approximate("GELU", this->approximate);
}
Tensor GELU::forward(const Tensor& x) { return gelu(x, approximate); }
std::string GELU::extra_repr() const { return fmt::format("approximate='{}'", approximate); }  // PyTorch's
Tensor SiLU::forward(const Tensor& x) { return silu(x); }
Tensor Tanh::forward(const Tensor& x) { return tanh(x); }
Tensor Sigmoid::forward(const Tensor& x) { return sigmoid(x); }

MaxPool2d::MaxPool2d(Pair2d kernel_size, MaxPool2dOptions options) : kernel_size(kernel_size), options(options) {}

Tensor MaxPool2d::forward(const Tensor& x) { return max_pool2d(x, kernel_size, options); }

namespace {
// PyTorch's pooling layers keep their arguments as given and print an int as an int: MaxPool2d(2) prints kernel_size=2.
// A square pair prints so here, which is PyTorch's repr for an int argument (a tuple (2, 2) would print as (2, 2)).
std::string pool_arg_str(const Pair2d& p) { return p[0] == p[1] ? std::to_string(p[0]) : pair_str(p); }
}  // namespace

std::string MaxPool2d::extra_repr() const {
  Pair2d stride = options.stride == Pair2d{0, 0} ? kernel_size : options.stride;
  return fmt::format("kernel_size={}, stride={}, padding={}, dilation={}, ceil_mode={}", pool_arg_str(kernel_size),
                     pool_arg_str(stride), pool_arg_str(options.padding), pool_arg_str(options.dilation),
                     repr_bool(options.ceil_mode));
}

AvgPool2d::AvgPool2d(Pair2d kernel_size, AvgPool2dOptions options) : kernel_size(kernel_size), options(options) {}

Tensor AvgPool2d::forward(const Tensor& x) { return avg_pool2d(x, kernel_size, options); }

std::string AvgPool2d::extra_repr() const {
  Pair2d stride = options.stride == Pair2d{0, 0} ? kernel_size : options.stride;
  return fmt::format("kernel_size={}, stride={}, padding={}", pool_arg_str(kernel_size), pool_arg_str(stride),
                     pool_arg_str(options.padding));
}

AdaptiveAvgPool2d::AdaptiveAvgPool2d(Pair2d output_size) : output_size(output_size) {}

Tensor AdaptiveAvgPool2d::forward(const Tensor& x) { return adaptive_avg_pool2d(x, output_size); }

std::string AdaptiveAvgPool2d::extra_repr() const { return "output_size=" + pool_arg_str(output_size); }

Dropout::Dropout(double p) : p(p) {
  HG_CHECK(p >= 0 && p <= 1, "Dropout: p must be in [0, 1], got {}", p);
}

Tensor Dropout::forward(const Tensor& x) { return dropout(x, p, is_training()); }

// PyTorch's words; halfgrad's dropout is never in place.
std::string Dropout::extra_repr() const { return fmt::format("p={}, inplace=False", repr_float(p)); }

// ---- Embedding

Embedding::Embedding(int64_t num_embeddings, int64_t embedding_dim, std::optional<int64_t> padding_idx,
                     TensorOptions options)
    : num_embeddings(size_argument("Embedding", "num_embeddings", num_embeddings)),
      embedding_dim(size_argument("Embedding", "embedding_dim", embedding_dim)),
      padding_idx(padding_idx && *padding_idx < 0 ? std::optional<int64_t>(*padding_idx + num_embeddings)
                                                  : padding_idx),
      weight(register_parameter("weight", empty({num_embeddings, embedding_dim}, param_options(options)))) {
  HG_CHECK(!this->padding_idx || (*this->padding_idx >= 0 && *this->padding_idx < num_embeddings),
           "Embedding: padding_idx {} out of range for {} embeddings", *padding_idx, num_embeddings);
  init::normal_(weight);
  if (this->padding_idx) {
    NoGradGuard no_grad;
    weight.select(0, *this->padding_idx).zero_();
  }
}

Tensor Embedding::forward(const Tensor& indices) { return embedding(indices, weight, padding_idx); }

std::string Embedding::extra_repr() const {
  std::string s = fmt::format("{}, {}", num_embeddings, embedding_dim);
  if (padding_idx) s += fmt::format(", padding_idx={}", *padding_idx);
  return s;
}

std::string Flatten::extra_repr() const { return fmt::format("start_dim={}, end_dim={}", start_dim, end_dim); }

// ---- Sequential

Sequential::Sequential(std::initializer_list<ModulePtr> modules) {
  for (const ModulePtr& m : modules) push_back(m);
}

namespace {

// Child i of a Sequential when it is exactly an M (not a subclass, which may override forward), else null.
template <typename M> M* exactly(const std::vector<std::pair<std::string, ModulePtr>>& children, size_t i) {
  if (i >= children.size() || typeid(*children[i].second) != typeid(M)) return nullptr;
  return static_cast<M*>(children[i].second.get());
}

}  // namespace

// A BatchNorm2d followed by a ReLU runs as one op (BatchNorm2d::forward_relu): the values of the two modules (relu
// commutes with rounding; on CUDA the kernels timed fastest for each form may differ in the last bit), two passes over
// the activation fewer forward and one backward. Where the BatchNorm2d after a Conv2d with a bias uses batch
// statistics, the bias is the batch norm's input_bias: it cancels, so its add forward and its gradient's sum backward
// are skipped (ops/batch_norm.h says what differs: its gradient is zero instead of the rounding error of a sum that is
// zero); the convolution runs as conv2d without it (Conv2d::forward is not called). Exactly those classes: a subclass
// may override forward.
Tensor Sequential::forward(const Tensor& x) {
  Tensor y = x;
  const auto& children = registered_children();
  for (size_t i = 0; i < children.size(); ++i) {
    const Conv2d* conv = exactly<Conv2d>(children, i);
    BatchNorm2d* next_bn = exactly<BatchNorm2d>(children, i + 1);
    if (conv && conv->bias.defined() && next_bn && next_bn->uses_batch_stats()) {
      const bool relu = exactly<ReLU>(children, i + 2) != nullptr;
      const Tensor convolved = conv2d(conv->padded_input(y), conv->weight, Tensor(), conv->conv_options());
      y = next_bn->forward_with_input_bias(convolved, conv->bias, relu);
      i += relu ? 2 : 1;
    } else if (BatchNorm2d* bn = exactly<BatchNorm2d>(children, i); bn && exactly<ReLU>(children, i + 1)) {
      y = bn->forward_relu(y);
      ++i;
    } else {
      y = children[i].second->forward(y);
    }
  }
  return y;
}

const ModulePtr& Sequential::operator[](size_t index) const {
  HG_CHECK(index < size(), "Sequential: index {} out of range for {} modules", index, size());
  return registered_children()[index].second;
}

std::shared_ptr<Sequential> sequential(std::initializer_list<ModulePtr> modules) {
  return std::make_shared<Sequential>(modules);
}

}  // namespace halfgrad::nn

// Recurrent layers (nn/rnn.h).
#include "nn/rnn.h"

#include <cmath>

#include "nn/init.h"

namespace halfgrad::nn {

namespace {

const char* kind_name(RecurrentKind k) {
  switch (k) {
    case RecurrentKind::RNNTanh:
    case RecurrentKind::RNNReLU: return "RNN";
    case RecurrentKind::GRU: return "GRU";
    case RecurrentKind::LSTM: return "LSTM";
  }
  return "RNN";
}

}  // namespace

Recurrent::Recurrent(RecurrentKind kind, int64_t input_size, int64_t hidden_size, RecurrentOptions options)
    : kind(kind), input_size(input_size), hidden_size(hidden_size), options(options) {
  HG_CHECK(input_size >= 1 && hidden_size >= 1 && options.num_layers >= 1,
           "{}: input_size, hidden_size and num_layers must be positive, got {}, {}, {}", kind_name(kind), input_size,
           hidden_size, options.num_layers);
  HG_CHECK(options.dropout >= 0 && options.dropout < 1, "{}: dropout must be in [0, 1), got {}", kind_name(kind),
           options.dropout);
  const int64_t G = rnn_gates(kind) * hidden_size;
  const double bound = 1.0 / std::sqrt(double(hidden_size));
  for (int64_t l = 0; l < options.num_layers; ++l) {
    const int64_t in = l == 0 ? input_size : hidden_size;
    const std::string k = std::to_string(l);
    auto add = [&](const std::string& name, const Shape& shape) {  // registered, drawn, and its slot kept
      Tensor& slot = register_parameter(name + k, empty(shape));
      init::uniform_(slot, -bound, bound);
      weights_.push_back(&slot);
    };
    // torch.nn.RNNBase's order: weight_ih, weight_hh, bias_ih, bias_hh per layer.
    add("weight_ih_l", {G, in});
    add("weight_hh_l", {G, hidden_size});
    if (options.bias) {
      add("bias_ih_l", {G});
      add("bias_hh_l", {G});
    }
  }
}

std::string Recurrent::type_name() const { return kind_name(kind); }

std::string Recurrent::extra_repr() const {
  std::string s = fmt::format("{}, {}", input_size, hidden_size);
  if (options.num_layers != 1) s += fmt::format(", num_layers={}", options.num_layers);
  // PyTorch's RNN hides its nonlinearity; printed here, so that the repr tells an RNN of relu from one of tanh.
  if (kind == RecurrentKind::RNNReLU) s += ", nonlinearity='relu'";
  if (!options.bias) s += ", bias=False";
  if (options.batch_first) s += ", batch_first=True";
  if (options.dropout > 0) s += ", dropout=" + repr_float(options.dropout);
  return s;
}

RecurrentOutput Recurrent::forward(const Tensor& input, const Tensor& h0, const Tensor& c0) {
  const char* op = kind_name(kind);
  HG_CHECK(input.defined() && input.dim() == 3 && input.size(2) == input_size && is_floating(input.dtype()),
           "{}: expected a floating input [{}, {}], got {}", op, options.batch_first ? "B, T" : "T, B", input_size,
           input.defined() ? input.meta() : "an undefined tensor");
  // The states, the weights and the options are the op's to check (ops/rnn.cpp).
  TensorList weights;
  for (Tensor* w : weights_) weights.push_back(*w);
  const RnnResult r = rnn(options.batch_first ? input.transpose(0, 1) : input, h0, c0, weights,
                          {.kind = kind, .num_layers = options.num_layers, .dropout = options.dropout,
                           .training = is_training()});
  return {options.batch_first ? r.output.transpose(0, 1) : r.output, r.h, r.c};
}

RNN::RNN(int64_t input_size, int64_t hidden_size, RecurrentOptions options, const std::string& nonlinearity)
    : Recurrent(nonlinearity == "relu" ? RecurrentKind::RNNReLU : RecurrentKind::RNNTanh, input_size, hidden_size,
                options) {
  HG_CHECK(nonlinearity == "tanh" || nonlinearity == "relu", "RNN: nonlinearity must be \"tanh\" or \"relu\", got \"{}\"",
           nonlinearity);
}

}  // namespace halfgrad::nn

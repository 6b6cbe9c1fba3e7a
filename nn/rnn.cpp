// Recurrent layers (nn/rnn.h).
#include "nn/rnn.h"

#include <cmath>

#include "nn/init.h"
#include "ops/dropout.h"
#include "ops/elementwise.h"
#include "ops/matmul.h"
#include "ops/stack.h"

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
  const int64_t G = gates() * hidden_size;
  const double bound = 1.0 / std::sqrt(double(hidden_size));
  for (int64_t l = 0; l < options.num_layers; ++l) {
    const int64_t in = l == 0 ? input_size : hidden_size;
    const std::string k = std::to_string(l);
    // torch.nn.RNNBase's order: weight_ih, weight_hh, bias_ih, bias_hh per layer.
    weight_ih_.push_back(&init::uniform_(register_parameter("weight_ih_l" + k, empty({G, in})), -bound, bound));
    weight_hh_.push_back(&init::uniform_(register_parameter("weight_hh_l" + k, empty({G, hidden_size})), -bound, bound));
    if (options.bias) {
      bias_ih_.push_back(&init::uniform_(register_parameter("bias_ih_l" + k, empty({G})), -bound, bound));
      bias_hh_.push_back(&init::uniform_(register_parameter("bias_hh_l" + k, empty({G})), -bound, bound));
    }
  }
}

int64_t Recurrent::gates() const {
  switch (kind) {
    case RecurrentKind::GRU: return 3;
    case RecurrentKind::LSTM: return 4;
    default: return 1;
  }
}

std::string Recurrent::type_name() const { return kind_name(kind); }

std::string Recurrent::extra_repr() const {
  std::string s = fmt::format("{}, {}", input_size, hidden_size);
  if (options.num_layers != 1) s += fmt::format(", num_layers={}", options.num_layers);
  if (kind == RecurrentKind::RNNReLU) s += ", nonlinearity='relu'";
  if (!options.bias) s += ", bias=false";
  if (options.batch_first) s += ", batch_first=true";
  if (options.dropout > 0) s += fmt::format(", dropout={}", options.dropout);
  return s;
}

RecurrentOutput Recurrent::forward(const Tensor& input, const Tensor& h0, const Tensor& c0) {
  const char* op = kind_name(kind);
  HG_CHECK(input.defined() && input.dim() == 3 && input.size(2) == input_size && is_floating(input.dtype()),
           "{}: expected a floating input [{}, {}], got {}", op, options.batch_first ? "B, T" : "T, B", input_size,
           input.defined() ? input.meta() : "an undefined tensor");
  Tensor x = options.batch_first ? input.transpose(0, 1) : input;
  const int64_t T = x.size(0), B = x.size(1), H = hidden_size, L = options.num_layers, G = gates() * H;
  const Shape state_shape{L, B, H};
  auto initial = [&](const Tensor& s, const char* name) {
    if (!s.defined()) return zeros(state_shape, {.dtype = input.dtype(), .device = input.device()});
    HG_CHECK(s.shape() == state_shape, "{}: {} must be [num_layers, batch, hidden] = [{}, {}, {}], got {}", op, name,
             L, B, H, s.meta());
    return s;
  };
  const Tensor h_init = initial(h0, "h0");
  const Tensor c_init = kind == RecurrentKind::LSTM ? initial(c0, "c0") : Tensor();
  HG_CHECK(kind == RecurrentKind::LSTM || !c0.defined(), "{}: only an LSTM takes a cell state c0", op);

  TensorList h_last, c_last;
  for (int64_t l = 0; l < L; ++l) {
    const Tensor& w_ih = *weight_ih_[size_t(l)];
    const Tensor& w_hh = *weight_hh_[size_t(l)];
    const Tensor b_ih = options.bias ? *bias_ih_[size_t(l)] : Tensor();
    const Tensor b_hh = options.bias ? *bias_hh_[size_t(l)] : Tensor();
    // The input projections of all T steps in one product: [T * B, in] -> [T, B, G * H].
    const Tensor projected = linear(x.reshape({T * B, x.size(2)}), w_ih, b_ih).view({T, B, G});
    Tensor h = h_init[l], c = kind == RecurrentKind::LSTM ? c_init[l] : Tensor();
    TensorList steps;
    for (int64_t t = 0; t < T; ++t) {
      const Tensor gi = projected[t], gh = linear(h, w_hh, b_hh);
      switch (kind) {
        case RecurrentKind::RNNTanh: h = (gi + gh).tanh(); break;
        case RecurrentKind::RNNReLU: h = (gi + gh).relu(); break;
        case RecurrentKind::GRU: {
          const Tensor r = (gi.narrow(1, 0, H) + gh.narrow(1, 0, H)).sigmoid();
          const Tensor z = (gi.narrow(1, H, H) + gh.narrow(1, H, H)).sigmoid();
          const Tensor n = (gi.narrow(1, 2 * H, H) + r * gh.narrow(1, 2 * H, H)).tanh();
          h = n + z * (h - n);  // (1 - z) n + z h
          break;
        }
        case RecurrentKind::LSTM: {
          const Tensor g = gi + gh;
          const Tensor i = g.narrow(1, 0, H).sigmoid(), f = g.narrow(1, H, H).sigmoid();
          const Tensor cell = g.narrow(1, 2 * H, H).tanh(), o = g.narrow(1, 3 * H, H).sigmoid();
          c = f * c + i * cell;
          h = o * c.tanh();
          break;
        }
      }
      steps.push_back(h);
    }
    x = stack(steps, 0);
    if (options.dropout > 0 && l + 1 < L) x = dropout(x, options.dropout, is_training());
    h_last.push_back(h);
    if (kind == RecurrentKind::LSTM) c_last.push_back(c);
  }
  return {options.batch_first ? x.transpose(0, 1) : x, stack(h_last, 0),
          kind == RecurrentKind::LSTM ? stack(c_last, 0) : Tensor()};
}

RNN::RNN(int64_t input_size, int64_t hidden_size, RecurrentOptions options, const std::string& nonlinearity)
    : Recurrent(nonlinearity == "relu" ? RecurrentKind::RNNReLU : RecurrentKind::RNNTanh, input_size, hidden_size,
                options) {
  HG_CHECK(nonlinearity == "tanh" || nonlinearity == "relu", "RNN: nonlinearity must be \"tanh\" or \"relu\", got \"{}\"",
           nonlinearity);
}

}  // namespace halfgrad::nn

#pragma once
// Recurrent layers: RNN (tanh or ReLU), GRU and LSTM, as torch.nn.RNN / GRU / LSTM (unidirectional): the same
// parameter names and shapes (weight_ih_l{k} [G * hidden, in], weight_hh_l{k} [G * hidden, hidden], bias_ih_l{k},
// bias_hh_l{k}, G = 1 / 3 / 4 gates), the same gate order (GRU r, z, n; LSTM i, f, g, o), the same equations and
// the same initialisation, U(-1/sqrt(hidden), 1/sqrt(hidden)) for every parameter.
//
//   nn::LSTM lstm(200, 200, {.num_layers = 2, .dropout = 0.2});
//   auto out = lstm.forward(x);                  // x [T, B, 200] (batch_first: [B, T, 200])
//   out.output;                                  // [T, B, 200]: the last layer's h at every step
//   auto next = lstm.forward(x2, out.h, out.c);  // carry the state on (detach it for truncated BPTT)
//
// forward is one call of the rnn op (ops/rnn.h): the whole stack over the whole sequence, one autograd node.
#include <cstdint>
#include <string>
#include <vector>

#include "nn/module.h"
#include "ops/rnn.h"

namespace halfgrad::nn {

using RecurrentKind = RnnKind;

struct RecurrentOptions {
  int64_t num_layers = 1;
  bool bias = true;
  bool batch_first = false;  // input and output [B, T, features] instead of [T, B, features]
  double dropout = 0;        // on the outputs of every layer but the last, in training mode
};

struct RecurrentOutput {
  Tensor output;  // [T, B, hidden] (or [B, T, hidden]): the last layer's hidden state at each step
  Tensor h;       // [num_layers, B, hidden]: each layer's hidden state after the last step
  Tensor c;       // LSTM only: [num_layers, B, hidden], the cell states
};

class Recurrent : public Module {
 public:
  Recurrent(RecurrentKind kind, int64_t input_size, int64_t hidden_size, RecurrentOptions options = {});

  // h0 (and c0 for an LSTM): [num_layers, B, hidden], or undefined for zeros.
  RecurrentOutput forward(const Tensor& input, const Tensor& h0, const Tensor& c0 = Tensor());
  Tensor forward(const Tensor& input) override { return forward(input, Tensor(), Tensor()).output; }
  std::string type_name() const override;
  std::string extra_repr() const override;

  const RecurrentKind kind;
  const int64_t input_size, hidden_size;
  const RecurrentOptions options;

 private:
  // The registered parameters' slots in the rnn op's order (per layer w_ih, w_hh[, b_ih, b_hh]).
  std::vector<Tensor*> weights_;
};

class RNN : public Recurrent {
 public:
  // nonlinearity: "tanh" or "relu"
  RNN(int64_t input_size, int64_t hidden_size, RecurrentOptions options = {}, const std::string& nonlinearity = "tanh");
};

class GRU : public Recurrent {
 public:
  GRU(int64_t input_size, int64_t hidden_size, RecurrentOptions options = {})
      : Recurrent(RecurrentKind::GRU, input_size, hidden_size, options) {}
};

class LSTM : public Recurrent {
 public:
  LSTM(int64_t input_size, int64_t hidden_size, RecurrentOptions options = {})
      : Recurrent(RecurrentKind::LSTM, input_size, hidden_size, options) {}
};

}  // namespace halfgrad::nn

// nn/rnn.h and models/language_model.h: the recurrent equations and gate orders of torch.nn.RNN/GRU/LSTM written
// out by hand, gradients against finite differences in float64, carrying state across calls, and a language model
// that learns a repeating sequence.
#include <doctest/doctest.h>

#include <cmath>

#include "halfgrad.h"
#include "models/language_model.h"
#include "nn/rnn.h"
#include "tests/gradcheck.h"
#include "tests/testing.h"

using namespace halfgrad;
using halfgrad::testing::values;
using halfgrad::testing::contains;
using halfgrad::testing::error_of;
using halfgrad::testing::gradcheck;

namespace {

Tensor param(const nn::Module& m, const std::string& name) {
  for (const auto& [n, t] : m.named_parameters())
    if (n == name) return t;
  FAIL("no parameter " << name);
  return Tensor();
}

Tensor sigmoid_of(const Tensor& t) { return t.sigmoid(); }

}  // namespace

TEST_CASE("RNN, GRU and LSTM have torch.nn's parameter names, shapes and U(-1/sqrt(H), 1/sqrt(H)) initialisation") {
  nn::LSTM lstm(10, 20, {.num_layers = 2});
  std::vector<std::string> names;
  for (const auto& [n, t] : lstm.named_parameters()) names.push_back(n);
  CHECK(names == std::vector<std::string>{"weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0", "weight_ih_l1",
                                          "weight_hh_l1", "bias_ih_l1", "bias_hh_l1"});
  CHECK(param(lstm, "weight_ih_l0").shape() == Shape{80, 10});
  CHECK(param(lstm, "weight_hh_l1").shape() == Shape{80, 20});
  CHECK(param(nn::GRU(10, 20), "weight_ih_l0").shape() == Shape{60, 10});
  CHECK(param(nn::RNN(10, 20), "bias_hh_l0").shape() == Shape{20});
  CHECK(nn::GRU(4, 5, {.bias = false}).named_parameters().size() == 2);
  const double bound = 1 / std::sqrt(20.0);
  for (const auto& [n, t] : lstm.named_parameters()) {
    CAPTURE(n);
    CHECK(t.abs().max().item<double>() <= bound);
    CHECK(t.abs().max().item<double>() > 0.9 * bound);
  }
  CHECK(lstm.type_name() == "LSTM");
  CHECK(lstm.extra_repr() == "10, 20, num_layers=2");
  CHECK(nn::RNN(3, 4, {}, "relu").extra_repr() == "3, 4, nonlinearity='relu'");
  CHECK(nn::GRU(3, 4, {.num_layers = 2, .bias = false, .batch_first = true, .dropout = 0.25}).extra_repr() ==
        "3, 4, num_layers=2, bias=False, batch_first=True, dropout=0.25");  // PyTorch's words, its True and False
}

TEST_CASE("the recurrent equations and gate orders: LSTM (i, f, g, o), GRU (r, z, n), RNN tanh/relu") {
  manual_seed(21);
  const int64_t T = 3, B = 2, I = 3, H = 4;
  Tensor x = randn({T, B, I}, {.dtype = kFloat64});
  Tensor h0 = randn({1, B, H}, {.dtype = kFloat64}), c0 = randn({1, B, H}, {.dtype = kFloat64});
  NoGradGuard no_grad;
  auto gates_of = [&](const nn::Module& m, const Tensor& xt, const Tensor& h) {
    return std::pair{linear(xt, param(m, "weight_ih_l0"), param(m, "bias_ih_l0")),
                     linear(h, param(m, "weight_hh_l0"), param(m, "bias_hh_l0"))};
  };
  SUBCASE("LSTM") {
    nn::LSTM lstm(I, H);
    lstm.to(kFloat64);
    auto out = lstm.forward(x, h0, c0);
    Tensor h = h0[0], c = c0[0];
    for (int64_t t = 0; t < T; ++t) {
      auto [gi, gh] = gates_of(lstm, x[t], h);
      Tensor g = gi + gh;
      Tensor i = sigmoid_of(g.narrow(1, 0, H)), f = sigmoid_of(g.narrow(1, H, H)), gg = g.narrow(1, 2 * H, H).tanh(),
             o = sigmoid_of(g.narrow(1, 3 * H, H));
      c = f * c + i * gg;
      h = o * c.tanh();
      testing::check_close(values(out.output[t]), values(h), 1e-12);
    }
    testing::check_close(values(out.h[0]), values(h), 1e-12);
    testing::check_close(values(out.c[0]), values(c), 1e-12);
  }
  SUBCASE("GRU") {
    nn::GRU gru(I, H);
    gru.to(kFloat64);
    auto out = gru.forward(x, h0);
    Tensor h = h0[0];
    for (int64_t t = 0; t < T; ++t) {
      auto [gi, gh] = gates_of(gru, x[t], h);
      Tensor r = sigmoid_of(gi.narrow(1, 0, H) + gh.narrow(1, 0, H));
      Tensor z = sigmoid_of(gi.narrow(1, H, H) + gh.narrow(1, H, H));
      Tensor n = (gi.narrow(1, 2 * H, H) + r * gh.narrow(1, 2 * H, H)).tanh();
      h = (1.0 - z) * n + z * h;
      testing::check_close(values(out.output[t]), values(h), 1e-12);
    }
    CHECK(!out.c.defined());
  }
  SUBCASE("RNN") {
    for (const char* nonlinearity : {"tanh", "relu"}) {
      nn::RNN rnn(I, H, {}, nonlinearity);
      rnn.to(kFloat64);
      auto out = rnn.forward(x, h0);
      Tensor h = h0[0];
      for (int64_t t = 0; t < T; ++t) {
        auto [gi, gh] = gates_of(rnn, x[t], h);
        h = std::string(nonlinearity) == "tanh" ? (gi + gh).tanh() : (gi + gh).relu();
      }
      testing::check_close(values(out.h[0]), values(h), 1e-12);
    }
  }
}

TEST_CASE("recurrent layers: gradients of inputs, states and every parameter match finite differences") {
  manual_seed(22);
  for (nn::RecurrentKind kind :
       {nn::RecurrentKind::RNNTanh, nn::RecurrentKind::GRU, nn::RecurrentKind::LSTM}) {
    nn::Recurrent layer(kind, 3, 4, {.num_layers = 2});
    CAPTURE(layer.type_name());
    layer.to(kFloat64);
    const bool lstm = kind == nn::RecurrentKind::LSTM;
    TensorList inputs = {randn({3, 2, 3}, {.dtype = kFloat64}).requires_grad_(),
                         randn({2, 2, 4}, {.dtype = kFloat64}).requires_grad_(),
                         lstm ? randn({2, 2, 4}, {.dtype = kFloat64}).requires_grad_() : Tensor()};
    // The parameters themselves: gradcheck perturbs them in place, which the layer sees.
    for (const Tensor& p : layer.parameters()) inputs.push_back(p);
    gradcheck(
        [&](const TensorList& in) {
          auto out = layer.forward(in[0], in[1], in[2]);
          Tensor all = cat({out.output.reshape({-1}), out.h.reshape({-1})});
          return lstm ? cat({all, out.c.reshape({-1})}) : all;
        },
        inputs);
  }
}

TEST_CASE("recurrent layers: batch_first, carrying the state across calls, dropout between layers, errors") {
  manual_seed(23);
  nn::LSTM lstm(3, 5, {.num_layers = 2});
  Tensor x = randn({6, 2, 3});
  auto whole = lstm.forward(x, Tensor());
  auto first = lstm.forward(x.narrow(0, 0, 4), Tensor());
  auto rest = lstm.forward(x.narrow(0, 4, 2), first.h, first.c);
  testing::check_close(values(rest.output), values(whole.output.narrow(0, 4, 2)), 1e-6);
  testing::check_close(values(rest.h), values(whole.h), 1e-6);
  CHECK(whole.h.shape() == Shape{2, 2, 5});

  nn::GRU gru(3, 5), gru_bf(3, 5, {.batch_first = true});
  gru_bf.load_state_dict(gru.state_dict());
  auto seq = gru.forward(x, Tensor());
  auto bf = gru_bf.forward(x.transpose(0, 1).contiguous(), Tensor());
  CHECK(bf.output.shape() == Shape{2, 6, 5});
  testing::check_close(values(bf.output.transpose(0, 1)), values(seq.output), 1e-6);

  // Dropout acts between layers in training and not at all in evaluation.
  nn::LSTM dropping(3, 5, {.num_layers = 2, .dropout = 0.5});
  Tensor a = dropping.forward(x), b = dropping.forward(x);
  CHECK(values(a) != values(b));
  dropping.eval();
  CHECK(values(dropping.forward(x)) == values(dropping.forward(x)));

  CHECK(contains(error_of([&] { lstm.forward(randn({6, 2, 4}), Tensor()); }), "expected a floating input [T, B, 3], got float32[6, 2, 4]"));
  CHECK(contains(error_of([&] { lstm.forward(x, zeros({1, 2, 5})); }), "h0 must be [num_layers, batch, hidden] = [2, 2, 5]"));
  CHECK(contains(error_of([&] { gru.forward(x, Tensor(), zeros({1, 2, 5})); }), "only an LSTM takes a cell state"));
  CHECK(contains(error_of([] { nn::RNN(3, 4, {}, "sigmoid"); }), "nonlinearity must be \"tanh\" or \"relu\""));
}

TEST_CASE("LanguageModel: pytorch/examples' parameters, tied weights, and it learns a repeating sequence") {
  {
    models::LanguageModel lm(33278);  // --emsize 200 --nhid 200 --nlayers 2, WikiText-2's vocabulary
    int64_t n = 0;
    for (const Tensor& p : lm.parameters()) n += p.numel();
    CHECK(n == 13987678);
    std::vector<std::string> names;
    for (const auto& [name, t] : lm.state_dict()) names.push_back(name);
    CHECK(names.front() == "encoder.weight");
    CHECK(names[1] == "rnn.weight_ih_l0");
    CHECK(names.back() == "decoder.bias");
    models::LanguageModel tied(33278, {.tie_weights = true});
    int64_t m = 0;
    for (const Tensor& p : tied.parameters()) m += p.numel();
    CHECK(m == 13987678 - 33278 * 200);  // the decoder's weight is the encoder's, counted once
    CHECK(tied.decoder->weight.data_ptr() == tied.encoder->weight.data_ptr());
    CHECK(contains(error_of([] { models::LanguageModel(10, {.embedding_size = 8, .hidden_size = 6, .tie_weights = true}); }),
                   "tied weights need embedding_size == hidden_size"));
  }
  manual_seed(24);
  // The sequence 0 1 2 ... 9 0 1 2 ..., in 4 columns: every next token is determined by the current one.
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < 400; ++i) ids.push_back(i % 10);
  Tensor source = data::batchify(tensor(ids), 4);
  for (nn::RecurrentKind kind : {nn::RecurrentKind::LSTM, nn::RecurrentKind::GRU}) {
    models::LanguageModel lm(10, {.kind = kind, .embedding_size = 16, .hidden_size = 16, .num_layers = 1, .dropout = 0});
    optim::Adam opt(lm.parameters(), {.lr = 0.05});
    double first = 0, last = 0;
    for (int step = 0; step < 60; ++step) {
      data::TextBatch b = data::bptt_batch(source, (step * 8) % 90, 8);
      opt.zero_grad();
      Tensor loss = cross_entropy(lm.forward(b.input).reshape({-1, 10}), b.target);
      loss.backward();
      opt.step();
      (step == 0 ? first : last) = loss.item<double>();
    }
    CAPTURE(lm.rnn->type_name());
    CHECK(first > 2.0);  // about log(10) at the start
    CHECK(last < 0.1);
  }
}

// Optimizers against hand-computed steps, parameter groups, checkpoint state, clip_grad_norm_, and the
// fused CUDA step against the CPU one.
//
// "PyTorch's numbers" below were computed by hand with PyTorch's update formulas in double precision
// (torch/optim/adam.py, _single_tensor_adam: lerp for m, bias corrections in Python floats); our float64
// step must agree to rounding, so the tolerance is 1e-12 relative.
#include <doctest/doctest.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/cuda.h"
#include "halfgrad.h"
#include "nn/checkpoint.h"
#include "optim/adagrad.h"
#include "optim/adam.h"
#include "optim/clip_grad.h"
#include "optim/rmsprop.h"
#include "optim/sgd.h"
#include "tests/testing.h"

using namespace halfgrad;
using halfgrad::testing::aligned_padding;
using halfgrad::testing::values;
using halfgrad::testing::bit_equal;
using halfgrad::testing::TempDir;
using optim::NamedTensors;

namespace {

// Sets p.grad to g and runs one step.
void step_with(optim::Optimizer& opt, Tensor& p, std::vector<double> g) {
  p.set_grad(tensor(g));
  opt.step();
}

void check_close(const Tensor& t, const std::vector<double>& expected, double rtol = 1e-12) {
  std::vector<double> v = values(t);
  REQUIRE(v.size() == expected.size());
  for (size_t i = 0; i < v.size(); ++i) CHECK(v[i] == doctest::Approx(expected[i]).epsilon(rtol));
}

// Largest |a - b| / (atol + rtol * |b|) over the elements: <= 1 passes. Equal values (infinities too) pass; a NaN on
// either side, or an infinity against anything else, is infinitely wrong (std::max would pass a NaN ratio over).
double worst_error(const Tensor& a, const Tensor& b, double rtol, double atol) {
  std::vector<double> x = values(a), y = values(b);
  REQUIRE(x.size() == y.size());
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double ratio = x[i] == y[i] ? 0 : std::abs(x[i] - y[i]) / (atol + rtol * std::abs(y[i]));
    if (std::isnan(ratio)) return INFINITY;
    worst = std::max(worst, ratio);
  }
  return worst;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------
// SGD

TEST_CASE("plain SGD subtracts lr * grad") {
  Tensor p = tensor(std::vector<double>{1, 2}).requires_grad_();
  optim::SGD opt({p}, {.lr = 0.1});
  step_with(opt, p, {1, -2});
  CHECK(values(p) == std::vector<double>{0.9, 2.2});
}

TEST_CASE("SGD momentum, dampening and weight decay follow PyTorch's update") {
  Tensor p = tensor(std::vector<double>{1.0}).requires_grad_();
  optim::SGD opt({p}, {.lr = 0.1, .momentum = 0.9, .dampening = 0.5, .weight_decay = 0.01});
  step_with(opt, p, {1.0});
  // g = 1 + 0.01*1 = 1.01 ; b = g (first step: no dampening) ; p = 1 - 0.1*1.01 = 0.899
  CHECK(values(p)[0] == doctest::Approx(0.899).epsilon(1e-12));
  step_with(opt, p, {1.0});
  // g = 1 + 0.01*0.899 = 1.00899 ; b = 0.9*1.01 + 0.5*1.00899 = 1.413495 ; p = 0.899 - 0.1413495
  CHECK(values(p)[0] == doctest::Approx(0.899 - 0.1413495).epsilon(1e-12));
}

TEST_CASE("SGD nesterov looks ahead along the momentum") {
  Tensor p = tensor(std::vector<double>{0.0}).requires_grad_();
  optim::SGD opt({p}, {.lr = 1, .momentum = 0.5, .nesterov = true});
  step_with(opt, p, {1.0});  // b = 1 ; g = 1 + 0.5 = 1.5
  CHECK(values(p)[0] == doctest::Approx(-1.5));
  step_with(opt, p, {1.0});  // b = 0.5 + 1 = 1.5 ; g = 1 + 0.75 = 1.75
  CHECK(values(p)[0] == doctest::Approx(-3.25));
}

TEST_CASE("parameter groups keep their own options, parameters without grad are skipped") {
  Tensor a = tensor(std::vector<double>{1.0}).requires_grad_();
  Tensor b = tensor(std::vector<double>{1.0}).requires_grad_();
  Tensor c = tensor(std::vector<double>{1.0}).requires_grad_();
  optim::SGD opt({{{a}, {.lr = 0.1}}, {{b, c}, {.lr = 1.0}}});
  a.set_grad(ones({1}, {.dtype = kFloat64}));
  b.set_grad(ones({1}, {.dtype = kFloat64}));
  opt.step();
  CHECK(values(a)[0] == doctest::Approx(0.9));
  CHECK(values(b)[0] == doctest::Approx(0.0));
  CHECK(values(c)[0] == 1.0);
  opt.zero_grad();
  CHECK_FALSE(a.grad().defined());
}

TEST_CASE("SGD refuses bad options and non-leaf parameters") {
  Tensor p = ones({1}, {.requires_grad = true});
  CHECK_THROWS_WITH_AS(optim::SGD({p}, {.lr = -1}), doctest::Contains("learning rate"), Error);
  CHECK_THROWS_WITH_AS(optim::SGD({p}, {.nesterov = true}), doctest::Contains("nesterov"), Error);
  CHECK_THROWS_WITH_AS(optim::SGD({p * 2}, {}), doctest::Contains("leaves"), Error);
  CHECK_THROWS_WITH_AS(optim::SGD({{{p}, {}}, {{p}, {}}}), doctest::Contains("more than once"), Error);
  Tensor ints = zeros({1}, {.dtype = kInt64});
  CHECK_THROWS_WITH_AS(optim::SGD({ints}, {}), doctest::Contains("floating point"), Error);
}

TEST_CASE("a frozen parameter (requires_grad false) is taken, as PyTorch does, and never moves") {
  nn::Linear layer(2, 2);
  layer.weight.requires_grad_(false);
  const Tensor before = layer.weight.clone();
  optim::SGD opt(layer.parameters(), {.lr = 0.1, .momentum = 0.9});
  const Tensor bias_before = layer.bias.clone();
  layer.forward(ones({3, 2})).sum().backward();
  opt.step();
  CHECK(values(layer.weight) == values(before));
  CHECK(values(layer.bias) != values(bias_before));  // the bias trains
}

TEST_CASE("a few SGD steps fit a linear model") {
  manual_seed(0);
  Tensor x = randn({64, 3}, {.dtype = kFloat64});
  Tensor w_true = tensor(std::vector<double>{1.5, -2, 0.5}, {3, 1});
  Tensor y = x.matmul(w_true);
  Tensor w = zeros({3, 1}, {.dtype = kFloat64, .requires_grad = true});
  optim::SGD opt({w}, {.lr = 0.1, .momentum = 0.5});
  double first = 0, last = 0;
  for (int i = 0; i < 100; ++i) {
    opt.zero_grad();
    Tensor loss = (x.matmul(w) - y).pow(2).mean();
    loss.backward();
    opt.step();
    (i == 0 ? first : last) = loss.item<double>();
  }
  CHECK(last < first * 1e-6);
}

// ---------------------------------------------------------------------------------------------------------
// Adam and AdamW: PyTorch's numbers (see the top of the file) for three steps with gradients
//   [0.5, -1.0], [0.1, 0.3], [-0.2, 0.05] from p = [1, -2], lr 0.1, betas (0.9, 0.999), eps 1e-8.

namespace {
const std::vector<std::vector<double>> kAdamGrads = {{0.5, -1.0}, {0.1, 0.3}, {-0.2, 0.05}};

void check_three_steps(optim::Optimizer& opt, Tensor& p, const std::vector<std::vector<double>>& expected) {
  for (size_t s = 0; s < 3; ++s) {
    CAPTURE(s);
    step_with(opt, p, kAdamGrads[s]);
    check_close(p, expected[s]);
  }
}
}  // namespace

TEST_CASE("Adam matches PyTorch's update: bias correction, eps outside the square root") {
  Tensor p = tensor(std::vector<double>{1.0, -2.0}).requires_grad_();
  optim::Adam opt({p}, {.lr = 0.1});
  // Step 1 by hand: m = 0.1 g, v = 0.001 g^2, so m / (1 - 0.9) = g and sqrt(v / (1 - 0.999)) = |g|:
  // p -= 0.1 * g / (|g| + 1e-8), a step of (almost exactly) lr against the sign of the gradient.
  check_three_steps(opt, p,
                    {{0.900000002, -1.900000001},
                     {0.8196959063846517, -1.8572151424292265},
                     {0.7852605318354889, -1.8272390434646615}});
}

TEST_CASE("Adam's weight decay is an L2 term added to the gradient") {
  Tensor p = tensor(std::vector<double>{1.0, -2.0}).requires_grad_();
  optim::Adam opt({p}, {.lr = 0.1, .weight_decay = 0.1});
  check_three_steps(opt, p,
                    {{0.9000000016666666, -1.9000000008333333},
                     {0.8136483454297575, -1.8400703555381717},
                     {0.7598997572221902, -1.7869615121704383}});
}

TEST_CASE("AdamW decays the weights directly: p *= 1 - lr * weight_decay") {
  Tensor p = tensor(std::vector<double>{1.0, -2.0}).requires_grad_();
  optim::AdamW opt({p}, {.lr = 0.1, .weight_decay = 0.1});
  // Step 1: p = 1 * (1 - 0.01) - 0.1 * 0.5 / (0.5 + 1e-8) = 0.890000002
  check_three_steps(opt, p,
                    {{0.890000002, -1.880000001},
                     {0.8007959063646517, -1.8184151424192265},
                     {0.7583525727518424, -1.7702548920304693}});
}

TEST_CASE("AdamW defaults to weight_decay 1e-2 like PyTorch, Adam to 0") {
  Tensor p = ones({1}, {.requires_grad = true});
  CHECK(optim::AdamW({p}).groups()[0].options.weight_decay == 1e-2);
  CHECK(optim::Adam({p}).groups()[0].options.weight_decay == 0);
}

TEST_CASE("amsgrad divides by the largest second moment seen so far") {
  // Gradients 1, 0.01, 0.01 with betas (0.5, 0.9): v shrinks after the first step, v_max does not, so
  // amsgrad takes the smaller steps.
  const std::vector<std::vector<double>> grads = {{1.0}, {0.01}, {0.01}};
  const std::vector<double> with = {-0.09999999900000002, -0.14686576411110677, -0.17179405268808334};
  const std::vector<double> without = {-0.09999999900000002, -0.14939810871252202, -0.17709295910977105};
  for (bool amsgrad : {true, false}) {
    CAPTURE(amsgrad);
    Tensor p = zeros({1}, {.dtype = kFloat64, .requires_grad = true});
    optim::Adam opt({p}, {.lr = 0.1, .betas = {0.5, 0.9}, .amsgrad = amsgrad});
    for (size_t s = 0; s < 3; ++s) {
      step_with(opt, p, grads[s]);
      check_close(p, {(amsgrad ? with : without)[s]});
    }
  }
}

TEST_CASE("Adam counts steps per parameter: one without a gradient keeps its bias correction") {
  Tensor a = tensor(std::vector<double>{1.0}).requires_grad_();
  Tensor b = tensor(std::vector<double>{1.0}).requires_grad_();
  optim::Adam opt({a, b}, {.lr = 0.1});
  a.set_grad(tensor(std::vector<double>{1.0}));
  opt.step();  // only a steps
  a.set_grad(tensor(std::vector<double>{1.0}));
  b.set_grad(tensor(std::vector<double>{1.0}));
  opt.step();  // a's second step, b's first: b moves by (almost exactly) lr, as a did on its first
  CHECK(opt.state(0, 0).step == 2);
  CHECK(opt.state(0, 1).step == 1);
  CHECK(values(b)[0] == doctest::Approx(1 - 0.1 / (1 + 1e-8)).epsilon(1e-12));
}

TEST_CASE("Adam refuses bad options") {
  Tensor p = ones({1}, {.requires_grad = true});
  CHECK_THROWS_WITH_AS(optim::Adam({p}, {.lr = -1}), doctest::Contains("learning rate"), Error);
  CHECK_THROWS_WITH_AS(optim::Adam({p}, {.betas = {1.0, 0.999}}), doctest::Contains("beta1"), Error);
  CHECK_THROWS_WITH_AS(optim::AdamW({p}, {.betas = {0.9, -0.1}}), doctest::Contains("AdamW: invalid beta2"), Error);
  CHECK_THROWS_WITH_AS(optim::Adam({p}, {.eps = -1}), doctest::Contains("eps"), Error);
  CHECK_THROWS_WITH_AS(optim::AdamW({p}, {.weight_decay = -1}), doctest::Contains("weight_decay"), Error);
}

// ---------------------------------------------------------------------------------------------------------
// RMSprop and Adagrad: PyTorch's numbers for three steps with gradients [1, -0.5], [0.25, 2], [-1.5, 0.125] from
// p = [1, -2] (PyTorch 2.11's torch.optim.RMSprop and Adagrad, foreach=False, float64, 2026-12-06; the same formulas
// in Python floats agree to 2e-16, a last bit apart where momentum is on).

namespace {
template <typename Optimizer, typename Options>
void check_pytorch_steps(const char* what, const Options& options, const std::vector<std::vector<double>>& expected) {
  CAPTURE(what);
  const std::vector<std::vector<double>> grads = {{1.0, -0.5}, {0.25, 2.0}, {-1.5, 0.125}};
  Tensor p = tensor(std::vector<double>{1.0, -2.0}).requires_grad_();
  Optimizer opt({p}, options);
  for (size_t s = 0; s < 3; ++s) {
    CAPTURE(s);
    step_with(opt, p, grads[s]);
    check_close(p, expected[s]);
  }
}
}  // namespace

TEST_CASE("RMSprop matches PyTorch's update: plain, weight decay, momentum, centered, and all of them") {
  // Step 1 by hand: square_avg = 0.01 g^2, so p = 1 - 0.1 * 1 / (0.1 + 1e-8).
  check_pytorch_steps<optim::RMSprop>("defaults but lr", optim::RMSpropOptions{.lr = 0.1},
                                      {{9.99999903994464e-08, -1.0000001999999606},
                                       {-0.24368496566133238, -1.9704281150335092},
                                       {0.583043651391154, -2.0312724743102324}});
  check_pytorch_steps<optim::RMSprop>("weight decay",
                                      optim::RMSpropOptions{.lr = 0.1, .alpha = 0.9, .weight_decay = 0.1},
                                      {{0.6837722430740709, -1.6837722482688757},
                                       {0.5914934135783971, -1.9810633874452659},
                                       {0.8483226676866971, -1.9685653949186221}});
  check_pytorch_steps<optim::RMSprop>("momentum", optim::RMSpropOptions{.lr = 0.1, .alpha = 0.9, .momentum = 0.5},
                                      {{0.6837722439831616, -1.6837722539831608},
                                       {0.44507607216960693, -1.8333506839333211},
                                       {0.5944325888995815, -1.928369388941434}});
  // Step 1: grad_avg = 0.1 g, square_avg = 0.1 g^2: avg = sqrt(0.09) |g|, p = 1 - 0.1 / 0.3.
  check_pytorch_steps<optim::RMSprop>("centered", optim::RMSpropOptions{.lr = 0.1, .alpha = 0.9, .centered = true},
                                      {{0.6666666777777774, -1.6666666888888875},
                                       {0.5799034797396929, -1.9834989882175904},
                                       {0.8495451824923517, -2.0043697918437573}});
  // alpha 0.3: grad_avg's lerp weight 0.7 runs lerp's other form (for these values both forms give the same digits).
  check_pytorch_steps<optim::RMSprop>(
      "all of them",
      optim::RMSpropOptions{
          .lr = 0.1, .alpha = 0.3, .eps = 1e-3, .weight_decay = 0.1, .momentum = 0.5, .centered = true},
      {{0.7822141531097498, -1.7824602677841026},
       {0.5777322073206267, -1.8431795718317447},
       {0.6369966256841713, -1.8661458501456545}});
}

TEST_CASE("RMSprop's state: square_avg, and grad_avg and momentum_buffer once its options need them, kept after") {
  Tensor a = ones({2, 3}, {.requires_grad = true});
  Tensor b = ones({4}, {.requires_grad = true});
  Tensor c = ones({1}, {.requires_grad = true});
  optim::RMSprop opt({{{a}, {.lr = 0.1}}, {{b}, {.momentum = 0.9, .centered = true}}, {{c}, {.momentum = 0.5}}});
  CHECK(optim::RMSprop({a}).groups()[0].options.lr == 1e-2);  // PyTorch's default
  auto state_names = [&] {
    std::vector<std::string> names;
    for (const auto& [name, t] : opt.state_tensors())
      if (name.rfind("state.", 0) == 0) names.push_back(name);
    return names;
  };
  auto step = [&] {
    a.set_grad(ones({2, 3}));
    b.set_grad(ones({4}));
    c.set_grad(ones({1}));
    opt.step();
  };
  step();
  CHECK(state_names() == std::vector<std::string>{"state.0.0.step", "state.0.0.square_avg", "state.1.0.step",
                                                  "state.1.0.square_avg", "state.1.0.grad_avg",
                                                  "state.1.0.momentum_buffer", "state.2.0.step",
                                                  "state.2.0.square_avg", "state.2.0.momentum_buffer"});
  // Options turned on after a step start their buffers from zeros, as a first step does; turned off, the buffers
  // stay (in the state too) for when they come back.
  opt.groups()[0].options.momentum = 0.9;
  opt.groups()[0].options.centered = true;
  opt.groups()[1].options.momentum = 0;
  opt.groups()[1].options.centered = false;
  step();
  CHECK(state_names() == std::vector<std::string>{"state.0.0.step", "state.0.0.square_avg", "state.0.0.grad_avg",
                                                  "state.0.0.momentum_buffer", "state.1.0.step",
                                                  "state.1.0.square_avg", "state.1.0.grad_avg",
                                                  "state.1.0.momentum_buffer", "state.2.0.step",
                                                  "state.2.0.square_avg", "state.2.0.momentum_buffer"});
  CHECK(opt.state(0, 0).step == 2);
  // Group 0's second step was its first with momentum and centered: b = g / avg from zeros, grad_avg = 0.01 g.
  CHECK(values(opt.state(0, 0).buffers[1])[0] == doctest::Approx(0.01).epsilon(1e-6));  // float32
}

TEST_CASE("RMSprop refuses bad options, a checkpoint of other options loads them, as PyTorch's load_state_dict") {
  Tensor p = ones({1}, {.requires_grad = true});
  CHECK_THROWS_WITH_AS(optim::RMSprop({p}, {.lr = -1}), doctest::Contains("RMSprop: invalid learning rate"), Error);
  CHECK_THROWS_WITH_AS(optim::RMSprop({p}, {.alpha = 1.5}), doctest::Contains("alpha"), Error);
  CHECK_THROWS_WITH_AS(optim::RMSprop({p}, {.eps = -1}), doctest::Contains("eps"), Error);
  CHECK_THROWS_WITH_AS(optim::RMSprop({p}, {.weight_decay = -1}), doctest::Contains("weight_decay"), Error);
  CHECK_THROWS_WITH_AS(optim::RMSprop({p}, {.momentum = -0.5}), doctest::Contains("momentum"), Error);
  auto grad_of = [](const Tensor& t, int s) {
    NoGradGuard no_grad;
    return (t * 0.3 + double(s) * 0.1 - 0.5).tanh();
  };
  // Saved from a centered run with momentum, loaded into one made plain: it goes on as the saved one would have.
  Tensor x = tensor(std::vector<double>{0.5, -1.0}).requires_grad_();
  optim::RMSprop saved({x}, {.lr = 0.01, .momentum = 0.9, .centered = true});
  for (int s = 0; s < 2; ++s) {
    x.set_grad(grad_of(x, s));
    saved.step();
  }
  Tensor y = x.detach().clone().requires_grad_();
  optim::RMSprop plain({y}, {.lr = 0.01});
  plain.load_state_tensors(saved.state_tensors());
  CHECK(plain.groups()[0].options.centered);
  CHECK(plain.groups()[0].options.momentum == 0.9);
  for (int s = 2; s < 4; ++s) {
    x.set_grad(grad_of(x, s));
    y.set_grad(grad_of(y, s));
    saved.step();
    plain.step();
  }
  CHECK(bit_equal(x, y));
  // A file whose parameter has grad_avg but not square_avg is refused, naming both.
  NamedTensors partial;
  for (const auto& [name, t] : saved.state_tensors())
    if (name != "state.0.0.square_avg") partial.emplace_back(name, t);
  CHECK_THROWS_WITH_AS(plain.load_state_tensors(partial),
                       doctest::Contains("has step, grad_avg, momentum_buffer but not square_avg"), Error);
}

TEST_CASE("Adagrad matches PyTorch's update: the lr decayed by each parameter's steps, the sum's initial value") {
  // Step 1 by hand: sum = g^2, so p = 1 - 0.1 * 1 / (1 + 1e-10).
  check_pytorch_steps<optim::Adagrad>("defaults but lr", optim::AdagradOptions{.lr = 0.1},
                                      {{0.90000000001, -1.90000000002},
                                       {0.8757464375087196, -1.9970142500298271},
                                       {0.9581627758734047, -2.003066525356222}});
  check_pytorch_steps<optim::Adagrad>(
      "lr_decay, weight decay, initial sum, eps",
      optim::AdagradOptions{.lr = 0.1, .lr_decay = 0.5, .weight_decay = 0.1, .initial_accumulator_value = 0.25,
                            .eps = 1e-3},
      {{0.9090386324171864, -1.9187211376376205},
       {0.8909507764301531, -1.9788918752072437},
       {0.928283900393737, -1.9770738782517308}});
}

TEST_CASE("Adagrad has no momentum: its state has none, loading one is refused, OneCycleLR must not cycle it") {
  Tensor p = ones({2}, {.requires_grad = true});
  CHECK_THROWS_WITH_AS(optim::Adagrad({p}, {.lr_decay = -1}), doctest::Contains("Adagrad: invalid lr_decay"), Error);
  CHECK_THROWS_WITH_AS(optim::Adagrad({p}, {.initial_accumulator_value = -1}),
                       doctest::Contains("initial_accumulator_value"), Error);
  optim::Adagrad opt({p}, {.lr = 0.1, .initial_accumulator_value = 0.5});
  p.set_grad(ones({2}));
  opt.step();
  std::vector<std::string> names;
  for (const auto& [name, t] : opt.state_tensors()) names.push_back(name);
  CHECK(names == std::vector<std::string>{"param_groups.0.lr", "param_groups.0.lr_decay", "param_groups.0.weight_decay",
                                          "param_groups.0.initial_accumulator_value", "param_groups.0.eps",
                                          "param_groups.0.with_state", "param_groups.0.num_params", "state.0.0.step",
                                          "state.0.0.sum"});
  CHECK(values(opt.state_tensors().back().second) == std::vector<double>{1.5, 1.5});  // 0.5 + 1^2
  NamedTensors with_momentum = opt.state_tensors();
  with_momentum.emplace_back("param_groups.0.momentum", scalar_tensor(0.9, {.dtype = kFloat64}));
  CHECK_THROWS_WITH_AS(opt.load_state_tensors(with_momentum),
                       doctest::Contains("unexpected entry 'param_groups.0.momentum': Adagrad has no momentum"), Error);
  CHECK_THROWS_WITH_AS(optim::OneCycleLR(opt, {.max_lr = {0.1}, .total_steps = 10}),
                       doctest::Contains("OneCycleLR: it sets the momentum, and Adagrad has none"), Error);
  CHECK(opt.groups()[0].options.lr == 0.1);  // the refused scheduler changed nothing
  optim::OneCycleLR cycle(opt, {.max_lr = {0.1}, .total_steps = 10, .cycle_momentum = false});
  CHECK(opt.groups()[0].options.lr == doctest::Approx(0.1 / 25));
}

// ---------------------------------------------------------------------------------------------------------
// The fused CPU kernels on many elements (several chunks and threads) and on 16-bit floats

namespace {
// Reference: one Adam step per element in double, written out as in the PyTorch docs.
void adam_reference(std::vector<double>& p, const std::vector<double>& g, std::vector<double>& m,
                    std::vector<double>& v, int t, double lr, double b1, double b2, double eps, double wd, bool decoupled) {
  for (size_t i = 0; i < p.size(); ++i) {
    double grad = g[i];
    if (decoupled)
      p[i] *= 1 - lr * wd;
    else
      grad += wd * p[i];
    m[i] = b1 * m[i] + (1 - b1) * grad;
    v[i] = b2 * v[i] + (1 - b2) * grad * grad;
    double m_hat = m[i] / (1 - std::pow(b1, t));
    double v_hat_sqrt = std::sqrt(v[i]) / std::sqrt(1 - std::pow(b2, t));
    p[i] -= lr * m_hat / (v_hat_sqrt + eps);
  }
}
}  // namespace

TEST_CASE("fused AdamW on large tensors (float32, float16, bfloat16) matches a per-element reference") {
  // 300k elements in two tensors: many 16k-element chunks, run by several OpenMP threads.
  manual_seed(1);
  const Shape shapes[] = {{300, 1000}, {7}};
  for (DType dt : {kFloat32, kFloat16, kBFloat16}) {
    CAPTURE(std::string(dtype_name(dt)));
    TensorList params;
    std::vector<std::vector<double>> p_ref, m_ref, v_ref;
    for (const Shape& s : shapes) {
      Tensor p = randn(s).to(dt).requires_grad_();
      params.push_back(p);
      p_ref.push_back(values(p));
      m_ref.emplace_back(p.numel(), 0.0);
      v_ref.emplace_back(p.numel(), 0.0);
    }
    optim::AdamW opt(params, {.lr = 1e-2, .weight_decay = 0.05});
    for (int t = 1; t <= 3; ++t) {
      for (size_t i = 0; i < params.size(); ++i) {
        // |g| in [0.5, 1.5): (1 - beta2) g^2 stays a normal float16 (a subnormal second moment loses its
        // precision, and the step with it: why float16 parameters want float32 master weights).
        Tensor u = rand(params[i].shape());
        Tensor g = ((u + 0.5) * (randn(params[i].shape()).sign())).to(dt);
        params[i].set_grad(g);
        adam_reference(p_ref[i], values(g), m_ref[i], v_ref[i], t, 1e-2, 0.9, 0.999, 1e-8, 0.05, true);
      }
      opt.step();
    }
    // float32: a few ulp of the parameter per step. 16-bit: p is rounded to the storage type every step
    // (half an ulp: 2^-11 relative for float16, 2^-8 for bfloat16), three steps make 1.5 ulp; m and v are
    // rounded too, which moves each step (~lr) by a relative ulp, far below that.
    const double rtol = dt == kFloat32 ? 1e-6 : dt == kFloat16 ? 3e-3 : 2.4e-2;
    for (size_t i = 0; i < params.size(); ++i) {
      Tensor ref = tensor(p_ref[i], params[i].shape());
      CHECK(worst_error(params[i], ref, rtol, 1e-4) <= 1);
    }
  }
}

TEST_CASE("SGD with momentum on a large tensor: the fused loop matches PyTorch's chain of ops") {
  manual_seed(2);
  Tensor p = randn({200000}).requires_grad_();
  Tensor p_ref = p.detach().clone().to(kFloat64);
  Tensor buf;
  optim::SGD opt({p}, {.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3, .nesterov = true});
  for (int s = 0; s < 3; ++s) {
    Tensor g = randn({200000});
    p.set_grad(g);
    opt.step();
    // torch.optim.SGD, written with tensor ops in float64
    Tensor g64 = g.to(kFloat64) + p_ref * 1e-3;
    buf = buf.defined() ? buf * 0.9 + g64 : g64;
    p_ref = p_ref - (g64 + buf * 0.9) * 0.05;
  }
  CHECK(worst_error(p, p_ref, 1e-6, 1e-6) <= 1);
}

TEST_CASE("a non-contiguous parameter is updated through a contiguous copy and written back") {
  Tensor p = tensor(std::vector<double>{1, 2, 3, 4, 5, 6}, {2, 3}).t().requires_grad_();  // [3, 2], strided
  REQUIRE_FALSE(p.is_contiguous());
  optim::SGD opt({p}, {.lr = 1});
  p.set_grad(ones({3, 2}, {.dtype = kFloat64}));
  opt.step();
  CHECK(values(p) == std::vector<double>{0, 3, 1, 4, 2, 5});
  CHECK_FALSE(p.is_contiguous());
}

TEST_CASE("a channels_last parameter is updated where it is, element for element as the NCHW one, its state NHWC") {
  auto check = [](auto make_optimizer) {
    manual_seed(4);
    const Tensor start = randn({3, 5, 2, 4}, {.dtype = kFloat64});
    Tensor nchw = start.clone().requires_grad_();
    Tensor nhwc = contiguous_channels_last(start).requires_grad_();
    REQUIRE((is_channels_last(nhwc) && !nhwc.is_contiguous()));
    auto opt_nchw = make_optimizer(nchw), opt_nhwc = make_optimizer(nhwc);
    for (int s = 0; s < 4; ++s) {
      const Tensor g = randn({3, 5, 2, 4}, {.dtype = kFloat64});
      nchw.set_grad(g);
      nhwc.set_grad(s % 2 == 0 ? contiguous_channels_last(g) : g);  // a gradient in either layout
      opt_nchw.step();
      opt_nhwc.step();
      CHECK(bit_equal(nhwc, nchw));
    }
    CHECK((is_channels_last(nhwc) && !nhwc.is_contiguous()));
    const NamedTensors a = opt_nchw.state_tensors(), b = opt_nhwc.state_tensors();
    REQUIRE(a.size() == b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      CAPTURE(b[i].first);
      CHECK(bit_equal(b[i].second, a[i].second));
      if (b[i].second.dim() == 4) CHECK((is_channels_last(b[i].second) && !b[i].second.is_contiguous()));
    }
  };
  SUBCASE("SGD with momentum, weight decay and nesterov") {
    check([](Tensor& p) {
      return optim::SGD({p}, {.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-2, .nesterov = true});
    });
  }
  SUBCASE("Adam with amsgrad") { check([](Tensor& p) { return optim::Adam({p}, {.lr = 0.01, .amsgrad = true}); }); }
}

TEST_CASE("an aligned-rows parameter is updated where it is, as the contiguous one, its state aligned, padding zero") {
  auto check = [](auto make_optimizer) {
    manual_seed(14);
    const Tensor start = randn({5, 7}, {.dtype = kFloat64});
    Tensor dense = start.clone().requires_grad_();
    Tensor aligned = contiguous_aligned_rows(start).requires_grad_();
    REQUIRE(is_aligned_rows(aligned));
    const std::shared_ptr<Storage> storage = aligned.storage();
    auto opt_dense = make_optimizer(dense), opt_aligned = make_optimizer(aligned);
    for (int s = 0; s < 4; ++s) {
      const Tensor g = randn({5, 7}, {.dtype = kFloat64});
      dense.set_grad(g);
      aligned.set_grad(s % 2 == 0 ? contiguous_aligned_rows(g) : g);  // a gradient in either layout
      opt_dense.step();
      opt_aligned.step();
      CHECK(bit_equal(aligned, dense));
    }
    CHECK(is_aligned_rows(aligned));
    CHECK(aligned.storage() == storage);  // updated in place
    CHECK(aligned_padding(aligned) == std::vector<double>(6 * 8 - 35, 0.0));
    const NamedTensors a = opt_dense.state_tensors(), b = opt_aligned.state_tensors();
    REQUIRE(a.size() == b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      CAPTURE(b[i].first);
      CHECK(bit_equal(b[i].second, a[i].second));
      if (b[i].second.dim() == 2) {
        CHECK(is_aligned_rows(b[i].second));
        CHECK(aligned_padding(b[i].second) == std::vector<double>(6 * 8 - 35, 0.0));
      }
    }
  };
  SUBCASE("SGD with momentum, weight decay and nesterov") {
    check([](Tensor& p) {
      return optim::SGD({p}, {.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-2, .nesterov = true});
    });
  }
  SUBCASE("Adam with amsgrad and weight decay") {
    check([](Tensor& p) { return optim::Adam({p}, {.lr = 0.01, .weight_decay = 1e-2, .amsgrad = true}); });
  }
  SUBCASE("RMSprop centered with momentum") {
    check([](Tensor& p) { return optim::RMSprop({p}, {.lr = 0.01, .momentum = 0.9, .centered = true}); });
  }
  SUBCASE("Adagrad whose sum starts at 0.5: the padding stays zero") {
    check([](Tensor& p) { return optim::Adagrad({p}, {.lr = 0.1, .initial_accumulator_value = 0.5}); });
  }
}

TEST_CASE("clip_grad_norm_ and unscale_ read and scale aligned-rows gradients in place, the padding left at zero") {
  manual_seed(15);
  const Tensor g = randn({9, 3}, {.dtype = kFloat64});
  Tensor dense = zeros({9, 3}, {.dtype = kFloat64, .requires_grad = true});
  Tensor aligned = contiguous_aligned_rows(zeros({9, 3}, {.dtype = kFloat64})).requires_grad_();
  dense.set_grad(g.clone());
  aligned.set_grad(contiguous_aligned_rows(g));
  const Tensor aligned_grad = aligned.grad();
  CHECK(optim::clip_grad_norm_({aligned}, 1.0).item<double>() == optim::clip_grad_norm_({dense}, 1.0).item<double>());
  CHECK(aligned.grad().same(aligned_grad));
  CHECK(bit_equal(aligned.grad(), dense.grad()));
  CHECK(aligned_padding(aligned.grad()) == std::vector<double>(10 * 4 - 27, 0.0));

  Tensor w = contiguous_aligned_rows(ones({3, 5})).requires_grad_();
  optim::SGD opt({w}, {.lr = 0.5});
  amp::GradScaler scaler({.init_scale = 8});
  scaler.scale((w * w).sum()).backward();
  REQUIRE(is_aligned_rows(w.grad()));
  scaler.unscale_(opt);
  CHECK(values(w.grad()) == std::vector<double>(15, 2.0));
  scaler.step(opt);
  scaler.update();
  CHECK(values(w) == std::vector<double>(15, 0.0));
  CHECK(is_aligned_rows(w));
  CHECK(aligned_padding(w) == std::vector<double>(4 * 8 - 15, 0.0));
}

TEST_CASE("optimizer state saved from an NCHW parameter goes on, laid out again, on a channels_last one") {
  manual_seed(5);
  Tensor nchw = randn({4, 3, 3, 3}, {.dtype = kFloat64}).requires_grad_();
  optim::SGD opt({nchw}, {.lr = 0.1, .momentum = 0.9});
  std::vector<Tensor> grads;
  for (int s = 0; s < 3; ++s) grads.push_back(randn({4, 3, 3, 3}, {.dtype = kFloat64}));
  nchw.set_grad(grads[0]);
  opt.step();
  NamedTensors saved;
  for (const auto& [name, t] : opt.state_tensors()) saved.emplace_back(name, t.clone());  // NCHW buffers

  Tensor nhwc = contiguous_channels_last(nchw.detach()).requires_grad_();
  optim::SGD resumed({nhwc}, {.lr = 0.1, .momentum = 0.9});
  resumed.load_state_tensors(saved);
  for (int s = 1; s < 3; ++s) {
    nchw.set_grad(grads[s]);
    nhwc.set_grad(grads[s]);
    opt.step();
    resumed.step();
  }
  CHECK(bit_equal(nhwc, nchw));
  for (const auto& [name, t] : resumed.state_tensors())
    if (t.dim() == 4) CHECK_MESSAGE(is_channels_last(t), name);
}

TEST_CASE("clip_grad_norm_ and unscale_ read and scale channels_last gradients in place") {
  manual_seed(6);
  const Tensor g = randn({2, 3, 4, 5}, {.dtype = kFloat64});
  Tensor nchw = zeros({2, 3, 4, 5}, {.dtype = kFloat64, .requires_grad = true});
  Tensor nhwc = contiguous_channels_last(zeros({2, 3, 4, 5}, {.dtype = kFloat64})).requires_grad_();
  nchw.set_grad(g.clone());
  nhwc.set_grad(contiguous_channels_last(g));
  const Tensor nhwc_grad = nhwc.grad();
  CHECK(optim::clip_grad_norm_({nhwc}, 1.0).item<double>() == optim::clip_grad_norm_({nchw}, 1.0).item<double>());
  CHECK(nhwc.grad().same(nhwc_grad));  // scaled where it is
  CHECK(is_channels_last(nhwc.grad()));
  CHECK(bit_equal(nhwc.grad(), nchw.grad()));

  Tensor w = contiguous_channels_last(ones({2, 3, 2, 2})).requires_grad_();
  optim::SGD opt({w}, {.lr = 0.5});
  amp::GradScaler scaler({.init_scale = 8});
  scaler.scale((w * w).sum()).backward();
  REQUIRE(is_channels_last(w.grad()));
  scaler.unscale_(opt);
  CHECK(values(w.grad()) == std::vector<double>(24, 2.0));  // d(w^2)/dw = 2, the scale of 8 divided out
  scaler.step(opt);
  scaler.update();
  CHECK(values(w) == std::vector<double>(24, 0.0));
  CHECK(is_channels_last(w));
}

TEST_CASE("a step bumps the parameter's version: a graph that saved the old value refuses to use it") {
  Tensor w = ones({2}, {.dtype = kFloat64, .requires_grad = true});
  Tensor y = (w * w).sum();  // saves w
  optim::SGD opt({w}, {.lr = 0.1});
  w.set_grad(ones({2}, {.dtype = kFloat64}));
  opt.step();
  CHECK_THROWS_AS(y.backward(), Error);
}

// ---------------------------------------------------------------------------------------------------------
// Generic access: what schedulers and amp::initialize use

TEST_CASE("param_groups() reads and writes each group's lr and momentum (Adam: beta1, Adagrad: none)") {
  Tensor a = ones({1}, {.requires_grad = true});
  Tensor b = ones({1}, {.requires_grad = true});
  optim::Adam adam({{{a}, {.lr = 0.1}}, {{b}, {.lr = 0.2, .betas = {0.8, 0.99}}}});
  optim::Optimizer& opt = adam;
  REQUIRE(opt.num_param_groups() == 2);
  CHECK(opt.param_group(1).lr == 0.2);
  CHECK(opt.param_group(1).momentum == 0.8);
  for (optim::ParamGroupRef g : opt.param_groups()) {
    g.lr *= 10;
    g.momentum = 0.85;
  }
  CHECK(adam.groups()[0].options.lr == doctest::Approx(1.0));
  CHECK(adam.groups()[1].options.betas == std::pair<double, double>{0.85, 0.99});
  CHECK_THROWS_WITH_AS(opt.param_group(2), doctest::Contains("no parameter group 2"), Error);

  optim::SGD sgd({a}, {.lr = 0.1, .momentum = 0.9});
  sgd.param_group(0).momentum = 0;
  CHECK(sgd.groups()[0].options.momentum == 0);
  // One group's momentum assigned from another's writes the value (and through a const reference, as lr).
  optim::SGD two({{{a}, {.momentum = 0.9}}, {{b}, {.momentum = 0.5}}});
  const optim::ParamGroupRef first = two.param_group(0), second = two.param_group(1);
  first.momentum = second.momentum;
  first.momentum = 0.7;
  CHECK(two.groups()[0].options.momentum == 0.7);
  CHECK(two.groups()[1].options.momentum == 0.5);

  optim::Adagrad adagrad({a}, {.lr = 0.1});
  CHECK_FALSE(adagrad.param_group(0).momentum.exists());
  CHECK_THROWS_WITH_AS(adagrad.param_group(0).momentum = 0.9, doctest::Contains("Adagrad has no momentum"), Error);
  CHECK_THROWS_WITH_AS((void)double(adagrad.param_group(0).momentum), doctest::Contains("Adagrad has no momentum"),
                       Error);
  adagrad.param_group(0).lr = 0.3;
  CHECK(adagrad.groups()[0].options.lr == 0.3);
}

TEST_CASE("add_param_group checks a new group as the constructor does, an empty parameter list is refused") {
  Tensor a = ones({1}, {.requires_grad = true}), b = ones({1}, {.requires_grad = true});
  optim::SGD sgd({a}, {.lr = 0.5});
  CHECK_THROWS_WITH_AS(sgd.add_param_group({{a, b}, {.lr = 0.1}}),
                       doctest::Contains("SGD: a parameter appears more than once (group 1, parameter 0"), Error);
  CHECK_THROWS_WITH_AS(sgd.add_param_group({{b}, {.lr = -1}}),
                       doctest::Contains("SGD: invalid learning rate -1 (group 1)"), Error);
  CHECK(sgd.num_param_groups() == 1);  // a refused group leaves the optimizer as it was
  sgd.add_param_group({{b}, {.lr = 1}});
  REQUIRE(sgd.num_param_groups() == 2);
  a.set_grad(ones({1}));
  b.set_grad(ones({1}));
  sgd.step();
  CHECK(values(a) == std::vector<double>{0.5});
  CHECK(values(b) == std::vector<double>{0});
  optim::Adam adam({a});
  CHECK_THROWS_WITH_AS(adam.add_param_group({{b}, {.betas = {1.5, 0.999}}}),
                       doctest::Contains("Adam: invalid beta1 1.5 (group 1)"), Error);

  // As PyTorch's "optimizer got an empty parameter list": an optimizer of nothing steps without a word.
  CHECK_THROWS_WITH_AS(optim::SGD(TensorList{}, {.lr = 1}), doctest::Contains("SGD: got an empty parameter list"),
                       Error);
  CHECK_THROWS_WITH_AS(optim::Adam(std::vector<optim::AdamGroup>{}), doctest::Contains("Adam: got an empty parameter "
                                                                                       "list (0 groups"), Error);
  CHECK_THROWS_WITH_AS(optim::AdamW(std::vector<optim::AdamWGroup>{{{}, {}}}), doctest::Contains("empty parameter"),
                       Error);
}

TEST_CASE("parameters replaced before the first step are the ones updated (amp's FP32 master weights)") {
  // The model runs in float16; the optimizer was built on it, then gets float32 masters.
  Tensor half_weight = ones({3}, {.dtype = kFloat16, .requires_grad = true});
  optim::SGD opt({half_weight}, {.lr = 0.5, .momentum = 0.9});
  Tensor master = half_weight.detach().to(kFloat32).requires_grad_();
  opt.param_group(0).params[0] = master;
  master.set_grad(full({3}, 0.25));
  opt.step();
  CHECK(values(master) == std::vector<double>{0.875, 0.875, 0.875});
  CHECK(values(half_weight) == std::vector<double>{1, 1, 1});
  CHECK(opt.state(0, 0).buffers[0].dtype() == kFloat32);
  CHECK(opt.parameters()[0].same(master));

  // Replacing it after the first step by a tensor of another shape is an error that says what happened.
  Tensor other = ones({4}, {.requires_grad = true});
  other.set_grad(ones({4}));
  opt.param_group(0).params[0] = other;
  CHECK_THROWS_WITH_AS(opt.step(), doctest::Contains("replaced after the optimizer's first step"), Error);
}

// ---------------------------------------------------------------------------------------------------------
// State for checkpoints

TEST_CASE("Adam's state has stable names: groups' options, step, exp_avg, exp_avg_sq") {
  Tensor a = ones({2, 3}, {.requires_grad = true});
  Tensor b = ones({4}, {.requires_grad = true});
  Tensor c = ones({1}, {.requires_grad = true});
  optim::Adam opt({{{a, b}, {.lr = 0.1}}, {{c}, {.lr = 0.2, .amsgrad = true}}});
  a.set_grad(ones({2, 3}));
  c.set_grad(ones({1}));
  opt.step();  // b has no gradient: no state
  std::vector<std::string> names;
  for (const auto& [name, t] : opt.state_tensors()) names.push_back(name);
  CHECK(names == std::vector<std::string>{"param_groups.0.lr", "param_groups.0.momentum", "param_groups.0.beta2",
                                          "param_groups.0.eps", "param_groups.0.weight_decay", "param_groups.0.amsgrad",
                                          "param_groups.0.with_state", "param_groups.0.num_params",
                                          "param_groups.1.lr", "param_groups.1.momentum", "param_groups.1.beta2",
                                          "param_groups.1.eps", "param_groups.1.weight_decay", "param_groups.1.amsgrad",
                                          "param_groups.1.with_state", "param_groups.1.num_params",
                                          "state.0.0.step", "state.0.0.exp_avg", "state.0.0.exp_avg_sq",
                                          "state.1.0.step", "state.1.0.exp_avg", "state.1.0.exp_avg_sq",
                                          "state.1.0.max_exp_avg_sq"});
  NamedTensors state = opt.state_tensors();
  CHECK(to_vector<int64_t>(state[6].second) == std::vector<int64_t>{0});  // a, not b: b had no gradient
  CHECK(state[7].second.item<int64_t>() == 2);                            // group 0 has a and b
  CHECK(to_vector<int64_t>(state[14].second) == std::vector<int64_t>{0});
  CHECK(state[15].second.item<int64_t>() == 1);
  CHECK(state[16].second.dim() == 0);
  CHECK(state[16].second.dtype() == kInt64);
  CHECK(state[16].second.item<int64_t>() == 1);
  CHECK(state[17].second.shape() == Shape{2, 3});
  CHECK(state[0].second.dim() == 0);
  CHECK(state[0].second.item<double>() == 0.1);
  CHECK(state[2].second.item<double>() == 0.999);  // beta2
  CHECK(state[13].second.dtype() == kBool);         // group 1's amsgrad
  CHECK(state[13].second.item<bool>());
}

TEST_CASE("continuing from loaded state gives exactly the results of uninterrupted training") {
  auto grad_of = [](const Tensor& p, int s) {
    NoGradGuard no_grad;
    return (p * 0.3 + double(s) * 0.1 - 0.5).tanh();
  };
  auto make_param = [] {
    manual_seed(3);
    return randn({5, 7}).requires_grad_();
  };
  auto check = [&](auto make_optimizer) {
    // Uninterrupted: 6 steps.
    Tensor p1 = make_param();
    auto opt1 = make_optimizer(p1);
    for (int s = 0; s < 6; ++s) {
      p1.set_grad(grad_of(p1, s));
      opt1.step();
    }
    // Interrupted after 3 steps: the state and the parameter go to a "checkpoint" (copies), a fresh
    // optimizer loads it, and training goes on.
    Tensor p2 = make_param();
    auto opt2 = make_optimizer(p2);
    for (int s = 0; s < 3; ++s) {
      p2.set_grad(grad_of(p2, s));
      opt2.step();
    }
    NamedTensors checkpoint;
    for (const auto& [name, t] : opt2.state_tensors()) checkpoint.emplace_back(name, t.clone());
    Tensor saved_param = p2.detach().clone();

    Tensor p3 = saved_param.clone().requires_grad_();
    auto opt3 = make_optimizer(p3);
    opt3.load_state_tensors(checkpoint);
    for (int s = 3; s < 6; ++s) {
      p3.set_grad(grad_of(p3, s));
      opt3.step();
    }
    CHECK(bit_equal(p1, p3));
  };
  SUBCASE("SGD with nesterov momentum") {
    check([](Tensor& p) { return optim::SGD({p}, {.lr = 0.1, .momentum = 0.9, .nesterov = true}); });
  }
  SUBCASE("Adam with amsgrad") { check([](Tensor& p) { return optim::Adam({p}, {.lr = 0.01, .amsgrad = true}); }); }
  SUBCASE("AdamW") { check([](Tensor& p) { return optim::AdamW({p}, {.lr = 0.01}); }); }
  SUBCASE("Adagrad with lr decay") {
    check([](Tensor& p) {
      return optim::Adagrad({p}, {.lr = 0.1, .lr_decay = 0.1, .initial_accumulator_value = 0.1});
    });
  }
  SUBCASE("RMSprop, centered with momentum") {
    check([](Tensor& p) { return optim::RMSprop({p}, {.lr = 0.01, .momentum = 0.9, .centered = true}); });
  }
}

TEST_CASE("loaded state is copied: later steps do not write into the caller's tensors") {
  Tensor p = ones({2}, {.requires_grad = true});
  optim::SGD opt({p}, {.lr = 0.1, .momentum = 0.9});
  Tensor buffer = full({2}, 3.0);
  opt.load_state_tensors({{"param_groups.0.lr", scalar_tensor(0.2, {.dtype = kFloat64})},
                          {"param_groups.0.momentum", scalar_tensor(0.9, {.dtype = kFloat64})},
                          {"state.0.0.momentum_buffer", buffer}});
  CHECK(opt.groups()[0].options.lr == 0.2);
  p.set_grad(ones({2}));
  opt.step();  // b = 0.9 * 3 + 1 = 3.7 ; p = 1 - 0.2 * 3.7 = 0.26
  CHECK(values(buffer) == std::vector<double>{3, 3});
  CHECK(values(p)[0] == doctest::Approx(0.26).epsilon(1e-6));
}

TEST_CASE("a step that fails its checks changes nothing: no group stepped, no count raised, no buffer made") {
  Tensor a = ones({2}, {.requires_grad = true}), b = ones({3}, {.requires_grad = true});
  SUBCASE("Adam: b replaced by a tensor of another shape after a step") {
    optim::Adam opt({a, b}, {.lr = 0.1});
    a.set_grad(ones({2}));
    b.set_grad(ones({3}));
    opt.step();
    const std::vector<double> a_after_one = values(a);
    Tensor other = ones({4}, {.requires_grad = true});
    other.set_grad(ones({4}));
    opt.param_groups()[0].params[1] = other;
    CHECK_THROWS_WITH_AS(opt.step(), doctest::Contains("the exp_avg of parameter 1 of group 0 is float32[3]"), Error);
    CHECK(values(a) == a_after_one);
    CHECK(opt.state(0, 0).step == 1);  // not 2: a later bias correction would be off
  }
  SUBCASE("SGD with momentum: group 1's parameter replaced by one of another shape") {
    optim::SGD opt({{{a}, {.lr = 0.1, .momentum = 0.9, .dampening = 0.5}}, {{b}, {.lr = 0.1, .momentum = 0.9}}});
    b.set_grad(ones({3}));
    opt.step();  // b's momentum buffer made; a has no gradient yet
    Tensor other = ones({4}, {.requires_grad = true});
    other.set_grad(ones({4}));
    opt.param_groups()[1].params[0] = other;
    a.set_grad(ones({2}));
    CHECK_THROWS_WITH_AS(opt.step(), doctest::Contains("the momentum_buffer of parameter 0 of group 1 is float32[3]"),
                         Error);
    CHECK(values(a) == std::vector<double>{1, 1});
    CHECK(opt.state(0, 0).buffers.empty());  // no momentum buffer: the first real step takes b = g, as PyTorch
    opt.param_groups()[1].params[0] = b;
    opt.step();
    CHECK(values(a)[0] == doctest::Approx(0.9));  // 1 - 0.1 * g, undamped on the first step
  }
}

TEST_CASE("step_scaled refuses a bad overflow flag before it scales the gradients") {
  Tensor a = ones({2}, {.requires_grad = true});
  optim::Adam opt({a}, {.lr = 0.1});
  a.set_grad(full({2}, 4.0));
  CHECK_THROWS_WITH_AS(opt.step_scaled(zeros({}, {.dtype = kFloat64}), full({}, 0.5)),
                       doctest::Contains("found_inf must be a float32 0-d tensor"), Error);
  CHECK(values(a.grad()) == std::vector<double>{4, 4});  // not scaled: a retry scales once
}

TEST_CASE("an optimizer state of groups of other sizes is refused, as PyTorch's") {
  Tensor a = ones({2}, {.requires_grad = true}), b = ones({3}, {.requires_grad = true}), c = ones({2}, {.requires_grad = true});
  optim::Adam two({a, b}, {.lr = 0.1});
  a.set_grad(ones({2}));
  two.step();  // only a has state
  optim::Adam one({c}, {.lr = 0.1});
  CHECK_THROWS_WITH_AS(one.load_state_tensors(two.state_tensors()),
                       doctest::Contains("'param_groups.0.num_params' says group 0 had 2 parameter(s), but the "
                                         "optimizer's group 0 has 1"), Error);
  CHECK(one.state_tensors().size() == 8);  // nothing loaded
}

TEST_CASE("loading state reports every mismatch at once and changes nothing") {
  Tensor a = ones({2, 3}, {.requires_grad = true});
  Tensor b = ones({4}, {.requires_grad = true});
  optim::Adam opt({a, b}, {.lr = 0.1});
  NamedTensors bad = {
      {"param_groups.0.lr", scalar_tensor(0.5, {.dtype = kFloat64})},
      // missing: param_groups.0.momentum
      {"state.0.0.step", scalar_tensor(int64_t(4), {.dtype = kInt64})},
      {"state.0.0.exp_avg", zeros({3, 2})},                 // wrong shape
      {"state.0.0.exp_avg_sq", zeros({2, 3}, {.dtype = kFloat64})},  // wrong dtype
      {"state.0.1.exp_avg", zeros({4})},                    // exp_avg_sq and step missing
      {"state.0.7.exp_avg", zeros({4})},                    // no parameter 7
      {"state.3.0.exp_avg", zeros({4})},                    // no group 3
      {"state.0.1.momentum_buffer", zeros({4})},            // not Adam's
      {"model.weight", zeros({4})},                         // not an optimizer entry
  };
  try {
    opt.load_state_tensors(bad);
    FAIL("expected an error");
  } catch (const Error& e) {
    const std::string msg = e.what();
    CAPTURE(msg);
    CHECK(msg.find("Adam: cannot load the optimizer state (9 problems)") != std::string::npos);
    CHECK(msg.find("missing 'param_groups.0.momentum'") != std::string::npos);
    CHECK(msg.find("'state.0.0.exp_avg' is float32[3, 2] cpu but parameter 0 of group 0 is float32[2, 3] cpu") !=
          std::string::npos);
    CHECK(msg.find("'state.0.0.exp_avg_sq' is float64[2, 3] cpu") != std::string::npos);
    CHECK(msg.find("parameter 1 of group 0 has exp_avg but not step, exp_avg_sq") != std::string::npos);
    CHECK(msg.find("names parameter 7 of group 0, which has 2 parameter(s)") != std::string::npos);
    CHECK(msg.find("names group 3, but the optimizer has 1 group(s)") != std::string::npos);
    CHECK(msg.find("unexpected entry 'state.0.1.momentum_buffer': Adam keeps step, exp_avg, exp_avg_sq") !=
          std::string::npos);
    CHECK(msg.find("unexpected entry 'model.weight'") != std::string::npos);
  }
  CHECK(opt.groups()[0].options.lr == 0.1);  // nothing changed
  CHECK(opt.state_tensors().size() == 8);  // lr, momentum, beta2, eps, weight_decay, amsgrad, with_state (empty),
                                           // num_params
}

TEST_CASE("loading state refuses an option that is not finite, or that the optimizer's constructor refuses") {
  Tensor w = ones({3}, {.requires_grad = true});
  optim::SGD sgd({w}, {.lr = 0.1, .momentum = 0.9, .nesterov = true});
  optim::Adam adam({w}, {.lr = 0.1});
  struct Case {
    optim::Optimizer* opt;
    std::string entry;
    double value;
    std::string expected;
  };
  for (const Case& c : std::vector<Case>{
           {&sgd, "param_groups.0.lr", std::nan(""), "'param_groups.0.lr' is nan, not a finite number"},
           {&sgd, "param_groups.0.momentum", INFINITY, "'param_groups.0.momentum' is inf, not a finite number"},
           {&sgd, "param_groups.0.lr", -5, "param_groups.0: lr -5, momentum 0.9, dampening 0, nesterov 1, "
                                            "weight_decay 0: SGD: invalid learning rate -5"},
           {&sgd, "param_groups.0.weight_decay", -1, "SGD: invalid weight_decay -1"},
           {&sgd, "param_groups.0.dampening", NAN, "'param_groups.0.dampening' is nan, not a finite number"},
           {&sgd, "param_groups.0.momentum", 0, "SGD: nesterov momentum requires a momentum and zero dampening"},
           {&adam, "param_groups.0.momentum", 5, "param_groups.0: lr 0.1, momentum 5, amsgrad 0, beta2 0.999, "
                                                 "eps 1e-08, weight_decay 0: Adam: invalid beta1 5"},
           {&adam, "param_groups.0.eps", -1, "Adam: invalid eps -1"},
           {&adam, "param_groups.0.amsgrad", 1, "'param_groups.0.amsgrad' must be a one-element bool tensor, got "
                                                "float64[] cpu"}}) {
    CAPTURE(c.entry);
    NamedTensors bad = c.opt->state_tensors();
    for (auto& [name, t] : bad)
      if (name == c.entry) t = scalar_tensor(c.value, {.dtype = kFloat64});
    CHECK_THROWS_WITH_AS(c.opt->load_state_tensors(bad), doctest::Contains(c.expected.c_str()), Error);
  }
  CHECK(sgd.groups()[0].options.lr == 0.1);
  CHECK(sgd.groups()[0].options.momentum == 0.9);
  CHECK(sgd.groups()[0].options.weight_decay == 0);
  CHECK(adam.groups()[0].options.betas.first == 0.9);
  CHECK(adam.groups()[0].options.eps == 1e-8);
}

TEST_CASE("loading another optimizer's state names the unexpected entry, what this one keeps and the group") {
  Tensor a = ones({1}, {.requires_grad = true}), b = ones({1}, {.requires_grad = true});
  optim::Adam with_amsgrad({a}, {.amsgrad = true});
  a.set_grad(ones({1}));
  with_amsgrad.step();
  optim::Adam plain({b}, {});
  CHECK_THROWS_WITH_AS(plain.load_state_tensors(with_amsgrad.state_tensors()),
                       doctest::Contains("unexpected entry 'state.0.0.max_exp_avg_sq': Adam keeps step, exp_avg, "
                                         "exp_avg_sq for group 0"), Error);
  CHECK_THROWS_WITH_AS(plain.load_state_tensors(with_amsgrad.state_tensors()),
                       doctest::Contains("'param_groups.0.amsgrad' is true but the optimizer's is false, and it "
                                         "decides which buffers each parameter keeps"), Error);
}

TEST_CASE("loading state restores every option of each group, as PyTorch's load_state_dict, an older file keeps the "
          "constructor's") {
  auto grad_of = [](const Tensor& p, int s) {
    NoGradGuard no_grad;
    return (p * 0.3 + double(s) * 0.1 - 0.5).tanh();
  };
  manual_seed(5);
  const Tensor start = randn({4});
  // Options edited after construction (as param_groups in PyTorch), then saved: a fresh optimizer built with the
  // defaults loads them, and goes on as the uninterrupted one.
  Tensor p1 = start.clone().requires_grad_(), p2 = start.clone().requires_grad_();
  optim::SGD opt1({p1}, {.lr = 0.1, .momentum = 0.9}), opt2({p2}, {.lr = 0.1, .momentum = 0.9});
  for (optim::SGD* o : {&opt1, &opt2}) {
    o->groups()[0].options.weight_decay = 0.5;
    o->groups()[0].options.dampening = 0.25;
  }
  for (int s = 0; s < 4; ++s) {
    p1.set_grad(grad_of(p1, s));
    opt1.step();
    if (s < 2) {
      p2.set_grad(grad_of(p2, s));
      opt2.step();
    }
  }
  Tensor p3 = p2.detach().clone().requires_grad_();
  optim::SGD opt3({p3}, {.lr = 0.1, .momentum = 0.9});
  opt3.load_state_tensors(opt2.state_tensors());
  CHECK(opt3.groups()[0].options.weight_decay == 0.5);
  CHECK(opt3.groups()[0].options.dampening == 0.25);
  for (int s = 2; s < 4; ++s) {
    p3.set_grad(grad_of(p3, s));
    opt3.step();
  }
  CHECK(bit_equal(p1, p3));

  Tensor w = ones({2}, {.requires_grad = true});
  optim::AdamW saved({w}, {.betas = {0.8, 0.9}, .eps = 1e-6, .weight_decay = 0.1});
  optim::AdamW loaded({w}, {});
  loaded.load_state_tensors(saved.state_tensors());
  CHECK(loaded.groups()[0].options.betas == std::pair<double, double>{0.8, 0.9});
  CHECK(loaded.groups()[0].options.eps == 1e-6);
  CHECK(loaded.groups()[0].options.weight_decay == 0.1);

  // A file from before the other options were kept: lr and momentum load, the rest stays the constructor's.
  NamedTensors older;
  for (const auto& [name, t] : saved.state_tensors())
    if (name.find("param_groups.0.") != 0 || name == "param_groups.0.lr" || name == "param_groups.0.momentum" ||
        name == "param_groups.0.with_state")
      older.emplace_back(name, t);
  optim::AdamW kept({w}, {.weight_decay = 0.3});
  kept.load_state_tensors(older);
  CHECK(kept.groups()[0].options.betas == std::pair<double, double>{0.8, 0.999});
  CHECK(kept.groups()[0].options.weight_decay == 0.3);
}

TEST_CASE("loading state refuses a file that lost a parameter's state, and aliased indices") {
  Tensor a = ones({2}, {.requires_grad = true});
  Tensor b = ones({3}, {.requires_grad = true});
  optim::SGD opt({a, b}, {.lr = 0.1, .momentum = 0.9});
  a.set_grad(ones({2}));
  b.set_grad(ones({3}));
  opt.step();
  const NamedTensors saved = opt.state_tensors();
  auto without = [&](const std::string& name) {
    NamedTensors out;
    for (const auto& [n, t] : saved)
      if (n != name) out.emplace_back(n, t);
    return out;
  };
  auto renamed = [&](const std::string& from, const std::string& to) {
    NamedTensors out;
    for (const auto& [n, t] : saved) out.emplace_back(n == from ? to : n, t);
    return out;
  };
  optim::SGD other({ones({2}, {.requires_grad = true}), ones({3}, {.requires_grad = true})},
                   {.lr = 0.1, .momentum = 0.9});
  other.load_state_tensors(saved);  // the whole state loads
  // A momentum buffer dropped (or renamed away from "optimizer.", so that the checkpoint put it among the extras):
  // without with_state, SGD would start that parameter's momentum from zero without a word.
  CHECK_THROWS_WITH_AS(other.load_state_tensors(without("state.0.1.momentum_buffer")),
                       doctest::Contains("parameter 1 of group 0 had state when saved (param_groups.0.with_state), "
                                         "but the file holds none of it: momentum_buffer"),
                       Error);
  // State that with_state does not list.
  NamedTensors extra = saved;
  Tensor& listed = std::find_if(extra.begin(), extra.end(), [](const auto& e) {
                     return e.first == "param_groups.0.with_state";
                   })->second;
  listed = tensor(std::vector<int64_t>{0});
  CHECK_THROWS_WITH_AS(other.load_state_tensors(extra),
                       doctest::Contains("parameter 1 of group 0 has momentum_buffer in the file, but "
                                         "param_groups.0.with_state does not list it"),
                       Error);
  listed = tensor(std::vector<int64_t>{0, 1, 5});
  CHECK_THROWS_WITH_AS(other.load_state_tensors(extra),
                       doctest::Contains("lists parameter 5, but group 0 has 2 parameter(s)"), Error);
  listed = tensor(std::vector<double>{0, 1});
  CHECK_THROWS_WITH_AS(other.load_state_tensors(extra), doctest::Contains("must be a 1-D int64 tensor"), Error);
  // "00" would alias "0": not an index.
  CHECK_THROWS_WITH_AS(other.load_state_tensors(renamed("state.0.0.momentum_buffer", "state.0.00.momentum_buffer")),
                       doctest::Contains("unexpected entry 'state.0.00.momentum_buffer'"), Error);
  CHECK_THROWS_WITH_AS(other.load_state_tensors(renamed("param_groups.0.lr", "param_groups.00.lr")),
                       doctest::Contains("unexpected entry 'param_groups.00.lr'"), Error);
  // A file from before with_state loads (with a warning), as it did.
  other.load_state_tensors(without("param_groups.0.with_state"));
  CHECK(bit_equal(other.state(0, 1).buffers[0], opt.state(0, 1).buffers[0]));
  // Before any step the list is empty, and an empty list goes through a checkpoint file and back.
  TempDir dir;
  optim::SGD fresh({ones({2}, {.requires_grad = true})}, {.lr = 0.1, .momentum = 0.9});
  nn::save_training_checkpoint(dir.file("ck.safetensors"), {.optimizer = fresh.state_tensors()});
  const nn::TrainingCheckpoint ck = nn::load_training_checkpoint(dir.file("ck.safetensors"));
  const auto with_state = std::find_if(ck.optimizer.begin(), ck.optimizer.end(),
                                       [](const auto& e) { return e.first == "param_groups.0.with_state"; });
  REQUIRE(with_state != ck.optimizer.end());
  CHECK(with_state->second.shape() == Shape{0});
  fresh.load_state_tensors(ck.optimizer);
}

// ---------------------------------------------------------------------------------------------------------
// clip_grad_norm_

TEST_CASE("clip_grad_norm_ with the 2-norm: total over all gradients, coefficient max_norm / (norm + 1e-6)") {
  Tensor a = zeros({2}, {.dtype = kFloat64, .requires_grad = true});
  Tensor b = zeros({1}, {.dtype = kFloat64, .requires_grad = true});
  Tensor c = zeros({1}, {.dtype = kFloat64, .requires_grad = true});  // no gradient: left out
  a.set_grad(tensor(std::vector<double>{3, 4}));
  b.set_grad(tensor(std::vector<double>{12}));
  Tensor norm = optim::clip_grad_norm_({a, b, c}, 6.5);
  CHECK(norm.dim() == 0);
  CHECK(norm.dtype() == kFloat64);
  CHECK(norm.item<double>() == doctest::Approx(13).epsilon(1e-15));  // sqrt(9 + 16 + 144)
  const double coef = 6.5 / (13 + 1e-6);
  check_close(a.grad(), {3 * coef, 4 * coef}, 1e-15);
  check_close(b.grad(), {12 * coef}, 1e-15);
  CHECK_FALSE(c.grad().defined());
}

TEST_CASE("clip_grad_norm_ with the inf-norm and other p, below max_norm the gradients do not change") {
  Tensor a = zeros({3}, {.dtype = kFloat64, .requires_grad = true});
  auto reset = [&] { a.set_grad(tensor(std::vector<double>{1, -12, 4})); };
  reset();
  CHECK(optim::clip_grad_norm_({a}, 6, INFINITY).item<double>() == 12);
  check_close(a.grad(), {6 / (12 + 1e-6), -12 * 6 / (12 + 1e-6), 4 * 6 / (12 + 1e-6)}, 1e-15);
  reset();
  CHECK(optim::clip_grad_norm_({a}, 100, 1).item<double>() == 17);
  CHECK(values(a.grad()) == std::vector<double>{1, -12, 4});  // coefficient clamped to exactly 1
  reset();
  CHECK(optim::grad_norm({a}, 3).item<double>() == doctest::Approx(std::cbrt(1 + 1728 + 64)).epsilon(1e-14));
  CHECK_THROWS_WITH_AS(optim::clip_grad_norm_({a}, 1, 0), doctest::Contains("norm_type"), Error);
}

TEST_CASE("clip_grad_norm_ on float16 gradients accumulates in float32, many gradients, nan propagates") {
  // Two float16 gradients of 60000: the norm 84853 is beyond float16's 65504 but not float32's.
  Tensor h = zeros({2}, {.dtype = kFloat16, .requires_grad = true});
  h.set_grad(full({2}, 60000.0, {.dtype = kFloat16}));
  Tensor norm = optim::clip_grad_norm_({h}, 1);
  CHECK(norm.dtype() == kFloat32);
  CHECK(norm.item<double>() == doctest::Approx(60000 * std::sqrt(2.0)).epsilon(1e-6));

  // 300k float32 elements across chunks and threads, mixed with a float64 gradient: float32 result.
  manual_seed(4);
  Tensor big = zeros({300000}, {.requires_grad = true});
  Tensor small = zeros({3}, {.dtype = kFloat64, .requires_grad = true});
  big.set_grad(randn({300000}));
  small.set_grad(tensor(std::vector<double>{1, 2, 3}));
  const double expected = std::sqrt(big.grad().to(kFloat64).pow(2).sum().item<double>() + 14);
  Tensor total = optim::clip_grad_norm_({big, small}, 1);
  CHECK(total.dtype() == kFloat32);
  CHECK(total.item<double>() == doctest::Approx(expected).epsilon(1e-5));
  CHECK(optim::grad_norm({big, small}).item<double>() == doctest::Approx(1).epsilon(1e-5));

  Tensor bad = zeros({2}, {.requires_grad = true});
  bad.set_grad(tensor(std::vector<float>{1, NAN}));
  CHECK(std::isnan(optim::clip_grad_norm_({bad}, 1).item<double>()));
  bad.set_grad(tensor(std::vector<float>{NAN, 1}));
  CHECK(std::isnan(optim::grad_norm({bad}, INFINITY).item<double>()));

  CHECK(optim::clip_grad_norm_({zeros({1}, {.requires_grad = true})}, 1).item<double>() == 0);  // no gradients
}

TEST_CASE("clip_grad_norm_ with error_if_nonfinite refuses a nan or infinite norm and leaves the gradients alone") {
  Tensor p = zeros({2}, {.requires_grad = true}), q = zeros({1}, {.requires_grad = true});
  p.set_grad(tensor(std::vector<float>{3, 4}));
  q.set_grad(tensor(std::vector<float>{INFINITY}));
  CHECK_THROWS_WITH_AS(optim::clip_grad_norm_({p, q}, 1, 2.0, /*error_if_nonfinite=*/true),
                       doctest::Contains("clip_grad_norm_: the total norm of order 2 of the gradients is inf"), Error);
  CHECK(values(p.grad()) == std::vector<double>{3, 4});
  CHECK(optim::clip_grad_norm_({p}, 1, 2.0, true).item<double>() == doctest::Approx(5));  // finite: clipped
  check_close(p.grad(), {0.6, 0.8}, 1e-6);
}

TEST_CASE("clip_grad_value_ clamps every gradient to [-clip, clip] in place, nan staying nan") {
  Tensor a = zeros({4}, {.requires_grad = true}), b = zeros({2}, {.dtype = kFloat16, .requires_grad = true});
  Tensor none = zeros({1}, {.requires_grad = true});  // no gradient: left out
  a.set_grad(tensor(std::vector<float>{-3, 0.5, 2, NAN}));
  b.set_grad(tensor(std::vector<float>{70, -0.25}).to(kFloat16));
  optim::clip_grad_value_({a, b, none}, 1.0);
  const std::vector<double> ga = values(a.grad());
  CHECK(ga[0] == -1.0);
  CHECK(ga[1] == 0.5);
  CHECK(ga[2] == 1.0);
  CHECK(std::isnan(ga[3]));
  CHECK(values(b.grad()) == std::vector<double>{1.0, -0.25});
  CHECK_FALSE(none.grad().defined());
  CHECK_THROWS_WITH_AS(optim::clip_grad_value_({a}, -1), doctest::Contains("clip_value must not be negative, got -1"),
                       Error);
}

TEST_CASE("the CPU norm is the same to the bit whatever the number of threads") {
  manual_seed(7);
  Tensor p = zeros({250000}, {.requires_grad = true});
  p.set_grad(randn({250000}));
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const float one = optim::grad_norm({p}).item<float>();
  omp_set_num_threads(std::max(2, threads));
  const float many = optim::grad_norm({p}).item<float>();
  omp_set_num_threads(threads);
  CHECK(one == many);
}

// ---------------------------------------------------------------------------------------------------------
// CUDA: the fused multi-tensor kernels against the CPU ones

#if HALFGRAD_WITH_CUDA
namespace {

// Parameter sizes that exercise the batching: 150 tensors (more than one launch's worth for every
// optimizer), some larger than a chunk, odd sizes (vector tails), and some misaligned (views at an odd
// offset, so the kernels take their scalar path).
std::vector<int64_t> cuda_test_sizes() {
  std::vector<int64_t> sizes;
  for (int i = 0; i < 150; ++i) sizes.push_back(1 + (i * 37) % 300);
  sizes.push_back(16384 * 3 + 5);
  sizes.push_back(100003);
  return sizes;
}

// Matching parameter lists on the CPU and the GPU: same values, the GPU ones partly misaligned.
std::pair<TensorList, TensorList> twin_params(DType dt) {
  TensorList cpu, gpu;
  int i = 0;
  for (int64_t n : cuda_test_sizes()) {
    Tensor values = (randn({n}) * 0.5).to(dt);
    cpu.push_back(values.clone().requires_grad_());
    Tensor g;
    if (i++ % 3 == 0) {  // an odd element offset inside a larger buffer
      Tensor buffer = zeros({n + 1}, {.dtype = dt, .device = Device::cuda(0)});
      g = buffer.narrow(0, 1, n);
      g.copy_(values);
    } else {
      g = values.to(Device::cuda(0));
    }
    gpu.push_back(g.requires_grad_());
  }
  return {cpu, gpu};
}

// Gradients with |g| in [0.5, 1.5): Adam's second moment of a float16 parameter stays a normal float16.
// (A subnormal one has so few bits that one rounding apart changes the step by percents, and a gradient
// below 2.4e-4 makes it 0 and the step lr * m / eps: float16 Adam wants float32 master weights.)
void set_twin_grads(const TensorList& cpu, const TensorList& gpu, DType dt) {
  for (size_t i = 0; i < cpu.size(); ++i) {
    Tensor g = ((rand(cpu[i].shape()) + 0.5) * randn(cpu[i].shape()).sign()).to(dt);
    cpu[i].set_grad(g);
    gpu[i].set_grad(g.to(Device::cuda(0)));
  }
}

// CPU and GPU compute the same formulas in the same opmath type; they differ by FMA contraction and
// division/sqrt rounding, a few ulp of float32 per step. 16-bit storage then rounds each to one of two
// neighbours: one ulp of float16 (2^-10 relative), of bfloat16 (2^-7).
double cuda_tolerance(DType dt) {
  switch (dt) {
    case kFloat64: return 1e-12;
    case kFloat32: return 1e-5;
    case kFloat16: return 2e-3;
    default: return 1.6e-2;
  }
}

template <typename MakeOptimizer> void compare_cuda_step(DType dt, MakeOptimizer make) {
  CAPTURE(std::string(dtype_name(dt)));
  manual_seed(5);
  auto [cpu, gpu] = twin_params(dt);
  auto opt_cpu = make(cpu);
  auto opt_gpu = make(gpu);
  for (int s = 0; s < 3; ++s) {
    set_twin_grads(cpu, gpu, dt);
    opt_cpu.step();
    opt_gpu.step();
  }
  const double tol = cuda_tolerance(dt);
  double worst = 0;
  for (size_t i = 0; i < cpu.size(); ++i) worst = std::max(worst, worst_error(gpu[i].cpu(), cpu[i], tol, tol));
  CHECK(worst <= 1);
  // The state too: every buffer of every parameter.
  NamedTensors sc = opt_cpu.state_tensors(), sg = opt_gpu.state_tensors();
  REQUIRE(sc.size() == sg.size());
  for (size_t i = 0; i < sc.size(); ++i) {
    CAPTURE(sc[i].first);
    CHECK(sc[i].first == sg[i].first);
    CHECK(worst_error(sg[i].second.cpu().to(kFloat64), sc[i].second.to(kFloat64), tol, tol) <= 1);
  }
}

}  // namespace

TEST_CASE("CUDA fused SGD matches the CPU step (momentum, nesterov, weight decay, every dtype)") {
  SKIP_WITHOUT_GPU();
  for (DType dt : {kFloat32, kFloat16, kBFloat16, kFloat64}) {
    compare_cuda_step(dt, [](TensorList& p) {
      return optim::SGD(p, {.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-2, .nesterov = true});
    });
    compare_cuda_step(dt, [](TensorList& p) {
      return optim::SGD(p, {.lr = 0.1, .momentum = 0.9, .dampening = 0.1});
    });
    compare_cuda_step(dt, [](TensorList& p) { return optim::SGD(p, {.lr = 0.1}); });
  }
}

TEST_CASE("CUDA plain SGD skips the vectors whose gradient is +0, bit-exact with the CPU step where it is 0") {
  SKIP_WITHOUT_GPU();
  // Without momentum or weight decay the kernel neither reads nor writes a parameter vector whose gradient is all
  // +0 (an embedding outside the step's words). Where the gradient is 0 the bits are the CPU's full formula's:
  // p = -0 stays -0 under a +0 gradient and becomes +0 under a -0 one (-0 - (lr x -0): element 49); NaN stays NaN.
  // A NaN clipping scale turns every parameter NaN, the skipped vectors too; with momentum nothing is skipped.
  const int64_t n = 4 * 1000 + 3;  // whole vectors of 4 and a scalar tail
  for (DType dt : {kFloat32, kFloat16, kFloat64}) {
    const std::string dt_name = dtype_name(dt);
    CAPTURE(dt_name);
    manual_seed(9);
    const Tensor p_random = randn({n}), g_random = randn({n});
    std::vector<float> pv(p_random.data<float>(), p_random.data<float>() + n),
        gv(g_random.data<float>(), g_random.data<float>() + n);
    for (size_t i = 0; i < size_t(n); ++i) {
      if (i % 12 < 8) gv[i] = 0.0f;    // two zero vectors of every three
      if (i % 24 == 1) gv[i] = -0.0f;  // some with a -0: updated as usual
      if (i % 7 == 0) pv[i] = -0.0f;
      if (i % 101 == 0) pv[i] = std::nanf("");
    }
    const Tensor p0 = tensor(pv).to(dt), g0 = tensor(gv).to(dt);
    struct Case {
      double momentum;
      float scale;
    };
    for (const Case c : {Case{0, 1.0f}, Case{0, 0.5f}, Case{0, NAN}, Case{0.9, 1.0f}}) {
      CAPTURE(c.momentum);
      CAPTURE(c.scale);
      TensorList on_cpu{p0.clone().requires_grad_()}, on_gpu{p0.to(Device::cuda(0)).requires_grad_()};
      on_cpu[0].set_grad(g0.clone());
      on_gpu[0].set_grad(g0.to(Device::cuda(0)));
      optim::SGD cpu(on_cpu, {.lr = 0.1, .momentum = c.momentum}), gpu(on_gpu, {.lr = 0.1, .momentum = c.momentum});
      cpu.step_scaled(Tensor(), full({}, c.scale, {.dtype = kFloat32}));
      gpu.step_scaled(Tensor(), full({}, c.scale, {.dtype = kFloat32, .device = Device::cuda(0)}));
      const Tensor a = on_cpu[0].detach().to(kFloat64), b = on_gpu[0].detach().cpu().to(kFloat64);
      // Where the gradient is 0 (or p NaN) no rounding can differ: the bits must be the CPU's. Elsewhere the two
      // differ by FMA contraction, as in the tests above.
      int64_t differing = 0;
      for (int64_t i = 0; i < n; ++i) {
        const double x = a.data<double>()[i], y = b.data<double>()[i];
        const bool exact = gv[size_t(i)] == 0.0f || std::isnan(x) || std::isnan(y);
        const bool same = exact ? (std::isnan(x) && std::isnan(y)) || (x == y && std::signbit(x) == std::signbit(y))
                                : std::abs(x - y) <= 1e-6 * std::max(1.0, std::abs(x));
        differing += same ? 0 : 1;
      }
      CHECK(differing == 0);
      if (c.scale == 1.0f) CHECK((b.data<double>()[49] == 0 && !std::signbit(b.data<double>()[49])));  // -0 - (lr x -0)
      if (std::isnan(c.scale)) CHECK(std::isnan(b.data<double>()[4]));  // a skipped vector's without the NaN
    }
  }
}

TEST_CASE("CUDA fused Adam and AdamW match the CPU step (amsgrad, weight decay, every dtype)") {
  SKIP_WITHOUT_GPU();
  for (DType dt : {kFloat32, kFloat16, kBFloat16, kFloat64}) {
    compare_cuda_step(dt, [](TensorList& p) {
      return optim::Adam(p, {.lr = 1e-2, .weight_decay = 1e-2, .amsgrad = true});
    });
    compare_cuda_step(dt, [](TensorList& p) { return optim::AdamW(p, {.lr = 1e-2}); });
  }
}

TEST_CASE("CUDA fused RMSprop matches the CPU step (centered, momentum, weight decay, every dtype)") {
  SKIP_WITHOUT_GPU();
  for (DType dt : {kFloat32, kFloat16, kBFloat16, kFloat64}) {
    compare_cuda_step(dt, [](TensorList& p) {
      return optim::RMSprop(p, {.lr = 1e-2, .weight_decay = 1e-2, .momentum = 0.9, .centered = true});
    });
    compare_cuda_step(dt, [](TensorList& p) {
      return optim::RMSprop(p, {.lr = 1e-2, .alpha = 0.3, .centered = true});
    });
    compare_cuda_step(dt, [](TensorList& p) { return optim::RMSprop(p, {.lr = 1e-2, .momentum = 0.5}); });
    compare_cuda_step(dt, [](TensorList& p) { return optim::RMSprop(p, {.lr = 1e-2}); });
  }
}

TEST_CASE("CUDA fused Adagrad matches the CPU step (lr decay, weight decay, initial sum, every dtype)") {
  SKIP_WITHOUT_GPU();
  for (DType dt : {kFloat32, kFloat16, kBFloat16, kFloat64}) {
    compare_cuda_step(dt, [](TensorList& p) {
      return optim::Adagrad(p, {.lr = 1e-2, .lr_decay = 0.1, .weight_decay = 1e-2, .initial_accumulator_value = 0.1});
    });
    compare_cuda_step(dt, [](TensorList& p) { return optim::Adagrad(p, {.lr = 1e-2}); });
  }
}

TEST_CASE("CUDA clip_grad_norm_ matches the CPU one (2, 1, 3 and inf norms) without a host sync") {
  SKIP_WITHOUT_GPU();
  for (DType dt : {kFloat32, kFloat16, kFloat64}) {
    for (double norm_type : {2.0, 1.0, 3.0, double(INFINITY)}) {
      CAPTURE(std::string(dtype_name(dt)));
      CAPTURE(norm_type);
      manual_seed(6);
      auto [cpu, gpu] = twin_params(dt);
      set_twin_grads(cpu, gpu, dt);
      Tensor n_cpu = optim::clip_grad_norm_(cpu, 1.0, norm_type);
      Tensor n_gpu = optim::clip_grad_norm_(gpu, 1.0, norm_type);
      CHECK(n_gpu.is_cuda());
      CHECK(n_gpu.dtype() == n_cpu.dtype());
      // Sums of ~170k terms in float32 in different orders: relative differences of ~1e-6.
      const double tol = dt == kFloat64 ? 1e-12 : 1e-5;
      CHECK(n_gpu.cpu().item<double>() == doctest::Approx(n_cpu.item<double>()).epsilon(tol));
      double worst = 0;
      for (size_t i = 0; i < cpu.size(); ++i)
        worst = std::max(worst, worst_error(gpu[i].grad().cpu(), cpu[i].grad(), cuda_tolerance(dt) + tol, 1e-6));
      CHECK(worst <= 1);
    }
  }
}
#endif

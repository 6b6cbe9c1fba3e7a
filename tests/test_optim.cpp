// Optimizers against hand-computed steps.
#include <doctest/doctest.h>

#include "halfgrad.h"
#include "optim/sgd.h"

using namespace halfgrad;

static std::vector<double> values(const Tensor& t) { return to_vector<double>(t); }

// Sets p.grad to g and runs one step.
static void step_with(optim::Optimizer& opt, Tensor& p, std::vector<double> g) {
  p.set_grad(tensor(g));
  opt.step();
}

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
  // g = 1 + 0.01*1 = 1.01 ; b = g (first step) ; p = 1 - 0.1*1.01 = 0.899
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

TEST_CASE("parameter groups keep their own options; parameters without grad are skipped") {
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

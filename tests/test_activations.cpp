// gelu (exact and tanh forms), silu and erf, and the activation modules GELU, SiLU, Tanh and Sigmoid: values against
// float64 references by the definitions, gradchecks, PyTorch's dtype rules and errors, autocast, CUDA against the CPU.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <numbers>
#include <string>
#include <vector>

#include "core/autocast.h"
#include "halfgrad.h"
#include "tests/gradcheck.h"
#include "tests/testing.h"

using namespace halfgrad;
using halfgrad::testing::check_close;
using halfgrad::testing::gradcheck;
using halfgrad::testing::leaf;
using halfgrad::testing::values;

namespace {

double gelu_exact(double x) { return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0))); }
double gelu_tanh(double x) {
  return 0.5 * x * (1 + std::tanh(std::sqrt(2 / std::numbers::pi) * (x + 0.044715 * x * x * x)));
}
double silu_ref(double x) { return x / (1 + std::exp(-x)); }

// The tolerance of a result computed in float32 (or float64) and rounded once to dt.
double rounding(DType dt) { return dt == kFloat64 ? 1e-14 : dt == kFloat32 ? 2e-6 : dt == kFloat16 ? 2e-3 : 1.6e-2; }

struct Activation {
  std::string name;
  std::function<Tensor(const Tensor&)> op;
  double (*reference)(double);
};
const std::vector<Activation> kActivations = {
    {"gelu", [](const Tensor& x) { return gelu(x); }, gelu_exact},
    {"gelu tanh", [](const Tensor& x) { return gelu(x, "tanh"); }, gelu_tanh},
    {"silu", [](const Tensor& x) { return silu(x); }, silu_ref},
    {"erf", [](const Tensor& x) { return erf(x); }, [](double x) { return std::erf(x); }},
};

}  // namespace

TEST_CASE("gelu, silu and erf at known points: PyTorch's float64 values") {
  const Tensor x = tensor<double>({1.0, -2.0, 3.0});
  check_close(values(gelu(x)), {0.8413447460685429, -0.04550026389635842, 2.99595030590511}, 1e-15);
  check_close(values(gelu(x, "tanh")), {0.8411919906082768, -0.04540230591222494, 2.996362607918227}, 1e-15);
  check_close(values(silu(x)), {0.7310585786300049, -0.2384058440442351, 2.8577223804672998}, 1e-15);
  check_close(values(erf(x)), {0.8427007929497149, -0.9953222650189527, 0.9999779095030014}, 1e-15);
  // The tails in float32: gelu and silu are x far right and 0 far left (silu's exp(100) overflows to inf: x / inf).
  const Tensor tails = tensor<float>({-100.0f, 100.0f});
  CHECK(values(gelu(tails)) == std::vector<double>{0, 100});
  CHECK(values(silu(tails)) == std::vector<double>{0, 100});
  CHECK(values(erf(tensor<float>({-INFINITY, INFINITY}))) == std::vector<double>{-1, 1});
}

TEST_CASE("gelu, silu and erf match the float64 definitions in every floating dtype, in the input's dtype") {
  manual_seed(301);
  const Tensor x64 = randn({7, 9}, {.dtype = kFloat64}) * 3;
  for (const Activation& a : kActivations) {
    for (DType dt : {kFloat64, kFloat32, kFloat16, kBFloat16}) {
      CAPTURE(a.name);
      CAPTURE(std::string(dtype_name(dt)));
      const Tensor x = x64.to(dt);
      const Tensor y = a.op(x);
      CHECK(y.dtype() == dt);
      std::vector<double> want;
      for (double v : values(x)) want.push_back(a.reference(v));
      check_close(values(y), want, rounding(dt));
    }
  }
}

TEST_CASE("gradcheck: gelu (both forms), silu and erf") {
  manual_seed(302);
  for (const Activation& a : kActivations) {
    CAPTURE(a.name);
    gradcheck([&a](const TensorList& in) { return a.op(in[0]); }, {leaf({4, 5}, 2.0)});
    Tensor base = leaf({5, 4}, 2.0);  // a non-contiguous input
    gradcheck([&a](const TensorList& in) { return a.op(in[0].t()); }, {base});
  }
}

TEST_CASE("gelu's and silu's gradients at known points: the derivatives' closed forms in float64") {
  Tensor x = tensor<double>({1.0, -2.0, 0.0}).requires_grad_();
  gelu(x).sum().backward();
  check_close(values(x.grad()), {1.0833154705876864, -0.08523180107819692, 0.5}, 1e-14);
  x.set_grad(Tensor());
  gelu(x, "tanh").sum().backward();
  check_close(values(x.grad()), {1.0829640838457826, -0.08609925662361825, 0.5}, 1e-14);
  x.set_grad(Tensor());
  silu(x).sum().backward();
  check_close(values(x.grad()), {0.9276705118714869, -0.09078424878489547, 0.5}, 1e-14);
}

TEST_CASE("gelu and silu take floating inputs only, as PyTorch's, and erf computes an integer input in float32") {
  CHECK_THROWS_WITH_AS(gelu(arange(4)), doctest::Contains("gelu: expected a floating-point input, got int64[4]"),
                       Error);
  CHECK_THROWS_WITH_AS(gelu(arange(4), "tanh"), doctest::Contains("gelu: expected a floating-point input"), Error);
  Tensor t = tensor<double>({1.0}).requires_grad_();
  CHECK(gelu(t, "tanh").grad_fn()->name() == "GeluBackward");  // PyTorch's node for both forms
  CHECK_THROWS_WITH_AS(silu(tensor<bool>({true})), doctest::Contains("silu: expected a floating-point input, got bool"),
                       Error);
  CHECK_THROWS_WITH_AS(gelu(ones({2}), "exact"),
                       doctest::Contains("gelu: approximate must be \"none\" or \"tanh\", got \"exact\""), Error);
  const Tensor e = erf(tensor<int64_t>({0, 1}));
  CHECK(e.dtype() == kFloat32);
  check_close(values(e), {0.0, 0.8427007929497149}, 1e-7);
  CHECK(erf(tensor<bool>({true})).dtype() == kFloat32);
}

TEST_CASE("under autocast gelu and silu keep a float16 input's dtype (PyTorch's autocast lists neither)") {
  const Tensor x = randn({4}).to(kFloat16);
  amp::AutocastGuard guard(kFloat16);
  CHECK(gelu(x).dtype() == kFloat16);
  CHECK(silu(x).dtype() == kFloat16);
  CHECK(gelu(randn({4})).dtype() == kFloat32);
}

TEST_CASE("GELU, SiLU, Tanh and Sigmoid modules apply their ops and print as PyTorch's") {
  manual_seed(303);
  const Tensor x = randn({3, 4});
  CHECK(values(nn::GELU()(x)) == values(gelu(x)));
  CHECK(values(nn::GELU("tanh")(x)) == values(gelu(x, "tanh")));
  CHECK(values(nn::SiLU()(x)) == values(silu(x)));
  CHECK(values(nn::Tanh()(x)) == values(tanh(x)));
  CHECK(values(nn::Sigmoid()(x)) == values(sigmoid(x)));
  CHECK(nn::GELU().repr() == "GELU(approximate='none')");
  CHECK(nn::GELU("tanh").repr() == "GELU(approximate='tanh')");
  CHECK(nn::SiLU().repr() == "SiLU()");
  CHECK(nn::Tanh().parameters().empty());
  CHECK_THROWS_WITH_AS(nn::GELU("erf"),
                       doctest::Contains("GELU: approximate must be \"none\" or \"tanh\", got \"erf\""), Error);
  // In a Sequential, gradients flow through them.
  nn::Sequential net({std::make_shared<nn::Linear>(4, 5), std::make_shared<nn::GELU>(),
                      std::make_shared<nn::Linear>(5, 2), std::make_shared<nn::SiLU>()});
  net(x).sum().backward();
  for (const Tensor& p : net.parameters()) CHECK(p.grad().defined());
}

TEST_CASE("CUDA gelu, silu and erf match the CPU, forward and backward, in every floating dtype") {
  SKIP_WITHOUT_GPU();
  manual_seed(304);
  for (const Activation& a : kActivations) {
    for (DType dt : {kFloat64, kFloat32, kFloat16, kBFloat16}) {
      CAPTURE(a.name);
      CAPTURE(std::string(dtype_name(dt)));
      const Tensor x = (randn({33, 65}, {.dtype = kFloat64}) * 3).to(dt);
      const Tensor g = randn({33, 65}, {.dtype = kFloat64}).to(dt);
      Tensor xc = x.detach().requires_grad_(), xg = x.detach().cuda().requires_grad_();
      const Tensor yc = a.op(xc), yg = a.op(xg);
      yc.backward(g);
      yg.backward(g.cuda());
      // each device's float32 (float64) math library: a last bit or two, then one rounding to dt
      const double tol = dt == kFloat64 ? 1e-13 : dt == kFloat32 ? 1e-5 : 2 * rounding(dt);
      check_close(values(yg.cpu()), values(yc), tol);
      check_close(values(xg.grad().cpu()), values(xc.grad()), tol);
    }
  }
}

// Losses: values against a float64 reference for each reduction, shape and dtype errors, gradchecks.
#include <doctest/doctest.h>

#include <cmath>

#include "halfgrad.h"
#include "ops/loss.h"
#include "tests/gradcheck.h"

using namespace halfgrad;
using halfgrad::testing::gradcheck;
using halfgrad::testing::leaf;

TEST_CASE("mse_loss averages, sums or keeps the squared differences") {
  manual_seed(21);
  for (DType dt : {kFloat64, kFloat32, kFloat16, kBFloat16}) {
    CAPTURE(std::string(dtype_name(dt)));
    Tensor input = randn({4, 7}, {.dtype = kFloat64}).to(dt), target = randn({4, 7}, {.dtype = kFloat64}).to(dt);
    std::vector<double> x = to_vector<double>(input), y = to_vector<double>(target), sq;
    double sum = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      sq.push_back((x[i] - y[i]) * (x[i] - y[i]));
      sum += sq.back();
    }
    // The differences and squares are rounded to the dtype (float16: 11 bits, bfloat16: 8), sums are not.
    double tol = dt == kFloat64 ? 1e-12 : dt == kFloat32 ? 1e-6 : dt == kFloat16 ? 2e-3 : 2e-2;
    Tensor none = mse_loss(input, target, Reduction::None);
    REQUIRE(none.shape() == Shape{4, 7});
    CHECK(none.dtype() == dt);
    std::vector<double> got = to_vector<double>(none);
    for (size_t i = 0; i < sq.size(); ++i) CHECK(got[i] == doctest::Approx(sq[i]).epsilon(tol).scale(1.0));
    Tensor mean = mse_loss(input, target);  // Mean is the default, as in PyTorch
    CHECK(mean.dim() == 0);
    CHECK(mean.item<double>() == doctest::Approx(sum / double(sq.size())).epsilon(tol));
    CHECK(mse_loss(input, target, Reduction::Sum).item<double>() == doctest::Approx(sum).epsilon(tol));
  }
}

TEST_CASE("mse_loss of identical tensors is zero") {
  Tensor x = randn({3, 3});
  CHECK(mse_loss(x, x).item<double>() == 0.0);
  CHECK(mse_loss(x, x, Reduction::Sum).item<double>() == 0.0);
}

TEST_CASE("mse_loss refuses to broadcast: the error names both shapes") {
  // PyTorch only warns here, and [N] against [N, 1] silently becomes an [N, N] loss.
  CHECK_THROWS_WITH_AS(mse_loss(ones({4}), ones({4, 1})),
                       doctest::Contains("mse_loss: input shape [4] and target shape [4, 1] differ"), Error);
  CHECK_THROWS_WITH_AS(mse_loss(ones({2, 3}), ones({3})), doctest::Contains("[2, 3]"), Error);
  CHECK_THROWS_WITH_AS(mse_loss(ones({2}, {.dtype = kInt64}), ones({2}, {.dtype = kInt64})),
                       doctest::Contains("mse_loss: expected floating-point"), Error);
}

TEST_CASE("mse_loss gradients match finite differences for input and target, in every reduction") {
  manual_seed(22);
  for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
    CAPTURE(reduction_name(r));
    gradcheck([r](const TensorList& in) { return mse_loss(in[0], in[1], r); }, {leaf({3, 4}), leaf({3, 4})});
    // Only the input requires grad (the usual case: the target is data).
    gradcheck([r](const TensorList& in) { return mse_loss(in[0], in[1], r); },
              {leaf({5}), randn({5}, {.dtype = kFloat64})});
  }
}

TEST_CASE("mse_loss of mixed float dtypes computes in the wider one and returns each input its own grad dtype") {
  Tensor input = randn({3}).requires_grad_();                          // float32
  Tensor target = randn({3}, {.dtype = kFloat64}).requires_grad_();    // float64
  Tensor loss = mse_loss(input, target);
  CHECK(loss.dtype() == kFloat64);
  loss.backward();
  CHECK(input.grad().dtype() == kFloat32);
  CHECK(target.grad().dtype() == kFloat64);
  std::vector<double> gi = to_vector<double>(input.grad()), gt = to_vector<double>(target.grad());
  for (size_t i = 0; i < gi.size(); ++i) CHECK(gi[i] == doctest::Approx(-gt[i]).epsilon(1e-6));
}

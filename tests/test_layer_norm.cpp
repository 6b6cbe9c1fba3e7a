// layer_norm and nn::LayerNorm: values against a float64 reference by the definition, exact values, gradchecks of
// input, weight and bias, PyTorch's argument rules and errors, autocast, empty inputs, CUDA against the CPU.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/autocast.h"
#include "halfgrad.h"
#include "tests/gradcheck.h"
#include "tests/testing.h"

using namespace halfgrad;
using halfgrad::testing::check_close;
using halfgrad::testing::contains;
using halfgrad::testing::error_of;
using halfgrad::testing::gradcheck;
using halfgrad::testing::leaf;
using halfgrad::testing::values;

namespace {

// layer_norm in float64 by its definition: rows of `cols` values, each normalised with its mean and biased variance.
std::vector<double> reference(const Tensor& x, int64_t cols, const Tensor& weight, const Tensor& bias, double eps) {
  const std::vector<double> v = values(x);
  const std::vector<double> w = weight.defined() ? values(weight) : std::vector<double>(size_t(cols), 1.0);
  const std::vector<double> b = bias.defined() ? values(bias) : std::vector<double>(size_t(cols), 0.0);
  std::vector<double> out(v.size());
  for (size_t r = 0; r < v.size() / size_t(cols); ++r) {
    double mean = 0, var = 0;
    for (size_t j = 0; j < size_t(cols); ++j) mean += v[r * size_t(cols) + j];
    mean /= double(cols);
    for (size_t j = 0; j < size_t(cols); ++j) var += std::pow(v[r * size_t(cols) + j] - mean, 2);
    var /= double(cols);
    for (size_t j = 0; j < size_t(cols); ++j)
      out[r * size_t(cols) + j] = (v[r * size_t(cols) + j] - mean) / std::sqrt(var + eps) * w[j] + b[j];
  }
  return out;
}

// The tolerance of a result computed in float32 (float64) and rounded once to dt.
double rounding(DType dt) { return dt == kFloat64 ? 1e-13 : dt == kFloat32 ? 1e-5 : dt == kFloat16 ? 4e-3 : 3e-2; }

// check_close row by row, each row's tolerance widened by a term for its condition c = 1 + max |x| / std (of x,
// float64 [rows, cols]): a mean summed in the statistics' dtype (float32 but for float64, as PyTorch's) is off by a
// few of its roundings (`epsilon` each) of the row's largest values, which normalising divides by the row's standard
// deviation: the output's error grows as c; the input's gradient multiplies xhat's error by rstd again, and its
// terms cancel, so its error grows as c^2 (`power` 2). Rows whose values lie close together for their size carry that
// error whatever the order of the sums (3 columns of randn * 3 + 1: a few rows in ten thousand, where an H100 gave the
// input's gradient errors of ~3e-6 c for c of 22-170 in session 65, more than the output's can reach, ~1e-7 c);
// well-conditioned rows keep tol. 16 roundings a term.
void check_close_by_row(const std::vector<double>& got, const std::vector<double>& want, const Tensor& x, double tol,
                        double epsilon, int power) {
  REQUIRE(got.size() == want.size());
  const std::vector<double> v = values(x);
  const size_t cols = size_t(x.size(-1));
  int failures = 0;
  for (size_t r = 0; r < v.size() / cols; ++r) {
    double mean = 0, var = 0, largest = 0;
    for (size_t j = 0; j < cols; ++j) {
      mean += v[r * cols + j];
      largest = std::max(largest, std::abs(v[r * cols + j]));
    }
    mean /= double(cols);
    for (size_t j = 0; j < cols; ++j) var += std::pow(v[r * cols + j] - mean, 2);
    const double condition = 1 + largest / std::sqrt(var / double(cols) + 1e-5);
    for (size_t i = r * cols; i < (r + 1) * cols; ++i) {
      const double allowed = (tol + 16 * epsilon * std::pow(condition, power)) * (1 + std::abs(want[i]));
      if (!(std::abs(got[i] - want[i]) <= allowed) && failures++ < 5)
        FAIL_CHECK("element " << i << " (row " << r << ", condition " << condition << "): got " << got[i] << ", want "
                              << want[i]);
    }
  }
  CHECK(failures == 0);
}

}  // namespace

TEST_CASE("layer_norm of one row: (x - mean) / sqrt(var + eps), var biased") {
  const Tensor x = tensor<double>({1, 2, 3, 4});
  // mean 2.5, biased variance 1.25
  const double s = std::sqrt(1.25);
  check_close(values(layer_norm(x, {4}, Tensor(), Tensor(), 0.0)), {-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s}, 1e-15);
  const double se = std::sqrt(1.25 + 0.75);
  check_close(values(layer_norm(x, {4}, tensor<double>({1, 2, 3, 4}), tensor<double>({0, 0, 0, 10}), 0.75)),
              {-1.5 / se, -1.0 / se, 1.5 / se, 6.0 / se + 10}, 1e-15);
  // A constant row is all bias: its deviations are 0, whatever eps.
  check_close(values(layer_norm(full({2, 3}, 7.0), {3}, Tensor(), full({3}, 0.5))), std::vector<double>(6, 0.5), 0);
}

TEST_CASE("layer_norm matches the float64 definition over one, two and all dims, with and without weight and bias") {
  manual_seed(311);
  const Tensor x64 = randn({3, 4, 5}, {.dtype = kFloat64}) * 2 + 1;
  for (DType dt : {kFloat64, kFloat32, kFloat16, kBFloat16}) {
    for (const Shape& normalized : {Shape{5}, Shape{4, 5}, Shape{3, 4, 5}}) {
      for (bool affine : {false, true}) {
        CAPTURE(std::string(dtype_name(dt)));
        CAPTURE(shape_str(normalized));
        CAPTURE(affine);
        const Tensor x = x64.to(dt);
        const Tensor w = affine ? randn(normalized, {.dtype = kFloat64}).to(dt) : Tensor();
        const Tensor b = affine ? randn(normalized, {.dtype = kFloat64}).to(dt) : Tensor();
        const Tensor y = layer_norm(x, normalized, w, b, 1e-5);
        CHECK(y.dtype() == dt);
        CHECK(y.shape() == x.shape());
        check_close(values(y), reference(x, numel_of(normalized), w, b, 1e-5), rounding(dt));
      }
    }
  }
}

TEST_CASE("CUDA layer_norm's float32 statistics take two passes: a large mean against a small spread loses nothing") {
  // On CUDA the sums run in float32, where one pass, E[x^2] - E[x]^2 with E[x^2] near 1e6 (float32's spacing there is
  // 0.0625), would leave nothing of the variance 0.078; the mean and the deviations from it are exact here. The CPU
  // sums in double, where one pass would pass too: its part is the reference.
  const Tensor x = tensor<float>({1000, 1000.25f, 1000.5f, 1000.75f});
  const double s = std::sqrt(0.078125);
  const std::vector<double> want = {-0.375 / s, -0.125 / s, 0.125 / s, 0.375 / s};
  check_close(values(layer_norm(x, {4}, Tensor(), Tensor(), 0.0)), want, 1e-6);
  if (!cuda::is_available()) return;
  check_close(values(layer_norm(x.cuda(), {4}, Tensor(), Tensor(), 0.0).cpu()), want, 1e-6);
}

TEST_CASE("gradcheck: layer_norm's input, weight and bias") {
  manual_seed(312);
  gradcheck([](const TensorList& in) { return layer_norm(in[0], {5}, in[1], in[2]); },
            {leaf({3, 5}), leaf({5}), leaf({5})});
  gradcheck([](const TensorList& in) { return layer_norm(in[0], {3, 4}, in[1], in[2], 1e-3); },
            {leaf({2, 3, 4}, 2, 1), leaf({3, 4}), leaf({3, 4})});
  gradcheck([](const TensorList& in) { return layer_norm(in[0], {4}); }, {leaf({6, 4})});  // no affine
  gradcheck([](const TensorList& in) { return layer_norm(in[0], {4}, in[1]); }, {leaf({6, 4}), leaf({4})});
  // A non-contiguous input (a transposed view), and a bias that does not require grad.
  const Tensor base = leaf({4, 3});
  gradcheck([](const TensorList& in) { return layer_norm(in[0].t(), {4}, in[1], in[2]); },
            {base, leaf({4}), leaf({4}).detach()});
}

TEST_CASE("layer_norm refuses what PyTorch's refuses, naming the argument, the shapes and dtypes") {
  const Tensor x = randn({2, 3, 4});
  CHECK(contains(error_of([&] { layer_norm(x, {3}); }),
                 "layer_norm: normalized_shape [3] must be the last dims of the input's shape, got input "
                 "float32[2, 3, 4]"));
  CHECK(contains(error_of([&] { layer_norm(x, {1, 2, 3, 4}); }),
                 "normalized_shape [1, 2, 3, 4] must be the last dims"));
  CHECK(contains(error_of([&] { layer_norm(x, {}); }), "layer_norm: normalized_shape is empty"));
  CHECK(contains(error_of([&] { layer_norm(x, {4}, ones({3})); }),
                 "layer_norm: weight must have normalized_shape [4] and the input's dtype and device (input "
                 "float32[2, 3, 4] cpu), got float32[3] cpu"));
  CHECK(contains(error_of([&] { layer_norm(x, {4}, Tensor(), ones({4}, {.dtype = kFloat64})); }),
                 "layer_norm: bias must have normalized_shape [4]"));
  CHECK(contains(error_of([&] { layer_norm(arange(4), {4}); }),
                 "layer_norm: expected a floating-point input, got int64[4]"));
  CHECK(contains(error_of([&] { layer_norm(x, {4}, Tensor(), Tensor(), -1); }),
                 "layer_norm: eps must be a number >= 0"));
  CHECK(contains(error_of([&] { layer_norm(x, {4}, Tensor(), Tensor(), NAN); }), "eps must be a number >= 0, got nan"));
  CHECK(contains(error_of([] { layer_norm(Tensor(), {4}); }), "layer_norm: the input is an undefined tensor"));
}

TEST_CASE("layer_norm of no rows is empty, and its parameters' gradients are zeros") {
  Tensor w = ones({4}).requires_grad_(), b = zeros({4}).requires_grad_();
  Tensor x = empty({0, 4}).requires_grad_();
  Tensor y = layer_norm(x, {4}, w, b);
  CHECK(y.shape() == Shape{0, 4});
  y.sum().backward();
  CHECK(values(w.grad()) == std::vector<double>(4, 0.0));
  CHECK(values(b.grad()) == std::vector<double>(4, 0.0));
  CHECK(x.grad().shape() == Shape{0, 4});
}

TEST_CASE("under autocast layer_norm runs in float32, as PyTorch's autocast lists it") {
  const Tensor x = randn({2, 8}).to(kFloat16);
  const Tensor w = ones({8}).to(kFloat16);
  amp::AutocastGuard guard(kFloat16);
  CHECK(layer_norm(x, {8}).dtype() == kFloat32);
  CHECK(layer_norm(x, {8}, w, w).dtype() == kFloat32);
}

TEST_CASE("an in-place change to layer_norm's input before backward is refused") {
  Tensor x = randn({2, 4}).requires_grad_();
  Tensor h = x * 2;
  Tensor y = layer_norm(h, {4});
  {
    NoGradGuard no_grad;
    h.add_(1);
  }
  CHECK(contains(error_of([&] { y.sum().backward(); }), "layer_norm"));
}

TEST_CASE("nn::LayerNorm: ones and zeros of normalized_shape, PyTorch's options and printing") {
  nn::LayerNorm ln(Shape{3, 4});
  CHECK(ln.weight.shape() == Shape{3, 4});
  CHECK(values(ln.weight) == std::vector<double>(12, 1.0));
  CHECK(values(ln.bias) == std::vector<double>(12, 0.0));
  CHECK(ln.parameters().size() == 2);
  CHECK(ln.repr() == "LayerNorm((3, 4), eps=1e-05, elementwise_affine=True)");
  CHECK(nn::LayerNorm(8).repr() == "LayerNorm((8,), eps=1e-05, elementwise_affine=True)");
  CHECK(nn::LayerNorm(8, {.elementwise_affine = false}).parameters().empty());
  nn::LayerNorm weight_only(8, {.bias = false});
  CHECK(weight_only.parameters().size() == 1);
  CHECK(!weight_only.bias.defined());
  CHECK(contains(error_of([] { nn::LayerNorm(Shape{}); }), "LayerNorm: normalized_shape is empty"));
  CHECK(contains(error_of([] { nn::LayerNorm(Shape{4, -1}); }), "LayerNorm"));

  manual_seed(313);
  const Tensor x = randn({2, 3, 4});
  {
    NoGradGuard no_grad;
    ln.weight.copy_(randn({3, 4}));
    ln.bias.copy_(randn({3, 4}));
  }
  CHECK(values(ln(x)) == values(layer_norm(x, {3, 4}, ln.weight, ln.bias)));
  ln(x).pow(2).sum().backward();
  CHECK(ln.weight.grad().defined());
  CHECK(ln.bias.grad().defined());
  // The same in eval: no running statistics.
  ln.eval();
  CHECK(values(ln(x)) == values(layer_norm(x, {3, 4}, ln.weight, ln.bias)));
}

TEST_CASE("CUDA layer_norm matches the CPU, forward and backward, over warp rows, block rows and many row chunks") {
  SKIP_WITHOUT_GPU();
  manual_seed(314);
  // {rows, cols}: short rows (a warp each), a row longer than 1024 (a block each), rows past one chunk of the
  // parameters' sums (256), a column count that is not a multiple of the 32-column tiles, more rows than 1024 chunks
  // of 256 (the chunks grow).
  for (auto [rows, cols] :
       {std::pair<int64_t, int64_t>{7, 10}, {3, 2000}, {1000, 48}, {600, 33}, {1, 1}, {270000, 3}}) {
    for (DType dt : {kFloat64, kFloat32, kFloat16, kBFloat16}) {
      for (bool affine : {true, false}) {
        CAPTURE(rows);
        CAPTURE(cols);
        CAPTURE(std::string(dtype_name(dt)));
        CAPTURE(affine);
        const Tensor x = (randn({rows, cols}, {.dtype = kFloat64}) * 3 + 1).to(dt);
        const Tensor g = randn({rows, cols}, {.dtype = kFloat64}).to(dt);
        const Tensor w = randn({cols}, {.dtype = kFloat64}).to(dt), b = randn({cols}, {.dtype = kFloat64}).to(dt);
        Tensor xc = x.detach().requires_grad_(), xg = x.cuda().requires_grad_();
        Tensor wc = w.detach().requires_grad_(), wg = w.cuda().requires_grad_();
        Tensor bc = b.detach().requires_grad_(), bg = b.cuda().requires_grad_();
        const Tensor yc = affine ? layer_norm(xc, {cols}, wc, bc) : layer_norm(xc, {cols});
        const Tensor yg = affine ? layer_norm(xg, {cols}, wg, bg) : layer_norm(xg, {cols});
        yc.backward(g);
        yg.backward(g.cuda());
        // Against the CPU in float64 on the same (rounded) values: CUDA sums in float32 in another order, then rounds
        // once to dt; the parameters' gradients are sums over up to 270,000 rows.
        const double tol = dt == kFloat64 ? 1e-12 : dt == kFloat32 ? 2e-5 : 2 * rounding(dt);
        if (dt != kFloat64) {
          Tensor x64 = xc.detach().to(kFloat64).requires_grad_(), w64 = wc.detach().to(kFloat64).requires_grad_();
          Tensor b64 = bc.detach().to(kFloat64).requires_grad_();
          (affine ? layer_norm(x64, {cols}, w64, b64) : layer_norm(x64, {cols})).backward(g.to(kFloat64));
          xc = x64, wc = w64, bc = b64;
        }
        const double statistics = dt == kFloat64 ? 1.2e-16 : 6e-8;  // half an ulp of 1 in the statistics' dtype
        check_close_by_row(values(yg.cpu()), values(yc), xc.detach().to(kFloat64), tol, statistics, 1);
        check_close_by_row(values(xg.grad().cpu()), values(xc.grad()), xc.detach().to(kFloat64), tol, statistics, 2);
        if (affine) {
          const double sums = dt == kFloat64 ? 1e-12 : dt == kFloat32 ? 1e-4 : 2 * rounding(dt);
          check_close(values(wg.grad().cpu()), values(wc.grad()), sums);
          check_close(values(bg.grad().cpu()), values(bc.grad()), sums);
        }
      }
    }
  }
}

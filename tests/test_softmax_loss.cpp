// softmax, log_softmax and the classification losses (nll_loss, cross_entropy, binary_cross_entropy and its
// logits version): values against float64 references computed here by the obvious formulas, PyTorch's
// conventions (weighted mean, ignore_index, label smoothing), errors, gradchecks, autocast, CUDA vs CPU.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/autocast.h"
#include "core/cuda.h"
#include "halfgrad.h"
#include "tests/testing.h"
#include "ops/loss.h"
#include "ops/softmax.h"
#include "tests/gradcheck.h"

using namespace halfgrad;
using halfgrad::testing::values;
using halfgrad::testing::check_close;
using halfgrad::testing::gradcheck;
using halfgrad::testing::leaf;

namespace {

// softmax over `dim` of a row-major tensor, in float64, the obvious way.
std::vector<double> reference_softmax(const Tensor& x, int64_t dim, bool log) {
  std::vector<double> v = values(x), out(v.size());
  const Shape& s = x.shape();
  int64_t outer = 1, size = s.empty() ? 1 : s[size_t(dim)], inner = 1;
  for (int64_t d = 0; d < int64_t(s.size()); ++d) {
    if (d < dim) outer *= s[size_t(d)];
    if (d > dim) inner *= s[size_t(d)];
  }
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = 0; i < inner; ++i) {
      auto at = [&](int64_t j) { return size_t((o * size + j) * inner + i); };
      double m = -INFINITY, sum = 0;
      for (int64_t j = 0; j < size; ++j) m = std::max(m, v[at(j)]);
      for (int64_t j = 0; j < size; ++j) sum += std::exp(v[at(j)] - m);
      for (int64_t j = 0; j < size; ++j) out[at(j)] = log ? v[at(j)] - m - std::log(sum) : std::exp(v[at(j)] - m) / sum;
    }
  return out;
}


// The tolerance of a result rounded once to dt from float32 (or float64) arithmetic.
double rounding(DType dt) {
  return dt == kFloat64 ? 1e-12 : dt == kFloat32 ? 2e-6 : dt == kFloat16 ? 2e-3 : 1.6e-2;
}

Tensor labels(const std::vector<int64_t>& v, const Shape& shape) { return tensor(v, shape); }

// nll_loss in float64 by its definition: per-element -w[t] x[n, t, i] and the target weights.
struct NllReference {
  std::vector<double> loss, weights;
  double sum() const {
    double s = 0;
    for (double l : loss) s += l;
    return s;
  }
  double total_weight() const {
    double s = 0;
    for (double w : weights) s += w;
    return s;
  }
};
NllReference reference_nll(const Tensor& input, const Tensor& target, const std::vector<double>& w, int64_t ignore) {
  std::vector<double> x = values(input);
  std::vector<int64_t> t = to_vector<int64_t>(target);
  const int64_t batch = input.dim() == 1 ? 1 : input.size(0), classes = input.size(input.dim() == 1 ? 0 : 1);
  const int64_t inner = input.numel() / (batch * classes);
  NllReference r;
  for (int64_t n = 0; n < batch; ++n)
    for (int64_t i = 0; i < inner; ++i) {
      const int64_t c = t[size_t(n * inner + i)];
      const double wc = c == ignore ? 0.0 : (w.empty() ? 1.0 : w[size_t(c)]);
      r.loss.push_back(c == ignore ? 0.0 : -wc * x[size_t((n * classes + c) * inner + i)]);
      r.weights.push_back(wc);
    }
  return r;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// softmax / log_softmax
// ---------------------------------------------------------------------------------------------------

TEST_CASE("softmax and log_softmax match a float64 reference along every dim and in every dtype") {
  manual_seed(101);
  for (DType dt : {kFloat64, kFloat32, kFloat16, kBFloat16}) {
    for (int64_t dim : {0, 1, 2, -1}) {
      const std::string dtype = dtype_name(dt);
      CAPTURE(dtype);
      CAPTURE(dim);
      Tensor x = (randn({3, 5, 7}, {.dtype = kFloat64}) * 3).to(dt);
      const int64_t d = dim < 0 ? dim + 3 : dim;
      Tensor y = softmax(x, dim), ly = log_softmax(x, dim);
      CHECK(y.dtype() == dt);
      CHECK(y.shape() == x.shape());
      check_close(values(y), reference_softmax(x, d, false), rounding(dt));
      check_close(values(ly), reference_softmax(x, d, true), rounding(dt));
    }
  }
}

TEST_CASE("softmax rows of every length: one element, short, and longer than a thread block") {
  manual_seed(102);
  for (int64_t n : {1, 3, 33, 1000, 5000}) {
    CAPTURE(n);
    Tensor x = randn({4, n}, {.dtype = kFloat64});
    check_close(values(softmax(x, -1)), reference_softmax(x, 1, false), 1e-12);
    check_close(values(log_softmax(x, 1)), reference_softmax(x, 1, true), 1e-12);
  }
  // A 0-d input is a row of one element.
  CHECK(softmax(scalar_tensor(3.5), 0).item<double>() == 1.0);
  CHECK(log_softmax(scalar_tensor(3.5), -1).item<double>() == 0.0);
}

TEST_CASE("softmax subtracts the row maximum: huge logits give no inf or nan") {
  for (DType dt : {kFloat32, kFloat16}) {
    // exp(1000) overflows float32 and float16 (and float64); exp(0) does not. Integers up to 2048 are
    // exact in float16.
    Tensor x = tensor<double>({1000, 1001, 1002, -1000}, {.dtype = dt});
    std::vector<double> y = values(softmax(x, 0)), ly = values(log_softmax(x, 0));
    const double z = 1 + std::exp(-1.0) + std::exp(-2.0);
    check_close(y, {std::exp(-2.0) / z, std::exp(-1.0) / z, 1 / z, 0.0}, rounding(dt));
    CHECK(std::isfinite(ly[0]));
    CHECK(ly[2] == doctest::Approx(-std::log(z)).epsilon(rounding(dt)));
  }
}

TEST_CASE("softmax accumulates float16 rows in float32: a 4096-wide row sums to one") {
  // In float16 arithmetic the running sum of 4096 terms near 1 loses its low bits (spacing 2 at 4096).
  Tensor x = (randn({2, 4096}) * 0.01).to(kFloat16);
  Tensor y = softmax(x, 1);
  CHECK(y.dtype() == kFloat16);
  CHECK(y.to(kFloat64).sum({1}).sub(1.0).abs().max().item<double>() < 2e-3);
  check_close(values(y), reference_softmax(x, 1, false), 2e-3);
}

TEST_CASE("softmax and log_softmax gradients match finite differences, on last and non-last dims") {
  manual_seed(103);
  for (int64_t dim : {-1, 0, 1}) {
    CAPTURE(dim);
    gradcheck([dim](const TensorList& in) { return softmax(in[0], dim); }, {leaf({3, 4, 5})});
    gradcheck([dim](const TensorList& in) { return log_softmax(in[0], dim); }, {leaf({3, 4, 5})});
  }
  // A non-contiguous input (transposed view).
  Tensor base = leaf({5, 4});
  gradcheck([](const TensorList& in) { return softmax(in[0].t(), 1); }, {base});
  gradcheck([](const TensorList& in) { return log_softmax(in[0].t(), 0); }, {base});
}

TEST_CASE("softmax of an integer tensor is an error naming the op and the operand") {
  CHECK_THROWS_WITH_AS(softmax(arange(4), 0), doctest::Contains("softmax: expected a floating-point input, got int64[4]"),
                       Error);
  CHECK_THROWS_WITH_AS(log_softmax(randn({2, 3}), 2), doctest::Contains("log_softmax"), Error);
}

TEST_CASE("under autocast, softmax and log_softmax run in float32") {
  Tensor x = randn({2, 8}).to(kFloat16);
  amp::AutocastGuard guard(kFloat16);
  CHECK(softmax(x, 1).dtype() == kFloat32);
  CHECK(log_softmax(x, 1).dtype() == kFloat32);
}

// ---------------------------------------------------------------------------------------------------
// nll_loss
// ---------------------------------------------------------------------------------------------------

TEST_CASE("nll_loss picks -w[t] * input[t] and takes PyTorch's weighted mean") {
  manual_seed(104);
  Tensor input = randn({5, 4}, {.dtype = kFloat64});
  Tensor target = labels({0, 3, -100, 1, 3}, {5});
  std::vector<double> w{0.5, 2.0, 1.0, 3.0};
  Tensor weight = tensor(w);
  NllReference r = reference_nll(input, target, w, -100);
  check_close(values(nll_loss(input, target, {.weight = weight, .reduction = Reduction::None})), r.loss, 1e-12);
  CHECK(nll_loss(input, target, {.weight = weight, .reduction = Reduction::Sum}).item<double>() ==
        doctest::Approx(r.sum()).epsilon(1e-12));
  // Mean divides by the weights of the targets used (0.5 + 3 + 2 + 3), not by N.
  CHECK(r.total_weight() == 8.5);
  CHECK(nll_loss(input, target, {.weight = weight}).item<double>() ==
        doctest::Approx(r.sum() / 8.5).epsilon(1e-12));
  // Without weights the mean is over the 4 targets that are not ignored.
  NllReference plain = reference_nll(input, target, {}, -100);
  CHECK(nll_loss(input, target).item<double>() == doctest::Approx(plain.sum() / 4).epsilon(1e-12));
}

TEST_CASE("nll_loss by hand: three samples") {
  // log-probabilities of three samples, targets 2, 0, 1: loss = -(-0.1 + -1.2 + -0.7) / 3
  Tensor input = tensor<double>({-2.0, -1.5, -0.1, -1.2, -0.9, -1.0, -3.0, -0.7, -0.8}, {3, 3});
  CHECK(nll_loss(input, labels({2, 0, 1}, {3})).item<double>() == doctest::Approx(2.0 / 3.0));
  CHECK(nll_loss(input, labels({2, 0, 1}, {3}), {.ignore_index = 0}).item<double>() == doctest::Approx(0.8 / 2.0));
}

TEST_CASE("nll_loss handles per-pixel targets [N, C, H, W] and a single unbatched sample [C]") {
  manual_seed(105);
  Tensor input = randn({2, 3, 4, 5}, {.dtype = kFloat64});
  Tensor target = randint(0, 3, {2, 4, 5});
  NllReference r = reference_nll(input, target, {}, -100);
  Tensor none = nll_loss(input, target, {.reduction = Reduction::None});
  CHECK(none.shape() == Shape{2, 4, 5});
  check_close(values(none), r.loss, 1e-12);
  CHECK(nll_loss(input, target).item<double>() == doctest::Approx(r.sum() / 40).epsilon(1e-12));

  Tensor one = randn({6}, {.dtype = kFloat64});
  Tensor t = scalar_tensor(int64_t(4), {.dtype = kInt64});
  Tensor l = nll_loss(one, t, {.reduction = Reduction::None});
  CHECK(l.dim() == 0);
  CHECK(l.item<double>() == -values(one)[4]);
}

TEST_CASE("nll_loss: a mean over only ignored targets is nan, and their gradient is zero") {
  Tensor input = randn({2, 3}, {.dtype = kFloat64}).requires_grad_();
  Tensor loss = nll_loss(input, labels({-100, -100}, {2}));
  CHECK(std::isnan(loss.item<double>()));
  loss.backward();
  CHECK(input.grad().abs().sum().item<double>() == 0.0);
}

TEST_CASE("nll_loss errors name the op, the offending value and the shapes") {
  Tensor input = randn({4, 3});
  CHECK_THROWS_WITH_AS(nll_loss(input, labels({0, 1, 3, 0}, {4})),
                       doctest::Contains("nll_loss: target 3 at position 2 is out of range for 3 classes"), Error);
  CHECK_THROWS_WITH_AS(nll_loss(input, labels({0, -1, 1, 0}, {4})), doctest::Contains("target -1 at position 1"), Error);
  CHECK_THROWS_WITH_AS(nll_loss(input, labels({0, 1, 2}, {3})),
                       doctest::Contains("nll_loss: expected a target of shape [4] for input float32[4, 3] cpu"), Error);
  CHECK_THROWS_WITH_AS(nll_loss(input, randn({4})), doctest::Contains("expected class indices (int64)"), Error);
  CHECK_THROWS_WITH_AS(nll_loss(input, labels({0, 1, 2, 0}, {4}), {.weight = ones({4})}),
                       doctest::Contains("expected a floating-point weight of shape [3]"), Error);
  CHECK_THROWS_WITH_AS(cross_entropy(input, labels({0, 1, 7, 0}, {4})),
                       doctest::Contains("cross_entropy: target 7 at position 2 is out of range for 3 classes"), Error);
}

TEST_CASE("nll_loss gradients match finite differences, with weights and ignore_index, in every reduction") {
  manual_seed(106);
  Tensor weight = tensor<double>({0.3, 1.5, 2.0, 0.7});
  for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
    CAPTURE(reduction_name(r));
    Tensor target = labels({1, 3, 2, 3, 0}, {5});
    gradcheck([&](const TensorList& in) { return nll_loss(in[0], target, {.weight = weight, .ignore_index = 2, .reduction = r}); },
              {leaf({5, 4})});
    Tensor pixels = labels({0, 1, 2, 1, 1, 0}, {2, 3});
    gradcheck([&](const TensorList& in) { return nll_loss(in[0], pixels, {.ignore_index = 1, .reduction = r}); },
              {leaf({2, 3, 3})});
  }
}

// ---------------------------------------------------------------------------------------------------
// cross_entropy
// ---------------------------------------------------------------------------------------------------

// PyTorch's cross_entropy with label smoothing, in float64, from its definition.
double reference_cross_entropy(const Tensor& logits, const Tensor& target, const std::vector<double>& w, int64_t ignore,
                               double eps, Reduction reduction, std::vector<double>* per_element = nullptr) {
  const int64_t classes = logits.size(1);
  Tensor logp = tensor(reference_softmax(logits.to(kFloat64), 1, true), logits.shape());
  NllReference nll = reference_nll(logp, target, w, ignore);
  std::vector<double> lp = values(logp);
  std::vector<int64_t> t = to_vector<int64_t>(target);
  const int64_t batch = logits.size(0), inner = logits.numel() / (batch * classes);
  std::vector<double> smooth;
  for (int64_t n = 0; n < batch; ++n)
    for (int64_t i = 0; i < inner; ++i) {
      double s = 0;
      for (int64_t c = 0; c < classes; ++c) s -= (w.empty() ? 1.0 : w[size_t(c)]) * lp[size_t((n * classes + c) * inner + i)];
      smooth.push_back(t[size_t(n * inner + i)] == ignore ? 0.0 : s);
    }
  double smooth_sum = 0;
  for (double s : smooth) smooth_sum += s;
  if (per_element) {
    per_element->clear();
    for (size_t k = 0; k < smooth.size(); ++k)
      per_element->push_back((1 - eps) * nll.loss[k] + eps / double(classes) * smooth[k]);
  }
  switch (reduction) {
    case Reduction::Sum: return (1 - eps) * nll.sum() + eps / double(classes) * smooth_sum;
    case Reduction::Mean: return ((1 - eps) * nll.sum() + eps / double(classes) * smooth_sum) / nll.total_weight();
    case Reduction::None: return 0;
  }
  return 0;
}

TEST_CASE("cross_entropy = nll_loss(log_softmax) with PyTorch's label smoothing, weights and ignore_index") {
  manual_seed(107);
  Tensor logits = randn({6, 5}, {.dtype = kFloat64}) * 2;
  Tensor target = labels({4, 0, 2, -1, 2, 1}, {6});
  std::vector<double> w{1.0, 0.5, 2.0, 1.5, 0.25};
  Tensor weight = tensor(w);
  for (double eps : {0.0, 0.1, 1.0}) {
    for (bool weighted : {false, true}) {
      CAPTURE(eps);
      CAPTURE(weighted);
      const std::vector<double> ww = weighted ? w : std::vector<double>{};
      CrossEntropyOptions o{.weight = weighted ? weight : Tensor(), .ignore_index = -1, .label_smoothing = eps};
      CHECK(cross_entropy(logits, target, o).item<double>() ==
            doctest::Approx(reference_cross_entropy(logits, target, ww, -1, eps, Reduction::Mean)).epsilon(1e-12));
      o.reduction = Reduction::Sum;
      CHECK(cross_entropy(logits, target, o).item<double>() ==
            doctest::Approx(reference_cross_entropy(logits, target, ww, -1, eps, Reduction::Sum)).epsilon(1e-12));
      o.reduction = Reduction::None;
      std::vector<double> per;
      reference_cross_entropy(logits, target, ww, -1, eps, Reduction::None, &per);
      check_close(values(cross_entropy(logits, target, o)), per, 1e-12);
    }
  }
}

TEST_CASE("cross_entropy with label smoothing compares targets of any integer dtype with ignore_index as int64") {
  // -100 as a uint8 is 156: class 156 is a class, and keeps its smoothing term.
  manual_seed(108);
  const Tensor logits = randn({2, 200}, {.dtype = kFloat64});
  const CrossEntropyOptions o{.label_smoothing = 0.1, .reduction = Reduction::None};
  const Tensor narrow = tensor<uint8_t>({156, 3}, {2});
  check_close(values(cross_entropy(logits, narrow, o)), values(cross_entropy(logits, narrow.to(kInt64), o)), 0);
}

TEST_CASE("cross_entropy over zero classes: every target is ignored, the mean is nan and the sum 0, as nll_loss") {
  for (const Shape& shape : {Shape{2, 0}, Shape{0}}) {
    const Tensor logits = zeros(shape, {.dtype = kFloat64}).requires_grad_();
    const Tensor target = shape.size() == 2 ? labels({-100, -100}, {2}) : labels({-100}, {});
    CHECK(std::isnan(cross_entropy(logits, target).item<double>()));
    const Tensor sum = cross_entropy(logits, target, {.reduction = Reduction::Sum});
    CHECK(sum.item<double>() == 0.0);
    sum.backward();
    CHECK(logits.grad().numel() == 0);
  }
  CHECK_THROWS_AS(cross_entropy(zeros({2, 0}), labels({0, -100}, {2})), Error);  // class 0 does not exist
}

TEST_CASE("cross_entropy by hand: logits [0, ln 2, ln 3] have probabilities [1/6, 2/6, 3/6]") {
  Tensor logits = tensor<double>({0.0, std::log(2.0), std::log(3.0)}, {1, 3});
  CHECK(cross_entropy(logits, labels({2}, {1})).item<double>() == doctest::Approx(std::log(2.0)));
  // Label smoothing 0.3: 0.7 * -log(1/2) + 0.1 * -(log(1/6) + log(2/6) + log(3/6)).
  const double want = 0.7 * std::log(2.0) - 0.1 * (std::log(1.0 / 6) + std::log(2.0 / 6) + std::log(3.0 / 6));
  CHECK(cross_entropy(logits, labels({2}, {1}), {.label_smoothing = 0.3}).item<double>() == doctest::Approx(want));
}

TEST_CASE("cross_entropy's gradient for a class index is softmax minus the one-hot target, times its weight") {
  // Row 0: logits [0, ln 2, ln 3] (probabilities [1/6, 2/6, 3/6]), target 2 of weight 4; row 1 is ignored.
  Tensor x = tensor<double>({0.0, std::log(2.0), std::log(3.0), 5.0, -1.0, 2.0}, {2, 3}).requires_grad_();
  Tensor loss = cross_entropy(x, labels({2, -100}, {2}), {.weight = tensor<double>({1.0, 1.0, 4.0}),
                                                          .reduction = Reduction::Sum});
  CHECK(loss.item<double>() == doctest::Approx(4.0 * std::log(2.0)));  // -4 log(3/6)
  loss.backward();
  check_close(values(x.grad()), {4.0 / 6, 4.0 * 2 / 6, 4.0 * (3.0 / 6 - 1), 0.0, 0.0, 0.0}, 1e-15);
}

TEST_CASE("cross_entropy with class-probability targets, per-pixel logits and an unbatched sample") {
  manual_seed(108);
  Tensor logits = randn({3, 4}, {.dtype = kFloat64});
  Tensor probs = softmax(randn({3, 4}, {.dtype = kFloat64}), 1);
  std::vector<double> lp = reference_softmax(logits, 1, true), p = values(probs);
  double total = 0;
  for (size_t k = 0; k < lp.size(); ++k) total -= p[k] * lp[k];
  CHECK(cross_entropy(logits, probs).item<double>() == doctest::Approx(total / 3).epsilon(1e-12));
  CHECK(cross_entropy(logits, probs, {.reduction = Reduction::Sum}).item<double>() == doctest::Approx(total).epsilon(1e-12));
  // One-hot probabilities give the class-index loss.
  Tensor target = labels({3, 0, 2}, {3});
  Tensor one_hot = tensor<double>({0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 0}, {3, 4});
  CHECK(cross_entropy(logits, one_hot, {.label_smoothing = 0.2}).item<double>() ==
        doctest::Approx(cross_entropy(logits, target, {.label_smoothing = 0.2}).item<double>()).epsilon(1e-12));

  Tensor pixels = randn({2, 3, 2, 2}, {.dtype = kFloat64});
  Tensor pixel_target = randint(0, 3, {2, 2, 2});
  CHECK(cross_entropy(pixels, pixel_target, {.label_smoothing = 0.1}).item<double>() ==
        doctest::Approx(reference_cross_entropy(pixels, pixel_target, {}, -100, 0.1, Reduction::Mean)).epsilon(1e-12));

  Tensor sample = randn({4}, {.dtype = kFloat64});
  CHECK(cross_entropy(sample, scalar_tensor(int64_t(1), {.dtype = kInt64})).item<double>() ==
        doctest::Approx(-reference_softmax(sample, 0, true)[1]).epsilon(1e-12));
}

TEST_CASE("cross_entropy gradients match finite differences: weights, ignore_index, label smoothing, probabilities") {
  manual_seed(109);
  Tensor weight = tensor<double>({0.5, 1.0, 2.0, 1.5});
  Tensor target = labels({3, 0, -100, 2, 3}, {5});
  for (Reduction r : {Reduction::Mean, Reduction::Sum, Reduction::None}) {
    CAPTURE(reduction_name(r));
    gradcheck([&](const TensorList& in) {
      return cross_entropy(in[0], target, {.weight = weight, .label_smoothing = 0.15, .reduction = r});
    }, {leaf({5, 4})});
    gradcheck([&](const TensorList& in) { return cross_entropy(in[0], target, {.reduction = r}); }, {leaf({5, 4})});
    gradcheck([&](const TensorList& in) { return cross_entropy(in[0], target, {.weight = weight, .reduction = r}); },
              {leaf({5, 4})});
  }
  Tensor pixel_target = labels({0, 2, 1, 1, 2, 0, 0, 1}, {2, 2, 2});
  for (double smoothing : {0.0, 0.2}) {
    CAPTURE(smoothing);
    gradcheck([&](const TensorList& in) {
      return cross_entropy(in[0], pixel_target, {.ignore_index = 1, .label_smoothing = smoothing});
    }, {leaf({2, 3, 2, 2})});
  }
  // Probability targets: the gradient reaches the target as well.
  Tensor probs = leaf({3, 4}, 0.2, 0.25);
  gradcheck([&](const TensorList& in) { return cross_entropy(in[0], in[1], {.weight = weight, .label_smoothing = 0.1}); },
            {leaf({3, 4}), probs});
}

TEST_CASE("cross_entropy under autocast runs in float32, without it a float16 loss keeps float16") {
  manual_seed(110);
  Tensor logits = randn({4, 10}).to(kFloat16).requires_grad_();
  Tensor target = labels({1, 9, 0, 3}, {4});
  Tensor plain = cross_entropy(logits, target);
  CHECK(plain.dtype() == kFloat16);
  Tensor reference = cross_entropy(logits.detach().to(kFloat64), target);
  CHECK(plain.item<double>() == doctest::Approx(reference.item<double>()).epsilon(2e-3));
  {
    amp::AutocastGuard guard(kFloat16);
    Tensor loss = cross_entropy(logits, target);
    CHECK(loss.dtype() == kFloat32);
    CHECK(loss.item<double>() == doctest::Approx(reference.item<double>()).epsilon(1e-5));
    CHECK(nll_loss(log_softmax(logits, 1), target).dtype() == kFloat32);
    loss.backward();
  }
  CHECK(logits.grad().dtype() == kFloat16);
}

TEST_CASE("cross_entropy's float32 math reads float16 logits as they are: the result of casting them first") {
  // Autocast's "float32 math" rule: no float32 copy of the logits, yet the loss and the gradient are those of
  // cross_entropy on float32 logits (the gradient rounded to float16 once), with a float32 loss that a loss scale
  // of 65536 does not overflow.
  manual_seed(116);
  for (Shape shape : {Shape{5, 37}, Shape{3, 4, 2, 3}}) {
    CAPTURE(shape_str(shape));
    Tensor logits = (randn(shape) * 3).to(kFloat16);
    Tensor target = randint(0, shape[1], shape.size() == 2 ? Shape{5} : Shape{3, 2, 3});
    for (double smoothing : {0.0, 0.1}) {
      CAPTURE(smoothing);
      Tensor x16 = logits.detach().requires_grad_(), x32 = logits.detach().to(kFloat32).requires_grad_();
      Tensor loss16;
      {
        amp::AutocastGuard guard(kFloat16);
        loss16 = cross_entropy(x16, target, {.label_smoothing = smoothing});
      }
      Tensor loss32 = cross_entropy(x32, target, {.label_smoothing = smoothing});
      CHECK(loss16.dtype() == kFloat32);
      CHECK(loss16.item<double>() == doctest::Approx(loss32.item<double>()).epsilon(1e-6));
      (loss16 * 65536.0).backward();
      (loss32 * 65536.0).backward();
      CHECK(x16.grad().dtype() == kFloat16);
      // one float16 rounding of the same float32 values (the sums may add in another order: a float32 ulp apart)
      check_close(values(x16.grad()), values(x32.grad().to(kFloat16)), 2e-3);
    }
  }
}

TEST_CASE("cross_entropy's log-probability is (x - max) - log_sum, as log_softmax's: a small loss keeps its bits") {
  // max + log_sum would round to max's ulp: beside logits near 1000 (float32 ulp 6.1e-5) a loss of 3.06e-7 read 0,
  // and the gradient at the target with it.
  Tensor x = tensor<float>({100.0f, 90.0f, 1000.0f, 985.0f}, {2, 2}).requires_grad_();
  Tensor target = labels({0, 0}, {2});
  Tensor loss = cross_entropy(x, target, {.reduction = Reduction::None});
  Tensor reference = nll_loss(log_softmax(x.detach(), 1), target, {.reduction = Reduction::None});
  CHECK(values(loss) == values(reference));  // the same float32 operations, bit for bit
  CHECK(loss[1].item<double>() == doctest::Approx(std::log1p(std::exp(-15.0))).epsilon(0.2));  // 3.06e-7, not 0
  loss.sum().backward();
  CHECK(x.grad()[1][0].item<double>() < 0.0);  // p - 1 = -3.06e-7: softmax((x - m) - log_sum)
  CHECK(x.grad()[1][0].item<double>() == doctest::Approx(-std::exp(-15.0)).epsilon(0.2));
}

TEST_CASE("cross_entropy's backward refuses targets or class weights changed in place after the forward") {
  // Both may be the caller's own tensors (an int64 target, a weight of the accumulation dtype): the backward would
  // read the new values, a gradient of another loss.
  Tensor x = tensor<float>({1, 2, 3, 4, 5, 6}, {2, 3}).requires_grad_();
  Tensor target = labels({0, 1}, {2});
  Tensor loss = cross_entropy(x, target);
  target.copy_(labels({2, 2}, {2}));
  CHECK_THROWS_WITH_AS(loss.backward(), doctest::Contains("modified by an in-place operation"), Error);
  Tensor weight = ones({3});
  Tensor weighted = cross_entropy(x, labels({0, 1}, {2}), {.weight = weight, .reduction = Reduction::Sum});
  weight.fill_(5.0);
  CHECK_THROWS_WITH_AS(weighted.backward(), doctest::Contains("modified by an in-place operation"), Error);
}

TEST_CASE("class weights that require grad: refused where PyTorch's nll_loss refuses them, differentiated otherwise") {
  Tensor x = randn({3, 4}, {.dtype = kFloat64});
  Tensor w = (rand({4}, {.dtype = kFloat64}) + 0.5).requires_grad_();
  Tensor target = labels({0, 3, 1}, {3});
  for (double smoothing : {0.0, 0.1}) {
    CAPTURE(smoothing);
    CHECK_THROWS_WITH_AS(cross_entropy(x, target, {.weight = w, .label_smoothing = smoothing}),
                         doctest::Contains("cross_entropy: the weight float64[4] cpu requires grad, but cross_entropy "
                                           "is not differentiable with respect to its weight"), Error);
  }
  CHECK_THROWS_WITH_AS(nll_loss(x, target, {.weight = w}), doctest::Contains("pass weight.detach()"), Error);
  {
    NoGradGuard no_grad;  // as PyTorch: the weight's requires_grad is refused even here
    CHECK_THROWS_AS(nll_loss(x, target, {.weight = w}), Error);
  }
  CHECK_NOTHROW(cross_entropy(x, target, {.weight = w.detach()}));
  // Class probabilities are a composition of ops in PyTorch: the weight gets its gradient.
  Tensor probs = softmax(randn({3, 4}, {.dtype = kFloat64}), 1);
  gradcheck([&](const TensorList& in) { return cross_entropy(in[0], probs, {.weight = in[1]}); },
            {leaf({3, 4}), leaf({4}, 0.5, 1.0)});
  // The binary cross-entropies refuse a weight or pos_weight that requires grad.
  Tensor p = rand({2, 3}, {.dtype = kFloat64}), y = rand({2, 3}, {.dtype = kFloat64});
  Tensor bw = ones({2, 3}, {.dtype = kFloat64}).requires_grad_();
  CHECK_THROWS_WITH_AS(binary_cross_entropy(p, y, {.weight = bw}),
                       doctest::Contains("binary_cross_entropy: the weight float64[2, 3] cpu requires grad"), Error);
  CHECK_THROWS_WITH_AS(binary_cross_entropy_with_logits(p, y, {.weight = bw}),
                       doctest::Contains("binary_cross_entropy_with_logits: the weight"), Error);
  CHECK_THROWS_WITH_AS(binary_cross_entropy_with_logits(p, y, {.pos_weight = bw}),
                       doctest::Contains("binary_cross_entropy_with_logits: the pos_weight"), Error);
}

TEST_CASE("cross_entropy with class probabilities: ignore_index is refused, the mean of no logits is nan") {
  Tensor logits = zeros({2, 3}), probs = full({2, 3}, 1.0 / 3);
  CHECK_THROWS_WITH_AS(cross_entropy(logits, probs, {.ignore_index = 1}),
                       doctest::Contains("ignore_index (1) does not apply to a floating-point target"), Error);
  CHECK(cross_entropy(logits, probs, {.ignore_index = -1}).item<double>() == doctest::Approx(std::log(3.0)));
  for (const Shape& shape : {Shape{2, 0}, Shape{0, 3}}) {
    CAPTURE(shape_str(shape));
    Tensor none = zeros(shape).requires_grad_();
    Tensor mean = cross_entropy(none, zeros(shape));
    CHECK(std::isnan(mean.item<double>()));  // PyTorch: nan for an empty input, [2, 0] too
    mean.backward();                         // and its graph stays: an empty gradient
    CHECK(none.grad().shape() == shape);
    CHECK(cross_entropy(none, zeros(shape), {.reduction = Reduction::Sum}).item<double>() == 0.0);
  }
}

TEST_CASE("cross_entropy errors: float targets of the wrong shape, label_smoothing out of range") {
  Tensor logits = randn({2, 3});
  CHECK_THROWS_WITH_AS(cross_entropy(logits, randn({2})),
                       doctest::Contains("cross_entropy: a floating-point target holds class probabilities"), Error);
  CHECK_THROWS_WITH_AS(cross_entropy(logits, labels({0, 1}, {2}), {.label_smoothing = 1.5}),
                       doctest::Contains("label_smoothing must be in [0, 1], got 1.5"), Error);
  CHECK_THROWS_WITH_AS(cross_entropy(arange(3), labels({0}, {1})), doctest::Contains("expected floating-point logits"),
                       Error);
}

// ---------------------------------------------------------------------------------------------------
// binary cross-entropy
// ---------------------------------------------------------------------------------------------------

TEST_CASE("binary_cross_entropy matches -w (y log p + (1 - y) log(1 - p)), with logs clamped at -100") {
  manual_seed(111);
  Tensor p = rand({3, 4}, {.dtype = kFloat64}) * 0.98 + 0.01;
  Tensor y = rand({3, 4}, {.dtype = kFloat64});
  Tensor w = rand({4}, {.dtype = kFloat64}) + 0.5;
  std::vector<double> pv = values(p), yv = values(y), wv = values(w), want;
  double sum = 0;
  for (size_t k = 0; k < pv.size(); ++k) {
    want.push_back(-wv[k % 4] * (yv[k] * std::log(pv[k]) + (1 - yv[k]) * std::log(1 - pv[k])));
    sum += want.back();
  }
  check_close(values(binary_cross_entropy(p, y, {.weight = w, .reduction = Reduction::None})), want, 1e-12);
  CHECK(binary_cross_entropy(p, y, {.weight = w}).item<double>() == doctest::Approx(sum / 12).epsilon(1e-12));
  CHECK(binary_cross_entropy(p, y, {.weight = w, .reduction = Reduction::Sum}).item<double>() ==
        doctest::Approx(sum).epsilon(1e-12));
  // p = 0 with y = 1: log(0) = -inf is clamped to -100, as PyTorch does.
  CHECK(binary_cross_entropy(tensor<double>({0.0, 1.0}), tensor<double>({1.0, 1.0}), {.reduction = Reduction::Sum})
            .item<double>() == 100.0);
}

TEST_CASE("binary_cross_entropy gradients match finite differences for probabilities and targets") {
  manual_seed(112);
  for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
    CAPTURE(reduction_name(r));
    Tensor w = rand({2, 3}, {.dtype = kFloat64}) + 0.5;
    gradcheck([&](const TensorList& in) { return binary_cross_entropy(in[0], in[1], {.weight = w, .reduction = r}); },
              {leaf({2, 3}, 0.1, 0.5), leaf({2, 3}, 0.2, 0.5)});
  }
}

TEST_CASE("binary_cross_entropy on probabilities is refused under autocast, pointing to the logits version") {
  Tensor p = rand({4}), y = rand({4});
  amp::AutocastGuard guard(kFloat16);
  CHECK_THROWS_WITH_AS(binary_cross_entropy(p, y), doctest::Contains("binary_cross_entropy: refused under autocast"), Error);
  CHECK_THROWS_WITH_AS(binary_cross_entropy(p, y), doctest::Contains("binary_cross_entropy_with_logits"), Error);
  {
    amp::AutocastGuard off(kFloat16, /*enabled=*/false);  // the way out the message suggests
    CHECK(binary_cross_entropy(p, y).dtype() == kFloat32);
  }
  CHECK(binary_cross_entropy_with_logits(p.to(kFloat16), y).dtype() == kFloat32);
}

TEST_CASE("binary_cross_entropy checks its operands: shapes, dtypes, probabilities in [0, 1] and not nan") {
  CHECK_THROWS_WITH_AS(binary_cross_entropy(rand({4}), rand({4, 1})),
                       doctest::Contains("binary_cross_entropy: input shape [4] and target shape [4, 1] differ"), Error);
  CHECK_THROWS_WITH_AS(binary_cross_entropy(tensor<float>({0.5f, 1.5f}), rand({2})),
                       doctest::Contains("must be probabilities in [0, 1]"), Error);
  CHECK_THROWS_WITH_AS(binary_cross_entropy(tensor<double>({0.5, std::nan("")}), rand({2}, {.dtype = kFloat64})),
                       doctest::Contains("must be probabilities in [0, 1], none nan"), Error);
  CHECK_THROWS_WITH_AS(binary_cross_entropy_with_logits(randn({3}), randn({3}), {.pos_weight = ones({2})}),
                       doctest::Contains("binary_cross_entropy_with_logits"), Error);
}

TEST_CASE("binary_cross_entropy_with_logits equals bce(sigmoid(x)) with pos_weight, and stays finite for huge logits") {
  manual_seed(113);
  Tensor x = randn({4, 3}, {.dtype = kFloat64}) * 3;
  Tensor y = rand({4, 3}, {.dtype = kFloat64});
  Tensor pw = tensor<double>({0.5, 2.0, 3.0});
  Tensor w = rand({4, 1}, {.dtype = kFloat64}) + 0.5;
  std::vector<double> xv = values(x), yv = values(y), pwv = values(pw), wv = values(w), want;
  for (size_t k = 0; k < xv.size(); ++k) {
    const double s = 1 / (1 + std::exp(-xv[k]));
    want.push_back(-wv[k / 3] * (pwv[k % 3] * yv[k] * std::log(s) + (1 - yv[k]) * std::log(1 - s)));
  }
  check_close(values(binary_cross_entropy_with_logits(x, y, {.weight = w, .pos_weight = pw, .reduction = Reduction::None})),
              want, 1e-12);
  // Without pos_weight and weight: the same as binary_cross_entropy on the sigmoid.
  CHECK(binary_cross_entropy_with_logits(x, y).item<double>() ==
        doctest::Approx(binary_cross_entropy(sigmoid(x), y).item<double>()).epsilon(1e-12));
  // |x| = 100: sigmoid(100) is 1 in float64, so the probability version would clamp; this one is exact.
  Tensor big = tensor<double>({100.0, -100.0, 40.0});
  std::vector<double> l = values(binary_cross_entropy_with_logits(big, tensor<double>({0.0, 1.0, 1.0}), {.reduction = Reduction::None}));
  CHECK(l[0] == doctest::Approx(100.0));
  CHECK(l[1] == doctest::Approx(100.0));
  CHECK(l[2] == doctest::Approx(std::exp(-40.0)).epsilon(1e-9));  // log(1 + e^-40) = e^-40 to 1e-17
  Tensor f16 = binary_cross_entropy_with_logits(tensor<float>({30000.f, -30000.f}, {.dtype = kFloat16}),
                                                tensor<float>({1.f, 0.f}, {.dtype = kFloat16}), {.reduction = Reduction::Sum});
  CHECK(f16.item<double>() == 0.0);
}

TEST_CASE("binary_cross_entropy_with_logits gradients match finite differences, with pos_weight and weight") {
  manual_seed(114);
  for (Reduction r : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
    CAPTURE(reduction_name(r));
    Tensor pw = tensor<double>({0.5, 2.0, 3.0}), w = rand({2, 1}, {.dtype = kFloat64}) + 0.5;
    gradcheck([&](const TensorList& in) {
      return binary_cross_entropy_with_logits(in[0], in[1], {.weight = w, .pos_weight = pw, .reduction = r});
    }, {leaf({2, 3}, 2.0), leaf({2, 3}, 0.2, 0.5)});
    gradcheck([&](const TensorList& in) { return binary_cross_entropy_with_logits(in[0], in[1], {.reduction = r}); },
              {leaf({2, 3}, 2.0), leaf({2, 3}, 0.2, 0.5)});
  }
}

// ---------------------------------------------------------------------------------------------------
// CUDA against the CPU
// ---------------------------------------------------------------------------------------------------

TEST_CASE("CUDA softmax, log_softmax, nll_loss and cross_entropy match the CPU, forward and backward") {
#if HALFGRAD_WITH_CUDA
  SKIP_WITHOUT_GPU();
  manual_seed(115);
  for (DType dt : {kFloat32, kFloat16, kBFloat16, kFloat64}) {
    for (Shape shape : {Shape{7, 10}, Shape{3, 2000}, Shape{4, 5, 6}, Shape{64, 33}}) {
      for (int64_t dim : {-1, 1, 0}) {
        const std::string dtype = dtype_name(dt);
        CAPTURE(dtype);
        CAPTURE(shape_str(shape));
        CAPTURE(dim);
        for (bool log : {false, true}) {
          Tensor x = (randn(shape) * 4).to(dt);
          Tensor g = randn(shape).to(dt);
          Tensor xc = x.requires_grad_(), xg = x.detach().cuda().requires_grad_();
          Tensor yc = log ? log_softmax(xc, dim) : softmax(xc, dim);
          Tensor yg = log ? log_softmax(xg, dim) : softmax(xg, dim);
          yc.backward(g);
          yg.backward(g.cuda());
          check_close(values(yg.cpu()), values(yc), rounding(dt) * 2);
          check_close(values(xg.grad().cpu()), values(xc.grad()), rounding(dt) * 4);
        }
      }
    }
  }
  // Rows of any alignment (C odd), the vector path's edges (C < 8, C a multiple of 8), a language model's vocabulary,
  // and logits at an odd offset in their storage, whose gradient's rows cannot line up with theirs.
  for (DType dt : {kFloat32, kFloat16, kBFloat16, kFloat64}) {
    for (auto [rows, classes] : {std::pair<int64_t, int64_t>{9, 1}, {9, 7}, {9, 8}, {5, 33}, {6, 1001}, {3, 33278}}) {
      for (bool offset : {false, true}) {
        const std::string dtype = dtype_name(dt);
        CAPTURE(dtype);
        CAPTURE(rows);
        CAPTURE(classes);
        CAPTURE(offset);
        Tensor storage = (randn({rows * classes + 1}) * 4).to(dt);
        Tensor logits = storage.narrow(0, offset ? 1 : 0, rows * classes).view({rows, classes});
        Tensor target = randint(0, classes, {rows});
        target = where(target.eq(int64_t(0)), int64_t(-100), target);
        Tensor xc = logits.detach().requires_grad_(), xg = logits.detach().cuda().requires_grad_();
        Tensor lc = cross_entropy(xc, target, {.reduction = Reduction::Sum});
        Tensor lg = cross_entropy(xg, target.cuda(), {.reduction = Reduction::Sum});
        lc.backward();
        lg.backward();
        check_close(values(lg.cpu()), values(lc), rounding(dt) * 4);
        check_close(values(xg.grad().cpu()), values(xc.grad()), rounding(dt) * 4);
      }
    }
  }
  for (DType dt : {kFloat32, kFloat16}) {
    Tensor logits = randn({16, 7, 3}).to(dt);
    Tensor target = randint(0, 7, {16, 3});
    target = where(target.eq(int64_t(4)), int64_t(-100), target);
    Tensor weight = rand({7}) + 0.5;
    for (auto [r, smoothing] : {std::pair{Reduction::Mean, 0.1}, {Reduction::Sum, 0.1}, {Reduction::None, 0.1},
                                {Reduction::Mean, 0.0}, {Reduction::Sum, 0.0}, {Reduction::None, 0.0}}) {
      CAPTURE(smoothing);
      CrossEntropyOptions o{.weight = weight, .label_smoothing = smoothing, .reduction = r};
      Tensor xc = logits.detach().requires_grad_(), xg = logits.detach().cuda().requires_grad_();
      Tensor lc = cross_entropy(xc, target, o);
      CrossEntropyOptions og = o;
      og.weight = weight.cuda();
      Tensor lg = cross_entropy(xg, target.cuda(), og);
      Tensor g = randn(lc.shape()).to(lc.dtype());
      lc.backward(g);
      lg.backward(g.cuda());
      check_close(values(lg.cpu()), values(lc), rounding(dt) * 4);
      check_close(values(xg.grad().cpu()), values(xc.grad()), rounding(dt) * 4);
    }
  }
#else
  MESSAGE("built without CUDA: skipped");
#endif
}

TEST_CASE("CUDA softmax, log_softmax and cross_entropy of a row holding +inf are nan throughout, as on the CPU") {
#if HALFGRAD_WITH_CUDA
  SKIP_WITHOUT_GPU();
  // PyTorch's exp(x - max) makes the +inf element's term nan, so the whole row is nan; a running (max, sum) that
  // counted the infinities would give a one-hot softmax and an infinite loss instead. Rows of one block, columns.
  const double inf = std::numeric_limits<double>::infinity();
  for (DType dt : {kFloat32, kFloat16, kFloat64}) {
    const std::string dtype = dtype_name(dt);
    CAPTURE(dtype);
    Tensor x = tensor<double>({inf, 1.0, 2.0, 0.5, -1.0, 3.0}, {2, 3}).to(dt);
    for (const Tensor& cpu : {x, x.t().contiguous().t()}) {
      Tensor gpu = cpu.cuda();
      // nan where the CPU has nan (the +inf's row, or its column along dim 0), else within rounding
      auto check_same = [&](const Tensor& got, const Tensor& want) {
        const std::vector<double> g = values(got.cpu()), w = values(want);
        for (size_t k = 0; k < w.size(); ++k) {
          CAPTURE(k);
          if (std::isnan(w[k])) CHECK(std::isnan(g[k]));
          else CHECK(g[k] == doctest::Approx(w[k]).epsilon(rounding(dt) * 2));
        }
      };
      for (int64_t dim : {1, 0}) {
        CAPTURE(dim);
        check_same(softmax(gpu, dim), softmax(cpu, dim));
        check_same(log_softmax(gpu, dim), log_softmax(cpu, dim));
      }
      const Tensor loss = cross_entropy(gpu, labels({1, 2}, {2}).cuda(), {.reduction = Reduction::None}).cpu();
      CHECK(std::isnan(loss[0].item<double>()));
      CHECK_FALSE(std::isnan(loss[1].item<double>()));
    }
    Tensor pixels = x.t().contiguous().view({1, 3, 2});  // classes along dim 1, two pixels: the columns kernel
    const Tensor per_pixel = cross_entropy(pixels.cuda(), labels({1, 2}, {1, 2}).cuda(), {.reduction = Reduction::None});
    CHECK(std::isnan(per_pixel.cpu()[0][0].item<double>()));
    CHECK_FALSE(std::isnan(per_pixel.cpu()[0][1].item<double>()));
  }
#else
  MESSAGE("built without CUDA: skipped");
#endif
}

TEST_CASE("CUDA binary cross-entropy losses match the CPU") {
#if HALFGRAD_WITH_CUDA
  SKIP_WITHOUT_GPU();
  manual_seed(116);
  Tensor x = randn({8, 5}) * 3, y = rand({8, 5}), pw = rand({5}) + 0.5;
  Tensor xc = x.detach().requires_grad_(), xg = x.detach().cuda().requires_grad_();
  Tensor lc = binary_cross_entropy_with_logits(xc, y, {.pos_weight = pw});
  Tensor lg = binary_cross_entropy_with_logits(xg, y.cuda(), {.pos_weight = pw.cuda()});
  lc.backward();
  lg.backward();
  CHECK(lg.item<double>() == doctest::Approx(lc.item<double>()).epsilon(1e-5));
  check_close(values(xg.grad().cpu()), values(xc.grad()), 1e-5);
  Tensor p = sigmoid(x);
  CHECK(binary_cross_entropy(p.cuda(), y.cuda()).item<double>() ==
        doctest::Approx(binary_cross_entropy(p, y).item<double>()).epsilon(1e-5));
#else
  MESSAGE("built without CUDA: skipped");
#endif
}

// A node must not hold its own output: the output's grad_fn holds the node, and a graph never run backward (a loss
// computed for reporting, with autograd on) then stays alive for good. cross_entropy's node held its per-element
// loss until LeakSanitizer found it (make sanitize). With reduction None the loss is that output itself.
TEST_CASE("cross_entropy's graph goes with its loss when no backward runs: the node does not hold its output") {
  Tensor logits = randn({5, 7}).requires_grad_(true);
  const Tensor target = tensor<int64_t>({0, 6, 3, -100, 2});
  for (Reduction reduction : {Reduction::None, Reduction::Mean}) {
    CAPTURE(int(reduction));
    Tensor loss = cross_entropy(logits, target, {.reduction = reduction});
    std::weak_ptr<Node> node = loss.grad_fn();
    REQUIRE_FALSE(node.expired());
    loss = Tensor();
    CHECK(node.expired());
  }
}

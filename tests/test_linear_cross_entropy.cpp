// linear_cross_entropy (ops/linear_cross_entropy.h): the fused CPU op against the composition it stands for,
// cross_entropy(linear(x, W, b), t), in values and in every gradient; gradcheck; its errors; autocast and CUDA.
#include <doctest/doctest.h>

#include <cmath>
#include <tuple>

#include "halfgrad.h"
#include "tests/gradcheck.h"
#include "tests/testing.h"

using namespace halfgrad;
using halfgrad::testing::aligned_padding;
using halfgrad::testing::check_close;
using halfgrad::testing::contains;
using halfgrad::testing::error_of;
using halfgrad::testing::gradcheck;
using halfgrad::testing::leaf;
using halfgrad::testing::values;

namespace {

struct Problem {
  Tensor x, w, b, t;
};

// x [n, in], W [classes, in], b [classes], targets in [0, classes) with every fifth row ignore_index.
Problem problem(int64_t n, int64_t in, int64_t classes, DType dtype, int64_t ignore_index = -100) {
  Problem p;
  p.x = randn({n, in}, {.dtype = kFloat64}).to(dtype).requires_grad_(true);
  p.w = randn({classes, in}, {.dtype = kFloat64}).mul(0.5).to(dtype).detach().requires_grad_(true);
  p.b = randn({classes}, {.dtype = kFloat64}).to(dtype).requires_grad_(true);
  p.t = randint(0, classes, {n});
  for (int64_t i = 0; i < n; i += 5) p.t.data<int64_t>()[i] = ignore_index;
  return p;
}

struct Result {
  std::vector<double> loss, dx, dw, db;
};

Result run(const Problem& p, bool fused, int64_t ignore_index = -100, bool with_bias = true) {
  for (const Tensor& t : {p.x, p.w, p.b}) t.set_grad(Tensor());
  const Tensor bias = with_bias ? p.b : Tensor();
  Tensor loss = fused ? linear_cross_entropy(p.x, p.w, bias, p.t, {.ignore_index = ignore_index})
                      : cross_entropy(linear(p.x, p.w, bias), p.t, {.ignore_index = ignore_index});
  loss.mul(3.0).backward();  // an upstream gradient other than 1
  return {values(loss), values(p.x.grad()), values(p.w.grad()), with_bias ? values(p.b.grad()) : std::vector<double>{}};
}

void check_same(const Result& got, const Result& want, double tol) {
  INFO("loss");
  check_close(got.loss, want.loss, tol);
  INFO("input gradient");
  check_close(got.dx, want.dx, tol);
  INFO("weight gradient");
  check_close(got.dw, want.dw, tol);
  INFO("bias gradient");
  check_close(got.db, want.db, tol);
}

}  // namespace

TEST_CASE("linear_cross_entropy equals cross_entropy(linear(...)): loss and all gradients, across row blocks") {
  manual_seed(3);
  // 5,003 classes in float64: blocks of 102 rows (4 MiB of logits), so 250 rows make three blocks, the last short,
  // shared between the threads; every fifth target ignored.
  Problem p = problem(250, 24, 5003, kFloat64);
  check_same(run(p, true), run(p, false), 1e-12);
  SUBCASE("without a bias") { check_same(run(p, true, -100, false), run(p, false, -100, false), 1e-12); }
  SUBCASE("another ignore_index, and a row block of one thread only") {
    Problem q = problem(7, 5, 11, kFloat64, 3);
    check_same(run(q, true, 3), run(q, false, 3), 1e-12);
  }
  SUBCASE("float32 against float64's composition") {
    Problem q = problem(70, 32, 3001, kFloat32);
    Problem wide{q.x.detach().to(kFloat64).requires_grad_(true), q.w.detach().to(kFloat64).requires_grad_(true),
                 q.b.detach().to(kFloat64).requires_grad_(true), q.t};
    check_same(run(q, true), run(wide, false), 2e-5);
  }
}

TEST_CASE("linear_cross_entropy's loss is (max - x[t]) + log_sum: a small loss beside large logits keeps its bits") {
  // Logits 1000 and 985 (x = 1, W = [1000, 985]) in float32: max + log_sum would round to max's ulp (6.1e-5) and read
  // a loss of 3.06e-7 as 0. On the GPU as on the CPU.
  for (bool on_gpu : {false, true}) {
    if (on_gpu && !cuda::is_available()) continue;
    const Device device = on_gpu ? Device::cuda(0) : Device::cpu();
    CAPTURE(on_gpu);
    const Tensor x = ones({1, 1}, {.device = device}), w = tensor<float>({1000.0f, 985.0f}, {2, 1}).to(device);
    const Tensor t = zeros({1}, {.dtype = kInt64, .device = device});
    const double loss = linear_cross_entropy(x, w, Tensor(), t).item<double>();
    CHECK(loss == doctest::Approx(std::log1p(std::exp(-15.0))).epsilon(0.2));
    CHECK(loss == cross_entropy(linear(x, w), t).item<double>());
  }
}

TEST_CASE("linear_cross_entropy: gradcheck in float64, with and without a bias") {
  manual_seed(4);
  const Tensor t = tensor<int64_t>({2, 0, 4, 1, -100, 3});
  gradcheck([&](const TensorList& in) { return linear_cross_entropy(in[0], in[1], in[2], t); },
            {leaf({6, 3}), leaf({5, 3}), leaf({5})});
  gradcheck([&](const TensorList& in) { return linear_cross_entropy(in[0], in[1], Tensor(), t); },
            {leaf({6, 3}), leaf({5, 3})});
}

TEST_CASE("linear_cross_entropy: the mean over no counted target is NaN, only the inputs that require grad get one") {
  Tensor x = randn({3, 2}, {.dtype = kFloat64}), w = randn({4, 2}, {.dtype = kFloat64}).requires_grad_(true);
  Tensor all_ignored = full({3}, int64_t(-100), {.dtype = kInt64});
  CHECK(std::isnan(linear_cross_entropy(x, w, Tensor(), all_ignored).item<double>()));
  Tensor loss = linear_cross_entropy(x, w, Tensor(), tensor<int64_t>({0, 1, 2}));
  loss.backward();
  CHECK(w.grad().defined());
  CHECK_FALSE(x.grad().defined());
  // No rows at all: NaN, and zero gradients for the weight.
  Tensor w0 = randn({4, 2}, {.dtype = kFloat64}).requires_grad_(true);
  Tensor none = linear_cross_entropy(zeros({0, 2}, {.dtype = kFloat64}), w0, Tensor(), zeros({0}, {.dtype = kInt64}));
  CHECK(std::isnan(none.item<double>()));
  none.backward();
  CHECK(values(w0.grad()) == std::vector<double>(8, 0.0));
  NoGradGuard no_grad;  // no graph, no gradients kept
  CHECK_FALSE(linear_cross_entropy(x, w, Tensor(), tensor<int64_t>({0, 1, 2})).requires_grad());
}

TEST_CASE("linear_cross_entropy names the op and what is wrong with its arguments") {
  Tensor x = randn({3, 2}), w = randn({4, 2}), b = randn({4});
  CHECK(contains(error_of([&] { linear_cross_entropy(x, w, b, tensor<int64_t>({0, 4, 1})); }),
                 "linear_cross_entropy: target 4 at row 1 is not a class index in [0, 4)"));
  CHECK(contains(error_of([&] { linear_cross_entropy(x, randn({4, 3}), b, tensor<int64_t>({0, 1, 2})); }),
                 "linear_cross_entropy: expected input [N, in] and weight [classes, in]"));
  CHECK(contains(error_of([&] { linear_cross_entropy(x, w, randn({5}), tensor<int64_t>({0, 1, 2})); }),
                 "linear_cross_entropy: bias"));
  CHECK(contains(error_of([&] { linear_cross_entropy(x, w, b, tensor<int64_t>({0, 1})); }),
                 "expected integer class indices [3]"));
  CHECK(contains(error_of([&] { linear_cross_entropy(x, w.to(kFloat64), b, tensor<int64_t>({0, 1, 2})); }),
                 "must have one dtype"));
}

TEST_CASE("linear_cross_entropy under autocast is linear's lower precision then cross_entropy's float32 math") {
  manual_seed(5);
  Problem p = problem(12, 8, 30, kFloat32);
  amp::AutocastGuard autocast(kBFloat16);
  Tensor got = linear_cross_entropy(p.x, p.w, p.b, p.t), want = cross_entropy(linear(p.x, p.w, p.b), p.t);
  CHECK(got.dtype() == kFloat32);
  CHECK(values(got) == values(want));
}

TEST_CASE("LanguageModel::loss equals cross_entropy of forward's logits, and its gradients") {
  manual_seed(6);
  models::LanguageModel lm(50, {.embedding_size = 8, .hidden_size = 8, .num_layers = 1, .dropout = 0.0});
  Tensor tokens = randint(0, 50, {5, 3}), targets = randint(0, 50, {15});
  Tensor fused = lm.loss(lm.features(tokens, Tensor()).features, targets);
  fused.backward();
  const std::vector<double> fused_grad = values(lm.decoder->weight.grad());
  lm.zero_grad();
  Tensor composed = cross_entropy(lm.forward(tokens, Tensor()).logits.reshape({-1, 50}), targets);
  composed.backward();
  check_close(values(fused), values(composed), 1e-6);
  check_close(fused_grad, values(lm.decoder->weight.grad()), 1e-6);
  CHECK(contains(error_of([&] { lm.loss(randn({5, 3, 7}), targets); }), "LanguageModel::loss: expected features"));
}

namespace {

Problem to_cuda(const Problem& p, DType dtype) {
  auto leaf_on_gpu = [&](const Tensor& t) { return t.detach().to(dtype).cuda().requires_grad_(true); };
  return {leaf_on_gpu(p.x), leaf_on_gpu(p.w), leaf_on_gpu(p.b), p.t.cuda()};
}

}  // namespace

// The CUDA op runs on padded operands (x_p = [x, 1, 0...], w_p = [W, b, 0...], the logits padded to whole 16-byte
// rows): sizes that are not multiples of the padding check that nothing of the padding leaks into the results.
TEST_CASE("cuda: linear_cross_entropy matches the CPU's fused op, odd sizes padded, with and without a bias") {
  SKIP_WITHOUT_GPU();
  manual_seed(7);
  for (auto [n, in, classes] : {std::tuple{40, 16, 900}, {37, 13, 901}, {5, 1, 3}, {70, 650, 3327}}) {
    CAPTURE(n);
    CAPTURE(in);
    CAPTURE(classes);
    Problem p = problem(n, in, classes, kFloat64);
    for (bool with_bias : {true, false}) {
      CAPTURE(with_bias);
      const Result cpu = run(p, true, -100, with_bias);
      check_same(run(to_cuda(p, kFloat64), true, -100, with_bias), cpu, 1e-10);
      check_same(run(to_cuda(p, kFloat32), true, -100, with_bias), cpu, 2e-5);
    }
  }
  SUBCASE("another ignore_index") {
    Problem q = problem(9, 5, 11, kFloat64, 3);
    check_same(run(to_cuda(q, kFloat64), true, 3), run(q, true, 3), 1e-12);
  }
  SUBCASE("every target ignored: a NaN loss and zero gradients") {
    Tensor x = randn({3, 5}, {.device = Device::cuda(0)}).requires_grad_(true);
    Tensor w = randn({7, 5}, {.device = Device::cuda(0)}).requires_grad_(true);
    Tensor b = randn({7}, {.device = Device::cuda(0)}).requires_grad_(true);
    Tensor loss = linear_cross_entropy(x, w, b, full({3}, int64_t(-100), {.dtype = kInt64, .device = Device::cuda(0)}));
    CHECK(std::isnan(loss.item<double>()));
    loss.backward();
    CHECK(values(x.grad()) == std::vector<double>(15, 0.0));
    CHECK(values(w.grad()) == std::vector<double>(35, 0.0));
    CHECK(values(b.grad()) == std::vector<double>(7, 0.0));
  }
  SUBCASE("no graph without gradients: the loss alone") {
    Problem q = problem(9, 5, 11, kFloat64);
    const Result cpu = run(q, true);
    Problem g = to_cuda(q, kFloat64);
    NoGradGuard no_grad;
    Tensor loss = linear_cross_entropy(g.x, g.w, g.b, g.t);
    CHECK_FALSE(loss.requires_grad());
    check_close(values(loss), cpu.loss, 1e-12);
  }
}

// Under autocast (apex O1) the CUDA op casts x, W and b to the half dtype in its padding copies and runs the products
// there; the softmax and the loss are float32, the gradients come back float32. Against the composition under
// autocast (half logits, float32 cross entropy) and against float64, within half precision.
TEST_CASE("cuda: linear_cross_entropy under autocast, and on half inputs, within half precision of float64") {
  SKIP_WITHOUT_GPU();
  manual_seed(8);
  Problem p = problem(60, 45, 2003, kFloat64);
  const Result exact = run(p, true);
  for (DType half : {kFloat16, kBFloat16}) {
    CAPTURE(std::string(dtype_name(half)));
    const double tol = half == kFloat16 ? 3e-3 : 2e-2;
    Problem g = to_cuda(p, kFloat32);
    {
      amp::AutocastGuard autocast(half);
      Tensor loss = linear_cross_entropy(g.x, g.w, g.b, g.t);
      CHECK(loss.dtype() == kFloat32);
      Tensor composed = cross_entropy(linear(g.x, g.w, g.b), g.t);
      check_close(values(loss), values(composed), tol);
    }
    Result got;
    {
      for (const Tensor& t : {g.x, g.w, g.b}) t.set_grad(Tensor());
      amp::AutocastGuard autocast(half);
      Tensor loss = linear_cross_entropy(g.x, g.w, g.b, g.t);
      loss.mul(3.0).backward();
      got = {values(loss), values(g.x.grad()), values(g.w.grad()), values(g.b.grad())};
      CHECK(g.w.grad().dtype() == kFloat32);
    }
    check_same(got, exact, tol);
    // Half inputs outside autocast (O2/O3's half model): the loss and the gradients in the half dtype.
    Problem h = to_cuda(p, half);
    const Result pure = run(h, true);
    CHECK(h.w.grad().dtype() == half);
    check_same(pure, exact, half == kFloat16 ? 1e-2 : 5e-2);
  }
}

// A weight laid out as aligned rows (models/language_model.h's decoder) is the op's padded operand as it is: the
// results of the dense weight, the gradient in the weight's layout with its padding zero. 13 and 650 columns leave a
// spare column for the bias; 16 does not (a float32 or float64 weight then takes the padded copy).
TEST_CASE("cuda: linear_cross_entropy on an aligned-rows weight equals the dense one, its gradient aligned") {
  SKIP_WITHOUT_GPU();
  manual_seed(9);
  for (auto [n, in, classes] : {std::tuple{40, 13, 901}, {37, 16, 900}, {70, 650, 3327}}) {
    CAPTURE(n);
    CAPTURE(in);
    CAPTURE(classes);
    Problem p = problem(n, in, classes, kFloat64);
    for (DType dtype : {kFloat64, kFloat32, kFloat16}) {
      CAPTURE(std::string(dtype_name(dtype)));
      for (bool with_bias : {true, false}) {
        CAPTURE(with_bias);
        const Result cpu = run(p, true, -100, with_bias);
        Problem g = to_cuda(p, dtype);
        g.w = contiguous_aligned_rows(g.w.detach()).requires_grad_(true);
        REQUIRE(is_aligned_rows(g.w));
        const Result got = run(g, true, -100, with_bias);
        check_same(got, cpu, dtype == kFloat64 ? 1e-10 : dtype == kFloat32 ? 2e-5 : 1e-2);
        REQUIRE(is_aligned_rows(g.w.grad()));
        const std::vector<double> padding = aligned_padding(g.w.grad());
        CHECK(padding == std::vector<double>(padding.size(), 0.0));
      }
    }
  }
  SUBCASE("the weight is the product's operand itself: changed in place before the backward, an error") {
    Problem p = problem(20, 13, 301, kFloat32);
    Problem g = to_cuda(p, kFloat32);
    g.w = contiguous_aligned_rows(g.w.detach()).requires_grad_(true);
    Tensor loss = linear_cross_entropy(g.x, g.w, g.b, g.t);
    {
      NoGradGuard no_grad;
      g.w.mul_(2.0);
    }
    CHECK_THROWS_WITH_AS(loss.backward(), doctest::Contains("linear_cross_entropy"), Error);
  }
  SUBCASE("under autocast: a float32 weight is cast into the padded copy, as a dense one is") {
    Problem p = problem(30, 13, 501, kFloat64);
    Problem dense = to_cuda(p, kFloat32), aligned = to_cuda(p, kFloat32);
    aligned.w = contiguous_aligned_rows(aligned.w.detach()).requires_grad_(true);
    amp::AutocastGuard autocast(kFloat16);
    const Result a = run(aligned, true), d = run(dense, true);
    check_same(a, d, 0);
  }
}

// Higher-order gradients: a backward pass with create_graph records itself, so that its gradients can be
// differentiated again (Hessian-vector products, gradient penalties), as libtorch's create_graph. Every op whose
// backward supports it (DoubleBackward::Supported) is checked by gradgradcheck against finite differences of first
// derivatives in float64; an op whose backward does not is an error naming it, and only where a second derivative
// needs it.
#include <doctest/doctest.h>

#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "halfgrad.h"
#include "tests/gradcheck.h"
#include "tests/testing.h"

using namespace halfgrad;
using namespace halfgrad::testing;

namespace {
constexpr bool kCreateGraph = true;

// The gradient of `y` by `x`, itself differentiable.
Tensor differentiable_grad(const Tensor& y, const Tensor& x) {
  return autograd::grad({y}, {x}, {}, std::nullopt, kCreateGraph)[0];
}
}  // namespace

TEST_CASE("create_graph: the first three derivatives of x^3, exact, by x * x * x and by pow") {
  for (bool by_pow : {false, true}) {
    INFO((by_pow ? "pow(x, 3)" : "x * x * x"));
    Tensor x = tensor<double>({2, -1}).requires_grad_();
    const Tensor cube = by_pow ? pow(x, 3) : x * x * x;
    const Tensor first = differentiable_grad(cube.sum(), x);  // 3 x^2
    CHECK(values(first) == std::vector<double>{12, 3});
    REQUIRE(first.requires_grad());
    const Tensor second = differentiable_grad(first.sum(), x);  // 6 x
    CHECK(values(second) == std::vector<double>{12, -6});
    const Tensor third = autograd::grad({second.sum()}, {x})[0];  // 6
    CHECK(values(third) == std::vector<double>{6, 6});
    CHECK(!third.requires_grad());  // a pass without create_graph records nothing
  }
}

TEST_CASE("backward(create_graph) leaves a .grad with a history, and keeps the graph unless told otherwise") {
  Tensor x = tensor<double>({0, 1, 2}).requires_grad_();
  const Tensor y = x.exp().sum();
  y.backward(Tensor(), std::nullopt, kCreateGraph);
  const Tensor first = x.grad();
  REQUIRE(first.requires_grad());
  check_close(values(first), {1, std::exp(1.0), std::exp(2.0)}, 1e-15);
  // retain_graph defaulted to create_graph: the graph runs again. Without create_graph that pass adds into the .grad
  // with a history in place (grad mode off, as PyTorch's AccumulateGrad).
  y.backward();
  CHECK(x.grad().same(first));
  check_close(values(first), {2, 2 * std::exp(1.0), 2 * std::exp(2.0)}, 1e-15);
  x.set_grad(Tensor());  // (the leaf and its .grad with a history hold each other until reset)
}

TEST_CASE("backward(create_graph) sums into a .grad out of place, the sum with both histories") {
  Tensor x = tensor<double>({1, 2}).requires_grad_();
  (x * x).sum().backward(Tensor(), std::nullopt, kCreateGraph);  // 2x
  const Tensor after_first = x.grad();
  (x * x * x).sum().backward(Tensor(), std::nullopt, kCreateGraph);  // + 3x^2
  CHECK(values(after_first) == std::vector<double>{2, 4});  // not written: the sum is a new tensor
  CHECK(values(x.grad()) == std::vector<double>{5, 16});
  CHECK(values(autograd::grad({x.grad().sum()}, {x})[0]) == std::vector<double>{8, 14});  // 2 + 6x
  x.set_grad(Tensor());  // (the leaf and its .grad with a history hold each other until reset)
}

TEST_CASE("gradgradcheck: unary elementwise ops and the activations") {
  const Tensor x = leaf({2, 3});
  const Tensor positive = leaf({2, 3}, 0.3, 1.5);
  gradgradcheck([](const TensorList& in) { return -in[0]; }, {x});
  gradgradcheck([](const TensorList& in) { return abs(in[0]) * in[0]; }, {x});
  gradgradcheck([](const TensorList& in) { return exp(in[0]); }, {x});
  gradgradcheck([](const TensorList& in) { return log(in[0]); }, {positive});
  gradgradcheck([](const TensorList& in) { return sqrt(in[0]); }, {positive});
  gradgradcheck([](const TensorList& in) { return rsqrt(in[0]); }, {positive});
  gradgradcheck([](const TensorList& in) { return tanh(in[0]); }, {x});
  gradgradcheck([](const TensorList& in) { return sigmoid(in[0]); }, {x});
  gradgradcheck([](const TensorList& in) { return relu(in[0]) * in[0]; }, {x});
  gradgradcheck([](const TensorList& in) { return erf(in[0]); }, {x});
  gradgradcheck([](const TensorList& in) { return sign(in[0]) * in[0] * in[0]; }, {x});
  gradgradcheck([](const TensorList& in) { return clamp(in[0], -0.5, 0.7) * in[0]; }, {x});
  gradgradcheck([](const TensorList& in) { return gelu(in[0]); }, {x});
  gradgradcheck([](const TensorList& in) { return gelu(in[0], "tanh"); }, {x});
  gradgradcheck([](const TensorList& in) { return silu(in[0]); }, {x});
}

TEST_CASE("gradgradcheck: binary elementwise ops, broadcast, and where") {
  const Tensor a = leaf({3, 1}), b = leaf({4});
  const Tensor positive = leaf({3, 1}, 0.3, 1.5);
  gradgradcheck([](const TensorList& in) { return (in[0] + in[1]) * in[0]; }, {a, b});
  gradgradcheck([](const TensorList& in) { return add(in[0], in[1], 2.5) * in[1]; }, {a, b});
  gradgradcheck([](const TensorList& in) { return (in[0] - in[1]) * (in[0] - in[1]); }, {a, b});
  gradgradcheck([](const TensorList& in) { return in[0] * in[1]; }, {a, b});
  gradgradcheck([](const TensorList& in) { return in[0] / in[1]; }, {a, leaf({4}, 0.3, 1.5)});
  gradgradcheck([](const TensorList& in) { return 2.0 / in[0]; }, {positive});
  gradgradcheck([](const TensorList& in) { return pow(in[0], in[1]); }, {positive, b});
  gradgradcheck([](const TensorList& in) { return pow(in[0], 2.5); }, {positive});
  gradgradcheck([](const TensorList& in) { return pow(1.7, in[0]); }, {a});
  gradgradcheck([](const TensorList& in) { return maximum(in[0], in[1]) * in[0]; }, {a, b});
  gradgradcheck([](const TensorList& in) { return minimum(in[0], in[1]) * in[1]; }, {a, b});
  gradgradcheck([](const TensorList& in) { return where(in[0].gt(in[1]), in[0] * in[0], in[1] * in[0]); }, {a, b});
  gradgradcheck([](const TensorList& in) { return masked_fill(in[0] * in[0], in[0].gt(0), 0.5); }, {a});
}

TEST_CASE("gradgradcheck: reductions") {
  const Tensor x = leaf({3, 4});
  gradgradcheck([](const TensorList& in) { return (in[0] * in[0]).sum(); }, {x});
  gradgradcheck([](const TensorList& in) { return (in[0] * in[0]).sum({1}, true); }, {x});
  gradgradcheck([](const TensorList& in) { return exp(in[0]).mean({0}); }, {x});
  gradgradcheck([](const TensorList& in) { return in[0].var({1}); }, {x});
  gradgradcheck([](const TensorList& in) { return in[0].std({1}); }, {x});
  gradgradcheck([](const TensorList& in) { return in[0].std(); }, {x});
  gradgradcheck([](const TensorList& in) { return amax(in[0] * in[0], {1}); }, {x});
  gradgradcheck([](const TensorList& in) { return max(in[0] * in[0], 0).first; }, {x});
}

TEST_CASE("gradgradcheck: views, copies and joins") {
  const Tensor x = leaf({2, 3}), y = leaf({2, 3});
  auto squared = [](const Tensor& t) { return t * t; };
  gradgradcheck([&](const TensorList& in) { return squared(in[0]).view({3, 2}); }, {x});
  gradgradcheck([&](const TensorList& in) { return squared(in[0]).t().reshape({6}); }, {x});
  gradgradcheck([&](const TensorList& in) { return squared(in[0]).permute({1, 0}).contiguous(); }, {x});
  gradgradcheck([&](const TensorList& in) { return squared(in[0]).unsqueeze(1).expand({2, 4, 3}); }, {x});
  gradgradcheck([&](const TensorList& in) { return squared(in[0]).slice(1, 0, 3, 2); }, {x});
  gradgradcheck([&](const TensorList& in) { return squared(in[0]).select(0, 1); }, {x});
  gradgradcheck([&](const TensorList& in) { return squared(in[0]).narrow(1, 1, 2).clone(); }, {x});
  gradgradcheck([&](const TensorList& in) { return squared(in[0]).unsqueeze(0).squeeze(0); }, {x});
  gradgradcheck([&](const TensorList& in) { return squared(in[0]).split(1, 1)[2] * in[1]; }, {x, y});
  gradgradcheck([&](const TensorList& in) { return cat({squared(in[0]), in[0] * in[1]}, 1); }, {x, y});
  gradgradcheck([&](const TensorList& in) { return stack({squared(in[0]), in[0] * in[1]}, 0); }, {x, y});
  gradgradcheck([&](const TensorList& in) {
    Tensor out = zeros({2, 3}, {.dtype = kFloat64});
    return out.copy_(squared(in[0])) * in[1];
  }, {x, y});
}

TEST_CASE("gradgradcheck: in-place writes into views (CopySlices), and views taken before them (AsStridedBackward)") {
  const Tensor x = leaf({3, 4}), y = leaf({4});
  gradgradcheck([](const TensorList& in) {
    Tensor buffer = in[0] * 1;
    buffer.select(0, 1).copy_(in[1] * in[1]);  // the base takes a CopySlices history
    return buffer * buffer;
  }, {x, y});
  gradgradcheck([](const TensorList& in) {
    Tensor buffer = in[0] * in[0];
    const Tensor row = buffer.select(0, 2);  // taken before the write: its history is made again from the base's
    buffer.slice(1, 0, 2).mul_(in[0].slice(1, 2, 4));
    return row * row.sum();
  }, {x});
}

TEST_CASE("create_graph through slice and select: a third derivative, exact") {
  Tensor x = tensor<double>({1, 2, 3}).requires_grad_();
  const Tensor y = pow(x.slice(0, 1, 3), 4).sum() + pow(x.select(0, 0), 4);  // every element to the fourth
  const Tensor first = differentiable_grad(y, x);  // 4x^3
  CHECK(values(first) == std::vector<double>{4, 32, 108});
  const Tensor second = differentiable_grad(first.slice(0, 0, 2).sum() + first.select(0, 2), x);  // 12x^2
  CHECK(values(second) == std::vector<double>{12, 48, 108});
  const Tensor third = autograd::grad({second.sum()}, {x})[0];  // 24x
  CHECK(values(third) == std::vector<double>{24, 48, 72});
}

TEST_CASE("gradgradcheck: matmul in every rank, bmm and linear") {
  gradgradcheck([](const TensorList& in) { return matmul(in[0], in[1]); }, {leaf({2, 3}), leaf({3, 4})});
  gradgradcheck([](const TensorList& in) { return matmul(in[0], in[1]); }, {leaf({3}), leaf({3})});
  gradgradcheck([](const TensorList& in) { return matmul(in[0], in[1]); }, {leaf({3}), leaf({2, 3, 2})});
  gradgradcheck([](const TensorList& in) { return matmul(in[0], in[1]); }, {leaf({2, 2, 3}), leaf({3, 2})});
  gradgradcheck([](const TensorList& in) { return bmm(in[0], in[1]); }, {leaf({2, 2, 3}), leaf({2, 3, 2})});
  gradgradcheck([](const TensorList& in) { return linear(in[0], in[1], in[2]); },
                {leaf({2, 2, 3}), leaf({4, 3}), leaf({4})});
}

TEST_CASE("gradgradcheck: layer_norm, with and without its affine parameters") {
  const Tensor x = leaf({3, 2, 4});
  gradgradcheck([](const TensorList& in) { return layer_norm(in[0], {4}, in[1], in[2]); }, {x, leaf({4}), leaf({4})});
  gradgradcheck([](const TensorList& in) { return layer_norm(in[0] * in[0], {2, 4}, in[1], Tensor(), 1e-3); },
                {x, leaf({2, 4})});
  gradgradcheck([](const TensorList& in) { return layer_norm(in[0], {4}); }, {x});
  gradgradcheck([](const TensorList& in) { return layer_norm(in[0].transpose(0, 2), {3}, Tensor(), in[1]); },
                {x, leaf({3})});  // no contiguous input; a bias without a weight
}

TEST_CASE("gradgradcheck: softmax, log_softmax and mse_loss") {
  const Tensor x = leaf({2, 4}), target = leaf({2, 4});
  gradgradcheck([](const TensorList& in) { return softmax(in[0], 1); }, {x});
  gradgradcheck([](const TensorList& in) { return softmax(in[0] * in[0], 0); }, {x});
  gradgradcheck([](const TensorList& in) { return log_softmax(in[0], 1); }, {x});
  for (Reduction reduction : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
    INFO(reduction_name(reduction));
    gradgradcheck([&](const TensorList& in) { return mse_loss(in[0] * in[0], in[1], reduction); }, {x, target});
  }
}

TEST_CASE("gradgradcheck: cross_entropy and nll_loss (class weights, ignored targets, smoothing, probabilities)") {
  const Tensor logits = leaf({3, 4}), spatial = leaf({2, 4, 3}), weight = tensor<double>({0.5, 1.0, 2.0, 1.5});
  const Tensor target = tensor<int64_t>({1, 3, 0}), ignored = tensor<int64_t>({1, -100, 0});
  const Tensor spatial_target = tensor<int64_t>({0, 3, 2, 1, 1, 0}).view({2, 3});
  for (Reduction reduction : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
    INFO(reduction_name(reduction));
    gradgradcheck([&](const TensorList& in) { return cross_entropy(in[0], target, {.reduction = reduction}); },
                  {logits});
    gradgradcheck([&](const TensorList& in) {
      return cross_entropy(in[0] * in[0], ignored, {.weight = weight, .reduction = reduction});
    }, {logits});
    gradgradcheck([&](const TensorList& in) {
      return nll_loss(log_softmax(in[0] * in[0], 1), ignored, {.weight = weight, .reduction = reduction});
    }, {logits});
  }
  gradgradcheck([&](const TensorList& in) { return cross_entropy(in[0], spatial_target, {.weight = weight}); },
                {spatial});
  gradgradcheck([&](const TensorList& in) { return cross_entropy(in[0], target, {.label_smoothing = 0.1}); },
                {logits});
  gradgradcheck([&](const TensorList& in) { return cross_entropy(in[0], softmax(in[1], 1)); }, {logits, leaf({3, 4})});
  // Logits that are no contiguous tensor (the op reads a copy, and differentiates through the view).
  gradgradcheck([&](const TensorList& in) { return cross_entropy(in[0].t(), target, {.weight = weight}); },
                {leaf({4, 3})});
}

TEST_CASE("gradgradcheck: binary_cross_entropy and binary_cross_entropy_with_logits (weight, pos_weight)") {
  const TensorOptions f64{.dtype = kFloat64};
  const Tensor weight = rand({2, 3}, f64) + 0.5, pos_weight = rand({3}, f64) + 0.5;
  const Tensor x = leaf({2, 3}), target = leaf({2, 3}, 0.3, 0.5);
  for (Reduction reduction : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
    INFO(reduction_name(reduction));
    gradgradcheck([&](const TensorList& in) {
      return binary_cross_entropy(sigmoid(in[0]), in[1], {.weight = weight, .reduction = reduction});
    }, {x, target});
    gradgradcheck([&](const TensorList& in) {
      return binary_cross_entropy_with_logits(in[0] * in[0], in[1], {.reduction = reduction});
    }, {x, target});
    gradgradcheck([&](const TensorList& in) {
      return binary_cross_entropy_with_logits(in[0], in[1], {.weight = weight, .pos_weight = pos_weight,
                                                             .reduction = reduction});
    }, {x, target});
  }
}

TEST_CASE("create_graph: binary_cross_entropy_with_logits at a logit of 0, exact") {
  // d loss / d y = (pw - 1) log(1 + exp(-x)) - x, whose derivative by x is -(pw - 1) sigmoid(-x) - 1: -2 at x = 0 for
  // pw = 3 (the one-sided derivatives of max(-x, 0) and |x| would give -3).
  Tensor x = tensor<double>({0.0}).requires_grad_(), y = tensor<double>({0.5}).requires_grad_();
  const Tensor loss = binary_cross_entropy_with_logits(x, y, {.pos_weight = tensor<double>({3.0})});
  const Tensor by_target = differentiable_grad(loss, y);
  check_close(values(by_target), {2 * std::log(2.0)}, 1e-15);
  CHECK(values(autograd::grad({by_target.sum()}, {x})[0]) == std::vector<double>{-2});
}

TEST_CASE("create_graph: binary_cross_entropy on a float16 leaf beside a float32 target computes in float32") {
  // The op reads the probabilities as float32 (the promoted dtype); the pass with create_graph differentiates the leaf
  // cast likewise. In float16 p (1 - p) = 0 at p = 0 and 1, and the floor of 1e-12 rounds to 0: 0 / 0.
  Tensor p = tensor<double>({0.0, 0.25, 1.0}).to(kFloat16).requires_grad_();
  const Tensor y = tensor<float>({0.0f, 0.75f, 1.0f});
  const Tensor plain = autograd::grad({binary_cross_entropy(p, y)}, {p})[0];
  const Tensor recorded = differentiable_grad(binary_cross_entropy(p, y), p);
  REQUIRE(recorded.dtype() == kFloat16);
  CHECK(values(recorded) == values(plain));
  CHECK(values(plain)[0] == 0);
  CHECK(values(plain)[2] == 0);
}

TEST_CASE("create_graph: a Mean over only ignored targets gives the plain pass's zero gradient, not nan") {
  // The loss is 0 / 0 and its gradient 1 / 0; the kernels give an ignored target 0 whatever its gradient, and so do
  // the ops a pass with create_graph records.
  Tensor x = leaf({3, 4});
  const Tensor ignored = tensor<int64_t>({-100, -100, -100});
  const std::vector<double> zeros_(12, 0.0);
  CHECK(values(autograd::grad({cross_entropy(x, ignored)}, {x})[0]) == zeros_);
  CHECK(values(differentiable_grad(cross_entropy(x, ignored), x)) == zeros_);
  CHECK(values(differentiable_grad(nll_loss(log_softmax(x, 1), ignored), x)) == zeros_);
}

TEST_CASE("create_graph: the activations' derivatives in float16 and bfloat16 are the kernel's, rounded once") {
  // Computed in float32 and rounded once, as the kernel: in float16 itself gelu-tanh's x^3 overflows past |x| = 40
  // (the derivative nan where it is 1) and bfloat16 loses erf's tail.
  for (DType dtype : {kFloat16, kBFloat16}) {
    INFO(dtype_name(dtype));
    const Tensor values_in = tensor<double>({-3, -0.7, 0.5, 2, 40, 300});
    for (int op = 0; op < 3; ++op) {
      INFO("activation " << op);
      auto f = [op](const Tensor& t) { return op == 0 ? gelu(t) : op == 1 ? gelu(t, "tanh") : silu(t); };
      Tensor x = values_in.to(dtype).requires_grad_();
      const Tensor plain = autograd::grad({f(x).sum()}, {x})[0];
      const Tensor recorded = differentiable_grad(f(x).sum(), x);
      REQUIRE(recorded.dtype() == dtype);
      check_close(values(recorded), values(plain), dtype == kFloat16 ? 1e-3 : 8e-3);
    }
  }
}

TEST_CASE("gradgradcheck: conv2d (strided, padded, dilated, grouped) and its two backward halves") {
  const Conv2dOptions options{.stride = {2, 1}, .padding = {1, 0}, .dilation = {1, 2}, .groups = 2};
  const Tensor x = leaf({2, 4, 5, 6}), w = leaf({6, 2, 3, 2}), b = leaf({6});
  gradgradcheck([&](const TensorList& in) { return conv2d(in[0], in[1], in[2], options); }, {x, w, b});
  gradgradcheck([](const TensorList& in) { return conv2d(in[0] * in[0], in[1]); },
                {leaf({1, 2, 4, 4}), leaf({3, 2, 2, 2})});
  // The halves conv2d's backward runs in a pass with create_graph: a third derivative of conv2d is their second.
  const Tensor g = leaf(conv2d(x, w, b, options).shape());
  gradgradcheck([&](const TensorList& in) { return conv2d_backward_input(in[0], in[1], x.shape(), options); }, {g, w});
  gradgradcheck([&](const TensorList& in) { return conv2d_backward_weight(in[0], in[1], w.shape(), options); }, {g, x});
}

TEST_CASE("gradgradcheck: avg_pool2d and adaptive_avg_pool2d") {
  const Tensor x = leaf({2, 3, 5, 7});
  gradgradcheck([](const TensorList& in) { return avg_pool2d(in[0] * in[0], {3, 2}); }, {x});
  gradgradcheck([](const TensorList& in) {
    return avg_pool2d(in[0] * in[0], {3, 3}, {.stride = {2, 2}, .padding = {1, 1}, .ceil_mode = true,
                                           .count_include_pad = false});
  }, {x});
  gradgradcheck([](const TensorList& in) { return adaptive_avg_pool2d(in[0] * in[0], {2, 3}); }, {x});
}

TEST_CASE("gradgradcheck: max_pool2d (window positions or flat indices, padding, dilation, ceil_mode, channels_last)") {
  const Tensor x = leaf({2, 3, 5, 7});
  gradgradcheck([](const TensorList& in) { return max_pool2d(in[0] * in[0], {2, 2}); }, {x});
  const MaxPool2dOptions options{.stride = {2, 1}, .padding = {1, 1}, .dilation = {1, 2}, .ceil_mode = true};
  gradgradcheck([&](const TensorList& in) { return max_pool2d(in[0] * in[0], {3, 3}, options); }, {x});
  gradgradcheck([&](const TensorList& in) { return max_pool2d_with_indices(in[0] * in[0], {3, 3}, options).first; },
                {x});
  gradgradcheck([](const TensorList& in) {
    return max_pool2d(contiguous(in[0] * in[0], MemoryFormat::ChannelsLast), {2, 3}, {.stride = {1, 2}});
  }, {x});
  // A window of more than kMaxWindowPositions elements keeps flat indices.
  gradgradcheck([](const TensorList& in) { return max_pool2d(in[0] * in[0], {16, 16}, {.stride = {4, 4}}); },
                {leaf({1, 2, 20, 20})});
  // Windows that hold no input element (rows -1 and 3 of 3): -inf outputs, which take and give no gradient.
  const MaxPool2dOptions empty_rows{.padding = {1, 0}, .dilation = {4, 1}};
  gradgradcheck([&](const TensorList& in) { return max_pool2d(in[0] * in[0], {2, 1}, empty_rows); },
                {leaf({1, 2, 3, 4})});
  gradgradcheck([&](const TensorList& in) { return max_pool2d_with_indices(in[0] * in[0], {2, 1}, empty_rows).first; },
                {leaf({1, 2, 3, 4})});
}

TEST_CASE("create_graph: max_pool2d's second derivative sends U's values at the maxima, exact") {
  // f = sum(max_pool2d(x)^2): df/dx_i = 2 x_i for each window whose maximum is x_i, 0 elsewhere; so the derivative of
  // sum(df/dx * u) by x_i is 2 u_i for each such window.
  Tensor x = tensor<double>({1, 5, 2, 3, -4, 0, 7, -1, 6}).view({1, 1, 3, 3}).requires_grad_();
  const Tensor pooled = max_pool2d(x, {2, 2}, {.stride = {1, 1}});  // the maxima: 5 (x1) twice, 7 (x6), 6 (x8)
  const Tensor first = differentiable_grad((pooled * pooled).sum(), x);
  CHECK(values(first) == std::vector<double>{0, 20, 0, 0, 0, 0, 14, 0, 12});
  const Tensor u = tensor<double>({1, 2, 3, 4, 5, 6, 7, 8, 9}).view({1, 1, 3, 3});
  CHECK(values(autograd::grad({(first * u).sum()}, {x})[0]) == std::vector<double>{0, 8, 0, 0, 0, 0, 14, 0, 18});
}

TEST_CASE("gradgradcheck: batch_norm and batch_norm_relu, training and eval, every saved form of relu") {
  const Tensor x = leaf({3, 4, 2, 3}), w = leaf({4}), b = leaf({4});
  const Tensor running_mean = randn({4}, {.dtype = kFloat64}), running_var = rand({4}, {.dtype = kFloat64}) + 0.5;
  for (bool training : {true, false}) {
    INFO((training ? "training" : "eval"));
    const Tensor mean = training ? Tensor() : running_mean, var = training ? Tensor() : running_var;
    gradgradcheck([&](const TensorList& in) { return batch_norm(in[0] * in[0], mean, var, in[1], in[2], training); },
                  {x, w, b});
    gradgradcheck([&](const TensorList& in) {
      return batch_norm(in[0], mean, var, Tensor(), Tensor(), training, 0.1, 1e-3);
    }, {x});
    gradgradcheck([&](const TensorList& in) {  // [N, C]: channels last by its layout
      return batch_norm(in[0] * in[0], mean, var, in[1], Tensor(), training);
    }, {leaf({5, 4}), w});
    for (ReluSaved saved : {ReluSaved::Mask, ReluSaved::Output}) {
      INFO((saved == ReluSaved::Mask ? "mask" : "output"));
      gradgradcheck([&](const TensorList& in) {
        return batch_norm_relu(in[0] * in[0], mean, var, in[1], in[2], training, 0.1, 1e-5, in[3], Tensor(), saved);
      }, {x, w, b, leaf({3, 4, 2, 3})});
      gradgradcheck([&](const TensorList& in) {
        return batch_norm_relu(contiguous(in[0] * in[0], MemoryFormat::ChannelsLast), mean, var, in[1], in[2],
                               training, 0.1, 1e-5, Tensor(), Tensor(), saved);
      }, {x, w, b});
    }
    // A convolution's bias folded into the batch norm (training) or added before it (eval).
    gradgradcheck([&](const TensorList& in) {
      return batch_norm(in[0] * in[0], mean, var, in[1], in[2], training, 0.1, 1e-5, in[3]);
    }, {x, w, b, leaf({4})});
  }
}

TEST_CASE("create_graph through dropout: the same mask at every order, exact") {
  // f = sum(dropout(x) * x) = sum(m s x^2): df/dx = 2 m s x, and its derivative 2 m s (m the mask, s = 2 at p = 0.5).
  manual_seed(7);
  Tensor x = tensor<double>({1, -2, 3, 0.5, -1.5, 2, 4, -3}).requires_grad_();
  const Tensor first = differentiable_grad((dropout(x, 0.5) * x).sum(), x);
  const std::vector<double> kept = values(first / (x * 4));  // m: 0 or 1
  int dropped = 0;
  for (double m : kept) {
    CHECK((m == 0 || m == 1));
    dropped += m == 0;
  }
  CHECK((dropped > 0 && dropped < 8));  // (with this seed: neither none nor all)
  const std::vector<double> second = values(autograd::grad({first.sum()}, {x})[0]);
  for (size_t i = 0; i < kept.size(); ++i) CHECK(second[i] == 4 * kept[i]);
}

TEST_CASE("gradgradcheck: embedding (padding_idx) and index_select along any dim") {
  const Tensor indices = tensor<int64_t>({2, 0, 2, 4, 1, 2}).view({2, 3});
  gradgradcheck([&](const TensorList& in) { return embedding(indices, in[0] * in[0]); }, {leaf({5, 3})});
  gradgradcheck([&](const TensorList& in) {
    const Tensor rows = embedding(indices, in[0], 2);
    return rows * rows;
  }, {leaf({5, 3})});
  const Tensor index = tensor<int64_t>({1, 0, 1, 2});
  for (int64_t dim : {0, 1, 2}) {
    INFO("dim " << dim);
    gradgradcheck([&](const TensorList& in) {
      const Tensor selected = index_select(in[0], dim, index);
      return selected * selected;
    }, {leaf({3, 3, 4})});
  }
}

TEST_CASE("gradgradcheck: gather, scatter (a tensor, a value), scatter_add and cumsum") {
  const Tensor index = tensor<int64_t>({2, 0, 1, 1, 0, 2}).view({2, 3});
  gradgradcheck([&](const TensorList& in) {
    const Tensor picked = gather(in[0], 1, index);
    return picked * picked;
  }, {leaf({2, 4})});
  gradgradcheck([&](const TensorList& in) { return scatter(in[0] * in[0], 1, index.narrow(1, 0, 1), in[1] * in[1]); },
                {leaf({2, 4}), leaf({2, 2})});
  gradgradcheck([&](const TensorList& in) { return scatter(in[0] * in[0], 0, index.narrow(0, 0, 1), 1.5); },
                {leaf({3, 3})});
  gradgradcheck([&](const TensorList& in) { return scatter_add(in[0] * in[0], 1, index, in[1] * in[1]); },
                {leaf({2, 4}), leaf({2, 3})});
  for (int64_t dim : {0, 1}) {
    INFO("dim " << dim);
    gradgradcheck([&](const TensorList& in) { return cumsum(in[0] * in[0], dim); }, {leaf({3, 4})});
  }
}

TEST_CASE("gradgradcheck: linear_cross_entropy (a bias or none, ignored targets) as the composition's") {
  const Tensor x = leaf({4, 3}), weight = leaf({5, 3}), bias = leaf({5});
  const Tensor target = tensor<int64_t>({0, 4, -100, 1});
  gradgradcheck([&](const TensorList& in) { return linear_cross_entropy(in[0] * in[0], in[1], in[2], target); },
                {x, weight, bias});
  gradgradcheck([&](const TensorList& in) { return linear_cross_entropy(in[0], in[1], Tensor(), target); },
                {x, weight});
  // Every target ignored: a NaN loss, and zero gradients at every order.
  Tensor w = leaf({5, 3});
  const Tensor ignored = tensor<int64_t>({-100, -100, -100, -100});
  const Tensor first = differentiable_grad(linear_cross_entropy(x, w, Tensor(), ignored), w);
  CHECK(values(first) == std::vector<double>(15, 0.0));
  CHECK(values(autograd::grad({first.sum()}, {w}, {}, std::nullopt, false, true)[0]) == std::vector<double>(15, 0.0));
}

TEST_CASE("create_graph: embedding's padding row takes no gradient at any order") {
  Tensor w = leaf({4, 2});
  const Tensor rows = embedding(tensor<int64_t>({1, 3, 1}), w, 1);
  const Tensor first = differentiable_grad((rows * rows * rows).sum(), w);  // 3 w^2 at row 3, 0 at the padding row 1
  const Tensor second = autograd::grad({first.sum()}, {w})[0];
  std::vector<double> want = values(w * 6);
  for (size_t i = 0; i < 6; ++i) want[i] = 0;  // rows 0 and 2 unread, row 1 the padding
  check_close(values(second), want, 1e-15);
}

TEST_CASE("gradgradcheck: a Hessian-vector product through a two-layer tanh network") {
  gradgradcheck([](const TensorList& in) {
    return linear(tanh(linear(in[0], in[1], in[2])), in[3]).sum({1});
  }, {leaf({3, 4}), leaf({5, 4}, 0.5), leaf({5}), leaf({2, 5}, 0.5)});
}

TEST_CASE("a gradient penalty (WGAN-GP) differentiates through the input gradient's graph") {
  // loss = mean(D(x)) + 10 mean((|dD/dx| - 1)^2): its gradient by every weight passes through the first pass's
  // graph. gradcheck differentiates the whole loss, create_graph pass included, by finite differences.
  gradcheck([](const TensorList& in) {
    const Tensor& x = in[0];
    const Tensor critic = linear(tanh(linear(x, in[1], in[2])), in[3], in[4]);  // [batch, 1]
    const Tensor input_grad = autograd::grad({critic.sum()}, {x}, {}, std::nullopt, kCreateGraph)[0];
    const Tensor norm = sqrt((input_grad * input_grad).sum({1}));
    return critic.mean() + 10 * ((norm - 1) * (norm - 1)).mean();
  }, {leaf({3, 4}), leaf({5, 4}, 0.5), leaf({5}), leaf({1, 5}, 0.5), leaf({1})});
}

TEST_CASE("a gradient penalty through a convolutional critic (conv2d, relu, avg_pool2d, linear)") {
  gradcheck([](const TensorList& in) {
    const Tensor& x = in[0];
    const Tensor features = avg_pool2d(relu(conv2d(x, in[1], in[2], {.padding = {1, 1}})), {2, 2});
    const Tensor critic = linear(features.reshape({x.size(0), -1}), in[3]);  // [batch, 1]
    const Tensor input_grad = autograd::grad({critic.sum()}, {x}, {}, std::nullopt, kCreateGraph)[0];
    const Tensor norm = sqrt((input_grad * input_grad).sum({1, 2, 3}));
    return critic.mean() + 10 * ((norm - 1) * (norm - 1)).mean();
  }, {leaf({2, 2, 4, 4}), leaf({3, 2, 3, 3}, 0.5), leaf({3}), leaf({1, 12}, 0.5)});
}

namespace {
// x^3 as an op of one's own whose backward runs without ops that record, as a user's op recorded with record()'s
// default (DoubleBackward::Refused).
Tensor opaque_cube(const Tensor& x) {
  Tensor out;
  {
    NoGradGuard no_grad;
    out = x * x * x;
  }
  record("OpaqueCubeBackward", {x}, {out}, [saved = SavedTensor(x, "opaque_cube")](const GradContext& g) -> TensorList {
    const Tensor base = saved.get();
    return {g[0] * base * base * 3.0};
  });
  return out;
}
}  // namespace

TEST_CASE("create_graph through an op whose backward does not support it: an error naming it, only where needed") {
  Tensor x = leaf({3});
  const Tensor first = differentiable_grad(opaque_cube(x * x).sum(), x);
  // The first derivative is as a plain pass's, and carries a history that refuses to be differentiated, only where a
  // second derivative needs it.
  check_close(values(first), values(x.pow(5) * 6), 1e-14);
  REQUIRE(first.requires_grad());
  CHECK(contains(error_of([&] { autograd::grad({first.sum()}, {x}); }),
                 "OpaqueCubeBackward: the gradients it computed (in a pass with create_graph) cannot be "
                 "differentiated again"));
  const Tensor z = differentiable_grad((x * x * x).sum(), x);
  check_close(values(autograd::grad({z.sum()}, {x})[0]), values(x * 6), 1e-15);
}

TEST_CASE("gradgradcheck: the recurrent op (RNN tanh and relu, GRU, LSTM, with two layers and dropout or no biases)") {
  for (RnnKind kind : {RnnKind::RNNTanh, RnnKind::RNNReLU, RnnKind::GRU, RnnKind::LSTM}) {
    INFO(rnn_kind_name(kind));
    const int64_t G = rnn_gates(kind), H = 3;
    const bool lstm = kind == RnnKind::LSTM;
    // All of the op's results in one tensor, each with its own weight.
    auto results = [](const RnnResult& r) {
      TensorList parts{r.output.reshape({-1}), r.h.reshape({-1}) * 0.5};
      if (r.c.defined()) parts.push_back(r.c.reshape({-1}) * 0.25);
      return cat(parts, 0);
    };
    gradgradcheck([&](const TensorList& in) {
      manual_seed(11);  // the same dropout masks at every evaluation
      const TensorList weights(in.begin() + 3, in.end());
      return results(rnn(in[0], in[1], in[2], weights, {.kind = kind, .num_layers = 2, .dropout = 0.3}));
    }, {leaf({4, 2, 2}), leaf({2, 2, H}), lstm ? leaf({2, 2, H}) : Tensor(), leaf({G * H, 2}, 0.5),
        leaf({G * H, H}, 0.5), leaf({G * H}, 0.5), leaf({G * H}, 0.5), leaf({G * H, H}, 0.5), leaf({G * H, H}, 0.5),
        leaf({G * H}, 0.5), leaf({G * H}, 0.5)});
    gradgradcheck([&](const TensorList& in) {  // no biases, no initial states: zeros
      return results(rnn(in[0] * in[0], Tensor(), Tensor(), {in[1], in[2]}, {.kind = kind}));
    }, {leaf({3, 2, 2}), leaf({G * H, 2}, 0.5), leaf({G * H, H}, 0.5)});
  }
  // Three layers: each layer's dropout its own mask.
  gradgradcheck([&](const TensorList& in) {
    manual_seed(13);
    const TensorList weights(in.begin() + 1, in.end());
    return rnn(in[0], Tensor(), Tensor(), weights, {.kind = RnnKind::RNNTanh, .num_layers = 3, .dropout = 0.5}).output;
  }, {leaf({3, 2, 2}), leaf({3, 2}, 0.5), leaf({3, 3}, 0.5), leaf({3, 3}, 0.5), leaf({3, 3}, 0.5), leaf({3, 3}, 0.5),
      leaf({3, 3}, 0.5)});
}

TEST_CASE("create_graph through the recurrent op with an empty batch, dropout between its layers: zeros") {
  Tensor x = leaf({3, 0, 2});
  const TensorList weights = {leaf({9, 2}), leaf({9, 3}), leaf({9, 3}), leaf({9, 3})};  // two layers, no biases
  const RnnResult r = rnn(x, Tensor(), Tensor(), weights, {.kind = RnnKind::GRU, .num_layers = 2, .dropout = 0.5});
  const TensorList first = autograd::grad({r.output.sum() + r.h.sum()}, {weights[0], weights[3]}, {}, std::nullopt,
                                          true);
  CHECK(values(first[0]) == std::vector<double>(18, 0.0));
  CHECK(values(first[1]) == std::vector<double>(27, 0.0));
}

TEST_CASE("create_graph through nn::LSTM: a gradient penalty on the input, as the unrolled cells give it") {
  // The LSTM's recorded pass against the same recurrence written out with linear, sigmoid and tanh.
  nn::LSTM lstm(2, 3);
  lstm.to(kFloat64);
  const Tensor x = leaf({4, 1, 2});
  auto parameter = [&](const std::string& name) {
    for (const auto& [n, t] : lstm.named_parameters())
      if (n == name) return t;
    FAIL("no parameter " << name);
    return Tensor();
  };
  auto penalty_gradient = [&](bool unrolled) {
    Tensor out;
    if (unrolled) {
      Tensor h = zeros({1, 3}, {.dtype = kFloat64}), c = zeros({1, 3}, {.dtype = kFloat64});
      TensorList steps;
      for (int64_t t = 0; t < 4; ++t) {
        const Tensor gates = linear(x[t], parameter("weight_ih_l0"), parameter("bias_ih_l0")) +
                             linear(h, parameter("weight_hh_l0"), parameter("bias_hh_l0"));
        c = sigmoid(gates.narrow(1, 3, 3)) * c + sigmoid(gates.narrow(1, 0, 3)) * tanh(gates.narrow(1, 6, 3));
        h = sigmoid(gates.narrow(1, 9, 3)) * tanh(c);
        steps.push_back(h);
      }
      out = stack(steps, 0);
    } else {
      out = lstm.forward(x);
    }
    const Tensor input_grad = differentiable_grad((out * out).sum(), x);
    return autograd::grad({(input_grad * input_grad).sum()}, {parameter("weight_hh_l0")})[0];
  };
  check_close(values(penalty_gradient(false)), values(penalty_gradient(true)), 1e-12);
}

TEST_CASE("create_graph leaves no reference cycle but a leaf's .grad, which resetting it breaks") {
  std::weak_ptr<Node> forward_node, gradient_node, leaf_gradient_node;
  std::weak_ptr<TensorImpl> leaf_impl;
  {
    Tensor x = leaf({3});
    leaf_impl = x.impl_ptr();
    const Tensor y = x.exp();  // exp's backward reads its saved output, whose history is exp's own node
    forward_node = y.grad_fn();
    const Tensor first = differentiable_grad(y.sum(), x);
    gradient_node = first.grad_fn();
    CHECK(values(autograd::grad({first.sum()}, {x})[0]) == values(y));
    // backward's .grad leads back to the leaf, which holds it (PyTorch's cycle too): resetting .grad frees both.
    (x * x).sum().backward(Tensor(), std::nullopt, kCreateGraph);
    leaf_gradient_node = x.grad().grad_fn();
    REQUIRE(!leaf_gradient_node.expired());
    x.set_grad(Tensor());
  }
  CHECK(forward_node.expired());
  CHECK(gradient_node.expired());
  CHECK(leaf_gradient_node.expired());
  CHECK(leaf_impl.expired());
}

TEST_CASE("create_graph: hooks and retain_grad see differentiable gradients") {
  Tensor x = tensor<double>({1, 3}).requires_grad_();
  const Tensor h = x * x;
  h.retain_grad();
  Tensor seen;
  h.register_hook([&](const Tensor& g) {
    seen = g;
    return g * 2;
  });
  (h * x).sum().backward(Tensor(), std::nullopt, kCreateGraph);  // dh = x (then doubled by the hook)
  REQUIRE(seen.requires_grad());
  CHECK(values(seen) == std::vector<double>{1, 3});
  CHECK(values(h.grad()) == std::vector<double>{2, 6});
  REQUIRE(h.grad().requires_grad());
  // .grad of x: h + dh 2x = x^2 + 2x * 2x = 5x^2 (dh doubled by the hook).
  CHECK(values(x.grad()) == std::vector<double>{5, 45});
  // By x: the first term, h itself, passes its gradient through h's node, whose hook doubles it again (the hook is
  // the tensor's, in every pass, as PyTorch's): 2 * 2x; the second, 4x^2 with the hook inside: 8x. 12x in all.
  CHECK(values(autograd::grad({x.grad().sum()}, {x})[0]) == std::vector<double>{12, 36});
  x.set_grad(Tensor());
}

TEST_CASE("cuda: a Hessian-vector product (create_graph) through linear, layer_norm, gelu, two losses: as the CPU's") {
  SKIP_WITHOUT_GPU();
  const TensorList weights = {randn({32, 16}) * 0.3, randn({32}), randn({4, 32}) * 0.3};
  const TensorList directions = {randn({32, 16}), randn({32}), randn({4, 32})};
  const Tensor x = randn({8, 16}), target = randn({8, 4}), labels = tensor<int64_t>({0, 3, 1, 2, 2, 0, 1, 3});
  // H v for the loss by the weights: the gradient's projection on v, differentiated again.
  auto hessian_vector_product = [&](Device device, DType dtype) {
    TensorList w, v;
    for (size_t i = 0; i < weights.size(); ++i) {
      w.push_back(weights[i].to(device, dtype).clone().requires_grad_());
      v.push_back(directions[i].to(device, dtype));
    }
    const Tensor hidden = softmax(gelu(layer_norm(tanh(linear(x.to(device, dtype), w[0], w[1])), {32})), 1);
    const Tensor out = linear(hidden, w[2]);
    const Tensor loss = mse_loss(out, target.to(device, dtype)) + cross_entropy(out, labels.to(device));
    const TensorList g = autograd::grad({loss}, w, {}, std::nullopt, /*create_graph=*/true);
    Tensor projected = (g[0] * v[0]).sum() + (g[1] * v[1]).sum() + (g[2] * v[2]).sum();
    return autograd::grad({projected}, w);
  };
  for (DType dtype : {kFloat64, kFloat32}) {
    INFO(dtype_name(dtype));
    const TensorList on_gpu = hessian_vector_product(Device::cuda(0), dtype);
    const TensorList on_cpu = hessian_vector_product(Device::cpu(), dtype);
    for (size_t i = 0; i < on_cpu.size(); ++i) {
      INFO("weight " << i);
      REQUIRE(on_gpu[i].device() == Device::cuda(0));
      check_close(values(on_gpu[i].to(Device::cpu())), values(on_cpu[i]), dtype == kFloat64 ? 1e-12 : 1e-4);
    }
  }
}

TEST_CASE("cuda: a gradient penalty through a convolutional critic equals the CPU's") {
  SKIP_WITHOUT_GPU();
  const TensorList weights = {randn({8, 3, 3, 3}, {.dtype = kFloat64}) * 0.3, randn({8}, {.dtype = kFloat64}),
                              randn({1, 8 * 4 * 4}, {.dtype = kFloat64}) * 0.1};
  const Tensor x = randn({4, 3, 8, 8}, {.dtype = kFloat64});
  auto weight_gradients = [&](Device device, MemoryFormat format) {
    TensorList w;
    for (const Tensor& t : weights) w.push_back(t.to(device).clone().requires_grad_());
    const Tensor input = contiguous(x.to(device), format).detach().requires_grad_();
    const Tensor features = avg_pool2d(relu(conv2d(input, w[0], w[1], {.padding = {1, 1}})), {2, 2});
    const Tensor critic = linear(features.reshape({4, -1}), w[2]);
    const Tensor input_grad = autograd::grad({critic.sum()}, {input}, {}, std::nullopt, /*create_graph=*/true)[0];
    const Tensor norm = sqrt((input_grad * input_grad).sum({1, 2, 3}));
    const Tensor loss = critic.mean() + 10 * ((norm - 1) * (norm - 1)).mean();
    return autograd::grad({loss}, w);
  };
  const TensorList on_cpu = weight_gradients(Device::cpu(), MemoryFormat::Contiguous);
  for (MemoryFormat format : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
    INFO(memory_format_name(format));
    const TensorList on_gpu = weight_gradients(Device::cuda(0), format);
    for (size_t i = 0; i < on_cpu.size(); ++i) {
      INFO("weight " << i);
      check_close(values(on_gpu[i].to(Device::cpu())), values(on_cpu[i]), 1e-10);
    }
  }
}

TEST_CASE("cuda: second derivatives through conv2d, batch_norm_relu, max_pool2d, dropout and embedding: as the CPU's") {
  SKIP_WITHOUT_GPU();
  const TensorOptions f64{.dtype = kFloat64};
  const TensorList weights = {randn({8, 3, 3, 3}, f64) * 0.3, rand({8}, f64) + 0.5, randn({8}, f64) * 0.1,
                              randn({6, 8}, f64), randn({1, 8 * 4 * 4}, f64) * 0.1};
  const Tensor x = randn({4, 3, 8, 8}, f64), running_mean = randn({8}, f64) * 0.1, running_var = rand({8}, f64) + 0.5;
  const Tensor ids = tensor<int64_t>({0, 5, 2, 5});
  // The gradient of the weights' gradient norm (itself from a pass with create_graph) by the weights.
  auto penalty_gradients = [&](Device device, DType dtype, MemoryFormat format, ReluSaved saved, bool training) {
    TensorList w;
    for (const Tensor& t : weights) w.push_back(t.to(device, dtype).clone().requires_grad_());
    manual_seed(3);  // the same dropout mask on both devices
    Tensor h = conv2d(contiguous(x.to(device, dtype), format), w[0], Tensor(), {.padding = {1, 1}});
    h = h + embedding(ids.to(device), w[3], 5).view({4, 8, 1, 1});
    h = batch_norm_relu(h, training ? Tensor() : running_mean.to(device), training ? Tensor() : running_var.to(device),
                        w[1], w[2], training, 0.1, 1e-5, Tensor(), Tensor(), saved);
    h = dropout(max_pool2d(h, {2, 2}), 0.25);
    const Tensor out = linear(h.reshape({4, -1}), w[4]);
    const TensorList g = autograd::grad({(out * out).mean()}, w, {}, std::nullopt, /*create_graph=*/true);
    Tensor penalty = (g[0] * g[0]).sum();
    for (size_t i = 1; i < g.size(); ++i) penalty = penalty + (g[i] * g[i]).sum();
    return autograd::grad({penalty}, w);
  };
  for (bool training : {true, false}) {
    for (ReluSaved saved : {ReluSaved::Mask, ReluSaved::Output}) {
      const TensorList on_cpu =
          penalty_gradients(Device::cpu(), kFloat64, MemoryFormat::Contiguous, saved, training);
      for (DType dtype : {kFloat64, kFloat32}) {
        for (MemoryFormat format : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
          INFO((training ? "training, " : "eval, ") << (saved == ReluSaved::Mask ? "mask, " : "output, ")
               << dtype_name(dtype) << ", " << memory_format_name(format));
          const TensorList on_gpu = penalty_gradients(Device::cuda(0), dtype, format, saved, training);
          for (size_t i = 0; i < on_cpu.size(); ++i) {
            INFO("weight " << i);
            REQUIRE(on_gpu[i].device() == Device::cuda(0));
            check_close(values(on_gpu[i].to(Device::cpu(), kFloat64)), values(on_cpu[i]),
                        dtype == kFloat64 ? 1e-10 : 5e-3);
          }
        }
      }
    }
  }
}

TEST_CASE("cuda: linear_cross_entropy's second derivatives (dense, aligned-rows weights, a bias or none): the CPU's") {
  SKIP_WITHOUT_GPU();
  const TensorOptions f64{.dtype = kFloat64};
  const Tensor x = randn({6, 5}, f64), weight = randn({7, 5}, f64) * 0.5, bias = randn({7}, f64);
  const Tensor target = tensor<int64_t>({0, 6, -100, 3, 3, 1}), v = randn({7, 5}, f64);
  // H v for the loss by the weight, and the input's gradient of the weight gradient's projection on v.
  auto second_derivatives = [&](Device device, bool with_bias, bool aligned) {
    Tensor w = weight.to(device);
    if (aligned) w = contiguous_aligned_rows(w);
    w = w.detach().requires_grad_();
    const Tensor input = x.to(device).requires_grad_();
    const Tensor loss = linear_cross_entropy(input, w, with_bias ? bias.to(device) : Tensor(), target.to(device));
    const Tensor g = autograd::grad({loss}, {w}, {}, std::nullopt, /*create_graph=*/true)[0];
    return autograd::grad({(g * v.to(device)).sum()}, {w, input});
  };
  for (bool with_bias : {false, true}) {
    const TensorList on_cpu = second_derivatives(Device::cpu(), with_bias, false);
    for (bool aligned : {false, true}) {
      INFO((with_bias ? "bias, " : "no bias, ") << (aligned ? "aligned rows" : "dense"));
      const TensorList on_gpu = second_derivatives(Device::cuda(0), with_bias, aligned);
      for (size_t i = 0; i < on_cpu.size(); ++i) {
        INFO("gradient " << i);
        check_close(values(on_gpu[i].to(Device::cpu())), values(on_cpu[i]), 1e-12);
      }
    }
  }
}

TEST_CASE("cuda: second derivatives through max_pool2d's flat indices, gather, cumsum, index_select, the binary "
          "cross-entropies: the CPU's") {
  SKIP_WITHOUT_GPU();
  const TensorOptions f64{.dtype = kFloat64};
  const Tensor x = randn({2, 3, 6, 6}, f64), y = rand({2, 12}, f64), index = tensor<int64_t>({2, 0, 1, 1, 0, 2});
  // The gradient by x of the squared norm of the loss's gradient by x (itself from a pass with create_graph).
  auto gradient_of_norm = [&](Device device) {
    const Tensor input = x.to(device).requires_grad_();
    const Tensor pooled = max_pool2d_with_indices(input * input, {3, 3}, {.stride = {2, 2}, .padding = {1, 1}}).first;
    const Tensor rows = cumsum(index_select(pooled.reshape({2, 27}), 1, index.to(device)), 1);  // [2, 6]
    const Tensor picked = gather(rows, 1, index.view({2, 3}).to(device));
    const Tensor logits = cat({picked, rows}, 1) * 0.1;  // [2, 9]
    const Tensor loss = binary_cross_entropy_with_logits(logits, y.narrow(1, 0, 9).to(device),
                                                         {.pos_weight = tensor<double>({2.0}).to(device)}) +
                        binary_cross_entropy(sigmoid(logits), y.narrow(1, 3, 9).to(device));
    const Tensor g = autograd::grad({loss}, {input}, {}, std::nullopt, /*create_graph=*/true)[0];
    return autograd::grad({(g * g).sum()}, {input})[0];
  };
  const Tensor on_gpu = gradient_of_norm(Device::cuda(0));
  REQUIRE(on_gpu.device() == Device::cuda(0));
  check_close(values(on_gpu.to(Device::cpu())), values(gradient_of_norm(Device::cpu())), 1e-12);
}

TEST_CASE("cuda: batch_norm_relu's create_graph pass in float16 channels_last (cuDNN's fused kernels) gives the "
          "plain pass's gradients") {
  SKIP_WITHOUT_GPU();
  const Tensor x = contiguous(randn({8, 16, 6, 6}).to(Device::cuda(0), kFloat16), MemoryFormat::ChannelsLast);
  const Tensor residual = randn({8, 16, 6, 6}).to(Device::cuda(0), kFloat16);
  for (ReluSaved saved : {ReluSaved::Mask, ReluSaved::Output}) {
    for (bool with_residual : {false, true}) {
      INFO((saved == ReluSaved::Mask ? "mask, " : "output, ") << (with_residual ? "a residual" : "no residual"));
      Tensor input = x.detach().requires_grad_();
      Tensor weight = (rand({16}) + 0.5).to(Device::cuda(0)).requires_grad_();
      Tensor bias = randn({16}).to(Device::cuda(0)).requires_grad_();
      auto loss = [&] {
        const Tensor out = batch_norm_relu(input, Tensor(), Tensor(), weight, bias, true, 0.1, 1e-5,
                                           with_residual ? residual : Tensor(), Tensor(), saved);
        return (out.to(kFloat32) * out.to(kFloat32)).mean();
      };
      const TensorList plain = autograd::grad({loss()}, {input, weight, bias});
      const TensorList recorded = autograd::grad({loss()}, {input, weight, bias}, {}, std::nullopt, true);
      for (size_t i = 0; i < plain.size(); ++i) {
        INFO("gradient " << i);
        REQUIRE(recorded[i].dtype() == plain[i].dtype());
        check_close(values(recorded[i]), values(plain[i]), 1e-2);
      }
      // and differentiable again
      CHECK(autograd::grad({(recorded[1] * recorded[1]).sum()}, {weight})[0].defined());
    }
  }
}

TEST_CASE("cuda: second derivatives through the recurrent op (two layers, dropout): the CPU's") {
  SKIP_WITHOUT_GPU();
  const TensorOptions f64{.dtype = kFloat64};
  for (RnnKind kind : {RnnKind::GRU, RnnKind::LSTM}) {
    INFO(rnn_kind_name(kind));
    const int64_t G = rnn_gates(kind), H = 8;
    TensorList weights;
    for (int64_t l = 0; l < 2; ++l) {
      for (const Shape& shape : {Shape{G * H, l == 0 ? 5 : H}, Shape{G * H, H}, Shape{G * H}, Shape{G * H}})
        weights.push_back(randn(shape, f64) * 0.3);
    }
    const Tensor x = randn({6, 4, 5}, f64);
    // The gradient by the weights of the input gradient's squared norm (from a pass with create_graph).
    auto gradients = [&](Device device, DType dtype) {
      TensorList w;
      for (const Tensor& t : weights) w.push_back(t.to(device, dtype).clone().requires_grad_());
      const Tensor input = x.to(device, dtype).clone().requires_grad_();
      manual_seed(5);
      const RnnResult r = rnn(input, Tensor(), Tensor(), w, {.kind = kind, .num_layers = 2, .dropout = 0.25});
      const Tensor g = autograd::grad({(r.output * r.output).sum()}, {input}, {}, std::nullopt, true)[0];
      return autograd::grad({(g * g).sum()}, w);
    };
    const TensorList on_cpu = gradients(Device::cpu(), kFloat64);
    for (DType dtype : {kFloat64, kFloat32}) {
      INFO(dtype_name(dtype));
      const TensorList on_gpu = gradients(Device::cuda(0), dtype);
      for (size_t i = 0; i < on_cpu.size(); ++i) {
        INFO("weight " << i);
        check_close(values(on_gpu[i].to(Device::cpu(), kFloat64)), values(on_cpu[i]), dtype == kFloat64 ? 1e-10 : 2e-3);
      }
    }
  }
}

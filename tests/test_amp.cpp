// Mixed precision: the casting table under autocast, the parameter-cast cache, and dynamic loss scaling.
#include <doctest/doctest.h>

#include <cmath>
#include <algorithm>
#include <string_view>
#include <map>
#include <functional>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <tuple>

#include "core/autocast.h"
#include "core/cuda_graph.h"
#include "halfgrad.h"
#include "tests/testing.h"
#include "optim/adagrad.h"
#include "optim/adam.h"
#include "optim/rmsprop.h"
#include "optim/sgd.h"
#include "optim/grad_scaler.h"

using namespace halfgrad;
using halfgrad::testing::contains;
using halfgrad::testing::values;

// Collects the trace lines written while it lives.
struct TraceCapture {
  std::vector<std::string> lines;
  amp::TraceGuard guard;
  TraceCapture() {
    amp::set_trace_sink([this](const std::string& line) { lines.push_back(line); });
  }
  ~TraceCapture() { amp::set_trace_sink(nullptr); }
  bool saw(const std::string& line) const { return std::find(lines.begin(), lines.end(), line) != lines.end(); }
};

TEST_CASE("autocast applies each op's rule from the table, as the trace shows") {
  Tensor a = randn({4, 8}), b = randn({8, 3});
  Tensor h = randn({4, 3}, {.dtype = kFloat16});
  TraceCapture trace;
  amp::AutocastGuard autocast(kFloat16);
  CHECK(matmul(a, b).dtype() == kFloat16);                 // lower precision
  CHECK(exp(h).dtype() == kFloat32);                       // float32
  CHECK((h + randn({4, 3})).dtype() == kFloat32);          // promote
  CHECK(relu(h).dtype() == kFloat16);                      // unchanged
  CHECK(sum(h).dtype() == kFloat32);                       // float32 reduction
  CHECK(cross_entropy(h, tensor<int64_t>({0, 2, 1, 0})).dtype() == kFloat32);  // float32 math, no float32 copy
  CHECK(trace.saw("matmul [lower precision] (float32, float32) -> (float16)"));
  CHECK(trace.saw("exp [float32] (float16) -> (float32)"));
  CHECK(trace.saw("add [promote] (float16, float32) -> (float32)"));
  CHECK(trace.saw("relu [unchanged] (float16) -> (float16)"));
  CHECK(trace.saw("sum [float32] (float16) -> (float32)"));
  CHECK(trace.saw("cross_entropy [float32 math] (float16, int64) -> (float32)"));
}

// Every row of the cast table (core/autocast.h) is an op that exists and applies its rule: each op is called once
// under autocast with the trace on, and the trace must name it with its category. A row added without a call here
// fails the test, as does an op whose trace line shows another rule.
TEST_CASE("every row of the cast table names an op that runs under autocast with that rule, as the trace shows") {
  manual_seed(11);
  const Tensor x = randn({4, 6}), y = randn({4, 6}), positive = rand({4, 6}).add(0.5);
  const Tensor image = randn({2, 3, 4, 4}), kernel = randn({5, 3, 3, 3});
  const Tensor labels = tensor<int64_t>({0, 2, 1, 5});
  nn::LSTM lstm(6, 3);
  const Tensor table = randn({10, 6}), ids = tensor<int64_t>({1, 3});
  const Tensor stats_mean = zeros({3}), stats_var = ones({3}), gamma = ones({3}), beta = zeros({3});
  const std::map<std::string_view, std::function<void()>> calls = {
      {"matmul", [&] { matmul(x, y.transpose(0, 1)); }},
      {"linear", [&] { linear(x, y, Tensor()); }},
      {"bmm", [&] { bmm(x.unsqueeze(0), y.transpose(0, 1).unsqueeze(0)); }},
      {"conv2d", [&] { conv2d(image, kernel); }},
      {"rnn", [&] { lstm.forward(x.unsqueeze(1), Tensor(), Tensor()); }},
      {"exp", [&] { exp(x); }},
      {"log", [&] { log(positive); }},
      {"pow", [&] { pow(positive, 2.0); }},
      {"softmax", [&] { softmax(x, 1); }},
      {"log_softmax", [&] { log_softmax(x, 1); }},
      {"mse_loss", [&] { mse_loss(x, y); }},
      {"cross_entropy", [&] { cross_entropy(x, labels); }},
      {"nll_loss", [&] { nll_loss(x, labels); }},
      {"binary_cross_entropy_with_logits", [&] { binary_cross_entropy_with_logits(x, sigmoid(y)); }},
      {"sum", [&] { sum(x); }},
      {"mean", [&] { mean(x); }},
      {"var", [&] { var(x); }},
      {"std", [&] { halfgrad::std(x); }},
      {"layer_norm", [&] { layer_norm(x, {6}); }},
      {"cumsum", [&] { cumsum(x, 1); }},
      {"add", [&] { add(x, y); }},
      {"sub", [&] { sub(x, y); }},
      {"mul", [&] { mul(x, y); }},
      {"div", [&] { div(x, positive); }},
      {"maximum", [&] { maximum(x, y); }},
      {"minimum", [&] { minimum(x, y); }},
      {"where", [&] { where(x.gt(0.0), x, y); }},
      {"cat", [&] { cat({x, y}, 0); }},
      {"stack", [&] { stack({x, y}, 0); }},
      {"scatter_add", [&] { scatter_add(x, 0, labels.narrow(0, 0, 2).view({2, 1}), y); }},
      {"relu", [&] { relu(x); }},
      {"tanh", [&] { tanh(x); }},
      {"sigmoid", [&] { sigmoid(x); }},
      {"gelu", [&] { gelu(x); }},
      {"silu", [&] { silu(x); }},
      {"erf", [&] { erf(x); }},
      {"neg", [&] { neg(x); }},
      {"abs", [&] { abs(x); }},
      {"sqrt", [&] { sqrt(positive); }},
      {"rsqrt", [&] { rsqrt(positive); }},
      {"clamp", [&] { clamp(x, -0.5, 0.5); }},
      {"max_pool2d", [&] { max_pool2d(image, {2, 2}); }},
      {"avg_pool2d", [&] { avg_pool2d(image, {2, 2}); }},
      {"adaptive_avg_pool2d", [&] { adaptive_avg_pool2d(image, {1, 1}); }},
      {"dropout", [&] { dropout(x, 0.5); }},
      {"embedding", [&] { embedding(ids, table); }},
      {"max", [&] { max(x); }},
      {"min", [&] { min(x); }},
      {"amax", [&] { amax(x, {1}); }},
      {"amin", [&] { amin(x, {1}); }},
      {"argmax", [&] { argmax(x, 1); }},
      {"gather", [&] { gather(x, 1, labels.view({4, 1})); }},
      {"scatter", [&] { scatter(x, 1, labels.view({4, 1}), 0.5); }},
      {"pad", [&] { pad(x, {1, 1}, PadMode::Reflect); }},
      {"batch_norm", [&] { batch_norm(image, stats_mean, stats_var, gamma, beta, true); }},
      {"batch_norm_relu", [&] { batch_norm_relu(image, stats_mean, stats_var, gamma, beta, true, 0.1, 1e-5, image); }},
  };
  for (const amp::OpRule& row : amp::kCastRules) {
    const std::string op(row.op);
    CAPTURE(op);
    const auto call = calls.find(row.op);
    REQUIRE_MESSAGE(call != calls.end(), "no call of this row's op in the test");
    TraceCapture trace;
    {
      amp::AutocastGuard autocast(kFloat16);
      call->second();
    }
    const std::string prefix = op + " [" + amp::rule_name(row.rule) + "] (";
    CHECK_MESSAGE(std::any_of(trace.lines.begin(), trace.lines.end(),
                              [&](const std::string& line) { return line.rfind(prefix, 0) == 0; }),
                  "expected a trace line starting \"" << prefix << "\"");
  }
  CHECK(calls.size() == std::size(amp::kCastRules));  // and no call for a row that is gone
}

TEST_CASE("autocast casts only floating tensors that are not float64") {
  amp::AutocastGuard autocast(kFloat16);
  CHECK(matmul(randn({2, 2}, {.dtype = kFloat64}), randn({2, 2}, {.dtype = kFloat64})).dtype() == kFloat64);
  CHECK(matmul(ones({2, 2}, {.dtype = kInt64}), ones({2, 2}, {.dtype = kInt64})).dtype() == kInt64);
}

TEST_CASE("bfloat16 autocast, and guards nest and can switch autocast off inside") {
  Tensor a = randn({2, 2});
  {
    amp::AutocastGuard outer(kBFloat16);
    CHECK(matmul(a, a).dtype() == kBFloat16);
    {
      amp::AutocastGuard off(kBFloat16, /*enabled=*/false);
      CHECK(matmul(a, a).dtype() == kFloat32);
    }
    CHECK(amp::is_autocast_enabled());
  }
  CHECK_FALSE(amp::is_autocast_enabled());
  CHECK(matmul(a, a).dtype() == kFloat32);
}

TEST_CASE("the trace alone changes nothing that runs") {
  Tensor a = randn({2, 2});
  TraceCapture trace;
  CHECK(matmul(a, a).dtype() == kFloat32);
  CHECK(trace.saw("matmul [lower precision] (float32, float32) -> (float32)"));
}

TEST_CASE("a float32 parameter is cast once per forward and its gradient arrives in float32") {
  Tensor w = randn({8, 8}, {.requires_grad = true});
  Tensor x = randn({4, 8});
  Tensor loss;
  {
    amp::AutocastGuard autocast(kFloat16);
    Tensor h = linear(x, w).relu();
    h = linear(h, w);  // the same weight again: the cached cast is reused
    CHECK(amp::autocast_cache_size() == 1);
    loss = mse_loss(h, zeros_like(h));  // float32 rule
    CHECK(loss.dtype() == kFloat32);
  }
  CHECK(amp::autocast_cache_size() == 0);  // released with the outermost guard
  loss.backward();
  CHECK(w.grad().dtype() == kFloat32);
  // Same computation in float32: the gradients agree to float16 accuracy.
  Tensor w32 = w.detach().clone().requires_grad_();
  Tensor h32 = linear(linear(x, w32).relu(), w32);
  mse_loss(h32, zeros_like(h32)).backward();
  double err = (w.grad() - w32.grad()).abs().max().item<double>() / w32.grad().abs().max().item<double>();
  CHECK(err < 1e-2);
}

TEST_CASE("autocast's cast of a parameter is not reused for another one at a freed one's address, nor after a write") {
  amp::AutocastGuard autocast(kFloat16);
  NoGradGuard no_grad;  // nothing else keeps a parameter alive once it goes: its address comes back for the next one
  const Tensor x = ones({1, 4});
  int wrong = 0;
  for (int i = 0; i < 200; ++i) {
    const Tensor w = full({4, 1}, double(i % 50 + 1)).requires_grad_();
    if (matmul(x, w).item<double>() != 4.0 * (i % 50 + 1)) ++wrong;  // the cast of an earlier, freed w: 157 of 200
  }
  CHECK(wrong == 0);
  Tensor w = ones({4, 1}).requires_grad_();
  CHECK(matmul(x, w).item<double>() == 4);
  w.mul_(2);  // an in-place write within the region (an optimizer's step): the cast made before is stale
  CHECK(matmul(x, w).item<double>() == 8);
}

// ---- parameter casts kept across regions

// Casts each parameter under autocast, as an op of the region would: the casts autocast then keeps.
static void cast_in_a_region(const TensorList& params, DType low) {
  amp::AutocastGuard autocast(low);
  for (const Tensor& p : params) (void)amp::detail::cast(p, low);
}

static bool is_cast_of(const Tensor& cast, const Tensor& param) {
  NoGradGuard no_grad;
  return cast.defined() && testing::bit_equal(cast, param.detach().to(cast.dtype()));
}

// Every fused optimizer's step writes each parameter's kept cast with the new value, bit for bit, and leaves it
// current: parameters of 37 elements (no whole vector), 2 x 16384 + 5 (two chunks and a tail) and a channels_last
// convolution weight; plain SGD with a gradient partly zero, which its CUDA kernel skips vector by vector.
static void check_steps_write_kept_casts(Device device) {
  using Make = std::function<std::unique_ptr<optim::Optimizer>(const TensorList&)>;
  const std::vector<std::pair<std::string, Make>> optimizers = {
      {"SGD with momentum and weight decay",
       [](const TensorList& p) {
         return std::make_unique<optim::SGD>(p, optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-4});
       }},
      {"plain SGD", [](const TensorList& p) { return std::make_unique<optim::SGD>(p, optim::SGDOptions{.lr = 0.1}); }},
      {"Adam", [](const TensorList& p) { return std::make_unique<optim::Adam>(p, optim::AdamOptions{.lr = 1e-2}); }},
      {"RMSprop centered with momentum",
       [](const TensorList& p) {
         return std::make_unique<optim::RMSprop>(
             p, optim::RMSpropOptions{.lr = 1e-2, .momentum = 0.9, .centered = true});
       }},
      {"Adagrad", [](const TensorList& p) { return std::make_unique<optim::Adagrad>(p, optim::AdagradOptions{}); }},
  };
  for (DType low : {kFloat16, kBFloat16}) {
    for (const auto& [name, make] : optimizers) {
      CAPTURE(name);
      CAPTURE(std::string(dtype_name(low)));
      const TensorOptions on{.device = device};
      TensorList params = {randn({37}, on), randn({2 * 16384 + 5}, on),
                           contiguous(randn({16, 8, 3, 3}, on), MemoryFormat::ChannelsLast)};
      for (Tensor& p : params) p.requires_grad_();
      cast_in_a_region(params, low);
      for (Tensor& p : params) {
        REQUIRE(amp::kept_cast(p).defined());
        p.set_grad(randn_like(p));
      }
      {
        NoGradGuard no_grad;
        params[1].grad().narrow(0, 0, 100).zero_();
      }
      std::vector<const void*> addresses;
      for (const Tensor& p : params) addresses.push_back(amp::kept_cast(p).data_ptr());
      std::unique_ptr<optim::Optimizer> opt = make(params);
      opt->step();
      opt->step();
      for (size_t i = 0; i < params.size(); ++i) {
        CAPTURE(i);
        const Tensor kept = amp::kept_cast(params[i]);
        CHECK(is_cast_of(kept, params[i]));
        CHECK(kept.data_ptr() == addresses[i]);  // written where it was, not cast again
      }
    }
  }
}

TEST_CASE("every fused optimizer step writes autocast's kept cast of each parameter with its new value") {
  manual_seed(21);
  check_steps_write_kept_casts(Device::cpu());
}

TEST_CASE("cuda: every fused optimizer step writes autocast's kept cast of each parameter with its new value") {
  SKIP_WITHOUT_GPU();
  manual_seed(22);
  check_steps_write_kept_casts(Device::cuda());
}

TEST_CASE("a training step's next region takes the kept casts, and trains as casting afresh does") {
  manual_seed(23);
  const Tensor x = randn({6, 8}), target = randn({6, 4});
  auto train = [&](bool keep) {
    amp::set_keep_parameter_casts(keep);
    manual_seed(24);
    Tensor w1 = randn({16, 8}, {.requires_grad = true}), w2 = randn({4, 16}, {.requires_grad = true});
    optim::SGD opt({w1, w2}, {.lr = 0.05, .momentum = 0.9});
    std::vector<const void*> casts;
    for (int step = 0; step < 3; ++step) {
      Tensor loss;
      {
        amp::AutocastGuard autocast(kFloat16);
        loss = mse_loss(linear(linear(x, w1).relu(), w2), target);
      }
      loss.backward();
      opt.step();
      opt.zero_grad();
      casts.push_back(amp::kept_cast(w1).defined() ? amp::kept_cast(w1).data_ptr() : nullptr);
    }
    amp::set_keep_parameter_casts(true);
    return std::make_tuple(w1.detach(), w2.detach(), casts);
  };
  const auto [kept_w1, kept_w2, kept_casts] = train(true);
  const auto [fresh_w1, fresh_w2, fresh_casts] = train(false);
  CHECK(testing::bit_equal(kept_w1, fresh_w1));  // the same casts, so the same steps, bit for bit
  CHECK(testing::bit_equal(kept_w2, fresh_w2));
  CHECK(kept_casts[0] != nullptr);  // one cast, kept and rewritten by every step
  CHECK(kept_casts[1] == kept_casts[0]);
  CHECK(kept_casts[2] == kept_casts[0]);
  CHECK(fresh_casts == std::vector<const void*>(3, nullptr));  // off: nothing kept
}

TEST_CASE("a kept cast goes stale with any other write to its parameter, and is cast again") {
  Tensor w = ones({4, 1}, {.requires_grad = true});
  const Tensor x = ones({1, 4});
  cast_in_a_region({w}, kFloat16);
  REQUIRE(amp::kept_cast(w).defined());
  {
    NoGradGuard no_grad;
    w.mul_(3);  // not an optimizer's step: the cast is not written
  }
  CHECK_FALSE(amp::kept_cast(w).defined());
  {
    amp::AutocastGuard autocast(kFloat16);
    CHECK(matmul(x, w).item<double>() == 12);
  }
  CHECK(is_cast_of(amp::kept_cast(w), w));
}

TEST_CASE("a step skipped for an overflow leaves each kept cast as its parameter's cast") {
  Tensor w = randn({5}, {.requires_grad = true});
  const Tensor before = w.detach().clone();
  cast_in_a_region({w}, kBFloat16);
  optim::SGD opt({w}, {.lr = 0.1, .momentum = 0.9});
  amp::GradScaler scaler;
  w.set_grad(tensor(std::vector<float>{1, INFINITY, 2, 3, 4}));
  scaler.step(opt);
  scaler.update();
  CHECK(testing::bit_equal(w.detach(), before));
  CHECK(is_cast_of(amp::kept_cast(w), w));
}

TEST_CASE("a step writes the kept casts of one dtype, a parameter cast to another is cast again by its next region") {
  Tensor a = randn({8}, {.requires_grad = true}), b = randn({8}, {.requires_grad = true});
  cast_in_a_region({a}, kFloat16);
  cast_in_a_region({b}, kBFloat16);
  optim::SGD opt({a, b}, {.lr = 0.1});
  a.set_grad(ones({8}));
  b.set_grad(ones({8}));
  opt.step();
  CHECK(is_cast_of(amp::kept_cast(a), a));
  CHECK_FALSE(amp::kept_cast(b).defined());
  cast_in_a_region({b}, kBFloat16);
  CHECK(is_cast_of(amp::kept_cast(b), b));
}

TEST_CASE("a kept cast still read by a graph kept for another backward is not written: that backward reads the old values") {
  manual_seed(25);
  Tensor w = randn({4, 4}, {.requires_grad = true});
  Tensor x = randn({3, 4}, {.requires_grad = true});  // so the product saves the float16 w, for x's gradient
  cast_in_a_region({w}, kFloat16);  // kept, so the next region takes it
  Tensor loss;
  {
    amp::AutocastGuard autocast(kFloat16);
    loss = matmul(x, w).to(kFloat32).pow(2).sum();
  }
  loss.backward(Tensor(), /*retain_graph=*/true);
  const Tensor first = x.grad().clone();
  optim::SGD opt({w}, {.lr = 0.1});
  opt.step();  // the graph's saved float16 w is the kept cast: left as it was, and stale
  CHECK_FALSE(amp::kept_cast(w).defined());
  x.set_grad(Tensor());
  loss.backward();
  CHECK(testing::bit_equal(x.grad(), first));
  cast_in_a_region({w}, kFloat16);  // cast afresh
  CHECK(is_cast_of(amp::kept_cast(w), w));
}

TEST_CASE("an aligned-rows weight's kept cast is taken as an aligned-rows matrix, and cast again after a step") {
  manual_seed(26);
  Tensor w = contiguous_aligned_rows(randn({5, 3})).requires_grad_();
  REQUIRE(is_aligned_rows(w));
  cast_in_a_region({w}, kFloat16);
  const void* kept_at = amp::kept_cast(w).data_ptr();
  {
    amp::AutocastGuard autocast(kFloat16);
    const Tensor taken = amp::detail::cast(w, kFloat16);  // the kept cast, as a tensor of its own
    CHECK(is_aligned_rows(taken));
    CHECK(taken.data_ptr() == kept_at);
  }
  optim::SGD opt({w}, {.lr = 0.1});
  w.set_grad(ones({5, 3}));
  opt.step();  // the step's flat view of w has float32's padding, the cast's float16's: not written
  CHECK_FALSE(amp::kept_cast(w).defined());
  cast_in_a_region({w}, kFloat16);
  CHECK(is_cast_of(amp::kept_cast(w), w));
}

TEST_CASE("cuda: a replayed training step keeps the casts current for eager evaluations between replays") {
  SKIP_WITHOUT_GPU();
  const TensorOptions on{.device = Device::cuda()};
  // Six steps, as a graph's replays or eagerly, each followed by evaluations in float16, bfloat16 and float16 again:
  // the first takes the casts the step wrote; the bfloat16 one replaces them, so the second float16 one casts afresh,
  // and a graph whose region took the casts kept at its capture must cast into those before its next replay.
  auto train = [&](bool graph) {
    manual_seed(27);
    // Small weights: training moves the outputs a little each step and never overflows float16 (a NaN would fail
    // every comparison below).
    Tensor w1 = (randn({32, 16}, on) * 0.1).requires_grad_(), w2 = (randn({8, 32}, on) * 0.1).requires_grad_();
    // An aligned-rows weight: the step cannot write its cast, so every step leaves it stale.
    Tensor w3 = contiguous_aligned_rows(randn({8, 8}, on) * 0.1).requires_grad_();
    const Tensor x = randn({4, 16}, on), target = randn({4, 8}, on), probe = randn({2, 16}, on);
    optim::SGD opt({w1, w2, w3}, {.lr = 0.01, .momentum = 0.9});
    auto model = [&](const Tensor& in) { return matmul(linear(linear(in, w1).relu(), w2), w3); };
    auto step = [&] {
      Tensor loss;
      {
        amp::AutocastGuard autocast(kFloat16);
        loss = mse_loss(model(x), target);
      }
      loss.backward();
      opt.step();
      opt.zero_grad();
    };
    cuda::CapturedStep captured(Device::cuda(), step, 2);
    for (int i = 0; i < 6; ++i) {
      graph ? captured() : step();
      CAPTURE(i);
      for (DType low : {kFloat16, kBFloat16, kFloat16}) {
        CAPTURE(std::string(dtype_name(low)));
        Tensor y;
        {
          amp::AutocastGuard autocast(low);
          NoGradGuard no_grad;
          for (const Tensor& w : {w1, w2, w3}) CHECK(is_cast_of(amp::detail::cast(w, low), w));
          y = model(probe);
        }
        NoGradGuard no_grad;  // what the evaluation computes from casts made now, by hand
        const Tensor fresh = matmul(linear(linear(probe.to(low), w1.to(low)).relu(), w2.to(low)), w3.to(low));
        REQUIRE(y.to(kFloat32).isfinite().all().item<bool>());
        CHECK(testing::bit_equal(y, fresh));
      }
    }
    CHECK(captured.captured() == graph);
    return TensorList{w1.detach().cpu(), w2.detach().cpu(), w3.detach().cpu()};
  };
  const TensorList replayed = train(true), eager = train(false);
  for (size_t i = 0; i < eager.size(); ++i) {
    CAPTURE(i);
    const double scale = eager[i].abs().max().item<double>();
    CHECK((replayed[i] - eager[i]).abs().max().item<double>() <= 1e-4 * scale);
  }
}

TEST_CASE("cuda: a replayed step skipped for an overflow after an edit between replays leaves the cast the parameter's") {
  SKIP_WITHOUT_GPU();
  manual_seed(29);
  const TensorOptions on{.device = Device::cuda()};
  Tensor w = (randn({8, 8}, on) * 0.1).requires_grad_();
  const Tensor x = randn({4, 8}, on);
  Tensor poison = zeros({}, on);  // the replays read it: inf makes the step's gradients overflow
  optim::SGD opt({w}, {.lr = 0.01, .momentum = 0.9});
  amp::GradScaler scaler;
  // A float32 step: its graph takes no cast, but writes the one each evaluation under autocast keeps.
  auto step = [&] {
    const Tensor loss = matmul(x, w).pow(2).sum() * (poison + 1);
    scaler.scale(loss).backward();
    scaler.step(opt);
    scaler.update();
    opt.zero_grad();
  };
  cuda::CapturedStep captured(Device::cuda(), step, 2);
  for (int i = 0; i < 4; ++i) {
    captured();
    cast_in_a_region({w}, kFloat16);  // an evaluation's cast, kept
    CHECK(is_cast_of(amp::kept_cast(w), w));
  }
  REQUIRE(captured.captured());
  {
    NoGradGuard no_grad;
    w.mul_(2);  // not a step: the kept cast, which the graph's step writes, is stale
    poison.fill_(INFINITY);
  }
  const Tensor before = w.detach().clone();
  captured();  // skipped: the step writes neither w nor its cast, which must be w's cast all the same
  CHECK(testing::bit_equal(w.detach(), before));
  CHECK(is_cast_of(amp::kept_cast(w), w));
  {
    NoGradGuard no_grad;
    poison.fill_(0);
  }
  captured();
  CHECK_FALSE(testing::bit_equal(w.detach(), before));
  CHECK(is_cast_of(amp::kept_cast(w), w));
}

TEST_CASE("keep_cast_current refuses an undefined parameter or cast, naming what it got") {
  const Tensor w = randn({4}, {.requires_grad = true});
  CHECK(contains(testing::error_of([&] { amp::keep_cast_current(w, Tensor()); }),
                 "amp::keep_cast_current: expected a parameter and the cast kept_cast() gave for it, got float32[4] "
                 "cpu and an undefined tensor"));
  CHECK(contains(testing::error_of([&] { amp::keep_cast_current(Tensor(), w); }), "got an undefined tensor and"));
  CHECK_FALSE(amp::kept_cast(Tensor()).defined());
}

TEST_CASE("a step marks current only the cast it writes, and drops one a region made from the values it replaces") {
  Tensor w = randn({4}, {.requires_grad = true});
  cast_in_a_region({w}, kFloat16);
  const Tensor written = amp::kept_cast(w);  // what a step's kernel writes
  REQUIRE(written.defined());
  {
    NoGradGuard no_grad;
    w.add_(1);  // the step's bump, before its kernel runs
  }
  cast_in_a_region({w}, kFloat16);  // another thread's region, in between: a cast of the values the step replaces
  REQUIRE(amp::kept_cast(w).defined());
  REQUIRE(amp::kept_cast(w).data_ptr() != written.data_ptr());
  amp::keep_cast_current(w, written);
  CHECK_FALSE(amp::kept_cast(w).defined());
  cast_in_a_region({w}, kFloat16);
  CHECK(is_cast_of(amp::kept_cast(w), w));
}

TEST_CASE("cuda: a capture that fails after its forward keeps none of the casts it made") {
  SKIP_WITHOUT_GPU();
  manual_seed(28);
  const TensorOptions on{.device = Device::cuda()};
  Tensor w = randn({8, 8}, on).requires_grad_();
  const Tensor x = randn({4, 8}, on);
  optim::Adam adam({w}, {.lr = 1e-3});
  {
    amp::AutocastGuard autocast(kFloat16);
    NoGradGuard no_grad;
    (void)matmul(x, w);  // cuBLAS's set-up, eagerly; a cast kept
  }
  {
    NoGradGuard no_grad;
    w.mul_(2);  // the kept cast is stale: the capture casts afresh
  }
  cuda::Graph graph;
  CHECK_THROWS(graph.capture(Device::cuda(), [&] {
    Tensor loss;
    {
      amp::AutocastGuard autocast(kFloat16);
      loss = matmul(x, w).to(kFloat32).sum();
    }
    loss.backward();
    adam.step();  // refuses a capture
  }));
  CHECK_FALSE(amp::kept_cast(w).defined());
  amp::AutocastGuard autocast(kFloat16);
  NoGradGuard no_grad;
  CHECK(testing::bit_equal(matmul(x, w), matmul(x.to(kFloat16), w.to(kFloat16))));
}

TEST_CASE("cuda: a graph whose region took a kept cast sees a parameter written between its replays") {
  SKIP_WITHOUT_GPU();
  const TensorOptions on{.device = Device::cuda()};
  Tensor w = ones({4, 4}, on).requires_grad_();
  const Tensor x = ones({2, 4}, on);
  Tensor y;
  auto forward = [&] {
    amp::AutocastGuard autocast(kFloat16);
    NoGradGuard no_grad;
    y = matmul(x, w);
  };
  forward();  // eagerly first: cuBLAS's set-up, and the cast autocast keeps
  REQUIRE(amp::kept_cast(w).defined());
  cuda::Graph graph;
  graph.capture(Device::cuda(), forward);  // takes the kept cast: no cast kernel in the graph
  graph.replay();
  CHECK(values(y) == std::vector<double>(8, 4));
  {
    NoGradGuard no_grad;
    w.mul_(2);  // no optimizer step, so no captured kernel writes the cast
  }
  graph.replay();
  CHECK(values(y) == std::vector<double>(8, 8));
  CHECK(is_cast_of(amp::kept_cast(w), w));
}

// ---- loss scaling

// A float16 parameter whose true gradient (1e-8) is below float16's smallest subnormal (6e-8).
static Tensor tiny_gradient_loss(const Tensor& w) {
  Tensor x = full({4}, 1e-3, {.dtype = kFloat16});
  return (w * x).sum().to(kFloat32) * 1e-5;  // d loss / d w = 1e-8; the loss in float32 as autocast makes it
}

TEST_CASE("a gradient that underflows float16 survives with loss scaling and vanishes without") {
  Tensor w = ones({4}, {.dtype = kFloat16, .requires_grad = true});
  tiny_gradient_loss(w).backward();
  CHECK(values(w.grad()) == std::vector<double>{0, 0, 0, 0});

  w.set_grad(Tensor());
  amp::GradScaler scaler;
  scaler.scale(tiny_gradient_loss(w)).backward();
  Tensor unscaled = w.grad().to(kFloat32) / scaler.get_scale();  // as O2's float32 master gradients hold it
  for (double g : values(unscaled)) CHECK(g == doctest::Approx(1e-8).epsilon(0.01));
}

TEST_CASE("an overflow skips the step, halves the scale and leaves the parameters unchanged") {
  Tensor w = ones({3}, {.requires_grad = true});
  optim::SGD opt({w}, {.lr = 0.1});
  amp::GradScaler scaler({.init_scale = 1024});
  w.set_grad(tensor(std::vector<float>{1, INFINITY, 2}));
  scaler.step(opt);
  scaler.update();
  CHECK(values(w) == std::vector<double>{1, 1, 1});
  CHECK(scaler.get_scale() == 512);
  CHECK(scaler.state().growth_tracker == 0);
  CHECK(scaler.skipped_steps() == 1);
  w.set_grad(tensor(std::vector<float>{NAN, 0, 0}));
  scaler.step(opt);
  scaler.update();
  CHECK(scaler.get_scale() == 256);
  CHECK(scaler.skipped_steps() == 2);
}

TEST_CASE("a skipped first step leaves SGD's momentum as if it had never run, Adam's step count does not advance") {
  for (double dampening : {0.0, 0.5}) {  // with dampening the skip is decided on the host (SGD::step_unless)
    CAPTURE(dampening);
    Tensor w = ones({2}, {.requires_grad = true}), ref = ones({2}, {.requires_grad = true});
    optim::SGD opt({w}, {.lr = 0.1, .momentum = 0.9, .dampening = dampening});
    optim::SGD ref_opt({ref}, {.lr = 0.1, .momentum = 0.9, .dampening = dampening});
    amp::GradScaler scaler({.init_scale = 4});
    w.set_grad(tensor(std::vector<float>{INFINITY, 1}));
    scaler.step(opt);
    scaler.update();
    CHECK(values(w) == std::vector<double>{1, 1});
    for (int i = 0; i < 2; ++i) {  // then two clean steps: the first of them is momentum's first (b = g)
      w.set_grad(tensor(std::vector<float>{2 * 2, 3 * 2}));  // scaled by the scale of 2 after the backoff
      scaler.step(opt);
      scaler.update();
      ref.set_grad(tensor(std::vector<float>{2, 3}));
      ref_opt.step();
    }
    CHECK(values(w) == values(ref));
  }
  Tensor v = ones({1}, {.requires_grad = true});
  optim::Adam adam({v}, {.lr = 0.1});
  amp::GradScaler scaler;
  v.set_grad(full({1}, NAN));
  scaler.step(adam);
  scaler.update();
  CHECK(adam.state(0, 0).step == 0);
  CHECK(values(v) == std::vector<double>{1});
}

TEST_CASE("a clean step unscales the gradients before the update") {
  Tensor w = ones({2}, {.requires_grad = true});
  optim::SGD opt({w}, {.lr = 1});
  amp::GradScaler scaler({.init_scale = 8});
  scaler.scale((w * tensor(std::vector<float>{1, 2})).sum()).backward();
  CHECK(values(w.grad()) == std::vector<double>{8, 16});
  scaler.step(opt);
  CHECK(values(w) == std::vector<double>{0, -1});
  scaler.update();
  CHECK(scaler.skipped_steps() == 0);
}

TEST_CASE("the scale grows after growth_interval clean steps in a row, and an overflow resets the count") {
  Tensor w = ones({1}, {.requires_grad = true});
  optim::SGD opt({w}, {.lr = 0});
  amp::GradScaler scaler({.init_scale = 4, .growth_interval = 3});
  auto iteration = [&](float g) {
    w.set_grad(full({1}, g));
    scaler.step(opt);
    scaler.update();
  };
  iteration(1);
  iteration(1);
  CHECK(scaler.get_scale() == 4);
  iteration(INFINITY);  // back off and reset the count
  CHECK(scaler.get_scale() == 2);
  iteration(1);
  iteration(1);
  CHECK(scaler.get_scale() == 2);
  iteration(1);
  CHECK(scaler.get_scale() == 4);
  CHECK(scaler.state().growth_tracker == 0);
}

TEST_CASE("the scale is float32 and never grows to infinity there") {
  Tensor w = ones({1}, {.requires_grad = true});
  optim::SGD opt({w}, {.lr = 0});
  amp::GradScaler scaler({.init_scale = 0x1p127, .growth_interval = 1});
  w.set_grad(ones({1}));
  scaler.step(opt);
  scaler.update();
  CHECK(scaler.get_scale() == 0x1p127);  // 2^128 is infinite in float32
  CHECK_THROWS_WITH_AS(amp::GradScaler({.init_scale = 1e39}), doctest::Contains("invalid scale 1e+39"), Error);
}

// Without a floor, 150 overflowing steps in a row took the scale below float32's smallest normal number; 1/scale
// overflowed and every later step was skipped however clean its gradients (issue 16). The rule is one function for
// both kernels (amp::update_scale_rule): the CPU's and, where a GPU is visible, the CUDA kernel's.
TEST_CASE("a dynamic scale stops at min_scale and clean steps go on from there, said once, it grows to max_scale") {
  std::vector<Device> devices{Device::cpu()};
  if (cuda::is_available()) devices.push_back(Device::cuda(0));
  for (Device device : devices) {
    CAPTURE(device.str());
    Tensor w = ones({1}, {.device = device, .requires_grad = true});
    optim::SGD opt({w}, {.lr = 1});
    amp::GradScaler scaler({.init_scale = 1});
    CHECK(amp::GradScalerOptions{}.min_scale == 0x1p-24);
    for (int i = 0; i < 201; ++i) {
      w.set_grad(full({1}, INFINITY, {.device = device}));
      scaler.step(opt);
      scaler.update();
    }
    CHECK(scaler.get_scale() == 0x1p-24);
    CHECK(scaler.skipped_steps() == 201);
    CHECK(values(w) == std::vector<double>{1});
    CHECK(contains(scaler.floor_warning(), "the loss scale reached its floor, min_scale 5.96"));  // seen at update 101
    w.set_grad(full({1}, 3 * 0x1p-24, {.device = device}));  // a clean step: its gradient unscales to 3
    scaler.step(opt);
    scaler.update();
    CHECK(values(w) == std::vector<double>{-2});
    CHECK(scaler.skipped_steps() == 201);

    amp::GradScaler up({.init_scale = 1024, .growth_interval = 1, .max_scale = 3000});
    std::vector<double> scales;
    for (int i = 0; i < 3; ++i) {
      w.set_grad(ones({1}, {.device = device}));
      up.step(opt);
      up.update();
      scales.push_back(up.get_scale());
    }
    CHECK(scales == std::vector<double>{2048, 3000, 3000});
    CHECK(up.floor_warning().empty());
  }
  CHECK_THROWS_WITH_AS(amp::GradScaler({.init_scale = 1, .min_scale = 2}),
                       doctest::Contains("init_scale 1 outside [min_scale 2, max_scale"), Error);
  CHECK_THROWS_WITH_AS(amp::GradScaler({.min_scale = 0}), doctest::Contains("invalid scale 0 (the scale and its "
                                                                          "inverse are float32"), Error);
  // 1e-40 is a float32 (subnormal), but its inverse is not: unscaling would turn a zero gradient into nan.
  CHECK_THROWS_WITH_AS(amp::GradScaler({.min_scale = 1e-40}), doctest::Contains("invalid scale 1e-40"), Error);
  CHECK_THROWS_WITH_AS(amp::GradScaler({.min_scale = 0x1p-128}), doctest::Contains("invalid scale"), Error);
  CHECK(amp::GradScaler({.min_scale = 0x1p-127}).state().scale == 65536);  // its inverse, 2^127, is a float32
  // A scale at min_scale reads back rounded to float32, and loads again.
  amp::GradScaler low({.init_scale = 1e-4, .min_scale = 1e-4});
  low.load_state(low.state());
}

TEST_CASE("a static scale never changes, a disabled scaler passes everything through") {
  Tensor w = ones({1}, {.requires_grad = true});
  optim::SGD opt({w}, {.lr = 1});
  amp::GradScaler fixed({.init_scale = 128, .growth_interval = 1, .dynamic = false});
  w.set_grad(full({1}, INFINITY));
  fixed.step(opt);
  fixed.update();
  CHECK(fixed.get_scale() == 128);
  CHECK(fixed.skipped_steps() == 1);
  CHECK(values(w) == std::vector<double>{1});

  amp::GradScaler off({.enabled = false});
  Tensor loss = (w * 3).sum();
  CHECK(off.scale(loss).same(loss));
  w.set_grad(ones({1}));
  off.step(opt);
  CHECK(values(w) == std::vector<double>{0});
}

TEST_CASE("unscale_ runs at most once per step") {
  Tensor w = ones({1}, {.requires_grad = true});
  optim::SGD opt({w}, {.lr = 1});
  amp::GradScaler scaler;
  w.set_grad(ones({1}));
  scaler.unscale_(opt);
  CHECK_THROWS_WITH_AS(scaler.unscale_(opt), doctest::Contains("already called"), Error);
  scaler.step(opt);
  scaler.update();
  w.set_grad(ones({1}));
  scaler.unscale_(opt);  // a new iteration
}

TEST_CASE("update() without an inf check since the last is an error, not a clean step, any gradient layout unscales") {
  Tensor w = ones({3, 2}, {.requires_grad = true});
  optim::SGD opt({w}, {.lr = 1});
  amp::GradScaler scaler({.init_scale = 1024, .growth_interval = 1});
  (void)scaler.scale(w.sum());
  CHECK_THROWS_WITH_AS(scaler.update(), doctest::Contains("GradScaler::update: no inf checks were recorded"), Error);
  CHECK(scaler.get_scale() == 1024);  // not grown
  // A gradient set by hand as a transposed view: unscaled through a contiguous copy, as PyTorch unscales any strides.
  w.set_grad(tensor(std::vector<float>{1024, 2048, 3072, 4096, 5120, 6144}, {2, 3}).t());
  scaler.unscale_(opt);
  CHECK(values(w.grad()) == std::vector<double>{1, 4, 2, 5, 3, 6});
  scaler.step(opt);
  scaler.update();
  // An expanded gradient cannot be written back: refused before any gradient is unscaled.
  Tensor v = ones({2}, {.requires_grad = true});
  optim::SGD two({w, v}, {.lr = 1});
  w.set_grad(full({3, 2}, 2048.0));
  v.set_grad(full({1}, 2048.0).expand({2}));
  CHECK_THROWS_WITH_AS(scaler.unscale_(two), doctest::Contains("GradScaler::unscale_: the gradient float32[2] cpu of a "
                                                               "parameter is an expanded view"), Error);
  CHECK(values(w.grad())[0] == 2048);  // untouched
}

TEST_CASE("step() of an optimizer with no gradient checked is refused, and update() after it counts no clean step") {
  // As PyTorch ("No inf checks were recorded for this optimizer"): nothing was checked, so nothing may count as clean.
  Tensor w = ones({2}, {.requires_grad = true});
  optim::SGD opt({w}, {.lr = 1});
  amp::GradScaler scaler({.init_scale = 1024, .growth_interval = 1});
  (void)scaler.scale(w.sum());  // no backward: w has no gradient
  CHECK_THROWS_WITH_AS(scaler.step(opt), doctest::Contains("GradScaler::step: no inf checks were recorded for this "
                                                           "optimizer: none of its 1 parameter(s) has a gradient"),
                       Error);
  CHECK_THROWS_WITH_AS(scaler.update(), doctest::Contains("no inf checks were recorded"), Error);
  CHECK(scaler.get_scale() == 1024);  // not grown
  // The next iteration starts afresh, and a step that ran once is refused a second time.
  w.set_grad(full({2}, 1024.0));
  scaler.step(opt);
  CHECK(values(w) == std::vector<double>{0, 0});
  CHECK_THROWS_WITH_AS(scaler.step(opt), doctest::Contains("step() was already called"), Error);
  scaler.update();
  CHECK(scaler.get_scale() == 2048);
}

TEST_CASE("a float16 gradient that unscaling by a scale below 1 takes past float16's range is an overflow") {
  // 30000 / 0.25 = 120000: finite in float32, where the product is made, inf once stored in float16.
  Tensor w = ones({2}, {.dtype = kFloat16, .requires_grad = true});
  optim::SGD opt({w}, {.lr = 1});
  amp::GradScaler scaler({.init_scale = 0.25});
  (void)scaler.scale(w.to(kFloat32).sum());
  w.set_grad(tensor(std::vector<float>{30000, 1}).to(kFloat16));
  scaler.step(opt);
  scaler.update();
  CHECK(scaler.skipped_steps() == 1);
  CHECK(values(w) == std::vector<double>{1, 1});  // left alone
}

TEST_CASE("cuda: a float16 gradient that unscaling by a scale below 1 overflows is flagged by the fused pass") {
  SKIP_WITHOUT_GPU();
  Tensor w = ones({2}, {.dtype = kFloat16, .device = Device::cuda(0), .requires_grad = true});
  optim::SGD opt({w}, {.lr = 1});
  amp::GradScaler scaler({.init_scale = 0.25});
  (void)scaler.scale(w.to(kFloat32).sum());
  w.set_grad(tensor(std::vector<float>{30000, 1}).to(kFloat16).cuda());
  scaler.step(opt);
  scaler.update();
  CHECK(scaler.skipped_steps() == 1);
  CHECK(values(w.cpu()) == std::vector<double>{1, 1});
}

TEST_CASE("scaler state round-trips") {
  amp::GradScaler a({.init_scale = 64, .growth_interval = 10});
  Tensor w = ones({1}, {.requires_grad = true});
  optim::SGD opt({w}, {.lr = 0});
  for (int i = 0; i < 3; ++i) {
    w.set_grad(ones({1}));
    a.step(opt);
    a.update();
  }
  amp::GradScaler b({.growth_interval = 10});
  b.load_state(a.state());
  CHECK(b.state() == a.state());
  CHECK(b.get_scale() == 64);
  CHECK(b.state().growth_tracker == 3);
  CHECK_THROWS_WITH_AS(b.load_state({.scale = -1}), doctest::Contains("invalid scale"), Error);
  CHECK_THROWS_WITH_AS(b.load_state({.scale = 1e-300}), doctest::Contains("invalid scale 1e-300"), Error);
  CHECK_THROWS_WITH_AS(b.load_state({.scale = 1e-10}), doctest::Contains("scale 1e-10 outside [min_scale"), Error);
  CHECK(b.get_scale() == 64);  // refused, unchanged
  amp::GradScaler c({.growth_interval = 10});
  c.load_state_tensors(a.state_tensors());  // as a training checkpoint carries it
  CHECK(c.state() == a.state());
  CHECK_THROWS_WITH_AS(c.load_state_tensors({}), doctest::Contains("scaler.scale"), Error);
  // A scale stored as int64 (another writer's file) is refused, not read as a number of that size.
  const std::vector<std::pair<std::string, Tensor>> int_scale = {
      {"scaler.scale", scalar_tensor(int64_t(1) << 62, {.dtype = kInt64})},
      {"scaler.growth_tracker", scalar_tensor(int64_t(0), {.dtype = kInt64})}};
  CHECK_THROWS_WITH_AS(c.load_state_tensors(int_scale),
                       doctest::Contains("'scaler.scale' must be a 0-d float64, got int64"), Error);
  CHECK(c.state() == a.state());  // unchanged
}

TEST_CASE("a scaler's checkpoint carries the options that move its scale, as PyTorch's state_dict") {
  amp::GradScaler a({.init_scale = 64, .growth_factor = 4, .backoff_factor = 0.25, .growth_interval = 3,
                     .min_scale = 2, .max_scale = 1024, .dynamic = true});
  // A scaler made with the defaults continues as the saved one would: growth after 3 clean steps, by 4.
  amp::GradScaler b;
  b.load_state_tensors(a.state_tensors());
  CHECK(b.options().growth_factor == 4);
  CHECK(b.options().backoff_factor == 0.25);
  CHECK(b.options().growth_interval == 3);
  CHECK(b.options().min_scale == 2);
  CHECK(b.options().max_scale == 1024);
  CHECK(b.options().init_scale == 65536);  // not saved: the loaded scale replaces it
  Tensor w = ones({1}, {.requires_grad = true});
  optim::SGD opt({w}, {.lr = 0});
  auto clean_step = [&](amp::GradScaler& scaler) {
    w.set_grad(ones({1}));
    scaler.step(opt);
    scaler.update();
  };
  for (int i = 0; i < 3; ++i) clean_step(b);
  CHECK(b.get_scale() == 256);
  w.set_grad(full({1}, std::numeric_limits<double>::infinity()));
  b.step(opt);
  b.update();
  CHECK(b.get_scale() == 64);

  // Refused as the constructor refuses them, and nothing changes.
  auto with = [&](const char* name, const Tensor& value) {
    auto named = a.state_tensors();
    for (auto& [n, t] : named)
      if (n == name) t = value;
    return named;
  };
  amp::GradScaler c;
  auto number = [](double v) { return scalar_tensor(v, {.dtype = kFloat64}); };
  auto count = [](int64_t v) { return scalar_tensor(v, {.dtype = kInt64}); };
  CHECK_THROWS_WITH_AS(c.load_state_tensors(with("scaler.growth_factor", number(0.5))),
                       doctest::Contains("GradScaler::load_state_tensors: growth_factor must be > 1 and finite in "
                                         "float32, got 0.5"), Error);
  // The factors are float32 in the update, as the scale: 1 - 1e-9 is 1 there, and the scale would never back off.
  CHECK_THROWS_WITH_AS(c.load_state_tensors(with("scaler.backoff_factor", number(1 - 1e-9))),
                       doctest::Contains("backoff_factor must be in (0, 1) in float32"), Error);
  CHECK_THROWS_WITH_AS(c.load_state_tensors(with("scaler.growth_factor", number(1 + 1e-9))),
                       doctest::Contains("growth_factor must be > 1 and finite in float32"), Error);
  // The clean-step count is an int32 on the device.
  CHECK_THROWS_WITH_AS(c.load_state_tensors(with("scaler.growth_interval", count(int64_t(1) << 32))),
                       doctest::Contains("growth_interval must be in [1, 2^31 - 1], got 4294967296"), Error);
  CHECK_THROWS_WITH_AS(c.load_state_tensors(with("scaler.min_scale", number(0))),
                       doctest::Contains("GradScaler::load_state_tensors (min_scale): invalid scale 0"), Error);
  CHECK_THROWS_WITH_AS(c.load_state_tensors(with("scaler.min_scale", number(128.0))),
                       doctest::Contains("scale 64 outside [min_scale 128"), Error);
  // Every entry that cannot be read is named in one error.
  auto two_wrong = with("scaler.growth_interval", number(2.0));
  for (auto& [n, t] : two_wrong)
    if (n == "scaler.dynamic") t = Tensor();
  CHECK_THROWS_WITH_AS(c.load_state_tensors(two_wrong),
                       doctest::Contains("cannot load the scaler state (2 problems):\n"
                                         "  - 'scaler.growth_interval' must be a 0-d int64, got float64[] cpu\n"
                                         "  - 'scaler.dynamic' must be a 0-d bool, got an undefined tensor"), Error);
  auto twice = a.state_tensors();
  twice.emplace_back("scaler.scale", number(1));
  CHECK_THROWS_WITH_AS(c.load_state_tensors(twice), doctest::Contains("'scaler.scale' is there twice"), Error);
  CHECK_THROWS_WITH_AS(c.load_state_tensors({{"scaler.growth_tracker", count(0)}}),
                       doctest::Contains("missing 'scaler.scale'"), Error);
  // The tracker is checked against the loaded interval: 2 clean steps are within an interval of 3, not of 2.
  clean_step(a);
  clean_step(a);
  CHECK_THROWS_WITH_AS(c.load_state_tensors(with("scaler.growth_interval", count(2))),
                       doctest::Contains("growth_tracker 2 outside [0, 2)"), Error);
  CHECK(c.options().growth_factor == 2);
  CHECK(c.options().growth_interval == 2000);
  CHECK(c.get_scale() == 65536);

  // A file written before the options were kept: this scaler's stay.
  amp::GradScaler d({.growth_interval = 7});
  d.load_state_tensors({{"scaler.scale", scalar_tensor(8.0, {.dtype = kFloat64})},
                        {"scaler.growth_tracker", scalar_tensor(int64_t(5), {.dtype = kInt64})}});
  CHECK(d.get_scale() == 8);
  CHECK(d.options().growth_interval == 7);

  // A static scale stays static.
  amp::GradScaler fixed({.init_scale = 128, .dynamic = false});
  amp::GradScaler e;
  e.load_state_tensors(fixed.state_tensors());
  w.set_grad(full({1}, std::numeric_limits<double>::infinity()));
  e.step(opt);
  e.update();
  CHECK(e.get_scale() == 128);
}

TEST_CASE("when the scale collapses, the diagnosis tells forward overflow from gradient overflow") {
  Tensor w = ones({2}, {.requires_grad = true});
  Tensor v = ones({2}, {.requires_grad = true});
  optim::SGD opt({w, v}, {.lr = 0});
  {
    amp::GradScaler scaler({.init_scale = 2, .warn_below_scale = 1.5});
    scaler.set_parameter_names({{"layer.weight", w}, {"layer.bias", v}});
    scaler.scale((w * 1).sum()).backward();
    v.set_grad(full({2}, INFINITY));
    scaler.step(opt);
    scaler.update();
    CHECK(scaler.diagnosis().find("'layer.bias'") != std::string::npos);
    CHECK(scaler.diagnosis().find("backward pass overflowed") != std::string::npos);
  }
  {
    opt.zero_grad();
    amp::GradScaler scaler({.init_scale = 2, .warn_below_scale = 1.5});
    scaler.scale((w * INFINITY).sum()).backward();
    scaler.step(opt);
    scaler.update();
    CHECK(scaler.diagnosis().find("loss itself is inf/NaN") != std::string::npos);
  }
}

// ---- on the GPU

#include "core/cuda.h"

TEST_CASE("cuda: the fused unscale pass divides every gradient and finds an inf among many tensors") {
  SKIP_WITHOUT_GPU();
  manual_seed(5);
  TensorList params;
  for (int i = 0; i < 300; ++i) {  // more chunks than one launch carries
    Tensor p = randn({int64_t(1000 + 97 * i)}, {.dtype = kFloat16, .device = Device::cuda()});
    p.requires_grad_();
    params.push_back(p);
  }
  optim::SGD opt(params, {.lr = 0});
  amp::GradScaler scaler({.init_scale = 1024});
  for (Tensor& p : params) p.set_grad(randn(p.shape(), {.dtype = kFloat16, .device = Device::cuda()}) * 1024);
  std::vector<Tensor> expected;
  for (Tensor& p : params) expected.push_back(p.grad().to(kFloat32).cpu() / 1024);
  scaler.step(opt);  // unscale_ inside; no overflow
  for (size_t i = 0; i < params.size(); ++i) {
    double err = (params[i].grad().to(kFloat32).cpu() - expected[i]).abs().max().item<double>();
    CHECK(err < 1e-3);
  }
  scaler.update();
  CHECK(scaler.get_scale() == 1024);

  Tensor last = params.back().grad();
  {
    NoGradGuard no_grad;
    last.narrow(0, last.numel() - 1, 1).fill_(INFINITY);  // the very last element of the last chunk
  }
  scaler.step(opt);
  scaler.update();
  CHECK(scaler.get_scale() == 512);
  CHECK(scaler.skipped_steps() == 1);
}

TEST_CASE("cuda: O2 trains a small convolutional net on the GPU with float32 masters") {
  SKIP_WITHOUT_GPU();
  manual_seed(6);
  auto net = nn::sequential({std::make_shared<nn::Conv2d>(3, 8, 3, nn::Conv2dOptions{.padding = {1, 1}}),
                             std::make_shared<nn::BatchNorm2d>(8), std::make_shared<nn::ReLU>(),
                             std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(8 * 6 * 6, 4)});
  net->to(Device::cuda());
  optim::SGD opt(net->parameters(), {.lr = 0.05, .momentum = 0.9});
  amp::Amp amp = amp::initialize(*net, opt, amp::OptLevel::O2);
  Tensor x = randn({32, 3, 6, 6}, {.device = Device::cuda()}), y = randn({32, 4}, {.device = Device::cuda()});
  double first = 0, last = 0;
  for (int i = 0; i < 40; ++i) {
    Tensor loss = mse_loss(amp.forward(*net, x), y);
    amp.backward(loss);
    amp.step();
    amp.zero_grad();
    (i == 0 ? first : last) = loss.item<double>();
  }
  CHECK(net->parameters()[0].dtype() == kFloat16);
  CHECK(net->parameters()[0].is_cuda());
  CHECK(last < 0.5 * first);
}

TEST_CASE("docs/mixed_precision.md carries the cast table of core/autocast.h as it is") {
  const std::filesystem::path doc = std::filesystem::path(HALFGRAD_SOURCE_DIR) / "docs" / "mixed_precision.md";
  std::ifstream in(doc);
  REQUIRE_MESSAGE(in.good(), "cannot read " << doc.string());
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string begin = "<!-- cast-table:begin -->\n", end = "<!-- cast-table:end -->";
  const size_t from = text.find(begin), to = text.find(end);
  REQUIRE_MESSAGE((from != std::string::npos && to != std::string::npos && from < to),
                  doc.string() << " has no cast-table markers");
  CHECK_MESSAGE(text.substr(from + begin.size(), to - from - begin.size()) == amp::cast_table_markdown(),
                "the table in " << doc.string() << " differs from kCastRules: paste `halfgrad info --cast-table` "
                "between its markers");
  // Each row names the ops of one category, in kCastRules' order.
  CHECK(amp::cast_table_markdown().find("| float32 math | cross_entropy |") != std::string::npos);
}

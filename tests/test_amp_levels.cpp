// apex opt levels O0..O3 through amp::initialize: what is converted, the master weights, and a step.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "core/cuda_graph.h"
#include "halfgrad.h"
#include "nn/layers.h"
#include "optim/adam.h"
#include "optim/amp.h"
#include "optim/clip_grad.h"
#include "tests/testing.h"

using namespace halfgrad;
using halfgrad::testing::bit_equal;
using halfgrad::testing::values;

namespace {
// conv -> batch norm -> relu -> flatten -> linear: every kind of parameter O2 treats differently.
std::shared_ptr<nn::Sequential> small_net() {
  manual_seed(3);
  return std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
      std::make_shared<nn::Conv2d>(3, 4, 3, nn::Conv2dOptions{.padding = {1, 1}}), std::make_shared<nn::BatchNorm2d>(4),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(4 * 5 * 5, 2)});
}

std::map<std::string, DType> dtypes(const nn::Module& m) {
  std::map<std::string, DType> out;
  for (auto& [name, t] : m.named_parameters()) out[name] = t.dtype();
  return out;
}

// One training iteration; returns the loss.
double iterate(amp::Amp& amp, nn::Module& model, const Tensor& x, const Tensor& y) {
  Tensor out = amp.forward(model, x);
  Tensor loss = mse_loss(out.to(kFloat32), y);
  amp.backward(loss);
  amp.step();
  amp.zero_grad();
  return loss.item<double>();
}
}  // namespace

TEST_CASE("O2 puts the model in half except BatchNorm and keeps float32 masters in the optimizer") {
  auto net = small_net();
  optim::SGD opt(net->parameters(), {.lr = 0.01, .momentum = 0.9});
  TensorList fp32_params = net->parameters();
  amp::Amp amp = amp::initialize(*net, opt, amp::OptLevel::O2);

  auto d = dtypes(*net);
  CHECK(d["0.weight"] == kFloat16);
  CHECK(d["0.bias"] == kFloat16);
  CHECK(d["1.weight"] == kFloat32);  // BatchNorm stays float32
  CHECK(d["1.bias"] == kFloat32);
  CHECK(net->named_buffers()[0].second.dtype() == kFloat32);  // running statistics too
  CHECK(d["4.weight"] == kFloat16);
  for (const Tensor& p : opt.parameters()) CHECK(p.dtype() == kFloat32);
  CHECK(amp.master_weights().size() == 4);  // conv and linear weight and bias
  for (auto& [master, model_param] : amp.master_weights()) {
    CHECK(master.dtype() == kFloat32);
    CHECK(model_param.dtype() == kFloat16);
  }
  CHECK(opt.parameters()[0].same(fp32_params[0]));  // the optimizer's own float32 tensors became the masters

  // A step updates the masters in float32 and copies them into the half model.
  Tensor x = randn({8, 3, 5, 5}), y = randn({8, 2});
  iterate(amp, *net, x, y);
  for (auto& [master, model_param] : amp.master_weights()) {
    CHECK(to_vector<double>(master.to(kFloat16)) == to_vector<double>(model_param));
    CHECK_FALSE(master.grad().defined());
  }
}

TEST_CASE("Amp::zero_grad forgets an unscale or a clipping of the gradients it zeroes") {
  // O2: the masters take the next backward's gradients, not none; O1: the next step checks the new gradients, so an
  // overflow among them is skipped rather than stepped with the old flag.
  for (amp::OptLevel level : {amp::OptLevel::O2, amp::OptLevel::O1}) {
    CAPTURE(int(level));
    manual_seed(5);
    auto net = small_net();
    optim::SGD opt(net->parameters(), {.lr = 0.1});
    amp::Amp amp = amp::initialize(*net, opt, level, {.scaler = {.init_scale = 16}});
    Tensor x = randn({8, 3, 5, 5}), y = randn({8, 2});
    amp.backward(mse_loss(amp.forward(*net, x).to(kFloat32), y));
    amp.clip_grad_norm_(1.0);
    amp.zero_grad();
    amp.backward(mse_loss(amp.forward(*net, x).to(kFloat32), y));
    const Tensor before = opt.parameters()[0].detach().clone();
    if (level == amp::OptLevel::O1) {
      Tensor g = opt.parameters()[0].grad();
      g.fill_(INFINITY);
    }
    amp.step();
    const bool moved = !bit_equal(opt.parameters()[0], before);
    CHECK(moved == (level == amp::OptLevel::O2));
    CHECK(amp.scaler().skipped_steps() == (level == amp::OptLevel::O1 ? 1 : 0));
    for (const Tensor& p : opt.parameters()) CHECK(std::isfinite(p.abs().max().item<double>()));
  }
}

TEST_CASE("O3 puts everything in half, BatchNorm included, without masters or scaling") {
  auto net = small_net();
  optim::SGD opt(net->parameters(), {.lr = 0.01});
  amp::Amp amp = amp::initialize(*net, opt, amp::OptLevel::O3);
  for (auto& [name, dt] : dtypes(*net)) CHECK_MESSAGE(dt == kFloat16, name);
  for (const Tensor& p : opt.parameters()) CHECK(p.dtype() == kFloat16);
  CHECK(amp.master_weights().empty());
  CHECK_FALSE(amp.scaler().is_enabled());
  Tensor before = net->parameters()[0].detach().clone();
  iterate(amp, *net, randn({8, 3, 5, 5}), randn({8, 2}));
  CHECK(to_vector<double>(before) != to_vector<double>(net->parameters()[0]));  // the optimizer trains the model
}

TEST_CASE("O0 and O1 leave the model in float32, O1 runs the forward under autocast") {
  for (amp::OptLevel level : {amp::OptLevel::O0, amp::OptLevel::O1}) {
    auto net = small_net();
    optim::SGD opt(net->parameters(), {.lr = 0.01});
    amp::Amp amp = amp::initialize(*net, opt, level);
    for (auto& [name, dt] : dtypes(*net)) CHECK(dt == kFloat32);
    Tensor out = amp.forward(*net, randn({2, 3, 5, 5}));
    CHECK(out.dtype() == (level == amp::OptLevel::O1 ? kFloat16 : kFloat32));  // the last op is a linear
    CHECK(amp.scaler().is_enabled() == (level == amp::OptLevel::O1));
  }
}

TEST_CASE("amp.loss gives a float32 cross-entropy at every level without a float32 copy of half logits") {
  for (amp::OptLevel level : {amp::OptLevel::O0, amp::OptLevel::O1, amp::OptLevel::O2, amp::OptLevel::O3}) {
    CAPTURE(amp::opt_level_name(level));
    auto net = small_net();
    optim::SGD opt(net->parameters(), {.lr = 0.01});
    amp::Amp amp = amp::initialize(*net, opt, level);
    Tensor out = amp.forward(*net, randn({4, 3, 5, 5})).detach().requires_grad_();
    Tensor target = tensor<int64_t>({0, 1, 1, 0});
    Tensor loss = amp.loss([&] { return cross_entropy(out, target); });
    CHECK(loss.dtype() == kFloat32);
    CHECK(loss.item<double>() == doctest::Approx(cross_entropy(out.detach().to(kFloat64), target).item<double>())
                                     .epsilon(1e-6));
    (loss * 65536.0).backward();  // a loss scale that float16 cannot hold
    CHECK(out.grad().dtype() == out.dtype());
    for (double g : testing::values(out.grad())) CHECK(std::isfinite(g));
  }
}

TEST_CASE("every opt level trains: the loss falls on a fixed batch") {
  for (amp::OptLevel level : {amp::OptLevel::O0, amp::OptLevel::O1, amp::OptLevel::O2, amp::OptLevel::O3}) {
    CAPTURE(amp::opt_level_name(level));
    auto net = small_net();
    optim::SGD opt(net->parameters(), {.lr = 0.05, .momentum = 0.9});
    amp::Amp amp = amp::initialize(*net, opt, level);
    manual_seed(4);
    Tensor x = randn({16, 3, 5, 5}), y = randn({16, 2});
    double first = iterate(amp, *net, x, y), last = first;
    for (int i = 0; i < 30; ++i) last = iterate(amp, *net, x, y);
    CHECK(last < 0.5 * first);
  }
}

// Three steps of small_net with clipping at max_norm, by `fused` amp.clip_grad_norm_ or by unscale_ then
// optim::clip_grad_norm_; returns the parameters (float32) and the norms the clipping returned.
struct ClippedRun {
  std::vector<std::vector<double>> params;
  std::vector<double> norms;
  int64_t skipped = 0;
  double scale = 0;
};
template <typename MakeOptimizer>
ClippedRun clipped_run(amp::OptLevel level, bool fused, double max_norm, MakeOptimizer make_optimizer) {
  // A scale whose scaled float16 gradients stay finite at every step: here both ways agree on skipping nothing.
  const amp::GradScalerOptions scaler{.init_scale = 256};
  auto net = small_net();
  auto opt = make_optimizer(net->parameters());
  amp::Amp amp = amp::initialize(*net, *opt, level, {.scaler = scaler});
  manual_seed(6);
  const Tensor x = randn({8, 3, 5, 5}), y = randn({8, 2});
  ClippedRun run;
  for (int step = 0; step < 3; ++step) {
    amp.backward(mse_loss(amp.forward(*net, x).to(kFloat32), y));
    const Tensor norm = fused ? amp.clip_grad_norm_(max_norm) : optim::clip_grad_norm_(amp.unscale_(), max_norm);
    run.norms.push_back(norm.item<double>());
    amp.step();
    amp.zero_grad();
  }
  for (const Tensor& p : net->parameters()) run.params.push_back(to_vector<double>(p.to(kFloat32)));
  run.skipped = amp.scaler().skipped_steps();
  run.scale = amp.scaler().is_enabled() ? amp.scaler().get_scale() : 1.0;
  return run;
}

double largest_relative_difference(const ClippedRun& a, const ClippedRun& b) {
  double worst = 0;
  for (size_t i = 0; i < a.params.size(); ++i)
    for (size_t k = 0; k < a.params[i].size(); ++k)
      worst = std::max(worst, std::abs(a.params[i][k] - b.params[i][k]) / (std::abs(b.params[i][k]) + 1e-3));
  return worst;
}

TEST_CASE("amp.clip_grad_norm_ is the step of unscale_ then clip_grad_norm_, for every level and optimizer") {
  auto sgd = [](TensorList p) { return std::make_unique<optim::SGD>(p, optim::SGDOptions{.lr = 0.1}); };
  auto momentum = [](TensorList p) {
    return std::make_unique<optim::SGD>(p, optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-2});
  };
  // Adam with an L2 penalty: without one its update hardly depends on the scale of the gradients.
  auto adam = [](TensorList p) {
    return std::make_unique<optim::Adam>(p, optim::AdamOptions{.lr = 1e-2, .weight_decay = 0.1});
  };
  for (amp::OptLevel level : {amp::OptLevel::O0, amp::OptLevel::O1, amp::OptLevel::O2, amp::OptLevel::O3}) {
    // 0.01 clips every step (the gradients' norm is ~1); 100 clips none.
    for (double max_norm : {0.01, 100.0}) {
      const std::string level_name = amp::opt_level_name(level);
      CAPTURE(level_name);
      CAPTURE(max_norm);
      auto compare = [&](auto make, const std::string& what) {
        CAPTURE(what);
        const ClippedRun fused = clipped_run(level, true, max_norm, make);
        const ClippedRun unfused = clipped_run(level, false, max_norm, make);
        for (size_t i = 0; i < fused.norms.size(); ++i)
          CHECK(fused.norms[i] == doctest::Approx(unfused.norms[i]).epsilon(1e-5));
        CHECK(fused.norms[0] > 0.05);  // what max_norm = 0.01 clips
        // float32 arithmetic differs in the last bits. O3 has no loss scaler and float16 gradients: clipping in place
        // rounds each clipped gradient to float16, SGD's fused kernel multiplies in float32 as it reads, so the
        // float16 parameters may part by an ulp (2^-10) or two.
        const double tolerance = level == amp::OptLevel::O3 ? 2.0 / 1024 : 1e-5;
        CHECK(largest_relative_difference(fused, unfused) < tolerance);
        CHECK(fused.skipped == 0);
      };
      compare(sgd, "SGD");
      compare(momentum, "SGD with momentum and weight decay");
      compare(adam, "Adam");
    }
  }
}

TEST_CASE("amp.clip_grad_norm_ leaves SGD's gradients scaled, skips overflowing steps, and is once per step") {
  auto net = small_net();
  optim::SGD opt(net->parameters(), {.lr = 0.1});
  amp::Amp amp = amp::initialize(*net, opt, amp::OptLevel::O1, {.scaler = {.init_scale = 1024}});
  manual_seed(6);
  const Tensor x = randn({8, 3, 5, 5}), y = randn({8, 2});
  amp.backward(mse_loss(amp.forward(*net, x).to(kFloat32), y));
  const Tensor weight_grad = net->parameters()[0].grad().clone();
  const Tensor norm = amp.clip_grad_norm_(0.01);
  // The norm of the unscaled gradients, the gradients untouched (SGD multiplies them as its kernel reads them).
  CHECK(norm.item<double>() == doctest::Approx(optim::grad_norm(net->parameters()).item<double>() / 1024).epsilon(1e-6));
  CHECK(to_vector<double>(net->parameters()[0].grad()) == to_vector<double>(weight_grad));  // still scaled
  CHECK_THROWS_WITH_AS(amp.clip_grad_norm_(0.01), doctest::Contains("already unscaled or clipped"), Error);
  CHECK_THROWS_WITH_AS(amp.unscale_(), doctest::Contains("already called"), Error);
  amp.step();
  amp.zero_grad();

  // An inf in a gradient: the norm is not finite, the step is skipped and the scale backs off, as unscale_ does.
  auto run_with_inf = [&](bool fused) {
    auto n = small_net();
    optim::SGD o(n->parameters(), {.lr = 0.1});
    amp::Amp a = amp::initialize(*n, o, amp::OptLevel::O1, {.scaler = {.init_scale = 1024}});
    a.backward(mse_loss(a.forward(*n, x).to(kFloat32), y));
    n->parameters()[1].grad().narrow(0, 0, 1).fill_(INFINITY);
    const std::vector<double> before = to_vector<double>(n->parameters()[0]);
    const Tensor total = fused ? a.clip_grad_norm_(0.01) : optim::clip_grad_norm_(a.unscale_(), 0.01);
    CHECK_FALSE(std::isfinite(total.item<double>()));
    a.step();
    CHECK(to_vector<double>(n->parameters()[0]) == before);
    CHECK(a.scaler().skipped_steps() == 1);
    CHECK(a.scaler().get_scale() == 512);
  };
  run_with_inf(true);
  run_with_inf(false);
}

TEST_CASE("amp.clip_grad_norm_ without a loss scaler (O0) leaves SGD's gradients as they are and clips in the step") {
  auto net = small_net();
  optim::SGD opt(net->parameters(), {.lr = 0.1});
  amp::Amp amp = amp::initialize(*net, opt, amp::OptLevel::O0);
  manual_seed(6);
  const Tensor x = randn({8, 3, 5, 5}), y = randn({8, 2});
  for (int step = 0; step < 2; ++step) {  // the second: zero_grad and step forgot the first step's clipping
    CAPTURE(step);
    amp.backward(mse_loss(amp.forward(*net, x), y));
    const Tensor weight = net->parameters()[0].clone(), weight_grad = net->parameters()[0].grad().clone();
    const Tensor norm = amp.clip_grad_norm_(0.01);
    CHECK(norm.item<double>() == doctest::Approx(optim::grad_norm(net->parameters()).item<double>()).epsilon(1e-6));
    CHECK(to_vector<double>(net->parameters()[0].grad()) == to_vector<double>(weight_grad));  // not clipped in place
    CHECK_THROWS_WITH_AS(amp.clip_grad_norm_(0.01), doctest::Contains("already clipped"), Error);
    amp.step();
    // SGD read each gradient times clipping's coefficient, 0.01 / (norm + 1e-6).
    const double coefficient = 0.01 / (norm.item<double>() + 1e-6);
    const Tensor want = weight - weight_grad * (0.1 * coefficient);
    testing::check_close(to_vector<double>(net->parameters()[0]), to_vector<double>(want), 1e-6);
    amp.zero_grad();
  }
  // float64 gradients are clipped in place, in float64 (the fused step reads a float32 coefficient).
  auto net64 = small_net();
  net64->to(kFloat64);
  optim::SGD opt64(net64->parameters(), {.lr = 0.1});
  amp::Amp amp64 = amp::initialize(*net64, opt64, amp::OptLevel::O0);
  amp64.backward(mse_loss(amp64.forward(*net64, x.to(kFloat64)), y.to(kFloat64)));
  const Tensor grad64 = net64->parameters()[0].grad().clone();
  const double norm64 = amp64.clip_grad_norm_(0.01).item<double>();
  const Tensor clipped64 = grad64 * (0.01 / (norm64 + 1e-6));
  testing::check_close(to_vector<double>(net64->parameters()[0].grad()), to_vector<double>(clipped64), 1e-15);
}

TEST_CASE("O2: a model whose first layer stays float32 (batch norm) takes its input in half, as apex casts it") {
  auto model = nn::sequential({std::make_shared<nn::BatchNorm2d>(1), std::make_shared<nn::Conv2d>(1, 2, 1)});
  optim::SGD opt(model->parameters(), {.lr = 0.1});
  amp::Amp amp = amp::initialize(*model, opt, amp::OptLevel::O2);
  const Tensor out = amp.forward(*model, randn({2, 1, 2, 2}));
  CHECK(out.dtype() == kFloat32);
  CHECK(out.shape() == Shape{2, 2, 2, 2});
}

TEST_CASE("O2: a state loaded into the model after initialize is what the next step starts from") {
  auto model = nn::sequential({std::make_shared<nn::Linear>(2, 1)});
  optim::SGD opt(model->parameters(), {.lr = 0.0});  // lr 0: a step changes nothing
  amp::Amp amp = amp::initialize(*model, opt, amp::OptLevel::O2);
  model->load_state_dict({{"0.weight", full({1, 2}, 7.0, {.dtype = kFloat16})},
                          {"0.bias", full({1}, 7.0, {.dtype = kFloat16})}});
  const Tensor out = amp.forward(*model, ones({1, 2}));
  amp.backward(amp.loss([&] { return out.sum(); }));
  amp.step();  // the masters took the loaded values; the step's copy into the model did not undo the load
  CHECK(values(model->parameters()[0]) == std::vector<double>{7, 7});
  CHECK(values(amp.master_weights()[0].first) == std::vector<double>{7, 7});
}

TEST_CASE("cuda: O2 as a captured step: a state loaded between replays with sync_masters() is what the next replay starts from") {
  SKIP_WITHOUT_GPU();
  auto model = nn::sequential({std::make_shared<nn::Linear>(2, 1)});
  model->to(Device::cuda());
  optim::SGD opt(model->parameters(), {.lr = 0.0});  // lr 0: a step changes nothing
  amp::Amp amp = amp::initialize(*model, opt, amp::OptLevel::O2);
  const Tensor x = ones({1, 2}, {.device = Device::cuda()});
  auto step = [&] {
    const Tensor out = amp.forward(*model, x);
    amp.backward(amp.loss([&] { return out.sum(); }));
    amp.step();
    amp.zero_grad();
  };
  cuda::CapturedStep captured(Device::cuda(), step, 1);
  for (int i = 0; i < 3; ++i) captured();  // one eager step, the capture and its replay, a replay
  REQUIRE(captured.captured());
  model->load_state_dict({{"0.weight", full({1, 2}, 7.0, {.dtype = kFloat16, .device = Device::cuda()})},
                          {"0.bias", full({1}, 7.0, {.dtype = kFloat16, .device = Device::cuda()})}});
  amp.sync_masters();  // the host code a replay does not run (optim/amp.h)
  captured();          // the replayed step's copy of the masters into the model did not undo the load
  CHECK(values(model->parameters()[0]) == std::vector<double>{7, 7});
  CHECK(values(amp.master_weights()[0].first) == std::vector<double>{7, 7});
}

TEST_CASE("O2: a write of the model's own values keeps the masters' float32 ones, a checkpoint's masters are kept") {
  auto model = nn::sequential({std::make_shared<nn::Linear>(2, 1)});
  {
    NoGradGuard no_grad;
    model->parameters()[0].copy_(tensor(std::vector<float>{0.1f, 0.3f}, {1, 2}));  // not float16 values
  }
  optim::SGD opt(model->parameters(), {.lr = 0.0});
  amp::Amp amp = amp::initialize(*model, opt, amp::OptLevel::O2);
  const Tensor master = amp.master_weights()[0].first;
  const std::vector<double> exact = values(master);
  auto step = [&] {
    const Tensor out = amp.forward(*model, ones({1, 2}));
    amp.backward(amp.loss([&] { return out.sum(); }));
    amp.step();
    amp.zero_grad();
  };
  {
    NoGradGuard no_grad;  // what DistributedDataParallel's first broadcast does: the same values written again
    for (Tensor p : model->parameters()) p.copy_(p.clone());
  }
  step();
  CHECK(values(master) == exact);  // not the half-rounded values
  {
    NoGradGuard no_grad;  // a training checkpoint restores both: the master's float32 values stand
    model->parameters()[0].copy_(full({1, 2}, 2.0, {.dtype = kFloat16}));
    Tensor(master).copy_(tensor(std::vector<float>{2.1f, 2.3f}, {1, 2}));
  }
  step();
  CHECK(values(master) == values(tensor(std::vector<float>{2.1f, 2.3f}, {1, 2})));
}

TEST_CASE("O2 with a frozen parameter: its master stays frozen and neither moves") {
  auto model = nn::sequential({std::make_shared<nn::Linear>(2, 1)});
  model->parameters()[0].requires_grad_(false);
  optim::SGD opt(model->parameters(), {.lr = 0.5});
  amp::Amp amp = amp::initialize(*model, opt, amp::OptLevel::O2);
  const std::vector<double> weight = values(model->parameters()[0]), bias = values(model->parameters()[1]);
  CHECK_FALSE(amp.master_weights()[0].first.requires_grad());
  const Tensor out = amp.forward(*model, ones({1, 2}));
  amp.backward(amp.loss([&] { return out.sum() * 0.01; }));  // scaled by 2^16, a gradient of 1 would overflow
  amp.step();
  CHECK(values(model->parameters()[0]) == weight);
  CHECK(values(model->parameters()[1]) != bias);
}

TEST_CASE("amp::initialize refuses an optimizer that already stepped and unknown levels") {
  auto net = small_net();
  optim::SGD opt(net->parameters(), {.lr = 0.01, .momentum = 0.9});
  for (Tensor& p : net->parameters()) p.set_grad(zeros_like(p));
  opt.step();
  CHECK_THROWS_WITH_AS(amp::initialize(*net, opt, amp::OptLevel::O2), doctest::Contains("already stepped"), Error);
  CHECK_THROWS_WITH_AS(amp::parse_opt_level("O4"), doctest::Contains("'O4'"), Error);
}

TEST_CASE("unscale_ hands the optimizer's unscaled gradients over for clipping, and step does not unscale again") {
  for (amp::OptLevel level : {amp::OptLevel::O1, amp::OptLevel::O2}) {
    CAPTURE(amp::opt_level_name(level));
    manual_seed(6);  // data whose first scaled backward does not overflow float16, whatever ran before
    Tensor x = randn({8, 3, 5, 5}), y = randn({8, 2});
    // The float32 reference: the same net, loss and clipping without amp.
    auto reference = small_net();
    std::vector<std::vector<double>> initial;
    for (const Tensor& p : reference->parameters()) initial.push_back(to_vector<double>(p));
    optim::SGD ref_opt(reference->parameters(), {.lr = 0.1});
    mse_loss(reference->forward(x), y).backward();
    const Tensor ref_norm = optim::clip_grad_norm_(reference->parameters(), 0.01);
    ref_opt.step();

    auto net = small_net();
    optim::SGD opt(net->parameters(), {.lr = 0.1});
    amp::Amp amp = amp::initialize(*net, opt, level);
    amp.backward(mse_loss(amp.forward(*net, x).to(kFloat32), y));
    TensorList params = amp.unscale_();
    REQUIRE(params.size() == opt.parameters().size());
    for (const Tensor& p : params) CHECK(p.dtype() == kFloat32);  // O2: the masters, not the half parameters
    const Tensor norm = optim::clip_grad_norm_(params, 0.01);
    // The norm of the unscaled gradients: the float32 one up to half-precision arithmetic, not scale times it.
    CHECK(norm.item<double>() == doctest::Approx(ref_norm.item<double>()).epsilon(0.02));
    amp.step();
    CHECK(amp.scaler().skipped_steps() == 0);
    // The update is the clipped step of the float32 reference: a second unscaling would shrink it to nothing.
    TensorList ref_params = reference->parameters();
    double diff = 0, size = 0;
    for (size_t i = 0; i < ref_params.size(); ++i) {
      const std::vector<double> got = to_vector<double>(params[i]), want = to_vector<double>(ref_params[i]);
      for (size_t k = 0; k < got.size(); ++k) {
        const double step_want = want[k] - initial[i][k], step_got = got[k] - initial[i][k];
        diff += (step_got - step_want) * (step_got - step_want);
        size += step_want * step_want;
      }
    }
    CHECK(size > 0);
    CHECK(std::sqrt(diff / size) < 0.05);
  }
}

// Learning-rate schedulers: their curves against PyTorch's closed forms at several steps.
//
// The expected values were computed by hand with the formulas of torch/optim/lr_scheduler.py
// (_get_closed_form_lr of StepLR, MultiStepLR, CosineAnnealingLR, ExponentialLR, LinearLR, ConstantLR, PolynomialLR;
// OneCycleLR.get_lr with its phases), in double precision: the tolerance is 1e-12 relative.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "halfgrad.h"
#include "optim/adam.h"
#include "optim/scheduler.h"
#include "optim/sgd.h"

using namespace halfgrad;

namespace {

struct Fixture {
  Tensor a = ones({1}, {.requires_grad = true});
  Tensor b = ones({1}, {.requires_grad = true});
};

Tensor count(int64_t n) { return scalar_tensor(n, {.dtype = kInt64}); }

// The lr of every group after each of `steps` calls of step() (index 0: after construction).
std::vector<std::vector<double>> curve(optim::LRScheduler& s, int steps) {
  std::vector<std::vector<double>> lrs = {s.get_last_lr()};
  for (int i = 0; i < steps; ++i) {
    s.step();
    lrs.push_back(s.get_last_lr());
  }
  return lrs;
}

}  // namespace

TEST_CASE("StepLR multiplies by gamma every step_size steps") {
  Fixture f;
  optim::SGD opt({{{f.a}, {.lr = 0.1}}, {{f.b}, {.lr = 1.0}}});
  optim::StepLR sched(opt, {.step_size = 3, .gamma = 0.5});
  auto lrs = curve(sched, 7);
  const double expected[] = {0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025, 0.025};
  for (int n = 0; n <= 7; ++n) {
    CAPTURE(n);
    CHECK(lrs[n][0] == doctest::Approx(expected[n]).epsilon(1e-12));
    CHECK(lrs[n][1] == doctest::Approx(10 * expected[n]).epsilon(1e-12));
  }
  CHECK(opt.groups()[1].options.lr == doctest::Approx(0.25).epsilon(1e-12));  // the optimizer follows
  CHECK(sched.last_step() == 7);
}

TEST_CASE("MultiStepLR decays at each milestone, including the milestone step itself") {
  Fixture f;
  optim::SGD opt({f.a}, {.lr = 1.0});
  optim::MultiStepLR sched(opt, {.milestones = {2, 5}, .gamma = 0.1});
  auto lrs = curve(sched, 6);
  const double expected[] = {1, 1, 0.1, 0.1, 0.1, 0.01, 0.01};
  for (int n = 0; n <= 6; ++n) CHECK(lrs[n][0] == doctest::Approx(expected[n]).epsilon(1e-12));
  // Milestones in any order, as PyTorch's (a Counter of them): the same curve; one given twice decays twice.
  optim::SGD opt2({f.a}, {.lr = 1.0});
  optim::MultiStepLR unsorted(opt2, {.milestones = {5, 2}, .gamma = 0.1});
  CHECK(curve(unsorted, 6) == lrs);
  optim::SGD opt3({f.a}, {.lr = 1.0});
  optim::MultiStepLR twice(opt3, {.milestones = {2, 2}, .gamma = 0.1});
  CHECK(curve(twice, 3)[2][0] == doctest::Approx(0.01).epsilon(1e-12));
}

TEST_CASE("CosineAnnealingLR follows PyTorch's closed form, periodic past T_max") {
  Fixture f;
  optim::SGD opt({f.a}, {.lr = 0.1});
  optim::CosineAnnealingLR sched(opt, {.T_max = 10, .eta_min = 0.001});
  auto lrs = curve(sched, 20);
  // eta_min + (0.1 - eta_min) * (1 + cos(pi n / 10)) / 2
  const std::pair<int, double> expected[] = {{0, 0.1},   {1, 0.09757729755661011}, {5, 0.0505},
                                             {9, 0.0034227024433899004}, {10, 0.001}, {15, 0.05049999999999999},
                                             {20, 0.1}};
  for (auto [n, lr] : expected) {
    CAPTURE(n);
    CHECK(lrs[n][0] == doctest::Approx(lr).epsilon(1e-12));
  }
}

TEST_CASE("OneCycleLR: PyTorch's curve for lr and momentum (SGD momentum)") {
  Fixture f;
  optim::SGD opt({f.a}, {.lr = 123, .momentum = 0.9});
  optim::OneCycleLR sched(opt, {.max_lr = {0.1}, .total_steps = 10});
  // Phases: steps 0..2 (0.3 * 10 - 1) warm up from 0.1/25 to 0.1, steps 2..9 anneal to 0.1/25/1e4;
  // momentum 0.95 -> 0.85 -> 0.95.
  const double lr[] = {0.0040000000000000036, 0.052000000000000005, 0.1, 0.09504846320134738, 0.0811745653949763,
                       0.06112620219362893,   0.03887419780637107,  0.0188258346050237, 0.004951936798652629,
                       4e-07,                 0.004951936798652624};
  const double momentum[] = {0.95, 0.8999999999999999, 0.85, 0.854951556604879, 0.8688255099070633,
                             0.8888739533021842, 0.9111260466978157, 0.9311744900929366, 0.945048443395121,
                             0.95, 0.945048443395121};
  CHECK(opt.groups()[0].options.lr == doctest::Approx(lr[0]).epsilon(1e-12));  // set by the constructor
  for (int n = 0; n <= 10; ++n) {
    CAPTURE(n);
    if (n > 0) sched.step();
    CHECK(sched.get_last_lr()[0] == doctest::Approx(lr[n]).epsilon(1e-12));
    CHECK(opt.groups()[0].options.momentum == doctest::Approx(momentum[n]).epsilon(1e-12));
  }
  // PyTorch allows total_steps + 1 values (steps 0..total_steps) and refuses more.
  CHECK_THROWS_WITH_AS(sched.step(), doctest::Contains("tried to step 11 times; total_steps is 10"), Error);
}

TEST_CASE("OneCycleLR cycles Adam's beta1, and takes epochs * steps_per_epoch, three phases, linear annealing") {
  Fixture f;
  SUBCASE("three phases, Adam") {
    optim::Adam opt({f.a}, {.betas = {0.9, 0.99}});
    optim::OneCycleLR sched(opt, {.max_lr = {0.1}, .epochs = 2, .steps_per_epoch = 5, .three_phase = true});
    CHECK(sched.total_steps() == 10);
    const double lr[] = {0.0040000000000000036, 0.052000000000000005, 0.1, 0.052000000000000005, 0.004,
                         0.0036180721853510196, 0.0026181721853510195, 0.0013822278146489802,
                         0.0003823278146489803, 4e-07, 0.00038232781464897985};
    const double beta1[] = {0.95, 0.8999999999999999, 0.85, 0.8999999999999999, 0.95, 0.95, 0.95, 0.95, 0.95,
                            0.95, 0.95};
    for (int n = 0; n <= 10; ++n) {
      CAPTURE(n);
      if (n > 0) sched.step();
      CHECK(opt.groups()[0].options.lr == doctest::Approx(lr[n]).epsilon(1e-12));
      CHECK(opt.groups()[0].options.betas.first == doctest::Approx(beta1[n]).epsilon(1e-12));
      CHECK(opt.groups()[0].options.betas.second == 0.99);
    }
  }
  SUBCASE("linear annealing, no momentum cycling, a max_lr per group") {
    optim::SGD opt({{{f.a}, {.momentum = 0.7}}, {{f.b}, {.momentum = 0.7}}});
    optim::OneCycleLR sched(opt, {.max_lr = {0.1, 1.0},
                                  .total_steps = 10,
                                  .anneal_strategy = optim::OneCycleLROptions::Anneal::Linear,
                                  .cycle_momentum = false});
    const double lr[] = {0.004, 0.052000000000000005, 0.1, 0.08571434285714286, 0.07142868571428572,
                         0.05714302857142858, 0.042857371428571434, 0.028571714285714284, 0.014286057142857148,
                         3.999999999976245e-07};
    for (int n = 0; n <= 9; ++n) {
      CAPTURE(n);
      if (n > 0) sched.step();
      CHECK(sched.get_last_lr()[0] == doctest::Approx(lr[n]).epsilon(1e-9));
      CHECK(sched.get_last_lr()[1] == doctest::Approx(10 * lr[n]).epsilon(1e-9));
      CHECK(opt.groups()[0].options.momentum == 0.7);
    }
  }
  SUBCASE("errors") {
    optim::SGD opt({{{f.a}, {}}, {{f.b}, {}}});
    CHECK_THROWS_WITH_AS(optim::OneCycleLR(opt, {.max_lr = {0.1}}), doctest::Contains("give a positive total_steps"), Error);
    CHECK_THROWS_WITH_AS(optim::OneCycleLR(opt, {.max_lr = {0.1, 0.2, 0.3}, .total_steps = 5}),
                         doctest::Contains("max_lr has 3 values"), Error);
    CHECK_THROWS_WITH_AS(optim::OneCycleLR(opt, {.max_lr = {0.1}, .total_steps = 5, .pct_start = 1.5}),
                         doctest::Contains("pct_start"), Error);
    // Counts as PyTorch takes them: a negative total_steps is not "take epochs x steps_per_epoch", and two negative
    // factors do not make a positive count.
    CHECK_THROWS_WITH_AS(
        optim::OneCycleLR(opt, {.max_lr = {0.1}, .total_steps = -5, .epochs = 2, .steps_per_epoch = 3}),
        doctest::Contains("give a positive total_steps"), Error);
    CHECK_THROWS_WITH_AS(optim::OneCycleLR(opt, {.max_lr = {0.1}, .epochs = -2, .steps_per_epoch = -3}),
                         doctest::Contains("positive epochs and steps_per_epoch (got total_steps 0, epochs -2"), Error);
    const double lr = opt.groups()[0].options.lr;
    CHECK_THROWS_WITH_AS(optim::OneCycleLR(opt, {.max_lr = {-1}, .total_steps = 5}),
                         doctest::Contains("max_lr must be finite and >= 0, got -1"), Error);
    CHECK(opt.groups()[0].options.lr == lr);  // refused before writing the groups
  }
}

TEST_CASE("LinearWarmup ramps up to the base lr, then stays or hands over to another scheduler") {
  Fixture f;
  SUBCASE("alone: constant after the warm-up") {
    optim::SGD opt({f.a}, {.lr = 0.4});
    optim::LinearWarmup sched(opt, {.warmup_steps = 4});
    auto lrs = curve(sched, 6);
    const double expected[] = {0, 0.1, 0.2, 0.3, 0.4, 0.4, 0.4};
    for (int n = 0; n <= 6; ++n) CHECK(lrs[n][0] == doctest::Approx(expected[n]).epsilon(1e-12));
  }
  SUBCASE("with a start factor, then cosine annealing from its step 0") {
    optim::SGD opt({f.a}, {.lr = 0.1});
    auto cosine = std::make_unique<optim::CosineAnnealingLR>(opt, optim::CosineAnnealingLROptions{.T_max = 10});
    optim::LinearWarmup sched(opt, {.warmup_steps = 2, .start_factor = 0.5}, std::move(cosine));
    auto lrs = curve(sched, 12);
    CHECK(lrs[0][0] == doctest::Approx(0.05).epsilon(1e-12));   // 0.5 * 0.1
    CHECK(lrs[1][0] == doctest::Approx(0.075).epsilon(1e-12));  // 0.75 * 0.1
    CHECK(lrs[2][0] == doctest::Approx(0.1).epsilon(1e-12));    // cosine step 0
    CHECK(lrs[3][0] == doctest::Approx(0.1 * (1 + std::cos(M_PI / 10)) / 2).epsilon(1e-12));
    CHECK(lrs[7][0] == doctest::Approx(0.05).epsilon(1e-12));   // cosine step 5
    CHECK(lrs[12][0] == doctest::Approx(0).epsilon(1e-12));     // cosine step 10
    CHECK(opt.groups()[0].options.lr == doctest::Approx(0).epsilon(1e-12));
  }
  SUBCASE("the scheduler after the warm-up keeps its own step and lr, as if stepped itself") {
    optim::SGD opt({f.a}, {.lr = 1});
    auto step_lr = std::make_unique<optim::StepLR>(opt, optim::StepLROptions{.step_size = 1, .gamma = 0.5});
    const optim::StepLR& inner = *step_lr;
    optim::LinearWarmup sched(opt, {.warmup_steps = 2}, std::move(step_lr));
    for (int n = 0; n < 2; ++n) sched.step();
    CHECK(inner.last_step() == 0);  // the warm-up ends: its step 0
    CHECK(inner.get_last_lr() == std::vector<double>{1});
    for (int n = 0; n < 3; ++n) sched.step();
    CHECK(inner.last_step() == 3);
    CHECK(inner.get_last_lr() == std::vector<double>{0.125});
    CHECK(opt.groups()[0].options.lr == 0.125);
    // and on down a chain of them
    auto innermost = std::make_unique<optim::StepLR>(opt, optim::StepLROptions{.step_size = 1, .gamma = 0.5});
    const optim::StepLR& last = *innermost;
    optim::LinearWarmup outer(opt, {.warmup_steps = 1},
                              std::make_unique<optim::LinearWarmup>(opt, optim::LinearWarmupOptions{.warmup_steps = 1},
                                                                    std::move(innermost)));
    for (int n = 0; n < 5; ++n) outer.step();
    CHECK(last.last_step() == 3);
  }
  SUBCASE("errors") {
    optim::SGD opt({f.a}, {.lr = 0.1});
    optim::SGD other({f.b}, {.lr = 0.1});
    CHECK_THROWS_WITH_AS(
        optim::LinearWarmup(opt, {.warmup_steps = 2}, std::make_unique<optim::StepLR>(other, optim::StepLROptions{})),
        doctest::Contains("drives another optimizer"), Error);
    CHECK_THROWS_WITH_AS(optim::LinearWarmup(opt, {.warmup_steps = -1}), doctest::Contains("warmup_steps"), Error);
  }
}

TEST_CASE("ExponentialLR, LinearLR, ConstantLR and PolynomialLR follow PyTorch's closed forms") {
  Fixture f;
  optim::SGD opt({{{f.a}, {.lr = 0.3}}, {{f.b}, {.lr = 0.6}}});
  // lr = base * factors[n], the factors as torch/optim/lr_scheduler.py's _get_closed_form_lr computes them.
  auto check_factors = [&](optim::LRScheduler& sched, const std::vector<double>& factors) {
    auto lrs = curve(sched, int(factors.size()) - 1);
    for (size_t n = 0; n < factors.size(); ++n) {
      CAPTURE(n);
      CHECK(lrs[n][0] == doctest::Approx(0.3 * factors[n]).epsilon(1e-12));
      CHECK(lrs[n][1] == doctest::Approx(0.6 * factors[n]).epsilon(1e-12));
    }
    CHECK(opt.groups()[1].options.lr == lrs.back()[1]);
  };
  SUBCASE("ExponentialLR: gamma^n") {
    optim::ExponentialLR sched(opt, {.gamma = 0.5});
    check_factors(sched, {1, 0.5, 0.25, 0.125, 0.0625});
  }
  SUBCASE("LinearLR: PyTorch's defaults rise from a third to the base lr in 5 steps, then hold") {
    optim::LinearLR sched(opt, {});
    check_factors(sched, {1.0 / 3, 1.0 / 3 + (2.0 / 3) / 5, 1.0 / 3 + (2.0 / 3) * 2 / 5, 1.0 / 3 + (2.0 / 3) * 3 / 5,
                          1.0 / 3 + (2.0 / 3) * 4 / 5, 1, 1, 1});
  }
  SUBCASE("LinearLR: a decay, from the base lr to a tenth of it in 3 steps") {
    optim::LinearLR sched(opt, {.start_factor = 1, .end_factor = 0.1, .total_iters = 3});
    check_factors(sched, {1, 0.7, 0.4, 0.1, 0.1});
  }
  SUBCASE("ConstantLR: the factor until total_iters, then the base lr") {
    optim::ConstantLR sched(opt, {.factor = 0.5, .total_iters = 3});
    check_factors(sched, {0.5, 0.5, 0.5, 1, 1});
  }
  SUBCASE("PolynomialLR: (1 - n / total_iters)^power, then 0") {
    optim::PolynomialLR sched(opt, {.total_iters = 4, .power = 2});
    check_factors(sched, {1, 0.5625, 0.25, 0.0625, 0, 0});
    opt.param_group(0).lr = 0.3;  // the next scheduler's base lrs: each group's lr when it is made
    opt.param_group(1).lr = 0.6;
    optim::PolynomialLR linear(opt, {});  // PyTorch's defaults: linear to 0 in 5 steps
    check_factors(linear, {1, 0.8, 0.6, 0.4, 0.2, 0, 0});
  }
  SUBCASE("options outside PyTorch's ranges, or that would make the lr NaN or negative, are refused") {
    CHECK_THROWS_WITH_AS(optim::ExponentialLR(opt, {.gamma = -0.5}),
                         doctest::Contains("ExponentialLR: gamma must be finite and >= 0"), Error);
    CHECK_THROWS_WITH_AS(optim::ExponentialLR(opt, {}),  // PyTorch's gamma has no default: not guessed
                         doctest::Contains("(and given: it has no default, as PyTorch's), got nan"), Error);
    CHECK_THROWS_WITH_AS(optim::LinearLR(opt, {.start_factor = 0}),
                         doctest::Contains("LinearLR: start_factor must be in (0, 1], got 0"), Error);
    CHECK_THROWS_WITH_AS(optim::LinearLR(opt, {.end_factor = 1.5}),
                         doctest::Contains("LinearLR: end_factor must be in [0, 1], got 1.5"), Error);
    CHECK_THROWS_WITH_AS(optim::LinearLR(opt, {.total_iters = 0}),
                         doctest::Contains("LinearLR: total_iters must be positive, got 0"), Error);
    CHECK_THROWS_WITH_AS(optim::ConstantLR(opt, {.factor = std::nan("")}),
                         doctest::Contains("ConstantLR: factor must be in [0, 1], got nan"), Error);
    // (PyTorch's step() with total_iters 0 keeps base_lr * factor for good, its closed form gives base_lr)
    CHECK_THROWS_WITH_AS(optim::ConstantLR(opt, {.total_iters = 0}),
                         doctest::Contains("ConstantLR: total_iters must be positive, got 0"), Error);
    CHECK_THROWS_WITH_AS(optim::PolynomialLR(opt, {.total_iters = 0}),
                         doctest::Contains("PolynomialLR: total_iters must be positive, got 0"), Error);
    CHECK_THROWS_WITH_AS(optim::PolynomialLR(opt, {.power = -1}),
                         doctest::Contains("PolynomialLR: power must be finite and >= 0, got -1"), Error);
    CHECK(opt.groups()[0].options.lr == 0.3);  // a refused scheduler set nothing
  }
  SUBCASE("an lr that overflows is refused before any group changes") {
    optim::ExponentialLR sched(opt, {.gamma = 2});
    CHECK_THROWS_WITH_AS(sched.set_step(1100), doctest::Contains("ExponentialLR: the lr of group 0 at step 1100 would "
                                                                 "be inf"), Error);
    CHECK(sched.last_step() == 0);
    CHECK(opt.groups()[1].options.lr == 0.6);
  }
}

TEST_CASE("LambdaLR multiplies each base lr by its group's function of the step") {
  Fixture f;
  optim::SGD opt({{{f.a}, {.lr = 0.1}}, {{f.b}, {.lr = 1.0}}});
  SUBCASE("one function for every group") {
    optim::LambdaLR sched(opt, [](int64_t n) { return 1.0 / double(n + 1); });
    auto lrs = curve(sched, 3);
    CHECK(lrs[0] == std::vector<double>{0.1, 1.0});
    CHECK(lrs[3][0] == doctest::Approx(0.025).epsilon(1e-12));
    CHECK(lrs[3][1] == doctest::Approx(0.25).epsilon(1e-12));
  }
  SUBCASE("one per group; the state keeps the step and base lrs, and the loader brings its functions") {
    auto warm_up = [](int64_t n) { return std::min(1.0, double(n + 1) / 4); };
    auto halve = [](int64_t n) { return std::pow(0.5, double(n)); };
    optim::LambdaLR saved(opt, std::vector<optim::LambdaLR::Factor>{warm_up, halve});
    auto lrs = curve(saved, 4);
    CHECK(lrs[2][0] == doctest::Approx(0.075).epsilon(1e-12));
    CHECK(lrs[2][1] == doctest::Approx(0.25).epsilon(1e-12));
    CHECK(lrs[4][0] == doctest::Approx(0.1).epsilon(1e-12));
    const optim::NamedTensors state = saved.state_tensors();
    REQUIRE(state.size() == 2);
    optim::SGD opt2({{{f.a}, {.lr = 0.7}}, {{f.b}, {.lr = 0.7}}});
    optim::LambdaLR loaded(opt2, std::vector<optim::LambdaLR::Factor>{warm_up, halve});
    loaded.load_state_tensors(state);
    CHECK(loaded.base_lrs() == std::vector<double>{0.1, 1.0});
    CHECK(loaded.get_last_lr() == saved.get_last_lr());
    CHECK_THROWS_WITH_AS(loaded.load_state_tensors(optim::ExponentialLR(opt2, {.gamma = 0.5}).state_tensors()),
                         doctest::Contains("unexpected entry 'gamma'"), Error);
  }
  SUBCASE("a braced list of functions: one per group") {
    optim::SGD one({f.a}, {.lr = 0.1});
    optim::LambdaLR sched(one, {[](int64_t n) { return 0.5 * double(n + 1); }});
    sched.step();
    CHECK(sched.get_last_lr() == std::vector<double>{0.1});
    CHECK_THROWS_WITH_AS(optim::LambdaLR(opt, {[](int64_t) { return 1.0; }}),
                         doctest::Contains("LambdaLR: 1 functions for 2 parameter groups"), Error);
  }
  SUBCASE("errors name the group, and leave the lrs as they were") {
    CHECK_THROWS_WITH_AS(optim::LambdaLR(opt, std::vector<optim::LambdaLR::Factor>{[](int64_t) { return 1.0; }}),
                         doctest::Contains("LambdaLR: 1 functions for 2 parameter groups"), Error);
    CHECK_THROWS_WITH_AS(optim::LambdaLR(opt, std::vector<optim::LambdaLR::Factor>{[](int64_t) { return 1.0; }, {}}),
                         doctest::Contains("LambdaLR: the function of group 1 is empty"), Error);
    // Group 0's lr would change at step 2, where group 1's function fails: neither changes.
    optim::LambdaLR sched(opt, std::vector<optim::LambdaLR::Factor>{[](int64_t n) { return n < 2 ? 1.0 : 0.5; },
                                                                    [](int64_t n) { return n < 2 ? 1.0 : -1.0; }});
    sched.step();
    CHECK_THROWS_WITH_AS(sched.step(), doctest::Contains("LambdaLR: the function of group 1 gave -1 at step 2"),
                         Error);
    CHECK(sched.last_step() == 1);
    CHECK(sched.get_last_lr() == std::vector<double>{0.1, 1.0});
    CHECK(opt.groups()[0].options.lr == 0.1);
    CHECK(opt.groups()[1].options.lr == 1.0);
  }
}

TEST_CASE("a scheduler made after another takes the optimizer's initial lr as its base, not the lr the first set") {
  Fixture f;
  optim::SGD opt({{{f.a}, {.lr = 1.0}}, {{f.b}, {.lr = 0.5}}});
  CHECK(!opt.initial_lr(0).has_value());
  optim::LinearLR warmup(opt, {.start_factor = 0.1, .total_iters = 4});  // step 0 sets the lrs to 0.1 and 0.05
  CHECK(opt.groups()[0].options.lr == doctest::Approx(0.1).epsilon(1e-12));
  CHECK(opt.initial_lr(0) == 1.0);
  CHECK(opt.initial_lr(1) == 0.5);
  // As PyTorch's SequentialLR([LinearLR, CosineAnnealingLR]): the cosine made second anneals from 1.0 and 0.5
  optim::CosineAnnealingLR cosine(opt, {.T_max = 10});
  CHECK(cosine.base_lrs() == std::vector<double>{1.0, 0.5});
  cosine.set_step(3);
  CHECK(opt.groups()[0].options.lr == doctest::Approx((1 + std::cos(M_PI * 3 / 10)) / 2).epsilon(1e-12));
  CHECK(opt.groups()[1].options.lr == doctest::Approx(0.5 * (1 + std::cos(M_PI * 3 / 10)) / 2).epsilon(1e-12));

  // OneCycleLR records its own start, max_lr / div_factor, as PyTorch's; a scheduler made after it starts there.
  optim::SGD opt2({f.a}, {.lr = 0.5, .momentum = 0.9});
  optim::OneCycleLR cycle(opt2, {.max_lr = {0.2}, .total_steps = 10});
  CHECK(opt2.initial_lr(0) == 0.2 / 25);
  CHECK(cycle.base_lrs() == std::vector<double>{0.2 / 25});
  optim::StepLR after(opt2, {.step_size = 1, .gamma = 0.5});
  CHECK(after.base_lrs() == std::vector<double>{0.2 / 25});
  CHECK_THROWS_WITH_AS(opt2.set_initial_lr(1, 0.1), doctest::Contains("SGD: no parameter group 1 (it has 1)"), Error);
}

TEST_CASE("the optimizer's state keeps its initial lrs: a scheduler made after a resume starts where it would have") {
  Fixture f;
  optim::SGD opt({f.a}, {.lr = 1.0});
  optim::LinearLR warmup(opt, {.start_factor = 0.1, .total_iters = 4});
  warmup.step();
  warmup.step();  // lr 0.55
  const optim::NamedTensors saved = opt.state_tensors(), saved_warmup = warmup.state_tensors();
  // Resumed in the documented order: the optimizer's state, a scheduler made, its state; then the next scheduler.
  optim::SGD resumed({f.b}, {.lr = 1.0});
  resumed.load_state_tensors(saved);
  CHECK(resumed.initial_lr(0) == 1.0);
  CHECK(resumed.groups()[0].options.lr == doctest::Approx(0.55).epsilon(1e-12));
  optim::LinearLR resumed_warmup(resumed, {.start_factor = 0.1, .total_iters = 4});
  resumed_warmup.load_state_tensors(saved_warmup);
  optim::CosineAnnealingLR cosine(resumed, {.T_max = 10});
  CHECK(cosine.base_lrs() == std::vector<double>{1.0});
  // A state written with no scheduler (or before initial lrs were kept) leaves none, as PyTorch's load_state_dict.
  optim::SGD plain({f.a}, {.lr = 0.01});
  const optim::NamedTensors without = plain.state_tensors();
  CHECK(std::none_of(without.begin(), without.end(), [](const auto& e) { return e.first.ends_with("initial_lr"); }));
  resumed.load_state_tensors(without);
  CHECK(!resumed.initial_lr(0).has_value());
  optim::StepLR step(resumed, {.step_size = 1});
  CHECK(step.base_lrs() == std::vector<double>{0.01});
  optim::NamedTensors negative = saved;
  for (auto& [name, t] : negative)
    if (name == "param_groups.0.initial_lr") t = scalar_tensor(-1.0, {.dtype = kFloat64});
  CHECK_THROWS_WITH_AS(resumed.load_state_tensors(negative),
                       doctest::Contains("'param_groups.0.initial_lr' is -1: a scheduler's base lr must be >= 0"), Error);
  CHECK(resumed.initial_lr(0) == 0.01);  // a refused load changes nothing
}

TEST_CASE("a scheduler's state is its step, base lrs and options: loading it restores the lr of that step") {
  Fixture f;
  optim::SGD opt({f.a}, {.lr = 0.1, .momentum = 0.9});
  optim::OneCycleLR sched(opt, {.max_lr = {0.1}, .total_steps = 10});
  for (int i = 0; i < 4; ++i) sched.step();
  optim::NamedTensors state = sched.state_tensors();
  REQUIRE(state.size() == 2 + 12);  // and OneCycleLROptions' 12 fields
  CHECK(state[0].first == "last_step");
  CHECK(state[0].second.item<int64_t>() == 4);
  CHECK(state[1].first == "base_lrs");
  CHECK(state[2].first == "max_lr");
  CHECK(state[3].first == "total_steps");
  CHECK(state[3].second.item<int64_t>() == 10);

  optim::SGD opt2({f.b}, {.lr = 0.1, .momentum = 0.9});
  optim::OneCycleLR sched2(opt2, {.max_lr = {0.1}, .total_steps = 10});
  sched2.load_state_tensors(state);
  CHECK(sched2.last_step() == 4);
  CHECK(opt2.groups()[0].options.lr == opt.groups()[0].options.lr);
  CHECK(opt2.groups()[0].options.momentum == opt.groups()[0].options.momentum);
  sched.step();
  sched2.step();
  CHECK(sched2.get_last_lr() == sched.get_last_lr());

  CHECK_THROWS_WITH_AS(sched2.load_state_tensors({{"epoch", count(3)}}),
                       doctest::Contains("unexpected entry 'epoch'"), Error);
  CHECK_THROWS_WITH_AS(sched2.load_state_tensors({state[0], {"base_lrs", tensor<double>({0.1, 0.2})}}),
                       doctest::Contains("'base_lrs' must be a floating tensor of 1 values (one per group)"), Error);
  CHECK_THROWS_WITH_AS(sched2.load_state_tensors({state[0], {"base_lrs", tensor<double>({-0.1})}}),
                       doctest::Contains("'base_lrs' holds -0.1"), Error);
  optim::StepLR step_lr(opt2, {.step_size = 1, .gamma = 0.5});
  step_lr.load_state_tensors({state[0]});  // written before base_lrs were saved: the scheduler keeps its own
  CHECK(step_lr.last_step() == 4);
  // opt2's initial lr, which sched2 (OneCycleLR) recorded: max_lr / div_factor
  CHECK(step_lr.base_lrs() == std::vector<double>{0.1 / 25});
}

TEST_CASE("a scheduler made after its optimizer's state was loaded takes the saved base lrs, not the decayed ones") {
  Fixture f;
  optim::SGD opt({f.a}, {.lr = 0.1});
  optim::StepLR sched(opt, {.step_size = 1, .gamma = 0.5});
  for (int i = 0; i < 3; ++i) sched.step();  // lr 0.0125
  const optim::NamedTensors opt_state = opt.state_tensors(), sched_state = sched.state_tensors();

  optim::SGD opt2({f.b}, {.lr = 0.1});
  opt2.load_state_tensors(opt_state);  // the group's lr is now 0.0125
  optim::StepLR sched2(opt2, {.step_size = 1, .gamma = 0.5});
  CHECK(sched2.base_lrs() == std::vector<double>{0.1});  // the optimizer's saved initial lr, not the decayed 0.0125
  sched2.load_state_tensors(sched_state);
  CHECK(sched2.base_lrs() == std::vector<double>{0.1});
  CHECK(opt2.groups()[0].options.lr == 0.0125);
  sched.step();
  sched2.step();
  CHECK(opt2.groups()[0].options.lr == 0.00625);
  CHECK(sched2.get_last_lr() == sched.get_last_lr());

  // The same through a warm-up, whose lr is made of the base lrs of the scheduler after it.
  optim::SGD opt3({f.a}, {.lr = 0.1});
  optim::LinearWarmup warm(opt3, {.warmup_steps = 1},
                           std::make_unique<optim::StepLR>(opt3, optim::StepLROptions{.step_size = 1, .gamma = 0.5}));
  for (int i = 0; i < 4; ++i) warm.step();  // the StepLR's step 3: 0.0125
  optim::SGD opt4({f.b}, {.lr = 0.1});
  opt4.load_state_tensors(opt3.state_tensors());
  optim::LinearWarmup warm2(opt4, {.warmup_steps = 1},
                            std::make_unique<optim::StepLR>(opt4, optim::StepLROptions{.step_size = 1, .gamma = 0.5}));
  warm2.load_state_tensors(warm.state_tensors());
  CHECK(opt4.groups()[0].options.lr == 0.0125);
  warm.step();
  warm2.step();
  CHECK(opt4.groups()[0].options.lr == 0.00625);
  CHECK(warm2.get_last_lr() == warm.get_last_lr());
  // A bad inner state is refused, and leaves the warm-up and the groups as they were.
  optim::NamedTensors bad = warm.state_tensors();
  for (auto& [name, t] : bad)
    if (name == "after.base_lrs") t = tensor<double>({-1});
  CHECK_THROWS_WITH_AS(warm2.load_state_tensors(bad), doctest::Contains("'base_lrs' holds -1"), Error);
  CHECK(opt4.groups()[0].options.lr == 0.00625);
  CHECK(warm2.last_step() == 5);
}

namespace {
Tensor entry(const optim::LRScheduler& s, const std::string& name) {
  for (const auto& [n, t] : s.state_tensors())
    if (n == name) return t;
  FAIL("no entry " << name);
  return {};
}
optim::NamedTensors with(optim::NamedTensors state, const std::string& name, const Tensor& value) {
  for (auto& [n, t] : state)
    if (n == name) t = value;
  return state;
}
// Steps both `steps` times; their lrs must agree at every step.
void step_together(optim::LRScheduler& saved, optim::LRScheduler& loaded, int steps) {
  for (int i = 0; i < steps; ++i) {
    saved.step();
    loaded.step();
    CHECK(loaded.get_last_lr() == saved.get_last_lr());
  }
}
}  // namespace

TEST_CASE("a scheduler made with other options continues as the saved one, as PyTorch's load_state_dict") {
  Fixture f;
  optim::SGD opt({f.a}, {.lr = 0.1, .momentum = 0.9});
  optim::SGD opt2({f.b}, {.lr = 0.1, .momentum = 0.9});
  Tensor c = ones({1}, {.requires_grad = true});
  optim::SGD opt3({c}, {.lr = 0.7, .momentum = 0.9});
  SUBCASE("StepLR") {
    optim::StepLR saved(opt, {.step_size = 3, .gamma = 0.5});
    for (int i = 0; i < 4; ++i) saved.step();
    optim::StepLR loaded(opt2, {});  // step_size 1, gamma 0.1
    loaded.load_state_tensors(saved.state_tensors());
    CHECK(loaded.get_last_lr() == saved.get_last_lr());
    step_together(saved, loaded, 6);
    // Refused, naming every entry wrong, and nothing changes, though the state's other entries differ.
    optim::StepLR other(opt, {.step_size = 2, .gamma = 0.25});
    const double lr = opt2.groups()[0].options.lr;
    CHECK_THROWS_WITH_AS(loaded.load_state_tensors(with(with(other.state_tensors(), "gamma", count(2)), "last_step",
                                                        scalar_tensor(1.0, {.dtype = kFloat64}))),
                         doctest::Contains("StepLR: cannot load the scheduler state (2 problems):\n"
                                           "  - 'last_step' must be a one-element integer tensor, got float64"),
                         Error);
    CHECK_THROWS_WITH_AS(loaded.load_state_tensors(with(other.state_tensors(), "gamma", count(2))),
                         doctest::Contains("  - 'gamma' must be a 0-d float64, got int64"), Error);
    CHECK_THROWS_WITH_AS(loaded.load_state_tensors(with(other.state_tensors(), "step_size", count(0))),
                         doctest::Contains("StepLR: step_size must be positive, got 0"), Error);
    // A gamma that is not a finite number >= 0 would make the lr NaN or negative.
    CHECK_THROWS_WITH_AS(loaded.load_state_tensors(with(other.state_tensors(), "gamma",
                                                        scalar_tensor(std::nan(""), {.dtype = kFloat64}))),
                         doctest::Contains("StepLR: gamma must be finite and >= 0, got nan"), Error);
    CHECK(entry(loaded, "step_size").item<int64_t>() == 3);
    CHECK(entry(loaded, "gamma").item<double>() == 0.5);
    CHECK(loaded.last_step() == saved.last_step());
    CHECK(opt2.groups()[0].options.lr == lr);
    step_together(saved, loaded, 1);
  }
  SUBCASE("MultiStepLR, its milestones a list") {
    optim::MultiStepLR saved(opt, {.milestones = {2, 5}, .gamma = 0.5});
    saved.step();
    optim::MultiStepLR loaded(opt2, {.milestones = {1}});
    loaded.load_state_tensors(saved.state_tensors());
    step_together(saved, loaded, 6);
    CHECK(loaded.get_last_lr() == std::vector<double>{0.1 * 0.25});
    loaded.load_state_tensors(with(saved.state_tensors(), "milestones", tensor(std::vector<int64_t>{5, 2})));
    CHECK(to_vector<int64_t>(entry(loaded, "milestones")) == std::vector<int64_t>{2, 5});  // in any order, sorted
  }
  SUBCASE("ExponentialLR, LinearLR, ConstantLR, PolynomialLR: their options and the saved base lrs") {
    // Each loaded into a scheduler of other options on an optimizer of another lr (0.7): it goes on as the saved one.
    auto resumed = [&](optim::LRScheduler& saved, auto&& loaded, int steps) {
      opt3.param_group(0).lr = 0.7;
      auto scheduler = loaded();
      scheduler.load_state_tensors(saved.state_tensors());
      CHECK(scheduler.base_lrs() == std::vector<double>{0.1});
      CHECK(scheduler.last_step() == saved.last_step());
      CHECK(scheduler.get_last_lr() == saved.get_last_lr());
      step_together(saved, scheduler, steps);
    };
    optim::ExponentialLR exponential(opt, {.gamma = 0.9});
    resumed(exponential, [&] { return optim::ExponentialLR(opt3, {.gamma = 0.5}); }, 3);
    optim::LinearLR linear(opt2, {.start_factor = 0.5, .end_factor = 0.25, .total_iters = 6});
    linear.step();
    resumed(linear, [&] { return optim::LinearLR(opt3, {}); }, 7);
    optim::LinearLR refusing(opt3, {});
    const double lr = opt3.groups()[0].options.lr;
    const std::vector<double> base_lrs = refusing.base_lrs();
    CHECK_THROWS_WITH_AS(refusing.load_state_tensors(with(linear.state_tensors(), "start_factor",
                                                          scalar_tensor(0.0, {.dtype = kFloat64}))),
                         doctest::Contains("LinearLR: start_factor must be in (0, 1], got 0"), Error);
    CHECK(entry(refusing, "start_factor").item<double>() == 1.0 / 3);
    CHECK(refusing.last_step() == 0);
    CHECK(refusing.base_lrs() == base_lrs);
    CHECK(opt3.groups()[0].options.lr == lr);
  }
  SUBCASE("ConstantLR and PolynomialLR, loaded") {
    optim::ConstantLR constant(opt, {.factor = 0.1, .total_iters = 2});
    opt3.param_group(0).lr = 0.7;
    optim::ConstantLR loaded_constant(opt3, {});
    loaded_constant.load_state_tensors(constant.state_tensors());
    CHECK(loaded_constant.base_lrs() == std::vector<double>{0.1});
    step_together(constant, loaded_constant, 3);
    optim::PolynomialLR poly(opt2, {.total_iters = 3, .power = 0.5});
    optim::PolynomialLR loaded_poly(opt3, {});
    loaded_poly.load_state_tensors(poly.state_tensors());
    step_together(poly, loaded_poly, 4);
    CHECK(loaded_poly.get_last_lr() == std::vector<double>{0});
  }
  SUBCASE("CosineAnnealingLR") {
    optim::CosineAnnealingLR saved(opt, {.T_max = 7, .eta_min = 0.01});
    optim::CosineAnnealingLR loaded(opt2, {.T_max = 100});
    loaded.load_state_tensors(saved.state_tensors());
    step_together(saved, loaded, 9);
  }
  SUBCASE("OneCycleLR: every option, its momentum too") {
    optim::OneCycleLR saved(opt, {.max_lr = {0.4}, .epochs = 3, .steps_per_epoch = 4, .pct_start = 0.25,
                                  .anneal_strategy = optim::OneCycleLROptions::Anneal::Linear,
                                  .base_momentum = 0.8, .max_momentum = 0.9, .div_factor = 10,
                                  .final_div_factor = 100, .three_phase = true});
    for (int i = 0; i < 3; ++i) saved.step();
    optim::OneCycleLR loaded(opt2, {.max_lr = {1.0}, .total_steps = 100});
    loaded.load_state_tensors(saved.state_tensors());
    CHECK(loaded.total_steps() == 12);
    CHECK(opt2.groups()[0].options.momentum == opt.groups()[0].options.momentum);
    for (int i = 0; i < 8; ++i) {  // to step 11, the last whose lr lies on the schedule (step 12 extrapolates)
      step_together(saved, loaded, 1);
      CHECK(opt2.groups()[0].options.momentum == opt.groups()[0].options.momentum);
    }
    // The state's step must lie within its own total_steps: refused, and the options and groups stay.
    optim::OneCycleLR other(opt2, {.max_lr = {1.0}, .total_steps = 100});
    for (int i = 0; i < 20; ++i) other.step();
    const double lr = opt2.groups()[0].options.lr;
    CHECK_THROWS_WITH_AS(other.load_state_tensors(with(other.state_tensors(), "total_steps", count(5))),
                         doctest::Contains("OneCycleLR: tried to step 20 times; total_steps is 5"), Error);
    CHECK(other.total_steps() == 100);
    CHECK(opt2.groups()[0].options.lr == lr);
    other.step();
    CHECK(other.last_step() == 21);
    CHECK_THROWS_WITH_AS(
        other.load_state_tensors(with(other.state_tensors(), "anneal_strategy", count(2))),
        doctest::Contains("'anneal_strategy' is 2: 0 (cos) or 1 (linear)"), Error);
    CHECK_THROWS_WITH_AS(other.load_state_tensors(with(other.state_tensors(), "max_lr", tensor<double>({0.1, 0.2}))),
                         doctest::Contains("max_lr has 2 values"), Error);
  }
  SUBCASE("LinearWarmup, and the scheduler after it") {
    optim::LinearWarmup saved(opt, {.warmup_steps = 3, .start_factor = 0.5},
                              std::make_unique<optim::StepLR>(opt, optim::StepLROptions{.step_size = 2, .gamma = 0.5}));
    saved.step();
    optim::LinearWarmup loaded(opt2, {.warmup_steps = 1},
                               std::make_unique<optim::StepLR>(opt2, optim::StepLROptions{}));
    loaded.load_state_tensors(saved.state_tensors());
    CHECK(entry(loaded, "after.step_size").item<int64_t>() == 2);
    step_together(saved, loaded, 8);
    // Refused in its own options or in the inner scheduler's: both stay, with their steps and the group's lr.
    optim::LinearWarmup other(opt, {.warmup_steps = 5, .start_factor = 0.1},
                              std::make_unique<optim::StepLR>(opt, optim::StepLROptions{.step_size = 4, .gamma = 0.9}));
    other.step();
    const double lr = opt2.groups()[0].options.lr;
    const int64_t last_step = loaded.last_step();
    for (const auto& [name, value] : {std::pair{"start_factor", scalar_tensor(2.0, {.dtype = kFloat64})},
                                      std::pair{"after.gamma", scalar_tensor(-1.0, {.dtype = kFloat64})}}) {
      CAPTURE(name);
      CHECK_THROWS_AS(loaded.load_state_tensors(with(other.state_tensors(), name, value)), Error);
      CHECK(entry(loaded, "warmup_steps").item<int64_t>() == 3);
      CHECK(entry(loaded, "start_factor").item<double>() == 0.5);
      CHECK(entry(loaded, "after.step_size").item<int64_t>() == 2);
      CHECK(entry(loaded, "after.gamma").item<double>() == 0.5);
      CHECK(loaded.last_step() == last_step);
      CHECK(opt2.groups()[0].options.lr == lr);
    }
    step_together(saved, loaded, 2);
  }
  SUBCASE("options that would make the lr or the momentum NaN or negative") {
    optim::CosineAnnealingLR cosine(opt, {.T_max = 7});
    CHECK_THROWS_WITH_AS(cosine.load_state_tensors(with(cosine.state_tensors(), "eta_min",
                                                        scalar_tensor(-5.0, {.dtype = kFloat64}))),
                         doctest::Contains("CosineAnnealingLR: eta_min must be finite and >= 0, got -5"), Error);
    optim::OneCycleLR one_cycle(opt2, {.max_lr = {0.1}, .total_steps = 10});
    CHECK_THROWS_WITH_AS(one_cycle.load_state_tensors(with(one_cycle.state_tensors(), "base_momentum",
                                                           scalar_tensor(std::nan(""), {.dtype = kFloat64}))),
                         doctest::Contains("OneCycleLR: base_momentum must be finite and >= 0, got nan"), Error);
    CHECK_THROWS_WITH_AS(optim::MultiStepLR(opt, {.milestones = {1}, .gamma = -0.5}),
                         doctest::Contains("MultiStepLR: gamma must be finite and >= 0, got -0.5"), Error);
  }
}

// ---------------------------------------------------------------------------------------------------------
// ReduceLROnPlateau: each group's lr after every step, as PyTorch 2.11's torch.optim.lr_scheduler.ReduceLROnPlateau
// gives them for the same metrics (run 2026-12-06; the same logic in Python printed the same).

namespace {
std::vector<std::vector<double>> plateau_curve(optim::ReduceLROnPlateau& s, const std::vector<double>& metrics) {
  std::vector<std::vector<double>> lrs;
  for (double m : metrics) {
    s.step(m);
    lrs.push_back(s.get_last_lr());
  }
  return lrs;
}
}  // namespace

TEST_CASE("ReduceLROnPlateau (min, rel): patience, cooldown, a NaN metric, and each group's own min_lr") {
  Fixture f;
  optim::SGD opt({{{f.a}, {.lr = 0.1}}, {{f.b}, {.lr = 0.1}}});
  optim::ReduceLROnPlateau plateau(opt, {.factor = 0.5, .patience = 2, .cooldown = 1, .min_lr = {0.02, 0.0}});
  CHECK(plateau.best() == INFINITY);
  CHECK(plateau.get_last_lr() == std::vector<double>{0.1, 0.1});
  // 0.9 after 0.9 is not better (by 1e-4 relative), nor is 0.89995; NaN is never better.
  const std::vector<double> metrics = {1.0, 0.9, 0.95, 0.9, 0.91, 0.89995, 0.5, 0.6, 0.6,
                                       0.6, 0.6, 0.6, NAN, 0.6, 0.6, 0.6, 0.6};
  const std::vector<std::vector<double>> expected = {
      {0.1, 0.1},     {0.1, 0.1},     {0.1, 0.1},     {0.1, 0.1},     {0.05, 0.05},   {0.05, 0.05},
      {0.05, 0.05},   {0.05, 0.05},   {0.05, 0.05},   {0.025, 0.025}, {0.025, 0.025}, {0.025, 0.025},
      {0.025, 0.025}, {0.02, 0.0125}, {0.02, 0.0125}, {0.02, 0.0125}, {0.02, 0.0125}};
  CHECK(plateau_curve(plateau, metrics) == expected);
  CHECK(plateau.best() == 0.5);
  CHECK(plateau.num_bad_steps() == 2);
  CHECK(plateau.cooldown_counter() == 0);
  CHECK(plateau.last_step() == int64_t(metrics.size()));
  CHECK(opt.groups()[1].options.lr == 0.0125);
}

TEST_CASE("ReduceLROnPlateau (max): abs and rel thresholds, a reduction by eps or less is not made") {
  SUBCASE("abs, patience 0, eps 1e-3: 0.001 -> 0.0001 would move the lr by less than eps") {
    Fixture f;
    optim::SGD opt({f.a}, {.lr = 0.1});
    optim::ReduceLROnPlateau plateau(opt, {.mode = optim::ReduceLROnPlateauOptions::Mode::Max, .patience = 0,
                                           .threshold = 0.5,
                                           .threshold_mode = optim::ReduceLROnPlateauOptions::ThresholdMode::Abs,
                                           .eps = 1e-3});
    CHECK(plateau.best() == -INFINITY);
    const auto lrs = plateau_curve(plateau, {1.0, 1.4, 1.6, 2.0, 2.6, 2.6, 2.6, 2.6});
    const std::vector<double> expected = {0.1, 0.010000000000000002, 0.010000000000000002, 0.0010000000000000002,
                                          0.0010000000000000002, 0.0010000000000000002, 0.0010000000000000002,
                                          0.0010000000000000002};
    for (size_t i = 0; i < expected.size(); ++i) CHECK(lrs[i] == std::vector<double>{expected[i]});
  }
  SUBCASE("rel, patience 1: a better metric is above best * 1.1, which below zero is a lower bar, as PyTorch's") {
    Fixture f;
    optim::SGD opt({f.a}, {.lr = 0.1});
    optim::ReduceLROnPlateau plateau(opt, {.mode = optim::ReduceLROnPlateauOptions::Mode::Max, .factor = 0.5,
                                           .patience = 1, .threshold = 0.1});
    const auto lrs = plateau_curve(plateau, {-1.0, -0.95, -0.85, 2.0, 2.19, 2.21, 2.2, 2.2});
    CHECK(lrs.back() == std::vector<double>{0.05});
    CHECK(lrs[6] == std::vector<double>{0.1});
    CHECK(plateau.best() == 2.21);
  }
}

TEST_CASE("ReduceLROnPlateau refuses bad options, its state goes on where saved, and a bad state changes nothing") {
  Fixture f;
  optim::SGD opt({{{f.a}, {.lr = 0.1}}, {{f.b}, {.lr = 0.1}}});
  using Options = optim::ReduceLROnPlateauOptions;
  CHECK_THROWS_WITH_AS(optim::ReduceLROnPlateau(opt, {.factor = 1.0}), doctest::Contains("factor must be in [0, 1)"),
                       Error);
  CHECK_THROWS_WITH_AS(optim::ReduceLROnPlateau(opt, {.patience = -1}), doctest::Contains("patience"), Error);
  CHECK_THROWS_WITH_AS(optim::ReduceLROnPlateau(opt, {.threshold = NAN}), doctest::Contains("threshold"), Error);
  CHECK_THROWS_WITH_AS(optim::ReduceLROnPlateau(opt, {.cooldown = -2}), doctest::Contains("cooldown"), Error);
  CHECK_THROWS_WITH_AS(optim::ReduceLROnPlateau(opt, {.min_lr = {0.1, 0.1, 0.1}}),
                       doctest::Contains("one value for every group or one per group (2), got 3"), Error);
  CHECK_THROWS_WITH_AS(optim::ReduceLROnPlateau(opt, {.min_lr = {-1}}), doctest::Contains("min_lr"), Error);

  const Options options{.factor = 0.5, .patience = 1, .cooldown = 2, .min_lr = {0.01, 0.0}};
  optim::ReduceLROnPlateau first(opt, options);
  for (double m : {1.0, 2.0, 2.0}) first.step(m);  // reduced at the third step: cooldown 2 begins
  const optim::NamedTensors state = first.state_tensors();
  std::vector<std::string> names;
  for (const auto& [name, t] : state) names.push_back(name);
  CHECK(names == std::vector<std::string>{"last_step", "best", "num_bad_steps", "cooldown_counter", "mode", "factor",
                                          "patience", "threshold", "threshold_mode", "cooldown", "min_lr", "eps"});

  // Another run made with other options takes the state's, as PyTorch's load_state_dict, and goes on as the first.
  optim::ReduceLROnPlateau second(opt, {.mode = Options::Mode::Max, .patience = 7});
  second.load_state_tensors(state);
  CHECK(second.options().patience == 1);
  CHECK(second.options().mode == Options::Mode::Min);
  CHECK(second.options().min_lr == std::vector<double>{0.01, 0.0});
  CHECK(second.cooldown_counter() == 2);
  CHECK(second.last_step() == 3);
  const std::vector<double> metrics = {3.0, 3.0, 3.0, 3.0, 0.5, 3.0};
  const double lr_before = opt.groups()[0].options.lr;
  const auto continued = plateau_curve(second, metrics);
  // The same steps from the first, on the lrs as they were: the same lrs.
  for (size_t g = 0; g < 2; ++g) opt.groups()[g].options.lr = lr_before;
  CHECK(plateau_curve(first, metrics) == continued);

  // A bad entry names itself, and the state before the load stays.
  optim::NamedTensors bad = state;
  bad[4].second = scalar_tensor(int64_t(2), {.dtype = kInt64});  // mode 2
  bad[1].second = scalar_tensor(NAN, {.dtype = kFloat64});        // best NaN
  bad.emplace_back("epoch", count(1));
  CHECK_THROWS_WITH_AS(second.load_state_tensors(bad),
                       doctest::Contains("unexpected entry 'epoch'"), Error);
  bad.pop_back();
  try {
    second.load_state_tensors(bad);
    FAIL("loaded a bad state");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("'mode' is 2") != std::string::npos);
    CHECK(std::string(e.what()).find("'best' is NaN") != std::string::npos);
  }
  CHECK(second.last_step() == 3 + int64_t(metrics.size()));
  CHECK(second.best() == 0.5);
  CHECK(second.cooldown_counter() == first.cooldown_counter());
  CHECK(second.num_bad_steps() == first.num_bad_steps());
  CHECK(second.options().mode == Options::Mode::Min);
  CHECK(second.options().patience == 1);
  CHECK_THROWS_WITH_AS(second.load_state_tensors({state[0]}), doctest::Contains("missing 'best'"), Error);
}

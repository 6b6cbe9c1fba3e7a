// L-BFGS (optim/lbfgs.h): PyTorch's numbers, what its steps reach, its line search where a trial overflows, its
// stopping rules, its checkpoint state and options, autocast and grad mode around it, CUDA against the CPU, and its
// refusals.
//
// "PyTorch's numbers" come from torch.optim.LBFGS of PyTorch 2.11 (CPU, float64) on the same problems, run on the GPU
// machine (2026-12-06, session 61); they are printed with 17 significant digits, and halfgrad's agree to ~1e-15, so the
// tolerance is 1e-12 relative.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/autograd.h"
#include "core/cuda.h"
#include "halfgrad.h"
#include "tests/testing.h"

using namespace halfgrad;
using halfgrad::testing::values;
using optim::NamedTensors;

namespace {

// A small regression with a tanh, and a parameter the loss never reads (its gradient stays undefined):
//   X[i][j] = sin(0.7 (3i + j) + 0.3) (6 x 3), Y[i][j] = cos(0.5 (2i + j)) (6 x 2),
//   w[i][j] = 0.1 (i + 1) - 0.2 j (3 x 2), b = [0.05, -0.1], unused = [0.5, -0.5],
//   loss = mean((tanh(X w + b) - Y)^2).
struct Regression {
  Tensor X, Y, w, b, unused;
  int evals = 0;

  explicit Regression(Device device = Device::cpu()) {
    std::vector<double> x, y, w0;
    for (int i = 0; i < 6; ++i)
      for (int j = 0; j < 3; ++j) x.push_back(std::sin(0.7 * (3 * i + j) + 0.3));
    for (int i = 0; i < 6; ++i)
      for (int j = 0; j < 2; ++j) y.push_back(std::cos(0.5 * (2 * i + j)));
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 2; ++j) w0.push_back(0.1 * (i + 1) - 0.2 * j);
    X = tensor(x, {6, 3}).to(device);
    Y = tensor(y, {6, 2}).to(device);
    w = tensor(w0, {3, 2}).to(device).requires_grad_();
    b = tensor(std::vector<double>{0.05, -0.1}).to(device).requires_grad_();
    unused = tensor(std::vector<double>{0.5, -0.5}).to(device).requires_grad_();
  }
  TensorList params() { return {w, b, unused}; }
  std::function<Tensor()> closure(optim::Optimizer& opt) {
    return [this, &opt] {
      opt.zero_grad();
      Tensor loss = (X.matmul(w).add(b).tanh().sub(Y)).pow(2).mean();
      loss.backward();
      ++evals;
      return loss;
    };
  }
};

void check_close(const std::vector<double>& got, const std::vector<double>& expected, double rel = 1e-10) {
  REQUIRE(got.size() == expected.size());
  for (size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i] == doctest::Approx(expected[i]).epsilon(rel));
  }
}

// Rosenbrock's function of x = (a, c): (1 - a)^2 + 100 (c - a^2)^2, its minimum 0 at (1, 1) along a curved valley.
Tensor rosenbrock(const Tensor& x) {
  Tensor a = x[0], c = x[1];
  return (a.neg().add(1)).pow(2).add(c.sub(a.pow(2)).pow(2).mul(100));
}

// The optimizer's own state entry `name` (state.<name>) as a double.
double own_state(const optim::LBFGS& opt, const std::string& name) {
  for (const auto& [n, t] : opt.state_tensors())
    if (n == "state." + name) return t.dim() == 1 ? double(t.size(0)) : t.item<double>();
  FAIL("no state." << name);
  return 0;
}

// One strong-Wolfe step from x = `start` on loss = -x / 10 + exp(steepness (x - 3)), a slope down to a wall at 3: x
// after it, and the evaluations it took.
std::pair<double, int> step_to_wall(double steepness, int64_t max_iter, double start = 0) {
  Tensor x = full({1}, start, {.dtype = kFloat64, .requires_grad = true});
  optim::LBFGS opt({x}, {.max_iter = max_iter, .strong_wolfe = true});
  int evals = 0;
  opt.step([&] {
    opt.zero_grad();
    Tensor loss = x.mul(-0.1).add(x.sub(3).mul(steepness).exp()).sum();
    loss.backward();
    ++evals;
    return loss;
  });
  return {values(x)[0], evals};
}

// Runs `steps` steps and returns each step's loss.
std::vector<double> run(Regression& r, optim::LBFGS& opt, int steps) {
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) losses.push_back(opt.step(r.closure(opt)).item<double>());
  return losses;
}

}  // namespace

TEST_CASE("LBFGS takes PyTorch's steps: a fixed step, max_eval, the strong-Wolfe line search, tolerance_change") {
  struct Expected {
    const char* name;
    optim::LBFGSOptions options;
    int steps;
    std::vector<double> losses, w, b;
    int evals, n_iter, history;
    double h_diag, prev_loss;
  };
  const std::vector<Expected> cases = {
      {"fixed step", {.max_iter = 5, .history_size = 3}, 3,
       {0.5342719442685531, 0.47999943503219883, 0.47999942415429003},
       {0.01691075640158893, -0.01993718086018524, -0.013796560760151334, 0.004195823104481641, 0.05604798526701881,
        0.026355465901564807},
       {-0.03942871353721256, -0.04872976914313554}, 9, 9, 3, 0.986190392104635, 0.47999942415429003},
      {"lr 0.5, max_eval 3", {.lr = 0.5, .max_iter = 4, .max_eval = 3, .history_size = 2}, 2,
       {0.5342719442685531, 0.48104745537751975},
       {0.007450397885688265, -0.033170177032250836, -0.013430346047413331, 0.0038454421892749075, 0.06606853670673324,
        0.03905248986249232},
       {-0.044295064418600476, -0.05188492963145777}, 6, 4, 2, 1.2187306192209943, 0.4804243560006842},
      {"strong Wolfe", {.max_iter = 8, .history_size = 4, .strong_wolfe = true}, 2,
       {0.5342719442685531, 0.47999942432437853},
       {0.016907374495678567, -0.0199276192125708, -0.01379027786434821, 0.004195612867480125, 0.05606097802046643,
        0.02634558265769433},
       {-0.03942622624797771, -0.04873184879490756}, 10, 9, 4, 1.027206808728601, 0.47999942432437853},
      {"strong Wolfe, tolerance_change 1e-5",
       {.max_iter = 6, .tolerance_change = 1e-5, .history_size = 4, .strong_wolfe = true}, 2,
       {0.5342719442685531, 0.47999948950304616},
       {0.016810834001461956, -0.01991609695100592, -0.013813785243181886, 0.004225594947247372, 0.056121559644594546,
        0.026379923515066787},
       {-0.03908355714373317, -0.04868154098444072}, 7, 7, 4, 2.411686041308756, 0.47999948950304616},
  };
  for (const Expected& e : cases) {
    CAPTURE(std::string(e.name));
    Regression r;
    optim::LBFGS opt(r.params(), e.options);
    check_close(run(r, opt, e.steps), e.losses, 1e-12);
    check_close(values(r.w), e.w, 1e-12);
    check_close(values(r.b), e.b, 1e-12);
    CHECK(values(r.unused) == std::vector<double>{0.5, -0.5});
    CHECK(r.evals == e.evals);
    CHECK(own_state(opt, "func_evals") == e.evals);
    CHECK(own_state(opt, "n_iter") == e.n_iter);
    CHECK(own_state(opt, "ro") == e.history);
    // y.s / y.y of the last gradient change y, a difference of nearly equal gradients near the minimum: their last
    // bits (the order of a sum) move it by ~1e-10.
    CHECK(own_state(opt, "H_diag") == doctest::Approx(e.h_diag).epsilon(1e-8));
    CHECK(own_state(opt, "prev_loss") == doctest::Approx(e.prev_loss).epsilon(1e-12));
  }
}

TEST_CASE("LBFGS's line search takes the trials max_eval leaves it, none where the first evaluation used them up") {
  // max_iter 1 makes max_eval 1: the line search evaluates its first guess (t = 1 here) and takes it where it is lower,
  // as PyTorch's does (x = 0.1 after 2 evaluations), though that point does not meet the curvature condition...
  const auto [x, evals] = step_to_wall(1e6, 1);
  CHECK(x == 0.1);
  CHECK(evals == 2);
  // ... and stays where it was where the guess is higher (from 2.95 the guess is past the wall, at inf).
  const auto [stayed, evals_there] = step_to_wall(1e6, 1, 2.95);
  CHECK(stayed == 2.95);
  CHECK(evals_there == 2);
}

TEST_CASE("LBFGS minimises Rosenbrock's function with the strong-Wolfe line search in one step") {
  // From (-1.5, 2), where a fixed step would cross the valley back and forth.
  Tensor x = tensor(std::vector<double>{-1.5, 2.0}).requires_grad_();
  optim::LBFGS opt({x}, {.lr = 1, .max_iter = 200, .strong_wolfe = true});
  int evals = 0;
  auto closure = [&] {
    opt.zero_grad();
    Tensor loss = rosenbrock(x);
    loss.backward();
    ++evals;
    return loss;
  };
  const double first = opt.step(closure).item<double>();
  CHECK(first == doctest::Approx(std::pow(2.5, 2) + 100 * std::pow(2 - 2.25, 2)));  // the loss before the step
  // PyTorch's point and counts: within ~2e-6 of (1, 1), where g . d rose above -tolerance_change (no descent left
  // along d).
  check_close(values(x), {0.9999979943196398, 0.9999973438921637}, 1e-12);
  CHECK(evals == 51);
  CHECK(own_state(opt, "n_iter") == 41);
}

TEST_CASE("LBFGS runs the closure with grad mode on, inside a NoGradGuard too, and returns its first loss") {
  Regression r;
  optim::LBFGS opt(r.params(), {.max_iter = 3});
  Tensor loss;
  {
    NoGradGuard no_grad;
    loss = opt.step(r.closure(opt));
    CHECK_FALSE(GradMode::is_enabled());  // the caller's mode, back
  }
  CHECK(r.evals == 3);  // the first evaluation and one after each iteration but the last
  Regression start;
  optim::LBFGS unused(start.params());
  CHECK(loss.item<double>() == start.closure(unused)().item<double>());  // the loss where the step began
  CHECK(r.w.grad().defined());
  CHECK(values(r.unused) == std::vector<double>{0.5, -0.5});  // no gradient: a zero one, never moved
}

TEST_CASE("LBFGS stops where the gradient is already below tolerance_grad, evaluating once") {
  Tensor x = tensor(std::vector<double>{3.0}).requires_grad_();
  optim::LBFGS opt({x}, {.tolerance_grad = 1e-7});
  int evals = 0;
  auto flat = [&] {
    opt.zero_grad();
    Tensor loss = x.mul(0).sum();  // a gradient of zeros
    loss.backward();
    ++evals;
    return loss;
  };
  opt.step(flat);
  CHECK(evals == 1);
  CHECK(values(x) == std::vector<double>{3.0});
  // The state has the count of evaluations and no history: no iteration ran.
  NamedTensors state;
  for (auto& [name, t] : opt.state_tensors())
    if (name.rfind("state.", 0) == 0) state.emplace_back(name, t);
  REQUIRE(state.size() == 2);
  CHECK(state[0].first == "state.func_evals");
  CHECK(state[0].second.item<int64_t>() == 1);
  CHECK(state[1].first == "state.n_iter");
  CHECK(state[1].second.item<int64_t>() == 0);
}

TEST_CASE("LBFGS resumes from its checkpoint state as if it had never stopped") {
  for (bool wolfe : {false, true}) {
    CAPTURE(wolfe);
    // Two iterations a step: far from the minimum after the first step, where the history shapes the next.
    const optim::LBFGSOptions options{.max_iter = 2, .history_size = 3, .strong_wolfe = wolfe};
    Regression through, resumed, fresh;
    optim::LBFGS a(through.params(), options);
    run(through, a, 1);
    const int first_evals = through.evals;
    const NamedTensors saved = a.state_tensors();
    for (Regression* r : {&resumed, &fresh}) {
      NoGradGuard no_grad;
      r->w.copy_(through.w);
      r->b.copy_(through.b);
    }
    optim::LBFGS b(resumed.params(), {.max_iter = 7});  // the file's options replace these
    b.load_state_tensors(saved);
    optim::LBFGS c(fresh.params(), options);  // the same options, no history
    const std::vector<double> expected = run(through, a, 2), got = run(resumed, b, 2);
    CHECK(got == expected);
    CHECK(values(resumed.w) == values(through.w));
    CHECK(values(resumed.b) == values(through.b));
    CHECK(resumed.evals == through.evals - first_evals);
    run(fresh, c, 2);
    CHECK(values(fresh.w) != values(through.w));
  }
}

TEST_CASE("LBFGS refuses a checkpoint state that does not fit it, naming each entry, and keeps its own") {
  Regression r;
  optim::LBFGS opt(r.params(), {.max_iter = 3, .history_size = 2});
  run(r, opt, 2);
  const NamedTensors good = opt.state_tensors();
  NamedTensors before;  // copies: state_tensors() hands out the optimizer's own tensors
  for (const auto& [name, t] : good) before.emplace_back(name, t.clone());
  auto with = [&](const std::string& name, const Tensor& value) {  // the entry replaced, or added
    NamedTensors s;
    for (const auto& [n, t] : good)
      if (n != name) s.emplace_back(n, t);
    s.emplace_back(name, value);
    return s;
  };
  auto without = [&](const std::string& name) {
    NamedTensors s;
    for (const auto& [n, t] : good)
      if (n != name) s.emplace_back(n, t);
    return s;
  };
  CHECK_THROWS_WITH_AS(opt.load_state_tensors(with("state.d", zeros({7}, {.dtype = kFloat64}))),
                       doctest::Contains("'state.d' must be a float64[10] tensor (the parameters' 10 elements end to "
                                         "end), got float64[7] cpu"), Error);
  CHECK_THROWS_WITH_AS(opt.load_state_tensors(with("state.ro", zeros({3}, {.dtype = kFloat64}))),
                       doctest::Contains("'state.ro' must be a 1-D floating tensor of at most history_size (2) "
                                         "values"), Error);
  CHECK_THROWS_WITH_AS(opt.load_state_tensors(without("state.prev_loss")),
                       doctest::Contains("the state has d, t, old_dirs, old_stps, ro, H_diag, prev_flat_grad but not "
                                         "prev_loss"), Error);
  CHECK_THROWS_WITH_AS(opt.load_state_tensors(with("state.n_iter", scalar_tensor(-1, {.dtype = kInt64}))),
                       doctest::Contains("'state.n_iter' must be a non-negative one-element integer tensor"), Error);
  CHECK_THROWS_WITH_AS(opt.load_state_tensors(with("state.al", zeros({2}, {.dtype = kFloat64}))),
                       doctest::Contains("unexpected entry 'state.al' (float64[2] cpu): LBFGS keeps func_evals, "
                                         "n_iter, d, t, old_dirs, old_stps, ro, H_diag, prev_flat_grad, prev_loss"),
                       Error);
  CHECK_THROWS_WITH_AS(opt.load_state_tensors(with("param_groups.0.max_iter", scalar_tensor(2.5, {.dtype = kFloat64}))),
                       doctest::Contains("'param_groups.0.max_iter' is 2.5, not a whole number"), Error);
  CHECK_THROWS_WITH_AS(opt.load_state_tensors(
                           with("param_groups.0.history_size", scalar_tensor(0.0, {.dtype = kFloat64}))),
                       doctest::Contains("invalid history_size 0"), Error);
  // Nothing changed: the state is still the one before the refused loads.
  const NamedTensors after = opt.state_tensors();
  REQUIRE(after.size() == before.size());
  for (size_t i = 0; i < after.size(); ++i) {
    CAPTURE(after[i].first);
    CHECK(after[i].first == before[i].first);
    CHECK(values(after[i].second) == values(before[i].second));
  }
  // Another optimizer's per-parameter state is not LBFGS's.
  CHECK_THROWS_WITH_AS(opt.load_state_tensors(with("state.0.0.momentum_buffer", zeros({3, 2}, {.dtype = kFloat64}))),
                       doctest::Contains("unexpected entry 'state.0.0.momentum_buffer'"), Error);
}

TEST_CASE("LBFGS refuses what it cannot run: no closure, a second group, mixed parameters, bad options") {
  Tensor x = zeros({2}, {.dtype = kFloat64, .requires_grad = true});
  optim::LBFGS opt({x});
  CHECK_THROWS_WITH_AS(opt.step(), doctest::Contains("LBFGS: step() needs the closure that evaluates the loss again"),
                       Error);
  CHECK_THROWS_WITH_AS(opt.step([] { return ones({2}); }),
                       doctest::Contains("LBFGS: the closure must return the loss, a one-element tensor; it returned "
                                         "float32[2] cpu"), Error);
  Tensor y = zeros({2}, {.dtype = kFloat64, .requires_grad = true});
  CHECK_THROWS_WITH_AS(opt.add_param_group({{y}, {}}), doctest::Contains("LBFGS: takes one parameter group (as "
                                                                         "PyTorch's), not a group 1"), Error);
  CHECK(opt.num_param_groups() == 1);
  Tensor f = zeros({3}, {.requires_grad = true});
  CHECK_THROWS_WITH_AS(optim::LBFGS({x, f}), doctest::Contains("LBFGS: every parameter must be on one device and of "
                                                               "one dtype"), Error);
  CHECK_THROWS_WITH_AS(optim::LBFGS({x}, {.max_iter = 0}), doctest::Contains("LBFGS: invalid max_iter 0"), Error);
  CHECK_THROWS_WITH_AS(optim::LBFGS({x}, {.max_eval = 0}), doctest::Contains("LBFGS: invalid max_eval 0"), Error);
  CHECK_THROWS_WITH_AS(optim::LBFGS({x}, {.history_size = 0}), doctest::Contains("LBFGS: invalid history_size 0"),
                       Error);
  CHECK_THROWS_WITH_AS(optim::LBFGS({x}, {.lr = -1}), doctest::Contains("LBFGS: invalid learning rate -1"), Error);
  // The default max_eval is PyTorch's, max_iter * 5 / 4.
  optim::LBFGS defaults({x}, {.max_iter = 10});
  CHECK(defaults.groups()[0].options.max_eval == 12);
  // Options edited in place are checked when a step starts, before the closure runs.
  defaults.groups()[0].options.max_eval = 0;
  int evals = 0;
  CHECK_THROWS_WITH_AS(defaults.step([&] {
    ++evals;
    return x.sum();
  }), doctest::Contains("LBFGS: invalid max_eval 0"), Error);
  CHECK(evals == 0);
}

TEST_CASE("LBFGS on CUDA takes the steps it takes on the CPU") {
  if (!cuda::is_available()) return;
  for (bool wolfe : {false, true}) {
    CAPTURE(wolfe);
    const optim::LBFGSOptions options{.max_iter = 5, .history_size = 3, .strong_wolfe = wolfe};
    Regression cpu, gpu(Device::cuda());
    optim::LBFGS a(cpu.params(), options), b(gpu.params(), options);
    check_close(run(gpu, b, 3), run(cpu, a, 3), 1e-12);
    check_close(values(gpu.w.cpu()), values(cpu.w), 1e-12);
    CHECK(gpu.evals == cpu.evals);
  }
}

TEST_CASE("LBFGS's line search takes the bracket's middle where an overflowed trial leaves its cubic no minimum") {
  // loss = -x / 10 + exp(10^300 (x - 3)): a slope of -1/10 up to a wall at 3, past which the loss and its gradient are
  // inf (below 3 the exponential is exactly 0). A trial past the wall makes the cubic's coefficient inf - inf (NaN);
  // PyTorch's interpolation then takes the middle of the bracket, and so must this one, rather than a NaN step. No
  // point meets Wolfe's curvature condition (the slope is -1/10 or inf), so the line search runs all the trials that
  // max_eval (20 * 5 / 4 = 25) leaves it, 24, closing in on the wall from below.
  const auto [at, evals] = step_to_wall(1e300, 20);
  CHECK(std::isfinite(at));
  CHECK(at > 2.9999);
  CHECK(at < 3);
  CHECK(evals == 1 + 1 + 24);  // the step's first, the line search's first guess, its 24 trials
}

TEST_CASE("LBFGS's own arithmetic runs without autocast, and its closure under the caller's") {
  // Under autocast a dot product (a matmul) would be float16, and Rosenbrock's slopes overflow it.
  auto minimise = [](bool autocast) {
    Tensor x = tensor(std::vector<float>{-1.5f, 2.0f}).requires_grad_();
    optim::LBFGS opt({x}, {.max_iter = 40, .strong_wolfe = true});
    bool closure_autocast = !autocast;
    auto closure = [&] {
      closure_autocast = amp::is_autocast_enabled();
      opt.zero_grad();
      Tensor loss = rosenbrock(x);
      loss.backward();
      return loss;
    };
    amp::AutocastGuard guard(kFloat16, autocast);
    opt.step(closure);
    CHECK(closure_autocast == autocast);
    CHECK(amp::is_autocast_enabled() == autocast);
    return values(x);
  };
  const std::vector<double> plain = minimise(false), under_autocast = minimise(true);
  CHECK(std::isfinite(under_autocast[0]));
  CHECK(under_autocast == plain);
}

TEST_CASE("LBFGS refuses a loss scaler's steps before touching a gradient") {
  Tensor x = tensor(std::vector<double>{1, 2}).requires_grad_();
  optim::LBFGS opt({x});
  x.set_grad(tensor(std::vector<double>{0.5, 0.25}));
  const Tensor flag = zeros({}), scale = full({}, 0.5);
  CHECK_THROWS_WITH_AS(opt.step_unless(flag), doctest::Contains("LBFGS: takes no loss scaler's overflow flag"), Error);
  CHECK_THROWS_WITH_AS(opt.step_unless(ones({})), doctest::Contains("LBFGS: takes no loss scaler's overflow flag"),
                       Error);
  CHECK_THROWS_WITH_AS(opt.step_scaled(flag, scale), doctest::Contains("LBFGS: takes no loss scaler or clipping "
                                                                       "coefficient"), Error);
  CHECK(values(x.grad()) == std::vector<double>{0.5, 0.25});
  CHECK(values(x) == std::vector<double>{1, 2});
}

TEST_CASE("LBFGS's checkpoint options: the file's history_size bounds its history, integers load from int64 too") {
  Regression r;
  optim::LBFGS saver(r.params(), {.max_iter = 6, .history_size = 5});
  run(r, saver, 1);
  const NamedTensors saved = saver.state_tensors();
  int64_t kept = 0;
  for (const auto& [name, t] : saved)
    if (name == "state.ro") kept = t.size(0);
  REQUIRE(kept > 2);
  // An optimizer made with a smaller history_size takes the file's, and with it the longer history.
  Regression r2;
  optim::LBFGS smaller(r2.params(), {.history_size = 2});
  smaller.load_state_tensors(saved);
  CHECK(smaller.groups()[0].options.history_size == 5);
  // A file whose history_size is below its own history is refused, whatever the optimizer's.
  NamedTensors shrunk;
  for (const auto& [name, t] : saved)
    shrunk.emplace_back(name, name == "param_groups.0.history_size" ? scalar_tensor(2.0, {.dtype = kFloat64}) : t);
  optim::LBFGS larger(r2.params(), {.history_size = 100});
  CHECK_THROWS_WITH_AS(larger.load_state_tensors(shrunk),
                       doctest::Contains("'state.ro' must be a 1-D floating tensor of at most history_size (2) values"),
                       Error);
  // Integer options as int64 tensors (as a converted PyTorch param_groups holds them).
  NamedTensors integers;
  for (const auto& [name, t] : saved)
    integers.emplace_back(name, name == "param_groups.0.max_iter" ? scalar_tensor(9, {.dtype = kInt64}) : t);
  larger.load_state_tensors(integers);
  CHECK(larger.groups()[0].options.max_iter == 9);
  // A history without an iteration to make it is refused.
  NamedTensors no_iteration;
  for (const auto& [name, t] : saved)
    no_iteration.emplace_back(name, name == "state.n_iter" ? scalar_tensor(0, {.dtype = kInt64}) : t);
  CHECK_THROWS_WITH_AS(larger.load_state_tensors(no_iteration),
                       doctest::Contains("'state.n_iter' is 0 but the state holds a history"), Error);
}

TEST_CASE("LBFGS's options replaced whole keep PyTorch's max_eval default, which ends a step") {
  // On Rosenbrock's function the line search takes two evaluations in some iterations, so max_eval (4 * 5 / 4 = 5)
  // ends the step before max_iter does: as many evaluations and the same point as an optimizer given those options at
  // construction, fewer than one allowed 1000.
  struct Rosenbrock {
    Tensor x = tensor(std::vector<double>{-1.5, 2.0}).requires_grad_();
    int evals = 0;
    void step(optim::LBFGS& opt) {
      opt.step([&] {
        opt.zero_grad();
        Tensor loss = rosenbrock(x);
        loss.backward();
        ++evals;
        return loss;
      });
    }
  } replaced, built, unbounded;
  const optim::LBFGSOptions options{.max_iter = 4, .strong_wolfe = true};
  optim::LBFGS a({replaced.x});
  a.groups()[0].options = options;  // max_eval unset
  optim::LBFGS b({built.x}, options);
  optim::LBFGSOptions more = options;
  more.max_eval = 1000;
  optim::LBFGS c({unbounded.x}, more);
  replaced.step(a), built.step(b), unbounded.step(c);
  CHECK(replaced.evals == built.evals);
  CHECK(values(replaced.x) == values(built.x));
  CHECK(built.evals == 5);
  CHECK(unbounded.evals == 6);
  double max_eval = 0;
  for (const auto& [name, t] : a.state_tensors())
    if (name == "param_groups.0.max_eval") max_eval = t.item<double>();
  CHECK(max_eval == 5);
}

TEST_CASE("LBFGS's integer options survive a checkpoint up to int64's largest") {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  // PyTorch's default, floor(max_iter * 5 / 4), without overflowing, and int64's largest where it would not fit.
  CHECK(optim::max_eval_of({.max_iter = 7}) == 8);
  CHECK(optim::max_eval_of({.max_iter = kMax / 5 * 4}) == kMax / 5 * 5);
  CHECK(optim::max_eval_of({.max_iter = kMax}) == kMax);
  Tensor x = zeros({1}, {.dtype = kFloat64, .requires_grad = true});
  optim::LBFGS saved({x}, {.max_iter = kMax}), loaded({x});
  loaded.load_state_tensors(saved.state_tensors());
  CHECK(loaded.groups()[0].options.max_iter == kMax);
  CHECK(loaded.groups()[0].options.max_eval == kMax);
}

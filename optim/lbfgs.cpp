#include "optim/lbfgs.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/autocast.h"
#include "core/autograd.h"
#include "core/cuda.h"
#include "ops/shape.h"
#include "ops/stack.h"

namespace halfgrad::optim {

int64_t max_eval_of(const LBFGSOptions& o) {
  if (o.max_eval) return *o.max_eval;
  // floor(max_iter * 5 / 4) without overflowing, int64's largest where it would not fit.
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  if (o.max_iter <= 0) return 0;
  return o.max_iter > kMax / 5 * 4 ? kMax : o.max_iter / 4 * 5 + o.max_iter % 4 * 5 / 4;
}

std::vector<OptionField> other_options_of(LBFGSOptions& o) {
  o.max_eval = max_eval_of(o);  // as a checkpoint keeps it: the number a step uses
  return {{.name = "max_iter", .integer = &o.max_iter},
          {.name = "max_eval", .integer = &*o.max_eval},
          {.name = "tolerance_grad", .number = &o.tolerance_grad},
          {.name = "tolerance_change", .number = &o.tolerance_change},
          {.name = "history_size", .integer = &o.history_size},
          {.name = "strong_wolfe", .flag = &o.strong_wolfe}};
}

namespace {

// The closure's loss, evaluated with grad mode on (as PyTorch's torch.enable_grad()(closure), whatever the caller's)
// and autocast as the caller of step() had it (the step's own arithmetic runs without).
struct CallerAutocast {
  bool enabled;
  DType dtype;
};
Tensor evaluate(const std::function<Tensor()>& closure, const CallerAutocast& autocast) {
  struct GradModeOn {
    bool previous = GradMode::is_enabled();
    GradModeOn() { GradMode::set_enabled(true); }
    ~GradModeOn() { GradMode::set_enabled(previous); }
  } grad_mode_on;
  amp::AutocastGuard callers(autocast.dtype, autocast.enabled);
  Tensor loss = closure();
  HG_CHECK(loss.defined() && loss.numel() == 1, "LBFGS: the closure must return the loss, a one-element tensor; it "
           "returned {}", loss.defined() ? loss.meta() : std::string("an undefined tensor"));
  return loss;
}

double dot(const Tensor& a, const Tensor& b) { return a.matmul(b).item<double>(); }
double max_abs(const Tensor& a) { return a.abs().max().item<double>(); }

// The minimiser of the cubic through (x1, f1) and (x2, f2) with slopes g1 and g2, clamped to the bounds (the
// interval between x1 and x2 where none are given); their middle where the cubic has no minimum.
double cubic_interpolate(double x1, double f1, double g1, double x2, double f2, double g2,
                         std::optional<std::pair<double, double>> bounds = std::nullopt) {
  const auto [lo, hi] = bounds ? *bounds : std::pair<double, double>(std::minmax(x1, x2));
  const double d1 = g1 + g2 - 3 * (f1 - f2) / (x1 - x2);
  const double d2_square = d1 * d1 - g1 * g2;
  if (!(d2_square >= 0)) return (lo + hi) / 2.0;  // NaN too (an overflowed trial), as PyTorch's
  const double d2 = std::sqrt(d2_square);
  const double min_pos = x1 <= x2 ? x2 - (x2 - x1) * ((g2 + d2 - d1) / (g2 - g1 + 2 * d2))
                                  : x1 - (x1 - x2) * ((g1 + d2 - d1) / (g1 - g2 + 2 * d2));
  return std::min(std::max(min_pos, lo), hi);
}

struct LineSearchResult {
  double loss;
  Tensor grad;
  double t;
  int64_t evals;
};

// A step length t along d from the loss f, gradient g and slope gtd = g . d at t = 0 that meets the strong Wolfe
// conditions (sufficient decrease c1, curvature c2), PyTorch's _strong_wolfe (after minFunc): widen a bracket from the
// first guess t until it holds such a point, then narrow it by cubic interpolation, at most max_ls trials after the
// first guess. `evaluate_at(t)` is the loss and flat gradient at x + t * d.
LineSearchResult strong_wolfe(const std::function<std::pair<double, Tensor>(double)>& evaluate_at, double t,
                              const Tensor& d, double f, const Tensor& g, double gtd, int64_t max_ls) {
  constexpr double c1 = 1e-4, c2 = 0.9;
  // The bracket's narrowest width (times |d|_inf): PyTorch's default, which its step never overrides (not the
  // optimizer's tolerance_change).
  constexpr double tolerance_change = 1e-9;
  const double d_norm = max_abs(d);
  auto [f_new, g_new] = evaluate_at(t);
  int64_t evals = 1;
  double gtd_new = dot(g_new, d);

  // The bracket: two points (or one that already meets the conditions) with their losses, gradients and slopes.
  double t_prev = 0, f_prev = f, gtd_prev = gtd;
  Tensor g_prev = g;
  std::vector<double> bracket, bracket_f, bracket_gtd;
  std::vector<Tensor> bracket_g;
  bool done = false;
  int64_t ls_iter = 0;
  while (ls_iter < max_ls) {
    if (f_new > f + c1 * t * gtd || (ls_iter > 1 && f_new >= f_prev)) {
      bracket = {t_prev, t}, bracket_f = {f_prev, f_new}, bracket_g = {g_prev, g_new};
      bracket_gtd = {gtd_prev, gtd_new};
      break;
    }
    if (std::abs(gtd_new) <= -c2 * gtd) {
      bracket = {t}, bracket_f = {f_new}, bracket_g = {g_new};
      done = true;
      break;
    }
    if (gtd_new >= 0) {
      bracket = {t_prev, t}, bracket_f = {f_prev, f_new}, bracket_g = {g_prev, g_new};
      bracket_gtd = {gtd_prev, gtd_new};
      break;
    }
    const double min_step = t + 0.01 * (t - t_prev), max_step = t * 10;
    const double previous = t;
    t = cubic_interpolate(t_prev, f_prev, gtd_prev, t, f_new, gtd_new, std::pair{min_step, max_step});
    t_prev = previous, f_prev = f_new, g_prev = g_new, gtd_prev = gtd_new;
    std::tie(f_new, g_new) = evaluate_at(t);
    ++evals;
    gtd_new = dot(g_new, d);
    ++ls_iter;
  }
  if (ls_iter == max_ls) {
    // As PyTorch: a bracket from 0 without slopes, which the zoom below never reads (its loop does not run).
    bracket = {0, t}, bracket_f = {f, f_new}, bracket_g = {g, g_new};
  }

  // Zoom: narrow the bracket around a point that meets the conditions, keeping its lower end at `low`.
  bool insufficient_progress = false;
  size_t low = bracket_f.front() <= bracket_f.back() ? 0 : 1, high = 1 - low;
  while (!done && ls_iter < max_ls) {
    if (std::abs(bracket[1] - bracket[0]) * d_norm < tolerance_change) break;
    t = cubic_interpolate(bracket[0], bracket_f[0], bracket_gtd[0], bracket[1], bracket_f[1], bracket_gtd[1]);
    // A trial too near an end of the bracket moves 10% of its width inside where the last one made too little
    // progress too, or where it is at (or past) an end.
    const double b_max = std::max(bracket[0], bracket[1]), b_min = std::min(bracket[0], bracket[1]);
    const double eps = 0.1 * (b_max - b_min);
    if (std::min(b_max - t, t - b_min) < eps) {
      if (insufficient_progress || t >= b_max || t <= b_min) {
        t = std::abs(t - b_max) < std::abs(t - b_min) ? b_max - eps : b_min + eps;
        insufficient_progress = false;
      } else {
        insufficient_progress = true;
      }
    } else {
      insufficient_progress = false;
    }
    std::tie(f_new, g_new) = evaluate_at(t);
    ++evals;
    gtd_new = dot(g_new, d);
    ++ls_iter;
    if (f_new > f + c1 * t * gtd || f_new >= bracket_f[low]) {
      // Not a sufficient decrease, or no lower than the low end: the new high end.
      bracket[high] = t, bracket_f[high] = f_new, bracket_g[high] = g_new, bracket_gtd[high] = gtd_new;
      low = bracket_f[0] <= bracket_f[1] ? 0 : 1, high = 1 - low;
    } else {
      if (std::abs(gtd_new) <= -c2 * gtd) {
        done = true;
      } else if (gtd_new * (bracket[high] - bracket[low]) >= 0) {
        // The old low end becomes the high one.
        bracket[high] = bracket[low], bracket_f[high] = bracket_f[low], bracket_g[high] = bracket_g[low];
        bracket_gtd[high] = bracket_gtd[low];
      }
      bracket[low] = t, bracket_f[low] = f_new, bracket_g[low] = g_new, bracket_gtd[low] = gtd_new;
    }
  }
  return {bracket_f[low], bracket_g[low], bracket[low], evals};
}

}  // namespace

LBFGS::LBFGS(TensorList params, LBFGSOptions options)
    : OptimizerWith("LBFGS", std::vector<Group<LBFGSOptions>>{{std::move(params), options}}) {
  LBFGSOptions& o = groups_[0].options;
  o.max_eval = max_eval_of(o);
  check_group_options(o, 0);
  check_parameters();
  const Tensor& first = this->params()[0];
  for (size_t p = 1; p < this->params().size(); ++p) {
    const Tensor& t = this->params()[p];
    HG_CHECK(t.device() == first.device() && t.dtype() == first.dtype(), "LBFGS: every parameter must be on one device "
             "and of one dtype (its vectors hold them end to end); parameter 0 is {}, parameter {} is {}",
             first.meta(), p, t.meta());
  }
}

void LBFGS::check_group_options(const LBFGSOptions& o, size_t g) const {
  HG_CHECK(g == 0, "LBFGS: takes one parameter group (as PyTorch's), not a group {}", g);
  check_not_negative("LBFGS", "learning rate", o.lr, g);
  HG_CHECK(o.max_iter >= 1, "LBFGS: invalid max_iter {}: must be >= 1", o.max_iter);
  HG_CHECK(o.max_eval.value_or(1) >= 1, "LBFGS: invalid max_eval {}: must be >= 1", o.max_eval.value_or(1));
  check_not_negative("LBFGS", "tolerance_grad", o.tolerance_grad, g);
  check_not_negative("LBFGS", "tolerance_change", o.tolerance_change, g);
  HG_CHECK(o.history_size >= 1, "LBFGS: invalid history_size {}: must be >= 1", o.history_size);
}

void LBFGS::step() {
  HG_FAIL("LBFGS: step() needs the closure that evaluates the loss again (zero_grad, forward, backward, return the "
          "loss): call step(closure)");
}

void LBFGS::step_unless(const Tensor&) {
  HG_FAIL("LBFGS: takes no loss scaler's overflow flag (step_unless): its steps evaluate the loss again themselves; "
          "call step(closure) without a scaler");
}

void LBFGS::step_scaled(const Tensor&, const Tensor&) {
  HG_FAIL("LBFGS: takes no loss scaler or clipping coefficient (step_scaled): its steps evaluate the loss again "
          "themselves; call step(closure) without a scaler");
}

int64_t LBFGS::flat_numel() const {
  int64_t n = 0;
  for (const Tensor& p : params()) n += p.numel();
  return n;
}

Tensor LBFGS::flat_grad() const {
  TensorList views;
  for (size_t i = 0; i < params().size(); ++i) {
    const Tensor& p = params()[i];
    const Tensor g = p.grad();
    HG_CHECK(!g.defined() || (g.shape() == p.shape() && g.dtype() == p.dtype() && g.device() == p.device()),
             "LBFGS: parameter {} is {} but its gradient is {}", i, p.meta(), g.meta());
    views.push_back(g.defined() ? g.reshape({-1}) : zeros({p.numel()}, {.dtype = p.dtype(), .device = p.device()}));
  }
  return cat(views, 0);
}

void LBFGS::add_to_params(double step, const Tensor& direction) {
  int64_t offset = 0;
  for (const Tensor& p : params()) {
    Tensor param = p;
    param.add_(direction.narrow(0, offset, p.numel()).view(p.shape()), step);
    offset += p.numel();
  }
}

std::pair<double, Tensor> LBFGS::evaluate_along(const std::function<double()>& loss_of, const TensorList& at, double t,
                                                const Tensor& direction) {
  add_to_params(t, direction);
  const double loss = loss_of();
  Tensor grad = flat_grad();
  for (size_t p = 0; p < at.size(); ++p) {
    Tensor param = params()[p];
    param.copy_(at[p]);
  }
  return {loss, grad};
}

Tensor LBFGS::step(const std::function<Tensor()>& closure) {
  HG_CHECK(closure, "LBFGS: step(closure) needs a closure that evaluates the loss");
  HG_CHECK(!cuda::is_capturing(params()[0].device()), "LBFGS: a step reads the loss and its gradient's dot products "
           "on the host every iteration, which a CUDA graph capture cannot; train eagerly");
  const CallerAutocast caller{amp::is_autocast_enabled(), amp::autocast_dtype()};
  NoGradGuard no_grad;
  amp::AutocastGuard no_autocast(caller.dtype, false);  // a dot product under autocast would be float16
  const auto loss_of = [&] { return evaluate(closure, caller).item<double>(); };
  const LBFGSOptions& o = groups_[0].options;
  check_group_options(o, 0);  // again: groups() hands the options out for editing in place
  const int64_t max_eval = max_eval_of(o);

  const Tensor orig_loss = evaluate(closure, caller);
  double loss = orig_loss.item<double>();
  int64_t current_evals = 1;
  ++func_evals_;
  Tensor grad = flat_grad();
  bool optimal = max_abs(grad) <= o.tolerance_grad;
  if (optimal) return orig_loss;

  for (int64_t n_iter = 1; n_iter <= o.max_iter; ++n_iter) {
    ++n_iter_;
    // The direction: the gradient's descent on the first iteration of all, then the two-loop recursion's product of
    // the inverse Hessian's estimate from the history with it.
    if (n_iter_ == 1) {
      d_ = grad.neg();
      old_dirs_.clear(), old_stps_.clear(), ro_.clear();
      h_diag_ = 1;
    } else {
      const Tensor y = grad.sub(prev_flat_grad_);
      const Tensor s = d_.mul(t_);
      const double ys = dot(y, s);
      if (ys > 1e-10) {  // a pair that keeps the estimate positive definite
        if (int64_t(old_dirs_.size()) == o.history_size) {
          old_dirs_.pop_front(), old_stps_.pop_front(), ro_.pop_front();
        }
        old_dirs_.push_back(y), old_stps_.push_back(s), ro_.push_back(1.0 / ys);
        h_diag_ = ys / dot(y, y);
      }
      const size_t num_old = old_dirs_.size();
      std::vector<double> al(num_old);
      Tensor q = grad.neg();
      for (size_t i = num_old; i-- > 0;) {
        al[i] = dot(old_stps_[i], q) * ro_[i];
        q.add_(old_dirs_[i], -al[i]);
      }
      d_ = q.mul(h_diag_);
      for (size_t i = 0; i < num_old; ++i) {
        const double be_i = dot(old_dirs_[i], d_) * ro_[i];
        d_.add_(old_stps_[i], al[i] - be_i);
      }
    }
    if (prev_flat_grad_.defined()) prev_flat_grad_.copy_(grad);
    else prev_flat_grad_ = grad.clone();
    prev_loss_ = loss;

    // The step length: lr, and on the first iteration of all at most lr / |g|_1.
    t_ = n_iter_ == 1 ? std::min(1.0, 1.0 / grad.abs().sum().item<double>()) * o.lr : o.lr;
    const double gtd = dot(grad, d_);
    if (gtd > -o.tolerance_change) break;  // no descent left along d

    int64_t ls_evals = 0;
    if (o.strong_wolfe) {
      TensorList x_init;
      for (const Tensor& p : params()) x_init.push_back(p.clone());
      // As PyTorch's: the trials the step's max_eval leaves (none where the first evaluation used it up).
      const LineSearchResult found = strong_wolfe([&](double t) { return evaluate_along(loss_of, x_init, t, d_); }, t_,
                                                  d_, loss, grad, gtd, max_eval - current_evals);
      loss = found.loss, grad = found.grad, t_ = found.t, ls_evals = found.evals;
      add_to_params(t_, d_);
      optimal = max_abs(grad) <= o.tolerance_grad;
    } else {
      add_to_params(t_, d_);
      // The last iteration's loss is not evaluated: the next step's first evaluation is the same.
      if (n_iter != o.max_iter) {
        loss = loss_of();
        grad = flat_grad();
        optimal = max_abs(grad) <= o.tolerance_grad;
        ls_evals = 1;
      }
    }
    current_evals += ls_evals;
    func_evals_ += ls_evals;

    if (n_iter == o.max_iter || current_evals >= max_eval || optimal) break;
    if (max_abs(d_.mul(t_)) <= o.tolerance_change) break;  // the step is too small
    if (std::abs(loss - prev_loss_) < o.tolerance_change) break;  // the loss no longer changes
  }
  return orig_loss;
}

NamedTensors LBFGS::own_state() const {
  if (func_evals_ == 0) return {};
  NamedTensors out;
  out.emplace_back("func_evals", scalar_tensor(func_evals_, {.dtype = kInt64}));
  out.emplace_back("n_iter", scalar_tensor(n_iter_, {.dtype = kInt64}));
  if (n_iter_ == 0) return out;
  const auto stacked = [](const std::deque<Tensor>& list, const Tensor& like) {
    return list.empty() ? empty({0, like.numel()}, {.dtype = like.dtype(), .device = like.device()})
                        : stack(TensorList(list.begin(), list.end()), 0);
  };
  out.emplace_back("d", d_);
  out.emplace_back("t", scalar_tensor(t_, {.dtype = kFloat64}));
  out.emplace_back("old_dirs", stacked(old_dirs_, d_));
  out.emplace_back("old_stps", stacked(old_stps_, d_));
  out.emplace_back("ro", tensor(std::vector<double>(ro_.begin(), ro_.end())));
  out.emplace_back("H_diag", scalar_tensor(h_diag_, {.dtype = kFloat64}));
  out.emplace_back("prev_flat_grad", prev_flat_grad_);
  out.emplace_back("prev_loss", scalar_tensor(prev_loss_, {.dtype = kFloat64}));
  return out;
}

namespace {

const std::vector<std::string> kCountNames = {"func_evals", "n_iter"};
const std::vector<std::string> kIterationNames = {"d", "t", "old_dirs", "old_stps", "ro", "H_diag", "prev_flat_grad",
                                                  "prev_loss"};

}  // namespace

std::vector<std::string> LBFGS::own_state_errors(const NamedTensors& entries,
                                                 const std::vector<std::map<std::string, double>>& options) const {
  std::vector<std::string> errors;
  std::map<std::string, Tensor> by_name(entries.begin(), entries.end());
  for (const auto& [name, t] : by_name) {
    const bool known = std::count(kCountNames.begin(), kCountNames.end(), name) ||
                       std::count(kIterationNames.begin(), kIterationNames.end(), name);
    if (!known) errors.push_back(fmt::format("unexpected entry 'state.{}' ({}): LBFGS keeps {}, {}", name, t.meta(),
                                             fmt::join(kCountNames, ", "), fmt::join(kIterationNames, ", ")));
  }
  // All or none of each set, the history only with the counts.
  for (const auto* names : {&kCountNames, &kIterationNames}) {
    std::vector<std::string> present, missing;
    for (const std::string& name : *names) (by_name.count(name) ? present : missing).push_back(name);
    if (!present.empty() && !missing.empty())
      errors.push_back(fmt::format("the state has {} but not {}", fmt::join(present, ", "), fmt::join(missing, ", ")));
  }
  const bool has_counts = by_name.count("n_iter") > 0, has_history = by_name.count("d") > 0;
  if (has_history && !has_counts)
    errors.push_back("the state has LBFGS's history but not its counts (func_evals, n_iter)");
  if (!errors.empty() || !has_counts) return errors;

  auto need = [&](const std::string& name, bool ok, const std::string& what) {
    if (!ok) errors.push_back(fmt::format("'state.{}' must be {}, got {}", name, what, by_name.at(name).meta()));
    return ok;
  };
  bool counts_ok = true;
  for (const std::string& name : kCountNames) {
    const Tensor& t = by_name[name];
    counts_ok &= need(name, t.numel() == 1 && is_integral(t.dtype()) && t.item<int64_t>() >= 0,
                      "a non-negative one-element integer tensor");
  }
  // An iteration makes the history, and only an iteration does (state_tensors writes it from the first on).
  if (counts_ok && (by_name["n_iter"].item<int64_t>() > 0) != has_history)
    errors.push_back(fmt::format("'state.n_iter' is {} but the state holds {} history (d, old_dirs, ...)",
                                 by_name["n_iter"].item<int64_t>(), has_history ? "a" : "no"));
  if (!has_history) return errors;
  const Tensor& first = params()[0];
  const int64_t n = flat_numel();
  const std::string flat =
      fmt::format("a {}[{}] tensor (the parameters' {} elements end to end)", dtype_name(first.dtype()), n, n);
  for (const char* name : {"d", "prev_flat_grad"})
    need(name, by_name[name].shape() == Shape{n} && by_name[name].dtype() == first.dtype(), flat);
  for (const char* name : {"t", "H_diag", "prev_loss"})
    need(name, by_name[name].numel() == 1 && by_name[name].is_floating_point(), "a one-element floating tensor");
  // The history_size the load sets: the file's where it has one.
  const double history = options.at(0).at("history_size");
  const Tensor& ro = by_name["ro"];
  const int64_t k = ro.dim() == 1 ? ro.size(0) : 0;
  need("ro", ro.dim() == 1 && ro.is_floating_point() && double(k) <= history,
       fmt::format("a 1-D floating tensor of at most history_size ({}) values", history));
  for (const char* name : {"old_dirs", "old_stps"}) {
    need(name, by_name[name].shape() == Shape{k, n} && by_name[name].dtype() == first.dtype(),
         fmt::format("a {}[{}, {}] tensor (a row for each value of state.ro)", dtype_name(first.dtype()), k, n));
  }
  return errors;
}

void LBFGS::load_own_state(const NamedTensors& entries) {
  std::map<std::string, Tensor> by_name(entries.begin(), entries.end());
  const Tensor& first = params()[0];
  const auto on_params = [&](const Tensor& t) {
    Tensor copy = empty(t.shape(), {.dtype = first.dtype(), .device = first.device()});
    copy.copy_(t);
    return copy;
  };
  func_evals_ = by_name.count("func_evals") ? by_name["func_evals"].item<int64_t>() : 0;
  n_iter_ = by_name.count("n_iter") ? by_name["n_iter"].item<int64_t>() : 0;
  old_dirs_.clear(), old_stps_.clear(), ro_.clear();
  if (!by_name.count("d")) {
    d_ = Tensor(), prev_flat_grad_ = Tensor();
    t_ = 0, h_diag_ = 1, prev_loss_ = 0;
    return;
  }
  d_ = on_params(by_name["d"]);
  prev_flat_grad_ = on_params(by_name["prev_flat_grad"]);
  t_ = by_name["t"].item<double>();
  h_diag_ = by_name["H_diag"].item<double>();
  prev_loss_ = by_name["prev_loss"].item<double>();
  const Tensor dirs = on_params(by_name["old_dirs"]), stps = on_params(by_name["old_stps"]);
  const std::vector<double> ro = to_vector<double>(by_name["ro"]);
  for (size_t i = 0; i < ro.size(); ++i) {
    old_dirs_.push_back(dirs[int64_t(i)]);
    old_stps_.push_back(stps[int64_t(i)]);
    ro_.push_back(ro[i]);
  }
}

}  // namespace halfgrad::optim

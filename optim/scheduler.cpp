#include "optim/scheduler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>

#include "core/log.h"
#include "optim/option_tensors.h"

namespace halfgrad::optim {

namespace {
// Each scheduler's options as a checkpoint keeps them, by their names in the options struct.
std::vector<NamedOption> fields_of(StepLROptions& o) { return {{"step_size", &o.step_size}, {"gamma", &o.gamma}}; }
std::vector<NamedOption> fields_of(MultiStepLROptions& o) {
  return {{"milestones", &o.milestones}, {"gamma", &o.gamma}};
}
std::vector<NamedOption> fields_of(CosineAnnealingLROptions& o) {
  return {{"T_max", &o.T_max}, {"eta_min", &o.eta_min}};
}
// anneal_strategy goes through `anneal`, its code: 0 cos, 1 linear.
std::vector<NamedOption> fields_of(OneCycleLROptions& o, int64_t& anneal) {
  return {{"max_lr", &o.max_lr},
          {"total_steps", &o.total_steps},
          {"epochs", &o.epochs},
          {"steps_per_epoch", &o.steps_per_epoch},
          {"pct_start", &o.pct_start},
          {"anneal_strategy", &anneal},
          {"cycle_momentum", &o.cycle_momentum},
          {"base_momentum", &o.base_momentum},
          {"max_momentum", &o.max_momentum},
          {"div_factor", &o.div_factor},
          {"final_div_factor", &o.final_div_factor},
          {"three_phase", &o.three_phase}};
}
std::vector<NamedOption> fields_of(ExponentialLROptions& o) { return {{"gamma", &o.gamma}}; }
std::vector<NamedOption> fields_of(LinearLROptions& o) {
  return {{"start_factor", &o.start_factor}, {"end_factor", &o.end_factor}, {"total_iters", &o.total_iters}};
}
std::vector<NamedOption> fields_of(ConstantLROptions& o) {
  return {{"factor", &o.factor}, {"total_iters", &o.total_iters}};
}
std::vector<NamedOption> fields_of(PolynomialLROptions& o) {
  return {{"total_iters", &o.total_iters}, {"power", &o.power}};
}
std::vector<NamedOption> fields_of(LinearWarmupOptions& o) {
  return {{"warmup_steps", &o.warmup_steps}, {"start_factor", &o.start_factor}};
}

template <typename Options> NamedTensors tensors_of(Options o) { return option_tensors(fields_of(o)); }

// `o` with the entries of `named` read into it (their errors appended to `errors`); true where no error was there.
template <typename Options> bool read_into(Options& o, const NamedTensors& named, std::vector<std::string>& errors) {
  read_option_tensors(fields_of(o), named, errors);
  return errors.empty();
}

// Every option that multiplies or is an lr must be a finite number >= 0: a negative lr turns the optimizer's steps
// into ascent (the rule base_lrs and OneCycleLR's max_lr follow).
void check_finite_non_negative(const char* who, const char* name, double value) {
  HG_CHECK(std::isfinite(value) && value >= 0, "{}: {} must be finite and >= 0, got {}", who, name, value);
}
}  // namespace

// ---- LRScheduler

LRScheduler::LRScheduler(Optimizer& optimizer, const char* name) : optimizer_(optimizer), name_(name) {
  HG_CHECK(optimizer.num_param_groups() > 0, "{}: the optimizer has no parameter groups", name);
  for (size_t g = 0; g < optimizer.num_param_groups(); ++g) {
    if (!optimizer.initial_lr(g)) optimizer.set_initial_lr(g, optimizer.param_group(g).lr);
    base_lrs_.push_back(*optimizer.initial_lr(g));
  }
}

void LRScheduler::step() { set_step(last_step_ + 1); }

void LRScheduler::set_step(int64_t n) {
  HG_CHECK(n >= 0, "{}: step {} is negative", name_, n);
  HG_CHECK(optimizer_.num_param_groups() == base_lrs_.size(),
           "{}: the optimizer has {} parameter groups but had {} when the scheduler was made", name_,
           optimizer_.num_param_groups(), base_lrs_.size());
  std::vector<double> lrs = lr_at(n);
  for (size_t g = 0; g < lrs.size(); ++g)  // gamma^n overflows: ExponentialLR's gamma 2 at step 1100
    HG_CHECK(std::isfinite(lrs[g]), "{}: the lr of group {} at step {} would be {}", name_, g, n, lrs[g]);
  std::vector<double> momenta = momentum_at(n);
  HG_CHECK(momenta.empty() || optimizer_.param_group(0).momentum.exists(), "{}: it sets the momentum, and {} has "
           "none: make it with cycle_momentum = false", name_, optimizer_.name());
  for (size_t g = 0; g < lrs.size(); ++g) {
    ParamGroupRef group = optimizer_.param_group(g);
    group.lr = lrs[g];
    if (!momenta.empty()) group.momentum = momenta[g];
  }
  last_step_ = n;
  last_lr_ = std::move(lrs);
  stepped(n);
}

NamedTensors LRScheduler::state_tensors() const {
  NamedTensors state = {{"last_step", scalar_tensor(last_step_, {.dtype = kInt64})}, {"base_lrs", tensor(base_lrs_)}};
  for (auto& entry : options_tensors()) state.push_back(std::move(entry));
  return state;
}

void LRScheduler::load_state_tensors(const NamedTensors& state) {
  std::vector<std::string> errors;
  int64_t n = -1;
  std::vector<double> base_lrs = base_lrs_;  // a checkpoint written before base_lrs were saved keeps this scheduler's
  const NamedTensors current_options = options_tensors();
  NamedTensors options;
  std::vector<std::string> missing;
  for (const auto& [name, t] : current_options) missing.push_back(name);
  for (const auto& [name, t] : state) {
    if (std::any_of(current_options.begin(), current_options.end(), [&](const auto& o) { return o.first == name; })) {
      options.emplace_back(name, t);
      std::erase(missing, name);
    } else if (name == "base_lrs") {
      if (!t.defined() || t.dim() != 1 || t.numel() != int64_t(base_lrs_.size()) || !t.is_floating_point()) {
        errors.push_back(fmt::format("'base_lrs' must be a floating tensor of {} values (one per group), got {}",
                                     base_lrs_.size(), t.defined() ? t.meta() : "an undefined tensor"));
        continue;
      }
      const Tensor values = t.detach().to(Device::cpu(), kFloat64).contiguous();
      base_lrs.assign(values.data<double>(), values.data<double>() + values.numel());
      for (double lr : base_lrs)
        if (!std::isfinite(lr) || lr < 0) errors.push_back(fmt::format("'base_lrs' holds {}", lr));
    } else if (name != "last_step") {
      errors.push_back(fmt::format("unexpected entry '{}'", name));
    } else if (!t.defined() || t.numel() != 1 || !is_integral(t.dtype())) {
      errors.push_back(fmt::format("'last_step' must be a one-element integer tensor, got {}",
                                   t.defined() ? t.meta() : "an undefined tensor"));
    } else {
      n = t.item<int64_t>();
      if (n < 0) errors.push_back(fmt::format("'last_step' is {}", n));
    }
  }
  if (n < 0 && errors.empty()) errors.push_back("missing 'last_step'");
  load_options(options, errors);  // adds what it cannot read; changes the options only where nothing was wrong
  if (!errors.empty()) fail_loading(name_, "scheduler state", errors);
  // The base lrs of the run that saved it: a scheduler made after its optimizer's state was loaded took the decayed
  // lrs as its bases (PyTorch keeps them as each group's initial_lr).
  const std::vector<double> previous = base_lrs_;
  base_lrs_ = std::move(base_lrs);
  try {
    set_step(n);  // refused past OneCycleLR's last step
  } catch (...) {
    base_lrs_ = previous;
    std::vector<std::string> none;
    load_options(current_options, none);
    throw;
  }
  if (!missing.empty())
    logger().warn("{}: the state has no {} (a file written before the options were kept): this scheduler's stay",
                  name_, fmt::join(missing, ", "));
}

// ---- LRSchedulerWith, with each scheduler's checks of its options (made or loaded)

namespace {
StepLROptions checked(StepLROptions o) {
  HG_CHECK(o.step_size > 0, "StepLR: step_size must be positive, got {}", o.step_size);
  check_finite_non_negative("StepLR", "gamma", o.gamma);
  return o;
}
MultiStepLROptions checked(MultiStepLROptions o) {
  std::sort(o.milestones.begin(), o.milestones.end());  // any order, as PyTorch's (it counts them)
  check_finite_non_negative("MultiStepLR", "gamma", o.gamma);
  return o;
}
CosineAnnealingLROptions checked(CosineAnnealingLROptions o) {
  HG_CHECK(o.T_max > 0, "CosineAnnealingLR: T_max must be positive, got {}", o.T_max);
  check_finite_non_negative("CosineAnnealingLR", "eta_min", o.eta_min);
  return o;
}
LinearWarmupOptions checked(LinearWarmupOptions o) {
  HG_CHECK(o.warmup_steps >= 0, "LinearWarmup: warmup_steps must not be negative, got {}", o.warmup_steps);
  HG_CHECK(o.start_factor >= 0 && o.start_factor <= 1, "LinearWarmup: start_factor must be in [0, 1], got {}",
           o.start_factor);
  return o;
}
ExponentialLROptions checked(ExponentialLROptions o) {
  HG_CHECK(std::isfinite(o.gamma) && o.gamma >= 0, "ExponentialLR: gamma must be finite and >= 0 (and given: it has "
           "no default, as PyTorch's), got {}", o.gamma);
  return o;
}
LinearLROptions checked(LinearLROptions o) {
  HG_CHECK(o.start_factor > 0 && o.start_factor <= 1, "LinearLR: start_factor must be in (0, 1], got {}",
           o.start_factor);
  HG_CHECK(o.end_factor >= 0 && o.end_factor <= 1, "LinearLR: end_factor must be in [0, 1], got {}", o.end_factor);
  HG_CHECK(o.total_iters > 0, "LinearLR: total_iters must be positive, got {}", o.total_iters);
  return o;
}
ConstantLROptions checked(ConstantLROptions o) {
  HG_CHECK(o.factor >= 0 && o.factor <= 1, "ConstantLR: factor must be in [0, 1], got {}", o.factor);
  HG_CHECK(o.total_iters > 0, "ConstantLR: total_iters must be positive, got {}", o.total_iters);
  return o;
}
PolynomialLROptions checked(PolynomialLROptions o) {
  HG_CHECK(o.total_iters > 0, "PolynomialLR: total_iters must be positive, got {}", o.total_iters);
  check_finite_non_negative("PolynomialLR", "power", o.power);
  return o;
}

// Each base lr times `factor`.
std::vector<double> scaled(const std::vector<double>& base_lrs, double factor) {
  std::vector<double> lrs;
  for (double base : base_lrs) lrs.push_back(base * factor);
  return lrs;
}
}  // namespace

template <typename Options>
LRSchedulerWith<Options>::LRSchedulerWith(Optimizer& optimizer, const char* name, Options options)
    : LRScheduler(optimizer, name), options_(checked(std::move(options))) {}
template <typename Options> NamedTensors LRSchedulerWith<Options>::options_tensors() const {
  return tensors_of(options_);
}
template <typename Options>
void LRSchedulerWith<Options>::load_options(const NamedTensors& named, std::vector<std::string>& errors) {
  if (Options o = options_; read_into(o, named, errors)) options_ = checked(std::move(o));
}
template class LRSchedulerWith<StepLROptions>;
template class LRSchedulerWith<MultiStepLROptions>;
template class LRSchedulerWith<CosineAnnealingLROptions>;
template class LRSchedulerWith<ExponentialLROptions>;
template class LRSchedulerWith<LinearLROptions>;
template class LRSchedulerWith<ConstantLROptions>;
template class LRSchedulerWith<PolynomialLROptions>;
template class LRSchedulerWith<LinearWarmupOptions>;

// ---- StepLR, MultiStepLR, CosineAnnealingLR

StepLR::StepLR(Optimizer& optimizer, StepLROptions options)
    : LRSchedulerWith(optimizer, "StepLR", std::move(options)) {
  start();
}

std::vector<double> StepLR::lr_at(int64_t n) const {
  return scaled(base_lrs_, std::pow(options_.gamma, double(n / options_.step_size)));
}

MultiStepLR::MultiStepLR(Optimizer& optimizer, MultiStepLROptions options)
    : LRSchedulerWith(optimizer, "MultiStepLR", std::move(options)) {
  start();
}

std::vector<double> MultiStepLR::lr_at(int64_t n) const {
  // Milestones passed so far (PyTorch's bisect_right): at step == milestone the decay has happened.
  const auto passed = std::upper_bound(options_.milestones.begin(), options_.milestones.end(), n) -
                      options_.milestones.begin();
  return scaled(base_lrs_, std::pow(options_.gamma, double(passed)));
}

CosineAnnealingLR::CosineAnnealingLR(Optimizer& optimizer, CosineAnnealingLROptions options)
    : LRSchedulerWith(optimizer, "CosineAnnealingLR", std::move(options)) {
  start();
}

std::vector<double> CosineAnnealingLR::lr_at(int64_t n) const {
  const double eta_min = options_.eta_min;
  std::vector<double> lrs;
  for (double base : base_lrs_)
    lrs.push_back(eta_min +
                  (base - eta_min) * (1 + std::cos(std::numbers::pi * double(n) / double(options_.T_max))) / 2);
  return lrs;
}

// ---- ExponentialLR, LinearLR, ConstantLR, PolynomialLR: PyTorch's closed forms, its arithmetic in its order

ExponentialLR::ExponentialLR(Optimizer& optimizer, ExponentialLROptions options)
    : LRSchedulerWith(optimizer, "ExponentialLR", std::move(options)) {
  start();
}
std::vector<double> ExponentialLR::lr_at(int64_t n) const {
  return scaled(base_lrs_, std::pow(options_.gamma, double(n)));
}

LinearLR::LinearLR(Optimizer& optimizer, LinearLROptions options)
    : LRSchedulerWith(optimizer, "LinearLR", std::move(options)) {
  start();
}
std::vector<double> LinearLR::lr_at(int64_t n) const {
  const LinearLROptions& o = options_;
  return scaled(base_lrs_, o.start_factor + (o.end_factor - o.start_factor) * double(std::min(o.total_iters, n)) /
                                                double(o.total_iters));
}

ConstantLR::ConstantLR(Optimizer& optimizer, ConstantLROptions options)
    : LRSchedulerWith(optimizer, "ConstantLR", std::move(options)) {
  start();
}
std::vector<double> ConstantLR::lr_at(int64_t n) const {
  return scaled(base_lrs_, n < options_.total_iters ? options_.factor : 1.0);
}

PolynomialLR::PolynomialLR(Optimizer& optimizer, PolynomialLROptions options)
    : LRSchedulerWith(optimizer, "PolynomialLR", std::move(options)) {
  start();
}
std::vector<double> PolynomialLR::lr_at(int64_t n) const {
  const PolynomialLROptions& o = options_;
  return scaled(base_lrs_, std::pow(1.0 - double(std::min(o.total_iters, n)) / double(o.total_iters), o.power));
}

// ---- LambdaLR

LambdaLR::LambdaLR(Optimizer& optimizer, Factor factor) : LRScheduler(optimizer, "LambdaLR"), factors_{factor} {
  HG_CHECK(bool(factor), "LambdaLR: the function is empty");
  start();
}

LambdaLR::LambdaLR(Optimizer& optimizer, std::vector<Factor> factors)
    : LRScheduler(optimizer, "LambdaLR"), factors_(std::move(factors)) {
  HG_CHECK(factors_.size() == base_lrs_.size(), "LambdaLR: {} functions for {} parameter groups (give one per group, "
           "or one function for all)", factors_.size(), base_lrs_.size());
  for (size_t g = 0; g < factors_.size(); ++g)
    HG_CHECK(bool(factors_[g]), "LambdaLR: the function of group {} is empty", g);
  start();
}

std::vector<double> LambdaLR::lr_at(int64_t n) const {
  std::vector<double> lrs;
  for (size_t g = 0; g < base_lrs_.size(); ++g) {
    const double factor = factors_[factors_.size() == 1 ? 0 : g](n);  // one function for all: called per group
    HG_CHECK(std::isfinite(factor) && factor >= 0, "LambdaLR: the function of group {} gave {} at step {} (a factor "
             "must be finite and >= 0)", g, factor, n);
    lrs.push_back(base_lrs_[g] * factor);
  }
  return lrs;
}

// ---- OneCycleLR

namespace {
enum { kInitial = 0, kMax = 1, kMin = 2 };
}

OneCycleLR::OneCycleLR(Optimizer& optimizer, OneCycleLROptions options) : LRScheduler(optimizer, "OneCycleLR") {
  configure(std::move(options));
  for (size_t g = 0; g < base_lrs_.size(); ++g) {  // its start is the groups' initial lr, as PyTorch's
    base_lrs_[g] = max_lrs_[g] / options_.div_factor;
    optimizer.set_initial_lr(g, base_lrs_[g]);
  }
  start();
}
namespace {
int64_t code_of(OneCycleLROptions::Anneal anneal) { return anneal == OneCycleLROptions::Anneal::Linear ? 1 : 0; }
}  // namespace

NamedTensors OneCycleLR::options_tensors() const {
  OneCycleLROptions o = options_;
  int64_t anneal = code_of(o.anneal_strategy);
  return option_tensors(fields_of(o, anneal));
}
void OneCycleLR::load_options(const NamedTensors& named, std::vector<std::string>& errors) {
  OneCycleLROptions o = options_;
  int64_t anneal = code_of(o.anneal_strategy);
  read_option_tensors(fields_of(o, anneal), named, errors);
  if (anneal != 0 && anneal != 1)
    errors.push_back(fmt::format("'anneal_strategy' is {}: 0 (cos) or 1 (linear)", anneal));
  if (!errors.empty()) return;
  o.anneal_strategy = anneal == 1 ? OneCycleLROptions::Anneal::Linear : OneCycleLROptions::Anneal::Cos;
  configure(std::move(o));
}

void OneCycleLR::configure(OneCycleLROptions o) {
  // As PyTorch: total_steps when given, else epochs and steps_per_epoch, each a positive count.
  HG_CHECK(o.total_steps > 0 || (o.total_steps == 0 && o.epochs > 0 && o.steps_per_epoch > 0 &&
                                 o.epochs <= std::numeric_limits<int64_t>::max() / o.steps_per_epoch),
           "OneCycleLR: give a positive total_steps, or (total_steps 0) positive epochs and steps_per_epoch (got "
           "total_steps {}, epochs {}, steps_per_epoch {})",
           o.total_steps, o.epochs, o.steps_per_epoch);
  const int64_t total_steps = o.total_steps > 0 ? o.total_steps : o.epochs * o.steps_per_epoch;
  HG_CHECK(o.pct_start >= 0 && o.pct_start <= 1, "OneCycleLR: pct_start must be in [0, 1], got {}", o.pct_start);
  HG_CHECK(o.div_factor > 0 && o.final_div_factor > 0,
           "OneCycleLR: div_factor and final_div_factor must be positive, got {} and {}", o.div_factor,
           o.final_div_factor);
  const size_t groups = base_lrs_.size();
  HG_CHECK(o.max_lr.size() == 1 || o.max_lr.size() == groups,
           "OneCycleLR: max_lr has {} values; give one for every group or one per group ({} groups)",
           o.max_lr.size(), groups);
  std::vector<double> max_lrs;
  for (size_t g = 0; g < groups; ++g) max_lrs.push_back(o.max_lr.size() == 1 ? o.max_lr[0] : o.max_lr[g]);
  for (double max_lr : max_lrs)  // a negative lr would turn the optimizer's steps into ascent
    HG_CHECK(std::isfinite(max_lr) && max_lr >= 0, "OneCycleLR: max_lr must be finite and >= 0, got {}",
             fmt::join(o.max_lr, ", "));
  if (o.cycle_momentum) {
    check_finite_non_negative("OneCycleLR", "base_momentum", o.base_momentum);
    check_finite_non_negative("OneCycleLR", "max_momentum", o.max_momentum);
  }

  const double total = double(total_steps);
  std::vector<Phase> phases;
  if (o.three_phase) {
    phases = {{o.pct_start * total - 1, kInitial, kMax, true, false},
              {2 * o.pct_start * total - 2, kMax, kInitial, false, true},
              {total - 1, kInitial, kMin, true, true}};
  } else {
    phases = {{o.pct_start * total - 1, kInitial, kMax, true, false}, {total - 1, kMax, kMin, false, true}};
  }
  options_ = std::move(o);
  phases_ = std::move(phases);
  total_steps_ = total_steps;
  max_lrs_ = std::move(max_lrs);
}

std::pair<const OneCycleLR::Phase*, double> OneCycleLR::locate(int64_t n) const {
  HG_CHECK(n <= total_steps_, "OneCycleLR: tried to step {} times; total_steps is {}", n, total_steps_);
  double start = 0;
  for (size_t i = 0; i < phases_.size(); ++i) {
    const Phase& phase = phases_[i];
    if (double(n) <= phase.end_step || i + 1 == phases_.size()) {
      // A phase of no length (pct_start * total_steps = 1) is over as soon as it starts.
      double pct = phase.end_step == start ? 1.0 : (double(n) - start) / (phase.end_step - start);
      return {&phase, pct};
    }
    start = phase.end_step;
  }
  return {&phases_.back(), 1.0};  // not reached
}

double OneCycleLR::anneal(double start, double end, double pct) const {
  if (options_.anneal_strategy == OneCycleLROptions::Anneal::Linear) return (end - start) * pct + start;
  return end + (start - end) / 2.0 * (std::cos(std::numbers::pi * pct) + 1);
}

std::vector<double> OneCycleLR::lr_at(int64_t n) const {
  auto [phase, pct] = locate(n);
  std::vector<double> lrs;
  for (double max_lr : max_lrs_) {
    const double initial = max_lr / options_.div_factor;
    const double levels[3] = {initial, max_lr, initial / options_.final_div_factor};
    lrs.push_back(anneal(levels[phase->start_lr], levels[phase->end_lr], pct));
  }
  return lrs;
}

std::vector<double> OneCycleLR::momentum_at(int64_t n) const {
  if (!options_.cycle_momentum) return {};
  auto [phase, pct] = locate(n);
  auto level = [&](bool max) { return max ? options_.max_momentum : options_.base_momentum; };
  return std::vector<double>(max_lrs_.size(),
                             anneal(level(phase->start_momentum_max), level(phase->end_momentum_max), pct));
}

// ---- LinearWarmup

LinearWarmup::LinearWarmup(Optimizer& optimizer, LinearWarmupOptions options, std::unique_ptr<LRScheduler> after)
    : LRSchedulerWith(optimizer, "LinearWarmup", options), after_(std::move(after)) {
  HG_CHECK(!after_ || &after_->optimizer() == &optimizer,
           "LinearWarmup: the scheduler after the warm-up ({}) drives another optimizer", after_->name());
  start();
}

NamedTensors LinearWarmup::state_tensors() const {
  NamedTensors state = LRScheduler::state_tensors();
  if (after_)
    for (auto& [name, t] : after_->state_tensors()) state.emplace_back("after." + name, t);
  return state;
}

void LinearWarmup::load_state_tensors(const NamedTensors& state) {
  NamedTensors own, after;
  for (const auto& [name, t] : state) {
    if (name.starts_with("after.")) after.emplace_back(name.substr(6), t);
    else own.emplace_back(name, t);
  }
  HG_CHECK(after.empty() || after_, "LinearWarmup: cannot load the scheduler state: it holds the state of a scheduler "
           "after the warm-up (after.{}), and this one has none", after.front().first);
  if (!after_ || after.empty()) return LRScheduler::load_state_tensors(own);  // a state written before "after."
  const NamedTensors before = after_->state_tensors();
  after_->load_state_tensors(after);  // its base lrs first: this one's lr is made of them
  try {
    LRScheduler::load_state_tensors(own);
  } catch (...) {
    after_->load_state_tensors(before);
    set_step(last_step());  // the groups as they were: the restore above wrote the inner scheduler's lrs
    throw;
  }
}

void LinearWarmup::stepped(int64_t n) {
  if (!after_) return;
  const int64_t inner = std::max<int64_t>(n - options_.warmup_steps, 0);
  after_->follow(inner, after_->lr_at(inner));
}

std::vector<double> LinearWarmup::lr_at(int64_t n) const {
  const int64_t warmup = options_.warmup_steps;
  if (n >= warmup) return after_ ? after_->lr_at(n - warmup) : base_lrs_;
  std::vector<double> lrs = after_ ? after_->lr_at(0) : base_lrs_;
  const double factor = options_.start_factor + (1 - options_.start_factor) * double(n) / double(warmup);
  for (double& lr : lrs) lr *= factor;
  return lrs;
}

std::vector<double> LinearWarmup::momentum_at(int64_t n) const {
  if (!after_) return {};
  return after_->momentum_at(std::max<int64_t>(0, n - options_.warmup_steps));
}

// ---- ReduceLROnPlateau

namespace {
// ReduceLROnPlateau's state as a checkpoint keeps it: its counters and best, then its options (mode and
// threshold_mode through their codes: 0 min / rel, 1 max / abs).
struct PlateauState {
  ReduceLROnPlateauOptions options;
  int64_t mode = -1, threshold_mode = -1, last_step = -1, num_bad_steps = -1, cooldown_counter = -1;
  double best = NAN;
  std::vector<NamedOption> fields() {
    return {{"last_step", &last_step},   {"best", &best},
            {"num_bad_steps", &num_bad_steps}, {"cooldown_counter", &cooldown_counter},
            {"mode", &mode},             {"factor", &options.factor},
            {"patience", &options.patience}, {"threshold", &options.threshold},
            {"threshold_mode", &threshold_mode}, {"cooldown", &options.cooldown},
            {"min_lr", &options.min_lr}, {"eps", &options.eps}};
  }
};

ReduceLROnPlateauOptions checked(ReduceLROnPlateauOptions o, size_t groups) {
  const char* who = "ReduceLROnPlateau";
  HG_CHECK(std::isfinite(o.factor) && o.factor >= 0 && o.factor < 1, "{}: factor must be in [0, 1), got {}", who,
           o.factor);
  HG_CHECK(o.patience >= 0, "{}: patience must not be negative, got {}", who, o.patience);
  check_finite_non_negative(who, "threshold", o.threshold);
  HG_CHECK(o.cooldown >= 0, "{}: cooldown must not be negative, got {}", who, o.cooldown);
  check_finite_non_negative(who, "eps", o.eps);
  HG_CHECK(o.min_lr.size() == 1 || o.min_lr.size() == groups,
           "{}: min_lr must hold one value for every group or one per group ({}), got {}", who, groups,
           o.min_lr.size());
  for (double lr : o.min_lr) check_finite_non_negative(who, "min_lr", lr);
  return o;
}
}  // namespace

ReduceLROnPlateau::ReduceLROnPlateau(Optimizer& optimizer, ReduceLROnPlateauOptions options)
    : optimizer_(optimizer), options_(checked(std::move(options), optimizer.num_param_groups())) {
  HG_CHECK(optimizer.num_param_groups() > 0, "ReduceLROnPlateau: the optimizer has no parameter groups");
  best_ = options_.mode == ReduceLROnPlateauOptions::Mode::Min ? std::numeric_limits<double>::infinity()
                                                               : -std::numeric_limits<double>::infinity();
  record_lrs();
}

void ReduceLROnPlateau::record_lrs() {
  last_lr_.clear();
  for (const ParamGroupRef& group : optimizer_.param_groups()) last_lr_.push_back(group.lr);
}

double ReduceLROnPlateau::min_lr(size_t group) const {
  return options_.min_lr.size() == 1 ? options_.min_lr[0] : options_.min_lr[group];
}

bool ReduceLROnPlateau::is_better(double metric) const {
  const bool rel = options_.threshold_mode == ReduceLROnPlateauOptions::ThresholdMode::Rel;
  if (options_.mode == ReduceLROnPlateauOptions::Mode::Min)
    return metric < (rel ? best_ * (1.0 - options_.threshold) : best_ - options_.threshold);
  return metric > (rel ? best_ * (options_.threshold + 1.0) : best_ + options_.threshold);
}

void ReduceLROnPlateau::step(double metric) {
  const size_t groups = optimizer_.num_param_groups();
  HG_CHECK(options_.min_lr.size() == 1 || options_.min_lr.size() == groups,
           "ReduceLROnPlateau: the optimizer has {} parameter groups, and min_lr holds one value for each of the {} "
           "it had when the scheduler was made: make a new scheduler, with a min_lr for each group or one for all",
           groups, options_.min_lr.size());
  ++last_step_;
  if (is_better(metric)) {
    best_ = metric;
    num_bad_steps_ = 0;
  } else {
    ++num_bad_steps_;
  }
  if (cooldown_counter_ > 0) {  // in cooldown: no step counts as bad
    --cooldown_counter_;
    num_bad_steps_ = 0;
  }
  if (num_bad_steps_ > options_.patience) {
    for (size_t g = 0; g < groups; ++g) {
      ParamGroupRef group = optimizer_.param_group(g);
      const double reduced = std::max(group.lr * options_.factor, min_lr(g));
      if (group.lr - reduced > options_.eps) {
        logger().debug("ReduceLROnPlateau: step {}: group {}'s lr {} -> {}", last_step_, g, group.lr, reduced);
        group.lr = reduced;
      }
    }
    cooldown_counter_ = options_.cooldown;
    num_bad_steps_ = 0;
  }
  record_lrs();
}

NamedTensors ReduceLROnPlateau::state_tensors() const {
  PlateauState s{.options = options_,
                 .mode = int64_t(options_.mode),
                 .threshold_mode = int64_t(options_.threshold_mode),
                 .last_step = last_step_,
                 .num_bad_steps = num_bad_steps_,
                 .cooldown_counter = cooldown_counter_,
                 .best = best_};
  return option_tensors(s.fields());
}

void ReduceLROnPlateau::load_state_tensors(const NamedTensors& state) {
  PlateauState s{.options = options_};  // the rest as "not read": -1 and NaN
  const std::vector<NamedOption> fields = s.fields();
  std::vector<std::string> errors;
  for (const std::string& absent : read_option_tensors(fields, state, errors))
    errors.push_back(fmt::format("missing '{}'", absent));
  for (const auto& [name, t] : state)
    if (std::none_of(fields.begin(), fields.end(), [&](const NamedOption& f) { return name == f.name; }))
      errors.push_back(fmt::format("unexpected entry '{}'", name));
  if (errors.empty()) {
    if (s.mode != 0 && s.mode != 1) errors.push_back(fmt::format("'mode' is {}: 0 (min) or 1 (max)", s.mode));
    if (s.threshold_mode != 0 && s.threshold_mode != 1)
      errors.push_back(fmt::format("'threshold_mode' is {}: 0 (rel) or 1 (abs)", s.threshold_mode));
    for (const auto& [what, value] : {std::pair{"last_step", s.last_step}, std::pair{"num_bad_steps", s.num_bad_steps},
                                      std::pair{"cooldown_counter", s.cooldown_counter}})
      if (value < 0) errors.push_back(fmt::format("'{}' is {}", what, value));
    if (std::isnan(s.best)) errors.push_back("'best' is NaN");
    s.options.mode = ReduceLROnPlateauOptions::Mode(s.mode);
    s.options.threshold_mode = ReduceLROnPlateauOptions::ThresholdMode(s.threshold_mode);
    try {
      s.options = checked(s.options, optimizer_.num_param_groups());
    } catch (const Error& e) {
      errors.push_back(e.what());
    }
  }
  if (!errors.empty()) fail_loading(name(), "scheduler state", errors);
  options_ = std::move(s.options);
  last_step_ = s.last_step;
  best_ = s.best;
  num_bad_steps_ = s.num_bad_steps;
  cooldown_counter_ = s.cooldown_counter;
  record_lrs();
}

}  // namespace halfgrad::optim

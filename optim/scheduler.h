#pragma once
// Learning-rate schedulers, with PyTorch's semantics (torch.optim.lr_scheduler).
//
//   optim::SGD opt(params, {.lr = 0.1, .momentum = 0.9});
//   optim::CosineAnnealingLR sched(opt, {.T_max = epochs});   // sets the lr for step 0 at once
//   for (int epoch = 0; epoch < epochs; ++epoch) {
//     train_one_epoch(opt);
//     sched.step();                                           // the lr for the next epoch
//   }
//
// Every LRScheduler is a closed form (ReduceLROnPlateau, at the end, follows a metric instead): lr_at(n) gives each
// group's lr after n calls of step() (momentum_at(n) the momentum, for OneCycleLR), computed from the groups' lr before
// the first scheduler on their optimizer set it (base_lrs(): Optimizer::initial_lr, PyTorch's initial_lr).
// So resuming needs the step count, those base lrs and the options (state_tensors; set_step alone where the scheduler
// was made with the same options, before the optimizer's state was loaded), and schedulers compose (LinearWarmup).
// Like PyTorch's, a scheduler applies step 0 in its constructor; what a "step" is (an epoch, an iteration)
// is the caller's choice.
#include <cmath>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "optim/optimizer.h"

namespace halfgrad::optim {

class LRScheduler {
 public:
  virtual ~LRScheduler() = default;
  LRScheduler(const LRScheduler&) = delete;
  LRScheduler& operator=(const LRScheduler&) = delete;

  // Advances one step and sets each group's lr (and momentum) to the values for the new step.
  void step();
  // Jumps to step n and sets the groups as n calls of step() would have.
  void set_step(int64_t n);
  // PyTorch's last_epoch: the number of step() calls so far (0 after construction).
  int64_t last_step() const { return last_step_; }
  // Each group's lr as set by the last step() (or by the constructor).
  const std::vector<double>& get_last_lr() const { return last_lr_; }
  // Each group's lr before the first scheduler on the optimizer set it (OneCycleLR: max_lr / div_factor), or as loaded
  // by load_state_tensors.
  const std::vector<double>& base_lrs() const { return base_lrs_; }

  // The closed form: each group's lr at step n.
  virtual std::vector<double> lr_at(int64_t n) const = 0;
  // Each group's momentum (SGD's and RMSprop's momentum, Adam's beta1; Adagrad has none) at step n; empty when the
  // scheduler leaves it alone.
  virtual std::vector<double> momentum_at(int64_t /*n*/) const { return {}; }

  // For checkpoints, what PyTorch's state_dict keeps: "last_step" (0-d int64), "base_lrs" (float64, one per group) and
  // the scheduler's options by their names ("step_size", "gamma", ...: options_tensors). Loading checks them all
  // before anything changes, replaces this scheduler's options and base lrs with the state's, and sets the groups
  // for that step. A state written before base lrs or options were kept keeps this scheduler's (with a warning for
  // the options).
  virtual NamedTensors state_tensors() const;
  virtual void load_state_tensors(const NamedTensors& state);

  const char* name() const { return name_; }
  Optimizer& optimizer() const { return optimizer_; }

 protected:
  LRScheduler(Optimizer& optimizer, const char* name);
  // Derived constructors call this last: applies step 0, as PyTorch's constructors do.
  void start() { set_step(0); }
  // The options as named tensors (optim/option_tensors.h), and back: load_options reads those present, adding what it
  // cannot read to `errors`; where `errors` is then empty it checks the result as the constructor does (throwing) and
  // replaces the options, else it changes nothing. A scheduler without options keeps the defaults (none).
  virtual NamedTensors options_tensors() const { return {}; }
  virtual void load_options(const NamedTensors& /*named*/, std::vector<std::string>& /*errors*/) {}

  Optimizer& optimizer_;
  std::vector<double> base_lrs_;

 private:
  friend class LinearWarmup;
  // After set_step(n) has written the groups: a scheduler that drives another (LinearWarmup) keeps it in step.
  virtual void stepped(int64_t /*n*/) {}
  // Where the scheduler driving this one has taken it: its step and lrs, the groups left as the driver set them; and
  // on down, where it drives another.
  void follow(int64_t n, std::vector<double> lrs) {
    last_step_ = n;
    last_lr_ = std::move(lrs);
    stepped(n);
  }

  const char* name_;
  int64_t last_step_ = 0;
  std::vector<double> last_lr_;
};

// A scheduler whose options are one struct: a checkpoint keeps each field by its name (fields_of in
// optim/scheduler.cpp), and the options made or loaded pass the same checks (checked() there), or are refused. Its
// members are defined there for the options of this file's schedulers only (the extern templates below): a scheduler
// of one's own derives from LRScheduler.
template <typename Options> class LRSchedulerWith : public LRScheduler {
 protected:
  LRSchedulerWith(Optimizer& optimizer, const char* name, Options options);
  Options options_;

 private:
  NamedTensors options_tensors() const override;
  void load_options(const NamedTensors& named, std::vector<std::string>& errors) override;
};

// lr = base_lr * gamma^floor(n / step_size)
struct StepLROptions {
  int64_t step_size = 1;
  double gamma = 0.1;
};
class StepLR : public LRSchedulerWith<StepLROptions> {
 public:
  StepLR(Optimizer& optimizer, StepLROptions options);
  std::vector<double> lr_at(int64_t n) const override;
};

// lr = base_lr * gamma^(number of milestones <= n)
struct MultiStepLROptions {
  std::vector<int64_t> milestones;  // in any order; one given twice decays twice there (as PyTorch's)
  double gamma = 0.1;
};
class MultiStepLR : public LRSchedulerWith<MultiStepLROptions> {
 public:
  MultiStepLR(Optimizer& optimizer, MultiStepLROptions options);
  std::vector<double> lr_at(int64_t n) const override;
};

// lr = eta_min + (base_lr - eta_min) * (1 + cos(pi * n / T_max)) / 2      (PyTorch's closed form; periodic
// past T_max, as PyTorch's)
struct CosineAnnealingLROptions {
  int64_t T_max = 1;
  double eta_min = 0;
};
class CosineAnnealingLR : public LRSchedulerWith<CosineAnnealingLROptions> {
 public:
  CosineAnnealingLR(Optimizer& optimizer, CosineAnnealingLROptions options);
  std::vector<double> lr_at(int64_t n) const override;
};

// lr = base_lr * gamma^n
struct ExponentialLROptions {
  double gamma = NAN;  // to be given: PyTorch's has no default, and a forgotten gamma is refused, not guessed
};
class ExponentialLR : public LRSchedulerWith<ExponentialLROptions> {
 public:
  ExponentialLR(Optimizer& optimizer, ExponentialLROptions options);
  std::vector<double> lr_at(int64_t n) const override;
};

// lr = base_lr * (start_factor + (end_factor - start_factor) * min(n, total_iters) / total_iters): from start_factor
// of the base lr to end_factor of it in total_iters steps, then held (PyTorch's LinearLR and its defaults).
struct LinearLROptions {
  double start_factor = 1.0 / 3;  // in (0, 1]
  double end_factor = 1.0;        // in [0, 1]
  int64_t total_iters = 5;
};
class LinearLR : public LRSchedulerWith<LinearLROptions> {
 public:
  LinearLR(Optimizer& optimizer, LinearLROptions options);
  std::vector<double> lr_at(int64_t n) const override;
};

// lr = base_lr * factor for n < total_iters, then base_lr (PyTorch's ConstantLR and its defaults).
struct ConstantLROptions {
  double factor = 1.0 / 3;  // in [0, 1]
  int64_t total_iters = 5;  // positive: PyTorch's step() with 0 keeps base_lr * factor, its closed form base_lr
};
class ConstantLR : public LRSchedulerWith<ConstantLROptions> {
 public:
  ConstantLR(Optimizer& optimizer, ConstantLROptions options);
  std::vector<double> lr_at(int64_t n) const override;
};

// lr = base_lr * (1 - min(n, total_iters) / total_iters)^power: down to 0 in total_iters steps, then held
// (PyTorch's PolynomialLR and its defaults).
struct PolynomialLROptions {
  int64_t total_iters = 5;
  double power = 1.0;
};
class PolynomialLR : public LRSchedulerWith<PolynomialLROptions> {
 public:
  PolynomialLR(Optimizer& optimizer, PolynomialLROptions options);
  std::vector<double> lr_at(int64_t n) const override;
};

// lr = base_lr * factor(n), with one function of the step for every group or one per group (PyTorch's LambdaLR).
// A function is called for any step, again for the same one (set_step, loading, LinearWarmup): it must depend on
// the step alone. A checkpoint keeps the step and the base lrs, not the functions: the loading scheduler brings its
// own. A factor that is negative or not finite is refused, naming the step and the group.
class LambdaLR : public LRScheduler {
 public:
  using Factor = std::function<double(int64_t step)>;
  LambdaLR(Optimizer& optimizer, Factor factor);                         // the same function for every group
  LambdaLR(Optimizer& optimizer, std::vector<Factor> factors);           // one per group
  LambdaLR(Optimizer& optimizer, std::initializer_list<Factor> factors)  // {f, g}: one per group
      : LambdaLR(optimizer, std::vector<Factor>(factors)) {}
  std::vector<double> lr_at(int64_t n) const override;

 private:
  std::vector<Factor> factors_;  // one per group, or one for all
};

extern template class LRSchedulerWith<StepLROptions>;
extern template class LRSchedulerWith<MultiStepLROptions>;
extern template class LRSchedulerWith<CosineAnnealingLROptions>;
extern template class LRSchedulerWith<ExponentialLROptions>;
extern template class LRSchedulerWith<LinearLROptions>;
extern template class LRSchedulerWith<ConstantLROptions>;
extern template class LRSchedulerWith<PolynomialLROptions>;

// The 1cycle policy (Smith & Topin), as torch.optim.lr_scheduler.OneCycleLR and fastai's fit_one_cycle: the
// lr rises from max_lr / div_factor to max_lr over the first pct_start of the steps, then anneals to
// max_lr / div_factor / final_div_factor; the momentum moves the opposite way, max_momentum -> base_momentum
// -> max_momentum. PyTorch's defaults; fastai's fit_one_cycle is pct_start = 0.25, final_div_factor = 1e5.
// The constructor sets each group's lr to max_lr / div_factor (and momentum to max_momentum): the base lrs
// are not used. Stepping past total_steps is an error.
struct OneCycleLROptions {
  std::vector<double> max_lr;  // one value for every group, or one per group
  int64_t total_steps = 0;     // or, when 0, epochs * steps_per_epoch
  int64_t epochs = 0;
  int64_t steps_per_epoch = 0;
  double pct_start = 0.3;
  enum class Anneal { Cos, Linear } anneal_strategy = Anneal::Cos;  // in a checkpoint: 0 cos, 1 linear
  bool cycle_momentum = true;  // false for an optimizer without a momentum (Adagrad), which is refused otherwise
  double base_momentum = 0.85;
  double max_momentum = 0.95;
  double div_factor = 25;
  double final_div_factor = 1e4;
  bool three_phase = false;  // a third phase: back down to the initial lr, then to the minimum
};
class OneCycleLR : public LRScheduler {
 public:
  OneCycleLR(Optimizer& optimizer, OneCycleLROptions options);
  std::vector<double> lr_at(int64_t n) const override;
  std::vector<double> momentum_at(int64_t n) const override;
  int64_t total_steps() const { return total_steps_; }

 private:
  NamedTensors options_tensors() const override;
  void load_options(const NamedTensors& named, std::vector<std::string>& errors) override;
  // Checks the options and derives the schedule from them (total_steps_, max_lrs_, phases_), or throws leaving all.
  void configure(OneCycleLROptions options);
  struct Phase {
    double end_step;
    int start_lr, end_lr;              // indices into {initial, max, min}
    bool start_momentum_max, end_momentum_max;
  };
  // The phase step n is in and the fraction of it done.
  std::pair<const Phase*, double> locate(int64_t n) const;
  double anneal(double start, double end, double pct) const;

  OneCycleLROptions options_;
  int64_t total_steps_ = 0;
  std::vector<double> max_lrs_;
  std::vector<Phase> phases_;
};

// Linear warm-up: for n < warmup_steps, lr = target * (start_factor + (1 - start_factor) * n / warmup_steps);
// from warmup_steps on, the scheduler `after` runs from its own step 0 (n - warmup_steps), or the lr stays
// at the target when there is none. The target is `after`'s lr at its step 0, or the group's lr.
// start_factor 0 makes step 0 an update with lr 0 (as transformers' linear warm-up); PyTorch's LinearLR
// starts at 1/3.
struct LinearWarmupOptions {
  int64_t warmup_steps = 0;
  double start_factor = 0;
};
class LinearWarmup : public LRSchedulerWith<LinearWarmupOptions> {
 public:
  // `after` must drive the same optimizer; LinearWarmup owns it.
  LinearWarmup(Optimizer& optimizer, LinearWarmupOptions options, std::unique_ptr<LRScheduler> after = nullptr);
  std::vector<double> lr_at(int64_t n) const override;
  std::vector<double> momentum_at(int64_t n) const override;
  // Its own state and, as "after.<name>", that of the scheduler after the warm-up (whose base lrs its lr is made of).
  NamedTensors state_tensors() const override;
  void load_state_tensors(const NamedTensors& state) override;

 private:
  void stepped(int64_t n) override;  // `after` follows: its last_step() and get_last_lr() are those of its own steps
  std::unique_ptr<LRScheduler> after_;
};
extern template class LRSchedulerWith<LinearWarmupOptions>;

// Reduces each group's lr by `factor` once a metric has stopped improving, as PyTorch's
// torch.optim.lr_scheduler.ReduceLROnPlateau (libtorch's ReduceLROnPlateauScheduler). Not a closed form: what it does
// depends on the metrics it is given, so it is no LRScheduler and keeps a state of its own.
//
//   optim::ReduceLROnPlateau plateau(opt, {.patience = 2});
//   for (int epoch = 0; epoch < epochs; ++epoch) {
//     train_one_epoch(opt);
//     plateau.step(validation_loss());
//   }
//
// A metric is better than the best so far where, in mode Min, it is below best * (1 - threshold) (threshold_mode Rel)
// or best - threshold (Abs); in mode Max, above best * (1 + threshold) or best + threshold. NaN is never better. After
// more than `patience` steps without a better metric, each group's lr becomes max(lr * factor, min_lr), where that
// moves it by more than eps; then for `cooldown` steps no step counts as bad.
struct ReduceLROnPlateauOptions {
  enum class Mode { Min, Max } mode = Mode::Min;  // in a checkpoint: 0 min, 1 max
  double factor = 0.1;                            // in [0, 1)
  int64_t patience = 10;
  double threshold = 1e-4;
  enum class ThresholdMode { Rel, Abs } threshold_mode = ThresholdMode::Rel;  // in a checkpoint: 0 rel, 1 abs
  int64_t cooldown = 0;
  std::vector<double> min_lr = {0};  // one value for every group, or one per group
  double eps = 1e-8;
};
class ReduceLROnPlateau {
 public:
  ReduceLROnPlateau(Optimizer& optimizer, ReduceLROnPlateauOptions options = {});
  // One step with its metric (an epoch's validation loss, say): counts it against the best, and reduces the lrs when
  // due.
  void step(double metric);
  int64_t last_step() const { return last_step_; }               // step() calls so far
  const std::vector<double>& get_last_lr() const { return last_lr_; }  // each group's lr after the last step
  double best() const { return best_; }                          // before any step: +inf (Min) or -inf (Max)
  int64_t num_bad_steps() const { return num_bad_steps_; }       // steps since the best, the cooldown's not counted
  int64_t cooldown_counter() const { return cooldown_counter_; }  // cooldown steps left
  const ReduceLROnPlateauOptions& options() const { return options_; }

  // For checkpoints: "last_step", "best", "num_bad_steps", "cooldown_counter" and the options by their names (mode
  // and threshold_mode by their codes). Loading checks every entry before anything changes and replaces the options
  // with the state's, as PyTorch's load_state_dict; the lrs are the optimizer's state's.
  NamedTensors state_tensors() const;
  void load_state_tensors(const NamedTensors& state);
  const char* name() const { return "ReduceLROnPlateau"; }
  Optimizer& optimizer() const { return optimizer_; }

 private:
  bool is_better(double metric) const;
  double min_lr(size_t group) const;
  void record_lrs();  // last_lr_: each group's lr now

  Optimizer& optimizer_;
  ReduceLROnPlateauOptions options_;
  int64_t last_step_ = 0, num_bad_steps_ = 0, cooldown_counter_ = 0;
  double best_ = 0;
  std::vector<double> last_lr_;
};

}  // namespace halfgrad::optim

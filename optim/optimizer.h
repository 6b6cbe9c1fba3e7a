#pragma once
// Optimizers update parameters from their .grad, in place, without recording autograd.
//
// Who uses what:
//   a training loop    step(), zero_grad()
//   schedulers         param_group(g).lr and .momentum           (optim/scheduler.h)
//   amp::initialize    param_group(g).params: O2 replaces each parameter by its FP32 master copy before the
//                      first step; the optimizer then keeps its state for, and updates, the masters
//   checkpoints        state_tensors() / load_state_tensors()
//
// Each optimizer keeps its parameters in groups with their own options, as PyTorch's param_groups:
//
//   optim::SGD opt({{{backbone...}, {.lr = 0.01, .momentum = 0.9}},
//                   {{head...}, {.lr = 0.1, .momentum = 0.9}}});
//   opt.groups()[1].options.weight_decay = 5e-4;          // typed access (each optimizer's options struct)
//   opt.add_param_group({{classifier...}, {.lr = 0.1}});  // a group added later, checked as the constructor's
//   for (optim::ParamGroupRef g : opt.param_groups()) g.lr *= 0.1;   // generic access (any Optimizer)
//
// A step runs the fused kernels of optim/fused.h: one call per (group, device, dtype) that updates all those
// parameters in one pass over memory (one or a few kernel launches on CUDA, not one per parameter). LBFGS is the
// exception: a step of it is iterations over flat vectors, with a closure (optim/lbfgs.h).
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace halfgrad::optim {

struct StepTensors;  // optim/fused.h

// Named tensors, as a checkpoint stores them.
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// A group's momentum as ParamGroupRef reaches it: SGD's and RMSprop's momentum, Adam's and AdamW's beta1 (what OneCycle
// cycles, as PyTorch's OneCycleLR), or none (Adagrad). Read and written as a double; either fails, naming the
// optimizer, where there is none.
class MomentumRef {
 public:
  MomentumRef(double* value, const char* optimizer) : value_(value), optimizer_(optimizer) {}
  MomentumRef(const MomentumRef&) = default;
  bool exists() const { return value_ != nullptr; }
  operator double() const { return *checked(); }
  // `if (g.momentum)` would read the value (false at momentum 0) where "has one" was meant: exists() says that.
  explicit operator bool() const = delete;
  // Writes the value, as `lr` is written through a const ParamGroupRef too; from another group's momentum as well
  // (the default assignment would have re-pointed this one instead).
  const MomentumRef& operator=(double momentum) const {
    *checked() = momentum;
    return *this;
  }
  const MomentumRef& operator=(const MomentumRef& other) const { return *this = double(other); }

 private:
  double* checked() const;
  double* value_;
  const char* optimizer_;
};

// One parameter group seen through the options every optimizer has. The references point into the
// optimizer: writing them changes the optimizer (until the group list itself changes).
struct ParamGroupRef {
  TensorList& params;  // may be replaced (same shapes) before the first step: amp's FP32 master weights
  double& lr;
  MomentumRef momentum;
};

// An option of a parameter group besides lr and momentum, as a checkpoint keeps it: a number, an integer (kept as a
// float64 number: exact up to 2^53, and int64's largest, 2^63 - 1, read back as such from its rounding to 2^63) or a
// flag (one of the three pointers is set). `shapes_state`: the option decides which buffers a parameter
// keeps (Adam's amsgrad), so a checkpoint can only be loaded where it has the file's value. Each optimizer lists its
// own (other_options_of).
struct OptionField {
  const char* name;
  double* number = nullptr;
  int64_t* integer = nullptr;
  bool* flag = nullptr;
  bool shapes_state = false;
};

// What an optimizer keeps for one parameter between steps.
struct ParamState {
  int64_t step = 0;     // steps this parameter took with a gradient
  TensorList buffers;   // in the order of the optimizer's state_names(); undefined until first needed
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  const char* name() const { return name_; }  // "SGD", "Adam", ...: error messages start with it

  // Updates every parameter that has a gradient; parameters whose .grad is undefined are skipped (and their
  // step count does not advance), as in PyTorch.
  virtual void step() = 0;
  // step(), unless `found_inf` (a float32 0-d tensor: the loss scaler's overflow flag) is nonzero, in which case
  // nothing changes. Optimizers whose fused kernel reads the flag on the device (SGD) decide there, with no host
  // synchronisation; the others (Adam, RMSprop, Adagrad, whose hosts count their steps) read it first.
  virtual void step_unless(const Tensor& found_inf);
  // step_unless(found_inf) (step() where found_inf is undefined) with every gradient multiplied by `grad_scale` (a
  // float32 0-d tensor on the gradients' device): the loss scaler's unscaling and clipping's coefficient in one
  // (amp::GradScaler::clip_grad_norm_), or clipping's alone (amp::Amp::clip_grad_norm_ without a loss scaler).
  // SGD's fused kernel multiplies as it reads and leaves the gradient tensors as they are; the others multiply the
  // gradients in place first (one more pass).
  virtual void step_scaled(const Tensor& found_inf, const Tensor& grad_scale);
  // Forgets the gradients of every parameter. Like PyTorch (set_to_none=True) the gradient becomes
  // undefined rather than zero: the next backward stores instead of adding, which saves a pass.
  void zero_grad();
  // Every group's parameters, in group order.
  TensorList parameters() const;

  // ---- parameter groups, for code that works with any optimizer
  virtual size_t num_param_groups() const = 0;
  virtual ParamGroupRef param_group(size_t g) = 0;
  std::vector<ParamGroupRef> param_groups();
  // Group g's lr before any scheduler set it, PyTorch's param_group["initial_lr"]: the first LRScheduler made on this
  // optimizer records each group's lr, and every scheduler takes the recorded one as its base, so that a scheduler
  // made after another has set its step 0 (a warm-up's start_factor) starts from the same lr, not from that one's
  // (OneCycleLR records its own start, max_lr / div_factor, as PyTorch's). Nothing until a scheduler records it; kept
  // in the optimizer's state (state_tensors), so a scheduler made after a resume starts from it too.
  std::optional<double> initial_lr(size_t g) const;
  void set_initial_lr(size_t g, double lr);

  // ---- state, for checkpoints. Names (stable; <g> the group, <p> the parameter's index in its group):
  //   param_groups.<g>.lr            0-d float64   the hyperparameters schedulers change
  //   param_groups.<g>.initial_lr    0-d float64   initial_lr(g), where a scheduler has recorded it (a load without
  //                                                it leaves none, as PyTorch's load_state_dict)
  //   param_groups.<g>.momentum      0-d float64   (Adam/AdamW: beta1; none for Adagrad, which has no momentum)
  //   param_groups.<g>.<option>      0-d float64   every other option of the group, as PyTorch's param_groups:
  //                                  or 0-d bool   SGD's dampening, weight_decay, nesterov; Adam's beta2, eps,
  //                                                weight_decay, amsgrad; RMSprop's alpha, eps, weight_decay,
  //                                                centered; Adagrad's lr_decay, weight_decay,
  //                                                initial_accumulator_value, eps; LBFGS's max_iter,
  //                                                max_eval, tolerance_grad, tolerance_change, history_size,
  //                                                strong_wolfe (its integers read from int64 tensors too)
  //   param_groups.<g>.with_state    int64 [n]     the indices <p> of the group's parameters that have state
  //   param_groups.<g>.num_params    0-d int64     how many parameters the group has (a load into a group of
  //                                                another size is refused, as PyTorch's; older files lack it)
  //   state.<g>.<p>.step             0-d int64     optimizers that count steps (Adam, AdamW, RMSprop, Adagrad)
  //   state.<g>.<p>.<buffer>         the parameter's shape and dtype: momentum_buffer (SGD); exp_avg,
  //                                  exp_avg_sq, max_exp_avg_sq (Adam/AdamW, the last with amsgrad); square_avg,
  //                                  grad_avg, momentum_buffer (RMSprop: the last two made when an option first
  //                                  needs them, and kept when it is turned off); sum (Adagrad)
  //   state.<name>                   the optimizer's own state, of no one parameter (LBFGS: optim/lbfgs.h)
  // A parameter has entries only once it has state (after its first step with a gradient). Indices are plain
  // decimals ("0", "12"; not "00").
  // The tensors are the optimizer's own, not copies (as PyTorch's state_dict): write them out before the
  // next step changes them.
  NamedTensors state_tensors() const;
  // Replaces the whole state by `state` (tensors are copied to each parameter's device), the groups' options
  // included, as PyTorch's load_state_dict: the file's weight_decay replaces the constructor's. Everything is
  // checked before anything changes: unknown names, groups or parameters that do not exist, shapes and
  // dtypes that differ from the parameter's, a parameter with part of its state (optional buffers, RMSprop's grad_avg
  // and momentum_buffer, may be absent), missing group entries, options the
  // constructor would refuse, an option that decides the state's buffers (amsgrad) unlike the optimizer's, and
  // a parameter that with_state lists without its state in the file (renamed or dropped: it would otherwise
  // restart from none) or the other way round. One Error lists every mismatch. A file without with_state
  // (written before it existed) loads with a warning that this cannot be checked; one without a group's other
  // options (written before they were kept) keeps the constructor's, with a warning.
  void load_state_tensors(const NamedTensors& state);

  // Per-parameter state, [group][param]; grows as groups do.
  ParamState& state(size_t group, size_t param);

 protected:
  explicit Optimizer(const char* name) : name_(name) {}
  virtual const TensorList& group_params(size_t g) const = 0;
  // The buffers each parameter of group g keeps (in ParamState::buffers order).
  virtual std::vector<std::string> state_names(size_t g) const = 0;
  // How many of them, from the first, every parameter with state has; the rest are made when an option first needs
  // them, and kept (RMSprop's grad_avg and momentum_buffer). A checkpoint holds all of the first or none.
  virtual size_t required_buffers(size_t g) const { return state_names(g).size(); }
  // Whether ParamState::step is part of the state (Adam's bias correction needs it; SGD's does not).
  virtual bool counts_steps() const = 0;
  // The optimizer's own state, of no one parameter (LBFGS's history): state_tensors() writes it as "state.<name>";
  // load_state_tensors() hands the file's "state.<name>" entries (named without "state.") to own_state_errors, which
  // lists what is wrong with them (checked with everything else, before anything changes) given each group's other
  // options as the load sets them (the file's, else the optimizer's), then to load_own_state. None by default: every
  // such entry is unexpected.
  virtual NamedTensors own_state() const { return {}; }
  virtual std::vector<std::string> own_state_errors(const NamedTensors& entries,
                                                    const std::vector<std::map<std::string, double>>& options) const;
  virtual void load_own_state(const NamedTensors& entries) { (void)entries; }
  // Group g's options besides lr and momentum, by name, with their values (a flag as 0 or 1).
  struct OtherOption {
    std::string name;
    double value;
    bool flag, shapes_state;
    bool integer = false;  // a whole number within int64's range
  };
  virtual std::vector<OtherOption> other_options(size_t g) const = 0;
  // Why group g cannot take a loaded lr, momentum and other options (the constructor's checks of its options with
  // them; an option missing from `others` keeps its value), or "".
  virtual std::string refusal(size_t g, double lr, double momentum,
                              const std::map<std::string, double>& others) const = 0;
  // Sets group g's options to those, which refusal accepted.
  virtual void set_options(size_t g, double lr, double momentum, const std::map<std::string, double>& others) = 0;

  // Checks that there is a parameter at all, and that every parameter is a floating leaf (one that requires no grad,
  // frozen, is taken and skipped) and appears in one group only.
  void check_parameters() const;

  // One parameter of a step, as a fused kernel takes it: 1-D views of its storage in memory order, so that a
  // parameter laid out in any format (a channels_last convolution weight, an aligned-rows decoder weight, whose zero
  // padding its gradient and state share and keep at zero) is updated where it is.
  struct StepItem {
    size_t index;         // the parameter's index in its group
    Tensor param;         // the parameter's storage (flat_storage_view), or that of a copy when it is in no format
    Tensor grad;          // the gradient, laid out as `param`, element for element
    Tensor parameter;     // the parameter as the model holds it
    MemoryFormat format;  // the layout of `param`: the parameter's, or Contiguous for a copy
    bool copied = false;  // `param` is a copy that write_back() copies into `parameter`
    // Autocast's kept cast of the parameter (core/autocast.h), as `param` is laid out, for the kernel to write the new
    // value's cast into; undefined where there is none, it is stale, held elsewhere too, laid out otherwise, or of
    // another dtype than the bucket's first cast.
    Tensor cast;
  };
  // The checks of each parameter that a step makes (its gradient, its existing state buffers), over all groups,
  // before anything changes: a step that fails them leaves no group stepped, no count raised and no buffer made.
  // The fused optimizers' steps (SGD, Adam/AdamW, RMSprop, Adagrad) and step_scaled call it first.
  void check_step();
  // step_unless's checks of its overflow flag (a float32 0-d tensor, no capture: this base steps on the host).
  void check_found_inf(const Tensor& found_inf) const;
  // The parameters of group g that have a gradient, split by (device, dtype): the lists of one fused kernel
  // call each. Checks each gradient against its parameter and bumps the parameter's version counter (the
  // step writes it in place, so a graph that saved it can no longer use it); marks each item's cast current, so the
  // step must hand every item to a kernel through add_tensors.
  std::vector<std::vector<StepItem>> step_items(size_t g);
  // Appends the item's parameter, gradient and cast to a kernel's arguments.
  static void add_tensors(StepTensors& args, const StepItem& item);
  static void write_back(const std::vector<StepItem>& items);
  // The state buffer k of parameter `item` of group g as the kernel takes it (a flat view, element for element with
  // item.param), created (zeros) when it does not exist yet; `created` tells which. The buffer is kept in the
  // parameter's shape and layout (a buffer loaded in another layout is laid out again once). Checks that an existing
  // buffer still matches the parameter.
  Tensor state_buffer(size_t g, const StepItem& item, size_t k, bool* created = nullptr);

 private:
  void check_gradient(size_t g, size_t p, const Tensor& param, const Tensor& grad) const;
  void check_buffer(size_t g, size_t p, size_t k, const Tensor& buffer, const Tensor& param) const;

  const char* name_;
  std::vector<std::vector<ParamState>> state_;
  std::vector<std::optional<double>> initial_lrs_;  // by group
};

// A loaded integer option's value, a whole number in [-2^63, 2^63] (load_state_tensors checks): int64's largest for
// 2^63, the rounding of 2^63 - 1 to float64.
int64_t whole_number(double value);

// An optimizer's check of an option that must not be negative (nor NaN): "<optimizer>: invalid <option> <value> (group
// <g>): must be >= 0".
void check_not_negative(const char* optimizer, const char* option, double value, size_t g);

// Parameters that share options.
template <typename Options> struct Group {
  TensorList params;
  Options options;
};

// The base of optimizers whose groups hold an `Options` struct with a `double lr`, whose
// `double* momentum_of(Options&)` names what ParamGroupRef::momentum refers to (nullptr: none), and whose
// `std::vector<OptionField> other_options_of(Options&)` lists the rest.
template <typename Options> class OptimizerWith : public Optimizer {
 public:
  // The groups, their options and parameters in place (edits are the caller's and unchecked, as PyTorch's
  // param_groups); a new group comes through add_param_group, which checks it.
  std::span<Group<Options>> groups() { return groups_; }
  std::span<const Group<Options>> groups() const { return groups_; }

  // As PyTorch's add_param_group: a group checked as the constructor checks its groups (its options, and parameters
  // in no other group), or an error that leaves the optimizer as it was. It invalidates the spans groups() gave, and
  // a scheduler made before it refuses to step (it holds a base lr for each group it saw).
  void add_param_group(Group<Options> group) {
    groups_.push_back(std::move(group));
    try {
      check_group_options(groups_.back().options, groups_.size() - 1);
      check_parameters();
    } catch (...) {
      groups_.pop_back();
      throw;
    }
  }

  size_t num_param_groups() const override { return groups_.size(); }
  ParamGroupRef param_group(size_t g) override {
    HG_CHECK(g < groups_.size(), "{}: no parameter group {} (it has {})", name(), g, groups_.size());
    Group<Options>& group = groups_[g];
    return {group.params, group.options.lr, MomentumRef(momentum_of(group.options), name())};
  }

 protected:
  OptimizerWith(const char* name, std::vector<Group<Options>> groups) : Optimizer(name), groups_(std::move(groups)) {}
  const TensorList& group_params(size_t g) const override { return groups_.at(g).params; }
  // The optimizer's own checks of a group's options (its constructor's); throw on a bad value.
  virtual void check_group_options(const Options& options, size_t g) const = 0;
  std::vector<OtherOption> other_options(size_t g) const override {
    Options options = groups_.at(g).options;
    std::vector<OtherOption> out;
    for (const OptionField& f : other_options_of(options)) {
      const double value = f.number ? *f.number : f.integer ? double(*f.integer) : double(*f.flag);
      out.push_back({f.name, value, f.flag != nullptr, f.shapes_state, f.integer != nullptr});
    }
    return out;
  }
  std::string refusal(size_t g, double lr, double momentum,
                      const std::map<std::string, double>& others) const override {
    try {
      check_group_options(with(groups_.at(g).options, lr, momentum, others), g);
    } catch (const Error& e) {
      return e.what();
    }
    return {};
  }
  void set_options(size_t g, double lr, double momentum, const std::map<std::string, double>& others) override {
    groups_.at(g).options = with(groups_.at(g).options, lr, momentum, others);
  }
  static Options with(Options options, double lr, double momentum, const std::map<std::string, double>& others) {
    options.lr = lr;
    if (double* m = momentum_of(options)) *m = momentum;
    for (const OptionField& f : other_options_of(options)) {
      const auto it = others.find(f.name);
      if (it == others.end()) continue;
      if (f.number) *f.number = it->second;
      else if (f.integer) *f.integer = whole_number(it->second);
      else *f.flag = it->second != 0;
    }
    return options;
  }

  std::vector<Group<Options>> groups_;
};

}  // namespace halfgrad::optim

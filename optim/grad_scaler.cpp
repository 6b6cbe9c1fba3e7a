#include "optim/grad_scaler.h"

#include <cmath>
#include <limits>

#include "core/autograd.h"
#include "core/cuda.h"
#include "core/log.h"
#include "dist/process_group.h"
#include "ops/elementwise.h"
#include "ops/reduce.h"
#include "ops/shape.h"
#include "optim/clip_grad.h"
#include "optim/option_tensors.h"

namespace halfgrad::amp {

KernelTable<UnscaleKernel> unscale_kernel("unscale_and_check");
KernelTable<UpdateScaleKernel> update_scale_kernel("update_scale");

namespace {
constexpr int64_t kDiagnosisInterval = 100;  // updates between two host reads of the scale

// The scale and its inverse (the unscaling factor) are float32: both must be finite there, and nonzero. A scale of
// 2^-128 or below has an infinite inverse, which unscales a zero gradient to nan.
void check_scale(double scale, std::string_view who) {
  const float f = float(scale);
  HG_CHECK(f > 0 && std::isfinite(f) && std::isfinite(1.0f / f),
           "{}: invalid scale {} (the scale and its inverse are float32: both positive and finite there, so the "
           "scale lies in (2.9e-39, 3.4e38])", who, scale);
}

// In float32, as the scale is kept and clamped: a scale at min_scale reads back rounded to float32, and loads again.
bool within_bounds(double scale, const GradScalerOptions& o) {
  return float(o.min_scale) <= float(scale) && float(scale) <= float(o.max_scale);
}

// The constructor's checks of the options that move the scale, and load_state_tensors' of those a checkpoint brings
// (`who` names the caller). As the scale, the factors are float32 in the update: checked there (a backoff_factor of
// 1 - 1e-9 is 1 in float32, and would never back off). The clean-step count is an int32 on the device.
void check_options(const GradScalerOptions& o, const char* who) {
  HG_CHECK(float(o.growth_factor) > 1 && std::isfinite(float(o.growth_factor)),
           "{}: growth_factor must be > 1 and finite in float32, got {}", who, o.growth_factor);
  HG_CHECK(float(o.backoff_factor) > 0 && float(o.backoff_factor) < 1,
           "{}: backoff_factor must be in (0, 1) in float32, got {}", who, o.backoff_factor);
  HG_CHECK(o.growth_interval > 0 && o.growth_interval <= std::numeric_limits<int32_t>::max(),
           "{}: growth_interval must be in [1, 2^31 - 1], got {}", who, o.growth_interval);
  check_scale(o.min_scale, fmt::format("{} (min_scale)", who));
  check_scale(o.max_scale, fmt::format("{} (max_scale)", who));
}
}  // namespace

GradScaler::GradScaler(GradScalerOptions options) : options_(options) {
  check_options(options, "GradScaler");
  check_scale(options.init_scale, "GradScaler (init_scale)");
  HG_CHECK(within_bounds(options.init_scale, options),
           "GradScaler: init_scale {} outside [min_scale {}, max_scale {}]", options.init_scale, options.min_scale,
           options.max_scale);
  pending_.scale = options.init_scale;
}

void GradScaler::place_state(Device device) {
  if (scale_.defined()) return;
  // Made in a capture, every replay would start again from the initial scale.
  HG_CHECK(!cuda::is_capturing(device), "GradScaler: its state is created on the first scale() or unscale_(), inside a "
           "CUDA graph capture here; run the step eagerly first (cuda::CapturedStep does)");
  scale_ = full({}, pending_.scale, {.dtype = kFloat32, .device = device});
  growth_tracker_ = full({}, double(pending_.growth_tracker), {.dtype = kInt32, .device = device});
  skipped_ = zeros({}, {.dtype = kInt64, .device = device});
}

Tensor GradScaler::scale_on(Device device) {
  place_state(device);
  return scale_.to(device);
}

Tensor GradScaler::scale(const Tensor& loss) {
  if (!options_.enabled) return loss;
  HG_CHECK(loss.is_floating_point(), "GradScaler::scale: the loss must be floating point, got {}", loss.meta());
  {
    NoGradGuard no_grad;
    loss_was_finite_.push_back(isfinite(loss.detach()).all());
  }
  // In float32 (or the loss's wider dtype): a float16 loss times 65536 would overflow on its own.
  return loss.to(promote_types(loss.dtype(), kFloat32)) * scale_on(loss.device());
}

GradScaler::PerOptimizer& GradScaler::per_optimizer(optim::Optimizer& optimizer) { return per_optimizer_[&optimizer]; }

void GradScaler::unscale_(optim::Optimizer& optimizer) {
  if (!options_.enabled) return;
  PerOptimizer& p = per_optimizer(optimizer);
  HG_CHECK(!p.unscaled, "GradScaler::unscale_: already called on this optimizer since the last update()");
  HG_CHECK(!p.stepped, "GradScaler::unscale_: called after step(); call update() first");
  NoGradGuard no_grad;
  // Group the gradients by (device, dtype): one fused pass per group.
  std::map<std::pair<Device, DType>, TensorList> groups;
  std::vector<std::pair<Tensor, Tensor>> copied;  // (gradient in no dense layout, its contiguous copy)
  last_parameters_ = optimizer.parameters();
  for (const Tensor& param : last_parameters_) {
    Tensor g = param.grad();
    if (!g.defined()) continue;
    // Before any gradient is unscaled: one that cannot be written back would leave the others unscaled twice later.
    HG_CHECK(!has_internal_overlap(g), "GradScaler::unscale_: the gradient {} of a parameter is an expanded view, "
             "whose elements share memory; give the parameter a gradient of its own (clone())", g.meta());
    // A gradient dense in any layout (channels_last) is unscaled in place, as the 1-D view of its storage; another
    // (set by hand, a transposed view) through a contiguous copy, written back.
    Tensor flat;
    if (storage_format(g)) {
      flat = flat_storage_view(g);
    } else {
      copied.emplace_back(g, g.contiguous());
      flat = copied.back().second;
    }
    groups[{g.device(), g.dtype()}].push_back(flat);
  }
  std::map<Device, Tensor> flags;
  for (auto& [key, grads] : groups) {
    Device device = key.first;
    if (!flags.count(device)) flags[device] = zeros({}, {.device = device});
    unscale_kernel[device](grads, scale_on(device), flags[device]);
  }
  for (auto& [grad, copy] : copied) grad.copy_(copy);
  for (auto& [device, flag] : flags) p.found_inf.push_back(flag);
  agree_on_overflow(p);
  p.unscaled = true;
}

void GradScaler::set_process_group(std::shared_ptr<dist::ProcessGroup> group) { group_ = std::move(group); }

void GradScaler::agree_on_overflow(PerOptimizer& p) const {
  if (!group_ || group_->size() == 1) return;
  // A rank without gradients (or without a scale yet) still joins, with 0.
  Tensor flag = scale_.defined() ? found_inf(p).to(group_->device()) : zeros({}, {.device = group_->device()});
  group_->all_reduce(flag, dist::ReduceOp::Max)->wait();
  p.found_inf = {flag};
}

Tensor GradScaler::clip_grad_norm_(optim::Optimizer& optimizer, double max_norm, double norm_type) {
  if (!options_.enabled) return optim::clip_grad_norm_(optimizer.parameters(), max_norm, norm_type);
  PerOptimizer& p = per_optimizer(optimizer);
  HG_CHECK(!p.unscaled, "GradScaler::clip_grad_norm_: the gradients were already unscaled or clipped (unscale_, "
           "clip_grad_norm_) since the last update()");
  HG_CHECK(!p.stepped, "GradScaler::clip_grad_norm_: called after step(); call update() first");
  NoGradGuard no_grad;
  last_parameters_ = optimizer.parameters();
  const Tensor scaled_norm = optim::grad_norm(last_parameters_, norm_type);
  p.unscaled = true;
  bool any_grad = false;
  for (const Tensor& param : last_parameters_) any_grad = any_grad || param.grad().defined();
  if (!any_grad) {
    agree_on_overflow(p);
    return scaled_norm;
  }
  const Tensor scale = scale_on(scaled_norm.device());
  const Tensor norm = scaled_norm / scale;
  p.found_inf.push_back(logical_not(isfinite(scaled_norm)).to(kFloat32));
  agree_on_overflow(p);
  p.grad_scale = (optim::clip_coefficient(norm, max_norm) / scale).to(kFloat32);
  return norm;
}

Tensor GradScaler::found_inf(const PerOptimizer& p) const {
  Tensor total;
  for (const Tensor& flag : p.found_inf) {
    Tensor f = flag.to(scale_.device());
    total = total.defined() ? maximum(total, f) : f;
  }
  return total.defined() ? total : zeros({}, {.device = scale_.device()});
}

void GradScaler::step(optim::Optimizer& optimizer) {
  if (!options_.enabled) {
    optimizer.step();
    return;
  }
  PerOptimizer& p = per_optimizer(optimizer);
  HG_CHECK(!p.stepped, "GradScaler::step: step() was already called on this optimizer since the last update()");
  if (!p.unscaled) unscale_(optimizer);
  if (!scale_.defined()) {  // no gradient and no loss seen: nothing can have overflowed
    optimizer.step();
    p.stepped = true;
    return;
  }
  // As PyTorch: an optimizer none of whose parameters has a gradient had nothing checked, and its step would count
  // as a clean one.
  HG_CHECK(!p.found_inf.empty(), "GradScaler::step: no inf checks were recorded for this optimizer: none of its {} "
           "parameter(s) has a gradient (call backward() on the scaled loss first)", optimizer.parameters().size());
  NoGradGuard no_grad;
  if (p.grad_scale.defined())
    optimizer.step_scaled(found_inf(p), p.grad_scale);
  else
    optimizer.step_unless(found_inf(p));
  p.stepped = true;  // once it ran: a step that failed (and changed nothing) may be called again, as PyTorch's
}

void GradScaler::forget_unscale(optim::Optimizer& optimizer) {
  auto it = per_optimizer_.find(&optimizer);
  if (it != per_optimizer_.end() && !it->second.stepped) per_optimizer_.erase(it);
}

void GradScaler::update() {
  if (!options_.enabled) return;
  if (scale_.defined()) {
    // As PyTorch: a step whose gradients were never checked for infinities must not count as a clean one.
    bool checked = false;
    for (const auto& [opt, p] : per_optimizer_) checked = checked || !p.found_inf.empty();
    if (!checked) {
      per_optimizer_.clear();  // this iteration's records end with the refusal, as they would with an update
      loss_was_finite_.clear();
      HG_FAIL("GradScaler::update: no inf checks were recorded since the last update(): call step(optimizer) (or "
              "unscale_) first, after a backward() that gave the optimizer's parameters gradients");
    }
    NoGradGuard no_grad;
    Tensor overflow;
    for (auto& [opt, p] : per_optimizer_) {
      Tensor f = found_inf(p);
      overflow = overflow.defined() ? maximum(overflow, f) : f;
    }
    captured_update_ = captured_update_ || cuda::is_capturing(scale_.device());
    update_scale_kernel[scale_.device()]({.scale = scale_,
                                          .growth_tracker = growth_tracker_,
                                          .skipped = skipped_,
                                          .found_inf = overflow,
                                          .growth_factor = options_.growth_factor,
                                          .backoff_factor = options_.backoff_factor,
                                          .min_scale = options_.min_scale,
                                          .max_scale = options_.max_scale,
                                          .growth_interval = options_.growth_interval,
                                          .dynamic = options_.dynamic});
    ++updates_;
    look_at_scale(overflow);
  }
  per_optimizer_.clear();
  loss_was_finite_.clear();
}

// The host looks at the scale every kDiagnosisInterval updates (starting with the first), one read for both uses and
// never inside a capture: once the scale is below warn_below_scale it diagnoses the next overflowing step (looking at
// every update until one comes), and a dynamic scale seen at its floor is said once.
void GradScaler::look_at_scale(const Tensor& overflow) {
  if (cuda::is_capturing(scale_.device())) return;
  const bool diagnose = diagnosis_.empty(), floor = floor_warning_.empty() && options_.dynamic;
  if (((diagnose && !watching_) || floor) && updates_ % kDiagnosisInterval == 1 % kDiagnosisInterval) {
    const float scale = scale_.item<float>();
    if (diagnose && !watching_) watching_ = scale < options_.warn_below_scale;
    if (floor && scale <= float(options_.min_scale)) {
      floor_warning_ = fmt::format(
          "GradScaler: the loss scale reached its floor, min_scale {}: gradients overflow even with the loss scaled "
          "that far down, and those steps are skipped (the model has most likely diverged: a lower lr, gradient "
          "clipping, or float32 for the overflowing ops may help)", options_.min_scale);
      logger().warn(floor_warning_);
    }
  }
  if (diagnose && watching_ && overflow.item<float>() != 0) {
    diagnose_overflow();
    watching_ = false;
  }
}

double GradScaler::get_scale() const { return scale_.defined() ? double(scale_.item<float>()) : pending_.scale; }

GradScalerState GradScaler::state() const {
  if (!scale_.defined()) return pending_;
  return {.scale = get_scale(), .growth_tracker = int64_t(growth_tracker_.item<int32_t>())};
}

int64_t GradScaler::skipped_steps() const { return skipped_.defined() ? skipped_.item<int64_t>() : 0; }

void GradScaler::load_state(const GradScalerState& state) {
  check_scale(state.scale, "GradScaler::load_state");
  HG_CHECK(within_bounds(state.scale, options_),
           "GradScaler::load_state: scale {} outside [min_scale {}, max_scale {}], where dynamic scaling keeps it",
           state.scale, options_.min_scale, options_.max_scale);
  HG_CHECK(state.growth_tracker >= 0 && state.growth_tracker < options_.growth_interval,
           "GradScaler::load_state: growth_tracker {} outside [0, {})", state.growth_tracker, options_.growth_interval);
  pending_ = state;
  if (scale_.defined()) {
    scale_.fill_(state.scale);
    growth_tracker_.fill_(double(state.growth_tracker));
  }
}

namespace {
// The scaler's entries in a checkpoint, "scaler." before each name: its state, and the options that decide how the
// scale moves from here (PyTorch's GradScaler.state_dict keeps growth_factor, backoff_factor and growth_interval).
constexpr std::string_view kPrefix = "scaler.";
std::vector<optim::NamedOption> fields_of(GradScalerState& s) {
  return {{"scale", &s.scale}, {"growth_tracker", &s.growth_tracker}};
}
std::vector<optim::NamedOption> fields_of(GradScalerOptions& o) {
  return {{"growth_factor", &o.growth_factor}, {"backoff_factor", &o.backoff_factor},
          {"growth_interval", &o.growth_interval}, {"min_scale", &o.min_scale},
          {"max_scale", &o.max_scale}, {"dynamic", &o.dynamic}};
}
}  // namespace

std::vector<std::pair<std::string, Tensor>> GradScaler::state_tensors() const {
  GradScalerState s = state();
  GradScalerOptions o = options_;
  optim::NamedTensors named = optim::option_tensors(fields_of(s), kPrefix);
  for (auto& entry : optim::option_tensors(fields_of(o), kPrefix)) named.push_back(std::move(entry));
  return named;
}

void GradScaler::load_state_tensors(const std::vector<std::pair<std::string, Tensor>>& named) {
  const char* who = "GradScaler::load_state_tensors";
  GradScalerState s;
  GradScalerOptions o = options_;
  std::vector<std::string> errors;
  for (const std::string& name : optim::read_option_tensors(fields_of(s), named, errors, kPrefix))
    errors.push_back(fmt::format("missing '{}'", name));
  const std::vector<std::string> missing = optim::read_option_tensors(fields_of(o), named, errors, kPrefix);
  if (!errors.empty()) optim::fail_loading(who, "scaler state", errors);
  check_options(o, who);
  // A captured update() holds the options as its kernel's arguments: replays would go on with the old ones.
  HG_CHECK(!captured_update_ || o == options_, "{}: the state's options differ from this scaler's, and its update() "
           "is captured in a CUDA graph, whose replays would keep the old ones: load before the first captured step",
           who);
  const GradScalerOptions previous = options_;
  options_ = o;
  try {
    load_state(s);
  } catch (...) {
    options_ = previous;
    throw;
  }
  if (!missing.empty() && options_.enabled)  // a disabled scaler's options move nothing
    logger().warn("{}: the state has no {} (a file written before the options were kept): this scaler's stay", who,
                  fmt::join(missing, ", "));
}

void GradScaler::set_parameter_names(std::vector<std::pair<std::string, Tensor>> named) { names_ = std::move(named); }

// The "my loss is NaN" question, answered once: was the loss itself already inf/NaN (the forward pass
// overflowed: scaling cannot help), or did a gradient overflow (and which parameter's first)?
void GradScaler::diagnose_overflow() {
  NoGradGuard no_grad;
  bool forward_overflow = false;
  for (const Tensor& finite : loss_was_finite_) forward_overflow = forward_overflow || !finite.item<bool>();
  if (forward_overflow) {
    diagnosis_ = fmt::format("GradScaler: the loss scale fell to {} because the loss itself is inf/NaN: the forward "
                             "pass overflowed (run the overflowing ops in float32, e.g. through autocast's float32 "
                             "rule, or lower the learning rate); loss scaling cannot fix this", get_scale());
    logger().warn(diagnosis_);
    return;
  }
  std::string culprit = "(none found: the overflow came from another optimizer's parameters)";
  for (size_t i = 0; i < last_parameters_.size(); ++i) {
    Tensor g = last_parameters_[i].grad();
    if (!g.defined() || isfinite(g).all().item<bool>()) continue;
    culprit = fmt::format("parameter #{} {}", i, last_parameters_[i].meta());
    for (const auto& [name, t] : names_)
      if (t.same(last_parameters_[i])) culprit = fmt::format("'{}' {}", name, t.meta());
    break;
  }
  diagnosis_ = fmt::format("GradScaler: the loss scale fell to {} after repeated gradient overflow; the first "
                           "parameter whose gradient overflowed is {}. The loss was finite, so the backward pass "
                           "overflowed: look for ops that run in float16 with large gradients there",
                           get_scale(), culprit);
  logger().warn(diagnosis_);
}

namespace {
void unscale_cpu(const TensorList& grads, const Tensor& scale, const Tensor& found_inf) {
  const float inv = 1.0f / scale.item<float>();
  bool any_bad = false;
  for (const Tensor& g : grads) {
    HG_CHECK(g.is_contiguous(), "unscale_: gradient {} is not contiguous", g.meta());
    dispatch_floating(g.dtype(), "unscale_", [&]<typename T>() {
      T* data = g.data<T>();
      const int64_t n = g.numel();
      bool bad = false;
      // One pass: scale and test together; the test is folded into a reduction the compiler vectorises.
#pragma omp parallel for reduction(|| : bad) if (n > 65536)
      for (int64_t i = 0; i < n; ++i) {
        // Tested as stored: a scale below 1 multiplies float16 gradients up, past float16's range.
        const T v = T(opmath_t<T>(data[i]) * opmath_t<T>(inv));
        bad = bad || !std::isfinite(opmath_t<T>(v));
        data[i] = v;
      }
      any_bad = any_bad || bad;
    });
    g.storage()->bump_version();
  }
  if (any_bad) {
    Tensor flag = found_inf;
    flag.fill_(1);
  }
}

// As the CUDA kernel (grad_scaler.cu), in float32.
void update_scale_cpu(const UpdateScaleArgs& a) {
  update_scale_rule(*a.scale.data<float>(), *a.growth_tracker.data<int32_t>(), *a.skipped.data<int64_t>(),
                    *a.found_inf.data<float>() != 0, float(a.growth_factor), float(a.backoff_factor),
                    float(a.min_scale), float(a.max_scale), a.growth_interval, a.dynamic);
  for (const Tensor* t : {&a.scale, &a.growth_tracker, &a.skipped}) t->storage()->bump_version();
}
}  // namespace

HG_REGISTER_KERNEL(unscale_kernel, CPU, unscale_cpu);
HG_REGISTER_KERNEL(update_scale_kernel, CPU, update_scale_cpu);

}  // namespace halfgrad::amp

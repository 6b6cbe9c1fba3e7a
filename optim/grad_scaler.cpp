#include "optim/grad_scaler.h"

#include <cmath>

#include "core/autograd.h"
#include "core/log.h"
#include "ops/elementwise.h"
#include "ops/reduce.h"

namespace halfgrad::amp {

KernelTable<UnscaleKernel> unscale_kernel("unscale_and_check");

GradScaler::GradScaler(GradScalerOptions options) : options_(options) {
  HG_CHECK(options.init_scale > 0 && std::isfinite(options.init_scale), "GradScaler: init_scale must be positive, got {}",
           options.init_scale);
  HG_CHECK(options.growth_factor > 1, "GradScaler: growth_factor must be > 1, got {}", options.growth_factor);
  HG_CHECK(options.backoff_factor > 0 && options.backoff_factor < 1, "GradScaler: backoff_factor must be in (0, 1), got {}",
           options.backoff_factor);
  HG_CHECK(options.growth_interval > 0, "GradScaler: growth_interval must be positive, got {}", options.growth_interval);
  state_.scale = options.init_scale;
}

Tensor GradScaler::scale_on(Device device) {
  auto it = scale_tensors_.find(device);
  if (it == scale_tensors_.end()) it = scale_tensors_.emplace(device, full({}, state_.scale, {.device = device})).first;
  return it->second;
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
  last_parameters_ = optimizer.parameters();
  for (const Tensor& param : last_parameters_) {
    Tensor g = param.grad();
    if (g.defined()) groups[{g.device(), g.dtype()}].push_back(g);
  }
  std::map<Device, Tensor> flags;
  for (auto& [key, grads] : groups) {
    Device device = key.first;
    if (!flags.count(device)) flags[device] = zeros({}, {.device = device});
    Tensor inv_scale = full({}, 1.0 / state_.scale, {.device = device});  // exact: the scale is a power of two
    unscale_kernel[device](grads, inv_scale, flags[device]);
  }
  for (auto& [device, flag] : flags) p.found_inf.push_back(flag);
  p.unscaled = true;
}

bool GradScaler::found_inf(const PerOptimizer& p) const {
  for (const Tensor& flag : p.found_inf)
    if (flag.item<float>() != 0) return true;
  return false;
}

bool GradScaler::step(optim::Optimizer& optimizer) {
  if (!options_.enabled) {
    optimizer.step();
    return true;
  }
  PerOptimizer& p = per_optimizer(optimizer);
  HG_CHECK(!p.stepped, "GradScaler::step: step() was already called on this optimizer since the last update()");
  if (!p.unscaled) unscale_(optimizer);
  p.stepped = true;
  if (found_inf(p)) return false;
  optimizer.step();
  return true;
}

void GradScaler::update() {
  if (!options_.enabled) return;
  bool overflow = false;
  for (auto& [opt, p] : per_optimizer_) overflow = overflow || found_inf(p);
  if (options_.dynamic) {
    if (overflow) {
      state_.scale *= options_.backoff_factor;
      state_.growth_tracker = 0;
    } else if (++state_.growth_tracker == options_.growth_interval) {
      double grown = state_.scale * options_.growth_factor;
      if (std::isfinite(grown)) state_.scale = grown;
      state_.growth_tracker = 0;
    }
    for (auto& [device, t] : scale_tensors_) t.fill_(state_.scale);
  }
  if (overflow && state_.scale < options_.warn_below_scale && diagnosis_.empty()) diagnose_overflow();
  per_optimizer_.clear();
  loss_was_finite_.clear();
}

void GradScaler::load_state(const GradScalerState& state) {
  HG_CHECK(state.scale > 0 && std::isfinite(state.scale), "GradScaler::load_state: invalid scale {}", state.scale);
  HG_CHECK(state.growth_tracker >= 0 && state.growth_tracker < options_.growth_interval,
           "GradScaler::load_state: growth_tracker {} outside [0, {})", state.growth_tracker, options_.growth_interval);
  state_ = state;
  for (auto& [device, t] : scale_tensors_) t.fill_(state_.scale);
}

std::vector<std::pair<std::string, Tensor>> GradScaler::state_tensors() const {
  return {{"scaler.scale", scalar_tensor(state_.scale, {.dtype = kFloat64})},
          {"scaler.growth_tracker", scalar_tensor(state_.growth_tracker, {.dtype = kInt64})}};
}

void GradScaler::load_state_tensors(const std::vector<std::pair<std::string, Tensor>>& named) {
  GradScalerState s;
  int found = 0;
  for (const auto& [name, t] : named) {
    if (name == "scaler.scale") {
      s.scale = t.item<double>();
      ++found;
    } else if (name == "scaler.growth_tracker") {
      s.growth_tracker = t.item<int64_t>();
      ++found;
    }
  }
  HG_CHECK(found == 2, "GradScaler::load_state_tensors: expected scaler.scale and scaler.growth_tracker, found {} of them",
           found);
  load_state(s);
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
                             "rule, or lower the learning rate); loss scaling cannot fix this", state_.scale);
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
                           state_.scale, culprit);
  logger().warn(diagnosis_);
}

namespace {
void unscale_cpu(const TensorList& grads, const Tensor& inv_scale, const Tensor& found_inf) {
  const float inv = inv_scale.item<float>();
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
        opmath_t<T> v = opmath_t<T>(data[i]) * opmath_t<T>(inv);
        bad = bad || !std::isfinite(v);
        data[i] = T(v);
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
}  // namespace

HG_REGISTER_KERNEL(unscale_kernel, CPU, unscale_cpu);

}  // namespace halfgrad::amp

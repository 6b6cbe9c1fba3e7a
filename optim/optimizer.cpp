// The Optimizer base: parameter groups seen generically, parameter checks, and the state a checkpoint
// saves and loads.
#include "optim/optimizer.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string_view>
#include <unordered_set>

#include "core/autocast.h"
#include "core/autograd.h"
#include "core/cuda.h"
#include "core/log.h"
#include "ops/conv.h"
#include "ops/shape.h"
#include "optim/clip_grad.h"
#include "optim/fused.h"
#include "optim/option_tensors.h"

namespace halfgrad::optim {

double* MomentumRef::checked() const {
  HG_CHECK(value_, "{} has no momentum (nor a beta1): its parameter groups' momentum cannot be read or set",
           optimizer_);
  return value_;
}

void check_not_negative(const char* optimizer, const char* option, double value, size_t g) {
  HG_CHECK(value >= 0, "{}: invalid {} {} (group {}): must be >= 0", optimizer, option, value, g);
}

void Optimizer::zero_grad() {
  for (const Tensor& p : parameters()) p.set_grad(Tensor());
}

void Optimizer::check_found_inf(const Tensor& found_inf) const {
  HG_CHECK(found_inf.defined() && found_inf.dim() == 0 && found_inf.dtype() == kFloat32,
           "{}.step_unless: found_inf must be a float32 0-d tensor, got {}", name_, found_inf.meta());
  HG_CHECK(!cuda::is_capturing(found_inf.device()),
           "{}.step_unless: this optimizer decides on the host whether to step (it counts its steps there), so it "
           "cannot run inside a CUDA graph capture with a loss scaler; use SGD, or train without capture",
           name_);
}

void Optimizer::step_unless(const Tensor& found_inf) {
  check_found_inf(found_inf);
  if (found_inf.item<float>() == 0) step();
}

void Optimizer::step_scaled(const Tensor& found_inf, const Tensor& grad_scale) {
  // Every check before the gradients are scaled: a step refused later would leave them scaled.
  check_step();
  if (found_inf.defined()) check_found_inf(found_inf);
  scale_grads_(parameters(), grad_scale);
  if (found_inf.defined())
    step_unless(found_inf);
  else
    step();
}

TensorList Optimizer::parameters() const {
  TensorList all;
  for (size_t g = 0; g < num_param_groups(); ++g) {
    const TensorList& params = group_params(g);
    all.insert(all.end(), params.begin(), params.end());
  }
  return all;
}

std::vector<ParamGroupRef> Optimizer::param_groups() {
  std::vector<ParamGroupRef> refs;
  for (size_t g = 0; g < num_param_groups(); ++g) refs.push_back(param_group(g));
  return refs;
}

std::optional<double> Optimizer::initial_lr(size_t g) const {
  return g < initial_lrs_.size() ? initial_lrs_[g] : std::nullopt;
}

void Optimizer::set_initial_lr(size_t g, double lr) {
  HG_CHECK(g < num_param_groups(), "{}: no parameter group {} (it has {})", name_, g, num_param_groups());
  if (initial_lrs_.size() <= g) initial_lrs_.resize(g + 1);
  initial_lrs_[g] = lr;
}

ParamState& Optimizer::state(size_t group, size_t param) {
  if (state_.size() <= group) state_.resize(group + 1);
  std::vector<ParamState>& states = state_[group];
  if (states.size() <= param) states.resize(param + 1);
  return states[param];
}

void Optimizer::check_parameters() const {
  size_t count = 0;
  for (size_t g = 0; g < num_param_groups(); ++g) count += group_params(g).size();
  // As PyTorch: an optimizer of nothing would step without a word, where the caller likely passed the wrong module.
  HG_CHECK(count > 0, "{}: got an empty parameter list ({} group{}, none with a parameter)", name_,
           num_param_groups(), num_param_groups() == 1 ? "" : "s");
  std::unordered_set<const TensorImpl*> seen;
  for (size_t g = 0; g < num_param_groups(); ++g) {
    const TensorList& params = group_params(g);
    for (size_t p = 0; p < params.size(); ++p) {
      const Tensor& t = params[p];
      HG_CHECK(t.defined(), "{}: parameter {} of group {} is an undefined tensor", name_, p, g);
      HG_CHECK(t.is_floating_point(), "{}: parameters must be floating point, got {} (group {}, parameter {})", name_,
               t.meta(), g, p);
      // A leaf that requires no grad (a frozen layer) is taken, as PyTorch does: it never gets a gradient, and a step
      // skips it.
      HG_CHECK(t.is_leaf(), "{}: parameters must be leaves (a tensor computed from others cannot be optimized), got {} "
               "(group {}, parameter {})", name_, t.meta(), g, p);
      HG_CHECK(seen.insert(t.impl()).second,
               "{}: a parameter appears more than once (group {}, parameter {}: {}); give each to one group only",
               name_, g, p, t.meta());
    }
  }
}

void Optimizer::check_gradient(size_t g, size_t p, const Tensor& param, const Tensor& grad) const {
  HG_CHECK(param.defined(), "{}: parameter {} of group {} is an undefined tensor", name_, p, g);
  if (!grad.defined()) return;
  HG_CHECK(grad.shape() == param.shape() && grad.dtype() == param.dtype() && grad.device() == param.device(),
           "{}: parameter {} of group {} is {} but its gradient is {}; the gradient must have the parameter's "
           "shape, dtype and device",
           name_, p, g, param.meta(), grad.meta());
  HG_CHECK(param.is_floating_point(), "{}: parameter {} of group {} is {}; parameters must be floating point",
           name_, p, g, param.meta());
}

void Optimizer::check_buffer(size_t g, size_t p, size_t k, const Tensor& buffer, const Tensor& param) const {
  HG_CHECK(buffer.shape() == param.shape() && buffer.dtype() == param.dtype() && buffer.device() == param.device(),
           "{}: the {} of parameter {} of group {} is {} but the parameter is now {}; a parameter replaced after "
           "the optimizer's first step must keep its shape, dtype and device",
           name_, state_names(g).at(k), p, g, buffer.meta(), param.meta());
}

void Optimizer::check_step() {
  for (size_t g = 0; g < num_param_groups(); ++g) {
    const TensorList& params = group_params(g);
    for (size_t p = 0; p < params.size(); ++p) {
      const Tensor& param = params[p];
      check_gradient(g, p, param, param.defined() ? param.grad() : Tensor());
      if (!param.grad().defined()) continue;
      if (g < state_.size() && p < state_[g].size()) {
        const std::vector<Tensor>& buffers = state_[g][p].buffers;
        for (size_t k = 0; k < buffers.size(); ++k)
          if (buffers[k].defined()) check_buffer(g, p, k, buffers[k], param);
      }
    }
  }
}

std::vector<std::vector<Optimizer::StepItem>> Optimizer::step_items(size_t g) {
  const TensorList& params = group_params(g);
  std::vector<std::vector<StepItem>> buckets;
  for (size_t p = 0; p < params.size(); ++p) {
    const Tensor& param = params[p];
    Tensor grad = param.defined() ? param.grad() : Tensor();
    check_gradient(g, p, param, grad);
    if (!grad.defined()) continue;
    auto same_kind = [&](const std::vector<StepItem>& b) {
      return b[0].param.device() == param.device() && b[0].param.dtype() == param.dtype();
    };
    const size_t bucket = size_t(std::find_if(buckets.begin(), buckets.end(), same_kind) - buckets.begin());
    if (bucket == buckets.size()) buckets.emplace_back();
    const std::optional<MemoryFormat> laid_out = storage_format(param);
    const MemoryFormat format = laid_out.value_or(MemoryFormat::Contiguous);
    // Autocast's kept cast, written by the kernel where it is laid out as the parameter, element for element, and of
    // the dtype of the bucket's first cast (a kernel writes casts of one dtype); any other is left to go stale and is
    // cast again by the next autocast region.
    Tensor cast = amp::kept_cast(param);  // current before the step's write, or undefined
    auto first_cast = std::find_if(buckets[bucket].begin(), buckets[bucket].end(),
                                   [](const StepItem& item) { return item.cast.defined(); });
    if (cast.defined() && !(param.dtype() == kFloat32 && laid_out && *laid_out != MemoryFormat::AlignedRows &&
                            storage_format(cast) == laid_out &&
                            (first_cast == buckets[bucket].end() || first_cast->cast.dtype() == cast.dtype())))
      cast = Tensor();
    check_inplace(param, name_, /*records=*/false);
    StepItem item{.index = p,
                  .param = flat_storage_view(laid_out ? param : param.contiguous()),
                  .grad = flat_storage_view(contiguous(grad, format)),
                  .parameter = param,
                  .format = format,
                  .copied = !laid_out,
                  .cast = Tensor()};
    if (cast.defined()) {
      check_inplace(cast, name_, /*records=*/false);
      item.cast = flat_storage_view(cast);
      amp::keep_cast_current(param, cast);
    }
    buckets[bucket].push_back(std::move(item));
  }
  return buckets;
}

void Optimizer::add_tensors(StepTensors& args, const StepItem& item) {
  args.params.push_back(item.param);
  args.grads.push_back(item.grad);
  args.param_casts.push_back(item.cast);
}

void Optimizer::write_back(const std::vector<StepItem>& items) {
  for (const StepItem& item : items)
    if (item.copied) {
      Tensor parameter = item.parameter;
      parameter.copy_(item.param.view(parameter.shape()));
    }
}

Tensor Optimizer::state_buffer(size_t g, const StepItem& item, size_t k, bool* created) {
  ParamState& s = state(g, item.index);
  if (s.buffers.size() <= k) s.buffers.resize(k + 1);
  Tensor& buf = s.buffers[k];
  const Tensor& p = item.parameter;
  if (created) *created = !buf.defined();
  const bool in_layout = buf.defined() && storage_format(buf) == item.format;
  if (!in_layout) {
    // Made in a capture, the zeros (or the buffer laid out again) would be made again by every replay.
    HG_CHECK(!cuda::is_capturing(p.device()),
             "{}: the {} of parameter {} of group {} is {} on its first step, inside a CUDA graph capture here; "
             "run the step eagerly first (cuda::CapturedStep does)", name_, state_names(g).at(k), item.index, g,
             buf.defined() ? "laid out as the parameter" : "created");
  }
  if (!buf.defined()) {
    buf = empty(p.shape(), {.dtype = p.dtype(), .device = p.device()}, item.format).zero_();
  } else {
    check_buffer(g, item.index, k, buf, p);
    if (!in_layout) buf = contiguous(buf, item.format);
  }
  return flat_storage_view(buf);
}

// ---- checkpoint state

NamedTensors Optimizer::state_tensors() const {
  NamedTensors out;
  // param_group() hands out writable references; here they are only read.
  auto& self = const_cast<Optimizer&>(*this);
  for (size_t g = 0; g < num_param_groups(); ++g) {
    ParamGroupRef group = self.param_group(g);
    out.emplace_back(fmt::format("param_groups.{}.lr", g), scalar_tensor(group.lr, {.dtype = kFloat64}));
    if (const std::optional<double> initial = initial_lr(g)) {
      out.emplace_back(fmt::format("param_groups.{}.initial_lr", g), scalar_tensor(*initial, {.dtype = kFloat64}));
    }
    if (group.momentum.exists()) {
      out.emplace_back(fmt::format("param_groups.{}.momentum", g),
                       scalar_tensor(double(group.momentum), {.dtype = kFloat64}));
    }
    for (const OtherOption& o : other_options(g)) {
      Tensor value = o.flag ? scalar_tensor(o.value != 0, {.dtype = kBool})
                            : scalar_tensor(o.value, {.dtype = kFloat64});
      out.emplace_back(fmt::format("param_groups.{}.{}", g, o.name), std::move(value));
    }
    // Which parameters have state, so that a load can tell an entry that went missing from one never written.
    std::vector<int64_t> with_state;
    const std::vector<ParamState> none;
    const std::vector<ParamState>& states = g < state_.size() ? state_[g] : none;
    for (size_t p = 0; p < states.size(); ++p) {
      const bool has_buffer = std::any_of(states[p].buffers.begin(), states[p].buffers.end(),
                                          [](const Tensor& b) { return b.defined(); });
      if (has_buffer || (counts_steps() && states[p].step > 0)) with_state.push_back(int64_t(p));
    }
    out.emplace_back(fmt::format("param_groups.{}.with_state", g), tensor(with_state));
    // The group's size, as PyTorch's state_dict lists its params: a file of other groups is refused on load.
    out.emplace_back(fmt::format("param_groups.{}.num_params", g),
                     scalar_tensor(int64_t(group_params(g).size()), {.dtype = kInt64}));
  }
  for (size_t g = 0; g < state_.size() && g < num_param_groups(); ++g) {
    const std::vector<std::string> names = state_names(g);
    for (size_t p = 0; p < state_[g].size(); ++p) {
      const ParamState& s = state_[g][p];
      if (counts_steps() && s.step > 0)
        out.emplace_back(fmt::format("state.{}.{}.step", g, p), scalar_tensor(s.step, {.dtype = kInt64}));
      for (size_t k = 0; k < s.buffers.size() && k < names.size(); ++k)
        if (s.buffers[k].defined()) out.emplace_back(fmt::format("state.{}.{}.{}", g, p, names[k]), s.buffers[k]);
    }
  }
  for (auto& [name, t] : own_state()) out.emplace_back("state." + name, std::move(t));
  return out;
}

int64_t whole_number(double value) {
  return value >= 0x1p63 ? std::numeric_limits<int64_t>::max() : int64_t(value);
}

std::vector<std::string> Optimizer::own_state_errors(const NamedTensors& entries,
                                                     const std::vector<std::map<std::string, double>>&) const {
  std::vector<std::string> errors;
  for (const auto& [name, t] : entries)
    errors.push_back(fmt::format("unexpected entry 'state.{}' ({})", name, t.meta()));
  return errors;
}

namespace {

std::vector<std::string_view> split_dots(std::string_view s) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (true) {
    size_t dot = s.find('.', start);
    parts.push_back(s.substr(start, dot == std::string_view::npos ? std::string_view::npos : dot - start));
    if (dot == std::string_view::npos) return parts;
    start = dot + 1;
  }
}

// A decimal index with nothing else around it, written as state_tensors writes it: "0", "12", not "00" or "012"
// (which would alias "0" and "12").
bool parse_index(std::string_view s, size_t& out) {
  if (s.empty() || (s.size() > 1 && s[0] == '0')) return false;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && end == s.data() + s.size();
}

}  // namespace

void Optimizer::load_state_tensors(const NamedTensors& state) {
  NoGradGuard no_grad;
  const size_t num_groups = num_param_groups();
  std::vector<std::string> errors;

  // What the file holds, gathered and checked before anything in the optimizer changes.
  struct GroupEntries {
    double lr = NAN, momentum = NAN;
    std::optional<double> initial_lr;  // none where the file has none (no scheduler had recorded one)
    bool has_lr = false, has_momentum = false, has_with_state = false;
    std::vector<OtherOption> expected;    // the optimizer's other options, as they are now
    std::map<std::string, double> others;  // those the file holds
    std::vector<bool> listed;  // [param]: in with_state
    std::vector<ParamState> params;
    std::vector<std::vector<bool>> have_buffer;  // [param][buffer]
    std::vector<bool> have_step;
  };
  std::vector<GroupEntries> groups(num_groups);
  std::vector<std::vector<std::string>> names(num_groups);
  for (size_t g = 0; g < num_groups; ++g) {
    names[g] = state_names(g);
    size_t n = group_params(g).size();
    groups[g].params.resize(n);
    for (ParamState& s : groups[g].params) s.buffers.resize(names[g].size());
    groups[g].have_buffer.assign(n, std::vector<bool>(names[g].size(), false));
    groups[g].have_step.assign(n, false);
    groups[g].listed.assign(n, false);
    groups[g].expected = other_options(g);
  }
  auto other_option = [&](size_t g, std::string_view name) -> const OtherOption* {
    if (g >= num_groups) return nullptr;
    for (const OtherOption& o : groups[g].expected)
      if (o.name == name) return &o;
    return nullptr;
  };

  NamedTensors own;  // "state.<name>" entries, named without "state."
  std::set<std::string> seen;
  for (const auto& [name, t] : state) {
    if (!seen.insert(name).second) {
      errors.push_back(fmt::format("'{}' appears more than once", name));
      continue;
    }
    if (!t.defined()) {
      errors.push_back(fmt::format("'{}' is an undefined tensor", name));
      continue;
    }
    std::vector<std::string_view> parts = split_dots(name);
    size_t g = 0, p = 0;
    if (parts.size() == 3 && parts[0] == "param_groups" && parse_index(parts[1], g) && parts[2] == "with_state") {
      if (g >= num_groups) {
        errors.push_back(fmt::format("'{}' names group {}, but the optimizer has {} group(s)", name, g, num_groups));
      } else if (t.dim() != 1 || t.dtype() != kInt64) {
        errors.push_back(fmt::format("'{}' must be a 1-D int64 tensor of parameter indices, got {}", name, t.meta()));
      } else {
        groups[g].has_with_state = true;
        for (int64_t i : to_vector<int64_t>(t)) {
          if (i < 0 || size_t(i) >= groups[g].listed.size()) {
            errors.push_back(fmt::format("'{}' lists parameter {}, but group {} has {} parameter(s)", name, i, g,
                                         groups[g].listed.size()));
          } else {
            groups[g].listed[size_t(i)] = true;
          }
        }
      }
      continue;
    }
    if (parts.size() == 3 && parts[0] == "param_groups" && parse_index(parts[1], g) && parts[2] == "num_params") {
      if (g >= num_groups) {
        errors.push_back(fmt::format("'{}' names group {}, but the optimizer has {} group(s)", name, g, num_groups));
      } else if (t.numel() != 1 || !is_integral(t.dtype())) {
        errors.push_back(fmt::format("'{}' must be a one-element integer tensor, got {}", name, t.meta()));
      } else if (const int64_t n = t.item<int64_t>(); n != int64_t(group_params(g).size())) {
        errors.push_back(fmt::format("'{}' says group {} had {} parameter(s), but the optimizer's group {} has {} "
                                     "(as PyTorch: a state of other groups does not load)", name, g, n, g,
                                     group_params(g).size()));
      }
      continue;  // (files written before this entry have none: their groups are checked by what they list)
    }
    if (parts.size() == 3 && parts[0] == "param_groups" && parse_index(parts[1], g) &&
        (parts[2] == "lr" || parts[2] == "momentum" || parts[2] == "initial_lr")) {
      if (g >= num_groups) {
        errors.push_back(fmt::format("'{}' names group {}, but the optimizer has {} group(s)", name, g, num_groups));
      } else if (parts[2] == "momentum" && !param_group(g).momentum.exists()) {
        errors.push_back(fmt::format("unexpected entry '{}': {} has no momentum", name, name_));
      } else if (t.numel() != 1 || !t.is_floating_point()) {
        errors.push_back(fmt::format("'{}' must be a one-element floating tensor, got {}", name, t.meta()));
      } else if (const double v = t.item<double>(); !std::isfinite(v)) {
        errors.push_back(fmt::format("'{}' is {}, not a finite number", name, v));
      } else if (parts[2] == "lr") {
        groups[g].lr = v;
        groups[g].has_lr = true;
      } else if (parts[2] == "initial_lr") {
        if (v < 0) errors.push_back(fmt::format("'{}' is {}: a scheduler's base lr must be >= 0", name, v));
        groups[g].initial_lr = v;
      } else {
        groups[g].momentum = v;
        groups[g].has_momentum = true;
      }
      continue;
    }
    if (parts.size() == 3 && parts[0] == "param_groups" && parse_index(parts[1], g)) {
      if (const OtherOption* o = other_option(g, parts[2])) {
        const bool dtype_fits = o->flag      ? t.dtype() == kBool
                                : o->integer ? t.is_floating_point() || is_integral(t.dtype())
                                             : t.is_floating_point();
        if (t.numel() != 1 || !dtype_fits) {
          errors.push_back(fmt::format("'{}' must be a one-element {} tensor, got {}", name,
                                       o->flag ? "bool" : o->integer ? "floating or integer" : "floating", t.meta()));
        } else if (const double v = t.item<double>(); !std::isfinite(v)) {
          errors.push_back(fmt::format("'{}' is {}, not a finite number", name, v));
        } else if (o->integer && (v != std::trunc(v) || std::abs(v) > 0x1p63)) {
          errors.push_back(fmt::format("'{}' is {}, not a whole number within int64's range", name, v));
        } else if (o->shapes_state && v != o->value) {
          errors.push_back(fmt::format("'{}' is {} but the optimizer's is {}, and it decides which buffers each "
                                       "parameter keeps: build the optimizer with the file's value", name,
                                       v != 0, o->value != 0));
        } else {
          groups[g].others[std::string(parts[2])] = v;
        }
        continue;
      }
    }
    if (parts.size() == 2 && parts[0] == "state") {
      own.emplace_back(std::string(parts[1]), t);
      continue;
    }
    if (!(parts.size() == 4 && parts[0] == "state" && parse_index(parts[1], g) && parse_index(parts[2], p))) {
      errors.push_back(fmt::format("unexpected entry '{}' ({})", name, t.meta()));
      continue;
    }
    if (g >= num_groups) {
      errors.push_back(fmt::format("'{}' names group {}, but the optimizer has {} group(s)", name, g, num_groups));
      continue;
    }
    const TensorList& params = group_params(g);
    if (p >= params.size()) {
      errors.push_back(
          fmt::format("'{}' names parameter {} of group {}, which has {} parameter(s)", name, p, g, params.size()));
      continue;
    }
    const Tensor& param = params[p];
    GroupEntries& ge = groups[g];
    if (parts[3] == "step" && counts_steps()) {
      if (t.numel() != 1 || !is_integral(t.dtype())) {
        errors.push_back(fmt::format("'{}' must be a one-element integer tensor, got {}", name, t.meta()));
      } else if (t.item<int64_t>() < 1) {
        errors.push_back(fmt::format("'{}' is {}; a saved step count is at least 1", name, t.item<int64_t>()));
      } else {
        ge.params[p].step = t.item<int64_t>();
        ge.have_step[p] = true;
      }
      continue;
    }
    size_t k = 0;
    while (k < names[g].size() && names[g][k] != parts[3]) ++k;
    if (k == names[g].size() && names[g].empty() && !counts_steps()) {
      errors.push_back(fmt::format("unexpected entry '{}': {} keeps no state per parameter", name, name_));
      continue;
    }
    if (k == names[g].size()) {
      errors.push_back(fmt::format("unexpected entry '{}': {} keeps {}{} for group {}", name, name_,
                                   counts_steps() ? "step, " : "", fmt::join(names[g], ", "), g));
      continue;
    }
    if (t.shape() != param.shape() || t.dtype() != param.dtype()) {
      errors.push_back(fmt::format("'{}' is {} but parameter {} of group {} is {}", name, t.meta(), p, g, param.meta()));
      continue;
    }
    // A copy on the parameter's device: the optimizer writes its state in place and must not write into
    // the caller's tensors.
    Tensor copy = empty(param.shape(), {.dtype = param.dtype(), .device = param.device()});
    copy.copy_(t);
    ge.params[p].buffers[k] = copy;
    ge.have_buffer[p][k] = true;
  }

  for (size_t g = 0; g < num_groups; ++g) {
    GroupEntries& ge = groups[g];
    if (!ge.has_lr) errors.push_back(fmt::format("missing 'param_groups.{}.lr'", g));
    const bool has_momentum = param_group(g).momentum.exists();
    if (has_momentum && !ge.has_momentum) errors.push_back(fmt::format("missing 'param_groups.{}.momentum'", g));
    // The values the constructor would refuse (a negative lr, Adam's beta1 >= 1, nesterov without momentum).
    if (ge.has_lr && (ge.has_momentum || !has_momentum)) {
      if (std::string why = refusal(g, ge.lr, ge.momentum, ge.others); !why.empty()) {
        std::string others;
        for (const auto& [option, value] : ge.others) others += fmt::format(", {} {}", option, value);
        const std::string momentum = has_momentum ? fmt::format(", momentum {}", ge.momentum) : "";
        errors.push_back(fmt::format("param_groups.{}: lr {}{}{}: {}", g, ge.lr, momentum, others, why));
      }
    }
    // A parameter's state is all there or not there at all (its optional buffers aside).
    for (size_t p = 0; p < ge.params.size(); ++p) {
      std::vector<std::string> present, missing;
      if (counts_steps()) (ge.have_step[p] ? present : missing).push_back("step");
      for (size_t k = 0; k < required_buffers(g); ++k)
        (ge.have_buffer[p][k] ? present : missing).push_back(names[g][k]);
      for (size_t k = required_buffers(g); k < names[g].size(); ++k)
        if (ge.have_buffer[p][k]) present.push_back(names[g][k]);
      if (!present.empty() && !missing.empty())
        errors.push_back(fmt::format("parameter {} of group {} has {} but not {}", p, g, fmt::join(present, ", "),
                                     fmt::join(missing, ", ")));
      if (ge.has_with_state && ge.listed[p] && present.empty())
        errors.push_back(fmt::format("parameter {} of group {} had state when saved (param_groups.{}.with_state), but "
                                     "the file holds none of it: {}", p, g, g, fmt::join(missing, ", ")));
      if (ge.has_with_state && !ge.listed[p] && !present.empty())
        errors.push_back(fmt::format("parameter {} of group {} has {} in the file, but param_groups.{}.with_state "
                                     "does not list it", p, g, fmt::join(present, ", "), g));
    }
  }
  std::vector<size_t> unchecked;
  std::vector<std::string> kept;  // "group 0: weight_decay, nesterov"
  for (size_t g = 0; g < num_groups; ++g) {
    if (!groups[g].has_with_state) unchecked.push_back(g);
    std::vector<std::string> absent;
    for (const OtherOption& o : groups[g].expected)
      if (!groups[g].others.count(o.name)) absent.push_back(o.name);
    if (!absent.empty()) kept.push_back(fmt::format("group {}: {}", g, fmt::join(absent, ", ")));
  }

  std::vector<std::map<std::string, double>> loaded_options(num_groups);
  for (size_t g = 0; g < num_groups; ++g) {
    for (const OtherOption& o : groups[g].expected) loaded_options[g][o.name] = o.value;
    for (const auto& [option, value] : groups[g].others) loaded_options[g][option] = value;
  }
  for (std::string& e : own_state_errors(own, loaded_options)) errors.push_back(std::move(e));
  if (!errors.empty()) fail_loading(name_, "optimizer state", errors);

  if (!unchecked.empty())
    logger().warn("{}: the state of group(s) {} has no with_state list (a file written before it existed): whether "
                  "some parameter's state is missing from it cannot be checked",
                  name_, fmt::join(unchecked, ", "));
  if (!kept.empty())
    logger().warn("{}: the state has no value for some options (a file written before they were kept), which keep "
                  "the constructor's: {}", name_, fmt::join(kept, "; "));
  state_.assign(num_groups, {});
  initial_lrs_.resize(num_groups);
  for (size_t g = 0; g < num_groups; ++g) {
    set_options(g, groups[g].lr, groups[g].momentum, groups[g].others);
    initial_lrs_[g] = groups[g].initial_lr;
    for (size_t p = 0; p < groups[g].params.size(); ++p) {
      bool any = groups[g].have_step[p];
      for (bool b : groups[g].have_buffer[p]) any = any || b;
      if (any) this->state(g, p) = std::move(groups[g].params[p]);
    }
  }
  load_own_state(own);
}

}  // namespace halfgrad::optim

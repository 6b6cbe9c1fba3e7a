// Module: registry, traversal, mode, conversion, state dicts and printing. See nn/module.h.
#include "nn/module.h"

#include <cstring>
#include <map>

#include "core/autograd.h"
#include "ops/conv.h"

namespace halfgrad::nn {

Tensor Module::forward(const Tensor&) {
  HG_FAIL("{}: this module has no forward(const Tensor&); call its own forward method", type_name());
}

// ---- registration

void Module::check_new_name(const std::string& name, const char* what) const {
  HG_CHECK(!name.empty(), "{}: register_{}: the name is empty", type_name(), what);
  HG_CHECK(name.find('.') == std::string::npos, "{}: register_{}: '{}' contains a '.', which separates the parts of "
           "a dotted name", type_name(), what, name);
  auto taken = [&](const auto& list) {
    for (const auto& entry : list)
      if (entry.name == name) return true;
    return false;
  };
  bool child = false;
  for (const auto& [n, m] : children_) child |= n == name;
  HG_CHECK(!taken(parameters_) && !taken(buffers_) && !child, "{}: register_{}: '{}' is already registered",
           type_name(), what, name);
}

Tensor& Module::register_parameter(const std::string& name, Tensor value, bool requires_grad) {
  check_new_name(name, "parameter");
  if (value.defined()) {
    HG_CHECK(value.is_leaf(), "{}: register_parameter: '{}' must be a leaf tensor, got one produced by {} (detach() "
             "it first)", type_name(), name, value.grad_fn()->name());
    value.requires_grad_(requires_grad);
  }
  parameters_.push_back({name, std::move(value), true});
  return parameters_.back().tensor;
}

Tensor& Module::register_buffer(const std::string& name, Tensor value, bool persistent) {
  check_new_name(name, "buffer");
  buffers_.push_back({name, std::move(value), persistent});
  return buffers_.back().tensor;
}

void Module::add_child(const std::string& name, ModulePtr module) {
  check_new_name(name, "module");
  HG_CHECK(module != nullptr, "{}: register_module: '{}' is null", type_name(), name);
  children_.emplace_back(name, std::move(module));
}

void Module::replace_child(const std::string& name, ModulePtr module) {
  HG_CHECK(module != nullptr, "{}: replace_module: '{}' is null", type_name(), name);
  auto it = std::find_if(children_.begin(), children_.end(), [&](const auto& c) { return c.first == name; });
  if (it == children_.end()) {
    std::string names;
    for (const auto& [n, c] : children_) names += (names.empty() ? "" : ", ") + n;
    HG_FAIL("{}: replace_module: no submodule is registered as '{}' (its submodules: {})", type_name(), name,
            names.empty() ? "none" : names);
  }
  it->second = std::move(module);
}

// ---- traversal

void Module::collect(const std::string& prefix, bool params, bool buffers, bool persistent_only, bool recurse,
                     NamedTensors& out, std::unordered_set<const TensorImpl*>* seen) const {
  auto add = [&](const Slot& s) {
    if (!s.tensor.defined() || (seen && !seen->insert(s.tensor.impl()).second)) return;
    out.emplace_back(prefix + s.name, s.tensor);
  };
  if (params)
    for (const Slot& s : parameters_) add(s);
  if (buffers)
    for (const Slot& s : buffers_)
      if (s.persistent || !persistent_only) add(s);
  if (recurse)
    for (const auto& [name, child] : children_)
      child->collect(prefix + name + ".", params, buffers, persistent_only, recurse, out, seen);
}

NamedTensors Module::named_parameters(bool recurse) const {
  NamedTensors out;
  std::unordered_set<const TensorImpl*> seen;
  collect("", true, false, false, recurse, out, &seen);
  return out;
}

TensorList Module::parameters(bool recurse) const {
  TensorList out;
  for (auto& [name, t] : named_parameters(recurse)) out.push_back(t);
  return out;
}

NamedTensors Module::named_buffers(bool recurse) const {
  NamedTensors out;
  std::unordered_set<const TensorImpl*> seen;
  collect("", false, true, false, recurse, out, &seen);
  return out;
}

TensorList Module::buffers(bool recurse) const {
  TensorList out;
  for (auto& [name, t] : named_buffers(recurse)) out.push_back(t);
  return out;
}

std::vector<std::pair<std::string, ModulePtr>> Module::named_children() const {
  std::vector<std::pair<std::string, ModulePtr>> out;
  std::unordered_set<const Module*> seen;
  for (const auto& [name, child] : children_) {
    if (seen.insert(child.get()).second) out.emplace_back(name, child);
  }
  return out;
}

std::vector<ModulePtr> Module::children() const {
  std::vector<ModulePtr> out;
  for (const auto& [name, child] : named_children()) out.push_back(child);
  return out;
}

void Module::collect_modules(const std::string& prefix, std::vector<std::pair<std::string, Module*>>& out,
                             std::unordered_set<const Module*>& seen) {
  if (!seen.insert(this).second) return;  // a module shared by two parents: listed (and visited) once
  out.emplace_back(prefix, this);
  for (const auto& [name, child] : children_) {
    child->collect_modules(prefix.empty() ? name : prefix + "." + name, out, seen);
  }
}

std::vector<std::pair<std::string, Module*>> Module::named_modules() {
  std::vector<std::pair<std::string, Module*>> out;
  std::unordered_set<const Module*> seen;
  collect_modules("", out, seen);
  return out;
}

std::vector<Module*> Module::modules() {
  std::vector<Module*> out;
  for (auto& [name, m] : named_modules()) out.push_back(m);
  return out;
}

Module* Module::owner_of(const std::string& dotted_name, std::string& rest, std::string& missing_child) {
  Module* m = this;
  rest = dotted_name;
  for (size_t dot; (dot = rest.find('.')) != std::string::npos;) {
    std::string head = rest.substr(0, dot);
    Module* next = nullptr;
    for (const auto& [name, child] : m->children_)
      if (name == head) next = child.get();
    if (!next) {
      missing_child = head;
      return nullptr;
    }
    m = next;
    rest = rest.substr(dot + 1);
  }
  return m;
}

Tensor& Module::tensor_at(const std::string& dotted_name) {
  std::string rest, missing_child;
  Module* m = owner_of(dotted_name, rest, missing_child);
  HG_CHECK(m, "{}: tensor_at('{}'): no submodule '{}'", type_name(), dotted_name, missing_child);
  for (auto* list : {&m->parameters_, &m->buffers_})
    for (Slot& s : *list)
      if (s.name == rest) {
        HG_CHECK(s.tensor.defined(), "{}: tensor_at('{}'): {}'s '{}' is registered but holds no tensor (a layer built "
                 "without it, as Linear without a bias)", type_name(), dotted_name, m->type_name(), rest);
        return s.tensor;
      }
  HG_FAIL("{}: tensor_at('{}'): {} has no parameter or buffer '{}'", type_name(), dotted_name, m->type_name(), rest);
}

void Module::apply(const std::function<void(Module&)>& fn) {
  for (Module* m : modules()) fn(*m);
}

// ---- mode

void Module::train(bool on) {
  for (Module* m : modules()) m->training_ = on;
}

// ---- conversion

namespace {
// Whether to(format) lays t out again: channels_last applies to 4-D tensors, aligned rows to 2-D ones, contiguous to
// both.
bool format_applies(MemoryFormat format, const Tensor& t) {
  switch (format) {
    case MemoryFormat::ChannelsLast: return t.dim() == 4;
    case MemoryFormat::AlignedRows: return t.dim() == 2;
    case MemoryFormat::Contiguous: return t.dim() == 4 || t.dim() == 2;
  }
  return false;
}

bool in_format(const Tensor& t, MemoryFormat format) {
  switch (format) {
    case MemoryFormat::ChannelsLast: return is_channels_last(t);
    case MemoryFormat::AlignedRows: return is_aligned_rows(t);
    case MemoryFormat::Contiguous: return t.is_contiguous();
  }
  return false;
}
}  // namespace

void Module::convert_own(const Conversion& to,
                         std::unordered_map<const TensorImpl*, std::pair<Tensor, Tensor>>& converted) {
  NoGradGuard no_grad;
  auto convert = [&](Tensor& t) {
    if (!t.defined()) return;
    if (auto it = converted.find(t.impl()); it != converted.end()) {
      t = it->second.second;  // shared with a slot converted earlier in this pass: stay shared
      return;
    }
    const DType to_dtype = to.dtype && t.is_floating_point() ? *to.dtype : t.dtype();
    const Device to_device = to.device ? *to.device : t.device();
    const bool relayout = to.format && t.is_floating_point() && format_applies(*to.format, t) &&
                          !in_format(t, *to.format);
    if (to_dtype == t.dtype() && to_device == t.device() && !relayout) return;  // nothing to do: keep the same tensor
    // The layout the copy ends in: the one asked for, else t's own (detach() makes a view, which to() would not
    // keep aligned).
    const MemoryFormat layout = relayout ? *to.format : kept_memory_format(t);
    auto converted_copy = [&](const Tensor& x) { return contiguous(x.detach().to(to_device, to_dtype), layout); };
    Tensor c = converted_copy(t);
    if (t.requires_grad()) c.requires_grad_();
    if (Tensor g = t.grad(); g.defined()) c.set_grad(converted_copy(g));
    converted.emplace(t.impl(), std::pair(t, c));
    t = c;  // writes the slot, which is the layer's member (see nn/module.h)
  };
  for (Slot& s : parameters_) convert(s.tensor);
  for (Slot& s : buffers_) convert(s.tensor);
}

void Module::convert_all(const Conversion& to, const std::function<bool(const Module&)>* select) {
  HG_CHECK(!to.dtype || is_floating(*to.dtype), "{}: to({}): modules convert to floating dtypes only", type_name(),
           dtype_name(*to.dtype));
  std::unordered_map<const TensorImpl*, std::pair<Tensor, Tensor>> converted;
  for (Module* m : modules())
    if (!select || (*select)(*m)) m->convert_own(to, converted);
  if (!select) return;
  // A module left out that shares a converted tensor (a tied weight) takes the same new tensor: else the two slots
  // would train apart.
  for (Module* m : modules()) {
    if ((*select)(*m)) continue;
    for (std::deque<Slot>* slots : {&m->parameters_, &m->buffers_})
      for (Slot& s : *slots)
        if (auto it = s.tensor.defined() ? converted.find(s.tensor.impl()) : converted.end(); it != converted.end())
          s.tensor = it->second.second;
  }
}

void Module::to(Device device) { convert_all({.device = &device}, nullptr); }
void Module::to(DType dtype) { convert_all({.dtype = &dtype}, nullptr); }
void Module::to(Device device, DType dtype) { convert_all({.dtype = &dtype, .device = &device}, nullptr); }
void Module::to(DType dtype, const std::function<bool(const Module&)>& select) {
  convert_all({.dtype = &dtype}, &select);
}
void Module::to(MemoryFormat format) { convert_all({.format = &format}, nullptr); }

void Module::zero_grad() {
  for (Tensor& p : parameters())
    if (p.grad().defined()) p.set_grad(Tensor());
}

// ---- state

// As PyTorch's state_dict: detached handles (requires_grad false, the same storage), so that a caller may edit the
// values in place, which a leaf that requires grad refuses.
NamedTensors Module::state_dict() const {
  NamedTensors out = own_tensors();
  for (auto& entry : out) entry.second = entry.second.detach();
  return out;
}

NamedTensors Module::own_tensors() const {
  NamedTensors out;
  collect("", true, true, /*persistent_only=*/true, true, out, /*seen=*/nullptr);
  return out;
}

LoadResult Module::load_state_dict(const NamedTensors& state, const LoadOptions& options) {
  NamedTensors mine = own_tensors();  // the model's own handles: tied weights are one TensorImpl
  std::map<std::string, const Tensor*> given;
  std::vector<std::string> problems;
  for (const auto& [name, t] : state) {
    if (!given.emplace(name, &t).second) problems.push_back(fmt::format("'{}' appears twice in the state", name));
    else if (!t.defined()) problems.push_back(fmt::format("'{}' is undefined in the state", name));
  }

  LoadResult result;
  std::map<std::string, bool> known;
  // A tensor the model holds under several names (tied weights): the first of its names given, and that value.
  std::map<const TensorImpl*, std::pair<std::string, const Tensor*>> shared;
  for (const auto& [name, t] : mine) {
    known[name] = true;
    auto it = given.find(name);
    if (it == given.end()) {
      std::string own_name, missing_child;
      const Module* owner = owner_of(name, own_name, missing_child);
      if (!owner || !owner->may_be_missing(own_name)) result.missing_keys.push_back(name);
      continue;
    }
    const Tensor& src = *it->second;
    if (!src.defined()) continue;
    if (src.shape() != t.shape())
      problems.push_back(fmt::format("shape mismatch for '{}': the state has {}, the model {}", name,
                                     shape_str(src.shape()), shape_str(t.shape())));
    if (src.dtype() != t.dtype() && !options.convert_dtypes)
      problems.push_back(fmt::format("dtype mismatch for '{}': the state has {}, the model {} (LoadOptions::"
                                     "convert_dtypes converts)", name, dtype_name(src.dtype()), dtype_name(t.dtype())));
    // One tensor, two values: copying both would keep the last and drop the other without a word. Compared as the
    // model would hold them (its dtype, bit for bit: a tied weight holding nan still loads).
    const auto [first, inserted] = shared.emplace(t.impl(), std::pair(name, &src));
    const Tensor& other = *first->second.second;
    if (!inserted && !other.same(src) && src.shape() == t.shape() && other.shape() == t.shape()) {
      const Tensor a = other.to(Device::cpu(), t.dtype()).contiguous();
      const Tensor b = src.to(Device::cpu(), t.dtype()).contiguous();
      if (std::memcmp(a.data_ptr(), b.data_ptr(), size_t(a.numel()) * element_size(a.dtype())) != 0) {
        problems.push_back(fmt::format("'{}' and '{}' are one tensor in the model (tied), but the state gives them "
                                       "different values", first->second.first, name));
      }
    }
  }
  for (const auto& [name, t] : state)
    if (!known.count(name)) result.unexpected_keys.push_back(name);

  if (options.strict) {
    if (!result.missing_keys.empty())
      problems.push_back(fmt::format("missing from the state ({}): {}", result.missing_keys.size(),
                                     fmt::join(result.missing_keys, ", ")));
    if (!result.unexpected_keys.empty())
      problems.push_back(fmt::format("unexpected in the state ({}): {}", result.unexpected_keys.size(),
                                     fmt::join(result.unexpected_keys, ", ")));
  }
  if (!problems.empty())
    HG_FAIL("load_state_dict: {} problem{} loading into {} (nothing was loaded):\n  {}", problems.size(),
            problems.size() == 1 ? "" : "s", type_name(), fmt::join(problems, "\n  "));

  NoGradGuard no_grad;
  for (auto& [name, t] : mine) {
    auto it = given.find(name);
    if (it != given.end()) Tensor(t).copy_(*it->second);  // t is a handle: this writes the model's tensor
  }
  return result;
}

// ---- printing

std::string Module::repr_float(double v) {
  std::string s = fmt::format("{}", v);
  if (s.find_first_not_of("-0123456789") == std::string::npos) s += ".0";
  return s;
}

std::string Module::repr() const {
  std::string extra = extra_repr();
  if (children_.empty()) return type_name() + "(" + extra + ")";
  std::string out = type_name() + "(\n";
  if (!extra.empty()) out += "  " + extra + "\n";
  for (const auto& [name, child] : children_) {
    std::string body = child->repr();
    // Indent the child's lines under this one.
    std::string indented;
    for (char c : body) {
      indented += c;
      if (c == '\n') indented += "  ";
    }
    out += fmt::format("  ({}): {}\n", name, indented);
  }
  return out + ")";
}

}  // namespace halfgrad::nn

#include "core/autograd.h"

#include "core/autocast.h"
#include "core/cuda_graph.h"
#include "core/log.h"
#include "ops/copy.h"
#include "ops/shape.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <mutex>
#include <queue>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace halfgrad {

namespace {
thread_local bool grad_mode_enabled = true;
// The callbacks queued by the backward() running on this thread (null outside one): see queue_callback.
thread_local std::vector<std::function<void()>>* queued_callbacks = nullptr;
std::atomic<uint64_t> backward_passes{0};  // backward() calls begun in this process
thread_local uint64_t current_pass = 0;   // the pass running on this thread (0: none)
thread_local FunctionNode* running_node = nullptr;  // the node whose backward runs on this thread (SavedTensor::output)
std::atomic<uint64_t> next_sequence_nr{0};

TensorMeta meta_of(const Tensor& t) { return {t.shape(), t.dtype(), t.device()}; }

std::shared_ptr<Node> grad_accumulator(const Tensor& leaf) {
  AutogradMeta& meta = leaf.impl()->autograd_meta();
  if (auto existing = meta.grad_accumulator.lock()) return existing;
  auto acc = std::make_shared<AccumulateGrad>(leaf.impl_ptr());
  acc->input_meta = {meta_of(leaf)};
  acc->output_meta = {meta_of(leaf)};
  acc->sequence_nr = next_sequence_nr++;
  meta.grad_accumulator = acc;
  return acc;
}

// Where the gradient of `t` goes: its grad_fn, or its leaf accumulator, or nowhere.
Edge gradient_edge(const Tensor& t) {
  if (!t.defined()) return {};
  if (const auto& fn = t.grad_fn()) return {fn, t.output_nr()};
  if (t.requires_grad()) return {grad_accumulator(t), 0};
  return {};
}

// What a hook returned, in place of `grad`: undefined keeps grad. A hook may change a gradient's values, not its shape,
// dtype or device, which the nodes after it and the leaf's .grad were made for.
Tensor hooked(const Tensor& grad, const Tensor& replaced) {
  if (!replaced.defined()) return grad;
  HG_CHECK(replaced.shape() == grad.shape() && replaced.dtype() == grad.dtype() && replaced.device() == grad.device(),
           "a gradient hook returned {} for the gradient {}: a hook may change a gradient's values, not its shape, "
           "dtype or device", replaced.meta(), grad.meta());
  return replaced;
}

// By index, each hook copied: a hook may register another, which grows the vector. A removed hook is empty.
Tensor apply_hooks(const std::vector<GradHook>& hooks, Tensor grad) {
  for (size_t i = 0; i < hooks.size(); ++i) {
    const GradHook hook = hooks[i];
    if (hook) grad = hooked(grad, hook(grad));
  }
  return grad;
}

// Where a view lies in its base, for the gradients that pass between them: a buffer laid out as the base lies in its
// storage (its strides, and any gaps between its elements), seen as the base and as the view, finds each element of
// the view where the storage has it.
struct ViewPlace {
  Shape base_shape, base_strides, view_shape, view_strides;
  int64_t view_offset = 0;  // from the base's first element
  Dims expanded;  // the view's dims of stride 0 and size > 1 (expand's), size 1 in view_shape: gradients sum over them

  ViewPlace(const Tensor& view, const Tensor& base)
      : base_shape(base.shape()), base_strides(base.strides()), view_shape(view.shape()),
        view_strides(view.strides()), view_offset(view.offset() - base.offset()) {
    for (size_t d = 0; d < view_shape.size(); ++d) {
      if (view_shape[d] > 1 && view_strides[d] == 0) {
        expanded.push_back(int64_t(d));
        view_shape[d] = 1;
      }
    }
  }

  // {the buffer as the base, as the view}, of `like`'s dtype and device; zeroed, or left for the caller to fill.
  std::pair<Tensor, Tensor> buffer(const Tensor& like, bool zeroed) const {
    int64_t span = 1;  // the base's elements and gaps, from its first; none where it has none
    for (size_t d = 0; d < base_shape.size() && span > 0; ++d)
      span = base_shape[d] == 0 ? 0 : span + (base_shape[d] - 1) * base_strides[d];
    const TensorOptions options{.dtype = like.dtype(), .device = like.device()};
    const Tensor flat = zeroed ? zeros({span}, options) : empty({span}, options);
    return {make_view(flat, base_shape, base_strides, 0), make_view(flat, view_shape, view_strides, view_offset)};
  }
};

// A tensor of its own on t's values (no view, so no base's history reaches it), whose gradient goes to output
// `output_nr` of `history`.
Tensor alias_with_history(const Tensor& t, const std::shared_ptr<Node>& history, uint32_t output_nr) {
  Tensor alias = t.detach();
  alias.impl()->is_view = alias.impl()->is_detached = false;
  set_history(alias, history, output_nr);
  return alias;
}

// Whether nothing but `t` holds it or its storage. A view's base, which the view holds for autograd, counts as the
// view's own where nothing else holds it.
bool only_holder(const Tensor& t) {
  if (t.impl_ptr().use_count() != 1) return false;
  const TensorImpl& impl = *t.impl();
  const long held_by_base = impl.view_base && impl.view_base.use_count() == 1 ? 1 : 0;
  return impl.storage.use_count() == 1 + held_by_base;
}

// Makes `view`'s history a node that puts the view's gradient where the view lies in `base` and passes it to base's
// present history (PyTorch's regenerated AsStridedBackward).
void remake_view_history(const Tensor& view, const Tensor& base) {
  const ViewPlace place(view, base);
  auto node = std::make_shared<FunctionNode>("AsStridedBackward", [place](const GradContext& g) -> TensorList {
    auto [as_base, as_view] = place.buffer(g[0], /*zeroed=*/true);
    as_view.copy_(place.expanded.empty() ? g[0] : g[0].sum(place.expanded, /*keepdim=*/true));
    return {as_base};
  }, DoubleBackward::Supported);
  node->sequence_nr = next_sequence_nr++;
  node->next_edges = {gradient_edge(base)};
  node->input_meta = {meta_of(base)};
  node->output_meta = {meta_of(view)};
  set_history(view, node, 0);
}

// A view whose history is older than a recorded in-place write to its storage gets one from its base's present history
// before anything reads its autograd state (PyTorch regenerates a view's grad_fn the same way): its values may be the
// write's, and its gradient must reach the base's history, which the write replaced or gave it.
// Not given one: a view made a leaf of its own (requires_grad_()), whose gradient goes to its .grad; a view of a base
// whose elements share locations (detach() of an expanded tensor), which no in-place write gives a new history.
void refresh_view_history(const Tensor& t) {
  TensorImpl& impl = *t.impl();
  if (!impl.view_base || impl.history_seen == impl.storage->history_version()) return;
  impl.history_seen = impl.storage->history_version();
  const Tensor base(impl.view_base);
  const bool own_leaf = impl.autograd && impl.autograd->requires_grad;
  if (!own_leaf && base.requires_grad() && !has_internal_overlap(base)) remake_view_history(t, base);
}

// t's implementation, after refresh_view_history: what the accessors of its autograd state read.
const TensorImpl& refreshed(const Tensor& t, const char* what) {
  const TensorImpl& impl = t.defined_impl(what);
  refresh_view_history(t);
  return impl;
}
}  // namespace

bool GradMode::is_enabled() { return grad_mode_enabled; }
void GradMode::set_enabled(bool enabled) { grad_mode_enabled = enabled; }

std::string TensorMeta::str() const { return fmt::format("{}{} {}", dtype_name(dtype), shape_str(shape), device.str()); }

AutogradMeta& TensorImpl::autograd_meta() {
  if (!autograd) autograd = std::make_unique<AutogradMeta>();
  return *autograd;
}

// ---- Tensor's autograd methods

bool Tensor::requires_grad() const {
  const auto& m = refreshed(*this, "requires_grad").autograd;
  return m && (m->requires_grad || m->grad_fn);
}

Tensor& Tensor::requires_grad_(bool enabled) {
  if (!is_leaf()) {  // it requires grad through its history: asking so again changes nothing, as in PyTorch
    HG_CHECK(enabled, "requires_grad_: only leaf tensors can change requires_grad; this {} was produced by {} "
             "(use detach() to get a new leaf)", meta(), grad_fn()->name());
    return *this;
  }
  HG_CHECK(!enabled || is_floating_point(), "requires_grad_: only floating-point tensors can require "
           "gradients, got {}", meta());
  impl()->autograd_meta().requires_grad = enabled;
  return *this;
}

bool Tensor::is_leaf() const { return grad_fn() == nullptr; }

Tensor Tensor::grad() const {
  const auto& m = defined_impl("grad").autograd;
  return m ? m->grad : Tensor();
}

void Tensor::set_grad(const Tensor& grad) const {
  if (grad.defined()) {
    HG_CHECK(grad.shape() == shape() && grad.dtype() == dtype() && grad.device() == device(),
             "set_grad: gradient {} does not match tensor {}", grad.meta(), meta());
  }
  defined_impl("set_grad");
  impl()->autograd_meta().grad = grad;
}

const std::shared_ptr<Node>& Tensor::grad_fn() const {
  static const std::shared_ptr<Node> none;
  const auto& m = refreshed(*this, "grad_fn").autograd;
  return m ? m->grad_fn : none;
}

uint32_t Tensor::output_nr() const {
  const auto& m = refreshed(*this, "output_nr").autograd;
  return m ? m->output_nr : 0;
}

uint64_t Tensor::version() const { return storage()->version(); }

Tensor Tensor::detach() const {
  const TensorImpl& self = defined_impl("detach");
  auto alias = std::make_shared<TensorImpl>();
  alias->storage = self.storage;
  alias->shape = self.shape;
  alias->strides = self.strides;
  alias->offset = self.offset;
  alias->dtype = self.dtype;
  alias->is_view = true;
  alias->is_detached = true;
  return Tensor(std::move(alias));
}

bool Tensor::retains_grad() const {
  const auto& m = defined_impl("retains_grad").autograd;
  return m && m->retains_grad;
}

void Tensor::retain_grad() const {
  HG_CHECK(requires_grad(), "retain_grad: {} does not require grad", meta());
  if (is_leaf() || retains_grad()) return;  // leaves keep their gradient anyway
  impl()->autograd_meta().retains_grad = true;
  grad_fn()->retained.emplace_back(output_nr(), impl_ptr());
}

HookHandle Tensor::register_hook(GradHook hook) const {
  HG_CHECK(requires_grad(), "register_hook: cannot register a hook on {}, which does not require grad", meta());
  if (is_leaf()) {
    auto& hooks = impl()->autograd_meta().hooks;
    hooks.push_back(std::move(hook));
    return HookHandle([leaf = std::weak_ptr<TensorImpl>(impl_ptr()), at = hooks.size() - 1] {
      if (const auto impl = leaf.lock()) impl->autograd_meta().hooks[at] = nullptr;
    });
  }
  grad_fn()->pre_hooks.emplace_back(output_nr(), std::move(hook));
  return HookHandle([node = std::weak_ptr<Node>(grad_fn()), at = grad_fn()->pre_hooks.size() - 1] {
    if (const auto n = node.lock()) n->pre_hooks[at].second = nullptr;
  });
}

HookHandle Tensor::register_post_accumulate_grad_hook(PostAccumulateGradHook hook) const {
  HG_CHECK(is_leaf() && requires_grad(), "register_post_accumulate_grad_hook: {} is not a leaf that requires grad "
           "(only leaves accumulate into .grad)", meta());
  auto& hooks = impl()->autograd_meta().post_accumulate_hooks;
  hooks.push_back(std::move(hook));
  return HookHandle([leaf = std::weak_ptr<TensorImpl>(impl_ptr()), at = hooks.size() - 1] {
    if (const auto impl = leaf.lock()) impl->autograd_meta().post_accumulate_hooks[at] = nullptr;
  });
}

void Tensor::backward(const Tensor& gradient, std::optional<bool> retain_graph, bool create_graph) const {
  halfgrad::backward({*this}, {gradient}, retain_graph, create_graph);
}

// ---- nodes

Node::~Node() {
  std::vector<std::shared_ptr<Node>> last_held;  // nodes whose last holder is being freed: freed here, in turn
  auto take_edges = [&](Node& n) {
    for (Edge& e : n.next_edges)
      if (e.node && e.node.use_count() == 1) last_held.push_back(std::move(e.node));
    n.next_edges.clear();
  };
  take_edges(*this);
  while (!last_held.empty()) {
    std::shared_ptr<Node> n = std::move(last_held.back());
    last_held.pop_back();
    n->release_saved();  // first: what it saved holds the histories of its inputs too, the nodes its edges lead to
    take_edges(*n);  // n's destructor, at the end of this scope, finds no edges of its own left
  }
}

namespace {
// What the engine hands the backward it runs on this thread (GradContext::accumulated): per input, the gradient
// accumulated so far that the backward may add into, and whether it took it. Kept by the engine, not on the node, so
// that backward passes on other threads over a shared graph do not meet.
struct HandOver {
  const Node* node = nullptr;  // the node the engine is running, for which alone this is meant
  TensorList accumulated;
  std::vector<bool> took;
  std::vector<bool> pruned;  // autograd::grad: inputs whose gradient leads to no requested input (GradContext::needs)
};
thread_local HandOver* t_hand_over = nullptr;
}  // namespace

TensorList FunctionNode::apply(TensorList&& grad_outputs) {
  HG_CHECK(fn_ != nullptr, "{}: trying to backward through the graph a second time (or to use saved tensors after "
           "they were freed). Pass retain_graph=true to the first backward() if you need to do this.", name_);
  struct Running {
    FunctionNode* outer;
    ~Running() { running_node = outer; }
  } running{std::exchange(running_node, this)};
  std::vector<bool> needs(next_edges.size());
  const bool handed = t_hand_over && t_hand_over->node == this;  // (not a node some backward calls itself)
  for (size_t i = 0; i < next_edges.size(); ++i)
    needs[i] = next_edges[i].node != nullptr && !(handed && t_hand_over->pruned[i]);
  if (handed) return fn_(GradContext(grad_outputs, needs, t_hand_over->accumulated, t_hand_over->took));
  TensorList accumulated(next_edges.size());  // called outside the engine's run of it: nothing to hand over
  std::vector<bool> took(next_edges.size(), false);
  return fn_(GradContext(grad_outputs, needs, accumulated, took));
}

Tensor AccumulateGrad::hooked_gradient(Tensor grad) const {
  return apply_hooks(leaf_->autograd_meta().hooks, std::move(grad));
}

TensorList AccumulateGrad::apply(TensorList&& grad_outputs) {
  if (!leaf_->autograd_meta().requires_grad) return {};  // requires_grad_(false) since the forward: as PyTorch's
  Tensor grad = hooked_gradient(std::move(grad_outputs[0]));
  Tensor& stored = leaf_->autograd_meta().grad;
  // PyTorch's gradient layout contract: .grad has the leaf's layout (NCHW, or NHWC for a channels_last leaf; here
  // also aligned rows for an aligned-rows leaf), so optimizers walk parameter and gradient in the same order and
  // nothing transposes later.
  const MemoryFormat layout = kept_memory_format(Tensor(leaf_));
  auto copy_in_layout = [&](const Tensor& t) {  // recorded in a pass with create_graph (grad mode on)
    Tensor copy = empty(t.shape(), {.dtype = t.dtype(), .device = t.device()}, layout);
    return copy.copy_(t);
  };
  if (GradMode::is_enabled()) {
    // A pass with create_graph: .grad keeps the gradient's history, a copy (nothing else may write it) or a new sum,
    // never a write into the old .grad, which may be another pass's gradient with a history of its own (PyTorch's).
    stored = stored.defined() ? stored.add(grad) : copy_in_layout(grad);
  } else if (!stored.defined()) {
    // The incoming tensor may be shared (add's backward hands the same gradient to both inputs) or a
    // broadcast view: own a contiguous copy unless nothing else can see this one.
    bool sole_owner = only_holder(grad);
    bool matches = false;
    switch (layout) {
      case MemoryFormat::ChannelsLast: matches = suggest_memory_format(grad) == layout; break;
      case MemoryFormat::AlignedRows: matches = is_aligned_rows(grad); break;
      case MemoryFormat::Contiguous: matches = grad.is_contiguous(); break;
    }
    stored = sole_owner && matches ? grad : copy_in_layout(grad);
  } else if (stored.storage() == grad.storage() || has_internal_overlap(stored)) {
    // A .grad set to a view of the gradient itself, or an expanded one: a new sum, in the leaf's layout.
    Tensor sum = copy_in_layout(stored);
    stored = sum.add_(grad);
  } else {
    // In place, as PyTorch's AccumulateGrad: a handle to .grad (a buffer given by set_grad, a bucket's view) sees
    // the sum, and a replayed graph finds it at the same address.
    stored.add_(grad);
  }
  const Tensor leaf(leaf_);
  const auto& hooks = leaf_->autograd_meta().post_accumulate_hooks;
  for (size_t i = 0; i < hooks.size(); ++i) {  // by index, each copied: a hook may register another
    const PostAccumulateGradHook hook = hooks[i];
    if (hook) hook(leaf);
  }
  return {};
}

bool AccumulateGrad::leaf_has_hooks() const {
  const AutogradMeta& meta = leaf_->autograd_meta();
  auto live = [](const auto& hooks) {
    return std::any_of(hooks.begin(), hooks.end(), [](const auto& hook) { return bool(hook); });
  };
  return live(meta.hooks) || live(meta.post_accumulate_hooks);
}

SavedTensor::SavedTensor(const Tensor& t, const char* op) : SavedTensor(t, t, op) {}

SavedTensor::SavedTensor(const Tensor& t, const Tensor& values, const char* op) : op_(op) {
  if (!t.defined()) return;
  tensor_ = values.detach();
  version_ = values.version();
  // Where the gradient goes matters only to a node that records, which needs grad mode on (not in a plain backward
  // pass, whose ops save tensors for nothing).
  if (!GradMode::is_enabled()) return;
  if (const std::shared_ptr<Node>& fn = t.grad_fn()) {
    grad_fn_ = fn;
    output_nr_ = t.output_nr();
  } else if (t.requires_grad()) {
    leaf_ = t.impl_ptr();
    leaf_version_ = t.version();
  }
}

SavedTensor SavedTensor::output(const Tensor& t, const char* op, uint32_t output_nr) {
  SavedTensor saved;
  saved.op_ = op;
  if (!t.defined()) return saved;
  saved.tensor_ = t.detach();
  saved.version_ = t.version();
  saved.output_nr_ = output_nr;
  saved.is_output_ = true;
  return saved;
}

Tensor SavedTensor::get() const {
  HG_CHECK(!tensor_.defined() || tensor_.version() == version_,
           "{}: one of the tensors needed for gradient computation has been modified by an in-place operation: "
           "{} is at version {}; expected version {} instead. Clone it before the in-place op, or make that op "
           "out of place.", op_, tensor_.meta(), tensor_.version(), version_);
  if (!GradMode::is_enabled() || !tensor_.defined()) return tensor_;
  if (leaf_) {
    const Tensor leaf(leaf_);
    HG_CHECK(leaf.version() == leaf_version_, "{}: the leaf {} saved for gradient computation has been modified by an "
             "in-place operation (version {}, expected {})", op_, leaf.meta(), leaf.version(), leaf_version_);
    // A copy the op cast (SavedTensor(t, values, op)): the backward computes in the dtype it read.
    return leaf.dtype() == tensor_.dtype() ? leaf : leaf.to(tensor_.dtype());
  }
  std::shared_ptr<Node> history = grad_fn_;
  if (is_output_) {
    HG_CHECK(running_node != nullptr, "{}: a saved output is read with grad mode on outside its node's backward",
             op_);
    history = running_node->shared_from_this();
  }
  return history ? alias_with_history(tensor_, history, output_nr_) : tensor_;
}

// ---- recording

bool any_requires_grad(std::initializer_list<const Tensor*> inputs) {
  if (!GradMode::is_enabled()) return false;
  for (const Tensor* t : inputs)
    if (t->defined() && t->requires_grad()) return true;
  return false;
}

bool any_requires_grad(const TensorList& inputs) {
  if (!GradMode::is_enabled()) return false;
  for (const Tensor& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

void record(const std::string& name, const TensorList& inputs, const TensorList& outputs, BackwardFn fn,
            DoubleBackward double_backward) {
  if (!any_requires_grad(inputs)) return;
  auto node = std::make_shared<FunctionNode>(name, std::move(fn), double_backward);
  node->sequence_nr = next_sequence_nr++;
  // Edges first: an in-place op passes the same tensor as input and output, and the input's edge must be
  // its history before this op.
  for (const Tensor& in : inputs) {
    node->next_edges.push_back(gradient_edge(in));
    node->input_meta.push_back(in.defined() ? meta_of(in) : TensorMeta{});
  }
  for (uint32_t i = 0; i < outputs.size(); ++i) {
    const Tensor& out = outputs[i];
    node->output_meta.push_back(meta_of(out));
    if (!is_floating(out.dtype())) continue;  // indices, masks: not differentiable
    set_history(out, node, i);
  }
}

void set_history(const Tensor& t, const std::shared_ptr<Node>& node, uint32_t output_nr) {
  AutogradMeta& m = t.impl()->autograd_meta();
  if (m.retains_grad && m.grad_fn) {
    std::erase_if(m.grad_fn->retained, [&](const auto& r) { return r.second.lock().get() == t.impl(); });
    node->retained.emplace_back(output_nr, t.impl_ptr());
  }
  m.grad_fn = node;
  m.output_nr = output_nr;
  m.requires_grad = false;
}

namespace {
// rebase_history's CopySlices node for a view that a recorded write has just given its history.
void give_base_copy_slices(const Tensor& self) {
  const TensorImpl& impl = *self.impl();
  const Tensor base(impl.view_base);
  const ViewPlace place(self, base);
  // The base's gradient: where the view lies, the write's (its node's, which passes on to the view's old values);
  // elsewhere, the base's old values'.
  // (In a pass with create_graph the buffer's writes record, and the views of it returned take their history from it.)
  auto node = std::make_shared<FunctionNode>("CopySlices", [place](const GradContext& g) -> TensorList {
    auto [as_base, as_view] = place.buffer(g[0], /*zeroed=*/false);
    as_base.copy_(g[0]);
    Tensor written = g.needs(1) ? as_view.clone() : Tensor();
    if (!g.needs(0)) return {Tensor(), written};
    if (GradMode::is_enabled()) {
      as_view.copy_(zeros_like(as_view));  // a pass with create_graph: a write that records (fill_ does not)
    } else {
      as_view.fill_(0);
    }
    return {as_base, written};
  }, DoubleBackward::Supported);
  node->sequence_nr = next_sequence_nr++;
  node->next_edges = {gradient_edge(base), Edge{impl.autograd->grad_fn, impl.autograd->output_nr}};
  node->input_meta = {meta_of(base), meta_of(self)};
  node->output_meta = {meta_of(base)};
  set_history(base, node, 0);
  remake_view_history(self, base);  // the view's values are the base's now: so is its history
}
}  // namespace

void rebase_history(const Tensor& self) {
  TensorImpl& impl = *self.impl();
  if (impl.view_base && impl.autograd && impl.autograd->grad_fn) give_base_copy_slices(self);
  // Marked once the write's history is in place, not before: a view refreshed while the write was recorded (copy_'s
  // source) took the base's history from before it, and must take it again.
  impl.storage->mark_history_written();
  if (impl.view_base) impl.history_seen = impl.storage->history_version();
}

std::string backward_name(std::string_view op) {
  std::string name;
  bool upper = true;
  for (char c : op) {
    if (c == '_') {
      upper = true;
      continue;
    }
    name += upper ? char(std::toupper(static_cast<unsigned char>(c))) : c;
    upper = false;
  }
  return name + "Backward";
}

void check_writable(const Tensor& self, const char* op, bool records) {
  if (GradMode::is_enabled() && self.requires_grad()) {
    HG_CHECK(!self.is_leaf(), "{}: a leaf tensor that requires grad ({}) is being used in an in-place operation; "
             "wrap the update in a NoGradGuard, as optimizers do", op, self.meta());
  }
  if (records && self.impl()->view_base) {  // the write becomes part of the base's history (rebase_history)
    const Tensor base(self.impl()->view_base);
    // PyTorch's rule: a view that requires grad of a leaf (one that requires grad, or one made a leaf of its own by
    // requires_grad_(), whose gradient the write would take from it).
    HG_CHECK(!base.is_leaf() || !self.requires_grad(), "{}: {} is a view of a leaf tensor ({}) and requires grad: an "
             "in-place operation that autograd records is refused on it, as in PyTorch; wrap the update in a "
             "NoGradGuard, as optimizers do, or write a clone of the leaf", op, self.meta(), base.meta());
    HG_CHECK(!has_internal_overlap(base), "{}: {} is a view of an expanded tensor ({}), some of whose elements are one "
             "memory location: autograd cannot tell which of them the write changes; clone() it first", op,
             self.meta(), base.meta());
    // (PyTorch's "a view was created in no_grad mode and is being modified inplace with grad mode enabled")
    HG_CHECK(self.requires_grad() || !base.requires_grad(), "{}: {} is a view taken where autograd recorded nothing "
             "(under a NoGradGuard) of a tensor that requires grad ({}), and is written in place where autograd "
             "records: the gradient of the values it overwrites would be lost. Take the view with grad mode on, or "
             "write under a NoGradGuard", op, self.meta(), base.meta());
  }
  HG_CHECK(!has_internal_overlap(self), "{}: {} is an expanded view, some of whose elements are one memory location "
           "(a dim of size > 1 with stride 0): writing it in place is ambiguous; clone() it first", op, self.meta());
}

void check_inplace(const Tensor& self, const char* op, bool records) {
  check_writable(self, op, records);
  self.storage()->bump_version();
  // A tensor written inside a CUDA graph capture is written again by every replay, which runs no host code: each
  // replay bumps its version as this write did, so what saved it, or keeps its autocast cast (core/autocast.h), sees
  // the replay's write.
  if (cuda::capturing_graph(self.device())) {
    cuda::before_each_replay([storage = std::weak_ptr<Storage>(self.storage())] {
      if (const std::shared_ptr<Storage> s = storage.lock()) s->bump_version();
    });
  }
}

// ---- the engine

namespace {

// autograd::grad's request: the gradient arriving at each edge, captured instead of passed on (run_backward).
struct Capture {
  std::vector<Edge> edges;  // one per input: gradient_edge(input)
  TensorList grads;         // filled by the pass; undefined where no gradient arrived
};

// Which nodes a pass for `capture` visits: those from which a captured edge's node can be reached (itself included).
std::unordered_set<Node*> nodes_reaching(const std::vector<std::shared_ptr<Node>>& roots, const Capture& capture) {
  std::unordered_set<Node*> targets, reaching, done;
  for (const Edge& e : capture.edges) targets.insert(e.node.get());
  // Iterative post-order, one root's search to its end before the next root's: a node is decided once every node
  // after it is (a root whose graph passes through another root must not find that one pushed but undecided).
  std::vector<std::pair<Node*, size_t>> stack;
  for (const auto& r : roots) {
    if (!done.insert(r.get()).second) continue;
    stack.emplace_back(r.get(), 0);
    while (!stack.empty()) {
      auto& [n, next] = stack.back();
      if (next < n->next_edges.size()) {
        Node* child = n->next_edges[next++].node.get();
        if (child && done.insert(child).second) stack.emplace_back(child, 0);
        continue;
      }
      bool reaches = targets.count(n) > 0;
      for (const Edge& e : n->next_edges) reaches = reaches || (e.node && reaching.count(e.node.get()));
      if (reaches) reaching.insert(n);
      stack.pop_back();
    }
  }
  return reaching;
}

// The backward pass of backward() and autograd::grad: with `capture`, only the nodes that lead to its edges run, the
// gradient reaching each edge is kept in capture->grads (after the tensor's hooks), and no leaf accumulates.
void run_backward(const TensorList& outputs, const TensorList& grad_outputs, bool retain_graph, bool create_graph,
                  Capture* capture);

}  // namespace

void backward(const TensorList& outputs, const TensorList& grad_outputs, std::optional<bool> retain_graph,
              bool create_graph) {
  if (create_graph) {
    static std::once_flag warned;
    std::call_once(warned, [] {
      logger().warn("backward with create_graph: each leaf's .grad gets a history that leads back to the leaf, a "
                    "reference cycle that holds both until .grad is reset (set_grad(Tensor()), an optimizer's "
                    "zero_grad), as in PyTorch. autograd::grad with create_graph returns the gradients instead");
    });
  }
  run_backward(outputs, grad_outputs, retain_graph.value_or(create_graph), create_graph, nullptr);
}

TensorList autograd::grad(const TensorList& outputs, const TensorList& inputs, const TensorList& grad_outputs,
                          std::optional<bool> retain_graph, bool create_graph, bool allow_unused) {
  HG_CHECK(!outputs.empty() && !inputs.empty(), "autograd::grad: needs outputs and inputs, got {} and {}",
           outputs.size(), inputs.size());
  Capture capture;
  for (size_t i = 0; i < inputs.size(); ++i) {
    HG_CHECK(inputs[i].defined(), "autograd::grad: input {} is undefined", i);
    HG_CHECK(inputs[i].requires_grad(), "autograd::grad: input {} ({}) does not require grad: there is no gradient "
             "to compute", i, inputs[i].meta());
    capture.edges.push_back(gradient_edge(inputs[i]));
  }
  capture.grads.resize(inputs.size());
  run_backward(outputs, grad_outputs, retain_graph.value_or(create_graph), create_graph, &capture);
  for (size_t i = 0; i < inputs.size(); ++i) {
    HG_CHECK(allow_unused || capture.grads[i].defined(), "autograd::grad: input {} ({}) is not used in the graph of "
             "the outputs; pass allow_unused = true to get an undefined tensor for it", i, inputs[i].meta());
  }
  return capture.grads;
}

namespace {

// In a pass with create_graph, the gradients a node whose backward is DoubleBackward::Refused returned (computed with
// grad mode off) get a history that refuses a second derivative: a node whose inputs are the gradients it took and
// the node's own inputs (for what its backward read of them), so that a pass that needs it reaches it and stops with
// an error naming the op, and a pass that does not is not hindered.
void refuse_double_backward(const Node& node, const TensorList& grads_in, TensorList& grads_out) {
  const std::string op = node.name();
  auto refusal = std::make_shared<FunctionNode>(op + "Backward", [op](const GradContext&) -> TensorList {
    HG_FAIL("{}: the gradients it computed (in a pass with create_graph) cannot be differentiated again: its backward "
            "runs kernels of its own that autograd does not record. Differentiate through ops whose backward "
            "supports it (DoubleBackward::Supported, core/autograd.h; docs/pytorch_to_halfgrad.md lists them)", op);
  });
  refusal->sequence_nr = next_sequence_nr++;
  for (const Tensor& g : grads_in) {
    refusal->next_edges.push_back(gradient_edge(g));
    refusal->input_meta.push_back(meta_of(g));
  }
  for (size_t i = 0; i < node.next_edges.size(); ++i) {
    refusal->next_edges.push_back(node.next_edges[i]);
    refusal->input_meta.push_back(node.input_meta[i]);
  }
  for (size_t i = 0; i < grads_out.size(); ++i) {
    Tensor& g = grads_out[i];
    refusal->output_meta.push_back(g.defined() ? meta_of(g) : TensorMeta{});
    if (!g.defined()) continue;
    // A tensor of its own: the backward may have returned a tensor someone else holds (the gradient it was given, one
    // tensor for two inputs), whose history is not this node's to replace.
    g = alias_with_history(g, refusal, uint32_t(i));
  }
}

void run_backward(const TensorList& outputs, const TensorList& grad_outputs, bool retain_graph, bool create_graph,
                  Capture* capture) {
  const char* op = capture ? "autograd::grad" : "backward";
  HG_CHECK(grad_outputs.empty() || grad_outputs.size() == outputs.size(),
           "{}: got {} tensors and {} gradients", op, outputs.size(), grad_outputs.size());
  for (size_t i = 0; i < outputs.size(); ++i) HG_CHECK(outputs[i].defined(), "{}: tensor {} is undefined", op, i);
  // Backward functions are not recorded, but in a pass with create_graph, where those that support it are (the others
  // run with grad mode off, below).
  struct GradModeScope {
    bool outer;
    ~GradModeScope() { GradMode::set_enabled(outer); }
  } grad_mode_scope{GradMode::is_enabled()};
  GradMode::set_enabled(create_graph);
  amp::AutocastGuard no_autocast(kFloat16, /*enabled=*/false);  // gradients run in the dtypes forward chose
  // This pass's queue_callback list; a backward inside a hook has its own, and an error drops the list.
  std::vector<std::function<void()>> callbacks;
  struct CallbackScope {
    std::vector<std::function<void()>>* outer;
    ~CallbackScope() { queued_callbacks = outer; }
  } scope{std::exchange(queued_callbacks, &callbacks)};
  struct PassScope {
    uint64_t outer;
    ~PassScope() { current_pass = outer; }
  } pass_scope{std::exchange(current_pass, ++backward_passes)};

  // Input buffer of each node: the sum of the gradients that reached each of its outputs.
  std::unordered_map<Node*, TensorList> buffers;
  std::unordered_map<Node*, std::shared_ptr<Node>> owners;
  // Gradients on their way to a leaf of another dtype (autocast's float16 weight gradients into float32 parameters:
  // a ResNet-18 step has 22), held and cast together by one cast_each once nothing else is ready to run, where a cast
  // each cost a launch each (ResNet-18 amp as a CUDA graph: 3.57 -> 3.53 ms on an H100). Only for a leaf without
  // hooks (which would see its gradient later), whose first gradient this is: its AccumulateGrad waits for the cast;
  // a later gradient for it casts the held one first, so sums keep their order. Only gradients whose storage (a view's
  // whole storage) holds at most kMaxHeldCastElements, for which a launch is a fair share of the cast's cost: held
  // ones live until the pass's end. Not with create_graph: cast_each records nothing.
  // The same on every device (on the CPU nothing is saved, and the rule is one).
  struct HeldCast {
    Edge edge;
    Tensor grad;
    DType dtype;
  };
  std::vector<HeldCast> held;  // in arrival order
  std::unordered_set<Node*> held_nodes;
  std::vector<Node*> waiting;  // ready AccumulateGrads whose gradient is held
  auto add_to_slot = [&](const Edge& edge, Tensor grad) {
    Node* n = edge.node.get();
    owners.emplace(n, edge.node);
    TensorList& buf = buffers[n];
    if (buf.empty()) buf.resize(n->output_meta.size());
    Tensor& slot = buf[edge.input_nr];
    slot = slot.defined() ? slot.add(grad) : std::move(grad);
  };
  auto cast_held = [&](Node* n) {
    auto it = std::find_if(held.begin(), held.end(), [n](const HeldCast& c) { return c.edge.node.get() == n; });
    HeldCast cast = std::move(*it);
    held.erase(it);
    held_nodes.erase(n);
    add_to_slot(cast.edge, cast.grad.to(cast.dtype));
  };
  auto accumulate = [&](const Edge& edge, Tensor grad) {
    if (held_nodes.count(edge.node.get())) cast_held(edge.node.get());
    add_to_slot(edge, std::move(grad));
  };
  auto holds_cast = [&](const Edge& edge, const Tensor& grad, DType dtype) {
    constexpr int64_t kMaxHeldCastElements = int64_t(1) << 22;  // float16 -> float32: 24 MB, ~10 µs on an H100
    const auto* acc = dynamic_cast<const AccumulateGrad*>(edge.node.get());
    if (create_graph || acc == nullptr || acc->leaf_has_hooks() || held_nodes.count(edge.node.get())) return false;
    const size_t max_bytes = size_t(kMaxHeldCastElements) * element_size(grad.dtype());
    if (grad.storage()->nbytes() > max_bytes || !casts_in_batches(grad, dtype)) return false;
    auto found = buffers.find(edge.node.get());
    return found == buffers.end() || edge.input_nr >= found->second.size() || !found->second[edge.input_nr].defined();
  };
  auto cast_all_held = [&] {
    TensorList grads;
    std::vector<DType> dtypes;
    for (const HeldCast& c : held) {
      grads.push_back(c.grad);
      dtypes.push_back(c.dtype);
    }
    TensorList cast = cast_each(grads, dtypes);
    for (size_t i = 0; i < held.size(); ++i) add_to_slot(held[i].edge, std::move(cast[i]));
    held.clear();
    held_nodes.clear();
  };

  std::vector<std::shared_ptr<Node>> roots;
  for (size_t i = 0; i < outputs.size(); ++i) {
    const Tensor& out = outputs[i];
    HG_CHECK(out.requires_grad(), "{}: tensor {} of the outputs ({}) does not require grad and has no grad_fn", op,
             i, out.meta());
    Tensor grad = i < grad_outputs.size() ? grad_outputs[i] : Tensor();
    if (!grad.defined()) {
      HG_CHECK(out.numel() == 1, "{}: a gradient can be left out only for single-element outputs, got {}; "
               "pass the gradient", op, out.meta());
      grad = ones_like(out);
    }
    HG_CHECK(grad.shape() == out.shape(), "{}: gradient {} does not match output {}", op, grad.meta(), out.meta());
    // A 0-d gradient moves to its output's device, as PyTorch's; any other on another device is the caller's error.
    HG_CHECK(grad.device() == out.device() || grad.dim() == 0, "{}: gradient {} for tensor {} of the outputs is on "
             "another device than the tensor ({})", op, grad.meta(), i, out.meta());
    Edge edge = gradient_edge(out);
    accumulate(edge, grad.to(out.device(), out.dtype()));
    roots.push_back(edge.node);
  }

  // autograd::grad: the nodes that lead to a captured edge; the others neither run nor count.
  const std::unordered_set<Node*> visited = capture ? nodes_reaching(roots, *capture) : std::unordered_set<Node*>();
  auto visits = [&](Node* n) { return n && (!capture || visited.count(n) > 0); };

  // Count, for every reachable node, how many edges lead into it: a node runs once all of them delivered.
  std::unordered_map<Node*, int> dependencies;
  {
    std::vector<Node*> stack;
    std::unordered_set<Node*> seen;
    for (auto& r : roots)
      if (visits(r.get()) && seen.insert(r.get()).second) stack.push_back(r.get());
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      for (const Edge& e : n->next_edges) {
        if (!visits(e.node.get())) continue;
        dependencies[e.node.get()]++;
        if (seen.insert(e.node.get()).second) stack.push_back(e.node.get());
      }
    }
  }

  // Among ready nodes run the most recently created first (reverse creation order is a topological order).
  auto later_first = [](Node* a, Node* b) { return a->sequence_nr < b->sequence_nr; };
  std::priority_queue<Node*, std::vector<Node*>, decltype(later_first)> ready(later_first);
  {
    std::unordered_set<Node*> queued;
    for (auto& r : roots)
      if (visits(r.get()) && dependencies[r.get()] == 0 && queued.insert(r.get()).second) ready.push(r.get());
  }

  for (;;) {
    if (ready.empty()) {
      if (held.empty()) break;
      cast_all_held();
      for (Node* n : waiting) ready.push(n);
      waiting.clear();
      continue;
    }
    Node* node = ready.top();
    ready.pop();
    if (held_nodes.count(node)) {
      waiting.push_back(node);
      continue;
    }
    std::shared_ptr<Node> keep_alive = owners[node];
    TensorList grads = std::move(buffers[node]);
    buffers.erase(node);
    grads.resize(node->output_meta.size());
    std::vector<bool> arrived(grads.size());  // (autograd::grad: an output no gradient reached gives its input none)
    for (size_t i = 0; i < grads.size(); ++i) {
      arrived[i] = grads[i].defined();
      if (!grads[i].defined()) {
        const TensorMeta& m = node->output_meta[i];
        grads[i] = zeros(m.shape, {.dtype = m.dtype, .device = m.device});
      }
    }
    for (size_t h = 0; h < node->pre_hooks.size(); ++h) {  // by index, each copied: a hook may register another
      const auto [output, hook] = node->pre_hooks[h];
      if (hook) grads[output] = hooked(grads[output], hook(grads[output]));
    }
    for (const auto& [output, weak] : node->retained) {  // out of place, as PyTorch's retain_grad
      if (const auto self = weak.lock()) {
        Tensor& stored = self->autograd_meta().grad;
        stored = stored.defined() ? stored.add(grads[output]) : grads[output].clone();
      }
    }
    if (capture) {
      // autograd::grad: an input's gradient is what reaches its edge, after its hooks (a leaf's, which its accumulator
      // would run); a leaf's accumulator does not run, and a node runs on only where it leads to another input.
      const auto* accumulator = dynamic_cast<const AccumulateGrad*>(node);
      if (accumulator) grads[0] = accumulator->hooked_gradient(std::move(grads[0]));  // once, for every capture of it
      for (size_t i = 0; i < capture->edges.size(); ++i) {
        const Edge& e = capture->edges[i];
        if (e.node.get() == node && arrived[e.input_nr]) capture->grads[i] = grads[e.input_nr];
      }
      const bool leads_on = std::any_of(node->next_edges.begin(), node->next_edges.end(),
                                        [&](const Edge& e) { return visits(e.node.get()); });
      if (accumulator || !leads_on) {
        owners.erase(node);
        continue;
      }
    }

    // Each input's gradient so far, handed to the backward to add into where nothing else holds it (not the
    // gradient of one of this node's own outputs: an add's backward passes one tensor to both of its inputs), laid
    // out in some format (not a broadcast view, whose elements overlap), of the input's dtype. Taken out of its slot
    // meanwhile. Not with create_graph: a write into a gradient would not be recorded.
    HandOver hand_over{node, TensorList(node->next_edges.size()), std::vector<bool>(node->next_edges.size(), false),
                       std::vector<bool>(node->next_edges.size(), false)};
    for (size_t i = 0; i < node->next_edges.size(); ++i)
      hand_over.pruned[i] = node->next_edges[i].node && !visits(node->next_edges[i].node.get());
    for (size_t i = 0; i < node->next_edges.size(); ++i) {
      const Edge& edge = node->next_edges[i];
      auto found = edge.node ? buffers.find(edge.node.get()) : buffers.end();
      if (create_graph || found == buffers.end() || edge.input_nr >= found->second.size()) continue;
      Tensor& slot = found->second[edge.input_nr];
      if (slot.defined() && only_holder(slot) &&
          !slot.requires_grad() && slot.dtype() == node->input_meta[i].dtype && storage_format(slot).has_value())
        hand_over.accumulated[i] = std::move(slot);
    }
    TensorList input_grads;
    const bool refused = create_graph && node->double_backward() == DoubleBackward::Refused;
    {
      struct Scope {
        HandOver* outer;
        ~Scope() { t_hand_over = outer; }
      } scope{std::exchange(t_hand_over, &hand_over)};
      if (refused) {
        const TensorList grads_in = grads;
        {
          NoGradGuard no_grad;
          input_grads = node->apply(std::move(grads));
        }
        refuse_double_backward(*node, grads_in, input_grads);
      } else {
        input_grads = node->apply(std::move(grads));
      }
    }
    if (!retain_graph) node->release_saved();

    for (size_t i = 0; i < node->next_edges.size(); ++i) {
      const Edge& edge = node->next_edges[i];
      if (!visits(edge.node.get())) continue;
      Tensor g = i < input_grads.size() ? input_grads[i] : Tensor();
      Tensor handed = std::move(hand_over.accumulated[i]);
      const bool took = hand_over.took[i];
      HG_CHECK(!took || (handed.defined() && g.same(handed)), "{}: backward took the gradient accumulated for input "
               "{} but returned another tensor (a bug in the op's backward)", node->name(), i);
      if (handed.defined() && !took) accumulate(edge, std::move(handed));  // back in its slot, first as before
      if (g.defined()) {
        const TensorMeta& m = node->input_meta[i];
        HG_CHECK(g.shape() == m.shape, "{}: backward returned a gradient {} for input {} of shape {} (a bug in "
                 "the op's backward)", node->name(), g.meta(), i, shape_str(m.shape));
        if (g.device() != m.device) {
          // A 0-d CPU input beside tensors on a device (a number that requires grad, as in x * s) gets its
          // gradient back on the CPU, as PyTorch's validate_outputs moves it; any other device is a bug.
          HG_CHECK(m.shape.empty() && m.device.is_cpu(), "{}: backward returned a gradient {} for input {} on {} (a "
                   "bug in the op's backward)", node->name(), g.meta(), i, m.device.str());
          g = g.to(m.device);
        }
        // A cast passes the gradient back in the input's dtype: now, or with the other leaves' casts.
        if (g.dtype() == m.dtype) {
          accumulate(edge, std::move(g));
        } else if (holds_cast(edge, g, m.dtype)) {
          held_nodes.insert(edge.node.get());
          held.push_back({edge, std::move(g), m.dtype});
        } else {
          accumulate(edge, g.to(m.dtype));
        }
      }
      if (--dependencies[edge.node.get()] == 0) {
        if (!buffers.count(edge.node.get())) owners.emplace(edge.node.get(), edge.node);
        ready.push(edge.node.get());
      }
    }
    owners.erase(node);
  }
  for (size_t i = 0; i < callbacks.size(); ++i) {  // by index: a callback may queue another (and grow the list)
    const std::function<void()> callback = std::move(callbacks[i]);
    callback();
  }
}

}  // namespace

uint64_t current_backward_pass() { return current_pass; }

void queue_callback(std::function<void()> callback) {
  HG_CHECK(queued_callbacks != nullptr, "queue_callback: no backward pass is running on this thread (call it from a "
           "gradient hook)");
  queued_callbacks->push_back(std::move(callback));
}

Tensor sum_to(const Tensor& grad, const Shape& shape) {
  if (grad.shape() == shape) return grad;
  const int64_t lead = grad.dim() - int64_t(shape.size());
  Dims dims;
  for (int64_t d = 0; d < grad.dim(); ++d) {
    if (d < lead || (shape[d - lead] == 1 && grad.size(d) != 1)) dims.push_back(d);
  }
  Tensor r = grad.sum(dims, /*keepdim=*/true);
  return r.view(shape);
}

}  // namespace halfgrad

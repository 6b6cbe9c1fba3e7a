#pragma once
// Autograd: the graph is recorded while ops run, and backward() walks it in reverse.
//
// Each op that has an input requiring grad creates one Node. The node knows, for each input, where that
// input's gradient must go next (an Edge to the input's own grad_fn, or to the AccumulateGrad node of a
// leaf), and holds the backward function the op wrote next to its forward:
//
//   Tensor y = ...;  // the forward's result, computed with grad mode off
//   record("ExpBackward", {x}, {y}, [saved_y = SavedTensor(y, "ExpBackward")](const GradContext& g) -> TensorList {
//     return {g[0] * saved_y.get()};   // d/dx exp(x) = exp(x)
//   });
//
// Backward functions are written with tensor ops, so they run on any device and dtype. The engine runs them
// with grad mode off, after all gradients flowing into a node have been summed; in a pass with create_graph, an op
// whose backward then computes with ops that record (DoubleBackward::Supported) runs it with grad mode on, so the
// gradients it returns have a history of their own and can be differentiated again.
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"

namespace halfgrad {

// Grad mode: on by default, off inside a NoGradGuard (per thread).
struct GradMode {
  static bool is_enabled();
  static void set_enabled(bool enabled);
};

class NoGradGuard {
 public:
  NoGradGuard() : previous_(GradMode::is_enabled()) { GradMode::set_enabled(false); }
  ~NoGradGuard() { GradMode::set_enabled(previous_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool previous_;
};

struct Edge {
  std::shared_ptr<Node> node;  // null: this input needs no gradient
  uint32_t input_nr = 0;       // which of node's outputs the gradient belongs to
};

// What a node remembers of a tensor, to validate or create gradients for it without keeping it alive.
struct TensorMeta {
  Shape shape;
  DType dtype = kFloat32;
  Device device;
  std::string str() const;
};

// What a backward function receives: the gradient of each output (zeros for outputs that received none)
// and which inputs need a gradient at all (so a matmul skips the product nobody wants; under autograd::grad, not those
// whose gradient leads to no requested input).
class GradContext {
 public:
  GradContext(const TensorList& grads, const std::vector<bool>& needs, const TensorList& accumulated,
              std::vector<bool>& took)
      : grads_(grads), needs_(needs), accumulated_(accumulated), took_(took) {}
  const Tensor& operator[](size_t output) const { return grads_[output]; }
  bool needs(size_t input) const { return needs_[input]; }
  // The gradient that the input's other consumers have already delivered, where the engine can hand it over for this
  // backward to add its own into (nothing else holds it or its storage, and it is laid out in some memory format: no
  // broadcast view); else undefined. Its layout is any format's: a backward checks that it is the one it writes. A
  // backward that adds into it calls take_accumulated and returns that very tensor, now the sum, for the input;
  // otherwise the engine adds the two, as always. conv2d's backward adds in cuDNN (beta = 1): a residual block's
  // input then needs no add of its two gradients.
  const Tensor& accumulated(size_t input) const { return accumulated_[input]; }
  void take_accumulated(size_t input) const { took_[input] = true; }

 private:
  const TensorList& grads_;
  const std::vector<bool>& needs_;
  const TensorList& accumulated_;
  std::vector<bool>& took_;
};

// One gradient per input, in order; an undefined Tensor where an input needs none.
using BackwardFn = std::function<TensorList(const GradContext&)>;

// Whether a pass with create_graph may record an op's backward, to differentiate its gradients again. Supported: with
// grad mode on the backward function computes with ops that record (a kernel of its own may serve it otherwise, as
// softmax's), and reads what it saved through SavedTensor (an output saved with SavedTensor::output). Refused (the
// default, for an op of one's own): the pass runs it with grad mode off, and a second derivative through the gradients
// it returns is an error naming the op.
enum class DoubleBackward { Refused, Supported };

class Node : public std::enable_shared_from_this<Node> {
 public:
  // Frees the nodes that only this one holds (and theirs) in a loop, not by recursion: a deep graph (a buffer filled
  // row by row, a long loop of in-place writes) would otherwise overflow the stack as its chain is freed.
  virtual ~Node();
  virtual std::string name() const = 0;
  virtual TensorList apply(TensorList&& grad_outputs) = 0;
  // Drops what the node saved for backward; called after use unless retain_graph.
  virtual void release_saved() {}
  virtual DoubleBackward double_backward() const { return DoubleBackward::Refused; }

  std::vector<Edge> next_edges;             // one per input
  std::vector<TensorMeta> input_meta;       // one per input: gradients are checked and cast to it
  std::vector<TensorMeta> output_meta;      // one per output: missing gradients become zeros of it
  std::vector<std::pair<uint32_t, GradHook>> pre_hooks;  // (output, hook), from register_hook; empty where removed
  // (output, tensor) from retain_grad: the tensor's .grad takes the output's gradient after the pre-hooks changed it
  // (PyTorch 2's order), and moves with the tensor to the node of an in-place op on it (set_history).
  std::vector<std::pair<uint32_t, std::weak_ptr<TensorImpl>>> retained;
  uint64_t sequence_nr = 0;                 // creation order: later nodes run first in backward
};

// The node an op records: its name and its backward function.
class FunctionNode : public Node {
 public:
  FunctionNode(std::string name, BackwardFn fn, DoubleBackward double_backward = DoubleBackward::Refused)
      : name_(std::move(name)), fn_(std::move(fn)), double_backward_(double_backward) {}
  std::string name() const override { return name_; }
  TensorList apply(TensorList&& grad_outputs) override;
  void release_saved() override { fn_ = nullptr; }
  DoubleBackward double_backward() const override { return double_backward_; }

 private:
  std::string name_;
  BackwardFn fn_;  // null once released
  DoubleBackward double_backward_;
};

// The end of every path: adds the incoming gradient into a leaf's .grad (after the leaf's hooks).
class AccumulateGrad : public Node {
 public:
  explicit AccumulateGrad(std::shared_ptr<TensorImpl> leaf) : leaf_(std::move(leaf)) {}
  std::string name() const override { return "AccumulateGrad"; }
  // In a pass with create_graph, .grad takes the gradient with its history (out of place, as PyTorch's).
  TensorList apply(TensorList&& grad_outputs) override;
  DoubleBackward double_backward() const override { return DoubleBackward::Supported; }
  // Whether the leaf has hooks (register_hook, register_post_accumulate_grad_hook) that see its gradient arrive.
  bool leaf_has_hooks() const;
  // grad after the leaf's register_hook hooks, as they give it to .grad (autograd::grad takes it from here).
  Tensor hooked_gradient(Tensor grad) const;

 private:
  std::shared_ptr<TensorImpl> leaf_;
};

// A tensor kept for backward, with the version it had then. Reading it after an in-place write to its
// storage is the classic silent-wrong-gradient bug; get() turns it into an error instead.
class SavedTensor {
 public:
  SavedTensor() = default;
  // Any tensor but an output of the op that saves it: a detached alias, and where it requires grad, where its gradient
  // goes (a leaf itself; else its history when saved, an older node: no reference cycle).
  SavedTensor(const Tensor& t, const char* op);
  // t's values as `values` holds them (a copy the op made of t, contiguous or cast, or t itself), with t's history: the
  // op's kernels read the copy, a pass with create_graph differentiates through t (a leaf t cast to values' dtype).
  SavedTensor(const Tensor& t, const Tensor& values, const char* op);
  // Output `output_nr` of the op that saves it, saved before record() gives it its history: a detached alias alone,
  // since holding its history (the node that holds this) would be a reference cycle; that node is the one whose
  // backward reads it (PyTorch's SavedVariable saves outputs so too).
  static SavedTensor output(const Tensor& t, const char* op, uint32_t output_nr = 0);
  // The tensor as saved. With grad mode on (a pass with create_graph running a backward that supports it), with its
  // history, so that what the backward computes from it is differentiable again.
  Tensor get() const;
  bool defined() const { return tensor_.defined(); }

 private:
  Tensor tensor_;
  uint64_t version_ = 0;
  const char* op_ = "";
  std::shared_ptr<TensorImpl> leaf_;  // a leaf that requires grad
  uint64_t leaf_version_ = 0;         // its version when saved
  std::shared_ptr<Node> grad_fn_;     // the history of a tensor that requires grad through one
  uint32_t output_nr_ = 0;            // of grad_fn_, or of the saving op for an output
  bool is_output_ = false;
};

// True when grad mode is on and any of the tensors requires grad: the op must record a node.
bool any_requires_grad(std::initializer_list<const Tensor*> inputs);
bool any_requires_grad(const TensorList& inputs);

// Creates the node for an op and hangs the outputs on it. Does nothing unless any_requires_grad(inputs).
// Node names follow PyTorch's printing: "MulBackward", "SumBackward" (see backward_name).
void record(const std::string& name, const TensorList& inputs, const TensorList& outputs, BackwardFn fn,
            DoubleBackward double_backward = DoubleBackward::Refused);

// Hangs t on output `output_nr` of `node` (an op's output, or the target of an in-place op, whose history this
// replaces); a tensor that retains its gradient moves that to the new node.
void set_history(const Tensor& t, const std::shared_ptr<Node>& node, uint32_t output_nr);

// After every in-place write that autograd recorded on `self` (self's history now the write's node): where self is a
// view, its base's history becomes a CopySlices node (PyTorch's name) that takes the write's gradient where the view
// lies and the base's old history's elsewhere, and the view's history becomes a view of that. Then marks the storage's
// history written (Storage::history_version), so that earlier views of it take their base's new history.
void rebase_history(const Tensor& self);

// "logical_not" -> "LogicalNotBackward", "add_" -> "AddBackward": the node name for an op name.
std::string backward_name(std::string_view op);

// For in-place ops: checks that `self` may be written (check_writable) and bumps its version counter (inside a
// cuda::Graph capture, also before each replay, which writes it again). Call after the op's own checks, just before
// writing: a refused op must leave the version as it was. records: whether autograd records the op (grad mode is on
// and self or an operand requires grad; the op then calls rebase_history once it has recorded). Refused: a leaf that
// requires grad; where the op records, a view that requires grad of a leaf, a view of an expanded tensor, or one taken
// where nothing recorded of a tensor that requires grad; an expanded view.
void check_inplace(const Tensor& self, const char* op, bool records);
// check_inplace's checks alone, for an op that checks several targets before it writes any (copy_each_).
void check_writable(const Tensor& self, const char* op, bool records);

// Computes gradients of `outputs` (seeded with `grad_outputs`) and accumulates them into the leaves. A leaf without
// hooks whose gradient arrives through a cast from another dtype (autocast's weights) gets it at the pass's end, with
// the other such casts in one launch; a pass that throws leaves those leaves' .grad as it was.
// create_graph (libtorch's): the pass records itself, so that the gradients (a leaf's .grad too) can be differentiated
// again (a Hessian-vector product, a gradient penalty); through an op whose backward is DoubleBackward::Refused that
// second derivative is an error naming it. retain_graph defaults to create_graph, as libtorch's. A leaf's .grad with
// a history leads back to the leaf: the two hold each other until .grad is reset (PyTorch's cycle; a warning, once).
void backward(const TensorList& outputs, const TensorList& grad_outputs = {},
              std::optional<bool> retain_graph = std::nullopt, bool create_graph = false);

// torch.autograd.grad (libtorch's torch::autograd::grad, in its order of arguments): the gradients of `outputs` (seeded
// with `grad_outputs`, which may be left out for single-element outputs, as backward's) with respect to each of
// `inputs`, returned instead of accumulated: no .grad changes and only the nodes that lead to an input run, computing
// only the gradients that lead on (GradContext::needs). An input's gradient is what reaches it after its register_hook
// hooks (a leaf's too), always: PyTorch's takes it before them where the input's node leads on to another input (its
// engine runs those hooks later), after them elsewhere. Post-accumulate hooks do not run, since nothing accumulates; a
// tensor that retains its gradient gets it where its node runs, as in backward. Every input must require grad; one
// the outputs do not depend on (or an output of a node that no gradient reached) is an error, or an undefined tensor
// with allow_unused. With create_graph the result is differentiable, as backward's.
namespace autograd {
TensorList grad(const TensorList& outputs, const TensorList& inputs, const TensorList& grad_outputs = {},
                std::optional<bool> retain_graph = std::nullopt, bool create_graph = false,
                bool allow_unused = false);
}  // namespace autograd

// Runs `callback` when the backward pass running on this thread has run every node, before backward() returns
// (PyTorch's Engine.queue_callback): how a gradient hook defers work to the end of the pass. Callbacks run in the
// order queued; an error in the pass drops them. Only from inside a backward pass (a hook): an error elsewhere.
void queue_callback(std::function<void()> callback);
// The backward pass running on this thread, numbered from 1 in the order passes begin in this process; 0 outside one.
// (A hook tells a new pass from the one whose end it is waiting for, even after a pass that ended in an error.)
uint64_t current_backward_pass();

// Reduces a broadcast gradient back to `shape` (sums over the broadcast dims).
Tensor sum_to(const Tensor& grad, const Shape& shape);

}  // namespace halfgrad

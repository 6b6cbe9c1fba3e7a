#pragma once
// Module: the building block of models, in the spirit of libtorch's torch::nn::Module but simpler.
//
// A module owns named parameters (tensors the optimizer trains), named buffers (state that is not trained
// but belongs to the model, like BatchNorm's running statistics) and named submodules. Names compose with
// dots: a ResNet's parameter is "layer1.0.conv1.weight", the name PyTorch gives the same tensor, so
// checkpoints (nn/checkpoint.h) line up with PyTorch's state_dict.
//
//   class Block : public nn::Module {
//    public:
//     Block() : conv(register_module("conv", std::make_shared<nn::Conv2d>(16, 16, 3))),
//               scale(register_parameter("scale", ones({16, 1, 1}))) {}
//     Tensor forward(const Tensor& x) override { return conv->forward(x) * scale; }  // x: (N, 16, H, W)
//     std::shared_ptr<nn::Conv2d> conv;
//     Tensor& scale;
//   };
//
// ---- One source of truth for each tensor
// The registry owns each parameter and buffer, in a slot whose address never changes (a deque). What
// register_parameter / register_buffer return is a reference to that slot, and layers keep exactly that
// reference as their public member (`Tensor& weight;`). So `linear.weight`, `linear.named_parameters()` and
// the checkpoint code all read the same slot: they cannot diverge, and assigning `linear.weight = t` replaces
// the registered parameter too. (Modules are neither copyable nor movable, which keeps the references valid;
// share them with std::shared_ptr.)
//
// ---- to(): conversion replaces tensors, load_state_dict() does not
// halfgrad tensors are handles. to(device/dtype) replaces each registered tensor that needs converting with
// a NEW leaf tensor (its converted copy, requires_grad kept, .grad converted along) written into the slot;
// tensors already on the right device and dtype are left alone (same object). Consequence: build the
// optimizer AFTER moving or casting the model; an optimizer built before still holds the old tensors.
// (That is also what mixed precision O2 wants: the float32 tensors the optimizer already holds become its
// master weights while the model runs in half.) load_state_dict() and nn::load() instead copy values INTO the
// existing tensors, so an optimizer built earlier keeps training the loaded model.
//
// to(dtype) converts floating-point tensors only (an int64 counter stays int64), as PyTorch's does;
// to(device) moves every tensor. A tensor registered in several places (tied weights: an embedding and the
// output layer sharing one matrix) is converted once, and every slot gets the same new tensor: still tied.
// named_parameters() lists such a tensor once, under its first name (so an optimizer sees it once), as
// PyTorch does; state_dict() lists every name.
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "core/serialize.h"  // NamedTensors
#include "core/tensor.h"

namespace halfgrad::nn {

class Module;
using ModulePtr = std::shared_ptr<Module>;

// What load_state_dict accepts.
struct LoadOptions {
  bool strict = true;            // missing and unexpected names are errors (false: skipped, and reported by the return value)
  bool convert_dtypes = false;   // false: a dtype differing from the model's is an error; true: converted on load
};

// What a non-strict load_state_dict skipped.
struct LoadResult {
  std::vector<std::string> missing_keys;     // in the model, not in the state (but those allowed: may_be_missing)
  std::vector<std::string> unexpected_keys;  // in the state, not in the model
};

class Module {
 public:
  Module() = default;
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;
  Module(Module&&) = delete;
  Module& operator=(Module&&) = delete;

  // ---- forward
  // The single-tensor forward that layers and Sequential use. A module whose forward takes other arguments
  // defines its own method and leaves this one throwing.
  virtual Tensor forward(const Tensor& input);
  Tensor operator()(const Tensor& input) { return forward(input); }

  // ---- registration. Names are non-empty, contain no '.', and are unique within the module.
  // Returns the registry's slot: keep the reference (see the header comment). requires_grad is set on the
  // tensor (a leaf). An undefined tensor registers a slot that the parameter lists skip (an absent bias).
  Tensor& register_parameter(const std::string& name, Tensor value, bool requires_grad = true);
  // A non-persistent buffer is converted by to() but left out of state_dict() and checkpoints.
  Tensor& register_buffer(const std::string& name, Tensor value, bool persistent = true);
  template <typename M> std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> module) {
    add_child(name, module);
    return module;
  }
  // Puts `module` where the submodule `name` was registered (an error if none was) and returns it: libtorch's
  // replace_module, PyTorch's `model.fc = nn.Linear(...)`. A member that held the old one is a copy of the pointer,
  // not the registry: assign it the result, or forward() and the lists (parameters, state_dict, to, train) disagree:
  //   model->fc = model->replace_module("fc", std::make_shared<nn::Linear>(512, 100));
  template <typename M> std::shared_ptr<M> replace_module(const std::string& name, std::shared_ptr<M> module) {
    replace_child(name, module);
    return module;
  }

  // ---- what a module holds. Names are dotted paths from this module; order: registration order, a
  // module's own tensors before its children's (PyTorch's order).
  NamedTensors named_parameters(bool recurse = true) const;
  TensorList parameters(bool recurse = true) const;
  NamedTensors named_buffers(bool recurse = true) const;
  TensorList buffers(bool recurse = true) const;
  // A child registered under two names is listed once, under the first (as PyTorch's).
  std::vector<std::pair<std::string, ModulePtr>> named_children() const;
  // Every registration: a child registered twice, twice (what nn::Sequential runs).
  const std::vector<std::pair<std::string, ModulePtr>>& registered_children() const { return children_; }
  std::vector<ModulePtr> children() const;
  // This module (named "") and every descendant (named by its dotted path), parents before children; a module
  // registered in several places once, under its first path (as PyTorch's named_modules).
  std::vector<std::pair<std::string, Module*>> named_modules();
  std::vector<Module*> modules();
  // The parameter or buffer at a dotted path ("layer1.0.bn1.running_mean"); an error if there is none.
  Tensor& tensor_at(const std::string& dotted_name);

  // Calls fn once on this module and on every descendant (a module under two parents once, where PyTorch's apply
  // visits it for each), parents first as libtorch's (PyTorch's Python apply visits children first).
  void apply(const std::function<void(Module&)>& fn);

  // ---- mode: Dropout and BatchNorm behave differently in training and evaluation.
  void train(bool on = true);  // this module and all descendants
  void eval() { train(false); }
  bool is_training() const { return training_; }

  // ---- conversion (see the header comment)
  void to(Device device);
  void to(DType dtype);
  void to(Device device, DType dtype);
  // Converts the floating tensors of the modules `select` returns true for, each module's own tensors only
  // (every descendant is asked separately). A tensor such a module shares with one left out (a tied weight) is
  // converted for both, as PyTorch's in-place conversion would be: the tie holds. Mixed precision O2, "the model in
  // half except BatchNorm":
  //   model.to(kFloat16, [](const nn::Module& m) { return !dynamic_cast<const nn::BatchNorm2d*>(&m); });
  void to(DType dtype, const std::function<bool(const Module&)>& select);
  // Lays out every floating tensor the format applies to, and its gradient, as `format`: ChannelsLast, the 4-D ones
  // (convolution weights), as PyTorch's model.to(memory_format=torch.channels_last) does: a channels_last input then
  // meets weights that need no copy into its layout, forward or backward; AlignedRows, the 2-D ones (a language
  // model's decoder weight: its products need no padded copy, ops/linear_cross_entropy.h); Contiguous, both back.
  // The optimizer updates them where they are (optim/optimizer.h). Replaces tensors as to(dtype) does; to(device)
  // and to(dtype) keep the layout.
  void to(MemoryFormat format);

  // Forgets every parameter's gradient (undefined, like PyTorch's set_to_none=True).
  void zero_grad();

  // ---- state: persistent parameters and buffers by dotted name: the tensors' own storage, not copies, in detached
  // handles (requires_grad false, as PyTorch's), so that their values may be edited in place.
  NamedTensors state_dict() const;
  // Copies `state` into this module's tensors (in place, under no-grad; across devices as needed). Checks
  // every name, shape and dtype first and reports ALL mismatches in one error, changing nothing; with
  // strict = false, missing and unexpected names are returned instead of being errors. A tensor the state leaves out
  // that its module allows to be missing (may_be_missing) keeps its value and is neither.
  LoadResult load_state_dict(const NamedTensors& state, const LoadOptions& options = {});
  // Whether a state may leave out `name`, one of this module's own parameters or buffers: it then keeps its value
  // and is not reported missing. None here; BatchNorm2d's num_batches_tracked, as PyTorch's BatchNorm, which keeps
  // its own count for a state without one (a plain dict: halfgrad's states carry no versions).
  virtual bool may_be_missing(const std::string& name) const {
    (void)name;
    return false;
  }

  // ---- printing, like PyTorch's repr:
  //   Sequential(
  //     (0): Linear(in_features=4, out_features=8, bias=True)
  //     (1): ReLU()
  //   )
  virtual std::string type_name() const { return "Module"; }
  virtual std::string extra_repr() const { return ""; }  // "in_features=4, out_features=8, bias=True"
  std::string repr() const;

 protected:
  // Values in an extra_repr as Python prints them: True/False, and a float's shortest round-trip digits with its
  // ".0" ("3.0" where fmt prints "3").
  static const char* repr_bool(bool b) { return b ? "True" : "False"; }
  static std::string repr_float(double v);

 private:
  NamedTensors own_tensors() const;  // state_dict's entries, the model's own handles (load_state_dict writes them)
  struct Slot {
    std::string name;
    Tensor tensor;
    bool persistent = true;
  };
  void check_new_name(const std::string& name, const char* what) const;
  void add_child(const std::string& name, ModulePtr module);
  void replace_child(const std::string& name, ModulePtr module);
  // Appends this module's (and, with recurse, its descendants') tensors; `seen`, when given, skips tensors
  // already listed.
  void collect(const std::string& prefix, bool params, bool buffers, bool persistent_only, bool recurse,
               NamedTensors& out, std::unordered_set<const TensorImpl*>* seen) const;
  void collect_modules(const std::string& prefix, std::vector<std::pair<std::string, Module*>>& out,
                       std::unordered_set<const Module*>& seen);
  // The module that owns the tensor at a dotted path, and the tensor's own name in `rest`; nullptr, with the first
  // name that is no child in `missing_child`, where the path leaves the tree.
  Module* owner_of(const std::string& dotted_name, std::string& rest, std::string& missing_child);
  // Converts this module's own tensors; `converted` maps each tensor already converted in this pass (by
  // identity) to (itself, its new version), so shared tensors stay shared. Holding the old tensor keeps its
  // address from being reused by another tensor during the pass.
  struct Conversion {
    const DType* dtype = nullptr;  // null: keep (and likewise below)
    const Device* device = nullptr;
    const MemoryFormat* format = nullptr;
  };
  void convert_own(const Conversion& to, std::unordered_map<const TensorImpl*, std::pair<Tensor, Tensor>>& converted);
  void convert_all(const Conversion& to, const std::function<bool(const Module&)>* select);

  std::deque<Slot> parameters_;  // deque: push_back never moves existing slots, so references stay valid
  std::deque<Slot> buffers_;
  std::vector<std::pair<std::string, ModulePtr>> children_;
  bool training_ = true;
};

}  // namespace halfgrad::nn

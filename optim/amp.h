#pragma once
// Mixed-precision training set-ups, by apex's opt levels:
//
//   O0  float32 everywhere; no loss scaling                        (the baseline)
//   O1  float32 model; forward under autocast (ops run by their precision rule, core/autocast.h);
//       dynamic loss scaling                                       ("AMP" in the benchmark tables)
//   O2  model in half except BatchNorm; FP32 master weights in the optimizer: half gradients are copied to
//       the float32 masters, unscaled and stepped there, and the masters copied back into the half model;
//       dynamic loss scaling                                       (fastai's to_fp16)
//   O3  everything in half, BatchNorm included; no master weights, no scaling  ("FP16" in the tables)
//
// Build the model and the optimizer in float32 first, then:
//
//   amp::Amp amp = amp::initialize(model, optimizer, amp::OptLevel::O2);
//   for (auto [x, y] : batches) {
//     Tensor out = amp.forward(model, x);        // input cast to the model's dtype, autocast for O1
//     Tensor loss = amp.loss([&] { return cross_entropy(out, y); });  // float32 at every level
//     amp.backward(loss);                        // scaled backward
//     amp.step();                                // masters, unscale, skip on overflow, copy back, update scale
//     amp.zero_grad();
//   }
#include <memory>
#include <utility>
#include <vector>

#include "core/autocast.h"
#include "nn/module.h"
#include "optim/grad_scaler.h"
#include "optim/optimizer.h"

namespace halfgrad::amp {

enum class OptLevel { O0, O1, O2, O3 };
const char* opt_level_name(OptLevel level);
OptLevel parse_opt_level(const std::string& name);  // "O0".."O3"; anything else is an error naming it

struct AmpOptions {
  DType half_dtype = kFloat16;   // or kBFloat16 (which needs no loss scaling, though it does no harm)
  GradScalerOptions scaler = {}; // for O1 and O2; its `enabled` is forced off for O0 and O3
};

class Amp {
 public:
  // Runs model(x): a floating x is cast to the half dtype for O2/O3 (as apex does, whatever the first layer: O2's
  // batch norm stays float32 and takes half input), to the first parameter's dtype for O0/O1; O1 runs under an
  // AutocastGuard; O2 returns the output in float32 (losses are computed in float32), as apex does.
  Tensor forward(nn::Module& model, const Tensor& x);
  // Runs fn() as a forward pass of the level: under autocast for O1, as it is otherwise. For models whose forward
  // takes more than one tensor (a language model and its recurrent state); the caller casts its own inputs.
  template <typename Fn> decltype(auto) run(Fn&& fn) {
    if (level_ == OptLevel::O1) {
      AutocastGuard autocast(options_.half_dtype);
      return fn();
    }
    return fn();
  }
  // Runs fn(), a loss of the forward's output, so that the loss is float32 at every level, as PyTorch's loops compute
  // losses under autocast: cross_entropy reads half logits as they are (its float32 math rule, core/autocast.h) and
  // returns float32, without a float32 copy of the logits. At O0 fn() runs as it is.
  template <typename Fn> decltype(auto) loss(Fn&& fn) {
    if (level_ == OptLevel::O0) return fn();
    AutocastGuard autocast(options_.half_dtype);
    return fn();
  }
  // Backward of the (scaled, for O1/O2) loss.
  void backward(const Tensor& loss);
  // Unscales the gradients the optimizer will use (O2: its float32 master weights' gradients) and returns those
  // parameters, for clipping before step(), which then does not unscale again (torch.cuda.amp's unscale_):
  //   amp.backward(loss);
  //   optim::clip_grad_norm_(amp.unscale_(), 0.25);
  //   amp.step();
  TensorList unscale_();
  // Clips the gradients the optimizer will use by their total norm, as optim::clip_grad_norm_(amp.unscale_(), ...)
  // and with the same result, in one reading pass instead of an unscaling and a scaling one
  // (GradScaler::clip_grad_norm_: SGD then unscales and clips as its step reads each gradient; without a loss scaler,
  // as at O0, it clips as it reads, float64 gradients aside). Returns the unscaled norm. Call it in place of
  // unscale_, once before step(); step() or zero_grad() of this Amp uses or forgets the clipping:
  //   amp.backward(loss);
  //   amp.clip_grad_norm_(0.25);
  //   amp.step();
  Tensor clip_grad_norm_(double max_norm, double norm_type = 2.0);
  // One optimizer step with everything the level needs (skipped on the device when a gradient overflowed:
  // scaler().skipped_steps() counts those). O2: a model parameter written since the last step (load_state_dict,
  // nn::load) while its master was not gives the master its value first, as apex's load hook does; otherwise the
  // step's copy of the masters into the model would undo the load. Where both were written (a training checkpoint
  // restores the masters too) the master is kept, and elements whose model value equals the master's rounding keep the
  // master's float32 value (a write of the same values, as DistributedDataParallel's first broadcast, changes nothing).
  // A captured step (cuda::CapturedStep) runs this host code once, at capture: load between replays with
  // sync_masters() then.
  void step();
  // What step() does first: masters take the values of model parameters written since the last step (see step()).
  void sync_masters();
  // Zeroes the model's and the optimizer's gradients, and forgets an unscale_ or clip_grad_norm_ of the ones zeroed:
  // the next step() unscales, checks (and at O2 gathers into the masters) the gradients of the next backward.
  void zero_grad();

  OptLevel level() const { return level_; }
  GradScaler& scaler() { return scaler_; }
  // (master, model) pairs of O2: the optimizer's float32 tensor and the half parameter the model runs with.
  const std::vector<std::pair<Tensor, Tensor>>& master_weights() const { return masters_; }

 private:
  friend Amp initialize(nn::Module&, optim::Optimizer&, OptLevel, AmpOptions);
  Amp(nn::Module& model, optim::Optimizer& optimizer, OptLevel level, AmpOptions options);

  nn::Module* model_;
  optim::Optimizer* optimizer_;
  OptLevel level_;
  AmpOptions options_;
  GradScaler scaler_;
  std::vector<std::pair<Tensor, Tensor>> masters_;
  // O2: (master, model) versions after their last copy; shared with a captured step's before-replay hook, which
  // outlives a move of this object.
  std::shared_ptr<std::vector<std::pair<uint64_t, uint64_t>>> synced_versions_ =
      std::make_shared<std::vector<std::pair<uint64_t, uint64_t>>>();
  bool masters_have_grads_ = false;  // O2: the half gradients of this step were copied to the masters
  Tensor clip_coefficient_;          // without a loss scaler: what clip_grad_norm_ left for step() to multiply by

  void gather_master_grads();
  void note_synced();
};

// Converts `model` as the level says and rewires `optimizer` (which must not have stepped yet) to train it.
Amp initialize(nn::Module& model, optim::Optimizer& optimizer, OptLevel level, AmpOptions options = {});

}  // namespace halfgrad::amp

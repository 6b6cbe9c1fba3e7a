#pragma once
// Dynamic loss scaling (apex / torch.cuda.amp.GradScaler). Float16 gradients below 2^-24 flush to zero;
// multiplying the loss by a large scale S moves every gradient S times up into float16's range. Before the
// optimizer step the gradients are divided by S again ("unscaled") and checked: if any is inf or NaN the
// step is skipped and S halves; after `growth_interval` clean steps in a row S doubles.
//
//   GradScaler scaler;
//   scaler.scale(loss).backward();
//   scaler.unscale_(opt);                 // optional: only needed before clipping gradients
//   clip_grad_norm_(params, 1.0);
//   scaler.step(opt);                     // skips the update when a gradient overflowed
//   scaler.update();
//
// Everything is decided on the device, so a training step waits for nothing: the scale (float32, as PyTorch's),
// the count of clean steps and the count of skipped steps are 0-d tensors on the device of the first gradients or
// loss the scaler sees; unscale_ writes an overflow flag there; step() hands the flag to the optimizer, whose
// fused kernel leaves the parameters alone when it is set (optim::Optimizer::step_unless); update() adjusts the
// scale in one kernel. The host reads the state only when asked (get_scale, state, skipped_steps) and, for the
// overflow diagnosis, on the 1st, 101st, 201st... update.
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/dispatch.h"
#include "core/half.h"  // HG_HOST_DEVICE
#include "core/tensor.h"
#include "optim/optimizer.h"

namespace halfgrad::dist {
class ProcessGroup;
}

namespace halfgrad::amp {

struct GradScalerOptions {
  double init_scale = 65536.0;  // 2^16; within [min_scale, max_scale]
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  // The floor and the ceiling of a dynamic scale. Without a floor, ~150 overflowing steps in a row take the scale
  // to 2^-128 or below, where 1/scale overflows float32, and every later step is skipped however clean (the
  // scaler wedges); at the floor overflowing steps are still skipped, and the scaler warns once (at its next periodic
  // check, within 100 updates). Both leave a run that never gets near them as PyTorch's GradScaler (which has neither)
  // runs it; a grown scale that is not finite in float32 is not taken either, as PyTorch's.
  double min_scale = 0x1p-24;  // float16's smallest subnormal: a scale this low means gradients overflow unscaled
  double max_scale = 3.4028234663852886e38;  // float32's largest finite value
  bool dynamic = true;  // false: a static scale that never changes (overflowing steps are still skipped)
  bool enabled = true;  // false: every call passes through, as for float32 training
  // Below this scale the scaler warns once, naming the first parameter whose gradient overflowed.
  double warn_below_scale = 1.0;
  bool operator==(const GradScalerOptions&) const = default;
};

// Everything needed to resume scaling exactly where it stopped (saved with training checkpoints).
struct GradScalerState {
  double scale = 65536.0;
  int64_t growth_tracker = 0;  // clean steps since the last change of scale
  bool operator==(const GradScalerState&) const = default;
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  // loss * scale. The scale lives on the loss's device as a float32 0-d tensor: no host round trip.
  Tensor scale(const Tensor& loss);
  // Divides the optimizer's gradients by the scale in place and records whether any is inf/NaN.
  // At most once per optimizer between update() calls.
  void unscale_(optim::Optimizer& optimizer);
  // unscale_ and optim::clip_grad_norm_ of the optimizer's gradients in one pass that only reads them: their total
  // norm is taken as they are (scaled), and divided by the scale; a non-finite norm is the overflow flag; and the next
  // step() multiplies each gradient by (clipping's coefficient / scale) as it reads it (Optimizer::step_scaled).
  // Returns the unscaled norm, as clip_grad_norm_. With SGD the gradient tensors are left scaled (its fused kernel
  // multiplies as it reads); other optimizers get them unscaled and clipped before their step. Instead of unscale_,
  // at most once per optimizer between update() calls.
  Tensor clip_grad_norm_(optim::Optimizer& optimizer, double max_norm, double norm_type = 2.0);
  // Unscales if not done yet, then runs the optimizer's step unless a gradient overflowed, decided on the device
  // (optim::Optimizer::step_unless, or step_scaled after clip_grad_norm_).
  void step(optim::Optimizer& optimizer);
  // Adjusts the scale for the next iteration: backoff on overflow, growth after growth_interval clean steps.
  void update();
  // Forgets what unscale_ or clip_grad_norm_ recorded for `optimizer` since the last update(), unless its step() has
  // run: its gradients are being zeroed (Amp::zero_grad), and the next step() must unscale and check the new ones.
  void forget_unscale(optim::Optimizer& optimizer);

  // These read the device (a synchronisation).
  double get_scale() const;
  GradScalerState state() const;
  int64_t skipped_steps() const;  // steps skipped for an overflow since construction (not saved in the state)

  bool is_enabled() const { return options_.enabled; }
  void load_state(const GradScalerState& state);
  const GradScalerOptions& options() const { return options_; }
  // The state as named 0-d tensors for training checkpoints (nn/checkpoint.h's `extra`): "scaler.scale" (float64),
  // "scaler.growth_tracker" (int64), and the options that decide how the scale moves on: "scaler.growth_factor",
  // "scaler.backoff_factor", "scaler.min_scale", "scaler.max_scale" (float64), "scaler.growth_interval" (int64),
  // "scaler.dynamic" (bool).
  std::vector<std::pair<std::string, Tensor>> state_tensors() const;
  // Reads the entries state_tensors() wrote from a checkpoint's named tensors (others are ignored): the state, and the
  // options, which replace this scaler's as PyTorch's load_state_dict does (a file without them keeps these, with a
  // warning). All are checked before anything changes. Once update() has been captured in a CUDA graph, whose kernel
  // holds the options as arguments, a state with other options is refused.
  void load_state_tensors(const std::vector<std::pair<std::string, Tensor>>& named);
  // Data parallelism: the overflow flag is all-reduced (max) over `group` once unscale_ or clip_grad_norm_ has found
  // it, so every rank skips the same steps and keeps the same scale, even when the ranks' gradients differ (they do
  // not after DistributedDataParallel's reduction, unless a rank's own arithmetic overflowed). One 4-byte
  // all-reduce a step, on the group's device.
  void set_process_group(std::shared_ptr<dist::ProcessGroup> group);
  // Names for the overflow diagnosis (model.named_parameters()); without them parameters are numbered.
  void set_parameter_names(std::vector<std::pair<std::string, Tensor>> named);
  // The overflow diagnosis, once the scale fell below warn_below_scale (also logged as a warning).
  const std::string& diagnosis() const { return diagnosis_; }
  // The warning given once the scale was seen at min_scale (empty before), also logged.
  const std::string& floor_warning() const { return floor_warning_; }

 private:
  struct PerOptimizer {
    bool unscaled = false;
    bool stepped = false;
    std::vector<Tensor> found_inf;  // one float32 0-d flag per device the gradients live on
    Tensor grad_scale;              // after clip_grad_norm_: what step() multiplies the gradients by
  };
  PerOptimizer& per_optimizer(optim::Optimizer& optimizer);
  // With a process group: p's flags become one, the maximum over the ranks.
  void agree_on_overflow(PerOptimizer& p) const;
  // Creates the state tensors on `device` the first time; later calls keep the device they were made on.
  void place_state(Device device);
  Tensor scale_on(Device device);
  // 1 (float32, 0-d, on the state's device) when any gradient unscaled for `p` overflowed, else 0.
  Tensor found_inf(const PerOptimizer& p) const;
  void look_at_scale(const Tensor& overflow);
  void diagnose_overflow();

  GradScalerOptions options_;
  GradScalerState pending_;  // the state until place_state() puts it on a device
  Tensor scale_;             // float32 0-d
  Tensor growth_tracker_;    // int32 0-d
  Tensor skipped_;           // int64 0-d
  int64_t updates_ = 0;
  bool captured_update_ = false;  // update() ran in a CUDA graph capture: its options are the graph's
  bool watching_ = false;    // the scale fell below warn_below_scale: diagnose at the next overflow
  std::map<optim::Optimizer*, PerOptimizer> per_optimizer_;
  std::vector<Tensor> loss_was_finite_;  // from scale(): tells forward overflow from gradient overflow
  std::vector<std::pair<std::string, Tensor>> names_;
  std::shared_ptr<dist::ProcessGroup> group_;
  TensorList last_parameters_;
  std::string diagnosis_;
  std::string floor_warning_;
};

// The fused pass behind unscale_: for each gradient g (all of one dtype and device), g *= 1 / scale (scale: the
// float32 0-d scale, read on the device), and found_inf (float32 0-d) becomes 1 if any element of any g is inf or
// NaN. One pass over the gradients; on CUDA one launch per dtype for all of them.
using UnscaleKernel = void (*)(const TensorList& grads, const Tensor& scale, const Tensor& found_inf);
extern KernelTable<UnscaleKernel> unscale_kernel;

// update(), on the state's device (as torch._amp_update_scale_): when found_inf != 0, skipped += 1 and, if dynamic,
// scale *= backoff_factor and growth_tracker = 0; otherwise, if dynamic, growth_tracker += 1 and when it reaches
// growth_interval, scale *= growth_factor (unless that is not finite in float32) and growth_tracker = 0.
struct UpdateScaleArgs {
  Tensor scale, growth_tracker, skipped, found_inf;
  double growth_factor, backoff_factor, min_scale, max_scale;
  int64_t growth_interval;
  bool dynamic;
};

// The update both kernels run (one thread on CUDA), in float32 as the scale is.
HG_HOST_DEVICE inline void update_scale_rule(float& scale, int32_t& tracker, int64_t& skipped, bool found_inf,
                                             float growth_factor, float backoff_factor, float min_scale,
                                             float max_scale, int64_t growth_interval, bool dynamic) {
  if (found_inf) {
    ++skipped;
    if (dynamic) {
      const float backed_off = scale * backoff_factor;
      scale = backed_off > min_scale ? backed_off : min_scale;
      tracker = 0;
    }
  } else if (dynamic && ++tracker == growth_interval) {
    const float grown = scale * growth_factor;
    if (grown - grown == 0.0f) scale = grown < max_scale ? grown : max_scale;  // finite (inf - inf is NaN)
    tracker = 0;
  }
}
using UpdateScaleKernel = void (*)(const UpdateScaleArgs& args);
extern KernelTable<UpdateScaleKernel> update_scale_kernel;

}  // namespace halfgrad::amp

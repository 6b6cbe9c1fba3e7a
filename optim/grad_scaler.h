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
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/dispatch.h"
#include "core/tensor.h"
#include "optim/optimizer.h"

namespace halfgrad::amp {

struct GradScalerOptions {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  bool dynamic = true;  // false: a static scale that never changes (overflowing steps are still skipped)
  bool enabled = true;  // false: every call passes through, as for float32 training
  // Below this scale the scaler warns once, naming the first parameter whose gradient overflowed.
  double warn_below_scale = 1.0;
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
  // Unscales if not done yet, then runs optimizer.step() unless a gradient overflowed. Returns whether the
  // step ran. Reading the overflow flag is the one host synchronisation of the step.
  bool step(optim::Optimizer& optimizer);
  // Adjusts the scale for the next iteration: backoff on overflow, growth after growth_interval clean steps.
  void update();

  double get_scale() const { return state_.scale; }
  bool is_enabled() const { return options_.enabled; }
  GradScalerState state() const { return state_; }
  void load_state(const GradScalerState& state);
  // The state as named 0-d tensors for training checkpoints (nn/checkpoint.h's `extra`):
  // "scaler.scale" (float64) and "scaler.growth_tracker" (int64).
  std::vector<std::pair<std::string, Tensor>> state_tensors() const;
  // Reads the entries state_tensors() wrote from a checkpoint's named tensors (others are ignored).
  void load_state_tensors(const std::vector<std::pair<std::string, Tensor>>& named);
  // Names for the overflow diagnosis (model.named_parameters()); without them parameters are numbered.
  void set_parameter_names(std::vector<std::pair<std::string, Tensor>> named);
  // The overflow diagnosis, once the scale fell below warn_below_scale (also logged as a warning).
  const std::string& diagnosis() const { return diagnosis_; }

 private:
  struct PerOptimizer {
    bool unscaled = false;
    bool stepped = false;
    std::vector<Tensor> found_inf;  // one float32 0-d flag per device the gradients live on
  };
  PerOptimizer& per_optimizer(optim::Optimizer& optimizer);
  Tensor scale_on(Device device);
  bool found_inf(const PerOptimizer& p) const;  // the host sync
  void diagnose_overflow();

  GradScalerOptions options_;
  GradScalerState state_;
  std::map<Device, Tensor> scale_tensors_;  // the scale, one copy per device in use
  std::map<optim::Optimizer*, PerOptimizer> per_optimizer_;
  std::vector<Tensor> loss_was_finite_;  // from scale(): tells forward overflow from gradient overflow
  std::vector<std::pair<std::string, Tensor>> names_;
  TensorList last_parameters_;
  std::string diagnosis_;
};

// The fused pass behind unscale_: for each gradient g (all of one dtype and device), g *= inv_scale, and
// found_inf (float32 0-d) becomes 1 if any element of any g is inf or NaN. One pass over the gradients; on
// CUDA one launch per dtype for all of them.
using UnscaleKernel = void (*)(const TensorList& grads, const Tensor& inv_scale, const Tensor& found_inf);
extern KernelTable<UnscaleKernel> unscale_kernel;

}  // namespace halfgrad::amp

#pragma once
// RMSprop with PyTorch's update (torch.optim.RMSprop: eps outside the square root, the centered variant's running
// mean of the gradient, momentum on the scaled gradient); the rule per element is optim/update_rules.h's
// rmsprop_update. The update is one fused pass per (group, device, dtype): optim/fused.h.
// State per parameter, in the parameter's dtype: square_avg; grad_avg once centered is on, momentum_buffer once
// momentum is not 0 (each made, zeros, on the first step that needs it, as PyTorch's are on the first step, and kept
// when the option is turned off); and the step count, as PyTorch keeps it (the update does not read it).
#include <string>
#include <vector>

#include "optim/optimizer.h"

namespace halfgrad::optim {

// PyTorch's defaults.
struct RMSpropOptions {
  double lr = 1e-2;
  double alpha = 0.99;  // the running averages' decay, in [0, 1] (PyTorch takes more; above 1 square_avg goes negative)
  double eps = 1e-8;
  double weight_decay = 0;
  double momentum = 0;
  bool centered = false;
};
inline double* momentum_of(RMSpropOptions& o) { return &o.momentum; }
inline std::vector<OptionField> other_options_of(RMSpropOptions& o) {
  return {{.name = "alpha", .number = &o.alpha}, {.name = "eps", .number = &o.eps},
          {.name = "weight_decay", .number = &o.weight_decay},
          {.name = "centered", .flag = &o.centered}};
}

using RMSpropGroup = Group<RMSpropOptions>;

class RMSprop : public OptimizerWith<RMSpropOptions> {
 public:
  RMSprop(TensorList params, RMSpropOptions options = {});
  explicit RMSprop(std::vector<RMSpropGroup> groups);
  void step() override;

 protected:
  // The buffers' places, whatever the options: a buffer is made when an option first needs it.
  enum Buffer : size_t { kSquareAvg, kGradAvg, kMomentumBuffer };
  std::vector<std::string> state_names(size_t) const override {
    return {"square_avg", "grad_avg", "momentum_buffer"};
  }
  size_t required_buffers(size_t) const override { return 1; }  // square_avg
  bool counts_steps() const override { return true; }
  void check_group_options(const RMSpropOptions& options, size_t g) const override;
};

}  // namespace halfgrad::optim

#pragma once
// RMSprop with PyTorch's update (torch.optim.RMSprop: eps outside the square root, the centered variant's running
// mean of the gradient, momentum on the scaled gradient); the rule per element is optim/update_rules.h's
// rmsprop_update. The update is one fused pass per (group, device, dtype): optim/fused.h.
// State per parameter, in the parameter's dtype: square_avg; grad_avg where centered; momentum_buffer where momentum
// is not 0 (created, zeros, on the first step with momentum); and the step count, as PyTorch keeps it.
#include <cstdint>
#include <string>
#include <vector>

#include "optim/optimizer.h"

namespace halfgrad::optim {

// PyTorch's defaults. `centered` decides which buffers a parameter keeps, so a checkpoint loads only into an optimizer
// with the file's value; so does whether momentum is 0.
struct RMSpropOptions {
  double lr = 1e-2;
  double alpha = 0.99;  // the running averages' decay
  double eps = 1e-8;
  double weight_decay = 0;
  double momentum = 0;
  bool centered = false;
};
inline double* momentum_of(RMSpropOptions& o) { return &o.momentum; }
inline std::vector<OptionField> other_options_of(RMSpropOptions& o) {
  return {{.name = "alpha", .number = &o.alpha}, {.name = "eps", .number = &o.eps},
          {.name = "weight_decay", .number = &o.weight_decay},
          {.name = "centered", .flag = &o.centered, .shapes_state = true}};
}

using RMSpropGroup = Group<RMSpropOptions>;

class RMSprop : public OptimizerWith<RMSpropOptions> {
 public:
  RMSprop(TensorList params, RMSpropOptions options = {});
  explicit RMSprop(std::vector<RMSpropGroup> groups);
  void step() override;

 protected:
  // "square_avg", then "grad_avg" (centered), then "momentum_buffer" (momentum != 0).
  std::vector<std::string> state_names(size_t g) const override;
  bool counts_steps() const override { return true; }
  void check_group_options(const RMSpropOptions& options, size_t g) const override;

 private:
  // Per group, the `centered` its first step ran with (-1: none yet): the buffers' places follow it.
  std::vector<int8_t> stepped_centered_;
};

}  // namespace halfgrad::optim

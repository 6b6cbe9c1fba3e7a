#pragma once
// Adagrad with PyTorch's update (torch.optim.Adagrad: each element's step divided by the square root of its gradients'
// squares summed so far, an lr decayed by each parameter's own step count, eps outside the square root); the rule per
// element is optim/update_rules.h's adagrad_update. The update is one fused pass per (group, device, dtype):
// optim/fused.h.
// State per parameter: step and sum (in the parameter's dtype), made on its first step with a gradient, the sum filled
// with initial_accumulator_value (PyTorch makes it in the constructor; the values are the same).
// Adagrad has no momentum: param_group(g).momentum.exists() is false (reading or writing it throws), its checkpoints
// hold none, and OneCycleLR needs cycle_momentum = false with it.
#include <string>
#include <vector>

#include "optim/optimizer.h"

namespace halfgrad::optim {

// PyTorch's defaults.
struct AdagradOptions {
  double lr = 1e-2;
  double lr_decay = 0;
  double weight_decay = 0;
  double initial_accumulator_value = 0;
  double eps = 1e-10;
};
inline double* momentum_of(AdagradOptions&) { return nullptr; }
inline std::vector<OptionField> other_options_of(AdagradOptions& o) {
  return {{.name = "lr_decay", .number = &o.lr_decay}, {.name = "weight_decay", .number = &o.weight_decay},
          {.name = "initial_accumulator_value", .number = &o.initial_accumulator_value},
          {.name = "eps", .number = &o.eps}};
}

using AdagradGroup = Group<AdagradOptions>;

class Adagrad : public OptimizerWith<AdagradOptions> {
 public:
  Adagrad(TensorList params, AdagradOptions options = {});
  explicit Adagrad(std::vector<AdagradGroup> groups);
  void step() override;

 protected:
  std::vector<std::string> state_names(size_t) const override { return {"sum"}; }
  bool counts_steps() const override { return true; }
  void check_group_options(const AdagradOptions& options, size_t g) const override;
};

}  // namespace halfgrad::optim

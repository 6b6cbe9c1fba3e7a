#pragma once
// Stochastic gradient descent with PyTorch's semantics (torch.optim.SGD): momentum, dampening, nesterov and weight
// decay; the rule per element is optim/update_rules.h's sgd_update. The update is one fused pass per (group,
// device, dtype): optim/fused.h.
#include <vector>

#include "optim/optimizer.h"

namespace halfgrad::optim {

struct SGDOptions {
  double lr = 1e-3;
  double momentum = 0;
  double dampening = 0;
  double weight_decay = 0;
  bool nesterov = false;
};
inline double* momentum_of(SGDOptions& o) { return &o.momentum; }
inline std::vector<OptionField> other_options_of(SGDOptions& o) {
  return {{.name = "dampening", .number = &o.dampening}, {.name = "weight_decay", .number = &o.weight_decay},
          {.name = "nesterov", .flag = &o.nesterov}};
}

// Parameters that share options, as PyTorch's param_groups.
using SGDGroup = Group<SGDOptions>;

class SGD : public OptimizerWith<SGDOptions> {
 public:
  SGD(TensorList params, SGDOptions options);
  explicit SGD(std::vector<SGDGroup> groups);
  void step() override;
  void step_unless(const Tensor& found_inf) override;
  void step_scaled(const Tensor& found_inf, const Tensor& grad_scale) override;

 protected:
  // State per parameter: "momentum_buffer" (undefined until the first step with momentum).
  std::vector<std::string> state_names(size_t) const override { return {"momentum_buffer"}; }
  bool counts_steps() const override { return false; }
  void check_group_options(const SGDOptions& options, size_t g) const override;

 private:
  // found_inf undefined: always; grad_scale undefined: the gradients as they are (fused.h's SGDStepArgs)
  void run_step(const Tensor& found_inf, const Tensor& grad_scale = Tensor());
  // Whether this step would create a momentum buffer under dampening: b = g on a first step is only the same as
  // b = momentum * 0 + (1 - dampening) * g without dampening, so a step skipped on the device could not be told
  // from a first one.
  bool creates_dampened_buffer();
  Tensor replayed_hyperparameters(size_t g, Device device);
};

}  // namespace halfgrad::optim

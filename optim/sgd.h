#pragma once
// Stochastic gradient descent with PyTorch's semantics (torch.optim.SGD):
//   g = grad + weight_decay * p
//   b = momentum * b + (1 - dampening) * g      (b = g on the first step)
//   g = nesterov ? g + momentum * b : b         (when momentum != 0)
//   p = p - lr * g
// The update is one fused pass per (group, device, dtype): optim/fused.h.
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
inline double& momentum_of(SGDOptions& o) { return o.momentum; }

// Parameters that share options, as PyTorch's param_groups.
using SGDGroup = Group<SGDOptions>;

class SGD : public OptimizerWith<SGDOptions> {
 public:
  SGD(TensorList params, SGDOptions options);
  explicit SGD(std::vector<SGDGroup> groups);
  void step() override;

 protected:
  // State per parameter: "momentum_buffer" (undefined until the first step with momentum).
  std::vector<std::string> state_names(size_t) const override { return {"momentum_buffer"}; }
  bool counts_steps() const override { return false; }
};

}  // namespace halfgrad::optim

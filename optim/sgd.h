#pragma once
// Stochastic gradient descent with PyTorch's semantics (torch.optim.SGD):
//   g = grad + weight_decay * p
//   b = momentum * b + (1 - dampening) * g      (b = g on the first step)
//   g = nesterov ? g + momentum * b : b         (when momentum != 0)
//   p = p - lr * g
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

// Parameters that share options, as PyTorch's param_groups.
struct SGDGroup {
  TensorList params;
  SGDOptions options;
};

class SGD : public Optimizer {
 public:
  SGD(TensorList params, SGDOptions options);
  explicit SGD(std::vector<SGDGroup> groups);
  void step() override;
  TensorList parameters() const override;
  std::vector<SGDGroup>& param_groups() { return groups_; }

 private:
  std::vector<SGDGroup> groups_;
  std::vector<TensorList> momentum_buffers_;  // [group][param], undefined until the first step with momentum
};

}  // namespace halfgrad::optim

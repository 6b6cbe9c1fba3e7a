#pragma once
// Adam and AdamW with PyTorch's update (torch.optim.Adam / AdamW: bias correction from each parameter's own step
// count, eps outside the square root, AdamW's weight decay decoupled from the gradient, amsgrad); the rule per
// element is optim/update_rules.h's adam_update. The update is one fused pass per (group, device, dtype):
// optim/fused.h.
// State per parameter: step, exp_avg (m), exp_avg_sq (v), max_exp_avg_sq (amsgrad), in the parameter's dtype.
#include <utility>
#include <vector>

#include "optim/optimizer.h"

namespace halfgrad::optim {

struct AdamOptions {
  double lr = 1e-3;
  std::pair<double, double> betas = {0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 0;  // L2 penalty added to the gradient
  bool amsgrad = false;
};
inline double& momentum_of(AdamOptions& o) { return o.betas.first; }

// The same options; PyTorch's AdamW defaults to weight_decay 1e-2, decoupled from the gradient.
struct AdamWOptions {
  double lr = 1e-3;
  std::pair<double, double> betas = {0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool amsgrad = false;
};
inline double& momentum_of(AdamWOptions& o) { return o.betas.first; }

template <typename Options> struct AdamStepper;  // the step both share (optim/adam.cpp)

using AdamGroup = Group<AdamOptions>;
using AdamWGroup = Group<AdamWOptions>;

class Adam : public OptimizerWith<AdamOptions> {
 public:
  Adam(TensorList params, AdamOptions options = {});
  explicit Adam(std::vector<AdamGroup> groups);
  void step() override;

 protected:
  std::vector<std::string> state_names(size_t g) const override;
  bool counts_steps() const override { return true; }
  template <typename> friend struct AdamStepper;
};

class AdamW : public OptimizerWith<AdamWOptions> {
 public:
  AdamW(TensorList params, AdamWOptions options = {});
  explicit AdamW(std::vector<AdamWGroup> groups);
  void step() override;

 protected:
  std::vector<std::string> state_names(size_t g) const override;
  bool counts_steps() const override { return true; }
  template <typename> friend struct AdamStepper;
};

}  // namespace halfgrad::optim

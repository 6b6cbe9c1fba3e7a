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

// Adam's and AdamW's options: the same fields. They differ in weight decay alone: Adam adds it to the gradient (an L2
// penalty), AdamW decays the parameter apart from the gradient (decoupled) and defaults to 1e-2, as PyTorch's.
template <bool kDecoupled> struct AdamFamilyOptions {
  double lr = 1e-3;
  std::pair<double, double> betas = {0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = kDecoupled ? 1e-2 : 0;
  bool amsgrad = false;
};
using AdamOptions = AdamFamilyOptions<false>;
using AdamWOptions = AdamFamilyOptions<true>;
template <bool kDecoupled> double* momentum_of(AdamFamilyOptions<kDecoupled>& o) { return &o.betas.first; }
template <bool kDecoupled> std::vector<OptionField> other_options_of(AdamFamilyOptions<kDecoupled>& o) {
  return {{.name = "beta2", .number = &o.betas.second}, {.name = "eps", .number = &o.eps},
          {.name = "weight_decay", .number = &o.weight_decay},
          {.name = "amsgrad", .flag = &o.amsgrad, .shapes_state = true}};
}

using AdamGroup = Group<AdamOptions>;
using AdamWGroup = Group<AdamWOptions>;

// The optimizer both are (optim/adam.cpp); Adam and AdamW below name its two forms.
template <bool kDecoupled> class AdamFamily : public OptimizerWith<AdamFamilyOptions<kDecoupled>> {
 public:
  using Options = AdamFamilyOptions<kDecoupled>;
  AdamFamily(TensorList params, Options options = {});
  explicit AdamFamily(std::vector<Group<Options>> groups);
  void step() override;

 protected:
  std::vector<std::string> state_names(size_t g) const override;
  bool counts_steps() const override { return true; }
  void check_group_options(const Options& options, size_t g) const override;
};

class Adam : public AdamFamily<false> {
 public:
  using AdamFamily::AdamFamily;
};

class AdamW : public AdamFamily<true> {
 public:
  using AdamFamily::AdamFamily;
};

}  // namespace halfgrad::optim

#include "optim/adam.h"

#include <cmath>

#include "core/autograd.h"
#include "core/cuda.h"
#include "optim/fused.h"

namespace halfgrad::optim {

namespace {

template <typename Options> void check_options(const char* name, const Options& o, size_t g) {
  check_not_negative(name, "learning rate", o.lr, g);
  check_not_negative(name, "eps", o.eps, g);
  HG_CHECK(o.betas.first >= 0 && o.betas.first < 1, "{}: invalid beta1 {} (group {}): must be in [0, 1)", name,
           o.betas.first, g);
  HG_CHECK(o.betas.second >= 0 && o.betas.second < 1, "{}: invalid beta2 {} (group {}): must be in [0, 1)", name,
           o.betas.second, g);
  check_not_negative(name, "weight_decay", o.weight_decay, g);
}

}  // namespace

template <bool kDecoupled>
AdamFamily<kDecoupled>::AdamFamily(TensorList params, Options options)
    : AdamFamily(std::vector<Group<Options>>{{std::move(params), options}}) {}

template <bool kDecoupled>
AdamFamily<kDecoupled>::AdamFamily(std::vector<Group<Options>> groups)
    : OptimizerWith<Options>(kDecoupled ? "AdamW" : "Adam", std::move(groups)) {
  for (size_t g = 0; g < this->groups_.size(); ++g) check_group_options(this->groups_[g].options, g);
  this->check_parameters();
}

template <bool kDecoupled>
void AdamFamily<kDecoupled>::check_group_options(const Options& options, size_t g) const {
  check_options(this->name(), options, g);
}

template <bool kDecoupled> std::vector<std::string> AdamFamily<kDecoupled>::state_names(size_t g) const {
  if (this->groups_.at(g).options.amsgrad) return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  return {"exp_avg", "exp_avg_sq"};
}

template <bool kDecoupled> void AdamFamily<kDecoupled>::step() {
  NoGradGuard no_grad;
  this->check_step();
  for (size_t g = 0; g < this->groups_.size(); ++g) {
    const Options& o = this->groups_[g].options;
    for (const auto& items : this->step_items(g)) {
      // The bias corrections come from step counts kept on the host, which a replayed graph would freeze.
      HG_CHECK(!cuda::is_capturing(items[0].param.device()),
               "{}: a step inside a CUDA graph capture would replay its first bias correction forever (the step "
               "counts live on the host); use SGD with --cuda-graph, or train eagerly", this->name());
      AdamStepArgs args;
      args.lr = o.lr;
      args.beta1 = o.betas.first;
      args.beta2 = o.betas.second;
      args.eps = o.eps;
      args.weight_decay = o.weight_decay;
      args.decoupled_weight_decay = kDecoupled;
      args.amsgrad = o.amsgrad;
      for (const auto& item : items) {
        this->add_tensors(args, item);
        args.exp_avgs.push_back(this->state_buffer(g, item, 0));
        args.exp_avg_sqs.push_back(this->state_buffer(g, item, 1));
        if (o.amsgrad) args.max_exp_avg_sqs.push_back(this->state_buffer(g, item, 2));
        // Bias corrections from the parameter's own step count, in double on the host, as PyTorch's single-tensor
        // and foreach Adam compute them.
        const double t = double(++this->state(g, item.index).step);
        args.step_sizes.push_back(o.lr / (1 - std::pow(o.betas.first, t)));
        args.bias_correction2_sqrts.push_back(std::sqrt(1 - std::pow(o.betas.second, t)));
      }
      adam_step_kernel[items[0].param.device()](args);
      this->write_back(items);
    }
  }
}

template class AdamFamily<false>;
template class AdamFamily<true>;

}  // namespace halfgrad::optim

#include "optim/adam.h"

#include <cmath>

#include "core/autograd.h"
#include "core/cuda.h"
#include "optim/fused.h"

namespace halfgrad::optim {

namespace {

template <typename Options> void check_options(const char* name, const Options& o, size_t g) {
  HG_CHECK(o.lr >= 0, "{}: invalid learning rate {} (group {})", name, o.lr, g);
  HG_CHECK(o.eps >= 0, "{}: invalid eps {} (group {})", name, o.eps, g);
  HG_CHECK(o.betas.first >= 0 && o.betas.first < 1, "{}: invalid beta1 {} (group {}): must be in [0, 1)", name,
           o.betas.first, g);
  HG_CHECK(o.betas.second >= 0 && o.betas.second < 1, "{}: invalid beta2 {} (group {}): must be in [0, 1)", name,
           o.betas.second, g);
  HG_CHECK(o.weight_decay >= 0, "{}: invalid weight_decay {} (group {})", name, o.weight_decay, g);
}

std::vector<std::string> adam_state_names(bool amsgrad) {
  if (amsgrad) return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  return {"exp_avg", "exp_avg_sq"};
}

}  // namespace

// Adam and AdamW differ only in where weight decay goes; one step function serves both.
template <typename Options> struct AdamStepper {
  template <typename Opt> static void step(Opt& opt, bool decoupled) {
    NoGradGuard no_grad;
    for (size_t g = 0; g < opt.groups_.size(); ++g) {
      const Options& o = opt.groups_[g].options;
      for (const auto& items : opt.step_items(g)) {
        // The bias corrections come from step counts kept on the host, which a replayed graph would freeze.
        HG_CHECK(!cuda::is_capturing(items[0].param.device()),
                 "{}: a step inside a CUDA graph capture would replay its first bias correction forever (the step "
                 "counts live on the host); use SGD with --cuda-graph, or train eagerly", opt.name());
        AdamStepArgs args;
        args.lr = o.lr;
        args.beta1 = o.betas.first;
        args.beta2 = o.betas.second;
        args.eps = o.eps;
        args.weight_decay = o.weight_decay;
        args.decoupled_weight_decay = decoupled;
        args.amsgrad = o.amsgrad;
        for (const auto& item : items) {
          args.params.push_back(item.param);
          args.grads.push_back(item.grad);
          args.exp_avgs.push_back(opt.state_buffer(g, item, 0));
          args.exp_avg_sqs.push_back(opt.state_buffer(g, item, 1));
          if (o.amsgrad) args.max_exp_avg_sqs.push_back(opt.state_buffer(g, item, 2));
          // Bias corrections from the parameter's own step count, in double on the host, as PyTorch's
          // single-tensor and foreach Adam compute them.
          const double t = double(++opt.state(g, item.index).step);
          args.step_sizes.push_back(o.lr / (1 - std::pow(o.betas.first, t)));
          args.bias_correction2_sqrts.push_back(std::sqrt(1 - std::pow(o.betas.second, t)));
        }
        adam_step_kernel[items[0].param.device()](args);
        Opt::write_back(items);  // through Opt, whose friend this is (clang refuses the base class's name)
      }
    }
  }
};

Adam::Adam(TensorList params, AdamOptions options) : Adam(std::vector<AdamGroup>{{std::move(params), options}}) {}
Adam::Adam(std::vector<AdamGroup> groups) : OptimizerWith("Adam", std::move(groups)) {
  for (size_t g = 0; g < groups_.size(); ++g) check_options(name(), groups_[g].options, g);
  check_parameters();
}
std::vector<std::string> Adam::state_names(size_t g) const { return adam_state_names(groups_.at(g).options.amsgrad); }
void Adam::step() { AdamStepper<AdamOptions>::step(*this, /*decoupled=*/false); }

AdamW::AdamW(TensorList params, AdamWOptions options)
    : AdamW(std::vector<AdamWGroup>{{std::move(params), options}}) {}
AdamW::AdamW(std::vector<AdamWGroup> groups) : OptimizerWith("AdamW", std::move(groups)) {
  for (size_t g = 0; g < groups_.size(); ++g) check_options(name(), groups_[g].options, g);
  check_parameters();
}
std::vector<std::string> AdamW::state_names(size_t g) const {
  return adam_state_names(groups_.at(g).options.amsgrad);
}
void AdamW::step() { AdamStepper<AdamWOptions>::step(*this, /*decoupled=*/true); }

}  // namespace halfgrad::optim

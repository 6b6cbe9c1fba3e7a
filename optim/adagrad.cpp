#include "optim/adagrad.h"

#include "core/autograd.h"
#include "core/cuda.h"
#include "optim/fused.h"

namespace halfgrad::optim {

Adagrad::Adagrad(TensorList params, AdagradOptions options)
    : Adagrad(std::vector<AdagradGroup>{{std::move(params), options}}) {}

Adagrad::Adagrad(std::vector<AdagradGroup> groups) : OptimizerWith("Adagrad", std::move(groups)) {
  for (size_t g = 0; g < groups_.size(); ++g) check_group_options(groups_[g].options, g);
  check_parameters();
}

void Adagrad::check_group_options(const AdagradOptions& o, size_t g) const {
  check_not_negative("Adagrad", "learning rate", o.lr, g);
  check_not_negative("Adagrad", "lr_decay", o.lr_decay, g);
  check_not_negative("Adagrad", "weight_decay", o.weight_decay, g);
  check_not_negative("Adagrad", "initial_accumulator_value", o.initial_accumulator_value, g);
  check_not_negative("Adagrad", "eps", o.eps, g);
}

void Adagrad::step() {
  NoGradGuard no_grad;
  check_step();
  for (size_t g = 0; g < groups_.size(); ++g) {
    const AdagradOptions& o = groups_[g].options;
    for (const std::vector<StepItem>& items : step_items(g)) {
      // The decayed lr comes from step counts kept on the host, which a replayed graph would freeze.
      HG_CHECK(!cuda::is_capturing(items[0].param.device()),
               "Adagrad: a step inside a CUDA graph capture would replay its first decayed lr forever (the step "
               "counts live on the host); use SGD with --cuda-graph, or train eagerly");
      AdagradStepArgs args;
      args.eps = o.eps;
      args.weight_decay = o.weight_decay;
      for (const StepItem& item : items) {
        add_tensors(args, item);
        bool created = false;
        args.sums.push_back(state_buffer(g, item, 0, &created));
        // The buffer's elements, not the flat view of its storage: an aligned-rows buffer's padding stays zero.
        if (created && o.initial_accumulator_value != 0)
          state(g, item.index).buffers[0].fill_(o.initial_accumulator_value);
        // As PyTorch's, in double on the host.
        const double t = double(++state(g, item.index).step);
        args.clrs.push_back(o.lr / (1 + (t - 1) * o.lr_decay));
      }
      adagrad_step_kernel[items[0].param.device()](args);
      write_back(items);
    }
  }
}

}  // namespace halfgrad::optim

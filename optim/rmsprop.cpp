#include "optim/rmsprop.h"

#include "core/autograd.h"
#include "core/cuda.h"
#include "optim/fused.h"

namespace halfgrad::optim {

RMSprop::RMSprop(TensorList params, RMSpropOptions options)
    : RMSprop(std::vector<RMSpropGroup>{{std::move(params), options}}) {}

RMSprop::RMSprop(std::vector<RMSpropGroup> groups) : OptimizerWith("RMSprop", std::move(groups)) {
  for (size_t g = 0; g < groups_.size(); ++g) check_group_options(groups_[g].options, g);
  check_parameters();
}

void RMSprop::check_group_options(const RMSpropOptions& o, size_t g) const {
  check_not_negative("RMSprop", "learning rate", o.lr, g);
  HG_CHECK(o.alpha >= 0 && o.alpha <= 1, "RMSprop: invalid alpha {} (group {}): must be in [0, 1] (PyTorch takes any "
           "alpha >= 0, but above 1 the average of the squares turns negative)", o.alpha, g);
  check_not_negative("RMSprop", "eps", o.eps, g);
  check_not_negative("RMSprop", "weight_decay", o.weight_decay, g);
  check_not_negative("RMSprop", "momentum", o.momentum, g);
}

void RMSprop::step() {
  NoGradGuard no_grad;
  check_step();
  for (size_t g = 0; g < groups_.size(); ++g) {
    const RMSpropOptions& o = groups_[g].options;
    for (const std::vector<StepItem>& items : step_items(g)) {
      // The step counts (which checkpoints keep) live on the host, where a replayed graph would not advance them.
      HG_CHECK(!cuda::is_capturing(items[0].param.device()),
               "RMSprop: a step inside a CUDA graph capture would leave its step counts where the capture left them; "
               "use SGD with --cuda-graph, or train eagerly");
      RMSpropStepArgs args;
      args.lr = o.lr;
      args.alpha = o.alpha;
      args.eps = o.eps;
      args.weight_decay = o.weight_decay;
      args.momentum = o.momentum;
      args.centered = o.centered;
      for (const StepItem& item : items) {
        add_tensors(args, item);
        args.square_avgs.push_back(state_buffer(g, item, kSquareAvg));
        if (o.centered) args.grad_avgs.push_back(state_buffer(g, item, kGradAvg));
        if (o.momentum != 0) args.momentum_buffers.push_back(state_buffer(g, item, kMomentumBuffer));
        ++state(g, item.index).step;  // with its buffers: a step that fails on a later item leaves whole states
      }
      rmsprop_step_kernel[items[0].param.device()](args);
      write_back(items);
    }
  }
}

}  // namespace halfgrad::optim

#include "optim/sgd.h"

#include "core/autograd.h"
#include "optim/fused.h"

namespace halfgrad::optim {

namespace {
void check_options(const SGDOptions& o, size_t g) {
  HG_CHECK(o.lr >= 0, "SGD: invalid learning rate {} (group {})", o.lr, g);
  HG_CHECK(o.momentum >= 0, "SGD: invalid momentum {} (group {})", o.momentum, g);
  HG_CHECK(o.weight_decay >= 0, "SGD: invalid weight_decay {} (group {})", o.weight_decay, g);
  HG_CHECK(!o.nesterov || (o.momentum > 0 && o.dampening == 0),
           "SGD: nesterov momentum requires a momentum and zero dampening (group {}: momentum {}, dampening {})", g,
           o.momentum, o.dampening);
}
}  // namespace

SGD::SGD(TensorList params, SGDOptions options) : SGD(std::vector<SGDGroup>{{std::move(params), options}}) {}

SGD::SGD(std::vector<SGDGroup> groups) : OptimizerWith("SGD", std::move(groups)) {
  for (size_t g = 0; g < groups_.size(); ++g) check_options(groups_[g].options, g);
  check_parameters();
}

void SGD::step() {
  NoGradGuard no_grad;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const SGDOptions& o = groups_[g].options;
    for (const std::vector<StepItem>& items : step_items(g)) {
      SGDStepArgs args;
      args.lr = o.lr;
      args.momentum = o.momentum;
      args.dampening = o.dampening;
      args.weight_decay = o.weight_decay;
      args.nesterov = o.nesterov;
      for (const StepItem& item : items) {
        args.params.push_back(item.param);
        args.grads.push_back(item.grad);
        ++state(g, item.index).step;
        if (o.momentum != 0) {
          bool created = false;
          args.momentum_buffers.push_back(state_buffer(g, item, 0, &created));
          args.first_step.push_back(created);
        }
      }
      sgd_step_kernel[items[0].param.device()](args);
      write_back(items);
    }
  }
}

}  // namespace halfgrad::optim

#include "optim/sgd.h"

#include "core/autograd.h"
#include "core/cuda.h"
#include "core/cuda_graph.h"
#include "optim/fused.h"

namespace halfgrad::optim {

namespace {
void check_options(const SGDOptions& o, size_t g) {
  check_not_negative("SGD", "learning rate", o.lr, g);
  check_not_negative("SGD", "momentum", o.momentum, g);
  check_not_negative("SGD", "weight_decay", o.weight_decay, g);
  HG_CHECK(!o.nesterov || (o.momentum > 0 && o.dampening == 0),
           "SGD: nesterov momentum requires a momentum and zero dampening (group {}: momentum {}, dampening {})", g,
           o.momentum, o.dampening);
}
}  // namespace

SGD::SGD(TensorList params, SGDOptions options) : SGD(std::vector<SGDGroup>{{std::move(params), options}}) {}

void SGD::check_group_options(const SGDOptions& options, size_t g) const { check_options(options, g); }

SGD::SGD(std::vector<SGDGroup> groups) : OptimizerWith("SGD", std::move(groups)) {
  for (size_t g = 0; g < groups_.size(); ++g) check_group_options(groups_[g].options, g);
  check_parameters();
}

void SGD::step() { run_step(Tensor()); }

void SGD::step_unless(const Tensor& found_inf) {
  if (creates_dampened_buffer()) return Optimizer::step_unless(found_inf);
  run_step(found_inf);
}

void SGD::step_scaled(const Tensor& found_inf, const Tensor& grad_scale) {
  if (creates_dampened_buffer()) return Optimizer::step_scaled(found_inf, grad_scale);
  run_step(found_inf, grad_scale);
}

bool SGD::creates_dampened_buffer() {
  for (size_t g = 0; g < groups_.size(); ++g) {
    const SGDOptions& o = groups_[g].options;
    if (o.momentum == 0 || o.dampening == 0) continue;
    for (size_t i = 0; i < groups_[g].params.size(); ++i) {
      const ParamState& s = state(g, i);
      if (groups_[g].params[i].grad().defined() && (s.buffers.empty() || !s.buffers[0].defined())) return true;
    }
  }
  return false;
}

// In a CUDA graph capture: the group's lr and momentum in device memory, written before each replay, so that what a
// scheduler sets between replays is what the replayed step uses.
Tensor SGD::replayed_hyperparameters(size_t g, Device device) {
  Tensor values = cuda::replay_input({2}, {.dtype = kFloat64, .device = device});
  const SGDOptions captured = groups_[g].options;
  cuda::before_each_replay([this, g, values, captured]() mutable {
    const SGDOptions& o = groups_[g].options;
    HG_CHECK((o.momentum != 0) == (captured.momentum != 0),
             "SGD: group {} was captured in a CUDA graph with momentum {}, and now has momentum {}; capture again",
             g, captured.momentum != 0 ? "on" : "off", o.momentum);
    // The kernels' other options were captured as arguments: a change (a loaded state's) would not reach them.
    HG_CHECK(o.weight_decay == captured.weight_decay && o.dampening == captured.dampening &&
                 o.nesterov == captured.nesterov,
             "SGD: group {} was captured in a CUDA graph with weight_decay {}, dampening {}, nesterov {}, and now has "
             "{}, {}, {}; capture again", g, captured.weight_decay, captured.dampening, captured.nesterov,
             o.weight_decay, o.dampening, o.nesterov);
    values.narrow(0, 0, 1).fill_(o.lr);  // fills: the values travel as kernel arguments, nothing waits
    values.narrow(0, 1, 1).fill_(o.momentum);
  });
  return values;
}

void SGD::run_step(const Tensor& found_inf, const Tensor& grad_scale) {
  NoGradGuard no_grad;
  check_step();
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
        add_tensors(args, item);
        ++state(g, item.index).step;
        if (o.momentum != 0) {
          bool created = false;
          args.momentum_buffers.push_back(state_buffer(g, item, 0, &created));
          args.first_step.push_back(created);
        }
      }
      const Device device = items[0].param.device();
      if (found_inf.defined()) args.found_inf = found_inf.to(device);
      if (grad_scale.defined()) args.grad_scale = grad_scale.to(device);
      if (cuda::is_capturing(device)) args.hyperparameters = replayed_hyperparameters(g, device);
      sgd_step_kernel[device](args);
      write_back(items);
    }
  }
}

}  // namespace halfgrad::optim

#include "optim/sgd.h"

#include "core/autograd.h"
#include "ops/elementwise.h"

namespace halfgrad::optim {

void Optimizer::zero_grad() {
  for (const Tensor& p : parameters()) p.set_grad(Tensor());
}

SGD::SGD(TensorList params, SGDOptions options) : SGD(std::vector<SGDGroup>{{std::move(params), options}}) {}

SGD::SGD(std::vector<SGDGroup> groups) : groups_(std::move(groups)) {
  for (const SGDGroup& g : groups_) {
    const SGDOptions& o = g.options;
    HG_CHECK(o.lr >= 0, "SGD: invalid learning rate {}", o.lr);
    HG_CHECK(o.momentum >= 0, "SGD: invalid momentum {}", o.momentum);
    HG_CHECK(o.weight_decay >= 0, "SGD: invalid weight_decay {}", o.weight_decay);
    HG_CHECK(!o.nesterov || (o.momentum > 0 && o.dampening == 0),
             "SGD: nesterov momentum requires a momentum and zero dampening");
    for (const Tensor& p : g.params)
      HG_CHECK(p.is_leaf() && p.requires_grad(), "SGD: parameters must be leaves that require grad, got {}", p.meta());
    momentum_buffers_.emplace_back(g.params.size());
  }
}

TensorList SGD::parameters() const {
  TensorList all;
  for (const SGDGroup& g : groups_) all.insert(all.end(), g.params.begin(), g.params.end());
  return all;
}

void SGD::step() {
  NoGradGuard no_grad;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const SGDOptions& o = groups_[gi].options;
    for (size_t pi = 0; pi < groups_[gi].params.size(); ++pi) {
      Tensor& p = groups_[gi].params[pi];
      Tensor g = p.grad();
      if (!g.defined()) continue;
      if (o.weight_decay != 0) g = g.add(p, o.weight_decay);
      if (o.momentum != 0) {
        Tensor& buf = momentum_buffers_[gi][pi];
        if (!buf.defined()) {
          buf = g.clone();
        } else {
          buf.mul_(o.momentum).add_(g, 1 - o.dampening);
        }
        g = o.nesterov ? g.add(buf, o.momentum) : buf;
      }
      p.sub_(g, o.lr);
    }
  }
}

}  // namespace halfgrad::optim

#include "optim/amp.h"

#include <map>

#include "core/autocast.h"
#include "core/autograd.h"
#include "core/cuda_graph.h"
#include "core/log.h"
#include "nn/layers.h"
#include "ops/elementwise.h"
#include "optim/clip_grad.h"

namespace halfgrad::amp {

const char* opt_level_name(OptLevel level) {
  constexpr const char* names[] = {"O0", "O1", "O2", "O3"};
  return names[int(level)];
}

OptLevel parse_opt_level(const std::string& name) {
  for (OptLevel l : {OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3})
    if (name == opt_level_name(l)) return l;
  HG_FAIL("amp: unknown opt level '{}' (expected O0, O1, O2 or O3)", name);
}

namespace {
GradScalerOptions scaler_for(OptLevel level, GradScalerOptions options) {
  options.enabled = options.enabled && (level == OptLevel::O1 || level == OptLevel::O2);
  return options;
}

bool is_batch_norm(const nn::Module& m) { return dynamic_cast<const nn::BatchNorm2d*>(&m) != nullptr; }
}  // namespace

Amp::Amp(nn::Module& model, optim::Optimizer& optimizer, OptLevel level, AmpOptions options)
    : model_(&model), optimizer_(&optimizer), level_(level), options_(options),
      scaler_(scaler_for(level, options.scaler)) {}

Amp initialize(nn::Module& model, optim::Optimizer& optimizer, OptLevel level, AmpOptions options) {
  HG_CHECK(options.half_dtype == kFloat16 || options.half_dtype == kBFloat16,
           "amp::initialize: half_dtype must be float16 or bfloat16, got {}", dtype_name(options.half_dtype));
  for (size_t g = 0; g < optimizer.num_param_groups(); ++g)
    for (size_t p = 0; p < optimizer.param_group(g).params.size(); ++p)
      HG_CHECK(optimizer.state(g, p).step == 0 && optimizer.state(g, p).buffers.empty(),
               "amp::initialize: the {} optimizer has already stepped; initialize before training", optimizer.name());
  Amp amp(model, optimizer, level, options);
  if (level == OptLevel::O0 || level == OptLevel::O1) return amp;

  // Convert the model; remember which float32 tensor became which half parameter (same names).
  NamedTensors before = model.named_parameters();
  if (level == OptLevel::O2) {
    model.to(options.half_dtype, [](const nn::Module& m) { return !is_batch_norm(m); });
  } else {
    model.to(options.half_dtype);
  }
  NamedTensors after = model.named_parameters();
  std::map<TensorImpl*, Tensor> converted;  // float32 tensor -> the model's parameter now
  for (size_t i = 0; i < before.size(); ++i) converted.emplace(before[i].second.impl(), after[i].second);

  // Rewire the optimizer. O2: it keeps (or gets) float32 masters, each paired with the model's half
  // parameter. O3: it trains the model's half parameters directly.
  for (optim::ParamGroupRef group : optimizer.param_groups()) {
    for (Tensor& p : group.params) {
      auto it = converted.find(p.impl());
      Tensor model_param = it != converted.end() ? it->second : p;
      if (level == OptLevel::O3) {
        p = model_param;
        continue;
      }
      if (model_param.same(p)) {
        if (p.dtype() == kFloat32) continue;  // BatchNorm: stays float32, needs no master
        Tensor master;  // an optimizer built on a half model: make its master
        {
          NoGradGuard no_grad;
          master = p.to(kFloat32).clone();
        }
        master.requires_grad_(p.requires_grad());  // a frozen parameter's master stays frozen
        amp.masters_.emplace_back(master, p);
        p = master;
      } else {
        amp.masters_.emplace_back(p, model_param);  // the optimizer's float32 tensor is the master
      }
    }
  }
  amp.note_synced();
  logger().info("amp: {} with {} ({} master weights)", opt_level_name(level), dtype_name(options.half_dtype),
                amp.masters_.size());
  return amp;
}

namespace {
void record_versions(const std::vector<std::pair<Tensor, Tensor>>& masters,
                     std::vector<std::pair<uint64_t, uint64_t>>& versions) {
  versions.clear();
  for (const auto& [master, model_param] : masters) versions.emplace_back(master.version(), model_param.version());
}
}  // namespace

void Amp::note_synced() { record_versions(masters_, *synced_versions_); }

void Amp::sync_masters() {
  NoGradGuard no_grad;
  for (size_t i = 0; i < masters_.size(); ++i) {
    auto& [master, model_param] = masters_[i];
    const auto [master_version, model_version] = (*synced_versions_)[i];
    if (model_param.version() == model_version || master.version() != master_version) continue;
    // On the device, without a host read: only the elements whose value moved off the master's rounding.
    const Tensor moved = model_param.ne(master.to(model_param.dtype()));
    master.copy_(where(moved, model_param.to(master.dtype()), master));
  }
  note_synced();
}

Tensor Amp::forward(nn::Module& model, const Tensor& x) {
  DType model_dtype = options_.half_dtype;
  if (level_ == OptLevel::O0 || level_ == OptLevel::O1) {
    const TensorList params = model.parameters();
    model_dtype = params.empty() ? kFloat32 : params.front().dtype();
  }
  Tensor input = x.is_floating_point() ? x.to(model_dtype) : x;
  Tensor out = run([&] { return model.forward(input); });
  return level_ == OptLevel::O2 && out.is_floating_point() ? out.to(kFloat32) : out;
}

void Amp::backward(const Tensor& loss) { scaler_.scale(loss).backward(); }

// O2: the half gradients become the masters' float32 gradients, where unscaling loses nothing.
void Amp::gather_master_grads() {
  if (masters_have_grads_) return;
  NoGradGuard no_grad;
  for (auto& [master, model_param] : masters_) {
    Tensor g = model_param.grad();
    master.set_grad(g.defined() ? g.to(kFloat32) : Tensor());
  }
  masters_have_grads_ = true;
}

TensorList Amp::unscale_() {
  gather_master_grads();
  scaler_.unscale_(*optimizer_);
  TensorList params;
  for (const optim::ParamGroupRef& group : optimizer_->param_groups())
    for (const Tensor& p : group.params) params.push_back(p);
  return params;
}

Tensor Amp::clip_grad_norm_(double max_norm, double norm_type) {
  gather_master_grads();
  if (scaler_.is_enabled()) return scaler_.clip_grad_norm_(*optimizer_, max_norm, norm_type);
  HG_CHECK(!clip_coefficient_.defined(),
           "Amp::clip_grad_norm_: the gradients were already clipped (clip_grad_norm_) since the last step()");
  const TensorList params = optimizer_->parameters();
  // float64 gradients are clipped in place, in float64: the fused step reads its coefficient in float32.
  for (const Tensor& p : params)
    if (p.dtype() == kFloat64) return optim::clip_grad_norm_(params, max_norm, norm_type);
  // No scale to divide by: the norm as it is, and the coefficient for step(), which saves clipping's pass over the
  // gradients (SGD multiplies as its kernel reads them).
  NoGradGuard no_grad;
  const Tensor norm = optim::grad_norm(params, norm_type);
  clip_coefficient_ = optim::clip_coefficient(norm, max_norm).to(kFloat32);
  return norm;
}

void Amp::step() {
  sync_masters();
  gather_master_grads();
  masters_have_grads_ = false;
  if (clip_coefficient_.defined()) {
    NoGradGuard no_grad;
    optimizer_->step_scaled(Tensor(), clip_coefficient_);
    clip_coefficient_ = Tensor();
  } else {
    scaler_.step(*optimizer_);
  }
  {
    // Unconditionally: after a skipped step the masters are unchanged and the copy rewrites the same values,
    // which costs less than asking the device whether the step ran.
    NoGradGuard no_grad;
    for (auto& [master, model_param] : masters_) model_param.copy_(master);
  }
  note_synced();
  // Each replay of a captured step bumps the versions of the masters and model parameters it writes
  // (check_inplace); the versions after those bumps are the synchronised ones, so a load between replays is seen.
  if (!masters_.empty() && cuda::capturing_graph(masters_.front().first.device())) {
    cuda::before_each_replay([masters = masters_, versions = synced_versions_] { record_versions(masters, *versions); });
  }
  scaler_.update();
}

void Amp::zero_grad() {
  // An unscale or a clipping of the gradients being zeroed is forgotten, and O2's masters take the next ones.
  clip_coefficient_ = Tensor();
  masters_have_grads_ = false;
  scaler_.forget_unscale(*optimizer_);
  model_->zero_grad();
  optimizer_->zero_grad();
}

}  // namespace halfgrad::amp

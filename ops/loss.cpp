// Loss functions: forward and backward side by side. nll_loss and cross_entropy run kernels (the CPU ones at the end of
// this file, the CUDA ones in ops/loss.cu); the other losses are written with tensor ops and run on any device.
#include "ops/loss.h"

#include <omp.h>

#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "core/autocast.h"
#include "core/autograd.h"
#include "ops/copy.h"
#include "ops/elementwise.h"
#include "ops/reduce.h"
#include "ops/softmax.h"

namespace halfgrad {

constinit KernelTable<NllLossKernel> nll_loss_kernel("nll_loss");
constinit KernelTable<NllLossBackwardKernel> nll_loss_backward_kernel("nll_loss_backward");
constinit KernelTable<CrossEntropyKernel> cross_entropy_kernel("cross_entropy");
constinit KernelTable<CrossEntropyBackwardKernel> cross_entropy_backward_kernel("cross_entropy_backward");

const char* reduction_name(Reduction reduction) {
  switch (reduction) {
    case Reduction::None: return "none";
    case Reduction::Mean: return "mean";
    case Reduction::Sum: return "sum";
  }
  return "?";
}

namespace {
Tensor reduce(const Tensor& loss, Reduction reduction) {
  switch (reduction) {
    case Reduction::None: return loss;
    case Reduction::Mean: return loss.mean();
    case Reduction::Sum: return loss.sum();
  }
  HG_FAIL("loss: unknown reduction {}", int(reduction));
}
}  // namespace

// ---- mse_loss. Autocast category: "float32".
//
//   loss_i = (input_i - target_i)^2             reduced: none / mean (/ N) / sum
//   d loss / d input_i  =  2 (input_i - target_i) * g_i   (g_i = the incoming gradient, / N for mean)
//   d loss / d target_i = -d loss / d input_i
Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction reduction) {
  HG_AUTOCAST(mse_loss, input, target, reduction);
  HG_CHECK(input.defined() && target.defined(), "mse_loss: got an undefined tensor (input {}, target {})",
           input.meta(), target.meta());
  HG_CHECK(input.shape() == target.shape(), "mse_loss: input shape {} and target shape {} differ (mse_loss does not "
           "broadcast; reshape the target)", shape_str(input.shape()), shape_str(target.shape()));
  HG_CHECK(input.device() == target.device(), "mse_loss: input {} and target {} are on different devices",
           input.meta(), target.meta());
  HG_CHECK(is_floating(promote_types(input.dtype(), target.dtype())),
           "mse_loss: expected floating-point input and target, got {} and {}", input.meta(), target.meta());

  Tensor loss;
  {
    NoGradGuard no_grad;  // one node for the whole loss, recorded below
    const Tensor diff = input.sub(target);
    loss = reduce(diff.mul(diff), reduction);
  }
  // backward: 2 (input - target) g (/ count), the difference formed again from what the caller holds anyway (as
  // PyTorch's mse_loss_backward), rather than kept.
  record("MseLossBackward", {input, target}, {loss},
         [input_ = SavedTensor(input, "mse_loss"), target_ = SavedTensor(target, "mse_loss"), reduction,
          count = input.numel()](const GradContext& ctx) -> TensorList {
           double scale = reduction == Reduction::Mean ? 2.0 / double(count) : 2.0;
           // ctx[0] is 0-d for mean/sum: broadcasts
           Tensor grad = scaled_once(input_.get().sub(target_.get()).mul(ctx[0]), scale);
           Tensor grad_input = ctx.needs(0) ? grad : Tensor();
           Tensor grad_target = ctx.needs(1) ? grad.neg() : Tensor();
           return {grad_input, grad_target};
         }, DoubleBackward::Supported);
  return loss;
}

// ---- nll_loss and cross_entropy. Autocast category: "float32" (nll_loss), "float32 math" (cross_entropy).
namespace {

// PyTorch's nll_loss and binary cross-entropies are not differentiable in their weights and refuse one that requires
// grad, even under no_grad; so do these, rather than leave its gradient silently undefined.
void refuse_weight_gradient(const Tensor& weight, const char* op, const char* what) {
  HG_CHECK(!weight.defined() || !weight.requires_grad(), "{}: the {} {} requires grad, but {} is not differentiable "
           "with respect to its {} (as in PyTorch); pass {}.detach()", op, what, weight.meta(), op, what, what);
}

// The per-element losses and target weights of nll_loss, [N, d...] (0-d for an unbatched [C] input), in
// the accumulation dtype (float32 for float16/bfloat16 inputs: sums of many losses, or of more than 65504
// target weights, overflow float16). `loss` carries the autograd node; `weights` is a constant.
struct NllElements {
  Tensor loss, weights;
  // What a backward needs: the targets (int64 [N, inner]), the class weights (accumulation dtype, or undefined)
  // and the sizes, input [N, C, inner].
  Tensor target, weight;
  int64_t batch, classes, inner;
};

// A [C] tensor of class weights, checked; undefined stays undefined. It keeps its autograd history: cross_entropy's
// probability targets differentiate through it, nll_problem refuses it.
Tensor check_class_weight(const Tensor& weight, const Tensor& input, int64_t classes, const char* op) {
  if (!weight.defined()) return weight;
  HG_CHECK(weight.dim() == 1 && weight.size(0) == classes && weight.is_floating_point(),
           "{}: expected a floating-point weight of shape [{}] (one per class of input {}), got {}", op, classes,
           input.meta(), weight.meta());
  HG_CHECK(weight.device() == input.device(), "{}: input {} and weight {} are on different devices", op, input.meta(),
           weight.meta());
  return weight;
}

// A class-index problem, checked: input [N, C, inner] (input [C] is one sample), targets as int64 [N, inner], class
// weights in the accumulation dtype (or undefined).
struct NllProblem {
  Shape target_shape;
  Tensor target, weight;
  int64_t batch, classes, inner;
  DType acc;
};

NllProblem nll_problem(const Tensor& input, const Tensor& target, const Tensor& weight, const char* op) {
  HG_CHECK(input.defined() && target.defined(), "{}: got an undefined tensor (input {}, target {})", op,
           input.meta(), target.meta());
  HG_CHECK(input.is_floating_point(), "{}: expected a floating-point input, got {}", op, input.meta());
  HG_CHECK(input.dim() >= 1, "{}: expected an input of shape [C], [N, C] or [N, C, d1, ...], got {}", op, input.meta());
  HG_CHECK(is_integral(target.dtype()), "{}: expected class indices (int64) as the target, got {}", op, target.meta());
  HG_CHECK(target.device() == input.device(), "{}: input {} and target {} are on different devices", op, input.meta(),
           target.meta());
  // input [N, C, d1, ..., dk] -> target [N, d1, ..., dk]; input [C] -> a 0-d target
  const bool batched = input.dim() >= 2;
  NllProblem p;
  p.classes = input.size(batched ? 1 : 0);
  p.batch = batched ? input.size(0) : 1;
  p.inner = 1;
  if (batched) p.target_shape.push_back(p.batch);
  for (int64_t d = 2; d < input.dim(); ++d) {
    p.target_shape.push_back(input.size(d));
    p.inner *= input.size(d);
  }
  HG_CHECK(target.shape() == p.target_shape, "{}: expected a target of shape {} for input {} (the input's shape "
           "without the class dim {}), got {}", op, shape_str(p.target_shape), input.meta(), batched ? 1 : 0,
           target.meta());
  p.acc = accumulation_dtype(input.dtype());
  p.weight = check_class_weight(weight, input, p.classes, op);
  refuse_weight_gradient(p.weight, op, "weight");
  if (p.weight.defined()) p.weight = cast_nograd(p.weight.detach(), p.acc).contiguous();
  p.target = cast_nograd(target.detach(), kInt64).contiguous();
  return p;
}

// What the backwards below compute in a pass with create_graph, from ops that record (their kernels otherwise), in
// `acc` as [batch, classes, inner]: each element's scale, w[t_j] g_j, and exactly 0 at ignored targets whatever g_j
// (as the kernels: a Mean over only ignored targets sends g = 1/0 there), and the targets' one-hot rows.
struct TargetTerms {
  Tensor scale, one_hot;
};
TargetTerms target_terms(const Tensor& g, const Tensor& target, const Tensor& element_weights, int64_t ignore_index,
                         int64_t batch, int64_t classes, int64_t inner, DType acc) {
  const Tensor targets = target.view({batch, 1, inner});
  const Tensor weighted = g.to(acc).reshape({batch, 1, inner}) * element_weights.view({batch, 1, inner});
  const Tensor class_of = arange(classes, {.dtype = kInt64, .device = target.device()}).view({1, classes, 1});
  return {where(targets.eq(Scalar(ignore_index)), 0.0, weighted), class_of.eq(targets).to(acc)};
}

// cross_entropy's gradient by its logits ([batch, classes, inner] of the accumulation dtype) in ops that record:
// d loss_j / d x[j, c] = w[t_j] g_j (softmax(x_j)[c] - [c == t_j]), with `terms` from target_terms.
Tensor cross_entropy_logits_gradient(const Tensor& logits, const TargetTerms& terms) {
  return (softmax(logits, 1) - terms.one_hot) * terms.scale;
}

// `input` holds log-probabilities (nll_loss).
NllElements nll_elements(const Tensor& input, const Tensor& target, const Tensor& weight, int64_t ignore_index,
                         const char* op) {
  const NllProblem p = nll_problem(input, target, weight, op);
  const int64_t batch = p.batch, classes = p.classes, inner = p.inner;
  const DType acc = p.acc;
  Tensor loss = empty(p.target_shape, {.dtype = acc, .device = input.device()});
  Tensor weights = empty(p.target_shape, {.dtype = acc, .device = input.device()});
  if (loss.numel() > 0) {
    nll_loss_kernel[input.device()](loss.view({batch, inner}), weights.view({batch, inner}),
                                    input.detach().contiguous().view({batch, classes, inner}),
                                    p.target.view({batch, inner}), p.weight, ignore_index, op);
  }

  // backward: the gradient of loss_j goes to input[j, t_j] only: d loss_j / d input[j, t_j] = -w[t_j].
  record("NllLossBackward", {input}, {loss},
         [t = SavedTensor(p.target, op), w = SavedTensor(p.weight, op), weights, ignore_index, shape = input.shape(),
          dtype = input.dtype(), acc, batch, classes, inner](const GradContext& g) -> TensorList {
           const Tensor& target_ = t.get();
           if (GradMode::is_enabled()) {
             const auto [scale, one_hot] =
                 target_terms(g[0], target_, weights, ignore_index, batch, classes, inner, acc);
             return {(one_hot * scale).neg().to(dtype).view(shape)};
           }
           Tensor grad_loss = g[0].to(acc).contiguous().view({batch, inner});
           Tensor grad_input = empty(shape, {.dtype = dtype, .device = target_.device()});
           if (grad_input.numel() > 0) {
             nll_loss_backward_kernel[target_.device()](grad_input.view({batch, classes, inner}), grad_loss,
                                                        target_.view({batch, inner}), w.get(), ignore_index);
           }
           return {grad_input};
         }, DoubleBackward::Supported);
  return {loss, weights, p.target, p.weight, batch, classes, inner};
}

// Mean divides by the summed target weights: with class weights, the sum of w[t_j] over the targets not
// ignored; without, their number.
Tensor reduce_nll(const NllElements& e, Reduction reduction) {
  switch (reduction) {
    case Reduction::None: return e.loss;
    case Reduction::Sum: return e.loss.sum();
    case Reduction::Mean: return e.loss.sum().div(e.weights.sum());
  }
  HG_FAIL("nll_loss: unknown reduction {}", int(reduction));
}

// w viewed to broadcast along the class dim of an input of `ndim` dims: [C] -> [1, C, 1, ..., 1].
Tensor class_weight_view(const Tensor& w, int64_t ndim) {
  if (ndim <= 1) return w;
  Shape shape(size_t(ndim), 1);
  shape[1] = w.numel();
  return w.view(shape);
}


}  // namespace

Tensor nll_loss(const Tensor& input, const Tensor& target, const NllLossOptions& options) {
  HG_AUTOCAST(nll_loss, input, target, options);
  NllElements e = nll_elements(input, target, options.weight, options.ignore_index, "nll_loss");
  return reduce_nll(e, options.reduction).to(input.dtype());
}

namespace {

// Class-index targets without label smoothing: the per-element losses and each row's normaliser (its max and log-sum)
// in one pass over the logits (cross_entropy_kernel), and one node whose backward is softmax minus the one-hot target
// in a single pass (cross_entropy_backward_kernel); no log-probabilities are stored. The loss is in `result` (the logits' dtype,
// or float32 under autocast), the logits' gradient in their own dtype.
Tensor cross_entropy_indices(const Tensor& input, const Tensor& target, const Tensor& weight,
                             const CrossEntropyOptions& options, DType result) {
  const char* op = "cross_entropy";
  const NllProblem p = nll_problem(input, target, weight, op);
  const int64_t batch = p.batch, classes = p.classes, inner = p.inner;
  const Tensor logits = input.detach().contiguous();
  NllElements e{empty(p.target_shape, {.dtype = p.acc, .device = input.device()}),
                empty(p.target_shape, {.dtype = p.acc, .device = input.device()}), p.target, p.weight, batch, classes,
                inner};
  Tensor row_max = empty({batch, inner}, {.dtype = p.acc, .device = input.device()});
  Tensor log_sum = empty({batch, inner}, {.dtype = p.acc, .device = input.device()});
  if (e.loss.numel() > 0) {
    cross_entropy_kernel[input.device()](e.loss.view({batch, inner}), e.weights.view({batch, inner}), row_max, log_sum,
                                         logits.view({batch, classes, inner}), p.target.view({batch, inner}), p.weight,
                                         options.ignore_index);
  }
  // The closure holds what the backward reads, never e.loss: the node's own output would keep the node alive
  // through its grad_fn, a cycle that leaked every graph not run backward (LeakSanitizer, make sanitize). The logits,
  // targets and weight may be the caller's own tensors (nothing needed a copy): saved with their versions.
  // The logits are saved with the input's history (for a pass with create_graph).
  record("CrossEntropyBackward", {input}, {e.loss},
         [x = SavedTensor(input, logits, op), row_max, log_sum, t = SavedTensor(e.target, op),
          w = SavedTensor(e.weight, op), weights = e.weights, acc = p.acc, batch, classes, inner,
          ignore_index = options.ignore_index](const GradContext& g) -> TensorList {
           if (GradMode::is_enabled()) {
             const Tensor x_ = x.get();
             const Tensor grad = cross_entropy_logits_gradient(
                 x_.to(acc).reshape({batch, classes, inner}),
                 target_terms(g[0], t.get(), weights, ignore_index, batch, classes, inner, acc));
             return {grad.to(x_.dtype()).view(x_.shape())};
           }
           const Tensor logits_ = x.get();
           Tensor grad_loss = g[0].to(acc).contiguous().view({batch, inner});
           Tensor grad_input = empty(logits_.shape(), {.dtype = logits_.dtype(), .device = logits_.device()});
           if (grad_input.numel() > 0) {
             cross_entropy_backward_kernel[logits_.device()](grad_input.view({batch, classes, inner}), grad_loss,
                                                             logits_.view({batch, classes, inner}), row_max, log_sum,
                                                             t.get().view({batch, inner}), w.get(), ignore_index);
           }
           return {grad_input};
         }, DoubleBackward::Supported);
  return reduce_nll(e, options.reduction).to(result);
}

}  // namespace

Tensor cross_entropy_mean_gradient(const Tensor& logits, const Tensor& target, const Tensor& g, int64_t ignore_index) {
  const int64_t batch = logits.size(0), classes = logits.size(1);
  const DType acc = accumulation_dtype(logits.dtype());
  const Tensor counted = target.ne(ignore_index).to(acc);  // each element's weight in the mean
  // The mean's gradient at each element; where nothing counted, target_terms gives every element 0.
  const Tensor element_grad = (g.to(acc) / counted.sum().clamp(1.0, std::nullopt)).expand({batch});
  const TargetTerms terms = target_terms(element_grad, target, counted, ignore_index, batch, classes, 1, acc);
  return cross_entropy_logits_gradient(logits.to(acc).view({batch, classes, 1}), terms).view({batch, classes});
}

Tensor cross_entropy(const Tensor& input, const Tensor& target, const CrossEntropyOptions& options) {
  HG_AUTOCAST(cross_entropy, input, target, options);
  const char* op = "cross_entropy";
  HG_CHECK(input.defined() && target.defined(), "{}: got an undefined tensor (input {}, target {})", op,
           input.meta(), target.meta());
  HG_CHECK(input.is_floating_point(), "{}: expected floating-point logits, got {}", op, input.meta());
  HG_CHECK(input.dim() >= 1, "{}: expected logits of shape [C], [N, C] or [N, C, d1, ...], got {}", op, input.meta());
  const double eps = options.label_smoothing;
  HG_CHECK(eps >= 0.0 && eps <= 1.0, "{}: label_smoothing must be in [0, 1], got {}", op, eps);
  const int64_t class_dim = input.dim() >= 2 ? 1 : 0, classes = input.size(class_dim);
  Tensor w = check_class_weight(options.weight, input, classes, op);
  const DType result = amp::result_dtype(input.dtype());
  if (!target.is_floating_point() && eps == 0) return cross_entropy_indices(input, target, w, options, result);
  // The other cases are compositions of ops: under autocast they run on float32 copies.
  if (result != input.dtype()) {
    return cross_entropy(input.to(result), target.is_floating_point() ? target.to(result) : target,
                         {.weight = w, .ignore_index = options.ignore_index, .label_smoothing = eps,
                          .reduction = options.reduction});
  }
  Tensor log_probs = log_softmax(input, class_dim);

  if (target.is_floating_point()) {
    // Class probabilities: loss_j = -sum_c w[c] p[j, c] log_softmax(x)[j, c].
    HG_CHECK(target.shape() == input.shape(), "{}: a floating-point target holds class probabilities and must have "
             "the input's shape: input {}, target {} (class indices must be an integer tensor)", op, input.meta(),
             target.meta());
    HG_CHECK(target.device() == input.device(), "{}: input {} and target {} are on different devices", op,
             input.meta(), target.meta());
    HG_CHECK(options.ignore_index < 0, "{}: ignore_index ({}) does not apply to a floating-point target of class "
             "probabilities (as in PyTorch); leave it negative (its default, -100)", op, options.ignore_index);
    Tensor p = eps > 0 ? target * (1.0 - eps) + eps / double(classes) : target;
    Tensor terms = log_probs * p;
    if (w.defined()) terms = terms * class_weight_view(w, input.dim());
    Tensor loss = terms.sum({class_dim}).neg();
    switch (options.reduction) {
      case Reduction::None: break;
      case Reduction::Sum: loss = loss.sum(); break;
      case Reduction::Mean:  // over the samples, whatever the weights; nan for no logits at all, as PyTorch (a nan
                             // made from the sum, so that backward() still runs)
        loss = input.numel() == 0 ? loss.sum() * std::numeric_limits<double>::quiet_NaN() : loss.mean();
        break;
    }
    return loss.to(input.dtype());
  }

  NllElements e = nll_elements(log_probs, target, w, options.ignore_index, op);
  Tensor loss = reduce_nll(e, options.reduction);
  if (eps > 0) {
    // The uniform part of the smoothed target: -sum_c w[c] log_softmax(x)[j, c], zero at ignored targets,
    // reduced like the nll part (Mean: by the same summed target weights).
    Tensor terms = w.defined() ? log_probs * class_weight_view(w, input.dim()) : log_probs;
    // (e.target: int64, where a narrower target would wrap ignore_index, -100 a uint8 156)
    Tensor smooth = where(e.target.eq(Scalar(options.ignore_index)), 0.0, terms.sum({class_dim}).neg());
    switch (options.reduction) {
      case Reduction::None: break;
      case Reduction::Sum: smooth = smooth.sum(); break;
      case Reduction::Mean: smooth = smooth.sum().div(e.weights.sum()); break;
    }
    loss = loss * (1.0 - eps) + smooth * (eps / double(classes));
  }
  return loss.to(input.dtype());
}

// ---- binary cross-entropy
namespace {

void check_binary_operands(const Tensor& input, const Tensor& target, const char* op) {
  HG_CHECK(input.defined() && target.defined(), "{}: got an undefined tensor (input {}, target {})", op,
           input.meta(), target.meta());
  HG_CHECK(input.shape() == target.shape(), "{}: input shape {} and target shape {} differ (the target must have "
           "the input's shape)", op, shape_str(input.shape()), shape_str(target.shape()));
  HG_CHECK(input.device() == target.device(), "{}: input {} and target {} are on different devices", op,
           input.meta(), target.meta());
  HG_CHECK(input.is_floating_point() && target.is_floating_point(),
           "{}: expected floating-point input and target, got {} and {}", op, input.meta(), target.meta());
}

// An optional per-element factor (weight, pos_weight), checked and cast, without autograd.
Tensor elementwise_factor(const Tensor& factor, const Tensor& input, DType dtype, const char* op, const char* what) {
  if (!factor.defined()) return factor;
  refuse_weight_gradient(factor, op, what);
  HG_CHECK(factor.device() == input.device() && factor.is_floating_point(),
           "{}: {} must be a floating-point tensor on the input's device; input {}, {} {}", op, what, input.meta(),
           what, factor.meta());
  broadcast_shapes(factor.shape(), input.shape(), op);  // throws when it does not broadcast
  HG_CHECK(broadcast_shapes(factor.shape(), input.shape(), op) == input.shape(),
           "{}: {} {} must broadcast to the input's shape {}", op, what, factor.meta(), shape_str(input.shape()));
  return cast_nograd(factor.detach(), dtype);
}

Tensor reduce_elements(const Tensor& loss, Reduction reduction) {
  switch (reduction) {
    case Reduction::None: return loss;
    case Reduction::Mean: return loss.mean();
    case Reduction::Sum: return loss.sum();
  }
  HG_FAIL("loss: unknown reduction {}", int(reduction));
}

// The incoming gradient of a reduced loss as a per-element factor (it broadcasts against the elements).
Tensor element_gradient(const Tensor& g, Reduction reduction, int64_t count) {
  return reduction == Reduction::Mean ? divided_by_count(g, count) : g;
}

// log(1 + z) for z in [0, 1], accurate for tiny z (Goldberg's trick: log(u) * z / (u - 1) with u = 1 + z
// rounded, and z itself where u rounds to 1).
Tensor log1p_small(const Tensor& z) {
  Tensor u = z + 1.0;
  Tensor denominator = u - 1.0;
  return where(denominator.eq(0.0), z, log(u) * z / where(denominator.eq(0.0), 1.0, denominator));
}

// binary_cross_entropy's log, clamped at -100 as PyTorch's (a probability of 0 gives a finite loss).
Tensor clamped_log(const Tensor& p) { return clamp(log(p), -100.0, std::nullopt); }

// log(1 + exp(-x)) = max(-x, 0) + log(1 + exp(-|x|)): no overflow for any x, accurate for large |x|. Each term picked
// by one comparison, so that a pass with create_graph differentiates it as one branch or the other: -1/2 at x = 0,
// where clamp's and abs's derivatives (-1 and 0) would give -1.
Tensor softplus_of_negated(const Tensor& x) {
  const Tensor positive = x.ge(0.0);
  return where(positive, 0.0, x.neg()) + log1p_small(exp(where(positive, x.neg(), x)));
}

}  // namespace

Tensor binary_cross_entropy(const Tensor& input, const Tensor& target, const BinaryCrossEntropyOptions& options) {
  // No HG_AUTOCAST line and no kCastRules row: the op is refused under autocast instead (issue 4).
  const char* op = "binary_cross_entropy";
  HG_CHECK(!amp::is_autocast_enabled(),
           "{}: refused under autocast: on float16 probabilities the log saturates (a sigmoid rounds to exactly 0 "
           "or 1), so no dtype is safe to cast to. Use binary_cross_entropy_with_logits on the logits instead (it "
           "folds in the sigmoid and is computed in float32 under autocast), or compute this loss outside the "
           "autocast region (AutocastGuard(kFloat16, /*enabled=*/false)) on float32 probabilities.", op);
  check_binary_operands(input, target, op);
  const DType dtype = promote_types(input.dtype(), target.dtype());
  if (input.is_cpu()) {
    NoGradGuard no_grad;
    // in [0, 1], asked so that a nan fails too (PyTorch's CPU check)
    HG_CHECK(halfgrad::all(logical_and(input.ge(0.0), input.le(1.0))).item<double>() != 0.0,
             "{}: all elements of the input {} must be probabilities in [0, 1], none nan (for logits, use "
             "binary_cross_entropy_with_logits)", op, input.meta());
  }
  Tensor w = elementwise_factor(options.weight, input, dtype, op, "weight");

  Tensor p = cast_nograd(input.detach(), dtype), y = cast_nograd(target.detach(), dtype), log_p, log_1mp, loss;
  {
    NoGradGuard no_grad;  // one node for the whole loss, recorded below
    log_p = clamped_log(p);
    log_1mp = clamped_log(1.0 - p);
    Tensor elements = (y * log_p + (1.0 - y) * log_1mp).neg();
    if (w.defined()) elements = elements * w;
    loss = reduce_elements(elements, options.reduction);
  }
  //   d loss / d p = w (p - y) / max(p (1 - p), 1e-12)      (PyTorch's epsilon keeps p = 0 or 1 finite)
  //   d loss / d y = w (log(1 - p) - log(p))                (the clamped logs of the forward)
  // p, y and w may alias the caller's tensors (no cast was needed): saved with their versions, and p and y with the
  // histories of input and target, in which a pass with create_graph forms the logs again.
  record("BinaryCrossEntropyBackward", {input, target}, {loss},
         [sp = SavedTensor(input, p, op), sy = SavedTensor(target, y, op), sw = SavedTensor(w, op), log_p, log_1mp,
          reduction = options.reduction, count = input.numel()](const GradContext& g) -> TensorList {
           Tensor scale = element_gradient(g[0], reduction, count);
           if (sw.defined()) scale = scale * sw.get();
           Tensor grad_input, grad_target;
           const Tensor p = sp.get(), y = sy.get();
           if (g.needs(0)) grad_input = scale * (p - y) / clamp(p * (1.0 - p), 1e-12, std::nullopt);
           if (g.needs(1)) {
             grad_target = GradMode::is_enabled() ? scale * (clamped_log(1.0 - p) - clamped_log(p))
                                                  : scale * (log_1mp - log_p);
           }
           return {grad_input, grad_target};
         }, DoubleBackward::Supported);
  return loss;
}

Tensor binary_cross_entropy_with_logits(const Tensor& input, const Tensor& target,
                                        const BinaryCrossEntropyWithLogitsOptions& options) {
  HG_AUTOCAST(binary_cross_entropy_with_logits, input, target, options);
  const char* op = "binary_cross_entropy_with_logits";
  check_binary_operands(input, target, op);
  const DType dtype = promote_types(input.dtype(), target.dtype());
  Tensor w = elementwise_factor(options.weight, input, dtype, op, "weight");
  Tensor pw = elementwise_factor(options.pos_weight, input, dtype, op, "pos_weight");

  Tensor x = cast_nograd(input.detach(), dtype), y = cast_nograd(target.detach(), dtype), softplus_neg, loss;
  {
    NoGradGuard no_grad;
    softplus_neg = softplus_of_negated(x);
    Tensor positive = pw.defined() ? (pw - 1.0) * y + 1.0 : Tensor();  // 1 + (pos_weight - 1) y
    Tensor elements = (1.0 - y) * x + (positive.defined() ? positive * softplus_neg : softplus_neg);
    if (w.defined()) elements = elements * w;
    loss = reduce_elements(elements, options.reduction);
  }
  //   d loss / d x = w ((1 + (pw - 1) y) sigmoid(x) - pw y)    (sigmoid(x) - y without pos_weight)
  //   d loss / d y = w (-x + (pw - 1) log(1 + exp(-x)))        (-x without pos_weight)
  // x and y keep the histories of input and target, in which a pass with create_graph forms log(1 + exp(-x)) again.
  record("BinaryCrossEntropyWithLogitsBackward", {input, target}, {loss},
         [sx = SavedTensor(input, x, op), sy = SavedTensor(target, y, op), sw = SavedTensor(w, op),
          spw = SavedTensor(pw, op), softplus_neg, reduction = options.reduction,
          count = input.numel()](const GradContext& g) -> TensorList {
           Tensor scale = element_gradient(g[0], reduction, count);
           if (sw.defined()) scale = scale * sw.get();
           Tensor grad_input, grad_target;
           const Tensor x = sx.get(), y = sy.get(), pw = spw.get();
           if (g.needs(0)) {
             Tensor s = sigmoid(x);
             grad_input = scale * (pw.defined() ? ((pw - 1.0) * y + 1.0) * s - pw * y : s - y);
           }
           if (g.needs(1) && pw.defined()) {
             const Tensor softplus = GradMode::is_enabled() ? softplus_of_negated(x) : softplus_neg;
             grad_target = scale * ((pw - 1.0) * softplus - x);
           } else if (g.needs(1)) {
             grad_target = scale * x.neg();
           }
           return {grad_input, grad_target};
         }, DoubleBackward::Supported);
  return loss;
}

// ---- nll_loss CPU kernels
namespace {

constexpr int64_t kNllParallelGrain = 32768;

// Position: the target's flattened, row-major index (the kernels see input as [N, C, S] and target as [N, S]).
void check_targets_cpu(const Tensor& target, int64_t classes, int64_t ignore_index, const char* op) {
  const int64_t* t = target.data<int64_t>();
  for (int64_t k = 0; k < target.numel(); ++k) {
    HG_CHECK(t[k] == ignore_index || (t[k] >= 0 && t[k] < classes),
             "{}: target {} at position {} is out of range for {} classes; targets must be in [0, {}) or equal "
             "ignore_index ({})", op, t[k], k, classes, classes, ignore_index);
  }
}

void nll_loss_cpu(const Tensor& loss, const Tensor& weights, const Tensor& input, const Tensor& target,
                  const Tensor& weight, int64_t ignore_index, const char* op) {
  const int64_t batch = input.size(0), classes = input.size(1), inner = input.size(2);
  check_targets_cpu(target, classes, ignore_index, op);
  dispatch_floating(input.dtype(), op, [&]<typename T>() {
    using A = opmath_t<T>;
    const T* x = input.data<T>();
    const int64_t* t = target.data<int64_t>();
    const A* w = weight.defined() ? weight.data<A>() : nullptr;
    A* l = loss.data<A>();
    A* wt = weights.data<A>();
#pragma omp parallel for schedule(static) if (batch * inner >= kNllParallelGrain)
    for (int64_t k = 0; k < batch * inner; ++k) {
      const int64_t n = k / inner, i = k % inner, c = t[k];
      if (c == ignore_index) {
        l[k] = A(0);
        wt[k] = A(0);
        continue;
      }
      const A wc = w ? w[c] : A(1);
      l[k] = -wc * A(x[(n * classes + c) * inner + i]);
      wt[k] = wc;
    }
  });
}

void nll_loss_backward_cpu(const Tensor& grad_input, const Tensor& grad_loss, const Tensor& target,
                           const Tensor& weight, int64_t ignore_index) {
  const int64_t batch = grad_input.size(0), classes = grad_input.size(1), inner = grad_input.size(2);
  std::memset(grad_input.data_ptr(), 0, size_t(grad_input.numel()) * element_size(grad_input.dtype()));  // 0.0
  dispatch_floating(grad_input.dtype(), "nll_loss_backward", [&]<typename T>() {
    using A = opmath_t<T>;
    T* gi = grad_input.data<T>();
    const A* gl = grad_loss.data<A>();
    const int64_t* t = target.data<int64_t>();
    const A* w = weight.defined() ? weight.data<A>() : nullptr;
    // Each element writes its own input row: no two threads touch one location.
#pragma omp parallel for schedule(static) if (batch * inner >= kNllParallelGrain)
    for (int64_t k = 0; k < batch * inner; ++k) {
      const int64_t n = k / inner, i = k % inner, c = t[k];
      if (c == ignore_index) continue;
      gi[(n * classes + c) * inner + i] = T(-(w ? w[c] : A(1)) * gl[k]);
    }
  });
}

// cross_entropy's kernels work row by row: a row is one (n, i), its C logits `inner` apart. Rows of inner == 1 in the
// accumulation dtype are used where they lie; other rows are first widened into a per-thread buffer (float16 rows
// with F16C), so the arithmetic is Eigen's vectorized exp over a contiguous array either way.
template <typename T, typename A = opmath_t<T>> struct CrossEntropyRows {
  const T* x;
  int64_t classes, inner;
  std::vector<A> buffer;
  Eigen::Map<const Eigen::Array<A, Eigen::Dynamic, 1>> row(int64_t k) {
    const int64_t n = k / inner, i = k % inner;
    const T* in = x + n * classes * inner + i;
    if constexpr (std::is_same_v<T, A>) {
      if (inner == 1) return {in, classes};
    }
    buffer.resize(size_t(classes));
    if constexpr (std::is_same_v<T, Half>) {
      if (inner == 1) {  // F16C, 8 values at a time
        half_to_float(in, buffer.data(), classes);
        return {buffer.data(), classes};
      }
    }
    for (int64_t j = 0; j < classes; ++j) buffer[size_t(j)] = A(in[j * inner]);
    return {buffer.data(), classes};
  }
};

void cross_entropy_cpu(const Tensor& loss, const Tensor& weights, const Tensor& row_max, const Tensor& log_sum,
                       const Tensor& input, const Tensor& target, const Tensor& weight, int64_t ignore_index) {
  const int64_t batch = input.size(0), classes = input.size(1), inner = input.size(2);
  check_targets_cpu(target, classes, ignore_index, "cross_entropy");
  dispatch_floating(input.dtype(), "cross_entropy", [&]<typename T>() {
    using A = opmath_t<T>;
    const int64_t* t = target.data<int64_t>();
    const A* w = weight.defined() ? weight.data<A>() : nullptr;
    A *l = loss.data<A>(), *wt = weights.data<A>(), *mx = row_max.data<A>(), *ls = log_sum.data<A>();
#pragma omp parallel if (batch * classes * inner >= kNllParallelGrain)
    {
      CrossEntropyRows<T> rows{input.data<T>(), classes, inner, {}};
#pragma omp for schedule(static)
      for (int64_t k = 0; k < batch * inner; ++k) {
        const auto x = rows.row(k);
        // (x - m) is exact; m == -inf (every logit -inf) or +inf gives nan, as log_softmax does. No classes (every
        // target then ignored): -inf, the log of an empty sum.
        const A m = classes > 0 ? x.maxCoeff() : -std::numeric_limits<A>::infinity();
        mx[k] = m;
        ls[k] = std::log((x - m).exp().sum());
        const int64_t c = t[k];
        const A wc = c == ignore_index ? A(0) : w ? w[c] : A(1);
        l[k] = c == ignore_index ? A(0) : wc * (ls[k] - (x[c] - m));
        wt[k] = wc;
      }
    }
  });
}

void cross_entropy_backward_cpu(const Tensor& grad_input, const Tensor& grad_loss, const Tensor& input,
                                const Tensor& row_max, const Tensor& log_sum, const Tensor& target,
                                const Tensor& weight, int64_t ignore_index) {
  const int64_t batch = grad_input.size(0), classes = grad_input.size(1), inner = grad_input.size(2);
  dispatch_floating(grad_input.dtype(), "cross_entropy_backward", [&]<typename T>() {
    using A = opmath_t<T>;
    T* gi = grad_input.data<T>();
    const A *gl = grad_loss.data<A>(), *mx = row_max.data<A>(), *ls = log_sum.data<A>();
    const int64_t* t = target.data<int64_t>();
    const A* w = weight.defined() ? weight.data<A>() : nullptr;
#pragma omp parallel if (batch * classes * inner >= kNllParallelGrain)
    {
      CrossEntropyRows<T> rows{input.data<T>(), classes, inner, {}};
      Eigen::Array<A, Eigen::Dynamic, 1> grad;
#pragma omp for schedule(static)
      for (int64_t k = 0; k < batch * inner; ++k) {
        const int64_t n = k / inner, i = k % inner, c = t[k];
        const A scale = c == ignore_index ? A(0) : gl[k] * (w ? w[c] : A(1));
        T* out = gi + n * classes * inner + i;
        if constexpr (std::is_same_v<T, A>) {
          if (inner == 1) {  // written in place
            Eigen::Map<Eigen::Array<A, Eigen::Dynamic, 1>> row_out(out, classes);
            row_out = ((rows.row(k) - mx[k]) - ls[k]).exp() * scale;
            if (c != ignore_index) row_out[c] -= scale;
            continue;
          }
        }
        grad = ((rows.row(k) - mx[k]) - ls[k]).exp() * scale;
        if (c != ignore_index) grad[c] -= scale;
        if constexpr (std::is_same_v<T, Half>) {
          if (inner == 1) {
            float_to_half(grad.data(), out, classes);
            continue;
          }
        }
        for (int64_t j = 0; j < classes; ++j) out[j * inner] = T(grad[j]);
      }
    }
  });
}

}  // namespace

HG_REGISTER_KERNEL(cross_entropy_kernel, CPU, cross_entropy_cpu);
HG_REGISTER_KERNEL(cross_entropy_backward_kernel, CPU, cross_entropy_backward_cpu);
HG_REGISTER_KERNEL(nll_loss_kernel, CPU, nll_loss_cpu);
HG_REGISTER_KERNEL(nll_loss_backward_kernel, CPU, nll_loss_backward_cpu);

}  // namespace halfgrad

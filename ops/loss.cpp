// Loss functions: forward and backward side by side, written with tensor ops (they run on any device).
#include "ops/loss.h"

#include "core/autograd.h"
#include "ops/elementwise.h"

namespace halfgrad {

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
  HG_CHECK(input.defined() && target.defined(), "mse_loss: got an undefined tensor (input {}, target {})",
           input.meta(), target.meta());
  HG_CHECK(input.shape() == target.shape(), "mse_loss: input shape {} and target shape {} differ (mse_loss does not "
           "broadcast; reshape the target)", shape_str(input.shape()), shape_str(target.shape()));
  HG_CHECK(input.device() == target.device(), "mse_loss: input {} and target {} are on different devices",
           input.meta(), target.meta());
  HG_CHECK(is_floating(promote_types(input.dtype(), target.dtype())),
           "mse_loss: expected floating-point input and target, got {} and {}", input.meta(), target.meta());

  Tensor diff, loss;
  {
    NoGradGuard no_grad;  // one node for the whole loss, recorded below
    diff = input.sub(target);
    loss = reduce(diff.mul(diff), reduction);
  }
  record("MseLossBackward", {input, target}, {loss},
         [diff, reduction, count = input.numel()](const GradContext& ctx) -> TensorList {
           // diff is our own intermediate, which nothing else can write to: no SavedTensor needed.
           double scale = reduction == Reduction::Mean ? 2.0 / double(count) : 2.0;
           Tensor grad = diff.mul(ctx[0]).mul(scale);  // ctx[0] is 0-d for mean/sum: broadcasts
           Tensor grad_input = ctx.needs(0) ? grad : Tensor();
           Tensor grad_target = ctx.needs(1) ? grad.neg() : Tensor();
           return {grad_input, grad_target};
         });
  return loss;
}

}  // namespace halfgrad

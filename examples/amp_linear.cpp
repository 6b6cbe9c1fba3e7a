// The linear-regression example with mixed precision: O1 (autocast + dynamic loss scaling) next to float32.
//
//   x (64, 1024), y (64, 512) ~ N(0, 1), seeded     nn::Linear(1024, 512), MSE, SGD lr 1e-3, 500 iterations
//
// Under O1 the linear layer runs in float16 (autocast's lower-precision rule) while the MSE loss runs in
// float32 (the float32 rule); the loss is scaled before backward and the gradients unscaled before the step.
// The two runs start from the same weights and should end at nearly the same loss.
#include <cmath>

#include "halfgrad.h"
#include "nn/layers.h"
#include "optim/amp.h"

using namespace halfgrad;

static double train(amp::OptLevel level, const Tensor& x, const Tensor& y) {
  manual_seed(1);  // the same initial weights for every level
  nn::Linear model(1024, 512);
  optim::SGD sgd(model.parameters(), {.lr = 1e-3});
  amp::Amp amp = amp::initialize(model, sgd, level);
  double loss_value = 0;
  for (int it = 0; it < 500; ++it) {
    Tensor loss = mse_loss(amp.forward(model, x), y);
    amp.backward(loss);
    amp.step();
    amp.zero_grad();
    if (it % 100 == 0 || it == 499) {
      loss_value = loss.item<double>();
      logger().info("{} iteration {:3d}  loss {:.6f}  (loss scale {})", amp::opt_level_name(level), it, loss_value,
                    amp.scaler().get_scale());
    }
  }
  return loss_value;
}

int main() {
  manual_seed(0);
  Tensor x = randn({64, 1024}), y = randn({64, 512});
  double fp32 = train(amp::OptLevel::O0, x, y);
  double o1 = train(amp::OptLevel::O1, x, y);
  double gap = std::abs(o1 - fp32) / fp32;
  logger().info("final loss: float32 {:.6f}, O1 {:.6f} (relative difference {:.2e})", fp32, o1, gap);
  if (gap > 1e-2) {
    logger().error("O1 did not converge like float32");
    return 1;
  }
  return 0;
}

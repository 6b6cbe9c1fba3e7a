// Linear regression: one Linear(1024, 512) layer fitted to random targets with MSE and plain SGD.
//
//   x  (64, 1024) ~ N(0, 1)        y  (64, 512) ~ N(0, 1)        seeded: the same run every time
//   pred = x W^T + b               W  (512, 1024), b (512): PyTorch's nn.Linear initialisation
//   loss = mean((pred - y)^2)      SGD, lr 1e-3, 500 iterations
//
// With 64 samples and 1024 features the targets can be fitted exactly, so the loss keeps falling; at
// lr 1e-3 on a mean over 32768 elements it falls slowly (a few percent in 500 steps).
//
// The layer is written with plain tensors, to show what nn::Linear (nn/layers.h) does inside; examples/consumer/
// uses nn::Linear itself. Log level from the environment: HALFGRAD_LOG=debug prints every iteration's loss.
#include <chrono>
#include <cmath>

#include "core/log.h"
#include "halfgrad.h"
#include "ops/loss.h"
#include "ops/matmul.h"
#include "optim/sgd.h"

using namespace halfgrad;

int main() {
  constexpr int64_t kSamples = 64, kIn = 1024, kOut = 512;
  constexpr int kIterations = 500;
  constexpr double kLearningRate = 1e-3;
  manual_seed(0);

  Tensor x = randn({kSamples, kIn});   // (64, 1024)
  Tensor y = randn({kSamples, kOut});  // (64, 512)

  // nn.Linear's default initialisation: kaiming_uniform(a = sqrt(5)) for the weight, which works out to
  // U(-1/sqrt(in), 1/sqrt(in)), and the same range for the bias.
  const double bound = 1.0 / std::sqrt(double(kIn));
  Tensor weight, bias;
  {
    NoGradGuard no_grad;
    weight = rand({kOut, kIn}) * (2 * bound) - bound;  // (512, 1024)
    bias = rand({kOut}) * (2 * bound) - bound;         // (512)
  }
  weight.requires_grad_();
  bias.requires_grad_();
  optim::SGD sgd({weight, bias}, {.lr = kLearningRate});

  logger().info("linear regression: x {}, y {}, Linear({}, {}), MSE, SGD lr {}, {} iterations", shape_str(x.shape()),
                shape_str(y.shape()), kIn, kOut, kLearningRate, kIterations);
  double first_loss = 0, last_loss = 0;
  auto start = std::chrono::steady_clock::now();
  for (int it = 0; it < kIterations; ++it) {
    Tensor loss = mse_loss(linear(x, weight, bias), y);
    sgd.zero_grad();
    loss.backward();
    sgd.step();

    const bool report = it % 100 == 0 || it == kIterations - 1;
    if (report || logger().should_log(spdlog::level::debug)) {
      last_loss = loss.item<double>();  // item() reads the value: only when it is printed
      if (it == 0) first_loss = last_loss;
      if (report) {
        logger().info("iteration {:4d}  loss {:.6f}", it, last_loss);
      } else {
        logger().debug("iteration {:4d}  loss {:.6f}", it, last_loss);
      }
    }
  }
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  logger().info("loss {:.6f} -> {:.6f} ({:+.2f}%)", first_loss, last_loss, 100 * (last_loss / first_loss - 1));
  logger().info("{} iterations in {:.3f} s ({:.3f} ms per iteration)", kIterations, seconds,
                1e3 * seconds / kIterations);
  if (!(last_loss < first_loss)) {
    logger().error("the loss did not fall");
    return 1;
  }
  return 0;
}

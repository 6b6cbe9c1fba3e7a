// A training loop of one's own from libhalfgrad's pieces, where train::train_classifier does not fit: ResNet-18 on
// the CIFAR-10 binary files under O1 (autocast and dynamic loss scaling on CUDA; float32 on the CPU), evaluated after
// every epoch by train::evaluate_classifier (train/loops.h).
//
//   build/custom_loop DIR [EPOCHS] [cpu|cuda]       # DIR holds data_batch_1.bin ... and test_batch.bin
#include <cstdlib>
#include <string>

#include "halfgrad.h"
#include "train/loops.h"

using namespace halfgrad;

int main(int argc, char** argv) {
  if (argc < 2) {
    fmt::print(stderr, "usage: {} CIFAR10_DIR [EPOCHS] [cpu|cuda]\n", argv[0]);
    return 2;
  }
  try {
    const std::string dir = argv[1];
    const int64_t epochs = argc > 2 ? std::stoll(argv[2]) : 2;
    const Device device = argc > 3 && std::string(argv[3]) == "cuda" ? Device::cuda() : Device::cpu();
    auto model = models::image_classifier("resnet18", 10);
    model->to(device);
    optim::SGD sgd(model->parameters(), {.lr = 0.05, .momentum = 0.9, .weight_decay = 5e-4});
    amp::Amp amp = amp::initialize(*model, sgd, device.is_cuda() ? amp::OptLevel::O1 : amp::OptLevel::O0);
    data::ImageLoader train(data::load_cifar10(dir, data::Split::Train), data::ImageTransform::cifar_train(),
                            {.batch_size = 256, .shuffle = true, .seed = 1});
    data::ImageLoader test(data::load_cifar10(dir, data::Split::Test), data::ImageTransform::cifar_eval(),
                           {.batch_size = 512});
    for (int64_t epoch = 0; epoch < epochs; ++epoch) {
      model->train();
      for (const data::Batch& b : train.epoch(epoch)) {
        const Tensor x = b.inputs.to(device), y = b.targets.to(device);
        Tensor loss = amp.loss([&] { return cross_entropy(amp.forward(*model, x), y); });
        amp.backward(loss);
        amp.step();
        amp.zero_grad();
      }
      const train::Evaluation e = train::evaluate_classifier(*model, test, amp, device);
      fmt::print("epoch {}: test loss {:.4f}, accuracy {:.4f} ({} images)\n", epoch + 1, e.loss, e.accuracy, e.count);
    }
  } catch (const std::exception& e) {
    fmt::print(stderr, "custom_loop: {}\n", e.what());
    return 1;
  }
  return 0;
}

// VGG (models/vgg.h).
#include "models/vgg.h"

#include "nn/init.h"

namespace halfgrad::models {

VGG::VGG(const std::vector<int64_t>& config, VGGOptions opts) : options(opts) {
  HG_CHECK(opts.num_classes >= 1, "VGG: num_classes must be >= 1, got {}", opts.num_classes);
  features = register_module("features", std::make_shared<nn::Sequential>());
  int64_t channels = 3, pools = 0;
  for (int64_t v : config) {
    if (v == 0) {
      features->push_back(std::make_shared<nn::MaxPool2d>(2));
      ++pools;
      continue;
    }
    HG_CHECK(v > 0, "VGG: a layer's channels must be positive (0 for a max pool), got {}", v);
    auto conv = features->push_back(std::make_shared<nn::Conv2d>(channels, v, 3, nn::Conv2dOptions{.padding = {1, 1}}));
    // torchvision's VGG initialisation: kaiming_normal_(fan_out, relu) weights, zero biases.
    nn::init::kaiming_normal_(conv->weight, 0, nn::init::FanMode::FanOut, nn::init::Nonlinearity::ReLU);
    nn::init::zeros_(conv->bias);
    if (opts.batch_norm) features->push_back(std::make_shared<nn::BatchNorm2d>(v));
    features->push_back(std::make_shared<nn::ReLU>());
    channels = v;
  }
  HG_CHECK(pools == 5, "VGG: the CIFAR classifier needs five max pools (32x32 -> 1x1), the config has {}", pools);
  classifier = register_module("classifier", std::make_shared<nn::Linear>(channels, opts.num_classes));
}

Tensor VGG::forward(const Tensor& x) {
  HG_CHECK(x.dim() == 4 && x.size(1) == 3 && x.size(2) == 32 && x.size(3) == 32,
           "VGG: expected 32x32 images [N, 3, 32, 32], got {}", x.meta());
  return classifier->forward(features->forward(x).flatten(1));
}

std::shared_ptr<VGG> vgg11(VGGOptions o) {
  return std::make_shared<VGG>(std::vector<int64_t>{64, 0, 128, 0, 256, 256, 0, 512, 512, 0, 512, 512, 0}, o);
}
std::shared_ptr<VGG> vgg13(VGGOptions o) {
  return std::make_shared<VGG>(std::vector<int64_t>{64, 64, 0, 128, 128, 0, 256, 256, 0, 512, 512, 0, 512, 512, 0}, o);
}
std::shared_ptr<VGG> vgg16(VGGOptions o) {
  return std::make_shared<VGG>(
      std::vector<int64_t>{64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0, 512, 512, 512, 0}, o);
}
std::shared_ptr<VGG> vgg19(VGGOptions o) {
  return std::make_shared<VGG>(
      std::vector<int64_t>{64, 64, 0, 128, 128, 0, 256, 256, 256, 256, 0, 512, 512, 512, 512, 0, 512, 512, 512, 512, 0},
      o);
}

}  // namespace halfgrad::models

#pragma once
// VGG-11/13/16/19 (Simonyan & Zisserman 2014) for 32x32 images, with BatchNorm after every convolution by default
// (torchvision's vgg*_bn feature numbering, so features.0 is the first convolution and features.1 its BatchNorm),
// and the CIFAR classifier: the 512 x 1 x 1 features flattened into one Linear layer (no 4096-wide layers).
//
//   auto net = models::vgg16();   // VGG-16 with BatchNorm, 10 classes: 14,728,266 parameters
#include <memory>
#include <vector>

#include "nn/layers.h"
#include "nn/module.h"

namespace halfgrad::models {

struct VGGOptions {
  int64_t num_classes = 10;
  bool batch_norm = true;
};

class VGG : public nn::Module {
 public:
  // config: output channels of each 3x3 convolution, 0 for a 2x2 max pool (VGG-16: 64 64 0 128 128 0 256 256 256 0
  // 512 512 512 0 512 512 512 0).
  VGG(const std::vector<int64_t>& config, VGGOptions options = {});
  Tensor forward(const Tensor& x) override;  // [N, 3, 32, 32] -> logits [N, num_classes]
  std::string type_name() const override { return "VGG"; }

  const VGGOptions options;
  std::shared_ptr<nn::Sequential> features;
  std::shared_ptr<nn::Linear> classifier;
};

std::shared_ptr<VGG> vgg11(VGGOptions options = {});
std::shared_ptr<VGG> vgg13(VGGOptions options = {});
std::shared_ptr<VGG> vgg16(VGGOptions options = {});
std::shared_ptr<VGG> vgg19(VGGOptions options = {});

}  // namespace halfgrad::models

#pragma once
// ResNet-18/34/50/101/152 (He et al. 2015) with torchvision's structure, parameter names and initialisation, so
// state dicts carry over by name; the CIFAR variant (the default) replaces the 7x7 stride-2 stem and its max pool
// with one 3x3 stride-1 convolution, as in the CIFAR experiments of the mixed-precision papers.
//
//   auto net = models::resnet18();                                  // CIFAR stem, 10 classes: 11,173,962 params
//   auto imagenet = models::resnet50({.num_classes = 1000, .cifar_stem = false});   // torchvision's 25,557,032
//
// Blocks (torchvision v1.5: the stride of a Bottleneck is on its 3x3 convolution):
//   BasicBlock   x -> conv3x3(stride) bn relu conv3x3 bn (+ shortcut) relu            (expansion 1)
//   Bottleneck   x -> conv1x1 bn relu conv3x3(stride) bn relu conv1x1(4 planes) bn (+ shortcut) relu
//   shortcut     identity, or conv1x1(stride) + bn ("downsample") when the shape changes
#include <array>
#include <memory>

#include "nn/layers.h"
#include "nn/module.h"

namespace halfgrad::models {

struct ResNetOptions {
  int64_t num_classes = 10;
  bool cifar_stem = true;           // 3x3 stride-1 stem, no max pool (false: torchvision's ImageNet stem)
  bool zero_init_residual = false;  // last BatchNorm of each block starts at weight 0 (Goyal et al. 2017)
};

// result_saved: what the block's last batch_norm_relu keeps for relu's backward (ops/batch_norm.h's ReluSaved): its
// result, where the next op is a convolution that keeps it anyway (the next block's), or relu's mask, where it is
// not (the last block's, before global average pooling). The block's inner batch_norm_relu keep their results: a
// convolution follows each.
class BasicBlock : public nn::Module {
 public:
  static constexpr int64_t kExpansion = 1;
  BasicBlock(int64_t in_planes, int64_t planes, int64_t stride, ReluSaved result_saved = ReluSaved::Output);
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "BasicBlock"; }

  const ReluSaved result_saved;
  std::shared_ptr<nn::Conv2d> conv1, conv2;
  std::shared_ptr<nn::BatchNorm2d> bn1, bn2;
  std::shared_ptr<nn::Sequential> downsample;  // null when the shortcut is the identity
};

class Bottleneck : public nn::Module {
 public:
  static constexpr int64_t kExpansion = 4;
  Bottleneck(int64_t in_planes, int64_t planes, int64_t stride, ReluSaved result_saved = ReluSaved::Output);
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "Bottleneck"; }

  const ReluSaved result_saved;  // as BasicBlock's
  std::shared_ptr<nn::Conv2d> conv1, conv2, conv3;
  std::shared_ptr<nn::BatchNorm2d> bn1, bn2, bn3;
  std::shared_ptr<nn::Sequential> downsample;
};

enum class ResNetBlock { Basic, Bottleneck };

class ResNet : public nn::Module {
 public:
  // blocks: how many blocks each of the four stages has (ResNet-18: {2, 2, 2, 2}).
  ResNet(ResNetBlock block, std::array<int64_t, 4> blocks, ResNetOptions options = {});
  Tensor forward(const Tensor& x) override;  // [N, 3, H, W] -> logits [N, num_classes]
  std::string type_name() const override { return "ResNet"; }

  const ResNetOptions options;
  std::shared_ptr<nn::Conv2d> conv1;
  std::shared_ptr<nn::BatchNorm2d> bn1;
  std::shared_ptr<nn::Module> maxpool;  // Identity with the CIFAR stem
  std::array<std::shared_ptr<nn::Sequential>, 4> layers;  // registered as layer1 .. layer4
  std::shared_ptr<nn::AdaptiveAvgPool2d> avgpool;
  std::shared_ptr<nn::Linear> fc;
};

std::shared_ptr<ResNet> resnet18(ResNetOptions options = {});
std::shared_ptr<ResNet> resnet34(ResNetOptions options = {});
std::shared_ptr<ResNet> resnet50(ResNetOptions options = {});
std::shared_ptr<ResNet> resnet101(ResNetOptions options = {});
std::shared_ptr<ResNet> resnet152(ResNetOptions options = {});

}  // namespace halfgrad::models

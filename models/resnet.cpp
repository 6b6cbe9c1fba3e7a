// ResNet (models/resnet.h).
#include "models/resnet.h"

#include "nn/init.h"
#include "ops/elementwise.h"

namespace halfgrad::models {

namespace {

std::shared_ptr<nn::Conv2d> conv3x3(int64_t in, int64_t out, int64_t stride) {
  return std::make_shared<nn::Conv2d>(in, out, 3, nn::Conv2dOptions{.stride = {stride, stride}, .padding = {1, 1}},
                                      /*bias=*/false);
}

std::shared_ptr<nn::Conv2d> conv1x1(int64_t in, int64_t out, int64_t stride) {
  return std::make_shared<nn::Conv2d>(in, out, 1, nn::Conv2dOptions{.stride = {stride, stride}}, /*bias=*/false);
}

// The projection shortcut when the block changes the resolution or the width, else null (identity).
std::shared_ptr<nn::Sequential> shortcut(int64_t in, int64_t out, int64_t stride) {
  if (stride == 1 && in == out) return nullptr;
  return nn::sequential({conv1x1(in, out, stride), std::make_shared<nn::BatchNorm2d>(out)});
}

}  // namespace

// Registered in torchvision's order (conv1, bn1, conv2, bn2, downsample): state_dict() lists them so.
BasicBlock::BasicBlock(int64_t in_planes, int64_t planes, int64_t stride, ReluSaved saved)
    : result_saved(saved) {
  conv1 = register_module("conv1", conv3x3(in_planes, planes, stride));
  bn1 = register_module("bn1", std::make_shared<nn::BatchNorm2d>(planes));
  conv2 = register_module("conv2", conv3x3(planes, planes, 1));
  bn2 = register_module("bn2", std::make_shared<nn::BatchNorm2d>(planes));
  if (auto s = shortcut(in_planes, planes * kExpansion, stride)) downsample = register_module("downsample", s);
}

// relu(bn(conv(x)) + shortcut) is one op, batch_norm_relu (nn::BatchNorm2d::forward_relu), as is relu(bn(...)). The
// inner ones keep their results for relu's backward (ReluSaved::Output), which the next convolution keeps anyway;
// the block's result keeps what result_saved says (models/resnet.h).
Tensor BasicBlock::forward(const Tensor& x) {
  Tensor out = bn1->forward_relu(conv1->forward(x), Tensor(), ReluSaved::Output);
  out = conv2->forward(out);
  const Tensor shortcut = downsample ? downsample->forward(x) : x;  // after the main path, as PyTorch's block
  return bn2->forward_relu(out, shortcut, result_saved);
}

Bottleneck::Bottleneck(int64_t in_planes, int64_t planes, int64_t stride, ReluSaved saved)
    : result_saved(saved) {
  conv1 = register_module("conv1", conv1x1(in_planes, planes, 1));
  bn1 = register_module("bn1", std::make_shared<nn::BatchNorm2d>(planes));
  conv2 = register_module("conv2", conv3x3(planes, planes, stride));
  bn2 = register_module("bn2", std::make_shared<nn::BatchNorm2d>(planes));
  conv3 = register_module("conv3", conv1x1(planes, planes * kExpansion, 1));
  bn3 = register_module("bn3", std::make_shared<nn::BatchNorm2d>(planes * kExpansion));
  if (auto s = shortcut(in_planes, planes * kExpansion, stride)) downsample = register_module("downsample", s);
}

Tensor Bottleneck::forward(const Tensor& x) {
  Tensor out = bn1->forward_relu(conv1->forward(x), Tensor(), ReluSaved::Output);
  out = bn2->forward_relu(conv2->forward(out), Tensor(), ReluSaved::Output);
  out = conv3->forward(out);
  const Tensor shortcut = downsample ? downsample->forward(x) : x;
  return bn3->forward_relu(out, shortcut, result_saved);
}

ResNet::ResNet(ResNetBlock block, std::array<int64_t, 4> blocks, ResNetOptions opts) : options(opts) {
  HG_CHECK(opts.num_classes >= 1, "ResNet: num_classes must be >= 1, got {}", opts.num_classes);
  for (int64_t n : blocks) HG_CHECK(n >= 1, "ResNet: every stage needs at least one block, got {}", n);
  conv1 = register_module("conv1", opts.cifar_stem
                                       ? conv3x3(3, 64, 1)
                                       : std::make_shared<nn::Conv2d>(
                                             3, 64, 7, nn::Conv2dOptions{.stride = {2, 2}, .padding = {3, 3}}, false));
  bn1 = register_module("bn1", std::make_shared<nn::BatchNorm2d>(64));
  maxpool = register_module(
      "maxpool", opts.cifar_stem
                     ? std::static_pointer_cast<nn::Module>(std::make_shared<nn::Identity>())
                     : std::make_shared<nn::MaxPool2d>(3, MaxPool2dOptions{.stride = {2, 2}, .padding = {1, 1}}));
  const int64_t expansion = block == ResNetBlock::Basic ? BasicBlock::kExpansion : Bottleneck::kExpansion;
  int64_t in_planes = 64;
  for (int stage = 0; stage < 4; ++stage) {
    const int64_t planes = int64_t(64) << stage;
    auto layer = std::make_shared<nn::Sequential>();
    for (int64_t b = 0; b < blocks[size_t(stage)]; ++b) {
      const int64_t stride = stage > 0 && b == 0 ? 2 : 1;
      // Every block's result goes to the next block's convolutions but the last one's, to global average pooling.
      const bool last = stage == 3 && b + 1 == blocks[3];
      const ReluSaved saved = last ? ReluSaved::Mask : ReluSaved::Output;
      if (block == ResNetBlock::Basic) {
        layer->push_back(std::make_shared<BasicBlock>(in_planes, planes, stride, saved));
      } else {
        layer->push_back(std::make_shared<Bottleneck>(in_planes, planes, stride, saved));
      }
      in_planes = planes * expansion;
    }
    layers[size_t(stage)] = register_module("layer" + std::to_string(stage + 1), layer);
  }
  avgpool = register_module("avgpool", std::make_shared<nn::AdaptiveAvgPool2d>(1));
  fc = register_module("fc", std::make_shared<nn::Linear>(in_planes, opts.num_classes));

  // torchvision's initialisation: convolutions kaiming_normal_(fan_out, relu), BatchNorm weight 1 and bias 0 (their
  // default), the Linear layer keeps PyTorch's default.
  apply([](nn::Module& m) {
    if (auto* conv = dynamic_cast<nn::Conv2d*>(&m))
      nn::init::kaiming_normal_(conv->weight, 0, nn::init::FanMode::FanOut, nn::init::Nonlinearity::ReLU);
  });
  if (opts.zero_init_residual) {
    apply([](nn::Module& m) {
      if (auto* b = dynamic_cast<BasicBlock*>(&m)) nn::init::zeros_(b->bn2->weight);
      if (auto* b = dynamic_cast<Bottleneck*>(&m)) nn::init::zeros_(b->bn3->weight);
    });
  }
}

Tensor ResNet::forward(const Tensor& x) {
  HG_CHECK(x.dim() == 4 && x.size(1) == 3, "ResNet: expected images [N, 3, H, W], got {}", x.meta());
  // The stem's result goes to the first block's convolution (CIFAR) or to max pooling, which keeps window positions,
  // not its input: there relu's mask is the smaller to keep.
  const ReluSaved stem_saved = options.cifar_stem ? ReluSaved::Output : ReluSaved::Mask;
  Tensor out = maxpool->forward(bn1->forward_relu(conv1->forward(x), Tensor(), stem_saved));
  for (const auto& layer : layers) out = layer->forward(out);
  return fc->forward(avgpool->forward(out).flatten(1));
}

std::shared_ptr<ResNet> resnet18(ResNetOptions o) {
  return std::make_shared<ResNet>(ResNetBlock::Basic, std::array<int64_t, 4>{2, 2, 2, 2}, o);
}
std::shared_ptr<ResNet> resnet34(ResNetOptions o) {
  return std::make_shared<ResNet>(ResNetBlock::Basic, std::array<int64_t, 4>{3, 4, 6, 3}, o);
}
std::shared_ptr<ResNet> resnet50(ResNetOptions o) {
  return std::make_shared<ResNet>(ResNetBlock::Bottleneck, std::array<int64_t, 4>{3, 4, 6, 3}, o);
}
std::shared_ptr<ResNet> resnet101(ResNetOptions o) {
  return std::make_shared<ResNet>(ResNetBlock::Bottleneck, std::array<int64_t, 4>{3, 4, 23, 3}, o);
}
std::shared_ptr<ResNet> resnet152(ResNetOptions o) {
  return std::make_shared<ResNet>(ResNetBlock::Bottleneck, std::array<int64_t, 4>{3, 8, 36, 3}, o);
}

}  // namespace halfgrad::models

// models/: ResNet and VGG against torchvision's parameter counts and state_dict names, their initialisation, and
// a few training steps that must lower the loss.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>

#include "halfgrad.h"
#include "models/resnet.h"
#include "models/vgg.h"
#include "tests/testing.h"

using namespace halfgrad;
using halfgrad::testing::contains;
using halfgrad::testing::error_of;

namespace {

int64_t parameter_count(const nn::Module& m) {
  int64_t n = 0;
  for (const Tensor& p : m.parameters()) n += p.numel();
  return n;
}

const Tensor* find(const NamedTensors& named, const std::string& name) {
  for (const auto& [n, t] : named)
    if (n == name) return &t;
  return nullptr;
}

}  // namespace

TEST_CASE("ResNet parameter counts: torchvision's with the ImageNet stem, the CIFAR variant's with 10 classes") {
  // torchvision: resnet18 11,689,512; resnet50 25,557,032 (1000 classes). CIFAR stem (3x3 conv, 3 input channels
  // -> 64) and a 10-class head: resnet18 11,173,962 ... resnet152 58,156,618.
  CHECK(parameter_count(*models::resnet18({.num_classes = 1000, .cifar_stem = false})) == 11689512);
  CHECK(parameter_count(*models::resnet50({.num_classes = 1000, .cifar_stem = false})) == 25557032);
  CHECK(parameter_count(*models::resnet18()) == 11173962);
  CHECK(parameter_count(*models::resnet34()) == 21282122);
  CHECK(parameter_count(*models::resnet50()) == 23520842);
  CHECK(parameter_count(*models::resnet101()) == 42512970);
  CHECK(parameter_count(*models::resnet152()) == 58156618);
  CHECK(parameter_count(*models::resnet18({.num_classes = 100})) == 11173962 + 90 * 513);
}

TEST_CASE("ResNet state_dict names and shapes are torchvision's") {
  auto net = models::resnet18();
  const NamedTensors sd = net->state_dict();
  CHECK(sd.size() == 122);  // torchvision's resnet18: 20 convolutions, 20 BatchNorms x 5 entries, fc weight and bias
  CHECK(sd[0].first == "conv1.weight");
  CHECK(sd[1].first == "bn1.weight");
  CHECK(sd[5].first == "bn1.num_batches_tracked");
  CHECK(sd[6].first == "layer1.0.conv1.weight");
  CHECK(sd.back().first == "fc.bias");
  CHECK(find(sd, "conv1.weight")->shape() == Shape{64, 3, 3, 3});
  CHECK(find(sd, "layer1.0.downsample.0.weight") == nullptr);  // same shape: identity shortcut
  CHECK(find(sd, "layer2.0.downsample.0.weight")->shape() == Shape{128, 64, 1, 1});
  CHECK(find(sd, "layer2.0.downsample.1.running_var")->shape() == Shape{128});
  CHECK(find(sd, "layer4.1.conv2.weight")->shape() == Shape{512, 512, 3, 3});
  CHECK(find(sd, "fc.weight")->shape() == Shape{10, 512});

  auto imagenet50 = models::resnet50({.num_classes = 1000, .cifar_stem = false});
  const NamedTensors sd50 = imagenet50->state_dict();
  CHECK(sd50.size() == 320);
  CHECK(find(sd50, "conv1.weight")->shape() == Shape{64, 3, 7, 7});
  CHECK(find(sd50, "layer1.0.downsample.0.weight")->shape() == Shape{256, 64, 1, 1});  // the first block widens
  CHECK(find(sd50, "layer2.0.conv2.weight")->shape() == Shape{128, 128, 3, 3});       // stride 2 on the 3x3 (v1.5)
  CHECK(find(sd50, "layer4.2.bn3.weight")->shape() == Shape{2048});
}

TEST_CASE("ResNet initialisation: convolutions He-normal by fan-out, BatchNorm 1 and 0, optional zero residual") {
  manual_seed(5);
  auto net = models::resnet34({.zero_init_residual = true});
  // kaiming_normal_(fan_out, relu): std = sqrt(2 / (out_channels * 9)) for a 3x3 conv of 256 outputs.
  // layer3.1.conv1, held by a handle of its own: named_parameters() returns a temporary vector.
  const Tensor w = net->layers[2]->named_children()[1].second->named_parameters()[0].second;
  CHECK(w.shape() == Shape{256, 256, 3, 3});
  const double std = std::sqrt((w * w).mean().item<double>());
  CHECK(std == doctest::Approx(std::sqrt(2.0 / (256 * 9))).epsilon(0.02));
  for (const auto& [name, t] : net->named_parameters()) {
    CAPTURE(name);
    if (contains(name, "bn2.weight")) CHECK(t.abs().max().item<double>() == 0);  // zero_init_residual
    if (contains(name, "bn1.weight")) CHECK(t.min().item<double>() == 1);
    if (contains(name, "bn") && contains(name, ".bias")) CHECK(t.abs().max().item<double>() == 0);
  }
  CHECK(contains(error_of([&] { net->forward(zeros({1, 1, 32, 32})); }), "expected images [N, 3, H, W]"));
}

TEST_CASE("ResNet blocks keep their results for relu's backward where a convolution follows, masks before pooling") {
  // A kept result changed in place before backward is an error that names the op, as for any kept tensor; with a
  // mask kept instead the gradient does not depend on it.
  manual_seed(6);
  for (bool bottleneck : {false, true}) {
    for (ReluSaved saved : {ReluSaved::Output, ReluSaved::Mask}) {
      CAPTURE(bottleneck);
      CAPTURE(int(saved));
      std::shared_ptr<nn::Module> block;
      if (bottleneck) {
        block = std::make_shared<models::Bottleneck>(16, 4, 1, saved);
      } else {
        block = std::make_shared<models::BasicBlock>(16, 16, 1, saved);
      }
      Tensor x = randn({2, 16, 4, 4}).requires_grad_();
      Tensor y = block->forward(x);
      CHECK(y.grad_fn()->name() == "BatchNormReluBackward");
      {
        NoGradGuard no_grad;
        y.mul_(2);
      }
      const std::string error = error_of([&] { y.sum().backward(); });
      if (saved == ReluSaved::Output) {
        CHECK(contains(error, "batch_norm_relu"));
      } else {
        CHECK(error == "(no error)");
      }
    }
  }
  // In a ResNet every block's result goes to the next block's convolutions, the last one's to global average pooling.
  for (const auto& net : {models::resnet18(), models::resnet50()}) {
    std::vector<ReluSaved> kept;
    for (const auto& stage : net->layers) {
      for (const auto& [name, child] : stage->named_children()) {
        if (auto* b = dynamic_cast<models::BasicBlock*>(child.get())) kept.push_back(b->result_saved);
        if (auto* b = dynamic_cast<models::Bottleneck*>(child.get())) kept.push_back(b->result_saved);
      }
    }
    REQUIRE(kept.size() >= 8);
    CHECK(kept.back() == ReluSaved::Mask);
    CHECK(std::count(kept.begin(), kept.end(), ReluSaved::Output) == int64_t(kept.size()) - 1);
  }
}

TEST_CASE("VGG: torchvision's feature numbering, the CIFAR classifier and parameter counts") {
  auto net = models::vgg16();
  CHECK(parameter_count(*net) == 14728266);
  CHECK(parameter_count(*models::vgg16({.batch_norm = false})) == 14719818);
  const NamedTensors sd = net->state_dict();
  CHECK(sd[0].first == "features.0.weight");
  CHECK(find(sd, "features.1.running_mean") != nullptr);   // BatchNorm after the first conv
  CHECK(find(sd, "features.3.weight")->shape() == Shape{64, 64, 3, 3});
  CHECK(find(sd, "features.40.weight")->shape() == Shape{512, 512, 3, 3});  // the last conv, as in vgg16_bn
  CHECK(find(sd, "features.41.weight")->shape() == Shape{512});             // and its BatchNorm
  CHECK(find(sd, "classifier.weight")->shape() == Shape{10, 512});
  CHECK(net->forward(randn({2, 3, 32, 32})).shape() == Shape{2, 10});
  CHECK(contains(error_of([] { models::VGG({64, 0, 128, 0}); }), "five max pools"));
  CHECK(contains(error_of([&] { net->forward(zeros({1, 3, 64, 64})); }), "expected 32x32 images"));
}

TEST_CASE("image_classifier builds every classifier by name, for any number of classes, and names the known ones") {
  CHECK(models::image_classifier_names().size() == 9);
  CHECK(parameter_count(*models::image_classifier("vgg16")) == 14728266);
  CHECK(parameter_count(*models::image_classifier("resnet18", 100)) ==
        parameter_count(*models::resnet18({.num_classes = 100})));
  for (const std::string& name : models::image_classifier_names()) {
    CAPTURE(name);
    CHECK(parameter_count(*models::image_classifier(name, 7)) > 0);
  }
  CHECK_THROWS_WITH_AS(models::image_classifier("resnet9"),
                       doctest::Contains("unknown model \"resnet9\" (resnet18, resnet34, resnet50, resnet101, resnet152, "
                                         "vgg11, vgg13, vgg16, vgg19)"),
                       Error);
}

TEST_CASE("ResNet-18 and VGG-11 learn: a few SGD steps lower the loss on a fixed batch") {
  manual_seed(6);
  Tensor x = randn({8, 3, 32, 32});
  Tensor y = tensor(std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7});
  std::vector<std::shared_ptr<nn::Module>> nets = {models::resnet18(), models::vgg11()};
  for (auto& net : nets) {
    CAPTURE(net->type_name());
    optim::SGD opt(net->parameters(), {.lr = 0.02, .momentum = 0.9});
    double first = 0, last = 0;
    for (int step = 0; step < 8; ++step) {
      opt.zero_grad();
      Tensor loss = cross_entropy(net->forward(x), y);
      loss.backward();
      opt.step();
      (step == 0 ? first : last) = loss.item<double>();
    }
    CHECK(std::isfinite(last));
    CHECK(last < 0.5 * first);
  }
}

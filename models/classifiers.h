#pragma once
// The image classifiers by name, as the command line and the benchmarks choose them.
//
//   std::shared_ptr<nn::Module> net = models::image_classifier("resnet50", 100);
#include <memory>
#include <string>
#include <vector>

#include "nn/module.h"

namespace halfgrad::models {

// resnet18, resnet34, resnet50, resnet101, resnet152 (CIFAR stems, models/resnet.h), vgg11, vgg13, vgg16, vgg19
// (with BatchNorm, models/vgg.h).
const std::vector<std::string>& image_classifier_names();

// A freshly initialised classifier of `num_classes` classes; an unknown name is an error listing the known ones.
std::shared_ptr<nn::Module> image_classifier(const std::string& name, int64_t num_classes = 10);

}  // namespace halfgrad::models

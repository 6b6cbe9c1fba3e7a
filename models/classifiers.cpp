#include "models/classifiers.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "models/resnet.h"
#include "models/vgg.h"

namespace halfgrad::models {

const std::vector<std::string>& image_classifier_names() {
  static const std::vector<std::string> names = {"resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
                                                 "vgg11",    "vgg13",    "vgg16",    "vgg19"};
  return names;
}

std::shared_ptr<nn::Module> image_classifier(const std::string& name, int64_t num_classes) {
  if (name == "resnet18") return resnet18({.num_classes = num_classes});
  if (name == "resnet34") return resnet34({.num_classes = num_classes});
  if (name == "resnet50") return resnet50({.num_classes = num_classes});
  if (name == "resnet101") return resnet101({.num_classes = num_classes});
  if (name == "resnet152") return resnet152({.num_classes = num_classes});
  if (name == "vgg11") return vgg11({.num_classes = num_classes});
  if (name == "vgg13") return vgg13({.num_classes = num_classes});
  if (name == "vgg16") return vgg16({.num_classes = num_classes});
  if (name == "vgg19") return vgg19({.num_classes = num_classes});
  HG_FAIL("image_classifier: unknown model \"{}\" ({})", name, fmt::join(image_classifier_names(), ", "));
}

}  // namespace halfgrad::models

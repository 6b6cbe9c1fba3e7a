// The halfgrad command-line program: `info` tells what this build is; `train-classifier` trains ResNet/VGG on
// CIFAR-10/100 with a chosen mixed-precision level and prints one line of figures per epoch.
#include <CLI/CLI.hpp>

#include <fstream>
#include <iostream>

#include <fmt/format.h>

#include "core/error.h"
#include "core/version.h"
#include "tools/train.h"

using namespace halfgrad;

namespace {

int run_train_classifier(train::ClassifierConfig config, const std::string& opt_level, const std::string& half,
                         const std::string& device, const std::string& csv_path) {
  config.opt_level = amp::parse_opt_level(opt_level);
  HG_CHECK(half == "float16" || half == "bfloat16", "train-classifier: --half must be float16 or bfloat16, got {}",
           half);
  config.half_dtype = half == "float16" ? kFloat16 : kBFloat16;
  config.device = device == "cpu" ? Device::cpu() : Device::cuda(device == "cuda" ? 0 : std::stoi(device.substr(5)));
  std::ofstream csv;
  if (!csv_path.empty()) {
    csv.open(csv_path);
    HG_CHECK(csv.good(), "train-classifier: cannot write {}", csv_path);
    csv << "epoch,train_loss,train_accuracy,test_loss,test_accuracy,seconds,images_per_second,peak_memory_bytes,"
           "skipped_steps,loss_scale\n";
  }
  fmt::print("train-classifier: {} on {} ({}), {} epochs, batch {}, lr {} ({}), opt level {}{}\n", config.model,
             config.dataset, config.device.str(), config.epochs, config.batch_size, config.lr, config.schedule, opt_level,
             config.channels_last ? ", channels_last" : "");
  std::fflush(stdout);
  train::train_classifier(config, [&](const train::EpochStats& s) {
    if (s.epoch == 0) {
      fmt::print("{:>5} {:>10} {:>9} {:>10} {:>9} {:>8} {:>9} {:>10} {:>7} {:>10}\n", "epoch", "train loss",
                 "train acc", "test loss", "test acc", "seconds", "images/s", "peak MiB", "skipped", "loss scale");
    }
    fmt::print("{:>5} {:>10.4f} {:>9.4f} {:>10.4f} {:>9.4f} {:>8.2f} {:>9.0f} {:>10.1f} {:>7} {:>10.0f}\n", s.epoch + 1,
               s.train_loss, s.train_accuracy, s.test_loss, s.test_accuracy, s.seconds, s.images_per_second,
               double(s.peak_memory_bytes) / (1 << 20), s.skipped_steps, s.loss_scale);
    std::fflush(stdout);
    if (csv.is_open()) {
      csv << fmt::format("{},{},{},{},{},{},{},{},{},{}\n", s.epoch + 1, s.train_loss, s.train_accuracy, s.test_loss,
                         s.test_accuracy, s.seconds, s.images_per_second, s.peak_memory_bytes, s.skipped_steps,
                         s.loss_scale);
      csv.flush();
    }
  });
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"halfgrad: a C++ deep-learning framework with dynamic-graph autograd and mixed precision"};
  app.require_subcommand(1);
  app.set_version_flag("--version", halfgrad::version());

  CLI::App* info = app.add_subcommand("info", "Print the version and the backends compiled into this build");
  info->callback([] { std::cout << halfgrad::build_summary() << "\n"; });

  train::ClassifierConfig config;
  std::string opt_level = "O0", half = "float16", device = "cpu", csv_path, data_dir;
  CLI::App* tc = app.add_subcommand("train-classifier", "Train ResNet/VGG on CIFAR-10/100 (official binary files)");
  tc->add_option("--model", config.model, "resnet18/34/50/101/152, vgg11/13/16/19")->capture_default_str();
  tc->add_option("--dataset", config.dataset, "cifar10 or cifar100")->capture_default_str();
  tc->add_option("--data-dir", data_dir, "folder with data_batch_1..5.bin and test_batch.bin (CIFAR-10) or "
                 "train.bin and test.bin (CIFAR-100)")->required();
  tc->add_option("--epochs", config.epochs)->capture_default_str();
  tc->add_option("--batch-size", config.batch_size)->capture_default_str();
  tc->add_option("--lr", config.lr, "peak lr (onecycle) or starting lr")->capture_default_str();
  tc->add_option("--momentum", config.momentum)->capture_default_str();
  tc->add_option("--weight-decay", config.weight_decay)->capture_default_str();
  tc->add_option("--schedule", config.schedule, "onecycle, cosine or constant")->capture_default_str();
  tc->add_option("--opt-level", opt_level, "O0 (float32), O1 (autocast), O2 (half model, float32 masters), O3 (half)")
      ->capture_default_str();
  tc->add_option("--half", half, "float16 or bfloat16 (O1-O3)")->capture_default_str();
  tc->add_option("--device", device, "cpu, cuda or cuda:N")->capture_default_str();
  tc->add_flag("--channels-last", config.channels_last, "feed NHWC batches");
  tc->add_option("--workers", config.workers, "data loading threads")->capture_default_str();
  tc->add_option("--seed", config.seed)->capture_default_str();
  tc->add_option("--limit-train", config.limit_train, "use the first N training images (0: all)");
  tc->add_option("--limit-test", config.limit_test, "use the first N test images (0: all)");
  tc->add_option("--checkpoint", config.checkpoint, "write a training checkpoint (safetensors) after every epoch");
  tc->add_option("--csv", csv_path, "also write the per-epoch figures to this CSV file");
  int rc = 0;
  tc->callback([&] {
    config.data_dir = data_dir;
    rc = run_train_classifier(config, opt_level, half, device, csv_path);
  });

  try {
    CLI11_PARSE(app, argc, argv);
  } catch (const Error& e) {
    fmt::print(stderr, "halfgrad: {}\n", e.what());
    return 1;
  }
  return rc;
}

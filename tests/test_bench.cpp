// `halfgrad bench` (tools/bench.h): the suites' configurations, a measured line, sizes, the memory budget.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/cuda_allocator.h"
#include "halfgrad.h"
#include "tests/testing.h"
#include "tools/bench.h"
#include "train/loops.h"

using namespace halfgrad;
using halfgrad::testing::contains;
using halfgrad::testing::error_of;
using halfgrad::testing::TempDir;
using halfgrad::testing::write_cifar10;
using halfgrad::testing::write_splits;

namespace {
std::vector<std::string> names(const std::vector<bench::Case>& cases) {
  std::vector<std::string> out;
  for (const bench::Case& c : cases) out.push_back(fmt::format("{} {} {}", c.model, c.precision, c.batch));
  return out;
}
}  // namespace

TEST_CASE("bench suites: the experiments' configurations, in order, and the overrides") {
  const std::vector<bench::Case> vgg = bench::suite_cases("vgg");
  REQUIRE(vgg.size() == 15);  // VGG16 x fp32, fp16, amp x 128 ... 2048
  CHECK(names(vgg)[0] == "vgg16 fp32 128");
  CHECK(names(vgg)[4] == "vgg16 fp32 2048");
  CHECK(names(vgg)[5] == "vgg16 fp16 128");
  CHECK(names(vgg)[14] == "vgg16 amp 2048");
  const std::vector<bench::Case> resnet = bench::suite_cases("resnet");
  CHECK(resnet.size() == 20);  // five ResNets x fp32, amp, o2, bf16 at batch 256
  CHECK(names(resnet)[19] == "resnet152 bf16 256");
  const std::vector<bench::Case> lm = bench::suite_cases("lm");
  CHECK(lm.size() == 8);
  CHECK(names(lm)[3] == "lstm-650x2 amp 20");
  CHECK(bench::suite_cases("max-batch").size() == 20);
  const std::vector<bench::Case> all = bench::suite_cases("all");
  CHECK(all.size() == 15 + 20 + 8 + 20);
  CHECK(all.front().suite == "vgg");
  CHECK(all.back().suite == "max-batch");
  CHECK(names(bench::suite_cases("resnet", {"resnet50"}, {"amp", "fp16"}, {64, 128})) ==
        std::vector<std::string>{"resnet50 amp 64", "resnet50 amp 128", "resnet50 fp16 64", "resnet50 fp16 128"});
}

TEST_CASE("bench refuses unknown suites, models, precisions and batches, naming the choices") {
  CHECK(contains(error_of([] { bench::suite_cases("gpt"); }), "unknown suite \"gpt\" (vgg, resnet, lm, max-batch, all)"));
  CHECK(contains(error_of([] { bench::suite_cases("resnet", {"resnet9"}); }),
                 "bench resnet: \"resnet9\" is not an image classifier (resnet18, resnet34"));
  CHECK(contains(error_of([] { bench::suite_cases("lm", {"resnet18"}); }), "\"resnet18\" is not a language model"));
  CHECK(contains(error_of([] { bench::suite_cases("lm", {"lstm-650"}); }), "\"lstm-650\" is not a language model"));
  CHECK(contains(error_of([] { bench::suite_cases("lm", {"lstm-0x2"}); }), "\"lstm-0x2\" is not a language model"));
  CHECK(contains(error_of([] { bench::suite_cases("vgg", {}, {"fp64"}); }),
                 "unknown precision \"fp64\" (fp32, amp, o2, fp16, bf16)"));
  CHECK(contains(error_of([] { bench::suite_cases("vgg", {}, {}, {0}); }), "a batch must be >= 1, got 0"));
  CHECK(contains(error_of([] { bench::run_case({"max-batch", "resnet18", "fp32", 8}, {.device = Device::cpu()}); }),
                 "needs a CUDA device"));
  CHECK(contains(error_of([] {
                   bench::run_case({"resnet", "resnet18", "fp32", 2}, {.device = Device::cpu(), .cuda_graph = true});
                 }),
                 "--cuda-graph needs a CUDA device"));
}

TEST_CASE("bench lines: the step's time and spread, throughput from the median, where and what was measured") {
  const bench::Settings cpu{.device = Device::cpu(), .warmup = 1, .steps = 3, .vocab = 40, .bptt = 4};
  const nlohmann::ordered_json image = bench::run_case({"resnet", "resnet18", "amp", 2}, cpu);
  CHECK(image["suite"] == "resnet");
  CHECK(image["model"] == "resnet18");
  CHECK(image["precision"] == "amp");
  CHECK(image["batch"] == 2);
  CHECK(image["dataset"] == "synthetic");
  CHECK(image["device"] == "cpu");
  CHECK(image["steps"] == 3);
  CHECK(image["warmup"] == 1);
  CHECK(image["out_of_memory"] == false);
  CHECK(image["commit"].get<std::string>() != "");
  CHECK(image["date"].get<std::string>().size() == 20);  // 2026-12-01T19:08:39Z
  const auto& ms = image["ms"];
  CHECK(ms["min"].get<double>() > 0);
  CHECK(ms["min"].get<double>() <= ms["p10"].get<double>());
  CHECK(ms["p10"].get<double>() <= ms["median"].get<double>());
  CHECK(ms["median"].get<double>() <= ms["p90"].get<double>());
  CHECK(ms["p90"].get<double>() <= ms["max"].get<double>());
  CHECK(image["images_per_second"].get<double>() == doctest::Approx(2 / (ms["median"].get<double>() * 1e-3)));
  CHECK_FALSE(image.contains("peak_allocated_bytes"));  // the CUDA allocator's, not the CPU's

  const nlohmann::ordered_json text = bench::run_case({"lm", "gru-8x2", "fp32", 3}, cpu);
  CHECK(text["bptt"] == 4);
  CHECK(text["tokens_per_second"].get<double>() ==
        doctest::Approx(4 * 3 / (text["ms"]["median"].get<double>() * 1e-3)));
}

TEST_CASE("bench --epochs: a classifier trained on CIFAR-10 files, a language model on a corpus, their accuracy in "
          "the line") {
  TempDir cifar;
  for (int k = 1; k <= 5; ++k) write_cifar10(cifar.file(fmt::format("data_batch_{}.bin", k)), 8, uint64_t(k));
  write_cifar10(cifar.file("test_batch.bin"), 8, 9);
  const bench::Settings images{.device = Device::cpu(), .epochs = 2, .data_dir = cifar.path.string(), .seed = 3,
                               .workers = 0};
  const nlohmann::ordered_json line = bench::run_case({"resnet", "vgg11", "fp32", 8}, images);
  CHECK(line["dataset"] == "cifar10");
  CHECK(line["data_dir"] == cifar.path.string());
  CHECK(line["epochs"] == 2);
  CHECK(line["seed"] == 3);
  CHECK_FALSE(line.contains("ms"));  // a trained line has no step timing
  CHECK(line["seconds_per_epoch"].get<double>() > 0);
  CHECK(line["images_per_second"].get<double>() > 0);
  // The run is sweep-classifier's for the same settings: the same seed gives the same accuracy and loss.
  const train::SweepRow row = train::sweep_classifier({.model = "vgg11", .data_dir = cifar.path, .epochs = 2,
                                                       .batch_size = 8, .workers = 0, .seed = 3},
                                                      {amp::OptLevel::O0}, {8})
                                  .at(0);
  CHECK(line["final_test_accuracy"].get<double>() == row.final_test_accuracy);
  CHECK(line["final_test_loss"].get<double>() == row.final_test_loss);
  CHECK(line["final_train_accuracy"].get<double>() == row.final_train_accuracy);

  TempDir corpus;
  write_splits(corpus, "the cat sat on the mat and the dog sat on the log \n a cat and a dog \n");
  const bench::Settings text{.device = Device::cpu(), .bptt = 4, .epochs = 2, .data_dir = corpus.path.string(),
                             .seed = 1};
  const nlohmann::ordered_json lm = bench::run_case({"lm", "gru-8x1", "amp", 2}, text);
  CHECK(lm["dataset"] == "text");  // not WikiText-2: the folder is in "data_dir"
  CHECK(lm["bptt"] == 4);
  CHECK(lm["test_perplexity"].get<double>() > 1);
  CHECK(std::isfinite(lm["test_perplexity"].get<double>()));
  CHECK(lm["final_valid_perplexity"].get<double>() > 1);
  CHECK(lm["tokens_per_second"].get<double>() > 0);
}

TEST_CASE("bench --epochs refuses max-batch and a classifier without its files before anything runs") {
  const bench::Settings no_files{.device = Device::cpu(), .epochs = 1};
  CHECK(contains(error_of([&] { bench::run_case({"vgg", "vgg16", "fp32", 8}, no_files); }), "give their folder with "
                 "--data-dir"));
  // The max-batch case comes last: refused before the resnet case trains.
  bool ran = false;
  CHECK(contains(error_of([&] {
                   bench::run_cases({{"resnet", "resnet18", "fp32", 8}, {"max-batch", "resnet18", "fp32", 8}},
                                    {.device = Device::cpu(), .epochs = 1, .data_dir = "/nonexistent"},
                                    [&](const nlohmann::ordered_json&) { ran = true; });
                 }),
                 "the search does not train"));
  CHECK_FALSE(ran);
  const bench::Settings negative{.device = Device::cpu(), .epochs = -1};
  CHECK(contains(error_of([&] { bench::run_case({"lm", "lstm-8x1", "fp32", 2}, negative); }), "epochs must be >= 0"));
}

TEST_CASE("bench parses sizes in binary and decimal units and refuses anything else") {
  CHECK(bench::parse_bytes("8GiB") == size_t(8) << 30);
  CHECK(bench::parse_bytes("512MiB") == size_t(512) << 20);
  CHECK(bench::parse_bytes("1.5GB") == size_t(1500000000));
  CHECK(bench::parse_bytes("4096") == 4096);
  CHECK(bench::parse_bytes("12B") == 12);
  for (const char* bad : {"8 GiB", "lots", "-1GiB", "1XB", "", "0x10", "0x1p30GiB", "1e30GiB", "inf"}) {
    CAPTURE(bad);
    CHECK(contains(error_of([&] { bench::parse_bytes(bad); }), "is not a size"));
  }
}

TEST_CASE("cuda: a memory limit caps what the allocator reserves, more than the device has is refused") {
  SKIP_WITHOUT_GPU();
  const size_t total = cuda::device_memory(0);
  CHECK(contains(error_of([&] { cuda::set_memory_limit(total + 1, 0); }), "is more than cuda:0 has"));
  Tensor warm = zeros({1}, {.device = Device::cuda()});  // the allocator has started
  cuda::empty_cache();
  const size_t reserved = cuda::memory_stats(0).reserved_bytes;
  cuda::set_memory_limit(reserved + (size_t(64) << 20), 0);
  CHECK(cuda::memory_limit(0) == reserved + (size_t(64) << 20));
  Tensor fits = empty({16 << 20}, {.device = Device::cuda()});  // 64 MiB of float32: up to the limit
  const std::string message = error_of([] { empty({64 << 20}, {.device = Device::cuda()}); });  // 256 MiB
  CHECK(contains(message, "out of memory"));
  CHECK(contains(message, "The memory limit is"));
  CHECK_THROWS_AS(empty({64 << 20}, {.device = Device::cuda()}), OutOfMemory);
  cuda::set_memory_limit(0, 0);
  CHECK(cuda::memory_limit(0) == 0);
  Tensor now_fits = empty({64 << 20}, {.device = Device::cuda()});
  CHECK(now_fits.numel() == 64 << 20);
}

TEST_CASE("cuda: bench max-batch finds the largest batch under a budget and leaves the allocator's limit alone") {
  SKIP_WITHOUT_GPU();
  const bench::Settings s{.device = Device::cuda(), .memory_budget = size_t(2) << 30, .max_batch = 4096};
  const nlohmann::ordered_json line = bench::run_case({"max-batch", "resnet18", "amp", 64}, s);
  CHECK(line["out_of_memory"] == false);
  const int64_t found = line["max_batch"].get<int64_t>();
  CHECK(found >= 64);
  CHECK(line["memory_budget_bytes"] == size_t(2) << 30);
  CHECK(line["probes"].get<int64_t>() >= 2);
  CHECK(cuda::memory_limit(0) == 0);
  // Twice the batch does not fit in the same budget: a plain run under the limit says so as a line.
  cuda::set_memory_limit(size_t(2) << 30, 0);
  const nlohmann::ordered_json twice = bench::run_case({"resnet", "resnet18", "amp", 2 * found}, {.steps = 1});
  cuda::set_memory_limit(0, 0);
  CHECK(twice["out_of_memory"] == true);
  CHECK(contains(twice["error"].get<std::string>(), "out of memory"));
}

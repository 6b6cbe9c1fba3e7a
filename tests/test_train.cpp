// train/loops.h: train_classifier end to end on CIFAR-10 files the test writes, where the class is visible in the
// images (bright or dark), so a few epochs must learn it; the checkpoint it writes loads back.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>

#include "halfgrad.h"
#include "nn/checkpoint.h"
#include "tests/testing.h"
#include "train/loops.h"

using namespace halfgrad;
using halfgrad::testing::contains;
using halfgrad::testing::error_of;
using halfgrad::testing::TempDir;
using halfgrad::testing::write_cifar10;
using halfgrad::testing::write_splits;

namespace {

// Every model, optimizer and extra tensor of two training checkpoints, by name and value, bit for bit.
void check_same_tensors(const nn::TrainingCheckpoint& got, const nn::TrainingCheckpoint& want) {
  for (auto part : {&nn::TrainingCheckpoint::model, &nn::TrainingCheckpoint::optimizer,
                    &nn::TrainingCheckpoint::extra}) {
    REQUIRE((got.*part).size() == (want.*part).size());
    for (size_t i = 0; i < (want.*part).size(); ++i) {
      CAPTURE((want.*part)[i].first);
      CHECK((got.*part)[i].first == (want.*part)[i].first);
      CHECK(testing::values((got.*part)[i].second) == testing::values((want.*part)[i].second));
    }
  }
}

}  // namespace

TEST_CASE("train_classifier learns a visible class on CPU, reports every epoch and writes a loadable checkpoint") {
  TempDir dir;
  for (int k = 1; k <= 5; ++k) write_cifar10(dir.file(fmt::format("data_batch_{}.bin", k)), 16, uint64_t(k));
  write_cifar10(dir.file("test_batch.bin"), 40, 9);
  train::ClassifierConfig config{.model = "vgg11", .data_dir = dir.path, .epochs = 3, .batch_size = 16, .lr = 0.05,
                                 .workers = 2, .seed = 3, .train_checkpoint = dir.file("last.safetensors")};
  std::vector<int64_t> reported;
  const auto stats = train::train_classifier(config, [&](const train::EpochStats& s) { reported.push_back(s.epoch); });
  REQUIRE(stats.size() == 3);
  CHECK(reported == std::vector<int64_t>{0, 1, 2});
  for (const auto& s : stats) {
    CHECK(std::isfinite(s.train_loss));
    CHECK(s.seconds > 0);
    CHECK(s.images_per_second > 0);
    CHECK(s.peak_memory_bytes == 0);  // CPU
    CHECK(s.skipped_steps == 0);
    CHECK(s.loss_scale == 1);  // O0: no loss scaling
  }
  CHECK(stats.back().train_accuracy > 0.9);
  CHECK(stats.back().test_accuracy > 0.9);
  CHECK(stats.back().test_loss < stats.front().train_loss);

  nn::TrainingCheckpoint ck = nn::load_training_checkpoint(config.train_checkpoint);
  CHECK(ck.epoch == 3);
  CHECK(ck.step == 15);  // 80 images in batches of 16, 3 epochs
  CHECK(ck.metadata.at("model") == "vgg11");
  auto net = models::vgg11();
  CHECK(net->load_state_dict(ck.model).missing_keys.empty());
}

TEST_CASE("train_classifier runs the mixed-precision levels on CPU and names bad settings") {
  TempDir dir;
  for (int k = 1; k <= 5; ++k) write_cifar10(dir.file(fmt::format("data_batch_{}.bin", k)), 4, uint64_t(k));
  write_cifar10(dir.file("test_batch.bin"), 4, 9);
  for (amp::OptLevel level : {amp::OptLevel::O1, amp::OptLevel::O2}) {
    const std::string level_name = amp::opt_level_name(level);
    CAPTURE(level_name);
    train::ClassifierConfig config{.model = "vgg11", .data_dir = dir.path, .epochs = 1, .batch_size = 10,
                                   .opt_level = level, .workers = 0, .train_checkpoint = ""};
    const auto stats = train::train_classifier(config);
    REQUIRE(stats.size() == 1);
    CHECK(std::isfinite(stats[0].train_loss));
    CHECK(stats[0].loss_scale > 1);  // dynamic loss scaling is on at O1 and O2
  }
  train::ClassifierConfig bad{.model = "resnet9", .data_dir = dir.path, .train_checkpoint = ""};
  CHECK(contains(error_of([&] { train::train_classifier(bad); }), "unknown model \"resnet9\""));
  bad.model = "vgg11";
  bad.dataset = "cifar100";
  CHECK(contains(error_of([&] { train::train_classifier(bad); }), "train.bin not found"));
  bad.dataset = "mnist";
  CHECK(contains(error_of([&] { train::train_classifier(bad); }), "unknown dataset \"mnist\""));
}

TEST_CASE("train_classifier --nesterov reaches SGD: another step than plain momentum, refused without momentum") {
  TempDir dir;
  for (int k = 1; k <= 5; ++k) write_cifar10(dir.file(fmt::format("data_batch_{}.bin", k)), 4, uint64_t(k));
  write_cifar10(dir.file("test_batch.bin"), 4, 9);
  train::ClassifierConfig plain{.model = "vgg11", .data_dir = dir.path, .epochs = 2, .batch_size = 10, .lr = 0.05,
                                .schedule = "constant", .workers = 0, .seed = 4};
  train::ClassifierConfig nesterov = plain;
  nesterov.nesterov = true;
  const auto a = train::train_classifier(plain), b = train::train_classifier(nesterov);
  REQUIRE(a.size() == 2);
  CHECK(a[1].train_loss != b[1].train_loss);  // from the first step on: g + momentum * b, not b
  nesterov.momentum = 0;
  CHECK(contains(error_of([&] { train::train_classifier(nesterov); }), "nesterov momentum requires a momentum"));
}

TEST_CASE("train_classifier --resume continues bit for bit: 2 epochs straight equal 1 epoch and a resume") {
  TempDir dir;
  for (int k = 1; k <= 5; ++k) write_cifar10(dir.file(fmt::format("data_batch_{}.bin", k)), 8, uint64_t(k));
  write_cifar10(dir.file("test_batch.bin"), 8, 9);
  // O0, and O2: loss scaling, and float32 masters apart from the half model.
  for (amp::OptLevel level : {amp::OptLevel::O0, amp::OptLevel::O2}) {
    const std::string level_name = amp::opt_level_name(level);
    CAPTURE(level_name);
    const train::ClassifierConfig straight{.model = "vgg11", .data_dir = dir.path, .epochs = 2, .batch_size = 8,
                                           .lr = 0.05, .opt_level = level, .workers = 2, .seed = 5,
                                           .train_checkpoint = dir.file("straight.safetensors")};
    const std::string after_first = dir.file("after_epoch_1.safetensors");
    const auto all = train::train_classifier(straight, [&](const train::EpochStats& s) {
      if (s.epoch == 0)
        std::filesystem::copy_file(straight.train_checkpoint, after_first, std::filesystem::copy_options::overwrite_existing);
    });
    REQUIRE(all.size() == 2);
    train::ClassifierConfig resumed = straight;
    resumed.resume = after_first;
    resumed.train_checkpoint = dir.file("resumed.safetensors");
    const auto rest = train::train_classifier(resumed);
    REQUIRE(rest.size() == 1);
    CHECK(rest[0].epoch == 1);
    CHECK(rest[0].train_loss == all[1].train_loss);
    CHECK(rest[0].test_loss == all[1].test_loss);
    const nn::TrainingCheckpoint want = nn::load_training_checkpoint(straight.train_checkpoint),
                                 got = nn::load_training_checkpoint(resumed.train_checkpoint);
    CHECK(got.epoch == want.epoch);
    CHECK(got.step == want.step);
    check_same_tensors(got, want);
  }
  // A run of other settings, and a checkpoint with nothing left to train, are refused, naming the file.
  train::ClassifierConfig other{.model = "vgg11", .data_dir = dir.path, .epochs = 3, .batch_size = 8, .lr = 0.05,
                                .opt_level = amp::OptLevel::O2, .workers = 2, .seed = 5,
                                .resume = dir.file("after_epoch_1.safetensors")};
  CHECK(contains(error_of([&] { train::train_classifier(other); }),
                 "after_epoch_1.safetensors: the checkpoint's run had epochs 2, this one has 3"));
  other.epochs = 2;
  other.resume = dir.file("straight.safetensors");
  CHECK(contains(error_of([&] { train::train_classifier(other); }), "the checkpoint already holds all 2 epochs"));
  // The optimizer's and schedule's settings too: a resumed run with another lr or weight decay would not train as
  // the uninterrupted run.
  other.resume = dir.file("after_epoch_1.safetensors");
  other.lr = 0.5;
  CHECK(contains(error_of([&] { train::train_classifier(other); }),
                 "the checkpoint's run had lr 0.05, this one has 0.5"));
  other.lr = 0.05;
  other.weight_decay = 0.1;
  CHECK(contains(error_of([&] { train::train_classifier(other); }),
                 "the checkpoint's run had weight_decay 0.0005, this one has 0.1"));
  // A checkpoint written before those settings were recorded resumes, taking this run's as the same.
  nn::TrainingCheckpoint older = nn::load_training_checkpoint(dir.file("after_epoch_1.safetensors"));
  for (const char* key :
       {"lr", "momentum", "weight_decay", "nesterov", "pct_start", "div_factor", "half", "world_size"})
    older.metadata.erase(key);
  nn::save_training_checkpoint(dir.file("older.safetensors"), older);
  train::ClassifierConfig from_older = other;
  from_older.weight_decay = 5e-4;
  from_older.resume = dir.file("older.safetensors");
  CHECK(train::train_classifier(from_older).size() == 1);
}

TEST_CASE("train_classifier --cuda-graph equals the eager run: schedule, loss scaling, a last smaller batch") {
  SKIP_WITHOUT_GPU();
  TempDir dir;
  // 50 training images in batches of 8: six replayed steps an epoch and a last batch of 2 run eagerly.
  for (int k = 1; k <= 5; ++k) write_cifar10(dir.file(fmt::format("data_batch_{}.bin", k)), 10, uint64_t(k));
  write_cifar10(dir.file("test_batch.bin"), 16, 9);
  // cuDNN's first-ranked engines rather than each run's timed fastest, so that the runs differ only by the order of
  // the sums inside kernels; and a small peak lr: at 0.05 a ResNet-18 on batches of 8 amplified those differences to
  // 8% in the training loss by the second epoch and to a test loss of 14 against 2e-7 (BatchNorm's running
  // statistics after a dozen steps), between two runs of the same kind.
  const bool benchmark = conv_benchmark();
  set_conv_benchmark(false);
  for (amp::OptLevel level : {amp::OptLevel::O0, amp::OptLevel::O1}) {
    const std::string level_name = amp::opt_level_name(level);
    CAPTURE(level_name);
    train::ClassifierConfig eager{.model = "resnet18", .data_dir = dir.path, .epochs = 2, .batch_size = 8,
                                  .lr = 0.01, .schedule = "onecycle", .opt_level = level, .device = Device::cuda(),
                                  .channels_last = true, .workers = 2, .seed = 5};
    train::ClassifierConfig graph = eager;
    graph.cuda_graph = true;
    const auto want = train::train_classifier(eager), again = train::train_classifier(eager),
               got = train::train_classifier(graph);
    REQUIRE(got.size() == 2);
    for (size_t e = 0; e < 2; ++e) {
      CAPTURE(e);
      // The replays differ from the eager run by no more than four times what two eager runs differ by, or 2%
      // (1e-3 near zero) where those happen to agree: a replay that skipped the update, the schedule or a loss
      // scale decision would move the losses by far more.
      auto close = [](double got_loss, double want_loss, double again_loss) {
        return std::abs(got_loss - want_loss) <=
               std::max({2e-2 * std::abs(want_loss), 1e-3, 4 * std::abs(again_loss - want_loss)});
      };
      CAPTURE(again[e].train_loss);
      CAPTURE(again[e].test_loss);
      CHECK_MESSAGE(close(got[e].train_loss, want[e].train_loss, again[e].train_loss),
                    "train loss " << got[e].train_loss << " replayed, " << want[e].train_loss << " eager");
      CHECK_MESSAGE(close(got[e].test_loss, want[e].test_loss, again[e].test_loss),
                    "test loss " << got[e].test_loss << " replayed, " << want[e].test_loss << " eager");
      // Close losses can still move an image across the decision boundary (on the H200 the replay counted 47 of the
      // 50 right where both eager runs counted 48): two images at most.
      CHECK(std::abs(got[e].train_accuracy - want[e].train_accuracy) <=
            std::abs(again[e].train_accuracy - want[e].train_accuracy) + 2.0 / 50 + 1e-12);
      CHECK(got[e].skipped_steps == want[e].skipped_steps);
    }
  }
  set_conv_benchmark(benchmark);
  train::ClassifierConfig cpu{.model = "vgg11", .data_dir = dir.path, .cuda_graph = true};
  CHECK(contains(error_of([&] { train::train_classifier(cpu); }), "--cuda-graph needs a CUDA device"));
}

TEST_CASE("train_classifier stopped within an epoch writes where it stopped, and a resume goes on as if uninterrupted") {
  TempDir dir;
  for (int k = 1; k <= 5; ++k) write_cifar10(dir.file(fmt::format("data_batch_{}.bin", k)), 8, uint64_t(k));
  write_cifar10(dir.file("test_batch.bin"), 8, 9);
  const train::ClassifierConfig straight{.model = "vgg11", .data_dir = dir.path, .epochs = 2, .batch_size = 8,
                                         .lr = 0.05, .opt_level = amp::OptLevel::O1, .workers = 2, .seed = 5,
                                         .train_checkpoint = dir.file("straight.safetensors")};
  const auto all = train::train_classifier(straight);
  // A stop asked for during batch 3 of epoch 2 (what Ctrl-C does): that step finishes, then the checkpoint.
  train::ClassifierConfig stopped = straight;
  stopped.train_checkpoint = dir.file("stopped.safetensors");
  stopped.log_interval = 1;
  const auto before = train::train_classifier(stopped, {}, [](const train::ClassifierProgress& p) {
    if (p.epoch == 1 && p.batch == 3) train::request_stop();
  });
  CHECK(train::stop_requested());
  train::clear_stop();
  REQUIRE(before.size() == 1);  // epoch 2 did not finish
  const nn::TrainingCheckpoint at_stop = nn::load_training_checkpoint(stopped.train_checkpoint);
  CHECK(at_stop.epoch == 1);
  CHECK(at_stop.step == 5 + 3);
  CHECK(at_stop.metadata.at("batch") == "3");
  train::ClassifierConfig resumed = straight;
  resumed.resume = stopped.train_checkpoint;
  resumed.train_checkpoint = dir.file("resumed.safetensors");
  const auto rest = train::train_classifier(resumed);
  REQUIRE(rest.size() == 1);
  CHECK(rest[0].train_loss == all[1].train_loss);  // the whole epoch's, the batches before the stop included
  CHECK(rest[0].train_accuracy == all[1].train_accuracy);
  CHECK(rest[0].test_loss == all[1].test_loss);
  check_same_tensors(nn::load_training_checkpoint(resumed.train_checkpoint), nn::load_training_checkpoint(straight.train_checkpoint));

  nn::TrainingCheckpoint bad = at_stop;  // a position that is not a count is an error naming the file
  bad.metadata["batch"] = "three";
  nn::save_training_checkpoint(dir.file("bad.safetensors"), bad);
  train::ClassifierConfig broken = straight;
  broken.resume = dir.file("bad.safetensors");
  broken.train_checkpoint = "";
  CHECK(contains(error_of([&] { train::train_classifier(broken); }),
                 "bad.safetensors: the checkpoint's batch is \"three\", not a count"));
  bad = at_stop;  // a count of correct answers that is not an integer would make a wrong accuracy
  for (auto& [name, t] : bad.extra)
    if (name == "epoch.correct") t = scalar_tensor(1.5);
  nn::save_training_checkpoint(dir.file("bad.safetensors"), bad);
  CHECK(contains(error_of([&] { train::train_classifier(broken); }),
                 "bad.safetensors: the checkpoint's epoch.correct is float32[] cpu, where the run keeps int64 []"));
  // A stop during an epoch's last batch, here a smaller one (40 images in batches of 16): resumed as any other.
  train::ClassifierConfig sixteen = straight;
  sixteen.batch_size = 16;
  sixteen.train_checkpoint = dir.file("sixteen.safetensors");
  const auto sixteen_all = train::train_classifier(sixteen);
  train::ClassifierConfig last = sixteen;
  last.train_checkpoint = dir.file("last_batch.safetensors");
  last.log_interval = 1;
  train::train_classifier(last, {}, [](const train::ClassifierProgress& p) {
    if (p.epoch == 0 && p.batch == 3) train::request_stop();
  });
  train::clear_stop();
  CHECK(nn::load_training_checkpoint(last.train_checkpoint).metadata.at("seen") == "40");
  last.resume = last.train_checkpoint;
  last.train_checkpoint = "";
  last.log_interval = 0;
  const auto last_rest = train::train_classifier(last);
  REQUIRE(last_rest.size() == 2);
  CHECK(last_rest[0].train_loss == sixteen_all[0].train_loss);
  CHECK(last_rest[1].test_loss == sixteen_all[1].test_loss);
  // A position that is no place in this run's epochs: images, batch or step that do not agree, a batch past the end.
  for (const auto& [key, value] : std::vector<std::pair<std::string, std::string>>{
           {"seen", "0"}, {"seen", "100000"}, {"batch", "0"}, {"batch", "5"}, {"batch", "6"}}) {
    CAPTURE(key);
    CAPTURE(value);
    bad = at_stop;
    bad.metadata[key] = value;
    nn::save_training_checkpoint(dir.file("bad.safetensors"), bad);
    CHECK(contains(error_of([&] { train::train_classifier(broken); }),
                   "bad.safetensors: the checkpoint stopped at step 8, after batch "));
    CHECK(contains(error_of([&] { train::train_classifier(broken); }), "which is no place in this run: its epochs "
                   "have 5 batches of 8 images"));
  }
}

TEST_CASE("train_classifier reports progress every log_interval batches: loss, accuracy, rate, the time left") {
  TempDir dir;
  for (int k = 1; k <= 5; ++k) write_cifar10(dir.file(fmt::format("data_batch_{}.bin", k)), 4, uint64_t(k));
  write_cifar10(dir.file("test_batch.bin"), 4, 9);
  train::ClassifierConfig config{.model = "vgg11", .data_dir = dir.path, .epochs = 1, .batch_size = 3,
                                 .schedule = "constant", .workers = 0, .train_checkpoint = "", .log_interval = 2};
  std::vector<train::ClassifierProgress> seen;
  train::train_classifier(config, {}, [&](const train::ClassifierProgress& p) { seen.push_back(p); });
  // 20 images in batches of 3: 7 batches, progress after the 2nd, 4th and 6th.
  REQUIRE(seen.size() == 3);
  for (size_t k = 0; k < seen.size(); ++k) {
    CAPTURE(k);
    CHECK(seen[k].batch == int64_t(2 * (k + 1)));
    CHECK(seen[k].batches == 7);
    CHECK(seen[k].lr == doctest::Approx(config.lr));
    CHECK(std::isfinite(seen[k].loss));
    CHECK(seen[k].accuracy >= 0);
    CHECK(seen[k].accuracy <= 1);
    CHECK(seen[k].images_per_second > 0);
  }
  CHECK(seen[2].eta_seconds < seen[0].eta_seconds * 5);  // 1 batch left against 5
  // progress_seconds (a nanosecond: after every batch) adds reports within the intervals and changes none at their
  // ends: the same run's interval figures, bit for bit.
  config.progress_seconds = 1e-9;
  std::vector<train::ClassifierProgress> live;
  train::train_classifier(config, {}, [&](const train::ClassifierProgress& p) { live.push_back(p); });
  REQUIRE(live.size() == 7);
  size_t ends = 0;
  for (size_t k = 0; k < live.size(); ++k) {
    CAPTURE(k);
    CHECK(live[k].batch == int64_t(k + 1));
    CHECK(live[k].interval_end == (live[k].batch % 2 == 0));
    if (!live[k].interval_end) continue;
    CHECK(live[k].loss == seen[ends].loss);
    CHECK(live[k].accuracy == seen[ends].accuracy);
    ++ends;
  }
  CHECK(ends == seen.size());
}

TEST_CASE("train_classifier stops at the first test loss that is not finite, before its checkpoint is overwritten") {
  TempDir dir;
  for (int k = 1; k <= 5; ++k) write_cifar10(dir.file(fmt::format("data_batch_{}.bin", k)), 8, uint64_t(k));
  write_cifar10(dir.file("test_batch.bin"), 8, 9);
  const std::string checkpoint = dir.file("last.safetensors");
  { std::ofstream(checkpoint) << "an earlier run's checkpoint"; }
  // lr 1e30 on float16 weights (O3): the first update overflows them, as in train-lm's case below.
  const train::ClassifierConfig config{.model = "vgg11", .data_dir = dir.path, .epochs = 3, .batch_size = 8,
                                       .lr = 1e30, .opt_level = amp::OptLevel::O3, .workers = 0, .seed = 5,
                                       .train_checkpoint = checkpoint};
  std::vector<double> reported;
  const std::string error = error_of([&] {
    train::train_classifier(config, [&](const train::EpochStats& s) { reported.push_back(s.test_loss); });
  });
  CHECK(contains(error, "train-classifier: the test loss after epoch 1 is "));
  CHECK(contains(error,
                 "the model diverged (a lower --lr may help); stopped. This run wrote no training checkpoint to "));
  REQUIRE(reported.size() == 1);  // the diverged epoch is reported (a log's last line), and no more are trained
  CHECK(!std::isfinite(reported[0]));
  std::ifstream in(checkpoint);
  CHECK(std::string(std::istreambuf_iterator<char>(in), {}) == "an earlier run's checkpoint");
  // A sweep trains on: a precision that diverges is one of its results.
  const auto rows = train::sweep_classifier(
      train::ClassifierConfig{.model = "vgg11", .data_dir = dir.path, .epochs = 2, .lr = 1e30, .workers = 0,
                              .seed = 5}, {amp::OptLevel::O3}, {8});
  REQUIRE(rows.size() == 1);
  CHECK(!std::isfinite(rows[0].final_test_loss));
}

TEST_CASE("train_language_model stops at the first validation loss that is not finite, and says what was kept") {
  TempDir dir;
  write_splits(dir, " the cat sat on a mat \n", 40);
  // lr 1e30 (finite, so the option takes it) on float16 weights (O3): the first update overflows them to inf on any
  // CPU. (In float32 the weights only grew to ~1e29 on the GPU machine's AVX-512 host, and the losses stayed finite.)
  train::LanguageModelConfig config{.data_dir = dir.path, .embedding_size = 8, .hidden_size = 8, .num_layers = 1,
                                    .dropout = 0, .epochs = 5, .batch_size = 4, .eval_batch_size = 2, .bptt = 8,
                                    .lr = 1e30, .opt_level = amp::OptLevel::O3,
                                    .checkpoint = dir.file("lm.safetensors")};
  int64_t epochs_seen = 0;
  const std::string error =
      error_of([&] { train::train_language_model(config, [&](const train::LanguageModelEpochStats&) { ++epochs_seen; }); });
  CHECK(contains(error, "train-lm: the validation loss after epoch 1 is "));
  // "nan" whatever the NaN's sign bit (on the GPU machine's AVX-512 host this check failed before the message named
  // NaNs itself: fmt prints a NaN with its sign bit set as "-nan").
  CHECK((contains(error, " is nan: the model diverged") || contains(error, " is inf: the model diverged") ||
         contains(error, " is -inf: the model diverged")));
  CHECK(contains(error, "No epoch had a finite validation loss: nothing was saved."));
  CHECK(epochs_seen == 0);  // stopped there, not after four more epochs
  CHECK(!std::filesystem::exists(dir.file("lm.safetensors")));
}

TEST_CASE("train_language_model follows main.py: perplexity falls on a predictable text, the best model is tested") {
  TempDir dir;
  {
    // Sentences over a small vocabulary where each word mostly determines the next.
    std::string text;
    const char* words[] = {"the", "cat", "sat", "on", "a", "mat", "and", "then", "slept", "well"};
    for (int line = 0; line < 60; ++line) {
      text += " ";
      for (int w = 0; w < 10; ++w) text += std::string(words[(line + w) % 10]) + " ";
      text += "\n";
    }
    write_splits(dir, text);
  }
  CHECK(train::LanguageModelConfig{}.lr == 20);  // main.py's lr
  // At lr 20 a model this small learns chaotically: by seed, or by the rounding of another CPU's vector width (an
  // AVX-512 machine against this AVX2 one), the best validation loss after 4 epochs ranged over 0.41-1.48. At lr 5
  // it falls every epoch for every seed tried (LSTM and GRU, seeds 1-6: 0.39-0.45 after 4 epochs).
  train::LanguageModelConfig config{.data_dir = dir.path, .embedding_size = 16, .hidden_size = 16, .num_layers = 1,
                                    .dropout = 0, .epochs = 4, .batch_size = 4, .eval_batch_size = 2, .bptt = 8,
                                    .lr = 5, .checkpoint = dir.file("lm.safetensors")};
  std::vector<double> lrs;
  const auto result = train::train_language_model(config, [&](const train::LanguageModelEpochStats& s) { lrs.push_back(s.lr); });
  REQUIRE(result.epochs.size() == 4);
  CHECK(lrs.front() == 5);
  const auto& first = result.epochs.front();
  const auto& last = result.epochs.back();
  CHECK(first.train_loss > std::log(5.0));  // starts near log(11): ten words and <eos>
  CHECK(last.valid_loss < 0.5 * first.train_loss);
  CHECK(std::isfinite(result.test_loss));
  CHECK(result.test_loss <= last.valid_loss + 1e-9);  // the test split is the same text; the best model is used
  CHECK(last.tokens_per_second > 0);
  for (size_t e = 1; e < lrs.size(); ++e) CHECK((lrs[e] == lrs[e - 1] || lrs[e] == lrs[e - 1] / 4));
  CHECK(std::filesystem::is_regular_file(config.checkpoint));

  // O1 and O2: autocast or a half model, dynamic loss scaling, unscaled gradients clipped.
  for (amp::OptLevel level : {amp::OptLevel::O1, amp::OptLevel::O2}) {
    const std::string level_name = amp::opt_level_name(level);
    CAPTURE(level_name);
    config.opt_level = level;
    config.epochs = 2;
    config.checkpoint = "";
    const auto mixed = train::train_language_model(config);
    CHECK(mixed.epochs.back().valid_loss < 0.7 * mixed.epochs.front().train_loss);
    CHECK(mixed.epochs.back().loss_scale > 1);
  }
}

TEST_CASE("train_language_model --resume continues bit for bit: 4 epochs straight equal 2 epochs and a resume") {
  TempDir dir;
  {
    std::string text;
    const char* words[] = {"red", "green", "blue", "light", "dark", "sky", "sea", "grass", "fire", "night", "day"};
    for (int line = 0; line < 50; ++line) {
      for (int w = 0; w < 7; ++w) text += std::string(words[(line * 3 + w * w) % 11]) + " ";
      text += "\n";
    }
    write_splits(dir, text);
  }
  // Two layers with dropout between them (the random state), lr 20 (annealed when the validation loss does not
  // improve); O0, and O2: loss scaling, and float32 masters apart from the half model.
  for (amp::OptLevel level : {amp::OptLevel::O0, amp::OptLevel::O2}) {
    const std::string level_name = amp::opt_level_name(level);
    CAPTURE(level_name);
    const train::LanguageModelConfig straight{.data_dir = dir.path, .embedding_size = 12, .hidden_size = 12,
                                              .num_layers = 2, .dropout = 0.3, .epochs = 4, .batch_size = 4,
                                              .eval_batch_size = 2, .bptt = 6, .opt_level = level, .checkpoint = "",
                                              .train_checkpoint = dir.file("straight.safetensors")};
    const std::string after_two = dir.file("after_epoch_2.safetensors");
    const auto all = train::train_language_model(straight, [&](const train::LanguageModelEpochStats& s) {
      if (s.epoch == 1)
        std::filesystem::copy_file(straight.train_checkpoint, after_two,
                                   std::filesystem::copy_options::overwrite_existing);
    });
    REQUIRE(all.epochs.size() == 4);
    train::LanguageModelConfig resumed = straight;
    resumed.resume = after_two;
    resumed.train_checkpoint = dir.file("resumed.safetensors");
    const auto rest = train::train_language_model(resumed);
    REQUIRE(rest.epochs.size() == 2);
    for (size_t e = 0; e < 2; ++e) {
      CAPTURE(e);
      CHECK(rest.epochs[e].epoch == all.epochs[e + 2].epoch);
      CHECK(rest.epochs[e].lr == all.epochs[e + 2].lr);
      CHECK(rest.epochs[e].train_loss == all.epochs[e + 2].train_loss);
      CHECK(rest.epochs[e].valid_loss == all.epochs[e + 2].valid_loss);
    }
    CHECK(rest.test_loss == all.test_loss);  // the best model, wherever it was found
    const nn::TrainingCheckpoint want = nn::load_training_checkpoint(straight.train_checkpoint),
                                 got = nn::load_training_checkpoint(resumed.train_checkpoint);
    CHECK(got.metadata == want.metadata);
    check_same_tensors(got, want);
  }
  train::LanguageModelConfig other{.data_dir = dir.path, .embedding_size = 12, .hidden_size = 12, .num_layers = 2,
                                   .dropout = 0.3, .epochs = 4, .batch_size = 4, .eval_batch_size = 2, .bptt = 7,
                                   .opt_level = amp::OptLevel::O2, .checkpoint = "",
                                   .resume = dir.file("after_epoch_2.safetensors")};
  CHECK(contains(error_of([&] { train::train_language_model(other); }),
                 "after_epoch_2.safetensors: the checkpoint's run had bptt 6, this one has 7"));
  // A resumed run none of whose epochs beats the checkpoint's best validation loss still leaves that best model in
  // --save, here another file than the interrupted run's.
  nn::TrainingCheckpoint best_so_far = nn::load_training_checkpoint(dir.file("after_epoch_2.safetensors"));
  best_so_far.metadata["best_valid"] = "0";  // below every loss
  nn::save_training_checkpoint(dir.file("best_so_far.safetensors"), best_so_far);
  train::LanguageModelConfig saving = other;
  saving.bptt = 6;
  saving.resume = dir.file("best_so_far.safetensors");
  saving.checkpoint = dir.file("best.safetensors");
  train::train_language_model(saving);
  REQUIRE(std::filesystem::is_regular_file(saving.checkpoint));
  const models::LoadedLanguageModel saved = models::load_language_model(saving.checkpoint, Device::cpu());
  for (const auto& [name, t] : saved.model->state_dict()) {
    CAPTURE(name);
    const auto best = std::find_if(best_so_far.extra.begin(), best_so_far.extra.end(),
                                   [&](const auto& e) { return e.first == "best." + name; });
    REQUIRE(best != best_so_far.extra.end());
    CHECK(testing::values(t) == testing::values(best->second));
  }
}

TEST_CASE("train_language_model stopped within an epoch writes where it stopped, and a resume goes on as if uninterrupted") {
  TempDir dir;
  write_splits(dir, " one two three four five six seven eight \n", 30);
  // 270 tokens, batch 4: 67 rows, bptt 8: 9 windows an epoch. LSTM: h and c are carried across the stop.
  const train::LanguageModelConfig straight{.data_dir = dir.path, .embedding_size = 8, .hidden_size = 8,
                                            .num_layers = 2, .dropout = 0.3, .epochs = 3, .batch_size = 4,
                                            .eval_batch_size = 2, .bptt = 8, .opt_level = amp::OptLevel::O1,
                                            .checkpoint = "", .train_checkpoint = dir.file("straight.safetensors")};
  const auto all = train::train_language_model(straight);
  train::LanguageModelConfig stopped = straight;
  stopped.train_checkpoint = dir.file("stopped.safetensors");
  stopped.log_interval = 1;
  const auto before = train::train_language_model(stopped, {}, [](const train::LanguageModelProgress& p) {
    if (p.epoch == 1 && p.batch == 4) train::request_stop();
  });
  CHECK(train::stop_requested());
  train::clear_stop();
  REQUIRE(before.epochs.size() == 1);
  const nn::TrainingCheckpoint at_stop = nn::load_training_checkpoint(stopped.train_checkpoint);
  CHECK(at_stop.epoch == 1);
  CHECK(at_stop.metadata.at("batch") == "4");
  train::LanguageModelConfig resumed = straight;
  resumed.resume = stopped.train_checkpoint;
  resumed.train_checkpoint = dir.file("resumed.safetensors");
  const auto rest = train::train_language_model(resumed);
  REQUIRE(rest.epochs.size() == 2);
  for (size_t e = 0; e < 2; ++e) {
    CAPTURE(e);
    CHECK(rest.epochs[e].train_loss == all.epochs[e + 1].train_loss);
    CHECK(rest.epochs[e].valid_loss == all.epochs[e + 1].valid_loss);
  }
  CHECK(rest.test_loss == all.test_loss);
  check_same_tensors(nn::load_training_checkpoint(resumed.train_checkpoint),
                     nn::load_training_checkpoint(straight.train_checkpoint));
}

TEST_CASE("train_language_model refuses a checkpoint whose resume point, sums, state, best loss or lr do not fit") {
  TempDir dir;
  write_splits(dir, " one two three four five six seven eight \n", 30);
  // 270 tokens, batch 4, bptt 8: 9 windows an epoch; stopped after 4 of epoch 2's.
  train::LanguageModelConfig config{.data_dir = dir.path, .embedding_size = 8, .hidden_size = 8, .num_layers = 1,
                                    .dropout = 0, .epochs = 2, .batch_size = 4, .eval_batch_size = 2, .bptt = 8,
                                    .checkpoint = "", .train_checkpoint = dir.file("stopped.safetensors"),
                                    .log_interval = 1};
  train::train_language_model(config, {}, [](const train::LanguageModelProgress& p) {
    if (p.epoch == 1 && p.batch == 4) train::request_stop();
  });
  train::clear_stop();
  const nn::TrainingCheckpoint good = nn::load_training_checkpoint(config.train_checkpoint);
  config.log_interval = 0;
  config.train_checkpoint = "";
  config.resume = dir.file("bad.safetensors");
  auto resume_error = [&](const std::function<void(nn::TrainingCheckpoint&)>& spoil) {
    nn::TrainingCheckpoint bad = good;
    spoil(bad);
    nn::save_training_checkpoint(config.resume, bad);
    return error_of([&] { train::train_language_model(config); });
  };
  auto replace = [](NamedTensors& tensors, const std::string& name, const Tensor& value) {
    for (auto& [n, t] : tensors)
      if (n == name) t = value;
  };
  const std::string file = "train: --resume " + config.resume;
  CHECK(contains(resume_error([](auto& ck) { ck.metadata["batch"] = "99999999"; }),
                 file + ": the epoch has 9 windows of at most 32 tokens, asked to resume after 99999999 windows"));
  CHECK(contains(resume_error([](auto& ck) { ck.metadata["tokens"] = "99999999999"; }),
                 "asked to resume after 4 windows and 99999999999 tokens"));
  CHECK(contains(resume_error([&](auto& ck) { replace(ck.extra, "epoch.total", zeros({3})); }),
                 file + ": the checkpoint's epoch.total is float32[3] cpu, where the run keeps floating []"));
  CHECK(contains(resume_error([&](auto& ck) { replace(ck.extra, "epoch.total", scalar_tensor(5, {.dtype = kInt64})); }),
                 "the checkpoint's epoch.total is int64[] cpu"));
  CHECK(contains(resume_error([&](auto& ck) { replace(ck.extra, "state.h", zeros({2, 3, 8})); }),
                 "the checkpoint's state.h is float32[2, 3, 8] cpu, where the run keeps floating [1, 4, 8]"));
  CHECK(contains(resume_error([](auto& ck) { ck.metadata["best_valid"] = "nan"; }),
                 file + ": the checkpoint's best_valid is \"nan\", not a finite number or inf"));
  CHECK(contains(resume_error([](auto& ck) { ck.metadata["best_valid"] = "-inf"; }), "not a finite number or inf"));
  CHECK(contains(resume_error([&](auto& ck) {
                   replace(ck.optimizer, "param_groups.0.lr", scalar_tensor(std::nan(""), {.dtype = kFloat64}));
                 }),
                 "'param_groups.0.lr' is nan, not a finite number"));
}

TEST_CASE("train_language_model reports progress every log_interval batches, as main.py's --log-interval") {
  TempDir dir;
  write_splits(dir, " one two three four five six seven eight \n", 40);
  // 40 lines of 9 tokens (8 words and <eos>) = 360 tokens; batch 4: 90 rows; bptt 8: ceil(89 / 8) = 12 batches.
  train::LanguageModelConfig config{.data_dir = dir.path, .embedding_size = 8, .hidden_size = 8, .num_layers = 1,
                                    .dropout = 0, .epochs = 2, .batch_size = 4, .eval_batch_size = 2, .bptt = 8,
                                    .checkpoint = "", .log_interval = 5};
  std::vector<train::LanguageModelProgress> seen;
  const auto result = train::train_language_model(config, {}, [&](const train::LanguageModelProgress& p) {
    seen.push_back(p);
  });
  REQUIRE(seen.size() == 4);  // batches 5 and 10 of each epoch
  for (size_t k = 0; k < seen.size(); ++k) {
    CAPTURE(k);
    CHECK(seen[k].epoch == int64_t(k / 2));
    CHECK(seen[k].batch == int64_t(5 * (k % 2 + 1)));
    CHECK(seen[k].batches == 12);
    CHECK(seen[k].lr == 20);
    CHECK(std::isfinite(seen[k].loss));
    CHECK(seen[k].loss > 0);
    CHECK(seen[k].tokens_per_second > 0);
    CHECK(seen[k].eta_seconds >= 0);
  }
  CHECK(seen[1].eta_seconds < seen[0].eta_seconds * 2);  // 2 batches left against 7 (same rate, within noise)
  CHECK(result.epochs.size() == 2);
  const std::vector<train::LanguageModelProgress> intervals = seen;
  // --dry-run: one batch an epoch, so no interval of 5 completes.
  config.dry_run = true;
  seen.clear();
  const auto dry = train::train_language_model(config, {}, [&](const train::LanguageModelProgress& p) {
    seen.push_back(p);
  });
  CHECK(seen.empty());
  CHECK(dry.epochs.size() == 2);
  CHECK(dry.epochs[0].tokens_per_second * dry.epochs[0].seconds == doctest::Approx(4 * 8));  // one batch: 4 x 8
  config.dry_run = false;
  // progress_seconds: reports in between, once that long has passed (here a nanosecond: after every batch); they
  // leave the intervals' figures as they were, so main.py's lines stay main.py's.
  std::vector<train::LanguageModelProgress> live;
  config.progress_seconds = 1e-9;
  train::train_language_model(config, {}, [&](const train::LanguageModelProgress& p) { live.push_back(p); });
  REQUIRE(live.size() == 24);  // every batch of both epochs
  std::vector<train::LanguageModelProgress> interval_ends;
  for (size_t k = 0; k < live.size(); ++k) {
    CAPTURE(k);
    CHECK(live[k].batch == int64_t(k % 12 + 1));
    CHECK(live[k].interval_end == (live[k].batch % 5 == 0));
    CHECK(std::isfinite(live[k].loss));
    CHECK(live[k].ms_per_batch > 0);
    if (live[k].interval_end) interval_ends.push_back(live[k]);
  }
  REQUIRE(interval_ends.size() == intervals.size());
  for (size_t k = 0; k < intervals.size(); ++k) CHECK(interval_ends[k].loss == intervals[k].loss);  // bit for bit
  // Without log_interval: the time alone, the loss over the epoch so far.
  config.log_interval = 0;
  live.clear();
  train::train_language_model(config, {}, [&](const train::LanguageModelProgress& p) { live.push_back(p); });
  CHECK(live.size() == 24);
  for (const auto& p : live) CHECK(!p.interval_end);
  config.progress_seconds = -1;
  CHECK(contains(error_of([&] { train::train_language_model(config); }), "progress_seconds must be finite and >= 0"));
  config.progress_seconds = 0;
  config.log_interval = -1;
  CHECK(contains(error_of([&] { train::train_language_model(config); }), "log_interval must be >= 0"));
}

TEST_CASE("train_language_model runs on the shipped WikiText-2 with a GRU") {
  train::LanguageModelConfig config{.rnn = "gru", .data_dir = {}, .embedding_size = 16, .hidden_size = 16, .num_layers = 1,
                                    .dropout = 0, .epochs = 1, .batch_size = 4, .eval_batch_size = 4, .bptt = 16,
                                    .limit_tokens = 3000, .checkpoint = ""};
  const auto result = train::train_language_model(config);
  REQUIRE(result.epochs.size() == 1);
  // A uniform guess over 33,278 words costs log(33278) = 10.4 per token.
  CHECK(result.epochs[0].train_loss < 10.6);
  CHECK(result.epochs[0].valid_loss < 10.4);
  train::LanguageModelConfig bad{.rnn = "transformer", .data_dir = {}, .checkpoint = ""};
  CHECK(contains(error_of([&] { train::train_language_model(bad); }), "unknown recurrent layer \"transformer\""));
}

TEST_CASE("sweep_classifier runs every opt level and batch size and names them as the experiments' tables do") {
  TempDir dir;
  for (int k = 1; k <= 5; ++k) write_cifar10(dir.file(fmt::format("data_batch_{}.bin", k)), 8, uint64_t(k));
  write_cifar10(dir.file("test_batch.bin"), 8, 9);
  train::ClassifierConfig base{.model = "vgg11", .data_dir = dir.path, .epochs = 2, .workers = 0, .train_checkpoint = "",
                               .log_interval = 2};
  std::vector<std::string> seen, progress;
  const auto rows = train::sweep_classifier(
      base, {amp::OptLevel::O0, amp::OptLevel::O3}, {8, 20},
      [&](const train::SweepRow& r) {
        seen.push_back(fmt::format("{} {}", train::precision_name(r.opt_level), r.batch_size));
      },
      [&](const train::SweepRow& r, const train::ClassifierProgress& p) {
        progress.push_back(fmt::format("{} {}: {} {}/{}", train::precision_name(r.opt_level), r.batch_size, p.epoch,
                                       p.batch, p.batches));
      });
  CHECK(seen == std::vector<std::string>{"FP32 8", "FP32 20", "FP16 8", "FP16 20"});
  // Each run's progress every 2 batches, naming its row: 40 images are 5 batches of 8 or 2 of 20.
  CHECK(progress == std::vector<std::string>{"FP32 8: 0 2/5", "FP32 8: 0 4/5", "FP32 8: 1 2/5", "FP32 8: 1 4/5",
                                             "FP32 20: 0 2/2", "FP32 20: 1 2/2", "FP16 8: 0 2/5", "FP16 8: 0 4/5",
                                             "FP16 8: 1 2/5", "FP16 8: 1 4/5", "FP16 20: 0 2/2", "FP16 20: 1 2/2"});
  REQUIRE(rows.size() == 4);
  for (const auto& r : rows) {
    CHECK_FALSE(r.out_of_memory);
    CHECK(r.seconds_per_epoch > 0);
    CHECK(r.images_per_second > 0);
    CHECK(r.final_test_accuracy >= 0);
    CHECK(r.final_test_accuracy <= 1);
  }
  CHECK(std::string(train::precision_name(amp::OptLevel::O1)) == "AMP");
  CHECK(std::string(train::precision_name(amp::OptLevel::O2)) == "O2");
  CHECK(contains(error_of([&] { train::sweep_classifier(base, {}, {8}); }), "at least one opt level"));
}

TEST_CASE("evaluate_classifier and evaluate_language_model: the loops' evaluation as functions of their own") {
  TempDir dir;
  write_cifar10(dir.file("test_batch.bin"), 12, 3);
  manual_seed(2);
  auto model = models::image_classifier("vgg11", 10);
  optim::SGD sgd(model->parameters(), {.lr = 0.1});
  amp::Amp amp = amp::initialize(*model, sgd, amp::OptLevel::O0);
  data::ImageLoader test(data::load_cifar10(dir.path, data::Split::Test), data::ImageTransform::cifar_eval(),
                         {.batch_size = 5});
  const train::Evaluation e = train::evaluate_classifier(*model, test, amp, Device::cpu());
  CHECK(e.count == 12);
  CHECK_FALSE(model->is_training());
  CHECK(e.accuracy >= 0.0);
  CHECK(e.accuracy <= 1.0);
  CHECK(e.loss > 0.0);

  // A language model on one batchified split: main.py's evaluate(), the mean over all rows but the last.
  models::LanguageModel lm(20, {.embedding_size = 4, .hidden_size = 4, .num_layers = 1, .dropout = 0.0});
  optim::SGD lm_sgd(lm.parameters(), {.lr = 1});
  amp::Amp lm_amp = amp::initialize(lm, lm_sgd, amp::OptLevel::O0);
  const Tensor source = randint(0, 20, {9, 2});
  const double loss = train::evaluate_language_model(lm, source, 3, lm_amp);
  // The same sum by hand: windows of rows 0-2, 3-5, 6-7 (predicting rows 1-8), the state carried.
  double sum = 0;
  Tensor h, c;
  {
    NoGradGuard no_grad;
    for (int64_t i = 0; i < 8; i += 3) {
      const data::TextBatch b = data::bptt_batch(source, i, 3);
      auto f = lm.features(b.input, h, c);
      h = f.h;
      c = f.c;
      sum += lm.loss(f.features, b.target).item<double>() * double(b.input.size(0));
    }
  }
  CHECK(loss == doctest::Approx(sum / 8));
  CHECK(contains(error_of([&] { train::evaluate_language_model(lm, randint(0, 20, {1, 2}), 3, lm_amp); }),
                 "evaluate_language_model: expected a batchified split [rows >= 2, batch]"));
}

// The loops' inner parts as functions of their own: a loop written with train_classifier_epoch and
// train_language_model_epoch (and the steps they take) trains exactly what train_classifier and
// train_language_model train, epoch after epoch.
TEST_CASE("train_classifier_epoch and train_language_model_epoch: a loop of one's own trains what the loops train") {
  TempDir dir;
  for (int k = 1; k <= 5; ++k) write_cifar10(dir.file(fmt::format("data_batch_{}.bin", k)), 7, uint64_t(k));
  write_cifar10(dir.file("test_batch.bin"), 8, 9);
  const train::ClassifierConfig c{.model = "vgg11", .data_dir = dir.path, .epochs = 2, .batch_size = 8, .lr = 0.05,
                                  .workers = 2, .seed = 5};
  const std::vector<train::EpochStats> want = train::train_classifier(c);
  REQUIRE(want.size() == 2);
  {
    data::ImageLoader loader(data::load_cifar10(dir.path, data::Split::Train), data::ImageTransform::cifar_train(),
                             {.batch_size = c.batch_size, .shuffle = true, .workers = c.workers, .seed = c.seed});
    manual_seed(c.seed);
    std::shared_ptr<nn::Module> model = models::image_classifier(c.model, 10);
    optim::SGD sgd(model->parameters(), {.lr = c.lr, .momentum = c.momentum, .weight_decay = c.weight_decay});
    amp::Amp amp = amp::initialize(*model, sgd, c.opt_level);
    optim::OneCycleLR schedule(sgd, {.max_lr = {c.lr}, .epochs = c.epochs, .steps_per_epoch = loader.batches_per_epoch(),
                                     .pct_start = c.pct_start, .div_factor = c.div_factor});
    int64_t reports = 0;
    for (int64_t epoch = 0; epoch < c.epochs; ++epoch) {
      CAPTURE(epoch);
      const train::ClassifierEpochSums sums = train::train_classifier_epoch(
          *model, loader, train::classifier_step(*model, amp), sgd,
          {.epoch = epoch, .schedule = &schedule, .log_interval = 2},
          [&](const train::ClassifierProgress& p) { reports += p.epoch == epoch && p.batch % 2 == 0 ? 1 : 100; });
      CHECK(sums.seen == 35);  // 5 files of 7 images, batches of 8: the last one of 3
      CHECK(sums.batches == 5);
      CHECK_FALSE(sums.interrupted);
      CHECK(sums.loss_sum.item<double>() / double(sums.seen) == want[size_t(epoch)].train_loss);
      CHECK(sums.correct.item<double>() / double(sums.seen) == want[size_t(epoch)].train_accuracy);
    }
    CHECK(reports == 4);  // batches 2 and 4 of each epoch
    CHECK(schedule.last_step() == 10);
  }

  write_splits(dir, " the cat sat on a mat and the dog sat on a log \n", 40);
  const train::LanguageModelConfig lm_config{.data_dir = dir.path, .embedding_size = 8, .hidden_size = 8,
                                             .num_layers = 2, .dropout = 0.3, .epochs = 2, .batch_size = 4,
                                             .eval_batch_size = 2, .bptt = 6, .lr = 5, .checkpoint = ""};
  const train::LanguageModelResult lm_want = train::train_language_model(lm_config);
  REQUIRE(lm_want.epochs.size() == 2);
  const data::Corpus corpus = data::load_corpus(dir.path);
  const Tensor train_data = data::batchify(corpus.train, lm_config.batch_size);
  manual_seed(lm_config.seed);
  models::LanguageModel lm(corpus.vocab.size(), {.embedding_size = 8, .hidden_size = 8, .num_layers = 2, .dropout = 0.3});
  optim::SGD sgd(lm.parameters(), {.lr = lm_config.lr});
  amp::Amp amp = amp::initialize(lm, sgd, amp::OptLevel::O0);
  const train::LanguageModelStep step = train::language_model_step(lm, amp, lm_config.clip);
  double best = std::numeric_limits<double>::infinity();
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    CAPTURE(epoch);
    const train::LanguageModelEpochSums sums =
        train::train_language_model_epoch(lm, train_data, step, sgd, {.epoch = epoch, .bptt = lm_config.bptt});
    CHECK(sums.batches == (train_data.size(0) - 2) / lm_config.bptt + 1);
    CHECK(sums.tokens == (train_data.size(0) - 1) * lm_config.batch_size);
    CHECK(sums.state.h.shape() == Shape{2, 4, 8});
    CHECK(sums.state.c.shape() == Shape{2, 4, 8});  // an LSTM's cells
    CHECK(sums.total.item<double>() / double(sums.tokens) == lm_want.epochs[size_t(epoch)].train_loss);
    const double valid = train::evaluate_language_model(lm, data::batchify(corpus.valid, 2), lm_config.bptt, amp);
    CHECK(valid == lm_want.epochs[size_t(epoch)].valid_loss);
    if (valid < best) {
      best = valid;
    } else {
      for (optim::ParamGroupRef g : sgd.param_groups()) g.lr /= 4;  // main.py's annealing, as the loop does
    }
  }
  CHECK(contains(error_of([&] { train::train_language_model_epoch(lm, randint(0, 5, {1, 4}), step, sgd); }),
                 "train_language_model_epoch: expected a batchified split [rows >= 2, batch]"));
}

TEST_CASE("a checkpoint path that cannot be written is an error before the first epoch, naming the option") {
  TempDir dir;
  train::LanguageModelConfig lm{.epochs = 1, .limit_tokens = 2000};
  lm.checkpoint = dir.file("no_such_folder/model.safetensors");
  int epochs_run = 0;
  const std::string error = error_of([&] { train::train_language_model(lm, [&](const auto&) { ++epochs_run; }); });
  CHECK(contains(error, "train-lm: --save: cannot write"));
  CHECK(contains(error, "does not exist"));
  CHECK(epochs_run == 0);
  lm.checkpoint = dir.path;  // a folder, not a file
  CHECK(contains(error_of([&] { train::train_language_model(lm); }), "is a folder, not a file"));
  train::ClassifierConfig c{.data_dir = dir.path};
  c.train_checkpoint = dir.file("missing/run.safetensors");
  CHECK(contains(error_of([&] { train::train_classifier(c); }), "train-classifier: --train-checkpoint: cannot write"));
  CHECK(std::distance(std::filesystem::directory_iterator(dir.path), std::filesystem::directory_iterator()) == 0);
}

TEST_CASE("train_language_model names a split too short for its batch columns (an empty valid.txt)") {
  TempDir dir;
  {
    std::ofstream train(dir.file("train.txt"));
    for (int i = 0; i < 50; ++i) train << "the cat sat on the mat\n";
  }
  std::ofstream(dir.file("valid.txt")).close();
  std::ofstream(dir.file("test.txt")) << "the cat\n";
  train::LanguageModelConfig lm{.data_dir = dir.path, .epochs = 1};
  lm.checkpoint = "";
  CHECK(contains(error_of([&] { train::train_language_model(lm); }),
                 "train-lm: the validation split has 0 tokens, too few for 10 columns (at least 20)"));
}

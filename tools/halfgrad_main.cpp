// The halfgrad command-line program: `info` tells what this build is; `train-classifier` trains ResNet/VGG on
// CIFAR-10/100 and `train-lm` an RNN/GRU/LSTM language model on WikiText-2, each with a chosen mixed-precision
// level, printing one line of figures per epoch; `sweep-classifier` runs the FP32 / AMP / O2 / FP16 comparison;
// `generate` samples text from a language model that `train-lm --save` wrote.
#include <CLI/CLI.hpp>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <exception>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/cuda.h"
#include "core/cuda_allocator.h"
#include "core/error.h"
#include "core/serialize.h"
#include "core/version.h"
#include "data/cifar.h"
#include "data/text.h"
#include "models/classifiers.h"
#include "tools/bench.h"
#include "tools/cli_checks.h"
#include "tools/launch.h"
#include "train/loops.h"

using namespace halfgrad;
using halfgrad::cli::file_name;
using halfgrad::cli::finite_at_least;
using halfgrad::cli::finite_in;
using halfgrad::cli::integer_in;

namespace {

// A choice checked when the command line is parsed, in any case, replaced by its canonical spelling; --help lists
// the choices.
CLI::IsMember one_of(std::vector<std::string> choices) { return CLI::IsMember(std::move(choices), CLI::ignore_case); }

// Whether progress lines go to a terminal (redrawn in place there) rather than a file or a pipe.
bool stdout_is_terminal() { return ::isatty(STDOUT_FILENO) != 0; }

// --progress-seconds: also a progress line within an interval once this long has passed since the last. Unless given:
// 1 s on a terminal (the line redrawn in place), 30 s elsewhere (a log file or CI gets a line now and then even when
// log-interval batches take minutes).
void add_progress_seconds(CLI::App* command, double& seconds) {
  seconds = stdout_is_terminal() ? 1 : 30;
  command->add_option("--progress-seconds", seconds, "also a progress line within an interval once this many seconds "
                      "have passed since the last (0: only every --log-interval batches; default 1 on a terminal, "
                      "30 otherwise)")->check(finite_at_least(0));
}

// --check-replicas (train-classifier, train-lm): under halfgrad launch, the ranks' weights compared every N steps.
void add_check_replicas(CLI::App* command, int64_t& every) {
  command->add_option("--check-replicas", every, "under halfgrad launch: every N steps the ranks compare their "
                      "weights and stop with an error naming any that differ (0: never)")
      ->check(integer_in<int64_t>(0))->capture_default_str();
}

DType parse_half(const std::string& half) {
  HG_CHECK(half == "float16" || half == "bfloat16", "--half must be float16 or bfloat16, got {}", half);
  return half == "float16" ? kFloat16 : kBFloat16;
}

Device parse_device(const std::string& device) {
  if (device == "cpu") return Device::cpu();
  if (device == "cuda") return Device::cuda(0);
  HG_CHECK(device.rfind("cuda:", 0) == 0 && device.size() > 5 && device.size() <= 9 &&
               device.find_first_not_of("0123456789", 5) == std::string::npos,
           "--device must be cpu, cuda or cuda:N (N a GPU ordinal, at most 4 digits), got {}", device);
  return Device::cuda(std::stoi(device.substr(5)));  // at most 9999: no overflow
}

// A log the command writes line by line: --csv (a header line, then a line an epoch or row) or --jsonl. Checked for
// writing when made, without changing what the file holds; opened at its first line, so a run that fails before
// it (a missing corpus, a refused checkpoint) leaves the file as it was, or none where there was none. A fresh run
// starts the file; a resumed one appends to it (the header only where the file is empty). Each line is flushed as
// written: a run stopped at any point leaves whole lines.
class LogFile {
 public:
  LogFile(std::string path, std::string option, const char* command, bool append, std::string header = "")
      : path_(std::move(path)), option_(std::move(option)), command_(command), append_(append),
        header_(std::move(header)) {
    if (path_.empty()) return;
    HG_CHECK(!std::filesystem::is_directory(path_), "{}: {} {} is a folder", command_, option_, path_);
    std::error_code ec;
    created_ = !std::filesystem::exists(path_, ec);  // through a link: a dangling one's target is created
    std::ofstream probe(path_, std::ios::app);  // creates a missing file, keeps an existing one whole
    HG_CHECK(probe.good(), "{}: cannot write {} {} (a missing folder, or no permission?)", command_, option_, path_);
  }
  // A file the probe created and no line reached (the run failed first) goes again: a failed run leaves no log. Where
  // the path is a link (the user's, which stays), the file is at its end.
  ~LogFile() {
    if (!created_ || out_.is_open()) return;
    std::error_code ec;
    std::filesystem::path file = path_;
    if (std::filesystem::is_symlink(file, ec)) {
      const std::filesystem::path target = std::filesystem::read_symlink(file, ec);
      file = target.is_absolute() ? target : file.parent_path() / target;
    }
    if (std::filesystem::is_regular_file(file, ec) && std::filesystem::file_size(file, ec) == 0 && !ec)
      std::filesystem::remove(file, ec);
  }
  LogFile(const LogFile&) = delete;
  LogFile& operator=(const LogFile&) = delete;
  const std::string& path() const { return path_; }
  void line(const std::string& text) {
    if (path_.empty()) return;
    if (!out_.is_open()) {
      // A resumed run's log already has its header where it is a file with lines; a stream (/dev/stdout, a pipe) gets
      // one each run.
      std::error_code ec;
      const bool has_lines = append_ && std::filesystem::is_regular_file(path_, ec) &&
                             std::filesystem::file_size(path_, ec) > 0 && !ec;
      out_.open(path_, append_ ? std::ios::app : std::ios::trunc);
      HG_CHECK(out_.good(), "{}: cannot write {} {}", command_, option_, path_);
      if (!has_lines && !header_.empty()) out_ << header_ << '\n';
    }
    out_ << text << '\n' << std::flush;
    HG_CHECK(out_.good(), "{}: writing {} {} failed", command_, option_, path_);
  }

 private:
  std::string path_, option_;
  const char* command_;
  bool append_;
  bool created_ = false;
  std::string header_;
  std::ofstream out_;
};

// --jsonl: the metrics as one JSON object a line ("event": "progress", "epoch", "row" or "test").
class JsonLines {
 public:
  JsonLines(const std::string& path, const char* command, bool append)
      : log_(path, "--jsonl", command, append), command_(command) {}
  const std::string& path() const { return log_.path(); }
  void write(const char* event, nlohmann::ordered_json fields) {
    if (log_.path().empty()) return;
    nlohmann::ordered_json line = {{"command", command_}, {"event", event}};
    line.update(fields);
    log_.line(line.dump());
  }

 private:
  LogFile log_;
  const char* command_;
};

using NamedFiles = std::vector<std::pair<std::string, std::string>>;  // option, path ("" where not given)

// Refuses a file the command writes (a log, a checkpoint, the model, the generated text) that names the same file as
// another it writes or one it reads (its data, --resume, generate's --checkpoint): the write would destroy it, or two
// logs would interleave. --train-checkpoint and --resume naming one file is the usual resume, and is allowed.
void check_files_apart(const char* command, const NamedFiles& written, const NamedFiles& read) {
  auto same = [](const std::string& a, const std::string& b) {
    std::error_code ec;
    // Two logs may share a stream (/dev/null, /dev/stdout): only a file would be overwritten or interleaved.
    for (const std::string& path : {a, b})
      if (std::filesystem::exists(path, ec) && !std::filesystem::is_regular_file(path, ec)) return false;
    if (std::filesystem::equivalent(a, b, ec)) return true;
    const auto canonical_a = std::filesystem::weakly_canonical(a, ec);
    return !ec && canonical_a == std::filesystem::weakly_canonical(b, ec) && !ec;
  };
  for (size_t i = 0; i < written.size(); ++i) {
    NamedFiles rest(written.begin() + ptrdiff_t(i) + 1, written.end());
    rest.insert(rest.end(), read.begin(), read.end());
    const auto& [option, path] = written[i];
    for (const auto& [other_option, other_path] : rest) {
      if (option == "--train-checkpoint" && other_option == "--resume") continue;
      HG_CHECK(path.empty() || other_path.empty() || !same(path, other_path),
               "{}: {} and {} name the same file, {}; give each its own", command, option, other_option, path);
    }
  }
}

// The files a run reads from its data folder, each named for errors as "--data-dir's <file>".
NamedFiles data_files(const std::filesystem::path& dir, const std::vector<std::string>& names) {
  NamedFiles files;
  for (const std::string& name : names) files.emplace_back(fmt::format("--data-dir's {}", name), (dir / name).string());
  return files;
}
NamedFiles cifar_files(const std::filesystem::path& dir, const std::string& dataset) {
  std::vector<std::string> names;
  for (data::Split split : {data::Split::Train, data::Split::Test}) {
    const std::vector<std::string> of_split =
        dataset == "cifar100" ? data::cifar100_file_names(split) : data::cifar10_file_names(split);
    names.insert(names.end(), of_split.begin(), of_split.end());
  }
  return data_files(dir, names);
}

// The progress lines within an epoch: on a terminal each redraws the last in place, and the line that follows (the
// epoch's figures) takes its place; elsewhere (a file, a pipe, CI) one line each, as main.py prints them.
class ProgressLine {
 public:
  ProgressLine() : tty_(stdout_is_terminal()) {}
  void show(const std::string& text) {
    if (tty_) {
      fmt::print("\r\033[K{}", text);
      shown_ = true;
    } else {
      fmt::print("{}\n", text);
    }
    std::fflush(stdout);
  }
  // Before any other output: clears a line drawn in place.
  void clear() {
    if (std::exchange(shown_, false)) fmt::print("\r\033[K");
  }

 private:
  bool tty_;
  bool shown_ = false;
};

// Ctrl-C (SIGINT) or SIGTERM during training: the first asks the loop to stop after the step under way (it writes its
// checkpoint there); the second ends the process at once, as the default handler does.
extern "C" void on_stop_signal(int signal) {
  static const char message[] = "\nhalfgrad: stopping after this step (again to quit at once)\n";
  halfgrad::train::request_stop();
  std::signal(signal, SIG_DFL);
  [[maybe_unused]] const ssize_t written = write(STDERR_FILENO, message, sizeof(message) - 1);
}

void stop_on_signals() {
  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGTERM, on_stop_signal);
}

// How errors name this process: "halfgrad", or "halfgrad (rank 1)" in a launched run.
std::string program_name() {
  const char* rank = std::getenv("RANK");
  return rank && *rank && std::getenv("WORLD_SIZE") ? fmt::format("halfgrad (rank {})", rank) : "halfgrad";
}

// After a stopped run: where it stopped and how to go on; the shell's exit status for SIGINT. epoch_ended: an epoch
// ended in this process's run (data parallel writes checkpoints at epochs' ends only); resume: the --resume it began
// from, if any.
int report_stop(const std::string& checkpoint, const char* option, bool data_parallel, bool epoch_ended,
                const std::string& resume) {
  if (checkpoint.empty()) {
    fmt::print("interrupted; nothing was saved (no {} given)\n", option);
  } else if (data_parallel && !epoch_ended && !resume.empty()) {
    fmt::print("interrupted before an epoch ended; {} still holds the run: the same command continues from it\n",
               resume);
  } else if (data_parallel && !epoch_ended) {
    fmt::print("interrupted in the first epoch; nothing was saved to {} yet\n", checkpoint);
  } else if (data_parallel) {  // every rank stopped after the same step; checkpoints are written at epochs' ends
    fmt::print("interrupted; {} holds the run as of its last finished epoch: the same command with --resume {} "
               "trains the interrupted epoch again\n", checkpoint, checkpoint);
  } else {
    fmt::print("interrupted; {} holds the run where it stopped: the same command with --resume {} continues it\n",
               checkpoint, checkpoint);
  }
  std::fflush(stdout);
  return 130;
}

// A stop asked for after the last epoch's training (during its evaluation, or the test) interrupts nothing: the run
// is complete, and says so, exiting 0 (a --resume of its checkpoint would have no epoch left).
void report_late_stop() {
  if (!train::stop_requested()) return;
  fmt::print("interrupted after the last epoch's training: the run is complete\n");
  std::fflush(stdout);
}

int run_train_classifier(train::ClassifierConfig config, const std::string& opt_level, const std::string& half,
                         const std::string& device, std::string csv_path, std::string jsonl_path) {
  config.opt_level = amp::parse_opt_level(opt_level);
  config.half_dtype = parse_half(half);
  config.device = parse_device(device);
  // Every rank, before they meet: all refuse alike, and before any opens a file.
  NamedFiles read = cifar_files(config.data_dir, config.dataset);
  read.emplace_back("--resume", config.resume);
  check_files_apart("train-classifier", {{"--csv", csv_path}, {"--jsonl", jsonl_path},
                                         {"--train-checkpoint", config.train_checkpoint}}, read);
  config.group = cli::join_launched_group(config.device, "train-classifier");
  if (config.group && config.group->rank() != 0) csv_path.clear(), jsonl_path.clear();  // rank 0 writes the files
  LogFile csv(csv_path, "--csv", "train-classifier", !config.resume.empty(),
              "epoch,train_loss,train_accuracy,test_loss,test_accuracy,seconds,images_per_second,peak_memory_bytes,"
              "skipped_steps,loss_scale");
  JsonLines jsonl(jsonl_path, "train-classifier", !config.resume.empty());
  fmt::print("train-classifier: {} on {} ({}), {} epochs, batch {}, lr {} ({}), opt level {}{}{}{}\n", config.model,
             config.dataset, config.device.str(), config.epochs, config.batch_size, config.lr, config.schedule, opt_level,
             config.channels_last ? ", channels_last" : "", config.cuda_graph ? ", CUDA graph" : "",
             config.group ? fmt::format(", data parallel over {} ranks ({}): batch {} a rank", config.group->size(),
                                        config.group->backend(), config.batch_size) : "");
  std::fflush(stdout);
  ProgressLine line;
  auto progress = [&](const train::ClassifierProgress& p) {
    const int64_t eta = int64_t(std::lround(p.eta_seconds));
    line.show(fmt::format("| epoch {:3d} | {:5d}/{:5d} batches | lr {:.4g} | loss {:6.4f} | acc {:6.4f} | {:.0f} "
                          "images/s | epoch ends in {}m{:02d}s", p.epoch + 1, p.batch, p.batches, p.lr, p.loss,
                          p.accuracy, p.images_per_second, eta / 60, eta % 60));
    jsonl.write("progress", {{"epoch", p.epoch + 1}, {"batch", p.batch}, {"batches", p.batches}, {"lr", p.lr},
                             {"loss", p.loss}, {"accuracy", p.accuracy}, {"images_per_second", p.images_per_second},
                             {"eta_seconds", p.eta_seconds}, {"interval_end", p.interval_end}});
  };
  bool header_printed = false;  // (a resumed run starts past epoch 1)
  int64_t last_epoch = -1;     // the last epoch finished
  train::train_classifier(config, [&](const train::EpochStats& s) {
    last_epoch = s.epoch;
    line.clear();
    if (!std::exchange(header_printed, true)) {
      fmt::print("{:>5} {:>10} {:>9} {:>10} {:>9} {:>8} {:>9} {:>10} {:>7} {:>10}\n", "epoch", "train loss",
                 "train acc", "test loss", "test acc", "seconds", "images/s", "peak MiB", "skipped", "loss scale");
    }
    fmt::print("{:>5} {:>10.4f} {:>9.4f} {:>10.4f} {:>9.4f} {:>8.2f} {:>9.0f} {:>10.1f} {:>7} {:>10.0f}\n", s.epoch + 1,
               s.train_loss, s.train_accuracy, s.test_loss, s.test_accuracy, s.seconds, s.images_per_second,
               double(s.peak_memory_bytes) / (1 << 20), s.skipped_steps, s.loss_scale);
    std::fflush(stdout);
    jsonl.write("epoch", {{"epoch", s.epoch + 1}, {"train_loss", s.train_loss}, {"train_accuracy", s.train_accuracy},
                          {"test_loss", s.test_loss}, {"test_accuracy", s.test_accuracy}, {"seconds", s.seconds},
                          {"images_per_second", s.images_per_second}, {"peak_memory_bytes", s.peak_memory_bytes},
                          {"skipped_steps", s.skipped_steps}, {"loss_scale", s.loss_scale}});
    csv.line(fmt::format("{},{},{},{},{},{},{},{},{},{}", s.epoch + 1, s.train_loss, s.train_accuracy, s.test_loss,
                         s.test_accuracy, s.seconds, s.images_per_second, s.peak_memory_bytes, s.skipped_steps,
                         s.loss_scale));
  }, progress);
  line.clear();
  if (train::stop_requested() && last_epoch + 1 < config.epochs)
    return report_stop(config.train_checkpoint, "--train-checkpoint", config.group != nullptr, header_printed,
                       config.resume);
  report_late_stop();
  return 0;
}

int run_sweep_classifier(train::ClassifierConfig config, const std::vector<std::string>& levels,
                         const std::vector<int64_t>& batch_sizes, const std::string& half, const std::string& device,
                         const std::string& csv_path, const std::string& jsonl_path) {
  std::vector<amp::OptLevel> parsed;
  for (const std::string& l : levels) parsed.push_back(amp::parse_opt_level(l));
  config.half_dtype = parse_half(half);
  config.device = parse_device(device);
  check_files_apart("sweep-classifier", {{"--csv", csv_path}, {"--jsonl", jsonl_path}},
                    cifar_files(config.data_dir, config.dataset));
  LogFile csv(csv_path, "--csv", "sweep-classifier", false,
              "precision,opt_level,batch_size,out_of_memory,seconds_per_epoch,images_per_second,peak_memory_bytes,"
              "final_train_accuracy,final_test_accuracy,final_test_loss,skipped_steps");
  JsonLines jsonl(jsonl_path, "sweep-classifier", false);
  fmt::print("sweep-classifier: {} on {} ({}), {} epochs per run, lr {} ({}){}{}\n", config.model, config.dataset,
             config.device.str(), config.epochs, config.lr, config.schedule,
             config.channels_last ? ", channels_last" : "", config.cuda_graph ? ", CUDA graph" : "");
  fmt::print("{:<9} {:>6} {:>11} {:>9} {:>10} {:>10} {:>9} {:>9}\n", "precision", "batch", "s / epoch", "images/s",
             "peak MiB", "train acc", "test acc", "skipped");
  std::fflush(stdout);
  ProgressLine line;
  auto progress = [&](const train::SweepRow& r, const train::ClassifierProgress& p) {
    const int64_t eta = int64_t(std::lround(p.eta_seconds));
    line.show(fmt::format("| {} batch {} | epoch {:3d} | {:5d}/{:5d} batches | loss {:6.4f} | {:.0f} images/s | "
                          "epoch ends in {}m{:02d}s", train::precision_name(r.opt_level), r.batch_size, p.epoch + 1,
                          p.batch, p.batches, p.loss, p.images_per_second, eta / 60, eta % 60));
    jsonl.write("progress", {{"precision", train::precision_name(r.opt_level)}, {"batch_size", r.batch_size},
                             {"epoch", p.epoch + 1}, {"batch", p.batch}, {"batches", p.batches}, {"loss", p.loss},
                             {"images_per_second", p.images_per_second}, {"eta_seconds", p.eta_seconds},
                             {"interval_end", p.interval_end}});
  };
  train::sweep_classifier(config, parsed, batch_sizes, [&](const train::SweepRow& r) {
    line.clear();
    const char* name = train::precision_name(r.opt_level);
    if (r.out_of_memory) {
      fmt::print("{:<9} {:>6} {:>11}\n", name, r.batch_size, "out of memory");
    } else {
      fmt::print("{:<9} {:>6} {:>11.2f} {:>9.0f} {:>10.1f} {:>10.4f} {:>9.4f} {:>9}\n", name, r.batch_size,
                 r.seconds_per_epoch, r.images_per_second, double(r.peak_memory_bytes) / (1 << 20),
                 r.final_train_accuracy, r.final_test_accuracy, r.skipped_steps);
    }
    std::fflush(stdout);
    jsonl.write("row", {{"precision", name}, {"opt_level", amp::opt_level_name(r.opt_level)},
                        {"batch_size", r.batch_size}, {"out_of_memory", r.out_of_memory},
                        {"seconds_per_epoch", r.seconds_per_epoch}, {"images_per_second", r.images_per_second},
                        {"peak_memory_bytes", r.peak_memory_bytes}, {"final_train_accuracy", r.final_train_accuracy},
                        {"final_test_accuracy", r.final_test_accuracy}, {"final_test_loss", r.final_test_loss},
                        {"skipped_steps", r.skipped_steps}});
    csv.line(fmt::format("{},{},{},{},{},{},{},{},{},{},{}", name, amp::opt_level_name(r.opt_level), r.batch_size,
                         r.out_of_memory ? 1 : 0, r.seconds_per_epoch, r.images_per_second, r.peak_memory_bytes,
                         r.final_train_accuracy, r.final_test_accuracy, r.final_test_loss, r.skipped_steps));
  }, progress);
  return 0;
}

int run_train_lm(train::LanguageModelConfig config, const std::string& opt_level, const std::string& half,
                 const std::string& device, std::string csv_path, std::string jsonl_path) {
  config.opt_level = amp::parse_opt_level(opt_level);
  config.half_dtype = parse_half(half);
  config.device = parse_device(device);
  NamedFiles read = data_files(data::corpus_directory(config.data_dir), data::kCorpusFiles);
  read.emplace_back("--resume", config.resume);
  check_files_apart("train-lm", {{"--csv", csv_path}, {"--jsonl", jsonl_path}, {"--save", config.checkpoint},
                                 {"--train-checkpoint", config.train_checkpoint}},
                    read);  // every rank, before they meet (as train-classifier)
  config.group = cli::join_launched_group(config.device, "train-lm");
  if (config.group && config.group->rank() != 0) csv_path.clear(), jsonl_path.clear();  // rank 0 writes the files
  LogFile csv(csv_path, "--csv", "train-lm", !config.resume.empty(),
              "epoch,lr,train_loss,train_ppl,valid_loss,valid_ppl,seconds,tokens_per_second,peak_memory_bytes,"
              "skipped_steps,loss_scale");
  JsonLines jsonl(jsonl_path, "train-lm", !config.resume.empty());
  fmt::print("train-lm: {} {}x{} ({} layers, dropout {}{}) on {} ({}), {} epochs, batch {}, bptt {}, lr {}, clip {}, "
             "opt level {}{}\n", config.rnn, config.embedding_size, config.hidden_size, config.num_layers, config.dropout,
             config.tie_weights ? ", tied" : "",
             config.data_dir.empty() ? "the shipped WikiText-2" : config.data_dir.string(), config.device.str(),
             config.epochs, config.batch_size, config.bptt, config.lr, config.clip, opt_level,
             config.group ? fmt::format(", data parallel over {} ranks ({}): batch {} a rank", config.group->size(),
                                        config.group->backend(), config.batch_size) : "");
  std::fflush(stdout);
  // main.py's progress line, with the rate and the epoch's remaining time.
  ProgressLine line;
  auto progress = [&](const train::LanguageModelProgress& p) {
    const int64_t eta = int64_t(std::lround(p.eta_seconds));
    line.show(fmt::format("| epoch {:3d} | {:5d}/{:5d} batches | lr {:05.2f} | ms/batch {:5.2f} | loss {:5.2f} | ppl "
                          "{:8.2f} | {:.0f} tokens/s | epoch ends in {}m{:02d}s", p.epoch + 1, p.batch, p.batches, p.lr,
                          p.ms_per_batch, p.loss, std::exp(p.loss), p.tokens_per_second, eta / 60, eta % 60));
    jsonl.write("progress", {{"epoch", p.epoch + 1}, {"batch", p.batch}, {"batches", p.batches}, {"lr", p.lr},
                             {"ms_per_batch", p.ms_per_batch}, {"loss", p.loss}, {"ppl", std::exp(p.loss)},
                             {"tokens_per_second", p.tokens_per_second}, {"eta_seconds", p.eta_seconds},
                             {"interval_end", p.interval_end}});
  };
  bool header_printed = false;  // (a resumed run starts past epoch 1)
  int64_t last_epoch = -1;     // the last epoch finished
  const auto result = train::train_language_model(config, [&](const train::LanguageModelEpochStats& s) {
    last_epoch = s.epoch;
    line.clear();
    if (!std::exchange(header_printed, true)) {
      fmt::print("{:>5} {:>8} {:>10} {:>9} {:>10} {:>9} {:>8} {:>9} {:>10} {:>7} {:>10}\n", "epoch", "lr",
                 "train loss", "train ppl", "valid loss", "valid ppl", "seconds", "tokens/s", "peak MiB", "skipped",
                 "loss scale");
    }
    fmt::print("{:>5} {:>8.4g} {:>10.4f} {:>9.2f} {:>10.4f} {:>9.2f} {:>8.2f} {:>9.0f} {:>10.1f} {:>7} {:>10.0f}\n",
               s.epoch + 1, s.lr, s.train_loss, std::exp(s.train_loss), s.valid_loss, std::exp(s.valid_loss), s.seconds,
               s.tokens_per_second, double(s.peak_memory_bytes) / (1 << 20), s.skipped_steps, s.loss_scale);
    std::fflush(stdout);
    jsonl.write("epoch", {{"epoch", s.epoch + 1}, {"lr", s.lr}, {"train_loss", s.train_loss},
                          {"train_ppl", std::exp(s.train_loss)}, {"valid_loss", s.valid_loss},
                          {"valid_ppl", std::exp(s.valid_loss)}, {"seconds", s.seconds},
                          {"tokens_per_second", s.tokens_per_second}, {"peak_memory_bytes", s.peak_memory_bytes},
                          {"skipped_steps", s.skipped_steps}, {"loss_scale", s.loss_scale}});
    csv.line(fmt::format("{},{},{},{},{},{},{},{},{},{},{}", s.epoch + 1, s.lr, s.train_loss, std::exp(s.train_loss),
                         s.valid_loss, std::exp(s.valid_loss), s.seconds, s.tokens_per_second, s.peak_memory_bytes,
                         s.skipped_steps, s.loss_scale));
  }, progress);
  line.clear();
  if (train::stop_requested() && last_epoch + 1 < config.epochs)
    return report_stop(config.train_checkpoint, "--train-checkpoint", config.group != nullptr, header_printed,
                       config.resume);
  fmt::print("test loss {:.4f}, test perplexity {:.2f} (the model with the best validation loss)\n", result.test_loss,
             std::exp(result.test_loss));
  jsonl.write("test", {{"test_loss", result.test_loss}, {"test_ppl", std::exp(result.test_loss)}});
  report_late_stop();
  return 0;
}

// What `make run` shows: the apex --fp16 word language model experiment in small. The language model of
// pytorch/examples on the shipped WikiText-2, trained the same way (seed, data, schedule) at O0 and at O1, then the
// two side by side. On a GPU main.py's default model (LSTM 200x2); on the CPU a 32x32 LSTM on the first 150,000
// tokens of each split, about a minute for both opt levels on 2 cores.
int run_demo(const std::string& device_name, int64_t epochs, int64_t limit_tokens) {
  const Device device = device_name == "auto" ? (cuda::is_available() ? Device::cuda(0) : Device::cpu())
                                              : parse_device(device_name);
  train::LanguageModelConfig config;
  config.device = device;
  config.epochs = epochs;
  config.checkpoint = "";
  config.log_interval = device.is_cuda() ? 1000 : 200;
  if (device.is_cpu()) {
    config.embedding_size = config.hidden_size = 32;
    config.limit_tokens = 150000;
  }
  if (limit_tokens >= 0) config.limit_tokens = limit_tokens;
  fmt::print("halfgrad demo: pytorch/examples' word language model ({} {}x{}, {} layers) on WikiText-2{}, {} "
             "epoch{} on {}, in float32 (O0) and then in mixed precision (O1: float16 autocast, dynamic loss "
             "scaling), as apex's --fp16 experiment\n",
             config.rnn, config.embedding_size, config.hidden_size, config.num_layers,
             config.limit_tokens > 0 ? fmt::format(" (the first {} tokens of each split)", config.limit_tokens) : "",
             epochs, epochs == 1 ? "" : "s", device.str());
  struct Run {
    const char* level;
    train::LanguageModelResult result;
  };
  std::vector<Run> runs;
  for (const char* level : {"O0", "O1"}) {
    config.opt_level = amp::parse_opt_level(level);
    fmt::print("\n== {} ==\n", level);
    std::fflush(stdout);
    auto result = train::train_language_model(config, [&](const train::LanguageModelEpochStats& s) {
      fmt::print("epoch {}: train ppl {:.2f}, valid ppl {:.2f}, {:.1f} s, {:.0f} tokens/s\n", s.epoch + 1,
                 std::exp(s.train_loss), std::exp(s.valid_loss), s.seconds, s.tokens_per_second);
      std::fflush(stdout);
    }, [](const train::LanguageModelProgress& p) {
      fmt::print("  {:5d}/{:5d} batches, loss {:.2f}, {:.0f} tokens/s\n", p.batch, p.batches, p.loss,
                 p.tokens_per_second);
      std::fflush(stdout);
    });
    runs.push_back({level, std::move(result)});
  }
  auto mean = [](const train::LanguageModelResult& r, auto field) {
    double total = 0;
    for (const auto& e : r.epochs) total += field(e);
    return total / double(r.epochs.size());
  };
  fmt::print("\n{:<28} {:>14} {:>14}\n", "", "O0 (float32)", "O1 (mixed)");
  auto row = [&](const char* name, auto value, const char* format) {
    fmt::print("{:<28} {:>14} {:>14}\n", name, fmt::format(fmt::runtime(format), value(runs[0].result)),
               fmt::format(fmt::runtime(format), value(runs[1].result)));
  };
  row("seconds per epoch", [&](const auto& r) { return mean(r, [](const auto& e) { return e.seconds; }); }, "{:.1f}");
  row("tokens per second", [&](const auto& r) { return mean(r, [](const auto& e) { return e.tokens_per_second; }); },
      "{:.0f}");
  if (device.is_cuda()) {
    row("peak GPU memory (MiB)", [](const auto& r) {
      int64_t peak = 0;
      for (const auto& e : r.epochs) peak = std::max(peak, e.peak_memory_bytes);
      return double(peak) / (1 << 20);
    }, "{:.0f}");
  }
  row("last validation perplexity", [](const auto& r) { return std::exp(r.epochs.back().valid_loss); }, "{:.2f}");
  row("test perplexity", [](const auto& r) { return std::exp(r.test_loss); }, "{:.2f}");
  const double speed = mean(runs[1].result, [](const auto& e) { return e.tokens_per_second; }) /
                       mean(runs[0].result, [](const auto& e) { return e.tokens_per_second; });
  const double ppl_change = 100 * (std::exp(runs[1].result.test_loss) / std::exp(runs[0].result.test_loss) - 1);
  fmt::print("\nO1 runs at {:.2f}x the tokens per second of O0; its test perplexity is {:.1f}% {} O0's{}.\n", speed,
             std::abs(ppl_change), ppl_change < 0 ? "below" : "above",
             device.is_cpu() ? " (a CPU has no float16 arithmetic: its kernels widen to float32, so mixed precision pays on a "
                              "GPU's tensor cores)" : "");
  return 0;
}

// Words to --outf or, streamed, to stdout; progress every log_interval words to stdout as generate.py prints it, or
// to stderr when the words themselves go to stdout. --outf is replaced whole or not at all (write_file_atomic).
int run_generate(train::GenerateConfig config, const std::string& device, const std::string& outf,
                 int64_t log_interval) {
  HG_CHECK(log_interval >= 0, "generate: --log-interval must be >= 0 (0: no progress lines), got {}", log_interval);
  config.device = parse_device(device);
  check_files_apart("generate", {{"--outf", outf}}, {{"--checkpoint", config.checkpoint}});
  if (!outf.empty()) check_writable(outf, "generate: --outf");  // before the words, not after them
  std::FILE* progress = outf.empty() ? stderr : stdout;
  const std::vector<std::string> words = train::generate_words(config, [&](int64_t i, const std::string& word) {
    if (outf.empty()) {
      fmt::print("{}{}", word, train::separator_after_word(i));
      if (i + 1 == config.words && train::separator_after_word(i) != '\n') fmt::print("\n");  // end the last line
      std::fflush(stdout);
    }
    if (log_interval > 0 && i % log_interval == 0) {
      fmt::print(progress, "| Generated {}/{} words\n", i, config.words);
      std::fflush(progress);
    }
  });
  if (!outf.empty()) {
    const std::string text = train::generated_text(words);
    write_file_atomic(outf, [&](const WriteBytes& write) { write(text.data(), text.size()); });
  }
  return 0;
}

struct BenchArgs {
  std::string suite, device = "cuda", memory_budget, out;
  std::vector<std::string> models, precisions;
  std::vector<int64_t> batches;
  bench::Settings settings;
  bool nchw = false;
  bool with_pytorch = false, torch_compile = false;
};

// An argument for /bin/sh, quoted.
std::string shell_quoted(const std::string& s) {
  std::string out = "'";
  for (char ch : s) out += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return out + "'";
}

// tools/bench_torch.py with the same configurations, appending to the same file: every ratio from one run.
int run_bench_torch(const BenchArgs& a, bool compile) {
  const std::string script = std::string(HALFGRAD_TOOLS_DIR) + "/bench_torch.py";
  HG_CHECK(std::filesystem::exists(script), "bench --with-pytorch: {} not found (it comes with halfgrad's sources)",
           script);
  std::string command = "python3 " + shell_quoted(script) + " " + shell_quoted(a.suite);
  auto list = [&](const char* flag, const auto& values) {
    if (!values.empty()) command += fmt::format(" {} {}", flag, shell_quoted(fmt::format("{}", fmt::join(values, ","))));
  };
  list("--models", a.models);
  list("--precisions", a.precisions);
  list("--batch", a.batches);
  command += fmt::format(" --steps {} --warmup {} --vocab {} --bptt {} --max-batch {}", a.settings.steps,
                         a.settings.warmup, a.settings.vocab, a.settings.bptt, a.settings.max_batch);
  if (!a.memory_budget.empty()) command += " --memory-budget " + shell_quoted(a.memory_budget);
  if (a.nchw) command += " --nchw";
  if (compile) command += " --compile";
  if (a.settings.epochs > 0) {
    command += fmt::format(" --epochs {} --seed {}", a.settings.epochs, a.settings.seed);
    if (!a.settings.data_dir.empty()) command += " --data-dir " + shell_quoted(a.settings.data_dir);
  }
  if (!a.out.empty()) command += " --out " + shell_quoted(a.out);
  fmt::print(stderr, "bench: PyTorch's side: {}\n", command);
  std::fflush(stdout);
  std::fflush(stderr);
  const int status = std::system(command.c_str());
  HG_CHECK(status == 0, "bench --with-pytorch: `{}` failed (status {})", command, status);
  return 0;
}

// JSON lines to stdout (and appended to --out, a whole line at a time, flushed: an interrupted run leaves every line
// it finished), a progress line to stderr before each configuration (rewritten in place on a terminal).
int run_bench(BenchArgs a) {
  a.settings.device = parse_device(a.device);
  a.settings.channels_last = !a.nchw;
  if (!a.memory_budget.empty()) {
    HG_CHECK(a.suite == "max-batch" || a.suite == "all", "bench: --memory-budget is the max-batch suite's; the {} "
             "suite does not use it", a.suite);
    a.settings.memory_budget = bench::parse_bytes(a.memory_budget);
    if (a.settings.device.is_cuda()) {
      HG_CHECK(cuda::is_available(), "bench: {} asked for, but no CUDA GPU is visible", a.device);
      const size_t total = cuda::device_memory(a.settings.device.index);
      HG_CHECK(a.settings.memory_budget <= total, "bench: --memory-budget {} is more than {} has ({})",
               a.memory_budget, a.settings.device.str(), cuda::format_bytes(total));
    }
  }
  HG_CHECK(a.settings.device.is_cpu() || cuda::is_available(), "bench: {} asked for, but no CUDA GPU is visible",
           a.device);
  // Before halfgrad's side runs: timings beside PyTorch's must come from one device. Trained runs (--epochs) are
  // allowed anywhere: what they compare is accuracy; their throughput fields then come from two devices, which each
  // line's "device" says.
  HG_CHECK(!a.with_pytorch || a.settings.epochs > 0 || a.settings.device == Device::cuda(0), "bench --with-pytorch: "
           "tools/bench_torch.py times PyTorch on cuda:0 only, and --device is {}; run with --device cuda, or without "
           "--with-pytorch", a.device);
  const std::vector<bench::Case> cases = bench::suite_cases(a.suite, a.models, a.precisions, a.batches);
  a.settings.group = cli::join_launched_group(a.settings.device, "bench");
  const bool rank0 = !a.settings.group || a.settings.group->rank() == 0;
  if (a.settings.group) {
    HG_CHECK(!a.with_pytorch, "bench: --with-pytorch is not available under halfgrad launch (PyTorch's side runs one "
             "process); run it without launch");
    if (!rank0) a.out.clear();  // rank 0 writes the lines
  }
  NamedFiles read = cifar_files(a.settings.data_dir, "cifar10");  // --epochs' data: CIFAR-10 files or a corpus
  const NamedFiles corpus = data_files(data::corpus_directory(a.settings.data_dir), data::kCorpusFiles);
  read.insert(read.end(), corpus.begin(), corpus.end());
  check_files_apart("bench", {{"--out", a.out}}, read);
  LogFile out(a.out, "--out", "bench", /*append=*/true);
  const bool tty = ::isatty(STDERR_FILENO) != 0;
  bench::run_cases(
      cases, a.settings,
      [&](const nlohmann::ordered_json& line) {
        const std::string text = line.dump() + "\n";
        if (tty) fmt::print(stderr, "\r\033[K");
        fmt::print("{}", text);
        std::fflush(stdout);
        out.line(line.dump());
      },
      [&](size_t done, size_t total, const bench::Case& c) {
        if (!rank0) return;
        fmt::print(stderr, "{}bench {}: [{}/{}] {} {} batch {}{}", tty ? "\r\033[K" : "", c.suite, done + 1, total,
                   c.model, c.precision, c.batch, tty ? "" : "\n");
        std::fflush(stderr);
      });
  if (a.with_pytorch) {
    run_bench_torch(a, false);
    if (a.torch_compile) run_bench_torch(a, true);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"halfgrad: a C++ deep-learning framework with dynamic-graph autograd and mixed precision"};
  app.require_subcommand(1);
  app.set_version_flag("--version", halfgrad::version());

  CLI::App* info = app.add_subcommand("info", "Print the version, the backends compiled into this build and the "
                                              "visible GPUs");
  bool cast_table = false;
  info->add_flag("--cast-table", cast_table, "print autocast's categories of ops (core/autocast.h) as the Markdown "
                 "table docs/mixed_precision.md carries");
  info->callback([&] {
    if (cast_table) {
      std::cout << halfgrad::amp::cast_table_markdown();
      return;
    }
    std::cout << halfgrad::build_summary() << "\n";
    std::cout << fmt::format("data parallel: gloo (CPU tensors) {}, nccl (CUDA tensors) {}\n",
                             dist::backend_available("gloo") ? "built" : "not built",
                             dist::backend_available("nccl") ? "built" : "not built");
    if (const std::string launched = cli::launched_environment(); !launched.empty())
      std::cout << "this process: " << launched << "\n";
    for (const std::string& line : halfgrad::cuda::describe_devices()) std::cout << line << "\n";
  });

  int rc = 0;
  // What the classifier subcommands share; strings are parsed when the subcommand runs.
  struct ClassifierArgs {
    train::ClassifierConfig config;
    std::string opt_level = "O0", half = "float16", device = "cpu", csv_path, jsonl_path, data_dir;
  };
  auto add_classifier_options = [](CLI::App* sub, ClassifierArgs& a) {
    train::ClassifierConfig& c = a.config;
    sub->add_option("--model", c.model, "resnet18/34/50/101/152, vgg11/13/16/19")
        ->transform(one_of(models::image_classifier_names()))
        ->capture_default_str();
    sub->add_option("--dataset", c.dataset, "cifar10 or cifar100")->transform(one_of({"cifar10", "cifar100"}))
        ->capture_default_str();
    sub->add_option("--data-dir", a.data_dir, "folder with data_batch_1..5.bin (those there) and test_batch.bin "
                    "(CIFAR-10) or train.bin and test.bin (CIFAR-100)")->required()->check(file_name());
    sub->add_option("--epochs", c.epochs)->check(integer_in<int64_t>(1))->capture_default_str();
    sub->add_option("--lr", c.lr, "peak lr (onecycle) or starting lr")->check(finite_at_least(0, true))
        ->capture_default_str();
    sub->add_option("--momentum", c.momentum, "SGD momentum; with --schedule onecycle the momentum cycles 0.95 -> "
                    "0.85 -> 0.95 instead (PyTorch's OneCycleLR), and this value is not used")
        ->check(finite_at_least(0))->capture_default_str();
    sub->add_option("--weight-decay", c.weight_decay)->check(finite_at_least(0))->capture_default_str();
    sub->add_flag("--nesterov", c.nesterov, "Nesterov momentum (torch.optim.SGD's nesterov=True)");
    sub->add_option("--schedule", c.schedule, "onecycle (lr up over --pct-start of the steps from lr / --div-factor "
                    "to --lr, then down; momentum cycled), cosine or constant")
        ->transform(one_of({"onecycle", "cosine", "constant"}))
        ->capture_default_str();
    sub->add_option("--pct-start", c.pct_start, "onecycle: the share of the steps spent raising the lr")
        ->check(finite_in(0, 1))->capture_default_str();
    sub->add_option("--div-factor", c.div_factor, "onecycle: the first lr is --lr / this")
        ->check(finite_at_least(0, true))->capture_default_str();
    sub->add_option("--half", a.half, "float16 or bfloat16 (O1-O3)")->transform(one_of({"float16", "bfloat16"}))
        ->capture_default_str();
    sub->add_option("--device", a.device, "cpu, cuda or cuda:N")->capture_default_str();
    sub->add_flag("--channels-last", c.channels_last, "feed NHWC batches");
    sub->add_flag("--cuda-graph", c.cuda_graph, "CUDA: capture the training step once as a CUDA graph and replay it "
                  "(a last, smaller batch runs eagerly)");
    sub->add_option("--workers", c.workers, "data loading threads")->check(integer_in<int>(0, 256))->capture_default_str();
    sub->add_option("--seed", c.seed)->check(integer_in<uint64_t>(0))->capture_default_str();
    sub->add_option("--limit-train", c.limit_train, "use the first N training images (0: all)")
        ->check(integer_in<int64_t>(0));
    sub->add_option("--limit-test", c.limit_test, "use the first N test images (0: all)")
        ->check(integer_in<int64_t>(0));
    sub->add_option("--csv", a.csv_path, "also write the figures to this CSV file")->check(file_name());
    sub->add_option("--jsonl", a.jsonl_path, "also write the figures (and the progress lines) to this file, one JSON "
                    "object a line")->check(file_name());
  };

  ClassifierArgs train_args;
  CLI::App* tc = app.add_subcommand("train-classifier", "Train ResNet/VGG on CIFAR-10/100 (official binary files)");
  add_classifier_options(tc, train_args);
  tc->add_option("--batch-size", train_args.config.batch_size)->check(integer_in<int64_t>(1))->capture_default_str();
  tc->add_option("--opt-level", train_args.opt_level, "O0 (float32), O1 (autocast), O2 (half model, float32 "
                 "masters), O3 (half)")->transform(one_of({"O0", "O1", "O2", "O3"}))->capture_default_str();
  tc->add_option("--train-checkpoint", train_args.config.train_checkpoint, "write a training checkpoint "
                 "(safetensors) after every epoch, and at the step under way on Ctrl-C, for --resume (as train-lm's)")
      ->check(file_name());
  tc->add_option("--resume", train_args.config.resume, "continue the run that wrote this --train-checkpoint file after its "
                 "last epoch, as if uninterrupted (the same settings, --epochs included)")
      ->check(file_name())->check(CLI::ExistingFile);
  train_args.config.log_interval = 100;
  tc->add_option("--log-interval", train_args.config.log_interval, "a progress line every N training batches "
                 "(0: none)")->check(integer_in<int64_t>(0))->capture_default_str();
  add_progress_seconds(tc, train_args.config.progress_seconds);
  add_check_replicas(tc, train_args.config.check_replicas_every);
  tc->callback([&] {
    stop_on_signals();
    train_args.config.data_dir = train_args.data_dir;
    rc = run_train_classifier(train_args.config, train_args.opt_level, train_args.half, train_args.device,
                              train_args.csv_path, train_args.jsonl_path);
  });

  ClassifierArgs sweep_args;
  std::vector<std::string> levels = {"O0", "O1", "O2", "O3"};
  std::vector<int64_t> batch_sizes = {128};
  CLI::App* sc = app.add_subcommand("sweep-classifier", "The FP32 / AMP / O2 / FP16 comparison: train-classifier "
                                    "once per opt level and batch size, one row each");
  add_classifier_options(sc, sweep_args);
  sc->add_option("--opt-levels", levels, "opt levels to run")->delimiter(',')
      ->transform(one_of({"O0", "O1", "O2", "O3"}))->capture_default_str();
  sweep_args.config.log_interval = 100;
  sc->add_option("--log-interval", sweep_args.config.log_interval, "a progress line every N training batches of each "
                 "run (0: none)")->check(integer_in<int64_t>(0))->capture_default_str();
  add_progress_seconds(sc, sweep_args.config.progress_seconds);
  sc->add_option("--batch-sizes", batch_sizes, "batch sizes to run (a run that does not fit says so)")
      ->delimiter(',')->check(integer_in<int64_t>(1))->capture_default_str();
  sc->callback([&] {
    sweep_args.config.data_dir = sweep_args.data_dir;
    rc = run_sweep_classifier(sweep_args.config, levels, batch_sizes, sweep_args.half, sweep_args.device,
                              sweep_args.csv_path, sweep_args.jsonl_path);
  });

  train::LanguageModelConfig lm;
  std::string lm_data_dir, lm_csv, lm_jsonl, lm_opt_level = "O0", lm_half = "float16", lm_device = "cpu";
  CLI::App* tl = app.add_subcommand("train-lm", "Train an RNN/GRU/LSTM word language model (pytorch/examples' "
                                    "word_language_model) on WikiText-2");
  tl->add_option("--rnn,--model", lm.rnn, "lstm, gru, rnn_tanh or rnn_relu, in any case (--model LSTM: "
                 "pytorch/examples' spelling)")
      ->transform(one_of({"lstm", "gru", "rnn_tanh", "rnn_relu"}))
      ->capture_default_str();
  tl->add_option("--data-dir", lm_data_dir, "train.txt, valid.txt, test.txt (default: the WikiText-2 halfgrad ships)")
      ->check(file_name());
  tl->add_option("--emsize", lm.embedding_size)->check(integer_in<int64_t>(1))->capture_default_str();
  tl->add_option("--nhid", lm.hidden_size)->check(integer_in<int64_t>(1))->capture_default_str();
  tl->add_option("--nlayers", lm.num_layers)->check(integer_in<int64_t>(1))->capture_default_str();
  tl->add_option("--dropout", lm.dropout)->check(finite_in(0, 0.99))->capture_default_str();
  tl->add_flag("--tied", lm.tie_weights, "tie the encoder and decoder weights");
  tl->add_option("--epochs", lm.epochs)->check(integer_in<int64_t>(1))->capture_default_str();
  tl->add_option("--batch-size,--batch_size", lm.batch_size)->check(integer_in<int64_t>(1))->capture_default_str();
  tl->add_option("--eval-batch-size", lm.eval_batch_size)->check(integer_in<int64_t>(1))->capture_default_str();
  tl->add_option("--bptt", lm.bptt)->check(integer_in<int64_t>(1))->capture_default_str();
  tl->add_option("--lr", lm.lr)->check(finite_at_least(0, true))->capture_default_str();
  tl->add_option("--clip", lm.clip)->check(finite_at_least(0, true))->capture_default_str();
  tl->add_option("--opt-level", lm_opt_level, "O0, O1, O2 or O3")->transform(one_of({"O0", "O1", "O2", "O3"}))
      ->capture_default_str();
  tl->add_option("--half", lm_half, "float16 or bfloat16 (O1-O3)")->transform(one_of({"float16", "bfloat16"}))
      ->capture_default_str();
  CLI::Option* lm_device_option = tl->add_option("--device", lm_device, "cpu, cuda or cuda:N")->capture_default_str();
  bool lm_cuda = false;
  tl->add_flag("--cuda", lm_cuda, "the same as --device cuda (pytorch/examples' spelling)")->excludes(lm_device_option);
  tl->add_option("--seed", lm.seed)->check(integer_in<uint64_t>(0))->capture_default_str();
  tl->add_option("--limit-tokens", lm.limit_tokens, "use the first N tokens of each split (0: all)")
      ->check(integer_in<int64_t>(0));
  lm.checkpoint = "model.safetensors";  // main.py saves to model.pt unless told otherwise
  tl->add_option("--save,--checkpoint", lm.checkpoint, "save the model with the best validation loss, its "
                 "architecture and vocabulary here (safetensors; for generate; \"\": not saved)")->capture_default_str()
      ->check(file_name());
  tl->add_option("--train-checkpoint", lm.train_checkpoint, "write a training checkpoint (safetensors) after every "
                 "epoch, for --resume")->check(file_name());
  tl->add_option("--resume", lm.resume, "continue the run that wrote this --train-checkpoint file after its last "
                 "epoch, as if uninterrupted (the same settings, --epochs included)")
      ->check(file_name())->check(CLI::ExistingFile);
  tl->add_flag("--dry-run", lm.dry_run, "one training batch per epoch: check that the code and the model run "
               "(main.py's --dry-run)");
  add_check_replicas(tl, lm.check_replicas_every);
  tl->add_flag("--cuda-graph", lm.cuda_graph, "CUDA: capture the training step once as a CUDA graph and replay it "
               "(the last, shorter window of an epoch runs eagerly)");
  tl->add_option("--csv", lm_csv, "also write the per-epoch figures to this CSV file")->check(file_name());
  tl->add_option("--jsonl", lm_jsonl, "also write the figures, the progress lines and the test perplexity to this "
                 "file, one JSON object a line")->check(file_name());
  lm.log_interval = 200;  // main.py's default
  tl->add_option("--log-interval", lm.log_interval, "a progress line every N training batches, as main.py prints it "
                 "(0: none)")->check(integer_in<int64_t>(0))->capture_default_str();
  add_progress_seconds(tl, lm.progress_seconds);
  tl->callback([&] {
    stop_on_signals();
    lm.data_dir = lm_data_dir;
    if (lm_cuda) lm_device = "cuda";
    rc = run_train_lm(lm, lm_opt_level, lm_half, lm_device, lm_csv, lm_jsonl);
  });

  std::string demo_device = "auto";
  int64_t demo_epochs = 2;
  CLI::App* td = app.add_subcommand("demo", "What halfgrad is for, in a few minutes: the word language model on "
                                    "WikiText-2 in float32 and in mixed precision, side by side (make run)");
  td->add_option("--device", demo_device, "auto (a GPU when one is visible), cpu, cuda or cuda:N")
      ->capture_default_str();
  td->add_option("--epochs", demo_epochs, "epochs at each opt level")->check(integer_in<int64_t>(1))
      ->capture_default_str();
  int64_t demo_limit_tokens = -1;
  td->add_option("--limit-tokens", demo_limit_tokens, "use the first N tokens of each split (0: all; default: all on "
                 "a GPU, 150,000 on the CPU)")->check(integer_in<int64_t>(0));
  td->callback([&] { rc = run_demo(demo_device, demo_epochs, demo_limit_tokens); });

  train::GenerateConfig gen;
  std::string gen_device = "cpu", gen_outf;
  int64_t gen_log_interval = 100;
  CLI::App* tg = app.add_subcommand("generate", "Sample text from a language model saved by train-lm --save "
                                    "(pytorch/examples' generate.py)");
  tg->add_option("--checkpoint", gen.checkpoint, "the model (safetensors, from train-lm --save)")->required()
      ->check(file_name());
  tg->add_option("--words", gen.words, "number of words to generate")->check(integer_in<int64_t>(0))
      ->capture_default_str();
  tg->add_option("--temperature", gen.temperature, "higher: more diverse (>= 1e-3)")->check(finite_at_least(1e-3))
      ->capture_default_str();
  tg->add_option("--seed", gen.seed)->check(integer_in<uint64_t>(0))->capture_default_str();
  tg->add_option("--device", gen_device, "cpu, cuda or cuda:N")->capture_default_str();
  tg->add_option("--outf", gen_outf, "write the text to this file (default: stdout)")->check(file_name());
  tg->add_option("--log-interval", gen_log_interval, "a progress line every N words (0: none)")
      ->check(integer_in<int64_t>(0))->capture_default_str();
  tg->callback([&] { rc = run_generate(gen, gen_device, gen_outf, gen_log_interval); });

  BenchArgs bench_args;
  CLI::App* tb = app.add_subcommand("bench", "The experiments' measurements, one JSON line per configuration: step "
                                    "time, throughput, peak memory, the largest batch that fits (tools/bench.h)");
  tb->add_option("suite", bench_args.suite, "vgg, resnet, lm, max-batch or all")->required()
      ->transform(one_of(bench::suite_names()));
  tb->add_option("--models", bench_args.models, "instead of the suite's: image classifiers (resnet50, vgg16) or "
                 "language models (lstm-650x2)")->delimiter(',');
  tb->add_option("--precisions", bench_args.precisions, "instead of the suite's: fp32, amp, o2, fp16, bf16")
      ->delimiter(',')->transform(one_of(bench::precision_names()));
  tb->add_option("--batch", bench_args.batches, "instead of the suite's batch sizes (max-batch: where the search "
                 "starts)")->delimiter(',')->check(integer_in<int64_t>(1));
  tb->add_option("--device", bench_args.device, "cuda, cuda:N or cpu")->capture_default_str();
  tb->add_option("--steps", bench_args.settings.steps, "timed steps per configuration")->check(integer_in<int>(1))
      ->capture_default_str();
  tb->add_option("--warmup", bench_args.settings.warmup, "untimed steps before them")->check(integer_in<int>(0))
      ->capture_default_str();
  tb->add_flag("--cuda-graph", bench_args.settings.cuda_graph, "replay each step as a CUDA graph");
  tb->add_flag("--nchw", bench_args.nchw, "NCHW image batches (default on CUDA: channels_last)");
  tb->add_option("--memory-budget", bench_args.memory_budget, "max-batch: the memory the steps must fit in (8GiB, "
                 "512MiB; default: the device's)");
  tb->add_option("--max-batch", bench_args.settings.max_batch, "max-batch: the search's ceiling")
      ->check(integer_in<int64_t>(1))->capture_default_str();
  tb->add_option("--vocab", bench_args.settings.vocab, "language models: words in the vocabulary")
      ->check(integer_in<int64_t>(1))->capture_default_str();
  tb->add_option("--bptt", bench_args.settings.bptt, "language models: steps per window")->check(integer_in<int64_t>(1))
      ->capture_default_str();
  tb->add_option("--epochs", bench_args.settings.epochs, "train this many epochs on real data and report accuracy or "
                 "perplexity instead of step times (vgg, resnet, lm; tools/bench.h)")->check(integer_in<int64_t>(1));
  tb->add_option("--data-dir", bench_args.settings.data_dir, "with --epochs: the CIFAR-10 files' folder; for lm a "
                 "WikiText-2 folder (default: the shipped one)")->check(file_name());
  tb->add_option("--seed", bench_args.settings.seed, "with --epochs: the runs' seed")
      ->check(integer_in<uint64_t>(0))->capture_default_str();
  tb->add_option("--workers", bench_args.settings.workers, "with --epochs: image loading threads")
      ->check(integer_in<int>(0, 256))->capture_default_str();
  tb->add_option("--out", bench_args.out, "also append the lines to this file")->check(file_name());
  tb->add_flag("--with-pytorch", bench_args.with_pytorch, "then the same configurations in PyTorch "
               "(tools/bench_torch.py, eager channels_last; with --epochs trained the same way), their lines to the "
               "same output");
  tb->add_flag("--torch-compile", bench_args.torch_compile, "with --with-pytorch: PyTorch under "
               "torch.compile(mode=\"reduce-overhead\") too");
  tb->callback([&] {
    // An option this run would not use is refused, naming what it is for, rather than taken and ignored.
    for (const char* option : {"--seed", "--workers", "--data-dir"})
      HG_CHECK(tb->count(option) == 0 || bench_args.settings.epochs > 0, "bench: {} is for trained runs (--epochs N); "
               "this run times steps on synthetic data", option);
    HG_CHECK(!bench_args.torch_compile || bench_args.with_pytorch, "bench: --torch-compile is a setting of PyTorch's "
             "side: add --with-pytorch");
    HG_CHECK(tb->count("--max-batch") == 0 || bench_args.suite == "max-batch" || bench_args.suite == "all",
             "bench: --max-batch is the max-batch suite's; the {} suite does not use it", bench_args.suite);
    // Which suites read which options ("all" runs every suite, so it takes each of them).
    const std::string& suite = bench_args.suite;
    const bool trains = bench_args.settings.epochs > 0;
    for (const char* option : {"--vocab", "--bptt"})
      HG_CHECK(tb->count(option) == 0 || suite == "lm" || suite == "all", "bench: {} is the language models' (the lm "
               "suite); the {} suite does not use it", option, suite);
    for (const char* option : {"--nchw", "--workers"})
      HG_CHECK(tb->count(option) == 0 || suite != "lm", "bench: {} is for image batches; the lm suite has none",
               option);
    for (const char* option : {"--epochs", "--steps", "--warmup", "--cuda-graph"})
      HG_CHECK(tb->count(option) == 0 || suite != "max-batch", "bench: {} is not used by the max-batch suite, which "
               "runs two eager steps a batch size while it searches", option);
    for (const char* option : {"--steps", "--warmup", "--vocab"})
      HG_CHECK(tb->count(option) == 0 || !trains, "bench: {} is for timed steps on synthetic data; a trained run "
               "(--epochs N) goes through whole epochs of the real data", option);
    rc = run_bench(bench_args);
  });

  cli::LaunchOptions launch_options;
  std::vector<std::string> launched;
  CLI::App* tn = app.add_subcommand("launch", "Data parallel: start one process per GPU of this machine running a "
                                    "halfgrad command (train-classifier, train-lm) as the ranks of one run, as "
                                    "torchrun does: halfgrad launch --nproc-per-node 2 -- train-lm --device cuda");
  tn->add_option("--nproc-per-node", launch_options.nproc_per_node, "processes (ranks) on this machine: one per GPU")
      ->check(integer_in<int>(1, 1024))->capture_default_str();
  tn->add_option("--nnodes", launch_options.nnodes, "machines in the run")->check(integer_in<int>(1))
      ->capture_default_str();
  tn->add_option("--node-rank", launch_options.node_rank, "this machine's place among them (0..nnodes-1)")
      ->check(integer_in<int>(0))->capture_default_str();
  tn->add_option("--master-addr", launch_options.master_addr, "the address of node 0, where rank 0 serves the "
                 "rendezvous")->capture_default_str();
  tn->add_option("--master-port", launch_options.master_port, "its port")->check(integer_in<int>(1, 65535))
      ->capture_default_str();
  tn->add_option("--grace-seconds", launch_options.grace_seconds, "after a rank fails, how long the others have to "
                 "stop before they are killed (at most a day)")->check(finite_in(0, 86400))->capture_default_str();
  tn->add_option("command", launched, "after --: the halfgrad command each rank runs, with its options")->required();
  tn->callback([&] { rc = cli::launch(launch_options, launched); });

  try {
    CLI11_PARSE(app, argc, argv);
  } catch (const Error& e) {
    fmt::print(stderr, "{}: {}\n", program_name(), e.what());
    return 1;
  } catch (const std::bad_alloc&) {  // a size the machine cannot hold: say so, do not abort
    fmt::print(stderr, "{}: out of memory (std::bad_alloc): a size asked for is larger than this machine has\n",
               program_name());
    return 1;
  } catch (const std::exception& e) {  // std::system_error from thread creation, std::out_of_range, ...
    fmt::print(stderr, "{}: {}\n", program_name(), e.what());
    return 1;
  }
  // What went to standard output (generate's text, bench's table) must have reached it: a full disk is a failure,
  // not a success with the output lost. (A closed pipe ends the process with SIGPIPE first, as other tools.)
  std::cout.flush();
  const bool flushed = std::fflush(stdout) == 0;
  const int flush_error = errno;
  if (!flushed || std::ferror(stdout) || !std::cout) {
    fmt::print(stderr, "{}: writing to standard output failed: {}\n", program_name(),
               flushed ? "an earlier write failed" : std::strerror(flush_error));
    return 1;
  }
  return rc;
}

// The training loops (train/loops.h).
#include "train/loops.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <set>
#include <tuple>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/autograd.h"
#include "core/cuda.h"
#include "core/cuda_allocator.h"
#include "core/cuda_graph.h"
#include "core/error.h"
#include "core/log.h"
#include "core/random.h"
#include "data/cifar.h"
#include "data/loader.h"
#include "data/text.h"
#include "dist/data_parallel.h"
#include "models/classifiers.h"
#include "models/language_model.h"
#include "models/language_model_checkpoint.h"
#include "nn/checkpoint.h"
#include "ops/conv.h"
#include "ops/elementwise.h"
#include "ops/loss.h"
#include "ops/reduce.h"
#include "ops/softmax.h"
#include "optim/scheduler.h"
#include "optim/sgd.h"

namespace halfgrad::train {

namespace {

// The first n images of d (all when n is 0 or more than there are).
data::ImageDataset first(data::ImageDataset d, int64_t n) {
  if (n <= 0 || n >= d.size()) return d;
  d.images = d.images.narrow(0, 0, n).contiguous();
  d.labels = d.labels.narrow(0, 0, n).contiguous();
  return d;
}

// Rank `rank` of `size`'s slice of d for evaluation: consecutive images, slices differing by at most one image,
// none repeated (unlike a training shard, which pads to equal length).
data::ImageDataset slice_for_rank(data::ImageDataset d, int rank, int size) {
  if (size == 1) return d;
  const int64_t begin = d.size() * rank / size, end = d.size() * (rank + 1) / size;
  d.images = d.images.narrow(0, begin, end - begin).contiguous();
  d.labels = d.labels.narrow(0, begin, end - begin).contiguous();
  return d;
}

// What a data-parallel run needs of its group, checked before anything trains.
void check_group(const dist::ProcessGroup* group, Device device, bool cuda_graph, int64_t check_replicas_every,
                 const char* command) {
  HG_CHECK(check_replicas_every >= 0, "{}: check_replicas_every must be >= 0 (0: never), got {}", command,
           check_replicas_every);
  HG_CHECK(group || check_replicas_every == 0, "{}: --check-replicas compares the ranks of a data-parallel run; start "
           "this one with `halfgrad launch`, or leave the option out", command);
  if (!group) return;
  HG_CHECK(group->device() == device, "{}: the model is on {}, but the {} group's collectives take tensors on {} (a "
           "CUDA run of rank r uses cuda:LOCAL_RANK and the nccl backend; a CPU run the gloo backend)", command,
           device.str(), group->backend(), group->device().str());
  HG_CHECK(!cuda_graph, "{}: --cuda-graph is not available with data parallelism yet: the gradients' all-reduce is "
           "launched from the host during backward, which a replayed graph would skip", command);
}

// "rank 3", "ranks 0, 2", "ranks 0-31": an ascending list of ranks, runs shortened.
std::string rank_list(const std::vector<int>& ranks) {
  std::vector<std::string> parts;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    parts.push_back(j == i ? std::to_string(ranks[i]) : fmt::format("{}-{}", ranks[i], ranks[j]));
    i = j + 1;
  }
  return fmt::format("{} {}", ranks.size() == 1 ? "rank" : "ranks", fmt::join(parts, ", "));
}

// Data parallel: `prepare` (this rank's checks and loading, up to the run's first collective) on every rank, and the
// settings it returns compared across the ranks. Every rank gets the same outcome: it goes on where every rank prepared
// and all agree; else every rank stops with one error that names the rank that failed and why, or each setting that
// differs and each rank's value. Ranks with other data, batch or epochs would take different numbers of steps, and
// ranks with other models exchange tensors of other sizes: their collectives would no longer pair up (Gloo then
// aborts the process from its own thread, where no error can be caught); a rank that failed alone (a file missing on
// its node) would leave the others waiting out the group's timeout. Other settings (the lr, the seed that shuffles the
// shards) would train replicas that drift apart, or shards that overlap. Without a group: `prepare` alone.
void agree_across_ranks(dist::ProcessGroup* group, const char* command, const std::function<Metadata()>& prepare) {
  if (!group || group->size() == 1) {
    prepare();
    return;
  }
  nlohmann::json mine;
  try {
    mine["settings"] = prepare();
  } catch (const std::exception& e) {
    mine["error"] = e.what();
  }
  std::vector<nlohmann::json> ranks;
  for (const std::string& s :
       dist::all_gather_string(*group, mine.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)))
    ranks.push_back(nlohmann::json::parse(s));
  for (size_t r = 0; r < ranks.size(); ++r)
    HG_CHECK(!ranks[r].contains("error"), "{}: rank {} of this data-parallel run could not start: {}", command, r,
             ranks[r]["error"].get<std::string>());
  std::vector<Metadata> settings;
  std::set<std::string> keys;
  for (const nlohmann::json& r : ranks) {
    settings.push_back(r["settings"].get<Metadata>());
    for (const auto& entry : settings.back()) keys.insert(entry.first);
  }
  std::vector<std::string> differ;
  for (const std::string& key : keys) {
    std::vector<std::pair<std::string, std::vector<int>>> values;  // each value and its ranks, in order of first rank
    for (size_t r = 0; r < settings.size(); ++r) {
      const auto it = settings[r].find(key);
      const std::string value = it == settings[r].end() ? "(none)" : it->second;
      auto same = std::find_if(values.begin(), values.end(), [&](const auto& v) { return v.first == value; });
      if (same == values.end()) same = values.insert(values.end(), {value, {}});
      same->second.push_back(int(r));
    }
    if (values.size() == 1) continue;
    std::vector<std::string> each;
    for (const auto& [value, on] : values) each.push_back(fmt::format("{} on {}", value, rank_list(on)));
    differ.push_back(fmt::format("{} ({})", key, fmt::join(each, "; ")));
  }
  HG_CHECK(differ.empty(), "{}: the ranks of this data-parallel run differ in {}; every rank must train the same model "
           "on the same data with the same options", command, fmt::join(differ, ", "));
}

// The first few of `names`, for an error.
std::string some_of(const std::vector<std::string>& names) {
  const size_t shown = std::min<size_t>(names.size(), 5);
  return fmt::format("{}{}", fmt::join(names.begin(), names.begin() + std::ptrdiff_t(shown), ", "),
                     names.size() > shown ? ", ..." : "");
}

// Data parallel, after each rank resumed from its own --resume file (a node's copy of rank 0's): one model on every
// rank, or one error on every rank. Resuming loads after DistributedDataParallel's broadcast, so nothing else would
// make the replicas equal again.
void check_resumed_replicas(dist::ProcessGroup* group, const nn::Module& model, const char* command) {
  if (!group) return;
  const std::vector<std::string> differ = nn::replica_mismatches(*group, model, /*with_buffers=*/true);
  HG_CHECK(differ.empty(), "{}: the ranks resumed from different checkpoints (--resume): their models differ in {} of "
           "their tensors ({})", command, differ.size(), some_of(differ));
}

// `stop`, and every `every` steps (data parallel, every > 0) the ranks' models compared: an error naming the tensors
// that differ (every rank gets the same list, so every rank stops).
std::function<bool()> checking_replicas(std::function<bool()> stop, dist::ProcessGroup* group, const nn::Module& model,
                                        int64_t every, const char* command) {
  if (!group || every == 0) return stop;
  // The count is shared by the copies: each epoch's options take one, and the steps are the run's, not the epoch's
  // (a copy's own count restarted each epoch, so an epoch shorter than `every` never checked).
  auto steps = std::make_shared<int64_t>(0);
  return [stop = std::move(stop), group, &model, every, command, steps] {
    if (++*steps % every == 0) {
      const std::vector<std::string> differ = nn::replica_mismatches(*group, model);
      HG_CHECK(differ.empty(), "{}: after step {} of this run the ranks' models differ in {} of their tensors ({}); "
               "data-parallel replicas must stay equal (--check-replicas {})", command, *steps, differ.size(),
               some_of(differ), every);
    }
    return stop();
  };
}

// `values` summed over the group's ranks in one all-reduce (float64); themselves without a group.
std::vector<double> summed_over_ranks(dist::ProcessGroup* group, std::vector<double> values) {
  if (!group || group->size() == 1) return values;
  Tensor t = tensor(values).to(group->device());
  group->all_reduce(t)->wait();
  t = t.cpu();
  return std::vector<double>(t.data<double>(), t.data<double>() + t.numel());
}

// Rank 0's `value` on every rank: decisions that must not differ between ranks (the language model's annealing).
double rank0_value(dist::ProcessGroup* group, double value) {
  if (!group || group->size() == 1) return value;
  Tensor t = tensor(std::vector<double>{value}).to(group->device());
  group->broadcast(t, 0)->wait();
  return t.cpu().data<double>()[0];
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// When the loops report progress: at the end of every log_interval batches of the epoch (main.py's lines), and with
// progress_seconds > 0 also within an interval once that long has passed since the last report (a live status line
// for slow steps). Reading the interval's sums synchronises, so the clock, not every batch, decides.
class ProgressClock {
 public:
  ProgressClock(int64_t log_interval, double progress_seconds, std::chrono::steady_clock::time_point start)
      : log_interval_(log_interval), every_(progress_seconds), interval_start_(start), last_report_(start) {}
  bool active() const { return log_interval_ > 0 || every_ > 0; }

  struct Due {
    bool report, interval_end;
  };
  // After batch `batch` of the epoch (1-based).
  Due batch_done(int64_t batch) {
    ++interval_batches_;
    const bool end = log_interval_ > 0 && batch % log_interval_ == 0;
    return {end || (every_ > 0 && seconds_since(last_report_) >= every_), end};
  }
  double interval_seconds() const { return seconds_since(interval_start_); }
  int64_t interval_batches() const { return interval_batches_; }
  void reported(bool interval_end) {
    last_report_ = std::chrono::steady_clock::now();
    if (interval_end) {
      interval_start_ = last_report_;
      interval_batches_ = 0;
    }
  }

 private:
  int64_t log_interval_;
  double every_;
  std::chrono::steady_clock::time_point interval_start_, last_report_;
  int64_t interval_batches_ = 0;
};

// Both loops' progress options, checked before anything runs.
void check_progress_options(int64_t log_interval, double progress_seconds) {
  HG_CHECK(log_interval >= 0, "train: log_interval must be >= 0 (0: no progress), got {}", log_interval);
  HG_CHECK(std::isfinite(progress_seconds) && progress_seconds >= 0,
           "train: progress_seconds must be finite and >= 0 (0: none between intervals), got {}", progress_seconds);
}

// ---- interruption

std::atomic<bool> g_stop_requested{false};  // lock-free: request_stop() may run in a signal handler
static_assert(std::atomic<bool>::is_always_lock_free);

// ---- resuming from a training checkpoint (--train-checkpoint of train-classifier and train-lm)

// What a resumed classifier run must share with the run that wrote its checkpoint: the schedule spans every epoch's
// steps, and the data order and augmentation follow the seed.
Metadata classifier_run(const ClassifierConfig& c) {
  Metadata run{{"model", c.model},
          {"dataset", c.dataset},
          {"opt_level", amp::opt_level_name(c.opt_level)},
          {"epochs", std::to_string(c.epochs)},
          {"batch_size", std::to_string(c.batch_size)},
          {"schedule", c.schedule},
          {"seed", std::to_string(c.seed)},
          {"limit_train", std::to_string(c.limit_train)},
          {"lr", fmt::format("{}", c.lr)},
          {"weight_decay", fmt::format("{}", c.weight_decay)},
          {"nesterov", c.nesterov ? "true" : "false"},
          {"world_size", std::to_string(c.group ? c.group->size() : 1)}};
  // Those the run uses only: onecycle cycles the momentum itself, O0 has no half dtype.
  if (c.schedule == "onecycle") {
    run["pct_start"] = fmt::format("{}", c.pct_start);
    run["div_factor"] = fmt::format("{}", c.div_factor);
  } else {
    run["momentum"] = fmt::format("{}", c.momentum);
  }
  if (c.opt_level != amp::OptLevel::O0) run["half"] = dtype_name(c.half_dtype);
  return run;
}

// The settings a checkpoint has recorded since 2026-12-05: one written before, without them, is taken (with a
// warning that they cannot be compared), as it was then.
bool recorded_since_2026_12_05(const std::string& key) {
  for (const char* later : {"lr", "momentum", "weight_decay", "nesterov", "pct_start", "div_factor", "half",
                            "world_size", "eval_batch_size"})
    if (key == later) return true;
  return false;
}

// Refuses a checkpoint written by a run of other settings, or with no epoch left to train.
void check_same_run(const nn::TrainingCheckpoint& ck, const Metadata& run, const std::string& path, int64_t epochs,
                    const char* writer) {
  std::vector<std::string> unrecorded;
  for (const auto& [key, value] : run) {
    const auto found = ck.metadata.find(key);
    if (found == ck.metadata.end() && recorded_since_2026_12_05(key)) {
      unrecorded.push_back(key);
      continue;
    }
    HG_CHECK(found != ck.metadata.end(), "train: --resume {}: the checkpoint does not say its {} (was it written by {}?)",
             path, key, writer);
    HG_CHECK(found->second == value, "train: --resume {}: the checkpoint's run had {} {}, this one has {} (a resumed "
             "run keeps the settings of the run it continues)", path, key, found->second, value);
  }
  HG_CHECK(ck.epoch < epochs, "train: --resume {}: the checkpoint already holds all {} epochs", path, epochs);
  if (!unrecorded.empty())
    logger().warn("train: --resume {}: the checkpoint was written before it recorded {}; the run takes this one's as "
                  "the same", path, fmt::join(unrecorded, ", "));
}

// Writes what resuming needs, atomically: model, optimizer, loss scaler, O2's masters and the random state, with the
// loop's own `metadata` and `extra` tensors; the run continues with `epoch` (at its `in-epoch` position, if any).
void write_training_checkpoint(const std::string& path, const nn::Module& model, const optim::Optimizer& opt,
                               amp::Amp& amp, int64_t epoch, int64_t step, Metadata metadata,
                               const NamedTensors& extra) {
  amp.sync_masters();  // a model loaded since the last step: its values, not the masters' older ones, are the run's
  nn::TrainingCheckpoint ck{.model = model.state_dict(), .optimizer = opt.state_tensors(),
                            .extra = amp.scaler().state_tensors(), .epoch = epoch, .step = step,
                            .rng = generator_state(), .metadata = std::move(metadata)};
  // O2's float32 masters are the optimizer's parameters, apart from the half model: they travel as "master.<i>".
  if (!amp.master_weights().empty()) {
    const TensorList masters = opt.parameters();
    for (size_t i = 0; i < masters.size(); ++i) ck.extra.emplace_back(fmt::format("master.{}", i), masters[i]);
  }
  ck.extra.insert(ck.extra.end(), extra.begin(), extra.end());
  nn::save_training_checkpoint(path, ck);
}

// A number the checkpoint's metadata holds: a count (where an interrupted epoch stopped), or train-lm's best
// validation loss ("inf" before any).
double metadata_number(const nn::TrainingCheckpoint& ck, const std::string& key, const std::string& path,
                       bool count) {
  const auto it = ck.metadata.find(key);
  HG_CHECK(it != ck.metadata.end(), "train: --resume {}: the checkpoint has no {}", path, key);
  try {
    size_t used = 0;
    const double v = count ? double(std::stoll(it->second, &used)) : std::stod(it->second, &used);
    // A loss is finite, or inf before there is one: nan or -inf would let no epoch ever be the best.
    if (used == it->second.size() && (count ? v >= 0 : !std::isnan(v) && v > -std::numeric_limits<double>::infinity()))
      return v;
  } catch (const std::exception&) {
  }
  HG_FAIL("train: --resume {}: the checkpoint's {} is \"{}\", not a {}", path, key, it->second,
          count ? "count" : "finite number or inf");
}
int64_t metadata_count(const nn::TrainingCheckpoint& ck, const std::string& key, const std::string& path) {
  return int64_t(metadata_number(ck, key, path, true));
}

const Tensor& named(const NamedTensors& tensors, const std::string& name, const std::string& path) {
  const auto it = std::find_if(tensors.begin(), tensors.end(), [&](const auto& e) { return e.first == name; });
  HG_CHECK(it != tensors.end(), "train: --resume {}: the checkpoint has no {}", path, name);
  return it->second;
}

// An interrupted epoch's tensor, which the resumed epoch adds to or carries on: of the shape it was written with, and of
// its dtype (a count int64, a sum floating).
const Tensor& named_sum(const NamedTensors& tensors, const std::string& name, const std::string& path,
                        const Shape& shape, bool count) {
  const Tensor& t = named(tensors, name, path);
  HG_CHECK(t.shape() == shape && (count ? t.dtype() == kInt64 : t.is_floating_point()), "train: --resume {}: the "
           "checkpoint's {} is {}, where the run keeps {} {}", path, name, t.meta(), count ? "int64" : "floating",
           shape_str(shape));
  return t;
}

// Reads a checkpoint that write_training_checkpoint wrote for a run of these settings (check_same_run) and restores
// its model, O2's masters, optimizer, loss scaler and random state; the loop reads the rest from what it returns.
nn::TrainingCheckpoint resume_training(const std::string& path, const Metadata& run, int64_t epochs, const char* writer,
                                       nn::Module& model, optim::Optimizer& opt, amp::Amp& amp) {
  nn::TrainingCheckpoint ck = nn::load_training_checkpoint(path);
  check_same_run(ck, run, path, epochs, writer);
  model.load_state_dict(ck.model);
  if (!amp.master_weights().empty()) {
    NoGradGuard no_grad;
    TensorList masters = opt.parameters();  // handles to the optimizer's own tensors
    for (size_t i = 0; i < masters.size(); ++i) masters[i].copy_(named(ck.extra, fmt::format("master.{}", i), path));
  }
  opt.load_state_tensors(ck.optimizer);
  amp.scaler().load_state_tensors(ck.extra);
  set_generator_state(ck.rng);
  return ck;
}

}  // namespace

void request_stop() { g_stop_requested.store(true); }
bool stop_requested() { return g_stop_requested.load(); }

std::function<bool()> agreed_stop(dist::ProcessGroup* group, int64_t interval) {
  HG_CHECK(interval >= 1, "agreed_stop: the interval must be >= 1, got {}", interval);
  if (!group) return [] { return stop_requested(); };
  auto steps = std::make_shared<int64_t>(0);  // shared by the copies, as checking_replicas' count
  return [group, interval, steps] {
    if (++*steps % interval != 0) return false;
    return summed_over_ranks(group, {stop_requested() ? 1.0 : 0.0})[0] > 0;
  };
}
void clear_stop() { g_stop_requested.store(false); }

namespace {

// A batch's images and labels on `device`, the images made channels_last when asked.
std::pair<Tensor, Tensor> batch_on(const data::Batch& b, Device device, bool channels_last) {
  Tensor x = b.inputs.to(device);
  if (channels_last) x = contiguous_channels_last(x);
  return {x, b.targets.to(device)};
}

}  // namespace

Evaluation evaluate_classifier(nn::Module& model, data::ImageLoader& loader, amp::Amp& amp, Device device,
                               bool channels_last) {
  model.eval();
  NoGradGuard no_grad;
  Tensor loss = zeros({}, {.device = device}), correct = zeros({}, {.dtype = kInt64, .device = device});
  int64_t count = 0;
  for (const data::Batch& batch : loader.epoch(0)) {
    const auto [x, y] = batch_on(batch, device, channels_last);
    Tensor logits = amp.forward(model, x).to(kFloat32);
    loss.add_(cross_entropy(logits, y), double(y.size(0)));
    correct.add_(argmax(logits, 1).eq(y).to(kInt64).sum());
    count += y.size(0);
  }
  const double n = double(std::max<int64_t>(count, 1));
  return {loss.item<double>() / n, correct.item<double>() / n, count};
}

ClassifierStep classifier_step(nn::Module& model, amp::Amp& amp) {
  return [&model, &amp](const Tensor& x, const Tensor& y) {
    Tensor logits = amp.forward(model, x);
    Tensor loss = amp.loss([&] { return cross_entropy(logits, y); });
    amp.backward(loss);
    amp.step();
    amp.zero_grad();
    NoGradGuard no_grad;
    return std::pair{loss.detach(), argmax(logits.detach(), 1).eq(y).to(kInt64).sum()};
  };
}

ClassifierEpochSums train_classifier_epoch(nn::Module& model, data::ImageLoader& loader, const ClassifierStep& step,
                                           optim::Optimizer& optimizer, const ClassifierEpochOptions& o,
                                           const std::function<void(const ClassifierProgress&)>& on_progress) {
  check_progress_options(o.log_interval, o.progress_seconds);
  const Device device = o.device;
  model.train();
  ClassifierEpochSums sums = o.start;
  {
    NoGradGuard no_grad;
    sums.loss_sum = o.start.loss_sum.defined() ? o.start.loss_sum.to(device).clone() : zeros({}, {.device = device});
    sums.correct = o.start.correct.defined() ? o.start.correct.to(device).clone()
                                             : zeros({}, {.dtype = kInt64, .device = device});
  }
  sums.interrupted = false;
  const int64_t batches = loader.batches_per_epoch();
  // The interval's sums stay on the device too; they are read (a synchronisation) once per report.
  Tensor interval_loss = zeros({}, {.device = device}), interval_correct = zeros({}, {.dtype = kInt64, .device = device});
  int64_t interval_seen = 0;
  ProgressClock clock(o.log_interval, o.progress_seconds, std::chrono::steady_clock::now());
  for (const data::Batch& batch : loader.epoch(o.epoch, sums.batches)) {
    auto [x, y] = batch_on(batch, device, o.channels_last);
    auto [loss, batch_correct] = step(x, y);
    if (o.schedule) o.schedule->step();
    NoGradGuard no_grad;
    sums.loss_sum.add_(loss, double(y.size(0)));
    sums.correct.add_(batch_correct);
    sums.seen += y.size(0);
    ++sums.batches;
    if (clock.active() && on_progress) {
      interval_loss.add_(loss, double(y.size(0)));
      interval_correct.add_(batch_correct);
      interval_seen += y.size(0);
      if (const auto due = clock.batch_done(sums.batches); due.report) {
        const double interval_mean = interval_loss.item<double>() / double(interval_seen);  // synchronizes
        const double seconds = clock.interval_seconds();
        on_progress({.epoch = o.epoch, .batch = sums.batches, .batches = batches,
                     .lr = optimizer.param_groups()[0].lr, .loss = interval_mean,
                     .accuracy = interval_correct.item<double>() / double(interval_seen),
                     .images_per_second = double(interval_seen) / seconds,
                     .eta_seconds = seconds / double(clock.interval_batches()) * double(batches - sums.batches),
                     .interval_end = due.interval_end});
        if (due.interval_end) {
          interval_loss.zero_();
          interval_correct.zero_();
          interval_seen = 0;
        }
        clock.reported(due.interval_end);
      }
    }
    if (o.stop ? o.stop() : stop_requested()) {
      sums.interrupted = true;
      break;
    }
  }
  return sums;
}

std::vector<EpochStats> train_classifier(const ClassifierConfig& c, const std::function<void(const EpochStats&)>& on_epoch,
                                         const std::function<void(const ClassifierProgress&)>& on_progress) {
  const int rank = c.group ? c.group->rank() : 0, ranks = c.group ? c.group->size() : 1;
  const bool cifar10 = c.dataset == "cifar10";
  const float(&mean)[3] = cifar10 ? data::kCifar10Mean : data::kCifar100Mean;
  const float(&std)[3] = cifar10 ? data::kCifar10Std : data::kCifar100Std;
  data::ImageDataset train_set, test_set;
  agree_across_ranks(c.group.get(), "train-classifier", [&] {
    check_progress_options(c.log_interval, c.progress_seconds);
    HG_CHECK(c.dataset == "cifar10" || c.dataset == "cifar100", "train: unknown dataset \"{}\" (cifar10, cifar100)",
             c.dataset);
    HG_CHECK(c.epochs >= 1 && c.batch_size >= 1, "train: epochs and batch_size must be >= 1, got {} and {}", c.epochs,
             c.batch_size);
    HG_CHECK(c.schedule == "onecycle" || c.schedule == "cosine" || c.schedule == "constant",
             "train: unknown schedule \"{}\" (onecycle, cosine, constant)", c.schedule);
    HG_CHECK(!c.cuda_graph || c.device.is_cuda(), "train: --cuda-graph needs a CUDA device, got {}", c.device.str());
    // Before the first epoch, not after it: a folder that cannot take the file would lose the run's state. Only rank
    // 0 writes it.
    if (!c.train_checkpoint.empty() && rank == 0)
      check_writable(c.train_checkpoint, "train-classifier: --train-checkpoint");
    HG_CHECK(c.device.is_cpu() || cuda::is_available(), "train: {} asked for, but no CUDA GPU is visible",
             c.device.str());
    check_group(c.group.get(), c.device, c.cuda_graph, c.check_replicas_every, "train-classifier");
    auto load = [&](data::Split split) {
      return cifar10 ? data::load_cifar10(c.data_dir, split) : data::load_cifar100(c.data_dir, split);
    };
    train_set = first(load(data::Split::Train), c.limit_train);
    test_set = first(load(data::Split::Test), c.limit_test);
    // The run's settings as its flags spell them; the data by its size (each node has its own path).
    Metadata agreed{{"--model", c.model}, {"--dataset", c.dataset}, {"--epochs", std::to_string(c.epochs)},
                    {"--batch-size", std::to_string(c.batch_size)}, {"--lr", fmt::format("{}", c.lr)},
                    {"--weight-decay", fmt::format("{}", c.weight_decay)},
                    {"--nesterov", c.nesterov ? "on" : "off"}, {"--schedule", c.schedule},
                    {"--opt-level", amp::opt_level_name(c.opt_level)}, {"--seed", std::to_string(c.seed)},
                    {"--check-replicas", std::to_string(c.check_replicas_every)},
                    {"training images", std::to_string(train_set.size())},
                    {"test images", std::to_string(test_set.size())}};
    if (c.schedule == "onecycle")  // which cycles the momentum in place of --momentum
      agreed.insert(
          {{"--pct-start", fmt::format("{}", c.pct_start)}, {"--div-factor", fmt::format("{}", c.div_factor)}});
    else
      agreed["--momentum"] = fmt::format("{}", c.momentum);
    if (c.opt_level != amp::OptLevel::O0) agreed["--half"] = dtype_name(c.half_dtype);
    return agreed;
  });
  data::ImageLoader train_loader(std::move(train_set), data::ImageTransform::cifar_train(mean, std),
                                 {.batch_size = c.batch_size, .shuffle = true, .workers = c.workers, .seed = c.seed,
                                  .rank = rank, .world_size = ranks});
  data::ImageLoader test_loader(slice_for_rank(std::move(test_set), rank, ranks),
                                data::ImageTransform::cifar_eval(mean, std),
                                {.batch_size = c.batch_size, .workers = c.workers});
  const int64_t classes = cifar10 ? 10 : 100;

  manual_seed(c.seed);
  std::shared_ptr<nn::Module> model = models::image_classifier(c.model, classes);
  model->to(c.device);
  if (c.channels_last) model->to(MemoryFormat::ChannelsLast);  // the weights in the batches' layout: no copies
  // Data parallel: rank 0's weights everywhere before O2 copies them into its float32 masters.
  if (c.group) nn::broadcast_from_rank0(*c.group, *model);
  optim::SGD sgd(model->parameters(),
                 {.lr = c.lr, .momentum = c.momentum, .weight_decay = c.weight_decay, .nesterov = c.nesterov});
  amp::Amp amp = amp::initialize(*model, sgd, c.opt_level, {.half_dtype = c.half_dtype});
  // Data parallel: the wrapper whose forward the steps run (rank 0's buffers first) and whose hooks average the
  // gradients (their .grad the buckets' views: zero_grad sets them to none every step); after amp::initialize, so that
  // it holds the tensors the level trains (O2's half model).
  std::shared_ptr<nn::DistributedDataParallel> ddp;
  if (c.group) {
    ddp = std::make_shared<nn::DistributedDataParallel>(
        model, c.group, nn::DistributedDataParallelOptions{.gradient_as_bucket_view = true});
    amp.scaler().set_process_group(c.group);
  }
  nn::Module& trained = ddp ? *ddp : *model;
  const int64_t steps_per_epoch = train_loader.batches_per_epoch();
  std::unique_ptr<optim::LRScheduler> schedule;
  if (c.schedule == "onecycle") {
    schedule = std::make_unique<optim::OneCycleLR>(
        sgd, optim::OneCycleLROptions{.max_lr = {c.lr}, .epochs = c.epochs, .steps_per_epoch = steps_per_epoch,
                                      .pct_start = c.pct_start, .div_factor = c.div_factor});
  } else if (c.schedule == "cosine") {
    schedule = std::make_unique<optim::CosineAnnealingLR>(
        sgd, optim::CosineAnnealingLROptions{.T_max = c.epochs * steps_per_epoch});
  }

  const ClassifierStep eager_step = classifier_step(trained, amp);
  // --cuda-graph: the step on fixed input buffers, its figures copied into fixed outputs, captured after two eager
  // calls; the scheduler's lr and momentum reach the replays through SGD (optim/sgd.h). A last smaller batch runs
  // eagerly.
  Tensor graph_x, graph_y, graph_loss, graph_correct;
  std::unique_ptr<cuda::CapturedStep> captured;
  if (c.cuda_graph) {
    graph_loss = zeros({}, {.device = c.device});
    graph_correct = zeros({}, {.dtype = kInt64, .device = c.device});
    captured = std::make_unique<cuda::CapturedStep>(c.device, [&] {
      auto [loss, batch_correct] = eager_step(graph_x, graph_y);
      NoGradGuard no_grad;
      graph_loss.copy_(loss);
      graph_correct.copy_(batch_correct);
    }, 2);
  }
  const ClassifierStep step_of_run = !captured ? eager_step : ClassifierStep([&](const Tensor& x, const Tensor& y) {
    if (y.size(0) != c.batch_size) return eager_step(x, y);
    {
      NoGradGuard no_grad;  // only for the copies: the step itself records its graph for backward
      if (!graph_x.defined()) {  // buffers of the batch's layout, channels_last or not
        graph_x = c.channels_last ? contiguous_channels_last(x.clone()) : x.clone();
        graph_y = y.clone();
      } else {
        graph_x.copy_(x);
        graph_y.copy_(y);
      }
    }
    (*captured)();
    return std::pair{graph_loss, graph_correct};
  });
  std::vector<EpochStats> all;
  int64_t step = 0, first_epoch = 0;
  // Where an interrupted epoch stopped (a checkpoint written by request_stop()): its batches and sums so far.
  ClassifierEpochSums resumed;
  agree_across_ranks(c.group.get(), "train-classifier", [&] {
    if (c.resume.empty()) return Metadata{{"--resume", "none"}};
    const nn::TrainingCheckpoint ck = resume_training(c.resume, classifier_run(c), c.epochs,
                                                      "train-classifier --train-checkpoint", *model, sgd, amp);
    step = ck.step;
    first_epoch = ck.epoch;
    if (ck.metadata.count("batch")) {
      HG_CHECK(!c.group, "train-classifier: {} was written within an epoch, by a run of one process; a data-parallel "
               "run resumes from the end of an epoch", c.resume);
      resumed.batches = metadata_count(ck, "batch", c.resume);
      resumed.seen = metadata_count(ck, "seen", c.resume);
    }
    // Where it stopped must be a place in this run's epochs: whole batches before it (an epoch's last may be smaller:
    // a stop after it is one too), and the step counts every batch before it (the schedule's position).
    const int64_t images = train_loader.samples_per_epoch();
    HG_CHECK(resumed.batches <= steps_per_epoch && resumed.seen == std::min(resumed.batches * c.batch_size, images) &&
                 ck.step == ck.epoch * steps_per_epoch + resumed.batches,
             "train: --resume {}: the checkpoint stopped at step {}, after batch {} ({} images) of epoch {}, which is "
             "no place in this run: its epochs have {} batches of {} images, {} in all", c.resume, ck.step,
             resumed.batches, resumed.seen, ck.epoch + 1, steps_per_epoch, c.batch_size, images);
    if (schedule) schedule->set_step(ck.step);
    if (ck.metadata.count("batch")) {
      resumed.loss_sum = named_sum(ck.extra, "epoch.loss_sum", c.resume, {}, false).to(c.device);
      resumed.correct = named_sum(ck.extra, "epoch.correct", c.resume, {}, true).to(c.device);
    }
    return Metadata{{"--resume", fmt::format("at epoch {}, step {}", first_epoch, step)}};
  });
  if (!c.resume.empty()) check_resumed_replicas(c.group.get(), *model, "train-classifier");
  int64_t skipped_before = amp.scaler().skipped_steps();
  const std::function<bool()> stop = checking_replicas(agreed_stop(c.group.get()), c.group.get(), *model,
                                                       c.check_replicas_every, "train-classifier");
  bool wrote_checkpoint = false;  // train_checkpoint, at an epoch's end of this run (what a divergence leaves there)
  for (int64_t epoch = first_epoch; epoch < c.epochs; ++epoch) {
    EpochStats s{.epoch = epoch};
    if (c.device.is_cuda()) cuda::reset_peak(c.device.index);
    const auto t0 = std::chrono::steady_clock::now();
    ClassifierEpochOptions options{.epoch = epoch, .device = c.device, .channels_last = c.channels_last,
                                   .schedule = schedule.get(), .log_interval = c.log_interval,
                                   .progress_seconds = c.progress_seconds, .stop = stop};
    if (epoch == first_epoch && resumed.batches > 0) options.start = resumed;
    const ClassifierEpochSums sums = train_classifier_epoch(trained, train_loader, step_of_run, sgd, options, on_progress);
    step += sums.batches - options.start.batches;
    if (sums.interrupted) {  // the step is done: keep where the epoch is, for --resume (one process)
      if (!c.train_checkpoint.empty() && !c.group) {
        Metadata metadata = classifier_run(c);
        metadata["batch"] = std::to_string(sums.batches);
        metadata["seen"] = std::to_string(sums.seen);
        write_training_checkpoint(c.train_checkpoint, *model, sgd, amp, epoch, step, metadata,
                                  {{"epoch.loss_sum", sums.loss_sum}, {"epoch.correct", sums.correct}});
      }
      return all;
    }
    if (c.device.is_cuda()) cuda::synchronize(c.device.index);
    s.seconds = seconds_since(t0);
    const std::vector<double> train = summed_over_ranks(
        c.group.get(), {sums.loss_sum.item<double>(), sums.correct.item<double>(), double(sums.seen),
                        double(sums.seen - options.start.seen)});
    s.images_per_second = train[3] / s.seconds;
    s.train_loss = train[0] / train[2];
    s.train_accuracy = train[1] / train[2];

    if (ddp) ddp->sync_buffers();  // every rank's slice evaluated with rank 0's running statistics
    const Evaluation test = evaluate_classifier(*model, test_loader, amp, c.device, c.channels_last);
    const std::vector<double> tested =
        summed_over_ranks(c.group.get(), {test.loss * double(test.count), test.accuracy * double(test.count),
                                          double(test.count)});
    s.test_loss = tested[0] / std::max(tested[2], 1.0);
    s.test_accuracy = tested[1] / std::max(tested[2], 1.0);
    if (c.device.is_cuda()) s.peak_memory_bytes = int64_t(cuda::memory_stats(c.device.index).peak_allocated_bytes);
    s.loss_scale = amp.scaler().is_enabled() ? amp.scaler().get_scale() : 1.0;
    s.skipped_steps = amp.scaler().skipped_steps() - skipped_before;
    skipped_before += s.skipped_steps;
    if (c.stop_when_diverged && !std::isfinite(s.test_loss)) {  // as train-lm's validation loss
      all.push_back(s);
      if (on_epoch) on_epoch(s);
      HG_FAIL("train-classifier: the test loss after epoch {} is {}: the model diverged (a lower --lr may help); "
              "stopped. {}", epoch + 1, std::isnan(s.test_loss) ? std::string("nan") : fmt::format("{}", s.test_loss),
              c.train_checkpoint.empty() ? std::string()
              : wrote_checkpoint ? fmt::format("{} holds the run after epoch {}.", c.train_checkpoint, epoch)
                                 : fmt::format("This run wrote no training checkpoint to {}.", c.train_checkpoint));
    }
    if (!c.train_checkpoint.empty()) {  // rank 0 writes it for the group
      if (rank == 0)
        write_training_checkpoint(c.train_checkpoint, *model, sgd, amp, epoch + 1, step, classifier_run(c), {});
      wrote_checkpoint = true;
    }
    all.push_back(s);
    if (on_epoch) on_epoch(s);
  }
  return all;
}

const char* precision_name(amp::OptLevel level) {
  switch (level) {
    case amp::OptLevel::O0: return "FP32";
    case amp::OptLevel::O1: return "AMP";
    case amp::OptLevel::O2: return "O2";
    case amp::OptLevel::O3: return "FP16";
  }
  return "?";
}

std::vector<SweepRow> sweep_classifier(const ClassifierConfig& base, const std::vector<amp::OptLevel>& levels,
                                       const std::vector<int64_t>& batch_sizes,
                                       const std::function<void(const SweepRow&)>& on_row,
                                       const std::function<void(const SweepRow&, const ClassifierProgress&)>& on_progress) {
  HG_CHECK(!levels.empty() && !batch_sizes.empty(), "sweep: give at least one opt level and one batch size");
  std::vector<SweepRow> rows;
  for (amp::OptLevel level : levels) {
    for (int64_t batch : batch_sizes) {
      ClassifierConfig config = base;
      config.opt_level = level;
      config.batch_size = batch;
      config.stop_when_diverged = false;
      SweepRow row{.opt_level = level, .batch_size = batch};
      if (config.device.is_cuda()) cuda::empty_cache();  // each run starts from an empty cache
      try {
        std::function<void(const ClassifierProgress&)> progress;
        if (on_progress) progress = [&](const ClassifierProgress& p) { on_progress(row, p); };
        const std::vector<EpochStats> epochs = train_classifier(config, {}, progress);
        const SteadyState steady = steady_state(epochs, &EpochStats::images_per_second);
        row.seconds_per_epoch = steady.seconds_per_epoch;
        row.images_per_second = steady.per_second;
        row.peak_memory_bytes = steady.peak_memory_bytes;
        row.skipped_steps = steady.skipped_steps;
        row.final_train_accuracy = epochs.back().train_accuracy;
        row.final_test_accuracy = epochs.back().test_accuracy;
        row.final_test_loss = epochs.back().test_loss;
      } catch (const OutOfMemory&) {
        row.out_of_memory = true;
      }
      rows.push_back(row);
      if (on_row) on_row(row);
    }
  }
  return rows;
}

namespace {

nn::RecurrentKind recurrent_kind(const std::string& name) {
  if (name == "lstm") return nn::RecurrentKind::LSTM;
  if (name == "gru") return nn::RecurrentKind::GRU;
  if (name == "rnn_tanh") return nn::RecurrentKind::RNNTanh;
  if (name == "rnn_relu") return nn::RecurrentKind::RNNReLU;
  HG_FAIL("train: unknown recurrent layer \"{}\" (lstm, gru, rnn_tanh, rnn_relu)", name);
}

// What a resumed language-model run must share with the run that wrote its checkpoint.
Metadata language_model_run(const LanguageModelConfig& c) {
  Metadata run{{"rnn", c.rnn},
          {"data_dir", c.data_dir.string()},
          {"embedding_size", std::to_string(c.embedding_size)},
          {"hidden_size", std::to_string(c.hidden_size)},
          {"num_layers", std::to_string(c.num_layers)},
          {"dropout", fmt::format("{}", c.dropout)},
          {"tie_weights", c.tie_weights ? "true" : "false"},
          {"epochs", std::to_string(c.epochs)},
          {"batch_size", std::to_string(c.batch_size)},
          {"bptt", std::to_string(c.bptt)},
          {"clip", fmt::format("{}", c.clip)},
          {"opt_level", amp::opt_level_name(c.opt_level)},
          {"seed", std::to_string(c.seed)},
          {"limit_tokens", std::to_string(c.limit_tokens)},
          {"dry_run", c.dry_run ? "true" : "false"},
          {"lr", fmt::format("{}", c.lr)},
          {"eval_batch_size", std::to_string(c.eval_batch_size)},
          {"world_size", std::to_string(c.group ? c.group->size() : 1)}};
  if (c.opt_level != amp::OptLevel::O0) run["half"] = dtype_name(c.half_dtype);  // used at O1-O3 only
  return run;
}

Tensor first_tokens(const Tensor& ids, int64_t n) { return n > 0 && n < ids.size(0) ? ids.narrow(0, 0, n) : ids; }

// The windows of a batchified source, as main.py walks them: rows 0, bptt, 2 bptt, ... while a next row exists.
template <typename Fn> void for_each_window(const Tensor& source, int64_t bptt, Fn&& fn) {
  const int64_t rows = source.size(0);
  for (int64_t i = 0; i + 1 < rows; i += std::min(bptt, rows)) fn(data::bptt_batch(source, i, bptt));  // no overflow
}

}  // namespace

double evaluate_language_model(models::LanguageModel& model, const Tensor& source, int64_t bptt, amp::Amp& amp) {
  HG_CHECK(source.dim() == 2 && source.size(0) >= 2 && bptt >= 1,
           "evaluate_language_model: expected a batchified split [rows >= 2, batch] and bptt >= 1, got {} and {}",
           source.meta(), bptt);
  model.eval();
  NoGradGuard no_grad;
  Tensor total = zeros({}, {.device = source.device()}), h, cell;
  for_each_window(source, bptt, [&](const data::TextBatch& b) {
    auto out = amp.run([&] { return model.features(b.input, h, cell); });
    h = out.h;
    cell = out.c;
    total.add_(amp.loss([&] { return model.loss(out.features, b.target); }), double(b.input.size(0)));
  });
  return total.item<double>() / double(source.size(0) - 1);
}

LanguageModelStep language_model_step(models::LanguageModel& model, amp::Amp& amp, double clip) {
  return [&model, &amp, clip](const Tensor& input, const Tensor& target, RecurrentState& state) {
    // Truncated backpropagation through time: the state goes on, its history does not.
    const Tensor h0 = state.h.defined() ? state.h.detach() : Tensor(), c0 = state.c.defined() ? state.c.detach() : Tensor();
    auto out = amp.run([&] { return model.features(input, h0, c0); });
    Tensor loss = amp.loss([&] { return model.loss(out.features, target); });
    amp.backward(loss);
    amp.clip_grad_norm_(clip);
    amp.step();
    amp.zero_grad();
    state = {out.h.detach(), out.c.defined() ? out.c.detach() : Tensor()};
    return loss.detach();
  };
}

namespace {

// The windows of bptt rows an epoch over `data` (batchified: a column a sequence) has, the last one shorter.
int64_t windows_of(const Tensor& data, int64_t bptt) { return (data.size(0) - 2) / bptt + 1; }

// Where a resumed epoch starts lies within it: at most all its windows, and no more tokens than those hold.
void check_resume_point(int64_t windows_done, int64_t tokens_done, const Tensor& data, int64_t bptt,
                        const std::string& who) {
  const int64_t windows = windows_of(data, bptt), window_tokens = bptt * data.size(1);
  HG_CHECK(windows_done <= windows && tokens_done <= windows_done * window_tokens, "{}: the epoch has {} windows of "
           "at most {} tokens, asked to resume after {} windows and {} tokens", who, windows, window_tokens,
           windows_done, tokens_done);
}

}  // namespace

LanguageModelEpochSums train_language_model_epoch(models::LanguageModel& model, const Tensor& train_data,
                                                  const LanguageModelStep& step, optim::Optimizer& optimizer,
                                                  const LanguageModelEpochOptions& o,
                                                  const std::function<void(const LanguageModelProgress&)>& on_progress) {
  HG_CHECK(train_data.dim() == 2 && train_data.size(0) >= 2 && o.bptt >= 1,
           "train_language_model_epoch: expected a batchified split [rows >= 2, batch] and bptt >= 1, got {} and {}",
           train_data.meta(), o.bptt);
  check_progress_options(o.log_interval, o.progress_seconds);
  const Device device = train_data.device();
  model.train();
  LanguageModelEpochSums sums = o.start;
  sums.interrupted = false;
  {
    NoGradGuard no_grad;
    sums.total = o.start.total.defined() ? o.start.total.to(device).clone() : zeros({}, {.device = device});
  }
  const int64_t skip = sums.batches, batches = windows_of(train_data, o.bptt);
  check_resume_point(sums.batches, sums.tokens, train_data, o.bptt, "train_language_model_epoch");
  const double lr = optimizer.param_groups()[0].lr;
  int64_t window = 0;
  // The interval's loss stays on the device; it is read (a synchronisation) once per report.
  Tensor interval_total = zeros({}, {.device = device});
  int64_t interval_tokens = 0;
  ProgressClock clock(o.log_interval, o.progress_seconds, std::chrono::steady_clock::now());
  for_each_window(train_data, o.bptt, [&](const data::TextBatch& b) {
    if (sums.interrupted || window++ < skip || (o.dry_run && sums.batches == 1)) return;
    const Tensor loss = step(b.input, b.target, sums.state);
    NoGradGuard no_grad;
    sums.total.add_(loss, double(b.target.numel()));
    sums.tokens += b.target.numel();
    ++sums.batches;
    if (clock.active() && on_progress) {
      interval_total.add_(loss, double(b.target.numel()));
      interval_tokens += b.target.numel();
      if (const auto due = clock.batch_done(sums.batches); due.report) {
        const double interval_loss = interval_total.item<double>() / double(interval_tokens);  // synchronizes
        const double seconds = clock.interval_seconds();
        const double per_batch = seconds / double(clock.interval_batches());
        on_progress({.epoch = o.epoch, .batch = sums.batches, .batches = batches, .lr = lr, .loss = interval_loss,
                     .ms_per_batch = 1e3 * per_batch, .tokens_per_second = double(interval_tokens) / seconds,
                     .eta_seconds = per_batch * double(batches - sums.batches), .interval_end = due.interval_end});
        if (due.interval_end) {
          interval_total.zero_();
          interval_tokens = 0;
        }
        clock.reported(due.interval_end);
      }
    }
    sums.interrupted = o.stop ? o.stop() : stop_requested();
  });
  return sums;
}

LanguageModelResult train_language_model(const LanguageModelConfig& c,
                                         const std::function<void(const LanguageModelEpochStats&)>& on_epoch,
                                         const std::function<void(const LanguageModelProgress&)>& on_progress) {
  const int rank = c.group ? c.group->rank() : 0, ranks = c.group ? c.group->size() : 1;
  nn::RecurrentKind kind{};
  data::Corpus corpus;
  Tensor train_data, valid_data, test_data;
  int64_t vocab = 0;
  agree_across_ranks(c.group.get(), "train-lm", [&] {
    HG_CHECK(c.epochs >= 1 && c.batch_size >= 1 && c.eval_batch_size >= 1 && c.bptt >= 1,
             "train: epochs, batch sizes and bptt must be >= 1, got {}, {}, {}, {}", c.epochs, c.batch_size,
             c.eval_batch_size, c.bptt);
    check_progress_options(c.log_interval, c.progress_seconds);
    HG_CHECK(!c.cuda_graph || c.device.is_cuda(), "train: --cuda-graph needs a CUDA device, got {}", c.device.str());
    // Before the first epoch, not after it: a folder that cannot take the files would lose the run's result. Only
    // rank 0 writes them.
    if (!c.checkpoint.empty() && rank == 0) check_writable(c.checkpoint, "train-lm: --save");
    if (!c.train_checkpoint.empty() && rank == 0) check_writable(c.train_checkpoint, "train-lm: --train-checkpoint");
    HG_CHECK(c.device.is_cpu() || cuda::is_available(), "train: {} asked for, but no CUDA GPU is visible",
             c.device.str());
    check_group(c.group.get(), c.device, c.cuda_graph, c.check_replicas_every, "train-lm");
    kind = recurrent_kind(c.rnn);
    corpus = data::load_corpus(data::corpus_directory(c.data_dir));
    // A split laid out in `batch` columns, with at least two rows: one window of inputs and their next tokens.
    auto split = [&](const Tensor& tokens, int64_t batch, const char* name) {
      const Tensor ids = first_tokens(tokens, c.limit_tokens);
      HG_CHECK(ids.size(0) / batch >= 2, "train-lm: the {} split has {} tokens, too few for {} columns (at least {})",
               name, ids.size(0), batch, 2 * uint64_t(batch));  // batch >= 1: no overflow past int64 / 2
      return data::batchify(ids, batch).to(c.device);
    };
    // Data parallel: this rank's columns of the split laid out for all ranks' columns.
    train_data =
        split(corpus.train, c.batch_size * ranks, "training").narrow(1, c.batch_size * rank, c.batch_size).contiguous();
    valid_data = split(corpus.valid, c.eval_batch_size, "validation");
    test_data = split(corpus.test, c.eval_batch_size, "test");
    vocab = corpus.vocab.size();
    // The run's settings as its flags spell them; the corpus by its sizes (each node has its own path).
    Metadata agreed{{"--model", c.rnn}, {"--emsize", std::to_string(c.embedding_size)},
                    {"--nhid", std::to_string(c.hidden_size)}, {"--nlayers", std::to_string(c.num_layers)},
                    {"--dropout", fmt::format("{}", c.dropout)}, {"--tied", c.tie_weights ? "on" : "off"},
                    {"--epochs", std::to_string(c.epochs)}, {"--batch-size", std::to_string(c.batch_size)},
                    {"--bptt", std::to_string(c.bptt)}, {"--lr", fmt::format("{}", c.lr)},
                    {"--clip", fmt::format("{}", c.clip)}, {"--opt-level", amp::opt_level_name(c.opt_level)},
                    {"--seed", std::to_string(c.seed)}, {"--dry-run", c.dry_run ? "on" : "off"},
                    {"--check-replicas", std::to_string(c.check_replicas_every)},
                    {"vocabulary size", std::to_string(vocab)},
                    {"training tokens", std::to_string(first_tokens(corpus.train, c.limit_tokens).size(0))},
                    {"validation tokens", std::to_string(first_tokens(corpus.valid, c.limit_tokens).size(0))},
                    {"test tokens", std::to_string(first_tokens(corpus.test, c.limit_tokens).size(0))}};
    if (c.opt_level != amp::OptLevel::O0) agreed["--half"] = dtype_name(c.half_dtype);
    return agreed;
  });

  manual_seed(c.seed);
  auto shared_model = std::make_shared<models::LanguageModel>(
      vocab, models::LanguageModelOptions{.kind = kind, .embedding_size = c.embedding_size,
                                          .hidden_size = c.hidden_size, .num_layers = c.num_layers,
                                          .dropout = c.dropout, .tie_weights = c.tie_weights});
  models::LanguageModel& model = *shared_model;
  model.to(c.device);
  model.align_decoder();
  if (c.group) nn::broadcast_from_rank0(*c.group, model);  // before O2 copies the weights into its masters
  optim::SGD sgd(model.parameters(), {.lr = c.lr});
  amp::Amp amp = amp::initialize(model, sgd, c.opt_level, {.half_dtype = c.half_dtype});
  // Data parallel: rank 0's weights everywhere and the gradients averaged by the wrapper's hooks (into the buckets'
  // views); the steps call the model's own forward (it takes the recurrent state; a language model has no buffers to
  // share).
  std::shared_ptr<nn::DistributedDataParallel> ddp;
  if (c.group) {
    ddp = std::make_shared<nn::DistributedDataParallel>(
        shared_model, c.group, nn::DistributedDataParallelOptions{.gradient_as_bucket_view = true});
    amp.scaler().set_process_group(c.group);
  }

  // Every rank evaluates; rank 0's figure decides for all.
  auto evaluate = [&](const Tensor& source) {
    return rank0_value(c.group.get(), evaluate_language_model(model, source, c.bptt, amp));
  };

  LanguageModelResult result;
  double lr = c.lr, best_valid = std::numeric_limits<double>::infinity();
  NamedTensors best_state;
  bool best_saved = false;  // by an epoch of this run (a resumed run's best may be the checkpoint's)
  int64_t first_epoch = 0;
  // Where an interrupted epoch stopped (a checkpoint written by request_stop()): its windows, loss sum and tokens so
  // far, and the recurrent state carried into the next window.
  LanguageModelEpochSums resumed;
  agree_across_ranks(c.group.get(), "train-lm", [&] {
    if (c.resume.empty()) return Metadata{{"--resume", "none"}};
    const nn::TrainingCheckpoint ck = resume_training(c.resume, language_model_run(c), c.epochs,
                                                      "train-lm --train-checkpoint", model, sgd, amp);
    lr = sgd.param_groups().front().lr;
    best_valid = metadata_number(ck, "best_valid", c.resume, false);  // "inf" before a first evaluation
    if (std::isfinite(best_valid)) {  // an epoch was evaluated: its best model is in the checkpoint
      for (const auto& [name, t] : model.state_dict())
        best_state.emplace_back(name, named(ck.extra, "best." + name, c.resume).to(t.device()));
    }
    first_epoch = ck.epoch;
    if (ck.metadata.count("batch")) {
      HG_CHECK(!c.group, "train-lm: {} was written within an epoch, by a run of one process; a data-parallel run "
               "resumes from the end of an epoch", c.resume);
      resumed.batches = metadata_count(ck, "batch", c.resume);
      resumed.tokens = metadata_count(ck, "tokens", c.resume);
      check_resume_point(resumed.batches, resumed.tokens, train_data, c.bptt, "train: --resume " + c.resume);
      const Shape state{c.num_layers, c.batch_size, c.hidden_size};
      resumed.total = named_sum(ck.extra, "epoch.total", c.resume, {}, false).to(c.device);
      resumed.state.h = named_sum(ck.extra, "state.h", c.resume, state, false).to(c.device);
      if (kind == nn::RecurrentKind::LSTM)
        resumed.state.c = named_sum(ck.extra, "state.c", c.resume, state, false).to(c.device);
    }
    // The lr and the best loss so far decide each rank's annealing: they must agree, as the model (checked below).
    return Metadata{{"--resume", fmt::format("at epoch {}, lr {}, best validation loss {:.17g}", first_epoch, lr,
                                             best_valid)}};
  });
  if (!c.resume.empty()) check_resumed_replicas(c.group.get(), model, "train-lm");
  // A training checkpoint whose run continues with `epoch`: from its start, or, for an interrupted epoch, from where
  // `in_epoch` and `in_epoch_metadata` say.
  auto save_training = [&](int64_t epoch, const NamedTensors& in_epoch, const Metadata& in_epoch_metadata) {
    Metadata metadata = language_model_run(c);
    metadata["best_valid"] = fmt::format("{:.17g}", best_valid);
    metadata.insert(in_epoch_metadata.begin(), in_epoch_metadata.end());
    NamedTensors extra;
    for (const auto& [name, t] : best_state) extra.emplace_back("best." + name, t);
    extra.insert(extra.end(), in_epoch.begin(), in_epoch.end());
    write_training_checkpoint(c.train_checkpoint, model, sgd, amp, epoch, 0, std::move(metadata), extra);
  };
  int64_t skipped_before = amp.scaler().skipped_steps();
  const LanguageModelStep eager_step = language_model_step(model, amp, c.clip);
  // --cuda-graph: the recurrent state lives in place (zeros at each epoch's start), with the window and the loss, in
  // tensors the captured step reads and writes; full-length windows replay the step, the last, shorter one runs it
  // eagerly on the same state.
  Tensor h, cell, window_input, window_target, window_loss;
  auto step_in_place = [&](const Tensor& input, const Tensor& target) {
    RecurrentState next{h, cell};
    Tensor loss = eager_step(input, target, next);
    NoGradGuard no_grad;
    h.copy_(next.h);
    if (cell.defined()) cell.copy_(next.c);
    window_loss.copy_(loss);
    return window_loss;
  };
  std::unique_ptr<cuda::CapturedStep> captured;
  if (c.cuda_graph) {
    const int64_t batch_size = train_data.size(1);
    window_input = empty({c.bptt, batch_size}, {.dtype = kInt64, .device = c.device});
    window_target = empty({c.bptt * batch_size}, {.dtype = kInt64, .device = c.device});
    window_loss = zeros({}, {.device = c.device});
    h = zeros({c.num_layers, batch_size, c.hidden_size}, {.device = c.device});
    if (kind == nn::RecurrentKind::LSTM) cell = zeros({c.num_layers, batch_size, c.hidden_size}, {.device = c.device});
    captured = std::make_unique<cuda::CapturedStep>(c.device, [&] { step_in_place(window_input, window_target); }, 2);
  }
  const LanguageModelStep step_of_run =
      !captured ? eager_step : LanguageModelStep([&](const Tensor& input, const Tensor& target, RecurrentState&) {
        if (input.size(0) != c.bptt) return step_in_place(input, target);
        window_input.copy_(input);
        window_target.copy_(target);
        (*captured)();
        return window_loss;
      });
  const std::function<bool()> stop = checking_replicas(agreed_stop(c.group.get()), c.group.get(), model,
                                                       c.check_replicas_every, "train-lm");
  for (int64_t epoch = first_epoch; epoch < c.epochs; ++epoch) {
    LanguageModelEpochStats s{.epoch = epoch, .lr = lr};
    if (c.device.is_cuda()) cuda::reset_peak(c.device.index);
    const auto t0 = std::chrono::steady_clock::now();
    LanguageModelEpochOptions options{.epoch = epoch, .bptt = c.bptt, .log_interval = c.log_interval,
                                      .progress_seconds = c.progress_seconds, .dry_run = c.dry_run, .stop = stop};
    const bool resuming = epoch == first_epoch && resumed.batches > 0;
    if (resuming) options.start = resumed;
    if (c.cuda_graph) {  // the state in its buffers, from zeros or from where the interrupted epoch stopped
      NoGradGuard no_grad;
      resuming ? h.copy_(resumed.state.h) : h.zero_();
      if (cell.defined()) resuming ? cell.copy_(resumed.state.c) : cell.zero_();
      options.start.state = {h, cell};
    }
    const LanguageModelEpochSums sums =
        train_language_model_epoch(model, train_data, step_of_run, sgd, options, on_progress);
    if (sums.interrupted) {  // the step is done: keep where the epoch is, for --resume (one process)
      if (!c.train_checkpoint.empty() && !c.group) {
        NamedTensors in_epoch{{"epoch.total", sums.total}, {"state.h", sums.state.h.detach()}};
        if (sums.state.c.defined()) in_epoch.emplace_back("state.c", sums.state.c.detach());
        save_training(epoch, in_epoch,
                      {{"batch", std::to_string(sums.batches)}, {"tokens", std::to_string(sums.tokens)}});
      }
      return result;
    }
    if (c.device.is_cuda()) cuda::synchronize(c.device.index);
    s.seconds = seconds_since(t0);
    const std::vector<double> train = summed_over_ranks(
        c.group.get(), {sums.total.item<double>(), double(sums.tokens), double(sums.tokens - options.start.tokens)});
    s.tokens_per_second = train[2] / s.seconds;
    s.train_loss = train[0] / train[1];
    s.valid_loss = evaluate(valid_data);
    if (c.device.is_cuda()) s.peak_memory_bytes = int64_t(cuda::memory_stats(c.device.index).peak_allocated_bytes);
    s.loss_scale = amp.scaler().is_enabled() ? amp.scaler().get_scale() : 1.0;
    s.skipped_steps = amp.scaler().skipped_steps() - skipped_before;
    skipped_before += s.skipped_steps;
    // A diverged model does not come back (NaN weights stay NaN): stop now rather than train on to the end and have
    // no best model to test. What the earlier epochs gave stays: the saved best model, the last training checkpoint.
    // A NaN is named "nan" whatever its sign bit (fmt writes "-nan" for some, and which one a CPU's vector code
    // produces differs: the GPU machine's AVX-512 host gave "-nan" where this AVX2 one gave "nan").
    if (!std::isfinite(s.valid_loss) && !best_saved && std::isfinite(best_valid) && !c.checkpoint.empty() &&
        rank == 0) {  // a resumed run's best, the checkpoint's: into --save before the error says it is there
      model.load_state_dict(best_state);
      models::save_language_model(model, corpus.vocab, c.checkpoint);
    }
    HG_CHECK(std::isfinite(s.valid_loss),
             "train-lm: the validation loss after epoch {} is {}: the model diverged (a lower --lr or --clip may "
             "help); stopped. {}",
             epoch + 1, std::isnan(s.valid_loss) ? std::string("nan") : fmt::format("{}", s.valid_loss),
             !std::isfinite(best_valid) ? std::string("No epoch had a finite validation loss: nothing was saved.")
             : c.checkpoint.empty()
                 ? fmt::format("The best validation perplexity was {:.2f}.", std::exp(best_valid))
                 : fmt::format("The best model (validation perplexity {:.2f}) is in {}.", std::exp(best_valid),
                               c.checkpoint));
    if (s.valid_loss < best_valid) {
      best_valid = s.valid_loss;
      best_state.clear();
      for (const auto& [name, t] : model.state_dict()) best_state.emplace_back(name, t.detach().clone());
      if (!c.checkpoint.empty() && rank == 0) models::save_language_model(model, corpus.vocab, c.checkpoint);
      best_saved = true;
    } else {
      lr /= 4;  // main.py: anneal when the validation loss did not improve
      for (optim::ParamGroupRef g : sgd.param_groups()) g.lr = lr;
    }
    if (!c.train_checkpoint.empty() && rank == 0) save_training(epoch + 1, {}, {});
    result.epochs.push_back(s);
    if (on_epoch) on_epoch(s);
  }
  model.load_state_dict(best_state);
  // A resumed run whose epochs all did worse than the checkpoint's best still leaves the best model in --save (which
  // may name another file than the interrupted run's).
  if (!best_saved && !c.checkpoint.empty() && rank == 0) models::save_language_model(model, corpus.vocab, c.checkpoint);
  result.test_loss = evaluate(test_data);
  return result;
}

namespace {

// A uniform double in [0, 1) from the global generator: 53 bits of one Philox block.
double next_uniform() {
  const GeneratorState s = next_random_counters(1);
  const Philox::U4 r = Philox::generate(s.seed, s.offset);
  return double((uint64_t(r.x[0]) << 21) | (r.x[1] >> 11)) * 0x1p-53;
}

// The index i with cdf(i - 1) <= u * total < cdf(i), over the weights' running sum (zero weights never chosen);
// -1 when the weights do not sum to a positive finite number.
int64_t sample_index(const std::vector<float>& weights, double u) {
  double total = 0;
  for (float w : weights) total += w;
  if (!(std::isfinite(total) && total > 0)) return -1;
  const double target = u * total;
  double cdf = 0;
  int64_t last = -1;
  for (size_t i = 0; i < weights.size(); ++i) {
    if (!(weights[i] > 0)) continue;
    cdf += weights[i];
    last = int64_t(i);
    if (target < cdf) return last;
  }
  return last;  // u * total rounded up to the total
}

}  // namespace

std::vector<std::string> generate_words(const GenerateConfig& c, const OnWord& on_word) {
  HG_CHECK(c.temperature >= 1e-3, "generate: temperature must be >= 1e-3, got {}", c.temperature);
  HG_CHECK(c.words >= 0, "generate: words must be >= 0, got {}", c.words);
  HG_CHECK(c.device.is_cpu() || cuda::is_available(), "generate: {} asked for, but no CUDA GPU is visible",
           c.device.str());
  models::LoadedLanguageModel lm = models::load_language_model(c.checkpoint, c.device);
  lm.model->eval();
  NoGradGuard no_grad;
  manual_seed(c.seed);  // after building the model, whose initialisation draws numbers too
  const int64_t vocab = lm.vocab.size();
  Tensor input = randint(0, vocab, {1, 1}).to(c.device);  // [T = 1, B = 1]
  Tensor h, cell;
  std::vector<std::string> words;
  for (int64_t i = 0; i < c.words; ++i) {
    auto out = lm.model->forward(input, h, cell);
    h = out.h;
    cell = out.c;
    const std::vector<float> p = to_vector<float>(softmax(out.logits.reshape({vocab}) / c.temperature, 0));
    const int64_t id = sample_index(p, next_uniform());
    HG_CHECK(id >= 0, "generate: '{}': the model's probabilities for word {} are not finite", c.checkpoint, i);
    input = full({1, 1}, id, {.dtype = kInt64, .device = c.device});
    words.push_back(lm.vocab.word(id));
    if (on_word) on_word(i, words.back());
  }
  return words;
}

std::string generated_text(const std::vector<std::string>& words) {
  std::string text;
  for (size_t i = 0; i < words.size(); ++i) text += words[i] + separator_after_word(int64_t(i));
  return text;
}

}  // namespace halfgrad::train

#pragma once
// The training loops of libhalfgrad, which the `halfgrad` commands (train-classifier, sweep-classifier, train-lm,
// generate, demo) are a thin layer on; a program of its own calls them the same way:
//
//   #include "train/loops.h"
//   train::ClassifierConfig c{.model = "resnet18", .data_dir = "cifar-10-batches-bin", .epochs = 30,
//                             .opt_level = amp::OptLevel::O1, .device = Device::cuda(), .channels_last = true};
//   train::train_classifier(c, [](const train::EpochStats& s) { fmt::print("{} {}\n", s.epoch, s.test_accuracy); });
//
// Training an image classifier on CIFAR-10/100 end to end, what `halfgrad train-classifier` runs: the data
// (data/cifar.h, data/loader.h), the model (models/), SGD with momentum and weight decay under a schedule, a
// mixed-precision level (optim/amp.h: O0 float32, O1 autocast, O2 half model with float32 masters, O3 pure half),
// and per-epoch figures: loss and accuracy on both splits, time, throughput, peak GPU memory, skipped steps.
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "core/tensor.h"
#include "data/loader.h"
#include "dist/process_group.h"
#include "models/language_model.h"
#include "optim/amp.h"
#include "optim/scheduler.h"

namespace halfgrad::train {

// Interruption (the CLI's SIGINT / SIGTERM handler calls request_stop(); it is async-signal-safe): the training
// loops finish the step under way, write their training checkpoint (when one is set) at that step, so that --resume
// continues there as if uninterrupted, and return what they have done. stop_requested() stays true until
// clear_stop().
void request_stop();
bool stop_requested();
void clear_stop();

// Data parallel: whether to stop after this step, the same answer on every rank of `group`, to be asked after every
// step. Every `interval` steps the ranks all-reduce their stop_requested() (4 bytes the host waits for), so a stop that
// reaches the ranks at different steps (Ctrl-C) ends them all after the same one; in between it answers false. One
// process (null group): stop_requested().
std::function<bool()> agreed_stop(dist::ProcessGroup* group, int64_t interval = 16);

// ---- Pieces of the loops, for loops of one's own

// A classifier's mean cross entropy and accuracy over one pass of a loader: the model in eval mode (left so), no
// gradients, the level's forward (amp.forward), each batch moved to `device` (and made channels_last when asked).
// The sums stay on the device until the end: one synchronisation. count: the images seen (0: loss and accuracy 0).
struct Evaluation {
  double loss = 0, accuracy = 0;
  int64_t count = 0;
};
Evaluation evaluate_classifier(nn::Module& model, data::ImageLoader& loader, amp::Amp& amp, Device device,
                               bool channels_last = false);

// main.py's evaluate(): a language model's mean cross entropy per token over a batchified split (data::batchify:
// [rows, batch] on the model's device), in windows of bptt rows with the recurrent state carried from window to
// window; eval mode (left so), no gradients, the level's forward.
double evaluate_language_model(models::LanguageModel& model, const Tensor& source, int64_t bptt, amp::Amp& amp);

// ---- One epoch's training: what train_classifier and train_language_model run for each epoch, for a loop of one's
// own that wants their steps, sums and progress reports but decides itself what happens between epochs.

// How far an epoch is, every log_interval batches (and every progress_seconds in between).
struct ClassifierProgress {
  int64_t epoch = 0, batch = 0, batches = 0;  // `batch` batches of the epoch's `batches` are done
  double lr = 0;                               // the first parameter group's, after the batch's scheduler step
  double loss = 0, accuracy = 0;               // over the interval's training batches (so far)
  double images_per_second = 0;                // over the interval, synchronized
  double eta_seconds = 0;                      // the epoch's remaining batches at the interval's rate
  bool interval_end = true;                    // false: a report within the interval (progress_seconds)
};

// A classifier's training step on one batch: the level's forward (amp.forward), the cross entropy under amp.loss,
// backward, the optimizer's step (loss scaling and all: amp.step) and zero_grad. Returns the batch's loss (0-d
// float32) and how many of its images the model classified right (0-d int64), both on the batch's device.
using ClassifierStep = std::function<std::pair<Tensor, Tensor>(const Tensor& images, const Tensor& labels)>;
ClassifierStep classifier_step(nn::Module& model, amp::Amp& amp);

// A classifier epoch's sums, on the device until read: the loss summed over its images, the images classified right,
// the images and batches done, and whether it stopped early (stop_requested(), after the step under way).
struct ClassifierEpochSums {
  Tensor loss_sum, correct;
  int64_t seen = 0, batches = 0;
  bool interrupted = false;
};

struct ClassifierEpochOptions {
  int64_t epoch = 0;                       // the loader's epoch (its shuffle and augmentation) and the reports'
  Device device = Device::cpu();           // where each batch goes
  bool channels_last = false;              // each batch's images made channels_last
  optim::LRScheduler* schedule = nullptr;  // stepped after every batch (none: the lr stays)
  ClassifierEpochSums start{};             // a resumed epoch's sums so far: its first `batches` batches are skipped
  int64_t log_interval = 0;                // on_progress after every this many batches (0: never)
  double progress_seconds = 0;             // also on_progress mid-interval once this long has passed (0: never)
  std::function<bool()> stop{};            // asked after each step instead of stop_requested() (data parallel: the
                                           // ranks' agreed answer, agreed_stop)
};

// One pass of `loader` in train mode, `step` per batch, then the schedule's step. No host synchronisation per batch:
// the sums stay on the device (a progress report reads its interval's, once). `optimizer`: the one the step updates,
// whose first group's lr the reports carry.
ClassifierEpochSums train_classifier_epoch(nn::Module& model, data::ImageLoader& loader, const ClassifierStep& step,
                                           optim::Optimizer& optimizer, const ClassifierEpochOptions& options = {},
                                           const std::function<void(const ClassifierProgress&)>& on_progress = {});

// What main.py prints every --log-interval batches, and how far the epoch is.
struct LanguageModelProgress {
  int64_t epoch = 0, batch = 0, batches = 0;  // `batch` batches of the epoch's `batches` are done
  double lr = 0;
  double loss = 0;              // mean cross-entropy per token over the interval's batches (perplexity = exp)
  double ms_per_batch = 0;      // over the interval, synchronized
  double tokens_per_second = 0;  // over the interval
  double eta_seconds = 0;        // the epoch's remaining batches at the interval's rate
  bool interval_end = true;      // false: a report within the interval (progress_seconds), its figures so far
};

// The recurrent state a language model carries from window to window (c: the LSTM's cells, else undefined; both
// undefined: zeros).
struct RecurrentState {
  Tensor h, c;
};

// A language model's training step on one window (truncated backpropagation through time, as main.py's train()):
// the forward from `state` (its history cut off), the loss under amp.loss, backward, clip_grad_norm at `clip`, the
// optimizer's step, zero_grad; `state` becomes the window's last state. Returns the window's mean loss (0-d float32).
using LanguageModelStep =
    std::function<Tensor(const Tensor& input, const Tensor& target, RecurrentState& state)>;
LanguageModelStep language_model_step(models::LanguageModel& model, amp::Amp& amp, double clip);

// A language-model epoch's sums: the loss summed over its tokens (0-d, on the device), the tokens and windows done,
// the state carried out of the last window, whether it stopped early (stop_requested()).
struct LanguageModelEpochSums {
  Tensor total;
  int64_t tokens = 0, batches = 0;
  RecurrentState state{};
  bool interrupted = false;
};

struct LanguageModelEpochOptions {
  int64_t epoch = 0;               // for the reports
  int64_t bptt = 35;               // the windows' rows
  LanguageModelEpochSums start{};  // where the epoch starts: its state (zeros at an epoch's start) and, resumed, its
                                   // sums so far (its first `batches` windows are skipped)
  int64_t log_interval = 0;        // on_progress after every this many windows (0: never)
  double progress_seconds = 0;     // also on_progress mid-interval once this long has passed (0: never)
  bool dry_run = false;            // one window only, as main.py's --dry-run
  std::function<bool()> stop{};    // asked after each window instead of stop_requested() (data parallel: agreed_stop)
};

// One pass over a batchified training split ([rows, batch], data::batchify, on the model's device) in windows of
// bptt rows in train mode, `step` per window, the state carried from each window into the next. `optimizer`: the one
// the step updates, whose first group's lr the reports carry.
LanguageModelEpochSums train_language_model_epoch(models::LanguageModel& model, const Tensor& train_data,
                                                  const LanguageModelStep& step, optim::Optimizer& optimizer,
                                                  const LanguageModelEpochOptions& options = {},
                                                  const std::function<void(const LanguageModelProgress&)>& on_progress = {});

struct ClassifierConfig {
  std::string model = "resnet18";  // resnet18/34/50/101/152, vgg11/13/16/19
  std::string dataset = "cifar10";  // cifar10 or cifar100 (official binary files in data_dir)
  std::filesystem::path data_dir{};
  int64_t epochs = 30;
  int64_t batch_size = 128;
  double lr = 0.1;  // the peak lr of the one-cycle schedule, the starting lr of the others
  double momentum = 0.9;
  double weight_decay = 5e-4;
  bool nesterov = false;  // Nesterov momentum (torch.optim.SGD's nesterov=True)
  std::string schedule = "onecycle";  // onecycle, cosine or constant
  // onecycle (PyTorch's OneCycleLR): lr rises from lr / div_factor to lr over the first pct_start of the steps, then
  // anneals; the momentum cycles the other way, 0.95 -> 0.85 -> 0.95, in place of `momentum`.
  double pct_start = 0.3, div_factor = 25;
  amp::OptLevel opt_level = amp::OptLevel::O0;
  DType half_dtype = kFloat16;
  Device device = Device::cpu();
  bool channels_last = false;  // feed NHWC batches (the layout tensor-core convolutions read)
  int workers = 4;
  uint64_t seed = 0;
  int64_t limit_train = 0, limit_test = 0;  // use only the first N images (0: all), for quick runs
  std::string train_checkpoint{};  // when set, a training checkpoint is written there after every epoch and on
                                   // request_stop() (for resume)
  // When set, a training checkpoint written by a run of the same settings (model, dataset, opt level and half dtype,
  // epochs, batch size, schedule and its options, lr, momentum, weight decay, nesterov, seed, training images, number
  // of ranks): the run continues where that one stopped (after its epoch, or within it for a checkpoint written on
  // request_stop()) with the model, optimizer, schedule, loss scaler, O2's float32 masters, random state and the
  // epoch's sums so far, and trains as the uninterrupted run would have, bit for bit. on_epoch and the result cover
  // the epochs finished here.
  std::string resume{};
  int64_t log_interval = 0;  // on_progress after every this many training batches (0: never)
  double progress_seconds = 0;  // also on_progress mid-interval once this long has passed since the last (0: never)
  // CUDA: the training step captured once as a CUDA graph (after two eager steps) and replayed, the batch copied into
  // its input buffers first; a last batch smaller than batch_size runs eagerly (core/cuda_graph.h).
  bool cuda_graph = false;
  // Data parallel (dist/data_parallel.h): this process is one rank of `group`, whose device() is `device`. It trains
  // on its shard of each epoch, batch_size images a step (the global batch is batch_size x the group's size), the
  // gradients averaged over the ranks and the loss scaler's overflow agreed on; it evaluates its slice of the test
  // split; the epoch's figures are the group's (images per second: all ranks'). Only rank 0 writes train_checkpoint,
  // at the end of each epoch (an interrupted epoch is trained again on --resume). Null: one process.
  std::shared_ptr<dist::ProcessGroup> group{};
  // Data parallel: every this many steps the ranks compare their parameters (nn::replica_mismatches, a copy of the
  // model to the host) and the run stops with an error naming those that differ. 0: never.
  int64_t check_replicas_every = 0;
  // An epoch whose test loss is not finite (the model diverged: NaN weights stay NaN) ends the run with an Error, once
  // on_epoch has seen it and before its weights overwrite train_checkpoint. False: train on (a sweep, whose rows
  // report a precision that diverges as one of its results).
  bool stop_when_diverged = true;
};

struct EpochStats {
  int64_t epoch = 0;
  double train_loss = 0, train_accuracy = 0, test_loss = 0, test_accuracy = 0;
  double seconds = 0;            // training part of the epoch, synchronized
  double images_per_second = 0;  // training images over those seconds
  int64_t peak_memory_bytes = 0;  // the CUDA allocator's peak during the epoch (0 on the CPU)
  int64_t skipped_steps = 0;      // optimizer steps skipped for overflow (dynamic loss scaling)
  double loss_scale = 1;          // at the end of the epoch (1 without loss scaling: O0, O3)
};

// Trains as configured and returns one EpochStats per epoch; on_epoch (if set) sees each as it is done, on_progress
// (if set) every log_interval batches and, with progress_seconds > 0, in between once that long has passed.
// Errors (an unknown model, a missing file, bad options) are halfgrad::Error naming what is wrong.
std::vector<EpochStats> train_classifier(const ClassifierConfig& config,
                                         const std::function<void(const EpochStats&)>& on_epoch = {},
                                         const std::function<void(const ClassifierProgress&)>& on_progress = {});

// A run's figures in its steady state: the epochs after the first (which includes cuDNN's autotuning), or the first
// when there is only one; `rate` (images or tokens per second) over their seconds, the most memory they used, and
// the steps skipped in every epoch. For EpochStats and LanguageModelEpochStats alike.
struct SteadyState {
  double seconds_per_epoch = 0, per_second = 0;
  int64_t peak_memory_bytes = 0, skipped_steps = 0;
};
template <typename Stats> SteadyState steady_state(const std::vector<Stats>& epochs, double Stats::*rate) {
  SteadyState s;
  const size_t from = epochs.size() > 1 ? 1 : 0;
  double seconds = 0, items = 0;
  for (size_t e = from; e < epochs.size(); ++e) {
    seconds += epochs[e].seconds;
    items += epochs[e].*rate * epochs[e].seconds;
    s.peak_memory_bytes = std::max(s.peak_memory_bytes, epochs[e].peak_memory_bytes);
  }
  for (const Stats& e : epochs) s.skipped_steps += e.skipped_steps;
  s.seconds_per_epoch = epochs.size() > from ? seconds / double(epochs.size() - from) : 0;
  s.per_second = seconds > 0 ? items / seconds : 0;
  return s;
}

// The benchmark sweep of the mixed-precision experiments: the same training run at each opt level (FP32 = O0,
// AMP = O1, O2 = half model with float32 masters, FP16 = O3) and batch size, one row each: time per epoch,
// throughput, peak GPU memory, final accuracy. A run that does not fit in GPU memory is a row saying so, which is
// how the largest batch size of each precision shows.
struct SweepRow {
  amp::OptLevel opt_level = amp::OptLevel::O0;
  int64_t batch_size = 0;
  bool out_of_memory = false;
  double seconds_per_epoch = 0;  // mean over the epochs after the first (which includes cuDNN's autotuning), or
                                 // the first when there is one epoch
  double images_per_second = 0;  // over the same epochs
  int64_t peak_memory_bytes = 0;  // the most of the same epochs: steady state, without the autotuning's workspaces
  double final_train_accuracy = 0, final_test_accuracy = 0, final_test_loss = 0;
  int64_t skipped_steps = 0;
};

// The precision's name in the experiments' tables: FP32, AMP, O2, FP16.
const char* precision_name(amp::OptLevel level);

// on_row sees each row as it is done; on_progress (with base.log_interval or base.progress_seconds > 0) each run's
// progress, with the row it is for (its opt level and batch size). A run that diverges trains all its epochs, and its
// row reports it (stop_when_diverged is off).
std::vector<SweepRow> sweep_classifier(
    const ClassifierConfig& base, const std::vector<amp::OptLevel>& levels, const std::vector<int64_t>& batch_sizes,
    const std::function<void(const SweepRow&)>& on_row = {},
    const std::function<void(const SweepRow&, const ClassifierProgress&)>& on_progress = {});

// A word-level language model on WikiText-2 (or any corpus in its format), what `halfgrad train-lm` runs, as
// pytorch/examples' word_language_model/main.py: batchified text, truncated backpropagation through time with the
// state carried (detached) from window to window, gradient clipping, plain SGD whose lr is divided by 4 whenever the
// validation loss does not improve; the same defaults. Perplexity = exp(loss).
struct LanguageModelConfig {
  std::string rnn = "lstm";  // rnn_tanh, rnn_relu, gru, lstm
  std::filesystem::path data_dir{};  // train.txt, valid.txt, test.txt; empty: the WikiText-2 halfgrad ships
  int64_t embedding_size = 200, hidden_size = 200, num_layers = 2;
  double dropout = 0.2;
  bool tie_weights = false;
  int64_t epochs = 40, batch_size = 20, eval_batch_size = 10, bptt = 35;
  double lr = 20, clip = 0.25;
  amp::OptLevel opt_level = amp::OptLevel::O0;
  DType half_dtype = kFloat16;
  Device device = Device::cpu();
  uint64_t seed = 1111;
  int64_t limit_tokens = 0;  // use only the first N tokens of each split (0: all), for quick runs
  std::string checkpoint{};  // when set, the model with the best validation loss is saved there, with its
                             // architecture and vocabulary (models/language_model_checkpoint.h)
  std::string train_checkpoint{};  // when set, a training checkpoint is written there after every epoch and on
                                   // request_stop() (for resume)
  // When set, a train_checkpoint written by a run of the same settings: the run continues where that one stopped
  // (after its epoch, or within it for a checkpoint written on request_stop(), with the recurrent state carried
  // into the next window) with the model, optimizer (its lr, annealed), loss scaler, O2's masters, random state,
  // the best validation loss and the best model, and trains as the uninterrupted run would have, bit for bit.
  // result.epochs covers the epochs finished here; the test loss is the best model's (0 when stopped).
  std::string resume{};
  int64_t log_interval = 0;  // on_progress after every this many training batches (0: never), as main.py's
  double progress_seconds = 0;  // also on_progress mid-interval once this long has passed since the last (0: never)
  bool dry_run = false;      // one training batch per epoch, as main.py's --dry-run: the code and the model run
  bool cuda_graph = false;   // CUDA: the training step captured once as a CUDA graph and replayed (core/cuda_graph.h)
  // Data parallel (dist/data_parallel.h): this process is one rank of `group`, whose device() is `device`. The
  // training split is batchified in batch_size x the group's size columns and each rank trains its batch_size of them
  // (so the run trains as one process with that many columns would), the gradients averaged over the ranks before
  // clipping; every rank evaluates, and rank 0's validation loss decides the lr for all. Only rank 0 writes
  // checkpoint and train_checkpoint, at the end of each epoch (an interrupted epoch is trained again on --resume).
  // Null: one process.
  std::shared_ptr<dist::ProcessGroup> group{};
  int64_t check_replicas_every = 0;  // as ClassifierConfig's
};

struct LanguageModelEpochStats {
  int64_t epoch = 0;
  double train_loss = 0, valid_loss = 0;  // mean cross-entropy per token (perplexity = exp)
  double lr = 0;                          // the lr the epoch trained with
  double seconds = 0, tokens_per_second = 0;
  int64_t peak_memory_bytes = 0, skipped_steps = 0;
  double loss_scale = 1;
};

struct LanguageModelResult {
  std::vector<LanguageModelEpochStats> epochs;
  double test_loss = 0;  // of the model with the best validation loss
};

LanguageModelResult train_language_model(const LanguageModelConfig& config,
                                         const std::function<void(const LanguageModelEpochStats&)>& on_epoch = {},
                                         const std::function<void(const LanguageModelProgress&)>& on_progress = {});

// Text sampled from a language model that train_language_model saved, what `halfgrad generate` runs, as
// pytorch/examples' word_language_model/generate.py: in eval mode and without autograd, the first input is a
// uniformly random word id, then each step feeds the last word and the recurrent state on, and draws the next word
// from softmax(logits / temperature). The draws come from halfgrad's generator (core/random.h) reseeded with
// `seed`: the start word from randint, each next word from one Philox block (53 bits, a uniform double in [0, 1))
// by inverse CDF over the probabilities copied to the host, so a seed gives the same words on every run and
// thread count (the CPU and CUDA logits may differ in the last bits, and so, rarely, the words). The numbers
// differ from torch.multinomial's, the distribution does not. generate.py exponentiates without subtracting the
// maximum, which overflows at low temperatures; softmax does not.
struct GenerateConfig {
  std::string checkpoint{};  // written by train_language_model (train-lm --save)
  int64_t words = 1000;    // how many to generate (>= 0)
  double temperature = 1.0;  // >= 1e-3, generate.py's limit; higher: more diverse
  uint64_t seed = 1111;
  Device device = Device::cpu();
};

// The generated words, in order; on_word (if set) sees each as it is drawn (index from 0), for streaming output and
// progress. Errors (the checkpoint, the settings) are halfgrad::Error naming what is wrong.
using OnWord = std::function<void(int64_t index, const std::string& word)>;
std::vector<std::string> generate_words(const GenerateConfig& config, const OnWord& on_word = {});

// What generate.py writes after word `index`: a newline after every 20th word, else a space.
inline char separator_after_word(int64_t index) { return index % 20 == 19 ? '\n' : ' '; }
// The words as generate.py writes them: each followed by separator_after_word.
std::string generated_text(const std::vector<std::string>& words);

}  // namespace halfgrad::train

#pragma once
// `halfgrad bench`: the measurements behind the experiments halfgrad reproduces, one JSON line per configuration.
//
//   suite       what it runs (each configuration: one model x precision x batch)
//   vgg         VGG16 x fp32, fp16, amp x batch 128, 256, 512, 1024, 2048 (the VGG16 benchmark)
//   resnet      ResNet-18, 34, 50, 101, 152 x fp32, amp, o2, bf16 at one batch (256; fastai's to_fp16)
//   lm          LSTM and GRU language models, 200x2 and 650x2, x fp32, amp at batch 20 (apex's --fp16 word LM)
//   max-batch   the largest batch of each ResNet x fp32, amp, o2, fp16 whose training step fits a memory budget
//   all         the four, in this order
//
// Precisions: fp32 (apex O0), amp (O1, float16), o2 (O2: half model, float32 masters), fp16 (O3), bf16 (O1 with
// bfloat16). Models: image classifiers by name (models/classifiers.h), language models as "<lstm|gru|rnn_tanh|
// rnn_relu>-<hidden>x<layers>" ("lstm-650x2"; embedding size = hidden size, dropout 0.2, 33,278 words).
//
// Data are synthetic and made once per configuration on the device: CIFAR-shaped standard-normal images with random
// labels, or random tokens [bptt, batch]. A step is what the training loops run (train/loops.cpp): forward, the loss
// under amp.loss, backward, (language models: clipping at 0.25 through amp.clip_grad_norm_), the optimizer step
// (SGD: momentum 0.9, weight decay 5e-4 for images; lr 20 for language models), zero_grad. Timed: `steps` steps after
// `warmup`, each between two CUDA events (the wall clock on the CPU); the line has their median and spread.
// Memory: the caching allocator's peaks (allocated and reserved) over the timed steps, after a first step.
// A configuration that runs out of memory is a line saying so ("out_of_memory": true), never the end of the run.
//
// Data parallel (Settings::group, set when `halfgrad launch` starts the bench: one process per GPU): vgg, resnet and lm
// time the step of nn::DistributedDataParallel around the model, `batch` a rank (so the line's throughput is the
// group's, world_size x batch a step), and the line adds "world_size", "global_batch", "replicas_agree" (the ranks'
// parameters equal bit for bit after the timed steps, nn::replica_mismatches; "replicas_differ" names those that are
// not) and "overlap": the medians of backward with the gradients' all-reduces ("backward_ms"), of
// backward under no_sync ("backward_no_sync_ms"), of the buckets' all-reduces alone ("all_reduce_ms"), and the share
// of the all-reduces that backward hid ("hidden": (no_sync + all_reduce - backward) / all_reduce, clamped to 0..1; the
// wrapper's own work, the gradients' copies into the buckets and back, counts against it: at one rank, where the
// all-reduce is a 0.03 ms copy, it reads 0).
// Rank 0 writes the lines; an out-of-memory ends the run (the ranks must stay in step). Not with max-batch, --epochs,
// --cuda-graph or --with-pytorch.
//
// Accuracy (Settings::epochs > 0): each configuration of vgg, resnet and lm trains instead, on real data, as the
// training commands do (train/loops.h): an image classifier `epochs` epochs on the CIFAR-10 files in data_dir with
// sweep-classifier's recipe (SGD, one-cycle lr 0.1, weight decay 5e-4, pad-4 crops and flips); a language model on
// WikiText-2 (data_dir, or the copy halfgrad ships) as train-lm does (lr 20 quartered when validation stalls, clipping
// 0.25). The line then has "dataset", "epochs", "seed", the final test accuracy (classifiers) or test perplexity
// (language models), seconds and images or tokens per second per epoch (the mean over the epochs after the first,
// which includes the autotuning) and the peak allocated memory. max-batch does not train.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/device.h"

namespace halfgrad::dist {
class ProcessGroup;
}

namespace halfgrad::bench {

const std::vector<std::string>& suite_names();      // vgg, resnet, lm, max-batch, all
const std::vector<std::string>& precision_names();  // fp32, amp, o2, fp16, bf16

struct Case {
  std::string suite;      // vgg, resnet, lm or max-batch
  std::string model;      // "vgg16", "resnet50", "lstm-650x2"
  std::string precision;  // one of precision_names()
  int64_t batch = 0;      // max-batch: where the search starts
};

struct Settings {
  Device device = Device::cuda();
  int warmup = 5, steps = 20;
  bool cuda_graph = false;     // replay the step as a CUDA graph after two eager ones (core/cuda_graph.h)
  bool channels_last = true;   // image batches in NHWC on CUDA (the layout the tensor-core convolutions read)
  int64_t vocab = 33278;       // language models: WikiText-2's vocabulary
  int64_t bptt = 35;
  size_t memory_budget = 0;    // max-batch: the allocator's limit while searching (0: the device's memory)
  int64_t max_batch = 65536;   // max-batch: the search's ceiling
  int64_t epochs = 0;          // > 0: train this many epochs on real data and report accuracy (above)
  std::string data_dir{};      // with epochs: the CIFAR-10 folder; for lm a WikiText-2 folder (empty: the shipped one)
  uint64_t seed = 0;           // with epochs: the runs' seed (initial weights, shuffling, augmentation, dropout)
  int workers = 4;             // with epochs: image loading threads
  std::shared_ptr<dist::ProcessGroup> group{};  // data parallel: this process is a rank of it (above); null: one process
};

// What a suite runs, in order. models / precisions / batches, when not empty, replace the suite's own lists (each
// entry must suit the suite: an image classifier for vgg, resnet and max-batch, a language model for lm).
std::vector<Case> suite_cases(const std::string& suite, const std::vector<std::string>& models = {},
                              const std::vector<std::string>& precisions = {}, const std::vector<int64_t>& batches = {});

// Runs one configuration and returns its JSON line: "framework": "halfgrad" (tools/bench_torch.py writes "pytorch"
// lines of the same form), the case, the settings, the environment (device, GPU, driver,
// CUDA, cuDNN, halfgrad's version and commit, the date), and
//   "ms": {"median", "min", "p10", "p90", "max"} of the timed steps, "images_per_second" or "tokens_per_second"
//   (from the median), "peak_allocated_bytes", "peak_reserved_bytes", "out_of_memory" (and "error" with the message);
//   max-batch: "max_batch" (0 when not even the first batch fits) and "memory_budget_bytes", no timing; "limited_by"
//              when a size limit other than memory ended the search (a kernel's largest tensor), with its message.
// Errors that are not out-of-memory (bad settings, a model that does not exist) are thrown, naming the case.
nlohmann::ordered_json run_case(const Case& c, const Settings& s);

// Runs every case, calling on_line with each line as it is done and on_progress before each ("[3/15] vgg16 amp
// batch 512"). Returns the lines.
std::vector<nlohmann::ordered_json> run_cases(const std::vector<Case>& cases, const Settings& s,
                                      const std::function<void(const nlohmann::ordered_json&)>& on_line = {},
                                      const std::function<void(size_t done, size_t total, const Case&)>& on_progress = {});

// "8GiB", "512MiB", "1.5GB", "4096" (bytes) -> bytes; anything else is an error naming the text.
size_t parse_bytes(const std::string& text);

}  // namespace halfgrad::bench

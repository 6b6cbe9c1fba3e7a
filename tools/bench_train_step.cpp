// bench_train_step: one whole training step of a CIFAR classifier (ResNet-18..152, VGG-11..19 with BatchNorm) on the
// GPU, per apex opt level and batch size, with the data already on the GPU: what the training loop costs without the
// data loader. A benchmark program, not a test: it prints a table. tools/bench_train_step_torch.py prints the same
// rows for PyTorch on the same GPU (eager, or torch.compile with --compile).
//
//   one step    logits = amp.forward(model, x); loss = amp.loss(cross_entropy(logits, y)); amp.backward(loss);
//               amp.step(); amp.zero_grad(), as train/loops.cpp; SGD with momentum 0.9 and weight decay 5e-4; random
//               inputs (standard normal) and labels, made once per row. --cuda-graph: the step captured after two
//               eager ones and replayed (cuda::CapturedStep, core/cuda_graph.h)
//   timing      CUDA events around each step, the median of --iters steps after --warmup (tools/bench_layers.h; the
//               first warm-up step autotunes cuDNN). "host ms" is the host's time to issue a step: when it is close to
//               "ms", the step is bound by the host, not the GPU
//   memory      the caching allocator's peak over the steps after the first (warm-up and timed)
//   tune s      the first step's wall time: mostly the convolutions' autotuning, in the first row to meet each problem
//               (choices are cached for the process)
//
//   bench_train_step [--model resnet18|...|vgg16] [--batch 128,512] [--opt-levels O0,O1,O2,O3] [--nchw]
//                    [--cuda-graph] [--unfused] [--no-bias-fold] [--no-conv-knobs]
//   --unfused   batch norm, the residual add and relu as separate ops (set_batch_norm_relu_fusion(false)): the step
//               before batch_norm_relu, to measure what the fusion saves in the same run
//   --no-bias-fold  a convolution's bias before batch norm added by an op of its own (set_batch_norm_input_bias_fold(
//               false)): an add forward and its gradient's sum backward, the passes the convolution's own bias made
//               before the fold, to measure what it saves (VGG; the ResNets' convolutions have no bias)
//   --no-conv-knobs  autotuning leaves the fastest cuDNN engine's knobs to the engine (set_conv_knob_search,
//               ops/conv.h: on by default): the step before the search, to measure what it saves in the same run
#include <CLI/CLI.hpp>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/cuda.h"
#include "core/cuda_allocator.h"
#include "core/cuda_graph.h"
#include "halfgrad.h"
#include "models/classifiers.h"
#include "optim/amp.h"
#include "optim/sgd.h"

#include "tools/bench_layers.h"
#include "tools/cli_checks.h"

using namespace halfgrad;

namespace {

struct Settings {
  std::string model = "resnet18";
  std::vector<int64_t> batches = {128, 512};
  std::vector<std::string> levels = {"O0", "O1", "O2", "O3"};
  bool nchw = false;
  bool cuda_graph = false;
  bool unfused = false;
  bool no_bias_fold = false;
  bool conv_knobs = ConvKnobSearch{}.enabled;
  int iters = 30, warmup = 5;
};

#if HALFGRAD_WITH_CUDA

int run(const Settings& s) {
  const Device gpu = Device::cuda(0);
  fmt::print("bench_train_step: halfgrad {} training step (CIFAR, 10 classes) on {}, {}, data on the GPU{}, median of "
             "{} steps after {} warm-up steps\n",
             s.model, cuda::device_name(0), s.nchw ? "NCHW" : "channels_last",
             std::string(s.cuda_graph ? ", the step replayed as a CUDA graph" : "") +
                 (s.unfused ? ", batch norm / add / relu unfused" : "") +
                 (s.no_bias_fold ? ", convolution biases added before batch norm" : "") +
                 (s.conv_knobs ? "" : ", cuDNN engines' knobs not searched"),
             s.iters, s.warmup);
  set_batch_norm_relu_fusion(!s.unfused);
  set_batch_norm_input_bias_fold(!s.no_bias_fold);
  set_conv_knob_search({.enabled = s.conv_knobs});
  fmt::print("{:<9} {:>6} {:<6} {:>9} {:>10} {:>9} {:>9} {:>7}\n", "model", "batch", "level", "ms", "images/s",
             "host ms", "peak MiB", "tune s");
  for (int64_t batch : s.batches) {
    for (const std::string& level_name : s.levels) {
      const amp::OptLevel level = amp::parse_opt_level(level_name);
      manual_seed(0);
      std::shared_ptr<nn::Module> model = models::image_classifier(s.model);
      model->to(gpu);
      if (!s.nchw) model->to(MemoryFormat::ChannelsLast);  // as the PyTorch script's model.to(memory_format=...)
      model->train();
      optim::SGD sgd(model->parameters(), {.lr = 0.01, .momentum = 0.9, .weight_decay = 5e-4});
      amp::Amp amp = amp::initialize(*model, sgd, level);
      Tensor x = randn({batch, 3, 32, 32}).to(gpu);
      if (!s.nchw) x = contiguous_channels_last(x);
      const Tensor y = randint(0, 10, {batch}).to(gpu);
      auto step = [&] {
        Tensor logits = amp.forward(*model, x);
        Tensor loss = amp.loss([&] { return cross_entropy(logits, y); });
        amp.backward(loss);
        amp.step();
        amp.zero_grad();
      };
      const auto first = std::chrono::steady_clock::now();
      step();  // autotuning and the first allocations stay out of the peak
      cuda::synchronize();
      const double tune_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - first).count();
      cuda::reset_peak(0);
      std::unique_ptr<cuda::CapturedStep> captured;
      if (s.cuda_graph) captured = std::make_unique<cuda::CapturedStep>(gpu, step, 2);
      auto timed_step = [&] {
        if (captured)
          (*captured)();
        else
          step();
      };
      const bench::StepTimes t = bench::time_steps(timed_step, s.warmup, s.iters);
      const double peak_mib = double(cuda::memory_stats(0).peak_allocated_bytes) / double(1 << 20);
      fmt::print("{:<9} {:>6} {:<6} {:>9.2f} {:>10.0f} {:>9.2f} {:>9.0f} {:>7.1f}\n", s.model, batch, level_name, t.ms,
                 double(batch) / (t.ms * 1e-3), t.host_ms, peak_mib, tune_s);
      std::fflush(stdout);
    }
  }
  return 0;
}

#endif  // HALFGRAD_WITH_CUDA

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{"one training step of a CIFAR classifier per opt level and batch size, data on the GPU (compare with "
               "tools/bench_train_step_torch.py)"};
  app.add_option("--model", s.model, "resnet18/34/50/101/152, vgg11/13/16/19")
      ->check(CLI::IsMember(models::image_classifier_names()));
  app.add_option("--batch", s.batches, "batch sizes")->delimiter(',')->check(cli::integer_in<int64_t>(1));
  app.add_option("--opt-levels", s.levels, "apex opt levels")->delimiter(',')->check(
      CLI::IsMember({"O0", "O1", "O2", "O3"}));
  app.add_flag("--nchw", s.nchw, "NCHW batches instead of channels_last");
  app.add_flag("--cuda-graph", s.cuda_graph, "capture the step after two eager ones and replay it");
  app.add_flag("--unfused", s.unfused, "batch norm, the residual add and relu as separate ops (the step before "
               "batch_norm_relu)");
  app.add_flag("--no-bias-fold", s.no_bias_fold, "a convolution's bias before batch norm added as its own op (the "
               "step before the fold)");
  app.add_flag("--conv-knobs,!--no-conv-knobs", s.conv_knobs,
               "whether autotuning also searches the knobs of the fastest cuDNN engine (default: on, as "
               "set_conv_knob_search's)");
  app.add_option("--iters", s.iters, "timed steps per row (the median is printed)")->check(cli::integer_in<int>(1));
  app.add_option("--warmup", s.warmup, "untimed steps before timing")->check(cli::integer_in<int>(0));
  CLI11_PARSE(app, argc, argv);
#if HALFGRAD_WITH_CUDA
  return bench::run_on_gpu("bench_train_step", [&] { return run(s); });
#else
  return bench::run_on_gpu("bench_train_step", [] { return 1; });
#endif
}

// bench_lm_step: one whole training step of the word language model of pytorch/examples' word_language_model
// (models::LanguageModel), per apex opt level, with the batch already on the device: what the language-model
// training loop (train/loops.cpp, `halfgrad train-lm`) costs without the data. A benchmark program, not a test: it
// prints a table. tools/bench_lm_step_torch.py prints the same rows for PyTorch on the same GPU.
//
//   model       embedding (emsize = nhid), --nlayers layers of LSTM / GRU / RNN, a linear decoder over --vocab words
//               (WikiText-2's 33,278 by default), dropout 0.2 (main.py's defaults), untied
//   one step    h, c detached from the previous step (main.py's repackage_hidden); out = model.features(tokens, h,
//               c) under the level (autocast for O1); loss = amp.loss(model.loss(features, targets)) in float32
//               (the decoder and cross_entropy as one op, ops/linear_cross_entropy.h);
//               amp.backward(loss); amp.clip_grad_norm_(0.25); amp.step() (optim::SGD, lr 20, no
//               momentum: p -= lr * grad, as main.py); amp.zero_grad(). As train/loops.cpp's train_language_model.
//   data        random int64 tokens [bptt, batch] and targets [bptt * batch] in [0, vocab), made once on the device
//   timing      --warmup steps, then per round --steps steps between two synchronisations, CUDA events around them
//               (on the CPU: the wall clock); ms = the round's time / steps, tokens/s = bptt * batch / ms. "host ms"
//               is the host's time to issue a step (the wall clock from the first event to the last step's return,
//               / steps): when it is close to "ms", the step is bound by the host, not the GPU. --repeats rounds,
//               each printed, then their median (ms, tokens/s and host ms medians of the rounds)
//   memory      the caching allocator's peak over the steps after the first (warm-up and timed); "-" on the CPU
//
//   bench_lm_step [--model lstm|gru|rnn_tanh|rnn_relu] [--nhid 200] [--nlayers 2] [--batch 20] [--bptt 35]
//                 [--vocab 33278] [--opt-levels O0,O1] [--warmup 5] [--steps 20] [--repeats 3] [--device cuda|cpu]
//                 [--rnn-loop fastest|persistent|steps] [--rnn-batch-groups N] [--tf32] [--cuda-graph]
//                 [--decoder-layout aligned|contiguous]
//   --rnn-batch-groups  the persistent kernels' groups of batch rows (ops/rnn.h's set_rnn_batch_groups; 0 chooses)
//   --cuda-graph  the step captured once as a CUDA graph and replayed (core/cuda_graph.h): the state is carried in
//                 place from step to step, as train/loops.cpp's train-lm --cuda-graph does
//   --decoder-layout  aligned (the default, as train-lm): the decoder weight laid out by LanguageModel::align_decoder;
//                 contiguous: as the model makes it, for measuring what the layout saves
//   bench_lm_step --device cpu            # the CPU target: defaults to a 32x32 LSTM (--nhid 32) at O0
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/cuda.h"
#include "core/cuda_allocator.h"
#include "core/cuda_graph.h"
#include "halfgrad.h"
#include "models/language_model.h"
#include "ops/rnn.h"
#include "optim/amp.h"
#include "optim/sgd.h"

#include "tools/bench_layers.h"
#include "tools/cli_checks.h"

#if HALFGRAD_WITH_CUDA
#include <cuda_runtime.h>
#endif

using namespace halfgrad;

namespace {

struct Settings {
  std::string model = "lstm";
  int64_t nhid = 200, nlayers = 2, batch = 20, bptt = 35, vocab = 33278;
  std::vector<std::string> levels = {"O0", "O1"};
  int warmup = 5, steps = 20, repeats = 3;
  std::string device = "cuda";
  double dropout = 0.2, lr = 20, clip = 0.25;
  std::string rnn_loop = "fastest";
  int rnn_batch_groups = 0;
  bool tf32 = false, cuda_graph = false;
  std::string decoder_layout = "aligned";
};

nn::RecurrentKind kind_of(const std::string& name) {
  if (name == "lstm") return nn::RecurrentKind::LSTM;
  if (name == "gru") return nn::RecurrentKind::GRU;
  if (name == "rnn_tanh") return nn::RecurrentKind::RNNTanh;
  return nn::RecurrentKind::RNNReLU;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Round {
  double ms = 0, host_ms = 0;  // per step
};

#if HALFGRAD_WITH_CUDA
template <typename Step> Round time_round_cuda(Step&& step, int steps) {
  auto check = [](cudaError_t status, const char* what) {
    HG_CHECK(status == cudaSuccess, "bench_lm_step: {} failed: {}", what, cudaGetErrorString(status));
  };
  const cudaStream_t stream = cuda::current_stream(0);
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  cuda::synchronize();
  check(cudaProfilerStart(), "cudaProfilerStart");
  const auto t0 = std::chrono::steady_clock::now();
  check(cudaEventRecord(start, stream), "cudaEventRecord");
  for (int i = 0; i < steps; ++i) step();
  check(cudaEventRecord(stop, stream), "cudaEventRecord");
  const double host = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  cuda::synchronize();
  check(cudaProfilerStop(), "cudaProfilerStop");
  float gpu = 0;
  check(cudaEventElapsedTime(&gpu, start, stop), "cudaEventElapsedTime");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return {double(gpu) / steps, host / steps};
}
#endif

template <typename Step> Round time_round_cpu(Step&& step, int steps) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) step();
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / steps;
  return {ms, ms};
}

int run(const Settings& s) {
  const bool on_gpu = s.device == "cuda";
  const Device device = on_gpu ? Device::cuda(0) : Device::cpu();
  const char* threads = std::getenv("OMP_NUM_THREADS");
  const std::string where = on_gpu ? cuda::device_name(0)
                                   : fmt::format("the CPU (OMP_NUM_THREADS={})", threads ? threads : "unset");
  const std::string name = fmt::format("{} {}x{}", s.model, s.nhid, s.nlayers);
  const std::string gpu_settings =
      on_gpu ? fmt::format(", time loops: {}, batch groups: {}, TF32 {}, decoder weight {}{}", s.rnn_loop,
                           s.rnn_batch_groups == 0 ? std::string("chosen") : std::to_string(s.rnn_batch_groups),
                           s.tf32 ? "on" : "off", s.decoder_layout,
                           s.cuda_graph ? ", the step replayed as a CUDA graph" : "")
             : "";
  fmt::print("bench_lm_step: halfgrad word language model training step ({}, emsize = nhid, vocab {}, dropout {}, "
             "bptt {}, SGD lr {}, clip {}{}) on {}, data on the device, {} round(s) of {} steps after {} warm-up "
             "steps\n",
             name, s.vocab, s.dropout, s.bptt, s.lr, s.clip, gpu_settings, where, s.repeats, s.steps, s.warmup);
  fmt::print("{:<14} {:>6} {:>5} {:<6} {:>6} {:>9} {:>10} {:>9} {:>9}\n", "model", "batch", "bptt", "level", "round",
             "ms", "tokens/s", "host ms", "peak MiB");
  const double tokens = double(s.bptt * s.batch);
  for (const std::string& level_name : s.levels) {
    const amp::OptLevel level = amp::parse_opt_level(level_name);
    manual_seed(0);
    models::LanguageModel model(s.vocab, {.kind = kind_of(s.model), .embedding_size = s.nhid, .hidden_size = s.nhid,
                                          .num_layers = s.nlayers, .dropout = s.dropout});
    model.to(device);
    if (s.decoder_layout == "aligned") model.align_decoder();
    model.train();
    optim::SGD sgd(model.parameters(), {.lr = s.lr});
    amp::Amp amp = amp::initialize(model, sgd, level);
    const Tensor input = randint(0, s.vocab, {s.bptt, s.batch}, {.dtype = kInt64, .device = device});
    const Tensor target = randint(0, s.vocab, {s.bptt * s.batch}, {.dtype = kInt64, .device = device});
    Tensor h, c;  // undefined: zeros on the first step
    auto step = [&] {
      if (h.defined()) h = h.detach();  // repackage_hidden
      if (c.defined()) c = c.detach();
      auto out = amp.run([&] { return model.features(input, h, c); });
      h = out.h;
      c = out.c;
      Tensor loss = amp.loss([&] { return model.loss(out.features, target); });
      amp.backward(loss);
      amp.clip_grad_norm_(s.clip);
      amp.step();
      amp.zero_grad();
    };
    step();  // the first allocations (and cuBLAS's set-up) stay out of the peak
    // --cuda-graph: the same step reading and writing the state in place, captured after two eager steps.
    Tensor h_carried = h.detach().clone(), c_carried = c.defined() ? c.detach().clone() : Tensor();
    auto carried_step = [&] {
      auto out = amp.run([&] { return model.features(input, h_carried, c_carried); });
      Tensor loss = amp.loss([&] { return model.loss(out.features, target); });
      amp.backward(loss);
      amp.clip_grad_norm_(s.clip);
      amp.step();
      amp.zero_grad();
      NoGradGuard no_grad;
      h_carried.copy_(out.h);
      if (c_carried.defined()) c_carried.copy_(out.c);
    };
    std::unique_ptr<cuda::CapturedStep> captured;
    if (s.cuda_graph) captured = std::make_unique<cuda::CapturedStep>(device, carried_step, 2);
    auto timed_step = [&] {
      if (captured)
        (*captured)();
      else
        step();
    };
    if (on_gpu) {
      cuda::synchronize();
      cuda::reset_peak(0);
    }
    for (int i = 0; i < s.warmup; ++i) timed_step();
    std::vector<double> ms, tps, host;
    auto row = [&](const std::string& round, double m, double t, double hm) {
      const std::string peak =
          on_gpu ? fmt::format("{:.0f}", double(cuda::memory_stats(0).peak_allocated_bytes) / double(1 << 20)) : "-";
      fmt::print("{:<14} {:>6} {:>5} {:<6} {:>6} {:>9.2f} {:>10.0f} {:>9.2f} {:>9}\n", name, s.batch, s.bptt,
                 level_name, round, m, t, hm, peak);
      std::fflush(stdout);
    };
    for (int r = 0; r < s.repeats; ++r) {
#if HALFGRAD_WITH_CUDA
      const Round t = on_gpu ? time_round_cuda(timed_step, s.steps) : time_round_cpu(timed_step, s.steps);
#else
      const Round t = time_round_cpu(timed_step, s.steps);
#endif
      ms.push_back(t.ms);
      tps.push_back(tokens / (t.ms * 1e-3));
      host.push_back(t.host_ms);
      row(std::to_string(r + 1), t.ms, tps.back(), t.host_ms);
    }
    row("median", median(ms), median(tps), median(host));
    if (const int64_t skipped = amp.scaler().skipped_steps(); skipped > 0)
      fmt::print("  ({} of the steps skipped by the loss scaler)\n", skipped);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{"one training step of the word language model per opt level, data on the device (compare with "
               "tools/bench_lm_step_torch.py)"};
  app.add_option("--model", s.model, "recurrent layer")->check(CLI::IsMember({"lstm", "gru", "rnn_tanh", "rnn_relu"}));
  app.add_option("--nhid", s.nhid, "hidden size per layer, and the embedding size (default 200; 32 on the CPU)")
      ->check(cli::integer_in<int64_t>(1));
  app.add_option("--nlayers", s.nlayers, "recurrent layers")->check(cli::integer_in<int64_t>(1));
  app.add_option("--batch", s.batch, "batch size")->check(cli::integer_in<int64_t>(1));
  app.add_option("--bptt", s.bptt, "sequence length")->check(cli::integer_in<int64_t>(1));
  app.add_option("--vocab", s.vocab, "vocabulary size (WikiText-2: 33278)")->check(cli::integer_in<int64_t>(1));
  app.add_option("--opt-levels", s.levels, "apex opt levels (default O0,O1; O0 on the CPU)")
      ->delimiter(',')
      ->check(CLI::IsMember({"O0", "O1", "O2", "O3"}));
  app.add_option("--warmup", s.warmup, "untimed steps before the rounds")->check(cli::integer_in<int>(0));
  app.add_option("--steps", s.steps, "timed steps per round")->check(cli::integer_in<int>(1));
  app.add_option("--repeats", s.repeats, "rounds (each printed, then the median)")->check(cli::integer_in<int>(1));
  app.add_option("--device", s.device, "cuda or cpu")->check(CLI::IsMember({"cuda", "cpu"}));
  app.add_option("--dropout", s.dropout, "dropout (main.py's default 0.2)")->check(cli::finite_in(0, 0.99));
  app.add_option("--rnn-loop", s.rnn_loop,
                 "CUDA: the recurrent layers' time loops as persistent kernels, as per-step cuBLAS and cell kernels "
                 "replayed as a graph, or the faster of the two per problem (the default; ops/rnn.h's RnnCudaLoop)")
      ->check(CLI::IsMember({"fastest", "persistent", "steps"}));
  app.add_option("--rnn-batch-groups", s.rnn_batch_groups,
                 "CUDA: the persistent kernels' groups of batch rows (0, the default, chooses; ops/rnn.h)")
      ->check(cli::integer_in<int>(0));
  app.add_flag("--tf32", s.tf32, "CUDA: float32 GEMMs on TF32 tensor cores (cuda::set_allow_tf32; off by default)");
  app.add_flag("--cuda-graph", s.cuda_graph, "CUDA: capture the step once as a CUDA graph and replay it");
  app.add_option("--decoder-layout", s.decoder_layout,
                 "CUDA: the decoder weight as train-lm lays it out (aligned: LanguageModel::align_decoder) or "
                 "contiguous (the padded copies it saves)")
      ->check(CLI::IsMember({"aligned", "contiguous"}));
  CLI11_PARSE(app, argc, argv);
  if (s.cuda_graph && s.device != "cuda") {
    fmt::print(stderr, "bench_lm_step: --cuda-graph needs --device cuda\n");
    return 1;
  }
  set_rnn_cuda_loop(s.rnn_loop == "persistent" ? RnnCudaLoop::Persistent
                    : s.rnn_loop == "steps"    ? RnnCudaLoop::Steps
                                               : RnnCudaLoop::Fastest);
  set_rnn_batch_groups(s.rnn_batch_groups);
  if (s.tf32) cuda::set_allow_tf32(true);
  if (s.device == "cpu") {
    if (app.count("--nhid") == 0) s.nhid = 32;
    if (app.count("--opt-levels") == 0) s.levels = {"O0"};
    try {
      return run(s);
    } catch (const Error& e) {
      fmt::print(stderr, "bench_lm_step: {}\n", e.what());
      return 1;
    }
  }
  return bench::run_on_gpu("bench_lm_step", [&] { return run(s); });
}

// `halfgrad bench` (tools/bench.h): the suites, one configuration's measurement, the largest batch under a budget.
#include "tools/bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <map>
#include <memory>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>

#if HALFGRAD_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "core/cuda.h"
#include "core/cuda_allocator.h"
#include "core/cuda_graph.h"
#include "core/version.h"
#include "dist/data_parallel.h"
#include "halfgrad.h"
#include "models/classifiers.h"
#include "models/language_model.h"
#include "optim/amp.h"
#include "optim/sgd.h"
#include "train/loops.h"

namespace halfgrad::bench {

using json = nlohmann::ordered_json;

const std::vector<std::string>& suite_names() {
  static const std::vector<std::string> names = {"vgg", "resnet", "lm", "max-batch", "all"};
  return names;
}

const std::vector<std::string>& precision_names() {
  static const std::vector<std::string> names = {"fp32", "amp", "o2", "fp16", "bf16"};
  return names;
}

namespace {

struct Precision {
  amp::OptLevel level;
  DType half;
};

Precision precision_of(const std::string& name) {
  if (name == "fp32") return {amp::OptLevel::O0, kFloat16};
  if (name == "amp") return {amp::OptLevel::O1, kFloat16};
  if (name == "o2") return {amp::OptLevel::O2, kFloat16};
  if (name == "fp16") return {amp::OptLevel::O3, kFloat16};
  if (name == "bf16") return {amp::OptLevel::O1, kBFloat16};
  HG_FAIL("bench: unknown precision \"{}\" ({})", name, fmt::join(precision_names(), ", "));
}

struct LanguageModelShape {
  std::string kind_name;  // "lstm", as train-lm's --model takes it
  nn::RecurrentKind kind = nn::RecurrentKind::LSTM;
  int64_t hidden = 0, layers = 0;
};

// "lstm-650x2" -> LSTM, 650, 2; nullopt for anything else.
std::optional<LanguageModelShape> language_model_shape(const std::string& name) {
  const size_t dash = name.find('-'), x = name.find('x', dash == std::string::npos ? 0 : dash);
  if (dash == std::string::npos || x == std::string::npos) return std::nullopt;
  const std::string kind = name.substr(0, dash), hidden = name.substr(dash + 1, x - dash - 1),
                    layers = name.substr(x + 1);
  auto number = [](const std::string& s) -> int64_t {
    if (s.empty() || s.size() > 6 || !std::all_of(s.begin(), s.end(), [](char ch) { return ch >= '0' && ch <= '9'; }))
      return 0;
    return std::stoll(s);
  };
  LanguageModelShape shape{.kind_name = kind, .hidden = number(hidden), .layers = number(layers)};
  if (kind == "lstm")
    shape.kind = nn::RecurrentKind::LSTM;
  else if (kind == "gru")
    shape.kind = nn::RecurrentKind::GRU;
  else if (kind == "rnn_tanh")
    shape.kind = nn::RecurrentKind::RNNTanh;
  else if (kind == "rnn_relu")
    shape.kind = nn::RecurrentKind::RNNReLU;
  else
    return std::nullopt;
  if (shape.hidden < 1 || shape.layers < 1) return std::nullopt;
  return shape;
}

bool is_classifier(const std::string& name) {
  const auto& names = models::image_classifier_names();
  return std::find(names.begin(), names.end(), name) != names.end();
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

// What a line says about where it was measured.
json environment(const Settings& s) {
  json e;
  e["device"] = s.device.str();
  e["gpu"] = s.device.is_cuda() ? cuda::device_name(s.device.index) : "";
  const cuda::Versions v = cuda::versions();
  e["driver"] = v.driver;
  e["cuda"] = v.runtime;
  e["cudnn"] = v.cudnn;
  e["halfgrad"] = version();
  e["commit"] = git_commit();
  e["date"] = utc_now();
  return e;
}

void synchronize(Device device) {
  if (device.is_cuda()) cuda::synchronize(device.index);
}

// The time of each of `steps` runs of `timed` after `warmup`: between two CUDA events on the device (runs are not
// synchronized one by one, so a run is timed by its kernels when the host keeps ahead and by the host when it does
// not), by the wall clock on the CPU. `before` and `after` (optional) run around each, untimed.
std::vector<double> time_each(const std::function<void()>& timed, const Settings& s,
                              const std::function<void()>& before = {}, const std::function<void()>& after = {}) {
  auto run = [&] {
    if (before) before();
    timed();
    if (after) after();
  };
  for (int i = 0; i < s.warmup; ++i) run();
  synchronize(s.device);
  std::vector<double> ms(size_t(s.steps));
#if HALFGRAD_WITH_CUDA
  if (s.device.is_cuda()) {
    auto check = [](cudaError_t status, const char* what) {
      HG_CHECK(status == cudaSuccess, "bench: {} failed: {}", what, cudaGetErrorString(status));
    };
    const cudaStream_t stream = cuda::current_stream(s.device);
    std::vector<cudaEvent_t> events(size_t(2 * s.steps));
    for (cudaEvent_t& e : events) check(cudaEventCreate(&e), "cudaEventCreate");
    for (int i = 0; i < s.steps; ++i) {
      if (before) before();
      check(cudaEventRecord(events[size_t(2 * i)], stream), "cudaEventRecord");
      timed();
      check(cudaEventRecord(events[size_t(2 * i + 1)], stream), "cudaEventRecord");
      if (after) after();
    }
    synchronize(s.device);
    for (int i = 0; i < s.steps; ++i) {
      float t = 0;
      check(cudaEventElapsedTime(&t, events[size_t(2 * i)], events[size_t(2 * i + 1)]), "cudaEventElapsedTime");
      ms[size_t(i)] = t;
    }
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    return ms;
  }
#endif
  for (int i = 0; i < s.steps; ++i) {
    if (before) before();
    const auto t0 = std::chrono::steady_clock::now();
    timed();
    ms[size_t(i)] = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (after) after();
  }
  return ms;
}

json spread(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  auto at = [&](double q) { return ms[size_t(std::lround(q * double(ms.size() - 1)))]; };
  return {{"median", at(0.5)}, {"min", ms.front()}, {"p10", at(0.1)}, {"p90", at(0.9)}, {"max", ms.back()}};
}

// A training step on synthetic data in its three parts, with everything they need alive as long as it is. The step:
// backward(forward()), then update() (clipping, the optimizer step, zero_grad, the recurrent state carried on).
struct Workload {
  std::function<Tensor()> forward;                  // the loss
  std::function<void(const Tensor&)> backward;
  std::function<void()> update;
  std::function<void()> zero_grad;
  double items = 0;          // images or tokens a step (this rank's)
  const char* unit = "";     // "images_per_second" or "tokens_per_second"
  std::shared_ptr<nn::DistributedDataParallel> ddp;  // data parallel: the wrapper whose hooks reduce the gradients
  std::shared_ptr<nn::Module> model;                 // what replica_mismatches compares
  std::shared_ptr<void> owner;

  void step() const {
    backward(forward());
    update();
  }
};

// Data parallel: rank 0's weights on every rank, before O2 copies them into its float32 masters.
void broadcast_weights(const Settings& s, nn::Module& model) {
  if (s.group) nn::broadcast_from_rank0(*s.group, model);
}

// Data parallel: the wrapper (after amp::initialize, so that it holds the tensors the level trains: O2's half model;
// gradients as bucket views, which the steps set to none each time, as the training loops do) and the loss scaler's
// overflow agreed on by the ranks; null for one process.
std::shared_ptr<nn::DistributedDataParallel> wrap(const Settings& s, const std::shared_ptr<nn::Module>& model,
                                                  amp::Amp& amp) {
  if (!s.group) return nullptr;
  amp.scaler().set_process_group(s.group);
  return std::make_shared<nn::DistributedDataParallel>(
      model, s.group, nn::DistributedDataParallelOptions{.gradient_as_bucket_view = true});
}

Workload classifier_workload(const Case& c, const Settings& s, int64_t batch) {
  struct State {
    std::shared_ptr<nn::Module> model;
    std::unique_ptr<optim::SGD> sgd;
    std::unique_ptr<amp::Amp> amp;
    Tensor x, y;
  };
  auto st = std::make_shared<State>();
  const Precision p = precision_of(c.precision);
  manual_seed(0);
  st->model = models::image_classifier(c.model);
  st->model->to(s.device);
  const bool channels_last = s.channels_last && s.device.is_cuda();
  if (channels_last) st->model->to(MemoryFormat::ChannelsLast);  // as the PyTorch side's model.to(memory_format=...)
  st->model->train();
  broadcast_weights(s, *st->model);
  st->sgd = std::make_unique<optim::SGD>(st->model->parameters(),
                                         optim::SGDOptions{.lr = 0.01, .momentum = 0.9, .weight_decay = 5e-4});
  st->amp = std::make_unique<amp::Amp>(amp::initialize(*st->model, *st->sgd, p.level, {.half_dtype = p.half}));
  const int rank = s.group ? s.group->rank() : 0;
  manual_seed(uint64_t(1 + rank));  // each rank its own batch
  st->x = randn({batch, 3, 32, 32}, {.device = s.device});
  if (channels_last) st->x = contiguous_channels_last(st->x);
  st->y = randint(0, 10, {batch}, {.dtype = kInt64, .device = s.device});
  Workload w;
  w.items = double(batch), w.unit = "images_per_second";
  w.ddp = wrap(s, st->model, *st->amp), w.model = st->model, w.owner = st;
  State* raw = st.get();
  nn::Module* trained = w.ddp ? static_cast<nn::Module*>(w.ddp.get()) : st->model.get();
  w.forward = [raw, trained] {
    Tensor logits = raw->amp->forward(*trained, raw->x);
    return raw->amp->loss([&] { return cross_entropy(logits, raw->y); });
  };
  w.backward = [raw](const Tensor& loss) { raw->amp->backward(loss); };
  w.update = [raw] {
    raw->amp->step();
    raw->amp->zero_grad();
  };
  w.zero_grad = [raw] { raw->amp->zero_grad(); };
  return w;
}

Workload language_model_workload(const Case& c, const Settings& s, int64_t batch) {
  const std::optional<LanguageModelShape> shape = language_model_shape(c.model);
  HG_CHECK(shape.has_value(), "bench: \"{}\" is not a language model (\"lstm-650x2\": lstm, gru, rnn_tanh or rnn_relu, "
           "hidden size x layers)", c.model);
  struct State {
    std::shared_ptr<models::LanguageModel> model;
    std::unique_ptr<optim::SGD> sgd;
    std::unique_ptr<amp::Amp> amp;
    Tensor input, target, h, cell, next_h, next_cell;
  };
  auto st = std::make_shared<State>();
  const Precision p = precision_of(c.precision);
  manual_seed(0);
  st->model = std::make_shared<models::LanguageModel>(
      s.vocab, models::LanguageModelOptions{.kind = shape->kind, .embedding_size = shape->hidden,
                                            .hidden_size = shape->hidden, .num_layers = shape->layers});
  st->model->to(s.device);
  st->model->align_decoder();
  st->model->train();
  broadcast_weights(s, *st->model);
  st->sgd = std::make_unique<optim::SGD>(st->model->parameters(), optim::SGDOptions{.lr = 20});
  st->amp = std::make_unique<amp::Amp>(amp::initialize(*st->model, *st->sgd, p.level, {.half_dtype = p.half}));
  const int rank = s.group ? s.group->rank() : 0;
  manual_seed(uint64_t(1 + rank));  // each rank its own tokens
  st->input = randint(0, s.vocab, {s.bptt, batch}, {.dtype = kInt64, .device = s.device});
  st->target = randint(0, s.vocab, {s.bptt * batch}, {.dtype = kInt64, .device = s.device});
  st->h = zeros({shape->layers, batch, shape->hidden}, {.device = s.device});
  if (shape->kind == nn::RecurrentKind::LSTM) st->cell = zeros({shape->layers, batch, shape->hidden}, {.device = s.device});
  // The wrapper's hooks reduce the gradients; the steps call the model's own features (it takes the recurrent state),
  // as train-lm does.
  Workload w;
  w.items = double(s.bptt * batch), w.unit = "tokens_per_second";
  w.ddp = wrap(s, st->model, *st->amp), w.model = st->model, w.owner = st;
  State* raw = st.get();
  w.forward = [raw] {
    auto out = raw->amp->run([&] { return raw->model->features(raw->input, raw->h, raw->cell); });
    raw->next_h = out.h, raw->next_cell = out.c;
    return raw->amp->loss([&] { return raw->model->loss(out.features, raw->target); });
  };
  w.backward = [raw](const Tensor& loss) { raw->amp->backward(loss); };
  // The state carried in place from step to step (as train-lm --cuda-graph does), detached by NoGradGuard's copy.
  w.update = [raw] {
    raw->amp->clip_grad_norm_(0.25);
    raw->amp->step();
    raw->amp->zero_grad();
    NoGradGuard no_grad;
    raw->h.copy_(raw->next_h);
    if (raw->cell.defined()) raw->cell.copy_(raw->next_cell);
  };
  w.zero_grad = [raw] { raw->amp->zero_grad(); };
  return w;
}

Workload workload(const Case& c, const Settings& s, int64_t batch) {
  return c.suite == "lm" ? language_model_workload(c, s, batch) : classifier_workload(c, s, batch);
}

double median_of(std::vector<double> ms) { return spread(std::move(ms))["median"].get<double>(); }

// Data parallel: how much of the gradients' communication backward hides, and whether the ranks still agree (the
// figures tools/bench.h lists). No optimizer step runs here, so the replicas stay as the timed steps left them.
void measure_data_parallel(const Workload& w, const Settings& s, json& line) {
  line["replicas_agree"] = true;
  const std::vector<std::string> differ = nn::replica_mismatches(*s.group, *w.model);
  if (!differ.empty()) line["replicas_agree"] = false, line["replicas_differ"] = differ;

  Tensor loss;
  auto forward = [&] { loss = w.forward(); };
  auto backward = [&] { w.backward(loss); };
  const double with_communication = median_of(time_each(backward, s, forward, w.zero_grad));
  const double without = median_of(time_each(
      [&] {
        auto no_sync = w.ddp->no_sync();
        w.backward(loss);
      },
      s, forward, w.zero_grad));
  // The buckets' all-reduces alone, on tensors of the buckets' sizes and dtypes.
  std::map<std::string, Tensor> parameters;
  for (auto& [name, p] : w.ddp->module().named_parameters()) parameters[name] = p;
  std::vector<Tensor> buckets;
  for (const auto& names : w.ddp->bucket_parameter_names()) {
    int64_t numel = 0;
    for (const std::string& name : names) numel += parameters.at(name).numel();
    const Tensor& first = parameters.at(names.front());
    buckets.push_back(randn({numel}, {.device = s.device}).to(first.dtype()));
  }
  const double all_reduce = median_of(time_each(
      [&] {
        std::vector<std::shared_ptr<dist::Work>> works;
        for (Tensor& b : buckets) works.push_back(s.group->all_reduce(b));
        for (auto& work : works) work->wait();
      },
      s));
  const double hidden = all_reduce > 0 ? (without + all_reduce - with_communication) / all_reduce : 1.0;
  line["overlap"] = {{"backward_ms", with_communication}, {"backward_no_sync_ms", without},
                     {"all_reduce_ms", all_reduce}, {"hidden", std::clamp(hidden, 0.0, 1.0)},
                     {"buckets", buckets.size()}};
}

void measure(const Case& c, const Settings& s, json& line) {
  Workload w = workload(c, s, c.batch);
  w.step();  // the first allocations and cuDNN's autotuning stay out of the figures
  synchronize(s.device);
  if (s.device.is_cuda()) {  // the autotuning's workspaces too: the reserved figure is the steps'
    cuda::empty_cache();
    cuda::reset_peak(s.device.index);
  }
  std::unique_ptr<cuda::CapturedStep> captured;
  if (s.cuda_graph) captured = std::make_unique<cuda::CapturedStep>(s.device, [&] { w.step(); }, 2);
  const std::vector<double> ms = time_each(captured ? std::function<void()>([&] { (*captured)(); })
                                                    : std::function<void()>([&] { w.step(); }),
                                           s);
  const int ranks = s.group ? s.group->size() : 1;
  line["ms"] = spread(ms);
  line[w.unit] = w.items * ranks / (line["ms"]["median"].get<double>() * 1e-3);
  if (s.device.is_cuda()) {
    const cuda::MemoryStats m = cuda::memory_stats(s.device.index);
    line["peak_allocated_bytes"] = m.peak_allocated_bytes;
    line["peak_reserved_bytes"] = m.peak_reserved_bytes;
  }
  if (s.group) measure_data_parallel(w, s, line);
}

// Whether two training steps at `batch` fit; the step's tensors are gone when it returns. Out of memory: no. Another
// error after a smaller batch ran (`smaller_fit`) is a size limit of the implementation, not of memory (cuDNN's
// convolutions take at most 2^31 - 1 elements a tensor): no, and `limit` keeps the message; otherwise it goes on.
bool fits(const Case& c, const Settings& s, int64_t batch, bool smaller_fit, std::string& limit) {
  try {
    Workload w = workload(c, s, batch);
    w.step();
    w.step();
    synchronize(s.device);
    return true;
  } catch (const OutOfMemory&) {
    return false;
  } catch (const Error& e) {
    if (!smaller_fit) throw;
    limit = e.what();
    return false;
  }
}

// The largest batch whose steps fit under the budget: doubling from c.batch until one does not fit (or the ceiling),
// then bisection to within 1%. The budget is the allocator's limit while searching; the old limit, an empty cache and
// reset peaks afterwards.
void search_max_batch(const Case& c, const Settings& s, json& line) {
  HG_CHECK(s.device.is_cuda(), "bench max-batch: the search needs a CUDA device (memory budgets are the CUDA "
           "allocator's), got {}", s.device.str());
  const size_t previous = cuda::memory_limit(s.device.index);
  const bool previous_benchmark = conv_benchmark();
  const size_t budget = s.memory_budget ? s.memory_budget : cuda::device_memory(s.device.index);
  cuda::empty_cache();
  cuda::set_memory_limit(budget, s.device.index);
  set_conv_benchmark(false);  // every probe is a new batch size: autotuning each would take seconds per probe
  int64_t probes = 0;
  int64_t good = 0, bad = 0;  // the largest batch known to fit, the smallest known not to (0: none yet)
  std::string limit;          // a size limit other than memory that ended the search (empty: none met)
  auto probe = [&](int64_t batch) {
    ++probes;
    const bool ok = fits(c, s, batch, good > 0, limit);
    cuda::empty_cache();
    return ok;
  };
  try {
    for (int64_t b = std::max<int64_t>(1, c.batch); b <= s.max_batch; b *= 2) {
      if (!probe(b)) {
        bad = b;
        break;
      }
      good = b;
    }
    if (bad == 0) bad = s.max_batch + 1;
    while (bad - good > std::max<int64_t>(1, good / 100)) {
      const int64_t mid = good + (bad - good) / 2;
      (probe(mid) ? good : bad) = mid;
    }
  } catch (...) {
    cuda::set_memory_limit(previous, s.device.index);
    set_conv_benchmark(previous_benchmark);
    throw;
  }
  cuda::set_memory_limit(previous, s.device.index);
  set_conv_benchmark(previous_benchmark);
  cuda::reset_peak(s.device.index);
  line["max_batch"] = good;
  line["memory_budget_bytes"] = budget;
  line["probes"] = probes;
  line["reached_ceiling"] = good == s.max_batch;
  if (!limit.empty()) line["limited_by"] = limit;
}

// The line's "dataset": synthetic batches when timing steps; trained, CIFAR-10 for the classifiers, and for a
// language model WikiText-2 unless data_dir names another corpus (the line then gives the folder).
const char* dataset_of(const Case& c, const Settings& s) {
  if (s.epochs == 0) return "synthetic";
  if (c.suite != "lm") return "cifar10";
  return s.data_dir.empty() ? "wikitext-2" : "text";
}

// What the settings allow for a case, checked before any case of a run starts.
void check_case(const Case& c, const Settings& s) {
  HG_CHECK(s.epochs >= 0, "bench: epochs must be >= 0, got {}", s.epochs);
  if (s.epochs > 0) {
    HG_CHECK(c.suite != "max-batch", "bench max-batch: the search does not train (--epochs applies to vgg, resnet "
             "and lm, each named on its own: `bench all` includes max-batch)");
    HG_CHECK(c.suite == "lm" || !s.data_dir.empty(), "bench {}: --epochs trains on the CIFAR-10 files: give their "
             "folder with --data-dir", c.suite);
  }
  HG_CHECK(c.suite != "max-batch" || s.device.is_cuda(), "bench max-batch: the search needs a CUDA device (memory "
           "budgets are the CUDA allocator's), got {}", s.device.str());
  if (s.group) {
    HG_CHECK(c.suite != "max-batch" && s.epochs == 0, "bench {}: under halfgrad launch the suites time data-parallel "
             "steps; {} runs one process (leave out launch)", c.suite, c.suite == "max-batch" ? "max-batch" : "--epochs");
    HG_CHECK(!s.cuda_graph, "bench {}: --cuda-graph is not available with data parallelism yet (the gradients' "
             "all-reduces are launched from the host during backward)", c.suite);
    HG_CHECK(s.group->device() == s.device, "bench {}: the steps run on {}, but the {} group's collectives take "
             "tensors on {}", c.suite, s.device.str(), s.group->backend(), s.group->device().str());
  }
}

// Accuracy: the classifier trained as sweep-classifier trains it, one row.
void train_classifier_case(const Case& c, const Settings& s, json& line) {
  const Precision p = precision_of(c.precision);
  const train::ClassifierConfig config{.model = c.model, .data_dir = s.data_dir, .epochs = s.epochs,
                                       .batch_size = c.batch, .half_dtype = p.half, .device = s.device,
                                       .channels_last = s.channels_last && s.device.is_cuda(), .workers = s.workers,
                                       .seed = s.seed, .cuda_graph = s.cuda_graph};
  const train::SweepRow row = train::sweep_classifier(config, {p.level}, {c.batch}).at(0);
  if (row.out_of_memory) {
    line["out_of_memory"] = true;
    return;
  }
  line["final_test_accuracy"] = row.final_test_accuracy;
  line["final_test_loss"] = row.final_test_loss;
  line["final_train_accuracy"] = row.final_train_accuracy;
  line["seconds_per_epoch"] = row.seconds_per_epoch;
  line["images_per_second"] = row.images_per_second;
  if (s.device.is_cuda()) line["peak_allocated_bytes"] = row.peak_memory_bytes;
  line["skipped_steps"] = row.skipped_steps;
}

// Accuracy: the language model trained as train-lm trains it.
void train_language_model_case(const Case& c, const Settings& s, json& line) {
  const std::optional<LanguageModelShape> shape = language_model_shape(c.model);
  HG_CHECK(shape.has_value(), "bench: \"{}\" is not a language model", c.model);
  const Precision p = precision_of(c.precision);
  const train::LanguageModelConfig config{.rnn = shape->kind_name, .data_dir = s.data_dir,
                                          .embedding_size = shape->hidden, .hidden_size = shape->hidden,
                                          .num_layers = shape->layers, .epochs = s.epochs, .batch_size = c.batch,
                                          .bptt = s.bptt, .opt_level = p.level, .half_dtype = p.half,
                                          .device = s.device, .seed = s.seed, .cuda_graph = s.cuda_graph};
  const train::LanguageModelResult result = train::train_language_model(config);
  const train::SteadyState steady =
      train::steady_state(result.epochs, &train::LanguageModelEpochStats::tokens_per_second);
  line["test_perplexity"] = std::exp(result.test_loss);
  line["final_valid_perplexity"] = std::exp(result.epochs.back().valid_loss);
  line["seconds_per_epoch"] = steady.seconds_per_epoch;
  line["tokens_per_second"] = steady.per_second;
  if (s.device.is_cuda()) line["peak_allocated_bytes"] = steady.peak_memory_bytes;
  line["skipped_steps"] = steady.skipped_steps;
}

}  // namespace

std::vector<Case> suite_cases(const std::string& suite, const std::vector<std::string>& models,
                              const std::vector<std::string>& precisions, const std::vector<int64_t>& batches) {
  if (suite == "all") {
    std::vector<Case> all;
    for (const char* one : {"vgg", "resnet", "lm", "max-batch"}) {
      const std::vector<Case> part = suite_cases(one, models, precisions, batches);
      all.insert(all.end(), part.begin(), part.end());
    }
    return all;
  }
  std::vector<std::string> m, p;
  std::vector<int64_t> b;
  if (suite == "vgg") {
    m = {"vgg16"}, p = {"fp32", "fp16", "amp"}, b = {128, 256, 512, 1024, 2048};
  } else if (suite == "resnet") {
    m = {"resnet18", "resnet34", "resnet50", "resnet101", "resnet152"}, p = {"fp32", "amp", "o2", "bf16"}, b = {256};
  } else if (suite == "lm") {
    m = {"lstm-200x2", "lstm-650x2", "gru-200x2", "gru-650x2"}, p = {"fp32", "amp"}, b = {20};
  } else if (suite == "max-batch") {
    m = {"resnet18", "resnet34", "resnet50", "resnet101", "resnet152"}, p = {"fp32", "amp", "o2", "fp16"}, b = {64};
  } else {
    HG_FAIL("bench: unknown suite \"{}\" ({})", suite, fmt::join(suite_names(), ", "));
  }
  if (!models.empty()) m = models;
  if (!precisions.empty()) p = precisions;
  if (!batches.empty()) b = batches;
  for (const std::string& model : m) {
    if (suite == "lm")
      HG_CHECK(language_model_shape(model).has_value(), "bench lm: \"{}\" is not a language model (\"lstm-650x2\": "
               "lstm, gru, rnn_tanh or rnn_relu, hidden size x layers)", model);
    else
      HG_CHECK(is_classifier(model), "bench {}: \"{}\" is not an image classifier ({})", suite, model,
               fmt::join(models::image_classifier_names(), ", "));
  }
  for (const std::string& precision : p) precision_of(precision);
  for (int64_t batch : b) HG_CHECK(batch >= 1, "bench {}: a batch must be >= 1, got {}", suite, batch);
  std::vector<Case> cases;
  for (const std::string& model : m)
    for (const std::string& precision : p)
      for (int64_t batch : b) cases.push_back({suite, model, precision, batch});
  return cases;
}

json run_case(const Case& c, const Settings& s) {
  HG_CHECK(s.steps >= 1 && s.warmup >= 0, "bench: steps must be >= 1 and warmup >= 0, got {} and {}", s.steps,
           s.warmup);
  HG_CHECK(!s.cuda_graph || s.device.is_cuda(), "bench: --cuda-graph needs a CUDA device, got {}", s.device.str());
  check_case(c, s);
  const bool trains = s.epochs > 0;
  json line = {{"framework", "halfgrad"}, {"suite", c.suite}, {"model", c.model}, {"precision", c.precision},
               {"batch", c.batch}, {"dataset", dataset_of(c, s)}};
  line.update(environment(s));
  line["cuda_graph"] = s.cuda_graph;
  if (s.group) line["world_size"] = s.group->size(), line["global_batch"] = c.batch * s.group->size();
  line["out_of_memory"] = false;
  if (trains) {
    line["data_dir"] = s.data_dir;
    line["epochs"] = s.epochs;
    line["seed"] = s.seed;
    if (c.suite == "lm") line["bptt"] = s.bptt;
  } else if (c.suite != "max-batch") {
    line["warmup"] = s.warmup;
    line["steps"] = s.steps;
    if (c.suite == "lm") line["bptt"] = s.bptt;
  }
  try {
    if (c.suite == "max-batch")
      search_max_batch(c, s, line);
    else if (trains)
      c.suite == "lm" ? train_language_model_case(c, s, line) : train_classifier_case(c, s, line);
    else
      measure(c, s, line);
  } catch (const OutOfMemory& e) {
    // Data parallel: the ranks' collectives would no longer line up if one went on alone, so the run ends.
    if (s.group) throw;
    line["out_of_memory"] = true;
    line["error"] = e.what();
  }
  if (s.device.is_cuda()) cuda::empty_cache();  // the next configuration starts from an empty cache
  return line;
}

std::vector<json> run_cases(const std::vector<Case>& cases, const Settings& s,
                            const std::function<void(const json&)>& on_line,
                            const std::function<void(size_t, size_t, const Case&)>& on_progress) {
  for (const Case& c : cases) check_case(c, s);  // before anything runs, not after an hour of the other suites
  std::vector<json> lines;
  for (size_t i = 0; i < cases.size(); ++i) {
    if (on_progress) on_progress(i, cases.size(), cases[i]);
    lines.push_back(run_case(cases[i], s));
    if (on_line) on_line(lines.back());
  }
  return lines;
}

size_t parse_bytes(const std::string& text) {
  size_t end = 0;
  double value = 0;
  try {
    value = std::stod(text, &end);
  } catch (const std::exception&) {
    HG_FAIL("bench: \"{}\" is not a size (say 8GiB, 512MiB, 1.5GB or a number of bytes)", text);
  }
  const std::string unit = text.substr(end);
  double scale = 0;
  for (auto [name, factor] : std::initializer_list<std::pair<const char*, double>>{
           {"", 1}, {"B", 1}, {"KiB", 0x1p10}, {"MiB", 0x1p20}, {"GiB", 0x1p30}, {"TiB", 0x1p40},
           {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12}})
    if (unit == name) scale = factor;
  // Decimal only (std::stod also reads hex, "0x1p30"), and a byte count an int64 holds.
  HG_CHECK(scale != 0 && value >= 0 && std::isfinite(value) && value * scale < 0x1p63 &&
               text.find_first_of("xX") == std::string::npos,
           "bench: \"{}\" is not a size (say 8GiB, 512MiB, 1.5GB or a number of bytes)", text);
  return size_t(std::llround(value * scale));
}

}  // namespace halfgrad::bench

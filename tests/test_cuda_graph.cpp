// Whole-step CUDA graphs (core/cuda_graph.h): a replayed training step equals the eager one step after step, draws
// new dropout masks every replay, skips overflowing steps on the device, follows a scheduler's learning rate, waits
// for the GPU nowhere, and a capture that cannot work says why.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>

#include "halfgrad.h"
#include "optim/adam.h"
#include "optim/amp.h"
#include "optim/clip_grad.h"
#include "optim/sgd.h"
#include "tests/testing.h"

#if HALFGRAD_WITH_CUDA
#include <cuda_runtime.h>

#include "core/graph_memsets.h"
#endif

using namespace halfgrad;

namespace {

// A small word language model trained on fixed random tokens, the state carried in place from step to step, as
// `halfgrad train-lm --cuda-graph` runs it. Returns the parameters after `steps` steps and the scaler's skips.
struct LmRun {
  std::vector<Tensor> params;
  int64_t skipped = 0;
  double scale = 0;
};

// How the step clips: PyTorch's way (unscale_, then clip_grad_norm_), or amp.clip_grad_norm_ (unscaled and clipped
// as SGD's kernel reads the gradients), as train-lm does.
enum class Clipping { UnscaleThenClip, Fused };
// How the loss is made: cross_entropy of forward's logits, or model.loss (linear_cross_entropy) as train-lm does, with
// the decoder weight as the model makes it or laid out by align_decoder (13 units leave the bias a spare column).
enum class Decoder { Logits, Fused, FusedAligned };

LmRun train_lm(bool graph, amp::OptLevel level, int steps, amp::GradScalerOptions scaler = {},
               Clipping clipping = Clipping::UnscaleThenClip, Decoder decoder = Decoder::Logits) {
  const Device cuda = Device::cuda();
  manual_seed(11);
  models::LanguageModel model(50, {.kind = nn::RecurrentKind::LSTM, .embedding_size = 13, .hidden_size = 13,
                                   .num_layers = 2, .dropout = 0.3});
  model.to(cuda);
  if (decoder == Decoder::FusedAligned) {
    model.align_decoder();
    REQUIRE(is_aligned_rows(model.decoder->weight));
  }
  model.train();
  optim::SGD sgd(model.parameters(), {.lr = 0.5, .momentum = 0.9});
  amp::Amp amp = amp::initialize(model, sgd, level, {.scaler = scaler});
  const Tensor input = randint(0, 50, {7, 4}, {.dtype = kInt64, .device = cuda});
  const Tensor target = randint(0, 50, {7 * 4}, {.dtype = kInt64, .device = cuda});
  Tensor h = zeros({2, 4, 13}, {.device = cuda}), c = zeros({2, 4, 13}, {.device = cuda});
  auto step = [&] {
    Tensor loss, next_h, next_c;
    if (decoder == Decoder::Logits) {
      auto out = amp.run([&] { return model.forward(input, h, c); });
      loss = cross_entropy(out.logits.reshape({-1, 50}).to(kFloat32), target);
      next_h = out.h, next_c = out.c;
    } else {
      auto out = amp.run([&] { return model.features(input, h, c); });
      loss = amp.loss([&] { return model.loss(out.features, target); });
      next_h = out.h, next_c = out.c;
    }
    amp.backward(loss);
    if (clipping == Clipping::Fused)
      amp.clip_grad_norm_(0.5);
    else
      optim::clip_grad_norm_(amp.unscale_(), 0.5);
    amp.step();
    amp.zero_grad();
    NoGradGuard no_grad;
    h.copy_(next_h);
    c.copy_(next_c);
  };
  if (graph) {
    cuda::CapturedStep captured(cuda, step, 2);
    for (int i = 0; i < steps; ++i) captured();
    CHECK(captured.captured());
  } else {
    for (int i = 0; i < steps; ++i) step();
  }
  LmRun run;
  for (const Tensor& p : model.parameters()) run.params.push_back(p.detach().to(kFloat64).cpu());
  run.skipped = amp.scaler().skipped_steps();
  run.scale = amp.scaler().is_enabled() ? amp.scaler().get_scale() : 1.0;
  return run;
}

double max_relative_difference(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double scale = std::max(1.0, b[i].abs().max().item<double>());
    worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>() / scale);
  }
  return worst;
}

}  // namespace

TEST_CASE("cuda graph: a replayed language-model step equals the eager step over many steps, at O0 and O1") {
  SKIP_WITHOUT_GPU();
  for (Clipping clipping : {Clipping::UnscaleThenClip, Clipping::Fused}) {
    for (amp::OptLevel level : {amp::OptLevel::O0, amp::OptLevel::O1}) {
      CAPTURE(amp::opt_level_name(level));
      CAPTURE(clipping == Clipping::Fused);
      // The same seed: the replays draw their dropout masks from the generator exactly where eager steps do.
      const LmRun eager = train_lm(false, level, 25, {}, clipping), replayed = train_lm(true, level, 25, {}, clipping);
      CHECK(max_relative_difference(replayed.params, eager.params) < 1e-4);
      CHECK(replayed.skipped == eager.skipped);
    }
  }
  // The decoder weight laid out as aligned rows: the fused loss's products take it in place and its gradient comes
  // back in its layout; the step is the dense weight's up to rounding, eager and replayed.
  for (amp::OptLevel level : {amp::OptLevel::O0, amp::OptLevel::O1}) {
    CAPTURE(amp::opt_level_name(level));
    const LmRun dense = train_lm(false, level, 12, {}, Clipping::Fused, Decoder::Fused),
                aligned = train_lm(false, level, 12, {}, Clipping::Fused, Decoder::FusedAligned),
                replayed = train_lm(true, level, 12, {}, Clipping::Fused, Decoder::FusedAligned);
    CHECK(max_relative_difference(aligned.params, dense.params) < 1e-4);
    CHECK(max_relative_difference(replayed.params, aligned.params) < 1e-4);
  }
  // The two ways of clipping are the same step up to rounding.
  const LmRun unfused = train_lm(false, amp::OptLevel::O1, 25), fused = train_lm(true, amp::OptLevel::O1, 25, {},
                                                                                  Clipping::Fused);
  CHECK(max_relative_difference(fused.params, unfused.params) < 1e-3);
}

TEST_CASE("cuda graph: overflowing steps are skipped inside the graph and the scale backs off on the device") {
  SKIP_WITHOUT_GPU();
  // 2^120: every float16 gradient overflows until the scale has come down; the first 2 steps are eager.
  const amp::GradScalerOptions scaler{.init_scale = 0x1p120};
  for (Clipping clipping : {Clipping::UnscaleThenClip, Clipping::Fused}) {
    CAPTURE(clipping == Clipping::Fused);
    const LmRun eager = train_lm(false, amp::OptLevel::O1, 30, scaler, clipping),
                replayed = train_lm(true, amp::OptLevel::O1, 30, scaler, clipping);
    CHECK(eager.skipped > 5);  // so most skips happened in replays
    CHECK(replayed.skipped == eager.skipped);
    CHECK(replayed.scale == eager.scale);
    CHECK(max_relative_difference(replayed.params, eager.params) < 1e-4);
  }
}

TEST_CASE("cuda graph: dropout draws a new mask at every replay, the one an eager call would draw") {
  SKIP_WITHOUT_GPU();
  const Device cuda = Device::cuda();
  const Tensor x = ones({1000}, {.device = cuda});
  Tensor y = zeros({1000}, {.device = cuda});
  cuda::Graph graph;
  manual_seed(3);
  const GeneratorState before = generator_state();
  graph.capture(cuda, [&] { y.copy_(dropout(x, 0.5)); });
  CHECK(generator_state().offset == before.offset);  // capturing ran nothing and drew nothing
  CHECK(graph.random_counters() == 250);
  graph.replay();
  const std::vector<double> first = testing::values(y);
  graph.replay();
  const std::vector<double> second = testing::values(y);
  CHECK(first != second);
  manual_seed(3);
  CHECK(testing::values(dropout(x, 0.5)) == first);
  CHECK(testing::values(dropout(x, 0.5)) == second);
}

TEST_CASE("cuda graph: replays follow the learning rate a scheduler sets between them") {
  SKIP_WITHOUT_GPU();
  const Device cuda = Device::cuda();
  Tensor w = zeros({3}, {.device = cuda, .requires_grad = true});
  optim::SGD sgd({w}, {.lr = 1.0});
  cuda::Graph graph;
  graph.capture(cuda, [&] {
    (w * 1.0).sum().backward();  // the gradient is 1
    sgd.step();
    sgd.zero_grad();
  });
  graph.replay();
  CHECK(testing::values(w) == std::vector<double>{-1, -1, -1});
  sgd.param_groups()[0].lr = 0.25;
  graph.replay();
  CHECK(testing::values(w) == std::vector<double>{-1.25, -1.25, -1.25});
  // The other options were captured with the kernels: a change (a loaded state's) is refused, not ignored.
  sgd.groups()[0].options.weight_decay = 0.1;
  CHECK_THROWS_WITH_AS(graph.replay(),
                       doctest::Contains("SGD: group 0 was captured in a CUDA graph with weight_decay 0, dampening 0, "
                                         "nesterov false, and now has 0.1, 0, false"), Error);
  sgd.groups()[0].options.weight_decay = 0;
  graph.replay();
  CHECK(testing::values(w) == std::vector<double>{-1.5, -1.5, -1.5});
}

TEST_CASE("cuda graph: a replayed training step makes no host synchronisation") {
  SKIP_WITHOUT_GPU();
  const Device cuda = Device::cuda();
  Tensor w = ones({64}, {.device = cuda, .requires_grad = true});
  const Tensor x = randn({64}, {.device = cuda});
  optim::SGD sgd({w}, {.lr = 0.1, .momentum = 0.9});
  amp::GradScaler scaler;
  auto step = [&] {
    Tensor y = dropout(w * x, 0.1);
    scaler.scale((y * y).sum()).backward();
    scaler.unscale_(sgd);
    optim::clip_grad_norm_({w}, 1.0);
    scaler.step(sgd);
    scaler.update();
    sgd.zero_grad();
  };
  cuda::CapturedStep captured(cuda, step, 2);
  for (int i = 0; i < 3; ++i) captured();  // two eager steps (the scaler's first update reads its scale), a capture
  const uint64_t before = cuda::host_synchronizations();
  for (int i = 0; i < 20; ++i) captured();
  CHECK(cuda::host_synchronizations() == before);
  CHECK(scaler.skipped_steps() == 0);
  // The captured update holds the scaler's options as its kernel's arguments: a state with others is refused.
  scaler.load_state_tensors(scaler.state_tensors());
  CHECK_THROWS_WITH_AS(scaler.load_state_tensors(amp::GradScaler({.growth_interval = 10}).state_tensors()),
                       doctest::Contains("update() is captured in a CUDA graph"), Error);
  CHECK(scaler.options().growth_interval == 2000);
}

TEST_CASE("cuda graph: work that waits for the GPU cannot be captured, and the error says what to do") {
  SKIP_WITHOUT_GPU();
  const Device cuda = Device::cuda();
  const Tensor x = ones({4}, {.device = cuda});
  cuda::Graph graph;
  const std::string error = testing::error_of([&] { graph.capture(cuda, [&] { (void)x.sum().item<double>(); }); });
  CHECK(error.find("could not be captured") != std::string::npos);
  CHECK(error.find("item()") != std::string::npos);
  CHECK_FALSE(graph.captured());
  CHECK((x * 2).sum().item<double>() == 8);  // the device is still usable
  CHECK(testing::error_of([&] { cuda::before_each_replay([] {}); }).find("outside a cuda::Graph capture") !=
        std::string::npos);

  // State made on a first step would be made again by every replay; Adam's bias correction would freeze.
  Tensor w = ones({4}, {.device = cuda, .requires_grad = true});
  optim::SGD sgd({w}, {.lr = 0.1, .momentum = 0.9});
  w.set_grad(ones({4}, {.device = cuda}));
  cuda::Graph first_step;
  CHECK(testing::error_of([&] { first_step.capture(cuda, [&] { sgd.step(); }); }).find("run the step eagerly first") !=
        std::string::npos);
  optim::Adam adam({w}, {.lr = 0.1});
  adam.step();
  cuda::Graph adam_step;
  CHECK(testing::error_of([&] { adam_step.capture(cuda, [&] { adam.step(); }); }).find("use SGD with --cuda-graph") !=
        std::string::npos);
  CHECK(testing::values(w) != std::vector<double>{1, 1, 1, 1});  // the eager Adam step ran; the captures ran nothing
}

TEST_CASE("cuda graph: a CPU device is refused") {
  CHECK(testing::error_of([] { cuda::CapturedStep step(Device::cpu(), [] {}); }).find("need a CUDA device") !=
        std::string::npos);
  cuda::Graph graph;
  CHECK(testing::error_of([&] { graph.capture(Device::cpu(), [] {}); }).find("CUDA device is needed") !=
        std::string::npos);
}

#if HALFGRAD_WITH_CUDA
TEST_CASE("cuda graph: small memset nodes become kernel nodes that write the same bytes in the same order") {
  SKIP_WITHOUT_GPU();
  // Memsets of 1-, 2- and 4-byte values, in rows and not; the second overwrites part of the first, and a copy of the
  // whole buffer after the last shows what each wrote and in which order. The last is too large to be rewritten.
  struct Memset {
    size_t offset, pitch;
    unsigned int value, element_size;
    size_t width, height;
  };
  const std::vector<Memset> memsets = {
      {0, 0, 0x11223344u, 4, 300, 1},    // 1,200 bytes from 0
      {256, 0, 0xabu, 1, 37, 1},         // bytes inside the first, at an odd length
      {402, 0, 0xbeefu, 2, 19, 1},       // 2-byte values from an address not a multiple of 4
      {1300, 96, 0xdeadbeefu, 4, 7, 5},  // 5 rows of 28 bytes, 96 apart
      {2048, 128, 0x5a5au, 2, 32, 4},    // 4 rows of 64 bytes, 128 apart
      {4096, 0, 0x77u, 1, cuda::kRewrittenMemsetBytes + 1, 1},  // left a memset node
  };
  constexpr size_t kBytes = 4096 + cuda::kRewrittenMemsetBytes + 64;
  std::vector<uint8_t> start(kBytes), expected;
  for (size_t i = 0; i < kBytes; ++i) start[i] = uint8_t(i * 7 + 3);
  expected = start;
  size_t rewritten_bytes = 0;
  for (const Memset& m : memsets) {
    for (size_t row = 0; row < m.height; ++row)
      for (size_t e = 0; e < m.width; ++e)
        for (unsigned int b = 0; b < m.element_size; ++b)
          expected[m.offset + row * m.pitch + e * m.element_size + b] = uint8_t(m.value >> (8 * b));
    const size_t bytes = m.width * m.element_size * m.height;
    if (bytes <= cuda::kRewrittenMemsetBytes) rewritten_bytes += bytes;
  }

  auto run = [&](bool rewrite) {
    const Device cuda = Device::cuda();
    Tensor buffer = tensor(start, {.dtype = kUInt8, .device = cuda});
    Tensor copy = zeros({int64_t(kBytes)}, {.dtype = kUInt8, .device = cuda});
    auto* base = static_cast<char*>(buffer.data_ptr());
    cudaGraph_t graph = nullptr;
    REQUIRE(cudaGraphCreate(&graph, 0) == cudaSuccess);
    cudaGraphNode_t last = nullptr;
    for (const Memset& m : memsets) {
      cudaMemsetParams params{.dst = base + m.offset, .pitch = m.height > 1 ? m.pitch : 0, .value = m.value,
                              .elementSize = m.element_size, .width = m.width, .height = m.height};
      cudaGraphNode_t node = nullptr;
      REQUIRE(cudaGraphAddMemsetNode(&node, graph, last ? &last : nullptr, last ? 1 : 0, &params) == cudaSuccess);
      last = node;
    }
    cudaGraphNode_t copied = nullptr;
    REQUIRE(cudaGraphAddMemcpyNode1D(&copied, graph, &last, 1, copy.data_ptr(), base, kBytes,
                                     cudaMemcpyDeviceToDevice) == cudaSuccess);
    if (rewrite) {
      const cuda::MemsetsRewritten done = cuda::memsets_as_kernels(graph);
      CHECK(done.nodes == int(memsets.size()) - 1);
      CHECK(done.bytes == rewritten_bytes);
      size_t count = 0;
      REQUIRE(cudaGraphGetNodes(graph, nullptr, &count) == cudaSuccess);
      std::vector<cudaGraphNode_t> nodes(count);
      REQUIRE(cudaGraphGetNodes(graph, nodes.data(), &count) == cudaSuccess);
      int kernels = 0, memset_nodes = 0;
      for (cudaGraphNode_t node : nodes) {
        cudaGraphNodeType type;
        REQUIRE(cudaGraphNodeGetType(node, &type) == cudaSuccess);
        kernels += type == cudaGraphNodeTypeKernel;
        memset_nodes += type == cudaGraphNodeTypeMemset;
      }
      CHECK(kernels == int(memsets.size()) - 1);
      CHECK(memset_nodes == 1);
    }
    cudaGraphExec_t exec = nullptr;
    REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
    cudaGraphDestroy(graph);
    for (int replay = 0; replay < 2; ++replay) REQUIRE(cudaGraphLaunch(exec, nullptr) == cudaSuccess);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    cudaGraphExecDestroy(exec);
    const Tensor host = copy.cpu();
    std::vector<uint8_t> bytes(kBytes);
    std::memcpy(bytes.data(), host.data_ptr(), kBytes);
    return bytes;
  };
  CHECK(run(false) == expected);  // the driver's memsets, against which the expectation itself is checked
  CHECK(run(true) == expected);
}

TEST_CASE("cuda graph: a memset captured in a step writes its bytes at every replay") {
  SKIP_WITHOUT_GPU();
  const Device cuda = Device::cuda();
  Tensor t = zeros({1000}, {.dtype = kUInt8, .device = cuda});
  cuda::Graph graph;
  graph.capture(cuda, [&] {
    REQUIRE(cudaMemsetAsync(t.narrow(0, 3, 500).data_ptr(), 0xab, 500, cuda::current_stream(0)) == cudaSuccess);
  });
  for (int replay = 0; replay < 2; ++replay) {
    t.fill_(0);
    graph.replay();
    std::vector<double> expected(1000, 0);
    std::fill(expected.begin() + 3, expected.begin() + 503, 0xab);
    CHECK(testing::values(t.cpu()) == expected);
  }
}
#endif

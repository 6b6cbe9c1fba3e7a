// ops/rnn.h: the fused recurrent op against its oracle (the recurrence written with the per-step differentiable
// ops, as nn/rnn.cpp computed it before the op existed), against finite differences in float64, in every dtype,
// on CUDA against the CPU, its dropout stream, its errors and its precision rule.
#include <doctest/doctest.h>

#include <cmath>
#include <tuple>

#include "core/cuda.h"
#include "halfgrad.h"
#include "ops/rnn.h"
#include "tests/gradcheck.h"
#include "tests/testing.h"

using namespace halfgrad;
using halfgrad::testing::check_close;
using halfgrad::testing::contains;
using halfgrad::testing::error_of;
using halfgrad::testing::gradcheck;
using halfgrad::testing::values;

namespace {

constexpr RnnKind kAllKinds[] = {RnnKind::RNNTanh, RnnKind::RNNReLU, RnnKind::GRU, RnnKind::LSTM};

// The oracle: one linear per step and the gate equations as separate ops, dropout through the dropout op.
RnnResult reference_rnn(const Tensor& input, const Tensor& h0, const Tensor& c0, const TensorList& w,
                        const RnnOptions& o) {
  const int64_t L = o.num_layers, per_layer = int64_t(w.size()) / L, H = w[1].size(1);
  const bool bias = per_layer == 4, lstm = o.kind == RnnKind::LSTM;
  Tensor x = input;
  TensorList h_last, c_last;
  for (int64_t l = 0; l < L; ++l) {
    const Tensor* lw = &w[size_t(l * per_layer)];
    const Tensor b_ih = bias ? lw[2] : Tensor(), b_hh = bias ? lw[3] : Tensor();
    Tensor h = h0.defined() ? h0[l] : zeros({input.size(1), H}, {.dtype = input.dtype()});
    Tensor c = lstm ? (c0.defined() ? c0[l] : zeros({input.size(1), H}, {.dtype = input.dtype()})) : Tensor();
    TensorList steps;
    for (int64_t t = 0; t < input.size(0); ++t) {
      const Tensor gi = linear(x[t], lw[0], b_ih), gh = linear(h, lw[1], b_hh);
      switch (o.kind) {
        case RnnKind::RNNTanh:
          h = (gi + gh).tanh();
          break;
        case RnnKind::RNNReLU:
          h = (gi + gh).relu();
          break;
        case RnnKind::GRU: {
          const Tensor r = (gi.narrow(1, 0, H) + gh.narrow(1, 0, H)).sigmoid();
          const Tensor z = (gi.narrow(1, H, H) + gh.narrow(1, H, H)).sigmoid();
          const Tensor n = (gi.narrow(1, 2 * H, H) + r * gh.narrow(1, 2 * H, H)).tanh();
          h = (1.0 - z) * n + z * h;
          break;
        }
        case RnnKind::LSTM: {
          const Tensor g = gi + gh;
          c = g.narrow(1, H, H).sigmoid() * c + g.narrow(1, 0, H).sigmoid() * g.narrow(1, 2 * H, H).tanh();
          h = g.narrow(1, 3 * H, H).sigmoid() * c.tanh();
          break;
        }
      }
      steps.push_back(h);
    }
    x = stack(steps, 0);
    if (l + 1 < L) x = dropout(x, o.dropout, o.training);
    h_last.push_back(h);
    if (lstm) c_last.push_back(c);
  }
  return {x, stack(h_last, 0), lstm ? stack(c_last, 0) : Tensor()};
}

// A problem's tensors: input, h0, c0 (LSTM) and the weights, float64 leaves on the CPU.
struct Inputs {
  Tensor x, h0, c0;
  TensorList w;
  TensorList all() const {
    TensorList a{x, h0, c0};
    a.insert(a.end(), w.begin(), w.end());
    return a;
  }
};

// weight_scale: the weights' standard deviation. Above about 1 / sqrt(H) the recurrence amplifies each step's
// rounding (a relu RNN without bound), which float16 comparisons cannot follow.
Inputs make_inputs(RnnKind kind, int64_t T, int64_t B, int64_t I, int64_t H, int64_t L, bool bias, bool states,
                   double weight_scale = 0.4) {
  const int64_t G = rnn_gates(kind);
  auto leaf = [](const Shape& s, double scale) {
    Tensor t = randn(s, {.dtype = kFloat64}) * scale;
    return t.requires_grad_();
  };
  Inputs in;
  in.x = leaf({T, B, I}, 1.0);
  if (states) in.h0 = leaf({L, B, H}, 0.5);
  if (states && kind == RnnKind::LSTM) in.c0 = leaf({L, B, H}, 0.5);
  for (int64_t l = 0; l < L; ++l) {
    in.w.push_back(leaf({G * H, l == 0 ? I : H}, weight_scale));
    in.w.push_back(leaf({G * H, H}, weight_scale));
    if (bias) in.w.push_back(leaf({G * H}, weight_scale / 2)), in.w.push_back(leaf({G * H}, weight_scale / 2));
  }
  return in;
}

// Every output flattened into one vector, weighted by fixed random numbers so each element matters.
Tensor weighted_sum(const RnnResult& r, uint64_t seed) {
  manual_seed(seed);
  Tensor total = zeros({}, {.dtype = kFloat64, .device = r.output.device()});
  for (const Tensor& t : r.tensors())
    total = total + (t.to(kFloat64) * randn(t.shape(), {.dtype = kFloat64}).to(t.device())).sum();
  return total;
}

// The gradients of every input that requires grad (undefined elsewhere), after backward of weighted_sum.
TensorList gradients_of(const RnnResult& r, const TensorList& inputs) {
  for (const Tensor& t : inputs)
    if (t.defined()) t.set_grad(Tensor());
  weighted_sum(r, 99).backward();
  TensorList g;
  for (const Tensor& t : inputs) g.push_back(t.defined() ? t.grad() : Tensor());
  return g;
}

// Calls check(got[i], want[i]) for each pair, both defined or both undefined (then skipped).
template <typename Check> void for_each_pair(const TensorList& got, const TensorList& want, Check&& check) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    REQUIRE(got[i].defined() == want[i].defined());
    if (got[i].defined()) check(got[i], want[i]);
  }
}

void check_same(const TensorList& got, const TensorList& want, double tol) {
  for_each_pair(got, want, [&](const Tensor& g, const Tensor& w) {
    CHECK(g.shape() == w.shape());
    check_close(values(g), values(w), tol);
  });
}

// ||got - want|| / ||want|| <= tol for each pair (the norm of the whole tensor).
void check_relative(const TensorList& got, const TensorList& want, double tol) {
  for_each_pair(got, want, [&](const Tensor& got_t, const Tensor& want_t) {
    const std::vector<double> g = values(got_t), w = values(want_t);
    REQUIRE(g.size() == w.size());
    double diff = 0, norm = 0;
    for (size_t e = 0; e < g.size(); ++e) diff += (g[e] - w[e]) * (g[e] - w[e]), norm += w[e] * w[e];
    CHECK(std::sqrt(diff) <= tol * std::sqrt(norm));
  });
}

}  // namespace

TEST_CASE("rnn: outputs, final states and every gradient equal the per-step oracle in float64") {
  struct Size {
    int64_t T, B, L;
  };
  for (RnnKind kind : kAllKinds) {
    for (bool bias : {true, false}) {
      for (bool states : {true, false}) {
        for (Size n : {Size{5, 3, 3}, Size{1, 1, 1}}) {  // three layers: two dropout draws; one step, one row
          const std::string kind_name = rnn_kind_name(kind);
          CAPTURE(kind_name);
          CAPTURE(bias);
          CAPTURE(states);
          CAPTURE(n.L);
          manual_seed(31);
          const Inputs in = make_inputs(kind, n.T, n.B, 4, 6, n.L, bias, states);
          const RnnOptions o{.kind = kind, .num_layers = n.L, .dropout = 0.3, .training = true};
          manual_seed(7);  // the same dropout counters for both
          const RnnResult got = rnn(in.x, in.h0, in.c0, in.w, o);
          const TensorList got_grads = gradients_of(got, in.all());
          manual_seed(7);
          const RnnResult want = reference_rnn(in.x, in.h0, in.c0, in.w, o);
          const TensorList want_grads = gradients_of(want, in.all());
          check_same(got.tensors(), want.tensors(), 1e-12);
          check_same(got_grads, want_grads, 1e-12);
          CHECK(got.output.grad_fn()->name() == "RnnBackward");
          CHECK(got.output.grad_fn() == got.h.grad_fn());  // one node for the whole stack
        }
      }
    }
  }
}

TEST_CASE("rnn: gradients of the input, the initial states and every weight match finite differences") {
  for (RnnKind kind : kAllKinds) {
    for (bool states : {true, false}) {
      const std::string kind_name = rnn_kind_name(kind);
      CAPTURE(kind_name);
      CAPTURE(states);
      manual_seed(32);
      const Inputs in = make_inputs(kind, 4, 2, 3, 4, 2, true, states);
      gradcheck(
          [&](const TensorList& a) {
            const TensorList w(a.begin() + 3, a.end());
            const RnnResult r = rnn(a[0], a[1], a[2], w, {.kind = kind, .num_layers = 2});
            TensorList flat;
            for (const Tensor& t : r.tensors()) flat.push_back(t.reshape({-1}));
            return cat(flat);
          },
          in.all());
    }
  }
}

TEST_CASE("rnn: only the wanted gradients are computed, and evaluation keeps no graph") {
  manual_seed(33);
  Inputs in = make_inputs(RnnKind::LSTM, 4, 2, 3, 5, 2, true, true);
  for (Tensor* t : {&in.x, &in.h0, &in.c0}) t->requires_grad_(false);
  for (size_t i = 0; i < 4; ++i) in.w[i].requires_grad_(false);  // layer 0 frozen: the backward stops above it
  const RnnOptions o{.kind = RnnKind::LSTM, .num_layers = 2};
  const TensorList got = gradients_of(rnn(in.x, in.h0, in.c0, in.w, o), in.all());
  const TensorList want = gradients_of(reference_rnn(in.x, in.h0, in.c0, in.w, o), in.all());
  check_same(got, want, 1e-12);
  for (size_t i = 4; i < in.w.size(); ++i) CHECK(got[3 + i].defined());
  {
    NoGradGuard no_grad;
    const RnnResult r = rnn(in.x, in.h0, in.c0, in.w, o);
    CHECK(r.output.grad_fn() == nullptr);
    check_same(r.tensors(), reference_rnn(in.x, in.h0, in.c0, in.w, o).tensors(), 1e-12);
  }
}

TEST_CASE("rnn: float32, float16 and bfloat16 on the CPU follow float64 to their precision") {
  for (RnnKind kind : kAllKinds) {
    const std::string kind_name = rnn_kind_name(kind);
    CAPTURE(kind_name);
    manual_seed(34);
    const Inputs in = make_inputs(kind, 6, 3, 5, 8, 2, true, true);
    const RnnOptions o{.kind = kind, .num_layers = 2};
    for (auto [dtype, tol] : {std::pair{kFloat32, 1e-5}, {kFloat16, 1e-2}, {kBFloat16, 6e-2}}) {
      const std::string dtype_str = dtype_name(dtype);
      CAPTURE(dtype_str);
      TensorList low;
      for (const Tensor& t : in.all()) low.push_back(t.defined() ? t.detach().to(dtype).requires_grad_() : Tensor());
      const RnnResult r = rnn(low[0], low[1], low[2], TensorList(low.begin() + 3, low.end()), o);
      for (const Tensor& t : r.tensors()) CHECK(t.dtype() == dtype);
      // Rounding the inputs to the dtype moves the exact result too: compare with the exact result of the
      // rounded inputs.
      TensorList rounded;
      for (const Tensor& t : low) rounded.push_back(t.defined() ? t.detach().to(kFloat64).requires_grad_() : Tensor());
      const RnnResult ref = rnn(rounded[0], rounded[1], rounded[2], TensorList(rounded.begin() + 3, rounded.end()), o);
      check_same(r.tensors(), ref.tensors(), tol);
      check_same(gradients_of(r, low), gradients_of(ref, rounded), tol * 4);
    }
  }
}

TEST_CASE("rnn: dropout between layers draws the dropout op's Philox stream, in training only") {
  manual_seed(35);
  const Inputs in = make_inputs(RnnKind::GRU, 5, 4, 3, 6, 3, true, false);
  const RnnOptions train{.kind = RnnKind::GRU, .num_layers = 3, .dropout = 0.5, .training = true};
  manual_seed(8);
  const Tensor a = rnn(in.x, in.h0, in.c0, in.w, train).output;
  const Tensor b = rnn(in.x, in.h0, in.c0, in.w, train).output;
  CHECK(values(a) != values(b));  // a new mask per call
  manual_seed(8);
  check_close(values(rnn(in.x, in.h0, in.c0, in.w, train).output), values(a), 0);  // the same seed, the same mask
  RnnOptions eval = train;
  eval.training = false;
  RnnOptions no_dropout = train;
  no_dropout.dropout = 0;
  check_close(values(rnn(in.x, in.h0, in.c0, in.w, eval).output),
              values(rnn(in.x, in.h0, in.c0, in.w, no_dropout).output), 0);
}

TEST_CASE("rnn: a weight changed in place between forward and backward is an error, not a wrong gradient") {
  manual_seed(36);
  const Inputs in = make_inputs(RnnKind::LSTM, 3, 2, 3, 4, 1, true, true);
  const RnnResult r = rnn(in.x, in.h0, in.c0, in.w, {.kind = RnnKind::LSTM});
  {
    NoGradGuard no_grad;
    Tensor(in.w[1]).mul_(0.5);
  }
  CHECK(contains(error_of([&] { r.output.sum().backward(); }),
                 "RnnBackward: one of the tensors needed for gradient computation has been modified"));
}

TEST_CASE("rnn: errors name the op, the tensor and its shape, dtype or device") {
  const Tensor x = randn({5, 2, 3});
  const TensorList w = {randn({16, 3}), randn({16, 4}), randn({16}), randn({16})};
  const RnnOptions lstm{.kind = RnnKind::LSTM};
  CHECK(contains(error_of([&] {
                   rnn(x, Tensor(), Tensor(), {randn({16, 4}), w[1], w[2], w[3]}, lstm);
                 }),
                 "rnn (LSTM): weight_ih_l0 must be [16, 3] for input float32[5, 2, 3] cpu and hidden size 4, got "
                 "float32[16, 4]"));
  CHECK(contains(error_of([&] {
                   rnn(x, Tensor(), Tensor(), {w[0], w[1], w[2]}, lstm);
                 }),
                 "expected 2 or 4 weights per layer for 1 layers, got 3 tensors"));
  CHECK(contains(error_of([&] {
                   rnn(x, Tensor(), Tensor(), {w[0], w[1].to(kFloat64), w[2], w[3]}, lstm);
                 }),
                 "weight_hh_l0 float64[16, 4] cpu and input float32[5, 2, 3] cpu must have the same dtype"));
  CHECK(contains(error_of([&] {
                   rnn(x, zeros({1, 3, 4}), Tensor(), w, lstm);
                 }),
                 "h0 must be [num_layers, batch, hidden] = [1, 2, 4], got float32[1, 3, 4]"));
  CHECK(contains(error_of([&] {
                   rnn(x, Tensor(), zeros({1, 2, 4}), {randn({4, 3}), randn({4, 4})}, {.kind = RnnKind::GRU});
                 }),
                 "weight_ih_l0 must be [3 * hidden, input_size]"));
  CHECK(contains(error_of([&] {
                   rnn(x, Tensor(), zeros({1, 2, 4}), {randn({4, 3}), randn({4, 4})}, {.kind = RnnKind::RNNTanh});
                 }),
                 "rnn (RNN_TANH): only an LSTM takes a cell state c0"));
  CHECK(contains(error_of([&] {
                   rnn(randn({0, 2, 3}), Tensor(), Tensor(), w, lstm);
                 }),
                 "expected a sequence of at least one step, got input float32[0, 2, 3]"));
  CHECK(contains(error_of([&] { rnn(x, Tensor(), Tensor(), w, {.kind = RnnKind::LSTM, .dropout = 1.0}); }),
                 "dropout must be in [0, 1), got 1"));
  CHECK(contains(error_of([&] {
                   rnn(randint(0, 3, {5, 2, 3}), Tensor(), Tensor(), w, lstm);
                 }),
                 "expected a floating input [T, B, input_size], got int64[5, 2, 3]"));
}

TEST_CASE("rnn under autocast runs in the lower precision, and the float32 weights get float32 gradients") {
  manual_seed(37);
  const Tensor x = randn({4, 2, 3});
  const TensorList w = {randn({12, 3}).requires_grad_(), randn({12, 4}).requires_grad_(), randn({12}).requires_grad_(),
                        randn({12}).requires_grad_()};
  amp::AutocastGuard autocast(kFloat16);
  const RnnResult r = rnn(x, Tensor(), Tensor(), w, {.kind = RnnKind::GRU});
  CHECK(r.output.dtype() == kFloat16);
  CHECK(r.h.dtype() == kFloat16);
  r.output.to(kFloat32).sum().backward();
  for (const Tensor& t : w) CHECK(t.grad().dtype() == kFloat32);
}

// ---- CUDA against the CPU

// Runs a scope with the CUDA loop kernels chosen (ops/rnn.h's set_rnn_cuda_loop), and restores them.
struct CudaLoop {
  RnnCudaLoop previous = rnn_cuda_loop();
  explicit CudaLoop(RnnCudaLoop loop) { set_rnn_cuda_loop(loop); }
  ~CudaLoop() { set_rnn_cuda_loop(previous); }
};

TEST_CASE("cuda: rnn's outputs and gradients match the CPU for every kind and dtype, dropout included") {
  SKIP_WITHOUT_GPU();
  for (RnnCudaLoop loop : {RnnCudaLoop::Persistent, RnnCudaLoop::Steps, RnnCudaLoop::Fastest}) {
    const CudaLoop loops(loop);
    CAPTURE(int(loop));
    for (RnnKind kind : kAllKinds) {
      for (auto [dtype, tol] : {std::pair{kFloat64, 1e-10}, {kFloat32, 1e-4}, {kFloat16, 1e-2}, {kBFloat16, 5e-2}}) {
        for (int64_t batch : {5, 40}) {
          const std::string kind_name = rnn_kind_name(kind), dtype_str = dtype_name(dtype);
          CAPTURE(kind_name);
          CAPTURE(dtype_str);
          CAPTURE(batch);
          manual_seed(38);
          // 6 inputs and 42 units: the layers' weight gradients run as one product in float32 (both layers) and
          // in float16/bfloat16 (the first), as two elsewhere (ops/rnn.cpp's one_weight_product).
          const Inputs in = make_inputs(kind, 7, batch, 6, 42, 2, true, true, 0.6 / std::sqrt(42.0));
          const RnnOptions o{.kind = kind, .num_layers = 2, .dropout = 0.25, .training = true};
          TensorList cpu, gpu;
          for (const Tensor& t : in.all()) {
            cpu.push_back(t.defined() ? t.detach().to(dtype).requires_grad_() : Tensor());
            gpu.push_back(t.defined() ? t.detach().to(Device::cuda(0), dtype).requires_grad_() : Tensor());
          }
          manual_seed(9);
          const RnnResult want = rnn(cpu[0], cpu[1], cpu[2], TensorList(cpu.begin() + 3, cpu.end()), o);
          manual_seed(9);
          const RnnResult got = rnn(gpu[0], gpu[1], gpu[2], TensorList(gpu.begin() + 3, gpu.end()), o);
          CHECK(got.output.is_cuda());
          const TensorList got_grads = gradients_of(got, gpu), want_grads = gradients_of(want, cpu);
          if (!is_half(dtype)) {
            check_same(got.tensors(), want.tensors(), tol);
            check_same(got_grads, want_grads, tol * 4);
          } else {
            // CUDA rounds h to the dtype after every step (the next GEMM's operand), the CPU only at the end, so
            // single elements can part (a relu near 0 switches its gradient on or off): compare whole tensors.
            check_relative(got.tensors(), want.tensors(), tol);
            check_relative(got_grads, want_grads, tol * 2);
          }
        }
      }
    }
  }
}

// Runs a scope with the persistent kernels' batch groups set (ops/rnn.h's set_rnn_batch_groups), and restores them.
struct BatchGroups {
  int previous = rnn_batch_groups();
  explicit BatchGroups(int groups) { set_rnn_batch_groups(groups); }
  ~BatchGroups() { set_rnn_batch_groups(previous); }
};

TEST_CASE("set_rnn_batch_groups refuses a negative count") {
  CHECK_THROWS_WITH_AS(set_rnn_batch_groups(-1), doctest::Contains("set_rnn_batch_groups"), Error);
  CHECK(rnn_batch_groups() == 0);
}

TEST_CASE("cuda: the persistent loop kernels equal the per-step kernels when units, rows and batch split into tiles") {
  SKIP_WITHOUT_GPU();
  // 300 units: several units per block on any GPU with fewer than 300 SMs, so a block's W_hh slice spans several
  // gates' rows; batches of 1, 6 (a partial tile) and 33 (9 CUDA-core tiles of 4 rows or 7 of 5, 3 tensor-core
  // tiles); float64, so the sums' orders cannot hide an error, and float16 / bfloat16, whose products run on tensor
  // cores. 650 units (5 a block on a GPU of 132 SMs): the backward holds 8 units a block, its W_hh slice in several
  // 16-byte chunks of units (2 in float32, 4 in float64). Each in 1, 2 and 3 groups of batch rows: 2 groups give a
  // block 10 units at 650 (the backward's 12-unit kernel), 3 groups leave blocks of the batch of 1 with no rows, and
  // 15 units at 650 take the backward off the persistent kernel (at most 12 units a block).
  for (RnnKind kind : kAllKinds) {
    for (auto [dtype, tol, hidden] : {std::tuple{kFloat64, 1e-10, 300}, {kFloat16, 1e-2, 300}, {kBFloat16, 5e-2, 300},
                                      {kFloat64, 1e-10, 650}, {kFloat32, 1e-4, 650}}) {
      for (auto [batch, groups] : {std::pair<int64_t, int>{1, 1}, {6, 1}, {33, 1}, {1, 3}, {6, 2}, {33, 2}, {33, 3}}) {
        const BatchGroups split(groups);
        const std::string kind_name = rnn_kind_name(kind), dtype_str = dtype_name(dtype);
        CAPTURE(kind_name);
        CAPTURE(dtype_str);
        CAPTURE(hidden);
        CAPTURE(batch);
        CAPTURE(groups);
        manual_seed(41);
        const Inputs in = make_inputs(kind, 5, batch, 7, hidden, 2, true, true, 0.8 / std::sqrt(double(hidden)));
        TensorList gpu;
        for (const Tensor& t : in.all())
          gpu.push_back(t.defined() ? t.detach().to(Device::cuda(0), dtype).requires_grad_() : Tensor());
        const RnnOptions o{.kind = kind, .num_layers = 2};
        auto run = [&](RnnCudaLoop loop) {
          const CudaLoop loops(loop);
          const RnnResult r = rnn(gpu[0], gpu[1], gpu[2], TensorList(gpu.begin() + 3, gpu.end()), o);
          TensorList all = r.tensors();
          for (const Tensor& g : gradients_of(r, gpu)) all.push_back(g);
          return all;
        };
        if (dtype == kFloat64)
          check_same(run(RnnCudaLoop::Persistent), run(RnnCudaLoop::Steps), tol);
        else
          check_relative(run(RnnCudaLoop::Persistent), run(RnnCudaLoop::Steps), tol);
      }
    }
  }
}

TEST_CASE("cuda: the persistent kernels' cells where a block has more units and rows than threads") {
  SKIP_WITHOUT_GPU();
  // A block's cells load their inputs at the start of the step where each (row, unit) has a thread of its own (512 a
  // block); past that they load them at the cell. 600 rows in one group: every block has at least 600 cells.
  const BatchGroups split(1);
  for (RnnKind kind : kAllKinds) {
    const std::string kind_name = rnn_kind_name(kind);
    CAPTURE(kind_name);
    manual_seed(44);
    const Inputs in = make_inputs(kind, 3, 600, 5, 20, 2, true, true, 0.8 / std::sqrt(20.0));
    TensorList gpu;
    for (const Tensor& t : in.all())
      gpu.push_back(t.defined() ? t.detach().to(Device::cuda(0)).requires_grad_() : Tensor());
    auto run = [&](RnnCudaLoop loop) {
      const CudaLoop loops(loop);
      const RnnResult r =
          rnn(gpu[0], gpu[1], gpu[2], TensorList(gpu.begin() + 3, gpu.end()), {.kind = kind, .num_layers = 2});
      TensorList all = r.tensors();
      for (const Tensor& g : gradients_of(r, gpu)) all.push_back(g);
      return all;
    };
    check_same(run(RnnCudaLoop::Persistent), run(RnnCudaLoop::Steps), 1e-10);
  }
}

TEST_CASE("cuda: a larger batch after a smaller one still runs the persistent kernels (training after evaluation)") {
  SKIP_WITHOUT_GPU();
  // Each batch size needs its own amount of shared memory; the kernel's limit once followed the last size planned,
  // so a training batch after an evaluation batch failed to launch (cudaErrorInvalidValue).
  const CudaLoop loops(RnnCudaLoop::Persistent);
  for (DType dtype : {kFloat32, kFloat16}) {
    const std::string dtype_str = dtype_name(dtype);
    CAPTURE(dtype_str);
    for (int64_t batch : {20, 10, 20}) {
      CAPTURE(batch);
      manual_seed(43);
      const Inputs in = make_inputs(RnnKind::LSTM, 4, batch, 8, 300, 2, true, true, 0.8 / std::sqrt(300.0));
      TensorList gpu;
      for (const Tensor& t : in.all())
        gpu.push_back(t.defined() ? t.detach().to(Device::cuda(0), dtype).requires_grad_() : Tensor());
      const RnnResult r = rnn(gpu[0], gpu[1], gpu[2], TensorList(gpu.begin() + 3, gpu.end()),
                              {.kind = RnnKind::LSTM, .num_layers = 2});
      CHECK(gradients_of(r, gpu).size() == gpu.size());  // forward and backward launched (a failure throws)
    }
  }
}

TEST_CASE("cuda: rnn called again on the same buffers (a replayed time loop) reads the new values") {
  SKIP_WITHOUT_GPU();
  const CudaLoop loops(RnnCudaLoop::Steps);  // the per-step kernels, whose loops are replayed as CUDA graphs
  for (RnnKind kind : {RnnKind::GRU, RnnKind::LSTM}) {
    const std::string kind_name = rnn_kind_name(kind);
    CAPTURE(kind_name);
    manual_seed(39);
    const Inputs in = make_inputs(kind, 6, 4, 5, 24, 2, true, true, 0.2);
    TensorList gpu;
    for (const Tensor& t : in.all())
      gpu.push_back(t.defined() ? t.detach().to(Device::cuda(0)).requires_grad_() : Tensor());
    const RnnOptions o{.kind = kind, .num_layers = 2};
    for (int round = 0; round < 4; ++round) {
      CAPTURE(round);
      {  // new values in the same tensors: the same addresses, so the time loops replay their graphs
        NoGradGuard no_grad;
        for (Tensor t : gpu)
          if (t.defined()) t.copy_(randn(t.shape(), {.dtype = kFloat64}).mul(0.3));
      }
      TensorList cpu;
      for (const Tensor& t : gpu) cpu.push_back(t.defined() ? t.detach().cpu().requires_grad_() : Tensor());
      const RnnResult want = rnn(cpu[0], cpu[1], cpu[2], TensorList(cpu.begin() + 3, cpu.end()), o);
      const RnnResult got = rnn(gpu[0], gpu[1], gpu[2], TensorList(gpu.begin() + 3, gpu.end()), o);
      check_same(got.tensors(), want.tensors(), 1e-10);
      check_same(gradients_of(got, gpu), gradients_of(want, cpu), 1e-10);
    }
  }
}

// rnn: checks, the forward and backward drivers (device-generic: GEMMs through gemm_kernel, one loop kernel per
// layer and direction), the autograd node, and the CPU loop kernels. The CUDA loop kernels are in ops/rnn.cu; the
// gate arithmetic both run is ops/rnn_cell.h.
//
// Per layer l (T steps, B rows, H units, G gates; x the layer's input [T B, in]):
//   forward    gi [T B, G H] = x W_ih^T                                   one GEMM
//              per t: gh = h_{t-1} W_hh^T; cell(gi[t], gh)                the loop kernel
//   backward   per t, last first: dh_t += dgh[t+1] W_hh; cell backward   the loop kernel
//                                 -> dgi[t], dgh[t]
//              dh_0 += dgh[0] W_hh; dx = dgi W_ih; dW_ih = dgi^T x;       GEMMs
//              dW_hh = dgh^T [h0; y_0 .. y_{T-2}] (or both as one product,
//              one_weight_product); db = column sums
// What forward keeps for backward, per layer: its input, its outputs, h0, the cell states (LSTM), the gate
// activations, and GRU's W_hn h + b_hn. Dropout masks are regenerated from their Philox counters.
#include "ops/rnn.h"

#include <atomic>

#include "core/autocast.h"
#include "core/autograd.h"
#include "core/cuda.h"
#include "ops/copy.h"
#include "ops/dropout.h"
#include "ops/elementwise.h"
#include "ops/matmul.h"
#include "ops/rnn_cell.h"
#include "ops/shape.h"
#include "ops/stack.h"

namespace halfgrad {

constinit KernelTable<RnnLoopForwardKernel> rnn_loop_forward_kernel("rnn");
constinit KernelTable<RnnLoopBackwardKernel> rnn_loop_backward_kernel("rnn backward");

namespace {
std::atomic<RnnCudaLoop> g_cuda_loop{RnnCudaLoop::Fastest};
std::atomic<int> g_batch_groups{0};
}  // namespace
void set_rnn_cuda_loop(RnnCudaLoop loop) { g_cuda_loop.store(loop); }
RnnCudaLoop rnn_cuda_loop() { return g_cuda_loop.load(std::memory_order_relaxed); }
void set_rnn_batch_groups(int groups) {
  HG_CHECK(groups >= 0, "set_rnn_batch_groups: groups must be 0 (chosen) or positive, got {}", groups);
  g_batch_groups.store(groups);
}
int rnn_batch_groups() { return g_batch_groups.load(std::memory_order_relaxed); }

const char* rnn_kind_name(RnnKind kind) {
  switch (kind) {
    case RnnKind::RNNTanh:
      return "RNN_TANH";
    case RnnKind::RNNReLU:
      return "RNN_RELU";
    case RnnKind::GRU:
      return "GRU";
    case RnnKind::LSTM:
      return "LSTM";
  }
  return "RNN";
}

int64_t rnn_gates(RnnKind kind) {
  switch (kind) {
    case RnnKind::GRU:
      return 3;
    case RnnKind::LSTM:
      return 4;
    default:
      return 1;
  }
}

namespace {

// The problem's sizes and dtypes.
struct Problem {
  RnnKind kind;
  int64_t T, B, I, H, L, G;  // G: G H columns of the gate matrices
  bool bias;
  DType storage, acc;  // see ops/rnn.h's Precision
  Device device;
  int64_t in(int64_t layer) const { return layer == 0 ? I : H; }
  int64_t per_layer() const { return bias ? 4 : 2; }  // weights per layer
};

// The storage dtype the drivers compute with: the CPU's kernels have no half GEMM with float32 output, so
// float16/bfloat16 are widened there once per call.
DType storage_dtype(DType dtype, Device device) { return device.is_cpu() && is_half(dtype) ? kFloat32 : dtype; }

void* data_or_null(const Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

Tensor dense(const Tensor& t, DType dtype) {
  NoGradGuard no_grad;
  return cast_nograd(t, dtype).contiguous();
}

// A dense copy in `dtype` that nothing else shares (the backward pass writes into it).
Tensor owned(const Tensor& t, DType dtype) {
  Tensor d = dense(t, dtype);
  return d.storage() == t.storage() ? d.clone() : d;
}

// Row-major C [m, n] = op(A) op(B) + beta C in the problem's dtypes, every operand dense (ldc = n).
void gemm(const Problem& p, DType c_dtype, int64_t m, int64_t n, int64_t k, const void* a, Trans ta, const void* b,
          Trans tb, void* c, double beta = 0) {
  gemm_dense(p.device, p.storage, c_dtype, m, n, k, a, ta, b, tb, c, beta);
}

// Whether a layer's two weight gradients run as one product, dgi^T [x | h_prev] (both gate gradients are dgi for
// every kind but GRU): on CUDA where the joined rows are whole multiples of kGemmAlignBytes and a separate one's are not, so that one
// product on aligned operands replaces two on zero-padded copies (ops/matmul.cu pads them; at 650 units in float32
// the padded pair took 4 x 22.5 µs of products and 8 copies a step against 35 µs and 5 copies,
// docs/benchmarks.md). Elsewhere the copies in and out would cost more than the launch saved.
bool one_weight_product(const Problem& p, int64_t in) {
  const auto aligned = [&](int64_t cols) { return cols * int64_t(element_size(p.storage)) % kGemmAlignBytes == 0; };
  return p.kind != RnnKind::GRU && p.device.is_cuda() && aligned(in + p.H) && !(aligned(in) && aligned(p.H));
}

struct LayerWeights {
  Tensor w_ih, w_hh, b_ih, b_hh;  // storage dtype, dense; biases undefined without bias
};

// The weights as backward reads them: an in-place change after the forward (an optimizer step before
// backward) is an error instead of a wrong gradient.
struct SavedWeights {
  SavedTensor w_ih, w_hh, b_ih, b_hh;
  explicit SavedWeights(const LayerWeights& w)
      : w_ih(w.w_ih, "RnnBackward"),
        w_hh(w.w_hh, "RnnBackward"),
        b_ih(w.b_ih, "RnnBackward"),
        b_hh(w.b_hh, "RnnBackward") {}
  LayerWeights get() const {
    return {w_ih.get(), w_hh.get(), b_ih.defined() ? b_ih.get() : Tensor(), b_hh.defined() ? b_hh.get() : Tensor()};
  }
};

// What one layer's forward keeps for its backward (all dense).
struct LayerSaved {
  SavedTensor x;    // S [T, B, in]: the layer's input (after dropout, above layer 0)
  SavedTensor out;  // S [T, B, H]: h at every step
  SavedTensor h0;   // S [B, H]
  Tensor cells;     // A [T + 1, B, H] (LSTM): c0, then c after each step
  Tensor gates;     // A [T, B, G H]
  Tensor hn;        // A [T, B, H] (GRU)
};

// What the autograd node keeps: per layer what its backward reads, and the dropout counters between layers.
struct Saved {
  std::vector<LayerSaved> layers;              // when training a graph
  std::vector<GeneratorState> dropout_states;  // per layer below the top, when dropout ran
};

struct Forward {
  Tensor output;  // S [T, B, H]: the last layer's h at every step
  TensorList h, c;  // per layer: [B, H] (S), [B, H] (A)
  Saved saved;
};

Forward run_forward(const Problem& p, const Tensor& input, const Tensor& h0, const Tensor& c0,
                    const std::vector<LayerWeights>& w, const RnnOptions& o, bool save) {
  const bool lstm = p.kind == RnnKind::LSTM, gru = p.kind == RnnKind::GRU;
  const TensorOptions storage{.dtype = p.storage, .device = p.device}, acc{.dtype = p.acc, .device = p.device};
  const int64_t GH = p.G * p.H;
  Forward f;
  Tensor x = input;
  for (int64_t l = 0; l < p.L; ++l) {
    Tensor gi = empty({p.T, p.B, GH}, acc), gh = empty({p.B, GH}, acc);
    Tensor out = empty({p.T, p.B, p.H}, storage);
    Tensor cells = lstm ? empty({p.T + 1, p.B, p.H}, acc) : Tensor();
    // Without a graph to train, the activations are not kept.
    Tensor gates = save ? empty({p.T, p.B, GH}, acc) : Tensor();
    Tensor hn = save && gru ? empty({p.T, p.B, p.H}, acc) : Tensor();
    const Tensor h_first = h0[l];
    if (lstm) cells[0].copy_(c0[l]);
    const LayerWeights& lw = w[size_t(l)];
    gemm(p, p.acc, p.T * p.B, GH, p.in(l), x.data_ptr(), Trans::No, lw.w_ih.data_ptr(), Trans::Yes, gi.data_ptr());
    rnn_loop_forward_kernel[p.device]({.kind = p.kind, .storage = p.storage, .device = p.device, .steps = p.T,
                                       .batch = p.B, .hidden = p.H, .w_hh = lw.w_hh.data_ptr(), .gi = gi.data_ptr(),
                                       .gh = gh.data_ptr(), .b_ih = data_or_null(lw.b_ih),
                                       .b_hh = data_or_null(lw.b_hh), .h0 = h_first.data_ptr(),
                                       .out = out.data_ptr(), .cells = data_or_null(cells),
                                       .gates = data_or_null(gates), .hn = data_or_null(hn)});
    f.output = out;
    f.h.push_back(out[p.T - 1]);
    if (lstm) f.c.push_back(cells[p.T]);
    if (save) {
      f.saved.layers.push_back({SavedTensor(x, "RnnBackward"), SavedTensor(out, "RnnBackward"),
                         SavedTensor(h_first, "RnnBackward"), cells, gates, hn});
    }
    x = out;
    if (l + 1 < p.L && o.training && o.dropout > 0 && out.numel() > 0) {
      const GeneratorState state = next_random_counters(uint64_t((out.numel() + 3) / 4));
      x = empty(out.shape(), storage);
      dropout_kernel[p.device](x, out, o.dropout, state);
      f.saved.dropout_states.push_back(state);
    }
  }
  return f;
}

struct Gradients {
  Tensor input, h0, c0;  // S [T, B, I], S [L, B, H], A [L, B, H]
  std::vector<LayerWeights> weights;
};

// needs: input, h0, c0, then each weight in the op's order (what the node's inputs want).
Gradients run_backward(const Problem& p, const Saved& f, const std::vector<LayerWeights>& w, const RnnOptions& o,
                       const Tensor& grad_output, const Tensor& grad_h, const Tensor& grad_c,
                       const std::vector<bool>& needs) {
  const bool lstm = p.kind == RnnKind::LSTM, gru = p.kind == RnnKind::GRU;
  const TensorOptions storage{.dtype = p.storage, .device = p.device};
  const int64_t GH = p.G * p.H;
  auto wants = [&](int64_t layer, int64_t which) { return bool(needs[size_t(3 + layer * p.per_layer() + which)]); };
  // The lowest layer a wanted gradient comes from: the backward pass stops there.
  int64_t lowest = needs[0] || needs[1] || needs[2] ? 0 : p.L;
  for (int64_t l = 0; l < p.L; ++l)
    for (int64_t k = 0; k < p.per_layer(); ++k)
      if (wants(l, k)) lowest = std::min(lowest, l);

  Gradients g;
  g.weights.resize(size_t(p.L));
  TensorList dh0(size_t(p.L)), dc0(size_t(p.L));
  Tensor dy = grad_output;  // S [T, B, H], the gradient of the current layer's output
  for (int64_t l = p.L - 1; l >= lowest; --l) {
    const LayerSaved& s = f.layers[size_t(l)];
    const Tensor x = s.x.get(), out = s.out.get(), h_first = s.h0.get();
    Tensor dh = owned(grad_h[l], p.acc), dc = lstm ? owned(grad_c[l], p.acc) : Tensor();
    Tensor dgi = empty({p.T, p.B, GH}, storage), dgh = gru ? empty({p.T, p.B, GH}, storage) : dgi;
    rnn_loop_backward_kernel[p.device]({.kind = p.kind, .storage = p.storage, .device = p.device, .steps = p.T,
                                        .batch = p.B, .hidden = p.H, .w_hh = w[l].w_hh.data_ptr(),
                                        .dy = dy.data_ptr(), .dh = dh.data_ptr(), .dc = data_or_null(dc),
                                        .gates = s.gates.data_ptr(), .cells = data_or_null(s.cells),
                                        .h0 = h_first.data_ptr(), .out = out.data_ptr(), .hn = data_or_null(s.hn),
                                        .dgi = dgi.data_ptr(), .dgh = gru ? dgh.data_ptr() : nullptr});
    // h0's gradient through the first step's product (a language model's detached state needs none).
    if (needs[1]) {
      gemm(p, p.acc, p.B, p.H, GH, dgh.data_ptr(), Trans::No, w[l].w_hh.data_ptr(), Trans::No, dh.data_ptr(), 1.0);
      dh0[size_t(l)] = dh;
    }
    if (lstm) dc0[size_t(l)] = dc;
    LayerWeights& gw = g.weights[size_t(l)];
    const int64_t in = p.in(l), rows = p.T * p.B;
    // Every step's h_prev is [h0; out[0 .. T - 2]].
    const Tensor out_prev = out.narrow(0, 0, p.T - 1).view({rows - p.B, p.H});
    if (wants(l, 0) && wants(l, 1) && one_weight_product(p, in)) {
      // dW_ih and dW_hh side by side: dgi^T [x | h_prev], the operand built in place by three copies.
      const Tensor inputs = empty({rows, in + p.H}, storage), both = empty({GH, in + p.H}, storage);
      inputs.narrow(1, 0, in).copy_(x.view({rows, in}));
      inputs.narrow(1, in, p.H).narrow(0, 0, p.B).copy_(h_first);
      inputs.narrow(1, in, p.H).narrow(0, p.B, rows - p.B).copy_(out_prev);
      gemm(p, p.storage, GH, in + p.H, rows, dgi.data_ptr(), Trans::Yes, inputs.data_ptr(), Trans::No,
           both.data_ptr());
      gw.w_ih = both.narrow(1, 0, in).contiguous();
      gw.w_hh = both.narrow(1, in, p.H).contiguous();
    } else {
      if (wants(l, 0)) {
        gw.w_ih = empty({GH, in}, storage);
        gemm(p, p.storage, GH, in, rows, dgi.data_ptr(), Trans::Yes, x.data_ptr(), Trans::No, gw.w_ih.data_ptr());
      }
      if (wants(l, 1)) {
        gw.w_hh = empty({GH, p.H}, storage);
        const Tensor h_prev = cat({h_first, out_prev}, 0);
        gemm(p, p.storage, GH, p.H, rows, dgh.data_ptr(), Trans::Yes, h_prev.data_ptr(), Trans::No,
             gw.w_hh.data_ptr());
      }
    }
    if (p.bias && (wants(l, 2) || wants(l, 3))) {
      // Where dgh is dgi (every kind but GRU) both biases have one gradient: summed once.
      const Tensor sum_i = dgi.view({rows, GH}).sum({0});
      if (wants(l, 2)) gw.b_ih = sum_i;
      if (wants(l, 3)) gw.b_hh = gru ? dgh.view({rows, GH}).sum({0}) : wants(l, 2) ? sum_i.clone() : sum_i;
    }
    if (l > lowest || (l == 0 && needs[0])) {
      Tensor dx = empty({p.T, p.B, in}, storage);
      gemm(p, p.storage, rows, in, GH, dgi.data_ptr(), Trans::No, w[l].w_ih.data_ptr(), Trans::No, dx.data_ptr());
      if (l > 0 && !f.dropout_states.empty()) {  // through the dropout below this layer
        Tensor through = empty(dx.shape(), storage);
        if (dx.numel() > 0) dropout_kernel[p.device](through, dx, o.dropout, f.dropout_states[size_t(l - 1)]);
        dx = through;
      }
      dy = dx;
    }
  }
  if (needs[0]) g.input = dy;
  if (needs[1]) g.h0 = stack(dh0, 0);
  if (needs[2]) g.c0 = stack(dc0, 0);
  return g;
}

void check_inputs(const Tensor& input, const Tensor& h0, const Tensor& c0, const TensorList& weights,
                  const RnnOptions& o) {
  const char* op = rnn_kind_name(o.kind);
  HG_CHECK(o.num_layers >= 1, "rnn ({}): num_layers must be positive, got {}", op, o.num_layers);
  HG_CHECK(o.dropout >= 0 && o.dropout < 1, "rnn ({}): dropout must be in [0, 1), got {}", op, o.dropout);
  HG_CHECK(input.defined() && input.dim() == 3 && input.is_floating_point(),
           "rnn ({}): expected a floating input [T, B, input_size], got {}", op,
           input.defined() ? input.meta() : "an undefined tensor");
  const int64_t L = o.num_layers;
  HG_CHECK(weights.size() == size_t(2 * L) || weights.size() == size_t(4 * L),
           "rnn ({}): expected 2 or 4 weights per layer for {} layers, got {} tensors", op, L, weights.size());
  const int64_t per_layer = int64_t(weights.size()) / L, G = rnn_gates(o.kind);
  HG_CHECK(weights[0].defined() && weights[0].dim() == 2 && weights[0].size(0) % G == 0,
           "rnn ({}): weight_ih_l0 must be [{} * hidden, input_size], got {}", op, G,
           weights[0].defined() ? weights[0].meta() : "an undefined tensor");
  HG_CHECK(input.size(0) >= 1, "rnn ({}): expected a sequence of at least one step, got input {}", op, input.meta());
  const int64_t H = weights[0].size(0) / G, B = input.size(1);
  for (int64_t l = 0; l < L; ++l) {
    const int64_t in = l == 0 ? input.size(2) : H;
    const std::string k = std::to_string(l);
    const std::pair<std::string, Shape> expected[] = {{"weight_ih_l" + k, {G * H, in}},
                                                      {"weight_hh_l" + k, {G * H, H}},
                                                      {"bias_ih_l" + k, {G * H}},
                                                      {"bias_hh_l" + k, {G * H}}};
    for (int64_t i = 0; i < per_layer; ++i) {
      const Tensor& w = weights[size_t(l * per_layer + i)];
      const auto& [name, shape] = expected[i];
      HG_CHECK(w.defined() && w.shape() == shape, "rnn ({}): {} must be {} for input {} and hidden size {}, got {}", op,
               name, shape_str(shape), input.meta(), H, w.defined() ? w.meta() : "an undefined tensor");
      HG_CHECK(w.dtype() == input.dtype() && w.device() == input.device(),
               "rnn ({}): {} {} and input {} must have the same dtype and device", op, name, w.meta(), input.meta());
    }
  }
  for (auto [s, name] : {std::pair{&h0, "h0"}, {&c0, "c0"}}) {
    if (!s->defined()) continue;
    HG_CHECK(s->shape() == Shape({L, B, H}), "rnn ({}): {} must be [num_layers, batch, hidden] = [{}, {}, {}], got {}",
             op, name, L, B, H, s->meta());
    HG_CHECK(s->dtype() == input.dtype() && s->device() == input.device(),
             "rnn ({}): {} {} and input {} must have the same dtype and device", op, name, s->meta(), input.meta());
  }
  HG_CHECK(o.kind == RnnKind::LSTM || !c0.defined(), "rnn ({}): only an LSTM takes a cell state c0", op);
}

// The recurrence of ops/rnn.h in ops that record, in the accumulation dtype: the forward formed again, for a pass with
// create_graph (the loop kernels serve every other pass). args: the op's arguments as its node's inputs (input, h0,
// c0, then the weights; h0 and c0 may be undefined: zeros); the dropout between layers draws the forward's masks from
// its counters. Each step's h is rounded to the storage dtype, as the kernels store it (float16 or bfloat16 on CUDA),
// and dropped out there. Returns the op's results (output, h, c or undefined), in `dtype`.
TensorList rnn_recorded(const TensorList& args, const Problem& p, const RnnOptions& o,
                        const std::vector<GeneratorState>& dropout_states, DType dtype) {
  const bool lstm = p.kind == RnnKind::LSTM;
  const int64_t H = p.H;
  auto in_acc = [&](const Tensor& t) { return t.defined() ? t.to(p.acc) : Tensor(); };
  auto stored = [&](const Tensor& t) { return p.storage == p.acc ? t : t.to(p.storage).to(p.acc); };
  auto gate = [&](const Tensor& g, int64_t k) { return g.narrow(1, k * H, H); };
  const Tensor h0 = in_acc(args[1]), c0 = in_acc(args[2]);
  auto initial = [&](const Tensor& states, int64_t l) {
    return states.defined() ? states[l] : zeros({p.B, H}, {.dtype = p.acc, .device = p.device});
  };
  Tensor x = in_acc(args[0]);
  TensorList last_h, last_c;
  for (int64_t l = 0; l < p.L; ++l) {
    const Tensor* w = &args[size_t(3 + l * p.per_layer())];
    const Tensor w_hh = in_acc(w[1]), b_hh = p.bias ? in_acc(w[3]) : Tensor();
    const Tensor gi = linear(x, in_acc(w[0]), p.bias ? in_acc(w[2]) : Tensor());  // [T, B, G H]: every step's
    Tensor h = initial(h0, l), c = lstm ? initial(c0, l) : Tensor();
    TensorList steps;
    for (int64_t t = 0; t < p.T; ++t) {
      const Tensor gx = gi[t], gh = linear(h, w_hh, b_hh);
      switch (p.kind) {
        case RnnKind::RNNTanh: h = tanh(gx + gh); break;
        case RnnKind::RNNReLU: h = relu(gx + gh); break;
        case RnnKind::GRU: {
          const Tensor r = sigmoid(gate(gx, 0) + gate(gh, 0)), z = sigmoid(gate(gx, 1) + gate(gh, 1));
          const Tensor n = tanh(gate(gx, 2) + r * gate(gh, 2));
          h = (1.0 - z) * n + z * h;
          break;
        }
        case RnnKind::LSTM: {
          const Tensor gates = gx + gh;
          c = sigmoid(gate(gates, 1)) * c + sigmoid(gate(gates, 0)) * tanh(gate(gates, 2));
          h = sigmoid(gate(gates, 3)) * tanh(c);
          break;
        }
      }
      h = stored(h);
      steps.push_back(h);
    }
    last_h.push_back(h);
    if (lstm) last_c.push_back(c);
    x = stack(steps, 0);
    if (l + 1 < p.L && o.training && o.dropout > 0 && x.numel() > 0) {  // run_forward's condition: a state per layer
      x = dropout_masked(x.to(p.storage), o.dropout, dropout_states[size_t(l)]).to(p.acc);
    }
  }
  return {x.to(dtype), stack(last_h, 0).to(dtype), lstm ? stack(last_c, 0).to(dtype) : Tensor()};
}

// RnnBackward in a pass with create_graph: the recurrence formed again in ops that record (rnn_recorded) from the
// arguments with their histories, and differentiated by a pass of its own, itself with create_graph, so that the
// gradients it returns can be differentiated again. Each wanted argument enters through a view of its own, where that
// pass stops instead of going on into the argument's history (which the outer pass walks).
TensorList rnn_backward_recorded(const GradContext& ctx, const std::vector<SavedTensor>& arguments, const Problem& p,
                                 const RnnOptions& o, const Saved& saved, DType dtype) {
  TensorList args, wanted;
  std::vector<size_t> wanted_at;
  for (size_t i = 0; i < arguments.size(); ++i) {
    Tensor t = arguments[i].defined() ? arguments[i].get() : Tensor();
    // (a leaf may have stopped requiring grad since the forward: its gradient goes nowhere, as AccumulateGrad drops it)
    if (t.defined() && ctx.needs(i) && t.requires_grad()) {
      t = t.view(t.shape());
      wanted.push_back(t);
      wanted_at.push_back(i);
    }
    args.push_back(t);
  }
  TensorList grads(arguments.size());
  if (wanted.empty()) return grads;
  const TensorList results = rnn_recorded(args, p, o, saved.dropout_states, dtype);
  TensorList outputs{results[0], results[1]}, grad_outputs{ctx[0], ctx[1]};
  if (results[2].defined()) {
    outputs.push_back(results[2]);
    grad_outputs.push_back(ctx[2]);
  }
  const TensorList found =
      autograd::grad(outputs, wanted, grad_outputs, std::nullopt, /*create_graph=*/true, /*allow_unused=*/true);
  for (size_t k = 0; k < wanted.size(); ++k) grads[wanted_at[k]] = found[k];
  return grads;
}

}  // namespace

RnnResult rnn(const Tensor& input, const Tensor& h0, const Tensor& c0, const TensorList& weights,
              const RnnOptions& options) {
  HG_AUTOCAST(rnn, input, h0, c0, weights, options);
  check_inputs(input, h0, c0, weights, options);
  const RnnKind kind = options.kind;
  const bool lstm = kind == RnnKind::LSTM;
  const int64_t L = options.num_layers, per_layer = int64_t(weights.size()) / L, G = rnn_gates(kind);
  const DType dtype = input.dtype(), storage = storage_dtype(dtype, input.device());
  const Problem p{kind, input.size(0),  input.size(1), input.size(2),      weights[0].size(0) / G, L,
                  G,    per_layer == 4, storage,       accumulation_dtype(storage), input.device()};

  std::vector<LayerWeights> w(static_cast<size_t>(L));
  for (int64_t l = 0; l < L; ++l) {
    const Tensor* lw = &weights[size_t(l * per_layer)];
    w[size_t(l)] = {dense(lw[0], storage), dense(lw[1], storage), p.bias ? dense(lw[2], storage) : Tensor(),
                    p.bias ? dense(lw[3], storage) : Tensor()};
  }
  const TensorOptions state{.dtype = storage, .device = p.device};
  const Tensor h_init = h0.defined() ? dense(h0, storage) : zeros({L, p.B, p.H}, state);
  const Tensor c_init = !lstm          ? Tensor()
                        : c0.defined() ? dense(c0, p.acc)
                                       : zeros({L, p.B, p.H}, {.dtype = p.acc, .device = p.device});
  TensorList inputs{input, h0, c0};
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  const bool save = any_requires_grad(inputs);
  const Tensor x = dense(input, storage);

  cuda::DeviceGuard device(p.device);
  RnnResult result;
  auto saved = std::make_shared<Saved>();  // the node's; it holds none of the results, which hold the node
  {
    NoGradGuard no_grad;
    Forward f = run_forward(p, x, h_init, c_init, w, options, save);
    result.output = cast_nograd(f.output, dtype);
    result.h = cast_nograd(stack(f.h, 0), dtype);
    if (lstm) result.c = cast_nograd(stack(f.c, 0), dtype);
    *saved = std::move(f.saved);
  }
  if (save) {
    std::vector<SavedWeights> saved_w(w.begin(), w.end());
    // The arguments as the kernels read them, with their histories: what a pass with create_graph forms the
    // recurrence again from (the dense copies the forward keeps anyway, where it made any; c0 itself, not its copy).
    std::vector<SavedTensor> arguments{SavedTensor(input, x, "RnnBackward"), SavedTensor(h0, h_init, "RnnBackward"),
                                       SavedTensor(c0, "RnnBackward")};
    for (int64_t l = 0; l < L; ++l) {
      const LayerWeights& lw = w[size_t(l)];
      const Tensor* values[] = {&lw.w_ih, &lw.w_hh, &lw.b_ih, &lw.b_hh};
      for (int64_t k = 0; k < per_layer; ++k)
        arguments.emplace_back(weights[size_t(l * per_layer + k)], *values[k], "RnnBackward");
    }
    record("RnnBackward", inputs, result.tensors(),
           [p, saved, saved_w, arguments = std::move(arguments), options, dtype](const GradContext& ctx)
               -> TensorList {
             cuda::DeviceGuard device(p.device);
             if (GradMode::is_enabled()) return rnn_backward_recorded(ctx, arguments, p, options, *saved, dtype);
             std::vector<LayerWeights> w;
             for (const SavedWeights& s : saved_w) w.push_back(s.get());
             std::vector<bool> needs;
             for (size_t i = 0; i < size_t(3 + p.L * p.per_layer()); ++i) needs.push_back(ctx.needs(i));
             const Tensor grad_c = p.kind == RnnKind::LSTM ? ctx[2] : Tensor();
             const Gradients g = run_backward(p, *saved, w, options, dense(ctx[0], p.storage), ctx[1], grad_c, needs);
             auto back = [&](const Tensor& t) { return t.defined() ? cast_nograd(t, dtype) : Tensor(); };
             TensorList grads{back(g.input), back(g.h0), back(g.c0)};
             for (const LayerWeights& lw : g.weights) {
               grads.push_back(back(lw.w_ih)), grads.push_back(back(lw.w_hh));
               if (p.bias) grads.push_back(back(lw.b_ih)), grads.push_back(back(lw.b_hh));
             }
             return grads;
           }, DoubleBackward::Supported);
  }
  return result;
}

// ---- CPU kernels: per step a GEMM, then rows of hidden units, each element through the shared cell arithmetic;
// threads over the elements when there are enough of them to pay for the fork.
namespace {

template <typename Cell>
void for_each_unit(int64_t B, int64_t H, RnnKind kind, const Cell& cell) {
  rnn_cell::dispatch_kind(kind, [&]<RnnKind K>() {
    const int64_t n = B * H;
#pragma omp parallel for schedule(static) if (n >= 32768)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < H; ++j) cell.template operator()<K>(b, j);
  });
}

template <typename S> constexpr bool kCpuStorage = std::is_same_v<S, float> || std::is_same_v<S, double>;

// Per step: the recurrent product (gemm_dense), then the cell over every unit.
void rnn_loop_forward_cpu(const RnnLoopForwardArgs& a) {
  const int64_t G = rnn_gates(a.kind), GH = G * a.hidden;
  dispatch_floating(a.storage, "rnn", [&]<typename S>() {
    HG_CHECK(kCpuStorage<S>, "rnn (cpu): {} operands are widened to float32 before the kernels", dtype_name(a.storage));
    if constexpr (kCpuStorage<S>) {
      for (int64_t t = 0; t < a.steps; ++t) {
        const rnn_cell::Forward<S> cell(a, G, t);
        gemm_dense(a.device, a.storage, accumulation_dtype(a.storage), a.batch, GH, a.hidden, cell.h_prev, Trans::No,
                   a.w_hh, Trans::Yes, a.gh, 0.0);
        for_each_unit(a.batch, a.hidden, a.kind, cell);
      }
    }
  });
}

void rnn_loop_backward_cpu(const RnnLoopBackwardArgs& a) {
  const int64_t G = rnn_gates(a.kind), GH = G * a.hidden;
  dispatch_floating(a.storage, "rnn backward", [&]<typename S>() {
    HG_CHECK(kCpuStorage<S>, "rnn backward (cpu): {} operands are widened to float32 before the kernels",
             dtype_name(a.storage));
    if constexpr (kCpuStorage<S>) {
      for (int64_t t = a.steps - 1; t >= 0; --t) {
        if (t + 1 < a.steps) {
          const rnn_cell::Backward<S> next(a, G, t + 1);
          gemm_dense(a.device, a.storage, accumulation_dtype(a.storage), a.batch, a.hidden, GH,
                     next.recurrent_gradient(), Trans::No, a.w_hh, Trans::No, a.dh, 1.0);
        }
        for_each_unit(a.batch, a.hidden, a.kind, rnn_cell::Backward<S>(a, G, t));
      }
    }
  });
}

}  // namespace

HG_REGISTER_KERNEL(rnn_loop_forward_kernel, CPU, rnn_loop_forward_cpu);
HG_REGISTER_KERNEL(rnn_loop_backward_kernel, CPU, rnn_loop_backward_cpu);

}  // namespace halfgrad

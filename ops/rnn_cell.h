#pragma once
// The gate arithmetic of one recurrent step, once for both devices: the CPU loops (ops/rnn.cpp) and the CUDA
// kernels (ops/rnn.cu) call these for each (row b, hidden unit j) of step t. S is the storage type, A =
// opmath_t<S> the type every value is computed in. The equations are those of ops/rnn.h; the backward follows from them:
//
//   LSTM  tc = tanh(c'); dh = dy + dh'; dc = dc' + dh o (1 - tc^2)
//         d(pre_i) = dc g i (1 - i), d(pre_f) = dc c f (1 - f), d(pre_g) = dc i (1 - g^2),
//         d(pre_o) = dh tc o (1 - o); dc_prev = dc f
//   GRU   dn = dh (1 - z); dz = dh (h - n); dh_prev (elementwise part) = dh z
//         d(pre_n) = dn (1 - n^2) for W_in x, d(pre_n) r for W_hn h; dr = d(pre_n) hn
//         d(pre_r) = dr r (1 - r), d(pre_z) = dz z (1 - z), the same for both projections
//   RNN   d(pre) = dh (1 - h'^2) (tanh) or dh [h' > 0] (relu)
#include <cstdint>

#include "core/dtype.h"
#include "core/half.h"
#include "ops/elementwise_math.h"
#include "ops/rnn.h"

namespace halfgrad::rnn_cell {

// The gates of a unit: rnn_gates (ops/rnn.h) as a constant of the kind.
template <RnnKind K> constexpr int kGates = K == RnnKind::LSTM ? 4 : K == RnnKind::GRU ? 3 : 1;

template <typename A>
HG_HOST_DEVICE inline A sigmoid(A x) {
  return unary_math<UnaryOp::Sigmoid>(x);
}
template <typename A>
HG_HOST_DEVICE inline A tanh(A x) {
  return unary_math<UnaryOp::Tanh>(x);
}
template <typename A>
HG_HOST_DEVICE inline A relu(A x) {
  return unary_math<UnaryOp::Relu>(x);
}

// What a forward cell reads for unit j of row b: gate k's input term (W_ih x + b_ih) and recurrent term (W_hh h +
// b_hh), and the unit's previous cell state (LSTM) or hidden state (GRU). Forward::inputs gathers them from the step's
// buffers; the persistent CUDA kernel gathers the input terms early and keeps the rest on chip.
template <typename A>
struct ForwardInputs {
  A in[4], rec[4];
  A c_prev = A(0), h_prev = A(0);
};

template <typename S>
struct Forward {
  using A = opmath_t<S>;
  int64_t H, G;  // hidden units, gates
  const A *gi, *gh;
  const S *b_ih, *b_hh, *h_prev;
  const A* c_prev;
  S* h;
  A *c, *gates, *hn;

  // Step t of a layer's loop (ops/rnn.h); G = rnn_gates(a.kind).
  HG_HOST_DEVICE Forward(const RnnLoopForwardArgs& a, int64_t gates_per_unit, int64_t t)
      : H(a.hidden),
        G(gates_per_unit),
        gi(static_cast<const A*>(a.gi) + t * a.batch * G * H),
        gh(static_cast<const A*>(a.gh)),
        b_ih(static_cast<const S*>(a.b_ih)),
        b_hh(static_cast<const S*>(a.b_hh)),
        h_prev(t == 0 ? static_cast<const S*>(a.h0) : static_cast<const S*>(a.out) + (t - 1) * a.batch * H),
        c_prev(a.cells ? static_cast<const A*>(a.cells) + t * a.batch * H : nullptr),
        h(static_cast<S*>(a.out) + t * a.batch * H),
        c(a.cells ? static_cast<A*>(a.cells) + (t + 1) * a.batch * H : nullptr),
        gates(a.gates ? static_cast<A*>(a.gates) + t * a.batch * G * H : nullptr),
        hn(a.hn ? static_cast<A*>(a.hn) + t * a.batch * H : nullptr) {}

  // Gate k's input and recurrent terms with their biases, for unit j of row b.
  HG_HOST_DEVICE A input_term(int64_t b, int64_t k, int64_t j) const {
    const int64_t col = k * H + j;
    return gi[b * G * H + col] + (b_ih ? A(b_ih[col]) : A(0));
  }
  // Gate k's recurrent term from its product (W_hh h) for unit j.
  HG_HOST_DEVICE A recurrent_term_of(A product, int64_t k, int64_t j) const {
    return product + (b_hh ? A(b_hh[k * H + j]) : A(0));
  }
  HG_HOST_DEVICE A recurrent_term(int64_t b, int64_t k, int64_t j) const {
    return recurrent_term_of(gh[b * G * H + k * H + j], k, j);
  }
  HG_HOST_DEVICE void save_gate(int64_t b, int64_t k, int64_t j, A v) const {
    if (gates) gates[b * G * H + k * H + j] = v;
  }

  template <RnnKind K>
  HG_HOST_DEVICE ForwardInputs<A> inputs(int64_t b, int64_t j) const {
    ForwardInputs<A> x;
    for (int k = 0; k < kGates<K>; ++k) x.in[k] = input_term(b, k, j), x.rec[k] = recurrent_term(b, k, j);
    if constexpr (K == RnnKind::LSTM) x.c_prev = c_prev[b * H + j];
    if constexpr (K == RnnKind::GRU) x.h_prev = A(h_prev[b * H + j]);
    return x;
  }

  // The cell of unit j, row b, on its inputs: writes h, c (LSTM), the saved gates and hn (GRU); returns c (LSTM).
  template <RnnKind K>
  HG_HOST_DEVICE A apply(int64_t b, int64_t j, const ForwardInputs<A>& x) const {
    const int64_t e = b * H + j;
    if constexpr (K == RnnKind::LSTM) {
      const A i = sigmoid(x.in[0] + x.rec[0]);
      const A f = sigmoid(x.in[1] + x.rec[1]);
      const A g = tanh(x.in[2] + x.rec[2]);
      const A o = sigmoid(x.in[3] + x.rec[3]);
      const A cell = f * x.c_prev + i * g;
      c[e] = cell;
      h[e] = S(o * tanh(cell));
      save_gate(b, 0, j, i), save_gate(b, 1, j, f), save_gate(b, 2, j, g), save_gate(b, 3, j, o);
      return cell;
    } else if constexpr (K == RnnKind::GRU) {
      const A r = sigmoid(x.in[0] + x.rec[0]);
      const A z = sigmoid(x.in[1] + x.rec[1]);
      const A hidden_n = x.rec[2];
      const A n = tanh(x.in[2] + r * hidden_n);
      h[e] = S(n + z * (x.h_prev - n));
      save_gate(b, 0, j, r), save_gate(b, 1, j, z), save_gate(b, 2, j, n);
      if (hn) hn[e] = hidden_n;
    } else {
      const A out = K == RnnKind::RNNTanh ? tanh(x.in[0] + x.rec[0]) : relu(x.in[0] + x.rec[0]);
      h[e] = S(out);
      save_gate(b, 0, j, out);
    }
    return A(0);
  }

  template <RnnKind K>
  HG_HOST_DEVICE void operator()(int64_t b, int64_t j) const {
    apply<K>(b, j, inputs<K>(b, j));
  }
};

// What a backward cell reads for unit j of row b, all written before the loop: the gradient from above (dy), the
// saved gate activations, the cell states (LSTM) or the previous hidden state and W_hn h + b_hn (GRU).
template <typename A>
struct BackwardInputs {
  A dy = A(0), gate[4];
  A c = A(0), c_prev = A(0), h_prev = A(0), hn = A(0);
};
// The gradients a backward cell carries from step to step for its unit: dh (without dy) and dc (LSTM).
template <typename A>
struct BackwardCarry {
  A dh = A(0), dc = A(0);
};

template <typename S>
struct Backward {
  using A = opmath_t<S>;
  int64_t H, G;
  const S* dy;
  A *dh, *dc;
  const A *gates, *c, *c_prev;
  const S* h_prev;
  const A* hn;
  S *dgi, *dgh;

  // Step t of a layer's loop (ops/rnn.h); G = rnn_gates(a.kind).
  HG_HOST_DEVICE Backward(const RnnLoopBackwardArgs& a, int64_t gates_per_unit, int64_t t)
      : H(a.hidden),
        G(gates_per_unit),
        dy(static_cast<const S*>(a.dy) + t * a.batch * H),
        dh(static_cast<A*>(a.dh)),
        dc(static_cast<A*>(a.dc)),
        gates(static_cast<const A*>(a.gates) + t * a.batch * G * H),
        c(a.cells ? static_cast<const A*>(a.cells) + (t + 1) * a.batch * H : nullptr),
        c_prev(a.cells ? static_cast<const A*>(a.cells) + t * a.batch * H : nullptr),
        h_prev(t == 0 ? static_cast<const S*>(a.h0) : static_cast<const S*>(a.out) + (t - 1) * a.batch * H),
        hn(a.hn ? static_cast<const A*>(a.hn) + t * a.batch * H : nullptr),
        dgi(static_cast<S*>(a.dgi) + t * a.batch * G * H),
        dgh(a.dgh ? static_cast<S*>(a.dgh) + t * a.batch * G * H : nullptr) {}

  // [B, G H]: this step's gradients of W_hh h_prev's pre-activations, which reach h_prev through W_hh.
  HG_HOST_DEVICE const S* recurrent_gradient() const { return dgh ? dgh : dgi; }
  // The gradient of gate k's pre-activation, the same for both projections.
  HG_HOST_DEVICE void put(int64_t b, int64_t k, int64_t j, A v) const {
    dgi[b * G * H + k * H + j] = S(v);
    if (dgh) dgh[b * G * H + k * H + j] = S(v);
  }

  template <RnnKind K>
  HG_HOST_DEVICE BackwardInputs<A> inputs(int64_t b, int64_t j) const {
    const int64_t e = b * H + j;
    BackwardInputs<A> x;
    x.dy = A(dy[e]);
    for (int k = 0; k < kGates<K>; ++k) x.gate[k] = gates[b * G * H + k * H + j];
    if constexpr (K == RnnKind::LSTM) x.c = c[e], x.c_prev = c_prev[e];
    if constexpr (K == RnnKind::GRU) x.h_prev = A(h_prev[e]), x.hn = hn[e];
    return x;
  }

  // The cell's backward for unit j, row b, on its inputs and the carried gradients: writes dgi (and dgh) and returns
  // the gradients carried to step t - 1 (dh: the part that does not go through W_hh).
  template <RnnKind K>
  HG_HOST_DEVICE BackwardCarry<A> apply(int64_t b, int64_t j, const BackwardInputs<A>& x, BackwardCarry<A> in) const {
    const A grad_h = x.dy + in.dh;
    if constexpr (K == RnnKind::LSTM) {
      const A i = x.gate[0], f = x.gate[1], g = x.gate[2], o = x.gate[3];
      const A tc = tanh(x.c);
      const A grad_c = in.dc + grad_h * o * (A(1) - tc * tc);
      put(b, 0, j, grad_c * g * i * (A(1) - i));
      put(b, 1, j, grad_c * x.c_prev * f * (A(1) - f));
      put(b, 2, j, grad_c * i * (A(1) - g * g));
      put(b, 3, j, grad_h * tc * o * (A(1) - o));
      return {A(0), grad_c * f};
    } else if constexpr (K == RnnKind::GRU) {
      const A r = x.gate[0], z = x.gate[1], n = x.gate[2];
      const A grad_pre_n = grad_h * (A(1) - z) * (A(1) - n * n);
      const A grad_r = grad_pre_n * x.hn;
      const A grad_z = grad_h * (x.h_prev - n);
      const int64_t row = b * G * H;
      dgi[row + j] = dgh[row + j] = S(grad_r * r * (A(1) - r));
      dgi[row + H + j] = dgh[row + H + j] = S(grad_z * z * (A(1) - z));
      dgi[row + 2 * H + j] = S(grad_pre_n);
      dgh[row + 2 * H + j] = S(grad_pre_n * r);
      return {grad_h * z, A(0)};
    } else {
      const A out = x.gate[0];
      put(b, 0, j, K == RnnKind::RNNTanh ? grad_h * (A(1) - out * out) : (out > A(0) ? grad_h : A(0)));
      return {A(0), A(0)};
    }
  }

  template <RnnKind K>
  HG_HOST_DEVICE void operator()(int64_t b, int64_t j) const {
    const int64_t e = b * H + j;
    const BackwardCarry<A> out = apply<K>(b, j, inputs<K>(b, j), {dh[e], K == RnnKind::LSTM ? dc[e] : A(0)});
    dh[e] = out.dh;
    if constexpr (K == RnnKind::LSTM) dc[e] = out.dc;
  }
};

// Calls fn.template operator()<K>() with the kind as a template argument, so each kernel is compiled per kind.
template <typename Fn>
decltype(auto) dispatch_kind(RnnKind kind, Fn&& fn) {
  switch (kind) {
    case RnnKind::RNNTanh:
      return fn.template operator()<RnnKind::RNNTanh>();
    case RnnKind::RNNReLU:
      return fn.template operator()<RnnKind::RNNReLU>();
    case RnnKind::GRU:
      return fn.template operator()<RnnKind::GRU>();
    default:
      return fn.template operator()<RnnKind::LSTM>();
  }
}

}  // namespace halfgrad::rnn_cell

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
  HG_HOST_DEVICE A recurrent_term(int64_t b, int64_t k, int64_t j) const {
    const int64_t col = k * H + j;
    return gh[b * G * H + col] + (b_hh ? A(b_hh[col]) : A(0));
  }
  HG_HOST_DEVICE void save_gate(int64_t b, int64_t k, int64_t j, A v) const {
    if (gates) gates[b * G * H + k * H + j] = v;
  }

  template <RnnKind K>
  HG_HOST_DEVICE void operator()(int64_t b, int64_t j) const {
    const int64_t e = b * H + j;
    if constexpr (K == RnnKind::LSTM) {
      const A i = sigmoid(input_term(b, 0, j) + recurrent_term(b, 0, j));
      const A f = sigmoid(input_term(b, 1, j) + recurrent_term(b, 1, j));
      const A g = tanh(input_term(b, 2, j) + recurrent_term(b, 2, j));
      const A o = sigmoid(input_term(b, 3, j) + recurrent_term(b, 3, j));
      const A cell = f * c_prev[e] + i * g;
      c[e] = cell;
      h[e] = S(o * tanh(cell));
      save_gate(b, 0, j, i), save_gate(b, 1, j, f), save_gate(b, 2, j, g), save_gate(b, 3, j, o);
    } else if constexpr (K == RnnKind::GRU) {
      const A r = sigmoid(input_term(b, 0, j) + recurrent_term(b, 0, j));
      const A z = sigmoid(input_term(b, 1, j) + recurrent_term(b, 1, j));
      const A hidden_n = recurrent_term(b, 2, j);
      const A n = tanh(input_term(b, 2, j) + r * hidden_n);
      h[e] = S(n + z * (A(h_prev[e]) - n));
      save_gate(b, 0, j, r), save_gate(b, 1, j, z), save_gate(b, 2, j, n);
      if (hn) hn[e] = hidden_n;
    } else {
      const A pre = input_term(b, 0, j) + recurrent_term(b, 0, j);
      const A out = K == RnnKind::RNNTanh ? tanh(pre) : relu(pre);
      h[e] = S(out);
      save_gate(b, 0, j, out);
    }
  }
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

  HG_HOST_DEVICE A gate(int64_t b, int64_t k, int64_t j) const { return gates[b * G * H + k * H + j]; }
  // [B, G H]: this step's gradients of W_hh h_prev's pre-activations, which reach h_prev through W_hh.
  HG_HOST_DEVICE const S* recurrent_gradient() const { return dgh ? dgh : dgi; }
  // The gradient of gate k's pre-activation, the same for both projections.
  HG_HOST_DEVICE void put(int64_t b, int64_t k, int64_t j, A v) const {
    dgi[b * G * H + k * H + j] = S(v);
    if (dgh) dgh[b * G * H + k * H + j] = S(v);
  }

  template <RnnKind K>
  HG_HOST_DEVICE void operator()(int64_t b, int64_t j) const {
    const int64_t e = b * H + j;
    const A grad_h = A(dy[e]) + dh[e];
    if constexpr (K == RnnKind::LSTM) {
      const A i = gate(b, 0, j), f = gate(b, 1, j), g = gate(b, 2, j), o = gate(b, 3, j);
      const A tc = tanh(c[e]);
      const A grad_c = dc[e] + grad_h * o * (A(1) - tc * tc);
      put(b, 0, j, grad_c * g * i * (A(1) - i));
      put(b, 1, j, grad_c * c_prev[e] * f * (A(1) - f));
      put(b, 2, j, grad_c * i * (A(1) - g * g));
      put(b, 3, j, grad_h * tc * o * (A(1) - o));
      dc[e] = grad_c * f;
      dh[e] = A(0);
    } else if constexpr (K == RnnKind::GRU) {
      const A r = gate(b, 0, j), z = gate(b, 1, j), n = gate(b, 2, j);
      const A grad_pre_n = grad_h * (A(1) - z) * (A(1) - n * n);
      const A grad_r = grad_pre_n * hn[e];
      const A grad_z = grad_h * (A(h_prev[e]) - n);
      const int64_t row = b * G * H;
      dgi[row + j] = dgh[row + j] = S(grad_r * r * (A(1) - r));
      dgi[row + H + j] = dgh[row + H + j] = S(grad_z * z * (A(1) - z));
      dgi[row + 2 * H + j] = S(grad_pre_n);
      dgh[row + 2 * H + j] = S(grad_pre_n * r);
      dh[e] = grad_h * z;
    } else {
      const A out = gate(b, 0, j);
      put(b, 0, j, K == RnnKind::RNNTanh ? grad_h * (A(1) - out * out) : (out > A(0) ? grad_h : A(0)));
      dh[e] = A(0);
    }
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

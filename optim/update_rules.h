#pragma once
// The optimizers' update rules for one element, written once for both devices: the CPU loops (optim/fused.cpp) and
// the CUDA kernels (optim/fused.cu) call these. M is the arithmetic type (opmath_t of the storage type: float for
// float16 and bfloat16); the callers read every value in M and round once when they store.
//
// torch.optim.SGD:
//   g = grad_scale * grad                                   (the callers: grad_scale is 1 unless given)
//   g = g + weight_decay * p                                (decay: weight_decay != 0)
//   b = first ? g : momentum * b + (1 - dampening) * g      (with momentum; first: the buffer is new)
//   g = nesterov ? g + momentum * b : b                     (with momentum)
//   p = p - lr * g
//
// torch.optim.Adam / AdamW (PyTorch's update, eps outside the square root):
//   Adam:  g = grad + weight_decay * p                      (decay)
//   AdamW: p = p * (1 - lr * weight_decay)                  (decay, decoupled)
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g^2
//   v_max = max(v_max, v), then v_max in place of v below   (amsgrad)
//   p = p - step_size * m / (sqrt(v) / bias_correction2_sqrt + eps)
// with, from the parameter's own step count t (1 on its first step):
//   step_size = lr / (1 - beta1^t),   bias_correction2_sqrt = sqrt(1 - beta2^t)
//
// torch.optim.RMSprop:
//   g = grad + weight_decay * p                             (decay)
//   square_avg = alpha * square_avg + (1 - alpha) * g^2
//   grad_avg = lerp(grad_avg, g, 1 - alpha)                 (centered; PyTorch's lerp, below)
//   avg = sqrt(square_avg - grad_avg^2) + eps               (centered; else sqrt(square_avg) + eps)
//   b = momentum * b + g / avg, p = p - lr * b              (with momentum)
//   p = p - lr * g / avg                                    (without)
//
// torch.optim.Adagrad:
//   g = grad + weight_decay * p                             (decay)
//   sum = sum + g^2
//   p = p - clr * g / (sqrt(sum) + eps)
// with clr = lr / (1 + (t - 1) * lr_decay) from the parameter's own step count t (1 on its first step).
//
// The flags are plain bools: the CPU loops pass compile-time constants, so that after inlining a loop has no
// branches and vectorises; the CUDA kernels pass what they read.
#include <cmath>

#include "core/half.h"

namespace halfgrad::optim {

template <typename M> struct SGDScalars {
  M lr, momentum, one_minus_dampening, weight_decay;
};

// The parameter's new value from p and the gradient g as read (times grad_scale). With momentum, b is the momentum
// buffer, read unless first and written; the caller stores it.
template <typename M>
HG_HOST_DEVICE inline M sgd_update(M p, M g, M& b, const SGDScalars<M>& s, bool momentum, bool first, bool nesterov,
                                   bool decay) {
  if (decay) g = g + s.weight_decay * p;
  if (momentum) {
    b = first ? g : s.momentum * b + s.one_minus_dampening * g;
    g = nesterov ? g + s.momentum * b : b;
  }
  return p - s.lr * g;
}

template <typename M> struct AdamScalars {
  M beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay;
  M decay_factor;  // AdamW's 1 - lr * weight_decay
};

// The parameter's new value; m and v (and v_max with amsgrad) are updated in place for the caller to store.
template <typename M>
HG_HOST_DEVICE inline M adam_update(M p, M g, M& m, M& v, M& v_max, M step_size, M bias_correction2_sqrt,
                                    const AdamScalars<M>& s, bool amsgrad, bool decoupled, bool decay) {
  using std::sqrt;
  if (decay) {
    if (decoupled)
      p = p * s.decay_factor;
    else
      g = g + s.weight_decay * p;
  }
  m = s.beta1 * m + s.one_minus_beta1 * g;
  v = s.beta2 * v + s.one_minus_beta2 * g * g;
  M second = v;
  if (amsgrad) {
    v_max = v_max < v ? v : v_max;  // std::max's choice, as PyTorch's fused kernel
    second = v_max;
  }
  return p - step_size * m / (sqrt(second) / bias_correction2_sqrt + s.eps);
}

// The parameter's new value; sum is updated in place for the caller to store.
template <typename M>
HG_HOST_DEVICE inline M adagrad_update(M p, M g, M& sum, M clr, M eps, M weight_decay, bool decay) {
  using std::sqrt;
  if (decay) g = g + weight_decay * p;
  sum = sum + g * g;
  return p - clr * g / (sqrt(sum) + eps);
}

template <typename M> struct RMSpropScalars {
  M lr, alpha, one_minus_alpha, eps, weight_decay, momentum;
};

// The parameter's new value; square_avg (and grad_avg when centered, b with momentum) are updated in place for the
// caller to store.
template <typename M>
HG_HOST_DEVICE inline M rmsprop_update(M p, M g, M& square_avg, M& grad_avg, M& b, const RMSpropScalars<M>& s,
                                       bool centered, bool momentum, bool decay) {
  using std::sqrt;
  if (decay) g = g + s.weight_decay * p;
  square_avg = s.alpha * square_avg + s.one_minus_alpha * g * g;
  M avg;
  if (centered) {
    // torch.lerp's two forms, as PyTorch picks them by the weight: each is exact at its end of the range.
    const M w = s.one_minus_alpha;
    grad_avg = w < M(0.5) ? grad_avg + w * (g - grad_avg) : g - (g - grad_avg) * (M(1) - w);
    avg = sqrt(square_avg - grad_avg * grad_avg) + s.eps;
  } else {
    avg = sqrt(square_avg) + s.eps;
  }
  if (momentum) {
    b = s.momentum * b + g / avg;
    return p - s.lr * b;
  }
  return p - s.lr * g / avg;
}

}  // namespace halfgrad::optim

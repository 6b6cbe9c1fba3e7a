#pragma once
// Gradient clipping by the total norm (torch.nn.utils.clip_grad_norm_), and by value (clip_grad_value_).
//
//   Tensor norm = clip_grad_norm_(model.parameters(), /*max_norm=*/1.0);
//   if (step % 100 == 0) log(norm.item<double>());     // reading it is the only host synchronisation
//
// No host synchronisation: the norm is computed on the gradients' device (one fused pass over all gradients
// of a dtype, optim/fused.h), the clip coefficient min(1, max_norm / (norm + 1e-6)) is computed there as a
// 0-d tensor, and every gradient is multiplied by it (one more fused pass), whether or not it is below 1,
// exactly as PyTorch does to avoid the sync. With loss scaling, unscale the gradients first
// (GradScaler::unscale_). A non-finite norm makes every gradient non-finite or zero (a nan norm: a nan coefficient,
// and so nan gradients; an infinite one: a coefficient of 0, finite gradients 0 and infinite ones nan), as PyTorch:
// the step a GradScaler would skip anyway.
#include "core/tensor.h"

namespace halfgrad::optim {

// The total norm of the gradients of `params` (those without a gradient are left out), as if all of them
// were concatenated into one vector: (sum |g|^p)^(1/p), or max |g| for norm_type = inf. A 0-d tensor on the
// first gradient's device, float64 when every gradient is float64, else float32 (float16 gradients are
// accumulated in float32, so a norm above 65504 does not overflow). 0 on the CPU when no parameter has a
// gradient.
Tensor grad_norm(const TensorList& params, double norm_type = 2.0);

// Scales the gradients of `params` in place so that their total norm is at most max_norm, and returns the
// total norm before clipping (as grad_norm). norm_type: any p > 0, or INFINITY. With error_if_nonfinite, a total norm
// that is nan or infinite is an error and no gradient changes (as PyTorch's; it reads the norm on the host, one
// synchronisation).
Tensor clip_grad_norm_(const TensorList& params, double max_norm, double norm_type = 2.0,
                       bool error_if_nonfinite = false);

// Clamps every gradient of `params` in place to [-clip_value, clip_value], a nan staying nan (PyTorch's
// clip_grad_value_). clip_value must not be negative (PyTorch would set every gradient to it).
void clip_grad_value_(const TensorList& params, double clip_value);

// The coefficient clipping multiplies the gradients by, from their total norm: min(1, max_norm / (norm + 1e-6)),
// as PyTorch's (a 0-d tensor where norm is).
Tensor clip_coefficient(const Tensor& norm, double max_norm);

// Multiplies every defined gradient of `params` in place by `coefficient` (a 0-d tensor, read on the gradients'
// devices): one fused pass per (device, dtype).
void scale_grads_(const TensorList& params, const Tensor& coefficient);

}  // namespace halfgrad::optim

#pragma once
// The fused optimizer kernels. One call updates every parameter of one (group, device, dtype) with a single
// pass over memory per element: weight decay, moments, bias correction and the parameter write happen in
// registers, instead of a chain of tensor ops that each read and write whole tensors.
//
//   CPU  (optim/fused.cpp): the elements of all the tensors are cut into chunks that OpenMP threads take;
//        each chunk is a plain indexed loop over contiguous arrays that the compiler vectorises.
//   CUDA (optim/fused.cu): multi-tensor apply, as PyTorch's: the pointers, sizes and per-tensor scalars of up
//        to several dozen tensors travel as one kernel argument, and the blocks of a launch walk the chunks
//        of all of them. A ResNet-50 step (161 tensors) is 3-4 launches, not one or more per parameter.
//
// Callers (optim/sgd.cpp, optim/adam.cpp, optim/rmsprop.cpp, optim/adagrad.cpp, optim/clip_grad.cpp) guarantee:
// every tensor of a call is contiguous, on one device, of one floating dtype; params[i], grads[i] and the state
// tensors [i] have the same number of elements. Arithmetic is in opmath_t (float for float16/bfloat16), rounded once
// on store.
#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/dispatch.h"
#include "core/tensor.h"

namespace halfgrad::optim {

// What every step's kernel writes besides its state: the parameters (params[i] -= ..., from grads[i]) and, where
// autocast keeps a parameter's cast (core/autocast.h, kept_cast), that cast of the new value.
struct StepTensors {
  TensorList params, grads;
  // Empty, or one per parameter: undefined, or a float16/bfloat16 tensor laid out as params[i], element for element,
  // into which the kernel writes the new value rounded to it. Float32 parameters only; one dtype in a call.
  TensorList param_casts;
};

// torch.optim.SGD's step (the rule per element: optim/update_rules.h, sgd_update).
struct SGDStepArgs : StepTensors {
  TensorList momentum_buffers;      // one per parameter when momentum != 0, else empty
  std::vector<uint8_t> first_step;  // per parameter (with momentum): the buffer is new, so b = g
  double lr = 0, momentum = 0, dampening = 0, weight_decay = 0;
  bool nesterov = false;
  // When defined (float32 0-d, on the parameters' device): the step changes nothing if it is nonzero when the step
  // runs. Read on the device, so the loss scaler's overflow check costs no host synchronisation.
  Tensor found_inf;
  // When defined (float64 [lr, momentum], on the parameters' device; CUDA only): read on the device in place of lr and
  // momentum, so a captured CUDA graph's replays follow a scheduler (core/cuda_graph.h).
  Tensor hyperparameters;
  // When defined (float32 0-d, on the parameters' device): grad is multiplied by it as it is read, before everything
  // above, and the gradient tensors are left as they are. The loss scaler's 1 / scale times clipping's coefficient
  // (amp::GradScaler::clip_grad_norm_), so that unscaling and clipping cost no pass of their own.
  Tensor grad_scale;
};

// torch.optim.Adam / AdamW's step (the rule per element: optim/update_rules.h, adam_update).
struct AdamStepArgs : StepTensors {
  TensorList exp_avgs, exp_avg_sqs;
  TensorList max_exp_avg_sqs;  // amsgrad only, else empty
  std::vector<double> step_sizes, bias_correction2_sqrts;  // per parameter
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  bool decoupled_weight_decay = false;  // AdamW
  bool amsgrad = false;
};

// torch.optim.RMSprop's step (the rule per element: optim/update_rules.h, rmsprop_update).
struct RMSpropStepArgs : StepTensors {
  TensorList square_avgs;
  TensorList grad_avgs;         // centered only, else empty
  TensorList momentum_buffers;  // momentum != 0 only, else empty
  double lr = 0, alpha = 0, eps = 0, weight_decay = 0, momentum = 0;
  bool centered = false;
};

// torch.optim.Adagrad's step (the rule per element: optim/update_rules.h, adagrad_update).
struct AdagradStepArgs : StepTensors {
  TensorList sums;
  std::vector<double> clrs;  // per parameter: lr / (1 + (its step - 1) * lr_decay)
  double eps = 0, weight_decay = 0;
};

using SGDStepKernel = void (*)(const SGDStepArgs& args);
using AdamStepKernel = void (*)(const AdamStepArgs& args);
using RMSpropStepKernel = void (*)(const RMSpropStepArgs& args);
using AdagradStepKernel = void (*)(const AdagradStepArgs& args);
// out (0-d, on the tensors' device; float64 for float64 tensors, else float32) receives
//   sum over all elements of |x|^norm_type   for a finite norm_type > 0,
//   max over all elements of |x|              for norm_type = inf (nan if any element is nan).
// Deterministic: the same inputs give the same bits, whatever the thread count.
using NormKernel = void (*)(const TensorList& tensors, double norm_type, const Tensor& out);
// tensors[i] *= coefficient, a 0-d tensor on the tensors' device (float64 for float64 tensors, else
// float32), read there: no host synchronisation.
using ScaleKernel = void (*)(const TensorList& tensors, const Tensor& coefficient);

extern KernelTable<SGDStepKernel> sgd_step_kernel;
extern KernelTable<AdamStepKernel> adam_step_kernel;
extern KernelTable<RMSpropStepKernel> rmsprop_step_kernel;
extern KernelTable<AdagradStepKernel> adagrad_step_kernel;
extern KernelTable<NormKernel> norm_kernel;
extern KernelTable<ScaleKernel> scale_kernel;


// Calls f(std::bool_constant<b>{}...) : turns run-time flags into compile-time ones for kernel templates.
template <typename F> decltype(auto) with_bools(F&& f) { return f(); }
template <typename F, typename... Rest> decltype(auto) with_bools(F&& f, bool b, Rest... rest) {
  if (b)
    return with_bools([&](auto... flags) { return f(std::true_type{}, flags...); }, rest...);
  return with_bools([&](auto... flags) { return f(std::false_type{}, flags...); }, rest...);
}

}  // namespace halfgrad::optim

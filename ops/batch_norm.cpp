// batch_norm: the public op with its backward next to it, and the CPU kernels.
//
// Contents: 1. layouts (planes / channels last), 2. the op and its backward, 3. CPU kernels.
#include "ops/batch_norm.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <vector>

#include "core/autocast.h"
#include "core/autograd.h"
#include "ops/copy.h"
#include "ops/elementwise.h"
#include "ops/elementwise_math.h"
#include "ops/layer_norm.h"

namespace halfgrad {

constinit KernelTable<BatchNormForwardKernel> batch_norm_forward_kernel("batch_norm");
constinit KernelTable<BatchNormBackwardKernel> batch_norm_backward_kernel("batch_norm_backward");
constinit KernelTable<ReluMaskValuesKernel> relu_mask_values_kernel("batch_norm_relu mask values");

namespace {
std::atomic<BatchNormBackend> g_backend{BatchNormBackend::Auto};
std::atomic<bool> g_fuse_relu{true};
std::atomic<bool> g_fold_input_bias{true};
}
void set_batch_norm_backend(BatchNormBackend backend) { g_backend = backend; }
BatchNormBackend batch_norm_backend() { return g_backend; }
void set_batch_norm_relu_fusion(bool enabled) { g_fuse_relu = enabled; }
bool batch_norm_relu_fusion() { return g_fuse_relu; }
void set_batch_norm_input_bias_fold(bool enabled) { g_fold_input_bias = enabled; }
bool batch_norm_input_bias_fold() { return g_fold_input_bias; }

// =====================================================================================================
// 1. Layouts
// =====================================================================================================
namespace {

// Whether t [N, C, d1, ..., dk] is stored channels last: C innermost, then dk, ..., d1, then N (size-1
// dims may have any stride). Every contiguous [N, C] (and [N, C, 1, 1]) tensor is.
bool is_channels_last_nd(const Tensor& t) {
  int64_t expected = 1;
  auto next = [&](int64_t d) {
    if (t.size(d) == 1) return true;
    const bool ok = t.stride(d) == expected;
    expected *= t.size(d);
    return ok;
  };
  if (!next(1)) return false;
  for (int64_t d = t.dim() - 1; d >= 2; --d)
    if (!next(d)) return false;
  return next(0);
}


// t (no autograd) in the given layout: itself when it already is, else a copy.
Tensor in_layout(const Tensor& t, bool channels_last) {
  Tensor d = t.detach();
  if (!channels_last) return d.contiguous();
  if (is_channels_last_nd(d)) return d;
  Tensor out = batch_norm_empty(d.shape(), d.dtype(), d.device(), true);
  copy_kernel[d.device()](out, d);
  return out;
}

void check_channel_tensor(const char* op, const Tensor& t, const Tensor& input, int64_t channels, const char* what) {
  if (!t.defined()) return;
  HG_CHECK(t.dim() == 1 && t.size(0) == channels && t.is_floating_point(),
           "{}: expected {} to be a floating-point [{}] tensor (one value per channel of input {}), got {}", op, what,
           channels, input.meta(), t.meta());
  HG_CHECK(t.device() == input.device(), "{}: input {} and {} {} are on different devices", op, input.meta(), what,
           t.meta());
}

// num_batches_tracked: one int64 element on the input's device, which the forward writes.
void check_batches_tracked(const char* op, const Tensor& counter, const Tensor& input) {
  if (!counter.defined()) return;
  HG_CHECK(counter.dtype() == kInt64 && counter.numel() == 1 && counter.device() == input.device(),
           "{}: expected num_batches_tracked to be an int64 tensor of one element on the input's device (input {}), "
           "got {}", op, input.meta(), counter.meta());
}

// batch_norm_relu's residual: the input's shape, floating point, on its device (checked before either path runs).
void check_residual(const Tensor& input, const Tensor& residual) {
  if (!residual.defined()) return;
  HG_CHECK(input.defined(), "batch_norm_relu: the input is an undefined tensor");
  HG_CHECK(residual.shape() == input.shape() && residual.is_floating_point(),
           "batch_norm_relu: expected a floating-point residual of the input's shape, got input {} and residual {}",
           input.meta(), residual.meta());
  HG_CHECK(residual.device() == input.device(), "batch_norm_relu: input {} and residual {} are on different devices",
           input.meta(), residual.meta());
}

}  // namespace

Tensor batch_norm_empty(const Shape& shape, DType dtype, Device device, bool channels_last) {
  if (!channels_last || shape.size() <= 2) return empty(shape, {.dtype = dtype, .device = device});
  Shape stored{shape[0]};  // [N, d1, ..., dk, C]
  stored.insert(stored.end(), shape.begin() + 2, shape.end());
  stored.push_back(shape[1]);
  Dims order{0, int64_t(shape.size()) - 1};  // back to [N, C, d1, ..., dk]
  for (int64_t d = 1; d + 1 < int64_t(shape.size()); ++d) order.push_back(d);
  return empty(stored, {.dtype = dtype, .device = device}).permute(order);
}

// =====================================================================================================
// 2. The op
// =====================================================================================================

namespace {

// Where batch_norm_relu's relu let the gradient through (bool, the output's layout), from what the op saved of it;
// undefined after batch_norm, which saved neither.
Tensor relu_passes(const Tensor& output, const Tensor& mask, const BatchNormShape& shape, const Shape& sizes,
                   Device device) {
  if (output.defined()) return output.gt(0);
  if (!mask.defined()) return Tensor();
  Tensor passes = batch_norm_empty(sizes, kBool, device, shape.channels_last);
  if (passes.numel() > 0) relu_mask_values_kernel[device](passes, mask);
  return passes;
}

// batch_norm's gradients in ops that record, for a pass with create_graph (the kernels otherwise): the formulas of
// ops/batch_norm.h, over each channel's M values, with x^ = (x - mean) invstd and g masked by relu where it ran. In
// training mean and invstd are recomputed from x, so that the second derivatives see how they depend on it; in eval
// they are the running statistics' (constants). The input_bias's gradient is zero (ops/batch_norm.h).
TensorList batch_norm_backward_recorded(const GradContext& g, const Tensor& input, const Tensor& weight,
                                        const Tensor& passes, const Tensor& saved_mean, const Tensor& saved_invstd,
                                        bool training, double eps) {
  const DType acc = accumulation_dtype(input.dtype());
  Dims dims{0};  // all but the channels
  for (int64_t d = 2; d < input.dim(); ++d) dims.push_back(d);
  Shape per_channel(size_t(input.dim()), 1);
  per_channel[1] = input.size(1);
  const Tensor x = input.to(acc);
  Tensor grad = g[0].to(acc);
  if (passes.defined()) grad = where(passes, grad, 0.0);
  const Tensor eval_invstd = training ? Tensor() : saved_invstd.view(per_channel);
  const Normalization n = training ? normalization_recorded(x, dims, eps)
                                   : Normalization{(x - saved_mean.view(per_channel)) * eval_invstd, eval_invstd};
  TensorList grads(5);
  if (g.needs(0)) {
    const Tensor gw = weight.defined() ? grad * weight.view(per_channel) : grad;
    grads[0] = (training ? normalization_input_gradient(gw, n, dims) : gw * n.invstd).to(input.dtype());
  }
  if (g.needs(1)) grads[1] = (grad * n.normalized).sum(dims);
  if (g.needs(2)) grads[2] = grad.sum(dims);
  if (g.needs(3)) grads[3] = grad;  // cast to each input's dtype by the engine
  if (g.needs(4)) grads[4] = zeros({input.size(1)}, {.dtype = acc, .device = input.device()});
  return grads;
}

// batch_norm and batch_norm_relu: `relu` and `residual` are the epilogue, `saved` what relu's backward keeps
// (ops/batch_norm.h).
Tensor batch_norm_impl(const char* op, const Tensor& input, const Tensor& running_mean, const Tensor& running_var,
                       const Tensor& weight, const Tensor& bias, bool training, double momentum, double eps, bool relu,
                       const Tensor& residual, const Tensor& input_bias, ReluSaved saved,
                       const Tensor& num_batches_tracked) {
  HG_CHECK(input.defined(), "{}: the input is an undefined tensor", op);
  HG_CHECK(input.dim() >= 2 && input.is_floating_point(),
           "{}: expected a floating-point input of shape [N, C] or [N, C, ...], got {}", op, input.meta());
  const int64_t channels = input.size(1);
  check_channel_tensor(op, weight, input, channels, "weight");
  check_channel_tensor(op, bias, input, channels, "bias");
  check_channel_tensor(op, running_mean, input, channels, "running_mean");
  check_channel_tensor(op, running_var, input, channels, "running_var");
  check_channel_tensor(op, input_bias, input, channels, "input_bias");
  check_batches_tracked(op, num_batches_tracked, input);
  HG_CHECK(!input_bias.defined() || training, "{}: input_bias is folded only with batch statistics", op);
  HG_CHECK(running_mean.defined() == running_var.defined(),
           "{}: running_mean ({}) and running_var ({}) must both be given or both be undefined", op,
           running_mean.meta(), running_var.meta());
  HG_CHECK(training || running_mean.defined(),
           "{}: evaluation mode (training = false) normalises with running_mean and running_var, which are "
           "undefined (input {}); pass them, or use training = true for batch statistics", op, input.meta());

  BatchNormShape shape{.batch = input.size(0), .channels = channels};
  for (int64_t d = 2; d < input.dim(); ++d) shape.spatial *= input.size(d);
  HG_CHECK(!training || shape.per_channel() > 1,
           "{}: expected more than 1 value per channel when training, got input {} ({} per channel)", op,
           input.meta(), shape.per_channel());
  // A channels-last input stays so (what tensor-core convolutions produce); anything else becomes planes.
  shape.channels_last = shape.spatial == 1 || (!input.is_contiguous() && is_channels_last_nd(input));

  const DType acc = accumulation_dtype(input.dtype());
  auto parameter = [&](const Tensor& t) { return t.defined() ? cast_nograd(t.detach(), acc).contiguous() : Tensor(); };
  const Tensor z = residual.defined() ? in_layout(cast_nograd(residual.detach(), input.dtype()), shape.channels_last)
                                      : Tensor();
  BatchNormForwardArgs args{.shape = shape,
                            .input = in_layout(input, shape.channels_last),
                            .output = batch_norm_empty(input.shape(), input.dtype(), input.device(),
                                                       shape.channels_last),
                            .weight = parameter(weight),
                            .bias = parameter(bias),
                            .running_mean = parameter(running_mean),
                            .running_var = parameter(running_var),
                            .batches_tracked = training ? num_batches_tracked : Tensor(),
                            .save_mean = empty({channels}, {.dtype = acc, .device = input.device()}),
                            .save_invstd = empty({channels}, {.dtype = acc, .device = input.device()}),
                            .relu = relu,
                            .residual = z,
                            .relu_mask = relu && saved == ReluSaved::Mask
                                             ? empty({ReluMask::words(input.numel())},
                                                     {.dtype = kInt32, .device = input.device()})
                                             : Tensor(),
                            .training = training,
                            .momentum = momentum,
                            .eps = eps,
                            .cudnn_fused = {}};  // the kernel's to write
  if (training && running_mean.defined()) {
    // The kernel updates the running statistics in place; when they are not already contiguous in the
    // accumulation dtype, it updates converted copies, written back below.
    check_inplace(running_mean, op, /*records=*/false);
    check_inplace(running_var, op, /*records=*/false);
  }
  if (args.batches_tracked.defined()) check_inplace(args.batches_tracked, op, /*records=*/false);
  if (input.numel() > 0) {
    batch_norm_forward_kernel[input.device()](args);
  } else if (args.batches_tracked.defined()) {  // no kernel to count the batch (C = 0: training refuses N or S = 0)
    NoGradGuard no_grad;
    args.batches_tracked.add_(1);
  }
  if (training && running_mean.defined()) {
    NoGradGuard no_grad;
    // The kernel's running mean took mean(input); the batch's is mean(input) + input_bias. Added in the accumulation
    // dtype, before a float16 running mean is rounded once by the copy back.
    if (input_bias.defined() && input.numel() > 0) {
      args.running_mean.add_(input_bias.detach().to(args.running_mean.dtype()), momentum);
    }
    for (auto [user, updated] : {std::pair{running_mean, args.running_mean}, std::pair{running_var, args.running_var}}) {
      if (updated.storage() != user.storage()) copy_kernel[user.device()](user, updated);
    }
  }

  // backward (formulas in ops/batch_norm.h): the input is saved in the kernel's layout (an alias of the
  // caller's input when it already was, so an in-place change to it is still caught); after relu, the mask or the
  // output too; after cuDNN's fused kernel, its reserve and the bias, which its backward reads. The input and weight
  // keep their histories, for a pass with create_graph.
  const bool fused = args.cudnn_fused.ran;
  record(relu ? "BatchNormReluBackward" : "BatchNormBackward", {input, weight, bias, residual, input_bias},
         {args.output},
         [x = SavedTensor(input, args.input, op), w = SavedTensor(weight, args.weight, op), mask = args.relu_mask,
          y = relu && saved == ReluSaved::Output ? SavedTensor::output(args.output, op) : SavedTensor(),
          cudnn_fused = args.cudnn_fused, residual_added = residual.defined(),
          saved_bias = fused ? SavedTensor(args.bias, op) : SavedTensor(), mean = args.save_mean,
          invstd = args.save_invstd, shape, training, eps](const GradContext& g) -> TensorList {
           if (GradMode::is_enabled()) {
             const Tensor xs = x.get();
             const Tensor passes = relu_passes(y.defined() ? y.get() : Tensor(), mask, shape, xs.shape(), xs.device());
             return batch_norm_backward_recorded(g, xs, w.get(), passes, mean, invstd, training, eps);
           }
           BatchNormBackwardArgs b;
           b.shape = shape;
           b.input = x.get();
           b.grad_output = in_layout(g[0].to(b.input.dtype()), shape.channels_last);
           b.relu_mask = mask;
           if (y.defined()) b.output = y.get();
           b.weight = w.get();
           b.cudnn_fused = cudnn_fused;
           b.residual_added = residual_added;
           if (saved_bias.defined()) b.bias = saved_bias.get();
           b.save_mean = mean;
           b.save_invstd = invstd;
           b.training = training;
           b.eps = eps;
           const Tensor& xs = b.input;
           auto like_input = [&] { return batch_norm_empty(xs.shape(), xs.dtype(), xs.device(), shape.channels_last); };
           if (g.needs(0)) b.grad_input = like_input();
           if (g.needs(1)) b.grad_weight = empty({shape.channels}, {.dtype = mean.dtype(), .device = xs.device()});
           if (g.needs(2)) b.grad_bias = empty({shape.channels}, {.dtype = mean.dtype(), .device = xs.device()});
           if (g.needs(3)) b.grad_residual = like_input();
           if (xs.numel() > 0) {
             batch_norm_backward_kernel[xs.device()](b);
           } else {  // no elements: the sums are zero
             if (b.grad_weight.defined()) b.grad_weight.zero_();
             if (b.grad_bias.defined()) b.grad_bias.zero_();
           }
           // input_bias's gradient, the sum of grad_input over each channel, is zero with batch statistics (the
           // only ones it is folded with): ops/batch_norm.h
           const Tensor grad_input_bias =
               g.needs(4) ? zeros({shape.channels}, {.dtype = mean.dtype(), .device = xs.device()}) : Tensor();
           // cast to each input's dtype by the engine
           return {b.grad_input, b.grad_weight, b.grad_bias, b.grad_residual, grad_input_bias};
         }, DoubleBackward::Supported);
  return args.output;
}

}  // namespace

namespace {

// Whether batch_norm's input_bias is added to the input first instead of folded into the op (ops/batch_norm.h).
bool adds_input_bias_first(const Tensor& input_bias, bool training) {
  return input_bias.defined() && (!training || !batch_norm_input_bias_fold());
}

// input + input_bias over each channel, in the input's dtype: the convolution's bias add that the fold skips.
Tensor add_input_bias(const char* op, const Tensor& input, const Tensor& input_bias) {
  HG_CHECK(input.defined() && input.dim() >= 2, "{}: expected an input of shape [N, C, ...], got {}", op,
           input.defined() ? input.meta() : std::string("an undefined tensor"));
  check_channel_tensor(op, input_bias, input, input.size(1), "input_bias");
  Shape per_channel(size_t(input.dim()), 1);
  per_channel[1] = input.size(1);
  return input + input_bias.to(input.dtype()).view(per_channel);
}

}  // namespace

Tensor batch_norm(const Tensor& input, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                  const Tensor& bias, bool training, double momentum, double eps, const Tensor& input_bias,
                  const Tensor& num_batches_tracked) {
  HG_AUTOCAST(batch_norm, input, running_mean, running_var, weight, bias, training, momentum, eps, input_bias,
              num_batches_tracked);
  if (adds_input_bias_first(input_bias, training)) {
    return batch_norm(add_input_bias("batch_norm", input, input_bias), running_mean, running_var, weight, bias,
                      training, momentum, eps, Tensor(), num_batches_tracked);
  }
  return batch_norm_impl("batch_norm", input, running_mean, running_var, weight, bias, training, momentum, eps,
                         /*relu=*/false, Tensor(), input_bias, ReluSaved::Mask, num_batches_tracked);
}

Tensor batch_norm_relu(const Tensor& input, const Tensor& running_mean, const Tensor& running_var,
                       const Tensor& weight, const Tensor& bias, bool training, double momentum, double eps,
                       const Tensor& residual, const Tensor& input_bias, ReluSaved saved,
                       const Tensor& num_batches_tracked) {
  HG_AUTOCAST(batch_norm_relu, input, running_mean, running_var, weight, bias, training, momentum, eps, residual,
              input_bias, saved, num_batches_tracked);
  check_residual(input, residual);
  if (adds_input_bias_first(input_bias, training)) {
    return batch_norm_relu(add_input_bias("batch_norm_relu", input, input_bias), running_mean, running_var, weight,
                           bias, training, momentum, eps, residual, Tensor(), saved, num_batches_tracked);
  }
  if (!batch_norm_relu_fusion()) {
    const Tensor y = batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps, input_bias,
                                num_batches_tracked);
    return (residual.defined() ? y + residual.to(y.dtype()) : y).relu();
  }
  return batch_norm_impl("batch_norm_relu", input, running_mean, running_var, weight, bias, training, momentum, eps,
                         /*relu=*/true, residual, input_bias, saved, num_batches_tracked);
}

// =====================================================================================================
// 3. CPU kernels
//
// Per-channel sums are accumulated in double: planes run one channel per task (contiguous runs of S
// values, `omp simd` reductions), channels last splits the rows among threads, each adding whole rows into
// its own C accumulators (a contiguous, vectorised inner loop), merged in thread order. The statistics take
// two passes (mean, then squared deviations from it), which stays exact where sum-of-squares would cancel.
// =====================================================================================================
namespace {

constexpr int64_t kParallelGrain = 32768;  // elements

// Adds, for every channel c, the K (1 or 2) values f(c, offset, v) of each element of channel c (offset:
// its position in memory) into sums[c * K + k], in double.
template <int K, typename F> std::vector<double> channel_sums(const BatchNormShape& s, F f) {
  static_assert(K == 1 || K == 2);
  const int64_t C = s.channels, S = s.spatial, rows = s.batch * S;
  std::vector<double> sums(static_cast<size_t>(C * K), 0.0);
  const bool parallel = rows * C >= kParallelGrain;
  if (!s.channels_last) {
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
    for (int64_t c = 0; c < C; ++c) {
      double acc0 = 0, acc1 = 0;
      for (int64_t n = 0; n < s.batch; ++n) {
        const int64_t base = (n * C + c) * S;
        double run0 = 0, run1 = 0;
#pragma omp simd reduction(+ : run0, run1)
        for (int64_t i = 0; i < S; ++i) {
          double v[2] = {0, 0};
          f(c, base + i, v);
          run0 += v[0];
          run1 += v[1];
        }
        acc0 += run0;
        acc1 += run1;
      }
      sums[size_t(c * K)] = acc0;
      if constexpr (K == 2) sums[size_t(c * K + 1)] = acc1;
    }
    return sums;
  }
  const int threads = parallel ? omp_get_max_threads() : 1;
  std::vector<std::vector<double>> partial(static_cast<size_t>(threads));
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    std::vector<double>& mine = partial[size_t(t)];
    mine.assign(size_t(C * K), 0.0);
    const int64_t chunk = (rows + nt - 1) / nt, lo = std::min(rows, t * chunk), hi = std::min(rows, lo + chunk);
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t base = r * C;
      double* acc = mine.data();
      for (int64_t c = 0; c < C; ++c) {
        double v[2] = {0, 0};
        f(c, base + c, v);
        acc[c * K] += v[0];
        if constexpr (K == 2) acc[c * K + 1] += v[1];
      }
    }
  }
  for (const std::vector<double>& p : partial)
    for (size_t i = 0; i < p.size(); ++i) sums[i] += p[i];
  return sums;
}

// Calls f(c, offset) for every element, in parallel, with runs of one channel (planes) or whole rows
// (channels last) as the inner loop.
template <typename F> void for_each_element(const BatchNormShape& s, F f) {
  const int64_t C = s.channels, S = s.spatial, rows = s.batch * S;
  const bool parallel = rows * C >= kParallelGrain;
  if (!s.channels_last) {
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t plane = 0; plane < s.batch * C; ++plane) {
      const int64_t c = plane % C, base = plane * S;
      for (int64_t i = 0; i < S; ++i) f(c, base + i);
    }
    return;
  }
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t base = r * C;
    for (int64_t c = 0; c < C; ++c) f(c, base + c);
  }
}

template <typename T, typename A> void batch_norm_forward_typed(const BatchNormForwardArgs& a) {
  const BatchNormShape& s = a.shape;
  const int64_t C = s.channels;
  const double count = double(s.per_channel());
  const T* x = a.input.data<T>();
  T* y = a.output.data<T>();
  A* save_mean = a.save_mean.data<A>();
  A* save_invstd = a.save_invstd.data<A>();

  if (a.training) {
    std::vector<double> mean = channel_sums<1>(s, [&](int64_t, int64_t at, double* v) { v[0] = double(A(x[at])); });
    for (double& m : mean) m /= count;
    std::vector<double> var = channel_sums<1>(s, [&](int64_t c, int64_t at, double* v) {
      const double d = double(A(x[at])) - mean[size_t(c)];
      v[0] = d * d;
    });
    A* running_mean = a.running_mean.defined() ? a.running_mean.data<A>() : nullptr;
    A* running_var = a.running_var.defined() ? a.running_var.data<A>() : nullptr;
    for (int64_t c = 0; c < C; ++c) {
      const double biased = var[size_t(c)] / count;
      save_mean[c] = A(mean[size_t(c)]);
      save_invstd[c] = A(1.0 / std::sqrt(biased + a.eps));
      if (running_mean) {
        running_mean[c] = A((1.0 - a.momentum) * double(running_mean[c]) + a.momentum * mean[size_t(c)]);
        running_var[c] = A((1.0 - a.momentum) * double(running_var[c]) + a.momentum * biased * count / (count - 1.0));
      }
    }
  } else {
    const A* running_mean = a.running_mean.data<A>();
    const A* running_var = a.running_var.data<A>();
    for (int64_t c = 0; c < C; ++c) {
      save_mean[c] = running_mean[c];
      save_invstd[c] = A(1.0 / std::sqrt(double(running_var[c]) + a.eps));
    }
  }

  // y = (x - mean) * (invstd * weight) + bias
  std::vector<A> scale(static_cast<size_t>(C)), shift(static_cast<size_t>(C));
  const A* weight = a.weight.defined() ? a.weight.data<A>() : nullptr;
  const A* bias = a.bias.defined() ? a.bias.data<A>() : nullptr;
  for (int64_t c = 0; c < C; ++c) {
    scale[size_t(c)] = save_invstd[c] * (weight ? weight[c] : A(1));
    shift[size_t(c)] = bias ? bias[c] : A(0);
  }
  const A* sc = scale.data();
  const A* sh = shift.data();
  if (!a.relu) {
    for_each_element(s, [&](int64_t c, int64_t at) { y[at] = T((A(x[at]) - save_mean[c]) * sc[c] + sh[c]); });
    return;
  }
  const T* z = a.residual.defined() ? a.residual.data<T>() : nullptr;
  for_each_element(s, [&](int64_t c, int64_t at) {
    A v = (A(x[at]) - save_mean[c]) * sc[c] + sh[c];
    if (z) v += A(z[at]);
    y[at] = T(unary_math<UnaryOp::Relu>(v));
  });
  if (!a.relu_mask.defined()) return;
  // The mask word by word (a word's 32 elements may belong to two threads' rows above).
  const int64_t n = a.output.numel(), words = ReluMask::words(n);
  int32_t* mask = a.relu_mask.data<int32_t>();
#pragma omp parallel for schedule(static) if (n >= kParallelGrain)
  for (int64_t w = 0; w < words; ++w) {
    uint32_t bits = 0;
    for (int64_t i = w * 32, end = std::min(n, i + 32); i < end; ++i) bits |= uint32_t(A(y[i]) > A(0)) << (i % 32);
    mask[w] = int32_t(bits);
  }
}

template <typename T, typename A> void batch_norm_backward_typed(const BatchNormBackwardArgs& a) {
  const BatchNormShape& s = a.shape;
  const int64_t C = s.channels;
  const double count = double(s.per_channel());
  const T* g_out = a.grad_output.data<T>();
  const T* x = a.input.data<T>();
  const A* mean = a.save_mean.data<A>();
  const A* invstd = a.save_invstd.data<A>();
  const A* weight = a.weight.defined() ? a.weight.data<A>() : nullptr;
  // The gradient that reaches the normalisation: after batch_norm_relu, only where the output is positive.
  const int32_t* mask = a.relu_mask.defined() ? a.relu_mask.data<int32_t>() : nullptr;
  const T* y = a.output.defined() ? a.output.data<T>() : nullptr;
  auto grad = [&](int64_t at) {
    if (mask) return ReluMask::bit(mask, at) ? A(g_out[at]) : A(0);
    return y ? relu_backward_math(A(g_out[at]), A(y[at])) : A(g_out[at]);
  };
  if (a.grad_residual.defined()) {
    T* gz = a.grad_residual.data<T>();
    for_each_element(s, [&](int64_t, int64_t at) { gz[at] = T(grad(at)); });
  }

  // sums[2c] = sum(g), sums[2c + 1] = sum(g * (x - mean)), when anything needs them
  const bool need_sums = a.grad_weight.defined() || a.grad_bias.defined() || (a.grad_input.defined() && a.training);
  std::vector<double> sums;
  if (need_sums) {
    sums = channel_sums<2>(s, [&](int64_t c, int64_t at, double* v) {
      const double gv = double(grad(at));
      v[0] = gv;
      v[1] = gv * (double(A(x[at])) - double(mean[c]));
    });
  }
  if (a.grad_bias.defined()) {
    A* gb = a.grad_bias.data<A>();
    for (int64_t c = 0; c < C; ++c) gb[c] = A(sums[size_t(2 * c)]);
  }
  if (a.grad_weight.defined()) {
    A* gw = a.grad_weight.data<A>();
    for (int64_t c = 0; c < C; ++c) gw[c] = A(sums[size_t(2 * c + 1)] * double(invstd[c]));
  }
  if (!a.grad_input.defined()) return;

  // grad_input = g * alpha + (x - mean) * beta + gamma, per channel:
  //   alpha = weight * invstd;   training: beta = -alpha * invstd^2 * sum(g (x - mean)) / M,
  //   gamma = -alpha * sum(g) / M;   eval: beta = gamma = 0
  std::vector<A> alpha(static_cast<size_t>(C)), beta(static_cast<size_t>(C), A(0)), gamma(static_cast<size_t>(C), A(0));
  for (int64_t c = 0; c < C; ++c) {
    const double k = double(invstd[c]) * (weight ? double(weight[c]) : 1.0);
    alpha[size_t(c)] = A(k);
    if (a.training) {
      beta[size_t(c)] = A(-k * double(invstd[c]) * double(invstd[c]) * sums[size_t(2 * c + 1)] / count);
      gamma[size_t(c)] = A(-k * sums[size_t(2 * c)] / count);
    }
  }
  T* gi = a.grad_input.data<T>();
  const A *al = alpha.data(), *be = beta.data(), *ga = gamma.data();
  for_each_element(s, [&](int64_t c, int64_t at) {
    gi[at] = T(grad(at) * al[c] + (A(x[at]) - mean[c]) * be[c] + ga[c]);
  });
}

void relu_mask_values_cpu(const Tensor& passes, const Tensor& mask) {
  bool* out = static_cast<bool*>(passes.data_ptr());
  const int32_t* bits = mask.data<int32_t>();
  const int64_t n = passes.numel();
#pragma omp parallel for schedule(static) if (n >= 65536)
  for (int64_t i = 0; i < n; ++i) out[i] = ReluMask::bit(bits, i);
}

void batch_norm_forward_cpu(const BatchNormForwardArgs& a) {
  dispatch_floating(a.input.dtype(), "batch_norm", [&]<typename T>() {
    batch_norm_forward_typed<T, std::conditional_t<std::is_same_v<T, double>, double, float>>(a);
  });
  if (a.batches_tracked.defined()) ++*a.batches_tracked.data<int64_t>();
}

void batch_norm_backward_cpu(const BatchNormBackwardArgs& a) {
  dispatch_floating(a.input.dtype(), "batch_norm_backward", [&]<typename T>() {
    batch_norm_backward_typed<T, std::conditional_t<std::is_same_v<T, double>, double, float>>(a);
  });
}

}  // namespace

HG_REGISTER_KERNEL(batch_norm_forward_kernel, CPU, batch_norm_forward_cpu);
HG_REGISTER_KERNEL(batch_norm_backward_kernel, CPU, batch_norm_backward_cpu);
HG_REGISTER_KERNEL(relu_mask_values_kernel, CPU, relu_mask_values_cpu);

}  // namespace halfgrad

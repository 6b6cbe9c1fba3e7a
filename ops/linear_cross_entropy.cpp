// linear_cross_entropy (ops/linear_cross_entropy.h): the op, its autograd nodes, the CPU kernel over row blocks and
// the padded path that runs on the CUDA kernels of ops/linear_cross_entropy.cu.
#include "ops/linear_cross_entropy.h"

#include <omp.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/autocast.h"
#include "core/autograd.h"
#include "core/error.h"
#include "ops/loss.h"
#include "ops/matmul.h"
#include "ops/shape.h"

namespace halfgrad {

constinit KernelTable<PaddedCopyKernel> padded_copy_kernel("linear_cross_entropy (padded copy)");
constinit KernelTable<LceRowsKernel> lce_rows_kernel("linear_cross_entropy (rows)");

namespace {

constexpr const char* kOp = "linear_cross_entropy";
constexpr int64_t kBlockBytes = int64_t(4) << 20;  // the logits of one block of rows: within the shared L3

// What the fused forward leaves for the backward: the gradients of the summed loss (undefined where not needed).
struct SumGrads {
  Tensor x, weight, bias;
  double loss_sum = 0;
  int64_t counted = 0;
};

// Rows per block: logits within kBlockBytes, a multiple of the GEMM's 6-row tiles where that is possible.
int64_t block_rows(int64_t n, int64_t classes, size_t element) {
  int64_t rows = kBlockBytes / std::max<int64_t>(1, classes * int64_t(element));
  if (rows >= 12) rows -= rows % 6;
  return std::clamp<int64_t>(rows, 1, std::max<int64_t>(n, 1));
}

template <typename T>
SumGrads fused_cpu(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& t, int64_t ignore_index,
                   bool need_x, bool need_w, bool need_b) {
  using Row = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;
  const int64_t n = x.size(0), in = x.size(1), classes = w.size(0);
  const DType dtype = x.dtype();
  const T *xp = x.data<T>(), *wp = w.data<T>(), *bp = b.defined() ? b.data<T>() : nullptr;
  const int64_t* tp = t.data<int64_t>();
  SumGrads out;
  if (need_x) out.x = empty({n, in}, {.dtype = dtype});
  if (need_w) out.weight = empty({classes, in}, {.dtype = dtype});
  if (need_b) out.bias = empty({classes}, {.dtype = dtype});
  const bool any_grad = need_x || need_w || need_b;
  const int64_t rows = block_rows(n, classes, sizeof(T)), blocks = (n + rows - 1) / rows;
  const int threads = int(std::clamp<int64_t>(blocks, 1, omp_get_max_threads()));
  // Thread i's weight and bias gradients (thread 0 writes the result's directly), each written by its first block.
  const size_t team = size_t(threads);
  std::vector<Tensor> w_parts(team), b_parts(team);
  std::vector<char> touched(team, 0);
  double loss_sum = 0;
  int64_t counted = 0;
#pragma omp parallel num_threads(threads) reduction(+ : loss_sum, counted) if (threads > 1)
  {
    const int me = omp_get_thread_num();
    // A tensor, not a std::vector: the CPU allocator's cache hands back the same pages call after call.
    const Tensor logits = empty({rows, classes}, {.dtype = dtype});
    T* wg = nullptr;
    T* bg = nullptr;
    if (need_w) {
      if (me > 0) w_parts[size_t(me)] = empty({classes, in}, {.dtype = dtype});
      wg = me == 0 ? out.weight.data<T>() : w_parts[size_t(me)].data<T>();
    }
    if (need_b) {
      if (me > 0) b_parts[size_t(me)] = empty({classes}, {.dtype = dtype});
      bg = me == 0 ? out.bias.data<T>() : b_parts[size_t(me)].data<T>();
    }
    bool first = true;
#pragma omp for schedule(static)
    for (int64_t block = 0; block < blocks; ++block) {
      const int64_t r0 = block * rows, m = std::min(rows, n - r0);
      T* l = logits.data<T>();
      // Products inside this parallel region run on this thread alone (OpenMP does not nest them).
      gemm_dense(Device::cpu(), dtype, dtype, m, classes, in, xp + r0 * in, Trans::No, wp, Trans::Yes, l, 0.0, bp);
      for (int64_t j = 0; j < m; ++j) {
        Row row(l + j * classes, classes);
        const int64_t target = tp[r0 + j];
        if (target == ignore_index) {
          if (any_grad) row.setZero();
          continue;
        }
        const T top = row.maxCoeff(), picked = row[target];
        row = (row - top).exp();  // (x - max) is exact; an all -inf or +inf row gives NaN, as log_softmax does
        const T sum = row.sum();
        loss_sum += double(std::log(sum) - (picked - top));  // (x - max) is exact, max + log(sum) would round
        ++counted;
        if (any_grad) {  // softmax minus the one-hot target: the gradient of this row's loss
          row *= T(1) / sum;
          row[target] -= T(1);
        }
      }
      if (need_x) {  // dx = G W for the block's rows
        gemm_dense(Device::cpu(), dtype, dtype, m, in, classes, l, Trans::No, wp, Trans::No, out.x.data<T>() + r0 * in);
      }
      if (need_w) {  // dW += G^T x
        gemm_dense(Device::cpu(), dtype, dtype, classes, in, m, l, Trans::Yes, xp + r0 * in, Trans::No, wg,
                   first ? 0.0 : 1.0);
      }
      if (need_b) {  // db += the block's column sums (its first block starts them)
        Row acc(bg, classes);
        if (first) acc = Row(l, classes);
        for (int64_t j = first ? 1 : 0; j < m; ++j) acc += Row(l + j * classes, classes);
      }
      first = false;
    }
    if (!first) touched[size_t(me)] = 1;
  }
  // The other threads' parts onto thread 0's (zeros first if thread 0 had no block).
  auto add_parts = [&](Tensor& result, const std::vector<Tensor>& parts) {
    T* r = result.data<T>();
    const int64_t size = result.numel();
    if (!touched[0]) std::fill(r, r + size, T(0));
    for (int i = 1; i < threads; ++i) {
      if (!touched[size_t(i)]) continue;
      const T* p = parts[size_t(i)].data<T>();
#pragma omp parallel for schedule(static) if (size > (1 << 16))
      for (int64_t e = 0; e < size; ++e) r[e] += p[e];
    }
  };
  if (need_w) add_parts(out.weight, w_parts);
  if (need_b) add_parts(out.bias, b_parts);
  out.loss_sum = loss_sum;
  out.counted = counted;
  return out;
}

// Shapes and devices; dtypes too outside autocast (under it, linear casts mixed dtypes as its rule says).
void check_arguments(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& t, bool autocast) {
  HG_CHECK(x.defined() && w.defined() && t.defined(), "{}: got an undefined tensor (input {}, weight {}, target {})",
           kOp, x.meta(), w.meta(), t.meta());
  HG_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
           "{}: expected input [N, in] and weight [classes, in], got input {} and weight {}", kOp, x.meta(), w.meta());
  HG_CHECK(!b.defined() || (b.dim() == 1 && b.size(0) == w.size(0)),
           "{}: bias {} does not match weight {} (expected [{}])", kOp, b.meta(), w.meta(), w.size(0));
  HG_CHECK(t.dim() == 1 && t.size(0) == x.size(0) && !t.is_floating_point(),
           "{}: expected integer class indices [{}] for input {}, got {}", kOp, x.size(0), x.meta(), t.meta());
  HG_CHECK(autocast || (x.dtype() == w.dtype() && (!b.defined() || b.dtype() == w.dtype())),
           "{}: input, weight and bias must have one dtype, got {}, {} and {}", kOp, x.meta(), w.meta(), b.meta());
  HG_CHECK(x.device() == w.device() && x.device() == t.device() && (!b.defined() || b.device() == x.device()),
           "{}: every tensor must be on one device, got input {}, weight {}, bias {}, target {}", kOp, x.meta(),
           w.meta(), b.meta(), t.meta());
}

// The gradients in ops that record, for a pass with create_graph (the fused products otherwise): the composition's,
// cross_entropy's gradient by the logits, in the accumulation dtype. x, w and b are the values the op read (or the
// arguments themselves), with the arguments' histories.
TensorList linear_cross_entropy_backward_recorded(const GradContext& g, const Tensor& x, const Tensor& w,
                                                  const Tensor& b, const Tensor& target, int64_t ignore_index) {
  const DType acc = accumulation_dtype(x.dtype());
  const Tensor xa = x.to(acc), wa = w.to(acc);
  const Tensor logits = linear(xa, wa, b.defined() ? b.to(acc) : Tensor());
  const Tensor grad_logits = cross_entropy_mean_gradient(logits, target, g[0], ignore_index);
  return {g.needs(0) ? grad_logits.matmul(wa) : Tensor(), g.needs(1) ? grad_logits.t().matmul(xa) : Tensor(),
          g.needs(2) ? grad_logits.sum({0}) : Tensor()};
}

// The padded path (the header says what it computes). `dtype`: the products' dtype.
Tensor padded_linear_cross_entropy(const Tensor& input, const Tensor& weight, const Tensor& bias, const Tensor& target,
                                   int64_t ignore_index, DType dtype, DType loss_dtype) {
  const int64_t n = input.size(0), in = input.size(1), classes = weight.size(0);
  const int64_t per_vector = 16 / int64_t(element_size(dtype));
  auto round_up = [&](int64_t v) { return (v + per_vector - 1) / per_vector * per_vector; };
  const bool has_bias = bias.defined();
  const int64_t in_p = round_up(in + (has_bias ? 1 : 0)), classes_p = round_up(classes);
  const DType acc = accumulation_dtype(dtype);
  const Device device = input.device();
  const bool grad = GradMode::is_enabled();
  const bool need_x = grad && input.requires_grad(), need_w = grad && weight.requires_grad(),
             need_b = grad && has_bias && bias.requires_grad();
  const bool any_grad = need_x || need_w || need_b;
  // An aligned-rows weight of the products' dtype laid out as w_p would be (room for the bias column, or no bias) is
  // w_p itself: its padding is zero, so the bias joins the logits in the row pass instead, and where its gradient
  // has the accumulation's dtype that gradient is made in place as an aligned-rows tensor. No copy in, none out. (A
  // contiguous weight whose sizes are whole vectors and that has no bias is such a w_p too.)
  const bool weight_aligned = is_aligned_rows(weight);
  const bool weight_in_place = weight_aligned && weight.dtype() == dtype && weight.stride(0) == in_p;
  Tensor x_p, w_p, logits, counted, loss;
  Tensor row_bias;  // the bias the row pass adds, where w_p does not hold it
  const Tensor target64 = target.to(kInt64).contiguous();
  {
    NoGradGuard no_grad;
    auto dense_rows = [](const Tensor& t) { return t.stride(1) == 1 ? t : t.contiguous(); };
    // x_p = [x, 1, 0...], w_p = [W, b, 0...]: the bias as one more column of the products' k.
    x_p = empty({n, in_p}, {.dtype = dtype, .device = device});
    padded_copy_kernel[device](x_p, dense_rows(input.detach()), has_bias ? in : -1, Tensor());
    if (weight_in_place) {
      w_p = make_view(weight.detach(), {classes_p, in_p}, {in_p, 1}, 0);
      if (has_bias) row_bias = bias.detach().to(dtype).contiguous();
    } else {
      w_p = empty({classes_p, in_p}, {.dtype = dtype, .device = device});
      padded_copy_kernel[device](w_p, dense_rows(weight.detach()), has_bias ? in : -1,
                                 has_bias ? bias.detach().to(weight.dtype()).contiguous() : Tensor());
    }
    logits = empty({n, classes_p}, {.dtype = dtype, .device = device});
    gemm_dense(device, dtype, dtype, n, classes_p, in_p, x_p.data_ptr(), Trans::No, w_p.data_ptr(), Trans::Yes,
               logits.data_ptr());
    const Tensor row_loss = empty({n}, {.dtype = acc, .device = device});
    const Tensor row_count = empty({n}, {.dtype = acc, .device = device});
    lce_rows_kernel[device](logits, classes, row_bias, target64, ignore_index, row_loss,
                            row_count, any_grad ? kGradFactor : 0.0);
    counted = row_count.sum();
    loss = row_loss.sum().div(counted).to(loss_dtype);  // 0 / 0: NaN when every target is ignored
  }
  if (!any_grad) return loss;
  const DType x_dtype = input.dtype(), w_dtype = weight.dtype(), b_dtype = has_bias ? bias.dtype() : dtype;
  // w_p is the weight itself there: the backward's dx product reads it, so an in-place change before then is an error.
  const SavedTensor saved_weight(weight_in_place && need_x ? weight : Tensor(), kOp);
  // For a pass with create_graph: the values the products read, with the arguments' histories.
  const SavedTensor x_values(input, x_p.narrow(1, 0, in), kOp),
      w_values(weight, w_p.narrow(0, 0, classes).narrow(1, 0, in), kOp),
      b_values(bias, !has_bias ? Tensor() : weight_in_place ? row_bias : w_p.narrow(0, 0, classes).select(1, in), kOp),
      t_values(target, target64, kOp);
  record("LinearCrossEntropyBackward", {input, weight, bias}, {loss},
         [=](const GradContext& g) -> TensorList {
           if (GradMode::is_enabled()) {
             return linear_cross_entropy_backward_recorded(g, x_values.get(), w_values.get(), b_values.get(),
                                                           t_values.get(), ignore_index);
           }
           NoGradGuard no_grad;
           if (saved_weight.defined()) saved_weight.get();  // checks the version
           // The products' alpha (and a zero beta), read on the device: the upstream gradient over the targets
           // counted and kGradFactor. Every gradient row of an ignored target is 0, so counted = 0 needs only a
           // finite divisor.
           const Tensor scale = g[0].to(acc).div(counted.clamp(1.0, std::nullopt).mul(kGradFactor));
           const Tensor scalars = zeros({2}, {.dtype = acc, .device = device});
           scalars.narrow(0, 0, 1).copy_(scale.view({1}));
           Tensor dx, dw, db;
           if (need_x) {  // G w_p
             const Tensor dx_p = empty({n, in_p}, {.dtype = acc, .device = device});
             gemm_dense(device, dtype, acc, n, in_p, classes_p, logits.data_ptr(), Trans::No, w_p.data_ptr(),
                        Trans::No, dx_p.data_ptr(), 0, nullptr, scalars.data_ptr());
             dx = empty({n, in}, {.dtype = x_dtype, .device = device});
             padded_copy_kernel[device](dx, dx_p, -1, Tensor());
           }
           if (need_w || need_b) {  // G^T x_p: column `in` is the bias gradient
             const Tensor dw_p = empty({classes_p, in_p}, {.dtype = acc, .device = device});
             gemm_dense(device, dtype, acc, classes_p, in_p, n, logits.data_ptr(), Trans::Yes, x_p.data_ptr(),
                        Trans::No, dw_p.data_ptr(), 0, nullptr, scalars.data_ptr());
             if (need_b) {
               db = empty({classes, 1}, {.dtype = b_dtype, .device = device});
               padded_copy_kernel[device](db, dw_p.narrow(1, in, 1), -1, Tensor());
               db = db.view({classes});
             }
             if (need_w && weight_in_place && acc == w_dtype) {
               // dw_p is zero beyond column `in` (x_p is) and below row `classes` (the logits' gradient is): with
               // the bias column cleared it is the aligned-rows gradient, W's own layout.
               if (has_bias) dw_p.narrow(1, in, 1).zero_();
               dw = as_aligned_rows(dw_p, classes, in);
             } else if (need_w) {  // copied out in W's layout: an aligned-rows W's padding written as zeros
               const Shape shape = weight_aligned ? Shape{aligned_row_extent(classes, w_dtype),
                                                          aligned_row_extent(in, w_dtype)}
                                                  : Shape{classes, in};
               const Tensor out = empty(shape, {.dtype = w_dtype, .device = device});
               padded_copy_kernel[device](out, dw_p.narrow(0, 0, classes).narrow(1, 0, in), -1, Tensor());
               dw = weight_aligned ? as_aligned_rows(out, classes, in) : out;
             }
           }
           return {dx, dw, db};
         }, DoubleBackward::Supported);
  return loss;
}

}  // namespace

Tensor linear_cross_entropy(const Tensor& input, const Tensor& weight, const Tensor& bias, const Tensor& target,
                            const LinearCrossEntropyOptions& options) {
  const bool autocast = amp::is_autocast_enabled();
  check_arguments(input, weight, bias, target, autocast);
  if (input.device().is_cuda()) {
    HG_CHECK(is_floating(input.dtype()) && is_floating(weight.dtype()) && (!bias.defined() || is_floating(bias.dtype())),
             "{}: floating input, weight and bias expected, got {}, {} and {}", kOp, input.meta(), weight.meta(),
             bias.meta());
    DType widest = promote_types(input.dtype(), weight.dtype());
    if (bias.defined()) widest = promote_types(widest, bias.dtype());
    // Under autocast linear's rule picks the products' dtype (float64 stays, as amp::detail::cast leaves it) and
    // cross_entropy's the loss's: float32 (core/autocast.h).
    const bool cast = autocast && widest != kFloat64;
    const DType dtype = cast ? amp::autocast_dtype() : input.dtype();
    const DType loss_dtype = cast ? kFloat32 : dtype;
    Tensor loss = padded_linear_cross_entropy(input, weight, bias, target, options.ignore_index, dtype, loss_dtype);
    if (cast && amp::is_tracing())
      amp::detail::trace(kOp, amp::CastRule::LowerPrecision, {input.dtype(), weight.dtype()}, {dtype, loss_dtype});
    return loss;
  }
  const bool fused = input.device().is_cpu() && (input.dtype() == kFloat32 || input.dtype() == kFloat64) && !autocast;
  if (!fused) return cross_entropy(linear(input, weight, bias), target, {.ignore_index = options.ignore_index});

  const Tensor t = target.to(kInt64).contiguous();
  const int64_t classes = weight.size(0);
  const int64_t* tp = t.data<int64_t>();
  for (int64_t i = 0; i < t.numel(); ++i) {  // checked here: the kernel's threads cannot report an error
    HG_CHECK(tp[i] == options.ignore_index || (tp[i] >= 0 && tp[i] < classes),
             "{}: target {} at row {} is not a class index in [0, {}) or ignore_index {}", kOp, tp[i], i, classes,
             options.ignore_index);
  }
  const bool grad = GradMode::is_enabled();
  const bool need_x = grad && input.requires_grad(), need_w = grad && weight.requires_grad(),
             need_b = grad && bias.defined() && bias.requires_grad();
  SumGrads sums;
  {
    NoGradGuard no_grad;
    const Tensor x = input.detach().contiguous(), w = weight.detach().contiguous(),
                 b = bias.defined() ? bias.detach().contiguous() : Tensor();
    sums = input.dtype() == kFloat32 ? fused_cpu<float>(x, w, b, t, options.ignore_index, need_x, need_w, need_b)
                                     : fused_cpu<double>(x, w, b, t, options.ignore_index, need_x, need_w, need_b);
  }
  const double mean =
      sums.counted > 0 ? sums.loss_sum / double(sums.counted) : std::numeric_limits<double>::quiet_NaN();
  Tensor loss = full({}, mean, {.dtype = input.dtype()});
  if (need_x || need_w || need_b) {
    // The arguments are kept for a pass with create_graph, which forms the composition again (the gradients in `sums`
    // need them no more: PyTorch's linear keeps them too, for its weight's gradient).
    record("LinearCrossEntropyBackward", {input, weight, bias}, {loss},
           [sums, x_values = SavedTensor(input, kOp), w_values = SavedTensor(weight, kOp),
            b_values = SavedTensor(bias, kOp), t_values = SavedTensor(target, t, kOp),
            ignore_index = options.ignore_index](const GradContext& g) -> TensorList {
             if (GradMode::is_enabled()) {
               return linear_cross_entropy_backward_recorded(g, x_values.get(), w_values.get(), b_values.get(),
                                                             t_values.get(), ignore_index);
             }
             // d(mean)/d(logits) = (softmax - one-hot) / counted, times the upstream gradient; with nothing
             // counted every row was ignored and every gradient is 0, as the composition's
             const Tensor scale = sums.counted > 0 ? g[0].div(double(sums.counted)) : g[0].mul(0.0);
             auto scaled = [&](const Tensor& sum_grad) { return sum_grad.defined() ? sum_grad.mul(scale) : Tensor(); };
             return {scaled(sums.x), scaled(sums.weight), scaled(sums.bias)};
           }, DoubleBackward::Supported);
  }
  return loss;
}

}  // namespace halfgrad

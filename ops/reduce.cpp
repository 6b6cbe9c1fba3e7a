// Reductions: the public ops with their backward next to them, the op layer that turns every reduction
// into "reduce the middle dim of a contiguous [outer, reduced, inner] block", and the CPU kernel.
//
// Contents, top to bottom:
//   1. op layer: plan_reduction (dims -> [outer, reduced, inner]) and run_reduction (-> reduce_kernel)
//   2. public ops and their backward: sum, mean, var, max/min, argmax/argmin, all/any, Tensor methods
//   3. CPU kernel: reducers (what is accumulated), reduce_block / reduce_row (how), run_reducer
//      (how the work is split over threads) and reduce_cpu (the dtype switch)
#include "ops/reduce.h"

#include <omp.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>  // widen(): float16 -> float32 conversions
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "core/autocast.h"
#include "core/autograd.h"
#include "ops/coalesce.h"
#include "ops/elementwise.h"
#include "ops/shape.h"

namespace halfgrad {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Mean: return "mean";
    case ReduceOp::Var: return "var";
    case ReduceOp::Max: return "max";
    case ReduceOp::Min: return "min";
    case ReduceOp::ArgMax: return "argmax";
    case ReduceOp::ArgMin: return "argmin";
    case ReduceOp::All: return "all";
    case ReduceOp::Any: return "any";
  }
  return "reduce";
}

constinit KernelTable<ReduceKernel> reduce_kernel("reduce");

// =====================================================================================================
// 1. Op layer
// =====================================================================================================
namespace {

// A reduction, normalised: output element (o, i) reduces input[o, :, i] of a contiguous block.
struct ReductionPlan {
  Tensor input;  // (outer, reduced, inner), contiguous: a view of x's memory when possible, else a copy
  int64_t outer = 1, reduced = 1, inner = 1;
  // Layout (c) below: reduce x over first_stage (keepdim) and the result over the other reduced dims.
  Tensor source;
  Dims first_stage;
  std::vector<bool> mask;  // which of x's dims are reduced (empty for a 0-d x)
  Shape keep_shape;        // x's shape with the reduced dims set to 1
  Shape out_shape;         // keep_shape when keepdim, else x's shape without the reduced dims
};

// A view of t's memory with a new shape and contiguous strides. Callers have checked that t's elements
// really are laid out that way (or that there are none).
Tensor flat_view(const Tensor& t, Shape shape) {
  Shape strides = contiguous_strides(shape);
  return make_view(t, std::move(shape), std::move(strides), t.offset());
}

// Whether t's memory is contiguous when its dims are read in `order` (size-1 dims may sit anywhere).
bool contiguous_in_order(const Tensor& t, const Dims& order) {
  int64_t expected = 1;
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    const int64_t size = t.shape()[size_t(*it)];
    if (size == 1) continue;
    if (t.strides()[size_t(*it)] != expected) return false;
    expected *= size;
  }
  return true;
}

// Layout (b) below read in x's memory order: x dense in that order, its reduced dims of size > 1 one block there,
// and its kept dims of size > 1 in their own order, so that output element (o, i) is element o inner + i of the
// output. Sets outer (the kept dims before the block) and inner (those after it); false when x is not so. The
// reduced block is read in memory order too: right for every reduction over several dims (sums, means, variances,
// all, any, max and min without indices); the reductions that return indices reduce one dim, read in its order.
bool one_block_in_memory(const Tensor& x, const std::vector<bool>& mask, int64_t& outer, int64_t& inner) {
  const Dims order = dims_in_memory_order(x.strides());
  if (!contiguous_in_order(x, order)) return false;
  outer = inner = 1;
  int64_t last_kept = -1;
  enum { Before, Inside, After } at = Before;
  for (int64_t d : order) {
    if (x.size(d) == 1) continue;
    if (mask[size_t(d)]) {
      if (at == After) return false;  // a second block
      at = Inside;
      continue;
    }
    if (d < last_kept) return false;  // the kept dims out of their order
    last_kept = d;
    if (at == Inside) at = After;
    (at == Before ? outer : inner) *= x.size(d);
  }
  return at != Before;
}

// The reductions that can run in stages (layout (c) below): a reduction of partial results is the result.
bool can_stage(ReduceOp op) {
  return op == ReduceOp::Sum || op == ReduceOp::Mean || op == ReduceOp::All || op == ReduceOp::Any;
}

// Chooses the cheapest [outer, reduced, inner] layout, in this order:
//   a. x's memory is already [kept dims..., reduced dims...] (a contiguous x reduced over its trailing
//      dims, or a transposed one reduced over what are its leading dims): no copy, inner = 1.
//   b. the reduced dims are one block of consecutive dims in x's memory, the kept ones in their order around it
//      (sum over dim 0 of [N, C], the reduction that sum_to in every broadcasting backward does; conv's bias
//      gradient of a channels-last [N, C, H, W], whose memory is [N H W, C]): no copy when x is dense, and with
//      inner > 1 the kernel accumulates whole rows into an inner-wide accumulator instead of transposing. Otherwise,
//      when the reduced dims are consecutive dims of x, x is copied contiguous first.
//   c. a contiguous x whose reduced dims are several blocks (conv's bias gradient: [N, C, H, W] summed over
//      {0, 2, 3}), for the ops that can be done in stages (sum, mean, all, any): reduce the last block
//      first, then the result over the remaining dims; each stage reads memory in order, nothing is
//      transposed. A mean of the first-stage means is the whole mean, since each of them averages as many elements.
//      Not for float16/bfloat16, whose intermediate would be rounded to 16 bits.
//   d. anything else: copy x with its reduced dims moved to the end, then as in (a).
// name: the public op's, for errors (amax's plan reduces with Max), where it differs from reduce_op's.
ReductionPlan plan_reduction(const Tensor& x, const Dims& dims, bool keepdim, ReduceOp reduce_op,
                             const char* name = nullptr) {
  const char* op = name ? name : reduce_op_name(reduce_op);
  HG_CHECK(x.defined(), "{}: the input is an undefined tensor", op);
  const int64_t ndim = x.dim();
  ReductionPlan p;
  p.mask.assign(size_t(ndim), dims.empty());
  std::vector<bool> seen(size_t(std::max<int64_t>(ndim, 1)), false);
  for (int64_t d : dims) {
    const int64_t w = wrap_dim(d, ndim, op);
    HG_CHECK(!seen[size_t(w)], "{}: dim {} appears more than once in dims [{}] for {}", op, w,
             fmt::join(dims, ", "), x.meta());
    seen[size_t(w)] = true;
    if (ndim > 0) p.mask[size_t(w)] = true;
  }

  Dims kept, reduced;
  int64_t kept_numel = 1;
  p.keep_shape = x.shape();
  for (int64_t d = 0; d < ndim; ++d) {
    if (p.mask[size_t(d)]) {
      reduced.push_back(d);
      p.reduced *= x.size(d);
      p.keep_shape[size_t(d)] = 1;
    } else {
      kept.push_back(d);
      kept_numel *= x.size(d);
      p.out_shape.push_back(x.size(d));
    }
  }
  if (keepdim) p.out_shape = p.keep_shape;

  Dims order = kept;
  order.insert(order.end(), reduced.begin(), reduced.end());
  if (x.numel() == 0 || contiguous_in_order(x, order)) {  // (a)
    p.outer = kept_numel;
    p.input = flat_view(x, {p.outer, p.reduced, 1});
    return p;
  }

  if (int64_t outer, inner; one_block_in_memory(x, p.mask, outer, inner)) {  // (b), without a copy
    p.outer = outer;
    p.inner = inner;
    p.input = flat_view(x, {outer, p.reduced, inner});
    return p;
  }

  // The reduced dims of size > 1, from first to last, with no kept dim of size > 1 between them?
  int64_t first = -1, last = -1;
  for (int64_t d = 0; d < ndim; ++d) {
    if (p.mask[size_t(d)] && x.size(d) != 1) {
      if (first < 0) first = d;
      last = d;
    }
  }
  bool consecutive = true;
  for (int64_t d = first + 1; first >= 0 && d < last; ++d) consecutive &= p.mask[size_t(d)] || x.size(d) == 1;

  if (!consecutive && can_stage(reduce_op) && x.is_contiguous() && !is_half(x.dtype())) {  // (c)
    int64_t start = last;  // the last block: back from `last` over reduced and size-1 dims
    while (start > 0 && (p.mask[size_t(start - 1)] || x.size(start - 1) == 1)) --start;
    for (int64_t d = start; d <= last; ++d)
      if (p.mask[size_t(d)]) p.first_stage.push_back(d);
    p.source = x.detach();
    p.outer = kept_numel;
    return p;
  }
  if (consecutive) {  // (b)
    Tensor xc = x.detach().contiguous();
    p.outer = kept_numel;
    if (first >= 0) {
      p.outer = 1;
      p.inner = 1;
      for (int64_t d = 0; d < first; ++d) p.outer *= x.size(d);
      for (int64_t d = last + 1; d < ndim; ++d) p.inner *= x.size(d);
    }
    p.input = flat_view(xc, {p.outer, p.reduced, p.inner});
  } else {  // (d)
    Tensor xc = x.detach().permute(order).contiguous();
    p.outer = kept_numel;
    p.input = flat_view(xc, {p.outer, p.reduced, 1});
  }
  return p;
}

// Runs the device's kernel. `values` and `indices` have the plan's out_shape (either may be undefined).
void run_reduction(ReduceOp op, const ReductionPlan& p, const Tensor& values, const Tensor& indices,
                   int64_t correction = 0) {
  if (p.outer * p.inner == 0) return;  // no output elements
  if (!p.first_stage.empty()) {  // layout (c): two reductions, the second possibly staged again
    ReductionPlan first = plan_reduction(p.source, p.first_stage, /*keepdim=*/true, op);
    Tensor partial = empty(first.out_shape, {.dtype = values.dtype(), .device = p.source.device()});
    run_reduction(op, first, partial, indices, correction);
    Dims rest;
    for (size_t d = 0; d < p.mask.size(); ++d)
      if (p.mask[d] && std::find(p.first_stage.begin(), p.first_stage.end(), int64_t(d)) == p.first_stage.end())
        rest.push_back(int64_t(d));
    run_reduction(op, plan_reduction(partial, rest, /*keepdim=*/true, op), values, indices, correction);
    return;
  }
  ReduceArgs args{.op = op,
                  .input = p.input,
                  .values = values.defined() ? flat_view(values, {p.outer, p.inner}) : Tensor(),
                  .indices = indices.defined() ? flat_view(indices, {p.outer, p.inner}) : Tensor(),
                  .outer = p.outer,
                  .reduced = p.reduced,
                  .inner = p.inner,
                  .correction = correction};
  reduce_kernel[p.input.device()](args);
}

// A reduced gradient (or index) put back in place of the reduced dims, ready to broadcast against x.
Tensor unsqueeze_reduced(Tensor t, const std::vector<bool>& mask, bool keepdim) {
  if (keepdim) return t;
  for (size_t d = 0; d < mask.size(); ++d)
    if (mask[d]) t = t.unsqueeze(int64_t(d));
  return t;
}

Dims reduced_dims(const std::vector<bool>& mask) {
  Dims dims;
  for (size_t d = 0; d < mask.size(); ++d)
    if (mask[d]) dims.push_back(int64_t(d));
  return dims;
}

void check_floating(const Tensor& x, const char* op) {
  HG_CHECK(x.is_floating_point(), "{}: input dtype should be floating point, got {} (convert it with .to(kFloat32))",
           op, x.meta());
}

}  // namespace

// =====================================================================================================
// 2. Public ops, each with its backward
// =====================================================================================================

// Autocast category "float32": every op's first line applies its row of amp::kCastRules (core/autocast.h).
Tensor sum(const Tensor& x, Dims dims, bool keepdim) {
  HG_AUTOCAST(sum, x, dims, keepdim);
  ReductionPlan p = plan_reduction(x, dims, keepdim, ReduceOp::Sum);
  Tensor out = empty(p.out_shape, {.dtype = sum_dtype(x.dtype()), .device = x.device()});
  run_reduction(ReduceOp::Sum, p, out, Tensor());
  // backward: every input element receives the gradient of the sum it went into.
  record("SumBackward", {x}, {out}, [mask = p.mask, keepdim, shape = x.shape()](const GradContext& g) -> TensorList {
    return {unsqueeze_reduced(g[0], mask, keepdim).expand(shape)};
  }, DoubleBackward::Supported);
  return out;
}

// Autocast category "float32".
Tensor mean(const Tensor& x, Dims dims, bool keepdim) {
  HG_AUTOCAST(mean, x, dims, keepdim);
  check_floating(x, "mean");
  ReductionPlan p = plan_reduction(x, dims, keepdim, ReduceOp::Mean);
  Tensor out = empty(p.out_shape, {.dtype = x.dtype(), .device = x.device()});
  run_reduction(ReduceOp::Mean, p, out, Tensor());
  // backward: as sum's, divided by the count.
  record("MeanBackward", {x}, {out},
         [mask = p.mask, keepdim, shape = x.shape(), count = p.reduced](const GradContext& g) -> TensorList {
           return {unsqueeze_reduced(divided_by_count(g[0], count), mask, keepdim).expand(shape)};
         }, DoubleBackward::Supported);
  return out;
}

// Autocast category "float32".
Tensor var(const Tensor& x, Dims dims, int64_t correction, bool keepdim) {
  HG_AUTOCAST(var, x, dims, correction, keepdim);
  check_floating(x, "var");
  HG_CHECK(correction >= 0, "var: correction must be non-negative, got {} for {}", correction, x.meta());
  ReductionPlan p = plan_reduction(x, dims, keepdim, ReduceOp::Var);
  Tensor out = empty(p.out_shape, {.dtype = x.dtype(), .device = x.device()});
  run_reduction(ReduceOp::Var, p, out, Tensor(), correction);
  // backward: d/dx_i sum_j (x_j - mean)^2 / (N - correction) = 2 (x_i - mean) / (N - correction); the
  // mean's own dependence on x_i drops out because the deviations sum to zero. Where N - correction <= 0, PyTorch's
  // var_backward: over every element, inf (nan where x_i is the mean, inf * 0); over named dims, the formula as it
  // stands (a finite factor of the wrong sign past N, inf at N).
  record("VarBackward", {x}, {out},
         [saved_x = SavedTensor(x, "var"), mask = p.mask, keepdim, correction, count = p.reduced,
          every_element = dims.empty() || x.dim() == 0](const GradContext& g) -> TensorList {
           const Tensor& xs = saved_x.get();
           Tensor deviation = xs.sub(xs.mean(reduced_dims(mask), /*keepdim=*/true));
           Tensor grad = unsqueeze_reduced(g[0], mask, keepdim);
           if (every_element && count - correction <= 0)
             return {where(deviation.eq(0.0), std::numeric_limits<double>::quiet_NaN(),
                           full_like(xs, std::numeric_limits<double>::infinity())).mul(grad)};
           return {scaled_once(deviation.mul(grad), 2.0 / double(count - correction))};
         }, DoubleBackward::Supported);
  return out;
}

// Autocast category "float32" (var's). The square root of var; its backward, as PyTorch's std_backward, passes 0
// where the result is 0 (a constant input) instead of 0 * inf = nan: g / (2 std) into var's backward.
Tensor std(const Tensor& x, Dims dims, int64_t correction, bool keepdim) {
  HG_AUTOCAST(std, x, dims, correction, keepdim);
  HG_CHECK(x.defined(), "std: the input is an undefined tensor");
  check_floating(x, "std");
  const Tensor variance = var(x, std::move(dims), correction, keepdim);
  Tensor out;
  {
    NoGradGuard no_grad;
    out = sqrt(variance);
  }
  record("StdBackward", {variance}, {out},
         [saved = SavedTensor::output(out, "std")](const GradContext& g) -> TensorList {
           const Tensor& s = saved.get();
           return {where(s.eq(0), 0, g[0].div(s.mul(2)))};
         }, DoubleBackward::Supported);
  return out;
}

namespace {

// max() / min() over every element (name "max" / "min", dims empty, nan_ties), amax / amin over dims: the values
// alone. nan_ties: a nan result's gradient goes to the nans (below).
Tensor extreme_values(const char* name, const Tensor& x, const Dims& dims, bool keepdim, ReduceOp op, bool nan_ties) {
  HG_CHECK(x.defined(), "{}: the input is an undefined tensor", name);
  HG_CHECK(!dims.empty() || x.numel() > 0, "{}: cannot reduce the empty tensor {} (there is no identity); use {}(dim) "
           "on a non-empty dim instead", name, x.meta(), name);
  ReductionPlan p = plan_reduction(x, dims, keepdim, op, name);
  for (size_t d = 0; d < p.mask.size(); ++d)
    HG_CHECK(!p.mask[d] || x.size(int64_t(d)) > 0,
             "{}: cannot reduce over dim {} of {}, which has size 0 (there is no identity)", name, d, x.meta());
  Tensor out = empty(p.out_shape, {.dtype = x.dtype(), .device = x.device()});
  run_reduction(op, p, out, Tensor());
  // backward: the gradient is split evenly among the elements equal to their result, as PyTorch's max() and amax.
  // Where the result is nan: max() and min() split it among the nans (PyTorch's evenly_distribute_backward); amax and
  // amin find no element equal to it and give the group nan (PyTorch's scale_grad_by_count: g / 0 * 0).
  record(backward_name(name), {x}, {out},
         [saved_x = SavedTensor(x, name), saved_out = SavedTensor::output(out, name), mask = p.mask, keepdim,
          nan_ties](const GradContext& g) -> TensorList {
           const Tensor& xs = saved_x.get();
           const Tensor result = unsqueeze_reduced(saved_out.get(), mask, keepdim);
           const Tensor ties = nan_ties ? logical_or(xs.eq(result), logical_and(xs.ne(xs), result.ne(result)))
                                        : xs.eq(result);
           // The ties counted in int64 and divided into the gradient in float32 (a float16 count rounds: 100,000
           // equal elements summed to inf, a zero gradient), the share rounded once to x's dtype.
           const Tensor count = ties.sum(reduced_dims(mask), /*keepdim=*/true).to(kFloat32);
           const Tensor share = unsqueeze_reduced(g[0], mask, keepdim).div(count).to(xs.dtype());
           return {ties.to(xs.dtype()).mul(share)};
         }, DoubleBackward::Supported);
  return out;
}

// The gradient of values picked along `dim` at `indices` (max(dim), min(dim)): g goes to the picked
// element, zeros elsewhere. Built as a one-hot mask (arange along dim == index) times the gradient.
Tensor picked_gradient(const Tensor& g, const Tensor& indices, int64_t dim, bool keepdim, const Shape& shape) {
  if (shape.empty()) return g;  // a 0-d input: the one element was picked
  Tensor g_kept = keepdim ? g : g.unsqueeze(dim);
  Tensor index_kept = keepdim ? indices : indices.unsqueeze(dim);
  Shape positions_shape(shape.size(), 1);
  positions_shape[size_t(dim)] = shape[size_t(dim)];
  Tensor positions = arange(shape[size_t(dim)], {.dtype = kInt64, .device = g.device()}).view(positions_shape);
  return positions.eq(index_kept).to(g.dtype()).mul(g_kept);
}

// max(dim) / min(dim): values and indices.
std::pair<Tensor, Tensor> extreme_dim(const Tensor& x, int64_t dim, bool keepdim, ReduceOp op) {
  const char* name = reduce_op_name(op);
  HG_CHECK(x.defined(), "{}: the input is an undefined tensor", name);
  const int64_t d = wrap_dim(dim, x.dim(), name);
  ReductionPlan p = plan_reduction(x, {d}, keepdim, op);
  HG_CHECK(p.reduced > 0, "{}: cannot reduce over dim {} of {}, which has size 0 (there is no identity)", name, d,
           x.meta());
  Tensor values = empty(p.out_shape, {.dtype = x.dtype(), .device = x.device()});
  Tensor indices = empty(p.out_shape, {.dtype = kInt64, .device = x.device()});
  run_reduction(op, p, values, indices);
  // backward: the gradient of each value flows to the element it was taken from.
  record(op == ReduceOp::Max ? "MaxDimBackward" : "MinDimBackward", {x}, {values, indices},
         [saved_indices = SavedTensor(indices, name), d, keepdim, shape = x.shape()](const GradContext& g) -> TensorList {
           return {picked_gradient(g[0], saved_indices.get(), d, keepdim, shape)};
         }, DoubleBackward::Supported);
  return {values, indices};
}

Tensor extreme_index(const Tensor& x, int64_t dim, bool keepdim, ReduceOp op) {
  const char* name = reduce_op_name(op);
  HG_CHECK(x.defined(), "{}: the input is an undefined tensor", name);
  const int64_t d = wrap_dim(dim, x.dim(), name);
  ReductionPlan p = plan_reduction(x, {d}, keepdim, op);
  HG_CHECK(p.reduced > 0, "{}: cannot reduce over dim {} of {}, which has size 0 (there is no identity)", name, d,
           x.meta());
  Tensor indices = empty(p.out_shape, {.dtype = kInt64, .device = x.device()});
  run_reduction(op, p, Tensor(), indices);
  return indices;  // not differentiable
}

Tensor logical_reduction(const Tensor& x, const Dims& dims, bool keepdim, ReduceOp op) {
  ReductionPlan p = plan_reduction(x, dims, keepdim, op);
  Tensor out = empty(p.out_shape, {.dtype = kBool, .device = x.device()});
  run_reduction(op, p, out, Tensor());
  // PyTorch keeps uint8 for a uint8 input (its one exception, kept for the masks of old code)
  return x.dtype() == kUInt8 ? out.to(kUInt8) : out;  // not differentiable
}

}  // namespace

// Autocast category "unchanged" for all of these: they compare, they do not accumulate, so any dtype is
// exact. (argmin, all and any are not in kCastRules, so they have no HG_AUTOCAST line: autocast would not
// cast them anyway, only its trace does not name them.)
Tensor max(const Tensor& x) {
  HG_AUTOCAST(max, x);
  return extreme_values("max", x, {}, false, ReduceOp::Max, /*nan_ties=*/true);
}
Tensor min(const Tensor& x) {
  HG_AUTOCAST(min, x);
  return extreme_values("min", x, {}, false, ReduceOp::Min, /*nan_ties=*/true);
}
Tensor amax(const Tensor& x, Dims dims, bool keepdim) {
  HG_AUTOCAST(amax, x, dims, keepdim);
  return extreme_values("amax", x, dims, keepdim, ReduceOp::Max, /*nan_ties=*/false);
}
Tensor amin(const Tensor& x, Dims dims, bool keepdim) {
  HG_AUTOCAST(amin, x, dims, keepdim);
  return extreme_values("amin", x, dims, keepdim, ReduceOp::Min, /*nan_ties=*/false);
}
std::pair<Tensor, Tensor> max(const Tensor& x, int64_t dim, bool keepdim) {
  HG_AUTOCAST(max, x, dim, keepdim);
  return extreme_dim(x, dim, keepdim, ReduceOp::Max);
}
std::pair<Tensor, Tensor> min(const Tensor& x, int64_t dim, bool keepdim) {
  HG_AUTOCAST(min, x, dim, keepdim);
  return extreme_dim(x, dim, keepdim, ReduceOp::Min);
}
Tensor argmax(const Tensor& x, int64_t dim, bool keepdim) {
  HG_AUTOCAST(argmax, x, dim, keepdim);
  return extreme_index(x, dim, keepdim, ReduceOp::ArgMax);
}
Tensor argmin(const Tensor& x, int64_t dim, bool keepdim) { return extreme_index(x, dim, keepdim, ReduceOp::ArgMin); }
Tensor all(const Tensor& x, Dims dims, bool keepdim) { return logical_reduction(x, dims, keepdim, ReduceOp::All); }
Tensor any(const Tensor& x, Dims dims, bool keepdim) { return logical_reduction(x, dims, keepdim, ReduceOp::Any); }

Tensor Tensor::sum(Dims dims, bool keepdim) const { return halfgrad::sum(*this, std::move(dims), keepdim); }
Tensor Tensor::mean(Dims dims, bool keepdim) const { return halfgrad::mean(*this, std::move(dims), keepdim); }
Tensor Tensor::var(Dims dims, int64_t correction, bool keepdim) const {
  return halfgrad::var(*this, std::move(dims), correction, keepdim);
}
Tensor Tensor::std(Dims dims, int64_t correction, bool keepdim) const {
  return halfgrad::std(*this, std::move(dims), correction, keepdim);
}
Tensor Tensor::amax(Dims dims, bool keepdim) const { return halfgrad::amax(*this, std::move(dims), keepdim); }
Tensor Tensor::amin(Dims dims, bool keepdim) const { return halfgrad::amin(*this, std::move(dims), keepdim); }
Tensor Tensor::max() const { return halfgrad::max(*this); }
Tensor Tensor::min() const { return halfgrad::min(*this); }
std::pair<Tensor, Tensor> Tensor::max(int64_t dim, bool keepdim) const { return halfgrad::max(*this, dim, keepdim); }
std::pair<Tensor, Tensor> Tensor::min(int64_t dim, bool keepdim) const { return halfgrad::min(*this, dim, keepdim); }
Tensor Tensor::argmax(int64_t dim, bool keepdim) const { return halfgrad::argmax(*this, dim, keepdim); }
Tensor Tensor::argmin(int64_t dim, bool keepdim) const { return halfgrad::argmin(*this, dim, keepdim); }
Tensor Tensor::all(Dims dims, bool keepdim) const { return halfgrad::all(*this, std::move(dims), keepdim); }
Tensor Tensor::any(Dims dims, bool keepdim) const { return halfgrad::any(*this, std::move(dims), keepdim); }

// =====================================================================================================
// 3. CPU kernel
// =====================================================================================================
namespace {

template <typename T>
constexpr bool kIsFloat = std::is_floating_point_v<T> || std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;
// 16-bit floats are widened to float32 a row at a time before they are reduced.
template <typename T> constexpr bool kWiden = std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;

template <typename V> bool is_nan(V v) {
  if constexpr (std::is_floating_point_v<V>) {
    return v != v;
  } else {
    return false;
  }
}

// dst[0..n) := src[0..n) in opmath_t<T>. Half's portable conversion is a chain of branches; with F16C
// (x86 since 2012) it is one instruction per 8 values.
template <typename T> void widen(const T* src, int64_t n, opmath_t<T>* dst) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, Half>) {
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  }
#endif
#if defined(__F16C__)
  if constexpr (std::is_same_v<T, Half>) {
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
#endif
  for (; i < n; ++i) dst[i] = opmath_t<T>(src[i]);
}

constexpr int64_t kParallelGrain = 32768;  // input elements below which a reduction runs on one thread
constexpr int64_t kMinRowChunk = 8192;     // the smallest piece of one row given to a thread
constexpr int64_t kMinRowsPerChunk = 64;   // the fewest rows of a column block given to a thread
constexpr int64_t kColumnBlock = 4096;     // columns reduced together in the [outer, reduced, inner > 1] case
constexpr int64_t kCascadeStep = 16;       // additions per cascade level before carrying to the next
constexpr int kMaxCascadeLevels = 16;      // 16^16 rows: more than any tensor has
constexpr int64_t kExtremeBlock = 1024;    // elements of a row scanned for their extreme at a time

// ---- reducers: what one output element accumulates.
//
// Accumulating reducers (sum, var's passes, all, any) have
//   State                          the running result; identity() is the result of reducing nothing
//   add(state, value, center)      value: the input element, widened to opmath_t for 16-bit floats
//   merge(a, b)                    a := a combined with b
//   kCascade                       accumulate in cascaded levels (floating sums: see reduce_block)
//   kCentered                      add() reads a per-output center (var's second pass)
// Extreme reducers (max, min) find a value and the index of its first occurrence; their loops are
// extreme_row and extreme_columns.

// Sum (also mean, and the mean pass of var), accumulated in Acc.
template <typename T, typename Acc> struct SumReducer {
  using In = T;
  using State = Acc;
  using Center = Acc;  // unused
  static constexpr bool kCascade = std::is_floating_point_v<Acc>;
  static constexpr bool kCentered = false;
  static State identity() { return Acc(0); }
  template <typename U> static void add(State& s, U v, Center) { s += Acc(v); }
  static void merge(State& a, const State& b) { a += b; }
};

// Var's second pass: the sum of (x - mean)^2, with the mean of the output's elements as the center.
// Two passes instead of Welford's one: the loop is a plain vectorisable multiply-add. An error e in the
// computed mean only adds n e^2 to the result (the cross term sums to zero), a second-order effect, so no
// correction term is needed.
template <typename T, typename Acc> struct SquaredDeviationReducer {
  using In = T;
  using State = Acc;
  using Center = Acc;
  static constexpr bool kCascade = true;
  static constexpr bool kCentered = true;
  static State identity() { return Acc(0); }
  template <typename U> static void add(State& s, U v, Center mean) {
    const Acc d = Acc(v) - mean;
    s += d * d;
  }
  static void merge(State& a, const State& b) { a += b; }
};

// All (kAll) or any: whether values are nonzero (nan is nonzero). A byte, not a bool, so that the
// compiler treats the lanes as plain integers and vectorises.
template <typename T, bool kAll> struct LogicalReducer {
  using In = T;
  using State = uint8_t;
  using Center = uint8_t;  // unused
  static constexpr bool kCascade = false;
  static constexpr bool kCentered = false;
  static State identity() { return kAll; }
  template <typename U> static void add(State& s, U v, Center) {
    if constexpr (kAll) {
      s &= uint8_t(v != U(0));
    } else {
      s |= uint8_t(v != U(0));
    }
  }
  static void merge(State& a, const State& b) {
    if constexpr (kAll) {
      a &= b;
    } else {
      a |= b;
    }
  }
};

// Max (kMax) or min, with the index of the first occurrence; a nan beats every number.
template <typename T, bool kMax> struct ExtremeReducer {
  using In = T;
  using V = opmath_t<T>;
  struct State {
    V v;
    int64_t i;
  };
  using Center = V;  // unused
  static constexpr bool kExtreme = true;
  // Whether v replaces the current extreme s: strictly better, or the first nan. Ties keep s, which came
  // from an earlier index.
  // (Bitwise | and &: no branches, so the loops that use these vectorise and random data costs no
  // mispredictions.)
  static bool takes(V v, V s) { return (kMax ? v > s : v < s) | (is_nan(v) & !is_nan(s)); }
  // The extreme of s and v when only the value matters (any nan wins).
  static V pick(V v, V s) { return ((kMax ? v > s : v < s) | is_nan(v)) ? v : s; }
  static void merge(State& a, const State& b) {
    const bool a_nan = is_nan(a.v), b_nan = is_nan(b.v);
    if (a_nan || b_nan) {
      if (b_nan && (!a_nan || b.i < a.i)) a = b;
    } else if ((kMax ? b.v > a.v : b.v < a.v) || (b.v == a.v && b.i < a.i)) {
      a = b;
    }
  }
};

template <typename Rd>
concept ExtremeReduction = Rd::kExtreme;

// How many independent accumulators reduce_row keeps: about 128 bytes of state, enough for the compiler
// to fill several vector registers and hide the latency of the adds.
template <typename Rd> constexpr int64_t kLanes = std::max<int64_t>(4, 128 / int64_t(sizeof(typename Rd::State)));

// A rectangle of the input for reduce_block: `rows` rows of `width` consecutive elements, row r at
// base + r * row_stride, each column reducing into one accumulator.
//   kWidth > 0 (row mode): the block is one contiguous row seen as [rows, kWidth]; every column shares
//     centers[0].
//   kWidth == 0 (column mode): column j has center centers[j].
// index_base is the index along the reduced dim of row 0 (used by the extreme reducers).
template <typename Rd> struct Block {
  const typename Rd::In* base;
  int64_t rows, row_stride, width;
  int64_t index_base;
  const typename Rd::Center* centers;  // read only when Rd::kCentered
};

// acc[j] := the reduction of column j of the block (an accumulating reducer).
//
// Floating sums are cascaded: level 0 takes kCascadeStep rows, then is added into level 1 and restarted;
// level 1 carries into level 2 after kCascadeStep such carries, and so on. Each level only ever adds up
// about kCascadeStep terms of similar size, so the error grows like log(rows) instead of rows, while the
// inner loop stays a plain vectorisable `acc[j] += row[j]` (a naive float32 sum of ones stops at 2^24;
// this one does not).
template <typename Rd, int64_t kWidth>
void reduce_block(const Block<Rd>& b, typename Rd::State* acc) {
  using In = typename Rd::In;
  using State = typename Rd::State;
  using Center = typename Rd::Center;
  constexpr bool kRowMode = kWidth > 0;
  const int64_t width = kRowMode ? kWidth : b.width;
  auto center = [&](int64_t j) -> Center {
    if constexpr (!Rd::kCentered) {
      return Center();
    } else if constexpr (kRowMode) {
      return b.centers[0];
    } else {
      return b.centers[j];
    }
  };
  // What add() receives: the input type, or float32 for 16-bit floats, which are widened into a buffer
  // first. Row mode widens many rows at once, since a load right after the stores that fill the buffer
  // would stall on store forwarding; column mode widens four rows at a time into a per-call buffer.
  using Value = std::conditional_t<kWiden<In>, opmath_t<In>, In>;
  constexpr int64_t kRowBatch = kRowMode ? std::max<int64_t>(4, 512 / std::max<int64_t>(kWidth, 1)) : 4;
  Value row_mode_wide[kWiden<In> && kRowMode ? kRowBatch * kWidth : 1];
  std::unique_ptr<Value[]> column_mode_wide;
  if constexpr (kWiden<In> && !kRowMode) column_mode_wide = std::make_unique<Value[]>(size_t(4 * width));

  // Adds rows [r, r + n) into dst, four rows per pass over dst: a quarter of the accumulator loads and
  // stores, which otherwise limit column mode.
  auto add_rows = [&](State* dst, int64_t r, int64_t n) {
    for (int64_t batch = r; batch < r + n; batch += kRowBatch) {
      const int64_t batch_rows = std::min(kRowBatch, r + n - batch);
      if constexpr (kWiden<In> && kRowMode) widen(b.base + batch * kWidth, batch_rows * kWidth, row_mode_wide);
      for (int64_t i = batch; i < batch + batch_rows; i += 4) {
        const int64_t k = std::min<int64_t>(4, batch + batch_rows - i);
        const Value* rows[4];
        for (int64_t q = 0; q < k; ++q) {
          if constexpr (kWiden<In> && kRowMode) {
            rows[q] = row_mode_wide + (i + q - batch) * kWidth;
          } else if constexpr (kWiden<In>) {
            widen(b.base + (i + q) * b.row_stride, width, column_mode_wide.get() + q * width);
            rows[q] = column_mode_wide.get() + q * width;
          } else {
            rows[q] = b.base + (i + q) * b.row_stride;
          }
        }
        if (k == 4) {
          const Value *r0 = rows[0], *r1 = rows[1], *r2 = rows[2], *r3 = rows[3];
          for (int64_t j = 0; j < width; ++j) {
            State s = dst[j];
            Rd::add(s, r0[j], center(j));
            Rd::add(s, r1[j], center(j));
            Rd::add(s, r2[j], center(j));
            Rd::add(s, r3[j], center(j));
            dst[j] = s;
          }
        } else {
          for (int64_t q = 0; q < k; ++q)
            for (int64_t j = 0; j < width; ++j) Rd::add(dst[j], rows[q][j], center(j));
        }
      }
    }
  };

  if constexpr (!Rd::kCascade) {
    for (int64_t j = 0; j < width; ++j) acc[j] = Rd::identity();
    add_rows(acc, 0, b.rows);
  } else {
    int levels = 1;
    for (int64_t capacity = kCascadeStep; capacity < b.rows && levels < kMaxCascadeLevels; capacity *= kCascadeStep)
      ++levels;
    // Level 0 is acc itself; the others live on the stack (row mode) or in one buffer per call.
    constexpr int64_t kStackStates = kRowMode ? kWidth * (kMaxCascadeLevels - 1) : 1;
    State stack_levels[kStackStates];
    std::unique_ptr<State[]> heap_levels;
    State* upper = stack_levels;
    if (!kRowMode && levels > 1) {
      heap_levels = std::make_unique<State[]>(size_t((levels - 1) * width));
      upper = heap_levels.get();
    }
    State* level[kMaxCascadeLevels];
    level[0] = acc;
    for (int k = 1; k < levels; ++k) level[k] = upper + (k - 1) * width;
    for (int k = 0; k < levels; ++k)
      for (int64_t j = 0; j < width; ++j) level[k][j] = Rd::identity();

    for (int64_t r = 0; r < b.rows;) {
      const int64_t n = std::min(kCascadeStep, b.rows - r);
      add_rows(level[0], r, n);
      r += n;
      if (n < kCascadeStep) break;  // the last, partial step stays in level 0
      int64_t carries = r / kCascadeStep;
      for (int k = 0; k + 1 < levels; ++k) {
        for (int64_t j = 0; j < width; ++j) {
          Rd::merge(level[k + 1][j], level[k][j]);
          level[k][j] = Rd::identity();
        }
        if (carries % kCascadeStep != 0) break;
        carries /= kCascadeStep;
      }
    }
    for (int k = 1; k < levels; ++k)
      for (int64_t j = 0; j < width; ++j) Rd::merge(acc[j], level[k][j]);
  }
}

// c ? a : b on the bits. For a scalar ternary on floats the compiler emits a branch, which random data
// mispredicts half of the time.
template <typename V> V select_bits(bool c, V a, V b) {
  using Bits = std::conditional_t<sizeof(V) == 1, uint8_t,
                                  std::conditional_t<sizeof(V) == 4, uint32_t, uint64_t>>;
  static_assert(sizeof(V) == sizeof(Bits));
  const Bits mask = Bits(Bits(0) - Bits(c));
  return std::bit_cast<V>(Bits((std::bit_cast<Bits>(a) & mask) | (std::bit_cast<Bits>(b) & Bits(~mask))));
}

// The extreme value of block[0..n), n >= 1 (any nan wins). Lanes of one vector register (four of them for
// long blocks, to hide the latency of compare-and-select); the tail is one more vector that overlaps the
// previous ones (harmless for a max), and the lanes are folded in a tree.
template <typename Rd> typename Rd::V block_extreme(const typename Rd::V* block, int64_t n) {
  using V = typename Rd::V;
  constexpr int64_t L = std::max<int64_t>(8, 64 / int64_t(sizeof(V)));
  if (n < L) {
    V e = block[0];
    for (int64_t i = 1; i < n; ++i) e = select_bits(Rd::takes(block[i], e), block[i], e);
    return e;
  }
  V lanes[L];
  int64_t i = L;
  if (n >= 4 * L) {
    V wide[4 * L];
    for (int64_t j = 0; j < 4 * L; ++j) wide[j] = block[j];
    for (i = 4 * L; i + 4 * L <= n; i += 4 * L)
      for (int64_t j = 0; j < 4 * L; ++j) wide[j] = Rd::pick(block[i + j], wide[j]);
    for (int64_t j = 0; j < L; ++j) lanes[j] = Rd::pick(Rd::pick(wide[j], wide[j + L]), Rd::pick(wide[j + 2 * L], wide[j + 3 * L]));
  } else {
    for (int64_t j = 0; j < L; ++j) lanes[j] = block[j];
  }
  for (; i + L <= n; i += L)
    for (int64_t j = 0; j < L; ++j) lanes[j] = Rd::pick(block[i + j], lanes[j]);
  if (i < n)
    for (int64_t j = 0; j < L; ++j) lanes[j] = Rd::pick(block[n - L + j], lanes[j]);
  // The fold, branch-free (a vectorised ternary is a blend, a scalar one a branch).
  for (int64_t width = L / 2; width >= 1; width /= 2)
    for (int64_t j = 0; j < width; ++j)
      lanes[j] = select_bits(Rd::takes(lanes[j + width], lanes[j]) | is_nan(lanes[j + width]), lanes[j + width], lanes[j]);
  return lanes[0];
}

// The first position of e in block[0..n), where it is known to be (a nan e matches the first nan).
template <typename Rd> int64_t first_position(const typename Rd::V* block, typename Rd::V e) {
  int64_t j = 0;
  if (is_nan(e)) {
    while (!is_nan(block[j])) ++j;
  } else {
    while (block[j] != e) ++j;
  }
  return j;
}

// Max or min of n >= 1 contiguous elements with the index of its first occurrence. Each block of the row
// is reduced to its extreme value (vectorised); the position is searched for only in the first block and
// in blocks that beat the best so far, which on most data is a handful of times per row.
template <typename Rd> typename Rd::State extreme_row(const typename Rd::In* p, int64_t n, int64_t index_base) {
  using In = typename Rd::In;
  using V = typename Rd::V;
  typename Rd::State best{};
  V wide[kExtremeBlock];
  for (int64_t b0 = 0; b0 < n; b0 += kExtremeBlock) {
    const int64_t m = std::min(kExtremeBlock, n - b0);
    const V* block;
    if constexpr (std::is_same_v<In, V>) {
      block = p + b0;
    } else {
      widen(p + b0, m, wide);
      block = wide;
    }
    const V e = block_extreme<Rd>(block, m);
    if (b0 == 0 || Rd::takes(e, best.v)) {
      const int64_t j = first_position<Rd>(block, e);
      best = {block[j], index_base + b0 + j};  // block[j], not e: -0.0 and 0.0 tie, and the value must be x[index]
    }
  }
  return best;
}

// acc[j] := max or min of column j of the block, with its first row (plus index_base). Values and
// indices are kept in separate arrays so that the compare-and-select per element vectorises.
template <typename Rd> void extreme_columns(const Block<Rd>& b, typename Rd::State* acc) {
  using In = typename Rd::In;
  using V = typename Rd::V;
  const int64_t width = b.width;
  // One allocation per call (per task), not per element.
  auto buffers = std::make_unique<V[]>(size_t(2 * width));
  auto index_buffer = std::make_unique<int64_t[]>(size_t(width));
  V* values = buffers.get();
  V* wide = buffers.get() + width;
  int64_t* indices = index_buffer.get();
  auto row_at = [&](int64_t r) -> const V* {
    if constexpr (std::is_same_v<In, V>) {
      return b.base + r * b.row_stride;
    } else {
      widen(b.base + r * b.row_stride, width, wide);
      return wide;
    }
  };
  const V* row0 = row_at(0);
  for (int64_t j = 0; j < width; ++j) {
    values[j] = row0[j];
    indices[j] = b.index_base;
  }
  for (int64_t r = 1; r < b.rows; ++r) {
    const V* row = row_at(r);
    const int64_t index = b.index_base + r;
    for (int64_t j = 0; j < width; ++j) {
      const bool take = Rd::takes(row[j], values[j]);
      values[j] = take ? row[j] : values[j];
      indices[j] = take ? index : indices[j];
    }
  }
  for (int64_t j = 0; j < width; ++j) acc[j] = {values[j], indices[j]};
}

// The reduction of n >= 1 contiguous elements, the first having index index_base.
template <typename Rd>
typename Rd::State reduce_row(const typename Rd::In* p, int64_t n, int64_t index_base, typename Rd::Center center) {
  if constexpr (ExtremeReduction<Rd>) {
    return extreme_row<Rd>(p, n, index_base);
  } else {
    using State = typename Rd::State;
    constexpr int64_t L = kLanes<Rd>;
    State s = Rd::identity();
    int64_t done = 0;
    if (n >= L) {
      // The row as a [n / L, L] block: L interleaved accumulators, merged at the end.
      State lanes[L];
      reduce_block<Rd, L>(Block<Rd>{p, n / L, L, L, index_base, &center}, lanes);
      for (int64_t j = 0; j < L; ++j) Rd::merge(s, lanes[j]);
      done = n / L * L;
    }
    for (int64_t i = done; i < n; ++i) Rd::add(s, opmath_t<typename Rd::In>(p[i]), center);
    return s;
  }
}

// acc[j] := the reduction of column j of the block (column mode).
template <typename Rd> void reduce_columns(const Block<Rd>& b, typename Rd::State* acc) {
  if constexpr (ExtremeReduction<Rd>) {
    extreme_columns<Rd>(b, acc);
  } else {
    reduce_block<Rd, 0>(b, acc);
  }
}

// [lo, hi) of piece `c` when n items are split into `pieces` nearly equal pieces.
std::pair<int64_t, int64_t> piece(int64_t n, int64_t pieces, int64_t c) { return {n * c / pieces, n * (c + 1) / pieces}; }

// Reduces input (outer, reduced, inner) and calls sink(output position o * inner + i, state) once per
// output. `centers` (var's second pass) holds one center per output.
template <typename Rd, typename Sink>
void run_reducer(const typename Rd::In* in, int64_t outer, int64_t reduced, int64_t inner,
                 const typename Rd::Center* centers, Sink&& sink) {
  using State = typename Rd::State;
  using Center = typename Rd::Center;
  const int64_t outputs = outer * inner;
  if (reduced == 0) {
    if constexpr (ExtremeReduction<Rd>) {
      HG_FAIL("reduce: max/min over an empty dim has no identity (a bug: the op layer should have refused it)");
    } else {
      for (int64_t pos = 0; pos < outputs; ++pos) sink(pos, Rd::identity());
      return;
    }
  }
  const int64_t threads = outer * reduced * inner >= kParallelGrain ? omp_get_max_threads() : 1;
  auto center_at = [&](int64_t pos) -> Center {
    if constexpr (ExtremeReduction<Rd>) {
      return Center();
    } else {
      return Rd::kCentered ? centers[pos] : Center();
    }
  };

  if (inner == 1) {
    // Each output reduces one contiguous row. Many rows: one row per iteration, rows over threads.
    // Few long rows: every row is cut into pieces, the pieces go over threads and are merged in order.
    const int64_t pieces = outer < threads ? std::min(threads, std::max<int64_t>(1, reduced / kMinRowChunk)) : 1;
    if (pieces == 1) {
#pragma omp parallel for schedule(static) if (threads > 1)
      for (int64_t o = 0; o < outer; ++o) sink(o, reduce_row<Rd>(in + o * reduced, reduced, 0, center_at(o)));
      return;
    }
    auto partial = std::make_unique<State[]>(size_t(outer * pieces));
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < outer * pieces; ++t) {
      const int64_t o = t / pieces;
      auto [lo, hi] = piece(reduced, pieces, t % pieces);
      partial[size_t(t)] = reduce_row<Rd>(in + o * reduced + lo, hi - lo, lo, center_at(o));
    }
    for (int64_t o = 0; o < outer; ++o) {
      State s = partial[size_t(o * pieces)];
      for (int64_t c = 1; c < pieces; ++c) Rd::merge(s, partial[size_t(o * pieces + c)]);
      sink(o, s);
    }
    return;
  }

  // inner > 1: an output column (o, i) reduces input[o, :, i]. Whole rows of up to kColumnBlock columns are
  // added into as many accumulators (a vectorised loop, and no transposing copy). Tasks are
  // (outer, column block) pairs; when there are fewer than threads, the rows are cut into pieces too.
  const int64_t column_blocks = (inner + kColumnBlock - 1) / kColumnBlock;
  const int64_t block_width = std::min(kColumnBlock, inner);  // the widest column block
  const int64_t tasks = outer * column_blocks;
  const int64_t pieces =
      tasks < threads ? std::min((threads + tasks - 1) / tasks, std::max<int64_t>(1, reduced / kMinRowsPerChunk)) : 1;
  auto reduce_task = [&](int64_t task, int64_t r0, int64_t r1, State* acc) {
    const int64_t o = task / column_blocks, col0 = task % column_blocks * kColumnBlock;
    const int64_t width = std::min(kColumnBlock, inner - col0);
    const Center* block_centers = nullptr;
    if constexpr (!ExtremeReduction<Rd>) {
      if (Rd::kCentered) block_centers = centers + o * inner + col0;
    }
    reduce_columns<Rd>(Block<Rd>{in + (o * reduced + r0) * inner + col0, r1 - r0, inner, width, r0, block_centers}, acc);
    return std::pair{o * inner + col0, width};  // the first output position and how many
  };
  if (pieces == 1) {
#pragma omp parallel for schedule(static) if (threads > 1)
    for (int64_t task = 0; task < tasks; ++task) {
      auto acc = std::make_unique<State[]>(size_t(block_width));  // one allocation per task
      auto [pos, width] = reduce_task(task, 0, reduced, acc.get());
      for (int64_t j = 0; j < width; ++j) sink(pos + j, acc[size_t(j)]);
    }
    return;
  }
  auto partial = std::make_unique<State[]>(size_t(tasks * pieces * block_width));
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tasks * pieces; ++t) {
    auto [r0, r1] = piece(reduced, pieces, t % pieces);
    reduce_task(t / pieces, r0, r1, &partial[size_t(t * block_width)]);
  }
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t o = task / column_blocks, col0 = task % column_blocks * kColumnBlock;
    const int64_t width = std::min(kColumnBlock, inner - col0);
    const State* first = &partial[size_t(task * pieces * block_width)];
    for (int64_t j = 0; j < width; ++j) {
      State s = first[j];
      for (int64_t c = 1; c < pieces; ++c) Rd::merge(s, first[c * block_width + j]);
      sink(o * inner + col0 + j, s);
    }
  }
}

template <typename T> void reduce_cpu_typed(const ReduceArgs& a) {
  const T* in = static_cast<const T*>(a.input.data_ptr());
  const char* name = reduce_op_name(a.op);
  const int64_t outer = a.outer, reduced = a.reduced, inner = a.inner;
  switch (a.op) {
    case ReduceOp::Sum: {
      if constexpr (kIsFloat<T>) {
        using Acc = opmath_t<T>;
        T* out = a.values.data<T>();
        run_reducer<SumReducer<T, Acc>>(in, outer, reduced, inner, nullptr, [&](int64_t pos, Acc s) { out[pos] = T(s); });
      } else {
        int64_t* out = a.values.data<int64_t>();
        run_reducer<SumReducer<T, int64_t>>(in, outer, reduced, inner, nullptr,
                                            [&](int64_t pos, int64_t s) { out[pos] = s; });
      }
      return;
    }
    case ReduceOp::Mean:
    case ReduceOp::Var: {
      if constexpr (kIsFloat<T>) {
        using Acc = opmath_t<T>;
        T* out = a.values.data<T>();
        const Acc count = Acc(reduced);
        if (a.op == ReduceOp::Mean) {
          run_reducer<SumReducer<T, Acc>>(in, outer, reduced, inner, nullptr,
                                          [&](int64_t pos, Acc s) { out[pos] = T(s / count); });
          return;
        }
        // Two passes: the means, then the deviations, both in double as PyTorch's CPU kernel (its Welford in double):
        // float32 values near 1.5e19 have squared deviations past float32's range and a variance within it.
        std::vector<double> means(size_t(outer * inner));
        run_reducer<SumReducer<T, double>>(in, outer, reduced, inner, nullptr,
                                           [&](int64_t pos, double s) { means[size_t(pos)] = s / double(reduced); });
        const double divisor = double(std::max<int64_t>(0, reduced - a.correction));
        run_reducer<SquaredDeviationReducer<T, double>>(in, outer, reduced, inner, means.data(),
                                                        [&](int64_t pos, double squares) {
                                                          out[pos] = T(squares / divisor);
                                                        });
        return;
      } else {
        throw_unsupported_dtype(name, a.input.dtype());
      }
    }
    case ReduceOp::Max:
    case ReduceOp::ArgMax:
    case ReduceOp::Min:
    case ReduceOp::ArgMin: {
      T* values = a.values.defined() ? a.values.data<T>() : nullptr;
      int64_t* indices = a.indices.defined() ? a.indices.data<int64_t>() : nullptr;
      auto store = [&](int64_t pos, const auto& s) {
        if (values) values[pos] = T(s.v);
        if (indices) indices[pos] = s.i;
      };
      if (a.op == ReduceOp::Max || a.op == ReduceOp::ArgMax) {
        run_reducer<ExtremeReducer<T, true>>(in, outer, reduced, inner, nullptr, store);
      } else {
        run_reducer<ExtremeReducer<T, false>>(in, outer, reduced, inner, nullptr, store);
      }
      return;
    }
    case ReduceOp::All:
    case ReduceOp::Any: {
      bool* out = a.values.data<bool>();
      auto store = [&](int64_t pos, uint8_t s) { out[pos] = s != 0; };
      if (a.op == ReduceOp::All) {
        run_reducer<LogicalReducer<T, true>>(in, outer, reduced, inner, nullptr, store);
      } else {
        run_reducer<LogicalReducer<T, false>>(in, outer, reduced, inner, nullptr, store);
      }
      return;
    }
  }
}

void reduce_cpu(const ReduceArgs& a) {
  HG_CHECK((a.input.numel() == 0 || a.input.is_contiguous()) && a.input.numel() == a.outer * a.reduced * a.inner,
           "{}: reduce_cpu expects a contiguous [outer, reduced, inner] input, got {} for [{}, {}, {}]",
           reduce_op_name(a.op), a.input.meta(), a.outer, a.reduced, a.inner);
  dispatch_all(a.input.dtype(), reduce_op_name(a.op), [&]<typename T>() { reduce_cpu_typed<T>(a); });
}

}  // namespace

HG_REGISTER_KERNEL(reduce_kernel, CPU, reduce_cpu);

}  // namespace halfgrad

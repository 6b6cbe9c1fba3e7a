// pad: the public op, its rules and its backward next to it, and the CPU kernels.
#include "ops/pad.h"

#include <numeric>
#include <utility>

#include <fmt/ranges.h>

#include "core/autocast.h"
#include "core/autograd.h"

namespace halfgrad {

constinit KernelTable<PadKernel> pad_kernel("pad");
constinit KernelTable<PadBackwardKernel> pad_backward_kernel("pad_backward");

const char* pad_mode_name(PadMode mode) {
  switch (mode) {
    case PadMode::Constant: return "constant";
    case PadMode::Reflect: return "reflect";
    case PadMode::Replicate: return "replicate";
    case PadMode::Circular: return "circular";
  }
  return "?";
}

namespace {

// A padding worked out once for the forward and reused by every backward: the shapes, the memory format both
// sides keep, the order of x's dims in memory (`order`: the kernels walk memory) and the kernels' geometry.
struct PadPlan {
  Shape in, out;
  MemoryFormat format = MemoryFormat::Contiguous;
  std::vector<int64_t> order;
  PadGeometry geometry;
};

// t (in or out of plan) as the kernels read it: contiguous in memory order, the dims of `order`.
Tensor in_memory_order(const Tensor& t, const PadPlan& plan) { return t.permute(plan.order).contiguous(); }

PadPlan plan_padding(const Tensor& x, const std::vector<int64_t>& padding, PadMode mode) {
  PadPlan plan;
  plan.in = x.shape();
  plan.out = x.shape();
  const int64_t dims = x.dim();
  std::vector<int64_t> before(size_t(dims), 0), after(size_t(dims), 0);
  for (size_t k = 0; k < padding.size() / 2; ++k) {
    const size_t d = size_t(dims) - 1 - k;
    before[d] = padding[2 * k];
    after[d] = padding[2 * k + 1];
    plan.out[d] = x.size(int64_t(d)) + before[d] + after[d];
  }
  plan.format = dims == 4 && suggest_memory_format(x) == MemoryFormat::ChannelsLast ? MemoryFormat::ChannelsLast
                                                                                    : MemoryFormat::Contiguous;
  plan.order.resize(size_t(dims));
  std::iota(plan.order.begin(), plan.order.end(), 0);
  if (plan.format == MemoryFormat::ChannelsLast) plan.order = {0, 2, 3, 1};
  // The kernels' dims: x's in memory order, each run of dims that no padding touches folded into one.
  PadGeometry& g = plan.geometry;
  g.mode = mode;
  bool folding = false;
  for (int64_t d : plan.order) {
    const bool padded = before[size_t(d)] != 0 || after[size_t(d)] != 0;
    if (!padded && x.size(d) == 1) continue;  // no index to walk
    if (!padded && folding) {
      g.in[g.dims - 1] *= x.size(d);
      g.out[g.dims - 1] *= x.size(d);
      continue;
    }
    HG_CHECK(g.dims < kMaxPadDims, "pad: padding {} of {} makes more than {} runs of padded and unpadded dims for "
             "the kernels to walk; pad fewer dims at a time", padding, x.meta(), kMaxPadDims);
    g.in[g.dims] = x.size(d);
    g.out[g.dims] = plan.out[size_t(d)];
    g.before[g.dims] = before[size_t(d)];
    ++g.dims;
    folding = !padded;
  }
  if (g.dims == 0) g.dims = 1, g.in[0] = g.out[0] = 1;  // a 0-d x: one element
  return plan;
}

// PyTorch's rules for the padding (F.pad and the reflection, replication and circular kernels behind it).
void check_padding(const Tensor& x, const std::vector<int64_t>& padding, PadMode mode,
                   const std::optional<Scalar>& value) {
  HG_CHECK(x.defined(), "pad: the input is an undefined tensor");
  const char* name = pad_mode_name(mode);
  HG_CHECK(padding.size() % 2 == 0, "pad: padding {} must hold (before, after) pairs, an even number of values; got "
           "{} for {}", padding, padding.size(), x.meta());
  const int64_t padded_dims = int64_t(padding.size()) / 2;
  HG_CHECK(padded_dims <= x.dim(), "pad: padding {} pads the last {} dims, but {} has {}", padding, padded_dims,
           x.meta(), x.dim());
  if (mode == PadMode::Constant) {
    HG_CHECK(!value || fits_dtype(*value, x.dtype()), "pad: the value {} cannot be converted to {} without overflow",
             value ? value->str() : "", x.meta());
  } else {
    HG_CHECK(!value || value->to_double() == 0, "pad: {} padding takes no value (got {}); the value is for constant "
             "padding", name, value ? value->str() : "");
    HG_CHECK(padded_dims >= 1 && padded_dims <= 3 && (x.dim() == padded_dims + 1 || x.dim() == padded_dims + 2),
             "pad: {} padding pads the last 1, 2 or 3 dims of a tensor with one or two more (channels, or a batch "
             "and channels): padding {} ({} dims) of {}", name, padding, padded_dims, x.meta());
    for (int64_t d = x.dim() == padded_dims + 2 ? 1 : 0; d < x.dim(); ++d) {
      HG_CHECK(x.size(d) > 0, "pad: {} padding of {}: dim {} is empty, and only a batch may be", name, x.meta(), d);
    }
  }
  for (int64_t k = 0; k < padded_dims; ++k) {
    const int64_t d = x.dim() - 1 - k, n = x.size(d), before = padding[size_t(2 * k)],
                  after = padding[size_t(2 * k + 1)];
    constexpr int64_t kLimit = int64_t(1) << 60;  // sizes and sums of them stay far from int64's end
    HG_CHECK(before >= -kLimit && before <= kLimit && after >= -kLimit && after <= kLimit, "pad: padding ({}, {}) of "
             "dim {} of {} is beyond +-2^60", before, after, d, x.meta());
    // What a negative amount removes comes off the input first (PyTorch's narrow), so it cannot remove more than all.
    const int64_t removed = (before < 0 ? -before : 0) + (after < 0 ? -after : 0), size = n + before + after;
    HG_CHECK(removed <= n, "pad: padding ({}, {}) of dim {} of {} removes {} elements of its {}", before, after, d,
             x.meta(), removed, n);
    switch (mode) {
      case PadMode::Constant: break;
      case PadMode::Reflect:
        HG_CHECK(before < n && after < n, "pad: reflect padding ({}, {}) of dim {} of {} must be less than its size, "
                 "{}", before, after, d, x.meta(), n);
        break;
      case PadMode::Replicate: break;
      case PadMode::Circular:
        HG_CHECK(before <= n - removed && after <= n - removed, "pad: circular padding ({}, {}) of dim {} of {} "
                 "wraps around more than once: each side at most the {} elements kept", before, after, d, x.meta(),
                 n - removed);
        break;
    }
    HG_CHECK(mode == PadMode::Constant || mode == PadMode::Circular || size > 0, "pad: {} padding ({}, {}) of dim {} "
             "of {} leaves no element", name, before, after, d, x.meta());
  }
}

const char* node_name(PadMode mode, bool transposed) {
  switch (mode) {
    case PadMode::Constant: return transposed ? "ConstantPadBackwardBackward" : "ConstantPadBackward";
    case PadMode::Reflect: return transposed ? "ReflectionPadBackwardBackward" : "ReflectionPadBackward";
    case PadMode::Replicate: return transposed ? "ReplicationPadBackwardBackward" : "ReplicationPadBackward";
    case PadMode::Circular: return transposed ? "CircularPadBackwardBackward" : "CircularPadBackward";
  }
  return "PadBackward";
}

Tensor pad_gradient(const Tensor& g, const PadPlan& plan);

// x padded by the plan, and the gradient's sums back into the input's elements: each the other's transpose, so each
// the other's backward (the constant is no function of x), to any order.
Tensor padded(const Tensor& x, const PadPlan& plan, const Scalar& value) {
  Tensor out = empty(plan.out, {.dtype = x.dtype(), .device = x.device()}, plan.format);
  if (out.numel() > 0) {
    const Tensor constant = full({}, value, {.dtype = x.dtype()});
    pad_kernel[x.device()](out, in_memory_order(x.detach(), plan), plan.geometry, constant);
  }
  if (!any_requires_grad({&x})) return out;  // (nothing to differentiate: no closure to build)
  record(node_name(plan.geometry.mode, false), {x}, {out}, [plan](const GradContext& g) -> TensorList {
    return {pad_gradient(g[0], plan)};
  }, DoubleBackward::Supported);
  return out;
}

// A constant padding's transpose as a constant padding of its output: every amount negated (what the forward added
// is cut off, what it removed comes back as zeros), input and output swapped.
PadGeometry pad_transposed(PadGeometry g) {
  for (int d = 0; d < g.dims; ++d) {
    std::swap(g.in[d], g.out[d]);
    g.before[d] = -g.before[d];
  }
  return g;
}

Tensor pad_gradient(const Tensor& g, const PadPlan& plan) {
  Tensor grad_input = empty(plan.in, {.dtype = g.dtype(), .device = g.device()}, plan.format);
  if (grad_input.numel() > 0) {
    const Tensor grad_output = in_memory_order(g.detach(), plan);
    if (plan.geometry.mode == PadMode::Constant) {
      const Tensor zero = full({}, 0, {.dtype = g.dtype()});
      pad_kernel[g.device()](grad_input, grad_output, pad_transposed(plan.geometry), zero);
    } else {
      HG_CHECK(plan.geometry.dims <= kMaxPadGradientDims, "pad: a {} padding's kernels walk {} dims, more than its "
               "gradient's {} (a bug: check_padding's rules leave at most that many)", pad_mode_name(plan.geometry.mode),
               plan.geometry.dims, kMaxPadGradientDims);
      pad_backward_kernel[g.device()](grad_input, grad_output, plan.geometry);
    }
  }
  if (!any_requires_grad({&g})) return grad_input;
  record(node_name(plan.geometry.mode, true), {g}, {grad_input}, [plan](const GradContext& gg) -> TensorList {
    return {padded(gg[0], plan, 0)};
  }, DoubleBackward::Supported);
  return grad_input;
}

}  // namespace

Tensor pad(const Tensor& x, const std::vector<int64_t>& padding, PadMode mode, std::optional<Scalar> value) {
  HG_AUTOCAST(pad, x, padding, mode, value);
  check_padding(x, padding, mode, value);
  return padded(x, plan_padding(x, padding, mode), value.value_or(Scalar(0)));
}

// ---- CPU kernels
namespace {

void pad_cpu(const Tensor& out, const Tensor& x, const PadGeometry& geometry, const Tensor& value) {
  dispatch_all(out.dtype(), "pad", [&]<typename T>() {
    T* o = out.data<T>();
    const T* in = x.data<T>();
    const T fill = value.data<T>()[0];
    const int64_t n = out.numel();
#pragma omp parallel for schedule(static) if (n >= 32768)
    for (int64_t k = 0; k < n; ++k) {
      const int64_t source = pad_source_index<int64_t>(geometry, geometry.out, k);
      o[k] = source < 0 ? fill : in[source];
    }
  });
}

void pad_backward_cpu(const Tensor& grad_input, const Tensor& grad_output, const PadGeometry& geometry) {
  dispatch_floating(grad_input.dtype(), "pad_backward", [&]<typename T>() {
    T* gi = grad_input.data<T>();
    const T* go = grad_output.data<T>();
    const int64_t n = grad_input.numel();
#pragma omp parallel for schedule(static) if (n >= 32768)
    for (int64_t k = 0; k < n; ++k) gi[k] = T(pad_gradient_of<opmath_t<T>, int64_t>(geometry, geometry.in, go, k));
  });
}

}  // namespace

HG_REGISTER_KERNEL(pad_kernel, CPU, pad_cpu);
HG_REGISTER_KERNEL(pad_backward_kernel, CPU, pad_backward_cpu);

}  // namespace halfgrad

#pragma once
// pad: torch.nn.functional.pad (constant, reflect, replicate and circular padding), forward and backward, on CPU
// (ops/pad.cpp) and CUDA (ops/pad.cu). One gather writes every output element from the input element its mode names
// (or the constant); its transpose sums each input element's gradient over the output elements that came from it,
// found by the same rule run backwards (a gather too: no atomics, the same sums on both devices). Each is the other's
// backward, so pad is differentiable to any order. Constant padding's transpose is a constant padding itself (the
// amounts negated, zeros): the forward's gather runs it.
#include <cstdint>
#include <optional>
#include <vector>

#include "core/dispatch.h"
#include "core/half.h"
#include "core/int_divider.h"
#include "core/tensor.h"

namespace halfgrad {

enum class PadMode : uint8_t {
  Constant,   // the value (0 unless given) outside the input
  Reflect,    // the input mirrored at its edges, the edge itself not repeated: [1 2 3] padded by 2 is [3 2 1 2 3 2 1]
  Replicate,  // the edge element repeated: [1 2 3] -> [1 1 1 2 3 3 3]
  Circular,   // the input repeated: [1 2 3] -> [2 3 1 2 3 1 2]
};
const char* pad_mode_name(PadMode mode);  // "constant", "reflect", "replicate", "circular" (PyTorch's mode strings)

// x padded as torch.nn.functional.pad(x, padding, mode, value). `padding` holds (before, after) pairs from the last
// dim backwards: {left, right} pads the last dim, {left, right, top, bottom} the last two, and so on.
//   pad(x, {1, 1, 2, 2});                          // zeros: W + 2, H + 4
//   pad(x, {2, 2, 2, 2}, PadMode::Reflect);       // an image [N, C, H, W] or [C, H, W], as nn.ReflectionPad2d(2)
//   pad(x, {0, 1}, PadMode::Constant, -INFINITY);
// PyTorch's rules, each an error naming pad and what it refuses:
//   - an even number of values, at most two per dim of x, each within +-2^60;
//   - a negative amount removes elements from its side, first (so the two sides of a dim remove at most its size);
//   - Constant: any dtype and number of dims (the kernels walk up to 8: each padded dim, each run of unpadded ones
//     merged, unpadded dims of 1 dropped); the value must fit x's dtype without overflow (as fill_);
//   - Reflect, Replicate and Circular pad the last 1, 2 or 3 dims of a tensor with one or two more (a batch and
//     channels, or channels alone), every dim but the batch non-empty, and take no value (or 0). Reflect: each
//     amount below the size of its dim. Circular: each amount at most what is kept of its dim (once round).
//     Two rules are stricter than PyTorch's: Reflect and Replicate refuse a padded dim left with no element (its
//     kernels refuse only a result with none in any padded dim), and Circular's "once round" counts what negative
//     amounts leave (PyTorch's counts the dim before them, and copies overlapping slices beyond it).
// The result has x's dtype, device and memory format (a channels_last x gives a channels_last result). Gradient
// (floating x): each input element gets the sum of the gradients of the output elements that came from it, in x's
// dtype (float16 and bfloat16 summed in float32); in Constant mode that is one gradient element, taken as it is (a
// -0.0 stays -0.0, as PyTorch's). Autocast: not cast.
Tensor pad(const Tensor& x, const std::vector<int64_t>& padding, PadMode mode = PadMode::Constant,
           std::optional<Scalar> value = std::nullopt);

// ---- kernels (core/dispatch.h)
// A padding in the kernels' terms: the tensors are contiguous, of up to kMaxPadDims dims (the op merges each run of
// dims no padding touches into one and drops unpadded dims of 1), and dim d has `in[d]` input elements, `out[d]` output
// elements and `before[d]` elements added before the input (negative: removed).
constexpr int kMaxPadDims = 8;
struct PadGeometry {
  int dims = 0;
  int64_t in[kMaxPadDims] = {}, out[kMaxPadDims] = {}, before[kMaxPadDims] = {};
  PadMode mode = PadMode::Constant;
};

// Reflect, Replicate and Circular pad at most 3 dims of a tensor of at most 5: their geometry has at most 4 dims (the
// batch and channels folded, or channels_last's 4), all that pad_gradient_of walks.
constexpr int kMaxPadGradientDims = 4;

// The index rules below take their integer type I: int64_t, or int32_t where every index of both tensors fits (the
// CUDA kernels' faster arithmetic).

// Circular padding along dim d of g: the input elements [first, first + kept) that a negative amount on either side
// leaves, and `left` repeated before them.
template <typename I> struct PadCircle {
  I first, kept, left;
};
template <typename I> HG_HOST_DEVICE inline PadCircle<I> pad_circle(const PadGeometry& g, int d) {
  const I n = I(g.in[d]), before = I(g.before[d]), after = I(g.out[d]) - n - before;
  const I first = before < 0 ? -before : 0;
  return {first, n - first - (after < 0 ? -after : 0), before > 0 ? before : 0};
}

// Along one dim of g: the input index whose value output index o takes, or -1 (only in Constant mode) where it takes
// the constant.
template <typename I> HG_HOST_DEVICE inline I pad_source(const PadGeometry& g, int d, I o) {
  const I n = I(g.in[d]), before = I(g.before[d]);
  I i = o - before;
  switch (g.mode) {
    case PadMode::Constant: return i >= 0 && i < n ? i : -1;
    case PadMode::Reflect: return i < 0 ? -i : i >= n ? 2 * (n - 1) - i : i;
    case PadMode::Replicate: return i < 0 ? 0 : i >= n ? n - 1 : i;
    case PadMode::Circular: {  // the repeats are of what a negative amount leaves, [first, first + kept)
      const PadCircle<I> c = pad_circle<I>(g, d);
      i = o - c.left;
      return c.first + (i < 0 ? i + c.kept : i >= c.kept ? i - c.kept : i);
    }
  }
  return -1;
}

// Along one dim of g: the output indices that take input index i (pad_source run backwards), as three ranges
// [lo[r], hi[r]) clipped to [0, out), each empty where lo[r] >= hi[r]. Reflect: i itself, then its mirror images on
// the left and on the right; Replicate: i, or a whole side for the edge elements; Circular: i's repeat on the left, i,
// its repeat on the right; Constant: none (its gradient is a padding: pad_transposed). Every range is written at a
// fixed place and read back by selection (low, high), never by an index the GPU only knows at run time, which would
// put the ranges in local memory.
template <typename I> struct PadTargets {
  I lo[3] = {0, 0, 0}, hi[3] = {0, 0, 0};
  HG_HOST_DEVICE I low(int r) const { return r == 0 ? lo[0] : r == 1 ? lo[1] : lo[2]; }
  HG_HOST_DEVICE I high(int r) const { return r == 0 ? hi[0] : r == 1 ? hi[1] : hi[2]; }
  HG_HOST_DEVICE bool none() const { return lo[0] >= hi[0] && lo[1] >= hi[1] && lo[2] >= hi[2]; }
};
template <typename I> HG_HOST_DEVICE inline PadTargets<I> pad_targets(const PadGeometry& g, int d, I i) {
  const I n = I(g.in[d]), m = I(g.out[d]), before = I(g.before[d]);
  PadTargets<I> t;
  auto set = [&](I& lo, I& hi, I a, I b) {  // a range = [a, b) clipped to the output
    lo = a > 0 ? a : 0;
    hi = b < m ? b : m;
  };
  switch (g.mode) {
    case PadMode::Constant: break;
    case PadMode::Reflect:
      set(t.lo[0], t.hi[0], i + before, i + before + 1);
      if (i > 0) set(t.lo[1], t.hi[1], before - i, before - i + 1);  // mirrored on the left
      if (i < n - 1) set(t.lo[2], t.hi[2], before + 2 * (n - 1) - i, before + 2 * (n - 1) - i + 1);  // on the right
      break;
    case PadMode::Replicate: set(t.lo[0], t.hi[0], i == 0 ? 0 : i + before, i == n - 1 ? m : i + before + 1); break;
    case PadMode::Circular: {
      const PadCircle<I> c = pad_circle<I>(g, d);
      const I k = i - c.first;
      if (k < 0 || k >= c.kept) break;  // removed
      set(t.lo[0], t.hi[0], c.left + k - c.kept, c.left + k - c.kept + 1);
      set(t.lo[1], t.hi[1], c.left + k, c.left + k + 1);
      set(t.lo[2], t.hi[2], c.left + k + c.kept, c.left + k + c.kept + 1);
      break;
    }
  }
  return t;
}

// Walking a flat index from the last dim to the first: dim d's coordinate (d's size n), `index` left holding the
// flat index over the dims before d. The quotient and the remainder come from one division, written as such (under
// separate conditions the compiler made two); dim 0's coordinate is what is left. The CUDA kernels' 32-bit walks
// give n as its IntDivider (core/int_divider.h says why and its bounds: index below 2^31, n in [1, 2^31]).
template <typename I> HG_HOST_DEVICE inline I pad_coordinate(I& index, int d, int64_t n) {
  if (d == 0) return index;
  const I q = index / I(n), r = index - q * I(n);
  index = q;
  return r;
}
HG_HOST_DEVICE inline int32_t pad_coordinate(int32_t& index, int d, const IntDivider& n) {
  if (d == 0) return index;
  const int32_t q = int32_t(n.div(uint32_t(index))), r = index - q * int32_t(n.divisor);
  index = q;
  return r;
}

// The flat input index that flat output index `index` takes, or -1 for the constant: the forward's gather, and
// Constant padding's backward on the transposed geometry. `out_sizes`: g.out, or their IntDividers (pad_coordinate).
template <typename I, typename Size>
HG_HOST_DEVICE inline I pad_source_index(const PadGeometry& g, const Size* out_sizes, I index) {
  I source = 0, stride = 1;
  for (int d = g.dims - 1; d >= 0; --d) {
    const I i = pad_source<I>(g, d, pad_coordinate(index, d, out_sizes[d]));
    if (i < 0) return -1;
    source += i * stride;
    stride *= I(g.in[d]);
  }
  return source;
}

// pad_gradient_of's sum over the targets of dims D.. (`t`, each dim's), `flat` the target's flat output index over
// the dims before D: each dim a level of its own, a template argument, so that on the GPU every t[D] is a register
// and no level's work is repeated for each target of the levels around it.
template <int D, typename A, typename I, typename T>
HG_HOST_DEVICE inline void pad_gradient_sum(const PadGeometry& g, const T* grad_output,
                                            const PadTargets<I> (&t)[kMaxPadGradientDims], I flat, A& sum) {
  if constexpr (D < kMaxPadGradientDims) {
    if (D < g.dims) {
      for (int r = 0; r < 3; ++r)
        for (I o = t[D].low(r); o < t[D].high(r); ++o)
          pad_gradient_sum<D + 1, A>(g, grad_output, t, flat * I(g.out[D]) + o, sum);
      return;
    }
  }
  sum += A(grad_output[flat]);
}

// The gradient of flat input index `index` of a Reflect, Replicate or Circular padding (at most kMaxPadGradientDims
// dims): grad_output summed over its targets (the product of each dim's ranges, the last dim fastest), in A, in the
// same order on every device. 0 where a negative amount removed the element. `in_sizes`: g.in, or their IntDividers
// (pad_coordinate).
template <typename A, typename I, typename T, typename Size>
HG_HOST_DEVICE inline A pad_gradient_of(const PadGeometry& g, const Size* in_sizes, const T* grad_output, I index) {
  PadTargets<I> t[kMaxPadGradientDims];
#if defined(__CUDA_ARCH__)
#pragma unroll  // (every t[d] at an index known when compiling: registers, not local memory)
#endif
  for (int d = kMaxPadGradientDims - 1; d >= 0; --d) {
    if (d >= g.dims) continue;
    t[d] = pad_targets<I>(g, d, pad_coordinate(index, d, in_sizes[d]));
    // Removed by a negative amount: no target to add (and none of the flat indices the other dims would form, which
    // need not fit I where the output is empty).
    if (t[d].none()) return A(0);
  }
  A sum = A(0);
  pad_gradient_sum<0, A>(g, grad_output, t, I(0), sum);
  return sum;
}

// out (geometry's output shape) = x padded; `value` is the constant in out's dtype (a 0-d CPU tensor). Any dtype.
using PadKernel = void (*)(const Tensor& out, const Tensor& x, const PadGeometry& geometry, const Tensor& value);
// grad_input (geometry's input shape) = the sums of grad_output over each element's targets: Reflect, Replicate and
// Circular geometries (pad_gradient_of). A floating dtype.
using PadBackwardKernel = void (*)(const Tensor& grad_input, const Tensor& grad_output, const PadGeometry& geometry);
extern KernelTable<PadKernel> pad_kernel;
extern KernelTable<PadBackwardKernel> pad_backward_kernel;

}  // namespace halfgrad

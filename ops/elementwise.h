#pragma once
// Elementwise ops: unary math, binary arithmetic and comparisons with broadcasting, where, clamp, fill.
// The public functions, their backward formulas and the CPU kernels are in ops/elementwise.cpp; the
// arithmetic itself in ops/elementwise_math.h; the CUDA kernels in ops/elementwise.cu.
#include <optional>
#include <string_view>

#include "core/dispatch.h"
#include "core/tensor.h"
#include "ops/elementwise_math.h"

namespace halfgrad {

// ---- public ops. Autocast category: "promote" for binary ops and where (widest floating input wins);
// "float32" for exp, log, pow; "unchanged" for the rest.
Tensor add(const Tensor& a, const Tensor& b, const Scalar& alpha = 1);  // a + alpha * b
Tensor sub(const Tensor& a, const Tensor& b, const Scalar& alpha = 1);  // a - alpha * b
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);  // true division: integers give floats
// A gradient's g / count (a mean's) and g * factor (2 / count: a squared error's), rounded once: a float16 or bfloat16
// g is computed in float32, where a count or factor out of the half dtype's range (70,000 past float16's largest,
// 2 / 70,000 below its normals) stays what it is, as PyTorch's float32 opmath reads it.
Tensor divided_by_count(const Tensor& g, int64_t count);
Tensor scaled_once(const Tensor& g, double factor);
Tensor pow(const Tensor& base, const Tensor& exponent);
Tensor pow(const Tensor& base, const Scalar& exponent);
Tensor pow(const Scalar& base, const Tensor& exponent);
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);
Tensor neg(const Tensor& x);
Tensor abs(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor rsqrt(const Tensor& x);
Tensor tanh(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor relu(const Tensor& x);
Tensor sign(const Tensor& x);
Tensor erf(const Tensor& x);  // the error function, 2/sqrt(pi) * integral of e^(-t^2) from 0 to x
// GELU (torch.nn.functional.gelu): x * Phi(x), Phi the standard normal's distribution function, with approximate
// "none" (through erf) or "tanh" (Hendrycks and Gimpel's tanh form). silu (swish): x * sigmoid(x). Floating inputs
// only, as PyTorch's; autocast "unchanged" (a float16 input is computed in float32 and rounded once).
Tensor gelu(const Tensor& x, std::string_view approximate = "none");
// approximate is "none" or "tanh", or an error naming `op` (gelu's rule, which nn::GELU checks at construction).
void check_gelu_approximate(const char* op, std::string_view approximate);
Tensor silu(const Tensor& x);
Tensor clamp(const Tensor& x, std::optional<Scalar> min, std::optional<Scalar> max);
Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);
Tensor logical_and(const Tensor& a, const Tensor& b);
Tensor logical_or(const Tensor& a, const Tensor& b);
Tensor logical_not(const Tensor& x);
Tensor isfinite(const Tensor& x);
Tensor where(const Tensor& condition, const Tensor& a, const Tensor& b);  // a where condition, else b
Tensor where(const Tensor& condition, const Tensor& a, const Scalar& b);
Tensor where(const Tensor& condition, const Scalar& a, const Tensor& b);
// value where mask (bool) is true, x elsewhere, in x's dtype; x and mask broadcast together (Tensor::masked_fill_ keeps
// x's shape). Gradient: x's where the mask is false.
Tensor masked_fill(const Tensor& x, const Tensor& mask, const Scalar& value);

Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator+(const Tensor& a, const Scalar& b);
Tensor operator-(const Tensor& a, const Scalar& b);
Tensor operator*(const Tensor& a, const Scalar& b);
Tensor operator/(const Tensor& a, const Scalar& b);
Tensor operator+(const Scalar& a, const Tensor& b);
Tensor operator-(const Scalar& a, const Tensor& b);
Tensor operator*(const Scalar& a, const Tensor& b);
Tensor operator/(const Scalar& a, const Tensor& b);
Tensor operator-(const Tensor& x);
Tensor& operator+=(Tensor& a, const Tensor& b);
Tensor& operator-=(Tensor& a, const Tensor& b);
Tensor& operator*=(Tensor& a, const Tensor& b);
Tensor& operator/=(Tensor& a, const Tensor& b);
Tensor& operator+=(Tensor& a, const Scalar& b);
Tensor& operator-=(Tensor& a, const Scalar& b);
Tensor& operator*=(Tensor& a, const Scalar& b);
Tensor& operator/=(Tensor& a, const Scalar& b);

// ---- kernels, one table per signature (core/dispatch.h)
// `in` has out's shape (strided views allowed). Same dtype as out, except predicates, whose out is bool.
using UnaryKernel = void (*)(UnaryOp op, const Tensor& out, const Tensor& in);
// a and b share one dtype and are viewed to out's shape (broadcast dims have stride 0). Either of them may
// instead be a 0-d CPU tensor: a scalar operand, which a device kernel passes by value. In float16 and bfloat16
// arithmetic it is a float32 one (on the CPU too), read in float32 as the op computes (ops/elementwise.cpp,
// scalar_dtype): the one case where the dtypes differ.
using BinaryKernel = void (*)(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b);
// For a kernel given operands of different dtypes: whether the float32 number is a (else b); anything else is an error.
bool float32_number_is_left(BinaryOp op, const Tensor& a, const Tensor& b);
// The same kernel's case in one place for both devices: run.template operator()<T>(x, number, left), x the float16
// or bfloat16 operand (T its storage type), number the float32 one's value, left whether it is a.
template <typename Run> void dispatch_float32_number(BinaryOp op, const Tensor& a, const Tensor& b, Run&& run) {
  const bool left = float32_number_is_left(op, a, b);
  const Tensor& x = left ? b : a;
  const float number = (left ? a : b).template item<float>();
  if (x.dtype() == kFloat16) return run.template operator()<Half>(x, number, left);
  return run.template operator()<BFloat16>(x, number, left);
}
// condition is bool; a and b have out's dtype; each viewed to out's shape, or, on a device, a 0-d CPU scalar passed by
// value.
using WhereKernel = void (*)(const Tensor& out, const Tensor& condition, const Tensor& a, const Tensor& b);
using FillKernel = void (*)(const Tensor& out, const Scalar& value);

extern KernelTable<UnaryKernel> unary_kernel;
extern KernelTable<BinaryKernel> binary_kernel;
extern KernelTable<WhereKernel> where_kernel;
extern KernelTable<FillKernel> fill_kernel;

}  // namespace halfgrad

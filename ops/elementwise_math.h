#pragma once
// The arithmetic of every elementwise op, once, for both backends: the CPU loops (ops/elementwise.cpp)
// and the CUDA kernels (ops/elementwise.cu) instantiate these same functions. Values arrive in the op's
// compute type (float for float16/bfloat16 storage, see opmath_t).
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/dtype.h"
#include "core/half.h"

namespace halfgrad {

// Every elementwise op once, with the rules both backends and the op layer follow; the enums, the names, the rule
// functions below and dispatch_*_op are made from these lists. A row: X(Op, "name", kind, takes bool), kind being
//   Plain      the result has the (promoted) input dtype
//   Math       a math function: an integer input is computed in the default float dtype (exp(int) is float32)
//   Predicate  the result is bool whatever the input dtype
//   Floating   a floating input only: an integer or bool one is refused (PyTorch's gelu and silu refuse them)
// and "takes bool" whether a bool input is allowed, as PyTorch allows it (the others ask for a conversion first; a
// Math op computes bool, as any integer, in the default float dtype: exp(bool) and bool / bool are float32). Adding
// an op: its row here, its case in unary_math / binary_math below, its derivative in ops/elementwise.cpp
// (unary_backward or binary), its function and Tensor method, and its row in core/autocast.h.
#define HG_UNARY_OPS(X)                                                                                    \
  X(Neg, "neg", Plain, false) X(Abs, "abs", Plain, true) X(Exp, "exp", Math, true) X(Log, "log", Math, true) \
  X(Sqrt, "sqrt", Math, true) X(Rsqrt, "rsqrt", Math, true) X(Tanh, "tanh", Math, true)                     \
  X(Sigmoid, "sigmoid", Math, true) X(Relu, "relu", Plain, false) X(Sign, "sign", Plain, true)             \
  X(LogicalNot, "logical_not", Predicate, true) X(IsFinite, "isfinite", Predicate, true)                 \
  X(Erf, "erf", Math, true) X(Gelu, "gelu", Floating, false) X(GeluTanh, "gelu", Floating, false)      \
  X(Silu, "silu", Floating, false)
// The *Backward rows are the activations' derivatives, g * f'(x) for a (g, x) pair in one kernel, which only
// unary_backward (ops/elementwise.cpp) calls: they are not differentiable themselves.
#define HG_BINARY_OPS(X)                                                                                        \
  X(Add, "add", Plain, true) X(Sub, "sub", Plain, false) X(Mul, "mul", Plain, true) X(Div, "div", Math, true) \
  X(Pow, "pow", Plain, false) X(Maximum, "maximum", Plain, true) X(Minimum, "minimum", Plain, true)            \
  X(Eq, "eq", Predicate, true) X(Ne, "ne", Predicate, true) X(Lt, "lt", Predicate, true)                       \
  X(Le, "le", Predicate, true) X(Gt, "gt", Predicate, true) X(Ge, "ge", Predicate, true)                       \
  X(LogicalAnd, "logical_and", Predicate, true) X(LogicalOr, "logical_or", Predicate, true)                   \
  X(GeluBackward, "gelu_backward", Floating, false) X(GeluTanhBackward, "gelu_tanh_backward", Floating, false)  \
  X(SiluBackward, "silu_backward", Floating, false)

enum class ElementwiseKind : uint8_t { Plain, Math, Predicate, Floating };

#define HG_ELEMENTWISE_ENUM(op, name, kind, takes_bool) op,
enum class UnaryOp : uint8_t { HG_UNARY_OPS(HG_ELEMENTWISE_ENUM) };
enum class BinaryOp : uint8_t { HG_BINARY_OPS(HG_ELEMENTWISE_ENUM) };
#undef HG_ELEMENTWISE_ENUM

#define HG_ELEMENTWISE_NAME(op, name, kind, takes_bool) name,
inline const char* op_name(UnaryOp op) {
  constexpr const char* names[] = {HG_UNARY_OPS(HG_ELEMENTWISE_NAME)};
  return names[int(op)];
}
inline const char* op_name(BinaryOp op) {
  constexpr const char* names[] = {HG_BINARY_OPS(HG_ELEMENTWISE_NAME)};
  return names[int(op)];
}
#undef HG_ELEMENTWISE_NAME

// An op's rules, from its row.
struct ElementwiseRules {
  ElementwiseKind kind;
  bool takes_bool;
};
#define HG_ELEMENTWISE_RULES(op, name, kind, takes_bool) ElementwiseRules{ElementwiseKind::kind, takes_bool},
HG_HOST_DEVICE constexpr ElementwiseRules rules_of(UnaryOp op) {
  constexpr ElementwiseRules rules[] = {HG_UNARY_OPS(HG_ELEMENTWISE_RULES)};
  return rules[int(op)];
}
HG_HOST_DEVICE constexpr ElementwiseRules rules_of(BinaryOp op) {
  constexpr ElementwiseRules rules[] = {HG_BINARY_OPS(HG_ELEMENTWISE_RULES)};
  return rules[int(op)];
}
#undef HG_ELEMENTWISE_RULES

// Ops whose result is bool whatever the input dtype.
template <typename Op> HG_HOST_DEVICE constexpr bool is_predicate(Op op) {
  return rules_of(op).kind == ElementwiseKind::Predicate;
}
// Ops computed in a floating dtype: an integer input is computed in the default float dtype.
template <typename Op> HG_HOST_DEVICE constexpr bool needs_floating(Op op) {
  return rules_of(op).kind == ElementwiseKind::Math;
}
// Ops that refuse integer and bool inputs.
template <typename Op> HG_HOST_DEVICE constexpr bool floating_only(Op op) {
  return rules_of(op).kind == ElementwiseKind::Floating;
}
// Ops that take bool inputs (the others ask for a conversion first).
template <typename Op> HG_HOST_DEVICE constexpr bool takes_bool(Op op) { return rules_of(op).takes_bool; }

// Signed integers add, subtract, multiply and negate in their unsigned type: the result wraps as PyTorch's does (two's
// complement), without C++'s undefined behaviour on signed overflow (int64's largest + 1; the sanitizer builds abort
// on it). Every other type computes as itself.
template <typename T, bool kSignedInteger = std::is_integral_v<T> && std::is_signed_v<T>> struct Wrapping {
  using type = T;
};
template <typename T> struct Wrapping<T, true> {
  using type = std::make_unsigned_t<T>;
};
template <typename T> using wrapping_t = typename Wrapping<T>::type;

// GELU's constants, PyTorch's: the exact form is x * Phi(x), Phi the standard normal's distribution function,
//   gelu(x) = x / 2 * (1 + erf(x / sqrt(2))),   gelu'(x) = Phi(x) + x * exp(-x^2 / 2) / sqrt(2 pi);
// the tanh approximation (approximate = "tanh"), with u = sqrt(2 / pi) * (x + 0.044715 x^3),
//   gelu(x) = x / 2 * (1 + tanh(u)),   gelu'(x) = (1 + tanh(u)) / 2 + x / 2 * (1 - tanh(u)^2) * du/dx.
namespace gelu_constants {
inline constexpr double kSqrtHalf = 0.70710678118654752440;           // 1 / sqrt(2)
inline constexpr double kInvSqrt2Pi = 0.39894228040143267794;         // 1 / sqrt(2 pi)
inline constexpr double kSqrt2OverPi = 0.79788456080286535588;        // sqrt(2 / pi)
inline constexpr double kCubic = 0.044715;
}  // namespace gelu_constants

template <UnaryOp OP, typename T> HG_HOST_DEVICE inline auto unary_math(T x) {
  using std::abs, std::exp, std::log, std::sqrt, std::tanh, std::isfinite, std::erf;
  using namespace gelu_constants;
  using W = wrapping_t<T>;
  // (-x, not 0 - x, for floating x: -0.0 is the negation of +0.0)
  if constexpr (OP == UnaryOp::Neg) { if constexpr (std::is_integral_v<T>) return T(W(0) - W(x)); else return T(-x); }
  // abs: 0 - x at zero too, so that -0 gives +0 (PyTorch's); nan passes the comparison by.
  else if constexpr (OP == UnaryOp::Abs) { if constexpr (std::is_same_v<T, bool>) return x; else return T(x <= T(0) ? T(W(0) - W(x)) : x); }
  else if constexpr (OP == UnaryOp::Exp) return exp(x);
  else if constexpr (OP == UnaryOp::Log) return log(x);
  else if constexpr (OP == UnaryOp::Sqrt) return sqrt(x);
  else if constexpr (OP == UnaryOp::Rsqrt) return T(1) / sqrt(x);
  else if constexpr (OP == UnaryOp::Tanh) return tanh(x);
  else if constexpr (OP == UnaryOp::Sigmoid) return T(1) / (T(1) + exp(-x));
  // NOTE: written as a select, not max(x, 0), so that NaN propagates like PyTorch's relu.
  else if constexpr (OP == UnaryOp::Relu) return x > T(0) ? x : (x == x ? T(0) : x);
  else if constexpr (OP == UnaryOp::Sign) return T((T(0) < x) - (x < T(0)));
  else if constexpr (OP == UnaryOp::LogicalNot) return !bool(x);
  else if constexpr (OP == UnaryOp::IsFinite) {
    if constexpr (std::is_floating_point_v<T>) return bool(isfinite(x)); else return true;
  }
  else if constexpr (OP == UnaryOp::Erf) return erf(x);
  else if constexpr (OP == UnaryOp::Gelu) return x * T(0.5) * (T(1) + erf(x * T(kSqrtHalf)));
  else if constexpr (OP == UnaryOp::GeluTanh)
    return T(0.5) * x * (T(1) + tanh(T(kSqrt2OverPi) * (x + T(kCubic) * (x * x * x))));
  else if constexpr (OP == UnaryOp::Silu) return x / (T(1) + exp(-x));
}

// relu's backward from its output: the gradient g passes where y > 0 and is 0 elsewhere (at x == 0 and for NaN, as
// PyTorch's). unary_backward (ops/elementwise.cpp) applies it as where(y > 0, g, 0); batch_norm_relu's kernels inline.
template <typename T> HG_HOST_DEVICE inline T relu_backward_math(T g, T y) { return y > T(0) ? g : T(0); }

template <BinaryOp OP, typename T> HG_HOST_DEVICE inline auto binary_math(T a, T b) {
  using std::pow, std::erf, std::exp, std::tanh;
  using namespace gelu_constants;
  using W = wrapping_t<T>;
  if constexpr (OP == BinaryOp::Add) return T(W(a) + W(b));
  else if constexpr (OP == BinaryOp::Sub) return T(W(a) - W(b));
  else if constexpr (OP == BinaryOp::Mul) return T(W(a) * W(b));
  else if constexpr (OP == BinaryOp::Div) return T(a / b);
  else if constexpr (OP == BinaryOp::Pow) {
    if constexpr (std::is_integral_v<T>) {
      T r = 1;  // integer power by squaring; negative exponents give 0 except for bases +-1 (as PyTorch)
      if (b < T(0)) return T(a == T(1) ? 1 : a == T(-1) ? ((b & 1) ? -1 : 1) : 0);
      for (T e = b, x = a; e != 0; e >>= 1, x = T(W(x) * W(x)))
        if (e & 1) r = T(W(r) * W(x));
      return r;
    } else {
      return pow(a, b);
    }
  }
  // NaN wins in maximum/minimum, as in PyTorch.
  else if constexpr (OP == BinaryOp::Maximum) return (a != a || a > b) ? a : b;
  else if constexpr (OP == BinaryOp::Minimum) return (a != a || a < b) ? a : b;
  else if constexpr (OP == BinaryOp::Eq) return a == b;
  else if constexpr (OP == BinaryOp::Ne) return a != b;
  else if constexpr (OP == BinaryOp::Lt) return a < b;
  else if constexpr (OP == BinaryOp::Le) return a <= b;
  else if constexpr (OP == BinaryOp::Gt) return a > b;
  else if constexpr (OP == BinaryOp::Ge) return a >= b;
  else if constexpr (OP == BinaryOp::LogicalAnd) return bool(a) && bool(b);
  else if constexpr (OP == BinaryOp::LogicalOr) return bool(a) || bool(b);
  // The activations' derivatives: a is the output's gradient g, b the input x (formulas above unary_math).
  else if constexpr (OP == BinaryOp::GeluBackward) {
    const T cdf = T(0.5) * (T(1) + erf(b * T(kSqrtHalf)));
    return a * (cdf + b * (exp(T(-0.5) * b * b) * T(kInvSqrt2Pi)));
  } else if constexpr (OP == BinaryOp::GeluTanhBackward) {
    const T t = tanh(T(kSqrt2OverPi) * (b + T(kCubic) * (b * b * b)));
    const T du = T(kSqrt2OverPi) * (T(1) + T(3) * T(kCubic) * (b * b));
    return a * (T(0.5) * (T(1) + t) + T(0.5) * b * (T(1) - t * t) * du);
  } else if constexpr (OP == BinaryOp::SiluBackward) {
    const T s = T(1) / (T(1) + exp(-b));  // silu'(x) = s (1 + x (1 - s)), s = sigmoid(x)
    return a * s * (T(1) + b * (T(1) - s));
  }
}

// The conversion rule of every dtype-converting copy (CPU and CUDA): through the compute types, so halves
// convert via float; bool is "nonzero"; a floating value becomes uint8 through int64, as PyTorch's (-1.5 is 255 and 300
// is 44 on both devices, where a direct conversion saturates on a GPU).
template <typename To, typename From> HG_HOST_DEVICE inline To convert_value(From x) {
  if constexpr (std::is_same_v<To, From>) {
    return x;
  } else if constexpr (std::is_same_v<To, bool>) {
    return opmath_t<From>(x) != opmath_t<From>(0);
  } else if constexpr (std::is_same_v<To, uint8_t> && !std::is_integral_v<opmath_t<From>>) {
    return To(int64_t(opmath_t<From>(x)));
  } else {
    return To(opmath_t<To>(opmath_t<From>(x)));
  }
}

// The value fill_ writes into a tensor of T (CPU and CUDA): the number in T's arithmetic; into bool its truth, as
// PyTorch's (0.5 and nan are true, where a conversion through an integer made 0.5 false).
template <typename T> inline T fill_value(const Scalar& value) {
  if constexpr (std::is_same_v<T, bool>) {
    return value.to_double() != 0;
  } else if constexpr (std::is_integral_v<T>) {
    return T(value.to_int());
  } else {
    return T(opmath_t<T>(value.to_double()));
  }
}

// Turns a run-time op into a compile-time one: fn.template operator()<OP>().
template <typename Fn> decltype(auto) dispatch_unary_op(UnaryOp op, Fn&& fn) {
  switch (op) {
#define HG_CASE(O, name, kind, takes_bool) case UnaryOp::O: return fn.template operator()<UnaryOp::O>();
    HG_UNARY_OPS(HG_CASE)
#undef HG_CASE
  }
  return fn.template operator()<UnaryOp::Neg>();
}

template <typename Fn> decltype(auto) dispatch_binary_op(BinaryOp op, Fn&& fn) {
  switch (op) {
#define HG_CASE(O, name, kind, takes_bool) case BinaryOp::O: return fn.template operator()<BinaryOp::O>();
    HG_BINARY_OPS(HG_CASE)
#undef HG_CASE
  }
  return fn.template operator()<BinaryOp::Add>();
}

}  // namespace halfgrad

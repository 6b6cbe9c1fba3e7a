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

enum class UnaryOp : uint8_t { Neg, Abs, Exp, Log, Sqrt, Rsqrt, Tanh, Sigmoid, Relu, Sign, LogicalNot, IsFinite };
enum class BinaryOp : uint8_t { Add, Sub, Mul, Div, Pow, Maximum, Minimum, Eq, Ne, Lt, Le, Gt, Ge, LogicalAnd, LogicalOr };

// Ops whose result is bool whatever the input dtype.
HG_HOST_DEVICE constexpr bool is_predicate(UnaryOp op) { return op == UnaryOp::LogicalNot || op == UnaryOp::IsFinite; }
HG_HOST_DEVICE constexpr bool is_predicate(BinaryOp op) { return op >= BinaryOp::Eq; }

template <UnaryOp OP, typename T> HG_HOST_DEVICE inline auto unary_math(T x) {
  using std::abs, std::exp, std::log, std::sqrt, std::tanh, std::isfinite;
  if constexpr (OP == UnaryOp::Neg) return T(-x);
  else if constexpr (OP == UnaryOp::Abs) { if constexpr (std::is_same_v<T, bool>) return x; else return T(x < T(0) ? -x : x); }
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
}

template <BinaryOp OP, typename T> HG_HOST_DEVICE inline auto binary_math(T a, T b) {
  using std::pow;
  if constexpr (OP == BinaryOp::Add) return T(a + b);
  else if constexpr (OP == BinaryOp::Sub) return T(a - b);
  else if constexpr (OP == BinaryOp::Mul) return T(a * b);
  else if constexpr (OP == BinaryOp::Div) return T(a / b);
  else if constexpr (OP == BinaryOp::Pow) {
    if constexpr (std::is_integral_v<T>) {
      T r = 1;  // integer power by squaring; negative exponents give 0 except for bases +-1 (as PyTorch)
      if (b < T(0)) return T(a == T(1) ? 1 : a == T(-1) ? ((b & 1) ? -1 : 1) : 0);
      for (T e = b, x = a; e != 0; e >>= 1, x = T(x * x))
        if (e & 1) r = T(r * x);
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
}

// The conversion rule of every dtype-converting copy (CPU and CUDA): through the compute types, so halves
// convert via float; bool is "nonzero".
template <typename To, typename From> HG_HOST_DEVICE inline To convert_value(From x) {
  if constexpr (std::is_same_v<To, From>) {
    return x;
  } else if constexpr (std::is_same_v<To, bool>) {
    return opmath_t<From>(x) != opmath_t<From>(0);
  } else {
    return To(opmath_t<To>(opmath_t<From>(x)));
  }
}

// Turns a run-time op into a compile-time one: fn.template operator()<OP>().
template <typename Fn> decltype(auto) dispatch_unary_op(UnaryOp op, Fn&& fn) {
  switch (op) {
#define HG_CASE(O) case UnaryOp::O: return fn.template operator()<UnaryOp::O>();
    HG_CASE(Neg) HG_CASE(Abs) HG_CASE(Exp) HG_CASE(Log) HG_CASE(Sqrt) HG_CASE(Rsqrt) HG_CASE(Tanh)
    HG_CASE(Sigmoid) HG_CASE(Relu) HG_CASE(Sign) HG_CASE(LogicalNot) HG_CASE(IsFinite)
#undef HG_CASE
  }
  return fn.template operator()<UnaryOp::Neg>();
}

template <typename Fn> decltype(auto) dispatch_binary_op(BinaryOp op, Fn&& fn) {
  switch (op) {
#define HG_CASE(O) case BinaryOp::O: return fn.template operator()<BinaryOp::O>();
    HG_CASE(Add) HG_CASE(Sub) HG_CASE(Mul) HG_CASE(Div) HG_CASE(Pow) HG_CASE(Maximum) HG_CASE(Minimum)
    HG_CASE(Eq) HG_CASE(Ne) HG_CASE(Lt) HG_CASE(Le) HG_CASE(Gt) HG_CASE(Ge) HG_CASE(LogicalAnd) HG_CASE(LogicalOr)
#undef HG_CASE
  }
  return fn.template operator()<BinaryOp::Add>();
}

}  // namespace halfgrad

#pragma once
// Element types, their C++ storage types, type promotion and the dtype switch used by every kernel.
#include <concepts>
#include <cstdint>
#include <string>
#include <type_traits>

#include "core/half.h"

namespace halfgrad {

enum class DType : uint8_t { Bool, UInt8, Int32, Int64, Float16, BFloat16, Float32, Float64 };

inline constexpr DType kBool = DType::Bool;
inline constexpr DType kUInt8 = DType::UInt8;
inline constexpr DType kInt32 = DType::Int32;
inline constexpr DType kInt64 = DType::Int64;
inline constexpr DType kFloat16 = DType::Float16;
inline constexpr DType kBFloat16 = DType::BFloat16;
inline constexpr DType kFloat32 = DType::Float32;
inline constexpr DType kFloat64 = DType::Float64;

const char* dtype_name(DType t);  // "float32", ...
size_t element_size(DType t);
inline bool is_floating(DType t) { return t >= DType::Float16; }
inline bool is_half(DType t) { return t == DType::Float16 || t == DType::BFloat16; }
// The dtype sums and statistics of a floating dtype are kept in: float64 for float64, float32 for the rest (the
// accumulators of batch_norm, layer_norm, the losses, the gradient scatters, the fused optimizers and the RNN GEMMs).
inline DType accumulation_dtype(DType t) { return t == DType::Float64 ? DType::Float64 : DType::Float32; }
// The dtype of sums of t's values (sum, cumsum) where none is asked for: t's own for floating t, int64 for integers and
// bool (PyTorch's: sums of int32 or uint8 overflow soon).
inline DType sum_dtype(DType t) { return is_floating(t) ? t : DType::Int64; }
inline bool is_integral(DType t, bool include_bool = false) {
  return (t >= DType::UInt8 && t <= DType::Int64) || (include_bool && t == DType::Bool);
}

// PyTorch's rules: bool < integers < floating; inside a category the wider type wins; float16 with
// bfloat16 gives float32 (neither holds the other); uint8 with a signed integer gives the signed one.
DType promote_types(DType a, DType b);

// The dtype of an op on two tensors (PyTorch's result_type): a 0-d tensor beside one with dims (x * tensor(2.0)) is
// read as a number is, and decides the dtype only where it is of a higher category (bool < integral < floating):
// float16 * float64 0-d is float16, int32 + int64 0-d is int32, int32 + float64 0-d is float64. Otherwise as
// promote_types.
DType promote_types(DType a, bool a_zero_dim, DType b, bool b_zero_dim);

// The type that kernels compute in: float for both 16-bit floats (so halves accumulate in float32).
template <typename T> struct OpMath { using type = T; };
template <> struct OpMath<Half> { using type = float; };
template <> struct OpMath<BFloat16> { using type = float; };
template <typename T> using opmath_t = typename OpMath<T>::type;

// C++ storage type of each dtype, and back.
template <DType D> struct CppType;
template <> struct CppType<DType::Bool> { using type = bool; };
template <> struct CppType<DType::UInt8> { using type = uint8_t; };
template <> struct CppType<DType::Int32> { using type = int32_t; };
template <> struct CppType<DType::Int64> { using type = int64_t; };
template <> struct CppType<DType::Float16> { using type = Half; };
template <> struct CppType<DType::BFloat16> { using type = BFloat16; };
template <> struct CppType<DType::Float32> { using type = float; };
template <> struct CppType<DType::Float64> { using type = double; };

template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<bool>() { return DType::Bool; }
template <> constexpr DType dtype_of<uint8_t>() { return DType::UInt8; }
template <> constexpr DType dtype_of<int32_t>() { return DType::Int32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::Int64; }
template <> constexpr DType dtype_of<Half>() { return DType::Float16; }
template <> constexpr DType dtype_of<BFloat16>() { return DType::BFloat16; }
template <> constexpr DType dtype_of<float>() { return DType::Float32; }
template <> constexpr DType dtype_of<double>() { return DType::Float64; }

[[noreturn]] void throw_unsupported_dtype(const char* op, DType t);

// Calls fn.template operator()<T>() with T the storage type of `t`:
//   dispatch_all(x.dtype(), "exp", [&]<typename T>() { ... });
// The dispatch_* variants name the dtypes an op accepts; any other dtype is a clear error.
#define HG_DTYPE_CASE(D) \
  case D: return fn.template operator()<typename CppType<D>::type>();

template <typename Fn> decltype(auto) dispatch_all(DType t, const char* op, Fn&& fn) {
  switch (t) {
    HG_DTYPE_CASE(DType::Bool)
    HG_DTYPE_CASE(DType::UInt8)
    HG_DTYPE_CASE(DType::Int32)
    HG_DTYPE_CASE(DType::Int64)
    HG_DTYPE_CASE(DType::Float16)
    HG_DTYPE_CASE(DType::BFloat16)
    HG_DTYPE_CASE(DType::Float32)
    HG_DTYPE_CASE(DType::Float64)
  }
  throw_unsupported_dtype(op, t);
}

template <typename Fn> decltype(auto) dispatch_numeric(DType t, const char* op, Fn&& fn) {
  switch (t) {
    HG_DTYPE_CASE(DType::UInt8)
    HG_DTYPE_CASE(DType::Int32)
    HG_DTYPE_CASE(DType::Int64)
    HG_DTYPE_CASE(DType::Float16)
    HG_DTYPE_CASE(DType::BFloat16)
    HG_DTYPE_CASE(DType::Float32)
    HG_DTYPE_CASE(DType::Float64)
    default: break;
  }
  throw_unsupported_dtype(op, t);
}

template <typename Fn> decltype(auto) dispatch_floating(DType t, const char* op, Fn&& fn) {
  switch (t) {
    HG_DTYPE_CASE(DType::Float16)
    HG_DTYPE_CASE(DType::BFloat16)
    HG_DTYPE_CASE(DType::Float32)
    HG_DTYPE_CASE(DType::Float64)
    default: break;
  }
  throw_unsupported_dtype(op, t);
}
#undef HG_DTYPE_CASE

[[noreturn]] void throw_scalar_out_of_range(uint64_t v);  // a number Scalar's int64 cannot hold

// A number given where a tensor could be (x + 2, clamp(x, 0, 6)). Like PyTorch's "wrapped numbers", a
// scalar only decides the result dtype when it is of a higher category than the tensor: float32 + 2.5 is
// float32, int64 + 2.5 is float32 (the default float dtype), float16 * 2 is float16.
class Scalar {
 public:
  Scalar(double v) : value_(v), kind_(Kind::Floating) {}
  Scalar(float v) : value_(v), kind_(Kind::Floating) {}
  Scalar(int v) : value_(v), ivalue_(v), kind_(Kind::Integral) {}  // also what an unscoped enum converts through
  // Any other integer type (int64_t, size_t, long long, unsigned); an unsigned value past int64's range is refused.
  template <std::integral T>
    requires(!std::is_same_v<T, bool>)
  Scalar(T v) : value_(double(v)), ivalue_(int64_t(v)), kind_(Kind::Integral) {
    if constexpr (std::is_unsigned_v<T> && sizeof(T) >= sizeof(int64_t)) {
      if (v > T(INT64_MAX)) throw_scalar_out_of_range(uint64_t(v));
    }
  }
  Scalar(bool v) : value_(v), ivalue_(v), kind_(Kind::Boolean) {}

  double to_double() const { return value_; }
  int64_t to_int() const { return kind_ == Kind::Floating ? int64_t(value_) : ivalue_; }
  bool is_floating() const { return kind_ == Kind::Floating; }
  bool is_bool() const { return kind_ == Kind::Boolean; }
  DType natural_dtype() const;  // float64 / int64 / bool
  std::string str() const;

 private:
  enum class Kind { Boolean, Integral, Floating };
  double value_ = 0;
  int64_t ivalue_ = 0;
  Kind kind_;
};

// The dtype of `tensor op scalar`.
DType promote_with_scalar(DType tensor, const Scalar& s);

// Whether `value` can be written into a tensor of `dtype` (fill_, full), by PyTorch's overflow rule: within the
// dtype's range, where infinities and NaN fit a floating dtype, a negative integer fits uint8 down to -255 (it wraps,
// as two's complement), and anything fits bool (nonzero is true). One stricter edge: a float of 2^63 does not fit
// int64 (PyTorch's comparison lets it through to an undefined conversion).
bool fits_dtype(const Scalar& value, DType dtype);

// The float dtype used when an integer input meets a floating-only op (exp, mean, division, ...).
inline constexpr DType kDefaultFloat = DType::Float32;

}  // namespace halfgrad

#include "core/dtype.h"

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "core/error.h"

namespace halfgrad {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::Bool: return "bool";
    case DType::UInt8: return "uint8";
    case DType::Int32: return "int32";
    case DType::Int64: return "int64";
    case DType::Float16: return "float16";
    case DType::BFloat16: return "bfloat16";
    case DType::Float32: return "float32";
    case DType::Float64: return "float64";
  }
  return "?";
}

size_t element_size(DType t) {
  switch (t) {
    case DType::Bool:
    case DType::UInt8: return 1;
    case DType::Float16:
    case DType::BFloat16: return 2;
    case DType::Int32:
    case DType::Float32: return 4;
    case DType::Int64:
    case DType::Float64: return 8;
  }
  return 0;
}

DType promote_types(DType a, DType b) {
  if (a == b) return a;
  if ((a == DType::Float16 && b == DType::BFloat16) || (a == DType::BFloat16 && b == DType::Float16))
    return DType::Float32;
  // The enum is ordered so that, outside the float16/bfloat16 pair, the larger value is the promoted type.
  return a > b ? a : b;
}

DType promote_types(DType a, bool a_zero_dim, DType b, bool b_zero_dim) {
  if (a_zero_dim == b_zero_dim) return promote_types(a, b);
  const DType dimensioned = a_zero_dim ? b : a, zero_dim = a_zero_dim ? a : b;
  // PyTorch's combine_categories: a floating tensor keeps its dtype; a bool tensor, or a floating 0-d beside an
  // integral tensor, promotes; an integral 0-d beside an integral tensor does not.
  if (is_floating(dimensioned)) return dimensioned;
  if (dimensioned == DType::Bool || is_floating(zero_dim)) return promote_types(dimensioned, zero_dim);
  return dimensioned;
}

void throw_unsupported_dtype(const char* op, DType t) {
  HG_FAIL("{}: dtype {} is not supported by this op", op, dtype_name(t));
}

void throw_scalar_out_of_range(uint64_t v) {
  HG_FAIL("{} is past the largest integer a Scalar holds (int64: {})", v, INT64_MAX);
}

DType Scalar::natural_dtype() const {
  switch (kind_) {
    case Kind::Boolean: return DType::Bool;
    case Kind::Integral: return DType::Int64;
    case Kind::Floating: return DType::Float64;
  }
  return DType::Float64;
}

std::string Scalar::str() const {
  switch (kind_) {
    case Kind::Boolean: return ivalue_ ? "true" : "false";
    case Kind::Integral: return std::to_string(ivalue_);
    case Kind::Floating: return fmt::format("{}", value_);
  }
  return "?";
}

DType promote_with_scalar(DType tensor, const Scalar& s) {
  auto category = [](DType t) { return is_floating(t) ? 2 : is_integral(t) ? 1 : 0; };
  int scalar_category = s.is_floating() ? 2 : s.is_bool() ? 0 : 1;
  if (scalar_category <= category(tensor)) return tensor;
  return scalar_category == 2 ? kDefaultFloat : DType::Int64;
}

bool fits_dtype(const Scalar& value, DType dtype) {
  if (dtype == DType::Bool || value.is_bool()) return true;
  if (is_floating(dtype)) {
    const double v = value.to_double(), largest = dtype == DType::Float16    ? 65504.0
                                                  : dtype == DType::BFloat16 ? 0x1.fep127
                                                  : dtype == DType::Float32  ? double(FLT_MAX)
                                                                             : DBL_MAX;
    return std::isinf(v) || std::isnan(v) || std::fabs(v) <= largest;
  }
  if (value.is_floating()) {  // NaN fails every comparison
    const double v = value.to_double();
    switch (dtype) {
      case DType::UInt8: return v >= 0 && v <= 255;
      case DType::Int32: return v >= INT32_MIN && v <= INT32_MAX;
      default: return v >= -0x1p63 && v < 0x1p63;
    }
  }
  const int64_t v = value.to_int();
  switch (dtype) {
    case DType::UInt8: return v < 256 && v > -256;
    case DType::Int32: return v >= INT32_MIN && v <= INT32_MAX;
    default: return true;
  }
}

}  // namespace halfgrad

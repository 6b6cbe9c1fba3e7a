#pragma once
// Small helpers the op tests share (gradcheck has its own header, tests/gradcheck.h).
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "halfgrad.h"

namespace halfgrad::testing {

inline const std::vector<DType> kFloatTypes = {kFloat64, kFloat32, kFloat16, kBFloat16};

// randn drawn in float64, then rounded to `dtype`: the same values for every dtype of a comparison.
inline Tensor random(const Shape& shape, DType dtype) { return randn(shape, {.dtype = kFloat64}).to(dtype); }

// The message of the halfgrad::Error that f throws, or "(no error)".
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Elementwise |got - want| <= tol (1 + |want|); reports the first five misses.
inline void check_close(const std::vector<double>& got, const std::vector<double>& want, double tol) {
  REQUIRE(got.size() == want.size());
  int failures = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(std::abs(got[i] - want[i]) <= tol * (1 + std::abs(want[i]))) && failures++ < 5)
      FAIL_CHECK("element " << i << ": got " << got[i] << ", want " << want[i]);
  }
  CHECK(failures == 0);
}

}  // namespace halfgrad::testing

#pragma once
// gradcheck: analytic gradients against central finite differences, in float64.
//
// For f(inputs) -> output, the check compares d<output, R>/d input (R a fixed random tensor, so every
// output element is weighted differently and all of them are checked) computed by backward() with
// (L(x + eps e_i) - L(x - eps e_i)) / (2 eps) for every element i of every input that requires grad.
// Central differences have O(eps^2) error; with eps = 1e-6 in float64 that is far below the tolerances.
#include <doctest/doctest.h>

#include <functional>

#include "halfgrad.h"

namespace halfgrad::testing {

inline double projected(const Tensor& out, const Tensor& r) {
  NoGradGuard no_grad;
  return (out.to(kFloat64) * r).sum().item<double>();
}

// Element i (row-major) of a strided float64 CPU tensor.
inline double& element(const Tensor& t, int64_t i) {
  int64_t offset = 0;
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    offset += (i % t.size(d)) * t.stride(d);
    i /= t.size(d);
  }
  return static_cast<double*>(t.storage()->data())[t.offset() + offset];
}

inline void gradcheck(std::function<Tensor(const TensorList&)> f, TensorList inputs, double eps = 1e-6,
                      double atol = 1e-5, double rtol = 1e-3) {
  for (Tensor& x : inputs) {
    if (!x.defined() || !x.requires_grad()) continue;
    REQUIRE_MESSAGE(x.dtype() == kFloat64, "gradcheck wants float64 inputs, got " << x.meta());
    REQUIRE_MESSAGE(x.is_cpu(), "gradcheck runs on the CPU, got " << x.meta());
    x.set_grad(Tensor());
  }
  Tensor out = f(inputs);
  Tensor r = randn(out.shape(), {.dtype = kFloat64});
  (out.to(kFloat64) * r).sum().backward();

  for (size_t k = 0; k < inputs.size(); ++k) {
    const Tensor& x = inputs[k];
    if (!x.defined() || !x.requires_grad()) continue;
    Tensor analytic = x.grad();
    REQUIRE_MESSAGE(analytic.defined(), "input " << k << " (" << x.meta() << ") got no gradient");
    REQUIRE(analytic.shape() == x.shape());
    std::vector<double> a = to_vector<double>(analytic);
    int failures = 0;
    for (int64_t i = 0; i < x.numel(); ++i) {
      double& v = element(x, i);
      double saved = v;
      v = saved + eps;
      double plus = projected(f(inputs), r);
      v = saved - eps;
      double minus = projected(f(inputs), r);
      v = saved;
      double numeric = (plus - minus) / (2 * eps);
      bool close = std::abs(a[size_t(i)] - numeric) <= atol + rtol * std::abs(numeric);
      if (!close && failures++ < 3) {
        FAIL_CHECK("gradient of input " << k << " (" << x.meta() << ") element " << i << ": analytic "
                                        << a[size_t(i)] << " vs numeric " << numeric);
      }
    }
    CHECK_MESSAGE(failures == 0, failures << " gradient elements of input " << k << " differ");
  }
}

// A float64 leaf for gradcheck: randn values (never zeros) that require grad.
inline Tensor leaf(const Shape& shape, double scale = 1.0, double shift = 0.0) {
  Tensor t;
  {
    NoGradGuard no_grad;
    t = randn(shape, {.dtype = kFloat64}) * scale + shift;
  }
  return t.requires_grad_();
}

}  // namespace halfgrad::testing

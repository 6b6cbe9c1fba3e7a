#pragma once
// gradcheck: analytic gradients against central finite differences, in float64.
//
// For f(inputs) -> output, the check compares d<output, R>/d input (R a fixed random tensor, so every
// output element is weighted differently and all of them are checked) computed by backward() with
// (L(x + eps e_i) - L(x - eps e_i)) / (2 eps) for every element i of every input that requires grad.
// Central differences have O(eps^2) error; with eps = 1e-6 in float64 that is far below the tolerances.
#include <doctest/doctest.h>

#include <functional>
#include <string>
#include <vector>

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

// gradgradcheck: second derivatives, a pass with create_graph differentiated again, against central finite
// differences of first derivatives, in float64. For f(inputs) -> output and fixed random R (itself differentiated:
// the first derivatives are linear in it) and U_k, the first pass gives G_k = d<f, R>/d x_k with create_graph, and
// S = sum_k <G_k, U_k>; the check compares dS/dx (a second pass, for every input that requires grad and R) with
// (S(x + eps e_i) - S(x - eps e_i)) / (2 eps), S there computed by plain first-order passes (which gradcheck checks).
// The G_k of the create_graph pass must equal a plain pass's too.
inline void gradgradcheck(std::function<Tensor(const TensorList&)> f, TensorList inputs, double eps = 1e-6,
                          double atol = 1e-5, double rtol = 1e-3) {
  TensorList xs;
  for (const Tensor& x : inputs) {
    if (!x.defined() || !x.requires_grad()) continue;
    REQUIRE_MESSAGE(x.dtype() == kFloat64, "gradgradcheck wants float64 inputs, got " << x.meta());
    REQUIRE_MESSAGE(x.is_cpu(), "gradgradcheck runs on the CPU, got " << x.meta());
    xs.push_back(x);
  }
  const Tensor r = leaf(f(inputs).shape());
  TensorList us;
  for (const Tensor& x : xs) us.push_back(randn(x.shape(), {.dtype = kFloat64}));
  auto first_derivatives = [&](bool create_graph) {
    return autograd::grad({f(inputs)}, xs, {r}, create_graph, create_graph, /*allow_unused=*/true);
  };
  auto projected_derivatives = [&](const TensorList& g) {
    Tensor s = zeros({}, {.dtype = kFloat64});
    for (size_t k = 0; k < g.size(); ++k)
      if (g[k].defined()) s = s + (g[k] * us[k]).sum();
    return s;
  };

  const TensorList with_graph = first_derivatives(true);
  const TensorList plain = first_derivatives(false);
  for (size_t k = 0; k < xs.size(); ++k) {
    REQUIRE(with_graph[k].defined() == plain[k].defined());
    if (!plain[k].defined()) continue;
    const std::vector<double> a = to_vector<double>(with_graph[k]), b = to_vector<double>(plain[k]);
    for (size_t i = 0; i < a.size(); ++i)
      REQUIRE_MESSAGE(std::abs(a[i] - b[i]) <= 1e-12 * (1 + std::abs(b[i])), "first derivative of input " << k
                      << " element " << i << ": " << a[i] << " with create_graph, " << b[i] << " without");
  }
  TensorList wrt = xs;
  wrt.push_back(r);
  const Tensor s = projected_derivatives(with_graph);
  REQUIRE_MESSAGE(s.requires_grad(), "the first derivatives of a create_graph pass have no history");
  const TensorList analytic = autograd::grad({s}, wrt, {}, false, false, /*allow_unused=*/true);
  for (size_t k = 0; k < wrt.size(); ++k) {
    const Tensor& x = wrt[k];
    const std::vector<double> a =
        analytic[k].defined() ? to_vector<double>(analytic[k]) : std::vector<double>(size_t(x.numel()), 0.0);
    const std::string what = k < xs.size() ? "input " + std::to_string(k) : std::string("the output's gradient R");
    int failures = 0;
    for (int64_t i = 0; i < x.numel(); ++i) {
      double& v = element(x, i);
      const double saved = v;
      v = saved + eps;
      const double plus = projected_derivatives(first_derivatives(false)).item<double>();
      v = saved - eps;
      const double minus = projected_derivatives(first_derivatives(false)).item<double>();
      v = saved;
      const double numeric = (plus - minus) / (2 * eps);
      if (std::abs(a[size_t(i)] - numeric) > atol + rtol * std::abs(numeric) && failures++ < 3) {
        FAIL_CHECK("second derivative by " << what << " (" << x.meta() << ") element " << i << ": analytic "
                                           << a[size_t(i)] << " vs numeric " << numeric);
      }
    }
    CHECK_MESSAGE(failures == 0, failures << " second-derivative elements by " << what << " differ");
  }
}

}  // namespace halfgrad::testing

// Reductions: values by hand and against a float64 reference in every layout, dtype rules, accumulation
// precision, nan and empty-tensor behaviour, multi-threaded splits, errors, and gradients.
#include <doctest/doctest.h>
#include <omp.h>

#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <string>

#include "core/autocast.h"
#include "halfgrad.h"
#include "ops/reduce.h"
#include "tests/gradcheck.h"
#include "tests/testing.h"

using namespace halfgrad;
using halfgrad::testing::check_close;
using halfgrad::testing::values;
using halfgrad::testing::gradcheck;
using halfgrad::testing::leaf;

namespace {

// Reduces x over `dims` (empty: all) the slow obvious way, in float64 on the host: fn receives the
// elements of each output, in order along the reduced dims. Outputs come in row-major order.
std::vector<double> reference(const Tensor& x, const Dims& dims, const std::function<double(const std::vector<double>&)>& fn) {
  std::vector<double> v = values(x);
  const int64_t ndim = x.dim();
  std::vector<bool> mask(size_t(ndim), dims.empty());
  for (int64_t d : dims) mask[size_t(d < 0 ? d + ndim : d)] = true;
  int64_t outputs = 1;
  for (int64_t d = 0; d < ndim; ++d)
    if (!mask[size_t(d)]) outputs *= x.size(d);
  std::vector<std::vector<double>> groups(static_cast<size_t>(outputs));
  for (int64_t i = 0; i < int64_t(v.size()); ++i) {
    int64_t rest = i, out = 0, out_stride = 1;
    for (int64_t d = ndim - 1; d >= 0; --d) {
      int64_t coord = rest % x.size(d);
      rest /= x.size(d);
      if (!mask[size_t(d)]) {
        out += coord * out_stride;
        out_stride *= x.size(d);
      }
    }
    groups[size_t(out)].push_back(v[size_t(i)]);
  }
  std::vector<double> result;
  for (const auto& g : groups) result.push_back(fn(g));
  return result;
}

double ref_sum(const std::vector<double>& g) { return std::accumulate(g.begin(), g.end(), 0.0); }
double ref_mean(const std::vector<double>& g) { return ref_sum(g) / double(g.size()); }
double ref_var(const std::vector<double>& g, int64_t correction) {
  double m = ref_mean(g), s = 0;
  for (double v : g) s += (v - m) * (v - m);
  return s / double(int64_t(g.size()) - correction);
}
double ref_max(const std::vector<double>& g) { return *std::max_element(g.begin(), g.end()); }
double ref_min(const std::vector<double>& g) { return *std::min_element(g.begin(), g.end()); }
double ref_argmax(const std::vector<double>& g) { return double(std::max_element(g.begin(), g.end()) - g.begin()); }
double ref_argmin(const std::vector<double>& g) { return double(std::min_element(g.begin(), g.end()) - g.begin()); }

// |got - want| <= tol * max(1, |want|) for every element; reports the first few misses.
void check_close(const std::vector<double>& got, const std::vector<double>& want, double tol, const std::string& what) {
  REQUIRE_MESSAGE(got.size() == want.size(), what);
  int misses = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    bool close = std::abs(got[i] - want[i]) <= tol * std::max(1.0, std::abs(want[i]));
    if (!close && misses++ < 3) FAIL_CHECK(what << ": element " << i << " is " << got[i] << ", expected " << want[i]);
  }
}

// The rounding of a result stored in dtype t (float16 keeps 11 significant bits, bfloat16 8); float32
// leaves room for the accumulated rounding of sums of a few hundred elements.
double tolerance(DType t) {
  switch (t) {
    case kFloat16: return 1e-3;
    case kBFloat16: return 8e-3;
    case kFloat32: return 2e-6;
    default: return 1e-12;
  }
}

// The layouts every reduction must handle: contiguous, transposed, permuted, strided slice, broadcast.
struct Layout {
  std::string name;
  std::function<Tensor(const Tensor&)> make;  // from a contiguous [6, 10, 14] tensor to a 3-d tensor
};
std::vector<Layout> layouts() {
  return {
      {"contiguous", [](const Tensor& t) { return t; }},
      {"transposed", [](const Tensor& t) { return t.transpose(0, 2); }},
      {"permuted", [](const Tensor& t) { return t.permute({1, 2, 0}); }},
      {"sliced", [](const Tensor& t) { return t.slice(1, 1, 10, 3).slice(2, 2, 14); }},
      {"broadcast", [](const Tensor& t) { return t.narrow(1, 4, 1).expand({6, 5, 14}); }},
  };
}
const std::vector<Dims> kDimSets = {{}, {0}, {1}, {2}, {-1}, {0, 1}, {0, 2}, {1, 2}, {2, 0}, {0, 1, 2}};

std::string describe(const char* op, const Layout& layout, const Dims& dims, DType dtype) {
  return fmt::format("{} of a {} {} tensor over dims [{}]", op, layout.name, dtype_name(dtype), fmt::join(dims, ", "));
}

}  // namespace

// ---- values

TEST_CASE("sum over several dims with keepdim matches a hand computation") {
  Tensor x = arange(24, {.dtype = kFloat32}).view({2, 3, 4});  // x[i][j][k] = 12i + 4j + k
  Tensor s = x.sum({0, 2}, /*keepdim=*/true);
  CHECK(s.shape() == Shape{1, 3, 1});
  CHECK(s.dtype() == kFloat32);
  // sum over i, k of 12i + 4j + k = 4*12 + 8*4j + 2*6 = 60 + 32j
  CHECK(values(s) == std::vector<double>{60, 92, 124});
  CHECK(x.sum({0, 2}).shape() == Shape{3});
  CHECK(values(x.sum({1})) == std::vector<double>{12, 15, 18, 21, 48, 51, 54, 57});
  CHECK(values(x.sum({-1})) == values(x.sum({2})));
  CHECK(x.sum().shape() == Shape{});
  CHECK(x.sum().item<double>() == 276);
  CHECK(x.sum({}, true).shape() == Shape{1, 1, 1});
}

TEST_CASE("mean, var, max, min and argmax of a small matrix match a hand computation") {
  Tensor x = tensor(std::vector<float>{1, 5, 3, 4, 2, 9}, {2, 3});
  CHECK(values(x.mean({1})) == std::vector<double>{3, 5});
  CHECK(values(x.mean({0})) == std::vector<double>{2.5, 3.5, 6});
  CHECK(values(x.var({1})) == std::vector<double>{4, 13});                    // (4 + 4 + 0) / 2, (1 + 9 + 16) / 2
  check_close(values(x.var({1}, /*correction=*/0)), {8.0 / 3, 26.0 / 3}, 1e-7, "population variance");
  CHECK(x.max().item<double>() == 9);
  CHECK(x.min().item<double>() == 1);
  auto [values_max, indices_max] = x.max(1);
  CHECK(values(values_max) == std::vector<double>{5, 9});
  CHECK(indices_max.dtype() == kInt64);
  CHECK(values(indices_max) == std::vector<double>{1, 2});
  auto [values_min, indices_min] = x.min(0, /*keepdim=*/true);
  CHECK(values_min.shape() == Shape{1, 3});
  CHECK(values(values_min) == std::vector<double>{1, 2, 3});
  CHECK(values(indices_min) == std::vector<double>{0, 1, 0});
  CHECK(values(x.argmax(-1)) == std::vector<double>{1, 2});
  CHECK(values(x.argmin(0)) == std::vector<double>{0, 1, 0});
  CHECK(x.argmax(1, true).shape() == Shape{2, 1});
  // The free functions are the same ops.
  CHECK(values(halfgrad::sum(x, {0})) == std::vector<double>{5, 7, 12});
  CHECK(halfgrad::max(x).item<double>() == 9);
}

TEST_CASE("sum, mean, var, max, min, argmax and argmin match a float64 reference in every layout, dim set and floating dtype") {
  manual_seed(1);
  Tensor base = randn({6, 10, 14}, {.dtype = kFloat64});
  for (DType dtype : {kFloat64, kFloat32, kFloat16, kBFloat16}) {
    for (const Layout& layout : layouts()) {
      Tensor x = layout.make(base.to(dtype));
      for (const Dims& dims : kDimSets) {
        const double tol = tolerance(dtype);
        check_close(values(x.sum(dims)), reference(x, dims, ref_sum), tol, describe("sum", layout, dims, dtype));
        check_close(values(x.mean(dims)), reference(x, dims, ref_mean), tol, describe("mean", layout, dims, dtype));
        check_close(values(x.var(dims)), reference(x, dims, [](const auto& g) { return ref_var(g, 1); }), tol,
                    describe("var", layout, dims, dtype));
        CHECK(x.sum(dims, true).dim() == 3);
        CHECK(x.sum(dims).dtype() == dtype);
      }
      for (int64_t dim : {0, 1, 2, -1}) {
        Dims dims{dim};
        auto [max_values, max_indices] = x.max(dim);
        auto [min_values, min_indices] = x.min(dim);
        check_close(values(max_values), reference(x, dims, ref_max), 0, describe("max", layout, dims, dtype));
        check_close(values(min_values), reference(x, dims, ref_min), 0, describe("min", layout, dims, dtype));
        // Rounding to 16 bits can create ties: the reference also takes the first occurrence.
        check_close(values(max_indices), reference(x, dims, ref_argmax), 0, describe("max indices", layout, dims, dtype));
        check_close(values(min_indices), reference(x, dims, ref_argmin), 0, describe("min indices", layout, dims, dtype));
        check_close(values(x.argmax(dim)), reference(x, dims, ref_argmax), 0, describe("argmax", layout, dims, dtype));
        check_close(values(x.argmin(dim)), reference(x, dims, ref_argmin), 0, describe("argmin", layout, dims, dtype));
      }
      CHECK(x.max().item<double>() == reference(x, {}, ref_max)[0]);
      CHECK(x.min().item<double>() == reference(x, {}, ref_min)[0]);
    }
  }
}

TEST_CASE("reductions over several separate blocks of dims (conv's bias gradient) match the reference") {
  // A contiguous [N, C, H, W] summed over {0, 2, 3} runs in stages without a transposing copy, a channels-last one
  // as one [N H W, C] block read in its memory order; the answer must not depend on either.
  manual_seed(7);
  Tensor base = randn({3, 4, 5, 6}, {.dtype = kFloat64});
  for (DType dtype : {kFloat64, kFloat32, kFloat16, kInt32, kBool}) {
    for (bool channels_last : {false, true}) {
      Tensor x = dtype == kBool ? base.gt(0.3) : dtype == kInt32 ? base.mul(10).to(kInt32) : base.to(dtype);
      if (channels_last) x = contiguous_channels_last(x);
      for (const Dims& dims : std::vector<Dims>{{0, 2, 3}, {0, 2}, {1, 3}, {0, 3}, {-4, -1}, {0, 1, 3}, {1}, {2, 3}}) {
        const double tol = is_floating(dtype) ? tolerance(dtype) : 0;
        const std::string what = fmt::format("{} {} over [{}]", channels_last ? "channels-last" : "contiguous",
                                             dtype_name(dtype), fmt::join(dims, ", "));
        check_close(values(x.sum(dims)), reference(x, dims, ref_sum), tol, "sum of " + what);
        CHECK(x.sum(dims, true).dim() == 4);
        if (is_floating(dtype)) check_close(values(x.mean(dims)), reference(x, dims, ref_mean), tol, "mean of " + what);
        check_close(values(x.all(dims)), reference(x, dims, [](const auto& g) {
                      return double(std::all_of(g.begin(), g.end(), [](double v) { return v != 0; }));
                    }), 0, "all of " + what);
        check_close(values(x.any(dims, true)), reference(x, dims, [](const auto& g) {
                      return double(std::any_of(g.begin(), g.end(), [](double v) { return v != 0; }));
                    }), 0, "any of " + what);
      }
    }
  }
  manual_seed(8);
  Tensor g = leaf({2, 3, 2, 4});
  gradcheck([](const TensorList& in) { return in[0].sum({0, 2, 3}); }, {g});
  gradcheck([](const TensorList& in) { return in[0].mean({0, 3}, true); }, {g});
}

TEST_CASE("integer and bool sums give int64, max, min and argmax work on every dtype") {
  manual_seed(2);
  Tensor ints = randint(-50, 50, {6, 10, 14});
  for (DType dtype : {kBool, kUInt8, kInt32, kInt64}) {
    Tensor base = dtype == kBool ? ints.gt(0) : dtype == kUInt8 ? ints.abs().to(kUInt8) : ints.to(dtype);
    for (const Layout& layout : layouts()) {
      Tensor x = layout.make(base);
      for (const Dims& dims : kDimSets) {
        Tensor s = x.sum(dims);
        CHECK(s.dtype() == kInt64);
        check_close(values(s), reference(x, dims, ref_sum), 0, describe("sum", layout, dims, dtype));
      }
      for (int64_t dim : {0, 1, 2}) {
        auto [max_values, max_indices] = x.max(dim);
        CHECK(max_values.dtype() == dtype);
        check_close(values(max_values), reference(x, {dim}, ref_max), 0, describe("max", layout, {dim}, dtype));
        check_close(values(max_indices), reference(x, {dim}, ref_argmax), 0, describe("max indices", layout, {dim}, dtype));
        check_close(values(x.argmin(dim)), reference(x, {dim}, ref_argmin), 0, describe("argmin", layout, {dim}, dtype));
      }
      CHECK(x.max().item<double>() == reference(x, {}, ref_max)[0]);
      CHECK(x.min().item<double>() == reference(x, {}, ref_min)[0]);
    }
  }
  // uint8 sums do not wrap at 256: they accumulate in int64.
  CHECK(full({1000}, 255, {.dtype = kUInt8}).sum().item<int64_t>() == 255000);
  CHECK(ones({3000}, {.dtype = kInt32}).mul(1000000).sum().item<int64_t>() == 3000000000LL);
}

TEST_CASE("all and any give bool, but uint8 for a uint8 input, as PyTorch's") {
  const Tensor bytes = tensor(std::vector<uint8_t>{1, 2, 0, 4}).view({2, 2});
  CHECK(bytes.all().dtype() == kUInt8);
  CHECK(values(bytes.all({1})) == std::vector<double>{1, 0});
  CHECK(values(bytes.any({1})) == std::vector<double>{1, 1});
  CHECK(bytes.any({1}).dtype() == kUInt8);
  CHECK(tensor(std::vector<int32_t>{1, 0}).any().dtype() == kBool);
}

TEST_CASE("half types accumulate in float32: sums of 4096 ones are exact in float16 and bfloat16") {
  // A float16 accumulator stops growing at 2048 (2048 + 1 rounds back to 2048), a bfloat16 one at 256.
  for (DType dtype : {kFloat16, kBFloat16}) {
    CAPTURE(std::string(dtype_name(dtype)));
    CHECK(ones({4096}, {.dtype = dtype}).sum().item<double>() == 4096);
    CHECK(ones({4096, 3}, {.dtype = dtype}).sum({0}).dtype() == dtype);
    CHECK(values(ones({4096, 3}, {.dtype = dtype}).sum({0})) == std::vector<double>(3, 4096));  // column mode
    CHECK(values(ones({3, 4096}, {.dtype = dtype}).sum({1})) == std::vector<double>(3, 4096));  // row mode
    CHECK(ones({4096, 2}, {.dtype = dtype}).mean().item<double>() == 1);
    // var of {0, 1, 0, 1, ...}: the mean 0.5 and the squared deviations 0.25 are exact in float32.
    std::vector<float> alternating(4096);
    for (size_t i = 0; i < alternating.size(); ++i) alternating[i] = float(i % 2);
    CHECK(tensor(alternating).to(dtype).var({}, 0).item<double>() == 0.25);
    CHECK(tensor(alternating).to(dtype).view({64, 64}).var({1}, 0).sum().item<double>() == 16);
  }
}

TEST_CASE("float32 sums of millions of elements stay accurate (cascaded, not one running accumulator)") {
  // 20M ones: a single float32 accumulator stops at 2^24 = 16777216.
  const int64_t n = 20'000'000;
  CHECK(ones({n}).sum().item<double>() == double(n));
  CHECK(values(ones({n / 2, 2}).sum({0})) == std::vector<double>(2, double(n / 2)));
  CHECK(ones({n}).mean().item<double>() == 1.0);
  // Random values against float64: the error stays near float32 rounding of the result.
  manual_seed(3);
  Tensor x64 = rand({4'000'000}, {.dtype = kFloat64});
  Tensor x = x64.to(kFloat32);
  double want = x.to(kFloat64).sum().item<double>();
  CHECK(std::abs(x.sum().item<double>() - want) <= 1e-6 * want);
  Tensor m = x.view({1000, 4000});
  check_close(values(m.sum({0})), values(m.to(kFloat64).sum({0})), 1e-6, "column sums of a [1000, 4000] matrix");
  check_close(values(m.sum({1})), values(m.to(kFloat64).sum({1})), 1e-6, "row sums of a [1000, 4000] matrix");
}

TEST_CASE("var uses the correction and stays accurate for data far from zero") {
  Tensor x = tensor(std::vector<double>{2, 4, 4, 4, 5, 5, 7, 9});
  CHECK(x.var({}, 0).item<double>() == doctest::Approx(4.0));
  CHECK(x.var().item<double>() == doctest::Approx(32.0 / 7));
  CHECK(x.var({0}, 2).item<double>() == doctest::Approx(32.0 / 6));
  // Unit variance around 1e4 in float32: the naive E[x^2] - E[x]^2 loses everything (1e8 vs ulp 8).
  manual_seed(4);
  Tensor y64 = randn({100000}, {.dtype = kFloat64}).add(1e4);
  Tensor y = y64.to(kFloat32);
  double want = y.to(kFloat64).var().item<double>();
  CHECK(y.var().item<double>() == doctest::Approx(want).epsilon(1e-4));
  Tensor columns = y.view({1000, 100});
  check_close(values(columns.var({0})), values(columns.to(kFloat64).var({0})), 1e-4, "column variances near 1e4");
  // float32 values of +-1.5e19: their squared deviations pass float32's range, their variance does not (PyTorch's CPU
  // sums in double).
  std::vector<float> alternating(1000);
  for (size_t i = 0; i < alternating.size(); ++i) alternating[i] = i % 2 ? -1.5e19f : 1.5e19f;
  Tensor wide = tensor(alternating);
  const double wide_want = wide.to(kFloat64).var().item<double>();
  CHECK(std::isfinite(wide.var().item<float>()));
  CHECK(wide.var().item<float>() == doctest::Approx(wide_want).epsilon(1e-6));
  // A single element: 0 / 0 with Bessel's correction, 0 without.
  CHECK(std::isnan(ones({1}).var().item<double>()));
  CHECK(ones({1}).var({}, 0).item<double>() == 0);
}

TEST_CASE("max and min propagate nan and report the index of the first nan") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (DType dtype : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
    CAPTURE(std::string(dtype_name(dtype)));
    Tensor x = tensor(std::vector<double>{1, nan, 7, nan, -3}).to(dtype);
    CHECK(std::isnan(x.max().item<double>()));
    CHECK(std::isnan(x.min().item<double>()));
    auto [v, i] = x.max(0);
    CHECK(std::isnan(v.item<double>()));
    CHECK(i.item<int64_t>() == 1);
    CHECK(x.argmin(0).item<int64_t>() == 1);
    CHECK(std::isnan(x.sum().item<double>()));
  }
  // Row by row: only the rows that hold a nan give nan.
  Tensor m = tensor(std::vector<float>{1, 2, 3, 4, NAN, 6}, {2, 3});
  auto [v, i] = m.max(1);
  CHECK(values(v)[0] == 3);
  CHECK(std::isnan(values(v)[1]));
  CHECK(values(i) == std::vector<double>{2, 1});
  // Along a column: inner > 1 layout.
  CHECK(values(m.argmax(0)) == std::vector<double>{1, 1, 1});
}

TEST_CASE("max(dim) and argmax return the first index among ties") {
  Tensor x = tensor(std::vector<float>{3, 1, 3, 3,    // max 3 at 0, 2, 3
                                       3, -2, -2, 1},  // min -2 at 1, 2; column 0 ties too
                    {2, 4});
  CHECK(values(x.argmax(1)) == std::vector<double>{0, 0});
  CHECK(values(x.argmin(1)) == std::vector<double>{1, 1});
  CHECK(values(x.max(0).second) == std::vector<double>{0, 0, 0, 0});
  CHECK(values(x.min(0).second) == std::vector<double>{0, 1, 1, 1});
  CHECK(values(x.t().argmax(0)) == std::vector<double>{0, 0});  // the same rows through a transposed view
}

TEST_CASE("long reductions split over threads merge to the same values and first indices") {
  // Forces more threads than this machine may have, so that the split paths (pieces of one long row, row
  // blocks of a few columns) run and are merged whatever the hardware.
  const int saved_threads = omp_get_max_threads();
  omp_set_num_threads(5);
  const int64_t n = 300001;
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = float((i * 7919) % 1000) / 100.0f;  // max 9.99 at many places
  v[123457] = 50;
  v[250000] = 50;   // tie: the first one wins even though another thread finds it
  v[3] = -50;
  v[290000] = -50;
  Tensor x = tensor(v);
  CHECK(x.argmax(0).item<int64_t>() == 123457);
  CHECK(x.argmin(0).item<int64_t>() == 3);
  CHECK(x.max().item<double>() == 50);
  CHECK(x.sum().item<double>() == doctest::Approx(reference(x, {}, ref_sum)[0]).epsilon(1e-6));
  // The same data as one long column of a [n, 1] and in the middle of a [1, n, 1]-like layout.
  Tensor column = x.view({n, 1}).expand({n, 3}).contiguous();
  CHECK(values(column.argmax(0)) == std::vector<double>{123457, 123457, 123457});
  CHECK(values(column.argmin(0)) == std::vector<double>{3, 3, 3});
  check_close(values(column.sum({0})), std::vector<double>(3, reference(x, {}, ref_sum)[0]), 1e-6, "column sums");
  check_close(values(column.var({0})), std::vector<double>(3, reference(x, {}, [](const auto& g) { return ref_var(g, 1); })[0]),
              1e-5, "column variances");
  // A nan late in a long row wins over the earlier maximum, in either split.
  v[280000] = NAN;
  Tensor with_nan = tensor(v);
  CHECK(with_nan.argmax(0).item<int64_t>() == 280000);
  CHECK(values(with_nan.view({n, 1}).expand({n, 2}).contiguous().argmax(0)) == std::vector<double>{280000, 280000});
  CHECK(values(halfgrad::any(with_nan.view({n, 1}).expand({n, 2}).contiguous(), {0})) == std::vector<double>{1, 1});
  CHECK_FALSE(halfgrad::all(with_nan).item<bool>());  // v[0] == 0
  omp_set_num_threads(saved_threads);
}

TEST_CASE("all and any treat nonzero, including nan, as true") {
  CHECK(tensor(std::vector<float>{1, -2, NAN}).all().item<bool>());
  CHECK_FALSE(tensor(std::vector<float>{1, 0, 3}).all().item<bool>());
  CHECK(tensor(std::vector<int32_t>{0, 0, 5}).any().item<bool>());
  CHECK_FALSE(zeros({4}, {.dtype = kFloat16}).any().item<bool>());
  CHECK(tensor(std::vector<double>{0, 0}).all().dtype() == kBool);
  Tensor m = tensor(std::vector<int64_t>{1, 0, 1, 1, 1, 1}, {2, 3});
  CHECK(values(halfgrad::all(m, {1})) == std::vector<double>{0, 1});
  CHECK(values(halfgrad::any(m.sub(ones_like(m)), {0})) == std::vector<double>{0, 1, 0});
  CHECK(values(halfgrad::all(m.gt(0), {0}, true)) == std::vector<double>{1, 0, 1});
}

TEST_CASE("empty tensors: sum is 0, mean and var nan, all true, any false, max over nothing is an error") {
  Tensor e = empty({0, 3});
  CHECK(e.sum().item<double>() == 0);
  CHECK(values(e.sum({0})) == std::vector<double>{0, 0, 0});
  CHECK(e.sum({1}).shape() == Shape{0});
  CHECK(std::isnan(e.mean().item<double>()));
  CHECK(std::isnan(e.var().item<double>()));
  CHECK(e.all().item<bool>());
  CHECK_FALSE(e.any().item<bool>());
  CHECK(empty({0}, {.dtype = kInt32}).sum().item<int64_t>() == 0);
  CHECK_THROWS_WITH_AS(e.max(), doctest::Contains("max: cannot reduce the empty tensor float32[0, 3] cpu"), Error);
  CHECK_THROWS_WITH_AS(e.min(), doctest::Contains("min:"), Error);
  CHECK_THROWS_WITH_AS(e.max(0), doctest::Contains("max: cannot reduce over dim 0 of float32[0, 3] cpu"), Error);
  CHECK_THROWS_WITH_AS(e.argmin(0), doctest::Contains("argmin:"), Error);
  // Reducing a non-empty dim of an empty tensor is fine: there is nothing to compute.
  CHECK(e.max(1).first.shape() == Shape{0});
  CHECK(e.argmax(1, true).shape() == Shape{0, 1});
}

TEST_CASE("0-d tensors reduce to themselves, with dim 0 or -1 or none") {
  Tensor s = scalar_tensor(2.5);
  CHECK(s.sum().item<double>() == 2.5);
  CHECK(s.sum({0}).shape() == Shape{});
  CHECK(s.sum({-1}, true).shape() == Shape{});
  CHECK(s.mean().item<double>() == 2.5);
  CHECK(s.max().item<double>() == 2.5);
  CHECK(s.max(0).second.item<int64_t>() == 0);
  CHECK(s.argmin(-1).item<int64_t>() == 0);
  CHECK(std::isnan(s.var().item<double>()));
  CHECK(s.all().item<bool>());
  CHECK_THROWS_WITH_AS(s.sum({1}), doctest::Contains("sum: dimension 1 is out of range"), Error);
}

// ---- errors

TEST_CASE("errors name the op and the operand") {
  Tensor x = ones({2, 3}, {.dtype = kInt64});
  CHECK_THROWS_WITH_AS(x.mean(), doctest::Contains("mean: input dtype should be floating point, got int64[2, 3] cpu"), Error);
  CHECK_THROWS_WITH_AS(x.var({0}), doctest::Contains("var: input dtype should be floating point, got int64[2, 3] cpu"), Error);
  Tensor f = ones({2, 3});
  CHECK_THROWS_WITH_AS(f.sum({1, -1}), doctest::Contains("sum: dim 1 appears more than once in dims [1, -1] for float32[2, 3] cpu"),
                       Error);
  CHECK_THROWS_WITH_AS(f.mean({0, 0}), doctest::Contains("mean: dim 0 appears more than once"), Error);
  CHECK_THROWS_WITH_AS(f.sum({2}), doctest::Contains("sum: dimension 2 is out of range"), Error);
  CHECK_THROWS_WITH_AS(f.max(-3), doctest::Contains("max: dimension -3 is out of range"), Error);
  CHECK_THROWS_WITH_AS(f.var({}, -1), doctest::Contains("var: correction must be non-negative"), Error);
}

// ---- gradients

TEST_CASE("gradients of sum, mean and var pass gradcheck over several dims, with and without keepdim") {
  manual_seed(5);
  Tensor x = leaf({3, 4, 5});
  gradcheck([](const TensorList& in) { return in[0].sum(); }, {x});
  gradcheck([](const TensorList& in) { return in[0].sum({0, 2}, true); }, {x});
  gradcheck([](const TensorList& in) { return in[0].sum({-1}); }, {x});
  gradcheck([](const TensorList& in) { return in[0].mean(); }, {x});
  gradcheck([](const TensorList& in) { return in[0].mean({1}, true); }, {x});
  gradcheck([](const TensorList& in) { return in[0].mean({2, 0}); }, {x});
  gradcheck([](const TensorList& in) { return in[0].var(); }, {x});
  gradcheck([](const TensorList& in) { return in[0].var({1}); }, {x});
  gradcheck([](const TensorList& in) { return in[0].var({0, 2}, 0, true); }, {x});
  // Through a non-contiguous view, whose forward copies.
  gradcheck([](const TensorList& in) { return in[0].transpose(0, 2).var({0, 2}); }, {x});
  gradcheck([](const TensorList& in) { return in[0].permute({1, 0, 2}).sum({1, 2}); }, {x});
}

TEST_CASE("gradients of max and min along a dim flow to the picked element") {
  manual_seed(6);
  Tensor x = leaf({4, 5, 3});
  gradcheck([](const TensorList& in) { return in[0].max(1).first; }, {x});
  gradcheck([](const TensorList& in) { return in[0].min(-1, true).first; }, {x});
  gradcheck([](const TensorList& in) { return in[0].transpose(0, 1).max(2).first; }, {x});
  gradcheck([](const TensorList& in) { return in[0].max(); }, {x});
  gradcheck([](const TensorList& in) { return in[0].min(); }, {x});
  // Ties along a dim: all of the gradient goes to the first (the index returned).
  Tensor t = tensor(std::vector<double>{1, 3, 3, 2}).requires_grad_();
  t.max(0).first.backward();
  CHECK(values(t.grad()) == std::vector<double>{0, 1, 0, 0});
  CHECK(t.max(0).first.grad_fn()->name() == "MaxDimBackward");
  CHECK_FALSE(t.max(0).second.requires_grad());
  CHECK_FALSE(t.argmax(0).requires_grad());
}

TEST_CASE("gradient of max() and min() over all elements is split evenly among ties") {
  Tensor x = tensor(std::vector<double>{1, 3, 3, 2, 3, -1}, {2, 3}).requires_grad_();
  x.max().backward();
  CHECK(values(x.grad()) == std::vector<double>{0, 1.0 / 3, 1.0 / 3, 0, 1.0 / 3, 0});
  Tensor y = tensor(std::vector<double>{-1, 3, -1}).requires_grad_();
  y.min().mul(tensor(std::vector<double>{4}).view({})).backward();
  CHECK(values(y.grad()) == std::vector<double>{2, 0, 2});
  // A nan result: the gradient goes to the nan.
  Tensor z = tensor(std::vector<double>{1, NAN, 2}).requires_grad_();
  z.max().backward();
  CHECK(values(z.grad()) == std::vector<double>{0, 1, 0});
  // Float16 ties are counted in int64, as PyTorch's evenly_distribute_backward: in float16 100,000 would be inf.
  Tensor h = zeros({100000}, {.dtype = kFloat16}).requires_grad_();
  h.max().backward();
  CHECK(h.grad()[0].item<double>() == doctest::Approx(1e-5).epsilon(0.05));
  CHECK(h.grad().to(kFloat32).sum().item<double>() == doctest::Approx(1.0).epsilon(0.05));
}

TEST_CASE("cuda: max()'s gradient among 100,000 float16 ties, counted in int64 and divided in float32, as on the CPU") {
  SKIP_WITHOUT_GPU();
  Tensor h = zeros({100000}, {.dtype = kFloat16, .device = Device::cuda(0)}).requires_grad_();
  h.max().backward();
  CHECK(h.grad().cpu()[0].item<double>() == doctest::Approx(1e-5).epsilon(0.05));
}

TEST_CASE("var's gradient where the correction leaves no degrees of freedom is PyTorch's") {
  // Over every element: inf, nan where x is the mean; over named dims: 2 / (N - correction) as it stands.
  Tensor x = tensor<double>({1, 2, 4}).requires_grad_();
  x.var({}, 3).backward();
  CHECK(values(x.grad()) == std::vector<double>(3, INFINITY));
  Tensor m = tensor<double>({1, 2, 3}).requires_grad_();
  m.var({}, 5).backward();
  const std::vector<double> at_mean = values(m.grad());
  CHECK(at_mean[0] == INFINITY);
  CHECK(std::isnan(at_mean[1]));  // x == mean: inf * 0
  Tensor d = tensor<double>({1, 2, 4}).requires_grad_();
  d.var({0}, 4).backward();  // 2 / (3 - 4) (x - 7/3)
  check_close(values(d.grad()), {8.0 / 3, 2.0 / 3, -10.0 / 3}, 1e-15);
}

TEST_CASE("reductions record nothing for inputs without grad and keep gradients in the input dtype") {
  Tensor x = ones({3, 4});
  CHECK_FALSE(x.sum().requires_grad());
  Tensor h = ones({3, 4}, {.dtype = kFloat16}).requires_grad_();
  h.mean({1}).sum().backward();
  CHECK(h.grad().dtype() == kFloat16);
  CHECK(values(h.grad()) == std::vector<double>(12, 0.25));
  Tensor w = ones({2, 3}).requires_grad_();
  {
    NoGradGuard no_grad;
    CHECK_FALSE(w.sum().requires_grad());
  }
  CHECK(w.sum({1}).grad_fn()->name() == "SumBackward");
  CHECK(w.var().grad_fn()->name() == "VarBackward");
}

TEST_CASE("under autocast sum, mean and var run in float32 while max and argmax keep the input dtype") {
  Tensor h = ones({64, 8}, {.dtype = kFloat16});
  amp::AutocastGuard autocast(kFloat16);
  CHECK(h.sum().dtype() == kFloat32);
  CHECK(h.mean({0}).dtype() == kFloat32);
  CHECK(h.var({1}).dtype() == kFloat32);
  CHECK(h.max().dtype() == kFloat16);
  CHECK(h.max(1).first.dtype() == kFloat16);
  CHECK(h.argmax(0).dtype() == kInt64);
  CHECK(ones({4}, {.dtype = kInt32}).sum().dtype() == kInt64);  // integers are never cast
}

TEST_CASE("amax and amin over several dims, with and without keepdim, by hand") {
  const Tensor x = tensor(std::vector<double>{1, 7, 3, 2, -5, 6, 0, 4, 9, -1, 8, 5}, {2, 3, 2});
  CHECK(values(x.amax({0, 2})) == std::vector<double>{7, 9, 8});
  CHECK(values(x.amin({0, 2})) == std::vector<double>{0, -1, -5});
  CHECK(x.amax({1}, /*keepdim=*/true).shape() == Shape{2, 1, 2});
  CHECK(values(x.amax({1}, true)) == std::vector<double>{3, 7, 9, 5});
  CHECK(values(x.amax()) == std::vector<double>{9});  // every dim
  CHECK(x.amax().dim() == 0);
  CHECK(values(x.amin({-1})) == std::vector<double>{1, 2, -5, 0, -1, 5});
  // Every dtype keeps itself; a nan wins.
  CHECK(arange(5).amax().item<int64_t>() == 4);
  CHECK(arange(5).amax().dtype() == kInt64);
  CHECK(std::isnan(tensor<float>({1, NAN, 3}).amax().item<float>()));
  CHECK_THROWS_WITH_AS(zeros({2, 0}).amax({1}),
                       doctest::Contains("amax: cannot reduce over dim 1 of float32[2, 0] cpu, which has size 0"),
                       Error);
  CHECK(zeros({2, 0}).amax({0}).shape() == Shape{0});  // a dim of size 0 kept: nothing to reduce to
  CHECK_THROWS_WITH_AS(x.amax({3}), doctest::Contains("amax: "), Error);  // errors name the op, not its kernel's
}

TEST_CASE("amax's and amin's gradients are split evenly among the ties of each result") {
  Tensor x = tensor(std::vector<double>{1, 3, 3, 2, 3, -1}, {2, 3}).requires_grad_();
  x.amax({1}).mul(tensor<double>({6, 10})).sum().backward();
  CHECK(values(x.grad()) == std::vector<double>{0, 3, 3, 0, 10, 0});
  x.set_grad(Tensor());
  x.amin({0}, true).sum().backward();  // column 1 ties at 3
  CHECK(values(x.grad()) == std::vector<double>{1, 0.5, 0, 0, 0.5, 1});
  gradcheck([](const TensorList& in) { return in[0].amax({0, 2}); }, {leaf({3, 2, 4})});
  // A nan result: no element equals it, and the group's gradient is nan, as PyTorch's amax (g / 0 * 0); max() over
  // every element gives it to the nans instead (the test above).
  Tensor n = tensor<double>({1, NAN, NAN, 2}).requires_grad_();
  n.amax().backward();
  for (double v : values(n.grad())) CHECK(std::isnan(v));
  gradcheck([](const TensorList& in) { return in[0].amin({1}, true); }, {leaf({3, 5})});
}

TEST_CASE("std is var's square root with the same correction, and its gradient at a constant input is 0") {
  const Tensor x = tensor(std::vector<double>{1, 2, 3, 4, 10, 10, 10, 10}, {2, 4});
  check_close(values(x.std({1})), {std::sqrt(5.0 / 3.0), 0.0}, 1e-15);
  check_close(values(x.std({1}, 0)), {std::sqrt(1.25), 0.0}, 1e-15);
  check_close(values(x.std()), {std::sqrt(values(x.var())[0])}, 1e-15);
  CHECK(x.std({0}, 1, true).shape() == Shape{1, 4});
  gradcheck([](const TensorList& in) { return in[0].std({1}); }, {leaf({3, 5})});
  gradcheck([](const TensorList& in) { return in[0].std({0, 2}, 0, true); }, {leaf({3, 2, 4})});
  // PyTorch's std_backward: 0 where the result is 0, not 0 * inf = nan.
  Tensor c = full({4}, 2.0, {.dtype = kFloat64}).requires_grad_();
  c.std().backward();
  CHECK(values(c.grad()) == std::vector<double>{0, 0, 0, 0});
  CHECK_THROWS_WITH_AS(arange(4).std(), doctest::Contains("std: input dtype should be floating point"), Error);
  amp::AutocastGuard guard(kFloat16);
  CHECK(randn({4}).to(kFloat16).std().dtype() == kFloat32);  // var's category
}

TEST_CASE("cuda: amax and std match the CPU forward and backward, amin forward") {
  SKIP_WITHOUT_GPU();
  manual_seed(321);
  for (DType dt : {kFloat32, kFloat64, kFloat16}) {
    CAPTURE(std::string(dtype_name(dt)));
    // Few distinct values: ties in every reduced group.
    const Tensor x = randint(0, 4, {6, 5, 7}).to(dt);
    for (const Dims& dims : {Dims{0, 2}, Dims{1}, Dims{}}) {
      Tensor xc = x.detach().requires_grad_(), xg = x.cuda().requires_grad_();
      const Tensor yc = xc.amax(dims), yg = xg.amax(dims);
      CHECK(values(yg.cpu()) == values(yc));
      yc.sum().backward();
      yg.sum().backward();
      check_close(values(xg.grad().cpu()), values(xc.grad()), 1e-3);
      Tensor sc = x.detach().requires_grad_(), sg = x.cuda().requires_grad_();
      const Tensor stc = sc.std(dims), stg = sg.std(dims);
      check_close(values(stg.cpu()), values(stc), 2e-3);
      stc.sum().backward();
      stg.sum().backward();
      check_close(values(sg.grad().cpu()), values(sc.grad()), 4e-3);
    }
    CHECK(values(x.cuda().amin({1}).cpu()) == values(x.amin({1})));
  }
}

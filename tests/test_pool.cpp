// Pooling: max_pool2d, avg_pool2d and adaptive_avg_pool2d against naive float64 loops and hand-computed
// values, PyTorch's edge rules (padding, ceil_mode, count_include_pad, ties, nan), memory layouts, errors,
// gradchecks, and CUDA against the CPU (skipped without a GPU).
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "core/cuda.h"
#include "halfgrad.h"
#include "tests/testing.h"
#include "ops/conv.h"
#include "ops/pool.h"
#include "tests/gradcheck.h"

using namespace halfgrad;
using namespace halfgrad::testing;
using halfgrad::testing::gradcheck;
using halfgrad::testing::leaf;

namespace {


// PyTorch's output size rule, written out independently of ops/pool.cpp.
int64_t out_size(int64_t in, int64_t k, int64_t s, int64_t p, int64_t d, bool ceil_mode) {
  const double span = double(in + 2 * p - d * (k - 1) - 1) / double(s);
  int64_t out = int64_t(ceil_mode ? std::ceil(span) : std::floor(span)) + 1;
  if (ceil_mode && (out - 1) * s >= in + p) --out;
  return out;
}

struct Plane {  // the values of a tensor, indexed (n, c, h, w)
  Shape shape;
  std::vector<double> v;
  explicit Plane(const Tensor& t) : shape(t.shape()), v(to_vector<double>(t)) {}
  double at(int64_t n, int64_t c, int64_t h, int64_t w) const {
    return v[size_t(((n * shape[1] + c) * shape[2] + h) * shape[3] + w)];
  }
};

// max_pool2d by the definition: values and indices (h * W + w); the first maximum wins, nan beats all.
std::pair<std::vector<double>, std::vector<int64_t>> reference_max_pool(const Tensor& x, Pair2d k,
                                                                        const MaxPool2dOptions& o, Shape& shape) {
  Plane in(x);
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  Pair2d s = o.stride[0] == 0 && o.stride[1] == 0 ? k : o.stride;
  const int64_t OH = out_size(H, k[0], s[0], o.padding[0], o.dilation[0], o.ceil_mode);
  const int64_t OW = out_size(W, k[1], s[1], o.padding[1], o.dilation[1], o.ceil_mode);
  shape = {N, C, OH, OW};
  std::vector<double> values;
  std::vector<int64_t> indices;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t oh = 0; oh < OH; ++oh)
        for (int64_t ow = 0; ow < OW; ++ow) {
          double best = -std::numeric_limits<double>::infinity();
          int64_t best_index = -1;
          for (int64_t i = 0; i < k[0]; ++i)
            for (int64_t j = 0; j < k[1]; ++j) {
              const int64_t h = oh * s[0] - o.padding[0] + i * o.dilation[0];
              const int64_t w = ow * s[1] - o.padding[1] + j * o.dilation[1];
              if (h < 0 || h >= H || w < 0 || w >= W) continue;
              const double v = in.at(n, c, h, w);
              if (best_index < 0 || v > best || std::isnan(v)) {
                best = v;
                best_index = h * W + w;
              }
            }
          values.push_back(best);
          indices.push_back(best_index);
        }
  return {values, indices};
}

// avg_pool2d by PyTorch's definition: the window clipped to the padded input counts with
// count_include_pad, only the real elements without; divisor_override replaces either.
std::vector<double> reference_avg_pool(const Tensor& x, Pair2d k, const AvgPool2dOptions& o, Shape& shape) {
  Plane in(x);
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  Pair2d s = o.stride[0] == 0 && o.stride[1] == 0 ? k : o.stride;
  const int64_t OH = out_size(H, k[0], s[0], o.padding[0], 1, o.ceil_mode);
  const int64_t OW = out_size(W, k[1], s[1], o.padding[1], 1, o.ceil_mode);
  shape = {N, C, OH, OW};
  std::vector<double> values;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t oh = 0; oh < OH; ++oh)
        for (int64_t ow = 0; ow < OW; ++ow) {
          double sum = 0;
          int64_t real = 0, padded = 0;
          for (int64_t i = 0; i < k[0]; ++i)
            for (int64_t j = 0; j < k[1]; ++j) {
              const int64_t h = oh * s[0] - o.padding[0] + i, w = ow * s[1] - o.padding[1] + j;
              if (h >= H + o.padding[0] || w >= W + o.padding[1]) continue;  // beyond the padded input
              ++padded;
              if (h < 0 || h >= H || w < 0 || w >= W) continue;
              ++real;
              sum += in.at(n, c, h, w);
            }
          values.push_back(sum / double(o.divisor_override ? *o.divisor_override
                                                           : o.count_include_pad ? padded : real));
        }
  return values;
}

std::vector<double> reference_adaptive_avg_pool(const Tensor& x, Pair2d size) {
  Plane in(x);
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  std::vector<double> values;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t oh = 0; oh < size[0]; ++oh)
        for (int64_t ow = 0; ow < size[1]; ++ow) {
          const auto h0 = int64_t(std::floor(double(oh * H) / double(size[0])));
          const auto h1 = int64_t(std::ceil(double((oh + 1) * H) / double(size[0])));
          const auto w0 = int64_t(std::floor(double(ow * W) / double(size[1])));
          const auto w1 = int64_t(std::ceil(double((ow + 1) * W) / double(size[1])));
          double sum = 0;
          for (int64_t h = h0; h < h1; ++h)
            for (int64_t w = w0; w < w1; ++w) sum += in.at(n, c, h, w);
          values.push_back(sum / double((h1 - h0) * (w1 - w0)));
        }
  return values;
}

// Pooled values against the reference: max is exact (a selection); means of a few values in float64 /
// float32 are within rounding, the half types within the final rounding (2^-11, 2^-8 relative) plus the
// input's own rounding, which the reference reads too.
void check_values(const Tensor& got, const std::vector<double>& want, DType dt) {
  const double rtol = dt == kFloat64 ? 1e-14 : dt == kFloat32 ? 1e-6 : dt == kFloat16 ? 1e-3 : 8e-3;
  std::vector<double> g = to_vector<double>(got);
  REQUIRE(g.size() == want.size());
  int bad = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    bool same = (std::isnan(g[i]) && std::isnan(want[i])) || std::abs(g[i] - want[i]) <= rtol * (1 + std::abs(want[i]));
    if (!same && bad++ < 3) FAIL_CHECK("element " << i << ": got " << g[i] << ", reference " << want[i]);
  }
  CHECK(bad == 0);
}

struct MaxCase {
  std::string name;
  Shape input;
  Pair2d kernel;
  MaxPool2dOptions options;
};
const std::vector<MaxCase> kMaxCases = {
    {"2x2", {2, 3, 6, 8}, {2, 2}, {}},
    {"3x3 stride 2 padding 1 (ResNet stem)", {2, 3, 9, 8}, {3, 3}, {.stride = {2, 2}, .padding = {1, 1}}},
    {"2x3 stride (1, 2)", {1, 2, 5, 7}, {2, 3}, {.stride = {1, 2}}},
    {"dilation 2, padding 1", {2, 2, 9, 9}, {3, 3}, {.stride = {1, 1}, .padding = {1, 1}, .dilation = {2, 2}}},
    {"ceil_mode", {2, 2, 7, 6}, {2, 2}, {.ceil_mode = true}},
    {"ceil_mode with padding", {1, 2, 6, 7}, {3, 3}, {.stride = {2, 2}, .padding = {1, 1}, .ceil_mode = true}},
    {"window as large as the input", {2, 3, 4, 5}, {4, 5}, {}},
};

struct AvgCase {
  std::string name;
  Shape input;
  Pair2d kernel;
  AvgPool2dOptions options;
};
const std::vector<AvgCase> kAvgCases = {
    {"2x2", {2, 3, 6, 8}, {2, 2}, {}},
    {"3x3 stride 1 padding 1", {2, 2, 5, 6}, {3, 3}, {.stride = {1, 1}, .padding = {1, 1}}},
    {"3x3 stride 1 padding 1 without pad counts", {2, 2, 5, 6}, {3, 3},
     {.stride = {1, 1}, .padding = {1, 1}, .count_include_pad = false}},
    {"2x4 stride (2, 3) padding (1, 2)", {1, 2, 7, 9}, {2, 4}, {.stride = {2, 3}, .padding = {1, 2}}},
    {"ceil_mode", {2, 2, 7, 5}, {2, 2}, {.ceil_mode = true}},
    {"ceil_mode, padding, without pad counts", {1, 2, 6, 7}, {3, 3},
     {.stride = {2, 2}, .padding = {1, 1}, .ceil_mode = true, .count_include_pad = false}},
    {"ceil_mode, padding, with pad counts", {1, 2, 6, 7}, {3, 3},
     {.stride = {2, 2}, .padding = {1, 1}, .ceil_mode = true, .count_include_pad = true}},
    {"divisor_override, padding, ceil_mode", {1, 2, 6, 7}, {3, 3},
     {.stride = {2, 2}, .padding = {1, 1}, .ceil_mode = true, .divisor_override = 4}},
    {"negative divisor_override", {2, 2, 5, 6}, {2, 3}, {.stride = {1, 2}, .divisor_override = -3}},
};

const std::vector<std::pair<Shape, Pair2d>> kAdaptiveCases = {
    {{2, 3, 8, 8}, {1, 1}},   // global average pooling
    {{2, 3, 8, 8}, {2, 4}},   // exact tiling
    {{1, 2, 5, 7}, {3, 4}},   // overlapping cells: 5 -> 3 gives [0, 2), [1, 4), [3, 5)
    {{1, 2, 3, 4}, {5, 6}},   // more cells than input rows: cells repeat elements
    {{2, 2, 7, 7}, {7, 7}},   // identity
};

}  // namespace

TEST_CASE("max_pool2d matches a float64 reference, with the argmax indices, in every float dtype") {
  manual_seed(41);
  for (DType dt : kFloatTypes) {
    for (const MaxCase& c : kMaxCases) {
      INFO("dtype: " << dtype_name(dt));
      INFO("case: " << c.name);
      Tensor x = random(c.input, dt);
      Shape shape;
      auto [values, indices] = reference_max_pool(x, c.kernel, c.options, shape);
      auto [y, idx] = max_pool2d_with_indices(x, c.kernel, c.options);
      REQUIRE(y.shape() == shape);
      CHECK(y.dtype() == dt);
      CHECK(idx.dtype() == kInt64);
      CHECK(to_vector<double>(y) == values);  // a selection: exact
      CHECK(to_vector<int64_t>(idx) == indices);
      CHECK(to_vector<double>(max_pool2d(x, c.kernel, c.options)) == values);
    }
  }
}

TEST_CASE("max_pool2d: hand-computed values, first index on ties, nan propagates, -inf windows") {
  Tensor x = arange(16, {.dtype = kFloat32}).reshape({1, 1, 4, 4});
  CHECK(to_vector<float>(max_pool2d(x, {2, 2})) == std::vector<float>{5, 7, 13, 15});
  auto [y, idx] = max_pool2d_with_indices(x, {3, 3}, {.stride = {2, 2}, .padding = {1, 1}});
  CHECK(to_vector<float>(y) == std::vector<float>{5, 7, 13, 15});
  CHECK(to_vector<int64_t>(idx) == std::vector<int64_t>{5, 7, 13, 15});

  // Ties: the gradient goes to the first maximum in the window (row-major), once.
  Tensor t = ones({1, 1, 2, 2}).requires_grad_();
  max_pool2d(t, {2, 2}).sum().backward();
  CHECK(to_vector<float>(t.grad()) == std::vector<float>{1, 0, 0, 0});

  float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  Tensor with_nan = tensor<float>({1, nan, 3, 2}, {1, 1, 2, 2});
  auto [yn, in] = max_pool2d_with_indices(with_nan, {2, 2});
  CHECK(std::isnan(to_vector<float>(yn)[0]));
  CHECK(to_vector<int64_t>(in)[0] == 1);
  Tensor all_minus_inf = full({1, 1, 2, 2}, -inf);
  auto [ym, im] = max_pool2d_with_indices(all_minus_inf, {2, 2});
  CHECK(to_vector<float>(ym)[0] == -inf);
  CHECK(to_vector<int64_t>(im)[0] == 0);
}

TEST_CASE("avg_pool2d matches a float64 reference for padding, ceil_mode and count_include_pad") {
  manual_seed(42);
  for (DType dt : kFloatTypes) {
    for (const AvgCase& c : kAvgCases) {
      INFO("dtype: " << dtype_name(dt));
      INFO("case: " << c.name);
      Tensor x = random(c.input, dt);
      Shape shape;
      std::vector<double> want = reference_avg_pool(x, c.kernel, c.options, shape);
      Tensor y = avg_pool2d(x, c.kernel, c.options);
      REQUIRE(y.shape() == shape);
      CHECK(y.dtype() == dt);
      check_values(y, want, dt);
    }
  }
}

TEST_CASE("avg_pool2d: hand-computed values with and without counting the padding, and with divisor_override") {
  Tensor x = ones({1, 1, 3, 3});
  // 3x3 windows with padding 1 over ones: a corner window covers 4 real elements of 9.
  std::vector<float> with_pad = to_vector<float>(avg_pool2d(x, {3, 3}, {.stride = {1, 1}, .padding = {1, 1}}));
  CHECK(with_pad[0] == doctest::Approx(4.0 / 9.0));
  CHECK(with_pad[1] == doctest::Approx(6.0 / 9.0));
  CHECK(with_pad[4] == doctest::Approx(1.0));
  std::vector<float> without =
      to_vector<float>(avg_pool2d(x, {3, 3}, {.stride = {1, 1}, .padding = {1, 1}, .count_include_pad = false}));
  for (float v : without) CHECK(v == doctest::Approx(1.0));
  Tensor a = arange(16, {.dtype = kFloat32}).reshape({1, 1, 4, 4});
  CHECK(to_vector<float>(avg_pool2d(a, {2, 2})) == std::vector<float>{2.5, 4.5, 10.5, 12.5});
  // divisor_override divides every window's sum by itself, padding or not: the corner's 4 ones by 2.
  Tensor over = avg_pool2d(x.requires_grad_(), {3, 3}, {.stride = {1, 1}, .padding = {1, 1}, .divisor_override = 2});
  CHECK(to_vector<float>(over) == std::vector<float>{2, 3, 2, 3, 4.5, 3, 2, 3, 2});
  over.sum().backward();
  CHECK(to_vector<float>(x.grad()) == std::vector<float>{2, 3, 2, 3, 4.5, 3, 2, 3, 2});  // 4, 6 or 9 windows, / 2
  CHECK(contains(error_of([&] { avg_pool2d(x, {3, 3}, {.divisor_override = 0}); }),
                 "avg_pool2d: divisor_override must not be 0"));
}

TEST_CASE("adaptive_avg_pool2d matches PyTorch's start/end windows") {
  manual_seed(43);
  for (DType dt : kFloatTypes) {
    for (const auto& [shape, size] : kAdaptiveCases) {
      INFO("dtype: " << dtype_name(dt));
      CAPTURE(shape_str(shape));
      Tensor x = random(shape, dt);
      Tensor y = adaptive_avg_pool2d(x, size);
      CHECK(y.shape() == Shape{shape[0], shape[1], size[0], size[1]});
      check_values(y, reference_adaptive_avg_pool(x, size), dt);
    }
  }
  // 5 -> 3 cells: [0, 2), [1, 4), [3, 5).
  Tensor r = tensor<float>({0, 1, 2, 3, 4}, {1, 1, 1, 5});
  CHECK(to_vector<float>(adaptive_avg_pool2d(r, {1, 3})) == std::vector<float>{0.5, 2, 3.5});
  // Global pooling equals the mean.
  Tensor g = randn({2, 3, 5, 5});
  std::vector<float> pooled = to_vector<float>(adaptive_avg_pool2d(g, {1, 1}).flatten());
  std::vector<float> mean = to_vector<float>(g.mean({2, 3}).flatten());
  REQUIRE(pooled.size() == mean.size());
  for (size_t i = 0; i < pooled.size(); ++i) CHECK(pooled[i] == doctest::Approx(mean[i]).epsilon(1e-5));
}

TEST_CASE("pooling keeps the channels_last format, reads strided inputs, and takes unbatched inputs") {
  manual_seed(44);
  for (DType dt : {kFloat32, kFloat16}) {
    INFO("dtype: " << dtype_name(dt));
    Tensor x = random({2, 3, 8, 7}, dt);
    Tensor cl = contiguous_channels_last(x);
    Tensor sliced = random({2, 3, 16, 7}, dt).slice(2, 0, 16, 2);
    auto same = [](const Tensor& a, const Tensor& b) { return to_vector<double>(a) == to_vector<double>(b); };

    Tensor m = max_pool2d(cl, {3, 3}, {.stride = {2, 2}, .padding = {1, 1}});
    CHECK(is_channels_last(m));
    CHECK(same(m, max_pool2d(x, {3, 3}, {.stride = {2, 2}, .padding = {1, 1}})));
    Tensor a = avg_pool2d(cl, {2, 2});
    CHECK(is_channels_last(a));
    CHECK(same(a, avg_pool2d(x, {2, 2})));
    Tensor g = adaptive_avg_pool2d(cl, {3, 2});
    CHECK(is_channels_last(g));
    CHECK(same(g, adaptive_avg_pool2d(x, {3, 2})));

    CHECK(same(max_pool2d(sliced, {2, 2}), max_pool2d(sliced.contiguous(), {2, 2})));
    CHECK(same(avg_pool2d(sliced, {2, 2}), avg_pool2d(sliced.contiguous(), {2, 2})));
    CHECK(same(adaptive_avg_pool2d(sliced, {2, 2}), adaptive_avg_pool2d(sliced.contiguous(), {2, 2})));

    Tensor unbatched = random({3, 6, 6}, dt);
    CHECK(max_pool2d(unbatched, {2, 2}).shape() == Shape{3, 3, 3});
    CHECK(same(avg_pool2d(unbatched, {2, 2}), avg_pool2d(unbatched.unsqueeze(0), {2, 2}).squeeze(0)));
    CHECK(adaptive_avg_pool2d(unbatched, {1, 1}).shape() == Shape{3, 1, 1});
  }
}

TEST_CASE("pooling errors name the op and the shapes") {
  Tensor x = randn({2, 3, 8, 8});
  std::string e = error_of([&] { max_pool2d(x, {2, 2}, {.padding = {2, 2}}); });
  CHECK(contains(e, "max_pool2d"));
  CHECK(contains(e, "at most half the kernel size"));
  CHECK(contains(e, "[2, 3, 8, 8]"));
  e = error_of([&] { max_pool2d(randn({2, 3, 2, 2}), {3, 3}); });
  CHECK(contains(e, "max_pool2d"));
  CHECK(contains(e, "larger than the input"));
  CHECK(contains(e, "[2, 3, 2, 2]"));
  e = error_of([&] { avg_pool2d(randn({8, 8}), {2, 2}); });
  CHECK(contains(e, "avg_pool2d"));
  CHECK(contains(e, "4-D"));
  CHECK(contains(e, "[8, 8]"));
  e = error_of([&] { adaptive_avg_pool2d(x.to(kInt64), {1, 1}); });
  CHECK(contains(e, "adaptive_avg_pool2d"));
  CHECK(contains(e, "floating-point"));
  CHECK(contains(error_of([&] { max_pool2d(x, {0, 2}); }), "kernel size must be positive"));
  CHECK(contains(error_of([&] { avg_pool2d(x, {2, 2}, {.stride = {2, -1}}); }), "stride must be positive"));
  CHECK(contains(error_of([&] { adaptive_avg_pool2d(x, {-1, 2}); }), "non-negative"));
  CHECK(contains(error_of([&] { max_pool2d(randn({2, 3, 0, 4}), {1, 1}); }), "non-empty"));
  // An unbatched input's error names it, not the batch of one it runs as.
  e = error_of([&] { max_pool2d(randn({2, 3, 3}), {5, 5}); });
  CHECK(contains(e, "larger than the input float32[2, 3, 3]"));
  CHECK_FALSE(contains(e, "[1, 2, 3, 3]"));
  CHECK(contains(error_of([&] { avg_pool2d(randn({2, 3, 3}).to(kInt32), {2, 2}); }), "int32[2, 3, 3]"));
  CHECK(contains(error_of([&] { adaptive_avg_pool2d(randn({2, 3, 3}), {-1, 2}); }), "float32[2, 3, 3]"));
  // A dilation whose window would overflow 64 bits gave an 8-row output of -inf: refused, as PyTorch refuses it.
  const Tensor tall = arange(16, {.dtype = kFloat32}).reshape({1, 1, 4, 4});
  const MaxPool2dOptions huge{.stride = {1, 1}, .padding = {2, 0}, .dilation = {int64_t(1) << 62, 1}};
  CHECK(contains(error_of([&] { max_pool2d(tall, {5, 1}, huge); }),
                 "max_pool2d: kernel size (5, 1), stride (1, 1), padding (2, 0) and dilation (4611686018427387904, 1) "
                 "must each be below 2^31"));
}

TEST_CASE("pooling gradients pass gradcheck") {
  manual_seed(45);
  for (const MaxCase& c : kMaxCases) {
    INFO("case: " << c.name);
    gradcheck([&](const TensorList& in) { return max_pool2d(in[0], c.kernel, c.options); }, {leaf(c.input)});
  }
  for (const AvgCase& c : kAvgCases) {
    INFO("case: " << c.name);
    gradcheck([&](const TensorList& in) { return avg_pool2d(in[0], c.kernel, c.options); }, {leaf(c.input)});
  }
  for (const auto& [shape, size] : kAdaptiveCases) {
    CAPTURE(shape_str(shape));
    gradcheck([&](const TensorList& in) { return adaptive_avg_pool2d(in[0], size); }, {leaf(shape)});
  }
  // Through a channels_last view of the input.
  gradcheck([](const TensorList& in) { return max_pool2d(contiguous_channels_last(in[0]), {2, 2}); },
            {leaf({2, 3, 4, 6})});
  gradcheck([](const TensorList& in) { return avg_pool2d(contiguous_channels_last(in[0]), {3, 3}, {.padding = {1, 1}}); },
            {leaf({2, 3, 5, 4})});
  gradcheck([](const TensorList& in) { return adaptive_avg_pool2d(contiguous_channels_last(in[0]), {2, 3}); },
            {leaf({2, 3, 5, 4})});
}

TEST_CASE("pooling gradients in float16 and bfloat16 accumulate in float32") {
  // adaptive_avg_pool2d to 1x1 over 1x1 cells repeated: each input element of a 1-row input pooled into
  // 4096 overlapping cells receives 4096 * (1/1) — with cells of one element, every share is exact.
  for (DType dt : {kFloat16, kBFloat16}) {
    INFO("dtype: " << dtype_name(dt));
    Tensor x = ones({1, 1, 1, 1}, {.dtype = dt}).requires_grad_();
    adaptive_avg_pool2d(x, {64, 64}).sum().backward();  // 4096 cells, each the single input element
    CHECK(to_vector<double>(x.grad())[0] == 4096.0);
  }
}

// ---- CUDA against the CPU

TEST_CASE("cuda: pooling forward and backward match the CPU in every dtype, NCHW and channels_last") {
  SKIP_WITHOUT_GPU();
  manual_seed(46);
  const Device gpu = Device::cuda(0);
  // Max is a selection, exact; means differ by summation order only: a few float32 ulps, or one
  // rounding of the half types.
  auto tolerance = [](DType dt) { return dt == kFloat64 ? 1e-12 : dt == kFloat32 ? 1e-5 : dt == kFloat16 ? 2e-3 : 1.6e-2; };
  auto check_close = [&](const Tensor& got, const Tensor& want, DType dt, const char* what) {
    INFO(what);
    REQUIRE(got.is_cuda());
    REQUIRE(got.shape() == want.shape());
    std::vector<double> a = to_vector<double>(got), b = to_vector<double>(want);
    int bad = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      if (!(std::abs(a[i] - b[i]) <= tolerance(dt) * (1 + std::abs(b[i]))) && bad++ < 3) {
        FAIL_CHECK("element " << i << ": cuda " << a[i] << " vs cpu " << b[i]);
      }
    }
    CHECK(bad == 0);
  };
  // Runs op on the CPU and the GPU with the same input and output gradient, compares output and gradient.
  auto compare = [&](const std::function<Tensor(const Tensor&)>& op, const Shape& shape, DType dt, MemoryFormat format) {
    Tensor x = contiguous(random(shape, dt), format);
    Tensor xc = x.detach().requires_grad_();
    Tensor yc = op(xc);
    Tensor gy = random(yc.shape(), dt);
    yc.backward(gy);
    Tensor xg = contiguous(x.to(gpu), format).detach().requires_grad_();
    Tensor yg = op(xg);
    CHECK(suggest_memory_format(yg) == suggest_memory_format(yc));
    yg.backward(gy.to(gpu));
    check_close(yg, yc, dt, "output");
    check_close(xg.grad(), xc.grad(), dt, "grad input");
  };
  for (DType dt : kFloatTypes) {
    for (MemoryFormat format : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
      INFO("dtype: " << dtype_name(dt));
      INFO("format: " << memory_format_name(format));
      for (const MaxCase& c : kMaxCases) {
        INFO("case: " << c.name);
        compare([&](const Tensor& x) { return max_pool2d(x, c.kernel, c.options); }, c.input, dt, format);
        Tensor x = random(c.input, dt);
        auto [yc, ic] = max_pool2d_with_indices(x, c.kernel, c.options);
        auto [yg, ig] = max_pool2d_with_indices(contiguous(x.to(gpu), format), c.kernel, c.options);
        CHECK(to_vector<int64_t>(ig) == to_vector<int64_t>(ic));
      }
      for (const AvgCase& c : kAvgCases) {
        INFO("case: " << c.name);
        compare([&](const Tensor& x) { return avg_pool2d(x, c.kernel, c.options); }, c.input, dt, format);
      }
      for (const auto& [shape, size] : kAdaptiveCases) {
        CAPTURE(shape_str(shape));
        compare([&](const Tensor& x) { return adaptive_avg_pool2d(x, size); }, shape, dt, format);
      }
      // ResNet sizes: the stem's max pool and the global average pool, batch 32.
      compare([](const Tensor& x) { return max_pool2d(x, {3, 3}, {.stride = {2, 2}, .padding = {1, 1}}); },
              {32, 64, 32, 32}, dt, format);
      compare([](const Tensor& x) { return adaptive_avg_pool2d(x, {1, 1}); }, {32, 512, 4, 4}, dt, format);
    }
  }
}

// Global average pooling's backward has a kernel of its own (16-byte vectors of dx, ops/pool.cu) where H W (NCHW)
// or C (NHWC) is a whole number of vectors: every element is dy[n, c] / (H W), whatever dy's strides.
TEST_CASE("cuda: global average pooling's backward gives every element dy / (H W), NCHW and NHWC, any dy strides") {
  SKIP_WITHOUT_GPU();
  manual_seed(47);
  const Device gpu = Device::cuda(0);
  for (DType dt : kFloatTypes) {
    for (MemoryFormat format : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
      CAPTURE(std::string(dtype_name(dt)));
      CAPTURE(memory_format_name(format));
      Tensor x = contiguous(random({4, 16, 3, 8}, dt).to(gpu), format).detach().requires_grad_();
      const Tensor wide = random({4, 40}, dt).to(gpu);
      const Tensor dy = wide.narrow(1, 5, 16).view({4, 16, 1, 1});  // row stride 40
      adaptive_avg_pool2d(x, {1, 1}).backward(dy);
      CHECK(suggest_memory_format(x.grad()) == format);
      const std::vector<double> got = to_vector<double>(x.grad()), share = to_vector<double>(dy.to(kFloat64) / 24.0);
      const double tol = dt == kFloat64 ? 1e-15 : dt == kFloat32 ? 1e-7 : dt == kFloat16 ? 1e-3 : 8e-3;
      int bad = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        const double want = share[i / 24];  // [4, 16, 3, 8] in NCHW order: 24 elements a channel
        if (!(std::abs(got[i] - want) <= tol * std::abs(want)) && bad++ < 3)
          FAIL_CHECK("element " << i << ": " << got[i] << " vs " << want);
      }
    }
  }
}

// ---- the window positions max_pool2d keeps for its backward (ops/pool.h: one byte an output, not an int64 index)

namespace {

// What max_pool2d's kernel writes into a uint8 tensor on `device`: each maximum's position within its window.
std::vector<int64_t> window_positions(const Tensor& x, Pair2d kernel, const MaxPool2dOptions& o, Device device) {
  const Pair2d stride = o.stride == Pair2d{0, 0} ? kernel : o.stride;
  const Pool2dParams p{.kernel = kernel, .stride = stride, .padding = o.padding, .dilation = o.dilation};
  const Tensor y = max_pool2d(x, kernel, o);  // the output's shape and layout
  Tensor positions = contiguous(zeros(y.shape(), {.dtype = kUInt8, .device = device}), suggest_memory_format(y));
  Tensor out = contiguous(empty_like(y), suggest_memory_format(y));  // the layout the op gives: the tiled path's
  max_pool2d_kernel[device](out, positions, x, p);
  return to_vector<int64_t>(positions);
}

// The positions the flat indices of the reference stand for: (h - (oh s - p)) / d rows and so many columns in.
std::vector<int64_t> positions_of(const Tensor& x, Pair2d kernel, const MaxPool2dOptions& o) {
  const Pair2d stride = o.stride == Pair2d{0, 0} ? kernel : o.stride;
  Shape shape;
  const std::vector<int64_t> flat = reference_max_pool(x, kernel, o, shape).second;
  const int64_t W = x.size(3), OH = shape[2], OW = shape[3];
  std::vector<int64_t> positions;
  for (size_t i = 0; i < flat.size(); ++i) {
    const int64_t ow = int64_t(i) % OW, oh = (int64_t(i) / OW) % OH;
    const int64_t kh = (flat[i] / W - (oh * stride[0] - o.padding[0])) / o.dilation[0];
    const int64_t kw = (flat[i] % W - (ow * stride[1] - o.padding[1])) / o.dilation[1];
    positions.push_back(kh * kernel[1] + kw);
  }
  return positions;
}

}  // namespace

TEST_CASE("max_pool2d keeps each maximum's window position for its backward: exact positions, the same gradients") {
  manual_seed(48);
  for (DType dt : kFloatTypes) {
    for (const MaxCase& c : kMaxCases) {
      INFO("dtype: " << dtype_name(dt));
      INFO("case: " << c.name);
      // Values from a few integers: ties in most windows, where the first maximum is the one kept.
      Tensor x = randint(-3, 4, c.input, {.dtype = dt});
      CHECK(window_positions(x, c.kernel, c.options, Device::cpu()) == positions_of(x, c.kernel, c.options));
      // Backward from the positions (max_pool2d) and from the flat indices (max_pool2d_with_indices): the same.
      Tensor a = x.detach().requires_grad_(), b = x.detach().requires_grad_();
      Tensor g = random(max_pool2d(x, c.kernel, c.options).shape(), dt);
      max_pool2d(a, c.kernel, c.options).backward(g);
      max_pool2d_with_indices(b, c.kernel, c.options).first.backward(g);
      CHECK(to_vector<double>(a.grad()) == to_vector<double>(b.grad()));
    }
  }
  // A window of 256 elements, one more than kMaxWindowPositions: flat indices are kept, with the same result.
  Tensor x = random({2, 3, 16, 16}, kFloat32).requires_grad_();
  max_pool2d(x, {16, 16}).sum().backward();
  Shape shape;
  const std::vector<int64_t> argmax = reference_max_pool(x.detach(), {16, 16}, {}, shape).second;
  const std::vector<double> grad = to_vector<double>(x.grad());
  for (int64_t plane = 0; plane < 6; ++plane) {
    for (int64_t i = 0; i < 256; ++i) CHECK(grad[size_t(plane * 256 + i)] == (i == argmax[size_t(plane)] ? 1.0 : 0.0));
  }
}

TEST_CASE("max_pool2d: a window that holds no input element gives -inf and passes no gradient, on every device") {
  // W = 1, padding 1 and dilation 2: the window's two columns are -1 and 1, both outside the input.
  const MaxPool2dOptions o{.stride = {1, 1}, .padding = {0, 1}, .dilation = {1, 2}};
  std::vector<Device> devices{Device::cpu()};
  if (cuda::device_count() > 0) devices.push_back(Device::cuda(0));
  for (Device device : devices) {
    CAPTURE(device.str());
    Tensor x = tensor<float>({1, 2, 3}, {1, 1, 3, 1}).to(device).requires_grad_();
    Tensor y = max_pool2d(x, {1, 2}, o);
    for (double v : to_vector<double>(y)) CHECK(v == -std::numeric_limits<double>::infinity());
    y.backward(full(y.shape(), 10.0, {.device = device}));
    CHECK(to_vector<double>(x.grad()) == std::vector<double>{0, 0, 0});
    CHECK(window_positions(x.detach(), {1, 2}, o, device) == std::vector<int64_t>{255, 255, 255});
  }
}

TEST_CASE("cuda: max pooling over windows that tile a channels-last input: its vector kernels give the CPU's results") {
  SKIP_WITHOUT_GPU();
  manual_seed(49);
  const Device gpu = Device::cuda(0);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Tiled {
    std::string name;
    Shape input;
    Pair2d kernel;
  };
  // The first three tile (C a whole number of 16-byte vectors in every dtype); the others take the general kernels:
  // 3 channels, a row left over, and a window that does not tile.
  const std::vector<Tiled> cases = {{"2x2 (VGG)", {4, 64, 8, 8}, {2, 2}},
                                    {"one image", {1, 32, 4, 6}, {2, 2}},
                                    {"3x2", {3, 16, 6, 4}, {3, 2}},
                                    {"1x1", {2, 8, 3, 3}, {1, 1}},
                                    {"3 channels", {2, 3, 8, 8}, {2, 2}},
                                    {"7 rows", {2, 16, 7, 8}, {2, 2}}};
  for (DType dt : kFloatTypes) {
    for (const Tiled& c : cases) {
      INFO("dtype: " << dtype_name(dt));
      INFO("case: " << c.name);
      Tensor x = randint(-3, 4, c.input, {.dtype = kFloat64});  // ties
      {
        NoGradGuard no_grad;
        x.view({-1}).narrow(0, 5, 1).fill_(nan);  // a nan in one window: it is the maximum
      }
      x = contiguous(x.to(dt), MemoryFormat::ChannelsLast);
      const Tensor xg = contiguous(x.to(gpu), MemoryFormat::ChannelsLast);
      CHECK(window_positions(xg, c.kernel, {}, gpu) == window_positions(x, c.kernel, {}, Device::cpu()));
      Tensor a = x.detach().requires_grad_(), b = xg.detach().requires_grad_();
      const Tensor ya = max_pool2d(a, c.kernel), yb = max_pool2d(b, c.kernel);
      CHECK(is_channels_last(yb));
      const std::vector<double> va = to_vector<double>(ya), vb = to_vector<double>(yb);
      REQUIRE(va.size() == vb.size());
      for (size_t i = 0; i < va.size(); ++i) CHECK(((std::isnan(va[i]) && std::isnan(vb[i])) || va[i] == vb[i]));
      const Tensor g = contiguous(random(ya.shape(), dt), MemoryFormat::ChannelsLast);
      ya.backward(g);
      yb.backward(contiguous(g.to(gpu), MemoryFormat::ChannelsLast));
      CHECK(to_vector<double>(b.grad()) == to_vector<double>(a.grad()));
      // an NCHW gradient: the general backward kernel reads the positions the vector forward wrote
      Tensor xn = xg.detach().requires_grad_();
      max_pool2d(xn, c.kernel).backward(g.contiguous().to(gpu));
      CHECK(to_vector<double>(xn.grad()) == to_vector<double>(a.grad()));
    }
  }
  // Dense channels-last data that is not 16-byte aligned (one element into its buffer): the general kernels.
  Tensor buffer = random({4 * 8 * 8 * 64 + 1}, kFloat16).to(gpu);
  Tensor x = buffer.narrow(0, 1, 4 * 8 * 8 * 64).view({4, 8, 8, 64}).permute({0, 3, 1, 2}).requires_grad_();
  REQUIRE(is_channels_last(x));
  Tensor xc = x.detach().cpu().requires_grad_();
  max_pool2d(x, {2, 2}).sum().backward();
  max_pool2d(xc, {2, 2}).sum().backward();
  CHECK(to_vector<double>(max_pool2d(x, {2, 2})) == to_vector<double>(max_pool2d(xc, {2, 2})));
  CHECK(to_vector<double>(x.grad()) == to_vector<double>(xc.grad()));
}

// conv2d: values against a naive float64 loop for every option and dtype, memory layouts (strided inputs,
// channels_last), errors, gradchecks of every input, the half-precision accumulation, autocast, and CUDA
// against the CPU (skipped without a GPU).
#include <doctest/doctest.h>
#include <spdlog/sinks/ostream_sink.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "core/autocast.h"
#include "core/cuda.h"
#include "halfgrad.h"
#include "tests/testing.h"
#include "ops/conv.h"
#include "ops/conv_few_channels.h"
#include "tests/gradcheck.h"

using namespace halfgrad;
using namespace halfgrad::testing;
using halfgrad::testing::gradcheck;
using halfgrad::testing::leaf;

namespace {

// float64 convolutions sum longer runs of products than the matrix products' tests: 1e-12 of the magnitude.
constexpr double kFloat64Tolerance = 1e-12;

// torch.nn.functional.conv2d computed the obvious way, in float64, from the operands' values. Also returns,
// per output element, sum |x| |w| (+ |b|): the scale that a floating-point dot product's rounding error is
// relative to.
Reference reference_conv2d(const Tensor& x, const Tensor& w, const Tensor& b, const Conv2dOptions& o) {
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const int64_t O = w.size(0), Cg = w.size(1), kH = w.size(2), kW = w.size(3);
  const int64_t Og = O / o.groups;
  const int64_t OH = (H + 2 * o.padding[0] - o.dilation[0] * (kH - 1) - 1) / o.stride[0] + 1;
  const int64_t OW = (W + 2 * o.padding[1] - o.dilation[1] * (kW - 1) - 1) / o.stride[1] + 1;
  std::vector<double> xv = to_vector<double>(x), wv = to_vector<double>(w);
  std::vector<double> bv = b.defined() ? to_vector<double>(b) : std::vector<double>(size_t(O), 0.0);
  Reference r;
  r.shape = {N, O, OH, OW};
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t oc = 0; oc < O; ++oc) {
      const int64_t group = oc / Og;
      for (int64_t oh = 0; oh < OH; ++oh) {
        for (int64_t ow = 0; ow < OW; ++ow) {
          double sum = bv[size_t(oc)], mag = std::abs(bv[size_t(oc)]);
          for (int64_t c = 0; c < Cg; ++c) {
            const int64_t ic = group * Cg + c;
            for (int64_t kh = 0; kh < kH; ++kh) {
              for (int64_t kw = 0; kw < kW; ++kw) {
                const int64_t ih = oh * o.stride[0] - o.padding[0] + kh * o.dilation[0];
                const int64_t iw = ow * o.stride[1] - o.padding[1] + kw * o.dilation[1];
                if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
                const double p = xv[size_t(((n * C + ic) * H + ih) * W + iw)] *
                                 wv[size_t(((oc * Cg + c) * kH + kh) * kW + kw)];
                sum += p;
                mag += std::abs(p);
              }
            }
          }
          r.values.push_back(sum);
          r.magnitude.push_back(mag);
        }
      }
    }
  }
  return r;
}

// One convolution problem: input shape, weight shape, options, bias or not.
struct Case {
  std::string name;
  Shape input, weight;
  Conv2dOptions options;
  bool bias = true;
};

const std::vector<Case> kCases = {
    {"3x3, defaults", {2, 3, 7, 6}, {4, 3, 3, 3}, {}},
    {"3x3, padding 1 (same size)", {2, 3, 6, 6}, {5, 3, 3, 3}, {.padding = {1, 1}}},
    {"stride (2, 1), padding (1, 2)", {2, 3, 9, 7}, {4, 3, 3, 3}, {.stride = {2, 1}, .padding = {1, 2}}},
    {"stride 3 with a 2x4 kernel", {1, 2, 10, 11}, {3, 2, 2, 4}, {.stride = {3, 3}}},
    {"dilation (2, 3), padding (2, 1)", {2, 3, 9, 10}, {4, 3, 3, 3}, {.padding = {2, 1}, .dilation = {2, 3}}},
    {"groups 2", {2, 4, 6, 5}, {6, 2, 3, 3}, {.padding = {1, 1}, .groups = 2}},
    {"depthwise (groups = channels)", {2, 4, 6, 6}, {4, 1, 3, 3}, {.padding = {1, 1}, .groups = 4}},
    {"depthwise, channel multiplier 2", {2, 3, 5, 6}, {6, 1, 3, 3}, {.stride = {2, 2}, .groups = 3}},
    {"1x1 (the input is the column matrix)", {3, 5, 4, 3}, {7, 5, 1, 1}, {}},
    {"1x1, stride 2 (downsample)", {2, 5, 7, 6}, {4, 5, 1, 1}, {.stride = {2, 2}}},
    {"1x1 with padding", {2, 3, 4, 4}, {2, 3, 1, 1}, {.padding = {1, 1}}},
    {"kernel as large as the padded input", {2, 2, 3, 4}, {3, 2, 5, 6}, {.padding = {1, 1}}},
    {"no bias", {2, 3, 6, 6}, {4, 3, 3, 3}, {.stride = {2, 2}, .padding = {1, 1}}, false},
    {"no bias, groups and dilation", {2, 6, 8, 8}, {6, 2, 3, 3}, {.padding = {2, 2}, .dilation = {2, 2}, .groups = 3},
     false},
    {"more samples than threads", {9, 4, 12, 12}, {8, 4, 3, 3}, {.padding = {1, 1}}},
};

}  // namespace

TEST_CASE("conv2d matches a float64 reference for stride, padding, dilation, groups and bias in every float dtype") {
  manual_seed(21);
  for (DType dt : kFloatTypes) {
    for (const Case& c : kCases) {
      INFO("dtype: " << dtype_name(dt));
      INFO("case: " << c.name);
      Tensor x = random(c.input, dt), w = random(c.weight, dt);
      Tensor b = c.bias ? random({c.weight[0]}, dt) : Tensor();
      check_matches(conv2d(x, w, b, c.options), reference_conv2d(x, w, b, c.options), dt, kFloat64Tolerance);
    }
  }
}

TEST_CASE("conv2d reads strided and channels_last inputs and keeps the input's memory format") {
  manual_seed(22);
  const Conv2dOptions o{.stride = {2, 1}, .padding = {1, 1}};
  for (DType dt : kFloatTypes) {
    INFO("dtype: " << dtype_name(dt));
    Tensor w = random({4, 3, 3, 3}, dt), b = random({4}, dt);

    // Every other row and column of a larger tensor; a transposed H and W.
    Tensor sliced = random({2, 3, 14, 12}, dt).slice(2, 0, 14, 2).slice(3, 1, 12, 2);  // [2, 3, 7, 6]
    REQUIRE_FALSE(sliced.is_contiguous());
    check_matches(conv2d(sliced, w, b, o), reference_conv2d(sliced, w, b, o), dt, kFloat64Tolerance);
    Tensor transposed = random({2, 3, 6, 7}, dt).transpose(2, 3);
    check_matches(conv2d(transposed, w, b, o), reference_conv2d(transposed, w, b, o), dt, kFloat64Tolerance);

    // channels_last in, channels_last out, same values.
    Tensor x = random({2, 3, 7, 6}, dt);
    Tensor x_cl = contiguous_channels_last(x);
    REQUIRE(is_channels_last(x_cl));
    REQUIRE_FALSE(x_cl.is_contiguous());
    Tensor y = conv2d(x_cl, w, b, o);
    CHECK(is_channels_last(y));
    CHECK(suggest_memory_format(y) == MemoryFormat::ChannelsLast);
    check_matches(y, reference_conv2d(x, w, b, o), dt, kFloat64Tolerance);
    CHECK(to_vector<double>(y) == to_vector<double>(conv2d(x, w, b, o)));

    // A channels_last weight with a contiguous input: the output follows the input.
    Tensor y2 = conv2d(x, contiguous_channels_last(w), b, o);
    CHECK(y2.is_contiguous());
    check_matches(y2, reference_conv2d(x, w, b, o), dt, kFloat64Tolerance);

    // Broadcast (stride-0) bias and weight views.
    Tensor wb = random({1, 3, 3, 3}, dt).expand({4, 3, 3, 3});
    Tensor bb = random({1}, dt).expand({4});
    check_matches(conv2d(x, wb, bb, o), reference_conv2d(x, wb, bb, o), dt, kFloat64Tolerance);
  }
}

TEST_CASE("conv2d in channels_last gives the NCHW values and gradients for every case and dtype") {
  // Every case in both layouts: the channels_last paths (pointwise GEMMs in NHWC, layout conversions)
  // against the reference, and their gradients against the NCHW ones.
  manual_seed(31);
  for (DType dt : kFloatTypes) {
    for (const Case& c : kCases) {
      INFO("dtype: " << dtype_name(dt));
      INFO("case: " << c.name);
      Tensor x = random(c.input, dt), w = random(c.weight, dt);
      Tensor b = c.bias ? random({c.weight[0]}, dt) : Tensor();
      Tensor x_cl = contiguous_channels_last(x).detach().requires_grad_(), w_cl = contiguous_channels_last(w);
      w_cl = w_cl.detach().requires_grad_();
      Tensor y_cl = conv2d(x_cl, w_cl, b, c.options);
      CHECK(is_channels_last(y_cl));  // (a [N, O, 1, 1] output is dense in both layouts)
      check_matches(y_cl, reference_conv2d(x, w, b, c.options), dt, kFloat64Tolerance);

      Tensor xn = x.detach().requires_grad_(), wn = w.detach().requires_grad_();
      Tensor yn = conv2d(xn, wn, b, c.options);
      Tensor g = random(yn.shape(), dt);
      yn.backward(g);
      y_cl.backward(contiguous_channels_last(g));
      // Both layouts sum the same products in float32 (float64); only the order may differ.
      const double tol = dt == kFloat64 ? 1e-12 : dt == kFloat32 ? 1e-5 : dt == kFloat16 ? 2e-3 : 1.6e-2;
      for (auto [got, want] : {std::pair{x_cl.grad(), xn.grad()}, std::pair{w_cl.grad(), wn.grad()}}) {
        std::vector<double> a = to_vector<double>(got), e = to_vector<double>(want);
        double scale = 0;
        for (double v : e) scale = std::max(scale, std::abs(v));
        int bad = 0;
        for (size_t i = 0; i < a.size(); ++i) {
          if (!(std::abs(a[i] - e[i]) <= tol * scale) && bad++ < 3) FAIL_CHECK("element " << i << ": " << a[i] << " vs " << e[i]);
        }
        CHECK(bad == 0);
      }
    }
  }
}

TEST_CASE("conv2d takes an unbatched [C, H, W] input") {
  manual_seed(23);
  Tensor x = random({3, 6, 5}, kFloat64), w = random({2, 3, 3, 3}, kFloat64), b = random({2}, kFloat64);
  Tensor y = conv2d(x, w, b, {.padding = {1, 1}});
  CHECK(y.shape() == Shape{2, 6, 5});
  Reference ref = reference_conv2d(x.unsqueeze(0), w, b, {.padding = {1, 1}});
  ref.shape = {2, 6, 5};
  check_matches(y, ref, kFloat64, kFloat64Tolerance);
}

TEST_CASE("conv2d accumulates float16 and bfloat16 products in float32") {
  // A 1x1 convolution over 4096 channels of ones: 4096 products of 1 * 1. A float16 running sum stops at
  // 2048 (2049 is not representable); accumulated in float32 and rounded once, the sum is exactly 4096.
  for (DType dt : {kFloat16, kBFloat16}) {
    INFO("dtype: " << dtype_name(dt));
    Tensor x = ones({2, 4096, 3, 3}, {.dtype = dt}), w = ones({2, 4096, 1, 1}, {.dtype = dt});
    for (double v : to_vector<double>(conv2d(x, w))) CHECK(v == 4096.0);
    // The 3x3 path (im2col) too: 9 * 512 = 4608, representable in both types.
    Tensor x3 = ones({1, 512, 3, 3}, {.dtype = dt}), w3 = ones({1, 512, 3, 3}, {.dtype = dt});
    for (double v : to_vector<double>(conv2d(x3, w3))) CHECK(v == 4608.0);
  }
}

TEST_CASE("set_conv_knob_search keeps what it is given and refuses a required gain of 1 or more, naming it") {
  const ConvKnobSearch previous = conv_knob_search();
  CHECK(ConvKnobSearch{}.enabled);  // on unless turned off
  CHECK(ConvKnobSearch{}.required_gain == 0.02);
  CHECK(previous.enabled == ConvKnobSearch{}.enabled);  // the process starts with the struct's defaults
  CHECK(previous.required_gain == ConvKnobSearch{}.required_gain);
  set_conv_knob_search({.enabled = false, .required_gain = 0.1});  // off: what bench_train_step --no-conv-knobs does
  CHECK_FALSE(conv_knob_search().enabled);
  CHECK(conv_knob_search().required_gain == 0.1);
  for (double bad : {1.0, 2.0, std::numeric_limits<double>::quiet_NaN()}) {
    CAPTURE(bad);
    const std::string e = error_of([&] { set_conv_knob_search({.enabled = true, .required_gain = bad}); });
    CHECK(contains(e, "set_conv_knob_search"));
    CHECK(contains(e, "required_gain"));
  }
  CHECK_FALSE(conv_knob_search().enabled);  // a refused setting changes nothing
  CHECK(conv_knob_search().required_gain == 0.1);
  set_conv_knob_search(previous);
  CHECK(conv_knob_search().enabled == previous.enabled);
}

TEST_CASE("conv2d errors name the op and the shapes") {
  Tensor x = randn({2, 3, 8, 8}), w = randn({4, 3, 3, 3});
  std::string e = error_of([&] { conv2d(x, randn({4, 2, 3, 3})); });
  CHECK(contains(e, "conv2d"));
  CHECK(contains(e, "[2, 3, 8, 8]"));
  CHECK(contains(e, "[4, 2, 3, 3]"));
  CHECK(contains(e, "3 channels"));

  e = error_of([&] { conv2d(randn({1, 3, 2, 2}), w); });
  CHECK(contains(e, "conv2d"));
  CHECK(contains(e, "spans more than the padded input"));
  CHECK(contains(e, "[1, 3, 2, 2]"));
  CHECK(contains(e, "[4, 3, 3, 3]"));
  CHECK(error_of([&] { conv2d(randn({1, 3, 2, 2}), w, {}, {.padding = {1, 1}}); }) == "(no error)");
  e = error_of([&] { conv2d(randn({1, 3, 5, 5}), w, {}, {.dilation = {3, 3}}); });  // 7x7 dilated kernel
  CHECK(contains(e, "spans more than the padded input"));
  // A dilation whose span overflows int64 is as much too large, not a wrapped-around empty output.
  e = error_of([&] { conv2d(randn({1, 3, 5, 5}), w, {}, {.dilation = {int64_t(1) << 62, 1}}); });
  CHECK(contains(e, "spans more than the padded input"));
  CHECK(contains(e, "dilation (4611686018427387904, 1)"));
  e = error_of([&] { conv2d(randn({1, 3, 5, 5}), randn({4, 3, 0, 3}), {}, {.dilation = {int64_t(1) << 62, 1}}); });
  CHECK(contains(e, "conv2d: the kernel must be at least 1x1, got weight float32[4, 3, 0, 3]"));

  e = error_of([&] { conv2d(randn({3, 8, 8, 1, 1}), w); });
  CHECK(contains(e, "conv2d"));
  CHECK(contains(e, "4-D"));
  CHECK(contains(e, "[3, 8, 8, 1, 1]"));
  e = error_of([&] { conv2d(x, randn({4, 3, 3})); });
  CHECK(contains(e, "weight must be 4-D"));
  CHECK(contains(e, "[4, 3, 3]"));

  e = error_of([&] { conv2d(x, randn({4, 1, 3, 3}), {}, {.groups = 2}); });
  CHECK(contains(e, "not divisible by groups = 2"));
  e = error_of([&] { conv2d(randn({2, 4, 8, 8}), randn({3, 2, 3, 3}), {}, {.groups = 2}); });
  CHECK(contains(e, "output channels are not divisible"));
  e = error_of([&] { conv2d(x, w, randn({3})); });
  CHECK(contains(e, "bias"));
  CHECK(contains(e, "[3]"));
  e = error_of([&] { conv2d(x, w.to(kFloat64)); });
  CHECK(contains(e, "same dtype"));
  CHECK(contains(e, "float64"));
  e = error_of([&] { conv2d(x.to(kInt64), w.to(kInt64)); });
  CHECK(contains(e, "floating-point"));
  CHECK(contains(error_of([&] { conv2d(x, w, {}, {.stride = {0, 1}}); }), "stride must be positive"));
  CHECK(contains(error_of([&] { conv2d(x, w, {}, {.padding = {-1, 0}}); }), "padding must be in [0, 2^60]"));
  CHECK(contains(error_of([&] { conv2d(x, w, {}, {.padding = {0, int64_t(1) << 62}}); }),
                 "padding must be in [0, 2^60]"));
  CHECK(contains(error_of([&] { conv2d(x, w, {}, {.dilation = {1, 0}}); }), "dilation must be positive"));
}

TEST_CASE("conv2d gradients of input, weight and bias pass gradcheck") {
  manual_seed(24);
  struct GradCase {
    std::string name;
    Shape input, weight;
    Conv2dOptions options;
  };
  const std::vector<GradCase> cases = {
      {"3x3", {2, 2, 5, 4}, {3, 2, 3, 3}, {}},
      {"stride and padding", {2, 2, 6, 5}, {3, 2, 3, 2}, {.stride = {2, 1}, .padding = {1, 1}}},
      {"dilation", {1, 2, 7, 6}, {2, 2, 3, 2}, {.padding = {1, 2}, .dilation = {2, 2}}},
      {"groups", {2, 4, 4, 4}, {4, 2, 2, 2}, {.stride = {2, 2}, .padding = {1, 0}, .groups = 2}},
      {"depthwise", {2, 3, 5, 5}, {3, 1, 3, 3}, {.padding = {1, 1}, .groups = 3}},
      {"1x1", {2, 3, 3, 4}, {2, 3, 1, 1}, {}},
      {"1x1 stride 2", {2, 3, 5, 4}, {2, 3, 1, 1}, {.stride = {2, 2}}},
  };
  for (const GradCase& c : cases) {
    INFO("case: " << c.name);
    Tensor x = leaf(c.input), w = leaf(c.weight), b = leaf({c.weight[0]});
    gradcheck([&](const TensorList& in) { return conv2d(in[0], in[1], in[2], c.options); }, {x, w, b});
    gradcheck([&](const TensorList& in) { return conv2d(in[0], in[1], Tensor(), c.options); }, {x, w});
  }
}

// A residual block's input has two gradients: its shortcut's and the convolution's. Where the engine hands the
// first to conv2d's backward (GradContext::accumulated), the kernel adds into it: the 3x3 kernel through a buffer, the
// 1x1 as a GEMM with beta = 1 (on CUDA, cuDNN with beta = 1; test_cuda.cpp).
TEST_CASE("conv2d's backward adds into its input's gradient from a shortcut: gradcheck of conv(x) + 2x") {
  manual_seed(26);
  for (auto [kernel, padding] : {std::pair{3, 1}, {1, 0}}) {
    CAPTURE(kernel);
    const Conv2dOptions o{.padding = {padding, padding}};
    // The shortcut made after the convolution: its backward runs first, so the convolution's adds into it.
    auto block = [&](const TensorList& in) {
      const Tensor conv = conv2d(in[0], in[1], Tensor(), o);
      return conv + in[0].mul(2.0);
    };
    gradcheck(block, {leaf({2, 3, 4, 5}), leaf({3, 3, kernel, kernel})});
    // The hand-over happened: the shortcut's gradient tensor, summed into by the convolution's kernel, becomes
    // x.grad itself (AccumulateGrad keeps a gradient nothing else holds).
    {
      Tensor x = leaf({2, 3, 4, 5}), w = leaf({3, 3, kernel, kernel});
      const Tensor conv = conv2d(x, w, Tensor(), o);
      const Tensor doubled = x.detach().mul(2.0);
      const Storage* shortcut_gradient = nullptr;
      record("Shortcut", {x}, {doubled}, [&shortcut_gradient](const GradContext& ctx) -> TensorList {
        Tensor g = ctx[0].mul(2.0);
        shortcut_gradient = g.storage().get();
        return {g};
      });
      (conv + doubled).sum().backward();
      CHECK(x.grad().storage().get() == shortcut_gradient);
    }
    Tensor x_cl;
    {
      NoGradGuard no_grad;
      x_cl = contiguous_channels_last(randn({2, 3, 4, 5}, {.dtype = kFloat64}));
    }
    x_cl.requires_grad_();
    gradcheck(block, {x_cl, leaf({3, 3, kernel, kernel})});
  }
}

TEST_CASE("conv2d gradients are right for channels_last and strided inputs, and for one input at a time") {
  manual_seed(25);
  const Conv2dOptions o{.stride = {1, 2}, .padding = {1, 1}};
  Tensor w = leaf({3, 2, 3, 3}), b = leaf({3});
  // channels_last leaves (gradcheck perturbs the leaf's own storage through its strides).
  Tensor x_cl;
  {
    NoGradGuard no_grad;
    x_cl = contiguous_channels_last(randn({2, 2, 5, 4}, {.dtype = kFloat64}));
  }
  x_cl.requires_grad_();
  gradcheck([&](const TensorList& in) { return conv2d(in[0], in[1], in[2], o); }, {x_cl, w, b});
  // The gradient is computed in the input's layout.
  Tensor y_cl = conv2d(x_cl.detach(), w.detach(), Tensor(), o);
  CHECK(is_channels_last(y_cl));
  CHECK(is_channels_last(conv2d_backward_input(y_cl, w.detach(), x_cl.shape(), o)));
  CHECK(is_channels_last(conv2d_backward_weight(y_cl, x_cl.detach(), w.shape(), o)));
  // A pointwise (1x1) convolution in channels_last: all three gradients are NHWC GEMMs.
  {
    Tensor x1;
    {
      NoGradGuard no_grad;
      x1 = contiguous_channels_last(randn({2, 3, 4, 3}, {.dtype = kFloat64}));
    }
    x1.requires_grad_();
    gradcheck([&](const TensorList& in) { return conv2d(contiguous_channels_last(in[0]), contiguous_channels_last(in[1]), in[2]); },
              {x1, leaf({5, 3, 1, 1}), leaf({5})});
  }
  // A transposed input.
  Tensor xt = leaf({2, 2, 4, 5});
  gradcheck([&](const TensorList& in) { return conv2d(in[0].transpose(2, 3), in[1], in[2], o); }, {xt, w, b});
  // Only the weight requires grad; only the input does.
  Tensor x_const = randn({2, 2, 5, 4}, {.dtype = kFloat64});
  gradcheck([&](const TensorList& in) { return conv2d(x_const, in[0], Tensor(), o); }, {w});
  Tensor w_const = randn({3, 2, 3, 3}, {.dtype = kFloat64});
  gradcheck([&](const TensorList& in) { return conv2d(in[0], w_const, Tensor(), o); }, {leaf({2, 2, 5, 4})});
}

TEST_CASE("conv2d_backward_input and conv2d_backward_weight match the autograd gradients") {
  manual_seed(26);
  const Conv2dOptions o{.stride = {2, 2}, .padding = {1, 1}, .groups = 2};
  Tensor x = leaf({3, 4, 7, 6}), w = leaf({6, 2, 3, 3});
  Tensor y = conv2d(x, w, Tensor(), o);
  Tensor g = randn(y.shape(), {.dtype = kFloat64});
  y.backward(g);
  Tensor gx = conv2d_backward_input(g, w.detach(), x.shape(), o);
  Tensor gw = conv2d_backward_weight(g, x.detach(), w.shape(), o);
  CHECK(to_vector<double>(gx) == to_vector<double>(x.grad()));
  CHECK(to_vector<double>(gw) == to_vector<double>(w.grad()));
  CHECK(contains(error_of([&] { conv2d_backward_input(g, w.detach(), {3, 4, 9, 9}, o); }), "does not match"));
  // The errors name the caller's shapes, not a stand-in's.
  CHECK(contains(error_of([&] { conv2d_backward_input(g, w.detach(), {3, 6, 7, 6}, o); }),
                 "input float64[3, 6, 7, 6] cpu has 6 channels, but weight float64[6, 2, 3, 3] cpu expects 4"));
  CHECK(contains(error_of([&] { conv2d_backward_input(g, w.detach(), {3, 4, -7, 6}, o); }),
                 "conv2d_backward_input: the shape [3, 4, -7, 6] has a negative size"));
  CHECK(contains(error_of([&] { conv2d_backward_weight(g, x.detach(), {6, -2, 3, 3}, o); }),
                 "conv2d_backward_weight: the shape [6, -2, 3, 3] has a negative size"));
  const int64_t huge = int64_t(1) << 40;
  CHECK(contains(error_of([&] { conv2d_backward_input(g, w.detach(), {huge, 4, huge, 9}, o); }),
                 "conv2d_backward_input: the shape [1099511627776, 4, 1099511627776, 9] has more elements than an "
                 "int64 counts"));
}

TEST_CASE("conv2d in float32 runs in float16 under autocast, and its gradients come back in float32") {
  manual_seed(27);
  Tensor x = randn({2, 3, 6, 6}), w = randn({4, 3, 3, 3}).requires_grad_(), b = randn({4}).requires_grad_();
  Tensor y;
  {
    amp::AutocastGuard autocast(kFloat16);
    y = conv2d(x, w, b, {.padding = {1, 1}});
  }
  CHECK(y.dtype() == kFloat16);
  Reference ref = reference_conv2d(x.to(kFloat16), w.detach().to(kFloat16), b.detach().to(kFloat16), {.padding = {1, 1}});
  check_matches(y, ref, kFloat16, kFloat64Tolerance);
  y.to(kFloat32).sum().backward();
  CHECK(w.grad().dtype() == kFloat32);
  CHECK(b.grad().dtype() == kFloat32);
}

TEST_CASE("channels_last helpers: is_channels_last, contiguous_channels_last, empty in a format") {
  Tensor x = randn({2, 3, 4, 5});
  CHECK_FALSE(is_channels_last(x));
  CHECK(suggest_memory_format(x) == MemoryFormat::Contiguous);
  Tensor cl = contiguous_channels_last(x);
  CHECK(cl.strides() == Shape{60, 1, 15, 3});
  CHECK(is_channels_last(cl));
  CHECK(suggest_memory_format(cl) == MemoryFormat::ChannelsLast);
  CHECK(to_vector<float>(cl) == to_vector<float>(x));
  CHECK(contiguous_channels_last(cl).same(cl));  // no copy when already channels_last
  CHECK(contiguous(cl, MemoryFormat::Contiguous).is_contiguous());

  // Size-1 dims: one channel, or a 1x1 image, is both layouts at once: computed as NCHW.
  Tensor one_channel = randn({2, 1, 4, 5});
  CHECK(is_channels_last(one_channel));
  CHECK(suggest_memory_format(one_channel) == MemoryFormat::Contiguous);
  CHECK(is_channels_last(randn({2, 8, 1, 1})));
  CHECK_FALSE(is_channels_last(randn({2, 3, 4})));
  CHECK_FALSE(is_channels_last(cl.slice(2, 0, 4, 2)));  // not dense

  Tensor e = empty({2, 3, 4, 5}, {.dtype = kFloat16}, MemoryFormat::ChannelsLast);
  CHECK(e.shape() == Shape{2, 3, 4, 5});
  CHECK(e.strides() == Shape{60, 1, 15, 3});
  CHECK(e.dtype() == kFloat16);
  CHECK(empty({2, 3, 4, 5}, {}, MemoryFormat::Contiguous).is_contiguous());

  // contiguous_channels_last is differentiable: the gradient flows back to the NCHW leaf.
  Tensor leaf_x = randn({1, 2, 3, 3}).requires_grad_();
  (contiguous_channels_last(leaf_x) * 3.0).sum().backward();
  for (float v : to_vector<float>(leaf_x.grad())) CHECK(v == 3.0f);
  CHECK(contains(error_of([&] { contiguous_channels_last(randn({2, 3})); }), "4-D"));
}

// ---- CUDA against the CPU (skipped without a GPU)

namespace {

// CUDA's cuDNN result against the CPU's for the same inputs, relative to the largest |value| of the CPU
// result: cuDNN's algorithms sum in other orders, and its FFT and Winograd ones apply transforms that spread
// rounding error across a tile (~10 float32 ulps of the scale). Half types: the rounding of the output
// (2^-11 / 2^-8) plus those differences. TF32 is off in these tests, so float32 is full precision.
double cuda_tolerance(DType t) {
  switch (t) {
    case kFloat64: return 1e-10;
    case kFloat32: return 1e-4;
    case kFloat16: return 4e-3;
    case kBFloat16: return 3e-2;
    default: return 0;
  }
}

void check_cuda_close(const Tensor& got, const Tensor& want, DType dt, const std::string& what) {
  INFO(what);
  REQUIRE(got.defined());
  CHECK(got.is_cuda());
  REQUIRE(got.shape() == want.shape());
  std::vector<double> a = to_vector<double>(got), b = to_vector<double>(want);
  double scale = 0;
  for (double v : b) scale = std::max(scale, std::abs(v));
  int bad = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!(std::abs(a[i] - b[i]) <= cuda_tolerance(dt) * scale) && bad++ < 3) {
      FAIL_CHECK("element " << i << ": cuda " << a[i] << " vs cpu " << b[i] << " (scale " << scale << ")");
    }
  }
  CHECK_MESSAGE(bad == 0, bad << " of " << a.size() << " elements differ");
}

struct TF32Off {
  bool previous = conv_allow_tf32();
  TF32Off() { set_conv_allow_tf32(false); }
  ~TF32Off() { set_conv_allow_tf32(previous); }
};

// While alive: halfgrad's logger at debug level, its messages collected; its other sinks print no more than before.
class DebugLog {
 public:
  DebugLog() : sink_(std::make_shared<spdlog::sinks::ostream_sink_mt>(text_)), level_(logger().level()) {
    for (const spdlog::sink_ptr& s : logger().sinks()) {
      sink_levels_.push_back(s->level());
      s->set_level(std::max(s->level(), level_));
    }
    sink_->set_pattern("%v");
    logger().sinks().push_back(sink_);
    logger().set_level(spdlog::level::debug);
  }
  ~DebugLog() {
    logger().set_level(level_);
    std::vector<spdlog::sink_ptr>& sinks = logger().sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), sink_), sinks.end());
    for (size_t i = 0; i < sinks.size() && i < sink_levels_.size(); ++i) sinks[i]->set_level(sink_levels_[i]);
  }
  DebugLog(const DebugLog&) = delete;
  DebugLog& operator=(const DebugLog&) = delete;

  std::vector<std::string> lines() const {
    std::vector<std::string> out;
    std::istringstream in(text_.str());
    for (std::string line; std::getline(in, line);) out.push_back(line);
    return out;
  }

 private:
  std::ostringstream text_;
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> sink_;
  spdlog::level::level_enum level_;
  std::vector<spdlog::level::level_enum> sink_levels_;
};

}  // namespace

TEST_CASE("cuda: conv2d forward and all gradients match the CPU in every dtype, NCHW and channels_last") {
  SKIP_WITHOUT_GPU();
  TF32Off tf32_off;
  manual_seed(28);
  const Device gpu = Device::cuda(0);
  for (DType dt : kFloatTypes) {
    for (const Case& c : kCases) {
      for (MemoryFormat format : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
        INFO("dtype: " << dtype_name(dt));
        INFO("case: " << c.name);
        INFO("format: " << memory_format_name(format));
        Tensor x = contiguous(random(c.input, dt), format), w = random(c.weight, dt);
        Tensor b = c.bias ? random({c.weight[0]}, dt) : Tensor();
        Tensor gy;
        Tensor xc = x.detach().requires_grad_(), wc = w.detach().requires_grad_();
        Tensor bc = b.defined() ? b.detach().requires_grad_() : Tensor();
        Tensor yc = conv2d(xc, wc, bc, c.options);
        gy = random(yc.shape(), dt);
        yc.backward(gy);

        Tensor xg = contiguous(x.to(gpu), format).detach().requires_grad_(), wg = w.to(gpu).detach().requires_grad_();
        Tensor bg = b.defined() ? b.to(gpu).detach().requires_grad_() : Tensor();
        Tensor yg = conv2d(xg, wg, bg, c.options);
        CHECK(suggest_memory_format(yg) == suggest_memory_format(yc));
        yg.backward(gy.to(gpu));
        check_cuda_close(yg, yc, dt, "output");
        check_cuda_close(xg.grad(), xc.grad(), dt, "grad input");
        check_cuda_close(wg.grad(), wc.grad(), dt, "grad weight");
        if (b.defined()) check_cuda_close(bg.grad(), bc.grad(), dt, "grad bias");
      }
    }
  }
}

// conv(x) + 2x: the engine hands the shortcut's gradient to conv2d's backward, whose kernel adds into it (cuDNN's
// beta = 1, or the 1x1 GEMM's); the autotuner times the engines on zeros, so the result is added once.
TEST_CASE("cuda: conv2d's backward adds into the input's gradient from a shortcut as the CPU's does") {
  SKIP_WITHOUT_GPU();
  TF32Off tf32_off;
  manual_seed(30);
  const Device gpu = Device::cuda(0);
  for (DType dt : {kFloat32, kFloat16, kFloat64}) {
    for (auto [kernel, padding] : {std::pair{3, 1}, {1, 0}}) {
      for (MemoryFormat format : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
        CAPTURE(std::string(dtype_name(dt)));
        CAPTURE(kernel);
        CAPTURE(memory_format_name(format));
        const Conv2dOptions o{.padding = {padding, padding}};
        const Tensor x = contiguous(random({4, 16, 8, 8}, dt), format), w = random({16, 16, kernel, kernel}, dt);
        const Tensor gy = random({4, 16, 8, 8}, dt);
        // The shortcut made after the convolution: its backward runs first, so the convolution's adds into it.
        auto block = [&](const Tensor& in, const Tensor& weight) {
          const Tensor conv = conv2d(in, weight, {}, o);
          return conv + in.mul(2.0);
        };
        Tensor xc = x.detach().requires_grad_();
        block(xc, w).backward(gy);
        for (int call = 0; call < 2; ++call) {  // the first call autotunes, the second takes the cached engine
          Tensor xg = contiguous(x.to(gpu), format).detach().requires_grad_();
          block(xg, w.to(gpu)).backward(gy.to(gpu));
          CHECK(suggest_memory_format(xg.grad()) == suggest_memory_format(xc.grad()));
          check_cuda_close(xg.grad(), xc.grad(), dt, "grad input");
        }
      }
    }
  }
}

TEST_CASE("cuda: conv2d at ResNet sizes matches the CPU, the cached algorithm gives the same result again") {
  SKIP_WITHOUT_GPU();
  TF32Off tf32_off;
  manual_seed(29);
  const Device gpu = Device::cuda(0);
  for (DType dt : {kFloat32, kFloat16}) {
    for (MemoryFormat format : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
      INFO("dtype: " << dtype_name(dt));
      INFO("format: " << memory_format_name(format));
      Tensor x = contiguous(random({8, 64, 16, 16}, dt), format), w = random({128, 64, 3, 3}, dt);
      const Conv2dOptions o{.stride = {2, 2}, .padding = {1, 1}};
      Tensor want = conv2d(x, w, {}, o);
      Tensor xg = x.to(gpu), wg = w.to(gpu);
      if (format == MemoryFormat::ChannelsLast) xg = contiguous_channels_last(xg);
      Tensor first = conv2d(xg, wg, {}, o);
      Tensor second = conv2d(xg, wg, {}, o);  // from the algorithm cache
      check_cuda_close(first, want, dt, "first call");
      CHECK(to_vector<double>(first) == to_vector<double>(second));
    }
  }
}

TEST_CASE("cuda: float32 conv2d uses TF32 only when allowed") {
  SKIP_WITHOUT_GPU();
  manual_seed(30);
  const Device gpu = Device::cuda(0);
  Tensor x = random({16, 64, 16, 16}, kFloat32), w = random({64, 64, 3, 3}, kFloat32);
  Tensor want = conv2d(x.to(kFloat64), w.to(kFloat64), {}, {.padding = {1, 1}});
  bool previous = conv_allow_tf32();
  set_conv_allow_tf32(false);
  Tensor full = conv2d(x.to(gpu), w.to(gpu), {}, {.padding = {1, 1}});
  set_conv_allow_tf32(true);
  Tensor tf32 = conv2d(x.to(gpu), w.to(gpu), {}, {.padding = {1, 1}});
  set_conv_allow_tf32(previous);
  check_cuda_close(full, want.to(kFloat32), kFloat32, "tf32 off: full float32");
  // TF32 rounds the operands to 10-bit mantissas: ~1e-3 relative error per product, averaging out over
  // the 576-term sums to well below 1e-2 of the output scale.
  std::vector<double> a = to_vector<double>(tf32), b = to_vector<double>(want);
  double scale = 0, worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    scale = std::max(scale, std::abs(b[i]));
    worst = std::max(worst, std::abs(a[i] - b[i]));
  }
  CHECK(worst <= 1e-2 * scale);
}

TEST_CASE("cuda: conv2d with autotuning off takes cuDNN's first fitting engine and computes the same convolution") {
  SKIP_WITHOUT_GPU();
  manual_seed(31);
  const Device gpu = Device::cuda(0);
  // A size no other test uses, so that both settings choose afresh; float16 to keep TF32 out of the comparison.
  Tensor x = random({6, 24, 13, 11}, kFloat16), w = random({40, 24, 3, 3}, kFloat16), g = random({6, 40, 13, 11}, kFloat16);
  const bool previous = conv_benchmark();
  auto run = [&](bool benchmark) {
    set_conv_benchmark(benchmark);
    Tensor xg = x.to(gpu).requires_grad_(true), wg = w.to(gpu).requires_grad_(true);
    Tensor y = conv2d(xg, wg, {}, {.padding = {1, 1}});
    y.backward(g.to(gpu));
    return std::vector<Tensor>{y.detach(), xg.grad(), wg.grad()};
  };
  const std::vector<Tensor> heuristic = run(false), tuned = run(true);
  set_conv_benchmark(previous);
  CHECK(conv_benchmark() == previous);
  const char* names[] = {"output", "input gradient", "weight gradient"};
  // Different engines sum in different orders: equal to float16 rounding of float32 sums.
  for (size_t i = 0; i < 3; ++i) check_cuda_close(heuristic[i], tuned[i].to(Device::cpu()), kFloat16, names[i]);
}

// Autotuning on, and the knob search with the given required gain, while alive.
struct KnobSearchOn {
  bool benchmark = conv_benchmark();
  ConvKnobSearch previous = conv_knob_search();
  explicit KnobSearchOn(double required_gain) {
    set_conv_benchmark(true);
    set_conv_knob_search({.enabled = true, .required_gain = required_gain});
  }
  ~KnobSearchOn() {
    set_conv_knob_search(previous);
    set_conv_benchmark(benchmark);
  }
  KnobSearchOn(const KnobSearchOn&) = delete;
  KnobSearchOn& operator=(const KnobSearchOn&) = delete;
};

// With the knob search on, where a cuDNN engine wins the timing its knobs are searched (ops/conv.cu, KnobSearch), and
// whichever setting is taken must compute what the CPU computes in every direction, the input gradient's add into the
// shortcut's included. float16 runs with a required gain of -inf, so that a setting that computed the same result
// replaces the engine's own choice however fast it is: the real runs then go through a knob-set plan. float32 keeps the
// default gain. Its six problems are new to that cache (no other case uses these shapes, and each case runs in a
// process of its own under ctest); the debug log must name the outcome of a search for each.
TEST_CASE("cuda: conv2d with the cuDNN engines' knobs searched matches the CPU, the shortcut's gradient included") {
  SKIP_WITHOUT_GPU();
  TF32Off tf32_off;
  manual_seed(33);
  const Device gpu = Device::cuda(0);
  std::vector<std::string> log;
  {
    DebugLog debug_log;
    for (auto [dt, gain] : {std::pair{kFloat16, -std::numeric_limits<double>::infinity()}, {kFloat32, 0.02}}) {
      CAPTURE(std::string(dtype_name(dt)));
      KnobSearchOn knob_search(gain);
      const Conv2dOptions o{.padding = {1, 1}};
      const Tensor x = contiguous_channels_last(random({12, 64, 16, 16}, dt)), w = random({64, 64, 3, 3}, dt);
      const Tensor gy = random({12, 64, 16, 16}, dt);
      // The shortcut made after the convolution: its backward runs first, so the convolution's adds into it.
      auto block = [&](const Tensor& in, const Tensor& weight) {
        const Tensor conv = conv2d(in, weight, {}, o);
        return conv + in.mul(2.0);
      };
      Tensor xc = x.detach().requires_grad_(), wc = w.detach().requires_grad_();
      Tensor yc = block(xc, wc);
      yc.backward(gy);
      // All channels_last on the GPU, as a ResNet's: the shortcut's gradient then has the layout the convolution's
      // backward adds into.
      Tensor xg = contiguous_channels_last(x.to(gpu)).detach().requires_grad_();
      Tensor wg = contiguous_channels_last(w.to(gpu)).detach().requires_grad_();
      Tensor yg = block(xg, wg);
      yg.backward(contiguous_channels_last(gy.to(gpu)));
      check_cuda_close(yg, yc, dt, "output");
      check_cuda_close(xg.grad(), xc.grad(), dt, "grad input");
      check_cuda_close(wg.grad(), wc.grad(), dt, "grad weight");
    }
    log = debug_log.lines();
  }
  std::string whole;
  for (const std::string& line : log) whole += line + "\n";
  INFO(whole);
  // One outcome a problem: the engine's own choice kept (and why), or its fastest setting timed against it.
  const std::regex outcome(R"(knob search: .*\(([0-9]+) settings tried: ([0-9]+) computed the same result)");
  int searches = 0, float16_matched = 0, float16_taken = 0, float16_adding = 0;
  for (const std::string& line : log) {
    std::smatch m;
    if (!std::regex_search(line, m, outcome)) continue;
    ++searches;
    if (line.find("input float16") == std::string::npos) continue;
    float16_matched += std::stoi(m[2].str()) > 0;
    float16_taken += line.find(", taken") != std::string::npos;
    float16_adding += line.find("adding into the result") != std::string::npos;
  }
  CHECK(searches == 6);                     // 2 dtypes x 3 directions
  CHECK(float16_matched > 0);               // the engines have knobs, and settings of them ran
  CHECK(float16_taken == float16_matched);  // each problem where a setting ran took one: gain -inf
  CHECK(float16_adding == 1);               // the input gradient's problem, added into the shortcut's
}

// ---- our kernels for windows of at most 32 values (ops/conv_few_channels.cu), called directly: the autotuner
// may prefer cuDNN for a problem, and these must be right whichever it takes. (A build without CUDA has no such
// kernels to link.)

#if HALFGRAD_WITH_CUDA
namespace {

struct FewChannelsCase {
  std::string name;
  Shape input, weight;
  Conv2dParams params;
};

const std::vector<FewChannelsCase> kFewChannelsCases = {
    {"CIFAR stem: RGB, 3x3, padding 1, a partial last tile", {5, 3, 17, 13}, {64, 3, 3, 3}, {.padding = {1, 1}}},
    {"two output chunks (72 = 64 + 8), stride (2, 1), dilation (2, 1)", {3, 3, 19, 23}, {72, 3, 3, 3},
     {.stride = {2, 1}, .padding = {1, 2}, .dilation = {2, 1}}},
    {"one channel, 5x5 (a 25-value window)", {4, 1, 12, 15}, {16, 1, 5, 5}, {.padding = {2, 2}}},
    {"a window of exactly 32: 2 channels, 4x4, stride (2, 3)", {3, 2, 14, 16}, {8, 2, 4, 4}, {.stride = {2, 3}}},
    {"1x1 over 32 channels", {2, 32, 9, 7}, {24, 32, 1, 1}, {}},
};

// The float64 convolution of the operands' values and, per output, sum |x| |w|.
Reference few_channels_reference(const Tensor& x, const Tensor& w, const Conv2dParams& p) {
  return reference_conv2d(x.contiguous(), w.contiguous(), Tensor(),
                          {.stride = p.stride, .padding = p.padding, .dilation = p.dilation});
}

// Each value within one rounding of the float64 result (2^-11 float16, 2^-8 bfloat16, relative) plus a float32 sum
// of `terms` products: 2^-23 per term of the sum of magnitudes, the worst case of any order when each addition may
// truncate (the tensor cores' float32 sums need not round to nearest).
void check_rounded(const Tensor& got, const Reference& want, DType dt, int64_t terms, const char* what) {
  INFO(what);
  REQUIRE(got.shape() == want.shape);
  const std::vector<double> a = to_vector<double>(got.contiguous());
  const double rounding = dt == kFloat16 ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
  int bad = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double allowed = rounding * std::abs(want.values[i]) + std::ldexp(double(terms), -23) * want.magnitude[i];
    if (!(std::abs(a[i] - want.values[i]) <= allowed) && bad++ < 3) {
      FAIL_CHECK("element " << i << ": " << a[i] << " vs " << want.values[i] << " (allowed " << allowed << ")");
    }
  }
  CHECK_MESSAGE(bad == 0, bad << " of " << a.size() << " elements differ");
}

}  // namespace

TEST_CASE("cuda: the few-channels kernels compute conv2d's forward and weight gradient (float16, bfloat16)") {
  SKIP_WITHOUT_GPU();
  manual_seed(32);
  const Device gpu = Device::cuda(0);
  if (cuda::compute_capability(0) < 80) return;  // mma.sync m16n8k16 needs sm_80
  for (DType dt : {kFloat16, kBFloat16}) {
    for (const FewChannelsCase& c : kFewChannelsCases) {
      for (MemoryFormat weight_format : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
        CAPTURE(std::string(dtype_name(dt)));
        CAPTURE(c.name);
        CAPTURE(memory_format_name(weight_format));
        const Tensor x = random(c.input, dt), w = contiguous(random(c.weight, dt), weight_format);
        const Conv2dOptions options{.stride = c.params.stride, .padding = c.params.padding,
                                    .dilation = c.params.dilation};
        const Shape out_shape = conv2d(x, w, {}, options).shape();
        const Tensor xg = contiguous_channels_last(x.to(gpu)), wg = contiguous(w.to(gpu), weight_format);
        const Tensor y = empty(out_shape, {.dtype = dt, .device = gpu}, MemoryFormat::ChannelsLast);
        REQUIRE(few_channels_conv_takes(xg, wg, y, c.params));
        few_channels_conv_forward(y, xg, wg, c.params);
        check_rounded(y, few_channels_reference(x, w, c.params), dt, 32, "output");

        // The weight gradient is the convolution of x with dy over the batch and positions: against the float64
        // gradient of the CPU's float64 convolution, with magnitudes from the same sums of |x| |dy|.
        const Tensor dy = random(out_shape, dt);
        Tensor x64 = x.to(kFloat64), w64 = w.to(kFloat64).contiguous().requires_grad_();
        conv2d(x64, w64, {}, options).backward(dy.to(kFloat64));
        Tensor w_abs = w64.detach().abs().requires_grad_();
        conv2d(x64.abs(), w_abs, {}, options).backward(dy.to(kFloat64).abs());
        const Reference want{w64.grad().shape(), to_vector<double>(w64.grad()), to_vector<double>(w_abs.grad())};
        const Tensor dyg = contiguous_channels_last(dy.to(gpu));
        const Tensor workspace = empty({few_channels_weight_workspace(xg, wg, dyg)}, {.dtype = kUInt8, .device = gpu});
        const Tensor dw = empty(c.weight, {.dtype = dt, .device = gpu}, weight_format);
        few_channels_conv_backward_weight(dw, dyg, xg, c.params, workspace);
        check_rounded(dw, want, dt, y.numel() / y.size(1), "weight gradient");
        // Summed in a fixed order: the same bits again.
        const Tensor again = empty(c.weight, {.dtype = dt, .device = gpu}, weight_format);
        few_channels_conv_backward_weight(again, dyg, xg, c.params, workspace);
        CHECK(to_vector<double>(again) == to_vector<double>(dw));
      }
    }
  }
}

// More tiles than the weight gradient's wave of blocks, so that each block adds several tiles into its sums. Small
// integers make every product and sum exact in float32, whatever the order: the result is the float64 gradient
// rounded once, bit for bit.
TEST_CASE("cuda: the few-channels weight gradient adds many tiles a block, exactly where the sums are exact") {
  SKIP_WITHOUT_GPU();
  if (cuda::compute_capability(0) < 80) return;
  manual_seed(33);
  const Device gpu = Device::cuda(0);
  const Conv2dParams same{.padding = {1, 1}};
  for (DType dt : {kFloat16, kBFloat16}) {
    CAPTURE(std::string(dtype_name(dt)));
    const Tensor x = randint(-2, 3, {48, 1, 64, 64}).to(dt), dy = randint(-2, 3, {48, 8, 64, 64}).to(dt);
    Tensor w64 = zeros({8, 1, 3, 3}, {.dtype = kFloat64}).requires_grad_();
    conv2d(x.to(kFloat64), w64, {}, {.padding = {1, 1}}).backward(dy.to(kFloat64));

    const Tensor xg = contiguous_channels_last(x.to(gpu)), dyg = contiguous_channels_last(dy.to(gpu));
    const Tensor dw = empty({8, 1, 3, 3}, {.dtype = dt, .device = gpu});
    REQUIRE(few_channels_conv_takes(xg, dw, dyg, same));
    const int64_t bytes = few_channels_weight_workspace(xg, dw, dyg);
    const int64_t blocks = bytes / (64 * 32 * int64_t(sizeof(float))), tiles = 48 * 64 * 64 / 128;
    REQUIRE(blocks < tiles);
    few_channels_conv_backward_weight(dw, dyg, xg, same, empty({bytes}, {.dtype = kUInt8, .device = gpu}));
    CHECK(to_vector<double>(dw) == to_vector<double>(w64.grad().to(dt)));
  }
}

TEST_CASE("cuda: the few-channels kernels decline what they cannot compute") {
  SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  const TensorOptions half{.dtype = kFloat16, .device = gpu};
  auto nhwc = [&](const Shape& s, const TensorOptions& o) { return empty(s, o, MemoryFormat::ChannelsLast); };
  const Tensor x = nhwc({2, 3, 8, 8}, half), w = empty({64, 3, 3, 3}, half), y = nhwc({2, 64, 8, 8}, half);
  const Conv2dParams same{.padding = {1, 1}};
  CHECK(few_channels_conv_takes(x, w, y, same) == (cuda::compute_capability(0) >= 80));
  const TensorOptions single{.dtype = kFloat32, .device = gpu};
  CHECK_FALSE(few_channels_conv_takes(nhwc({2, 3, 8, 8}, single), empty({64, 3, 3, 3}, single),
                                      nhwc({2, 64, 8, 8}, single), same));  // float32
  CHECK_FALSE(few_channels_conv_takes(nhwc({2, 4, 8, 8}, half), empty({64, 4, 3, 3}, half), y, same));  // 36 values
  CHECK_FALSE(few_channels_conv_takes(x, empty({60, 3, 3, 3}, half), nhwc({2, 60, 8, 8}, half), same));  // O % 8
  CHECK_FALSE(few_channels_conv_takes(empty({2, 3, 8, 8}, half), w, y, same));                         // NCHW input
  CHECK_FALSE(few_channels_conv_takes(x, w, empty({2, 64, 8, 8}, half), same));                        // NCHW output
  CHECK_FALSE(few_channels_conv_takes(x, w, y, {.padding = {1, 1}, .groups = 3}));                     // groups
  CHECK_FALSE(few_channels_conv_takes(nhwc({2, 3, 0, 8}, half), empty({8, 3, 1, 1}, half), nhwc({2, 8, 2, 10}, half),
                                      same));  // an empty input under padding
}
#endif  // HALFGRAD_WITH_CUDA

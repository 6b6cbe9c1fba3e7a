// batch_norm: running statistics against a hand computation, outputs against a float64 reference in both
// memory layouts (NCHW and channels last), float16/bfloat16 inputs with float32 parameters and statistics,
// gradchecks in training and evaluation, errors, and CUDA against the CPU.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/autocast.h"
#include "core/cuda.h"
#include "core/cuda_allocator.h"
#include "halfgrad.h"
#include "tests/testing.h"
#include "ops/batch_norm.h"
#include "tests/gradcheck.h"

using namespace halfgrad;
using halfgrad::testing::values;
using halfgrad::testing::check_close;
using halfgrad::testing::gradcheck;
using halfgrad::testing::leaf;

namespace {

// The same values stored channels last ([N, C, H, W] viewed over [N, H, W, C] memory).
Tensor channels_last(const Tensor& t) {
  Dims to{0}, back{0, t.dim() - 1};
  for (int64_t d = 2; d < t.dim(); ++d) to.push_back(d);
  to.push_back(1);
  for (int64_t d = 1; d + 1 < t.dim(); ++d) back.push_back(d);
  return t.permute(to).contiguous().permute(back);
}

bool is_channels_last_layout(const Tensor& t) {  // [N, C, H, W] with C innermost
  return t.stride(1) == 1 && t.stride(t.dim() - 1) == t.size(1);
}

struct Reference {
  std::vector<double> y, mean, var;  // var: biased
};

// batch_norm in float64 by its definition. Eval mode when running statistics are given.
Reference reference_batch_norm(const Tensor& x, const std::vector<double>& weight, const std::vector<double>& bias,
                               const std::vector<double>* running_mean, const std::vector<double>* running_var,
                               double eps) {
  std::vector<double> v = values(x);
  const int64_t N = x.size(0), C = x.size(1), S = x.numel() / (N * C);
  Reference r;
  r.y.resize(v.size());
  for (int64_t c = 0; c < C; ++c) {
    double sum = 0, sq = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t s = 0; s < S; ++s) sum += v[size_t((n * C + c) * S + s)];
    const double mean = sum / double(N * S);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t s = 0; s < S; ++s) sq += std::pow(v[size_t((n * C + c) * S + s)] - mean, 2);
    r.mean.push_back(mean);
    r.var.push_back(sq / double(N * S));
    const double m = running_mean ? (*running_mean)[size_t(c)] : mean;
    const double var = running_var ? (*running_var)[size_t(c)] : r.var.back();
    const double w = weight.empty() ? 1.0 : weight[size_t(c)], b = bias.empty() ? 0.0 : bias[size_t(c)];
    for (int64_t n = 0; n < N; ++n)
      for (int64_t s = 0; s < S; ++s) {
        const size_t i = size_t((n * C + c) * S + s);
        r.y[i] = (v[i] - m) / std::sqrt(var + eps) * w + b;
      }
  }
  return r;
}

// Sets which CUDA implementation runs channels-last training batch_norm, for a scope.
struct BackendGuard {
  BatchNormBackend previous = batch_norm_backend();
  explicit BackendGuard(BatchNormBackend backend) { set_batch_norm_backend(backend); }
  ~BackendGuard() { set_batch_norm_backend(previous); }
};

#if HALFGRAD_WITH_CUDA
// float32 values around 1000 with spread 0.1 through CUDA batch_norm, NCHW or channels last: a sum-of-squares
// variance would lose every digit (E[x^2] - E[x]^2 with E[x^2] ~ 1e6 in float32 has an error near 0.1, the
// variance is 0.01).
void check_mean_far_larger_than_spread(bool cl) {
  CAPTURE(cl);
  Tensor x = randn({64, 16, 8, 8}) * 0.1 + 1000.0;
  Tensor xg = cl ? channels_last(x.cuda()) : x.cuda();
  Tensor rm = zeros({16}, {.device = Device::cuda(0)}), rv = ones({16}, {.device = Device::cuda(0)});
  Tensor y = batch_norm(xg, rm, rv, Tensor(), Tensor(), true, 1.0, 0.0);
  Reference r = reference_batch_norm(x.to(kFloat64), std::vector<double>(16, 1.0), std::vector<double>(16, 0.0),
                                     nullptr, nullptr, 0.0);
  // The input's own rounding (ulp(1000) = 6e-5, 6e-4 of the spread) is in the reference too; what is left is
  // the statistics' error.
  check_close(values(y.cpu()), r.y, 2e-3);
  const double n = 64 * 8 * 8;
  std::vector<double> unbiased;
  for (double v : r.var) unbiased.push_back(v * n / (n - 1));
  check_close(values(rv.cpu()), unbiased, 1e-3);
}
#endif

}  // namespace

TEST_CASE("batch_norm training updates the running statistics as computed by hand") {
  // Channel 0 holds 1, 2, 5, 6 and channel 1 holds 3, 4, 7, 8: mean 3.5 and 5.5, biased variance 4.25,
  // unbiased variance 4.25 * 4 / 3 = 17 / 3.
  Tensor x = tensor<float>({1, 2, 3, 4, 5, 6, 7, 8}, {2, 2, 2});
  Tensor running_mean = zeros({2}), running_var = ones({2});
  Tensor y = batch_norm(x, running_mean, running_var, Tensor(), Tensor(), /*training=*/true, /*momentum=*/0.1, 1e-5);
  CHECK(to_vector<float>(running_mean)[0] == doctest::Approx(0.35));
  CHECK(to_vector<float>(running_mean)[1] == doctest::Approx(0.55));
  CHECK(to_vector<float>(running_var)[0] == doctest::Approx(0.9 + 0.1 * 17.0 / 3.0));
  CHECK(to_vector<float>(running_var)[1] == doctest::Approx(0.9 + 0.1 * 17.0 / 3.0));
  // The output is normalised with the biased variance.
  const double s = std::sqrt(4.25 + 1e-5);
  check_close(values(y), {-2.5 / s, -1.5 / s, -2.5 / s, -1.5 / s, 1.5 / s, 2.5 / s, 1.5 / s, 2.5 / s}, 1e-6);
  // A second step moves them again: running = 0.9 * running + 0.1 * batch statistic.
  batch_norm(x, running_mean, running_var, Tensor(), Tensor(), true, 0.1, 1e-5);
  CHECK(to_vector<float>(running_mean)[0] == doctest::Approx(0.9 * 0.35 + 0.35));
  // momentum 1 replaces them with the batch statistics; the running tensors' version counters move.
  const uint64_t version = running_mean.version();
  batch_norm(x, running_mean, running_var, Tensor(), Tensor(), true, 1.0, 1e-5);
  CHECK(values(running_mean) == std::vector<double>{3.5, 5.5});
  CHECK(to_vector<float>(running_var)[1] == doctest::Approx(17.0 / 3.0));
  CHECK(running_mean.version() > version);
}

TEST_CASE("batch_norm adds a training batch to num_batches_tracked on every path, evaluation leaves it alone") {
  manual_seed(104);
  Tensor x = randn({4, 3, 2, 2}), z = randn({4, 3, 2, 2}), ib = randn({3});
  Tensor rm = zeros({3}), rv = ones({3});
  Tensor count = zeros({}, {.dtype = kInt64});
  uint64_t version = count.version();
  batch_norm(x, rm, rv, Tensor(), Tensor(), true, 0.1, 1e-5, Tensor(), count);
  CHECK(count.item<int64_t>() == 1);
  CHECK(count.version() > version);  // written in place, as the running statistics
  version = count.version();
  batch_norm(x, rm, rv, Tensor(), Tensor(), /*training=*/false, 0.1, 1e-5, Tensor(), count);
  batch_norm_relu(x, rm, rv, Tensor(), Tensor(), false, 0.1, 1e-5, z, Tensor(), ReluSaved::Mask, count);
  CHECK(count.item<int64_t>() == 1);
  CHECK(count.version() == version);
  batch_norm_relu(x, rm, rv, Tensor(), Tensor(), true, 0.1, 1e-5, z, Tensor(), ReluSaved::Output, count);
  batch_norm(x, rm, rv, Tensor(), Tensor(), true, 0.1, 1e-5, ib, count);  // input_bias folded
  CHECK(count.item<int64_t>() == 3);
  set_batch_norm_relu_fusion(false);  // the separate ops
  batch_norm_relu(x, rm, rv, Tensor(), Tensor(), true, 0.1, 1e-5, z, Tensor(), ReluSaved::Mask, count);
  set_batch_norm_relu_fusion(true);
  set_batch_norm_input_bias_fold(false);  // input_bias added first
  batch_norm(x, rm, rv, Tensor(), Tensor(), true, 0.1, 1e-5, ib, count);
  set_batch_norm_input_bias_fold(true);
  CHECK(count.item<int64_t>() == 5);
  batch_norm(randn({4, 0, 2}), Tensor(), Tensor(), Tensor(), Tensor(), true, 0.1, 1e-5, Tensor(), count);
  CHECK(count.item<int64_t>() == 6);  // no elements, no kernel: still a batch
  Tensor one = zeros({1}, {.dtype = kInt64});  // a one-element [1] tensor counts too
  batch_norm(x, Tensor(), Tensor(), Tensor(), Tensor(), true, 0.1, 1e-5, Tensor(), one);
  CHECK(one.item<int64_t>() == 1);
  const std::vector<double> running_mean = values(rm);
  CHECK_THROWS_WITH_AS(batch_norm(x, rm, rv, Tensor(), Tensor(), true, 0.1, 1e-5, Tensor(), zeros({})),
                       doctest::Contains("batch_norm: expected num_batches_tracked to be an int64 tensor of one element "
                                         "on the input's device (input float32[4, 3, 2, 2] cpu), got float32[] cpu"),
                       Error);
  CHECK_THROWS_WITH_AS(batch_norm_relu(x, rm, rv, Tensor(), Tensor(), true, 0.1, 1e-5, z, Tensor(), ReluSaved::Mask,
                                       zeros({2}, {.dtype = kInt64})),
                       doctest::Contains("batch_norm_relu: expected num_batches_tracked to be an int64 tensor of one "
                                         "element"), Error);
  CHECK(values(rm) == running_mean);  // refused before anything was written
}

TEST_CASE("batch_norm evaluation normalises with the running statistics and leaves them alone") {
  Tensor x = tensor<double>({1, 2, 3, 4}, {2, 2});
  Tensor running_mean = tensor<double>({1.0, -1.0}), running_var = tensor<double>({4.0, 0.25});
  Tensor weight = tensor<double>({2.0, 3.0}), bias = tensor<double>({0.5, -0.5});
  Tensor y = batch_norm(x, running_mean, running_var, weight, bias, /*training=*/false, 0.1, 0.0);
  check_close(values(y), {(1 - 1) / 2.0 * 2 + 0.5, (2 + 1) / 0.5 * 3 - 0.5, (3 - 1) / 2.0 * 2 + 0.5, (4 + 1) / 0.5 * 3 - 0.5},
              1e-12);
  CHECK(values(running_mean) == std::vector<double>{1.0, -1.0});
  CHECK(values(running_var) == std::vector<double>{4.0, 0.25});
}

TEST_CASE("batch_norm matches a float64 reference for every rank, both layouts, training and evaluation") {
  manual_seed(401);
  for (Shape shape : {Shape{8, 3}, Shape{4, 3, 5}, Shape{2, 3, 4, 5}, Shape{3, 16, 2, 2}, Shape{2, 4, 1, 1}}) {
    for (bool cl : {false, true}) {
      for (bool training : {true, false}) {
        CAPTURE(shape_str(shape));
        CAPTURE(cl);
        CAPTURE(training);
        const int64_t C = shape[1];
        Tensor x = randn(shape, {.dtype = kFloat64}) * 2 + 3;
        if (cl && shape.size() == 4) x = channels_last(x);
        std::vector<double> w = values(randn({C}, {.dtype = kFloat64})), b = values(randn({C}, {.dtype = kFloat64}));
        std::vector<double> rm = values(randn({C}, {.dtype = kFloat64})), rv = values(rand({C}, {.dtype = kFloat64}) + 0.5);
        Tensor running_mean = tensor(rm), running_var = tensor(rv);
        Tensor y = batch_norm(x, running_mean, running_var, tensor(w), tensor(b), training, 0.1, 1e-5);
        Reference r = training ? reference_batch_norm(x, w, b, nullptr, nullptr, 1e-5)
                               : reference_batch_norm(x, w, b, &rm, &rv, 1e-5);
        check_close(values(y), r.y, 1e-10);
        if (cl && shape.size() == 4 && shape[2] * shape[3] > 1) CHECK(is_channels_last_layout(y));
        if (training) {
          const double count = double(x.numel() / C);
          std::vector<double> want_mean, want_var;
          for (int64_t c = 0; c < C; ++c) {
            want_mean.push_back(0.9 * rm[size_t(c)] + 0.1 * r.mean[size_t(c)]);
            want_var.push_back(0.9 * rv[size_t(c)] + 0.1 * r.var[size_t(c)] * count / (count - 1));
          }
          check_close(values(running_mean), want_mean, 1e-12);
          check_close(values(running_var), want_var, 1e-12);
        }
      }
    }
  }
}

TEST_CASE("batch_norm gradients match finite differences in training and evaluation, both layouts") {
  manual_seed(402);
  for (bool training : {true, false}) {
    for (bool affine : {true, false}) {
      CAPTURE(training);
      CAPTURE(affine);
      Tensor rm = randn({3}, {.dtype = kFloat64}), rv = rand({3}, {.dtype = kFloat64}) + 0.5;
      auto f = [&](const TensorList& in) {
        return batch_norm(in[0], rm.clone(), rv.clone(), in[1], in[2], training, 0.1, 1e-5);
      };
      Tensor w = affine ? leaf({3}) : Tensor(), b = affine ? leaf({3}) : Tensor();
      gradcheck(f, {leaf({4, 3, 2, 3}, 2.0, 1.0), w, b});
      gradcheck(f, {leaf({6, 3}), w, b});
      gradcheck(f, {leaf({2, 3, 5}), w, b});
      // channels-last input: the kernels run on the NHWC layout directly
      Tensor x = leaf({2, 3, 3, 2});
      gradcheck([&](const TensorList& in) { return f({channels_last(in[0]), in[1], in[2]}); }, {x, w, b});
      // without running statistics in training: batch statistics only
      if (training) {
        gradcheck([&](const TensorList& in) { return batch_norm(in[0], Tensor(), Tensor(), in[1], in[2], true); },
                  {leaf({3, 3, 2}), w, b});
      }
    }
  }
}

TEST_CASE("batch_norm takes float16 and bfloat16 input with float32 parameters: float32 statistics, half output") {
  manual_seed(403);
  for (DType dt : {kFloat16, kBFloat16}) {
    for (bool cl : {false, true}) {
      const std::string dtype = dtype_name(dt);
      CAPTURE(dtype);
      CAPTURE(cl);
      // Values around 100 with spread 1: sums of squares in float16 would be meaningless.
      Tensor x = (randn({16, 4, 6, 6}) + 100.0).to(dt);
      if (cl) x = channels_last(x);
      Tensor weight = rand({4}) + 0.5, bias = randn({4});
      Tensor running_mean = zeros({4}), running_var = ones({4});
      Tensor y = batch_norm(x, running_mean, running_var, weight, bias, /*training=*/true);
      CHECK(y.dtype() == dt);
      CHECK(running_mean.dtype() == kFloat32);
      Reference r = reference_batch_norm(x.to(kFloat64), values(weight), values(bias), nullptr, nullptr, 1e-5);
      // One rounding of the output to dt (relative 2^-11 or 2^-8) on values of magnitude up to ~4.
      check_close(values(y), r.y, dt == kFloat16 ? 2e-3 : 1.6e-2);
      std::vector<double> want_mean;
      for (double m : r.mean) want_mean.push_back(0.1 * m);
      check_close(values(running_mean), want_mean, 1e-6);

      // Gradients reach the half input (in its dtype) and the float32 parameters (in theirs).
      Tensor xg = x.detach().requires_grad_(), wg = weight.detach().requires_grad_(), bg = bias.detach().requires_grad_();
      Tensor g = randn({16, 4, 6, 6});
      batch_norm(xg, Tensor(), Tensor(), wg, bg, true).backward(g.to(dt));
      Tensor x64 = x.to(kFloat64).requires_grad_(), w64 = weight.to(kFloat64).requires_grad_(),
             b64 = bias.to(kFloat64).requires_grad_();
      batch_norm(x64, Tensor(), Tensor(), w64, b64, true).backward(g.to(dt).to(kFloat64));
      CHECK(xg.grad().dtype() == dt);
      CHECK(wg.grad().dtype() == kFloat32);
      check_close(values(wg.grad()), values(w64.grad()), 1e-3);
      check_close(values(bg.grad()), values(b64.grad()), 1e-4);
      check_close(values(xg.grad()), values(x64.grad()), dt == kFloat16 ? 5e-3 : 3e-2);
    }
  }
}

TEST_CASE("batch_norm with everything in float16 (O3) converts parameters and statistics internally") {
  manual_seed(404);
  Tensor x = randn({8, 3, 4}).to(kFloat16);
  Tensor running_mean = zeros({3}, {.dtype = kFloat16}), running_var = ones({3}, {.dtype = kFloat16});
  Tensor weight = ones({3}, {.dtype = kFloat16}).requires_grad_();
  Tensor y = batch_norm(x, running_mean, running_var, weight, zeros({3}, {.dtype = kFloat16}), true);
  CHECK(y.dtype() == kFloat16);
  Reference r = reference_batch_norm(x.to(kFloat64), {}, {}, nullptr, nullptr, 1e-5);
  check_close(values(y), r.y, 2e-3);
  std::vector<double> want_mean;
  for (double m : r.mean) want_mean.push_back(0.1 * m);
  check_close(values(running_mean), want_mean, 1e-3);
  y.sum().backward();
  CHECK(weight.grad().dtype() == kFloat16);
}

TEST_CASE("batch_norm under autocast is left alone: half activations with float32 parameters") {
  Tensor x = randn({4, 2, 3}).to(kFloat16);
  amp::AutocastGuard guard(kFloat16);
  Tensor y = batch_norm(x, zeros({2}), ones({2}), ones({2}), zeros({2}), true);
  CHECK(y.dtype() == kFloat16);
  CHECK(batch_norm(randn({4, 2}), Tensor(), Tensor(), ones({2}), zeros({2}), true).dtype() == kFloat32);
}

TEST_CASE("batch_norm errors name the problem and the operands") {
  CHECK_THROWS_WITH_AS(batch_norm(randn({1, 3}), zeros({3}), ones({3}), Tensor(), Tensor(), true),
                       doctest::Contains("batch_norm: expected more than 1 value per channel when training, got input "
                                         "float32[1, 3] cpu"), Error);
  CHECK_THROWS_WITH_AS(batch_norm(randn({4, 3}), Tensor(), Tensor(), Tensor(), Tensor(), false),
                       doctest::Contains("evaluation mode (training = false) normalises with running_mean and running_var"),
                       Error);
  CHECK_THROWS_WITH_AS(batch_norm(randn({4, 3}), Tensor(), Tensor(), ones({4}), Tensor(), true),
                       doctest::Contains("batch_norm: expected weight to be a floating-point [3] tensor (one value per "
                                         "channel of input float32[4, 3] cpu), got float32[4] cpu"), Error);
  CHECK_THROWS_WITH_AS(batch_norm(randn({4}), Tensor(), Tensor(), Tensor(), Tensor(), true),
                       doctest::Contains("expected a floating-point input of shape [N, C] or [N, C, ...], got float32[4]"),
                       Error);
  CHECK_THROWS_WITH_AS(batch_norm(randn({4, 3}), zeros({3}), Tensor(), Tensor(), Tensor(), true),
                       doctest::Contains("must both be given"), Error);
}

TEST_CASE("batch_norm on a non-contiguous input (a transposed view) gives the contiguous result") {
  manual_seed(405);
  Tensor base = randn({5, 4, 3}, {.dtype = kFloat64});
  Tensor x = base.transpose(0, 2);  // [3, 4, 5], neither NCHW-contiguous nor channels last
  Tensor y = batch_norm(x, Tensor(), Tensor(), Tensor(), Tensor(), true);
  check_close(values(y), values(batch_norm(x.contiguous(), Tensor(), Tensor(), Tensor(), Tensor(), true)), 1e-12);
}

TEST_CASE("CUDA batch_norm matches the CPU: NCHW and NHWC, float32 and float16 with float32 parameters") {
#if HALFGRAD_WITH_CUDA
  SKIP_WITHOUT_GPU();
  manual_seed(406);
  for (DType dt : {kFloat32, kFloat16, kBFloat16, kFloat64}) {
    for (Shape shape : {Shape{32, 16, 8, 8}, Shape{4, 64, 3, 3}, Shape{256, 10}, Shape{2, 3, 200, 200}}) {
      for (bool cl : {false, true}) {
        for (bool training : {true, false}) {
          const std::string dtype = dtype_name(dt), dims = shape_str(shape);
          CAPTURE(dtype);
          CAPTURE(dims);
          CAPTURE(cl);
          CAPTURE(training);
          const int64_t C = shape[1];
          DType pt = dt == kFloat64 ? kFloat64 : kFloat32;
          Tensor x = (randn(shape) * 2 + 1).to(dt);
          if (cl && shape.size() == 4) x = channels_last(x);
          Tensor weight = (rand({C}) + 0.5).to(pt), bias = randn({C}).to(pt);
          Tensor rm = randn({C}).to(pt), rv = (rand({C}) + 0.5).to(pt);
          Tensor rm_g = rm.cuda(), rv_g = rv.cuda();
          // (.cuda() copies into a contiguous tensor: the channels-last layout is made again on the GPU)
          Tensor xc = x.detach().requires_grad_();
          Tensor xg = (cl && shape.size() == 4 ? channels_last(x.detach().cuda()) : x.detach().cuda()).requires_grad_();
          if (cl && shape.size() == 4) REQUIRE(is_channels_last_layout(xg));
          Tensor wc = weight.detach().requires_grad_(), wg = weight.detach().cuda().requires_grad_();
          Tensor bc = bias.detach().requires_grad_(), bg = bias.detach().cuda().requires_grad_();
          Tensor yc = batch_norm(xc, rm, rv, wc, bc, training);
          Tensor yg = batch_norm(xg, rm_g, rv_g, wg, bg, training);
          if (cl && shape.size() == 4) CHECK(is_channels_last_layout(yg));
          const double tol = dt == kFloat64 ? 1e-10 : dt == kFloat32 ? 1e-4 : dt == kFloat16 ? 4e-3 : 3e-2;
          check_close(values(yg.cpu()), values(yc), tol);
          check_close(values(rm_g.cpu()), values(rm), 1e-5);
          check_close(values(rv_g.cpu()), values(rv), 1e-5);
          Tensor g = randn(shape).to(dt);
          yc.backward(g);
          yg.backward(g.cuda());
          check_close(values(xg.grad().cpu()), values(xc.grad()), tol * 4);
          check_close(values(wg.grad().cpu()), values(wc.grad()), 1e-3);
          check_close(values(bg.grad().cpu()), values(bc.grad()), 1e-3);
        }
      }
    }
  }
#else
  MESSAGE("built without CUDA: skipped");
#endif
}

TEST_CASE("CUDA batch_norm: 16-byte and one-value paths, misaligned data, and a mean far larger than the spread") {
#if HALFGRAD_WITH_CUDA
  SKIP_WITHOUT_GPU();
  manual_seed(407);
  const BackendGuard own(BatchNormBackend::Own);  // ours, whatever Auto would pick (cuDNN's: the next case)
  // The kernels read 16 bytes at a time when the contiguous dim (S in NCHW, C in NHWC) is a multiple of the
  // vector (8 halves, 4 floats, 2 doubles) and the data are 16-byte aligned, else one value at a time.
  // [8, 24, 4, 4]: S = 16 and C = 24 take the vector path in both layouts; [6, 5, 3, 7]: S = 21, C = 5 do not;
  // offset 1: the same sizes one element past an aligned address, which must fall back to single values.
  for (DType dt : {kFloat32, kFloat16, kFloat64}) {
    for (Shape shape : {Shape{8, 24, 4, 4}, Shape{6, 5, 3, 7}}) {
      for (bool cl : {false, true}) {
        for (int64_t offset : {0, 1}) {
          const std::string dtype = dtype_name(dt), dims = shape_str(shape);
          CAPTURE(dtype);
          CAPTURE(dims);
          CAPTURE(cl);
          CAPTURE(offset);
          const int64_t C = shape[1];
          DType pt = dt == kFloat64 ? kFloat64 : kFloat32;
          Tensor x = (randn(shape) * 3 + 2).to(dt), g = randn(shape).to(dt);
          Tensor weight = (rand({C}) + 0.5).to(pt), bias = randn({C}).to(pt);
          // The GPU copies laid out as asked, starting `offset` elements into their storage.
          auto on_gpu = [&](const Tensor& t) {
            Tensor storage = zeros({t.numel() + offset}, {.dtype = dt, .device = Device::cuda(0)});
            Tensor flat = storage.narrow(0, offset, t.numel());
            Tensor placed = cl ? flat.view({shape[0], shape[2], shape[3], shape[1]}).permute({0, 3, 1, 2})
                               : flat.view(shape);
            NoGradGuard no_grad;
            placed.copy_(t.cuda());
            return placed;
          };
          Tensor xg = on_gpu(x).requires_grad_(), gg = on_gpu(g);
          REQUIRE(xg.offset() == offset);
          if (cl) REQUIRE(is_channels_last_layout(xg));
          Tensor wg = weight.cuda().requires_grad_(), bg = bias.cuda().requires_grad_();
          Tensor xc = x.detach().requires_grad_(), wc = weight.detach().requires_grad_(), bc = bias.detach().requires_grad_();
          Tensor yg = batch_norm(xg, Tensor(), Tensor(), wg, bg, true);
          Tensor yc = batch_norm(xc, Tensor(), Tensor(), wc, bc, true);
          yg.backward(gg);
          yc.backward(g);
          const double tol = dt == kFloat64 ? 1e-10 : dt == kFloat32 ? 1e-4 : 4e-3;
          check_close(values(yg.cpu()), values(yc), tol);
          check_close(values(xg.grad().cpu()), values(xc.grad()), tol * 4);
          check_close(values(wg.grad().cpu()), values(wc.grad()), 1e-3);
          check_close(values(bg.grad().cpu()), values(bc.grad()), 1e-3);
        }
      }
    }
  }

  for (bool cl : {false, true}) check_mean_far_larger_than_spread(cl);
#else
  MESSAGE("built without CUDA: skipped");
#endif
}

TEST_CASE("CUDA batch_norm counts each training batch once on every backend, Auto's timing runs aside, and at every "
          "replay of a graph") {
#if HALFGRAD_WITH_CUDA
  SKIP_WITHOUT_GPU();
  manual_seed(389);
  const Device cuda = Device::cuda(0);
  // Shapes no other case meets, so that Auto times both implementations here (float16 channels last: cuDNN takes
  // them). Each backend's own channel count keeps Auto's choices apart.
  // batch_norm, then batch_norm_relu keeping the mask, then keeping y (which cuDNN's fused kernels take).
  int64_t channels = 40;
  for (BatchNormBackend backend : {BatchNormBackend::Own, BatchNormBackend::Cudnn, BatchNormBackend::Auto}) {
    for (int form : {0, 1, 2}) {
      CAPTURE(int(backend));
      CAPTURE(form);
      const bool relu = form > 0;
      const BackendGuard guard(backend);
      channels += 8;
      const Tensor x = channels_last(randn({24, channels, 6, 6}).to(kFloat16).cuda());
      Tensor rm = zeros({channels}, {.device = cuda}), rv = ones({channels}, {.device = cuda});
      Tensor count = zeros({}, {.dtype = kInt64, .device = cuda});
      Tensor y = zeros_like(x);
      auto step = [&] {
        NoGradGuard no_grad;
        y.copy_(relu ? batch_norm_relu(x, rm, rv, Tensor(), Tensor(), true, 0.1, 1e-5, Tensor(), Tensor(),
                                       form == 1 ? ReluSaved::Mask : ReluSaved::Output, count)
                     : batch_norm(x, rm, rv, Tensor(), Tensor(), true, 0.1, 1e-5, Tensor(), count));
      };
      step();
      CHECK(count.cpu().item<int64_t>() == 1);
      step();
      CHECK(count.cpu().item<int64_t>() == 2);
      batch_norm(x, rm, rv, Tensor(), Tensor(), /*training=*/false, 0.1, 1e-5, Tensor(), count);
      CHECK(count.cpu().item<int64_t>() == 2);
      cuda::Graph graph;
      graph.capture(cuda, step);
      CHECK(count.cpu().item<int64_t>() == 2);  // capturing ran nothing
      for (int i = 0; i < 3; ++i) graph.replay();
      CHECK(count.cpu().item<int64_t>() == 5);
    }
  }
  CHECK_THROWS_WITH_AS(batch_norm(randn({4, 3, 2, 2}).cuda(), Tensor(), Tensor(), Tensor(), Tensor(), true, 0.1, 1e-5,
                                  Tensor(), zeros({}, {.dtype = kInt64})),
                       doctest::Contains("batch_norm: expected num_batches_tracked to be an int64 tensor of one element "
                                         "on the input's device (input float32[4, 3, 2, 2] cuda:0), got int64[] cpu"),
                       Error);
#else
  MESSAGE("built without CUDA: skipped");
#endif
}

TEST_CASE("CUDA batch_norm through cuDNN's kernels, and Auto's choice, match the CPU in both layouts") {
#if HALFGRAD_WITH_CUDA
  SKIP_WITHOUT_GPU();
  manual_seed(408);
  // float16/float32 training with contiguous runs (channels last: C, NCHW: H * W) of whole 16-byte vectors goes to
  // cuDNN (Cudnn) or to the faster of cuDNN and ours (Auto). The offsets: 0 and 16 bytes into the storage are
  // taken by cuDNN; 8 bytes is not (misaligned), nor are runs of 6 or 25 or 49 values, nor spatial size 1: those
  // run ours.
  for (BatchNormBackend backend : {BatchNormBackend::Cudnn, BatchNormBackend::Auto}) {
    const BackendGuard guard(backend);
    for (DType dt : {kFloat32, kFloat16}) {
      for (Shape shape : {Shape{32, 64, 8, 8}, Shape{16, 32, 7, 7}, Shape{8, 128, 4, 4}, Shape{8, 6, 5, 5},
                          Shape{64, 32, 1, 1}}) {
        for (int64_t offset_bytes : {0, 8, 16}) {
          for (bool cl : {true, false}) {
            for (bool affine : {true, false}) {
              const std::string dtype = dtype_name(dt), dims = shape_str(shape);
              CAPTURE(int(backend));
              CAPTURE(dtype);
              CAPTURE(dims);
              CAPTURE(offset_bytes);
              CAPTURE(cl);
              CAPTURE(affine);
              const int64_t C = shape[1], offset = offset_bytes / int64_t(element_size(dt));
              Tensor x = (randn(shape) * 2 + 1).to(dt), g = randn(shape).to(dt);
              Tensor weight = rand({C}) + 0.5, bias = randn({C});
              Tensor rm = randn({C}), rv = rand({C}) + 0.5;
              Tensor rm_g = rm.cuda(), rv_g = rv.cuda();
              auto on_gpu = [&](const Tensor& t) {  // in the layout, `offset` elements into its storage
                Tensor storage = zeros({t.numel() + offset}, {.dtype = dt, .device = Device::cuda(0)});
                Tensor flat = storage.narrow(0, offset, t.numel());
                Tensor placed = cl ? flat.view({shape[0], shape[2], shape[3], shape[1]}).permute({0, 3, 1, 2})
                                   : flat.view(shape);
                NoGradGuard no_grad;
                placed.copy_(t.cuda());
                return placed;
              };
              Tensor xg = on_gpu(x).requires_grad_(), gg = on_gpu(g);
              if (cl) REQUIRE(is_channels_last_layout(xg));
              Tensor xc = x.detach().requires_grad_();
              Tensor wc = weight.detach().requires_grad_(), wg = weight.cuda().requires_grad_();
              Tensor bc = bias.detach().requires_grad_(), bg = bias.cuda().requires_grad_();
              Tensor yc = affine ? batch_norm(xc, rm, rv, wc, bc, true)
                                 : batch_norm(xc, rm, rv, Tensor(), Tensor(), true);
              Tensor yg = affine ? batch_norm(xg, rm_g, rv_g, wg, bg, true)
                                 : batch_norm(xg, rm_g, rv_g, Tensor(), Tensor(), true);
              if (cl) CHECK(is_channels_last_layout(yg));
              const double tol = dt == kFloat32 ? 1e-4 : 4e-3;
              check_close(values(yg.cpu()), values(yc), tol);
              // One update each (Auto's timing runs must not have moved them).
              check_close(values(rm_g.cpu()), values(rm), 1e-5);
              check_close(values(rv_g.cpu()), values(rv), 1e-5);
              yc.backward(g);
              yg.backward(gg);
              check_close(values(xg.grad().cpu()), values(xc.grad()), tol * 4);
              if (affine) {
                check_close(values(wg.grad().cpu()), values(wc.grad()), 1e-3);
                check_close(values(bg.grad().cpu()), values(bc.grad()), 1e-3);
              }
            }
          }
        }
      }
    }
  }

  // Only the parameters' gradients wanted (cuDNN always computes the input's): ours runs, and is right.
  {
    const BackendGuard guard(BatchNormBackend::Cudnn);
    Tensor x = randn({16, 32, 4, 4}), g = randn({16, 32, 4, 4});
    Tensor w = rand({32}) + 0.5, b = randn({32});
    Tensor wc = w.detach().requires_grad_(), bc = b.detach().requires_grad_();
    Tensor wg = w.cuda().requires_grad_(), bg = b.cuda().requires_grad_();
    batch_norm(x, Tensor(), Tensor(), wc, bc, true).backward(g);
    batch_norm(channels_last(x.cuda()), Tensor(), Tensor(), wg, bg, true).backward(channels_last(g.cuda()));
    check_close(values(wg.grad().cpu()), values(wc.grad()), 1e-3);
    check_close(values(bg.grad().cpu()), values(bc.grad()), 1e-3);
  }

  // Auto may pick cuDNN for one direction and ours for the other: each backward must take the other's saved mean
  // and invstd (1 / sqrt(var + eps)). A float32 weight that is a view 4 bytes past an aligned address is not
  // taken by cuDNN (ours runs both directions).
  for (bool cl : {true, false}) {
    for (int variant = 0; variant < 3; ++variant) {  // cuDNN then ours, ours then cuDNN, misaligned weight
      const bool cudnn_forward = variant != 1, misaligned = variant == 2;
      CAPTURE(cl);
      CAPTURE(variant);
      Tensor x = randn({16, 32, 4, 4}) * 2 + 1, g = randn({16, 32, 4, 4});
      Tensor w_storage = rand({36}) + 0.5, b = randn({32});
      const int64_t w_offset = misaligned ? 1 : 0;
      Tensor w = w_storage.narrow(0, w_offset, 32);
      Tensor xc = x.detach().requires_grad_(), wc = w.detach().requires_grad_(), bc = b.detach().requires_grad_();
      Tensor xg = (cl ? channels_last(x.cuda()) : x.cuda()).requires_grad_();
      Tensor wg = w_storage.cuda().narrow(0, w_offset, 32).detach().requires_grad_(), bg = b.cuda().requires_grad_();
      REQUIRE((reinterpret_cast<uintptr_t>(wg.data_ptr()) % 16 != 0) == misaligned);
      Tensor yc = batch_norm(xc, Tensor(), Tensor(), wc, bc, true);
      Tensor yg;
      {
        const BackendGuard guard(cudnn_forward ? BatchNormBackend::Cudnn : BatchNormBackend::Own);
        yg = batch_norm(xg, Tensor(), Tensor(), wg, bg, true);
      }
      const BackendGuard guard(cudnn_forward && !misaligned ? BatchNormBackend::Own : BatchNormBackend::Cudnn);
      yc.backward(g);
      yg.backward(cl ? channels_last(g.cuda()) : g.cuda());
      check_close(values(yg.cpu()), values(yc), 1e-4);
      check_close(values(xg.grad().cpu()), values(xc.grad()), 4e-4);
      check_close(values(wg.grad().cpu()), values(wc.grad()), 1e-3);
      check_close(values(bg.grad().cpu()), values(bc.grad()), 1e-3);
    }
  }

  // A mean far larger than the spread, through cuDNN: its statistics must hold up as ours do.
  {
    const BackendGuard guard(BatchNormBackend::Cudnn);
    for (bool cl : {false, true}) check_mean_far_larger_than_spread(cl);
  }
#else
  MESSAGE("built without CUDA: skipped");
#endif
}

// ---- batch_norm_relu: relu(batch_norm(x) + residual) as one op

namespace {

// The separate ops batch_norm_relu stands for.
Tensor unfused_batch_norm_relu(const Tensor& x, const Tensor& rm, const Tensor& rv, const Tensor& w, const Tensor& b,
                               bool training, const Tensor& residual) {
  Tensor y = batch_norm(x, rm, rv, w, b, training);
  return (residual.defined() ? y + residual : y).relu();
}

// Forward values, the running statistics and (with `grads`) every gradient of batch_norm_relu against the separate
// ops, on `device`, with `tol` (0: bit for bit). Callers leave the gradients out where relu's mask may differ between
// the two: in float16 a sum within rounding of 0 may be positive on one side and 0 on the other. `saved`: what the
// fused op keeps for relu's backward.
void check_against_unfused(DType dt, Device device, bool cl, bool training, bool with_residual, double tol,
                           bool grads = true, const Shape& shape = {6, 8, 3, 5}, ReluSaved saved = ReluSaved::Mask) {
  const std::string dtype = dtype_name(dt), dims = shape_str(shape);
  const bool keeps_output = saved == ReluSaved::Output;
  CAPTURE(dtype);
  CAPTURE(dims);
  CAPTURE(keeps_output);
  CAPTURE(cl);
  CAPTURE(training);
  CAPTURE(with_residual);
  const int64_t C = shape[1];
  const DType pt = dt == kFloat64 ? kFloat64 : kFloat32;
  auto place = [&](const Tensor& t) { return cl ? channels_last(t.to(device)) : t.to(device); };
  Tensor x = place((randn(shape) * 2 + 0.5).to(dt)), z = place(randn(shape).to(dt)), g = place(randn(shape).to(dt));
  Tensor w = (rand({C}) + 0.5).to(pt).to(device), b = randn({C}).to(pt).to(device);
  Tensor rm = randn({C}).to(pt).to(device), rv = (rand({C}) + 0.5).to(pt).to(device);
  Tensor rm2 = rm.clone(), rv2 = rv.clone();
  auto leaves = [&] {
    return TensorList{x.detach().requires_grad_(), w.detach().requires_grad_(), b.detach().requires_grad_(),
                      z.detach().requires_grad_()};
  };
  TensorList f = leaves(), u = leaves();
  Tensor yf = batch_norm_relu(f[0], rm, rv, f[1], f[2], training, 0.1, 1e-5, with_residual ? f[3] : Tensor(),
                              Tensor(), saved);
  Tensor yu = unfused_batch_norm_relu(u[0], rm2, rv2, u[1], u[2], training, with_residual ? u[3] : Tensor());
  CHECK(yf.grad_fn()->name() == "BatchNormReluBackward");
  CHECK(yf.dtype() == dt);
  if (cl) CHECK(is_channels_last_layout(yf));
  check_close(values(yf.cpu()), values(yu.cpu()), tol);
  // one update each; on CUDA under Auto the two forms may run different kernels, whose statistics differ in the
  // last bit
  check_close(values(rm.cpu()), values(rm2.cpu()), tol == 0 ? 0 : 1e-6);
  check_close(values(rv.cpu()), values(rv2.cpu()), tol == 0 ? 0 : 1e-6);
  if (!grads) return;
  yf.backward(g);
  yu.backward(g);
  for (int k = 0; k < (with_residual ? 4 : 3); ++k) {
    CAPTURE(k);
    check_close(values(f[size_t(k)].grad().cpu()), values(u[size_t(k)].grad().cpu()), tol);
  }
  if (!with_residual) CHECK_FALSE(f[3].grad().defined());
}

}  // namespace

TEST_CASE("batch_norm_relu equals relu(batch_norm(x) + residual) bit for bit in float64 and float32 on the CPU") {
  manual_seed(420);
  for (DType dt : {kFloat64, kFloat32})
    for (bool cl : {false, true})
      for (bool training : {true, false})
        for (bool with_residual : {false, true})
          for (ReluSaved saved : {ReluSaved::Mask, ReluSaved::Output})
            check_against_unfused(dt, Device::cpu(), cl, training, with_residual, 0, true, {6, 8, 3, 5}, saved);
}

TEST_CASE("batch_norm_relu gradients match finite differences: input, weight, bias and residual, both layouts") {
  manual_seed(421);
  for (int form = 0; form < 4; ++form) {
    const bool training = form % 2 == 0;
    const ReluSaved saved = form < 2 ? ReluSaved::Mask : ReluSaved::Output;
    CAPTURE(training);
    CAPTURE(int(saved));
    Tensor rm = randn({3}, {.dtype = kFloat64}), rv = rand({3}, {.dtype = kFloat64}) + 0.5;
    auto f = [&](const TensorList& in) {
      return batch_norm_relu(in[0], rm.clone(), rv.clone(), in[1], in[2], training, 0.1, 1e-5, in[3], Tensor(), saved);
    };
    gradcheck(f, {leaf({4, 3, 2, 3}), leaf({3}), leaf({3}), leaf({4, 3, 2, 3})});
    gradcheck(f, {leaf({5, 3}), leaf({3}), leaf({3}), Tensor()});
    gradcheck([&](const TensorList& in) { return f({channels_last(in[0]), in[1], in[2], channels_last(in[3])}); },
              {leaf({2, 3, 3, 2}), leaf({3}), leaf({3}), leaf({2, 3, 3, 2})});
    // a residual in the other layout than the input
    gradcheck([&](const TensorList& in) { return f({channels_last(in[0]), in[1], in[2], in[3]}); },
              {leaf({2, 3, 3, 2}), Tensor(), Tensor(), leaf({2, 3, 3, 2})});
  }
}

TEST_CASE("batch_norm_relu rounds a float16 or bfloat16 result once, where the separate ops round twice") {
  manual_seed(422);
  for (DType dt : {kFloat16, kBFloat16}) {
    for (bool cl : {false, true}) {
      const std::string dtype = dtype_name(dt);
      CAPTURE(dtype);
      CAPTURE(cl);
      Tensor x = (randn({8, 4, 3, 3}) * 3).to(dt), z = randn({8, 4, 3, 3}).to(dt);
      if (cl) x = channels_last(x), z = channels_last(z);
      Tensor w = rand({4}) + 0.5, b = randn({4});
      Tensor y = batch_norm_relu(x, Tensor(), Tensor(), w, b, true, 0.1, 1e-5, z);
      CHECK(y.dtype() == dt);
      // The same inputs in float32 run the same float32 arithmetic (statistics, normalisation, add, relu) without a
      // rounding; rounded to dt at the end they are the half result bit for bit.
      Tensor once = batch_norm_relu(x.to(kFloat32), Tensor(), Tensor(), w, b, true, 0.1, 1e-5, z.to(kFloat32)).to(dt);
      check_close(values(y), values(once), 0);
      // the separate ops round bn's output before the add: somewhere that shows
      const std::vector<double> twice = values((batch_norm(x, Tensor(), Tensor(), w, b, true) + z).relu());
      const std::vector<double> fused = values(y);
      CHECK(twice != fused);
    }
  }
}

TEST_CASE("batch_norm_relu keeps relu's mask by default, not its output: an in-place change to the output leaves the "
          "gradients") {
  manual_seed(427);
  // 4 x 3 x 3 x 3 = 108 elements: a mask of 3 whole words and a partial one.
  Tensor x = randn({4, 3, 3, 3}), z = randn({4, 3, 3, 3}), g = randn({4, 3, 3, 3});
  TensorList want, got;
  for (bool change : {false, true}) {
    Tensor xl = x.detach().requires_grad_(), zl = z.detach().requires_grad_();
    Tensor y = batch_norm_relu(xl, Tensor(), Tensor(), Tensor(), Tensor(), true, 0.1, 1e-5, zl);
    if (change) {
      NoGradGuard no_grad;
      y.mul_(-1);  // every sign flipped: a mask read from y would now pass the other elements
    }
    y.backward(g);
    (change ? got : want) = TensorList{xl.grad(), zl.grad()};
  }
  check_close(values(got[0]), values(want[0]), 0);
  check_close(values(got[1]), values(want[1]), 0);
  // the residual's gradient is g where the (unchanged) output was positive
  const Tensor y = batch_norm_relu(x, Tensor(), Tensor(), Tensor(), Tensor(), true, 0.1, 1e-5, z);
  check_close(values(want[1]), values(where(y.gt(0), g, 0)), 0);
}

TEST_CASE("batch_norm_relu with ReluSaved::Output keeps its output: an in-place change to it before backward is an "
          "error") {
  // plain, with a folded input_bias (training), and with the input_bias added first (eval: the op is called again
  // on the sum, with `saved` passed on)
  for (int form = 0; form < 3; ++form) {
    CAPTURE(form);
    const bool training = form < 2;
    Tensor x = randn({4, 3, 2, 2}).requires_grad_(), ib = form > 0 ? randn({3}) : Tensor();
    Tensor rm = zeros({3}), rv = ones({3});
    Tensor y = batch_norm_relu(x, rm, rv, Tensor(), Tensor(), training, 0.1, 1e-5, Tensor(), ib, ReluSaved::Output);
    {
      NoGradGuard no_grad;
      y.mul_(2);
    }
    CHECK_THROWS_WITH_AS(y.sum().backward(), doctest::Contains("batch_norm_relu"), Error);
  }
}

namespace {

// batch_norm_relu keeping relu's mask and keeping its output give the same result and gradients bit for bit, for
// each set of wanted gradients, which decides the backward's passes: the residual's alone (the masked gradient only),
// the weight's alone (the masked sums without the apply), and all.
void check_relu_saved_forms_agree(Device device, DType dt, bool cl, const Shape& shape) {
  const std::string dtype = dtype_name(dt), dims = shape_str(shape);
  CAPTURE(dtype);
  CAPTURE(dims);
  CAPTURE(cl);
  auto place = [&](const Tensor& t) { return cl ? channels_last(t.to(device)) : t.to(device); };
  Tensor x = place((randn(shape) * 2).to(dt)), z = place(randn(shape).to(dt)), g = place(randn(shape).to(dt));
  Tensor w = (rand({shape[1]}) + 0.5).to(device);
  // which of x, the residual and the weight want gradients
  for (auto [x_grad, z_grad, w_grad] : {std::tuple{false, true, false}, {false, false, true}, {true, true, true},
                                        {true, false, false}}) {
    CAPTURE(x_grad);
    CAPTURE(z_grad);
    CAPTURE(w_grad);
    TensorList results[2];
    for (ReluSaved saved : {ReluSaved::Mask, ReluSaved::Output}) {
      Tensor xl = x.detach().requires_grad_(x_grad), zl = z.detach().requires_grad_(z_grad);
      Tensor wl = w.detach().requires_grad_(w_grad);
      Tensor y = batch_norm_relu(xl, Tensor(), Tensor(), wl, Tensor(), true, 0.1, 1e-5, zl, Tensor(), saved);
      y.backward(g);
      results[int(saved)] = {y.detach(), xl.grad(), zl.grad(), wl.grad()};
    }
    for (size_t k = 0; k < 4; ++k) {
      CAPTURE(k);
      REQUIRE(results[0][k].defined() == results[1][k].defined());
      if (results[0][k].defined()) check_close(values(results[1][k].cpu()), values(results[0][k].cpu()), 0);
    }
  }
}

}  // namespace

TEST_CASE("batch_norm_relu's two ReluSaved forms give the same values and gradients bit for bit") {
  manual_seed(429);
  // 4 x 3 x 3 x 3 = 108 elements: a mask of 3 whole words and a partial one
  for (bool cl : {false, true}) check_relu_saved_forms_agree(Device::cpu(), kFloat32, cl, {4, 3, 3, 3});
}

TEST_CASE("CUDA batch_norm_relu's two ReluSaved forms give the same values and gradients bit for bit where they run "
          "the same kernels") {
#if HALFGRAD_WITH_CUDA
  SKIP_WITHOUT_GPU();
  manual_seed(430);
  // our kernels, one value at a time and in 16-byte vectors, and more vectors than the grid's threads; cuDNN's plain
  // kernels (whose backward masks the gradient in a pass of ours) where they take the shape: float32 with rows or
  // planes of whole 16-byte vectors
  for (BatchNormBackend backend : {BatchNormBackend::Own, BatchNormBackend::Cudnn}) {
    const BackendGuard guard(backend);
    CAPTURE(int(backend));
    for (bool cl : {false, true}) {
      check_relu_saved_forms_agree(Device::cuda(0), kFloat32, cl, {4, 3, 3, 3});
      check_relu_saved_forms_agree(Device::cuda(0), kFloat32, cl, {8, 64, 4, 4});
      // Not float16 channels last under cuDNN, where the Output form runs cuDNN's fused kernels, which round y once
      // where its plain forward and our epilogue round twice: a y within rounding of 0 may then be 0 in one form and
      // positive in the other, and pass the gradient in one only. The CPU case below checks those kernels.
      if (backend == BatchNormBackend::Own || !cl) {
        check_relu_saved_forms_agree(Device::cuda(0), kFloat16, cl, {16, 64, 6, 6});
        check_relu_saved_forms_agree(Device::cuda(0), kFloat16, cl, {8, 64, 4, 4});  // planes cuDNN takes
      }
      check_relu_saved_forms_agree(Device::cuda(0), kBFloat16, cl, {64, 64, 32, 32});
    }
  }
#else
  MESSAGE("built without CUDA: skipped");
#endif
}

TEST_CASE("CUDA batch_norm_relu with ReluSaved::Output keeps no mask of ours: its node holds the mask's bytes less, "
          "where cuDNN's fused kernel with a residual keeps its own") {
#if HALFGRAD_WITH_CUDA
  SKIP_WITHOUT_GPU();
  manual_seed(431);
  const Shape shape{256, 64, 32, 32};  // ResNet-18's first stage at batch 256: a mask of 524,288 words
  const Tensor x = channels_last(randn(shape, {.device = Device::cuda(0)}).to(kFloat16));
  const Tensor z = channels_last(randn(shape, {.device = Device::cuda(0)}).to(kFloat16));
  const int64_t mask_bytes = ReluMask::words(x.numel()) * 4;
  for (BatchNormBackend backend : {BatchNormBackend::Own, BatchNormBackend::Cudnn}) {
    for (bool with_residual : {false, true}) {
      const BackendGuard guard(backend);
      CAPTURE(int(backend));
      CAPTURE(with_residual);
      int64_t held[2] = {0, 0};  // bytes the result and its node hold, by ReluSaved
      for (ReluSaved saved : {ReluSaved::Mask, ReluSaved::Output}) {
        Tensor xl = x.detach().requires_grad_();
        cuda::synchronize();
        const int64_t before = int64_t(cuda::memory_stats(0).requested_bytes);
        Tensor y = batch_norm_relu(xl, Tensor(), Tensor(), Tensor(), Tensor(), true, 0.1, 1e-5,
                                   with_residual ? z : Tensor(), Tensor(), saved);
        cuda::synchronize();
        held[int(saved)] = int64_t(cuda::memory_stats(0).requested_bytes) - before;
      }
      const int64_t kept_by_output = held[int(ReluSaved::Output)] - (held[int(ReluSaved::Mask)] - mask_bytes);
      if (backend == BatchNormBackend::Cudnn && with_residual) {
        // cuDNN's fused batch norm + add + relu keeps relu's mask in its reserve: a bit an element too, and 1,024
        // bytes more (cuDNN 9.14 and 9.19). Without the add its backward needs none: y > 0 is the mask.
        CHECK(kept_by_output >= mask_bytes);
        CHECK(kept_by_output <= mask_bytes + 4096);
      } else {
        CHECK(kept_by_output == 0);
      }
    }
  }
#else
  MESSAGE("built without CUDA: skipped");
#endif
}

TEST_CASE("batch_norm_relu with the fusion switched off runs the separate ops, with the same checks") {
  manual_seed(426);
  Tensor x = randn({4, 3, 2, 2}), z = randn({4, 3, 2, 2}), w = rand({3}) + 0.5, b = randn({3});
  const Tensor fused = batch_norm_relu(x, Tensor(), Tensor(), w, b, true, 0.1, 1e-5, z);
  set_batch_norm_relu_fusion(false);
  CHECK_FALSE(batch_norm_relu_fusion());
  Tensor xs = x.detach().requires_grad_();
  const Tensor separate = batch_norm_relu(xs, Tensor(), Tensor(), w, b, true, 0.1, 1e-5, z);
  CHECK(separate.grad_fn()->name() == "ReluBackward");
  check_close(values(separate), values(fused), 0);
  CHECK_THROWS_WITH_AS(batch_norm_relu(x, Tensor(), Tensor(), w, b, true, 0.1, 1e-5, randn({1, 3, 1, 1})),
                       doctest::Contains("batch_norm_relu: expected a floating-point residual"), Error);
  set_batch_norm_relu_fusion(true);
  CHECK(batch_norm_relu_fusion());
}

TEST_CASE("batch_norm_relu errors name the op and the operands") {
  Tensor x = randn({2, 3, 4, 4});
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string shape = message(
      [&] { batch_norm_relu(x, Tensor(), Tensor(), Tensor(), Tensor(), true, 0.1, 1e-5, randn({2, 3, 4})); });
  CHECK(shape.find("batch_norm_relu") != std::string::npos);
  CHECK(shape.find("residual") != std::string::npos);
  CHECK(shape.find("[2, 3, 4]") != std::string::npos);
  const std::string ints = message([&] {
    batch_norm_relu(x, Tensor(), Tensor(), Tensor(), Tensor(), true, 0.1, 1e-5, zeros({2, 3, 4, 4}, {.dtype = kInt64}));
  });
  CHECK(ints.find("floating-point residual") != std::string::npos);
  CHECK(message([&] { batch_norm_relu(randn({1, 3}), Tensor(), Tensor(), Tensor(), Tensor(), true); })
            .find("batch_norm_relu: expected more than 1 value per channel") != std::string::npos);
}

TEST_CASE("batch_norm_relu: only the residual's gradient wanted, and a float32 residual for a float64 input") {
  manual_seed(423);
  Tensor x = randn({4, 3, 2, 2}, {.dtype = kFloat64});
  Tensor z = randn({4, 3, 2, 2}).requires_grad_();  // float32: read in the input's dtype, its gradient cast back
  Tensor y = batch_norm_relu(x, Tensor(), Tensor(), Tensor(), Tensor(), true, 0.1, 1e-5, z);
  CHECK(y.dtype() == kFloat64);
  Tensor g = randn({4, 3, 2, 2}, {.dtype = kFloat64});
  y.backward(g);
  REQUIRE(z.grad().defined());
  CHECK(z.grad().dtype() == kFloat32);
  check_close(values(z.grad()), values(where(y.detach().gt(0), g, 0).to(kFloat32)), 0);
}

namespace {
// Subclasses that change forward: Sequential must call them, not fuse them.
struct DoubledBatchNorm : nn::BatchNorm2d {
  using nn::BatchNorm2d::BatchNorm2d;
  Tensor forward(const Tensor& x) override { return nn::BatchNorm2d::forward(x) * 2; }
};
struct CappedReLU : nn::ReLU {
  Tensor forward(const Tensor& x) override { return clamp(x, 0.0, 0.5); }
};
}  // namespace

TEST_CASE("Sequential fuses exactly a BatchNorm2d and a ReLU, not subclasses that override forward") {
  manual_seed(427);
  Tensor x = randn({2, 4, 3, 3});
  auto doubled = nn::sequential({std::make_shared<DoubledBatchNorm>(4), std::make_shared<nn::ReLU>()});
  Tensor y = doubled->forward(x);
  CHECK(y.grad_fn()->name() == "ReluBackward");  // the subclass's forward, then relu
  check_close(values(y), values((nn::BatchNorm2d(4).forward(x) * 2).relu()), 1e-6);
  auto capped = nn::sequential({std::make_shared<nn::BatchNorm2d>(4), std::make_shared<CappedReLU>()});
  Tensor c = capped->forward(x);
  CHECK(values(c.max()).front() <= 0.5);
  CHECK(c.grad_fn()->name() != "BatchNormReluBackward");
}

TEST_CASE("Sequential runs a BatchNorm2d followed by a ReLU as batch_norm_relu, with the same values and gradients") {
  manual_seed(424);
  auto conv = std::make_shared<nn::Conv2d>(3, 4, 3, nn::Conv2dOptions{.padding = {1, 1}}, /*bias=*/false);
  auto bn = std::make_shared<nn::BatchNorm2d>(4);
  auto seq = nn::sequential({conv, bn, std::make_shared<nn::ReLU>()});
  Tensor x = randn({2, 3, 5, 5});
  Tensor y = seq->forward(x);
  CHECK(y.grad_fn()->name() == "BatchNormReluBackward");
  y.sum().backward();
  Tensor fused_grad = conv->weight.grad().clone();
  conv->weight.set_grad(Tensor());
  // the modules one by one: batch_norm, then relu (the running statistics move a second time: same batch)
  Tensor u = bn->forward(conv->forward(x)).relu();
  CHECK(u.grad_fn()->name() != "BatchNormReluBackward");
  check_close(values(y), values(u), 0);
  u.sum().backward();
  check_close(values(conv->weight.grad()), values(fused_grad), 0);
}

TEST_CASE("CUDA batch_norm_relu matches the separate ops and the CPU, ours and cuDNN's, every dtype and layout") {
#if HALFGRAD_WITH_CUDA
  SKIP_WITHOUT_GPU();
  manual_seed(425);
  for (BatchNormBackend backend : {BatchNormBackend::Own, BatchNormBackend::Cudnn, BatchNormBackend::Auto}) {
    const BackendGuard guard(backend);
    CAPTURE(int(backend));
    for (bool cl : {false, true})
      for (bool training : {true, false})
        for (bool with_residual : {false, true}) {
          // float32 and float64: the same arithmetic as the separate ops (cuDNN's forward is cuDNN's either way)
          for (ReluSaved saved : {ReluSaved::Mask, ReluSaved::Output}) {
            check_against_unfused(kFloat64, Device::cuda(0), cl, training, with_residual, 1e-12, true, {6, 8, 3, 5},
                                  saved);
            check_against_unfused(kFloat32, Device::cuda(0), cl, training, with_residual, 1e-5, true, {6, 8, 3, 5},
                                  saved);
          }
          // float16: one rounding instead of two with a residual; without one the same values (relu commutes with
          // rounding) when both sides run the same implementation
          check_against_unfused(kFloat16, Device::cuda(0), cl, training, with_residual, 4e-3,
                                !with_residual && backend != BatchNormBackend::Auto);
        }
    // NCHW planes of whole 16-byte vectors (the shapes above run one value at a time there)
    check_against_unfused(kFloat32, Device::cuda(0), false, true, true, 1e-5, true, {8, 16, 4, 4});
    // more vectors than the grid's threads: each warp stores relu's mask words on several trips of the loop (in
    // float64, whose 65,536-value sums the two forms add in different orders without a visible difference)
    // (and the mask the backward makes from a kept y, on as many trips)
    for (ReluSaved saved : {ReluSaved::Mask, ReluSaved::Output}) {
      check_against_unfused(kFloat64, Device::cuda(0), true, true, true, 1e-10, true, {64, 64, 32, 32}, saved);
      check_against_unfused(kFloat16, Device::cuda(0), false, true, false, 4e-3, backend != BatchNormBackend::Auto,
                            {8, 16, 4, 4}, saved);
      check_against_unfused(kFloat16, Device::cuda(0), true, true, false, 4e-3, backend != BatchNormBackend::Auto,
                            {8, 64, 4, 4}, saved);
    }
  }
  // Only the weight needs a gradient: the masked sums without the apply pass.
  {
    manual_seed(428);
    Tensor x = channels_last(randn({16, 64, 6, 6})), z = channels_last(randn({16, 64, 6, 6}));
    Tensor g = randn({16, 64, 6, 6}), w = rand({64}) + 0.5;
    Tensor wg = w.cuda().requires_grad_(), wc = w.detach().requires_grad_();
    batch_norm_relu(channels_last(x.cuda()), Tensor(), Tensor(), wg, Tensor(), true, 0.1, 1e-5, channels_last(z.cuda()))
        .backward(g.cuda());
    batch_norm_relu(x, Tensor(), Tensor(), wc, Tensor(), true, 0.1, 1e-5, z).backward(g);
    check_close(values(wg.grad().cpu()), values(wc.grad()), 1e-3);
  }
  // Against the CPU at a shape cuDNN takes (channels last, 64 channels), every gradient. The reference backward takes
  // relu's mask from the GPU's output: in float16 and bfloat16 a sum within rounding of 0 may come out 0 on one side
  // and one ulp above on the other (cuDNN's output is rounded before the residual is added), and the mask is y's.
  // (ReluSaved::Output in float16 under cuDNN: its fused kernels)
  for (auto [backend, saved] : {std::pair{BatchNormBackend::Own, ReluSaved::Mask},
                                {BatchNormBackend::Own, ReluSaved::Output},
                                {BatchNormBackend::Cudnn, ReluSaved::Mask},
                                {BatchNormBackend::Cudnn, ReluSaved::Output}}) {
    const BackendGuard guard(backend);
    for (DType dt : {kFloat32, kFloat16, kBFloat16}) {
      const std::string dtype = dtype_name(dt);
      const bool keeps_output = saved == ReluSaved::Output;
      CAPTURE(int(backend));
      CAPTURE(keeps_output);
      CAPTURE(dtype);
      const Shape shape{16, 64, 6, 6};
      Tensor x = channels_last((randn(shape) * 2).to(dt)), z = channels_last(randn(shape).to(dt));
      Tensor g = channels_last(randn(shape).to(dt)), w = rand({64}) + 0.5, b = randn({64});
      auto leaves = [&](Device d) {  // new leaves on d; channels last again on the GPU (.to copies contiguous)
        TensorList in;
        for (const Tensor& t : {x, w, b, z}) {
          Tensor placed = t.detach().to(d);
          in.push_back((t.dim() == 4 && d.is_cuda() ? channels_last(placed) : placed).requires_grad_());
        }
        return in;
      };
      TensorList gpu = leaves(Device::cuda(0)), c = leaves(Device::cpu());
      Tensor yg = batch_norm_relu(gpu[0], Tensor(), Tensor(), gpu[1], gpu[2], true, 0.1, 1e-5, gpu[3], Tensor(), saved);
      yg.backward(channels_last(g.cuda()));
      Tensor yc = batch_norm_relu(c[0], Tensor(), Tensor(), c[1], c[2], true, 0.1, 1e-5, c[3]);
      const double tol = dt == kFloat32 ? 1e-4 : dt == kFloat16 ? 4e-3 : 3e-2;
      check_close(values(yg.cpu()), values(yc), tol);
      // the reference: batch_norm(x) + z on the CPU, given the gradient that passes the GPU's mask
      const Tensor passed = where(yg.detach().cpu().gt(0), g, 0);
      (batch_norm(c[0], Tensor(), Tensor(), c[1], c[2], true) + c[3]).backward(passed);
      check_close(values(gpu[0].grad().cpu()), values(c[0].grad()), tol * 4);
      check_close(values(gpu[1].grad().cpu()), values(c[1].grad()), 1e-3 + tol);
      check_close(values(gpu[2].grad().cpu()), values(c[2].grad()), 1e-3 + tol);
      check_close(values(gpu[3].grad().cpu()), values(passed), 0);
      // and the masks differ only where the CPU's output is within rounding of 0
      const std::vector<double> ycv = values(yc), ygv = values(yg.cpu());
      int flips = 0;
      for (size_t i = 0; i < ycv.size(); ++i) flips += (ycv[i] > 0) != (ygv[i] > 0) && std::abs(ycv[i]) > tol;
      CHECK(flips == 0);
    }
  }
  // Only the residual needs a gradient: the mask alone.
  {
    Tensor x = randn({8, 16, 4, 4}, {.device = Device::cuda(0)});
    Tensor z = randn({8, 16, 4, 4}, {.device = Device::cuda(0)}).requires_grad_();
    Tensor y = batch_norm_relu(x, Tensor(), Tensor(), Tensor(), Tensor(), true, 0.1, 1e-5, z);
    Tensor g = randn({8, 16, 4, 4}, {.device = Device::cuda(0)});
    y.backward(g);
    check_close(values(z.grad().cpu()), values(where(y.detach().gt(0), g, 0).cpu()), 0);
  }
#else
  MESSAGE("built without CUDA: skipped");
#endif
}

TEST_CASE("CUDA batch_norm_relu on cuDNN's fused kernels matches the CPU without affine parameters and with only "
          "some gradients wanted") {
#if HALFGRAD_WITH_CUDA
  SKIP_WITHOUT_GPU();
  manual_seed(432);
  // float16 channels last keeping y: cuDNN's fused forward. Its backward runs where the input's gradient is wanted (a
  // scratch gradient for the residual where that one is not); elsewhere ours runs after it, reading y.
  const BackendGuard guard(BatchNormBackend::Cudnn);
  const Shape shape{16, 64, 6, 6};
  const double tol = 4e-3;
  Tensor x = channels_last((randn(shape) * 2).to(kFloat16)), z = channels_last(randn(shape).to(kFloat16));
  Tensor g = channels_last(randn(shape).to(kFloat16)), w = rand({64}) + 0.5, b = randn({64});
  for (auto [affine, x_grad, z_grad] : {std::tuple{false, true, true}, {true, true, false}, {true, false, true},
                                        {false, false, true}}) {
    CAPTURE(affine);
    CAPTURE(x_grad);
    CAPTURE(z_grad);
    auto leaf = [](const Tensor& t, Device d, bool grad) {
      Tensor placed = t.detach().to(d);
      return (t.dim() == 4 && d.is_cuda() ? channels_last(placed) : placed).requires_grad_(grad);
    };
    const Device cuda = Device::cuda(0), cpu = Device::cpu();
    Tensor xg = leaf(x, cuda, x_grad), zg = leaf(z, cuda, z_grad), xc = leaf(x, cpu, x_grad), zc = leaf(z, cpu, z_grad);
    Tensor wg = affine ? leaf(w, cuda, true) : Tensor(), bg = affine ? leaf(b, cuda, true) : Tensor();
    Tensor wc = affine ? leaf(w, cpu, true) : Tensor(), bc = affine ? leaf(b, cpu, true) : Tensor();
    Tensor yg = batch_norm_relu(xg, Tensor(), Tensor(), wg, bg, true, 0.1, 1e-5, zg, Tensor(), ReluSaved::Output);
    yg.backward(channels_last(g.cuda()));
    Tensor yc = batch_norm_relu(xc, Tensor(), Tensor(), wc, bc, true, 0.1, 1e-5, zc);
    check_close(values(yg.cpu()), values(yc), tol);
    // the reference gradients, given the gradient that passes the GPU's mask (as the case above)
    const Tensor passed = where(yg.detach().cpu().gt(0), g, 0);
    (batch_norm(xc, Tensor(), Tensor(), wc, bc, true) + zc).backward(passed);
    if (x_grad) check_close(values(xg.grad().cpu()), values(xc.grad()), tol * 4);
    if (z_grad) check_close(values(zg.grad().cpu()), values(passed), 0);
    if (affine) {
      check_close(values(wg.grad().cpu()), values(wc.grad()), 1e-3 + tol);
      check_close(values(bg.grad().cpu()), values(bc.grad()), 1e-3 + tol);
    }
    CHECK(xg.grad().defined() == x_grad);
    CHECK(zg.grad().defined() == z_grad);
  }
#else
  MESSAGE("built without CUDA: skipped");
#endif
}

// ---- input_bias: a convolution's bias folded into the batch norm after it

namespace {

// batch_norm or batch_norm_relu of (x + input_bias), folded or formed by hand, with running statistics of their own.
struct BiasedRun {
  Tensor y, x, input_bias, running_mean, running_var;
};
BiasedRun run_biased(const Tensor& x, const Tensor& input_bias, const Tensor& w, const Tensor& b, bool relu,
                     bool training, bool folded, const Tensor& g) {
  BiasedRun r{.y = Tensor(),
              .x = x.detach().requires_grad_(),
              .input_bias = input_bias.detach().requires_grad_(),
              .running_mean = full({x.size(1)}, 0.5, {.dtype = w.dtype(), .device = x.device()}),
              .running_var = full({x.size(1)}, 2.0, {.dtype = w.dtype(), .device = x.device()})};
  Shape per_channel{1, x.size(1), 1, 1};
  const Tensor in = folded ? r.x : r.x + r.input_bias.to(x.dtype()).view(per_channel);
  const Tensor ib = folded ? r.input_bias : Tensor();
  r.y = relu ? batch_norm_relu(in, r.running_mean, r.running_var, w, b, training, 0.1, 1e-5, Tensor(), ib)
             : batch_norm(in, r.running_mean, r.running_var, w, b, training, 0.1, 1e-5, ib);
  r.y.backward(g);
  return r;
}

}  // namespace

TEST_CASE("batch_norm's input_bias gives batch_norm(input + input_bias): values, running statistics, gradients") {
  manual_seed(430);
  const TensorOptions f64{.dtype = kFloat64};
  for (bool cl : {false, true})
    for (bool relu : {false, true})
      for (bool training : {true, false}) {
        CAPTURE(cl);
        CAPTURE(relu);
        CAPTURE(training);
        Tensor x = randn({4, 3, 3, 2}, f64) * 2 + 1, g = randn({4, 3, 3, 2}, f64);
        if (cl) x = channels_last(x);
        const Tensor input_bias = randn({3}, f64) * 3;  // far from zero: a fold that dropped it would show
        const Tensor w = rand({3}, f64) + 0.5, b = randn({3}, f64);
        const BiasedRun folded = run_biased(x, input_bias, w, b, relu, training, true, g);
        const BiasedRun separate = run_biased(x, input_bias, w, b, relu, training, false, g);
        check_close(values(folded.y), values(separate.y), 1e-12);
        check_close(values(folded.running_mean), values(separate.running_mean), 1e-12);
        check_close(values(folded.running_var), values(separate.running_var), 1e-12);
        check_close(values(folded.x.grad()), values(separate.x.grad()), 1e-11);
        if (training) {
          // The sum of the input's gradient over each channel: zero exactly, where the separate ops' sum has the
          // rounding error of adding values that cancel.
          check_close(values(folded.input_bias.grad()), std::vector<double>(3, 0.0), 0);
          check_close(values(separate.input_bias.grad()), std::vector<double>(3, 0.0), 1e-12);
        } else {
          // eval: the sum is formed, and its gradient is the input's gradient summed over each channel
          check_close(values(folded.input_bias.grad()), values(separate.input_bias.grad()), 1e-12);
          CHECK(values(folded.input_bias.grad().abs().sum()).front() > 0.1);
        }
      }
}

TEST_CASE("batch_norm's input_bias: gradients match finite differences, with and without relu, both modes") {
  manual_seed(431);
  for (bool training : {true, false}) {
    CAPTURE(training);
    Tensor rm = randn({3}, {.dtype = kFloat64}), rv = rand({3}, {.dtype = kFloat64}) + 0.5;
    gradcheck([&](const TensorList& in) {
      return batch_norm(in[0], rm.clone(), rv.clone(), in[1], in[2], training, 0.1, 1e-5, in[3]);
    }, {leaf({4, 3, 2, 3}, 2.0, 1.0), leaf({3}), leaf({3}), leaf({3}, 3.0)});
    gradcheck([&](const TensorList& in) {
      return batch_norm_relu(channels_last(in[0]), rm.clone(), rv.clone(), in[1], in[2], training, 0.1, 1e-5,
                             channels_last(in[4]), in[3]);
    }, {leaf({2, 3, 3, 2}), leaf({3}), leaf({3}), leaf({3}, 3.0), leaf({2, 3, 3, 2})});
  }
}

TEST_CASE("batch_norm's input_bias with the fold switched off is added first, with the same checks") {
  manual_seed(432);
  Tensor x = randn({4, 3, 2, 2}), g = randn({4, 3, 2, 2}), ib = randn({3}), w = rand({3}) + 0.5, b = randn({3});
  set_batch_norm_input_bias_fold(false);
  CHECK_FALSE(batch_norm_input_bias_fold());
  const BiasedRun off = run_biased(x, ib, w, b, true, true, true, g);
  const BiasedRun separate = run_biased(x, ib, w, b, true, true, false, g);
  CHECK_THROWS_WITH_AS(batch_norm(x, Tensor(), Tensor(), w, b, true, 0.1, 1e-5, randn({4})),
                       doctest::Contains("batch_norm: expected input_bias to be a floating-point [3] tensor"), Error);
  set_batch_norm_input_bias_fold(true);
  CHECK(batch_norm_input_bias_fold());
  // the same ops as the separate ones, so the same values bit for bit, the gradient's rounding error included
  check_close(values(off.y), values(separate.y), 0);
  check_close(values(off.input_bias.grad()), values(separate.input_bias.grad()), 0);
  check_close(values(off.x.grad()), values(separate.x.grad()), 0);
  check_close(values(off.running_mean), values(separate.running_mean), 0);
  check_close(values(off.running_var), values(separate.running_var), 0);
}

TEST_CASE("batch_norm_relu with the relu fusion off still folds its input_bias") {
  manual_seed(435);
  const TensorOptions f64{.dtype = kFloat64};
  Tensor x = randn({4, 3, 2, 2}, f64), g = randn({4, 3, 2, 2}, f64), ib = randn({3}, f64) * 3;
  Tensor w = rand({3}, f64) + 0.5, b = randn({3}, f64);
  const BiasedRun fused = run_biased(x, ib, w, b, true, true, true, g);
  set_batch_norm_relu_fusion(false);
  const BiasedRun separate_relu = run_biased(x, ib, w, b, true, true, true, g);
  set_batch_norm_relu_fusion(true);
  CHECK(separate_relu.y.grad_fn()->name() == "ReluBackward");
  check_close(values(separate_relu.y), values(fused.y), 1e-12);
  check_close(values(separate_relu.running_mean), values(fused.running_mean), 1e-12);
  check_close(values(separate_relu.x.grad()), values(fused.x.grad()), 1e-11);
  check_close(values(separate_relu.input_bias.grad()), std::vector<double>(3, 0.0), 0);
}

TEST_CASE("batch_norm's input_bias errors name the op, the operand and the shapes") {
  Tensor x = randn({2, 3, 4, 4});
  for (bool training : {true, false}) {
    CAPTURE(training);
    CHECK_THROWS_WITH_AS(batch_norm(x, zeros({3}), ones({3}), Tensor(), Tensor(), training, 0.1, 1e-5, randn({2})),
                         doctest::Contains("batch_norm: expected input_bias to be a floating-point [3] tensor (one "
                                           "value per channel of input"),
                         Error);
    CHECK_THROWS_WITH_AS(
        batch_norm_relu(x, zeros({3}), ones({3}), Tensor(), Tensor(), training, 0.1, 1e-5, Tensor(),
                        zeros({3}, {.dtype = kInt64})),
        doctest::Contains("batch_norm_relu: expected input_bias to be a floating-point [3] tensor"), Error);
  }
}

TEST_CASE("Sequential folds a Conv2d's bias into the BatchNorm2d after it, training and eval, with or without ReLU") {
  manual_seed(433);
  const TensorOptions f64{.dtype = kFloat64};
  for (bool relu : {false, true}) {
    CAPTURE(relu);
    auto conv = std::make_shared<nn::Conv2d>(3, 4, 3, nn::Conv2dOptions{.padding = {1, 1}}, true, f64);
    {
      NoGradGuard no_grad;
      conv->bias.copy_(randn({4}, f64) * 2);  // not its zero-free default only: a bias far from zero
    }
    auto bn = std::make_shared<nn::BatchNorm2d>(4, nn::BatchNormOptions{}, f64);
    auto seq = relu ? nn::sequential({conv, bn, std::make_shared<nn::ReLU>()}) : nn::sequential({conv, bn});
    Tensor x = randn({2, 3, 5, 5}, f64), g = randn({2, 4, 5, 5}, f64);
    for (bool training : {true, false}) {
      CAPTURE(training);
      seq->train(training);
      const Tensor mean_before = bn->running_mean.clone(), var_before = bn->running_var.clone();
      Tensor y = seq->forward(x);
      CHECK(y.grad_fn()->name() == (relu ? "BatchNormReluBackward" : "BatchNormBackward"));
      y.backward(g);
      const Tensor weight_grad = conv->weight.grad().clone(), bias_grad = conv->bias.grad().clone();
      const Tensor mean_after = bn->running_mean.clone(), var_after = bn->running_var.clone();
      conv->weight.set_grad(Tensor());
      conv->bias.set_grad(Tensor());
      // the modules one by one from the same running statistics
      {
        NoGradGuard no_grad;
        bn->running_mean.copy_(mean_before);
        bn->running_var.copy_(var_before);
      }
      Tensor u = bn->forward(conv->forward(x));
      if (relu) u = u.relu();
      u.backward(g);
      check_close(values(y), values(u), 1e-12);
      check_close(values(mean_after), values(bn->running_mean), 1e-12);
      check_close(values(var_after), values(bn->running_var), 1e-12);
      check_close(values(weight_grad), values(conv->weight.grad()), 1e-11);
      if (training) {
        check_close(values(bias_grad), std::vector<double>(4, 0.0), 0);
      } else {
        check_close(values(bias_grad), values(conv->bias.grad()), 1e-11);
      }
      conv->weight.set_grad(Tensor());
      conv->bias.set_grad(Tensor());
    }
  }
}

TEST_CASE("Sequential's fold with momentum None, without affine parameters, and without running statistics") {
  manual_seed(436);
  const TensorOptions f64{.dtype = kFloat64};
  const std::vector<nn::BatchNormOptions> variants = {{.momentum = std::nullopt}, {.affine = false},
                                                      {.track_running_stats = false}};
  for (const nn::BatchNormOptions& options : variants) {
    for (bool training : {true, false}) {
      CAPTURE(options.affine);
      CAPTURE(options.track_running_stats);
      CAPTURE(training);
      auto conv = std::make_shared<nn::Conv2d>(3, 4, 3, nn::Conv2dOptions{.padding = {1, 1}}, true, f64);
      {
        NoGradGuard no_grad;
        conv->bias.copy_(randn({4}, f64) * 2);
      }
      auto bn = std::make_shared<nn::BatchNorm2d>(4, options, f64);
      auto seq = nn::sequential({conv, bn, std::make_shared<nn::ReLU>()});
      seq->train(training);
      Tensor x = randn({2, 3, 5, 5}, f64), g = randn({2, 4, 5, 5}, f64);
      // three steps: momentum None averages over the batches so far (1/1, 1/2, 1/3)
      std::vector<Tensor> folded_means;
      for (int step = 0; step < 3; ++step) {
        seq->forward(x * double(step + 1)).backward(g);
        if (options.track_running_stats) folded_means.push_back(bn->running_mean.clone());
      }
      const Tensor bias_grad = conv->bias.grad().clone(), weight_grad = conv->weight.grad().clone();
      conv->weight.set_grad(Tensor());
      conv->bias.set_grad(Tensor());
      if (options.track_running_stats) bn->reset_running_stats();
      for (int step = 0; step < 3; ++step) {
        bn->forward(conv->forward(x * double(step + 1))).relu().backward(g);
        if (options.track_running_stats) {
          check_close(values(folded_means[size_t(step)]), values(bn->running_mean), 1e-12);
        }
      }
      check_close(values(weight_grad), values(conv->weight.grad()), 1e-10);
      // batch statistics (training, or no running statistics at all): folded, a zero gradient
      if (training || !options.track_running_stats) {
        check_close(values(bias_grad), std::vector<double>(4, 0.0), 0);
      } else {
        check_close(values(bias_grad), values(conv->bias.grad()), 1e-10);
      }
    }
  }
}

TEST_CASE("batch_norm's input_bias with everything in float16 (O3): the running mean close to the separate ops'") {
  manual_seed(437);
  const TensorOptions f16{.dtype = kFloat16};
  const Tensor x = randn({8, 4, 3, 3}, f16), g = randn({8, 4, 3, 3}, f16), ib = (randn({4}) * 3).to(kFloat16);
  const Tensor w = (rand({4}) + 0.5).to(kFloat16), b = randn({4}, f16);
  const BiasedRun folded = run_biased(x, ib, w, b, true, true, true, g);
  const BiasedRun separate = run_biased(x, ib, w, b, true, true, false, g);
  CHECK(folded.running_mean.dtype() == kFloat16);
  check_close(values(folded.running_mean), values(separate.running_mean), 2e-3);
  check_close(values(folded.running_var), values(separate.running_var), 2e-3);
  check_close(values(folded.y), values(separate.y), 1e-2);
}

TEST_CASE("CUDA batch_norm's input_bias matches the CPU: float16 channels last with a float32 bias, ours and cuDNN's") {
#if HALFGRAD_WITH_CUDA
  SKIP_WITHOUT_GPU();
  manual_seed(434);
  for (BatchNormBackend backend : {BatchNormBackend::Own, BatchNormBackend::Cudnn}) {
    const BackendGuard guard(backend);
    for (bool relu : {false, true}) {
      CAPTURE(int(backend));
      CAPTURE(relu);
      const Shape shape{16, 64, 6, 6};
      const Tensor x = channels_last(randn(shape).to(kFloat16)), g = channels_last(randn(shape).to(kFloat16));
      const Tensor ib = randn({64}) * 2, w = rand({64}) + 0.5, b = randn({64});
      const Device gpu = Device::cuda(0);
      const BiasedRun on_gpu = run_biased(channels_last(x.cuda()), ib.cuda(), w.cuda(), b.cuda(), relu, true, true,
                                          channels_last(g.cuda()));
      // the reference: the sum formed in float64 on the CPU
      const BiasedRun on_cpu = run_biased(x.to(kFloat64), ib.to(kFloat64), w.to(kFloat64), b.to(kFloat64), relu,
                                          true, false, g.to(kFloat64));
      CHECK(on_gpu.y.dtype() == kFloat16);
      CHECK(on_gpu.y.device() == gpu);
      check_close(values(on_gpu.y.cpu()), values(on_cpu.y), 4e-3);
      check_close(values(on_gpu.running_mean.cpu()), values(on_cpu.running_mean), 1e-5);
      check_close(values(on_gpu.running_var.cpu()), values(on_cpu.running_var), 1e-4);
      check_close(values(on_gpu.x.grad().cpu()), values(on_cpu.x.grad()), 2e-2);
      REQUIRE(on_gpu.input_bias.grad().defined());
      CHECK(on_gpu.input_bias.grad().dtype() == kFloat32);
      check_close(values(on_gpu.input_bias.grad().cpu()), std::vector<double>(64, 0.0), 0);
    }
  }
#endif
}

// dropout (seeded Philox masks: reproducible, thread-count independent, the same on CPU and CUDA, reused by
// the backward) and embedding (gather forward, scatter-add backward, padding_idx, index errors).
#include <doctest/doctest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/autocast.h"
#include "core/cuda.h"
#include "core/random.h"
#include "halfgrad.h"
#include "ops/dropout.h"
#include "ops/embedding.h"
#include "tests/gradcheck.h"
#include "tests/testing.h"

using namespace halfgrad;
using halfgrad::testing::values;
using halfgrad::testing::gradcheck;
using halfgrad::testing::leaf;

namespace {
}  // namespace

// ---------------------------------------------------------------------------------------------------
// dropout
// ---------------------------------------------------------------------------------------------------

TEST_CASE("dropout in evaluation, or with p = 0, returns its input itself") {
  Tensor x = randn({3, 4});
  CHECK(dropout(x, 0.5, /*training=*/false).same(x));
  CHECK(dropout(x, 0.0).same(x));
}

TEST_CASE("dropout zeroes about p of the elements and scales the survivors by exactly 1 / (1 - p)") {
  manual_seed(201);
  for (double p : {0.1, 0.5, 0.9}) {
    CAPTURE(p);
    Tensor x = rand({100000}, {.dtype = kFloat64}) + 1.0;  // never 0: a zero in the output means dropped
    std::vector<double> in = values(x), out = values(dropout(x, p));
    int64_t dropped = 0;
    for (size_t i = 0; i < in.size(); ++i) {
      if (out[i] == 0) {
        ++dropped;
      } else if (out[i] != in[i] * (1.0 / (1.0 - p))) {
        FAIL_CHECK("element " << i << ": " << out[i] << " is not " << in[i] << " / (1 - p)");
        break;
      }
    }
    // Binomial(100000, p): the standard deviation is at most 158, so 5 of them is 800.
    CHECK(std::abs(double(dropped) - p * 100000) < 800);
  }
}

TEST_CASE("dropout masks follow the documented Philox stream: element i keeps iff uniform(counter i/4, lane i%4) < 1 - p") {
  manual_seed(202);
  const GeneratorState state = next_random_counters(0);  // where the next call starts
  manual_seed(202);
  Tensor x = ones({1001}, {.dtype = kFloat32});
  std::vector<double> out = values(dropout(x, 0.3));
  for (int64_t i = 0; i < 1001; ++i) {
    const Philox::U4 r = Philox::generate(state.seed, state.offset + uint64_t(i / 4));
    const bool keep = Philox::uniform(r.x[i % 4]) < float(0.7);
    if ((out[size_t(i)] != 0) != keep) {
      FAIL_CHECK("element " << i << " of the mask differs from the Philox stream");
      break;
    }
  }
}

TEST_CASE("dropout is reproducible: the same seed gives the same mask, the next call a new one") {
  Tensor x = randn({64, 65});
  manual_seed(7);
  Tensor a = dropout(x, 0.4), b = dropout(x, 0.4);
  manual_seed(7);
  Tensor c = dropout(x, 0.4);
  CHECK(values(a) == values(c));
  CHECK(values(a) != values(b));
}

TEST_CASE("dropout masks do not depend on the number of threads") {
  Tensor x = ones({300001});
  const int threads = omp_get_max_threads();
  manual_seed(9);
  Tensor many = dropout(x, 0.5);
  omp_set_num_threads(1);
  manual_seed(9);
  Tensor one = dropout(x, 0.5);
  omp_set_num_threads(threads);
  CHECK(values(many) == values(one));
}

TEST_CASE("dropout backward applies the forward's mask and scale to the gradient") {
  manual_seed(203);
  Tensor x = (rand({40, 30}) + 1.0).requires_grad_();
  Tensor y = dropout(x, 0.25);
  Tensor g = randn({40, 30});
  y.backward(g);
  std::vector<double> yv = values(y), gv = values(g), grad = values(x.grad());
  for (size_t i = 0; i < yv.size(); ++i) {
    const double want = yv[i] == 0 ? 0.0 : gv[i] / 0.75;
    REQUIRE(grad[i] == doctest::Approx(want).epsilon(1e-6));
  }
  // With the generator re-seeded inside f, each evaluation sees the same mask: gradcheck applies.
  gradcheck([](const TensorList& in) {
    manual_seed(11);
    return dropout(in[0], 0.3);
  }, {leaf({4, 5})});
}

TEST_CASE("dropout multiplies a dropped element by 0: a dropped inf or nan gives nan, forward and backward, as PyTorch") {
  std::vector<Device> devices{Device::cpu()};
  if (cuda::is_available()) devices.push_back(Device::cuda());
  for (const Device device : devices) {
    const std::string where = device.str();
    CAPTURE(where);
    const Tensor x = full({64}, INFINITY, {.device = device}).requires_grad_();
    manual_seed(206);
    const Tensor y = dropout(x, 0.5);
    y.backward(full({64}, NAN, {.device = device}));
    const std::vector<double> yv = values(y.cpu()), gv = values(x.grad().cpu());
    const auto infs = std::count(yv.begin(), yv.end(), INFINITY);
    const auto nans = std::count_if(yv.begin(), yv.end(), [](double v) { return std::isnan(v); });
    CHECK(infs > 0);
    CHECK(nans > 0);
    CHECK(infs + nans == 64);  // kept: inf * 2; dropped: inf * 0
    CHECK(std::all_of(gv.begin(), gv.end(), [](double v) { return std::isnan(v); }));
  }
}

TEST_CASE("dropout with p = 1 multiplies by 0: zeros and zero gradients, nan from inf or nan, p outside [0, 1] is an "
          "error") {
  Tensor x = randn({5}).requires_grad_();
  Tensor y = dropout(x, 1.0);
  CHECK(y.abs().sum().item<double>() == 0.0);
  y.sum().backward();
  CHECK(x.grad().abs().sum().item<double>() == 0.0);
  const Tensor overflowed = tensor<float>({INFINITY, 1, NAN}).requires_grad_();
  dropout(overflowed, 1.0).backward(tensor<float>({1, NAN, 1}));
  CHECK(std::isnan(dropout(overflowed, 1.0)[0].item<double>()));  // as at any p < 1: the scaler sees the overflow
  CHECK(dropout(overflowed, 1.0)[1].item<double>() == 0.0);
  CHECK(std::isnan(overflowed.grad()[1].item<double>()));
  CHECK_THROWS_WITH_AS(dropout(x, 1.5), doctest::Contains("dropout: probability has to be between 0 and 1, got 1.5"), Error);
  CHECK_THROWS_WITH_AS(dropout(arange(3), 0.5), doctest::Contains("dropout: expected a floating-point input, got int64[3]"),
                       Error);
}

TEST_CASE("dropout keeps float16 and bfloat16, scaling in float32 and rounding once") {
  for (DType dt : {kFloat16, kBFloat16}) {
    manual_seed(204);
    Tensor x = randn({1000}).to(dt);
    manual_seed(205);
    std::vector<double> got = values(dropout(x, 0.2));
    manual_seed(205);
    std::vector<double> wide = values(dropout(x.to(kFloat32), 0.2).to(dt));  // same mask, float32 then rounded
    CHECK(got == wide);
  }
}

TEST_CASE("CUDA dropout gives the CPU's mask for the same seed, forward and backward") {
#if HALFGRAD_WITH_CUDA
  SKIP_WITHOUT_GPU();
  for (DType dt : {kFloat32, kFloat16, kFloat64}) {
    const std::string dtype = dtype_name(dt);
    CAPTURE(dtype);
    Tensor x = (rand({1234, 7}) + 1.0).to(dt);
    Tensor xc = x.detach().requires_grad_(), xg = x.detach().cuda().requires_grad_();
    manual_seed(42);
    Tensor yc = dropout(xc, 0.35);
    manual_seed(42);
    Tensor yg = dropout(xg, 0.35);
    CHECK(values(yg.cpu()) == values(yc));
    Tensor g = randn({1234, 7}).to(dt);
    yc.backward(g);
    yg.backward(g.cuda());
    CHECK(values(xg.grad().cpu()) == values(xc.grad()));
  }
#else
  MESSAGE("built without CUDA: skipped");
#endif
}

// ---------------------------------------------------------------------------------------------------
// embedding
// ---------------------------------------------------------------------------------------------------

TEST_CASE("embedding gathers weight rows: indices [...] give [..., D]") {
  Tensor weight = arange(0, 12, 1, {.dtype = kFloat32}).view({4, 3});
  Tensor idx = tensor<int64_t>({3, 0, 0, 2, 1, 3}, {2, 3});
  Tensor out = embedding(idx, weight);
  CHECK(out.shape() == Shape{2, 3, 3});
  CHECK(out.dtype() == kFloat32);
  CHECK(values(out) == std::vector<double>{9, 10, 11, 0, 1, 2, 0, 1, 2, 6, 7, 8, 3, 4, 5, 9, 10, 11});
  // int32 indices and a 0-d index work too.
  CHECK(values(embedding(tensor<int32_t>({2}), weight)) == std::vector<double>{6, 7, 8});
  CHECK(embedding(scalar_tensor(int64_t(1), {.dtype = kInt64}), weight).shape() == Shape{3});
}

TEST_CASE("embedding backward adds the gradient of every use of a row, padding_idx rows get none") {
  Tensor weight = randn({5, 2}).requires_grad_();
  Tensor idx = tensor<int64_t>({1, 4, 1, 1, 0});
  Tensor g = tensor<float>({1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, {5, 2});
  embedding(idx, weight, /*padding_idx=*/0).backward(g);
  CHECK(values(weight.grad()) == std::vector<double>{0, 0, 1 + 5 + 7, 2 + 6 + 8, 0, 0, 0, 0, 3, 4});
  // A negative padding_idx counts from V.
  weight.set_grad(Tensor());
  embedding(idx, weight, /*padding_idx=*/-1).backward(g);
  CHECK(values(weight.grad()) == std::vector<double>{9, 10, 1 + 5 + 7, 2 + 6 + 8, 0, 0, 0, 0, 0, 0});
}

TEST_CASE("embedding gradients match finite differences") {
  manual_seed(206);
  Tensor idx = tensor<int64_t>({2, 0, 2, 3, 3, 3}, {3, 2});
  gradcheck([&](const TensorList& in) { return embedding(idx, in[0]); }, {leaf({4, 3})});
  // Rows wider than one thread's share (the CPU backward splits columns among threads).
  Tensor wide_idx = randint(0, 6, {50});
  gradcheck([&](const TensorList& in) { return embedding(wide_idx, in[0]); }, {leaf({6, 130})});
}

TEST_CASE("embedding accumulates float16 gradients in float32") {
  // 3000 uses of one row, each adding 1: float16 stops counting at 2048 (spacing 2 above it).
  Tensor weight = zeros({2, 4}, {.dtype = kFloat16}).requires_grad_();
  Tensor idx = zeros({3000}, {.dtype = kInt64});
  Tensor out = embedding(idx, weight);
  CHECK(out.dtype() == kFloat16);
  out.backward(ones({3000, 4}, {.dtype = kFloat16}));
  CHECK(weight.grad().dtype() == kFloat16);
  // (Checked row by row: GCC 12.2 at -O2 -march=native on AVX-512 miscompiles the braced list
  // {3000, 3000, 3000, 3000, 0, 0, 0, 0} into eight 3000s.)
  CHECK(values(weight.grad()[0]) == std::vector<double>(4, 3000.0));
  CHECK(values(weight.grad()[1]) == std::vector<double>(4, 0.0));
}

TEST_CASE("embedding errors name the bad index, its position and the number of rows") {
  Tensor weight = randn({10, 4});
  CHECK_THROWS_WITH_AS(embedding(tensor<int64_t>({3, 10, 1}), weight),
                       doctest::Contains("embedding: index 10 at position 1 is out of range for a weight of 10 rows"), Error);
  CHECK_THROWS_WITH_AS(embedding(tensor<int64_t>({-1}), weight), doctest::Contains("index -1"), Error);
  CHECK_THROWS_WITH_AS(embedding(tensor<float>({1.f}), weight),
                       doctest::Contains("embedding: expected integer indices (int64, int32 or uint8), got float32[1]"),
                       Error);
  CHECK_THROWS_WITH_AS(embedding(tensor<int64_t>({1}), randn({10})),
                       doctest::Contains("expected a floating-point weight of shape [V, D], got float32[10]"), Error);
  CHECK_THROWS_WITH_AS(embedding(tensor<int64_t>({1}), weight, 10),
                       doctest::Contains("embedding: padding_idx 10 is out of range for a weight of 10 rows"), Error);
  // A weight of no columns gives no values, but its indices are still checked.
  CHECK(embedding(tensor<int64_t>({9, 0}), randn({10, 0})).shape() == Shape{2, 0});
  CHECK_THROWS_WITH_AS(embedding(tensor<int64_t>({2, 12}), randn({10, 0})),
                       doctest::Contains("embedding: index 12 at position 1 is out of range for a weight of 10 rows"),
                       Error);
}

TEST_CASE("cuda: embedding checks the indices of a weight of no columns, as the CPU, with an error it can go on from") {
  SKIP_WITHOUT_GPU();
  const Tensor weight = randn({10, 0}).cuda();
  CHECK(embedding(tensor<int64_t>({9, 0}).cuda(), weight).shape() == Shape{2, 0});
  CHECK_THROWS_WITH_AS(embedding(tensor<int64_t>({2, 12}).cuda(), weight),
                       doctest::Contains("embedding: index 12 at position 1 is out of range for a weight of 10 rows"),
                       Error);
  CHECK(values(embedding(tensor<int64_t>({1}).cuda(), randn({10, 2}).cuda()).cpu()).size() == 2);  // the GPU goes on
}

TEST_CASE("CUDA embedding matches the CPU, forward and backward") {
#if HALFGRAD_WITH_CUDA
  SKIP_WITHOUT_GPU();
  manual_seed(207);
  for (DType dt : {kFloat32, kFloat16, kBFloat16, kFloat64}) {
    const std::string dtype = dtype_name(dt);
    CAPTURE(dtype);
    Tensor weight = randn({50, 33}).to(dt);
    Tensor idx = randint(0, 50, {8, 16});
    Tensor wc = weight.detach().requires_grad_(), wg = weight.detach().cuda().requires_grad_();
    Tensor oc = embedding(idx, wc, 7), og = embedding(idx.cuda(), wg, 7);
    CHECK(values(og.cpu()) == values(oc));
    Tensor g = randn({8, 16, 33}).to(dt);
    oc.backward(g);
    og.backward(g.cuda());
    // Both accumulate in float32 (float64); only the order of the additions differs.
    std::vector<double> a = values(wg.grad().cpu()), b = values(wc.grad());
    for (size_t i = 0; i < a.size(); ++i) REQUIRE(a[i] == doctest::Approx(b[i]).epsilon(dt == kFloat64 ? 1e-12 : 1e-2));
  }
#else
  MESSAGE("built without CUDA: skipped");
#endif
}

// ---------------------------------------------------------------------------------------------------
// index_select, one_hot
// ---------------------------------------------------------------------------------------------------

TEST_CASE("index_select gathers slices along any dim, in the index's order, in any dtype, as PyTorch's") {
  const Tensor x = arange(24).view({2, 3, 4});
  const Tensor idx = tensor<int64_t>({2, 0, 2});
  const Tensor along1 = x.index_select(1, idx);
  CHECK(along1.shape() == Shape{2, 3, 4});
  CHECK(along1.dtype() == kInt64);
  CHECK(values(along1.select(0, 0)) == std::vector<double>{8, 9, 10, 11, 0, 1, 2, 3, 8, 9, 10, 11});
  CHECK(values(x.index_select(-1, tensor<int32_t>({3, 0}))) ==
        std::vector<double>{3, 0, 7, 4, 11, 8, 15, 12, 19, 16, 23, 20});
  CHECK(values(x.index_select(0, tensor<int32_t>({1})).flatten()) == values(x.select(0, 1).flatten()));
  CHECK(x.index_select(2, tensor<int64_t>({})).shape() == Shape{2, 3, 0});
  CHECK(x.index_select(1, scalar_tensor(1, {.dtype = kInt64})).shape() == Shape{2, 1, 4});  // a 0-d index is one value
  CHECK(values(scalar_tensor(7.0).index_select(0, tensor<int64_t>({0}))) == std::vector<double>{7});
  CHECK(scalar_tensor(7.0).index_select(0, tensor<int64_t>({0})).dim() == 0);
  CHECK(x.index_select(1, idx).is_contiguous());
  const Tensor flags = tensor<bool>({true, false, true});
  CHECK(values(flags.index_select(0, tensor<int64_t>({1, 2}))) == std::vector<double>{0, 1});
  CHECK(values(flags.view({1, 3}).index_select(1, tensor<int64_t>({2, 1}))) == std::vector<double>{1, 0});
  // A strided x along a dim other than the first: read where it lies, x's elements in their logical places.
  const Tensor transposed = x.transpose(0, 2);  // [4, 3, 2]
  CHECK(values(transposed.index_select(1, idx)) == values(transposed.contiguous().index_select(1, idx)));
  CHECK(values(transposed.index_select(2, tensor<int64_t>({1}))) == values(x.select(0, 1).t().flatten()));
}

TEST_CASE("index_select refuses bad indices, naming the op, the index and the dim") {
  const Tensor x = randn({2, 3});
  CHECK_THROWS_WITH_AS(x.index_select(1, tensor<int64_t>({0, 3})),
                       doctest::Contains("index_select: index 3 at position 1 is out of range for dim 1 of size 3 of "
                                         "float32[2, 3] cpu"), Error);
  CHECK_THROWS_WITH_AS(x.index_select(0, tensor<int64_t>({-1})), doctest::Contains("index_select: index -1"), Error);
  CHECK_THROWS_WITH_AS(x.index_select(0, tensor<float>({0})),
                       doctest::Contains("index_select: expected a 1-D int64 or int32 index, got float32[1]"), Error);
  CHECK_THROWS_WITH_AS(x.index_select(0, tensor<uint8_t>({0})), doctest::Contains("int64 or int32 index"), Error);
  CHECK_THROWS_WITH_AS(x.index_select(0, tensor<int64_t>({0, 1}, {1, 2})), doctest::Contains("1-D int64 or int32"),
                       Error);
  CHECK_THROWS_WITH_AS(x.index_select(2, tensor<int64_t>({0})), doctest::Contains("index_select"), Error);
  CHECK_THROWS_WITH_AS(scalar_tensor(1.0).index_select(0, tensor<int64_t>({0, 0})),
                       doctest::Contains("index_select: the index of a 0-d input must hold one value"), Error);
  // A dim of no columns around it: still checked.
  CHECK_THROWS_WITH_AS(zeros({0, 3}).index_select(1, tensor<int64_t>({5})), doctest::Contains("index 5"), Error);
}

TEST_CASE("index_select's gradient adds each selected slice's gradient into the slice it came from") {
  Tensor x = arange(6).to(kFloat64).view({2, 3}).requires_grad_();
  x.index_select(1, tensor<int64_t>({2, 2, 0})).mul(tensor<double>({1, 10, 100}, {1, 3})).sum().backward();
  CHECK(values(x.grad()) == std::vector<double>{100, 0, 11, 100, 0, 11});
  manual_seed(361);
  const Tensor idx = tensor<int64_t>({1, 0, 1, 3});
  gradcheck([&](const TensorList& in) { return in[0].index_select(2, idx); }, {leaf({2, 3, 4})});
  gradcheck([&](const TensorList& in) { return in[0].index_select(0, idx); }, {leaf({4, 3})});
  gradcheck([&](const TensorList& in) { return in[0].t().index_select(1, idx); }, {leaf({4, 2})});  // strided input
  // The result is a tensor of its own, not a view: in place on it is allowed, and autograd sees the write.
  Tensor base = tensor<double>({1, 2, 3}).requires_grad_();
  for (int64_t dim : {0, -1}) {
    Tensor picked = base.index_select(dim, tensor<int64_t>({2, 0}));
    picked.mul_(2);
    picked.sum().backward();
  }
  CHECK(values(base.grad()) == std::vector<double>{4, 0, 4});
  Tensor h = randn({4}).to(kFloat16).requires_grad_();
  h.index_select(0, idx).sum().backward();
  CHECK(h.grad().dtype() == kFloat16);
  CHECK(values(h.grad()) == std::vector<double>{1, 2, 0, 1});
}

TEST_CASE("one_hot: int64 [..., classes] with PyTorch's inference and checks") {
  CHECK(values(one_hot(tensor<int64_t>({0, 2, 1}), 4)) == std::vector<double>{1, 0, 0, 0, 0, 0, 1, 0, 0, 1, 0, 0});
  const Tensor inferred = one_hot(tensor<int64_t>({1, 0, 3, 1}, {2, 2}));
  CHECK(inferred.shape() == Shape{2, 2, 4});
  CHECK(inferred.dtype() == kInt64);
  CHECK(one_hot(tensor<int64_t>({}), 3).shape() == Shape{0, 3});
  CHECK_THROWS_WITH_AS(one_hot(tensor<int64_t>({}), -1), doctest::Contains("num_classes cannot be inferred"), Error);
  CHECK_THROWS_WITH_AS(one_hot(tensor<int64_t>({}), 0), doctest::Contains("num_classes cannot be inferred"), Error);
  CHECK(one_hot(tensor<int64_t>({0, 0}), 1).shape() == Shape{2, 1});
  CHECK_THROWS_WITH_AS(one_hot(tensor<int64_t>({0, 5}), 5),
                       doctest::Contains("one_hot: index 5 of int64[2] cpu is out of range for 5 classes"), Error);
  CHECK_THROWS_WITH_AS(one_hot(tensor<int64_t>({-1}), 5), doctest::Contains("one_hot: index -1"), Error);
  CHECK_THROWS_WITH_AS(one_hot(tensor<int32_t>({1}), 5), doctest::Contains("one_hot: expected int64 indices"), Error);
}

TEST_CASE("CUDA index_select and one_hot match the CPU, forward and backward") {
  SKIP_WITHOUT_GPU();
  manual_seed(362);
  for (DType dt : {kFloat32, kFloat16, kFloat64, kInt64, kUInt8}) {
    CAPTURE(std::string(dtype_name(dt)));
    const Tensor x = (randn({3, 5, 7}) * 20).to(dt);
    for (int64_t dim : {0, 1, 2}) {
      const Tensor i = randint(0, x.size(dim), {9});
      CHECK(values(x.cuda().index_select(dim, i.cuda()).cpu()) == values(x.index_select(dim, i)));
      const Tensor strided = x.transpose(0, 2);  // read where it lies along dims 1 and 2
      const Tensor j = randint(0, strided.size(dim), {4});
      CHECK(values(strided.cuda().index_select(dim, j.cuda()).cpu()) == values(strided.index_select(dim, j)));
    }
  }
  Tensor xc = randn({6, 4}).requires_grad_(), xg = xc.detach().cuda().requires_grad_();
  const Tensor repeated = tensor<int64_t>({3, 3, 0, 2, 3});
  const Tensor g = randn({6, 5});
  xc.index_select(1, repeated).backward(g);
  xg.index_select(1, repeated.cuda()).backward(g.cuda());
  halfgrad::testing::check_close(values(xg.grad().cpu()), values(xc.grad()), 1e-6);
  // No columns around the dim: no element for the kernel to check an index by, checked on the host, as on the CPU.
  CHECK_THROWS_WITH_AS(zeros({0, 3}).cuda().index_select(1, tensor<int64_t>({5}).cuda()),
                       doctest::Contains("index_select: index 5"), Error);
  const Tensor labels = tensor<int64_t>({3, 0, 2});
  CHECK(values(one_hot(labels.cuda(), 5).cpu()) == values(one_hot(labels, 5)));
  CHECK(values(one_hot(labels.cuda()).cpu()) == values(one_hot(labels)));
}

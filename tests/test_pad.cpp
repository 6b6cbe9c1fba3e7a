// pad (ops/pad.h): torch.nn.functional.pad's values in each mode, negative amounts, its rules and their errors, the
// gradient against finite differences (and to the second order), memory formats, and CUDA against the CPU.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/cuda.h"
#include "core/int_divider.h"
#include "halfgrad.h"
#include "ops/pad.h"
#include "tests/gradcheck.h"
#include "tests/testing.h"

using namespace halfgrad;
using halfgrad::testing::gradcheck;
using halfgrad::testing::gradgradcheck;
using halfgrad::testing::leaf;
using halfgrad::testing::values;

namespace {
const Tensor kOneTwoThree = tensor<double>({1, 2, 3}).view({1, 3});  // [channels 1, width 3]
const std::vector<PadMode> kModes = {PadMode::Constant, PadMode::Reflect, PadMode::Replicate, PadMode::Circular};
}  // namespace

TEST_CASE("pad: each mode's values along one dim, as PyTorch's F.pad") {
  CHECK(values(pad(kOneTwoThree, {2, 2})) == std::vector<double>{0, 0, 1, 2, 3, 0, 0});
  CHECK(values(pad(kOneTwoThree, {2, 1}, PadMode::Constant, 9)) == std::vector<double>{9, 9, 1, 2, 3, 9});
  CHECK(values(pad(kOneTwoThree, {2, 2}, PadMode::Reflect)) == std::vector<double>{3, 2, 1, 2, 3, 2, 1});
  CHECK(values(pad(kOneTwoThree, {2, 2}, PadMode::Replicate)) == std::vector<double>{1, 1, 1, 2, 3, 3, 3});
  CHECK(values(pad(kOneTwoThree, {2, 2}, PadMode::Circular)) == std::vector<double>{2, 3, 1, 2, 3, 1, 2});
  CHECK(values(pad(kOneTwoThree, {3, 3}, PadMode::Circular)) == std::vector<double>{1, 2, 3, 1, 2, 3, 1, 2, 3});
  CHECK(pad(kOneTwoThree, {2, 2}).shape() == Shape{1, 7});
  // Only the last dim: {left, right}; the dims before keep their sizes.
  CHECK(pad(zeros({2, 3, 4}), {1, 2}).shape() == Shape{2, 3, 7});
  CHECK(pad(zeros({2, 3, 4}), {1, 2, 3, 4}).shape() == Shape{2, 10, 7});
  CHECK(pad(zeros({2, 3, 4}), {1, 2, 3, 4, 5, 6}).shape() == Shape{13, 10, 7});
}

TEST_CASE("pad: two dims of an image in each mode, the corners taken from both") {
  // [1 2 3]
  // [4 5 6]
  const Tensor image = tensor<double>({1, 2, 3, 4, 5, 6}).view({1, 1, 2, 3});
  CHECK(values(pad(image, {1, 1, 1, 1}, PadMode::Reflect)) ==
        std::vector<double>{5, 4, 5, 6, 5, 2, 1, 2, 3, 2, 5, 4, 5, 6, 5, 2, 1, 2, 3, 2});
  CHECK(values(pad(image, {1, 1, 1, 0}, PadMode::Replicate)) ==
        std::vector<double>{1, 1, 2, 3, 3, 1, 1, 2, 3, 3, 4, 4, 5, 6, 6});
  CHECK(values(pad(image, {1, 0, 0, 1}, PadMode::Circular)) == std::vector<double>{3, 1, 2, 3, 6, 4, 5, 6, 3, 1, 2, 3});
  CHECK(values(pad(image, {0, 1, 1, 0}, PadMode::Constant, -1)) ==
        std::vector<double>{-1, -1, -1, -1, 1, 2, 3, -1, 4, 5, 6, -1});
  // Three dims of a volume, unbatched [C, D, H, W].
  const Tensor volume = arange(8, {.dtype = kFloat64}).view({1, 2, 2, 2});
  const Tensor v = pad(volume, {1, 1, 1, 1, 1, 1}, PadMode::Replicate);
  CHECK(v.shape() == Shape{1, 4, 4, 4});
  CHECK(values(v.select(1, 0).select(1, 0)) == std::vector<double>{0, 0, 1, 1});
  CHECK(values(v.select(1, 3).select(1, 3)) == std::vector<double>{6, 6, 7, 7});
}

TEST_CASE("pad: a negative amount removes elements from its side, as PyTorch's kernels") {
  const Tensor x = tensor<double>({1, 2, 3, 4, 5}).view({1, 5});
  CHECK(values(pad(x, {-1, -2})) == std::vector<double>{2, 3});
  CHECK(values(pad(x, {-2, 1}, PadMode::Constant, 7)) == std::vector<double>{3, 4, 5, 7});
  // Reflect and replicate still mirror at (or repeat) the input's own edge.
  CHECK(values(pad(x, {-1, 2}, PadMode::Reflect)) == std::vector<double>{2, 3, 4, 5, 4, 3});
  CHECK(values(pad(x, {-2, 1}, PadMode::Replicate)) == std::vector<double>{3, 4, 5, 5});
  CHECK(values(pad(x, {2, -1}, PadMode::Replicate)) == std::vector<double>{1, 1, 1, 2, 3, 4});
  // Circular repeats what is left after the removal: [2 3 4 5] and then its start.
  CHECK(values(pad(x, {-1, 2}, PadMode::Circular)) == std::vector<double>{2, 3, 4, 5, 2, 3});
  CHECK(values(pad(x, {2, -2}, PadMode::Circular)) == std::vector<double>{2, 3, 1, 2, 3});
  CHECK(pad(x, {-3, -2}).shape() == Shape{1, 0});
}

TEST_CASE("pad keeps the dtype, device and memory format, and fills any dtype") {
  CHECK(values(pad(tensor<int64_t>({5, 6}), {1, 1}, PadMode::Constant, -3)) == std::vector<double>{-3, 5, 6, -3});
  CHECK(pad(tensor<int64_t>({5, 6}), {1, 1}).dtype() == kInt64);
  CHECK(values(pad(tensor<bool>({true}), {1, 0}, PadMode::Constant, true)) == std::vector<double>{1, 1});
  CHECK(values(pad(tensor<int32_t>({1, 2, 3}).view({1, 3}), {1, 1}, PadMode::Reflect)) ==
        std::vector<double>{2, 1, 2, 3, 2});
  // float16: the same bits as float32's padding rounded, -inf exact.
  const Tensor h = randn({2, 3, 4, 5}).to(kFloat16);
  CHECK(values(pad(h, {1, 2, 3, 2}, PadMode::Reflect)) == values(pad(h.to(kFloat32), {1, 2, 3, 2}, PadMode::Reflect)));
  CHECK(values(pad(h, {0, 1}, PadMode::Constant, -INFINITY))[5] == -INFINITY);
  // channels_last in, channels_last out, with the values of the contiguous input's padding.
  const Tensor x = randn({2, 3, 4, 5});
  const Tensor last = contiguous(x, MemoryFormat::ChannelsLast);
  for (PadMode mode : kModes) {
    CAPTURE(std::string(pad_mode_name(mode)));
    const Tensor p = pad(last, {1, 2, 2, 1}, mode);
    CHECK(suggest_memory_format(p) == MemoryFormat::ChannelsLast);
    CHECK(values(p) == values(pad(x, {1, 2, 2, 1}, mode)));
  }
  // A channels_last input padded along C too (constant): still its layout.
  CHECK(values(pad(last, {1, 1, 0, 0, 2, 0})) == values(pad(x, {1, 1, 0, 0, 2, 0})));
  // No padding at all: a copy; a 0-d tensor included.
  CHECK(values(pad(scalar_tensor(2.5, {.dtype = kFloat64}), {})) == std::vector<double>{2.5});
  CHECK(values(pad(x, {})) == values(x));
  // An empty input padded with a constant: the constant everywhere.
  CHECK(values(pad(zeros({2, 0}), {1, 1}, PadMode::Constant, 4)) == std::vector<double>{4, 4, 4, 4});
}

TEST_CASE("pad refuses what PyTorch's pad refuses, naming the op, the padding and the input") {
  const Tensor x = zeros({1, 2, 3, 4}), row = zeros({2, 4});
  CHECK_THROWS_WITH_AS(pad(x, {1, 1, 1}), doctest::Contains("pad: padding [1, 1, 1] must hold (before, after) pairs, "
                                                            "an even number of values; got 3 for float32[1, 2, 3, 4]"),
                       Error);
  CHECK_THROWS_WITH_AS(pad(zeros({3}), {1, 1, 1, 1}),
                       doctest::Contains("pad: padding [1, 1, 1, 1] pads the last 2 dims, but float32[3] cpu has 1"),
                       Error);
  CHECK_THROWS_WITH_AS(pad(row, {3, 4}, PadMode::Reflect),
                       doctest::Contains("pad: reflect padding (3, 4) of dim 1 of float32[2, 4] cpu must be less than "
                                         "its size, 4"), Error);
  CHECK_THROWS_WITH_AS(pad(row, {1, 1}, PadMode::Reflect, 2),
                       doctest::Contains("pad: reflect padding takes no value (got 2)"), Error);
  CHECK(pad(row, {1, 1}, PadMode::Reflect, 0).shape() == Shape{2, 6});  // 0 is no value, as PyTorch takes it
  CHECK_THROWS_WITH_AS(pad(zeros({2, 0, 5}), {1, 1}, PadMode::Reflect),
                       doctest::Contains("pad: reflect padding of float32[2, 0, 5] cpu: dim 1 is empty, and only a "
                                         "batch may be"), Error);
  CHECK(pad(zeros({0, 2, 5}), {1, 1}, PadMode::Reflect).shape() == Shape{0, 2, 7});
  // A negative amount comes off first: the two sides remove at most the dim, whatever the other adds back.
  CHECK_THROWS_WITH_AS(pad(row, {-5, 3}), doctest::Contains("pad: padding (-5, 3) of dim 1 of float32[2, 4] cpu "
                                                            "removes 5 elements of its 4"), Error);
  CHECK_THROWS_WITH_AS(pad(row, {3, -2}, PadMode::Circular),
                       doctest::Contains("wraps around more than once: each side at most the 2 elements kept"), Error);
  CHECK(pad(row, {-2, -2}, PadMode::Circular).shape() == Shape{2, 0});  // circular may leave nothing, as constant
  CHECK_THROWS_WITH_AS(pad(zeros({1, 1, 2, 2, 2, 2}), {1, 1, 1, 1, 1, 1, 1, 1}, PadMode::Reflect),
                       doctest::Contains("pad: reflect padding pads the last 1, 2 or 3 dims"), Error);
  CHECK_THROWS_WITH_AS(pad(row, {-2, -2}, PadMode::Replicate),
                       doctest::Contains("pad: replicate padding (-2, -2) of dim 1 of float32[2, 4] cpu leaves no "
                                         "element"), Error);
  CHECK_THROWS_WITH_AS(pad(row, {0, (int64_t(1) << 60) + 1}), doctest::Contains("is beyond +-2^60"), Error);
  CHECK_THROWS_WITH_AS(pad(row, {INT64_MIN, 5}, PadMode::Circular),
                       doctest::Contains("pad: padding (-9223372036854775808, 5) of dim 1 of float32[2, 4] cpu is "
                                         "beyond +-2^60"), Error);
  CHECK_THROWS_WITH_AS(pad(zeros({4}), {1, 1}, PadMode::Replicate),
                       doctest::Contains("pad: replicate padding pads the last 1, 2 or 3 dims of a tensor with one or "
                                         "two more (channels, or a batch and channels): padding [1, 1] (1 dims) of "
                                         "float32[4]"), Error);
  CHECK_THROWS_WITH_AS(pad(x, {}, PadMode::Circular),
                       doctest::Contains("pad: circular padding pads the last 1, 2 or 3"), Error);
  CHECK_THROWS_WITH_AS(pad(row, {5, 0}, PadMode::Circular),
                       doctest::Contains("pad: circular padding (5, 0) of dim 1 of float32[2, 4] cpu wraps "
                                         "around more than once: each side at most the 4 elements kept"), Error);
  CHECK_THROWS_WITH_AS(pad(zeros({1, 0}), {1, 1}, PadMode::Replicate),
                       doctest::Contains("pad: replicate padding of float32[1, 0] cpu: dim 1 is empty"), Error);
  CHECK_THROWS_WITH_AS(pad(row, {-3, -1}, PadMode::Reflect),
                       doctest::Contains("pad: reflect padding (-3, -1) of dim 1 of float32[2, 4] cpu leaves no "
                                         "element"), Error);
  CHECK_THROWS_WITH_AS(pad(zeros({2}, {.dtype = kFloat16}), {1, 1}, PadMode::Constant, 1e6),
                       doctest::Contains("pad: the value 1000000 cannot be converted to float16[2] cpu"), Error);
  CHECK_THROWS_WITH_AS(pad(Tensor(), {1, 1}), doctest::Contains("pad: the input is an undefined tensor"), Error);
  // Constant padding of more runs of dims than the kernels walk: named, not wrong. Unpadded dims of 1 take no run.
  CHECK(pad(zeros(Shape(9, 1)), std::vector<int64_t>(16, 1)).shape() == Shape{1, 3, 3, 3, 3, 3, 3, 3, 3});
  CHECK_THROWS_WITH_AS(pad(zeros(Shape(9, 2)), {1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1}),
                       doctest::Contains("makes more than 8 runs of padded and unpadded dims"), Error);
}

TEST_CASE("pad's gradient: each input element's sum over the outputs it fills, against finite differences") {
  // Exact: how many times each of [1 2 3] appears in the padded row.
  for (auto [mode, want] : std::vector<std::pair<PadMode, std::vector<double>>>{
           {PadMode::Constant, {1, 1, 1}}, {PadMode::Reflect, {2, 3, 2}}, {PadMode::Replicate, {3, 1, 3}},
           {PadMode::Circular, {2, 3, 2}}}) {
    CAPTURE(std::string(pad_mode_name(mode)));
    Tensor x = kOneTwoThree.detach().clone().requires_grad_();
    pad(x, {2, 2}, mode).sum().backward();
    CHECK(values(x.grad()) == want);
  }
  // Constant padding's gradient takes each element as it is, as PyTorch's: a -0.0 keeps its sign; a removed element
  // gets +0.0.
  Tensor cut = kOneTwoThree.detach().clone().requires_grad_();
  pad(cut, {1, -1}).backward(tensor<double>({7, -0.0, 5}).view({1, 3}));
  CHECK(values(cut.grad()) == std::vector<double>{-0.0, 5, 0});
  CHECK(std::signbit(values(cut.grad())[0]));
  CHECK(!std::signbit(values(cut.grad())[2]));
  // A circular padding that keeps nothing of a dim: an empty output, every input element's gradient 0.
  Tensor wide = leaf({2, 3, 1});
  const Tensor nothing = pad(wide, {-1, 0, 3, 3}, PadMode::Circular);
  CHECK(nothing.shape() == Shape{2, 9, 0});
  nothing.sum().backward();
  CHECK(values(wide.grad()) == std::vector<double>(6, 0.0));
  Tensor x = kOneTwoThree.detach().clone().requires_grad_();
  const Tensor padded = pad(x, {1, 1}, PadMode::Reflect);
  CHECK(padded.grad_fn()->name() == "ReflectionPadBackward");
  for (PadMode mode : kModes) {
    CAPTURE(std::string(pad_mode_name(mode)));
    for (const std::vector<int64_t>& padding : std::vector<std::vector<int64_t>>{
             {2, 1}, {1, 2, 2, 1}, {-1, 2, 1, -1}, {1, 1, 1, 1, 1, 1}}) {
      CAPTURE(padding.size());
      CAPTURE(padding[0]);
      gradcheck([&](const TensorList& in) { return pad(in[0], padding, mode); },
                {leaf(padding.size() == 2 ? Shape{3, 3, 4} : Shape{2, 3, 3, 4})});
    }
    gradcheck([&](const TensorList& in) {
      return pad(contiguous(in[0], MemoryFormat::ChannelsLast), {1, 2, 2, 1}, mode);
    }, {leaf({2, 3, 4, 5})});
    gradgradcheck([&](const TensorList& in) { return pad(in[0] * in[0], {2, 1, 1, 2}, mode); }, {leaf({1, 2, 3, 4})});
  }
  gradcheck([](const TensorList& in) { return pad(in[0], {1, 0, 0, 2, 1, 1, 0, 1}, PadMode::Constant, 3); },
            {leaf({2, 3, 2, 3})});
}

TEST_CASE("pad's 32-bit walks, dividing by each size's IntDivider, find the 64-bit walks' indices and sums") {
  // The CUDA kernels' 32-bit walks take the sizes so (ops/pad.cu); here the same rules run on the host.
  manual_seed(5);
  for (PadMode mode : kModes) {
    CAPTURE(std::string(pad_mode_name(mode)));
    PadGeometry g;  // [4, 5, 7] padded by (2, 3) in dim 1 and (-1, 2) in dim 2
    g.dims = 3;
    g.mode = mode;
    const int64_t in[] = {4, 5, 7}, out[] = {4, 10, 8}, before[] = {0, 2, -1};
    PadGeometry transposed = g;  // Constant padding's gradient: in and out swapped, the amounts negated
    IntDivider in_divisors[3], out_divisors[3];
    for (int d = 0; d < 3; ++d) {
      g.in[d] = transposed.out[d] = in[d];
      g.out[d] = transposed.in[d] = out[d];
      g.before[d] = before[d], transposed.before[d] = -before[d];
      in_divisors[d] = IntDivider{uint32_t(in[d])};
      out_divisors[d] = IntDivider{uint32_t(out[d])};
    }
    int64_t wrong = 0;
    for (int64_t k = 0; k < 4 * 10 * 8; ++k)
      wrong += pad_source_index(g, out_divisors, int32_t(k)) != pad_source_index(g, g.out, k);
    CHECK(wrong == 0);
    if (mode == PadMode::Constant) {  // its gradient is a padding: the walk of the transposed geometry
      for (int64_t k = 0; k < 4 * 5 * 7; ++k)
        wrong += pad_source_index(transposed, in_divisors, int32_t(k)) !=
                 pad_source_index(transposed, transposed.out, k);
      CHECK(wrong == 0);
      continue;
    }
    const std::vector<double> grad_output = values(randn({4 * 10 * 8}, {.dtype = kFloat64}));
    for (int64_t k = 0; k < 4 * 5 * 7; ++k) {
      wrong += pad_gradient_of<double>(g, in_divisors, grad_output.data(), int32_t(k)) !=
               pad_gradient_of<double>(g, g.in, grad_output.data(), k);
    }
    CHECK(wrong == 0);
  }
}

TEST_CASE("cuda: pad and its gradient equal the CPU's in every mode, dtype and layout") {
  SKIP_WITHOUT_GPU();
  manual_seed(77);
  for (PadMode mode : kModes) {
    for (DType dt : {kFloat32, kFloat16, kBFloat16, kFloat64}) {
      for (bool channels_last : {false, true}) {
        CAPTURE(std::string(pad_mode_name(mode)));
        CAPTURE(std::string(dtype_name(dt)));
        CAPTURE(channels_last);
        Tensor xc = randn({3, 5, 17, 33}).to(dt);
        if (channels_last) xc = contiguous(xc, MemoryFormat::ChannelsLast);
        xc.requires_grad_();
        Tensor xg = xc.detach().cuda().requires_grad_();
        const std::vector<int64_t> padding = {3, 2, -1, 4};
        const Tensor yc = pad(xc, padding, mode), yg = pad(xg, padding, mode);
        CHECK(values(yg.cpu()) == values(yc));
        CHECK(suggest_memory_format(yg) == suggest_memory_format(yc));
        const Tensor seed = randn(yc.shape()).to(dt);
        yc.backward(seed);
        yg.backward(seed.cuda());
        CHECK(values(xg.grad().cpu()) == values(xc.grad()));  // the same sums in the same order on both devices
      }
    }
  }
  // A side with an empty dim: the constant fills an empty input; the gradients of a constant padding that removes a
  // whole dim and of a circular one that keeps nothing of one (every element's gradient 0).
  CHECK(values(pad(zeros({2, 0}).cuda(), {1, 1}, PadMode::Constant, 4).cpu()) == std::vector<double>{4, 4, 4, 4});
  struct Emptying {
    PadMode mode;
    Shape shape;
    std::vector<int64_t> padding;
  };
  for (const Emptying& e : {Emptying{PadMode::Constant, {2, 1, 3}, {-3, 0}},
                            Emptying{PadMode::Circular, {2, 3, 1}, {-1, 0, 3, 3}}}) {
    CAPTURE(std::string(pad_mode_name(e.mode)));
    Tensor emptied = zeros(e.shape, {.device = Device::cuda(0)}).requires_grad_();
    const Tensor y = pad(emptied, e.padding, e.mode);
    CHECK(y.numel() == 0);
    y.sum().backward();
    CHECK(values(emptied.grad().cpu()) == std::vector<double>(6, 0.0));
  }
  // Integers and a constant of 3 dims beside a large tensor (a grid of many blocks).
  const Tensor big = randint(-9, 9, {4, 64, 40, 40}).to(kInt32);
  CHECK(values(pad(big.cuda(), {1, 2, 3, 4, 5, 6}, PadMode::Constant, 7).cpu()) ==
        values(pad(big, {1, 2, 3, 4, 5, 6}, PadMode::Constant, 7)));
  // Past 2^30 elements the kernels index in 64 bits: replicate padding of 1.07e9 bytes, read at its far corners.
  Tensor huge = ones({1, 32769, 32768}, {.dtype = kUInt8, .device = Device::cuda(0)});
  huge.select(1, 32768).fill_(2);  // the last row
  huge.select(2, 32767).fill_(3);  // the last column
  const Tensor padded = pad(huge, {1, 1, 1, 1}, PadMode::Replicate);
  CHECK(padded.shape() == Shape{1, 32771, 32770});
  CHECK(padded[0][32770][5].item<uint8_t>() == 2);
  CHECK(padded[0][100][32769].item<uint8_t>() == 3);
  CHECK(padded[0][32770][32769].item<uint8_t>() == 3);
  CHECK(padded[0][0][0].item<uint8_t>() == 1);
  // Second derivatives on CUDA, in float64: the CPU's.
  const Tensor a = leaf({2, 3, 4, 5});
  auto second = [](const Tensor& x) {
    const Tensor y = pad(x * x, {2, 1, 1, 2}, PadMode::Reflect);
    const Tensor g = autograd::grad({(y * y).sum()}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
    return autograd::grad({g.sum()}, {x})[0];
  };
  halfgrad::testing::check_close(values(second(a.detach().cuda().requires_grad_()).cpu()),
                                 values(second(a.detach().requires_grad_())), 1e-12);
}

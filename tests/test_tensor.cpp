// Tensors: storage, views, dtypes and promotion, factories, printing, errors.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "halfgrad.h"
#include "tests/gradcheck.h"
#include "tests/testing.h"

using namespace halfgrad;
using halfgrad::testing::aligned_padding;
using halfgrad::testing::values;
using halfgrad::testing::gradcheck;
using halfgrad::testing::leaf;

TEST_CASE("a tensor is storage seen through shape, strides and offset") {
  Tensor t = arange(12, {.dtype = kFloat32}).view({3, 4});
  CHECK(t.shape() == Shape{3, 4});
  CHECK(t.strides() == Shape{4, 1});
  CHECK(t.numel() == 12);
  CHECK(t.is_contiguous());
  CHECK(t.dtype() == kFloat32);
  CHECK(t.is_cpu());
  CHECK(t[1][2].item<float>() == 6.0f);
}

TEST_CASE("views share storage: a write through a view is seen by the base") {
  Tensor base = zeros({2, 3});
  Tensor row = base.select(0, 1);
  row.fill_(5);
  CHECK(values(base) == std::vector<double>{0, 0, 0, 5, 5, 5});
  Tensor col = base.transpose(0, 1).narrow(0, 2, 1);
  col.fill_(7);
  CHECK(values(base) == std::vector<double>{0, 0, 7, 5, 5, 7});
  CHECK(col.storage() == base.storage());
}

TEST_CASE("assigning to a view writes into it, as libtorch's x[0] = y, assigning to a name rebinds the name") {
  Tensor base = zeros({2, 3});
  const Tensor row = tensor<double>({1, 2, 3});
  base[1] = row;  // copied, cast to float32
  CHECK(values(base) == std::vector<double>{0, 0, 0, 1, 2, 3});
  base.select(1, 0) = 9;  // a scalar fills
  CHECK(values(base) == std::vector<double>{9, 0, 0, 9, 2, 3});
  base.narrow(1, 1, 2) = tensor<double>({-1, -2});  // broadcast over the rows
  CHECK(values(base) == std::vector<double>{9, -1, -2, 9, -1, -2});
  base[0] = 7;
  CHECK(values(base) == std::vector<double>{7, 7, 7, 9, -1, -2});
  base[0] = std::move(base[1]);  // the rvalue source is copied from, too
  CHECK(values(base) == std::vector<double>{9, -1, -2, 9, -1, -2});
  CHECK(values(row) == std::vector<double>{1, 2, 3});  // the source is read, not rebound

  Tensor name = base;
  name = row;  // a named tensor is rebound: base keeps its values
  CHECK(name.same(row));
  CHECK(values(base) == std::vector<double>{9, -1, -2, 9, -1, -2});

  CHECK_THROWS_WITH_AS(base[0] = zeros({2}), doctest::Contains("copy_: cannot broadcast"), Error);  // copy_'s check
  // Where autograd sees the write it records it, as copy_ into a view (its base's history: CopySlices), not fill_
  // unseen; on a leaf that requires grad, or a view of one, it is refused.
  const Tensor w = ones({2}, {.requires_grad = true});
  Tensor y = w * 2;
  y[0] = 0;
  CHECK(values(y.detach()) == std::vector<double>{0, 2});
  y.sum().backward();
  CHECK(values(w.grad()) == std::vector<double>{0, 2});
  CHECK_THROWS_WITH_AS(w[0] = 0, doctest::Contains("is a view of a leaf tensor (float32[2] cpu)"), Error);
  CHECK_THROWS_WITH_AS(y.fill_(0), doctest::Contains("autograd does not record fill_"), Error);
  CHECK_THROWS_WITH_AS(Tensor(w).fill_(0), doctest::Contains("fill_: float32[2] cpu requires grad"), Error);
}

TEST_CASE("transpose and permute change strides, not data, contiguous() copies") {
  Tensor t = arange(6, {.dtype = kFloat64}).view({2, 3});
  Tensor tt = t.t();
  CHECK(tt.shape() == Shape{3, 2});
  CHECK(tt.strides() == Shape{1, 3});
  CHECK_FALSE(tt.is_contiguous());
  CHECK(values(tt) == std::vector<double>{0, 3, 1, 4, 2, 5});
  Tensor c = tt.contiguous();
  CHECK(c.is_contiguous());
  CHECK(c.storage() != t.storage());
  CHECK(values(c) == values(tt));
  Tensor p = arange(24).view({2, 3, 4}).permute({2, 0, 1});
  CHECK(p.shape() == Shape{4, 2, 3});
  CHECK(p[3][1][2].item<int64_t>() == 1 * 12 + 2 * 4 + 3);
}

TEST_CASE("view needs compatible strides, reshape copies when it must") {
  Tensor t = arange(6).view({2, 3}).t();
  CHECK_THROWS_WITH_AS(t.view({6}), doctest::Contains("view"), Error);
  Tensor r = t.reshape({6});
  CHECK(values(r) == std::vector<double>{0, 3, 1, 4, 2, 5});
  CHECK(arange(6).view({-1, 2}).shape() == Shape{3, 2});
  CHECK_THROWS_WITH_AS(arange(6).view({4, -1}), doctest::Contains("invalid for input of size 6"), Error);
  // A product of sizes past int64 names the op (it wrapped to -2 and inferred a size of -3).
  const int64_t huge = std::numeric_limits<int64_t>::max();
  CHECK_THROWS_WITH_AS(arange(6).view({-1, huge, 2}),
                       doctest::Contains("view: shape [-1, 9223372036854775807, 2] is invalid for input of size 6"),
                       Error);
  CHECK_THROWS_WITH_AS(arange(6).reshape({huge, 2}), doctest::Contains("reshape: shape [9223372036854775807, 2] is "
                                                                       "invalid for input of size 6"), Error);
  CHECK_THROWS_WITH_AS(ones({1, 2}).expand({huge, 2}), doctest::Contains("expand: cannot broadcast"), Error);
  // A channels_last tensor reshaped row-major, as PyTorch: a copy, forward and in the backward of a view.
  const Tensor x = arange(48, {.dtype = kFloat64}).view({2, 3, 4, 2});
  const Tensor nhwc = contiguous_channels_last(x);
  CHECK(values(nhwc.reshape({2, -1})) == values(x.reshape({2, -1})));
  CHECK(values(nhwc.flatten(1)) == values(x.flatten(1)));
  Tensor leaf = arange(24, {.dtype = kFloat64}).view({2, 12}).requires_grad_();
  contiguous_channels_last(leaf.view({2, 3, 2, 2})).mul(tensor<double>({1, 2})).sum().backward();
  CHECK(values(leaf.grad()) == values(tensor<double>({1, 2}).expand({2, 3, 2, 2}).reshape({2, 12})));
}

TEST_CASE("slice with a step, narrow, select with negative indices") {
  Tensor t = arange(10);
  CHECK(values(t.slice(0, 1, 8, 3)) == std::vector<double>{1, 4, 7});
  CHECK(values(t.narrow(0, -3, 2)) == std::vector<double>{7, 8});
  CHECK(t.select(0, -1).item<int64_t>() == 9);
  CHECK_THROWS_WITH_AS(t.select(0, 10), doctest::Contains("out of range"), Error);
  CHECK_THROWS_WITH_AS(t.narrow(0, 8, 5), doctest::Contains("narrow"), Error);
  // Extreme starts, lengths and steps: no int64 wrap-around into an empty or wrong view.
  const int64_t big = std::numeric_limits<int64_t>::max(), small = std::numeric_limits<int64_t>::min();
  CHECK_THROWS_WITH_AS(t.narrow(0, 1, big), doctest::Contains("narrow: start 1 and length 9223372036854775807 are "
                                                              "outside dim 0"), Error);
  CHECK_THROWS_WITH_AS(t.narrow(0, small, 1), doctest::Contains("narrow"), Error);
  CHECK(values(t.slice(0, 0, 5, big)) == std::vector<double>{0});
  CHECK(values(t.slice(0, small, big, 4)) == std::vector<double>{0, 4, 8});
  CHECK(values(t.slice(0, -2, big)) == std::vector<double>{8, 9});
  // A 0-d tensor has no dims to index: an error, not a read past its empty shape.
  const Tensor scalar = scalar_tensor(1.0);
  for (auto [name, op] : std::vector<std::pair<std::string, std::function<void()>>>{
           {"size", [&] { scalar.size(-1); }},
           {"stride", [&] { scalar.stride(0); }},
           {"slice", [&] { scalar.slice(0, 0, 1); }},
           {"narrow", [&] { scalar.narrow(0, 0, 1); }},
           {"select", [&] { scalar.select(0, 0); }}}) {
    CAPTURE(name);
    CHECK_THROWS_WITH_AS(op(), doctest::Contains((name + ": dimension").c_str()), Error);
    CHECK_THROWS_WITH_AS(op(), doctest::Contains("the tensor is 0-d: it has no dimensions"), Error);
  }
  // ... while transpose and flatten take 0 and -1 for it, as PyTorch, and refuse the rest.
  CHECK(scalar.transpose(0, -1).dim() == 0);
  CHECK(scalar.flatten(0, -1).shape() == Shape{1});
  CHECK_THROWS_WITH_AS(scalar.transpose(5, 3), doctest::Contains("transpose: dimension 5 is out of range (expected in "
                                                                 "[-1, 0])"), Error);
  CHECK_THROWS_WITH_AS(scalar.flatten(3, 1), doctest::Contains("flatten: dimension 3 is out of range"), Error);
  CHECK_THROWS_WITH_AS(zeros({2, 3, 4}).unsqueeze(4), doctest::Contains("unsqueeze: dimension 4 is out of range "
                                                                        "(expected in [-4, 3])"), Error);
}

TEST_CASE("expand broadcasts with stride 0, squeeze, unsqueeze and flatten") {
  Tensor t = arange(3).view({3, 1});
  Tensor e = t.expand({2, 3, 4});
  CHECK(e.shape() == Shape{2, 3, 4});
  CHECK(e.strides() == Shape{0, 1, 0});
  CHECK(e[1][2][3].item<int64_t>() == 2);
  CHECK(t.expand({-1, 5}).shape() == Shape{3, 5});
  CHECK_THROWS_WITH_AS(t.expand({2, 4}), doctest::Contains("expand"), Error);
  CHECK(t.squeeze().shape() == Shape{3});
  CHECK(t.unsqueeze(0).shape() == Shape{1, 3, 1});
  CHECK(t.unsqueeze(-1).shape() == Shape{3, 1, 1});
  CHECK(zeros({2, 3, 4}).flatten(1).shape() == Shape{2, 12});
  CHECK(zeros({2, 3, 4}).flatten().shape() == Shape{24});
}

TEST_CASE("cat joins along a dim") {
  Tensor a = arange(4).view({2, 2}), b = arange(4, 6).view({2, 1});
  Tensor c = cat({a, b}, 1);
  CHECK(c.shape() == Shape{2, 3});
  CHECK(values(c) == std::vector<double>{0, 1, 4, 2, 3, 5});
  CHECK_THROWS_WITH_AS(cat({a, b}, 0), doctest::Contains("cat"), Error);
}

TEST_CASE("cat takes PyTorch's legacy empty tensor of shape [0] beside any shape, in the dtype only") {
  // A list grown from empty({0}): the [0] joins a [2, 3] along either dim, and promotes the result's dtype.
  Tensor grown = ones({2, 3}).requires_grad_();
  Tensor start = empty({0}, {.dtype = kFloat64}).requires_grad_();
  for (int64_t dim : {0, 1, -1}) {
    CAPTURE(dim);
    Tensor c = cat({start, grown}, dim);
    CHECK(c.shape() == Shape{2, 3});
    CHECK(c.dtype() == kFloat64);
    CHECK(values(c) == std::vector<double>(6, 1.0));
  }
  Tensor c = cat({grown, start, grown * 2.0}, 1);
  CHECK(c.shape() == Shape{2, 6});
  c.sum().backward();
  CHECK(start.grad().shape() == Shape{0});
  CHECK(values(grown.grad()) == std::vector<double>(6, 3.0));
  CHECK(cat({empty({0}), empty({0})}).shape() == Shape{0});
  CHECK(cat({empty({0}), empty({0})}, 1).shape() == Shape{0});  // any dim, as PyTorch's
  // Any other empty tensor still has a shape to match.
  CHECK_THROWS_WITH_AS(cat({zeros({0, 2}), ones({2, 3})}, 0), doctest::Contains("sizes must match except in dim 0"),
                       Error);
}

TEST_CASE("squeeze of nothing, t() of a vector and transpose of a 0-d tensor are new views, not the tensor itself") {
  // Autograd state set on the result must not land on the input (PyTorch returns an alias of it).
  Tensor x = ones({3}), c = ones({2, 3}), s = scalar_tensor(2.0);
  for (Tensor y : {x.squeeze(), x.t(), c.squeeze(0), s.transpose(0, 0)}) y.requires_grad_();
  CHECK_FALSE(x.requires_grad());
  CHECK_FALSE(c.requires_grad());
  CHECK_FALSE(s.requires_grad());
  Tensor leaf = ones({3}).requires_grad_();
  Tensor view = leaf.squeeze();
  CHECK_FALSE(view.same(leaf));
  CHECK_FALSE(view.is_leaf());  // a view of a tensor that requires grad, with a node to it
  (view * 2.0).sum().backward();
  CHECK(values(leaf.grad()) == std::vector<double>(3, 2.0));
}

TEST_CASE("type promotion follows PyTorch") {
  CHECK(promote_types(kInt32, kFloat16) == kFloat16);
  CHECK(promote_types(kFloat16, kBFloat16) == kFloat32);
  CHECK(promote_types(kUInt8, kInt32) == kInt32);
  CHECK(promote_types(kBool, kUInt8) == kUInt8);
  CHECK(promote_types(kFloat32, kFloat64) == kFloat64);
  CHECK(promote_types(kInt64, kFloat32) == kFloat32);
  // Scalars decide only when of a higher category than the tensor.
  CHECK((ones({2}, {.dtype = kFloat16}) * 2.5).dtype() == kFloat16);
  CHECK((ones({2}, {.dtype = kInt32}) * 2).dtype() == kInt32);
  CHECK((ones({2}, {.dtype = kInt32}) * 2.5).dtype() == kFloat32);
  CHECK((ones({2}, {.dtype = kInt64}) / 2).dtype() == kFloat32);  // true division
  CHECK((ones({2}, {.dtype = kFloat16}) + ones({2}, {.dtype = kFloat32})).dtype() == kFloat32);
  CHECK((ones({2}, {.dtype = kBFloat16}) + ones({2}, {.dtype = kFloat16})).dtype() == kFloat32);
}

TEST_CASE("casts between all dtypes round-trip representable values") {
  std::vector<double> v{-3, -1, 0, 1, 2, 100};
  for (DType from : {kFloat64, kFloat32, kFloat16, kBFloat16, kInt64, kInt32}) {
    for (DType to : {kFloat64, kFloat32, kFloat16, kBFloat16, kInt64, kInt32}) {
      Tensor t = tensor(v).to(from).to(to);
      CAPTURE(std::string(dtype_name(from)));
      CAPTURE(std::string(dtype_name(to)));
      CHECK(t.dtype() == to);
      CHECK(values(t) == v);
    }
  }
  CHECK(values(tensor(std::vector<double>{-1.5, 0, 2}).to(kBool)) == std::vector<double>{1, 0, 1});
  CHECK(values(tensor(std::vector<double>{300}).to(kUInt8).to(kInt32)) == std::vector<double>{300 - 256});
  CHECK(values(tensor(std::vector<double>{-2.7, 2.7}).to(kInt64)) == std::vector<double>{-2, 2});  // truncation
}

TEST_CASE("float16 and bfloat16 round to nearest even and saturate to infinity") {
  CHECK(float(Half(1.0f + 1.0f / 2048)) == 1.0f);                // a tie rounds to the even mantissa
  CHECK(float(Half(1.0f + 3.0f / 2048)) == 1.0f + 2.0f / 1024);  // a tie rounds up to even
  CHECK(float(Half(65504.0f)) == 65504.0f);
  CHECK(std::isinf(float(Half(65520.0f))));
  CHECK(float(Half(5.9604645e-8f)) == 5.9604645e-8f);  // smallest subnormal
  CHECK(float(Half(2e-8f)) == 0.0f);
  CHECK(std::isnan(float(Half(NAN))));
  CHECK(float(BFloat16(1.0f + 1.0f / 256)) == 1.0f);
  CHECK(float(BFloat16(3.0e38f)) == doctest::Approx(2.99e38).epsilon(0.01));
  CHECK(std::isnan(float(BFloat16(NAN))));
  for (float f : {0.1f, -3.75f, 1000.5f, 1e-3f}) {
    CHECK(float(Half(f)) == doctest::Approx(f).epsilon(1e-3));
    CHECK(float(BFloat16(f)) == doctest::Approx(f).epsilon(1e-2));
  }
}

TEST_CASE("factories: zeros, ones, full, arange, tensor, from_buffer") {
  CHECK(values(zeros({2})) == std::vector<double>{0, 0});
  CHECK(values(ones({2}, {.dtype = kFloat16})) == std::vector<double>{1, 1});
  CHECK(values(full({3}, 2.5, {.dtype = kFloat64})) == std::vector<double>{2.5, 2.5, 2.5});
  CHECK(values(arange(1, 2, 0.25, {.dtype = kFloat32})) == std::vector<double>{1, 1.25, 1.5, 1.75});
  CHECK(arange(5).dtype() == kInt64);
  // Without options the dtype is int64 for integers only, else float32, as PyTorch's.
  CHECK(arange(0, 1, 0.1).dtype() == kFloat32);
  CHECK(arange(0, 1, 0.1).numel() == 10);
  CHECK(values(arange(0.5, 3)) == std::vector<double>{0.5, 1.5, 2.5});
  CHECK(values(arange(2.5)) == std::vector<double>{0, 1, 2});
  CHECK(arange(2.5).dtype() == kFloat32);
  // integers count in int64, exactly past 2^53
  const int64_t big = (int64_t(1) << 53) + 1;
  CHECK(to_vector<int64_t>(arange(big, big + 3)) == std::vector<int64_t>{big, big + 1, big + 2});
  CHECK(values(arange(10, 0, -3)) == std::vector<double>{10, 7, 4, 1});
  CHECK_THROWS_WITH_AS(arange(big, big - 1), doctest::Contains("arange: cannot go from 9007199254740993 to "
                                                               "9007199254740992 in steps of 1"), Error);
  // any integer type, as the numbers of a container's size() are
  const std::vector<int> three(3);
  CHECK(arange(three.size()).numel() == 3);
  CHECK(arange(5u).dtype() == kInt64);
  CHECK(arange(2LL, 5LL).numel() == 3);
  CHECK_THROWS_WITH_AS(arange(uint64_t(1) << 63), doctest::Contains("9223372036854775808 is past the largest integer"),
                       Error);
  float buf[4] = {1, 2, 3, 4};
  Tensor b = from_buffer(buf, {2, 2}, kFloat32);
  buf[0] = 100;  // copied, not aliased
  CHECK(b[0][0].item<float>() == 1.0f);
  CHECK(scalar_tensor(3).dim() == 0);
  const Tensor flags = tensor<bool>({true, false, true});  // std::vector<bool> keeps bits: copied a byte each
  CHECK(flags.dtype() == kBool);
  CHECK(values(flags) == std::vector<double>{1, 0, 1});
  CHECK(tensor<bool>({true, false, false, true}, {2, 2}, {.dtype = kFloat32}).dtype() == kFloat32);
  CHECK_THROWS_WITH_AS(empty({2, -1}), doctest::Contains("negative"), Error);
}

TEST_CASE("random numbers are reproducible from a seed and have the right moments") {
  manual_seed(42);
  Tensor a = randn({10000});
  manual_seed(42);
  Tensor b = randn({10000});
  CHECK(values(a) == values(b));
  Tensor c = randn({10000});
  CHECK(values(a) != values(c));
  double mean = a.mean().item<double>(), var = a.var().item<double>();
  CHECK(std::abs(mean) < 0.05);
  CHECK(std::abs(var - 1) < 0.05);
  Tensor u = rand({10000}, {.dtype = kFloat64});
  CHECK(u.min().item<double>() >= 0);
  CHECK(u.max().item<double>() < 1);
  CHECK(std::abs(u.mean().item<double>() - 0.5) < 0.02);
  Tensor i = randint(3, 7, {1000});
  CHECK(i.min().item<int64_t>() == 3);
  CHECK(i.max().item<int64_t>() == 6);
}

TEST_CASE("printing shows values, dtype, device and autograd state") {
  Tensor t = tensor(std::vector<float>{1.5f, -2.0f, 3.25f}, {3});
  CHECK(t.str() == "tensor([ 1.5000, -2.0000,  3.2500])");
  CHECK(arange(4).view({2, 2}).str() == "tensor([[0, 1],\n        [2, 3]])");
  CHECK(ones({2}, {.dtype = kFloat16}).str() == "tensor([1.0000, 1.0000], dtype=float16)");
  Tensor w = ones({1}, {.requires_grad = true});
  CHECK(w.str() == "tensor([1.0000], requires_grad=True)");
  CHECK((w * 2).str() == "tensor([2.0000], grad_fn=<MulBackward>)");
  std::string big = zeros({100, 100}).str();
  CHECK(big.find("...") != std::string::npos);
  CHECK(big.find("size=[100, 100]") != std::string::npos);
  CHECK(ones({2, 3}).meta() == "float32[2, 3] cpu");
  std::ostringstream os;  // std::cout << t, as libtorch's users write it
  os << t << " " << Tensor();
  CHECK(os.str() == "tensor([ 1.5000, -2.0000,  3.2500]) tensor(undefined)");
}

TEST_CASE("integers print every digit") {
  const Tensor t = tensor(std::vector<int64_t>{9007199254740993, -9223372036854775807});
  CHECK(t.str() == "tensor([    9007199254740993, -9223372036854775807])");
}

TEST_CASE("mismatched operands give errors that name the op and each operand") {
  CHECK_THROWS_WITH_AS(ones({2, 3}) + ones({4}), "add: shapes [2, 3] and [4] cannot be broadcast together (dim 1: 3 vs 4)", Error);
  CHECK_THROWS_WITH_AS(ones({2}).item<float>(), doctest::Contains("float32[2] cpu"), Error);
  CHECK_THROWS_WITH_AS(ones({2}).data<double>(), doctest::Contains("float32[2] cpu"), Error);
  CHECK_THROWS_WITH_AS(ones({2}, {.dtype = kBool}) - ones({2}, {.dtype = kBool}), doctest::Contains("sub: not supported for bool"), Error);
}

TEST_CASE("elementwise ops, casts and clone keep a channels_last layout, contiguous() gives NCHW") {
  Tensor x = randn({2, 3, 4, 5}).permute({0, 2, 3, 1}).contiguous().permute({0, 3, 1, 2});  // NHWC memory
  REQUIRE(is_channels_last(x));
  REQUIRE_FALSE(x.is_contiguous());
  CHECK(is_channels_last(relu(x)));
  CHECK(is_channels_last(x * 2 + x));
  CHECK(is_channels_last(x.to(kFloat16)));
  CHECK(is_channels_last(x.clone()));
  CHECK(x.contiguous().is_contiguous());
  CHECK(to_vector<float>(relu(x)) == to_vector<float>(relu(x.contiguous())));
  // The gradient of an NHWC leaf is stored as it arrives: no transposing copy.
  Tensor leaf = x.detach().requires_grad_();
  (leaf * 3).sum().backward();
  CHECK(is_channels_last(leaf.grad()));
  CHECK(to_vector<float>(leaf.grad()) == std::vector<float>(120, 3.0f));
}

TEST_CASE("an aligned-rows matrix: rows and columns padded to 16 bytes with zeros, to(), casts and .grad keep it") {
  // Extents per dtype: float64 pads to 2, float32 to 4, 16-bit to 8 elements.
  for (auto [dtype, rows, cols] : {std::tuple{kFloat64, 6, 8}, {kFloat32, 8, 8}, {kFloat16, 8, 8}}) {
    CAPTURE(std::string(dtype_name(dtype)));
    const Tensor x = empty({5, 7}, {.dtype = dtype}, MemoryFormat::AlignedRows);
    CHECK(x.strides() == Shape{cols, 1});
    CHECK(x.storage()->nbytes() == size_t(rows * cols) * element_size(dtype));
    CHECK(is_aligned_rows(x));
    CHECK_FALSE(x.is_contiguous());
    CHECK(storage_format(x) == MemoryFormat::AlignedRows);
    CHECK(flat_storage_view(x).numel() == rows * cols);
    CHECK(aligned_padding(x) == std::vector<double>(size_t(rows * cols - 35), 0.0));
  }
  manual_seed(3);
  const Tensor dense = randn({5, 7}, {.dtype = kFloat64});
  const Tensor x = contiguous_aligned_rows(dense);
  REQUIRE(is_aligned_rows(x));
  CHECK(values(x) == values(dense));
  CHECK(contiguous_aligned_rows(x).same(x));
  CHECK(aligned_padding(x) == std::vector<double>(48 - 35, 0.0));
  // Casts keep the format at the new dtype's extents; elementwise results are contiguous.
  const Tensor half = x.to(kFloat16);
  CHECK(is_aligned_rows(half));
  CHECK(half.stride(0) == 8);
  CHECK(values(half) == values(dense.to(kFloat16)));
  CHECK(aligned_padding(half) == std::vector<double>(64 - 35, 0.0));
  CHECK((x * 2).is_contiguous());
  CHECK(x.contiguous().is_contiguous());
  // A leaf's gradient comes back in its layout.
  Tensor leaf = contiguous_aligned_rows(dense).requires_grad_();
  (leaf * 3).sum().backward();
  CHECK(is_aligned_rows(leaf.grad()));
  CHECK(values(leaf.grad()) == std::vector<double>(35, 3.0));
  CHECK(aligned_padding(leaf.grad()) == std::vector<double>(48 - 35, 0.0));
  (leaf * 2).sum().backward();  // accumulated into .grad: still in the leaf's layout
  CHECK(is_aligned_rows(leaf.grad()));
  CHECK(values(leaf.grad()) == std::vector<double>(35, 5.0));
  CHECK(aligned_padding(leaf.grad()) == std::vector<double>(48 - 35, 0.0));
  // Aligned already: the format is contiguous, with the rows padded in storage only.
  const Tensor wide = empty({3, 8}, {.dtype = kFloat32}, MemoryFormat::AlignedRows);
  CHECK(wide.is_contiguous());
  CHECK(storage_format(wide) == MemoryFormat::Contiguous);
  // A bug fixed: a contiguous float64 [700, 650] is aligned rows as well (650 is a whole number of float64 pairs),
  // and its cast to float32 came out padded to 652 columns, which kernels reading raw rows of 650 misread.
  const Tensor plain = randn({700, 650}, {.dtype = kFloat64});
  REQUIRE(is_aligned_rows(plain));
  CHECK(kept_memory_format(plain) == MemoryFormat::Contiguous);
  CHECK(plain.to(kFloat32).is_contiguous());
  CHECK(plain.to(kFloat16).is_contiguous());
}

TEST_CASE("a view with an aligned-rows matrix's strides is not one: its storage holds other values there") {
  const Tensor big = ones({6, 8}, {.dtype = kFloat64});
  const Tensor corner = big.narrow(0, 0, 5).narrow(1, 0, 7);
  CHECK(corner.strides() == Shape{8, 1});
  CHECK_FALSE(is_aligned_rows(corner));
  CHECK_FALSE(storage_format(corner).has_value());
  CHECK_FALSE(is_aligned_rows(contiguous_aligned_rows(big.narrow(1, 0, 7)).detach()));  // detach() is a view
  CHECK_THROWS_WITH_AS(empty({2, 3, 4}, {}, MemoryFormat::AlignedRows),
                       doctest::Contains("the aligned_rows format needs a 2-D"), Error);
  CHECK_THROWS_WITH_AS(as_aligned_rows(big, 5, 5), doctest::Contains("as_aligned_rows: float64[6, 8] cpu"), Error);
}

TEST_CASE("cuda: an aligned-rows matrix moves between devices as it is, padding and all") {
  SKIP_WITHOUT_GPU();
  manual_seed(4);
  const Tensor dense = randn({33, 13});
  const Tensor gpu = contiguous_aligned_rows(dense).cuda();
  CHECK(is_aligned_rows(gpu));
  CHECK(values(gpu) == values(dense));
  CHECK(aligned_padding(gpu) == std::vector<double>(36 * 16 - 33 * 13, 0.0));
  const Tensor back = gpu.to(kFloat16).cpu();
  CHECK(is_aligned_rows(back));
  CHECK(values(back) == values(dense.to(kFloat16)));
}

TEST_CASE("a CPU storage of 2^63 bytes or more is an out-of-memory error at once") {
  // empty() stops short of these sizes, but Storage is public: its size class once doubled a power of two past
  // 2^63 to 0 and looped forever, and rounding up SIZE_MAX would have wrapped to a small block.
  for (size_t nbytes : {size_t(1) << 63, SIZE_MAX}) {  // (refused before malloc, which ASan would abort in)
    CAPTURE(nbytes);
    const std::string expected = fmt::format("cpu allocator: out of memory allocating {} bytes", nbytes);
    CHECK_THROWS_WITH_AS(Storage(nbytes, Device::cpu()), doctest::Contains(expected.c_str()), Error);
  }
}

TEST_CASE("the CPU allocator keeps large freed blocks for the next request of their size class, up to its limit") {
  struct LimitGuard {  // the limit is process-wide: leave it as found
    size_t saved = cpu_cache_limit();
    ~LimitGuard() { set_cpu_cache_limit(saved); }
  } guard;
  constexpr size_t MiB = size_t(1) << 20;
  empty_cpu_cache();
  set_cpu_cache_limit(16 * MiB);
  const void* first = nullptr;
  {
    Tensor a = full({1 << 20}, 7.0);  // 4 MiB of float32
    first = a.data_ptr();
  }
  CHECK(cpu_cached_bytes() == 4 * MiB);
  {
    Tensor b = zeros({(1 << 20) - 16});  // 64 bytes less: the same size class, so the same block
    CHECK(b.data_ptr() == first);
    CHECK(cpu_cached_bytes() == 0);
    CHECK(b.sum().item<double>() == 0.0);  // and what was in it is not seen through zeros()
  }
  {
    Tensor small = empty({1000});  // under 1 MiB: back to malloc, not cached
  }
  CHECK(cpu_cached_bytes() == 4 * MiB);
  {
    std::vector<Tensor> five;
    for (int i = 0; i < 5; ++i) five.push_back(empty({1 << 20}));
    CHECK(cpu_cached_bytes() == 0);  // the first took the cached block
  }
  CHECK(cpu_cached_bytes() == 16 * MiB);  // four kept, the fifth over the limit freed
  set_cpu_cache_limit(8 * MiB);
  CHECK(cpu_cached_bytes() == 8 * MiB);
  empty_cpu_cache();
  CHECK(cpu_cached_bytes() == 0);
  set_cpu_cache_limit(0);  // off
  { Tensor c = empty({1 << 20}); }
  CHECK(cpu_cached_bytes() == 0);
}

TEST_CASE("bulk float16 conversions give the scalar conversions' results, tails and all") {
  // Every one of the 65,536 half values widens as Half::to_float widens it (NaNs to NaNs).
  std::vector<Half> all(65536);
  for (uint32_t b = 0; b < 65536; ++b) all[b] = Half::from_bits(uint16_t(b));
  std::vector<float> wide(all.size());
  half_to_float(all.data(), wide.data(), int64_t(all.size()));
  int mismatches = 0;
  for (uint32_t b = 0; b < 65536; ++b) {
    const float want = Half::to_float(uint16_t(b));
    if (std::isnan(want) ? !std::isnan(wide[b]) : std::memcmp(&want, &wide[b], 4) != 0) ++mismatches;
  }
  CHECK(mismatches == 0);
  // Narrowing: normals, ties, values that round to the subnormals, to zero, to the largest half and past it, and
  // infinities; 1,003 values so that the vector loop leaves a tail.
  manual_seed(409);
  std::vector<float> floats;
  for (double v : values(randn({1003}) * 3000.0)) floats.push_back(float(v));
  const std::vector<float> special = {0.0f, -0.0f, 65504.0f, 65519.99f, 65520.0f, -1e9f, 1e-8f, 5.96e-8f, 2.98e-8f,
                                      3e-5f, 6.1e-5f, 1.0009765625f, 1.00048828125f, INFINITY, -INFINITY};
  for (size_t i = 0; i < special.size(); ++i) floats[i * 61] = special[i];
  floats[5] = NAN;  // inside the first block of 8
  std::vector<Half> narrow(floats.size());
  float_to_half(floats.data(), narrow.data(), int64_t(floats.size()));
  mismatches = 0;
  for (size_t i = 0; i < floats.size(); ++i) {
    if (std::isnan(floats[i])) {
      mismatches += !std::isnan(float(narrow[i]));
    } else {
      mismatches += narrow[i].bits != Half(floats[i]).bits;
    }
  }
  CHECK(mismatches == 0);
}

TEST_CASE("an undefined tensor is an error wherever it is read, not a crash") {
  const Tensor undefined;
  CHECK_THROWS_WITH_AS(undefined.dim(), doctest::Contains("dim: the tensor is undefined"), Error);
  // Elementwise ops name themselves and both operands.
  CHECK_THROWS_WITH_AS(ones({3}) + undefined, doctest::Contains("add: an operand is undefined (float32[3] cpu, "
                                                                "(undefined tensor))"), Error);
  CHECK_THROWS_WITH_AS(undefined * 2.0, doctest::Contains("mul: an operand is undefined"), Error);
  CHECK_THROWS_WITH_AS(undefined.exp(), doctest::Contains("exp: an operand is undefined"), Error);
  CHECK_THROWS_WITH_AS(where(undefined, ones({3}), ones({3})), doctest::Contains("where: an operand is undefined"),
                       Error);
  CHECK_THROWS_WITH_AS(ones({3}).add_(undefined), doctest::Contains("add_: an operand is undefined"), Error);
  CHECK_THROWS_WITH_AS(ones({3}).copy_(undefined), doctest::Contains("the tensor is undefined"), Error);
  CHECK_THROWS_WITH_AS(undefined.backward(), doctest::Contains("backward: tensor 0 is undefined"), Error);
  CHECK_THROWS_WITH_AS(cat({undefined, ones({3})}), doctest::Contains("cat: the tensor at position 0 is undefined"),
                       Error);
  CHECK(undefined.meta() == "(undefined tensor)");
}

TEST_CASE("shapes whose element count or bytes overflow int64, and negative expanded sizes, are refused") {
  CHECK_THROWS_WITH_AS(zeros({int64_t(1) << 40, int64_t(1) << 40}),
                       doctest::Contains("shape [1099511627776, 1099511627776] has more elements than an int64 counts"),
                       Error);
  CHECK_THROWS_WITH_AS(empty({int64_t(1) << 62, 8}), doctest::Contains("more elements than an int64 counts"), Error);
  CHECK_THROWS_WITH_AS(empty({int64_t(1) << 62}), doctest::Contains("empty: shape [4611686018427387904] of float32 "
                                                                    "needs more bytes than an int64 counts"), Error);
  CHECK_THROWS_WITH_AS(ones({1, 1}).expand({int64_t(1) << 62, 4}), doctest::Contains("more elements than an int64"),
                       Error);
  CHECK_THROWS_WITH_AS(ones({1, 4}).expand({-2, 4}), doctest::Contains("expand: the target [-2, 4] of float32[1, 4] "
                                                                       "cpu has a negative size"), Error);
  CHECK_THROWS_WITH_AS(ones({3, 4}).expand({-1, 3, 4}), doctest::Contains("has a negative size"), Error);
  CHECK(ones({3, 1}).expand({2, -1, 5}).shape() == Shape{2, 3, 5});  // -1 keeps an existing dim
}

TEST_CASE("tensor() needs as many values as the shape has elements, arange needs a finite count") {
  CHECK_THROWS_WITH_AS(tensor(std::vector<float>{1, 2, 3}, Shape{2, 2}),
                       doctest::Contains("tensor: 3 values for the shape [2, 2], which has 4 elements"), Error);
  CHECK(values(tensor(std::vector<float>{1, 2, 3, 4}, Shape{2, 2})) == std::vector<double>{1, 2, 3, 4});
  CHECK_THROWS_WITH_AS(arange(0, INFINITY), doctest::Contains("arange: cannot go from 0 to inf"), Error);
  CHECK_THROWS_WITH_AS(arange(0, 1e30), doctest::Contains("more than a tensor holds"), Error);
  CHECK(values(arange(1, 2, 0.25, {.dtype = kFloat64})) == std::vector<double>{1, 1.25, 1.5, 1.75});
}

TEST_CASE("cat refuses tensors without dims, naming their position") {
  CHECK_THROWS_WITH_AS(cat({scalar_tensor(1.0), scalar_tensor(2.0)}),
                       doctest::Contains("cat: the tensor at position 0 (float32[] cpu) cannot be concatenated"), Error);
  CHECK_THROWS_WITH_AS(cat({ones({2}), scalar_tensor(2.0)}), doctest::Contains("position 1"), Error);
}

TEST_CASE("rand in float16 and bfloat16 stays below 1, and randint's range must fit its dtype") {
  for (DType dtype : {kFloat16, kBFloat16}) {
    manual_seed(0);
    const Tensor r = rand({100000}, {.dtype = dtype});
    CHECK(r.ge(1.0).sum().item<int64_t>() == 0);
    CHECK(r.lt(0.0).sum().item<int64_t>() == 0);
    CHECK(r.to(kFloat64).mean().item<double>() == doctest::Approx(0.5).epsilon(0.01));
  }
  CHECK_THROWS_WITH_AS(randint(0, 1000, {5}, {.dtype = kUInt8}),
                       doctest::Contains("randint: [0, 1000) is not within uint8's range [0, 255]"), Error);
  CHECK_THROWS_WITH_AS(randint(-(int64_t(1) << 40), int64_t(1) << 40, {3}, {.dtype = kInt32}),
                       doctest::Contains("is not within int32's range"), Error);
  const Tensor bytes = randint(0, 256, {1000}, {.dtype = kUInt8});
  CHECK(bytes.dtype() == kUInt8);
  const Tensor whole = randint(INT64_MIN, INT64_MAX, {1000});  // the widest range: no overflow
  CHECK(whole.lt(0).sum().item<int64_t>() > 0);
  CHECK(whole.gt(0).sum().item<int64_t>() > 0);
}

TEST_CASE("split, split_with_sizes, chunk and unbind: views of consecutive ranges along a dim, as PyTorch's") {
  const Tensor t = arange(10);
  auto lists = [](const std::vector<Tensor>& pieces) {
    std::vector<std::vector<double>> out;
    for (const Tensor& p : pieces) out.push_back(values(p));
    return out;
  };
  using Lists = std::vector<std::vector<double>>;
  CHECK(lists(t.split(4)) == Lists{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9}});
  CHECK(lists(t.split(10)) == Lists{{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}});
  CHECK(t.split(std::numeric_limits<int64_t>::max()).size() == 1);  // no overflow past the end
  CHECK(lists(t.split_with_sizes({1, 0, 9})) == Lists{{0}, {}, {1, 2, 3, 4, 5, 6, 7, 8, 9}});
  CHECK(lists(t.chunk(3)) == Lists{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9}});
  CHECK(t.chunk(4).size() == 4);  // pieces of 3: 3, 3, 3, 1
  CHECK(t.narrow(0, 0, 6).chunk(4).size() == 3);  // pieces of 2 cover 6 in three, as PyTorch's chunk
  CHECK(t.chunk(20).size() == 10);
  CHECK(zeros({0}).chunk(3).size() == 3);  // a dim of size 0: chunks empty pieces
  CHECK(zeros({0}).split(2).size() == 1);
  CHECK(zeros({0}).split(0).size() == 1);
  const Tensor m = arange(6).view({2, 3});
  CHECK(lists(m.split(2, 1)) == Lists{{0, 1, 3, 4}, {2, 5}});
  CHECK(m.split(2, -1)[1].shape() == Shape{2, 1});
  CHECK(lists(m.unbind(1)) == Lists{{0, 3}, {1, 4}, {2, 5}});
  CHECK(m.unbind()[1].shape() == Shape{3});
  // Views: a write through a piece is seen by the tensor it came from.
  Tensor base = zeros({4});
  base.chunk(2)[1].fill_(7);
  CHECK(values(base) == std::vector<double>{0, 0, 7, 7});
  CHECK(m.split(1, 0)[1].storage().get() == m.storage().get());
}

TEST_CASE("split, split_with_sizes, chunk and unbind refuse sizes that do not cover the dim, naming the op") {
  const Tensor t = arange(10);
  CHECK_THROWS_WITH_AS(t.split(0), doctest::Contains("split: split_size must be positive (0 only for a dim of size "
                                                     "0), got 0 for dim 0 of int64[10]"), Error);
  CHECK_THROWS_WITH_AS(t.split(-1), doctest::Contains("split: split_size must be positive"), Error);
  CHECK_THROWS_WITH_AS(t.split_with_sizes({3, 3}), doctest::Contains("split_with_sizes: sizes [3, 3] add up to 6, but "
                                                                     "dim 0 of int64[10] cpu has size 10"), Error);
  CHECK_THROWS_WITH_AS(t.split_with_sizes({11, -1}), doctest::Contains("a negative size"), Error);
  CHECK_THROWS_WITH_AS(t.chunk(0), doctest::Contains("chunk: chunks must be positive, got 0"), Error);
  CHECK_THROWS_WITH_AS(scalar_tensor(1.0).unbind(), doctest::Contains("unbind: dimension 0 given, but the tensor is "
                                                                      "0-d"), Error);
  CHECK_THROWS_WITH_AS(t.split(2, 1), doctest::Contains("split"), Error);
}

TEST_CASE("split's, chunk's and unbind's pieces share one backward node that joins their gradients") {
  manual_seed(331);
  gradcheck([](const TensorList& in) {
    const std::vector<Tensor> p = in[0].chunk(3, 1);
    return p[0] * 2 + p[2].sum() - p[1].exp().sum();
  }, {leaf({4, 7})});
  gradcheck([](const TensorList& in) {
    const std::vector<Tensor> p = in[0].split_with_sizes({1, 3}, 0);
    return p[1] * p[0];
  }, {leaf({4, 3})});
  gradcheck([](const TensorList& in) { return in[0].unbind(1)[2] * 3; }, {leaf({3, 4})});
  // A piece no loss uses gets zeros, and one node serves them all.
  Tensor x = arange(6).to(kFloat64).requires_grad_();
  const std::vector<Tensor> p = x.split(2);
  CHECK(p[0].grad_fn() == p[2].grad_fn());
  CHECK(p[0].grad_fn()->name() == "SplitBackward");
  CHECK(x.chunk(2)[0].grad_fn()->name() == "SplitBackward");  // as PyTorch's chunk
  (p[2] * 5).sum().backward();
  CHECK(values(x.grad()) == std::vector<double>{0, 0, 0, 0, 5, 5});
  CHECK(x.unbind()[0].grad_fn()->name() == "UnbindBackward");
}

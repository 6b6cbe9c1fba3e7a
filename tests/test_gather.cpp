// gather, scatter and scatter_add (ops/gather.h): PyTorch's values and checks, their gradients against finite
// differences, the in-place methods, and CUDA against the CPU.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "core/autocast.h"
#include "core/cuda.h"
#include "halfgrad.h"
#include "tests/gradcheck.h"
#include "tests/testing.h"

using namespace halfgrad;
using halfgrad::testing::gradcheck;
using halfgrad::testing::leaf;
using halfgrad::testing::values;

namespace {
Tensor index_of(std::vector<int64_t> v, const Shape& shape) { return tensor<int64_t>(std::move(v), shape); }
}  // namespace

TEST_CASE("gather reads the input at q, p with dim's coordinate replaced by index[p], as PyTorch's") {
  const Tensor x = tensor<double>({1, 2, 3, 4}, {2, 2});
  // torch.gather's documented example
  CHECK(values(x.gather(1, index_of({0, 0, 1, 0}, {2, 2}))) == std::vector<double>{1, 1, 4, 3});
  CHECK(values(x.gather(0, index_of({1, 0, 1, 1}, {2, 2}))) == std::vector<double>{3, 2, 3, 4});
  // index smaller than the input elsewhere, longer along dim, repeated; the result has index's shape
  const Tensor y = arange(24).view({2, 3, 4});
  const Tensor picked = y.gather(-1, index_of({3, 3, 0, 0, 0, 1, 2, 3, 1, 1}, {1, 2, 5}));
  CHECK(picked.shape() == Shape{1, 2, 5});
  CHECK(picked.dtype() == kInt64);
  CHECK(values(picked) == std::vector<double>{3, 3, 0, 0, 0, 5, 6, 7, 5, 5});
  CHECK(values(y.gather(1, index_of({2, 0}, {1, 1, 2}))) == std::vector<double>{8, 1});
  // a strided input and index
  CHECK(values(x.t().gather(0, index_of({1, 0}, {2, 1}).t())) == std::vector<double>{2, 3});
  // other dtypes, 0-d, empty
  CHECK(values(tensor<bool>({true, false, true}).gather(0, index_of({1, 2}, {2}))) == std::vector<double>{0, 1});
  CHECK(values(tensor<float>({1.5f, 2.5f}).to(kFloat16).gather(0, index_of({1}, {1}))) == std::vector<double>{2.5});
  const Tensor zero_d = scalar_tensor(7.0).gather(0, scalar_tensor(0, {.dtype = kInt64}));
  CHECK(zero_d.dim() == 0);
  CHECK(values(zero_d) == std::vector<double>{7});
  CHECK(x.gather(1, tensor<int64_t>({}).view({2, 0})).shape() == Shape{2, 0});
}

TEST_CASE("scatter writes src at index's positions into a copy, scatter_ into the tensor itself") {
  // torch.Tensor.scatter_'s documented examples
  const Tensor src = arange(1, 11).view({2, 5}).to(kFloat64);
  const Tensor zeros35 = zeros({3, 5}, {.dtype = kFloat64});
  CHECK(values(zeros35.scatter(0, index_of({0, 1, 2, 0}, {1, 4}), src)) ==
        std::vector<double>{1, 0, 0, 4, 0, 0, 2, 0, 0, 0, 0, 0, 3, 0, 0});
  CHECK(values(zeros35.scatter(1, index_of({0, 1, 2, 0, 1, 4}, {2, 3}), src)) ==
        std::vector<double>{1, 2, 3, 0, 0, 6, 7, 0, 0, 8, 0, 0, 0, 0, 0});
  CHECK(values(zeros35) == std::vector<double>(15, 0));  // out of place: the input is unchanged
  Tensor filled = full({2, 4}, 2.0, {.dtype = kFloat64});
  Tensor& same = filled.scatter_(1, index_of({2, 3}, {2, 1}), 1.23);
  CHECK(&same == &filled);
  CHECK(values(filled) == std::vector<double>{2, 2, 1.23, 2, 2, 2, 2, 1.23});
  // the no-grad path writes into the tensor's own storage, through its strides
  Tensor target = zeros({4, 3});
  const void* storage = target.data_ptr();
  target.t().scatter_(1, index_of({3, 0}, {1, 2}), tensor<float>({5, 6}, {1, 2}));
  CHECK(target.data_ptr() == storage);
  CHECK(values(target) == std::vector<double>{6, 0, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0});
  // one-hot rows, as users build them
  Tensor rows = zeros({3, 4}, {.dtype = kInt64});
  rows.scatter_(1, index_of({2, 0, 3}, {3, 1}), 1);
  CHECK(values(rows) == std::vector<double>{0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1});
  // src is the tensor itself: read before it is written
  Tensor self_src = tensor<double>({1, 2, 3});
  self_src.scatter_(0, index_of({1, 2, 0}, {3}), self_src);
  CHECK(values(self_src) == std::vector<double>{3, 1, 2});
  // the CPU kernel's last write wins where index repeats a position
  CHECK(values(zeros({2}).scatter(0, index_of({1, 1, 1}, {3}), tensor<float>({4, 5, 6}))) ==
        std::vector<double>{0, 6});
}

TEST_CASE("scatter_add adds src at index's positions, repeats adding up, integers wrapping") {
  // torch.Tensor.scatter_add_'s documented examples
  const Tensor ones25 = ones({2, 5});
  CHECK(values(zeros({3, 5}).scatter_add(0, index_of({0, 1, 2, 0, 0}, {1, 5}), ones25)) ==
        std::vector<double>{1, 0, 0, 1, 1, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0});
  CHECK(values(zeros({3, 5}).scatter_add(0, index_of({0, 1, 2, 0, 0, 0, 1, 2, 2, 2}, {2, 5}), ones25)) ==
        std::vector<double>{2, 0, 0, 1, 1, 0, 2, 0, 0, 0, 0, 0, 2, 1, 1});
  Tensor counts = zeros({4}, {.dtype = kInt64});
  counts.scatter_add_(0, index_of({3, 1, 3, 3}, {4}), ones({4}, {.dtype = kInt64}));
  CHECK(values(counts) == std::vector<double>{0, 1, 0, 3});
  const Tensor bytes = tensor<uint8_t>({250, 1});
  CHECK(values(bytes.scatter_add(0, index_of({0, 0}, {2}), tensor<uint8_t>({10, 3}))) == std::vector<double>{7, 1});
  // float16 adds round at each addition, as PyTorch's: 2048 + 1 is 2048 again
  const Tensor h = tensor<float>({2048}).to(kFloat16);
  CHECK(values(h.scatter_add(0, index_of({0, 0}, {2}), ones({2}, {.dtype = kFloat16}))) ==
        std::vector<double>{2048});
}

TEST_CASE("scatter_add under autocast promotes self and src to the wider dtype, as PyTorch's") {
  const Tensor self = zeros({3});
  const Tensor src = ones({2}, {.dtype = kFloat16});
  const Tensor index = index_of({0, 2}, {2});
  CHECK_THROWS_WITH_AS(self.scatter_add(0, index, src),
                       doctest::Contains("scatter_add: src float16[2] cpu must have the dtype of self float32[3]"),
                       Error);
  amp::AutocastGuard autocast(kFloat16);
  const Tensor out = self.scatter_add(0, index, src);
  CHECK(out.dtype() == kFloat32);
  CHECK(values(out) == std::vector<double>{1, 0, 1});
  CHECK(self.gather(0, index).dtype() == kFloat32);  // gather and scatter: unchanged
}

TEST_CASE("the CPU's scatter_add over many threads equals the sums taken one by one") {
  manual_seed(901);
  const int64_t rows = 7, cols = 3000, picks = 40;
  const Tensor index = randint(0, rows, {picks, cols});
  const Tensor src = randint(-5, 6, {picks, cols}).to(kFloat64);
  const Tensor out = zeros({rows, cols}, {.dtype = kFloat64}).scatter_add(0, index, src);
  std::vector<double> expected(size_t(rows * cols), 0.0);
  const std::vector<double> i = values(index), s = values(src);
  for (int64_t p = 0; p < picks; ++p) {
    for (int64_t c = 0; c < cols; ++c) {
      const size_t at = size_t(p * cols + c);
      expected[size_t(int64_t(i[at]) * cols + c)] += s[at];
    }
  }
  CHECK(values(out) == expected);
  // and gather reads back what a scatter of unique positions wrote
  const Tensor perm = index_of({3, 0, 6, 1, 4, 2, 5}, {rows, 1}).expand({rows, cols}).contiguous();
  const Tensor data = randn({rows, cols}, {.dtype = kFloat64});
  const Tensor placed = zeros({rows, cols}, {.dtype = kFloat64}).scatter(0, perm, data);
  CHECK(values(placed.gather(0, perm)) == values(data));
}

TEST_CASE("an empty index is not checked and changes nothing, and an int32 index works as int64, as PyTorch's") {
  const Tensor x = tensor<double>({1, 2, 3, 4, 5, 6}, {2, 3});
  CHECK(x.gather(0, tensor<int64_t>({})).shape() == Shape{0});
  CHECK(x.gather(1, tensor<int32_t>({}).view({5, 0})).shape() == Shape{5, 0});
  CHECK(values(x.scatter(0, tensor<int64_t>({}), tensor<double>({9}))) == values(x));
  CHECK(values(x.scatter_add(1, tensor<float>({}).view({0, 7}), ones({1, 1}, {.dtype = kFloat64}))) == values(x));
  Tensor target = x.clone();
  target.scatter_(0, tensor<int64_t>({}), 7.0);
  CHECK(values(target) == values(x));
  Tensor self = x.clone().requires_grad_(), src = tensor<double>({9}).requires_grad_();
  self.scatter(0, tensor<int64_t>({}), src).sum().backward();
  CHECK(values(self.grad()) == std::vector<double>(6, 1));
  CHECK(values(src.grad()) == std::vector<double>{0});
  const Tensor idx32 = tensor<int32_t>({2, 0, 1, 1}, {2, 2});
  CHECK(values(x.gather(1, idx32)) == values(x.gather(1, idx32.to(kInt64))));
  CHECK(values(zeros({2, 3}).scatter_add(1, idx32, ones({2, 2}))) == std::vector<double>{1, 0, 1, 0, 2, 0});
}

TEST_CASE("gather and the scatters refuse bad operands, naming the op, the tensors and the dim") {
  const Tensor x = randn({2, 3});
  CHECK_THROWS_WITH_AS(x.gather(1, index_of({0, 3}, {1, 2})),
                       doctest::Contains("gather: index 3 at position [0, 1] is out of range for dim 1 of size 3 of "
                                         "float32[2, 3] cpu; indices must be in [0, 3)"), Error);
  CHECK_THROWS_WITH_AS(x.gather(0, index_of({-1}, {1, 1})), doctest::Contains("gather: index -1 at position [0, 0]"),
                       Error);
  CHECK_THROWS_WITH_AS(x.gather(0, tensor<float>({0}).view({1, 1})),
                       doctest::Contains("gather: expected an int64 or int32 index, got float32[1, 1]"), Error);
  CHECK_THROWS_WITH_AS(x.gather(0, index_of({0}, {1})),
                       doctest::Contains("gather: index int64[1] cpu must have as many dims as input "
                                         "float32[2, 3]"),
                       Error);
  CHECK_THROWS_WITH_AS(x.gather(0, index_of({0, 0, 0, 0}, {1, 4})),
                       doctest::Contains("gather: index int64[1, 4] cpu is larger than input float32[2, 3] cpu in "
                                         "dim 1; only dim 0 may be larger"), Error);
  CHECK_THROWS_WITH_AS(x.gather(2, index_of({0}, {1, 1})), doctest::Contains("gather"), Error);
  CHECK_THROWS_WITH_AS(x.scatter(0, index_of({0, 1}, {1, 2}), tensor<double>({1}, {1, 1})),
                       doctest::Contains("scatter: src float64[1, 1] cpu must have the dtype of self float32[2, 3]"),
                       Error);
  CHECK_THROWS_WITH_AS(x.scatter(0, index_of({0, 1}, {1, 2}), ones({1, 1})),
                       doctest::Contains("scatter: index int64[1, 2] cpu is larger than src float32[1, 1] cpu in "
                                         "dim 1"),
                       Error);
  CHECK_THROWS_WITH_AS(x.scatter_add(1, index_of({5}, {1, 1}), ones({1, 1})),
                       doctest::Contains("scatter_add: index 5 at position [0, 0] is out of range for dim 1"), Error);
  CHECK_THROWS_WITH_AS(tensor<bool>({true}).scatter_add(0, index_of({0}, {1}), tensor<bool>({true})),
                       doctest::Contains("scatter_add: bool tensors are not added"), Error);
  CHECK_THROWS_WITH_AS(tensor<uint8_t>({1}).scatter(0, index_of({0}, {1}), 300),
                       doctest::Contains("scatter: 300 cannot be converted to uint8[1]"), Error);
  CHECK_THROWS_WITH_AS(x.gather(0, Tensor()), doctest::Contains("gather: got an undefined tensor"), Error);
  // A refused in-place scatter leaves the tensor and its version as they were.
  Tensor target = zeros({3});
  const uint64_t version = target.version();
  CHECK_THROWS_WITH_AS(target.scatter_(0, index_of({1, 3}, {2}), ones({2})),
                       doctest::Contains("scatter_: index 3 at position [1]"), Error);
  CHECK(target.version() == version);
  CHECK(values(target) == std::vector<double>{0, 0, 0});
  Tensor weight = zeros({3}).requires_grad_();
  CHECK_THROWS_WITH_AS(weight.scatter_(0, index_of({1}, {1}), ones({1})),
                       doctest::Contains("scatter_: a leaf tensor that requires grad"), Error);
  // Where autograd records the write, the errors still name the in-place op.
  Tensor computed = weight * 2;
  CHECK_THROWS_WITH_AS(computed.scatter_(0, index_of({5}, {1}), 1.0), doctest::Contains("scatter_: index 5"), Error);
  CHECK_THROWS_WITH_AS(computed.scatter_add_(0, index_of({5}, {1}), ones({1})),
                       doctest::Contains("scatter_add_: index 5"), Error);
  CHECK_THROWS_WITH_AS(tensor<uint8_t>({1}).scatter_(0, index_of({0}, {1}), 300),
                       doctest::Contains("scatter_: 300 cannot be converted"), Error);
}

TEST_CASE("gather's gradient adds each read's gradient where it read, in float32 sums for float16") {
  Tensor x = tensor<double>({1, 2, 3}).requires_grad_();
  x.gather(0, index_of({2, 2, 0, 2}, {4})).mul(tensor<double>({1, 10, 100, 1000})).sum().backward();
  CHECK(values(x.grad()) == std::vector<double>{100, 0, 1011});
  manual_seed(902);
  const Tensor index = randint(0, 3, {2, 5, 4});
  gradcheck([&](const TensorList& in) { return in[0].gather(1, index); }, {leaf({2, 3, 4})});
  gradcheck([&](const TensorList& in) { return in[0].gather(0, index.narrow(0, 0, 1)); }, {leaf({3, 6, 5})});
  gradcheck([&](const TensorList& in) { return in[0].permute({2, 0, 1}).gather(2, index.permute({2, 0, 1})); },
            {leaf({2, 3, 4})});  // strided input and index
  // 3,000 ones into one float16 element: float32 sums reach 3000, float16 ones would stop at 2048
  Tensor h = zeros({2}, {.dtype = kFloat16}).requires_grad_();
  h.gather(0, zeros({3000}, {.dtype = kInt64})).sum().backward();
  CHECK(h.grad().dtype() == kFloat16);
  CHECK(values(h.grad()) == std::vector<double>{3000, 0});
}

TEST_CASE("scatter's and scatter_add's gradients: self's but where overwritten, src's read back at index") {
  Tensor self = tensor<double>({1, 2, 3, 4}).requires_grad_();
  Tensor src = tensor<double>({10, 20, 30}).requires_grad_();
  const Tensor weights = tensor<double>({1, 10, 100, 1000});
  self.scatter(0, index_of({3, 0}, {2}), src).mul(weights).sum().backward();
  CHECK(values(self.grad()) == std::vector<double>{0, 10, 100, 0});
  CHECK(values(src.grad()) == std::vector<double>{1000, 1, 0});  // src[2] lies outside index's shape
  self.set_grad(Tensor());
  src.set_grad(Tensor());
  self.scatter_add(0, index_of({3, 3}, {2}), src).mul(weights).sum().backward();
  CHECK(values(self.grad()) == std::vector<double>{1, 10, 100, 1000});
  CHECK(values(src.grad()) == std::vector<double>{1000, 1000, 0});
  manual_seed(903);
  const Tensor unique = index_of({2, 0, 1, 1, 2, 0}, {2, 3});  // along dim 0 of [3, 3]: no position written twice
  gradcheck([&](const TensorList& in) { return in[0].scatter(0, unique, in[1]); }, {leaf({3, 3}), leaf({2, 4})});
  gradcheck([&](const TensorList& in) { return in[0].scatter(1, unique.t(), 2.5); }, {leaf({3, 4})});
  const Tensor repeated = randint(0, 3, {4, 3});
  gradcheck([&](const TensorList& in) { return in[0].scatter_add(0, repeated, in[1]); }, {leaf({3, 5}), leaf({4, 3})});
  gradcheck([&](const TensorList& in) { return in[0].t().scatter_add(1, repeated, in[1].t()); },
            {leaf({5, 4}), leaf({3, 4})});  // strided self and src
}

TEST_CASE("scatter_ and scatter_add_ on a tensor with history are recorded: gradients as out of place") {
  Tensor base = tensor<double>({1, 2, 3}).requires_grad_();
  Tensor src = tensor<double>({5, 7}).requires_grad_();
  Tensor y = base * 2;
  y.scatter_add_(0, index_of({0, 0}, {2}), src);
  y.scatter_(0, index_of({2}, {1}), 9.0);
  CHECK(values(y) == std::vector<double>{14, 4, 9});
  y.mul(tensor<double>({1, 10, 100})).sum().backward();
  CHECK(values(base.grad()) == std::vector<double>{2, 20, 0});
  CHECK(values(src.grad()) == std::vector<double>{1, 1});
  // A scatter_ whose src requires grad records too, into a tensor that did not.
  Tensor plain = zeros({3}, {.dtype = kFloat64});
  Tensor s = tensor<double>({4}).requires_grad_();
  plain.scatter_(0, index_of({1}, {1}), s);
  CHECK(plain.requires_grad());
  plain.mul(tensor<double>({1, 3, 1})).sum().backward();
  CHECK(values(s.grad()) == std::vector<double>{3});
}

TEST_CASE("CUDA gather and scatters match the CPU in every dtype, and their float32 gradients") {
  SKIP_WITHOUT_GPU();
  manual_seed(904);
  for (DType dt : {kFloat32, kFloat16, kBFloat16, kFloat64, kInt64, kInt32, kUInt8, kBool}) {
    CAPTURE(std::string(dtype_name(dt)));
    const Tensor x = (randn({4, 5, 6}) * 20).to(dt);
    for (int64_t dim : {0, 1, 2}) {
      CAPTURE(dim);
      Shape shape{3, 4, 5};
      shape[size_t(dim)] = 7;
      const Tensor index = randint(0, x.size(dim), shape);
      CHECK(values(x.cuda().gather(dim, index.cuda()).cpu()) == values(x.gather(dim, index)));
      // three distinct positions along dim for scatter, so that no write races another
      const Tensor perm = index_of({x.size(dim) - 1, 0, 1}, {3});
      Shape view_shape{1, 1, 1};
      view_shape[size_t(dim)] = 3;
      Shape run_shape{3, 4, 5};
      run_shape[size_t(dim)] = 3;
      const Tensor runs = perm.view(view_shape).expand(run_shape);  // an expanded (stride 0) index
      const Tensor src = (randn({4, 5, 6}) * 20).to(dt);
      CHECK(values(x.cuda().scatter(dim, runs.cuda(), src.cuda()).cpu()) == values(x.scatter(dim, runs, src)));
      CHECK(values(x.cuda().scatter(dim, runs.cuda(), 1).cpu()) == values(x.scatter(dim, runs, 1)));
      if (dt == kBool) continue;
      // Repeated positions, added atomically in any order on CUDA: small integers in every dtype, whose sums (up to
      // |20| + 7 x 20) every dtype holds exactly, so that the order cannot show (an H100 ran bfloat16 sums of
      // randn * 20 to differences of several of their roundings: 0.25 against -0.34 where the terms were ~20).
      const Tensor base = randint(-20, 21, {4, 5, 6}).to(dt), addends = randint(-20, 21, shape).to(dt);
      CHECK(values(base.cuda().scatter_add(dim, index.cuda(), addends.cuda()).cpu()) ==
            values(base.scatter_add(dim, index, addends)));
    }
  }
  // in place through strides, and 0-d
  Tensor target = zeros({4, 3}).cuda();
  target.t().scatter_(1, index_of({3, 0}, {1, 2}).cuda(), tensor<float>({5, 6}, {1, 2}).cuda());
  CHECK(values(target.cpu()) == std::vector<double>{6, 0, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0});
  CHECK(values(scalar_tensor(7.0).cuda().gather(0, scalar_tensor(0, {.dtype = kInt64}).cuda()).cpu()) ==
        std::vector<double>{7});
  // gradients
  Tensor xc = randn({5, 6}).requires_grad_(), xg = xc.detach().cuda().requires_grad_();
  Tensor sc = randn({3, 6}).requires_grad_(), sg = sc.detach().cuda().requires_grad_();
  const Tensor index = randint(0, 5, {3, 6});
  const Tensor g = randn({3, 6});
  xc.gather(0, index).backward(g);
  xg.gather(0, index.cuda()).backward(g.cuda());
  halfgrad::testing::check_close(values(xg.grad().cpu()), values(xc.grad()), 1e-5);
  xc.set_grad(Tensor());
  xg.set_grad(Tensor());
  const Tensor g2 = randn({5, 6});
  xc.scatter_add(0, index, sc).backward(g2);
  xg.scatter_add(0, index.cuda(), sg).backward(g2.cuda());
  CHECK(values(xg.grad().cpu()) == values(xc.grad()));
  CHECK(values(sg.grad().cpu()) == values(sc.grad()));
  // an index on the other device
  CHECK_THROWS_WITH_AS(xg.detach().gather(0, index), doctest::Contains("gather: input float32[5, 6] cuda:0"), Error);
}

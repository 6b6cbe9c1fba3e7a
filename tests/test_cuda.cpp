// The CUDA backend: every op on CUDA against the CPU result on random inputs, transfers, the caching
// allocator, streams, errors and autograd on CUDA tensors.
//
// Every test that needs a GPU skips (with a message) when none is available, so the file compiles and
// passes in a build without CUDA and on a machine without a GPU (CI).
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <initializer_list>
#include <string>
#include <tuple>
#include <vector>

#include "core/cuda.h"
#include "core/cuda_allocator.h"
#include "halfgrad.h"
#include "tests/testing.h"

#if HALFGRAD_WITH_CUDA
#include <cuda_runtime.h>
#endif

using namespace halfgrad;

namespace {

const Device kGpu = Device::cuda(0);

// How far a CUDA result may be from the CPU's for the same op on the same input. Both compute in the
// same type (opmath_t), so the differences are the math library's last bit or two (CUDA's expf, tanhf,
// powf are within 2 ulp, glibc's within 1) and FMA contraction; a 16-bit result can then round to the
// neighbouring value: one ulp of float16 is 2^-10 relative, of bfloat16 2^-7.
struct Tolerance {
  double rtol, atol;
};
Tolerance op_tolerance(DType t) {
  switch (t) {
    case kFloat16: return {2e-3, 1e-3};
    case kBFloat16: return {1.6e-2, 1e-2};
    case kFloat32: return {1e-5, 1e-6};
    case kFloat64: return {1e-12, 1e-12};
    default: return {0, 0};  // integers and bool: exact
  }
}

// Random values (never all zeros) of a dtype: floats uniform in [lo, hi), integers in [-50, 50) (uint8:
// [0, 100)), bools half true.
Tensor random(const Shape& shape, DType dt, double lo = -2, double hi = 2) {
  if (is_floating(dt)) return (rand(shape, {.dtype = kFloat64}) * (hi - lo) + lo).to(dt);
  if (dt == kBool) return randint(0, 2, shape).to(kBool);
  if (dt == kUInt8) return randint(0, 100, shape, {.dtype = kUInt8});
  return randint(-50, 50, shape, {.dtype = dt});
}

// Every element of `got` (a CUDA result) within tolerance of `want` (the CPU's); nan matches nan.
void check_close(const Tensor& got, const Tensor& want, Tolerance tol, const std::string& what) {
  INFO(what);
  REQUIRE(got.defined());
  CHECK(got.device() == kGpu);
  REQUIRE(got.shape() == want.shape());
  REQUIRE(got.dtype() == want.dtype());
  std::vector<double> a = to_vector<double>(got), b = to_vector<double>(want);
  int bad = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    bool same = (std::isnan(a[i]) && std::isnan(b[i])) || a[i] == b[i] ||
                std::abs(a[i] - b[i]) <= tol.atol + tol.rtol * std::abs(b[i]);
    if (!same && bad++ < 3) FAIL_CHECK("element " << i << ": cuda " << a[i] << " vs cpu " << b[i]);
  }
  CHECK_MESSAGE(bad == 0, bad << " of " << a.size() << " elements differ");
}

// ||a - b|| / ||b|| in float64.
double relative_error(const Tensor& a, const Tensor& b) {
  std::vector<double> x = to_vector<double>(a), y = to_vector<double>(b);
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    num += (x[i] - y[i]) * (x[i] - y[i]);
    den += y[i] * y[i];
  }
  return std::sqrt(num / den);
}

using Unary = Tensor (*)(const Tensor&);

const std::vector<DType> kFloatTypes = {kFloat64, kFloat32, kFloat16, kBFloat16};
const std::vector<DType> kAllTypes = {kBool, kUInt8, kInt32, kInt64, kFloat16, kBFloat16, kFloat32, kFloat64};

}  // namespace

TEST_CASE("cuda: availability, and a clear error for CUDA tensors, graphs and syncs without a GPU") {
  CHECK(cuda::device_count() >= 0);
  auto capture = [](int device) {
    cuda::Graph graph;
    graph.capture(Device::cuda(device), [] {});
  };
  if (!cuda::is_available()) {
    CHECK(cuda::device_count() == 0);
    CHECK_THROWS_AS(empty({4}, {.device = kGpu}), Error);
    // Each names the call and says why, not the driver call that failed first (cudaGetDevice).
#if HALFGRAD_WITH_CUDA
    const std::string none = ": no CUDA device is available (no GPU or no driver)";
#else
    const std::string none = ": halfgrad was built without CUDA";
#endif
    CHECK_THROWS_WITH_AS(capture(0), doctest::Contains(("cuda::Graph::capture" + none).c_str()), Error);
    CHECK_THROWS_WITH_AS((cuda::CapturedStep(kGpu, [] {})), doctest::Contains(("cuda::CapturedStep" + none).c_str()),
                         Error);
    CHECK_THROWS_WITH_AS(cuda::synchronize(), doctest::Contains(("cuda::synchronize" + none).c_str()), Error);
    CHECK_THROWS_WITH_AS(cuda::synchronize(0), doctest::Contains(("cuda::synchronize" + none).c_str()), Error);
    CHECK_THROWS_WITH_AS(cuda::synchronize_stream(0), doctest::Contains(("cuda::synchronize_stream" + none).c_str()),
                         Error);
    CHECK_THROWS_WITH_AS(cuda::current_device(), doctest::Contains(("cuda::current_device" + none).c_str()), Error);
    CHECK_THROWS_WITH_AS(cuda::DeviceGuard(0), doctest::Contains(("cuda::DeviceGuard" + none).c_str()), Error);
    MESSAGE("no GPU: only the error paths were checked");
    return;
  }
  CHECK(cuda::device_count() >= 1);
  CHECK_FALSE(cuda::device_name(0).empty());
  MESSAGE("GPU 0: " << cuda::device_name(0));
  CHECK_THROWS_AS(empty({4}, {.device = Device::cuda(cuda::device_count())}), Error);  // no such GPU
  const std::string past = fmt::format("cuda::Graph::capture: CUDA device {} does not exist", cuda::device_count());
  CHECK_THROWS_WITH_AS(capture(cuda::device_count()), doctest::Contains(past.c_str()), Error);
  // A negative index is refused, not taken as the current device.
  CHECK_THROWS_WITH_AS(cuda::synchronize(-1), doctest::Contains("cuda::synchronize: CUDA device -1 does not exist"),
                       Error);
  CHECK_THROWS_WITH_AS(cuda::synchronize_stream(-1),
                       doctest::Contains("cuda::synchronize_stream: CUDA device -1 does not exist"), Error);
}

TEST_CASE("cuda: checked calls name the call, the op and file:line") {
  auto failing_call = [] { return 1; };  // cudaErrorInvalidValue, cuBLAS/cuDNN "not initialized"
  try {
    HG_CUDA_CHECK(failing_call(), "my_op");
    FAIL("HG_CUDA_CHECK did not throw");
  } catch (const Error& e) {
    std::string msg = e.what();
    CHECK(msg.find("failing_call()") != std::string::npos);
    CHECK(msg.find("my_op") != std::string::npos);
    CHECK(msg.find("test_cuda.cpp:") != std::string::npos);
    CHECK(msg.find("CUDA error") != std::string::npos);
  }
  CHECK_THROWS_WITH_AS([&] { HG_CUBLAS_CHECK(failing_call()); }(), doctest::Contains("cuBLAS error"), Error);
  CHECK_THROWS_WITH_AS([&] { HG_CUDNN_CHECK(failing_call()); }(), doctest::Contains("cuDNN error"), Error);
  CHECK_NOTHROW([] { HG_CUDA_CHECK([] { return 0; }()); }());
}

TEST_CASE("cuda: host <-> device round trips are exact in every dtype") {
  SKIP_WITHOUT_GPU();
  manual_seed(10);
  for (DType dt : kAllTypes) {
    CAPTURE(std::string(dtype_name(dt)));
    Tensor x = random({17, 33}, dt);
    Tensor g = x.to(kGpu);
    CHECK(g.is_cuda());
    CHECK(g.dtype() == dt);
    check_close(g, x, {0, 0}, "upload");
    Tensor back = g.cpu();
    CHECK(back.is_cpu());
    CHECK(to_vector<double>(back) == to_vector<double>(x));
  }
  // Larger than one 16 MiB staging chunk, with a partial last chunk; a non-contiguous source.
  Tensor big = random({5'000'003}, kFloat32);
  CHECK(to_vector<float>(big.cuda().cpu()) == to_vector<float>(big));
  Tensor t = random({64, 48}, kFloat64).t();
  check_close(t.cuda(), t.contiguous(), {0, 0}, "transposed upload");
  // A cast and a move at once, and copy_ across devices into a view.
  check_close(big.to(kGpu, kFloat16), big.to(kFloat16), {0, 0}, "to(device, dtype)");
  Tensor dst = zeros({8, 8}, {.device = kGpu});
  Tensor src = random({8, 4}, kFloat32);
  dst.slice(1, 0, 8, 2).copy_(src);
  check_close(dst.slice(1, 0, 8, 2), src, {0, 0}, "copy_ from the host into a strided device view");
  check_close(dst.slice(1, 1, 8, 2), zeros({8, 4}), {0, 0}, "untouched columns stay zero");
}

TEST_CASE("cuda: device to device copies") {
  SKIP_WITHOUT_GPU();
  Tensor x = random({1000}, kFloat32).cuda();
  Tensor y = x.clone();
  CHECK(y.data_ptr() != x.data_ptr());
  check_close(y, x.cpu(), {0, 0}, "clone");
  if (cuda::device_count() >= 2) {
    Tensor other = x.to(Device::cuda(1));
    CHECK(other.device() == Device::cuda(1));
    check_close(other.to(kGpu), x.cpu(), {0, 0}, "cuda:0 -> cuda:1 -> cuda:0");
  } else {
    MESSAGE("one GPU: copies between GPUs not checked");
  }
}

TEST_CASE("cuda: copies between matrices' rows (column ranges of wider matrices, row-broadcast sources) are exact") {
  SKIP_WITHOUT_GPU();
  // The rows path (ops/copy.cu): 2-D, same dtype, unit column stride; widths below, at and past a warp's tile.
  for (DType dt : {kFloat32, kFloat16, kFloat64, kInt64}) {
    for (auto [rows, cols] : {std::pair{3, 5}, {7, 256}, {33, 650}, {2, 1000}}) {
      const std::string dtype = dtype_name(dt);
      CAPTURE(dtype);
      CAPTURE(cols);
      const Tensor wide = random({rows, 2 * cols + 3}, dt);
      const Tensor wide_gpu = wide.cuda();
      // Taken out: the right-hand columns of a wider matrix into a dense one.
      check_close(wide_gpu.narrow(1, cols, cols).contiguous(), wide.narrow(1, cols, cols).contiguous(), {0, 0},
                  "column range out");
      // Put in: a dense matrix into a column range, the columns around it untouched.
      Tensor into = wide_gpu.clone();
      const Tensor part = random({rows, cols}, dt);
      into.narrow(1, 1, cols).copy_(part.cuda());
      Tensor want = wide.clone();
      want.narrow(1, 1, cols).copy_(part);
      check_close(into, want, {0, 0}, "column range in");
      // A row broadcast (row stride 0) as the source.
      Tensor rowwise = empty({rows, cols}, {.dtype = dt, .device = Device::cuda(0)});
      rowwise.copy_(part.cuda().narrow(0, 0, 1).expand({rows, cols}));
      check_close(rowwise, part.narrow(0, 0, 1).expand({rows, cols}).contiguous(), {0, 0}, "row broadcast");
    }
  }
}

TEST_CASE("cuda: casts between every pair of dtypes match the CPU") {
  SKIP_WITHOUT_GPU();
  manual_seed(11);
  for (DType from : kAllTypes) {
    // Values every dtype can hold (uint8 has no negatives): integers 0..99 and fractions for floats.
    Tensor x = is_floating(from) ? random({9, 31}, from, 0, 100) : random({9, 31}, from);
    if (from != kUInt8 && !is_floating(from) && from != kBool) x = x.abs();
    Tensor xg = x.cuda();
    for (DType to : kAllTypes) {
      CAPTURE(std::string(dtype_name(from)));
      CAPTURE(std::string(dtype_name(to)));
      check_close(xg.to(to), x.to(to), {0, 0}, "contiguous cast");
      check_close(xg.t().to(to), x.t().to(to), {0, 0}, "transposed cast");
    }
  }
}

TEST_CASE("cuda: unary ops match the CPU in every dtype they take") {
  SKIP_WITHOUT_GPU();
  manual_seed(12);
  struct Case {
    std::string name;
    Tensor (*op)(const Tensor&);
    bool positive;
  };
  const std::vector<Case> cases = {{"neg", neg, false},   {"abs", abs, false},   {"exp", exp, false},
                                   {"log", log, true},    {"sqrt", sqrt, true},  {"rsqrt", rsqrt, true},
                                   {"tanh", tanh, false}, {"sigmoid", sigmoid, false}, {"relu", relu, false},
                                   {"sign", sign, false}, {"isfinite", isfinite, false}};
  for (const Case& c : cases) {
    for (DType dt : kFloatTypes) {
      CAPTURE(c.name);
      CAPTURE(std::string(dtype_name(dt)));
      Tensor x = c.positive ? random({31, 67}, dt, 0.1, 4) : random({31, 67}, dt, -4, 4);
      Tolerance tol = std::string(c.name) == "isfinite" ? Tolerance{0, 0} : op_tolerance(dt);
      check_close(c.op(x.cuda()), c.op(x), tol, "contiguous");
      check_close(c.op(x.cuda().t()), c.op(x.t()), tol, "transposed");
      check_close(c.op(x.cuda().slice(1, 1, 60, 3)), c.op(x.slice(1, 1, 60, 3)), tol, "sliced");
    }
  }
  for (DType dt : {kUInt8, kInt32, kInt64}) {
    CAPTURE(std::string(dtype_name(dt)));
    Tensor x = random({13, 29}, dt);
    for (Unary op : std::initializer_list<Unary>{neg, abs, relu, sign, logical_not, isfinite, exp, sqrt})
      check_close(op(x.cuda()), op(x), {1e-5, 1e-6}, "integer");
  }
  Tensor b = random({40}, kBool);
  check_close(logical_not(b.cuda()), logical_not(b), {0, 0}, "logical_not");
  check_close(isfinite(b.cuda()), isfinite(b), {0, 0}, "isfinite of bool");
  // nan and inf pass through as on the CPU.
  Tensor special = tensor<float>({NAN, INFINITY, -INFINITY, -0.0f, 1.5f, -2.0f});
  for (Unary op : std::initializer_list<Unary>{relu, tanh, sigmoid, isfinite, abs, sign})
    check_close(op(special.cuda()), op(special), op_tolerance(kFloat32), "specials");
}

TEST_CASE("cuda: binary ops match the CPU with broadcasting, strides and scalars") {
  SKIP_WITHOUT_GPU();
  manual_seed(13);
  using Op = Tensor (*)(const Tensor&, const Tensor&);
  struct Case {
    std::string name;
    Op op;
  };
  const std::vector<Case> arithmetic = {{"add", [](const Tensor& a, const Tensor& b) { return a + b; }},
                                        {"sub", [](const Tensor& a, const Tensor& b) { return a - b; }},
                                        {"mul", mul},
                                        {"div", div},
                                        {"maximum", maximum},
                                        {"minimum", minimum},
                                        {"eq", eq},
                                        {"ne", ne},
                                        {"lt", lt},
                                        {"le", le},
                                        {"gt", gt},
                                        {"ge", ge},
                                        {"logical_and", logical_and},
                                        {"logical_or", logical_or}};
  for (DType dt : kAllTypes) {
    for (const Case& c : arithmetic) {
      const bool is_div = std::string(c.name) == "div";
      if (dt == kBool && (is_div || std::string(c.name) == "sub")) continue;  // refused for bool
      CAPTURE(std::string(dtype_name(dt)));
      CAPTURE(c.name);
      Tolerance tol = op_tolerance(is_div && !is_floating(dt) ? kFloat32 : dt);
      Tensor a = random({5, 1, 37}, dt), b = random({4, 37}, dt);
      if (is_div) b = is_floating(dt) ? b.abs() + 0.5 : b.abs() + 1;  // no division by zero
      // Same shape, broadcast, transposed/sliced operands, and a 0-d CPU scalar operand.
      Tensor a2 = random({4, 37}, dt);
      check_close(c.op(a2.cuda(), b.cuda()), c.op(a2, b), tol, "same shape");
      check_close(c.op(a.cuda(), b.cuda()), c.op(a, b), tol, "broadcast");
      Tensor at = random({37, 4}, dt);
      check_close(c.op(at.cuda().t(), b.cuda()), c.op(at.t(), b), tol, "transposed");
      check_close(c.op(a.cuda().slice(2, 1, 37, 2), b.cuda().slice(1, 0, 36, 2)),
                  c.op(a.slice(2, 1, 37, 2), b.slice(1, 0, 36, 2)), tol, "sliced");
      Tensor s = random({}, dt);
      if (is_div) s = is_floating(dt) ? s.abs() + 0.5 : s.abs() + 1;
      check_close(c.op(a.cuda(), s), c.op(a, s), tol, "tensor op cpu scalar");
      check_close(c.op(s, b.cuda()), c.op(s, b), tol, "cpu scalar op tensor");
    }
  }
  // pow: positive bases for floats; small exponents for integers.
  for (DType dt : kFloatTypes) {
    CAPTURE(std::string(dtype_name(dt)));
    Tensor base = random({3, 50}, dt, 0.1, 3), exponent = random({50}, dt, -2, 2);
    check_close(pow(base.cuda(), exponent.cuda()), pow(base, exponent), op_tolerance(dt), "pow");
    check_close(pow(base.cuda(), 2.5), pow(base, 2.5), op_tolerance(dt), "pow scalar");
  }
  for (DType dt : {kInt32, kInt64}) {
    Tensor base = randint(-3, 4, {60}, {.dtype = dt}), exponent = randint(-1, 5, {60}, {.dtype = dt});
    check_close(pow(base.cuda(), exponent.cuda()), pow(base, exponent), {0, 0}, "integer pow");
  }
  // Scalars given as numbers, in place updates and a broadcast result of mixed dtypes.
  Tensor x = random({6, 7}, kFloat32);
  check_close(x.cuda() * 2.5 + 1, x * 2.5 + 1, op_tolerance(kFloat32), "number operands");
  check_close(3 - x.cuda(), 3 - x, op_tolerance(kFloat32), "number on the left");
  Tensor y = x.cuda();
  y.mul_(2).add_(random({7}, kFloat32).cuda());
  CHECK(y.is_cuda());
  Tensor i = random({6, 7}, kInt32);
  check_close(x.cuda() + i.cuda(), x + i, op_tolerance(kFloat32), "float32 + int32 promotes");
  check_close(x.cuda().to(kFloat16) + x.cuda().to(kBFloat16), x.to(kFloat16) + x.to(kBFloat16), op_tolerance(kFloat32),
              "float16 + bfloat16 -> float32");
}

TEST_CASE("cuda: a number beside float16 and bfloat16 is read as on the CPU, bit for bit (float32 in arithmetic)") {
  SKIP_WITHOUT_GPU();
  manual_seed(17);
  using Op = Tensor (*)(const Tensor&, const Tensor&);
  const std::vector<std::pair<const char*, Op>> ops = {
      {"add", [](const Tensor& a, const Tensor& b) { return a + b; }},
      {"sub", [](const Tensor& a, const Tensor& b) { return a - b; }},
      {"mul", mul}, {"div", div}, {"maximum", maximum}, {"minimum", minimum}, {"eq", eq}, {"lt", lt}, {"ge", ge}};
  for (DType dt : {kFloat16, kBFloat16}) {
    const Tensor x = random({3, 41}, dt, 0.05, 2000);
    for (double number : {1e-8, 0.1, 0.3, 70000.0}) {
      const Tensor s = scalar_tensor(number, {.dtype = kFloat64});
      for (const auto& [name, op] : ops) {
        CAPTURE(std::string(dtype_name(dt)));
        CAPTURE(name);
        CAPTURE(number);
        check_close(op(x.cuda(), s), op(x, s), {0, 0}, "tensor op number");
        check_close(op(s, x.cuda()), op(s, x), {0, 0}, "number op tensor");
      }
      Tensor y = x.cuda().t();
      y.mul_(number).add_(number);
      check_close(y, x.t() * number + number, {0, 0}, "in place");
      check_close(pow(x.cuda(), number), pow(x, number), op_tolerance(dt), "pow");  // powf against std::pow
    }
  }
  // float16's 1000 * 1e-8 as PyTorch's CUDA kernel gives it (1e-8 rounded to float16 first would make it 0).
  CHECK((full({1}, 1000.0, {.dtype = kFloat16, .device = Device::cuda()}) * 1e-8).item<double>() ==
        1.0013580322265625e-05);
}

TEST_CASE("cuda: copy_each_ copies many tensors bit for bit in batched launches, and casts and strided pairs too") {
  SKIP_WITHOUT_GPU();
  const DType dtypes[] = {kFloat32, kFloat16, kBFloat16, kFloat64, kInt64, kInt32, kUInt8, kBool};
  TensorList src, dst;
  for (int i = 0; i < 200; ++i) {  // more tensors than one launch's batch holds
    const DType dtype = dtypes[i % 8];
    const int64_t n = 1 + (i * 37) % 5000 + (i == 7 ? 100000 : 0);  // one of several chunks
    src.push_back((randn({n}) * 100).to(dtype).cuda());
    // Every third destination starts one element into its storage: not 16-byte aligned, the one-element path.
    Tensor d = empty({n + 1}, {.dtype = dtype, .device = kGpu});
    dst.push_back(i % 3 == 0 ? d.narrow(0, 1, n) : d.narrow(0, 0, n));
  }
  src.push_back(randn({6, 5}).cuda());
  dst.push_back(empty({6, 5}, {.dtype = kFloat16, .device = kGpu}));  // a cast
  src.push_back(randn({5, 6}).cuda().t());
  dst.push_back(empty({6, 5}, {.device = kGpu}));  // a transposed source
  copy_each_(dst, src);
  for (size_t i = 0; i < src.size(); ++i) {
    CAPTURE(i);
    CHECK(testing::values(dst[i].cpu()) == testing::values(src[i].to(dst[i].dtype()).cpu()));
  }
}

TEST_CASE("cuda: copy_each_ casts float32 to and from float16 and bfloat16 in batched launches, bit for bit as to()") {
  SKIP_WITHOUT_GPU();
  // Values past float16's range, subnormals, infinities and NaN; lengths with a tail past the 4-element vectors;
  // destinations one element into their storage (the element-by-element path); channels_last pairs.
  const std::vector<float> specials = {70000.f, -1e-6f, 3e-8f, INFINITY, -INFINITY, NAN, 1.f / 3, -0.f, 65520.f};
  auto bits = [](const Tensor& t) {
    const Tensor c = t.cpu().contiguous();
    std::vector<uint8_t> out(size_t(c.numel()) * element_size(c.dtype()));
    std::memcpy(out.data(), c.data_ptr(), out.size());
    return out;
  };
  const std::pair<DType, DType> pairs[] = {{kFloat32, kFloat16}, {kFloat32, kBFloat16}, {kFloat16, kFloat32},
                                           {kBFloat16, kFloat32}};
  TensorList src, dst;
  for (int i = 0; i < 440; ++i) {  // 110 a pair of dtypes: more than one launch's batch holds (95)
    const auto [to, from] = pairs[i % 4];
    const int64_t n = 1 + (i * 53) % 1000 + (i == 5 ? 40000 : 0);
    Tensor values = randn({n}) * 1000;
    values.narrow(0, 0, std::min<int64_t>(n, 9)).copy_(tensor(specials).narrow(0, 0, std::min<int64_t>(n, 9)));
    src.push_back(values.to(from).cuda());
    Tensor d = empty({n + 1}, {.dtype = to, .device = kGpu});
    dst.push_back(i % 3 == 0 ? d.narrow(0, 1, n) : d.narrow(0, 0, n));
  }
  for (const auto& [to, from] : pairs) {
    src.push_back(contiguous_channels_last((randn({4, 6, 3, 5}) * 100).to(from).cuda()));
    dst.push_back(empty({4, 6, 3, 5}, {.dtype = to, .device = kGpu}, MemoryFormat::ChannelsLast));
  }
  copy_each_(dst, src);
  for (size_t i = 0; i < src.size(); ++i) {
    CAPTURE(i);
    CHECK(bits(dst[i]) == bits(src[i].to(dst[i].dtype())));
  }
  CHECK(is_channels_last(dst.back()));
}

TEST_CASE("cuda: where, clamp and fill match the CPU") {
  SKIP_WITHOUT_GPU();
  manual_seed(14);
  for (DType dt : kAllTypes) {
    CAPTURE(std::string(dtype_name(dt)));
    Tensor c = random({5, 1}, kBool), a = random({5, 9}, dt), b = random({9}, dt);
    check_close(where(c.cuda(), a.cuda(), b.cuda()), where(c, a, b), {0, 0}, "where");
    check_close(where(c.cuda(), a.cuda().t().t(), 3), where(c, a, 3), {0, 0}, "where with a scalar");
    Tensor f = empty({3, 70}, {.dtype = dt, .device = kGpu});
    f.fill_(dt == kBool ? 1 : 7);
    check_close(f, full({3, 70}, dt == kBool ? 1 : 7, {.dtype = dt}), {0, 0}, "fill_");
    Tensor strided = zeros({10, 10}, {.dtype = dt, .device = kGpu});
    strided.slice(0, 0, 10, 3).fill_(1);
    Tensor expect = zeros({10, 10}, {.dtype = dt});
    expect.slice(0, 0, 10, 3).fill_(1);
    check_close(strided, expect, {0, 0}, "strided fill_");
  }
  for (DType dt : kFloatTypes) {
    Tensor x = random({40}, dt, -3, 3);
    check_close(x.cuda().clamp(-1, 0.5), x.clamp(-1, 0.5), op_tolerance(dt), "clamp");
  }
}

TEST_CASE("cuda: elementwise kernels at vector-path edges: sizes, offsets and large tensors") {
  SKIP_WITHOUT_GPU();
  manual_seed(15);
  for (int64_t n : {int64_t(1), int64_t(3), int64_t(8), int64_t(15), int64_t(1023), int64_t(4097), int64_t(1 << 20) + 5}) {
    for (DType dt : {kFloat32, kFloat16, kUInt8, kFloat64}) {
      CAPTURE(n);
      CAPTURE(std::string(dtype_name(dt)));
      Tensor a = random({n + 1}, dt), b = random({n + 1}, dt);
      Tensor ag = a.cuda(), bg = b.cuda();
      // Offset by one element: the 16-byte vector path does not apply, the kernel must still be right.
      check_close(ag.slice(0, 1, n + 1) + bg.slice(0, 0, n), a.slice(0, 1, n + 1) + b.slice(0, 0, n), op_tolerance(dt),
                  "misaligned");
      check_close(ag.slice(0, 0, n) * bg.slice(0, 0, n), a.slice(0, 0, n) * b.slice(0, 0, n), op_tolerance(dt), "aligned");
    }
  }
}

TEST_CASE("cuda: elementwise ops over channels-last, permuted and mixed layouts match the CPU and keep the layout") {
  // Operands that fill their memory in another order than NCHW (channels last, a permutation) run as one flat
  // range; others (broadcast bias, mixed layouts, gaps) in the order of the output's memory. Both must be right.
  SKIP_WITHOUT_GPU();
  manual_seed(16);
  for (DType dt : {kFloat32, kFloat16}) {
    CAPTURE(std::string(dtype_name(dt)));
    const Tolerance tol = op_tolerance(dt);
    Tensor a = random({4, 24, 5, 6}, dt), b = random({4, 24, 5, 6}, dt), bias = random({24, 1, 1}, dt);
    Tensor a_cl = contiguous_channels_last(a.cuda()), b_cl = contiguous_channels_last(b.cuda());
    Tensor sum = a_cl + b_cl;
    CHECK(sum.stride(1) == 1);  // the result is channels last too
    check_close(sum, a + b, tol, "both channels last");
    check_close(relu(a_cl), relu(a), tol, "unary, channels last");
    check_close(where(a_cl.gt(0.0), a_cl, b_cl), where(a.gt(0.0), a, b), tol, "where, channels last");
    check_close(a_cl + bias.cuda(), a + bias, tol, "channels last + broadcast bias");
    check_close(a_cl * b.cuda(), a * b, tol, "channels last * NCHW");
    Tensor p = random({6, 5, 24, 4}, dt);  // dense, dims permuted: [4, 24, 5, 6] over [6, 5, 24, 4] memory
    check_close(p.cuda().permute({3, 2, 1, 0}) - b.cuda().permute({0, 1, 3, 2}).contiguous().permute({0, 1, 3, 2}),
                p.permute({3, 2, 1, 0}) - b, tol, "permuted and transposed");
    Tensor wide = random({4, 24, 5, 12}, dt);  // every other column: a gap in the memory
    check_close(a_cl + wide.cuda().slice(3, 0, 12, 2), a + wide.slice(3, 0, 12, 2), tol, "channels last + sliced");
  }
}

TEST_CASE("cuda: a strided op over more than 2^31 elements is split correctly") {
  SKIP_WITHOUT_GPU();
#if HALFGRAD_WITH_CUDA
  size_t free_bytes = 0, total = 0;
  REQUIRE(cudaMemGetInfo(&free_bytes, &total) == cudaSuccess);
  if (free_bytes < (size_t(8) << 30)) {
    MESSAGE("less than 8 GiB free on the GPU: skipped");
    return;
  }
  const int64_t n = (int64_t(1) << 31) + 77;
  Tensor x = empty({n, 2}, {.dtype = kUInt8, .device = kGpu});
  x.select(1, 0).fill_(3);  // a strided fill over n elements
  x.select(1, 1).fill_(5);
  Tensor y = x.select(1, 0) + x.select(1, 1);  // strided inputs, n > 2^31: the launcher splits
  CHECK(y.sum().item<int64_t>() == 8 * n);
  CHECK(y.slice(0, n - 3, n).cpu().sum().item<int64_t>() == 24);
#endif
}

TEST_CASE("cuda: reductions match the CPU") {
  SKIP_WITHOUT_GPU();
  manual_seed(16);
  // Shapes chosen to reach every kernel: short and long rows (inner == 1), columns (inner > 1), splits of
  // the reduced dim (few outputs), and one output over a million elements.
  const std::vector<std::pair<Shape, Dims>> problems = {
      {{7, 300, 5}, {}},      {{7, 300, 5}, {1}},   {{7, 300, 5}, {2}},     {{7, 300, 5}, {0}},
      {{7, 300, 5}, {0, 2}},  {{3, 100000}, {1}},   {{100000, 3}, {0}},     {{1 << 20}, {}},
      {{2048, 3}, {1}},       {{4, 4, 4, 4}, {1, 3}}, {{1, 1}, {}},         {{5, 0, 2}, {1}},
      {{3000, 64}, {0}}};  // columns grouped for 8/16-bit types, with splits
  for (const auto& [shape, dims] : problems) {
    for (DType dt : kFloatTypes) {
      CAPTURE(shape_str(shape));
      CAPTURE(dims.size());
      CAPTURE(std::string(dtype_name(dt)));
      // Positive values: sums do not cancel, so a relative tolerance fits. Accumulation is float32
      // (float64 for float64); what differs is the order of the additions: about log2(n) ulp of float32,
      // plus the output's own rounding for 16-bit dtypes.
      Tensor x = random(shape, dt, 0.5, 1.5), xg = x.cuda();
      Tolerance tol = dt == kFloat64 ? Tolerance{1e-12, 0} : dt == kFloat32 ? Tolerance{2e-5, 0} : op_tolerance(dt);
      check_close(xg.sum(dims), x.sum(dims), tol, "sum");
      check_close(xg.mean(dims, true), x.mean(dims, true), tol, "mean");
      if (x.numel() > 0) check_close(xg.var(dims), x.var(dims), {tol.rtol * 10 + 1e-5, 1e-6}, "var");
    }
  }
  // conv's bias gradient of a channels-last gradient: [N, C, H, W] over {0, 2, 3} is one [N H W, C] block of
  // columns in its memory, reduced without a transposing copy (ops/reduce.cpp).
  for (DType dt : kFloatTypes) {
    CAPTURE(std::string(dtype_name(dt)));
    Tensor x = contiguous_channels_last(random({32, 64, 16, 16}, dt, 0.5, 1.5));
    Tensor xg = contiguous_channels_last(x.cuda());
    Tolerance tol = dt == kFloat64 ? Tolerance{1e-12, 0} : dt == kFloat32 ? Tolerance{2e-5, 0} : op_tolerance(dt);
    check_close(xg.sum({0, 2, 3}), x.sum({0, 2, 3}), tol, "channels-last sum over {0, 2, 3}");
    check_close(xg.mean({0, 2, 3}, true), x.mean({0, 2, 3}, true), tol, "channels-last mean over {0, 2, 3}");
  }
  for (const auto& [shape, dims] : problems) {
    for (DType dt : kAllTypes) {
      CAPTURE(shape_str(shape));
      CAPTURE(std::string(dtype_name(dt)));
      Tensor x = random(shape, dt), xg = x.cuda();
      check_close(xg.all(dims), x.all(dims), {0, 0}, "all");
      check_close(xg.any(dims), x.any(dims), {0, 0}, "any");
      if (dt != kBool) check_close(xg.sum(dims), x.sum(dims), {dt == kFloat16 || dt == kBFloat16 ? op_tolerance(dt).rtol : 1e-5, 1e-3}, "sum (int64 for integers)");
      if (dims.size() == 1 && x.size(dims[0]) > 0) {
        auto [v, i] = xg.max(dims[0]);
        auto [cv, ci] = x.max(dims[0]);
        check_close(v, cv, {0, 0}, "max values");
        check_close(i, ci, {0, 0}, "max indices (first occurrence)");
        auto [mv, mi] = xg.min(dims[0], true);
        auto [cmv, cmi] = x.min(dims[0], true);
        check_close(mv, cmv, {0, 0}, "min values");
        check_close(mi, cmi, {0, 0}, "min indices");
        check_close(xg.argmax(dims[0]), x.argmax(dims[0]), {0, 0}, "argmax");
        check_close(xg.argmin(dims[0]), x.argmin(dims[0]), {0, 0}, "argmin");
      }
      if (x.numel() > 0) {
        check_close(xg.max(), x.max(), {0, 0}, "max over all");
        check_close(xg.min(), x.min(), {0, 0}, "min over all");
      }
    }
  }
  // Ties go to the first index; a nan wins, its first occurrence.
  Tensor ties = tensor<float>({1, 5, 5, 2, 5, 0}, {2, 3});
  check_close(ties.cuda().argmax(1), ties.argmax(1), {0, 0}, "ties");
  Tensor nans = tensor<float>({1, NAN, 3, NAN, 2, 9}, {6});
  check_close(nans.cuda().max(), nans.max(), {0, 0}, "nan wins");
  check_close(nans.cuda().argmax(0), nans.argmax(0), {0, 0}, "first nan");
  // Var of a large-offset input: one-pass Welford stays accurate.
  Tensor offset = random({3, 5000}, kFloat32, 1000, 1001);
  check_close(offset.cuda().var({1}), offset.to(kFloat64).var({1}).to(kFloat32), {1e-3, 0}, "var with a large mean");
}

TEST_CASE("cuda: matmul, bmm and linear match the CPU, fp32 is full precision unless TF32 is allowed") {
  SKIP_WITHOUT_GPU();
  manual_seed(17);
  // Error against a float64 product of the same (rounded) inputs, relative in the Frobenius norm: float32
  // lands far under 1e-5; TF32 (10-bit mantissa products) near 3e-4; float16 about 5e-4; bfloat16 4e-3.
  auto check_product = [](DType dt, int64_t m, int64_t k, int64_t n, double max_error) {
    CAPTURE(std::string(dtype_name(dt)));
    CAPTURE(m);
    CAPTURE(k);
    CAPTURE(n);
    Tensor a = random({m, k}, dt), b = random({k, n}, dt);
    Tensor ref = matmul(a.to(kFloat64), b.to(kFloat64));
    Tensor got = matmul(a.cuda(), b.cuda());
    CHECK(got.is_cuda());
    CHECK(got.dtype() == dt);
    double err = relative_error(got, ref);
    CHECK_MESSAGE(err < max_error, "relative error " << err);
    return err;
  };
  cuda::set_allow_tf32(false);
  const std::vector<std::tuple<int64_t, int64_t, int64_t>> shapes = {{64, 64, 64}, {127, 33, 65}, {1, 300, 7}, {513, 257, 129}};
  for (auto [m, k, n] : shapes) {
    check_product(kFloat64, m, k, n, 1e-14);
    double fp32 = check_product(kFloat32, m, k, n, 1e-5);
    check_product(kFloat16, m, k, n, 2e-3);
    check_product(kBFloat16, m, k, n, 1.6e-2);
    cuda::set_allow_tf32(true);
    double tf32 = check_product(kFloat32, m, k, n, 5e-3);
    cuda::set_allow_tf32(false);
    MESSAGE("float32 error " << fp32 << ", with TF32 allowed " << tf32);
  }
  CHECK_FALSE(cuda::allow_tf32());

  // Transposed operands, batches (strided and broadcast), vectors, linear with bias, integers, k == 0.
  Tensor a = random({4, 30, 20}, kFloat32), b = random({4, 20, 10}, kFloat32);
  check_close(bmm(a.cuda(), b.cuda()), bmm(a, b), {1e-4, 1e-4}, "bmm");
  check_close(matmul(a.cuda(), b.cuda()[0]), matmul(a, b[0]), {1e-4, 1e-4}, "batched x shared");
  Tensor at = random({4, 20, 30}, kFloat32);
  check_close(matmul(at.cuda().transpose(1, 2), b.cuda()), matmul(at.transpose(1, 2), b), {1e-4, 1e-4}, "A^T");
  check_close(matmul(a.cuda(), b.cuda().transpose(0, 2).transpose(0, 2)), matmul(a, b), {1e-4, 1e-4}, "views");
  Tensor v = random({20}, kFloat32);
  check_close(matmul(a.cuda(), v.cuda()), matmul(a, v), {1e-4, 1e-4}, "matrix x vector");
  check_close(matmul(v.cuda(), v.cuda()), matmul(v, v), {1e-5, 1e-4}, "dot");
  Tensor x = random({3, 5, 20}, kFloat32), w = random({7, 20}, kFloat32), bias = random({7}, kFloat32);
  check_close(linear(x.cuda(), w.cuda(), bias.cuda()), linear(x, w, bias), {1e-4, 1e-4}, "linear with bias");
  check_close(linear(x.cuda().to(kFloat16), w.cuda().to(kFloat16), bias.cuda().to(kFloat16)),
              linear(x.to(kFloat16), w.to(kFloat16), bias.to(kFloat16)), {1e-2, 1e-2}, "float16 linear");
  for (DType dt : {kInt32, kInt64}) {
    Tensor ia = random({9, 13}, dt), ib = random({13, 6}, dt);
    check_close(matmul(ia.cuda(), ib.cuda()), matmul(ia, ib), {0, 0}, "integer matmul");
  }
  Tensor e1 = random({3, 0}, kFloat32), e2 = random({0, 4}, kFloat32);
  check_close(matmul(e1.cuda(), e2.cuda()), zeros({3, 4}), {0, 0}, "k == 0 gives zeros");
}

TEST_CASE("cuda: tensor-core products of odd sizes (run on zero-padded copies) match float64") {
  SKIP_WITHOUT_GPU();
  manual_seed(19);
  // The language model's decoder at 650 units, with fewer words: 650 and 5,003 are not multiples of 8 (16-bit) or 4
  // (float32), and each product is over 4 GFLOP, so each runs on copies padded to 656 and 5,008 or 652 and 5,004
  // (ops/matmul.cu, padded_problem); float32 with TF32 allowed, as the language model's training runs it.
  const bool tf32 = cuda::allow_tf32();
  cuda::set_allow_tf32(true);
  for (DType dt : {kFloat16, kBFloat16, kFloat32}) {
    CAPTURE(std::string(dtype_name(dt)));
    const double tolerance = dt == kBFloat16 ? 1.6e-2 : dt == kFloat16 ? 2e-3 : 5e-3;
    Tensor x = random({700, 650}, dt), w = random({5003, 650}, dt), bias = random({5003}, dt);
    Tensor g = random({700, 5003}, dt);
    auto f64 = [](const Tensor& t) { return t.to(kFloat64); };
    auto check = [&](const Tensor& got, const Tensor& ref, const char* what) {
      CHECK(got.is_cuda());
      CHECK(got.dtype() == dt);
      CHECK(got.shape() == ref.shape());
      const double err = relative_error(got, ref);
      CHECK_MESSAGE(err < tolerance, what << ": relative error " << err);
    };
    check(linear(x.cuda(), w.cuda(), bias.cuda()), linear(f64(x), f64(w), f64(bias)), "x W^T + b (beta = 1)");
    check(matmul(g.cuda(), w.cuda()), matmul(f64(g), f64(w)), "g W (k = 5,003)");
    check(g.cuda().t().matmul(x.cuda()), f64(g).t().matmul(f64(x)), "g^T x (m = 5,003 transposed)");
    // An operand one element off 16-byte alignment, with an odd leading dimension: copied though its sizes need none.
    Tensor wide = random({5003, 657}, dt);
    Tensor shifted = wide.cuda().narrow(1, 1, 656);
    Tensor y = random({704, 5003}, dt);
    check(matmul(y.cuda(), shifted), matmul(f64(y), f64(wide.narrow(1, 1, 656))), "a misaligned view");
    // Operands with a float32 result, accumulated onto C (beta = 1), as the recurrent kernels call it.
    Tensor c = random({700, 5003}, kFloat32);
    Tensor c_gpu = c.cuda();
    Tensor xg = x.cuda(), wg = w.cuda();
    gemm_dense(xg.device(), dt, kFloat32, 700, 5003, 650, xg.data_ptr(), Trans::No, wg.data_ptr(), Trans::Yes,
               c_gpu.data_ptr(), /*beta=*/1);
    const Tensor want = matmul(f64(x), f64(w).t()) + f64(c);
    const double err = relative_error(c_gpu, want);
    CHECK_MESSAGE(err < (dt == kFloat32 ? tolerance : 1e-4), "float32 C with beta = 1: relative error " << err);
  }
  cuda::set_allow_tf32(tf32);
}

TEST_CASE("cuda: a product with alpha and beta in device memory scales as alpha on the host does") {
  SKIP_WITHOUT_GPU();
  manual_seed(57);
  // Aligned (cuBLAS as it is) and 650 wide (the padded copies): both carry the device's alpha to cuBLAS.
  for (int64_t k : {648, 650}) {
    for (DType dt : {kFloat32, kFloat16, kFloat64}) {
      CAPTURE(k);
      CAPTURE(std::string(dtype_name(dt)));
      const DType acc = dt == kFloat64 ? kFloat64 : kFloat32;
      Tensor a = random({700, k}, dt).cuda(), b = random({3000, k}, dt).cuda();
      Tensor scalars = tensor(std::vector<double>{-0.375, 0.0}).to(acc).cuda();
      Tensor got = empty({700, 3000}, {.dtype = acc, .device = kGpu}).fill_(7);  // beta 0: what C held is dropped
      gemm_dense(a.device(), dt, acc, 700, 3000, k, a.data_ptr(), Trans::No, b.data_ptr(), Trans::Yes, got.data_ptr(),
                 0, nullptr, scalars.data_ptr());
      const Tensor want = matmul(a.to(kFloat64), b.to(kFloat64).t()) * -0.375;
      CHECK(relative_error(got, want) < (dt == kFloat64 ? 1e-12 : dt == kFloat32 ? 1e-5 : 2e-3));
    }
  }
  Tensor a = random({4, 8}, kFloat32).cuda(), c = empty({4, 4}, {.device = kGpu});
  Tensor scalars = tensor(std::vector<float>{2.0f, 0.0f}).cuda();
  CHECK_THROWS_WITH_AS(gemm_dense(a.device(), kFloat32, kFloat32, 4, 4, 8, a.data_ptr(), Trans::No, a.data_ptr(),
                                  Trans::Yes, c.data_ptr(), /*beta=*/1, nullptr, scalars.data_ptr()),
                       doctest::Contains("alpha 1 and beta 0 on the host (got float32 operands, alpha 1, beta 1)"),
                       Error);
}

TEST_CASE("cuda: operands on different devices are a clear error") {
  SKIP_WITHOUT_GPU();
  Tensor c = random({3}, kFloat32), g = random({3}, kFloat32).cuda();
  CHECK_THROWS_WITH_AS(c + g, doctest::Contains("different devices"), Error);
  CHECK_THROWS_WITH_AS(g * c, doctest::Contains("cuda:0"), Error);
  CHECK_THROWS_AS(where(g.gt(0), c, g), Error);
  CHECK_THROWS_AS(matmul(random({3, 3}, kFloat32), random({3, 3}, kFloat32).cuda()), Error);
  // A 0-d CPU tensor is a scalar, allowed with a tensor on any device (as in PyTorch).
  Tensor s = scalar_tensor(2.0);
  check_close(g * s, g.cpu() * s, op_tolerance(kFloat32), "0-d CPU scalar operand");
  // where takes one too, by value (relu's backward: where(y > 0, g, 0)).
  check_close(where(g.gt(0), g, s), where(g.cpu().gt(0), g.cpu(), s), {0, 0}, "where with a 0-d CPU scalar");
  check_close(where(g.gt(0), 0.0, g), where(g.cpu().gt(0), 0.0, g.cpu()), {0, 0}, "where with a Scalar");
  // Any of its operands, as PyTorch's: both values, or the condition, 0-d on the CPU beside the rest on the GPU.
  check_close(where(g.gt(0), s, 0.0), where(g.cpu().gt(0), s, 0.0), {0, 0}, "where with two 0-d CPU values");
  const Tensor yes = scalar_tensor(true, {.dtype = kBool});
  check_close(where(yes, g, -g), g.cpu(), {0, 0}, "where with a 0-d CPU condition");
  Tensor x = g.detach().requires_grad_();
  where(yes.logical_not(), x, x * 3).sum().backward();
  check_close(x.grad(), full({3}, 3.0f), {0, 0}, "where's backward with a 0-d CPU condition");
  CHECK_THROWS_WITH_AS(where(c.gt(0), g, s), doctest::Contains("where: operands are on different devices"), Error);
  Tensor mask = contiguous_channels_last(random({2, 3, 4, 5}, kFloat32).gt(0).cuda());
  CHECK(is_channels_last(where(mask, s, 0.0)));  // the mask's layout, as PyTorch's
  // A number that requires grad, used beside GPU tensors, gets its gradient on the CPU, as in PyTorch.
  Tensor number = scalar_tensor(2.0f).requires_grad_();
  (g * number).sum().backward();
  REQUIRE(number.grad().defined());
  CHECK(number.grad().is_cpu());
  CHECK(number.grad().item<float>() == doctest::Approx(g.sum().item<float>()));
  // copy_ between devices passes src's gradient back to src's device, both ways, as PyTorch's.
  Tensor w = tensor(std::vector<float>{1, 2, 3}).requires_grad_();
  Tensor on_gpu = empty({3}, {.device = kGpu});
  on_gpu.copy_(w);
  (on_gpu * 2).sum().backward();
  CHECK(w.grad().is_cpu());
  CHECK(to_vector<float>(w.grad()) == std::vector<float>{2, 2, 2});
  Tensor v = tensor(std::vector<float>{1, 2, 3}).cuda().requires_grad_();
  Tensor on_cpu = empty({3});
  on_cpu.copy_(v);
  on_cpu.sum().backward();
  CHECK(!v.grad().is_cpu());
  Tensor value = scalar_tensor(1.0f).requires_grad_();
  where(g.gt(0), value, 0.0).sum().backward();
  CHECK(value.grad().is_cpu());
  CHECK(value.grad().item<float>() == float(g.gt(0).sum().item<int64_t>()));
}

TEST_CASE("cuda: autograd through CUDA tensors matches the CPU gradients") {
  SKIP_WITHOUT_GPU();
  manual_seed(18);
  for (DType dt : {kFloat64, kFloat32}) {
    CAPTURE(std::string(dtype_name(dt)));
    Tensor x = random({6, 8}, dt), w = random({8, 5}, dt), b = random({5}, dt), t = random({6, 5}, dt);
    auto loss = [](const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& t) {
      Tensor h = tanh(matmul(x, w) + b);
      Tensor y = sigmoid(h) * exp(-x.sum({1}, true) / 10) + relu(h) - h.clamp(-0.5, 0.5);
      // pow with a scalar exponent (a 0-d CPU tensor beside CUDA operands, in its backward too) and a tensor one
      return ((y - t) * (y - t)).mean() + maximum(h, t).var() + x.abs().sum() * 1e-3 + (y - t).pow(2.0).mean() +
             pow(h.abs() + 0.5, t).mean();
    };
    auto grads = [&](Device device) {
      TensorList leaves;
      for (const Tensor& p : {x, w, b}) leaves.push_back(p.to(device).detach().requires_grad_());
      Tensor l = loss(leaves[0], leaves[1], leaves[2], t.to(device));
      CHECK(l.device() == device);
      l.backward();
      TensorList g;
      for (const Tensor& p : leaves) {
        CHECK(p.grad().device() == device);
        g.push_back(p.grad());
      }
      g.push_back(l);
      return g;
    };
    TensorList cpu = grads(Device::cpu()), gpu = grads(kGpu);
    Tolerance tol = dt == kFloat64 ? Tolerance{1e-10, 1e-12} : Tolerance{1e-4, 1e-5};
    const char* names[] = {"dx", "dw", "db", "loss"};
    for (size_t i = 0; i < cpu.size(); ++i) check_close(gpu[i], cpu[i], tol, names[i]);
  }
  // A gradient that crosses devices: to() records its backward as a copy back.
  Tensor p = random({4}, kFloat32).requires_grad_();
  (p.cuda() * 3).sum().backward();
  REQUIRE(p.grad().defined());
  CHECK(p.grad().is_cpu());
  CHECK(to_vector<float>(p.grad()) == std::vector<float>(4, 3.0f));
}

TEST_CASE("cuda: the caching allocator reuses freed blocks and keeps statistics") {
  SKIP_WITHOUT_GPU();
  cuda::synchronize();
  cuda::empty_cache();  // start from whole segments: no fragments left by earlier tests
  // A size class of each pool: 4000 bytes (small pool, rounded to 4096), 1 MiB + 1 (large pool).
  for (int64_t bytes : {int64_t(4000), int64_t((1 << 20) + 1), int64_t(64) << 20}) {
    CAPTURE(bytes);
    { Tensor warm = empty({bytes}, {.dtype = kUInt8, .device = kGpu}); }
    const cuda::MemoryStats before = cuda::memory_stats(0);
    const int64_t rounded = (bytes + 511) / 512 * 512;
    {
      Tensor t = empty({bytes}, {.dtype = kUInt8, .device = kGpu});
      cuda::MemoryStats during = cuda::memory_stats(0);
      CHECK(during.allocated_bytes == before.allocated_bytes + size_t(rounded));
      CHECK(during.requested_bytes == before.requested_bytes + size_t(bytes));
      CHECK(during.peak_allocated_bytes >= during.allocated_bytes);
      CHECK(during.num_allocations == before.num_allocations + 1);
    }
    const cuda::MemoryStats after = cuda::memory_stats(0);
    CHECK(after.num_cuda_mallocs == before.num_cuda_mallocs);  // the freed block was reused: no cudaMalloc
    CHECK(after.allocated_bytes == before.allocated_bytes);
    CHECK(after.reserved_bytes == before.reserved_bytes);
  }
  // A loop of the kind a training step runs: after the first iteration, no cudaMalloc at all.
  auto step = [] {
    Tensor x = randn({256, 256}).cuda();
    return (matmul(x, x).relu() + 1).sum().item<float>();
  };
  step();
  const uint64_t mallocs = cuda::memory_stats(0).num_cuda_mallocs;
  for (int i = 0; i < 5; ++i) step();
  CHECK(cuda::memory_stats(0).num_cuda_mallocs == mallocs);

  // Peak, reset_peak, and empty_cache returning what is cached.
  cuda::reset_peak(0);
  const size_t base = cuda::memory_stats(0).allocated_bytes;
  CHECK(cuda::memory_stats(0).peak_allocated_bytes == base);
  {
    Tensor big = empty({int64_t(256) << 20}, {.dtype = kUInt8, .device = kGpu});
    CHECK(cuda::memory_stats(0).peak_allocated_bytes == cuda::memory_stats(0).allocated_bytes);
  }
  const size_t peak = cuda::memory_stats(0).peak_allocated_bytes;  // stays after the free
  CHECK(peak >= base + (size_t(256) << 20));
  CHECK(peak <= base + (size_t(258) << 20));
  cuda::reset_peak(0);
  CHECK(cuda::memory_stats(0).peak_allocated_bytes == base);
  const cuda::MemoryStats cached = cuda::memory_stats(0);
  CHECK(cached.reserved_bytes >= cached.allocated_bytes + (size_t(256) << 20));
  cuda::empty_cache();
  const cuda::MemoryStats emptied = cuda::memory_stats(0);
  CHECK(emptied.reserved_bytes + (size_t(256) << 20) <= cached.reserved_bytes);
  CHECK(emptied.num_cuda_frees > cached.num_cuda_frees);
  CHECK(emptied.allocated_bytes == cached.allocated_bytes);
  MESSAGE("allocator after empty_cache: " << cuda::memory_stats_str(0));
}

TEST_CASE("cuda: with caching off every tensor is its own cudaMalloc of its exact size, freed at once") {
  SKIP_WITHOUT_GPU();
  if (!cuda::caching()) return;  // HALFGRAD_CUDA_NO_CACHING is set for the whole run: the rest assumes it is not
  cuda::synchronize();
  struct CachingBack {  // on again however the case ends
    ~CachingBack() { cuda::set_caching(true); }
  } caching_back;
  {
    cuda::empty_cache();  // no free block left that could hold the next one: it gets a segment of its own
    Tensor cached = empty({int64_t(64) << 20}, {.dtype = kUInt8, .device = kGpu});
    cuda::set_caching(false);
    const size_t reserved = cuda::memory_stats(0).reserved_bytes;
    cached = Tensor();  // made while caching was on, its segment goes back to the driver with it now
    CHECK(cuda::memory_stats(0).reserved_bytes < reserved);
  }
  const cuda::MemoryStats before = cuda::memory_stats(0);
  {
    Tensor t = empty({4001}, {.dtype = kUInt8, .device = kGpu});  // not rounded to 512
    const cuda::MemoryStats during = cuda::memory_stats(0);
    CHECK(during.num_cuda_mallocs == before.num_cuda_mallocs + 1);
    CHECK(during.reserved_bytes == before.reserved_bytes + 4001);
    CHECK(during.allocated_bytes == before.allocated_bytes + 4001);
    Tensor host = arange(4001, {.dtype = kFloat32});
    CHECK((host.cuda().cpu() - host).abs().max().item<float>() == 0);  // an odd size round-trips uncached
  }
  const cuda::MemoryStats after = cuda::memory_stats(0);
  CHECK(after.num_cuda_frees >= before.num_cuda_frees + 1);
  CHECK(after.reserved_bytes == before.reserved_bytes);
  CHECK_THROWS_WITH(cuda::Graph().capture(kGpu, [] {}), doctest::Contains("caching is off"));
  cuda::set_caching(true);
  { Tensor t = empty({4001}, {.dtype = kUInt8, .device = kGpu}); }
  CHECK(cuda::memory_stats(0).reserved_bytes > cuda::memory_stats(0).allocated_bytes);  // cached again
}

TEST_CASE("cuda: running out of memory throws a catchable OutOfMemory that names the size") {
  SKIP_WITHOUT_GPU();
  const int64_t petabyte = int64_t(1) << 50;
  const uint64_t retries = cuda::memory_stats(0).num_oom_retries;
  try {
    Tensor t = empty({petabyte}, {.dtype = kUInt8, .device = kGpu});
    FAIL("allocating 1 PiB did not throw");
  } catch (const OutOfMemory& e) {
    std::string msg = e.what();
    MESSAGE(msg);
    CHECK(msg.find("1125899906842624") != std::string::npos);
    CHECK(msg.find("1.00 PiB") != std::string::npos);
    CHECK(msg.find("cudaMalloc calls") != std::string::npos);
    CHECK(msg.find("cuda:0") != std::string::npos);
  }
  CHECK(cuda::memory_stats(0).num_oom_retries == retries + 1);  // the cache was released and the call retried
  CHECK_THROWS_AS(empty({petabyte}, {.dtype = kUInt8, .device = kGpu}), Error);  // OutOfMemory is an Error
  // The allocator still works afterwards.
  Tensor ok = full({1000}, 2.0, {.device = kGpu});
  CHECK(ok.sum().item<double>() == 2000.0);
}

TEST_CASE("cuda: work runs on the current stream, synchronize waits for it") {
  SKIP_WITHOUT_GPU();
#if HALFGRAD_WITH_CUDA
  CHECK(cuda::current_stream(0) == nullptr);  // the default stream until one is set
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  Tensor x = random({1000, 100}, kFloat32);
  Tensor result;
  {
    cuda::StreamGuard guard(0, stream);
    CHECK(cuda::current_stream(0) == stream);
    Tensor g = x.cuda();
    result = (g * 2).sum({1});  // upload, kernels and the result's allocation all on `stream`
    cuda::synchronize_stream(0);
    check_close(result, (x * 2).sum({1}), {1e-5, 1e-5}, "on a stream");  // sums of 100 terms of either sign
    result = Tensor();  // free while `stream` is current: the block returns to that stream's pool
  }
  CHECK(cuda::current_stream(0) == nullptr);
  cuda::synchronize();
  REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
#endif
}

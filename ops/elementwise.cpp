// Elementwise ops: forward, backward and CPU kernels. The arithmetic is in ops/elementwise_math.h.
#include "ops/elementwise.h"

#include <functional>
#include <initializer_list>
#include <numbers>
#include <string>
#include <vector>

#include "core/autocast.h"
#include "core/autograd.h"
#include "ops/copy.h"
#include "ops/inplace.h"
#include "ops/loops.h"
#include "ops/shape.h"

namespace halfgrad {

KernelTable<UnaryKernel> unary_kernel("unary");
KernelTable<BinaryKernel> binary_kernel("binary");
KernelTable<WhereKernel> where_kernel("where");
KernelTable<FillKernel> fill_kernel("fill");

namespace {

// Before anything reads an operand's dtype, whose own error would name no op.
void check_defined(const char* op, std::initializer_list<std::reference_wrapper<const Tensor>> operands) {
  for (const Tensor& t : operands) {
    if (t.defined()) continue;
    std::vector<std::string> metas;
    for (const Tensor& each : operands) metas.push_back(each.meta());
    HG_FAIL("{}: an operand is undefined ({}): a default-constructed Tensor holds no data", op, fmt::join(metas, ", "));
  }
}

void check_same_device(const char* op, const Tensor& a, const Tensor& b) {
  HG_CHECK(a.device() == b.device(), "{}: operands are on different devices: {} and {}", op, a.meta(), b.meta());
}

// ---- forward computations (no autograd)

Tensor unary_forward(UnaryOp op, const Tensor& x) {
  const char* name = op_name(op);
  HG_CHECK(!floating_only(op) || x.is_floating_point(),
           "{}: expected a floating-point input, got {} (convert it with .to(kFloat32))", name, x.meta());
  HG_CHECK(x.dtype() != kBool || takes_bool(op), "{}: not supported for bool tensors ({})", name, x.meta());
  DType compute = needs_floating(op) && !x.is_floating_point() ? kDefaultFloat : x.dtype();
  Tensor in = cast_nograd(x, compute);
  Tensor out = empty(x.shape(), {.dtype = is_predicate(op) ? kBool : compute, .device = x.device()},
                     suggest_memory_format(x));  // an NHWC activation stays NHWC
  unary_kernel[x.device()](op, out, in);
  return out;
}

// A 0-d CPU operand is a number to the kernels (binary_kernel's contract): a device kernel takes it by value. Beside a
// float16 or bfloat16 tensor, arithmetic reads it in float32, the op's compute type, as PyTorch's CUDA kernels do
// (their TensorIterator leaves a CPU scalar uncast and they fetch it as float: PyTorch 2.11 on an H100 gives
// float16(1000) * 1e-8 = 1.0014e-05, where 1e-8 rounded to float16 first would give 0); its comparisons and pow read it
// in the tensor's dtype (scalar_value<scalar_t>), and so does halfgrad. PyTorch's CPU kernels round it for + and -
// (measured): halfgrad's CPU follows the CUDA rule, so that the two devices agree. The dtype it is passed in, and
// whether the kernel takes it unbroadcast.
bool reads_number_in_float32(BinaryOp op) {
  return op == BinaryOp::Add || op == BinaryOp::Sub || op == BinaryOp::Mul || op == BinaryOp::Div;
}
DType scalar_dtype(BinaryOp op, DType compute) {
  return is_half(compute) && reads_number_in_float32(op) ? kFloat32 : compute;
}
bool kernel_takes_scalar(BinaryOp op, Device device, DType compute) {
  return !device.is_cpu() || scalar_dtype(op, compute) != compute;
}

// Binary op on two tensors; either may be a 0-d CPU "scalar". Where both are, the number is the one not of the compute
// dtype (number_operand's float32 beside a 0-d float16 tensor), else b.
Tensor binary_forward(BinaryOp op, const Tensor& a, const Tensor& b, DType compute) {
  const char* name = op_name(op);
  Shape shape = broadcast_shapes(a.shape(), b.shape(), name);
  const bool a_0d = a.dim() == 0 && a.is_cpu(), b_0d = b.dim() == 0 && b.is_cpu();
  const bool b_scalar = b_0d && (!a_0d || a.dtype() == compute), a_scalar = a_0d && !b_scalar;
  Device device = a_scalar ? b.device() : a.device();
  if (!a_scalar && !b_scalar) check_same_device(name, a, b);
  // The output takes the layout of the operand that has the output's shape (a, else b).
  const Tensor& layout = a.shape() == shape ? a : b;
  Tensor out = empty(shape, {.dtype = is_predicate(op) ? kBool : compute, .device = device},
                     layout.shape() == shape ? suggest_memory_format(layout) : MemoryFormat::Contiguous);
  auto operand = [&](const Tensor& t, bool scalar) {
    if (scalar && kernel_takes_scalar(op, device, compute)) return cast_nograd(t, scalar_dtype(op, compute));
    return broadcast_view(cast_nograd(t, compute), shape, name);
  };
  binary_kernel[device](op, out, operand(a, a_scalar), operand(b, b_scalar));
  return out;
}

// The dtype an op computes in: division of integers is true division, in the default float dtype.
DType binary_compute_dtype(BinaryOp op, DType common) {
  return needs_floating(op) && !is_floating(common) ? kDefaultFloat : common;
}

void check_not_bool_arithmetic(BinaryOp op, DType common) {
  HG_CHECK(common != kBool || takes_bool(op), "{}: not supported for bool tensors; convert with to() first",
           op_name(op));
}

// The dtype of an op on tensors a and b (promote_types with their 0-d flags: PyTorch's result_type).
DType result_type(const Tensor& a, const Tensor& b) {
  return promote_types(a.dtype(), a.dim() == 0, b.dtype(), b.dim() == 0);
}

// A number as a 0-d CPU tensor of `dtype`. A number the dtype cannot hold becomes what the cast gives (1e6 in float16:
// inf; PyTorch's wrapped numbers alike): fill_'s overflow check is for values written into tensors.
Tensor scalar_operand(const Scalar& s, DType dtype) {
  Tensor t = empty({}, {.dtype = dtype});
  fill_kernel[t.device()](t, s);
  return t;
}
// A number beside a tensor in `op` computed in `compute`, in scalar_dtype: float32 for float16 arithmetic, so that
// nothing rounds it to float16 before the op reads it.
Tensor number_operand(BinaryOp op, const Scalar& s, DType compute) {
  return scalar_operand(s, scalar_dtype(op, compute));
}

// ---- backward formulas, next to each other so the calculus can be read at once

// The activations' derivatives in ops that record, for a pass with create_graph (one kernel each otherwise): the
// formulas of binary_math's GeluBackward, GeluTanhBackward and SiluBackward (ops/elementwise_math.h).
Tensor activation_derivative(UnaryOp op, const Tensor& x) {
  using namespace gelu_constants;
  switch (op) {
    case UnaryOp::Gelu: return (1 + erf(x * kSqrtHalf)) * 0.5 + x * exp(x * x * -0.5) * kInvSqrt2Pi;
    case UnaryOp::GeluTanh: {
      const Tensor t = tanh((x + x * x * x * kCubic) * kSqrt2OverPi);
      const Tensor du = (1 + x * x * (3 * kCubic)) * kSqrt2OverPi;
      return (1 + t) * 0.5 + x * 0.5 * (1 - t * t) * du;
    }
    case UnaryOp::Silu: {
      const Tensor s = sigmoid(x);
      return s * (1 + x * (1 - s));
    }
    default: HG_FAIL("{}: no activation derivative", op_name(op));
  }
}

Tensor unary_backward(UnaryOp op, const Tensor& g, const Tensor& x, const Tensor& y) {
  switch (op) {
    case UnaryOp::Neg: return -g;
    case UnaryOp::Abs: return g * sign(x);
    case UnaryOp::Exp: return g * y;                          // d exp(x) = exp(x)
    case UnaryOp::Log: return g / x;                          // d log(x) = 1/x
    case UnaryOp::Sqrt: return g / (y * 2);                   // d sqrt(x) = 1/(2 sqrt(x))
    case UnaryOp::Rsqrt: return g * y * y * y * -0.5;         // d x^-1/2 = -1/2 x^-3/2
    case UnaryOp::Tanh: return g * (1 - y * y);               // d tanh = 1 - tanh^2
    case UnaryOp::Sigmoid: return g * y * (1 - y);            // d s = s (1 - s)
    case UnaryOp::Relu: return where(y.gt(0), g, 0);         // relu_backward_math (ops/elementwise_math.h)
    case UnaryOp::Sign: return zeros_like(g);
    case UnaryOp::Erf: return g * exp(-x * x) * (2 * std::numbers::inv_sqrtpi);  // d erf = 2/sqrt(pi) e^(-x^2)
    // The activations' derivatives, one kernel each (their formulas: binary_math, ops/elementwise_math.h), or in ops
    // that record in a pass with create_graph.
    case UnaryOp::Gelu:
    case UnaryOp::GeluTanh:
    case UnaryOp::Silu: {
      if (GradMode::is_enabled()) {  // in the kernel's compute dtype, rounded once, as the kernel
        const DType acc = accumulation_dtype(x.dtype());
        return (g.to(acc) * activation_derivative(op, x.to(acc))).to(result_type(g, x));
      }
      const BinaryOp derivative = op == UnaryOp::Gelu       ? BinaryOp::GeluBackward
                                  : op == UnaryOp::GeluTanh ? BinaryOp::GeluTanhBackward
                                                            : BinaryOp::SiluBackward;
      return binary_forward(derivative, g, x, result_type(g, x));
    }
    default: HG_FAIL("{}: not differentiable", op_name(op));
  }
}

// Which of x and y a unary op's backward reads (saving only what is needed keeps memory down).
bool backward_uses_input(UnaryOp op) {
  return op == UnaryOp::Abs || op == UnaryOp::Log || op == UnaryOp::Sign || op == UnaryOp::Erf ||
         op == UnaryOp::Gelu || op == UnaryOp::GeluTanh || op == UnaryOp::Silu;
}
bool backward_uses_output(UnaryOp op) {
  return op == UnaryOp::Exp || op == UnaryOp::Sqrt || op == UnaryOp::Rsqrt || op == UnaryOp::Tanh ||
         op == UnaryOp::Sigmoid || op == UnaryOp::Relu;
}

Tensor unary(UnaryOp op, const Tensor& x) {
  check_defined(op_name(op), {x});
  Tensor y = unary_forward(op, x);
  if (any_requires_grad({&x}) && y.is_floating_point()) {
    const char* name = op_name(op);
    SavedTensor sx(backward_uses_input(op) ? x : Tensor(), name);
    SavedTensor sy = SavedTensor::output(backward_uses_output(op) ? y : Tensor(), name);
    record(backward_name(name), {x}, {y}, [op, sx, sy](const GradContext& g) -> TensorList {
      return {unary_backward(op, g[0], sx.get(), sy.get())};
    }, DoubleBackward::Supported);
  }
  return y;
}

// The op in the dtype `common` (a number's promotion is decided before it becomes a 0-d tensor).
Tensor binary_as(BinaryOp op, const Tensor& a, const Tensor& b, DType common) {
  check_not_bool_arithmetic(op, common);
  Tensor out = binary_forward(op, a, b, binary_compute_dtype(op, common));
  if (is_predicate(op) || !any_requires_grad({&a, &b})) return out;

  const char* name = op_name(op);
  Shape sa = a.shape(), sb = b.shape();
  switch (op) {
    case BinaryOp::Add:
      record(backward_name(name), {a, b}, {out}, [sa, sb](const GradContext& g) -> TensorList {
        return {g.needs(0) ? sum_to(g[0], sa) : Tensor(), g.needs(1) ? sum_to(g[0], sb) : Tensor()};
      }, DoubleBackward::Supported);
      break;
    case BinaryOp::Sub:
      record(backward_name(name), {a, b}, {out}, [sa, sb](const GradContext& g) -> TensorList {
        return {g.needs(0) ? sum_to(g[0], sa) : Tensor(), g.needs(1) ? sum_to(-g[0], sb) : Tensor()};
      }, DoubleBackward::Supported);
      break;
    case BinaryOp::Mul: {
      SavedTensor A(b.requires_grad() ? a : Tensor(), name), B(a.requires_grad() ? b : Tensor(), name);
      record(backward_name(name), {a, b}, {out}, [A, B, sa, sb](const GradContext& g) -> TensorList {
        return {g.needs(0) ? sum_to(g[0] * B.get(), sa) : Tensor(), g.needs(1) ? sum_to(g[0] * A.get(), sb) : Tensor()};
      }, DoubleBackward::Supported);
      break;
    }
    case BinaryOp::Div: {
      SavedTensor B(b, name), OUT = SavedTensor::output(b.requires_grad() ? out : Tensor(), name);
      record(backward_name(name), {a, b}, {out}, [B, OUT, sa, sb](const GradContext& g) -> TensorList {
        Tensor ga = g[0] / B.get();  // d(a/b)/da = 1/b ; d(a/b)/db = -a/b^2 = -(a/b)/b
        return {g.needs(0) ? sum_to(ga, sa) : Tensor(), g.needs(1) ? sum_to(-ga * OUT.get(), sb) : Tensor()};
      }, DoubleBackward::Supported);
      break;
    }
    case BinaryOp::Pow: {
      SavedTensor A(a, name), B(b, name), OUT = SavedTensor::output(b.requires_grad() ? out : Tensor(), name);
      record(backward_name(name), {a, b}, {out}, [A, B, OUT, sa, sb](const GradContext& g) -> TensorList {
        // d a^b/da = b a^(b-1), 0 where b == 0 (a^0 is 1 everywhere, and 0 * 0^-1 would be nan); d a^b/db =
        // a^b log(a), 0 where a == 0 and b >= 0 (0 * -inf). As PyTorch's pow_backward, the factor is masked, not g:
        // an inf or nan gradient still passes (the loss scaler's overflow check counts on it). A scalar exponent is
        // a 0-d CPU tensor, its mask decided on the host: no kernel where it masks nothing.
        auto zero_where = [](const Tensor& mask, const Tensor& factor) {
          if (mask.dim() == 0 && mask.is_cpu()) return mask.item<bool>() ? zeros_like(factor) : factor;
          return where(mask, 0, factor);
        };
        const Tensor& a = A.get();
        const Tensor& b = B.get();
        Tensor ga, gb;
        if (g.needs(0)) ga = sum_to(g[0] * zero_where(b.eq(0), b * pow(a, b - 1)), sa);
        if (g.needs(1)) gb = sum_to(g[0] * where(logical_and(a.eq(0), b.ge(0)), 0, OUT.get() * log(a)), sb);
        return {ga, gb};
      }, DoubleBackward::Supported);
      break;
    }
    case BinaryOp::Maximum:
    case BinaryOp::Minimum: {
      SavedTensor A(a, name), B(b, name);
      bool is_max = op == BinaryOp::Maximum;
      record(backward_name(name), {a, b}, {out}, [A, B, sa, sb, is_max](const GradContext& g) -> TensorList {
        // PyTorch's rule: a side strictly beaten gets nothing, a tie splits the gradient evenly, and otherwise a side
        // gets it whole. A nan (no order either way) gives it to both.
        const Tensor &a = A.get(), &b = B.get();
        const DType dt = g[0].dtype();
        const Tensor whole_or_half = 1 - eq(a, b).to(dt) * 0.5;
        auto share = [&](const Tensor& beaten) { return whole_or_half * (1 - beaten.to(dt)); };
        return {g.needs(0) ? sum_to(g[0] * share(is_max ? lt(a, b) : gt(a, b)), sa) : Tensor(),
                g.needs(1) ? sum_to(g[0] * share(is_max ? gt(a, b) : lt(a, b)), sb) : Tensor()};
      }, DoubleBackward::Supported);
      break;
    }
    default: HG_FAIL("{}: not differentiable", name);
  }
  return out;
}

Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b) {
  check_defined(op_name(op), {a, b});
  return binary_as(op, a, b, result_type(a, b));
}

Tensor binary(BinaryOp op, const Tensor& a, const Scalar& b) {
  check_defined(op_name(op), {a});
  DType common = promote_with_scalar(a.dtype(), b);
  return binary_as(op, a, number_operand(op, b, common), common);
}

Tensor binary(BinaryOp op, const Scalar& a, const Tensor& b) {
  check_defined(op_name(op), {b});
  DType common = promote_with_scalar(b.dtype(), a);
  return binary_as(op, number_operand(op, a, common), b, common);
}

// self = self op other, written straight into self by the kernel when nothing records the op, the result has self's
// dtype (the common case: optimizer and loss-scaler updates) and other does not share memory with self but as self
// itself (the kernel would read values it has already written). Otherwise `apply_in_place`, which reads every operand
// before it writes.
template <typename Compute>
Tensor& binary_inplace(Tensor& self, BinaryOp op, const char* name, const Tensor& other, Compute compute) {
  check_defined(name, {self, other});
  bool graph = GradMode::is_enabled() && (self.requires_grad() || other.requires_grad());
  DType common = binary_compute_dtype(op, result_type(self, other));
  bool device_ok = other.device() == self.device() || (other.dim() == 0 && other.is_cpu());
  if (graph || common != self.dtype() || !device_ok ||
      broadcast_shapes(self.shape(), other.shape(), name) != self.shape() || overlaps_partially(self, other)) {
    return apply_in_place(self, name, {other}, compute);
  }
  check_inplace(self, name, /*records=*/false);
  // A 0-d CPU other is a number, passed as binary_forward passes one; otherwise the kernel takes operands of self's
  // dtype, a narrower other (float16 into float32) widened.
  if (other.dim() == 0 && other.is_cpu() && kernel_takes_scalar(op, self.device(), self.dtype())) {
    binary_kernel[self.device()](op, self, self, cast_nograd(other, scalar_dtype(op, self.dtype())));
    return self;
  }
  binary_kernel[self.device()](op, self, self, broadcast_view(cast_nograd(other, self.dtype()), self.shape(), name));
  return self;
}

}  // namespace

// ---- public ops

namespace {
// PyTorch's rules for alpha, checked before a - alpha b is rewritten into two ops that would each let it pass: an
// integral result takes an integral alpha, a bool alpha is for bool tensors, and bool tensors are never subtracted
// (an alpha would otherwise make sub(bool, bool) an int64 one).
void check_alpha(const char* name, BinaryOp op, const Tensor& a, const Tensor& b, const Scalar& alpha) {
  check_defined(name, {a, b});
  const DType common = result_type(a, b);
  check_not_bool_arithmetic(op, common);
  HG_CHECK(is_floating(common) || !alpha.is_floating(), "{}: alpha {:#} is a floating-point number, but {} and {} are "
           "integral, and so is their result: pass an integral alpha", name, alpha.to_double(), a.meta(),
           b.meta());
  HG_CHECK(common == kBool || !alpha.is_bool(), "{}: a bool alpha is for bool tensors only, got {} and {}", name,
           a.meta(), b.meta());
}
}  // namespace

namespace {
// a + alpha b or a - alpha b (alpha != 1) in the result dtype's opmath, as PyTorch's kernels compute it: alpha b in
// float32 for float16 and bfloat16 results (the result dtype otherwise), never in b's own dtype (uint8 200 * 2 wrapped
// to 144; float16 100 * 1000 overflowed), and a float16 result rounded from float32 once. (PyTorch's kernels fuse the
// multiply and the add, which here round apart in float32: at most a last-bit difference.)
Tensor with_alpha(BinaryOp op, const Tensor& a, const Tensor& b, const Scalar& alpha) {
  const DType common = result_type(a, b);
  const DType math = common == kFloat16 || common == kBFloat16 ? kFloat32 : common;
  return binary(op, a.to(math), binary(BinaryOp::Mul, b.to(math), alpha)).to(common);
}
}  // namespace

Tensor add(const Tensor& a, const Tensor& b, const Scalar& alpha) {
  check_alpha("add", BinaryOp::Add, a, b, alpha);
  HG_AUTOCAST(add, a, b, alpha);
  if (alpha.to_double() == 1) return binary(BinaryOp::Add, a, b);
  // Bool tensors add in bool, as PyTorch's: alpha counts as its truth value (an int alpha times a bool would
  // otherwise make the sum int64).
  if (result_type(a, b) == kBool) return binary(BinaryOp::Add, a, binary(BinaryOp::Mul, b, alpha.to_double() != 0));
  return with_alpha(BinaryOp::Add, a, b, alpha);
}
Tensor sub(const Tensor& a, const Tensor& b, const Scalar& alpha) {
  check_alpha("sub", BinaryOp::Sub, a, b, alpha);
  HG_AUTOCAST(sub, a, b, alpha);
  return alpha.to_double() == 1 ? binary(BinaryOp::Sub, a, b) : with_alpha(BinaryOp::Sub, a, b, alpha);
}
Tensor mul(const Tensor& a, const Tensor& b) {
  HG_AUTOCAST(mul, a, b);
  return binary(BinaryOp::Mul, a, b);
}
Tensor div(const Tensor& a, const Tensor& b) {
  HG_AUTOCAST(div, a, b);
  return binary(BinaryOp::Div, a, b);
}
namespace {
// f(g), for a float16 or bfloat16 g in float32 and rounded back once.
template <typename F> Tensor in_float32(const Tensor& g, F f) {
  return is_half(g.dtype()) ? f(g.to(kFloat32)).to(g.dtype()) : f(g);
}
}  // namespace
Tensor divided_by_count(const Tensor& g, int64_t count) {
  return in_float32(g, [&](const Tensor& t) { return t.div(double(count)); });
}
Tensor scaled_once(const Tensor& g, double factor) {
  return in_float32(g, [&](const Tensor& t) { return t.mul(factor); });
}
Tensor pow(const Tensor& base, const Tensor& exponent) {
  HG_AUTOCAST(pow, base, exponent);
  return binary(BinaryOp::Pow, base, exponent);
}
Tensor pow(const Tensor& base, const Scalar& exponent) {
  HG_AUTOCAST(pow, base, exponent);
  check_defined("pow", {base});
  HG_CHECK(!is_integral(base.dtype(), /*include_bool=*/true) || exponent.is_floating() || exponent.to_int() >= 0,
           "pow: integers to negative integer powers are not allowed ({} to the power {})", base.meta(),
           exponent.str());
  // As PyTorch, x^0.5 is sqrt(x) and x^-0.5 rsqrt(x), which differ from std::pow at -inf (nan, where pow gives inf
  // and 0) and at -0 (-0 and -inf, where pow gives 0 and inf).
  if (base.is_floating_point() && exponent.is_floating()) {
    if (exponent.to_double() == 0.5) return sqrt(base);
    if (exponent.to_double() == -0.5) return rsqrt(base);
  }
  return binary(BinaryOp::Pow, base, exponent);
}
Tensor pow(const Scalar& base, const Tensor& exponent) {
  HG_AUTOCAST(pow, base, exponent);
  return binary(BinaryOp::Pow, base, exponent);
}
Tensor maximum(const Tensor& a, const Tensor& b) {
  HG_AUTOCAST(maximum, a, b);
  return binary(BinaryOp::Maximum, a, b);
}
Tensor minimum(const Tensor& a, const Tensor& b) {
  HG_AUTOCAST(minimum, a, b);
  return binary(BinaryOp::Minimum, a, b);
}
Tensor eq(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Eq, a, b); }
Tensor ne(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Ne, a, b); }
Tensor lt(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Lt, a, b); }
Tensor le(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Le, a, b); }
Tensor gt(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Gt, a, b); }
Tensor ge(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Ge, a, b); }
Tensor logical_and(const Tensor& a, const Tensor& b) { return binary(BinaryOp::LogicalAnd, a, b); }
Tensor logical_or(const Tensor& a, const Tensor& b) { return binary(BinaryOp::LogicalOr, a, b); }

Tensor neg(const Tensor& x) {
  HG_AUTOCAST(neg, x);
  return unary(UnaryOp::Neg, x);
}
Tensor abs(const Tensor& x) {
  HG_AUTOCAST(abs, x);
  return unary(UnaryOp::Abs, x);
}
Tensor exp(const Tensor& x) {
  HG_AUTOCAST(exp, x);
  return unary(UnaryOp::Exp, x);
}
Tensor log(const Tensor& x) {
  HG_AUTOCAST(log, x);
  return unary(UnaryOp::Log, x);
}
Tensor sqrt(const Tensor& x) {
  HG_AUTOCAST(sqrt, x);
  return unary(UnaryOp::Sqrt, x);
}
Tensor rsqrt(const Tensor& x) {
  HG_AUTOCAST(rsqrt, x);
  return unary(UnaryOp::Rsqrt, x);
}
Tensor tanh(const Tensor& x) {
  HG_AUTOCAST(tanh, x);
  return unary(UnaryOp::Tanh, x);
}
Tensor sigmoid(const Tensor& x) {
  HG_AUTOCAST(sigmoid, x);
  return unary(UnaryOp::Sigmoid, x);
}
Tensor relu(const Tensor& x) {
  HG_AUTOCAST(relu, x);
  return unary(UnaryOp::Relu, x);
}
Tensor erf(const Tensor& x) {
  HG_AUTOCAST(erf, x);
  return unary(UnaryOp::Erf, x);
}
void check_gelu_approximate(const char* op, std::string_view approximate) {
  HG_CHECK(approximate == "none" || approximate == "tanh",
           "{}: approximate must be \"none\" or \"tanh\", got \"{}\"", op, approximate);
}
Tensor gelu(const Tensor& x, std::string_view approximate) {
  check_gelu_approximate("gelu", approximate);
  HG_AUTOCAST(gelu, x, approximate);
  return unary(approximate == "tanh" ? UnaryOp::GeluTanh : UnaryOp::Gelu, x);
}
Tensor silu(const Tensor& x) {
  HG_AUTOCAST(silu, x);
  return unary(UnaryOp::Silu, x);
}
Tensor sign(const Tensor& x) { return unary(UnaryOp::Sign, x); }
Tensor logical_not(const Tensor& x) { return unary(UnaryOp::LogicalNot, x); }
Tensor isfinite(const Tensor& x) { return unary(UnaryOp::IsFinite, x); }

Tensor clamp(const Tensor& x, std::optional<Scalar> min, std::optional<Scalar> max) {
  check_defined("clamp", {x});
  HG_AUTOCAST(clamp, x, min, max);
  HG_CHECK(min || max, "clamp: at least one of min and max must be given ({})", x.meta());
  Tensor y;
  {
    NoGradGuard no_grad;
    y = x;
    if (min) y = binary(BinaryOp::Maximum, y, *min);
    if (max) y = binary(BinaryOp::Minimum, y, *max);
  }
  if (any_requires_grad({&x})) {
    SavedTensor sx(x, "clamp");
    record("ClampBackward", {x}, {y}, [sx, min, max](const GradContext& g) -> TensorList {
      // The gradient passes where x is inside [min, max] (boundaries included, as PyTorch).
      Tensor inside = ones_like(sx.get()).to(kBool);
      if (min) inside = logical_and(inside, sx.get().ge(*min));
      if (max) inside = logical_and(inside, sx.get().le(*max));
      return {where(inside, g[0], 0)};
    }, DoubleBackward::Supported);
  }
  return y;
}

namespace {

// where's work, under the name of the public op that asked for it (where or masked_fill): its errors and its node.
Tensor select_where(const char* op, const char* node, const Tensor& condition, const Tensor& a, const Tensor& b) {
  // Any operand may be a 0-d CPU "scalar" with the others on a device, as in binary ops and PyTorch's where: the
  // kernel takes it by value (relu's backward, where(y > 0, g, 0), then runs on the flat kernel instead of reading a
  // broadcast operand). The others share one device.
  auto is_scalar = [](const Tensor& t) { return t.dim() == 0 && t.is_cpu(); };
  const Tensor* on_device = nullptr;
  for (const Tensor* t : {&condition, &a, &b}) {
    if (is_scalar(*t)) continue;
    if (on_device) check_same_device(op, *on_device, *t);
    else on_device = t;
  }
  const Device device = on_device ? on_device->device() : Device::cpu();
  DType common = result_type(a, b);
  Shape shape = broadcast_shapes(broadcast_shapes(condition.shape(), a.shape(), op), b.shape(), op);
  // The output takes the layout of the first operand that has the output's shape (a, b, else the condition: two
  // 0-d values beside a channels_last mask give a channels_last result, as PyTorch's).
  const Tensor& layout = a.shape() == shape ? a : b.shape() == shape ? b : condition;
  Tensor out = empty(shape, {.dtype = common, .device = device},
                     layout.shape() == shape ? suggest_memory_format(layout) : MemoryFormat::Contiguous);
  auto operand = [&](const Tensor& t) {
    return is_scalar(t) && !device.is_cpu() ? t : broadcast_view(t, shape, op);
  };
  where_kernel[device](out, operand(condition), operand(cast_nograd(a, common)), operand(cast_nograd(b, common)));
  if (any_requires_grad({&a, &b})) {
    SavedTensor c(condition, node);
    Shape sa = a.shape(), sb = b.shape();
    record(node, {a, b}, {out}, [c, sa, sb](const GradContext& g) -> TensorList {
      return {g.needs(0) ? sum_to(where(c.get(), g[0], 0), sa) : Tensor(),
              g.needs(1) ? sum_to(where(c.get(), 0, g[0]), sb) : Tensor()};
    }, DoubleBackward::Supported);
  }
  return out;
}

}  // namespace

Tensor where(const Tensor& condition, const Tensor& a, const Tensor& b) {
  check_defined("where", {condition, a, b});
  HG_AUTOCAST(where, condition, a, b);
  HG_CHECK(condition.dtype() == kBool, "where: condition must be bool, got {}", condition.meta());
  return select_where("where", "WhereBackward", condition, a, b);
}

Tensor where(const Tensor& condition, const Tensor& a, const Scalar& b) {
  return where(condition, a, scalar_operand(b, promote_with_scalar(a.dtype(), b)));
}
Tensor where(const Tensor& condition, const Scalar& a, const Tensor& b) {
  return where(condition, scalar_operand(a, promote_with_scalar(b.dtype(), a)), b);
}

// where(mask, value, x) with value in x's dtype (the number converted as fill_ converts it: PyTorch's rule), so the
// result keeps x's dtype; x and mask broadcast together, as PyTorch's out-of-place masked_fill.
Tensor masked_fill(const Tensor& x, const Tensor& mask, const Scalar& value) {
  check_defined("masked_fill", {x, mask});
  HG_CHECK(mask.dtype() == kBool, "masked_fill: expected a bool mask, got {} for input {}", mask.meta(), x.meta());
  HG_CHECK(fits_dtype(value, x.dtype()), "masked_fill: {} cannot be converted to {} without overflow", value.str(),
           x.meta());
  return select_where("masked_fill", "MaskedFillBackward", mask, scalar_operand(value, x.dtype()), x);
}

Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
Tensor operator+(const Tensor& a, const Scalar& b) { return binary(BinaryOp::Add, a, b); }
Tensor operator-(const Tensor& a, const Scalar& b) { return binary(BinaryOp::Sub, a, b); }
Tensor operator*(const Tensor& a, const Scalar& b) { return binary(BinaryOp::Mul, a, b); }
Tensor operator/(const Tensor& a, const Scalar& b) { return binary(BinaryOp::Div, a, b); }
Tensor operator+(const Scalar& a, const Tensor& b) { return binary(BinaryOp::Add, a, b); }
Tensor operator-(const Scalar& a, const Tensor& b) { return binary(BinaryOp::Sub, a, b); }
Tensor operator*(const Scalar& a, const Tensor& b) { return binary(BinaryOp::Mul, a, b); }
Tensor operator/(const Scalar& a, const Tensor& b) { return binary(BinaryOp::Div, a, b); }
Tensor operator-(const Tensor& x) { return neg(x); }
Tensor& operator+=(Tensor& a, const Tensor& b) { return a.add_(b); }
Tensor& operator-=(Tensor& a, const Tensor& b) { return a.sub_(b); }
Tensor& operator*=(Tensor& a, const Tensor& b) { return a.mul_(b); }
Tensor& operator/=(Tensor& a, const Tensor& b) { return a.div_(b); }
Tensor& operator+=(Tensor& a, const Scalar& b) { return a.add_(b); }
Tensor& operator-=(Tensor& a, const Scalar& b) { return a.sub_(b); }
Tensor& operator*=(Tensor& a, const Scalar& b) { return a.mul_(b); }
Tensor& operator/=(Tensor& a, const Scalar& b) { return a.div_(b); }

// ---- Tensor methods

Tensor Tensor::add(const Tensor& other, const Scalar& alpha) const { return halfgrad::add(*this, other, alpha); }
Tensor Tensor::add(const Scalar& other) const { return *this + other; }
Tensor Tensor::sub(const Tensor& other, const Scalar& alpha) const { return halfgrad::sub(*this, other, alpha); }
Tensor Tensor::sub(const Scalar& other) const { return *this - other; }
Tensor Tensor::mul(const Tensor& other) const { return halfgrad::mul(*this, other); }
Tensor Tensor::mul(const Scalar& other) const { return *this * other; }
Tensor Tensor::div(const Tensor& other) const { return halfgrad::div(*this, other); }
Tensor Tensor::div(const Scalar& other) const { return *this / other; }
Tensor Tensor::pow(const Tensor& exponent) const { return halfgrad::pow(*this, exponent); }
Tensor Tensor::pow(const Scalar& exponent) const { return halfgrad::pow(*this, exponent); }
Tensor Tensor::neg() const { return halfgrad::neg(*this); }
Tensor Tensor::abs() const { return halfgrad::abs(*this); }
Tensor Tensor::exp() const { return halfgrad::exp(*this); }
Tensor Tensor::log() const { return halfgrad::log(*this); }
Tensor Tensor::sqrt() const { return halfgrad::sqrt(*this); }
Tensor Tensor::rsqrt() const { return halfgrad::rsqrt(*this); }
Tensor Tensor::tanh() const { return halfgrad::tanh(*this); }
Tensor Tensor::sigmoid() const { return halfgrad::sigmoid(*this); }
Tensor Tensor::relu() const { return halfgrad::relu(*this); }
Tensor Tensor::sign() const { return halfgrad::sign(*this); }
Tensor Tensor::erf() const { return halfgrad::erf(*this); }
Tensor Tensor::clamp(std::optional<Scalar> min, std::optional<Scalar> max) const { return halfgrad::clamp(*this, min, max); }
Tensor Tensor::eq(const Tensor& other) const { return halfgrad::eq(*this, other); }
Tensor Tensor::ne(const Tensor& other) const { return halfgrad::ne(*this, other); }
Tensor Tensor::lt(const Tensor& other) const { return halfgrad::lt(*this, other); }
Tensor Tensor::le(const Tensor& other) const { return halfgrad::le(*this, other); }
Tensor Tensor::gt(const Tensor& other) const { return halfgrad::gt(*this, other); }
Tensor Tensor::ge(const Tensor& other) const { return halfgrad::ge(*this, other); }
Tensor Tensor::eq(const Scalar& other) const { return binary(BinaryOp::Eq, *this, other); }
Tensor Tensor::ne(const Scalar& other) const { return binary(BinaryOp::Ne, *this, other); }
Tensor Tensor::lt(const Scalar& other) const { return binary(BinaryOp::Lt, *this, other); }
Tensor Tensor::le(const Scalar& other) const { return binary(BinaryOp::Le, *this, other); }
Tensor Tensor::gt(const Scalar& other) const { return binary(BinaryOp::Gt, *this, other); }
Tensor Tensor::ge(const Scalar& other) const { return binary(BinaryOp::Ge, *this, other); }
Tensor Tensor::logical_not() const { return halfgrad::logical_not(*this); }
Tensor Tensor::isfinite() const { return halfgrad::isfinite(*this); }

Tensor& Tensor::add_(const Tensor& other, const Scalar& alpha) {
  check_alpha("add_", BinaryOp::Add, *this, other, alpha);  // also for alpha 1.0, which the first path would not see
  if (alpha.to_double() == 1)
    return binary_inplace(*this, BinaryOp::Add, "add_", other, [&](const Tensor& s) { return halfgrad::add(s, other); });
  return apply_in_place(*this, "add_", {other}, [&](const Tensor& s) { return halfgrad::add(s, other, alpha); });
}
Tensor& Tensor::add_(const Scalar& other) {
  return binary_inplace(*this, BinaryOp::Add, "add_",
                        number_operand(BinaryOp::Add, other, promote_with_scalar(dtype(), other)),
                        [&](const Tensor& s) { return s + other; });
}
Tensor& Tensor::sub_(const Tensor& other, const Scalar& alpha) {
  check_alpha("sub_", BinaryOp::Sub, *this, other, alpha);
  if (alpha.to_double() == 1)
    return binary_inplace(*this, BinaryOp::Sub, "sub_", other, [&](const Tensor& s) { return halfgrad::sub(s, other); });
  return apply_in_place(*this, "sub_", {other}, [&](const Tensor& s) { return halfgrad::sub(s, other, alpha); });
}
Tensor& Tensor::sub_(const Scalar& other) {
  return binary_inplace(*this, BinaryOp::Sub, "sub_",
                        number_operand(BinaryOp::Sub, other, promote_with_scalar(dtype(), other)),
                        [&](const Tensor& s) { return s - other; });
}
Tensor& Tensor::mul_(const Tensor& other) {
  return binary_inplace(*this, BinaryOp::Mul, "mul_", other, [&](const Tensor& s) { return halfgrad::mul(s, other); });
}
Tensor& Tensor::mul_(const Scalar& other) {
  return binary_inplace(*this, BinaryOp::Mul, "mul_",
                        number_operand(BinaryOp::Mul, other, promote_with_scalar(dtype(), other)),
                        [&](const Tensor& s) { return s * other; });
}
Tensor& Tensor::div_(const Tensor& other) {
  return binary_inplace(*this, BinaryOp::Div, "div_", other, [&](const Tensor& s) { return halfgrad::div(s, other); });
}
Tensor& Tensor::div_(const Scalar& other) {
  return binary_inplace(*this, BinaryOp::Div, "div_",
                        number_operand(BinaryOp::Div, other, promote_with_scalar(dtype(), other)),
                        [&](const Tensor& s) { return s / other; });
}
Tensor& Tensor::neg_() {
  return apply_in_place(*this, "neg_", {}, [](const Tensor& s) { return halfgrad::neg(s); });
}
Tensor& Tensor::exp_() {
  return apply_in_place(*this, "exp_", {}, [](const Tensor& s) { return halfgrad::exp(s); });
}
Tensor& Tensor::sqrt_() {
  return apply_in_place(*this, "sqrt_", {}, [](const Tensor& s) { return halfgrad::sqrt(s); });
}
Tensor& Tensor::relu_() {
  return apply_in_place(*this, "relu_", {}, [](const Tensor& s) { return halfgrad::relu(s); });
}
Tensor& Tensor::clamp_(std::optional<Scalar> min, std::optional<Scalar> max) {
  return apply_in_place(*this, "clamp_", {}, [&](const Tensor& s) { return halfgrad::clamp(s, min, max); });
}

Tensor Tensor::masked_fill(const Tensor& mask, const Scalar& value) const {
  return halfgrad::masked_fill(*this, mask, value);
}
Tensor& Tensor::masked_fill_(const Tensor& mask, const Scalar& value) {
  check_defined("masked_fill_", {*this, mask});
  HG_CHECK(broadcast_shapes(shape(), mask.shape(), "masked_fill_") == shape(),
           "masked_fill_: mask {} does not broadcast to the shape of {}, which an in-place write keeps", mask.meta(),
           meta());
  return apply_in_place(*this, "masked_fill_", {mask},
                        [&](const Tensor& s) { return halfgrad::masked_fill(s, mask, value); });
}

Tensor& Tensor::operator=(const Scalar& value) && {
  // Where autograd sees the write, copy_ records it (on a view, into its base's history) or refuses it as any in-place
  // write (a leaf that requires grad, or a view of one); fill_ is never recorded.
  if (GradMode::is_enabled() && requires_grad()) return copy_(scalar_tensor(value, {.dtype = dtype()}));
  return fill_(value);
}

Tensor& Tensor::fill_(const Scalar& value) {
  HG_CHECK(defined(), "fill_: the tensor is undefined");
  HG_CHECK(!GradMode::is_enabled() || !requires_grad(), "fill_: {} requires grad; {}", meta(),
           "autograd does not record fill_: a parameter (or a view of one) is filled under a NoGradGuard, a computed "
           "tensor's new values are made out of place (where, full_like)");
  HG_CHECK(fits_dtype(value, dtype()), "fill_: {} cannot be converted to {} without overflow", value.str(), meta());
  check_inplace(*this, "fill_", /*records=*/false);  // after the checks: a refused fill bumps no version
  fill_kernel[device()](*this, value);
  return *this;
}

bool float32_number_is_left(BinaryOp op, const Tensor& a, const Tensor& b) {
  const bool left = a.dim() == 0 && a.is_cpu() && a.dtype() == kFloat32 && is_half(b.dtype());
  const Tensor& number = left ? a : b;
  HG_CHECK(number.dim() == 0 && number.is_cpu() && number.dtype() == kFloat32 && is_half((left ? b : a).dtype()),
           "{}: the kernel was given operands of different dtypes, {} and {}, and neither is a 0-d float32 number "
           "beside float16 or bfloat16", op_name(op), a.meta(), b.meta());
  return left;
}

// ---- CPU kernels

namespace {

void unary_cpu(UnaryOp op, const Tensor& out, const Tensor& in) {
  dispatch_all(in.dtype(), op_name(op), [&]<typename T>() {
    dispatch_unary_op(op, [&]<UnaryOp OP>() {
      using M = opmath_t<T>;
      // auto operands: float16 arrives as float in contiguous runs (cpu::map)
      if constexpr (floating_only(OP) && !std::is_floating_point_v<M>) {
        HG_FAIL("{}: not supported for {} tensors", op_name(op), in.meta());
      } else if constexpr (is_predicate(OP)) {
        cpu::map<bool, T>(out, [](auto x) { return bool(unary_math<OP>(M(x))); }, {in});
      } else if constexpr (!std::is_same_v<T, bool>) {
        cpu::map<T, T>(out, [](auto x) { return cpu::widened_t<T>(unary_math<OP>(M(x))); }, {in});
      } else if constexpr (takes_bool(OP) && !needs_floating(OP)) {  // abs, sign: as on CUDA
        cpu::map<bool, bool>(out, [](bool x) { return unary_math<OP>(x); }, {in});
      } else {
        HG_FAIL("{}: not supported for bool tensors", op_name(op));
      }
    });
  });
}

// A float16 or bfloat16 op with a number (a 0-d float32 tensor, read in float32): the tensor operand mapped alone. The
// number's side is a compile-time choice: a branch in the loop keeps GCC from vectorising an ordered comparison.
template <typename T> void binary_scalar_cpu(BinaryOp op, const Tensor& out, const Tensor& x, float scalar, bool left) {
  dispatch_binary_op(op, [&]<BinaryOp OP>() {
    auto run = [&]<bool LEFT>() {
      auto math = [scalar](float v) { return LEFT ? binary_math<OP>(scalar, v) : binary_math<OP>(v, scalar); };
      if constexpr (is_predicate(OP))
        cpu::map<bool, T>(out, [math](auto v) { return bool(math(float(v))); }, {x});
      else
        cpu::map<T, T>(out, [math](auto v) { return cpu::widened_t<T>(math(float(v))); }, {x});
    };
    left ? run.template operator()<true>() : run.template operator()<false>();
  });
}

void binary_cpu(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype())
    return dispatch_float32_number(op, a, b, [&]<typename T>(const Tensor& x, float number, bool left) {
      binary_scalar_cpu<T>(op, out, x, number, left);
    });
  dispatch_all(a.dtype(), op_name(op), [&]<typename T>() {
    dispatch_binary_op(op, [&]<BinaryOp OP>() {
      using M = opmath_t<T>;
      if constexpr (floating_only(OP) && !std::is_floating_point_v<M>) {
        HG_FAIL("{}: not supported for {} operands", op_name(op), a.meta());
      } else if constexpr (is_predicate(OP)) {
        cpu::map<bool, T, T>(out, [](auto x, auto y) { return bool(binary_math<OP>(M(x), M(y))); }, {a, b});
      } else {
        cpu::map<T, T, T>(
            out, [](auto x, auto y) { return cpu::widened_t<T>(binary_math<OP>(M(x), M(y))); }, {a, b});
      }
    });
  });
}

void where_cpu(const Tensor& out, const Tensor& condition, const Tensor& a, const Tensor& b) {
  dispatch_all(out.dtype(), "where", [&]<typename T>() {
    // The condition read as bytes: GCC vectorises a select on uint8_t, not on bool (which cost a branch per value).
    cpu::map<T, uint8_t, T, T>(out, [](uint8_t c, auto x, auto y) { return c != 0 ? x : y; }, {condition, a, b});
  });
}

void fill_cpu(const Tensor& out, const Scalar& value) {
  dispatch_all(out.dtype(), "fill_", [&]<typename T>() {
    const T v = fill_value<T>(value);
    cpu::map<T>(out, [v]() { return v; }, {});
  });
}

}  // namespace

HG_REGISTER_KERNEL(unary_kernel, CPU, unary_cpu);
HG_REGISTER_KERNEL(binary_kernel, CPU, binary_cpu);
HG_REGISTER_KERNEL(where_kernel, CPU, where_cpu);
HG_REGISTER_KERNEL(fill_kernel, CPU, fill_cpu);

}  // namespace halfgrad

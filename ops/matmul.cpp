// Matrix products: matmul, bmm, linear; their backward passes; the CPU GEMM kernel (float32 through
// ops/gemm_blocked.cpp where it suits, else Eigen).
//
// Path from an op to the kernel:
//   matmul / bmm / linear  ->  run_gemm(Operand a, Operand b, Operand c)  ->  gemm_kernel[device](GemmArgs)
// The ops only describe their operands as stacks of strided matrices (Operand, no copies: transposed and
// broadcast inputs are read in place); run_gemm turns that into as few strided-batched GEMM calls as the
// strides allow (usually one).
#include "ops/matmul.h"

#include <omp.h>

#include <Eigen/Core>
#include <algorithm>
#include <cstring>
#include <mutex>
#include <optional>
#include <type_traits>
#include <vector>

#include "core/autocast.h"
#include "core/autograd.h"
#include "ops/gemm_blocked.h"

namespace halfgrad {

KernelTable<GemmKernel> gemm_kernel("gemm");

void gemm_dense(Device device, DType ab, DType c_dtype, int64_t m, int64_t n, int64_t k, const void* a,
                Trans trans_a, const void* b, Trans trans_b, void* c, double beta, const void* bias,
                const void* device_scalars) {
  if (m == 0 || n == 0) return;
  GemmArgs g;
  g.ab_dtype = ab, g.c_dtype = c_dtype, g.device = device;
  g.m = m, g.n = n, g.k = k;
  g.a = a, g.trans_a = trans_a, g.lda = trans_a == Trans::Yes ? m : k;
  g.b = b, g.trans_b = trans_b, g.ldb = trans_b == Trans::Yes ? k : n;
  g.c = c, g.ldc = n;
  g.beta = beta;
  g.bias = bias;
  g.device_scalars = device_scalars;
  gemm_kernel[device](g);
}

GemmArgs start_from_bias(const GemmArgs& g) {
  HG_CHECK(g.bias != nullptr && g.beta == 0, "gemm: a bias is added to C's rows with beta = 0 (got beta {})", g.beta);
  GemmArgs rest = g;
  rest.bias = nullptr;
  rest.beta = 1;
  return rest;
}

namespace {

// ---- operands: a tensor seen as a stack of matrices (batch..., rows, cols), without copying it

struct Operand {
  char* data = nullptr;  // element 0 (the tensor's data_ptr)
  DType dtype = kFloat32;
  Shape sizes;    // batch..., rows, cols (at least 2 entries)
  Shape strides;  // in elements

  int64_t rows() const { return sizes[sizes.size() - 2]; }
  int64_t cols() const { return sizes.back(); }
  size_t batch_dims() const { return sizes.size() - 2; }
};

// `t` as a stack of matrices; a 1-D t becomes one row ([1, n], as_row) or one column ([n, 1]).
// transposed: swap the last two dims (a free transpose: only the strides change).
Operand operand_of(const Tensor& t, bool transposed = false, bool as_row = true) {
  Operand op{static_cast<char*>(t.data_ptr()), t.dtype(), t.shape(), t.strides()};
  if (t.dim() == 1) {
    op.sizes.insert(as_row ? op.sizes.begin() : op.sizes.end(), 1);
    op.strides.insert(as_row ? op.strides.begin() : op.strides.end(), 0);  // a size-1 dim's stride is unused
  }
  if (transposed) {
    std::swap(op.sizes[op.sizes.size() - 2], op.sizes.back());
    std::swap(op.strides[op.strides.size() - 2], op.strides.back());
  }
  return op;
}

// How GEMM reads a matrix with strides (s_row, s_col): row-major (s_col == 1) as stored, column-major
// (s_row == 1) as the transpose of a row-major matrix. A size-1 dim's stride is arbitrary, so it never
// disqualifies a layout. BLAS also requires the leading dimension to cover a row: ld >= max(1, cols).
struct MatrixLayout {
  Trans trans = Trans::No;
  int64_t ld = 1;
};

std::optional<MatrixLayout> layout_of(int64_t rows, int64_t cols, int64_t s_row, int64_t s_col) {
  if (cols <= 1 || s_col == 1) {
    int64_t ld = rows <= 1 ? std::max<int64_t>(cols, 1) : s_row;
    if (ld >= std::max<int64_t>(cols, 1)) return MatrixLayout{Trans::No, ld};
  }
  if (rows <= 1 || s_row == 1) {
    int64_t ld = cols <= 1 ? std::max<int64_t>(rows, 1) : s_col;
    if (ld >= std::max<int64_t>(rows, 1)) return MatrixLayout{Trans::Yes, ld};
  }
  return std::nullopt;
}

std::optional<MatrixLayout> layout_of(const Operand& op) {
  size_t r = op.sizes.size() - 2;
  return layout_of(op.sizes[r], op.sizes[r + 1], op.strides[r], op.strides[r + 1]);
}

// The operand of `t`, made contiguous first when GEMM cannot read its matrices in place (neither
// stride is 1: a strided slice, or a matrix broadcast with stride 0). `keep` owns the copy.
Operand gemm_operand(const Tensor& t, Tensor& keep, bool transposed = false, bool as_row = true) {
  Operand op = operand_of(t, transposed, as_row);
  if (layout_of(op)) return op;
  NoGradGuard no_grad;
  keep = t.contiguous();
  return operand_of(keep, transposed, as_row);
}

// Batch dims that step uniformly in A, B and C merge into one, so that the innermost run of batch dims is
// a single strided-batched call. Returns the runs outermost first.
struct BatchRun {
  int64_t size;
  int64_t stride_a, stride_b, stride_c;
};

std::vector<BatchRun> batch_runs(const Shape& batch, const Shape& sa, const Shape& sb, const Shape& sc) {
  std::vector<BatchRun> runs;
  for (size_t d = 0; d < batch.size(); ++d) {
    if (batch[d] == 1) continue;
    BatchRun next{batch[d], sa[d], sb[d], sc[d]};
    if (!runs.empty()) {
      BatchRun& outer = runs.back();
      if (outer.stride_a == next.stride_a * next.size && outer.stride_b == next.stride_b * next.size &&
          outer.stride_c == next.stride_c * next.size) {
        outer = {outer.size * next.size, next.stride_a, next.stride_b, next.stride_c};
        continue;
      }
    }
    runs.push_back(next);
  }
  return runs;
}

// Strides of `op`'s batch dims aligned to a batch shape of `ndim` dims (missing or size-1 dims: 0).
Shape aligned_batch_strides(const Operand& op, size_t ndim) {
  Shape s(ndim, 0);
  size_t lead = ndim - op.batch_dims();
  for (size_t d = 0; d < op.batch_dims(); ++d) s[lead + d] = op.sizes[d] == 1 ? 0 : op.strides[d];
  return s;
}

// C[batch..., m, n] = alpha * A[batch..., m, k] B[batch..., k, n] + beta * C, where the batch dims of A and
// B broadcast to C's (C has all of them). A and B must be readable in place (gemm_operand); C is written
// and must not overlap between batch entries.
void run_gemm(const Operand& a, const Operand& b, const Operand& c, Device device, double beta = 0.0,
              const void* bias = nullptr) {
  GemmArgs args;
  args.bias = bias;
  args.m = c.rows();
  args.n = c.cols();
  args.k = a.cols();
  args.ab_dtype = a.dtype;
  args.c_dtype = c.dtype;
  args.beta = beta;
  args.device = device;
  MatrixLayout la = *layout_of(a), lb = *layout_of(b), lc = *layout_of(c);
  HG_CHECK(lc.trans == Trans::No, "gemm: the output must be row-major");
  args.trans_a = la.trans;
  args.lda = la.ld;
  args.trans_b = lb.trans;
  args.ldb = lb.ld;
  args.ldc = lc.ld;

  const size_t nb = c.batch_dims();
  Shape batch(c.sizes.begin(), c.sizes.begin() + nb);
  Shape sa = aligned_batch_strides(a, nb), sb = aligned_batch_strides(b, nb), sc = aligned_batch_strides(c, nb);

  // A stack of row-major A times one shared B: fold A's batch dims into its rows, one [batch*m, k] GEMM.
  // (x[B, T, in] W: the common case in linear layers; one big GEMM beats many small ones.)
  bool b_shared = std::all_of(sb.begin(), sb.end(), [](int64_t s) { return s == 0; });
  if (nb > 0 && b_shared && la.trans == Trans::No) {
    Shape rows_sizes = batch, rows_a = sa, rows_c = sc;
    rows_sizes.push_back(args.m);
    rows_a.push_back(args.m == 1 ? 0 : la.ld);
    rows_c.push_back(args.m == 1 ? 0 : lc.ld);
    Shape zeros(rows_sizes.size(), 0);
    std::vector<BatchRun> runs = batch_runs(rows_sizes, rows_a, zeros, rows_c);
    if (runs.size() <= 1) {
      int64_t rows = runs.empty() ? 1 : runs[0].size;
      args.m = rows;
      if (rows > 1) {
        args.lda = runs[0].stride_a;
        args.ldc = runs[0].stride_c;
      }
      if (args.lda >= std::max<int64_t>(args.k, 1) && args.ldc >= std::max<int64_t>(args.n, 1)) {
        args.a = a.data;
        args.b = b.data;
        args.c = c.data;
        gemm_kernel[device](args);
        return;
      }
      // A folded leading dimension that BLAS would reject (rows overlapping): use the batched path.
      args.m = c.rows();
      args.lda = la.ld;
      args.ldc = lc.ld;
    }
  }

  std::vector<BatchRun> runs = batch_runs(batch, sa, sb, sc);
  BatchRun inner = runs.empty() ? BatchRun{1, 0, 0, 0} : runs.back();
  if (!runs.empty()) runs.pop_back();
  args.batch = inner.size;
  args.stride_a = inner.stride_a;
  args.stride_b = inner.stride_b;
  args.stride_c = inner.stride_c;

  // The outer runs (batch dims whose strides do not merge, e.g. [2, 1] x [1, 3]) loop here.
  const int64_t ea = int64_t(element_size(a.dtype)), eb = int64_t(element_size(b.dtype)),
                ec = int64_t(element_size(c.dtype));
  int64_t outer = 1;
  for (const BatchRun& r : runs) outer *= r.size;
  for (int64_t i = 0; i < outer; ++i) {
    int64_t rem = i, off_a = 0, off_b = 0, off_c = 0;
    for (size_t r = runs.size(); r-- > 0;) {
      int64_t idx = rem % runs[r].size;
      rem /= runs[r].size;
      off_a += idx * runs[r].stride_a;
      off_b += idx * runs[r].stride_b;
      off_c += idx * runs[r].stride_c;
    }
    args.a = a.data + off_a * ea;
    args.b = b.data + off_b * eb;
    args.c = c.data + off_c * ec;
    gemm_kernel[device](args);
  }
}

// ---- checks

// PyTorch refuses mixed dtypes in matrix products rather than promoting: a float64 weight silently turning
// a float32 network into float64 (or the reverse) is a bug to report, not to hide.
void check_same_dtype_device(const char* op, const char* operands, const Tensor& a, const Tensor& b) {
  HG_CHECK(a.dtype() == b.dtype(), "{}: expected {} to have the same dtype, got {} and {} (convert one with "
           ".to(dtype))", op, operands, a.meta(), b.meta());
  HG_CHECK(a.device() == b.device(), "{}: expected {} on the same device, got {} and {}", op, operands, a.meta(),
           b.meta());
}

void check_gemm_dtype(const char* op, const Tensor& t) {
  HG_CHECK(t.dtype() != kBool, "{}: bool tensors are not supported (got {}); convert to an integer or float dtype",
           op, t.meta());
}

// ---- forward (no autograd): out = a @ b with matmul's rank rules

Tensor matmul_forward(const Tensor& a, const Tensor& b) {
  const int64_t da = a.dim(), db = b.dim();
  Tensor keep_a, keep_b;
  Operand oa = gemm_operand(a, keep_a, false, /*as_row=*/true);   // 1-D left operand: a row [1, k]
  Operand ob = gemm_operand(b, keep_b, false, /*as_row=*/false);  // 1-D right operand: a column [k, 1]
  const int64_t m = oa.rows(), k = oa.cols(), n = ob.cols();
  HG_CHECK(ob.rows() == k, "matmul: shapes {} and {} cannot be multiplied ({}x{} and {}x{})", shape_str(a.shape()),
           shape_str(b.shape()), m, k, ob.rows(), n);

  Shape batch_a(oa.sizes.begin(), oa.sizes.end() - 2), batch_b(ob.sizes.begin(), ob.sizes.end() - 2);
  Shape batch;
  try {
    batch = broadcast_shapes(batch_a, batch_b, "matmul");
  } catch (const Error& e) {
    HG_FAIL("matmul: the batch dims of shapes {} and {} do not broadcast ({})", shape_str(a.shape()),
            shape_str(b.shape()), e.what());
  }
  Shape full = batch;  // the result with both matrix dims
  full.push_back(m);
  full.push_back(n);
  Shape result = batch;  // torch.matmul's shape: a 1-D operand's dim of 1 is dropped
  if (da > 1) result.push_back(m);
  if (db > 1) result.push_back(n);

  Tensor out = empty(result, {.dtype = a.dtype(), .device = a.device()});
  if (out.numel() == 0) return out;
  Operand oc{static_cast<char*>(out.data_ptr()), out.dtype(), full, contiguous_strides(full)};
  run_gemm(oa, ob, oc, a.device());
  return out;
}

// What the backward of out = a @ b keeps: each operand only where the other's gradient needs it (as PyTorch's), so
// that an operand changed in place after the op is no error where no gradient reads it; and both shapes.
struct MatmulSaved {
  SavedTensor a, b;
  Shape a_shape, b_shape;
  MatmulSaved(const Tensor& a, const Tensor& b, const char* op)
      : a(b.requires_grad() ? SavedTensor(a, op) : SavedTensor()),
        b(a.requires_grad() ? SavedTensor(b, op) : SavedTensor()),
        a_shape(a.shape()),
        b_shape(b.shape()) {}
};

// Gradients of out = a @ b (matmul's rank rules) for the inputs that need one.
TensorList matmul_backward(const GradContext& ctx, const MatmulSaved& saved) {
  // Redo the forward's promotion of 1-D operands, and put the dropped dims back into the gradient.
  const Shape &a_shape = saved.a_shape, &b_shape = saved.b_shape;
  Tensor g = ctx[0];
  if (b_shape.size() == 1) g = g.unsqueeze(-1);
  if (a_shape.size() == 1) g = g.unsqueeze(-2);  // g: [batch..., m, n]

  Tensor grad_a, grad_b;
  if (ctx.needs(0)) {
    // dA = dC B^T, summed over the batch dims A was broadcast along.
    const Tensor& b = saved.b.get();
    const Tensor b2 = b.dim() == 1 ? b.unsqueeze(-1) : b;  // [..., k, n]
    const Shape a2_shape = a_shape.size() == 1 ? Shape{1, a_shape[0]} : a_shape;  // [..., m, k]
    grad_a = sum_to(matmul(g, b2.transpose(-1, -2)), a2_shape).reshape(a_shape);
  }
  if (ctx.needs(1)) {
    const Tensor& a = saved.a.get();
    const Tensor a2 = a.dim() == 1 ? a.unsqueeze(0) : a;
    const Shape b2_shape = b_shape.size() == 1 ? Shape{b_shape[0], 1} : b_shape;
    if (b2_shape.size() == 2 && a2.dim() > 2) {
      // A shared matrix B: dB = A^T dC over all rows of the stack at once, one GEMM instead of a batch.
      const int64_t rows = numel_of(Shape(a2.shape().begin(), a2.shape().end() - 1));
      grad_b = a2.reshape({rows, a2.size(-1)}).t().matmul(g.reshape({rows, g.size(-1)}));
    } else {
      grad_b = sum_to(matmul(a2.transpose(-1, -2), g), b2_shape);
    }
    grad_b = grad_b.reshape(b_shape);
  }
  return {grad_a, grad_b};
}

}  // namespace

// ---- matmul. Autocast category: "lower precision".

Tensor matmul(const Tensor& a, const Tensor& b) {
  HG_AUTOCAST(matmul, a, b);
  HG_CHECK(a.defined() && b.defined(), "matmul: got an undefined tensor ({} and {})", a.meta(), b.meta());
  check_same_dtype_device("matmul", "both operands", a, b);
  check_gemm_dtype("matmul", a);
  HG_CHECK(a.dim() >= 1 && b.dim() >= 1, "matmul: both arguments need at least 1 dimension, got shapes {} and {}",
           shape_str(a.shape()), shape_str(b.shape()));
  Tensor out = matmul_forward(a, b);
  record("MatmulBackward", {a, b}, {out}, [saved = MatmulSaved(a, b, "MatmulBackward")](const GradContext& ctx) {
    return matmul_backward(ctx, saved);
  }, DoubleBackward::Supported);
  return out;
}

Tensor Tensor::matmul(const Tensor& other) const { return halfgrad::matmul(*this, other); }

// ---- bmm. Autocast category: "lower precision".

Tensor bmm(const Tensor& a, const Tensor& b) {
  HG_AUTOCAST(bmm, a, b);
  HG_CHECK(a.defined() && b.defined(), "bmm: got an undefined tensor ({} and {})", a.meta(), b.meta());
  check_same_dtype_device("bmm", "both operands", a, b);
  check_gemm_dtype("bmm", a);
  HG_CHECK(a.dim() == 3 && b.dim() == 3, "bmm: expected two 3-D tensors, got shapes {} and {}",
           shape_str(a.shape()), shape_str(b.shape()));
  HG_CHECK(a.size(0) == b.size(0) && a.size(2) == b.size(1),
           "bmm: shapes {} and {} cannot be multiplied (batch {} and {}, matrices {}x{} and {}x{})",
           shape_str(a.shape()), shape_str(b.shape()), a.size(0), b.size(0), a.size(1), a.size(2), b.size(1), b.size(2));
  Tensor out = matmul_forward(a, b);
  record("BmmBackward", {a, b}, {out}, [saved = MatmulSaved(a, b, "BmmBackward")](const GradContext& ctx) {
    return matmul_backward(ctx, saved);  // same batch: no broadcast sums happen
  }, DoubleBackward::Supported);
  return out;
}

// ---- linear. Autocast category: "lower precision".

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  HG_AUTOCAST(linear, x, weight, bias);
  HG_CHECK(x.defined() && weight.defined(), "linear: got an undefined tensor (input {}, weight {})", x.meta(),
           weight.meta());
  check_same_dtype_device("linear", "input and weight", x, weight);
  check_gemm_dtype("linear", x);
  if (weight.dim() == 1) {
    // One output feature whose dim the result drops, as PyTorch's: x [..., in] -> [...] (a 1-D x gives a 0-d result).
    // With a bias of one value too, where PyTorch 2.x's eager linear refuses most such calls (its addmm path).
    HG_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(0),
             "linear: input shape {} does not match weight shape {} (expected input [..., {}])", shape_str(x.shape()),
             shape_str(weight.shape()), weight.size(0));
    HG_CHECK(!bias.defined() || (bias.dim() <= 1 && bias.numel() == 1),
             "linear: with a 1-D weight {} the bias must be one value (0-d or [1]), got shape {}",
             shape_str(weight.shape()), shape_str(bias.shape()));
    if (bias.defined()) check_same_dtype_device("linear", "weight and bias", weight, bias);
    return linear(x, weight.unsqueeze(0), bias.defined() ? bias.reshape({1}) : bias).squeeze(-1);
  }
  HG_CHECK(weight.dim() == 2, "linear: weight must be 2-D [out_features, in_features] or 1-D [in_features], got "
           "shape {}", shape_str(weight.shape()));
  HG_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1),
           "linear: input shape {} does not match weight shape {} (expected input [..., {}])", shape_str(x.shape()),
           shape_str(weight.shape()), weight.size(1));
  const int64_t in_features = weight.size(1), out_features = weight.size(0);
  if (bias.defined()) {
    check_same_dtype_device("linear", "weight and bias", weight, bias);
    HG_CHECK(bias.dim() == 1 && bias.size(0) == out_features,
             "linear: bias shape {} does not match weight shape {} (expected [{}])", shape_str(bias.shape()),
             shape_str(weight.shape()), out_features);
  }

  const int64_t rows = numel_of(Shape(x.shape().begin(), x.shape().end() - 1));  // all leading dims of x
  Shape result = x.shape();  // [..., out_features]
  result.back() = out_features;
  Tensor out = empty(result, {.dtype = x.dtype(), .device = x.device()});
  if (out.numel() > 0) {
    // The bias is fused: the GEMM kernel starts C as the bias rows and accumulates onto them.
    Tensor dense_bias;
    if (bias.defined()) {
      NoGradGuard no_grad;
      dense_bias = bias.contiguous();
    }
    Tensor keep_x, keep_w;
    Operand ox = gemm_operand(x, keep_x);                           // [..., in] (1-D x: [1, in])
    Operand ow = gemm_operand(weight, keep_w, /*transposed=*/true);  // W^T: [in, out], read in place
    Shape full = ox.sizes;
    full.back() = out_features;
    Operand oc{static_cast<char*>(out.data_ptr()), out.dtype(), full, contiguous_strides(full)};
    run_gemm(ox, ow, oc, x.device(), 0.0, dense_bias.defined() ? dense_bias.data_ptr() : nullptr);
  }

  record("LinearBackward", {x, weight, bias}, {out},
         [sx = SavedTensor(x, "LinearBackward"), sw = SavedTensor(weight, "LinearBackward"), rows, in_features,
          out_features](const GradContext& ctx) -> TensorList {
           const Tensor& g = ctx[0];  // [..., out]
           Tensor grad_x, grad_w, grad_b;
           Tensor g2 = g.reshape({rows, out_features});  // every leading dim flattened into rows
           if (ctx.needs(0)) grad_x = g.matmul(sw.get());  // dx = g W: [..., in]
           if (ctx.needs(1)) {
             // dW = g^T x over all rows: one GEMM, however many leading dims x has.
             grad_w = g2.t().matmul(sx.get().reshape({rows, in_features}));
           }
           if (ctx.needs(2)) grad_b = g2.sum({0});  // db = g summed over the rows
           return {grad_x, grad_w, grad_b};
         }, DoubleBackward::Supported);
  return out;
}

// ---- CPU kernel

namespace {

constexpr double kParallelBatchFlops = 2.0 * 128 * 128 * 128;  // below this a product is "small"

void init_eigen() {
  static std::once_flag once;
  std::call_once(once, [] { Eigen::initParallel(); });
}

template <typename T> using RowMajorMap =
    Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>, 0, Eigen::OuterStride<>>;
template <typename T> using ColMajorMap =
    Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>, 0, Eigen::OuterStride<>>;
template <typename T> using OutMap =
    Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>, 0, Eigen::OuterStride<>>;

// Calls fn(map) with op(X) (rows x cols) mapped onto X's storage: a row-major map for Trans::No, a
// column-major one (the same memory, read transposed) for Trans::Yes. Eigen's GEMM packs either layout.
template <typename T, typename Fn>
void with_operand(const T* p, Trans trans, int64_t rows, int64_t cols, int64_t ld, Fn&& fn) {
  if (trans == Trans::No) {
    fn(RowMajorMap<T>(p, rows, cols, Eigen::OuterStride<>(ld)));
  } else {
    fn(ColMajorMap<T>(p, rows, cols, Eigen::OuterStride<>(ld)));
  }
}

// Whether to run the batch entries on separate threads (each product single-threaded) rather than one
// after another with Eigen's own threads inside each product: many small matrices parallelise better
// over the batch.
bool parallel_over_batch(const GemmArgs& g) {
  const int threads = omp_get_max_threads();
  if (g.batch < 2 || threads < 2) return false;
  const double flops = 2.0 * double(g.m) * double(g.n) * double(g.k);
  return flops < kParallelBatchFlops || g.batch >= 4 * threads;
}


template <typename T> void gemm_eigen(const GemmArgs& g) {
  init_eigen();
  const T alpha = T(g.alpha), beta = T(g.beta);
  const bool over_batch = parallel_over_batch(g);
  auto one = [&](int64_t i) {
    const T* a = static_cast<const T*>(g.a) + i * g.stride_a;
    const T* b = static_cast<const T*>(g.b) + i * g.stride_b;
    if constexpr (std::is_same_v<T, float>) {
      if (g.k > 0 && gemm_blocked::suits(g)) {
        const double flops = 2.0 * double(g.m) * double(g.n) * double(g.k);
        const int threads = over_batch || flops < 4e6 ? 1 : omp_get_max_threads();
        gemm_blocked::run(g, a, b, static_cast<float*>(g.c) + i * g.stride_c, threads);
        return;
      }
    }
    HG_CHECK(!g.bias, "gemm (cpu): Eigen's products take no bias (gemm_cpu writes it into C first)");
    OutMap<T> c(static_cast<T*>(g.c) + i * g.stride_c, g.m, g.n, Eigen::OuterStride<>(g.ldc));
    if (g.k == 0) {  // an empty sum: C = beta * C
      if (g.beta == 0) {
        c.setZero();
      } else {
        c *= beta;
      }
      return;
    }
    if (g.beta != 0 && g.beta != 1) c *= beta;
    with_operand(a, g.trans_a, g.m, g.k, g.lda, [&](const auto& A) {
      with_operand(b, g.trans_b, g.k, g.n, g.ldb, [&](const auto& B) {
        if (g.beta == 0) {
          c.noalias() = (alpha * A) * B;  // Eigen folds the scalar into its GEMM's alpha
        } else {
          c.noalias() += (alpha * A) * B;
        }
      });
    });
  };
  if (over_batch) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < g.batch; ++i) one(i);  // inside a parallel region Eigen runs single-threaded
  } else {
    for (int64_t i = 0; i < g.batch; ++i) one(i);
  }
}

// Integers: a plain loop (no BLAS does them). Unsigned arithmetic so that overflow wraps as in PyTorch
// instead of being undefined behaviour.
template <typename T> void gemm_loop(const GemmArgs& g) {
  using U = std::make_unsigned_t<T>;
  const U alpha = U(T(g.alpha)), beta = U(T(g.beta));
  const bool parallel = double(g.batch) * double(g.m) * double(g.n) * double(g.k) > 1e5;
#pragma omp parallel for collapse(2) schedule(static) if (parallel)
  for (int64_t bi = 0; bi < g.batch; ++bi) {
    for (int64_t i = 0; i < g.m; ++i) {
      const T* a = static_cast<const T*>(g.a) + bi * g.stride_a;
      const T* b = static_cast<const T*>(g.b) + bi * g.stride_b;
      T* c = static_cast<T*>(g.c) + bi * g.stride_c + i * g.ldc;
      std::vector<U> acc(size_t(g.n), U(0));
      for (int64_t p = 0; p < g.k; ++p) {
        const U av = U(g.trans_a == Trans::No ? a[i * g.lda + p] : a[p * g.lda + i]);
        for (int64_t j = 0; j < g.n; ++j) {
          acc[size_t(j)] += av * U(g.trans_b == Trans::No ? b[p * g.ldb + j] : b[j * g.ldb + p]);
        }
      }
      for (int64_t j = 0; j < g.n; ++j) {
        U v = alpha * acc[size_t(j)];
        if (g.beta != 0) v += beta * U(c[j]);
        c[j] = T(v);
      }
    }
  }
}

// Copies `count` stored matrices (rows x cols, leading dim ld, `stride` apart) into packed float32 ones. The
// buffers are tensors, so that large ones come from the CPU allocator's cache: fresh std::vector memory cost a
// zero-fill and page faults per call (perf: 10% of an O1 language-model step).
template <typename H>
Tensor widen(const H* src, int64_t count, int64_t stride, int64_t rows, int64_t cols, int64_t ld) {
  Tensor out = empty({count * rows * cols});
  float* o0 = out.data<float>();
#pragma omp parallel for collapse(2) if (count * rows * cols > (1 << 16))
  for (int64_t b = 0; b < count; ++b) {
    for (int64_t r = 0; r < rows; ++r) {
      const H* in = src + b * stride + r * ld;
      float* o = o0 + (b * rows + r) * cols;
      if constexpr (std::is_same_v<H, Half>) {
        half_to_float(in, o, cols);
      } else {
        for (int64_t c = 0; c < cols; ++c) o[c] = float(in[c]);
      }
    }
  }
  return out;
}

// float16 / bfloat16: widen to float32, run the float32 GEMM (products accumulate in float32), round the
// result once. Costs a copy of each operand, small next to the GEMM's m*n*k work.
template <typename H> void gemm_half(const GemmArgs& g) {
  const int64_t a_rows = g.trans_a == Trans::No ? g.m : g.k, a_cols = g.trans_a == Trans::No ? g.k : g.m;
  const int64_t b_rows = g.trans_b == Trans::No ? g.k : g.n, b_cols = g.trans_b == Trans::No ? g.n : g.k;
  const int64_t a_count = g.stride_a == 0 ? 1 : g.batch, b_count = g.stride_b == 0 ? 1 : g.batch;
  const Tensor a = widen(static_cast<const H*>(g.a), a_count, g.stride_a, a_rows, a_cols, g.lda);
  const Tensor b = widen(static_cast<const H*>(g.b), b_count, g.stride_b, b_rows, b_cols, g.ldb);
  // beta == 0: the float32 GEMM writes C without reading it.
  const Tensor c = g.beta == 0 ? empty({g.batch * g.m * g.n})
                               : widen(static_cast<const H*>(g.c), g.batch, g.stride_c, g.m, g.n, g.ldc);
  GemmArgs f = g;
  f.ab_dtype = f.c_dtype = kFloat32;
  f.a = a.data<float>();
  f.lda = std::max<int64_t>(a_cols, 1);
  f.stride_a = g.stride_a == 0 ? 0 : a_rows * a_cols;
  f.b = b.data<float>();
  f.ldb = std::max<int64_t>(b_cols, 1);
  f.stride_b = g.stride_b == 0 ? 0 : b_rows * b_cols;
  f.c = c.data<float>();
  f.ldc = std::max<int64_t>(g.n, 1);
  f.stride_c = g.m * g.n;
  gemm_eigen<float>(f);
  const float* c0 = c.data<float>();
#pragma omp parallel for collapse(2) if (g.batch * g.m * g.n > (1 << 16))
  for (int64_t bi = 0; bi < g.batch; ++bi) {
    for (int64_t r = 0; r < g.m; ++r) {
      H* out = static_cast<H*>(g.c) + bi * g.stride_c + r * g.ldc;
      const float* in = c0 + (bi * g.m + r) * g.n;
      if constexpr (std::is_same_v<H, Half>) {
        float_to_half(in, out, g.n);
      } else {
        for (int64_t j = 0; j < g.n; ++j) out[j] = H(in[j]);
      }
    }
  }
}

void gemm_cpu(const GemmArgs& g) {
  HG_CHECK(g.ab_dtype == g.c_dtype, "gemm (cpu): operands {} with output {} are not supported",
           dtype_name(g.ab_dtype), dtype_name(g.c_dtype));
  HG_CHECK(g.device_scalars == nullptr, "gemm (cpu): alpha and beta in device memory are for CUDA products");
  if (g.batch == 0 || g.m == 0 || g.n == 0) return;
  // The blocked float32 kernel adds the bias as it writes C; the others start from C's rows set to it.
  if (g.bias && !(g.ab_dtype == kFloat32 && g.k > 0 && gemm_blocked::suits(g))) {
    const size_t row_bytes = size_t(g.n) * element_size(g.c_dtype);
#pragma omp parallel for collapse(2) if (g.batch * g.m * g.n > (1 << 16))
    for (int64_t b = 0; b < g.batch; ++b)
      for (int64_t r = 0; r < g.m; ++r)
        std::memcpy(static_cast<char*>(g.c) + (b * g.stride_c + r * g.ldc) * element_size(g.c_dtype), g.bias,
                    row_bytes);
    gemm_cpu(start_from_bias(g));
    return;
  }
  dispatch_numeric(g.ab_dtype, "matmul", [&]<typename T>() {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
      gemm_eigen<T>(g);
    } else if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
      gemm_half<T>(g);
    } else {
      gemm_loop<T>(g);
    }
  });
}

}  // namespace

HG_REGISTER_KERNEL(gemm_kernel, CPU, gemm_cpu);

}  // namespace halfgrad

// gather, scatter, scatter_add: the public ops with their backward next to them, and the CPU kernel.
#include "ops/gather.h"

#include <algorithm>
#include <cstring>
#include <string_view>

#include "core/autocast.h"
#include "core/autograd.h"
#include "ops/copy.h"
#include "ops/elementwise_math.h"
#include "ops/inplace.h"
#include "ops/loops.h"
#include "ops/shape.h"

namespace halfgrad {

constinit KernelTable<IndexedKernel> indexed_kernel("indexed");

const char* indexed_op_name(IndexedOp op) {
  switch (op) {
    case IndexedOp::Gather: return "gather";
    case IndexedOp::Scatter: return "scatter";
    case IndexedOp::ScatterAdd: return "scatter_add";
  }
  return "an indexed op";
}

namespace {

// A 0-d tensor as one dim of 1: the kernels' operands have dims.
Tensor with_dims(const Tensor& t) { return t.dim() == 0 ? t.view({1}) : t; }

// PyTorch's checks of the operands, shared by the ops: devices, src (the scatters') of target's dtype, and for an index
// with elements (PyTorch checks nothing more of an empty one) its dtype, its number of dims, and its sizes: no larger
// than src's anywhere and than target's (x's, or self's) but along dim. Returns dim wrapped.
int64_t check_operands(const char* op, const Tensor& target, int64_t dim, const Tensor& index, const Tensor* src) {
  const char* target_name = std::string_view(op) == "gather" ? "input" : "self";
  HG_CHECK(target.defined() && index.defined() && (!src || src->defined()),
           "{}: got an undefined tensor ({} {}, index {}{}{})", op, target_name, target.meta(), index.meta(),
           src ? ", src " : "", src ? src->meta() : "");
  HG_CHECK(index.device() == target.device(), "{}: {} {} and index {} are on different devices", op, target_name,
           target.meta(), index.meta());
  const int64_t ndim = std::max<int64_t>(target.dim(), 1);
  const int64_t d = wrap_dim(dim, ndim, op);
  if (src) {
    HG_CHECK(src->device() == target.device(), "{}: self {} and src {} are on different devices", op, target.meta(),
             src->meta());
    HG_CHECK(src->dtype() == target.dtype(), "{}: src {} must have the dtype of self {}", op, src->meta(),
             target.meta());
  }
  if (index.numel() == 0) return d;
  HG_CHECK(index.dtype() == kInt64 || index.dtype() == kInt32, "{}: expected an int64 or int32 index, got {}", op,
           index.meta());
  HG_CHECK(std::max<int64_t>(index.dim(), 1) == ndim, "{}: index {} must have as many dims as {} {}", op,
           index.meta(), target_name, target.meta());
  const Tensor t = with_dims(target), i = with_dims(index);
  for (int64_t k = 0; k < ndim; ++k) {
    HG_CHECK(k == d || i.size(k) <= t.size(k), "{}: index {} is larger than {} {} in dim {}; only dim {} may be "
             "larger", op, index.meta(), target_name, target.meta(), k, d);
  }
  if (src) {
    HG_CHECK(std::max<int64_t>(src->dim(), 1) == ndim, "{}: src {} must have as many dims as self {}", op,
             src->meta(), target.meta());
    const Tensor s = with_dims(*src);
    for (int64_t k = 0; k < ndim; ++k) {
      HG_CHECK(i.size(k) <= s.size(k), "{}: index {} is larger than src {} in dim {}", op, index.meta(), src->meta(),
               k);
    }
  }
  return d;
}

// On the CPU, before a kernel writes anything: every value of index in [0, size of dim of target), or an error naming
// the op, the first value that is not and its position. (On CUDA the kernel asserts it.)
void check_index_values(const char* op, const Tensor& index, int64_t dim, const Tensor& target) {
  if (!index.is_cpu() || index.numel() == 0) return;
  const int64_t size = with_dims(target).size(dim);
  const Tensor dense = with_dims(index).contiguous();
  const int64_t* values = dense.data<int64_t>();
  for (int64_t k = 0; k < dense.numel(); ++k) {
    if (values[k] >= 0 && values[k] < size) continue;
    Shape position(size_t(dense.dim()));
    for (int64_t d = dense.dim() - 1, rest = k; d >= 0; rest /= dense.size(d), --d) {
      position[size_t(d)] = rest % dense.size(d);
    }
    HG_FAIL("{}: index {} at position {} is out of range for dim {} of size {} of {}; indices must be in [0, {})", op,
            values[k], shape_str(position), dim, size, target.meta(), size);
  }
}

// The operands checked (check_operands, then on the CPU every index value against target's dim), as the kernels take
// them: dim wrapped, and the index as int64 (an int32 one converted; an empty one of any dtype, which nothing reads).
struct CheckedOperands {
  int64_t dim;
  Tensor positions;
};
CheckedOperands check_all(const char* op, const Tensor& target, int64_t dim, const Tensor& index, const Tensor* src) {
  const int64_t d = check_operands(op, target, dim, index, src);
  Tensor positions = index.dtype() == kInt64 ? index.detach() : cast_nograd(index.detach(), kInt64);
  check_index_values(op, positions, d, target);
  return {d, std::move(positions)};
}

// src's part that index covers (src narrowed to index's shape): what the kernel reads.
Tensor covered(const Tensor& src, const Tensor& index) {
  Tensor part = with_dims(src);
  const Tensor i = with_dims(index);
  for (int64_t k = 0; k < i.dim(); ++k) part = part.narrow(k, 0, i.size(k));
  return part;
}

// value in dtype as a tensor of index's shape on `device` (one element, expanded): the src of scatter(value).
Tensor value_operand(const Scalar& value, DType dtype, Device device, const Tensor& index) {
  return full({}, value, {.dtype = dtype, .device = device}).expand(with_dims(index).shape());
}

// self with src's part that index covers written or added at the q's: the scatters' forward, outside autograd.
Tensor scattered(IndexedOp op, const Tensor& self, int64_t dim, const Tensor& index, const Tensor& src) {
  Tensor out = self.detach().clone();
  if (index.numel() > 0) indexed_kernel[out.device()](op, with_dims(out), dim, with_dims(index), covered(src, index));
  return out;
}

// The gradient of scatter's self: out's gradient but 0 at the q's that src (or the value) overwrote. In a pass with
// create_graph by scatter itself, which records (this is its own backward).
Tensor zero_where_written(const Tensor& grad, int64_t dim, const Tensor& index) {
  if (GradMode::is_enabled()) return scatter(grad, dim, index, 0.0);
  return scattered(IndexedOp::Scatter, grad, dim, index, value_operand(0, grad.dtype(), grad.device(), index));
}

// The gradient of the scatters' src: out's gradient at each q (gather), zero where src lies outside index's shape; in
// ops that record.
Tensor src_gradient(const Tensor& grad, int64_t dim, const Tensor& index, const Shape& src_shape) {
  if (index.numel() == 0) return zeros(src_shape, {.dtype = grad.dtype(), .device = grad.device()});
  const Tensor picked = gather(grad, dim, index);
  if (picked.shape() == src_shape) return picked;
  Tensor whole = zeros(src_shape, {.dtype = picked.dtype(), .device = picked.device()});
  covered(whole, index).copy_(with_dims(picked));
  return whole;
}

void check_addable(const char* op, const Tensor& self) {
  HG_CHECK(self.dtype() != kBool, "{}: bool tensors are not added; got {}", op, self.meta());
}

// self.scatter_(...) and self.scatter_add_(...): the kernel writes into self when nothing records and neither src nor
// index shares self's memory (the kernel would read what it has written); otherwise the out-of-place op, through
// apply_in_place.
template <typename OutOfPlace>
Tensor& scatter_in_place(Tensor& self, IndexedOp op, const char* name, int64_t dim, const Tensor& index,
                         const Tensor& src, OutOfPlace out_of_place) {
  const auto [d, positions] = check_all(name, self, dim, index, &src);
  if (op == IndexedOp::ScatterAdd) check_addable(name, self);
  const bool graph = GradMode::is_enabled() && (self.requires_grad() || src.requires_grad());
  if (graph || src.storage() == self.storage() || index.storage() == self.storage()) {
    return apply_in_place(self, name, {src}, out_of_place);
  }
  check_inplace(self, name, /*records=*/false);  // after the checks: a refused write bumps no version
  if (index.numel() > 0) {
    indexed_kernel[self.device()](op, with_dims(self), d, with_dims(positions), covered(src, positions));
  }
  return self;
}

void check_value(const char* op, const Scalar& value, const Tensor& self) {
  HG_CHECK(fits_dtype(value, self.dtype()), "{}: {} cannot be converted to {} without overflow", op, value.str(),
           self.meta());
}

}  // namespace

Tensor gather(const Tensor& x, int64_t dim, const Tensor& index) {
  HG_AUTOCAST(gather, x, dim, index);
  const auto [d, positions] = check_all("gather", x, dim, index, nullptr);
  Tensor out = empty(index.shape(), {.dtype = x.dtype(), .device = x.device()});
  if (out.numel() > 0) {
    indexed_kernel[x.device()](IndexedOp::Gather, with_dims(x.detach()), d, with_dims(positions), with_dims(out));
  }
  // backward: each out[p]'s gradient added at q, in float32 for float16/bfloat16 (the engine casts the sum to x's
  // dtype), as index_select's; in a pass with create_graph by scatter_add, which records (its backward is gather).
  record("GatherBackward", {x}, {out},
         [saved_index = SavedTensor(positions, "gather"), d, shape = x.shape()](const GradContext& g) -> TensorList {
           const Tensor idx = saved_index.get();
           Tensor sums = zeros(shape, {.dtype = accumulation_dtype(g[0].dtype()), .device = g[0].device()});
           if (GradMode::is_enabled()) return {scatter_add(sums, d, idx, g[0].to(sums.dtype()))};
           if (idx.numel() > 0) {
             indexed_kernel[sums.device()](IndexedOp::ScatterAdd, with_dims(sums), d, with_dims(idx),
                                           with_dims(cast_nograd(g[0], sums.dtype())));
           }
           return {sums};
         }, DoubleBackward::Supported);
  return out;
}

Tensor scatter(const Tensor& self, int64_t dim, const Tensor& index, const Tensor& src) {
  HG_AUTOCAST(scatter, self, dim, index, src);
  const auto [d, positions] = check_all("scatter", self, dim, index, &src);
  Tensor out = scattered(IndexedOp::Scatter, self, d, positions, src.detach());
  // backward: out's gradient, but 0 at the q's written, for self; out's gradient at q for src[p].
  record("ScatterBackward", {self, src}, {out},
         [saved_index = SavedTensor(positions, "scatter"), d, src_shape = src.shape()](const GradContext& g)
             -> TensorList {
           const Tensor& idx = saved_index.get();
           return {g.needs(0) ? zero_where_written(g[0], d, idx) : Tensor(),
                   g.needs(1) ? src_gradient(g[0], d, idx, src_shape) : Tensor()};
         }, DoubleBackward::Supported);
  return out;
}

Tensor scatter(const Tensor& self, int64_t dim, const Tensor& index, const Scalar& value) {
  HG_AUTOCAST(scatter, self, dim, index, value);
  const auto [d, positions] = check_all("scatter", self, dim, index, nullptr);
  check_value("scatter", value, self);
  Tensor out = scattered(IndexedOp::Scatter, self, d, positions, value_operand(value, self.dtype(), self.device(),
                                                                               positions));
  record("ScatterBackward", {self}, {out},
         [saved_index = SavedTensor(positions, "scatter"), d](const GradContext& g) -> TensorList {
           return {zero_where_written(g[0], d, saved_index.get())};
         }, DoubleBackward::Supported);
  return out;
}

Tensor scatter_add(const Tensor& self, int64_t dim, const Tensor& index, const Tensor& src) {
  HG_AUTOCAST(scatter_add, self, dim, index, src);
  const auto [d, positions] = check_all("scatter_add", self, dim, index, &src);
  check_addable("scatter_add", self);
  Tensor out = scattered(IndexedOp::ScatterAdd, self, d, positions, src.detach());
  // backward: out's gradient for self as it is; out's gradient at q for src[p].
  record("ScatterAddBackward", {self, src}, {out},
         [saved_index = SavedTensor(positions, "scatter_add"), d, src_shape = src.shape()](const GradContext& g)
             -> TensorList {
           return {g.needs(0) ? g[0] : Tensor(),
                   g.needs(1) ? src_gradient(g[0], d, saved_index.get(), src_shape) : Tensor()};
         }, DoubleBackward::Supported);
  return out;
}

Tensor Tensor::gather(int64_t dim, const Tensor& index) const { return halfgrad::gather(*this, dim, index); }
Tensor Tensor::scatter(int64_t dim, const Tensor& index, const Tensor& src) const {
  return halfgrad::scatter(*this, dim, index, src);
}
Tensor Tensor::scatter(int64_t dim, const Tensor& index, const Scalar& value) const {
  return halfgrad::scatter(*this, dim, index, value);
}
Tensor Tensor::scatter_add(int64_t dim, const Tensor& index, const Tensor& src) const {
  return halfgrad::scatter_add(*this, dim, index, src);
}

Tensor& Tensor::scatter_(int64_t dim, const Tensor& index, const Tensor& src) {
  return scatter_in_place(*this, IndexedOp::Scatter, "scatter_", dim, index, src,
                          [&](const Tensor& s) { return halfgrad::scatter(s, dim, index, src); });
}
Tensor& Tensor::scatter_(int64_t dim, const Tensor& index, const Scalar& value) {
  HG_CHECK(defined() && index.defined(), "scatter_: got an undefined tensor (self {}, index {})", meta(), index.meta());
  check_value("scatter_", value, *this);
  return scatter_in_place(*this, IndexedOp::Scatter, "scatter_", dim, index,
                          value_operand(value, dtype(), device(), index),
                          [&](const Tensor& s) { return halfgrad::scatter(s, dim, index, value); });
}
Tensor& Tensor::scatter_add_(int64_t dim, const Tensor& index, const Tensor& src) {
  return scatter_in_place(*this, IndexedOp::ScatterAdd, "scatter_add_", dim, index, src,
                          [&](const Tensor& s) { return halfgrad::scatter_add(s, dim, index, src); });
}

// ---- CPU kernel
namespace {

// The loop of the scatters: apply(dense[p], indexed[q]) for every position p of index's shape. The positions with
// dim's coordinate 0 are split among threads, each walking its positions' run along dim in order (so no two threads
// write one indexed[q], and scatter_add's sums run in p's order).
template <typename T, typename Apply>
void each_position(const Tensor& indexed, int64_t dim, const Tensor& index, const Tensor& dense, Apply apply) {
  const int64_t length = index.size(dim);
  Shape starts = index.shape();
  starts[size_t(dim)] = 1;
  auto at_starts = [&](const Tensor& t) { return make_view(t, starts, t.strides(), t.offset()); };
  const cpu::StridedLoop<3> loop({at_starts(dense), at_starts(indexed), at_starts(index)});
  const int64_t dense_step = dense.stride(dim) * int64_t(sizeof(T));
  const int64_t indexed_step = indexed.stride(dim) * int64_t(sizeof(T));
  const int64_t index_step = index.stride(dim) * int64_t(sizeof(int64_t));
  loop.run(
      [&](const std::array<char*, 3>& p, const std::array<int64_t, 3>& s, int64_t n) {
        for (int64_t e = 0; e < n; ++e) {
          char* dense_run = p[0] + e * s[0];
          char* indexed_start = p[1] + e * s[1];
          const char* index_run = p[2] + e * s[2];
          for (int64_t k = 0; k < length; ++k) {
            const int64_t q = *reinterpret_cast<const int64_t*>(index_run + k * index_step);
            apply(*reinterpret_cast<T*>(dense_run + k * dense_step),
                  *reinterpret_cast<T*>(indexed_start + q * indexed_step));
          }
        }
      },
      std::max<int64_t>(1, 32768 / std::max<int64_t>(length, 1)));
}

// Gather, which writes each dense[p] once: every position on its own, split among threads in dense's order (so a
// thread reads the rows of indexed along the dims after dim in order, and few runs along dim still use every thread).
// indexed is read through a view of index's shape with dim's stride 0 (indexed[p with dim's coordinate 0]), plus q
// strides along dim.
template <typename T>
void gather_positions(const Tensor& indexed, int64_t dim, const Tensor& index, const Tensor& dense) {
  Shape strides = indexed.strides();
  strides[size_t(dim)] = 0;
  const cpu::StridedLoop<3> loop({dense, make_view(indexed, index.shape(), strides, indexed.offset()), index});
  const int64_t step = indexed.stride(dim) * int64_t(sizeof(T));
  constexpr int64_t size = int64_t(sizeof(T));
  loop.run([&](const std::array<char*, 3>& p, const std::array<int64_t, 3>& s, int64_t n) {
    if (s[2] == 0 && s[0] == size && s[1] == size) {  // one index for a contiguous run (index_select's rows)
      std::memcpy(p[0], p[1] + *reinterpret_cast<const int64_t*>(p[2]) * step, size_t(n * size));
      return;
    }
    for (int64_t e = 0; e < n; ++e) {
      const int64_t q = *reinterpret_cast<const int64_t*>(p[2] + e * s[2]);
      *reinterpret_cast<T*>(p[0] + e * s[0]) = *reinterpret_cast<const T*>(p[1] + e * s[1] + q * step);
    }
  });
}

void indexed_cpu(IndexedOp op, const Tensor& indexed, int64_t dim, const Tensor& index, const Tensor& dense) {
  if (index.numel() == 0) return;
  const char* name = indexed_op_name(op);
  switch (op) {
    case IndexedOp::Gather:
      dispatch_all(dense.dtype(), name, [&]<typename T>() { gather_positions<T>(indexed, dim, index, dense); });
      return;
    case IndexedOp::Scatter:
      dispatch_all(dense.dtype(), name, [&]<typename T>() {
        each_position<T>(indexed, dim, index, dense, [](const T& src, T& out) { out = src; });
      });
      return;
    case IndexedOp::ScatterAdd:
      dispatch_numeric(dense.dtype(), name, [&]<typename T>() {
        each_position<T>(indexed, dim, index, dense, [](const T& src, T& out) {
          using A = opmath_t<T>;
          out = T(binary_math<BinaryOp::Add>(A(out), A(src)));  // integers wrap, as PyTorch's
        });
      });
      return;
  }
}

}  // namespace

HG_REGISTER_KERNEL(indexed_kernel, CPU, indexed_cpu);

}  // namespace halfgrad

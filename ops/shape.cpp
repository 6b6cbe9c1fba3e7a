// View ops: new shape and strides over the same storage, and their backward formulas.
#include "ops/shape.h"

#include <algorithm>
#include <numeric>
#include <optional>

#include "core/autocast.h"
#include "core/autograd.h"
#include "ops/copy.h"
#include "ops/stack.h"

namespace halfgrad {

Tensor make_view(const Tensor& t, Shape shape, Shape strides, int64_t offset) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = t.storage();
  impl->shape = std::move(shape);
  impl->strides = std::move(strides);
  impl->offset = offset;
  impl->dtype = t.dtype();
  impl->is_view = true;
  const TensorImpl& source = *t.impl();
  impl->view_base = source.view_base ? source.view_base : t.impl_ptr();  // detach()'s alias is a base of its own
  impl->history_seen = impl->storage->history_version();
  return Tensor(std::move(impl));
}

Tensor broadcast_view(const Tensor& t, const Shape& shape, const char* op) {
  if (t.shape() == shape) return t;
  // The one view that can hold more elements than t: one whose count overflows is refused here.
  HG_CHECK(checked_numel(shape).has_value(), "{}: cannot broadcast {} to {}, which has more elements than an int64 "
           "counts", op, t.meta(), shape_str(shape));
  HG_CHECK(t.dim() <= int64_t(shape.size()), "{}: cannot broadcast {} to {}", op, t.meta(), shape_str(shape));
  Shape strides(shape.size(), 0);
  int64_t lead = int64_t(shape.size()) - t.dim();
  for (int64_t d = 0; d < t.dim(); ++d) {
    int64_t size = t.shape()[d];
    HG_CHECK(size == shape[d + lead] || size == 1, "{}: cannot broadcast {} to {}", op, t.meta(), shape_str(shape));
    strides[d + lead] = size == 1 ? 0 : t.strides()[d];
  }
  return make_view(t, shape, strides, t.offset());
}

std::optional<MemoryFormat> storage_format(const Tensor& t) {
  if (t.is_contiguous()) return MemoryFormat::Contiguous;
  if (is_channels_last(t)) return MemoryFormat::ChannelsLast;
  if (is_aligned_rows(t)) return MemoryFormat::AlignedRows;
  return std::nullopt;
}

Tensor flat_storage_view(const Tensor& t) {
  const std::optional<MemoryFormat> format = storage_format(t);
  HG_CHECK(format.has_value(), "flat_storage_view: {} is laid out in no memory format", t.meta());
  const int64_t n = *format == MemoryFormat::AlignedRows
                        ? aligned_row_extent(t.size(0), t.dtype()) * aligned_row_extent(t.size(1), t.dtype())
                        : t.numel();
  return make_view(t, {n}, {1}, t.offset());
}

namespace {

// A view op: the view, plus (when the input is in the graph) a node with the given backward, which every view op writes
// with ops that record (DoubleBackward::Supported).
Tensor view_op(const char* name, const Tensor& x, Shape shape, Shape strides, int64_t offset,
               std::function<Tensor(const Tensor&)> backward) {
  Tensor out = make_view(x, std::move(shape), std::move(strides), offset);
  if (any_requires_grad({&x})) {
    record(backward_name(name), {x}, {out}, [backward](const GradContext& g) -> TensorList { return {backward(g[0])}; },
           DoubleBackward::Supported);
  }
  return out;
}

// A new view of all of x: what squeeze of no dim of size 1, t() of a vector and transpose of a 0-d tensor give, as in
// PyTorch. Not x itself: requires_grad_, hooks or retain_grad set on the result would be set on x.
Tensor alias_view(const char* name, const Tensor& x) {
  return view_op(name, x, x.shape(), x.strides(), x.offset(), [](const Tensor& g) { return g; });
}

Shape infer_shape(Shape shape, int64_t numel, const char* op) {
  int64_t known = 1, infer_at = -1;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == -1) {
      HG_CHECK(infer_at < 0, "{}: only one dimension can be -1, got {}", op, shape_str(shape));
      infer_at = int64_t(d);
    } else {
      HG_CHECK(shape[d] >= 0, "{}: invalid size {} in shape {}", op, shape[d], shape_str(shape));
      // A product past int64 cannot be the input's size (it wrapped to -2 for [-1, 2^63 - 1, 2], inferring -3).
      HG_CHECK(!__builtin_mul_overflow(known, shape[d], &known), "{}: shape {} is invalid for input of size {}", op,
               shape_str(shape), numel);
    }
  }
  if (infer_at >= 0) {
    HG_CHECK(known != 0 && numel % known == 0, "{}: shape {} is invalid for input of size {}", op, shape_str(shape), numel);
    shape[size_t(infer_at)] = numel / known;
  } else {
    HG_CHECK(known == numel, "{}: shape {} is invalid for input of size {}", op, shape_str(shape), numel);
  }
  return shape;
}

// Strides that let `shape` view memory laid out as (old_shape, old_strides), if any (PyTorch's rule: each
// group of new dims must cover a run of old dims that is contiguous in memory).
std::optional<Shape> view_strides(const Shape& old_shape, const Shape& old_strides, const Shape& shape) {
  Shape strides(shape.size());
  if (old_shape.empty() || numel_of(old_shape) == 0) return contiguous_strides(shape);
  int64_t view_d = int64_t(shape.size()) - 1;
  int64_t chunk_base_stride = old_strides.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t d = int64_t(old_shape.size()) - 1; d >= 0; --d) {
    tensor_numel *= old_shape[d];
    bool chunk_ends = d == 0 || (old_shape[d - 1] != 1 && old_strides[d - 1] != tensor_numel * chunk_base_stride);
    if (!chunk_ends) continue;
    while (view_d >= 0 && (view_numel < tensor_numel || shape[view_d] == 1)) {
      strides[view_d] = view_numel * chunk_base_stride;
      view_numel *= shape[view_d];
      --view_d;
    }
    if (view_numel != tensor_numel) return std::nullopt;
    if (d > 0) {
      chunk_base_stride = old_strides[d - 1];
      tensor_numel = 1;
      view_numel = 1;
    }
  }
  if (view_d != -1) return std::nullopt;
  return strides;
}

}  // namespace

Tensor Tensor::view(Shape new_shape) const {
  new_shape = infer_shape(std::move(new_shape), numel(), "view");
  auto strides = view_strides(shape(), this->strides(), new_shape);
  HG_CHECK(strides.has_value(), "view: shape {} cannot view {} with strides {} without a copy; use reshape()",
           shape_str(new_shape), meta(), shape_str(this->strides()));
  Shape old = shape();
  return view_op("view", *this, new_shape, *strides, offset(), [old](const Tensor& g) { return g.reshape(old); });
}

Tensor Tensor::reshape(Shape new_shape) const {
  new_shape = infer_shape(std::move(new_shape), numel(), "reshape");
  if (view_strides(shape(), strides(), new_shape)) return view(new_shape);
  return contiguous().view(new_shape);  // as PyTorch: a row-major copy, whatever the layout (clone keeps channels_last)
}

Tensor Tensor::permute(Dims dims) const {
  HG_CHECK(int64_t(dims.size()) == dim(), "permute: {} dims given for {}", dims.size(), meta());
  Shape new_shape(dims.size()), new_strides(dims.size());
  Dims inverse(dims.size());
  std::vector<bool> seen(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) {
    int64_t d = wrap_dim(dims[i], dim(), "permute");
    HG_CHECK(!seen[size_t(d)], "permute: dim {} repeated in {}", d, shape_str(dims));
    seen[size_t(d)] = true;
    new_shape[i] = shape()[size_t(d)];
    new_strides[i] = strides()[size_t(d)];
    inverse[size_t(d)] = int64_t(i);
  }
  return view_op("permute", *this, new_shape, new_strides, offset(),
                 [inverse](const Tensor& g) { return g.permute(inverse); });
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  d0 = wrap_dim(d0, dim(), "transpose");
  d1 = wrap_dim(d1, dim(), "transpose");
  if (dim() == 0) return alias_view("transpose", *this);
  Dims order(static_cast<size_t>(dim()));
  std::iota(order.begin(), order.end(), 0);
  std::swap(order[size_t(d0)], order[size_t(d1)]);
  return permute(order);
}

Tensor Tensor::t() const {
  HG_CHECK(dim() <= 2, "t: expects a tensor with <= 2 dims, got {}", meta());
  return dim() < 2 ? alias_view("t", *this) : transpose(0, 1);
}

Tensor Tensor::slice(int64_t d, int64_t start, int64_t end, int64_t step) const {
  d = wrap_existing_dim(d, dim(), "slice");
  HG_CHECK(step > 0, "slice: step must be positive, got {}", step);
  int64_t size = shape()[size_t(d)];
  // Clamped to [0, size] before any arithmetic: an index near INT64_MIN/MAX must not wrap.
  auto clip = [size](int64_t i) { return i < 0 ? std::max<int64_t>(i, -size) + size : std::min(i, size); };
  start = clip(start);
  end = std::max(start, clip(end));
  Shape new_shape = shape(), new_strides = strides();
  new_shape[size_t(d)] = end == start ? 0 : (end - start - 1) / step + 1;  // no overflow for a step near INT64_MAX
  // A dim of one element or none keeps its stride: a huge step would overflow the product, which nothing reads.
  if (new_shape[size_t(d)] > 1) new_strides[size_t(d)] *= step;
  Shape full = shape();
  return view_op("slice", *this, new_shape, new_strides, offset() + start * strides()[size_t(d)],
                 [full, d, start, end, step](const Tensor& g) {
                   Tensor r = zeros(full, {.dtype = g.dtype(), .device = g.device()});
                   r.slice(d, start, end, step).copy_(g);
                   return r;
                 });
}

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  d = wrap_existing_dim(d, dim(), "narrow");
  int64_t size = shape()[size_t(d)];
  if (start < 0 && start >= -size) start += size;
  // length > size - start, not start + length > size: the sum may overflow
  HG_CHECK(start >= 0 && start <= size && length >= 0 && length <= size - start, "narrow: start {} and length {} are "
           "outside dim {} of {}", start, length, d, meta());
  return slice(d, start, start + length);
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  d = wrap_existing_dim(d, dim(), "select");
  int64_t size = shape()[size_t(d)];
  HG_CHECK(index >= -size && index < size, "select: index {} is out of range for dim {} of {}", index, d, meta());
  if (index < 0) index += size;
  Shape new_shape = shape(), new_strides = strides();
  new_shape.erase(new_shape.begin() + d);
  new_strides.erase(new_strides.begin() + d);
  Shape full = shape();
  return view_op("select", *this, new_shape, new_strides, offset() + index * strides()[size_t(d)],
                 [full, d, index](const Tensor& g) {
                   Tensor r = zeros(full, {.dtype = g.dtype(), .device = g.device()});
                   r.select(d, index).copy_(g);
                   return r;
                 });
}

namespace {

// Views of x along d: consecutive ranges of the given sizes (split, split_with_sizes, chunk), or each index (unbind,
// `ranges` false); `name` names their node. One node for all of them, whose backward joins their gradients (cat, or
// stack for unbind; the engine gives a piece without one zeros): one pass, where a node per piece (narrow's) would
// each write a zeros tensor of x's whole size.
std::vector<Tensor> pieces_along(const char* name, const Tensor& x, int64_t d, const std::vector<int64_t>& sizes,
                                 bool ranges) {
  std::vector<Tensor> pieces;
  int64_t start = 0;
  for (int64_t size : sizes) {
    Shape shape = x.shape(), strides = x.strides();
    if (ranges) {
      shape[size_t(d)] = size;
    } else {
      shape.erase(shape.begin() + d);
      strides.erase(strides.begin() + d);
    }
    pieces.push_back(make_view(x, shape, strides, x.offset() + start * x.stride(d)));
    start += ranges ? size : 1;
  }
  record(backward_name(name), {x}, pieces, [d, ranges, n = pieces.size()](const GradContext& g) -> TensorList {
    TensorList grads;
    for (size_t i = 0; i < n; ++i) grads.push_back(g[i]);
    return {ranges ? cat(grads, d) : stack(grads, d)};
  }, DoubleBackward::Supported);
  return pieces;
}

}  // namespace

std::vector<Tensor> Tensor::split_with_sizes(const std::vector<int64_t>& sizes, int64_t d) const {
  d = wrap_existing_dim(d, dim(), "split_with_sizes");
  int64_t total = 0;
  for (int64_t size : sizes) {
    HG_CHECK(size >= 0 && !__builtin_add_overflow(total, size, &total),
             "split_with_sizes: sizes {} hold a negative size or overflow, for dim {} of {}", shape_str(sizes), d,
             meta());
  }
  HG_CHECK(total == size(d), "split_with_sizes: sizes {} add up to {}, but dim {} of {} has size {}", shape_str(sizes),
           total, d, meta(), size(d));
  return pieces_along("split_with_sizes", *this, d, sizes, /*ranges=*/true);
}

std::vector<Tensor> Tensor::split(int64_t split_size, int64_t d) const {
  d = wrap_existing_dim(d, dim(), "split");
  const int64_t n = size(d);
  HG_CHECK(split_size > 0 || (split_size == 0 && n == 0),
           "split: split_size must be positive (0 only for a dim of size 0), got {} for dim {} of {}", split_size, d,
           meta());
  std::vector<int64_t> sizes;
  for (int64_t start = 0; start < n; start += sizes.back()) sizes.push_back(std::min(split_size, n - start));
  if (sizes.empty()) sizes.push_back(0);  // a dim of size 0: one empty piece, as PyTorch's
  return pieces_along("split", *this, d, sizes, /*ranges=*/true);
}

std::vector<Tensor> Tensor::chunk(int64_t chunks, int64_t d) const {
  d = wrap_existing_dim(d, dim(), "chunk");
  HG_CHECK(chunks > 0, "chunk: chunks must be positive, got {} for {}", chunks, meta());
  const int64_t n = size(d);
  // (the node is "SplitBackward", as PyTorch's chunk, which splits)
  if (n == 0) return pieces_along("split", *this, d, std::vector<int64_t>(size_t(chunks), 0), /*ranges=*/true);
  const int64_t piece = n / chunks + (n % chunks != 0);  // ceil(n / chunks) without overflow
  std::vector<int64_t> sizes;
  for (int64_t start = 0; start < n; start += sizes.back()) sizes.push_back(std::min(piece, n - start));
  return pieces_along("split", *this, d, sizes, /*ranges=*/true);
}

std::vector<Tensor> Tensor::unbind(int64_t d) const {
  d = wrap_existing_dim(d, dim(), "unbind");
  return pieces_along("unbind", *this, d, std::vector<int64_t>(size_t(size(d)), 1), /*ranges=*/false);
}

Tensor Tensor::expand(Shape new_shape) const {
  HG_CHECK(int64_t(new_shape.size()) >= dim(), "expand: the target {} has fewer dims than {}", shape_str(new_shape), meta());
  int64_t lead = int64_t(new_shape.size()) - dim();
  for (int64_t d = 0; d < dim(); ++d)
    if (new_shape[size_t(d + lead)] == -1) new_shape[size_t(d + lead)] = shape()[size_t(d)];
  for (int64_t s : new_shape) {
    HG_CHECK(s >= 0, "expand: the target {} of {} has a negative size (-1 keeps an existing dim's size, and a new "
             "leading dim has none to keep)", shape_str(new_shape), meta());
  }
  Tensor v = broadcast_view(*this, new_shape, "expand");
  Shape old = shape();
  return view_op("expand", *this, v.shape(), v.strides(), v.offset(), [old](const Tensor& g) { return sum_to(g, old); });
}

Tensor Tensor::squeeze() const {
  Shape new_shape;
  for (int64_t s : shape())
    if (s != 1) new_shape.push_back(s);
  return new_shape.size() == shape().size() ? alias_view("squeeze", *this) : reshape(new_shape);
}

Tensor Tensor::squeeze(int64_t d) const {
  d = wrap_dim(d, dim(), "squeeze");
  if (dim() == 0 || shape()[size_t(d)] != 1) return alias_view("squeeze", *this);
  Shape new_shape = shape();
  new_shape.erase(new_shape.begin() + d);
  return reshape(new_shape);
}

Tensor Tensor::unsqueeze(int64_t d) const {
  d = wrap_dim(d, dim() + 1, "unsqueeze");
  Shape new_shape = shape(), new_strides = strides();
  int64_t stride = d < dim() ? strides()[size_t(d)] * shape()[size_t(d)] : 1;
  new_shape.insert(new_shape.begin() + d, 1);
  new_strides.insert(new_strides.begin() + d, stride);
  return view_op("unsqueeze", *this, new_shape, new_strides, offset(), [d](const Tensor& g) { return g.squeeze(d); });
}

Tensor Tensor::flatten(int64_t start_dim, int64_t end_dim) const {
  start_dim = wrap_dim(start_dim, dim(), "flatten");
  end_dim = wrap_dim(end_dim, dim(), "flatten");
  if (dim() == 0) return reshape({1});
  HG_CHECK(start_dim <= end_dim, "flatten: start_dim {} is after end_dim {}", start_dim, end_dim);
  Shape new_shape(shape().begin(), shape().begin() + start_dim);
  int64_t merged = 1;
  for (int64_t d = start_dim; d <= end_dim; ++d) merged *= shape()[size_t(d)];
  new_shape.push_back(merged);
  new_shape.insert(new_shape.end(), shape().begin() + end_dim + 1, shape().end());
  return reshape(new_shape);
}

// Autocast category: "promote" (inputs are cast to the widest dtype among them).
Tensor cat(const TensorList& tensors, int64_t dim) {
  HG_AUTOCAST(cat, tensors, dim);
  HG_CHECK(!tensors.empty(), "cat: expects a non-empty list of tensors");
  for (size_t i = 0; i < tensors.size(); ++i) {
    HG_CHECK(tensors[i].defined(), "cat: the tensor at position {} is undefined", i);
    HG_CHECK(tensors[i].dim() > 0, "cat: the tensor at position {} ({}) cannot be concatenated: it has no dims "
             "(stack() makes a new dim; unsqueeze(0) gives it one)", i, tensors[i].meta());
  }
  // As PyTorch, an empty tensor of shape [0] (a list grown from empty({0})) joins any shape: it counts in the dtype
  // only. The others decide the shape; where all are such, the result is one too.
  auto legacy_empty = [](const Tensor& t) { return t.dim() == 1 && t.numel() == 0; };
  const Tensor* shaped = &tensors[0];
  for (const Tensor& t : tensors)
    if (!legacy_empty(t)) {
      shaped = &t;
      break;
    }
  const Tensor& first = *shaped;
  dim = legacy_empty(first) ? 0 : wrap_dim(dim, first.dim(), "cat");  // (only [0]s: any dim, as PyTorch's)
  DType dtype = first.dtype();
  Shape shape = first.shape();
  shape[size_t(dim)] = 0;
  for (const Tensor& t : tensors) {
    HG_CHECK(t.device() == first.device(), "cat: {} does not match {}", t.meta(), first.meta());
    dtype = promote_types(dtype, t.dtype());
    if (legacy_empty(t) && &t != &first) continue;
    HG_CHECK(t.dim() == first.dim(), "cat: {} does not match {}", t.meta(), first.meta());
    for (int64_t d = 0; d < t.dim(); ++d)
      HG_CHECK(d == dim || t.shape()[size_t(d)] == first.shape()[size_t(d)],
               "cat: sizes must match except in dim {}: {} vs {}", dim, t.meta(), first.meta());
    shape[size_t(dim)] += t.shape()[size_t(dim)];
  }
  // The inputs' layout where they share one (channels_last activations stay so), else contiguous, as PyTorch's
  // cat_compute_output_memory_format; a legacy [0] counts as contiguous.
  const bool channels_last = std::all_of(tensors.begin(), tensors.end(), [](const Tensor& t) {
    return suggest_memory_format(t) == MemoryFormat::ChannelsLast;
  });
  Tensor out = empty(shape, {.dtype = dtype, .device = first.device()},
                     channels_last ? MemoryFormat::ChannelsLast : MemoryFormat::Contiguous);
  std::vector<int64_t> sizes;  // along dim; -1 for a legacy empty input, whose gradient is its own [0]
  {
    NoGradGuard no_grad;
    int64_t at = 0;
    for (const Tensor& t : tensors) {
      if (legacy_empty(t) && &t != &first) {
        sizes.push_back(-1);
        continue;
      }
      int64_t n = t.shape()[size_t(dim)];
      copy_kernel[out.device()](out.narrow(dim, at, n), t);
      sizes.push_back(n);
      at += n;
    }
  }
  if (any_requires_grad(tensors)) {
    record("CatBackward", tensors, {out}, [sizes, dim](const GradContext& g) -> TensorList {
      TensorList grads;
      int64_t at = 0;
      for (size_t i = 0; i < sizes.size(); ++i) {
        if (sizes[i] < 0) {
          grads.push_back(g.needs(i) ? empty({0}, {.dtype = g[0].dtype(), .device = g[0].device()}) : Tensor());
          continue;
        }
        grads.push_back(g.needs(i) ? g[0].narrow(dim, at, sizes[i]) : Tensor());
        at += sizes[i];
      }
      return grads;
    }, DoubleBackward::Supported);
  }
  return out;
}

}  // namespace halfgrad

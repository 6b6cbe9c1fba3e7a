#pragma once
// Tensor: a handle to shared storage seen through shape + strides + offset, with a dtype, a device and
// (when it takes part in autograd) a place in the graph.
//
// Copying a Tensor copies the handle, as in libtorch: both handles name the same tensor.
// Where the methods are defined: metadata, factories and printing in core/tensor.cpp; view ops in
// ops/shape.cpp; arithmetic in ops/elementwise.cpp; reductions in ops/reduce.cpp; matmul in
// ops/matmul.cpp; casts and copies in ops/copy.cpp; autograd methods in core/autograd.cpp.
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/storage.h"

namespace halfgrad {

using Shape = std::vector<int64_t>;
using Dims = std::vector<int64_t>;

class Tensor;
struct TensorImpl;
class Node;
using TensorList = std::vector<Tensor>;
// A gradient hook receives the gradient flowing into a tensor; returning a defined tensor replaces it.
using GradHook = std::function<Tensor(const Tensor& grad)>;
// A post-accumulate hook receives the leaf itself once its .grad holds the gradient of the backward pass
// (what data parallelism needs: the moment a parameter's gradient is complete).
using PostAccumulateGradHook = std::function<void(const Tensor& leaf)>;
// What register_hook and register_post_accumulate_grad_hook return: remove() takes the hook away, as PyTorch's
// RemovableHandle (a second remove(), or one after the tensor and its graph are gone, does nothing). Dropping the
// handle keeps the hook.
class HookHandle {
 public:
  HookHandle() = default;
  explicit HookHandle(std::function<void()> remove) : remove_(std::move(remove)) {}
  void remove() {
    if (remove_) std::exchange(remove_, nullptr)();
  }

 private:
  std::function<void()> remove_;
};

struct TensorOptions {
  DType dtype = kFloat32;
  Device device = Device::cpu();
  bool requires_grad = false;
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}
  Tensor(const Tensor&) = default;
  Tensor(Tensor&&) noexcept = default;
  Tensor& operator=(const Tensor&) & = default;
  Tensor& operator=(Tensor&&) & noexcept = default;
  // Assigning to a temporary writes into the tensor it names, as in libtorch: x[0] = y copies y's values into x's
  // first row (broadcast and cast as copy_ does), x.narrow(1, 0, 2) = 0.5 fills two columns. Assigning to a named
  // tensor rebinds the name.
  Tensor& operator=(const Tensor& src) && { return copy_(src); }
  Tensor& operator=(Tensor&& src) && { return copy_(src); }
  Tensor& operator=(const Scalar& value) &&;  // ops/elementwise.cpp

  bool defined() const { return impl_ != nullptr; }
  TensorImpl* impl() const { return impl_.get(); }
  // *impl(), or an error naming `what` where the tensor is undefined: what every accessor below reads through.
  TensorImpl& defined_impl(const char* what) const;
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  bool same(const Tensor& other) const { return impl_ == other.impl_; }  // the same tensor object

  // ---- metadata (core/tensor.cpp)
  const Shape& shape() const;
  const Shape& strides() const;
  int64_t dim() const;
  int64_t size(int64_t d) const;  // negative d counts from the end
  int64_t stride(int64_t d) const;
  int64_t offset() const;
  int64_t numel() const;
  DType dtype() const;
  Device device() const;
  bool is_cpu() const { return device().is_cpu(); }
  bool is_cuda() const { return device().is_cuda(); }
  bool is_contiguous() const;
  bool is_floating_point() const { return is_floating(dtype()); }
  const std::shared_ptr<Storage>& storage() const;
  void* data_ptr() const;  // address of element 0 (storage base + offset)
  template <typename T> T* data() const;  // checked against dtype
  template <typename T = double> T item() const;  // single-element tensors; copies to the host
  std::string meta() const;  // "float32[2, 3] cpu": what error messages print for an operand
  std::string str() const;   // values, abbreviated like PyTorch's printing

  // ---- views: share storage (ops/shape.cpp)
  Tensor view(Shape shape) const;  // -1 allowed once; needs compatible strides
  Tensor reshape(Shape shape) const;  // a view when possible, else a copy
  Tensor permute(Dims dims) const;
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor t() const;  // 2-D transpose
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor slice(int64_t dim, int64_t start, int64_t end, int64_t step = 1) const;
  Tensor select(int64_t dim, int64_t index) const;
  // Views along dim, in order: pieces of split_size (the last may be smaller); pieces of the given sizes (they must
  // add up to the dim's size); `chunks` pieces of ceil(size / chunks) (fewer where that covers the dim sooner); every
  // index (select). As PyTorch's split, split_with_sizes, chunk and unbind.
  std::vector<Tensor> split(int64_t split_size, int64_t dim = 0) const;
  std::vector<Tensor> split_with_sizes(const std::vector<int64_t>& sizes, int64_t dim = 0) const;
  std::vector<Tensor> chunk(int64_t chunks, int64_t dim = 0) const;
  std::vector<Tensor> unbind(int64_t dim = 0) const;
  Tensor index_select(int64_t dim, const Tensor& index) const;  // a copy, not a view (ops/embedding.h)
  Tensor operator[](int64_t index) const { return select(0, index); }
  Tensor expand(Shape shape) const;  // broadcast: size-1 dims become stride-0, -1 keeps a size
  Tensor expand_as(const Tensor& other) const { return expand(other.shape()); }
  Tensor squeeze() const;
  Tensor squeeze(int64_t dim) const;
  Tensor unsqueeze(int64_t dim) const;
  Tensor flatten(int64_t start_dim = 0, int64_t end_dim = -1) const;
  Tensor contiguous() const;  // itself when already contiguous
  Tensor clone() const;       // a dense copy in the same memory format (as PyTorch's preserve_format), differentiable

  // ---- dtype and device (ops/copy.cpp)
  Tensor to(DType dtype) const;  // itself when the dtype already matches
  Tensor to(Device device) const;
  Tensor to(Device device, DType dtype) const;
  Tensor cpu() const { return to(Device::cpu()); }
  Tensor cuda(int index = 0) const { return to(Device::cuda(index)); }
  Tensor& copy_(const Tensor& src);  // broadcasting, casting, cross-device copy into this tensor

  // ---- autograd (core/autograd.cpp)
  bool requires_grad() const;
  Tensor& requires_grad_(bool enabled = true);
  bool is_leaf() const;
  Tensor grad() const;  // undefined until a backward pass reaches this tensor
  void set_grad(const Tensor& grad) const;
  const std::shared_ptr<Node>& grad_fn() const;
  uint32_t output_nr() const;
  Tensor detach() const;  // same storage, no history
  void retain_grad() const;  // keep .grad on a non-leaf too
  bool retains_grad() const;
  HookHandle register_hook(GradHook hook) const;
  // Leaves only: `hook` runs each time a backward pass has added into this tensor's .grad.
  HookHandle register_post_accumulate_grad_hook(PostAccumulateGradHook hook) const;
  uint64_t version() const;  // bumped by each in-place write to the storage
  // Backpropagates from this tensor. `gradient` may be left out for a single-element tensor. create_graph and
  // retain_graph (which defaults to create_graph) as halfgrad::backward's (core/autograd.h).
  void backward(const Tensor& gradient = Tensor(), std::optional<bool> retain_graph = std::nullopt,
                bool create_graph = false) const;

  // ---- elementwise (ops/elementwise.cpp)
  Tensor add(const Tensor& other, const Scalar& alpha = 1) const;
  Tensor add(const Scalar& other) const;
  Tensor sub(const Tensor& other, const Scalar& alpha = 1) const;
  Tensor sub(const Scalar& other) const;
  Tensor mul(const Tensor& other) const;
  Tensor mul(const Scalar& other) const;
  Tensor div(const Tensor& other) const;
  Tensor div(const Scalar& other) const;
  Tensor pow(const Tensor& exponent) const;
  Tensor pow(const Scalar& exponent) const;
  Tensor neg() const;
  Tensor abs() const;
  Tensor exp() const;
  Tensor log() const;
  Tensor sqrt() const;
  Tensor rsqrt() const;
  Tensor tanh() const;
  Tensor sigmoid() const;
  Tensor relu() const;
  Tensor sign() const;
  Tensor erf() const;
  Tensor clamp(std::optional<Scalar> min, std::optional<Scalar> max) const;
  Tensor eq(const Tensor& other) const;
  Tensor ne(const Tensor& other) const;
  Tensor lt(const Tensor& other) const;
  Tensor le(const Tensor& other) const;
  Tensor gt(const Tensor& other) const;
  Tensor ge(const Tensor& other) const;
  Tensor eq(const Scalar& other) const;
  Tensor ne(const Scalar& other) const;
  Tensor lt(const Scalar& other) const;
  Tensor le(const Scalar& other) const;
  Tensor gt(const Scalar& other) const;
  Tensor ge(const Scalar& other) const;
  Tensor logical_not() const;
  Tensor isfinite() const;
  // In place: write into this tensor (its dtype is kept; the result must be castable to it).
  Tensor& add_(const Tensor& other, const Scalar& alpha = 1);
  Tensor& add_(const Scalar& other);
  Tensor& sub_(const Tensor& other, const Scalar& alpha = 1);
  Tensor& sub_(const Scalar& other);
  Tensor& mul_(const Tensor& other);
  Tensor& mul_(const Scalar& other);
  Tensor& div_(const Tensor& other);
  Tensor& div_(const Scalar& other);
  Tensor& neg_();
  Tensor& exp_();
  Tensor& sqrt_();
  Tensor& relu_();
  Tensor& clamp_(std::optional<Scalar> min, std::optional<Scalar> max);
  Tensor& fill_(const Scalar& value);
  // value where mask (bool) is true, this tensor elsewhere (ops/elementwise.cpp): out of place the two broadcast
  // together; in place the mask must broadcast to this tensor's shape.
  Tensor masked_fill(const Tensor& mask, const Scalar& value) const;
  Tensor& masked_fill_(const Tensor& mask, const Scalar& value);
  Tensor& zero_() { return fill_(0); }
  // Indexing element by element along dim (ops/gather.h): gather reads this tensor at index's positions; the
  // scatters write (or add) src's values there, into a copy of this tensor or (the _ methods) into itself.
  Tensor gather(int64_t dim, const Tensor& index) const;
  Tensor scatter(int64_t dim, const Tensor& index, const Tensor& src) const;
  Tensor scatter(int64_t dim, const Tensor& index, const Scalar& value) const;
  Tensor scatter_add(int64_t dim, const Tensor& index, const Tensor& src) const;
  Tensor& scatter_(int64_t dim, const Tensor& index, const Tensor& src);
  Tensor& scatter_(int64_t dim, const Tensor& index, const Scalar& value);
  Tensor& scatter_add_(int64_t dim, const Tensor& index, const Tensor& src);

  // ---- reductions (ops/reduce.cpp). Empty `dims` means every dim.
  Tensor sum(Dims dims = {}, bool keepdim = false) const;
  Tensor mean(Dims dims = {}, bool keepdim = false) const;
  Tensor var(Dims dims = {}, int64_t correction = 1, bool keepdim = false) const;
  Tensor std(Dims dims = {}, int64_t correction = 1, bool keepdim = false) const;
  Tensor amax(Dims dims = {}, bool keepdim = false) const;
  Tensor amin(Dims dims = {}, bool keepdim = false) const;
  Tensor max() const;  // over all elements
  Tensor min() const;
  std::pair<Tensor, Tensor> max(int64_t dim, bool keepdim = false) const;  // (values, int64 indices)
  std::pair<Tensor, Tensor> min(int64_t dim, bool keepdim = false) const;
  Tensor argmax(int64_t dim, bool keepdim = false) const;
  Tensor argmin(int64_t dim, bool keepdim = false) const;
  Tensor all(Dims dims = {}, bool keepdim = false) const;  // every element nonzero (nan counts): bool (uint8 for uint8)
  Tensor any(Dims dims = {}, bool keepdim = false) const;
  // Running sums along dim (ops/cumsum.h): in `dtype`, else this tensor's (int64 for integers and bool); in place,
  // in this tensor's own dtype.
  Tensor cumsum(int64_t dim, std::optional<DType> dtype = std::nullopt) const;
  Tensor& cumsum_(int64_t dim);
  // Ordering along dim (ops/sort.h): (values, int64 indices); NaN above every number; ties in their order.
  std::pair<Tensor, Tensor> sort(int64_t dim = -1, bool descending = false, bool stable = false) const;
  Tensor argsort(int64_t dim = -1, bool descending = false, bool stable = false) const;
  std::pair<Tensor, Tensor> topk(int64_t k, int64_t dim = -1, bool largest = true, bool sorted = true) const;

  // ---- linear algebra (ops/matmul.cpp)
  Tensor matmul(const Tensor& other) const;

 private:
  std::shared_ptr<TensorImpl> impl_;
};

// ---- autograd state of a tensor (core/autograd.h explains the graph)
struct AutogradMeta {
  bool requires_grad = false;  // set on leaves by the user; non-leaves require grad through grad_fn
  Tensor grad;
  std::shared_ptr<Node> grad_fn;  // the node that produced this tensor, null for leaves
  uint32_t output_nr = 0;         // which output of grad_fn this tensor is
  std::weak_ptr<Node> grad_accumulator;  // leaves: the node that adds into .grad
  std::vector<GradHook> hooks;  // leaves only; a non-leaf's hooks live on its grad_fn; empty where removed
  std::vector<PostAccumulateGradHook> post_accumulate_hooks;  // leaves only; empty where removed
  bool retains_grad = false;
  // Leaves: autocast's float16/bfloat16 cast of this parameter, kept across autocast regions while kept_cast_version
  // is the storage's version (core/autocast.h, kept_cast); the optimizers' fused steps write it with the parameter.
  Tensor kept_cast;
  uint64_t kept_cast_version = 0;
};

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  Shape shape;
  Shape strides;  // in elements
  int64_t offset = 0;  // in elements
  DType dtype = kFloat32;
  bool is_view = false;  // shares storage with the tensor it was viewed from
  bool is_detached = false;  // that view is detach()'s: autograd does not relate the two
  // A view's base (make_view; none for detach()'s alias): the tensor at the root of its chain of views, itself no view
  // or detach()'s alias. An in-place write that autograd records on the view gives the base a new history (a
  // CopySlices node), and a write to the base or to any of its views gives every earlier view of it a history that
  // leads to the base's new one (refresh_view_history, core/autograd.cpp), as PyTorch's views do.
  std::shared_ptr<TensorImpl> view_base;
  // A view: the storage's history_version when the view's history was made: an older one means a recorded in-place
  // write to the storage since, and the view's history is made again from its base's before it is used.
  uint64_t history_seen = 0;
  std::unique_ptr<AutogradMeta> autograd;  // null until the tensor enters autograd

  AutogradMeta& autograd_meta();  // creates it on first use
};

// std::cout << t prints t.str(), PyTorch's layout of the values (libtorch's operator<< prints another).
std::ostream& operator<<(std::ostream& out, const Tensor& t);

// ---- shape helpers used by ops
int64_t numel_of(const Shape& shape);
// The number of elements of `shape`, or nothing where it passes int64 (for callers that name themselves in the error).
std::optional<int64_t> checked_numel(const Shape& shape);
Shape contiguous_strides(const Shape& shape);
int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op);  // -1 -> ndim-1, with a range check
// As wrap_dim, for ops that index a dim the tensor has (size, slice, narrow): a 0-d tensor has none, where wrap_dim
// lets reductions take 0 or -1 for it, as PyTorch does.
int64_t wrap_existing_dim(int64_t dim, int64_t ndim, const char* op);
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);
std::string shape_str(const Shape& shape);

// ---- factories (core/tensor.cpp)
Tensor empty(const Shape& shape, TensorOptions options = {});
Tensor zeros(const Shape& shape, TensorOptions options = {});
Tensor ones(const Shape& shape, TensorOptions options = {});
Tensor full(const Shape& shape, const Scalar& value, TensorOptions options = {});
// Without options the dtype is PyTorch's: int64 where start, end and step are all integers, else the default float
// (arange(0, 1, 0.1) is ten float32 values). With options it is theirs, float32 where they name none (TensorOptions'
// default): arange(5, {.device = Device::cuda()}) is float32, where libtorch would infer int64.
Tensor arange(const Scalar& start, const Scalar& end, const Scalar& step = 1);
Tensor arange(const Scalar& start, const Scalar& end, const Scalar& step, TensorOptions options);
Tensor arange(const Scalar& end);
Tensor arange(const Scalar& end, TensorOptions options);
Tensor rand(const Shape& shape, TensorOptions options = {});   // uniform [0, 1)
Tensor randn(const Shape& shape, TensorOptions options = {});  // standard normal
Tensor randint(int64_t low, int64_t high, const Shape& shape, TensorOptions options = {.dtype = kInt64});
Tensor scalar_tensor(const Scalar& value, TensorOptions options = {});
Tensor empty_like(const Tensor& t);
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
Tensor full_like(const Tensor& t, const Scalar& value);
Tensor randn_like(const Tensor& t);
// Copies `count` elements of `dtype` from host memory.
Tensor from_buffer(const void* data, const Shape& shape, DType dtype, Device device = Device::cpu());
template <typename T>
Tensor tensor(const std::vector<T>& values, const Shape& shape, TensorOptions options = {.dtype = dtype_of<T>()}) {
  HG_CHECK(int64_t(values.size()) == numel_of(shape), "tensor: {} values for the shape {}, which has {} elements",
           values.size(), shape_str(shape), numel_of(shape));
  Tensor t = from_buffer(values.data(), shape, dtype_of<T>());
  if (options.dtype != dtype_of<T>() || !options.device.is_cpu()) t = t.to(options.device, options.dtype);
  if (options.requires_grad) t.requires_grad_();
  return t;
}
// std::vector<bool> packs its values as bits and has no data(): they are copied a byte each.
template <>
inline Tensor tensor<bool>(const std::vector<bool>& values, const Shape& shape, TensorOptions options) {
  return tensor(std::vector<uint8_t>(values.begin(), values.end()), shape, options);
}
template <typename T>
Tensor tensor(const std::vector<T>& values, TensorOptions options = {.dtype = dtype_of<T>()}) {
  return tensor(values, Shape{int64_t(values.size())}, options);
}
// A tensor's values as a host vector of T (converted), in row-major order.
template <typename T> std::vector<T> to_vector(const Tensor& t);

// ---- memory formats: the layouts an op may produce (4-D tensors only for channels_last, 2-D for aligned_rows)
enum class MemoryFormat : uint8_t {
  Contiguous,    // NCHW: strides [C*H*W, H*W, W, 1]
  ChannelsLast,  // NHWC: strides [H*W*C, 1, W*C, C]
  // A matrix [R, C] in the top-left corner of a zero-filled [R_p, C_p] one, strides [C_p, 1], R_p and C_p the
  // multiples of kAlignedRowBytes / element size at or above R and C. cuBLAS's tensor-core products take such a
  // matrix as it is where a dense one of odd size runs on a padded copy (ops/matmul.cu): the layout of a language
  // model's decoder weight (models/language_model.h). Not dense: the padding stays zero because ops write only a
  // tensor's elements, and the kernels that walk a parameter's whole storage (optimizers, the gradient norm,
  // unscaling, transfers) pair it with a gradient or state of the same layout, whose padding is zero too.
  AlignedRows,
};
const char* memory_format_name(MemoryFormat format);

// The row alignment of MemoryFormat::AlignedRows: the 16 bytes cuBLAS's tensor-core kernels want of every
// contiguous extent (ops/matmul.h's kGemmAlignBytes is this).
constexpr int64_t kAlignedRowBytes = 16;
// n rounded up to a whole number of kAlignedRowBytes vectors of `dtype`.
int64_t aligned_row_extent(int64_t n, DType dtype);
// Whether t is an aligned-rows matrix: made by empty(shape, options, MemoryFormat::AlignedRows), a copy that keeps
// the format, or as_aligned_rows; 2-D, strides [C_p, 1], at the start of a storage of exactly R_p x C_p elements, and
// not a view (a view with these strides may sit in a storage whose padding holds other values).
bool is_aligned_rows(const Tensor& t);
// The top-left [rows, cols] of `padded` as an aligned-rows tensor on its storage. padded: a dense [R_p, C_p] matrix
// (not a view) whose padding is zero, handed over: nothing else may write its storage afterwards. For ops that
// compute a padded result in place (linear_cross_entropy's weight gradient).
Tensor as_aligned_rows(const Tensor& padded, int64_t rows, int64_t cols);

// Whether t is 4-D and dense in N, H, W, C order (the strides of size-1 dims do not matter, so a tensor
// with C == 1 or H == W == 1 is both channels_last and contiguous).
bool is_channels_last(const Tensor& t);
// The format an op should produce for input t: ChannelsLast when t is channels_last and not also
// contiguous, else Contiguous (4-D tensors that are dense in neither layout are computed as NCHW; an
// aligned-rows operand gives a contiguous result).
MemoryFormat suggest_memory_format(const Tensor& t);
// The format a copy of t keeps where PyTorch's would keep t's layout (to(device), to(dtype), .grad): AlignedRows
// for an aligned-rows t that is not also contiguous, else suggest_memory_format(t).
MemoryFormat kept_memory_format(const Tensor& t);
// A tensor laid out in `format`: uninitialised, but for the padding of AlignedRows, which is zero. ChannelsLast
// takes a 4-D [N, C, H, W] shape, AlignedRows a 2-D one.
Tensor empty(const Shape& shape, TensorOptions options, MemoryFormat format);


// Reproducible random numbers: one seeded global generator (Philox), like torch.manual_seed.
void manual_seed(uint64_t seed);

// ---- memory shared between elements and tensors: what an in-place write must not write twice or read after writing
// Whether two of t's elements are one memory location (a dim of size > 1 with stride 0: an expanded view).
bool has_internal_overlap(const Tensor& t);
// Whether a and b share memory without being the same view of it (one offset, shape and strides): a kernel that
// writes a while it reads b element by element could read values it has already written. May say yes for views
// that interleave without sharing an element (a conservative answer: the caller then copies first).
bool overlaps_partially(const Tensor& a, const Tensor& b);

}  // namespace halfgrad

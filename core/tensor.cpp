// Tensor metadata, factories, random numbers and printing.
#include "core/tensor.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <numbers>
#include <ostream>
#include <type_traits>

#include "core/autograd.h"
#include "core/random.h"

namespace halfgrad {

// ---- shape helpers

std::optional<int64_t> checked_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t s : shape)
    if (__builtin_mul_overflow(n, s, &n)) return std::nullopt;
  return n;
}

int64_t numel_of(const Shape& shape) {
  const std::optional<int64_t> n = checked_numel(shape);
  HG_CHECK(n.has_value(), "shape {} has more elements than an int64 counts", shape_str(shape));
  return *n;
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (int64_t d = int64_t(shape.size()) - 1; d >= 0; --d) {
    strides[d] = s;
    s *= std::max<int64_t>(shape[d], 1);
  }
  return strides;
}

int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op) {
  int64_t range = std::max<int64_t>(ndim, 1);  // a 0-d tensor accepts dim 0 and -1, as in PyTorch
  HG_CHECK(dim >= -range && dim < range, "{}: dimension {} is out of range (expected in [{}, {}])", op, dim, -range,
           range - 1);
  return dim < 0 ? dim + range : dim;
}

int64_t wrap_existing_dim(int64_t dim, int64_t ndim, const char* op) {
  HG_CHECK(ndim > 0, "{}: dimension {} given, but the tensor is 0-d: it has no dimensions", op, dim);
  return wrap_dim(dim, ndim, op);
}

std::string shape_str(const Shape& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    HG_CHECK(da == db || da == 1 || db == 1, "{}: shapes {} and {} cannot be broadcast together (dim {}: {} vs {})",
             op, shape_str(a), shape_str(b), i, da, db);
    out[i] = da == 1 ? db : da;
  }
  return out;
}

// ---- metadata

TensorImpl& Tensor::defined_impl(const char* what) const {
  HG_CHECK(impl_ != nullptr, "{}: the tensor is undefined (a default-constructed Tensor holds no data: an operand or "
           "result that was never set?)", what);
  return *impl_;
}

const Shape& Tensor::shape() const { return defined_impl("shape").shape; }
const Shape& Tensor::strides() const { return defined_impl("strides").strides; }
int64_t Tensor::dim() const { return int64_t(defined_impl("dim").shape.size()); }
int64_t Tensor::size(int64_t d) const { return shape()[wrap_existing_dim(d, dim(), "size")]; }
int64_t Tensor::stride(int64_t d) const { return strides()[wrap_existing_dim(d, dim(), "stride")]; }
int64_t Tensor::offset() const { return defined_impl("offset").offset; }
int64_t Tensor::numel() const { return numel_of(defined_impl("numel").shape); }
DType Tensor::dtype() const { return defined_impl("dtype").dtype; }
Device Tensor::device() const { return defined_impl("device").storage->device(); }
const std::shared_ptr<Storage>& Tensor::storage() const { return defined_impl("storage").storage; }

bool Tensor::is_contiguous() const {
  if (numel() == 0) return true;  // as PyTorch: an empty tensor has no layout to speak of
  int64_t expected = 1;
  for (int64_t d = dim() - 1; d >= 0; --d) {
    if (impl()->shape[d] == 1) continue;
    if (impl()->strides[d] != expected) return false;
    expected *= impl()->shape[d];
  }
  return true;
}

void* Tensor::data_ptr() const {
  const TensorImpl& impl = defined_impl("data_ptr");
  return static_cast<char*>(impl.storage->data()) + impl.offset * int64_t(element_size(impl.dtype));
}

template <typename T> T* Tensor::data() const {
  HG_CHECK(dtype() == dtype_of<T>(), "data<{}>(): the tensor is {}", dtype_name(dtype_of<T>()), meta());
  return static_cast<T*>(data_ptr());
}

template <typename T> T Tensor::item() const {
  HG_CHECK(numel() == 1, "item(): expected a tensor with one element, got {}", meta());
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    // Checked, as libtorch's item<T>() (checked_convert) but stricter: any value an integer T cannot hold is an error
    // (libtorch wraps a negative int64 into uint8), not a wrapped or undefined number.
    using Limits = std::numeric_limits<T>;
    const char* name = dtype_name(dtype_of<T>());
    if (is_floating_point()) {
      const double v = to_vector<double>(*this)[0];  // NaN fails both comparisons
      HG_CHECK(v >= double(Limits::lowest()) && v < double(Limits::max()) + 1.0,
               "item<{}>(): the value {} of {} cannot be converted to {} without overflow", name, v, meta(), name);
      return T(v);
    }
    if (dtype() != kBool) {
      const int64_t v = to_vector<int64_t>(*this)[0];
      HG_CHECK(v >= int64_t(Limits::lowest()) && v <= int64_t(Limits::max()),
               "item<{}>(): the value {} of {} cannot be converted to {} without overflow", name, v, meta(), name);
      return T(v);
    }
  }
  return to_vector<T>(*this)[0];
}

std::string Tensor::meta() const {
  if (!defined()) return "(undefined tensor)";
  return fmt::format("{}{} {}", dtype_name(dtype()), shape_str(shape()), device().str());
}

#define HG_INSTANTIATE(T)                    \
  template T* Tensor::data<T>() const;       \
  template T Tensor::item<T>() const;        \
  template std::vector<T> to_vector<T>(const Tensor&);
HG_INSTANTIATE(bool)
HG_INSTANTIATE(uint8_t)
HG_INSTANTIATE(int32_t)
HG_INSTANTIATE(int64_t)
HG_INSTANTIATE(Half)
HG_INSTANTIATE(BFloat16)
HG_INSTANTIATE(float)
HG_INSTANTIATE(double)
#undef HG_INSTANTIATE

template <typename T> std::vector<T> to_vector(const Tensor& t) {
  Tensor host = t.to(Device::cpu(), dtype_of<T>()).contiguous();
  const T* values = static_cast<const T*>(host.data_ptr());
  return std::vector<T>(values, values + host.numel());  // (std::vector<bool> has no data() to memcpy into)
}

// ---- factories

Tensor empty(const Shape& shape, TensorOptions options) {
  for (int64_t s : shape) HG_CHECK(s >= 0, "empty: negative dimension in shape {}", shape_str(shape));
  int64_t bytes = 0;
  HG_CHECK(!__builtin_mul_overflow(numel_of(shape), int64_t(element_size(options.dtype)), &bytes),
           "empty: shape {} of {} needs more bytes than an int64 counts", shape_str(shape), dtype_name(options.dtype));
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::make_shared<Storage>(size_t(bytes), options.device);
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = options.dtype;
  Tensor t(std::move(impl));
  if (options.requires_grad) t.requires_grad_();
  return t;
}

Tensor full(const Shape& shape, const Scalar& value, TensorOptions options) {
  HG_CHECK(fits_dtype(value, options.dtype), "full: {} cannot be converted to {} without overflow", value.str(),
           dtype_name(options.dtype));
  bool requires_grad = options.requires_grad;
  options.requires_grad = false;
  Tensor t = empty(shape, options);
  t.fill_(value);
  if (requires_grad) t.requires_grad_();
  return t;
}

Tensor zeros(const Shape& shape, TensorOptions options) { return full(shape, 0, options); }
Tensor ones(const Shape& shape, TensorOptions options) { return full(shape, 1, options); }
Tensor scalar_tensor(const Scalar& value, TensorOptions options) { return full({}, value, options); }

static TensorOptions like(const Tensor& t) { return {.dtype = t.dtype(), .device = t.device()}; }
Tensor empty_like(const Tensor& t) { return empty(t.shape(), like(t)); }
Tensor zeros_like(const Tensor& t) { return zeros(t.shape(), like(t)); }
Tensor ones_like(const Tensor& t) { return ones(t.shape(), like(t)); }
Tensor full_like(const Tensor& t, const Scalar& value) { return full(t.shape(), value, like(t)); }
Tensor randn_like(const Tensor& t) { return randn(t.shape(), like(t)); }

Tensor from_buffer(const void* data, const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, {.dtype = dtype});
  if (t.numel() > 0) std::memcpy(t.data_ptr(), data, size_t(t.numel()) * element_size(dtype));
  return device.is_cpu() ? t : t.to(device);
}

namespace {
bool all_integers(const Scalar& start, const Scalar& end, const Scalar& step) {
  return !start.is_floating() && !end.is_floating() && !step.is_floating();
}
}  // namespace

Tensor arange(const Scalar& start, const Scalar& end, const Scalar& step, TensorOptions options) {
  const double first = start.to_double(), last = end.to_double(), by = step.to_double();
  auto refuse = [&] { HG_FAIL("arange: cannot go from {} to {} in steps of {}", start.str(), end.str(), step.str()); };
  Tensor values;  // a size no memory holds fails at its allocation, as any does
  if (all_integers(start, end, step) && !is_floating(options.dtype)) {
    // in int64, exactly: a double holds 53 bits
    const __int128 span = __int128(end.to_int()) - start.to_int(), by_int = step.to_int();
    if (by_int == 0 || (span != 0 && (span > 0) != (by_int > 0))) refuse();
    const __int128 count = span / by_int + (span % by_int != 0 ? 1 : 0);
    HG_CHECK(count < (__int128(1) << 62), "arange: {} to {} in steps of {} is {} values, more than a tensor holds",
             start.str(), end.str(), step.str(), double(count));
    values = empty({int64_t(count)}, {.dtype = kInt64});
    int64_t* v = values.data<int64_t>();
    for (int64_t i = 0; i < int64_t(count); ++i) v[i] = int64_t(start.to_int() + __int128(i) * step.to_int());
  } else {
    if (!(std::isfinite(first) && std::isfinite(last) && std::isfinite(by) && by != 0 && (last - first) / by >= 0))
      refuse();
    const double count = std::ceil((last - first) / by);
    HG_CHECK(count < 0x1p62, "arange: {} to {} in steps of {} is {} values, more than a tensor holds", start.str(),
             end.str(), step.str(), count);
    values = empty({int64_t(count)}, {.dtype = kFloat64});
    double* v = values.data<double>();
    for (int64_t i = 0; i < int64_t(count); ++i) v[i] = first + double(i) * by;
  }
  Tensor out = values.to(options.device, options.dtype);
  if (options.requires_grad) out.requires_grad_();
  return out;
}

Tensor arange(const Scalar& start, const Scalar& end, const Scalar& step) {
  return arange(start, end, step, {.dtype = all_integers(start, end, step) ? kInt64 : kDefaultFloat});
}
Tensor arange(const Scalar& end) { return arange(0, end, 1); }
Tensor arange(const Scalar& end, TensorOptions options) { return arange(0, end, 1, options); }

// ---- memory formats

const char* memory_format_name(MemoryFormat format) {
  switch (format) {
    case MemoryFormat::Contiguous: return "contiguous";
    case MemoryFormat::ChannelsLast: return "channels_last";
    case MemoryFormat::AlignedRows: return "aligned_rows";
  }
  return "?";
}

int64_t aligned_row_extent(int64_t n, DType dtype) {
  const int64_t per_vector = std::max<int64_t>(1, kAlignedRowBytes / int64_t(element_size(dtype)));
  return (n + per_vector - 1) / per_vector * per_vector;
}

bool is_aligned_rows(const Tensor& t) {
  if (!t.defined() || t.dim() != 2 || t.offset() != 0 || t.impl()->is_view) return false;
  const int64_t rows = aligned_row_extent(t.size(0), t.dtype()), cols = aligned_row_extent(t.size(1), t.dtype());
  return t.stride(1) == 1 && t.stride(0) == cols &&
         t.storage()->nbytes() == size_t(rows * cols) * element_size(t.dtype());
}

Tensor as_aligned_rows(const Tensor& padded, int64_t rows, int64_t cols) {
  HG_CHECK(padded.defined() && padded.dim() == 2 && padded.is_contiguous() && padded.offset() == 0 &&
               !padded.impl()->is_view && rows >= 0 && cols >= 0 &&
               padded.size(0) == aligned_row_extent(rows, padded.dtype()) &&
               padded.size(1) == aligned_row_extent(cols, padded.dtype()) &&
               padded.storage()->nbytes() == size_t(padded.numel()) * element_size(padded.dtype()),
           "as_aligned_rows: {} is not a whole dense [{}, {}] matrix to hold an aligned-rows [{}, {}] one",
           padded.defined() ? padded.meta() : "an undefined tensor", aligned_row_extent(rows, padded.dtype()),
           aligned_row_extent(cols, padded.dtype()), rows, cols);
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = padded.storage();
  impl->shape = {rows, cols};
  impl->strides = {padded.size(1), 1};
  impl->dtype = padded.dtype();
  return Tensor(std::move(impl));
}

bool has_internal_overlap(const Tensor& t) {
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.shape()[d] > 1 && t.strides()[d] == 0) return true;
  return false;
}

bool overlaps_partially(const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined() || a.storage() != b.storage() || a.numel() == 0 || b.numel() == 0) return false;
  if (a.offset() == b.offset() && a.shape() == b.shape() && a.strides() == b.strides()) return false;
  auto span = [](const Tensor& t) {  // the first and last element t reaches, in elements of the storage
    int64_t first = t.offset(), last = t.offset();
    for (int64_t d = 0; d < t.dim(); ++d) (t.strides()[d] < 0 ? first : last) += (t.shape()[d] - 1) * t.strides()[d];
    return std::pair(first * int64_t(element_size(t.dtype())), (last + 1) * int64_t(element_size(t.dtype())));
  };
  const auto [a_begin, a_end] = span(a);
  const auto [b_begin, b_end] = span(b);
  return a_begin < b_end && b_begin < a_end;
}

bool is_channels_last(const Tensor& t) {
  if (!t.defined() || t.dim() != 4) return false;
  const Shape& size = t.shape();
  const Shape& stride = t.strides();
  int64_t expected = 1;
  for (int d : {1, 3, 2, 0}) {  // C, W, H, N: innermost first
    if (size[d] == 1) continue;
    if (stride[d] != expected) return false;
    expected *= size[d];
  }
  return true;
}

MemoryFormat suggest_memory_format(const Tensor& t) {
  return is_channels_last(t) && !t.is_contiguous() ? MemoryFormat::ChannelsLast : MemoryFormat::Contiguous;
}

MemoryFormat kept_memory_format(const Tensor& t) {
  // Contiguous first: a contiguous matrix whose sizes are whole vectors of its dtype is aligned rows too, but a cast
  // to a smaller dtype would pad it.
  return is_aligned_rows(t) && !t.is_contiguous() ? MemoryFormat::AlignedRows : suggest_memory_format(t);
}

namespace {
Tensor empty_aligned_rows(const Shape& shape, TensorOptions options) {
  HG_CHECK(shape.size() == 2, "empty: the aligned_rows format needs a 2-D [rows, columns] shape, got {}",
           shape_str(shape));
  const bool requires_grad = options.requires_grad;
  options.requires_grad = false;
  const int64_t rows = shape[0], cols = shape[1];
  const Tensor padded = empty({aligned_row_extent(rows, options.dtype), aligned_row_extent(cols, options.dtype)},
                              options);
  padded.narrow(1, cols, padded.size(1) - cols).zero_();
  padded.narrow(0, rows, padded.size(0) - rows).zero_();
  Tensor t = as_aligned_rows(padded, rows, cols);
  if (requires_grad) t.requires_grad_();
  return t;
}
}  // namespace

Tensor empty(const Shape& shape, TensorOptions options, MemoryFormat format) {
  if (format == MemoryFormat::Contiguous) return empty(shape, options);
  if (format == MemoryFormat::AlignedRows) return empty_aligned_rows(shape, options);
  HG_CHECK(shape.size() == 4, "empty: the channels_last format needs a 4-D [N, C, H, W] shape, got {}",
           shape_str(shape));
  const bool requires_grad = options.requires_grad;
  options.requires_grad = false;
  Tensor nhwc = empty({shape[0], shape[2], shape[3], shape[1]}, options);
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = nhwc.storage();
  impl->shape = shape;
  impl->strides = {shape[2] * shape[3] * shape[1], 1, shape[3] * shape[1], shape[1]};
  impl->dtype = options.dtype;
  Tensor t(std::move(impl));  // not a view: it owns its storage
  if (requires_grad) t.requires_grad_();
  return t;
}

// ---- random numbers

namespace {
std::mutex generator_mutex;
GeneratorState generator{.seed = 67280421310721ull, .offset = 0};

// Fills `n` values with fn(counter) -> up to 4 values, in parallel; the stream depends only on the seed.
template <typename T, int PerCounter, typename Fn> Tensor generate(const Shape& shape, TensorOptions options, Fn fn) {
  Tensor host = empty(shape, {.dtype = dtype_of<T>()});
  int64_t n = host.numel();
  int64_t counters = (n + PerCounter - 1) / PerCounter;
  GeneratorState state = next_random_counters(uint64_t(counters));
  HG_CHECK(!state.graph_state, "rand/randn/randint: random tensors are made on the host, which a CUDA graph capture "
                               "cannot replay; make them before capturing");
  T* out = host.data<T>();
#pragma omp parallel for if (counters > 4096)
  for (int64_t c = 0; c < counters; ++c) {
    T values[PerCounter];
    fn(Philox::generate(state.seed, state.offset + uint64_t(c)), values);
    for (int k = 0; k < PerCounter && c * PerCounter + k < n; ++k) out[c * PerCounter + k] = values[k];
  }
  Tensor t = host.to(options.device, options.dtype);
  if (options.requires_grad) t.requires_grad_();
  return t;
}

double uniform53(uint32_t hi, uint32_t lo) {
  return double((uint64_t(hi) << 21) ^ (lo >> 11)) * (1.0 / 9007199254740992.0);
}
}  // namespace

thread_local GraphGenerator* graph_generator = nullptr;

void set_graph_generator(GraphGenerator* generator) { graph_generator = generator; }

GeneratorState next_random_counters(uint64_t count) {
  if (graph_generator) {
    GeneratorState s{.seed = 0, .offset = graph_generator->used, .graph_state = graph_generator->device_state};
    graph_generator->used += count;
    return s;
  }
  std::lock_guard<std::mutex> lock(generator_mutex);
  GeneratorState s = generator;
  generator.offset += count;
  return s;
}

void manual_seed(uint64_t seed) {
  std::lock_guard<std::mutex> lock(generator_mutex);
  generator = {.seed = seed, .offset = 0};
}

GeneratorState generator_state() {
  std::lock_guard<std::mutex> lock(generator_mutex);
  return generator;
}

void set_generator_state(GeneratorState state) {
  std::lock_guard<std::mutex> lock(generator_mutex);
  generator = state;
}

Tensor rand(const Shape& shape, TensorOptions options) {
  HG_CHECK(is_floating(options.dtype), "rand: dtype must be floating, got {}", dtype_name(options.dtype));
  if (options.dtype == kFloat64) {
    return generate<double, 2>(shape, options, [](Philox::U4 r, double* v) {
      v[0] = uniform53(r.x[0], r.x[1]);
      v[1] = uniform53(r.x[2], r.x[3]);
    });
  }
  // As many random bits as the dtype's significand holds (24, float16 11, bfloat16 8, as PyTorch draws): multiples of
  // 2^-bits below 1, each exact in the dtype. More bits would round the values nearest 1 up to 1.
  const int bits = options.dtype == kFloat16 ? 11 : options.dtype == kBFloat16 ? 8 : 24;
  const float unit = std::ldexp(1.0f, -bits);
  return generate<float, 4>(shape, options, [bits, unit](Philox::U4 r, float* v) {
    for (int k = 0; k < 4; ++k) v[k] = float(r.x[k] >> (32 - bits)) * unit;
  });
}

Tensor randn(const Shape& shape, TensorOptions options) {
  HG_CHECK(is_floating(options.dtype), "randn: dtype must be floating, got {}", dtype_name(options.dtype));
  // Box-Muller: two uniforms (u1 in (0, 1]) give two independent standard normals.
  if (options.dtype == kFloat64) {
    return generate<double, 2>(shape, options, [](Philox::U4 r, double* v) {
      double u1 = 1.0 - uniform53(r.x[0], r.x[1]), u2 = uniform53(r.x[2], r.x[3]);
      double radius = std::sqrt(-2.0 * std::log(u1)), angle = 2.0 * std::numbers::pi * u2;
      v[0] = radius * std::cos(angle);
      v[1] = radius * std::sin(angle);
    });
  }
  return generate<float, 4>(shape, options, [](Philox::U4 r, float* v) {
    for (int k = 0; k < 4; k += 2) {
      float u1 = 1.0f - Philox::uniform(r.x[k]), u2 = Philox::uniform(r.x[k + 1]);
      float radius = std::sqrt(-2.0f * std::log(u1)), angle = 2.0f * std::numbers::pi_v<float> * u2;
      v[k] = radius * std::cos(angle);
      v[k + 1] = radius * std::sin(angle);
    }
  });
}

Tensor randint(int64_t low, int64_t high, const Shape& shape, TensorOptions options) {
  HG_CHECK(high > low, "randint: empty range [{}, {})", low, high);
  if (is_integral(options.dtype, /*include_bool=*/true)) {
    int64_t lowest = INT64_MIN, highest = INT64_MAX;
    switch (options.dtype) {
      case kBool: lowest = 0, highest = 1; break;
      case kUInt8: lowest = 0, highest = 255; break;
      case kInt32: lowest = INT32_MIN, highest = INT32_MAX; break;
      default: break;
    }
    HG_CHECK(low >= lowest && high - 1 <= highest, "randint: [{}, {}) is not within {}'s range [{}, {}]", low, high,
             dtype_name(options.dtype), lowest, highest);
  }
  // In unsigned arithmetic, which wraps: over INT64_MIN..INT64_MAX, high - low and low + offset overflow int64
  // (undefined, which UBSan reports), while the wrapped results are the right values.
  const uint64_t range = uint64_t(high) - uint64_t(low);
  auto draw = [&](uint32_t hi, uint32_t lo) { return int64_t(uint64_t(low) + ((uint64_t(hi) << 32) | lo) % range); };
  Tensor t = generate<int64_t, 2>(shape, {.dtype = kInt64}, [&](Philox::U4 r, int64_t* v) {
    v[0] = draw(r.x[0], r.x[1]);
    v[1] = draw(r.x[2], r.x[3]);
  });
  return t.to(options.device, options.dtype);
}

// ---- printing

namespace {
constexpr int64_t kSummarizeAbove = 1000;  // elements; larger tensors print their ends only
constexpr int64_t kEdgeItems = 3;

struct Printer {
  const std::vector<double>& values;
  const std::vector<int64_t>& integers;  // an integral tensor's values as they are (a double holds 53 bits)
  const Shape& shape;
  bool floating, boolean, summarize;
  int width = 0;
  bool scientific = false;

  std::string number(size_t i) const {
    const double v = values[i];
    if (boolean) return v != 0 ? "true" : "false";
    if (!floating) return fmt::format("{}", integers[i]);
    if (std::isnan(v)) return "nan";
    if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
    return scientific ? fmt::format("{:.4e}", v) : fmt::format("{:.4f}", v);
  }

  void body(std::string& out, int64_t dim, int64_t base, int indent) const {
    if (dim == int64_t(shape.size())) {
      out += fmt::format("{:>{}}", number(size_t(base)), width);
      return;
    }
    int64_t stride = 1;
    for (size_t d = size_t(dim) + 1; d < shape.size(); ++d) stride *= shape[d];
    out += '[';
    for (int64_t i = 0; i < shape[dim]; ++i) {
      if (summarize && shape[dim] > 2 * kEdgeItems && i == kEdgeItems) {
        out += dim + 1 == int64_t(shape.size()) ? "..., " : fmt::format("...,\n{:{}}", "", indent + 1);
        i = shape[dim] - kEdgeItems;
      }
      body(out, dim + 1, base + i * stride, indent + 1);
      if (i + 1 < shape[dim]) {
        out += ',';
        out += dim + 1 == int64_t(shape.size()) ? std::string(" ")
                                                 : std::string(size_t(shape.size() - dim - 1), '\n') +
                                                       std::string(size_t(indent + 1), ' ');
      }
    }
    out += ']';
  }
};
}  // namespace

std::string Tensor::str() const {
  if (!defined()) return "tensor(undefined)";
  std::vector<double> values = to_vector<double>(*this);
  const bool floating = is_floating_point(), boolean = dtype() == kBool;
  const std::vector<int64_t> integers = floating || boolean ? std::vector<int64_t>() : to_vector<int64_t>(*this);
  Printer p{values, integers, shape(), floating, boolean, numel() > kSummarizeAbove};
  double largest = 0, smallest_nonzero = INFINITY;
  for (double v : values) {
    if (!std::isfinite(v)) continue;
    largest = std::max(largest, std::abs(v));
    if (v != 0) smallest_nonzero = std::min(smallest_nonzero, std::abs(v));
  }
  p.scientific = p.floating && (largest >= 1e8 || smallest_nonzero < 1e-4);
  for (size_t i = 0; i < values.size(); ++i) p.width = std::max(p.width, int(p.number(i).size()));
  std::string out = "tensor(";
  if (dim() == 0) {
    out += p.number(0);
  } else {
    p.body(out, 0, 0, 7);
  }
  std::vector<std::string> extras;
  if (dtype() != kFloat32 && dtype() != kInt64 && dtype() != kBool) extras.push_back(fmt::format("dtype={}", dtype_name(dtype())));
  if (numel() == 0 || p.summarize) extras.push_back(fmt::format("size={}", shape_str(shape())));
  if (!is_cpu()) extras.push_back(fmt::format("device={}", device().str()));
  if (grad_fn()) {
    extras.push_back(fmt::format("grad_fn=<{}>", grad_fn()->name()));
  } else if (requires_grad()) {
    extras.push_back("requires_grad=True");  // as PyTorch prints it
  }
  for (const auto& e : extras) out += ", " + e;
  return out + ")";
}

std::ostream& operator<<(std::ostream& out, const Tensor& t) { return out << t.str(); }

}  // namespace halfgrad

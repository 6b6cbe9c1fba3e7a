// Copies and casts: Tensor::to, copy_, contiguous, clone, and the CPU copy kernel that converts dtypes.
#include "ops/copy.h"

#include <algorithm>
#include <map>
#include <tuple>
#include <utility>

#include "core/autograd.h"
#include "ops/elementwise_math.h"
#include "ops/loops.h"
#include "ops/shape.h"

namespace halfgrad {

KernelTable<CopyKernel> copy_kernel("copy");
KernelTable<CopyKernel> transfer_kernel("transfer between devices");
KernelTable<CopyEachKernel> copy_each_kernel("copy_each_");

namespace {
// Where a cast of t to `dtype` goes: t's layout kept, as PyTorch's to() keeps it.
Tensor empty_cast_of(const Tensor& t, DType dtype) {
  return empty(t.shape(), {.dtype = dtype, .device = t.device()}, kept_memory_format(t));
}
}  // namespace

Tensor cast_nograd(const Tensor& t, DType dtype) {
  if (t.dtype() == dtype) return t;
  Tensor out = empty_cast_of(t, dtype);
  copy_kernel[t.device()](out, t);
  return out;
}

namespace {
// A copy of t on `device` (same dtype), contiguous, or channels_last or aligned rows when t is (as PyTorch's to()
// keeps the layout): the storage moves as it is, padding included.
Tensor transfer(const Tensor& t, Device device) {
  const MemoryFormat format = kept_memory_format(t);
  const Tensor src = format == MemoryFormat::Contiguous ? t.contiguous() : t;
  Tensor out = empty(t.shape(), {.dtype = t.dtype(), .device = device}, format);
  Device backend = device.is_cpu() ? src.device() : device;  // the non-CPU side performs the copy
  transfer_kernel[backend](flat_storage_view(out), flat_storage_view(src));
  return out;
}
}  // namespace

// Autocast category: "unchanged" (a cast is what autocast inserts).
namespace {
// `out` is t cast to another dtype.
void record_cast(const Tensor& t, const Tensor& out) {
  if (any_requires_grad({&t}) && is_floating(out.dtype())) {
    // The engine casts each gradient to its input's dtype: the gradient passes back unchanged otherwise.
    record("ToBackward", {t}, {out}, [](const GradContext& g) -> TensorList { return {g[0]}; },
           DoubleBackward::Supported);
  }
}
}  // namespace

Tensor Tensor::to(DType dtype) const {
  if (dtype == this->dtype()) return *this;
  Tensor out = cast_nograd(*this, dtype);
  record_cast(*this, out);
  return out;
}

Tensor as_cast_of(const Tensor& t, const Tensor& values) {
  // A tensor of its own on values' storage, for a node of its own (values may be an earlier region's cast), and not a
  // view: what a fresh cast would be (is_aligned_rows, for one, refuses views).
  Tensor out = values.detach();
  out.impl()->is_view = out.impl()->is_detached = false;
  record_cast(t, out);
  return out;
}

Tensor Tensor::to(Device device) const {
  if (device == this->device()) return *this;
  Tensor out = transfer(*this, device);
  if (any_requires_grad({this})) {
    Device from = this->device();
    record("ToBackward", {*this}, {out}, [from](const GradContext& g) -> TensorList { return {g[0].to(from)}; },
           DoubleBackward::Supported);
  }
  return out;
}

Tensor Tensor::to(Device device, DType dtype) const {
  // Cast on the side where elements are smaller: fewer bytes cross the bus.
  if (element_size(dtype) < element_size(this->dtype())) return to(dtype).to(device);
  return to(device).to(dtype);
}

Tensor& Tensor::copy_(const Tensor& src) {
  const bool records = GradMode::is_enabled() && (requires_grad() || src.requires_grad());
  {
    NoGradGuard no_grad;
    Tensor from = src.device() == device() ? src : src.to(device(), dtype());
    // From a copy where src shares memory with this tensor (m.copy_(m.t())): the kernel would read what it wrote.
    if (overlaps_partially(*this, from)) from = from.clone();
    const Tensor source = broadcast_view(from, shape(), "copy_");  // a shape refused before the version moves
    check_inplace(*this, "copy_", records);
    copy_kernel[device()](*this, source);
  }
  if (records) {
    Shape src_shape = src.shape();
    const Device src_device = src.device();
    // This tensor's old value is overwritten: its history gets a zero gradient from here on (an input of the node, so
    // that the tensor takes the node's history even where src does not require grad). src's gradient goes back to
    // src's device (a copy between devices, as PyTorch's).
    record("CopyBackward", {src, *this}, {*this}, [src_shape, src_device](const GradContext& g) -> TensorList {
      return {g.needs(0) ? sum_to(g[0], src_shape).to(src_device) : Tensor(), g.needs(1) ? zeros_like(g[0]) : Tensor()};
    }, DoubleBackward::Supported);
    rebase_history(*this);
  }
  return *this;
}

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  Tensor out = empty(shape(), {.dtype = dtype(), .device = device()});
  copy_kernel[device()](out, *this);
  if (any_requires_grad({this})) {
    record("ContiguousBackward", {*this}, {out}, [](const GradContext& g) -> TensorList { return {g[0]}; },
           DoubleBackward::Supported);
  }
  return out;
}

Tensor contiguous_aligned_rows(const Tensor& t) {
  HG_CHECK(t.defined() && t.dim() == 2, "contiguous_aligned_rows: expected a 2-D tensor, got {}",
           t.defined() ? t.meta() : "an undefined tensor");
  if (is_aligned_rows(t)) return t;
  Tensor out = empty(t.shape(), {.dtype = t.dtype(), .device = t.device()}, MemoryFormat::AlignedRows);
  copy_kernel[t.device()](out, t);
  if (any_requires_grad({&t})) {
    record("ContiguousBackward", {t}, {out}, [](const GradContext& g) -> TensorList { return {g[0]}; },
           DoubleBackward::Supported);
  }
  return out;
}

Tensor Tensor::clone() const {
  Tensor out = empty(shape(), {.dtype = dtype(), .device = device()}, suggest_memory_format(*this));
  copy_kernel[device()](out, *this);
  if (any_requires_grad({this})) {
    record("CloneBackward", {*this}, {out}, [](const GradContext& g) -> TensorList { return {g[0]}; },
           DoubleBackward::Supported);
  }
  return out;
}

bool copy_each_kernel_takes(DType dst, DType src) {
  const bool narrow_or_widen = (dst == kFloat32 && is_half(src)) || (is_half(dst) && src == kFloat32);
  return dst == src || narrow_or_widen;
}

namespace {
// Contiguous or channels_last: a tensor whose storage holds its elements alone, in its layout's order. Two of one
// shape and one such layout are copied as their storages' 1-D views: element i of one is element i of the other.
// (Not aligned rows: their padding is no element.)
bool flat_in_storage(const Tensor& t) {
  const std::optional<MemoryFormat> format = storage_format(t);
  return format == MemoryFormat::Contiguous || format == MemoryFormat::ChannelsLast;
}

bool laid_out_alike(const Tensor& d, const Tensor& s) {
  return flat_in_storage(d) && storage_format(d) == storage_format(s);
}

// copy_each_ past its checks: the pairs copy_each_kernel takes, grouped by device and dtypes, a launch (on CUDA) a
// group; the others one by one.
void copy_pairs(const TensorList& dst, const TensorList& src) {
  NoGradGuard no_grad;
  std::map<std::tuple<int, int, int, int>, std::pair<TensorList, TensorList>> batched;  // device type, index, dtypes
  for (size_t i = 0; i < dst.size(); ++i) {
    const Tensor &d = dst[i], &s = src[i];
    if (d.numel() == 0) continue;
    if (laid_out_alike(d, s) && copy_each_kernel_takes(d.dtype(), s.dtype())) {
      auto& [ds, ss] = batched[{int(d.device().type), d.device().index, int(d.dtype()), int(s.dtype())}];
      ds.push_back(flat_storage_view(d));
      ss.push_back(flat_storage_view(s));
    } else {
      copy_kernel[d.device()](d, s);
    }
  }
  for (auto& [key, lists] : batched) copy_each_kernel[lists.first[0].device()](lists.first, lists.second);
}
}  // namespace

void copy_each_(const TensorList& dst, const TensorList& src) {
  HG_CHECK(dst.size() == src.size(), "copy_each_: {} destinations for {} sources", dst.size(), src.size());
  for (size_t i = 0; i < dst.size(); ++i) {  // every pair checked before any is copied, or any version bumped
    HG_CHECK(dst[i].shape() == src[i].shape() && dst[i].device() == src[i].device(), "copy_each_: pair {}: {} <- {} "
             "(each pair must have one shape and one device)", i, dst[i].meta(), src[i].meta());
    // (The batched kernel reads and writes in no order: x[1:] <- x[:-1] came out all zeros.)
    HG_CHECK(!overlaps_partially(dst[i], src[i]), "copy_each_: pair {}: the destination {} and the source {} share "
             "some of their memory; copy a clone() of the source", i, dst[i].meta(), src[i].meta());
    check_writable(dst[i], "copy_each_", /*records=*/false);
  }
  for (const Tensor& d : dst) check_inplace(d, "copy_each_", /*records=*/false);
  copy_pairs(dst, src);
}

bool casts_in_batches(const Tensor& t, DType dtype) {
  // cast_each's destination keeps t's layout (empty_cast_of): laid out alike where t is flat in its storage.
  return t.dtype() != dtype && copy_each_kernel_takes(dtype, t.dtype()) && flat_in_storage(t);
}

TensorList cast_each(const TensorList& tensors, const std::vector<DType>& dtypes) {
  HG_CHECK(tensors.size() == dtypes.size(), "cast_each: {} tensors for {} dtypes", tensors.size(), dtypes.size());
  TensorList out;
  for (size_t i = 0; i < tensors.size(); ++i) out.push_back(empty_cast_of(tensors[i], dtypes[i]));
  copy_pairs(out, tensors);
  return out;
}

namespace {
// float16 <-> float32 between contiguous tensors of one shape (what autocast's casts are): the hardware's
// conversion instructions, in blocks over the threads.
bool copy_half_float(const Tensor& dst, const Tensor& src) {
  const bool widen = dst.dtype() == kFloat32 && src.dtype() == kFloat16;
  const bool narrow = dst.dtype() == kFloat16 && src.dtype() == kFloat32;
  if (!(widen || narrow) || !dst.is_contiguous() || !src.is_contiguous() || dst.shape() != src.shape()) return false;
  const int64_t n = dst.numel();
  constexpr int64_t kBlock = 1 << 14;
  auto blocks = [&](auto convert, const auto* from, auto* to) {
#pragma omp parallel for if (n > 4 * kBlock)
    for (int64_t i = 0; i < n; i += kBlock) convert(from + i, to + i, std::min(kBlock, n - i));
  };
  if (widen) {
    blocks(half_to_float, src.data<Half>(), dst.data<float>());
  } else {
    blocks(float_to_half, src.data<float>(), dst.data<Half>());
  }
  return true;
}

// A copy within one dtype moves bits: NaN payloads and signed zeros arrive as they were, whatever the layout.
template <typename Bits> void copy_bits(const Tensor& dst, const Tensor& src) {
  cpu::map<Bits, Bits>(dst, [](Bits x) { return x; }, {src});
}

void copy_cpu(const Tensor& dst, const Tensor& src) {
  HG_CHECK(src.is_cpu() && dst.is_cpu(), "copy: cpu kernel given {} -> {}", src.meta(), dst.meta());
  if (copy_half_float(dst, src)) return;
  if (dst.dtype() == src.dtype()) {
    switch (element_size(dst.dtype())) {
      case 1: return copy_bits<uint8_t>(dst, src);
      case 2: return copy_bits<uint16_t>(dst, src);
      case 4: return copy_bits<uint32_t>(dst, src);
      default: return copy_bits<uint64_t>(dst, src);
    }
  }
  dispatch_all(dst.dtype(), "copy", [&]<typename To>() {
    dispatch_all(src.dtype(), "copy", [&]<typename From>() {
      // auto: float16 arrives as float in contiguous runs (cpu::map)
      cpu::map<To, From>(dst, [](auto x) { return convert_value<To>(x); }, {src});
    });
  });
}
}  // namespace

// The CPU has no launches to save: a copy each.
void copy_each_cpu(const TensorList& dst, const TensorList& src) {
  for (size_t i = 0; i < dst.size(); ++i) copy_cpu(dst[i], src[i]);
}

HG_REGISTER_KERNEL(copy_kernel, CPU, copy_cpu);
HG_REGISTER_KERNEL(copy_each_kernel, CPU, copy_each_cpu);

}  // namespace halfgrad

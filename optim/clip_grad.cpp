#include "optim/clip_grad.h"

#include <algorithm>
#include <cmath>

#include "core/autograd.h"
#include "ops/elementwise.h"
#include "ops/shape.h"
#include "optim/fused.h"

namespace halfgrad::optim {

namespace {

// The defined gradients of `params`, grouped by (device, dtype): one fused kernel call each.
std::vector<TensorList> gradient_buckets(const TensorList& params, const char* op) {
  std::vector<TensorList> buckets;
  for (const Tensor& p : params) {
    HG_CHECK(p.defined(), "{}: an undefined tensor among the parameters", op);
    Tensor g = p.grad();
    if (!g.defined()) continue;
    HG_CHECK(g.is_floating_point(), "{}: gradients must be floating point, got {}", op, g.meta());
    auto it = std::find_if(buckets.begin(), buckets.end(), [&](const TensorList& b) {
      return b[0].device() == g.device() && b[0].dtype() == g.dtype();
    });
    if (it == buckets.end()) {
      buckets.emplace_back();
      it = buckets.end() - 1;
    }
    it->push_back(g);
  }
  return buckets;
}

void check_norm_type(double norm_type, const char* op) {
  HG_CHECK(norm_type > 0, "{}: norm_type must be positive (or INFINITY), got {}", op, norm_type);
}

Tensor total_norm(const std::vector<TensorList>& buckets, double norm_type) {
  if (buckets.empty()) return zeros({});
  bool all_float64 = true;
  for (const TensorList& b : buckets) all_float64 = all_float64 && b[0].dtype() == kFloat64;
  const DType dtype = all_float64 ? kFloat64 : kFloat32;
  const Device device = buckets[0][0].device();
  const bool inf = std::isinf(norm_type);

  // Per bucket: sum |g|^p (or max |g|) on the bucket's device; then combined on the first one.
  Tensor reduced;
  for (const TensorList& b : buckets) {
    TensorList flat;  // the norm does not depend on the order of the elements: any dense layout is read in place
    for (const Tensor& g : b) flat.push_back(flat_storage_view(storage_format(g) ? g : g.contiguous()));
    Tensor part = empty({}, {.dtype = accumulation_dtype(b[0].dtype()), .device = b[0].device()});
    norm_kernel[part.device()](flat, norm_type, part);
    part = part.to(device, dtype);
    reduced = !reduced.defined() ? part : inf ? maximum(reduced, part) : reduced + part;
  }
  if (inf || norm_type == 1) return reduced;
  if (norm_type == 2) return reduced.sqrt();
  return reduced.pow(1.0 / norm_type);
}

// Multiplies the gradients of every bucket by `coefficient`.
void scale_buckets(const std::vector<TensorList>& buckets, const Tensor& coefficient) {
  for (const TensorList& b : buckets) {
    Tensor c = coefficient.to(b[0].device(), accumulation_dtype(b[0].dtype()));
    TensorList flat;
    for (const Tensor& g : b) {
      if (storage_format(g)) {
        flat.push_back(flat_storage_view(g));
      } else {
        Tensor strided = g;  // rare (a gradient some backward left strided): an ordinary in-place op
        strided.mul_(c.to(g.dtype()));
      }
    }
    if (!flat.empty()) scale_kernel[c.device()](flat, c);
  }
}

}  // namespace

Tensor grad_norm(const TensorList& params, double norm_type) {
  check_norm_type(norm_type, "grad_norm");
  NoGradGuard no_grad;
  return total_norm(gradient_buckets(params, "grad_norm"), norm_type);
}

Tensor clip_grad_norm_(const TensorList& params, double max_norm, double norm_type, bool error_if_nonfinite) {
  check_norm_type(norm_type, "clip_grad_norm_");
  NoGradGuard no_grad;
  const std::vector<TensorList> buckets = gradient_buckets(params, "clip_grad_norm_");
  Tensor norm = total_norm(buckets, norm_type);
  if (error_if_nonfinite) {
    const double value = norm.item<double>();
    HG_CHECK(std::isfinite(value), "clip_grad_norm_: the total norm of order {} of the gradients is {}, so they cannot "
             "be clipped (error_if_nonfinite is set; no gradient was changed)", norm_type, value);
  }
  if (!buckets.empty()) scale_buckets(buckets, clip_coefficient(norm, max_norm));
  return norm;
}

void clip_grad_value_(const TensorList& params, double clip_value) {
  HG_CHECK(clip_value >= 0, "clip_grad_value_: clip_value must not be negative, got {}", clip_value);
  NoGradGuard no_grad;
  for (const TensorList& bucket : gradient_buckets(params, "clip_grad_value_"))
    for (Tensor g : bucket) g.clamp_(-clip_value, clip_value);
}

Tensor clip_coefficient(const Tensor& norm, double max_norm) {
  NoGradGuard no_grad;
  return (max_norm / (norm + 1e-6)).clamp(std::nullopt, 1.0);
}

void scale_grads_(const TensorList& params, const Tensor& coefficient) {
  NoGradGuard no_grad;
  scale_buckets(gradient_buckets(params, "scale_grads_"), coefficient);
}

}  // namespace halfgrad::optim

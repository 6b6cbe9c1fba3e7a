#pragma once
// apply_in_place: an in-place op (x.add_(y), x.scatter_(...)) as its out-of-place op followed by a write into self,
// with autograd's rules for in-place writes. Ops whose kernel can write into self directly when nothing records
// (binary_inplace in ops/elementwise.cpp, scatter_in_place in ops/gather.cpp) take that path first and this one
// otherwise.
#include "core/autograd.h"
#include "core/tensor.h"
#include "ops/copy.h"

namespace halfgrad {

// self = compute_out_of_place(self), `others` being the op's other tensor operands. With autograd the op runs on a
// copy of self (so what backward saves is not overwritten), the result is written back, and self's history moves to
// the new node (where self is a view, its base's history to a CopySlices node: rebase_history); without it the op
// reads self itself. self's version is bumped after the operands were read and checked, just before the write: a
// refused op leaves it as it was, and an operand that is self itself (x.mul_(x)) is saved at the version the write
// makes stale, so its backward refuses, as PyTorch's does.
template <typename Compute>
Tensor& apply_in_place(Tensor& self, const char* name, const TensorList& others, Compute compute_out_of_place) {
  bool graph = GradMode::is_enabled() && (self.requires_grad() || any_requires_grad(others));
  Tensor result;
  if (graph) {
    result = compute_out_of_place(self.clone());
  } else {
    NoGradGuard no_grad;
    result = compute_out_of_place(self);
  }
  HG_CHECK(result.shape() == self.shape(), "{}: the result shape {} does not match the in-place target {}", name,
           shape_str(result.shape()), self.meta());
  // PyTorch's can_cast: a floating result into an integral tensor, or a number into a bool one, would lose values.
  HG_CHECK((is_floating(self.dtype()) || !is_floating(result.dtype())) &&
               (self.dtype() != kBool || result.dtype() == kBool),
           "{}: result type {} can't be cast to the in-place target {}", name, dtype_name(result.dtype()), self.meta());
  check_inplace(self, name, graph);
  {
    NoGradGuard no_grad;
    copy_kernel[self.device()](self, cast_nograd(result, self.dtype()));
  }
  if (graph) {
    set_history(self, result.grad_fn(), result.output_nr());
    rebase_history(self);
  }
  return self;
}

}  // namespace halfgrad

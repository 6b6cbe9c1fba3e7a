// stack = cat of the inputs, each unsqueezed at the new dim; cat records the backward (each input gets
// its slice of the gradient), unsqueeze's backward squeezes it back.
#include "ops/stack.h"

#include "core/autocast.h"
#include "ops/shape.h"

namespace halfgrad {

Tensor stack(const TensorList& tensors, int64_t dim) {
  HG_AUTOCAST(stack, tensors, dim);
  HG_CHECK(!tensors.empty(), "stack: expects a non-empty list of tensors");
  const Tensor& first = tensors[0];
  for (size_t i = 0; i < tensors.size(); ++i) {
    HG_CHECK(tensors[i].defined(), "stack: tensor {} is undefined", i);
    HG_CHECK(tensors[i].shape() == first.shape(),
             "stack: expects each tensor to be of equal shape, but tensor 0 is {} and tensor {} is {}", first.meta(),
             i, tensors[i].meta());
    HG_CHECK(tensors[i].device() == first.device(), "stack: tensor 0 is {} and tensor {} is {} (different devices)",
             first.meta(), i, tensors[i].meta());
  }
  const int64_t d = wrap_dim(dim, first.dim() + 1, "stack");
  TensorList unsqueezed;
  unsqueezed.reserve(tensors.size());
  for (const Tensor& t : tensors) unsqueezed.push_back(t.unsqueeze(d));
  return cat(unsqueezed, d);
}

}  // namespace halfgrad

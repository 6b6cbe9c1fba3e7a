#pragma once
// Errors: every check throws halfgrad::Error with a message that names the op and its operands.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <stdexcept>
#include <string>

namespace halfgrad {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A device allocator found no memory, even after releasing what it had cached. The message gives the
// size asked for and the allocator's statistics. Catch it to retry with a smaller batch.
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

// HG_CHECK(x.dim() == 2, "matmul: expected a 2-D tensor, got {}", x.meta());
#define HG_CHECK(cond, ...)                                               \
  do {                                                                    \
    if (!(cond)) throw ::halfgrad::Error(::fmt::format(__VA_ARGS__));     \
  } while (0)

#define HG_FAIL(...) throw ::halfgrad::Error(::fmt::format(__VA_ARGS__))

}  // namespace halfgrad

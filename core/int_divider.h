#pragma once
// 32-bit division by a value known only at run time, as a multiply-high, an add and a shift (Granlund & Montgomery,
// "Division by invariant integers using multiplication", 1994): the GPU has no integer divide instruction, and its
// division by a run-time value costs ~20 instructions, which index arithmetic pays for every element. The divisor's
// multiplier is found once, on the host; exact for divisors in [1, 2^31] and numerators below 2^31.
//
//   const IntDivider columns{uint32_t(width)};   // on the host
//   const uint32_t row = columns.div(index);     // in a kernel: index / width
#include <cstdint>

#include "core/error.h"
#include "core/half.h"  // HG_HOST_DEVICE

namespace halfgrad {

struct IntDivider {
  uint32_t divisor = 1, magic = 1, shift = 0;

  IntDivider() = default;
  // shift = ceil(log2 d); magic = floor(2^32 (2^shift - d) / d) + 1, so that n / d = (hi32(n magic) + n) >> shift.
  explicit IntDivider(uint32_t d) : divisor(d) {
    HG_CHECK(d >= 1 && d <= (uint32_t(1) << 31), "IntDivider: divisor {} outside [1, 2^31]", d);
    while (shift < 32 && (uint64_t(1) << shift) < d) ++shift;
    magic = uint32_t(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d)) / d + 1);
  }
  // n / divisor, for n below 2^31 (the add would carry out of 32 bits above).
  HG_HOST_DEVICE uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t high = __umulhi(n, magic);
#else
    const uint32_t high = uint32_t((uint64_t(n) * magic) >> 32);
#endif
    return (high + n) >> shift;
  }
};

}  // namespace halfgrad

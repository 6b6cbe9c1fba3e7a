#pragma once
// 16-bit floating-point storage types: IEEE binary16 (Half) and bfloat16 (BFloat16).
//
// They are plain 2-byte structs on purpose: kernels load them, convert to float, compute in float and
// convert back (the "accumulate in float32" rule of mixed precision). The bit layout is the one CUDA's
// __half / __nv_bfloat16 use, so a device kernel may reinterpret the same memory.
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define HG_HOST_DEVICE __host__ __device__
// In device code the conversions below use the GPU's conversion instructions (same rounding: to nearest,
// ties to even); the portable bit manipulation costs enough instructions per element to make float16
// kernels compute-bound (measured on an H200: float16 add at 61% of copy bandwidth, 100% with these).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#else
#define HG_HOST_DEVICE
#endif

namespace halfgrad {

namespace detail {
HG_HOST_DEVICE inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
HG_HOST_DEVICE inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
}  // namespace detail

struct BFloat16 {
  uint16_t bits = 0;

  BFloat16() = default;
  HG_HOST_DEVICE BFloat16(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    bits = __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
    bits = round_from_float(f);
#endif
  }
  HG_HOST_DEVICE operator float() const { return detail::bits_float(uint32_t(bits) << 16); }

  static HG_HOST_DEVICE BFloat16 from_bits(uint16_t b) {
    BFloat16 h;
    h.bits = b;
    return h;
  }
  // Round to nearest, ties to even; NaN stays a (quiet) NaN instead of rounding into infinity.
  static HG_HOST_DEVICE uint16_t round_from_float(float f) {
    uint32_t u = detail::float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
    uint32_t lsb = (u >> 16) & 1u;
    return uint16_t((u + 0x7fffu + lsb) >> 16);
  }
};

struct Half {
  uint16_t bits = 0;

  Half() = default;
  HG_HOST_DEVICE Half(float f) {
#if defined(__CUDA_ARCH__)
    bits = __half_as_ushort(__float2half_rn(f));
#else
    bits = round_from_float(f);
#endif
  }
  HG_HOST_DEVICE operator float() const {
#if defined(__CUDA_ARCH__)
    return __half2float(__ushort_as_half(bits));
#else
    return to_float(bits);
#endif
  }

  static HG_HOST_DEVICE Half from_bits(uint16_t b) {
    Half h;
    h.bits = b;
    return h;
  }

  // Exact widening: binary16 -> binary32 (normals, subnormals, inf, nan).
  static HG_HOST_DEVICE float to_float(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0x1f) return detail::bits_float(sign | 0x7f800000u | (mant << 13));  // inf / nan
    if (exp == 0) {
      if (mant == 0) return detail::bits_float(sign);
      // Subnormal: value = mant * 2^-24, exact in float.
      float v = float(mant) * 5.9604644775390625e-8f;
      return sign ? -v : v;
    }
    return detail::bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
  }

  // Narrowing with round to nearest, ties to even; overflow goes to infinity, as the hardware does.
  static HG_HOST_DEVICE uint16_t round_from_float(float f) {
    uint32_t u = detail::float_bits(f);
    uint16_t sign = uint16_t((u >> 16) & 0x8000u);
    uint32_t abs = u & 0x7fffffffu;
    if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u);   // nan
    if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520 -> inf
    if (abs < 0x38800000u) {
      // Result is subnormal (or zero) in half: scale so the half ulp (2^-24) becomes 1 and round.
      // Adding 0.5 (as a float with the right exponent) performs round-to-nearest-even in hardware.
      float a = detail::bits_float(abs);
      float r = a + 0.5f;  // the ulp of 0.5f is 2^-24: the integer part's bits are the result
      return uint16_t(sign | uint16_t(detail::float_bits(r) - detail::float_bits(0.5f)));
    }
    uint32_t lsb = (abs >> 13) & 1u;
    abs += 0xfffu + lsb;  // round mantissa to 10 bits, ties to even
    return uint16_t(sign | uint16_t((abs - (112u << 23)) >> 13));
  }
};

// ---- bulk conversions of contiguous arrays on the CPU: the hardware's F16C instructions, 8 values at a time,
// when the build targets them (HALFGRAD_NATIVE on any x86 of the last decade), else the scalar code above. Same
// results (round to nearest even, overflow to infinity), except that a NaN keeps its payload's top bits here.
void half_to_float(const Half* src, float* dst, int64_t n);
void float_to_half(const float* src, Half* dst, int64_t n);

}  // namespace halfgrad

// metal_compat.h: the Metal types and builtins that the shaders in metal/ use, modelled in C++17,
// so that each shader body compiles with g++ unchanged and runs over its whole grid on the CPU
// (tensorfold/mlx/metal.py builds it; tests/test_metal_shaders.py checks it against the torch
// references, bit for bit). Never included on a Mac: there the same bodies go to
// mx.fast.metal_kernel, which brings <metal_stdlib> and generates the kernel signature.
//
// What is modelled, and how faithfully:
// - address-space qualifiers (device, constant, thread) are empty: a CPU has one address space;
// - scalar types (uint, ulong, ...) are the fixed-width integers Metal defines them as;
//   float is IEEE binary32 (SSE on x86-64, compiled with -ffp-contract=off, no fast math);
// - half and bfloat16_t are their bit patterns with an exact conversion to float (the shaders
//   only read them);
// - as_type<T> is a bit copy (memcpy), metal::floor is floor: both exact on either side;
// - clz of a 32-bit uint, with Metal's clz(0) == 32;
// - uint3 thread_position_in_grid: the wrapper metal.py generates calls the body once per grid
//   position, in order. The shaders use no threadgroup memory, barriers or SIMD-group functions,
//   so the order of the threads cannot change a result and a serial walk is a faithful model.
#ifndef TF_METAL_COMPAT
#define TF_METAL_COMPAT

#include <cmath>
#include <cstdint>
#include <cstring>

typedef unsigned int uint;
typedef unsigned long ulong;
typedef unsigned short ushort;
typedef unsigned char uchar;
static_assert(sizeof(long) == 8 && sizeof(ulong) == 8, "Metal's long and ulong are 64 bits");

#define device
#define thread
#define constant const

struct uint3 {
  uint x, y, z;
};

template <typename To, typename From>
inline To as_type(From from) {
  static_assert(sizeof(To) == sizeof(From), "as_type keeps the size");
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}

// IEEE binary16, read only: its bits widened exactly to float.
struct half {
  ushort bits;
  operator float() const {
    uint sign = uint(bits >> 15) << 31;
    int exp = (bits >> 10) & 0x1F;
    uint frac = bits & 0x3FF;
    if (exp == 0x1F) return as_type<float>(sign | 0x7F800000u | (frac << 13));
    if (exp == 0) {  // zero or subnormal: frac 2^-24, exact in float
      float mag = float(frac) * 5.9604644775390625e-08f;
      return sign ? -mag : mag;
    }
    return as_type<float>(sign | (uint(exp - 15 + 127) << 23) | (frac << 13));
  }
};
typedef half float16_t;

// bfloat16: the top half of a float's bits.
struct bfloat16_t {
  ushort bits;
  operator float() const { return as_type<float>(uint(bits) << 16); }
};

namespace metal {
inline float floor(float x) { return std::floor(x); }
inline uint clz(uint x) { return x == 0 ? 32u : uint(__builtin_clz(x)); }
}  // namespace metal
using metal::clz;

#endif  // TF_METAL_COMPAT

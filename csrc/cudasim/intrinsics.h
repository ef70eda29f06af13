// Device math and bit-cast intrinsics on the host, with the device's rounding: every *_rn
// intrinsic is one IEEE operation in round-to-nearest-even (the simulator is built with
// -ffp-contract=off, so nothing is fused behind the kernel's back), __fmaf_rn is a true fma.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace cudasim {
template <typename To, typename From>
inline To bit_cast(From f) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast between types of different sizes");
  To t;
  std::memcpy(&t, &f, sizeof(To));
  return t;
}
}  // namespace cudasim

inline unsigned int __float_as_uint(float x) { return cudasim::bit_cast<unsigned int>(x); }
inline float __uint_as_float(unsigned int x) { return cudasim::bit_cast<float>(x); }
inline int __float_as_int(float x) { return cudasim::bit_cast<int>(x); }
inline float __int_as_float(int x) { return cudasim::bit_cast<float>(x); }
inline long long __double_as_longlong(double x) { return cudasim::bit_cast<long long>(x); }
inline double __longlong_as_double(long long x) { return cudasim::bit_cast<double>(x); }

inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __frcp_rn(float a) { return 1.f / a; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }

inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
// Byte n of the result is byte ((s >> 4n) & 7) of the eight bytes of a (0-3) then b (4-7).
inline unsigned int __byte_perm(unsigned int a, unsigned int b, unsigned int s) {
  const uint64_t ab = static_cast<uint64_t>(b) << 32 | a;
  unsigned int r = 0;
  for (int n = 0; n < 4; ++n)
    r |= static_cast<unsigned int>(ab >> (8 * (s >> (4 * n) & 7u)) & 0xffu) << (8 * n);
  return r;
}
inline int __ffs(int x) { return __builtin_ffs(x); }

// The device's min/max overloads (integers of any width and sign, float, double).
template <typename A, typename B,
          typename = std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>>>
inline std::common_type_t<A, B> min(A a, B b) {
  using C = std::common_type_t<A, B>;
  if constexpr (std::is_floating_point_v<C>) {
    return std::fmin(static_cast<C>(a), static_cast<C>(b));
  } else {
    return static_cast<C>(b) < static_cast<C>(a) ? static_cast<C>(b) : static_cast<C>(a);
  }
}
template <typename A, typename B,
          typename = std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>>>
inline std::common_type_t<A, B> max(A a, B b) {
  using C = std::common_type_t<A, B>;
  if constexpr (std::is_floating_point_v<C>) {
    return std::fmax(static_cast<C>(a), static_cast<C>(b));
  } else {
    return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(b) : static_cast<C>(a);
  }
}

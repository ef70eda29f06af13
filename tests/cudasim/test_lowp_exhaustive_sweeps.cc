// Exhaustive sweeps behind two kernel shortcuts, too slow for every run (minutes each): run them
// after changing either with --gtest_also_run_disabled_tests --gtest_filter='*Exhaustive*'.
//  - fp4::div6_rn (NVFP4's amax / 6 by two fmas, csrc/core/lowp/fp4.h) on all 2^32 bit patterns:
//    the same bits as fp32 x / 6 for every one but +Inf (NaN there, which nv_scale_code_nodiv
//    never passes it: +Inf is its NaN-block marker, returned before); NaN stays NaN.
//  - fp8dev::FastDiv (the 1x128 kernel's row lookup, csrc/cuda/fp8_device.cuh) for every divisor
//    below 2^31: with M = magic + 2^32 and e = M * d - 2^(32 + l), (hi + n) >> l equals
//    floor(n / d + n * e / (d * 2^(32 + l))), exact for every n < 2^31 when 2^(l - 1) < d <= 2^l
//    and 0 < e <= d (the excess stays below 1 / d); checked for each d, with its worst numerators.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

#include "core/lowp/fp4.h"
#include "cudasim/cudasim.h"

// After cudasim.h, which gives its device code the intrinsics on the host.
#include "cuda/fp8_device.cuh"

namespace tierlift {
namespace {

TEST(LowpExhaustive, DISABLED_DivideBySixOnAllBitPatterns) {
  int64_t bad = 0;
  for (uint64_t u = 0; u <= 0xffffffffull; ++u) {
    const uint32_t b = static_cast<uint32_t>(u);
    if (b == 0x7f800000u) continue;  // +Inf: the NaN-block marker, never divided
    const float x = fp4::from_bits(b);
    const float want = x / 6.f, got = fp4::div6_rn(x);
    const bool same = std::isnan(want) ? std::isnan(got) : fp4::bits(got) == fp4::bits(want);
    if (!same && ++bad <= 5) ADD_FAILURE() << "bits " << b << ": " << got << ", want " << want;
  }
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(fp4::nv_scale_code_nodiv(fp4::inf_f32(), 1.f), fp4::kE4M3Nan);
}

TEST(LowpExhaustive, DISABLED_MultiplyShiftDivisionOnAllDivisors) {
  int64_t bad = 0;
  constexpr uint32_t kMaxN = 0x7fffffffu;
  for (uint64_t d = 1; d <= kMaxN; ++d) {
    const cuda::fp8dev::FastDiv f = cuda::fp8dev::FastDiv::of(static_cast<uint32_t>(d));
    const unsigned __int128 m = static_cast<unsigned __int128>(f.magic) + (uint64_t{1} << 32);
    const unsigned __int128 p = static_cast<unsigned __int128>(1) << (32 + f.shift);
    const bool shift_ok = f.shift <= 31 && (uint64_t{1} << f.shift) >= d &&
                          (f.shift == 0 || (uint64_t{1} << (f.shift - 1)) < d);
    const bool excess_ok = m * d > p && m * d - p <= d;
    // The largest numerators, and the last with remainder d - 1 (the largest error) and after it.
    const uint32_t worst = static_cast<uint32_t>((uint64_t{kMaxN} + 1) / d * d - 1);
    const bool div_ok = f.div(kMaxN) == kMaxN / d && f.div(worst) == worst / d &&
                        (worst == kMaxN || f.div(worst + 1) == (worst + 1) / d);
    if (!(shift_ok && excess_ok && div_ok) && ++bad <= 5) ADD_FAILURE() << "divisor " << d;
  }
  EXPECT_EQ(bad, 0);
}

}  // namespace
}  // namespace tierlift

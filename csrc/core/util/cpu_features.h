// Which SIMD instruction sets this CPU can run, and which one tierlift should use.
//
// Kernels are compiled for AVX-512, AVX2 and plain C++ in the same binary; the path is picked
// at run time so one wheel runs everywhere. TIERLIFT_SIMD=avx512|avx2|scalar forces a path (an
// unsupported forced path falls back to the best the CPU has), which lets tests cover all three
// paths on one machine.
#pragma once

namespace tierlift {

enum class SimdLevel { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// Best level the CPU and OS support (cached after the first call).
SimdLevel cpu_simd_level();

// The level kernels should use now: TIERLIFT_SIMD if set and supported, else cpu_simd_level().
// Read on every call so tests can switch paths with setenv().
SimdLevel active_simd_level();

const char* simd_level_name(SimdLevel level);

}  // namespace tierlift

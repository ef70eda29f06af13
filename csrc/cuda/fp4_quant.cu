#include <cstdint>

#include "cuda/fp4_quant.cuh"
#include "cuda/launch.cuh"
#include "cuda/lowp_load.cuh"

namespace tierlift {
namespace cuda {
namespace {

constexpr int kThreads = 256;
// Consecutive elements of a row per thread: 16 (not 8) halves the per-thread work outside the
// per-element code (index math, block scale, votes); an NVFP4 block is one lane's.
constexpr int kPer = 16;
constexpr int kHalf = kPer / 2;  // elements per 16-byte bf16/fp16 load
constexpr unsigned kFull = 0xffffffffu;

// Where a thread's 16 elements live: flat index e0 = 16 * t, t = kThreads * `block` + thread
// (row-major over [rows, cols]), row i, column j0 (cols % 16 == 0, so the 16 never straddle a
// row). An NVFP4 block is one lane, lanes 2t and 2t + 1 share an MXFP4 block. The row is
// `per_row`.div(t) (threads per row; the launch checks t < 2^31), a division where it cannot be.
struct Chunk {
  int64_t e0, i = 0, j0 = 0;
  bool valid;  // false past the end: the lane still takes part in the shuffles with zeros
};

__device__ __forceinline__ void locate_row(const Fp4QuantArgs& a, Div31 per_row, Chunk& c) {
  if (per_row.magic) {
    c.i = c.valid ? per_row.div(static_cast<uint32_t>(c.e0 / kPer)) : 0;
  } else {
    c.i = c.valid ? c.e0 / a.cols : 0;
  }
  c.j0 = c.e0 - c.i * a.cols;
}

// kFlat: the row and column are left 0 (the lean path reads by flat index; NVFP4's 16x16 blocks
// locate the row where they need it).
template <bool kFlat>
__device__ __forceinline__ Chunk chunk_of(const Fp4QuantArgs& a, Div31 per_row, unsigned block) {
  Chunk c;
  c.e0 = (static_cast<int64_t>(block) * kThreads + threadIdx.x) * kPer;
  c.valid = c.e0 < a.rows * a.cols;
  if constexpr (!kFlat) locate_row(a, per_row, c);
  return c;
}

// The benchmark's path, compiled apart so it carries nothing it does not use (kLean): rows
// contiguous and 16-byte aligned (element e0 is at offset e0: no row, column or stride math), no
// Hadamard, round-to-nearest, no clip mask, aligned code stores.

// The thread's 16 elements, rotated. kVec: two 16-byte loads (four for fp32), for row-contiguous
// inputs with 8 | row stride and a 16-byte aligned base; strided loads otherwise. The Hadamard
// butterflies (a lane with bit h set takes a - b, the other a + b: fp4::hadamard_block's pairs
// and order) run in registers for h < 16 and across lanes (xor 1) for h = 16.
template <DType kT, bool kVec, bool kLean>
__device__ __forceinline__ void rotated(const Fp4QuantArgs& a, const Chunk& c, float (&v)[kPer]) {
  for (int k = 0; k < kPer; ++k) v[k] = 0.f;
  if constexpr (kLean) {
    if (c.valid) {
      constexpr uint64_t kBytes = kT == DType::kFloat32 ? 4 : 2;
      const void* p = static_cast<const char*>(a.x) + static_cast<uint64_t>(c.e0) * kBytes;
      float lo[kHalf], hi[kHalf];
      lowp::load_vec<kT, kHalf>(p, 0, lo);
      lowp::load_vec<kT, kHalf>(p, kHalf, hi);
      for (int k = 0; k < kHalf; ++k) v[k] = lo[k], v[k + kHalf] = hi[k];
    }
    return;
  }
  if (c.valid) {
    if constexpr (kVec) {
      const int64_t base = c.i * a.row_stride + c.j0;
      float lo[kHalf], hi[kHalf];
      lowp::load_vec<kT, kHalf>(a.x, base, lo);
      lowp::load_vec<kT, kHalf>(a.x, base + kHalf, hi);
      for (int k = 0; k < kHalf; ++k) v[k] = lo[k], v[k + kHalf] = hi[k];
    } else {
      const int64_t base = c.i * a.row_stride + c.j0 * a.col_stride;
      for (int k = 0; k < kPer; ++k) v[k] = lowp::load<kT>(a.x, base + k * a.col_stride);
    }
  }
  if (a.hadamard == 0) return;
  const int n = a.hadamard;
  for (int k = 0; k < kPer; ++k) {
    if ((a.signs >> ((c.j0 + k) & (n - 1))) & 1u) v[k] = -v[k];
  }
  for (int h = 1; h < kPer; h <<= 1) {
    float o[kPer];
    for (int k = 0; k < kPer; ++k) {
      o[k] = (k & h) ? __fsub_rn(v[k ^ h], v[k]) : __fadd_rn(v[k], v[k ^ h]);
    }
    for (int k = 0; k < kPer; ++k) v[k] = o[k];
  }
  for (int h = kPer; h < n; h <<= 1) {
    const bool upper = (c.j0 & h) != 0;
    for (int k = 0; k < kPer; ++k) {
      const float p = __shfl_xor_sync(kFull, v[k], h / kPer);
      v[k] = upper ? __fsub_rn(p, v[k]) : __fadd_rn(v[k], p);
    }
  }
  const float s = n == 16 ? fp4::kHadamardScale16 : fp4::kHadamardScale32;
  for (int k = 0; k < kPer; ++k) v[k] = __fmul_rn(v[k], s);
}

// The largest |v| of the thread's elements as bits, two operations per element: non-negative
// floats order like their bits, and a NaN or Inf has bits >= Inf's (kNonfiniteBits), so one
// compare of the block's maximum tells whether the block holds one; without one, the maximum is
// the finite amax itself.
constexpr uint32_t kNonfiniteBits = 0x7f800000u;
__device__ __forceinline__ uint32_t abs_max_bits(const float (&v)[kPer]) {
  uint32_t m = 0;
  TIERLIFT_UNROLL
  for (int k = 0; k < kPer; ++k) m = max(m, fp4::bits(v[k]) & 0x7fffffffu);
  return m;
}

// Max over the kLanes lanes (1 or 2) sharing a block.
template <int kLanes>
__device__ __forceinline__ uint32_t block_max(uint32_t m) {
  for (int h = kLanes / 2; h >= 1; h >>= 1) m = max(m, __shfl_xor_sync(kFull, m, h));
  return m;
}

// Philox4x32-10 of counter n, all four words.
__device__ __forceinline__ uint4 philox4(uint64_t seed, uint64_t n) {
  uint32_t w[4];
  fp4::philox4(seed, n, w);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// fp4::philox_uniform(seed, offset, e0 + k) for k < 16: the 16 elements' stream positions share
// 4 or 5 Philox counters, so each is computed once instead of once per element.
__device__ __forceinline__ void uniforms(const Fp4QuantArgs& a, int64_t e0, float (&u)[kPer]) {
  const uint64_t n0 = a.offset + static_cast<uint64_t>(e0);  // wraps as philox_uniform's sum
  const int r = static_cast<int>(n0 & 3u);
  const uint64_t base = n0 - static_cast<uint64_t>(r);
  uint32_t w[kPer + 4];
  TIERLIFT_UNROLL
  for (int n = 0; n < kPer / 4; ++n) {
    const uint4 p = philox4(a.seed, (base + 4 * n) >> 2);
    w[4 * n] = p.x, w[4 * n + 1] = p.y, w[4 * n + 2] = p.z, w[4 * n + 3] = p.w;
  }
  const uint4 tail = r ? philox4(a.seed, (base + kPer) >> 2) : make_uint4(0, 0, 0, 0);
  w[kPer] = tail.x, w[kPer + 1] = tail.y, w[kPer + 2] = tail.z, w[kPer + 3] = tail.w;
  TIERLIFT_UNROLL
  for (int k = 0; k < kPer; ++k) {  // word r + k, picked with constant indices (registers)
    const uint32_t x = r == 0 ? w[k] : r == 1 ? w[k + 1] : r == 2 ? w[k + 2] : w[k + 3];
    u[k] = static_cast<float>(x >> 8) * 5.9604644775390625e-8f;  // 2^-24
  }
}

// The lean path's codes of v, one 8-byte store: per 8-code word, v's top 4 bits (the sign, then
// exponent bits a final mask drops) shifted in last element first, one funnel shift each; the
// magnitudes (`magnitude`(v[k]), 0..7) paired into bytes (one shift-add per pair) and the 4
// bytes gathered by 3 byte permutes. `nan_block`: every code 0.
template <typename Magnitude>
__device__ __forceinline__ void store_lean(const Fp4QuantArgs& a, const Chunk& c, bool nan_block,
                                           const float (&v)[kPer], Magnitude magnitude) {
  if (!c.valid) return;
  uint32_t code[2];
  TIERLIFT_UNROLL
  for (int w = 0; w < 2; ++w) {
    uint32_t top = 0, pair[4];
    TIERLIFT_UNROLL
    for (int k = 8 * w + 7; k >= 8 * w; --k) top = (top << 4) | (fp4::bits(v[k]) >> 28);
    TIERLIFT_UNROLL
    for (int j = 0; j < 4; ++j) {
      pair[j] = (magnitude(v[8 * w + 2 * j + 1]) << 4) + magnitude(v[8 * w + 2 * j]);
    }
    const uint32_t mag = __byte_perm(__byte_perm(pair[0], pair[1], 0x0040),
                                     __byte_perm(pair[2], pair[3], 0x0040), 0x5410);
    code[w] = nan_block ? 0u : (top & 0x88888888u) | mag;
  }
  reinterpret_cast<uint2*>(a.codes)[c.e0 / kPer] = make_uint2(code[0], code[1]);
}

// Encodes v (RNE or Philox stochastic rounding), packs the 16 nibbles (first element low) into
// one 8-byte store and the clip mask into one 16-byte store (`packed`: the outputs are aligned,
// else byte stores). `nan_block`: the block has the NaN scale, so every v is NaN and every code 0;
// otherwise no v is NaN (a finite rotated value times a finite multiplier), so the RNE encode
// skips its per-element NaN test.
template <bool kLean>
__device__ __forceinline__ void encode_store(const Fp4QuantArgs& a, const Chunk& c, bool packed,
                                             bool nan_block, const float (&v)[kPer]) {
  if (!c.valid) return;
  if constexpr (kLean) {
    store_lean(a, c, nan_block, v, [](float x) { return fp4::e2m1_magnitude_rne(x); });
    return;
  }
  float u[kPer];
  if (a.stochastic) uniforms(a, c.e0, u);
  uint32_t code[2] = {0, 0}, mask[4] = {0, 0, 0, 0};
  TIERLIFT_UNROLL
  for (int k = 0; k < kPer; ++k) {
    const uint32_t q =
        a.stochastic ? fp4::e2m1_encode_sr(v[k], u[k]) : fp4::e2m1_encode_rne_not_nan(v[k]);
    code[k / 8] |= q << (4 * (k % 8));
    // Named, not inline in the shift: GCC 12 with -fsanitize=undefined (the ASan build of the
    // simulator) drops the bits of `(cond ? 1u : 0u) << n` in this unrolled loop.
    const uint32_t representable = fabsf(v[k]) <= fp4::kMax ? 1u : 0u;
    mask[k / 4] |= representable << (8 * (k % 4));
  }
  if (nan_block) code[0] = code[1] = 0;
  if (packed) {
    reinterpret_cast<uint2*>(a.codes)[c.e0 / kPer] = make_uint2(code[0], code[1]);
    if (a.mask) {
      reinterpret_cast<uint4*>(a.mask)[c.e0 / kPer] =
          make_uint4(mask[0], mask[1], mask[2], mask[3]);
    }
  } else {
    TIERLIFT_UNROLL
    for (int b = 0; b < kPer / 2; ++b) {
      a.codes[c.e0 / 2 + b] = static_cast<uint8_t>(code[b / 4] >> (8 * (b % 4)));
    }
    if (a.mask) {
      TIERLIFT_UNROLL
      for (int k = 0; k < kPer; ++k) {
        a.mask[c.e0 + k] = static_cast<uint8_t>(mask[k / 4] >> (8 * (k % 4)));
      }
    }
  }
}

template <DType kT, bool kVec, bool kLean>
__global__ void __launch_bounds__(kThreads) mx_kernel(Fp4QuantArgs a, bool packed, Div31 per_row) {
  constexpr int kLanes = 32 / kPer;
  const Chunk c = chunk_of<kLean>(a, per_row, blockIdx.x);
  if (__all_sync(kFull, !c.valid)) return;  // whole warps exit together
  float v[kPer];
  rotated<kT, kVec, kLean>(a, c, v);
  const uint32_t block_bits = block_max<kLanes>(abs_max_bits(v));
  const bool bad = block_bits >= kNonfiniteBits;  // the block holds a NaN/Inf
  // A bad block's statistic is never used (NaN scale, NaN multiplier).
  float stat = bad ? 0.f : fp4::from_bits(block_bits);
  if (a.rule == fp4::ScaleRule::kQuest) {  // fp4::block_rms: the halving tree s[i] += s[i + h]
    const int sh = fp4::rms_shift(stat);
    float s[kPer];
    for (int k = 0; k < kPer; ++k) {
      const float fs = __fmul_rn(fp4::finite_abs(v[k]), fp4::pow2(-sh));
      s[k] = __fmul_rn(fs, fs);
    }
    for (int h = kLanes / 2; h >= 1; h >>= 1) {  // h = 16 elements: across lanes
      for (int k = 0; k < kPer; ++k) s[k] = __fadd_rn(s[k], __shfl_xor_sync(kFull, s[k], h));
    }
    for (int h = kPer / 2; h >= 1; h >>= 1) {
      for (int k = 0; k < h; ++k) s[k] = __fadd_rn(s[k], s[k + h]);
    }
    stat = __fmul_rn(__fsqrt_rn(__fmul_rn(s[0], 1.f / 32)), fp4::pow2(sh));
  }
  const int ex = fp4::mx_exponent(stat, a.rule);
  if (c.valid && (threadIdx.x & (kLanes - 1)) == 0) {
    a.scales[c.e0 >> 5] = bad ? fp4::kE8M0Nan : static_cast<uint8_t>(ex + 127);
  }
  if (kLean && ex > -127 && ex < 127) {  // the multiplier folded into the encode
    const uint32_t bound = fp4::mx_step_bound(ex);
    store_lean(a, c, bad, v, [bound](float x) { return fp4::e2m1_magnitude_rne_scaled(x, bound); });
    return;
  }
  const float mult = bad ? fp4::nan_f32() : fp4::pow2(-ex);
  for (int k = 0; k < kPer; ++k) v[k] = __fmul_rn(v[k], mult);
  encode_store<kLean>(a, c, packed, bad, v);
}

__device__ __forceinline__ void atomic_max_nonneg(float* addr, float v) {
  atomicMax(reinterpret_cast<int*>(addr), __float_as_int(v));  // v >= 0 orders like its bits
}

// Pass 1's last thread block, warp 0 (every other block's max is in): s_t into the workspace
// tail and the output, and s_t / sb for each of the 128 E4M3 codes (0 for code 0, NaN for the
// NaN code), by the reference's own functions, so pass 2 reads what it would have computed.
__device__ __forceinline__ void nv_finish_tensor_scale(const Fp4QuantArgs& a, float* tail,
                                                       int lane) {
  unsigned amax_bits = 0;
  if (lane == 0) amax_bits = atomicOr(reinterpret_cast<unsigned*>(tail + kNvTailAmax), 0u);
  const float st = fp4::nv_tensor_scale(__uint_as_float(__shfl_sync(kFull, amax_bits, 0)));
  if (lane == 0) tail[kNvTailScale] = *a.tensor_scale = st;
  for (int code = lane; code < 128; code += 32) {
    tail[kNvTailMultipliers + code] = fp4::nv_multiplier(static_cast<uint8_t>(code), st);
  }
}

// NVFP4 pass 1: per-1x16-block amax (+inf for a block holding a NaN/Inf) into the workspace,
// and the tensor amax over finite elements: one atomicMax per thread block, then the tensor
// scale and the multipliers by the last block to finish.
template <DType kT, bool kVec, bool kLean>
__global__ void __launch_bounds__(kThreads) nv_amax_kernel(Fp4QuantArgs a, Div31 per_row) {
  static_assert(kPer == 16, "a lane holds its whole NVFP4 block");
  __shared__ float warp_max[kThreads / 32];
  const Chunk c = chunk_of<kLean>(a, per_row, blockIdx.x);
  float v[kPer];
  rotated<kT, kVec, kLean>(a, c, v);
  const uint32_t block_bits = abs_max_bits(v);
  const bool bad = block_bits >= kNonfiniteBits;
  float m = fp4::from_bits(block_bits);
  if (bad) {  // rare: the tensor amax still takes the block's finite elements
    m = 0.f;
    for (int k = 0; k < kPer; ++k) m = fmaxf(m, fp4::finite_abs(v[k]));
  }
  if (c.valid) a.workspace[c.e0 >> 4] = bad ? fp4::inf_f32() : m;
  for (int h = 16; h >= 1; h >>= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, h));
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  if (lane == 0) warp_max[warp] = m;
  __syncthreads();
  if (warp == 0) {
    m = lane < kThreads / 32 ? warp_max[lane] : 0.f;
    for (int h = 16; h >= 1; h >>= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, h));
    float* tail = a.workspace + (a.rows * a.cols >> 4);
    unsigned done = 0;
    if (lane == 0) {
      atomic_max_nonneg(tail + kNvTailAmax, m);
      __threadfence();  // the max lands before the count that says this block is done
      done = atomicAdd(reinterpret_cast<unsigned*>(tail + kNvTailDone), 1u);
    }
    if (__shfl_sync(kFull, done, 0) == gridDim.x - 1) {
      __threadfence();  // and the last block reads the max only after every count
      nv_finish_tensor_scale(a, tail, lane);
    }
  }
}

// NVFP4 pass 2: block scales (a 16x16 block's amax over its 16 rows of pass-1 amaxes, read by
// the lane of the block's row), then the encode. It walks the thread blocks in
// reverse, so it starts on the input pass 1 read last, still in L2 (the bits are the same).
template <DType kT, bool kVec, bool kLean>
__global__ void __launch_bounds__(kThreads)
    nv_encode_kernel(Fp4QuantArgs a, bool packed, Div31 per_row) {
  static_assert(kPer == 16, "a lane holds its whole NVFP4 block");
  Chunk c = chunk_of<kLean>(a, per_row, gridDim.x - 1 - blockIdx.x);
  if (__all_sync(kFull, !c.valid)) return;  // whole warps exit together
  const float* tail = a.workspace + (a.rows * a.cols >> 4);
  float v[kPer];
  rotated<kT, kVec, kLean>(a, c, v);
  const float st = tail[kNvTailScale];
  float amax = 0.f;
  int64_t slot = 0;
  bool writer = false;
  const int64_t nb = a.cols >> 4;
  if (a.block_2d) {
    if constexpr (kLean) locate_row(a, per_row, c);
    const int64_t k = c.j0 >> 4, i0 = c.i & ~int64_t{15};
    const int64_t hi = i0 + 16 < a.rows ? i0 + 16 : a.rows;
    if (c.valid) {
      for (int64_t r = i0; r < hi; ++r) amax = fmaxf(amax, a.workspace[r * nb + k]);
    }
    slot = (c.i >> 4) * nb + k;
    writer = (c.i & 15) == 0;
  } else {
    slot = kLean ? c.e0 >> 4 : c.i * nb + (c.j0 >> 4);  // contiguous rows: the flat index
    if (c.valid) amax = a.workspace[slot];
    writer = true;
  }
  const uint8_t code = fp4::nv_scale_code_nodiv(amax, st);
  if (c.valid && writer) a.scales[slot] = code;
  const float mult = tail[kNvTailMultipliers + code];
  for (int n = 0; n < kPer; ++n) v[n] = __fmul_rn(v[n], mult);
  encode_store<kLean>(a, c, packed, code == fp4::kE4M3Nan, v);
}

template <DType kT, bool kVec, bool kLean>
cudaError_t launch_rule(const Fp4QuantArgs& a, unsigned blocks, bool packed, Div31 per_row,
                        cudaStream_t stream) {
  if (a.rule != fp4::ScaleRule::kNv) {
    TIERLIFT_LAUNCH(blocks, kThreads, 0, stream, mx_kernel<kT, kVec, kLean>)(a, packed, per_row);
    return cudaGetLastError();
  }
  const int64_t total = a.rows * a.cols;
  cudaError_t err =
      cudaMemsetAsync(a.workspace + (total >> 4) + kNvTailAmax, 0, 2 * sizeof(float), stream);
  if (err != cudaSuccess) return err;
  TIERLIFT_LAUNCH(blocks, kThreads, 0, stream, nv_amax_kernel<kT, kVec, kLean>)(a, per_row);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  TIERLIFT_LAUNCH(blocks, kThreads, 0, stream, nv_encode_kernel<kT, kVec, kLean>)
  (a, packed, per_row);
  return cudaGetLastError();
}

template <DType kT>
cudaError_t launch(const Fp4QuantArgs& a, cudaStream_t stream) {
  const int64_t total = a.rows * a.cols;
  if (total == 0) return cudaSuccess;    // the caller filled tensor_scale
  const int64_t threads = total / kPer;  // cols % 16 == 0
  const unsigned blocks = static_cast<unsigned>((threads + kThreads - 1) / kThreads);
  const bool vec =
      a.col_stride == 1 && a.row_stride % kHalf == 0 && reinterpret_cast<uintptr_t>(a.x) % 16 == 0;
  const bool packed = reinterpret_cast<uintptr_t>(a.codes) % 8 == 0 &&
                      reinterpret_cast<uintptr_t>(a.mask) % 16 == 0;
  // Every thread index, the tail block's included, below 2^31: rows by multiply and shift.
  const bool small = int64_t{blocks} * kThreads <= (int64_t{1} << 31);
  const Div31 per_row = small ? Div31::make(a.cols / kPer) : Div31{};
  const bool lean = vec && a.row_stride == a.cols && packed && a.hadamard == 0 && !a.stochastic &&
                    a.mask == nullptr;
  if (lean) return launch_rule<kT, true, true>(a, blocks, packed, per_row, stream);
  return vec ? launch_rule<kT, true, false>(a, blocks, packed, per_row, stream)
             : launch_rule<kT, false, false>(a, blocks, packed, per_row, stream);
}

}  // namespace

cudaError_t fp4_quantize(const Fp4QuantArgs& args, cudaStream_t stream) {
  switch (args.dtype) {
    case DType::kFloat32:
      return launch<DType::kFloat32>(args, stream);
    case DType::kBFloat16:
      return launch<DType::kBFloat16>(args, stream);
    default:
      return launch<DType::kFloat16>(args, stream);
  }
}

}  // namespace cuda
}  // namespace tierlift

// fp8_quantize: the launcher, and the fused one-kernel path for row and 1x128 scaling of a
// row-contiguous input with a single output (fp8_quant.cuh). Everything else goes to the tiled
// path (fp8_quant_tiles.cu).
//
// Both fused kernels move kW = 8 (or 4) consecutive elements per load where the view allows:
// 16-byte (8-byte) loads, and codes leave as 8-byte (4-byte) stores; element by element otherwise
// (odd widths, a misaligned base or row stride). On the vector paths the codes come from the
// branch-free encoder (fp8dev::Fp8Encoder), four at a time; a group holding NaN or Inf is
// encoded again with the exact encoder. The amax is a plain max of |x| (NaN drops out of fmaxf);
// only where it comes out infinite is it reduced again without the non-finite values.
//  - 1x128: a block of 128 elements is 4 lanes of 32 elements (four 16-byte loads in flight per
//    lane, eight for fp32), read once, reduced with two shuffles, cast. A lane finds its row by a
//    multiply and shift (FastDiv), not a division; past 2^28 blocks, a fallback kernel divides in
//    64 bits.
//  - row: one thread block per row, 32 to 512 threads: as few as hold the row in registers (32
//    elements per thread, up to 16384: an FFN width of 14336 too), all its loads in flight, so the
//    input is read once. Longer rows take 512 threads and read the row a second time for the
//    cast, four loads in flight.
#include <cstdint>

#include "cuda/fp8_device.cuh"
#include "cuda/fp8_quant.cuh"
#include "cuda/fp8_quant_tiles.cuh"
#include "cuda/launch.cuh"

namespace tierlift {
namespace cuda {
namespace {

using fp8dev::encode;
using fp8dev::encode_store;
using fp8dev::FastDiv;
using fp8dev::finite_abs;
using fp8dev::Fp8Encoder;
using fp8dev::group_max;
using fp8dev::load_vec;
using fp8dev::scale_of;

constexpr int kRowThreads = 512;  // the most threads per row
constexpr int kRowRegs = 32;      // elements per thread a row kernel keeps in registers
constexpr int kBlockLanes = 4;    // lanes per 1x128 block on the vector path
constexpr int kLaneElems = 128 / kBlockLanes;

// kW consecutive elements at byte address p (aligned to kW elements, 16 bytes at most), widened
// to fp32; zeros where !in.
template <DType kT, int kW>
__device__ __forceinline__ void load_or_zero(const char* p, bool in, float (&v)[kW]) {
  if constexpr (kW == 8) {
    fp8dev::widen8<kT>(fp8dev::load_raw8<kT>(p, in), v);
  } else {
    static_assert(kW == 4, "vector width 4 or 8");
    if constexpr (kT == DType::kFloat32) {
      float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
      if (in) f = *reinterpret_cast<const float4*>(p);
      v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    } else {
      uint2 raw = make_uint2(0u, 0u);
      if (in) raw = *reinterpret_cast<const uint2*>(p);
      v[0] = lowp::widen16<kT>(raw.x), v[1] = lowp::widen16<kT>(raw.x >> 16);
      v[2] = lowp::widen16<kT>(raw.y), v[3] = lowp::widen16<kT>(raw.y >> 16);
    }
  }
}

// |v| max for the amax: fmaxf drops NaN, so only an infinite result needs finite_abs.
template <int kN>
__device__ __forceinline__ float abs_max(const float (&v)[kN], float m) {
  for (int n = 0; n < kN; ++n) m = fmaxf(m, fabsf(v[n]));
  return m;
}

template <int kN>
__device__ __forceinline__ float finite_abs_max(const float (&v)[kN], float m) {
  for (int n = 0; n < kN; ++n) m = fmaxf(m, finite_abs(v[n]));
  return m;
}

// The kW codes of v * s packed (element 0 in the lowest byte) into kW / 4 words by the
// branch-free encoder; a word holding a non-finite product is encoded again exactly.
template <int kW>
__device__ __forceinline__ void encode_codes(const float (&v)[kW], float s, const Fp8Encoder& enc,
                                             uint32_t (&w)[kW / 4]) {
  bool special = false;
  TIERLIFT_UNROLL
  for (int k = 0; k < kW / 4; ++k) {
    const float xk[4] = {__fmul_rn(v[4 * k], s), __fmul_rn(v[4 * k + 1], s),
                         __fmul_rn(v[4 * k + 2], s), __fmul_rn(v[4 * k + 3], s)};
    w[k] = enc.pack4(xk, special);
  }
  if (special) {  // rare: NaN or Inf in x
    TIERLIFT_UNROLL
    for (int k = 0; k < kW / 4; ++k) {
      uint32_t word = 0;
      for (int b = 0; b < 4; ++b) word |= encode(__fmul_rn(v[4 * k + b], s), enc.fmt) << (8 * b);
      w[k] = word;
    }
  }
}

// One kW-byte store of packed codes at byte address q (aligned to kW).
template <int kW>
__device__ __forceinline__ void store_codes(uint8_t* q, const uint32_t (&w)[kW / 4]) {
  if constexpr (kW == 8) {
    *reinterpret_cast<uint2*>(q) = make_uint2(w[0], w[1]);
  } else {
    *reinterpret_cast<uint32_t*>(q) = w[0];
  }
}

// 1x128 blocks on the vector path (kW = 8 or 4: cols, row stride and bases aligned to kW): 4
// lanes per block, lane `sub` holding elements kW * sub + 4 * kW * p of it for p < 32 / kW, so
// each load of a block's 4 lanes covers 4 * kW consecutive elements, and a lane's 32 elements
// pay for its index, shuffles and scale. Launched with rows * ceil(cols / 128) * 4 < 2^31
// threads (the row found by `by_gc`).
template <DType kT, int kW>
__global__ void __launch_bounds__(256)
    block1x128_kernel(const void* x, int64_t rows, int64_t cols, int64_t rs, FastDiv by_gc,
                      uint32_t gc, Fp8Encoder enc, bool pow2, uint8_t* q, float* scales) {
  constexpr int kParts = kLaneElems / kW, kPartStride = kBlockLanes * kW;
  constexpr int kSize = kT == DType::kFloat32 ? 4 : 2;
  const uint32_t t = blockIdx.x * blockDim.x + threadIdx.x;
  const uint32_t block = t / kBlockLanes;  // a shift
  const int sub = threadIdx.x % kBlockLanes;
  const uint32_t i = by_gc.div(block);
  const bool live = i < rows;  // the grid's last warp may run past the last block
  const int64_t j0 = static_cast<int64_t>(block - i * gc) * 128 + kW * sub;
  const char* xp = static_cast<const char*>(x) + (i * rs + j0) * kSize;
  float v[kParts][kW];
  TIERLIFT_UNROLL
  for (int p = 0; p < kParts; ++p) {  // all loads first: several in flight per lane
    load_or_zero<kT, kW>(xp + kPartStride * p * kSize, live && j0 + kPartStride * p < cols, v[p]);
  }
  float m = 0.f;
  TIERLIFT_UNROLL
  for (int p = 0; p < kParts; ++p) m = abs_max(v[p], m);
  m = group_max<kBlockLanes>(m);
  if (__any_sync(0xffffffffu, m > kF32Max)) {  // rare: an Inf in one of the warp's blocks
    m = 0.f;
    TIERLIFT_UNROLL
    for (int p = 0; p < kParts; ++p) m = finite_abs_max(v[p], m);
    m = group_max<kBlockLanes>(m);
  }
  const float s = scale_of(m, enc.fmt, pow2);
  if (!live) return;
  uint8_t* qp = q + i * cols + j0;
  TIERLIFT_UNROLL
  for (int p = 0; p < kParts; ++p) {
    if (j0 + kPartStride * p < cols) {
      uint32_t w[kW / 4];
      encode_codes<kW>(v[p], s, enc, w);
      store_codes<kW>(qp + kPartStride * p, w);
    }
  }
  if (sub == 0) scales[block] = s;
}

// 1x128 blocks element by element (any alignment), or with 64-bit indices (past 2^28 blocks:
// narrow is false), kW as the vector path's: 128 / kW lanes per block (32 lanes of 4 strided
// elements for kW = 1) and the exact encoder. narrow: the block count fits 32-bit division.
template <DType kT, int kW>
__global__ void block1x128_any_kernel(const void* x, int64_t rows, int64_t cols, int64_t rs,
                                      Fp8Format fmt, bool pow2, uint8_t* q, float* scales,
                                      bool narrow) {
  constexpr int kLanes = kW == 1 ? 32 : 128 / kW;
  const int64_t gc = (cols + 127) / 128;
  const int64_t nblocks = rows * gc;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int lane = threadIdx.x & 31, sub = threadIdx.x & (kLanes - 1);
  if ((t - lane) / kLanes >= nblocks) return;  // whole warps exit together
  const int64_t block = t / kLanes;
  const bool live = block < nblocks;  // a warp may hold a live and a dead half
  int64_t i = 0, jb = 0;
  if (live && narrow) {  // 32-bit division: several times cheaper than 64-bit
    const uint32_t b32 = static_cast<uint32_t>(block), g32 = static_cast<uint32_t>(gc);
    i = b32 / g32;
    jb = static_cast<int64_t>(b32 % g32) * 128;
  } else if (live) {
    i = block / gc;
    jb = (block % gc) * 128;
  }
  float s;
  if constexpr (kW == 1) {
    float v[4];
    float m = 0.f;
    for (int k = 0; k < 4; ++k) {
      const int64_t j = jb + sub + 32 * k;
      v[k] = live && j < cols ? fp8dev::load<kT>(x, i * rs + j) : 0.f;
      m = fmaxf(m, finite_abs(v[k]));
    }
    s = scale_of(group_max<kLanes>(m), fmt, pow2);
    for (int k = 0; k < 4; ++k) {
      const int64_t j = jb + sub + 32 * k;
      if (live && j < cols) q[i * cols + j] = static_cast<uint8_t>(encode(__fmul_rn(v[k], s), fmt));
    }
  } else {
    const int64_t j = jb + kW * sub;  // cols % kW == 0: the kW are all in or all out
    const bool in = live && j < cols;
    float v[kW];
    for (int n = 0; n < kW; ++n) v[n] = 0.f;
    if (in) load_vec<kT, kW>(x, i * rs + j, v);
    float m = 0.f;
    for (int n = 0; n < kW; ++n) m = fmaxf(m, finite_abs(v[n]));
    s = scale_of(group_max<kLanes>(m), fmt, pow2);
    if (in) encode_store<kW>(q, i * cols + j, v, s, fmt);
  }
  if (live && sub == 0) scales[block] = s;
}

// The max of every thread's m over the thread block (blockDim.x a multiple of 32, at most 512),
// returned to every thread; all must call it. `partial` holds 16 floats, and a second call needs
// other ones (the first call's reads are not fenced off from its writes).
__device__ __forceinline__ float block_max(float m, float* partial) {
  m = group_max(m);
  const int warps = blockDim.x / 32, lane = threadIdx.x % 32;
  if (warps == 1) return m;
  if (lane == 0) partial[threadIdx.x / 32] = m;
  __syncthreads();
  return group_max(lane < warps ? partial[lane] : 0.f);  // every warp reads all: no 2nd barrier
}

// kW consecutive elements at byte address p as load_or_zero (kW = 1: any address).
template <DType kT, int kW>
__device__ __forceinline__ void load_any(const char* p, bool in, float (&v)[kW]) {
  if constexpr (kW == 1) {
    v[0] = in ? fp8dev::load<kT>(p, 0) : 0.f;
  } else {
    load_or_zero<kT, kW>(p, in, v);
  }
}

// Codes of v * s stored at byte address q, from the branch-free encoder (a non-finite product
// encoded again exactly): kW = 4, 8 packed into one store.
template <int kW>
__device__ __forceinline__ void cast_store(uint8_t* q, const float (&v)[kW], float s,
                                           const Fp8Encoder& enc) {
  if constexpr (kW == 1) {
    const float p = __fmul_rn(v[0], s);
    bool special = false;
    uint32_t code = (enc.magnitude(p, special) & 0xffu) | ((__float_as_uint(p) >> 24) & 0x80u);
    if (special) code = encode(p, enc.fmt);
    *q = static_cast<uint8_t>(code);
  } else {
    uint32_t w[kW / 4];
    encode_codes<kW>(v, s, enc, w);
    store_codes<kW>(q, w);
  }
}

// Row scaling: one thread block per row, kW consecutive elements per thread and step. kInRegs:
// the row fits kRowRegs elements per thread (launched with as few threads as that needs), is
// loaded at once and read once. Otherwise 512 threads walk the row twice, kUnroll loads in
// flight per thread: the amax, then the cast (the second read mostly hits L2).
template <DType kT, int kW, bool kInRegs>
__global__ void __launch_bounds__(kRowThreads)
    row_kernel(const void* x, int64_t cols, int64_t rs, Fp8Encoder enc, bool pow2, uint8_t* q,
               float* scales) {
  constexpr int kSize = kT == DType::kFloat32 ? 4 : 2;
  constexpr int kUnroll = kInRegs ? kRowRegs / kW : 4;
  __shared__ float partial[2][kRowThreads / 32];
  const int64_t i = blockIdx.x;
  const char* xi = static_cast<const char*>(x) + i * rs * kSize;
  uint8_t* qi = q + i * cols;
  const int step = kW * blockDim.x, j0 = kW * threadIdx.x;
  float m = 0.f, s;
  if constexpr (kInRegs) {
    const int n = static_cast<int>(cols);  // <= 16384
    float v[kUnroll][kW];
    TIERLIFT_UNROLL
    for (int c = 0; c < kUnroll; ++c) {
      const int j = j0 + c * step;
      load_any<kT, kW>(xi + j * kSize, j < n, v[c]);
    }
    TIERLIFT_UNROLL
    for (int c = 0; c < kUnroll; ++c) m = abs_max(v[c], m);
    m = block_max(m, partial[0]);
    if (m > kF32Max) {  // rare, and the same for the whole block: an Inf in the row
      m = 0.f;
      TIERLIFT_UNROLL
      for (int c = 0; c < kUnroll; ++c) m = finite_abs_max(v[c], m);
      m = block_max(m, partial[1]);
    }
    s = scale_of(m, enc.fmt, pow2);
    TIERLIFT_UNROLL
    for (int c = 0; c < kUnroll; ++c) {
      const int j = j0 + c * step;
      if (j < n) cast_store<kW>(qi + j, v[c], s, enc);
    }
  } else {
    const int64_t big_step = static_cast<int64_t>(kUnroll) * step;
    // Both passes read kUnroll groups per trip, all loads issued before any use.
    auto load_groups = [&](int64_t j, float(&v)[kUnroll][kW]) {
      TIERLIFT_UNROLL
      for (int u = 0; u < kUnroll; ++u) {
        load_any<kT, kW>(xi + (j + u * step) * kSize, j + u * step < cols, v[u]);
      }
    };
    auto amax_pass = [&](bool finite_only) {
      float mm = 0.f;
      for (int64_t j = j0; j < cols; j += big_step) {
        float v[kUnroll][kW];
        load_groups(j, v);
        TIERLIFT_UNROLL
        for (int u = 0; u < kUnroll; ++u) {
          mm = finite_only ? finite_abs_max(v[u], mm) : abs_max(v[u], mm);
        }
      }
      return mm;
    };
    m = block_max(amax_pass(false), partial[0]);
    if (m > kF32Max) m = block_max(amax_pass(true), partial[1]);  // rare: an Inf in the row
    s = scale_of(m, enc.fmt, pow2);
    for (int64_t j = j0; j < cols; j += big_step) {
      float v[kUnroll][kW];
      load_groups(j, v);
      TIERLIFT_UNROLL
      for (int u = 0; u < kUnroll; ++u) {
        if (j + u * step < cols) cast_store<kW>(qi + j + u * step, v[u], s, enc);
      }
    }
  }
  if (threadIdx.x == 0) scales[i] = s;
}

// The widest kW in {8, 4} the view allows (cols, row stride and the bases aligned to it), else 1.
int fused_width(const Fp8QuantArgs& a, uintptr_t esize) {
  for (int w : {8, 4}) {
    const uintptr_t xa = w * esize < 16 ? w * esize : 16;
    if (a.cols % w == 0 && a.row_stride % w == 0 && reinterpret_cast<uintptr_t>(a.x) % xa == 0 &&
        reinterpret_cast<uintptr_t>(a.q) % w == 0) {
      return w;
    }
  }
  return 1;
}

// The vector kernel while its lanes (8 per block) fit 31-bit indices; the 128 / kW lanes per
// block kernel otherwise (kW = 1, or a 64-bit fallback past 2^28 blocks).
template <DType kT, int kW>
void launch_1x128(const Fp8QuantArgs& a, int64_t gc, cudaStream_t stream) {
  const int64_t nblocks = a.rows * gc;
  if constexpr (kW != 1) {
    const int64_t lanes = nblocks * kBlockLanes;
    if (lanes <= narrow_index_limit() && lanes <= INT32_MAX) {
      TIERLIFT_LAUNCH(static_cast<unsigned>((lanes + 255) / 256), 256, 0, stream,
                      block1x128_kernel<kT, kW>)
      (a.x, a.rows, a.cols, a.row_stride, FastDiv::of(static_cast<uint32_t>(gc)),
       static_cast<uint32_t>(gc), Fp8Encoder::of(a.fmt), a.pow2_scale, a.q, a.scales);
      return;
    }
  }
  constexpr int kLanes = kW == 1 ? 32 : 128 / kW;
  const unsigned blocks = static_cast<unsigned>((nblocks * kLanes + 255) / 256);
  const bool narrow = nblocks <= narrow_index_limit() && nblocks <= INT32_MAX;
  TIERLIFT_LAUNCH(blocks, 256, 0, stream, block1x128_any_kernel<kT, kW>)
  (a.x, a.rows, a.cols, a.row_stride, a.fmt, a.pow2_scale, a.q, a.scales, narrow);
}

template <DType kT, int kW>
void launch_row(const Fp8QuantArgs& a, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>(a.rows);
  const Fp8Encoder enc = Fp8Encoder::of(a.fmt);
  if (a.cols <= static_cast<int64_t>(kRowRegs) * kRowThreads) {
    unsigned threads = 32;
    while (threads * kRowRegs < a.cols) threads *= 2;
    TIERLIFT_LAUNCH(blocks, threads, 0, stream, row_kernel<kT, kW, true>)
    (a.x, a.cols, a.row_stride, enc, a.pow2_scale, a.q, a.scales);
  } else {
    TIERLIFT_LAUNCH(blocks, kRowThreads, 0, stream, row_kernel<kT, kW, false>)
    (a.x, a.cols, a.row_stride, enc, a.pow2_scale, a.q, a.scales);
  }
}

template <DType kT>
cudaError_t run(const Fp8QuantArgs& a, cudaStream_t stream) {
  // scales_t too: for an empty input qt may be null (an empty tensor's data_ptr()) while
  // scales_t still has safe scales to receive.
  const bool dual = a.qt != nullptr || a.scales_t != nullptr;
  const Fp8Blocks b = fp8_blocks(a.scaling, a.rows, a.cols);
  if (a.rows * a.cols == 0) {  // no elements: every scale is the safe scale of amax 0
    cudaError_t e =
        fp8_amax_to_scales(a.scales, b.grid_rows * b.grid_cols, a.fmt, a.pow2_scale, true, stream);
    if (e == cudaSuccess && dual) {
      const Fp8Blocks bt = fp8_blocks(a.scaling, a.cols, a.rows);
      e = fp8_amax_to_scales(a.scales_t, bt.grid_rows * bt.grid_cols, a.fmt, a.pow2_scale, true,
                             stream);
    }
    return e;
  }
  if (dual || a.col_stride != 1 ||
      (a.scaling != Fp8Scaling::kBlock1x128 && a.scaling != Fp8Scaling::kRow)) {
    return fp8_quantize_tiled(a, stream);
  }
  // The row kernel's grid is one block per row: past 2^31 - 1 rows the unsigned block count
  // would fail to launch or, past 2^32, wrap to a few rows and leave the rest unwritten.
  if (a.scaling == Fp8Scaling::kRow && a.rows > INT32_MAX) return cudaErrorInvalidConfiguration;
  const int w = fused_width(a, kT == DType::kFloat32 ? 4 : 2);
  if (a.scaling == Fp8Scaling::kBlock1x128) {
    if (w == 8) {
      launch_1x128<kT, 8>(a, b.grid_cols, stream);
    } else if (w == 4) {
      launch_1x128<kT, 4>(a, b.grid_cols, stream);
    } else {
      launch_1x128<kT, 1>(a, b.grid_cols, stream);
    }
  } else if (w == 8) {
    launch_row<kT, 8>(a, stream);
  } else if (w == 4) {
    launch_row<kT, 4>(a, stream);
  } else {
    launch_row<kT, 1>(a, stream);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t fp8_quantize(const Fp8QuantArgs& args, cudaStream_t stream) {
  switch (args.dtype) {
    case DType::kBFloat16:
      return run<DType::kBFloat16>(args, stream);
    case DType::kFloat16:
      return run<DType::kFloat16>(args, stream);
    default:
      return run<DType::kFloat32>(args, stream);
  }
}

}  // namespace cuda
}  // namespace tierlift

#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/fp8_quant.cuh"
#include "cuda/launch.cuh"

namespace tierlift {
namespace cuda {
namespace {

constexpr int kTile = 32;
constexpr int kTileRowsPerThread = 4;  // block (32, 8) covers a 32x32 tile
constexpr int kRowThreads = 256;

template <DType kT>
__device__ __forceinline__ float load(const void* p, int64_t k) {
  if constexpr (kT == DType::kFloat32) {
    return static_cast<const float*>(p)[k];
  } else if constexpr (kT == DType::kBFloat16) {
    return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(p)[k]) << 16);
  } else {
    return __half2float(static_cast<const __half*>(p)[k]);
  }
}

__device__ __forceinline__ float pow2f_dev(int e) {
  return __uint_as_float(static_cast<uint32_t>(e + 127) << 23);
}

__device__ __forceinline__ float finite_abs_dev(float x) {
  const uint32_t a = __float_as_uint(x) & 0x7fffffffu;
  return a >= 0x7f800000u ? 0.f : __uint_as_float(a);
}

// fp8.h fp8_encode, operation for operation.
__device__ __forceinline__ uint8_t encode(float x, Fp8Format fmt) {
  const int mbits = fmt == Fp8Format::kE4M3 ? 3 : 2;
  const int bias = fmt == Fp8Format::kE4M3 ? 7 : 15;
  const uint32_t max_bits = __float_as_uint(fmt == Fp8Format::kE4M3 ? kE4M3Max : kE5M2Max);
  const uint32_t u = __float_as_uint(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return 0x7fu;
  if (abs == 0x7f800000u) return fmt == Fp8Format::kE5M2 ? (sign | 0x7cu) : 0x7fu;
  if (abs > max_bits) abs = max_bits;
  const float a = __uint_as_float(abs);
  if (a < pow2f_dev(1 - bias)) {
    const float units = __fmul_rn(a, pow2f_dev(bias - 1 + mbits));
    const float r = __fsub_rn(__fadd_rn(units, 8388608.f), 8388608.f);
    return sign | static_cast<uint8_t>(static_cast<uint32_t>(r));
  }
  const int shift = 23 - mbits;
  const uint32_t lsb = (abs >> shift) & 1u;
  uint32_t r = (abs + ((1u << (shift - 1)) - 1u) + lsb) >> shift;
  r -= static_cast<uint32_t>(127 - bias) << mbits;
  return sign | static_cast<uint8_t>(r);
}

// fp8.h fp8_scale.
__device__ __forceinline__ float scale_of(float amax, Fp8Format fmt, bool pow2) {
  if (!(amax > 0.f)) return 1.f;
  float s = __fdiv_rn(fmt == Fp8Format::kE4M3 ? kE4M3Max : kE5M2Max, amax);
  if (s > kF32Max) s = kF32Max;
  if (pow2) s = __uint_as_float(__float_as_uint(s) & 0xff800000u);
  return s;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// A grid of scaling blocks, described over x's rows and columns: br x bc elements of x per
// block. `transposed` grids belong to x^T (the dual output): their scales are stored row-major
// over x^T, so x[i, j]'s block is at (j / bc, i / br) in a grid gc wide.
struct Grid {
  int64_t br, bc, gc;
  float* out;  // amax, then scales
  bool transposed;
  __device__ __forceinline__ int64_t index(int64_t i, int64_t j) const {
    return transposed ? (j / bc) * gc + i / br : (i / br) * gc + j / bc;
  }
  // Per-element form without divisions: along a dimension whose block is not 1 a 32-aligned
  // tile lies in one block, whose coordinate the caller computes once per tile
  // (rb = r0 / br, cb = c0 / bc, ignored where the block is 1).
  __device__ __forceinline__ int64_t slot(int64_t i, int64_t j, int64_t rb, int64_t cb) const {
    const int64_t bi = br == 1 ? i : rb, bj = bc == 1 ? j : cb;
    return transposed ? bj * gc + bi : bi * gc + bj;
  }
};

__device__ __forceinline__ void atomic_max_nonneg(float* addr, float v) {
  atomicMax(reinterpret_cast<unsigned int*>(addr), __float_as_uint(v));
}

// Merges one 32x32 tile (|x| in smem, 0 outside the matrix) into grid g's amax.
// Tiles are 32-aligned and every block dimension is 1, a multiple of 128 or the whole matrix,
// so along a dimension whose block is not 1 the tile lies inside a single block. (1x1 blocks
// happen only for degenerate shapes, e.g. column scaling of a single row.)
__device__ void merge_tile(const float (*tile)[kTile + 1], const Grid& g, int64_t r0, int64_t c0,
                           int64_t rows, int64_t cols, float* warp_partial) {
  const int lane = threadIdx.x, warp = threadIdx.y;
  if (g.br == 1 && g.bc == 1) {  // one block per element
    for (int k = 0; k < kTileRowsPerThread; ++k) {
      const int r = warp * kTileRowsPerThread + k;
      if (r0 + r < rows && c0 + lane < cols) {
        atomic_max_nonneg(&g.out[g.index(r0 + r, c0 + lane)], tile[r][lane]);
      }
    }
  } else if (g.br == 1) {  // one block per row
    for (int k = 0; k < kTileRowsPerThread; ++k) {
      const int r = warp * kTileRowsPerThread + k;
      const float m = warp_max(tile[r][lane]);
      if (lane == 0 && r0 + r < rows) atomic_max_nonneg(&g.out[g.index(r0 + r, c0)], m);
    }
  } else if (g.bc == 1) {  // one block per column
    for (int k = 0; k < kTileRowsPerThread; ++k) {
      const int c = warp * kTileRowsPerThread + k;
      const float m = warp_max(tile[lane][c]);
      if (lane == 0 && c0 + c < cols) atomic_max_nonneg(&g.out[g.index(r0, c0 + c)], m);
    }
  } else {  // the whole tile is in one block
    float m = 0.f;
    for (int k = 0; k < kTileRowsPerThread; ++k)
      m = fmaxf(m, tile[warp * kTileRowsPerThread + k][lane]);
    m = warp_max(m);
    if (lane == 0) warp_partial[warp] = m;
    __syncthreads();
    if (warp == 0) {
      m = lane < kTile / kTileRowsPerThread ? warp_partial[lane] : 0.f;
      m = warp_max(m);
      if (lane == 0) atomic_max_nonneg(&g.out[g.index(r0, c0)], m);
    }
  }
}

template <DType kT>
__global__ void amax_tiles_kernel(const void* x, int64_t rows, int64_t cols, int64_t rs, int64_t cs,
                                  Grid g0, Grid g1, bool two) {
  __shared__ float tile[kTile][kTile + 1];
  __shared__ float warp_partial[kTile / kTileRowsPerThread];
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTile;  // rows on x: up to 2^31 tiles
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kTile;
  for (int k = 0; k < kTileRowsPerThread; ++k) {
    const int r = threadIdx.y * kTileRowsPerThread + k;
    const int64_t i = r0 + r, j = c0 + threadIdx.x;
    tile[r][threadIdx.x] =
        (i < rows && j < cols) ? finite_abs_dev(load<kT>(x, i * rs + j * cs)) : 0.f;
  }
  __syncthreads();
  merge_tile(tile, g0, r0, c0, rows, cols, warp_partial);
  if (two) {
    __syncthreads();
    merge_tile(tile, g1, r0, c0, rows, cols, warp_partial);
  }
}

__global__ void amax_to_scale_kernel(float* s, int64_t n, Fp8Format fmt, bool pow2) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) s[i] = scale_of(s[i], fmt, pow2);
}

// Pass 2: q[i, j] with grid g; if qt, also qt[j, i] with the transposed grid gt.
template <DType kT>
__global__ void cast_tiles_kernel(const void* x, int64_t rows, int64_t cols, int64_t rs, int64_t cs,
                                  Fp8Format fmt, Grid g, uint8_t* q, Grid gt, uint8_t* qt) {
  __shared__ float tile[kTile][kTile + 1];
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTile;  // rows on x: up to 2^31 tiles
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t j = c0 + threadIdx.x;
  const int64_t rb = r0 / g.br, cb = c0 / g.bc;
  for (int k = 0; k < kTileRowsPerThread; ++k) {
    const int r = threadIdx.y * kTileRowsPerThread + k;
    const int64_t i = r0 + r;
    float v = 0.f;
    if (i < rows && j < cols) {
      v = load<kT>(x, i * rs + j * cs);
      const float s = g.out[g.slot(i, j, rb, cb)];
      q[i * cols + j] = encode(__fmul_rn(v, s), fmt);
    }
    tile[r][threadIdx.x] = v;
  }
  if (qt == nullptr) return;
  __syncthreads();
  // Row jt of x^T is column jt of x; its element it is x[it, jt].
  const int64_t it = r0 + threadIdx.x;
  const int64_t rbt = r0 / gt.br, cbt = c0 / gt.bc;
  for (int k = 0; k < kTileRowsPerThread; ++k) {
    const int c = threadIdx.y * kTileRowsPerThread + k;
    const int64_t jt = c0 + c;
    if (it < rows && jt < cols) {
      const float s = gt.out[gt.slot(it, jt, rbt, cbt)];
      qt[jt * rows + it] = encode(__fmul_rn(tile[threadIdx.x][c], s), fmt);
    }
  }
}

// Four consecutive elements x[k..k+3] (k % 4 == 0, base aligned to 4 elements): one 16-byte
// (fp32) or 8-byte (bf16/fp16) load instead of four.
template <DType kT>
__device__ __forceinline__ void load4(const void* p, int64_t k, float (&v)[4]) {
  if constexpr (kT == DType::kFloat32) {
    const float4 f = reinterpret_cast<const float4*>(p)[k / 4];
    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
  } else {
    const uint2 raw = reinterpret_cast<const uint2*>(p)[k / 4];
    const uint32_t w[4] = {raw.x & 0xffffu, raw.x >> 16, raw.y & 0xffffu, raw.y >> 16};
    for (int n = 0; n < 4; ++n) {
      if constexpr (kT == DType::kBFloat16) {
        v[n] = __uint_as_float(w[n] << 16);
      } else {
        v[n] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[n])));
      }
    }
  }
}

// q[k..k+3] = encode(v * s) as one 4-byte store (little-endian: element k at the lowest byte).
__device__ __forceinline__ void encode_store4(uint8_t* q, int64_t k, const float (&v)[4], float s,
                                              Fp8Format fmt) {
  uint32_t w = 0;
  for (int n = 0; n < 4; ++n)
    w |= static_cast<uint32_t>(encode(__fmul_rn(v[n], s), fmt)) << (8 * n);
  reinterpret_cast<uint32_t*>(q)[k / 4] = w;
}

// 1x128 blocks: one warp per block, 4 values per lane kept in registers. kVec: lane owns 4
// consecutive elements (vector load/store; needs cols % 4 == 0 and aligned rows), else
// elements lane + 32k. narrow: rows * gc fits 32-bit division (see narrow_index_limit).
template <DType kT, bool kVec>
__global__ void block1x128_kernel(const void* x, int64_t rows, int64_t cols, int64_t rs,
                                  Fp8Format fmt, bool pow2, uint8_t* q, float* scales,
                                  bool narrow) {
  const int64_t gc = (cols + 127) / 128;
  const int64_t block = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (block >= rows * gc) return;  // whole warps exit together
  int64_t i, jb;
  if (narrow) {  // 32-bit division: several times cheaper than 64-bit
    const uint32_t b32 = static_cast<uint32_t>(block), g32 = static_cast<uint32_t>(gc);
    i = b32 / g32;
    jb = static_cast<int64_t>(b32 % g32) * 128;
  } else {
    i = block / gc;
    jb = (block % gc) * 128;
  }
  float v[4] = {0.f, 0.f, 0.f, 0.f};
  float m = 0.f;
  if constexpr (kVec) {
    const int64_t j = jb + 4 * lane;  // cols % 4 == 0: the 4 are all in or all out
    if (j < cols) load4<kT>(x, i * rs + j, v);
    for (int n = 0; n < 4; ++n) m = fmaxf(m, finite_abs_dev(v[n]));
    const float s = scale_of(warp_max(m), fmt, pow2);
    if (j < cols) encode_store4(q, i * cols + j, v, s, fmt);
    if (lane == 0) scales[block] = s;
  } else {
    for (int k = 0; k < 4; ++k) {
      const int64_t j = jb + lane + 32 * k;
      v[k] = j < cols ? load<kT>(x, i * rs + j) : 0.f;
      m = fmaxf(m, finite_abs_dev(v[k]));
    }
    const float s = scale_of(warp_max(m), fmt, pow2);
    for (int k = 0; k < 4; ++k) {
      const int64_t j = jb + lane + 32 * k;
      if (j < cols) q[i * cols + j] = encode(__fmul_rn(v[k], s), fmt);
    }
    if (lane == 0) scales[block] = s;
  }
}

// Row scaling: one thread block per row; amax reduction, then the cast (re-read from L2).
// kVec as in block1x128_kernel: 4 consecutive elements per thread and step.
template <DType kT, bool kVec>
__global__ void __launch_bounds__(kRowThreads)
    row_kernel(const void* x, int64_t cols, int64_t rs, Fp8Format fmt, bool pow2, uint8_t* q,
               float* scales) {
  __shared__ float partial[kRowThreads / 32];
  __shared__ float row_scale;
  const int64_t i = blockIdx.x;
  float m = 0.f;
  if constexpr (kVec) {
    for (int64_t j = 4 * threadIdx.x; j < cols; j += 4 * kRowThreads) {
      float v[4];
      load4<kT>(x, i * rs + j, v);
      for (int n = 0; n < 4; ++n) m = fmaxf(m, finite_abs_dev(v[n]));
    }
  } else {
    for (int64_t j = threadIdx.x; j < cols; j += kRowThreads) {
      m = fmaxf(m, finite_abs_dev(load<kT>(x, i * rs + j)));
    }
  }
  m = warp_max(m);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < kRowThreads / 32 ? partial[threadIdx.x] : 0.f;
    m = warp_max(m);
    if (threadIdx.x == 0) {
      row_scale = scale_of(m, fmt, pow2);
      scales[i] = row_scale;
    }
  }
  __syncthreads();
  const float s = row_scale;
  if constexpr (kVec) {
    for (int64_t j = 4 * threadIdx.x; j < cols; j += 4 * kRowThreads) {
      float v[4];
      load4<kT>(x, i * rs + j, v);
      encode_store4(q, i * cols + j, v, s, fmt);
    }
  } else {
    for (int64_t j = threadIdx.x; j < cols; j += kRowThreads) {
      q[i * cols + j] = encode(__fmul_rn(load<kT>(x, i * rs + j), s), fmt);
    }
  }
}

// Turns n amaxes into scales in place (zeroing them first when `zero`: the empty-input case).
cudaError_t amax_to_scales(float* s, int64_t n, Fp8Format fmt, bool pow2, bool zero,
                           cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (zero) {
    if (cudaError_t e = cudaMemsetAsync(s, 0, n * sizeof(float), stream); e != cudaSuccess) {
      return e;
    }
  }
  TIERLIFT_LAUNCH(static_cast<unsigned>((n + 255) / 256), 256, 0, stream, amax_to_scale_kernel)
  (s, n, fmt, pow2);
  return cudaGetLastError();
}

template <DType kT>
cudaError_t run(const Fp8QuantArgs& a, cudaStream_t stream) {
  // scales_t too: for an empty input qt may be null (an empty tensor's data_ptr()) while
  // scales_t still has safe scales to receive.
  const bool dual = a.qt != nullptr || a.scales_t != nullptr;
  const Fp8Blocks b = fp8_blocks(a.scaling, a.rows, a.cols);
  if (a.rows * a.cols == 0) {  // no elements: every scale is the safe scale of amax 0
    cudaError_t e =
        amax_to_scales(a.scales, b.grid_rows * b.grid_cols, a.fmt, a.pow2_scale, true, stream);
    if (e == cudaSuccess && dual) {
      const Fp8Blocks bt = fp8_blocks(a.scaling, a.cols, a.rows);
      e = amax_to_scales(a.scales_t, bt.grid_rows * bt.grid_cols, a.fmt, a.pow2_scale, true,
                         stream);
    }
    return e;
  }
  if (!dual && a.col_stride == 1 &&
      (a.scaling == Fp8Scaling::kBlock1x128 || a.scaling == Fp8Scaling::kRow)) {
    const size_t esize = kT == DType::kFloat32 ? 4 : 2;
    const bool vec = a.cols % 4 == 0 && a.row_stride % 4 == 0 &&
                     reinterpret_cast<uintptr_t>(a.x) % (4 * esize) == 0 &&
                     reinterpret_cast<uintptr_t>(a.q) % 4 == 0;
    if (a.scaling == Fp8Scaling::kBlock1x128) {
      const int64_t warps = a.rows * b.grid_cols;
      const unsigned blocks = static_cast<unsigned>((warps * 32 + 255) / 256);
      const bool narrow = warps <= narrow_index_limit() && warps <= INT32_MAX;
      if (vec) {
        TIERLIFT_LAUNCH(blocks, 256, 0, stream, block1x128_kernel<kT, true>)
        (a.x, a.rows, a.cols, a.row_stride, a.fmt, a.pow2_scale, a.q, a.scales, narrow);
      } else {
        TIERLIFT_LAUNCH(blocks, 256, 0, stream, block1x128_kernel<kT, false>)
        (a.x, a.rows, a.cols, a.row_stride, a.fmt, a.pow2_scale, a.q, a.scales, narrow);
      }
    } else {
      const unsigned blocks = static_cast<unsigned>(a.rows);
      if (vec) {
        TIERLIFT_LAUNCH(blocks, kRowThreads, 0, stream, row_kernel<kT, true>)
        (a.x, a.cols, a.row_stride, a.fmt, a.pow2_scale, a.q, a.scales);
      } else {
        TIERLIFT_LAUNCH(blocks, kRowThreads, 0, stream, row_kernel<kT, false>)
        (a.x, a.cols, a.row_stride, a.fmt, a.pow2_scale, a.q, a.scales);
      }
    }
    return cudaGetLastError();
  }
  // Two-pass tiled path. x^T's block (h, w) covers w rows and h columns of x.
  const Grid g{b.rows, b.cols, b.grid_cols, a.scales, false};
  const Fp8Blocks bt = fp8_blocks(a.scaling, a.cols, a.rows);
  const Grid gt{bt.cols, bt.rows, bt.grid_cols, a.scales_t, true};
  const int64_t n = b.grid_rows * b.grid_cols, nt = bt.grid_rows * bt.grid_cols;
  if (cudaError_t e = cudaMemsetAsync(a.scales, 0, n * sizeof(float), stream); e != cudaSuccess) {
    return e;
  }
  if (dual) {
    if (cudaError_t e = cudaMemsetAsync(a.scales_t, 0, nt * sizeof(float), stream);
        e != cudaSuccess) {
      return e;
    }
  }
  const dim3 block(kTile, kTile / kTileRowsPerThread);
  const dim3 tiles(static_cast<unsigned>((a.rows + kTile - 1) / kTile),
                   static_cast<unsigned>((a.cols + kTile - 1) / kTile));
  if (tiles.y > 65535u) return cudaErrorInvalidConfiguration;  // > 2M columns
  TIERLIFT_LAUNCH(tiles, block, 0, stream, amax_tiles_kernel<kT>)
  (a.x, a.rows, a.cols, a.row_stride, a.col_stride, g, gt, dual);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (cudaError_t e = amax_to_scales(a.scales, n, a.fmt, a.pow2_scale, false, stream);
      e != cudaSuccess) {
    return e;
  }
  if (dual) {
    if (cudaError_t e = amax_to_scales(a.scales_t, nt, a.fmt, a.pow2_scale, false, stream);
        e != cudaSuccess) {
      return e;
    }
  }
  TIERLIFT_LAUNCH(tiles, block, 0, stream, cast_tiles_kernel<kT>)
  (a.x, a.rows, a.cols, a.row_stride, a.col_stride, a.fmt, g, a.q, gt, a.qt);
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

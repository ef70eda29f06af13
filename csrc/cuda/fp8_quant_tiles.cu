// The FP8 quantizer's tiled path: tensor, column and 128x128 scaling, strided inputs and the dual
// (x and x^T) output of every scaling. Two passes over 64x64 tiles of x, 256 threads each:
//  1. amax. Each thread block stages |x| of up to 4 vertically adjacent tiles in shared memory
//     (16-byte loads of 8 elements where the rows are contiguous and aligned), max-combining
//     them where the scaling blocks allow, reduces every scaling block's slice of the tile and
//     merges it into the amax grid with one atomicMax per (tile, block) (non-negative floats
//     order like their bit patterns). Tensor scaling of a contiguous input is one grid-stride
//     reduction instead: one atomicMax per thread block. A tiny kernel turns amaxes into scales.
//  2. cast. Each block stages x's tile in shared memory and its scales next to it; a thread
//     encodes 16 consecutive codes of a row of q, and 16 of a row of x^T for qt read across
//     the tile, so both outputs leave as coalesced 16-byte stores (8, 4 or 1 where the output
//     widths are not multiples of 16).
// Every tile is 64-aligned and every block dimension is 1, a multiple of 128 or the whole
// matrix, so along a dimension whose block is not 1 a tile lies in one block (and so do 2 tiles
// down a column for 128-row blocks, 4 for whole columns). Results are bit-identical to fp8.h's
// rules.
// Delayed scaling (fp8_quantize_delayed) has its scale before it starts, so it skips pass 1: the
// cast kernel (or, for a contiguous input without q^T, a flat grid-stride cast) reads the scale
// from device memory and reduces the staged values' finite amax with one atomicMax per block; a
// one-thread kernel decides the scale used, and a second launch of the same cast, whose blocks
// return at once unless that scale changed, recasts only when the given scale would clip. Taken
// from an amax history (fp8_quantize_from_history), the scale is written first by a one-warp
// kernel, and the decision also writes the scale returned.
#include <cstdint>

#include "cuda/fp8_device.cuh"
#include "cuda/fp8_quant.cuh"
#include "cuda/fp8_quant_tiles.cuh"
#include "cuda/launch.cuh"

namespace tierlift {
namespace cuda {
namespace {

using fp8dev::atomic_max_nonneg;
using fp8dev::encode;
using fp8dev::finite_abs;
using fp8dev::group_max;
using fp8dev::scale_of;

constexpr int kTile = 64;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxSpan = 4;  // row tiles one amax block may combine

// How a grid's blocks meet a tile: one block for the tile, one per row, one per column, or
// one per element (degenerate shapes, e.g. column scaling of a single row).
enum Kind : int { kOne, kPerRow, kPerCol, kPerElem };

// A grid of scaling blocks, described over x's rows and columns: br x bc elements of x per
// block. `transposed` grids belong to x^T (the dual output): their scales are stored row-major
// over x^T, so x[i, j]'s block is at (j / bc, i / br) in a grid gc wide.
struct Grid {
  int64_t br, bc, gc;
  float* out;  // amax, then scales
  bool transposed;
  int kind;
  // x[i, j]'s slot, given the tile's block coordinates rb = r0 / br, cb = c0 / bc (used only
  // where the block is not 1).
  __device__ __forceinline__ int64_t slot(int64_t i, int64_t j, int64_t rb, int64_t cb) const {
    const int64_t bi = br == 1 ? i : rb, bj = bc == 1 ? j : cb;
    return transposed ? bj * gc + bi : bi * gc + bj;
  }
};

Grid make_grid(int64_t br, int64_t bc, int64_t gc, float* out, bool transposed) {
  const int kind = br == 1 ? (bc == 1 ? kPerElem : kPerRow) : (bc == 1 ? kPerCol : kOne);
  return Grid{br, bc, gc, out, transposed, kind};
}

// Stages x[r0.., c0..] (0 outside the matrix; |x| with kAbs, max-combined into what is there
// with kMax) in `tile`, and returns the finite |x| max of the elements this thread loaded. kW = 8:
// rows contiguous, 8 | cols, 8 | row stride, base 16-byte aligned; each thread loads two 8-element
// vectors. kW = 1: any strides, 16 elements per thread, walking along whichever of x's dimensions
// is contiguous.
template <DType kT, int kW, bool kAbs, bool kMax>
__device__ __forceinline__ float load_tile(float (*tile)[kTile + 1], const void* x, int64_t rows,
                                           int64_t cols, int64_t rs, int64_t cs, int64_t r0,
                                           int64_t c0, bool rows_fast) {
  float m = 0.f;
  auto put = [&](int r, int c, float v) {
    m = fmaxf(m, finite_abs(v));
    if (kAbs) v = finite_abs(v);
    tile[r][c] = kMax ? fmaxf(tile[r][c], v) : v;
  };
  if constexpr (kW == 8) {
    constexpr int kPer = kTile * kTile / 8 / kThreads;
    float v[kPer][8];
    TIERLIFT_UNROLL
    for (int k = 0; k < kPer; ++k) {  // all loads first: several in flight per thread
      const int idx = threadIdx.x + kThreads * k, r = idx / (kTile / 8), c = idx % (kTile / 8) * 8;
      const int64_t i = r0 + r, j = c0 + c;
      for (int n = 0; n < 8; ++n) v[k][n] = 0.f;
      if (i < rows && j < cols) fp8dev::load_vec<kT, 8>(x, i * rs + j, v[k]);
    }
    TIERLIFT_UNROLL
    for (int k = 0; k < kPer; ++k) {
      const int idx = threadIdx.x + kThreads * k, r = idx / (kTile / 8), c = idx % (kTile / 8) * 8;
      for (int n = 0; n < 8; ++n) put(r, c + n, v[k][n]);
    }
  } else {
    constexpr int kPer = kTile * kTile / kThreads;
    float v[kPer];
    TIERLIFT_UNROLL
    for (int k = 0; k < kPer; ++k) {
      const int idx = threadIdx.x + kThreads * k;
      const int r = rows_fast ? idx % kTile : idx / kTile,
                c = rows_fast ? idx / kTile : idx % kTile;
      const int64_t i = r0 + r, j = c0 + c;
      v[k] = i < rows && j < cols ? fp8dev::load<kT>(x, i * rs + j * cs) : 0.f;
    }
    TIERLIFT_UNROLL
    for (int k = 0; k < kPer; ++k) {
      const int idx = threadIdx.x + kThreads * k;
      const int r = rows_fast ? idx % kTile : idx / kTile,
                c = rows_fast ? idx / kTile : idx % kTile;
      put(r, c, v[k]);
    }
  }
  return m;
}

// Merges a staged |x| tile into grid g's amax (entries outside the matrix are 0).
__device__ void merge_tile(const float (*tile)[kTile + 1], const Grid& g, int64_t r0, int64_t c0,
                           int64_t rows, int64_t cols, float* warp_partial) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int64_t rb = r0 / g.br, cb = c0 / g.bc;
  constexpr int kLines = kTile / kWarps;  // rows (columns) per warp
  if (g.kind == kPerElem) {
    for (int k = 0; k < kTile * kTile / kThreads; ++k) {
      const int idx = threadIdx.x + kThreads * k, r = idx / kTile, c = idx % kTile;
      if (r0 + r < rows && c0 + c < cols) {
        atomic_max_nonneg(&g.out[g.slot(r0 + r, c0 + c, rb, cb)], tile[r][c]);
      }
    }
  } else if (g.kind == kPerRow) {
    for (int k = 0; k < kLines; ++k) {
      const int r = warp * kLines + k;
      const float m = group_max(fmaxf(tile[r][lane], tile[r][lane + 32]));
      if (lane == 0 && r0 + r < rows) atomic_max_nonneg(&g.out[g.slot(r0 + r, c0, rb, cb)], m);
    }
  } else if (g.kind == kPerCol) {
    for (int k = 0; k < kLines; ++k) {
      const int c = warp * kLines + k;
      const float m = group_max(fmaxf(tile[lane][c], tile[lane + 32][c]));
      if (lane == 0 && c0 + c < cols) atomic_max_nonneg(&g.out[g.slot(r0, c0 + c, rb, cb)], m);
    }
  } else {  // the whole tile is in one block
    float m = 0.f;
    for (int k = 0; k < kLines; ++k) {
      const int r = warp * kLines + k;
      m = fmaxf(m, fmaxf(tile[r][lane], tile[r][lane + 32]));
    }
    m = group_max(m);
    if (lane == 0) warp_partial[warp] = m;
    __syncthreads();
    if (warp == 0) {
      m = group_max(lane < kWarps ? warp_partial[lane] : 0.f);
      if (lane == 0) atomic_max_nonneg(&g.out[g.slot(r0, c0, rb, cb)], m);
    }
  }
}

// Pass 1 over `span` vertically adjacent tiles per block (span > 1 only where both grids'
// blocks hold whole 64*span-row strips of a column).
template <DType kT, int kW>
__global__ void __launch_bounds__(kThreads)
    amax_tiles_kernel(const void* x, int64_t rows, int64_t cols, int64_t rs, int64_t cs,
                      bool rows_fast, int span, Grid g0, Grid g1, bool two) {
  __shared__ float tile[kTile][kTile + 1];
  __shared__ float warp_partial[kWarps];
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTile * span;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kTile;
  load_tile<kT, kW, true, false>(tile, x, rows, cols, rs, cs, r0, c0, rows_fast);
  for (int s = 1; s < span; ++s) {  // each thread max-combines only the entries it wrote
    load_tile<kT, kW, true, true>(tile, x, rows, cols, rs, cs, r0 + s * kTile, c0, rows_fast);
  }
  __syncthreads();
  merge_tile(tile, g0, r0, c0, rows, cols, warp_partial);
  if (two) {
    __syncthreads();
    merge_tile(tile, g1, r0, c0, rows, cols, warp_partial);
  }
}

// Tensor amax of n contiguous elements (base 16-byte aligned): a grid-stride loop with four
// 8-element vector loads in flight per thread, one atomicMax per block into out0 (and out1).
template <DType kT>
__global__ void __launch_bounds__(kThreads)
    amax_flat_kernel(const void* x, int64_t n, float* out0, float* out1) {
  __shared__ float warp_partial[kWarps];
  constexpr int kUnroll = 4;
  const int64_t nv = n / 8, tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  float m = 0.f;
  for (int64_t c = tid; c < nv; c += kUnroll * stride) {
    float v[kUnroll][8];
    TIERLIFT_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      for (int e = 0; e < 8; ++e) v[u][e] = 0.f;
      if (c + u * stride < nv) fp8dev::load_vec<kT, 8>(x, (c + u * stride) * 8, v[u]);
    }
    TIERLIFT_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      for (int e = 0; e < 8; ++e) m = fmaxf(m, finite_abs(v[u][e]));
    }
  }
  for (int64_t k = nv * 8 + tid; k < n; k += stride)
    m = fmaxf(m, finite_abs(fp8dev::load<kT>(x, k)));
  m = group_max(m);
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  if (lane == 0) warp_partial[warp] = m;
  __syncthreads();
  if (warp == 0) {
    m = group_max(lane < kWarps ? warp_partial[lane] : 0.f);
    if (lane == 0) {
      atomic_max_nonneg(out0, m);
      if (out1) atomic_max_nonneg(out1, m);
    }
  }
}

__global__ void amax_to_scale_kernel(float* s, int64_t n, Fp8Format fmt, bool pow2) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) s[i] = scale_of(s[i], fmt, pow2);
}

// Stages grid g's scales for the tile: sc[r] per row, sc[c] per column, sc[0] for the tile.
// Called by threads 0..63.
__device__ __forceinline__ void stage_scales(float* sc, const Grid& g, int64_t r0, int64_t c0,
                                             int64_t rows, int64_t cols, int t) {
  const int64_t rb = r0 / g.br, cb = c0 / g.bc;
  if (g.kind == kPerRow) {
    sc[t] = r0 + t < rows ? g.out[g.slot(r0 + t, c0, rb, cb)] : 0.f;
  } else if (g.kind == kPerCol) {
    sc[t] = c0 + t < cols ? g.out[g.slot(r0, c0 + t, rb, cb)] : 0.f;
  } else if (g.kind == kOne) {
    sc[t] = g.out[g.slot(r0, c0, rb, cb)];
  }
}

// Encodes 16 staged values at (r, c + n) of x (n < 16; `across`: at (r + n, c) instead) with
// grid g's scales into four little-endian words.
__device__ __forceinline__ void encode16(const float (*tile)[kTile + 1], const float* sc,
                                         const Grid& g, int64_t rows, int64_t cols, int64_t r0,
                                         int64_t c0, int r, int c, bool across, Fp8Format fmt,
                                         uint32_t (&w)[4]) {
  const int64_t rb = r0 / g.br, cb = c0 / g.bc;
  TIERLIFT_UNROLL  // constant indices into w: registers, not local memory
      for (int k = 0; k < 4; ++k) {
    uint32_t word = 0;
    TIERLIFT_UNROLL
    for (int b = 0; b < 4; ++b) {
      const int n = 4 * k + b, rr = across ? r + n : r, cc = across ? c : c + n;
      float s;
      if (g.kind == kOne) {
        s = sc[0];
      } else if (g.kind == kPerRow) {
        s = sc[rr];
      } else if (g.kind == kPerCol) {
        s = sc[cc];
      } else {  // one block per element: only inside the matrix
        s = r0 + rr < rows && c0 + cc < cols ? g.out[g.slot(r0 + rr, c0 + cc, rb, cb)] : 0.f;
      }
      word |= encode(__fmul_rn(tile[rr][cc], s), fmt) << (8 * b);
    }
    w[k] = word;
  }
}

// Writes the first min(avail, 16) of the 16 codes in w to dst, `width` bytes per store
// (16, 8, 4 or 1; dst and avail are multiples of width, so a store is all in or all out).
__device__ __forceinline__ void store16(uint8_t* dst, const uint32_t (&w)[4], int64_t avail,
                                        int width) {
  if (width == 16) {
    if (avail >= 16) *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
  } else if (width == 8) {
    TIERLIFT_UNROLL
    for (int h = 0; h < 2; ++h) {
      if (avail >= 8 * h + 8) reinterpret_cast<uint2*>(dst)[h] = make_uint2(w[2 * h], w[2 * h + 1]);
    }
  } else if (width == 4) {
    TIERLIFT_UNROLL
    for (int k = 0; k < 4; ++k) {
      if (avail >= 4 * k + 4) reinterpret_cast<uint32_t*>(dst)[k] = w[k];
    }
  } else {
    TIERLIFT_UNROLL
    for (int n = 0; n < 16; ++n) {
      if (n < avail) dst[n] = static_cast<uint8_t>(w[n / 4] >> (8 * (n % 4)));
    }
  }
}

// Delayed scaling's options for a cast kernel. amax: also reduce the staged values' finite |x|
// max into *amax (one atomicMax per block). first_scale: this launch is the recast, and every
// block returns at once unless the decided scale (the grid's) differs from *first_scale, the
// scale the first cast used: equal scales give equal codes.
struct DelayedPass {
  float* amax = nullptr;
  const float* first_scale = nullptr;
};

// Whether a delayed recast has nothing to do (the same answer for every thread).
__device__ __forceinline__ bool recast_not_needed(const DelayedPass& d, const float* scale) {
  return d.first_scale != nullptr && __float_as_uint(*scale) == __float_as_uint(*d.first_scale);
}

// One thread block's finite amax into *amax: warp maxima were written to warp_partial before a
// __syncthreads; warp 0 combines them.
__device__ __forceinline__ void merge_block_amax(const float* warp_partial, float* amax) {
  if (threadIdx.x < 32) {
    const float m = group_max(threadIdx.x < kWarps ? warp_partial[threadIdx.x] : 0.f);
    if (threadIdx.x == 0) atomic_max_nonneg(amax, m);
  }
}

// Pass 2: q[i, j] with grid g (q_width bytes per store); if qt, also qt[j, i] with the
// transposed grid gt. With d (delayed scaling, tensor grids read from device scales): the amax of
// the staged tile, or the guarded recast.
template <DType kT, int kW>
__global__ void __launch_bounds__(kThreads)
    cast_tiles_kernel(const void* x, int64_t rows, int64_t cols, int64_t rs, int64_t cs,
                      bool rows_fast, Fp8Format fmt, Grid g, uint8_t* q, int q_width, Grid gt,
                      uint8_t* qt, int qt_width, DelayedPass d) {
  __shared__ float tile[kTile][kTile + 1];
  __shared__ float sc[kTile], sct[kTile];
  __shared__ float warp_partial[kWarps];
  if (recast_not_needed(d, g.out)) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int t = threadIdx.x;
  if (t < kTile) {
    stage_scales(sc, g, r0, c0, rows, cols, t);
  } else if (t < 2 * kTile && qt != nullptr) {
    stage_scales(sct, gt, r0, c0, rows, cols, t - kTile);
  }
  const float m = load_tile<kT, kW, false, false>(tile, x, rows, cols, rs, cs, r0, c0, rows_fast);
  if (d.amax != nullptr) {
    const float wm = group_max(m);
    if ((t & 31) == 0) warp_partial[t / 32] = wm;
  }
  __syncthreads();
  if (d.amax != nullptr) merge_block_amax(warp_partial, d.amax);
  const int line = t / 4, seg = t % 4 * 16;  // 4 threads per output row segment of 64 codes
  uint32_t w[4];
  if (r0 + line < rows && c0 + seg < cols) {  // row r0 + line of q, columns c0 + seg ..
    encode16(tile, sc, g, rows, cols, r0, c0, line, seg, false, fmt, w);
    store16(q + (r0 + line) * cols + c0 + seg, w, cols - c0 - seg, q_width);
  }
  if (qt != nullptr && c0 + line < cols && r0 + seg < rows) {  // row c0 + line of x^T
    encode16(tile, sct, gt, rows, cols, r0, c0, seg, line, true, fmt, w);
    store16(qt + (c0 + line) * rows + r0 + seg, w, rows - r0 - seg, qt_width);
  }
}

// The widest store in {16, 8, 4} that `n`-byte rows starting at p allow, else 1.
int store_width(const void* p, int64_t n) {
  for (int w : {16, 8, 4}) {
    if (n % w == 0 && reinterpret_cast<uintptr_t>(p) % w == 0) return w;
  }
  return 1;
}

// Thread blocks of a grid-stride loop over n contiguous elements, 8 per thread and step: at
// most 8 per SM (the grid's size only: any count gives the same result).
unsigned flat_blocks(int64_t n) {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms < 1) {
    sms = 132;
  }
  const int64_t want = (n / 8 + kThreads - 1) / kThreads;
  return static_cast<unsigned>(want < 8 * sms ? (want > 0 ? want : 1) : 8 * sms);
}

template <DType kT>
cudaError_t run_tiled(const Fp8QuantArgs& a, cudaStream_t stream) {
  const bool dual = a.qt != nullptr || a.scales_t != nullptr;
  // x^T's block (h, w) covers w rows and h columns of x.
  const Fp8Blocks b = fp8_blocks(a.scaling, a.rows, a.cols);
  const Fp8Blocks bt = fp8_blocks(a.scaling, a.cols, a.rows);
  const Grid g = make_grid(b.rows, b.cols, b.grid_cols, a.scales, false);
  const Grid gt = make_grid(bt.cols, bt.rows, bt.grid_cols, a.scales_t, true);
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
  const uintptr_t xa = reinterpret_cast<uintptr_t>(a.x);
  const bool vec = a.col_stride == 1 && a.cols % 8 == 0 && a.row_stride % 8 == 0 && xa % 16 == 0;
  const bool rows_fast = a.col_stride != 1 && a.row_stride == 1;
  const int64_t row_tiles = (a.rows + kTile - 1) / kTile, col_tiles = (a.cols + kTile - 1) / kTile;
  if (col_tiles > 65535) return cudaErrorInvalidConfiguration;  // > 4M columns
  const dim3 block(kThreads);
  if (a.scaling == Fp8Scaling::kTensor && a.col_stride == 1 && a.row_stride == a.cols &&
      xa % 16 == 0) {
    const int64_t total = a.rows * a.cols;
    TIERLIFT_LAUNCH(flat_blocks(total), block, 0, stream, amax_flat_kernel<kT>)
    (a.x, total, a.scales, dual ? a.scales_t : nullptr);
  } else {
    // Tiles combine down a column where neither grid has a block per row and every block is
    // whole columns or 128-row multiples (span * 64 divides the block height).
    int span = 1;
    if (g.br != 1 && (!dual || gt.br != 1)) {
      const int64_t h = dual && gt.br < g.br ? gt.br : g.br;
      span = h >= a.rows ? kMaxSpan : static_cast<int>(h / kTile < kMaxSpan ? h / kTile : kMaxSpan);
    }
    const dim3 grid(static_cast<unsigned>((row_tiles + span - 1) / span),
                    static_cast<unsigned>(col_tiles));
    if (vec) {
      TIERLIFT_LAUNCH(grid, block, 0, stream, amax_tiles_kernel<kT, 8>)
      (a.x, a.rows, a.cols, a.row_stride, a.col_stride, rows_fast, span, g, gt, dual);
    } else {
      TIERLIFT_LAUNCH(grid, block, 0, stream, amax_tiles_kernel<kT, 1>)
      (a.x, a.rows, a.cols, a.row_stride, a.col_stride, rows_fast, span, g, gt, dual);
    }
  }
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (cudaError_t e = fp8_amax_to_scales(a.scales, n, a.fmt, a.pow2_scale, false, stream);
      e != cudaSuccess) {
    return e;
  }
  if (dual) {
    if (cudaError_t e = fp8_amax_to_scales(a.scales_t, nt, a.fmt, a.pow2_scale, false, stream);
        e != cudaSuccess) {
      return e;
    }
  }
  const dim3 tiles(static_cast<unsigned>(row_tiles), static_cast<unsigned>(col_tiles));
  const int qw = store_width(a.q, a.cols), qtw = a.qt ? store_width(a.qt, a.rows) : 1;
  if (vec) {
    TIERLIFT_LAUNCH(tiles, block, 0, stream, cast_tiles_kernel<kT, 8>)
    (a.x, a.rows, a.cols, a.row_stride, a.col_stride, rows_fast, a.fmt, g, a.q, qw, gt, a.qt, qtw,
     DelayedPass{});
  } else {
    TIERLIFT_LAUNCH(tiles, block, 0, stream, cast_tiles_kernel<kT, 1>)
    (a.x, a.rows, a.cols, a.row_stride, a.col_stride, rows_fast, a.fmt, g, a.q, qw, gt, a.qt, qtw,
     DelayedPass{});
  }
  return cudaGetLastError();
}

// Delayed scaling's cast of n contiguous elements (x 16-byte and q 8-byte aligned) with the
// device scale *scale: a grid-stride loop with four 8-element vector loads in flight per thread
// and one 8-byte store of codes per vector, the finite amax reduced on the way (options as in
// cast_tiles_kernel). Each element is read once: the single pass the tiles' staging is not needed
// for when there is no q^T.
template <DType kT>
__global__ void __launch_bounds__(kThreads)
    cast_flat_kernel(const void* x, int64_t n, Fp8Format fmt, const float* scale, uint8_t* q,
                     DelayedPass d) {
  __shared__ float warp_partial[kWarps];
  if (recast_not_needed(d, scale)) return;
  constexpr int kUnroll = 4;
  const float s = *scale;
  const int64_t nv = n / 8, tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  float m = 0.f;
  for (int64_t c = tid; c < nv; c += kUnroll * stride) {
    float v[kUnroll][8];
    TIERLIFT_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      for (int e = 0; e < 8; ++e) v[u][e] = 0.f;
      if (c + u * stride < nv) fp8dev::load_vec<kT, 8>(x, (c + u * stride) * 8, v[u]);
    }
    TIERLIFT_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      for (int e = 0; e < 8; ++e) m = fmaxf(m, finite_abs(v[u][e]));
      if (c + u * stride < nv) fp8dev::encode_store<8>(q, (c + u * stride) * 8, v[u], s, fmt);
    }
  }
  for (int64_t k = nv * 8 + tid; k < n; k += stride) {
    const float v = fp8dev::load<kT>(x, k);
    m = fmaxf(m, finite_abs(v));
    q[k] = static_cast<uint8_t>(encode(__fmul_rn(v, s), fmt));
  }
  if (d.amax == nullptr) return;  // the same for the whole block
  m = group_max(m);
  if ((threadIdx.x & 31) == 0) warp_partial[threadIdx.x / 32] = m;
  __syncthreads();
  merge_block_amax(warp_partial, d.amax);
}

// core's fp8_delayed_redo and fp8_scale: scale_used = *scale, or x's own scale where *scale is
// not finite and > 0 or fl(amax * *scale) exceeds the format's max; with `masked`, also
// *masked = scale_used, or 1 where amax is 0 (fp8_quantize_from_history's scale). One thread.
__global__ void delayed_scale_kernel(const float* amax, const float* scale, Fp8Format fmt,
                                     bool pow2, float* scale_used, float* masked) {
  const float a = *amax, s = *scale;
  const float fmax = fmt == Fp8Format::kE4M3 ? kE4M3Max : kE5M2Max;
  const bool redo = !(s > 0.f && s <= kF32Max) || __fmul_rn(a, s) > fmax;
  const float used = redo ? scale_of(a, fmt, pow2) : s;
  *scale_used = used;
  if (masked != nullptr) *masked = a == 0.f ? 1.f : used;
}

// core's fp8_history_scale on one warp: the lanes stride over the history, then the warp
// combines their maxima (at least kSmallestAmax) and whether any lane saw a NaN (torch's max
// returns NaN then, whose scale is 1). Also zeroes the amax the cast reduces into (the memset
// fp8_quantize_delayed needs).
__global__ void history_scale_kernel(const float* history, int64_t n, int64_t stride, Fp8Format fmt,
                                     bool pow2, float* given, float* amax) {
  float m = kSmallestAmax;
  bool nan = false;
  for (int64_t i = threadIdx.x; i < n; i += 32) {
    const float v = history[i * stride];
    nan |= v != v;
    m = fmaxf(m, v);
  }
  m = group_max(m);
  nan = __any_sync(0xffffffffu, nan);
  if (threadIdx.x == 0) {
    *given = nan ? 1.f : scale_of(m, fmt, pow2);
    *amax = 0.f;
  }
}

// One cast of delayed scaling with the device scale `scale` (the first, with d.amax, or the
// guarded recast): the flat kernel for a contiguous input without q^T, the tiles otherwise.
template <DType kT>
cudaError_t delayed_cast(const Fp8DelayedArgs& a, const float* scale, DelayedPass d,
                         cudaStream_t stream) {
  const uintptr_t xa = reinterpret_cast<uintptr_t>(a.x);
  const dim3 block(kThreads);
  if (a.qt == nullptr && a.col_stride == 1 && a.row_stride == a.cols && xa % 16 == 0 &&
      reinterpret_cast<uintptr_t>(a.q) % 8 == 0) {
    const int64_t n = a.rows * a.cols;
    TIERLIFT_LAUNCH(flat_blocks(n), block, 0, stream, cast_flat_kernel<kT>)
    (a.x, n, a.fmt, scale, a.q, d);
    return cudaGetLastError();
  }
  // Tensor scaling's grids: every element's scale is scale[0].
  const Fp8Blocks b = fp8_blocks(Fp8Scaling::kTensor, a.rows, a.cols);
  const Fp8Blocks bt = fp8_blocks(Fp8Scaling::kTensor, a.cols, a.rows);
  float* s = const_cast<float*>(scale);  // the cast kernels only read their grids
  const Grid g = make_grid(b.rows, b.cols, b.grid_cols, s, false);
  const Grid gt = make_grid(bt.cols, bt.rows, bt.grid_cols, s, true);
  const bool vec = a.col_stride == 1 && a.cols % 8 == 0 && a.row_stride % 8 == 0 && xa % 16 == 0;
  const bool rows_fast = a.col_stride != 1 && a.row_stride == 1;
  const int64_t row_tiles = (a.rows + kTile - 1) / kTile, col_tiles = (a.cols + kTile - 1) / kTile;
  if (col_tiles > 65535) return cudaErrorInvalidConfiguration;  // > 4M columns
  const dim3 tiles(static_cast<unsigned>(row_tiles), static_cast<unsigned>(col_tiles));
  const int qw = store_width(a.q, a.cols), qtw = a.qt ? store_width(a.qt, a.rows) : 1;
  if (vec) {
    TIERLIFT_LAUNCH(tiles, block, 0, stream, cast_tiles_kernel<kT, 8>)
    (a.x, a.rows, a.cols, a.row_stride, a.col_stride, rows_fast, a.fmt, g, a.q, qw, gt, a.qt, qtw,
     d);
  } else {
    TIERLIFT_LAUNCH(tiles, block, 0, stream, cast_tiles_kernel<kT, 1>)
    (a.x, a.rows, a.cols, a.row_stride, a.col_stride, rows_fast, a.fmt, g, a.q, qw, gt, a.qt, qtw,
     d);
  }
  return cudaGetLastError();
}

// The cast, the decision (also writing `masked` where given) and the guarded recast; *a.amax is
// zeroed first unless an earlier launch did.
template <DType kT>
cudaError_t run_delayed(const Fp8DelayedArgs& a, float* masked, bool amax_zeroed,
                        cudaStream_t stream) {
  const bool empty = a.rows * a.cols == 0;
  if (!amax_zeroed) {
    if (cudaError_t e = cudaMemsetAsync(a.amax, 0, sizeof(float), stream); e != cudaSuccess) {
      return e;
    }
  }
  if (!empty) {
    if (cudaError_t e = delayed_cast<kT>(a, a.scale, DelayedPass{a.amax, nullptr}, stream);
        e != cudaSuccess) {
      return e;
    }
  }
  TIERLIFT_LAUNCH(1, 1, 0, stream, delayed_scale_kernel)
  (a.amax, a.scale, a.fmt, a.pow2_scale, a.scale_used, masked);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (empty) return cudaSuccess;
  return delayed_cast<kT>(a, a.scale_used, DelayedPass{nullptr, a.scale}, stream);
}

cudaError_t run_delayed_any(const Fp8DelayedArgs& a, float* masked, bool amax_zeroed,
                            cudaStream_t stream) {
  switch (a.dtype) {
    case DType::kBFloat16:
      return run_delayed<DType::kBFloat16>(a, masked, amax_zeroed, stream);
    case DType::kFloat16:
      return run_delayed<DType::kFloat16>(a, masked, amax_zeroed, stream);
    default:
      return run_delayed<DType::kFloat32>(a, masked, amax_zeroed, stream);
  }
}

}  // namespace

cudaError_t fp8_amax_to_scales(float* s, int64_t n, Fp8Format fmt, bool pow2, bool zero,
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

cudaError_t fp8_quantize_tiled(const Fp8QuantArgs& a, cudaStream_t stream) {
  switch (a.dtype) {
    case DType::kBFloat16:
      return run_tiled<DType::kBFloat16>(a, stream);
    case DType::kFloat16:
      return run_tiled<DType::kFloat16>(a, stream);
    default:
      return run_tiled<DType::kFloat32>(a, stream);
  }
}

cudaError_t fp8_quantize_delayed(const Fp8DelayedArgs& a, cudaStream_t stream) {
  return run_delayed_any(a, nullptr, false, stream);
}

cudaError_t fp8_quantize_from_history(const Fp8HistoryArgs& h, cudaStream_t stream) {
  if (h.history_len < 1) return cudaErrorInvalidValue;
  const Fp8DelayedArgs& a = h.delayed;
  TIERLIFT_LAUNCH(1, 32, 0, stream, history_scale_kernel)
  (h.history, h.history_len, h.history_stride, a.fmt, a.pow2_scale, h.given, a.amax);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  Fp8DelayedArgs with_given = a;
  with_given.scale = h.given;
  return run_delayed_any(with_given, h.scale, true, stream);
}

}  // namespace cuda
}  // namespace tierlift

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
//     the tile (or, where x^T's scale for the tile is x's: tensor, 128x128 and delayed scaling,
//     q's codes read back down the columns), so both outputs leave as coalesced 16-byte stores
//     (8, 4 or 1 where the output widths are not multiples of 16). The 16 codes take one scale from
//     a register, or 16 read as four 16-byte shared loads where the blocks change along them; the
//     encoder (fp8dev::Fp8Encoder) has no per-element branch, and a group holding NaN or Inf is
//     encoded again exactly.
// Every tile is 64-aligned and every block dimension is 1, 64 * 2^k or the whole matrix, so along
// a dimension whose block is not 1 a tile lies in one block (and so do 2 tiles down a column for
// 128-row blocks, 4 for whole columns), found by shifting the tile's index: no kernel divides.
// Results are bit-identical to fp8.h's rules.
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

// How a grid's blocks meet a tile: one block for the tile, one per row, or one per column.
enum Kind : int { kOne, kPerRow, kPerCol };

// A grid of scaling blocks, described over x's rows and columns. `transposed` grids belong to
// x^T (the dual output): their scales are stored row-major over x^T, gc wide. A tile's block
// coordinates are its tile indices shifted right by row_shift / col_shift (blocks of 64 * 2^k
// rows or columns, or whole dimensions: shift 63), so no kernel divides.
struct Grid {
  int64_t gc;
  float* out;  // amax, then scales
  bool transposed;
  int kind;
  int row_shift, col_shift;
  // The block coordinates of the tile at (r0, c0) (r0 and c0 multiples of 64).
  __device__ __forceinline__ int64_t row_block(int64_t r0) const { return (r0 >> 6) >> row_shift; }
  __device__ __forceinline__ int64_t col_block(int64_t c0) const { return (c0 >> 6) >> col_shift; }
  // x[i, j]'s slot in the tile whose blocks are rb, cb: a row's own block for kPerRow, a
  // column's for kPerCol.
  __device__ __forceinline__ int64_t slot(int64_t i, int64_t j, int64_t rb, int64_t cb) const {
    const int64_t bi = kind == kPerRow ? i : rb, bj = kind == kPerCol ? j : cb;
    return transposed ? bj * gc + bi : bi * gc + bj;
  }
};

// The tile-index shift of blocks b elements long along a dimension of n > 0: 0 for b = 1 (unused:
// such a dimension is indexed per row or column), 63 for a whole dimension, k for b = 64 * 2^k;
// -1 for any other size, which no scaling has (a tile would straddle two blocks).
int tile_shift(int64_t b, int64_t n) {
  if (b == 1) return 0;
  if (b >= n) return 63;
  for (int k = 0; k < 32; ++k) {
    if (b == (int64_t{kTile} << k)) return k;
  }
  return -1;
}

// The grid of br x bc blocks over a rows x cols x; false where its blocks do not meet the tiles
// as the kernels assume. A grid of single elements only exists for a single row or column, where
// it is per column (rows == 1) or per row (cols == 1): the other coordinate is 0 in every tile.
bool make_grid(int64_t br, int64_t bc, int64_t gc, float* out, bool transposed, int64_t rows,
               int64_t cols, Grid* g) {
  int kind = kOne;
  if (br == 1 && bc == 1) {
    if (rows != 1 && cols != 1) return false;
    kind = rows == 1 ? kPerCol : kPerRow;
  } else if (br == 1) {
    kind = kPerRow;
  } else if (bc == 1) {
    kind = kPerCol;
  }
  *g = Grid{gc, out, transposed, kind, tile_shift(br, rows), tile_shift(bc, cols)};
  return g->row_shift >= 0 && g->col_shift >= 0;
}

// Stages x[r0.., c0..] (0 outside the matrix; |x| with kAbs, max-combined into what is there
// with kMax) in `tile`, and returns the finite |x| max of the elements this thread loaded where
// want_amax (0 otherwise: the reduction is skipped, not just unused). kW = 8:
// rows contiguous, 8 | cols, 8 | row stride, base 16-byte aligned; each thread loads two 8-element
// vectors. kW = 1: any strides, 16 elements per thread, walking along whichever of x's dimensions
// is contiguous.
template <DType kT, int kW, bool kAbs, bool kMax>
__device__ __forceinline__ float load_tile(float (*tile)[kTile + 1], const void* x, int64_t rows,
                                           int64_t cols, int64_t rs, int64_t cs, int64_t r0,
                                           int64_t c0, bool rows_fast, bool want_amax) {
  float m = 0.f;
  auto put = [&](int r, int c, float v) {
    if (kAbs) v = finite_abs(v);
    // Volatile: what the previous tile of the span left is read back, not kept in registers
    // (16 more per thread) across the loads.
    tile[r][c] = kMax ? fmaxf(*static_cast<volatile float*>(&tile[r][c]), v) : v;
  };
  if constexpr (kW == 8) {
    // Thread t's vectors: rows r + 32 k, columns c ... A warp covers 8 rows of 32 columns: its
    // shared stores (row stride 65) fall in 32 different banks, as 4 rows of 64 would not.
    constexpr int kPer = kTile * kTile / 8 / kThreads, kRowsPer = kThreads / (kTile / 8);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int r = warp / 2 * 8 + lane / 4, c = warp % 2 * 32 + lane % 4 * 8;
    const int64_t rows_left = rows - r0 - r;
    const bool col_in = c0 + c < cols;
    // Byte addresses: an element index would be divided by 8 (with a sign fix) per load.
    constexpr int kSize = kT == DType::kFloat32 ? 4 : 2;
    const char* first = static_cast<const char*>(x) + ((r0 + r) * rs + c0 + c) * kSize;
    fp8dev::Raw8<kT> raw[kPer];
    TIERLIFT_UNROLL
    for (int k = 0; k < kPer; ++k) {  // all loads first: several in flight per thread
      raw[k] = fp8dev::load_raw8<kT>(first + kRowsPer * k * rs * kSize,
                                     col_in && kRowsPer * k < rows_left);
    }
    float v[kPer][8];
    TIERLIFT_UNROLL
    for (int k = 0; k < kPer; ++k) fp8dev::widen8<kT>(raw[k], v[k]);
    if (want_amax) {
      for (int k = 0; k < kPer; ++k) {
        for (int n = 0; n < 8; ++n) m = fmaxf(m, finite_abs(v[k][n]));
      }
    }
    TIERLIFT_UNROLL
    for (int k = 0; k < kPer; ++k) {
      for (int n = 0; n < 8; ++n) put(r + kRowsPer * k, c + n, v[k][n]);
    }
  } else {
    // Thread t's elements: 16 along the slow dimension, 4 apart, at t % 64 along the fast one.
    constexpr int kPer = kTile * kTile / kThreads, kStep = kThreads / kTile;
    const int fast = threadIdx.x % kTile, slow = threadIdx.x / kTile;
    const int r = rows_fast ? fast : slow, c = rows_fast ? slow : fast;
    const int64_t first = (r0 + r) * rs + (c0 + c) * cs, step = kStep * (rows_fast ? cs : rs);
    const int64_t left = rows_fast ? cols - c0 - c : rows - r0 - r;  // along the slow dimension
    const bool fast_in = rows_fast ? r0 + r < rows : c0 + c < cols;
    float v[kPer];
    TIERLIFT_UNROLL
    for (int k = 0; k < kPer; ++k) {
      v[k] = fast_in && kStep * k < left ? fp8dev::load<kT>(x, first + k * step) : 0.f;
    }
    if (want_amax) {
      for (int k = 0; k < kPer; ++k) m = fmaxf(m, finite_abs(v[k]));
    }
    TIERLIFT_UNROLL
    for (int k = 0; k < kPer; ++k) {
      put(rows_fast ? r : r + kStep * k, rows_fast ? c + kStep * k : c, v[k]);
    }
  }
  return m;
}

// Merges a staged |x| tile into grid g's amax (entries outside the matrix are 0).
__device__ void merge_tile(const float (*tile)[kTile + 1], const Grid& g, int64_t r0, int64_t c0,
                           int64_t rows, int64_t cols, float* warp_partial) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int64_t rb = g.row_block(r0), cb = g.col_block(c0);
  constexpr int kLines = kTile / kWarps;  // rows (columns) per warp
  if (g.kind == kPerRow) {
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
  load_tile<kT, kW, true, false>(tile, x, rows, cols, rs, cs, r0, c0, rows_fast, false);
  for (int s = 1; s < span; ++s) {  // each thread max-combines only the entries it wrote
    load_tile<kT, kW, true, true>(tile, x, rows, cols, rs, cs, r0 + s * kTile, c0, rows_fast,
                                  false);
  }
  __syncthreads();
  merge_tile(tile, g0, r0, c0, rows, cols, warp_partial);
  if (two) {
    __syncthreads();
    merge_tile(tile, g1, r0, c0, rows, cols, warp_partial);
  }
}

// The grid-stride loop of the flat kernels over n contiguous elements of x (base 16-byte
// aligned): kUnroll 8-element vector loads in flight per thread and step, then vec(v, k, in) for
// each (elements k..k+7; in: inside the tensor, else v is zeros), then one(value, k) for each of
// the n % 8 tail elements.
template <DType kT, int kUnroll, class Vec, class One>
__device__ __forceinline__ void flat_loop(const void* x, int64_t n, Vec&& vec, One&& one) {
  const int64_t nv = n / 8, tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  constexpr int kSize = kT == DType::kFloat32 ? 4 : 2;
  for (int64_t c = tid; c < nv; c += kUnroll * stride) {
    fp8dev::Raw8<kT> raw[kUnroll];
    TIERLIFT_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      raw[u] = fp8dev::load_raw8<kT>(static_cast<const char*>(x) + (c + u * stride) * 8 * kSize,
                                     c + u * stride < nv);
    }
    TIERLIFT_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      float v[8];
      fp8dev::widen8<kT>(raw[u], v);
      vec(v, (c + u * stride) * 8, c + u * stride < nv);
    }
  }
  // The n % 8 < 8 tail elements: thread j takes element nv * 8 + j (a grid has >= 256 threads),
  // an `if` rather than a loop whose trip count the compiler would divide out.
  if (const int64_t k = nv * 8 + tid; k < n) one(fp8dev::load<kT>(x, k), k);
}

// Tensor amax of n contiguous elements (base 16-byte aligned): the flat loop, one atomicMax per
// block into out0 (and out1).
template <DType kT>
__global__ void __launch_bounds__(kThreads)
    amax_flat_kernel(const void* x, int64_t n, float* out0, float* out1) {
  __shared__ float warp_partial[kWarps];
  float m = 0.f;
  flat_loop<kT, 4>(
      x, n,
      [&](const float(&v)[8], int64_t, bool) {  // zeros outside: no test needed
        for (int e = 0; e < 8; ++e) m = fmaxf(m, finite_abs(v[e]));
      },
      [&](float v, int64_t) { m = fmaxf(m, finite_abs(v)); });
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

// Stages grid g's scales for the tile: sc[r] per row, sc[c] per column (0 outside the matrix),
// the tile's one scale in every sc[t] otherwise. Called by threads 0..63.
__device__ __forceinline__ void stage_scales(float* sc, const Grid& g, int64_t r0, int64_t c0,
                                             int64_t rows, int64_t cols, int t) {
  const int64_t rb = g.row_block(r0), cb = g.col_block(c0);
  if (g.kind == kPerRow) {
    sc[t] = r0 + t < rows ? g.out[g.slot(r0 + t, c0, rb, cb)] : 0.f;
  } else if (g.kind == kPerCol) {
    sc[t] = c0 + t < cols ? g.out[g.slot(r0, c0 + t, rb, cb)] : 0.f;
  } else {
    sc[t] = g.out[g.slot(r0, c0, rb, cb)];
  }
}

// Codes of 16 staged values, tile[line][seg + n] (kAcross: tile[seg + n][line]) for n < 16,
// into four little-endian words. kPerCode: value n's scale is s[n] (16-byte aligned), else s[0]
// for all. The fast encoder first; a group holding a non-finite product is encoded again with
// encode(), which gives those their codes.
template <bool kAcross, bool kPerCode>
__device__ __forceinline__ void encode16_scaled(const float (*tile)[kTile + 1], const float* s,
                                                int line, int seg, const fp8dev::Fp8Encoder& enc,
                                                uint32_t (&w)[4]) {
  auto value = [&](int n) { return kAcross ? tile[seg + n][line] : tile[line][seg + n]; };
  const float one_scale = s[0];
  bool special = false;
  TIERLIFT_UNROLL  // constant indices into w: registers, not local memory
      for (int k = 0; k < 4; ++k) {
    float sk[4] = {one_scale, one_scale, one_scale, one_scale};
    if (kPerCode) {
      const float4 s4 = reinterpret_cast<const float4*>(s)[k];
      sk[0] = s4.x, sk[1] = s4.y, sk[2] = s4.z, sk[3] = s4.w;
    }
    float xk[4];
    for (int b = 0; b < 4; ++b) xk[b] = __fmul_rn(value(4 * k + b), sk[b]);
    w[k] = enc.pack4(xk, special);
  }
  if (special) {  // rare: NaN or Inf in x, or a product that overflowed
    // Volatile: read again here rather than keep the 16 values in registers for this path.
    auto again = [](const float& f) { return *static_cast<const volatile float*>(&f); };
    TIERLIFT_UNROLL
    for (int k = 0; k < 4; ++k) {
      uint32_t word = 0;
      for (int b = 0; b < 4; ++b) {
        const int n = 4 * k + b;
        const float v = again(kAcross ? tile[seg + n][line] : tile[line][seg + n]);
        word |= encode(__fmul_rn(v, kPerCode ? again(s[n]) : one_scale), enc.fmt) << (8 * b);
      }
      w[k] = word;
    }
  }
}

// Codes of 16 staged values (as encode16_scaled) with the tile's scales sc of a grid of `kind`:
// one per code where the grid's blocks vary along the 16 (per column along a row of q, per row
// along a row of q^T), else the line's or the tile's.
template <bool kAcross>
__device__ __forceinline__ void encode16(const float (*tile)[kTile + 1], const float* sc, int kind,
                                         int line, int seg, const fp8dev::Fp8Encoder& enc,
                                         uint32_t (&w)[4]) {
  if (kind == (kAcross ? kPerRow : kPerCol)) {
    encode16_scaled<kAcross, true>(tile, sc + seg, line, seg, enc, w);
  } else {
    encode16_scaled<kAcross, false>(tile, sc + (kind == kOne ? 0 : line), line, seg, enc, w);
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

// Codes of a 64x64 tile as bytes, rows 68 bytes apart (word-aligned rows; the column reads of
// the 4 segments of a line meet 2 to a bank).
constexpr int kCodeRowWords = kTile / 4 + 1;

// Codes tile[seg + n][line] for n < 16 read down a column of the staged codes, packed as encode16
// packs them.
__device__ __forceinline__ void gather16(const uint32_t (*codes)[kCodeRowWords], int line, int seg,
                                         uint32_t (&w)[4]) {
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(codes);
  TIERLIFT_UNROLL
  for (int k = 0; k < 4; ++k) {
    uint32_t word = 0;
    for (int b = 0; b < 4; ++b) {
      word |= static_cast<uint32_t>(bytes[(seg + 4 * k + b) * 4 * kCodeRowWords + line]) << (8 * b);
    }
    w[k] = word;
  }
}

// Pass 2: q[i, j] with grid g (q_width bytes per store); if qt, also qt[j, i] with the
// transposed grid gt. Where both grids give the tile one and the same scale (tensor and 128x128
// scaling, delayed scaling), qt's codes are q's: they are staged in shared memory and read back
// down the columns instead of encoded twice. With d (delayed scaling, tensor grids read from
// device scales): the amax of the staged tile, or the guarded recast.
// 8 blocks per SM (32 registers) for the vector loads, 6 (40) for the element loads: what each
// fits without spilling (nvcc would take 36 for fp32 vectors, a block fewer).
template <DType kT, int kW>
__global__ void __launch_bounds__(kThreads, kW == 8 ? 8 : 6)
    cast_tiles_kernel(const void* x, int64_t rows, int64_t cols, int64_t rs, int64_t cs,
                      bool rows_fast, fp8dev::Fp8Encoder enc, Grid g, uint8_t* q, int q_width,
                      Grid gt, uint8_t* qt, int qt_width, DelayedPass d) {
  __shared__ float tile[kTile][kTile + 1];
  __shared__ __align__(16) float sc[kTile];
  __shared__ __align__(16) float sct[kTile];
  __shared__ uint32_t codes[kTile][kCodeRowWords];
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
  const bool want_amax = d.amax != nullptr;
  const float m =
      load_tile<kT, kW, false, false>(tile, x, rows, cols, rs, cs, r0, c0, rows_fast, want_amax);
  if (want_amax) {
    const float wm = group_max(m);
    if ((t & 31) == 0) warp_partial[t / 32] = wm;
  }
  __syncthreads();
  if (want_amax) merge_block_amax(warp_partial, d.amax);
  // 4 threads per output row of 64 codes, 16 each. A warp takes 16 lines and 2 segments: the
  // 16 codes' shared reads (row stride 65) then fall in 32 different banks, as 8 lines and 4
  // segments would not.
  const int line = t / 64 * 16 + t % 16, seg = t / 16 % 4 * 16;
  // Equal scales give equal codes (the same for every thread: read after the barrier).
  const bool qt_is_q_transposed = qt != nullptr && g.kind == kOne && gt.kind == kOne &&
                                  __float_as_uint(sc[0]) == __float_as_uint(sct[0]);
  uint32_t w[4];
  if (r0 + line < rows && c0 + seg < cols) {  // row r0 + line of q, columns c0 + seg ..
    encode16<false>(tile, sc, g.kind, line, seg, enc, w);
    store16(q + (r0 + line) * cols + c0 + seg, w, cols - c0 - seg, q_width);
    if (qt_is_q_transposed) {
      for (int k = 0; k < 4; ++k) codes[line][seg / 4 + k] = w[k];
    }
  }
  if (qt == nullptr) return;
  // Every code qt stores below was staged: its q row and segment are inside the matrix.
  if (qt_is_q_transposed) __syncthreads();
  if (c0 + line < cols && r0 + seg < rows) {  // row c0 + line of x^T
    if (qt_is_q_transposed) {
      gather16(codes, line, seg, w);
    } else {
      encode16<true>(tile, sct, gt.kind, line, seg, enc, w);
    }
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
  Grid g, gt;
  if (!make_grid(b.rows, b.cols, b.grid_cols, a.scales, false, a.rows, a.cols, &g) ||
      !make_grid(bt.cols, bt.rows, bt.grid_cols, a.scales_t, true, a.rows, a.cols, &gt)) {
    return cudaErrorInvalidValue;  // before any launch: no scaling has such blocks
  }
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
    const int64_t br = b.rows, brt = bt.cols;  // block heights over x's rows
    if (br != 1 && (!dual || brt != 1)) {
      const int64_t h = dual && brt < br ? brt : br;
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
    (a.x, a.rows, a.cols, a.row_stride, a.col_stride, rows_fast, fp8dev::Fp8Encoder::of(a.fmt), g,
     a.q, qw, gt, a.qt, qtw, DelayedPass{});
  } else {
    TIERLIFT_LAUNCH(tiles, block, 0, stream, cast_tiles_kernel<kT, 1>)
    (a.x, a.rows, a.cols, a.row_stride, a.col_stride, rows_fast, fp8dev::Fp8Encoder::of(a.fmt), g,
     a.q, qw, gt, a.qt, qtw, DelayedPass{});
  }
  return cudaGetLastError();
}

// Delayed scaling's cast of n contiguous elements (x 16-byte and q 8-byte aligned) with the
// device scale *scale: the flat loop, one 8-byte store of codes per vector, the finite amax
// reduced on the way (options as in cast_tiles_kernel). Each element is read once: the single
// pass the tiles' staging is not needed for when there is no q^T.
template <DType kT>
__global__ void __launch_bounds__(kThreads)
    cast_flat_kernel(const void* x, int64_t n, fp8dev::Fp8Encoder enc, const float* scale,
                     uint8_t* q, DelayedPass d) {
  __shared__ float warp_partial[kWarps];
  if (recast_not_needed(d, scale)) return;
  const float s = *scale;
  float m = 0.f;
  flat_loop<kT, 2>(  // two vectors in flight: the encoder's registers fit at 50% occupancy
      x, n,
      [&](const float(&v)[8], int64_t k, bool in) {
        // |v| max without the non-finite test: a non-finite v makes its product non-finite, and
        // such a vector is redone below.
        float vm = 0.f;
        bool special = false;
        uint32_t w[2];
        TIERLIFT_UNROLL
        for (int h = 0; h < 2; ++h) {
          float xh[4];
          for (int b = 0; b < 4; ++b) {
            xh[b] = __fmul_rn(v[4 * h + b], s);
            vm = fmaxf(vm, fabsf(v[4 * h + b]));
          }
          w[h] = enc.pack4(xh, special);
        }
        if (!in) return;  // zeros: nothing to store or add
        reinterpret_cast<uint2*>(q)[k / 8] = make_uint2(w[0], w[1]);
        if (!special) {
          m = fmaxf(m, vm);
          return;
        }
        // Rare: NaN or Inf in x, or a product that overflowed. The vector is loaded again (after
        // the store, which may alias it for all the compiler knows) rather than kept in registers
        // for this path, encoded exactly and stored over the fast codes.
        float again[8];
        fp8dev::load_vec<kT, 8>(x, k, again);
        TIERLIFT_UNROLL
        for (int h = 0; h < 2; ++h) {
          w[h] = 0;
          for (int b = 0; b < 4; ++b) {
            w[h] |= encode(__fmul_rn(again[4 * h + b], s), enc.fmt) << (8 * b);
            m = fmaxf(m, finite_abs(again[4 * h + b]));
          }
        }
        reinterpret_cast<uint2*>(q)[k / 8] = make_uint2(w[0], w[1]);
      },
      [&](float v, int64_t k) {
        m = fmaxf(m, finite_abs(v));
        q[k] = static_cast<uint8_t>(encode(__fmul_rn(v, s), enc.fmt));
      });
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
    (a.x, n, fp8dev::Fp8Encoder::of(a.fmt), scale, a.q, d);
    return cudaGetLastError();
  }
  // Tensor scaling's grids: every element's scale is scale[0].
  const Fp8Blocks b = fp8_blocks(Fp8Scaling::kTensor, a.rows, a.cols);
  const Fp8Blocks bt = fp8_blocks(Fp8Scaling::kTensor, a.cols, a.rows);
  float* s = const_cast<float*>(scale);  // the cast kernels only read their grids
  Grid g, gt;
  if (!make_grid(b.rows, b.cols, b.grid_cols, s, false, a.rows, a.cols, &g) ||
      !make_grid(bt.cols, bt.rows, bt.grid_cols, s, true, a.rows, a.cols, &gt)) {
    return cudaErrorInvalidValue;  // not reached: tensor blocks are whole dimensions
  }
  const bool vec = a.col_stride == 1 && a.cols % 8 == 0 && a.row_stride % 8 == 0 && xa % 16 == 0;
  const bool rows_fast = a.col_stride != 1 && a.row_stride == 1;
  const int64_t row_tiles = (a.rows + kTile - 1) / kTile, col_tiles = (a.cols + kTile - 1) / kTile;
  if (col_tiles > 65535) return cudaErrorInvalidConfiguration;  // > 4M columns
  const dim3 tiles(static_cast<unsigned>(row_tiles), static_cast<unsigned>(col_tiles));
  const int qw = store_width(a.q, a.cols), qtw = a.qt ? store_width(a.qt, a.rows) : 1;
  if (vec) {
    TIERLIFT_LAUNCH(tiles, block, 0, stream, cast_tiles_kernel<kT, 8>)
    (a.x, a.rows, a.cols, a.row_stride, a.col_stride, rows_fast, fp8dev::Fp8Encoder::of(a.fmt), g,
     a.q, qw, gt, a.qt, qtw, d);
  } else {
    TIERLIFT_LAUNCH(tiles, block, 0, stream, cast_tiles_kernel<kT, 1>)
    (a.x, a.rows, a.cols, a.row_stride, a.col_stride, rows_fast, fp8dev::Fp8Encoder::of(a.fmt), g,
     a.q, qw, gt, a.qt, qtw, d);
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

// fp8_quantize: the launcher, and the fused one-kernel path for row and 1x128 scaling of a
// row-contiguous input with a single output (fp8_quant.cuh). Everything else goes to the tiled
// path (fp8_quant_tiles.cu).
//
// Both fused kernels move kW = 8 (or 4) consecutive elements per thread and step where the view
// allows: one 16-byte (8-byte) load and one 8-byte (4-byte) store of codes; element by element
// otherwise (odd widths, a misaligned base or row stride).
//  - 1x128: a block of 128 elements is 128 / kW lanes (16 lanes for kW = 8), held in registers:
//    read once, reduced with shuffles, cast.
//  - row: one 256-thread block per row. Rows up to 8192 elements stay in registers (32 per
//    thread), so the input is read once; longer rows are read a second time for the cast.
#include <cstdint>

#include "cuda/fp8_device.cuh"
#include "cuda/fp8_quant.cuh"
#include "cuda/fp8_quant_tiles.cuh"
#include "cuda/launch.cuh"

namespace tierlift {
namespace cuda {
namespace {

using fp8dev::encode_store;
using fp8dev::finite_abs;
using fp8dev::group_max;
using fp8dev::load_vec;
using fp8dev::scale_of;

constexpr int kRowThreads = 256;
constexpr int kRowRegs = 32;  // elements per thread a row kernel keeps in registers

// 1x128 blocks, 128 / kW lanes each (32 lanes of 4 strided elements for kW = 1). narrow: the
// block count fits 32-bit division (see narrow_index_limit).
template <DType kT, int kW>
__global__ void block1x128_kernel(const void* x, int64_t rows, int64_t cols, int64_t rs,
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
      if (live && j < cols)
        q[i * cols + j] = static_cast<uint8_t>(fp8dev::encode(__fmul_rn(v[k], s), fmt));
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

// Row scaling: one thread block per row, kW consecutive elements per thread and step. kInRegs:
// the row fits kRowRegs elements per thread and is read once.
template <DType kT, int kW, bool kInRegs>
__global__ void __launch_bounds__(kRowThreads)
    row_kernel(const void* x, int64_t cols, int64_t rs, Fp8Format fmt, bool pow2, uint8_t* q,
               float* scales) {
  constexpr int kChunks = kInRegs ? kRowRegs / kW : 1;
  constexpr int64_t kStep = static_cast<int64_t>(kW) * kRowThreads;
  __shared__ float partial[kRowThreads / 32];
  __shared__ float row_scale;
  const int64_t i = blockIdx.x;
  const int64_t j0 = static_cast<int64_t>(kW) * threadIdx.x;
  const void* xi = static_cast<const char*>(x) + i * rs * (kT == DType::kFloat32 ? 4 : 2);
  uint8_t* qi = q + i * cols;
  float v[kChunks][kW];
  float m = 0.f;
  if constexpr (kInRegs) {
    TIERLIFT_UNROLL
    for (int c = 0; c < kChunks; ++c) {
      const int64_t j = j0 + c * kStep;
      for (int n = 0; n < kW; ++n) v[c][n] = 0.f;
      if (j < cols) load_vec<kT, kW>(xi, j, v[c]);
      for (int n = 0; n < kW; ++n) m = fmaxf(m, finite_abs(v[c][n]));
    }
  } else {
    for (int64_t j = j0; j < cols; j += kStep) {
      load_vec<kT, kW>(xi, j, v[0]);
      for (int n = 0; n < kW; ++n) m = fmaxf(m, finite_abs(v[0][n]));
    }
  }
  m = group_max(m);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < kRowThreads / 32 ? partial[threadIdx.x] : 0.f;
    m = group_max(m);
    if (threadIdx.x == 0) {
      row_scale = scale_of(m, fmt, pow2);
      scales[i] = row_scale;
    }
  }
  __syncthreads();
  const float s = row_scale;
  if constexpr (kInRegs) {
    TIERLIFT_UNROLL
    for (int c = 0; c < kChunks; ++c) {
      const int64_t j = j0 + c * kStep;
      if (j < cols) encode_store<kW>(qi, j, v[c], s, fmt);
    }
  } else {
    for (int64_t j = j0; j < cols; j += kStep) {  // the second read mostly hits L2
      load_vec<kT, kW>(xi, j, v[0]);
      encode_store<kW>(qi, j, v[0], s, fmt);
    }
  }
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

template <DType kT, int kW>
void launch_1x128(const Fp8QuantArgs& a, int64_t nblocks, cudaStream_t stream) {
  constexpr int kLanes = kW == 1 ? 32 : 128 / kW;
  const unsigned blocks = static_cast<unsigned>((nblocks * kLanes + 255) / 256);
  const bool narrow = nblocks <= narrow_index_limit() && nblocks <= INT32_MAX;
  TIERLIFT_LAUNCH(blocks, 256, 0, stream, block1x128_kernel<kT, kW>)
  (a.x, a.rows, a.cols, a.row_stride, a.fmt, a.pow2_scale, a.q, a.scales, narrow);
}

template <DType kT, int kW>
void launch_row(const Fp8QuantArgs& a, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>(a.rows);
  if (a.cols <= static_cast<int64_t>(kRowRegs) * kRowThreads) {
    TIERLIFT_LAUNCH(blocks, kRowThreads, 0, stream, row_kernel<kT, kW, true>)
    (a.x, a.cols, a.row_stride, a.fmt, a.pow2_scale, a.q, a.scales);
  } else {
    TIERLIFT_LAUNCH(blocks, kRowThreads, 0, stream, row_kernel<kT, kW, false>)
    (a.x, a.cols, a.row_stride, a.fmt, a.pow2_scale, a.q, a.scales);
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
  const int w = fused_width(a, kT == DType::kFloat32 ? 4 : 2);
  if (a.scaling == Fp8Scaling::kBlock1x128) {
    const int64_t nblocks = a.rows * b.grid_cols;
    if (w == 8) {
      launch_1x128<kT, 8>(a, nblocks, stream);
    } else if (w == 4) {
      launch_1x128<kT, 4>(a, nblocks, stream);
    } else {
      launch_1x128<kT, 1>(a, nblocks, stream);
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

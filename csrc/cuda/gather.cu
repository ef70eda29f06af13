#include "cuda/gather.cuh"
#include "cuda/launch.cuh"

namespace tierlift {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;

template <int kUnit>
struct UnitType;
template <>
struct UnitType<16> {
  using type = uint4;
};
template <>
struct UnitType<8> {
  using type = uint2;
};
template <>
struct UnitType<4> {
  using type = uint32_t;
};
template <>
struct UnitType<2> {
  using type = uint16_t;
};
template <>
struct UnitType<1> {
  using type = uint8_t;
};

// Copies `bytes` bytes with `lanes` cooperating threads (lane in [0, lanes)). src and dst are
// congruent modulo kUnit. Bytes before the first kUnit-aligned source address and after the
// last whole unit go one byte per lane.
template <int kUnit>
__device__ __forceinline__ void copy_row(const char* __restrict__ src, char* __restrict__ dst,
                                         int64_t bytes, int lane, int lanes) {
  using T = typename UnitType<kUnit>::type;
  const uintptr_t s = reinterpret_cast<uintptr_t>(src);
  int64_t head = static_cast<int64_t>((kUnit - s % kUnit) % kUnit);
  if (head > bytes) head = bytes;
  if (lane < head) dst[lane] = src[lane];
  const char* s1 = src + head;
  char* d1 = dst + head;
  const int64_t units = (bytes - head) / kUnit;
  // Units between the 128-byte line start and s1: lanes below `skew` idle in the first round,
  // so all later rounds issue line-aligned requests.
  // (Not for 1- and 2-byte units: up to 127 idle lanes would cost more than they save.)
  const int64_t skew =
      kUnit >= 4 ? static_cast<int64_t>((reinterpret_cast<uintptr_t>(s1) % 128) / kUnit) : 0;
  const T* sv = reinterpret_cast<const T*>(s1);
  T* dv = reinterpret_cast<T*>(d1);
  for (int64_t u = lane; u < units + skew; u += lanes) {
    if (u >= skew) dv[u - skew] = sv[u - skew];
  }
  const int64_t done = head + units * kUnit;
  const int64_t tail = bytes - done;
  if (lane < tail) dst[done + lane] = src[done + lane];
}

__device__ __forceinline__ int pick_unit(const char* src, const char* dst) {
  const uintptr_t diff = reinterpret_cast<uintptr_t>(src) ^ reinterpret_cast<uintptr_t>(dst);
  if ((diff & 15) == 0) return 16;
  if ((diff & 7) == 0) return 8;
  if ((diff & 3) == 0) return 4;
  if ((diff & 1) == 0) return 2;
  return 1;
}

template <typename Idx>
__global__ void __launch_bounds__(kThreads)
    gather_kernel(GatherArgs a, const Idx* __restrict__ index, int warps_per_row) {
  const int lanes = warps_per_row * kWarp;
  const int lane = threadIdx.x % lanes;
  const int64_t groups_per_block = kThreads / lanes;
  const int64_t group = blockIdx.x * groups_per_block + threadIdx.x / lanes;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * groups_per_block;
  const char* host = static_cast<const char*>(a.table);
  const char* cache = static_cast<const char*>(a.cache_table);
  char* out = static_cast<char*>(a.out);
  for (int64_t i = group; i < a.count; i += stride) {
    const int64_t row = static_cast<int64_t>(index[i]);
    if (row < 0 || row >= a.num_rows) {
      if (lane == 0) {
        const auto pos = static_cast<unsigned long long>(i);
        if (a.first_bad != nullptr) atomicMin(a.first_bad, pos);
        if (a.bad_pair != nullptr && atomicCAS(a.bad_pair, ~0ull, pos) == ~0ull) {
          a.bad_pair[1] = static_cast<unsigned long long>(row);
        }
      }
      continue;  // never dereferenced
    }
    const char* src = host + row * a.row_bytes;
    if (a.cache_slot != nullptr) {
      const int32_t slot = a.cache_slot[row];
      if (slot >= 0 && slot < a.cache_rows) src = cache + static_cast<int64_t>(slot) * a.row_bytes;
    }
    char* dst = out + i * a.row_bytes;
    switch (pick_unit(src, dst)) {
      case 16:
        copy_row<16>(src, dst, a.row_bytes, lane, lanes);
        break;
      case 8:
        copy_row<8>(src, dst, a.row_bytes, lane, lanes);
        break;
      case 4:
        copy_row<4>(src, dst, a.row_bytes, lane, lanes);
        break;
      case 2:
        copy_row<2>(src, dst, a.row_bytes, lane, lanes);
        break;
      default:
        copy_row<1>(src, dst, a.row_bytes, lane, lanes);
    }
  }
}

// One warp per 512 bytes of row (a warp's 16-byte loads), at most a whole block per row.
int warps_for(int64_t row_bytes) {
  int w = 1;
  while (w < kThreads / kWarp && static_cast<int64_t>(w) * kWarp * 16 < row_bytes) w *= 2;
  return w;
}

}  // namespace

cudaError_t gather_rows(const GatherArgs& a, cudaStream_t stream) {
  // Zero-byte rows still run: their indices are checked like any others.
  if (a.count <= 0 || a.row_bytes < 0) return cudaSuccess;
  const int warps = warps_for(a.row_bytes);
  const int64_t groups_per_block = kThreads / (warps * kWarp);
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  // Enough resident warps to keep many PCIe requests in flight; rows loop inside the kernel.
  const int64_t needed = (a.count + groups_per_block - 1) / groups_per_block;
  const int blocks = static_cast<int>(needed < int64_t{sms} * 16 ? needed : int64_t{sms} * 16);
  if (a.index_is_int64) {
    TIERLIFT_LAUNCH(blocks, kThreads, 0, stream, gather_kernel<int64_t>)
    (a, static_cast<const int64_t*>(a.index), warps);
  } else {
    TIERLIFT_LAUNCH(blocks, kThreads, 0, stream, gather_kernel<int32_t>)
    (a, static_cast<const int32_t*>(a.index), warps);
  }
  return cudaGetLastError();
}

cudaError_t mapped_device_pointer(const void* host, void** device) {
  cudaPointerAttributes attr;
  cudaError_t err = cudaPointerGetAttributes(&attr, host);
  if (err != cudaSuccess) return err;
  if (attr.type != cudaMemoryTypeHost || attr.devicePointer == nullptr) {
    return cudaErrorInvalidHostPointer;
  }
  *device = attr.devicePointer;
  return cudaSuccess;
}

cudaError_t host_register(void* ptr, size_t bytes, bool read_only) {
  unsigned int flags = cudaHostRegisterMapped | cudaHostRegisterPortable;
  if (read_only) flags |= cudaHostRegisterReadOnly;
  return cudaHostRegister(ptr, bytes, flags);
}

cudaError_t host_unregister(void* ptr) { return cudaHostUnregister(ptr); }

}  // namespace cuda
}  // namespace tierlift

#include "cuda/gather.cuh"
#include "cuda/launch.cuh"

namespace tierlift {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr int kBatch = 8;  // rows whose loads a grouped thread issues before their stores
constexpr int64_t kGroupedMaxRowBytes = kWarp * 16;  // a warp's 16-byte units
constexpr unsigned kFullMask = 0xFFFFFFFFu;

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
// last whole unit (fewer than kUnit each) go one byte per lane: lanes >= 16.
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
  // so all later rounds issue line-aligned requests. Only where a round covers a whole line:
  // not for 1- and 2-byte units (up to 127 idle lanes would cost more than they save), nor for
  // a small group, whose rounds never make up a line anyway.
  const int64_t skew = kUnit >= 4 && lanes * kUnit >= 128
                           ? static_cast<int64_t>((reinterpret_cast<uintptr_t>(s1) % 128) / kUnit)
                           : 0;
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

// One row, any alignment, by `lanes` threads.
__device__ __forceinline__ void copy_any(const char* src, char* dst, int64_t bytes, int lane,
                                         int lanes) {
  switch (pick_unit(src, dst)) {
    case 16:
      copy_row<16>(src, dst, bytes, lane, lanes);
      break;
    case 8:
      copy_row<8>(src, dst, bytes, lane, lanes);
      break;
    case 4:
      copy_row<4>(src, dst, bytes, lane, lanes);
      break;
    case 2:
      copy_row<2>(src, dst, bytes, lane, lanes);
      break;
    default:
      copy_row<1>(src, dst, bytes, lane, lanes);
  }
}

__device__ __forceinline__ bool in_table(const GatherArgs& a, int64_t row) {
  return row >= 0 && row < a.num_rows;
}

// The output position the k-th row of the processing order fills.
__device__ __forceinline__ int64_t position_of(const GatherArgs& a, int64_t k) {
  return a.order != nullptr ? a.order[k] : k;
}

// Records bad index value `row` at output position `at`; called once per bad position.
__device__ __forceinline__ void report_bad(const GatherArgs& a, int64_t at, int64_t row) {
  const auto pos = static_cast<unsigned long long>(at);
  if (a.first_bad != nullptr) atomicMin(a.first_bad, pos);
  if (a.bad_pair != nullptr && atomicCAS(a.bad_pair, ~0ull, pos) == ~0ull) {
    a.bad_pair[1] = static_cast<unsigned long long>(row);
  }
}

// Where a (checked) row is read from: the GPU cache table when it holds the row, else the host.
__device__ __forceinline__ const char* source_row(const GatherArgs& a, int64_t row) {
  const char* src = static_cast<const char*>(a.table) + row * a.row_bytes;
  if (a.cache_slot != nullptr) {
    const int32_t slot = a.cache_slot[row];
    if (slot >= 0 && slot < a.cache_rows) {
      src = static_cast<const char*>(a.cache_table) + static_cast<int64_t>(slot) * a.row_bytes;
    }
  }
  return src;
}

// 1-8 warps per row, one row in flight per group of `warps_per_row` warps.
template <typename Idx>
__global__ void __launch_bounds__(kThreads)
    gather_kernel(GatherArgs a, const Idx* __restrict__ index, int warps_per_row) {
  const int lanes = warps_per_row * kWarp;
  const int lane = threadIdx.x % lanes;
  const int64_t groups_per_block = kThreads / lanes;
  const int64_t group = blockIdx.x * groups_per_block + threadIdx.x / lanes;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * groups_per_block;
  char* out = static_cast<char*>(a.out);
  for (int64_t k = group; k < a.count; k += stride) {
    const int64_t row = static_cast<int64_t>(index[k]);
    const int64_t i = position_of(a, k);
    if (!in_table(a, row)) {
      if (lane == 0) report_bad(a, i, row);
      continue;  // never dereferenced
    }
    copy_any(source_row(a, row), out + i * a.row_bytes, a.row_bytes, lane, lanes);
  }
}

// `lanes` (1-32, a power of two) threads per row, 32 / lanes rows per warp at once. A warp
// takes 32 consecutive entries of the order per round: lane j loads and checks entry j (one
// coalesced load), then in passes of up to kBatch rows per group, group g takes entries
// (pass row) * groups + g from the lanes that loaded them, so the groups of a warp fill
// consecutive output rows together. kAligned (host-checked): rows are whole 16-byte units on
// 16-byte-aligned bases and lanes * 16 >= row_bytes, so a lane moves at most one unit per row
// and issues the loads of a pass's rows before any store. Otherwise (16 or 32 lanes, for
// copy_row's head and tail bytes) each group copies its rows one at a time, any unit.
template <typename Idx, bool kAligned>
__global__ void __launch_bounds__(kThreads)
    gather_grouped_kernel(GatherArgs a, const Idx* __restrict__ index, int lanes) {
  const int lane = threadIdx.x % kWarp;
  const int groups = kWarp / lanes;
  const int group = lane / lanes;
  const int lane_in_row = lane % lanes;
  const int batch = lanes < kBatch ? lanes : kBatch;  // a group has `lanes` entries a round
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / kWarp);
  const int64_t unit_at = static_cast<int64_t>(lane_in_row) * 16;
  char* out = static_cast<char*>(a.out);
  // Warp-uniform loop: every lane reaches every shuffle.
  for (int64_t base = warp * kWarp; base < a.count; base += warps * kWarp) {
    const int64_t k = base + lane;
    int64_t row = -1, pos = 0;  // row -1: nothing to copy (past the end, or a bad index)
    if (k < a.count) {
      const int64_t value = static_cast<int64_t>(index[k]);
      pos = position_of(a, k);
      if (in_table(a, value)) {
        row = value;
      } else {
        report_bad(a, pos, value);
      }
    }
    if constexpr (kAligned) {
      for (int first = 0; first < lanes; first += batch) {
        uint4 v[kBatch] = {};
        char* dst[kBatch];  // null: nothing to store
        TIERLIFT_UNROLL
        for (int j = 0; j < kBatch; ++j) {
          if (j < batch) {
            const int from = (first + j) * groups + group;
            const int64_t r = __shfl_sync(kFullMask, row, from);
            const int64_t at = __shfl_sync(kFullMask, pos, from);
            dst[j] = nullptr;
            if (r >= 0 && unit_at < a.row_bytes) {
              v[j] = *reinterpret_cast<const uint4*>(source_row(a, r) + unit_at);
              dst[j] = out + at * a.row_bytes + unit_at;
            }
          }
        }
        TIERLIFT_UNROLL
        for (int j = 0; j < kBatch; ++j) {
          if (j < batch && dst[j] != nullptr) *reinterpret_cast<uint4*>(dst[j]) = v[j];
        }
      }
    } else {  // any size and alignment: one row at a time per group
      for (int e = 0; e < lanes; ++e) {
        const int from = e * groups + group;
        const int64_t r = __shfl_sync(kFullMask, row, from);
        const int64_t at = __shfl_sync(kFullMask, pos, from);
        if (r >= 0) {
          copy_any(source_row(a, r), out + at * a.row_bytes, a.row_bytes, lane_in_row, lanes);
        }
      }
    }
  }
}

// One warp per 512 bytes of row (a warp's 16-byte loads), at most a whole block per row.
int warps_for(int64_t row_bytes) {
  int w = 1;
  while (w < kThreads / kWarp && static_cast<int64_t>(w) * kWarp * 16 < row_bytes) w *= 2;
  return w;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename Idx>
void launch(const GatherArgs& a, const GatherPlan& plan, int blocks, cudaStream_t stream) {
  const auto* index = static_cast<const Idx*>(a.index);
  if (!plan.grouped) {
    TIERLIFT_LAUNCH(blocks, kThreads, 0, stream, gather_kernel<Idx>)
    (a, index, plan.lanes / kWarp);
  } else if (plan.aligned) {
    TIERLIFT_LAUNCH(blocks, kThreads, 0, stream, gather_grouped_kernel<Idx, true>)
    (a, index, plan.lanes);
  } else {
    TIERLIFT_LAUNCH(blocks, kThreads, 0, stream, gather_grouped_kernel<Idx, false>)
    (a, index, plan.lanes);
  }
}

}  // namespace

GatherPlan plan_gather(const GatherArgs& a) {
  GatherPlan plan;
  plan.grouped = a.kernel != GatherKernel::kWarpPerRow && a.row_bytes <= kGroupedMaxRowBytes;
  if (!plan.grouped) {
    plan.lanes = warps_for(a.row_bytes) * kWarp;
    return plan;
  }
  plan.aligned = a.row_bytes % 16 == 0 && aligned16(a.table) && aligned16(a.out) &&
                 (a.cache_table == nullptr || aligned16(a.cache_table));
  // Aligned: a lane per 16-byte unit. Otherwise copy_row's head and tail bytes (up to 15 each)
  // go one per lane, so at least 16 lanes.
  plan.lanes = plan.aligned ? 1 : 16;
  while (plan.lanes < kWarp && plan.lanes * int64_t{16} < a.row_bytes) plan.lanes *= 2;
  return plan;
}

cudaError_t gather_rows(const GatherArgs& a, cudaStream_t stream) {
  // Zero-byte rows still run: their indices are checked like any others.
  if (a.count <= 0 || a.row_bytes < 0) return cudaSuccess;
  const GatherPlan plan = plan_gather(a);
  // Entries a block takes per round of its loop: a row per group, or 32 per warp.
  const int64_t per_block = plan.grouped ? kThreads : kThreads / plan.lanes;
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  // Enough resident warps to keep many PCIe requests in flight; rows loop inside the kernel.
  const int64_t needed = (a.count + per_block - 1) / per_block;
  const int blocks = static_cast<int>(needed < int64_t{sms} * 16 ? needed : int64_t{sms} * 16);
  if (a.index_is_int64) {
    launch<int64_t>(a, plan, blocks, stream);
  } else {
    launch<int32_t>(a, plan, blocks, stream);
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

// CPU and CUDA implementations of the ZeRO flat-buffer ops (schemas in schemas.cpp):
//   flatten_pack_(flat, tensors): copy `tensors` back to back into the 1-D `flat` and zero the
//     tail (the padding that makes flat.numel() divisible by the world size);
//   unflatten_(flat, tensors): copy consecutive slices of `flat` back into `tensors`.
// A ZeRO unit keeps its parameters in one flat buffer so that each collective is a single
// contiguous all-gather / reduce-scatter and each rank's shard is a plain slice. The CPU copy
// splits the flat byte range (not the tensor list) across the thread pool, so one huge tensor
// and many tiny ones parallelize equally well; the CUDA path issues one device copy per tensor
// on the current stream (copies are bandwidth-bound, a custom kernel would gain nothing).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "checks.h"
#include "core/util/thread_pool.h"

namespace tierlift {
namespace {

constexpr int64_t kCopyGrainBytes = 1 << 18;  // below this, threads cost more than they save

// Validates the pair and returns each tensor's element offset in `flat` (plus the total).
std::vector<int64_t> check_flat_args(const at::Tensor& flat, at::TensorList tensors, const char* op,
                                     bool tensors_written) {
  TL_CHECK_DENSE(flat);
  TORCH_CHECK_VALUE(flat.dim() == 1, op, ": flat must be 1-D, got shape ", flat.sizes());
  TORCH_CHECK_VALUE(flat.is_contiguous(), op, ": flat must be contiguous");
  std::vector<int64_t> offsets(tensors.size() + 1, 0);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK_VALUE(t.layout() == at::kStrided, op, ": tensors[", i, "] must be dense");
    TORCH_CHECK_VALUE(t.device() == flat.device(), op, ": tensors[", i, "] is on ", t.device(),
                      " but flat is on ", flat.device());
    TORCH_CHECK_TYPE(t.scalar_type() == flat.scalar_type(), op, ": tensors[", i, "] has dtype ",
                     t.scalar_type(), " but flat has ", flat.scalar_type());
    if (tensors_written) {
      TORCH_CHECK_VALUE(t.is_contiguous(), op, ": tensors[", i,
                        "] must be contiguous (it is written in place)");
    }
    offsets[i + 1] = offsets[i] + t.numel();
  }
  TORCH_CHECK_VALUE(offsets.back() <= flat.numel(), op, ": tensors hold ", offsets.back(),
                    " elements in total but flat has only ", flat.numel());
  return offsets;
}

// Copies the byte range [begin, end) of the packed layout between flat and the tensors.
// `to_flat` picks the direction. Bytes past the last tensor are zeroed when packing.
void copy_range(char* flat, const std::vector<char*>& ptrs, const std::vector<int64_t>& byte_off,
                int64_t begin, int64_t end, bool to_flat) {
  const int64_t packed = byte_off.back();
  if (to_flat && end > packed) {
    const int64_t z = std::max(begin, packed);
    std::memset(flat + z, 0, static_cast<size_t>(end - z));
    end = std::min(end, packed);
  }
  if (begin >= end) return;
  // First tensor whose range contains `begin`.
  size_t i = static_cast<size_t>(std::upper_bound(byte_off.begin(), byte_off.end(), begin) -
                                 byte_off.begin() - 1);
  for (int64_t pos = begin; pos < end; ++i) {
    const int64_t stop = std::min(end, byte_off[i + 1]);
    if (stop > pos) {
      char* t = ptrs[i] + (pos - byte_off[i]);
      if (to_flat) {
        std::memcpy(flat + pos, t, static_cast<size_t>(stop - pos));
      } else {
        std::memcpy(t, flat + pos, static_cast<size_t>(stop - pos));
      }
    }
    pos = stop;
  }
}

void flat_copy_cpu(const at::Tensor& flat, const std::vector<at::Tensor>& tensors,
                   const std::vector<int64_t>& offsets, bool to_flat) {
  const int64_t elem = static_cast<int64_t>(flat.element_size());
  std::vector<int64_t> byte_off(offsets.size());
  for (size_t i = 0; i < offsets.size(); ++i) byte_off[i] = offsets[i] * elem;
  std::vector<char*> ptrs(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    ptrs[i] = static_cast<char*>(tensors[i].data_ptr());
  }
  char* base = static_cast<char*>(flat.data_ptr());
  const int64_t total = to_flat ? flat.numel() * elem : byte_off.back();
  ThreadPool::global().parallel_for(total, kCopyGrainBytes, [&](int64_t b, int64_t e) {
    copy_range(base, ptrs, byte_off, b, e, to_flat);
  });
}

void flatten_pack_cpu(const at::Tensor& flat, at::TensorList tensors) {
  TL_CHECK_CPU(flat);
  const auto offsets = check_flat_args(flat, tensors, "flatten_pack_", false);
  std::vector<at::Tensor> srcs;
  srcs.reserve(tensors.size());
  for (const auto& t : tensors) srcs.push_back(t.contiguous());
  flat_copy_cpu(flat, srcs, offsets, true);
}

void unflatten_cpu(const at::Tensor& flat, at::TensorList tensors) {
  TL_CHECK_CPU(flat);
  const auto offsets = check_flat_args(flat, tensors, "unflatten_", true);
  flat_copy_cpu(flat, tensors.vec(), offsets, false);
}

#ifdef TIERLIFT_WITH_CUDA
void flatten_pack_cuda(const at::Tensor& flat, at::TensorList tensors) {
  TORCH_CHECK_VALUE(flat.is_cuda(), "flatten_pack_: flat must be a CUDA tensor");
  const auto offsets = check_flat_args(flat, tensors, "flatten_pack_", false);
  for (size_t i = 0; i < tensors.size(); ++i) {
    flat.narrow(0, offsets[i], tensors[i].numel()).copy_(tensors[i].reshape({-1}));
  }
  const int64_t tail = flat.numel() - offsets.back();
  if (tail > 0) flat.narrow(0, offsets.back(), tail).zero_();
}

void unflatten_cuda(const at::Tensor& flat, at::TensorList tensors) {
  TORCH_CHECK_VALUE(flat.is_cuda(), "unflatten_: flat must be a CUDA tensor");
  const auto offsets = check_flat_args(flat, tensors, "unflatten_", true);
  for (size_t i = 0; i < tensors.size(); ++i) {
    at::Tensor dst = tensors[i];
    dst.view({-1}).copy_(flat.narrow(0, offsets[i], dst.numel()));
  }
}
#endif

}  // namespace

TORCH_LIBRARY_IMPL(tierlift, CPU, m) {
  m.impl("flatten_pack_", &flatten_pack_cpu);
  m.impl("unflatten_", &unflatten_cpu);
}

#ifdef TIERLIFT_WITH_CUDA
TORCH_LIBRARY_IMPL(tierlift, CUDA, m) {
  m.impl("flatten_pack_", &flatten_pack_cuda);
  m.impl("unflatten_", &unflatten_cuda);
}
#endif

}  // namespace tierlift

// What the fp32-state and compact-state Adam ops (optim_ops.cpp, optim_compact_ops.cpp) share at
// the binding layer: the hyperparameters from the op's arguments, the checks every state tensor
// makes against its param, and, on CUDA, the grouping of tensors into multi-tensor launches.
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "core/optim/adam.h"
#include "core/util/dtype.h"

#ifdef TIERLIFT_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <map>
#include <utility>
#include <vector>
#endif

namespace tierlift {

inline AdamHyper adam_hyper(double lr, double beta1, double beta2, double eps, double weight_decay,
                            int64_t step, bool decoupled, bool amsgrad, bool maximize) {
  AdamHyper h;
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  h.weight_decay = weight_decay;
  h.step = step;
  h.decoupled = decoupled;
  h.amsgrad = amsgrad;
  h.maximize = maximize;
  return h;
}

// `name`[i] of `op` is dense and on the device of p (params[i]).
inline void check_dense_beside(const char* op, const at::Tensor& t, const char* name, size_t i,
                               const at::Tensor& p) {
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, op, ": ", name, "[", i,
                    "] must be dense (sparse gradients are not supported)");
  TORCH_CHECK_VALUE(t.device() == p.device(), op, ": ", name, "[", i, "] is on ", t.device(),
                    ", params[", i, "] on ", p.device());
}

// GradScaler's scale (the ops' grad_scale argument), when given: a 1-element float32 tensor on
// the params' device (on CUDA the kernel reads it there, without a host sync). On CPU the value
// itself is checked here; on CUDA, reading it would cost a sync, so the caller checks it.
inline void check_grad_scale(const char* op, const c10::optional<at::Tensor>& grad_scale,
                             at::TensorList params, c10::DeviceType backend) {
  if (!grad_scale.has_value()) return;
  const at::Tensor& s = *grad_scale;
  TORCH_CHECK_TYPE(s.scalar_type() == at::kFloat, op, ": grad_scale must be float32, got ",
                   s.scalar_type());
  TORCH_CHECK_VALUE(s.numel() == 1 && s.layout() == at::kStrided, op,
                    ": grad_scale must be a dense 1-element tensor, got ", s.numel(), " elements");
  if (!params.empty()) {
    TORCH_CHECK_VALUE(s.device() == params[0].device(), op, ": grad_scale is on ", s.device(),
                      " but params[0] is on ", params[0].device(),
                      "; put the scale on the params' device");
  } else {
    TORCH_CHECK_VALUE(s.device().type() == backend, op, ": grad_scale is on ", s.device(),
                      " but this call runs on ", backend);
  }
  if (backend == c10::DeviceType::CPU) {
    const float v = *s.data_ptr<float>();
    TORCH_CHECK_VALUE(grad_scale_usable(v), op, ": grad_scale must be finite and > 0, got ", v);
  }
}

// The CPU kernels take the scale by value.
inline void set_grad_scale(AdamHyper& h, const c10::optional<at::Tensor>& grad_scale) {
  if (!grad_scale.has_value()) return;
  h.unscale = true;
  h.grad_scale = *grad_scale->data_ptr<float>();
}

// The CUDA kernels read the scale from device memory: null when not given.
inline const float* grad_scale_ptr(const c10::optional<at::Tensor>& grad_scale) {
  return grad_scale.has_value() ? grad_scale->data_ptr<float>() : nullptr;
}

inline void check_contiguous(const char* op, const at::Tensor& t, const char* name, size_t i) {
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, "[", i, "] must be contiguous");
}

// refresh_from_copies reads the copies, so it needs them.
inline void check_refresh(const char* op, bool refresh_from_copies, at::TensorList param_copies) {
  TORCH_CHECK_VALUE(!refresh_from_copies || !param_copies.empty(), op,
                    ": refresh_from_copies=True needs param_copies (one per param)");
}

// An out-of-place source list (the ops' *_from arguments): absent, or one tensor per param, each
// like the state tensor it is read in place of (dense, same device, dtype and numel, contiguous),
// and either that tensor's memory itself or memory apart from it: the kernel's threads read one
// range while they write another, so a partial overlap would race.
using SourceList = c10::optional<at::TensorList>;

inline void check_sources(const char* op, const SourceList& from, at::TensorList state,
                          const char* name) {
  if (!from.has_value()) return;
  TORCH_CHECK_VALUE(from->size() == state.size(), op, ": ", name,
                    " must be None or hold one tensor per param, got ", from->size(), " for ",
                    state.size());
  for (size_t i = 0; i < state.size(); ++i) {
    const at::Tensor& f = (*from)[i];
    const at::Tensor& t = state[i];
    check_dense_beside(op, f, name, i, t);
    TORCH_CHECK_TYPE(f.scalar_type() == t.scalar_type(), op, ": ", name, "[", i, "] must be ",
                     t.scalar_type(), " like the tensor it is read in place of, got ",
                     f.scalar_type());
    TORCH_CHECK_VALUE(f.numel() == t.numel(), op, ": ", name, "[", i, "] has ", f.numel(),
                      " elements, the tensor it is read in place of ", t.numel());
    TORCH_CHECK_VALUE(f.is_contiguous(), op, ": ", name, "[", i, "] must be contiguous");
    if (f.numel() == 0) continue;
    const at::MemOverlapStatus overlap = at::get_overlap_status(f, t);
    TORCH_CHECK_VALUE(
        overlap == at::MemOverlapStatus::Full || overlap == at::MemOverlapStatus::No, op, ": ",
        name, "[", i,
        "] partly overlaps the tensor it is read in place of; pass that tensor itself or "
        "memory apart from it");
  }
}

// Out-of-place sources exist only on the CPU (the offloaded step's host tiers).
inline void check_no_sources(const char* op, std::initializer_list<const SourceList*> lists) {
  for (const SourceList* from : lists) {
    TORCH_CHECK_VALUE(!from->has_value(), op,
                      ": the *_from arguments (out-of-place steps) are supported on the CPU only");
  }
}

template <typename T>
inline const T* source_ptr(const SourceList& from, size_t i) {
  return from.has_value() ? static_cast<const T*>((*from)[i].data_ptr()) : nullptr;
}

#ifdef TIERLIFT_WITH_CUDA
// The CUDA side of an Adam op once its tensors are checked: every param on one device, then one
// multi-tensor launch sequence per (grad dtype, copy dtype) group, on the current stream.
// ptrs_of(i) returns {{grad dtype, copy dtype}, kernel descriptor of tensor i};
// launch(ptrs, count, grad_type, copy_type, stream) launches one group and returns its error.
template <typename Ptrs, typename PtrsOf, typename Launch>
void launch_grouped(const char* op, at::TensorList params, PtrsOf&& ptrs_of, Launch&& launch) {
  if (params.empty()) return;
  const at::Device device = params[0].device();
  for (size_t i = 1; i < params.size(); ++i) {
    TORCH_CHECK_VALUE(params[i].device() == device, op, ": params[", i, "] is on ",
                      params[i].device(), " but params[0] is on ", device);
  }
  c10::cuda::CUDAGuard guard(device);
  std::map<std::pair<DType, DType>, std::vector<Ptrs>> groups;
  for (size_t i = 0; i < params.size(); ++i) {
    std::pair<std::pair<DType, DType>, Ptrs> typed = ptrs_of(i);
    groups[typed.first].push_back(typed.second);
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(device.index());
  for (auto& [types, ptrs] : groups) {
    const cudaError_t err =
        launch(ptrs.data(), static_cast<int>(ptrs.size()), types.first, types.second, stream);
    TORCH_CHECK(err == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(err));
  }
}
#endif

}  // namespace tierlift

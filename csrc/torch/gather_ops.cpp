// CPU and CUDA implementations of tierlift::gather_rows (schema in schemas.cpp), and the
// HostRegistration class that page-locks and maps a feature table for the zero-copy CUDA path.
//
// gather_rows(table, index, cache_table, cache_slots, out): out[i] = table[index[i]]. On CPU all
// tensors are CPU tensors and core/gather copies the rows. On CUDA, `table` is a CPU tensor in
// pinned, mapped memory (or a CUDA tensor), index/out/cache live on the GPU, and the kernel reads
// the host rows directly. Either way a bad index raises IndexError naming its position and value,
// and is never dereferenced.
//
// locality="sorted": on CUDA the op sorts the index on the device (at::sort, stream-ordered) and
// the kernel reads the rows in that order, writing each to its own position; "index" (the
// default) reads them as given. kernel: "auto", "warp" or "grouped" (cuda/gather.cuh). Both are
// validated on every backend; the CPU gather's result does not depend on them and ignores them.
//
// bad_index (optional, int64 [2], initialised to -1): the deferred check. The op then neither
// raises nor, on CUDA, synchronises: the (position, value) of a bad index is stored there unless
// slot 0 already holds one, and the caller raises later. On CUDA it lives on out's device (the
// kernel's atomics stay in device memory; FeatureStore mirrors it into pinned host memory with a
// non-blocking copy, so the host can look at it without a synchronisation).
#include <ATen/ATen.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <string>
#include <utility>

#include "checks.h"
#include "core/gather/gather.h"

#ifdef TIERLIFT_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/gather.cuh"
#endif

namespace tierlift {
namespace {

// Checks shared by both backends: shapes, dtypes, layout. Returns bytes per row.
int64_t check_gather_args(const at::Tensor& table, const at::Tensor& index, const at::Tensor& out) {
  TL_CHECK_DENSE(table);
  TL_CHECK_DENSE(index);
  TL_CHECK_DENSE(out);
  TORCH_CHECK_VALUE(table.dim() >= 1, "gather_rows: table must have at least one dimension");
  TL_CHECK_CONTIGUOUS(table);
  TORCH_CHECK_TYPE(index.scalar_type() == at::kLong || index.scalar_type() == at::kInt,
                   "gather_rows: index must be int64 or int32, got ", index.scalar_type());
  TORCH_CHECK_VALUE(index.dim() == 1, "gather_rows: index must be 1-D, got shape ", index.sizes());
  TORCH_CHECK_VALUE(out.scalar_type() == table.scalar_type(), "gather_rows: out must be ",
                    table.scalar_type(), " like table, got ", out.scalar_type());
  std::vector<int64_t> shape(table.sizes().begin(), table.sizes().end());
  shape[0] = index.numel();
  TORCH_CHECK_VALUE(out.sizes() == at::IntArrayRef(shape), "gather_rows: out must have shape ",
                    at::IntArrayRef(shape), ", got ", out.sizes());
  TL_CHECK_CONTIGUOUS(out);
  const int64_t rows = table.size(0);
  return rows == 0 ? 0 : static_cast<int64_t>(table.nbytes()) / rows;
}

// Whether two tensors' byte spans intersect (conservative for strided views), by address:
// two storages over one buffer (from_blob, from_numpy twice) alias as well as one shared.
bool shares_memory(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || a.device() != b.device()) return false;
  auto span = [](const at::Tensor& t) {
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    const auto start = reinterpret_cast<uintptr_t>(t.data_ptr());
    return std::make_pair(start, start + static_cast<uintptr_t>((last + 1) * t.element_size()));
  };
  const auto [a0, a1] = span(a);
  const auto [b0, b1] = span(b);
  return a0 < b1 && b0 < a1;
}

// The op writes out (and bad_index): neither may share memory with what it reads, or rows would
// be read after being overwritten. Checked on every backend before anything is written.
void check_no_overlap(const at::Tensor& table, const at::Tensor& index,
                      const std::optional<at::Tensor>& cache_table,
                      const std::optional<at::Tensor>& cache_slots, const at::Tensor& out,
                      const std::optional<at::Tensor>& bad_index) {
  const std::pair<const char*, const at::Tensor*> read[] = {
      {"table", &table},
      {"index", &index},
      {"cache_table", cache_table.has_value() ? &*cache_table : nullptr},
      {"cache_slots", cache_slots.has_value() ? &*cache_slots : nullptr}};
  for (const auto& [name, t] : read) {
    if (t == nullptr) continue;
    TORCH_CHECK_VALUE(!shares_memory(out, *t), "gather_rows: out shares memory with ", name,
                      ", so rows would be read after being overwritten; gather into a separate "
                      "tensor");
    TORCH_CHECK_VALUE(!bad_index.has_value() || !shares_memory(*bad_index, *t),
                      "gather_rows: bad_index shares memory with ", name,
                      "; pass a separate int64 tensor of two -1s");
  }
  TORCH_CHECK_VALUE(!bad_index.has_value() || !shares_memory(*bad_index, out),
                    "gather_rows: bad_index shares memory with out; pass a separate int64 tensor "
                    "of two -1s");
}

[[noreturn]] void throw_bad_index(int64_t pos, int64_t value, int64_t rows) {
  TORCH_CHECK_INDEX(false, "gather_rows: index[", pos, "] = ", value,
                    " is out of range for a table of ", rows, " rows");
  std::abort();  // unreachable
}

// Validates the deferred-check pair; returns it.
const at::Tensor& check_bad_index(const at::Tensor& bad) {
  TL_CHECK_DENSE(bad);
  TL_CHECK_CONTIGUOUS(bad);
  TORCH_CHECK_TYPE(bad.scalar_type() == at::kLong, "gather_rows: bad_index must be int64, got ",
                   bad.scalar_type());
  TORCH_CHECK_VALUE(bad.dim() == 1 && bad.numel() == 2,
                    "gather_rows: bad_index must have shape (2,), got ", bad.sizes());
  return bad;
}

bool sorted_locality(const std::string& locality) {
  TORCH_CHECK_VALUE(locality == "index" || locality == "sorted",
                    "gather_rows: locality must be 'index' or 'sorted', got '", locality, "'");
  return locality == "sorted";
}

void check_kernel_name(const std::string& kernel) {
  TORCH_CHECK_VALUE(kernel == "auto" || kernel == "warp" || kernel == "grouped",
                    "gather_rows: kernel must be 'auto', 'warp' or 'grouped', got '", kernel, "'");
}

GatherIndex core_index(const at::Tensor& index, const at::Tensor& contiguous) {
  return {contiguous.data_ptr(),
          index.scalar_type() == at::kInt ? IndexType::kInt32 : IndexType::kInt64,
          contiguous.numel()};
}

void gather_rows_cpu(const at::Tensor& table, const at::Tensor& index,
                     const std::optional<at::Tensor>& cache_table,
                     const std::optional<at::Tensor>& cache_slots, const at::Tensor& out,
                     const std::optional<at::Tensor>& bad_index, c10::string_view locality,
                     c10::string_view kernel) {
  sorted_locality(std::string(locality));  // checked; one CPU gather whatever the order
  check_kernel_name(std::string(kernel));
  const int64_t row_bytes = check_gather_args(table, index, out);
  TL_CHECK_CPU(table);
  TL_CHECK_CPU(index);
  TL_CHECK_CPU(out);
  TORCH_CHECK_VALUE(!cache_table.has_value() && !cache_slots.has_value(),
                    "gather_rows: cache_table/cache_slots are only used by the CUDA gather");
  check_no_overlap(table, index, cache_table, cache_slots, out, bad_index);
  const at::Tensor idx = index.contiguous();
  const GatherIndex gi = core_index(index, idx);
  if (bad_index.has_value()) TL_CHECK_CPU(check_bad_index(*bad_index));
  const int64_t bad = gather_rows({table.data_ptr(), table.size(0), row_bytes}, gi, out.data_ptr());
  if (bad == kNoBadIndex) return;
  if (!bad_index.has_value()) throw_bad_index(bad, index_value(gi, bad), table.size(0));
  int64_t* pair = bad_index->data_ptr<int64_t>();
  if (pair[0] == -1) {
    pair[0] = bad;
    pair[1] = index_value(gi, bad);
  }
}

#ifdef TIERLIFT_WITH_CUDA
void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "gather_rows: ", what, " failed: ", cudaGetErrorString(err));
}

// Device pointer of pinned, mapped host memory; ValueError `message` otherwise.
void* mapped_or_throw(const void* host, const char* message) {
  void* dev = nullptr;
  const cudaError_t err = cuda::mapped_device_pointer(host, &dev);
  if (err != cudaSuccess) cudaGetLastError();  // clear the sticky-free error state
  TORCH_CHECK_VALUE(err == cudaSuccess, message);
  return dev;
}

void gather_rows_cuda(const at::Tensor& table, const at::Tensor& index,
                      const std::optional<at::Tensor>& cache_table,
                      const std::optional<at::Tensor>& cache_slots, const at::Tensor& out,
                      const std::optional<at::Tensor>& bad_index, c10::string_view locality,
                      c10::string_view kernel) {
  const bool sorted = sorted_locality(std::string(locality));
  check_kernel_name(std::string(kernel));
  const cuda::GatherKernel shape = kernel == "warp"      ? cuda::GatherKernel::kWarpPerRow
                                   : kernel == "grouped" ? cuda::GatherKernel::kGrouped
                                                         : cuda::GatherKernel::kAuto;
  const int64_t row_bytes = check_gather_args(table, index, out);
  TORCH_CHECK_VALUE(out.is_cuda(), "gather_rows: out must be a CUDA tensor, got ", out.device());
  const at::Device device = out.device();
  TL_CHECK_DEVICE(index, device);
  c10::cuda::CUDAGuard guard(device);
  cuda::GatherArgs a;
  if (table.is_cuda()) {
    TL_CHECK_DEVICE(table, device);
    a.table = table.data_ptr();
  } else {
    a.table = mapped_or_throw(table.data_ptr(),
                              "gather_rows: a CPU table must be in pinned, mapped host memory "
                              "(FeatureStore registers it; or use tensor.pin_memory()), got "
                              "pageable memory");
  }
  if (bad_index.has_value()) {
    const at::Tensor& bad = check_bad_index(*bad_index);
    TL_CHECK_DEVICE(bad, device);
    a.bad_pair = reinterpret_cast<unsigned long long*>(bad.data_ptr<int64_t>());
  }
  TORCH_CHECK_VALUE(cache_table.has_value() == cache_slots.has_value(),
                    "gather_rows: pass both cache_table and cache_slots, or neither");
  if (cache_table.has_value()) {
    const at::Tensor& ct = *cache_table;
    const at::Tensor& cs = *cache_slots;
    TL_CHECK_DEVICE(ct, device);
    TL_CHECK_DEVICE(cs, device);
    TL_CHECK_CONTIGUOUS(ct);
    TL_CHECK_CONTIGUOUS(cs);
    TL_CHECK_DTYPE(cs, at::kInt);
    TORCH_CHECK_VALUE(ct.scalar_type() == table.scalar_type() && ct.dim() == table.dim() &&
                          ct.sizes().slice(1) == table.sizes().slice(1),
                      "gather_rows: cache_table must hold rows like table's, got ", ct.sizes(), " ",
                      ct.scalar_type());
    TORCH_CHECK_VALUE(cs.dim() == 1 && cs.numel() == table.size(0),
                      "gather_rows: cache_slots must have one entry per table row (", table.size(0),
                      "), got shape ", cs.sizes());
    a.cache_table = ct.data_ptr();
    a.cache_slot = cs.data_ptr<int32_t>();
    a.cache_rows = ct.size(0);
  }
  check_no_overlap(table, index, cache_table, cache_slots, out, bad_index);
  if (index.numel() == 0) return;  // zero-byte rows still go: their indices are checked
  const at::Tensor idx = index.contiguous();
  a.num_rows = table.size(0);
  a.row_bytes = row_bytes;
  a.kernel = shape;
  a.index = idx.data_ptr();
  at::Tensor sorted_index, order;  // live until the kernel is queued (stream-ordered frees)
  if (sorted) {
    std::tie(sorted_index, order) = at::sort(idx);
    a.index = sorted_index.data_ptr();
    a.order = order.data_ptr<int64_t>();
  }
  a.index_is_int64 = index.scalar_type() == at::kLong;
  a.count = idx.numel();
  a.out = out.data_ptr();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(device.index());
  if (a.bad_pair != nullptr) {  // deferred check: the caller reads the pair later
    check_cuda(cuda::gather_rows(a, stream), "kernel launch");
    return;
  }
  at::Tensor first_bad = at::full({1}, -1, index.options().dtype(at::kLong));
  a.first_bad = reinterpret_cast<unsigned long long*>(first_bad.data_ptr<int64_t>());
  check_cuda(cuda::gather_rows(a, stream), "kernel launch");
  // The one synchronisation: an out-of-range index must surface as an exception here.
  const int64_t bad = first_bad.item<int64_t>();
  if (bad != -1) throw_bad_index(bad, idx[bad].item<int64_t>(), table.size(0));
}
#endif

// Owns a cudaHostRegister of a tensor's memory; the caller keeps the tensor alive. Its errors
// name `owner` (the caller: a FeatureStore, the optimizer's pinned state, ...) and end with
// `remedy` when the caller has one, so they read right wherever they surface.
class HostRegistration {
 public:
  HostRegistration(const at::Tensor& tensor, bool read_only, const std::string& owner,
                   const std::string& remedy) {
#ifdef TIERLIFT_WITH_CUDA
    TL_CHECK_CPU(tensor);
    TL_CHECK_CONTIGUOUS(tensor);
    TORCH_CHECK_VALUE(tensor.nbytes() > 0, owner, ": tensor is empty");
    const std::string then = remedy.empty() ? "" : "; " + remedy;
    ptr_ = tensor.data_ptr();
    const cudaError_t err = cuda::host_register(ptr_, tensor.nbytes(), read_only);
    if (err != cudaSuccess) {
      cudaGetLastError();
      ptr_ = nullptr;
      TORCH_CHECK_VALUE(err != cudaErrorHostMemoryAlreadyRegistered, owner,
                        ": this memory is already registered with CUDA (by another "
                        "HostRegistration or a cudaHostRegister call)",
                        then);
      TORCH_CHECK_VALUE(false, owner, ": cudaHostRegister of ", tensor.nbytes(), " bytes failed (",
                        cudaGetErrorString(err),
                        "); the memory may be too large to lock in RAM (ulimit -l) or of a kind "
                        "CUDA cannot pin",
                        then);
    }
#else
    (void)tensor;
    (void)read_only;
    (void)remedy;
    TORCH_CHECK(false, owner, ": tierlift was built without CUDA kernels");
#endif
  }
  ~HostRegistration() { close(); }
  void close() {
#ifdef TIERLIFT_WITH_CUDA
    if (ptr_ != nullptr) {
      cuda::host_unregister(ptr_);
      cudaGetLastError();
      ptr_ = nullptr;
    }
#endif
  }
  bool active() const { return ptr_ != nullptr; }

 private:
  void* ptr_ = nullptr;
};

}  // namespace

void bind_gather(pybind11::module_& m) {
  pybind11::class_<HostRegistration>(
      m, "HostRegistration",
      "cudaHostRegister(tensor memory, mapped) until close(); keep the tensor alive meanwhile. "
      "Errors name `owner` and end with `remedy` (what the caller offers instead).")
      .def(pybind11::init<const at::Tensor&, bool, const std::string&, const std::string&>(),
           pybind11::arg("tensor"), pybind11::arg("read_only") = false,
           pybind11::arg("owner") = "HostRegistration", pybind11::arg("remedy") = "")
      .def("close", &HostRegistration::close)
      .def_property_readonly("active", &HostRegistration::active);
}

TORCH_LIBRARY_IMPL(tierlift, CPU, m) { m.impl("gather_rows", &gather_rows_cpu); }

#ifdef TIERLIFT_WITH_CUDA
TORCH_LIBRARY_IMPL(tierlift, CUDA, m) { m.impl("gather_rows", &gather_rows_cuda); }
#endif

}  // namespace tierlift

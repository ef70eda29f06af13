// pybind11 classes of the NVMe engine (tierlift._C.io): Engine, Request, the crc32c helper and
// the in-memory content fingerprint.
// Tensors are checked here (CPU, contiguous, dense), the GIL is released while waiting, and
// engine errors become Python exceptions: OSError(errno, message, path) for I/O failures,
// EOFError for a read past the end of a file, ValueError/RuntimeError for bad use.
#include <Python.h>
#include <torch/extension.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "checks.h"
#include "core/io/crc32c.h"
#include "core/io/engine.h"
#include "core/util/fingerprint.h"

#ifdef TIERLIFT_WITH_CUDA
#include <cuda_runtime_api.h>

#include "cuda/fingerprint.cuh"
#endif

namespace py = pybind11;

namespace tierlift {
namespace {

using io::Engine;
using io::IoRequest;
using io::IoStatus;

void set_status_error(const IoStatus& s, const char* op) {
  const std::string msg = s.message(op);
  if (s.err == io::kErrEof) {
    PyErr_SetString(PyExc_EOFError, msg.c_str());
  } else {
    py::object exc = py::module_::import("builtins").attr("OSError")(s.err, msg, s.path);
    PyErr_SetObject(PyExc_OSError, exc.ptr());
  }
}

[[noreturn]] void raise_status(const IoStatus& s, const char* op) {
  set_status_error(s, op);
  throw py::error_already_set();
}

void emit_warnings(Engine& e) {
  for (const auto& w : e.take_warnings()) {
    if (PyErr_WarnEx(PyExc_RuntimeWarning, w.c_str(), 2) != 0) throw py::error_already_set();
  }
}

std::pair<void*, size_t> checked_bytes(const at::Tensor& tensor) {
  TL_CHECK_CPU(tensor);
  TL_CHECK_DENSE(tensor);
  TL_CHECK_CONTIGUOUS(tensor);
  return {tensor.data_ptr(), tensor.numel() * tensor.element_size()};
}

std::vector<uint32_t> block_crc32c(const at::Tensor& tensor, int64_t block_bytes) {
  auto [ptr, n] = checked_bytes(tensor);
  TORCH_CHECK_VALUE(block_bytes > 0, "block_bytes must be > 0, got ", block_bytes);
  std::vector<uint32_t> out;
  py::gil_scoped_release nogil;
  const auto* p = static_cast<const unsigned char*>(ptr);
  for (size_t off = 0; off < n; off += static_cast<size_t>(block_bytes)) {
    const size_t len = std::min(n - off, static_cast<size_t>(block_bytes));
    out.push_back(io::crc32c(0, p + off, len));
  }
  return out;
}

std::vector<uint64_t> fingerprints(const std::vector<at::Tensor>& tensors, int64_t threads) {
  std::vector<ByteRange> ranges;
  ranges.reserve(tensors.size());
  for (const auto& t : tensors) {
    auto [ptr, n] = checked_bytes(t);
    ranges.push_back({ptr, n});
  }
  py::gil_scoped_release nogil;
  return fingerprint64_many(ranges, static_cast<int>(threads));
}

#ifdef TIERLIFT_WITH_CUDA
// fingerprints of device memory on the device: table is int64 [count, 2] (data pointer, bytes)
// on the device where those bytes are, out int64 [count] there (the uint64 values' bits). Only
// queues the kernel on `stream` (the caller reads `out` back, in stream order).
void fingerprints_device(const at::Tensor& table, const at::Tensor& out, int64_t stream) {
  static_assert(sizeof(cuda::FingerprintRange) == 2 * sizeof(int64_t), "table rows are 2 int64");
  TORCH_CHECK_VALUE(table.is_cuda() && out.is_cuda() && table.device() == out.device(),
                    "fingerprints_device: table and out must be on one CUDA device");
  TL_CHECK_DTYPE(table, at::kLong);
  TL_CHECK_DTYPE(out, at::kLong);
  TL_CHECK_CONTIGUOUS(table);
  TL_CHECK_CONTIGUOUS(out);
  TORCH_CHECK_VALUE(
      table.dim() == 2 && table.size(1) == 2 && out.dim() == 1 && out.size(0) == table.size(0),
      "fingerprints_device: table must be [count, 2] and out [count], got ", table.sizes(), " and ",
      out.sizes());
  int current = -1;
  TORCH_CHECK(cudaGetDevice(&current) == cudaSuccess && current == table.device().index(),
              "fingerprints_device: the current CUDA device (", current, ") is not the tensors' (",
              table.device().index(), ")");
  const cudaError_t err = cuda::fingerprint_ranges(
      static_cast<const cuda::FingerprintRange*>(table.data_ptr()), table.size(0),
      static_cast<uint64_t*>(out.data_ptr()), reinterpret_cast<cudaStream_t>(stream));
  TORCH_CHECK(err == cudaSuccess, "fingerprints_device: ", cudaGetErrorString(err));
}
#endif

// The exponent field of a float dtype: all of its bits set is an Inf or a NaN.
std::pair<int, uint32_t> float_exponent(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return {4, 0x7F800000u};
    case at::kBFloat16:
      return {2, 0x7F80u};
    case at::kHalf:
      return {2, 0x7C00u};
    default:
      break;
  }
  TORCH_CHECK_TYPE(false, "fingerprints_finite: tensors must be float32, bfloat16 or float16, got ",
                   t.scalar_type());
}

std::pair<std::vector<uint64_t>, std::vector<bool>> fingerprints_finite(
    const std::vector<at::Tensor>& tensors, int64_t threads) {
  std::vector<FloatRange> ranges;
  ranges.reserve(tensors.size());
  for (const auto& t : tensors) {
    auto [ptr, n] = checked_bytes(t);
    auto [width, mask] = float_exponent(t);
    ranges.push_back({ptr, n, width, mask});
  }
  std::vector<FiniteFingerprint> got;
  {
    py::gil_scoped_release nogil;
    got = fingerprint64_finite_many(ranges, static_cast<int>(threads));
  }
  std::pair<std::vector<uint64_t>, std::vector<bool>> out;
  for (const auto& g : got) {
    out.first.push_back(g.value);
    out.second.push_back(g.finite);
  }
  return out;
}

using CopyItem = std::tuple<at::Tensor, at::Tensor, std::optional<uint64_t>>;

std::vector<std::optional<std::vector<uint64_t>>> copy_checked(
    const std::vector<std::vector<CopyItem>>& groups, int64_t threads) {
  std::vector<std::vector<CheckedCopy>> todo(groups.size());
  for (size_t i = 0; i < groups.size(); ++i) {
    for (const auto& [dst, src, want] : groups[i]) {
      auto [d, dn] = checked_bytes(dst);
      auto [s, sn] = checked_bytes(src);
      TORCH_CHECK_VALUE(dn == sn, "copy_checked: dst has ", dn, " bytes but src has ", sn);
      const auto* dc = static_cast<const char*>(d);
      const auto* sc = static_cast<const char*>(s);
      TORCH_CHECK_VALUE(dn == 0 || dc + dn <= sc || sc + sn <= dc,
                        "copy_checked: dst and src overlap");
      todo[i].push_back({d, s, dn, want.has_value(), want.value_or(0)});
    }
  }
  std::vector<CheckedCopyResult> got;
  {
    py::gil_scoped_release nogil;
    got = fingerprint64_copy_checked(todo, static_cast<int>(threads));
  }
  std::vector<std::optional<std::vector<uint64_t>>> out;
  out.reserve(got.size());
  for (auto& g : got) {
    if (g.copied) {
      out.emplace_back(std::move(g.values));
    } else {
      out.emplace_back(std::nullopt);
    }
  }
  return out;
}

// An engine whose pool is page-locked with cudaHostRegister when `pin` is set and CUDA works, so
// H2D/D2H copies from pool tensors are asynchronous. A refused registration leaves the pool
// pageable (correct, slower); `error` keeps CUDA's reason for the Python engine to report. The
// deleter closes the engine (no I/O in flight) and unpins the arena before it is freed.
struct PinState {
  bool pinned = false;
  std::string error;  // why pinning was refused; empty when pinned or not asked for
};

struct UnpinAndDelete {
  std::shared_ptr<PinState> state;
  void operator()(Engine* p) const {
    p->close();
#ifdef TIERLIFT_WITH_CUDA
    if (state->pinned) cudaHostUnregister(p->pool().arena());
#endif
    delete p;
  }
};

std::shared_ptr<Engine> make_engine(const io::EngineOptions& o, bool pin) {
  auto state = std::make_shared<PinState>();
  auto* e = new Engine(o);
#ifdef TIERLIFT_WITH_CUDA
  if (pin) {
    const cudaError_t err =
        cudaHostRegister(e->pool().arena(), e->pool().budget(), cudaHostRegisterDefault);
    state->pinned = err == cudaSuccess;
    if (!state->pinned) {
      cudaGetLastError();  // clear the sticky error; the pool stays pageable
      state->error = std::string("cudaHostRegister of ") + std::to_string(e->pool().budget()) +
                     " bytes failed: " + cudaGetErrorString(err);
    }
  }
#else
  if (pin) state->error = "tierlift was built without CUDA kernels";
#endif
  return std::shared_ptr<Engine>(e, UnpinAndDelete{state});
}

const PinState& pin_state(const std::shared_ptr<Engine>& e) {
  return *std::get_deleter<UnpinAndDelete>(e)->state;
}

}  // namespace

void bind_io(py::module_& m) {
  py::module_ io = m.def_submodule("io", "NVMe engine (io_uring or pread/pwrite threads)");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const io::IoError& e) {
      const std::string what = e.what();
      const std::string op = what.substr(0, what.find(" of '"));
      set_status_error(IoStatus{e.err(), e.path(), e.offset()}, op.c_str());
    }
  });

  py::class_<IoRequest, std::shared_ptr<IoRequest>>(io, "Request")
      .def("done", &IoRequest::done, "True once every block of the request has finished.")
      .def(
          "wait",
          [](IoRequest& r) {
            IoStatus st;
            {
              py::gil_scoped_release nogil;
              st = r.wait();
            }
            if (!st.ok()) raise_status(st, r.is_write() ? "write" : "read");
          },
          "Blocks (without the GIL) until the request finishes; raises its error.");

  py::class_<Engine, std::shared_ptr<Engine>>(io, "Engine")
      .def(py::init([](const std::string& backend, int queue_depth, int64_t block_size,
                       int64_t pool_bytes, bool direct, bool sqpoll, bool pin, int copy_threads) {
             TORCH_CHECK_VALUE(block_size > 0, "block_size must be > 0, got ", block_size);
             TORCH_CHECK_VALUE(pool_bytes > 0, "pool_bytes must be > 0, got ", pool_bytes);
             io::EngineOptions o;
             o.backend = backend;
             o.queue_depth = queue_depth;
             o.block_size = static_cast<size_t>(block_size);
             o.pool_bytes = static_cast<size_t>(pool_bytes);
             o.direct = direct;
             o.sqpoll = sqpoll;
             o.copy_threads = copy_threads;
             auto e = make_engine(o, pin);
             emit_warnings(*e);
             return e;
           }),
           py::kw_only(), py::arg("backend"), py::arg("queue_depth"), py::arg("block_size"),
           py::arg("pool_bytes"), py::arg("direct"), py::arg("sqpoll"), py::arg("pin") = false,
           py::arg("copy_threads") = 0)
      .def(
          "read",
          [](Engine& e, const at::Tensor& tensor, const std::vector<std::string>& paths,
             int64_t offset) {
            TORCH_CHECK_VALUE(offset >= 0, "offset must be >= 0, got ", offset);
            auto [ptr, n] = checked_bytes(tensor);
            auto r = e.read(ptr, n, paths, static_cast<uint64_t>(offset));
            emit_warnings(e);
            return r;
          },
          py::arg("tensor"), py::arg("paths"), py::arg("offset"))
      .def(
          "write",
          [](Engine& e, const at::Tensor& tensor, const std::vector<std::string>& paths,
             int64_t offset) {
            TORCH_CHECK_VALUE(offset >= 0, "offset must be >= 0, got ", offset);
            auto [ptr, n] = checked_bytes(tensor);
            auto r = e.write(ptr, n, paths, static_cast<uint64_t>(offset));
            emit_warnings(e);
            return r;
          },
          py::arg("tensor"), py::arg("paths"), py::arg("offset"))
      .def("sync",
           [](Engine& e) {
             IoStatus st;
             {
               py::gil_scoped_release nogil;
               st = e.sync();
             }
             if (!st.ok()) raise_status(st, "sync");
           })
      .def("forget", &Engine::forget, py::arg("path"), py::call_guard<py::gil_scoped_release>())
      .def("close", &Engine::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("closed", &Engine::closed)
      .def_property_readonly("backend", &Engine::backend_name)
      .def_property_readonly("fixed_buffers", &Engine::fixed_buffers)
      .def_property_readonly("fixed_files", &Engine::fixed_files)
      .def_property_readonly("pool_budget", [](Engine& e) { return e.pool().budget(); })
      .def_property_readonly("pool_in_use", [](Engine& e) { return e.pool().in_use(); })
      .def_property_readonly(
          "pool_pinned", [](const std::shared_ptr<Engine>& e) { return pin_state(e).pinned; },
          "Whether the pool is page-locked (asked for with pin=True and granted by CUDA).")
      .def_property_readonly(
          "pin_error", [](const std::shared_ptr<Engine>& e) { return pin_state(e).error; },
          "Why pin=True left the pool pageable; empty when it is pinned or was not asked for.")
      .def_property_readonly("path_bytes",
                             [](Engine& e) {
                               const auto& b = e.path_bytes();
                               py::dict d;
                               d["direct"] = b.direct.load();
                               d["staged"] = b.staged.load();
                               d["buffered"] = b.buffered.load();
                               return d;
                             })
      .def_property_readonly(
          "pool_base", [](Engine& e) { return reinterpret_cast<uintptr_t>(e.pool().arena()); })
      .def(
          "pool_acquire",
          [](const std::shared_ptr<Engine>& e, int64_t nbytes, bool block) {
            TORCH_CHECK_VALUE(nbytes > 0, "nbytes must be > 0, got ", nbytes);
            TORCH_CHECK_VALUE(static_cast<size_t>(nbytes) <= e->pool().budget(), "nbytes (", nbytes,
                              ") exceeds the pool budget of ", e->pool().budget(),
                              " bytes; raise pool_bytes");
            void* p;
            {
              py::gil_scoped_release nogil;
              p = block ? e->pool().acquire(nbytes) : e->pool().try_acquire(nbytes);
            }
            if (p == nullptr) return py::object(py::none());
            // The deleter holds the engine so the arena outlives every tensor carved from it.
            at::Tensor t = torch::from_blob(
                p, {nbytes}, [e](void* q) { e->pool().release(q); },
                at::TensorOptions().dtype(at::kByte));
            return py::cast(t);
          },
          py::arg("nbytes"), py::arg("block") = true,
          "A uint8 tensor of nbytes from the aligned pool (None when block=False and the pool "
          "is full); its memory returns to the pool when the tensor is freed.");

  io.def("uring_unavailable_reason", &io::uring_unavailable_reason,
         "Why io_uring cannot be used here, or '' when it can.");
  io.def("block_crc32c", &block_crc32c, py::arg("tensor"), py::arg("block_bytes"),
         "CRC-32C of each block_bytes-long block of a contiguous CPU tensor's bytes.");
  io.def("fingerprints", &fingerprints, py::arg("tensors"), py::arg("threads") = 1,
         "64-bit content fingerprint of each contiguous CPU tensor's bytes, for in-memory "
         "comparisons only (never stored): up to `threads` threads of the kernel pool.");
#ifdef TIERLIFT_WITH_CUDA
  io.def("fingerprints_device", &fingerprints_device, py::arg("table"), py::arg("out"),
         py::arg("stream"),
         "Queues, on CUDA stream `stream` (its handle), the fingerprints (as fingerprints gives "
         "for the same bytes) of the device ranges in table (int64 [count, 2]: data pointer, "
         "bytes) into out (int64 [count], the values' bits), both on that device.");
#endif
  io.def("fingerprints_finite", &fingerprints_finite, py::arg("tensors"), py::arg("threads") = 1,
         "(fingerprints, finite) of float32/bfloat16/float16 CPU tensors in one pass: each "
         "tensor's fingerprint (as fingerprints gives) and whether all its values are finite.");
  io.def("copy_checked", &copy_checked, py::arg("groups"), py::arg("threads") = 1,
         "groups: lists of (dst, src, want) CPU tensors of equal bytes. Per group, all or "
         "nothing: if every dst with a `want` still has that fingerprint, copies each src into "
         "its dst and returns the fingerprints of the copied bytes; else copies nothing (None).");
}

}  // namespace tierlift

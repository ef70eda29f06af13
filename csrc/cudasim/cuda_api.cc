// The part of the CUDA runtime API the kernels' launchers call, on the host: memory is host
// memory, every pointer is "device-accessible", streams and memsets are synchronous. Signatures
// come from the real cuda_runtime_api.h; libcudart is not linked into the simulator.
#include <cuda_runtime.h>

#include <cstring>
#include <mutex>
#include <string>

#include "cudasim/errors.h"
#include "cudasim/launch.h"

namespace cudasim {
namespace {

constexpr int kSimulatedSms = 2;  // small, so grids sized from it stay small and loop inside

thread_local cudaError_t last_code = cudaSuccess;
std::mutex message_mu;
std::string last_message;

}  // namespace

void set_error(cudaError_t code, const std::string& message) {
  last_code = code;
  std::lock_guard<std::mutex> lock(message_mu);
  last_message = message;
}

std::string last_error_message() {
  std::lock_guard<std::mutex> lock(message_mu);
  return last_message;
}

}  // namespace cudasim

cudaError_t cudaGetLastError() {
  const cudaError_t e = cudasim::last_code;
  cudasim::last_code = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return cudasim::last_code; }

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
    case cudaErrorLaunchFailure:
      return "cudaErrorLaunchFailure";
    case cudaErrorNotSupported:
      return "cudaErrorNotSupported";
    case cudaErrorInvalidHostPointer:
      return "cudaErrorInvalidHostPointer";
    default:
      return "cudaErrorUnknown";
  }
}

const char* cudaGetErrorString(cudaError_t e) { return cudaGetErrorName(e); }

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  switch (attr) {
    case cudaDevAttrMultiProcessorCount:
      *value = cudasim::kSimulatedSms;
      return cudaSuccess;
    case cudaDevAttrWarpSize:
      *value = 32;
      return cudaSuccess;
    case cudaDevAttrMaxThreadsPerBlock:
      *value = 1024;
      return cudaSuccess;
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t count, cudaStream_t) {
  std::memset(ptr, value, count);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind,
                            cudaStream_t) {
  std::memmove(dst, src, count);
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attr, const void* ptr) {
  if (ptr == nullptr) return cudaErrorInvalidValue;
  std::memset(attr, 0, sizeof(*attr));
  attr->type = cudaMemoryTypeHost;  // every host pointer reads as pinned and mapped
  attr->hostPointer = const_cast<void*>(ptr);
  attr->devicePointer = const_cast<void*>(ptr);
  return cudaSuccess;
}

cudaError_t cudaHostRegister(void*, size_t, unsigned int) { return cudaSuccess; }
cudaError_t cudaHostUnregister(void*) { return cudaSuccess; }

// How the launcher reports an error to the runtime API (cuda_api.cc): like CUDA's, the code is
// per host thread (cudaGetLastError clears it); the message stays for last_error_message().
#pragma once

#include <cuda_runtime.h>

#include <string>

namespace cudasim {

void set_error(cudaError_t code, const std::string& message);

}  // namespace cudasim

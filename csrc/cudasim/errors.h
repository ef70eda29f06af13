// The simulator's last-error state, shared by the launcher and the runtime API: like CUDA's, the
// code is per host thread (cudaGetLastError clears it); the message stays for last_error_message.
#pragma once

#include <cuda_runtime.h>

#include <string>

namespace cudasim {

void set_error(cudaError_t code, const std::string& message);
cudaError_t take_error();  // returns and clears this host thread's code
cudaError_t peek_error();

}  // namespace cudasim

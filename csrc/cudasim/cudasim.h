// The CPU simulator's view of CUDA C++, force-included (-include cudasim/cudasim.h) into every
// csrc/cuda/*.cu file when it is compiled by the host compiler with TIERLIFT_CUDASIM defined.
//
// Types and the host runtime API come from the real CUDA headers (their host paths: dim3, uint4,
// __half, cudaError_t...); this header adds what only device code has: the thread coordinates,
// __shared__ memory (one copy per block: blocks of a launch run one at a time per OS thread),
// barriers, warp shuffles and votes, atomics and the explicitly rounded math intrinsics. Every
// thread of a block is a fiber (scheduler.h), so barriers and shuffles are real rendezvous.
#pragma once

#ifndef TIERLIFT_CUDASIM
#error "cudasim.h is for the simulator build (-DTIERLIFT_CUDASIM)"
#endif

#include <cuda_runtime.h>
#include <math.h>

#include "cudasim/atomics.h"
#include "cudasim/intrinsics.h"
#include "cudasim/scheduler.h"
#include "cudasim/warp.h"

// Host compilers see __shared__ as nothing; here it is per OS thread, hence per running block.
// The scheduler finds every such function-local thread_local in the program's symbol table and
// poisons them at each block start (shared_memory.cc).
#undef __shared__
#define __shared__ static thread_local
#define __launch_bounds__(...)

#define threadIdx (::cudasim::current.thread_idx)
#define blockIdx (::cudasim::current.block_idx)
#define blockDim (::cudasim::current.block_dim)
#define gridDim (::cudasim::current.grid_dim)
constexpr int warpSize = 32;

// Where the simulated __shared__ memory lives, so that it can be poisoned at each block start.
// `__shared__` is a function-local `static thread_local` here (cudasim.h); the program's symbol
// table names every such variable (mangled _ZZ...), with its offset in the TLS segment. GCC
// ignores section attributes on the statics of template functions, hence the symbol table.
#pragma once

#include <cstddef>

namespace cudasim {

// Fills the calling OS thread's copy of every __shared__ variable with `byte`.
void fill_shared_memory(unsigned char byte);

}  // namespace cudasim

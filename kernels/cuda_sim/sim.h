// Internal interface between the CUDA simulator's runtime (runtime.cpp) and its kernel runner
// (fibers.cpp). Nothing outside kernels/cuda_sim includes this.
#pragma once
#include <string>

#include <cuda_runtime.h>

namespace cudasim {

// A bug the simulator caught that a GPU would turn into garbage or a fault: print it and abort.
[[noreturn]] void fatal(const std::string& msg);

// BATON_CUDASIM_FILL: fresh device memory and each block's shared memory start as 0xFF bytes.
bool fill_memory();

// Runs every block of a launch, one after another (called by the runtime, under its lock).
void run_kernel(const Launch& l);

}  // namespace cudasim

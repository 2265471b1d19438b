// The CUTLASS instantiations of the epilogue GEMM, one per (dtype, add, tile), compiled for sm_90a
// only (src/cuda/gemm/epilogue_gemm_*.cu); epilogue_gemm.cpp picks one. Host-only declarations.
#pragma once

#include <cuda_runtime_api.h>

#include <optional>
#include <string>

#include "cuda/gemm/epilogue_gemm.hpp"

namespace lmoe::cuda {

// Enqueues one GEMM; returns what CUTLASS refused (can_implement, initialize, launch), or nullopt.
template <DType dtype, EpilogueAdd add, EpilogueTile tile>
std::optional<std::string> launch_epilogue_gemm(const EpilogueGemmArgs& args, int sm_count,
                                                cudaStream_t stream);

}  // namespace lmoe::cuda

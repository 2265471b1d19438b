// Launches one P2P round (src/cuda/p2p_round.cuh) on the caller's stream. Host code.
#pragma once

#include <cuda_runtime_api.h>

#include "cuda/comm/p2p_types.hpp"
#include "lmoe/dtype.hpp"

namespace lmoe::cuda {

// Loads the round kernels on the current device now. With lazy module loading, a kernel loaded
// while a peer's round spins may wait for the context to go idle, which the spinner never lets it.
cudaError_t preload_p2p_kernels();

// `blocks` must be the same on every rank for the same round (block b pairs with block b).
cudaError_t launch_p2p_round(const P2pDeviceHandle& handle, const P2pRound& round, int blocks,
                             DType dtype, cudaStream_t stream);

}  // namespace lmoe::cuda

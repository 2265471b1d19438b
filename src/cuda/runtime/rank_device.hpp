// Which GPU a rank's objects belong to. Host code only.
#pragma once

#include <cuda_runtime.h>

#include "cuda/comm/p2p_peer_access.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "lmoe/communicator.hpp"

namespace lmoe::cuda {

// Makes the rank's GPU current and returns it: a p2p rank's own GPU (its workspace lives there and
// its peers map it from there), else the device the calling thread has current. Executors call it
// before they allocate anything, so that a rank's weights, workspaces and streams are on its GPU
// whichever device its thread had current.
inline int make_rank_device_current(Communicator& comm) {
  if (const auto* peers = dynamic_cast<const P2pPeerAccess*>(&comm))
    LMOE_CUDA_CHECK(cudaSetDevice(peers->device()));
  int device = 0;
  LMOE_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

}  // namespace lmoe::cuda

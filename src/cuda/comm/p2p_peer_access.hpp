// What a kernel that talks to its peers directly (the fused tail) needs from the p2p
// communicator, beyond the Communicator interface: the group's failure reporting, how many
// ranks share this rank's GPU, and memory every rank's kernels can read. Internal to the CUDA
// backend.
#pragma once

#include <cstddef>
#include <memory>

#include "cuda/comm/p2p_group.hpp"
#include "cuda/comm/p2p_types.hpp"

namespace lmoe {

class P2pPeerAccess {
 public:
  virtual ~P2pPeerAccess() = default;
  // This rank's status record, the group's abort flag and the timeout (p2p_types.hpp).
  virtual cuda::P2pDeviceHandle device_handle() const = 0;
  // Ranks of the group on this rank's GPU, itself included: their kernels must be resident at once.
  virtual int ranks_on_my_gpu() const = 0;
  // This rank's GPU (the device its kernels run on and its buffers belong to).
  virtual int device() const = 0;
  // Throws the group's first device-side failure (timeout, abort, concurrent use) as an error.
  virtual void throw_if_device_failed(const char* operation) = 0;
  // Collective: `bytes` of zeroed device memory on every rank's GPU (sizes may differ between
  // ranks: a peer reads only what the ranks lay out alike), with every rank's address as this
  // rank's kernels can use it (a peer's own pointer between threads, its IPC mapping between
  // processes). Keep it no longer than the communicator.
  virtual std::unique_ptr<P2pSharedBuffer> share_buffer(std::size_t bytes) = 0;
};

}  // namespace lmoe

#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "device_support.hpp"
#include "lmoe/cuda_communicator.hpp"
#include "lmoe/error.hpp"
#include "lmoe/nccl_communicator.hpp"
#include "lmoe/p2p_communicator.hpp"

namespace lmoe::python {

StreamHandle current_stream(const at::Tensor& tensor) {
  if (!tensor.is_cuda()) return nullptr;
  return at::cuda::getCurrentCUDAStream(tensor.device().index()).stream();
}

std::shared_ptr<Communicator> make_device_communicator(Communicator& host, int device,
                                                       const std::string& comm) {
  if (host.size() == 1) {
    // p2p with no peers: its rounds only stage and publish to themselves, and, unlike
    // cuda-threads, it can be captured in a CUDA graph (engines capture one graph per batch size).
    P2pOptions options;
    options.devices = {device};
    return make_p2p_thread_communicators(1, options).front();
  }
  if (comm == "p2p") {
    // Every rank names its own GPU; the group learns them all over the host path.
    std::vector<int> devices(static_cast<std::size_t>(host.size()));
    host.control_all_gather(&device, devices.data(), sizeof(int));
    P2pOptions options;
    options.devices = devices;
    return make_p2p_process_communicator(host, options);
  }
  if (comm == "nccl") {
    // make_nccl_env_communicator takes its id from a file that rank 0 writes: rank 0 picks a fresh
    // path and hands it to the others over the group. RANK and WORLD_SIZE must be the group's.
    char path[128] = {};
    if (host.rank() == 0) {
      std::random_device random;
      std::snprintf(path, sizeof(path), "/tmp/lmoe-nccl-id-%08x%08x", random(), random());
    }
    std::vector<char> all(sizeof(path) * static_cast<std::size_t>(host.size()));
    host.control_all_gather(path, all.data(), sizeof(path));
    ::setenv("LMOE_NCCL_ID_FILE", all.data(), 1);
    NcclProcessOptions options;
    options.device = device;
    return make_nccl_env_communicator(options);
  }
  throw Error("comm: expected p2p or nccl for a cuda tail of several ranks, got " + comm);
}

}  // namespace lmoe::python

// What only a build with CUDA provides to the torch ops: the caller's current stream, and the
// communicators of ranks on GPUs. A build without CUDA answers with an error naming why.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>

#include "lmoe/communicator.hpp"
#include "lmoe/tensor.hpp"

namespace lmoe::python {

// The current torch stream of `tensor`'s device (CUDA tensors); nullptr for CPU tensors.
StreamHandle current_stream(const at::Tensor& tensor);

// The communicator a cuda tail runs over on `device`: with one rank, p2p with no peers
// (capturable); else `comm` ("p2p": lmoe's collectives with CUDA IPC handles exchanged over `host`;
// "nccl": an NCCL communicator whose id travels over `host`). `host` carries the setup's exchanges.
std::shared_ptr<Communicator> make_device_communicator(Communicator& host, int device,
                                                       const std::string& comm);

}  // namespace lmoe::python

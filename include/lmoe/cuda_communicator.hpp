// The `cuda-threads` communicator: ranks are host threads of one process that share one GPU, each
// with its own stream. Collectives run on the caller's stream and read the peers' device buffers
// directly (same device, plain pointers); every reduction is the contract's rank-order sum, so
// results are bit-identical on every rank and equal to the host communicators'.
//
// Defined by builds with the CUDA backend (lmoe_cuda); the declarations are the same in every
// build.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "lmoe/communicator.hpp"

namespace lmoe {

// One communicator per rank, all on `device`. Buffers passed to collectives are device memory;
// a null stream means the calling thread's default stream (cudaStreamPerThread). A collective whose
// peers do not arrive within `timeout` aborts the group and fails with lmoe::Error on every rank.
std::vector<std::shared_ptr<Communicator>> make_cuda_thread_communicators(
    int num_ranks, int device, std::chrono::milliseconds timeout = std::chrono::seconds(120));

// Runs fn(rank, communicator) on `num_ranks` threads (each made current on `device`) and joins
// them; on a rank's error the group is aborted and the first root-cause error is rethrown.
void run_on_cuda_threads(int num_ranks, int device,
                         const std::function<void(int rank, Communicator& comm)>& fn,
                         std::chrono::milliseconds timeout = std::chrono::seconds(120));

}  // namespace lmoe

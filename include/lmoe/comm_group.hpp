// Groups of ranks on threads of this process, chosen by communicator backend name: the one switch
// the tools and tests use to pick a transport ("threads", "cuda-threads", "nccl").
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "lmoe/communicator.hpp"
#include "lmoe/latent_tail.hpp"
#include "lmoe/reference.hpp"

namespace lmoe {

// The thread-group communicators this build and machine can run for a compute backend, the
// default first (cpu: "threads"; cuda: "cuda-threads", then "nccl" in builds with NCCL).
std::vector<std::string> comm_backends(Backend backend);

// Those of comm_backends(backend) that can host `num_ranks` ranks here (nccl: one GPU per rank).
std::vector<std::string> comm_backends(Backend backend, int num_ranks);

// Why the named communicator cannot host `num_ranks` ranks here, or nullopt. nccl: one GPU per
// rank. p2p: ranks may share a GPU only with LMOE_P2P_SHARED_GPU=1, because on a shared GPU a
// rank's spinning round can hold SM resources that a peer's queued work needs, and the round then
// fails at its timeout (docs/p2p.md).
std::optional<std::string> comm_group_limit(std::string_view comm_backend, int num_ranks);

// The default for `backend`: comm_backends(backend).front().
std::string default_comm_backend(Backend backend);

// How the named backend sums across ranks, for judging its results (reference_tail): "nccl" in
// NCCL's own order, every other one in the contract's rank order.
ReductionOrder comm_reduction_order(std::string_view comm_backend);

// Runs fn(rank, comm) on `num_ranks` threads with communicators of the named backend and joins
// them; a rank's error aborts the group and the first root-cause error is rethrown. Throws
// lmoe::Error naming the choices when `comm_backend` is unknown or unavailable here, and for
// "nccl" when num_ranks exceeds the visible GPUs (one rank per GPU).
void run_comm_group(std::string_view comm_backend, int num_ranks,
                    const std::function<void(int rank, Communicator& comm)>& fn,
                    std::chrono::milliseconds timeout = std::chrono::seconds(120));

}  // namespace lmoe

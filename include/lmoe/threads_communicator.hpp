// The `threads` communicator: ranks are threads of one process exchanging host buffers.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "lmoe/communicator.hpp"

namespace lmoe {

// One communicator per rank, all joined to one group. A collective that waits longer than
// `timeout` for its peers fails with lmoe::Error instead of hanging, and aborts the group.
std::vector<std::shared_ptr<Communicator>> make_thread_communicators(
    int num_ranks, std::chrono::milliseconds timeout = std::chrono::seconds(120));

// Runs fn(rank, communicator) on `num_ranks` threads and joins them. When a rank throws, the group
// is aborted so that its peers stop waiting; the first error by rank order that did not come from
// the abort itself is rethrown.
void run_on_threads(int num_ranks, const std::function<void(int rank, Communicator& comm)>& fn,
                    std::chrono::milliseconds timeout = std::chrono::seconds(120));

// run_on_threads over communicators made elsewhere (e.g. the cuda-threads ones): one thread per
// communicator, rank = index, with the same error handling.
void run_on_rank_threads(std::span<const std::shared_ptr<Communicator>> comms,
                         const std::function<void(int rank, Communicator& comm)>& fn);

}  // namespace lmoe

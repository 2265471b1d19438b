// The `threads` communicator: ranks are threads of one process exchanging host buffers.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
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

}  // namespace lmoe

// The CUDA half of the tail runner (include/lmoe/tail_runner.hpp): a rank's inputs go to device
// buffers, the tail runs on the rank's own stream, and y comes back to the host.
#pragma once

#include "lmoe/tools/tail_runner.hpp"

namespace lmoe {

// As run_case_rank, on the current device; `comm` must be a device communicator.
RankRun run_case_rank_cuda(const TailCase& c, Communicator& comm, const RunOptions& options);

}  // namespace lmoe

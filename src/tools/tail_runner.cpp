#include "lmoe/tools/tail_runner.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "lmoe/comm_group.hpp"
#include "lmoe/error.hpp"

#ifdef LMOE_HAS_CUDA
#include "tools/cuda/cuda_tail_runner.hpp"
#endif

namespace lmoe {

TailOptions tail_options_for(const TailCase& c, const Communicator& comm,
                             const RunOptions& options) {
  LMOE_CHECK(comm.size() == c.tp, "the case has tp=" + std::to_string(c.tp) +
                                      " but the communicator has " + std::to_string(comm.size()) +
                                      " ranks");
  TailOptions tail_options;
  tail_options.dims = c.dims;
  tail_options.rms_norm_eps = c.eps;
  tail_options.latent_norm = c.latent_norm;
  tail_options.dtype = c.dtype;
  tail_options.backend = options.backend;
  tail_options.policy = options.policy;
  // GPU workspaces are allocated once, at construction: capture needs it, and a device allocation
  // in the middle of a forward would stall ranks that share a GPU and spin on each other (p2p).
  if (options.backend == Backend::cuda)
    tail_options.max_tokens = std::max<std::int64_t>(c.num_tokens, 1);
  return tail_options;
}

RankRun run_case_rank(const TailCase& c, Communicator& comm, const RunOptions& options) {
#ifdef LMOE_HAS_CUDA
  // Device inputs, the rank's own stream, y copied back: see src/tools/cuda/cuda_tail_runner.cpp.
  if (options.backend == Backend::cuda) return run_case_rank_cuda(c, comm, options);
#endif
  LMOE_CHECK(!options.graph, "CUDA graphs need the cuda backend");
  LatentTail tail(tail_options_for(c, comm, options), comm, c.norm_weight.matrix(),
                  c.up_proj_weight.matrix());

  const int rank = comm.rank();
  RankRun run;
  run.y = HostTensor(c.dtype, {c.num_tokens, c.dims.d_model});
  HostTensor shared(c.dtype, {c.num_tokens, c.dims.d_model});
  const ConstMatrixView shared_in = c.shared.slice_matrix(rank);
  for (int repeat = 0; repeat < std::max(1, options.repeats); ++repeat) {
    // The call may overwrite `shared` (column accumulates into it): start from the input each time.
    if (shared.nbytes()) std::memcpy(shared.data(), shared_in.data, shared.nbytes());
    run.y.fill_bytes(std::byte{0xff});  // NaN in every dtype: an unwritten element cannot pass
    comm.barrier();
    const auto start = std::chrono::steady_clock::now();
    run.tier =
        tail.forward(c.routed.slice_matrix(rank), shared.matrix(), run.y.matrix(), options.tier);
    comm.barrier();
    run.seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return run;
}

CaseRun run_case_on_threads(const TailCase& c, const RunOptions& options) {
  CaseRun result;
  result.ranks.resize(static_cast<std::size_t>(c.tp));
  const auto run_rank = [&](int rank, Communicator& comm) {
    result.ranks[static_cast<std::size_t>(rank)] = run_case_rank(c, comm, options);
  };
  run_comm_group(options.comm.empty() ? default_comm_backend(options.backend) : options.comm, c.tp,
                 run_rank);
  const RankRun& first = result.ranks.front();
  result.tier = first.tier;
  for (const RankRun& rank : result.ranks) {
    if (!same_bits(rank.y, first.y)) result.ranks_identical = false;
  }
  std::vector<double> seconds = first.seconds;
  std::sort(seconds.begin(), seconds.end());
  result.median_seconds = seconds.empty() ? 0.0 : seconds[seconds.size() / 2];
  return result;
}

}  // namespace lmoe

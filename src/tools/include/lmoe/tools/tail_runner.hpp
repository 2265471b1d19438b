// Runs one TailCase through LatentTail, every rank at once: the harness behind `lmoe run`,
// `lmoe tail`, the parity tests and the MPI tests.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "lmoe/communicator.hpp"
#include "lmoe/latent_tail.hpp"
#include "lmoe/reference.hpp"

namespace lmoe {

struct RunOptions {
  Backend backend = Backend::cpu;
  std::string comm;     // thread-group communicator (comm_group.hpp); empty: the backend's default
  PolicyConfig policy;  // used when `tier` is empty
  std::optional<TailTier> tier;  // force a tier
  int repeats = 1;               // timed forwards; the output of the last one is kept
  // cuda: capture one forward in a CUDA graph and replay it for every repeat, with
  // the inputs copied in again and the output poisoned before each replay. Needs a communicator
  // whose collectives can be captured (p2p, nccl).
  bool graph = false;
};

struct RankRun {
  HostTensor y;                  // [T, d], poisoned (all bits set) before each forward
  std::optional<TailTier> tier;  // what ran (nullopt for T = 0)
  std::vector<double> seconds;   // one per repeat, between barriers before and after
};

// The LatentTail options for a case (its dims, eps and dtype) and a run (backend, policy).
// Throws lmoe::Error when the communicator's size is not the case's tp.
TailOptions tail_options_for(const TailCase& c, const Communicator& comm,
                             const RunOptions& options);

// One rank's part: builds the LatentTail for this rank and runs its slice of the case.
RankRun run_case_rank(const TailCase& c, Communicator& comm, const RunOptions& options);

struct CaseRun {
  std::vector<RankRun> ranks;   // one per rank
  bool ranks_identical = true;  // every rank's y has the same bits
  std::optional<TailTier> tier;
  double median_seconds = 0;  // rank 0's median over repeats
};

// All ranks on threads of this process, with options.comm's communicators.
CaseRun run_case_on_threads(const TailCase& c, const RunOptions& options);

}  // namespace lmoe

// One rank's side of the tail benchmark (include/lmoe/tail_bench.hpp): its input and output
// buffers for up to max_tokens rows, and how it runs and times forwards. A forward runs every
// layer's tail (BenchOptions::layers: each its own weights, `shared` and output; the same routed
// input), back to back. The host version keeps host buffers and times with steady_clock between
// barriers; the CUDA version (src/tools/cuda/cuda_tail_bench.cpp) keeps device buffers and its own
// stream, times with CUDA events and can capture a forward into a CUDA graph.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "lmoe/communicator.hpp"
#include "lmoe/latent_tail.hpp"
#include "lmoe/tools/tail_bench.hpp"

namespace lmoe {

// Fills count elements of dst (host memory) with bench::value(seed, i), stored in dtype.
void fill_bench_values(void* dst, std::size_t count, DType dtype, std::uint64_t seed);

class BenchRank {
 public:
  virtual ~BenchRank() = default;
  // Fresh inputs for T rows: routed [T, l] and shared [T, d] from their streams (a pristine copy of
  // shared is kept, since the column tier accumulates into it); out poisoned. Synchronizes with
  // the other ranks before and after, so no peer reads a buffer while it changes.
  virtual void load_inputs(std::int64_t num_tokens, std::uint64_t routed_seed,
                           std::uint64_t shared_seed) = 0;
  // What forward() runs from now on: `tier` on the loaded rows, as a replay of one captured graph
  // (graph) or a LatentTail::forward call (eager). A tier prepared before at the same T keeps its
  // graph, so that a T's tiers can be timed in turns.
  virtual void prepare(TailTier tier, BenchMode mode) = 0;
  // `count` forwards, not timed.
  virtual void warm_up(int count) = 0;
  // `count` forwards, the seconds each took on this rank (all its layers).
  virtual std::vector<double> time(int count) = 0;
  // Restores shared, poisons out (all bits set: NaN in every dtype), runs one forward as prepared
  // and returns an output [T, d] in host memory: first_differing_output of the layers'.
  virtual HostTensor checked_output() = 0;
};

// The output a check should see of several layers' (each the same tail on the same inputs): the
// first whose bits differ from layer 0's, else layer 0's. A layer that went wrong alone (a
// workspace two tails share, a graph that left one out) is then what the contract judges.
HostTensor first_differing_output(std::vector<HostTensor> outputs);

// How many turns time_tiers_in_turns splits each tier's iterations into.
inline constexpr int kTimingTurns = 5;

// The tiers of one T (loaded, each prepared once) timed in turns: `iters` timed forwards of each,
// in min(kTimingTurns, iters) turns of a share each, every turn starting one tier later and each
// share after one untimed forward of its tier. Timed one after another, a tier inherits the clocks
// and L2 its predecessor left: the same body measured 8–11 % apart by its place in the sweep
// (docs/perf.md); in turns each tier sees every position. Per tier, its seconds.
std::vector<std::vector<double>> time_tiers_in_turns(BenchRank& bench_rank,
                                                     std::span<const TailTier> tiers,
                                                     BenchMode mode, int iters);

// `layers`: the tails a forward runs, in order (at least one; they outlive the rank).
std::unique_ptr<BenchRank> make_host_bench_rank(std::span<LatentTail* const> layers,
                                                Communicator& comm, std::int64_t max_tokens);

#ifdef LMOE_HAS_CUDA
// On the current device; `comm` must be a device communicator. `cold_l2`: time() evicts the
// device's L2 before each timed forward (BenchOptions::cold_l2).
std::unique_ptr<BenchRank> make_cuda_bench_rank(std::span<LatentTail* const> layers,
                                                Communicator& comm, std::int64_t max_tokens,
                                                bool cold_l2);
#endif

}  // namespace lmoe

// The p2p collectives at the layout production runs: 32 blocks a round, each staging into its own
// 1 MiB region (rounds of 32 MiB), so that full rounds take the unrolled copy and reduce loops
// (kP2pUnroll: a block's slice of at least 2048 vectors), and collectives of many rounds, in place
// and out of place; random sizes of every dtype; and several collectives of different sizes in one
// CUDA graph replayed back to back with new inputs. Every output of every rank is checked against
// the host (the rank-order sum, or the blocks gathered) bit for bit, on fresh random inputs, with
// outputs poisoned before each run. The protocol's corner cases (tiny rounds, signed zeros,
// failures) are in test_p2p.cpp.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cuda/runtime/device_buffer.hpp"
#include "gpu_test_support.hpp"
#include "lmoe/comm_group.hpp"
#include "lmoe/p2p_communicator.hpp"
#include "p2p_test_support.hpp"

namespace {

using lmoe::DType;
using p2p_test::Collective;
using p2p_test::Op;

// The production layout, stated rather than defaulted: ranks sharing a GPU default to 16 blocks.
constexpr int kBlocks = 32;
constexpr std::size_t kRoundBytes = std::size_t{32} << 20;

lmoe::P2pOptions production_layout() {
  lmoe::P2pOptions options;
  options.blocks = kBlocks;
  options.round_bytes = kRoundBytes;
  return options;
}

// Elements of `dtype` one round stages per rank.
std::size_t round_elements(DType dtype) { return kRoundBytes / lmoe::dtype_size(dtype); }

// The rank counts of 2 … 4 that can run p2p here (with one GPU: LMOE_P2P_SHARED_GPU=1).
std::vector<int> runnable_rank_counts() {
  std::vector<int> counts;
  for (int tp = 2; tp <= 4; ++tp) {
    if (!lmoe::comm_group_limit("p2p", tp)) counts.push_back(tp);
  }
  return counts;
}

// Several rounds of 32 MiB (two full ones and a partial one ending in a partial vector) of every
// collective, in place and out of place, with uneven blocks (a rank with none from tp 3 up), at
// every runnable rank count. Full rounds give every block a slice of 1 MiB, far beyond the 2048
// vectors from which the copy and reduce loops run unrolled.
TEST(P2pCollectivesAtTheProductionLayout, SeveralFullRoundsMatchTheHostBitForBit) {
  SKIP_WITHOUT_GPU();
  const std::vector<int> rank_counts = runnable_rank_counts();
  if (rank_counts.empty()) GTEST_SKIP() << *lmoe::comm_group_limit("p2p", 2);
  for (int tp : rank_counts) {
    // reduce_scatter reduces a piece of every rank's block per round: a block's region holds a slot
    // of region / tp elements per rank, so a round carries kBlocks · slot elements of each block.
    const std::size_t slot = (std::size_t{1} << 20) / 4 / static_cast<std::size_t>(tp) / 8 * 8;
    const std::size_t piece = kBlocks * slot;  // f32
    std::vector<std::size_t> scatter_counts, gather_counts;
    for (int r = 0; r < tp; ++r) {
      const bool empty = tp > 2 && r == tp - 1;
      scatter_counts.push_back(r == 0 ? 2 * piece + 999 : empty ? 0 : piece / 2 + 37 * r);
      gather_counts.push_back(r == 0  ? round_elements(DType::f16) + 4099
                              : empty ? 0
                                      : 100000 + 37 * r);
    }
    const std::vector<Collective> collectives = {
        {Op::all_reduce, DType::f32,
         p2p_test::split_evenly(2 * round_elements(DType::f32) + 4099, tp), false},
        {Op::all_reduce, DType::bf16, p2p_test::split_evenly(round_elements(DType::bf16) + 29, tp),
         true},
        {Op::reduce_scatter, DType::f32, scatter_counts, false},
        {Op::reduce_scatter, DType::f32, scatter_counts, true},
        {Op::all_gather, DType::f16, gather_counts, false},
        {Op::all_gather, DType::f16, gather_counts, true},
    };
    p2p_test::expect_runs_match_the_host(
        tp, collectives, false, 1, 20261201u + static_cast<unsigned>(tp), production_layout());
  }
}

// Random sizes from 1 Ki to 2 Mi elements of every dtype and collective, in place or not, issued
// back to back: half of them with blocks of multiples of 8 elements (the vector paths), half with
// random blocks (the element-wise ones). The seed is fixed, so a failure reproduces; the sizes are
// printed.
TEST(P2pCollectivesAtTheProductionLayout, RandomSizesOfEveryDtypeMatchTheHostBitForBit) {
  SKIP_WITHOUT_GPU();
  const std::vector<int> rank_counts = runnable_rank_counts();
  if (rank_counts.empty()) GTEST_SKIP() << *lmoe::comm_group_limit("p2p", 2);
  std::mt19937_64 rng(20261207u);
  for (int tp : rank_counts) {
    std::vector<Collective> collectives;
    for (DType dtype : {DType::bf16, DType::f16, DType::f32}) {
      for (Op op : {Op::all_reduce, Op::reduce_scatter, Op::all_gather}) {
        for (int pick = 0; pick < 3; ++pick) {
          // log-uniform in [2^10, 2^21], with both ends always among the picks
          const double exponent = pick == 0   ? 10.0
                                  : pick == 1 ? 21.0
                                              : std::uniform_real_distribution<double>(10, 21)(rng);
          std::size_t total = static_cast<std::size_t>(std::exp2(exponent));
          std::vector<std::size_t> counts;
          if ((pick + static_cast<int>(op)) % 2 == 0) {
            total = total / (8 * tp) * (8 * tp);
            counts = p2p_test::split_evenly(total, tp);
          } else {
            std::vector<double> weights;
            for (int r = 0; r < tp; ++r)
              weights.push_back(std::uniform_real_distribution<double>(0.2, 1.0)(rng));
            double sum = 0;
            for (double w : weights) sum += w;
            std::size_t given = 0;
            for (int r = 0; r + 1 < tp; ++r) {
              counts.push_back(
                  static_cast<std::size_t>(static_cast<double>(total) * weights[r] / sum));
              given += counts.back();
            }
            counts.push_back(total - given);
          }
          collectives.push_back({op, dtype, counts, rng() % 2 == 0});
        }
      }
    }
    std::printf("[ p2p    ] tp %d:", tp);
    for (const Collective& c : collectives) std::printf(" %s;", c.name().c_str());
    std::printf("\n");
    p2p_test::expect_runs_match_the_host(tp, collectives, false, 1,
                                         7000u + static_cast<unsigned>(tp), production_layout());
  }
}

// Collectives of different sizes, dtypes and placements captured in one CUDA graph and replayed
// back to back, every replay with new inputs: each collective's rounds follow the last one's on
// every block, whatever their grids, and the replays' rounds follow each other the same way.
TEST(P2pCollectivesAtTheProductionLayout, OneGraphOfSeveralCollectivesReplaysWithNewInputs) {
  SKIP_WITHOUT_GPU();
  const std::vector<int> rank_counts = runnable_rank_counts();
  if (rank_counts.empty()) GTEST_SKIP() << *lmoe::comm_group_limit("p2p", 2);
  const int tp = rank_counts.back();
  std::vector<std::size_t> uneven;
  for (int r = 0; r < tp; ++r) uneven.push_back(150000 + 4099 * static_cast<std::size_t>(r));
  const std::vector<Collective> collectives = {
      {Op::all_reduce, DType::bf16, p2p_test::split_evenly((1 << 20) + 3, tp), false},
      {Op::reduce_scatter, DType::f32, p2p_test::split_evenly(3 * (512 << 10), tp), true},
      {Op::all_gather, DType::f16, uneven, false},
      {Op::all_reduce, DType::f32, p2p_test::split_evenly(1000, tp), true},
      {Op::reduce_scatter, DType::bf16, uneven, false},
      {Op::all_gather, DType::bf16, p2p_test::split_evenly(64 << 10, tp), true},
  };
  p2p_test::expect_runs_match_the_host(tp, collectives, true, 4, 424242u, production_layout());
}

}  // namespace

// The fused tier's chained path (cuda/fused_chained.cuh; wgmma, compute 9.0 only) against the CPU
// contract, ranks sharing one GPU: calls chained by programmatic launch reading what the call
// before wrote, turning it off and bad settings, split K over clusters, the first copies paced and
// the norm's count handed off, and a soak of graph replays.

#include "fused_test_support.hpp"

namespace {

using namespace lmoe_fused_test;

// Each call's routed input is the previous call's output (expect_each_call_reads_the_last_output):
// the chained path's first kernel may start before the stream's previous kernel ends (it is
// launched programmatically and waits for it before reading anything), and the up-projection lets
// its successor start at once, so every call must still read what the call before it wrote. With
// one rank the up-projection's first copies are paced (issued from a thread of their own while the
// producer waits for the norm kernel), so also with them all at once
// (LMOE_FUSED_CHAINED_PACE_NS=0). T = 1, 5 and 17: the chained path on compute 9.0 (elsewhere the
// decode kernel, then the general kernel).
TEST_F(Fused, ACallReadsWhatTheCallBeforeItWrote) {
  SKIP_WITHOUT_GPU();
  for (int variant = 0; variant < 4; ++variant) {
    const bool graph = (variant & 1) != 0;
    const bool at_once = (variant & 2) != 0;
    const ScopedEnv pace("LMOE_FUSED_CHAINED_PACE_NS", at_once ? "0" : nullptr);
    for (const std::int64_t tokens : {1, 5, 17}) {
      SCOPED_TRACE(std::string(at_once ? "first copies at once" : "first copies paced"));
      expect_each_call_reads_the_last_output(tokens, graph,
                                             90u + static_cast<std::uint64_t>(tokens));
    }
  }
}

// LMOE_FUSED_CHAINED=0 sends the chained path's calls to the general kernel and says why; with one
// rank and without the latent norm it does not run either (with several N lands in the workspace,
// normalized or not).
TEST_F(Fused, ChainedPathCanBeTurnedOffAndSaysWhyItDoesNotRun) {
  SKIP_WITHOUT_GPU();
  if (compute_capability() != 90) GTEST_SKIP() << "the chained path runs on compute 9.0 only";
  const auto limit_with = [](int tp, bool latent_norm) {
    lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, tp, 32, 43u);
    c.latent_norm = latent_norm;
    std::string why;
    const auto comms = lmoe::make_p2p_thread_communicators(tp, {});
    lmoe::run_on_rank_threads(comms, [&](int rank, lmoe::Communicator& comm) {
      FusedRank state(comm, c, 64);
      EXPECT_EQ(state.fused->chained_max_tokens() > 0, !state.fused->chained_limit().has_value());
      if (rank == 0) why = state.fused->chained_limit().value_or("");
    });
    return why;
  };
  EXPECT_EQ(limit_with(1, true), "");
  EXPECT_NE(limit_with(1, false).find("latent norm"), std::string::npos);
  // What `lmoe bench` and `lmoe explain` count as its exchange: two shots where the chained path
  // takes the call with several ranks (5 … 128 rows at tp 2 … 7, 17 … 128 from tp 8; the decode
  // kernel's one shot below, the general kernel's above).
  EXPECT_TRUE(lmoe::fused_runs_two_shot(lmoe::Backend::cuda, kK3, DType::bf16, 8, 17));
  EXPECT_TRUE(lmoe::fused_runs_two_shot(lmoe::Backend::cuda, kK3, DType::bf16, 2, 128));
  EXPECT_TRUE(lmoe::fused_runs_two_shot(lmoe::Backend::cuda, kK3, DType::bf16, 2, 5));
  EXPECT_FALSE(lmoe::fused_runs_two_shot(lmoe::Backend::cuda, kK3, DType::bf16, 2, 4));
  EXPECT_FALSE(lmoe::fused_runs_two_shot(lmoe::Backend::cuda, kK3, DType::bf16, 8, 16));
  EXPECT_FALSE(lmoe::fused_runs_two_shot(lmoe::Backend::cuda, kK3, DType::bf16, 8, 129));
  EXPECT_FALSE(lmoe::fused_runs_two_shot(lmoe::Backend::cuda, kK3, DType::bf16, 1, 64));
  const bool two_ranks = !lmoe::comm_group_limit("p2p", 2);
  if (two_ranks) {
    EXPECT_EQ(limit_with(2, true), "");
    EXPECT_EQ(limit_with(2, false), "");
  }
  const ScopedEnv off("LMOE_FUSED_CHAINED", "0");
  EXPECT_NE(limit_with(1, true).find("LMOE_FUSED_CHAINED=0"), std::string::npos);
  if (two_ranks) {
    EXPECT_NE(limit_with(2, true).find("LMOE_FUSED_CHAINED=0"), std::string::npos);
  }
}

// The chained path's measurement settings with a bad value — LMOE_FUSED_EXCHANGE_GRID (the exchange
// blocks with several ranks) outside [1, what the GPU allows] or not a number,
// LMOE_FUSED_CHAINED_TILE_ROWS (the up-projection's tile) anything but 64 or 128, the first copies'
// pace and burst (LMOE_FUSED_CHAINED_PACE_NS, _BURST) out of range or not a number: every rank's
// construction fails naming the variable, before any kernel of the call is launched (one rank and
// two; the exchange grid is read with several ranks only, the others at every tp).
TEST_F(Fused, BadChainedPathSettingsAreAnErrorOnEveryRank) {
  SKIP_WITHOUT_GPU();
  if (compute_capability() != 90) GTEST_SKIP() << "the chained path runs on compute 9.0 only";
  struct Bad {
    const char* variable;
    std::vector<const char*> values;
    const char* error;
    int min_tp;
  };
  const Bad bads[] = {
      {"LMOE_FUSED_EXCHANGE_GRID",
       {"0", "100000", "8x"},
       "LMOE_FUSED_EXCHANGE_GRID: expected a count of blocks on this GPU in [1, ",
       2},
      {"LMOE_FUSED_CHAINED_TILE_ROWS",
       {"96", "32", "256", "64x"},
       "LMOE_FUSED_CHAINED_TILE_ROWS: expected 64 or 128",
       1},
      {"LMOE_FUSED_CHAINED_PACE_NS",
       {"-1", "100001", "250ns"},
       "LMOE_FUSED_CHAINED_PACE_NS: expected nanoseconds in [0, 100000]",
       1},
      {"LMOE_FUSED_CHAINED_PACE_BURST",
       {"0", "65", "2x"},
       "LMOE_FUSED_CHAINED_PACE_BURST: expected a count of copies in [1, 64]",
       1},
  };
  for (int tp : {1, 2}) {
    if (tp > 1 && lmoe::comm_group_limit("p2p", tp)) continue;
    const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, tp, 32, 44u);
    for (const Bad& bad : bads) {
      if (tp < bad.min_tp) continue;
      for (const char* value : bad.values) {
        SCOPED_TRACE(std::string(bad.variable) + "=" + value + " tp=" + std::to_string(tp));
        const ScopedEnv set(bad.variable, value);
        expect_every_rank_error(construction_errors(c, tp, 64), bad.error);
      }
    }
  }
}

// LMOE_FUSED_TRACE on the chained path: destroying the FusedTail prints the up-projection's points
// for the last call (one of 33 rows, in the plan's tiles and splits) — entry, N ready, the last
// wgmma, the partials, the parking stores issued, the parked slice and the end, in that order —
// then the global timer line that benchmarks/tail_timeline.py reads.
TEST_F(Fused, ChainedTraceListsItsPointsAndTheGlobalTimer) {
  SKIP_WITHOUT_GPU();
  if (compute_capability() != 90) GTEST_SKIP() << "the chained path runs on compute 9.0 only";
  const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, 1, 33, 61u);
  const ScopedEnv env("LMOE_FUSED_TRACE", "1");
  const auto comms = lmoe::make_p2p_thread_communicators(1, {});
  ::testing::internal::CaptureStderr();
  lmoe::run_on_rank_threads(comms, [&](int, lmoe::Communicator& comm) {
    FusedRank state(comm, c, 33);
    state.fused->run(state.routed.data(), state.shared.data(), state.out.data(), 33, nullptr);
    cuda_ok(cudaStreamSynchronize(nullptr));
  });
  const std::string traced = ::testing::internal::GetCapturedStderr();
  const std::size_t header = traced.find("[ fused trace ] rank 0, chained up-projection, grid ");
  ASSERT_NE(header, std::string::npos) << traced;
  std::size_t at = header;
  for (const char* point :
       {"entry", "N ready", "multiplied", "partials in", "stored", "parked", "end"}) {
    const std::size_t next = traced.find(std::string("[ fused trace ] ") + point + " ", at);
    ASSERT_NE(next, std::string::npos) << point << "\n" << traced;  // and in this order
    at = next;
  }
  unsigned long long first = 0, last = 0;
  const std::size_t timer = traced.find("[ fused trace ] global timer: first entry ", at);
  ASSERT_NE(timer, std::string::npos) << traced;
  EXPECT_EQ(std::sscanf(traced.c_str() + timer,
                        "[ fused trace ] global timer: first entry %llu ns, last stamp %llu ns",
                        &first, &last),
            2);
  EXPECT_GT(first, 0ull);
  EXPECT_LE(first, last);
}

// The chained path splits K over the blocks of a cluster, a power of two up to 8 per tile of 64 or
// 128 rows, each block finishing tile / splits of the tile's rows (a reduce-scatter through
// distributed shared memory; a tile of 128 stores both consumers' 64 rows). Shapes whose
// tile counts give 1, 2, 4 and 8 splits with either tile on 132 SMs (the expectation is derived
// from this device's SMs), each run with both tiles (LMOE_FUSED_CHAINED_TILE_ROWS), with K not a
// multiple of 64 (l = 528, 1040), ranges of K of unequal length (17 chunks over 8 blocks), a tile
// partly past d (d = 64) and more tiles of 64 than SMs (d = 8704): random inputs within the
// contract and crafted inputs bit for bit at T = 5, 17 and 128 (T ≤ 4 is the decode kernel's).
// Unset, the plan takes the tile with more blocks in one wave, at equal blocks fewer splits.
TEST_F(Fused, ChainedPathSplitsKOverClustersOfOneToEightBlocks) {
  SKIP_WITHOUT_GPU();
  if (compute_capability() != 90) GTEST_SKIP() << "the chained path runs on compute 9.0 only";
  int device = 0, sms = 0;
  cuda_ok(cudaGetDevice(&device));
  cuda_ok(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const lmoe::TailDims shapes[] = {{8704, 256}, {7168, 256}, {2560, 512},
                                   {1280, 528}, {896, 1040}, {64, 4480}};
  struct Plan {
    int tile_rows, tiles, splits;
  };
  const auto expected_plan = [&](const lmoe::TailDims& dims, int tile_rows) {
    const int tiles = static_cast<int>((dims.d_model + tile_rows - 1) / tile_rows);
    const int chunks = static_cast<int>((dims.d_latent + 63) / 64);
    const int most = std::min({lmoe::cuda::kChainedMaxSplits, std::max(1, sms / tiles), chunks});
    int splits = 1;
    while (splits * 2 <= most) splits *= 2;
    return Plan{tile_rows, tiles, splits};
  };
  // The plan's tile and splits for `dims` with LMOE_FUSED_CHAINED_TILE_ROWS as it is set now.
  const auto taken_plan = [](const lmoe::TailCase& c) {
    Plan plan{};
    const auto comms = lmoe::make_p2p_thread_communicators(1, {});
    lmoe::run_on_rank_threads(comms, [&](int, lmoe::Communicator& comm) {
      FusedRank state(comm, c, 128);
      EXPECT_FALSE(state.fused->chained_limit().has_value()) << *state.fused->chained_limit();
      plan = {state.fused->chained_tile_rows(), 0, state.fused->chained_splits()};
    });
    return plan;
  };
  std::vector<std::pair<int, int>> seen;  // (tile rows, splits)
  double worst = 0;
  std::string taken;
  for (const lmoe::TailDims& dims : shapes) {
    const lmoe::TailCase c = lmoe::make_random_case(dims, 1e-5f, DType::bf16, 1, 128, 47u);
    const std::string shape = std::to_string(dims.d_model) + "x" + std::to_string(dims.d_latent);
    {
      const Plan wide = expected_plan(dims, 128), narrow = expected_plan(dims, 64);
      const int wide_blocks = wide.tiles * wide.splits,
                narrow_blocks = narrow.tiles * narrow.splits;
      const Plan expected =
          narrow_blocks <= sms && (narrow_blocks > wide_blocks ||
                                   (narrow_blocks == wide_blocks && narrow.splits < wide.splits))
              ? narrow
              : wide;
      const ScopedEnv unset("LMOE_FUSED_CHAINED_TILE_ROWS", nullptr);
      const Plan plan = taken_plan(c);
      EXPECT_EQ(plan.tile_rows, expected.tile_rows) << shape;
      EXPECT_EQ(plan.splits, expected.splits) << shape;
      taken +=
          " " + shape + ":" + std::to_string(plan.tile_rows) + "/" + std::to_string(plan.splits);
    }
    for (const char* tile : {"64", "128"}) {
      const ScopedEnv set("LMOE_FUSED_CHAINED_TILE_ROWS", tile);
      const Plan expected = expected_plan(dims, std::atoi(tile));
      const Plan plan = taken_plan(c);
      SCOPED_TRACE(shape + " tile=" + tile + " splits=" + std::to_string(plan.splits));
      EXPECT_EQ(plan.tile_rows, expected.tile_rows);
      EXPECT_EQ(plan.splits, expected.splits);
      seen.emplace_back(plan.tile_rows, plan.splits);
      for (std::int64_t tokens : {std::int64_t{5}, std::int64_t{17}, std::int64_t{128}}) {
        SCOPED_TRACE("T=" + std::to_string(tokens));
        expect_random_and_crafted_inputs_pass(
            dims, DType::bf16, 1, tokens, 11u * static_cast<std::uint64_t>(tokens) + 3u, &worst);
      }
    }
  }
  if (sms == 132) {
    for (int tile_rows : {64, 128}) {
      for (int splits : {1, 2, 4, 8}) {
        EXPECT_NE(std::find(seen.begin(), seen.end(), std::make_pair(tile_rows, splits)),
                  seen.end())
            << tile_rows << " rows, " << splits << " splits";
      }
    }
  }
  std::printf(
      "[ fused  ] chained plans (d x l: tile rows/splits by default)%s; both tiles at "
      "T 5/17/128 max_err/bound=%.3f\n",
      taken.c_str(), worst);
}

// The same for the chained path (a graph bounded by 128 rows: its wgmma N of 128 and the cluster's
// reduction over every replay): one rank, and two through the exchange and gather kernels (lines
// of both parities, epochs, T < tp).
TEST_F(Fused, ChainedSoakOfGraphReplaysWithChangingTAndInputsHasNoMismatch) {
  SKIP_WITHOUT_GPU();
  if (compute_capability() != 90) GTEST_SKIP() << "the chained path runs on compute 9.0 only";
  soak_graph_replays(1, 128, {17, 128, 1, 64, 33}, lmoe::cuda::FusedKernel::chained);
  if (lmoe::comm_group_limit("p2p", 2)) GTEST_SKIP() << "p2p with 2 ranks cannot run here";
  soak_graph_replays(2, 128, {17, 128, 1, 64, 33}, lmoe::cuda::FusedKernel::chained);
}

// The ring's first round paced at another pace than one rank's default, and with two ranks
// (sharing the GPU: the exchange kernel before the up-projection), where it is not paced by
// default (LMOE_FUSED_CHAINED_PACE_NS=300, _BURST=1: one copy at a time, 300 ns apart, by a thread
// of its own, the bytes of each stage expected before any is issued). Crafted inputs bit for bit
// and random ones within the bound at every token class, then graph replays with T changing on
// the device.
TEST_F(Fused, ChainedPacedFirstCopiesGiveTheContractsResults) {
  SKIP_WITHOUT_GPU();
  if (compute_capability() != 90) GTEST_SKIP() << "the chained path runs on compute 9.0 only";
  const ScopedEnv paced("LMOE_FUSED_CHAINED_PACE_NS", "300");
  const ScopedEnv burst("LMOE_FUSED_CHAINED_PACE_BURST", "1");
  double worst = 0;
  for (const int tp : {1, 2}) {
    for (const std::int64_t tokens : {1, 17, 33, 65, 128}) {
      SCOPED_TRACE("tp=" + std::to_string(tp) + " T=" + std::to_string(tokens));
      expect_random_and_crafted_inputs_pass(kSmall, DType::bf16, tp, tokens,
                                            300u + static_cast<std::uint64_t>(tokens), &worst);
    }
  }
  expect_random_and_crafted_inputs_pass(kK3, DType::bf16, 1, 16, 432u, &worst);
  soak_graph_replays(1, 128, {17, 128, 1, 64, 33}, lmoe::cuda::FusedKernel::chained);
  std::printf("[ fused  ] chained, first copies paced: max_err/bound=%.3f\n", worst);
}

}  // namespace

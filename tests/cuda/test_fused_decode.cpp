// The fused tier's decode kernel (cuda/fused_decode.cuh; T ≤ 16, any device) against the CPU
// contract, ranks sharing one GPU: where it runs by default and how it is turned off, its bound and
// the groups an SM takes, small odd shapes, K3 eager and in graphs with T on the device, several
// ranks, and a soak of graph replays.

#include <functional>
#include <utility>
#include <vector>

#include "cuda/comm/p2p_peer_access.hpp"
#include "cuda/fused/fused_decode_launch.hpp"
#include "cuda/fused/fused_ll_lines.hpp"
#include "fused_test_support.hpp"
#include "tools/cuda/fused_ll_soak.hpp"

namespace {

using namespace lmoe_fused_test;

// With one rank the decode kernel is launched programmatically: it may start before the stream's
// previous kernel (the previous call's) ends, and asks for gamma and its first weight items before
// waiting for it (LMOE_FUSED_DECODE_EARLY_ITEMS: 0, 5, and the default, 4). Each call's routed
// input is the previous call's output, eager and in a graph: every call must still read what the
// call before it wrote (expect_each_call_reads_the_last_output). T = 1, 5, 16 with the chained
// path off (on compute 9.0 it takes these calls otherwise).
TEST_F(Fused, DecodeCallsReadWhatTheCallBeforeThemWrote) {
  SKIP_WITHOUT_GPU();
  const ScopedEnv chained("LMOE_FUSED_CHAINED", "0");
  for (const char* early : {"0", "5", static_cast<const char*>(nullptr)}) {
    const ScopedEnv items("LMOE_FUSED_DECODE_EARLY_ITEMS", early);
    for (const bool graph : {false, true}) {
      for (const std::int64_t tokens : {1, 5, 16}) {
        SCOPED_TRACE(std::string("early items ") + (early ? early : "(default)"));
        expect_each_call_reads_the_last_output(tokens, graph,
                                               190u + static_cast<std::uint64_t>(tokens),
                                               lmoe::cuda::FusedKernel::decode);
      }
    }
  }
}

// LMOE_FUSED_DECODE_EARLY_ITEMS out of range or not a number, LMOE_FUSED_DECODE_PROGRAMMATIC or
// LMOE_FUSED_DECODE_PAIR not a flag: the construction fails naming the variable (one rank, and two
// where p2p runs them).
TEST_F(Fused, BadDecodeLaunchSettingsAreAnError) {
  SKIP_WITHOUT_GPU();
  const std::pair<const char*, const char*> bads[] = {
      {"LMOE_FUSED_DECODE_EARLY_ITEMS", "-1"}, {"LMOE_FUSED_DECODE_EARLY_ITEMS", "65"},
      {"LMOE_FUSED_DECODE_EARLY_ITEMS", "3x"}, {"LMOE_FUSED_DECODE_PROGRAMMATIC", "maybe"},
      {"LMOE_FUSED_DECODE_PAIR", "2"},
  };
  for (const int tp : {1, 2}) {
    if (tp > 1 && lmoe::comm_group_limit("p2p", tp)) continue;
    const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, tp, 4, 45u);
    for (const auto& [variable, value] : bads) {
      SCOPED_TRACE(std::string(variable) + "=" + value + " tp=" + std::to_string(tp));
      const ScopedEnv set(variable, value);
      const std::string name = variable;
      const std::string expected = name == "LMOE_FUSED_DECODE_PROGRAMMATIC"
                                       ? "LMOE_FUSED_DECODE_PROGRAMMATIC='maybe': expected 1, 0"
                                   : name == "LMOE_FUSED_DECODE_PAIR"
                                       ? "LMOE_FUSED_DECODE_PAIR='2': expected 1, 0"
                                       : "LMOE_FUSED_DECODE_EARLY_ITEMS: expected a count of a "
                                         "warp's weight items in [0, 64]";
      expect_every_rank_error(construction_errors(c, tp, 4), expected);
    }
  }
}

// Where the decode kernel is launched programmatically (FusedTail::decode_programmatic): with one
// rank by default and not with LMOE_FUSED_DECODE_PROGRAMMATIC=0; with two ranks not by default,
// and with =1 only where each rank has a GPU of its own (two GPUs: ranks on GPUs 0 and 1), never
// where they share one; nowhere the decode kernel does not run (LMOE_FUSED_DECODE=0).
TEST_F(Fused, DecodeIsLaunchedProgrammaticallyWhereItMay) {
  SKIP_WITHOUT_GPU();
  int gpus = 0;
  cuda_ok(cudaGetDeviceCount(&gpus));
  const auto programmatic = [](int tp, const char* setting, const char* decode) {
    const ScopedEnv set("LMOE_FUSED_DECODE_PROGRAMMATIC", setting);
    const ScopedEnv on("LMOE_FUSED_DECODE", decode);
    const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, tp, 4, 46u);
    std::vector<int> launched(static_cast<std::size_t>(tp), -1);
    const auto comms = lmoe::make_p2p_thread_communicators(tp, {});
    lmoe::run_on_rank_threads(comms, [&](int rank, lmoe::Communicator& comm) {
      FusedRank state(comm, c, 4);
      launched[static_cast<std::size_t>(rank)] = state.fused->decode_programmatic() ? 1 : 0;
    });
    for (const int l : launched) EXPECT_EQ(l, launched[0]);
    return launched[0] == 1;
  };
  EXPECT_TRUE(programmatic(1, nullptr, nullptr));
  EXPECT_TRUE(programmatic(1, "1", nullptr));
  EXPECT_FALSE(programmatic(1, "0", nullptr));
  EXPECT_FALSE(programmatic(1, nullptr, "0"));
  if (lmoe::comm_group_limit("p2p", 2)) GTEST_SKIP() << "p2p with 2 ranks cannot run here";
  EXPECT_FALSE(programmatic(2, nullptr, nullptr));
  EXPECT_EQ(programmatic(2, "1", nullptr), gpus >= 2) << gpus << " GPU(s)";
  EXPECT_FALSE(programmatic(2, "0", nullptr));
}

// A narrow stripe (K3's 896 rows at tp 8, as one rank's whole d): a block's share of w_up is one
// group of 8 rows and every warp's 7 items fit in its first ring, so the kernel asks for them all
// at once and multiplies them once landed (the "whole" path; K3's whole w_up, 6 or 7 groups a
// block, streams them through the ring, DecodeK3EagerAndGraphReplaysWithTOnTheDevice). T = 1, 2, 5,
// 8, 9 and 16 (both instances), random and crafted inputs, bf16 and f16, eager and as graph
// replays.
TEST_F(Fused, DecodeNarrowStripeMeetsTheContract) {
  SKIP_WITHOUT_GPU();
  const ScopedEnv chained_off("LMOE_FUSED_CHAINED", "0");  // one rank: decode up to its bound
  const lmoe::TailDims stripe{896, 3584};
  double worst = 0;
  for (DType dtype : {DType::bf16, DType::f16}) {
    for (std::int64_t tokens : {1, 2, 5, 8, 9, 16}) {
      SCOPED_TRACE(std::string(lmoe::dtype_name(dtype)) + " T=" + std::to_string(tokens));
      expect_random_and_crafted_inputs_pass(stripe, dtype, 1, tokens,
                                            31u * static_cast<std::uint64_t>(tokens), &worst);
      const lmoe::TailCase c = lmoe::make_random_case(stripe, 1e-5f, dtype, 1, tokens, 77u);
      expect_meets_contract(c, run_fused(c, true), &worst);
    }
  }
  std::printf("[ fused  ] decode d=896 l=3584 T 1…16 max_err/bound=%.3f\n", worst);
}

// The pair instance (FusedDecodePlan::pair_tokens): with one rank, launched programmatically,
// where a block's share of w_up is one group of 8 rows (K3's 896-row stripe at tp 8 as one rank's
// whole d), calls of up to 4 rows run with two blocks an SM by the occupancy calculator, calls of 5
// with one; K3's whole w_up (7 groups a block) has no pair, nor does a stripe with
// LMOE_FUSED_DECODE_PAIR=0 or LMOE_FUSED_DECODE_PROGRAMMATIC=0 (the stripe's calls against the
// contract: DecodeNarrowStripeMeetsTheContract). Then a soak of graph replays with T changing on
// the device inside the pair's bound.
TEST_F(Fused, DecodePairInstanceRunsTwoBlocksAnSmWhereABlockTakesOneGroup) {
  SKIP_WITHOUT_GPU();
  const ScopedEnv chained_off("LMOE_FUSED_CHAINED", "0");  // one rank: decode up to its bound
  const lmoe::TailDims stripe{896, 3584};
  const auto with = [](lmoe::TailDims dims, const char* pair, const char* programmatic,
                       const std::function<void(const lmoe::cuda::FusedTail&)>& check) {
    const ScopedEnv pair_setting("LMOE_FUSED_DECODE_PAIR", pair);
    const ScopedEnv launch_setting("LMOE_FUSED_DECODE_PROGRAMMATIC", programmatic);
    const lmoe::TailCase c = lmoe::make_random_case(dims, 1e-5f, DType::bf16, 1, 4, 47u);
    const auto comms = lmoe::make_p2p_thread_communicators(1, {});
    lmoe::run_on_rank_threads(comms, [&](int, lmoe::Communicator& comm) {
      FusedRank state(comm, c, 16);
      check(*state.fused);
    });
  };
  with(stripe, nullptr, nullptr, [](const lmoe::cuda::FusedTail& fused) {
    EXPECT_EQ(fused.decode_pair_tokens(), 4) << fused.decode_limit().value_or("");
    for (std::int64_t tokens : {1, 4}) EXPECT_EQ(fused.decode_resident_blocks(tokens), 2);
    EXPECT_EQ(fused.decode_resident_blocks(5), 1);
    EXPECT_EQ(fused.decode_resident_blocks(16), 1);
    EXPECT_EQ(fused.kernel_for(4), lmoe::cuda::FusedKernel::decode);
  });
  with(kK3, nullptr, nullptr, [](const lmoe::cuda::FusedTail& fused) {
    EXPECT_EQ(fused.decode_pair_tokens(), 0);
    EXPECT_EQ(fused.decode_resident_blocks(1), 1);
  });
  for (const auto& [pair, programmatic] : {std::pair<const char*, const char*>{"0", nullptr},
                                           std::pair<const char*, const char*>{nullptr, "0"}}) {
    with(stripe, pair, programmatic, [](const lmoe::cuda::FusedTail& fused) {
      EXPECT_EQ(fused.decode_pair_tokens(), 0);
      EXPECT_EQ(fused.decode_resident_blocks(1), 1);
    });
  }
  soak_graph_replays(1, 4, {1, 4, 3, 2}, lmoe::cuda::FusedKernel::decode);
}

// The launcher refuses what no instance of the kernel can take, before anything reaches the device
// (without its checks these calls would launch a kernel on null pointers): a bound of 0 or above
// 16 rows, no grid, f32, and the pair instance with several ranks (its exchange is compiled out:
// FusedTail plans it at one rank only). No GPU needed; CI runs it.
TEST(FusedDecodeLaunch, CallsNoInstanceCanTakeAreRefusedBeforeTheDevice) {
  lmoe::cuda::FusedDecodeParams p;
  p.rows = 896;
  p.l = 3584;
  lmoe::cuda::FusedDecodePlan plan;
  plan.grid = 112;
  const auto launch = [&](std::int64_t max_tokens, DType dtype) {
    return lmoe::cuda::launch_fused_decode(p, max_tokens, dtype, plan, nullptr);
  };
  EXPECT_EQ(launch(0, DType::bf16), cudaErrorInvalidValue);
  EXPECT_EQ(launch(lmoe::cuda::kFusedDecodeMaxTokens + 1, DType::bf16), cudaErrorInvalidValue);
  EXPECT_EQ(launch(4, DType::f32), cudaErrorInvalidValue);
  plan.grid = 0;
  EXPECT_EQ(launch(4, DType::bf16), cudaErrorInvalidValue);
  plan.grid = 112;
  plan.pair_tokens = lmoe::cuda::kFusedDecodePairTokens;
  p.programmatic = true;
  p.protocol.tp = 2;
  EXPECT_EQ(launch(4, DType::bf16), cudaErrorInvalidValue);
  EXPECT_EQ(launch(1, DType::f16), cudaErrorInvalidValue);
}

// Which kernel a call runs, at every bound ±1 (fused_kernel_for: FusedTail::kernel_for with the
// bounds its plans agreed on; docs/fused.md, "At a glance"). No GPU needed; CI runs it.
TEST(FusedKernelFor, EachPathTakesTheCallsUpToItsBoundAndNoMore) {
  using lmoe::cuda::fused_kernel_for;
  using lmoe::cuda::FusedKernel;
  struct Case {
    const char* where;
    int tp;
    std::int64_t decode_max, pair_tokens, chained_max;
    std::vector<std::pair<std::int64_t, FusedKernel>> calls;
  };
  const FusedKernel decode = FusedKernel::decode, chained = FusedKernel::chained,
                    general = FusedKernel::general;
  // clang-format off
  const std::vector<Case> cases = {
      {"compute 9.0, one rank, the pair instance (a narrow stripe)", 1, 16, 4, 128,
       {{0, general}, {1, decode}, {4, decode}, {5, chained}, {128, chained}, {129, general}, {256, general}}},
      {"compute 9.0, one rank, no pair instance (K3)", 1, 16, 0, 128,
       {{1, chained}, {16, chained}, {128, chained}, {129, general}}},
      {"compute 9.0, one rank, the pair's bound above the decode plan's", 1, 2, 4, 128,
       {{2, decode}, {3, chained}}},
      {"compute 9.0, 2 ranks", 2, 16, 0, 128,
       {{1, decode}, {4, decode}, {5, chained}, {128, chained}, {129, general}}},
      {"compute 9.0, 7 ranks", 7, 16, 0, 128, {{4, decode}, {5, chained}}},
      {"compute 9.0, 8 ranks", 8, 16, 0, 128,
       {{16, decode}, {17, chained}, {128, chained}, {129, general}}},
      {"compute 9.0, 8 ranks, the decode plan stops at 8 rows", 8, 8, 0, 128,
       {{8, decode}, {9, chained}}},
      {"compute 9.0, 2 ranks, a workspace of 64 rows", 2, 16, 0, 64,
       {{4, decode}, {64, chained}, {65, general}}},
      {"no chained path (sm_100), one rank", 1, 16, 4, 0, {{16, decode}, {17, general}, {256, general}}},
      {"no chained path (sm_100), 8 ranks", 8, 16, 0, 0, {{1, decode}, {16, decode}, {17, general}}},
      {"the decode kernel off", 2, 0, 0, 128, {{1, chained}, {128, chained}, {129, general}}},
      {"both off", 1, 0, 0, 0, {{1, general}, {16, general}, {256, general}}},
  };
  // clang-format on
  for (const Case& c : cases) {
    for (const auto& [tokens, kernel] : c.calls) {
      EXPECT_EQ(fused_kernel_for(tokens, c.tp, c.decode_max, c.pair_tokens, c.chained_max), kernel)
          << c.where << ", T = " << tokens;
    }
  }
}

// The decode kernel launched programmatically with several ranks, one per GPU
// (LMOE_FUSED_DECODE_PROGRAMMATIC=1, the chained path off so that it takes every T ≤ 16): K3's
// stripes, random and crafted inputs at T = 1, 4, 16, then a soak of graph replays with T changing
// on the device. tp 2, and 4 and 8 where there are as many GPUs.
TEST_F(Fused, DecodeLaunchedProgrammaticallyAcrossGpusMeetsTheContract) {
  SKIP_WITH_FEWER_GPUS_THAN(2, "needs a GPU per rank");
  int gpus = 0;
  cuda_ok(cudaGetDeviceCount(&gpus));
  const ScopedEnv programmatic("LMOE_FUSED_DECODE_PROGRAMMATIC", "1");
  const ScopedEnv decode_on("LMOE_FUSED_DECODE", "1");
  const ScopedEnv chained_off("LMOE_FUSED_CHAINED", "0");
  for (const int tp : {2, 4, 8}) {
    if (tp > gpus || lmoe::comm_group_limit("p2p", tp)) continue;
    double worst = 0;
    for (const std::int64_t tokens : {1, 4, 16}) {
      SCOPED_TRACE("tp=" + std::to_string(tp) + " T=" + std::to_string(tokens));
      expect_random_and_crafted_inputs_pass(kK3, DType::bf16, tp, tokens,
                                            71u + static_cast<std::uint64_t>(tokens), &worst);
    }
    soak_graph_replays(tp, 16, {1, 16, 4, 9}, lmoe::cuda::FusedKernel::decode);
    std::printf(
        "[ fused  ] decode launched programmatically, K3 tp=%d T 1/4/16 max_err/bound=%.3f\n", tp,
        worst);
  }
}

// LMOE_FUSED_DECODE: unset or 1, the decode kernel runs with one rank and with several; 0 turns it
// off everywhere, and the limit says why.
TEST_F(Fused, DecodeKernelRunsByDefaultAtEveryTpAndCanBeTurnedOff) {
  SKIP_WITHOUT_GPU();
  const auto decode_bound = [](int tp, std::string* why) {
    const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, tp, 4, 42u);
    std::vector<std::int64_t> bounds(static_cast<std::size_t>(tp));
    const auto comms = lmoe::make_p2p_thread_communicators(tp, {});
    lmoe::run_on_rank_threads(comms, [&](int rank, lmoe::Communicator& comm) {
      FusedRank state(comm, c, 4);
      bounds[static_cast<std::size_t>(rank)] = state.fused->decode_max_tokens();
      if (rank == 0) *why = state.fused->decode_limit().value_or("");
      // T = 1 runs it where it runs, unless the chained path takes T = 1 (one rank on compute 9.0
      // where the pair instance does not run).
      const bool chained_takes_one = state.fused->chained_max_tokens() > 0 &&
                                     std::max(lmoe::cuda::fused_decode_beside_chained_tokens(tp),
                                              state.fused->decode_pair_tokens()) < 1;
      EXPECT_EQ(state.fused->kernel_for(1) == lmoe::cuda::FusedKernel::decode,
                bounds[static_cast<std::size_t>(rank)] > 0 && !chained_takes_one);
    });
    for (std::int64_t b : bounds) EXPECT_EQ(b, bounds[0]);
    return bounds[0];
  };
  std::string why;
  for (const char* on : {static_cast<const char*>(nullptr), "1"}) {
    const ScopedEnv set("LMOE_FUSED_DECODE", on);
    for (int tp : {1, 2}) {
      if (tp > 1 && lmoe::comm_group_limit("p2p", tp)) continue;
      EXPECT_EQ(decode_bound(tp, &why), 4) << "tp=" << tp << ": " << why;
    }
  }
  {
    const ScopedEnv off("LMOE_FUSED_DECODE", "0");
    for (int tp : {1, 2}) {
      if (tp > 1 && lmoe::comm_group_limit("p2p", tp)) continue;
      EXPECT_EQ(decode_bound(tp, &why), 0) << "tp=" << tp;
      EXPECT_NE(why.find("LMOE_FUSED_DECODE=0"), std::string::npos) << why;
    }
  }
  {
    // Read as a flag: anything but 1/0, true/false, yes/no, on/off is an error naming it.
    const ScopedEnv bad("LMOE_FUSED_DECODE", "maybe");
    try {
      decode_bound(1, &why);
      ADD_FAILURE() << "LMOE_FUSED_DECODE=maybe was accepted";
    } catch (const lmoe::Error& error) {
      EXPECT_NE(error.message().find("LMOE_FUSED_DECODE='maybe'"), std::string::npos)
          << error.message();
    }
  }
}

// A latent too long for 16 normalized rows next to the weight rings in a block's shared memory
// (l = 4480: 246,272 bytes, more than any device's 227-228 KiB) but not for 8 (230,400 bytes, 225
// KiB): the decode kernel
// takes calls of up to 8 rows and says why not 16; 8 and 9 rows meet the contract (9 through the
// general kernel).
TEST_F(Fused, DecodeStopsAt8RowsWhere16NormalizedRowsDoNotFit) {
  SKIP_WITHOUT_GPU();
  const ScopedEnv chained_off("LMOE_FUSED_CHAINED", "0");  // one rank: decode up to its bound
  const lmoe::TailDims dims{64, 4480};
  const lmoe::TailCase c = lmoe::make_random_case(dims, 1e-5f, DType::bf16, 1, 9, 17u);
  const auto comms = lmoe::make_p2p_thread_communicators(1, {});
  lmoe::run_on_rank_threads(comms, [&](int, lmoe::Communicator& comm) {
    FusedRank state(comm, c, 64);
    EXPECT_EQ(state.fused->decode_max_tokens(), 8);
    ASSERT_TRUE(state.fused->decode_limit().has_value());
    EXPECT_NE(state.fused->decode_limit()->find("do not fit in a block's shared memory"),
              std::string::npos)
        << *state.fused->decode_limit();
    EXPECT_EQ(state.fused->kernel_for(8), lmoe::cuda::FusedKernel::decode);
    EXPECT_EQ(state.fused->kernel_for(9), lmoe::cuda::FusedKernel::general);
  });
  double worst = 0;
  for (std::int64_t tokens : {8, 9}) {
    SCOPED_TRACE("T=" + std::to_string(tokens));
    expect_random_and_crafted_inputs_pass(dims, DType::bf16, 1, tokens,
                                          23u + static_cast<std::uint64_t>(tokens), &worst);
  }
  std::printf("[ fused  ] decode d=64 l=4480 T 8/9 max_err/bound=%.3f\n", worst);
}

// Around the bound (17 takes the general kernel), bf16 and f16, random inputs within the contract's
// bound and crafted inputs bit for bit; with and without the latent norm.
TEST_F(Fused, DecodeAroundItsBoundMeetsTheContractWithAndWithoutTheNorm) {
  SKIP_WITHOUT_GPU();
  const ScopedEnv chained_off("LMOE_FUSED_CHAINED", "0");  // one rank: decode up to its bound
  for (bool latent_norm : {true, false}) {
    for (DType dtype : {DType::bf16, DType::f16}) {
      double worst = 0;
      for (std::int64_t tokens : {1, 2, 5, 8, 15, 16, 17}) {
        SCOPED_TRACE(std::string(lmoe::dtype_name(dtype)) + " T=" + std::to_string(tokens) +
                     (latent_norm ? "" : " no norm"));
        const auto seed = 13u * static_cast<std::uint64_t>(tokens) + (latent_norm ? 0u : 7u);
        lmoe::TailCase random = lmoe::make_random_case(kSmall, 1e-5f, dtype, 1, tokens, seed);
        random.latent_norm = latent_norm;
        expect_meets_contract(random, run_fused(random), &worst);
        lmoe::TailCase exact = lmoe::make_exact_case(kSmall, dtype, 1, tokens, seed);
        exact.latent_norm = latent_norm;
        expect_crafted_inputs_match_bit_for_bit(exact);  // one rank: identical trivially
      }
      std::printf("[ fused  ] decode tp=1 %-4s T 1…17 norm=%d max_err/bound=%.3f\n",
                  std::string(lmoe::dtype_name(dtype)).c_str(), latent_norm ? 1 : 0, worst);
    }
  }
}

// Odd shapes: d = 40, l = 48 (5 groups of 8 rows over 5 blocks; 2 steps of 32 of K, the second
// half past l, so 14 of the 16 warps have no K, and in that half step lanes q = 2, 3 of every row
// copy nothing),
// and d = 3176, l = 560 (397 groups over up to one block per SM: 3 or 4 each on 132 SMs; 18 steps,
// 1 or 2 per warp, the last half past l).
TEST_F(Fused, DecodeSmallOddShapes) {
  SKIP_WITHOUT_GPU();
  const ScopedEnv chained_off("LMOE_FUSED_CHAINED", "0");  // one rank: decode up to its bound
  double worst = 0;
  for (const lmoe::TailDims dims : {lmoe::TailDims{40, 48}, lmoe::TailDims{3176, 560}}) {
    for (DType dtype : {DType::bf16, DType::f16}) {
      for (std::int64_t tokens : {1, 3, 9, 16}) {
        SCOPED_TRACE("d=" + std::to_string(dims.d_model) + " l=" + std::to_string(dims.d_latent) +
                     " " + std::string(lmoe::dtype_name(dtype)) + " T=" + std::to_string(tokens));
        expect_random_and_crafted_inputs_pass(dims, dtype, 1, tokens,
                                              3u * static_cast<std::uint64_t>(tokens), &worst);
      }
    }
  }
  std::printf("[ fused  ] decode d=40 l=48 and d=3176 l=560 max_err/bound=%.3f\n", worst);
}

// The most groups of 8 rows of w_up a block takes (kDecodeMaxGroups = 8; their accumulators are
// registers): d = 64 · SMs puts exactly 8 on every block (K3 has 6 or 7 on 132 SMs) and meets the
// contract; one group more, d = 8 · (8 · SMs + 1), is declined with the reason (the general kernel
// runs it).
TEST_F(Fused, DecodeTakesEightGroupsPerSmAndDeclinesNine) {
  SKIP_WITHOUT_GPU();
  const ScopedEnv chained_off("LMOE_FUSED_CHAINED", "0");  // one rank: decode up to its bound
  int device = 0, sms = 0;
  cuda_ok(cudaGetDevice(&device));
  cuda_ok(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const lmoe::TailDims eight{64 * static_cast<std::int64_t>(sms), 64};
  const lmoe::TailDims nine{8 * (8 * static_cast<std::int64_t>(sms) + 1), 64};
  const auto comms = lmoe::make_p2p_thread_communicators(1, {});
  lmoe::run_on_rank_threads(comms, [&](int, lmoe::Communicator& comm) {
    FusedRank takes(comm, lmoe::make_random_case(eight, 1e-5f, DType::bf16, 1, 16, 5u), 16);
    EXPECT_EQ(takes.fused->decode_max_tokens(), 16) << takes.fused->decode_limit().value_or("");
    FusedRank declines(comm, lmoe::make_random_case(nine, 1e-5f, DType::bf16, 1, 16, 6u), 16);
    EXPECT_EQ(declines.fused->decode_max_tokens(), 0);
    ASSERT_TRUE(declines.fused->decode_limit().has_value());
    EXPECT_NE(declines.fused->decode_limit()->find("at most 8 groups"), std::string::npos)
        << *declines.fused->decode_limit();
  });
  // The policy asks the same question (fused_decode_limit): fused up to 6 tokens at tp 1 where the
  // decode kernel runs, 0 with the reason where it does not.
  EXPECT_FALSE(lmoe::fused_decode_limit(eight, DType::bf16).has_value());
  const std::optional<std::string> limit = lmoe::fused_decode_limit(nine, DType::bf16);
  ASSERT_TRUE(limit.has_value());
  EXPECT_NE(limit->find("at most 8 groups"), std::string::npos) << *limit;
  const lmoe::PolicyConfig built_in = lmoe::load_policy_config(
      [](const std::string&) -> std::optional<std::string> { return std::nullopt; });
  EXPECT_EQ(lmoe::with_rank_defaults(built_in, lmoe::Backend::cuda, 1, eight, DType::bf16)
                .fused_max_tokens.value,
            lmoe::kFusedDefaultTp1Tokens);
  EXPECT_EQ(lmoe::with_rank_defaults(built_in, lmoe::Backend::cuda, 1, nine, DType::bf16)
                .fused_max_tokens.value,
            0);
  // With several ranks it asks about one rank's stripe (d / tp rows) and 16 rows (the chained
  // path, turned off in this test, would give its own range).
  EXPECT_FALSE(lmoe::fused_decode_limit(eight, DType::bf16, 2).has_value());
  EXPECT_EQ(lmoe::with_rank_defaults(built_in, lmoe::Backend::cuda, 2, kK3, DType::bf16)
                .fused_max_tokens.value,
            lmoe::kFusedDefaultDecodeTokens);
  double worst = 0;
  for (std::int64_t tokens : {1, 9, 16}) {
    SCOPED_TRACE("d=" + std::to_string(eight.d_model) + " T=" + std::to_string(tokens));
    expect_random_and_crafted_inputs_pass(eight, DType::bf16, 1, tokens,
                                          71u + static_cast<std::uint64_t>(tokens), &worst);
  }
  std::printf("[ fused  ] decode d=%lld (8 groups per SM) max_err/bound=%.3f\n",
              static_cast<long long>(eight.d_model), worst);
}

// K3 dims, for bounds of 16 and 8 rows (the kernel's two shapes): an eager call of that many rows
// against the contract, then one graph captured for up to that many rows with T on the device,
// replayed with T changing between replays. Rows are independent, so each
// replay's first T rows must equal the eager call's bit for bit, and the rows after them must stay
// as poisoned before the replay.
TEST_F(Fused, DecodeK3EagerAndGraphReplaysWithTOnTheDevice) {
  SKIP_WITHOUT_GPU();
  const ScopedEnv chained_off("LMOE_FUSED_CHAINED", "0");  // one rank: decode up to its bound
  const std::int64_t d = kK3.d_model;
  // Both shapes of the kernel: a bound of 16 rows, and of 8 (the policy's tp-1 default).
  for (const std::int64_t max_tokens : {std::int64_t{16}, std::int64_t{8}}) {
    const std::vector<std::int32_t> replays =
        max_tokens == 16 ? std::vector<std::int32_t>{16, 1, 7, 16, 3, 12, 2}
                         : std::vector<std::int32_t>{8, 1, 7, 8, 3, 5, 2};
    for (DType dtype : {DType::bf16, DType::f16}) {
      SCOPED_TRACE(std::string(lmoe::dtype_name(dtype)) + " bound " + std::to_string(max_tokens));
      const lmoe::TailCase c = lmoe::make_random_case(kK3, 1e-5f, dtype, 1, max_tokens, 99u);
      const std::size_t esize = lmoe::dtype_size(dtype),
                        row_bytes = static_cast<std::size_t>(d) * esize;
      const auto comms = lmoe::make_p2p_thread_communicators(1, {});
      lmoe::run_on_rank_threads(comms, [&](int, lmoe::Communicator& comm) {
        FusedRank state(comm, c, max_tokens);
        ASSERT_EQ(state.fused->kernel_for(max_tokens), lmoe::cuda::FusedKernel::decode)
            << state.fused->decode_limit().value_or("");
        cudaStream_t stream = nullptr;
        cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        cuda_ok(cudaMemsetAsync(state.out.data(), 0xff, max_tokens * row_bytes, stream));
        state.fused->run(state.routed.data(), state.shared.data(), state.out.data(), max_tokens,
                         stream);
        lmoe::HostTensor eager(dtype, {max_tokens, d});
        cuda_ok(cudaMemcpyAsync(eager.data(), state.out.data(), max_tokens * row_bytes,
                                cudaMemcpyDeviceToHost, stream));
        cuda_ok(cudaStreamSynchronize(stream));
        const lmoe::Comparison cmp = lmoe::compare(
            eager.matrix(), lmoe::reference_tail(c, lmoe::contract_of(TailTier::fused)),
            lmoe::exact_tail(c));
        EXPECT_EQ(cmp.beyond_bound, 0) << "max err/bound " << cmp.max_error_over_bound;
        EXPECT_LE(cmp.normwise_error, cmp.normwise_tolerance);
        std::printf("[ fused  ] decode K3 %s T=%lld eager max_err/bound=%.3f\n",
                    std::string(lmoe::dtype_name(dtype)).c_str(),
                    static_cast<long long>(max_tokens), cmp.max_error_over_bound);

        DeviceBuffer tokens_now(sizeof(std::int32_t));
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        capture_fused_call(state, max_tokens, tokens_now.data(), stream, &graph, &exec);
        std::vector<std::byte> got(max_tokens * row_bytes);
        for (std::int32_t tokens : replays) {
          SCOPED_TRACE("graph T=" + std::to_string(tokens));
          cuda_ok(cudaMemcpyAsync(tokens_now.data(), &tokens, sizeof(tokens),
                                  cudaMemcpyHostToDevice, stream));
          cuda_ok(cudaMemsetAsync(state.out.data(), 0xff, max_tokens * row_bytes, stream));
          cuda_ok(cudaGraphLaunch(exec, stream));
          cuda_ok(cudaMemcpyAsync(got.data(), state.out.data(), got.size(), cudaMemcpyDeviceToHost,
                                  stream));
          cuda_ok(cudaStreamSynchronize(stream));
          const std::size_t used = static_cast<std::size_t>(tokens) * row_bytes;
          EXPECT_EQ(std::memcmp(got.data(), eager.data(), used), 0);
          std::size_t untouched = 0;
          for (std::size_t i = used; i < got.size(); ++i) untouched += got[i] == std::byte{0xff};
          EXPECT_EQ(untouched, got.size() - used);
        }
        EXPECT_EQ(state.fused->general_calls(), 0u);  // every call above ran the decode kernel
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
        cudaStreamDestroy(stream);
      });
    }
  }
}

// K3 dims with several ranks through the decode kernel (tp 2: 448 groups of the stripe, tp 8: 112,
// over the blocks the ranks sharing this GPU split; the chained path off, which would take T = 16
// at tp 2), T = 1 and 16, random inputs within the contract's bound and crafted inputs bit for bit
// (through LatentTail, as a model calls it).
TEST_F(Fused, DecodeK3WithSeveralRanksMeetsTheContract) {
  SKIP_WITHOUT_GPU();
  const ScopedEnv decode_on("LMOE_FUSED_DECODE", "1");     // whatever the environment says
  const ScopedEnv chained_off("LMOE_FUSED_CHAINED", "0");  // the decode kernel up to 16 rows
  for (int tp : {2, 8}) {
    if (lmoe::comm_group_limit("p2p", tp)) continue;
    double worst = 0;
    for (std::int64_t tokens : {1, 16}) {
      SCOPED_TRACE("tp=" + std::to_string(tp) + " T=" + std::to_string(tokens));
      expect_random_and_crafted_inputs_pass(kK3, DType::bf16, tp, tokens,
                                            61u + static_cast<std::uint64_t>(tokens), &worst);
    }
    std::printf("[ fused  ] decode K3 tp=%d T 1/16 max_err/bound=%.3f\n", tp, worst);
  }
}

// The same for the decode kernel (a graph bounded by 16 rows): with one rank, whose blocks share
// nothing, and with two, through the protocol.
TEST_F(Fused, DecodeSoakOfGraphReplaysWithChangingTAndInputsHasNoMismatch) {
  SKIP_WITHOUT_GPU();
  const ScopedEnv chained_off("LMOE_FUSED_CHAINED", "0");  // one rank: decode up to its bound
  soak_graph_replays(1, 16, {1, 16, 9, 5}, lmoe::cuda::FusedKernel::decode);
  if (lmoe::comm_group_limit("p2p", 2)) GTEST_SKIP() << "p2p with 2 ranks cannot run here";
  const ScopedEnv decode_on("LMOE_FUSED_DECODE", "1");  // whatever the environment says
  soak_graph_replays(2, 16, {1, 16, 9, 5}, lmoe::cuda::FusedKernel::decode);
}

// What the LL lines' soak saw on each rank.
struct LlSoakResult {
  std::vector<unsigned long long> taken, wrong;  // lines taken, and those with the wrong data
  std::vector<std::string> errors;               // a failed wait's error ("" for none)
};

// Lines of the soak's calls: the soak kernel's 1024 threads (launch_fused_ll_soak) stride over
// them, so threads 768 … 1023 start in the second half. A stride that divided the half would have
// every thread take a first-half line (which waits for the late sender) before its second-half
// one, and the second half's flags would then almost never be polled before they are written.
constexpr std::int64_t kLlSoakLines = 1536;

// `calls` calls of the decode kernel's line exchange alone (tools/cuda/fused_ll_soak.hpp) on tp
// p2p ranks, from epoch `first_epoch`, the second half of the lines first used at call
// `widen_at`, the late sender of every call waiting `late_ns`. Each rank's lines start as the
// fused tier starts them (start_ll_lines), or with `flags_as_tier_starts` false, every byte 0.
LlSoakResult run_ll_soak(int tp, std::uint32_t first_epoch, std::int64_t calls,
                         std::int64_t widen_at, std::uint64_t late_ns, bool flags_as_tier_starts) {
  constexpr std::int64_t kLines = kLlSoakLines;
  constexpr std::int64_t kCallsPerLaunch = 8192;  // launches follow each other; epochs go on
  const std::int64_t parity_bytes = lmoe::cuda::fused_ll_soak_parity_bytes(tp, kLines);
  LlSoakResult result;
  result.taken.assign(static_cast<std::size_t>(tp), 0);
  result.wrong.assign(static_cast<std::size_t>(tp), ~0ull);
  result.errors.resize(static_cast<std::size_t>(tp));
  lmoe::P2pOptions options;
  options.timeout = std::chrono::milliseconds(5000);
  lmoe::run_on_p2p_threads(
      tp,
      [&](int rank, lmoe::Communicator& comm) {
        auto* peers = dynamic_cast<lmoe::P2pPeerAccess*>(&comm);
        ASSERT_NE(peers, nullptr);
        const auto lines = peers->share_buffer(static_cast<std::size_t>(2 * parity_bytes));
        std::byte* own = lines->base(rank);
        if (flags_as_tier_starts) {
          cuda_ok(lmoe::cuda::start_ll_lines(own, parity_bytes));
        } else {
          cuda_ok(cudaMemset(own, 0, static_cast<std::size_t>(2 * parity_bytes)));
        }
        const DeviceBuffer counters(2 * sizeof(unsigned long long));  // taken, wrong
        cudaStream_t stream = nullptr;
        cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        cuda_ok(cudaMemsetAsync(counters.data(), 0, counters.bytes(), stream));
        cuda_ok(cudaDeviceSynchronize());
        comm.barrier();  // every rank's lines have started before any rank sends
        lmoe::cuda::FusedLlSoak soak;
        soak.rank = rank;
        soak.tp = tp;
        for (int r = 0; r < tp; ++r) soak.regions[r] = lines->base(r);
        soak.lines = kLines;
        soak.parity_bytes = parity_bytes;
        soak.first_epoch = first_epoch;
        soak.widen_at = widen_at;
        soak.seed = 0x6c6c2d736f616bull ^ first_epoch;
        soak.late_sender_ns = late_ns;
        const lmoe::cuda::P2pDeviceHandle handle = peers->device_handle();
        soak.status = handle.status;
        soak.abort_flag = handle.abort_flag;
        soak.timeout_ns = handle.timeout_ns;
        soak.taken = static_cast<unsigned long long*>(counters.data());
        soak.wrong = soak.taken + 1;
        for (std::int64_t first = 0; first < calls; first += kCallsPerLaunch) {
          soak.first_call = first;
          soak.calls = static_cast<int>(std::min(kCallsPerLaunch, calls - first));
          cuda_ok(lmoe::cuda::launch_fused_ll_soak(soak, stream));
        }
        cuda_ok(cudaStreamSynchronize(stream));
        try {
          comm.barrier();  // raises what a failed wait recorded
        } catch (const lmoe::Error& error) {
          result.errors[static_cast<std::size_t>(rank)] = error.message();
        }
        unsigned long long counted[2] = {};
        cuda_ok(cudaMemcpy(counted, counters.data(), sizeof(counted), cudaMemcpyDeviceToHost));
        result.taken[static_cast<std::size_t>(rank)] = counted[0];
        result.wrong[static_cast<std::size_t>(rank)] = counted[1];
        cudaStreamDestroy(stream);
      },
      options);
  return result;
}

// The decode kernel's LL lines (fused_ll.cuh) alone, between ranks sharing the GPU: call after
// call every rank sends its peers 768 … 1536 lines whose payloads change every call (−0,
// subnormal and NaN bit patterns and data equal to a flag among them), takes theirs one by one or
// four at once, and checks every line's data; in every call one rank sends late, so its peers
// poll lines it has not written yet. From epoch 1 (as a FusedTail starts) and from just below the
// epochs' wrap, so that calls of epochs 2^32 − 2, 2^32 − 1, 0, 1 … run; in both, the second half
// of the lines is first used halfway through (at epoch 0 across the wrap), where only the flags
// they started with keep a receiver from taking them early. The calls are
// LMOE_FUSED_SOAK_REPLAYS (100000 unless set). The epoch a FusedTail's calls use lives in its
// workspace's flags, which no caller can set, hence the exchange alone with epochs of the test's
// choosing.
TEST_F(Fused, LlLinesCarryChangingPayloadsAcrossTheEpochsWrap) {
  SKIP_WITHOUT_GPU();
  const std::int64_t calls = soak_replays("LMOE_FUSED_SOAK_REPLAYS", 100000);
  ASSERT_GE(calls, 8) << "LMOE_FUSED_SOAK_REPLAYS";
  bool ran = false;
  for (const int tp : {2, 4}) {
    if (lmoe::comm_group_limit("p2p", tp)) continue;
    ran = true;
    for (const std::uint32_t first_epoch : {1u, 0u - static_cast<std::uint32_t>(calls / 2)}) {
      SCOPED_TRACE("tp=" + std::to_string(tp) + " first epoch " + std::to_string(first_epoch));
      const LlSoakResult result = run_ll_soak(tp, first_epoch, calls, calls / 2, 2000, true);
      for (int r = 0; r < tp; ++r) {
        const auto rank = static_cast<std::size_t>(r);
        EXPECT_EQ(result.errors[rank], "") << "rank " << r;
        EXPECT_EQ(result.wrong[rank], 0ull) << "rank " << r;
        // Every call takes at least half the lines from every peer.
        EXPECT_GE(result.taken[rank], static_cast<unsigned long long>(calls) * (kLlSoakLines / 2) *
                                          static_cast<unsigned long long>(tp - 1))
            << "rank " << r;
      }
      std::printf(
          "[ fused  ] LL lines: %lld calls, tp=%d, from epoch %u: %llu lines taken by "
          "rank 0, %llu wrong\n",
          static_cast<long long>(calls), tp, first_epoch, result.taken[0], result.wrong[0]);
    }
  }
  if (!ran) GTEST_SKIP() << *lmoe::comm_group_limit("p2p", 2);
}

// The soak above can fail: lines whose flags all start at 0 carry the epoch the call of epoch 0
// waits for before anyone wrote them, so across the wrap a receiver takes a late sender's fresh
// lines early, with the wrong data.
TEST_F(Fused, LlLinesWhoseFlagsStartAtZeroAreTakenEarlyAtEpochZero) {
  SKIP_WITHOUT_GPU();
  if (lmoe::comm_group_limit("p2p", 2)) GTEST_SKIP() << *lmoe::comm_group_limit("p2p", 2);
  const LlSoakResult result = run_ll_soak(2, 0u - 16u, 64, 16, 50000, false);
  EXPECT_GT(result.wrong[0] + result.wrong[1], 0ull)
      << "no line was taken before its sender wrote it";
}

// Rows whose latent has one nonzero element (so every output element is one product of the
// up-projection: exact in any order, and the contract's bits are every implementation's), with
// −0 and subnormals where the decode kernel's exchange carries them. Row t: its element
// (37 t + 5) mod l is the sum of subnormal partials (t ≡ 0 mod 3) or 1.5 (t ≡ 1), or the row has
// none (t ≡ 2: U = +0); every other element sums to ±0 from −0, +0 and cancelling subnormal
// partials. `shared`'s partials by column: all −0 (the sum stays −0 only from rank 0's value), −0
// and +0, subnormals, cancelling subnormals, small integers. w_up's rows by i mod 4: 1, −0.75,
// 0.5, and (f16) −2^-14, whose product with a subnormal row's N rounds to −0 in f16, so that
// Y = −0 + (−0) shows whether the shared sum kept its sign. (In bf16, whose range is fp32's, U
// would have to be an fp32 subnormal to round to −0: −1.25 there.) The rows depend on t alone, so
// the case of T rows is the first T rows of a larger one.
lmoe::TailCase signed_zero_and_subnormal_case(DType dtype, int tp, std::int64_t tokens) {
  lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, dtype, tp, tokens, 1u);
  const std::int64_t l = kSmall.d_latent, d = kSmall.d_model;
  const bool bf16 = dtype == DType::bf16;
  const float latent_tiny = bf16 ? std::ldexp(1.0f, -130) : std::ldexp(1.0f, -22);  // subnormal
  const float shared_tiny = bf16 ? std::ldexp(1.0f, -133) : std::ldexp(1.0f, -24);  // the least
  for (int r = 0; r < tp; ++r) {
    for (std::int64_t t = 0; t < tokens; ++t) {
      const std::int64_t nonzero = (37 * t + 5) % l;
      for (std::int64_t j = 0; j < l; ++j) {
        float v = -0.0f;
        if (j == nonzero && t % 3 == 0) {
          v = r == 0 ? 2 * latent_tiny : r == 1 ? latent_tiny : -0.0f;
        } else if (j == nonzero && t % 3 == 1) {
          v = r == 0 ? 1.5f : -0.0f;
        } else if ((t * l + j) % 3 == 1) {
          v = r == 0 ? latent_tiny : r == 1 ? -latent_tiny : -0.0f;
        } else if ((t * l + j) % 3 == 2) {
          v = r == 1 ? 0.0f : -0.0f;
        }
        c.routed.set((r * tokens + t) * l + j, v);
      }
      for (std::int64_t i = 0; i < d; ++i) {
        const float by_column[5] = {-0.0f, r == 1 ? 0.0f : -0.0f,
                                    static_cast<float>(r + 1) * shared_tiny,
                                    r == 0   ? shared_tiny
                                    : r == 1 ? -shared_tiny
                                             : -0.0f,
                                    static_cast<float>(r - 1)};
        c.shared.set((r * tokens + t) * d + i, by_column[i % 5]);
      }
    }
  }
  for (std::int64_t j = 0; j < l; ++j) c.norm_weight.set(j, 1.0f);
  const float by_row[4] = {1.0f, -0.75f, 0.5f, bf16 ? -1.25f : -std::ldexp(1.0f, -14)};
  for (std::int64_t i = 0; i < d * l; ++i) c.up_proj_weight.set(i, by_row[i / l % 4]);
  return c;
}

// −0 and subnormals through the decode kernel's exchange (latent partials, shared columns and
// output stripes as LL lines; rank sums from rank 0's value), at tp 2 and 4, bf16 and f16, every
// T up to the decode kernel's bound here from 1 (the fewest rows: every block sums and normalizes
// them itself; more: the rows shared out over the blocks): every rank's output bit for bit the CPU
// contract's (signed_zero_and_subnormal_case), and the contract's output holds −0 (f16), subnormals
// and values that only a subnormal latent gives, so the check sees them. f32 is not a fused dtype
// (its signed zeros and subnormals through the p2p collectives:
// P2p.KeepsNegativeZeroAndSubnormals).
TEST_F(Fused, DecodeExchangeKeepsNegativeZeroAndSubnormalsBitForBit) {
  SKIP_WITHOUT_GPU();
  EXPECT_TRUE(lmoe::cuda::FusedTail::problem_limit(kSmall, DType::f32, 2).has_value());
  const ScopedEnv decode_on("LMOE_FUSED_DECODE", "1");  // whatever the environment says
  constexpr std::int64_t kRows = 16;
  bool ran = false;
  for (const int tp : {2, 4}) {
    if (lmoe::comm_group_limit("p2p", tp)) continue;
    ran = true;
    for (const DType dtype : {DType::bf16, DType::f16}) {
      SCOPED_TRACE("tp=" + std::to_string(tp) + " " + std::string(lmoe::dtype_name(dtype)));
      const lmoe::TailCase largest = signed_zero_and_subnormal_case(dtype, tp, kRows);
      std::vector<std::int64_t> token_counts;  // T the decode kernel takes here (rank 0's)
      std::vector<std::vector<lmoe::HostTensor>> outputs(static_cast<std::size_t>(tp));
      const auto comms = lmoe::make_p2p_thread_communicators(tp);
      lmoe::run_on_rank_threads(comms, [&](int rank, lmoe::Communicator& comm) {
        FusedRank state(comm, largest, kRows);
        std::vector<std::int64_t> counts;
        for (const std::int64_t t : {1, 2, 3, 4, 5, 8, 16}) {
          if (state.fused->kernel_for(t) == lmoe::cuda::FusedKernel::decode) counts.push_back(t);
        }
        if (rank == 0) token_counts = counts;
        cudaStream_t stream = nullptr;
        cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        for (const std::int64_t t : counts) {
          cuda_ok(cudaMemsetAsync(state.out.data(), 0xff, state.out.bytes(), stream));
          cuda_ok(cudaStreamSynchronize(stream));
          comm.barrier();
          state.fused->run(state.routed.data(), state.shared.data(), state.out.data(), t, stream);
          cuda_ok(cudaStreamSynchronize(stream));
          comm.barrier();
          lmoe::HostTensor& y = outputs[static_cast<std::size_t>(rank)].emplace_back(
              dtype, std::vector<std::int64_t>{t, kSmall.d_model});
          cuda_ok(cudaMemcpy(y.data(), state.out.data(), y.nbytes(), cudaMemcpyDeviceToHost));
        }
        cudaStreamDestroy(stream);
      });
      ASSERT_FALSE(token_counts.empty()) << "the decode kernel takes no T here";
      std::int64_t negative_zeros = 0, subnormals = 0, from_subnormal_latents = 0;
      const float least_normal =
          dtype == DType::f16 ? std::ldexp(1.0f, -14) : std::ldexp(1.0f, -126);
      for (std::size_t k = 0; k < token_counts.size(); ++k) {
        const std::int64_t t = token_counts[k];
        SCOPED_TRACE("T=" + std::to_string(t));
        const lmoe::TailCase c = signed_zero_and_subnormal_case(dtype, tp, t);
        const auto reference = lmoe::reference_tail(c, lmoe::contract_of(TailTier::fused));
        const std::vector<double> exact = lmoe::exact_tail(c);
        for (int r = 0; r < tp; ++r) {
          ASSERT_EQ(outputs[static_cast<std::size_t>(r)].size(), token_counts.size());
          EXPECT_EQ(
              lmoe::compare(outputs[static_cast<std::size_t>(r)][k].matrix(), reference, exact)
                  .bit_mismatches,
              0)
              << "rank " << r;
        }
        for (std::int64_t i = 0; i < reference.y.numel(); ++i) {
          const float v = reference.y.get(i);
          negative_zeros += v == 0.0f && std::signbit(v);
          subnormals += v != 0.0f && std::fabs(v) < least_normal;
          from_subnormal_latents +=
              v != 0.0f && std::fabs(v) < 1e-30f && !(std::fabs(v) < least_normal);
        }
      }
      EXPECT_GT(subnormals, 0) << "the case must give subnormal outputs";
      if (dtype == DType::f16) {
        EXPECT_GT(negative_zeros, 0) << "the case must give −0 outputs";
      } else {
        EXPECT_GT(from_subnormal_latents, 0) << "the case must give outputs of subnormal latents";
      }
      std::printf(
          "[ fused  ] decode exchange tp=%d %s, T up to %lld: %lld −0, %lld subnormal "
          "outputs, bit for bit\n",
          tp, std::string(lmoe::dtype_name(dtype)).c_str(),
          static_cast<long long>(token_counts.back()), static_cast<long long>(negative_zeros),
          static_cast<long long>(subnormals));
    }
  }
  if (!ran) GTEST_SKIP() << *lmoe::comm_group_limit("p2p", 2);
}

}  // namespace

// The fused tier (cuda/fused_tail.cuh and the kernels it routes to) against the CPU contract, with
// its ranks sharing one GPU over the p2p communicator: every T of the issue (1 … 256, thresholds
// ±1), tp ∈ {1, 2, 4, 8}, bf16 and f16, random inputs within the contract's bound and crafted
// inputs bit for bit, ±0 and subnormals, graph replays with T read on the device (a soak of many
// replays with changing T and inputs), a stalled rank, two calls at once on one workspace, which
// kernel each call runs, the kernels taking turns on one workspace, and what it declines. The
// decode kernel's own tests: test_fused_decode.cpp; the chained path's: test_fused_chained.cpp.

#include "cuda/comm/p2p_group.hpp"
#include "fused_test_support.hpp"
#include "lmoe/cuda_communicator.hpp"
#include "tools/cuda/replay_soak.hpp"

namespace {

using namespace lmoe_fused_test;

class FusedParity : public ::testing::TestWithParam<std::tuple<int, DType>> {
 protected:
  static void SetUpTestSuite() { lmoe::cpu::set_blas_threads(4); }
  ScopedSharedGpu shared_gpu_;
};

TEST_P(FusedParity, TokenCountsAroundEveryPathsBoundMeetTheContractAndCraftedInputsMatchBits) {
  SKIP_WITHOUT_GPU();
  const auto [tp, dtype] = GetParam();
  if (tp > 1) {
    if (auto limit = lmoe::comm_group_limit("p2p", tp)) GTEST_SKIP() << *limit;
  }
  double worst = 0;
  for (std::int64_t tokens : kTokensAroundPathBounds) {
    SCOPED_TRACE("T=" + std::to_string(tokens));
    const auto seed = 31u * static_cast<std::uint64_t>(tokens) + static_cast<std::uint64_t>(tp);
    expect_random_and_crafted_inputs_pass(kSmall, dtype, tp, tokens, seed, &worst);
    if (tokens <=
        16) {  // the decode kernel's sizes through the chained path (or the general kernel)
      const ScopedEnv general_only("LMOE_FUSED_DECODE", "0");
      expect_random_and_crafted_inputs_pass(kSmall, dtype, tp, tokens, seed + 7u, &worst);
    }
    if (tokens <= 128) {  // the chained path's sizes through the general kernel too
      const ScopedEnv decode_off("LMOE_FUSED_DECODE", "0");
      const ScopedEnv chained_off("LMOE_FUSED_CHAINED", "0");
      expect_random_and_crafted_inputs_pass(kSmall, dtype, tp, tokens, seed + 13u, &worst);
    }
  }
  std::printf("[ fused  ] tp=%d %-4s T=1…256 (11 sizes) max_err/bound=%.3f\n", tp,
              std::string(lmoe::dtype_name(dtype)).c_str(), worst);
}

// The decode kernel with several ranks: every T it takes, random
// inputs within the contract's bound and crafted inputs bit for bit, with and without the norm.
TEST_P(FusedParity, DecodeKernelWithSeveralRanksMeetsTheContract) {
  SKIP_WITHOUT_GPU();
  const auto [tp, dtype] = GetParam();
  if (tp == 1) GTEST_SKIP() << "one rank: the decode tests below";
  if (auto limit = lmoe::comm_group_limit("p2p", tp)) GTEST_SKIP() << *limit;
  const ScopedEnv decode_on("LMOE_FUSED_DECODE", "1");  // whatever the environment says
  double worst = 0;
  for (bool latent_norm : {true, false}) {
    for (std::int64_t tokens : {1, 2, 5, 8, 15, 16}) {
      SCOPED_TRACE("T=" + std::to_string(tokens) + (latent_norm ? "" : " no norm"));
      const auto seed = 53u * static_cast<std::uint64_t>(tokens) + static_cast<std::uint64_t>(tp) +
                        (latent_norm ? 0u : 11u);
      lmoe::TailCase random = lmoe::make_random_case(kSmall, 1e-5f, dtype, tp, tokens, seed);
      random.latent_norm = latent_norm;
      expect_meets_contract(random, run_fused(random), &worst);
      lmoe::TailCase exact = lmoe::make_exact_case(kSmall, dtype, tp, tokens, seed);
      exact.latent_norm = latent_norm;
      expect_crafted_inputs_match_bit_for_bit(exact);
    }
  }
  std::printf("[ fused  ] decode tp=%d %-4s T 1…16 ±norm max_err/bound=%.3f\n", tp,
              std::string(lmoe::dtype_name(dtype)).c_str(), worst);
}

INSTANTIATE_TEST_SUITE_P(TpDtype, FusedParity,
                         ::testing::Combine(::testing::Values(1, 2, 4, 8),
                                            ::testing::Values(DType::bf16, DType::f16)),
                         [](const auto& info) {
                           return "tp" + std::to_string(std::get<0>(info.param)) + "_" +
                                  std::string(lmoe::dtype_name(std::get<1>(info.param)));
                         });

// The stripe product's edges: K not a multiple of its 64-wide chunks (the last chunk partly
// zero-filled), enough chunks for several splits of K (summed by each tile's last split), and
// stripes that end inside a 64-column tile (tp 2: 224 = 3 tiles + 32 columns, tp 4: 112 = 1 + 48).
TEST_F(Fused, KNotAMultipleOfTheChunkSplitKAndPartialColumnTiles) {
  SKIP_WITHOUT_GPU();
  const lmoe::TailDims dims{448, 528};  // l = 8 chunks of 64 + 16: up to 2 splits of K
  double worst = 0;
  for (int tp : {1, 2, 4}) {
    if (tp > 1 && lmoe::comm_group_limit("p2p", tp)) continue;
    for (std::int64_t tokens : {std::int64_t{1}, std::int64_t{17}, std::int64_t{129}}) {
      SCOPED_TRACE("tp=" + std::to_string(tp) + " T=" + std::to_string(tokens));
      const auto seed = 5u * static_cast<std::uint64_t>(tokens) + static_cast<std::uint64_t>(tp);
      expect_random_and_crafted_inputs_pass(dims, DType::bf16, tp, tokens, seed, &worst);
    }
  }
  std::printf("[ fused  ] d=448 l=528 tp 1/2/4 T 1/17/129 max_err/bound=%.3f\n", worst);
}

TEST_F(Fused, K3DimsEagerAndGraphReplays) {
  SKIP_WITHOUT_GPU();
  for (int tp : {1, 8}) {
    if (tp > 1 && lmoe::comm_group_limit("p2p", tp)) continue;
    for (std::int64_t tokens : {std::int64_t{1}, std::int64_t{16}, std::int64_t{128}}) {
      for (bool graph : {false, true}) {
        SCOPED_TRACE("tp=" + std::to_string(tp) + " T=" + std::to_string(tokens) +
                     (graph ? " graph" : " eager"));
        const lmoe::TailCase c = lmoe::make_random_case(kK3, 1e-5f, DType::bf16, tp, tokens,
                                                        77u + static_cast<std::uint64_t>(tokens));
        double worst = 0;
        expect_meets_contract(c, run_fused(c, graph), &worst);
        std::printf("[ fused  ] K3 tp=%d T=%lld %s max_err/bound=%.3f\n", tp,
                    static_cast<long long>(tokens), graph ? "graph" : "eager", worst);
      }
    }
  }
}

// Every routed partial zero (so N = 0 and U = +0) and shared partials that are −0 or subnormal:
// Y = round(+0 + round(Σ shared)) must keep subnormals (no flush) and give exactly what the
// contract's rank-order sum gives for −0 (starting from rank 0's value).
TEST_F(Fused, KeepsSubnormalsAndSignedZerosOfTheSharedSum) {
  SKIP_WITHOUT_GPU();
  for (int tp : {1, 2, 4}) {
    if (tp > 1 && lmoe::comm_group_limit("p2p", tp)) continue;
    for (DType dtype : {DType::bf16, DType::f16}) {
      lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, dtype, tp, 9, 5u);
      const float tiny =
          dtype == DType::bf16 ? std::ldexp(1.0f, -130) : std::ldexp(1.0f, -20);  // subnormal
      for (std::int64_t i = 0; i < c.routed.numel(); ++i) c.routed.set(i, 0.0f);
      for (std::int64_t i = 0; i < c.shared.numel(); ++i) {
        const std::int64_t r = i / (c.num_tokens * c.dims.d_model);
        c.shared.set(i,
                     i % 3 == 0 ? -0.0f : (i % 3 == 1 ? tiny * static_cast<float>(r + 1) : -tiny));
      }
      const lmoe::CaseRun result = run_fused(c);
      EXPECT_TRUE(result.ranks_identical);
      const auto reference = lmoe::reference_tail(c, lmoe::contract_of(TailTier::fused));
      const lmoe::Comparison cmp =
          lmoe::compare(result.ranks[0].y.matrix(), reference, lmoe::exact_tail(c));
      EXPECT_EQ(cmp.bit_mismatches, 0) << "tp=" << tp << " " << lmoe::dtype_name(dtype);
      std::int64_t subnormals = 0;
      const lmoe::HostTensor& y = result.ranks[0].y;
      for (std::int64_t i = 0; i < y.numel(); ++i) {
        const float v = y.get(i);
        subnormals += v != 0.0f && std::fabs(v) < (dtype == DType::bf16 ? std::ldexp(1.0f, -126)
                                                                        : std::ldexp(1.0f, -14));
      }
      EXPECT_GT(subnormals, 0) << "the case must exercise subnormal outputs";
    }
  }
}

TEST_F(Fused, DeclinesWhatItCannotRunAndThePolicyFallsBack) {
  SKIP_WITHOUT_GPU();
  const lmoe::TailProblem f32{16, kSmall, DType::f32, 2};
  EXPECT_TRUE(lmoe::cuda_tier_limit(TailTier::fused, f32).has_value());
  const lmoe::TailProblem odd_stripe{
      16, {392, 192}, DType::bf16, 2};  // 392 / 2 = 196, not a multiple of 8
  EXPECT_TRUE(lmoe::cuda_tier_limit(TailTier::fused, odd_stripe).has_value());
  const lmoe::TailProblem too_many{257, kSmall, DType::bf16, 2};
  EXPECT_TRUE(lmoe::cuda_tier_limit(TailTier::fused, too_many).has_value());
  EXPECT_FALSE(lmoe::cuda_tier_limit(TailTier::fused, {256, kSmall, DType::bf16, 2}).has_value());

  // Over cuda-threads with tp > 1 the kernel cannot read its peers: declined, and the policy's
  // choice for a decode T is then another tier.
  const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, 2, 4, 1u);
  lmoe::run_comm_group("cuda-threads", 2, [&](int, lmoe::Communicator& comm) {
    lmoe::TailOptions options;
    options.dims = kSmall;
    options.backend = lmoe::Backend::cuda;
    lmoe::LatentTail tail(options, comm, c.norm_weight.matrix(), c.up_proj_weight.matrix());
    const lmoe::TierSupport support = tail.support(4);
    const auto& declined = support.declined[static_cast<std::size_t>(TailTier::fused)];
    EXPECT_TRUE(declined.has_value());
    if (declined) {
      EXPECT_NE(declined->find("p2p"), std::string::npos) << *declined;
    }
    const lmoe::TierDecision decision = tail.decide(4);
    ASSERT_TRUE(decision.tier.has_value());
    EXPECT_NE(*decision.tier, TailTier::fused);
  });
}

// LMOE_FUSED_TRACE: destroying the FusedTail prints when the blocks of the last call of each kernel
// reached each of its points (one call of 17 rows: the general kernel, the chained path turned
// off; one of 4: the decode kernel); without the variable nothing is printed.
TEST_F(Fused, TraceListsEveryPhaseOfTheLastCallOnlyWhenAskedFor) {
  SKIP_WITHOUT_GPU();
  const ScopedEnv general("LMOE_FUSED_CHAINED", "0");
  const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, 1, 17, 12u);
  const auto stderr_of_two_calls = [&](const char* trace) {
    const ScopedEnv env("LMOE_FUSED_TRACE", trace);
    const auto comms = lmoe::make_p2p_thread_communicators(1, {});
    ::testing::internal::CaptureStderr();
    lmoe::run_on_rank_threads(comms, [&](int, lmoe::Communicator& comm) {
      FusedRank state(comm, c, 17);
      for (std::int64_t tokens : {17, 4}) {
        state.fused->run(state.routed.data(), state.shared.data(), state.out.data(), tokens,
                         nullptr);
        cuda_ok(cudaStreamSynchronize(nullptr));
      }
    });
    return ::testing::internal::GetCapturedStderr();
  };
  const std::string traced = stderr_of_two_calls("1");
  EXPECT_NE(traced.find("[ fused trace ] rank 0, grid "), std::string::npos) << traced;
  for (const char* point : {"entry", "epoch", "normed", "rows done", "items done", "end"}) {
    EXPECT_NE(traced.find(std::string("[ fused trace ] ") + point + " "), std::string::npos)
        << point << "\n"
        << traced;
  }
  // With one rank there are no peers: no staging or stripe points.
  EXPECT_EQ(traced.find("stripes arrived"), std::string::npos) << traced;
  EXPECT_NE(traced.find("[ fused trace ] rank 0, decode kernel, grid "), std::string::npos)
      << traced;
  for (const char* point : {"released", "inputs landed", "items landed", "warp 0 multiplied",
                            "streamed", "partials stored"}) {
    EXPECT_NE(traced.find(std::string("[ fused trace ] ") + point + " "), std::string::npos)
        << point << "\n"
        << traced;
  }
  // Each kernel's trace ends with the global timer at its first entry and last stamp (two kernels:
  // the general and the decode kernel), the first no later than the second.
  std::size_t at = 0;
  int timers = 0;
  while ((at = traced.find("[ fused trace ] global timer: first entry ", at)) !=
         std::string::npos) {
    unsigned long long first = 0, last = 0;
    EXPECT_EQ(std::sscanf(traced.c_str() + at,
                          "[ fused trace ] global timer: first entry %llu ns, last stamp %llu ns",
                          &first, &last),
              2)
        << traced;
    EXPECT_GT(first, 0ull);
    EXPECT_LE(first, last);
    ++timers;
    ++at;
  }
  EXPECT_EQ(timers, 2) << traced;
  EXPECT_EQ(stderr_of_two_calls(nullptr).find("[ fused trace ]"), std::string::npos);
}

// The kernels a call of `tokens` rows runs with two ranks, for tests that run one of each: the
// decode kernel at 4, the chained path at 33 (compute 9.0; else the general kernel).
const std::int64_t kTwoRankKernelTokens[] = {4, 33};

// A rank that never calls: its peer's kernel gives up after the timeout, and both ranks get an
// error well within 5 s instead of hanging.
TEST_F(Fused, AStalledRankMakesEveryRankFailWithinFiveSeconds) {
  SKIP_WITHOUT_GPU();
  for (const std::int64_t tokens : kTwoRankKernelTokens) {
    SCOPED_TRACE("T=" + std::to_string(tokens));
    const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, 2, tokens, 9u);
    lmoe::P2pOptions options;
    options.timeout = std::chrono::milliseconds(500);
    std::vector<std::string> errors(2);
    const auto start = std::chrono::steady_clock::now();
    const auto comms = lmoe::make_p2p_thread_communicators(2, options);
    lmoe::run_on_rank_threads(comms, [&](int rank, lmoe::Communicator& comm) {
      FusedRank state(comm, c, tokens);
      cudaStream_t stream = nullptr;
      cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      cuda_ok(cudaDeviceSynchronize());
      comm.barrier();
      try {
        if (rank == 0) {
          state.fused->run(state.routed.data(), state.shared.data(), state.out.data(), tokens,
                           stream);
          cuda_ok(cudaStreamSynchronize(stream));
        } else {
          // Later than rank 0's kernel timeout, so that rank 0's kernel reports the stall itself
          // (an earlier barrier timeout here would abort the group first).
          std::this_thread::sleep_for(std::chrono::milliseconds(1000));
        }
        comm.barrier();  // every rank learns of the device failure here
      } catch (const lmoe::Error& error) {
        errors[static_cast<std::size_t>(rank)] = error.what();
      }
      cudaStreamDestroy(stream);
    });
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(seconds, 5.0);
    for (int r = 0; r < 2; ++r)
      EXPECT_FALSE(errors[static_cast<std::size_t>(r)].empty()) << "rank " << r;
    EXPECT_NE(errors[0].find("waited more than 500 ms for rank 1"), std::string::npos) << errors[0];
  }
}

// A buffer that fused's vector accesses cannot use, on one rank only: the ranks agree on the call
// before anything is launched, so both fail with the reason. (Were the buffer found only at launch,
// rank 0's kernel would wait for rank 1 and fail with a p2p timeout message instead.)
TEST_F(Fused, AMisalignedBufferOnOneRankFailsEveryRankAtOnce) {
  SKIP_WITHOUT_GPU();
  const std::int64_t tokens = 4, d = kSmall.d_model, l = kSmall.d_latent;
  const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, 2, tokens, 11u);
  std::vector<std::string> errors(2);
  const auto comms = lmoe::make_p2p_thread_communicators(2);
  lmoe::run_on_rank_threads(comms, [&](int rank, lmoe::Communicator& comm) {
    lmoe::TailOptions options;
    options.dims = kSmall;
    options.backend = lmoe::Backend::cuda;
    options.max_tokens = tokens;
    lmoe::LatentTail tail(options, comm, c.norm_weight.matrix(), c.up_proj_weight.matrix());
    const DeviceBuffer routed(static_cast<std::size_t>(tokens * l) * 2),
        shared(static_cast<std::size_t>(tokens * d) * 2),
        out(static_cast<std::size_t>(tokens * d) * 2 + 16);
    void* out_data =
        static_cast<std::byte*>(out.data()) + (rank == 1 ? 2 : 0);  // bf16-aligned, not 16-byte
    const lmoe::ConstMatrixView routed_view{
        routed.data(), DType::bf16, tokens, l, l, lmoe::MemorySpace::device};
    const lmoe::MatrixView shared_view{
        shared.data(), DType::bf16, tokens, d, d, lmoe::MemorySpace::device};
    const lmoe::MatrixView out_view{out_data, DType::bf16, tokens, d, d, lmoe::MemorySpace::device};
    cuda_ok(cudaDeviceSynchronize());
    comm.barrier();
    try {
      tail.forward(routed_view, shared_view, out_view, TailTier::fused, nullptr);
      cuda_ok(cudaDeviceSynchronize());
    } catch (const lmoe::Error& error) {
      errors[static_cast<std::size_t>(rank)] = error.what();
    }
  });
  expect_every_rank_error(
      errors, "rank 1: tier fused cannot run on these buffers: out must be 16-byte aligned");
}

// Two calls of one rank at once on its workspace (two streams, no order between them): an error,
// not a deadlock and not silently wrong rows.
TEST_F(Fused, TwoCallsAtOnceOnOneWorkspaceAreAnError) {
  SKIP_WITHOUT_GPU();
  for (const std::int64_t tokens : kTwoRankKernelTokens) {
    SCOPED_TRACE("T=" + std::to_string(tokens));
    const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, 2, tokens, 10u);
    lmoe::P2pOptions options;
    options.timeout = std::chrono::milliseconds(2000);
    std::vector<std::string> errors(2);
    const auto comms = lmoe::make_p2p_thread_communicators(2, options);
    lmoe::run_on_rank_threads(comms, [&](int rank, lmoe::Communicator& comm) {
      FusedRank state(comm, c, tokens);
      cudaStream_t first = nullptr, second = nullptr;
      cuda_ok(cudaStreamCreateWithFlags(&first, cudaStreamNonBlocking));
      cuda_ok(cudaStreamCreateWithFlags(&second, cudaStreamNonBlocking));
      cuda_ok(cudaDeviceSynchronize());
      comm.barrier();
      try {
        if (rank == 0) {
          // The first call waits for rank 1, which never calls; the second finds the workspace
          // busy.
          state.fused->run(state.routed.data(), state.shared.data(), state.out.data(), tokens,
                           first);
          state.fused->run(state.routed.data(), state.shared.data(), state.out.data(), tokens,
                           second);
          cuda_ok(cudaStreamSynchronize(first));
          cuda_ok(cudaStreamSynchronize(second));
        }
        comm.barrier();
      } catch (const lmoe::Error& error) {
        errors[static_cast<std::size_t>(rank)] = error.what();
      }
      cudaStreamDestroy(first);
      cudaStreamDestroy(second);
    });
    EXPECT_NE(errors[0].find("at the same time"), std::string::npos) << errors[0];
    EXPECT_FALSE(errors[1].empty());
  }
}

// Which kernel ran: the general kernel counts its calls in the workspace, the chained path in its
// own, the decode kernel nowhere. Where the chained path runs (compute 9.0) the decode kernel takes
// up to 4 rows (with one rank its pair instance, which these dims allow; 2 … 7 ranks; the call's
// T, or the bound of a call with T on the device), the chained path the rest up to 128; elsewhere
// the decode kernel up to 16 and the general kernel above; 129 takes the general kernel
// everywhere. Each bound ±1, tp 1, 2, 4.
TEST_F(Fused, EachCallRunsTheKernelItsRowsChoose) {
  SKIP_WITHOUT_GPU();
  for (int tp : {1, 2, 4}) {
    if (tp > 1 && lmoe::comm_group_limit("p2p", tp)) continue;
    const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, tp, 129, 41u);
    const auto comms = lmoe::make_p2p_thread_communicators(tp, {});
    lmoe::run_on_rank_threads(comms, [&](int, lmoe::Communicator& comm) {
      FusedRank state(comm, c, 256);
      lmoe::cuda::FusedTail& fused = *state.fused;
      // One stream per rank: ranks spinning on each other must not share the legacy default stream.
      cudaStream_t stream = nullptr;
      cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      EXPECT_EQ(fused.decode_max_tokens(), 16) << fused.decode_limit().value_or("");
      EXPECT_FALSE(fused.decode_limit().has_value());
      const bool chained = compute_capability() == 90;
      EXPECT_EQ(fused.chained_max_tokens(), chained ? 128 : 0)
          << fused.chained_limit().value_or("");
      EXPECT_EQ(fused.chained_limit().has_value(), !chained);
      std::uint32_t general = fused.general_calls(), chained_calls = fused.chained_calls();
      // One rank: the decode kernel's pair instance (a block's share of w_up is one group of 8
      // rows here: 48 groups) takes up to 4 rows beside the chained path.
      if (tp == 1) {
        EXPECT_EQ(fused.decode_pair_tokens(), 4);
      }
      // Each bound ±1: ≤ 4 beside the chained path (one rank: the pair instance; 2 … 7 ranks),
      // else 16.
      for (std::int64_t tokens : {1, 2, 3, 4, 5, 16, 17, 128, 129}) {
        using lmoe::cuda::FusedKernel;
        const std::int64_t decode_bound = chained ? 4 : 16;
        EXPECT_EQ(lmoe::cuda::fused_decode_beside_chained_tokens(tp), tp == 1 ? 0 : 4);
        const FusedKernel expected = tokens <= decode_bound     ? FusedKernel::decode
                                     : chained && tokens <= 128 ? FusedKernel::chained
                                                                : FusedKernel::general;
        EXPECT_EQ(fused.kernel_for(tokens), expected) << "tp=" << tp << " T=" << tokens;
        comm.barrier();
        fused.run(state.routed.data(), state.shared.data(), state.out.data(), tokens, stream);
        cuda_ok(cudaStreamSynchronize(stream));
        const std::uint32_t general_now = fused.general_calls();
        const std::uint32_t chained_now = fused.chained_calls();
        EXPECT_EQ(general_now - general, expected == FusedKernel::general ? 1u : 0u)
            << "tp=" << tp << " T=" << tokens;
        EXPECT_EQ(chained_now - chained_calls, expected == FusedKernel::chained ? 1u : 0u)
            << "tp=" << tp << " T=" << tokens;
        general = general_now;
        chained_calls = chained_now;
      }
      EXPECT_EQ(fused.kernel_for(0), lmoe::cuda::FusedKernel::general);
      cudaStreamDestroy(stream);
    });
  }
}

// A caller's weights on another GPU than the rank's (FusedTail is below LatentTail, which places
// them right): refused at construction, naming both GPUs, before anything is launched. Two GPUs.
TEST_F(Fused, WeightsOnAnotherGpuThanTheRanksAreRefusedNamingBoth) {
  SKIP_WITH_FEWER_GPUS_THAN(2, "needs two GPUs (rank 1 on the second)");
  if (auto limit = lmoe::comm_group_limit("p2p", 2)) GTEST_SKIP() << *limit;
  const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, 2, 4, 77u);
  std::vector<std::string> errors(2);
  lmoe::P2pOptions options;
  options.timeout = std::chrono::milliseconds(2000);
  const auto comms = lmoe::make_p2p_thread_communicators(2, options);
  lmoe::run_on_rank_threads(comms, [&](int rank, lmoe::Communicator& comm) {
    cuda_ok(cudaSetDevice(0));  // every rank's weights on GPU 0; rank 1 runs on GPU 1
    const DeviceBuffer w(static_cast<std::size_t>(kSmall.d_model / 2 * kSmall.d_latent) * 2);
    const DeviceBuffer gamma(static_cast<std::size_t>(kSmall.d_latent) * sizeof(float));
    try {
      lmoe::cuda::FusedTail fused(comm, kSmall, DType::bf16, true, 1e-5f, w.data(),
                                  static_cast<const float*>(gamma.data()), 4);
    } catch (const lmoe::Error& error) {
      errors[static_cast<std::size_t>(rank)] = error.message();
      if (rank == 1) comm.abort(error.message());  // rank 0 waits in the workspace exchange
    }
  });
  EXPECT_NE(errors[1].find("fused: w_up's stripe is on GPU 0, this rank runs on GPU 1"),
            std::string::npos)
      << errors[1];
  EXPECT_FALSE(errors[0].empty());  // the abort reached it
}

// Ranks whose grids differ (tp 3 on two GPUs: ranks 0 and 2 share GPU 0, rank 1 has GPU 1 to
// itself) with a stripe whose K is split (l = 3584: each rank's own fp32 partials are sized by its
// grid): what the peers write must still be laid out alike on every rank. Decode and general calls
// meet the contract. Two GPUs.
TEST_F(Fused, RanksWithDifferentGridsLayOutWhatThePeersWriteAlike) {
  SKIP_WITHOUT_GPU();
  int gpus = 0;
  cuda_ok(cudaGetDeviceCount(&gpus));
  if (gpus != 2) GTEST_SKIP() << "needs exactly two GPUs (two ranks on one, one on the other)";
  if (auto limit = lmoe::comm_group_limit("p2p", 3)) GTEST_SKIP() << *limit;
  const lmoe::TailDims dims{3072, 3584};  // d % (8 · 3) == 0
  double worst = 0;
  for (std::int64_t tokens : {1, 8, 40}) {
    SCOPED_TRACE("T=" + std::to_string(tokens));
    const lmoe::TailCase c = lmoe::make_random_case(dims, 1e-5f, DType::bf16, 3, tokens,
                                                    90u + static_cast<std::uint64_t>(tokens));
    expect_meets_contract(c, run_fused(c), &worst);
  }
  std::printf("[ fused  ] tp=3 on two GPUs (grids differ), T 1/8/40 max_err/bound=%.3f\n", worst);
}

// A status record as a kernel leaves it: the fields a failure sets, every other one 0.
lmoe::cuda::P2pStatus status_record(std::int32_t code, std::int32_t peer, std::int32_t block,
                                    std::int32_t round, std::int32_t tokens = 0,
                                    std::int32_t compared_tokens = 0) {
  return {.code = code,
          .peer = peer,
          .block = block,
          .round = round,
          .own_tag = 0,
          .peer_tag = 0,
          .tokens = tokens,
          .compared_tokens = compared_tokens};
}

// The error a status record becomes (p2p_failure_text): a wait for a peer names the peer, a fused
// kernel's wait for its own grid (the peer is the rank itself) says so; both name the timeout the
// waits had; no failure and an abort (a consequence of another record's failure) give no text. No
// GPU needed; CI runs it.
TEST(FusedFailureText, NamesTheTimeoutAndWhatTheWaitWasFor) {
  const auto text = [](int rank, const lmoe::cuda::P2pStatus& record, int ms) {
    return lmoe::p2p_failure_text(rank, record, std::chrono::milliseconds(ms));
  };
  EXPECT_EQ(text(0, status_record(lmoe::cuda::kP2pTimeout, 0, 3, 7), 250),
            "rank 0's block 3 waited more than 250 ms for the other blocks of its grid (fused call "
            "7); the GPU did not run all of the grid's blocks at once");
  EXPECT_EQ(text(1, status_record(lmoe::cuda::kP2pTimeout, 0, 4, 2), 500),
            "p2p: rank 1 waited more than 500 ms for rank 0 (round 2, block 4); the peer is "
            "stalled or never issued the same collective");
  EXPECT_NE(text(0, status_record(lmoe::cuda::kP2pConcurrentUse, -1, 0, 1), 250)
                .find("rank 0 ran two collectives at the same time"),
            std::string::npos);
  EXPECT_EQ(text(0, status_record(lmoe::cuda::kP2pOk, 0, 0, 0), 250), "");
  EXPECT_EQ(text(0, status_record(lmoe::cuda::kP2pAborted, -1, 0, 3), 250), "");
}

// A fused call's T in a status record: two ranks' different T name both ranks and both values; a
// T read on the device past the bound names T and the bound. No GPU needed; CI runs it.
TEST(FusedFailureText, NamesBothRanksTOrTheTReadAndTheBound) {
  const auto text = [](int rank, const lmoe::cuda::P2pStatus& record) {
    return lmoe::p2p_failure_text(rank, record, std::chrono::milliseconds(500));
  };
  EXPECT_EQ(text(1, status_record(lmoe::cuda::kFusedTokensMismatch, 0, 2, 9, 5, 7)),
            "rank 1 ran T = 5 and rank 0 T = 7 in the same fused call (call 9); every rank must "
            "run a call with the same T (a graph replayed with T on the device: the same T "
            "written on every rank)");
  EXPECT_EQ(text(0, status_record(lmoe::cuda::kFusedTokensOutOfRange, -1, 0, 0, 300, 256)),
            "rank 0 read T = 300 from tokens_device, outside [0, 256] (the rows its fused call "
            "was launched for); its call wrote no output");
  EXPECT_NE(text(0, status_record(lmoe::cuda::kFusedTokensOutOfRange, -1, 0, 0, -1, 16))
                .find("read T = -1 from tokens_device, outside [0, 16]"),
            std::string::npos);
}

// A FusedTail whose workspace no GPU holds (d_model = 2^34: terabytes of staged rows) fails at the
// workspace's allocation, after its own failure record (one rank: page-locked, mapped) was
// allocated: 1000 such constructions leak neither host nor device memory.
TEST_F(Fused, FailedConstructionsLeakNoMemory) {
  SKIP_WITHOUT_GPU();
  const auto comms = lmoe::make_p2p_thread_communicators(1, {});
  const lmoe::TailDims too_large{std::int64_t{1} << 34, 16};
  const auto construct = [&] {
    lmoe::cuda::FusedTail fused(*comms[0], too_large, DType::bf16, true, 1e-5f, nullptr, nullptr,
                                16);
  };
  try {
    construct();
    ADD_FAILURE() << "a FusedTail with d_model = 2^34 was built";
  } catch (const lmoe::Error& error) {
    EXPECT_NE(std::string(error.message()).find("cudaMalloc"), std::string::npos)
        << "the failure must come after the record's allocation: " << error.message();
  }
  expect_failed_attempts_leak_nothing("FusedTail on one rank, d_model = 2^34", 1000, construct);
}

// Ranks built for different numbers of rows (max_tokens) would address each other's workspaces at
// different offsets: an error on every rank at construction, naming the setting.
TEST_F(Fused, DifferentMaxTokensOnTheRanksAreAnErrorOnEveryRank) {
  SKIP_WITHOUT_GPU();
  if (auto limit = lmoe::comm_group_limit("p2p", 2)) GTEST_SKIP() << *limit;
  const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, 2, 4, 91u);
  std::vector<std::string> errors(2);
  const auto comms = lmoe::make_p2p_thread_communicators(2);
  lmoe::run_on_rank_threads(comms, [&](int rank, lmoe::Communicator& comm) {
    try {
      FusedRank state(comm, c, rank == 0 ? 16 : 32);
    } catch (const lmoe::Error& error) {
      errors[static_cast<std::size_t>(rank)] = error.message();
    }
  });
  expect_every_rank_error(errors,
                          "fused: the ranks' workspaces hold different rows (rank 0: 16, "
                          "rank 1: 32): max_tokens must be the same on every rank");
}

// Ranks whose workspaces hold the same rows but lay out the regions their peers write differently
// (here another d_latent on rank 1: the staged rows and lines are longer) would write into each
// other at the wrong offsets: an error on every rank at construction, naming what differs with
// every rank's value.
TEST_F(Fused, RanksThatLayOutTheirWorkspacesDifferentlyAreAnErrorOnEveryRank) {
  SKIP_WITHOUT_GPU();
  if (auto limit = lmoe::comm_group_limit("p2p", 2)) GTEST_SKIP() << *limit;
  const lmoe::TailCase narrow = lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, 2, 4, 92u);
  const lmoe::TailCase wide =
      lmoe::make_random_case({kSmall.d_model, kSmall.d_latent + 16}, 1e-5f, DType::bf16, 2, 4, 93u);
  std::vector<std::string> errors(2);
  const auto comms = lmoe::make_p2p_thread_communicators(2);
  lmoe::run_on_rank_threads(comms, [&](int rank, lmoe::Communicator& comm) {
    try {
      FusedRank state(comm, rank == 0 ? narrow : wide, 16);
    } catch (const lmoe::Error& error) {
      errors[static_cast<std::size_t>(rank)] = error.message();
    }
  });
  expect_every_rank_error(errors,
                          "fused: the ranks lay out the part of their workspaces that "
                          "peers write differently (it ends at rank 0: byte ");
  expect_every_rank_error(errors, ", rank 1: byte ");
  expect_every_rank_error(errors, "every rank needs the same d_model, d_latent, dtype");
  EXPECT_EQ(errors[0], errors[1]);
  // The values named differ (rank 1's latent rows are longer).
  const std::size_t at0 = errors[0].find("rank 0: byte "), at1 = errors[0].find("rank 1: byte ");
  ASSERT_NE(at0, std::string::npos);
  ASSERT_NE(at1, std::string::npos);
  EXPECT_LT(std::stoll(errors[0].substr(at0 + 13)), std::stoll(errors[0].substr(at1 + 13)))
      << errors[0];
}

// How long a wait of one rank's kernels lasts (their grid barrier: one rank has no peers) is the
// configured timeout: LMOE_P2P_TIMEOUT_MS over any communicator but p2p, whose own timeout (its
// options', else the same variable's) serves there.
TEST_F(Fused, OneRanksWaitsLastTheConfiguredTimeout) {
  SKIP_WITHOUT_GPU();
  const ScopedEnv timeout("LMOE_P2P_TIMEOUT_MS", "250");
  const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, 1, 4, 94u);
  const auto wait_timeout = [&](lmoe::Communicator& comm) {
    return FusedRank(comm, c, 16).fused->wait_timeout().count();
  };
  EXPECT_EQ(wait_timeout(*lmoe::make_cuda_thread_communicators(1, 0)[0]), 250);
  EXPECT_EQ(wait_timeout(*lmoe::make_p2p_thread_communicators(1)[0]), 250);
  lmoe::P2pOptions options;
  options.timeout = std::chrono::milliseconds(300);
  EXPECT_EQ(wait_timeout(*lmoe::make_p2p_thread_communicators(1, options)[0]), 300);
}

// A LatentTail on p2p ranks whose threads all have GPU 0 current: each rank's weights, workspaces
// and streams go to the rank's own GPU (rank % GPUs), which it leaves current for the caller's
// buffers, and fused and overlap calls then meet the contract bit for bit (crafted inputs). Two
// GPUs.
TEST_F(Fused, ALatentTailOnP2pRanksPlacesItsWeightsOnTheRanksGpu) {
  SKIP_WITH_FEWER_GPUS_THAN(2, "needs two GPUs (rank 1 on the second)");
  if (auto limit = lmoe::comm_group_limit("p2p", 2)) GTEST_SKIP() << *limit;
  const std::int64_t tokens = 4, d = kSmall.d_model, l = kSmall.d_latent;
  const lmoe::TailCase c = lmoe::make_exact_case(kSmall, DType::bf16, 2, tokens, 78u);
  const auto reference = lmoe::reference_tail(c, lmoe::contract_of(TailTier::fused));
  const std::vector<double> exact = lmoe::exact_tail(c);
  std::vector<int> devices(2, -1);
  std::vector<std::string> errors(2);
  lmoe::HostTensor outputs(DType::bf16, {2, tokens, d});  // rank 0's Y of each tier
  const auto comms = lmoe::make_p2p_thread_communicators(2);
  lmoe::run_on_rank_threads(comms, [&](int rank, lmoe::Communicator& comm) {
    cuda_ok(cudaSetDevice(0));
    lmoe::TailOptions options;
    options.dims = kSmall;
    options.backend = lmoe::Backend::cuda;
    options.max_tokens = tokens;
    try {
      lmoe::LatentTail tail(options, comm, c.norm_weight.matrix(), c.up_proj_weight.matrix());
      cuda_ok(cudaGetDevice(&devices[static_cast<std::size_t>(rank)]));
      const std::size_t routed_bytes = static_cast<std::size_t>(tokens * l) * 2,
                        rows_bytes = static_cast<std::size_t>(tokens * d) * 2;
      const DeviceBuffer routed(routed_bytes), shared(rows_bytes), out(rows_bytes);
      const lmoe::ConstMatrixView routed_view{
          routed.data(), DType::bf16, tokens, l, l, lmoe::MemorySpace::device};
      const lmoe::MatrixView shared_view{
          shared.data(), DType::bf16, tokens, d, d, lmoe::MemorySpace::device};
      const lmoe::MatrixView out_view{out.data(), DType::bf16, tokens,
                                      d,          d,           lmoe::MemorySpace::device};
      int slot = 0;
      for (TailTier tier : {TailTier::fused, TailTier::overlap}) {
        cuda_ok(cudaMemcpy(routed.data(), c.routed.slice_matrix(rank).data, routed_bytes,
                           cudaMemcpyHostToDevice));
        cuda_ok(cudaMemcpy(shared.data(), c.shared.slice_matrix(rank).data, rows_bytes,
                           cudaMemcpyHostToDevice));
        cuda_ok(cudaMemset(out.data(), 0xff, rows_bytes));  // NaN-poisoned
        cuda_ok(cudaDeviceSynchronize());
        comm.barrier();
        tail.forward(routed_view, shared_view, out_view, tier, nullptr);
        cuda_ok(cudaDeviceSynchronize());
        if (rank == 0) {
          cuda_ok(cudaMemcpy(outputs.slice_matrix(slot).data, out.data(), rows_bytes,
                             cudaMemcpyDeviceToHost));
        }
        ++slot;
        comm.barrier();
      }
    } catch (const lmoe::Error& error) {
      errors[static_cast<std::size_t>(rank)] = error.message();
      comm.abort(error.message());
    }
  });
  EXPECT_EQ(devices, (std::vector<int>{0, 1}));
  for (int r = 0; r < 2; ++r)
    EXPECT_TRUE(errors[static_cast<std::size_t>(r)].empty()) << errors[static_cast<std::size_t>(r)];
  for (int slot = 0; slot < 2; ++slot) {
    const lmoe::Comparison cmp = lmoe::compare(outputs.slice_matrix(slot), reference, exact);
    EXPECT_EQ(cmp.bit_mismatches, 0) << (slot == 0 ? "fused" : "overlap");
  }
}

// Each fused kernel with the environment that makes a bound choose it: the decode kernel (the
// chained path off; with one rank at 4 rows its pair instance), the general kernel (both off, and
// at 129 rows where neither runs) and, on compute 9.0, the chained path.
struct KernelAtBound {
  lmoe::cuda::FusedKernel kernel;
  std::int64_t bound;
  const char* decode;   // LMOE_FUSED_DECODE (null: unset)
  const char* chained;  // LMOE_FUSED_CHAINED
};
std::vector<KernelAtBound> kernels_at_bounds() {
  using lmoe::cuda::FusedKernel;
  std::vector<KernelAtBound> cases = {{FusedKernel::decode, 4, "1", "0"},
                                      {FusedKernel::decode, 12, "1", "0"},
                                      {FusedKernel::general, 40, "0", "0"},
                                      {FusedKernel::general, 129, nullptr, nullptr}};
  if (compute_capability() == 90) cases.push_back({FusedKernel::chained, 64, nullptr, nullptr});
  return cases;
}

// A graph replayed with T on the device past its call's bound, for each kernel: no output written
// anywhere, and the next call fails naming T and the bound on every rank, with one rank and two
// (expect_device_tokens_past_the_bound_fail).
TEST_F(Fused, DeviceTPastTheBoundWritesNothingAndFailsEveryRank) {
  SKIP_WITHOUT_GPU();
  for (const KernelAtBound& at : kernels_at_bounds()) {
    const ScopedEnv decode("LMOE_FUSED_DECODE", at.decode);
    const ScopedEnv chained("LMOE_FUSED_CHAINED", at.chained);
    expect_device_tokens_past_the_bound_fail(at.kernel, at.bound);
  }
}

// Two ranks replaying a graph with different T on the device, for each kernel (T one apart at the
// bound, and 0 on rank 0: a call of no rows still sends its T): every rank fails naming both T,
// instead of summing rows its peer never staged (the general kernel) or waiting for rows the peer
// never sends until the timeout (the decode kernel, the chained path).
TEST_F(Fused, RanksReplayingDifferentTFailEveryRankNamingBoth) {
  SKIP_WITHOUT_GPU();
  for (const KernelAtBound& at : kernels_at_bounds()) {
    const ScopedEnv decode("LMOE_FUSED_DECODE", at.decode);
    const ScopedEnv chained("LMOE_FUSED_CHAINED", at.chained);
    const auto bound = static_cast<std::int32_t>(at.bound);
    expect_different_device_tokens_fail_every_rank(at.kernel, at.bound, bound - 1, bound);
    expect_different_device_tokens_fail_every_rank(at.kernel, at.bound, 0, bound / 2 + 1);
  }
}

// The kernels take turns on one workspace with several ranks (each call's counter targets are the
// grids of the calls before it plus its own, and the grids differ; the chained path's lines carry
// the epochs the others advance): 40 calls of the cases (where the chained path runs decode up to
// 4 rows at tp 2 and 4, 16 at tp 8, chained to 128, above general; elsewhere decode up to 16, above
// general) in a pseudo-random order, with no
// host synchronization between them (a rank may run a call ahead of its peers), every output
// against the contract and equal on every rank, at tp 2, 4 and 8 (T < tp included).
void expect_calls_in_turn(int tp, const std::vector<std::int64_t>& case_tokens) {
  constexpr int kCalls = 40;
  std::vector<std::size_t> order(kCalls);
  std::mt19937 pick(777);
  for (std::size_t& k : order) k = pick() % case_tokens.size();
  const std::int64_t d = kSmall.d_model, l = kSmall.d_latent;
  {
    SCOPED_TRACE("tp=" + std::to_string(tp));
    std::vector<lmoe::TailCase> cases;
    for (std::size_t k = 0; k < case_tokens.size(); ++k) {
      cases.push_back(
          lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, tp, case_tokens[k], 900u + k));
      cases[k].norm_weight = cases[0].norm_weight;
      cases[k].up_proj_weight = cases[0].up_proj_weight;
    }
    std::vector<std::vector<lmoe::HostTensor>> outputs(static_cast<std::size_t>(tp));
    std::vector<std::uint32_t> general_calls(static_cast<std::size_t>(tp)),
        chained_calls(static_cast<std::size_t>(tp));
    const auto comms = lmoe::make_p2p_thread_communicators(tp);
    lmoe::run_on_rank_threads(comms, [&](int rank, lmoe::Communicator& comm) {
      FusedRank state(comm, cases[0], 256);
      EXPECT_EQ(state.fused->decode_max_tokens(), 16) << state.fused->decode_limit().value_or("");
      // Inputs and results on the device, copied before and after: between the calls only
      // stream-ordered device copies (a pageable host copy can wait inside the driver for another
      // rank's, whose kernel waits for this rank's call).
      std::vector<DeviceBuffer> routed, shared, results;
      for (std::size_t k = 0; k < cases.size(); ++k) {
        routed.emplace_back(static_cast<std::size_t>(case_tokens[k] * l) * 2);
        shared.emplace_back(static_cast<std::size_t>(case_tokens[k] * d) * 2);
        cuda_ok(cudaMemcpy(routed[k].data(), cases[k].routed.slice_matrix(rank).data,
                           routed[k].bytes(), cudaMemcpyHostToDevice));
        cuda_ok(cudaMemcpy(shared[k].data(), cases[k].shared.slice_matrix(rank).data,
                           shared[k].bytes(), cudaMemcpyHostToDevice));
      }
      for (std::size_t k : order)
        results.emplace_back(static_cast<std::size_t>(case_tokens[k] * d) * 2);
      cudaStream_t stream = nullptr;
      cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      comm.barrier();
      for (std::size_t i = 0; i < order.size(); ++i) {
        const std::size_t k = order[i];
        cuda_ok(cudaMemcpyAsync(state.routed.data(), routed[k].data(), routed[k].bytes(),
                                cudaMemcpyDeviceToDevice, stream));
        cuda_ok(cudaMemcpyAsync(state.shared.data(), shared[k].data(), shared[k].bytes(),
                                cudaMemcpyDeviceToDevice, stream));
        cuda_ok(cudaMemsetAsync(state.out.data(), 0xff, state.out.bytes(), stream));
        state.fused->run(state.routed.data(), state.shared.data(), state.out.data(), case_tokens[k],
                         stream);
        cuda_ok(cudaMemcpyAsync(results[i].data(), state.out.data(), results[i].bytes(),
                                cudaMemcpyDeviceToDevice, stream));
      }
      cuda_ok(cudaStreamSynchronize(stream));
      comm.barrier();
      for (std::size_t i = 0; i < order.size(); ++i) {
        lmoe::HostTensor y(DType::bf16, {case_tokens[order[i]], d});
        cuda_ok(
            cudaMemcpy(y.data(), results[i].data(), results[i].bytes(), cudaMemcpyDeviceToHost));
        outputs[static_cast<std::size_t>(rank)].push_back(std::move(y));
      }
      general_calls[static_cast<std::size_t>(rank)] = state.fused->general_calls();
      chained_calls[static_cast<std::size_t>(rank)] = state.fused->chained_calls();
      cudaStreamDestroy(stream);
    });
    // Where the chained path runs: decode up to decode_beside_chained_tokens(tp), chained to 128.
    const bool chained_runs = compute_capability() == 90;
    const std::int64_t chained_bound = chained_runs ? 128 : 16;
    const std::int64_t decode_bound =
        chained_runs ? lmoe::cuda::fused_decode_beside_chained_tokens(tp) : 16;
    std::uint32_t general = 0, chained = 0;
    for (std::size_t k : order) {
      general += case_tokens[k] > chained_bound ? 1u : 0u;
      chained += case_tokens[k] > decode_bound && case_tokens[k] <= chained_bound ? 1u : 0u;
    }
    std::vector<lmoe::ContractReference> references;
    for (const lmoe::TailCase& c : cases)
      references.push_back(lmoe::reference_tail(c, lmoe::contract_of(TailTier::fused)));
    double worst = 0;
    for (int r = 0; r < tp; ++r) {
      EXPECT_EQ(general_calls[static_cast<std::size_t>(r)], general) << "rank " << r;
      EXPECT_EQ(chained_calls[static_cast<std::size_t>(r)], chained) << "rank " << r;
      ASSERT_EQ(outputs[static_cast<std::size_t>(r)].size(), order.size()) << "rank " << r;
      for (std::size_t i = 0; i < order.size(); ++i) {
        const std::size_t k = order[i];
        SCOPED_TRACE("rank " + std::to_string(r) + " call " + std::to_string(i) +
                     " T=" + std::to_string(case_tokens[k]));
        const lmoe::HostTensor& y = outputs[static_cast<std::size_t>(r)][i];
        if (r > 0) {
          EXPECT_EQ(std::memcmp(y.data(), outputs[0][i].data(),
                                static_cast<std::size_t>(case_tokens[k] * d) * 2),
                    0);
        }
        const lmoe::Comparison cmp =
            lmoe::compare(y.matrix(), references[k], lmoe::exact_tail(cases[k]));
        EXPECT_EQ(cmp.beyond_bound, 0) << "max err/bound " << cmp.max_error_over_bound;
        worst = std::max(worst, cmp.max_error_over_bound);
      }
    }
    std::printf(
        "[ fused  ] calls in turn, tp=%d, %d calls (%u chained, %u general): max_err/bound=%.3f\n",
        tp, kCalls, chained, general, worst);
  }
}

TEST_F(Fused, TheKernelsTakeTurnsOnOneWorkspace) {
  SKIP_WITHOUT_GPU();
  const ScopedEnv decode_on("LMOE_FUSED_DECODE", "1");  // whatever the environment says
  const std::vector<std::int64_t> mixed = {1, 17, 16, 3, 40, 8, 2, 33, 5, 64, 129, 150};
  for (int tp : {2, 4, 8}) {
    if (lmoe::comm_group_limit("p2p", tp)) continue;
    if (tp == 8) {  // each kernel alone first: a failure below then says which part breaks
      expect_calls_in_turn(tp, {1, 16, 3, 8, 2, 5});
      expect_calls_in_turn(tp, {17, 40, 33, 64});
      expect_calls_in_turn(tp, {129, 200, 150});
    }
    expect_calls_in_turn(tp, mixed);
  }
}

TEST_F(Fused, SoakOfGraphReplaysWithChangingTAndInputsHasNoMismatch) {
  SKIP_WITHOUT_GPU();
  if (lmoe::comm_group_limit("p2p", 2)) GTEST_SKIP() << "p2p with 2 ranks cannot run here";
  const ScopedEnv chained_off("LMOE_FUSED_CHAINED", "0");  // the general kernel at 17 … 64 too
  soak_graph_replays(2, 64, {1, 17, 64, 5}, lmoe::cuda::FusedKernel::general);
}

// One captured graph per rank that runs every fused kernel in turn on one workspace (the decode
// kernel, the chained path where it runs, the general kernel, each at the largest bound it takes),
// replayed back to back with T and inputs that change every replay and no host work: the graph
// picks each call's T in [1, its bound] and derives crafted exact inputs (make_exact_case's
// construction) from a replay counter it advances itself, poisons the outputs, runs the calls,
// and counts on the device every output element that differs from the contract's bits (exact
// inputs: the result is order-free) and every written byte past T. At checkpoints the ranks stop
// together and the last replay's outputs are checked on the host against the CPU contract
// (reference_tail of the same replay's inputs), bit for bit. LMOE_FUSED_SOAK_REPLAYS sets the
// replays (10000 unless set; 100000 for the full soak).
TEST_F(Fused, SoakOfTheKernelsInTurnWithInputsDerivedFromAReplayCounterIsExact) {
  SKIP_WITHOUT_GPU();
  const int tp = 2;
  if (auto limit = lmoe::comm_group_limit("p2p", tp)) GTEST_SKIP() << *limit;
  const ScopedEnv decode_on("LMOE_FUSED_DECODE", "1");  // whatever the environment says
  const long replays = soak_replays("LMOE_FUSED_SOAK_REPLAYS", 10000);
  constexpr long kCheckEvery = 1000;
  constexpr std::uint64_t kSeed = 20261209;
  constexpr std::int64_t kRows = 256;  // the workspace's rows: the general kernel's bound
  const DType dtype = DType::bf16;
  const std::int64_t d = kSmall.d_model, l = kSmall.d_latent;
  const std::size_t esize = lmoe::dtype_size(dtype);
  // Integer weights and gamma, eps 0: the inputs of every replay follow the same construction.
  const lmoe::TailCase weights = lmoe::make_exact_case(kSmall, dtype, tp, kRows, kSeed);
  struct Call {
    lmoe::cuda::FusedKernel kernel;
    std::int64_t bound;
    std::uint64_t seed;
  };
  struct Checkpoint {
    std::uint64_t counter = 0;
    std::vector<std::int32_t> tokens;             // per call
    std::vector<std::vector<std::byte>> outputs;  // per call: [bound, d]
  };
  std::vector<std::vector<Checkpoint>> checkpoints(tp);
  std::vector<unsigned long long> wrong_on_device(tp, ~0ull);
  std::vector<Call> calls;  // rank 0's; the bounds are agreed, so every rank's
  const auto comms = lmoe::make_p2p_thread_communicators(tp);
  lmoe::run_on_rank_threads(comms, [&](int rank, lmoe::Communicator& comm) {
    FusedRank state(comm, weights, kRows);
    lmoe::cuda::FusedTail& fused = *state.fused;
    std::vector<Call> rank_calls;
    for (const auto kernel : {lmoe::cuda::FusedKernel::decode, lmoe::cuda::FusedKernel::chained,
                              lmoe::cuda::FusedKernel::general}) {
      std::int64_t bound = 0;
      for (std::int64_t b = 1; b <= kRows; ++b) {
        if (fused.kernel_for(b) == kernel) bound = b;
      }
      if (bound > 0) rank_calls.push_back({kernel, bound, kSeed + 1 + rank_calls.size()});
    }
    if (rank == 0) calls = rank_calls;
    std::vector<DeviceBuffer> routed, shared, out, tokens;
    for (const Call& call : rank_calls) {
      routed.emplace_back(static_cast<std::size_t>(call.bound * l) * esize);
      shared.emplace_back(static_cast<std::size_t>(call.bound * d) * esize);
      out.emplace_back(static_cast<std::size_t>(call.bound * d) * esize);
      tokens.emplace_back(sizeof(std::int32_t));
    }
    const DeviceBuffer w_up(static_cast<std::size_t>(d * l) * esize),
        counter(sizeof(std::uint64_t)), wrong(sizeof(unsigned long long));
    cuda_ok(cudaMemcpy(w_up.data(), weights.up_proj_weight.data(), w_up.bytes(),
                       cudaMemcpyHostToDevice));
    cudaStream_t stream = nullptr;
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cuda_ok(cudaMemsetAsync(counter.data(), 0, counter.bytes(), stream));
    cuda_ok(cudaMemsetAsync(wrong.data(), 0, wrong.bytes(), stream));
    auto* replay = static_cast<std::uint64_t*>(counter.data());
    const auto issue = [&] {
      for (std::size_t k = 0; k < rank_calls.size(); ++k) {
        const Call& call = rank_calls[k];
        auto* call_tokens = static_cast<std::int32_t*>(tokens[k].data());
        // The poison first: a fused kernel launched programmatically then follows a kernel.
        cuda_ok(cudaMemsetAsync(out[k].data(), 0xff, out[k].bytes(), stream));
        cuda_ok(lmoe::cuda::launch_pick_replay_tokens(
            call_tokens, static_cast<std::int32_t>(call.bound), call.seed, replay, stream));
        cuda_ok(lmoe::cuda::launch_fill_replay_exact_tail(routed[k].data(), shared[k].data(),
                                                          call.bound, kSmall, dtype, call.seed,
                                                          rank, tp, replay, stream));
        fused.run(routed[k].data(), shared[k].data(), out[k].data(), call.bound, stream,
                  call_tokens);
        cuda_ok(lmoe::cuda::launch_count_wrong_replay_exact_tail(
            out[k].data(), call_tokens, call.bound, kSmall, dtype, w_up.data(),
            static_cast<const float*>(state.gamma.data()), call.seed, tp, replay,
            static_cast<unsigned long long*>(wrong.data()), stream));
      }
      cuda_ok(lmoe::cuda::launch_advance_replay(replay, stream));
    };
    const auto copy_out = [&] {
      Checkpoint& taken = checkpoints[static_cast<std::size_t>(rank)].emplace_back();
      cuda_ok(cudaMemcpy(&taken.counter, replay, sizeof(std::uint64_t), cudaMemcpyDeviceToHost));
      for (std::size_t k = 0; k < rank_calls.size(); ++k) {
        cuda_ok(cudaMemcpy(&taken.tokens.emplace_back(), tokens[k].data(), sizeof(std::int32_t),
                           cudaMemcpyDeviceToHost));
        taken.outputs.emplace_back(out[k].bytes());
        cuda_ok(cudaMemcpy(taken.outputs.back().data(), out[k].data(), out[k].bytes(),
                           cudaMemcpyDeviceToHost));
      }
    };
    soak_captured_replays(comm, stream, replays, kCheckEvery, issue, copy_out);
    cuda_ok(cudaMemcpy(&wrong_on_device[static_cast<std::size_t>(rank)], wrong.data(),
                       sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    cudaStreamDestroy(stream);
  });
  EXPECT_GE(calls.size(), 2u) << "the decode and general kernels run on every device";
  std::int64_t mismatches_on_host = 0;
  for (int r = 0; r < tp; ++r) {
    const auto rank = static_cast<std::size_t>(r);
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(wrong_on_device[rank], 0ull) << "elements wrong over every replay";
    ASSERT_FALSE(checkpoints[rank].empty());
    EXPECT_EQ(checkpoints[rank].back().counter, static_cast<std::uint64_t>(replays) + 1);
    for (const Checkpoint& taken : checkpoints[rank]) {
      const std::uint64_t last = taken.counter - 1;  // the replay whose outputs these are
      for (std::size_t k = 0; k < calls.size(); ++k) {
        const std::int64_t t = taken.tokens[k];
        SCOPED_TRACE(std::string(kernel_name(calls[k].kernel)) + " call of replay " +
                     std::to_string(last) + ", T=" + std::to_string(t));
        EXPECT_EQ(
            t, lmoe::bench::replay_tokens(calls[k].seed, last, static_cast<int>(calls[k].bound)));
        const lmoe::TailCase c = exact_case_of_replay(weights, calls[k].seed, last, t);
        const auto reference = lmoe::reference_tail(c, lmoe::contract_of(TailTier::fused));
        lmoe::HostTensor y(dtype, {t, d});
        std::memcpy(y.data(), taken.outputs[k].data(), y.nbytes());
        const lmoe::Comparison cmp = lmoe::compare(y.matrix(), reference, lmoe::exact_tail(c));
        EXPECT_EQ(cmp.bit_mismatches, 0);
        mismatches_on_host += cmp.bit_mismatches;
        EXPECT_EQ(written_from(taken.outputs[k], y.nbytes()), 0u) << "bytes written past T";
      }
    }
  }
  std::string kernels;
  for (const Call& call : calls) {
    kernels += (kernels.empty() ? "" : ", ") + std::string(kernel_name(call.kernel)) + " up to " +
               std::to_string(call.bound);
  }
  std::printf(
      "[ fused  ] soak: %ld graph replays per rank, tp=%d, the kernels in turn (%s), exact inputs "
      "from a replay counter: %llu wrong elements on the device, %lld at %zu checkpoints on the "
      "host\n",
      replays, tp, kernels.c_str(), wrong_on_device[0] + wrong_on_device[1],
      static_cast<long long>(mismatches_on_host), checkpoints[0].size());
}

}  // namespace

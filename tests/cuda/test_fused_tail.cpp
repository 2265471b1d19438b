// The fused decode tail (cuda/fused_tail.cuh) against the CPU contract, with its ranks sharing one
// GPU over the p2p communicator: every T of the issue (1 … 256, thresholds ±1), tp ∈ {1, 2, 4, 8},
// bf16 and f16, random inputs within the contract's bound and crafted inputs bit for bit, ±0 and
// subnormals, graph replays with T read on the device (a soak of many replays with changing T and
// inputs), a stalled rank, two calls at once on one workspace, and what it declines.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpu_test_support.hpp"
#include "cpu/cpu_math.hpp"
#include "cuda/device_buffer.hpp"
#include "cuda/fused_tail.hpp"
#include "cuda/launchers.hpp"
#include "lmoe/comm_group.hpp"
#include "lmoe/error.hpp"
#include "lmoe/latent_tail.hpp"
#include "lmoe/p2p_communicator.hpp"
#include "lmoe/reference.hpp"
#include "lmoe/tail_runner.hpp"
#include "lmoe/threads_communicator.hpp"

namespace {

using lmoe::DType;
using lmoe::TailTier;
using lmoe::cuda::DeviceBuffer;

const lmoe::TailDims kSmall{384, 192};  // d % (8·tp) == 0 for tp ≤ 8 (stripes of 48 … 384 columns)
const lmoe::TailDims kK3{7168, 3584};
const std::int64_t kIssueTokens[] = {1, 2, 5, 8, 16, 33, 64, 65, 128, 129, 256};

// The current device's compute capability as 10 · major + minor (the chained path runs on 90 only).
int compute_capability() {
  int device = 0, major = 0, minor = 0;
  cuda_ok(cudaGetDevice(&device));
  cuda_ok(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  cuda_ok(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return 10 * major + minor;
}

// The fused kernel sizes its grid so that the blocks of every rank on a GPU are resident at once,
// which ranks spinning on each other need: these tests run p2p ranks on one GPU, opted in for the
// duration of each test only (the library keeps p2p on a shared GPU opt-in, docs/p2p.md, and the
// other tests of this binary see its default).
class ScopedSharedGpu : public ScopedEnv {
 public:
  ScopedSharedGpu() : ScopedEnv("LMOE_P2P_SHARED_GPU", "1") {}
};

class Fused : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { lmoe::cpu::set_blas_threads(4); }
  ScopedSharedGpu shared_gpu_;
};

lmoe::CaseRun run_fused(const lmoe::TailCase& c, bool graph = false) {
  lmoe::RunOptions options;
  options.backend = lmoe::Backend::cuda;
  options.comm = "p2p";  // with one rank: no peers, but capturable (cuda-threads is not)
  options.tier = TailTier::fused;
  options.graph = graph;
  options.repeats = graph ? 2 : 1;
  return lmoe::run_case_on_threads(c, options);
}

void expect_meets_contract(const lmoe::TailCase& c, const lmoe::CaseRun& result, double* worst) {
  EXPECT_TRUE(result.ranks_identical);
  ASSERT_EQ(result.tier, TailTier::fused);
  const auto reference = lmoe::reference_tail(c, lmoe::contract_of(TailTier::fused));
  const lmoe::Comparison cmp = lmoe::compare(result.ranks[0].y.matrix(), reference, lmoe::exact_tail(c));
  EXPECT_EQ(cmp.beyond_bound, 0) << "max err/bound " << cmp.max_error_over_bound;
  EXPECT_LE(cmp.normwise_error, cmp.normwise_tolerance);
  *worst = std::max(*worst, cmp.max_error_over_bound);
}

// Random inputs within the contract's bound and crafted inputs bit for bit, at one (dims, dtype, tp, T).
void expect_random_and_crafted_inputs_pass(lmoe::TailDims dims, DType dtype, int tp, std::int64_t tokens,
                                           std::uint64_t seed, double* worst) {
  const lmoe::TailCase random = lmoe::make_random_case(dims, 1e-5f, dtype, tp, tokens, seed);
  expect_meets_contract(random, run_fused(random), worst);
  const lmoe::TailCase exact = lmoe::make_exact_case(dims, dtype, tp, tokens, seed);
  const lmoe::CaseRun exact_run = run_fused(exact);
  EXPECT_TRUE(exact_run.ranks_identical);
  const lmoe::Comparison cmp = lmoe::compare(exact_run.ranks[0].y.matrix(),
                                             lmoe::reference_tail(exact, lmoe::contract_of(TailTier::fused)),
                                             lmoe::exact_tail(exact));
  EXPECT_EQ(cmp.bit_mismatches, 0);
}

// Every rank's error (one per rank, by rank) names `what`.
void expect_every_rank_error(const std::vector<std::string>& errors, const std::string& what) {
  for (std::size_t r = 0; r < errors.size(); ++r)
    EXPECT_NE(errors[r].find(what), std::string::npos) << "rank " << r << ": " << errors[r];
}

class FusedParity : public ::testing::TestWithParam<std::tuple<int, DType>> {
 protected:
  static void SetUpTestSuite() { lmoe::cpu::set_blas_threads(4); }
  ScopedSharedGpu shared_gpu_;
};

TEST_P(FusedParity, EveryIssueTokenCountMeetsTheContractAndCraftedInputsMatchBitForBit) {
  SKIP_WITHOUT_GPU();
  const auto [tp, dtype] = GetParam();
  if (tp > 1) {
    if (auto limit = lmoe::comm_group_limit("p2p", tp)) GTEST_SKIP() << *limit;
  }
  double worst = 0;
  for (std::int64_t tokens : kIssueTokens) {
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
      const lmoe::CaseRun exact_run = run_fused(exact);
      EXPECT_TRUE(exact_run.ranks_identical);
      const lmoe::Comparison cmp = lmoe::compare(
          exact_run.ranks[0].y.matrix(),
          lmoe::reference_tail(exact, lmoe::contract_of(TailTier::fused)), lmoe::exact_tail(exact));
      EXPECT_EQ(cmp.bit_mismatches, 0);
    }
  }
  std::printf("[ fused  ] decode tp=%d %-4s T 1…16 ±norm max_err/bound=%.3f\n", tp,
              std::string(lmoe::dtype_name(dtype)).c_str(), worst);
}

INSTANTIATE_TEST_SUITE_P(TpDtype, FusedParity,
                         ::testing::Combine(::testing::Values(1, 2, 4, 8), ::testing::Values(DType::bf16, DType::f16)),
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
        SCOPED_TRACE("tp=" + std::to_string(tp) + " T=" + std::to_string(tokens) + (graph ? " graph" : " eager"));
        const lmoe::TailCase c = lmoe::make_random_case(kK3, 1e-5f, DType::bf16, tp, tokens, 77u + static_cast<std::uint64_t>(tokens));
        double worst = 0;
        expect_meets_contract(c, run_fused(c, graph), &worst);
        std::printf("[ fused  ] K3 tp=%d T=%lld %s max_err/bound=%.3f\n", tp, static_cast<long long>(tokens),
                    graph ? "graph" : "eager", worst);
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
      const float tiny = dtype == DType::bf16 ? std::ldexp(1.0f, -130) : std::ldexp(1.0f, -20);  // subnormal
      for (std::int64_t i = 0; i < c.routed.numel(); ++i) c.routed.set(i, 0.0f);
      for (std::int64_t i = 0; i < c.shared.numel(); ++i) {
        const std::int64_t r = i / (c.num_tokens * c.dims.d_model);
        c.shared.set(i, i % 3 == 0 ? -0.0f : (i % 3 == 1 ? tiny * static_cast<float>(r + 1) : -tiny));
      }
      const lmoe::CaseRun result = run_fused(c);
      EXPECT_TRUE(result.ranks_identical);
      const auto reference = lmoe::reference_tail(c, lmoe::contract_of(TailTier::fused));
      const lmoe::Comparison cmp = lmoe::compare(result.ranks[0].y.matrix(), reference, lmoe::exact_tail(c));
      EXPECT_EQ(cmp.bit_mismatches, 0) << "tp=" << tp << " " << lmoe::dtype_name(dtype);
      std::int64_t subnormals = 0;
      const lmoe::HostTensor& y = result.ranks[0].y;
      for (std::int64_t i = 0; i < y.numel(); ++i) {
        const float v = y.get(i);
        subnormals += v != 0.0f && std::fabs(v) < (dtype == DType::bf16 ? std::ldexp(1.0f, -126) : std::ldexp(1.0f, -14));
      }
      EXPECT_GT(subnormals, 0) << "the case must exercise subnormal outputs";
    }
  }
}

TEST_F(Fused, DeclinesWhatItCannotRunAndThePolicyFallsBack) {
  SKIP_WITHOUT_GPU();
  const lmoe::TailProblem f32{16, kSmall, DType::f32, 2};
  EXPECT_TRUE(lmoe::cuda_tier_limit(TailTier::fused, f32).has_value());
  const lmoe::TailProblem odd_stripe{16, {392, 192}, DType::bf16, 2};  // 392 / 2 = 196, not a multiple of 8
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

// One rank's device state for calling FusedTail directly (below LatentTail: no agreement exchange,
// so a rank can be made to stall on purpose).
struct FusedRank {
  DeviceBuffer w, gamma, routed, shared, out;
  std::unique_ptr<lmoe::cuda::FusedTail> fused;

  FusedRank(lmoe::Communicator& comm, const lmoe::TailCase& c, std::int64_t max_tokens) {
    const int rank = comm.rank();
    // The rank's GPU first (the p2p thread group's placement, rank % GPUs, as run_on_p2p_threads
    // sets it): buffers on another GPU would make this rank's stream-ordered copies cross GPUs.
    int gpus = 0;
    cuda_ok(cudaGetDeviceCount(&gpus));
    cuda_ok(cudaSetDevice(rank % gpus));
    const std::int64_t d = c.dims.d_model, l = c.dims.d_latent, s = d / comm.size(), t = c.num_tokens;
    const std::size_t esize = lmoe::dtype_size(c.dtype);
    w = DeviceBuffer(static_cast<std::size_t>(s * l) * esize);
    cuda_ok(cudaMemcpy(w.data(), c.up_proj_weight.data() + static_cast<std::size_t>(rank * s * l) * esize, w.bytes(),
                       cudaMemcpyHostToDevice));
    std::vector<float> g(static_cast<std::size_t>(l));
    for (std::int64_t j = 0; j < l; ++j) g[static_cast<std::size_t>(j)] = c.norm_weight.get(j);
    gamma = DeviceBuffer(g.size() * sizeof(float));
    cuda_ok(cudaMemcpy(gamma.data(), g.data(), gamma.bytes(), cudaMemcpyHostToDevice));
    routed = DeviceBuffer(static_cast<std::size_t>(max_tokens * l) * esize);
    shared = DeviceBuffer(static_cast<std::size_t>(max_tokens * d) * esize);
    out = DeviceBuffer(static_cast<std::size_t>(max_tokens * d) * esize);
    cuda_ok(cudaMemcpy(routed.data(), c.routed.slice_matrix(rank).data, static_cast<std::size_t>(t * l) * esize,
                       cudaMemcpyHostToDevice));
    cuda_ok(cudaMemcpy(shared.data(), c.shared.slice_matrix(rank).data, static_cast<std::size_t>(t * d) * esize,
                       cudaMemcpyHostToDevice));
    fused = std::make_unique<lmoe::cuda::FusedTail>(comm, c.dims, c.dtype, c.latent_norm, c.eps, w.data(),
                                                    static_cast<const float*>(gamma.data()), max_tokens);
  }
};

// One fused call of up to max_tokens rows with T read from tokens_device, captured on `stream` into
// *graph and instantiated into *exec.
void capture_fused_call(FusedRank& state, std::int64_t max_tokens, const void* tokens_device,
                        cudaStream_t stream, cudaGraph_t* graph, cudaGraphExec_t* exec) {
  cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  state.fused->run(state.routed.data(), state.shared.data(), state.out.data(), max_tokens, stream,
                   static_cast<const std::int32_t*>(tokens_device));
  cuda_ok(cudaStreamEndCapture(stream, graph));
  cuda_ok(cudaGraphInstantiate(exec, *graph, 0));
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
    EXPECT_NE(traced.find(std::string("[ fused trace ] ") + point + " "), std::string::npos) << point << "\n" << traced;
  }
  // With one rank there are no peers: no staging or stripe points.
  EXPECT_EQ(traced.find("stripes arrived"), std::string::npos) << traced;
  EXPECT_NE(traced.find("[ fused trace ] rank 0, decode kernel, grid "), std::string::npos)
      << traced;
  for (const char* point : {"inputs landed", "streamed"}) {
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
          // Later than rank 0's device timeout, so that rank 0's kernel reports the stall itself
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
    const DeviceBuffer routed(static_cast<std::size_t>(tokens * l) * 2), shared(static_cast<std::size_t>(tokens * d) * 2),
        out(static_cast<std::size_t>(tokens * d) * 2 + 16);
    void* out_data = static_cast<std::byte*>(out.data()) + (rank == 1 ? 2 : 0);  // bf16-aligned, not 16-byte
    const lmoe::ConstMatrixView routed_view{routed.data(), DType::bf16, tokens, l, l, lmoe::MemorySpace::device};
    const lmoe::MatrixView shared_view{shared.data(), DType::bf16, tokens, d, d, lmoe::MemorySpace::device};
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

// ---- The decode kernel (cuda/fused_decode.cuh): T ≤ 16
// -----------------------------------

// Which kernel ran: the general kernel counts its calls in the workspace, the chained path in its
// own, the decode kernel nowhere. Where the chained path runs (compute 9.0) the decode kernel takes
// up to 2 rows with one rank and up to 4 with 2 … 7 ranks (the call's T, or the bound of a call
// with T on the device), the chained path the rest up to 128; elsewhere the decode kernel up to 16
// and the general kernel above; 129 takes the general kernel everywhere.
// Each call's routed input is the previous call's output (d == l). The chained path's first kernel
// may start before the stream's previous kernel ends (it is launched programmatically and waits for
// it before reading anything), and the up-projection lets its successor start at once: every call
// must still read what the call before it wrote. Outputs poisoned, calls issued back to back
// (eager, then captured into one graph), each step checked against the contract on the input it
// had; with one rank the up-projection's first copies are paced (issued from a thread of their
// own while the producer waits for the norm kernel), so also with them all at once
// (LMOE_FUSED_CHAINED_PACE_NS=0); and with the up-projection waiting for the norm kernel's count
// instead of its end (LMOE_FUSED_CHAINED_HANDOFF=1), whose count must belong to each call.
TEST_F(Fused, ACallReadsWhatTheCallBeforeItWrote) {
  SKIP_WITHOUT_GPU();
  const lmoe::TailDims dims{384, 384};
  constexpr int kSteps = 4;
  for (int variant = 0; variant < 8; ++variant) {
    const bool graph = (variant & 1) != 0;
    const bool at_once = (variant & 2) != 0;
    const bool handoff = (variant & 4) != 0;
    const ScopedEnv pace("LMOE_FUSED_CHAINED_PACE_NS", at_once ? "0" : nullptr);
    const ScopedEnv count("LMOE_FUSED_CHAINED_HANDOFF", handoff ? "1" : nullptr);
    for (const std::int64_t tokens : {1, 5, 17}) {  // the decode kernel, then the chained path
      SCOPED_TRACE(std::string(graph ? "graph" : "eager") + " T=" + std::to_string(tokens) +
                   (at_once ? " first copies at once" : "") + (handoff ? " handoff" : ""));
      const lmoe::TailCase c = lmoe::make_random_case(dims, 1e-5f, DType::bf16, 1, tokens,
                                                      90u + static_cast<std::uint64_t>(tokens));
      const std::size_t bytes = static_cast<std::size_t>(tokens * dims.d_model) * 2;
      const auto comms = lmoe::make_p2p_thread_communicators(1, {});
      lmoe::run_on_rank_threads(comms, [&](int, lmoe::Communicator& comm) {
        FusedRank state(comm, c, tokens);
        std::vector<DeviceBuffer> outs;
        for (int k = 0; k < kSteps; ++k) {
          outs.emplace_back(bytes);
          cuda_ok(cudaMemset(outs.back().data(), 0xff, bytes));  // NaN: a read too early shows
        }
        cudaStream_t stream = nullptr;
        cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        const auto issue = [&] {
          const void* input = state.routed.data();
          for (int k = 0; k < kSteps; ++k) {
            state.fused->run(input, state.shared.data(), outs[k].data(), tokens, stream);
            input = outs[k].data();
          }
        };
        if (graph) {
          cudaGraph_t captured = nullptr;
          cudaGraphExec_t exec = nullptr;
          cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
          issue();
          cuda_ok(cudaStreamEndCapture(stream, &captured));
          cuda_ok(cudaGraphInstantiate(&exec, captured, 0));
          cuda_ok(cudaGraphLaunch(exec, stream));
          cuda_ok(cudaStreamSynchronize(stream));
          cuda_ok(cudaGraphExecDestroy(exec));
          cuda_ok(cudaGraphDestroy(captured));
        } else {
          issue();
        }
        cuda_ok(cudaStreamSynchronize(stream));
        cudaStreamDestroy(stream);
        lmoe::TailCase step = c;  // step k's inputs: routed = step k − 1's output
        for (int k = 0; k < kSteps; ++k) {
          SCOPED_TRACE("step " + std::to_string(k));
          lmoe::HostTensor y(DType::bf16, {tokens, dims.d_model});
          cuda_ok(cudaMemcpy(y.data(), outs[k].data(), bytes, cudaMemcpyDeviceToHost));
          const lmoe::Comparison cmp = lmoe::compare(
              y.matrix(), lmoe::reference_tail(step, lmoe::contract_of(TailTier::fused)),
              lmoe::exact_tail(step));
          EXPECT_EQ(cmp.beyond_bound, 0) << "max err/bound " << cmp.max_error_over_bound;
          std::memcpy(step.routed.data(), y.data(), bytes);
        }
      });
    }
  }
}

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
      // Each bound ±1: no decode with one rank, ≤ 4 (2 … 7 ranks) beside the chained path, else 16.
      for (std::int64_t tokens : {1, 2, 3, 4, 5, 16, 17, 128, 129}) {
        using lmoe::cuda::FusedKernel;
        const std::int64_t decode_bound = chained ? (tp == 1 ? 0 : 4) : 16;
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
// blocks with several ranks) outside [1, what the GPU allows] or not a number, and
// LMOE_FUSED_CHAINED_TILE_ROWS (the up-projection's tile) anything but 64 or 128: every rank's
// construction fails naming the variable, before any kernel of the call is launched (one rank and
// two; the exchange grid is read with several ranks only).
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
  };
  for (int tp : {1, 2}) {
    if (tp > 1 && lmoe::comm_group_limit("p2p", tp)) continue;
    const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, tp, 32, 44u);
    for (const Bad& bad : bads) {
      if (tp < bad.min_tp) continue;
      for (const char* value : bad.values) {
        SCOPED_TRACE(std::string(bad.variable) + "=" + value + " tp=" + std::to_string(tp));
        const ScopedEnv set(bad.variable, value);
        std::vector<std::string> errors(static_cast<std::size_t>(tp));
        const auto comms = lmoe::make_p2p_thread_communicators(tp, {});
        lmoe::run_on_rank_threads(comms, [&](int rank, lmoe::Communicator& comm) {
          try {
            FusedRank state(comm, c, 64);
          } catch (const lmoe::Error& error) {
            errors[static_cast<std::size_t>(rank)] = error.what();
          }
        });
        expect_every_rank_error(errors, bad.error);
      }
    }
  }
}

// The chained path splits K over the blocks of a cluster, a power of two up to 8 per tile of 64 or
// 128 rows, each block finishing tile / splits of the tile's rows (a reduce-scatter through
// distributed shared memory; a tile of 64 also adds its two consumers' halves of K). Shapes whose
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
      // T = 1 runs it where it runs, unless the chained path takes T = 1 (one rank on compute 9.0).
      const bool chained_takes_one = state.fused->chained_max_tokens() > 0 &&
                                     lmoe::cuda::fused_decode_beside_chained_tokens(tp) < 1;
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
  expect_every_rank_error(errors, "max_tokens must be the same on every rank");
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
        const lmoe::CaseRun exact_run = run_fused(exact);
        const lmoe::Comparison cmp =
            lmoe::compare(exact_run.ranks[0].y.matrix(),
                          lmoe::reference_tail(exact, lmoe::contract_of(TailTier::fused)),
                          lmoe::exact_tail(exact));
        EXPECT_EQ(cmp.bit_mismatches, 0);
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

// K3 dims with several ranks through the decode kernel (tp 2: 448 groups of the stripe, tp 8: 112,
// over the blocks the ranks sharing this GPU split; the chained path off, which would take T = 16
// at tp 2), T = 1 and 16, random inputs within the contract's bound and crafted inputs bit for bit
// (through LatentTail, as a model calls it).
TEST_F(Fused, DecodeK3WithSeveralRanksMeetsTheContract) {
  SKIP_WITHOUT_GPU();
  const ScopedEnv decode_on("LMOE_FUSED_DECODE", "1");  // whatever the environment says
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

// Graph replays with T and inputs changing between replays and no host work in the call: the
// kernel reads T on the device. Each replay's output is compared on the device with the eager
// result of the same inputs (itself checked against the contract), so a stale parity, a row left
// over from a longer call or a race in the protocol shows up as a counted mismatch. `kernel`: the
// fused kernel every call must take (the bound decides it: the eager calls pass the graph's bound
// with T on the device too, so that they run the kernel the replays run).
void soak_graph_replays(int tp, std::int64_t max_tokens,
                        const std::vector<std::int64_t>& set_tokens,
                        lmoe::cuda::FusedKernel kernel) {
  const char* env = std::getenv("LMOE_FUSED_SOAK_REPLAYS");
  const long replays = env ? std::atol(env) : 100000;
  std::vector<lmoe::TailCase> cases;
  for (std::size_t k = 0; k < set_tokens.size(); ++k) {
    cases.push_back(lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, tp, set_tokens[k], 500u + k));
  }
  // Every case uses the weights of the first (the graph holds one FusedTail per rank).
  for (std::size_t k = 1; k < cases.size(); ++k) {
    cases[k].norm_weight = cases[0].norm_weight;
    cases[k].up_proj_weight = cases[0].up_proj_weight;
  }
  std::vector<unsigned long long> mismatches(tp, ~0ull);
  std::vector<long> replayed(tp, 0);
  const auto comms = lmoe::make_p2p_thread_communicators(tp);
  lmoe::run_on_rank_threads(comms, [&](int rank, lmoe::Communicator& comm) {
    const std::size_t esize = 2;
    const std::int64_t d = kSmall.d_model, l = kSmall.d_latent;
    FusedRank state(comm, cases[0], max_tokens);
    EXPECT_EQ(state.fused->kernel_for(max_tokens), kernel)
        << state.fused->decode_limit().value_or("");
    // Per case, on the device: its inputs and the expected output (from an eager call below).
    std::vector<DeviceBuffer> routed, shared, expected;
    std::vector<std::int32_t> tokens_host;
    DeviceBuffer tokens_sets(set_tokens.size() * sizeof(std::int32_t)), tokens_now(sizeof(std::int32_t));
    for (std::size_t k = 0; k < cases.size(); ++k) {
      const std::int64_t t = set_tokens[k];
      routed.emplace_back(static_cast<std::size_t>(t * l) * esize);
      shared.emplace_back(static_cast<std::size_t>(t * d) * esize);
      expected.emplace_back(static_cast<std::size_t>(t * d) * esize);
      cuda_ok(cudaMemcpy(routed[k].data(), cases[k].routed.slice_matrix(rank).data, routed[k].bytes(), cudaMemcpyHostToDevice));
      cuda_ok(cudaMemcpy(shared[k].data(), cases[k].shared.slice_matrix(rank).data, shared[k].bytes(), cudaMemcpyHostToDevice));
      tokens_host.push_back(static_cast<std::int32_t>(t));
    }
    cuda_ok(cudaMemcpy(tokens_sets.data(), tokens_host.data(), tokens_sets.bytes(), cudaMemcpyHostToDevice));
    DeviceBuffer counter(sizeof(unsigned long long));
    cuda_ok(cudaMemset(counter.data(), 0, counter.bytes()));
    cudaStream_t stream = nullptr;
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    auto load_case = [&](std::size_t k) {
      const std::int64_t t = set_tokens[k];
      cuda_ok(cudaMemcpyAsync(state.routed.data(), routed[k].data(), routed[k].bytes(), cudaMemcpyDeviceToDevice, stream));
      cuda_ok(cudaMemcpyAsync(state.shared.data(), shared[k].data(), shared[k].bytes(), cudaMemcpyDeviceToDevice, stream));
      cuda_ok(cudaMemcpyAsync(tokens_now.data(), static_cast<std::int32_t*>(tokens_sets.data()) + k, sizeof(std::int32_t),
                              cudaMemcpyDeviceToDevice, stream));
      cuda_ok(cudaMemsetAsync(state.out.data(), 0xff, static_cast<std::size_t>(t * d) * esize, stream));
    };
    // The graph: one fused call of up to max_tokens rows, T from tokens_now.
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    capture_fused_call(state, max_tokens, tokens_now.data(), stream, &graph, &exec);
    cuda_ok(cudaGraphUpload(exec, stream));
    cuda_ok(cudaDeviceSynchronize());
    comm.barrier();
    // Eager calls give the expected outputs (checked against the contract on rank 0's thread below).
    for (std::size_t k = 0; k < cases.size(); ++k) {
      load_case(k);
      state.fused->run(state.routed.data(), state.shared.data(), state.out.data(), max_tokens,
                       stream, static_cast<const std::int32_t*>(tokens_now.data()));
      cuda_ok(cudaMemcpyAsync(expected[k].data(), state.out.data(), expected[k].bytes(), cudaMemcpyDeviceToDevice, stream));
    }
    cuda_ok(cudaStreamSynchronize(stream));
    comm.barrier();
    std::mt19937 order(12345);  // the same sequence of cases on every rank
    for (long i = 0; i < replays; ++i) {
      const std::size_t k = order() % cases.size();
      load_case(k);
      cuda_ok(cudaGraphLaunch(exec, stream));
      cuda_ok(lmoe::cuda::launch_count_differences(state.out.data(), expected[k].data(), static_cast<std::int64_t>(expected[k].bytes()),
                                                   static_cast<unsigned long long*>(counter.data()), stream));
      if (i % 4096 == 4095) cuda_ok(cudaStreamSynchronize(stream));  // bounded queue
      replayed[static_cast<std::size_t>(rank)] = i + 1;
    }
    cuda_ok(cudaStreamSynchronize(stream));
    comm.barrier();
    cuda_ok(cudaMemcpy(&mismatches[static_cast<std::size_t>(rank)], counter.data(), sizeof(unsigned long long),
                       cudaMemcpyDeviceToHost));
    // The expected outputs themselves against the contract.
    for (std::size_t k = 0; k < cases.size(); ++k) {
      lmoe::HostTensor y(DType::bf16, {set_tokens[k], d});
      cuda_ok(cudaMemcpy(y.data(), expected[k].data(), expected[k].bytes(), cudaMemcpyDeviceToHost));
      const lmoe::Comparison cmp = lmoe::compare(
          y.matrix(), lmoe::reference_tail(cases[k], lmoe::contract_of(TailTier::fused)), lmoe::exact_tail(cases[k]));
      EXPECT_EQ(cmp.beyond_bound, 0) << "case " << k << " rank " << rank;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
  });
  unsigned long long total = 0;
  for (int r = 0; r < tp; ++r) {
    EXPECT_EQ(replayed[static_cast<std::size_t>(r)], replays);
    EXPECT_EQ(mismatches[static_cast<std::size_t>(r)], 0ull) << "rank " << r;
    total += mismatches[static_cast<std::size_t>(r)];
  }
  std::string tokens_list;
  for (std::int64_t t : set_tokens)
    tokens_list += (tokens_list.empty() ? "" : ", ") + std::to_string(t);
  std::printf(
      "[ fused  ] soak: %ld graph replays per rank, tp=%d (%s kernel), T in {%s}: %llu mismatched "
      "bytes\n",
      replays, tp,
      kernel == lmoe::cuda::FusedKernel::decode    ? "decode"
      : kernel == lmoe::cuda::FusedKernel::chained ? "chained"
                                                   : "general",
      tokens_list.c_str(), total);
}

TEST_F(Fused, SoakOfGraphReplaysWithChangingTAndInputsHasNoMismatch) {
  SKIP_WITHOUT_GPU();
  if (lmoe::comm_group_limit("p2p", 2)) GTEST_SKIP() << "p2p with 2 ranks cannot run here";
  const ScopedEnv chained_off("LMOE_FUSED_CHAINED", "0");  // the general kernel at 17 … 64 too
  soak_graph_replays(2, 64, {1, 17, 64, 5}, lmoe::cuda::FusedKernel::general);
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

// LMOE_FUSED_CHAINED_HANDOFF=1 (one rank; experimental): the norm kernel's blocks count themselves
// once their rows are stored, the up-projection's producers wait for that count instead of for the
// norm kernel's end, and the call's last block past the wait takes the count back out before any
// block lets the next call's kernels launch. Crafted inputs bit for bit and random ones at every
// token class, eager and in graphs; then graph replays with T changing on the device (each replay's
// count must be its own: a stale count would copy the previous call's N, and the soak compares
// every replay with its own reference).
TEST_F(Fused, ChainedHandoffGivesTheContractsResults) {
  SKIP_WITHOUT_GPU();
  if (compute_capability() != 90) GTEST_SKIP() << "the chained path runs on compute 9.0 only";
  const ScopedEnv count("LMOE_FUSED_CHAINED_HANDOFF", "1");
  double worst = 0;
  for (const std::int64_t tokens : {1, 17, 33, 65, 128}) {
    SCOPED_TRACE("T=" + std::to_string(tokens));
    expect_random_and_crafted_inputs_pass(kSmall, DType::bf16, 1, tokens,
                                          500u + static_cast<std::uint64_t>(tokens), &worst);
  }
  expect_random_and_crafted_inputs_pass(kK3, DType::bf16, 1, 16, 532u, &worst);
  soak_graph_replays(1, 128, {17, 128, 1, 64, 33}, lmoe::cuda::FusedKernel::chained);
  std::printf("[ fused  ] chained, the norm's count handed off: max_err/bound=%.3f\n", worst);
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

}  // namespace

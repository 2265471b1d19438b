// The CUDA backend against the CPU contract: the same-GPU collectives bit for bit, and every tier ×
// tp × T × dtype within the contract's bound (random inputs) and bit for bit (crafted exact
// inputs), with all ranks sharing one GPU. Every test skips where no GPU is visible.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "core/host_math.hpp"
#include "core/rank_order_reduce.hpp"
#include "cuda/runtime/cuda_device_info.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "cuda/tail/cuda_tail_executor.hpp"
#include "gpu_test_support.hpp"
#include "lmoe/comm_group.hpp"
#include "lmoe/cuda_communicator.hpp"
#include "lmoe/error.hpp"
#include "lmoe/latent_tail.hpp"
#include "lmoe/reference.hpp"
#include "lmoe/tools/tail_runner.hpp"

namespace {

using lmoe::DType;
using lmoe::TailTier;

const lmoe::TailDims kSmall{384, 192};  // divisible by 8·tp for tp ∈ {1, 2, 4, 8}
const lmoe::TailDims kK3{7168, 3584};

constexpr TailTier kGpuTiers[] = {TailTier::overlap, TailTier::column, TailTier::token,
                                  TailTier::fused};

// The GPU communicators that keep the contract's rank-order sums (bit for bit on every rank).
const char* const kExactComms[] = {"cuda-threads", "p2p"};

// Skips the test when the communicator cannot host tp ranks on this machine (comm_group_limit).
#define SKIP_UNLESS_COMM_CAN_RUN(comm, tp)                                     \
  do {                                                                         \
    if (auto limit = lmoe::comm_group_limit(comm, tp)) GTEST_SKIP() << *limit; \
  } while (0)

// Where the fused kernel declines (its own tests: test_fused_tail.cpp): f32, more than 256 tokens,
// and several ranks over a communicator whose workspaces it cannot read (anything but p2p).
bool fused_declines(const std::string& comm, int tp, DType dtype, std::int64_t tokens) {
  return dtype == DType::f32 || tokens > 256 || (tp > 1 && comm != "p2p");
}

lmoe::CaseRun run_gpu(const lmoe::TailCase& c, TailTier tier, const std::string& comm,
                      bool graph = false) {
  lmoe::RunOptions options;
  options.backend = lmoe::Backend::cuda;
  options.comm = comm;
  options.tier = tier;
  options.graph = graph;
  options.repeats =
      graph ? 2 : 1;  // a graph is replayed twice: the second replay must not see the first's state
  return lmoe::run_case_on_threads(c, options);
}

// `tier` on the GPU, rank 0's output compared with the contract's reference; every rank must return
// the same bits and run the tier asked for.
lmoe::Comparison run_and_compare(const lmoe::TailCase& c, TailTier tier, const std::string& comm,
                                 bool graph) {
  const lmoe::CaseRun result = run_gpu(c, tier, comm, graph);
  EXPECT_TRUE(result.ranks_identical);
  EXPECT_EQ(result.tier, tier);
  const auto reference = lmoe::reference_tail(c, lmoe::contract_of(tier));
  return lmoe::compare(result.ranks[0].y.matrix(), reference, lmoe::exact_tail(c));
}

std::vector<std::int64_t> token_counts(int tp) {
  std::set<std::int64_t> tokens = {1, 7, 129, 257, 300, 1024};
  for (std::int64_t t : {tp - 1, tp}) {
    if (t > 0) tokens.insert(t);
  }
  return {tokens.begin(), tokens.end()};
}

// ---- collectives -------------------------------------------------------------------------------

// Values with a few significant bits so that any order of the rank sum is exact in every dtype,
// and random ones compared with the host's rank-order reduce, which is the contract's sum.
std::vector<float> collective_input(int rank, std::size_t count, bool exact, std::uint64_t seed) {
  std::mt19937_64 rng(seed * 131 + static_cast<std::uint64_t>(rank));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> small(-8, 8);
  std::vector<float> values(count);
  for (auto& v : values) v = exact ? static_cast<float>(small(rng)) * 0.25f : normal(rng);
  return values;
}

class CudaCollectives : public ::testing::TestWithParam<std::tuple<std::string, int, DType>> {};

TEST_P(CudaCollectives, MatchTheHostRankOrderSumBitForBit) {
  SKIP_WITHOUT_GPU();
  const auto [comm_name, tp, dtype] = GetParam();
  SKIP_UNLESS_COMM_CAN_RUN(comm_name, tp);
  const std::size_t esize = lmoe::dtype_size(dtype);
  for (bool exact : {true, false}) {
    for (std::size_t count :
         {std::size_t{1}, std::size_t{7}, std::size_t{4096 + 3}, std::size_t{1} << 20}) {
      SCOPED_TRACE("count " + std::to_string(count) + (exact ? " exact" : " random"));
      // Host inputs in the storage dtype and the expected sums.
      std::vector<std::vector<std::byte>> inputs(static_cast<std::size_t>(tp));
      std::vector<const void*> input_ptrs;
      for (int r = 0; r < tp; ++r) {
        const auto values = collective_input(r, count, exact, count);
        inputs[r].resize(count * esize);
        for (std::size_t i = 0; i < count; ++i)
          lmoe::store_from_float(inputs[r].data(), i, dtype, values[i]);
        input_ptrs.push_back(inputs[r].data());
      }
      std::vector<std::byte> expected(count * esize);
      lmoe::reduce_in_rank_order(input_ptrs, expected.data(), count, dtype);
      const auto offsets = lmoe::even_split_offsets(count, tp);
      std::vector<std::size_t> counts;
      for (int r = 0; r < tp; ++r) counts.push_back(offsets[r + 1] - offsets[r]);

      std::vector<std::vector<std::byte>> all_reduced(tp), scattered(tp), gathered(tp);
      lmoe::run_comm_group(comm_name, tp, [&](int rank, lmoe::Communicator& comm) {
        EXPECT_EQ(comm.memory_space(), lmoe::MemorySpace::device);
        void* buffer = nullptr;
        void* other = nullptr;
        cuda_ok(cudaMalloc(&buffer, count * esize));
        cuda_ok(cudaMalloc(&other, count * esize));
        cuda_ok(cudaMemcpy(buffer, inputs[rank].data(), count * esize, cudaMemcpyHostToDevice));
        cudaStream_t stream = nullptr;
        cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        // p2p ranks share the GPU and spin on each other: setup and teardown (which may wait for
        // the whole GPU) stay outside the collectives, between barriers.
        // reduce-scatter out of place, then all-reduce in place (recv == send), then all-gather of
        // the scattered blocks in place (each rank's block already sits at its offset).
        cuda_ok(cudaMemsetAsync(other, 0xff, count * esize, stream));
        void* my_block = static_cast<std::byte*>(other) + offsets[rank] * esize;
        // Results are copied out only after every rank's collectives have finished (the barrier):
        // a synchronous copy waits for the GPU, which a peer's spinning round may be occupying.
        void* scattered_copy = nullptr;
        cuda_ok(cudaMalloc(&scattered_copy, std::max<std::size_t>(counts[rank], 1) * esize));
        cuda_ok(cudaDeviceSynchronize());
        comm.barrier();
        comm.reduce_scatter(buffer, my_block, counts, dtype, stream);
        if (counts[rank]) {
          cuda_ok(cudaMemcpyAsync(scattered_copy, my_block, counts[rank] * esize,
                                  cudaMemcpyDeviceToDevice, stream));
        }
        comm.all_reduce(buffer, buffer, count, dtype, stream);
        comm.all_gather(my_block, other, counts, dtype, stream);
        cuda_ok(cudaStreamSynchronize(stream));
        comm.barrier();
        auto& s = scattered[rank];
        s.resize(counts[rank] * esize);
        if (!s.empty())
          cuda_ok(cudaMemcpy(s.data(), scattered_copy, s.size(), cudaMemcpyDeviceToHost));
        all_reduced[rank].resize(count * esize);
        gathered[rank].resize(count * esize);
        cuda_ok(
            cudaMemcpy(all_reduced[rank].data(), buffer, count * esize, cudaMemcpyDeviceToHost));
        cuda_ok(cudaMemcpy(gathered[rank].data(), other, count * esize, cudaMemcpyDeviceToHost));
        cuda_ok(cudaFree(scattered_copy));
        cuda_ok(cudaStreamDestroy(stream));
        cuda_ok(cudaFree(buffer));
        cuda_ok(cudaFree(other));
      });
      for (int r = 0; r < tp; ++r) {
        EXPECT_EQ(0, std::memcmp(all_reduced[r].data(), expected.data(), expected.size()))
            << "all_reduce rank " << r;
        EXPECT_EQ(0, std::memcmp(gathered[r].data(), expected.data(), expected.size()))
            << "all_gather rank " << r;
        EXPECT_EQ(0, std::memcmp(scattered[r].data(), expected.data() + offsets[r] * esize,
                                 scattered[r].size()))
            << "reduce_scatter rank " << r;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(CommTpDtype, CudaCollectives,
                         ::testing::Combine(::testing::Values(std::string("cuda-threads"),
                                                              std::string("p2p")),
                                            ::testing::Values(1, 2, 3, 4, 8),
                                            ::testing::Values(DType::bf16, DType::f16, DType::f32)),
                         [](const auto& info) {
                           std::string comm = std::get<0>(info.param);
                           std::replace(comm.begin(), comm.end(), '-', '_');
                           return comm + "_tp" + std::to_string(std::get<1>(info.param)) + "_" +
                                  std::string(lmoe::dtype_name(std::get<2>(info.param)));
                         });

TEST(CudaCollectives, RejectsWrongCountsAndTooManyRanks) {
  SKIP_WITHOUT_GPU();
  EXPECT_THROW(lmoe::make_cuda_thread_communicators(17, 0), lmoe::Error);
  EXPECT_THROW(lmoe::run_on_cuda_threads(2, 0,
                                         [](int, lmoe::Communicator& comm) {
                                           const std::vector<std::size_t> counts = {1};
                                           comm.all_gather(nullptr, nullptr, counts, DType::f32,
                                                           nullptr);
                                         }),
               lmoe::Error);
}

// ---- the tail ----------------------------------------------------------------------------------

struct ParityParam {
  std::string comm;
  int tp;
  DType dtype;
  bool graph = false;  // captured once, replayed (p2p only: cuda-threads cannot be captured)
};

class CudaTailParity : public ::testing::TestWithParam<ParityParam> {
 protected:
  static void SetUpTestSuite() { lmoe::cpu::set_blas_threads(4); }
};

TEST_P(CudaTailParity, EveryTierMeetsItsContractAndFp64) {
  SKIP_WITHOUT_GPU();
  const auto [comm, tp, dtype, graph] = GetParam();
  SKIP_UNLESS_COMM_CAN_RUN(comm, tp);
  for (TailTier tier : kGpuTiers) {
    std::int64_t elements = 0, mismatches = 0;
    double worst = 0;
    for (std::int64_t tokens : token_counts(tp)) {
      SCOPED_TRACE("tier " + std::string(lmoe::tier_name(tier)) + " T=" + std::to_string(tokens));
      const std::uint64_t seed =
          1000u * static_cast<std::uint64_t>(tp) + static_cast<std::uint64_t>(tokens);
      const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, dtype, tp, tokens, seed);
      if ((tier == TailTier::token && tokens < tp) ||
          (tier == TailTier::fused && fused_declines(comm, tp, dtype, tokens))) {
        EXPECT_THROW(run_gpu(c, tier, comm, graph), lmoe::Error);  // declined, with the reason
        continue;
      }
      const lmoe::Comparison cmp = run_and_compare(c, tier, comm, graph);
      EXPECT_EQ(cmp.beyond_bound, 0) << "max err/bound " << cmp.max_error_over_bound;
      EXPECT_LE(cmp.normwise_error, cmp.normwise_tolerance);
      elements += cmp.elements;
      mismatches += cmp.bit_mismatches;
      worst = std::max(worst, cmp.max_error_over_bound);
    }
    // Not asserted (the GEMM's order is free): how far cuBLASLt's order moves results.
    std::printf(
        "[ parity ] %-12s%s %-7s tp=%d %-4s elements=%lld bit_mismatches=%lld max_err/bound=%.3f\n",
        comm.c_str(), graph ? "+graph" : "      ", std::string(lmoe::tier_name(tier)).c_str(), tp,
        std::string(lmoe::dtype_name(dtype)).c_str(), static_cast<long long>(elements),
        static_cast<long long>(mismatches), worst);
  }
}

TEST_P(CudaTailParity, CraftedExactInputsMatchBitForBit) {
  SKIP_WITHOUT_GPU();
  const auto [comm, tp, dtype, graph] = GetParam();
  SKIP_UNLESS_COMM_CAN_RUN(comm, tp);
  for (std::int64_t tokens :
       {std::int64_t{1}, std::int64_t{tp}, std::int64_t{37}, std::int64_t{300}}) {
    const lmoe::TailCase c =
        lmoe::make_exact_case(kSmall, dtype, tp, tokens, 77u + static_cast<std::uint64_t>(tokens));
    for (TailTier tier : kGpuTiers) {
      if (tier == TailTier::token && tokens < tp) continue;  // declined: covered by the random test
      if (tier == TailTier::fused && fused_declines(comm, tp, dtype, tokens)) continue;
      SCOPED_TRACE("tier " + std::string(lmoe::tier_name(tier)) + " T=" + std::to_string(tokens));
      const lmoe::Comparison cmp = run_and_compare(c, tier, comm, graph);
      EXPECT_EQ(cmp.bit_mismatches, 0);
    }
  }
}

std::vector<ParityParam> parity_params() {
  std::vector<ParityParam> params;
  for (const char* comm : kExactComms) {
    for (const auto& [tp, dtype] : {std::pair{1, DType::bf16},
                                    {2, DType::bf16},
                                    {4, DType::bf16},
                                    {8, DType::bf16},
                                    {2, DType::f16},
                                    {8, DType::f16},
                                    {2, DType::f32},
                                    {8, DType::f32}}) {
      params.push_back({comm, tp, dtype});
    }
  }
  for (int tp : {1, 2, 4, 8}) params.push_back({"p2p", tp, DType::bf16, true});
  params.push_back({"p2p", 8, DType::f32, true});
  return params;
}

INSTANTIATE_TEST_SUITE_P(CommTpDtype, CudaTailParity, ::testing::ValuesIn(parity_params()),
                         [](const auto& info) {
                           std::string comm = info.param.comm;
                           std::replace(comm.begin(), comm.end(), '-', '_');
                           return comm + (info.param.graph ? "_graph" : "") + "_tp" +
                                  std::to_string(info.param.tp) + "_" +
                                  std::string(lmoe::dtype_name(info.param.dtype));
                         });

TEST(CudaTailK3, Bf16Tp8AtModelDims) {
  SKIP_WITHOUT_GPU();
  for (std::int64_t tokens : {std::int64_t{1}, std::int64_t{129}}) {
    const lmoe::TailCase c = lmoe::make_random_case(kK3, 1e-5f, DType::bf16, 8, tokens,
                                                    4242u + static_cast<std::uint64_t>(tokens));
    const std::vector<double> exact = lmoe::exact_tail(c);
    for (const char* comm : kExactComms) {
      if (auto limit = lmoe::comm_group_limit(comm, 8)) {
        std::printf("[ k3     ] %s skipped: %s\n", comm, limit->c_str());
        continue;
      }
      for (TailTier tier :
           {TailTier::overlap, TailTier::column, TailTier::token, TailTier::fused}) {
        if (tier == TailTier::token && tokens < 8) continue;
        if (tier == TailTier::fused && fused_declines(comm, 8, DType::bf16, tokens)) continue;
        SCOPED_TRACE(std::string(comm) + " tier " + std::string(lmoe::tier_name(tier)) +
                     " T=" + std::to_string(tokens));
        lmoe::RunOptions options;
        options.backend = lmoe::Backend::cuda;
        options.comm = comm;
        options.tier = tier;
        options.repeats = 5;  // the median is printed for information only (host barriers included)
        const lmoe::CaseRun result = lmoe::run_case_on_threads(c, options);
        EXPECT_TRUE(result.ranks_identical);
        const auto reference = lmoe::reference_tail(c, lmoe::contract_of(tier));
        const lmoe::Comparison cmp = lmoe::compare(result.ranks[0].y.matrix(), reference, exact);
        EXPECT_EQ(cmp.beyond_bound, 0) << "max err/bound " << cmp.max_error_over_bound;
        EXPECT_LE(cmp.normwise_error, cmp.normwise_tolerance);
        std::printf(
            "[ k3     ] %-12s %-7s T=%lld bit_mismatches=%lld/%lld max_err/bound=%.3f "
            "normwise=%.2e median_ms=%.3f\n",
            comm, std::string(lmoe::tier_name(tier)).c_str(), static_cast<long long>(tokens),
            static_cast<long long>(cmp.bit_mismatches), static_cast<long long>(cmp.elements),
            cmp.max_error_over_bound, cmp.normwise_error, result.median_seconds * 1e3);
      }
    }
  }
}

// tp = 1, fused: the one-launch kernel (norm, tensor-core product and add) over cuda-threads (no
// peers to read), bf16 and f16 (f32 is declined), T around 16, against the contract (random
// inputs) and bit for bit (crafted exact inputs), small and K3 dims.
TEST(CudaTailTp1, FusedOneLaunchPathMeetsTheContract) {
  SKIP_WITHOUT_GPU();
  const lmoe::TailCase f32 = lmoe::make_random_case(kSmall, 1e-5f, DType::f32, 1, 4, 3u);
  EXPECT_THROW(run_gpu(f32, TailTier::fused, "cuda-threads"), lmoe::Error);
  for (const lmoe::TailDims dims : {kSmall, kK3}) {
    for (DType dtype : {DType::bf16, DType::f16}) {
      for (std::int64_t tokens : {1, 2, 5, 8, 15, 16, 17}) {
        SCOPED_TRACE("d=" + std::to_string(dims.d_model) + " " +
                     std::string(lmoe::dtype_name(dtype)) + " T=" + std::to_string(tokens));
        const auto seed =
            static_cast<std::uint64_t>(tokens) * 7 + static_cast<std::uint64_t>(dtype);
        const lmoe::TailCase random = lmoe::make_random_case(dims, 1e-5f, dtype, 1, tokens, seed);
        const lmoe::CaseRun result = run_gpu(random, TailTier::fused, "cuda-threads");
        const auto reference = lmoe::reference_tail(random, lmoe::contract_of(TailTier::fused));
        const lmoe::Comparison cmp =
            lmoe::compare(result.ranks[0].y.matrix(), reference, lmoe::exact_tail(random));
        EXPECT_EQ(cmp.beyond_bound, 0) << "max err/bound " << cmp.max_error_over_bound;
        EXPECT_LE(cmp.normwise_error, cmp.normwise_tolerance);
        const lmoe::TailCase exact = lmoe::make_exact_case(dims, dtype, 1, tokens, seed);
        const lmoe::CaseRun exact_result = run_gpu(exact, TailTier::fused, "cuda-threads");
        const lmoe::Comparison exact_cmp =
            lmoe::compare(exact_result.ranks[0].y.matrix(),
                          lmoe::reference_tail(exact, lmoe::contract_of(TailTier::fused)),
                          lmoe::exact_tail(exact));
        EXPECT_EQ(exact_cmp.bit_mismatches, 0);
      }
    }
  }
}

// One LatentTail per rank across calls whose T grows and shrinks (the workspaces grow on demand),
// with out = shared (allowed by the API) and a null stream (the thread's default stream).
TEST(CudaTail, OutMayBeSharedOnTheDefaultStreamAsTGrowsAndShrinks) {
  SKIP_WITHOUT_GPU();
  const int tp = 4;
  const std::vector<std::int64_t> token_steps = {5, 300, 64};
  std::vector<lmoe::TailCase> cases;
  for (std::int64_t tokens : token_steps) {
    cases.push_back(lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, tp, tokens,
                                           900u + static_cast<std::uint64_t>(tokens)));
    cases.back().norm_weight = cases.front().norm_weight;  // one tail, one set of weights
    cases.back().up_proj_weight = cases.front().up_proj_weight;
  }
  for (const char* comm_name : kExactComms) {
    if (lmoe::comm_group_limit(comm_name, tp))
      continue;  // p2p on one GPU: opt-in (LMOE_P2P_SHARED_GPU)
    for (TailTier tier : kGpuTiers) {
      if (tier == TailTier::fused) continue;  // T = 300 is beyond fused's workspace (declined)
      SCOPED_TRACE(std::string(comm_name) + " tier " + std::string(lmoe::tier_name(tier)));
      std::vector<std::vector<lmoe::HostTensor>> outputs(cases.size(),
                                                         std::vector<lmoe::HostTensor>(tp));
      lmoe::run_comm_group(comm_name, tp, [&](int rank, lmoe::Communicator& comm) {
        lmoe::TailOptions options;
        options.dims = kSmall;
        options.backend = lmoe::Backend::cuda;
        // p2p ranks spin on each other on one GPU, so no rank may allocate (grow a workspace) while
        // a peer's collective is in flight: there the workspaces are sized once, and T moves within
        // them.
        if (std::string(comm_name) == "p2p") options.max_tokens = 300;
        lmoe::LatentTail tail(options, comm, cases[0].norm_weight.matrix(),
                              cases[0].up_proj_weight.matrix());
        for (std::size_t i = 0; i < cases.size(); ++i) {
          const lmoe::TailCase& c = cases[i];
          const std::int64_t tokens = c.num_tokens;
          const lmoe::ConstMatrixView routed_in = c.routed.slice_matrix(rank),
                                      shared_in = c.shared.slice_matrix(rank);
          const std::size_t routed_bytes = static_cast<std::size_t>(tokens * kSmall.d_latent) * 2;
          const std::size_t shared_bytes = static_cast<std::size_t>(tokens * kSmall.d_model) * 2;
          const lmoe::cuda::DeviceBuffer routed(routed_bytes), shared(shared_bytes);
          cuda_ok(cudaMemcpy(routed.data(), routed_in.data, routed_bytes, cudaMemcpyHostToDevice));
          cuda_ok(cudaMemcpy(shared.data(), shared_in.data, shared_bytes, cudaMemcpyHostToDevice));
          const lmoe::MatrixView shared_view{shared.data(),  DType::bf16,
                                             tokens,         kSmall.d_model,
                                             kSmall.d_model, lmoe::MemorySpace::device};
          const lmoe::ConstMatrixView routed_view{routed.data(),   DType::bf16,
                                                  tokens,          kSmall.d_latent,
                                                  kSmall.d_latent, lmoe::MemorySpace::device};
          cuda_ok(cudaDeviceSynchronize());
          comm.barrier();  // every rank's buffers exist before any rank's collectives spin
          EXPECT_EQ(tail.forward(routed_view, shared_view, shared_view, tier), tier);
          cuda_ok(cudaStreamSynchronize(cudaStreamPerThread));
          comm.barrier();  // and nobody frees them (a GPU-wide wait) while a peer still spins
          outputs[i][rank] = lmoe::HostTensor(DType::bf16, {tokens, kSmall.d_model});
          cuda_ok(cudaMemcpy(outputs[i][rank].data(), shared.data(), shared_bytes,
                             cudaMemcpyDeviceToHost));
        }
      });
      for (std::size_t i = 0; i < cases.size(); ++i) {
        SCOPED_TRACE("T=" + std::to_string(cases[i].num_tokens));
        expect_ranks_alike_within_contract(outputs[i], cases[i], tier);
      }
    }
  }
}

// A bad shape on one rank must fail every rank with the same message before anything is launched
// (the ranks agree over the communicator's host control path, not through device collectives).
TEST(CudaTail, BadInputOnOneRankFailsEveryRankAlike) {
  SKIP_WITHOUT_GPU();
  const int tp = 4;
  const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, tp, 4, 31u);
  for (const char* comm_name : kExactComms) {
    if (lmoe::comm_group_limit(comm_name, tp)) continue;
    SCOPED_TRACE(comm_name);
    std::vector<std::string> messages(tp);
    lmoe::run_comm_group(comm_name, tp, [&](int rank, lmoe::Communicator& comm) {
      lmoe::TailOptions options;
      options.dims = kSmall;
      options.backend = lmoe::Backend::cuda;
      lmoe::LatentTail tail(options, comm, c.norm_weight.matrix(), c.up_proj_weight.matrix());
      const std::int64_t out_rows = rank == 2 ? 3 : 4;
      const lmoe::cuda::DeviceBuffer routed(4 * kSmall.d_latent * 2),
          shared(4 * kSmall.d_model * 2), out(out_rows * kSmall.d_model * 2);
      const lmoe::ConstMatrixView routed_view{
          routed.data(),   DType::bf16,     4,
          kSmall.d_latent, kSmall.d_latent, lmoe::MemorySpace::device};
      const lmoe::MatrixView shared_view{shared.data(),  DType::bf16,    4,
                                         kSmall.d_model, kSmall.d_model, lmoe::MemorySpace::device};
      const lmoe::MatrixView out_view{out.data(),     DType::bf16,    out_rows,
                                      kSmall.d_model, kSmall.d_model, lmoe::MemorySpace::device};
      try {
        tail.forward(routed_view, shared_view, out_view);
      } catch (const lmoe::Error& error) {
        messages[rank] = error.message();
      }
    });
    for (int rank = 0; rank < tp; ++rank) {
      EXPECT_EQ(messages[rank], "rank 2: out: expected shape [4, 384], got [3, 384]")
          << "rank " << rank;
    }
  }
}

TEST(CudaTail, DeclinesWhatItCannotRunWithAReason) {
  const lmoe::TailProblem odd{16, {100, 60}, DType::bf16, 2};
  const auto reason = lmoe::cuda_tier_limit(TailTier::overlap, odd);
  ASSERT_TRUE(reason.has_value());
  EXPECT_NE(reason->find("multiples of 8"), std::string::npos) << *reason;
  EXPECT_FALSE(lmoe::cuda_tier_limit(TailTier::token, {16, kSmall, DType::bf16, 8}).has_value());
}

}  // namespace

// The token tier pipelined over chunks of rows (LMOE_TOKEN_CHUNKS, read when the tail is built):
// chunk counts that divide T and that do not, more chunks than T / tp allows (clamped), eager and
// captured, on every communicator with two ranks; each against the contract and every rank alike.
TEST(CudaTokenChunks, EveryChunkCountMeetsTheContract) {
  SKIP_WITHOUT_GPU();
  for (const char* comm : {"cuda-threads", "p2p", "nccl"}) {
    if (auto limit = lmoe::comm_group_limit(comm, 2)) {
      std::printf("[ chunks ] %s skipped: %s\n", comm, limit->c_str());
      continue;
    }
    for (const char* chunks : {"1", "2", "3", "8"}) {
      ScopedEnv env("LMOE_TOKEN_CHUNKS", chunks);
      for (std::int64_t tokens :
           {std::int64_t{2}, std::int64_t{5}, std::int64_t{37}, std::int64_t{300}}) {
        for (bool graph : {false, true}) {
          if (graph && std::string(comm) == "cuda-threads") continue;  // synchronizes on the host
          const std::string where = std::string(comm) + " chunks=" + chunks +
                                    " T=" + std::to_string(tokens) + (graph ? " graph" : "");
          SCOPED_TRACE(where);
          std::printf("[ chunks ] %s\n", where.c_str());  // an exception names no case
          std::fflush(stdout);
          const lmoe::TailCase c =
              lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, 2, tokens, 77u + tokens);
          const lmoe::CaseRun result = run_gpu(c, TailTier::token, comm, graph);
          EXPECT_TRUE(result.ranks_identical);
          const auto reference = lmoe::reference_tail(c, lmoe::contract_of(TailTier::token));
          const lmoe::Comparison cmp =
              lmoe::compare(result.ranks[0].y.matrix(), reference, lmoe::exact_tail(c));
          EXPECT_EQ(cmp.beyond_bound, 0) << "max err/bound " << cmp.max_error_over_bound;
        }
      }
    }
  }
}

TEST(CudaTokenChunks, AChunkCountOutOfRangeIsAnErrorNamingTheVariable) {
  SKIP_WITHOUT_GPU();
  for (const char* bad : {"0", "9", "two"}) {
    ScopedEnv env("LMOE_TOKEN_CHUNKS", bad);
    const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, 1, 4, 5u);
    try {
      run_gpu(c, TailTier::token, "cuda-threads");
      ADD_FAILURE() << "LMOE_TOKEN_CHUNKS=" << bad << " was accepted";
    } catch (const lmoe::Error& e) {
      EXPECT_NE(std::string(e.what()).find("LMOE_TOKEN_CHUNKS"), std::string::npos) << e.what();
    }
  }
}

// latent_norm = false (Nemotron 3): N is the reduced latent itself. Every tier, fused included,
// on one and two ranks, against the contract; crafted exact inputs bit for bit; and the flag
// changes the result.
TEST(CudaTail, WithoutTheLatentNormEveryTierMeetsItsContract) {
  SKIP_WITHOUT_GPU();
  for (const char* comm : kExactComms) {
    for (int tp : {1, 2}) {
      if (lmoe::comm_group_limit(comm, tp)) continue;
      for (std::int64_t tokens : {std::int64_t{1}, std::int64_t{7}, std::int64_t{129}}) {
        lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, tp, tokens,
                                                  41u + static_cast<std::uint64_t>(tokens));
        c.latent_norm = false;
        lmoe::TailCase crafted = lmoe::make_exact_case(kSmall, DType::bf16, tp, tokens,
                                                       7u + static_cast<std::uint64_t>(tokens));
        crafted.latent_norm = false;
        for (TailTier tier : kGpuTiers) {
          if (tier == TailTier::token && tokens < tp) continue;
          if (tier == TailTier::fused && fused_declines(comm, tp, DType::bf16, tokens)) continue;
          SCOPED_TRACE(std::string(comm) + " tp=" + std::to_string(tp) +
                       " T=" + std::to_string(tokens) + " " + std::string(lmoe::tier_name(tier)));
          const lmoe::CaseRun result = run_gpu(c, tier, comm);
          EXPECT_TRUE(result.ranks_identical);
          const lmoe::Comparison cmp =
              lmoe::compare(result.ranks[0].y.matrix(),
                            lmoe::reference_tail(c, lmoe::contract_of(tier)), lmoe::exact_tail(c));
          EXPECT_EQ(cmp.beyond_bound, 0) << "max err/bound " << cmp.max_error_over_bound;
          const lmoe::CaseRun exact = run_gpu(crafted, tier, comm);
          EXPECT_EQ(lmoe::compare(exact.ranks[0].y.matrix(),
                                  lmoe::reference_tail(crafted, lmoe::contract_of(tier)),
                                  lmoe::exact_tail(crafted))
                        .bit_mismatches,
                    0);
          lmoe::TailCase normed = c;
          normed.latent_norm = true;
          const lmoe::CaseRun with_norm = run_gpu(normed, tier, comm);
          EXPECT_NE(0, std::memcmp(with_norm.ranks[0].y.data(), result.ranks[0].y.data(),
                                   result.ranks[0].y.nbytes()));
        }
      }
    }
  }
}

// Every tier that adds after the GEMM, one and two ranks, against the contract (random inputs) and
// bit for bit (exact ones), with LMOE_EPILOGUE_GEMM (read when the tail is built) at `setting`.
static void expect_every_tier_meets_its_contract_with_epilogue_gemm(const char* setting) {
  ScopedEnv env("LMOE_EPILOGUE_GEMM", setting);
  for (const auto& [comm, tp] :
       {std::pair<const char*, int>{"p2p", 1}, {"p2p", 2}, {"cuda-threads", 2}}) {
    if (auto limit = lmoe::comm_group_limit(comm, tp)) {
      std::printf("[ epilogue=%s ] %s tp=%d skipped: %s\n", setting, comm, tp, limit->c_str());
      continue;
    }
    for (TailTier tier : {TailTier::overlap, TailTier::column, TailTier::token}) {
      for (std::int64_t tokens : {std::int64_t{1}, std::int64_t{37}, std::int64_t{300}}) {
        if (tier == TailTier::token && tokens < tp) continue;
        SCOPED_TRACE(std::string(comm) + " tp=" + std::to_string(tp) + " " +
                     std::string(lmoe::tier_name(tier)) + " T=" + std::to_string(tokens));
        const lmoe::TailCase random =
            lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, tp, tokens, 5u + tokens);
        const lmoe::Comparison cmp = run_and_compare(random, tier, comm, false);
        EXPECT_EQ(cmp.beyond_bound, 0) << "max err/bound " << cmp.max_error_over_bound;
        const lmoe::TailCase exact = lmoe::make_exact_case(kSmall, DType::bf16, tp, tokens, 9u);
        EXPECT_EQ(run_and_compare(exact, tier, comm, false).bit_mismatches, 0);
      }
    }
  }
}

// The unfused path (0): cuBLASLt writes the product and a kernel adds it, the path of GPUs other
// than Hopper's.
TEST(CudaTail, TheUnfusedUpProjectionMeetsEveryContract) {
  SKIP_WITHOUT_GPU();
  expect_every_tier_meets_its_contract_with_epilogue_gemm("0");
}

// The epilogue GEMM at every size (1), where by default the small GEMMs of these dims would take
// the unfused path: the stripes in place, one rank's C = shared and D = out, the token chunks.
TEST(CudaTail, TheEpilogueGemmAtEverySizeMeetsEveryContract) {
  SKIP_WITHOUT_GPU();
  expect_every_tier_meets_its_contract_with_epilogue_gemm("1");
}

// The add in the GEMM's epilogue is what runs by default on Hopper: column with one rank then
// reads `shared` and writes `out`, leaving shared's bits alone, while the unfused path
// (LMOE_EPILOGUE_GEMM=0, and every GPU but Hopper) accumulates into shared in place and copies it.
TEST(CudaTailTp1, ColumnLeavesSharedAloneExactlyWhenTheEpilogueGemmRuns) {
  SKIP_WITHOUT_GPU();
  const bool hopper = lmoe::cuda::current_compute_capability() == 90;
  // K3's width: 56 CTAs at T = 37, enough for the epilogue GEMM by default.
  const lmoe::TailCase c = lmoe::make_random_case(kK3, 1e-5f, DType::bf16, 1, 37, 11u);
  const auto reference = lmoe::reference_tail(c, lmoe::contract_of(TailTier::column));
  for (const char* setting : {static_cast<const char*>(nullptr), "1", "0"}) {
    SCOPED_TRACE(std::string("LMOE_EPILOGUE_GEMM=") + (setting ? setting : "(unset)"));
    ScopedEnv env("LMOE_EPILOGUE_GEMM", setting);
    lmoe::run_comm_group("cuda-threads", 1, [&](int, lmoe::Communicator& comm) {
      lmoe::TailOptions options;
      options.dims = kK3;
      options.backend = lmoe::Backend::cuda;
      lmoe::LatentTail tail(options, comm, c.norm_weight.matrix(), c.up_proj_weight.matrix());
      const std::int64_t t = c.num_tokens, d = kK3.d_model, l = kK3.d_latent;
      const std::size_t routed_bytes = static_cast<std::size_t>(t * l) * 2,
                        shared_bytes = static_cast<std::size_t>(t * d) * 2;
      const lmoe::cuda::DeviceBuffer routed(routed_bytes), shared(shared_bytes), out(shared_bytes);
      cuda_ok(cudaMemcpy(routed.data(), c.routed.slice_matrix(0).data, routed_bytes,
                         cudaMemcpyHostToDevice));
      cuda_ok(cudaMemcpy(shared.data(), c.shared.slice_matrix(0).data, shared_bytes,
                         cudaMemcpyHostToDevice));
      cuda_ok(cudaMemset(out.data(), 0xff, shared_bytes));
      const lmoe::ConstMatrixView routed_view{
          routed.data(), DType::bf16, t, l, l, lmoe::MemorySpace::device};
      const lmoe::MatrixView shared_view{
          shared.data(), DType::bf16, t, d, d, lmoe::MemorySpace::device};
      const lmoe::MatrixView out_view{out.data(), DType::bf16, t, d, d, lmoe::MemorySpace::device};
      EXPECT_EQ(tail.forward(routed_view, shared_view, out_view, TailTier::column),
                TailTier::column);
      cuda_ok(cudaStreamSynchronize(cudaStreamPerThread));
      lmoe::HostTensor shared_after(DType::bf16, {t, d}), y(DType::bf16, {t, d});
      cuda_ok(cudaMemcpy(shared_after.data(), shared.data(), shared_bytes, cudaMemcpyDeviceToHost));
      cuda_ok(cudaMemcpy(y.data(), out.data(), shared_bytes, cudaMemcpyDeviceToHost));
      const bool untouched =
          std::memcmp(shared_after.data(), c.shared.slice_matrix(0).data, shared_bytes) == 0;
      const bool epilogue = hopper && (setting == nullptr || std::string(setting) == "1");
      EXPECT_EQ(untouched, epilogue);
      const lmoe::Comparison cmp = lmoe::compare(y.matrix(), reference, lmoe::exact_tail(c));
      EXPECT_EQ(cmp.beyond_bound, 0) << "max err/bound " << cmp.max_error_over_bound;
    });
  }
}

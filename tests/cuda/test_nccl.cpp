// The `nccl` communicator, one rank per GPU on threads of this process: the collectives bit for bit
// on inputs whose sums are exact in any order (equal and unequal blocks, in place, overlapping
// buffers), within the reordered-sum bound on random inputs; every tier through RunOptions::comm =
// "nccl" against the contract (ReductionOrder::unspecified) and bit for bit on crafted exact
// inputs; abort; CUDA graph capture; and the errors for too many ranks. A test that needs more GPUs
// than are visible skips and says how many it needs.
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "comm/aborted_error.hpp"
#include "core/host_math.hpp"
#include "core/rank_order_reduce.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "cuda/tail/cuda_tail_executor.hpp"
#include "gpu_test_support.hpp"
#include "lmoe/comm_group.hpp"
#include "lmoe/error.hpp"
#include "lmoe/latent_tail.hpp"
#include "lmoe/nccl_communicator.hpp"
#include "lmoe/reference.hpp"
#include "lmoe/tools/tail_runner.hpp"

namespace {

using lmoe::DType;
using lmoe::TailTier;
using ::testing::HasSubstr;

const lmoe::TailDims kSmall{384, 192};  // divisible by 8·tp for tp ∈ {1, 2, 4, 8}
constexpr TailTier kGpuTiers[] = {TailTier::overlap, TailTier::column, TailTier::token,
                                  TailTier::fused};
constexpr DType kDtypes[] = {DType::bf16, DType::f16, DType::f32};

#define SKIP_WITHOUT_GPUS(needed)                                                       \
  do {                                                                                  \
    const int visible = lmoe::cuda_device_count();                                      \
    if (visible < (needed)) {                                                           \
      GTEST_SKIP() << "needs " << (needed) << " GPU(s), one per NCCL rank; " << visible \
                   << " visible";                                                       \
    }                                                                                   \
  } while (0)

std::string tp_name(const ::testing::TestParamInfo<int>& info) {
  return "tp" + std::to_string(info.param);
}

// ---- collectives -------------------------------------------------------------------------------

// Rank r's input in the storage dtype: quarter-integers in [-2, 2] when `exact` (every partial sum
// of up to 8 ranks has at most 7 significant bits, so any order is exact in every dtype), else N(0,
// 1).
std::vector<std::byte> rank_input(int rank, std::size_t count, DType dtype, bool exact,
                                  std::uint64_t seed) {
  std::mt19937_64 rng(seed * 131 + static_cast<std::uint64_t>(rank));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> small(-8, 8);
  std::vector<std::byte> bytes(count * lmoe::dtype_size(dtype));
  for (std::size_t i = 0; i < count; ++i) {
    lmoe::store_from_float(bytes.data(), i, dtype,
                           exact ? static_cast<float>(small(rng)) * 0.25f : normal(rng));
  }
  return bytes;
}

std::vector<std::size_t> split(std::size_t count, int tp) {
  const auto offsets = lmoe::even_split_offsets(count, tp);
  std::vector<std::size_t> counts;
  for (int r = 0; r < tp; ++r) counts.push_back(offsets[r + 1] - offsets[r]);
  return counts;
}

std::vector<std::byte> to_host(const void* device, std::size_t bytes) {
  std::vector<std::byte> host(bytes);
  if (bytes) {
    EXPECT_EQ(cudaMemcpy(host.data(), device, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return host;
}

// One rank's results of every collective on one input.
struct RankResults {
  std::vector<std::byte> all_reduce_out, all_reduce_in_place, scatter_out, scatter_in_place,
      scatter_clash, gather_out, gather_in_place, gather_clash;
};

// Runs each collective on this rank's input: out of place, in place, and with buffers that overlap
// other than in place (NCCL's forbidden case, which the communicator stages through scratch).
RankResults run_collectives(lmoe::Communicator& comm, const std::vector<std::byte>& input,
                            const std::vector<std::size_t>& counts, DType dtype) {
  const int rank = comm.rank();
  const std::size_t esize = lmoe::dtype_size(dtype), count = input.size() / esize;
  std::size_t first = 0;
  for (int r = 0; r < rank; ++r) first += counts[r];
  const std::size_t mine = counts[rank] * esize;
  const lmoe::cuda::DeviceBuffer send(input.size()), recv(input.size()), work(input.size());
  cudaStream_t stream = nullptr;
  EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const auto load = [&](const lmoe::cuda::DeviceBuffer& buffer) {
    EXPECT_EQ(
        cudaMemcpyAsync(buffer.data(), input.data(), input.size(), cudaMemcpyHostToDevice, stream),
        cudaSuccess);
  };
  const auto poison = [&](const lmoe::cuda::DeviceBuffer& buffer) {
    EXPECT_EQ(cudaMemsetAsync(buffer.data(), 0xff, buffer.bytes(), stream), cudaSuccess);
  };
  const auto fetch = [&](const void* device, std::size_t bytes) {
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    return to_host(device, bytes);
  };
  RankResults out;
  load(send);
  poison(recv);
  comm.all_reduce(send.data(), recv.data(), count, dtype, stream);
  out.all_reduce_out = fetch(recv.data(), input.size());
  load(work);
  comm.all_reduce(work.data(), work.data(), count, dtype, stream);
  out.all_reduce_in_place = fetch(work.data(), input.size());

  poison(recv);
  comm.reduce_scatter(send.data(), recv.data(), counts, dtype, stream);
  out.scatter_out = fetch(recv.data(), mine);
  load(work);
  comm.reduce_scatter(work.data(), work.at(first * esize), counts, dtype, stream);
  out.scatter_in_place = fetch(work.at(first * esize), mine);
  // recv at the start of send: in place for rank 0, overlapping other blocks for the rest.
  load(work);
  comm.reduce_scatter(work.data(), work.data(), counts, dtype, stream);
  out.scatter_clash = fetch(work.data(), mine);

  // Gather this rank's block of the input: out of place, in place, and from the start of recv.
  poison(recv);
  comm.all_gather(send.at(first * esize), recv.data(), counts, dtype, stream);
  out.gather_out = fetch(recv.data(), input.size());
  poison(work);
  EXPECT_EQ(cudaMemcpyAsync(work.at(first * esize), input.data() + first * esize, mine,
                            cudaMemcpyHostToDevice, stream),
            cudaSuccess);
  comm.all_gather(work.at(first * esize), work.data(), counts, dtype, stream);
  out.gather_in_place = fetch(work.data(), input.size());
  poison(work);
  EXPECT_EQ(cudaMemcpyAsync(work.data(), input.data() + first * esize, mine, cudaMemcpyHostToDevice,
                            stream),
            cudaSuccess);
  comm.all_gather(work.data(), work.data(), counts, dtype, stream);
  out.gather_clash = fetch(work.data(), input.size());
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  return out;
}

class NcclCollectives : public ::testing::TestWithParam<int> {};

TEST_P(NcclCollectives, ExactInputsMatchTheRankOrderSumBitForBit) {
  const int tp = GetParam();
  SKIP_WITHOUT_GPUS(tp);
  // Unequal blocks (count % tp != 0 takes the grouped ncclReduce / ncclBroadcast path), equal
  // blocks (ncclReduceScatter / ncclAllGather), a block of one element, and 1 MiB elements.
  const std::vector<std::size_t> sizes = {static_cast<std::size_t>(tp), 4096 + 3,
                                          1000 * static_cast<std::size_t>(tp),
                                          std::size_t{1} << 20};
  lmoe::run_on_nccl_threads(tp, {}, [&](int rank, lmoe::Communicator& comm) {
    EXPECT_EQ(comm.backend_name(), "nccl");
    EXPECT_EQ(comm.memory_space(), lmoe::MemorySpace::device);
    EXPECT_TRUE(comm.graph_capturable());
    for (DType dtype : kDtypes) {
      for (std::size_t count : sizes) {
        SCOPED_TRACE(std::string(lmoe::dtype_name(dtype)) + " count " + std::to_string(count) +
                     " rank " + std::to_string(rank));
        const std::size_t esize = lmoe::dtype_size(dtype);
        std::vector<std::vector<std::byte>> inputs;
        std::vector<const void*> pointers;
        for (int r = 0; r < tp; ++r) inputs.push_back(rank_input(r, count, dtype, true, count));
        for (const auto& input : inputs) pointers.push_back(input.data());
        std::vector<std::byte> expected(count * esize);
        lmoe::reduce_in_rank_order(pointers, expected.data(), count, dtype);
        const std::vector<std::size_t> counts = split(count, tp);
        std::size_t first = 0;
        for (int r = 0; r < rank; ++r) first += counts[r];
        const std::vector<std::byte> my_block(
            expected.begin() + static_cast<std::ptrdiff_t>(first * esize),
            expected.begin() + static_cast<std::ptrdiff_t>((first + counts[rank]) * esize));

        const RankResults got = run_collectives(comm, inputs[rank], counts, dtype);
        EXPECT_EQ(got.all_reduce_out, expected);
        EXPECT_EQ(got.all_reduce_in_place, expected);
        EXPECT_EQ(got.scatter_out, my_block);
        EXPECT_EQ(got.scatter_in_place, my_block);
        EXPECT_EQ(got.scatter_clash, my_block);
        // The gathers move bytes: every rank's own input blocks, concatenated.
        std::vector<std::byte> gathered;
        std::size_t offset = 0;
        for (int r = 0; r < tp; ++r) {
          gathered.insert(
              gathered.end(), inputs[r].begin() + static_cast<std::ptrdiff_t>(offset * esize),
              inputs[r].begin() + static_cast<std::ptrdiff_t>((offset + counts[r]) * esize));
          offset += counts[r];
        }
        EXPECT_EQ(got.gather_out, gathered);
        EXPECT_EQ(got.gather_in_place, gathered);
        EXPECT_EQ(got.gather_clash, gathered);
      }
    }
  });
}

// Random inputs: NCCL's order is its own, so the sums are held to the reordered-sum bound per
// element (γ_{tp−1}(u) Σ|x_r| from the exact sum, plus the contract's own error), and every rank
// must hold the same bits.
TEST_P(NcclCollectives, RandomInputsStayWithinTheReorderedSumBoundOnEveryRankAlike) {
  const int tp = GetParam();
  SKIP_WITHOUT_GPUS(tp);
  const std::size_t count = 100003;
  std::vector<std::vector<std::byte>> reduced(static_cast<std::size_t>(tp));
  for (DType dtype : kDtypes) {
    SCOPED_TRACE(std::string(lmoe::dtype_name(dtype)));
    std::vector<std::vector<std::byte>> inputs;
    for (int r = 0; r < tp; ++r) inputs.push_back(rank_input(r, count, dtype, false, 11));
    lmoe::run_on_nccl_threads(tp, {}, [&](int rank, lmoe::Communicator& comm) {
      const lmoe::cuda::DeviceBuffer buffer(inputs[rank].size());
      cuda_ok(
          cudaMemcpy(buffer.data(), inputs[rank].data(), buffer.bytes(), cudaMemcpyHostToDevice));
      comm.all_reduce(buffer.data(), buffer.data(), count, dtype, nullptr);
      cuda_ok(cudaStreamSynchronize(cudaStreamPerThread));
      reduced[rank] = to_host(buffer.data(), buffer.bytes());
    });
    const int mantissa_bits = dtype == DType::f32 ? 23 : dtype == DType::f16 ? 10 : 7;
    const double unit = std::ldexp(1.0, -mantissa_bits - 1);
    const double gamma = (tp - 1) * unit / (1 - (tp - 1) * unit);
    std::int64_t beyond = 0;
    for (std::size_t i = 0; i < count; ++i) {
      double sum = 0, magnitude = 0;
      for (int r = 0; r < tp; ++r) {
        const double x = lmoe::load_as_float(inputs[r].data(), i, dtype);
        sum += x;
        magnitude += std::fabs(x);
      }
      const double got = lmoe::load_as_float(reduced[0].data(), i, dtype);
      // The last rounding of a sum that lands on a subnormal or zero is exact, so γ·Σ|x| covers
      // all.
      if (!(std::fabs(got - sum) <= gamma * magnitude * 1.0001)) ++beyond;
    }
    EXPECT_EQ(beyond, 0);
    for (int r = 1; r < tp; ++r) EXPECT_EQ(reduced[r], reduced[0]) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Tp, NcclCollectives, ::testing::Values(1, 2, 4, 8), tp_name);

// ---- the tail through RunOptions::comm = "nccl" -------------------------------------------------

struct TailParam {
  int tp;
  DType dtype;
};

class NcclTail : public ::testing::TestWithParam<TailParam> {
 protected:
  static void SetUpTestSuite() { lmoe::cpu::set_blas_threads(4); }
};

lmoe::CaseRun run_nccl(const lmoe::TailCase& c, TailTier tier) {
  lmoe::RunOptions options;
  options.backend = lmoe::Backend::cuda;
  options.comm = "nccl";
  options.tier = tier;
  return lmoe::run_case_on_threads(c, options);
}

TEST_P(NcclTail, EveryTierMeetsItsContractWithinTheReorderedBound) {
  const auto [tp, dtype] = GetParam();
  SKIP_WITHOUT_GPUS(tp);
  for (TailTier tier : kGpuTiers) {
    double worst = 0, worst_normwise = 0;
    for (std::int64_t tokens :
         {std::int64_t{1}, std::int64_t{tp}, std::int64_t{37}, std::int64_t{300}}) {
      SCOPED_TRACE("tier " + std::string(lmoe::tier_name(tier)) + " T=" + std::to_string(tokens));
      const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, dtype, tp, tokens,
                                                      700u + static_cast<std::uint64_t>(tokens));
      // Declined: token with fewer rows than ranks; fused over NCCL with several ranks (its kernel
      // reads the peers' workspaces, which only p2p provides) or beyond its 256 rows.
      if ((tier == TailTier::token && tokens < tp) ||
          (tier == TailTier::fused && (tp > 1 || tokens > 256))) {
        EXPECT_THROW(run_nccl(c, tier), lmoe::Error);
        continue;
      }
      const lmoe::CaseRun result = run_nccl(c, tier);
      EXPECT_TRUE(result.ranks_identical);
      ASSERT_EQ(result.tier, tier);
      const auto reference =
          lmoe::reference_tail(c, lmoe::contract_of(tier), lmoe::comm_reduction_order("nccl"));
      const lmoe::Comparison cmp =
          lmoe::compare(result.ranks[0].y.matrix(), reference, lmoe::exact_tail(c));
      EXPECT_EQ(cmp.beyond_bound, 0) << "max err/bound " << cmp.max_error_over_bound;
      EXPECT_LE(cmp.normwise_error, cmp.normwise_tolerance);
      worst = std::max(worst, cmp.max_error_over_bound);
      worst_normwise = std::max(worst_normwise, cmp.normwise_error);
    }
    std::printf("[ nccl   ] %-7s tp=%d %-4s max_err/bound=%.3f fp64_err=%.2e\n",
                std::string(lmoe::tier_name(tier)).c_str(), tp,
                std::string(lmoe::dtype_name(dtype)).c_str(), worst, worst_normwise);
  }
}

TEST_P(NcclTail, CraftedExactInputsMatchBitForBit) {
  const auto [tp, dtype] = GetParam();
  SKIP_WITHOUT_GPUS(tp);
  for (std::int64_t tokens : {std::int64_t{1}, std::int64_t{37}, std::int64_t{300}}) {
    const lmoe::TailCase c =
        lmoe::make_exact_case(kSmall, dtype, tp, tokens, 79u + static_cast<std::uint64_t>(tokens));
    for (TailTier tier : kGpuTiers) {
      if (tier == TailTier::token && tokens < tp) continue;
      if (tier == TailTier::fused && (tp > 1 || tokens > 256)) continue;  // declined (see above)
      SCOPED_TRACE("tier " + std::string(lmoe::tier_name(tier)) + " T=" + std::to_string(tokens));
      const lmoe::CaseRun result = run_nccl(c, tier);
      EXPECT_TRUE(result.ranks_identical);
      const lmoe::Comparison cmp =
          lmoe::compare(result.ranks[0].y.matrix(),
                        lmoe::reference_tail(c, lmoe::contract_of(tier)), lmoe::exact_tail(c));
      EXPECT_EQ(cmp.bit_mismatches, 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(TpDtype, NcclTail,
                         ::testing::Values(TailParam{1, DType::bf16}, TailParam{2, DType::bf16},
                                           TailParam{4, DType::bf16}, TailParam{8, DType::bf16},
                                           TailParam{2, DType::f16}, TailParam{2, DType::f32},
                                           TailParam{8, DType::f16}, TailParam{8, DType::f32}),
                         [](const auto& info) {
                           return "tp" + std::to_string(info.param.tp) + "_" +
                                  std::string(lmoe::dtype_name(info.param.dtype));
                         });

// One group serves many calls whose T grows and shrinks (the executor's workspaces grow on demand)
// over every tier, with the results judged as above.
TEST(NcclTailReuse, OneGroupServesManyCalls) {
  SKIP_WITHOUT_GPUS(1);
  const int tp = std::min(2, lmoe::cuda_device_count());
  std::vector<lmoe::TailCase> cases;
  for (std::int64_t tokens : {5, 300, 64}) {
    cases.push_back(lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, tp, tokens,
                                           40u + static_cast<std::uint64_t>(tokens)));
  }
  std::vector<std::vector<lmoe::HostTensor>> outputs(cases.size() * 4,
                                                     std::vector<lmoe::HostTensor>(tp));
  lmoe::run_on_nccl_threads(tp, {}, [&](int rank, lmoe::Communicator& comm) {
    lmoe::RunOptions options;
    options.backend = lmoe::Backend::cuda;
    for (std::size_t t = 0; t < 4; ++t) {
      options.tier = kGpuTiers[t];
      for (std::size_t i = 0; i < cases.size(); ++i) {
        if (kGpuTiers[t] == TailTier::fused && (tp > 1 || cases[i].num_tokens > 256))
          continue;  // declined
        outputs[t * cases.size() + i][rank] = lmoe::run_case_rank(cases[i], comm, options).y;
      }
    }
  });
  for (std::size_t t = 0; t < 4; ++t) {
    for (std::size_t i = 0; i < cases.size(); ++i) {
      SCOPED_TRACE(std::string(lmoe::tier_name(kGpuTiers[t])) +
                   " T=" + std::to_string(cases[i].num_tokens));
      if (kGpuTiers[t] == TailTier::fused && (tp > 1 || cases[i].num_tokens > 256)) continue;
      const auto& ranks = outputs[t * cases.size() + i];
      for (int r = 1; r < tp; ++r)
        EXPECT_EQ(0, std::memcmp(ranks[r].data(), ranks[0].data(), ranks[0].nbytes()));
      const auto reference = lmoe::reference_tail(cases[i], lmoe::contract_of(kGpuTiers[t]),
                                                  lmoe::ReductionOrder::unspecified);
      const lmoe::Comparison cmp =
          lmoe::compare(ranks[0].matrix(), reference, lmoe::exact_tail(cases[i]));
      EXPECT_TRUE(cmp.ok()) << "beyond " << cmp.beyond_bound << ", normwise " << cmp.normwise_error;
    }
  }
}

// A bad shape on one rank fails every rank with the same message, before anything is launched
// (the ranks agree over the host control path).
TEST(NcclTailErrors, BadInputOnOneRankFailsEveryRankAlike) {
  SKIP_WITHOUT_GPUS(2);
  const int tp = 2;
  const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, tp, 4, 31u);
  std::vector<std::string> messages(tp);
  lmoe::run_on_nccl_threads(tp, {}, [&](int rank, lmoe::Communicator& comm) {
    lmoe::TailOptions options;
    options.dims = kSmall;
    options.backend = lmoe::Backend::cuda;
    lmoe::LatentTail tail(options, comm, c.norm_weight.matrix(), c.up_proj_weight.matrix());
    const std::int64_t out_rows = rank == 1 ? 3 : 4;
    const lmoe::cuda::DeviceBuffer routed(4 * kSmall.d_latent * 2), shared(4 * kSmall.d_model * 2),
        out(out_rows * kSmall.d_model * 2);
    try {
      tail.forward({routed.data(), DType::bf16, 4, kSmall.d_latent, kSmall.d_latent,
                    lmoe::MemorySpace::device},
                   {shared.data(), DType::bf16, 4, kSmall.d_model, kSmall.d_model,
                    lmoe::MemorySpace::device},
                   {out.data(), DType::bf16, out_rows, kSmall.d_model, kSmall.d_model,
                    lmoe::MemorySpace::device});
    } catch (const lmoe::Error& error) {
      messages[rank] = error.message();
    }
  });
  for (int rank = 0; rank < tp; ++rank) {
    EXPECT_EQ(messages[rank], "rank 1: out: expected shape [4, 384], got [3, 384]")
        << "rank " << rank;
  }
}

// ---- abort, graphs, and groups that cannot be made ---------------------------------------------

// Rank 0 aborts while the other ranks have an all-reduce in flight that waits for rank 0: the
// abort must end their kernels (ncclCommAbort on every member), and every later call on every rank
// must throw an error carrying the reason. With one GPU, only rank 0's side is checked.
TEST(NcclAbort, EveryRankThrowsWithTheReason) {
  SKIP_WITHOUT_GPUS(1);
  const int tp = std::min(4, lmoe::cuda_device_count());
  std::vector<std::string> after_abort(tp), barrier_error(tp);
  std::vector<int> kernel_ended(tp, 0);
  lmoe::run_on_nccl_threads(tp, {}, [&](int rank, lmoe::Communicator& comm) {
    const lmoe::cuda::DeviceBuffer buffer(1024 * sizeof(float));
    cuda_ok(cudaMemset(buffer.data(), 0, buffer.bytes()));
    comm.all_reduce(buffer.data(), buffer.data(), 1024, DType::f32, nullptr);  // connects the ranks
    cuda_ok(cudaStreamSynchronize(cudaStreamPerThread));
    comm.barrier();
    if (rank == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the others are waiting by now
      comm.abort("test: rank 0 gives up");
      kernel_ended[rank] = 1;
    } else {
      try {
        comm.all_reduce(buffer.data(), buffer.data(), 1024, DType::f32,
                        nullptr);  // rank 0 never joins
      } catch (const lmoe::Error&) {
        // Taken by the abort before NCCL had launched it: nothing is in flight.
      }
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (cudaStreamQuery(cudaStreamPerThread) == cudaErrorNotReady &&
             std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      kernel_ended[rank] = cudaStreamQuery(cudaStreamPerThread) != cudaErrorNotReady;
    }
    try {
      comm.all_reduce(buffer.data(), buffer.data(), 1024, DType::f32, nullptr);
    } catch (const lmoe::CommunicatorAborted& error) {
      after_abort[rank] = error.message();
    }
    try {
      comm.barrier();
    } catch (const lmoe::CommunicatorAborted& error) {
      barrier_error[rank] = error.message();
    }
  });
  for (int rank = 0; rank < tp; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    EXPECT_TRUE(kernel_ended[rank]) << "the pending all-reduce was not ended by the abort";
    EXPECT_EQ(after_abort[rank], "communicator aborted by rank 0: test: rank 0 gives up");
    EXPECT_EQ(barrier_error[rank], "communicator aborted by rank 0: test: rank 0 gives up");
  }
}

// A rank that throws makes run_on_nccl_threads rethrow its error (not the peers' aborts).
TEST(NcclAbort, ARankErrorIsTheOneReported) {
  SKIP_WITHOUT_GPUS(2);
  try {
    lmoe::run_on_nccl_threads(2, {}, [](int rank, lmoe::Communicator& comm) {
      if (rank == 1) throw lmoe::Error("rank 1 failed on purpose");
      comm.barrier();
    });
    FAIL() << "no error";
  } catch (const lmoe::Error& error) {
    EXPECT_EQ(error.message(), "rank 1 failed on purpose");
  }
}

// The collectives are capturable: an all-reduce captured on each rank's stream and replayed
// reduces the values the buffer holds at each launch.
TEST(NcclGraphs, ACapturedAllReduceReplays) {
  SKIP_WITHOUT_GPUS(1);
  const int tp = std::min(2, lmoe::cuda_device_count());
  const std::size_t count = 4096;
  std::vector<std::vector<float>> results(tp);
  lmoe::run_on_nccl_threads(tp, {}, [&](int rank, lmoe::Communicator& comm) {
    ASSERT_TRUE(comm.graph_capturable());
    const lmoe::cuda::DeviceBuffer buffer(count * sizeof(float));
    cudaStream_t stream = nullptr;
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    comm.all_reduce(buffer.data(), buffer.data(), count, DType::f32, stream);
    cuda_ok(cudaStreamEndCapture(stream, &graph));
    cuda_ok(cudaGraphInstantiate(&exec, graph, 0));
    for (int launch = 1; launch <= 2; ++launch) {
      const std::vector<float> mine(count, static_cast<float>(launch * (rank + 1)));
      cuda_ok(cudaMemcpyAsync(buffer.data(), mine.data(), buffer.bytes(), cudaMemcpyHostToDevice,
                              stream));
      cuda_ok(cudaGraphLaunch(exec, stream));
      cuda_ok(cudaStreamSynchronize(stream));
      std::vector<float> got(count);
      cuda_ok(cudaMemcpy(got.data(), buffer.data(), buffer.bytes(), cudaMemcpyDeviceToHost));
      results[rank].push_back(got.front());
      results[rank].push_back(got.back());
    }
    cuda_ok(cudaGraphExecDestroy(exec));
    cuda_ok(cudaGraphDestroy(graph));
    cuda_ok(cudaStreamDestroy(stream));
  });
  const float ranks_sum = static_cast<float>(tp * (tp + 1) / 2);  // Σ_r (r + 1)
  for (int rank = 0; rank < tp; ++rank) {
    EXPECT_EQ(results[rank],
              (std::vector<float>{ranks_sum, ranks_sum, 2 * ranks_sum, 2 * ranks_sum}))
        << "rank " << rank;
  }
}

// Runs without a GPU too: the counts are checked before NCCL is touched.
TEST(NcclGroups, MoreRanksThanGpusIsAnError) {
  const int visible = lmoe::cuda_device_count();
  const std::string expected =
      "nccl: " + std::to_string(visible + 1) +
      (visible == 0 ? " rank needs 1 GPU"
                    : " ranks need " + std::to_string(visible + 1) + " GPUs") +
      " (NCCL cannot put two ranks on one GPU; the cuda-threads communicator can), but " +
      std::to_string(visible) + (visible == 1 ? " is" : " are") + " visible";
  try {
    lmoe::make_nccl_thread_communicators(visible + 1);
    FAIL() << "no error";
  } catch (const lmoe::Error& error) {
    EXPECT_EQ(error.message(), expected);
  }
  if (visible == 0) return;  // run_comm_group refuses "nccl" where no GPU is visible, as below
  try {
    lmoe::run_comm_group("nccl", visible + 1, [](int, lmoe::Communicator&) {});
    FAIL() << "no error";
  } catch (const lmoe::Error& error) {
    EXPECT_EQ(error.message(), expected);
  }
}

TEST(NcclGroups, ADeviceListedTwiceOrNotVisibleIsAnError) {
  SKIP_WITHOUT_GPUS(1);
  const int twice[] = {0, 0};
  EXPECT_THAT([&] { lmoe::make_nccl_thread_communicators(2, twice); },
              ::testing::ThrowsMessage<lmoe::Error>(HasSubstr(
                  "ranks 0 and 1 are both on GPU 0 (NCCL cannot put two ranks on one GPU)")));
  const int missing[] = {lmoe::cuda_device_count()};
  EXPECT_THAT(
      [&] { lmoe::make_nccl_thread_communicators(1, missing); },
      ::testing::ThrowsMessage<lmoe::Error>(HasSubstr(
          "rank 0 on GPU " + std::to_string(missing[0]) + ", but the visible GPUs are 0 to")));
}

TEST(NcclGroups, IsListedForTheCudaBackendAndJudgedInItsOwnOrder) {
  SKIP_WITHOUT_GPUS(1);
  const std::vector<std::string> names = lmoe::comm_backends(lmoe::Backend::cuda);
  EXPECT_THAT(names, ::testing::ElementsAre("cuda-threads", "p2p", "nccl"));
  EXPECT_EQ(lmoe::default_comm_backend(lmoe::Backend::cuda), "cuda-threads");
  EXPECT_EQ(lmoe::comm_reduction_order("nccl"), lmoe::ReductionOrder::unspecified);
  EXPECT_EQ(lmoe::comm_reduction_order("cuda-threads"), lmoe::ReductionOrder::rank_order);
  EXPECT_GE(lmoe::nccl_runtime_version(), 21800);
}

}  // namespace

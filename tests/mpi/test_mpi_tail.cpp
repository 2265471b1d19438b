// The tail and the collectives with one process per rank, under `mpirun -n N`: every tier against
// the contract, crafted exact inputs bit for bit, results identical on every rank, and a bad input
// on one rank making every rank fail with the same error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "core/host_math.hpp"
#include "core/rank_order_reduce.hpp"
#include "lmoe/error.hpp"
#include "lmoe/mpi_communicator.hpp"
#include "lmoe/reference.hpp"
#include "lmoe/tools/tail_runner.hpp"

namespace {

using lmoe::DType;
using lmoe::TailTier;

lmoe::Communicator* g_comm = nullptr;
const lmoe::TailDims kSmall{384, 192};

// Every rank's bytes equal rank 0's (all-gathered and compared on each rank).
bool identical_on_all_ranks(const lmoe::HostTensor& tensor) {
  const int tp = g_comm->size();
  std::vector<std::byte> all(tensor.nbytes() * static_cast<std::size_t>(tp));
  const std::vector<std::size_t> counts(static_cast<std::size_t>(tp), tensor.nbytes() / 2);
  g_comm->all_gather(tensor.data(), all.data(), counts, DType::bf16);  // bytes, two at a time
  for (int r = 1; r < tp; ++r) {
    if (std::memcmp(all.data(), all.data() + tensor.nbytes() * static_cast<std::size_t>(r),
                    tensor.nbytes()) != 0) {
      return false;
    }
  }
  return true;
}

TEST(MpiTail, EveryTierMeetsItsContract) {
  const int tp = g_comm->size();
  for (DType dtype : {DType::bf16, DType::f32}) {
    for (std::int64_t tokens : {std::int64_t{1}, std::int64_t{tp}, std::int64_t{tp + 1},
                                std::int64_t{129}, std::int64_t{300}}) {
      const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, dtype, tp, tokens,
                                                      42u + static_cast<std::uint64_t>(tokens));
      const std::vector<double> exact = lmoe::exact_tail(c);
      for (TailTier tier : lmoe::kAllTiers) {
        SCOPED_TRACE(std::string(lmoe::tier_name(tier)) + " T=" + std::to_string(tokens) + " " +
                     std::string(lmoe::dtype_name(dtype)));
        lmoe::RunOptions options;
        options.tier = tier;
        if (tier == TailTier::token && tokens < tp) {
          EXPECT_THROW(lmoe::run_case_rank(c, *g_comm, options),
                       lmoe::Error);  // declined on every rank
          continue;
        }
        const lmoe::RankRun run = lmoe::run_case_rank(c, *g_comm, options);
        const lmoe::Comparison cmp =
            lmoe::compare(run.y.matrix(), lmoe::reference_tail(c, lmoe::contract_of(tier)), exact);
        EXPECT_EQ(cmp.beyond_bound, 0);
        EXPECT_LE(cmp.normwise_error, cmp.normwise_tolerance);
        EXPECT_TRUE(identical_on_all_ranks(run.y));
      }
    }
  }
}

TEST(MpiTail, CraftedExactInputsMatchBitForBit) {
  const int tp = g_comm->size();
  const lmoe::TailCase c = lmoe::make_exact_case(kSmall, DType::bf16, tp, 2 * tp + 1, 9u);
  for (TailTier tier : lmoe::kAllTiers) {
    SCOPED_TRACE(std::string(lmoe::tier_name(tier)));
    lmoe::RunOptions options;
    options.tier = tier;
    const lmoe::RankRun run = lmoe::run_case_rank(c, *g_comm, options);
    const lmoe::Comparison cmp = lmoe::compare(
        run.y.matrix(), lmoe::reference_tail(c, lmoe::contract_of(tier)), lmoe::exact_tail(c));
    EXPECT_EQ(cmp.bit_mismatches, 0);
  }
}

TEST(MpiCollectives, ReductionsFollowRankOrderBitForBit) {
  const int tp = g_comm->size();
  const int rank = g_comm->rank();
  const std::size_t count = 1001;  // not a multiple of tp: uneven chunks
  // Every rank builds every rank's input from the same seed, to compute the expected sums locally.
  lmoe::TailCase c =
      lmoe::make_random_case({static_cast<std::int64_t>(count), 1}, 1e-5f, DType::bf16, tp, 1, 5u);
  std::vector<const void*> inputs;
  for (int r = 0; r < tp; ++r) inputs.push_back(c.shared.slice_matrix(r).data);
  std::vector<std::uint16_t> expected(count), got(count);
  lmoe::reduce_in_rank_order(inputs, expected.data(), count, DType::bf16);

  g_comm->all_reduce(inputs[rank], got.data(), count, DType::bf16);
  EXPECT_EQ(got, expected);

  const auto offsets = lmoe::even_split_offsets(count, tp);
  std::vector<std::size_t> counts;
  for (int r = 0; r < tp; ++r) counts.push_back(offsets[r + 1] - offsets[r]);
  std::vector<std::uint16_t> mine(counts[rank]);
  g_comm->reduce_scatter(inputs[rank], mine.data(), counts, DType::bf16);
  EXPECT_TRUE(std::equal(mine.begin(), mine.end(),
                         expected.begin() + static_cast<std::ptrdiff_t>(offsets[rank])));

  std::vector<std::uint16_t> gathered(count);
  g_comm->all_gather(mine.data(), gathered.data(), counts, DType::bf16);
  EXPECT_EQ(gathered, expected);

  // In place: this rank's block already sits at its offset of the output (MPI forbids overlapping
  // buffers, so the communicator sends a copy of it).
  std::vector<std::uint16_t> in_place(count, 0xffff);
  std::copy(mine.begin(), mine.end(),
            in_place.begin() + static_cast<std::ptrdiff_t>(offsets[rank]));
  g_comm->all_gather(in_place.data() + offsets[rank], in_place.data(), counts, DType::bf16);
  EXPECT_EQ(in_place, expected);
}

// Refused before any byte moves, alike on every rank (each passes the same wrong counts), so no
// rank waits in MPI for a peer that threw.
TEST(MpiCollectives, CountsOfTheWrongLengthOrOverMpisIntLimitAreRefused) {
  const int tp = g_comm->size();
  const std::string ranks = std::to_string(tp);
  std::vector<std::uint16_t> buffer(16);
  const std::vector<std::size_t> one_too_many(static_cast<std::size_t>(tp) + 1, 1);
  const auto message_of = [](auto&& call) {
    try {
      call();
    } catch (const lmoe::Error& error) {
      return error.message();
    }
    return std::string("no error");
  };
  EXPECT_EQ(message_of([&] {
              g_comm->reduce_scatter(buffer.data(), buffer.data(), one_too_many, DType::bf16);
            }),
            "reduce_scatter: counts has " + std::to_string(tp + 1) +
                " entries, expected one per rank (" + ranks + ")");
  EXPECT_EQ(message_of([&] {
              g_comm->all_gather(buffer.data(), buffer.data(), one_too_many, DType::bf16);
            }),
            "all_gather: counts has " + std::to_string(tp + 1) +
                " entries, expected one per rank (" + ranks + ")");
  // 2^30 bf16 elements a rank: 2^31 bytes, one past MPI's int count (the buffers are never read).
  const std::vector<std::size_t> huge(static_cast<std::size_t>(tp), std::size_t{1} << 30);
  const std::string too_big = ": a block of 2147483648 bytes exceeds MPI's int count limit";
  EXPECT_EQ(
      message_of([&] { g_comm->reduce_scatter(buffer.data(), buffer.data(), huge, DType::bf16); }),
      "reduce_scatter" + too_big);
  EXPECT_EQ(
      message_of([&] { g_comm->all_gather(buffer.data(), buffer.data(), huge, DType::bf16); }),
      "all_gather" + too_big);
  // The communicator still works after the refusals.
  g_comm->barrier();
  std::vector<std::uint16_t> ones(static_cast<std::size_t>(tp), 0x3f80), gathered(ones.size());
  const std::vector<std::size_t> single(static_cast<std::size_t>(tp), 1);
  g_comm->all_gather(ones.data() + g_comm->rank(), gathered.data(), single, DType::bf16);
  EXPECT_EQ(gathered, ones);
}

TEST(MpiTail, BadInputOnOneRankFailsEveryRankAlike) {
  const int tp = g_comm->size();
  const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, tp, 4, 1u);
  lmoe::TailOptions options;
  options.dims = c.dims;
  lmoe::LatentTail tail(options, *g_comm, c.norm_weight.matrix(), c.up_proj_weight.matrix());
  lmoe::HostTensor shared(DType::bf16, {4, kSmall.d_model});
  lmoe::HostTensor out(DType::bf16, {g_comm->rank() == tp - 1 ? 3 : 4, kSmall.d_model});
  std::string message;
  try {
    tail.forward(c.routed.slice_matrix(g_comm->rank()), shared.matrix(), out.matrix());
  } catch (const lmoe::Error& error) {
    message = error.message();
  }
  EXPECT_EQ(message,
            "rank " + std::to_string(tp - 1) + ": out: expected shape [4, 384], got [3, 384]");
}

}  // namespace

int main(int argc, char** argv) {
  lmoe::MpiSession session(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  lmoe::cpu::set_blas_threads(1);
  auto comm = lmoe::make_mpi_communicator();
  g_comm = comm.get();
  if (comm->rank() != 0) {
    // One report, from rank 0; a failure on any rank still fails the run through the exit code.
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int result = RUN_ALL_TESTS();
  if (result != 0) std::fprintf(stderr, "rank %d: tests failed\n", comm->rank());
  comm.reset();
  return result;
}

// The collectives benchmark's check (lmoe_comm_bench's #wrong): its inputs sum exactly in every
// dtype and order, a right output counts no wrong element, and each kind of wrong output is
// counted, element by element. Host only.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "core/rank_order_reduce.hpp"
#include "lmoe/dtype.hpp"
#include "tools/bench_values.hpp"
#include "tools/collective_check.hpp"

namespace {

using lmoe::DType;
using lmoe::bench::CollectiveOp;
using lmoe::bench::CollectiveShape;

constexpr std::uint64_t kSeed = 77;

// Rank r's input of `shape`, as the device fills it.
std::vector<std::byte> input_of(const CollectiveShape& shape, DType dtype, int rank) {
  const std::size_t count = shape.input_count(rank);
  std::vector<std::byte> bytes(count * lmoe::dtype_size(dtype));
  const std::uint64_t seed = lmoe::bench::collective_input_seed(kSeed, rank);
  for (std::size_t i = 0; i < count; ++i)
    lmoe::store_from_float(bytes.data(), i, dtype, lmoe::bench::collective_value(seed, i));
  return bytes;
}

// Rank `rank`'s output of `shape` computed the way a correct communicator does: the contract's
// rank-order sum of every rank's input, or every rank's block gathered.
std::vector<std::byte> right_output(const CollectiveShape& shape, DType dtype, int rank) {
  const int ranks = static_cast<int>(shape.counts.size());
  const std::size_t esize = lmoe::dtype_size(dtype);
  std::vector<std::vector<std::byte>> inputs;
  for (int r = 0; r < ranks; ++r) inputs.push_back(input_of(shape, dtype, r));
  if (shape.op == CollectiveOp::all_gather) {
    std::vector<std::byte> gathered;
    for (const auto& input : inputs) gathered.insert(gathered.end(), input.begin(), input.end());
    return gathered;
  }
  std::vector<const void*> pointers;
  for (const auto& input : inputs) pointers.push_back(input.data());
  std::vector<std::byte> sum(shape.total() * esize);
  lmoe::reduce_in_rank_order(pointers, sum.data(), shape.total(), dtype);
  if (shape.op == CollectiveOp::all_reduce) return sum;
  const auto from = sum.begin() + static_cast<std::ptrdiff_t>(shape.first(rank) * esize);
  return {from, from + static_cast<std::ptrdiff_t>(shape.output_count(rank) * esize)};
}

// Any order of the sum, rounded to the dtype after every addition (as NCCL's ring and tree steps
// do), gives the rank-order sum's bits: with 16 ranks, the most the benchmark's values allow.
TEST(CollectiveCheck, SumsOfTheInputsAreExactInEveryOrderAndDtype) {
  constexpr int kRanks = 16;
  for (DType dtype : {DType::bf16, DType::f16, DType::f32}) {
    std::vector<std::uint64_t> seeds;
    for (int r = 0; r < kRanks; ++r) seeds.push_back(lmoe::bench::collective_input_seed(kSeed, r));
    for (std::uint64_t i = 0; i < 20000; ++i) {
      float forward = 0.0f, backward = 0.0f;
      std::byte rounded[4];
      for (int r = 0; r < kRanks; ++r) {
        const float value = lmoe::bench::collective_value(seeds[r], i);
        EXPECT_TRUE(value >= -8.0f && value <= 7.0f && value == static_cast<int>(value)) << value;
        forward += value;
        lmoe::store_from_float(rounded, 0, dtype,
                               backward + lmoe::bench::collective_value(seeds[kRanks - 1 - r], i));
        backward = lmoe::load_as_float(rounded, 0, dtype);
      }
      ASSERT_EQ(forward, backward) << lmoe::dtype_name(dtype) << ", element " << i;
    }
  }
}

TEST(CollectiveCheck, ARightOutputHasNoWrongElement) {
  const std::vector<std::vector<std::size_t>> shapes = {{1000}, {504, 0, 1003}, {8, 16, 24, 32}};
  for (const auto& counts : shapes) {
    for (CollectiveOp op :
         {CollectiveOp::all_reduce, CollectiveOp::reduce_scatter, CollectiveOp::all_gather}) {
      for (DType dtype : {DType::bf16, DType::f16, DType::f32}) {
        const CollectiveShape shape{op, counts};
        for (int rank = 0; rank < static_cast<int>(counts.size()); ++rank) {
          SCOPED_TRACE(std::string(lmoe::bench::collective_op_name(op)) + " " +
                       std::string(lmoe::dtype_name(dtype)) + " of " +
                       std::to_string(counts.size()) + " ranks, rank " + std::to_string(rank));
          const std::vector<std::byte> output = right_output(shape, dtype, rank);
          ASSERT_EQ(output.size(), shape.output_count(rank) * lmoe::dtype_size(dtype));
          EXPECT_EQ(lmoe::bench::count_wrong_elements(shape, dtype, rank, kSeed, output.data()),
                    0u);
        }
      }
    }
  }
}

// A changed element, a negative zero for a positive one, an output left poisoned, blocks gathered
// in the wrong order, another run's inputs: each wrong element counts, and nothing else does.
TEST(CollectiveCheck, EveryWrongElementCounts) {
  const std::vector<std::size_t> counts = {96, 160, 64};
  const DType dtype = DType::bf16;
  const std::size_t esize = lmoe::dtype_size(dtype);
  const CollectiveShape reduce{CollectiveOp::all_reduce, counts};
  const std::vector<std::byte> right = right_output(reduce, dtype, 1);

  std::vector<std::byte> changed = right;
  lmoe::store_from_float(changed.data(), 7, dtype, lmoe::load_as_float(right.data(), 7, dtype) + 1);
  lmoe::store_from_float(changed.data(), 300, dtype, 1000.0f);
  EXPECT_EQ(lmoe::bench::count_wrong_elements(reduce, dtype, 1, kSeed, changed.data()), 2u);

  std::vector<std::byte> signed_zero = right;
  std::size_t zeros = 0;
  for (std::size_t i = 0; i < reduce.total(); ++i) {
    if (lmoe::load_as_float(right.data(), i, dtype) != 0.0f) continue;
    lmoe::store_from_float(signed_zero.data(), i, dtype, -0.0f);
    ++zeros;
  }
  ASSERT_GT(zeros, 0u) << "the inputs sum to zero somewhere";
  EXPECT_EQ(lmoe::bench::count_wrong_elements(reduce, dtype, 1, kSeed, signed_zero.data()), zeros);

  const std::vector<std::byte> poisoned(right.size(), std::byte{0xff});
  EXPECT_EQ(lmoe::bench::count_wrong_elements(reduce, dtype, 1, kSeed, poisoned.data()),
            reduce.total());

  EXPECT_GT(lmoe::bench::count_wrong_elements(reduce, dtype, 1, kSeed + 1, right.data()),
            reduce.total() / 2)
      << "an output of other inputs passes";

  const CollectiveShape gather{CollectiveOp::all_gather, counts};
  std::vector<std::byte> swapped = right_output(gather, dtype, 0);
  const std::vector<std::byte> first_block(
      swapped.begin(), swapped.begin() + static_cast<std::ptrdiff_t>(64 * esize));
  std::memmove(swapped.data(), swapped.data() + 96 * esize, 64 * esize);  // rank 1's head first
  std::memcpy(swapped.data() + 96 * esize, first_block.data(), 64 * esize);
  const std::size_t moved =
      lmoe::bench::count_wrong_elements(gather, dtype, 0, kSeed, swapped.data());
  EXPECT_GT(moved, 64u);
  EXPECT_LE(moved, 128u);

  const CollectiveShape scatter{CollectiveOp::reduce_scatter, counts};
  const std::vector<std::byte> of_rank_1 = right_output(scatter, dtype, 1);  // 160 of them
  EXPECT_GT(lmoe::bench::count_wrong_elements(scatter, dtype, 0, kSeed, of_rank_1.data()), 48u)
      << "rank 1's piece passes as rank 0's";
}

}  // namespace

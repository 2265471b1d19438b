// The `threads` communicator: every collective on every tp and dtype, checked bit for bit — on
// inputs whose sums are exact in any order (so any correct reduction must match), and on random
// inputs against the rank-order fp32 sum (so the order itself is checked). Failure paths: a rank
// that never arrives times out instead of hanging, and a rank that throws is the error reported.
#include "lmoe/threads_communicator.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <bit>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/rank_order_reduce.hpp"
#include "error_message.hpp"
#include "lmoe/comm_group.hpp"
#include "lmoe/error.hpp"

namespace {

using lmoe::Communicator;
using lmoe::DType;
using lmoe::testing::error_message_of;
using ::testing::HasSubstr;

constexpr int kTpSizes[] = {1, 2, 3, 4, 8};
constexpr DType kDtypes[] = {DType::bf16, DType::f16, DType::f32};
// Outputs are filled with this byte before each collective so that an element left unwritten
// shows up as a mismatch (0x7f7f… is NaN-free garbage in every dtype: large finite values).
constexpr std::byte kPoison{0x7f};
constexpr std::size_t kGuard = 5;  // poisoned elements past the end of each output

// A host buffer of `count` elements of one dtype, addressed through fp32.
struct Buffer {
  DType dtype;
  std::vector<std::byte> bytes;
  Buffer(DType type, std::size_t count) : dtype(type), bytes(count * lmoe::dtype_size(type)) {}
  std::size_t size() const { return bytes.size() / lmoe::dtype_size(dtype); }
  void* data() { return bytes.data(); }
  const void* data() const { return bytes.data(); }
  float get(std::size_t i) const { return lmoe::load_as_float(bytes.data(), i, dtype); }
  void set(std::size_t i, float value) { lmoe::store_from_float(bytes.data(), i, dtype, value); }
  void poison() { std::fill(bytes.begin(), bytes.end(), kPoison); }
};

// Index of the first element whose bits differ, or -1.
long first_bit_difference(const Buffer& a, const Buffer& b, std::size_t count) {
  const std::size_t esize = lmoe::dtype_size(a.dtype);
  for (std::size_t i = 0; i < count; ++i) {
    if (std::memcmp(a.bytes.data() + i * esize, b.bytes.data() + i * esize, esize) != 0) {
      return static_cast<long>(i);
    }
  }
  return -1;
}

bool guard_intact(const Buffer& buffer, std::size_t from) {
  for (std::size_t byte = from * lmoe::dtype_size(buffer.dtype); byte < buffer.bytes.size();
       ++byte) {
    if (buffer.bytes[byte] != kPoison) return false;
  }
  return true;
}

// Small integers in [-8, 8]: any sum of up to 8 of them is exact in bf16, f16 and f32.
float exact_value(int rank, std::size_t i) {
  return static_cast<float>(
      static_cast<int>((i * 7 + static_cast<std::size_t>(rank) * 13 + i / 5) % 17) - 8);
}
float exact_sum(int tp, std::size_t i) {
  float sum = 0;
  for (int r = 0; r < tp; ++r) sum += exact_value(r, i);
  return sum;
}

std::vector<Buffer> exact_inputs(int tp, DType dtype, std::size_t count) {
  std::vector<Buffer> inputs;
  for (int r = 0; r < tp; ++r) {
    inputs.emplace_back(dtype, count);
    for (std::size_t i = 0; i < count; ++i) inputs[r].set(i, exact_value(r, i));
  }
  return inputs;
}

std::vector<Buffer> random_inputs(int tp, DType dtype, std::size_t count, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> scale(-6, 6);
  std::vector<Buffer> inputs;
  for (int r = 0; r < tp; ++r) {
    inputs.emplace_back(dtype, count);
    // Mixed magnitudes make the rounding of the fp32 sum depend on the order of addition.
    for (std::size_t i = 0; i < count; ++i) inputs[r].set(i, std::ldexp(normal(rng), scale(rng)));
  }
  return inputs;
}

// The contract written out independently of the library: fp32, rank 0 first, one rounding.
Buffer rank_order_sum(const std::vector<Buffer>& inputs, std::size_t begin, std::size_t count) {
  Buffer out(inputs[0].dtype, count);
  for (std::size_t i = 0; i < count; ++i) {
    float acc = inputs[0].get(begin + i);
    for (std::size_t r = 1; r < inputs.size(); ++r) acc += inputs[r].get(begin + i);
    out.set(i, acc);
  }
  return out;
}

// The library's own rank-order reduction, run on the main thread.
Buffer library_rank_order_sum(const std::vector<Buffer>& inputs, std::size_t begin,
                              std::size_t count) {
  Buffer out(inputs[0].dtype, count);
  const std::size_t esize = lmoe::dtype_size(out.dtype);
  std::vector<const void*> pointers;
  for (const Buffer& input : inputs) pointers.push_back(input.bytes.data() + begin * esize);
  lmoe::reduce_in_rank_order(pointers, out.data(), count, out.dtype);
  return out;
}

std::string label(int tp, DType dtype, std::size_t count) {
  return "tp=" + std::to_string(tp) + " dtype=" + std::string(lmoe::dtype_name(dtype)) +
         " count=" + std::to_string(count);
}

// Runs all_reduce on every rank and returns each rank's output (count + kGuard, poisoned first).
std::vector<Buffer> run_all_reduce(const std::vector<Buffer>& inputs, std::size_t count) {
  const int tp = static_cast<int>(inputs.size());
  std::vector<Buffer> outputs;
  for (int r = 0; r < tp; ++r) {
    outputs.emplace_back(inputs[0].dtype, count + kGuard);
    outputs[r].poison();
  }
  lmoe::run_on_threads(tp, [&](int rank, Communicator& comm) {
    comm.all_reduce(inputs[rank].data(), outputs[rank].data(), count, inputs[rank].dtype);
  });
  return outputs;
}

// ---------------------------------------------------------------------------------------------
// all_reduce

TEST(ThreadsAllReduce, ExactInputsEveryTpAndDtype) {
  // Counts below tp, not a multiple of tp, and across the reduction's 1024-element block.
  for (int tp : kTpSizes) {
    for (DType dtype : kDtypes) {
      for (std::size_t count :
           {std::size_t{1}, std::size_t{5}, std::size_t{1027}, std::size_t{2051}}) {
        const auto inputs = exact_inputs(tp, dtype, count);
        const auto outputs = run_all_reduce(inputs, count);
        Buffer expected(dtype, count);
        for (std::size_t i = 0; i < count; ++i) expected.set(i, exact_sum(tp, i));
        for (int r = 0; r < tp; ++r) {
          ASSERT_EQ(first_bit_difference(outputs[r], expected, count), -1)
              << label(tp, dtype, count) << " rank " << r;
          ASSERT_TRUE(guard_intact(outputs[r], count)) << label(tp, dtype, count) << " rank " << r;
        }
      }
    }
  }
}

TEST(ThreadsAllReduce, RandomInputsMatchTheRankOrderSumBitForBit) {
  std::uint32_t seed = 1000;
  for (int tp : kTpSizes) {
    for (DType dtype : kDtypes) {
      const std::size_t count = 3001;
      const auto inputs = random_inputs(tp, dtype, count, ++seed);
      const Buffer expected = rank_order_sum(inputs, 0, count);
      // The helper the communicator uses must agree with the contract written out above.
      ASSERT_EQ(first_bit_difference(library_rank_order_sum(inputs, 0, count), expected, count), -1)
          << label(tp, dtype, count);
      const auto outputs = run_all_reduce(inputs, count);
      for (int r = 0; r < tp; ++r) {
        ASSERT_EQ(first_bit_difference(outputs[r], expected, count), -1)
            << label(tp, dtype, count) << " rank " << r;
        ASSERT_TRUE(guard_intact(outputs[r], count));
      }
    }
  }
}

TEST(ThreadsAllReduce, RandomInputsAreSensitiveToTheOrder) {
  // Guards the test above: with these inputs a reversed order gives different bits, so a
  // communicator that summed in another order could not pass it.
  const auto inputs = random_inputs(4, DType::f32, 3001, 77);
  const Buffer forward = rank_order_sum(inputs, 0, 3001);
  const std::vector<Buffer> reversed_inputs(inputs.rbegin(), inputs.rend());
  const Buffer reversed = rank_order_sum(reversed_inputs, 0, 3001);
  EXPECT_NE(first_bit_difference(forward, reversed, 3001), -1);
}

TEST(ThreadsAllReduce, SumIsInFp32InRankOrderAndRoundedOnce) {
  struct Case {
    DType dtype;
    std::vector<float> per_rank;
    float expected;
  };
  const Case cases[] = {
      // f16: 65504 + 65504 overflows f16 but not fp32; one rounding at the end keeps 65504.
      {DType::f16, {65504.0f, 65504.0f, -65504.0f}, 65504.0f},
      // bf16: each 2^-8 alone is a tie that rounds away; in fp32 together they make 2^-7.
      {DType::bf16, {1.0f, 0x1p-8f, 0x1p-8f}, 1.0f + 0x1p-7f},
      // f32 in rank order: (1 + 2^27) rounds to 2^27 and the 1 is lost; the reverse order keeps it.
      {DType::f32, {1.0f, 0x1p27f, -0x1p27f}, 0.0f},
      {DType::f32, {0x1p27f, -0x1p27f, 1.0f}, 1.0f},
      // f16: a real overflow still becomes inf.
      {DType::f16, {65504.0f, 65504.0f}, std::numeric_limits<float>::infinity()},
  };
  for (const Case& c : cases) {
    const int tp = static_cast<int>(c.per_rank.size());
    std::vector<Buffer> inputs;
    for (int r = 0; r < tp; ++r) {
      inputs.emplace_back(c.dtype, 3);
      for (std::size_t i = 0; i < 3; ++i) inputs[r].set(i, c.per_rank[r]);
      ASSERT_EQ(inputs[r].get(0), c.per_rank[r]) << "input not representable";
    }
    const auto outputs = run_all_reduce(inputs, 3);
    for (int r = 0; r < tp; ++r) {
      for (std::size_t i = 0; i < 3; ++i) {
        EXPECT_EQ(outputs[r].get(i), c.expected) << lmoe::dtype_name(c.dtype) << " rank " << r;
      }
    }
  }
}

TEST(ThreadsAllReduce, InPlace) {
  for (int tp : kTpSizes) {
    for (DType dtype : kDtypes) {
      const std::size_t count = 1029;
      auto buffers = random_inputs(tp, dtype, count, 4242u + static_cast<std::uint32_t>(tp));
      const Buffer expected = rank_order_sum(buffers, 0, count);
      lmoe::run_on_threads(tp, [&](int rank, Communicator& comm) {
        comm.all_reduce(buffers[rank].data(), buffers[rank].data(), count, dtype);
      });
      for (int r = 0; r < tp; ++r) {
        ASSERT_EQ(first_bit_difference(buffers[r], expected, count), -1)
            << label(tp, dtype, count) << " rank " << r;
      }
    }
  }
}

TEST(ThreadsAllReduce, ZeroCountTouchesNothing) {
  for (int tp : kTpSizes) {
    const auto inputs = exact_inputs(tp, DType::bf16, 4);
    const auto outputs = run_all_reduce(inputs, 0);
    for (int r = 0; r < tp; ++r) EXPECT_TRUE(guard_intact(outputs[r], 0)) << "tp=" << tp;
  }
}

TEST(ThreadsAllReduce, NegativeZeroSumStartsFromRankZero) {
  for (int tp : kTpSizes) {
    for (DType dtype : kDtypes) {
      std::vector<Buffer> inputs;
      for (int r = 0; r < tp; ++r) {
        inputs.emplace_back(dtype, 3);
        inputs[r].set(0, -0.0f);                  // all −0 → −0 (a +0 start would give +0)
        inputs[r].set(1, r == 0 ? 0.0f : -0.0f);  // +0 first → +0
        inputs[r].set(2, r == 0 ? -0.0f : 0.0f);  // −0 + +0 → +0 (unless tp = 1)
      }
      const auto outputs = run_all_reduce(inputs, 3);
      for (int r = 0; r < tp; ++r) {
        EXPECT_TRUE(std::signbit(outputs[r].get(0))) << label(tp, dtype, 3) << " rank " << r;
        EXPECT_EQ(outputs[r].get(0), 0.0f);
        EXPECT_FALSE(std::signbit(outputs[r].get(1))) << label(tp, dtype, 3) << " rank " << r;
        EXPECT_EQ(std::signbit(outputs[r].get(2)), tp == 1) << label(tp, dtype, 3) << " rank " << r;
      }
    }
  }
}

TEST(ThreadsAllReduce, SubnormalsArePreserved) {
  // The smallest subnormal of each dtype, on every rank: the sum is tp of them, exactly (no FTZ),
  // and a subnormal and its negation cancel to +0.
  struct Tiny {
    DType dtype;
    float value;
  };
  for (const Tiny& tiny : {Tiny{DType::bf16, 0x1p-133f}, Tiny{DType::f16, 0x1p-24f},
                           Tiny{DType::f32, std::numeric_limits<float>::denorm_min()}}) {
    for (int tp : kTpSizes) {
      std::vector<Buffer> inputs;
      for (int r = 0; r < tp; ++r) {
        inputs.emplace_back(tiny.dtype, 2);
        inputs[r].set(0, tiny.value);
        inputs[r].set(1, r % 2 ? -tiny.value : tiny.value);
        ASSERT_EQ(inputs[r].get(0), tiny.value);
      }
      const auto outputs = run_all_reduce(inputs, 2);
      const float expected0 = static_cast<float>(tp) * tiny.value;
      const float expected1 = tp % 2 ? tiny.value : 0.0f;
      ASSERT_EQ(std::fpclassify(expected0), tiny.dtype == DType::f16 ? FP_NORMAL : FP_SUBNORMAL);
      for (int r = 0; r < tp; ++r) {
        EXPECT_EQ(outputs[r].get(0), expected0) << label(tp, tiny.dtype, 2) << " rank " << r;
        EXPECT_EQ(std::bit_cast<std::uint32_t>(outputs[r].get(1)),
                  std::bit_cast<std::uint32_t>(expected1))
            << label(tp, tiny.dtype, 2) << " rank " << r;
      }
    }
  }
}

TEST(ThreadsAllReduce, ManyCollectivesInARowStayInStep) {
  // Back-to-back collectives of different kinds reuse the group's slots and scratch: a rank that
  // runs ahead must not disturb a slower peer still reading the previous one.
  const int tp = 4;
  const std::size_t count = 257;
  std::vector<std::vector<Buffer>> inputs;
  for (int round = 0; round < 40; ++round) {
    inputs.push_back(
        random_inputs(tp, DType::bf16, count, 9000u + static_cast<std::uint32_t>(round)));
  }
  std::vector<std::vector<Buffer>> outputs(inputs.size());
  for (auto& round : outputs) {
    for (int r = 0; r < tp; ++r) round.emplace_back(DType::bf16, count);
  }
  const auto offsets = lmoe::even_split_offsets(count, tp);
  std::vector<std::size_t> counts;
  for (int r = 0; r < tp; ++r) counts.push_back(offsets[r + 1] - offsets[r]);
  lmoe::run_on_threads(tp, [&](int rank, Communicator& comm) {
    for (std::size_t round = 0; round < inputs.size(); ++round) {
      void* out = outputs[round][rank].data();
      const void* in = inputs[round][rank].data();
      if (rank == static_cast<int>(round % tp))
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      switch (round % 3) {
        case 0: comm.all_reduce(in, out, count, DType::bf16); break;
        case 1: {
          comm.reduce_scatter(in, out, counts, DType::bf16);
          break;
        }
        case 2: comm.all_gather(in, out, counts, DType::bf16); break;
      }
    }
  });
  for (std::size_t round = 0; round < inputs.size(); ++round) {
    for (int r = 0; r < tp; ++r) {
      if (round % 3 == 0) {
        ASSERT_EQ(
            first_bit_difference(outputs[round][r], rank_order_sum(inputs[round], 0, count), count),
            -1)
            << "round " << round << " rank " << r;
      } else if (round % 3 == 1) {
        ASSERT_EQ(
            first_bit_difference(outputs[round][r],
                                 rank_order_sum(inputs[round], offsets[r], counts[r]), counts[r]),
            -1)
            << "round " << round << " rank " << r;
      } else {
        Buffer expected(DType::bf16, count);
        for (int peer = 0; peer < tp; ++peer) {
          for (std::size_t i = 0; i < counts[peer]; ++i)
            expected.set(offsets[peer] + i, inputs[round][peer].get(i));
        }
        ASSERT_EQ(first_bit_difference(outputs[round][r], expected, count), -1)
            << "round " << round << " rank " << r;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// reduce_scatter

// Counts per rank to try for a given tp: uneven, with zeros, all zero.
std::vector<std::vector<std::size_t>> count_patterns(int tp) {
  std::vector<std::vector<std::size_t>> patterns;
  std::vector<std::size_t> uneven, with_zeros, all_zero(static_cast<std::size_t>(tp), 0), big;
  for (int r = 0; r < tp; ++r) {
    uneven.push_back(static_cast<std::size_t>(3 + 2 * r));
    with_zeros.push_back(r % 2 ? 0 : static_cast<std::size_t>(r + 1));
    big.push_back(static_cast<std::size_t>(1500 - 97 * r));
  }
  patterns.push_back(uneven);
  patterns.push_back(with_zeros);
  patterns.push_back(all_zero);
  patterns.push_back(big);
  return patterns;
}

std::vector<std::size_t> prefix_offsets(const std::vector<std::size_t>& counts) {
  std::vector<std::size_t> offsets(counts.size() + 1, 0);
  for (std::size_t r = 0; r < counts.size(); ++r) offsets[r + 1] = offsets[r] + counts[r];
  return offsets;
}

TEST(ThreadsReduceScatter, ExactAndRandomInputsEveryTpDtypeAndCountPattern) {
  std::uint32_t seed = 31;
  for (int tp : kTpSizes) {
    for (DType dtype : kDtypes) {
      for (const auto& counts : count_patterns(tp)) {
        const auto offsets = prefix_offsets(counts);
        const std::size_t total = offsets.back();
        for (bool exact : {true, false}) {
          const auto inputs =
              exact ? exact_inputs(tp, dtype, total) : random_inputs(tp, dtype, total, ++seed);
          std::vector<Buffer> outputs;
          for (int r = 0; r < tp; ++r) {
            outputs.emplace_back(dtype, counts[r] + kGuard);
            outputs[r].poison();
          }
          lmoe::run_on_threads(tp, [&](int rank, Communicator& comm) {
            comm.reduce_scatter(inputs[rank].data(), outputs[rank].data(), counts, dtype);
          });
          for (int r = 0; r < tp; ++r) {
            Buffer expected(dtype, counts[r]);
            if (exact) {
              for (std::size_t i = 0; i < counts[r]; ++i)
                expected.set(i, exact_sum(tp, offsets[r] + i));
            } else {
              expected = rank_order_sum(inputs, offsets[r], counts[r]);
            }
            ASSERT_EQ(first_bit_difference(outputs[r], expected, counts[r]), -1)
                << label(tp, dtype, total) << (exact ? " exact" : " random") << " rank " << r;
            ASSERT_TRUE(guard_intact(outputs[r], counts[r]))
                << label(tp, dtype, total) << " rank " << r;
          }
        }
      }
    }
  }
}

TEST(ThreadsReduceScatter, InPlaceIntoOwnBlock) {
  // recv is this rank's own block of send, which its peers are still reading.
  for (int tp : kTpSizes) {
    std::vector<std::size_t> counts;
    for (int r = 0; r < tp; ++r) counts.push_back(static_cast<std::size_t>(100 + 31 * r));
    const auto offsets = prefix_offsets(counts);
    auto buffers =
        random_inputs(tp, DType::f16, offsets.back(), 555u + static_cast<std::uint32_t>(tp));
    const auto original = buffers;
    lmoe::run_on_threads(tp, [&](int rank, Communicator& comm) {
      void* own_block = buffers[rank].bytes.data() + offsets[rank] * 2;
      comm.reduce_scatter(buffers[rank].data(), own_block, counts, DType::f16);
    });
    for (int r = 0; r < tp; ++r) {
      const Buffer expected = rank_order_sum(original, offsets[r], counts[r]);
      Buffer got(DType::f16, counts[r]);
      std::memcpy(got.data(), buffers[r].bytes.data() + offsets[r] * 2, counts[r] * 2);
      ASSERT_EQ(first_bit_difference(got, expected, counts[r]), -1) << "tp=" << tp << " rank " << r;
    }
  }
}

TEST(ThreadsReduceScatter, NegativeZeroAndSubnormals) {
  const int tp = 3;
  for (DType dtype : {DType::bf16, DType::f16}) {
    const float tiny = dtype == DType::bf16 ? 0x1p-133f : 0x1p-24f;
    const std::vector<std::size_t> counts = {2, 2, 2};
    std::vector<Buffer> inputs;
    for (int r = 0; r < tp; ++r) {
      inputs.emplace_back(dtype, 6);
      for (std::size_t i = 0; i < 6; ++i) inputs[r].set(i, i % 2 ? tiny : -0.0f);
    }
    std::vector<Buffer> outputs;
    for (int r = 0; r < tp; ++r) outputs.emplace_back(dtype, 2);
    lmoe::run_on_threads(tp, [&](int rank, Communicator& comm) {
      comm.reduce_scatter(inputs[rank].data(), outputs[rank].data(), counts, dtype);
    });
    for (int r = 0; r < tp; ++r) {
      EXPECT_TRUE(std::signbit(outputs[r].get(0))) << lmoe::dtype_name(dtype);
      EXPECT_EQ(outputs[r].get(0), 0.0f);
      EXPECT_EQ(outputs[r].get(1), 3 * tiny) << lmoe::dtype_name(dtype);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// all_gather

TEST(ThreadsAllGather, EveryTpDtypeAndCountPattern) {
  std::uint32_t seed = 71;
  for (int tp : kTpSizes) {
    for (DType dtype : kDtypes) {
      for (const auto& counts : count_patterns(tp)) {
        const auto offsets = prefix_offsets(counts);
        const std::size_t total = offsets.back();
        std::vector<Buffer> inputs;
        for (int r = 0; r < tp; ++r) {
          inputs.push_back(random_inputs(1, dtype, counts[r], ++seed)[0]);
          if (counts[r] > 0)
            inputs[r].set(0, r % 2 ? -0.0f : 0x1p-133f);  // −0 and subnormals pass as bits
        }
        std::vector<Buffer> outputs;
        for (int r = 0; r < tp; ++r) {
          outputs.emplace_back(dtype, total + kGuard);
          outputs[r].poison();
        }
        lmoe::run_on_threads(tp, [&](int rank, Communicator& comm) {
          comm.all_gather(inputs[rank].data(), outputs[rank].data(), counts, dtype);
        });
        Buffer expected(dtype, total);
        for (int peer = 0; peer < tp; ++peer) {
          if (counts[peer] == 0)
            continue;  // an empty block's data() may be null, which memcpy forbids
          std::memcpy(expected.bytes.data() + offsets[peer] * lmoe::dtype_size(dtype),
                      inputs[peer].data(), counts[peer] * lmoe::dtype_size(dtype));
        }
        for (int r = 0; r < tp; ++r) {
          ASSERT_EQ(first_bit_difference(outputs[r], expected, total), -1)
              << label(tp, dtype, total) << " rank " << r;
          ASSERT_TRUE(guard_intact(outputs[r], total)) << label(tp, dtype, total) << " rank " << r;
        }
      }
    }
  }
}

TEST(ThreadsAllGather, InPlaceFromOwnBlock) {
  // send is this rank's own block of recv (the in-place form the implementation supports).
  for (int tp : kTpSizes) {
    std::vector<std::size_t> counts;
    for (int r = 0; r < tp; ++r) counts.push_back(static_cast<std::size_t>(40 + 9 * r));
    const auto offsets = prefix_offsets(counts);
    const std::size_t total = offsets.back();
    const auto blocks =
        random_inputs(tp, DType::bf16, total, 808u + static_cast<std::uint32_t>(tp));
    std::vector<Buffer> buffers;
    for (int r = 0; r < tp; ++r) {
      buffers.emplace_back(DType::bf16, total);
      buffers[r].poison();
      std::memcpy(buffers[r].bytes.data() + offsets[r] * 2, blocks[r].bytes.data() + offsets[r] * 2,
                  counts[r] * 2);
    }
    lmoe::run_on_threads(tp, [&](int rank, Communicator& comm) {
      const void* own_block = buffers[rank].bytes.data() + offsets[rank] * 2;
      comm.all_gather(own_block, buffers[rank].data(), counts, DType::bf16);
    });
    Buffer expected(DType::bf16, total);
    for (int peer = 0; peer < tp; ++peer) {
      std::memcpy(expected.bytes.data() + offsets[peer] * 2,
                  blocks[peer].bytes.data() + offsets[peer] * 2, counts[peer] * 2);
    }
    for (int r = 0; r < tp; ++r) {
      ASSERT_EQ(first_bit_difference(buffers[r], expected, total), -1)
          << "tp=" << tp << " rank " << r;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Bad arguments and failures

TEST(ThreadsCommunicatorErrors, CountsOfTheWrongLengthThrowBeforeWaiting) {
  // Checked before the rank joins the collective, so a lone caller fails at once (no peers needed).
  auto comms = lmoe::make_thread_communicators(3, std::chrono::milliseconds(5000));
  std::vector<std::uint16_t> send(16), recv(16);
  const std::vector<std::size_t> two = {1, 1}, four = {1, 1, 1, 1};
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(error_message_of(
                [&] { comms[1]->reduce_scatter(send.data(), recv.data(), two, DType::bf16); }),
            "reduce_scatter: counts has 2 entries, expected one per rank (3)");
  EXPECT_EQ(
      error_message_of([&] { comms[0]->all_gather(send.data(), recv.data(), four, DType::bf16); }),
      "all_gather: counts has 4 entries, expected one per rank (3)");
  EXPECT_EQ(
      error_message_of([&] { comms[2]->all_gather(send.data(), recv.data(), {}, DType::bf16); }),
      "all_gather: counts has 0 entries, expected one per rank (3)");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
}

TEST(ThreadsCommunicatorErrors, GroupSizeMustBePositive) {
  EXPECT_EQ(error_message_of([] { lmoe::make_thread_communicators(0); }),
            "number of ranks must be >= 1, got 0");
  EXPECT_EQ(error_message_of([] { lmoe::make_thread_communicators(-2); }),
            "number of ranks must be >= 1, got -2");
  auto comms = lmoe::make_thread_communicators(1);
  ASSERT_EQ(comms.size(), 1u);
  EXPECT_EQ(comms[0]->size(), 1);
  EXPECT_EQ(comms[0]->rank(), 0);
  EXPECT_EQ(comms[0]->backend_name(), "threads");
  EXPECT_EQ(comms[0]->memory_space(), lmoe::MemorySpace::host);
}

TEST(ThreadsCommunicatorErrors, RanksAndSizesAreReported) {
  auto comms = lmoe::make_thread_communicators(4);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(comms[r]->rank(), r);
    EXPECT_EQ(comms[r]->size(), 4);
  }
}

TEST(ThreadsCommunicatorErrors, MissingRankTimesOutInsteadOfHanging) {
  const auto timeout = std::chrono::milliseconds(200);
  auto comms = lmoe::make_thread_communicators(3, timeout);
  std::vector<std::string> messages(2);
  std::vector<int> threw_error(2, 0);  // not vector<bool>: its bits share words across threads
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {  // rank 2 never arrives
    threads.emplace_back([&, rank] {
      std::vector<float> data(8, 1.0f);
      try {
        comms[rank]->all_reduce(data.data(), data.data(), data.size(), DType::f32);
      } catch (const lmoe::Error& error) {
        threw_error[rank] = 1;
        messages[rank] = error.message();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_GE(elapsed, timeout);
  EXPECT_LT(elapsed, std::chrono::seconds(5));
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(threw_error[rank], 1) << "rank " << rank;
    EXPECT_THAT(messages[rank], HasSubstr("waited more than 200 ms for its peers in all_reduce"))
        << rank;
  }
  // The group is aborted now: the late rank and any later collective fail at once.
  const auto late = std::chrono::steady_clock::now();
  float value = 1.0f;
  EXPECT_THAT(error_message_of([&] { comms[2]->all_reduce(&value, &value, 1, DType::f32); }),
              HasSubstr("waited more than 200 ms"));
  EXPECT_THAT(error_message_of([&] { comms[0]->barrier(); }),
              HasSubstr("communicator aborted by rank"));
  EXPECT_LT(std::chrono::steady_clock::now() - late, timeout);
}

TEST(ThreadsCommunicatorErrors, MissingRankUnderRunOnThreads) {
  const auto start = std::chrono::steady_clock::now();
  const std::string message = error_message_of([] {
    lmoe::run_on_threads(
        4,
        [](int rank, Communicator& comm) {
          if (rank == 3) return;  // leaves without joining the collective
          std::vector<std::uint16_t> data(4, 0);
          comm.all_gather(data.data(), std::vector<std::uint16_t>(16).data(),
                          std::vector<std::size_t>(4, 1), DType::bf16);
        },
        std::chrono::milliseconds(200));
  });
  EXPECT_THAT(message, HasSubstr("waited more than 200 ms for its peers in all_gather"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

TEST(ThreadsCommunicatorErrors, ExplicitAbortFailsPendingAndFutureCollectives) {
  auto comms = lmoe::make_thread_communicators(2, std::chrono::milliseconds(10000));
  std::string pending;
  std::thread waiter([&] { pending = error_message_of([&] { comms[0]->barrier(); }); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const auto start = std::chrono::steady_clock::now();
  comms[1]->abort("out of memory on rank 1");
  waiter.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start,
            std::chrono::seconds(2));  // not the 10 s timeout
  EXPECT_EQ(pending, "communicator aborted by rank 1: out of memory on rank 1");
  float value = 0;
  EXPECT_EQ(error_message_of([&] { comms[1]->all_reduce(&value, &value, 1, DType::f32); }),
            "communicator aborted by rank 1: out of memory on rank 1");
  // A second abort does not replace the first reason.
  comms[0]->abort("later");
  EXPECT_EQ(error_message_of([&] { comms[0]->barrier(); }),
            "communicator aborted by rank 1: out of memory on rank 1");
}

TEST(ThreadsCommunicatorErrors, RunOnThreadsRethrowsTheFailingRanksOwnError) {
  const auto start = std::chrono::steady_clock::now();
  // Rank 2 fails before the collective the others wait in; they are released by the abort.
  const std::string message = error_message_of([] {
    lmoe::run_on_threads(
        4,
        [](int rank, Communicator& comm) {
          if (rank == 2) throw lmoe::Error("rank 2 found a bad shape");
          float value = 1.0f;
          comm.all_reduce(&value, &value, 1, DType::f32);
        },
        std::chrono::milliseconds(10000));
  });
  EXPECT_EQ(message, "rank 2 found a bad shape");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

TEST(ThreadsCommunicatorErrors, RunOnThreadsWithManyAbortedRanks) {
  // Seven ranks are released by one abort at once and record that concurrently; the genuine error
  // of the highest rank must still be the one reported, every time.
  for (int attempt = 0; attempt < 20; ++attempt) {
    const std::string message = error_message_of([] {
      lmoe::run_on_threads(8, [](int rank, Communicator& comm) {
        if (rank == 7) {
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
          throw lmoe::Error("rank 7 failed");
        }
        comm.barrier();
      });
    });
    ASSERT_EQ(message, "rank 7 failed") << "attempt " << attempt;
  }
}

TEST(ThreadsCommunicatorErrors, RunOnThreadsKeepsTheExceptionType) {
  try {
    lmoe::run_on_threads(3, [](int rank, Communicator& comm) {
      if (rank == 1) throw std::out_of_range("index 9 past 8");
      comm.barrier();
    });
    FAIL() << "no throw";
  } catch (const std::out_of_range& error) {
    EXPECT_STREQ(error.what(), "index 9 past 8");
  }
  // Something that is not even a std::exception is still reported, not swallowed.
  EXPECT_THROW(lmoe::run_on_threads(2,
                                    [](int rank, Communicator& comm) {
                                      if (rank == 0) throw 42;
                                      comm.barrier();
                                    }),
               int);
}

TEST(ThreadsCommunicatorErrors, RunOnThreadsReportsTheLowestFailingRank) {
  // Ranks 1 and 3 both fail on their own; rank order decides, whichever thread failed first.
  for (int attempt = 0; attempt < 5; ++attempt) {
    const std::string message = error_message_of([] {
      lmoe::run_on_threads(4, [](int rank, Communicator& comm) {
        if (rank == 3) throw lmoe::Error("rank 3 failed");
        if (rank == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
          throw lmoe::Error("rank 1 failed");
        }
        comm.barrier();
      });
    });
    // Rank 1 never waits, so rank 3's abort cannot preempt it: both errors are genuine and the
    // lower rank's is reported although it was thrown later.
    EXPECT_EQ(message, "rank 1 failed");
  }
}

TEST(ThreadsCommunicatorErrors, RunOnThreadsSucceedsQuietly) {
  std::atomic<int> ran{0};
  lmoe::run_on_threads(8, [&](int, Communicator& comm) {
    comm.barrier();
    ++ran;
  });
  EXPECT_EQ(ran.load(), 8);
}

// ---------------------------------------------------------------------------------------------
// even_split_offsets

TEST(EvenSplitOffsets, SizesDifferByAtMostOneAndTheFirstAreLonger) {
  using Offsets = std::vector<std::size_t>;
  EXPECT_EQ(lmoe::even_split_offsets(10, 3), (Offsets{0, 4, 7, 10}));
  EXPECT_EQ(lmoe::even_split_offsets(9, 3), (Offsets{0, 3, 6, 9}));
  EXPECT_EQ(lmoe::even_split_offsets(11, 3), (Offsets{0, 4, 8, 11}));
  EXPECT_EQ(lmoe::even_split_offsets(2, 4), (Offsets{0, 1, 2, 2, 2}));
  EXPECT_EQ(lmoe::even_split_offsets(0, 4), (Offsets{0, 0, 0, 0, 0}));
  EXPECT_EQ(lmoe::even_split_offsets(7, 1), (Offsets{0, 7}));
  for (std::size_t count = 0; count < 70; ++count) {
    for (int parts : {1, 2, 3, 4, 5, 8}) {
      const auto offsets = lmoe::even_split_offsets(count, parts);
      ASSERT_EQ(offsets.size(), static_cast<std::size_t>(parts) + 1);
      ASSERT_EQ(offsets.front(), 0u);
      ASSERT_EQ(offsets.back(), count);
      for (int p = 0; p < parts; ++p) {
        const std::size_t size = offsets[p + 1] - offsets[p];
        ASSERT_EQ(size, count / parts + (static_cast<std::size_t>(p) < count % parts ? 1 : 0))
            << count << "/" << parts << " part " << p;
      }
    }
  }
}

TEST(ReduceInRankOrder, OutMayAliasTheFirstInput) {
  std::vector<float> a = {1.0f, -0.0f, 0x1p27f}, b = {0x1p27f, -0.0f, 1.0f},
                     c = {-0x1p27f, -0.0f, -0x1p27f};
  const std::vector<const void*> inputs = {a.data(), b.data(), c.data()};
  lmoe::reduce_in_rank_order(inputs, a.data(), 3, DType::f32);
  EXPECT_EQ(a[0], 0.0f);  // (1 + 2^27) − 2^27 in fp32: the 1 is lost, as in rank order
  EXPECT_TRUE(std::signbit(a[1]));
  EXPECT_EQ(a[2], 0.0f);  // 2^27 + 1 rounds to 2^27 (ulp 16), − 2^27
}

}  // namespace

// The control path gathers whole records of any byte length (not a multiple of 4 here), in rank
// order, on every rank: LatentTail agrees on each call through it.
TEST(ThreadsControlAllGather, GathersOddSizedRecordsInRankOrder) {
  for (int tp : {1, 2, 3}) {
    std::vector<std::vector<unsigned char>> gathered(static_cast<std::size_t>(tp));
    lmoe::run_on_threads(tp, [&](int rank, lmoe::Communicator& comm) {
      const unsigned char mine[7] = {static_cast<unsigned char>(rank),      1, 2, 3, 4, 5,
                                     static_cast<unsigned char>(200 + rank)};
      gathered[rank].assign(7u * static_cast<std::size_t>(tp), 0xee);
      comm.control_all_gather(mine, gathered[rank].data(), sizeof(mine));
    });
    for (int rank = 0; rank < tp; ++rank) {
      for (int peer = 0; peer < tp; ++peer) {
        EXPECT_EQ(gathered[rank][7u * peer], peer);
        EXPECT_EQ(gathered[rank][7u * peer + 6], 200 + peer);
      }
    }
  }
}

// A comm name this build cannot run is refused before any rank starts, with the names it can.
TEST(CommGroup, AnUnknownCommIsRefusedNamingThoseAvailable) {
  std::atomic<int> ran{0};
  try {
    lmoe::run_comm_group("thread", 2, [&](int, Communicator&) { ++ran; });
    ADD_FAILURE() << "no error";
  } catch (const lmoe::Error& error) {
    EXPECT_THAT(error.message(),
                HasSubstr("unknown or unavailable comm backend 'thread'; available here: threads"));
  }
  EXPECT_EQ(ran.load(), 0);
}

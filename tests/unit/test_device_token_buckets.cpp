// The buckets of T behind LatentTail::forward_device_tokens (one CUDA graph for every T), and what
// the entry point refuses on a backend that cannot read T on the device. The GPU side is
// tests/cuda/test_device_tokens.cpp.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/device_token_buckets.hpp"
#include "lmoe/error.hpp"
#include "lmoe/latent_tail.hpp"
#include "lmoe/reference.hpp"
#include "lmoe/threads_communicator.hpp"

namespace {

using lmoe::DeviceTokenBucket;
using lmoe::DeviceTokenChoice;
using lmoe::TailTier;

struct Expected {
  std::int64_t min_tokens, max_tokens;
  std::optional<TailTier> tier;
};

void expect_buckets(const std::vector<DeviceTokenBucket>& got,
                    const std::vector<Expected>& expected) {
  ASSERT_EQ(got.size(), expected.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    SCOPED_TRACE("bucket " + std::to_string(i));
    EXPECT_EQ(got[i].min_tokens, expected[i].min_tokens);
    EXPECT_EQ(got[i].max_tokens, expected[i].max_tokens);
    EXPECT_EQ(got[i].tier, expected[i].tier);
  }
}

// The power-of-two buckets [1, 1], [2, 2], [3, 4], ... [max_tokens / 2 + 1, max_tokens] for a
// power of two max_tokens <= 128, all of one tier.
std::vector<Expected> power_of_two_buckets(std::int64_t max_tokens, TailTier tier) {
  constexpr std::int64_t kBounds[][2] = {{1, 1},  {2, 2},   {3, 4},   {5, 8},
                                         {9, 16}, {17, 32}, {33, 64}, {65, 128}};
  std::vector<Expected> buckets;
  for (const auto& [first, last] : kBounds) {
    if (last <= max_tokens) buckets.push_back({first, last, tier});
  }
  return buckets;
}

// `head` followed by `tail`.
std::vector<Expected> joined(std::vector<Expected> head, const std::vector<Expected>& tail) {
  head.insert(head.end(), tail.begin(), tail.end());
  return head;
}

// A breakpoint policy: fused up to fused_max, overlap up to overlap_max, column above.
auto breakpoints(std::int64_t fused_max, std::int64_t overlap_max) {
  return [=](std::int64_t t) -> DeviceTokenChoice {
    if (t <= fused_max) return {TailTier::fused, {}};
    if (t <= overlap_max) return {TailTier::overlap, {}};
    return {TailTier::column, {}};
  };
}

TEST(DeviceTokenBuckets, PowersOfTwoAndTheTiersBoundariesSplitThem) {
  expect_buckets(
      lmoe::make_device_token_buckets(200, breakpoints(128, 256)),
      joined(power_of_two_buckets(128, TailTier::fused), {{129, 200, TailTier::overlap}}));
  // A boundary inside a power-of-two range splits it; the bucket ends (45, 64) get the tier chosen
  // there.
  expect_buckets(lmoe::make_device_token_buckets(70, breakpoints(45, 65)),
                 joined(power_of_two_buckets(32, TailTier::fused), {{33, 45, TailTier::fused},
                                                                    {46, 64, TailTier::overlap},
                                                                    {65, 65, TailTier::overlap},
                                                                    {66, 70, TailTier::column}}));
  expect_buckets(lmoe::make_device_token_buckets(1, breakpoints(0, 0)), {{1, 1, TailTier::column}});
  // Every T asked once, in order.
  std::vector<std::int64_t> asked;
  lmoe::make_device_token_buckets(9, [&](std::int64_t t) -> DeviceTokenChoice {
    asked.push_back(t);
    return {TailTier::token, {}};
  });
  EXPECT_EQ(asked, (std::vector<std::int64_t>{1, 2, 3, 4, 5, 6, 7, 8, 9}));
}

TEST(DeviceTokenBuckets, TWithoutATierGetsABucketWithTheReason) {
  // The token tier forced with tp = 4: T < 4 cannot run it.
  const auto buckets = lmoe::make_device_token_buckets(6, [](std::int64_t t) -> DeviceTokenChoice {
    if (t < 4) return {std::nullopt, "T=" + std::to_string(t) + " < tp=4"};
    return {TailTier::token, {}};
  });
  expect_buckets(buckets, {{1, 1, std::nullopt},
                           {2, 2, std::nullopt},
                           {3, 3, std::nullopt},
                           {4, 4, TailTier::token},
                           {5, 6, TailTier::token}});
  EXPECT_EQ(buckets[0].reason, "T=1 < tp=4");
  EXPECT_EQ(buckets[2].reason, "T=3 < tp=4");
  EXPECT_TRUE(buckets[3].reason.empty());
}

TEST(DeviceTokenBuckets, TheCpuBackendRefusesTReadOnTheDevice) {
  const lmoe::TailDims dims{64, 32};
  const lmoe::TailCase c = lmoe::make_random_case(dims, 1e-5f, lmoe::DType::bf16, 1, 4, 5u);
  lmoe::run_on_threads(1, [&](int, lmoe::Communicator& comm) {
    lmoe::TailOptions options;
    options.dims = dims;
    options.max_tokens = 8;
    lmoe::LatentTail tail(options, comm, c.norm_weight.matrix(), c.up_proj_weight.matrix());
    const auto buckets = tail.device_token_buckets();
    ASSERT_FALSE(buckets.empty());
    EXPECT_EQ(buckets.back().max_tokens, 8);
    for (const DeviceTokenBucket& bucket : buckets) {
      EXPECT_FALSE(bucket.tier.has_value());
      EXPECT_NE(bucket.reason.find("the cpu backend reads T on the host only"), std::string::npos)
          << bucket.reason;
    }
    lmoe::HostTensor routed(lmoe::DType::bf16, {8, dims.d_latent}),
        shared(lmoe::DType::bf16, {8, dims.d_model});
    const std::int32_t tokens = 4;
    try {
      tail.forward_device_tokens(routed.matrix(), shared.matrix(), shared.matrix(), &tokens);
      ADD_FAILURE() << "the cpu backend ran forward_device_tokens";
    } catch (const lmoe::Error& error) {
      EXPECT_EQ(error.message(), "forward_device_tokens needs the cuda backend, not cpu");
    }
    EXPECT_NO_THROW(tail.check_device_tokens());  // nothing recorded
  });
}

}  // namespace

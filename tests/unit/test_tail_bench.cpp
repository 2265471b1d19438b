// The tail benchmark's library parts: statistics, byte counts, the input generator, and the CPU
// sweep end to end (records, declines, checks, a fault that must be caught, bad options).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "lmoe/error.hpp"
#include "lmoe/tools/tail_bench.hpp"
#include "tools/bench_rank.hpp"
#include "tools/bench_values.hpp"

namespace {

using lmoe::DType;
using lmoe::TailTier;
using ::testing::HasSubstr;

const lmoe::TailDims kSmall{384, 192};
const lmoe::TailDims kK3{7168, 3584};

// ---- statistics --------------------------------------------------------------------------------

TEST(BenchStats, QuantilesInterpolateBetweenSortedSamples) {
  const std::vector<double> odd = {5, 1, 3};  // sorted 1 3 5
  EXPECT_DOUBLE_EQ(lmoe::quantile(odd, 0.5), 3);
  EXPECT_DOUBLE_EQ(lmoe::quantile(odd, 0.1), 1.4);  // position 0.2
  EXPECT_DOUBLE_EQ(lmoe::quantile(odd, 0.9), 4.6);  // position 1.8
  EXPECT_DOUBLE_EQ(lmoe::quantile(odd, 0.0), 1);
  EXPECT_DOUBLE_EQ(lmoe::quantile(odd, 1.0), 5);

  const std::vector<double> even = {4, 2, 1, 3};
  EXPECT_DOUBLE_EQ(lmoe::quantile(even, 0.5), 2.5);

  std::vector<double> hundred_and_one;
  for (int i = 100; i >= 0; --i) hundred_and_one.push_back(i);
  const lmoe::TimeStats stats = lmoe::time_stats(hundred_and_one);
  EXPECT_DOUBLE_EQ(stats.median, 50);
  EXPECT_DOUBLE_EQ(stats.p10, 10);
  EXPECT_DOUBLE_EQ(stats.p90, 90);
  EXPECT_DOUBLE_EQ(stats.min, 0);
  EXPECT_DOUBLE_EQ(stats.max, 100);
}

TEST(BenchStats, OneSampleIsEveryQuantile) {
  const lmoe::TimeStats stats = lmoe::time_stats(std::vector<double>{7.5});
  EXPECT_EQ(stats.median, 7.5);
  EXPECT_EQ(stats.p10, 7.5);
  EXPECT_EQ(stats.p90, 7.5);
}

TEST(BenchStats, NoSamplesOrBadQuantileIsAnError) {
  try {
    lmoe::time_stats(std::vector<double>{});
    FAIL() << "no error";
  } catch (const lmoe::Error& error) {
    EXPECT_THAT(error.message(), HasSubstr("at least one sample"));
  }
  const std::vector<double> one = {1};
  EXPECT_THROW(lmoe::quantile(one, 1.5), lmoe::Error);
  EXPECT_THROW(lmoe::quantile(one, -0.1), lmoe::Error);
}

// ---- byte counts -------------------------------------------------------------------------------

TEST(BenchBytes, InputBytesAreBothPartials) {
  EXPECT_DOUBLE_EQ(lmoe::tail_input_bytes(1, kK3, DType::bf16), (7168 + 3584) * 2.0);
  EXPECT_DOUBLE_EQ(lmoe::tail_input_bytes(3, kSmall, DType::f32), 3 * (384 + 192) * 4.0);
}

TEST(BenchBytes, BusBytesFollowEachTiersCollectives) {
  const double esize = 2, t = 5, d = 7168, l = 3584, tp = 8;
  // AR(x) = 2(tp−1)/tp·T·x·esize, RS = AG = (tp−1)/tp·T·x·esize.
  const double ar_l = 2 * (tp - 1) / tp * t * l * esize, ar_d = 2 * (tp - 1) / tp * t * d * esize;
  const double rs_l = (tp - 1) / tp * t * l * esize, rs_d = (tp - 1) / tp * t * d * esize;
  EXPECT_DOUBLE_EQ(lmoe::tier_bus_bytes(TailTier::overlap, 5, kK3, DType::bf16, 8), ar_l + ar_d);
  EXPECT_DOUBLE_EQ(lmoe::tier_bus_bytes(TailTier::column, 5, kK3, DType::bf16, 8), ar_l + ar_d);
  EXPECT_DOUBLE_EQ(lmoe::tier_bus_bytes(TailTier::token, 5, kK3, DType::bf16, 8), rs_l + 2 * rs_d);
  EXPECT_DOUBLE_EQ(lmoe::tier_bus_bytes(TailTier::fused, 5, kK3, DType::bf16, 8),
                   (tp - 1) * t * l * esize + 2 * rs_d);
  // The chained path's two-shot exchange: an all-reduce's bytes for the latent (tp / 2 times
  // fewer than one shot), the same stripes; the other tiers do not depend on it.
  EXPECT_DOUBLE_EQ(lmoe::tier_bus_bytes(TailTier::fused, 5, kK3, DType::bf16, 8, true),
                   ar_l + 2 * rs_d);
  EXPECT_DOUBLE_EQ(lmoe::tier_bus_bytes(TailTier::column, 5, kK3, DType::bf16, 8, true),
                   ar_l + ar_d);
  // At tp 2 one shot and two carry the same bytes.
  EXPECT_DOUBLE_EQ(lmoe::tier_bus_bytes(TailTier::fused, 5, kK3, DType::bf16, 2, true),
                   lmoe::tier_bus_bytes(TailTier::fused, 5, kK3, DType::bf16, 2));
  // DESIGN.md §2: at K3 dims token sends 2.5/3 of column's bytes.
  EXPECT_DOUBLE_EQ(lmoe::tier_bus_bytes(TailTier::token, 5, kK3, DType::bf16, 8) /
                       lmoe::tier_bus_bytes(TailTier::column, 5, kK3, DType::bf16, 8),
                   2.5 / 3.0);
  // One rank sends nothing.
  for (TailTier tier : lmoe::kAllTiers)
    EXPECT_EQ(lmoe::tier_bus_bytes(tier, 64, kK3, DType::bf16, 1), 0.0);
  // Concrete: overlap at T = 1, tp = 2, small dims: 2·½·(192 + 384)·2 bytes.
  EXPECT_DOUBLE_EQ(lmoe::tier_bus_bytes(TailTier::overlap, 1, kSmall, DType::bf16, 2), 1152.0);
}

// ---- inputs ------------------------------------------------------------------------------------

TEST(BenchValues, ExactInEveryDtypeAndFreshPerStream) {
  std::set<float> seen;
  double sum = 0;
  constexpr int kCount = 4096;
  for (int i = 0; i < kCount; ++i) {
    const float v = lmoe::bench::value(11, static_cast<std::uint64_t>(i));
    ASSERT_GE(v, -2.0f);
    ASSERT_LT(v, 2.0f);
    ASSERT_EQ(v * 64.0f, std::round(v * 64.0f)) << "not a multiple of 1/64: " << v;
    for (DType dtype : {DType::bf16, DType::f16, DType::f32})
      ASSERT_EQ(lmoe::round_to(dtype, v), v);
    seen.insert(v);
    sum += v;
  }
  EXPECT_GT(seen.size(), 200u);             // most of the 256 values occur
  EXPECT_LT(std::fabs(sum / kCount), 0.1);  // centred near 0
  // Different (T, rank, tensor) give different streams; the same gives the same (a T's tiers
  // share their inputs).
  const std::uint64_t a = lmoe::bench::input_seed(1, 64, 0, 0);
  EXPECT_EQ(a, lmoe::bench::input_seed(1, 64, 0, 0));
  std::set<std::uint64_t> seeds = {
      a, lmoe::bench::input_seed(1, 65, 0, 0), lmoe::bench::input_seed(1, 64, 1, 0),
      lmoe::bench::input_seed(1, 64, 0, 1), lmoe::bench::input_seed(2, 64, 0, 0)};
  EXPECT_EQ(seeds.size(), 5u);

  std::vector<std::uint16_t> bf16(8);
  lmoe::fill_bench_values(bf16.data(), bf16.size(), DType::bf16, a);
  for (std::size_t i = 0; i < bf16.size(); ++i) {
    EXPECT_EQ(lmoe::bf16_bits_to_float(bf16[i]), lmoe::bench::value(a, i));
  }
}

// ---- the sweep on the cpu backend --------------------------------------------------------------

lmoe::BenchOptions small_options(int tp, std::vector<std::int64_t> tokens) {
  lmoe::BenchOptions options;
  options.backend = lmoe::Backend::cpu;
  options.dims = kSmall;
  options.tp = tp;
  options.tokens = std::move(tokens);
  options.warmup = 1;
  options.iters = 3;
  return options;
}

const lmoe::BenchRecord& find(const lmoe::BenchResult& result, std::int64_t tokens, TailTier tier) {
  for (const lmoe::BenchRecord& record : result.records) {
    if (record.tokens == tokens && record.tier == tier) return record;
  }
  throw std::runtime_error("no record");
}

TEST(TailBench, CpuSweepTimesAndChecksEveryTier) {
  lmoe::BenchOptions options = small_options(2, {1, 3, 130});
  options.check_max_tokens = 3;
  std::vector<std::int64_t> progress_tokens;
  const lmoe::BenchResult result = lmoe::run_tail_bench(
      options, [&](const lmoe::BenchProgress& p) { progress_tokens.push_back(p.tokens); });
  ASSERT_TRUE(result.comm_errors.empty());
  ASSERT_EQ(result.records.size(), 3u * 4u);
  EXPECT_TRUE(result.ok());
  EXPECT_FALSE(progress_tokens.empty());

  const lmoe::BenchRecord& token_at_1 = find(result, 1, TailTier::token);
  ASSERT_TRUE(token_at_1.declined.has_value());
  EXPECT_THAT(*token_at_1.declined, HasSubstr("T=1 < tp=2"));
  EXPECT_TRUE(token_at_1.seconds.empty());

  for (const lmoe::BenchRecord& record : result.records) {
    SCOPED_TRACE("T=" + std::to_string(record.tokens) + " " +
                 std::string(lmoe::tier_name(record.tier)));
    EXPECT_EQ(record.comm, "threads");
    if (record.declined) continue;
    EXPECT_EQ(record.mode, lmoe::BenchMode::eager);
    ASSERT_EQ(record.seconds.size(), 3u);
    EXPECT_GT(record.stats.median, 0);
    EXPECT_LE(record.stats.p10, record.stats.median);
    EXPECT_LE(record.stats.median, record.stats.p90);
    EXPECT_DOUBLE_EQ(record.algbw_gbps, record.bytes / record.stats.median * 1e-9);
    EXPECT_DOUBLE_EQ(record.busbw_gbps, record.bus_bytes / record.stats.median * 1e-9);
    if (record.tokens <= 3) {
      EXPECT_TRUE(record.checked);
      EXPECT_EQ(record.wrong(), 0);
      EXPECT_EQ(record.comparison.elements, record.tokens * kSmall.d_model);
      EXPECT_TRUE(record.ranks_identical);
    } else {
      EXPECT_FALSE(record.checked);
      EXPECT_EQ(record.wrong(), -1);
    }
  }
  // The policy's pick at each T: fused up to 128, overlap up to 256.
  for (std::int64_t t : {1, 3, 130}) {
    int chosen = 0;
    for (TailTier tier : lmoe::kAllTiers) chosen += find(result, t, tier).chosen ? 1 : 0;
    EXPECT_EQ(chosen, 1) << "T=" << t;
  }
  EXPECT_TRUE(find(result, 3, TailTier::fused).chosen);
  EXPECT_TRUE(find(result, 130, TailTier::overlap).chosen);
}

TEST(TailBench, LayersRunTailsOfTheirOwnAndEveryOneIsChecked) {
  lmoe::BenchOptions options = small_options(2, {1, 4});
  options.layers = 3;
  const lmoe::BenchResult result = lmoe::run_tail_bench(options);
  ASSERT_TRUE(result.comm_errors.empty());
  ASSERT_EQ(result.records.size(), 2u * 4u);
  EXPECT_TRUE(result.ok());
  for (const lmoe::BenchRecord& record : result.records) {
    SCOPED_TRACE("T=" + std::to_string(record.tokens) + " " +
                 std::string(lmoe::tier_name(record.tier)));
    if (record.declined) continue;  // token at T = 1 < tp
    ASSERT_EQ(record.seconds.size(), 3u);
    EXPECT_TRUE(record.checked);
    EXPECT_EQ(record.wrong(), 0);
    EXPECT_TRUE(record.ranks_identical);
  }
  // The layers' outputs are compared before the check: a layer that differs is the one checked.
  options.tiers = {TailTier::column};
  options.inject_fault = true;
  EXPECT_FALSE(lmoe::run_tail_bench(options).ok());
}

TEST(BenchLayers, TheCheckSeesTheFirstLayerWhoseOutputDiffers) {
  const auto output = [](float value) {
    lmoe::HostTensor t(DType::f32, {1, 2});
    t.set(0, value);
    t.set(1, 1.0f);
    return t;
  };
  const auto first_of = [&](std::vector<float> values) {
    std::vector<lmoe::HostTensor> outputs;
    for (float v : values) outputs.push_back(output(v));
    return lmoe::first_differing_output(std::move(outputs)).get(0);
  };
  EXPECT_EQ(first_of({2, 2, 2}), 2);
  EXPECT_EQ(first_of({2, 2, 5, 7}), 5);
  EXPECT_EQ(first_of({4}), 4);
  // -0 and +0 compare equal as floats but not as bits: the bits decide.
  EXPECT_EQ(std::signbit(first_of({0.0f, -0.0f})), true);
  EXPECT_THROW(lmoe::first_differing_output({}), lmoe::Error);
}

TEST(TailBench, AWrongElementIsCaught) {
  lmoe::BenchOptions options = small_options(2, {4});
  options.tiers = {TailTier::column, TailTier::token};
  options.inject_fault = true;
  const lmoe::BenchResult result = lmoe::run_tail_bench(options);
  ASSERT_EQ(result.records.size(), 2u);
  for (const lmoe::BenchRecord& record : result.records) {
    EXPECT_TRUE(record.checked);
    EXPECT_GE(record.wrong(), 1);
    EXPECT_FALSE(record.ok());
  }
  EXPECT_FALSE(result.ok());
}

TEST(TailBench, NoCheckLeavesEveryRecordUnchecked) {
  lmoe::BenchOptions options = small_options(3, {5});
  options.check_max_tokens = 0;
  options.inject_fault = true;  // nothing is compared, so nothing can be found wrong
  const lmoe::BenchResult result = lmoe::run_tail_bench(options);
  ASSERT_EQ(result.records.size(), 4u);
  for (const lmoe::BenchRecord& record : result.records) EXPECT_FALSE(record.checked);
  EXPECT_TRUE(result.ok());
}

TEST(TailBench, BadOptionsNameTheOption) {
  const auto message_of = [](const lmoe::BenchOptions& options) {
    try {
      lmoe::validate_bench_options(options);
    } catch (const lmoe::Error& error) {
      return error.message();
    }
    return std::string("no error");
  };
  lmoe::BenchOptions options = small_options(0, {1});
  EXPECT_THAT(message_of(options), HasSubstr("tp: expected at least 1 rank, got 0"));
  options = small_options(2, {1, 0});
  EXPECT_THAT(message_of(options), HasSubstr("tokens: expected token counts >= 1, got 0"));
  options = small_options(2, {});
  EXPECT_THAT(message_of(options), HasSubstr("tokens: expected at least one"));
  options = small_options(2, {1});
  options.comms = {"carrier-pigeon"};
  EXPECT_THAT(message_of(options), HasSubstr("comm backend 'carrier-pigeon'"));
  EXPECT_THAT(message_of(options), HasSubstr("available here: threads"));
  options = small_options(2, {1});
  options.iters = 0;
  EXPECT_THAT(message_of(options), HasSubstr("iters: expected >= 1"));
  for (int layers : {0, lmoe::kMaxBenchLayers + 1}) {
    options = small_options(2, {1});
    options.layers = layers;
    EXPECT_EQ(message_of(options),
              "bench: layers: expected 1 to 64 tails a timed "
              "iteration, got " +
                  std::to_string(layers));
  }
  options.layers = lmoe::kMaxBenchLayers;
  EXPECT_EQ(message_of(options), "no error");
  options = small_options(2, {1});
  options.cold_l2 = true;
  EXPECT_THAT(message_of(options),
              HasSubstr("bench: cold_l2 (--cold-l2) needs the cuda backend: the cpu backend has "
                        "no device L2 to evict"));
  EXPECT_THROW(lmoe::run_tail_bench(options), lmoe::Error);
  options.cold_l2 = false;
  EXPECT_EQ(message_of(options), "no error");
  options.mode = lmoe::BenchMode::graph;
  EXPECT_THAT(message_of(options), HasSubstr("graph needs the cuda backend"));
  options.mode = lmoe::BenchMode::device_tokens;
  EXPECT_THAT(message_of(options), HasSubstr("device-tokens needs the cuda backend"));
  EXPECT_THROW(lmoe::run_tail_bench(options), lmoe::Error);
}

TEST(TailBench, TiersThatCannotSplitTheHiddenSizeAreDeclined) {
  // d_model 384 is not divisible by tp = 5: fused and column decline with their reason, the others
  // run, and nothing fails.
  lmoe::BenchOptions options = small_options(5, {5});
  const lmoe::BenchResult result = lmoe::run_tail_bench(options);
  EXPECT_TRUE(result.comm_errors.empty());
  EXPECT_TRUE(find(result, 5, TailTier::fused).declined.has_value());
  EXPECT_TRUE(find(result, 5, TailTier::column).declined.has_value());
  EXPECT_FALSE(find(result, 5, TailTier::token).declined.has_value());
  EXPECT_TRUE(result.ok());
}

// A BenchRank that records the calls it gets and times iteration i of each call as i + 1.
class RecordingBenchRank : public lmoe::BenchRank {
 public:
  std::vector<std::string> calls;
  void load_inputs(std::int64_t, std::uint64_t, std::uint64_t) override { calls.push_back("load"); }
  void prepare(TailTier tier, lmoe::BenchMode) override {
    calls.push_back("prepare " + std::string(lmoe::tier_name(tier)));
  }
  void warm_up(int count) override { calls.push_back("warm " + std::to_string(count)); }
  std::vector<double> time(int count) override {
    calls.push_back("time " + std::to_string(count));
    std::vector<double> seconds;
    for (int i = 0; i < count; ++i) seconds.push_back(i + 1);
    return seconds;
  }
  lmoe::HostTensor checked_output() override { return {}; }
};

TEST(BenchTurns, EachTierIsTimedInEveryPositionAfterAnUntimedForward) {
  RecordingBenchRank rank;
  const std::vector<TailTier> tiers = {TailTier::overlap, TailTier::column, TailTier::token};
  const auto seconds = lmoe::time_tiers_in_turns(rank, tiers, lmoe::BenchMode::graph, 12);
  ASSERT_EQ(seconds.size(), 3u);
  for (const auto& each : seconds) EXPECT_EQ(each.size(), 12u);  // every iteration, once
  // 5 turns of 2, 2, 3, 2, 3 iterations; turn t starts with tier t mod 3.
  std::vector<std::string> expected;
  const int counts[] = {2, 2, 3, 2, 3};
  for (int turn = 0; turn < 5; ++turn) {
    for (int i = 0; i < 3; ++i) {
      const TailTier tier = tiers[static_cast<std::size_t>((i + turn) % 3)];
      expected.push_back("prepare " + std::string(lmoe::tier_name(tier)));
      expected.push_back("warm 1");
      expected.push_back("time " + std::to_string(counts[turn]));
    }
  }
  EXPECT_EQ(rank.calls, expected);
  EXPECT_EQ(seconds[0], (std::vector<double>{1, 2, 1, 2, 1, 2, 3, 1, 2, 1, 2, 3}));
}

TEST(BenchTurns, FewerIterationsThanTurnsTimeOneEach) {
  RecordingBenchRank rank;
  const std::vector<TailTier> tiers = {TailTier::fused, TailTier::overlap};
  const auto seconds = lmoe::time_tiers_in_turns(rank, tiers, lmoe::BenchMode::eager, 2);
  EXPECT_EQ(seconds[0].size(), 2u);
  EXPECT_EQ(seconds[1].size(), 2u);
  EXPECT_EQ(std::count(rank.calls.begin(), rank.calls.end(), "time 1"), 4);
}

TEST(BenchMode, NamesRoundTrip) {
  EXPECT_EQ(lmoe::parse_bench_mode("graph"), lmoe::BenchMode::graph);
  EXPECT_EQ(lmoe::parse_bench_mode("eager"), lmoe::BenchMode::eager);
  EXPECT_EQ(lmoe::bench_mode_name(lmoe::BenchMode::graph), "graph");
  EXPECT_EQ(lmoe::parse_bench_mode("device-tokens"), lmoe::BenchMode::device_tokens);
  EXPECT_EQ(lmoe::bench_mode_name(lmoe::BenchMode::device_tokens), "device-tokens");
  EXPECT_THROW(lmoe::parse_bench_mode("lazy"), lmoe::Error);
}

TEST(BenchTokens, CudaDefaultsCoverDecodeToPrefillWithMidpoints) {
  const std::vector<std::int64_t> tokens = lmoe::default_bench_tokens(lmoe::Backend::cuda);
  EXPECT_EQ(tokens.front(), 1);
  EXPECT_EQ(tokens.back(), 32768);
  for (std::int64_t t : {96, 128, 192, 256, 384, 3072}) {
    EXPECT_NE(std::find(tokens.begin(), tokens.end(), t), tokens.end()) << t;
  }
  EXPECT_TRUE(std::is_sorted(tokens.begin(), tokens.end()));
}

}  // namespace

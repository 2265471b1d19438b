// Tier selection by measurement: ranges found on the grid measured on two H200s (an order the
// breakpoints cannot express) and on random grids, breakpoints found on synthetic grids (clean
// crossovers, noise, non-monotonic winners, declined tiers, one tier everywhere, checked against a
// brute-force search on random grids), tier tables (version 3, and version 2 still read) written,
// read and matched against a configuration, their precedence against the environment (breakpoint
// variables set the ranges aside), explain() citing them, the check of a policy against a sweep,
// and `tune` on the CPU backend at small dims.
#include "lmoe/tools/tier_tuning.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "lmoe/error.hpp"
#include "lmoe/reference.hpp"
#include "lmoe/threads_communicator.hpp"
#include "lmoe/version.hpp"
#include "tier_table_files.hpp"

namespace {

using lmoe_test::running_like;

using lmoe::BreakpointFit;
using lmoe::Breakpoints;
using lmoe::GridPoint;
using lmoe::PolicyConfig;
using lmoe::TailTier;
using lmoe::TierRange;
using lmoe::TierTiming;
using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr std::int64_t kNoLimit = lmoe::kNoTokenLimit;

// A grid point with every tier's median given (< 0: declined); p10/p90 at ±5 %.
GridPoint point(std::int64_t tokens, std::array<double, 4> medians) {
  GridPoint p;
  p.tokens = tokens;
  for (TailTier tier : lmoe::kAllTiers) {
    const double m = medians[static_cast<std::size_t>(tier)];
    p[tier] = m < 0 ? TierTiming::declined_because("declined in the test")
                    : TierTiming::measured(m, 0.95 * m, 1.05 * m);
  }
  return p;
}

// `n` points, T rising by 1 to `max_step`, each tier's median in [1, 100) or (1 in 6) declined.
std::vector<GridPoint> random_grid(std::mt19937_64& rng, std::size_t n, std::int64_t max_step) {
  std::uniform_real_distribution<double> time(1.0, 100.0);
  std::uniform_int_distribution<int> coin(0, 5);
  std::vector<GridPoint> grid;
  std::int64_t t = 0;
  for (std::size_t i = 0; i < n; ++i) {
    t += 1 + static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(max_step));
    std::array<double, 4> medians{};
    for (double& m : medians) m = coin(rng) == 0 ? -1 : time(rng);
    grid.push_back(point(t, medians));
  }
  return grid;
}

// Affine time models a + b·T per tier: the medians on a grid.
struct Model {
  double fixed, per_token;
};
std::vector<GridPoint> grid_of(const std::vector<std::int64_t>& tokens,
                               const std::array<Model, 4>& models) {
  std::vector<GridPoint> grid;
  for (std::int64_t t : tokens) {
    std::array<double, 4> medians{};
    for (std::size_t i = 0; i < 4; ++i) {
      medians[i] = models[i].fixed + models[i].per_token * static_cast<double>(t);
    }
    grid.push_back(point(t, medians));
  }
  return grid;
}

std::vector<std::int64_t> powers_of_two(std::int64_t last) {
  std::vector<std::int64_t> tokens;
  for (std::int64_t t = 1; t <= last; t *= 2) tokens.push_back(t);
  return tokens;
}

std::vector<std::optional<TailTier>> chosen_tiers(const lmoe::PolicyFit& fit) {
  std::vector<std::optional<TailTier>> tiers;
  for (const lmoe::PointFit& p : fit.points) tiers.push_back(p.chosen);
  return tiers;
}

std::string find_error(const std::vector<GridPoint>& grid) {
  try {
    lmoe::find_breakpoints(grid);
  } catch (const lmoe::Error& error) {
    return error.message();
  }
  ADD_FAILURE() << "find_breakpoints accepted the grid";
  return "<no error>";
}

// ---- ranges -------------------------------------------------------------------------------------

// `lmoe tune` on two H200s, K3 dims, tp 2, NCCL (2026-11-29), median us: fused declined at every T
// (over NCCL at tp 2), token at T=1 (T < tp). The fastest tiers in T order are column, column,
// overlap, overlap, token, token, token. The medians at T >= 4096 were not quoted with the run,
// only that token was the fastest there: these two points stand for that.
std::vector<GridPoint> h200_tp2_grid() {
  return {point(1, {-1, 34.6, 30.2, -1}),
          point(16, {-1, 39.1, 31.4, 48.6}),
          point(128, {-1, 58.4, 64.7, 69.9}),
          point(256, {-1, 85.4, 100.1, 100.7}),
          point(1024, {-1, 202.8, 220.8, 188.5}),
          point(4096, {-1, 760.0, 790.0, 650.0}),
          point(16384, {-1, 2900.0, 3000.0, 2500.0})};
}

const std::vector<TierRange> kH200Ranges = {
    {77, TailTier::column}, {652, TailTier::overlap}, {std::nullopt, TailTier::token}};

TEST(FindRanges, TheH200GridGivesColumnOverlapTokenAtZeroRegret) {
  const std::vector<GridPoint> grid = h200_tp2_grid();
  const lmoe::RangeFit fit = lmoe::find_ranges(grid);
  // Where the medians cross: 16 + 112·7.7/14.0 = 77.6 and 256 + 768·15.3/29.6 = 653.0 (floored; the
  // geometric means would be 45 and 512).
  EXPECT_EQ(fit.ranges, kH200Ranges);
  EXPECT_EQ(lmoe::describe_tier_ranges(fit.ranges), "column T<=77, overlap T<=652, token above");
  ASSERT_EQ(fit.points.size(), grid.size());
  for (const lmoe::PointFit& p : fit.points) {
    EXPECT_EQ(p.chosen, p.fastest) << "T=" << p.tokens;
    EXPECT_EQ(p.regret, 0) << "T=" << p.tokens;
    EXPECT_FALSE(p.fallback) << "T=" << p.tokens;
  }
  EXPECT_EQ(fit.total_regret, 0);
  EXPECT_EQ(fit.max_regret, 0);
  // ±1 around each boundary, through the policy itself.
  const PolicyConfig policy = lmoe::policy_from(fit.ranges, "table t.json");
  EXPECT_EQ(lmoe::preferred_tier(77, policy), TailTier::column);
  EXPECT_EQ(lmoe::preferred_tier(78, policy), TailTier::overlap);
  EXPECT_EQ(lmoe::preferred_tier(652, policy), TailTier::overlap);
  EXPECT_EQ(lmoe::preferred_tier(653, policy), TailTier::token);

  // The breakpoints cannot follow column → overlap → token: the best they do is column up to the
  // column/token crossing (256 + 768·0.6/32.9 = 270), 10.8 % slower than overlap at T=128.
  const BreakpointFit breakpoints = lmoe::find_breakpoints(grid);
  EXPECT_EQ(breakpoints.breakpoints, (Breakpoints{0, 0, 270}));
  EXPECT_NEAR(breakpoints.points[2].regret, 64.7 / 58.4 - 1, 1e-12);
  EXPECT_GT(breakpoints.total_regret, 0.25);
}

// What `lmoe bench --check-table` judges: with the table's ranges loaded, every choice on the
// H200 grid is the fastest; with its breakpoints, T=128 and T=256 fail the 3 % rule.
TEST(FindRanges, TheCheckOfATableJudgesItsRanges) {
  const std::vector<GridPoint> grid = h200_tp2_grid();
  const auto records_chosen_by = [&](const PolicyConfig& policy) {
    std::vector<lmoe::BenchRecord> records;
    for (const GridPoint& p : grid) {
      const auto chosen = lmoe::decide(p.tokens, policy, lmoe::grid_support(p)).tier;
      for (TailTier tier : lmoe::kAllTiers) {
        lmoe::BenchRecord r;
        r.comm = "nccl";
        r.tokens = p.tokens;
        r.tier = tier;
        r.chosen = chosen == tier;
        if (p[tier].ran()) {
          r.stats.median = p[tier].median_us * 1e-6;
          r.stats.p10 = p[tier].p10_us * 1e-6;
          r.stats.p90 = p[tier].p90_us * 1e-6;
        } else {
          r.declined = p[tier].reason;
        }
        records.push_back(r);
      }
    }
    return lmoe::check_choices(records);
  };
  for (const lmoe::ChoiceCheck& check :
       records_chosen_by(lmoe::policy_from(lmoe::find_ranges(grid).ranges, "t.json"))) {
    EXPECT_EQ(check.verdict, lmoe::ChoiceCheck::Verdict::fastest) << "T=" << check.tokens;
  }
  std::vector<std::int64_t> failed;
  for (const lmoe::ChoiceCheck& check :
       records_chosen_by(lmoe::policy_from(lmoe::find_breakpoints(grid).breakpoints, "t.json"))) {
    if (!check.ok()) failed.push_back(check.tokens);
  }
  EXPECT_EQ(failed, (std::vector<std::int64_t>{128, 256}));
}

TEST(FindRanges, BoundariesAreWhereTheTiersCrossElseTheFlooredGeometricMean) {
  EXPECT_EQ(lmoe::range_boundary(16, 128), 45);  // sqrt(2048) = 45.25
  EXPECT_EQ(lmoe::range_boundary(256, 1024), 512);
  EXPECT_EQ(lmoe::range_boundary(2, 8), 4);  // exact square
  EXPECT_EQ(lmoe::range_boundary(3, 12), 6);
  EXPECT_EQ(lmoe::range_boundary(1, 2), 1);
  EXPECT_EQ(lmoe::range_boundary(7, 8), 7);
  EXPECT_EQ(lmoe::range_boundary(1, 4), 2);
  EXPECT_EQ(lmoe::range_boundary(1, 3), 1);  // sqrt(3) = 1.73
  // Exact where a·b does not fit in 64 bits.
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  EXPECT_EQ(lmoe::range_boundary(kMax - 1, kMax), kMax - 1);
  EXPECT_EQ(lmoe::range_boundary(std::int64_t{1} << 40, std::int64_t{1} << 42),
            std::int64_t{1} << 41);
  EXPECT_EQ(lmoe::range_boundary(std::int64_t{3037000499}, std::int64_t{3037000501}),
            3037000499);  // 3037000500² > 3037000499·3037000501 = 3037000500² − 1
  for (const auto& [a, b] :
       std::vector<std::pair<std::int64_t, std::int64_t>>{{0, 1}, {5, 5}, {6, 5}}) {
    try {
      lmoe::range_boundary(a, b);
      ADD_FAILURE() << "no error for a=" << a << ", b=" << b;
    } catch (const lmoe::Error& error) {
      EXPECT_EQ(error.message(), "range_boundary: expected 1 <= a < b, got a=" + std::to_string(a) +
                                     ", b=" + std::to_string(b));
    }
  }
  // In a fit: T <= boundary takes the lower point's tier. Both tiers timed at both points: where
  // their medians cross, interpolated linearly in T (16 + 112·10/20 = 72; 16 + 112·10/(10 + 30) =
  // 44).
  EXPECT_EQ(lmoe::find_ranges(
                std::vector<GridPoint>{point(16, {10, 20, 20, 20}), point(128, {20, 10, 20, 20})})
                .ranges,
            (std::vector<TierRange>{{72, TailTier::fused}, {std::nullopt, TailTier::overlap}}));
  EXPECT_EQ(lmoe::find_ranges(
                std::vector<GridPoint>{point(16, {10, 20, 20, 20}), point(128, {40, 10, 20, 20})})
                .ranges,
            (std::vector<TierRange>{{44, TailTier::fused}, {std::nullopt, TailTier::overlap}}));
  // One of them declined at an end: no crossing to read, the geometric mean (45).
  EXPECT_EQ(lmoe::find_ranges(
                std::vector<GridPoint>{point(16, {10, 20, 20, 20}), point(128, {-1, 10, 20, 20})})
                .ranges,
            (std::vector<TierRange>{{45, TailTier::fused}, {std::nullopt, TailTier::overlap}}));
  // The same boundaries as the breakpoints between the same points.
  EXPECT_EQ(lmoe::find_breakpoints(
                std::vector<GridPoint>{point(16, {10, 20, 20, 20}), point(128, {20, 10, 20, 20})})
                .breakpoints.fused_max_tokens,
            72);
}

TEST(FindRanges, EqualNeighboursMergeAndOneTierIsOnePiece) {
  const auto grid =
      grid_of(powers_of_two(4096), {Model{50, 1}, Model{50, 1}, Model{10, 0.1}, Model{60, 1}});
  EXPECT_EQ(lmoe::find_ranges(grid).ranges,
            (std::vector<TierRange>{{std::nullopt, TailTier::column}}));
  // A tier that comes back after another gets a piece of its own each time.
  const std::vector<GridPoint> back_and_forth = {
      point(1, {10, 20, 20, 20}), point(4, {20, 10, 20, 20}), point(16, {10, 20, 20, 20})};
  EXPECT_EQ(lmoe::find_ranges(back_and_forth).ranges,
            (std::vector<TierRange>{
                {2, TailTier::fused}, {10, TailTier::overlap}, {std::nullopt, TailTier::fused}}));
}

TEST(FindRanges, PointsWhereNothingRunsJoinAPieceAndSplitNone) {
  const std::vector<GridPoint> grid = {point(1, {-1, -1, -1, -1}), point(2, {-1, -1, 5, -1}),
                                       point(4, {-1, -1, -1, -1}), point(8, {-1, -1, 9, 3}),
                                       point(16, {-1, -1, -1, -1})};
  const lmoe::RangeFit fit = lmoe::find_ranges(grid);
  // column at 1 (the first point that runs), 2 and 4; token at 8 and 16; floor(sqrt(32)) = 5.
  EXPECT_EQ(fit.ranges,
            (std::vector<TierRange>{{5, TailTier::column}, {std::nullopt, TailTier::token}}));
  EXPECT_EQ(fit.points[0].chosen, std::nullopt);
  EXPECT_EQ(fit.points[0].regret, 0);
  EXPECT_EQ(fit.total_regret, 0);
  // Nothing runs anywhere: one piece, fused.
  EXPECT_EQ(lmoe::find_ranges(std::vector<GridPoint>{point(1, {-1, -1, -1, -1})}).ranges,
            (std::vector<TierRange>{{std::nullopt, TailTier::fused}}));
}

TEST(FindRanges, BadGridsAreErrors) {
  try {
    lmoe::find_ranges(std::vector<GridPoint>{point(4, {1, 1, 1, 1}), point(2, {1, 1, 1, 1})});
    FAIL() << "no error";
  } catch (const lmoe::Error& error) {
    EXPECT_EQ(error.message(), "find_ranges: grid T must rise strictly, got 4 then 2");
  }
  EXPECT_THROW(lmoe::find_ranges(std::vector<GridPoint>{}), lmoe::Error);
}

// On random grids with random declines and winners: the fastest tier at every point, boundaries
// between differing neighbours only (a <= boundary < b), and never more regret than the
// breakpoints.
TEST(FindRanges, ZeroRegretAndNeverWorseThanTheBreakpointsOnRandomGrids) {
  std::mt19937_64 rng(2027);
  for (int trial = 0; trial < 300; ++trial) {
    const std::vector<GridPoint> grid =
        random_grid(rng, 1 + static_cast<std::size_t>(trial % 9), 300);
    const lmoe::RangeFit fit = lmoe::find_ranges(grid);
    ASSERT_NO_THROW(lmoe::validate_tier_ranges(fit.ranges, "fit")) << "trial " << trial;
    for (const lmoe::PointFit& p : fit.points) {
      ASSERT_EQ(p.chosen, p.fastest) << "trial " << trial << " T=" << p.tokens;
    }
    ASSERT_EQ(fit.total_regret, 0) << "trial " << trial;
    ASSERT_LE(fit.total_regret, lmoe::find_breakpoints(grid).total_regret) << "trial " << trial;
    // Each boundary lies between two neighbours that run different tiers.
    for (std::size_t r = 0; r + 1 < fit.ranges.size(); ++r) {
      const std::int64_t boundary = *fit.ranges[r].max_tokens;
      const auto above = std::find_if(grid.begin(), grid.end(),
                                      [&](const GridPoint& p) { return p.tokens > boundary; });
      ASSERT_NE(above, grid.begin()) << "trial " << trial;
      ASSERT_NE(above, grid.end()) << "trial " << trial;
      // Where the two tiers' medians cross, interpolated linearly in T, when both ran at both
      // points and each leads at its own end; else the floored geometric mean.
      const GridPoint &lo = *(above - 1), &hi = *above;
      const TailTier below_tier = fit.ranges[r].tier, above_tier = fit.ranges[r + 1].tier;
      std::int64_t expected = lmoe::range_boundary(lo.tokens, hi.tokens);
      if (lo[below_tier].ran() && lo[above_tier].ran() && hi[below_tier].ran() &&
          hi[above_tier].ran()) {
        const double lead_lo = lo[above_tier].median_us - lo[below_tier].median_us;
        const double lead_hi = hi[below_tier].median_us - hi[above_tier].median_us;
        if (lead_lo >= 0 && lead_hi >= 0 && lead_lo + lead_hi > 0) {
          const double at =
              static_cast<double>(lo.tokens) +
              static_cast<double>(hi.tokens - lo.tokens) * lead_lo / (lead_lo + lead_hi);
          expected =
              std::clamp(static_cast<std::int64_t>(std::floor(at)), lo.tokens, hi.tokens - 1);
        }
      }
      ASSERT_EQ(boundary, expected) << "trial " << trial;
      ASSERT_NE(fit.ranges[r].tier, fit.ranges[r + 1].tier) << "trial " << trial;
    }
    // The fit's account agrees with the policy it describes.
    const lmoe::PolicyFit again =
        lmoe::evaluate_policy(grid, lmoe::policy_from(fit.ranges, "again"));
    ASSERT_EQ(chosen_tiers(again), chosen_tiers(fit)) << "trial " << trial;
  }
}

// ---- breakpoints on synthetic grids -------------------------------------------------------------

TEST(FindBreakpoints, CleanCrossoversLandWhereTheLinesCross) {
  // fused 10 + T, overlap 20 + T/2 (crosses fused at T = 20), column 60 + T/4 (crosses overlap at
  // T = 160), token 188 + T/8 (crosses column at T = 1024).
  const auto grid = grid_of(powers_of_two(8192),
                            {Model{10, 1}, Model{20, 0.5}, Model{60, 0.25}, Model{188, 0.125}});
  const BreakpointFit fit = lmoe::find_breakpoints(grid);
  EXPECT_EQ(fit.breakpoints.fused_max_tokens, 20);
  EXPECT_EQ(fit.breakpoints.overlap_max_tokens, 160);
  // 1024 is a grid point where column and token tie: column, the earlier tier, counts as the
  // fastest there, and the crossing between 1024 and 2048 interpolates to 1024 itself.
  EXPECT_EQ(fit.breakpoints.column_max_tokens, std::optional<std::int64_t>(1024));
  EXPECT_EQ(fit.total_regret, 0);
  for (const lmoe::PointFit& p : fit.points) {
    EXPECT_EQ(p.chosen, p.fastest) << "T=" << p.tokens;
    EXPECT_FALSE(p.fallback);
  }
  // ±1 around each breakpoint, through the policy itself.
  const PolicyConfig policy = lmoe::policy_from(fit.breakpoints, "t.json");
  EXPECT_EQ(lmoe::preferred_tier(20, policy), TailTier::fused);
  EXPECT_EQ(lmoe::preferred_tier(21, policy), TailTier::overlap);
  EXPECT_EQ(lmoe::preferred_tier(160, policy), TailTier::overlap);
  EXPECT_EQ(lmoe::preferred_tier(161, policy), TailTier::column);
  EXPECT_EQ(lmoe::preferred_tier(1024, policy), TailTier::column);
  EXPECT_EQ(lmoe::preferred_tier(1025, policy), TailTier::token);
}

TEST(FindBreakpoints, WithoutAUsableCrossingTheBreakpointIsTheGeometricMean) {
  // At 16, fused (10) beats column (40); at 64, column (20) beats fused (100): the lines cross at
  // 16 + 48·30/(30 + 80).
  std::vector<GridPoint> grid = {point(16, {10, 50, 40, 50}), point(64, {100, 200, 20, 200})};
  BreakpointFit fit = lmoe::find_breakpoints(grid);
  EXPECT_EQ(fit.breakpoints.fused_max_tokens, 16 + 48 * 30 / 110);
  EXPECT_EQ(fit.breakpoints.overlap_max_tokens, 16 + 48 * 30 / 110);
  EXPECT_EQ(fit.breakpoints.column_max_tokens, std::nullopt);

  // Without column's time at 16 there is no crossing to interpolate: sqrt(16·64) = 32.
  grid[0][TailTier::column] = TierTiming{};
  fit = lmoe::find_breakpoints(grid);
  EXPECT_EQ(fit.breakpoints.fused_max_tokens, 32);
  EXPECT_EQ(fit.breakpoints.overlap_max_tokens, 32);
  // Neighbours: the breakpoint stays within [lower T, upper T − 1].
  fit = lmoe::find_breakpoints(
      std::vector<GridPoint>{point(7, {1, 9, 9, 9}), point(8, {9, 9, 1, 9})});
  EXPECT_EQ(fit.breakpoints.fused_max_tokens, 7);
}

TEST(FindBreakpoints, NoiseWithinTheSpreadDoesNotSplitARange) {
  // column and token within 1 % of each other from T = 64 on, alternating; token ahead by 10 %
  // from T = 4096. Switching to token once and staying there costs the least regret.
  std::vector<GridPoint> grid;
  const std::vector<std::int64_t> tokens = powers_of_two(32768);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    const double t = static_cast<double>(tokens[i]);
    const double column = 50 + t / 4;
    const double noise = (i % 2 == 0 ? 1.005 : 0.995);
    double token = tokens[i] < 64 ? column * 1.5 : column * noise;
    if (tokens[i] >= 4096) token = column * 0.9;
    grid.push_back(point(tokens[i], {-1, column * 3, column, token}));
  }
  const BreakpointFit fit = lmoe::find_breakpoints(grid);
  // Where the two alternate, either choice costs at most 0.5 % per point: one switch somewhere in
  // [64, 4096], and token from 4096 on.
  ASSERT_TRUE(fit.breakpoints.column_max_tokens);
  EXPECT_GE(*fit.breakpoints.column_max_tokens, 32);
  EXPECT_LT(*fit.breakpoints.column_max_tokens, 4096);
  EXPECT_LT(fit.total_regret, 0.005 * 7);
  for (const lmoe::PointFit& p : fit.points) {
    if (p.tokens >= 4096) {
      EXPECT_EQ(p.chosen, TailTier::token) << p.tokens;
    }
    if (p.tokens < 64) {
      EXPECT_EQ(p.chosen, TailTier::column) << p.tokens;
    }
    EXPECT_LE(p.regret, 0.0101) << p.tokens;
  }
}

TEST(FindBreakpoints, NonMonotonicWinnersGetTheLeastRegretTheOrderAllows) {
  // Winners by T: column, fused, column, fused. The policy's order (fused below column) cannot
  // give fused back after column, so one of the four points must lose.
  const std::vector<GridPoint> grid = {
      point(1, {110, 500, 100, -1}),   // column ahead by 10 %
      point(2, {100, 500, 150, 500}),  // fused ahead by 50 %
      point(4, {100, 500, 102, 500}),  // fused ahead by 2 %
      point(8, {100, 500, 101, 500}),  // fused ahead by 1 %
  };
  const BreakpointFit fit = lmoe::find_breakpoints(grid);
  // Column at T=1 and fused above would cost nothing, but fused cannot follow column. Fused
  // everywhere costs 10 % (at T=1), column everywhere 50 + 2 + 1 %: fused everywhere wins.
  EXPECT_EQ(fit.breakpoints.fused_max_tokens, kNoLimit);
  EXPECT_EQ(fit.breakpoints.overlap_max_tokens, kNoLimit);
  EXPECT_EQ(fit.breakpoints.column_max_tokens, std::nullopt);
  EXPECT_NEAR(fit.total_regret, 0.1, 1e-12);
  EXPECT_NEAR(fit.max_regret, 0.1, 1e-12);
  EXPECT_NEAR(fit.points[0].regret, 0.1, 1e-12);

  // Make column's lead at T=1 worth more: fused everywhere now costs 100 %, column everywhere
  // still 53 %, and column wins.
  std::vector<GridPoint> steep = grid;
  steep[0] = point(1, {200, 500, 100, -1});
  const BreakpointFit other = lmoe::find_breakpoints(steep);
  EXPECT_EQ(other.breakpoints.fused_max_tokens, 0);
  EXPECT_EQ(other.breakpoints.overlap_max_tokens, 0);
  EXPECT_EQ(other.breakpoints.column_max_tokens, std::nullopt);
  EXPECT_NEAR(other.total_regret, 0.5 + 0.02 + 0.01, 1e-12);
}

TEST(FindBreakpoints, DeclinedTiersAreNeverPreferredWhereTheyCannotRun) {
  // token is fastest wherever it runs, but it is declined at T = 1 and 2 (T < tp): there fused is
  // best. The policy gives fused up to between 2 and 4, then token.
  const std::vector<GridPoint> grid = {point(1, {10, 30, 20, -1}), point(2, {12, 30, 22, -1}),
                                       point(4, {40, 35, 30, 5}), point(8, {50, 40, 35, 6})};
  const BreakpointFit fit = lmoe::find_breakpoints(grid);
  EXPECT_EQ(chosen_tiers(fit),
            (std::vector<std::optional<TailTier>>{TailTier::fused, TailTier::fused, TailTier::token,
                                                  TailTier::token}));
  EXPECT_EQ(fit.breakpoints.fused_max_tokens,
            2);  // sqrt(2·4) = 2.83: no crossing (token declined at 2)
  EXPECT_EQ(fit.breakpoints.overlap_max_tokens, 2);
  EXPECT_EQ(fit.breakpoints.column_max_tokens, std::optional<std::int64_t>(2));
  EXPECT_EQ(fit.total_regret, 0);
}

TEST(FindBreakpoints, ATierDeclinedEverywhereGetsNoRangeOfItsOwn) {
  // fused declined at every T (d % tp != 0): preferring it would only ever fall back. Ties are
  // broken toward the fewest fallbacks, so fused's range is empty.
  const std::vector<GridPoint> grid = {point(1, {-1, 10, 20, -1}), point(8, {-1, 12, 22, 30}),
                                       point(64, {-1, 40, 30, 35})};
  const BreakpointFit fit = lmoe::find_breakpoints(grid);
  EXPECT_EQ(fit.breakpoints.fused_max_tokens, 0);
  EXPECT_GE(fit.breakpoints.overlap_max_tokens, 8);
  EXPECT_LT(fit.breakpoints.overlap_max_tokens, 64);
  EXPECT_EQ(fit.breakpoints.column_max_tokens, std::nullopt);
  for (const lmoe::PointFit& p : fit.points) EXPECT_FALSE(p.fallback) << p.tokens;
  EXPECT_EQ(fit.total_regret, 0);
}

TEST(FindBreakpoints, WhereTheBestTierIsDeclinedTheFallbackIsWhatCounts) {
  // At T=1 only column runs: whatever the breakpoints prefer there, column runs, at zero regret;
  // the fit prefers it outright rather than by a fallback.
  const std::vector<GridPoint> grid = {point(1, {-1, -1, 20, -1}), point(4, {-1, -1, 30, 10})};
  const BreakpointFit fit = lmoe::find_breakpoints(grid);
  EXPECT_EQ(chosen_tiers(fit),
            (std::vector<std::optional<TailTier>>{TailTier::column, TailTier::token}));
  EXPECT_EQ(fit.total_regret, 0);
  EXPECT_FALSE(fit.points[0].fallback);
}

TEST(FindBreakpoints, ASingleTierEverywhere) {
  const std::vector<std::int64_t> tokens = {1, 16, 256, 4096};
  const auto best = [&](TailTier winner) {
    std::vector<GridPoint> grid;
    for (std::int64_t t : tokens) {
      std::array<double, 4> medians = {50, 50, 50, 50};
      medians[static_cast<std::size_t>(winner)] = 10;
      if (t < 2) medians[3] = -1;  // token: T < tp
      grid.push_back(point(t, medians));
    }
    return lmoe::find_breakpoints(grid).breakpoints;
  };
  EXPECT_EQ(best(TailTier::fused), (Breakpoints{kNoLimit, kNoLimit, std::nullopt}));
  EXPECT_EQ(best(TailTier::overlap), (Breakpoints{0, kNoLimit, std::nullopt}));
  EXPECT_EQ(best(TailTier::column), (Breakpoints{0, 0, std::nullopt}));
  // token cannot run T=1, where the others tie at 50: fused (the earliest) takes it, and as token
  // has no time at T=1 the breakpoint is the geometric mean of 1 and 16.
  EXPECT_EQ(best(TailTier::token), (Breakpoints{4, 4, 4}));
  // A grid of one point, one tier.
  EXPECT_EQ(lmoe::find_breakpoints(std::vector<GridPoint>{point(64, {-1, -1, 5, -1})}).breakpoints,
            (Breakpoints{0, 0, std::nullopt}));
}

TEST(FindBreakpoints, APointWhereNothingRunsCountsForNothing) {
  const std::vector<GridPoint> grid = {point(1, {-1, -1, -1, -1}), point(2, {5, 10, 10, 10})};
  const BreakpointFit fit = lmoe::find_breakpoints(grid);
  EXPECT_EQ(fit.points[0].chosen, std::nullopt);
  EXPECT_EQ(fit.points[0].fastest, std::nullopt);
  EXPECT_EQ(fit.points[0].regret, 0);
  EXPECT_EQ(fit.points[1].chosen, TailTier::fused);
}

// Every assignment the policy can express, tried through decide() itself: the fit must reach the
// least total regret among them, on random grids with random declines and random winners.
TEST(FindBreakpoints, MatchesABruteForceSearchOnRandomGrids) {
  std::mt19937_64 rng(2026);
  for (int trial = 0; trial < 200; ++trial) {
    const std::vector<GridPoint> grid =
        random_grid(rng, 1 + static_cast<std::size_t>(trial % 7), 50);
    const BreakpointFit fit = lmoe::find_breakpoints(grid);

    std::vector<std::optional<std::int64_t>> limits = {0, std::nullopt};
    for (const GridPoint& p : grid) limits.push_back(p.tokens);
    double least = 1e300;
    for (const auto& f : limits) {
      for (const auto& o : limits) {
        for (const auto& c : limits) {
          const PolicyConfig policy = lmoe::policy_from(
              Breakpoints{f.value_or(kNoLimit), o.value_or(kNoLimit), c}, "brute");
          double total = 0;
          for (const GridPoint& p : grid) {
            const auto chosen = lmoe::decide(p.tokens, policy, lmoe::grid_support(p)).tier;
            const auto fastest = lmoe::fastest_tier(p);
            if (chosen && fastest) total += p[*chosen].median_us / p[*fastest].median_us - 1;
          }
          least = std::min(least, total);
        }
      }
    }
    ASSERT_NEAR(fit.total_regret, least, 1e-9) << "trial " << trial;
    // The fit's own account agrees with the policy it describes.
    const lmoe::PolicyFit again =
        lmoe::evaluate_policy(grid, lmoe::policy_from(fit.breakpoints, "again"));
    ASSERT_EQ(chosen_tiers(again), chosen_tiers(fit)) << "trial " << trial;
    ASSERT_NEAR(again.total_regret, fit.total_regret, 1e-12) << "trial " << trial;
  }
}

TEST(FindBreakpoints, BadGridsAreErrors) {
  EXPECT_EQ(find_error({}), "find_breakpoints: expected at least one grid point, got none");
  EXPECT_EQ(find_error({point(0, {1, 1, 1, 1})}), "find_breakpoints: grid T must be >= 1, got 0");
  EXPECT_EQ(find_error({point(4, {1, 1, 1, 1}), point(4, {1, 1, 1, 1})}),
            "find_breakpoints: grid T must rise strictly, got 4 then 4");
  EXPECT_EQ(find_error({point(8, {1, 1, 1, 1}), point(4, {1, 1, 1, 1})}),
            "find_breakpoints: grid T must rise strictly, got 8 then 4");
  GridPoint nan = point(2, {1, 1, 1, 1});
  nan[TailTier::column].median_us = std::nan("");
  EXPECT_THAT(find_error({nan}),
              StartsWith("find_breakpoints: T=2 column: expected a finite median"));
}

TEST(GridHelpers, FastestSupportAndNearest) {
  GridPoint p = point(64, {30, 20, 20, -1});
  EXPECT_EQ(lmoe::fastest_tier(p), TailTier::overlap);  // a tie goes to the earlier tier
  p[TailTier::fused] = TierTiming{};
  const lmoe::TierSupport support = lmoe::grid_support(p);
  EXPECT_EQ(support.declined[0], std::optional<std::string>("not measured"));
  EXPECT_TRUE(support.can_run(TailTier::overlap));
  EXPECT_EQ(support.declined[3], std::optional<std::string>("declined in the test"));
  EXPECT_EQ(lmoe::fastest_tier(point(1, {-1, -1, -1, -1})), std::nullopt);

  const std::vector<GridPoint> grid = {point(1, {1, 1, 1, 1}), point(16, {1, 1, 1, 1}),
                                       point(256, {1, 1, 1, 1})};
  EXPECT_EQ(lmoe::nearest_grid_point(grid, 300)->tokens, 256);
  EXPECT_EQ(lmoe::nearest_grid_point(grid, 3)->tokens, 1);  // log: 3 is nearer 1 than 16
  EXPECT_EQ(lmoe::nearest_grid_point(grid, 5)->tokens, 16);
  EXPECT_EQ(lmoe::nearest_grid_point(grid, 4)->tokens, 1);  // exactly between: the smaller T
  EXPECT_EQ(lmoe::nearest_grid_point(grid, 0)->tokens, 1);
  EXPECT_EQ(lmoe::nearest_grid_point(std::vector<GridPoint>{}, 4), nullptr);
}

lmoe::BenchRecord record(const std::string& comm, std::int64_t tokens, TailTier tier,
                         double median_us, double p90_us, bool chosen = false) {
  lmoe::BenchRecord r;
  r.comm = comm;
  r.tokens = tokens;
  r.tier = tier;
  r.chosen = chosen;
  if (median_us < 0) {
    r.declined = "declined in the test";
    return r;
  }
  r.stats.median = median_us * 1e-6;
  r.stats.p10 = median_us * 0.9e-6;
  r.stats.p90 = p90_us * 1e-6;
  return r;
}

TEST(GridHelpers, GridFromRecordsTakesOneCommSortedByT) {
  const std::vector<lmoe::BenchRecord> records = {
      record("nccl", 64, TailTier::fused, 1, 1), record("p2p", 64, TailTier::fused, 7, 8),
      record("p2p", 1, TailTier::token, -1, 0), record("p2p", 1, TailTier::fused, 3, 4)};
  const std::vector<GridPoint> grid = lmoe::grid_from_records(records, "p2p");
  ASSERT_EQ(grid.size(), 2u);
  EXPECT_EQ(grid[0].tokens, 1);
  EXPECT_DOUBLE_EQ(grid[0][TailTier::fused].median_us, 3);
  EXPECT_DOUBLE_EQ(grid[0][TailTier::fused].p90_us, 4);
  EXPECT_EQ(grid[0][TailTier::token].status, TierTiming::Status::declined);
  EXPECT_EQ(grid[0][TailTier::column].status, TierTiming::Status::not_measured);
  EXPECT_DOUBLE_EQ(grid[1][TailTier::fused].median_us, 7);
  try {
    lmoe::grid_from_records(records, "threads");
    FAIL() << "no error";
  } catch (const lmoe::Error& error) {
    EXPECT_EQ(error.message(), "grid_from_records: no records of comm 'threads'");
  }
}

// ---- tables -------------------------------------------------------------------------------------

lmoe::TierTable sample_table() {
  lmoe::TierTable table;
  lmoe::TableProvenance& p = table.provenance;
  p.lmoe_version = lmoe::kVersion;
  p.backend = lmoe::Backend::cuda;
  p.gpu = lmoe::TableGpu{"NVIDIA H200", "9.0", 13000, 13000};
  p.driver_version = "580.159.04";
  p.nccl_version = "2.28.3";
  p.tp = 8;
  p.dims = {7168, 3584};
  p.dtype = lmoe::DType::bf16;
  p.comm = "cuda-threads";
  p.date_utc = "2026-11-29T12:00:00Z";
  p.hostname = "gpu-host";
  p.preset = "kimi-k3";
  p.mode = "graph";
  p.warmup = 5;
  p.iters = 50;
  p.cold_l2 = true;  // not the default: round trips must keep it
  p.layers = 8;      // likewise
  p.settings = {{"LMOE_TOKEN_CHUNKS", "4"}};
  table.grid = {point(1, {20.5, 30.25, 40.125, -1}), point(256, {990, 950.5, 901, 812}),
                point(512, {1800, 1700, 1500, 1300})};
  table.grid[2][TailTier::overlap] = TierTiming{};  // not measured
  table.ranges = lmoe::find_ranges(table.grid).ranges;
  table.breakpoints = lmoe::find_breakpoints(table.grid).breakpoints;
  return table;
}

std::string read_error(const std::string& text) {
  try {
    lmoe::read_tier_table(text, "t.json");
  } catch (const lmoe::Error& error) {
    return error.message();
  }
  ADD_FAILURE() << "read_tier_table accepted " << text;
  return "<no error>";
}

std::string match_error(const lmoe::TableProvenance& table, const lmoe::RunningConfig& running) {
  try {
    lmoe::match_tier_table(table, running, "t.json");
  } catch (const lmoe::Error& error) {
    return error.message();
  }
  ADD_FAILURE() << "match_tier_table accepted the configuration";
  return "<no error>";
}

void expect_same_grid(const std::vector<GridPoint>& a, const std::vector<GridPoint>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].tokens, b[i].tokens);
    for (TailTier tier : lmoe::kAllTiers) {
      SCOPED_TRACE("T=" + std::to_string(a[i].tokens) + " " + std::string(lmoe::tier_name(tier)));
      EXPECT_EQ(a[i][tier].status, b[i][tier].status);
      EXPECT_EQ(a[i][tier].median_us, b[i][tier].median_us);
      EXPECT_EQ(a[i][tier].p10_us, b[i][tier].p10_us);
      EXPECT_EQ(a[i][tier].p90_us, b[i][tier].p90_us);
      EXPECT_EQ(a[i][tier].reason, b[i][tier].reason);
    }
  }
}

TEST(TierTableV3, RoundTrip) {
  lmoe::TierTable table = sample_table();
  for (auto& p : table.grid) {  // values a file holds exactly (to the nanosecond)
    for (auto& timing : p.tiers) {
      timing.median_us = std::round(timing.median_us * 1000) / 1000;
      timing.p10_us = std::round(timing.p10_us * 1000) / 1000;
      timing.p90_us = std::round(timing.p90_us * 1000) / 1000;
    }
  }
  const std::string text = lmoe::write_tier_table(table);
  EXPECT_THAT(text, StartsWith("{\n  \"format\": \"lmoe-tier-table\",\n  \"version\": 3,"));
  const lmoe::TierTable back = lmoe::read_tier_table(text, "t.json");
  EXPECT_EQ(back.provenance, table.provenance);
  EXPECT_EQ(back.ranges, table.ranges);
  EXPECT_EQ(back.breakpoints, table.breakpoints);
  expect_same_grid(back.grid, table.grid);
  EXPECT_EQ(lmoe::write_tier_table(back), text);

  // A table without GPU, driver or NCCL (the cpu backend), with no column limit, and with ranges
  // the breakpoints could not express.
  table.provenance.backend = lmoe::Backend::cpu;
  table.provenance.gpu.reset();
  table.provenance.driver_version.reset();
  table.provenance.nccl_version.reset();
  table.breakpoints = {3, 7, std::nullopt};
  table.ranges = {{2, TailTier::token}, {300, TailTier::fused}, {std::nullopt, TailTier::overlap}};
  const lmoe::TierTable cpu = lmoe::read_tier_table(lmoe::write_tier_table(table), "t.json");
  EXPECT_EQ(cpu.provenance, table.provenance);
  EXPECT_EQ(cpu.breakpoints, table.breakpoints);
  EXPECT_EQ(cpu.ranges, table.ranges);

  // Malformed ranges are not written.
  table.ranges = {{2, TailTier::token}};
  try {
    lmoe::write_tier_table(table);
    FAIL() << "no error";
  } catch (const lmoe::Error& error) {
    EXPECT_EQ(error.message(),
              "write_tier_table: table.ranges[0].max_tokens: the last piece must be unbounded "
              "(null) so that every T has a tier, got 2");
  }
}

TEST(TierTableV3, WrittenFitHasTheRangesAndTheBreakpoints) {
  lmoe::TierTable table = sample_table();
  table.grid = h200_tp2_grid();
  table.ranges = lmoe::find_ranges(table.grid).ranges;
  table.breakpoints = lmoe::find_breakpoints(table.grid).breakpoints;
  const nlohmann::json doc = nlohmann::json::parse(lmoe::write_tier_table(table));
  EXPECT_EQ(doc["ranges"], nlohmann::json::parse(R"([{"max_tokens": 77, "tier": "column"},
      {"max_tokens": 652, "tier": "overlap"}, {"max_tokens": null, "tier": "token"}])"));
  EXPECT_EQ(doc["breakpoints"], nlohmann::json::parse(
                                    R"({"fused_max_tokens": 0, "overlap_max_tokens": 0,
                                        "column_max_tokens": 270})"));
  EXPECT_EQ(doc["fit"]["total_regret"], 0.0);
  EXPECT_EQ(doc["fit"]["max_regret"], 0.0);
  EXPECT_GT(doc["fit"]["breakpoints"]["total_regret"].get<double>(), 0.25);
  // T=128: overlap fastest and chosen by the ranges; the breakpoints chose column.
  const nlohmann::json& at_128 = doc["grid"][2];
  EXPECT_EQ(at_128["tokens"], 128);
  EXPECT_EQ(at_128["fastest"], "overlap");
  EXPECT_EQ(at_128["chosen"], "overlap");
  EXPECT_EQ(at_128["regret"], 0.0);
  EXPECT_EQ(at_128["breakpoints_chosen"], "column");
  EXPECT_NEAR(at_128["breakpoints_regret"].get<double>(), 64.7 / 58.4 - 1, 1e-6);
  EXPECT_EQ(doc["grid"][0]["tiers"]["fused"]["declined"], "declined in the test");
}

// The written table with `edit` applied to its JSON.
std::string edited(const lmoe::TierTable& table, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json doc = nlohmann::json::parse(lmoe::write_tier_table(table));
  edit(doc);
  return doc.dump();
}

TEST(TierTableV3, MalformedRangesNameTheField) {
  const lmoe::TierTable table = sample_table();
  const auto with_ranges = [&](const std::string& ranges) {
    return read_error(
        edited(table, [&](nlohmann::json& d) { d["ranges"] = nlohmann::json::parse(ranges); }));
  };
  // Unsorted, and equal bounds.
  EXPECT_EQ(
      with_ranges(R"([{"max_tokens": 64, "tier": "fused"}, {"max_tokens": 16, "tier": "column"},
                            {"max_tokens": null, "tier": "token"}])"),
      "t.json: ranges[1].max_tokens: expected more than the previous piece's 64 (pieces rise "
      "in T), got 16");
  EXPECT_EQ(
      with_ranges(R"([{"max_tokens": 64, "tier": "fused"}, {"max_tokens": 64, "tier": "column"},
                            {"max_tokens": null, "tier": "token"}])"),
      "t.json: ranges[1].max_tokens: expected more than the previous piece's 64 (pieces rise "
      "in T), got 64");
  // A tier that does not exist.
  EXPECT_EQ(
      with_ranges(R"([{"max_tokens": 64, "tier": "fusd"}, {"max_tokens": null, "tier": "token"}])"),
      "t.json: ranges[0].tier: unknown tier 'fusd': expected fused, overlap, column or token");
  EXPECT_EQ(
      with_ranges(R"([{"max_tokens": 64, "tier": 1}, {"max_tokens": null, "tier": "token"}])"),
      "t.json: ranges[0].tier: expected a string, got 1");
  // max_tokens < 1, and not an integer.
  EXPECT_EQ(
      with_ranges(R"([{"max_tokens": 0, "tier": "fused"}, {"max_tokens": null, "tier": "token"}])"),
      "t.json: ranges[0].max_tokens: expected an integer >= 1, got 0");
  EXPECT_EQ(with_ranges(
                R"([{"max_tokens": -3, "tier": "fused"}, {"max_tokens": null, "tier": "token"}])"),
            "t.json: ranges[0].max_tokens: expected an integer >= 1, got -3");
  EXPECT_EQ(with_ranges(
                R"([{"max_tokens": 2.5, "tier": "fused"}, {"max_tokens": null, "tier": "token"}])"),
            "t.json: ranges[0].max_tokens: expected an integer >= 1, got 2.5");
  // ±1: 1 is a valid bound.
  EXPECT_EQ(
      lmoe::read_tier_table(
          edited(
              table,
              [](nlohmann::json& d) {
                d["ranges"] = nlohmann::json::parse(
                    R"([{"max_tokens": 1, "tier": "fused"}, {"max_tokens": null, "tier": "token"}])");
              }),
          "t.json")
          .ranges,
      (std::vector<TierRange>{{1, TailTier::fused}, {std::nullopt, TailTier::token}}));
  // No unbounded last piece; an unbounded piece that is not the last.
  EXPECT_EQ(
      with_ranges(R"([{"max_tokens": 64, "tier": "fused"}, {"max_tokens": 128, "tier": "token"}])"),
      "t.json: ranges[1].max_tokens: the last piece must be unbounded (null) so that every T "
      "has a tier, got 128");
  EXPECT_EQ(
      with_ranges(
          R"([{"max_tokens": null, "tier": "fused"}, {"max_tokens": null, "tier": "token"}])"),
      "t.json: ranges[0].max_tokens: only the last piece may be unbounded (null); 1 piece(s) "
      "follow it");
  // Shapes: empty, not an array, a piece that is not an object, a missing or unknown key.
  EXPECT_EQ(with_ranges("[]"),
            "t.json: ranges: expected a non-empty array of pieces {\"max_tokens\": T or null, "
            "\"tier\": name}, got []");
  EXPECT_EQ(with_ranges(R"({"max_tokens": null, "tier": "token"})"),
            "t.json: ranges: expected a non-empty array of pieces {\"max_tokens\": T or null, "
            "\"tier\": name}, got {\"max_tokens\":null,\"tier\":\"token\"}");
  EXPECT_EQ(with_ranges(R"([64, {"max_tokens": null, "tier": "token"}])"),
            "t.json: ranges[0]: expected an object, got 64");
  EXPECT_EQ(with_ranges(R"([{"tier": "token"}])"), "t.json: ranges[0]: missing \"max_tokens\"");
  EXPECT_EQ(with_ranges(R"([{"max_tokens": null}])"), "t.json: ranges[0]: missing \"tier\"");
  EXPECT_EQ(with_ranges(R"([{"max_tokens": null, "tier": "token", "min_tokens": 1}])"),
            "t.json: ranges[0].min_tokens: unknown key (expected max_tokens and tier)");
  EXPECT_EQ(read_error(edited(table, [](nlohmann::json& d) { d.erase("ranges"); })),
            "t.json: missing \"ranges\"");
  // The same errors when the table is loaded into a policy.
  PolicyConfig config;
  try {
    lmoe::apply_tier_table(
        config, edited(table, [](nlohmann::json& d) { d["ranges"][0]["tier"] = "fusd"; }),
        "table t.json");
    FAIL() << "no error";
  } catch (const lmoe::Error& error) {
    EXPECT_THAT(error.message(), StartsWith("table t.json: ranges[0].tier: unknown tier 'fusd'"));
  }
}

// A version-2 table (before ranges): read with no ranges, and its breakpoints rule exactly as
// before.
std::string as_version_2(const lmoe::TierTable& table) {
  return edited(table, [](nlohmann::json& d) {
    d["version"] = 2;
    d.erase("ranges");
    d["fit"].erase("breakpoints");
    for (auto& point : d["grid"]) {
      point.erase("breakpoints_chosen");
      point.erase("breakpoints_regret");
    }
  });
}

TEST(TierTableV2, StillLoadsAndItsBreakpointsRule) {
  lmoe::TierTable table = sample_table();
  table.grid = h200_tp2_grid();
  table.ranges = lmoe::find_ranges(table.grid).ranges;
  table.breakpoints = lmoe::find_breakpoints(table.grid).breakpoints;
  const std::string v2 = as_version_2(table);
  const lmoe::TierTable back = lmoe::read_tier_table(v2, "t.json");
  EXPECT_TRUE(back.ranges.empty());
  EXPECT_EQ(back.breakpoints, table.breakpoints);
  EXPECT_EQ(back.provenance, table.provenance);

  PolicyConfig config;
  lmoe::apply_tier_table(config, v2, "table t.json");
  ASSERT_TRUE(config.table);
  EXPECT_TRUE(config.ranges.value.empty());
  EXPECT_EQ(lmoe::describe_rule(config), "breakpoints");
  const PolicyConfig breakpoints = lmoe::policy_from(table.breakpoints, "table t.json");
  for (std::int64_t t = 0; t <= 2000; ++t) {
    for (const lmoe::TierSupport& support : {lmoe::TierSupport{}, lmoe::grid_support(table.grid[0]),
                                             lmoe::grid_support(table.grid[3])}) {
      const lmoe::TierDecision a = lmoe::decide(t, config, support);
      const lmoe::TierDecision b = lmoe::decide(t, breakpoints, support);
      ASSERT_EQ(a.tier, b.tier) << "T=" << t;
      ASSERT_EQ(a.summary, b.summary) << "T=" << t;
    }
  }
  // The same table as version 3: its ranges rule.
  PolicyConfig v3;
  lmoe::apply_tier_table(v3, lmoe::write_tier_table(table), "table t.json");
  EXPECT_EQ(v3.ranges.value, kH200Ranges);
  EXPECT_EQ(v3.ranges.origin, "table t.json ranges");
  EXPECT_EQ(lmoe::select(128, v3, lmoe::TierSupport{}), TailTier::overlap);
  EXPECT_EQ(lmoe::select(128, config, lmoe::TierSupport{}), TailTier::column);
  // A version-2 table over a config with ranges clears them: its breakpoints are meant to rule.
  lmoe::apply_tier_table(v3, v2, "table old.json");
  EXPECT_TRUE(v3.ranges.value.empty());
  EXPECT_EQ(lmoe::select(128, v3, lmoe::TierSupport{}), TailTier::column);
}

TEST(TierTableV3, MalformedTablesNameTheField) {
  const std::string good = lmoe::write_tier_table(sample_table());
  const auto replaced = [&](const std::string& from, const std::string& to) {
    std::string text = good;
    const std::size_t at = text.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return text.replace(at, from.size(), to);
  };
  EXPECT_EQ(read_error(replaced("\"version\": 3", "\"version\": 1")),
            "t.json: expected \"version\" 2 or 3 (a measured table), got 1");
  EXPECT_EQ(read_error(replaced("\"version\": 3", "\"version\": 4")),
            "t.json: expected \"version\" 2 or 3 (a measured table), got 4");
  EXPECT_EQ(read_error(replaced("\"provenance\"", "\"provenanse\"")),
            "t.json: missing \"provenance\"");
  EXPECT_EQ(read_error(replaced("\"grid\"", "\"grids\"")), "t.json: missing \"grid\"");
  EXPECT_EQ(read_error(replaced("\"tp\": 8", "\"tp\": 0")),
            "t.json: provenance.tp: expected an integer >= 1, got 0");
  EXPECT_EQ(read_error(replaced("\"tp\": 8", "\"tp\": \"8\"")),
            "t.json: provenance.tp: expected an integer >= 1, got \"8\"");
  EXPECT_EQ(read_error(replaced("\"dtype\": \"bf16\"", "\"dtype\": \"fp8\"")),
            "t.json: provenance.dtype: unknown dtype 'fp8': expected bf16, f16 or f32");
  EXPECT_EQ(read_error(replaced("\"backend\": \"cuda\"", "\"backend\": \"tpu\"")),
            "t.json: provenance.backend: unknown backend 'tpu': expected cpu or cuda");
  EXPECT_EQ(read_error(replaced("\"d_model\": 7168", "\"d_model\": -1")),
            "t.json: provenance.dims.d_model: expected an integer >= 1, got -1");
  EXPECT_EQ(read_error(replaced("\"fused\": {", "\"fusd\": {")),
            "t.json: grid[0].tiers: unknown tier 'fusd': expected fused, overlap, column or token");
  EXPECT_EQ(read_error(replaced("\"median_us\": 20.5", "\"median_us\": -20.5")),
            "t.json: grid[0].tiers.fused.median_us: expected a finite number >= 0, got -20.5");
  EXPECT_EQ(read_error(replaced("\"tokens\": 256", "\"tokens\": 1")),
            "t.json: grid[1].tokens: expected T to rise strictly, got 1 then 1");
  EXPECT_EQ(read_error(replaced("\"cold_l2\": true", "\"cold_l2\": 1")),
            "t.json: provenance.cold_l2: expected true or false, got 1");
  // Tables from before cold_l2 was recorded were measured warm.
  const lmoe::TierTable old = lmoe::read_tier_table(replaced("\"cold_l2\": true,", ""), "t.json");
  EXPECT_FALSE(old.provenance.cold_l2);
  EXPECT_TRUE(lmoe::read_tier_table(good, "t.json").provenance.cold_l2);
  // Layers the same way: one tail a timed iteration before they were recorded; at least 1.
  EXPECT_EQ(read_error(replaced("\"layers\": 8", "\"layers\": 0")),
            "t.json: provenance.layers: expected an integer >= 1, got 0");
  EXPECT_EQ(lmoe::read_tier_table(replaced("\"layers\": 8,", ""), "t.json").provenance.layers, 1);
  EXPECT_EQ(lmoe::read_tier_table(good, "t.json").provenance.layers, 8);
  EXPECT_EQ(read_error(replaced("\"LMOE_TOKEN_CHUNKS\": \"4\"", "\"LMOE_TOKEN_CHUNKS\": 4")),
            "t.json: provenance.settings.LMOE_TOKEN_CHUNKS: expected a string, got 4");
  // Tables from before the timing settings were recorded: none.
  nlohmann::json without = nlohmann::json::parse(good);
  without["provenance"].erase("settings");
  EXPECT_TRUE(lmoe::read_tier_table(without.dump(), "t.json").provenance.settings.empty());
  EXPECT_EQ(lmoe::read_tier_table(good, "t.json").provenance.settings,
            (lmoe::TimingSettings{{"LMOE_TOKEN_CHUNKS", "4"}}));
  EXPECT_EQ(read_error(replaced("\"fused_max_tokens\"", "\"fusd_max_tokens\"")),
            "t.json: breakpoints.fusd_max_tokens: unknown breakpoint (expected fused_max_tokens, "
            "overlap_max_tokens or column_max_tokens)");
  EXPECT_THAT(read_error("{"), StartsWith("t.json: not valid JSON"));
}

TEST(TierTableV3, AppliedToAPolicyItSetsTheRangesAllThreeBreakpointsAndTheTable) {
  const lmoe::TierTable table = sample_table();
  PolicyConfig config;
  lmoe::apply_tier_table(config, lmoe::write_tier_table(table), "table t.json");
  EXPECT_EQ(config.fused_max_tokens.value, table.breakpoints.fused_max_tokens);
  EXPECT_EQ(config.fused_max_tokens.source, lmoe::SettingSource::table);
  EXPECT_EQ(config.fused_max_tokens.origin, "table t.json fused_max_tokens");
  EXPECT_EQ(config.overlap_max_tokens.value, table.breakpoints.overlap_max_tokens);
  EXPECT_EQ(config.column_max_tokens.value, table.breakpoints.column_max_tokens);
  EXPECT_EQ(config.column_max_tokens.source, lmoe::SettingSource::table);
  EXPECT_EQ(config.ranges.value, table.ranges);
  EXPECT_EQ(config.ranges.source, lmoe::SettingSource::table);
  EXPECT_EQ(config.ranges.origin, "table t.json ranges");
  ASSERT_TRUE(config.table);
  EXPECT_EQ(config.table->provenance, table.provenance);
  EXPECT_EQ(config.table->ranges, table.ranges);
  EXPECT_EQ(config.table->grid.size(), 3u);

  // A version-1 table sets no measured table (and clears nothing that was there).
  PolicyConfig v1;
  lmoe::apply_tier_table(v1, R"({"format": "lmoe-tier-table", "version": 1})", "v1");
  EXPECT_FALSE(v1.table);
}

// ---- matching -----------------------------------------------------------------------------------

TEST(MatchTierTable, TheSameConfigurationMatchesWithoutWarnings) {
  const lmoe::TableProvenance p = sample_table().provenance;
  EXPECT_TRUE(lmoe::match_tier_table(p, running_like(p), "t.json").empty());
}

TEST(MatchTierTable, EachHardwareOrShapeFieldIsRefusedWithBothValues) {
  const lmoe::TableProvenance p = sample_table().provenance;
  const std::string head = "tier table t.json was measured for another configuration: ";
  const std::string tail = " (measure this configuration, or leave the table out)";
  struct Case {
    std::function<void(lmoe::RunningConfig&)> change;
    std::string difference;
  };
  const std::vector<Case> cases = {
      {[](auto& r) { r.gpu->name = "NVIDIA B200"; },
       "gpu.name is 'NVIDIA H200' in the table, 'NVIDIA B200' here"},
      {[](auto& r) { r.gpu->compute_capability = "10.0"; },
       "gpu.compute_capability is 9.0 in the table, 10.0 here"},
      {[](auto& r) { r.backend = lmoe::Backend::cpu; }, "backend is cuda in the table, cpu here"},
      {[](auto& r) { r.tp = 4; }, "tp is 8 in the table, 4 here"},
      {[](auto& r) { r.dims.d_model = 4096; }, "d_model is 7168 in the table, 4096 here"},
      {[](auto& r) { r.dims.d_latent = 1024; }, "d_latent is 3584 in the table, 1024 here"},
      {[](auto& r) { r.dtype = lmoe::DType::f16; }, "dtype is bf16 in the table, f16 here"},
      {[](auto& r) { r.comm = "nccl"; }, "comm is 'cuda-threads' in the table, 'nccl' here"},
  };
  for (const Case& c : cases) {
    lmoe::RunningConfig running = running_like(p);
    c.change(running);
    EXPECT_EQ(match_error(p, running), head + c.difference + tail);
  }
  // Several at once: every one is named.
  lmoe::RunningConfig running = running_like(p);
  running.tp = 2;
  running.dtype = lmoe::DType::f32;
  EXPECT_EQ(match_error(p, running), head +
                                         "tp is 8 in the table, 2 here; dtype is bf16 in the "
                                         "table, f32 here" +
                                         tail);
}

TEST(MatchTierTable, AnUnknownCommIsNotCompared) {
  const lmoe::TableProvenance p = sample_table().provenance;
  lmoe::RunningConfig running = running_like(p);
  running.comm.reset();
  EXPECT_TRUE(lmoe::match_tier_table(p, running, "t.json").empty());
}

TEST(MatchTierTable, SoftwareVersionsOnlyWarn) {
  const lmoe::TableProvenance p = sample_table().provenance;
  lmoe::RunningConfig running = running_like(p);
  running.driver_version = "590.10";
  std::vector<std::string> warnings = lmoe::match_tier_table(p, running, "t.json");
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_EQ(warnings[0],
            "tier table t.json: driver_version is '580.159.04' in the table, '590.10' here; the "
            "table is used, but its measurements may not hold");

  running = running_like(p);
  running.gpu->cuda_driver_version = 13010;
  running.gpu->cuda_runtime_version = 12080;
  running.nccl_version.reset();
  running.lmoe_version = "0.2.0";
  warnings = lmoe::match_tier_table(p, running, "t.json");
  ASSERT_EQ(warnings.size(), 4u);
  EXPECT_THAT(warnings[0], HasSubstr("gpu.cuda_driver_version is 13.0 in the table, 13.1 here"));
  EXPECT_THAT(warnings[1], HasSubstr("gpu.cuda_runtime_version is 13.0 in the table, 12.8 here"));
  EXPECT_THAT(warnings[2], HasSubstr("nccl_version is '2.28.3' in the table, none here"));
  EXPECT_THAT(warnings[3], HasSubstr("lmoe_version is '" + std::string(lmoe::kVersion) +
                                     "' in the table, '0.2.0' here"));
}

TEST(MatchTierTable, RunningConfigOfTheCpuBackend) {
  const lmoe::RunningConfig running =
      lmoe::running_config(lmoe::Backend::cpu, 2, {384, 192}, lmoe::DType::bf16, "threads");
  EXPECT_EQ(running.backend, lmoe::Backend::cpu);
  EXPECT_FALSE(running.gpu);
  EXPECT_FALSE(running.nccl_version);
  EXPECT_EQ(running.tp, 2);
  EXPECT_EQ(running.comm, std::optional<std::string>("threads"));
  EXPECT_EQ(running.lmoe_version, lmoe::kVersion);
}

// ---- loading: files, the environment and explain() ----------------------------------------------

// The tier policy tests' fixture, under a test suite name of this file's own.
class TableFiles : public lmoe_test::TierTableFiles {};

TEST_F(TableFiles, EnvironmentVariablesWinOverAMeasuredTable) {
  lmoe::TierTable table = sample_table();
  table.breakpoints = {10, 20, 30};
  const std::string path = write("tiers.json", lmoe::write_tier_table(table));

  PolicyConfig config = lmoe::load_policy_config(lmoe_test::fake_env({{"LMOE_TIER_TABLE", path}}));
  EXPECT_EQ(config.fused_max_tokens.value, 10);
  EXPECT_EQ(config.overlap_max_tokens.value, 20);
  EXPECT_EQ(config.column_max_tokens.value, std::optional<std::int64_t>(30));
  ASSERT_TRUE(config.table);
  EXPECT_EQ(config.table_path, std::optional<std::string>(path));

  config = lmoe::load_policy_config(
      lmoe_test::fake_env({{"LMOE_FUSED_MAX_TOKENS", "5"}, {"LMOE_COLUMN_MAX_TOKENS", "none"}}),
      path);
  EXPECT_EQ(config.fused_max_tokens.value, 5);
  EXPECT_EQ(config.fused_max_tokens.source, lmoe::SettingSource::environment);
  EXPECT_EQ(config.overlap_max_tokens.value, 20);
  EXPECT_EQ(config.overlap_max_tokens.source, lmoe::SettingSource::table);
  EXPECT_EQ(config.column_max_tokens.value, std::nullopt);
  EXPECT_EQ(config.column_max_tokens.source, lmoe::SettingSource::environment);
  ASSERT_TRUE(config.table);  // the table's measurements stay for explain()

  // An explicit path wins over LMOE_TIER_TABLE; LMOE_TIER wins over everything.
  const std::string other = write("other.json", R"({"format": "lmoe-tier-table", "version": 1,
      "breakpoints": {"fused_max_tokens": 99}})");
  config = lmoe::load_policy_config(
      lmoe_test::fake_env({{"LMOE_TIER_TABLE", other}, {"LMOE_TIER", "token"}}), path);
  EXPECT_EQ(config.fused_max_tokens.value, 10);
  EXPECT_EQ(lmoe::select(3, config, lmoe::TierSupport{}), TailTier::token);
  // And the version-1 file through the variable alone.
  config = lmoe::load_policy_config(lmoe_test::fake_env({{"LMOE_TIER_TABLE", other}}));
  EXPECT_EQ(config.fused_max_tokens.value, 99);
  EXPECT_FALSE(config.table);
}

TEST_F(TableFiles, BreakpointVariablesSetTheTableRangesAside) {
  lmoe::TierTable table = sample_table();
  table.grid = h200_tp2_grid();
  table.ranges = lmoe::find_ranges(table.grid).ranges;
  table.breakpoints = lmoe::find_breakpoints(table.grid).breakpoints;  // column up to 270, token
  const std::string path = write("tiers.json", lmoe::write_tier_table(table));
  const lmoe::TierSupport support = lmoe::grid_support(table.grid[2]);

  // No variable: the ranges rule.
  PolicyConfig config = lmoe::load_policy_config(lmoe_test::fake_env({}), path);
  EXPECT_EQ(config.ranges.value, kH200Ranges);
  EXPECT_FALSE(config.ranges_set_aside);
  EXPECT_EQ(lmoe::decide(128, config, support).summary,
            "T=128 → overlap (preferred: 77 < T <= 652: overlap, table " + path + " ranges)");
  EXPECT_THAT(lmoe::explain(128, config, support),
              HasSubstr("rule: ranges column T<=77, overlap T<=652, token above (table " + path +
                        " ranges); the breakpoints are not used\n"));

  // Each breakpoint variable sets them aside, even at a value the table already has: the
  // breakpoints rule, with the variable over the table's value.
  const std::vector<std::pair<std::string, std::string>> variables = {
      {"LMOE_FUSED_MAX_TOKENS", "0"},
      {"LMOE_OVERLAP_MAX_TOKENS", "0"},
      {"LMOE_COLUMN_MAX_TOKENS", "270"},
      {"LMOE_DISABLE_OVERLAP", "0"}};
  for (const auto& [name, value] : variables) {
    SCOPED_TRACE(name);
    config = lmoe::load_policy_config(lmoe_test::fake_env({{name, value}}), path);
    EXPECT_TRUE(config.ranges.value.empty());
    EXPECT_EQ(config.ranges.source, lmoe::SettingSource::environment);
    EXPECT_EQ(config.ranges_set_aside, std::optional<std::string>(name + "=" + value));
    EXPECT_EQ(lmoe::select(128, config, support), TailTier::column);
    EXPECT_EQ(lmoe::select(1024, config, lmoe::grid_support(table.grid[4])), TailTier::token);
    const std::string text = lmoe::explain(128, config, support);
    EXPECT_THAT(text, HasSubstr("rule: breakpoints; the table's ranges are set aside because " +
                                name + "=" + value + " is set\n"));
    EXPECT_THAT(text, HasSubstr("  ranges              none    set aside by " + name + "=" + value +
                                " (were column T<=77, overlap T<=652, token above, table " + path +
                                " ranges)\n"));
    ASSERT_TRUE(config.table);  // the measurements stay for explain()
  }
  // Two at once are both named.
  config = lmoe::load_policy_config(
      lmoe_test::fake_env({{"LMOE_FUSED_MAX_TOKENS", "64"}, {"LMOE_DISABLE_OVERLAP", "1"}}), path);
  EXPECT_EQ(lmoe::describe_rule(config),
            "breakpoints; the table's ranges are set aside because LMOE_FUSED_MAX_TOKENS=64, "
            "LMOE_DISABLE_OVERLAP=1 are set");
  EXPECT_EQ(lmoe::select(64, config, lmoe::TierSupport{}), TailTier::fused);

  // Empty variables are unset, LMOE_TIER=auto is not a breakpoint: the ranges stay.
  config = lmoe::load_policy_config(
      lmoe_test::fake_env({{"LMOE_FUSED_MAX_TOKENS", ""}, {"LMOE_TIER", "auto"}}), path);
  EXPECT_EQ(config.ranges.value, kH200Ranges);
  EXPECT_FALSE(config.ranges_set_aside);
  // A forced tier wins over the ranges (which stay, unused).
  config = lmoe::load_policy_config(lmoe_test::fake_env({{"LMOE_TIER", "token"}}), path);
  EXPECT_EQ(config.ranges.value, kH200Ranges);
  EXPECT_EQ(lmoe::select(128, config, support), TailTier::token);
  // Without ranges (a version-1 table) a breakpoint variable sets nothing aside.
  const std::string v1 = write("v1.json", R"({"format": "lmoe-tier-table", "version": 1,
      "breakpoints": {"fused_max_tokens": 99}})");
  config = lmoe::load_policy_config(lmoe_test::fake_env({{"LMOE_FUSED_MAX_TOKENS", "5"}}), v1);
  EXPECT_FALSE(config.ranges_set_aside);
  EXPECT_EQ(config.ranges.source, lmoe::SettingSource::built_in);
  EXPECT_EQ(lmoe::describe_rule(config), "breakpoints");
}

TEST_F(TableFiles, ExplainCitesTheMeasurementNearestToT) {
  lmoe::TierTable table = sample_table();
  table.breakpoints = {16, 64, 128};
  const std::string path = write("tiers.json", lmoe::write_tier_table(table));
  const PolicyConfig config = lmoe::load_policy_config(lmoe_test::fake_env({}), path);
  const std::string text = lmoe::explain(300, config, lmoe::TierSupport{});
  EXPECT_THAT(text, StartsWith("decision: T=300 → token"));
  EXPECT_THAT(text, HasSubstr("evidence: table " + path +
                              " measured at T=256 (nearest to T=300): token 812.0 us (chosen), "
                              "column 901.0 us, overlap 950.5 us, fused 990.0 us\n"));
  EXPECT_THAT(text,
              HasSubstr("measured 2026-11-29T12:00:00Z on NVIDIA H200, tp 8, comm cuda-threads"));
  // At a grid T the note says nothing about nearness; declined and unmeasured tiers say so.
  const std::string at_one = lmoe::explain(1, config, lmoe::TierSupport{});
  EXPECT_THAT(at_one, HasSubstr("evidence: table " + path +
                                " measured at T=1: fused 20.5 us "
                                "(chosen), overlap 30.2 us, column 40.1 us, token declined "
                                "(declined in the test)\n"));
  const std::string at_512 = lmoe::explain(512, config, lmoe::TierSupport{});
  EXPECT_THAT(at_512, HasSubstr("overlap not measured"));
  // No table, no evidence line.
  EXPECT_THAT(lmoe::explain(300, PolicyConfig{}, lmoe::TierSupport{}),
              ::testing::Not(HasSubstr("evidence")));
}

// ---- LatentTail with a table --------------------------------------------------------------------

lmoe::TierTable cpu_table(int tp, lmoe::TailDims dims) {
  lmoe::TierTable table = sample_table();
  table.provenance.backend = lmoe::Backend::cpu;
  table.provenance.gpu.reset();
  table.provenance.driver_version.reset();
  table.provenance.nccl_version.reset();
  table.provenance.tp = tp;
  table.provenance.dims = dims;
  table.provenance.comm = "threads";
  table.provenance.settings = lmoe::timing_settings_from_environment();  // measured here
  return table;
}

void build_tail(const lmoe::TierTable& table, int tp, std::vector<std::string>* warnings) {
  const lmoe::TailDims dims{64, 32};
  const lmoe::TailCase c = lmoe::make_random_case(dims, 1e-5f, lmoe::DType::bf16, tp, 1, 5u);
  lmoe::run_on_threads(tp, [&](int rank, lmoe::Communicator& comm) {
    lmoe::TailOptions options;
    options.dims = dims;
    options.policy.table = std::make_shared<lmoe::TierTable>(table);
    options.policy.table_path = "t.json";
    lmoe::LatentTail tail(options, comm, c.norm_weight.matrix(), c.up_proj_weight.matrix());
    if (rank == 0 && warnings) *warnings = tail.table_warnings();
  });
}

TEST(LatentTailTable, AMismatchedTableIsRefusedOnEveryRank) {
  try {
    build_tail(cpu_table(4, {64, 32}), 2, nullptr);
    FAIL() << "no error";
  } catch (const lmoe::Error& error) {
    EXPECT_THAT(error.message(), HasSubstr("tier table t.json was measured for another "
                                           "configuration: tp is 4 in the table, 2 here"));
  }
  try {
    build_tail(cpu_table(2, {128, 32}), 2, nullptr);
    FAIL() << "no error";
  } catch (const lmoe::Error& error) {
    EXPECT_THAT(error.message(), HasSubstr("d_model is 128 in the table, 64 here"));
  }
}

// Several differing fields make a long message; every rank gets all of it (the agreement record
// between ranks carries whole messages).
TEST(LatentTailTable, ALongRefusalReachesEveryRankWhole) {
  lmoe::TierTable table = cpu_table(4, {128, 16});
  table.provenance.comm =
      "a-communicator-with-a-long-name-that-no-machine-has-to-make-the-message-long";
  try {
    build_tail(table, 2, nullptr);
    FAIL() << "no error";
  } catch (const lmoe::Error& error) {
    const std::string message = error.message();
    EXPECT_GT(message.size(), 240u) << message;
    EXPECT_THAT(message, HasSubstr("tp is 4 in the table, 2 here"));
    EXPECT_THAT(message, HasSubstr("d_model is 128 in the table, 64 here"));
    EXPECT_THAT(message, HasSubstr("d_latent is 16 in the table, 32 here"));
    EXPECT_THAT(message, HasSubstr("no-machine-has-to-make-the-message-long"));
  }
}

TEST(LatentTailTable, AMatchingTableIsUsedAndOtherVersionsAreWarnedAbout) {
  std::vector<std::string> warnings = {"poison"};
  build_tail(cpu_table(2, {64, 32}), 2, &warnings);
  EXPECT_TRUE(warnings.empty());
  lmoe::TierTable older = cpu_table(2, {64, 32});
  older.provenance.lmoe_version = "0.0.1";
  build_tail(older, 2, &warnings);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_THAT(warnings[0], HasSubstr("lmoe_version is '0.0.1' in the table"));
  // Measured with another timing setting than this process has: used, with a warning.
  lmoe::TierTable other = cpu_table(2, {64, 32});
  other.provenance.settings["LMOE_FUSED_DECODE"] = "a value no process here has";
  build_tail(other, 2, &warnings);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_THAT(warnings[0],
              HasSubstr("LMOE_FUSED_DECODE is 'a value no process here has' in the table"));
}

// ---- checking a policy against a sweep ----------------------------------------------------------

TEST(CheckChoices, VerdictsAtTheirEdges) {
  using V = lmoe::ChoiceCheck::Verdict;
  const std::vector<lmoe::BenchRecord> records = {
      // T=1: the choice is the fastest.
      record("p2p", 1, TailTier::fused, 10, 11, true),
      record("p2p", 1, TailTier::column, 12, 13),
      // T=2: just under 3 % slower: ok; T=3: just over 3 % and above the p90: slower.
      record("p2p", 2, TailTier::fused, 102.99, 104, true),
      record("p2p", 2, TailTier::column, 100, 101),
      record("p2p", 3, TailTier::fused, 103.01, 104, true),
      record("p2p", 3, TailTier::column, 100, 101),
      // T=4: 10 % slower but not above the fastest's p90 (a noisy fastest): within the spread.
      record("p2p", 4, TailTier::overlap, 110, 120, true),
      record("p2p", 4, TailTier::column, 100, 110),
      // T=5: the chosen tier was not timed (here: no record carries the mark).
      record("p2p", 5, TailTier::column, 100, 110),
      // T=6: nothing ran.
      record("p2p", 6, TailTier::token, -1, 0),
      // Another comm at T=1, judged on its own.
      record("nccl", 1, TailTier::fused, 50, 51, true),
      record("nccl", 1, TailTier::column, 10, 11),
  };
  const std::vector<lmoe::ChoiceCheck> checks = lmoe::check_choices(records);
  ASSERT_EQ(checks.size(), 7u);
  EXPECT_EQ(checks[0].verdict, V::fastest);
  EXPECT_EQ(checks[0].chosen, TailTier::fused);
  EXPECT_DOUBLE_EQ(checks[0].ratio, 1.0);
  EXPECT_EQ(checks[1].verdict, V::within_percent);
  EXPECT_NEAR(checks[1].ratio, 1.0299, 1e-12);
  EXPECT_EQ(checks[2].verdict, V::slower);
  EXPECT_FALSE(checks[2].ok());
  EXPECT_EQ(checks[2].fastest, TailTier::column);
  EXPECT_NEAR(checks[2].fastest_p90_us, 101, 1e-9);
  EXPECT_EQ(checks[3].verdict, V::within_spread);
  EXPECT_TRUE(checks[3].ok());
  EXPECT_EQ(checks[4].verdict, V::not_timed);
  EXPECT_FALSE(checks[4].ok());
  EXPECT_EQ(checks[5].verdict, V::nothing_ran);
  EXPECT_TRUE(checks[5].ok());
  EXPECT_EQ(checks[6].comm, "nccl");
  EXPECT_EQ(checks[6].verdict, V::slower);
  EXPECT_NEAR(checks[6].ratio, 5.0, 1e-12);
  // A looser tolerance lets T=3 pass.
  EXPECT_EQ(lmoe::check_choices(records, 0.05)[2].verdict, V::within_percent);
}

// ---- tune on the CPU backend --------------------------------------------------------------------

TEST(TuneTiers, CpuSweepGivesATableThatMatchesItsOwnConfiguration) {
  lmoe::BenchOptions options;
  options.backend = lmoe::Backend::cpu;
  options.dims = {64, 32};
  options.tp = 2;
  options.tokens = {1, 4, 16};
  options.warmup = 0;
  options.iters = 2;
  const lmoe::TuneResult result = lmoe::tune_tiers(options, "tiny");
  ASSERT_TRUE(result.ok());
  const lmoe::TierTable& table = result.table;
  EXPECT_EQ(table.provenance.backend, lmoe::Backend::cpu);
  EXPECT_EQ(table.provenance.comm, "threads");
  EXPECT_EQ(table.provenance.tp, 2);
  EXPECT_EQ(table.provenance.preset, "tiny");
  EXPECT_EQ(table.provenance.mode, "eager");
  EXPECT_EQ(table.provenance.iters, 2);
  EXPECT_EQ(table.provenance.lmoe_version, lmoe::kVersion);
  ASSERT_EQ(table.grid.size(), 3u);
  EXPECT_EQ(table.grid[0][TailTier::token].status, TierTiming::Status::declined);
  for (const GridPoint& p : table.grid) {
    for (TailTier tier : {TailTier::fused, TailTier::overlap, TailTier::column}) {
      EXPECT_TRUE(p[tier].ran()) << p.tokens;
      EXPECT_LE(p[tier].p10_us, p[tier].median_us);
      EXPECT_LE(p[tier].median_us, p[tier].p90_us);
    }
  }
  EXPECT_EQ(table.breakpoints, lmoe::find_breakpoints(table.grid).breakpoints);
  EXPECT_EQ(result.breakpoint_fit.breakpoints, table.breakpoints);
  // The ranges give every T the fastest tier measured there.
  EXPECT_EQ(table.ranges, lmoe::find_ranges(table.grid).ranges);
  EXPECT_EQ(result.range_fit.ranges, table.ranges);
  EXPECT_EQ(result.range_fit.total_regret, 0);
  EXPECT_LE(result.range_fit.total_regret, result.breakpoint_fit.total_regret);
  EXPECT_EQ(lmoe::read_tier_table(lmoe::write_tier_table(table), "t.json").ranges, table.ranges);
  EXPECT_TRUE(lmoe::match_tier_table(table.provenance,
                                     lmoe::running_config(lmoe::Backend::cpu, 2, {64, 32},
                                                          lmoe::DType::bf16, "threads"),
                                     "t.json")
                  .empty());
  // Two comms cannot share one table.
  options.comms = {"threads", "threads"};
  EXPECT_THROW(lmoe::tune_tiers(options, "tiny"), lmoe::Error);
}

TEST(TuneTiers, DefaultGridIsDenseBetweenPowersOfTwo) {
  const std::vector<std::int64_t> cuda = lmoe::default_tune_tokens(lmoe::Backend::cuda);
  EXPECT_EQ(cuda.front(), 1);
  EXPECT_EQ(cuda.back(), 32768);
  EXPECT_TRUE(std::is_sorted(cuda.begin(), cuda.end()));
  for (std::int64_t t = 1; t <= 32768; t *= 2) {
    EXPECT_TRUE(std::count(cuda.begin(), cuda.end(), t)) << t;
    if (t >= 2 && t < 32768) {
      EXPECT_TRUE(std::count(cuda.begin(), cuda.end(), 3 * t / 2)) << t;
    }
  }
  EXPECT_EQ(cuda.size(), 30u);
}

}  // namespace

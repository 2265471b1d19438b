// The tier policy: where each breakpoint comes from (default < table < environment), which tier
// each T gets at and around every breakpoint, forcing, declining with a reason, and the errors a
// bad environment variable or tier table raises.
#include "lmoe/tier_policy.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "lmoe/error.hpp"
#include "lmoe/latent_tail.hpp"
#include "tier_table_files.hpp"

namespace {

using lmoe::PolicyConfig;
using lmoe::SettingSource;
using lmoe::TailTier;
using lmoe::TierDecision;
using lmoe::TierSupport;
using ::testing::HasSubstr;
using ::testing::StartsWith;

using Env = std::map<std::string, std::string>;

using lmoe_test::fake_env;

PolicyConfig load(const Env& env, const std::optional<std::string>& table_path = std::nullopt) {
  return lmoe::load_policy_config(fake_env(env), table_path);
}

// The message of the lmoe::Error that loading throws; any other outcome fails the test.
std::string load_error(const Env& env,
                       const std::optional<std::string>& table_path = std::nullopt) {
  try {
    load(env, table_path);
  } catch (const lmoe::Error& error) {
    return error.message();
  }
  ADD_FAILURE() << "load_policy_config did not throw";
  return "<no error>";
}

std::string table_error(const std::string& json) {
  PolicyConfig config;
  try {
    lmoe::apply_tier_table(config, json, "t.json");
  } catch (const lmoe::Error& error) {
    return error.message();
  }
  ADD_FAILURE() << "apply_tier_table accepted " << json;
  return "<no error>";
}

TierSupport all_can_run() { return {}; }

TierSupport declining(TailTier tier, const std::string& why) {
  TierSupport support;
  support.declined[static_cast<std::size_t>(tier)] = why;
  return support;
}

TailTier tier_for(std::int64_t tokens, const PolicyConfig& config,
                  const TierSupport& support = all_can_run()) {
  return lmoe::select(tokens, config, support);
}

// A built-in fused bound: fused from T = 1 up to `bound` and overlap just above it.
void expect_built_in_fused_bound(const PolicyConfig& config, std::int64_t bound) {
  EXPECT_EQ(config.fused_max_tokens.value, bound);
  EXPECT_EQ(config.fused_max_tokens.source, SettingSource::built_in);
  EXPECT_EQ(tier_for(1, config), TailTier::fused);
  EXPECT_EQ(tier_for(bound, config), TailTier::fused);
  EXPECT_EQ(tier_for(bound + 1, config), TailTier::overlap);
}

std::string select_error(std::int64_t tokens, const PolicyConfig& config,
                         const TierSupport& support) {
  try {
    lmoe::select(tokens, config, support);
  } catch (const lmoe::Error& error) {
    return error.message();
  }
  ADD_FAILURE() << "select did not throw for T=" << tokens;
  return "<no error>";
}

using lmoe_test::TierTableFiles;

const char* kFullTable = R"({"format": "lmoe-tier-table", "version": 1,
  "breakpoints": {"fused_max_tokens": 64, "overlap_max_tokens": 512, "column_max_tokens": 4096},
  "overlap_disabled": true,
  "hardware": {"gpu": "H200"}, "measurements": [1, 2, 3]})";

// ---------------------------------------------------------------------------------------------
// Sources and precedence

TEST(TierPolicyConfig, BuiltInDefaultsWithAnEmptyEnvironment) {
  const PolicyConfig config = load({});
  EXPECT_EQ(config.fused_max_tokens.value, 128);
  EXPECT_EQ(config.fused_max_tokens.source, SettingSource::built_in);
  EXPECT_EQ(config.overlap_max_tokens.value, 256);
  EXPECT_EQ(config.overlap_max_tokens.source, SettingSource::built_in);
  EXPECT_EQ(config.column_max_tokens.value, std::nullopt);
  EXPECT_EQ(config.column_max_tokens.source, SettingSource::built_in);
  EXPECT_FALSE(config.overlap_disabled.value);
  EXPECT_EQ(config.forced_tier.value, std::nullopt);
  EXPECT_EQ(config.table_path, std::nullopt);
}

TEST(TierPolicyConfig, EmptyVariablesCountAsUnset) {
  const PolicyConfig config = load({{"LMOE_FUSED_MAX_TOKENS", ""},
                                    {"LMOE_OVERLAP_MAX_TOKENS", ""},
                                    {"LMOE_COLUMN_MAX_TOKENS", ""},
                                    {"LMOE_DISABLE_OVERLAP", ""},
                                    {"LMOE_TIER", ""},
                                    {"LMOE_TIER_TABLE", ""}});
  EXPECT_EQ(config.fused_max_tokens.value, 128);
  EXPECT_EQ(config.fused_max_tokens.source, SettingSource::built_in);
  EXPECT_EQ(config.column_max_tokens.source, SettingSource::built_in);
  EXPECT_EQ(config.forced_tier.source, SettingSource::built_in);
  EXPECT_EQ(config.table_path, std::nullopt);
}

TEST_F(TierTableFiles, TableOverridesEveryDefault) {
  const std::string path = write("tiers.json", kFullTable);
  const PolicyConfig config = load({}, path);
  EXPECT_EQ(config.fused_max_tokens.value, 64);
  EXPECT_EQ(config.fused_max_tokens.source, SettingSource::table);
  EXPECT_EQ(config.fused_max_tokens.origin, "table " + path + " fused_max_tokens");
  EXPECT_EQ(config.overlap_max_tokens.value, 512);
  EXPECT_EQ(config.overlap_max_tokens.source, SettingSource::table);
  EXPECT_EQ(config.column_max_tokens.value, std::optional<std::int64_t>(4096));
  EXPECT_EQ(config.column_max_tokens.source, SettingSource::table);
  EXPECT_TRUE(config.overlap_disabled.value);
  EXPECT_EQ(config.overlap_disabled.source, SettingSource::table);
  EXPECT_EQ(config.table_path, std::optional<std::string>(path));
}

TEST_F(TierTableFiles, TableKeysLeftOutKeepTheirDefaults) {
  const std::string path = write("partial.json", R"({"format": "lmoe-tier-table", "version": 1,
                                "breakpoints": {"overlap_max_tokens": 300}})");
  const PolicyConfig config = load({}, path);
  EXPECT_EQ(config.fused_max_tokens.value, 128);
  EXPECT_EQ(config.fused_max_tokens.source, SettingSource::built_in);
  EXPECT_EQ(config.overlap_max_tokens.value, 300);
  EXPECT_EQ(config.overlap_max_tokens.source, SettingSource::table);
  EXPECT_FALSE(config.overlap_disabled.value);
  EXPECT_EQ(config.overlap_disabled.source, SettingSource::built_in);
}

TEST_F(TierTableFiles, TableIsFoundThroughLmoeTierTable) {
  const std::string path = write("tiers.json", kFullTable);
  const PolicyConfig config = load({{"LMOE_TIER_TABLE", path}});
  EXPECT_EQ(config.fused_max_tokens.value, 64);
  EXPECT_EQ(config.table_path, std::optional<std::string>(path));
}

TEST_F(TierTableFiles, ExplicitTablePathWinsOverLmoeTierTable) {
  const std::string chosen = write("chosen.json", kFullTable);
  // The variable names a file that does not exist: it must not even be opened.
  const PolicyConfig config = load({{"LMOE_TIER_TABLE", (dir_ / "missing.json").string()}}, chosen);
  EXPECT_EQ(config.fused_max_tokens.value, 64);
  EXPECT_EQ(config.table_path, std::optional<std::string>(chosen));
}

TEST_F(TierTableFiles, EnvironmentOverridesTheTableForEachKey) {
  const std::string path = write("tiers.json", kFullTable);
  const PolicyConfig config = load({{"LMOE_FUSED_MAX_TOKENS", "32"},
                                    {"LMOE_OVERLAP_MAX_TOKENS", "1000"},
                                    {"LMOE_COLUMN_MAX_TOKENS", "none"},
                                    {"LMOE_DISABLE_OVERLAP", "0"}},
                                   path);
  EXPECT_EQ(config.fused_max_tokens.value, 32);
  EXPECT_EQ(config.fused_max_tokens.source, SettingSource::environment);
  EXPECT_EQ(config.fused_max_tokens.origin, "LMOE_FUSED_MAX_TOKENS=32");
  EXPECT_EQ(config.overlap_max_tokens.value, 1000);
  EXPECT_EQ(config.overlap_max_tokens.source, SettingSource::environment);
  EXPECT_EQ(config.overlap_max_tokens.origin, "LMOE_OVERLAP_MAX_TOKENS=1000");
  // "none" clears the table's limit rather than being ignored.
  EXPECT_EQ(config.column_max_tokens.value, std::nullopt);
  EXPECT_EQ(config.column_max_tokens.source, SettingSource::environment);
  EXPECT_EQ(config.column_max_tokens.origin, "LMOE_COLUMN_MAX_TOKENS=none");
  EXPECT_FALSE(config.overlap_disabled.value);
  EXPECT_EQ(config.overlap_disabled.source, SettingSource::environment);
  EXPECT_EQ(config.overlap_disabled.origin, "LMOE_DISABLE_OVERLAP=0");
  EXPECT_EQ(config.table_path, std::optional<std::string>(path));
}

TEST(TierPolicyConfig, EnvironmentOverridesEachDefault) {
  const PolicyConfig config = load({{"LMOE_FUSED_MAX_TOKENS", "0"},
                                    {"LMOE_OVERLAP_MAX_TOKENS", "7"},
                                    {"LMOE_COLUMN_MAX_TOKENS", "9"},
                                    {"LMOE_DISABLE_OVERLAP", "yes"},
                                    {"LMOE_TIER", "column"}});
  EXPECT_EQ(config.fused_max_tokens.value, 0);
  EXPECT_EQ(config.overlap_max_tokens.value, 7);
  EXPECT_EQ(config.column_max_tokens.value, std::optional<std::int64_t>(9));
  EXPECT_TRUE(config.overlap_disabled.value);
  EXPECT_EQ(config.forced_tier.value, std::optional<TailTier>(TailTier::column));
  EXPECT_EQ(config.forced_tier.source, SettingSource::environment);
  EXPECT_EQ(config.forced_tier.origin, "LMOE_TIER=column");
}

TEST(TierPolicyConfig, FlagSpellings) {
  for (const char* yes : {"1", "true", "TRUE", "Yes", "on"}) {
    EXPECT_TRUE(load({{"LMOE_DISABLE_OVERLAP", yes}}).overlap_disabled.value) << yes;
  }
  for (const char* no : {"0", "false", "No", "OFF"}) {
    const PolicyConfig config = load({{"LMOE_DISABLE_OVERLAP", no}});
    EXPECT_FALSE(config.overlap_disabled.value) << no;
    EXPECT_EQ(config.overlap_disabled.source, SettingSource::environment) << no;
  }
}

TEST(TierPolicyConfig, LmoeTierAutoMeansNoForcedTier) {
  const PolicyConfig config = load({{"LMOE_TIER", "auto"}});
  EXPECT_EQ(config.forced_tier.value, std::nullopt);
  EXPECT_EQ(config.forced_tier.source, SettingSource::environment);
  for (TailTier tier : lmoe::kAllTiers) {
    const std::string name(lmoe::tier_name(tier));
    EXPECT_EQ(load({{"LMOE_TIER", name}}).forced_tier.value, std::optional<TailTier>(tier)) << name;
  }
}

TEST(TierPolicyConfig, LargestTokenCountIsAcceptedAndOneMoreIsTooLarge) {
  EXPECT_EQ(load({{"LMOE_FUSED_MAX_TOKENS", "9223372036854775807"}}).fused_max_tokens.value,
            INT64_MAX);
  EXPECT_EQ(load_error({{"LMOE_FUSED_MAX_TOKENS", "9223372036854775808"}}),
            "LMOE_FUSED_MAX_TOKENS='9223372036854775808': the number is too large");
  EXPECT_EQ(load_error({{"LMOE_OVERLAP_MAX_TOKENS", "99999999999999999999999"}}),
            "LMOE_OVERLAP_MAX_TOKENS='99999999999999999999999': the number is too large");
}

// ---------------------------------------------------------------------------------------------
// Bad environment values: every message names the variable and its value.

TEST(TierPolicyConfig, GarbageTokenCountsThrowNamingTheVariable) {
  const char* variables[] = {"LMOE_FUSED_MAX_TOKENS", "LMOE_OVERLAP_MAX_TOKENS",
                             "LMOE_COLUMN_MAX_TOKENS"};
  const char* garbage[] = {"-1", "abc", "12x", " 12", "12 ", "+5", "1e3", "1.5", "0x10", "--0"};
  for (const char* variable : variables) {
    for (const char* value : garbage) {
      EXPECT_EQ(load_error({{variable, value}}),
                std::string(variable) + "='" + value +
                    "': expected a non-negative integer number of tokens")
          << variable << "=" << value;
    }
  }
  EXPECT_EQ(load_error({{"LMOE_FUSED_MAX_TOKENS", "-1"}}),
            "LMOE_FUSED_MAX_TOKENS='-1': expected a non-negative integer number of tokens");
}

TEST(TierPolicyConfig, GarbageFlagThrowsNamingTheVariable) {
  EXPECT_EQ(load_error({{"LMOE_DISABLE_OVERLAP", "maybe"}}),
            "LMOE_DISABLE_OVERLAP='maybe': expected 1, 0, true, false, yes, no, on or off");
  EXPECT_EQ(load_error({{"LMOE_DISABLE_OVERLAP", "2"}}),
            "LMOE_DISABLE_OVERLAP='2': expected 1, 0, true, false, yes, no, on or off");
}

TEST(TierPolicyConfig, UnknownForcedTierThrowsNamingTheVariable) {
  EXPECT_EQ(
      load_error({{"LMOE_TIER", "turbo"}}),
      "LMOE_TIER='turbo': unknown tier 'turbo': expected auto, fused, overlap, column or token");
  EXPECT_EQ(
      load_error({{"LMOE_TIER", "Fused"}}),
      "LMOE_TIER='Fused': unknown tier 'Fused': expected auto, fused, overlap, column or token");
}

TEST(TierPolicyConfig, ErrorWhatCarriesThePlaceAndMessageDoesNot) {
  try {
    load({{"LMOE_FUSED_MAX_TOKENS", "x"}});
    FAIL() << "no throw";
  } catch (const lmoe::Error& error) {
    EXPECT_THAT(std::string(error.what()), HasSubstr("core/settings.cpp:"));
    EXPECT_THAT(error.message(), StartsWith("LMOE_FUSED_MAX_TOKENS='x'"));
  }
}

// ---------------------------------------------------------------------------------------------
// Malformed tier tables

TEST(TierTable, NotJson) {
  EXPECT_THAT(table_error("{not json"), StartsWith("t.json: not valid JSON: "));
  EXPECT_THAT(table_error(""), StartsWith("t.json: not valid JSON: "));
}

TEST(TierTable, TopLevelMustBeAnObject) {
  EXPECT_EQ(table_error("[1, 2]"), "t.json: expected a JSON object at the top level");
  EXPECT_EQ(table_error("128"), "t.json: expected a JSON object at the top level");
}

TEST(TierTable, WrongOrMissingFormat) {
  EXPECT_EQ(table_error(R"({"format": "other", "version": 1})"),
            "t.json: \"format\" must be \"lmoe-tier-table\"");
  EXPECT_EQ(table_error(R"({"version": 1})"), "t.json: \"format\" must be \"lmoe-tier-table\"");
  // Another kind of value is the same mistake, not a JSON library's type error.
  EXPECT_EQ(table_error(R"({"format": 3, "command": true, "version": 1})"),
            "t.json: \"format\" must be \"lmoe-tier-table\"");
  EXPECT_EQ(table_error(R"({"format": null, "command": ["bench"]})"),
            "t.json: \"format\" must be \"lmoe-tier-table\"");
}

TEST(TierTable, WrongOrMissingVersion) {
  EXPECT_EQ(table_error(R"({"format": "lmoe-tier-table", "version": 4})"),
            "t.json: unsupported \"version\" 4 (this lmoe reads versions 1, 2 and 3)");
  // Versions 2 and 3 are read, and must carry their measurements (test_tier_tuning.cpp has the
  // rest); version 3 its ranges first.
  EXPECT_EQ(table_error(R"({"format": "lmoe-tier-table", "version": 2})"),
            "t.json: missing \"breakpoints\"");
  EXPECT_EQ(table_error(R"({"format": "lmoe-tier-table", "version": 3})"),
            "t.json: missing \"ranges\"");
  EXPECT_EQ(table_error(R"({"format": "lmoe-tier-table", "version": 0})"),
            "t.json: unsupported \"version\" 0 (this lmoe reads versions 1, 2 and 3)");
  EXPECT_EQ(table_error(R"({"format": "lmoe-tier-table", "version": "1"})"),
            "t.json: unsupported \"version\" \"1\" (this lmoe reads versions 1, 2 and 3)");
  EXPECT_EQ(table_error(R"({"format": "lmoe-tier-table"})"),
            "t.json: unsupported \"version\" null (this lmoe reads versions 1, 2 and 3)");
}

TEST(TierTable, UnknownBreakpointIsAnError) {
  EXPECT_EQ(table_error(R"({"format": "lmoe-tier-table", "version": 1,
                             "breakpoints": {"fused_max_token": 64}})"),
            "t.json: breakpoints.fused_max_token: unknown breakpoint (expected fused_max_tokens, "
            "overlap_max_tokens or column_max_tokens)");
}

TEST(TierTable, BreakpointValuesMustBeNonNegativeIntegers) {
  const auto with = [](const std::string& key, const std::string& value) {
    return R"({"format": "lmoe-tier-table", "version": 1, "breakpoints": {")" + key +
           "\": " + value + "}}";
  };
  EXPECT_EQ(table_error(with("fused_max_tokens", "-1")),
            "t.json: breakpoints.fused_max_tokens: expected a non-negative integer, got -1");
  EXPECT_EQ(table_error(with("overlap_max_tokens", "1.5")),
            "t.json: breakpoints.overlap_max_tokens: expected a non-negative integer, got 1.5");
  EXPECT_EQ(table_error(with("column_max_tokens", "\"64\"")),
            "t.json: breakpoints.column_max_tokens: expected a non-negative integer, got \"64\"");
  EXPECT_EQ(table_error(with("fused_max_tokens", "null")),
            "t.json: breakpoints.fused_max_tokens: expected a non-negative integer, got null");
  // An unsigned value beyond int64 must not wrap into an accepted (or negative) limit.
  EXPECT_THAT(table_error(with("fused_max_tokens", "18446744073709551615")),
              StartsWith("t.json: breakpoints.fused_max_tokens: expected a non-negative integer"));
  // ±1 at the lower edge: 0 is a valid breakpoint.
  PolicyConfig config;
  lmoe::apply_tier_table(config, with("fused_max_tokens", "0"), "t.json");
  EXPECT_EQ(config.fused_max_tokens.value, 0);
}

TEST(TierTable, BreakpointsAndFlagHaveTypes) {
  EXPECT_EQ(table_error(R"({"format": "lmoe-tier-table", "version": 1, "breakpoints": [128]})"),
            "t.json: \"breakpoints\" must be an object");
  EXPECT_EQ(
      table_error(R"({"format": "lmoe-tier-table", "version": 1, "overlap_disabled": "yes"})"),
      "t.json: \"overlap_disabled\" must be true or false");
}

TEST(TierTable, NullColumnLimitMeansNoLimitFromTheTable) {
  PolicyConfig config;
  config.column_max_tokens.value = 100;
  lmoe::apply_tier_table(config, R"({"format": "lmoe-tier-table", "version": 1,
                                     "breakpoints": {"column_max_tokens": null}})",
                         "t.json");
  EXPECT_EQ(config.column_max_tokens.value, std::nullopt);
  EXPECT_EQ(config.column_max_tokens.source, SettingSource::table);
  EXPECT_EQ(config.column_max_tokens.origin, "t.json column_max_tokens");
}

TEST_F(TierTableFiles, MalformedTableFileFailsTheLoadWithItsPath) {
  const std::string path = write("bad.json", R"({"format": "lmoe-tier-table", "version": 4})");
  EXPECT_EQ(load_error({}, path),
            "table " + path + ": unsupported \"version\" 4 (this lmoe reads versions 1, 2 and 3)");
  EXPECT_EQ(load_error({{"LMOE_TIER_TABLE", path}}),
            "table " + path + ": unsupported \"version\" 4 (this lmoe reads versions 1, 2 and 3)");
}

TEST_F(TierTableFiles, MissingTableFileThrows) {
  const std::string path = (dir_ / "nope.json").string();
  EXPECT_EQ(load_error({}, path), "cannot open the tier table '" + path + "'");
  EXPECT_EQ(load_error({{"LMOE_TIER_TABLE", path}}), "cannot open the tier table '" + path + "'");
}

// ---------------------------------------------------------------------------------------------
// Breakpoints, each at −1, at, +1

TEST(TierPolicySelect, DefaultBreakpoints) {
  const PolicyConfig config = load({});
  EXPECT_EQ(tier_for(1, config), TailTier::fused);
  EXPECT_EQ(tier_for(127, config), TailTier::fused);
  EXPECT_EQ(tier_for(128, config), TailTier::fused);
  EXPECT_EQ(tier_for(129, config), TailTier::overlap);
  EXPECT_EQ(tier_for(255, config), TailTier::overlap);
  EXPECT_EQ(tier_for(256, config), TailTier::overlap);
  EXPECT_EQ(tier_for(257, config), TailTier::column);
  // Without a column limit the token tier is never preferred.
  EXPECT_EQ(tier_for(1'000'000'000, config), TailTier::column);
  EXPECT_EQ(tier_for(INT64_MAX, config), TailTier::column);
}

// On cuda where the decode kernel runs the built-in fused breakpoint is its measured range: 6 at 1
// rank (32 where the chained path runs too, below), 16 from 2 to 7 ranks; where it does not, 0 (the
// general kernel measured slower than overlap), with the reason; at 8 and 16 ranks, and on the cpu
// backend, the reference system's 128 stays; a breakpoint from the environment or a table is kept
// whatever the ranks.
TEST(TierPolicyRankDefaults, CudaBelowEightRanksTakesTheDecodeKernelsRange) {
  using lmoe::Backend;
  const std::optional<std::string> no_chained("the chained path runs on compute 9.0 only");
  const auto with_rank_defaults = [&](PolicyConfig policy, Backend backend, int ranks,
                                      const std::optional<std::string>& decode_limit) {
    return lmoe::with_rank_defaults(std::move(policy), backend, ranks, decode_limit, no_chained);
  };
  {
    // One rank: the decode kernel up to kFusedDefaultTp1Tokens, overlap above.
    const PolicyConfig config = with_rank_defaults(load({}), Backend::cuda, 1, std::nullopt);
    expect_built_in_fused_bound(config, lmoe::kFusedDefaultTp1Tokens);
    EXPECT_EQ(tier_for(256, config), TailTier::overlap);
    EXPECT_EQ(tier_for(257, config), TailTier::column);
    EXPECT_THAT(lmoe::explain(1, config, all_can_run()), HasSubstr("default for cuda at tp 1"));
    const PolicyConfig from_env =
        with_rank_defaults(load({{"LMOE_FUSED_MAX_TOKENS", "0"}}), Backend::cuda, 1, std::nullopt);
    EXPECT_EQ(from_env.fused_max_tokens.value, 0);
    EXPECT_EQ(tier_for(1, from_env), TailTier::overlap);
    // Where the decode kernel cannot run, the general kernel would: overlap instead, and why.
    const PolicyConfig without =
        with_rank_defaults(load({}), Backend::cuda, 1, std::string("more than 8 groups per SM"));
    EXPECT_EQ(without.fused_max_tokens.value, 0);
    EXPECT_EQ(tier_for(1, without), TailTier::overlap);
    EXPECT_THAT(lmoe::explain(1, without, all_can_run()),
                HasSubstr("without the decode kernel (more than 8 groups per SM)"));
    // LMOE_FUSED_DECODE=0 turns it off (before anything else is asked); a value that is not a flag
    // is an error naming it.
    setenv("LMOE_FUSED_DECODE", "0", 1);
    EXPECT_EQ(lmoe::fused_decode_limit({7168, 3584}, lmoe::DType::bf16, 2),
              std::optional<std::string>("the decode kernel is turned off (LMOE_FUSED_DECODE=0)"));
    EXPECT_EQ(lmoe::with_rank_defaults(load({}), Backend::cuda, 2, {7168, 3584}, lmoe::DType::bf16)
                  .fused_max_tokens.value,
              0);
    setenv("LMOE_FUSED_DECODE", "maybe", 1);
    EXPECT_THROW(lmoe::fused_decode_limit({7168, 3584}, lmoe::DType::bf16, 2), lmoe::Error);
    unsetenv("LMOE_FUSED_DECODE");
    EXPECT_THAT(lmoe::fused_decode_limit({7168, 3584}, lmoe::DType::bf16, 3).value_or(""),
                HasSubstr("d_model=7168 is not split into 3 stripes"));
#ifndef LMOE_HAS_CUDA
    // The dims-and-dtype form asks the decode kernel's plan; a build without CUDA has none.
    EXPECT_EQ(lmoe::fused_decode_limit({7168, 3584}, lmoe::DType::bf16),
              std::optional<std::string>("this build has no CUDA backend"));
    EXPECT_EQ(lmoe::with_rank_defaults(load({}), Backend::cuda, 1, {7168, 3584}, lmoe::DType::bf16)
                  .fused_max_tokens.value,
              0);
#endif
  }
  for (const int ranks : {2, 4, lmoe::kFusedDefaultMinRanks - 1}) {
    SCOPED_TRACE("ranks " + std::to_string(ranks));
    const PolicyConfig config = with_rank_defaults(load({}), Backend::cuda, ranks, std::nullopt);
    expect_built_in_fused_bound(config, lmoe::kFusedDefaultDecodeTokens);
    EXPECT_EQ(tier_for(256, config), TailTier::overlap);
    EXPECT_EQ(tier_for(257, config), TailTier::column);
    EXPECT_THAT(lmoe::explain(1, config, all_can_run()),
                HasSubstr("default for cuda at tp " + std::to_string(ranks) +
                          ": the decode kernel measured faster than overlap up to 16 tokens"));
    // Without the decode kernel: overlap, and why.
    const PolicyConfig without = with_rank_defaults(load({}), Backend::cuda, ranks,
                                                    std::string("the decode kernel is turned off"));
    EXPECT_EQ(without.fused_max_tokens.value, 0);
    EXPECT_EQ(tier_for(1, without), TailTier::overlap);
    EXPECT_EQ(tier_for(128, without), TailTier::overlap);
    EXPECT_THAT(lmoe::explain(1, without, all_can_run()),
                HasSubstr("default for cuda at tp " + std::to_string(ranks) +
                          " without the decode kernel (the decode kernel is turned off)"));
    // The setting's other sources rule.
    const PolicyConfig from_env = with_rank_defaults(load({{"LMOE_FUSED_MAX_TOKENS", "16"}}),
                                                     Backend::cuda, ranks, std::nullopt);
    EXPECT_EQ(from_env.fused_max_tokens.value, 16);
    EXPECT_EQ(tier_for(16, from_env), TailTier::fused);
    PolicyConfig from_table = load({});
    lmoe::apply_tier_table(from_table, R"({"format": "lmoe-tier-table", "version": 1,
        "breakpoints": {"fused_max_tokens": 64}})",
                           "t.json");
    from_table = with_rank_defaults(from_table, Backend::cuda, ranks, std::nullopt);
    EXPECT_EQ(from_table.fused_max_tokens.value, 64);
    EXPECT_EQ(tier_for(64, from_table), TailTier::fused);
  }
  for (const int ranks : {lmoe::kFusedDefaultMinRanks, 16}) {
    const PolicyConfig config = with_rank_defaults(load({}), Backend::cuda, ranks, std::nullopt);
    EXPECT_EQ(config.fused_max_tokens.value, 128);
    EXPECT_EQ(tier_for(128, config), TailTier::fused);
    EXPECT_EQ(tier_for(129, config), TailTier::overlap);
  }
  for (const int ranks : {1, 2, 8}) {
    EXPECT_EQ(
        with_rank_defaults(load({}), Backend::cpu, ranks, std::nullopt).fused_max_tokens.value,
        128);
  }
}

// One rank where the chained path runs (cuda/fused_chained_launch.hpp): fused up to
// kFusedDefaultTp1ChainedTokens, overlap above, with the reason, whether or not the decode kernel
// runs too (the chained path then takes every fused call); with several ranks it is not asked.
TEST(TierPolicyRankDefaults, CudaOneRankTakesTheChainedPathsRangeWhereItRuns) {
  using lmoe::Backend;
  for (const std::optional<std::string>& decode :
       {std::optional<std::string>(), std::optional<std::string>("more than 8 groups per SM")}) {
    const PolicyConfig config =
        lmoe::with_rank_defaults(load({}), Backend::cuda, 1, decode, std::nullopt);
    expect_built_in_fused_bound(config, lmoe::kFusedDefaultTp1ChainedTokens);
    EXPECT_THAT(lmoe::explain(1, config, all_can_run()),
                HasSubstr("default for cuda at tp 1: the chained path (every call of up to 128 "
                          "rows with one rank, but those of up to 4 where the decode kernel's "
                          "pair instance runs) measured faster than overlap up to 128 tokens"));
  }
  EXPECT_THAT(lmoe::fused_chained_limit({7168, 3584}, lmoe::DType::bf16, 3).value_or(""),
              HasSubstr("d_model=7168 is not split into 3 stripes"));
  setenv("LMOE_FUSED_CHAINED", "0", 1);
  EXPECT_EQ(lmoe::fused_chained_limit({7168, 3584}, lmoe::DType::bf16, 1),
            std::optional<std::string>("the chained path is turned off (LMOE_FUSED_CHAINED=0)"));
  setenv("LMOE_FUSED_CHAINED", "sometimes", 1);
  EXPECT_THROW(lmoe::fused_chained_limit({7168, 3584}, lmoe::DType::bf16, 1), lmoe::Error);
  unsetenv("LMOE_FUSED_CHAINED");
  // Without the latent norm the chained path does not run: the decode kernel's range (or 0).
  EXPECT_NE(lmoe::with_rank_defaults(load({}), Backend::cuda, 1, {7168, 3584}, lmoe::DType::bf16,
                                     /*latent_norm=*/false)
                .fused_max_tokens.value,
            lmoe::kFusedDefaultTp1ChainedTokens);
#ifndef LMOE_HAS_CUDA
  EXPECT_EQ(lmoe::fused_chained_limit({7168, 3584}, lmoe::DType::bf16, 1),
            std::optional<std::string>("this build has no CUDA backend"));
#endif
}

// Two to seven ranks where the chained path runs (exchange, the stripe's up-projection, gather):
// fused up to kFusedDefaultChainedTokens whether or not the decode kernel runs (the chained path
// then takes the small calls too), overlap above, with the reason; where it does not run, the
// decode kernel's range.
TEST(TierPolicyRankDefaults, CudaSeveralRanksTakeTheChainedPathsRangeWhereItRuns) {
  using lmoe::Backend;
  for (const int ranks : {2, 4, lmoe::kFusedDefaultMinRanks - 1}) {
    SCOPED_TRACE("ranks " + std::to_string(ranks));
    for (const std::optional<std::string>& decode :
         {std::optional<std::string>(), std::optional<std::string>("more than 8 groups per SM")}) {
      const PolicyConfig config =
          lmoe::with_rank_defaults(load({}), Backend::cuda, ranks, decode, std::nullopt);
      expect_built_in_fused_bound(config, lmoe::kFusedDefaultChainedTokens);
      EXPECT_THAT(lmoe::explain(1, config, all_can_run()),
                  HasSubstr("default for cuda at tp " + std::to_string(ranks) +
                            ": the decode kernel and the chained path measured faster than "
                            "overlap and column up to 64 tokens"));
    }
    EXPECT_EQ(lmoe::with_rank_defaults(load({}), Backend::cuda, ranks, std::nullopt,
                                       std::string("not compute 9.0"))
                  .fused_max_tokens.value,
              lmoe::kFusedDefaultDecodeTokens);
  }
  // From eight ranks the reference system's range stays.
  EXPECT_EQ(lmoe::with_rank_defaults(load({}), Backend::cuda, lmoe::kFusedDefaultMinRanks,
                                     std::nullopt, std::nullopt)
                .fused_max_tokens.value,
            128);
}

TEST(TierPolicySelect, ColumnLimitWhenSet) {
  const PolicyConfig config = load({{"LMOE_COLUMN_MAX_TOKENS", "1024"}});
  EXPECT_EQ(tier_for(256, config), TailTier::overlap);
  EXPECT_EQ(tier_for(257, config), TailTier::column);
  EXPECT_EQ(tier_for(1023, config), TailTier::column);
  EXPECT_EQ(tier_for(1024, config), TailTier::column);
  EXPECT_EQ(tier_for(1025, config), TailTier::token);
}

TEST(TierPolicySelect, BreakpointsFromTheEnvironment) {
  const PolicyConfig config = load({{"LMOE_FUSED_MAX_TOKENS", "16"},
                                    {"LMOE_OVERLAP_MAX_TOKENS", "48"},
                                    {"LMOE_COLUMN_MAX_TOKENS", "96"}});
  EXPECT_EQ(tier_for(15, config), TailTier::fused);
  EXPECT_EQ(tier_for(16, config), TailTier::fused);
  EXPECT_EQ(tier_for(17, config), TailTier::overlap);
  EXPECT_EQ(tier_for(47, config), TailTier::overlap);
  EXPECT_EQ(tier_for(48, config), TailTier::overlap);
  EXPECT_EQ(tier_for(49, config), TailTier::column);
  EXPECT_EQ(tier_for(95, config), TailTier::column);
  EXPECT_EQ(tier_for(96, config), TailTier::column);
  EXPECT_EQ(tier_for(97, config), TailTier::token);
}

TEST(TierPolicySelect, ZeroFusedLimitSendsEvenOneTokenOnward) {
  const PolicyConfig config = load({{"LMOE_FUSED_MAX_TOKENS", "0"}});
  EXPECT_EQ(tier_for(1, config), TailTier::overlap);
}

TEST(TierPolicySelect, PreferredTierIgnoresCapabilities) {
  const PolicyConfig config = load({{"LMOE_COLUMN_MAX_TOKENS", "1000"}});
  EXPECT_EQ(lmoe::preferred_tier(128, config), TailTier::fused);
  EXPECT_EQ(lmoe::preferred_tier(129, config), TailTier::overlap);
  EXPECT_EQ(lmoe::preferred_tier(257, config), TailTier::column);
  EXPECT_EQ(lmoe::preferred_tier(1001, config), TailTier::token);
}

TEST(TierPolicySelect, DisabledOverlapRoutesItsRangeToColumn) {
  const PolicyConfig config = load({{"LMOE_DISABLE_OVERLAP", "1"}});
  EXPECT_EQ(tier_for(128, config), TailTier::fused);
  EXPECT_EQ(tier_for(129, config), TailTier::column);
  EXPECT_EQ(tier_for(256, config), TailTier::column);
  EXPECT_EQ(tier_for(257, config), TailTier::column);
  const TierDecision decision = lmoe::decide(129, config, all_can_run());
  EXPECT_EQ(decision.summary,
            "T=129 → column (preferred: T=129 is in overlap's range but overlap is disabled "
            "(LMOE_DISABLE_OVERLAP=1))");
}

TEST(TierPolicySelect, DisabledOverlapIsNeverAFallback) {
  const PolicyConfig config = load({{"LMOE_DISABLE_OVERLAP", "1"}});
  // Fused declined: the next candidate would be overlap, but it is disabled, so column runs.
  const TierDecision decision =
      lmoe::decide(8, config, declining(TailTier::fused, "no P2P workspace"));
  ASSERT_EQ(decision.tier, std::optional<TailTier>(TailTier::column));
  ASSERT_EQ(decision.considered.size(), 4u);
  EXPECT_EQ(decision.considered[1].tier, TailTier::overlap);
  EXPECT_FALSE(decision.considered[1].chosen);
  EXPECT_EQ(decision.considered[1].reason, "declined: disabled (LMOE_DISABLE_OVERLAP=1)");
}

// ---------------------------------------------------------------------------------------------
// Forcing

TEST(TierPolicyForce, ForcedTierWinsOverTheBreakpoints) {
  for (TailTier tier : lmoe::kAllTiers) {
    const PolicyConfig config = load({{"LMOE_TIER", std::string(lmoe::tier_name(tier))}});
    for (std::int64_t tokens : {1, 128, 129, 256, 257, 100000}) {
      EXPECT_EQ(tier_for(tokens, config), tier) << lmoe::tier_name(tier) << " T=" << tokens;
    }
  }
}

TEST(TierPolicyForce, ForcedTierRecordsItsOriginAndTheOthersAreNotConsidered) {
  const PolicyConfig config = load({{"LMOE_TIER", "token"}});
  const TierDecision decision = lmoe::decide(5, config, all_can_run());
  ASSERT_EQ(decision.tier, std::optional<TailTier>(TailTier::token));
  EXPECT_EQ(decision.summary, "T=5 → token (forced: LMOE_TIER=token)");
  ASSERT_EQ(decision.considered.size(), 4u);
  EXPECT_EQ(decision.considered[0].tier, TailTier::token);
  EXPECT_TRUE(decision.considered[0].chosen);
  for (std::size_t i = 1; i < decision.considered.size(); ++i) {
    EXPECT_FALSE(decision.considered[i].chosen);
    EXPECT_EQ(decision.considered[i].reason, "not considered: a tier is forced");
  }
}

TEST(TierPolicyForce, ForcedTierThatIsDeclinedDoesNotFallBack) {
  const PolicyConfig config = load({{"LMOE_TIER", "token"}});
  const std::string why = "T=1 < tp=2 (the tier gives every rank at least one token row)";
  const TierSupport support = declining(TailTier::token, why);
  const TierDecision decision = lmoe::decide(1, config, support);
  EXPECT_EQ(decision.tier, std::nullopt);
  EXPECT_EQ(decision.summary, "T=1: forced tier token cannot run: " + why);
  ASSERT_FALSE(decision.considered.empty());
  EXPECT_EQ(decision.considered[0].reason, "forced (LMOE_TIER=token) but declined: " + why);
  EXPECT_EQ(select_error(1, config, support), "T=1: forced tier token cannot run: " + why);
  EXPECT_THAT(lmoe::explain(1, config, support), HasSubstr(why));
}

TEST(TierPolicyForce, CallerForcedTierInTheConfig) {
  PolicyConfig config;
  config.forced_tier = {TailTier::overlap, SettingSource::caller, "--tier overlap"};
  EXPECT_EQ(lmoe::decide(3, config, all_can_run()).summary,
            "T=3 → overlap (forced: --tier overlap)");
}

TEST(TierPolicyForce, ForcedTierWinsOverDisabledOverlap) {
  // The header's rule: a forced tier wins over all settings, including LMOE_DISABLE_OVERLAP.
  const PolicyConfig config = load({{"LMOE_TIER", "overlap"}, {"LMOE_DISABLE_OVERLAP", "1"}});
  EXPECT_EQ(tier_for(500, config), TailTier::overlap);
}

// ---------------------------------------------------------------------------------------------
// Declining and falling back

TEST(TierPolicyFallback, FusedDeclinedFallsBackToOverlapWithTheReason) {
  const PolicyConfig config = load({});
  const std::string why = "d_model=90 is not divisible by tp=4";
  const TierSupport support = declining(TailTier::fused, why);
  const TierDecision decision = lmoe::decide(64, config, support);
  ASSERT_EQ(decision.tier, std::optional<TailTier>(TailTier::overlap));
  ASSERT_EQ(decision.considered.size(), 4u);
  EXPECT_EQ(decision.considered[0].tier, TailTier::fused);
  EXPECT_FALSE(decision.considered[0].chosen);
  EXPECT_EQ(decision.considered[0].reason, "declined: " + why);
  EXPECT_EQ(decision.considered[1].tier, TailTier::overlap);
  EXPECT_TRUE(decision.considered[1].chosen);
  EXPECT_EQ(decision.considered[1].reason, "fallback after fused declined: " + why);
  EXPECT_EQ(decision.considered[2].reason, "not needed: overlap was chosen");
  EXPECT_EQ(decision.considered[3].reason, "not needed: overlap was chosen");
  EXPECT_EQ(decision.summary, "T=64 → overlap (fallback after fused declined: " + why + ")");

  const std::string text = lmoe::explain(64, config, support);
  EXPECT_THAT(text, HasSubstr("declined: " + why));
  EXPECT_THAT(text, HasSubstr("* overlap  fallback after fused declined"));
}

TEST(TierPolicyFallback, FallbackOrderFollowsThePreferredTier) {
  const PolicyConfig config = load({{"LMOE_COLUMN_MAX_TOKENS", "1000"}});
  // column preferred (T=500) but declined → token next.
  EXPECT_EQ(tier_for(500, config, declining(TailTier::column, "x")), TailTier::token);
  // token preferred (T=2000) but declined → column next.
  EXPECT_EQ(tier_for(2000, config, declining(TailTier::token, "x")), TailTier::column);
  // overlap preferred (T=200) but declined → column next.
  EXPECT_EQ(tier_for(200, config, declining(TailTier::overlap, "x")), TailTier::column);
  // Fused and overlap both declined for a decode batch → column.
  TierSupport both = declining(TailTier::fused, "a");
  both.declined[static_cast<std::size_t>(TailTier::overlap)] = "b";
  EXPECT_EQ(tier_for(4, config, both), TailTier::column);
}

TEST(TierPolicyFallback, NothingCanRunListsEveryReason) {
  TierSupport support;
  support.declined = {std::string("r-fused"), std::string("r-overlap"), std::string("r-column"),
                      std::string("r-token")};
  const PolicyConfig config = load({});
  const TierDecision decision = lmoe::decide(10, config, support);
  EXPECT_EQ(decision.tier, std::nullopt);
  EXPECT_EQ(decision.considered.size(), 4u);
  const std::string expected =
      "T=10: no tier can run (fused declined: r-fused; overlap declined: r-overlap; column "
      "declined: r-column; token declined: r-token)";
  EXPECT_EQ(decision.summary, expected);
  EXPECT_EQ(select_error(10, config, support), expected);
}

// ---------------------------------------------------------------------------------------------
// No work, invalid T

TEST(TierPolicyDecide, ZeroTokensIsNoWorkAndNotAnException) {
  const PolicyConfig config = load({});
  TierDecision decision;
  ASSERT_NO_THROW(decision = lmoe::decide(0, config, all_can_run()));
  EXPECT_EQ(decision.tier, std::nullopt);
  EXPECT_TRUE(decision.considered.empty());
  EXPECT_EQ(decision.summary, "T=0: no tokens, nothing to run");
  EXPECT_EQ(select_error(0, config, all_can_run()), "T=0: no tokens, nothing to run");
  // Forcing a tier does not turn "no work" into work.
  EXPECT_EQ(lmoe::decide(0, load({{"LMOE_TIER", "fused"}}), all_can_run()).tier, std::nullopt);
}

TEST(TierPolicyDecide, NegativeTokenCountIsInvalid) {
  const PolicyConfig config = load({});
  for (std::int64_t tokens : {std::int64_t{-1}, std::int64_t{-128}, INT64_MIN}) {
    const TierDecision decision = lmoe::decide(tokens, config, all_can_run());
    EXPECT_EQ(decision.tier, std::nullopt);
    EXPECT_EQ(decision.summary,
              "T=" + std::to_string(tokens) + ": a negative token count is invalid");
    EXPECT_EQ(select_error(tokens, config, all_can_run()),
              "T=" + std::to_string(tokens) + ": a negative token count is invalid");
  }
  EXPECT_EQ(lmoe::decide(-1, load({{"LMOE_TIER", "fused"}}), all_can_run()).tier, std::nullopt);
}

// ---------------------------------------------------------------------------------------------
// Ranges: any tier in any T range

using lmoe::TierRange;

PolicyConfig with_ranges(std::vector<TierRange> ranges) {
  PolicyConfig config;
  config.ranges = {std::move(ranges), SettingSource::table, "table t.json ranges"};
  return config;
}

// column, then overlap, then token: an order the breakpoints cannot express.
const std::vector<TierRange> kRanges = {
    {45, TailTier::column}, {512, TailTier::overlap}, {std::nullopt, TailTier::token}};

std::string ranges_error(const std::vector<TierRange>& ranges) {
  try {
    lmoe::validate_tier_ranges(ranges, "r");
  } catch (const lmoe::Error& error) {
    return error.message();
  }
  ADD_FAILURE() << "validate_tier_ranges accepted the ranges";
  return "<no error>";
}

TEST(TierPolicyRanges, EachPieceAtItsEdges) {
  const PolicyConfig config = with_ranges(kRanges);
  const std::vector<std::pair<std::int64_t, TailTier>> expected = {
      {1, TailTier::column},
      {44, TailTier::column},
      {45, TailTier::column},
      {46, TailTier::overlap},
      {511, TailTier::overlap},
      {512, TailTier::overlap},
      {513, TailTier::token},
      {1 << 20, TailTier::token},
      {std::numeric_limits<std::int64_t>::max(), TailTier::token}};
  for (const auto& [tokens, tier] : expected) {
    EXPECT_EQ(lmoe::preferred_tier(tokens, config), tier) << "T=" << tokens;
    EXPECT_EQ(tier_for(tokens, config), tier) << "T=" << tokens;
  }
  // The breakpoints (fused up to 128 by default) are not used while there are ranges.
  EXPECT_EQ(config.fused_max_tokens.value, 128);
  EXPECT_EQ(tier_for(100, config), TailTier::overlap);
  // One piece for every T.
  EXPECT_EQ(tier_for(3, with_ranges({{std::nullopt, TailTier::fused}})), TailTier::fused);
  EXPECT_EQ(tier_for(100000, with_ranges({{std::nullopt, TailTier::fused}})), TailTier::fused);
}

TEST(TierPolicyRanges, SummaryNamesThePieceAndItsSource) {
  const PolicyConfig config = with_ranges(kRanges);
  EXPECT_EQ(lmoe::decide(1, config, all_can_run()).summary,
            "T=1 → column (preferred: T <= 45: column, table t.json ranges)");
  EXPECT_EQ(lmoe::decide(128, config, all_can_run()).summary,
            "T=128 → overlap (preferred: 45 < T <= 512: overlap, table t.json ranges)");
  EXPECT_EQ(lmoe::decide(513, config, all_can_run()).summary,
            "T=513 → token (preferred: T > 512: token, table t.json ranges)");
  EXPECT_EQ(lmoe::decide(7, with_ranges({{std::nullopt, TailTier::fused}}), all_can_run()).summary,
            "T=7 → fused (preferred: every T: fused, table t.json ranges)");
  // No work and invalid T are said as without ranges.
  EXPECT_EQ(lmoe::decide(0, config, all_can_run()).summary, "T=0: no tokens, nothing to run");
  EXPECT_EQ(lmoe::decide(0, config, all_can_run()).tier, std::nullopt);
}

TEST(TierPolicyRanges, ADeclinedTierInsideARangeFallsBackInTheUsualOrder) {
  PolicyConfig config = with_ranges(kRanges);
  // T=100 is in overlap's piece; overlap declined: column, its first fallback, runs.
  TierDecision decision = lmoe::decide(100, config, declining(TailTier::overlap, "why-overlap"));
  EXPECT_EQ(decision.tier, TailTier::column);
  EXPECT_EQ(decision.summary, "T=100 → column (fallback after overlap declined: why-overlap)");
  ASSERT_EQ(decision.considered.size(), 4u);
  EXPECT_EQ(decision.considered[0].tier, TailTier::overlap);
  EXPECT_EQ(decision.considered[1].tier, TailTier::column);
  EXPECT_EQ(decision.considered[2].tier, TailTier::token);
  EXPECT_EQ(decision.considered[3].tier, TailTier::fused);
  // T=600 is in token's piece; token and column declined: overlap, then fused.
  TierSupport support = declining(TailTier::token, "T < tp");
  support.declined[static_cast<std::size_t>(TailTier::column)] = "why-column";
  EXPECT_EQ(tier_for(600, config, support), TailTier::overlap);
  support.declined[static_cast<std::size_t>(TailTier::overlap)] = "why-overlap";
  EXPECT_EQ(tier_for(600, config, support), TailTier::fused);
  // T=1 is in column's piece; column declined: token.
  EXPECT_EQ(tier_for(1, config, declining(TailTier::column, "why-column")), TailTier::token);
  // A disabled overlap is declined inside its piece too.
  config.overlap_disabled = {true, SettingSource::table, "t.json overlap_disabled"};
  decision = lmoe::decide(100, config, all_can_run());
  EXPECT_EQ(decision.tier, TailTier::column);
  EXPECT_EQ(decision.summary,
            "T=100 → column (fallback after overlap declined: disabled (t.json overlap_disabled))");
}

TEST(TierPolicyRanges, AForcedTierWinsOverRanges) {
  PolicyConfig config = with_ranges(kRanges);
  config.forced_tier = {TailTier::fused, SettingSource::caller, "caller"};
  EXPECT_EQ(tier_for(600, config), TailTier::fused);
  EXPECT_EQ(tier_for(1, config), TailTier::fused);
  EXPECT_THAT(lmoe::explain(600, config, all_can_run()),
              HasSubstr("rule: a forced tier, fused (caller); neither ranges nor breakpoints are "
                        "used\n"));
}

TEST(TierPolicyRanges, MalformedRangesAreErrorsNamingTheField) {
  EXPECT_EQ(ranges_error({}), "r: expected at least one piece, got none");
  EXPECT_EQ(
      ranges_error(
          {{512, TailTier::overlap}, {45, TailTier::column}, {std::nullopt, TailTier::token}}),
      "r[1].max_tokens: expected more than the previous piece's 512 (pieces rise in T), got "
      "45");
  EXPECT_EQ(ranges_error(
                {{45, TailTier::overlap}, {45, TailTier::column}, {std::nullopt, TailTier::token}}),
            "r[1].max_tokens: expected more than the previous piece's 45 (pieces rise in T), got "
            "45");
  EXPECT_EQ(ranges_error({{0, TailTier::fused}, {std::nullopt, TailTier::token}}),
            "r[0].max_tokens: expected an integer >= 1 (or null for the last piece), got 0");
  EXPECT_EQ(ranges_error({{-5, TailTier::fused}, {std::nullopt, TailTier::token}}),
            "r[0].max_tokens: expected an integer >= 1 (or null for the last piece), got -5");
  EXPECT_EQ(ranges_error({{45, TailTier::column}, {512, TailTier::overlap}}),
            "r[1].max_tokens: the last piece must be unbounded (null) so that every T has a tier, "
            "got 512");
  EXPECT_EQ(ranges_error({{std::nullopt, TailTier::column}, {std::nullopt, TailTier::token}}),
            "r[0].max_tokens: only the last piece may be unbounded (null); 1 piece(s) follow it");
  // ±1 at the lower edge: 1 is a valid bound; and the well-formed lists pass.
  EXPECT_NO_THROW(lmoe::validate_tier_ranges(
      std::vector<TierRange>{{1, TailTier::fused}, {std::nullopt, TailTier::token}}, "r"));
  EXPECT_NO_THROW(lmoe::validate_tier_ranges(kRanges, "r"));
  EXPECT_NO_THROW(
      lmoe::validate_tier_ranges(std::vector<TierRange>{{std::nullopt, TailTier::column}}, "r"));
}

TEST(TierPolicyRanges, Described) {
  EXPECT_EQ(lmoe::describe_tier_ranges(kRanges), "column T<=45, overlap T<=512, token above");
  EXPECT_EQ(lmoe::describe_tier_ranges(std::vector<TierRange>{{std::nullopt, TailTier::token}}),
            "token for every T");
}

TEST(TierPolicyRanges, ExplainSaysWhichRuleRules) {
  const std::string with = lmoe::explain(128, with_ranges(kRanges), all_can_run());
  EXPECT_THAT(with, StartsWith("decision: T=128 → overlap (preferred: 45 < T <= 512: overlap, "
                               "table t.json ranges)\n"));
  EXPECT_THAT(with, HasSubstr("rule: ranges column T<=45, overlap T<=512, token above (table "
                              "t.json ranges); the breakpoints are not used\n"));
  EXPECT_THAT(with, HasSubstr("  ranges              column T<=45, overlap T<=512, token above "
                              "table t.json ranges\n"));
  const std::string without = lmoe::explain(128, load({}), all_can_run());
  EXPECT_THAT(without, HasSubstr("rule: breakpoints\n"));
  EXPECT_THAT(without, HasSubstr("  ranges              none    default: none\n"));
}

TEST(TierPolicyRanges, ATableOfVersion1WithBreakpointsClearsEarlierRanges) {
  PolicyConfig config = with_ranges(kRanges);
  // Only the flag: the ranges stay.
  lmoe::apply_tier_table(config, R"({"format": "lmoe-tier-table", "version": 1,
                                     "overlap_disabled": false})",
                         "v1.json");
  EXPECT_EQ(config.ranges.value, kRanges);
  // Breakpoints: they are meant to rule, so the ranges go.
  lmoe::apply_tier_table(config, R"({"format": "lmoe-tier-table", "version": 1,
                                     "breakpoints": {"fused_max_tokens": 8}})",
                         "v1.json");
  EXPECT_TRUE(config.ranges.value.empty());
  EXPECT_EQ(config.ranges.origin, "v1.json: none (version 1)");
  EXPECT_EQ(tier_for(8, config), TailTier::fused);
  EXPECT_EQ(tier_for(9, config), TailTier::overlap);
}

// ---------------------------------------------------------------------------------------------
// Purity and the explanation

bool same_decision(const TierDecision& a, const TierDecision& b) {
  if (a.tier != b.tier || a.summary != b.summary || a.considered.size() != b.considered.size()) {
    return false;
  }
  for (std::size_t i = 0; i < a.considered.size(); ++i) {
    if (a.considered[i].tier != b.considered[i].tier ||
        a.considered[i].chosen != b.considered[i].chosen ||
        a.considered[i].reason != b.considered[i].reason) {
      return false;
    }
  }
  return true;
}

TEST(TierPolicyDecide, IsPure) {
  const PolicyConfig config = load({{"LMOE_COLUMN_MAX_TOKENS", "1000"}});
  const TierSupport support = declining(TailTier::fused, "no workspace");
  const std::vector<std::int64_t> tokens = {-1, 0, 1, 128, 129, 256, 257, 1000, 1001};
  std::vector<TierDecision> first;
  for (std::int64_t t : tokens) first.push_back(lmoe::decide(t, config, support));
  // Again in reverse order, interleaved with other configurations: nothing carries over.
  for (std::size_t i = tokens.size(); i-- > 0;) {
    (void)lmoe::decide(tokens[i], load({{"LMOE_TIER", "token"}}), all_can_run());
    EXPECT_TRUE(same_decision(lmoe::decide(tokens[i], config, support), first[i]))
        << "T=" << tokens[i];
    EXPECT_EQ(lmoe::explain(tokens[i], config, support), lmoe::explain(tokens[i], config, support));
  }
}

TEST_F(TierTableFiles, ExplainNamesEveryTierAndEverySource) {
  const std::string path = write("tiers.json", R"({"format": "lmoe-tier-table", "version": 1,
      "breakpoints": {"overlap_max_tokens": 300}})");
  const PolicyConfig config = load({{"LMOE_FUSED_MAX_TOKENS", "64"}}, path);
  // T=50 prefers fused (limit 64 from the environment), which is declined: overlap (limit from the
  // table) takes it, and the column limit is still the built-in one.
  const std::string text = lmoe::explain(50, config, declining(TailTier::fused, "why-fused"));
  EXPECT_THAT(text,
              StartsWith("decision: T=50 → overlap (fallback after fused declined: why-fused)\n"));
  EXPECT_THAT(text, HasSubstr("precedence: default < table < environment; a forced tier wins"));
  EXPECT_THAT(text, HasSubstr("fused_max_tokens    64      LMOE_FUSED_MAX_TOKENS=64\n"));
  EXPECT_THAT(text,
              HasSubstr("overlap_max_tokens  300     table " + path + " overlap_max_tokens\n"));
  EXPECT_THAT(text, HasSubstr("column_max_tokens   none    default: the token tier is off\n"));
  EXPECT_THAT(text, HasSubstr("tier_table          " + path));
  const std::string tiers = text.substr(text.find("tiers:\n"));
  for (TailTier tier : lmoe::kAllTiers) {
    std::string word(lmoe::tier_name(tier));
    word.insert(word.begin(), ' ');  // not `" " + name`: GCC 12 -O2 raises a false -Wrestrict on it
    word.push_back(' ');
    EXPECT_THAT(tiers, HasSubstr(word)) << word;
  }
  EXPECT_THAT(tiers, HasSubstr("    fused    declined: why-fused\n"));
  EXPECT_THAT(tiers, HasSubstr("  * overlap  fallback after fused declined: why-fused\n"));
}

TEST(TierPolicyDecide, SummaryNamesTheBreakpointAndItsSource) {
  const PolicyConfig config = load({});
  EXPECT_EQ(lmoe::decide(64, config, all_can_run()).summary,
            "T=64 → fused (preferred: T=64 <= fused_max_tokens=128 (default))");
  EXPECT_EQ(lmoe::decide(257, config, all_can_run()).summary,
            "T=257 → column (preferred: T=257 > every smaller tier's limit; column_max_tokens=none "
            "(default: the token tier is off))");
  const PolicyConfig limited = load({{"LMOE_COLUMN_MAX_TOKENS", "300"}});
  EXPECT_EQ(
      lmoe::decide(301, limited, all_can_run()).summary,
      "T=301 → token (preferred: T=301 > column_max_tokens=300 (LMOE_COLUMN_MAX_TOKENS=300))");
}

TEST(TierPolicyNames, SourcesAndTiers) {
  EXPECT_EQ(lmoe::setting_source_name(SettingSource::built_in), "default");
  EXPECT_EQ(lmoe::setting_source_name(SettingSource::table), "table");
  EXPECT_EQ(lmoe::setting_source_name(SettingSource::environment), "environment");
  EXPECT_EQ(lmoe::setting_source_name(SettingSource::caller), "caller");
  for (TailTier tier : lmoe::kAllTiers) EXPECT_EQ(lmoe::parse_tier(lmoe::tier_name(tier)), tier);
  try {
    lmoe::parse_tier("auto");  // "auto" is only for parse_tier_or_auto
    FAIL() << "no throw";
  } catch (const lmoe::Error& error) {
    EXPECT_EQ(error.message(), "unknown tier 'auto': expected fused, overlap, column or token");
  }
}

}  // namespace

// The tier tables built into lmoe (src/models/<model>/tier_tables/*.json): each reads as a measured
// table, and with_shipped_tier_table uses one exactly where its configuration runs and nothing of
// the choice of tier was set.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "lmoe/tier_policy.hpp"
#include "lmoe/tools/tier_tuning.hpp"
#include "tier_table_files.hpp"

namespace {

using lmoe_test::running_like;

using lmoe::PolicyConfig;
using lmoe::SettingSource;
using ::testing::HasSubstr;

lmoe::TierTable read(const lmoe::ShippedTierTable& shipped) {
  return lmoe::read_tier_table(std::string(shipped.json), std::string(shipped.name));
}

// Nothing of `policy`'s choice of tier came from a table.
void expect_untouched(const PolicyConfig& policy) {
  EXPECT_EQ(policy.table, nullptr);
  EXPECT_FALSE(policy.table_path.has_value());
  EXPECT_TRUE(policy.ranges.value.empty());
  EXPECT_NE(policy.fused_max_tokens.source, SettingSource::table);
  EXPECT_NE(policy.overlap_max_tokens.source, SettingSource::table);
  EXPECT_NE(policy.column_max_tokens.source, SettingSource::table);
}

TEST(ShippedTierTables, EachReadsAsAMeasuredTableOfItsModelsFolder) {
  const auto tables = lmoe::shipped_tier_tables();
  std::vector<std::string> names;
  for (const lmoe::ShippedTierTable& shipped : tables) {
    SCOPED_TRACE(std::string(shipped.name));
    names.emplace_back(shipped.name);
    EXPECT_THAT(std::string(shipped.name),
                ::testing::MatchesRegex("[a-z0-9_]+/tier_tables/[a-z0-9_]+\\.json"));
    const lmoe::TierTable table = read(shipped);
    EXPECT_FALSE(table.provenance.comm.empty());
    EXPECT_FALSE(table.grid.empty());
    ASSERT_FALSE(table.ranges.empty());  // version 3: the ranges rule
    lmoe::validate_tier_ranges(table.ranges, std::string(shipped.name));
  }
  // The K3 measurements on two H200s (docs/tuning.md), both comms.
  EXPECT_THAT(names, ::testing::IsSupersetOf({"kimi_k3/tier_tables/h200x2_tp2_nccl.json",
                                              "kimi_k3/tier_tables/h200x2_tp2_p2p.json"}));
  // No two tables hold for one configuration (the first match would hide the other).
  for (std::size_t i = 0; i < tables.size(); ++i) {
    for (std::size_t j = i + 1; j < tables.size(); ++j) {
      const lmoe::TableProvenance a = read(tables[i]).provenance, b = read(tables[j]).provenance;
      EXPECT_FALSE(a.backend == b.backend && a.tp == b.tp && a.dims.d_model == b.dims.d_model &&
                   a.dims.d_latent == b.dims.d_latent && a.dtype == b.dtype && a.comm == b.comm &&
                   a.gpu.has_value() == b.gpu.has_value() &&
                   (!a.gpu || (a.gpu->name == b.gpu->name &&
                               a.gpu->compute_capability == b.gpu->compute_capability)))
          << tables[i].name << " and " << tables[j].name;
    }
  }
}

TEST(ShippedTierTables, TheLibraryHoldsEachFileOfTheSourceTreeByteForByte) {
  // Every src/models/<model>/tier_tables/*.json, and nothing else, as the file reads.
  std::vector<std::string> files;
  for (const auto& model : std::filesystem::directory_iterator(LMOE_MODELS_DIR)) {
    const std::filesystem::path dir = model.path() / "tier_tables";
    if (!std::filesystem::is_directory(dir)) continue;
    for (const auto& file : std::filesystem::directory_iterator(dir)) {
      if (file.path().extension() == ".json") {
        files.push_back(std::filesystem::relative(file.path(), LMOE_MODELS_DIR).generic_string());
      }
    }
  }
  std::sort(files.begin(), files.end());
  std::vector<std::string> shipped;
  for (const lmoe::ShippedTierTable& table : lmoe::shipped_tier_tables()) {
    shipped.emplace_back(table.name);
    std::ifstream in(std::filesystem::path(LMOE_MODELS_DIR) / table.name, std::ios::binary);
    const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    EXPECT_EQ(text, table.json) << table.name;
  }
  EXPECT_EQ(shipped, files);
}

TEST(ShippedTierTables, ATableChoosesWhereItsConfigurationRuns) {
  for (const lmoe::ShippedTierTable& shipped : lmoe::shipped_tier_tables()) {
    SCOPED_TRACE(std::string(shipped.name));
    const lmoe::TierTable table = read(shipped);
    const PolicyConfig policy =
        lmoe::with_shipped_tier_table(PolicyConfig{}, running_like(table.provenance));
    ASSERT_NE(policy.table, nullptr);
    EXPECT_TRUE(policy.table->provenance == table.provenance);
    EXPECT_EQ(policy.ranges.value, table.ranges);
    EXPECT_EQ(policy.ranges.source, SettingSource::table);
    EXPECT_EQ(policy.fused_max_tokens.value, table.breakpoints.fused_max_tokens);
    EXPECT_EQ(policy.table_path, "shipped table " + std::string(shipped.name));
    EXPECT_THAT(policy.ranges.origin, HasSubstr(std::string(shipped.name)));
    // Other software versions only warn (the caller's match_tier_table): the table still holds.
    lmoe::RunningConfig newer = running_like(table.provenance);
    newer.driver_version = "999.1";
    newer.nccl_version = "9.9.9";
    newer.lmoe_version = "9.9.9";
    EXPECT_NE(lmoe::with_shipped_tier_table(PolicyConfig{}, newer).table, nullptr);
  }
}

TEST(ShippedTierTables, NoTableWhereAnotherConfigurationRuns) {
  for (const lmoe::ShippedTierTable& shipped : lmoe::shipped_tier_tables()) {
    SCOPED_TRACE(std::string(shipped.name));
    const lmoe::TableProvenance p = read(shipped).provenance;
    std::vector<lmoe::RunningConfig> elsewhere(8, running_like(p));
    elsewhere[0].tp = p.tp * 2;
    elsewhere[1].dims.d_model += 8;
    elsewhere[2].dtype = p.dtype == lmoe::DType::bf16 ? lmoe::DType::f16 : lmoe::DType::bf16;
    elsewhere[3].comm = p.comm + "-other";
    elsewhere[4].comm.reset();  // the comm not known: no table is assumed to hold
    elsewhere[5].backend = lmoe::Backend::cpu;
    elsewhere[6].gpu.reset();        // no GPU known here: a GPU's table does not hold
    elsewhere[7].ranks_per_gpu = 2;  // ranks sharing a GPU: measured with one rank per GPU
    if (p.gpu) {
      elsewhere.push_back(running_like(p));
      elsewhere.back().gpu->name += " NVL";
    }
    for (const lmoe::RunningConfig& running : elsewhere) {
      expect_untouched(lmoe::with_shipped_tier_table(PolicyConfig{}, running));
    }
  }
}

TEST(ShippedTierTables, ASettingOfTheUserKeepsThemOut) {
  const auto tables = lmoe::shipped_tier_tables();
  ASSERT_FALSE(tables.empty());
  const lmoe::RunningConfig running = running_like(read(tables.front()).provenance);
  // A breakpoint of the environment.
  PolicyConfig from_env =
      lmoe::load_policy_config(lmoe_test::fake_env({{"LMOE_COLUMN_MAX_TOKENS", "64"}}));
  from_env = lmoe::with_shipped_tier_table(from_env, running);
  expect_untouched(from_env);
  EXPECT_EQ(from_env.column_max_tokens.value, 64);
  // The caller's ranges.
  PolicyConfig caller;
  caller.ranges = {{{std::nullopt, lmoe::TailTier::overlap}}, SettingSource::caller, "test"};
  caller = lmoe::with_shipped_tier_table(caller, running);
  EXPECT_EQ(caller.table, nullptr);
  ASSERT_EQ(caller.ranges.value.size(), 1u);
  EXPECT_EQ(caller.ranges.value[0].tier, lmoe::TailTier::overlap);
  // A table of the user's (version 1: breakpoints only) stays the one that rules.
  PolicyConfig user;
  lmoe::apply_tier_table(
      user,
      R"({"format": "lmoe-tier-table", "version": 1, "breakpoints": {"fused_max_tokens": 3}})",
      "user.json");
  user.table_path = "user.json";
  user = lmoe::with_shipped_tier_table(user, running);
  EXPECT_EQ(user.table, nullptr);
  EXPECT_EQ(user.table_path, "user.json");
  EXPECT_EQ(user.fused_max_tokens.value, 3);
  // LMOE_DISABLE_OVERLAP, which sets a table's ranges aside as the breakpoint variables do.
  const PolicyConfig disabled = lmoe::with_shipped_tier_table(
      lmoe::load_policy_config(lmoe_test::fake_env({{"LMOE_DISABLE_OVERLAP", "1"}})), running);
  expect_untouched(disabled);
  EXPECT_TRUE(disabled.overlap_disabled.value);
  // A forced tier wins over any rule; the table still describes the rest.
  const PolicyConfig forced = lmoe::with_shipped_tier_table(
      lmoe::load_policy_config(lmoe_test::fake_env({{"LMOE_TIER", "token"}})), running);
  EXPECT_NE(forced.table, nullptr);
  EXPECT_EQ(forced.forced_tier.value, lmoe::TailTier::token);
}

TEST(ShippedTierTables, NotWithTheDecodeKernelTurnedOff) {
  // The fused ranges were measured with the decode kernel; LMOE_FUSED_DECODE=0 turns it off.
  const auto tables = lmoe::shipped_tier_tables();
  ASSERT_FALSE(tables.empty());
  const lmoe::RunningConfig running = running_like(read(tables.front()).provenance);
  ASSERT_EQ(::setenv("LMOE_FUSED_DECODE", "0", 1), 0);
  const PolicyConfig off = lmoe::with_shipped_tier_table(PolicyConfig{}, running);
  ASSERT_EQ(::unsetenv("LMOE_FUSED_DECODE"), 0);
  expect_untouched(off);
  EXPECT_NE(lmoe::with_shipped_tier_table(PolicyConfig{}, running).table, nullptr);
}

}  // namespace

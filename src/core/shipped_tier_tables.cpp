// Tier tables built into lmoe: which one holds for a running configuration. The tables themselves
// are the files src/models/<model>/tier_tables/*.json, compiled in as text by src/CMakeLists.txt
// (shipped_tier_tables() is generated there).
#include "lmoe/error.hpp"
#include "lmoe/tier_tuning.hpp"

namespace lmoe {

namespace {

// Every setting that shapes the ranges or breakpoints is built in (LMOE_DISABLE_OVERLAP counts: it
// sets a table's ranges aside too, docs/tuning.md), and no table was loaded.
bool choice_untouched(const PolicyConfig& policy) {
  const auto built_in = [](const auto& setting) {
    return setting.source == SettingSource::built_in;
  };
  return built_in(policy.fused_max_tokens) && built_in(policy.overlap_max_tokens) &&
         built_in(policy.column_max_tokens) && built_in(policy.overlap_disabled) &&
         built_in(policy.ranges) && !policy.table && !policy.table_path;
}

}  // namespace

PolicyConfig with_shipped_tier_table(PolicyConfig policy, const RunningConfig& running) {
  if (!choice_untouched(policy) || !running.comm) return policy;
  for (const ShippedTierTable& shipped : shipped_tier_tables()) {
    const std::string origin = "shipped table " + std::string(shipped.name);
    const TierTable table = read_tier_table(std::string(shipped.json), origin);
    if (table.provenance.gpu && !running.gpu) continue;  // a GPU's table, and no GPU known here
    try {
      match_tier_table(table.provenance, running, origin);
    } catch (const Error&) {
      continue;  // measured for another configuration
    }
    apply_tier_table(policy, std::string(shipped.json), origin);
    policy.table_path = origin;
    return policy;
  }
  return policy;
}

}  // namespace lmoe

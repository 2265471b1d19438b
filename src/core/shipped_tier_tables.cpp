// Tier tables built into lmoe: which one holds for a running configuration. The tables themselves
// are the files src/models/<model>/tier_tables/*.json, compiled in as text by src/CMakeLists.txt
// (shipped_tier_tables() is generated there).
#include "lmoe/tier_table.hpp"

#include <vector>

#include "lmoe/error.hpp"
#include "lmoe/fused_defaults.hpp"

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

// Each shipped table's provenance, read once (every LatentTail asks).
const std::vector<TableProvenance>& shipped_provenances() {
  static const std::vector<TableProvenance> provenances = [] {
    std::vector<TableProvenance> read;
    for (const ShippedTierTable& shipped : shipped_tier_tables()) {
      read.push_back(
          read_tier_table(std::string(shipped.json), std::string(shipped.name)).provenance);
    }
    return read;
  }();
  return provenances;
}

}  // namespace

PolicyConfig with_shipped_tier_table(PolicyConfig policy, const RunningConfig& running) {
  // The tables' fused ranges were measured with the decode kernel, and with one rank per GPU: not
  // with it turned off, nor for ranks that share a GPU.
  if (!choice_untouched(policy) || !running.comm || fused_decode_turned_off() ||
      running.ranks_per_gpu > 1) {
    return policy;
  }
  const std::span<const ShippedTierTable> tables = shipped_tier_tables();
  for (std::size_t i = 0; i < tables.size(); ++i) {
    const ShippedTierTable& shipped = tables[i];
    const std::string origin = "shipped table " + std::string(shipped.name);
    const TableProvenance& table = shipped_provenances()[i];
    if (table.gpu && !running.gpu) continue;  // a GPU's table, and no GPU known here
    try {
      match_tier_table(table, running, origin);
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

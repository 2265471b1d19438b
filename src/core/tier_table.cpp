// Tier tables: JSON files that set the policy's breakpoints (written by hand or, later, by
// `lmoe tune`). Schema, version 1:
//   {"format": "lmoe-tier-table", "version": 1,
//    "breakpoints": {"fused_max_tokens": 128, "overlap_max_tokens": 256, "column_max_tokens": null},
//    "overlap_disabled": false, ... any further keys (measurements, hardware) are kept for tools}
// Every breakpoint is optional; an unknown breakpoint name is an error (it is most likely a typo).
#include <nlohmann/json.hpp>

#include "lmoe/error.hpp"
#include "lmoe/tier_policy.hpp"

namespace lmoe {

namespace {

std::int64_t token_count(const nlohmann::json& value, const std::string& where) {
  if (!value.is_number_integer() || value.get<std::int64_t>() < 0) {
    throw Error(where + ": expected a non-negative integer, got " + value.dump());
  }
  return value.get<std::int64_t>();
}

}  // namespace

void apply_tier_table(PolicyConfig& config, const std::string& json_text, const std::string& origin) {
  nlohmann::json table;
  try {
    table = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::exception& error) {
    throw Error(origin + ": not valid JSON: " + error.what());
  }
  if (!table.is_object()) throw Error(origin + ": expected a JSON object at the top level");
  if (table.value("format", std::string()) != "lmoe-tier-table") {
    throw Error(origin + ": \"format\" must be \"lmoe-tier-table\"");
  }
  if (!table.contains("version") || table["version"] != 1) {
    throw Error(origin + ": unsupported \"version\" " + table.value("version", nlohmann::json()).dump() +
                " (this lmoe reads version 1)");
  }
  auto set = [&](auto& setting, auto value, const std::string& key) {
    setting.value = value;
    setting.source = SettingSource::table;
    setting.origin = origin + " " + key;
  };
  if (table.contains("breakpoints")) {
    const nlohmann::json& breakpoints = table["breakpoints"];
    if (!breakpoints.is_object()) throw Error(origin + ": \"breakpoints\" must be an object");
    for (const auto& [key, value] : breakpoints.items()) {
      const std::string where = origin + ": breakpoints." + key;
      if (key == "fused_max_tokens") {
        set(config.fused_max_tokens, token_count(value, where), key);
      } else if (key == "overlap_max_tokens") {
        set(config.overlap_max_tokens, token_count(value, where), key);
      } else if (key == "column_max_tokens") {
        set(config.column_max_tokens,
            value.is_null() ? std::optional<std::int64_t>() : std::optional(token_count(value, where)),
            key);
      } else {
        throw Error(where + ": unknown breakpoint (expected fused_max_tokens, overlap_max_tokens or "
                    "column_max_tokens)");
      }
    }
  }
  if (table.contains("overlap_disabled")) {
    if (!table["overlap_disabled"].is_boolean()) {
      throw Error(origin + ": \"overlap_disabled\" must be true or false");
    }
    set(config.overlap_disabled, table["overlap_disabled"].get<bool>(), "overlap_disabled");
  }
}

}  // namespace lmoe

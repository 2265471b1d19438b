#include "lmoe/tier_policy.hpp"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>

#include "core/env_flag.hpp"
#include "lmoe/error.hpp"
#include "lmoe/settings.hpp"
#include "lmoe/tier_table.hpp"

namespace lmoe {

std::string_view setting_source_name(SettingSource source) {
  switch (source) {
    case SettingSource::built_in: return "default";
    case SettingSource::table: return "table";
    case SettingSource::environment: return "environment";
    case SettingSource::caller: return "caller";
  }
  return "?";
}

namespace {

// An unset or empty variable leaves the setting as it was.
std::optional<std::string> read_variable(const EnvLookup& env, const std::string& name) {
  return setting_text(name, env);
}

std::string describe_limit(const Setting<std::optional<std::int64_t>>& setting) {
  return setting.value ? std::to_string(*setting.value) : std::string("none");
}

template <typename T>
std::string origin_of(const Setting<T>& setting) {
  return setting.origin.empty() ? std::string(setting_source_name(setting.source)) : setting.origin;
}

struct Preference {
  TailTier tier;
  std::string why;
};

// "45 < T <= 512" for piece i of the ranges.
std::string piece_text(std::span<const TierRange> ranges, std::size_t i) {
  const std::optional<std::int64_t> low = i > 0 ? ranges[i - 1].max_tokens : std::nullopt;
  const std::optional<std::int64_t> high = ranges[i].max_tokens;
  if (low && high) return std::to_string(*low) + " < T <= " + std::to_string(*high);
  if (high) return "T <= " + std::to_string(*high);
  if (low) return "T > " + std::to_string(*low);
  return "every T";
}

Preference prefer_by_ranges(std::int64_t num_tokens, const PolicyConfig& config) {
  const std::vector<TierRange>& ranges = config.ranges.value;
  std::size_t piece = ranges.size() - 1;
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    if (!ranges[i].max_tokens || num_tokens <= *ranges[i].max_tokens) {
      piece = i;
      break;
    }
  }
  return {ranges[piece].tier, piece_text(ranges, piece) + ": " +
                                  std::string(tier_name(ranges[piece].tier)) + ", " +
                                  origin_of(config.ranges)};
}

Preference prefer(std::int64_t num_tokens, const PolicyConfig& config) {
  if (!config.ranges.value.empty()) return prefer_by_ranges(num_tokens, config);
  const std::string t = "T=" + std::to_string(num_tokens);
  if (num_tokens <= config.fused_max_tokens.value) {
    return {TailTier::fused,
            t + " <= fused_max_tokens=" + std::to_string(config.fused_max_tokens.value) + " (" +
                origin_of(config.fused_max_tokens) + ")"};
  }
  if (num_tokens <= config.overlap_max_tokens.value) {
    if (!config.overlap_disabled.value) {
      return {TailTier::overlap,
              t + " <= overlap_max_tokens=" + std::to_string(config.overlap_max_tokens.value) +
                  " (" + origin_of(config.overlap_max_tokens) + ")"};
    }
  }
  const auto& column_max = config.column_max_tokens;
  if (!column_max.value || num_tokens <= *column_max.value) {
    std::string why = column_max.value
                          ? t + " <= column_max_tokens=" + describe_limit(column_max) + " (" +
                                origin_of(column_max) + ")"
                          : t + " > every smaller tier's limit; column_max_tokens=none (" +
                                origin_of(column_max) + ")";
    if (num_tokens <= config.overlap_max_tokens.value && config.overlap_disabled.value) {
      why = t + " is in overlap's range but overlap is disabled (" +
            origin_of(config.overlap_disabled) + ")";
    }
    return {TailTier::column, why};
  }
  return {TailTier::token, t + " > column_max_tokens=" + describe_limit(column_max) + " (" +
                               origin_of(column_max) + ")"};
}

// Where to go when the preferred tier cannot run: the nearest tier in cost model first.
std::vector<TailTier> fallback_order(TailTier preferred) {
  switch (preferred) {
    case TailTier::fused: return {TailTier::overlap, TailTier::column, TailTier::token};
    case TailTier::overlap: return {TailTier::column, TailTier::token, TailTier::fused};
    case TailTier::column: return {TailTier::token, TailTier::overlap, TailTier::fused};
    case TailTier::token: return {TailTier::column, TailTier::overlap, TailTier::fused};
  }
  return {};
}

}  // namespace

void validate_tier_ranges(std::span<const TierRange> ranges, const std::string& where) {
  if (ranges.empty()) throw Error(where + ": expected at least one piece, got none");
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    const std::string at = where + "[" + std::to_string(i) + "].max_tokens";
    const std::optional<std::int64_t> max_tokens = ranges[i].max_tokens;
    const bool last = i + 1 == ranges.size();
    if (!max_tokens) {
      if (!last) {
        throw Error(at + ": only the last piece may be unbounded (null); " +
                    std::to_string(ranges.size() - 1 - i) + " piece(s) follow it");
      }
      continue;
    }
    if (*max_tokens < 1) {
      throw Error(at + ": expected an integer >= 1 (or null for the last piece), got " +
                  std::to_string(*max_tokens));
    }
    if (i > 0 && *max_tokens <= *ranges[i - 1].max_tokens) {
      throw Error(at + ": expected more than the previous piece's " +
                  std::to_string(*ranges[i - 1].max_tokens) + " (pieces rise in T), got " +
                  std::to_string(*max_tokens));
    }
    if (last) {
      throw Error(at +
                  ": the last piece must be unbounded (null) so that every T has a tier, got " +
                  std::to_string(*max_tokens));
    }
  }
}

std::string describe_tier_ranges(std::span<const TierRange> ranges) {
  if (ranges.size() == 1 && !ranges[0].max_tokens) {
    return std::string(tier_name(ranges[0].tier)) + " for every T";
  }
  std::string text;
  for (const TierRange& piece : ranges) {
    if (!text.empty()) text += ", ";
    text += std::string(tier_name(piece.tier)) +
            (piece.max_tokens ? " T<=" + std::to_string(*piece.max_tokens) : " above");
  }
  return text;
}

PolicyConfig load_policy_config(const EnvLookup& env,
                                const std::optional<std::string>& table_path) {
  PolicyConfig config;

  std::optional<std::string> path = table_path;
  if (!path || path->empty()) path = read_variable(env, "LMOE_TIER_TABLE");
  if (path) {
    std::ifstream file(*path, std::ios::binary);
    if (!file) throw Error("cannot open the tier table '" + *path + "'");
    std::stringstream text;
    text << file.rdbuf();
    apply_tier_table(config, text.str(), "table " + *path);
    config.table_path = *path;
  }

  auto from_env = [&](auto& setting, const std::string& name, auto parse) {
    if (auto text = read_variable(env, name)) {
      setting.value = parse(name, *text);
      setting.source = SettingSource::environment;
      setting.origin = name + "=" + *text;
    }
  };
  // A user who sets a breakpoint means the breakpoints to rule: ranges would hide the variable.
  std::string breakpoint_variables;
  for (const char* name : {"LMOE_FUSED_MAX_TOKENS", "LMOE_OVERLAP_MAX_TOKENS",
                           "LMOE_COLUMN_MAX_TOKENS", "LMOE_DISABLE_OVERLAP"}) {
    if (auto text = read_variable(env, name)) {
      breakpoint_variables +=
          (breakpoint_variables.empty() ? "" : ", ") + std::string(name) + "=" + *text;
    }
  }
  from_env(config.fused_max_tokens, "LMOE_FUSED_MAX_TOKENS", parse_setting_tokens);
  from_env(config.overlap_max_tokens, "LMOE_OVERLAP_MAX_TOKENS", parse_setting_tokens);
  from_env(config.column_max_tokens, "LMOE_COLUMN_MAX_TOKENS",
           [](const std::string& name, const std::string& text) -> std::optional<std::int64_t> {
             if (ascii_lowercase(text) == "none") return std::nullopt;
             return parse_setting_tokens(name, text);
           });
  from_env(config.overlap_disabled, "LMOE_DISABLE_OVERLAP", parse_flag);
  from_env(config.forced_tier, "LMOE_TIER",
           [](const std::string& name, const std::string& text) -> std::optional<TailTier> {
             try {
               return parse_tier_or_auto(text);
             } catch (const Error& error) {
               throw Error(name + "='" + text + "': " + error.message());
             }
           });
  if (!breakpoint_variables.empty() && !config.ranges.value.empty()) {
    config.ranges.origin = "set aside by " + breakpoint_variables + " (were " +
                           describe_tier_ranges(config.ranges.value) + ", " +
                           origin_of(config.ranges) + ")";
    config.ranges.value.clear();
    config.ranges.source = SettingSource::environment;
    config.ranges_set_aside = breakpoint_variables;
  }
  return config;
}

TailTier preferred_tier(std::int64_t num_tokens, const PolicyConfig& config) {
  return prefer(num_tokens, config).tier;
}

TierDecision decide(std::int64_t num_tokens, const PolicyConfig& config,
                    const TierSupport& support) {
  TierDecision decision;
  const std::string t = "T=" + std::to_string(num_tokens);
  auto declined_reason = [&](TailTier tier) -> std::optional<std::string> {
    if (tier == TailTier::overlap && config.overlap_disabled.value) {
      return "disabled (" + origin_of(config.overlap_disabled) + ")";
    }
    return support.declined[static_cast<std::size_t>(tier)];
  };

  if (num_tokens < 0) {
    decision.summary = t + ": a negative token count is invalid";
    return decision;
  }
  if (num_tokens == 0) {
    decision.summary = t + ": no tokens, nothing to run";
    return decision;
  }

  if (const auto& forced = config.forced_tier; forced.value) {
    const TailTier tier = *forced.value;
    auto declined = support.declined[static_cast<std::size_t>(tier)];
    if (declined) {
      decision.considered.push_back(
          {tier, false, "forced (" + origin_of(forced) + ") but declined: " + *declined});
      decision.summary =
          t + ": forced tier " + std::string(tier_name(tier)) + " cannot run: " + *declined;
    } else {
      decision.tier = tier;
      decision.considered.push_back({tier, true, "forced (" + origin_of(forced) + ")"});
      decision.summary =
          t + " → " + std::string(tier_name(tier)) + " (forced: " + origin_of(forced) + ")";
    }
    for (TailTier other : kAllTiers) {
      if (other != tier)
        decision.considered.push_back({other, false, "not considered: a tier is forced"});
    }
    return decision;
  }

  const Preference preference = prefer(num_tokens, config);
  std::vector<TailTier> order = {preference.tier};
  for (TailTier tier : fallback_order(preference.tier)) order.push_back(tier);

  std::string fallback_note;
  for (TailTier tier : order) {
    if (decision.tier) {
      auto declined = declined_reason(tier);
      decision.considered.push_back(
          {tier, false,
           "not needed: " + std::string(tier_name(*decision.tier)) + " was chosen" +
               (declined ? " (and it cannot run: " + *declined + ")" : "")});
      continue;
    }
    if (auto declined = declined_reason(tier)) {
      decision.considered.push_back({tier, false, "declined: " + *declined});
      fallback_note += (fallback_note.empty() ? "" : "; ") + std::string(tier_name(tier)) +
                       " declined: " + *declined;
      continue;
    }
    decision.tier = tier;
    std::string why = tier == preference.tier ? "preferred: " + preference.why
                                              : "fallback after " + fallback_note;
    decision.considered.push_back({tier, true, why});
    decision.summary = t + " → " + std::string(tier_name(tier)) + " (" + why + ")";
  }
  if (!decision.tier) decision.summary = t + ": no tier can run (" + fallback_note + ")";
  return decision;
}

TailTier select(std::int64_t num_tokens, const PolicyConfig& config, const TierSupport& support) {
  TierDecision decision = decide(num_tokens, config, support);
  if (!decision.tier) throw Error(decision.summary);
  return *decision.tier;
}

std::string describe_rule(const PolicyConfig& config) {
  if (config.forced_tier.value) {
    return "a forced tier, " + std::string(tier_name(*config.forced_tier.value)) + " (" +
           origin_of(config.forced_tier) + "); neither ranges nor breakpoints are used";
  }
  if (!config.ranges.value.empty()) {
    return "ranges " + describe_tier_ranges(config.ranges.value) + " (" + origin_of(config.ranges) +
           "); the breakpoints are not used";
  }
  if (config.ranges_set_aside) {
    return "breakpoints; the table's ranges are set aside because " + *config.ranges_set_aside +
           (config.ranges_set_aside->find(',') == std::string::npos ? " is" : " are") + " set";
  }
  return "breakpoints";
}

std::string explain(std::int64_t num_tokens, const PolicyConfig& config,
                    const TierSupport& support) {
  std::ostringstream out;
  const TierDecision decision = decide(num_tokens, config, support);
  out << "decision: " << decision.summary << "\n";
  if (config.table) {
    const std::string name = config.table_path.value_or("(unnamed)");
    if (auto measured = describe_measurement(*config.table, num_tokens, decision.tier, name)) {
      out << "evidence: " << *measured << "\n";
    }
  }
  out << "rule: " << describe_rule(config) << "\n";
  out << "settings (precedence: default < table < environment; a forced tier wins; ranges rule "
         "over breakpoints unless a breakpoint variable is set):\n";
  auto row = [&](const std::string& name, const std::string& value, const std::string& origin) {
    out << "  " << name << std::string(20 - std::min<std::size_t>(20, name.size()), ' ') << value
        << std::string(value.size() < 8 ? 8 - value.size() : 1, ' ') << origin << "\n";
  };
  row("ranges", config.ranges.value.empty() ? "none" : describe_tier_ranges(config.ranges.value),
      origin_of(config.ranges));
  row("fused_max_tokens", std::to_string(config.fused_max_tokens.value),
      origin_of(config.fused_max_tokens));
  row("overlap_max_tokens", std::to_string(config.overlap_max_tokens.value),
      origin_of(config.overlap_max_tokens));
  row("column_max_tokens", describe_limit(config.column_max_tokens),
      origin_of(config.column_max_tokens));
  row("overlap_disabled", config.overlap_disabled.value ? "yes" : "no",
      origin_of(config.overlap_disabled));
  row("forced_tier",
      config.forced_tier.value ? std::string(tier_name(*config.forced_tier.value)) : "none",
      origin_of(config.forced_tier));
  std::string table_note;
  if (config.table) {
    const TableProvenance& p = config.table->provenance;
    table_note = "measured " + p.date_utc + " on " +
                 (p.gpu ? p.gpu->name : std::string(backend_name(p.backend))) + ", tp " +
                 std::to_string(p.tp) + ", comm " + p.comm;
  }
  row("tier_table", config.table_path.value_or("none"), table_note);
  out << "tiers:\n";
  for (const TierVerdict& verdict : decision.considered) {
    const std::string name(tier_name(verdict.tier));
    out << "  " << (verdict.chosen ? "* " : "  ") << name << std::string(9 - name.size(), ' ')
        << verdict.reason << "\n";
  }
  return out.str();
}

}  // namespace lmoe

// Which tail tier runs for a batch of T tokens: a pure select() and an explain() that says why.
//
// Two rules say which tier a T prefers. The breakpoints (the built-in rule) can express one order
// only: fused, then overlap, then column, then token. Ranges (from a version-3 tier table, or a
// caller) are pieces of T each preferring any tier, so any tier can be preferred in any T range;
// when a config has them they rule. Each threshold comes from (rising precedence) the built-in
// default, a tier-table JSON file, or an environment variable; a breakpoint variable set by the
// user sets a table's ranges aside (the breakpoints rule then), and a forced tier (LMOE_TIER, or a
// caller's explicit choice) wins over all. docs/tuning.md has the whole rule.
// A tier that cannot run a case is declined with its reason and the next candidate is tried; every
// candidate considered appears in the explanation, so nothing falls back silently.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "lmoe/settings.hpp"  // EnvLookup
#include "lmoe/tier.hpp"

namespace lmoe {

struct TierTable;  // tier_tuning.hpp

// Where a setting's value came from.
enum class SettingSource : std::uint8_t { built_in, table, environment, caller };
std::string_view setting_source_name(SettingSource source);

template <typename T>
struct Setting {
  T value{};
  SettingSource source = SettingSource::built_in;
  std::string origin;  // "LMOE_FUSED_MAX_TOKENS=64", "table tiers.json", "default"
};

// One piece of the ranges rule: T up to max_tokens (after the previous piece's) prefers `tier`.
struct TierRange {
  std::optional<std::int64_t> max_tokens;  // nullopt: no upper end (the last piece only)
  TailTier tier = TailTier::column;
  bool operator==(const TierRange&) const = default;
};

// Throws lmoe::Error naming `where` and the field unless `ranges` is non-empty, every max_tokens
// but the last is >= 1 and larger than the one before, and the last is unbounded, so the pieces
// cover every T >= 1 once.
void validate_tier_ranges(std::span<const TierRange> ranges, const std::string& where);

// "column T<=45, overlap T<=512, token above"; "column for every T" for a single piece.
std::string describe_tier_ranges(std::span<const TierRange> ranges);

// Breakpoints in T: fused for T <= fused_max_tokens, overlap for T <= overlap_max_tokens, column
// for T <= column_max_tokens (nullopt: no limit), token above. The defaults follow the reference
// system: fused up to 128, overlap up to 256, column above; token only where a table or the
// environment enables it. On cuda below 8 ranks LatentTail makes the built-in fused breakpoint 0
// (with_rank_defaults in latent_tail.hpp).
struct PolicyConfig {
  Setting<std::int64_t> fused_max_tokens{128, SettingSource::built_in, "default"};
  Setting<std::int64_t> overlap_max_tokens{256, SettingSource::built_in, "default"};
  Setting<std::optional<std::int64_t>> column_max_tokens{std::nullopt, SettingSource::built_in,
                                                         "default: the token tier is off"};
  Setting<bool> overlap_disabled{false, SettingSource::built_in, "default"};
  Setting<std::optional<TailTier>> forced_tier{std::nullopt, SettingSource::built_in, "default"};
  // Pieces of T, each preferring one tier (validate_tier_ranges' form). Non-empty: they rule and
  // the breakpoints above are not used to prefer a tier (overlap_disabled still declines overlap).
  // LatentTail refuses a malformed list at construction (validate_tier_ranges, on every rank);
  // decide() alone, given one, prefers the first piece that holds T, else the last piece.
  Setting<std::vector<TierRange>> ranges{{}, SettingSource::built_in, "default: none"};
  // Set when a table's ranges were set aside because breakpoint variables of the environment are
  // set (the ranges are then empty): the variables, e.g. "LMOE_FUSED_MAX_TOKENS=64".
  std::optional<std::string> ranges_set_aside;
  std::optional<std::string> table_path;  // the tier table these settings were read from, if any
  // A measured table (version 2 or 3): its provenance and grid, for explain() to cite and for users
  // of the policy to match against their configuration (match_tier_table). Null for no table and
  // for version 1, which holds breakpoints only.
  std::shared_ptr<const TierTable> table;
};

// Builds the policy from defaults, then `table_path` (or LMOE_TIER_TABLE when table_path is empty),
// then the environment: LMOE_FUSED_MAX_TOKENS, LMOE_OVERLAP_MAX_TOKENS, LMOE_COLUMN_MAX_TOKENS,
// LMOE_DISABLE_OVERLAP, LMOE_TIER. Any of the first four set (non-empty) sets the table's ranges
// aside: the breakpoints rule, and ranges_set_aside names the variables. Garbage or negative values
// throw lmoe::Error naming the variable.
PolicyConfig load_policy_config(const EnvLookup& env,
                                const std::optional<std::string>& table_path = std::nullopt);

// Applies a tier table (JSON text, version 1, 2 or 3) on top of `config`; `origin` names it in
// explanations. Version 3 sets the ranges and the breakpoints; versions 1 and 2 set breakpoints and
// clear any ranges (a later table's breakpoints are meant to rule). Versions 2 and 3 also set
// config.table.
void apply_tier_table(PolicyConfig& config, const std::string& json_text,
                      const std::string& origin);

// For one T: which tiers the backend can run, with the reason for each it cannot.
struct TierSupport {
  std::array<std::optional<std::string>, 4> declined;  // indexed by TailTier; nullopt = can run
  bool can_run(TailTier tier) const { return !declined[static_cast<std::size_t>(tier)]; }
};

struct TierVerdict {
  TailTier tier;
  bool chosen = false;
  std::string reason;  // why it was taken, declined or not preferred
};

struct TierDecision {
  std::optional<TailTier> tier;         // nullopt: no tier can run (an error for callers)
  std::vector<TierVerdict> considered;  // in the order they were considered
  // One line: "T=64 → fused (preferred: T=64 <= fused_max_tokens=128 (default))", or with ranges
  // "T=128 → overlap (preferred: 45 < T <= 512: overlap, table t.json ranges)".
  std::string summary;
};

// The tier the ranges (when the config has them) or else the breakpoints prefer for T, before
// capabilities are consulted.
TailTier preferred_tier(std::int64_t num_tokens, const PolicyConfig& config);
// Pure: the same inputs give the same decision. Throws nothing for T = 0 (reported as no work).
TierDecision decide(std::int64_t num_tokens, const PolicyConfig& config,
                    const TierSupport& support);
// decide() that throws lmoe::Error (with the explanation) when no tier can run.
TailTier select(std::int64_t num_tokens, const PolicyConfig& config, const TierSupport& support);
// Which rule prefers tiers, in one line: "ranges column T<=45, overlap T<=512, token above (table
// t.json ranges); the breakpoints are not used", "breakpoints", "breakpoints; the table's ranges
// are set aside because LMOE_FUSED_MAX_TOKENS=64 is set", or a forced tier.
std::string describe_rule(const PolicyConfig& config);
// Multi-line human-readable account: the rule, the settings and their sources, then every tier
// considered; with a measured table, its medians at the grid point nearest to T.
std::string explain(std::int64_t num_tokens, const PolicyConfig& config,
                    const TierSupport& support);

}  // namespace lmoe

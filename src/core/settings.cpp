#include "lmoe/settings.hpp"

#include <algorithm>
#include <array>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "core/env_flag.hpp"
#include "core/token_chunks.hpp"
#include "lmoe/error.hpp"

extern char** environ;

namespace lmoe {

namespace {

using T = SettingType;
constexpr std::int64_t kMaxInt64 = std::numeric_limits<std::int64_t>::max();
// A day: a longer wait is a mistake, and ms · 10^6 must fit the device's 64-bit nanoseconds.
constexpr std::int64_t kMaxTimeoutMs = std::int64_t{24} * 3600 * 1000;
// The decode kernel's early items: kFusedDecodeMaxEarlyItems (cuda/fused, checked there).
constexpr std::int64_t kMaxDecodeEarlyItems = 64;
// Blocks on one GPU: no GPU has this many SMs; the GPU's own bound is checked at construction.
constexpr std::int64_t kMaxExchangeGrid = 1 << 16;

// In name order (a test checks it, and that every name here is read somewhere and every name read
// is here).
constexpr std::array<SettingSpec, 26> kTable = {{
    {"LMOE_BENCH_INJECT_FAULT", T::choice, 0, 0, "0 or 1", "0",
     "testing only: makes one element of every checked output wrong", "lmoe bench"},
    {"LMOE_COLUMN_MAX_TOKENS", T::tokens, 0, kMaxInt64, "a token count or none",
     "the backend's breakpoint (docs/tuning.md)",
     "largest T the column tier is preferred for (none: no bound); sets a table's ranges aside",
     "tier policy (core)"},
    {"LMOE_DISABLE_OVERLAP", T::flag, 0, 0, "", "0",
     "declines the overlap tier; sets a table's ranges aside", "tier policy (core)"},
    {"LMOE_EPILOGUE_GEMM", T::flag, 0, 0, "", "unset: where it fills the GPU (32 CTAs or more)",
     "the up-projection's add in its epilogue (CUTLASS, Hopper): 1 at every size, 0 never "
     "(cuBLASLt "
     "writes the product and a kernel adds it)",
     "cuda tail (overlap and column at tp 1, column's stripes, token)"},
    {"LMOE_FUSED_CHAINED", T::flag, 0, 0, "", "1",
     "0 turns the chained path off (the fused kernel for T <= 128, docs/fused.md)",
     "cuda fused tier; tier policy defaults"},
    {"LMOE_FUSED_CHAINED_PACE_BURST", T::integer, 1, 64, "a count of copies", "1",
     "copies of weights the chained path issues before its pace starts (measurements)",
     "cuda fused tier (chained path)"},
    {"LMOE_FUSED_CHAINED_PACE_NS", T::nanoseconds, 0, 100000, "nanoseconds",
     "paced from the grid's bytes at tp 1; 0 (all at once) at tp > 1",
     "pace of the chained path's first copies of weights, per block (measurements)",
     "cuda fused tier (chained path)"},
    {"LMOE_FUSED_CHAINED_TILE_ROWS", T::integer, 64, 128, "64 or 128", "the plan's",
     "the chained path's tile of w_up: 64 or 128 rows (measurements)",
     "cuda fused tier (chained path)"},
    {"LMOE_FUSED_DECODE", T::flag, 0, 0, "", "1",
     "0 turns the decode kernel off (the fused kernel for T <= 16, docs/fused.md)",
     "cuda fused tier; tier policy defaults"},
    {"LMOE_FUSED_DECODE_EARLY_ITEMS", T::integer, 0, kMaxDecodeEarlyItems,
     "a count of a warp's weight items", "4 (all in the pair instance)",
     "weight items a decode warp asks for before it waits for the kernel before it",
     "cuda fused tier (decode kernel)"},
    {"LMOE_FUSED_DECODE_PAIR", T::flag, 0, 0, "", "1",
     "the decode kernel's pair instance (two blocks an SM) for a narrow stripe at tp 1",
     "cuda fused tier (decode kernel)"},
    {"LMOE_FUSED_DECODE_PROGRAMMATIC", T::flag, 0, 0, "", "1 at tp 1, 0 at tp > 1",
     "launch the decode kernel programmatically (it may start before the last kernel ends)",
     "cuda fused tier (decode kernel)"},
    {"LMOE_FUSED_EXCHANGE_GRID", T::integer, 1, kMaxExchangeGrid, "a count of blocks on this GPU",
     "one per SM (one rank per GPU), else at most 32",
     "blocks of the chained path's exchange and gather kernels at tp > 1 (measurements); also at "
     "most what the GPU holds",
     "cuda fused tier (chained path, tp > 1)"},
    {"LMOE_FUSED_MAX_TOKENS", T::tokens, 0, kMaxInt64, "a token count",
     "the backend's breakpoint (docs/tuning.md)",
     "largest T the fused tier is preferred for; sets a table's ranges aside",
     "tier policy (core)"},
    {"LMOE_FUSED_TRACE", T::presence, 0, 0, "", "unset",
     "set to anything: the fused kernels stamp the time per block and point, printed on stderr",
     "cuda fused tier (diagnostics)"},
    {"LMOE_LAYER_DEVICE_EXPERTS", T::flag, 0, 0, "", "0",
     "eager forwards take the device path for the routed experts too (graphs always do)",
     "cuda layer"},
    {"LMOE_LAYER_SERIAL_STAGES", T::flag, 0, 0, "", "0",
     "the shared experts run after the routed ones, so each stage's time is its own",
     "cuda layer; lmoe layer"},
    {"LMOE_NCCL_ID_FILE", T::path, 0, 0, "", "unset (needed when WORLD_SIZE > 1)",
     "file through which rank 0 hands its NCCL id to the other processes",
     "cuda comm (nccl, one process per rank)"},
    {"LMOE_OVERLAP_MAX_TOKENS", T::tokens, 0, kMaxInt64, "a token count",
     "the backend's breakpoint (docs/tuning.md)",
     "largest T the overlap tier is preferred for; sets a table's ranges aside",
     "tier policy (core)"},
    {"LMOE_P2P_DIAGNOSE", T::presence, 0, 0, "", "unset",
     "set to anything: a failed p2p round's error lists every block's progress",
     "cuda comm (p2p, diagnostics)"},
    {"LMOE_P2P_ID_FILE", T::path, 0, 0, "", "unset (needed when WORLD_SIZE > 1)",
     "file through which rank 0 hands its shared memory's name to the other processes",
     "cuda comm (p2p, one process per rank)"},
    {"LMOE_P2P_SHARED_GPU", T::flag, 0, 0, "", "0",
     "p2p ranks may share a GPU (its SMs, bandwidth and L2), where rounds can stall",
     "cuda comm (p2p)"},
    {"LMOE_P2P_TIMEOUT_MS", T::milliseconds, 1, kMaxTimeoutMs, "a positive number of milliseconds",
     "10000",
     "how long a p2p round or fused kernel waits for its peers (or its own grid) before it fails",
     "cuda comm (p2p), cuda fused tier"},
    {"LMOE_TIER", T::tier, 0, 0, "", "auto", "forces a tier for every T (auto: the policy's)",
     "tier policy (core)"},
    {"LMOE_TIER_TABLE", T::path, 0, 0, "", "unset (the shipped table or the breakpoints)",
     "tier table (JSON) to load; --tier-table wins over it", "tier policy (core)"},
    {"LMOE_TOKEN_CHUNKS", T::integer, 1, kMaxTokenChunks, "a count of chunks",
     "2 from T = 4096 up, else 1", "chunks the token tier pipelines its collectives over",
     "cuda token tier"},
}};

std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1] ? 1 : 0)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

const SettingSpec& spec_of_type(std::string_view name, std::initializer_list<SettingType> types) {
  const SettingSpec& spec = setting_spec(name);
  if (std::find(types.begin(), types.end(), spec.type) == types.end()) {
    throw Error(std::string(name) + " is a " + std::string(setting_type_name(spec.type)) +
                " setting, read here as another type (a programming error)");
  }
  return spec;
}

}  // namespace

EnvLookup process_environment() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  };
}

std::string_view setting_type_name(SettingType type) {
  switch (type) {
    case T::flag: return "flag";
    case T::presence: return "presence";
    case T::integer: return "integer";
    case T::milliseconds: return "milliseconds";
    case T::nanoseconds: return "nanoseconds";
    case T::tokens: return "tokens";
    case T::choice: return "choice";
    case T::tier: return "tier";
    case T::path: return "path";
  }
  return "?";
}

std::span<const SettingSpec> settings_table() { return kTable; }

const SettingSpec* find_setting(std::string_view name) {
  for (const SettingSpec& spec : kTable) {
    if (name == spec.name) return &spec;
  }
  return nullptr;
}

const SettingSpec& setting_spec(std::string_view name) {
  if (const SettingSpec* spec = find_setting(name)) return *spec;
  throw Error(std::string(name) +
              " is not in the settings table (lmoe/settings.hpp): add it there before reading it");
}

std::string setting_range_text(const SettingSpec& spec) {
  switch (spec.type) {
    case T::flag: return "1/0, true/false, yes/no, on/off";
    case T::presence: return "set or unset";
    case T::integer:
    case T::milliseconds:
    case T::nanoseconds:
    case T::tokens: {
      const std::string range =
          "[" + std::to_string(spec.min) + ", " + std::to_string(spec.max) + "]";
      return spec.name == std::string_view("LMOE_COLUMN_MAX_TOKENS")         ? range + " or none"
             : spec.name == std::string_view("LMOE_FUSED_CHAINED_TILE_ROWS") ? "64 or 128"
                                                                             : range;
    }
    case T::choice: return spec.what;
    case T::tier: return "auto, fused, overlap, column or token";
    case T::path: return "a path";
  }
  return "?";
}

std::optional<std::string> setting_text(std::string_view name, const EnvLookup& env) {
  (void)setting_spec(name);
  auto value = env(std::string(name));
  if (!value || value->empty()) return std::nullopt;
  return value;
}

bool setting_present(std::string_view name, const EnvLookup& env) {
  (void)spec_of_type(name, {T::presence});
  return env(std::string(name)).has_value();
}

std::optional<bool> setting_flag_if_set(std::string_view name, const EnvLookup& env) {
  (void)spec_of_type(name, {T::flag});
  const auto text = setting_text(name, env);
  if (!text) return std::nullopt;
  return parse_flag(std::string(name), *text);
}

bool setting_flag(std::string_view name, const EnvLookup& env) {
  return setting_flag_if_set(name, env).value_or(false);
}

std::optional<std::int64_t> setting_int(std::string_view name, const EnvLookup& env) {
  const SettingSpec& spec = spec_of_type(name, {T::integer, T::milliseconds, T::nanoseconds});
  const auto text = setting_text(name, env);
  if (!text) return std::nullopt;
  return parse_integer(std::string(name), *text, spec.min, spec.max, spec.what);
}

std::int64_t parse_setting_tokens(std::string_view name, const std::string& text) {
  const SettingSpec& spec = spec_of_type(name, {T::tokens});
  const std::string variable(name);
  const bool digits_only = !text.empty() && std::all_of(text.begin(), text.end(), [](char c) {
    return c >= '0' && c <= '9';
  });
  if (!digits_only) {
    throw Error(variable + "='" + text + "': expected a non-negative integer number of tokens");
  }
  std::int64_t value = 0;
  for (char c : text) {
    if (value > (spec.max - (c - '0')) / 10) {
      throw Error(variable + "='" + text + "': the number is too large");
    }
    value = value * 10 + (c - '0');
  }
  return value;
}

std::optional<std::string> setting_choice(std::string_view name, const EnvLookup& env) {
  const SettingSpec& spec = spec_of_type(name, {T::choice});
  const auto text = setting_text(name, env);
  if (!text) return std::nullopt;
  // `what` lists the words: "0 or 1", "a, b or c".
  std::string words = spec.what;
  for (char& c : words) {
    if (c == ',') c = ' ';
  }
  std::size_t start = 0;
  while (start < words.size()) {
    const std::size_t end = std::min(words.find(' ', start), words.size());
    const std::string word = words.substr(start, end - start);
    if (!word.empty() && word != "or" && word == *text) return text;
    start = end + 1;
  }
  throw Error(std::string(name) + "='" + *text + "': expected " + spec.what);
}

std::optional<std::string> closest_setting_name(std::string_view name) {
  std::optional<std::string> best;
  std::size_t best_distance = 4;  // more than 3 edits away is no typo of it
  for (const SettingSpec& spec : kTable) {
    const std::size_t distance = edit_distance(name, spec.name);
    if (distance < best_distance) {
      best_distance = distance;
      best = spec.name;
    }
  }
  return best;
}

std::vector<std::string> unknown_setting_warnings(const std::vector<std::string>& names) {
  std::vector<std::string> warnings;
  for (const std::string& name : names) {
    if (name.rfind("LMOE_", 0) != 0 || find_setting(name)) continue;
    std::string warning = name + " is not a setting lmoe reads";
    if (const auto closest = closest_setting_name(name)) {
      warning += " (did you mean " + *closest + "?)";
    }
    warnings.push_back(warning);
  }
  return warnings;
}

std::vector<std::string> environment_lmoe_names() {
  std::vector<std::string> names;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const std::string_view text(*entry);
    if (text.rfind("LMOE_", 0) != 0) continue;
    names.emplace_back(text.substr(0, std::min(text.find('='), text.size())));
  }
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace lmoe

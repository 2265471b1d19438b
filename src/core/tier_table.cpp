// Tier tables: JSON files that set the policy's breakpoints.
//
// Version 1 (written by hand):
//   {"format": "lmoe-tier-table", "version": 1,
//    "breakpoints": {"fused_max_tokens": 128, "overlap_max_tokens": 256, "column_max_tokens":
//    null}, "overlap_disabled": false, ... any further keys (measurements, hardware) are kept for
//    tools}
//   Every breakpoint is optional; an unknown breakpoint name is an error (it is most likely a
//   typo).
//
// Version 2 (written by `lmoe tune` before ranges; docs/tuning.md): all three breakpoints, plus
// "provenance" (where and for what the grid was measured) and "grid" (per T, each tier's median,
// p10 and p90 in microseconds or why it was declined, and the fit's choice and regret for readers,
// which loading ignores). "overlap_disabled" is read as in version 1.
//
// Version 3 (written by `lmoe tune`): version 2 plus "ranges", the pieces of T the policy prefers a
// tier in ([{"max_tokens": 45, "tier": "column"}, ..., {"max_tokens": null, "tier": "token"}]),
// which rule when the table is loaded; the breakpoints stay for readers of version 2 and for when a
// breakpoint variable of the environment sets the ranges aside. Its provenance may add "eps" and
// "derived_from" (the recorded sweep a table was derived from, `lmoe tune --from-sweep`), both
// optional when reading.
#include <nlohmann/json.hpp>

#include <cmath>

#include "core/json_fields.hpp"
#include "core/text_file.hpp"
#include "lmoe/error.hpp"
#include "lmoe/tier_policy.hpp"
#include "lmoe/tier_table.hpp"

namespace lmoe {

namespace {

using nlohmann::json;
using namespace json_fields;
// Written tables keep their keys in a reading order (format and version first).
using ordered = nlohmann::ordered_json;

// Microseconds to the nanosecond: the file stays readable and loses nothing a timer resolves.
double to_ns(double us) { return std::round(us * 1000) / 1000; }

std::int64_t token_count(const json& value, const std::string& where) {
  if (!value.is_number_integer() || value.get<std::int64_t>() < 0) {
    throw Error(where + ": expected a non-negative integer, got " + value.dump());
  }
  return value.get<std::int64_t>();
}

ordered optional_json(const std::optional<std::string>& value) {
  return value ? ordered(*value) : ordered();
}

// ---- version 2
// -----------------------------------------------------------------------------------

ordered provenance_json(const TableProvenance& p) {
  ordered gpu;
  if (p.gpu) {
    gpu = {{"name", p.gpu->name},
           {"compute_capability", p.gpu->compute_capability},
           {"cuda_driver_version", p.gpu->cuda_driver_version},
           {"cuda_runtime_version", p.gpu->cuda_runtime_version}};
  }
  return {{"lmoe_version", p.lmoe_version},
          {"backend", backend_name(p.backend)},
          {"gpu", gpu},
          {"driver_version", optional_json(p.driver_version)},
          {"nccl_version", optional_json(p.nccl_version)},
          {"tp", p.tp},
          {"dims", {{"d_model", p.dims.d_model}, {"d_latent", p.dims.d_latent}}},
          {"dtype", dtype_name(p.dtype)},
          {"comm", p.comm},
          {"date", p.date_utc},
          {"hostname", p.hostname},
          {"preset", p.preset},
          {"mode", p.mode},
          {"warmup", p.warmup},
          {"iters", p.iters},
          {"cold_l2", p.cold_l2},
          {"layers", p.layers},
          {"settings", p.settings},
          {"eps", p.eps ? ordered(*p.eps) : ordered()},
          {"derived_from", p.derived_from ? ordered{{"path", p.derived_from->path},
                                                    {"date", p.derived_from->date_utc},
                                                    {"derived_date", p.derived_from->derived_utc}}
                                          : ordered()}};
}

TableProvenance read_provenance(const json& object, const std::string& where) {
  TableProvenance p;
  p.lmoe_version = text_field(object, "lmoe_version", where);
  p.backend = parsed(where + ".backend",
                     [&] { return parse_backend(text_field(object, "backend", where)); });
  const json gpu = field(object, "gpu", where);
  if (!gpu.is_null()) {
    const std::string at = where + ".gpu";
    p.gpu = TableGpu{text_field(gpu, "name", at), text_field(gpu, "compute_capability", at),
                     int_field(gpu, "cuda_driver_version", at, 0),
                     int_field(gpu, "cuda_runtime_version", at, 0)};
  }
  p.driver_version = optional_text(object, "driver_version", where);
  p.nccl_version = optional_text(object, "nccl_version", where);
  p.tp = int_field(object, "tp", where, 1);
  const json dims = field(object, "dims", where);
  p.dims.d_model = integer_field(dims, "d_model", where + ".dims", 1);
  p.dims.d_latent = integer_field(dims, "d_latent", where + ".dims", 1);
  p.dtype =
      parsed(where + ".dtype", [&] { return parse_dtype(text_field(object, "dtype", where)); });
  p.comm = text_field(object, "comm", where);
  p.date_utc = text_field(object, "date", where);
  p.hostname = text_field(object, "hostname", where);
  p.preset = text_field(object, "preset", where);
  p.mode = text_field(object, "mode", where);
  p.warmup = int_field(object, "warmup", where, 0);
  p.iters = int_field(object, "iters", where, 0);
  // Optional: tables written before these were recorded lack them (cold_l2: they were warm; layers:
  // one tail a timed iteration).
  p.cold_l2 = object.contains("cold_l2") && bool_field(object, "cold_l2", where);
  p.layers = object.contains("layers") ? int_field(object, "layers", where, 1) : 1;
  if (object.contains("settings")) p.settings = text_map_field(object, "settings", where);
  if (object.contains("eps") && !object["eps"].is_null()) {
    p.eps = static_cast<float>(nonnegative_field(object, "eps", where));
  }
  if (object.contains("derived_from") && !object["derived_from"].is_null()) {
    const json& source = object["derived_from"];
    const std::string at = where + ".derived_from";
    p.derived_from =
        TableSweepSource{text_field(source, "path", at), text_field(source, "date", at),
                         text_field(source, "derived_date", at)};
  }
  return p;
}

ordered timing_json(const TierTiming& timing) {
  if (timing.status == TierTiming::Status::declined) return {{"declined", timing.reason}};
  return {{"median_us", to_ns(timing.median_us)},
          {"p10_us", to_ns(timing.p10_us)},
          {"p90_us", to_ns(timing.p90_us)}};
}

TierTiming read_timing(const json& object, const std::string& where) {
  if (!object.is_object()) throw Error(where + ": expected an object");
  if (object.contains("declined"))
    return TierTiming::declined_because(text_field(object, "declined", where));
  return TierTiming::measured(nonnegative_field(object, "median_us", where),
                              nonnegative_field(object, "p10_us", where),
                              nonnegative_field(object, "p90_us", where));
}

ordered tier_or_null(std::optional<TailTier> tier) {
  return tier ? ordered(tier_name(*tier)) : ordered();
}

std::vector<GridPoint> read_grid(const json& array, const std::string& where) {
  if (!array.is_array() || array.empty()) {
    throw Error(where + ": expected a non-empty array of grid points");
  }
  std::vector<GridPoint> grid;
  for (std::size_t i = 0; i < array.size(); ++i) {
    const std::string at = where + "[" + std::to_string(i) + "]";
    GridPoint point;
    point.tokens = integer_field(array[i], "tokens", at, 1);
    if (!grid.empty() && point.tokens <= grid.back().tokens) {
      throw Error(at + ".tokens: expected T to rise strictly, got " +
                  std::to_string(grid.back().tokens) + " then " + std::to_string(point.tokens));
    }
    const json tiers = field(array[i], "tiers", at);
    if (!tiers.is_object()) throw Error(at + ".tiers: expected an object");
    for (const auto& [name, value] : tiers.items()) {
      const TailTier tier = parsed(at + ".tiers", [&] { return parse_tier(name); });
      point[tier] = read_timing(value, at + ".tiers." + name);
    }
    grid.push_back(std::move(point));
  }
  return grid;
}

Breakpoints read_breakpoints(const json& object, const std::string& where) {
  if (!object.is_object()) throw Error(where + ": expected an object");
  for (const auto& [key, value] : object.items()) {
    if (key != "fused_max_tokens" && key != "overlap_max_tokens" && key != "column_max_tokens") {
      throw Error(where + "." + key +
                  ": unknown breakpoint (expected fused_max_tokens, overlap_max_tokens or "
                  "column_max_tokens)");
    }
    (void)value;
  }
  Breakpoints breakpoints;
  breakpoints.fused_max_tokens = integer_field(object, "fused_max_tokens", where, 0);
  breakpoints.overlap_max_tokens = integer_field(object, "overlap_max_tokens", where, 0);
  if (!field(object, "column_max_tokens", where).is_null()) {
    breakpoints.column_max_tokens = integer_field(object, "column_max_tokens", where, 0);
  }
  return breakpoints;
}

std::vector<TierRange> read_ranges(const json& array, const std::string& where) {
  if (!array.is_array() || array.empty()) {
    throw Error(where +
                ": expected a non-empty array of pieces {\"max_tokens\": T or null, "
                "\"tier\": name}, got " +
                array.dump());
  }
  std::vector<TierRange> ranges;
  for (std::size_t i = 0; i < array.size(); ++i) {
    const std::string at = where + "[" + std::to_string(i) + "]";
    const json& piece = array[i];
    if (!piece.is_object()) throw Error(at + ": expected an object, got " + piece.dump());
    for (const auto& [key, value] : piece.items()) {
      if (key != "max_tokens" && key != "tier") {
        throw Error(at + "." + key + ": unknown key (expected max_tokens and tier)");
      }
      (void)value;
    }
    TierRange range;
    if (!field(piece, "max_tokens", at).is_null()) {
      range.max_tokens = integer_field(piece, "max_tokens", at, 1);
    }
    const std::string tier = text_field(piece, "tier", at);
    range.tier = parsed(at + ".tier", [&] { return parse_tier(tier); });
    ranges.push_back(range);
  }
  validate_tier_ranges(ranges, where);
  return ranges;
}

ordered ranges_json(const std::vector<TierRange>& ranges) {
  ordered array = ordered::array();
  for (const TierRange& range : ranges) {
    array.push_back({{"max_tokens", range.max_tokens ? ordered(*range.max_tokens) : ordered()},
                     {"tier", tier_name(range.tier)}});
  }
  return array;
}

json parse_json(const std::string& json_text, const std::string& origin) {
  json table = parse_object(json_text, origin);
  // Compared as JSON values, so a key holding a number or a boolean is just "not equal" (asking for
  // a std::string default would throw nlohmann's type_error, naming neither the file nor the key).
  if (table.value("format", json()) != "lmoe-tier-table") {
    if (table.value("command", json()) == "bench") {
      throw Error(origin +
                  ": is a recorded sweep of tier times, not a tier table (a table is derived "
                  "from a sweep by tuning it)");
    }
    throw Error(origin + ": \"format\" must be \"lmoe-tier-table\"");
  }
  return table;
}

// Versions 2 and 3: a measured table; version 3 adds the ranges.
TierTable read_measured(const json& table, const std::string& origin, int version) {
  TierTable result;
  if (version == 3)
    result.ranges = read_ranges(field(table, "ranges", origin), origin + ": ranges");
  result.breakpoints =
      read_breakpoints(field(table, "breakpoints", origin), origin + ": breakpoints");
  result.provenance = read_provenance(field(table, "provenance", origin), origin + ": provenance");
  result.grid = read_grid(field(table, "grid", origin), origin + ": grid");
  return result;
}

}  // namespace

std::string write_tier_table(const TierTable& table) {
  validate_tier_ranges(table.ranges, "write_tier_table: table.ranges");
  const PolicyFit by_ranges = evaluate_policy(table.grid, policy_from(table.ranges, "table"));
  const PolicyFit by_breakpoints =
      evaluate_policy(table.grid, policy_from(table.breakpoints, "table"));
  const auto rounded = [](double regret) { return std::round(regret * 1e6) / 1e6; };
  ordered grid = ordered::array();
  for (std::size_t i = 0; i < table.grid.size(); ++i) {
    const GridPoint& point = table.grid[i];
    ordered tiers = ordered::object();
    for (TailTier tier : kAllTiers) {
      if (point[tier].status != TierTiming::Status::not_measured) {
        tiers[std::string(tier_name(tier))] = timing_json(point[tier]);
      }
    }
    grid.push_back({{"tokens", point.tokens},
                    {"tiers", tiers},
                    {"fastest", tier_or_null(by_ranges.points[i].fastest)},
                    {"chosen", tier_or_null(by_ranges.points[i].chosen)},
                    {"regret", rounded(by_ranges.points[i].regret)},
                    {"breakpoints_chosen", tier_or_null(by_breakpoints.points[i].chosen)},
                    {"breakpoints_regret", rounded(by_breakpoints.points[i].regret)}});
  }
  const Breakpoints& b = table.breakpoints;
  const ordered doc = {
      {"format", "lmoe-tier-table"},
      {"version", 3},
      {"ranges", ranges_json(table.ranges)},
      {"breakpoints",
       {{"fused_max_tokens", b.fused_max_tokens},
        {"overlap_max_tokens", b.overlap_max_tokens},
        {"column_max_tokens", b.column_max_tokens ? ordered(*b.column_max_tokens) : ordered()}}},
      {"provenance", provenance_json(table.provenance)},
      {"fit",
       {{"total_regret", rounded(by_ranges.total_regret)},
        {"max_regret", rounded(by_ranges.max_regret)},
        {"rule",
         "ranges: at each grid T the tier decide() runs when preferring the fastest measured tier, "
         "equal neighbours merged, the boundary between grid points a < b where the two tiers' "
         "medians cross, interpolated linearly in T, else at floor(sqrt(a*b)) (docs/tuning.md)"},
        {"breakpoints",
         {{"total_regret", rounded(by_breakpoints.total_regret)},
          {"max_regret", rounded(by_breakpoints.max_regret)},
          {"rule",
           "least total regret sum_T (median(chosen)/median(fastest) - 1) over the grid among the "
           "breakpoints the policy can express (docs/tuning.md)"}}}}},
      {"grid", grid}};
  return doc.dump(2) + "\n";
}

TierTable read_tier_table(const std::string& json_text, const std::string& origin) {
  const json table = parse_json(json_text, origin);
  const json version = table.value("version", json());
  if (version != 2 && version != 3) {
    throw Error(origin + ": expected \"version\" 2 or 3 (a measured table), got " + version.dump());
  }
  return read_measured(table, origin, version.get<int>());
}

void apply_tier_table(PolicyConfig& config, const std::string& json_text,
                      const std::string& origin) {
  const json table = parse_json(json_text, origin);
  const json version = table.value("version", json());
  if (version != 1 && version != 2 && version != 3) {
    throw Error(origin + ": unsupported \"version\" " + version.dump() +
                " (this lmoe reads versions 1, 2 and 3)");
  }
  auto set = [&](auto& setting, auto value, const std::string& key) {
    setting.value = value;
    setting.source = SettingSource::table;
    setting.origin = origin + " " + key;
  };
  // A table of version 1 or 2 means its breakpoints to rule: ranges of an earlier one go.
  const auto clear_ranges = [&] {
    config.ranges.value.clear();
    config.ranges.source = SettingSource::table;
    config.ranges.origin = origin + ": none (version " + version.dump() + ")";
  };
  if (version == 2 || version == 3) {
    auto measured = std::make_shared<TierTable>(read_measured(table, origin, version.get<int>()));
    set(config.fused_max_tokens, measured->breakpoints.fused_max_tokens, "fused_max_tokens");
    set(config.overlap_max_tokens, measured->breakpoints.overlap_max_tokens, "overlap_max_tokens");
    set(config.column_max_tokens, measured->breakpoints.column_max_tokens, "column_max_tokens");
    if (version == 3) {
      set(config.ranges, measured->ranges, "ranges");
    } else if (!config.ranges.value.empty()) {
      clear_ranges();
    }
    config.table = std::move(measured);
  } else if (table.contains("breakpoints")) {
    if (!config.ranges.value.empty()) clear_ranges();
    const json& breakpoints = table["breakpoints"];
    if (!breakpoints.is_object()) throw Error(origin + ": \"breakpoints\" must be an object");
    for (const auto& [key, value] : breakpoints.items()) {
      const std::string where = origin + ": breakpoints." + key;
      if (key == "fused_max_tokens") {
        set(config.fused_max_tokens, token_count(value, where), key);
      } else if (key == "overlap_max_tokens") {
        set(config.overlap_max_tokens, token_count(value, where), key);
      } else if (key == "column_max_tokens") {
        set(config.column_max_tokens,
            value.is_null() ? std::optional<std::int64_t>()
                            : std::optional(token_count(value, where)),
            key);
      } else {
        throw Error(where +
                    ": unknown breakpoint (expected fused_max_tokens, overlap_max_tokens or "
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

TierTable read_tier_table_file(const std::string& path) {
  return read_tier_table(read_text_file(path, "tier table file"), path);
}

}  // namespace lmoe

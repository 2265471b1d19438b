// The measured grid, how a policy does on it, and matching a table to the running configuration
// (lmoe/tier_table.hpp). Reading and writing the file format is core/tier_table.cpp.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "core/grid_fit.hpp"
#include "lmoe/error.hpp"
#include "lmoe/tier_table.hpp"

namespace lmoe {

// ---- the measured grid --------------------------------------------------------------------------

TierTiming TierTiming::measured(double median_us, double p10_us, double p90_us) {
  TierTiming timing;
  timing.status = Status::ran;
  timing.median_us = median_us;
  timing.p10_us = p10_us;
  timing.p90_us = p90_us;
  return timing;
}

TierTiming TierTiming::declined_because(std::string reason) {
  TierTiming timing;
  timing.status = Status::declined;
  timing.reason = std::move(reason);
  return timing;
}

std::optional<TailTier> fastest_tier(const GridPoint& point) {
  std::optional<TailTier> fastest;
  for (TailTier tier : kAllTiers) {
    if (!point[tier].ran()) continue;
    if (!fastest || point[tier].median_us < point[*fastest].median_us) fastest = tier;
  }
  return fastest;
}

TierSupport grid_support(const GridPoint& point) {
  TierSupport support;
  for (TailTier tier : kAllTiers) {
    const TierTiming& timing = point[tier];
    auto& declined = support.declined[static_cast<std::size_t>(tier)];
    if (timing.status == TierTiming::Status::declined) declined = timing.reason;
    if (timing.status == TierTiming::Status::not_measured) declined = "not measured";
  }
  return support;
}

const GridPoint* nearest_grid_point(std::span<const GridPoint> grid, std::int64_t tokens) {
  const GridPoint* nearest = nullptr;
  double best = 0;
  const std::int64_t t = std::max<std::int64_t>(tokens, 1);
  for (const GridPoint& point : grid) {
    const double distance =
        std::abs(std::log(static_cast<double>(point.tokens) / static_cast<double>(t)));
    if (!nearest || distance < best || (distance == best && point.tokens < nearest->tokens)) {
      nearest = &point;
      best = distance;
    }
  }
  return nearest;
}

// ---- breakpoints --------------------------------------------------------------------------------

PolicyConfig policy_from(const Breakpoints& breakpoints, const std::string& origin) {
  PolicyConfig config;
  config.fused_max_tokens = {breakpoints.fused_max_tokens, SettingSource::table,
                             origin + " fused_max_tokens"};
  config.overlap_max_tokens = {breakpoints.overlap_max_tokens, SettingSource::table,
                               origin + " overlap_max_tokens"};
  config.column_max_tokens = {breakpoints.column_max_tokens, SettingSource::table,
                              origin + " column_max_tokens"};
  return config;
}

PolicyConfig policy_from(const std::vector<TierRange>& ranges, const std::string& origin) {
  validate_tier_ranges(ranges, origin + " ranges");
  PolicyConfig config;
  config.ranges = {ranges, SettingSource::table, origin + " ranges"};
  return config;
}

void validate_grid(std::span<const GridPoint> grid, const char* who) {
  LMOE_CHECK(!grid.empty(), std::string(who) + ": expected at least one grid point, got none");
  for (std::size_t i = 0; i < grid.size(); ++i) {
    LMOE_CHECK(grid[i].tokens >= 1,
               std::string(who) + ": grid T must be >= 1, got " + std::to_string(grid[i].tokens));
    LMOE_CHECK(i == 0 || grid[i].tokens > grid[i - 1].tokens,
               std::string(who) + ": grid T must rise strictly, got " +
                   std::to_string(grid[i - 1].tokens) + " then " + std::to_string(grid[i].tokens));
    for (TailTier tier : kAllTiers) {
      const TierTiming& timing = grid[i][tier];
      if (!timing.ran()) continue;
      LMOE_CHECK(std::isfinite(timing.median_us) && timing.median_us >= 0,
                 std::string(who) + ": T=" + std::to_string(grid[i].tokens) + " " +
                     std::string(tier_name(tier)) + ": expected a finite median >= 0, got " +
                     std::to_string(timing.median_us));
    }
  }
}

double regret_of(const GridPoint& point, TailTier chosen, TailTier fastest) {
  const double best = point[fastest].median_us, mine = point[chosen].median_us;
  if (mine <= best) return 0;
  if (best <= 0) return 1e6;  // a tier that takes no measurable time beats any that does
  return mine / best - 1;
}

PolicyFit evaluate_policy(std::span<const GridPoint> grid, const PolicyConfig& policy) {
  validate_grid(grid, "evaluate_policy");
  PolicyFit fit;
  for (const GridPoint& point : grid) {
    PointFit result;
    result.tokens = point.tokens;
    result.fastest = fastest_tier(point);
    const TierDecision decision = decide(point.tokens, policy, grid_support(point));
    result.chosen = decision.tier;
    result.fallback = decision.tier && !policy.forced_tier.value &&
                      *decision.tier != preferred_tier(point.tokens, policy);
    if (result.chosen && result.fastest) {
      result.regret = regret_of(point, *result.chosen, *result.fastest);
    }
    fit.total_regret += result.regret;
    fit.max_regret = std::max(fit.max_regret, result.regret);
    fit.points.push_back(result);
  }
  return fit;
}

// ---- matching -----------------------------------------------------------------------------------

bool TableProvenance::operator==(const TableProvenance& o) const {
  return lmoe_version == o.lmoe_version && backend == o.backend && gpu == o.gpu &&
         driver_version == o.driver_version && nccl_version == o.nccl_version && tp == o.tp &&
         dims.d_model == o.dims.d_model && dims.d_latent == o.dims.d_latent && dtype == o.dtype &&
         comm == o.comm && date_utc == o.date_utc && hostname == o.hostname && preset == o.preset &&
         mode == o.mode && warmup == o.warmup && iters == o.iters && cold_l2 == o.cold_l2 &&
         layers == o.layers && settings == o.settings && eps == o.eps &&
         derived_from == o.derived_from;
}

std::optional<std::string> nvidia_driver_version() {
  // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Thu ..." (open and proprietary
  // modules alike): the first token after "Kernel Module" that starts with a digit.
  std::ifstream file("/proc/driver/nvidia/version");
  std::string line;
  if (!file || !std::getline(file, line)) return std::nullopt;
  const std::size_t at = line.find("Kernel Module");
  if (at == std::string::npos) return std::nullopt;
  std::istringstream words(line.substr(at + 13));
  std::string word;
  while (words >> word) {
    if (!word.empty() && word[0] >= '0' && word[0] <= '9') return word;
  }
  return std::nullopt;
}

namespace {

std::string quoted(const std::optional<std::string>& value) {
  return value ? "'" + *value + "'" : std::string("none");
}

std::string cuda_version_text(int version) {
  return std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10);
}

}  // namespace

std::vector<std::string> match_tier_table(const TableProvenance& table,
                                          const RunningConfig& running,
                                          const std::string& table_name) {
  std::vector<std::string> differences;
  const auto refuse_if = [&](bool differ, const std::string& field, const std::string& in_table,
                             const std::string& here) {
    if (differ)
      differences.push_back(field + " is " + in_table + " in the table, " + here + " here");
  };
  refuse_if(table.backend != running.backend, "backend", std::string(backend_name(table.backend)),
            std::string(backend_name(running.backend)));
  if (table.gpu && running.gpu) {
    refuse_if(table.gpu->name != running.gpu->name, "gpu.name", "'" + table.gpu->name + "'",
              "'" + running.gpu->name + "'");
    refuse_if(table.gpu->compute_capability != running.gpu->compute_capability,
              "gpu.compute_capability", table.gpu->compute_capability,
              running.gpu->compute_capability);
  }
  refuse_if(table.tp != running.tp, "tp", std::to_string(table.tp), std::to_string(running.tp));
  refuse_if(table.dims.d_model != running.dims.d_model, "d_model",
            std::to_string(table.dims.d_model), std::to_string(running.dims.d_model));
  refuse_if(table.dims.d_latent != running.dims.d_latent, "d_latent",
            std::to_string(table.dims.d_latent), std::to_string(running.dims.d_latent));
  refuse_if(table.dtype != running.dtype, "dtype", std::string(dtype_name(table.dtype)),
            std::string(dtype_name(running.dtype)));
  if (running.comm) {
    refuse_if(table.comm != *running.comm, "comm", "'" + table.comm + "'",
              "'" + *running.comm + "'");
  }
  if (!differences.empty()) {
    std::string message = "tier table " + table_name + " was measured for another configuration: ";
    for (std::size_t i = 0; i < differences.size(); ++i) {
      message += (i == 0 ? "" : "; ") + differences[i];
    }
    throw Error(message + " (measure this configuration, or leave the table out)");
  }

  std::vector<std::string> warnings;
  const auto warn_if = [&](bool differ, const std::string& field, const std::string& in_table,
                           const std::string& here) {
    if (differ) {
      warnings.push_back("tier table " + table_name + ": " + field + " is " + in_table +
                         " in the table, " + here +
                         " here; the table is used, but its measurements may not hold");
    }
  };
  if (table.gpu && running.gpu) {
    warn_if(table.gpu->cuda_driver_version != running.gpu->cuda_driver_version,
            "gpu.cuda_driver_version", cuda_version_text(table.gpu->cuda_driver_version),
            cuda_version_text(running.gpu->cuda_driver_version));
    warn_if(table.gpu->cuda_runtime_version != running.gpu->cuda_runtime_version,
            "gpu.cuda_runtime_version", cuda_version_text(table.gpu->cuda_runtime_version),
            cuda_version_text(running.gpu->cuda_runtime_version));
  }
  if (table.backend == Backend::cuda) {
    warn_if(table.driver_version != running.driver_version, "driver_version",
            quoted(table.driver_version), quoted(running.driver_version));
    warn_if(table.nccl_version != running.nccl_version, "nccl_version", quoted(table.nccl_version),
            quoted(running.nccl_version));
  }
  if (!running.lmoe_version.empty()) {
    warn_if(table.lmoe_version != running.lmoe_version, "lmoe_version",
            "'" + table.lmoe_version + "'", "'" + running.lmoe_version + "'");
  }
  if (running.cold_l2) {
    // Cold and warm weights change the tiers' times, and not equally (docs/bench.md, "Cold L2").
    warn_if(table.cold_l2 != *running.cold_l2, "cold_l2", table.cold_l2 ? "true" : "false",
            *running.cold_l2 ? "true" : "false");
  }
  if (running.layers) {
    // Tails timed in a graph of their own or several to a graph pay the replay's own cost
    // differently (docs/bench.md, "Layers").
    warn_if(table.layers != *running.layers, "layers", std::to_string(table.layers),
            std::to_string(*running.layers));
  }
  if (running.settings) {
    // A setting that picks another kernel or algorithm changes the times the table holds.
    for (const std::string& difference :
         timing_settings_differences(table.settings, *running.settings, "the table", "here")) {
      warnings.push_back("tier table " + table_name + ": " + difference +
                         "; the table is used, but its measurements may not hold");
    }
  }
  return warnings;
}

// ---- evidence -----------------------------------------------------------------------------------

namespace {

std::string microseconds(double us) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f us", us);
  return text;
}

}  // namespace

std::optional<std::string> describe_measurement(const TierTable& table, std::int64_t tokens,
                                                std::optional<TailTier> chosen,
                                                const std::string& table_name) {
  const GridPoint* point = nearest_grid_point(table.grid, tokens);
  if (point == nullptr) return std::nullopt;
  std::string line = "table " + table_name + " measured at T=" + std::to_string(point->tokens);
  if (point->tokens != tokens) line += " (nearest to T=" + std::to_string(tokens) + ")";
  line += ":";
  std::vector<TailTier> ran, other;
  for (TailTier tier : kAllTiers) ((*point)[tier].ran() ? ran : other).push_back(tier);
  std::stable_sort(ran.begin(), ran.end(), [&](TailTier a, TailTier b) {
    return (*point)[a].median_us < (*point)[b].median_us;
  });
  std::string sep = " ";
  for (TailTier tier : ran) {
    line += sep + std::string(tier_name(tier)) + " " + microseconds((*point)[tier].median_us) +
            (chosen == tier ? " (chosen)" : "");
    sep = ", ";
  }
  for (TailTier tier : other) {
    const TierTiming& timing = (*point)[tier];
    line += sep + std::string(tier_name(tier)) +
            (timing.status == TierTiming::Status::declined ? " declined (" + timing.reason + ")"
                                                           : std::string(" not measured"));
    sep = ", ";
  }
  return line;
}

}  // namespace lmoe

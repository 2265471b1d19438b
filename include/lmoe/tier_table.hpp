// Tier tables: the measured grid of tier times over T, the breakpoints and ranges a policy takes
// from it, the file format (lmoe-tier-table, versions 1 to 3), the check that a table fits the
// configuration that loads it, and the tables built into lmoe. How tables are made from
// measurements is the tools' (lmoe/tools/tier_tuning.hpp); docs/tuning.md has the format and the
// matching rules.
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "lmoe/backend.hpp"
#include "lmoe/dims.hpp"
#include "lmoe/dtype.hpp"
#include "lmoe/tier.hpp"
#include "lmoe/tier_policy.hpp"
#include "lmoe/timing_settings.hpp"

namespace lmoe {

// ---- the measured grid --------------------------------------------------------------------------

// One tier at one T: its time over the sweep's iterations, or why it could not run.
struct TierTiming {
  enum class Status : std::uint8_t { not_measured, ran, declined };
  Status status = Status::not_measured;
  double median_us = 0, p10_us = 0, p90_us = 0;  // when ran
  std::string reason;                            // when declined

  static TierTiming measured(double median_us, double p10_us, double p90_us);
  static TierTiming declined_because(std::string reason);
  bool ran() const { return status == Status::ran; }
};

struct GridPoint {
  std::int64_t tokens = 0;
  std::array<TierTiming, 4> tiers;  // indexed by TailTier

  TierTiming& operator[](TailTier tier) { return tiers[static_cast<std::size_t>(tier)]; }
  const TierTiming& operator[](TailTier tier) const {
    return tiers[static_cast<std::size_t>(tier)];
  }
};

// The tier with the least median at this point (a tie goes to the earlier tier); nullopt when
// none ran.
std::optional<TailTier> fastest_tier(const GridPoint& point);

// The tiers that cannot be chosen at this point: declined (with the sweep's reason) or not
// measured.
TierSupport grid_support(const GridPoint& point);
// The grid point nearest to T on a log scale (ties: the smaller T); nullptr for an empty grid.
const GridPoint* nearest_grid_point(std::span<const GridPoint> grid, std::int64_t tokens);

// ---- breakpoints --------------------------------------------------------------------------------

// fused_max_tokens or overlap_max_tokens when the tier's range has no upper end.
inline constexpr std::int64_t kNoTokenLimit = std::numeric_limits<std::int64_t>::max();

struct Breakpoints {
  std::int64_t fused_max_tokens = 0;
  std::int64_t overlap_max_tokens = 0;
  std::optional<std::int64_t> column_max_tokens;  // nullopt: no limit (token is never preferred)
  bool operator==(const Breakpoints&) const = default;
};

// The built-in policy with these three breakpoints, each from SettingSource::table and `origin`.
PolicyConfig policy_from(const Breakpoints& breakpoints, const std::string& origin);
// The built-in policy with these ranges (SettingSource::table, origin + " ranges"); lmoe::Error
// when they are malformed (validate_tier_ranges).
PolicyConfig policy_from(const std::vector<TierRange>& ranges, const std::string& origin);

struct PointFit {
  std::int64_t tokens = 0;
  std::optional<TailTier> fastest;  // nullopt: no tier ran at this T
  std::optional<TailTier> chosen;   // decide()'s pick; nullopt: no tier can run
  bool fallback = false;            // the preferred tier was declined and `chosen` stood in
  double regret = 0;                // median(chosen) / median(fastest) − 1; 0 where nothing ran
};

// How a policy does on a grid.
struct PolicyFit {
  std::vector<PointFit> points;  // in the grid's order
  double total_regret = 0;       // the sum over points
  double max_regret = 0;
};

// How `policy` does on the grid: what it chooses at every point, and the regret.
PolicyFit evaluate_policy(std::span<const GridPoint> grid, const PolicyConfig& policy);

// ---- tier tables, version 3 ---------------------------------------------------------------------

struct TableGpu {
  std::string name;                // "NVIDIA H200"
  std::string compute_capability;  // "9.0"
  int cuda_driver_version = 0;     // cudaDriverGetVersion: the CUDA version the driver supports
  int cuda_runtime_version = 0;    // cudaRuntimeGetVersion
  bool operator==(const TableGpu&) const = default;
};

// Where a table derived from a recorded sweep (`lmoe tune --from-sweep`) came from.
struct TableSweepSource {
  std::string path;         // the sweep file, as it was named
  std::string date_utc;     // the sweep's own date (when it was measured)
  std::string derived_utc;  // when the table was derived from it
  bool operator==(const TableSweepSource&) const = default;
};

// What a table's measurements hold for. Matched against the running configuration: the hardware,
// dims, dtype, tp, backend and comm must be equal; versions of software may differ with a warning.
struct TableProvenance {
  std::string lmoe_version;
  Backend backend = Backend::cpu;
  std::optional<TableGpu> gpu;                // cuda: device 0
  std::optional<std::string> driver_version;  // the NVIDIA kernel driver, "580.159.04"
  std::optional<std::string> nccl_version;    // builds with NCCL
  int tp = 1;
  TailDims dims;
  DType dtype = DType::bf16;
  std::string comm;
  // For the record only (not matched).
  std::string date_utc, hostname, preset, mode;
  int warmup = 0, iters = 0;
  bool cold_l2 = false;  // L2 evicted before each timed iteration; absent (false) in older tables
  int layers = 1;  // tails a timed iteration (BenchOptions::layers); absent (1) in older tables
  // The timing settings the measurements were taken with (lmoe/timing_settings.hpp); absent (none)
  // in older tables. Loading the table under other settings warns.
  TimingSettings settings;
  std::optional<float> eps;                      // absent in tables written before it was recorded
  std::optional<TableSweepSource> derived_from;  // nullopt: measured by `lmoe tune` itself
  bool operator==(const TableProvenance& other) const;  // every field
};

struct TierTable {
  TableProvenance provenance;
  std::vector<GridPoint> grid;    // sorted by T
  std::vector<TierRange> ranges;  // what the policy uses; empty in a version-2 table
  Breakpoints breakpoints;        // for readers of version 2
};

// JSON text of format "lmoe-tier-table", version 3, with each grid point's fit (by the ranges and
// by the breakpoints) for readers. lmoe::Error when the ranges are malformed.
std::string write_tier_table(const TierTable& table);
// Reads a version-2 or version-3 table; lmoe::Error naming `origin` and the bad field otherwise.
TierTable read_tier_table(const std::string& json_text, const std::string& origin);
// read_tier_table of a file (origin: its path); lmoe::Error naming the path when it cannot be read.
TierTable read_tier_table_file(const std::string& path);

// The configuration a table is matched against. Fields left unset are not compared.
struct RunningConfig {
  Backend backend = Backend::cpu;
  std::optional<TableGpu> gpu;
  std::optional<std::string> driver_version;
  std::optional<std::string> nccl_version;
  int tp = 1;
  TailDims dims;
  DType dtype = DType::bf16;
  std::optional<std::string> comm;
  std::string lmoe_version;
  // Ranks of the tail's group on this rank's GPU (p2p ranks may share one, LMOE_P2P_SHARED_GPU).
  // Not part of a table's provenance: the tables built into lmoe were all measured with one rank
  // per GPU, and with_shipped_tier_table keeps them away from ranks that share one.
  int ranks_per_gpu = 1;
  // How a measurement here was taken, compared (with a warning) when set: a sweep's, when a table
  // judges it; a plain run has no cache state or timing settings of its own to compare.
  std::optional<bool> cold_l2;
  std::optional<int> layers;
  std::optional<TimingSettings> settings;
};

// The NVIDIA kernel driver's version from /proc/driver/nvidia/version; nullopt where there is none.
std::optional<std::string> nvidia_driver_version();

// Throws lmoe::Error listing every field in which the table and the running configuration differ
// (GPU name, compute capability, backend, tp, d_model, d_latent, dtype, comm), each with both
// values. Returns one warning per software version that differs (driver, CUDA driver and runtime,
// NCCL, lmoe), per timing setting set differently and for another cold_l2 or layers (each when set
// in `running`): the table is used, but its measurements may no longer hold.
std::vector<std::string> match_tier_table(const TableProvenance& table,
                                          const RunningConfig& running,
                                          const std::string& table_name);

// One line citing the table's measurements at the grid point nearest to T, fastest first:
// "table t.json measured at T=256 (nearest to T=300): token 812.0 us (chosen), column 901.0 us,
// ...". nullopt when the table has no grid.
std::optional<std::string> describe_measurement(const TierTable& table, std::int64_t tokens,
                                                std::optional<TailTier> chosen,
                                                const std::string& table_name);

// ---- tier tables built into lmoe ----------------------------------------------------------------

// A tier table the project measured and built into the library: the files
// src/models/<model>/tier_tables/*.json, named by their path under src/models.
struct ShippedTierTable {
  std::string_view name;  // "kimi_k3/tier_tables/h200x2_tp2_p2p.json"
  std::string_view json;  // the file's text (version 3)
};
std::span<const ShippedTierTable> shipped_tier_tables();

// `policy` with the first shipped table that holds for `running` applied (apply_tier_table, origin
// and table_path "shipped table NAME"), when nothing of the policy's choice of tier is set yet
// (the breakpoints, overlap_disabled and the ranges built in, no table; a forced tier still wins
// over the table) and `running` names its comm (and its GPU, for a table measured on one), and
// the decode kernel is not turned off (LMOE_FUSED_DECODE=0: the fused ranges were measured with
// it); otherwise `policy` as it is. A table holds where match_tier_table accepts it (software
// versions may differ; the caller's match then warns) and the ranks have a GPU each
// (`running.ranks_per_gpu` 1: the tables were measured so, and ranks sharing a GPU run slower than
// they say).
PolicyConfig with_shipped_tier_table(PolicyConfig policy, const RunningConfig& running);

}  // namespace lmoe

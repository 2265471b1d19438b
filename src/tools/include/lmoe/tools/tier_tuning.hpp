// Tier selection by measurement: tuning a table from a sweep of every tier over T (the ranges and
// the breakpoints that serve the grid best) and the check of a policy against a fresh sweep. The
// table format and its matching are lmoe/tier_table.hpp.
//
// find_ranges gives every grid point the tier decide() ends up with when it prefers the fastest
// measured tier there (so declines count), merges neighbours with equal tiers and puts each
// boundary between grid points a < b where the two tiers' medians cross, interpolated linearly in
// T (else at floor(sqrt(a·b))): any tier in any T range, zero regret at every grid point where the
// fastest tier can run. The breakpoints (tier_policy.hpp) can express
// one order only: fused for T <= fused_max_tokens, overlap up to overlap_max_tokens, column up to
// column_max_tokens, token above; find_breakpoints picks, among every such assignment of the grid's
// T, the one with the least total regret, where the regret at T is median(chosen)/median(fastest) −
// 1 and `chosen` is what decide() picks (fallbacks from declined tiers included). Tables keep both:
// the policy uses the ranges, older readers the breakpoints. docs/tuning.md has the whole rule, the
// file format and the matching rules.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "lmoe/backend_registry.hpp"
#include "lmoe/dims.hpp"
#include "lmoe/dtype.hpp"
#include "lmoe/tier.hpp"
#include "lmoe/tier_policy.hpp"
#include "lmoe/tier_table.hpp"
#include "lmoe/tools/tail_bench.hpp"

namespace lmoe {

// ---- the measured grid, from a sweep --------------------------------------------------------

// One comm's records of a sweep as a grid, sorted by T (records of other comms are ignored).
// Throws lmoe::Error when the comm has no records.
std::vector<GridPoint> grid_from_records(std::span<const BenchRecord> records,
                                         std::string_view comm);

struct BreakpointFit : PolicyFit {
  Breakpoints breakpoints;
};

struct RangeFit : PolicyFit {
  std::vector<TierRange> ranges;
};

// The breakpoints with the least total regret over the grid (sorted by T, each T once, T >= 1;
// lmoe::Error otherwise). Ties go to the assignment that runs the fastest tier at the most points,
// then to the fewest fallbacks, then to the smallest breakpoints. Between two grid points a
// breakpoint sits where the two tiers' medians, interpolated linearly in T, cross (when both ran
// at both points and each is at least as fast at its own end), else at the geometric mean of the
// two T; rounded down. The tier that runs at the largest T keeps running above it.
BreakpointFit find_breakpoints(std::span<const GridPoint> grid);

// The ranges for the grid (sorted by T, each T once, T >= 1; lmoe::Error otherwise): at each point
// the tier decide() runs when the fastest measured tier is preferred there, consecutive equal tiers
// merged, the boundary between grid points a < b placed as find_breakpoints places a breakpoint
// (where the two tiers' medians cross, interpolated linearly in T, when both ran at both points
// and each is at least as fast at its own end; else floor(sqrt(a·b))); T <= boundary takes a's
// tier, the last piece unbounded. A point where no tier ran takes the tier of the point before it
// (the first such points, the tier after them); a grid where nothing ran at all gives fused
// everywhere.
RangeFit find_ranges(std::span<const GridPoint> grid);

// floor(sqrt(a·b)) exactly, for 1 <= a < b: the boundary between a and b where the two tiers'
// crossing cannot be interpolated.
std::int64_t range_boundary(std::int64_t a, std::int64_t b);

// ---- tuning -------------------------------------------------------------------------------------

// The default grid of `lmoe tune`: cuda powers of two from 1 to 32768 and the midpoints 3·2^k
// between them (where crossovers fall between powers of two); cpu a short list for small dims.
std::vector<std::int64_t> default_tune_tokens(Backend backend);

struct TuneResult {
  BenchResult bench;  // the sweep
  TierTable
      table;  // its grid, the ranges find_ranges chose and the breakpoints find_breakpoints chose
  RangeFit range_fit;
  BreakpointFit breakpoint_fit;
  // The sweep had no comm error and every checked output met the contract.
  bool ok() const { return bench.ok(); }
};

// Sweeps every tier of options.tiers over options.tokens with the one comm in options.comms
// (empty: the backend's default), then finds the ranges and the breakpoints. `preset` is recorded
// only.
TuneResult tune_tiers(const BenchOptions& options, const std::string& preset,
                      const BenchProgressFn& progress = {});

// ---- tables from recorded sweeps ----------------------------------------------------------------

// The comm of a recorded sweep to derive a table from or check one with: `comm` when given (the
// sweep must hold records of it), else the sweep's only comm. lmoe::Error naming `origin` and the
// sweep's comms otherwise.
std::string sweep_comm(const BenchSweep& sweep, const std::optional<std::string>& comm,
                       const std::string& origin);

// The configuration the sweep ran with `comm`, to match a table against it (match_tier_table): its
// backend, GPU, kernel driver, CUDA and NCCL versions, lmoe version, tp, dims and dtype.
RunningConfig running_config_of(const BenchSweep& sweep, const std::string& comm);

// What tune_tiers does, from a recorded sweep instead of a measurement: the records of one comm
// (sweep_comm) fitted exactly as tune_tiers fits its own, into a table whose provenance is the
// sweep's (hardware and versions, dims, dtype, eps, tp, comm, date, mode, warm-up, iterations) with
// derived_from = {origin, the sweep's date, now}. Records above the sweep's check_max_tokens were
// not checked; their timings are used, as tune_tiers uses its own. lmoe::Error naming `origin`
// when the comm failed in the sweep, the sweep did not time every tier at every T, or a record of
// the comm was wrong (`ok` false: each such record by index, T and tier), as tune_tiers writes no
// table then.
TuneResult tune_from_sweep(const BenchSweep& sweep, const std::optional<std::string>& comm,
                           const std::string& origin);

// The table with its ranges and breakpoints fitted again to its own grid by this version's rules
// (`lmoe tune --refit`): grid and provenance as they are, nothing measured; `bench` is empty. For
// a table tuned before a rule changed (docs/tuning.md). lmoe::Error for a table without a grid.
TuneResult refit_tier_table(const TierTable& table);

// ---- checking a policy against a sweep ----------------------------------------------------------

// The records with `chosen` set again, as `policy` chooses at each (comm, T): decide() with the
// tiers the records declined there as declined. A tier without a record at (comm, T) counts as
// able to run; when the policy chooses it, no record is chosen (check_choices: not timed). This is
// how a table is checked against a recorded sweep (`lmoe bench --check-table --from-sweep`).
std::vector<BenchRecord> choose_again(std::span<const BenchRecord> records,
                                      const PolicyConfig& policy);

// At one (comm, T) of a sweep: the policy's choice against the fastest tier measured.
struct ChoiceCheck {
  std::string comm;
  std::int64_t tokens = 0;
  std::optional<TailTier> chosen;   // nullopt: the policy chose a tier the sweep did not time
  std::optional<TailTier> fastest;  // nullopt: no tier ran
  double chosen_median_us = 0, fastest_median_us = 0, fastest_p90_us = 0;
  double ratio = 1;  // chosen / fastest median
  enum class Verdict : std::uint8_t {
    fastest,         // the choice is the fastest tier
    within_percent,  // median <= (1 + tolerance) · the fastest's median
    within_spread,   // median <= the fastest's p90
    slower,          // worse than both: a failure
    not_timed,       // the choice was not timed: a failure
    nothing_ran,     // no tier ran at this T: nothing to judge
  } verdict = Verdict::nothing_ran;
  bool ok() const { return verdict != Verdict::slower && verdict != Verdict::not_timed; }
};
std::string_view verdict_name(ChoiceCheck::Verdict verdict);

// One check per (comm, T) of the records, in their order. The `chosen` flag of the records is the
// policy's choice.
std::vector<ChoiceCheck> check_choices(std::span<const BenchRecord> records,
                                       double tolerance = 0.03);

}  // namespace lmoe

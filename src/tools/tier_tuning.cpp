#include "lmoe/tools/tier_tuning.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include "core/grid_fit.hpp"
#include "lmoe/comm_group.hpp"
#include "lmoe/error.hpp"
#include "lmoe/version.hpp"

namespace lmoe {

// ---- the measured grid --------------------------------------------------------------------------

std::vector<GridPoint> grid_from_records(std::span<const BenchRecord> records,
                                         std::string_view comm) {
  std::map<std::int64_t, GridPoint> by_tokens;
  for (const BenchRecord& record : records) {
    if (record.comm != comm) continue;
    GridPoint& point = by_tokens[record.tokens];
    point.tokens = record.tokens;
    point[record.tier] = record.declined
                             ? TierTiming::declined_because(*record.declined)
                             : TierTiming::measured(record.stats.median * 1e6,
                                                    record.stats.p10 * 1e6, record.stats.p90 * 1e6);
  }
  LMOE_CHECK(!by_tokens.empty(),
             "grid_from_records: no records of comm '" + std::string(comm) + "'");
  std::vector<GridPoint> grid;
  for (auto& [tokens, point] : by_tokens) grid.push_back(std::move(point));
  return grid;
}

namespace {

// The tier decide() runs at `point` when `preferred` is the tier the policy prefers there.
// decide() depends on the policy only through the preferred tier, so one piece preferring it for
// every T stands for every policy that prefers it at this T.
std::optional<TailTier> decided_when_preferring(const GridPoint& point, TailTier preferred) {
  const PolicyConfig config =
      policy_from(std::vector<TierRange>{{std::nullopt, preferred}}, "candidate");
  return decide(point.tokens, config, grid_support(point)).tier;
}

// Where a breakpoint or a range boundary between grid points `lower` and `upper` (the last T of one
// range and the first of the next) goes: the crossing of the two tiers' medians, interpolated
// linearly in T, when both tiers ran at both points and each is the faster one at its own end; else
// the geometric mean (range_boundary). The crossing lands nearer the measured change of the
// fastest tier than the geometric mean does (docs/tuning.md).
std::int64_t place_breakpoint(const GridPoint& lower, const GridPoint& upper,
                              std::optional<TailTier> lower_tier,
                              std::optional<TailTier> upper_tier) {
  if (lower_tier && upper_tier && *lower_tier != *upper_tier && lower[*lower_tier].ran() &&
      lower[*upper_tier].ran() && upper[*lower_tier].ran() && upper[*upper_tier].ran()) {
    // Each tier at least as fast at its own end, and one of them strictly: they cross in between
    // (at an end where they tie).
    const double margin_lo = lower[*upper_tier].median_us - lower[*lower_tier].median_us;
    const double margin_hi = upper[*lower_tier].median_us - upper[*upper_tier].median_us;
    if (margin_lo >= 0 && margin_hi >= 0 && margin_lo + margin_hi > 0) {
      const double lo = static_cast<double>(lower.tokens), hi = static_cast<double>(upper.tokens);
      const double crossing = lo + (hi - lo) * margin_lo / (margin_lo + margin_hi);
      const auto at = static_cast<std::int64_t>(std::floor(crossing));
      return std::clamp(at, lower.tokens, upper.tokens - 1);
    }
  }
  return range_boundary(lower.tokens, upper.tokens);
}

}  // namespace

BreakpointFit find_breakpoints(std::span<const GridPoint> grid) {
  validate_grid(grid, "find_breakpoints");
  const std::size_t n = grid.size();

  // For every point and preferred tier: the regret of what then runs, and whether it falls back.
  struct Outcome {
    double regret = 0;
    bool not_fastest = false;  // something else is the fastest (a tie at zero regret)
    bool fallback = false;
  };
  std::vector<std::array<Outcome, 4>> outcome(n);
  for (std::size_t p = 0; p < n; ++p) {
    const std::optional<TailTier> fastest = fastest_tier(grid[p]);
    for (TailTier preferred : kAllTiers) {
      const std::optional<TailTier> runs = decided_when_preferring(grid[p], preferred);
      Outcome& o = outcome[p][static_cast<std::size_t>(preferred)];
      o.fallback = runs && *runs != preferred;
      o.not_fastest = runs != fastest;
      if (runs && fastest) o.regret = regret_of(grid[p], *runs, *fastest);
    }
  }

  // Every assignment the breakpoints can express: points [0, i) fused, [i, j) overlap, [j, k)
  // column, [k, n) token. The sums are taken in point order for every candidate, so equal
  // assignments give bit-equal totals and ties are exact.
  struct Candidate {
    double regret = 0;
    std::size_t not_fastest = 0, fallbacks = 0;
    std::size_t i = 0, j = 0, k = 0;
    auto key() const { return std::tie(regret, not_fastest, fallbacks, i, j, k); }
  };
  std::optional<Candidate> best;
  for (std::size_t i = 0; i <= n; ++i) {
    for (std::size_t j = i; j <= n; ++j) {
      for (std::size_t k = j; k <= n; ++k) {
        Candidate c{0, 0, 0, i, j, k};
        for (std::size_t p = 0; p < n; ++p) {
          const TailTier preferred = p < i   ? TailTier::fused
                                     : p < j ? TailTier::overlap
                                     : p < k ? TailTier::column
                                             : TailTier::token;
          const Outcome& o = outcome[p][static_cast<std::size_t>(preferred)];
          c.regret += o.regret;
          c.not_fastest += o.not_fastest ? 1 : 0;
          c.fallbacks += o.fallback ? 1 : 0;
        }
        if (!best || c.key() < best->key()) best = c;
      }
    }
  }

  // What runs at each point under the winning assignment, to place each breakpoint between the
  // tiers that actually meet there.
  std::vector<std::optional<TailTier>> runs(n);
  for (std::size_t p = 0; p < n; ++p) {
    const TailTier preferred = p < best->i   ? TailTier::fused
                               : p < best->j ? TailTier::overlap
                               : p < best->k ? TailTier::column
                                             : TailTier::token;
    runs[p] = decided_when_preferring(grid[p], preferred);
  }
  // The breakpoint after the first `count` points: 0 before all of them, no limit after all.
  const auto breakpoint_after = [&](std::size_t count) -> std::optional<std::int64_t> {
    if (count == 0) return 0;
    if (count == n) return std::nullopt;
    return place_breakpoint(grid[count - 1], grid[count], runs[count - 1], runs[count]);
  };
  Breakpoints breakpoints;
  breakpoints.fused_max_tokens = breakpoint_after(best->i).value_or(kNoTokenLimit);
  breakpoints.overlap_max_tokens = breakpoint_after(best->j).value_or(kNoTokenLimit);
  breakpoints.column_max_tokens = breakpoint_after(best->k);

  BreakpointFit fit;
  static_cast<PolicyFit&>(fit) = evaluate_policy(grid, policy_from(breakpoints, "fit"));
  fit.breakpoints = breakpoints;
  // The placed breakpoints must reproduce the assignment they were placed for.
  for (std::size_t p = 0; p < n; ++p) {
    LMOE_CHECK(fit.points[p].chosen == runs[p],
               "find_breakpoints: internal error: the placed breakpoints change T=" +
                   std::to_string(grid[p].tokens));
  }
  return fit;
}

std::int64_t range_boundary(std::int64_t a, std::int64_t b) {
  LMOE_CHECK(a >= 1 && a < b, "range_boundary: expected 1 <= a < b, got a=" + std::to_string(a) +
                                  ", b=" + std::to_string(b));
  // Exact in integers (a·b can exceed 64 bits): the largest r in [a, b − 1] with r² <= a·b, which
  // exists as a² <= a·b < b².
  using Wide = unsigned __int128;
  const Wide product = static_cast<Wide>(a) * static_cast<Wide>(b);
  std::int64_t low = a, high = b - 1;
  while (low < high) {
    const std::int64_t mid = low + (high - low + 1) / 2;
    if (static_cast<Wide>(mid) * static_cast<Wide>(mid) <= product) {
      low = mid;
    } else {
      high = mid - 1;
    }
  }
  return low;
}

RangeFit find_ranges(std::span<const GridPoint> grid) {
  validate_grid(grid, "find_ranges");
  const std::size_t n = grid.size();

  // What runs at each point when its fastest tier is preferred (a declined preference counts as
  // the tier it falls back to); nullopt where no tier ran.
  std::vector<std::optional<TailTier>> runs(n);
  for (std::size_t p = 0; p < n; ++p) {
    if (const std::optional<TailTier> fastest = fastest_tier(grid[p])) {
      runs[p] = decided_when_preferring(grid[p], *fastest);
    }
  }
  // A point where nothing runs costs nothing whichever tier it gets: it joins the piece before it
  // (points before any that runs, the first piece) rather than splitting one.
  const auto first_run =
      std::find_if(runs.begin(), runs.end(), [](const auto& tier) { return tier.has_value(); });
  std::vector<TailTier> tiers(n, first_run != runs.end() ? **first_run : TailTier::fused);
  for (std::size_t p = 1; p < n; ++p) tiers[p] = runs[p] ? *runs[p] : tiers[p - 1];

  std::vector<TierRange> ranges = {{std::nullopt, tiers[0]}};
  for (std::size_t p = 1; p < n; ++p) {
    if (tiers[p] == ranges.back().tier) continue;
    ranges.back().max_tokens = place_breakpoint(grid[p - 1], grid[p], tiers[p - 1], tiers[p]);
    ranges.push_back({std::nullopt, tiers[p]});
  }

  RangeFit fit;
  static_cast<PolicyFit&>(fit) = evaluate_policy(grid, policy_from(ranges, "fit"));
  fit.ranges = std::move(ranges);
  // The placed boundaries must give every point the tier it was given.
  for (std::size_t p = 0; p < n; ++p) {
    LMOE_CHECK(fit.points[p].chosen == runs[p],
               "find_ranges: internal error: the placed ranges change T=" +
                   std::to_string(grid[p].tokens));
  }
  return fit;
}

// ---- tuning -------------------------------------------------------------------------------------

std::vector<std::int64_t> default_tune_tokens(Backend backend) {
  if (backend == Backend::cpu) return {1, 2, 4, 8, 16, 32, 64, 128, 256};
  std::set<std::int64_t> tokens;
  for (std::int64_t t = 1; t <= 32768; t *= 2) {
    tokens.insert(t);
    if (t >= 2 && t < 32768) tokens.insert(3 * t / 2);
  }
  return {tokens.begin(), tokens.end()};
}

namespace {

// The ranges and breakpoints fitted to result.table's grid: what tune_tiers, tune_from_sweep and
// refit_tier_table share.
void fit_grid(TuneResult& result) {
  TierTable& table = result.table;
  result.range_fit = find_ranges(table.grid);
  table.ranges = result.range_fit.ranges;
  result.breakpoint_fit = find_breakpoints(table.grid);
  table.breakpoints = result.breakpoint_fit.breakpoints;
}

// The grid of the table's comm in result.bench, fitted.
void fit_table(TuneResult& result) {
  result.table.grid = grid_from_records(result.bench.records, result.table.provenance.comm);
  fit_grid(result);
}

// The mode of the first record of `comm` that ran (every record of a comm runs in one mode).
std::string mode_of(std::span<const BenchRecord> records, const std::string& comm) {
  for (const BenchRecord& record : records) {
    if (record.comm == comm && !record.declined) return std::string(bench_mode_name(record.mode));
  }
  return "";
}

// What a table fitted to the sweep's records of `comm` holds for, and where they were measured.
TableProvenance provenance_of(const BenchSweep& sweep, const std::string& comm) {
  TableProvenance p;
  const RunningConfig ran = running_config_of(sweep, comm);
  p.lmoe_version = ran.lmoe_version;
  p.backend = ran.backend;
  p.gpu = ran.gpu;
  p.driver_version = ran.driver_version;
  p.nccl_version = ran.nccl_version;
  p.tp = ran.tp;
  p.dims = ran.dims;
  p.dtype = ran.dtype;
  p.eps = sweep.eps;
  p.comm = comm;
  p.date_utc = sweep.date_utc;
  p.hostname = sweep.hostname;
  p.preset = sweep.preset;
  p.warmup = sweep.warmup;
  p.iters = sweep.iters;
  p.cold_l2 = sweep.cold_l2;
  p.layers = sweep.layers;
  p.settings = sweep.settings;
  p.mode = mode_of(sweep.result.records, comm);
  return p;
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
}

}  // namespace

TuneResult tune_tiers(const BenchOptions& options_in, const std::string& preset,
                      const BenchProgressFn& progress) {
  BenchOptions options = options_in;
  if (options.comms.empty()) options.comms = {default_comm_backend(options.backend)};
  LMOE_CHECK(options.comms.size() == 1,
             "tune: expected one comm backend (a table holds for one), got " +
                 std::to_string(options.comms.size()));
  TuneResult result;
  result.bench = run_tail_bench(options, progress);
  if (!result.bench.comm_errors.empty()) {
    throw Error("tune: comm " + result.bench.comm_errors.front().comm +
                " failed: " + result.bench.comm_errors.front().error);
  }
  const std::string& comm = options.comms.front();
  result.table.provenance = provenance_of(
      bench_sweep_of(options, preset, bench_environment(options.backend), result.bench), comm);
  fit_table(result);
  return result;
}

// ---- tables from recorded sweeps ----------------------------------------------------------------

std::string sweep_comm(const BenchSweep& sweep, const std::optional<std::string>& comm,
                       const std::string& origin) {
  std::vector<std::string> comms;  // with records, in the sweep's order
  for (const std::string& name : sweep.comms) {
    const bool has_records =
        std::any_of(sweep.result.records.begin(), sweep.result.records.end(),
                    [&](const BenchRecord& record) { return record.comm == name; });
    if (has_records && std::find(comms.begin(), comms.end(), name) == comms.end()) {
      comms.push_back(name);
    }
  }
  if (comm) {
    LMOE_CHECK(std::find(comms.begin(), comms.end(), *comm) != comms.end(),
               origin + ": no records of comm '" + *comm + "' (the sweep has " +
                   (comms.empty() ? std::string("none") : joined(comms)) + ")");
    return *comm;
  }
  LMOE_CHECK(!comms.empty(), origin + ": no records (the sweep recorded none)");
  LMOE_CHECK(comms.size() == 1, origin + ": the sweep has records of several comms (" +
                                    joined(comms) + "); say which with --comm");
  return comms.front();
}

RunningConfig running_config_of(const BenchSweep& sweep, const std::string& comm) {
  RunningConfig running;
  running.backend = sweep.backend;
  if (sweep.gpu) {
    running.gpu = TableGpu{sweep.gpu->name, sweep.gpu->compute_capability,
                           sweep.gpu->driver_version, sweep.gpu->runtime_version};
  }
  running.driver_version = sweep.driver_version;
  running.nccl_version = sweep.nccl_version;
  running.tp = sweep.tp;
  running.dims = sweep.dims;
  running.dtype = sweep.dtype;
  running.comm = comm;
  running.lmoe_version = sweep.lmoe_version;
  running.cold_l2 = sweep.cold_l2;
  running.layers = sweep.layers;
  running.settings = sweep.settings;
  return running;
}

TuneResult tune_from_sweep(const BenchSweep& sweep, const std::optional<std::string>& comm_in,
                           const std::string& origin) {
  const std::string comm = sweep_comm(sweep, comm_in, origin);
  for (const BenchCommError& error : sweep.result.comm_errors) {
    LMOE_CHECK(error.comm != comm, origin + ": comm " + comm + " failed in the sweep (" +
                                       error.error + "); its records are not a whole sweep");
  }
  // A table is fitted over every tier: one the sweep did not time could have been the fastest.
  std::vector<std::string> timed;
  for (TailTier tier : sweep.tiers) timed.emplace_back(tier_name(tier));
  for (TailTier tier : kAllTiers) {
    LMOE_CHECK(std::find(sweep.tiers.begin(), sweep.tiers.end(), tier) != sweep.tiers.end(),
               origin + ": tiers: the sweep timed " + joined(timed) +
                   "; a table is fitted over every tier (fused, overlap, column, token), as "
                   "`lmoe tune` times all four");
  }

  TuneResult result;
  std::vector<std::string> wrong;
  std::map<std::pair<std::int64_t, TailTier>, std::size_t> seen;
  for (std::size_t i = 0; i < sweep.result.records.size(); ++i) {
    const BenchRecord& record = sweep.result.records[i];
    if (record.comm != comm) continue;
    const std::string name = "records[" + std::to_string(i) +
                             "] (T=" + std::to_string(record.tokens) + " " +
                             std::string(tier_name(record.tier)) + ")";
    const auto [at, fresh] = seen.emplace(std::make_pair(record.tokens, record.tier), i);
    LMOE_CHECK(fresh, origin + ": " + name + " repeats records[" + std::to_string(at->second) +
                          "] of comm " + comm);
    if (!record.ok()) {
      std::vector<std::string> why;
      const Comparison& c = record.comparison;
      if (c.beyond_bound > 0) {
        why.push_back(std::to_string(c.beyond_bound) + " element(s) beyond the numerics contract");
      }
      if (!(c.normwise_error <= c.normwise_tolerance)) {
        why.push_back("error against fp64 math " + std::to_string(c.normwise_error) + " above " +
                      std::to_string(c.normwise_tolerance));
      }
      if (!record.ranks_identical) why.emplace_back("ranks' outputs differ");
      wrong.push_back(name + ": " + joined(why));
    }
    result.bench.records.push_back(record);
  }
  if (!wrong.empty()) {
    std::string message = origin + ": comm " + comm + ": ";
    for (std::size_t i = 0; i < wrong.size(); ++i) message += (i == 0 ? "" : "; ") + wrong[i];
    throw Error(message +
                "; no table is derived from a sweep with a wrong output (as `lmoe tune` "
                "writes none)");
  }
  for (std::int64_t tokens : sweep.tokens) {
    for (TailTier tier : kAllTiers) {
      LMOE_CHECK(seen.count({tokens, tier}),
                 origin + ": no record of comm " + comm + " at T=" + std::to_string(tokens) +
                     " for " + std::string(tier_name(tier)) + " (the sweep lists that T and tier)");
    }
  }

  TableProvenance& p = result.table.provenance;
  p = provenance_of(sweep, comm);
  p.derived_from =
      TableSweepSource{origin, sweep.date_utc, bench_environment(Backend::cpu).date_utc};
  fit_table(result);
  return result;
}

TuneResult refit_tier_table(const TierTable& table) {
  LMOE_CHECK(!table.grid.empty(), "refit_tier_table: the table has no grid to fit");
  TuneResult result;
  result.table = table;
  fit_grid(result);
  return result;
}

// ---- checking a policy against a sweep ----------------------------------------------------------

std::string_view verdict_name(ChoiceCheck::Verdict verdict) {
  switch (verdict) {
    case ChoiceCheck::Verdict::fastest: return "fastest";
    case ChoiceCheck::Verdict::within_percent: return "within tolerance";
    case ChoiceCheck::Verdict::within_spread: return "within spread";
    case ChoiceCheck::Verdict::slower: return "SLOWER";
    case ChoiceCheck::Verdict::not_timed: return "NOT TIMED";
    case ChoiceCheck::Verdict::nothing_ran: return "nothing ran";
  }
  return "?";
}

std::vector<BenchRecord> choose_again(std::span<const BenchRecord> records,
                                      const PolicyConfig& policy) {
  std::map<std::pair<std::string, std::int64_t>, TierSupport> support;
  for (const BenchRecord& record : records) {
    TierSupport& at = support[{record.comm, record.tokens}];
    if (record.declined) at.declined[static_cast<std::size_t>(record.tier)] = *record.declined;
  }
  std::vector<BenchRecord> chosen(records.begin(), records.end());
  for (BenchRecord& record : chosen) {
    const TierDecision decision =
        decide(record.tokens, policy, support.at({record.comm, record.tokens}));
    record.chosen = decision.tier == record.tier;
  }
  return chosen;
}

std::vector<ChoiceCheck> check_choices(std::span<const BenchRecord> records, double tolerance) {
  LMOE_CHECK(tolerance >= 0,
             "check_choices: tolerance: expected >= 0, got " + std::to_string(tolerance));
  // (comm, T) in the order they first appear.
  std::vector<std::pair<std::string, std::int64_t>> keys;
  std::map<std::pair<std::string, std::int64_t>, std::vector<const BenchRecord*>> groups;
  for (const BenchRecord& record : records) {
    auto key = std::make_pair(record.comm, record.tokens);
    if (!groups.count(key)) keys.push_back(key);
    groups[key].push_back(&record);
  }
  std::vector<ChoiceCheck> checks;
  for (const auto& key : keys) {
    ChoiceCheck check;
    check.comm = key.first;
    check.tokens = key.second;
    const BenchRecord* fastest = nullptr;
    const BenchRecord* chosen = nullptr;
    for (const BenchRecord* record : groups[key]) {
      if (record->declined) continue;
      if (!fastest || record->stats.median < fastest->stats.median) fastest = record;
      if (record->chosen) chosen = record;
    }
    if (fastest == nullptr) {
      check.verdict = ChoiceCheck::Verdict::nothing_ran;
      checks.push_back(check);
      continue;
    }
    check.fastest = fastest->tier;
    check.fastest_median_us = fastest->stats.median * 1e6;
    check.fastest_p90_us = fastest->stats.p90 * 1e6;
    if (chosen == nullptr) {
      check.verdict = ChoiceCheck::Verdict::not_timed;
      checks.push_back(check);
      continue;
    }
    check.chosen = chosen->tier;
    check.chosen_median_us = chosen->stats.median * 1e6;
    check.ratio = fastest->stats.median > 0  ? chosen->stats.median / fastest->stats.median
                  : chosen->stats.median > 0 ? std::numeric_limits<double>::infinity()
                                             : 1.0;
    if (chosen == fastest || chosen->stats.median <= fastest->stats.median) {
      check.verdict = ChoiceCheck::Verdict::fastest;
    } else if (chosen->stats.median <= (1 + tolerance) * fastest->stats.median) {
      check.verdict = ChoiceCheck::Verdict::within_percent;
    } else if (chosen->stats.median <= fastest->stats.p90) {
      check.verdict = ChoiceCheck::Verdict::within_spread;
    } else {
      check.verdict = ChoiceCheck::Verdict::slower;
    }
    checks.push_back(check);
  }
  return checks;
}

}  // namespace lmoe

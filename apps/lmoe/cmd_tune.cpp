// `lmoe tune`: measures every tier over a grid of T for one configuration (dims, dtype, tp,
// backend, comm), finds the ranges (any tier in any T range) and the breakpoints with the least
// regret, and writes a tier table (version 3) that `--tier-table` and LMOE_TIER_TABLE load. The
// sweep and the fits are the library's (include/lmoe/tier_tuning.hpp); docs/tuning.md says how the
// ranges and the breakpoints are chosen. With --from-sweep FILE nothing is measured: the table is
// fitted to the records of a sweep recorded with `lmoe bench --json` (tune_from_sweep).
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>

#include "common.hpp"
#include "core/host_math.hpp"
#include "lmoe/comm_group.hpp"
#include "lmoe/error.hpp"
#include "progress.hpp"
#include "sweep_options.hpp"
#include "table.hpp"

namespace lmoe::cli {

namespace {

struct TuneCommand {
  CLI::App* app = nullptr;
  SweepOptions sweep;
  std::string comm;
  std::int64_t check_max_tokens = 64;
  std::string output;
  std::string from_sweep;  // derive the table from this recorded sweep instead of measuring
  std::string refit;       // fit this table's own grid again instead of measuring

  void execute();
  void measure();
  void derive();
  void refit_table();
  // Prints the grid and the fits; writes the table unless a checked output was wrong.
  void report(const TuneResult& result, const std::string& setting, const std::string& where);
};

std::string percent(double fraction) { return fixed(fraction * 100, 1) + "%"; }

std::string describe(const Breakpoints& b) {
  const auto limit = [](std::int64_t value) {
    return value == kNoTokenLimit ? std::string("no limit") : std::to_string(value);
  };
  return "fused_max_tokens " + limit(b.fused_max_tokens) + ", overlap_max_tokens " +
         limit(b.overlap_max_tokens) + ", column_max_tokens " +
         (b.column_max_tokens ? std::to_string(*b.column_max_tokens) : std::string("none"));
}

// Fail before the work, not after it (and leave no empty file behind).
void probe_output(const std::string& output) {
  const bool existed = std::filesystem::exists(output);
  std::ofstream probe(output, std::ios::app);
  if (!probe) throw Error("--output: cannot write '" + output + "'");
  probe.close();
  if (!existed) std::filesystem::remove(output);
}

std::string describe_setting(const std::string& preset, const TableProvenance& p,
                             std::size_t token_counts) {
  return preset + ", d_model " + std::to_string(p.dims.d_model) + ", d_latent " +
         std::to_string(p.dims.d_latent) + ", " + std::string(dtype_name(p.dtype)) + ", tp " +
         std::to_string(p.tp) + ", backend " + std::string(backend_name(p.backend)) + ", comm " +
         p.comm + ", " + std::to_string(token_counts) + " token counts, " +
         std::to_string(p.warmup) + " warm-up + " + std::to_string(p.iters) + " timed iterations" +
         layers_note(p.layers) + l2_note(p.backend, p.cold_l2) + settings_note(p.settings);
}

void TuneCommand::execute() {
  if (!refit.empty()) {
    refit_table();
  } else if (!from_sweep.empty()) {
    derive();
  } else {
    measure();
  }
}

void TuneCommand::measure() {
  const SweepOptions::Resolved resolved = sweep.resolve(*app, default_tune_tokens);
  BenchOptions options = resolved.options;
  const Backend chosen_backend = options.backend;
  // The grid is sorted: the breakpoints lie between neighbours.
  std::sort(options.tokens.begin(), options.tokens.end());
  options.tokens.erase(std::unique(options.tokens.begin(), options.tokens.end()),
                       options.tokens.end());
  const std::string chosen_comm = resolve_comm(comm, chosen_backend);
  if (auto limit = comm_group_limit(chosen_comm, options.tp))
    throw Error("--comm " + chosen_comm + ": " + *limit);
  options.comms = {chosen_comm};
  LMOE_CHECK(check_max_tokens >= 0,
             "--check-max-tokens: expected >= 0, got " + std::to_string(check_max_tokens));
  check_at_most("--check-max-tokens", check_max_tokens, kMaxTokens, "tokens");
  options.check_max_tokens = check_max_tokens;
  validate_bench_options(options);
  probe_output(output);
  if (chosen_backend == Backend::cpu) cpu::set_blas_threads(1);  // ranks are the parallelism

  TableProvenance planned;
  planned.dims = options.dims;
  planned.dtype = options.dtype;
  planned.tp = options.tp;
  planned.backend = chosen_backend;
  planned.comm = chosen_comm;
  planned.warmup = options.warmup;
  planned.iters = options.iters;
  planned.cold_l2 = options.cold_l2;
  planned.layers = options.layers;
  const std::string setting = describe_setting(resolved.preset, planned, options.tokens.size());
  std::cerr << "lmoe tune: " << setting << "\n";

  TuneResult result;
  {
    ProgressPrinter printer("lmoe tune");
    result = tune_tiers(options, resolved.preset,
                        [&printer](const BenchProgress& progress) { printer(progress); });
  }
  report(result, setting, "");
}

// Everything that would shape a measurement comes from the file with --from-sweep and --refit:
// giving it too is a mistake (it would silently not apply).
void refuse_measuring_options(const CLI::App& app, const SweepOptions& sweep,
                              const std::string& flag, const std::string& source) {
  std::vector<std::string> measuring = sweep.given(app);
  if (app.count("--check-max-tokens") > 0) measuring.push_back("--check-max-tokens");
  if (flag == "--refit" && app.count("--comm") > 0) measuring.push_back("--comm");
  if (measuring.empty()) return;
  std::string names;
  for (const std::string& name : measuring) names += (names.empty() ? "" : ", ") + name;
  throw Error(flag + ": " + names + (measuring.size() == 1 ? " shapes" : " shape") +
              " a measurement; with " + flag + " the configuration, grid and iterations are the " +
              source + "'s (leave " + (measuring.size() == 1 ? "it" : "them") +
              " out, or measure with `lmoe tune`)");
}

void TuneCommand::refit_table() {
  refuse_measuring_options(*app, sweep, "--refit", "table");
  LMOE_CHECK(from_sweep.empty(),
             "--refit and --from-sweep: give one (a table to fit again, or a "
             "recorded sweep to derive one from)");
  const TierTable table = read_tier_table_file(refit);
  probe_output(output);
  const TuneResult result = refit_tier_table(table);
  const TableProvenance& p = result.table.provenance;
  const std::string setting = describe_setting(p.preset, p, result.table.grid.size());
  std::cerr << "lmoe tune: " << setting << ", fitted again from the grid of " << refit << "\n";
  report(result, setting,
         ", fitted again from the grid of " + refit + " (measured " + p.date_utc + ", host " +
             p.hostname + "; nothing measured here)");
}

void TuneCommand::derive() {
  refuse_measuring_options(*app, sweep, "--from-sweep", "recorded sweep");
  const BenchSweep recorded = read_bench_file(from_sweep);
  probe_output(output);
  const TuneResult result = tune_from_sweep(
      recorded, comm.empty() ? std::nullopt : std::optional<std::string>(comm), from_sweep);
  const TableProvenance& p = result.table.provenance;
  const std::string setting = describe_setting(p.preset, p, result.table.grid.size());
  std::cerr << "lmoe tune: " << setting << ", from the sweep recorded in " << from_sweep << "\n";
  report(result, setting,
         ", from the sweep recorded in " + from_sweep + " (" + p.date_utc + ", host " + p.hostname +
             "; nothing measured here)");
}

void TuneCommand::report(const TuneResult& result, const std::string& setting,
                         const std::string& where) {
  const TierTable& table = result.table;

  Table grid({"T", "fused_us", "overlap_us", "column_us", "token_us", "fastest", "chosen", "regret",
              "bp_chosen", "bp_regret"});
  const auto chosen_cell = [](const PointFit& fit) {
    return fit.chosen ? std::string(tier_name(*fit.chosen)) + (fit.fallback ? "*" : "") : "-";
  };
  for (std::size_t i = 0; i < table.grid.size(); ++i) {
    const GridPoint& point = table.grid[i];
    const PointFit& fit = result.range_fit.points[i];
    const PointFit& by_breakpoints = result.breakpoint_fit.points[i];
    std::vector<std::string> cells = {std::to_string(point.tokens)};
    for (TailTier tier : kAllTiers) {
      const TierTiming& timing = point[tier];
      cells.push_back(timing.ran()                                    ? fixed(timing.median_us, 1)
                      : timing.status == TierTiming::Status::declined ? "declined"
                                                                      : "-");
    }
    cells.push_back(fit.fastest ? std::string(tier_name(*fit.fastest)) : "-");
    cells.push_back(chosen_cell(fit));
    cells.push_back(percent(fit.regret));
    cells.push_back(chosen_cell(by_breakpoints));
    cells.push_back(percent(by_breakpoints.regret));
    grid.add_row(cells);
  }
  std::cout << "# lmoe tune: " << setting;
  if (table.provenance.gpu) {
    std::cout << " (" << table.provenance.gpu->name << ", cc "
              << table.provenance.gpu->compute_capability << ")";
  }
  std::cout << where << "\n";
  grid.print(std::cout);
  std::size_t unchecked = 0;
  std::int64_t checked_up_to = 0;
  for (const BenchRecord& record : result.bench.records) {
    if (record.declined) continue;
    if (record.checked) checked_up_to = std::max(checked_up_to, record.tokens);
    if (!record.checked) ++unchecked;
  }
  std::cout << "# times: median per forward over the timed iterations, microseconds (the slowest "
               "rank's); `lmoe bench` has p10 and p90\n"
            << "# chosen, regret: by the ranges (what the table's policy uses); bp_chosen, "
               "bp_regret: by the breakpoints (for readers of version-2 tables)\n"
            << "# regret: median(chosen) / median(fastest) - 1; chosen*: the preferred tier is "
               "declined at this T and the one shown stands in\n";
  if (unchecked > 0) {
    std::cout << "# " << unchecked << " timing(s) "
              << (checked_up_to > 0 ? "above T=" + std::to_string(checked_up_to) + " " : "")
              << "were not checked against the numerics contract; their times are used\n";
  }

  const auto regret_line = [&](const PolicyFit& fit) {
    std::size_t worst = 0;
    for (std::size_t i = 0; i < fit.points.size(); ++i) {
      if (fit.points[i].regret > fit.points[worst].regret) worst = i;
    }
    return "regret: total " + percent(fit.total_regret) + " over " +
           std::to_string(table.grid.size()) + " T, worst " + percent(fit.max_regret) +
           " at T=" + std::to_string(table.grid[worst].tokens);
  };
  std::cout << "ranges: " << describe_tier_ranges(table.ranges) << " ("
            << regret_line(result.range_fit) << ")\n"
            << "breakpoints: " << describe(table.breakpoints) << " ("
            << regret_line(result.breakpoint_fit) << ")\n";

  if (!result.ok()) {
    for (const BenchRecord& record : result.bench.records) {
      if (!record.ok()) {
        std::cout << "T=" << record.tokens << " " << tier_name(record.tier)
                  << ": output beyond the numerics contract (" << record.wrong()
                  << " wrong elements" << (record.ranks_identical ? "" : ", ranks differ") << ")\n";
      }
    }
    std::cout << "TUNE FAILED: a tier's output is wrong; " << output << " was not written\n";
    throw CLI::RuntimeError(1);
  }
  std::ofstream out(output);
  if (!out) throw Error("--output: cannot write '" + output + "'");
  out << write_tier_table(table);
  if (!out) throw Error("--output: writing '" + output + "' failed");
  std::cout << "wrote " << output << " (load it with --tier-table " << output
            << " or LMOE_TIER_TABLE=" << output << ")\n";
}

}  // namespace

void add_tune_command(CLI::App& app) {
  auto command = std::make_shared<TuneCommand>();
  CLI::App* sub = app.add_subcommand(
      "tune",
      "measure every tier over a grid of T for one configuration, choose the ranges (the fastest "
      "tier at each T) and the breakpoints with the least regret, write a tier table (default: "
      "cuda at kimi-k3 dims on 8 ranks; cpu at small dims on 4)");
  command->app = sub;
  command->sweep.add_to(*sub, "-n,--ranks,--tp",
                        "cuda: 1, 2, 3, 4, 6, 8, 12, ..., 24576, 32768; cpu: 1, 2, 4, ..., 256");
  sub->add_option("--comm", command->comm,
                  "the one comm backend to measure (a table holds for one; default: the "
                  "backend's)");
  sub->add_option("--check-max-tokens", command->check_max_tokens,
                  "check every T up to this against the contract; no table is written when a "
                  "tier is wrong")
      ->capture_default_str();
  sub->add_option("-o,--output", command->output, "the tier table to write (JSON, version 3)")
      ->required();
  sub->add_option("--refit", command->refit,
                  "measure nothing: fit the ranges and breakpoints of this tier table again to its "
                  "own grid by this lmoe's rules (a table tuned before a rule changed); grid and "
                  "provenance are kept");
  sub->add_option("--from-sweep", command->from_sweep,
                  "measure nothing: derive the table from a sweep recorded with `lmoe bench --json "
                  "FILE` (its records of --comm, or of its only comm), on any machine; the "
                  "configuration, grid and iterations are the file's");
  sub->footer(
      "The table records where it was measured (GPU, compute capability, driver, CUDA, NCCL, lmoe "
      "version), for what (backend, tp, dims, dtype, comm), every tier's median, p10 and p90 at "
      "every T, the ranges (what the policy uses) and the breakpoints (for older readers). Loading "
      "it elsewhere is refused, or warned about when only "
      "software versions differ. Check it against a fresh sweep with `lmoe bench --tier-table "
      "FILE --check-table`, or against a recorded one with `lmoe bench --check-table FILE "
      "--from-sweep SWEEP`. See docs/tuning.md.");
  sub->callback([command] { command->execute(); });
}

}  // namespace lmoe::cli

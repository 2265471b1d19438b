// `lmoe tune`: measures every tier over a grid of T for one configuration (dims, dtype, tp,
// backend, comm), finds the breakpoints with the least regret, and writes a tier table (version 2)
// that
// `--tier-table` and LMOE_TIER_TABLE load. The sweep and the fit are the library's
// (include/lmoe/tier_tuning.hpp); docs/tuning.md says how the breakpoints are chosen.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>

#include "common.hpp"
#include "cpu/cpu_math.hpp"
#include "lmoe/comm_group.hpp"
#include "lmoe/error.hpp"
#include "progress.hpp"
#include "table.hpp"

namespace lmoe::cli {

namespace {

struct TuneCommand {
  CLI::App* app = nullptr;
  ModelOptions model;
  std::string backend = "auto";
  std::optional<int> ranks;
  std::string comm;
  std::vector<std::int64_t> tokens;
  std::optional<int> warmup;
  std::optional<int> iters;
  std::string mode = "auto";
  std::uint64_t seed = 2026;
  std::int64_t check_max_tokens = 64;
  std::string output;

  void execute();
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

void TuneCommand::execute() {
  const Backend chosen_backend = resolve_backend(backend);
  const bool cuda = chosen_backend == Backend::cuda;
  ModelOptions dims = model;
  if (app->count("--preset") == 0 && !cuda) dims.preset = "small";
  const ModelOptions::Resolved resolved = dims.resolve();

  BenchOptions options;
  options.backend = chosen_backend;
  options.dims = resolved.dims;
  options.eps = resolved.eps;
  options.dtype = resolved.dtype;
  options.tp = ranks.value_or(cuda ? 8 : 4);
  LMOE_CHECK(options.tp >= 1,
             "-n/--ranks/--tp: expected at least 1 rank, got " + std::to_string(options.tp));
  options.tokens = tokens.empty() ? default_tune_tokens(chosen_backend) : tokens;
  for (std::int64_t t : options.tokens) {
    LMOE_CHECK(t >= 1, "-t/--tokens: expected token counts >= 1, got " + std::to_string(t));
  }
  std::sort(options.tokens.begin(), options.tokens.end());
  options.tokens.erase(std::unique(options.tokens.begin(), options.tokens.end()),
                       options.tokens.end());
  const std::string chosen_comm = resolve_comm(comm, chosen_backend);
  if (auto limit = comm_group_limit(chosen_comm, options.tp))
    throw Error("--comm " + chosen_comm + ": " + *limit);
  options.comms = {chosen_comm};
  options.warmup = warmup.value_or(cuda ? 5 : 2);
  LMOE_CHECK(options.warmup >= 0,
             "--warmup: expected >= 0 iterations, got " + std::to_string(options.warmup));
  options.iters = iters.value_or(cuda ? 50 : 10);
  LMOE_CHECK(options.iters >= 1,
             "--iters: expected at least 1 timed iteration, got " + std::to_string(options.iters));
  LMOE_CHECK(check_max_tokens >= 0,
             "--check-max-tokens: expected >= 0, got " + std::to_string(check_max_tokens));
  options.check_max_tokens = check_max_tokens;
  if (mode != "auto") {
    try {
      options.mode = parse_bench_mode(mode);
    } catch (const Error& error) {
      throw Error("--mode: " + error.message() + " (or auto)");
    }
  }
  options.seed = seed;
  validate_bench_options(options);
  // Fail before the sweep, not after it (and leave no empty file behind).
  {
    const bool existed = std::filesystem::exists(output);
    std::ofstream probe(output, std::ios::app);
    if (!probe) throw Error("--output: cannot write '" + output + "'");
    probe.close();
    if (!existed) std::filesystem::remove(output);
  }
  if (!cuda) cpu::set_blas_threads(1);  // ranks are the parallelism

  const std::string setting =
      resolved.name + ", d_model " + std::to_string(options.dims.d_model) + ", d_latent " +
      std::to_string(options.dims.d_latent) + ", " + std::string(dtype_name(options.dtype)) +
      ", tp " + std::to_string(options.tp) + ", backend " +
      std::string(backend_name(chosen_backend)) + ", comm " + chosen_comm + ", " +
      std::to_string(options.tokens.size()) + " token counts, " + std::to_string(options.warmup) +
      " warm-up + " + std::to_string(options.iters) + " timed iterations";
  std::cerr << "lmoe tune: " << setting << "\n";

  TuneResult result;
  {
    ProgressPrinter printer("lmoe tune");
    result = tune_tiers(options, resolved.name,
                        [&printer](const BenchProgress& progress) { printer(progress); });
  }
  const TierTable& table = result.table;

  Table grid(
      {"T", "fused_us", "overlap_us", "column_us", "token_us", "fastest", "chosen", "regret"});
  for (std::size_t i = 0; i < table.grid.size(); ++i) {
    const GridPoint& point = table.grid[i];
    const PointFit& fit = result.fit.points[i];
    std::vector<std::string> cells = {std::to_string(point.tokens)};
    for (TailTier tier : kAllTiers) {
      const TierTiming& timing = point[tier];
      cells.push_back(timing.ran()                                    ? fixed(timing.median_us, 1)
                      : timing.status == TierTiming::Status::declined ? "declined"
                                                                      : "-");
    }
    cells.push_back(fit.fastest ? std::string(tier_name(*fit.fastest)) : "-");
    cells.push_back(fit.chosen ? std::string(tier_name(*fit.chosen)) + (fit.fallback ? "*" : "")
                               : "-");
    cells.push_back(percent(fit.regret));
    grid.add_row(cells);
  }
  std::cout << "# lmoe tune: " << setting;
  if (table.provenance.gpu) {
    std::cout << " (" << table.provenance.gpu->name << ", cc "
              << table.provenance.gpu->compute_capability << ")";
  }
  std::cout << "\n";
  grid.print(std::cout);
  std::cout << "# times: median per forward over the timed iterations, microseconds (the slowest "
               "rank's); `lmoe bench` has p10 and p90\n"
            << "# regret: median(chosen) / median(fastest) - 1; chosen*: the preferred tier is "
               "declined at this T and the one shown stands in\n";

  std::size_t worst = 0;
  for (std::size_t i = 0; i < result.fit.points.size(); ++i) {
    if (result.fit.points[i].regret > result.fit.points[worst].regret) worst = i;
  }
  std::cout << "breakpoints: " << describe(table.breakpoints) << "\n"
            << "regret: total " << percent(result.fit.total_regret) << " over " << table.grid.size()
            << " T, worst " << percent(result.fit.max_regret)
            << " at T=" << table.grid[worst].tokens << "\n";

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
      "measure every tier over a grid of T for one configuration, choose the breakpoints with the "
      "least regret, write a tier table (default: cuda at kimi-k3 dims on 8 ranks; cpu at small "
      "dims on 4)");
  command->app = sub;
  command->model.add_to(*sub);
  sub->get_option("--preset")
      ->default_str("")
      ->description("model dims (default: kimi-k3 on cuda, small on cpu)");
  sub->add_option("--backend", command->backend, "auto, cpu or cuda")->capture_default_str();
  sub->add_option("-n,--ranks,--tp", command->ranks,
                  "tensor-parallel ranks (default: 8 on cuda, 4 on cpu)");
  sub->add_option("--comm", command->comm,
                  "the one comm backend to measure (a table holds for one; default: the "
                  "backend's)");
  sub->add_option("-t,--tokens", command->tokens,
                  "token counts T (default cuda: 1, 2, 3, 4, 6, 8, 12, ..., 24576, 32768; cpu: 1, "
                  "2, 4, ..., 256)")
      ->delimiter(',');
  sub->add_option("--warmup", command->warmup,
                  "untimed forwards per T and tier (default: 5 on cuda, 2 on cpu)");
  sub->add_option("--iters", command->iters,
                  "timed forwards per T and tier (default: 50 on cuda, 10 on cpu)");
  sub->add_option("--mode", command->mode, "auto, graph or eager (as in lmoe bench)")
      ->capture_default_str();
  sub->add_option("--check-max-tokens", command->check_max_tokens,
                  "check every T up to this against the contract; no table is written when a "
                  "tier is wrong")
      ->capture_default_str();
  sub->add_option("--seed", command->seed, "seed of the weights and inputs")->capture_default_str();
  sub->add_option("-o,--output", command->output, "the tier table to write (JSON, version 2)")
      ->required();
  sub->footer(
      "The table records where it was measured (GPU, compute capability, driver, CUDA, NCCL, lmoe "
      "version), for what (backend, tp, dims, dtype, comm), every tier's median, p10 and p90 at "
      "every T, and the breakpoints. Loading it elsewhere is refused, or warned about when only "
      "software versions differ. Check it against a fresh sweep with `lmoe bench --tier-table "
      "FILE --check-table`. See docs/tuning.md.");
  sub->callback([command] { command->execute(); });
}

}  // namespace lmoe::cli

// `lmoe bench`: the tail benchmark (tiers × T × comm backend), printed as an nccl-tests table and
// optionally written as JSON. The sweep itself is the library's (include/lmoe/tail_bench.hpp).
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <memory>

#include "common.hpp"
#include "cpu/cpu_math.hpp"
#include "lmoe/comm_group.hpp"
#include "lmoe/error.hpp"
#include "lmoe/tail_bench.hpp"
#include "table.hpp"

namespace lmoe::cli {

namespace {

constexpr const char* kBytesDefinition =
    "bytes: the input bytes each rank's tail reduces, T*(l + d)*esize; algbw = bytes / median time";
constexpr const char* kBusDefinition =
    "busbw = the bytes each rank sends in the tier / median time, with AR(x) = "
    "2(tp-1)/tp*T*x*esize and "
    "RS(x) = AG(x) = (tp-1)/tp*T*x*esize: overlap and column AR(l) + AR(d); token RS(l) + RS(d) + "
    "AG(d); "
    "fused (one-shot latent all-reduce) (tp-1)*T*l*esize + RS(d) + AG(d)";
constexpr const char* kTimeDefinition =
    "time of an iteration: the slowest rank's (cuda: CUDA events on each rank's stream; cpu: "
    "steady_clock "
    "between barriers); median, p10, p90 over the timed iterations";
constexpr const char* kWrongDefinition =
    "#wrong: elements of a checked run's output beyond the numerics contract's per-element bound "
    "(fresh "
    "inputs per T and tier, output poisoned before the run); '-': not checked";

struct BenchCommand {
  CLI::App* app = nullptr;
  ModelOptions model;
  std::string backend = "auto";
  std::optional<int> ranks;
  std::vector<std::int64_t> tokens;
  std::vector<std::string> tiers;
  std::vector<std::string> comms;
  std::optional<int> warmup;
  std::optional<int> iters;
  std::string mode = "auto";
  std::string tier_table;
  std::uint64_t seed = 2026;
  std::int64_t check_max_tokens = 2048;
  bool no_check = false;
  std::string json_path;

  void execute();
};

std::string fixed(double value, int decimals) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.*f", decimals, value);
  return text;
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
}

// LMOE_BENCH_INJECT_FAULT=1 (testing only): one element of every checked output is made wrong.
bool inject_fault_from_environment() {
  const char* value = std::getenv("LMOE_BENCH_INJECT_FAULT");
  if (value == nullptr || std::string(value).empty() || std::string(value) == "0") return false;
  if (std::string(value) == "1") return true;
  throw Error("LMOE_BENCH_INJECT_FAULT='" + std::string(value) + "': expected 0 or 1");
}

std::string format_duration(double seconds) {
  if (seconds < 0) return "?";
  if (seconds < 90) return fixed(seconds, seconds < 10 ? 1 : 0) + " s";
  return fixed(seconds / 60, 1) + " min";
}

// One line per job on stderr; on a terminal each replaces the last.
class ProgressPrinter {
 public:
  ProgressPrinter() : terminal_(isatty(STDERR_FILENO) != 0) {}
  ~ProgressPrinter() {
    if (terminal_ && printed_) std::cerr << "\n";
  }
  void operator()(const BenchProgress& progress) {
    const bool timing = progress.phase == BenchProgress::Phase::time;
    std::string line = std::string("lmoe bench: [") + (timing ? "time " : "check ") +
                       std::to_string(progress.done + 1) + "/" + std::to_string(progress.total) +
                       "] " + (timing ? progress.comm + " " : "") +
                       "T=" + std::to_string(progress.tokens) + " " +
                       std::string(tier_name(progress.tier)) + "  elapsed " +
                       format_duration(progress.elapsed_seconds) + ", ETA " +
                       format_duration(progress.eta_seconds);
    if (terminal_) {
      std::cerr << "\r" << line << "\033[K" << std::flush;
    } else {
      std::cerr << line << "\n";
    }
    printed_ = true;
  }

 private:
  bool terminal_;
  bool printed_ = false;
};

nlohmann::json optional_json(const std::optional<std::string>& value) {
  return value ? nlohmann::json(*value) : nlohmann::json();
}

nlohmann::json record_json(const BenchRecord& record) {
  const bool ran = !record.declined;
  std::vector<double> iterations_us;
  for (double s : record.seconds) iterations_us.push_back(s * 1e6);
  const auto if_ran = [&](double value) { return ran ? nlohmann::json(value) : nlohmann::json(); };
  const auto if_checked = [&](auto value) {
    return record.checked ? nlohmann::json(value) : nlohmann::json();
  };
  return {{"comm", record.comm},
          {"tokens", record.tokens},
          {"tier", tier_name(record.tier)},
          {"status", ran ? "ran" : "declined"},
          {"reason", optional_json(record.declined)},
          {"chosen", record.chosen},
          {"mode", ran ? nlohmann::json(bench_mode_name(record.mode)) : nlohmann::json()},
          {"mode_reason", ran ? nlohmann::json(record.mode_reason) : nlohmann::json()},
          {"bytes", record.bytes},
          {"bus_bytes", record.bus_bytes},
          {"median_us", if_ran(record.stats.median * 1e6)},
          {"p10_us", if_ran(record.stats.p10 * 1e6)},
          {"p90_us", if_ran(record.stats.p90 * 1e6)},
          {"min_us", if_ran(record.stats.min * 1e6)},
          {"max_us", if_ran(record.stats.max * 1e6)},
          {"algbw_gbps", if_ran(record.algbw_gbps)},
          {"busbw_gbps", if_ran(record.busbw_gbps)},
          {"checked", record.checked},
          {"wrong", if_checked(record.comparison.beyond_bound)},
          {"bit_mismatches_vs_contract", if_checked(record.comparison.bit_mismatches)},
          {"max_error_over_bound", if_checked(record.comparison.max_error_over_bound)},
          {"normwise_error_vs_fp64", if_checked(record.comparison.normwise_error)},
          {"normwise_tolerance", if_checked(record.comparison.normwise_tolerance)},
          {"ranks_identical", if_checked(record.ranks_identical)},
          {"ok", record.ok()},
          {"iterations_us", iterations_us}};
}

// Why a ran record failed, for its table row; empty when it passed or was not checked.
std::string failure_note(const BenchRecord& record) {
  if (record.ok()) return "";
  std::string note = "FAIL:";
  if (record.comparison.beyond_bound > 0) {
    note += " max err/bound " + format_number(record.comparison.max_error_over_bound) + ";";
  }
  if (record.comparison.normwise_error > record.comparison.normwise_tolerance) {
    note += " fp64 error " + format_number(record.comparison.normwise_error) + " > " +
            format_number(record.comparison.normwise_tolerance) + ";";
  }
  if (!record.ranks_identical) note += " ranks' outputs differ;";
  note.pop_back();
  return note;
}

void BenchCommand::execute() {
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
             "-n/--ranks: expected at least 1 rank, got " + std::to_string(options.tp));
  options.tokens = tokens.empty() ? default_bench_tokens(chosen_backend) : tokens;
  for (std::int64_t t : options.tokens) {
    LMOE_CHECK(t >= 1, "-t/--tokens: expected token counts >= 1, got " + std::to_string(t));
  }
  if (!tiers.empty()) {
    options.tiers.clear();
    for (const std::string& name : tiers) {
      try {
        options.tiers.push_back(parse_tier(name));
      } catch (const Error& error) {
        throw Error("--tiers: " + error.message());
      }
    }
  }
  const std::vector<std::string> available = comm_backends(chosen_backend);
  options.comms = comms.empty() ? available : comms;
  for (const std::string& name : options.comms) {
    if (std::find(available.begin(), available.end(), name) == available.end()) {
      throw Error("--comm: unknown or unavailable comm backend '" + name + "' for the " +
                  std::string(backend_name(chosen_backend)) +
                  " backend; available here: " + (available.empty() ? "none" : joined(available)));
    }
  }
  options.warmup = warmup.value_or(cuda ? 5 : 2);
  LMOE_CHECK(options.warmup >= 0,
             "--warmup: expected >= 0 iterations, got " + std::to_string(options.warmup));
  options.iters = iters.value_or(cuda ? 50 : 10);
  LMOE_CHECK(options.iters >= 1,
             "--iters: expected at least 1 timed iteration, got " + std::to_string(options.iters));
  LMOE_CHECK(check_max_tokens >= 0,
             "--check-max-tokens: expected >= 0, got " + std::to_string(check_max_tokens));
  if (mode != "auto") {
    try {
      options.mode = parse_bench_mode(mode);
    } catch (const Error& error) {
      throw Error("--mode: " + error.message() + " (or auto)");
    }
  }
  options.policy = resolve_policy(tier_table);
  options.seed = seed;
  options.check_max_tokens = no_check ? 0 : check_max_tokens;
  options.inject_fault = inject_fault_from_environment();
  validate_bench_options(options);
  if (!cuda) cpu::set_blas_threads(1);  // ranks are the parallelism

  const BenchEnvironment environment = bench_environment(chosen_backend);
  std::string setting = resolved.name + ", d_model " + std::to_string(options.dims.d_model) +
                        ", d_latent " + std::to_string(options.dims.d_latent) + ", " +
                        std::string(dtype_name(options.dtype)) + ", tp " +
                        std::to_string(options.tp) + ", backend " +
                        std::string(backend_name(chosen_backend));
  if (environment.gpu) {
    setting += " (" + environment.gpu->name + ", cc " + environment.gpu->compute_capability + ")";
  }
  setting += ", comm " + joined(options.comms) + ", " + std::to_string(options.warmup) +
             " warm-up + " + std::to_string(options.iters) + " timed iterations";
  std::cerr << "lmoe bench: " << setting << "\n";
  if (options.inject_fault)
    std::cerr << "lmoe bench: LMOE_BENCH_INJECT_FAULT=1: checked outputs are made wrong\n";

  BenchResult result;
  {
    ProgressPrinter printer;
    result =
        run_tail_bench(options, [&printer](const BenchProgress& progress) { printer(progress); });
  }

  Table table({"T", "bytes", "tier", "comm", "mode", "median_us", "p10_us", "p90_us", "algbw_GB/s",
               "busbw_GB/s", "chosen", "#wrong"});
  std::map<std::string, std::string> mode_reasons;  // comm → "eager: why"
  std::size_t unchecked = 0, declined = 0, failed = 0;
  for (const BenchRecord& record : result.records) {
    std::vector<std::string> cells = {std::to_string(record.tokens), fixed(record.bytes, 0),
                                      std::string(tier_name(record.tier)), record.comm};
    if (record.declined) {
      ++declined;
      table.add_row(cells, "declined: " + *record.declined);
      continue;
    }
    mode_reasons[record.comm] =
        std::string(bench_mode_name(record.mode)) + " (" + record.mode_reason + ")";
    if (!record.checked) ++unchecked;
    if (!record.ok()) ++failed;
    cells.insert(cells.end(),
                 {std::string(bench_mode_name(record.mode)), fixed(record.stats.median * 1e6, 1),
                  fixed(record.stats.p10 * 1e6, 1), fixed(record.stats.p90 * 1e6, 1),
                  fixed(record.algbw_gbps, 2), fixed(record.busbw_gbps, 2),
                  record.chosen ? "*" : "", record.checked ? std::to_string(record.wrong()) : "-"});
    table.add_row(cells, failure_note(record));
  }

  std::cout << "# lmoe bench: " << setting << "\n";
  table.print(std::cout);
  std::cout << "# " << kBytesDefinition << "\n# " << kBusDefinition << "\n# " << kTimeDefinition
            << "\n";
  for (const auto& [comm, reason] : mode_reasons)
    std::cout << "# mode of " << comm << ": " << reason << "\n";
  std::cout << "# chosen: * marks the tier the policy picks at this T (`lmoe explain` says why)\n"
            << "# " << kWrongDefinition << "\n";
  if (unchecked > 0) {
    std::cout << "# " << unchecked << " row(s) not checked: "
              << (options.check_max_tokens > 0
                      ? "T > --check-max-tokens " + std::to_string(options.check_max_tokens)
                      : std::string("--no-check"))
              << "\n";
  }
  for (const BenchCommError& error : result.comm_errors) {
    std::cout << "comm " << error.comm << " FAILED: " << error.error << "\n";
  }
  const bool ok = result.ok();
  if (ok) {
    std::cout << "all rows ok (" << result.records.size() - declined - unchecked << " checked, "
              << unchecked << " unchecked, " << declined << " declined)\n";
  } else {
    std::cout << "SOME ROWS FAILED (" << failed << " row(s), " << result.comm_errors.size()
              << " comm error(s))\n";
  }

  if (!json_path.empty()) {
    nlohmann::json records = nlohmann::json::array();
    for (const BenchRecord& record : result.records) records.push_back(record_json(record));
    nlohmann::json comm_errors = nlohmann::json::array();
    for (const BenchCommError& error : result.comm_errors) {
      comm_errors.push_back({{"comm", error.comm}, {"error", error.error}});
    }
    nlohmann::json gpu;
    if (environment.gpu) {
      gpu = {{"name", environment.gpu->name},
             {"compute_capability", environment.gpu->compute_capability},
             {"driver_version", environment.gpu->driver_version},
             {"runtime_version", environment.gpu->runtime_version},
             {"device_count", environment.gpu->device_count}};
    }
    std::vector<std::string> tier_names;
    for (TailTier tier : options.tiers) tier_names.emplace_back(tier_name(tier));
    const nlohmann::json doc = {{"command", "bench"},
                                {"tool", "lmoe"},
                                {"version", kVersion},
                                {"date", environment.date_utc},
                                {"hostname", environment.hostname},
                                {"backend", backend_name(chosen_backend)},
                                {"gpu", gpu},
                                {"nccl_version", optional_json(environment.nccl_version)},
                                {"preset", resolved.name},
                                {"d_model", options.dims.d_model},
                                {"d_latent", options.dims.d_latent},
                                {"dtype", dtype_name(options.dtype)},
                                {"eps", options.eps},
                                {"tp", options.tp},
                                {"comms", options.comms},
                                {"tiers", tier_names},
                                {"tokens", options.tokens},
                                {"warmup", options.warmup},
                                {"iters", options.iters},
                                {"seed", options.seed},
                                {"check_max_tokens", options.check_max_tokens},
                                {"fault_injected", options.inject_fault},
                                {"definitions",
                                 {{"bytes", kBytesDefinition},
                                  {"busbw", kBusDefinition},
                                  {"time", kTimeDefinition},
                                  {"wrong", kWrongDefinition}}},
                                {"records", records},
                                {"comm_errors", comm_errors},
                                {"ok", ok}};
    write_json_file(json_path, doc);
  }
  if (!ok) throw CLI::RuntimeError(1);
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto command = std::make_shared<BenchCommand>();
  CLI::App* sub = app.add_subcommand(
      "bench",
      "time every tier over a sweep of T and comm backends, check each against the contract, print "
      "an "
      "nccl-tests table (default: cuda at kimi-k3 dims on 8 ranks; cpu at small dims on 4)");
  command->app = sub;
  command->model.add_to(*sub);
  std::vector<std::string> presets;
  for (const ModelPreset& preset : model_presets()) presets.push_back(preset.name);
  sub->get_option("--preset")
      ->default_str("")
      ->description("model dims: " + joined(presets) + " (default: kimi-k3 on cuda, small on cpu)");
  sub->add_option("--backend", command->backend, "auto, cpu or cuda")->capture_default_str();
  sub->add_option("-n,--ranks", command->ranks,
                  "tensor-parallel ranks (default: 8 on cuda, 4 on cpu)");
  sub->add_option("-t,--tokens", command->tokens,
                  "token counts T (default cuda: 1, 2, 4, ..., 32768 and 96, 192, ..., 3072; cpu: "
                  "1, 4, 16, ..., 512)")
      ->delimiter(',');
  sub->add_option("--tiers", command->tiers, "tiers to time (default: fused,overlap,column,token)")
      ->delimiter(',');
  sub->add_option("--comm", command->comms,
                  "comm backends (default: every one this build and machine can run)")
      ->delimiter(',');
  sub->add_option("--warmup", command->warmup,
                  "untimed forwards per T and tier (default: 5 on cuda, 2 on cpu)");
  sub->add_option("--iters", command->iters,
                  "timed forwards per T and tier (default: 50 on cuda, 10 on cpu)");
  sub->add_option(
         "--mode", command->mode,
         "auto (graph where the comm is capturable and the workspaces persistent), graph or eager")
      ->capture_default_str();
  sub->add_option(
         "--check-max-tokens", command->check_max_tokens,
         "check every T up to this against the contract (the CPU reference costs 2*T*d*l FLOPs)")
      ->capture_default_str();
  sub->add_flag("--no-check", command->no_check, "check nothing (#wrong is '-')");
  sub->add_option("--tier-table", command->tier_table,
                  "tier table JSON for `chosen` (default: $LMOE_TIER_TABLE)");
  sub->add_option("--seed", command->seed, "seed of the weights and inputs")->capture_default_str();
  sub->add_option("--json", command->json_path,
                  "also write the results (with every iteration's time) to this file");
  sub->footer(std::string("Columns:\n  ") + kBytesDefinition + "\n  " + kBusDefinition + "\n  " +
              kTimeDefinition +
              "\n  mode: graph = replays of one forward captured into a CUDA graph; eager = one "
              "LatentTail::forward "
              "per iteration\n  chosen: * marks the tier the policy picks at this T\n  " +
              kWrongDefinition +
              "\nExits non-zero when an element is wrong, ranks' outputs differ or a comm fails, "
              "after printing "
              "everything.\nLMOE_BENCH_INJECT_FAULT=1 (for testing only) makes one element of "
              "every checked output "
              "wrong.\nSee docs/bench.md.");
  sub->callback([command] { command->execute(); });
}

}  // namespace lmoe::cli

// `lmoe bench`: the tail benchmark (tiers × T × comm backend), printed as an nccl-tests table and
// optionally written as JSON. The sweep itself is the library's (include/lmoe/tail_bench.hpp), and
// so is its JSON (write_bench_json, read_bench_json). `--check-table --from-sweep FILE` judges the
// policy against a recorded sweep instead of a measurement.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <memory>

#include "common.hpp"
#include "core/host_math.hpp"
#include "lmoe/comm_group.hpp"
#include "lmoe/error.hpp"
#include "lmoe/settings.hpp"
#include "lmoe/tools/tail_bench.hpp"
#include "lmoe/tools/tail_floor.hpp"
#include "progress.hpp"
#include "sweep_options.hpp"
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
    "fused (one-shot latent all-reduce) (tp-1)*T*l*esize + RS(d) + AG(d), or where its chained "
    "path runs (cuda, tp > 1, compute 9.0, T = 17...128) two-shot AR(l) + RS(d) + AG(d)";
constexpr const char* kTimeDefinition =
    "time of an iteration: the slowest rank's (cuda: CUDA events on each rank's stream; cpu: "
    "steady_clock "
    "between barriers); median, p10, p90 over the timed iterations";
constexpr const char* kFloorDefinition =
    "floor: the least time the tier can take on the machine's rates, max(bytes each rank sends / "
    "link, (w_up bytes its GEMM reads + T*(l + 2d)*esize) / memory, its up-projection's FLOPs / "
    "GEMM rate), as if all three overlapped (a bound, not a prediction; weights from memory, which "
    "a "
    "warm L2 can beat); x_floor = median / floor; "
    "'-' where ranks share a GPU or no rates are known (--rates)";
constexpr const char* kWrongDefinition =
    "#wrong: elements of a checked run's output beyond the numerics contract's per-element bound "
    "(fresh inputs per T, output poisoned before each tier's run); '-': not checked";

struct BenchCommand {
  CLI::App* app = nullptr;
  SweepOptions sweep;
  std::vector<std::string> tiers;
  std::vector<std::string> comms;
  std::string tier_table;
  std::string check_table_path;  // --check-table FILE; --check-table alone checks the loaded policy
  std::int64_t check_max_tokens = 2048;
  bool no_check = false;
  std::string json_path;
  std::string from_sweep;  // --check-table against this recorded sweep instead of a measurement
  std::string rates;       // --rates LINK_GBS,MEMORY_GBS,GEMM_TFLOPS for the floors

  void execute();
  // --check-table --from-sweep FILE: the policy judged against FILE's records.
  void judge_recorded(bool check_table);
  // Prints the sweep's table (and the policy check), writes --json, exits 1 when a row or a
  // choice failed. `recorded_in`: the file the sweep was read from; empty when measured here.
  void report(const BenchSweep& recorded, const PolicyConfig& policy, bool check_table,
              const std::string& recorded_in);
};

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
}

// LMOE_BENCH_INJECT_FAULT=1 (testing only): one element of every checked output is made wrong.
bool inject_fault_from_environment() {
  return setting_choice("LMOE_BENCH_INJECT_FAULT").value_or("0") == "1";
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

constexpr double kCheckTolerance = 0.03;

std::string check_rule() {
  return "a choice is ok when its median is within " + fixed(kCheckTolerance * 100, 0) +
         "% of the fastest tier's median, or at most the fastest tier's p90 (the sweep's own "
         "spread)";
}

void print_policy_check(const std::vector<ChoiceCheck>& checks, const PolicyConfig& policy,
                        const std::string& recorded_in, std::ostream& out) {
  Table table({"T", "comm", "chosen", "chosen_us", "fastest", "fastest_us", "fastest_p90_us",
               "ratio", "verdict"});
  std::size_t failures = 0, judged = 0;
  for (const ChoiceCheck& check : checks) {
    std::vector<std::string> cells = {std::to_string(check.tokens), check.comm};
    if (check.verdict == ChoiceCheck::Verdict::nothing_ran) {
      table.add_row(cells, "no tier ran");
      continue;
    }
    ++judged;
    if (!check.ok()) ++failures;
    cells.insert(cells.end(),
                 {check.chosen ? std::string(tier_name(*check.chosen)) : "-",
                  check.chosen ? fixed(check.chosen_median_us, 1) : "-",
                  std::string(tier_name(*check.fastest)), fixed(check.fastest_median_us, 1),
                  fixed(check.fastest_p90_us, 1), check.chosen ? fixed(check.ratio, 3) : "-",
                  std::string(verdict_name(check.verdict))});
    table.add_row(cells);
  }
  out << "# policy check: "
      << (policy.table_path ? "tier table " + *policy.table_path
                            : std::string("no tier table given (defaults and environment; "
                                          "a table built into lmoe where one holds)"))
      << " against "
      << (recorded_in.empty() ? std::string("this sweep") : "the sweep recorded in " + recorded_in)
      << " (rule: " << describe_rule(policy) << "); " << check_rule() << "\n";
  table.print(out);
  if (failures == 0) {
    out << "policy check ok (" << judged << " choice(s) judged)\n";
  } else {
    out << "POLICY CHECK FAILED (" << failures << " of " << judged
        << " choice(s) slower than the rule allows)\n";
  }
}

nlohmann::json checks_json(const std::vector<ChoiceCheck>& checks) {
  nlohmann::json array = nlohmann::json::array();
  const auto tier_or_null = [](std::optional<TailTier> tier) {
    return tier ? nlohmann::json(tier_name(*tier)) : nlohmann::json();
  };
  for (const ChoiceCheck& check : checks) {
    const bool judged = check.chosen && check.fastest;
    const auto if_set = [](bool set, double value) {
      return set ? nlohmann::json(value) : nlohmann::json();
    };
    array.push_back(
        {{"comm", check.comm},
         {"tokens", check.tokens},
         {"chosen", tier_or_null(check.chosen)},
         {"fastest", tier_or_null(check.fastest)},
         {"chosen_median_us", if_set(judged, check.chosen_median_us)},
         {"fastest_median_us", if_set(check.fastest.has_value(), check.fastest_median_us)},
         {"fastest_p90_us", if_set(check.fastest.has_value(), check.fastest_p90_us)},
         {"ratio", if_set(judged, check.ratio)},
         {"verdict", verdict_name(check.verdict)},
         {"ok", check.ok()}});
  }
  return array;
}

// "kimi-k3, d_model 7168, d_latent 3584, bf16, tp 8, backend cuda (NVIDIA H200, cc 9.0), comm nccl,
// 5 warm-up + 50 timed iterations, L2 warm (see --cold-l2)" (", L2 evicted before each" with
// --cold-l2; nothing about L2 on cpu).
std::string describe_setting(const BenchSweep& sweep) {
  std::string setting = sweep.preset + ", d_model " + std::to_string(sweep.dims.d_model) +
                        ", d_latent " + std::to_string(sweep.dims.d_latent) + ", " +
                        std::string(dtype_name(sweep.dtype)) + ", tp " + std::to_string(sweep.tp) +
                        ", backend " + std::string(backend_name(sweep.backend));
  if (sweep.gpu) setting += " (" + sweep.gpu->name + ", cc " + sweep.gpu->compute_capability + ")";
  return setting + ", comm " + joined(sweep.comms) + ", " + std::to_string(sweep.warmup) +
         " warm-up + " + std::to_string(sweep.iters) + " timed iterations" +
         layers_note(sweep.layers) + l2_note(sweep.backend, sweep.cold_l2) +
         settings_note(sweep.settings);
}

void BenchCommand::execute() {
  if (!rates.empty()) parse_machine_rates(rates);  // refused before anything is measured
  const bool check_table = app->count("--check-table") > 0;
  if (check_table && !check_table_path.empty()) {
    if (!tier_table.empty() && tier_table != check_table_path) {
      throw Error("--check-table " + check_table_path + " and --tier-table " + tier_table +
                  " name different tables; give one");
    }
    tier_table = check_table_path;
  }
  if (!from_sweep.empty()) {
    judge_recorded(check_table);
    return;
  }

  const SweepOptions::Resolved resolved = sweep.resolve(*app, default_bench_tokens);
  BenchOptions options = resolved.options;
  const Backend chosen_backend = options.backend;
  const bool cuda = chosen_backend == Backend::cuda;
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
  if (check_table && options.tiers.size() != kAllTiers.size()) {
    throw Error(
        "--check-table: compares the policy's choice with every tier, so it times all four; "
        "leave out --tiers");
  }
  options.policy = resolve_policy(tier_table);
  const std::shared_ptr<const TierTable> measured = options.policy.table;
  // A measured table holds for one comm and its grid: by default, sweep those.
  if (measured && comms.empty()) comms = {measured->provenance.comm};
  if (measured && check_table && sweep.tokens.empty()) {
    options.tokens.clear();
    for (const GridPoint& point : measured->grid) options.tokens.push_back(point.tokens);
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
  LMOE_CHECK(check_max_tokens >= 0,
             "--check-max-tokens: expected >= 0, got " + std::to_string(check_max_tokens));
  check_at_most("--check-max-tokens", check_max_tokens, kMaxTokens, "tokens");
  std::optional<PolicyConfig> shipped_policy;
  const BenchEnvironment environment = bench_environment(chosen_backend);
  // The sweep's p2p ranks are threads placed on GPU rank % GPUs: more ranks than GPUs share them.
  const int gpus =
      environment.gpu && environment.gpu->device_count > 0 ? environment.gpu->device_count : 1;
  for (const std::string& comm : options.comms) {
    RunningConfig running =
        running_config(chosen_backend, options.tp, options.dims, options.dtype, comm);
    running.cold_l2 = options.cold_l2;  // as this sweep will measure
    running.layers = options.layers;
    if (comm == "p2p") running.ranks_per_gpu = (options.tp + gpus - 1) / gpus;
    check_table_fits(options.policy, running);
    // The tails choose as LatentTail does: say so where a table built into lmoe holds.
    const PolicyConfig shipped = with_shipped_tier_table(options.policy, running);
    if (shipped.table && !options.policy.table) {
      std::cerr << "lmoe bench: comm " << comm << ": the tiers are chosen by the "
                << *shipped.table_path << " (built into lmoe for this configuration)\n";
      // One comm: the sweep's policy is that table (its record and --check-table name it).
      if (options.comms.size() == 1) shipped_policy = shipped;
    }
  }
  if (shipped_policy) options.policy = std::move(*shipped_policy);
  options.check_max_tokens = no_check ? 0 : check_max_tokens;
  options.inject_fault = inject_fault_from_environment();
  validate_bench_options(options);
  if (!cuda) cpu::set_blas_threads(1);  // ranks are the parallelism

  BenchSweep planned = bench_sweep_of(options, resolved.preset, environment, {});
  std::cerr << "lmoe bench: " << describe_setting(planned) << "\n";
  if (options.inject_fault)
    std::cerr << "lmoe bench: LMOE_BENCH_INJECT_FAULT=1: checked outputs are made wrong\n";

  {
    ProgressPrinter printer("lmoe bench");
    planned.result =
        run_tail_bench(options, [&printer](const BenchProgress& progress) { printer(progress); });
  }
  report(planned, options.policy, check_table, "");
}

void BenchCommand::judge_recorded(bool check_table) {
  if (!check_table) {
    throw Error(
        "--from-sweep: needs --check-table (with --from-sweep nothing is measured: the "
        "policy is judged against the recorded sweep)");
  }
  // Everything that would shape a measurement comes from the file: giving it here is a mistake
  // (it would silently not apply).
  std::vector<std::string> measuring = sweep.given(*app);
  for (const char* flag : {"--tiers", "--check-max-tokens", "--no-check"}) {
    if (app->count(flag) > 0) measuring.emplace_back(flag);
  }
  if (!measuring.empty()) {
    throw Error("--from-sweep: " + joined(measuring) +
                (measuring.size() == 1 ? " shapes" : " shape") +
                " a measurement; with --from-sweep the configuration, T and iterations are "
                "the recorded sweep's (leave " +
                (measuring.size() == 1 ? "it" : "them") +
                " out, or measure with `lmoe bench --check-table` alone)");
  }
  BenchSweep recorded = read_bench_file(from_sweep);
  if (recorded.tiers.size() != kAllTiers.size() ||
      !std::all_of(kAllTiers.begin(), kAllTiers.end(), [&](TailTier tier) {
        return std::find(recorded.tiers.begin(), recorded.tiers.end(), tier) !=
               recorded.tiers.end();
      })) {
    std::vector<std::string> timed;
    for (TailTier tier : recorded.tiers) timed.emplace_back(tier_name(tier));
    throw Error("--check-table: compares the policy's choice with every tier; the sweep " +
                from_sweep + " timed " + joined(timed));
  }
  const PolicyConfig policy = resolve_policy(tier_table);
  // The comms judged: --comm, else a measured table's, else every comm the sweep has records of.
  std::vector<std::string> judged = comms;
  if (judged.empty() && policy.table) judged = {policy.table->provenance.comm};
  if (judged.empty()) {
    for (const std::string& comm : recorded.comms) {
      if (std::any_of(recorded.result.records.begin(), recorded.result.records.end(),
                      [&](const BenchRecord& record) { return record.comm == comm; })) {
        judged.push_back(comm);
      }
    }
  }
  for (const std::string& comm : judged) {
    sweep_comm(recorded, comm, from_sweep);  // it has records of this comm
    // The sweep ran where the table must hold: refused or warned about as loading it there would.
    check_table_fits(policy, running_config_of(recorded, comm));
  }
  const auto is_judged = [&](const std::string& comm) {
    return std::find(judged.begin(), judged.end(), comm) != judged.end();
  };
  std::vector<BenchRecord> records;
  for (const BenchRecord& record : recorded.result.records) {
    if (is_judged(record.comm)) records.push_back(record);
  }
  std::vector<BenchCommError> comm_errors;
  for (const BenchCommError& error : recorded.result.comm_errors) {
    if (is_judged(error.comm)) comm_errors.push_back(error);
  }
  recorded.result.records = choose_again(records, policy);
  recorded.result.comm_errors = std::move(comm_errors);
  recorded.comms = judged;
  recorded.tier_table = policy.table_path;
  std::cerr << "lmoe bench: " << describe_setting(recorded) << ", recorded in " << from_sweep
            << " (nothing is measured)\n";
  report(recorded, policy, true, from_sweep);
}

void BenchCommand::report(const BenchSweep& recorded, const PolicyConfig& policy, bool check_table,
                          const std::string& recorded_in) {
  const BenchResult& result = recorded.result;
  // The machine's rates for the floors: --rates, else those lmoe knows for the sweep's GPU.
  const FloorRates machine =
      floor_rates(rates, recorded.gpu ? std::optional(recorded.gpu->name) : std::nullopt,
                  recorded.dtype, recorded.backend);
  std::vector<std::optional<TierFloor>> floors;
  for (const BenchRecord& record : result.records) {
    floors.push_back(machine.rates ? record_floor(recorded, record, *machine.rates) : std::nullopt);
  }
  Table table({"T", "bytes", "tier", "comm", "mode", "median_us", "p10_us", "p90_us", "algbw_GB/s",
               "busbw_GB/s", "floor_us", "x_floor", "chosen", "#wrong"});
  std::map<std::string, std::string> mode_reasons;  // comm → "eager: why"
  std::size_t unchecked = 0, declined = 0, failed = 0;
  for (std::size_t i = 0; i < result.records.size(); ++i) {
    const BenchRecord& record = result.records[i];
    const std::optional<TierFloor>& floor = floors[i];
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
                  floor ? fixed(floor->floor_us, 1) : "-",
                  floor ? fixed(record.stats.median * 1e6 / floor->floor_us, 1) : "-",
                  record.chosen ? "*" : "", record.checked ? std::to_string(record.wrong()) : "-"});
    table.add_row(cells, failure_note(record));
  }

  std::cout << "# lmoe bench: " << describe_setting(recorded);
  if (!recorded_in.empty()) {
    std::cout << ", recorded in " << recorded_in << " (" << recorded.date_utc << ", host "
              << recorded.hostname << "; nothing measured here)";
  }
  std::cout << "\n";
  table.print(std::cout);
  std::cout << "# " << kBytesDefinition << "\n# " << kBusDefinition << "\n# " << kTimeDefinition
            << "\n# " << kFloorDefinition << "\n# rates: " << machine.text << "\n";
  for (const auto& [comm, reason] : mode_reasons)
    std::cout << "# mode of " << comm << ": " << reason << "\n";
  std::cout << "# chosen: * marks the tier the policy picks at this T (`lmoe explain` says why)\n"
            << "# " << kWrongDefinition << "\n";
  if (unchecked > 0) {
    std::cout << "# " << unchecked << " row(s) not checked: "
              << (recorded.check_max_tokens > 0
                      ? "T > --check-max-tokens " + std::to_string(recorded.check_max_tokens)
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

  std::vector<ChoiceCheck> checks;
  bool policy_ok = true;
  if (check_table) {
    checks = check_choices(result.records, kCheckTolerance);
    print_policy_check(checks, policy, recorded_in, std::cout);
    policy_ok = std::all_of(checks.begin(), checks.end(),
                            [](const ChoiceCheck& check) { return check.ok(); });
  }

  if (!json_path.empty()) {
    nlohmann::json doc = nlohmann::json::parse(write_bench_json(recorded));
    doc["definitions"] = {{"bytes", kBytesDefinition},
                          {"busbw", kBusDefinition},
                          {"time", kTimeDefinition},
                          {"floor", kFloorDefinition},
                          {"wrong", kWrongDefinition}};
    doc["floor_rates"] = machine.rates ? nlohmann::json{{"link_gbps", machine.rates->link_gbps},
                                                        {"memory_gbps", machine.rates->memory_gbps},
                                                        {"gemm_tflops", machine.rates->gemm_tflops},
                                                        {"source", machine.source}}
                                       : nlohmann::json();
    nlohmann::json& records = doc["records"];
    for (std::size_t i = 0; i < floors.size() && i < records.size(); ++i) {
      const std::optional<TierFloor>& floor = floors[i];
      records[i]["floor"] = floor ? nlohmann::json{{"comm_us", floor->comm_us},
                                                   {"memory_us", floor->memory_us},
                                                   {"flops_us", floor->flops_us},
                                                   {"floor_us", floor->floor_us}}
                                  : nlohmann::json();
    }
    doc["from_sweep"] = recorded_in.empty() ? nlohmann::json() : nlohmann::json(recorded_in);
    doc["policy_check"] = check_table ? checks_json(checks) : nlohmann::json();
    doc["ok"] = ok && policy_ok;
    write_json_file(json_path, doc);
  }
  if (!ok || !policy_ok) throw CLI::RuntimeError(1);
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
  command->sweep.add_to(*sub, "-n,--ranks",
                        "cuda: 1, 2, 4, ..., 32768 and 96, 192, ..., 3072; cpu: 1, 4, 16, ..., "
                        "512; with --check-table and a measured table: its grid");
  sub->add_option("--tiers", command->tiers, "tiers to time (default: fused,overlap,column,token)")
      ->delimiter(',');
  sub->add_option("--comm", command->comms,
                  "comm backends (default: every one this build and machine can run)")
      ->delimiter(',');
  sub->add_option(
         "--check-max-tokens", command->check_max_tokens,
         "check every T up to this against the contract (the CPU reference costs 2*T*d*l FLOPs)")
      ->capture_default_str();
  sub->add_flag("--no-check", command->no_check, "check nothing (#wrong is '-')");
  sub->add_option("--tier-table", command->tier_table,
                  "tier table JSON for `chosen` (default: $LMOE_TIER_TABLE); a measured table also "
                  "sets the default --comm");
  sub->add_option("--check-table", command->check_table_path,
                  "after the sweep, judge the policy's choice at every T against the fastest tier "
                  "measured; exit 1 when a choice is slower than allowed. FILE (optional) is the "
                  "tier table to check, else the one loaded; with a measured table the default T "
                  "are its grid's")
      ->expected(0, 1);
  sub->add_option("--from-sweep", command->from_sweep,
                  "with --check-table: measure nothing; judge the policy against the records of "
                  "a sweep recorded with `lmoe bench --json FILE` (on any machine; the sweep must "
                  "match a measured table's configuration)");
  sub->add_option("--json", command->json_path,
                  "also write the results (with every iteration's time) to this file");
  sub->add_option(
      "--rates", command->rates,
      "LINK_GBS,MEMORY_GBS,GEMM_TFLOPS: one GPU's rates for the floor columns (default: "
      "those lmoe knows for the GPU, e.g. 450,4270,790 for an H200 in bf16/f16)");
  sub->footer(std::string("Columns:\n  ") + kBytesDefinition + "\n  " + kBusDefinition + "\n  " +
              kTimeDefinition + "\n  " + kFloorDefinition +
              "\n  mode: graph = replays of one forward captured into a CUDA graph; eager = one "
              "LatentTail::forward "
              "per iteration; device-tokens = replays of one graph per tier captured around "
              "LatentTail::forward_device_tokens, T written to the device (docs/graphs.md)\n  "
              "chosen: * marks the tier the policy picks at this T\n  " +
              kWrongDefinition +
              "\nExits non-zero when an element is wrong, ranks' outputs differ, a comm fails or "
              "(--check-table) a choice is slower than allowed, after printing everything.\n"
              "--check-table: " +
              check_rule() +
              ".\nLMOE_BENCH_INJECT_FAULT=1 (for testing only) makes one element of "
              "every checked output "
              "wrong.\nSee docs/bench.md.");
  sub->callback([command] { command->execute(); });
}

}  // namespace lmoe::cli

// `lmoe run`: the main job. For each T, runs the tier the policy picks and every other tier on
// fresh random inputs, checks each against the numerics contract and fp64 math, and prints a table.
#include <nlohmann/json.hpp>

#include <iostream>
#include <memory>

#include "common.hpp"
#include "core/host_math.hpp"
#include "lmoe/comm_group.hpp"
#include "lmoe/error.hpp"
#include "lmoe/reference.hpp"
#include "lmoe/tools/tail_runner.hpp"
#include "table.hpp"

namespace lmoe::cli {

namespace {

struct RunCommand {
  ModelOptions model;
  int ranks = 4;
  std::vector<std::int64_t> tokens = {1, 8, 64, 128, 256, 512, 2048};
  std::string backend = "auto";
  std::string comm;  // empty: the backend's default
  std::string tier_table;
  int repeats = 1;
  std::uint64_t seed = 2026;
  std::string json_path;

  void execute() const;
};

struct TierResult {
  TailTier tier;
  std::optional<std::string> declined;
  double median_us = -1;
  Comparison comparison;
  bool ranks_identical = true;
  bool ok() const { return declined || (comparison.ok() && ranks_identical); }
};

nlohmann::json to_json(const TierResult& result) {
  nlohmann::json entry;
  if (result.declined) {
    entry["status"] = "declined";
    entry["reason"] = *result.declined;
    return entry;
  }
  const Comparison& c = result.comparison;
  entry = {{"status", "ran"},
           {"median_us", result.median_us},
           {"elements", c.elements},
           {"bit_mismatches_vs_contract", c.bit_mismatches},
           {"beyond_bound", c.beyond_bound},
           {"max_error_over_bound", c.max_error_over_bound},
           {"normwise_error_vs_fp64", c.normwise_error},
           {"normwise_tolerance", c.normwise_tolerance},
           {"ranks_identical", result.ranks_identical},
           {"ok", result.ok()}};
  return entry;
}

void RunCommand::execute() const {
  const ModelOptions::Resolved resolved = model.resolve();
  check_forward_sizes(ranks, tokens, repeats);
  const Backend chosen_backend = resolve_backend(backend);
  const std::string chosen_comm = resolve_comm(comm, chosen_backend);
  // NCCL sums in its own order: its results are judged by the reordered-sum bound
  // (docs/numerics.md).
  const ReductionOrder reductions = comm_reduction_order(chosen_comm);
  const PolicyConfig policy = with_rank_defaults(resolve_policy(tier_table), chosen_backend, ranks,
                                                 resolved.dims, resolved.dtype);
  check_table_fits(
      policy, running_config(chosen_backend, ranks, resolved.dims, resolved.dtype, chosen_comm));
  if (chosen_backend == Backend::cpu) cpu::set_blas_threads(1);  // ranks are the parallelism

  std::cerr << "lmoe run: " << resolved.name << " d=" << resolved.dims.d_model
            << " l=" << resolved.dims.d_latent << " dtype=" << dtype_name(resolved.dtype)
            << " tp=" << ranks << " backend=" << backend_name(chosen_backend)
            << " comm=" << chosen_comm << "\n";

  Table table({"T", "chosen", "fused_us", "overlap_us", "column_us", "token_us", "max_err/bound",
               "fp64_err", "ok"});
  nlohmann::json rows = nlohmann::json::array();
  bool all_ok = true;
  std::size_t row_index = 0;
  for (std::int64_t t : tokens) {
    ++row_index;
    std::cerr << "[" << row_index << "/" << tokens.size() << "] T=" << t
              << ": preparing inputs and references\n";
    const TailCase c = make_random_case(resolved.dims, resolved.eps, resolved.dtype, ranks, t,
                                        seed + static_cast<std::uint64_t>(t));
    const std::vector<double> exact = exact_tail(c);
    std::unique_ptr<ContractReference> references[2];
    const TierSupport support =
        tier_support(chosen_backend, t, resolved.dims, resolved.dtype, ranks);
    const TierDecision decision = decide(t, policy, support);

    std::vector<TierResult> results;
    for (TailTier tier : kAllTiers) {
      TierResult result{tier, support.declined[static_cast<std::size_t>(tier)], -1, {}, true};
      if (t == 0 && !result.declined) result.declined = "T=0: nothing to run";
      if (!result.declined) {
        std::cerr << "    " << tier_name(tier) << "\n";
        auto& reference = references[static_cast<int>(contract_of(tier))];
        if (!reference)
          reference =
              std::make_unique<ContractReference>(reference_tail(c, contract_of(tier), reductions));
        const CaseRun run = run_case_on_threads(c, {.backend = chosen_backend,
                                                    .comm = chosen_comm,
                                                    .policy = policy,
                                                    .tier = tier,
                                                    .repeats = repeats});
        result.median_us = run.median_seconds * 1e6;
        result.ranks_identical = run.ranks_identical;
        result.comparison = compare(run.ranks.front().y.matrix(), *reference, exact);
      }
      results.push_back(result);
    }

    bool row_ok = true;
    double worst_bound = 0, worst_fp64 = 0;
    std::vector<std::string> cells = {std::to_string(t),
                                      decision.tier ? std::string(tier_name(*decision.tier)) : "-"};
    nlohmann::json tiers_json;
    for (const TierResult& result : results) {
      cells.push_back(result.declined ? "declined" : format_number(result.median_us));
      if (!result.declined) {
        worst_bound = std::max(worst_bound, result.comparison.max_error_over_bound);
        worst_fp64 = std::max(worst_fp64, result.comparison.normwise_error);
      }
      row_ok = row_ok && result.ok();
      tiers_json[std::string(tier_name(result.tier))] = to_json(result);
    }
    // The policy must have picked a tier for every T > 0, and it must be one that ran correctly.
    if (t > 0 && !decision.tier) row_ok = false;
    cells.push_back(format_number(worst_bound));
    cells.push_back(format_number(worst_fp64));
    cells.push_back(row_ok ? "ok" : "FAIL");
    table.add_row(cells);
    all_ok = all_ok && row_ok;
    rows.push_back(
        {{"tokens", t},
         {"chosen", decision.tier ? nlohmann::json(tier_name(*decision.tier)) : nlohmann::json()},
         {"decision", decision.summary},
         {"tiers", tiers_json},
         {"ok", row_ok}});
  }

  std::cout << "# lmoe run: " << resolved.name << ", d_model " << resolved.dims.d_model
            << ", d_latent " << resolved.dims.d_latent << ", " << dtype_name(resolved.dtype)
            << ", tp " << ranks << ", backend " << backend_name(chosen_backend) << ", comm "
            << chosen_comm << "\n"
            << "# times: median per forward over " << repeats
            << " run(s), all ranks, microseconds; "
            << "max_err/bound: worst |Y - contract| / allowed bound over tiers (<= 1 passes"
            << (reductions == ReductionOrder::unspecified
                    ? "; the bound of reductions in NCCL's own order"
                    : "")
            << "); "
            << "fp64_err: worst normwise error against fp64 math (tolerance "
            << format_number(fp64_tolerance(resolved.dtype)) << ")\n";
  table.print(std::cout);
  std::cout << (all_ok ? "all rows ok\n" : "SOME ROWS FAILED\n");

  if (!json_path.empty()) {
    nlohmann::json doc = {{"command", "run"},
                          {"lmoe_version", "0.1.0"},
                          {"preset", resolved.name},
                          {"d_model", resolved.dims.d_model},
                          {"d_latent", resolved.dims.d_latent},
                          {"dtype", dtype_name(resolved.dtype)},
                          {"eps", resolved.eps},
                          {"tp", ranks},
                          {"backend", backend_name(chosen_backend)},
                          {"comm", chosen_comm},
                          {"repeats", repeats},
                          {"seed", seed},
                          {"rows", rows},
                          {"ok", all_ok}};
    write_json_file(json_path, doc);
  }
  if (!all_ok) throw CLI::RuntimeError(1);
}

}  // namespace

void add_run_command(CLI::App& app) {
  auto command = std::make_shared<RunCommand>();
  CLI::App* sub = app.add_subcommand(
      "run",
      "run every tier at a preset's dims over a sweep of T, check each against the contract "
      "and fp64 math, print a table (default: kimi-k3, 4 ranks on threads)");
  command->model.add_to(*sub);
  sub->add_option("-n,--ranks", command->ranks, "tensor-parallel ranks (threads)")
      ->capture_default_str();
  sub->add_option("-t,--tokens", command->tokens, "token counts T to run")
      ->delimiter(',')
      ->capture_default_str();
  add_backend_option(*sub, command->backend);
  add_comm_option(*sub, command->comm);
  add_tier_table_option(*sub, command->tier_table);
  sub->add_option("--repeats", command->repeats, "timed forwards per tier and T")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sub->add_option("--seed", command->seed, "seed of the random inputs")->capture_default_str();
  sub->add_option("--json", command->json_path, "also write the results as JSON to this file");
  sub->callback([command] { command->execute(); });
}

}  // namespace lmoe::cli

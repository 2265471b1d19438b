// `lmoe explain`: the policy's decision for T tokens and tp ranks, with every reason.
#include <iostream>
#include <memory>

#include "common.hpp"
#include "lmoe/comm_group.hpp"
#include "lmoe/error.hpp"
#include "lmoe/tools/tail_floor.hpp"
#include "progress.hpp"
#include "table.hpp"

namespace lmoe::cli {

namespace {

struct ExplainCommand {
  ModelOptions model;
  std::int64_t tokens = 1;
  int tp = 8;
  std::string backend = "auto";
  std::string comm;  // empty: not known, so a table's comm is not compared
  std::string tier_table;
  std::string rates;  // --rates LINK_GBS,MEMORY_GBS,GEMM_TFLOPS for the floors

  // Each tier's floor at T (lmoe/tail_floor.hpp), one rank per GPU, on --rates or the rates lmoe
  // knows for this machine's GPU; a line saying why not where there are none.
  void print_floors(const RunningConfig& running, TailDims dims, DType dtype) const {
    const FloorRates machine =
        floor_rates(rates, running.gpu ? std::optional(running.gpu->name) : std::nullopt, dtype,
                    running.backend);
    if (!machine.rates) {
      std::cout << "floors: " << machine.text << "\n";
      return;
    }
    if (tokens < 1) return;
    std::cout << "floors at T=" << tokens << ", one rank per GPU, at " << machine.text
              << ": the least time each tier can take (docs/bench.md):\n";
    Table table({"tier", "floor_us", "comm_us", "memory_us", "flops_us", "bound_by"});
    for (TailTier tier : kAllTiers) {
      const TierFloor floor =
          tier_floor(tier, tokens, dims, dtype, tp, *machine.rates,
                     fused_runs_two_shot(running.backend, dims, dtype, tp, tokens));
      const char* bound = floor.floor_us == floor.comm_us     ? "links"
                          : floor.floor_us == floor.memory_us ? "memory"
                                                              : "GEMM";
      table.add_row(std::vector<std::string>{std::string(tier_name(tier)), fixed(floor.floor_us, 2),
                                             fixed(floor.comm_us, 2), fixed(floor.memory_us, 2),
                                             fixed(floor.flops_us, 2), bound});
    }
    table.print(std::cout);
  }

  void execute() const {
    if (!rates.empty()) parse_machine_rates(rates);  // refused before anything is printed
    const ModelOptions::Resolved resolved = model.resolve();
    LMOE_CHECK(tp >= 1, "--tp: expected at least 1, got " + std::to_string(tp));
    check_at_most("--tp", tp, kMaxRanks, "ranks");
    check_at_most("-t/--tokens", tokens, kMaxTokens, "tokens");
    const Backend chosen = resolve_backend(backend);
    const RunningConfig running =
        running_config(chosen, tp, resolved.dims, resolved.dtype,
                       comm.empty() ? std::nullopt : std::optional(resolve_comm(comm, chosen)));
    // As LatentTail decides: a tier table built into lmoe for this configuration (known only with
    // --comm), then the defaults by rank count.
    PolicyConfig policy = resolve_policy(tier_table);
    policy = with_shipped_tier_table(std::move(policy), running);
    policy = with_rank_defaults(std::move(policy), chosen, tp, resolved.dims, resolved.dtype);
    check_table_fits(policy, running);
    std::cout << resolved.name << ": d_model " << resolved.dims.d_model << ", d_latent "
              << resolved.dims.d_latent << ", " << dtype_name(resolved.dtype) << ", tp " << tp
              << ", backend " << backend_name(chosen) << "\n";
    std::cout << explain(tokens, policy,
                         tier_support(chosen, tokens, resolved.dims, resolved.dtype, tp));
    if (comm.empty() && !policy.table) {
      // The comm decides whether a built-in table holds: name the ones that would.
      for (const std::string& name : comm_backends(chosen)) {
        RunningConfig with_comm = running;
        with_comm.comm = name;
        const PolicyConfig shipped = with_shipped_tier_table(resolve_policy(tier_table), with_comm);
        if (shipped.table) {
          std::cout << "note: with --comm " << name << " the " << *shipped.table_path
                    << " (built into lmoe for this configuration) chooses instead\n";
        }
      }
    }
    print_floors(running, resolved.dims, resolved.dtype);
  }
};

}  // namespace

void add_explain_command(CLI::App& app) {
  auto command = std::make_shared<ExplainCommand>();
  CLI::App* sub = app.add_subcommand("explain", "say which tier runs T tokens and why");
  command->model.add_to(*sub);
  sub->add_option("-t,--tokens", command->tokens, "token count T")
      ->required()
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--tp", command->tp, "tensor-parallel ranks")->capture_default_str();
  add_backend_option(*sub, command->backend);
  sub->add_option("--comm", command->comm,
                  "the communicator the tail would use, for matching a measured tier table "
                  "and for the tables built into lmoe (default: not compared, none built in used)");
  add_tier_table_option(*sub, command->tier_table);
  sub->add_option("--rates", command->rates,
                  "LINK_GBS,MEMORY_GBS,GEMM_TFLOPS: one GPU's rates for the tiers' floors at T "
                  "(default: those lmoe knows for this machine's GPU, e.g. an H200's)");
  sub->callback([command] { command->execute(); });
}

}  // namespace lmoe::cli

// `lmoe tail`: replays one tail call dumped from an engine. IN holds routed [tp, T, l],
// shared [tp, T, d], norm.weight [l] and up_proj.weight [d, l]; tp is the first dim.
#include <iostream>
#include <memory>

#include "common.hpp"
#include "core/host_math.hpp"
#include "lmoe/comm_group.hpp"
#include "lmoe/error.hpp"
#include "lmoe/reference.hpp"
#include "lmoe/safetensors.hpp"
#include "lmoe/tools/tail_runner.hpp"

namespace lmoe::cli {

namespace {

struct TailCommand {
  std::string input;
  std::string output;
  std::string tier = "auto";
  std::string backend = "auto";
  std::string comm;  // empty: the backend's default
  std::string tier_table;
  std::optional<float> eps;
  bool check = false;

  void execute() const;
};

HostTensor take(SafetensorsFile& file, const std::string& input, const std::string& name,
                std::size_t rank) {
  auto found = file.tensors.find(name);
  if (found == file.tensors.end()) throw Error(input + ": missing tensor '" + name + "'");
  if (found->second.shape().size() != rank) {
    throw Error(input + ": tensor '" + name + "' has shape " + found->second.shape_string() +
                ", expected " + std::to_string(rank) + " dimensions");
  }
  return std::move(found->second);
}

float eps_from(const SafetensorsFile& file, const std::string& input, std::optional<float> flag,
               std::string& source) {
  if (flag) {
    source = "--eps";
    return *flag;
  }
  for (const char* key : {"eps", "rms_norm_eps"}) {
    auto found = file.metadata.find(key);
    if (found == file.metadata.end()) continue;
    try {
      std::size_t used = 0;
      const float value = std::stof(found->second, &used);
      if (used != found->second.size()) throw std::invalid_argument("trailing text");
      source = std::string("__metadata__ ") + key;
      return value;
    } catch (const std::exception&) {
      throw Error(input + ": __metadata__ " + key + "='" + found->second + "' is not a number");
    }
  }
  source = "default";
  return 1e-5f;
}

void TailCommand::execute() const {
  SafetensorsFile file = read_safetensors(input);
  TailCase c;
  c.routed = take(file, input, "routed", 3);
  c.shared = take(file, input, "shared", 3);
  c.norm_weight = take(file, input, "norm.weight", 1);
  c.up_proj_weight = take(file, input, "up_proj.weight", 2);
  const auto& rs = c.routed.shape();
  const auto& ss = c.shared.shape();
  c.tp = static_cast<int>(rs[0]);
  c.num_tokens = rs[1];
  c.dims = {ss[2], rs[2]};
  c.dtype = c.routed.dtype();
  std::string eps_source;
  c.eps = eps_from(file, input, eps, eps_source);

  auto expect_shape = [&](const HostTensor& tensor, const std::string& name,
                          std::vector<std::int64_t> shape) {
    if (tensor.shape() != shape) {
      throw Error(input + ": tensor '" + name + "' has shape " + tensor.shape_string() +
                  ", expected " + shape_string(shape) + " (from routed " + c.routed.shape_string() +
                  ")");
    }
    if (tensor.dtype() != c.dtype) {
      throw Error(input + ": tensor '" + name + "' is " +
                  std::string(safetensors_dtype_name(tensor.dtype())) + " but routed is " +
                  std::string(safetensors_dtype_name(c.dtype)) +
                  " (all four tensors must share one dtype)");
    }
  };
  if (c.tp < 1)
    throw Error(input + ": routed has tp=" + std::to_string(c.tp) +
                " (its first dim); expected >= 1");
  expect_shape(c.shared, "shared", {c.tp, c.num_tokens, c.dims.d_model});
  expect_shape(c.norm_weight, "norm.weight", {c.dims.d_latent});
  expect_shape(c.up_proj_weight, "up_proj.weight", {c.dims.d_model, c.dims.d_latent});

  RunOptions options;
  options.backend = resolve_backend(backend);
  options.comm = resolve_comm(comm, options.backend);
  options.policy = with_rank_defaults(resolve_policy(tier_table), options.backend, c.tp, c.dims,
                                      c.dtype, c.latent_norm);
  options.tier = parse_tier_or_auto(tier);
  check_table_fits(options.policy,
                   running_config(options.backend, c.tp, c.dims, c.dtype, options.comm));
  if (options.backend == Backend::cpu) cpu::set_blas_threads(1);

  const TierSupport support = tier_support(options.backend, c.num_tokens, c.dims, c.dtype, c.tp);
  std::cerr << "lmoe tail: " << input << ": tp=" << c.tp << " T=" << c.num_tokens
            << " d=" << c.dims.d_model << " l=" << c.dims.d_latent
            << " dtype=" << dtype_name(c.dtype) << " eps=" << c.eps << " (" << eps_source
            << ") backend=" << backend_name(options.backend) << " comm=" << options.comm << "\n";
  if (!options.tier) std::cerr << explain(c.num_tokens, options.policy, support);

  const CaseRun run = run_case_on_threads(c, options);
  if (!run.ranks_identical)
    throw Error("ranks produced different outputs; the output was not written");
  std::cout << "tier: " << (run.tier ? std::string(tier_name(*run.tier)) : "none (T=0)") << " — "
            << (options.tier ? std::string("forced by --tier")
                             : decide(c.num_tokens, options.policy, support).summary)
            << "\n";

  if (check) {
    const TailTier ran = run.tier.value_or(TailTier::overlap);
    // NCCL sums in its own order: its results are judged by the reordered-sum bound
    // (docs/numerics.md).
    const Comparison result = compare(
        run.ranks.front().y.matrix(),
        reference_tail(c, contract_of(ran), comm_reduction_order(options.comm)), exact_tail(c));
    std::cout << "check: " << result.bit_mismatches << " of " << result.elements
              << " elements differ in bits from the contract, " << result.beyond_bound
              << " beyond the bound (max err/bound " << result.max_error_over_bound
              << "); normwise error vs fp64 " << result.normwise_error << " (tolerance "
              << result.normwise_tolerance << ")\n";
    if (!result.ok())
      throw Error("check failed: the output does not meet the contract; it was not written");
  }

  std::map<std::string, HostTensor> tensors;
  tensors.emplace("output", run.ranks.front().y);
  write_safetensors(output, tensors,
                    {{"tier", run.tier ? std::string(tier_name(*run.tier)) : "none"},
                     {"tp", std::to_string(c.tp)},
                     {"eps", std::to_string(c.eps)},
                     {"producer", "lmoe 0.1.0"}});
  std::cout << "wrote " << output << ": output "
            << shape_string(std::vector<std::int64_t>{c.num_tokens, c.dims.d_model}) << " "
            << safetensors_dtype_name(c.dtype) << "\n";
}

}  // namespace

void add_tail_command(CLI::App& app) {
  auto command = std::make_shared<TailCommand>();
  CLI::App* sub = app.add_subcommand(
      "tail", "run the tail on tensors from a safetensors file, write the output");
  sub->add_option(
         "--input", command->input,
         "safetensors with routed [tp,T,l], shared [tp,T,d], norm.weight [l], up_proj.weight [d,l]")
      ->required();
  sub->add_option("--output", command->output,
                  "safetensors to write: output [T,d] in the input dtype")
      ->required();
  sub->add_option("--tier", command->tier, "auto, fused, overlap, column or token")
      ->capture_default_str();
  add_backend_option(*sub, command->backend);
  add_comm_option(*sub, command->comm);
  add_tier_table_option(*sub, command->tier_table);
  sub->add_option("--eps", command->eps,
                  "RMSNorm epsilon (default: __metadata__ eps or rms_norm_eps, else 1e-5)");
  sub->add_flag("--check", command->check,
                "compare with the contract and fp64 math before writing");
  sub->callback([command] { command->execute(); });
}

}  // namespace lmoe::cli

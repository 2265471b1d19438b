// lmoe: the latent MoE tail under tensor parallelism, from the command line.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <fstream>
#include <iostream>

#include "common.hpp"
#include "lmoe/comm_group.hpp"
#include "lmoe/error.hpp"

namespace lmoe::cli {

void ModelOptions::add_to(CLI::App& app, bool layers_only) {
  std::string presets;
  for (const ModelPreset& preset : model_presets()) {
    if (layers_only && !preset.layer) continue;
    presets += (presets.empty() ? "" : ", ") + preset.name;
  }
  app.add_option("--preset", preset, "model dims: " + presets)->capture_default_str();
  app.add_option("--d-model", d_model, "hidden size d (overrides the preset)")
      ->check(CLI::PositiveNumber);
  app.add_option("--d-latent", d_latent, "latent size l (overrides the preset)")
      ->check(CLI::PositiveNumber);
  app.add_option("--dtype", dtype, "storage dtype: bf16, f16 or f32 (default: the preset's)");
  app.add_option("--eps", eps, "RMSNorm epsilon (default: the preset's)");
}

void check_at_most(const std::string& flag, std::int64_t value, std::int64_t limit,
                   const std::string& unit) {
  if (value <= limit) return;
  throw Error(flag + ": at most " + std::to_string(limit) + (unit.empty() ? "" : " ") + unit +
              ", got " + std::to_string(value));
}

void check_forward_sizes(int ranks, const std::vector<std::int64_t>& tokens, std::int64_t repeats) {
  LMOE_CHECK(ranks >= 1, "--ranks: expected at least 1, got " + std::to_string(ranks));
  check_at_most("-n/--ranks", ranks, kMaxRanks, "ranks");
  for (std::int64_t t : tokens) {
    LMOE_CHECK(t >= 0, "--tokens: expected non-negative token counts, got " + std::to_string(t));
    check_at_most("-t/--tokens", t, kMaxTokens, "tokens");
  }
  check_at_most("--repeats", repeats, kMaxRepeats, "forwards");
}

ModelOptions::Resolved ModelOptions::resolve() const {
  check_at_most("--d-model", d_model, kMaxWidth, "");
  check_at_most("--d-latent", d_latent, kMaxWidth, "");
  const ModelPreset& base = find_preset(preset);
  Resolved resolved{base.name, base.dims, base.dtype, base.rms_norm_eps};
  if (d_model > 0) resolved.dims.d_model = d_model;
  if (d_latent > 0) resolved.dims.d_latent = d_latent;
  if (d_model > 0 || d_latent > 0) resolved.name += " (dims overridden)";
  if (!dtype.empty()) resolved.dtype = parse_dtype(dtype);
  if (eps) resolved.eps = *eps;
  return resolved;
}

Backend resolve_backend(const std::string& name) {
  if (name == "auto") return backend_available(Backend::cuda) ? Backend::cuda : Backend::cpu;
  const Backend backend = parse_backend(name);
  if (!backend_available(backend)) {
    throw Error("backend " + name + " is not available (not built, or no GPU on this machine)");
  }
  return backend;
}

std::string l2_note(Backend backend, bool cold_l2) {
  if (cold_l2) return ", L2 evicted before each";
  return backend == Backend::cuda ? ", L2 warm (see --cold-l2)" : "";
}

std::string layers_note(int layers) {
  return layers > 1 ? " of " + std::to_string(layers) +
                          " tails (layers, each its own weights; times per tail)"
                    : "";
}

std::string settings_note(const TimingSettings& settings) {
  return settings.empty() ? "" : ", with " + timing_settings_text(settings);
}

std::string resolve_comm(const std::string& name, Backend backend) {
  if (name.empty()) return default_comm_backend(backend);
  const std::vector<std::string> names = comm_backends(backend);
  if (std::find(names.begin(), names.end(), name) != names.end()) return name;
  std::string choices;
  for (const std::string& known : names) choices += (choices.empty() ? "" : ", ") + known;
  throw Error("--comm " + name + ": not available for the " + std::string(backend_name(backend)) +
              " backend here (choices: " + (choices.empty() ? "none" : choices) + ")");
}

void write_json_file(const std::string& path, const nlohmann::json& doc) {
  std::ofstream out(path);
  if (!out) throw Error("--json: cannot write '" + path + "'");
  out << doc.dump(2) << "\n";
  if (!out) throw Error("--json: writing '" + path + "' failed");
}

PolicyConfig resolve_policy(const std::string& tier_table) {
  return load_policy_config(process_environment(), tier_table.empty()
                                                       ? std::nullopt
                                                       : std::optional<std::string>(tier_table));
}

void check_table_fits(const PolicyConfig& policy, const RunningConfig& running) {
  if (!policy.table) return;
  for (const std::string& warning : match_tier_table(policy.table->provenance, running,
                                                     policy.table_path.value_or("(unnamed)"))) {
    std::cerr << "lmoe: warning: " << warning << "\n";
  }
}

}  // namespace lmoe::cli

int main(int argc, char** argv) {
  CLI::App app{"lmoe — the latent Mixture-of-Experts tail under tensor parallelism"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("lmoe ") + lmoe::cli::kVersion);
  lmoe::cli::add_run_command(app);
  lmoe::cli::add_tail_command(app);
  lmoe::cli::add_explain_command(app);
  lmoe::cli::add_bench_command(app);
  lmoe::cli::add_tune_command(app);
  lmoe::cli::add_layer_command(app);
  lmoe::cli::add_env_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    return app.exit(error);
  } catch (const lmoe::Error& error) {
    std::cerr << "lmoe: error: " << error.message() << "\n";
    return 2;
  } catch (const std::exception& error) {
    std::cerr << "lmoe: error: " << error.what() << "\n";
    return 2;
  }
  return 0;
}

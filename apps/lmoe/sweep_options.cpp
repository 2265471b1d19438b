#include "sweep_options.hpp"

#include <algorithm>

#include "lmoe/error.hpp"

namespace lmoe::cli {

void SweepOptions::add_to(CLI::App& app, const std::string& ranks_names,
                          const std::string& tokens_default) {
  model.add_to(app);
  std::string presets;
  for (const ModelPreset& preset : model_presets()) {
    presets += (presets.empty() ? "" : ", ") + preset.name;
  }
  app.get_option("--preset")
      ->default_str("")
      ->description("model dims: " + presets + " (default: kimi-k3 on cuda, small on cpu)");
  add_backend_option(app, backend);
  app.add_option(ranks_names, ranks, "tensor-parallel ranks (default: 8 on cuda, 4 on cpu)");
  ranks_flag_ = ranks_names;
  std::replace(ranks_flag_.begin(), ranks_flag_.end(), ',', '/');
  app.add_option("-t,--tokens", tokens, "token counts T (default " + tokens_default + ")")
      ->delimiter(',');
  app.add_option("--warmup", warmup,
                 "untimed forwards per T and tier (default: 5 on cuda, 2 on cpu)");
  app.add_option("--iters", iters,
                 "timed forwards per T and tier (default: 50 on cuda, 10 on cpu)");
  app.add_flag(
      "--cold-l2", cold_l2,
      "cuda: evict the GPU's L2 (read max(2x its size, 64 MiB)) before each timed forward, "
      "outside its time, then read the inputs back, as other layers would between two "
      "calls of the tail; meant for one rank per GPU (docs/bench.md)");
  app.add_option("--layers", layers,
                 "tails a timed iteration, back to back (one graph in graph mode), each with its "
                 "own copy of the weights, shared and output, as a model's layers; times are per "
                 "tail (the iteration's / N), so a graph's own launch cost is spread as in a "
                 "model's graph (1 to 64; docs/bench.md)")
      ->capture_default_str();
  app.add_option(
         "--mode", mode,
         "auto (graph where the comm is capturable and the workspaces persistent), graph, eager or "
         "device-tokens (one graph per tier for every T, T read on the device)")
      ->capture_default_str();
  app.add_option("--seed", seed, "seed of the weights and inputs")->capture_default_str();
}

SweepOptions::Resolved SweepOptions::resolve(
    const CLI::App& app, std::vector<std::int64_t> (*default_tokens)(Backend backend)) const {
  Resolved resolved;
  BenchOptions& options = resolved.options;
  options.backend = resolve_backend(backend);
  const bool cuda = options.backend == Backend::cuda;
  ModelOptions dims = model;
  if (app.count("--preset") == 0 && !cuda) dims.preset = "small";
  const ModelOptions::Resolved chosen = dims.resolve();
  resolved.preset = chosen.name;
  options.dims = chosen.dims;
  options.eps = chosen.eps;
  options.dtype = chosen.dtype;
  options.tp = ranks.value_or(cuda ? 8 : 4);
  LMOE_CHECK(options.tp >= 1,
             ranks_flag_ + ": expected at least 1 rank, got " + std::to_string(options.tp));
  check_at_most(ranks_flag_, options.tp, kMaxRanks, "ranks");
  options.tokens = tokens.empty() ? default_tokens(options.backend) : tokens;
  for (std::int64_t t : options.tokens) {
    LMOE_CHECK(t >= 1, "-t/--tokens: expected token counts >= 1, got " + std::to_string(t));
    check_at_most("-t/--tokens", t, kMaxTokens, "tokens");
  }
  options.warmup = warmup.value_or(cuda ? 5 : 2);
  LMOE_CHECK(options.warmup >= 0,
             "--warmup: expected >= 0 iterations, got " + std::to_string(options.warmup));
  check_at_most("--warmup", options.warmup, kMaxRepeats, "iterations");
  options.iters = iters.value_or(cuda ? 50 : 10);
  LMOE_CHECK(options.iters >= 1,
             "--iters: expected at least 1 timed iteration, got " + std::to_string(options.iters));
  check_at_most("--iters", options.iters, kMaxRepeats, "iterations");
  check_at_most("--layers", layers, kMaxLayers, "tails");
  if (mode != "auto") {
    try {
      options.mode = parse_bench_mode(mode);
    } catch (const Error& error) {
      throw Error("--mode: " + error.message() + " (or auto)");
    }
  }
  options.cold_l2 = cold_l2;
  options.layers = layers;
  options.seed = seed;
  return resolved;
}

std::vector<std::string> SweepOptions::given(const CLI::App& app) const {
  const std::vector<std::string> flags = {
      "--preset",    "--d-model", "--d-latent", "--dtype",   "--eps",    "--backend", ranks_flag_,
      "-t/--tokens", "--warmup",  "--iters",    "--cold-l2", "--layers", "--mode",    "--seed"};
  std::vector<std::string> found;
  for (const std::string& flag : flags) {
    // CLI11 finds an option by any one of its names: the last of "-t/--tokens".
    const std::string name = flag.substr(flag.rfind('/') + 1);
    if (app.count(name) > 0) found.push_back(flag);
  }
  return found;
}

}  // namespace lmoe::cli

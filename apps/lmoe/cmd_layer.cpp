// `lmoe layer`: the whole latent MoE layer (router, latent down-projection, routed experts, shared
// experts, tail) on random weights at a preset's dims, scaled down by default so that it runs on
// the CPU in seconds, or on one layer of a checkpoint (--weights DIR --layer N). Prints the time of
// each stage per T and checks every T against fp64 math (a cuda run also against the cpu backend),
// on the cpu or the cuda backend (docs/layer.md). With --graph (cuda) each T's forward is captured
// into a CUDA graph and timed as replays, each replay's y checked against the eager forward's bits.
// --describe prints the preset's layer as JSON instead of running it (benchmarks/torch_moe.py reads
// it, so that a model's layer is written down only in src/models/).
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <charconv>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <string_view>

#include "common.hpp"
#include "core/host_math.hpp"
#include "lmoe/comm_group.hpp"
#include "lmoe/error.hpp"
#include "lmoe/layer_reference.hpp"
#include "lmoe/safetensors.hpp"
#include "lmoe/settings.hpp"
#include "lmoe/tools/layer_runner.hpp"
#include "lmoe/tools/tail_bench.hpp"
#include "table.hpp"

namespace lmoe::cli {

namespace {

struct LayerCommand {
  ModelOptions model;
  int scale = 8;
  std::int64_t experts = 0;  // 0: the preset's (scaled by --scale)
  int ranks = 2;
  std::vector<std::int64_t> tokens = {1, 7, 64, 300};
  std::string backend = "cpu";
  std::string comm;
  std::string tier = "auto";
  std::string tier_table;
  int repeats = 0;  // 0: kEagerRepeats, or kGraphRepeats with --graph
  bool graph = false;
  bool cold_l2 = false;
  std::string dump_dir;
  std::uint64_t seed = 2026;
  bool no_check = false;
  std::string weights_dir;
  int layer_index = -1;
  bool keep_packed = false;
  std::string json_path;
  bool describe = false;

  // The options --describe reads (the layer's); every other option is a run's and is refused.
  static constexpr std::array<std::string_view, 8> kDescribeOptions = {
      "--describe", "--preset", "--d-model", "--d-latent",
      "--dtype",    "--eps",    "--scale",   "--experts"};

  static constexpr int kEagerRepeats = 3;
  static constexpr int kGraphRepeats = 50;  // replays are cheap; p10 and p90 need samples
  static constexpr int kGraphWarmup = 5;    // untimed replays, as lmoe bench warms a graph

  void execute() const;
  // --describe: the layer as one JSON object on stdout; nothing is made or run.
  void print_description() const;

 private:
  // The preset's layer as a run builds it: the preset's dims or --d-model/--d-latent, scaled down
  // by --scale (not for a checkpoint, loaded at the model's own dims), with --experts routed
  // experts where given; checked on its own (a run checks it again for its ranks).
  struct PresetLayer {
    const ModelPreset* preset = nullptr;
    ModelOptions::Resolved resolved;
    int divisor = 1;
    LayerConfig config;
  };
  PresetLayer preset_layer(bool load) const;
  // The flags resolved and checked, before anything is made or run.
  struct LayerSetup {
    bool load = false;  // a checkpoint's layer, not random weights
    int divisor = 1;    // the dims' scale-down
    const ModelPreset* preset = nullptr;
    ModelOptions::Resolved resolved;
    LayerConfig config;
    Backend chosen_backend = Backend::cpu;
    LayerOptions options;
    LayerRunOptions run;
    std::string setting;  // the run described in one line
  };
  int repeat_count() const { return repeats > 0 ? repeats : graph ? kGraphRepeats : kEagerRepeats; }
  // Per T: the inputs, every rank's results and, when checked, the fp64 reference and the cpu
  // backend's results on the same inputs (cuda runs).
  struct LayerRuns {
    std::vector<HostTensor> inputs;
    std::vector<LayerInputRun> results;
    std::unique_ptr<LayerReference> reference;
    std::vector<LayerInputRun> cpu_results;
    LayerWeightBytes weight_bytes;  // rank 0's
    // cuda: what building the layers took on rank 0's GPU (LayerRankResult::layer_device_bytes)
    std::int64_t device_bytes = -1;
  };
  // The printed table, its rows as JSON and whether every row passed its checks.
  struct LayerRows {
    Table table;
    nlohmann::json rows;
    bool all_ok = true;
  };

  LayerSetup setup() const;
  LayerRuns run_layers(const LayerSetup& setup) const;
  LayerRows report_rows(const LayerSetup& setup, const LayerRuns& runs) const;
  void write_report(const LayerSetup& setup, const LayerRuns& runs, const nlohmann::json& rows,
                    bool all_ok) const;
  void dump(const LayerSetup& setup, const LayerRuns& runs) const;
};

// Median over repeats of one stage of rank 0's times.
double median_us(const std::vector<LayerStageTimes>& times, double LayerStageTimes::*stage) {
  std::vector<double> values;
  for (const LayerStageTimes& t : times) values.push_back(t.*stage * 1e6);
  std::sort(values.begin(), values.end());
  return values.empty() ? -1 : values[values.size() / 2];
}

// How a cuda run compares with the cpu backend on the same input: the tokens both routed to the
// same experts (ids in order; a near-tie may go either way), and y on those tokens within the
// layer's tolerances.
struct VersusCpu {
  std::int64_t same_routing = 0;
  LayerComparison y;
};

VersusCpu versus_cpu(const LayerRankResult& mine, const LayerRankResult& cpu, std::int64_t cols,
                     DType dtype) {
  VersusCpu result;
  std::vector<double> y, y_cpu;
  for (std::int64_t t = 0; t < mine.routing.num_tokens; ++t) {
    const auto ids = mine.routing.ids_of(t), cpu_ids = cpu.routing.ids_of(t);
    if (!std::equal(ids.begin(), ids.end(), cpu_ids.begin(), cpu_ids.end())) continue;
    ++result.same_routing;
    for (std::int64_t c = 0; c < cols; ++c) {
      y.push_back(mine.y.get(t * cols + c));
      y_cpu.push_back(cpu.y.get(t * cols + c));
    }
  }
  result.y = compare_layer(y, y_cpu, cols, dtype);
  return result;
}

// Graph replays: per timed replay, the slowest rank's seconds (as lmoe bench times an iteration).
std::vector<double> slowest_rank_seconds(const LayerInputRun& run) {
  std::vector<double> seconds;
  for (const LayerRankResult& rank : run.ranks) {
    if (seconds.size() < rank.replay_seconds.size()) seconds.resize(rank.replay_seconds.size(), 0);
    for (std::size_t i = 0; i < rank.replay_seconds.size(); ++i)
      seconds[i] = std::max(seconds[i], rank.replay_seconds[i]);
  }
  return seconds;
}

double median_of_us(const std::vector<LayerStageTimes>& times,
                    double (LayerStageTimes::*measure)() const) {
  std::vector<double> values;
  for (const LayerStageTimes& t : times) values.push_back((t.*measure)() * 1e6);
  std::sort(values.begin(), values.end());
  return values.empty() ? -1 : values[values.size() / 2];
}

LayerCommand::PresetLayer LayerCommand::preset_layer(bool load) const {
  LMOE_CHECK(scale >= 1, "--scale: expected a divisor ≥ 1, got " + std::to_string(scale));
  check_at_most("--scale", scale, kMaxScale, "");
  check_at_most("--experts", experts, kMaxExperts, "experts");
  PresetLayer layer;
  layer.resolved = model.resolve();
  const ModelPreset& preset = *(layer.preset = &find_preset(model.preset));
  if (!preset.layer) {
    throw Error("--preset " + preset.name +
                ": no layer description (expert sizes unknown); presets with one: " + [] {
                  std::string names;
                  for (const ModelPreset& p : model_presets()) {
                    if (p.layer) names += (names.empty() ? "" : ", ") + p.name;
                  }
                  return names;
                }());
  }
  LayerConfig full = *preset.layer;
  full.d_model = layer.resolved.dims.d_model;
  full.d_latent = layer.resolved.dims.d_latent;
  layer.divisor = load ? 1 : scale;
  layer.config = scale_down(full, layer.divisor);
  if (experts > 0) layer.config.router.num_experts = experts;
  if (auto error = validate_layer_config(layer.config)) throw Error("layer config: " + *error);
  return layer;
}

LayerCommand::LayerSetup LayerCommand::setup() const {
  LayerSetup setup;
  const bool load = setup.load = !weights_dir.empty();
  if (load != (layer_index >= 0))
    throw Error(
        "--weights and --layer: give both (a checkpoint directory and a layer index) or neither");
  check_forward_sizes(ranks, tokens, repeats);
  LMOE_CHECK(!cold_l2 || graph,
             "--cold-l2: needs --graph (L2 is evicted before graph replays; "
             "before eager forwards it would hide their launch gaps)");
  if (keep_packed && !load)
    throw Error("--keep-packed: give --weights and --layer (random weights are dense)");
  if (load && (model.d_model > 0 || model.d_latent > 0)) {
    throw Error("--weights: the checkpoint has the preset's own dims; drop --d-model/--d-latent");
  }
  const PresetLayer layer = preset_layer(load);
  const ModelPreset& preset = *(setup.preset = layer.preset);
  const ModelOptions::Resolved& resolved = setup.resolved = layer.resolved;
  const int divisor = setup.divisor = layer.divisor;
  const LayerConfig& config = setup.config = layer.config;
  if (load && !preset.tensor_names)
    throw Error("--preset " + preset.name + ": no tensor names to load a checkpoint by");
  if (keep_packed && !preset.tensor_names->experts_mxfp4) {
    throw Error("--keep-packed: the routed experts of --preset " + preset.name +
                " are not MXFP4 (nothing to keep packed)");
  }
  if (auto error = validate_layer_config(config, ranks)) throw Error("layer config: " + *error);

  const Backend chosen_backend = setup.chosen_backend = resolve_backend(backend);
  if (graph && chosen_backend != Backend::cuda) {
    throw Error("--graph: CUDA graphs need --backend cuda; the " +
                std::string(backend_name(chosen_backend)) + " backend runs eagerly only");
  }
  LayerOptions& options = setup.options;
  options.config = config;
  options.dtype = resolved.dtype;
  options.rms_norm_eps = resolved.eps;
  options.backend = chosen_backend;
  options.policy = resolve_policy(tier_table);
  LayerRunOptions& run = setup.run;
  // A graph needs a communicator that can be captured: p2p unless another one is named.
  run.comm = resolve_comm(graph && comm.empty() ? "p2p" : comm, chosen_backend);
  if (graph && run.comm == "cuda-threads") {
    throw Error(
        "--graph: the cuda-threads communicator cannot be captured into a CUDA graph; use "
        "--comm p2p (ranks sharing one GPU also need LMOE_P2P_SHARED_GPU=1) or --comm nccl");
  }
  // A table for other hardware or dims fails here, before any weights are made or loaded.
  check_table_fits(options.policy, running_config(chosen_backend, ranks, config.tail_dims(),
                                                  resolved.dtype, run.comm));
  run.tier = parse_tier_or_auto(tier);
  run.repeats = repeat_count();
  run.warmup = graph ? kGraphWarmup : 1;  // first touches of weights and buffers are not timed
  run.graph = graph;
  run.cold_l2 = cold_l2;
  if (chosen_backend == Backend::cpu) cpu::set_blas_threads(1);  // ranks are the parallelism

  setup.setting = resolved.name +
                  (load ? " from " + weights_dir + " layer " + std::to_string(layer_index) : "") +
                  (keep_packed ? " (experts kept packed)" : "") +
                  (divisor > 1 ? " scaled down " + std::to_string(divisor) + "x" : "") + ": d " +
                  std::to_string(config.d_model) + ", l " + std::to_string(config.d_latent) + ", " +
                  std::to_string(config.router.num_experts) + " experts top-" +
                  std::to_string(config.router.top_k) + " (groups " +
                  std::to_string(config.router.topk_group) + "/" +
                  std::to_string(config.router.n_group) + "), expert I " +
                  std::to_string(config.expert_intermediate) + ", shared " +
                  std::to_string(config.num_shared_experts) + " x " +
                  std::to_string(config.shared_intermediate) + ", " +
                  std::string(activation_name(config.activation)) + ", " +
                  std::string(dtype_name(resolved.dtype)) + ", tp " + std::to_string(ranks) +
                  ", backend " + std::string(backend_name(chosen_backend)) + ", comm " + run.comm +
                  (graph ? std::string(", CUDA graph replays") +
                               (cold_l2 ? ", L2 evicted before each" : ", L2 warm (see --cold-l2)")
                         : std::string(", eager forwards"));
  std::cerr << "lmoe layer: " << setup.setting << "\n";
  return setup;
}

LayerCommand::LayerRuns LayerCommand::run_layers(const LayerSetup& setup) const {
  const bool load = setup.load;
  const ModelPreset& preset = *setup.preset;
  const ModelOptions::Resolved& resolved = setup.resolved;
  const LayerConfig& config = setup.config;
  const Backend chosen_backend = setup.chosen_backend;
  const LayerOptions& options = setup.options;
  const LayerRunOptions& run = setup.run;
  LayerRuns runs;
  std::vector<HostTensor>& inputs = runs.inputs;
  for (std::int64_t t : tokens) {
    inputs.push_back(make_random_layer_input(config.d_model, t, resolved.dtype,
                                             seed + 1 + static_cast<std::uint64_t>(t)));
  }
  // Rank `rank` of tp's weights: loaded from the checkpoint, or random (the same values for any
  // tp).
  const auto weights_of = [&](int tp, int rank) {
    if (!load) return make_random_layer_weights(config, resolved.dtype, tp, rank, seed);
    try {
      return load_layer_weights(weights_dir, *preset.tensor_names, layer_index, config,
                                resolved.dtype, tp, rank, {.keep_experts_packed = keep_packed});
    } catch (const Error& error) {  // the library names its arguments; here they are flags
      throw Error("--weights " + weights_dir + " --layer " + std::to_string(layer_index) + ": " +
                  error.message());
    }
  };
  runs.results = run_layer_on_threads(
      options, ranks,
      [&](int rank) {
        LayerWeights weights = weights_of(ranks, rank);
        // Rank 0's thread writes it; it is read once the ranks are joined.
        if (rank == 0) runs.weight_bytes = layer_weight_bytes(weights, resolved.dtype);
        return weights;
      },
      inputs, run);
  if (!runs.results.empty())
    runs.device_bytes = runs.results.front().ranks.front().layer_device_bytes;

  if (!no_check) {
    std::cerr << "lmoe layer: checking against fp64 math\n";
    runs.reference = std::make_unique<LayerReference>(config, resolved.eps, weights_of(1, 0));
    if (chosen_backend == Backend::cuda) {
      // The cpu backend is the reference every backend is held to: the same inputs through it.
      std::cerr << "lmoe layer: running the cpu backend on the same inputs\n";
      LayerOptions cpu_options = options;
      cpu_options.backend = Backend::cpu;
      cpu_options.policy = PolicyConfig{};  // a tier table, if any, was measured for cuda
      LayerRunOptions cpu_run;
      cpu_run.comm = default_comm_backend(Backend::cpu);
      cpu_run.tier = run.tier;
      cpu::set_blas_threads(1);
      runs.cpu_results = run_layer_on_threads(
          cpu_options, ranks, [&](int rank) { return weights_of(ranks, rank); }, inputs, cpu_run);
    }
  }
  return runs;
}

LayerCommand::LayerRows LayerCommand::report_rows(const LayerSetup& setup,
                                                  const LayerRuns& runs) const {
  const ModelOptions::Resolved& resolved = setup.resolved;
  const LayerConfig& config = setup.config;
  const std::vector<HostTensor>& inputs = runs.inputs;
  const std::vector<LayerInputRun>& results = runs.results;
  const std::unique_ptr<LayerReference>& reference = runs.reference;
  const std::vector<LayerInputRun>& cpu_results = runs.cpu_results;
  std::vector<std::string> columns = {"T",       "tier",       "router_us",
                                      "down_us", "experts_us", "shared_us",
                                      "tail_us", "total_us",   "forward_us"};
  if (graph) {
    for (const char* column : {"p10_us", "p90_us", "traced_us", "=eager"})
      columns.push_back(column);
  }
  for (const char* column : {"fp64_err", "row_err", "cpu_ids", "cpu_err", "ok"})
    columns.push_back(column);
  LayerRows out{Table(columns), nlohmann::json::array(), true};
  Table& table = out.table;
  nlohmann::json& rows = out.rows;
  bool& all_ok = out.all_ok;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const LayerRankResult& first = results[i].ranks.front();
    const std::vector<LayerStageTimes>& times = first.times;
    std::optional<LayerComparison> comparison;
    std::optional<VersusCpu> vs_cpu;
    if (reference && tokens[i] > 0) {
      const ExactLayer exact = reference->run(inputs[i].matrix(), first.routing);
      comparison = compare_layer(first.y.matrix(), exact.y);
      if (!cpu_results.empty()) {
        vs_cpu = versus_cpu(first, cpu_results[i].ranks.front(), config.d_model, resolved.dtype);
      }
    }
    const bool replays_match =
        std::all_of(results[i].ranks.begin(), results[i].ranks.end(),
                    [](const LayerRankResult& rank) { return rank.replay_matches_eager; });
    const std::vector<double> replay_seconds = slowest_rank_seconds(results[i]);
    const std::optional<TimeStats> replays =
        replay_seconds.empty() ? std::nullopt
                               : std::optional<TimeStats>(time_stats(replay_seconds));
    const bool ok = results[i].ranks_identical && replays_match &&
                    (!comparison || comparison->ok()) && (!vs_cpu || vs_cpu->y.ok());
    all_ok = all_ok && ok;
    const double stage_us[] = {median_us(times, &LayerStageTimes::router),
                               median_us(times, &LayerStageTimes::down_projection),
                               median_us(times, &LayerStageTimes::experts),
                               median_us(times, &LayerStageTimes::shared),
                               median_us(times, &LayerStageTimes::tail)};
    std::vector<std::string> cells = {std::to_string(tokens[i]),
                                      first.tier ? std::string(tier_name(*first.tier)) : "-"};
    for (double us : stage_us) cells.push_back(format_number(us));
    cells.push_back(format_number(median_of_us(times, &LayerStageTimes::total)));
    // Graph: the forward is the plain graph's replays; the stages and traced_us come from the
    // replays of the graph captured with stage events.
    const double forward_us = graph ? (replays ? replays->median * 1e6 : -1)
                                    : median_of_us(times, &LayerStageTimes::wall);
    cells.push_back(format_number(forward_us));
    if (graph) {
      cells.push_back(replays ? format_number(replays->p10 * 1e6) : "-");
      cells.push_back(replays ? format_number(replays->p90 * 1e6) : "-");
      cells.push_back(format_number(median_of_us(times, &LayerStageTimes::wall)));
      cells.push_back(tokens[i] == 0 ? "-" : replays_match ? "yes" : "NO");
    }
    cells.push_back(comparison ? format_number(comparison->normwise_error) : "-");
    cells.push_back(comparison ? format_number(comparison->max_row_error) : "-");
    cells.push_back(vs_cpu ? std::to_string(vs_cpu->same_routing) + "/" + std::to_string(tokens[i])
                           : "-");
    cells.push_back(vs_cpu ? format_number(vs_cpu->y.normwise_error) : "-");
    cells.push_back(ok ? "ok" : "FAIL");
    table.add_row(cells);
    nlohmann::json row = {
        {"tokens", tokens[i]},
        {"tier", first.tier ? nlohmann::json(tier_name(*first.tier)) : nlohmann::json()},
        {"router_us", stage_us[0]},
        {"down_projection_us", stage_us[1]},
        {"experts_us", stage_us[2]},
        {"shared_us", stage_us[3]},
        {"tail_us", stage_us[4]},
        {"total_us", median_of_us(times, &LayerStageTimes::total)},
        {"forward_us", forward_us},
        {"ranks_identical", results[i].ranks_identical},
        {"checked", comparison.has_value()},
        {"ok", ok}};
    if (comparison) {
      row["normwise_error_vs_fp64"] = comparison->normwise_error;
      row["normwise_tolerance"] = comparison->normwise_tolerance;
      row["max_row_error_vs_fp64"] = comparison->max_row_error;
      row["row_tolerance"] = comparison->row_tolerance;
    }
    if (graph) {
      row["traced_forward_us"] = median_of_us(times, &LayerStageTimes::wall);
      row["replay_matches_eager"] = replays_match;
      for (const auto& [key, value] :
           {std::pair<const char*, double TimeStats::*>{"p10_us", &TimeStats::p10},
            {"p90_us", &TimeStats::p90},
            {"min_us", &TimeStats::min},
            {"max_us", &TimeStats::max}}) {
        row[key] = replays ? nlohmann::json((*replays).*value * 1e6) : nlohmann::json();
      }
      nlohmann::json iterations = nlohmann::json::array();
      for (double seconds : replay_seconds) iterations.push_back(seconds * 1e6);
      row["iterations_us"] = iterations;
    }
    if (vs_cpu) {
      row["tokens_routed_as_cpu"] = vs_cpu->same_routing;
      row["normwise_error_vs_cpu"] = vs_cpu->y.normwise_error;
      row["max_row_error_vs_cpu"] = vs_cpu->y.max_row_error;
    }
    rows.push_back(row);
  }
  return out;
}

void LayerCommand::write_report(const LayerSetup& setup, const LayerRuns& runs,
                                const nlohmann::json& rows, bool all_ok) const {
  const LayerWeightBytes& weight_bytes = runs.weight_bytes;
  const bool load = setup.load;
  const ModelPreset& preset = *setup.preset;
  const ModelOptions::Resolved& resolved = setup.resolved;
  const LayerConfig& config = setup.config;
  const int divisor = setup.divisor;
  const Backend chosen_backend = setup.chosen_backend;
  const LayerRunOptions& run = setup.run;
  if (!json_path.empty()) {
    nlohmann::json doc = {
        {"command", "layer"},
        {"lmoe_version", kVersion},
        {"preset", preset.name},
        {"scale", divisor},
        {"weights", load ? nlohmann::json(weights_dir) : nlohmann::json()},
        {"layer", load ? nlohmann::json(layer_index) : nlohmann::json()},
        {"weight_bytes",
         {{"total", weight_bytes.total()},
          {"routed_experts", weight_bytes.routed_experts},
          {"routed_experts_dequantized", weight_bytes.routed_experts_dequantized},
          {"routed_experts_mxfp4", weight_bytes.routed_experts_mxfp4},
          {"other", weight_bytes.other},
          {"experts_packed", weight_bytes.experts_packed}}},
        {"layer_device_bytes",
         runs.device_bytes >= 0 ? nlohmann::json(runs.device_bytes) : nlohmann::json()},
        {"d_model", config.d_model},
        {"d_latent", config.d_latent},
        {"num_experts", config.router.num_experts},
        {"top_k", config.router.top_k},
        {"n_group", config.router.n_group},
        {"topk_group", config.router.topk_group},
        {"expert_intermediate", config.expert_intermediate},
        {"num_shared_experts", config.num_shared_experts},
        {"shared_intermediate", config.shared_intermediate},
        {"activation", activation_name(config.activation)},
        {"routed_scaling_factor", config.router.routed_scaling_factor},
        {"dtype", dtype_name(resolved.dtype)},
        {"eps", resolved.eps},
        {"tp", ranks},
        {"backend", backend_name(chosen_backend)},
        {"comm", run.comm},
        {"mode", graph ? "graph" : "eager"},
        {"cold_l2", cold_l2},
        {"warmup", run.warmup},
        {"repeats", run.repeats},
        {"seed", seed},
        {"rows", rows},
        {"ok", all_ok}};
    write_json_file(json_path, doc);
  }
}

// DIR/t{T}.safetensors per T > 0: x, rank 0's y and its routing (expert ids as exact f32 values,
// weights), for benchmarks/torch_moe.py --check-lmoe to run the same inputs.
void LayerCommand::dump(const LayerSetup& setup, const LayerRuns& runs) const {
  std::error_code error;
  std::filesystem::create_directories(dump_dir, error);
  if (error) throw Error("--dump-dir " + dump_dir + ": " + error.message());
  const std::int64_t k = setup.config.router.top_k;
  for (std::size_t i = 0; i < runs.inputs.size(); ++i) {
    const std::int64_t t = tokens[i];
    const LayerRankResult& first = runs.results[i].ranks.front();
    if (t == 0 || static_cast<std::int64_t>(first.routing.expert_ids.size()) != t * k) continue;
    HostTensor ids(DType::f32, {t, k}), weights(DType::f32, {t, k});
    for (std::int64_t s = 0; s < t * k; ++s) {
      ids.set(s, static_cast<float>(first.routing.expert_ids[static_cast<std::size_t>(s)]));
      weights.set(s, first.routing.weights[static_cast<std::size_t>(s)]);
    }
    const std::map<std::string, HostTensor> tensors = {
        {"x", runs.inputs[i]}, {"y", first.y}, {"expert_ids", ids}, {"expert_weights", weights}};
    const std::filesystem::path path =
        std::filesystem::path(dump_dir) / ("t" + std::to_string(t) + ".safetensors");
    write_safetensors(path.string(), tensors,
                      {{"preset", setup.preset->name},
                       {"backend", std::string(backend_name(setup.chosen_backend))},
                       {"tp", std::to_string(ranks)},
                       {"mode", graph ? "graph" : "eager"}});
  }
  std::cerr << "lmoe layer: wrote x, y and the routing per T to " << dump_dir << "\n";
}

// A float as its shortest decimal (1e-5f as 1e-05, not 9.99999974737875e-06), for JSON readers
// that take the number as a double.
double shortest_decimal(float value) {
  char text[32];
  const auto [end, error] = std::to_chars(text, text + sizeof(text), value);
  double decimal = value;
  if (error == std::errc()) std::from_chars(text, end, decimal);
  return decimal;
}

// The layer as `lmoe layer --describe` prints it: the config, the preset's eps and dtype (or
// --eps/--dtype), and where a checkpoint keeps each tensor ("" where the model has none).
nlohmann::json layer_description(const ModelPreset& preset, const LayerConfig& config,
                                 const ModelOptions::Resolved& resolved, int divisor) {
  const RouterConfig& router = config.router;
  const LayerTensorNames names = preset.tensor_names.value_or(LayerTensorNames{});
  nlohmann::json tensor_names = nlohmann::json::object();
  for (const auto& [key, member] : {std::pair<const char*, std::string LayerTensorNames::*>{
                                        "router_weight", &LayerTensorNames::router_weight},
                                    {"router_bias", &LayerTensorNames::router_bias},
                                    {"latent_down", &LayerTensorNames::latent_down},
                                    {"latent_norm", &LayerTensorNames::latent_norm},
                                    {"latent_up", &LayerTensorNames::latent_up},
                                    {"expert_gate", &LayerTensorNames::expert_gate},
                                    {"expert_up", &LayerTensorNames::expert_up},
                                    {"expert_down", &LayerTensorNames::expert_down},
                                    {"shared_gate", &LayerTensorNames::shared_gate},
                                    {"shared_up", &LayerTensorNames::shared_up},
                                    {"shared_down", &LayerTensorNames::shared_down}}) {
    tensor_names[key] = names.*member;
  }
  return {{"preset", preset.name},
          {"lmoe_version", kVersion},
          {"scale", divisor},
          {"d_model", config.d_model},
          {"d_latent", config.d_latent},
          {"router",
           {{"num_experts", router.num_experts},
            {"top_k", router.top_k},
            {"n_group", router.n_group},
            {"topk_group", router.topk_group},
            {"score", router_score_name(router.score)},
            {"correction_bias", router.correction_bias},
            {"renormalize", router.renormalize},
            {"routed_scaling_factor", shortest_decimal(router.routed_scaling_factor)}}},
          {"expert_intermediate", config.expert_intermediate},
          {"num_shared_experts", config.num_shared_experts},
          {"shared_intermediate", config.shared_intermediate},
          {"activation", activation_name(config.activation)},
          {"activation_beta", shortest_decimal(config.activation_beta)},
          {"activation_linear_beta", shortest_decimal(config.activation_linear_beta)},
          {"latent_norm", config.latent_norm},
          {"dtype", dtype_name(resolved.dtype)},
          {"eps", shortest_decimal(resolved.eps)},
          {"experts_mxfp4", names.experts_mxfp4},
          {"tensor_names", tensor_names}};
}

// What rank 0's weights hold, so that a user sees the memory of packed and dequantized experts.
void print_weight_bytes(const LayerWeightBytes& bytes, DType dtype) {
  const auto mib = [](std::size_t count) {
    return std::to_string(count) + " B (" + format_number(static_cast<double>(count) / 1048576.0) +
           " MiB)";
  };
  const std::string dense = "dequantized to " + std::string(dtype_name(dtype));
  std::cout << "# weights of rank 0: " << mib(bytes.total()) << "; routed experts "
            << mib(bytes.routed_experts) << " "
            << (bytes.experts_packed
                    ? "packed as MXFP4, " + mib(bytes.routed_experts_dequantized) + " " + dense
                    : "dense, " + mib(bytes.routed_experts_mxfp4) + " as MXFP4 blocks and scales")
            << "; the other weights " << mib(bytes.other) << "\n";
}

void LayerCommand::execute() const {
  const LayerSetup setup = this->setup();
  const LayerRuns runs = run_layers(setup);
  const LayerRows report = report_rows(setup, runs);
  const LayerWeightBytes& weight_bytes = runs.weight_bytes;
  const ModelOptions::Resolved& resolved = setup.resolved;
  const Backend chosen_backend = setup.chosen_backend;
  const std::string& setting = setup.setting;
  const Table& table = report.table;
  const bool all_ok = report.all_ok;

  std::cout << "# lmoe layer: " << setting << "\n";
  if (graph) {
    std::cout << "# forward_us, p10_us, p90_us: per replay of one captured forward (CUDA events "
                 "around each, the slowest rank's), "
              << setup.run.repeats << " timed after " << setup.run.warmup
              << " untimed; stages and traced_us: medians over as many replays of a second graph "
                 "captured with an event between stages (docs/layer.md); =eager: every rank's "
                 "replay gave the eager forward's y bit for bit\n";
  }
  std::cout << "# times: median over " << setup.run.repeats
            << " forward(s) (after one warm-up) of rank 0's stages, "
            << "microseconds (total_us: median of the per-forward sums; forward_us: median wall "
               "time of a forward, which is less than the sum where stages overlap"
            << (chosen_backend == Backend::cuda
                    ? (setting_flag("LMOE_LAYER_SERIAL_STAGES")
                           ? "; cuda: CUDA events per stage, shared runs after the experts "
                             "(LMOE_LAYER_SERIAL_STAGES=1), see docs/layer.md"
                           : "; cuda: CUDA events per stage, shared runs on a second stream "
                             "alongside router, down and experts, see docs/layer.md")
                    : "")
            << "); "
            << "fp64_err: normwise error of y against fp64 math (tolerance "
            << format_number(layer_normwise_tolerance(resolved.dtype))
            << "); row_err: worst |y - fp64| over "
            << "its row's RMS (tolerance " << format_number(layer_row_tolerance(resolved.dtype))
            << ")"
            << (chosen_backend == Backend::cuda
                    ? "; cpu_ids: tokens routed to the same experts as by the cpu backend "
                      "(the fp64 check uses the backend's own routing; a near-tie may go "
                      "either way); cpu_err: normwise error of y against the cpu backend's "
                      "on those tokens (same tolerances)"
                    : "")
            << "\n";
  print_weight_bytes(weight_bytes, resolved.dtype);
  if (runs.device_bytes >= 0) {
    std::cout << "# device memory in use on rank 0's GPU grew by " << runs.device_bytes << " B ("
              << format_number(static_cast<double>(runs.device_bytes) / 1048576.0)
              << " MiB) while the ranks built their layers (weights and workspaces; every "
                 "rank's where they share the GPU)\n";
  }
  table.print(std::cout);
  std::cout << (all_ok ? "all rows ok\n" : "SOME ROWS FAILED\n");

  write_report(setup, runs, report.rows, all_ok);
  if (!dump_dir.empty()) dump(setup, runs);
  if (!all_ok) throw CLI::RuntimeError(1);
}

void LayerCommand::print_description() const {
  const PresetLayer layer = preset_layer(/*load=*/false);
  std::cout << layer_description(*layer.preset, layer.config, layer.resolved, layer.divisor).dump(2)
            << "\n";
}

}  // namespace

void add_layer_command(CLI::App& app) {
  auto command = std::make_shared<LayerCommand>();
  CLI::App* sub = app.add_subcommand(
      "layer",
      "run the whole latent MoE layer (router, down-projection, experts, shared experts, tail) on "
      "random weights at a preset's dims (scaled down by --scale), time each stage per T and check "
      "y against fp64 math");
  command->model.add_to(*sub, /*layers_only=*/true);
  sub->add_option(
         "--scale", command->scale,
         "divide d, l, intermediate sizes and the expert count by this (1: the model's own dims)")
      ->capture_default_str();
  sub->add_option("--experts", command->experts,
                  "routed experts (default: the preset's, divided by --scale); e.g. --scale 1 "
                  "--experts 112 runs "
                  "the model's own dims with 1/8 of Kimi-K3's experts, to fit one GPU; with "
                  "--weights, the checkpoint's (one written with that many, e.g. by "
                  "benchmarks/torch_moe.py --generate --experts N)")
      ->check(CLI::PositiveNumber);
  sub->add_option("-n,--ranks", command->ranks, "tensor-parallel ranks (threads)")
      ->capture_default_str();
  sub->add_option("-t,--tokens", command->tokens, "token counts T to run")
      ->delimiter(',')
      ->capture_default_str();
  sub->add_option("--backend", command->backend,
                  "cpu or cuda (every rank on the current GPU with cuda-threads, or one GPU per "
                  "rank with --comm nccl)")
      ->capture_default_str();
  sub->add_option("--comm", command->comm, "communicator (default: the backend's)");
  sub->add_option("--tier", command->tier, "the tail's tier: auto, fused, overlap, column or token")
      ->capture_default_str();
  add_tier_table_option(*sub, command->tier_table);
  sub->add_option("--repeats", command->repeats,
                  "timed forwards per T (default: 3; with --graph 50 timed replays, and as many "
                  "replays of the graph with stage events)")
      ->check(CLI::PositiveNumber);
  sub->add_flag("--graph", command->graph,
                "cuda: capture each T's forward into a CUDA graph and time its replays (comm p2p "
                "unless --comm nccl); each replay's y is checked bit for bit against the eager "
                "forward's; eager forwards are the default");
  sub->add_flag("--cold-l2", command->cold_l2,
                "with --graph: evict the GPU's L2 before each replay (as lmoe bench --cold-l2)");
  sub->add_option("--dump-dir", command->dump_dir,
                  "also write DIR/t{T}.safetensors per T: x, rank 0's y and its routing "
                  "(benchmarks/torch_moe.py --check-lmoe reads them)");
  sub->add_option("--seed", command->seed, "seed of the random weights and inputs")
      ->capture_default_str();
  sub->add_flag("--no-check", command->no_check,
                "skip the fp64 check (it dominates the run time at large dims)");
  sub->add_option(
      "--weights", command->weights_dir,
      "load the layer from this checkpoint directory (safetensors shards, by the preset's tensor "
      "names; the preset's own dims, --scale ignored) instead of random weights");
  sub->add_option("--layer", command->layer_index, "the layer index to load from --weights");
  sub->add_flag("--keep-packed", command->keep_packed,
                "keep a checkpoint's MXFP4 routed experts packed (blocks and scales, ~3.8x fewer "
                "bytes than bf16) instead of dequantizing them at load: the cpu backend "
                "dequantizes each expert when a token needs it, the cuda backend keeps them packed "
                "on the GPU and its grouped GEMMs dequantize them (docs/layer.md)");
  sub->add_option("--json", command->json_path, "also write the results as JSON to this file");
  sub->add_flag(
      "--describe", command->describe,
      "print the preset's layer (dims scaled by --scale, router, experts, activation, eps, "
      "tensor names, whether the routed experts are MXFP4) as one JSON object and exit "
      "without running; takes --preset, --d-model, --d-latent, --dtype, --eps, --scale "
      "and --experts, and refuses the run options");
  sub->callback([command, sub] {
    if (!command->describe) return command->execute();
    for (const CLI::Option* option : sub->get_options()) {
      const std::string name = option->get_name();
      if (option->count() > 0 &&
          std::find(LayerCommand::kDescribeOptions.begin(), LayerCommand::kDescribeOptions.end(),
                    name) == LayerCommand::kDescribeOptions.end()) {
        throw Error("--describe: prints the layer without running it; drop " + name +
                    " (an option of a run)");
      }
    }
    command->print_description();
  });
}

}  // namespace lmoe::cli

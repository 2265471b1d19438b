// Options and helpers that several `lmoe` subcommands share.
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <vector>

#include "lmoe/dims.hpp"
#include "lmoe/latent_tail.hpp"
#include "lmoe/tier_policy.hpp"
#include "lmoe/tools/tier_tuning.hpp"
#include "lmoe/version.hpp"

namespace lmoe::cli {

// The tool's version, as `--version` and the JSON files say it.
inline constexpr const char* kVersion = lmoe::kVersion;

// Upper bounds of the sizes the command line takes: far above any model or machine lmoe runs, low
// enough that a typo (a digit too many) is refused before threads or memory are taken for it.
inline constexpr std::int64_t kMaxRanks = 64;        // -n/--ranks, --tp
inline constexpr std::int64_t kMaxTokens = 1 << 20;  // -t/--tokens, --check-max-tokens
inline constexpr std::int64_t kMaxWidth = 1 << 16;   // --d-model, --d-latent
inline constexpr std::int64_t kMaxRepeats = 100000;  // --repeats, --iters, --warmup
inline constexpr std::int64_t kMaxExperts = 4096;    // --experts
inline constexpr std::int64_t kMaxScale = 1024;      // --scale
inline constexpr std::int64_t kMaxLayers = 64;       // --layers

// lmoe::Error "<flag>: at most <limit> <unit>, got <value>" when value > limit.
void check_at_most(const std::string& flag, std::int64_t value, std::int64_t limit,
                   const std::string& unit);

// -n/--ranks ≥ 1 and within its bound, every -t/--tokens count ≥ 0 and within its bound, and
// --repeats within its bound (the commands that run forwards: run, layer).
void check_forward_sizes(int ranks, const std::vector<std::int64_t>& tokens, std::int64_t repeats);

// --preset, --d-model, --d-latent, --dtype, --eps: a preset's dims, each overridable.
struct ModelOptions {
  std::string preset = "kimi-k3";
  std::int64_t d_model = 0;   // 0: the preset's
  std::int64_t d_latent = 0;  // 0: the preset's
  std::string dtype;          // empty: the preset's
  std::optional<float> eps;   // empty: the preset's

  // layers_only: --preset lists only the presets with a layer description (`lmoe layer`).
  void add_to(CLI::App& app, bool layers_only = false);
  struct Resolved {
    std::string name;
    TailDims dims;
    DType dtype;
    float eps;
  };
  Resolved resolve() const;
};

// --backend: "auto" picks cuda when it is available, else cpu.
Backend resolve_backend(const std::string& name);

// --comm: empty picks the backend's default communicator; otherwise one that comm_backends lists.
std::string resolve_comm(const std::string& name, Backend backend);

// The end of a sweep's one-line description: whether L2 was evicted before each timed iteration
// (--cold-l2) or, on cuda, left warm (weights may stay in L2 between back-to-back replays); nothing
// on cpu.
std::string l2_note(Backend backend, bool cold_l2);
// " of 8 tails (layers, each its own weights; times per tail)" after "timed iterations" for a sweep
// of several tails an iteration (--layers); "" for one.
std::string layers_note(int layers);
// ", with LMOE_FUSED_DECODE=1" for the timing settings a measurement ran with; "" for none.
std::string settings_note(const TimingSettings& settings);

// The policy from the environment and an optional --tier-table.
PolicyConfig resolve_policy(const std::string& tier_table);

// A measured table in `policy` must fit `running`: lmoe::Error when it does not (match_tier_table);
// its warnings go to stderr, once.
void check_table_fits(const PolicyConfig& policy, const RunningConfig& running);
// --json FILE: writes `doc` (indented), or throws lmoe::Error naming the file.
void write_json_file(const std::string& path, const nlohmann::json& doc);

void add_run_command(CLI::App& app);
void add_tail_command(CLI::App& app);
void add_explain_command(CLI::App& app);
void add_bench_command(CLI::App& app);
void add_tune_command(CLI::App& app);
void add_layer_command(CLI::App& app);
void add_env_command(CLI::App& app);

// Options several commands take, each worded once.
inline void add_backend_option(CLI::App& sub, std::string& backend) {
  sub.add_option("--backend", backend, "auto, cpu or cuda")->capture_default_str();
}
inline void add_comm_option(CLI::App& sub, std::string& comm) {
  sub.add_option("--comm", comm,
                 "communicator: threads (cpu); cuda-threads, p2p or nccl (cuda; nccl: one GPU per "
                 "rank) (default: the backend's)");
}
inline void add_tier_table_option(CLI::App& sub, std::string& tier_table) {
  sub.add_option("--tier-table", tier_table, "tier table JSON (default: $LMOE_TIER_TABLE)");
}

}  // namespace lmoe::cli

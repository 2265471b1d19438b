// The tail benchmark behind `lmoe bench` (and the tier tuning that builds on it): a sweep over
// communicator backends × token counts T × tiers that times LatentTail::forward on every rank and
// checks one output per (T, tier) against the numerics contract, in the manner of nccl-tests.
//
// Definitions (docs/bench.md):
//   bytes     = T·(l + d)·esize, the input bytes each rank's tail reduces; algbw = bytes / time.
//   bus bytes = what each rank sends in the tier (DESIGN.md §2): see tier_bus_bytes; busbw = bus
//   bytes / time. time      = per iteration, the maximum over ranks; median, p10 and p90 over the
//   timed iterations.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "lmoe/dims.hpp"
#include "lmoe/dtype.hpp"
#include "lmoe/latent_tail.hpp"
#include "lmoe/reference.hpp"
#include "lmoe/tier.hpp"
#include "lmoe/tier_policy.hpp"
#include "lmoe/timing_settings.hpp"

namespace lmoe {

// ---- statistics and byte counts ----------------------------------------------------------------

// The p-th quantile (0 <= p <= 1) by linear interpolation between sorted samples, at position
// p·(n − 1) (numpy's default). Throws lmoe::Error for no samples or p outside [0, 1].
double quantile(std::span<const double> samples, double p);

struct TimeStats {
  double median = 0, p10 = 0, p90 = 0, min = 0, max = 0;
};
TimeStats time_stats(std::span<const double> samples);

// T·(l + d)·esize: the bytes of routed [T, l] and shared [T, d] one rank's tail reduces.
double tail_input_bytes(std::int64_t num_tokens, TailDims dims, DType dtype);

// Bytes each rank sends in `tier`, with AR(x) = 2(tp−1)/tp·T·x·esize and RS(x) = AG(x) =
// (tp−1)/tp·T·x·esize:
//   overlap, column: AR(l) + AR(d)
//   token:           RS(l) + RS(d) + AG(d)
//   fused:           (tp−1)·T·l·esize (one-shot all-reduce: the latent goes whole to every peer)
//                    + RS(d) + AG(d) (the stripes of shared and of the output); with
//                    fused_two_shot (the chained path with several ranks, fused_runs_two_shot in
//                    latent_tail.hpp) AR(l) + RS(d) + AG(d)
// 0 for tp = 1. The data's bytes: lines that carry their own flags send twice as many.
double tier_bus_bytes(TailTier tier, std::int64_t num_tokens, TailDims dims, DType dtype, int tp,
                      bool fused_two_shot = false);

// ---- the sweep ---------------------------------------------------------------------------------

// graph: each (T, tier) captured once into a CUDA graph and timed as graph replays; eager: every
// iteration calls LatentTail::forward (always so on the cpu backend); device_tokens
// ("device-tokens"): each tier captured once around LatentTail::forward_device_tokens and replayed
// for every T, which is written to the device before (docs/graphs.md).
enum class BenchMode : std::uint8_t { eager, graph, device_tokens };
std::string_view bench_mode_name(BenchMode mode);
BenchMode parse_bench_mode(std::string_view name);

// The default token counts: cuda 1, 2, 4, …, 32768 with the midpoints 96 … 3072 around the default
// tier crossings; cpu a short list for small dims.
std::vector<std::int64_t> default_bench_tokens(Backend backend);

struct BenchOptions {
  Backend backend = Backend::cpu;
  TailDims dims;
  float eps = 1e-5f;
  DType dtype = DType::bf16;
  int tp = 1;
  std::vector<std::int64_t> tokens;  // each >= 1, in the order to run
  std::vector<TailTier> tiers{kAllTiers.begin(), kAllTiers.end()};
  std::vector<std::string> comms;  // thread-group communicators; empty: comm_backends(backend)
  PolicyConfig policy;             // decides which tier is `chosen` at each T
  int warmup = 5;
  int iters = 50;
  // cuda only: before each timed iteration, outside its events, a read of 2 x the device's L2
  // evicts the weights and inputs the previous forward left there, as in a model where other
  // layers run between two calls of the tail. Warm-up iterations are not preceded by it. Ranks
  // sharing a GPU share its L2 (one's eviction can overlap a peer's timed forward): meant for one
  // rank per GPU.
  bool cold_l2 = false;
  // Tails a timed iteration runs back to back (in one graph in graph mode), each with its own copy
  // of the weights, `shared` and output, as consecutive layers of a model; times are per tail (the
  // iteration's / layers). With 1 a graph mode time includes the replay's own cost (docs/bench.md),
  // which a model's graph of many layers pays once: with layers > 1 it is
  // spread over them, as there. 1 … kMaxBenchLayers.
  int layers = 1;
  std::uint64_t seed = 2026;             // the weights and, mixed with (T, tier, rank), the inputs
  std::int64_t check_max_tokens = 2048;  // check every T up to this against the contract; 0: none
  std::optional<BenchMode> mode;  // nullopt: graph where the comm and tail allow it, else eager
  // Testing only: adds 1024 to one element of every checked output before the comparison, so that
  // the check can be seen to fail (`LMOE_BENCH_INJECT_FAULT=1` for `lmoe bench`).
  bool inject_fault = false;
};

inline constexpr int kMaxBenchLayers = 64;

// Throws lmoe::Error naming the first bad option (tp, tokens, tiers, comms, warm-up, iterations,
// layers, a mode or cold_l2 the backend cannot run).
void validate_bench_options(const BenchOptions& options);

struct BenchRecord {
  std::string comm;
  std::int64_t tokens = 0;
  TailTier tier = TailTier::fused;
  bool chosen = false;                  // the policy's pick at this T
  std::optional<std::string> declined;  // why the tier cannot run this T (nothing else is set)
  BenchMode mode = BenchMode::eager;
  std::string mode_reason;      // why this mode (e.g. why not graph)
  double bytes = 0;             // tail_input_bytes
  double bus_bytes = 0;         // tier_bus_bytes
  std::vector<double> seconds;  // per timed iteration, the maximum over ranks
  TimeStats stats;              // of `seconds`
  double algbw_gbps = 0;        // bytes / median, 1e9 bytes per second
  double busbw_gbps = 0;        // bus_bytes / median
  bool checked = false;         // T <= check_max_tokens: compared with the contract
  Comparison comparison;        // when checked: rank 0's output against reference_tail
  bool ranks_identical = true;  // when checked: every rank's output has rank 0's bits
  std::int64_t wrong() const { return checked ? comparison.beyond_bound : -1; }
  bool ok() const { return declined || !checked || (comparison.ok() && ranks_identical); }
};

struct BenchCommError {
  std::string comm;
  std::string error;
};

struct BenchResult {
  // Ordered by T (as given), then tier, then comm (as given); a comm that failed keeps the
  // records it finished.
  std::vector<BenchRecord> records;
  std::vector<BenchCommError>
      comm_errors;  // a comm whose group failed (e.g. it cannot run tp ranks here)
  bool ok() const;
};

struct BenchProgress {
  enum class Phase : std::uint8_t { time, check } phase = Phase::time;
  std::string comm;  // time phase: the comm running; check phase: empty
  std::int64_t tokens = 0;
  TailTier tier = TailTier::fused;
  std::size_t done = 0, total = 0;  // jobs of this phase done before this one, and in all
  double elapsed_seconds = 0;       // since the phase began
  double eta_seconds = -1;          // the phase's remaining time, estimated; < 0: unknown
};
using BenchProgressFn = std::function<void(const BenchProgress&)>;

// Runs the sweep: for each comm one group of tp rank threads, each rank with one LatentTail
// (weights from `seed`, identical on all ranks) and buffers for the largest T; for each T and
// tier, fresh inputs, warm-up and timed iterations, then (T <= check_max_tokens) one checked run
// of the same inputs with the output poisoned first. The checks against reference_tail run after
// all comms, on the host, once per (T, tier) for every comm. `progress` is called on one thread
// before each job. Throws lmoe::Error for bad options; a comm's failure is recorded, not thrown.
BenchResult run_tail_bench(const BenchOptions& options, const BenchProgressFn& progress = {});

// Where the benchmark ran, for its JSON.
struct BenchEnvironment {
  std::string hostname;
  std::string date_utc;  // ISO 8601, seconds
  struct Gpu {
    std::string name;
    std::string compute_capability;  // "9.0"
    int driver_version = 0;          // cudaDriverGetVersion: 1000·major + 10·minor
    int runtime_version = 0;         // cudaRuntimeGetVersion
    int device_count = 0;
  };
  std::optional<Gpu> gpu;                   // the cuda backend's device 0
  std::optional<std::string> nccl_version;  // builds with NCCL
  // The NVIDIA kernel driver ("580.159.04", /proc/driver/nvidia/version): the cuda backend only.
  std::optional<std::string> driver_version;
  TimingSettings settings;  // the environment's timing settings (lmoe/timing_settings.hpp)
};
BenchEnvironment bench_environment(Backend backend);

// ---- recorded sweeps ---------------------------------------------------------------------------

// A sweep as `lmoe bench --json` records it: for what and where it ran, and every record. Tier
// tables can be derived from it and checked against it on any machine (tier_tuning.hpp).
struct BenchSweep {
  std::string lmoe_version;  // "version"
  std::string date_utc;      // "date"
  std::string hostname;
  Backend backend = Backend::cpu;
  std::optional<BenchEnvironment::Gpu> gpu;
  std::optional<std::string> nccl_version;
  std::optional<std::string> driver_version;  // absent in files written before it was recorded
  std::string preset;
  TailDims dims;
  DType dtype = DType::bf16;
  float eps = 1e-5f;
  int tp = 1;
  std::vector<std::string> comms;
  std::vector<TailTier> tiers;
  std::vector<std::int64_t> tokens;
  int warmup = 0, iters = 0;
  bool cold_l2 = false;  // L2 evicted before each timed iteration; absent in older (warm) files
  int layers = 1;        // tails a timed iteration (BenchOptions::layers); absent in older files: 1
  TimingSettings settings;  // the timing settings it ran with; absent (none) in older files
  std::uint64_t seed = 0;
  std::int64_t check_max_tokens = 0;
  bool fault_injected = false;
  std::optional<std::string> tier_table;  // the table the policy loaded (its path)
  BenchResult result;
};

// The sweep of `options` with its result, as `lmoe bench --json` records it.
BenchSweep bench_sweep_of(const BenchOptions& options, const std::string& preset,
                          const BenchEnvironment& environment, BenchResult result);

// JSON text of the sweep: every field `lmoe bench --json` writes except those the tool adds
// (definitions, policy_check, ok); docs/bench.md. Times are written in microseconds.
std::string write_bench_json(const BenchSweep& sweep);

// Reads what write_bench_json writes (keys it does not know are ignored, so a `--check-table`
// file reads too). lmoe::Error naming `origin` and the field (a record's with its index:
// "records[17].median_us") when a field is missing, of the wrong type or out of range, when a
// record's "ok" disagrees with its fields, or when the file is not a bench sweep (a tier table,
// another command's JSON). Times read back as written: seconds = microseconds / 1e6.
BenchSweep read_bench_json(const std::string& json_text, const std::string& origin);
// read_bench_json of a file; lmoe::Error naming the path when it cannot be read.
BenchSweep read_bench_file(const std::string& path);

}  // namespace lmoe

#include "lmoe/tools/tail_bench.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <memory>
#include <set>

#include "lmoe/comm_group.hpp"
#include "lmoe/error.hpp"
#include "lmoe/tools/tail_runner.hpp"
#include "lmoe/tools/tier_tuning.hpp"
#include "runtime/backend_registry.hpp"
#include "tools/bench_rank.hpp"
#include "tools/bench_values.hpp"

namespace lmoe {

// ---- statistics and byte counts ----------------------------------------------------------------

double quantile(std::span<const double> samples, double p) {
  LMOE_CHECK(!samples.empty(), "quantile: expected at least one sample, got none");
  LMOE_CHECK(p >= 0.0 && p <= 1.0, "quantile: expected p in [0, 1], got " + std::to_string(p));
  std::vector<double> sorted(samples.begin(), samples.end());
  std::sort(sorted.begin(), sorted.end());
  const double position = p * static_cast<double>(sorted.size() - 1);
  const std::size_t below = static_cast<std::size_t>(std::floor(position));
  const std::size_t above = std::min(below + 1, sorted.size() - 1);
  return sorted[below] + (position - static_cast<double>(below)) * (sorted[above] - sorted[below]);
}

TimeStats time_stats(std::span<const double> samples) {
  TimeStats stats;
  stats.median = quantile(samples, 0.5);
  stats.p10 = quantile(samples, 0.1);
  stats.p90 = quantile(samples, 0.9);
  stats.min = quantile(samples, 0.0);
  stats.max = quantile(samples, 1.0);
  return stats;
}

double tail_input_bytes(std::int64_t num_tokens, TailDims dims, DType dtype) {
  return static_cast<double>(num_tokens) * static_cast<double>(dims.d_latent + dims.d_model) *
         static_cast<double>(dtype_size(dtype));
}

double tier_bus_bytes(TailTier tier, std::int64_t num_tokens, TailDims dims, DType dtype, int tp,
                      bool fused_two_shot) {
  LMOE_CHECK(tp >= 1, "tier_bus_bytes: expected tp >= 1, got " + std::to_string(tp));
  const double row = static_cast<double>(num_tokens) * static_cast<double>(dtype_size(dtype));
  const double l = static_cast<double>(dims.d_latent), d = static_cast<double>(dims.d_model);
  const double share = static_cast<double>(tp - 1) / tp;  // of a tensor that leaves each rank once
  const auto all_reduce = [&](double x) { return 2.0 * share * row * x; };
  const auto scatter_or_gather = [&](double x) { return share * row * x; };
  switch (tier) {
    case TailTier::overlap:
    case TailTier::column: return all_reduce(l) + all_reduce(d);
    case TailTier::token: return scatter_or_gather(l) + 2.0 * scatter_or_gather(d);
    case TailTier::fused:
      return (fused_two_shot ? all_reduce(l) : static_cast<double>(tp - 1) * row * l) +
             2.0 * scatter_or_gather(d);
  }
  return 0;
}

std::string_view bench_mode_name(BenchMode mode) {
  switch (mode) {
    case BenchMode::eager: return "eager";
    case BenchMode::graph: return "graph";
    case BenchMode::device_tokens: return "device-tokens";
  }
  return "eager";
}

BenchMode parse_bench_mode(std::string_view name) {
  if (name == "eager") return BenchMode::eager;
  if (name == "graph") return BenchMode::graph;
  if (name == "device-tokens") return BenchMode::device_tokens;
  throw Error("unknown bench mode '" + std::string(name) +
              "': expected eager, graph or device-tokens");
}

std::vector<std::int64_t> default_bench_tokens(Backend backend) {
  if (backend == Backend::cpu) return {1, 4, 16, 64, 128, 256, 512};
  // Powers of two, and midpoints where the default breakpoints (128, 256) and likely tuned ones
  // fall.
  std::set<std::int64_t> tokens = {96, 192, 384, 768, 1536, 3072};
  for (std::int64_t t = 1; t <= 32768; t *= 2) tokens.insert(t);
  return {tokens.begin(), tokens.end()};
}

void validate_bench_options(const BenchOptions& options) {
  LMOE_CHECK(options.tp >= 1,
             "bench: tp: expected at least 1 rank, got " + std::to_string(options.tp));
  LMOE_CHECK(!options.tokens.empty(), "bench: tokens: expected at least one token count, got none");
  for (std::int64_t t : options.tokens) {
    LMOE_CHECK(t >= 1, "bench: tokens: expected token counts >= 1, got " + std::to_string(t));
  }
  LMOE_CHECK(!options.tiers.empty(), "bench: tiers: expected at least one tier, got none");
  LMOE_CHECK(options.warmup >= 0,
             "bench: warmup: expected >= 0 iterations, got " + std::to_string(options.warmup));
  LMOE_CHECK(options.iters >= 1,
             "bench: iters: expected >= 1 timed iterations, got " + std::to_string(options.iters));
  LMOE_CHECK(options.layers >= 1 && options.layers <= kMaxBenchLayers,
             "bench: layers: expected 1 to " + std::to_string(kMaxBenchLayers) +
                 " tails a timed iteration, got " + std::to_string(options.layers));
  LMOE_CHECK(options.check_max_tokens >= 0, "bench: check_max_tokens: expected >= 0, got " +
                                                std::to_string(options.check_max_tokens));
  LMOE_CHECK(options.dims.d_model > 0 && options.dims.d_latent > 0,
             "bench: dims: expected positive d_model and d_latent, got " +
                 std::to_string(options.dims.d_model) + " and " +
                 std::to_string(options.dims.d_latent));
  LMOE_CHECK(
      !(options.backend == Backend::cpu && options.mode && *options.mode != BenchMode::eager),
      "bench: mode " + std::string(bench_mode_name(options.mode.value_or(BenchMode::eager))) +
          " needs the cuda backend (the cpu backend has no graphs)");
  LMOE_CHECK(!(options.backend == Backend::cpu && options.cold_l2),
             "bench: cold_l2 (--cold-l2) needs the cuda backend: the cpu backend has no device L2 "
             "to evict");
  const std::vector<std::string> available = comm_backends(options.backend);
  std::string names;
  for (const std::string& name : available) names += (names.empty() ? "" : ", ") + name;
  for (const std::string& comm : options.comms) {
    LMOE_CHECK(std::find(available.begin(), available.end(), comm) != available.end(),
               "bench: comm: unknown or unavailable comm backend '" + comm + "' for the " +
                   std::string(backend_name(options.backend)) +
                   " backend; available here: " + (names.empty() ? "none" : names));
  }
  LMOE_CHECK(!available.empty() || !options.comms.empty(),
             "bench: no comm backend can run the " + std::string(backend_name(options.backend)) +
                 " backend here");
}

bool BenchResult::ok() const {
  return comm_errors.empty() && std::all_of(records.begin(), records.end(),
                                            [](const BenchRecord& record) { return record.ok(); });
}

// ---- the sweep ---------------------------------------------------------------------------------

namespace {

struct Job {
  std::int64_t tokens;
  TailTier tier;
};

// One (T, tier) of one comm, filled by the rank threads (each rank its own entries; rank 0 the
// rest).
struct JobSlot {
  std::optional<std::string> declined;
  bool chosen = false;
  BenchMode mode = BenchMode::eager;
  std::string mode_reason;
  std::vector<std::vector<double>> rank_seconds;  // [tp][iters]
  HostTensor output;                              // rank 0's checked output
  std::vector<std::uint8_t> matches_rank0;  // [tp]: the rank's checked output has rank 0's bits
  std::vector<std::uint8_t> rank_done;      // [tp]

  bool complete() const {
    return std::all_of(rank_done.begin(), rank_done.end(),
                       [](std::uint8_t done) { return done != 0; });
  }
};

struct ModeChoice {
  BenchMode mode;
  std::string reason;
};

ModeChoice choose_mode(const BenchOptions& options, const Communicator& comm,
                       std::int64_t max_tokens) {
  if (options.backend == Backend::cpu)
    return {BenchMode::eager, "the cpu backend runs on the host"};
  const std::string comm_name(comm.backend_name());
  std::optional<std::string> why_not;
  if (!comm.graph_capturable()) {
    why_not = "comm '" + comm_name + "' cannot be captured (it synchronizes on the host)";
  }
  if (options.mode == BenchMode::eager) return {BenchMode::eager, "eager mode requested"};
  if (options.mode == BenchMode::device_tokens) {
    if (why_not) throw Error("bench: device-tokens mode cannot run: " + *why_not);
    return {BenchMode::device_tokens,
            "one graph per tier for every T (read on the device), workspaces sized for T=" +
                std::to_string(max_tokens)};
  }
  if (!why_not) {
    return {BenchMode::graph,
            "comm '" + comm_name +
                "' is capturable and the workspaces are sized for T=" + std::to_string(max_tokens)};
  }
  if (options.mode == BenchMode::graph) throw Error("bench: graph mode cannot run: " + *why_not);
  return {BenchMode::eager, *why_not};
}

std::unique_ptr<BenchRank> make_bench_rank(const BenchOptions& options,
                                           std::span<LatentTail* const> layers, Communicator& comm,
                                           std::int64_t max_tokens) {
  const Backend backend = options.backend;
#ifdef LMOE_HAS_CUDA
  if (backend == Backend::cuda)
    return make_cuda_bench_rank(layers, comm, max_tokens, options.cold_l2);
#endif
  LMOE_CHECK(backend == Backend::cpu, "bench: the cuda backend is not built");
  return make_host_bench_rank(layers, comm, max_tokens);
}

bool is_checked(const BenchOptions& options, std::int64_t tokens) {
  return tokens <= options.check_max_tokens;
}

// Reports progress with an ETA from the work done so far, each job weighted by its size.
class ProgressMeter {
 public:
  ProgressMeter(BenchProgress::Phase phase, std::vector<double> weights,
                const BenchProgressFn& callback)
      : phase_(phase),
        weights_(std::move(weights)),
        callback_(callback),
        start_(std::chrono::steady_clock::now()) {
    for (double w : weights_) total_ += w;
  }

  // Before job `index` (of weights) starts.
  void report(std::size_t index, const std::string& comm, std::int64_t tokens, TailTier tier) {
    // Jobs of weight 0 (declined, unchecked) take no time and are neither shown nor counted.
    if (!callback_ || index >= weights_.size() || weights_[index] <= 0) return;
    BenchProgress progress;
    progress.phase = phase_;
    progress.comm = comm;
    progress.tokens = tokens;
    progress.tier = tier;
    progress.elapsed_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    double done = 0;
    for (std::size_t i = 0; i < weights_.size(); ++i) {
      if (weights_[i] <= 0) continue;
      ++progress.total;
      if (i < index) {
        ++progress.done;
        done += weights_[i];
      }
    }
    if (done > 0) progress.eta_seconds = progress.elapsed_seconds * (total_ - done) / done;
    callback_(progress);
  }

 private:
  BenchProgress::Phase phase_;
  std::vector<double> weights_;
  double total_ = 0;
  const BenchProgressFn& callback_;
  std::chrono::steady_clock::time_point start_;
};

// One comm's part of the sweep, on every rank of its group.
void time_comm(const BenchOptions& options, const std::string& comm_name, const TailCase& weights,
               const std::vector<Job>& jobs, std::vector<JobSlot>& slots, ProgressMeter& meter,
               std::size_t first_progress_index) {
  const std::int64_t max_tokens = *std::max_element(options.tokens.begin(), options.tokens.end());
  run_comm_group(comm_name, options.tp, [&](int rank, Communicator& comm) {
    RunOptions run_options;
    run_options.backend = options.backend;
    run_options.policy = options.policy;
    TailOptions tail_options = tail_options_for(weights, comm, run_options);
    // Workspaces sized once for the largest T: no forward allocates (which would stall ranks that
    // share a GPU and spin on each other) and every forward can be captured.
    tail_options.max_tokens = max_tokens;
    // One tail per layer, each with its own copy of the weights (and its own workspaces), as a
    // model's layers have: a layer's weights are not in L2 because the previous layer read them.
    std::vector<std::unique_ptr<LatentTail>> owned_layers;
    std::vector<LatentTail*> layers;
    for (int i = 0; i < options.layers; ++i) {
      owned_layers.push_back(std::make_unique<LatentTail>(
          tail_options, comm, weights.norm_weight.matrix(), weights.up_proj_weight.matrix()));
      layers.push_back(owned_layers.back().get());
    }
    LatentTail& tail = *layers.front();  // what the policy and capabilities are asked of
    const std::unique_ptr<BenchRank> bench_rank =
        make_bench_rank(options, layers, comm, max_tokens);
    const ModeChoice mode = choose_mode(options, comm, max_tokens);
    const std::size_t r = static_cast<std::size_t>(rank);

    // Jobs come T by T (run_tail_bench): a T's tiers share its inputs and are timed in turns.
    for (std::size_t first = 0; first < jobs.size();) {
      std::size_t last = first;
      while (last < jobs.size() && jobs[last].tokens == jobs[first].tokens) ++last;
      const std::int64_t tokens = jobs[first].tokens;
      std::vector<std::size_t> runs;  // the T's jobs that run (not declined)
      for (std::size_t j = first; j < last; ++j) {
        const Job& job = jobs[j];
        JobSlot& slot = slots[j];
        std::optional<std::string> declined =
            tail.support(tokens).declined[static_cast<std::size_t>(job.tier)];
        if (!declined && mode.mode == BenchMode::device_tokens) {
          // The tier's buckets with T read on the device (a bucket without it: the reason).
          for (const DeviceTokenBucket& bucket : tail.device_token_buckets(job.tier)) {
            if (tokens <= bucket.max_tokens) {
              if (!bucket.tier) declined = bucket.reason;
              break;
            }
          }
        }
        if (rank == 0) {
          slot.declined = declined;
          slot.chosen = tail.decide(tokens).tier == job.tier;
          slot.mode = mode.mode;
          slot.mode_reason = mode.reason;
        }
        if (!declined) runs.push_back(j);
      }
      if (!runs.empty()) {
        bench_rank->load_inputs(tokens, bench::input_seed(options.seed, tokens, rank, 0),
                                bench::input_seed(options.seed, tokens, rank, 1));
        for (std::size_t j : runs) {
          if (rank == 0) meter.report(first_progress_index + j, comm_name, tokens, jobs[j].tier);
          bench_rank->prepare(jobs[j].tier, mode.mode);
          bench_rank->warm_up(options.warmup);
        }
        std::vector<TailTier> tiers;
        for (std::size_t j : runs) tiers.push_back(jobs[j].tier);
        std::vector<std::vector<double>> seconds =
            time_tiers_in_turns(*bench_rank, tiers, mode.mode, options.iters);
        for (std::size_t i = 0; i < runs.size(); ++i) {
          const std::size_t j = runs[i];
          slots[j].rank_seconds[r] = std::move(seconds[i]);
          for (double& each : slots[j].rank_seconds[r]) each /= options.layers;  // per tail
          if (!is_checked(options, tokens)) continue;
          bench_rank->prepare(jobs[j].tier, mode.mode);
          HostTensor y = bench_rank->checked_output();
          if (rank == 0) slots[j].output = std::move(y);
          comm.barrier();  // rank 0's output is in the slot
          slots[j].matches_rank0[r] = rank == 0 || same_bits(y, slots[j].output);
        }
      }
      for (std::size_t j = first; j < last; ++j) slots[j].rank_done[r] = 1;
      first = last;
    }
  });
}

BenchRecord record_of(const BenchOptions& options, const std::string& comm, const Job& job,
                      const JobSlot& slot) {
  BenchRecord record;
  record.comm = comm;
  record.tokens = job.tokens;
  record.tier = job.tier;
  record.chosen = slot.chosen;
  record.declined = slot.declined;
  record.mode = slot.mode;
  record.mode_reason = slot.mode_reason;
  record.bytes = tail_input_bytes(job.tokens, options.dims, options.dtype);
  record.bus_bytes = tier_bus_bytes(
      job.tier, job.tokens, options.dims, options.dtype, options.tp,
      fused_runs_two_shot(options.backend, options.dims, options.dtype, options.tp, job.tokens));
  if (slot.declined) return record;
  // An iteration lasts until its slowest rank is done.
  record.seconds.assign(static_cast<std::size_t>(options.iters), 0.0);
  for (const std::vector<double>& seconds : slot.rank_seconds) {
    for (std::size_t i = 0; i < seconds.size() && i < record.seconds.size(); ++i) {
      record.seconds[i] = std::max(record.seconds[i], seconds[i]);
    }
  }
  record.stats = time_stats(record.seconds);
  if (record.stats.median > 0) {
    record.algbw_gbps = record.bytes / record.stats.median * 1e-9;
    record.busbw_gbps = record.bus_bytes / record.stats.median * 1e-9;
  }
  if (is_checked(options, job.tokens)) {
    record.ranks_identical = std::all_of(slot.matches_rank0.begin(), slot.matches_rank0.end(),
                                         [](std::uint8_t match) { return match != 0; });
  }
  return record;
}

// The inputs every rank had at T (every tier's), regenerated on the host, with the shared weights.
void load_case_inputs(TailCase& c, const BenchOptions& options, const Job& job) {
  const std::int64_t l = options.dims.d_latent, d = options.dims.d_model;
  c.num_tokens = job.tokens;
  c.routed = HostTensor(options.dtype, {options.tp, job.tokens, l});
  c.shared = HostTensor(options.dtype, {options.tp, job.tokens, d});
  for (int rank = 0; rank < options.tp; ++rank) {
    fill_bench_values(c.routed.slice_matrix(rank).data, static_cast<std::size_t>(job.tokens * l),
                      options.dtype, bench::input_seed(options.seed, job.tokens, rank, 0));
    fill_bench_values(c.shared.slice_matrix(rank).data, static_cast<std::size_t>(job.tokens * d),
                      options.dtype, bench::input_seed(options.seed, job.tokens, rank, 1));
  }
}

double job_weight(std::int64_t tokens, double fixed) { return static_cast<double>(tokens) + fixed; }

}  // namespace

std::vector<std::vector<double>> time_tiers_in_turns(BenchRank& bench_rank,
                                                     std::span<const TailTier> tiers,
                                                     BenchMode mode, int iters) {
  std::vector<std::vector<double>> seconds(tiers.size());
  const int turns = std::min(kTimingTurns, iters);
  for (int turn = 0; turn < turns; ++turn) {
    const int count = iters * (turn + 1) / turns - iters * turn / turns;
    for (std::size_t i = 0; i < tiers.size(); ++i) {
      const std::size_t t = (i + static_cast<std::size_t>(turn)) % tiers.size();
      bench_rank.prepare(tiers[t], mode);
      bench_rank.warm_up(1);
      const std::vector<double> timed = bench_rank.time(count);
      seconds[t].insert(seconds[t].end(), timed.begin(), timed.end());
    }
  }
  return seconds;
}

BenchResult run_tail_bench(const BenchOptions& options_in, const BenchProgressFn& progress) {
  validate_bench_options(options_in);
  BenchOptions options = options_in;
  if (options.comms.empty()) options.comms = comm_backends(options.backend, options.tp);

  std::vector<Job> jobs;
  std::vector<double> time_weights;
  for (std::int64_t tokens : options.tokens) {
    const TierSupport support =
        tier_support(options.backend, tokens, options.dims, options.dtype, options.tp);
    for (TailTier tier : options.tiers) {
      jobs.push_back({tokens, tier});
      // Work grows with T; a fixed part stands for launches and synchronization.
      time_weights.push_back(support.can_run(tier) ? job_weight(tokens, 256) : 0.0);
    }
  }
  std::vector<double> all_time_weights;
  for (std::size_t c = 0; c < options.comms.size(); ++c) {
    all_time_weights.insert(all_time_weights.end(), time_weights.begin(), time_weights.end());
  }
  ProgressMeter time_meter(BenchProgress::Phase::time, all_time_weights, progress);

  // Weights from `seed`, the same on every rank and for every comm; inputs come per job.
  TailCase c =
      make_random_case(options.dims, options.eps, options.dtype, options.tp, 0, options.seed);

  const std::size_t tp = static_cast<std::size_t>(options.tp);
  std::vector<std::vector<JobSlot>> slots(options.comms.size(), std::vector<JobSlot>(jobs.size()));
  BenchResult result;
  for (std::size_t ci = 0; ci < options.comms.size(); ++ci) {
    for (JobSlot& slot : slots[ci]) {
      slot.rank_seconds.resize(tp);
      slot.matches_rank0.assign(tp, 0);
      slot.rank_done.assign(tp, 0);
    }
    try {
      time_comm(options, options.comms[ci], c, jobs, slots[ci], time_meter, ci * jobs.size());
    } catch (const Error& error) {
      result.comm_errors.push_back({options.comms[ci], error.message()});
    } catch (const std::exception& error) {
      result.comm_errors.push_back({options.comms[ci], error.what()});
    }
  }

  // Records by T, tier, then comm; checked ones are compared once the reference for (T, tier)
  // exists.
  std::vector<double> check_weights;
  for (std::size_t j = 0; j < jobs.size(); ++j) {
    bool any = false;
    for (std::size_t ci = 0; ci < options.comms.size(); ++ci) {
      any = any || (slots[ci][j].complete() && !slots[ci][j].declined &&
                    is_checked(options, jobs[j].tokens));
    }
    check_weights.push_back(any ? job_weight(jobs[j].tokens, 16) : 0.0);
  }
  ProgressMeter check_meter(BenchProgress::Phase::check, check_weights, progress);
  for (std::size_t j = 0; j < jobs.size(); ++j) {
    const Job& job = jobs[j];
    std::optional<ContractReference> reference;
    std::vector<double> exact;
    for (std::size_t ci = 0; ci < options.comms.size(); ++ci) {
      JobSlot& slot = slots[ci][j];
      if (!slot.complete()) continue;
      BenchRecord record = record_of(options, options.comms[ci], job, slot);
      if (!record.declined && is_checked(options, job.tokens)) {
        if (!reference) {
          check_meter.report(j, "", job.tokens, job.tier);
          load_case_inputs(c, options, job);
          reference = reference_tail(c, contract_of(job.tier));
          exact = exact_tail(c);
        }
        if (options.inject_fault && slot.output.numel() > 0)
          slot.output.set(0, slot.output.get(0) + 1024.0f);
        record.checked = true;
        record.comparison = compare(slot.output.matrix(), *reference, exact);
        slot.output = HostTensor();
      }
      result.records.push_back(std::move(record));
    }
  }
  return result;
}

// ---- environment -------------------------------------------------------------------------------

BenchEnvironment bench_environment(Backend backend) {
  BenchEnvironment environment;
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) == 0) environment.hostname = host;
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char date[32];
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", &utc);
  environment.date_utc = date;
  environment.settings = timing_settings_from_environment();
  const BackendOps& ops = backend_ops(backend);
  if (ops.built()) {
    if (const std::optional<DeviceDescription> device = ops.device()) {
      environment.gpu =
          BenchEnvironment::Gpu{device->name, device->compute_capability, device->driver_version,
                                device->runtime_version, device->device_count};
      environment.nccl_version = device->nccl_version;
      environment.driver_version = nvidia_driver_version();
    }
  }
  return environment;
}

}  // namespace lmoe

#include "lmoe/latent_tail.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <vector>

#include "core/device_token_buckets.hpp"
#include "core/tail_executor.hpp"
#include "core/validation.hpp"
#include "lmoe/error.hpp"
#include "lmoe/tier_table.hpp"
#include "runtime/backend_registry.hpp"
#include "runtime/rank_agreement.hpp"

namespace lmoe {

PolicyConfig with_rank_defaults(PolicyConfig policy, Backend backend, int ranks, TailDims dims,
                                DType dtype, bool latent_norm) {
  std::optional<std::string> decode, chained = std::string("not asked");
  if (backend == Backend::cuda && ranks < kFusedDefaultMinRanks &&
      policy.fused_max_tokens.source == SettingSource::built_in) {
    decode = fused_decode_limit(dims, dtype, ranks);
    chained = latent_norm || ranks > 1
                  ? fused_chained_limit(dims, dtype, ranks)
                  : std::optional<std::string>("the chained path needs the latent norm");
  }
  return with_rank_defaults(std::move(policy), backend, ranks, decode, chained);
}

namespace {

// Why d_model does not split into a stripe per rank (the fused kernels' rows of w_up per rank).
std::optional<std::string> stripes_limit(TailDims dims, int ranks) {
  if (ranks >= 1 && dims.d_model % ranks == 0) return std::nullopt;
  return "d_model=" + std::to_string(dims.d_model) + " is not split into " + std::to_string(ranks) +
         " stripes";
}

}  // namespace

std::optional<std::string> fused_decode_limit(TailDims dims, DType dtype, int ranks) {
  if (auto off = fused_decode_turned_off()) return off;
  if (auto unsplit = stripes_limit(dims, ranks)) return unsplit;
  return backend_ops(Backend::cuda).fused_decode_limit(dims, dtype, ranks);
}

std::optional<std::string> fused_chained_limit(TailDims dims, DType dtype, int ranks) {
  if (auto off = fused_chained_turned_off()) return off;
  if (auto unsplit = stripes_limit(dims, ranks)) return unsplit;
  return backend_ops(Backend::cuda).fused_chained_limit(dims, dtype, ranks);
}

bool fused_runs_two_shot(Backend backend, TailDims dims, DType dtype, int tp,
                         std::int64_t num_tokens) {
  const BackendOps& ops = backend_ops(backend);
  if (tp < 2 || num_tokens < 1 || num_tokens > ops.fused_chained_max_tokens() ||
      fused_chained_limit(dims, dtype, tp)) {
    return false;
  }
  return num_tokens > ops.fused_decode_beside_chained_tokens(tp) ||
         fused_decode_limit(dims, dtype, tp).has_value();
}

struct LatentTail::Impl {
  TailOptions options;
  Communicator& comm;
  std::unique_ptr<TailExecutor> executor;
  std::uint64_t config_hash = 0;
  std::string config_text;
  std::vector<std::string> table_warnings;

  Impl(TailOptions opts, Communicator& communicator)
      : options(std::move(opts)), comm(communicator) {}

  TailProblem problem(std::int64_t tokens) const {
    return {tokens, options.dims, options.dtype, comm.size()};
  }

  bool exchange_records() const { return options.check_ranks_agree && comm.size() > 1; }

  // forward_device_tokens: buckets per forced tier (key: the tier's index, -1 for the policy), made
  // once (the policy does not change after construction), and the keys whose GEMMs have run.
  mutable std::map<int, std::vector<DeviceTokenBucket>> device_buckets;
  std::set<int> device_warmed;

  DeviceTokensRunner* device_tokens() const {
    return dynamic_cast<DeviceTokensRunner*>(executor.get());
  }

  // Why the backend cannot run `tier` with T read on the device; nullopt when it can.
  std::optional<std::string> device_tokens_limit(TailTier tier) const {
    if (const DeviceTokensRunner* runner = device_tokens())
      return runner->device_tokens_limit(tier);
    return "the " + std::string(backend_name(options.backend)) +
           " backend reads T on the host only";
  }

  // What a replay could not run since the last check, as the error message; clears the record.
  std::optional<std::string> device_tokens_failure() {
    if (DeviceTokensRunner* runner = device_tokens()) {
      if (const auto failure = runner->take_device_tokens_failure()) {
        std::string text =
            "a run with T read on the device read T=" + std::to_string(failure->tokens);
        if (failure->out_of_range) {
          text += ", outside [0, max_tokens=" + std::to_string(options.max_tokens) + "]";
        } else {
          text += ", which no tier runs here";
          for (const auto& [key, buckets] : device_buckets) {
            for (const DeviceTokenBucket& bucket : buckets) {
              if (!bucket.tier && failure->tokens >= bucket.min_tokens &&
                  failure->tokens <= bucket.max_tokens) {
                text += " (" + bucket.reason + ")";
                break;
              }
            }
          }
        }
        return text + "; it ran nothing (out untouched)";
      }
    }
    return std::nullopt;
  }
};

LatentTail::LatentTail(TailOptions options, Communicator& comm, ConstMatrixView norm_weight,
                       ConstMatrixView up_proj_weight)
    : impl_(std::make_unique<Impl>(std::move(options), comm)) {
  // Where the project measured this very configuration (a tier table built into lmoe) and nothing
  // of the choice of tier is set, the table chooses (docs/tuning.md). (Without the backend there
  // is no GPU to match; validation below reports it.)
  if (backend_available(impl_->options.backend)) {
    RunningConfig running = running_config(impl_->options.backend, comm.size(), impl_->options.dims,
                                           impl_->options.dtype, std::string(comm.backend_name()));
    running.ranks_per_gpu = backend_ops(impl_->options.backend).ranks_on_my_device(comm);
    impl_->options.policy = with_shipped_tier_table(std::move(impl_->options.policy), running);
  }
  impl_->options.policy =
      with_rank_defaults(std::move(impl_->options.policy), impl_->options.backend, comm.size(),
                         impl_->options.dims, impl_->options.dtype, impl_->options.latent_norm);
  const TailOptions& opts = impl_->options;
  std::optional<std::string> error = validate_options(opts, comm.size());
  if (!error) error = validate_weights(opts, norm_weight, up_proj_weight);
  if (!error && !backend_available(opts.backend)) {
    error = "backend " + std::string(backend_name(opts.backend)) +
            " is not available in this build or on this machine";
  }

  if (!error && opts.policy.table) {
    // A table measured elsewhere would choose tiers by times that do not hold here.
    try {
      impl_->table_warnings =
          match_tier_table(opts.policy.table->provenance,
                           running_config(opts.backend, comm.size(), opts.dims, opts.dtype,
                                          std::string(comm.backend_name())),
                           opts.policy.table_path.value_or("(unnamed)"));
    } catch (const Error& mismatch) {
      error = mismatch.message();
    }
  }

  RankRecord mine;
  if (!error) {
    std::uint64_t hash = fnv1a(&opts.dims, sizeof(opts.dims));
    hash = fnv1a(&opts.rms_norm_eps, sizeof(opts.rms_norm_eps), hash);
    hash = fnv1a(&opts.latent_norm, sizeof(opts.latent_norm), hash);
    hash = fnv1a(&opts.dtype, sizeof(opts.dtype), hash);
    hash = fnv1a(&opts.backend, sizeof(opts.backend), hash);
    hash = fnv1a(&opts.max_tokens, sizeof(opts.max_tokens), hash);
    const std::uint64_t weights = checksum(up_proj_weight, checksum(norm_weight, kFnvOffsetBasis));
    hash = fnv1a(&weights, sizeof(weights), hash);
    char text[200];
    std::snprintf(
        text, sizeof(text),
        "d_model=%lld d_latent=%lld latent_norm=%s eps=%g dtype=%s backend=%s max_tokens=%lld "
        "weights=%016llx",
        static_cast<long long>(opts.dims.d_model), static_cast<long long>(opts.dims.d_latent),
        opts.latent_norm ? "true" : "false", static_cast<double>(opts.rms_norm_eps),
        std::string(dtype_name(opts.dtype)).c_str(),
        std::string(backend_name(opts.backend)).c_str(), static_cast<long long>(opts.max_tokens),
        static_cast<unsigned long long>(weights));
    impl_->config_hash = hash;
    impl_->config_text = text;
    mine.config_hash = hash;
    set_text(mine, text);
  } else {
    mine.ok = 0;
    set_text(mine, *error);
  }
  if (comm.size() > 1) {
    throw_if_ranks_disagree(exchange(comm, mine), "configuration");
  } else if (error) {
    throw Error(*error);
  }
  agree_on_policy(comm, opts.policy);

  impl_->executor =
      backend_ops(opts.backend)
          .make_tail_executor(comm, opts.dims, opts.dtype, opts.latent_norm, opts.rms_norm_eps,
                              norm_weight, up_proj_weight, opts.max_tokens);
}

LatentTail::~LatentTail() = default;

const TailOptions& LatentTail::options() const { return impl_->options; }
int LatentTail::tp_rank() const { return impl_->comm.rank(); }
int LatentTail::tp_size() const { return impl_->comm.size(); }

TierSupport tier_support(Backend backend, std::int64_t num_tokens, TailDims dims, DType dtype,
                         int tp) {
  TierSupport support;
  const TailProblem problem{num_tokens, dims, dtype, tp};
  for (TailTier tier : kAllTiers) {
    auto& declined = support.declined[static_cast<std::size_t>(tier)];
    declined = generic_tier_limit(tier, problem);
    if (!declined) declined = backend_ops(backend).tier_limit(tier, problem);
  }
  return support;
}

TierSupport LatentTail::support(std::int64_t num_tokens) const {
  const TailOptions& opts = impl_->options;
  TierSupport support = tier_support(opts.backend, num_tokens, opts.dims, opts.dtype, tp_size());
  const TailProblem problem = impl_->problem(num_tokens);
  for (TailTier tier : kAllTiers) {
    auto& declined = support.declined[static_cast<std::size_t>(tier)];
    if (!declined) declined = impl_->executor->can_implement(tier, problem);
  }
  return support;
}

TierDecision LatentTail::decide(std::int64_t num_tokens) const {
  return lmoe::decide(num_tokens, impl_->options.policy, support(num_tokens));
}

std::string LatentTail::explain(std::int64_t num_tokens) const {
  std::string text = lmoe::explain(num_tokens, impl_->options.policy, support(num_tokens));
  for (const std::string& warning : impl_->table_warnings) text += "warning: " + warning + "\n";
  return text;
}

const std::vector<std::string>& LatentTail::table_warnings() const { return impl_->table_warnings; }

std::optional<TailTier> LatentTail::forward(ConstMatrixView routed, MatrixView shared,
                                            MatrixView out, std::optional<TailTier> tier,
                                            StreamHandle stream) {
  const std::int64_t tokens = routed.rows;
  std::optional<std::string> error = impl_->device_tokens_failure();
  if (!error) {
    error = validate_call(impl_->options, impl_->executor->memory_space(), routed, as_const(shared),
                          as_const(out));
  }
  std::optional<TailTier> chosen;
  if (!error && tokens > 0) {
    if (tier) {
      const TierSupport can = support(tokens);
      if (auto declined = can.declined[static_cast<std::size_t>(*tier)]) {
        error = "tier " + std::string(tier_name(*tier)) +
                " cannot run T=" + std::to_string(tokens) + ": " + *declined;
      } else {
        chosen = tier;
      }
    } else {
      TierDecision decision = decide(tokens);
      if (decision.tier) {
        chosen = decision.tier;
      } else {
        error = decision.summary;
      }
    }
  }

  if (!error && chosen) {
    if (auto limit =
            impl_->executor->call_limit(*chosen, routed, as_const(shared), as_const(out))) {
      error = "tier " + std::string(tier_name(*chosen)) + " cannot run on these buffers: " + *limit;
    }
  }

  if (impl_->exchange_records()) {
    RankRecord mine;
    mine.config_hash = impl_->config_hash;
    mine.num_tokens = tokens;
    mine.tier = chosen ? static_cast<std::int32_t>(*chosen) : -1;
    mine.ok = error ? 0 : 1;
    set_text(mine, error ? *error : impl_->config_text);
    throw_if_ranks_disagree(exchange(impl_->comm, mine), "configuration");
  } else if (error) {
    throw Error(*error);
  }
  if (tokens == 0) return std::nullopt;
  impl_->executor->run(*chosen, routed, shared, out, stream);
  return chosen;
}

}  // namespace lmoe

namespace lmoe {

std::vector<DeviceTokenBucket> LatentTail::device_token_buckets(
    std::optional<TailTier> tier) const {
  const std::int64_t max_tokens = impl_->options.max_tokens;
  const int key = tier ? static_cast<int>(*tier) : -1;
  if (const auto found = impl_->device_buckets.find(key); found != impl_->device_buckets.end())
    return found->second;
  const auto choose = [&](std::int64_t tokens) -> DeviceTokenChoice {
    TierSupport can = support(tokens);
    for (TailTier each : kAllTiers) {
      auto& declined = can.declined[static_cast<std::size_t>(each)];
      if (declined) continue;
      if (auto limit = impl_->device_tokens_limit(each))
        declined = "with T read on the device: " + *limit;
    }
    if (tier) {
      if (const auto& declined = can.declined[static_cast<std::size_t>(*tier)]) {
        return {std::nullopt, "tier " + std::string(tier_name(*tier)) +
                                  " cannot run T=" + std::to_string(tokens) + ": " + *declined};
      }
      return {tier, {}};
    }
    TierDecision decision = lmoe::decide(tokens, impl_->options.policy, can);
    return {decision.tier, decision.summary};
  };
  std::vector<DeviceTokenBucket> buckets = make_device_token_buckets(max_tokens, choose);
  impl_->device_buckets[key] = buckets;
  return buckets;
}

void LatentTail::check_device_tokens() {
  if (auto failure = impl_->device_tokens_failure()) throw Error(*failure);
}

void LatentTail::forward_device_tokens(ConstMatrixView routed, MatrixView shared, MatrixView out,
                                       const std::int32_t* tokens_device,
                                       std::optional<TailTier> tier, StreamHandle stream) {
  const TailOptions& opts = impl_->options;
  const std::int64_t max_tokens = opts.max_tokens;
  std::optional<std::string> error = impl_->device_tokens_failure();
  if (!error && opts.backend != Backend::cuda) {
    error = "forward_device_tokens needs the cuda backend, not " +
            std::string(backend_name(opts.backend));
  }
  if (!error && max_tokens <= 0) {
    error =
        "forward_device_tokens needs TailOptions::max_tokens > 0 (the rows of its views), got " +
        std::to_string(max_tokens);
  }
  if (!error && tokens_device == nullptr)
    error = "tokens_device: expected a device pointer to T (int32), got null";
  if (!error)
    error = validate_call(opts, impl_->executor->memory_space(), routed, as_const(shared),
                          as_const(out));
  if (!error && routed.rows != max_tokens) {
    error = "routed: expected max_tokens=" + std::to_string(max_tokens) +
            " rows (T is read on the device), got " + std::to_string(routed.rows) + " rows";
  }

  std::vector<DeviceTokenBucket> buckets;
  bool capture = false;
  std::int64_t tokens = -1;  // read on the host outside capture
  const DeviceTokenBucket* bucket = nullptr;
  DeviceTokensRunner* runner = error ? nullptr : impl_->device_tokens();
  if (!error && runner == nullptr)
    error = "forward_device_tokens: this backend cannot read T on the device";
  if (!error) {
    buckets = device_token_buckets(tier);
    if (std::none_of(buckets.begin(), buckets.end(),
                     [](const DeviceTokenBucket& b) { return b.tier.has_value(); })) {
      error = "forward_device_tokens: no tier can run any T up to max_tokens=" +
              std::to_string(max_tokens) +
              " with T read on the device (T=1: " + buckets.front().reason + ")";
    }
  }
  if (!error) {
    // The fused kernel's vector accesses need aligned buffers: asked of every tier that may run.
    for (const DeviceTokenBucket& b : buckets) {
      if (!b.tier) continue;
      if (auto limit =
              impl_->executor->call_limit(*b.tier, routed, as_const(shared), as_const(out))) {
        error =
            "tier " + std::string(tier_name(*b.tier)) + " cannot run on these buffers: " + *limit;
        break;
      }
    }
  }
  if (!error) {
    capture = runner->capturing(stream);
    if (!capture) {
      tokens = runner->read_device_tokens(tokens_device, stream);
      if (tokens < 0 || tokens > max_tokens) {
        error = "T=" + std::to_string(tokens) +
                " read from tokens_device is outside [0, max_tokens=" + std::to_string(max_tokens) +
                "]";
      } else if (tokens > 0) {
        bucket = &*std::find_if(buckets.begin(), buckets.end(),
                                [&](const DeviceTokenBucket& b) { return tokens <= b.max_tokens; });
        if (!bucket->tier)
          error = "T=" + std::to_string(tokens) + " read from tokens_device: " + bucket->reason;
      }
    }
  }

  // Under capture the ranks agree on the call's shape (T is not known yet); outside it, on T too.
  if (impl_->exchange_records()) {
    RankRecord mine;
    mine.config_hash = impl_->config_hash;
    mine.num_tokens = capture ? -max_tokens : tokens;
    mine.tier = bucket && bucket->tier ? static_cast<std::int32_t>(*bucket->tier) : -1;
    mine.ok = error ? 0 : 1;
    set_text(mine, error ? *error : impl_->config_text);
    throw_if_ranks_disagree(exchange(impl_->comm, mine), "configuration");
  } else if (error) {
    throw Error(*error);
  }

  if (capture) {
    runner->capture_buckets(buckets, routed, shared, out, tokens_device, stream);
    return;
  }
  const int key = tier ? static_cast<int>(*tier) : -1;
  if (impl_->device_warmed.insert(key).second) runner->warm_up_buckets(buckets, stream);
  if (tokens == 0) return;
  const auto rows = [&](auto view) {
    view.rows = bucket->max_tokens;
    return view;
  };
  runner->run_bucket(*bucket->tier, rows(routed), rows(shared), rows(out), tokens_device, stream);
}

}  // namespace lmoe

#include "lmoe/latent_tail.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "core/rank_agreement.hpp"
#include "core/tail_executor.hpp"
#include "core/validation.hpp"
#include "cpu/cpu_tail_executor.hpp"
#include "lmoe/error.hpp"
#include "lmoe/tier_tuning.hpp"

#ifdef LMOE_HAS_CUDA
#include "cuda/cuda_tail_executor.hpp"
#endif

namespace lmoe {

std::string_view backend_name(Backend backend) { return backend == Backend::cpu ? "cpu" : "cuda"; }

Backend parse_backend(std::string_view name) {
  if (name == "cpu") return Backend::cpu;
  if (name == "cuda") return Backend::cuda;
  throw Error("unknown backend '" + std::string(name) + "': expected cpu or cuda");
}

bool backend_available(Backend backend) {
  if (backend == Backend::cpu) return true;
#ifdef LMOE_HAS_CUDA
  return cuda_device_count() > 0;
#else
  return false;
#endif
}

struct LatentTail::Impl {
  TailOptions options;
  Communicator& comm;
  std::unique_ptr<TailExecutor> executor;
  std::uint64_t config_hash = 0;
  std::string config_text;
  std::vector<std::string> table_warnings;

  Impl(TailOptions opts, Communicator& communicator) : options(std::move(opts)), comm(communicator) {}

  TailProblem problem(std::int64_t tokens) const {
    return {tokens, options.dims, options.dtype, comm.size()};
  }

  bool exchange_records() const {
    return options.check_ranks_agree && comm.size() > 1;
  }
};

LatentTail::LatentTail(TailOptions options, Communicator& comm, ConstMatrixView norm_weight,
                       ConstMatrixView up_proj_weight)
    : impl_(std::make_unique<Impl>(std::move(options), comm)) {
  const TailOptions& opts = impl_->options;
  std::optional<std::string> error = validate_options(opts, comm.size());
  if (!error) error = validate_weights(opts, norm_weight, up_proj_weight);
  if (!error && !opts.latent_norm && opts.backend != Backend::cpu) {
    error = "latent_norm = false (no RMSNorm before the up-projection) runs on the cpu backend only for now, not on " +
            std::string(backend_name(opts.backend));
  }
  if (!error && !backend_available(opts.backend)) {
    error = "backend " + std::string(backend_name(opts.backend)) +
            " is not available in this build or on this machine";
  }

  if (!error && opts.policy.table) {
    // A table measured elsewhere would choose tiers by times that do not hold here.
    try {
      impl_->table_warnings = match_tier_table(
          opts.policy.table->provenance,
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
    std::snprintf(text, sizeof(text),
                  "d_model=%lld d_latent=%lld latent_norm=%s eps=%g dtype=%s backend=%s max_tokens=%lld weights=%016llx",
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

  if (opts.backend == Backend::cpu) {
    impl_->executor = make_cpu_tail_executor(comm, opts.dims, opts.dtype, opts.latent_norm, opts.rms_norm_eps,
                                             norm_weight, up_proj_weight);
  } else {
#ifdef LMOE_HAS_CUDA
    impl_->executor = make_cuda_tail_executor(comm, opts.dims, opts.dtype, opts.rms_norm_eps,
                                              norm_weight, up_proj_weight, opts.max_tokens);
#endif
  }
}

LatentTail::~LatentTail() = default;

const TailOptions& LatentTail::options() const { return impl_->options; }
int LatentTail::tp_rank() const { return impl_->comm.rank(); }
int LatentTail::tp_size() const { return impl_->comm.size(); }

TierSupport tier_support(Backend backend, std::int64_t num_tokens, TailDims dims, DType dtype, int tp) {
  TierSupport support;
  const TailProblem problem{num_tokens, dims, dtype, tp};
  for (TailTier tier : kAllTiers) {
    auto& declined = support.declined[static_cast<std::size_t>(tier)];
    declined = generic_tier_limit(tier, problem);
#ifdef LMOE_HAS_CUDA
    if (!declined && backend == Backend::cuda) declined = cuda_tier_limit(tier, problem);
#else
    if (!declined && backend == Backend::cuda) declined = "the cuda backend is not built";
#endif
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

std::optional<TailTier> LatentTail::forward(ConstMatrixView routed, MatrixView shared, MatrixView out,
                                            std::optional<TailTier> tier, StreamHandle stream) {
  const std::int64_t tokens = routed.rows;
  std::optional<std::string> error = validate_call(impl_->options, impl_->executor->memory_space(),
                                                   routed, as_const(shared), as_const(out));
  std::optional<TailTier> chosen;
  if (!error && tokens > 0) {
    if (tier) {
      const TierSupport can = support(tokens);
      if (auto declined = can.declined[static_cast<std::size_t>(*tier)]) {
        error = "tier " + std::string(tier_name(*tier)) + " cannot run T=" + std::to_string(tokens) +
                ": " + *declined;
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
    if (auto limit = impl_->executor->call_limit(*chosen, routed, as_const(shared), as_const(out))) {
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

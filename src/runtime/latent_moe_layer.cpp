#include "lmoe/latent_moe_layer.hpp"

#include <chrono>
#include <cstdio>
#include <tuple>

#include "core/layer_executor.hpp"
#include "core/validation.hpp"
#include "lmoe/error.hpp"
#include "runtime/rank_agreement.hpp"

#include "runtime/backend_registry.hpp"

namespace lmoe {

namespace {

// A description of what must be the same on every rank: the configuration and the replicated
// weights (the router, its bias and the latent down-projection; the tail checks its own).
std::string describe(const LayerOptions& options, const LayerWeights& weights) {
  const LayerConfig& c = options.config;
  std::uint64_t hash = kFnvOffsetBasis;
  for (const HostTensor* tensor :
       {&weights.router_weight, &weights.router_bias, &weights.latent_down}) {
    hash = fnv1a(tensor->data(), tensor->nbytes(), hash);
  }
  char text[240];
  std::snprintf(
      text, sizeof(text),
      "d=%lld l=%lld E=%lld k=%lld groups=%lld/%lld score=%d bias=%d renorm=%d scale=%g "
      "I=%lld shared=%lldx%lld act=%s(%g,%g) norm=%d dtype=%s eps=%g backend=%s weights=%016llx",
      static_cast<long long>(c.d_model), static_cast<long long>(c.d_latent),
      static_cast<long long>(c.router.num_experts), static_cast<long long>(c.router.top_k),
      static_cast<long long>(c.router.topk_group), static_cast<long long>(c.router.n_group),
      static_cast<int>(c.router.score), static_cast<int>(c.router.correction_bias),
      static_cast<int>(c.router.renormalize), static_cast<double>(c.router.routed_scaling_factor),
      static_cast<long long>(c.expert_intermediate), static_cast<long long>(c.num_shared_experts),
      static_cast<long long>(c.shared_intermediate),
      std::string(activation_name(c.activation)).c_str(), static_cast<double>(c.activation_beta),
      static_cast<double>(c.activation_linear_beta), static_cast<int>(c.latent_norm),
      std::string(dtype_name(options.dtype)).c_str(), static_cast<double>(options.rms_norm_eps),
      std::string(backend_name(options.backend)).c_str(), static_cast<unsigned long long>(hash));
  return text;
}

std::optional<std::string> validate_layer(const LayerOptions& options, int tp,
                                          const LayerWeights& weights) {
  if (auto error = validate_layer_config(options.config, tp)) return "layer config: " + *error;
  if (auto error = validate_layer_weights(options.config, options.dtype, tp, weights)) return error;
  const BackendOps& ops = backend_ops(options.backend);
  if (ops.built() && !ops.available()) {
    return "backend " + std::string(backend_name(options.backend)) + ": no " +
           (options.backend == Backend::cuda ? "CUDA GPU" : "device") +
           " is visible on this machine";
  }
  if (auto limit = ops.layer_limit(options.config)) {
    return "backend " + std::string(backend_name(options.backend)) + ": " + *limit;
  }
  return std::nullopt;
}

using Clock = std::chrono::steady_clock;

}  // namespace

struct LatentMoELayer::Impl {
  LayerOptions options;
  Communicator& comm;
  std::unique_ptr<LayerExecutor> executor;
  std::unique_ptr<LatentTail> tail;
  std::uint64_t config_hash = 0;
  std::string config_text;
  LayerStageTimes times;
  LayerWeightBytes weight_bytes;
  // forward()'s partials where the executor keeps none of its own (cpu).
  HostTensor routed;           // [T, l] this rank's partial
  HostTensor shared;           // [T, d] this rank's partial
  bool times_pending = false;  // the executor fills `times` on request (device events)

  Impl(LayerOptions opts, Communicator& communicator)
      : options(std::move(opts)), comm(communicator) {}

  bool exchange_records() const { return options.check_ranks_agree && comm.size() > 1; }

  // Every rank raises the same error when one rank's call is bad or ranks disagree on T.
  void agree_on_call(std::int64_t tokens, const std::optional<std::string>& error) {
    if (exchange_records()) {
      RankRecord mine;
      mine.config_hash = config_hash;
      mine.num_tokens = tokens;
      mine.ok = error ? 0 : 1;
      set_text(mine, error ? *error : config_text);
      throw_if_ranks_disagree(exchange(comm, mine), "layer configuration");
    } else if (error) {
      throw Error(*error);
    }
  }

  // Ranks that routed differently would sum partials of different experts: fail instead.
  void agree_on_routing(std::int64_t tokens) {
    const Routing* routing = executor->host_routing();
    if (!exchange_records() || routing == nullptr) return;
    RankRecord mine;
    mine.config_hash =
        fnv1a(routing->expert_ids.data(), routing->expert_ids.size() * sizeof(std::int32_t));
    mine.config_hash =
        fnv1a(routing->weights.data(), routing->weights.size() * sizeof(float), mine.config_hash);
    mine.num_tokens = tokens;
    char text[64];
    std::snprintf(text, sizeof(text), "routing hash %016llx",
                  static_cast<unsigned long long>(mine.config_hash));
    set_text(mine, text);
    throw_if_ranks_disagree(exchange(comm, mine), "routing");
  }

  void run_partials(ConstMatrixView x, MatrixView routed_out, MatrixView shared_out,
                    std::optional<std::string> error, StreamHandle stream) {
    const LayerConfig& c = options.config;
    const MemorySpace space = executor->memory_space();
    const std::int64_t tokens = x.rows;
    if (!error && tokens < 0)
      error = "x: expected a non-negative token count, got " + std::to_string(tokens);
    if (!error) error = check_matrix("x", x, options.dtype, space, tokens, c.d_model);
    if (!error) error = executor->cannot_run(tokens, stream);
    if (!error)
      error =
          check_matrix("routed", as_const(routed_out), options.dtype, space, tokens, c.d_latent);
    if (!error)
      error = check_matrix("shared", as_const(shared_out), options.dtype, space, tokens, c.d_model);
    agree_on_call(tokens, error);
    times = {};
    times_pending = true;
    executor->run(x, routed_out, shared_out, times, stream);
    agree_on_routing(tokens);
  }
};

LatentMoELayer::LatentMoELayer(LayerOptions options, Communicator& comm, LayerWeights weights)
    : impl_(std::make_unique<Impl>(std::move(options), comm)) {
  const LayerOptions& opts = impl_->options;
  const std::optional<std::string> error = validate_layer(opts, comm.size(), weights);
  RankRecord mine;
  if (!error) {
    impl_->config_text = describe(opts, weights);
    impl_->config_hash = fnv1a(impl_->config_text.data(), impl_->config_text.size());
    mine.config_hash = impl_->config_hash;
    set_text(mine, impl_->config_text);
  } else {
    mine.ok = 0;
    set_text(mine, *error);
  }
  if (comm.size() > 1) {
    throw_if_ranks_disagree(exchange(comm, mine), "layer configuration");
  } else if (error) {
    throw Error(*error);
  }

  impl_->weight_bytes = layer_weight_bytes(weights, opts.dtype);
  impl_->executor = backend_ops(opts.backend)
                        .make_layer_executor(opts.config, opts.dtype, comm.size(), weights,
                                             opts.max_tokens, opts.device_experts);
  TailOptions tail;
  tail.dims = opts.config.tail_dims();
  tail.rms_norm_eps = opts.rms_norm_eps;
  tail.latent_norm = opts.config.latent_norm;
  tail.dtype = opts.dtype;
  tail.backend = opts.backend;
  tail.policy = opts.policy;
  tail.check_ranks_agree = opts.check_ranks_agree;
  tail.max_tokens = opts.max_tokens;
  impl_->tail = std::make_unique<LatentTail>(tail, comm, weights.latent_norm.matrix(),
                                             weights.latent_up.matrix());
}

LatentMoELayer::~LatentMoELayer() = default;

const LayerOptions& LatentMoELayer::options() const { return impl_->options; }
int LatentMoELayer::tp_rank() const { return impl_->comm.rank(); }
int LatentMoELayer::tp_size() const { return impl_->comm.size(); }
LatentTail& LatentMoELayer::tail() { return *impl_->tail; }
const LayerWeightBytes& LatentMoELayer::weight_bytes() const { return impl_->weight_bytes; }
const LayerStageTimes& LatentMoELayer::last_times() const {
  if (impl_->times_pending) {
    impl_->executor->finish_times(impl_->times);
    impl_->times_pending = false;
  }
  return impl_->times;
}
const Routing* LatentMoELayer::last_routing() const { return impl_->executor->host_routing(); }

void LatentMoELayer::set_capture_stage_events(bool on) {
  impl_->executor->set_capture_stage_events(on);
}

LayerStageTimes LatentMoELayer::replay_stage_times() const {
  if (auto times = impl_->executor->replay_stage_times()) return *times;
  throw Error(
      "replay_stage_times: no forward of this layer was captured with stage events (call "
      "set_capture_stage_events(true) before capturing; the " +
      std::string(impl_->executor->backend_name()) + " backend " +
      (impl_->executor->memory_space() == MemorySpace::device ? "records them in a graph)"
                                                              : "has no graphs)"));
}

void LatentMoELayer::forward_partials(ConstMatrixView x, MatrixView routed, MatrixView shared,
                                      StreamHandle stream) {
  impl_->run_partials(x, routed, shared, std::nullopt, stream);
}

std::optional<TailTier> LatentMoELayer::forward(ConstMatrixView x, MatrixView y,
                                                std::optional<TailTier> tier, StreamHandle stream) {
  Impl& impl = *impl_;
  const LayerConfig& c = impl.options.config;
  const std::int64_t tokens = std::max<std::int64_t>(x.rows, 0);
  std::optional<std::string> error = check_matrix("y", as_const(y), impl.options.dtype,
                                                  impl.executor->memory_space(), x.rows, c.d_model);
  MatrixView routed, shared;
  if (auto buffers = impl.executor->partial_buffers(tokens, stream)) {
    std::tie(routed, shared) = *buffers;
  } else {
    if (impl.routed.shape() != std::vector<std::int64_t>{tokens, c.d_latent}) {
      impl.routed = HostTensor(impl.options.dtype, {tokens, c.d_latent});
      impl.shared = HostTensor(impl.options.dtype, {tokens, c.d_model});
    }
    routed = impl.routed.matrix();
    shared = impl.shared.matrix();
  }
  impl.run_partials(x, routed, shared, error, stream);
  const auto start = Clock::now();
  const bool device_timed = impl.executor->begin_tail(stream);
  // The shared partial is scratch here, so the column tier may accumulate into it.
  const std::optional<TailTier> ran = impl.tail->forward(routed, shared, y, tier, stream);
  if (device_timed) {
    impl.executor->end_tail(stream);
  } else {
    impl.times.tail = std::chrono::duration<double>(Clock::now() - start).count();
  }
  return ran;
}

}  // namespace lmoe

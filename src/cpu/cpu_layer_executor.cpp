#include "cpu/cpu_layer_executor.hpp"

#include <chrono>
#include <vector>

#include "core/expert_activation.hpp"
#include "core/host_math.hpp"
#include "lmoe/error.hpp"

namespace lmoe {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::vector<float> to_float(const HostTensor& tensor) {
  std::vector<float> values(static_cast<std::size_t>(tensor.numel()));
  for (std::int64_t i = 0; i < tensor.numel(); ++i)
    values[static_cast<std::size_t>(i)] = tensor.get(i);
  return values;
}

class CpuLayerExecutor final : public LayerExecutor {
 public:
  CpuLayerExecutor(const LayerConfig& config, DType dtype, int tp, const LayerWeights& weights)
      : config_(config),
        dtype_(dtype),
        inter_(config.expert_intermediate / tp),
        shared_(config.shared_width() / tp),
        router_weight_(to_float(weights.router_weight)),
        router_bias_(to_float(weights.router_bias)),
        latent_down_(to_float(weights.latent_down)),
        expert_gate_(to_float(weights.expert_gate)),
        expert_up_(to_float(weights.expert_up)),
        expert_down_(to_float(weights.expert_down)),
        packed_gate_(weights.expert_gate_mxfp4),
        packed_up_(weights.expert_up_mxfp4),
        packed_down_(weights.expert_down_mxfp4),
        shared_gate_(to_float(weights.shared_gate)),
        shared_up_(to_float(weights.shared_up)),
        shared_down_(to_float(weights.shared_down)) {
    if (!config.router.correction_bias) router_bias_.clear();
  }

  std::string_view backend_name() const override { return "cpu"; }
  MemorySpace memory_space() const override { return MemorySpace::host; }
  const Routing* host_routing() const override { return &routing_; }

  void run(ConstMatrixView x, MatrixView routed, MatrixView shared, LayerStageTimes& times,
           StreamHandle) override {
    const std::int64_t tokens = x.rows;
    const std::vector<float> x32 = cpu::to_float(x);  // exact: x is in the storage dtype

    auto start = Clock::now();
    std::vector<float> logits(static_cast<std::size_t>(tokens * config_.router.num_experts));
    cpu::sgemm_nt(tokens, config_.router.num_experts, config_.d_model, x32.data(),
                  router_weight_.data(), logits.data());
    routing_ = select_experts(logits, tokens, router_bias_, config_.router);
    times.router = seconds_since(start);

    start = Clock::now();
    // z = round(x · W_downᵀ) [T, l], kept as the fp32 values of the storage dtype.
    std::vector<float> latent(static_cast<std::size_t>(tokens * config_.d_latent));
    cpu::sgemm_nt(tokens, config_.d_latent, config_.d_model, x32.data(), latent_down_.data(),
                  latent.data());
    for (float& value : latent) value = round_to(dtype_, value);
    times.down_projection = seconds_since(start);

    start = Clock::now();
    run_routed_experts(latent, routed);
    times.experts = seconds_since(start);

    start = Clock::now();
    run_shared_experts(x32, shared);
    times.shared = seconds_since(start);
  }

 private:
  // h = round(act(a · gateᵀ, a · upᵀ)) for `rows` rows of a [rows, k]: the expert's hidden
  // activations, stored in the storage dtype (kept here as the fp32 value of that dtype).
  void hidden(const float* a, std::int64_t rows, std::int64_t k, const float* gate, const float* up,
              std::int64_t width, std::vector<float>& gate_out, std::vector<float>& out) const {
    out.resize(static_cast<std::size_t>(rows * width));
    cpu::sgemm_nt(rows, width, k, a, up, out.data());
    const bool gated = is_gated(config_.activation);
    if (gated) {
      gate_out.resize(out.size());
      cpu::sgemm_nt(rows, width, k, a, gate, gate_out.data());
    }
    for (std::size_t i = 0; i < out.size(); ++i) {
      out[i] = round_to(dtype_, activate<float>(config_, gated ? gate_out[i] : 0.0f, out[i]));
    }
  }

  // Expert e's matrix of one routed weight as fp32 values of the storage dtype: a slice of the
  // converted dense weight, or the packed one dequantized into `scratch` now (the values a
  // dequantizing load stores, so the results are the same bits); nullptr where it is absent.
  const float* expert_matrix(const std::vector<float>& dense, const Mxfp4Tensor& packed,
                             std::int64_t expert, std::vector<float>& scratch) const {
    if (packed.empty()) {
      if (dense.empty()) return nullptr;
      return dense.data() + expert * inter_ * config_.d_latent;  // [I_r, l] or [l, I_r]
    }
    scratch.resize(static_cast<std::size_t>(packed.shape[1] * packed.shape[2]));
    packed.dequantize_matrix(expert, dtype_, scratch.data());
    return scratch.data();
  }

  // For each expert (in id order), its tokens' latent rows go through this rank's slice of the
  // expert; each (token, slot) output row lands in its own place, and the token's slots are then
  // weighted and summed in slot order. The order of that sum is thus fixed by the routing alone.
  void run_routed_experts(const std::vector<float>& latent, MatrixView routed) {
    const std::int64_t tokens = routing_.num_tokens, top_k = routing_.top_k;
    const std::int64_t l = config_.d_latent, experts = config_.router.num_experts;

    // Slots (t·k + j) grouped by expert, tokens ascending within an expert (a counting sort).
    std::vector<std::int64_t> first(static_cast<std::size_t>(experts + 1), 0);
    for (std::int32_t e : routing_.expert_ids) ++first[static_cast<std::size_t>(e) + 1];
    for (std::int64_t e = 0; e < experts; ++e) first[e + 1] += first[e];
    std::vector<std::int64_t> slots(routing_.expert_ids.size());
    {
      std::vector<std::int64_t> next(first.begin(), first.end() - 1);
      for (std::int64_t s = 0; s < tokens * top_k; ++s) {
        slots[static_cast<std::size_t>(next[routing_.expert_ids[s]]++)] = s;
      }
    }

    std::vector<float> slot_out(static_cast<std::size_t>(tokens * top_k * l));  // [T·k, l] fp32
    std::vector<float> gathered, gate, act, out;
    for (std::int64_t e = 0; e < experts; ++e) {
      const std::int64_t count = first[e + 1] - first[e];
      if (count == 0) continue;
      gathered.resize(static_cast<std::size_t>(count * l));
      for (std::int64_t i = 0; i < count; ++i) {
        const std::int64_t token = slots[first[e] + i] / top_k;
        std::copy_n(latent.data() + token * l, l, gathered.data() + i * l);
      }
      hidden(gathered.data(), count, l, expert_matrix(expert_gate_, packed_gate_, e, gate_scratch_),
             expert_matrix(expert_up_, packed_up_, e, up_scratch_), inter_, gate, act);
      out.resize(static_cast<std::size_t>(count * l));
      cpu::sgemm_nt(count, l, inter_, act.data(),
                    expert_matrix(expert_down_, packed_down_, e, down_scratch_), out.data());
      for (std::int64_t i = 0; i < count; ++i) {
        std::copy_n(out.data() + i * l, l, slot_out.data() + slots[first[e] + i] * l);
      }
    }

    // routed[t] = round(Σ_j w_tj · o_tj), fp32, j in slot order; each product rounded to fp32
    // before it is added (products go through memory, so no FMA fuses them with the sum).
    std::vector<float> products(static_cast<std::size_t>(top_k));
    for (std::int64_t t = 0; t < tokens; ++t) {
      const std::span<const float> weights = routing_.weights_of(t);
      for (std::int64_t col = 0; col < l; ++col) {
        for (std::int64_t j = 0; j < top_k; ++j) {
          products[j] = weights[j] * slot_out[static_cast<std::size_t>((t * top_k + j) * l + col)];
        }
        float sum = products[0];
        for (std::int64_t j = 1; j < top_k; ++j) sum += products[j];
        store_from_float(routed.data, routed.offset(t, col), routed.dtype, sum);
      }
    }
  }

  // shared_r = round(round(act(x · G_rᵀ, x · U_rᵀ)) · D_rᵀ); +0 everywhere without shared experts.
  void run_shared_experts(const std::vector<float>& x32, MatrixView shared) {
    const std::int64_t tokens = shared.rows, d = config_.d_model;
    std::vector<float> gate, act, out(static_cast<std::size_t>(tokens * d), 0.0f);
    if (shared_ > 0) {
      hidden(x32.data(), tokens, d, shared_gate_.empty() ? nullptr : shared_gate_.data(),
             shared_up_.data(), shared_, gate, act);
      cpu::sgemm_nt(tokens, d, shared_, act.data(), shared_down_.data(), out.data());
    }
    for (std::int64_t t = 0; t < tokens; ++t) {
      for (std::int64_t col = 0; col < d; ++col) {
        store_from_float(shared.data, shared.offset(t, col), shared.dtype,
                         out[static_cast<std::size_t>(t * d + col)]);
      }
    }
  }

  LayerConfig config_;
  DType dtype_;
  std::int64_t inter_;   // this rank's slice of each routed expert's intermediate dim
  std::int64_t shared_;  // this rank's slice of the shared experts' intermediate dim
  std::vector<float> router_weight_, router_bias_, latent_down_;
  std::vector<float> expert_gate_, expert_up_, expert_down_;  // empty when packed
  // MXFP4 experts as loaded (empty when dense), dequantized one expert at a time on use.
  Mxfp4Tensor packed_gate_, packed_up_, packed_down_;
  std::vector<float> gate_scratch_, up_scratch_, down_scratch_;
  std::vector<float> shared_gate_, shared_up_, shared_down_;
  Routing routing_;
};

}  // namespace

std::unique_ptr<LayerExecutor> make_cpu_layer_executor(const LayerConfig& config, DType dtype,
                                                       int tp, const LayerWeights& weights) {
  return std::make_unique<CpuLayerExecutor>(config, dtype, tp, weights);
}

}  // namespace lmoe

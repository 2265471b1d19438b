// The cuda backend's entry in the runtime's registry: what the GPU and this build can run, the
// fused kernels' plans behind the built-in breakpoints, and its executors.
#include "core/backend_ops.hpp"
#include "cuda/comm/p2p_peer_access.hpp"
#include "cuda/fused/fused_chained_launch.hpp"
#include "cuda/fused/fused_decode_launch.hpp"
#include "cuda/layer/cuda_layer_executor.hpp"
#include "cuda/runtime/cuda_device_info.hpp"
#include "cuda/tail/cuda_tail_executor.hpp"
#include "lmoe/cuda_communicator.hpp"
#include "lmoe/error.hpp"
#include "lmoe/fused_defaults.hpp"
#include "lmoe/p2p_communicator.hpp"
#include "lmoe/settings.hpp"
#ifdef LMOE_HAS_NCCL
#include "lmoe/nccl_communicator.hpp"
#endif

namespace lmoe {

namespace {

class CudaBackendOps final : public BackendOps {
 public:
  Backend backend() const override { return Backend::cuda; }
  bool built() const override { return true; }
  bool available() const override { return cuda_device_count() > 0; }
  std::optional<std::string> tier_limit(TailTier tier, const TailProblem& problem) const override {
    return cuda_tier_limit(tier, problem);
  }
  std::optional<std::string> fused_decode_limit(TailDims dims, DType dtype,
                                                int ranks) const override {
    if (cuda_device_count() == 0) return "no CUDA device";
    cuda::FusedDecodePlan plan;
    const int tokens = ranks == 1 ? kFusedDefaultTp1Tokens : kFusedDefaultDecodeTokens;
    if (const char* reason =
            cuda::fused_decode_plan(dims.d_model / ranks, dims.d_latent, tokens, dtype, &plan)) {
      return std::string(reason);
    }
    return std::nullopt;
  }
  std::optional<std::string> fused_chained_limit(TailDims dims, DType dtype,
                                                 int ranks) const override {
    if (cuda_device_count() == 0) return "no CUDA device";
    cuda::FusedChainedPlan plan;
    const int tokens = ranks == 1 ? kFusedDefaultTp1ChainedTokens : kFusedDefaultChainedTokens;
    if (const char* reason = cuda::fused_chained_plan(dims.d_model / ranks, dims.d_latent, tokens,
                                                      dtype, 0, &plan)) {
      return std::string(reason);
    }
    return std::nullopt;
  }
  std::int64_t fused_chained_max_tokens() const override { return cuda::kFusedChainedMaxTokens; }
  std::int64_t fused_decode_beside_chained_tokens(int tp) const override {
    return cuda::fused_decode_beside_chained_tokens(tp);
  }
  int ranks_on_my_device(const Communicator& comm) const override {
    if (const auto* p2p = dynamic_cast<const P2pPeerAccess*>(&comm)) return p2p->ranks_on_my_gpu();
    return 1;
  }
  std::optional<DeviceDescription> device() const override {
    const cuda::DeviceInfo info = cuda::device_info(0);
    return DeviceDescription{
        info.name,
        std::to_string(info.compute_major) + "." + std::to_string(info.compute_minor),
        info.driver_version,
        info.runtime_version,
        info.device_count,
        cuda::nccl_version()};
  }
  std::vector<std::string> comm_backends() const override {
    if (cuda_device_count() == 0) return {};
    std::vector<std::string> names{"cuda-threads", "p2p"};
#ifdef LMOE_HAS_NCCL
    names.push_back("nccl");
#endif
    return names;
  }
  std::optional<std::string> comm_group_limit(std::string_view name, int num_ranks) const override {
    const int gpus = cuda_device_count();
    if (name == "nccl" && num_ranks > gpus) {
      return "nccl needs one GPU per rank (" + std::to_string(num_ranks) + " ranks, " +
             std::to_string(gpus) + " GPU(s) visible)";
    }
    if (name == "p2p" && num_ranks > gpus && !setting_flag("LMOE_P2P_SHARED_GPU")) {
      return "p2p ranks would share a GPU (" + std::to_string(num_ranks) + " ranks, " +
             std::to_string(gpus) +
             " GPU(s)), where their rounds can stall (docs/p2p.md); set LMOE_P2P_SHARED_GPU=1 to "
             "run it anyway";
    }
    return std::nullopt;
  }
  bool run_comm_group(std::string_view name, int num_ranks,
                      const std::function<void(int, Communicator&)>& fn,
                      std::chrono::milliseconds timeout) const override {
    if (name == "cuda-threads") {
      LMOE_CHECK(cuda_device_count() > 0,
                 "comm backend 'cuda-threads' needs a CUDA GPU; none is visible");
      run_on_cuda_threads(num_ranks, 0, fn, timeout);
      return true;
    }
    if (name == "p2p") {
      LMOE_CHECK(cuda_device_count() > 0, "comm backend 'p2p' needs a CUDA GPU; none is visible");
      if (auto limit = comm_group_limit(name, num_ranks)) throw Error(*limit);
      // Its own device-side bound (P2pOptions::timeout) applies, not the host barrier's.
      run_on_p2p_threads(num_ranks, fn);
      return true;
    }
#ifdef LMOE_HAS_NCCL
    // One rank per GPU: make_nccl_thread_communicators says so when there are too few.
    if (name == "nccl") {
      run_on_nccl_threads(num_ranks, {}, fn, timeout);
      return true;
    }
#endif
    return false;
  }
  std::optional<std::string> layer_limit(const LayerConfig& config) const override {
    return cuda_layer_limit(config);
  }
  std::unique_ptr<TailExecutor> make_tail_executor(Communicator& comm, TailDims dims, DType dtype,
                                                   bool latent_norm, float eps,
                                                   ConstMatrixView norm_weight,
                                                   ConstMatrixView up_proj_weight,
                                                   std::int64_t max_tokens) const override {
    return make_cuda_tail_executor(comm, dims, dtype, latent_norm, eps, norm_weight, up_proj_weight,
                                   max_tokens);
  }
  std::unique_ptr<LayerExecutor> make_layer_executor(const LayerConfig& config, DType dtype, int tp,
                                                     const LayerWeights& weights,
                                                     std::int64_t max_tokens,
                                                     bool device_experts) const override {
    return make_cuda_layer_executor(config, dtype, tp, weights, max_tokens, device_experts);
  }
};

}  // namespace

const BackendOps& cuda_backend_ops() {
  static const CudaBackendOps ops;
  return ops;
}

}  // namespace lmoe

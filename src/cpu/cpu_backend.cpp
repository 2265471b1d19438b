// The cpu backend's entry in the runtime's registry: always built and available, every tier, no
// fused kernels of its own to plan.
#include "core/backend_ops.hpp"
#include "cpu/cpu_layer_executor.hpp"
#include "cpu/cpu_tail_executor.hpp"
#include "lmoe/threads_communicator.hpp"

namespace lmoe {

namespace {

class CpuBackendOps final : public BackendOps {
 public:
  Backend backend() const override { return Backend::cpu; }
  bool built() const override { return true; }
  bool available() const override { return true; }
  std::optional<std::string> tier_limit(TailTier, const TailProblem&) const override { return std::nullopt; }
  std::optional<std::string> fused_decode_limit(TailDims, DType, int) const override {
    return "the cpu backend has no decode kernel";
  }
  std::optional<std::string> fused_chained_limit(TailDims, DType, int) const override {
    return "the cpu backend has no chained path";
  }
  std::int64_t fused_chained_max_tokens() const override { return 0; }
  std::int64_t fused_decode_beside_chained_tokens(int) const override { return 0; }
  int ranks_on_my_device(const Communicator&) const override { return 1; }
  std::optional<DeviceDescription> device() const override { return std::nullopt; }
  std::vector<std::string> comm_backends() const override { return {"threads"}; }
  std::optional<std::string> comm_group_limit(std::string_view, int) const override { return std::nullopt; }
  bool run_comm_group(std::string_view name, int num_ranks, const std::function<void(int, Communicator&)>& fn,
                      std::chrono::milliseconds timeout) const override {
    if (name != "threads") return false;
    run_on_threads(num_ranks, fn, timeout);
    return true;
  }
  std::optional<std::string> layer_limit(const LayerConfig&) const override { return std::nullopt; }
  std::unique_ptr<TailExecutor> make_tail_executor(Communicator& comm, TailDims dims, DType dtype,
                                                   bool latent_norm, float eps, ConstMatrixView norm_weight,
                                                   ConstMatrixView up_proj_weight,
                                                   std::int64_t /*max_tokens*/) const override {
    return make_cpu_tail_executor(comm, dims, dtype, latent_norm, eps, norm_weight, up_proj_weight);
  }
  std::unique_ptr<LayerExecutor> make_layer_executor(const LayerConfig& config, DType dtype, int tp,
                                                     const LayerWeights& weights,
                                                     std::int64_t /*max_tokens*/) const override {
    return make_cpu_layer_executor(config, dtype, tp, weights);
  }
};

}  // namespace

const BackendOps& cpu_backend_ops() {
  static const CpuBackendOps ops;
  return ops;
}

}  // namespace lmoe

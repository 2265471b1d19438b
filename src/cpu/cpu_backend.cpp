// The cpu backend's entry in the runtime's registry: a host backend as BackendOps's defaults
// describe it (every tier, no fused kernels of its own), its threads communicator and executors.
#include "core/backend_ops.hpp"
#include "cpu/cpu_layer_executor.hpp"
#include "cpu/cpu_tail_executor.hpp"
#include "lmoe/threads_communicator.hpp"

namespace lmoe {

namespace {

class CpuBackendOps final : public BackendOps {
 public:
  Backend backend() const override { return Backend::cpu; }
  std::vector<std::string> comm_backends() const override { return {"threads"}; }
  bool run_comm_group(std::string_view name, int num_ranks,
                      const std::function<void(int, Communicator&)>& fn,
                      std::chrono::milliseconds timeout) const override {
    if (name != "threads") return false;
    run_on_threads(num_ranks, fn, timeout);
    return true;
  }
  std::unique_ptr<TailExecutor> make_tail_executor(Communicator& comm, TailDims dims, DType dtype,
                                                   bool latent_norm, float eps,
                                                   ConstMatrixView norm_weight,
                                                   ConstMatrixView up_proj_weight,
                                                   std::int64_t /*max_tokens*/) const override {
    return make_cpu_tail_executor(comm, dims, dtype, latent_norm, eps, norm_weight, up_proj_weight);
  }
  std::unique_ptr<LayerExecutor> make_layer_executor(const LayerConfig& config, DType dtype, int tp,
                                                     const LayerWeights& weights,
                                                     std::int64_t /*max_tokens*/,
                                                     bool /*device_experts*/) const override {
    return make_cpu_layer_executor(config, dtype, tp, weights);
  }
};

}  // namespace

const BackendOps& cpu_backend_ops() {
  static const CpuBackendOps ops;
  return ops;
}

}  // namespace lmoe

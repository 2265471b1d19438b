// The cuda backend's entry in builds without it (linked instead of lmoe_cuda): never available,
// and every question answered with why.
#include "core/backend_ops.hpp"
#include "lmoe/error.hpp"

namespace lmoe {

namespace {

constexpr const char* kNotBuilt = "this build has no CUDA backend";

class AbsentCudaBackendOps final : public BackendOps {
 public:
  Backend backend() const override { return Backend::cuda; }
  bool built() const override { return false; }
  bool available() const override { return false; }
  std::optional<std::string> tier_limit(TailTier, const TailProblem&) const override {
    return "the cuda backend is not built";
  }
  std::optional<std::string> fused_decode_limit(TailDims, DType, int) const override { return kNotBuilt; }
  std::optional<std::string> fused_chained_limit(TailDims, DType, int) const override { return kNotBuilt; }
  std::int64_t fused_chained_max_tokens() const override { return 0; }
  std::int64_t fused_decode_beside_chained_tokens(int) const override { return 0; }
  int ranks_on_my_device(const Communicator&) const override { return 1; }
  std::optional<DeviceDescription> device() const override { return std::nullopt; }
  std::vector<std::string> comm_backends() const override { return {}; }
  std::optional<std::string> comm_group_limit(std::string_view, int) const override { return std::nullopt; }
  bool run_comm_group(std::string_view, int, const std::function<void(int, Communicator&)>&,
                      std::chrono::milliseconds) const override {
    return false;
  }
  std::optional<std::string> layer_limit(const LayerConfig&) const override {
    return std::string(kNotBuilt) + " (configure with the cuda preset)";
  }
  std::unique_ptr<TailExecutor> make_tail_executor(Communicator&, TailDims, DType, bool, float, ConstMatrixView,
                                                   ConstMatrixView, std::int64_t) const override {
    throw Error(kNotBuilt);
  }
  std::unique_ptr<LayerExecutor> make_layer_executor(const LayerConfig&, DType, int, const LayerWeights&,
                                                     std::int64_t) const override {
    throw Error(kNotBuilt);
  }
};

}  // namespace

const BackendOps& cuda_backend_ops() {
  static const AbsentCudaBackendOps ops;
  return ops;
}

}  // namespace lmoe

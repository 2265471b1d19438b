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
  std::optional<std::string> fused_decode_limit(TailDims, DType, int) const override {
    return kNotBuilt;
  }
  std::optional<std::string> fused_chained_limit(TailDims, DType, int) const override {
    return kNotBuilt;
  }
  std::vector<std::string> comm_backends() const override { return {}; }
  bool run_comm_group(std::string_view, int, const std::function<void(int, Communicator&)>&,
                      std::chrono::milliseconds) const override {
    return false;
  }
  std::optional<std::string> layer_limit(const LayerConfig&) const override {
    return std::string(kNotBuilt) + " (configure with the cuda preset)";
  }
  std::unique_ptr<TailExecutor> make_tail_executor(Communicator&, TailDims, DType, bool, float,
                                                   ConstMatrixView, ConstMatrixView,
                                                   std::int64_t) const override {
    throw Error(kNotBuilt);
  }
  std::unique_ptr<LayerExecutor> make_layer_executor(const LayerConfig&, DType, int,
                                                     const LayerWeights&, std::int64_t,
                                                     bool) const override {
    throw Error(kNotBuilt);
  }
};

}  // namespace

const BackendOps& cuda_backend_ops() {
  static const AbsentCudaBackendOps ops;
  return ops;
}

}  // namespace lmoe

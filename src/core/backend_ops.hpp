// What a backend tells the runtime: whether this build and machine have it, what it can run and
// why not, the fused kernels' limits the built-in breakpoints rest on, the device it runs on, and
// how to make its executors. Each backend library fills one (cpu_backend_ops, cuda_backend_ops);
// the runtime's registry (runtime/backend_registry.hpp) hands out the one a Backend names.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/layer_executor.hpp"
#include "core/tail_executor.hpp"
#include "lmoe/backend.hpp"
#include "lmoe/dims.hpp"
#include "lmoe/dtype.hpp"
#include "lmoe/layer_weights.hpp"
#include "lmoe/tensor.hpp"
#include "lmoe/tier.hpp"

namespace lmoe {

class Communicator;

// The device a backend runs on (the cuda backend: device 0), for records of measurements.
struct DeviceDescription {
  std::string name;                // "NVIDIA H200"
  std::string compute_capability;  // "9.0"
  int driver_version = 0;          // cudaDriverGetVersion: 1000·major + 10·minor
  int runtime_version = 0;         // cudaRuntimeGetVersion
  int device_count = 0;
  std::optional<std::string> nccl_version;  // builds with NCCL
};

class BackendOps {
 public:
  virtual ~BackendOps() = default;
  virtual Backend backend() const = 0;
  // Whether this build has the backend at all. The defaults below are a host backend's: built,
  // available, every tier, no fused kernels of its own, no device.
  virtual bool built() const { return true; }
  // Whether this build and machine can run it (cuda: built and a GPU visible).
  virtual bool available() const { return true; }
  // nullopt when the backend can run `tier` for `problem` (beyond the limits every backend shares);
  // otherwise why not.
  virtual std::optional<std::string> tier_limit(TailTier /*tier*/,
                                                const TailProblem& /*problem*/) const {
    return std::nullopt;
  }
  // Why the fused decode kernel, or the chained path, cannot take the default calls over one rank's
  // stripe (d / ranks rows of w_up) at these dims and dtype; nullopt when it can
  // (fused_defaults.hpp: the built-in breakpoints rest on these).
  virtual std::optional<std::string> fused_decode_limit(TailDims /*dims*/, DType /*dtype*/,
                                                        int /*ranks*/) const {
    return "the " + std::string(backend_name(backend())) + " backend has no decode kernel";
  }
  virtual std::optional<std::string> fused_chained_limit(TailDims /*dims*/, DType /*dtype*/,
                                                         int /*ranks*/) const {
    return "the " + std::string(backend_name(backend())) + " backend has no chained path";
  }
  // The most rows the chained path takes (0: none), and the rows up to which the decode kernel
  // keeps a call beside it at `tp` ranks (LatentTail's fused_runs_two_shot rests on both).
  virtual std::int64_t fused_chained_max_tokens() const { return 0; }
  virtual std::int64_t fused_decode_beside_chained_tokens(int /*tp*/) const { return 0; }
  // Ranks of comm's group on this rank's device (p2p ranks may share a GPU); 1 elsewhere.
  virtual int ranks_on_my_device(const Communicator& /*comm*/) const { return 1; }
  virtual std::optional<DeviceDescription> device() const { return std::nullopt; }
  // The communicators this backend's ranks can use on this machine, the preferred first.
  virtual std::vector<std::string> comm_backends() const = 0;
  // Why `num_ranks` ranks cannot use the communicator `name` here; nullopt when they can.
  virtual std::optional<std::string> comm_group_limit(std::string_view /*name*/,
                                                      int /*num_ranks*/) const {
    return std::nullopt;
  }
  // Runs fn(rank, comm) on `num_ranks` ranks of the communicator `name` (lmoe/comm_group.hpp);
  // false, running nothing, when `name` is none of this backend's.
  virtual bool run_comm_group(std::string_view name, int num_ranks,
                              const std::function<void(int, Communicator&)>& fn,
                              std::chrono::milliseconds timeout) const = 0;
  // Why the backend cannot run this layer; nullopt when it can.
  virtual std::optional<std::string> layer_limit(const LayerConfig& /*config*/) const {
    return std::nullopt;
  }
  // Copies the weights to the backend's memory. max_tokens > 0: workspaces for that many tokens,
  // allocated now (CUDA graphs need them fixed); 0: they grow on demand.
  virtual std::unique_ptr<TailExecutor> make_tail_executor(Communicator& comm, TailDims dims,
                                                           DType dtype, bool latent_norm, float eps,
                                                           ConstMatrixView norm_weight,
                                                           ConstMatrixView up_proj_weight,
                                                           std::int64_t max_tokens) const = 0;
  // device_experts: eager forwards take the routed experts' device path (LayerOptions).
  virtual std::unique_ptr<LayerExecutor> make_layer_executor(const LayerConfig& config, DType dtype,
                                                             int tp, const LayerWeights& weights,
                                                             std::int64_t max_tokens,
                                                             bool device_experts) const = 0;
};

// Filled by lmoe_cpu.
const BackendOps& cpu_backend_ops();
// Filled by lmoe_cuda; in builds without it, by the runtime's stand-in that says so.
const BackendOps& cuda_backend_ops();

}  // namespace lmoe

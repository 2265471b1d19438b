#include "runtime/backend_registry.hpp"

#include "lmoe/backend_registry.hpp"
#include "lmoe/version.hpp"

namespace lmoe {

const BackendOps& backend_ops(Backend backend) {
  return backend == Backend::cuda ? cuda_backend_ops() : cpu_backend_ops();
}

bool backend_available(Backend backend) { return backend_ops(backend).available(); }

RunningConfig running_config(Backend backend, int tp, TailDims dims, DType dtype,
                             std::optional<std::string> comm) {
  RunningConfig running;
  running.backend = backend;
  running.tp = tp;
  running.dims = dims;
  running.dtype = dtype;
  running.comm = std::move(comm);
  running.lmoe_version = kVersion;
  running.settings = timing_settings_from_environment();
  if (backend_ops(backend).available()) {
    if (const std::optional<DeviceDescription> device = backend_ops(backend).device()) {
      running.gpu = TableGpu{device->name, device->compute_capability, device->driver_version,
                             device->runtime_version};
      running.nccl_version = device->nccl_version;
      running.driver_version = nvidia_driver_version();
    }
  }
  return running;
}

}  // namespace lmoe

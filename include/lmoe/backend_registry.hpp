// What the backends of this build and machine can do: whether one can run here, and the
// configuration a measured tier table is matched against (the device, its driver and NCCL).
#pragma once

#include <optional>
#include <string>

#include "lmoe/backend.hpp"
#include "lmoe/dims.hpp"
#include "lmoe/dtype.hpp"
#include "lmoe/tier_table.hpp"

namespace lmoe {

// Whether this build and machine can run the backend (cuda: compiled in and a GPU present).
bool backend_available(Backend backend);

// This process's configuration: the device, driver and NCCL of this machine and build (cuda: device
// 0), lmoe's version, and the given rest.
RunningConfig running_config(Backend backend, int tp, TailDims dims, DType dtype,
                             std::optional<std::string> comm);

}  // namespace lmoe

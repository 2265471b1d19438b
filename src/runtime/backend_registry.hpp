// The runtime's registry of backends: the BackendOps a Backend names (core/backend_ops.hpp).
#pragma once

#include "core/backend_ops.hpp"

namespace lmoe {

const BackendOps& backend_ops(Backend backend);

}  // namespace lmoe

// The CPU executor of every tier, each with its true dataflow: a rank computes and writes only
// what it would on a GPU, and every exchange goes through the communicator.
#pragma once

#include <memory>

#include "core/tail_executor.hpp"
#include "lmoe/communicator.hpp"

namespace lmoe {

// latent_norm false: the latent is not normalized (norm_weight and eps are unused).
std::unique_ptr<TailExecutor> make_cpu_tail_executor(Communicator& comm, TailDims dims, DType dtype,
                                                     bool latent_norm, float eps,
                                                     ConstMatrixView norm_weight,
                                                     ConstMatrixView up_proj_weight);

}  // namespace lmoe

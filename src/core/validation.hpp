// Checks done before any work: every problem becomes a message that names the argument and the
// expected value. They return the message instead of throwing so that ranks can exchange their
// verdicts first and fail together.
#pragma once

#include <optional>
#include <string>

#include "core/tail_executor.hpp"
#include "lmoe/tail_options.hpp"

namespace lmoe {

// A matrix argument: its dtype, shape [rows, cols], contiguity and memory space; the message names
// it (`name`) and what was expected.
std::optional<std::string> check_matrix(const char* name, ConstMatrixView view, DType dtype,
                                        MemorySpace space, std::int64_t rows, std::int64_t cols);

// Options alone (dims, eps, tp).
std::optional<std::string> validate_options(const TailOptions& options, int tp);
// The weights handed to the constructor.
std::optional<std::string> validate_weights(const TailOptions& options, ConstMatrixView norm_weight,
                                            ConstMatrixView up_proj_weight);
// One call's tensors.
std::optional<std::string> validate_call(const TailOptions& options, MemorySpace space,
                                         ConstMatrixView routed, ConstMatrixView shared,
                                         ConstMatrixView out);
// Limits of a tier that hold on every backend (the backend adds its own).
std::optional<std::string> generic_tier_limit(TailTier tier, const TailProblem& problem);

}  // namespace lmoe

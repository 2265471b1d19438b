// The interface between LatentTail and a backend: one executor per backend runs every tier.
#pragma once

#include <optional>
#include <string>

#include "lmoe/communicator.hpp"
#include "lmoe/dims.hpp"
#include "lmoe/tensor.hpp"
#include "lmoe/tier.hpp"

namespace lmoe {

struct TailProblem {
  std::int64_t num_tokens = 0;
  TailDims dims;
  DType dtype = DType::bf16;
  int tp = 1;
};

class TailExecutor {
 public:
  virtual ~TailExecutor() = default;
  virtual std::string_view backend_name() const = 0;
  virtual MemorySpace memory_space() const = 0;
  // nullopt when `tier` can run `problem` on this backend; otherwise the reason it cannot.
  virtual std::optional<std::string> can_implement(TailTier tier, const TailProblem& problem) const = 0;
  // Inputs are validated by the caller. routed [T, l], shared [T, d] (may be overwritten), out [T, d].
  virtual void run(TailTier tier, ConstMatrixView routed, MatrixView shared, MatrixView out,
                   StreamHandle stream) = 0;
};

}  // namespace lmoe

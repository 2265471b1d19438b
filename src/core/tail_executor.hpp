// The interface between LatentTail and a backend: one executor per backend runs every tier.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

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

// How the token tier splits T rows over the ranks: contiguous blocks whose sizes differ by at
// most one, rank r owning rows [row_offsets[r], row_offsets[r + 1]). Every backend uses this one
// split, so their token tiers agree on which rank owns which row.
struct TokenRowSplit {
  std::vector<std::size_t> row_offsets;    // tp + 1 entries
  std::vector<std::size_t> latent_counts;  // elements of [rows_r, l] per rank
  std::vector<std::size_t> model_counts;   // elements of [rows_r, d] per rank
  std::int64_t rows(int rank) const {
    return static_cast<std::int64_t>(row_offsets[rank + 1] - row_offsets[rank]);
  }
};
TokenRowSplit split_token_rows(std::int64_t num_tokens, int tp, TailDims dims);

class TailExecutor {
 public:
  virtual ~TailExecutor() = default;
  virtual std::string_view backend_name() const = 0;
  virtual MemorySpace memory_space() const = 0;
  // nullopt when `tier` can run `problem` on this backend; otherwise the reason it cannot.
  virtual std::optional<std::string> can_implement(TailTier tier, const TailProblem& problem) const = 0;
  // nullopt when `tier` can run on these very buffers; otherwise why not (e.g. an alignment a
  // kernel needs). LatentTail asks before the ranks agree on a call, so that a rank whose buffers
  // do not fit makes every rank fail at once instead of leaving them waiting in a collective.
  virtual std::optional<std::string> call_limit(TailTier, ConstMatrixView /*routed*/, ConstMatrixView /*shared*/,
                                                ConstMatrixView /*out*/) const {
    return std::nullopt;
  }
  // Inputs are validated by the caller. routed [T, l], shared [T, d] (may be overwritten), out [T, d].
  virtual void run(TailTier tier, ConstMatrixView routed, MatrixView shared, MatrixView out,
                   StreamHandle stream) = 0;
};

}  // namespace lmoe

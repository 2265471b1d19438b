// The interface between LatentTail and a backend: one executor per backend runs every tier.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "lmoe/dims.hpp"
#include "lmoe/tail_options.hpp"
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
  virtual std::optional<std::string> can_implement(TailTier tier,
                                                   const TailProblem& problem) const = 0;
  // nullopt when `tier` can run on these very buffers; otherwise why not (e.g. an alignment a
  // kernel needs). LatentTail asks before the ranks agree on a call, so that a rank whose buffers
  // do not fit makes every rank fail at once instead of leaving them waiting in a collective.
  virtual std::optional<std::string> call_limit(TailTier, ConstMatrixView /*routed*/,
                                                ConstMatrixView /*shared*/,
                                                ConstMatrixView /*out*/) const {
    return std::nullopt;
  }
  // Inputs are validated by the caller. routed [T, l], shared [T, d] (may be overwritten), out [T,
  // d].
  virtual void run(TailTier tier, ConstMatrixView routed, MatrixView shared, MatrixView out,
                   StreamHandle stream) = 0;
};

// What LatentTail::forward_device_tokens needs from the CUDA executor (T read on the device; one
// CUDA graph for every T, docs/graphs.md). An executor that can implements it next to TailExecutor
// (the CUDA one).
class DeviceTokensRunner {
 public:
  virtual ~DeviceTokensRunner() = default;
  // nullopt when `tier` can run inside a CUDA graph conditional body with this communicator; else
  // why not.
  virtual std::optional<std::string> device_tokens_limit(TailTier tier) const = 0;
  virtual bool capturing(StreamHandle stream) const = 0;
  // T as *tokens_device holds it once the stream's earlier work is done (waits for the stream).
  virtual std::int64_t read_device_tokens(const std::int32_t* tokens_device,
                                          StreamHandle stream) = 0;
  // Runs the GEMMs of every bucket once, outside any collective (every rank at the same call).
  virtual void warm_up_buckets(const std::vector<DeviceTokenBucket>& buckets,
                               StreamHandle stream) = 0;
  // Bucket `tier` on the views' rows (the bucket's max_tokens); the fused tier reads T from
  // tokens_device.
  virtual void run_bucket(TailTier tier, ConstMatrixView routed, MatrixView shared, MatrixView out,
                          const std::int32_t* tokens_device, StreamHandle stream) = 0;
  // Under capture on `stream`: the selector and one body per bucket (views of max_tokens rows).
  virtual void capture_buckets(const std::vector<DeviceTokenBucket>& buckets,
                               ConstMatrixView routed, MatrixView shared, MatrixView out,
                               const std::int32_t* tokens_device, StreamHandle stream) = 0;
  // What a replay could not run since the last call (and clears the record): the last such T, and
  // whether it was outside [0, max_tokens] (else it fell in a bucket no tier runs).
  struct Failure {
    bool out_of_range = false;
    std::int64_t tokens = 0;
  };
  virtual std::optional<Failure> take_device_tokens_failure() = 0;
};

}  // namespace lmoe

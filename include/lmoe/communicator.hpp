// The communicator interface every backend implements (threads, MPI; NCCL and P2P on GPUs).
//
// Reductions follow the numerics contract (DESIGN.md §3): each element is summed in fp32 in rank
// order 0 … size−1, starting from rank 0's value, and rounded once to the storage dtype, so every
// rank receives bit-identical results whatever the transport. The exception is the nccl
// communicator: NCCL sums in its own order with intermediate roundings (still identical on every
// rank), judged by the bound of docs/numerics.md, "Reductions in an unspecified order".
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "lmoe/dtype.hpp"
#include "lmoe/tensor.hpp"

namespace lmoe {

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "threads", "mpi", ...
  virtual std::string_view backend_name() const = 0;
  // Where the buffers passed to the collectives live.
  virtual MemorySpace memory_space() const = 0;

  // recv[i] = round(Σ_r send_r[i]) for i < count. send and recv may be the same buffer.
  virtual void all_reduce(const void* send, void* recv, std::size_t count, DType dtype,
                          StreamHandle stream = nullptr) = 0;
  // send holds Σ counts elements, one contiguous block per rank in rank order; this rank receives
  // round(Σ_r block_rank of send_r) in recv (counts[rank()] elements). Counts may differ per rank.
  virtual void reduce_scatter(const void* send, void* recv, std::span<const std::size_t> counts,
                              DType dtype, StreamHandle stream = nullptr) = 0;
  // Rank r contributes counts[r] elements; recv receives all blocks concatenated in rank order.
  virtual void all_gather(const void* send, void* recv, std::span<const std::size_t> counts,
                          DType dtype, StreamHandle stream = nullptr) = 0;
  // Control plane: gathers `bytes` bytes of host memory from every rank into recv (rank order),
  // synchronously, whatever memory_space() the data collectives use. Ranks use it to agree on a
  // call before they launch anything. The default serves host communicators; device
  // communicators provide their own host path.
  virtual void control_all_gather(const void* send, void* recv, std::size_t bytes);
  // Whether the collectives can be captured into a CUDA graph: no host work per call, persistent
  // buffers. Communicators that synchronize on the host (threads, MPI, cuda-threads) cannot.
  virtual bool graph_capturable() const { return false; }
  virtual void barrier() = 0;
  // Makes every rank's pending and future collectives fail with an error that carries `why`.
  virtual void abort(const std::string& why) = 0;
};

}  // namespace lmoe

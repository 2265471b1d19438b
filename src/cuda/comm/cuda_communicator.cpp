// Same-GPU collectives between ranks on threads. Ordering between the ranks' streams uses events
// fenced by host barriers, in two rounds per collective:
//   1. each rank records `ready` on its stream once its send buffer is written; barrier; every rank
//      makes its stream wait for all peers' `ready`, then reads the peers' buffers;
//   2. each rank records `done` after its reads; barrier; every rank waits for all peers' `done`
//      before its stream may go on (and overwrite its own send buffer, which peers were reading).
// No device code spins, so a slow or dead peer can only stall the host barrier, which is bounded.
// Reductions go through a per-rank scratch buffer because recv may alias send, which the peers
// are still reading; the scratch is ordered across the rank's streams with one event.
// TODO(graphs): the host barriers make these collectives uncapturable; the P2P workspace tier
// (device flags, persistent buffers) replaces them for CUDA graphs.
#include "lmoe/cuda_communicator.hpp"

#include <cuda_runtime_api.h>

#include <cstring>
#include <numeric>
#include <string>

#include "comm/aborted_error.hpp"
#include "comm/host_barrier.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/tail/launchers.hpp"
#include "lmoe/error.hpp"
#include "lmoe/threads_communicator.hpp"

namespace lmoe {

namespace {

using cuda::check;

// From this size on, all_reduce is two-shot.
constexpr std::size_t kTwoShotBytes = std::size_t{1} << 20;

class CudaThreadGroup {
 public:
  CudaThreadGroup(int size, int device, std::chrono::milliseconds timeout)
      : size_(size),
        device_(device),
        barrier_(size, timeout),
        slots_(static_cast<std::size_t>(size)) {}

  int size() const { return size_; }
  int device() const { return device_; }

  void barrier(int rank, const char* operation) { barrier_.arrive_and_wait(rank, operation); }
  void abort(int rank, const std::string& why) { barrier_.abort(rank, why); }

  // What each rank publishes for the collective in progress.
  struct Slot {
    const void* send = nullptr;
    const void* control = nullptr;  // host memory, for control_all_gather
    cudaEvent_t ready = nullptr;
    cudaEvent_t done = nullptr;
  };
  Slot& slot(int rank) { return slots_[static_cast<std::size_t>(rank)]; }

 private:
  const int size_;
  const int device_;
  HostBarrier barrier_;
  std::vector<Slot> slots_;
};

class CudaThreadCommunicator final : public Communicator {
 public:
  CudaThreadCommunicator(std::shared_ptr<CudaThreadGroup> group, int rank)
      : group_(std::move(group)), rank_(rank) {
    LMOE_CUDA_CHECK(cudaSetDevice(group_->device()));
    auto& slot = group_->slot(rank_);
    LMOE_CUDA_CHECK(cudaEventCreateWithFlags(&slot.ready, cudaEventDisableTiming));
    LMOE_CUDA_CHECK(cudaEventCreateWithFlags(&slot.done, cudaEventDisableTiming));
    LMOE_CUDA_CHECK(cudaEventCreateWithFlags(&scratch_.free, cudaEventDisableTiming));
    LMOE_CUDA_CHECK(cudaEventCreateWithFlags(&staging_.free, cudaEventDisableTiming));
  }

  ~CudaThreadCommunicator() override {
    cudaSetDevice(group_->device());
    scratch_.release();
    staging_.release();
    auto& slot = group_->slot(rank_);
    cudaEventDestroy(slot.ready);
    cudaEventDestroy(slot.done);
  }

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  std::string_view backend_name() const override { return "cuda-threads"; }
  MemorySpace memory_space() const override { return MemorySpace::device; }

  // One-shot (every rank sums all peers' whole buffers) for small sizes; two-shot above: a
  // reduce-scatter into this rank's block of a staging buffer, then an all-gather of the blocks,
  // which reads tp× less memory at the price of two more barrier rounds. Either way each element
  // is the same rank-order sum, so the results are bit-identical.
  void all_reduce(const void* send, void* recv, std::size_t count, DType dtype,
                  StreamHandle stream_handle) override {
    const std::size_t esize = dtype_size(dtype);
    if (size() == 1 || count * esize < kTwoShotBytes) {
      return reduce_block(send, recv, 0, count, dtype, stream_handle, "all_reduce");
    }
    // Blocks are whole 16-byte vectors (8 elements in every dtype) so the vector kernels apply.
    std::vector<std::size_t> counts(static_cast<std::size_t>(size()));
    const std::size_t vectors = count / 8, base = vectors / counts.size(),
                      extra = vectors % counts.size();
    for (std::size_t r = 0; r < counts.size(); ++r) counts[r] = 8 * (base + (r < extra ? 1 : 0));
    counts.back() += count - 8 * vectors;
    const std::size_t first =
        std::accumulate(counts.begin(), counts.begin() + rank_, std::size_t{0});
    void* block =
        staging_for(counts[static_cast<std::size_t>(rank_)] * esize, enter(stream_handle));
    reduce_block(send, block, first, counts[static_cast<std::size_t>(rank_)], dtype, stream_handle,
                 "all_reduce");
    all_gather(block, recv, counts, dtype, stream_handle);
    LMOE_CUDA_CHECK(cudaEventRecord(staging_.free, enter(stream_handle)));
  }

  void reduce_scatter(const void* send, void* recv, std::span<const std::size_t> counts,
                      DType dtype, StreamHandle stream_handle) override {
    check_counts(counts, "reduce_scatter");
    const std::size_t first =
        std::accumulate(counts.begin(), counts.begin() + rank_, std::size_t{0});
    reduce_block(send, recv, first, counts[static_cast<std::size_t>(rank_)], dtype, stream_handle,
                 "reduce_scatter");
  }

  void all_gather(const void* send, void* recv, std::span<const std::size_t> counts, DType dtype,
                  StreamHandle stream_handle) override {
    check_counts(counts, "all_gather");
    const cudaStream_t stream = enter(stream_handle);
    const std::size_t esize = dtype_size(dtype);
    publish_and_wait_ready(send, stream, "all_gather");
    std::size_t offset = 0;
    for (int peer = 0; peer < size(); ++peer) {
      const std::size_t bytes = counts[static_cast<std::size_t>(peer)] * esize;
      auto* dst = static_cast<std::byte*>(recv) + offset * esize;
      const void* src = group_->slot(peer).send;
      // An in-place all-gather passes its own block of recv as send: nothing to move.
      if (bytes && dst != src) {
        LMOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
      }
      offset += counts[static_cast<std::size_t>(peer)];
    }
    signal_and_wait_done(stream, "all_gather");
  }

  // Host records between threads: no device work, so ranks can agree before launching anything.
  void control_all_gather(const void* send, void* recv, std::size_t bytes) override {
    group_->slot(rank_).control = send;
    group_->barrier(rank_, "control_all_gather");
    for (int peer = 0; peer < size(); ++peer) {
      if (bytes) {
        std::memcpy(static_cast<std::byte*>(recv) + static_cast<std::size_t>(peer) * bytes,
                    group_->slot(peer).control, bytes);
      }
    }
    group_->barrier(rank_, "control_all_gather");
  }

  void barrier() override { group_->barrier(rank_, "barrier"); }
  void abort(const std::string& why) override { group_->abort(rank_, why); }

 private:
  cudaStream_t enter(StreamHandle stream) {
    LMOE_CUDA_CHECK(cudaSetDevice(group_->device()));
    return cuda::stream_or_default(stream);
  }

  void check_counts(std::span<const std::size_t> counts, const char* operation) const {
    if (counts.size() != static_cast<std::size_t>(size())) {
      throw Error(std::string(operation) + ": counts has " + std::to_string(counts.size()) +
                  " entries, expected one per rank (" + std::to_string(size()) + ")");
    }
  }

  // The scratch buffer, at least `bytes` long, free for `stream` to write (its last user, possibly
  // another of this rank's streams, has finished with it).
  // recv = round(Σ_peer send_peer[first, first + count)) through this rank's scratch, because recv
  // may alias send, which the peers are still reading.
  void reduce_block(const void* send, void* recv, std::size_t first, std::size_t count, DType dtype,
                    StreamHandle stream_handle, const char* operation) {
    const cudaStream_t stream = enter(stream_handle);
    const std::size_t bytes = count * dtype_size(dtype);
    void* scratch = scratch_for(bytes, stream);
    publish_and_wait_ready(send, stream, operation);
    reduce_from_peers(first, count, dtype, scratch, stream);
    signal_and_wait_done(stream, operation);
    finish_from_scratch(scratch, recv, bytes, stream);
  }

  // A per-rank device buffer that grows on demand and is handed to a stream only once its last
  // user is done (`free` is recorded after that use; a peer's stream may have been the reader).
  struct ReusedBuffer {
    void* data = nullptr;
    std::size_t bytes = 0;
    cudaEvent_t free = nullptr;

    void* for_stream(std::size_t needed, cudaStream_t stream) {
      if (needed > bytes) {
        if (data) {
          LMOE_CUDA_CHECK(cudaEventSynchronize(free));
          LMOE_CUDA_CHECK(cudaFree(data));
          data = nullptr;
          bytes = 0;
        }
        LMOE_CUDA_CHECK(cudaMalloc(&data, needed));
        bytes = needed;
      }
      LMOE_CUDA_CHECK(cudaStreamWaitEvent(stream, free, 0));
      return data;
    }
    void release() {
      if (data) {
        cudaEventSynchronize(free);
        cudaFree(data);
      }
      cudaEventDestroy(free);
    }
  };

  // The reduction's scratch: recv may alias send, which the peers are still reading.
  void* scratch_for(std::size_t bytes, cudaStream_t stream) {
    return scratch_.for_stream(bytes, stream);
  }
  // The two-shot all-reduce's block of reduced elements, read by the peers in the all-gather that
  // follows; `staging_.free` is recorded after that all-gather's closing wait.
  void* staging_for(std::size_t bytes, cudaStream_t stream) {
    return staging_.for_stream(bytes, stream);
  }

  void publish_and_wait_ready(const void* send, cudaStream_t stream, const char* operation) {
    auto& mine = group_->slot(rank_);
    mine.send = send;
    LMOE_CUDA_CHECK(cudaEventRecord(mine.ready, stream));
    group_->barrier(rank_, operation);
    for (int peer = 0; peer < size(); ++peer) {
      if (peer != rank_) LMOE_CUDA_CHECK(cudaStreamWaitEvent(stream, group_->slot(peer).ready, 0));
    }
  }

  void signal_and_wait_done(cudaStream_t stream, const char* operation) {
    LMOE_CUDA_CHECK(cudaEventRecord(group_->slot(rank_).done, stream));
    group_->barrier(rank_, operation);
    for (int peer = 0; peer < size(); ++peer) {
      if (peer != rank_) LMOE_CUDA_CHECK(cudaStreamWaitEvent(stream, group_->slot(peer).done, 0));
    }
  }

  // scratch = round(Σ_peer send_peer[first, first + count)) in rank order.
  void reduce_from_peers(std::size_t first, std::size_t count, DType dtype, void* scratch,
                         cudaStream_t stream) {
    const void* inputs[cuda::kMaxReduceInputs];
    const std::size_t offset = first * dtype_size(dtype);
    for (int peer = 0; peer < size(); ++peer) {
      inputs[peer] = static_cast<const std::byte*>(group_->slot(peer).send) + offset;
    }
    check(cuda::launch_rank_order_reduce(inputs, size(), scratch, static_cast<std::int64_t>(count),
                                         dtype, stream),
          "launch_rank_order_reduce");
  }

  void finish_from_scratch(const void* scratch, void* recv, std::size_t bytes,
                           cudaStream_t stream) {
    if (bytes)
      LMOE_CUDA_CHECK(cudaMemcpyAsync(recv, scratch, bytes, cudaMemcpyDeviceToDevice, stream));
    LMOE_CUDA_CHECK(cudaEventRecord(scratch_.free, stream));
  }

  std::shared_ptr<CudaThreadGroup> group_;
  int rank_;
  ReusedBuffer scratch_;
  ReusedBuffer staging_;
};

}  // namespace

std::vector<std::shared_ptr<Communicator>> make_cuda_thread_communicators(
    int num_ranks, int device, std::chrono::milliseconds timeout) {
  if (num_ranks < 1 || num_ranks > cuda::kMaxReduceInputs) {
    throw Error("cuda-threads: number of ranks must be in [1, " +
                std::to_string(cuda::kMaxReduceInputs) + "], got " + std::to_string(num_ranks));
  }
  auto group = std::make_shared<CudaThreadGroup>(num_ranks, device, timeout);
  std::vector<std::shared_ptr<Communicator>> comms;
  for (int rank = 0; rank < num_ranks; ++rank) {
    comms.push_back(std::make_shared<CudaThreadCommunicator>(group, rank));
  }
  return comms;
}

void run_on_cuda_threads(int num_ranks, int device,
                         const std::function<void(int, Communicator&)>& fn,
                         std::chrono::milliseconds timeout) {
  run_on_rank_threads(make_cuda_thread_communicators(num_ranks, device, timeout),
                      [&](int rank, Communicator& comm) {
                        LMOE_CUDA_CHECK(cudaSetDevice(device));
                        fn(rank, comm);
                      });
}

}  // namespace lmoe

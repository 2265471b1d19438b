// Host side of the P2P communicator: a rank's collectives cut into rounds over its group's
// workspace, the status records that turn a device-side timeout or abort into an lmoe::Error, and
// the group of ranks that are threads of this process (the group of processes: p2p_process.cpp).
#include "lmoe/p2p_communicator.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "comm/aborted_error.hpp"
#include "comm/host_barrier.hpp"
#include "cuda/comm/p2p_group.hpp"
#include "cuda/comm/p2p_launch.hpp"
#include "cuda/comm/p2p_peer_access.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "cuda/runtime/mapped_host_buffer.hpp"
#include "lmoe/error.hpp"
#include "lmoe/settings.hpp"
#include "lmoe/threads_communicator.hpp"

namespace lmoe {

namespace {

using cuda::kP2pMaxBlocks;
using cuda::kP2pMaxRanks;
using cuda::P2pCollective;
using cuda::P2pDeviceHandle;
using cuda::P2pOp;
using cuda::P2pRound;
using cuda::P2pStatus;

// Ranks that share a GPU spin on each other's kernels, which must therefore run at the same time.
// Streams beyond the GPU's hardware queues (8 by default) share queues and serialize, so a spinning
// round can block the peer round it waits for (DESIGN.md §4: 16 ranks time out at 8 queues). The
// driver reads this variable when it creates the context, so it is set before main() runs; a value
// the user set is kept.
//
// For the same reason modules are loaded eagerly: with lazy loading, the first launch of a kernel
// (ours, or a cuBLASLt GEMM's) may wait for the context to go idle, and a spinning peer round never
// lets it (CUDA programming guide, lazy loading, "concurrent execution").
const bool kSpinSafeEnvironment = [] {
  return setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0) == 0 &&
         setenv("CUDA_MODULE_LOADING", "EAGER", 0) == 0;
}();

// Ranks that are threads of this process: peers' workspaces are plain device pointers (peer
// access between GPUs), the status records host memory of this process, the control path a host
// barrier and pointers published in host slots.
class P2pThreadGroup final : public P2pGroup {
 public:
  P2pThreadGroup(int size, std::vector<int> devices, const P2pOptions& options)
      : P2pGroup(size, p2p_layout(options, has_duplicates(devices))) {
    devices_ = std::move(devices);
    std::vector<int> distinct = devices_;
    std::sort(distinct.begin(), distinct.end());
    distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
    for (int device : devices_) gpu_ids_.push_back(std::to_string(device));
    barrier_ = std::make_unique<HostBarrier>(size, layout_.timeout);
    enable_peer_access(distinct);

    status_memory_ = cuda::MappedHostBuffer(sizeof(P2pMappedStatus));
    mapped_ = mapped_device_ = static_cast<P2pMappedStatus*>(status_memory_.data());

    for (int r = 0; r < size; ++r) {
      LMOE_CUDA_CHECK(cudaSetDevice(devices_[r]));
      workspaces_.emplace_back(p2p_workspace_bytes(layout_));
      LMOE_CUDA_CHECK(cudaMemset(workspaces_.back().data(), 0, p2p_flags_bytes()));
      flags_.push_back(static_cast<cuda::P2pFlags*>(workspaces_.back().data()));
      data_.push_back(static_cast<std::byte*>(workspaces_.back().at(p2p_flags_bytes())));
    }
    for (int device : distinct) {
      LMOE_CUDA_CHECK(cudaSetDevice(device));
      LMOE_CUDA_CHECK(cudaDeviceSynchronize());  // the zeroed flags are in place before any round
      LMOE_CUDA_CHECK(cuda::preload_p2p_kernels());
    }
    slots_.resize(static_cast<std::size_t>(size));
  }

  void barrier(int rank, const char* operation) override {
    barrier_->arrive_and_wait(rank, operation);
  }
  void abort_host(int rank, const std::string& why) override { barrier_->abort(rank, why); }

  void control_all_gather(int rank, const void* send, void* recv, std::size_t bytes) override {
    slots_[static_cast<std::size_t>(rank)] = send;
    barrier_->arrive_and_wait(rank, "control_all_gather");
    for (int peer = 0; peer < size_ && bytes; ++peer) {
      std::memcpy(static_cast<std::byte*>(recv) + static_cast<std::size_t>(peer) * bytes,
                  slots_[static_cast<std::size_t>(peer)], bytes);
    }
    barrier_->arrive_and_wait(rank, "control_all_gather");
  }

  std::unique_ptr<P2pSharedBuffer> share_buffer(int rank, std::size_t bytes) override {
    auto shared = std::make_unique<ThreadBuffer>(bytes, size_);
    std::byte* mine = static_cast<std::byte*>(shared->own.data());
    control_all_gather(rank, &mine, shared->bases(), sizeof(std::byte*));
    return shared;
  }

 private:
  // Every rank's pointer is valid on every rank (peer access, or the same GPU).
  struct ThreadBuffer final : P2pSharedBuffer {
    ThreadBuffer(std::size_t bytes, int size) : own(bytes) {
      LMOE_CUDA_CHECK(cudaMemset(own.data(), 0, bytes));
      LMOE_CUDA_CHECK(cudaDeviceSynchronize());  // zeroed before any peer can reach it
      bases_.resize(static_cast<std::size_t>(size));
    }
    std::byte** bases() { return bases_.data(); }
    cuda::DeviceBuffer own;
  };

  static bool has_duplicates(std::vector<int> devices) {
    std::sort(devices.begin(), devices.end());
    return std::adjacent_find(devices.begin(), devices.end()) != devices.end();
  }

  void enable_peer_access(const std::vector<int>& distinct) {
    for (int from : distinct) {
      for (int to : distinct) {
        if (from == to) continue;
        int can = 0;
        LMOE_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, from, to));
        LMOE_CHECK(can, "p2p: GPU " + std::to_string(from) + " cannot access the memory of GPU " +
                            std::to_string(to) +
                            " (no peer access between them); use the nccl communicator");
        LMOE_CUDA_CHECK(cudaSetDevice(from));
        const cudaError_t status = cudaDeviceEnablePeerAccess(to, 0);
        if (status == cudaErrorPeerAccessAlreadyEnabled) {
          cudaGetLastError();
        } else {
          LMOE_CUDA_CHECK(status);
        }
      }
    }
  }

  std::unique_ptr<HostBarrier> barrier_;
  cuda::MappedHostBuffer status_memory_;        // mapped_: the status records and the abort flag
  std::vector<cuda::DeviceBuffer> workspaces_;  // per rank: flags, then [parity][block] regions
  std::vector<const void*> slots_;              // control_all_gather's host records
};

// The devices of a thread group: as given, or round-robin over the visible GPUs; checked.
std::vector<int> thread_group_devices(int size, const P2pOptions& options) {
  LMOE_CHECK(size >= 1 && size <= kP2pMaxRanks, "p2p: number of ranks must be in [1, " +
                                                    std::to_string(kP2pMaxRanks) + "], got " +
                                                    std::to_string(size));
  int visible = 0;
  LMOE_CUDA_CHECK(cudaGetDeviceCount(&visible));
  std::vector<int> devices = options.devices;
  if (devices.empty()) {
    for (int r = 0; r < size; ++r) devices.push_back(r % visible);
  }
  LMOE_CHECK(static_cast<int>(devices.size()) == size,
             "p2p: devices has " + std::to_string(devices.size()) +
                 " entries, expected one per rank (" + std::to_string(size) + ")");
  for (int device : devices) {
    LMOE_CHECK(device >= 0 && device < visible, "p2p: device " + std::to_string(device) +
                                                    " is not visible (" + std::to_string(visible) +
                                                    " GPUs)");
  }
  return devices;
}

class P2pCommunicator final : public Communicator, public P2pPeerAccess {
 public:
  P2pCommunicator(std::shared_ptr<P2pGroup> group, int rank)
      : group_(std::move(group)), rank_(rank), handle_(group_->handle(rank)) {}

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  std::string_view backend_name() const override { return "p2p"; }
  MemorySpace memory_space() const override { return MemorySpace::device; }
  bool graph_capturable() const override { return true; }

  void all_reduce(const void* send, void* recv, std::size_t count, DType dtype,
                  StreamHandle stream) override {
    const cudaStream_t s = enter(stream);
    const std::size_t esize = dtype_size(dtype);
    const std::size_t per_round = elements_per_round(esize);
    const std::uint32_t tag = tag_of(P2pCollective::all_reduce, dtype, count);
    for (std::size_t start = 0; start < count; start += per_round) {
      const std::size_t n = std::min(per_round, count - start);
      P2pRound round =
          make_round(tag, P2pOp::reduce, offset(send, start * esize), offset(recv, start * esize));
      for (int r = 0; r < size(); ++r) round.stage_count[r] = static_cast<std::int64_t>(n);
      round.reduce_first = 0;
      round.reduce_count = static_cast<std::int64_t>(n);
      launch(round, n, dtype, s, "all_reduce");
    }
  }

  void reduce_scatter(const void* send, void* recv, std::span<const std::size_t> counts,
                      DType dtype, StreamHandle stream) override {
    check_counts(counts, "reduce_scatter");
    const cudaStream_t s = enter(stream);
    const std::size_t esize = dtype_size(dtype);
    const std::uint32_t tag = tag_of(P2pCollective::reduce_scatter, dtype, total_of(counts));
    const std::size_t region = group_->block_bytes() / esize;
    // Each round carries a piece of every rank's block, and every rank reduces its own piece in the
    // same round (all blocks of all ranks reading at once). A block's region holds its slice of
    // every piece: up to `slot` elements each, a whole number of 8-element slots.
    const std::size_t slot = region / static_cast<std::size_t>(size()) / 8 * 8;
    if (slot == 0) return reduce_scatter_whole(tag, send, recv, counts, dtype, s);
    const std::size_t blocks = static_cast<std::size_t>(group_->blocks());
    const std::size_t per_piece = blocks * slot;
    const std::size_t longest = *std::max_element(counts.begin(), counts.end());
    std::vector<std::size_t> block_offset(counts.size(), 0);
    std::partial_sum(counts.begin(), counts.end() - 1, block_offset.begin() + 1);
    for (std::size_t start = 0; start < longest; start += per_piece) {
      P2pRound round = make_round(tag, P2pOp::reduce_scatter, send, offset(recv, start * esize));
      std::size_t most = 0;
      for (int r = 0; r < size(); ++r) {
        const std::size_t count = counts[static_cast<std::size_t>(r)];
        const std::size_t piece = start < count ? std::min(per_piece, count - start) : 0;
        round.piece_offset[r] =
            static_cast<std::int64_t>(block_offset[static_cast<std::size_t>(r)] + start);
        round.piece_count[r] = static_cast<std::int64_t>(piece);
        most = std::max(most, piece);
      }
      // A block per ~4096 elements of the largest piece; every block's slice of a piece stays
      // within its slot (g · unit ≥ most, unit ≤ slot, both multiples of 8).
      const std::size_t unit = std::min<std::size_t>(4096, slot);
      const int grid =
          static_cast<int>(std::clamp<std::size_t>((most + unit - 1) / unit, 1, blocks));
      cuda::check(cuda::launch_p2p_round(handle_, round, grid, dtype, s), "reduce_scatter");
    }
  }

  // reduce_scatter with regions too small for a slot per rank (f32, tp 16, the smallest regions):
  // every rank stages all of its send buffer round by round and keeps the part of each round that
  // falls in its own block.
  void reduce_scatter_whole(std::uint32_t tag, const void* send, void* recv,
                            std::span<const std::size_t> counts, DType dtype, cudaStream_t s) {
    const std::size_t esize = dtype_size(dtype);
    const std::size_t total = total_of(counts);
    const std::size_t first =
        std::accumulate(counts.begin(), counts.begin() + rank_, std::size_t{0});
    const std::size_t last = first + counts[static_cast<std::size_t>(rank_)];
    const std::size_t per_round = elements_per_round(esize);
    for (std::size_t start = 0; start < total; start += per_round) {
      const std::size_t n = std::min(per_round, total - start);
      const std::size_t lo = std::max(first, start), hi = std::min(last, start + n);
      P2pRound round = make_round(tag, P2pOp::reduce, offset(send, start * esize),
                                  offset(recv, (lo < hi ? lo - first : 0) * esize));
      for (int r = 0; r < size(); ++r) round.stage_count[r] = static_cast<std::int64_t>(n);
      round.reduce_first = lo < hi ? static_cast<std::int64_t>(lo - start) : 0;
      round.reduce_count = lo < hi ? static_cast<std::int64_t>(hi - lo) : 0;
      launch(round, n, dtype, s, "reduce_scatter");
    }
  }

  void all_gather(const void* send, void* recv, std::span<const std::size_t> counts, DType dtype,
                  StreamHandle stream) override {
    check_counts(counts, "all_gather");
    const cudaStream_t s = enter(stream);
    const std::size_t esize = dtype_size(dtype);
    const std::size_t longest = *std::max_element(counts.begin(), counts.end());
    const std::size_t per_round = elements_per_round(esize);
    const std::uint32_t tag = tag_of(P2pCollective::all_gather, dtype, total_of(counts));
    std::vector<std::size_t> block_offset(counts.size(), 0);
    std::partial_sum(counts.begin(), counts.end() - 1, block_offset.begin() + 1);
    const bool in_place =
        offset(recv, block_offset[static_cast<std::size_t>(rank_)] * esize) == send;
    for (std::size_t start = 0; start < longest; start += per_round) {
      const std::size_t n = std::min(per_round, longest - start);
      const std::size_t mine = counts[static_cast<std::size_t>(rank_)];
      P2pRound round =
          make_round(tag, P2pOp::gather, offset(send, std::min(start, mine) * esize), recv);
      for (int r = 0; r < size(); ++r) {
        const std::size_t count = counts[static_cast<std::size_t>(r)];
        round.stage_count[r] =
            static_cast<std::int64_t>(start < count ? std::min(n, count - start) : 0);
        round.gather_offset[r] =
            static_cast<std::int64_t>(block_offset[static_cast<std::size_t>(r)] + start);
      }
      round.skip_own_gather = in_place;
      launch(round, n, dtype, s, "all_gather");
    }
  }

  // Host records through the group's control path (host slots between threads, shared memory
  // between processes): ranks agree before launching.
  void control_all_gather(const void* send, void* recv, std::size_t bytes) override {
    throw_if_failed("control_all_gather");
    host_wait("control_all_gather", [&] { group_->control_all_gather(rank_, send, recv, bytes); });
  }

  void barrier() override {
    throw_if_failed("barrier");
    host_wait("barrier", [&] { group_->barrier(rank_, "barrier"); });
    throw_if_failed("barrier");
  }

  void abort(const std::string& why) override {
    group_->raise_abort();
    group_->abort_host(rank_, why);
  }

  cuda::P2pDeviceHandle device_handle() const override { return handle_; }
  int ranks_on_my_gpu() const override { return group_->ranks_on_gpu_of(rank_); }
  int device() const override { return group_->device(rank_); }
  void throw_if_device_failed(const char* operation) override { throw_if_failed(operation); }
  std::unique_ptr<P2pSharedBuffer> share_buffer(std::size_t bytes) override {
    throw_if_failed("share_buffer");
    LMOE_CUDA_CHECK(cudaSetDevice(group_->device(rank_)));
    std::unique_ptr<P2pSharedBuffer> shared;
    host_wait("share_buffer", [&] { shared = group_->share_buffer(rank_, bytes); });
    return shared;
  }

 private:
  static const void* offset(const void* base, std::size_t bytes) {
    return static_cast<const std::byte*>(base) + bytes;
  }
  static void* offset(void* base, std::size_t bytes) {
    return static_cast<std::byte*>(base) + bytes;
  }

  // A round stages at most one region per block.
  std::size_t elements_per_round(std::size_t esize) const {
    return static_cast<std::size_t>(group_->blocks()) * (group_->block_bytes() / esize);
  }

  cudaStream_t enter(StreamHandle stream) {
    throw_if_failed("collective");
    LMOE_CUDA_CHECK(cudaSetDevice(group_->device(rank_)));
    return cuda::stream_or_default(stream);
  }

  static std::size_t total_of(std::span<const std::size_t> counts) {
    return std::accumulate(counts.begin(), counts.end(), std::size_t{0});
  }

  static std::uint32_t tag_of(P2pCollective collective, DType dtype, std::size_t count) {
    return cuda::p2p_round_tag(collective, static_cast<std::uint32_t>(dtype), count);
  }

  static P2pRound make_round(std::uint32_t tag, P2pOp op, const void* send, void* out) {
    P2pRound round{};
    round.tag = tag;
    round.op = op;
    round.send = send;
    round.out = out;
    return round;
  }

  // The grid for a round whose largest staged part is n elements: the same on every rank (n is), a
  // block per ~4096 elements up to the group's limit, and never a slice larger than a block's
  // region (n ≤ blocks · region elements, and a grid below the limit has slices of at most `unit`).
  void launch(const P2pRound& round, std::size_t n, DType dtype, cudaStream_t stream,
              const char* operation) {
    const std::size_t region = group_->block_bytes() / dtype_size(dtype);
    const std::size_t unit = std::min<std::size_t>(4096, region);
    const int blocks = static_cast<int>(std::clamp<std::size_t>(
        (n + unit - 1) / unit, 1, static_cast<std::size_t>(group_->blocks())));
    cuda::check(cuda::launch_p2p_round(handle_, round, blocks, dtype, stream), operation);
  }

  void check_counts(std::span<const std::size_t> counts, const char* operation) const {
    if (counts.size() != static_cast<std::size_t>(size())) {
      throw Error(std::string(operation) + ": counts has " + std::to_string(counts.size()) +
                  " entries, expected one per rank (" + std::to_string(size()) + ")");
    }
  }

  // A failure a round reported on the device becomes an error on the host, and the group's host
  // barrier is aborted so that no rank waits there for one that has given up.
  void throw_if_failed(const char* operation) {
    std::string failure = group_->device_failure();
    if (failure.empty()) return;
    if (setting_present("LMOE_P2P_DIAGNOSE")) failure += group_->block_progress();
    group_->abort_host(rank_, failure);
    throw CommunicatorAborted(std::string(operation) + ": " + failure);
  }

  template <class Wait>
  void host_wait(const char* operation, const Wait& wait) {
    try {
      wait();
    } catch (const CommunicatorAborted&) {
      group_->raise_abort();
      throw_if_failed(operation);  // the device's reason is the root cause when there is one
      throw;
    }
  }

  std::shared_ptr<P2pGroup> group_;
  int rank_;
  P2pDeviceHandle handle_;
};

}  // namespace

std::shared_ptr<Communicator> make_p2p_communicator(std::shared_ptr<P2pGroup> group, int rank) {
  (void)kSpinSafeEnvironment;
  LMOE_CHECK(group && rank >= 0 && rank < group->size(),
             "p2p: rank " + std::to_string(rank) + " is not in the group");
  return std::make_shared<P2pCommunicator>(std::move(group), rank);
}

std::vector<std::shared_ptr<Communicator>> make_p2p_thread_communicators(
    int num_ranks, const P2pOptions& options) {
  int current = 0;
  LMOE_CUDA_CHECK(cudaGetDevice(&current));
  std::vector<int> devices = thread_group_devices(num_ranks, options);
  auto group = std::make_shared<P2pThreadGroup>(num_ranks, std::move(devices), options);
  LMOE_CUDA_CHECK(cudaSetDevice(current));
  std::vector<std::shared_ptr<Communicator>> comms;
  for (int rank = 0; rank < num_ranks; ++rank) comms.push_back(make_p2p_communicator(group, rank));
  return comms;
}

void run_on_p2p_threads(int num_ranks, const std::function<void(int, Communicator&)>& fn,
                        const P2pOptions& options) {
  const auto comms = make_p2p_thread_communicators(num_ranks, options);
  int visible = 0;
  LMOE_CUDA_CHECK(cudaGetDeviceCount(&visible));
  run_on_rank_threads(comms, [&](int rank, Communicator& comm) {
    const int device =
        options.devices.empty() ? rank % visible : options.devices[static_cast<std::size_t>(rank)];
    LMOE_CUDA_CHECK(cudaSetDevice(device));
    fn(rank, comm);
  });
}

}  // namespace lmoe

// Host side of the P2P communicator: the group's workspaces and flags, rounds cut to the workspace,
// and the status records that turn a device-side timeout or abort into an lmoe::Error.
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
#include "comm/p2p_peer_access.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/device_buffer.hpp"
#include "cuda/p2p_launch.hpp"
#include "lmoe/error.hpp"
#include "lmoe/threads_communicator.hpp"

namespace lmoe {

namespace {

using cuda::kP2pMaxBlocks;
using cuda::kP2pMaxRanks;
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
  return setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0) == 0 && setenv("CUDA_MODULE_LOADING", "EAGER", 0) == 0;
}();

constexpr std::size_t kDefaultRoundBytes = std::size_t{32} << 20;

std::chrono::milliseconds default_timeout() {
  if (const char* value = std::getenv("LMOE_P2P_TIMEOUT_MS")) {
    char* end = nullptr;
    const long long ms = std::strtoll(value, &end, 10);
    LMOE_CHECK(end != value && *end == '\0' && ms > 0,
               std::string("LMOE_P2P_TIMEOUT_MS: expected a positive number of milliseconds, got '") + value + "'");
    return std::chrono::milliseconds(ms);
  }
  return std::chrono::seconds(10);
}

// Host-mapped pinned memory: the rounds write their status here, the host reads it without
// synchronizing any stream.
struct MappedStatus {
  P2pStatus status[kP2pMaxRanks];
  std::int32_t abort_flag;
};

class P2pGroup {
 public:
  P2pGroup(int size, const P2pOptions& options) : size_(size) {
    LMOE_CHECK(size >= 1 && size <= kP2pMaxRanks, "p2p: number of ranks must be in [1, " +
                                                      std::to_string(kP2pMaxRanks) + "], got " + std::to_string(size));
    int visible = 0;
    LMOE_CUDA_CHECK(cudaGetDeviceCount(&visible));
    devices_ = options.devices;
    if (devices_.empty()) {
      for (int r = 0; r < size; ++r) devices_.push_back(r % visible);
    }
    LMOE_CHECK(static_cast<int>(devices_.size()) == size,
               "p2p: devices has " + std::to_string(devices_.size()) + " entries, expected one per rank (" +
                   std::to_string(size) + ")");
    for (int device : devices_) {
      LMOE_CHECK(device >= 0 && device < visible, "p2p: device " + std::to_string(device) + " is not visible (" +
                                                      std::to_string(visible) + " GPUs)");
    }
    std::vector<int> distinct = devices_;
    std::sort(distinct.begin(), distinct.end());
    distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
    const bool shared_gpu = distinct.size() < devices_.size();
    blocks_ = options.blocks ? options.blocks : (shared_gpu ? 16 : kP2pMaxBlocks);
    LMOE_CHECK(blocks_ >= 1 && blocks_ <= kP2pMaxBlocks,
               "p2p: blocks must be in [1, " + std::to_string(kP2pMaxBlocks) + "], got " + std::to_string(blocks_));
    // Each block stages into its own region of block_bytes_ (a multiple of 256, so every region is
    // aligned for vectors and holds a whole number of 8-element slices in every dtype).
    const std::size_t round_bytes = options.round_bytes ? options.round_bytes : kDefaultRoundBytes;
    block_bytes_ = std::max<std::size_t>(256, round_bytes / static_cast<std::size_t>(blocks_) / 256 * 256);
    timeout_ = options.timeout.count() > 0 ? options.timeout : default_timeout();
    barrier_ = std::make_unique<HostBarrier>(size, timeout_);
    enable_peer_access(distinct);

    void* mapped = nullptr;
    LMOE_CUDA_CHECK(cudaHostAlloc(&mapped, sizeof(MappedStatus), cudaHostAllocMapped | cudaHostAllocPortable));
    mapped_ = static_cast<MappedStatus*>(mapped);
    std::memset(mapped_, 0, sizeof(MappedStatus));

    data_.resize(static_cast<std::size_t>(size));
    flags_.resize(static_cast<std::size_t>(size));
    for (int r = 0; r < size; ++r) {
      LMOE_CUDA_CHECK(cudaSetDevice(devices_[r]));
      data_[r] = cuda::DeviceBuffer(2 * static_cast<std::size_t>(blocks_) * block_bytes_);
      flags_[r] = cuda::DeviceBuffer(sizeof(cuda::P2pFlags));
      LMOE_CUDA_CHECK(cudaMemset(flags_[r].data(), 0, flags_[r].bytes()));
    }
    for (int device : distinct) {
      LMOE_CUDA_CHECK(cudaSetDevice(device));
      LMOE_CUDA_CHECK(cudaDeviceSynchronize());  // the zeroed flags are in place before any round
      LMOE_CUDA_CHECK(cuda::preload_p2p_kernels());
    }
    slots_.resize(static_cast<std::size_t>(size));
  }

  ~P2pGroup() {
    data_.clear();
    flags_.clear();
    cudaFreeHost(mapped_);
  }

  int size() const { return size_; }
  int device(int rank) const { return devices_[rank]; }
  int ranks_on_device(int device) const {
    return static_cast<int>(std::count(devices_.begin(), devices_.end(), device));
  }
  int blocks() const { return blocks_; }
  std::size_t block_bytes() const { return block_bytes_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  HostBarrier& barrier() { return *barrier_; }
  const void*& control_slot(int rank) { return slots_[static_cast<std::size_t>(rank)]; }

  P2pDeviceHandle handle(int rank) const {
    P2pDeviceHandle h{};
    h.rank = rank;
    h.size = size_;
    h.block_bytes = static_cast<std::int64_t>(block_bytes_);
    h.max_blocks = blocks_;
    for (int r = 0; r < size_; ++r) {
      h.data[r] = static_cast<std::byte*>(data_[r].data());
      h.flags[r] = static_cast<cuda::P2pFlags*>(flags_[r].data());
    }
    h.status = &mapped_->status[rank];
    h.abort_flag = &mapped_->abort_flag;
    h.timeout_ns = static_cast<std::uint64_t>(timeout_.count()) * 1000000ull;
    return h;
  }

  // Where every rank's blocks are, for a failure message: "rank r: entered/completed" per block,
  // from the flags in device memory (read once the rounds have stopped, which a raised abort flag
  // ensures). A stalled rank whose blocks never entered the round was not running at all (queued
  // behind other work, or not resident); one that entered but did not complete was waiting. Then,
  // for the block of the first timeout, the arrival each rank holds from every peer: a peer that
  // completed the round while a rank still holds an older arrival from it points at the flags'
  // visibility, not at scheduling.
  std::string block_progress() {
    std::string text;
    int timed_out_block = -1;
    for (int r = 0; r < size_ && timed_out_block < 0; ++r) {
      if (mapped_->status[r].code == cuda::kP2pTimeout) timed_out_block = mapped_->status[r].block;
    }
    std::vector<cuda::P2pFlags> flags(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r) {
      LMOE_CUDA_CHECK(cudaSetDevice(devices_[r]));
      if (cudaMemcpy(&flags[r], flags_[r].data(), sizeof(cuda::P2pFlags), cudaMemcpyDeviceToHost) != cudaSuccess) {
        cudaGetLastError();
        return "";
      }
      text += "; rank " + std::to_string(r) + " blocks entered/completed:";
      for (int b = 0; b < blocks_; ++b) {
        text += " " + std::to_string(flags[r].entered[b]) + "/" + std::to_string(flags[r].epoch[b]);
      }
    }
    if (timed_out_block >= 0 && timed_out_block < blocks_) {
      text += "; arrivals held for block " + std::to_string(timed_out_block) + " (from rank 0 … " +
              std::to_string(size_ - 1) + "):";
      for (int r = 0; r < size_; ++r) {
        text += " rank " + std::to_string(r) + " [";
        for (int peer = 0; peer < size_; ++peer) {
          text += (peer ? " " : "") + std::to_string(flags[r].arrive[timed_out_block][peer]);
        }
        text += "]";
      }
    }
    return text;
  }

  // Raises the device-visible abort flag: rounds in flight stop spinning, later rounds fail at once.
  void raise_abort() {
    reinterpret_cast<volatile std::int32_t&>(mapped_->abort_flag) = 1;
  }

  // The first device-side failure in the group, as a message; empty when there is none.
  std::string device_failure() const {
    std::string aborted;
    for (int r = 0; r < size_; ++r) {
      const volatile P2pStatus& s = mapped_->status[r];
      switch (s.code) {
        case cuda::kP2pTimeout:
          return "p2p: rank " + std::to_string(r) + " waited more than " + std::to_string(timeout_.count()) +
                 " ms for rank " + std::to_string(s.peer) + " (round " + std::to_string(s.round) + ", block " +
                 std::to_string(s.block) + "); the peer is stalled or never issued the same collective";
        case cuda::kP2pConcurrentUse:
          return "p2p: rank " + std::to_string(r) +
                 " ran two collectives at the same time on one workspace (issue them in one order, or "
                 "order the streams with events)";
        case cuda::kP2pAborted:
          if (aborted.empty()) aborted = "p2p: the group was aborted while rank " + std::to_string(r) + " was waiting";
          break;
        default: break;
      }
    }
    return aborted;
  }

 private:
  void enable_peer_access(const std::vector<int>& distinct) {
    for (int from : distinct) {
      for (int to : distinct) {
        if (from == to) continue;
        int can = 0;
        LMOE_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, from, to));
        LMOE_CHECK(can, "p2p: GPU " + std::to_string(from) + " cannot access the memory of GPU " + std::to_string(to) +
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

  const int size_;
  std::vector<int> devices_;
  int blocks_ = 0;
  std::size_t block_bytes_ = 0;
  std::chrono::milliseconds timeout_{0};
  std::unique_ptr<HostBarrier> barrier_;
  MappedStatus* mapped_ = nullptr;
  std::vector<cuda::DeviceBuffer> data_;   // per rank: [parity][block] regions of block_bytes_
  std::vector<cuda::DeviceBuffer> flags_;  // per rank: P2pFlags
  std::vector<const void*> slots_;         // control_all_gather's host records
};

class P2pCommunicator final : public Communicator, public P2pPeerAccess {
 public:
  P2pCommunicator(std::shared_ptr<P2pGroup> group, int rank)
      : group_(std::move(group)), rank_(rank), handle_(group_->handle(rank)) {}

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  std::string_view backend_name() const override { return "p2p"; }
  MemorySpace memory_space() const override { return MemorySpace::device; }
  bool graph_capturable() const override { return true; }

  void all_reduce(const void* send, void* recv, std::size_t count, DType dtype, StreamHandle stream) override {
    const cudaStream_t s = enter(stream);
    const std::size_t esize = dtype_size(dtype);
    const std::size_t per_round = elements_per_round(esize);
    for (std::size_t start = 0; start < count; start += per_round) {
      const std::size_t n = std::min(per_round, count - start);
      P2pRound round = make_round(P2pOp::reduce, offset(send, start * esize), offset(recv, start * esize));
      for (int r = 0; r < size(); ++r) round.stage_count[r] = static_cast<std::int64_t>(n);
      round.reduce_first = 0;
      round.reduce_count = static_cast<std::int64_t>(n);
      launch(round, n, dtype, s, "all_reduce");
    }
  }

  void reduce_scatter(const void* send, void* recv, std::span<const std::size_t> counts, DType dtype,
                      StreamHandle stream) override {
    check_counts(counts, "reduce_scatter");
    const cudaStream_t s = enter(stream);
    const std::size_t esize = dtype_size(dtype);
    const std::size_t total = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
    const std::size_t first = std::accumulate(counts.begin(), counts.begin() + rank_, std::size_t{0});
    const std::size_t last = first + counts[static_cast<std::size_t>(rank_)];
    const std::size_t per_round = elements_per_round(esize);
    // Every rank stages all of its send buffer (each block goes to its owner), round by round; a
    // rank keeps the part of each round that falls in its own block.
    for (std::size_t start = 0; start < total; start += per_round) {
      const std::size_t n = std::min(per_round, total - start);
      const std::size_t lo = std::max(first, start), hi = std::min(last, start + n);
      P2pRound round = make_round(P2pOp::reduce, offset(send, start * esize),
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
    std::vector<std::size_t> block_offset(counts.size(), 0);
    std::partial_sum(counts.begin(), counts.end() - 1, block_offset.begin() + 1);
    const bool in_place = offset(recv, block_offset[static_cast<std::size_t>(rank_)] * esize) == send;
    for (std::size_t start = 0; start < longest; start += per_round) {
      const std::size_t n = std::min(per_round, longest - start);
      const std::size_t mine = counts[static_cast<std::size_t>(rank_)];
      P2pRound round = make_round(P2pOp::gather, offset(send, std::min(start, mine) * esize), recv);
      for (int r = 0; r < size(); ++r) {
        const std::size_t count = counts[static_cast<std::size_t>(r)];
        round.stage_count[r] = static_cast<std::int64_t>(start < count ? std::min(n, count - start) : 0);
        round.gather_offset[r] = static_cast<std::int64_t>(block_offset[static_cast<std::size_t>(r)] + start);
      }
      round.skip_own_gather = in_place;
      launch(round, n, dtype, s, "all_gather");
    }
  }

  // Host records between threads, like the cuda-threads communicator: ranks agree before launching.
  void control_all_gather(const void* send, void* recv, std::size_t bytes) override {
    throw_if_failed("control_all_gather");
    group_->control_slot(rank_) = send;
    wait_for_peers("control_all_gather");
    for (int peer = 0; peer < size(); ++peer) {
      if (bytes) {
        std::memcpy(static_cast<std::byte*>(recv) + static_cast<std::size_t>(peer) * bytes,
                    group_->control_slot(peer), bytes);
      }
    }
    wait_for_peers("control_all_gather");
  }

  void barrier() override {
    throw_if_failed("barrier");
    wait_for_peers("barrier");
    throw_if_failed("barrier");
  }

  void abort(const std::string& why) override {
    group_->raise_abort();
    group_->barrier().abort(rank_, why);
  }

  cuda::P2pDeviceHandle device_handle() const override { return handle_; }
  int ranks_on_my_gpu() const override { return group_->ranks_on_device(group_->device(rank_)); }
  void throw_if_device_failed(const char* operation) override { throw_if_failed(operation); }

 private:
  static const void* offset(const void* base, std::size_t bytes) { return static_cast<const std::byte*>(base) + bytes; }
  static void* offset(void* base, std::size_t bytes) { return static_cast<std::byte*>(base) + bytes; }

  // A round stages at most one region per block.
  std::size_t elements_per_round(std::size_t esize) const {
    return static_cast<std::size_t>(group_->blocks()) * (group_->block_bytes() / esize);
  }

  cudaStream_t enter(StreamHandle stream) {
    throw_if_failed("collective");
    LMOE_CUDA_CHECK(cudaSetDevice(group_->device(rank_)));
    return cuda::stream_or_default(stream);
  }

  P2pRound make_round(P2pOp op, const void* send, void* out) const {
    P2pRound round{};
    round.op = op;
    round.send = send;
    round.out = out;
    return round;
  }

  // The grid for a round whose largest staged part is n elements: the same on every rank (n is), a
  // block per ~4096 elements up to the group's limit, and never a slice larger than a block's region
  // (n ≤ blocks · region elements, and a grid below the limit has slices of at most `unit`).
  void launch(const P2pRound& round, std::size_t n, DType dtype, cudaStream_t stream, const char* operation) {
    const std::size_t region = group_->block_bytes() / dtype_size(dtype);
    const std::size_t unit = std::min<std::size_t>(4096, region);
    const int blocks = static_cast<int>(
        std::clamp<std::size_t>((n + unit - 1) / unit, 1, static_cast<std::size_t>(group_->blocks())));
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
    if (std::getenv("LMOE_P2P_DIAGNOSE")) failure += group_->block_progress();
    group_->barrier().abort(rank_, failure);
    throw CommunicatorAborted(std::string(operation) + ": " + failure);
  }

  void wait_for_peers(const char* operation) {
    try {
      group_->barrier().arrive_and_wait(rank_, operation);
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

std::vector<std::shared_ptr<Communicator>> make_p2p_thread_communicators(int num_ranks, const P2pOptions& options) {
  (void)kSpinSafeEnvironment;
  int current = 0;
  LMOE_CUDA_CHECK(cudaGetDevice(&current));
  auto group = std::make_shared<P2pGroup>(num_ranks, options);
  LMOE_CUDA_CHECK(cudaSetDevice(current));
  std::vector<std::shared_ptr<Communicator>> comms;
  for (int rank = 0; rank < num_ranks; ++rank) comms.push_back(std::make_shared<P2pCommunicator>(group, rank));
  return comms;
}

void run_on_p2p_threads(int num_ranks, const std::function<void(int, Communicator&)>& fn, const P2pOptions& options) {
  const auto comms = make_p2p_thread_communicators(num_ranks, options);
  int visible = 0;
  LMOE_CUDA_CHECK(cudaGetDeviceCount(&visible));
  run_on_rank_threads(comms, [&](int rank, Communicator& comm) {
    const int device = options.devices.empty() ? rank % visible : options.devices[static_cast<std::size_t>(rank)];
    LMOE_CUDA_CHECK(cudaSetDevice(device));
    fn(rank, comm);
  });
}

}  // namespace lmoe

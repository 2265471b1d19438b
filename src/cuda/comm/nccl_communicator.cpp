// The `nccl` communicator (include/lmoe/nccl_communicator.hpp): the data collectives map onto NCCL
// on the caller's stream; the host control path (barrier, control_all_gather) is a host barrier for
// a thread group, MPI for processes started by mpirun, or NCCL itself on a small device buffer.
// Creation, polling and abort are in nccl_group.cpp.
#include "lmoe/nccl_communicator.hpp"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>

#include "comm/process_launch.hpp"
#include "cuda/comm/nccl_group.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/tail/cuda_tail_executor.hpp"
#include "lmoe/error.hpp"
#include "lmoe/settings.hpp"
#include "lmoe/threads_communicator.hpp"

#ifdef LMOE_HAS_MPI
#include <mpi.h>

#include "comm/mpi_check.hpp"
#endif

namespace lmoe {

namespace {

using Clock = std::chrono::steady_clock;

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return ncclFloat32;
    case DType::f16: return ncclFloat16;
    case DType::bf16: return ncclBfloat16;
  }
  throw Error("nccl: unknown dtype");
}

const std::byte* at(const void* base, std::size_t byte_offset) {
  return static_cast<const std::byte*>(base) + byte_offset;
}
std::byte* at(void* base, std::size_t byte_offset) {
  return static_cast<std::byte*>(base) + byte_offset;
}

bool overlaps(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  const auto a_begin = reinterpret_cast<std::uintptr_t>(a),
             b_begin = reinterpret_cast<std::uintptr_t>(b);
  return a_bytes > 0 && b_bytes > 0 && a_begin < b_begin + b_bytes && b_begin < a_begin + a_bytes;
}

// Device memory for the calls whose buffers overlap in a way NCCL does not allow (the tail's tiers
// never make such calls). Stream-ordered (cudaMallocAsync / cudaFreeAsync), so that growing it
// never synchronizes the device, where NCCL kernels may be waiting for peers; an event orders its
// uses across the caller's streams.
class Scratch {
 public:
  explicit Scratch(int device) : device_(device) {}
  ~Scratch() {
    if (!free_) return;
    const DeviceScope scope(device_);
    if (data_) {
      cudaStreamWaitEvent(cudaStreamPerThread, free_, 0);
      cudaFreeAsync(data_, cudaStreamPerThread);
    }
    cudaEventDestroy(free_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  // `bytes` of device memory that `stream` (on the scratch's device, current) may use once its
  // previous user has finished with it.
  void* acquire(std::size_t bytes, cudaStream_t stream) {
    if (!free_) LMOE_CUDA_CHECK(cudaEventCreateWithFlags(&free_, cudaEventDisableTiming));
    LMOE_CUDA_CHECK(cudaStreamWaitEvent(stream, free_, 0));
    if (bytes > bytes_) {
      if (data_) LMOE_CUDA_CHECK(cudaFreeAsync(data_, stream));
      data_ = nullptr;
      bytes_ = 0;
      LMOE_CUDA_CHECK(cudaMallocAsync(&data_, bytes, stream));
      bytes_ = bytes;
    }
    return data_;
  }
  void release(cudaStream_t stream) { LMOE_CUDA_CHECK(cudaEventRecord(free_, stream)); }

 private:
  int device_;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  cudaEvent_t free_ = nullptr;  // made on first use, on the rank's thread and device
};

// The stream a collective runs on. NCCL may launch a call's kernels from a thread of its own (a
// nonblocking communicator sets up connections in the background), where the handle of the
// per-thread default stream would name that thread's stream. A call on it runs on a stream of this
// rank's instead, after the caller's earlier work and before its later work (two events).
class ProxyStream {
 public:
  explicit ProxyStream(int device) : device_(device) {}
  ~ProxyStream() {
    if (!stream_) return;
    const DeviceScope scope(device_);
    cudaEventDestroy(joined_);
    cudaEventDestroy(forked_);
    cudaStreamDestroy(stream_);  // returns at once; its work still completes
  }
  ProxyStream(const ProxyStream&) = delete;
  ProxyStream& operator=(const ProxyStream&) = delete;

  cudaStream_t begin(cudaStream_t caller) {
    if (caller != cudaStreamPerThread) return caller;
    if (!stream_) {
      LMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      LMOE_CUDA_CHECK(cudaEventCreateWithFlags(&forked_, cudaEventDisableTiming));
      LMOE_CUDA_CHECK(cudaEventCreateWithFlags(&joined_, cudaEventDisableTiming));
    }
    LMOE_CUDA_CHECK(cudaEventRecord(forked_, caller));
    LMOE_CUDA_CHECK(cudaStreamWaitEvent(stream_, forked_, 0));
    return stream_;
  }
  void end(cudaStream_t caller, cudaStream_t used) {
    if (used == caller) return;
    LMOE_CUDA_CHECK(cudaEventRecord(joined_, used));
    LMOE_CUDA_CHECK(cudaStreamWaitEvent(caller, joined_, 0));
  }

 private:
  int device_;
  cudaStream_t stream_ = nullptr;  // made on first use, on the rank's thread and device
  cudaEvent_t forked_ = nullptr, joined_ = nullptr;
};

// Starts a group of NCCL calls and always ends it (a failed call inside still needs the end); the
// result is the first failure, else ncclGroupEnd's (ncclInProgress on nonblocking communicators).
template <class Calls>
ncclResult_t grouped(Calls&& calls) {
  const ncclResult_t start = ncclGroupStart();
  if (start != ncclSuccess) return start;
  const ncclResult_t first = calls();
  const ncclResult_t end = ncclGroupEnd();
  return first != ncclSuccess && first != ncclInProgress ? first : end;
}

// The data collectives, shared by the thread-group and the per-process communicators.
class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<NcclGroup> group, NcclMember& member)
      : group_(std::move(group)), member_(member), scratch_(member.device), proxy_(member.device) {}

  int rank() const override { return member_.rank; }
  int size() const override { return group_->size(); }
  std::string_view backend_name() const override { return "nccl"; }
  MemorySpace memory_space() const override { return MemorySpace::device; }
  bool graph_capturable() const override { return true; }

  void all_reduce(const void* send, void* recv, std::size_t count, DType dtype,
                  StreamHandle handle) override {
    const cudaStream_t caller = enter(handle);
    const std::size_t bytes = count * dtype_size(dtype);
    if (count == 0) return;
    const cudaStream_t stream = proxy_.begin(caller);
    // NCCL allows recv == send (in place) or disjoint buffers; anything else goes through a copy.
    const void* source = send;
    const bool clash = send != recv && overlaps(send, bytes, recv, bytes);
    if (clash) source = copy_to_scratch(send, bytes, stream);
    group_->run(member_, "ncclAllReduce", [&](ncclComm_t comm) {
      return ncclAllReduce(source, recv, count, nccl_type(dtype), ncclSum, comm, stream);
    });
    if (clash) scratch_.release(stream);
    proxy_.end(caller, stream);
  }

  // Equal blocks: ncclReduceScatter. Unequal blocks (the token tier splits rows unevenly): one
  // ncclReduce per block, rooted at its owner.
  void reduce_scatter(const void* send, void* recv, std::span<const std::size_t> counts,
                      DType dtype, StreamHandle handle) override {
    const Blocks blocks = layout(counts, dtype, "reduce_scatter");
    const cudaStream_t caller = enter(handle);
    if (blocks.total_bytes == 0) return;
    const cudaStream_t stream = proxy_.begin(caller);
    // In place is recv == this rank's block of send; any other overlap reduces into scratch.
    const bool in_place = recv == at(send, blocks.my_offset_bytes);
    const bool clash = !in_place && overlaps(send, blocks.total_bytes, recv, blocks.my_bytes);
    void* target = clash ? scratch_.acquire(blocks.my_bytes, stream) : recv;
    if (blocks.equal) {
      group_->run(member_, "ncclReduceScatter", [&](ncclComm_t comm) {
        return ncclReduceScatter(send, target, counts[0], nccl_type(dtype), ncclSum, comm, stream);
      });
    } else {
      run_per_block("ncclReduce (reduce_scatter of unequal blocks)", counts, blocks,
                    [&](int root, std::size_t count, std::size_t offset_bytes, ncclComm_t comm) {
                      return ncclReduce(at(send, offset_bytes), root == rank() ? target : nullptr,
                                        count, nccl_type(dtype), ncclSum, root, comm, stream);
                    });
    }
    if (clash) {
      if (blocks.my_bytes) {
        LMOE_CUDA_CHECK(
            cudaMemcpyAsync(recv, target, blocks.my_bytes, cudaMemcpyDeviceToDevice, stream));
      }
      scratch_.release(stream);
    }
    proxy_.end(caller, stream);
  }

  // Equal blocks: ncclAllGather. Unequal blocks: one ncclBroadcast per block from its owner.
  void all_gather(const void* send, void* recv, std::span<const std::size_t> counts, DType dtype,
                  StreamHandle handle) override {
    const Blocks blocks = layout(counts, dtype, "all_gather");
    const cudaStream_t caller = enter(handle);
    if (blocks.total_bytes == 0) return;
    const cudaStream_t stream = proxy_.begin(caller);
    // In place is send == this rank's block of recv; any other overlap sends a copy, because the
    // peers' blocks land in recv while send is still being read.
    const bool in_place = send == at(recv, blocks.my_offset_bytes);
    const bool clash = !in_place && overlaps(send, blocks.my_bytes, recv, blocks.total_bytes);
    const void* source = clash ? copy_to_scratch(send, blocks.my_bytes, stream) : send;
    if (blocks.equal) {
      group_->run(member_, "ncclAllGather", [&](ncclComm_t comm) {
        return ncclAllGather(source, recv, counts[0], nccl_type(dtype), comm, stream);
      });
    } else {
      run_per_block("ncclBroadcast (all_gather of unequal blocks)", counts, blocks,
                    [&](int root, std::size_t count, std::size_t offset_bytes, ncclComm_t comm) {
                      return ncclBroadcast(root == rank() ? source : nullptr,
                                           at(recv, offset_bytes), count, nccl_type(dtype), root,
                                           comm, stream);
                    });
    }
    if (clash) scratch_.release(stream);
    proxy_.end(caller, stream);
  }

  void abort(const std::string& why) override { group_->abort(rank(), why); }

 protected:
  cudaStream_t enter(StreamHandle handle) {
    group_->throw_if_aborted();
    LMOE_CUDA_CHECK(cudaSetDevice(member_.device));
    return cuda::stream_or_default(handle);
  }

  NcclGroup& group() { return *group_; }

 private:
  // Where each rank's block lies in a block collective's buffer.
  struct Blocks {
    std::size_t my_offset_bytes = 0, my_bytes = 0, total_bytes = 0;
    std::vector<std::size_t> offset_bytes;  // one per rank
    bool equal = true;                      // every block the same size (NCCL's own collectives)
  };

  Blocks layout(std::span<const std::size_t> counts, DType dtype, const char* operation) const {
    if (counts.size() != static_cast<std::size_t>(size())) {
      throw Error(std::string(operation) + ": counts has " + std::to_string(counts.size()) +
                  " entries, expected one per rank (" + std::to_string(size()) + ")");
    }
    const std::size_t esize = dtype_size(dtype);
    Blocks blocks;
    for (int r = 0; r < size(); ++r) {
      const std::size_t bytes = counts[static_cast<std::size_t>(r)] * esize;
      if (r == rank()) {
        blocks.my_offset_bytes = blocks.total_bytes;
        blocks.my_bytes = bytes;
      }
      blocks.offset_bytes.push_back(blocks.total_bytes);
      blocks.total_bytes += bytes;
      blocks.equal = blocks.equal && counts[static_cast<std::size_t>(r)] == counts[0];
    }
    return blocks;
  }

  // call(root, count, offset_bytes, comm) for every non-empty block, in one NCCL group; every rank
  // makes the same calls (empty blocks are skipped alike).
  template <class Call>
  void run_per_block(const char* what, std::span<const std::size_t> counts, const Blocks& blocks,
                     const Call& call) {
    group_->run(member_, what, [&](ncclComm_t comm) {
      return grouped([&] {
        for (int root = 0; root < size(); ++root) {
          const std::size_t count = counts[static_cast<std::size_t>(root)];
          if (count == 0) continue;
          const ncclResult_t status =
              call(root, count, blocks.offset_bytes[static_cast<std::size_t>(root)], comm);
          if (status != ncclSuccess && status != ncclInProgress) return status;
        }
        return ncclSuccess;
      });
    });
  }

  const void* copy_to_scratch(const void* source, std::size_t bytes, cudaStream_t stream) {
    void* copy = scratch_.acquire(bytes, stream);
    LMOE_CUDA_CHECK(cudaMemcpyAsync(copy, source, bytes, cudaMemcpyDeviceToDevice, stream));
    return copy;
  }

  std::shared_ptr<NcclGroup> group_;
  NcclMember& member_;
  Scratch scratch_;
  ProxyStream proxy_;
};

// Ranks as threads of one process: the host control path is a bounded host barrier and pointers
// published in host slots, as in the cuda-threads communicator.
class NcclThreadCommunicator final : public NcclCommunicator {
 public:
  NcclThreadCommunicator(const std::shared_ptr<NcclGroup>& group, int rank)
      : NcclCommunicator(group, group->member(static_cast<std::size_t>(rank))) {}

  void barrier() override { group().host_barrier(rank(), "barrier"); }

  void control_all_gather(const void* send, void* recv, std::size_t bytes) override {
    group().control_slot(rank()) = send;
    group().host_barrier(rank(), "control_all_gather");
    for (int peer = 0; peer < size() && bytes; ++peer) {
      std::memcpy(at(recv, static_cast<std::size_t>(peer) * bytes), group().control_slot(peer),
                  bytes);
    }
    group().host_barrier(rank(), "control_all_gather");
  }
};

// The host control path of one process per GPU.
class HostChannel {
 public:
  virtual ~HostChannel() = default;
  virtual void barrier() = 0;
  // recv[r · bytes, (r + 1) · bytes) = rank r's `bytes` bytes of send.
  virtual void all_gather(const void* send, void* recv, std::size_t bytes) = 0;
};

class NcclProcessCommunicator final : public NcclCommunicator {
 public:
  // The channel is destroyed before the base class's group (and the NCCL communicator it uses).
  NcclProcessCommunicator(const std::shared_ptr<NcclGroup>& group,
                          std::unique_ptr<HostChannel> channel)
      : NcclCommunicator(group, group->member(0)), channel_(std::move(channel)) {}

  void barrier() override {
    group().throw_if_aborted();
    channel_->barrier();
  }
  void control_all_gather(const void* send, void* recv, std::size_t bytes) override {
    group().throw_if_aborted();
    channel_->all_gather(send, recv, bytes);
  }

 private:
  std::unique_ptr<HostChannel> channel_;
};

// The control path through NCCL itself, for processes that have no other channel (torchrun): a
// small device buffer on a stream of its own, waited for with a deadline.
class NcclHostChannel final : public HostChannel {
 public:
  NcclHostChannel(NcclGroup& group, NcclMember& member) : group_(group), member_(member) {
    LMOE_CUDA_CHECK(cudaSetDevice(member_.device));
    LMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~NcclHostChannel() override {
    const DeviceScope scope(member_.device);
    if (buffer_) cudaFreeAsync(buffer_, stream_);
    cudaStreamSynchronize(stream_);  // only a free is left on it: every collective was waited for
    cudaStreamDestroy(stream_);
  }

  void barrier() override {
    void* word = reserve(sizeof(float));
    LMOE_CUDA_CHECK(cudaMemsetAsync(word, 0, sizeof(float), stream_));
    group_.run(member_, "barrier (ncclAllReduce)", [&](ncclComm_t comm) {
      return ncclAllReduce(word, word, 1, ncclFloat32, ncclSum, comm, stream_);
    });
    group_.wait_stream(member_, stream_, "barrier");
  }

  void all_gather(const void* send, void* recv, std::size_t bytes) override {
    if (bytes == 0) return;
    const std::size_t total = bytes * static_cast<std::size_t>(group_.size());
    std::byte* gathered = static_cast<std::byte*>(reserve(total));
    std::byte* mine = gathered + bytes * static_cast<std::size_t>(member_.rank);
    LMOE_CUDA_CHECK(cudaSetDevice(member_.device));
    LMOE_CUDA_CHECK(cudaMemcpyAsync(mine, send, bytes, cudaMemcpyHostToDevice, stream_));
    group_.run(member_, "control_all_gather (ncclAllGather)", [&](ncclComm_t comm) {
      return ncclAllGather(mine, gathered, bytes, ncclUint8, comm, stream_);
    });
    group_.wait_stream(member_, stream_, "control_all_gather");
    LMOE_CUDA_CHECK(cudaMemcpyAsync(recv, gathered, total, cudaMemcpyDeviceToHost, stream_));
    group_.wait_stream(member_, stream_, "control_all_gather");
  }

 private:
  // A device buffer of at least `bytes`, grown stream-ordered (no device-wide synchronization).
  void* reserve(std::size_t bytes) {
    LMOE_CUDA_CHECK(cudaSetDevice(member_.device));
    if (bytes > bytes_) {
      if (buffer_) LMOE_CUDA_CHECK(cudaFreeAsync(buffer_, stream_));
      buffer_ = nullptr;
      bytes_ = 0;
      LMOE_CUDA_CHECK(cudaMallocAsync(&buffer_, bytes, stream_));
      bytes_ = bytes;
    }
    return buffer_;
  }

  NcclGroup& group_;
  NcclMember& member_;
  cudaStream_t stream_ = nullptr;
  void* buffer_ = nullptr;
  std::size_t bytes_ = 0;
};

#ifdef LMOE_HAS_MPI
// The control path over MPI for processes started by mpirun. Nonblocking MPI calls, tested against
// a deadline: a rank that never arrives fails its peers instead of hanging them.
class MpiHostChannel final : public HostChannel {
 public:
  MpiHostChannel(NcclGroup& group, int rank) : group_(group), rank_(rank) {
    check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &comm_), "MPI_Comm_dup");
    check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  }
  ~MpiHostChannel() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }

  void barrier() override {
    MPI_Request request = MPI_REQUEST_NULL;
    check_mpi(MPI_Ibarrier(comm_, &request), "MPI_Ibarrier");
    wait(request, "barrier");
  }

  void all_gather(const void* send, void* recv, std::size_t bytes) override {
    LMOE_CHECK(bytes <= static_cast<std::size_t>(INT32_MAX),
               "control_all_gather: too many bytes for MPI");
    MPI_Request request = MPI_REQUEST_NULL;
    check_mpi(MPI_Iallgather(send, static_cast<int>(bytes), MPI_BYTE, recv, static_cast<int>(bytes),
                             MPI_BYTE, comm_, &request),
              "MPI_Iallgather");
    wait(request, "control_all_gather");
  }

 private:
  void wait(MPI_Request& request, const char* what) {
    const auto deadline = Clock::now() + group_.timeout();
    for (int round = 0;; ++round) {
      group_.throw_if_aborted();
      int done = 0;
      check_mpi(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "MPI_Test");
      if (done) return;
      if (Clock::now() >= deadline) {
        group_.fail(rank_, "rank " + std::to_string(rank_) + ": " + what +
                               " over MPI did not complete within " +
                               std::to_string(group_.timeout().count()) +
                               " ms (a rank missing or stuck?)");
      }
      if (round > 64) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  NcclGroup& group_;
  int rank_;
  MPI_Comm comm_ = MPI_COMM_NULL;
};
#endif

std::string gpus(int count) { return std::to_string(count) + (count == 1 ? " GPU" : " GPUs"); }

std::string many_gpus_message(int ranks, int visible) {
  return "nccl: " + std::to_string(ranks) + (ranks == 1 ? " rank needs " : " ranks need ") +
         gpus(ranks) +
         " (NCCL cannot put two ranks on one GPU; the cuda-threads communicator can), but " +
         std::to_string(visible) + (visible == 1 ? " is" : " are") + " visible";
}

// Why `device` cannot serve this process's rank, or empty.
std::string device_problem(int rank, int device, const std::string& chosen_by) {
  const int visible = cuda_device_count();
  if (visible == 0) return "rank " + std::to_string(rank) + ": no CUDA GPU is visible";
  if (device < 0 || device >= visible) {
    return "rank " + std::to_string(rank) + " would use GPU " + std::to_string(device) + " (" +
           chosen_by + "), but only " + gpus(visible) + (visible == 1 ? " is" : " are") +
           " visible: start at most " + std::to_string(visible) +
           " process(es) per node (NCCL cannot put two ranks on one GPU)";
  }
  return {};
}

std::vector<std::byte> id_bytes(const ncclUniqueId& id) {
  std::vector<std::byte> bytes(sizeof(id));
  std::memcpy(bytes.data(), &id, sizeof(id));
  return bytes;
}

}  // namespace

int nccl_runtime_version() {
  int version = 0;
  check_nccl(ncclGetVersion(&version), "ncclGetVersion");
  return version;
}

std::vector<std::shared_ptr<Communicator>> make_nccl_thread_communicators(
    int num_ranks, std::span<const int> devices, std::chrono::milliseconds timeout) {
  LMOE_CHECK(num_ranks >= 1,
             "nccl: number of ranks must be >= 1, got " + std::to_string(num_ranks));
  const int visible = cuda_device_count();
  std::vector<int> chosen(devices.begin(), devices.end());
  if (chosen.empty()) {
    if (num_ranks > visible) throw Error(many_gpus_message(num_ranks, visible));
    chosen.resize(static_cast<std::size_t>(num_ranks));
    std::iota(chosen.begin(), chosen.end(), 0);
  }
  LMOE_CHECK(chosen.size() == static_cast<std::size_t>(num_ranks),
             "nccl: devices lists " + std::to_string(chosen.size()) +
                 " GPUs, expected one per rank (" + std::to_string(num_ranks) + ")");
  std::vector<std::pair<int, int>> rank_devices;
  for (int rank = 0; rank < num_ranks; ++rank) {
    const int device = chosen[static_cast<std::size_t>(rank)];
    LMOE_CHECK(device >= 0 && device < visible,
               "nccl: rank " + std::to_string(rank) + " on GPU " + std::to_string(device) +
                   ", but the visible GPUs are 0 to " + std::to_string(visible - 1));
    for (int earlier = 0; earlier < rank; ++earlier) {
      LMOE_CHECK(chosen[static_cast<std::size_t>(earlier)] != device,
                 "nccl: ranks " + std::to_string(earlier) + " and " + std::to_string(rank) +
                     " are both on GPU " + std::to_string(device) +
                     " (NCCL cannot put two ranks on one GPU)");
    }
    rank_devices.emplace_back(rank, device);
  }
  ncclUniqueId id;
  check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
  auto group = std::make_shared<NcclGroup>(num_ranks, rank_devices, timeout, /*thread_group=*/true);
  group->init(id);
  std::vector<std::shared_ptr<Communicator>> comms;
  for (int rank = 0; rank < num_ranks; ++rank)
    comms.push_back(std::make_shared<NcclThreadCommunicator>(group, rank));
  return comms;
}

void run_on_nccl_threads(int num_ranks, std::span<const int> devices,
                         const std::function<void(int, Communicator&)>& fn,
                         std::chrono::milliseconds timeout) {
  std::vector<int> chosen(devices.begin(), devices.end());
  if (chosen.empty()) {
    chosen.resize(static_cast<std::size_t>(std::max(num_ranks, 0)));
    std::iota(chosen.begin(), chosen.end(), 0);
  }
  // `devices` as given: with none, too few GPUs is reported as such, not as a bad device of rank 1.
  run_on_rank_threads(make_nccl_thread_communicators(num_ranks, devices, timeout),
                      [&](int rank, Communicator& comm) {
                        LMOE_CUDA_CHECK(cudaSetDevice(chosen[static_cast<std::size_t>(rank)]));
                        fn(rank, comm);
                      });
}

std::shared_ptr<Communicator> make_nccl_mpi_communicator(const NcclProcessOptions& options) {
#ifdef LMOE_HAS_MPI
  int initialized = 0;
  check_mpi(MPI_Initialized(&initialized), "MPI_Initialized");
  LMOE_CHECK(initialized, "nccl: MPI is not initialized (create an lmoe::MpiSession first)");
  int rank = 0, size = 0, local_rank = 0;
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &size), "MPI_Comm_size");
  {
    MPI_Comm node = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node),
              "MPI_Comm_split_type");
    const int status = MPI_Comm_rank(node, &local_rank);
    MPI_Comm_free(&node);
    check_mpi(status, "MPI_Comm_rank");
  }
  const int device = options.device.value_or(local_rank);
  const std::string chosen_by =
      options.device ? "given" : "its index among the processes of its node";

  auto group = std::make_shared<NcclGroup>(size, std::vector<std::pair<int, int>>{{rank, device}},
                                           options.timeout,
                                           /*thread_group=*/false);
  auto channel = std::make_unique<MpiHostChannel>(*group, rank);
  // Every rank learns every rank's problem before anyone waits for NCCL, and all fail alike.
  constexpr std::size_t kMessageBytes = 256;
  std::vector<char> mine(kMessageBytes, '\0'), all(kMessageBytes * static_cast<std::size_t>(size));
  const std::string problem = device_problem(rank, device, chosen_by);
  std::memcpy(mine.data(), problem.data(), std::min(problem.size(), kMessageBytes - 1));
  channel->all_gather(mine.data(), all.data(), kMessageBytes);
  for (int r = 0; r < size; ++r) {
    const char* message = all.data() + static_cast<std::size_t>(r) * kMessageBytes;
    if (*message != '\0')
      throw Error("nccl: " + std::string(message, strnlen(message, kMessageBytes)));
  }
  ncclUniqueId id{};
  if (rank == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
  std::vector<ncclUniqueId> ids(static_cast<std::size_t>(size));
  channel->all_gather(&id, ids.data(), sizeof(id));
  LMOE_CUDA_CHECK(cudaSetDevice(device));
  group->init(ids[0]);
  return std::make_shared<NcclProcessCommunicator>(group, std::move(channel));
#else
  (void)options;
  throw Error(
      "nccl: this lmoe was built without MPI; start one process per GPU with torchrun "
      "(make_nccl_env_communicator) or rebuild with MPI");
#endif
}

std::shared_ptr<Communicator> make_nccl_env_communicator(const NcclProcessOptions& options) {
  const EnvLookup env = process_environment();
  const std::optional<LaunchRank> launch = launch_rank_from_env(env);
  if (!launch) {
    throw Error(
        "nccl: RANK and WORLD_SIZE are not set: start one process per GPU with torchrun (or under "
        "mpirun with make_nccl_mpi_communicator)");
  }
  const int rank = launch->rank, size = launch->world_size;
  std::string chosen_by = "given";
  int device = 0;
  if (options.device) {
    device = *options.device;
  } else if (launch->local_rank) {
    device = *launch->local_rank;
    chosen_by = "LOCAL_RANK=" + std::to_string(device);
  } else if (size > 1) {
    throw Error(
        "nccl: LOCAL_RANK is not set: cannot tell which GPU rank " + std::to_string(rank) +
        " should use (a launcher like torchrun sets it; or pass NcclProcessOptions::device)");
  }
  if (const std::string problem = device_problem(rank, device, chosen_by); !problem.empty()) {
    throw Error("nccl: " + problem);
  }

  ncclUniqueId id{};
  std::optional<std::string> id_file;
  if (size == 1) {
    check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
  } else {
    id_file = setting_text("LMOE_NCCL_ID_FILE", env);
    if (!id_file || id_file->empty()) {
      throw Error(
          "nccl: LMOE_NCCL_ID_FILE is not set: with WORLD_SIZE=" + std::to_string(size) +
          ", rank 0 hands its NCCL id to the others through a file; set it to a fresh path on a "
          "filesystem every rank sees");
    }
    if (rank == 0) {
      check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
      publish_launch_record(*id_file, size, id_bytes(id));
    } else {
      const std::vector<std::byte> bytes = [&] {
        try {
          return await_launch_record(*id_file, size, sizeof(id), options.timeout);
        } catch (const Error& error) {
          throw Error("nccl: rank " + std::to_string(rank) +
                      ": LMOE_NCCL_ID_FILE: " + error.message());
        }
      }();
      std::memcpy(&id, bytes.data(), sizeof(id));
    }
  }
  auto group = std::make_shared<NcclGroup>(size, std::vector<std::pair<int, int>>{{rank, device}},
                                           options.timeout,
                                           /*thread_group=*/false);
  LMOE_CUDA_CHECK(cudaSetDevice(device));
  group->init(id);
  // Creation needs every rank, so each has read the file by now.
  if (rank == 0 && id_file) remove_launch_record(*id_file);
  auto channel = std::make_unique<NcclHostChannel>(*group, group->member(0));
  return std::make_shared<NcclProcessCommunicator>(group, std::move(channel));
}

}  // namespace lmoe

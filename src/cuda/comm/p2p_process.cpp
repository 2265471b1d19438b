// The p2p communicator with one process per rank, all on one node: every rank's workspace is a
// cudaMalloc allocation exported with cudaIpcGetMemHandle and opened by every peer
// (cudaIpcOpenMemHandle), so the rounds and the fused kernel run unchanged on mapped pointers.
//
// What the processes share besides the workspaces is a POSIX shared-memory segment that rank 0
// creates and names through the bootstrap communicator:
//   page 0        the status records and the abort flag (P2pMappedStatus), registered with
//                 cudaHostRegister(Mapped) in every process so that the rounds write and read it
//                 exactly as they do host-mapped memory between threads;
//   the rest      the host control path (SharedControl): bounded barriers, all-gathers, the reason
//                 of an abort.
// Host shared memory rather than device memory opened by IPC because the host must raise the
// abort flag and read every rank's status at any time, with plain loads and stores: a copy into
// device memory is GPU work, and on a GPU where a peer's round spins it may wait behind it (the
// very hazard the abort exists to end). The rounds already read the flag only after 50 µs of
// waiting (p2p_protocol.cuh), so its PCIe latency costs nothing on the fast path.
//
// Rules of CUDA IPC that shape this file: a handle names a whole cudaMalloc allocation and is
// opened at its base (so each shared buffer is its own allocation, rounded up to the 2 MiB
// granule, so that no unrelated allocation shares its pages); a process opens a peer's handle once
// and closes it with cudaIpcCloseMemHandle; the exporter must not free an allocation while a peer
// still maps it (undefined behaviour), so teardown is: every rank meets, closes what it opened,
// meets again, and only then frees what it exported; and a shared buffer (the fused workspace)
// released by its owner is freed only once every rank reports its mapping closed.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "comm/aborted_error.hpp"
#include "comm/process_launch.hpp"
#include "comm/shared_segment.hpp"
#include "cuda/comm/p2p_group.hpp"
#include "cuda/comm/p2p_launch.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "lmoe/error.hpp"
#include "lmoe/mpi_communicator.hpp"
#include "lmoe/p2p_communicator.hpp"
#include "lmoe/settings.hpp"
#include "lmoe/tier_policy.hpp"

namespace lmoe {

namespace {

constexpr std::size_t kIpcGranule = std::size_t{2} << 20;
constexpr std::size_t kNameBytes = 128;
constexpr std::size_t kProblemBytes = 256;
// Written by each rank after its flags, checked by every peer through its mapping: a mapping that
// does not land on the peer's workspace fails setup instead of corrupting memory.
constexpr std::uint64_t kIdentityTag = 0x6c6d6f6570327030ull;  // "lmoep2p0"
struct Identity {
  std::uint64_t tag;
  std::uint64_t rank;
};

// How long setup waits for the other processes: the NCCL path's bound, or the group's timeout
// when that is longer.
std::chrono::milliseconds p2p_setup_timeout(const P2pLayout& layout) {
  return std::max<std::chrono::milliseconds>(layout.timeout, std::chrono::seconds(120));
}

std::size_t round_up(std::size_t bytes, std::size_t granule) {
  return (bytes + granule - 1) / granule * granule;
}

template <std::size_t N>
void put(char (&field)[N], const std::string& text) {
  std::memset(field, 0, N);
  std::memcpy(field, text.data(), std::min(text.size(), N - 1));
}
template <std::size_t N>
std::string get(const char (&field)[N]) {
  return std::string(field, strnlen(field, N));
}

std::string cuda_failure(const char* call, cudaError_t status) {
  cudaGetLastError();
  return std::string(call) + " failed: " + cudaGetErrorName(status) + " (" +
         cudaGetErrorString(status) + ")";
}

// Every rank learns every rank's problem and all throw the same error, naming the first rank.
template <class Gather>
void agree(const std::string& problem, int size, const Gather& gather) {
  char mine[kProblemBytes];
  put(mine, problem);
  std::vector<char> all(kProblemBytes * static_cast<std::size_t>(size));
  gather(mine, all.data(), kProblemBytes);
  for (int r = 0; r < size; ++r) {
    const char* text = all.data() + static_cast<std::size_t>(r) * kProblemBytes;
    if (*text != '\0') {
      throw Error("p2p: rank " + std::to_string(r) + ": " +
                  std::string(text, strnlen(text, kProblemBytes)));
    }
  }
}

std::string gpu_id(int device) {
  cudaDeviceProp prop{};
  LMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  std::string id;
  char hex[3];
  for (char byte : prop.uuid.bytes) {
    std::snprintf(hex, sizeof(hex), "%02x", static_cast<unsigned char>(byte));
    id += hex;
  }
  return id;
}

std::string pci_bus_id(int device) {
  char id[32] = {};
  if (cudaDeviceGetPCIBusId(id, sizeof(id), device) != cudaSuccess) {
    cudaGetLastError();
    return "GPU " + std::to_string(device);
  }
  return id;
}

class P2pProcessGroup;

// A shared buffer between processes: this rank's own allocation and its peers' mappings.
class ProcessBuffer final : public P2pSharedBuffer {
 public:
  ProcessBuffer(std::weak_ptr<P2pProcessGroup> group, int rank, int size, std::uint64_t id)
      : group_(std::move(group)), rank_(rank), id_(id) {
    bases_.assign(static_cast<std::size_t>(size), nullptr);
  }
  ~ProcessBuffer() override;
  void set_own(void* own) {
    bases_[static_cast<std::size_t>(rank_)] = static_cast<std::byte*>(own);
  }
  void set_peer(int peer, void* mapped) {
    bases_[static_cast<std::size_t>(peer)] = static_cast<std::byte*>(mapped);
  }

 private:
  std::weak_ptr<P2pProcessGroup> group_;
  int rank_;
  std::uint64_t
      id_;  // the group's count of shared buffers before this one (the same on every rank)
};

class P2pProcessGroup final : public P2pGroup,
                              public std::enable_shared_from_this<P2pProcessGroup> {
 public:
  // Status records in the segment's first page(s), the control block after them.
  static std::size_t status_bytes() {
    const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    return round_up(sizeof(P2pMappedStatus), page);
  }
  static std::size_t segment_bytes() { return status_bytes() + SharedControl::bytes(); }

  P2pProcessGroup(int rank, int size, P2pLayout layout, int device,
                  std::vector<std::string> gpu_ids, SharedSegment segment)
      : P2pGroup(size, layout), rank_(rank), segment_(std::move(segment)) {
    devices_.assign(static_cast<std::size_t>(size), -1);
    devices_[static_cast<std::size_t>(rank)] = device;
    gpu_ids_ = std::move(gpu_ids);
    mapped_ = reinterpret_cast<P2pMappedStatus*>(segment_.data());
    control_.emplace(segment_.data() + status_bytes(), &mapped_->abort_flag, rank, size,
                     layout.timeout);
    data_.assign(static_cast<std::size_t>(size), nullptr);
    flags_.assign(static_cast<std::size_t>(size), nullptr);
    imported_.assign(static_cast<std::size_t>(size), nullptr);
  }

  ~P2pProcessGroup() override {
    cudaSetDevice(devices_[static_cast<std::size_t>(rank_)]);
    // Every rank has stopped launching (its communicator is gone) before anyone unmaps, and every
    // rank has closed its mappings before anyone frees what it exported.
    const bool met = control_->teardown_barrier(1);
    for (void*& mapped : imported_) {
      if (mapped) cudaIpcCloseMemHandle(mapped);
      mapped = nullptr;
    }
    const bool closed = met && control_->teardown_barrier(2);
    if (closed) {
      if (workspace_) cudaFree(workspace_);
      for (const auto& [id, own] : retired_) cudaFree(own);
    } else {
      // Freeing while a live peer may still map it is undefined behaviour; the process's exit
      // returns the memory instead.
      std::fprintf(
          stderr,
          "lmoe: p2p rank %d: a peer did not reach teardown within %lld ms; this rank's workspace "
          "is left allocated until the process exits\n",
          rank_, static_cast<long long>(layout_.timeout.count()));
    }
    if (registered_) cudaHostUnregister(segment_.data());
  }

  // Setup after the segment is open and the layout agreed: status page registered, workspace
  // allocated, exported, exchanged and opened. Collective; every rank throws the same error.
  void join() {
    // Processes reach setup at their own pace (context creation loads every module eagerly): its
    // waits get the NCCL path's bound, the collectives' host path the group's timeout after it.
    struct SetupBound {
      SharedControl& control;
      std::chrono::milliseconds after;
      ~SetupBound() { control.set_timeout(after); }
    } bound{*control_, layout_.timeout};
    control_->set_timeout(p2p_setup_timeout(layout_));
    const int device = devices_[static_cast<std::size_t>(rank_)];
    std::string problem;
    cudaIpcMemHandle_t handle{};
    const auto step = [&](const char* call, cudaError_t status) {
      if (problem.empty() && status != cudaSuccess) problem = cuda_failure(call, status);
      return problem.empty();
    };
    step("cudaSetDevice", cudaSetDevice(device));
    if (step("cudaHostRegister (the group's status page in shared memory)",
             cudaHostRegister(segment_.data(), status_bytes(),
                              cudaHostRegisterMapped | cudaHostRegisterPortable))) {
      registered_ = true;
      void* device_view = nullptr;
      if (step("cudaHostGetDevicePointer",
               cudaHostGetDevicePointer(&device_view, segment_.data(), 0))) {
        mapped_device_ = static_cast<P2pMappedStatus*>(device_view);
      }
    }
    if (problem.empty()) {
      const std::size_t bytes = round_up(p2p_workspace_bytes(layout_), kIpcGranule);
      if (step("cudaMalloc (the p2p workspace)", cudaMalloc(&workspace_, bytes)) &&
          step("cudaMemset", cudaMemset(workspace_, 0, p2p_flags_bytes()))) {
        const Identity identity{kIdentityTag, static_cast<std::uint64_t>(rank_)};
        step("cudaMemcpy", cudaMemcpy(identity_address(workspace_), &identity, sizeof(identity),
                                      cudaMemcpyHostToDevice));
        step("cudaDeviceSynchronize",
             cudaDeviceSynchronize());  // zeroed flags before any peer can reach them
        step("cudaIpcGetMemHandle", cudaIpcGetMemHandle(&handle, workspace_));
        step("loading the p2p kernels", cuda::preload_p2p_kernels());
      }
    }
    agree_all(problem);
    std::vector<cudaIpcMemHandle_t> handles(static_cast<std::size_t>(size_));
    all_gather(&handle, handles.data(), sizeof(handle), "setup (exchanging IPC handles)");

    for (int peer = 0; peer < size_ && problem.empty(); ++peer) {
      void* mapped = workspace_;
      if (peer != rank_) {
        const cudaError_t status = cudaIpcOpenMemHandle(
            &mapped, handles[static_cast<std::size_t>(peer)], cudaIpcMemLazyEnablePeerAccess);
        if (status != cudaSuccess) {
          problem = cuda_failure("cudaIpcOpenMemHandle", status) + " for the workspace of rank " +
                    std::to_string(peer) +
                    " (GPUs without peer access between them cannot use p2p; use nccl)";
          break;
        }
        imported_[static_cast<std::size_t>(peer)] = mapped;
        Identity identity{};
        if (!step("cudaMemcpy (reading a peer's workspace)",
                  cudaMemcpy(&identity, identity_address(mapped), sizeof(identity),
                             cudaMemcpyDeviceToHost))) {
          break;
        }
        if (identity.tag != kIdentityTag || identity.rank != static_cast<std::uint64_t>(peer)) {
          problem = "the mapping of rank " + std::to_string(peer) +
                    "'s workspace does not show its identity record";
          break;
        }
      }
      flags_[static_cast<std::size_t>(peer)] = static_cast<cuda::P2pFlags*>(mapped);
      data_[static_cast<std::size_t>(peer)] = static_cast<std::byte*>(mapped) + p2p_flags_bytes();
    }
    agree_all(problem);  // its last barrier: every rank's mappings are in place before any round
  }

  void barrier(int, const char* operation) override { control_->barrier(operation); }
  void abort_host(int, const std::string& why) override { control_->abort(why); }
  void control_all_gather(int, const void* send, void* recv, std::size_t bytes) override {
    control_->all_gather(send, recv, bytes, "control_all_gather");
  }

  std::unique_ptr<P2pSharedBuffer> share_buffer(int, std::size_t bytes) override {
    // Buffers are shared collectively, so the n-th one has id n on every rank. Each rank tells the
    // others the lowest id it still maps (every buffer below it is closed here); an exported buffer
    // below every rank's lowest is mapped nowhere any more and can be freed now.
    struct Record {
      cudaIpcMemHandle_t handle;
      std::uint64_t lowest_open;
    };
    Record mine{};
    std::uint64_t id = 0;
    {
      const std::lock_guard lock(buffers_mutex_);
      id = next_buffer_id_++;
      mine.lowest_open = open_buffers_.empty() ? id : *open_buffers_.begin();
      open_buffers_.insert(id);
    }
    auto shared = std::make_unique<ProcessBuffer>(weak_from_this(), rank_, size_, id);
    std::string problem;
    void* own = nullptr;
    cudaIpcMemHandle_t& handle = mine.handle;
    const auto step = [&](const char* call, cudaError_t status) {
      if (problem.empty() && status != cudaSuccess) problem = cuda_failure(call, status);
      return problem.empty();
    };
    if (step("cudaMalloc (a shared buffer)",
             cudaMalloc(&own, round_up(std::max<std::size_t>(bytes, 1), kIpcGranule)))) {
      shared->set_own(own);
      step("cudaMemset", cudaMemset(own, 0, bytes));
      step("cudaDeviceSynchronize",
           cudaDeviceSynchronize());  // zeroed before any peer can reach it
      step("cudaIpcGetMemHandle", cudaIpcGetMemHandle(&handle, own));
    }
    agree_all(problem);
    std::vector<Record> records(static_cast<std::size_t>(size_));
    all_gather(&mine, records.data(), sizeof(Record), "share_buffer");
    std::uint64_t closed_everywhere = id;
    for (const Record& record : records)
      closed_everywhere = std::min(closed_everywhere, record.lowest_open);
    free_retired_below(closed_everywhere);
    for (int peer = 0; peer < size_ && problem.empty(); ++peer) {
      if (peer == rank_) continue;
      void* mapped = nullptr;
      if (!step("cudaIpcOpenMemHandle (a peer's shared buffer)",
                cudaIpcOpenMemHandle(&mapped, records[static_cast<std::size_t>(peer)].handle,
                                     cudaIpcMemLazyEnablePeerAccess))) {
        break;
      }
      shared->set_peer(peer, mapped);
    }
    agree_all(problem);
    return shared;
  }

  // A shared buffer this rank is done with (its peers' mappings closed): its own allocation may
  // still be mapped by peers, so it is freed once every rank reports it closed (share_buffer) or
  // at teardown, after every rank has met (see the destructor). `own` may be null.
  void release(std::uint64_t id, void* own) {
    const std::lock_guard lock(buffers_mutex_);
    open_buffers_.erase(id);
    if (own) retired_.emplace_back(id, own);
  }

 private:
  static void* identity_address(void* workspace) {
    return static_cast<std::byte*>(workspace) + p2p_flags_bytes() - sizeof(Identity);
  }
  static_assert(sizeof(cuda::P2pFlags) + sizeof(Identity) <=
                    ((sizeof(cuda::P2pFlags) + 255) / 256 * 256),
                "the identity record lies in the padding after the flags");

  void all_gather(const void* send, void* recv, std::size_t bytes, const char* operation) {
    control_->all_gather(send, recv, bytes, operation);
  }
  // Every rank throws the same error when any rank had a problem.
  void agree_all(const std::string& problem) {
    agree(problem, size_, [this](const void* send, void* recv, std::size_t bytes) {
      all_gather(send, recv, bytes, "setup");
    });
  }

  void free_retired_below(std::uint64_t id) {
    const std::lock_guard lock(buffers_mutex_);
    std::erase_if(retired_, [&](const std::pair<std::uint64_t, void*>& retired) {
      if (retired.first >= id) return false;
      cudaFree(retired.second);
      return true;
    });
  }

  const int rank_;
  SharedSegment segment_;
  std::optional<SharedControl> control_;
  bool registered_ = false;
  void* workspace_ = nullptr;    // this rank's flags and regions (exported)
  std::vector<void*> imported_;  // peers' workspaces as mapped here (null for this rank)
  std::mutex buffers_mutex_;
  std::uint64_t next_buffer_id_ = 0;
  std::set<std::uint64_t> open_buffers_;                  // ids of this rank's live shared buffers
  std::vector<std::pair<std::uint64_t, void*>> retired_;  // released, exported, maybe still mapped
};

ProcessBuffer::~ProcessBuffer() {
  for (std::size_t r = 0; r < bases_.size(); ++r) {
    if (static_cast<int>(r) != rank_ && bases_[r]) cudaIpcCloseMemHandle(bases_[r]);
  }
  void* own = bases_[static_cast<std::size_t>(rank_)];
  if (const auto group = group_.lock()) {
    group->release(id_, own);
  } else if (own) {
    cudaFree(own);
  }
}

// The records every rank sends through the bootstrap: first where it runs (and, from rank 0, the
// segment's name), then its GPU.
struct JoinRecord {
  char host[kNameBytes];
  char segment[kNameBytes];
  char problem[kProblemBytes];
  std::int32_t shared_gpu_allowed;
};
struct DeviceRecord {
  char gpu[kNameBytes];
  char pci[kNameBytes];
  char problem[kProblemBytes];
};

// The third: the group's layout as this rank computes it, or why its options give none.
struct LayoutRecord {
  P2pLayout layout;
  char problem[kProblemBytes];
};
static_assert(std::is_trivially_copyable_v<LayoutRecord>);

std::string host_name() {
  char name[kNameBytes] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "(unknown host)";
  return name;
}

bool shared_gpu_allowed() { return setting_flag("LMOE_P2P_SHARED_GPU"); }

}  // namespace

std::shared_ptr<Communicator> make_p2p_process_communicator(Communicator& bootstrap,
                                                            const P2pOptions& options) {
  const int rank = bootstrap.rank(), size = bootstrap.size();
  LMOE_CHECK(size >= 1 && size <= cuda::kP2pMaxRanks, "p2p: number of ranks must be in [1, " +
                                                          std::to_string(cuda::kP2pMaxRanks) +
                                                          "], got " + std::to_string(size));
  // 1. Rank 0 creates the segment; every rank learns its name and where every rank runs.
  SharedSegment segment;
  JoinRecord mine{};
  put(mine.host, host_name());
  mine.shared_gpu_allowed = shared_gpu_allowed() ? 1 : 0;
  if (rank == 0) {
    try {
      segment = SharedSegment::create(P2pProcessGroup::segment_bytes());
      put(mine.segment, segment.name());
    } catch (const Error& error) {
      put(mine.problem, error.message());
    }
  }
  std::vector<JoinRecord> joined(static_cast<std::size_t>(size));
  bootstrap.control_all_gather(&mine, joined.data(), sizeof(JoinRecord));
  std::string problem = get(joined[0].problem);
  int local_index = 0;
  bool allow_sharing = true;
  for (int r = 0; r < size; ++r) {
    const JoinRecord& record = joined[static_cast<std::size_t>(r)];
    allow_sharing = allow_sharing && record.shared_gpu_allowed;
    if (problem.empty() && get(record.host) != get(joined[0].host)) {
      problem = "rank " + std::to_string(r) + " runs on " + get(record.host) + ", rank 0 on " +
                get(joined[0].host) +
                ": p2p joins the processes of one node (CUDA IPC); use the nccl communicator "
                "across nodes";
    }
    if (r < rank && get(record.host) == get(joined[static_cast<std::size_t>(rank)].host))
      ++local_index;
  }
  if (!problem.empty()) throw Error("p2p: " + problem);

  // 2. Every rank opens the segment and picks its GPU.
  DeviceRecord device_record{};
  int device = 0;
  {
    std::string trouble;
    try {
      if (rank != 0)
        segment = SharedSegment::open(get(joined[0].segment), P2pProcessGroup::segment_bytes());
      int visible = 0;
      LMOE_CUDA_CHECK(cudaGetDeviceCount(&visible));
      if (!options.devices.empty()) {
        LMOE_CHECK(static_cast<int>(options.devices.size()) == size,
                   "devices has " + std::to_string(options.devices.size()) +
                       " entries, expected one per rank (" + std::to_string(size) + ")");
        device = options.devices[static_cast<std::size_t>(rank)];
      } else {
        LMOE_CHECK(visible > 0, "no CUDA GPU is visible");
        device = local_index % visible;
      }
      LMOE_CHECK(device >= 0 && device < visible, "device " + std::to_string(device) +
                                                      " is not visible (" +
                                                      std::to_string(visible) + " GPUs)");
      put(device_record.gpu, gpu_id(device));
      put(device_record.pci, pci_bus_id(device));
    } catch (const Error& error) {
      trouble = error.message();
    }
    put(device_record.problem, trouble);
  }
  std::vector<DeviceRecord> devices(static_cast<std::size_t>(size));
  bootstrap.control_all_gather(&device_record, devices.data(), sizeof(DeviceRecord));
  std::vector<std::string> gpu_ids;
  bool shared_gpu = false;
  for (const DeviceRecord& record : devices) {
    if (*record.problem)
      throw Error("p2p: rank " + std::to_string(&record - devices.data()) + ": " +
                  get(record.problem));
  }
  for (int r = 0; r < size; ++r) {
    const DeviceRecord& record = devices[static_cast<std::size_t>(r)];
    gpu_ids.push_back(get(record.gpu));
    for (int earlier = 0; earlier < r; ++earlier) {
      if (gpu_ids[static_cast<std::size_t>(earlier)] != gpu_ids.back()) continue;
      shared_gpu = true;
      if (!allow_sharing) {
        throw Error("p2p: ranks " + std::to_string(earlier) + " and " + std::to_string(r) +
                    " share GPU " + get(record.pci) +
                    ", where their rounds can stall (docs/p2p.md); set LMOE_P2P_SHARED_GPU=1 "
                    "on every rank to run it anyway");
      }
    }
  }
  // Every rank has opened the segment: its name can go (nothing is left in /dev/shm after a crash).
  if (rank == 0) segment.unlink();
  // 3. The layouts compared. Every rank computed its own from its options and environment: the
  // workspaces are sized from it and blocks pair by index, so the ranks compare them before
  // anything is allocated. A rank whose options give no layout says why in the same exchange, so
  // that no rank is left waiting in it.
  LayoutRecord layout_record{};
  try {
    layout_record.layout = p2p_layout(options, shared_gpu);
  } catch (const Error& error) {
    put(layout_record.problem, error.message());
  }
  std::vector<LayoutRecord> layout_records(static_cast<std::size_t>(size));
  bootstrap.control_all_gather(&layout_record, layout_records.data(), sizeof(LayoutRecord));
  std::vector<P2pLayout> layouts;
  for (const LayoutRecord& record : layout_records) {
    std::string why = get(record.problem);
    if (why.rfind("p2p: ", 0) == 0) why.erase(0, 5);
    if (!why.empty())
      throw Error("p2p: rank " + std::to_string(&record - layout_records.data()) + ": " + why);
    layouts.push_back(record.layout);
  }
  if (const std::string disagreement = p2p_layout_disagreement(layouts); !disagreement.empty())
    throw Error(disagreement);
  const P2pLayout layout = layouts[static_cast<std::size_t>(rank)];

  // 4. Workspaces exported and opened over the segment's control path (bounded from here on).
  auto group = std::make_shared<P2pProcessGroup>(rank, size, layout, device, std::move(gpu_ids),
                                                 std::move(segment));
  group->join();
  return make_p2p_communicator(group, rank);
}

namespace {

// The bootstrap of processes started without MPI: a small segment of its own whose name rank 0
// hands the others through a launch record file. Carries only the control path.
class SegmentBootstrap final : public Communicator {
 public:
  SegmentBootstrap(SharedSegment segment, int rank, int size, std::chrono::milliseconds timeout)
      : segment_(std::move(segment)),
        rank_(rank),
        size_(size),
        control_(segment_.data() + kAbortWordBytes,
                 reinterpret_cast<std::int32_t*>(segment_.data()), rank, size, timeout) {}
  static std::size_t segment_bytes() { return kAbortWordBytes + SharedControl::bytes(); }
  void unlink() { segment_.unlink(); }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend_name() const override { return "p2p-bootstrap"; }
  MemorySpace memory_space() const override { return MemorySpace::host; }
  void all_reduce(const void*, void*, std::size_t, DType, StreamHandle) override {
    unsupported("all_reduce");
  }
  void reduce_scatter(const void*, void*, std::span<const std::size_t>, DType,
                      StreamHandle) override {
    unsupported("reduce_scatter");
  }
  void all_gather(const void*, void*, std::span<const std::size_t>, DType, StreamHandle) override {
    unsupported("all_gather");
  }
  void control_all_gather(const void* send, void* recv, std::size_t bytes) override {
    control_.all_gather(send, recv, bytes, "p2p setup");
  }
  void barrier() override { control_.barrier("p2p setup"); }
  void abort(const std::string& why) override { control_.abort(why); }

 private:
  static constexpr std::size_t kAbortWordBytes = 64;
  [[noreturn]] static void unsupported(const char* operation) {
    throw Error(std::string("p2p setup: ") + operation +
                " is not available on the bootstrap channel");
  }

  SharedSegment segment_;
  int rank_, size_;
  SharedControl control_;
};

// Removes the launch record when setup ends, whichever way (rank 0 only).
struct RecordRemover {
  std::optional<std::string> path;
  ~RecordRemover() {
    if (path) remove_launch_record(*path);
  }
};

}  // namespace

std::shared_ptr<Communicator> make_p2p_env_communicator(const P2pOptions& options) {
  const EnvLookup env = process_environment();
  const std::optional<LaunchRank> launch = launch_rank_from_env(env);
  if (!launch) {
    throw Error(
        "p2p: RANK and WORLD_SIZE are not set: start one process per rank with torchrun (or under "
        "mpirun with make_p2p_mpi_communicator)");
  }
  const int rank = launch->rank, size = launch->world_size;
  // Processes start at their own pace: the wait for the others is setup's, not a round's. Only the
  // timeout matters here: bad blocks are refused in setup, on every rank alike.
  P2pOptions timing = options;
  timing.blocks = 0;
  const std::chrono::milliseconds startup = p2p_setup_timeout(p2p_layout(timing, false));
  SharedSegment segment;
  RecordRemover remover;
  if (rank == 0) {
    segment = SharedSegment::create(SegmentBootstrap::segment_bytes());
    if (size > 1) {
      const std::optional<std::string> path = setting_text("LMOE_P2P_ID_FILE", env);
      if (!path || path->empty()) {
        throw Error("p2p: LMOE_P2P_ID_FILE is not set: with WORLD_SIZE=" + std::to_string(size) +
                    ", rank 0 hands the others the name of its shared memory through a file; set "
                    "it to a fresh "
                    "path on this node");
      }
      char name[kNameBytes];
      put(name, segment.name());
      publish_launch_record(*path, size, std::as_bytes(std::span(name)));
      remover.path = path;
    }
  } else {
    const std::optional<std::string> path = setting_text("LMOE_P2P_ID_FILE", env);
    if (!path || path->empty()) {
      throw Error("p2p: rank " + std::to_string(rank) +
                  ": LMOE_P2P_ID_FILE is not set (it must name the file "
                  "rank 0 writes)");
    }
    std::vector<std::byte> record;
    try {
      record = await_launch_record(*path, size, kNameBytes, startup);
    } catch (const Error& error) {
      throw Error("p2p: rank " + std::to_string(rank) + ": LMOE_P2P_ID_FILE: " + error.message());
    }
    char name[kNameBytes];
    std::memcpy(name, record.data(), kNameBytes);
    name[kNameBytes - 1] = '\0';
    segment = SharedSegment::open(name, SegmentBootstrap::segment_bytes());
  }
  SegmentBootstrap bootstrap(std::move(segment), rank, size, startup);
  // Every rank has opened the bootstrap segment once the first exchange is done; its name, and the
  // record that carried it, can go as soon as the group exists (or setup has failed).
  auto comm = make_p2p_process_communicator(bootstrap, options);
  if (rank == 0) bootstrap.unlink();
  return comm;
}

std::shared_ptr<Communicator> make_p2p_mpi_communicator(const P2pOptions& options) {
  const std::shared_ptr<Communicator> bootstrap = make_mpi_communicator();
  return make_p2p_process_communicator(*bootstrap, options);
}

}  // namespace lmoe

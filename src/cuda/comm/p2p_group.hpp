// The state a p2p group shares, whatever its ranks are: threads of one process
// (p2p_communicator.cpp) or one process per rank exchanging CUDA IPC handles (p2p_process.cpp).
// The communicator of a rank (P2pCommunicator) talks to its group only through this interface:
// the rounds' device handle, the status records, and a bounded host control path. Internal to the
// CUDA backend.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cuda/comm/p2p_types.hpp"
#include "lmoe/communicator.hpp"
#include "lmoe/p2p_communicator.hpp"

namespace lmoe {

// Host-mapped memory: the rounds write their status here and read the abort flag; the host reads
// the records and raises the flag without any CUDA call (so never behind a spinning kernel).
struct P2pMappedStatus {
  cuda::P2pStatus status[cuda::kP2pMaxRanks];
  std::int32_t abort_flag;
};

// What every rank's buffer of one shared allocation is, as this process's kernels address it.
// Destroying it releases this rank's part (threads: frees it; processes: closes the peers' IPC
// mappings and hands its own allocation back to the group, freed at the group's teardown).
class P2pSharedBuffer {
 public:
  virtual ~P2pSharedBuffer() = default;
  std::byte* base(int rank) const { return bases_[static_cast<std::size_t>(rank)]; }

 protected:
  std::vector<std::byte*> bases_;  // one per rank
};

// Grid and staging sizes of a group, the same on every rank.
struct P2pLayout {
  int blocks = 0;
  std::size_t block_bytes = 0;
  std::chrono::milliseconds timeout{0};
};
// From the options (defaults resolved): blocks 32, or 16 when ranks share a GPU.
P2pLayout p2p_layout(const P2pOptions& options, bool shared_gpu);
// Empty when every rank's layout (layouts[r] is rank r's) is the same; else an error message naming
// each field that differs and every rank's value of it. Ranks of processes compute their layouts
// apart, from their own options and environment, and a rank whose regions or grid differ from its
// peers' would read past their regions or pair blocks that stage other slices.
std::string p2p_layout_disagreement(std::span<const P2pLayout> layouts);

// "all_reduce of 4096 bf16 elements": what a round's tag (p2p_round_tag) says its rank ran, for
// failure messages.
std::string describe_p2p_collective(std::uint32_t tag);

// How long a wait for a peer lasts where the options set no timeout: LMOE_P2P_TIMEOUT_MS, or 10 s.
std::chrono::milliseconds p2p_default_timeout();

// The failure rank `rank`'s status record holds, as an error's text (timeout: the bound its waits
// had); "" for none and for an abort, the consequence of a failure that has a record of its own.
std::string p2p_failure_text(int rank, const volatile cuda::P2pStatus& status,
                             std::chrono::milliseconds timeout);

// Bytes of one rank's workspace: its flags, then its [parity][block] staging regions.
std::size_t p2p_flags_bytes();
std::size_t p2p_workspace_bytes(const P2pLayout& layout);

class P2pGroup {
 public:
  virtual ~P2pGroup() = default;
  P2pGroup(const P2pGroup&) = delete;
  P2pGroup& operator=(const P2pGroup&) = delete;

  int size() const { return size_; }
  int blocks() const { return layout_.blocks; }
  std::size_t block_bytes() const { return layout_.block_bytes; }
  std::chrono::milliseconds timeout() const { return layout_.timeout; }
  // The CUDA device (in this process) of a rank this process drives.
  int device(int rank) const { return devices_[static_cast<std::size_t>(rank)]; }
  // Ranks of the group on the same physical GPU as `rank`, itself included.
  int ranks_on_gpu_of(int rank) const;

  cuda::P2pDeviceHandle handle(int rank) const;
  // The first device-side failure in the group, as a message; empty when there is none.
  std::string device_failure() const;
  // Where every rank's blocks are, for a failure message (LMOE_P2P_DIAGNOSE).
  std::string block_progress();
  // Raises the device-visible abort flag: rounds in flight stop spinning, later rounds fail at
  // once.
  void raise_abort();

  // The host control path, bounded by timeout(): waits for every rank, or throws
  // CommunicatorAborted (after aborting the group when the peers did not come in time).
  virtual void barrier(int rank, const char* operation) = 0;
  // Makes every pending and future host wait of the group throw CommunicatorAborted with `why`.
  virtual void abort_host(int rank, const std::string& why) = 0;
  // recv[r · bytes, (r + 1) · bytes) = rank r's `bytes` bytes of send.
  virtual void control_all_gather(int rank, const void* send, void* recv, std::size_t bytes) = 0;
  // Collective: every rank allocates `bytes` (its own size) of zeroed device memory on its GPU, and
  // learns every rank's address as its kernels can use it.
  virtual std::unique_ptr<P2pSharedBuffer> share_buffer(int rank, std::size_t bytes) = 0;

 protected:
  P2pGroup(int size, P2pLayout layout) : size_(size), layout_(layout) {}

  const int size_;
  P2pLayout layout_;
  // Filled by the derived group.
  std::vector<int> devices_;  // per rank: its CUDA device here (-1: a rank of another process)
  std::vector<std::string> gpu_ids_;   // per rank: its physical GPU (equal strings: the same GPU)
  P2pMappedStatus* mapped_ = nullptr;  // host address
  P2pMappedStatus* mapped_device_ = nullptr;  // the same memory as kernels address it
  std::vector<std::byte*>
      data_;  // per rank: its staging regions, as this process's kernels see them
  std::vector<cuda::P2pFlags*> flags_;  // per rank: its flags, likewise
};

// A rank's communicator over its group. Throws lmoe::Error for a rank outside the group.
std::shared_ptr<Communicator> make_p2p_communicator(std::shared_ptr<P2pGroup> group, int rank);

}  // namespace lmoe

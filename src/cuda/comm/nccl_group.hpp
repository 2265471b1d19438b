// The NCCL communicators of the ranks that fail together (every rank of a thread group, or this
// process's one rank), from creation to destruction or abort, with every host wait bounded.
//
// Every NCCL communicator here is nonblocking (ncclConfig_t::blocking = 0): a call returns at once,
// possibly with ncclInProgress while NCCL completes it in the background, and the host then polls
// ncclCommGetAsyncError until the state is ncclSuccess, an error, the group's abort, or a deadline.
// So no host wait is unbounded, and a communicator can be aborted at any point, which NCCL allows
// only for nonblocking communicators and only while no other call on it runs: every call on a
// member is made under the member's mutex. Aborting the group aborts every member with
// ncclCommAbort, so that a peer's kernel waiting for the failed rank ends instead of spinning.
// (Built with CUDA and NCCL only.)
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comm/host_barrier.hpp"

namespace lmoe {

// "ncclAllReduce failed: invalid argument (<NCCL's last error message>)"
std::string nccl_failure(const std::string& call, ncclResult_t status, ncclComm_t comm = nullptr);

// Throws lmoe::Error with nccl_failure() unless the call succeeded (ncclInProgress is a failure
// here: for calls that do not involve a communicator).
void check_nccl(ncclResult_t status, const char* call);

// Makes `device` current for a scope and restores the caller's device after: creation, abort and
// teardown may run on any thread, whose own current device must not change under it.
class DeviceScope {
 public:
  explicit DeviceScope(int device) noexcept {
    if (cudaGetDevice(&saved_) != cudaSuccess) saved_ = -1;
    ok_ = cudaSetDevice(device) == cudaSuccess;
  }
  ~DeviceScope() {
    if (saved_ >= 0) cudaSetDevice(saved_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  bool ok() const { return ok_; }

 private:
  int saved_ = -1;
  bool ok_ = false;
};

// One rank's NCCL communicator and the lock every call on it holds.
struct NcclMember {
  int rank = 0;
  int device = 0;
  std::mutex mutex;
  ncclComm_t comm = nullptr;  // null before init and once destroyed or aborted
};

class NcclGroup {
 public:
  // `size` ranks in all; `members` are the ranks (and their devices) this object drives. A thread
  // group also gets a host barrier and control slots for its ranks.
  NcclGroup(int size, const std::vector<std::pair<int, int>>& rank_devices,
            std::chrono::milliseconds timeout, bool thread_group);
  // Finalizes every member (all first, then waits: they synchronize with each other) and destroys
  // them; a member that does not finish within the timeout, or an aborted group, is aborted
  // instead.
  ~NcclGroup();
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

  int size() const { return size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  NcclMember& member(std::size_t index) { return *members_[index]; }
  std::size_t num_members() const { return members_.size(); }

  // Creates every member's communicator for `id` in one NCCL group call and waits until all are
  // ready.
  void init(const ncclUniqueId& id);

  // Makes one NCCL call (or a group of them) on the member under its lock and waits until NCCL has
  // taken it (its kernels are on their streams).
  void run(NcclMember& member, const std::string& what,
           const std::function<ncclResult_t(ncclComm_t)>& call);

  // Waits until the work on `stream` has finished, watching the member's communicator for errors.
  void wait_stream(NcclMember& member, cudaStream_t stream, const std::string& what);

  // Records `why` (the first reason wins), wakes the host barrier's waiters and aborts every
  // member's NCCL communicator. Later calls throw CommunicatorAborted carrying the reason.
  void abort(int rank, const std::string& why);
  bool aborted() const { return aborted_.load(); }
  void throw_if_aborted() const;

  // Aborts the group with `message` and throws it as this rank's own error (the root cause).
  [[noreturn]] void fail(int rank, const std::string& message);

  // Thread groups only: the bounded host barrier, and a host pointer slot per rank.
  void host_barrier(int rank, const char* operation);
  const void*& control_slot(int rank) { return control_slots_[static_cast<std::size_t>(rank)]; }

 private:
  // What a poll found besides the communicator's own state.
  struct Progress {
    bool done = true;
    std::string error;  // non-empty: failed
  };
  void poll(NcclMember& member, const std::string& what, const std::function<Progress()>& progress);
  void abort_member(NcclMember& member) noexcept;

  const int size_;
  const std::chrono::milliseconds timeout_;
  std::vector<std::unique_ptr<NcclMember>> members_;
  std::optional<HostBarrier> barrier_;
  std::vector<const void*> control_slots_;
  std::atomic<bool> aborted_{false};
  mutable std::mutex reason_mutex_;
  std::string reason_;
};

}  // namespace lmoe

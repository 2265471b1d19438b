#include "cuda/comm/nccl_group.hpp"

#include <cstdio>
#include <cstdlib>
#include <thread>

#include "comm/aborted_error.hpp"
#include "cuda/comm/nccl_settings.hpp"
#include "lmoe/error.hpp"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 18, 0)
#error \
    "lmoe's nccl communicator needs NCCL 2.18 or newer (nonblocking communicators, ncclCommFinalize)"
#endif

namespace lmoe {

namespace {

using Clock = std::chrono::steady_clock;

// Spins briefly (NCCL usually answers within microseconds), then sleeps up to a millisecond.
void pause(int round) {
  if (round < 64) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(std::min(1000, 10 * (round - 63))));
  }
}

std::string milliseconds(std::chrono::milliseconds timeout) {
  return std::to_string(timeout.count()) + " ms";
}

std::mutex g_settings_mutex;
std::optional<std::string> g_graph_mixing;  // set at the process's first NCCL communicator

}  // namespace

void note_nccl_first_init() {
  const std::lock_guard lock(g_settings_mutex);
  if (g_graph_mixing) return;
  const char* value = std::getenv("NCCL_GRAPH_MIXING_SUPPORT");
  g_graph_mixing = value != nullptr && *value != '\0' ? std::string(value) : std::string("1");
}

std::optional<std::string> nccl_graph_mixing_in_effect() {
  const std::lock_guard lock(g_settings_mutex);
  return g_graph_mixing;
}

std::string nccl_failure(const std::string& call, ncclResult_t status, ncclComm_t comm) {
  std::string message = call + " failed: " + ncclGetErrorString(status);
  const char* detail = ncclGetLastError(comm);
  if (detail != nullptr && *detail != '\0') message += " (" + std::string(detail) + ")";
  return message;
}

void check_nccl(ncclResult_t status, const char* call) {
  if (status != ncclSuccess) throw Error(nccl_failure(call, status));
}

NcclGroup::NcclGroup(int size, const std::vector<std::pair<int, int>>& rank_devices,
                     std::chrono::milliseconds timeout, bool thread_group)
    : size_(size), timeout_(timeout) {
  for (const auto& [rank, device] : rank_devices) {
    members_.push_back(std::make_unique<NcclMember>());
    members_.back()->rank = rank;
    members_.back()->device = device;
  }
  if (thread_group) {
    barrier_.emplace(size, timeout);
    control_slots_.assign(static_cast<std::size_t>(size), nullptr);
  }
}

NcclGroup::~NcclGroup() {
  const auto deadline = Clock::now() + timeout_;
  bool clean = !aborted();
  for (auto& member : members_) {
    if (!member->comm) continue;
    const DeviceScope scope(member->device);
    const ncclResult_t status = ncclCommFinalize(member->comm);
    if (status != ncclSuccess && status != ncclInProgress) {
      std::fprintf(stderr, "lmoe: nccl: rank %d: %s\n", member->rank,
                   nccl_failure("ncclCommFinalize", status, member->comm).c_str());
      clean = false;
    }
  }
  for (int round = 0; clean; ++round) {
    bool pending = false;
    for (auto& member : members_) {
      if (!member->comm) continue;
      ncclResult_t state = ncclSuccess;
      const ncclResult_t status = ncclCommGetAsyncError(member->comm, &state);
      if (status != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
        std::fprintf(
            stderr, "lmoe: nccl: rank %d: %s\n", member->rank,
            nccl_failure("ncclCommFinalize", status != ncclSuccess ? status : state, member->comm)
                .c_str());
        clean = false;
      }
      pending = pending || state == ncclInProgress;
    }
    if (!pending) break;
    if (Clock::now() >= deadline) {
      std::fprintf(stderr,
                   "lmoe: nccl: finalizing the communicators took more than %s (a rank gone?); "
                   "aborting them\n",
                   milliseconds(timeout_).c_str());
      clean = false;
    }
    pause(round);
  }
  for (auto& member : members_) {
    if (!member->comm) continue;
    if (!clean) {
      abort_member(*member);
      continue;
    }
    const DeviceScope scope(member->device);
    const ncclResult_t status = ncclCommDestroy(member->comm);
    if (status != ncclSuccess) {
      std::fprintf(stderr, "lmoe: nccl: rank %d: %s\n", member->rank,
                   nccl_failure("ncclCommDestroy", status, member->comm).c_str());
    }
    member->comm = nullptr;
  }
}

void NcclGroup::init(const ncclUniqueId& id) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  std::string failure;
  {
    // One group call, so that NCCL joins this thread's members concurrently (as ncclCommInitAll
    // does).
    const DeviceScope restore_device(members_.front()->device);
    note_nccl_first_init();
    check_nccl(ncclGroupStart(), "ncclGroupStart");
    for (auto& member : members_) {
      const std::lock_guard lock(member->mutex);
      if (cudaSetDevice(member->device) != cudaSuccess) {
        failure = "cudaSetDevice(" + std::to_string(member->device) + ") failed for rank " +
                  std::to_string(member->rank);
        cudaGetLastError();
        break;
      }
      const ncclResult_t status =
          ncclCommInitRankConfig(&member->comm, size_, id, member->rank, &config);
      if (status != ncclSuccess && status != ncclInProgress) {
        failure = "rank " + std::to_string(member->rank) + ": " +
                  nccl_failure("ncclCommInitRankConfig", status, member->comm);
        break;
      }
    }
    const ncclResult_t end = ncclGroupEnd();
    if (failure.empty() && end != ncclSuccess && end != ncclInProgress)
      failure = nccl_failure("ncclGroupEnd", end);
  }
  if (!failure.empty())
    fail(members_.front()->rank, "nccl: creating the communicators: " + failure);
  for (auto& member : members_)
    poll(*member, "ncclCommInitRankConfig (creating the communicator)", nullptr);
}

void NcclGroup::run(NcclMember& member, const std::string& what,
                    const std::function<ncclResult_t(ncclComm_t)>& call) {
  std::string failure;
  {
    const std::lock_guard lock(member.mutex);
    throw_if_aborted();
    if (!member.comm)
      throw Error("rank " + std::to_string(member.rank) + ": " + what +
                  ": the NCCL communicator is closed");
    const ncclResult_t status = call(member.comm);
    if (status != ncclSuccess && status != ncclInProgress)
      failure = nccl_failure(what, status, member.comm);
  }
  // Even an invalid argument (which NCCL says left the communicator usable) fails the group: the
  // peers have made their matching calls and would wait for this rank's forever.
  if (!failure.empty()) fail(member.rank, "rank " + std::to_string(member.rank) + ": " + failure);
  poll(member, what, nullptr);
}

void NcclGroup::wait_stream(NcclMember& member, cudaStream_t stream, const std::string& what) {
  poll(member, what, [stream] {
    const cudaError_t status = cudaStreamQuery(stream);
    if (status == cudaSuccess) return Progress{true, {}};
    if (status == cudaErrorNotReady) return Progress{false, {}};
    cudaGetLastError();
    return Progress{false, std::string("cudaStreamQuery failed: ") + cudaGetErrorName(status) +
                               " (" + cudaGetErrorString(status) + ")"};
  });
}

void NcclGroup::poll(NcclMember& member, const std::string& what,
                     const std::function<Progress()>& progress) {
  const auto deadline = Clock::now() + timeout_;
  const std::string who = "rank " + std::to_string(member.rank) + ": ";
  for (int round = 0;; ++round) {
    std::string failure;
    {
      const std::lock_guard lock(member.mutex);
      throw_if_aborted();
      if (!member.comm) throw Error(who + what + ": the NCCL communicator is closed");
      ncclResult_t state = ncclSuccess;
      const ncclResult_t status = ncclCommGetAsyncError(member.comm, &state);
      if (status != ncclSuccess) {
        failure = nccl_failure("ncclCommGetAsyncError", status, member.comm);
      } else if (state != ncclSuccess && state != ncclInProgress) {
        failure = nccl_failure(what, state, member.comm);
      } else if (state == ncclSuccess) {
        const Progress now = progress ? progress() : Progress{};
        if (!now.error.empty()) {
          failure = what + ": " + now.error;
        } else if (now.done) {
          return;
        }
      }
    }
    if (!failure.empty()) fail(member.rank, who + failure);
    if (Clock::now() >= deadline) {
      fail(member.rank, who + what + " did not complete within " + milliseconds(timeout_) +
                            " (a rank missing, or one that stopped calling the collectives?)");
    }
    pause(round);
  }
}

void NcclGroup::abort(int rank, const std::string& why) {
  {
    const std::lock_guard lock(reason_mutex_);
    if (!aborted_.load()) {
      reason_ = "communicator aborted by rank " + std::to_string(rank) + ": " + why;
      aborted_.store(true);
    }
  }
  if (barrier_) barrier_->abort(rank, why);
  for (auto& member : members_) abort_member(*member);
}

void NcclGroup::abort_member(NcclMember& member) noexcept {
  const std::lock_guard lock(member.mutex);
  if (!member.comm) return;
  const DeviceScope scope(member.device);
  const ncclResult_t status = ncclCommAbort(member.comm);
  if (status != ncclSuccess) {
    std::fprintf(stderr, "lmoe: nccl: rank %d: %s\n", member.rank,
                 nccl_failure("ncclCommAbort", status).c_str());
  }
  member.comm = nullptr;
}

void NcclGroup::throw_if_aborted() const {
  if (!aborted_.load()) return;
  const std::lock_guard lock(reason_mutex_);
  throw CommunicatorAborted(reason_);
}

void NcclGroup::fail(int rank, const std::string& message) {
  abort(rank, message);
  throw Error(message);
}

void NcclGroup::host_barrier(int rank, const char* operation) {
  try {
    barrier_->arrive_and_wait(rank, operation);
  } catch (const CommunicatorAborted& aborted) {
    // A barrier that timed out aborted itself only: take the NCCL communicators down with it, so
    // that no peer's kernel is left waiting (a no-op when the group was aborted already). Its
    // message already says "communicator aborted by rank N: "; the reason is what follows.
    const std::string& message = aborted.message();
    const std::size_t colon = message.find(": ");
    abort(rank, colon == std::string::npos ? message : message.substr(colon + 2));
    throw;
  }
}

}  // namespace lmoe

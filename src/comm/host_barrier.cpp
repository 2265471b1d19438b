#include "comm/host_barrier.hpp"

#include "comm/aborted_error.hpp"

namespace lmoe {

void HostBarrier::arrive_and_wait(int rank, const char* operation) {
  std::unique_lock lock(mutex_);
  throw_if_aborted();
  const std::uint64_t generation = generation_;
  if (++arrived_ == size_) {
    arrived_ = 0;
    ++generation_;
    changed_.notify_all();
    return;
  }
  const bool released =
      changed_.wait_for(lock, timeout_, [&] { return generation_ != generation || aborted_; });
  if (!released) {
    abort_locked(rank, "rank " + std::to_string(rank) + " waited more than " +
                           std::to_string(timeout_.count()) + " ms for its peers in " + operation);
  }
  throw_if_aborted();
}

void HostBarrier::abort(int rank, const std::string& why) {
  std::lock_guard lock(mutex_);
  abort_locked(rank, why);
}

void HostBarrier::abort_locked(int rank, const std::string& why) {
  if (!aborted_) {
    aborted_ = true;
    abort_reason_ = "communicator aborted by rank " + std::to_string(rank) + ": " + why;
  }
  changed_.notify_all();
}

void HostBarrier::throw_if_aborted() const {
  if (aborted_) throw CommunicatorAborted(abort_reason_);
}

}  // namespace lmoe

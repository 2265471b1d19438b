// A barrier for ranks that are threads of one process, bounded in time and abortable: the
// synchronization under the `threads` and `cuda-threads` communicators.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>

namespace lmoe {

class HostBarrier {
 public:
  HostBarrier(int size, std::chrono::milliseconds timeout) : size_(size), timeout_(timeout) {}

  int size() const { return size_; }

  // Waits until all `size` ranks have arrived. Throws CommunicatorAborted if the group is aborted
  // while waiting; when the peers do not arrive within the timeout, aborts the group itself (so
  // that every waiting rank fails instead of hanging) and throws.
  void arrive_and_wait(int rank, const char* operation);

  // Makes every pending and future wait throw CommunicatorAborted carrying `why`.
  void abort(int rank, const std::string& why);

 private:
  void abort_locked(int rank, const std::string& why);
  void throw_if_aborted() const;

  const int size_;
  const std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable changed_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  bool aborted_ = false;
  std::string abort_reason_;
};

}  // namespace lmoe

// A POSIX shared-memory segment that the processes of one node map (shm_open + mmap), and a
// bounded, abortable barrier and all-gather over it: the host control path of the p2p
// communicator between processes. Plain host code.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace lmoe {

class SharedSegment {
 public:
  // Creates a segment of `bytes` (zeroed) under a fresh name (creator), or opens `name`. A page
  // before data() records the creator's pid and `bytes`; open refuses a segment of another owner
  // (uid), one made for another size, or one whose creator has exited (left by an earlier run).
  static SharedSegment create(std::size_t bytes);
  static SharedSegment open(const std::string& name, std::size_t bytes);
  SharedSegment() = default;
  ~SharedSegment();
  SharedSegment(SharedSegment&& other) noexcept;
  SharedSegment& operator=(SharedSegment&& other) noexcept;
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;

  const std::string& name() const { return name_; }
  std::byte* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  // Removes the name (the mappings stay valid): once every process has opened the segment, so
  // that nothing is left behind in /dev/shm whatever happens later. The creator does it at
  // destruction at the latest.
  void unlink() noexcept;

 private:
  std::string name_;
  std::byte* data_ = nullptr;
  std::size_t bytes_ = 0;
  bool owns_name_ = false;
};

// The control block of a group of `size` processes, in a segment they all map. Waits poll shared
// counters against a deadline and an abort word (the same word the p2p rounds read on the GPU).
class SharedControl {
 public:
  static constexpr int kMaxRanks = 16;
  static constexpr std::size_t kSlotBytes = 16384;  // all_gather moves larger records in pieces
  static constexpr std::size_t kReasonBytes = 1024;
  struct Block {
    std::uint64_t arrived[kMaxRanks];  // barriers each rank has entered
    std::uint32_t leaving[kMaxRanks];  // teardown phases each rank has reached (1, 2)
    std::uint32_t reason_state;        // 0: no reason, 1: being written, 2: written
    char reason[kReasonBytes];
    std::byte slots[kMaxRanks][kSlotBytes];
  };
  static std::size_t bytes() { return sizeof(Block); }

  // `block` lies in the segment; `abort_word` is the group's abort flag (also in the segment).
  SharedControl(void* block, std::int32_t* abort_word, int rank, int size,
                std::chrono::milliseconds timeout)
      : block_(static_cast<Block*>(block)),
        abort_word_(abort_word),
        rank_(rank),
        size_(size),
        timeout_(timeout) {}

  // The bound of every later wait (setup allows more than the collectives' timeout).
  void set_timeout(std::chrono::milliseconds timeout) { timeout_ = timeout; }

  // Throws CommunicatorAborted when the group is aborted while waiting; a peer missing past the
  // timeout aborts the group (naming it and `operation`) and throws.
  void barrier(const char* operation);
  // recv[r · bytes, (r + 1) · bytes) = rank r's send; every rank passes the same `bytes`.
  void all_gather(const void* send, void* recv, std::size_t bytes, const char* operation);
  // Records `why` (the first reason wins) and raises the abort word.
  void abort(const std::string& why);
  bool aborted() const;
  // The recorded reason of an abort ("communicator aborted by rank r: …").
  std::string abort_reason() const;
  // A one-shot barrier for teardown, phase 1 then 2, that ignores aborts (the group is going away
  // either way): false when a peer did not reach the phase within the timeout.
  bool teardown_barrier(std::uint32_t phase);

 private:
  [[noreturn]] void throw_aborted() const;

  Block* block_;
  std::int32_t* abort_word_;
  int rank_, size_;
  std::chrono::milliseconds timeout_;
  std::uint64_t barriers_ = 0;  // this rank's barriers so far
};

}  // namespace lmoe

#include "comm/shared_segment.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>
#include <thread>
#include <utility>

#include "comm/aborted_error.hpp"
#include "comm/process_liveness.hpp"
#include "lmoe/error.hpp"

namespace lmoe {

namespace {

using Clock = std::chrono::steady_clock;

std::string system_error(const std::string& what, const std::string& name) {
  return what + " '" + name + "': " + std::strerror(errno);
}

// The segment's first page: who made it and for what size, checked by every rank that opens it.
// The data follow on the next page, so that data() stays page aligned (cudaHostRegister).
struct SegmentRecord {
  char tag[16];
  std::uint64_t bytes;  // what the creator asked for, after this page
  std::int64_t creator_pid;
  std::uint64_t creator_pid_namespace;  // 0: unknown
};
constexpr char kSegmentTag[16] = "lmoe-segment-v1";

std::size_t record_bytes() { return static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)); }

std::byte* map(int fd, std::size_t bytes, const std::string& name) {
  void* address = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (address == MAP_FAILED) {
    const std::string message = system_error("mmap of shared memory", name);
    ::close(fd);
    throw Error(message);
  }
  ::close(fd);  // the mapping keeps the segment
  return static_cast<std::byte*>(address);
}

// Spins briefly, then sleeps: waits are on the host path (setup, barriers), not per collective.
void pause(int round) {
  if (round < 64) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

template <class T>
std::atomic_ref<T> shared(T& value) {
  return std::atomic_ref<T>(value);
}

// Waits until every rank's counter has reached `target`, or until `give_up()` (checked between
// polls) says to stop: the rank it gave up waiting for, or -1 when all arrived.
template <class T, class GiveUp>
int wait_for_ranks(T* counters, int size, T target, const GiveUp& give_up) {
  for (int peer = 0, round = 0; peer < size; ++round) {
    if (shared(counters[peer]).load(std::memory_order_acquire) >= target) {
      ++peer;
      continue;
    }
    if (give_up()) return peer;
    pause(round);
  }
  return -1;
}

}  // namespace

SharedSegment SharedSegment::create(std::size_t bytes) {
  static std::atomic<unsigned> counter{0};
  std::random_device random;
  SharedSegment segment;
  segment.name_ = "/lmoe-p2p-" + std::to_string(::getpid()) + "-" + std::to_string(counter++) +
                  "-" + std::to_string(random());
  const int fd = ::shm_open(segment.name_.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) throw Error(system_error("shm_open (create)", segment.name_));
  segment.owns_name_ = true;
  const std::size_t mapped = record_bytes() + bytes;
  if (::ftruncate(fd, static_cast<off_t>(mapped)) != 0) {
    const std::string message = system_error("ftruncate of shared memory", segment.name_);
    ::close(fd);
    ::shm_unlink(segment.name_.c_str());
    throw Error(message + " (is /dev/shm large enough?)");
  }
  std::byte* base = map(fd, mapped, segment.name_);
  SegmentRecord record{};
  std::memcpy(record.tag, kSegmentTag, sizeof(record.tag));
  record.bytes = bytes;
  record.creator_pid = ::getpid();
  record.creator_pid_namespace = pid_namespace();
  std::memcpy(base, &record, sizeof(record));
  segment.data_ = base + record_bytes();
  segment.bytes_ = bytes;
  return segment;  // ftruncate zero-fills
}

SharedSegment SharedSegment::open(const std::string& name, std::size_t bytes) {
  SharedSegment segment;
  segment.name_ = name;
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) throw Error(system_error("shm_open", name) + " (are all ranks on one node?)");
  const std::size_t mapped = record_bytes() + bytes;
  struct stat info {};
  if (::fstat(fd, &info) != 0 || static_cast<std::size_t>(info.st_size) < mapped) {
    ::close(fd);
    throw Error("shared memory '" + name + "' is smaller than " + std::to_string(bytes) + " bytes");
  }
  // Another user's segment under the name a rank was handed is not ours to trust or write.
  if (info.st_uid != ::geteuid()) {
    ::close(fd);
    throw Error("shared memory '" + name + "' is owned by uid " + std::to_string(info.st_uid) +
                ", not by this process's uid " + std::to_string(::geteuid()));
  }
  std::byte* base = map(fd, mapped, name);
  SegmentRecord record{};
  std::memcpy(&record, base, sizeof(record));
  const auto refuse = [&](const std::string& why) {
    ::munmap(base, mapped);
    throw Error("shared memory '" + name + "' " + why);
  };
  if (std::memcmp(record.tag, kSegmentTag, sizeof(record.tag)) != 0)
    refuse("is not an lmoe segment (no record of its creator)");
  if (record.bytes != bytes) {
    refuse("was made for " + std::to_string(record.bytes) + " bytes, expected " +
           std::to_string(bytes) + " (another lmoe version?)");
  }
  // A name left by a run that died before unlinking it: its peers are gone too. A creator in
  // another pid namespace cannot be looked up, so it is trusted.
  if (record.creator_pid_namespace != 0 && record.creator_pid_namespace == pid_namespace() &&
      process_has_exited(static_cast<pid_t>(record.creator_pid))) {
    refuse("was made by pid " + std::to_string(record.creator_pid) +
           ", which has exited: left by an earlier run");
  }
  segment.data_ = base + record_bytes();
  segment.bytes_ = bytes;
  return segment;
}

SharedSegment::~SharedSegment() {
  if (owns_name_) unlink();
  if (data_) ::munmap(data_ - record_bytes(), record_bytes() + bytes_);
}

SharedSegment::SharedSegment(SharedSegment&& other) noexcept
    : name_(std::move(other.name_)),
      data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      owns_name_(std::exchange(other.owns_name_, false)) {}

SharedSegment& SharedSegment::operator=(SharedSegment&& other) noexcept {
  if (this != &other) {
    if (owns_name_) unlink();
    if (data_) ::munmap(data_ - record_bytes(), record_bytes() + bytes_);
    name_ = std::move(other.name_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    owns_name_ = std::exchange(other.owns_name_, false);
  }
  return *this;
}

void SharedSegment::unlink() noexcept {
  if (owns_name_) ::shm_unlink(name_.c_str());
  owns_name_ = false;
}

bool SharedControl::aborted() const {
  return shared(*abort_word_).load(std::memory_order_acquire) != 0;
}

std::string SharedControl::abort_reason() const {
  // A peer raising the abort writes its reason first; one raised by a GPU round has none (the
  // communicator then reports the round's status record).
  if (shared(block_->reason_state).load(std::memory_order_acquire) != 2)
    return "the group was aborted";
  return std::string(block_->reason, strnlen(block_->reason, kReasonBytes));
}

void SharedControl::throw_aborted() const { throw CommunicatorAborted(abort_reason()); }

void SharedControl::abort(const std::string& why) {
  std::uint32_t expected = 0;
  if (shared(block_->reason_state)
          .compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
    const std::string reason = "communicator aborted by rank " + std::to_string(rank_) + ": " + why;
    std::memset(block_->reason, 0, kReasonBytes);
    std::memcpy(block_->reason, reason.data(), std::min(reason.size(), kReasonBytes - 1));
    shared(block_->reason_state).store(2, std::memory_order_release);
  }
  shared(*abort_word_).store(1, std::memory_order_release);
}

void SharedControl::barrier(const char* operation) {
  if (aborted()) throw_aborted();
  const std::uint64_t target = ++barriers_;
  shared(block_->arrived[rank_]).store(target, std::memory_order_release);
  const auto deadline = Clock::now() + timeout_;
  const int missing = wait_for_ranks(block_->arrived, size_, target,
                                     [&] { return aborted() || Clock::now() >= deadline; });
  if (missing < 0) return;
  if (!aborted()) {
    abort("rank " + std::to_string(rank_) + " waited more than " +
          std::to_string(timeout_.count()) + " ms for rank " + std::to_string(missing) + " in " +
          operation);
  }
  throw_aborted();
}

void SharedControl::all_gather(const void* send, void* recv, std::size_t bytes,
                               const char* operation) {
  // Piece by piece through this rank's slot: write, meet, read every slot, meet (a slot is not
  // overwritten before every peer has read it).
  std::size_t done = 0;
  do {
    const std::size_t piece = std::min(kSlotBytes, bytes - done);
    if (piece) std::memcpy(block_->slots[rank_], static_cast<const std::byte*>(send) + done, piece);
    barrier(operation);
    for (int r = 0; r < size_ && piece; ++r) {
      std::memcpy(static_cast<std::byte*>(recv) + static_cast<std::size_t>(r) * bytes + done,
                  block_->slots[r], piece);
    }
    barrier(operation);
    done += piece;
  } while (done < bytes);
}

bool SharedControl::teardown_barrier(std::uint32_t phase) {
  shared(block_->leaving[rank_]).store(phase, std::memory_order_release);
  const auto deadline = Clock::now() + timeout_;
  return wait_for_ranks(block_->leaving, size_, phase, [&] { return Clock::now() >= deadline; }) <
         0;
}

}  // namespace lmoe

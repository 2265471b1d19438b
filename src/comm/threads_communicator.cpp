// Ranks as threads: each collective publishes a pointer per rank, meets at a barrier, and reads
// its peers' buffers directly. Reductions are split into one chunk per rank (each rank reduces
// its chunk of every peer's buffer in rank order), so the work is spread like a two-shot
// all-reduce and the results are identical on every rank.
#include "lmoe/threads_communicator.hpp"

#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <numeric>
#include <thread>

#include "comm/aborted_error.hpp"
#include "comm/rank_order_reduce.hpp"
#include "lmoe/error.hpp"

namespace lmoe {

namespace {

class ThreadGroup {
 public:
  ThreadGroup(int size, std::chrono::milliseconds timeout)
      : size_(size), timeout_(timeout), slots_(static_cast<std::size_t>(size)),
        scratch_(static_cast<std::size_t>(size)) {}

  int size() const { return size_; }

  // Waits until every rank has arrived. Throws CommunicatorAborted if the group is aborted while
  // waiting, and aborts the group itself when the peers do not arrive within the timeout.
  void barrier(int rank, const char* operation) {
    std::unique_lock lock(mutex_);
    throw_if_aborted();
    const std::uint64_t generation = generation_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++generation_;
      changed_.notify_all();
      return;
    }
    const bool released = changed_.wait_for(lock, timeout_, [&] {
      return generation_ != generation || aborted_;
    });
    if (!released) {
      abort_locked(rank, "rank " + std::to_string(rank) + " waited more than " +
                             std::to_string(timeout_.count()) + " ms for its peers in " + operation);
    }
    throw_if_aborted();
  }

  void abort(int rank, const std::string& why) {
    std::lock_guard lock(mutex_);
    abort_locked(rank, why);
  }

  const void*& slot(int rank) { return slots_[static_cast<std::size_t>(rank)]; }
  std::vector<std::byte>& scratch(int rank) { return scratch_[static_cast<std::size_t>(rank)]; }

 private:
  void abort_locked(int rank, const std::string& why) {
    if (!aborted_) {
      aborted_ = true;
      abort_reason_ = "communicator aborted by rank " + std::to_string(rank) + ": " + why;
    }
    changed_.notify_all();
  }
  void throw_if_aborted() const {
    if (aborted_) throw CommunicatorAborted(abort_reason_);
  }

  const int size_;
  const std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable changed_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  bool aborted_ = false;
  std::string abort_reason_;
  std::vector<const void*> slots_;
  std::vector<std::vector<std::byte>> scratch_;
};

class ThreadCommunicator final : public Communicator {
 public:
  ThreadCommunicator(std::shared_ptr<ThreadGroup> group, int rank)
      : group_(std::move(group)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  std::string_view backend_name() const override { return "threads"; }
  MemorySpace memory_space() const override { return MemorySpace::host; }

  void all_reduce(const void* send, void* recv, std::size_t count, DType dtype,
                  StreamHandle) override {
    const std::size_t esize = dtype_size(dtype);
    const auto offsets = even_split_offsets(count, size());
    const std::size_t begin = offsets[rank_], end = offsets[rank_ + 1];
    group_->slot(rank_) = send;
    group_->barrier(rank_, "all_reduce");
    reduce_block_into_scratch(begin * esize, end - begin, dtype);
    group_->barrier(rank_, "all_reduce");
    for (int peer = 0; peer < size(); ++peer) {
      const auto& chunk = group_->scratch(peer);
      std::memcpy(static_cast<std::byte*>(recv) + offsets[peer] * esize, chunk.data(),
                  (offsets[peer + 1] - offsets[peer]) * esize);
    }
    group_->barrier(rank_, "all_reduce");
  }

  void reduce_scatter(const void* send, void* recv, std::span<const std::size_t> counts,
                      DType dtype, StreamHandle) override {
    check_counts(counts, "reduce_scatter");
    const std::size_t esize = dtype_size(dtype);
    const std::size_t begin = std::accumulate(counts.begin(), counts.begin() + rank_, std::size_t{0});
    group_->slot(rank_) = send;
    group_->barrier(rank_, "reduce_scatter");
    reduce_block_into_scratch(begin * esize, counts[rank_], dtype);
    // recv may overlap this rank's send buffer, which peers read until everyone has reduced.
    group_->barrier(rank_, "reduce_scatter");
    std::memcpy(recv, group_->scratch(rank_).data(), counts[rank_] * esize);
  }

  void all_gather(const void* send, void* recv, std::span<const std::size_t> counts, DType dtype,
                  StreamHandle) override {
    check_counts(counts, "all_gather");
    const std::size_t esize = dtype_size(dtype);
    group_->slot(rank_) = send;
    group_->barrier(rank_, "all_gather");
    std::size_t offset = 0;
    for (int peer = 0; peer < size(); ++peer) {
      // memmove: an in-place all-gather passes its own block of recv as send.
      std::memmove(static_cast<std::byte*>(recv) + offset * esize, group_->slot(peer),
                   counts[peer] * esize);
      offset += counts[peer];
    }
    group_->barrier(rank_, "all_gather");
  }

  void barrier() override { group_->barrier(rank_, "barrier"); }
  void abort(const std::string& why) override { group_->abort(rank_, why); }

 private:
  void check_counts(std::span<const std::size_t> counts, const char* operation) const {
    if (counts.size() != static_cast<std::size_t>(size())) {
      throw Error(std::string(operation) + ": counts has " + std::to_string(counts.size()) +
                  " entries, expected one per rank (" + std::to_string(size()) + ")");
    }
  }

  // scratch(rank) = round(Σ_peer send_peer[byte_offset .. +count]) in rank order.
  void reduce_block_into_scratch(std::size_t byte_offset, std::size_t count, DType dtype) {
    std::vector<const void*> inputs(static_cast<std::size_t>(size()));
    for (int peer = 0; peer < size(); ++peer) {
      inputs[peer] = static_cast<const std::byte*>(group_->slot(peer)) + byte_offset;
    }
    auto& scratch = group_->scratch(rank_);
    scratch.resize(count * dtype_size(dtype));
    reduce_in_rank_order(inputs, scratch.data(), count, dtype);
  }

  std::shared_ptr<ThreadGroup> group_;
  int rank_;
};

}  // namespace

std::vector<std::shared_ptr<Communicator>> make_thread_communicators(
    int num_ranks, std::chrono::milliseconds timeout) {
  if (num_ranks < 1) throw Error("number of ranks must be >= 1, got " + std::to_string(num_ranks));
  auto group = std::make_shared<ThreadGroup>(num_ranks, timeout);
  std::vector<std::shared_ptr<Communicator>> comms;
  for (int rank = 0; rank < num_ranks; ++rank) {
    comms.push_back(std::make_shared<ThreadCommunicator>(group, rank));
  }
  return comms;
}

void run_on_threads(int num_ranks, const std::function<void(int, Communicator&)>& fn,
                    std::chrono::milliseconds timeout) {
  auto comms = make_thread_communicators(num_ranks, timeout);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(num_ranks));
  std::vector<bool> from_abort(static_cast<std::size_t>(num_ranks), false);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < num_ranks; ++rank) {
    threads.emplace_back([&, rank] {
      Communicator& comm = *comms[static_cast<std::size_t>(rank)];
      try {
        fn(rank, comm);
      } catch (const CommunicatorAborted&) {
        errors[rank] = std::current_exception();
        from_abort[rank] = true;
      } catch (const std::exception& error) {
        errors[rank] = std::current_exception();
        comm.abort(error.what());
      } catch (...) {
        errors[rank] = std::current_exception();
        comm.abort("unknown exception");
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (int rank = 0; rank < num_ranks; ++rank) {
    if (errors[rank] && !from_abort[rank]) std::rethrow_exception(errors[rank]);
  }
  for (int rank = 0; rank < num_ranks; ++rank) {
    if (errors[rank]) std::rethrow_exception(errors[rank]);
  }
}

}  // namespace lmoe

// Ranks as threads: each collective publishes a pointer per rank, meets at a barrier, and reads
// its peers' buffers directly. Reductions are split into one chunk per rank (each rank reduces
// its chunk of every peer's buffer in rank order), so the work is spread like a two-shot
// all-reduce and the results are identical on every rank.
#include "lmoe/threads_communicator.hpp"

#include <cstring>
#include <exception>
#include <numeric>
#include <thread>

#include "comm/aborted_error.hpp"
#include "comm/host_barrier.hpp"
#include "core/rank_order_reduce.hpp"
#include "lmoe/error.hpp"

namespace lmoe {

namespace {

class ThreadGroup {
 public:
  ThreadGroup(int size, std::chrono::milliseconds timeout)
      : size_(size),
        barrier_(size, timeout),
        slots_(static_cast<std::size_t>(size)),
        scratch_(static_cast<std::size_t>(size)) {}

  int size() const { return size_; }

  void barrier(int rank, const char* operation) { barrier_.arrive_and_wait(rank, operation); }
  void abort(int rank, const std::string& why) { barrier_.abort(rank, why); }

  const void*& slot(int rank) { return slots_[static_cast<std::size_t>(rank)]; }
  std::vector<std::byte>& scratch(int rank) { return scratch_[static_cast<std::size_t>(rank)]; }

 private:
  const int size_;
  HostBarrier barrier_;
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
      const std::size_t bytes = (offsets[peer + 1] - offsets[peer]) * esize;
      if (bytes) {
        std::memcpy(static_cast<std::byte*>(recv) + offsets[peer] * esize,
                    group_->scratch(peer).data(), bytes);
      }
    }
    group_->barrier(rank_, "all_reduce");
  }

  void reduce_scatter(const void* send, void* recv, std::span<const std::size_t> counts,
                      DType dtype, StreamHandle) override {
    check_counts(counts, "reduce_scatter");
    const std::size_t esize = dtype_size(dtype);
    const std::size_t begin =
        std::accumulate(counts.begin(), counts.begin() + rank_, std::size_t{0});
    group_->slot(rank_) = send;
    group_->barrier(rank_, "reduce_scatter");
    reduce_block_into_scratch(begin * esize, counts[rank_], dtype);
    // recv may overlap this rank's send buffer, which peers read until everyone has reduced.
    group_->barrier(rank_, "reduce_scatter");
    if (counts[rank_]) std::memcpy(recv, group_->scratch(rank_).data(), counts[rank_] * esize);
  }

  void all_gather(const void* send, void* recv, std::span<const std::size_t> counts, DType dtype,
                  StreamHandle) override {
    check_counts(counts, "all_gather");
    const std::size_t esize = dtype_size(dtype);
    group_->slot(rank_) = send;
    group_->barrier(rank_, "all_gather");
    std::size_t offset = 0;
    for (int peer = 0; peer < size(); ++peer) {
      std::byte* destination = static_cast<std::byte*>(recv) + offset * esize;
      // An in-place all-gather passes its own block of recv as send: nothing to copy, and peers
      // are reading that block meanwhile.
      if (counts[peer] && destination != group_->slot(peer)) {
        std::memcpy(destination, group_->slot(peer), counts[peer] * esize);
      }
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
  run_on_rank_threads(make_thread_communicators(num_ranks, timeout), fn);
}

void run_on_rank_threads(std::span<const std::shared_ptr<Communicator>> comms,
                         const std::function<void(int, Communicator&)>& fn) {
  const std::size_t num_ranks = comms.size();
  std::vector<std::exception_ptr> errors(num_ranks);
  std::vector<char> from_abort(num_ranks, 0);
  std::vector<std::thread> threads;
  for (std::size_t rank = 0; rank < num_ranks; ++rank) {
    threads.emplace_back([&, rank] {
      Communicator& comm = *comms[rank];
      try {
        fn(static_cast<int>(rank), comm);
      } catch (const CommunicatorAborted&) {
        errors[rank] = std::current_exception();
        from_abort[rank] = 1;
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
  // The root cause first: an error a rank raised itself, not one it got from the abort.
  for (std::size_t rank = 0; rank < num_ranks; ++rank) {
    if (errors[rank] && !from_abort[rank]) std::rethrow_exception(errors[rank]);
  }
  for (const auto& error : errors) {
    if (error) std::rethrow_exception(error);
  }
}

}  // namespace lmoe

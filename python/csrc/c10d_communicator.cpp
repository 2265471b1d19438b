#include "c10d_communicator.hpp"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <vector>

#include "core/rank_order_reduce.hpp"
#include "lmoe/error.hpp"

namespace lmoe::python {
namespace {

class C10dCommunicator final : public Communicator {
 public:
  explicit C10dCommunicator(c10::intrusive_ptr<c10d::ProcessGroup> group)
      : group_(std::move(group)), rank_(group_->getRank()), size_(group_->getSize()) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend_name() const override { return "c10d"; }
  MemorySpace memory_space() const override { return MemorySpace::host; }

  void all_reduce(const void* send, void* recv, std::size_t count, DType dtype,
                  StreamHandle) override {
    const std::size_t bytes = count * dtype_size(dtype);
    const std::vector<std::byte> all = gather_bytes(send, bytes);
    reduce_blocks(all, bytes, 0, recv, count, dtype);
  }

  void reduce_scatter(const void* send, void* recv, std::span<const std::size_t> counts,
                      DType dtype, StreamHandle) override {
    check_counts(counts);
    std::size_t total = 0, first = 0;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) first = total;
      total += counts[static_cast<std::size_t>(r)];
    }
    // Every rank's whole send travels (not only this rank's block): simple, and the host path
    // serves tests and CPU inference, where the bytes are few.
    const std::size_t element = dtype_size(dtype);
    const std::vector<std::byte> all = gather_bytes(send, total * element);
    reduce_blocks(all, total * element, first * element, recv,
                  counts[static_cast<std::size_t>(rank_)], dtype);
  }

  void all_gather(const void* send, void* recv, std::span<const std::size_t> counts, DType dtype,
                  StreamHandle) override {
    check_counts(counts);
    const std::size_t element = dtype_size(dtype);
    const std::size_t widest = *std::max_element(counts.begin(), counts.end()) * element;
    // c10d gathers equal blocks: pad each rank's block to the widest.
    std::vector<std::byte> mine(widest);
    std::memcpy(mine.data(), send, counts[static_cast<std::size_t>(rank_)] * element);
    const std::vector<std::byte> all = gather_bytes(mine.data(), widest);
    std::byte* out = static_cast<std::byte*>(recv);
    for (int r = 0; r < size_; ++r) {
      const std::size_t bytes = counts[static_cast<std::size_t>(r)] * element;
      std::memcpy(out, all.data() + static_cast<std::size_t>(r) * widest, bytes);
      out += bytes;
    }
  }

  void control_all_gather(const void* send, void* recv, std::size_t bytes) override {
    const std::vector<std::byte> all = gather_bytes(send, bytes);
    std::memcpy(recv, all.data(), all.size());
  }

  void barrier() override {
    check_open();
    group_->barrier()->wait();
  }

  // c10d offers no way to wake a peer already waiting in a collective (gloo's own timeout does):
  // this rank's later collectives fail at once.
  void abort(const std::string& why) override {
    std::lock_guard lock(mutex_);
    if (!aborted_) why_ = why;
    aborted_ = true;
  }

 private:
  void check_open() const {
    std::lock_guard lock(mutex_);
    if (aborted_) throw Error("c10d communicator: aborted: " + why_);
  }

  void check_counts(std::span<const std::size_t> counts) const {
    LMOE_CHECK(counts.size() == static_cast<std::size_t>(size_),
               "c10d communicator: expected " + std::to_string(size_) + " counts, got " +
                   std::to_string(counts.size()));
  }

  // Every rank's `bytes` bytes of `send`, in rank order.
  std::vector<std::byte> gather_bytes(const void* send, std::size_t bytes) {
    check_open();
    std::vector<std::byte> all(bytes * static_cast<std::size_t>(size_));
    if (bytes == 0) return all;
    const auto options = at::TensorOptions().dtype(at::kByte);
    const auto length = static_cast<std::int64_t>(bytes);
    at::Tensor input = at::from_blob(const_cast<void*>(send), {length}, options);
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int r = 0; r < size_; ++r) {
      outputs[0].push_back(
          at::from_blob(all.data() + static_cast<std::size_t>(r) * bytes, {length}, options));
    }
    std::vector<at::Tensor> inputs{input};
    group_->allgather(outputs, inputs)->wait();
    return all;
  }

  void reduce_blocks(const std::vector<std::byte>& all, std::size_t stride, std::size_t offset,
                     void* recv, std::size_t count, DType dtype) const {
    std::vector<const void*> inputs(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r)
      inputs[static_cast<std::size_t>(r)] =
          all.data() + static_cast<std::size_t>(r) * stride + offset;
    reduce_in_rank_order(inputs, recv, count, dtype);
  }

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int rank_ = 0, size_ = 1;
  mutable std::mutex mutex_;
  bool aborted_ = false;
  std::string why_;
};

}  // namespace

std::shared_ptr<Communicator> make_c10d_communicator(const std::string& group_name) {
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  try {
    group = c10d::resolve_process_group(group_name);
  } catch (const std::exception& error) {
    throw Error("group: no torch.distributed process group named '" + group_name + "' (" +
                error.what() + ")");
  }
  return std::make_shared<C10dCommunicator>(std::move(group));
}

}  // namespace lmoe::python

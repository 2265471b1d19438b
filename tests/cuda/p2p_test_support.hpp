// What the p2p tests share (test_p2p.cpp, test_p2p_collectives.cpp): the skip where ranks would
// share a GPU without the opt-in, a rank's own stream, the host's rank-order sum, and collectives
// described as data (operation, dtype, per-rank counts, in place or not) with fresh inputs, the
// outputs every rank must receive, and the device buffers a rank runs them on.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/rank_order_reduce.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "cuda/runtime/owned_stream.hpp"
#include "gpu_test_support.hpp"
#include "lmoe/comm_group.hpp"
#include "lmoe/communicator.hpp"
#include "lmoe/dtype.hpp"
#include "lmoe/p2p_communicator.hpp"
#include "tools/bench_values.hpp"
#include "tools/collective_check.hpp"

// Ranks sharing a GPU can stall in p2p (docs/p2p.md): such tests run only where every rank has its
// own GPU or with LMOE_P2P_SHARED_GPU=1. The failure-path tests (a stalled rank, two collectives at
// once, an abort) run everywhere: they must end in an error, which they do.
#define SKIP_UNLESS_P2P_CAN_RUN(tp)                                             \
  do {                                                                          \
    if (auto limit = lmoe::comm_group_limit("p2p", tp)) GTEST_SKIP() << *limit; \
  } while (0)

namespace p2p_test {

using lmoe::DType;

// A non-blocking stream of the rank's own, synchronized and destroyed with the scope.
using Stream = lmoe::cuda::OwnedStream;

// round(Σ_r inputs[r][i]) in rank order (the contract's sum), for i < count.
inline std::vector<std::byte> host_sum(const std::vector<std::vector<std::byte>>& inputs,
                                       std::size_t count, DType dtype) {
  std::vector<const void*> pointers;
  for (const auto& input : inputs) pointers.push_back(input.data());
  std::vector<std::byte> sum(count * lmoe::dtype_size(dtype));
  lmoe::reduce_in_rank_order(pointers, sum.data(), count, dtype);
  return sum;
}

// `count` values uniform in (−2, 2) with every bit of the dtype's mantissa in use, so that sums
// round differently in another order; from a counter-based hash, fast enough for tens of millions.
inline std::vector<std::byte> uniform_values(std::size_t count, DType dtype, std::uint64_t seed) {
  std::vector<std::byte> bytes(count * lmoe::dtype_size(dtype));
  const std::uint64_t stream = lmoe::bench::mix64(seed ^ 0x7032707465737473ull);
  for (std::size_t i = 0; i < count; ++i) {
    const std::uint64_t bits = lmoe::bench::mix64(stream + i);
    const float unit = static_cast<float>(bits >> 40) * (1.0f / 16777216.0f);  // [0, 1), 24 bits
    lmoe::store_from_float(bytes.data(), i, dtype, 4.0f * unit - 2.0f);
  }
  return bytes;
}

using Op = lmoe::bench::CollectiveOp;

// One collective as every rank issues it. counts[r] is rank r's block (all_reduce: the buffer is
// the blocks together); in place as nccl-tests (CollectiveShape).
struct Collective {
  Op op = Op::all_reduce;
  DType dtype = DType::bf16;
  std::vector<std::size_t> counts;
  bool in_place = false;

  lmoe::bench::CollectiveShape shape() const { return {op, counts}; }
  std::size_t total() const { return shape().total(); }
  std::size_t esize() const { return lmoe::dtype_size(dtype); }
  // "reduce_scatter of 4194304 f32 elements in place": for failure messages.
  std::string name() const {
    return std::string(lmoe::bench::collective_op_name(op)) + " of " + std::to_string(total()) +
           " " + std::string(lmoe::dtype_name(dtype)) + " elements" + (in_place ? " in place" : "");
  }
};

// `total` elements in `tp` blocks whose sizes differ by at most one.
inline std::vector<std::size_t> split_evenly(std::size_t total, int tp) {
  const std::vector<std::size_t> offsets = lmoe::even_split_offsets(total, tp);
  std::vector<std::size_t> counts;
  for (int r = 0; r < tp; ++r) counts.push_back(offsets[r + 1] - offsets[r]);
  return counts;
}

// Fresh inputs of every rank and what every rank must receive: the host's rank-order sum, or every
// rank's block in rank order.
struct CollectiveData {
  std::vector<std::vector<std::byte>> inputs;    // [rank]: shape().input_count(rank) elements
  std::vector<std::vector<std::byte>> expected;  // [rank]: shape().output_count(rank) elements
};

inline CollectiveData make_collective_data(const Collective& c, std::uint64_t seed) {
  const int tp = static_cast<int>(c.counts.size());
  CollectiveData data;
  for (int r = 0; r < tp; ++r) {
    data.inputs.push_back(uniform_values(c.shape().input_count(r), c.dtype,
                                         seed * 131 + static_cast<std::uint64_t>(r)));
  }
  std::vector<std::byte> whole;
  if (c.op == Op::all_gather) {
    for (const auto& input : data.inputs) whole.insert(whole.end(), input.begin(), input.end());
  } else {
    whole = host_sum(data.inputs, c.total(), c.dtype);
  }
  for (int r = 0; r < tp; ++r) {
    const std::size_t from = c.op == Op::reduce_scatter ? c.shape().first(r) * c.esize() : 0;
    data.expected.emplace_back(
        whole.begin() + static_cast<std::ptrdiff_t>(from),
        whole.begin() + static_cast<std::ptrdiff_t>(from + c.shape().output_count(r) * c.esize()));
  }
  return data;
}

// One rank's device buffers for a collective. stage() copies an input already on the device to
// where the collective reads it and poisons every byte of the output that is not input, on the
// rank's stream, so that runs can follow each other with no host work between them.
class RankCollective {
 public:
  RankCollective(const Collective& c, int rank)
      : c_(c),
        rank_(rank),
        send_(c.in_place ? 0 : bytes(c.shape().input_count(rank) * c.esize())),
        recv_(bytes((c.in_place ? c.total() : c.shape().output_count(rank)) * c.esize())) {}

  void* send() const {
    return c_.in_place ? recv_.at(c_.shape().in_place_send_offset(rank_) * c_.esize())
                       : send_.data();
  }
  void* recv() const {
    return c_.in_place ? recv_.at(c_.shape().in_place_recv_offset(rank_) * c_.esize())
                       : recv_.data();
  }
  std::size_t input_bytes() const { return c_.shape().input_count(rank_) * c_.esize(); }
  std::size_t output_bytes() const { return c_.shape().output_count(rank_) * c_.esize(); }

  void stage(const void* input, cudaStream_t stream) const {
    const bool output_is_input = c_.in_place && c_.op != Op::all_gather;
    if (!output_is_input) cuda_ok(cudaMemsetAsync(recv_.data(), 0xff, recv_.bytes(), stream));
    if (input_bytes() == 0) return;  // nothing to stage, and no buffer to stage it from
    cuda_ok(cudaMemcpyAsync(send(), input, input_bytes(), cudaMemcpyDeviceToDevice, stream));
  }

  void issue(lmoe::Communicator& comm, cudaStream_t stream) const {
    switch (c_.op) {
      case Op::all_reduce: comm.all_reduce(send(), recv(), c_.total(), c_.dtype, stream); break;
      case Op::reduce_scatter:
        comm.reduce_scatter(send(), recv(), c_.counts, c_.dtype, stream);
        break;
      case Op::all_gather: comm.all_gather(send(), recv(), c_.counts, c_.dtype, stream); break;
    }
  }

 private:
  // A buffer of n bytes, at least 16, so that an empty block still has an address.
  static std::size_t bytes(std::size_t n) { return std::max<std::size_t>(n, 16); }

  Collective c_;
  int rank_;
  lmoe::cuda::DeviceBuffer send_, recv_;
};

// EXPECT that `got` holds the same bits as `expected`; else how many elements differ and the first
// of them, with both values.
inline void expect_same_bits(const std::vector<std::byte>& got,
                             const std::vector<std::byte>& expected, DType dtype,
                             const std::string& what) {
  ASSERT_EQ(got.size(), expected.size()) << what;
  const std::size_t esize = lmoe::dtype_size(dtype);
  std::size_t wrong = 0, first = 0;
  for (std::size_t i = 0; i < got.size() / esize; ++i) {
    if (std::memcmp(got.data() + i * esize, expected.data() + i * esize, esize) == 0) continue;
    if (wrong++ == 0) first = i;
  }
  EXPECT_EQ(wrong, 0u) << what << ": " << wrong << " of " << got.size() / esize
                       << " elements differ from the host's; the first at " << first << ": got "
                       << lmoe::load_as_float(got.data(), first, dtype) << ", expected "
                       << lmoe::load_as_float(expected.data(), first, dtype);
}

// Runs `collectives` `runs` times on `tp` ranks with `options`, back to back on each
// rank's stream: eagerly, or (graph) captured once as one CUDA graph and replayed. Every run has
// its own fresh inputs, staged on the device ahead of time and copied in on the stream (outputs
// poisoned), and its outputs are copied out there, so no host work separates runs. Then every
// output of every run and rank is checked against the host bit for bit.
inline void expect_runs_match_the_host(int tp, const std::vector<Collective>& collectives,
                                       bool graph, int runs, std::uint64_t seed,
                                       const lmoe::P2pOptions& options) {
  SCOPED_TRACE("tp " + std::to_string(tp) + (graph ? ", one graph" : ", eager"));
  std::vector<std::vector<CollectiveData>> data(static_cast<std::size_t>(runs));  // [run][k]
  for (int i = 0; i < runs; ++i) {
    for (std::size_t k = 0; k < collectives.size(); ++k) {
      data[i].push_back(
          make_collective_data(collectives[k], seed + 1000 * static_cast<std::uint64_t>(i) + k));
    }
  }
  // [run][k][rank]
  std::vector<std::vector<std::vector<std::vector<std::byte>>>> got(
      static_cast<std::size_t>(runs),
      std::vector<std::vector<std::vector<std::byte>>>(collectives.size(),
                                                       std::vector<std::vector<std::byte>>(tp)));
  lmoe::run_on_p2p_threads(
      tp,
      [&](int rank, lmoe::Communicator& comm) {
        const Stream stream;
        std::vector<RankCollective> rank_runs;
        for (const Collective& c : collectives) rank_runs.emplace_back(c, rank);
        std::vector<std::vector<lmoe::cuda::DeviceBuffer>> inputs(runs), outputs(runs);  // [run][k]
        for (int i = 0; i < runs; ++i) {
          for (std::size_t k = 0; k < collectives.size(); ++k) {
            inputs[i].emplace_back(rank_runs[k].input_bytes());
            outputs[i].emplace_back(rank_runs[k].output_bytes());
            // A rank with no elements has no buffer to copy into (a null pointer is an error).
            if (rank_runs[k].input_bytes() == 0) continue;
            cuda_ok(cudaMemcpy(inputs[i][k].data(), data[i][k].inputs[rank].data(),
                               rank_runs[k].input_bytes(), cudaMemcpyHostToDevice));
          }
        }
        // Allocations and synchronous copies wait for the whole GPU: every rank finishes them
        // (and its stream runs its first work) before any rank captures or spins.
        const lmoe::cuda::DeviceBuffer first_work(16);
        cuda_ok(cudaMemsetAsync(first_work.data(), 0, first_work.bytes(), stream.get()));
        cuda_ok(cudaDeviceSynchronize());
        comm.barrier();
        cudaGraph_t captured = nullptr;
        cudaGraphExec_t exec = nullptr;
        if (graph) {
          cuda_ok(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
          for (const RankCollective& run : rank_runs) run.issue(comm, stream.get());
          cuda_ok(cudaStreamEndCapture(stream.get(), &captured));
          cuda_ok(cudaGraphInstantiate(&exec, captured, 0));
          cuda_ok(cudaGraphUpload(exec, stream.get()));
          cuda_ok(cudaStreamSynchronize(stream.get()));
          comm.barrier();
        }
        for (int i = 0; i < runs; ++i) {
          for (std::size_t k = 0; k < collectives.size(); ++k)
            rank_runs[k].stage(inputs[i][k].data(), stream.get());
          if (graph) {
            cuda_ok(cudaGraphLaunch(exec, stream.get()));
          } else {
            for (const RankCollective& run : rank_runs) run.issue(comm, stream.get());
          }
          for (std::size_t k = 0; k < collectives.size(); ++k) {
            cuda_ok(cudaMemcpyAsync(outputs[i][k].data(), rank_runs[k].recv(),
                                    rank_runs[k].output_bytes(), cudaMemcpyDeviceToDevice,
                                    stream.get()));
          }
        }
        cuda_ok(cudaStreamSynchronize(stream.get()));
        comm.barrier();
        for (int i = 0; i < runs; ++i) {
          for (std::size_t k = 0; k < collectives.size(); ++k) {
            got[i][k][rank].resize(rank_runs[k].output_bytes());
            cuda_ok(cudaMemcpy(got[i][k][rank].data(), outputs[i][k].data(),
                               rank_runs[k].output_bytes(), cudaMemcpyDeviceToHost));
          }
        }
        if (graph) {
          cudaGraphExecDestroy(exec);
          cudaGraphDestroy(captured);
        }
      },
      options);
  for (int i = 0; i < runs; ++i) {
    for (std::size_t k = 0; k < collectives.size(); ++k) {
      for (int r = 0; r < tp; ++r) {
        expect_same_bits(
            got[i][k][r], data[i][k].expected[r], collectives[k].dtype,
            collectives[k].name() + ", run " + std::to_string(i) + ", rank " + std::to_string(r));
      }
    }
  }
}

}  // namespace p2p_test

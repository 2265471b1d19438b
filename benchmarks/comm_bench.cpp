// lmoe_comm_bench: the bandwidth of the communicators' collectives alone, in the style of
// nccl-tests — all_reduce, reduce_scatter and all_gather over sizes, out of place and in place, for
// every named comm backend (p2p, nccl, cuda-threads), ranks on threads of this process (one per
// GPU, or sharing GPUs where the backend allows it). The tiers' times at large T are mostly these
// collectives (docs/perf.md), so this is where a transport's bandwidth is measured and compared.
//
// Each (comm, op, size, placement) is timed on every rank with CUDA events around `iters`
// back-to-back calls on the rank's stream after `warmup` calls (captured as one CUDA graph where
// the communicator is capturable), the ranks started together by a barrier; the time of a call is
// the slowest rank's elapsed time / iters. Columns as nccl-tests: algbw = bytes / time,
// busbw = algbw · 2(n−1)/n (all_reduce) or · (n−1)/n (reduce_scatter, all_gather), with bytes the
// whole buffer (all_reduce: each rank's input; reduce_scatter: each rank's input; all_gather:
// each rank's output). In place as nccl-tests: all_reduce's recv is its send, reduce_scatter's recv
// is the rank's block of send, all_gather's send is the rank's block of recv.
//
// Every result is checked, as nccl-tests' #wrong: the inputs are small integers whose sums are
// exact in every dtype and order (bench::collective_value), so each output element has one right
// value, and #wrong counts the elements of every rank's output that differ from it, over three
// checks: one eager call, one call captured as a graph (capturable comms), and the timed calls
// (out of place, where their inputs stay as filled; in place they overwrite them). Outputs are
// poisoned before each check. The process exits with 1 when any element is wrong. A benchmark is a
// program, not a test: it prints a table (and --json FILE) and asserts no time.
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "lmoe/comm_group.hpp"
#include "lmoe/error.hpp"
#include "tools/bench_values.hpp"
#include "tools/collective_check.hpp"
#include "tools/cuda/bench_fill.hpp"

namespace {

using lmoe::DType;
using lmoe::bench::CollectiveOp;
using lmoe::bench::CollectiveShape;
using lmoe::cuda::DeviceBuffer;
using Json = nlohmann::json;

struct Settings {
  std::vector<std::string> comms = {"p2p", "nccl"};
  std::vector<std::string> ops = {"all_reduce", "reduce_scatter", "all_gather"};
  int ranks = 0;  // 0: one per visible GPU
  std::vector<std::int64_t> bytes = {std::int64_t{1} << 20, std::int64_t{8} << 20,
                                     std::int64_t{64} << 20, std::int64_t{256} << 20};
  std::string dtype = "bf16";
  int warmup = 3;
  int iters = 20;
  std::string json_path;
};

struct Row {
  std::string comm, op;
  std::int64_t bytes = 0;  // the whole buffer
  std::int64_t count = 0;  // its elements
  bool in_place = false;
  double us = 0;  // per call, the slowest rank
  double algbw = 0, busbw = 0;
  bool graph = false;      // timed as one CUDA graph (else eagerly)
  std::int64_t wrong = 0;  // output elements unlike the exact result, over every rank and check
};

double bus_factor(const std::string& op, int n) {
  if (n == 1) return 0.0;
  return op == "all_reduce" ? 2.0 * (n - 1) / n : static_cast<double>(n - 1) / n;
}

std::optional<CollectiveOp> parse_op(const std::string& name) {
  for (CollectiveOp op :
       {CollectiveOp::all_reduce, CollectiveOp::reduce_scatter, CollectiveOp::all_gather}) {
    if (lmoe::bench::collective_op_name(op) == name) return op;
  }
  return std::nullopt;
}

std::optional<DType> parse_dtype(const std::string& name) {
  for (DType dtype : {DType::bf16, DType::f16, DType::f32}) {
    if (lmoe::dtype_name(dtype) == name) return dtype;
  }
  return std::nullopt;
}

// Where one call reads and writes on `rank` (see the placements above).
struct Placement {
  void* send;
  void* recv;
};
Placement place(const CollectiveShape& shape, bool in_place, int rank, std::size_t esize,
                void* send, void* recv) {
  if (!in_place) return {send, recv};
  std::byte* buffer = static_cast<std::byte*>(recv);
  return {buffer + shape.in_place_send_offset(rank) * esize,
          buffer + shape.in_place_recv_offset(rank) * esize};
}

void run_op(lmoe::Communicator& comm, const CollectiveShape& shape, Placement at, DType dtype,
            cudaStream_t stream) {
  switch (shape.op) {
    case CollectiveOp::all_reduce:
      comm.all_reduce(at.send, at.recv, shape.total(), dtype, stream);
      break;
    case CollectiveOp::reduce_scatter:
      comm.reduce_scatter(at.send, at.recv, shape.counts, dtype, stream);
      break;
    case CollectiveOp::all_gather:
      comm.all_gather(at.send, at.recv, shape.counts, dtype, stream);
      break;
  }
}

// `calls` calls captured as one graph. Ranks that share a GPU must not capture while a peer makes a
// synchronous call (it invalidates the capture), hence the barriers around it.
cudaGraphExec_t capture(lmoe::Communicator& comm, int calls, const CollectiveShape& shape,
                        Placement at, DType dtype, cudaStream_t stream) {
  comm.barrier();
  cudaGraph_t captured = nullptr;
  LMOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < calls; ++i) run_op(comm, shape, at, dtype, stream);
  LMOE_CUDA_CHECK(cudaStreamEndCapture(stream, &captured));
  comm.barrier();
  cudaGraphExec_t graph = nullptr;
  LMOE_CUDA_CHECK(cudaGraphInstantiate(&graph, captured, 0));
  LMOE_CUDA_CHECK(cudaGraphDestroy(captured));
  return graph;
}

struct RankResult {
  double us = 0;
  std::int64_t wrong = 0;
};

std::vector<Row> measure(const Settings& s, DType dtype, const std::string& comm_name, int ranks) {
  std::vector<Row> rows;
  std::mutex mutex;
  int visible = 0;
  LMOE_CUDA_CHECK(cudaGetDeviceCount(&visible));
  const std::size_t esize = lmoe::dtype_size(dtype);
  lmoe::run_comm_group(comm_name, ranks, [&](int rank, lmoe::Communicator& comm) {
    LMOE_CUDA_CHECK(cudaSetDevice(rank % visible));
    cudaStream_t stream = nullptr;
    LMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaEvent_t start = nullptr, stop = nullptr;
    LMOE_CUDA_CHECK(cudaEventCreate(&start));
    LMOE_CUDA_CHECK(cudaEventCreate(&stop));
    const std::int64_t most = *std::max_element(s.bytes.begin(), s.bytes.end());
    DeviceBuffer send(static_cast<std::size_t>(most)), recv(static_cast<std::size_t>(most));
    std::vector<std::byte> output(static_cast<std::size_t>(most));  // a check's copy
    for (std::size_t op_index = 0; op_index < s.ops.size(); ++op_index) {
      const std::string& op = s.ops[op_index];
      for (const std::int64_t bytes : s.bytes) {
        // Elements a multiple of 8 per rank, so that every rank's block is 16-byte aligned.
        const std::size_t per_rank = static_cast<std::size_t>(bytes) / esize / ranks / 8 * 8;
        const std::vector<std::size_t> counts(static_cast<std::size_t>(ranks), per_rank);
        const CollectiveShape shape{*parse_op(op), counts};
        std::array<Row, 2> placed;
        for (const bool in_place : {false, true}) {
          const Placement at = place(shape, in_place, rank, esize, send.data(), recv.data());
          const std::uint64_t seed = lmoe::bench::mix64((static_cast<std::uint64_t>(bytes) << 8) ^
                                                        (op_index << 1) ^ (in_place ? 1u : 0u));
          // Fresh inputs where the call reads them, every other byte of the output poisoned.
          const auto prepare = [&] {
            const bool output_is_input = in_place && shape.op != CollectiveOp::all_gather;
            if (!output_is_input) {
              LMOE_CUDA_CHECK(cudaMemsetAsync(
                  in_place ? recv.data() : at.recv, 0xff,
                  (in_place ? shape.total() : shape.output_count(rank)) * esize, stream));
            }
            LMOE_CUDA_CHECK(lmoe::cuda::launch_fill_collective_values(
                at.send, static_cast<std::int64_t>(shape.input_count(rank)), dtype,
                lmoe::bench::collective_input_seed(seed, rank), stream));
            LMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
            comm.barrier();
          };
          // Every rank has finished the call before any rank copies out (a synchronous copy).
          const auto wrong_elements = [&]() -> std::int64_t {
            LMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
            comm.barrier();
            const std::size_t out_bytes = shape.output_count(rank) * esize;
            LMOE_CUDA_CHECK(cudaMemcpy(output.data(), at.recv, out_bytes, cudaMemcpyDeviceToHost));
            return static_cast<std::int64_t>(
                lmoe::bench::count_wrong_elements(shape, dtype, rank, seed, output.data()));
          };
          std::int64_t wrong = 0;
          prepare();
          run_op(comm, shape, at, dtype, stream);
          wrong += wrong_elements();  // eager
          if (comm.graph_capturable()) {
            const cudaGraphExec_t single = capture(comm, 1, shape, at, dtype, stream);
            prepare();
            LMOE_CUDA_CHECK(cudaGraphLaunch(single, stream));
            wrong += wrong_elements();  // in a graph
            LMOE_CUDA_CHECK(cudaGraphExecDestroy(single));
          }
          prepare();  // the timed calls' inputs: out of place they stay, and so does the result
          for (int i = 0; i < s.warmup; ++i) run_op(comm, shape, at, dtype, stream);
          LMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
          // Capturable communicators (p2p, nccl): the timed calls are one CUDA graph, so the time
          // is the GPU's, not the host's enqueueing; the others run eagerly.
          cudaGraphExec_t graph = nullptr;
          if (comm.graph_capturable()) {
            graph = capture(comm, s.iters, shape, at, dtype, stream);
            // warm: the graph's first launch uploads it
            LMOE_CUDA_CHECK(cudaGraphLaunch(graph, stream));
            LMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
          }
          comm.barrier();
          LMOE_CUDA_CHECK(cudaEventRecord(start, stream));
          if (graph) {
            LMOE_CUDA_CHECK(cudaGraphLaunch(graph, stream));
          } else {
            for (int i = 0; i < s.iters; ++i) run_op(comm, shape, at, dtype, stream);
          }
          LMOE_CUDA_CHECK(cudaEventRecord(stop, stream));
          LMOE_CUDA_CHECK(cudaEventSynchronize(stop));
          float ms = 0;
          LMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
          if (graph) LMOE_CUDA_CHECK(cudaGraphExecDestroy(graph));
          if (!in_place) wrong += wrong_elements();  // the timed calls
          const RankResult mine{1000.0 * ms / s.iters, wrong};
          std::vector<RankResult> all(static_cast<std::size_t>(ranks));
          comm.control_all_gather(&mine, all.data(), sizeof(RankResult));
          Row& row = placed[in_place ? 1 : 0];
          row.comm = comm_name;
          row.op = op;
          row.count = static_cast<std::int64_t>(shape.total());
          row.bytes = row.count * static_cast<std::int64_t>(esize);
          row.in_place = in_place;
          row.graph = comm.graph_capturable();
          for (const RankResult& result : all) {
            row.us = std::max(row.us, result.us);
            row.wrong += result.wrong;
          }
          row.algbw = static_cast<double>(row.bytes) / (row.us * 1e3);
          row.busbw = row.algbw * bus_factor(op, ranks);
        }
        if (rank == 0) {
          const std::lock_guard lock(mutex);
          const Row& out = placed[0];
          const Row& in = placed[1];
          std::printf(
              "%14s %14s %12lld %12lld %10.1f %10.2f %10.2f %7lld %10.1f %10.2f %10.2f %7lld\n",
              out.comm.c_str(), out.op.c_str(), static_cast<long long>(out.bytes),
              static_cast<long long>(out.count), out.us, out.algbw, out.busbw,
              static_cast<long long>(out.wrong), in.us, in.algbw, in.busbw,
              static_cast<long long>(in.wrong));
          std::fflush(stdout);
          rows.insert(rows.end(), placed.begin(), placed.end());
        }
      }
    }
    LMOE_CUDA_CHECK(cudaEventDestroy(start));
    LMOE_CUDA_CHECK(cudaEventDestroy(stop));
    LMOE_CUDA_CHECK(cudaStreamDestroy(stream));
  });
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{
      "lmoe_comm_bench: the communicators' collectives alone (nccl-tests style: algbw, busbw, "
      "#wrong)"};
  app.add_option("--comm", s.comms, "comm backends (p2p, nccl, cuda-threads)")->delimiter(',');
  app.add_option("--ops", s.ops, "all_reduce, reduce_scatter, all_gather")->delimiter(',');
  app.add_option("-n,--ranks", s.ranks, "ranks (default: one per visible GPU)");
  app.add_option("--bytes", s.bytes, "buffer sizes in bytes")->delimiter(',');
  app.add_option("--dtype", s.dtype, "bf16, f16 or f32");
  app.add_option("--warmup", s.warmup, "untimed calls per size");
  app.add_option("--iters", s.iters, "timed calls per size");
  app.add_option("--json", s.json_path, "also write the rows to this file");
  CLI11_PARSE(app, argc, argv);
  try {
    // The arguments first, before any GPU work.
    for (const std::string& op : s.ops) {
      LMOE_CHECK(parse_op(op).has_value(),
                 "--ops: expected all_reduce, reduce_scatter or all_gather, got '" + op + "'");
    }
    const std::optional<DType> dtype = parse_dtype(s.dtype);
    LMOE_CHECK(dtype.has_value(), "--dtype: expected bf16, f16 or f32, got '" + s.dtype + "'");
    for (const std::string& comm : s.comms) {
      LMOE_CHECK(comm == "p2p" || comm == "nccl" || comm == "cuda-threads",
                 "--comm: expected p2p, nccl or cuda-threads, got '" + comm + "'");
    }
    LMOE_CHECK(s.iters >= 1 && s.warmup >= 0,
               "--iters, --warmup: expected iters >= 1 and warmup >= 0, got " +
                   std::to_string(s.iters) + " and " + std::to_string(s.warmup));
    LMOE_CHECK(s.ranks >= 0, "--ranks: expected a positive count (or 0: one per GPU), got " +
                                 std::to_string(s.ranks));
    std::ofstream json_file;
    if (!s.json_path.empty()) {
      json_file.open(s.json_path);
      LMOE_CHECK(json_file.good(), "--json: cannot write " + s.json_path);
    }
    int visible = 0;
    LMOE_CUDA_CHECK(cudaGetDeviceCount(&visible));
    const int ranks = s.ranks > 0 ? s.ranks : visible;
    const std::int64_t esize = static_cast<std::int64_t>(lmoe::dtype_size(*dtype));
    for (const std::int64_t bytes : s.bytes) {
      LMOE_CHECK(bytes >= 8 * esize * ranks, "--bytes: expected at least 8 elements (" +
                                                 std::to_string(8 * esize) +
                                                 " bytes) per rank, got " + std::to_string(bytes));
    }
    std::printf(
        "# lmoe_comm_bench: %d ranks, %s, %d warm-up + %d timed calls per size (one CUDA graph "
        "where the comm is capturable); time: the slowest rank's; #wrong: output elements unlike "
        "the exact result, every rank's, of an eager call, a graph's and the timed calls'\n",
        ranks, s.dtype.c_str(), s.warmup, s.iters);
    std::printf("%14s %14s %12s %12s %10s %10s %10s %7s %10s %10s %10s %7s\n", "", "", "", "",
                "out-of-place", "", "", "", "in-place", "", "", "");
    std::printf("%14s %14s %12s %12s %10s %10s %10s %7s %10s %10s %10s %7s\n", "comm", "op",
                "bytes", "count", "time_us", "algbw_GB/s", "busbw_GB/s", "#wrong", "time_us",
                "algbw_GB/s", "busbw_GB/s", "#wrong");
    Json out = {{"tool", "lmoe_comm_bench"},
                {"ranks", ranks},
                {"gpus", visible},
                {"dtype", s.dtype},
                {"rows", Json::array()}};
    std::int64_t wrong = 0;
    for (const std::string& comm : s.comms) {
      if (const auto limit = lmoe::comm_group_limit(comm, ranks)) {
        std::printf("# %s skipped: %s\n", comm.c_str(), limit->c_str());
        continue;
      }
      for (const Row& row : measure(s, *dtype, comm, ranks)) {
        out["rows"].push_back({{"comm", row.comm},
                               {"op", row.op},
                               {"bytes", row.bytes},
                               {"count", row.count},
                               {"in_place", row.in_place},
                               {"time_us", row.us},
                               {"algbw_gbs", row.algbw},
                               {"busbw_gbs", row.busbw},
                               {"graph", row.graph},
                               {"wrong", row.wrong}});
        wrong += row.wrong;
      }
    }
    out["wrong"] = wrong;
    out["ok"] = wrong == 0;
    if (json_file.is_open()) json_file << out.dump(2) << "\n";
    if (wrong > 0) {
      std::fprintf(stderr, "lmoe_comm_bench: %lld output elements were wrong (#wrong)\n",
                   static_cast<long long>(wrong));
      return 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lmoe_comm_bench: error: %s\n", e.what());
    return 1;
  }
  return 0;
}

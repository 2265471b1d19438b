// lmoe_comm_bench: the bandwidth of the communicators' collectives alone, in the style of
// nccl-tests — all_reduce, reduce_scatter and all_gather over sizes, for every named comm backend
// (p2p, nccl, cuda-threads), ranks on threads of this process (one per GPU, or sharing GPUs where
// the backend allows it). The tiers' times at large T are mostly these collectives (docs/perf.md),
// so this is where a transport's bandwidth is measured and compared.
//
// Each (comm, op, size) is timed on every rank with CUDA events around `iters` back-to-back calls
// on the rank's stream after `warmup` calls (captured as one CUDA graph where the communicator is
// capturable), the ranks started together by a barrier; the time of a call is the slowest rank's
// elapsed time / iters. Columns as nccl-tests: algbw = bytes / time,
// busbw = algbw · 2(n−1)/n (all_reduce) or · (n−1)/n (reduce_scatter, all_gather), with bytes the
// whole buffer (all_reduce: each rank's input; reduce_scatter: each rank's input; all_gather:
// each rank's output). Inputs are random bf16; the results are not checked here (the p2p and nccl
// tests do that). A benchmark is a program, not a test: it prints a table (and --json FILE) and
// asserts nothing.
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "lmoe/comm_group.hpp"
#include "lmoe/error.hpp"
#include "tools/cuda/bench_fill.hpp"

namespace {

using lmoe::DType;
using lmoe::cuda::DeviceBuffer;
using Json = nlohmann::json;

struct Settings {
  std::vector<std::string> comms = {"p2p", "nccl"};
  std::vector<std::string> ops = {"all_reduce", "reduce_scatter", "all_gather"};
  int ranks = 0;  // 0: one per visible GPU
  std::vector<std::int64_t> bytes = {std::int64_t{1} << 20, std::int64_t{8} << 20,
                                     std::int64_t{64} << 20, std::int64_t{256} << 20};
  int warmup = 3;
  int iters = 20;
  std::string json_path;
};

struct Row {
  std::string comm, op;
  std::int64_t bytes = 0;
  double us = 0;  // per call, the slowest rank
  double algbw = 0, busbw = 0;
  bool graph = false;  // timed as one CUDA graph (else eagerly)
};

double bus_factor(const std::string& op, int n) {
  if (n == 1) return 0.0;
  return op == "all_reduce" ? 2.0 * (n - 1) / n : static_cast<double>(n - 1) / n;
}

// One collective of `op` over a buffer of `bytes` (its elements split evenly over the ranks for
// reduce_scatter and all_gather).
void run_op(lmoe::Communicator& comm, const std::string& op, const void* send, void* recv,
            std::size_t elements, cudaStream_t stream) {
  const int n = comm.size();
  const std::vector<std::size_t> counts(static_cast<std::size_t>(n),
                                        elements / static_cast<std::size_t>(n));
  if (op == "all_reduce") {
    comm.all_reduce(send, recv, elements, DType::bf16, stream);
  } else if (op == "reduce_scatter") {
    comm.reduce_scatter(send, recv, counts, DType::bf16, stream);
  } else {
    comm.all_gather(send, recv, counts, DType::bf16, stream);
  }
}

std::vector<Row> measure(const Settings& s, const std::string& comm_name, int ranks) {
  std::vector<Row> rows;
  std::mutex mutex;
  int visible = 0;
  LMOE_CUDA_CHECK(cudaGetDeviceCount(&visible));
  lmoe::run_comm_group(comm_name, ranks, [&](int rank, lmoe::Communicator& comm) {
    LMOE_CUDA_CHECK(cudaSetDevice(rank % visible));
    cudaStream_t stream = nullptr;
    LMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaEvent_t start = nullptr, stop = nullptr;
    LMOE_CUDA_CHECK(cudaEventCreate(&start));
    LMOE_CUDA_CHECK(cudaEventCreate(&stop));
    const std::int64_t most = *std::max_element(s.bytes.begin(), s.bytes.end());
    DeviceBuffer send(static_cast<std::size_t>(most)), recv(static_cast<std::size_t>(most));
    LMOE_CUDA_CHECK(lmoe::cuda::launch_fill_bench_values(
        send.data(), most / 2, DType::bf16, 1234u + static_cast<std::uint64_t>(rank), stream));
    for (const std::string& op : s.ops) {
      for (const std::int64_t bytes : s.bytes) {
        // Elements a multiple of 8 per rank, so that every rank's block is 16-byte aligned.
        const std::size_t per_rank = static_cast<std::size_t>(bytes / 2 / ranks) / 8 * 8;
        const std::size_t elements = per_rank * static_cast<std::size_t>(ranks);
        // all_gather's send is one rank's block; its output is the whole buffer.
        for (int i = 0; i < s.warmup; ++i)
          run_op(comm, op, send.data(), recv.data(), elements, stream);
        LMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
        // Capturable communicators (p2p, nccl): the timed calls are one CUDA graph, so the time is
        // the GPU's, not the host's enqueueing; the others run eagerly.
        cudaGraphExec_t graph = nullptr;
        if (comm.graph_capturable()) {
          cudaGraph_t captured = nullptr;
          LMOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
          for (int i = 0; i < s.iters; ++i)
            run_op(comm, op, send.data(), recv.data(), elements, stream);
          LMOE_CUDA_CHECK(cudaStreamEndCapture(stream, &captured));
          LMOE_CUDA_CHECK(cudaGraphInstantiate(&graph, captured, 0));
          LMOE_CUDA_CHECK(cudaGraphDestroy(captured));
          LMOE_CUDA_CHECK(
              cudaGraphLaunch(graph, stream));  // warm: the graph's first launch uploads it
          LMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
        }
        comm.barrier();
        LMOE_CUDA_CHECK(cudaEventRecord(start, stream));
        if (graph) {
          LMOE_CUDA_CHECK(cudaGraphLaunch(graph, stream));
        } else {
          for (int i = 0; i < s.iters; ++i)
            run_op(comm, op, send.data(), recv.data(), elements, stream);
        }
        LMOE_CUDA_CHECK(cudaEventRecord(stop, stream));
        LMOE_CUDA_CHECK(cudaEventSynchronize(stop));
        float ms = 0;
        LMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
        if (graph) LMOE_CUDA_CHECK(cudaGraphExecDestroy(graph));
        const double mine = 1000.0 * ms / s.iters;
        std::vector<double> all(static_cast<std::size_t>(ranks));
        comm.control_all_gather(&mine, all.data(), sizeof(double));
        if (rank == 0) {
          Row row{comm_name, op, static_cast<std::int64_t>(elements * 2),
                  *std::max_element(all.begin(), all.end())};
          row.graph = comm.graph_capturable();
          row.algbw = static_cast<double>(row.bytes) / (row.us * 1e3);
          row.busbw = row.algbw * bus_factor(op, ranks);
          const std::lock_guard lock(mutex);
          rows.push_back(row);
          std::printf("%14s %14s %12lld %10.1f %10.2f %10.2f\n", row.comm.c_str(), row.op.c_str(),
                      static_cast<long long>(row.bytes), row.us, row.algbw, row.busbw);
          std::fflush(stdout);
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
      "lmoe_comm_bench: the communicators' collectives alone (nccl-tests style: algbw, busbw)"};
  app.add_option("--comm", s.comms, "comm backends (p2p, nccl, cuda-threads)")->delimiter(',');
  app.add_option("--ops", s.ops, "all_reduce, reduce_scatter, all_gather")->delimiter(',');
  app.add_option("-n,--ranks", s.ranks, "ranks (default: one per visible GPU)");
  app.add_option("--bytes", s.bytes, "buffer sizes in bytes")->delimiter(',');
  app.add_option("--warmup", s.warmup, "untimed calls per size");
  app.add_option("--iters", s.iters, "timed calls per size");
  app.add_option("--json", s.json_path, "also write the rows to this file");
  CLI11_PARSE(app, argc, argv);
  try {
    // The arguments first, before any GPU work.
    for (const std::string& op : s.ops) {
      LMOE_CHECK(op == "all_reduce" || op == "reduce_scatter" || op == "all_gather",
                 "--ops: expected all_reduce, reduce_scatter or all_gather, got '" + op + "'");
    }
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
    for (const std::int64_t bytes : s.bytes) {
      LMOE_CHECK(bytes >= 16 * ranks,
                 "--bytes: expected at least 16 bytes per rank, got " + std::to_string(bytes));
    }
    std::printf(
        "# lmoe_comm_bench: %d ranks, bf16, %d warm-up + %d timed calls per size (one CUDA graph "
        "where the comm "
        "is capturable); time: the slowest rank's\n",
        ranks, s.warmup, s.iters);
    std::printf("%14s %14s %12s %10s %10s %10s\n", "comm", "op", "bytes", "time_us", "algbw_GB/s",
                "busbw_GB/s");
    Json out = {
        {"tool", "lmoe_comm_bench"}, {"ranks", ranks}, {"gpus", visible}, {"rows", Json::array()}};
    for (const std::string& comm : s.comms) {
      if (const auto limit = lmoe::comm_group_limit(comm, ranks)) {
        std::printf("# %s skipped: %s\n", comm.c_str(), limit->c_str());
        continue;
      }
      for (const Row& row : measure(s, comm, ranks)) {
        out["rows"].push_back({{"comm", row.comm},
                               {"op", row.op},
                               {"bytes", row.bytes},
                               {"time_us", row.us},
                               {"algbw_gbs", row.algbw},
                               {"busbw_gbs", row.busbw},
                               {"graph", row.graph}});
      }
    }
    if (json_file.is_open()) json_file << out.dump(2) << "\n";
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lmoe_comm_bench: error: %s\n", e.what());
    return 1;
  }
  return 0;
}

// lmoe_spin_probe: can this GPU run the spinning kernels of several ranks' streams at the same
// time?
//
// The P2P collectives (docs/p2p.md) make every rank's kernel wait, on the device, for its peers'
// kernels. When ranks share one GPU that only works if their kernels are resident together. This
// program isolates the ways that can fail, one scenario at a time, with nothing of the tail around:
//
//   queues   K host threads, one stream each, R rounds of a handshake kernel (each rank's blocks
//            arrive on a counter and wait for all ranks' blocks): does any round stall?
//   stride   the same with S-1 unused streams created between two ranks' streams: streams that
//            land on one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS) serialize, so a stride that
//            folds two ranks onto one queue stalls every time if streams take queues round-robin;
//   gemm     one rank runs a cuBLASLt GEMM before each handshake while its peers already spin:
//            with a shape seen for the first time (first launch of a kernel, module loading) and
//            with a shape already run (GPU residency of a large GEMM beside spinning blocks).
//
// Every wait is bounded (--timeout-ms); a stall is counted, aborts the remaining rounds, and the
// program goes on. Output: one line per scenario, and --json FILE. Not a test: it asserts nothing.
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "cuda/gemm/cublaslt_gemm.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_buffer.hpp"

namespace {

struct ProbeState {
  unsigned arrived[4096];  // per round: blocks of all ranks that arrived
  int aborted;
  int stalled_round;
};

__device__ unsigned long long probe_clock() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Every block arrives on the round's counter, then waits until every rank's blocks have arrived.
__global__ void handshake(ProbeState* state, int round, unsigned expected,
                          unsigned long long timeout_ns) {
  if (threadIdx.x == 0) {
    if (atomicAdd(&state->aborted, 0) == 0) {
      atomicAdd(&state->arrived[round], 1u);
      __threadfence();
      const unsigned long long start = probe_clock();
      while (atomicAdd(&state->arrived[round], 0u) < expected) {
        if (atomicAdd(&state->aborted, 0) != 0) break;
        if (probe_clock() - start > timeout_ns) {
          atomicCAS(&state->stalled_round, -1, round);
          atomicExch(&state->aborted, 1);
          break;
        }
      }
    }
  }
  __syncthreads();
}

struct Result {
  std::string scenario;
  int ranks, rounds, completed, stalled_round;
  double seconds;
};

struct Probe {
  int blocks = 4, threads = 512, rounds = 200;
  unsigned long long timeout_ns = 500000000ull;

  // Runs `rounds` handshakes on `streams` (one host thread per rank); before every handshake, rank
  // 0 calls `before(round, stream)` when given.
  template <typename Before>
  Result run(const char* name, std::vector<cudaStream_t> streams, Before before) {
    const int ranks = static_cast<int>(streams.size());
    lmoe::cuda::DeviceBuffer state(sizeof(ProbeState));
    LMOE_CUDA_CHECK(cudaMemset(state.data(), 0, sizeof(ProbeState)));
    const int minus_one = -1;
    LMOE_CUDA_CHECK(
        cudaMemcpy(static_cast<char*>(state.data()) + offsetof(ProbeState, stalled_round),
                   &minus_one, sizeof(int), cudaMemcpyHostToDevice));
    LMOE_CUDA_CHECK(cudaDeviceSynchronize());
    auto* s = static_cast<ProbeState*>(state.data());
    const unsigned expected = static_cast<unsigned>(ranks * blocks);
    const auto start = std::chrono::steady_clock::now();
    std::vector<std::thread> threads_of_ranks;
    for (int r = 0; r < ranks; ++r) {
      threads_of_ranks.emplace_back([&, r] {
        for (int round = 0; round < rounds; ++round) {
          if (r == 0) before(round, streams[0]);
          handshake<<<blocks, threads, 0, streams[r]>>>(s, round, expected, timeout_ns);
        }
        LMOE_CUDA_CHECK(cudaStreamSynchronize(streams[r]));
      });
    }
    for (auto& t : threads_of_ranks) t.join();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ProbeState host{};
    LMOE_CUDA_CHECK(cudaMemcpy(&host, s, sizeof(host), cudaMemcpyDeviceToHost));
    int completed = 0;
    while (completed < rounds && host.arrived[completed] == expected) ++completed;
    Result result{name, ranks, rounds, completed, host.stalled_round, seconds};
    std::printf(
        "%-34s ranks %2d  rounds %4d  completed %4d  %s  %.3f s\n", name, ranks, rounds, completed,
        host.stalled_round < 0 ? "ok     "
                               : ("STALLED at round " + std::to_string(host.stalled_round)).c_str(),
        seconds);
    std::fflush(stdout);
    return result;
  }
};

std::vector<cudaStream_t> make_streams(int ranks, int stride, std::vector<cudaStream_t>& all) {
  std::vector<cudaStream_t> mine;
  for (int r = 0; r < ranks; ++r) {
    for (int k = 0; k < stride; ++k) {
      cudaStream_t stream;
      LMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      all.push_back(stream);
      if (k == 0) mine.push_back(stream);
    }
  }
  return mine;
}

}  // namespace

int main(int argc, char** argv) {
  Probe probe;
  const char* json = nullptr;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&] {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--blocks")
      probe.blocks = std::atoi(value());
    else if (arg == "--threads")
      probe.threads = std::atoi(value());
    else if (arg == "--rounds")
      probe.rounds = std::atoi(value());
    else if (arg == "--timeout-ms")
      probe.timeout_ns = std::strtoull(value(), nullptr, 10) * 1000000ull;
    else if (arg == "--json")
      json = value();
    else {
      std::fprintf(stderr,
                   "usage: lmoe_spin_probe [--blocks N] [--threads N] [--rounds N] [--timeout-ms "
                   "N] [--json FILE]\n");
      return 2;
    }
  }
  if (probe.rounds < 1 || probe.rounds > 4096) {
    std::fprintf(stderr, "--rounds must be in [1, 4096]\n");
    return 2;
  }
  const char* connections = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  const char* loading = std::getenv("CUDA_MODULE_LOADING");
  std::printf("CUDA_DEVICE_MAX_CONNECTIONS=%s CUDA_MODULE_LOADING=%s blocks %d threads %d\n",
              connections ? connections : "(unset)", loading ? loading : "(unset)", probe.blocks,
              probe.threads);
  std::vector<Result> results;
  std::vector<cudaStream_t> all;
  auto nothing = [](int, cudaStream_t) {};

  for (int ranks : {2, 4, 8, 16, 33, 40}) {
    results.push_back(probe.run("queues", make_streams(ranks, 1, all), nothing));
  }
  for (int stride : {2, 4, 8, 16, 32}) {
    const std::string name = "stride " + std::to_string(stride);
    results.push_back(probe.run(name.c_str(), make_streams(2, stride, all), nothing));
  }

  // GEMMs on rank 0 before each handshake, peers already spinning.
  lmoe::cuda::CublasLtGemm gemm;
  const std::int64_t m = 4096, n = 4096, k = 4096;
  lmoe::cuda::DeviceBuffer a(static_cast<std::size_t>(m * k) * 2),
      w(static_cast<std::size_t>(n * k) * 2), d(static_cast<std::size_t>(m * n) * 4);
  LMOE_CUDA_CHECK(cudaMemset(a.data(), 0, a.bytes()));
  LMOE_CUDA_CHECK(cudaMemset(w.data(), 0, w.bytes()));
  LMOE_CUDA_CHECK(cudaDeviceSynchronize());
  {
    // A new shape every round: the first launch of each plan happens while the peers spin.
    auto fresh = [&](int round, cudaStream_t stream) {
      gemm.run(a.data(), w.data(), k, d.data(), n, 64 + 64 * (round % 60), n, k, lmoe::DType::bf16,
               lmoe::DType::f32, stream);
    };
    Probe short_probe = probe;
    short_probe.rounds = 60;
    results.push_back(short_probe.run("gemm, new shapes", make_streams(4, 1, all), fresh));
  }
  {
    auto warm = [&](int, cudaStream_t stream) {
      gemm.run(a.data(), w.data(), k, d.data(), n, m, n, k, lmoe::DType::bf16, lmoe::DType::f32,
               stream);
    };
    cudaStream_t s;
    LMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    warm(0, s);
    LMOE_CUDA_CHECK(cudaStreamSynchronize(s));
    all.push_back(s);
    for (int ranks : {2, 8}) {
      const std::string name = "gemm 4096^3, warm, ranks " + std::to_string(ranks);
      results.push_back(probe.run(name.c_str(), make_streams(ranks, 1, all), warm));
    }
  }
  for (cudaStream_t s : all) cudaStreamDestroy(s);

  if (json) {
    FILE* f = std::fopen(json, "w");
    if (!f) {
      std::perror(json);
      return 1;
    }
    std::fprintf(f,
                 "{\"connections\": \"%s\", \"module_loading\": \"%s\", \"blocks\": %d, "
                 "\"threads\": %d, \"results\": [",
                 connections ? connections : "", loading ? loading : "", probe.blocks,
                 probe.threads);
    for (std::size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      std::fprintf(f,
                   "%s{\"scenario\": \"%s\", \"ranks\": %d, \"rounds\": %d, \"completed\": %d, "
                   "\"stalled_round\": %d, \"seconds\": %.6f}",
                   i ? ", " : "", r.scenario.c_str(), r.ranks, r.rounds, r.completed,
                   r.stalled_round, r.seconds);
    }
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  return 0;
}

// lmoe_launch_floor: what a graph replay costs in `lmoe bench` before any tail work.
//
// `lmoe bench` (graph mode) times each forward as one graph launch between two CUDA events on the
// rank's stream, the iterations issued back to back, and reports the median. Part of every such
// time is the replay itself: the graph's launch, each kernel's launch and block scheduling (with
// the large shared-memory configuration the fused kernels ask for), and the events. This program
// times graphs that do nothing else, the same way, in the shapes the fused tier uses:
//
//   one block          one kernel of one warp;
//   one wave           one kernel of a block per SM, 384 threads, ~200 KB of dynamic shared memory
//                      each (the chained up-projection's shape);
//   two, chained       a kernel of 128 small blocks, then the one-wave kernel launched with
//                      programmatic dependent launch (it waits for the first with
//                      griddepcontrol.wait), as the chained path at tp 1 (norm, then
//                      up-projection);
//   two, serialized    the same two kernels without the attribute.
//
// Quantiles by nearest rank (benchmarks/graph_timer.hpp), where `lmoe bench` interpolates. The
// kernels do no memory work, so the times are the floor under any tail of that shape measured
// by `lmoe bench` on this GPU (docs/fused.md). Prints a table and, with --json FILE, JSON. Asserts
// nothing.
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/hopper_async.cuh"
#include "cuda/runtime/launch_config.hpp"
#include "graph_timer.hpp"
#include "lmoe/error.hpp"

namespace {

using Json = nlohmann::json;

constexpr int kSmallBlocks = 128, kSmallThreads = 256;
constexpr int kWaveThreads = 384;
constexpr int kWaveSharedBytes = 200 * 1024;

// Each block writes one word, so that no block is optimized away. The first kernel of a chained
// pair lets the second start at once, as the chained path's norm kernel does.
__global__ void small_kernel(unsigned* sink) {
  lmoe::cuda::pdl_launch_dependents();
  if (threadIdx.x == 0) sink[blockIdx.x] = blockIdx.x;
}

// The one-wave kernel; waits for the kernel before it where it was launched with programmatic
// dependent launch (a no-op otherwise).
__global__ void wave_kernel(unsigned* sink) {
  extern __shared__ unsigned wave_smem[];
  lmoe::cuda::pdl_wait();
  if (threadIdx.x == 0) {
    wave_smem[0] = blockIdx.x;
    sink[kSmallBlocks + blockIdx.x] = wave_smem[0];
  }
}

struct Settings {
  int warmup = 20, iters = 200;
  std::string json_path;
};

struct Row {
  std::string name;
  lmoe::bench::Timing timing;
};

int run(const Settings& settings) {
  int device = 0, sms = 0;
  LMOE_CUDA_CHECK(cudaGetDevice(&device));
  LMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  cudaDeviceProp properties{};
  LMOE_CUDA_CHECK(cudaGetDeviceProperties(&properties, device));
  LMOE_CUDA_CHECK(cudaFuncSetAttribute(wave_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       kWaveSharedBytes));
  unsigned* sink = nullptr;
  LMOE_CUDA_CHECK(
      cudaMalloc(&sink, sizeof(unsigned) * static_cast<std::size_t>(kSmallBlocks + sms)));
  cudaStream_t stream = nullptr;
  LMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  const auto launch_wave = [&](bool chained) {
    lmoe::cuda::LaunchConfig config(dim3(static_cast<unsigned>(sms)), dim3(kWaveThreads),
                                    kWaveSharedBytes, stream);
    LMOE_CUDA_CHECK(cudaLaunchKernelEx(config.programmatic(chained).get(), wave_kernel, sink));
  };
  // One operation per graph launch (no amortizing copies), an event before and after each launch,
  // back to back: as `lmoe bench` times a forward.
  const lmoe::bench::TimerSettings timer_settings{settings.warmup, settings.iters, 0.0};
  lmoe::bench::Timer timer(timer_settings, stream);
  const auto time_graph = [&](const char* name, const std::function<void()>& enqueue) {
    const lmoe::bench::Timing timing = timer.time([&](int) { enqueue(); });
    if (timing.inner != 1) throw lmoe::Error("lmoe_launch_floor: expected one operation a graph");
    return Row{name, timing};
  };
  std::vector<Row> rows;
  rows.push_back(time_graph("one block", [&] {
    small_kernel<<<1, 32, 0, stream>>>(sink);
    LMOE_CUDA_CHECK(cudaGetLastError());
  }));
  rows.push_back(time_graph("one wave", [&] { launch_wave(false); }));
  rows.push_back(time_graph("two, chained", [&] {
    small_kernel<<<kSmallBlocks, kSmallThreads, 0, stream>>>(sink);
    LMOE_CUDA_CHECK(cudaGetLastError());
    launch_wave(true);
  }));
  rows.push_back(time_graph("two, serialized", [&] {
    small_kernel<<<kSmallBlocks, kSmallThreads, 0, stream>>>(sink);
    LMOE_CUDA_CHECK(cudaGetLastError());
    launch_wave(false);
  }));

  std::printf(
      "# lmoe_launch_floor: %s, %d SMs; graph replays timed as lmoe bench does (an event "
      "before and after each, back to back), %d iterations after %d warm-up\n",
      properties.name, sms, settings.iters, settings.warmup);
  std::printf("%-16s %10s %8s %8s\n", "graph", "median_us", "p10_us", "p90_us");
  Json json_rows = Json::array();
  for (const Row& row : rows) {
    std::printf("%-16s %10.2f %8.2f %8.2f\n", row.name.c_str(), row.timing.median_us,
                row.timing.p10_us, row.timing.p90_us);
    json_rows.push_back({{"graph", row.name},
                         {"median_us", row.timing.median_us},
                         {"p10_us", row.timing.p10_us},
                         {"p90_us", row.timing.p90_us}});
  }
  if (!settings.json_path.empty()) {
    std::ofstream file(settings.json_path);
    if (!file) throw lmoe::Error("--json: cannot write '" + settings.json_path + "'");
    file << Json{{"gpu", properties.name},
                 {"sms", sms},
                 {"iters", settings.iters},
                 {"warmup", settings.warmup},
                 {"rows", json_rows}}
                .dump(2)
         << "\n";
  }
  LMOE_CUDA_CHECK(cudaStreamDestroy(stream));
  LMOE_CUDA_CHECK(cudaFree(sink));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Settings settings;
  CLI::App app{
      "lmoe_launch_floor: the time of graph replays that do no work, timed as lmoe bench "
      "times a tail"};
  app.add_option("--iters", settings.iters, "timed graph launches per row")
      ->check(CLI::Range(1, 100000));
  app.add_option("--warmup", settings.warmup, "untimed graph launches per row")
      ->check(CLI::Range(0, 100000));
  app.add_option("--json", settings.json_path, "write the results as JSON to this file");
  CLI11_PARSE(app, argc, argv);
  try {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      std::fprintf(stderr, "lmoe_launch_floor: no CUDA device\n");
      return 1;
    }
    return run(settings);
  } catch (const lmoe::Error& error) {
    std::fprintf(stderr, "lmoe_launch_floor: %s\n", error.what());
    return 1;
  }
}

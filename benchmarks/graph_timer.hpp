// What the benchmark programs share: one operation timed as a CUDA graph of `inner` copies of it
// (enough for about graph_target_us of GPU time), launched `repeats` times after `warmup`, with
// CUDA events; per-operation median and 10th/90th percentiles. And the probes' plain timing of
// launches issued back to back. Host code; benchmarks only.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <functional>
#include <vector>

#include "cuda/runtime/cuda_check.hpp"

namespace lmoe::bench {

struct TimerSettings {
  int warmup = 5;
  int repeats = 30;
  double graph_target_us = 2000;  // GPU time of one timed graph launch
};

struct Timing {
  double median_us = 0, p10_us = 0, p90_us = 0;  // per operation
  int inner = 1;                                 // operations per graph launch
};

// The q-quantile of samples (nearest rank).
inline double quantile(std::vector<double> samples, double q) {
  std::sort(samples.begin(), samples.end());
  const auto rank =
      static_cast<std::size_t>(std::lround(q * static_cast<double>(samples.size() - 1)));
  return samples[rank];
}

class Timer {
 public:
  Timer(const TimerSettings& settings, cudaStream_t stream) : settings_(settings), stream_(stream) {
    LMOE_CUDA_CHECK(cudaEventCreate(&start_));
    LMOE_CUDA_CHECK(cudaEventCreate(&stop_));
  }
  ~Timer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;

  // enqueue(i) puts the i-th operation on the stream (i selects a rotating buffer set).
  Timing time(const std::function<void(int)>& enqueue) { return time_together({enqueue})[0]; }

  // Several ways of doing one operation, each in its own graph, timed in turns: repeat r launches
  // every way's graph once, so a clock that drifts over the run moves every way alike (timed one
  // after the other, the same kernel measured up to 18 % apart a few rows later).
  std::vector<Timing> time_together(const std::vector<std::function<void(int)>>& ways) {
    const std::size_t n = ways.size();
    std::vector<Timing> timings(n);
    std::vector<cudaGraph_t> graphs(n, nullptr);
    std::vector<cudaGraphExec_t> execs(n, nullptr);
    for (std::size_t w = 0; w < n; ++w) {
      // Calibrate: the first calls also build cuBLASLt plans and load modules, outside any capture.
      for (int i = 0; i < 2; ++i) ways[w](i);
      LMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
      LMOE_CUDA_CHECK(cudaEventRecord(start_, stream_));
      ways[w](0);
      LMOE_CUDA_CHECK(cudaEventRecord(stop_, stream_));
      LMOE_CUDA_CHECK(cudaEventSynchronize(stop_));
      float single_ms = 0;
      LMOE_CUDA_CHECK(cudaEventElapsedTime(&single_ms, start_, stop_));
      timings[w].inner = static_cast<int>(std::clamp(
          std::ceil(settings_.graph_target_us / std::max(1.0, single_ms * 1e3)), 1.0, 256.0));
      LMOE_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
      for (int i = 0; i < timings[w].inner; ++i) ways[w](i);
      LMOE_CUDA_CHECK(cudaStreamEndCapture(stream_, &graphs[w]));
      LMOE_CUDA_CHECK(cudaGraphInstantiate(&execs[w], graphs[w], 0));
      for (int i = 0; i < settings_.warmup; ++i)
        LMOE_CUDA_CHECK(cudaGraphLaunch(execs[w], stream_));
    }
    const std::size_t repeats = static_cast<std::size_t>(settings_.repeats);
    std::vector<cudaEvent_t> events(2 * repeats * n);
    for (cudaEvent_t& event : events) LMOE_CUDA_CHECK(cudaEventCreate(&event));
    for (std::size_t r = 0; r < repeats; ++r) {
      for (std::size_t w = 0; w < n; ++w) {
        LMOE_CUDA_CHECK(cudaEventRecord(events[2 * (r * n + w)], stream_));
        LMOE_CUDA_CHECK(cudaGraphLaunch(execs[w], stream_));
        LMOE_CUDA_CHECK(cudaEventRecord(events[2 * (r * n + w) + 1], stream_));
      }
    }
    LMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    for (std::size_t w = 0; w < n; ++w) {
      std::vector<double> per_op_us;
      for (std::size_t r = 0; r < repeats; ++r) {
        float ms = 0;
        LMOE_CUDA_CHECK(
            cudaEventElapsedTime(&ms, events[2 * (r * n + w)], events[2 * (r * n + w) + 1]));
        per_op_us.push_back(ms * 1e3 / timings[w].inner);
      }
      timings[w].median_us = quantile(per_op_us, 0.5);
      timings[w].p10_us = quantile(per_op_us, 0.1);
      timings[w].p90_us = quantile(per_op_us, 0.9);
      LMOE_CUDA_CHECK(cudaGraphExecDestroy(execs[w]));
      LMOE_CUDA_CHECK(cudaGraphDestroy(graphs[w]));
    }
    for (cudaEvent_t event : events) cudaEventDestroy(event);
    return timings;
  }

 private:
  const TimerSettings& settings_;
  cudaStream_t stream_;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

// The mean µs of `iters` launches issued back to back on `stream` between two events, after
// three untimed; body(i) issues launch i (a probe may rotate its inputs by i so that every launch
// reads from memory, not L2).
inline double back_to_back_us(const std::function<void(int)>& body, cudaStream_t stream,
                              int iters) {
  cudaEvent_t start, stop;
  LMOE_CUDA_CHECK(cudaEventCreate(&start));
  LMOE_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) body(i);
  LMOE_CUDA_CHECK(cudaEventRecord(start, stream));
  for (int i = 0; i < iters; ++i) body(i);
  LMOE_CUDA_CHECK(cudaEventRecord(stop, stream));
  LMOE_CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  LMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  LMOE_CUDA_CHECK(cudaEventDestroy(start));
  LMOE_CUDA_CHECK(cudaEventDestroy(stop));
  return 1000.0 * ms / iters;
}

}  // namespace lmoe::bench

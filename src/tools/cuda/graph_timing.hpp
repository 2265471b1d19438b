// What the GPU benchmarks share to time CUDA graphs: owning handles for streams, events and
// instantiated graphs, timing events, and a thread-local capture of one forward into a graph
// (`lmoe bench`'s graph modes, `lmoe layer --graph`). Host code only.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <vector>

#include "cuda/runtime/cuda_check.hpp"

namespace lmoe::cuda {

struct StreamDeleter {
  void operator()(cudaStream_t stream) const {
    cudaStreamSynchronize(stream);
    cudaStreamDestroy(stream);
  }
};
struct EventDeleter {
  void operator()(cudaEvent_t event) const { cudaEventDestroy(event); }
};
struct GraphExecDeleter {
  void operator()(cudaGraphExec_t exec) const { cudaGraphExecDestroy(exec); }
};
using UniqueStream = std::unique_ptr<CUstream_st, StreamDeleter>;
using UniqueEvent = std::unique_ptr<CUevent_st, EventDeleter>;
using UniqueGraphExec = std::unique_ptr<CUgraphExec_st, GraphExecDeleter>;

inline UniqueEvent make_timing_event() {
  cudaEvent_t event = nullptr;
  LMOE_CUDA_CHECK(cudaEventCreate(&event));
  return UniqueEvent(event);
}

// Times `count` iterations issued back to back on one stream, as an engine issues layers: each
// bracketed by events on the stream, so its time is what the stream spent on it (any wait for the
// host or for peers included); `before(i)` is enqueued ahead of each start event, outside the
// timed span (e.g. an L2 eviction), with no host synchronization between iterations.
class StreamTimer {
 public:
  template <typename Before, typename Body>
  std::vector<double> time(cudaStream_t stream, int count, Before&& before, Body&& body) {
    while (static_cast<int>(starts_.size()) < count) {
      starts_.push_back(make_timing_event());
      stops_.push_back(make_timing_event());
    }
    for (int i = 0; i < count; ++i) {
      before(i);
      LMOE_CUDA_CHECK(cudaEventRecord(starts_[i].get(), stream));
      body(i);
      LMOE_CUDA_CHECK(cudaEventRecord(stops_[i].get(), stream));
    }
    LMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<double> seconds;
    for (int i = 0; i < count; ++i) {
      float ms = 0;
      LMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, starts_[i].get(), stops_[i].get()));
      seconds.push_back(static_cast<double>(ms) * 1e-3);
    }
    return seconds;
  }

 private:
  std::vector<UniqueEvent> starts_, stops_;  // reused from one call to the next
};

// Captures what `issue` enqueues on `stream` and instantiates it. Thread-local capture: ranks on
// other threads capture their own streams at the same time. An error in `issue` ends the capture
// (so the stream is usable again) and is rethrown.
template <typename Issue>
UniqueGraphExec capture_graph(cudaStream_t stream, Issue&& issue) {
  LMOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  cudaGraph_t graph = nullptr;
  try {
    issue();
  } catch (...) {
    if (cudaStreamEndCapture(stream, &graph) == cudaSuccess && graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    throw;
  }
  LMOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t instantiated = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  LMOE_CUDA_CHECK(instantiated);
  return UniqueGraphExec(exec);
}

}  // namespace lmoe::cuda

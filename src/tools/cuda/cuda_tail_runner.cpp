#include "tools/cuda/cuda_tail_runner.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "cuda/runtime/owned_stream.hpp"
#include "lmoe/error.hpp"

namespace lmoe {

namespace {

// An instantiated CUDA graph of one captured call.
class Graph {
 public:
  Graph() = default;
  // Captures what fn issues on `stream` (thread-local mode: other ranks' threads capture their
  // own). A failure during capture ends the capture before the error propagates.
  template <typename Fn>
  static Graph capture(cudaStream_t stream, Fn&& fn) {
    LMOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    cudaGraph_t captured = nullptr;
    try {
      fn();
    } catch (...) {
      cudaStreamEndCapture(stream, &captured);
      if (captured) cudaGraphDestroy(captured);
      cudaGetLastError();
      throw;
    }
    LMOE_CUDA_CHECK(cudaStreamEndCapture(stream, &captured));
    Graph graph;
    const cudaError_t status = cudaGraphInstantiate(&graph.exec_, captured, 0);
    cudaGraphDestroy(captured);
    LMOE_CUDA_CHECK(status);
    return graph;
  }
  Graph(Graph&& other) noexcept : exec_(std::exchange(other.exec_, nullptr)) {}
  Graph& operator=(Graph&&) = delete;
  Graph(const Graph&) = delete;
  ~Graph() {
    if (exec_) cudaGraphExecDestroy(exec_);
  }
  explicit operator bool() const { return exec_ != nullptr; }
  void launch(cudaStream_t stream) const { LMOE_CUDA_CHECK(cudaGraphLaunch(exec_, stream)); }
  // Moves the graph's device state into place now rather than at its first launch.
  void upload(cudaStream_t stream) const {
    LMOE_CUDA_CHECK(cudaGraphUpload(exec_, stream));
    LMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

 private:
  cudaGraphExec_t exec_ = nullptr;
};

MatrixView device_view(const cuda::DeviceBuffer& buffer, DType dtype, std::int64_t rows,
                       std::int64_t cols) {
  return {buffer.data(), dtype, rows, cols, cols, MemorySpace::device};
}

}  // namespace

RankRun run_case_rank_cuda(const TailCase& c, Communicator& comm, const RunOptions& options) {
  LatentTail tail(tail_options_for(c, comm, options), comm, c.norm_weight.matrix(),
                  c.up_proj_weight.matrix());

  const int rank = comm.rank();
  const std::int64_t tokens = c.num_tokens, d = c.dims.d_model, l = c.dims.d_latent;
  const std::size_t esize = dtype_size(c.dtype);
  const ConstMatrixView routed_in = c.routed.slice_matrix(rank);  // [T, l], host
  const ConstMatrixView shared_in = c.shared.slice_matrix(rank);  // [T, d], host
  const cuda::DeviceBuffer routed(static_cast<std::size_t>(tokens * l) * esize);
  const cuda::DeviceBuffer shared(static_cast<std::size_t>(tokens * d) * esize);
  const cuda::DeviceBuffer y(static_cast<std::size_t>(tokens * d) * esize);
  const cuda::OwnedStream stream;
  if (routed.bytes()) {
    LMOE_CUDA_CHECK(
        cudaMemcpy(routed.data(), routed_in.data, routed.bytes(), cudaMemcpyHostToDevice));
  }

  RankRun run;
  run.y = HostTensor(c.dtype, {tokens, d});
  const auto forward = [&] {
    return tail.forward(device_view(routed, c.dtype, tokens, l),
                        device_view(shared, c.dtype, tokens, d), device_view(y, c.dtype, tokens, d),
                        options.tier, stream.get());
  };
  // The call may overwrite `shared` (column accumulates into it): start from the input each time.
  // All bits set is NaN in every dtype: an element the tail does not write cannot pass.
  const auto refresh = [&] {
    if (!shared.bytes()) return;
    LMOE_CUDA_CHECK(cudaMemcpyAsync(shared.data(), shared_in.data, shared.bytes(),
                                    cudaMemcpyHostToDevice, stream.get()));
    LMOE_CUDA_CHECK(cudaMemsetAsync(y.data(), 0xff, y.bytes(), stream.get()));
  };
  // Graph mode makes one eager call first (its output is overwritten below): ranks that share a GPU
  // then run each GEMM shape once outside any collective (cuda_tail_executor.cpp, warm_up_gemms).
  if (options.graph && tokens > 0) {
    comm.barrier();
    LMOE_CUDA_CHECK(cudaDeviceSynchronize());
    comm.barrier();
    refresh();
    forward();
    LMOE_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    comm.barrier();
  }
  const Graph graph = options.graph && tokens > 0
                          ? Graph::capture(stream.get(), [&] { run.tier = forward(); })
                          : Graph();
  if (graph) graph.upload(stream.get());
  // Every rank's setup has finished on the GPU before any rank's collectives start: ranks that
  // share a GPU and spin on each other (p2p) must not wait behind a peer's unfinished setup work.
  // The first barrier keeps a peer's capture from being cut short by this device-wide wait.
  comm.barrier();
  LMOE_CUDA_CHECK(cudaDeviceSynchronize());
  for (int repeat = 0; repeat < std::max(1, options.repeats); ++repeat) {
    refresh();
    LMOE_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    comm.barrier();
    const auto start = std::chrono::steady_clock::now();
    if (graph) {
      graph.launch(stream.get());
    } else {
      run.tier = forward();
    }
    LMOE_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    comm.barrier();
    run.seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  if (y.bytes())
    LMOE_CUDA_CHECK(cudaMemcpy(run.y.data(), y.data(), y.bytes(), cudaMemcpyDeviceToHost));
  return run;
}

}  // namespace lmoe

#include "tools/cuda/cuda_layer_runner.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>

#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "cuda/runtime/owned_stream.hpp"

namespace lmoe {

namespace {

// A device copy of a host tensor's shape, as a matrix view.
struct DeviceMatrix {
  cuda::DeviceBuffer buffer;
  MatrixView view;
  DeviceMatrix(DType dtype, std::int64_t rows, std::int64_t cols)
      : buffer(static_cast<std::size_t>(rows * cols) * dtype_size(dtype)),
        view{buffer.data(), dtype, rows, cols, cols, MemorySpace::device} {}
  // All bits set is NaN in every dtype: an element the layer does not write cannot pass.
  void poison(cudaStream_t stream) const {
    if (buffer.bytes())
      LMOE_CUDA_CHECK(cudaMemsetAsync(buffer.data(), 0xff, buffer.bytes(), stream));
  }
  void to_host(HostTensor& host) const {
    if (buffer.bytes()) {
      LMOE_CUDA_CHECK(
          cudaMemcpy(host.data(), buffer.data(), buffer.bytes(), cudaMemcpyDeviceToHost));
    }
  }
};

}  // namespace

void run_layer_rank_cuda(LatentMoELayer& layer, Communicator& comm,
                         std::span<const HostTensor> inputs, const LayerRunOptions& run,
                         std::vector<LayerInputRun>& results) {
  const LayerOptions& options = layer.options();
  const LayerConfig& config = options.config;
  const DType dtype = options.dtype;
  const int rank = comm.rank();
  const cuda::OwnedStream stream;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const HostTensor& input = inputs[i];
    const std::int64_t tokens = input.shape().empty() ? 0 : input.shape()[0];
    LayerRankResult& mine = results[i].ranks[static_cast<std::size_t>(rank)];
    const DeviceMatrix x(dtype, tokens, config.d_model);
    if (x.buffer.bytes()) {
      LMOE_CUDA_CHECK(
          cudaMemcpy(x.buffer.data(), input.data(), x.buffer.bytes(), cudaMemcpyHostToDevice));
    }
    const ConstMatrixView x_view = x.view;
    if (run.keep_partials) {
      const DeviceMatrix routed(dtype, tokens, config.d_latent),
          shared(dtype, tokens, config.d_model);
      routed.poison(stream.get());
      shared.poison(stream.get());
      layer.forward_partials(x_view, routed.view, shared.view, stream.get());
      LMOE_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
      mine.routed = HostTensor(dtype, {tokens, config.d_latent});
      mine.shared = HostTensor(dtype, {tokens, config.d_model});
      routed.to_host(mine.routed);
      shared.to_host(mine.shared);
    }
    const DeviceMatrix y(dtype, tokens, config.d_model);
    for (int warmup = 0; warmup < run.warmup; ++warmup) {
      layer.forward(x_view, y.view, run.tier, stream.get());
    }
    for (int repeat = 0; repeat < std::max(1, run.repeats); ++repeat) {
      y.poison(stream.get());
      LMOE_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
      comm.barrier();
      mine.tier = layer.forward(x_view, y.view, run.tier, stream.get());
      mine.times.push_back(layer.last_times());  // waits for the forward's events
      LMOE_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    }
    mine.y = HostTensor(dtype, {tokens, config.d_model});
    y.to_host(mine.y);
    if (const Routing* routing = layer.last_routing()) mine.routing = *routing;
  }
}

}  // namespace lmoe

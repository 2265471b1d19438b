#include "tools/cuda/cuda_layer_runner.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "cuda/runtime/owned_stream.hpp"
#include "lmoe/error.hpp"
#include "tools/cuda/graph_timing.hpp"
#include "tools/cuda/l2_evict.hpp"

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
  // The first `rows` rows (the buffer holds the largest T's).
  MatrixView rows_of(std::int64_t rows) const {
    MatrixView head = view;
    head.rows = rows;
    return head;
  }
};

// One rank of `lmoe layer --graph`. Every buffer is made for the largest T before anything is
// captured and freed after the last replay: with p2p ranks sharing a GPU, a free (which
// synchronizes the device) on one rank while a peer captures invalidates the peer's capture. For
// the same reason the ranks pass a barrier between every phase that captures and every phase
// that does not, and every rank instantiates its graphs before any rank replays (docs/layer.md,
// "Capturable forwards").
class GraphRank {
 public:
  GraphRank(LatentMoELayer& layer, Communicator& comm, std::int64_t max_tokens,
            const LayerRunOptions& run)
      : layer_(layer),
        comm_(comm),
        run_(run),
        dtype_(layer.options().dtype),
        d_model_(layer.options().config.d_model),
        x_(dtype_, max_tokens, d_model_),
        y_(dtype_, max_tokens, d_model_),
        routed_(dtype_, max_tokens, layer.options().config.d_latent),
        shared_(dtype_, max_tokens, d_model_) {
    if (run.cold_l2) evictor_.emplace(stream());  // its buffer (2 x L2) only when asked for
    quiesce();
  }

  ~GraphRank() { cudaStreamSynchronize(stream()); }

  void run_input(const HostTensor& input, LayerRankResult& mine) {
    const std::int64_t tokens = input.shape().empty() ? 0 : input.shape()[0];
    const ConstMatrixView x = x_.rows_of(tokens);
    const MatrixView y = y_.rows_of(tokens);
    mine.y = HostTensor(dtype_, {tokens, d_model_});
    if (tokens == 0) {  // nothing to capture: an eager call, for its checks
      mine.tier = layer_.forward(x, y, run_.tier, stream());
      return;
    }
    const std::size_t x_bytes = input.nbytes();
    quiesce();
    LMOE_CUDA_CHECK(
        cudaMemcpyAsync(x_.buffer.data(), input.data(), x_bytes, cudaMemcpyHostToDevice, stream()));
    // The stages without the tail first (no peer spins yet): they plan T's cuBLASLt shapes and
    // load their kernels before any rank waits for another (docs/p2p.md).
    layer_.forward_partials(x, routed_.rows_of(tokens), shared_.rows_of(tokens), stream());
    quiesce();
    // The eager forward: it warms the tail, and its y and routing are the replays' reference.
    LMOE_CUDA_CHECK(cudaMemsetAsync(y_.buffer.data(), 0xff, x_bytes, stream()));
    mine.tier = layer_.forward(x, y, run_.tier, stream());
    HostTensor eager(dtype_, {tokens, d_model_});
    LMOE_CUDA_CHECK(
        cudaMemcpyAsync(eager.data(), y_.buffer.data(), x_bytes, cudaMemcpyDeviceToHost, stream()));
    LMOE_CUDA_CHECK(cudaStreamSynchronize(stream()));
    if (const Routing* routing = layer_.last_routing()) mine.routing = *routing;
    quiesce();

    const auto forward = [&] { layer_.forward(x, y, run_.tier, stream()); };
    const cuda::UniqueGraphExec graph = cuda::capture_graph(stream(), forward);
    layer_.set_capture_stage_events(true);
    std::optional<cuda::UniqueGraphExec> traced;
    try {
      traced.emplace(cuda::capture_graph(stream(), forward));
    } catch (...) {
      layer_.set_capture_stage_events(false);
      throw;
    }
    layer_.set_capture_stage_events(false);
    quiesce();  // every rank's graphs are ready before any replay spins on its peers

    for (int i = 0; i < run_.warmup; ++i) replay(graph.get(), x_bytes);
    LMOE_CUDA_CHECK(cudaStreamSynchronize(stream()));
    mine.replay_seconds = timed_replays(graph.get(), x_bytes);
    for (int i = 0; i < std::max(1, run_.repeats); ++i) {
      replay(traced->get(), x_bytes);
      mine.times.push_back(layer_.replay_stage_times());  // waits for the replay's events
    }

    // The checked replay: y poisoned first, so an element the graph does not write cannot pass.
    LMOE_CUDA_CHECK(cudaMemsetAsync(y_.buffer.data(), 0xff, x_bytes, stream()));
    LMOE_CUDA_CHECK(cudaGraphLaunch(graph.get(), stream()));
    LMOE_CUDA_CHECK(cudaMemcpyAsync(mine.y.data(), y_.buffer.data(), x_bytes,
                                    cudaMemcpyDeviceToHost, stream()));
    LMOE_CUDA_CHECK(cudaStreamSynchronize(stream()));
    mine.replay_matches_eager = std::memcmp(mine.y.data(), eager.data(), x_bytes) == 0;
    quiesce();  // no rank destroys its graphs while a peer still replays
  }

 private:
  cudaStream_t stream() const { return stream_.get(); }

  void quiesce() {
    LMOE_CUDA_CHECK(cudaStreamSynchronize(stream()));
    comm_.barrier();
  }

  // Cold L2: the eviction, then x read back into L2 (in a model, the kernels that wrote it ran
  // just before the layer), on the stream, outside the timed span.
  void prepare_replay(std::size_t x_bytes) {
    if (!evictor_) return;
    evictor_->evict(stream());
    evictor_->touch(x_.buffer.data(), x_bytes, stream());
  }

  void replay(cudaGraphExec_t exec, std::size_t x_bytes) {
    prepare_replay(x_bytes);
    LMOE_CUDA_CHECK(cudaGraphLaunch(exec, stream()));
  }

  // Replays issued back to back, each bracketed by events on the rank's stream, as `lmoe bench`
  // times a tail's graph (src/tools/cuda/cuda_tail_bench.cpp).
  std::vector<double> timed_replays(cudaGraphExec_t exec, std::size_t x_bytes) {
    return timer_.time(
        stream(), std::max(1, run_.repeats), [&](int) { prepare_replay(x_bytes); },
        [&](int) { LMOE_CUDA_CHECK(cudaGraphLaunch(exec, stream())); });
  }

  LatentMoELayer& layer_;
  Communicator& comm_;
  const LayerRunOptions& run_;
  DType dtype_;
  std::int64_t d_model_;
  cuda::OwnedStream stream_;
  DeviceMatrix x_, y_;            // [max T, d]
  DeviceMatrix routed_, shared_;  // [max T, l], [max T, d]: forward_partials' outputs (unread)
  std::optional<cuda::L2Evictor> evictor_;
  cuda::StreamTimer timer_;
};

}  // namespace

void run_layer_rank_cuda(LatentMoELayer& layer, Communicator& comm,
                         std::span<const HostTensor> inputs, const LayerRunOptions& run,
                         std::vector<LayerInputRun>& results) {
  const LayerOptions& options = layer.options();
  const LayerConfig& config = options.config;
  const DType dtype = options.dtype;
  const int rank = comm.rank();
  if (run.graph) {
    std::int64_t max_tokens = 0;
    for (const HostTensor& input : inputs) {
      max_tokens = std::max(max_tokens, input.shape().empty() ? 0 : input.shape()[0]);
    }
    GraphRank graph_rank(layer, comm, max_tokens, run);
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      graph_rank.run_input(inputs[i], results[i].ranks[static_cast<std::size_t>(rank)]);
    }
    return;
  }
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

std::int64_t device_memory_in_use() {
  std::size_t free = 0, total = 0;
  LMOE_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return static_cast<std::int64_t>(total - free);
}

}  // namespace lmoe

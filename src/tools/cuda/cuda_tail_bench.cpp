// The benchmark's rank on a GPU: device buffers for the largest T, inputs generated on the device,
// forwards (every layer's tail, back to back) on the rank's own stream timed with CUDA events, and
// (graph mode) one forward per (T, tier) captured into a CUDA graph and replayed.
#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "lmoe/error.hpp"
#include "tools/bench_rank.hpp"
#include "tools/cuda/bench_fill.hpp"
#include "tools/cuda/graph_timing.hpp"
#include "tools/cuda/l2_evict.hpp"

namespace lmoe {

namespace {

using cuda::capture_graph;
using cuda::DeviceBuffer;
using cuda::UniqueGraphExec;
using cuda::UniqueStream;

class CudaBenchRank final : public BenchRank {
 public:
  CudaBenchRank(std::span<LatentTail* const> layers, Communicator& comm, std::int64_t max_tokens,
                bool cold_l2)
      : layers_(layers.begin(), layers.end()),
        comm_(comm),
        dims_(layers.front()->options().dims),
        dtype_(layers.front()->options().dtype),
        max_tokens_(max_tokens),
        routed_(bytes(max_tokens * dims_.d_latent)),
        pristine_shared_(bytes(max_tokens * dims_.d_model)),
        tokens_device_(sizeof(std::int32_t)) {
    for (std::size_t i = 0; i < layers_.size(); ++i) {
      shared_.emplace_back(bytes(max_tokens * dims_.d_model));
      out_.emplace_back(bytes(max_tokens * dims_.d_model));
    }
    LMOE_CHECK(comm.memory_space() == MemorySpace::device,
               "bench: the cuda backend needs a device communicator, got '" +
                   std::string(comm.backend_name()) + "'");
    cudaStream_t stream = nullptr;
    LMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    stream_.reset(stream);
    if (cold_l2) evictor_.emplace(stream);  // its buffer (2 x L2) only when asked for
  }

  // A graph may still be running on the stream: let it finish before its exec and buffers go.
  ~CudaBenchRank() override { cudaStreamSynchronize(stream()); }

  void load_inputs(std::int64_t num_tokens, std::uint64_t routed_seed,
                   std::uint64_t shared_seed) override {
    LMOE_CHECK(num_tokens >= 1 && num_tokens <= max_tokens_,
               "bench: T=" + std::to_string(num_tokens) + " outside the buffers' 1.." +
                   std::to_string(max_tokens_));
    quiesce();
    graphs_.clear();  // captured with the previous T
    tokens_ = num_tokens;
    cuda::check(cuda::launch_fill_bench_values(routed_.data(), tokens_ * dims_.d_latent, dtype_,
                                               routed_seed, stream()),
                "launch_fill_bench_values");
    cuda::check(cuda::launch_fill_bench_values(pristine_shared_.data(), tokens_ * dims_.d_model,
                                               dtype_, shared_seed, stream()),
                "launch_fill_bench_values");
    restore_and_poison();
    const auto value = static_cast<std::int32_t>(num_tokens);
    LMOE_CUDA_CHECK(cudaMemcpyAsync(tokens_device_.data(), &value, sizeof(value),
                                    cudaMemcpyHostToDevice, stream()));
    quiesce();
  }

  void prepare(TailTier tier, BenchMode mode) override {
    tier_ = tier;
    graph_mode_ = mode == BenchMode::graph;
    device_tokens_ = mode == BenchMode::device_tokens;
    if (device_tokens_ && !device_graphs_.contains(tier)) {
      // Captured once per tier, for every T: one eager call first (it runs every bucket's GEMMs
      // once).
      quiesce();
      device_forward();
      quiesce();
      device_graphs_[tier] = capture([&] { device_forward(); });
      quiesce();
    }
    if (graph_mode_ && !graphs_.contains(tier)) {
      // One eager call first: ranks that share a GPU run each GEMM shape once outside any
      // collective there (cuda_tail_executor.cpp, warm_up_gemms); and no rank instantiates while a
      // peer already replays.
      quiesce();
      eager_forward();
      quiesce();
      graphs_[tier] = capture([&] { eager_forward(); });
      quiesce();
    }
  }

  void warm_up(int count) override {
    for (int i = 0; i < count; ++i) forward();
    LMOE_CUDA_CHECK(cudaStreamSynchronize(stream()));
  }

  // Iterations are issued back to back, as an engine issues layers; each is bracketed by events on
  // the rank's stream, so its time is what the stream spent on it, including any wait for the host
  // (eager launches) or for peers (collectives). Cold L2: an eviction before each start event, on
  // the same stream (no host synchronization between iterations), then a read of the inputs: cold
  // weights, warm activations, as in a model. Ranks that share one GPU share
  // its L2, so one rank's eviction can run while a peer's timed forward runs (and slow it, or evict
  // what it just loaded): cold numbers are meant for one rank per GPU.
  std::vector<double> time(int count) override {
    quiesce();
    return timer_.time(
        stream(), count,
        [&](int) {
          if (!evictor_) return;
          evictor_->evict(stream());
          // The inputs back in L2: in a model, the kernels that wrote them ran just before the
          // tail.
          evictor_->touch(routed_.data(), bytes(tokens_ * dims_.d_latent), stream());
          for (const DeviceBuffer& shared : shared_)
            evictor_->touch(shared.data(), bytes(tokens_ * dims_.d_model), stream());
        },
        [&](int) { forward(); });
  }

  HostTensor checked_output() override {
    quiesce();
    restore_and_poison();
    quiesce();
    forward();
    std::vector<HostTensor> outputs;
    for (const DeviceBuffer& out : out_) {
      HostTensor y(dtype_, {tokens_, dims_.d_model});
      LMOE_CUDA_CHECK(
          cudaMemcpyAsync(y.data(), out.data(), y.nbytes(), cudaMemcpyDeviceToHost, stream()));
      outputs.push_back(std::move(y));
    }
    LMOE_CUDA_CHECK(cudaStreamSynchronize(stream()));
    return first_differing_output(std::move(outputs));
  }

 private:
  std::size_t bytes(std::int64_t elements) const {
    return static_cast<std::size_t>(elements) * dtype_size(dtype_);
  }
  cudaStream_t stream() const { return stream_.get(); }

  // Peers read this rank's buffers inside collectives (same-GPU and P2P communicators): before they
  // change, every rank's stream must be idle.
  void quiesce() {
    LMOE_CUDA_CHECK(cudaStreamSynchronize(stream()));
    comm_.barrier();
  }

  void restore_and_poison() {
    const std::size_t model_bytes = bytes(tokens_ * dims_.d_model);
    for (std::size_t i = 0; i < layers_.size(); ++i) {
      LMOE_CUDA_CHECK(cudaMemcpyAsync(shared_[i].data(), pristine_shared_.data(), model_bytes,
                                      cudaMemcpyDeviceToDevice, stream()));
      // All bits set is NaN in every dtype: an element the tail does not write cannot pass.
      LMOE_CUDA_CHECK(cudaMemsetAsync(out_[i].data(), 0xff, model_bytes, stream()));
    }
  }

  MatrixView view(const DeviceBuffer& buffer, std::int64_t cols) const {
    return {buffer.data(), dtype_, tokens_, cols, cols, MemorySpace::device};
  }

  void eager_forward() {
    for (std::size_t i = 0; i < layers_.size(); ++i) {
      layers_[i]->forward(view(routed_, dims_.d_latent), view(shared_[i], dims_.d_model),
                          view(out_[i], dims_.d_model), tier_, stream());
    }
  }

  // T read on the device (tokens_device_), the views holding every row of the buffers.
  void device_forward() {
    for (std::size_t i = 0; i < layers_.size(); ++i) {
      MatrixView routed = view(routed_, dims_.d_latent), shared = view(shared_[i], dims_.d_model),
                 out = view(out_[i], dims_.d_model);
      routed.rows = shared.rows = out.rows = max_tokens_;
      layers_[i]->forward_device_tokens(routed, shared, out,
                                        static_cast<const std::int32_t*>(tokens_device_.data()),
                                        tier_, stream());
    }
  }

  void forward() {
    if (device_tokens_) {
      LMOE_CUDA_CHECK(cudaGraphLaunch(device_graphs_.at(tier_).get(), stream()));
    } else if (graph_mode_) {
      LMOE_CUDA_CHECK(cudaGraphLaunch(graphs_.at(tier_).get(), stream()));
    } else {
      eager_forward();
    }
  }

  template <typename Forward>
  UniqueGraphExec capture(Forward&& issue) {
    return capture_graph(stream(), std::forward<Forward>(issue));
  }

  std::vector<LatentTail*> layers_;
  Communicator& comm_;
  TailDims dims_;
  DType dtype_;
  std::int64_t max_tokens_;
  DeviceBuffer routed_;           // [max T, l], every layer's input
  DeviceBuffer pristine_shared_;  // [max T, d]: the loaded shared, to restore it
  std::vector<DeviceBuffer>
      shared_;  // per layer [max T, d]: the call's input, which column overwrites
  std::vector<DeviceBuffer> out_;  // per layer [max T, d]
  UniqueStream stream_;
  cuda::StreamTimer timer_;
  std::map<TailTier, UniqueGraphExec> graphs_;  // graph mode: one forward of each tier at tokens_
  DeviceBuffer tokens_device_;                  // device-tokens mode: T, written by load_inputs
  std::map<TailTier, UniqueGraphExec> device_graphs_;  // device-tokens mode: one per tier, every T
  std::optional<cuda::L2Evictor> evictor_;             // cold L2: read before each timed forward
  bool graph_mode_ = false;
  bool device_tokens_ = false;
  std::int64_t tokens_ = 0;
  TailTier tier_ = TailTier::overlap;
};

}  // namespace

std::unique_ptr<BenchRank> make_cuda_bench_rank(std::span<LatentTail* const> layers,
                                                Communicator& comm, std::int64_t max_tokens,
                                                bool cold_l2) {
  LMOE_CHECK(!layers.empty(), "bench: expected at least one layer's tail, got none");
  return std::make_unique<CudaBenchRank>(layers, comm, max_tokens, cold_l2);
}

}  // namespace lmoe

// The layer's stages before the tail on one GPU, with the CPU executor's dataflow:
//
//   main stream:  router GEMM (fp32 logits: bf16 x against the weight's three bf16 parts, else
//                 x in fp32 against the fp32 weight) → route kernel → routing to the host
//                 → latent z = round(x · W_downᵀ)
//                 → routed experts, on one of two paths:
//                   host:   counting sort of the slots by expert on the host → slot order to the
//                           device → gather z rows by expert → per active expert: up (and gate)
//                           cuBLASLt GEMMs, fp32 out → activation → per active expert: down GEMM
//                   device: the same sort by a kernel → one grouped GEMM for every expert's up
//                           (and gate) rows, gathering z's rows and applying the activation →
//                           one grouped GEMM for the down rows (no host read: capturable)
//                 → weighted combine
//   side stream:  shared experts on x (forked at the start, joined at the end)
//
// The host path reads each forward's routing (one device→host copy: ids and weights) to size the
// experts' GEMMs, so it serves eager forwards only; a forward on a capturing stream takes the
// device path (LMOE_LAYER_DEVICE_EXPERTS=1: eager ones too), and so does every forward of a layer
// whose MXFP4 experts are kept packed (only the grouped GEMM reads them; a layer the device path
// cannot run refuses them when it is built). Stage times come from events, each stage's own pair
// on its own stream (docs/layer.md); a captured forward has none. Each stage is a
// class of its own (layer_router, layer_down_projection, layer_routed_experts,
// layer_shared_experts); this executor owns them, the streams, the events and the workspaces'
// size, and times the tail around LatentTail::forward.
#include "cuda/layer/cuda_layer_executor.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#include "cuda/gemm/cublaslt_gemm.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/layer/layer_down_projection.hpp"
#include "cuda/layer/layer_kernels.hpp"
#include "cuda/layer/layer_routed_experts.hpp"
#include "cuda/layer/layer_router.hpp"
#include "cuda/layer/layer_shared_experts.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "lmoe/error.hpp"
#include "lmoe/settings.hpp"

namespace lmoe {

std::optional<std::string> cuda_layer_limit(const LayerConfig& config) {
  if (config.router.num_experts > cuda::kMaxRouterExperts) {
    return "num_experts=" + std::to_string(config.router.num_experts) + " > " +
           std::to_string(cuda::kMaxRouterExperts) +
           " (the cuda router holds a token's scores in shared memory)";
  }
  return std::nullopt;
}

std::optional<std::string> cuda_device_experts_limit(const LayerConfig& config, DType dtype,
                                                     int tp) {
  if (dtype != DType::bf16 && dtype != DType::f16) {
    return "dtype: the device path's grouped GEMM takes bf16 or f16, got " +
           std::string(dtype_name(dtype));
  }
  if (config.router.num_experts > cuda::kSortMaxExperts) {
    return "num_experts=" + std::to_string(config.router.num_experts) + " > " +
           std::to_string(cuda::kSortMaxExperts) + " (the device sort's one block)";
  }
  const std::int64_t inter = config.expert_intermediate / tp;
  if (config.d_latent % 2 != 0 || inter % 2 != 0) {
    return "d_latent=" + std::to_string(config.d_latent) +
           ", expert_intermediate/tp=" + std::to_string(inter) +
           ": the grouped GEMM expects even row widths";
  }
  return std::nullopt;
}

namespace {

using cuda::check;
using cuda::DeviceBuffer;
using cuda::make_event;

class CudaLayerExecutor final : public LayerExecutor {
 public:
  CudaLayerExecutor(const LayerConfig& config, DType dtype, int tp, const LayerWeights& weights,
                    std::int64_t max_tokens, bool device_experts)
      : config_(config),
        dtype_(dtype),
        esize_(dtype_size(dtype)),
        device_limit_(cuda_device_experts_limit(config, dtype, tp)),
        device_eager_(device_experts || setting_flag(kDeviceExpertsEnv)),
        serial_stages_(setting_flag(kSerialStagesEnv)),
        router_(config, dtype, weights),
        down_projection_(config, dtype, weights),
        routed_experts_(config, dtype, config.expert_intermediate / tp, weights),
        shared_experts_(config, dtype, config.shared_width() / tp, weights) {
    LMOE_CUDA_CHECK(cudaGetDevice(&device_));
    if (device_eager_ && device_limit_) {
      throw Error(
          (device_experts ? std::string("device_experts") : std::string(kDeviceExpertsEnv) + "=1") +
          ": the device path cannot run this layer: " + *device_limit_);
    }
    if (routed_experts_.packed() && device_limit_) {
      throw Error(
          "weights: MXFP4 experts kept packed run on the cuda layer's device path (the host path "
          "reads dense weights), which cannot run this layer: " +
          *device_limit_ + "; load them dequantized (LayerLoadOptions::keep_experts_packed off)");
    }
    LMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&side_stream_, cudaStreamNonBlocking));
    for (cudaEvent_t* event : {&start_, &router_end_, &down_end_, &experts_end_, &shared_start_,
                               &shared_end_, &tail_start_, &tail_end_}) {
      *event = make_event(true);
    }
    for (cudaEvent_t& event : replay_events_) event = make_event(true);
    gemm_ = std::make_unique<cuda::CublasLtGemm>();
    check(cuda::prepare_layer_kernels(dtype_), "prepare_layer_kernels");
    if (!device_limit_) check(cuda::prepare_grouped_gemm(dtype_), "prepare_grouped_gemm");
    if (max_tokens > 0) {
      reserve(max_tokens, cudaStreamPerThread);
      grow_partials(max_tokens);
    }
  }

  ~CudaLayerExecutor() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(side_stream_);
    for (cudaEvent_t event : {start_, router_end_, down_end_, experts_end_, shared_start_,
                              shared_end_, tail_start_, tail_end_}) {
      cudaEventDestroy(event);
    }
    for (cudaEvent_t event : replay_events_) cudaEventDestroy(event);
    cudaStreamDestroy(side_stream_);
  }

  std::string_view backend_name() const override { return "cuda"; }
  MemorySpace memory_space() const override { return MemorySpace::device; }
  // An eager forward on the device path copies its routing to the host too, and the host reads
  // it here, on request (waiting for the router); a captured forward has no host routing.
  const Routing* host_routing() const override {
    if (routing_pending_) {
      LMOE_CUDA_CHECK(cudaSetDevice(device_));
      LMOE_CUDA_CHECK(cudaEventSynchronize(router_end_));
      const std::int64_t count = slots(routing_.num_tokens);
      const std::int32_t* ids = router_.host_routing();
      routing_.expert_ids.assign(ids, ids + count);
      const auto* weights = reinterpret_cast<const float*>(ids + count);
      routing_.weights.assign(weights, weights + count);
      routing_pending_ = false;
    }
    return captured_ ? nullptr : &routing_;
  }

  std::optional<std::string> cannot_run(std::int64_t tokens, StreamHandle handle) const override {
    const bool partials_short = std::exchange(partials_short_, false);
    if (!is_capturing(cuda::stream_or_default(handle))) return std::nullopt;
    if (device_limit_) {
      return "stream: a captured forward takes the cuda layer's device path (no host read of the "
             "routing), which cannot run this layer: " +
             *device_limit_;
    }
    if (tokens > capacity_ || partials_short) {
      return "stream: T=" + std::to_string(tokens) +
             " tokens need larger workspaces than the layer holds, and they cannot grow while the "
             "stream is captured into a CUDA graph: set LayerOptions::max_tokens ≥ T, or run one "
             "forward of at least T tokens before capturing";
    }
    return std::nullopt;
  }

  std::optional<std::pair<MatrixView, MatrixView>> partial_buffers(std::int64_t tokens,
                                                                   StreamHandle handle) override {
    LMOE_CUDA_CHECK(cudaSetDevice(device_));
    if (tokens > partial_capacity_) {
      // Growing would synchronize a capturing stream and break the capture on this rank alone:
      // the call's cannot_run refuses it instead, on every rank, before anything is launched.
      if (is_capturing(cuda::stream_or_default(handle))) {
        partials_short_ = true;
      } else {
        // The old buffers may still be read by the previous forward's tail.
        LMOE_CUDA_CHECK(cudaStreamSynchronize(cuda::stream_or_default(handle)));
        grow_partials(tokens);
      }
    }
    const MatrixView routed{routed_partial_.data(), dtype_,           tokens,
                            config_.d_latent,       config_.d_latent, MemorySpace::device};
    const MatrixView shared{shared_partial_.data(), dtype_,          tokens,
                            config_.d_model,        config_.d_model, MemorySpace::device};
    return std::make_pair(routed, shared);
  }

  void run(ConstMatrixView x, MatrixView routed, MatrixView shared, LayerStageTimes& times,
           StreamHandle handle) override {
    LMOE_CUDA_CHECK(cudaSetDevice(device_));
    const std::int64_t tokens = x.rows;
    if (auto why = cannot_run(tokens, handle)) throw Error(*why);
    const cudaStream_t stream = cuda::stream_or_default(handle);
    times = {};
    timed_ = false;
    tail_timed_ = false;
    captured_ = is_capturing(stream);
    routing_pending_ = false;
    routing_.num_tokens = tokens;
    routing_.top_k = config_.router.top_k;
    routing_.expert_ids.clear();
    routing_.weights.clear();
    if (tokens == 0) return;
    reserve(tokens, stream);
    const bool device_path = captured_ || device_eager_ || routed_experts_.packed();

    mark(start_, kStart, stream);
    // The shared experts on the side stream, from `after` on `stream`.
    const auto fork_shared_experts = [&](cudaEvent_t after) {
      LMOE_CUDA_CHECK(cudaStreamWaitEvent(side_stream_, after, 0));
      mark(shared_start_, kSharedStart, side_stream_);
      shared_experts_.run(x, shared, side_stream_);
      mark(shared_end_, kSharedEnd, side_stream_);
    };
    if (!serial_stages_) fork_shared_experts(start_);

    router_.route(x, captured_, *gemm_, stream);
    mark(router_end_, kRouterEnd, stream);

    // z = round(x · W_downᵀ) [T, l], replicated.
    down_projection_.run(x, *gemm_, stream);
    mark(down_end_, kDownEnd, stream);

    if (device_path) {
      routed_experts_.run_on_device(tokens, router_, down_projection_.latent(), routed, stream);
      routing_pending_ = !captured_;
    } else {
      routed_experts_.run_on_host(tokens, router_, router_end_, routing_, down_projection_.latent(),
                                  routed, *gemm_, stream);
    }
    mark(experts_end_, kExpertsEnd, stream);
    if (serial_stages_) fork_shared_experts(experts_end_);
    LMOE_CUDA_CHECK(cudaStreamWaitEvent(stream, shared_end_, 0));
    // Events recorded during a capture only order the captured work; they time nothing.
    timed_ = !captured_;
  }

  bool begin_tail(StreamHandle handle) override {
    mark(tail_start_, kTailStart, cuda::stream_or_default(handle));
    return true;
  }
  void end_tail(StreamHandle handle) override {
    mark(tail_end_, kTailEnd, cuda::stream_or_default(handle));
    tail_timed_ = !captured_;
    if (captured_ && capture_stage_events_) replay_events_captured_ = true;
  }

  void set_capture_stage_events(bool on) override { capture_stage_events_ = on; }

  std::optional<LayerStageTimes> replay_stage_times() const override {
    if (!replay_events_captured_) return std::nullopt;
    LMOE_CUDA_CHECK(cudaSetDevice(device_));
    const auto between = [&](StagePoint begin, StagePoint end) {
      return elapsed(replay_events_[begin], replay_events_[end]);
    };
    LayerStageTimes times;
    times.router = between(kStart, kRouterEnd);
    times.down_projection = between(kRouterEnd, kDownEnd);
    times.experts = between(kDownEnd, kExpertsEnd);
    times.shared = between(kSharedStart, kSharedEnd);
    times.tail = between(kTailStart, kTailEnd);
    times.forward = between(kStart, kTailEnd);
    return times;
  }

  void finish_times(LayerStageTimes& times) override {
    if (!timed_) return;
    LMOE_CUDA_CHECK(cudaSetDevice(device_));
    times.router = elapsed(start_, router_end_);
    times.down_projection = elapsed(router_end_, down_end_);
    times.experts = elapsed(down_end_, experts_end_);
    times.shared = elapsed(shared_start_, shared_end_);
    if (tail_timed_) {
      times.tail = elapsed(tail_start_, tail_end_);
      times.forward = elapsed(start_, tail_end_);
    }
  }

 private:
  std::size_t bytes(std::int64_t elements) const {
    return static_cast<std::size_t>(elements) * esize_;
  }
  std::int64_t slots(std::int64_t tokens) const { return tokens * config_.router.top_k; }

  enum StagePoint {
    kStart,
    kRouterEnd,
    kDownEnd,
    kExpertsEnd,
    kSharedStart,
    kSharedEnd,
    kTailStart,
    kTailEnd,
    kStagePoints
  };

  // Where each stage starts or ends: `event` orders (and, eager, times) the forward; in a capture
  // with stage events, the point's external event is recorded beside it for every replay. The two
  // are kept apart because a capture turns an ordinary record into the graph's fork and join. The
  // external record comes first: a node after the join's record would be the side stream's
  // unjoined work, which ends the capture with an error.
  void mark(cudaEvent_t event, StagePoint point, cudaStream_t stream) {
    if (captured_ && capture_stage_events_) {
      LMOE_CUDA_CHECK(
          cudaEventRecordWithFlags(replay_events_[point], stream, cudaEventRecordExternal));
    }
    LMOE_CUDA_CHECK(cudaEventRecord(event, stream));
  }

  static bool is_capturing(cudaStream_t stream) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    LMOE_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    return capture != cudaStreamCaptureStatusNone;
  }

  void grow_partials(std::int64_t tokens) {
    partial_capacity_ = (tokens + 63) / 64 * 64;
    routed_partial_ = DeviceBuffer(bytes(partial_capacity_ * config_.d_latent));
    shared_partial_ = DeviceBuffer(bytes(partial_capacity_ * config_.d_model));
  }

  static double elapsed(cudaEvent_t begin, cudaEvent_t end) {
    LMOE_CUDA_CHECK(cudaEventSynchronize(end));
    float ms = 0.0f;
    LMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, begin, end));
    return static_cast<double>(ms) * 1e-3;
  }

  // Workspaces for up to `tokens` rows; they grow on demand, after the streams' earlier work (the
  // old buffers may still be in use).
  void reserve(std::int64_t tokens, cudaStream_t stream) {
    if (tokens <= capacity_) return;
    LMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    LMOE_CUDA_CHECK(cudaStreamSynchronize(side_stream_));
    routed_experts_.wait_for_order_upload();
    const std::int64_t rows = (tokens + 63) / 64 * 64;
    router_.reserve(rows);
    down_projection_.reserve(rows);
    routed_experts_.reserve(rows);
    shared_experts_.reserve(rows);
    capacity_ = rows;
  }

  LayerConfig config_;
  DType dtype_;
  std::size_t esize_;
  std::optional<std::string> device_limit_;  // why the device path cannot run, or nullopt
  bool device_eager_;                        // LMOE_LAYER_DEVICE_EXPERTS=1
  bool serial_stages_;                       // LMOE_LAYER_SERIAL_STAGES=1
  // The stages, in the order a forward runs them (the shared experts on the side stream).
  cuda::LayerRouter router_;
  cuda::LatentDownProjection down_projection_;
  cuda::RoutedExperts routed_experts_;
  cuda::SharedExperts shared_experts_;
  int device_ = 0;

  std::unique_ptr<cuda::CublasLtGemm> gemm_;  // the main stream's
  cudaStream_t side_stream_ = nullptr;
  // Timing events (docs/layer.md): router [start, router_end], down-projection [router_end,
  // down_end], experts [down_end, experts_end] on the main stream, shared on the side stream, tail
  // around LatentTail::forward. router_end also tells the host that the routing has arrived.
  cudaEvent_t start_ = nullptr, router_end_ = nullptr, down_end_ = nullptr, experts_end_ = nullptr;
  cudaEvent_t shared_start_ = nullptr, shared_end_ = nullptr, tail_start_ = nullptr,
              tail_end_ = nullptr;
  bool timed_ = false, tail_timed_ = false;
  // External events of forwards captured with stage events (set_capture_stage_events), one per
  // StagePoint: a replay records them, replay_stage_times() reads them.
  std::array<cudaEvent_t, kStagePoints> replay_events_{};
  bool capture_stage_events_ = false;
  bool replay_events_captured_ = false;  // a forward with its tail was captured with them
  bool captured_ = false;  // the last forward was captured (no times, no host routing)
  mutable bool routing_pending_ = false;  // routing_host_ holds an eager device-path routing
  mutable bool partials_short_ = false;   // partial_buffers could not grow under capture

  std::int64_t capacity_ = 0;  // tokens the workspaces hold

  std::int64_t partial_capacity_ = 0;
  DeviceBuffer routed_partial_;  // [T, l] for forward()
  DeviceBuffer shared_partial_;  // [T, d]

  mutable Routing routing_;
};

}  // namespace

std::unique_ptr<LayerExecutor> make_cuda_layer_executor(const LayerConfig& config, DType dtype,
                                                        int tp, const LayerWeights& weights,
                                                        std::int64_t max_tokens,
                                                        bool device_experts) {
  return std::make_unique<CudaLayerExecutor>(config, dtype, tp, weights, max_tokens,
                                             device_experts);
}

}  // namespace lmoe

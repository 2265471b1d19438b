// The layer's stages before the tail on one GPU, with the CPU executor's dataflow:
//
//   main stream:  x → fp32 → router GEMM (fp32 logits) → route kernel → routing to the host
//                 → latent z = round(x · W_downᵀ)
//                 → host: counting sort of the slots by expert → slot order to the device
//                 → gather z rows by expert → per active expert: up (and gate) GEMMs, fp32 out
//                 → activation → per active expert: down GEMM, fp32 out → weighted combine
//   side stream:  shared experts on x (forked at the start, joined at the end)
//
// The host reads each forward's routing (one device→host copy: ids and weights) to size the
// experts' GEMMs, so a forward cannot be captured in a CUDA graph; a capturing stream is refused.
// Stage times come from events, each stage's own pair on its own stream (docs/layer.md).
#include "cuda/cuda_layer_executor.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "cuda/cublaslt_gemm.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/device_buffer.hpp"
#include "cuda/layer_kernels.hpp"
#include "lmoe/error.hpp"

namespace lmoe {

std::optional<std::string> cuda_layer_limit(const LayerConfig& config) {
  if (config.router.num_experts > cuda::kMaxRouterExperts) {
    return "num_experts=" + std::to_string(config.router.num_experts) + " > " +
           std::to_string(cuda::kMaxRouterExperts) +
           " (the cuda router holds a token's scores in shared memory)";
  }
  return std::nullopt;
}

namespace {

using cuda::check;

// Each expert's rows in the grouped buffers start at a multiple of this many rows (16-byte aligned
// operands for any row width: 8 rows of ≥ 2-byte elements span a multiple of 16 bytes).
constexpr std::int64_t kExpertRowAlign = 8;
using cuda::DeviceBuffer;

// Page-locked host memory, so that copies to and from it are asynchronous.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(std::size_t bytes) {
    if (bytes) LMOE_CUDA_CHECK(cudaMallocHost(&data_, bytes));
  }
  ~PinnedBuffer() {
    if (data_) cudaFreeHost(data_);
  }
  PinnedBuffer(PinnedBuffer&& other) noexcept : data_(std::exchange(other.data_, nullptr)) {}
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept {
    if (this != &other) {
      if (data_) cudaFreeHost(data_);
      data_ = std::exchange(other.data_, nullptr);
    }
    return *this;
  }
  void* data() const { return data_; }

 private:
  void* data_ = nullptr;
};

DeviceBuffer upload(const HostTensor& tensor) {
  DeviceBuffer buffer(tensor.nbytes());
  if (tensor.nbytes()) {
    LMOE_CUDA_CHECK(
        cudaMemcpy(buffer.data(), tensor.data(), tensor.nbytes(), cudaMemcpyHostToDevice));
  }
  return buffer;
}

cudaEvent_t make_event(bool timing) {
  cudaEvent_t event = nullptr;
  LMOE_CUDA_CHECK(
      cudaEventCreateWithFlags(&event, timing ? cudaEventDefault : cudaEventDisableTiming));
  return event;
}

void* offset(const DeviceBuffer& buffer, std::size_t byte_offset) { return buffer.at(byte_offset); }

class CudaLayerExecutor final : public LayerExecutor {
 public:
  CudaLayerExecutor(const LayerConfig& config, DType dtype, int tp, const LayerWeights& weights)
      : config_(config),
        dtype_(dtype),
        esize_(dtype_size(dtype)),
        inter_(config.expert_intermediate / tp),
        shared_width_(config.shared_width() / tp) {
    LMOE_CUDA_CHECK(cudaGetDevice(&device_));
    router_weight_ = upload(weights.router_weight);
    if (config.router.correction_bias) router_bias_ = upload(weights.router_bias);
    latent_down_ = upload(weights.latent_down);
    expert_gate_ = upload(weights.expert_gate);
    expert_up_ = upload(weights.expert_up);
    expert_down_ = upload(weights.expert_down);
    shared_gate_ = upload(weights.shared_gate);
    shared_up_ = upload(weights.shared_up);
    shared_down_ = upload(weights.shared_down);

    LMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&side_stream_, cudaStreamNonBlocking));
    for (cudaEvent_t* event : {&start_, &router_end_, &down_end_, &experts_end_, &shared_start_,
                               &shared_end_, &tail_start_, &tail_end_}) {
      *event = make_event(true);
    }
    order_copied_ = make_event(false);
    gemm_ = std::make_unique<cuda::CublasLtGemm>();
    // The side stream runs at the same time as the main one: a workspace of its own.
    side_gemm_ = std::make_unique<cuda::CublasLtGemm>();
  }

  ~CudaLayerExecutor() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(side_stream_);
    cudaEventSynchronize(order_copied_);
    for (cudaEvent_t event : {start_, router_end_, down_end_, experts_end_, shared_start_,
                              shared_end_, tail_start_, tail_end_, order_copied_}) {
      cudaEventDestroy(event);
    }
    cudaStreamDestroy(side_stream_);
  }

  std::string_view backend_name() const override { return "cuda"; }
  MemorySpace memory_space() const override { return MemorySpace::device; }
  const Routing* host_routing() const override { return &routing_; }

  std::optional<std::string> cannot_run(StreamHandle handle) const override {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    LMOE_CUDA_CHECK(cudaStreamIsCapturing(cuda::stream_or_default(handle), &capture));
    if (capture == cudaStreamCaptureStatusNone) return std::nullopt;
    return std::string(
        "stream: the cuda layer reads each forward's routing on the host (to size the experts' "
        "GEMMs), so its forward cannot be captured in a CUDA graph yet; run it outside stream "
        "capture (the tail alone can be captured: LatentTail with max_tokens)");
  }

  std::optional<std::pair<MatrixView, MatrixView>> partial_buffers(std::int64_t tokens,
                                                                   StreamHandle handle) override {
    LMOE_CUDA_CHECK(cudaSetDevice(device_));
    // A capturing stream is refused by the call (cannot_run) before anything touches the buffers;
    // growing them here would synchronize it and break the capture on this rank alone.
    if (tokens > partial_capacity_ && !cannot_run(handle)) {
      // The old buffers may still be read by the previous forward's tail.
      LMOE_CUDA_CHECK(cudaStreamSynchronize(cuda::stream_or_default(handle)));
      partial_capacity_ = (tokens + 63) / 64 * 64;
      routed_partial_ = DeviceBuffer(bytes(partial_capacity_ * config_.d_latent));
      shared_partial_ = DeviceBuffer(bytes(partial_capacity_ * config_.d_model));
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
    if (auto why = cannot_run(handle)) throw Error(*why);
    const cudaStream_t stream = cuda::stream_or_default(handle);
    const std::int64_t tokens = x.rows;
    times = {};
    timed_ = false;
    tail_timed_ = false;
    routing_.num_tokens = tokens;
    routing_.top_k = config_.router.top_k;
    routing_.expert_ids.clear();
    routing_.weights.clear();
    if (tokens == 0) return;
    reserve(tokens, stream);

    LMOE_CUDA_CHECK(cudaEventRecord(start_, stream));
    LMOE_CUDA_CHECK(cudaStreamWaitEvent(side_stream_, start_, 0));
    LMOE_CUDA_CHECK(cudaEventRecord(shared_start_, side_stream_));
    run_shared_experts(x, shared);
    LMOE_CUDA_CHECK(cudaEventRecord(shared_end_, side_stream_));

    route(x, stream);
    LMOE_CUDA_CHECK(cudaEventRecord(router_end_, stream));

    // z = round(x · W_downᵀ) [T, l], replicated.
    gemm_->run(x.data, latent_down_.data(), config_.d_model, latent_.data(), config_.d_latent,
               tokens, config_.d_latent, config_.d_model, dtype_, dtype_, stream);
    LMOE_CUDA_CHECK(cudaEventRecord(down_end_, stream));

    run_routed_experts(tokens, routed, stream);
    LMOE_CUDA_CHECK(cudaEventRecord(experts_end_, stream));
    LMOE_CUDA_CHECK(cudaStreamWaitEvent(stream, shared_end_, 0));
    timed_ = true;
  }

  bool begin_tail(StreamHandle handle) override {
    LMOE_CUDA_CHECK(cudaEventRecord(tail_start_, cuda::stream_or_default(handle)));
    return true;
  }
  void end_tail(StreamHandle handle) override {
    LMOE_CUDA_CHECK(cudaEventRecord(tail_end_, cuda::stream_or_default(handle)));
    tail_timed_ = true;
  }

  void finish_times(LayerStageTimes& times) override {
    if (!timed_) return;
    LMOE_CUDA_CHECK(cudaSetDevice(device_));
    times.router = elapsed(start_, router_end_);
    times.down_projection = elapsed(router_end_, down_end_);
    times.experts = elapsed(down_end_, experts_end_);
    times.shared = elapsed(shared_start_, shared_end_);
    if (tail_timed_) times.tail = elapsed(tail_start_, tail_end_);
  }

 private:
  std::size_t bytes(std::int64_t elements) const {
    return static_cast<std::size_t>(elements) * esize_;
  }
  static std::size_t floats(std::int64_t elements) {
    return static_cast<std::size_t>(elements) * sizeof(float);
  }
  std::int64_t slots(std::int64_t tokens) const { return tokens * config_.router.top_k; }
  // Rows of the expert-grouped buffers for `slot_count` slots: each active expert's rows padded to
  // a multiple of kExpertRowAlign.
  std::int64_t grouped_rows(std::int64_t slot_count) const {
    return slot_count + (kExpertRowAlign - 1) * std::min(config_.router.num_experts, slot_count);
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
    LMOE_CUDA_CHECK(cudaEventSynchronize(order_copied_));
    const std::int64_t rows = (tokens + 63) / 64 * 64;
    const std::int64_t d = config_.d_model, l = config_.d_latent;
    const std::int64_t experts = config_.router.num_experts, slot_rows = slots(rows);
    const std::int64_t group_rows = grouped_rows(slot_rows);
    const bool gated = is_gated(config_.activation);
    x32_ = DeviceBuffer(floats(rows * d));
    logits_ = DeviceBuffer(floats(rows * experts));
    routing_device_ = DeviceBuffer(2 * floats(slot_rows));  // ids [T·k] int32, weights [T·k] fp32
    routing_host_ = PinnedBuffer(2 * floats(slot_rows));
    // int32: the row of each slot, then the token of each grouped row.
    order_device_ = DeviceBuffer(floats(slot_rows + group_rows));
    order_host_ = PinnedBuffer(floats(slot_rows + group_rows));
    latent_ = DeviceBuffer(bytes(rows * l));
    gathered_ = DeviceBuffer(bytes(group_rows * l));
    expert_up_acc_ = DeviceBuffer(floats(group_rows * inter_));
    expert_gate_acc_ = gated ? DeviceBuffer(floats(group_rows * inter_)) : DeviceBuffer();
    hidden_ = DeviceBuffer(bytes(group_rows * inter_));
    slot_out_ = DeviceBuffer(floats(group_rows * l));
    shared_up_acc_ = DeviceBuffer(floats(rows * shared_width_));
    shared_gate_acc_ = gated ? DeviceBuffer(floats(rows * shared_width_)) : DeviceBuffer();
    shared_hidden_ = DeviceBuffer(bytes(rows * shared_width_));
    capacity_ = rows;
  }

  // ids and weights [T, k] on the device, then in routing_host_ (the copy is on `stream`).
  void route(ConstMatrixView x, cudaStream_t stream) {
    const std::int64_t tokens = x.rows, d = config_.d_model, experts = config_.router.num_experts;
    auto* ids = static_cast<std::int32_t*>(routing_device_.data());
    auto* weights = reinterpret_cast<float*>(ids + slots(tokens));
    // The router weight is fp32: x is converted exactly, and the GEMM accumulates in fp32.
    check(
        cuda::launch_to_float(x.data, static_cast<float*>(x32_.data()), tokens * d, dtype_, stream),
        "launch_to_float");
    gemm_->run(x32_.data(), router_weight_.data(), d, logits_.data(), experts, tokens, experts, d,
               DType::f32, DType::f32, stream);
    check(cuda::launch_route(static_cast<const float*>(logits_.data()),
                             static_cast<const float*>(router_bias_.data()), tokens, config_.router,
                             ids, weights, stream),
          "launch_route");
    // ids and weights are adjacent: one copy. routing_host_ is free: the host read the last one.
    LMOE_CUDA_CHECK(cudaMemcpyAsync(routing_host_.data(), ids, 2 * floats(slots(tokens)),
                                    cudaMemcpyDeviceToHost, stream));
  }

  // The host's copy of the routing, then the slots (t·k + j) grouped by expert, tokens ascending
  // within an expert (the CPU executor's counting sort): first_[e] … first_[e + 1] are expert e's
  // rows of the gathered latent. Each expert's rows are padded to a multiple of kExpertRowAlign
  // with copies of token 0 (computed, never read), so that every per-expert GEMM operand starts
  // 16-byte aligned whatever l and I/tp are, and GEMM shapes repeat (m a multiple of 8: few
  // cuBLASLt plans). Uploads each slot's row and the grouped rows' tokens; returns the row count.
  std::int64_t sort_slots(std::int64_t tokens, cudaStream_t stream) {
    const std::int64_t count = slots(tokens), experts = config_.router.num_experts;
    LMOE_CUDA_CHECK(cudaEventSynchronize(router_end_));
    const auto* ids = static_cast<const std::int32_t*>(routing_host_.data());
    const auto* weights = reinterpret_cast<const float*>(ids + count);
    routing_.expert_ids.assign(ids, ids + count);
    routing_.weights.assign(weights, weights + count);

    first_.assign(static_cast<std::size_t>(experts + 1), 0);
    for (std::int64_t s = 0; s < count; ++s) {
      const std::int32_t e = ids[s];
      LMOE_CHECK(e >= 0 && e < experts, "router: expert id " + std::to_string(e) +
                                            " out of range 0 … " + std::to_string(experts - 1));
      ++first_[static_cast<std::size_t>(e) + 1];
    }
    for (std::int64_t e = 0; e < experts; ++e) {
      const std::int64_t padded =
          (first_[e + 1] + kExpertRowAlign - 1) / kExpertRowAlign * kExpertRowAlign;
      first_[e + 1] = first_[e] + padded;
    }
    const std::int64_t rows = first_[static_cast<std::size_t>(experts)];
    // The previous forward's upload from order_host_ must be done before it is rewritten (it is,
    // on one stream; not necessarily when the caller changed streams).
    LMOE_CUDA_CHECK(cudaEventSynchronize(order_copied_));
    auto* row_of_slot = static_cast<std::int32_t*>(order_host_.data());  // [T·k]
    std::int32_t* token_of_row = row_of_slot + count;                    // [rows]
    std::fill(token_of_row, token_of_row + rows, 0);
    std::vector<std::int64_t> next(first_.begin(), first_.end() - 1);
    for (std::int64_t s = 0; s < count; ++s) {
      const std::int64_t row = next[static_cast<std::size_t>(ids[s])]++;
      token_of_row[row] = static_cast<std::int32_t>(s / config_.router.top_k);
      row_of_slot[s] = static_cast<std::int32_t>(row);
    }
    LMOE_CUDA_CHECK(cudaMemcpyAsync(order_device_.data(), order_host_.data(), floats(count + rows),
                                    cudaMemcpyHostToDevice, stream));
    LMOE_CUDA_CHECK(cudaEventRecord(order_copied_, stream));
    return rows;
  }

  // routed [T, l] = round(Σ_j w_tj · o_tj), o_tj = round(act(z_t·G_eᵀ, z_t·U_eᵀ)) · D_eᵀ in fp32.
  void run_routed_experts(std::int64_t tokens, MatrixView routed, cudaStream_t stream) {
    const std::int64_t l = config_.d_latent, count = slots(tokens);
    const std::int64_t experts = config_.router.num_experts;
    const bool gated = is_gated(config_.activation);
    const std::int64_t rows_total = sort_slots(tokens, stream);
    const auto* row_of_slot = static_cast<const std::int32_t*>(order_device_.data());
    const std::int32_t* token_of_row = row_of_slot + count;
    check(cuda::launch_gather_rows(latent_.data(), token_of_row, gathered_.data(), rows_total, l,
                                   dtype_, stream),
          "launch_gather_rows");

    const std::size_t matrix = bytes(inter_ * l);  // one expert's slice of a projection
    for (std::int64_t e = 0; e < experts; ++e) {
      const std::int64_t first = first_[e], rows = first_[e + 1] - first_[e];
      if (rows == 0) continue;
      const void* a = offset(gathered_, bytes(first * l));
      gemm_->run(a, offset(expert_up_, e * matrix), l,
                 offset(expert_up_acc_, floats(first * inter_)), inter_, rows, inter_, l, dtype_,
                 DType::f32, stream);
      if (gated) {
        gemm_->run(a, offset(expert_gate_, e * matrix), l,
                   offset(expert_gate_acc_, floats(first * inter_)), inter_, rows, inter_, l,
                   dtype_, DType::f32, stream);
      }
    }
    check(cuda::launch_activation(static_cast<const float*>(expert_gate_acc_.data()),
                                  static_cast<const float*>(expert_up_acc_.data()), hidden_.data(),
                                  rows_total * inter_, config_, dtype_, stream),
          "launch_activation");
    for (std::int64_t e = 0; e < experts; ++e) {
      const std::int64_t first = first_[e], rows = first_[e + 1] - first_[e];
      if (rows == 0) continue;
      gemm_->run(offset(hidden_, bytes(first * inter_)), offset(expert_down_, e * matrix), inter_,
                 offset(slot_out_, floats(first * l)), l, rows, l, inter_, dtype_, DType::f32,
                 stream);
    }
    const auto* weights = reinterpret_cast<const float*>(
        static_cast<const std::int32_t*>(routing_device_.data()) + count);
    check(cuda::launch_combine(static_cast<const float*>(slot_out_.data()), row_of_slot, weights,
                               routed.data, tokens, config_.router.top_k, l, dtype_, stream),
          "launch_combine");
  }

  // shared [T, d] = round(round(act(x · G_sᵀ, x · U_sᵀ)) · D_sᵀ) on the side stream; +0 without
  // shared experts.
  void run_shared_experts(ConstMatrixView x, MatrixView shared) {
    const std::int64_t tokens = x.rows, d = config_.d_model;
    if (shared_width_ == 0) {
      LMOE_CUDA_CHECK(cudaMemsetAsync(shared.data, 0, bytes(tokens * d), side_stream_));
      return;
    }
    side_gemm_->run(x.data, shared_up_.data(), d, shared_up_acc_.data(), shared_width_, tokens,
                    shared_width_, d, dtype_, DType::f32, side_stream_);
    if (is_gated(config_.activation)) {
      side_gemm_->run(x.data, shared_gate_.data(), d, shared_gate_acc_.data(), shared_width_,
                      tokens, shared_width_, d, dtype_, DType::f32, side_stream_);
    }
    check(cuda::launch_activation(static_cast<const float*>(shared_gate_acc_.data()),
                                  static_cast<const float*>(shared_up_acc_.data()),
                                  shared_hidden_.data(), tokens * shared_width_, config_, dtype_,
                                  side_stream_),
          "launch_activation");
    side_gemm_->run(shared_hidden_.data(), shared_down_.data(), shared_width_, shared.data, d,
                    tokens, d, shared_width_, dtype_, dtype_, side_stream_);
  }

  LayerConfig config_;
  DType dtype_;
  std::size_t esize_;
  std::int64_t inter_;         // this rank's slice of each routed expert's intermediate dim
  std::int64_t shared_width_;  // this rank's slice of the shared experts' intermediate dim
  int device_ = 0;

  DeviceBuffer router_weight_;  // [E, d] fp32
  DeviceBuffer router_bias_;    // [E] fp32, or empty
  DeviceBuffer latent_down_;    // [l, d]
  DeviceBuffer expert_gate_;    // [E, I_r, l], or empty (relu2)
  DeviceBuffer expert_up_;      // [E, I_r, l]
  DeviceBuffer expert_down_;    // [E, l, I_r]
  DeviceBuffer shared_gate_;    // [S_r, d], or empty
  DeviceBuffer shared_up_;      // [S_r, d]
  DeviceBuffer shared_down_;    // [d, S_r]

  std::unique_ptr<cuda::CublasLtGemm> gemm_, side_gemm_;
  cudaStream_t side_stream_ = nullptr;
  // Timing events (docs/layer.md): router [start, router_end], down-projection [router_end,
  // down_end], experts [down_end, experts_end] on the main stream, shared on the side stream, tail
  // around LatentTail::forward. router_end also tells the host that the routing has arrived.
  cudaEvent_t start_ = nullptr, router_end_ = nullptr, down_end_ = nullptr, experts_end_ = nullptr;
  cudaEvent_t shared_start_ = nullptr, shared_end_ = nullptr, tail_start_ = nullptr,
              tail_end_ = nullptr;
  cudaEvent_t order_copied_ = nullptr;  // order_host_ may be rewritten
  bool timed_ = false, tail_timed_ = false;

  std::int64_t capacity_ = 0;    // tokens the workspaces hold
  DeviceBuffer x32_;             // [T, d] fp32
  DeviceBuffer logits_;          // [T, E] fp32
  DeviceBuffer routing_device_;  // ids [T·k] int32, then weights [T·k] fp32
  PinnedBuffer routing_host_;    // the same, on the host
  DeviceBuffer order_device_;    // row of each slot [T·k] int32, then token of each grouped row
  PinnedBuffer order_host_;
  DeviceBuffer latent_;  // [T, l] z
  // Grouped rows (G = grouped_rows(T·k)): each expert's rows together, padded.
  DeviceBuffer gathered_;            // [G, l] z rows grouped by expert
  DeviceBuffer expert_up_acc_;       // [G, I_r] fp32
  DeviceBuffer expert_gate_acc_;     // [G, I_r] fp32 (gated)
  DeviceBuffer hidden_;              // [G, I_r] storage dtype
  DeviceBuffer slot_out_;            // [G, l] fp32
  DeviceBuffer shared_up_acc_;       // [T, S_r] fp32
  DeviceBuffer shared_gate_acc_;     // [T, S_r] fp32 (gated)
  DeviceBuffer shared_hidden_;       // [T, S_r] storage dtype
  std::vector<std::int64_t> first_;  // [E + 1] first gathered row of each expert

  std::int64_t partial_capacity_ = 0;
  DeviceBuffer routed_partial_;  // [T, l] for forward()
  DeviceBuffer shared_partial_;  // [T, d]

  Routing routing_;
};

}  // namespace

std::unique_ptr<LayerExecutor> make_cuda_layer_executor(const LayerConfig& config, DType dtype,
                                                        int tp, const LayerWeights& weights) {
  return std::make_unique<CudaLayerExecutor>(config, dtype, tp, weights);
}

}  // namespace lmoe

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
// device path (LMOE_LAYER_DEVICE_EXPERTS=1: eager ones too). Stage times come from events, each
// stage's own pair on its own stream (docs/layer.md); a captured forward has none.
#include "cuda/layer/cuda_layer_executor.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "lmoe/settings.hpp"
#include "core/router_weight_split.hpp"
#include "cuda/gemm/cublaslt_gemm.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/layer/layer_kernels.hpp"
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
  CudaLayerExecutor(const LayerConfig& config, DType dtype, int tp, const LayerWeights& weights,
                    std::int64_t max_tokens)
      : config_(config),
        dtype_(dtype),
        esize_(dtype_size(dtype)),
        inter_(config.expert_intermediate / tp),
        shared_width_(config.shared_width() / tp),
        device_limit_(cuda_device_experts_limit(config, dtype, tp)),
        device_eager_(setting_flag(kDeviceExpertsEnv)),
        serial_stages_(setting_flag(kSerialStagesEnv)),
        split_router_(dtype == DType::bf16) {
    LMOE_CUDA_CHECK(cudaGetDevice(&device_));
    if (device_eager_ && device_limit_) {
      throw Error(std::string(kDeviceExpertsEnv) +
                  "=1: the device path cannot run this layer: " + *device_limit_);
    }
    // A bf16 layer's router GEMM runs on tensor cores over the weight split into three bf16 parts
    // (every product exact, sums in fp32: the router contract); others convert x to fp32.
    if (split_router_) {
      router_parts_ = upload(split_router_weight_bf16(weights.router_weight));
    } else {
      router_weight_ = upload(weights.router_weight);
    }
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
    sorted_first_ = DeviceBuffer(sizeof(std::int32_t) * (config.router.num_experts + 1));
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
    cudaEventSynchronize(order_copied_);
    for (cudaEvent_t event : {start_, router_end_, down_end_, experts_end_, shared_start_,
                              shared_end_, tail_start_, tail_end_, order_copied_}) {
      cudaEventDestroy(event);
    }
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
      const auto* ids = static_cast<const std::int32_t*>(routing_host_.data());
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
    const bool device_path = captured_ || device_eager_;

    LMOE_CUDA_CHECK(cudaEventRecord(start_, stream));
    // The shared experts on the side stream, from `after` on `stream`.
    const auto fork_shared_experts = [&](cudaEvent_t after) {
      LMOE_CUDA_CHECK(cudaStreamWaitEvent(side_stream_, after, 0));
      LMOE_CUDA_CHECK(cudaEventRecord(shared_start_, side_stream_));
      run_shared_experts(x, shared);
      LMOE_CUDA_CHECK(cudaEventRecord(shared_end_, side_stream_));
    };
    if (!serial_stages_) fork_shared_experts(start_);

    route(x, stream);
    LMOE_CUDA_CHECK(cudaEventRecord(router_end_, stream));

    // z = round(x · W_downᵀ) [T, l], replicated.
    gemm_->run(x.data, latent_down_.data(), config_.d_model, latent_.data(), config_.d_latent,
               tokens, config_.d_latent, config_.d_model, dtype_, dtype_, stream);
    LMOE_CUDA_CHECK(cudaEventRecord(down_end_, stream));

    if (device_path) {
      run_routed_experts_on_device(tokens, routed, stream);
      routing_pending_ = !captured_;
    } else {
      run_routed_experts(tokens, routed, stream);
    }
    LMOE_CUDA_CHECK(cudaEventRecord(experts_end_, stream));
    if (serial_stages_) fork_shared_experts(experts_end_);
    LMOE_CUDA_CHECK(cudaStreamWaitEvent(stream, shared_end_, 0));
    // Events recorded during a capture only order the captured work; they time nothing.
    timed_ = !captured_;
  }

  bool begin_tail(StreamHandle handle) override {
    LMOE_CUDA_CHECK(cudaEventRecord(tail_start_, cuda::stream_or_default(handle)));
    return true;
  }
  void end_tail(StreamHandle handle) override {
    LMOE_CUDA_CHECK(cudaEventRecord(tail_end_, cuda::stream_or_default(handle)));
    tail_timed_ = !captured_;
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
  static std::size_t floats(std::int64_t elements) {
    return static_cast<std::size_t>(elements) * sizeof(float);
  }
  std::int64_t slots(std::int64_t tokens) const { return tokens * config_.router.top_k; }
  // Rows of the expert-grouped buffers for `slot_count` slots: each active expert's rows padded to
  // a multiple of kExpertRowAlign.
  std::int64_t grouped_rows(std::int64_t slot_count) const {
    return slot_count + (kExpertRowAlign - 1) * std::min(config_.router.num_experts, slot_count);
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
    LMOE_CUDA_CHECK(cudaEventSynchronize(order_copied_));
    const std::int64_t rows = (tokens + 63) / 64 * 64;
    const std::int64_t d = config_.d_model, l = config_.d_latent;
    const std::int64_t experts = config_.router.num_experts, slot_rows = slots(rows);
    const std::int64_t group_rows = grouped_rows(slot_rows);
    const bool gated = is_gated(config_.activation);
    x32_ = split_router_ ? DeviceBuffer() : DeviceBuffer(floats(rows * d));
    router_x_ = split_router_ ? DeviceBuffer(bytes(rows * d)) : DeviceBuffer();
    logits_ = DeviceBuffer(floats(rows * experts * (split_router_ ? 3 : 1)));
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

  // ids and weights [T, k] on the device, then (eager forwards) in routing_host_, by a copy on
  // `stream`.
  void route(ConstMatrixView x, cudaStream_t stream) {
    const std::int64_t tokens = x.rows, d = config_.d_model, experts = config_.router.num_experts;
    auto* ids = static_cast<std::int32_t*>(routing_device_.data());
    auto* weights = reinterpret_cast<float*>(ids + slots(tokens));
    if (split_router_) {
      // [T, 3E] fp32: x times each bf16 part of the weight (exact products, fp32 sums); the route
      // kernel adds each expert's three. x is copied first into a buffer of this executor: the
      // GEMM's algorithm depends on its operands' alignment, and every rank must route alike
      // whatever the alignment of its caller's x.
      LMOE_CUDA_CHECK(cudaMemcpyAsync(router_x_.data(), x.data, bytes(tokens * d),
                                      cudaMemcpyDeviceToDevice, stream));
      gemm_->run(router_x_.data(), router_parts_.data(), d, logits_.data(), 3 * experts, tokens,
                 3 * experts, d, DType::bf16, DType::f32, stream);
    } else {
      // The router weight is fp32: x is converted exactly, and the GEMM accumulates in fp32.
      check(cuda::launch_to_float(x.data, static_cast<float*>(x32_.data()), tokens * d, dtype_,
                                  stream),
            "launch_to_float");
      gemm_->run(x32_.data(), router_weight_.data(), d, logits_.data(), experts, tokens, experts, d,
                 DType::f32, DType::f32, stream);
    }
    check(cuda::launch_route(static_cast<const float*>(logits_.data()),
                             static_cast<const float*>(router_bias_.data()), tokens, config_.router,
                             ids, weights, stream, split_router_ ? 3 : 1),
          "launch_route");
    // ids and weights are adjacent: one copy. routing_host_ is free: the host read the last one
    // (the host path at once; the device path's host_routing() waits for router_end_, and a
    // forward's reserve() or this copy comes after the previous forward's router). A captured
    // forward copies nothing: a graph's replays would overwrite it behind the host's back.
    if (!captured_) {
      LMOE_CUDA_CHECK(cudaMemcpyAsync(routing_host_.data(), ids, 2 * floats(slots(tokens)),
                                      cudaMemcpyDeviceToHost, stream));
    }
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
    check(cuda::launch_gather_rows(latent_.data(), l, token_of_row, gathered_.data(), rows_total, l,
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

  // The device path of run_routed_experts: the same rows, sums and roundings, sized on the device.
  // The sort writes the host path's order bit for bit; the up GEMM reads z's rows through the
  // sorted tokens (staged in gathered_ first where its tile loads rows by TMA) and applies the
  // activation to its fp32 accumulators (the activation kernel's formula); the down GEMM writes
  // fp32 slot outputs; the combine is shared.
  // Only the GEMMs' summation order over K differs from cuBLASLt's (docs/layer.md).
  void run_routed_experts_on_device(std::int64_t tokens, MatrixView routed, cudaStream_t stream) {
    const std::int64_t l = config_.d_latent, count = slots(tokens);
    const std::int64_t experts = config_.router.num_experts;
    const auto* ids = static_cast<const std::int32_t*>(routing_device_.data());
    auto* first = static_cast<std::int32_t*>(sorted_first_.data());
    auto* row_of_slot = static_cast<std::int32_t*>(order_device_.data());
    std::int32_t* token_of_row = row_of_slot + count;
    check(cuda::launch_sort_slots(ids, count, experts, config_.router.top_k, kExpertRowAlign, first,
                                  row_of_slot, token_of_row, stream),
          "launch_sort_slots");

    cuda::GroupedGemmArgs up;
    up.a = latent_.data();
    up.a_rows = token_of_row;
    up.lda = l;
    // Where the warp-specialized tile pays, the launcher stages the gathered rows here first.
    up.a_staging = gathered_.data();
    up.b = expert_up_.data();
    up.b2 = is_gated(config_.activation) ? expert_gate_.data() : nullptr;
    up.b_group_stride = inter_ * l;
    up.c = hidden_.data();
    up.ldc = inter_;
    up.n = inter_;
    up.k = l;
    up.first = first;
    up.groups = static_cast<int>(experts);
    up.max_rows = grouped_rows(count);
    up.max_groups = std::min(experts, count);
    up.dtype = dtype_;
    up.out = cuda::GroupedOut::activation;
    up.activation = &config_;
    if (auto why = cuda::grouped_gemm_unsupported(up)) throw Error("experts' up GEMM: " + *why);
    check(cuda::launch_grouped_gemm(up, stream), "launch_grouped_gemm(up)");

    cuda::GroupedGemmArgs down = up;
    down.a = hidden_.data();
    down.a_rows = nullptr;
    down.lda = inter_;
    down.b = expert_down_.data();
    down.b2 = nullptr;
    down.c = slot_out_.data();
    down.ldc = l;
    down.n = l;
    down.k = inter_;
    down.out = cuda::GroupedOut::f32;
    down.activation = nullptr;
    if (auto why = cuda::grouped_gemm_unsupported(down)) throw Error("experts' down GEMM: " + *why);
    check(cuda::launch_grouped_gemm(down, stream), "launch_grouped_gemm(down)");

    const auto* weights = reinterpret_cast<const float*>(ids + count);
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
  std::optional<std::string> device_limit_;  // why the device path cannot run, or nullopt
  bool device_eager_;                        // LMOE_LAYER_DEVICE_EXPERTS=1
  bool serial_stages_;                       // LMOE_LAYER_SERIAL_STAGES=1
  bool split_router_;                        // bf16 x: the router GEMM over router_parts_
  int device_ = 0;

  DeviceBuffer router_weight_;  // [E, d] fp32 (not split_router_)
  DeviceBuffer router_parts_;   // [3E, d] bf16 (split_router_): core/router_weight_split.hpp
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
  bool captured_ = false;  // the last forward was captured (no times, no host routing)
  mutable bool routing_pending_ = false;  // routing_host_ holds an eager device-path routing
  mutable bool partials_short_ = false;   // partial_buffers could not grow under capture

  std::int64_t capacity_ = 0;    // tokens the workspaces hold
  DeviceBuffer x32_;             // [T, d] fp32 (not split_router_)
  DeviceBuffer router_x_;        // [T, d] bf16 (split_router_): x where the router GEMM reads it
  DeviceBuffer logits_;          // [T, E] fp32, [T, 3E] with split_router_
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
  std::vector<std::int64_t> first_;  // [E + 1] first gathered row of each expert (host path)
  DeviceBuffer sorted_first_;        // [E + 1] int32, the same on the device (device path)

  std::int64_t partial_capacity_ = 0;
  DeviceBuffer routed_partial_;  // [T, l] for forward()
  DeviceBuffer shared_partial_;  // [T, d]

  mutable Routing routing_;
};

}  // namespace

std::unique_ptr<LayerExecutor> make_cuda_layer_executor(const LayerConfig& config, DType dtype,
                                                        int tp, const LayerWeights& weights,
                                                        std::int64_t max_tokens) {
  return std::make_unique<CudaLayerExecutor>(config, dtype, tp, weights, max_tokens);
}

}  // namespace lmoe

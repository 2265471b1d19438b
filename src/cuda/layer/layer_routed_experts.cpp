#include "cuda/layer/layer_routed_experts.hpp"

#include <algorithm>
#include <string>

#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/layer/layer_kernels.hpp"
#include "lmoe/error.hpp"

namespace lmoe::cuda {

RoutedExperts::RoutedExperts(const LayerConfig& config, DType dtype, std::int64_t inter,
                             const LayerWeights& weights)
    : config_(config), dtype_(dtype), inter_(inter), experts_(weights) {
  order_copied_ = make_event(false);
  sorted_first_ = DeviceBuffer(sizeof(std::int32_t) * (config.router.num_experts + 1));
}

RoutedExperts::~RoutedExperts() {
  cudaEventSynchronize(order_copied_);
  cudaEventDestroy(order_copied_);
}

void RoutedExperts::wait_for_order_upload() const {
  LMOE_CUDA_CHECK(cudaEventSynchronize(order_copied_));
}

void RoutedExperts::reserve(std::int64_t rows) {
  const std::int64_t l = config_.d_latent, slot_rows = slots(rows);
  const std::int64_t group_rows = grouped_rows(slot_rows, config_.router.num_experts);
  const bool gated = is_gated(config_.activation);
  // int32: the row of each slot, then the token of each grouped row.
  order_device_ = DeviceBuffer(floats(slot_rows + group_rows));
  order_host_ = MappedHostBuffer(floats(slot_rows + group_rows));
  gathered_ = DeviceBuffer(bytes(group_rows * l));
  expert_up_acc_ = DeviceBuffer(floats(group_rows * inter_));
  expert_gate_acc_ = gated ? DeviceBuffer(floats(group_rows * inter_)) : DeviceBuffer();
  hidden_ = DeviceBuffer(bytes(group_rows * inter_));
  slot_out_ = DeviceBuffer(floats(group_rows * l));
}

// The host's copy of the routing, then the slots (t·k + j) grouped by expert, tokens ascending
// within an expert (the CPU executor's counting sort): first_[e] … first_[e + 1] are expert e's
// rows of the gathered latent. Each expert's rows are padded to a multiple of kExpertRowAlign
// with copies of token 0 (computed, never read), so that every per-expert GEMM operand starts
// 16-byte aligned whatever l and I/tp are, and GEMM shapes repeat (m a multiple of 8: few
// cuBLASLt plans). Uploads each slot's row and the grouped rows' tokens; returns the row count.
std::int64_t RoutedExperts::sort_slots(std::int64_t tokens, const LayerRouter& router,
                                       cudaEvent_t router_end, Routing& routing,
                                       cudaStream_t stream) {
  const std::int64_t count = slots(tokens), experts = config_.router.num_experts;
  LMOE_CUDA_CHECK(cudaEventSynchronize(router_end));
  const std::int32_t* ids = router.host_routing();
  const auto* weights = reinterpret_cast<const float*>(ids + count);
  routing.expert_ids.assign(ids, ids + count);
  routing.weights.assign(weights, weights + count);

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
void RoutedExperts::run_on_host(std::int64_t tokens, const LayerRouter& router,
                                cudaEvent_t router_end, Routing& routing,
                                const DeviceBuffer& latent, MatrixView routed, CublasLtGemm& gemm,
                                cudaStream_t stream) {
  LMOE_CHECK(!experts_.packed(),
             "routed experts: MXFP4 experts kept packed run on the device path only (the host "
             "path's cuBLASLt GEMMs read dense weights)");
  const std::int64_t l = config_.d_latent, count = slots(tokens);
  const std::int64_t experts = config_.router.num_experts;
  const bool gated = is_gated(config_.activation);
  const std::int64_t rows_total = sort_slots(tokens, router, router_end, routing, stream);
  const auto* row_of_slot = static_cast<const std::int32_t*>(order_device_.data());
  const std::int32_t* token_of_row = row_of_slot + count;
  check(launch_gather_rows(latent.data(), l, token_of_row, gathered_.data(), rows_total, l, dtype_,
                           stream),
        "launch_gather_rows");

  const std::size_t matrix = bytes(inter_ * l);  // one expert's slice of a projection
  for (std::int64_t e = 0; e < experts; ++e) {
    const std::int64_t first = first_[e], rows = first_[e + 1] - first_[e];
    if (rows == 0) continue;
    const void* a = offset(gathered_, bytes(first * l));
    gemm.run(a, offset(experts_.up, e * matrix), l, offset(expert_up_acc_, floats(first * inter_)),
             inter_, rows, inter_, l, dtype_, DType::f32, stream);
    if (gated) {
      gemm.run(a, offset(experts_.gate, e * matrix), l,
               offset(expert_gate_acc_, floats(first * inter_)), inter_, rows, inter_, l, dtype_,
               DType::f32, stream);
    }
  }
  check(launch_activation(static_cast<const float*>(expert_gate_acc_.data()),
                          static_cast<const float*>(expert_up_acc_.data()), hidden_.data(),
                          rows_total * inter_, config_, dtype_, stream),
        "launch_activation");
  for (std::int64_t e = 0; e < experts; ++e) {
    const std::int64_t first = first_[e], rows = first_[e + 1] - first_[e];
    if (rows == 0) continue;
    gemm.run(offset(hidden_, bytes(first * inter_)), offset(experts_.down, e * matrix), inter_,
             offset(slot_out_, floats(first * l)), l, rows, l, inter_, dtype_, DType::f32, stream);
  }
  const auto* weights = reinterpret_cast<const float*>(router.device_routing() + count);
  check(launch_combine(static_cast<const float*>(slot_out_.data()), row_of_slot, weights,
                       routed.data, tokens, config_.router.top_k, l, dtype_, stream),
        "launch_combine");
}

namespace {

// The grouped GEMM reads `weight` (and `gate`, or none) as MXFP4, in place of dense b and b2.
void use_packed(const DeviceMxfp4Weight& weight, const DeviceMxfp4Weight* gate,
                GroupedGemmArgs& args) {
  args.b = args.b2 = nullptr;
  args.b_group_stride = 0;
  args.b_blocks = weight.blocks_data();
  args.b_scales = weight.scales_data();
  args.b2_blocks = gate ? gate->blocks_data() : nullptr;
  args.b2_scales = gate ? gate->scales_data() : nullptr;
  args.blocks_group_stride = weight.blocks_per_expert;
  args.scales_group_stride = weight.scales_per_expert;
}

}  // namespace

// The device path of run_on_host: the same rows, sums and roundings, sized on the device.
// The sort writes the host path's order bit for bit; the up GEMM reads z's rows through the
// sorted tokens (staged in gathered_ first where its tile loads rows by TMA) and applies the
// activation to its fp32 accumulators (the activation kernel's formula); the down GEMM writes
// fp32 slot outputs; the combine is shared.
// Only the GEMMs' summation order over K differs from cuBLASLt's (docs/layer.md). Packed experts
// are read as MXFP4 and dequantized in the GEMMs' main loop: the bits of the dequantized experts.
void RoutedExperts::run_on_device(std::int64_t tokens, const LayerRouter& router,
                                  const DeviceBuffer& latent, MatrixView routed,
                                  cudaStream_t stream) {
  const std::int64_t l = config_.d_latent, count = slots(tokens);
  const std::int64_t experts = config_.router.num_experts;
  const std::int32_t* ids = router.device_routing();
  auto* first = static_cast<std::int32_t*>(sorted_first_.data());
  auto* row_of_slot = static_cast<std::int32_t*>(order_device_.data());
  std::int32_t* token_of_row = row_of_slot + count;
  check(launch_sort_slots(ids, count, experts, config_.router.top_k, kExpertRowAlign, first,
                          row_of_slot, token_of_row, stream),
        "launch_sort_slots");

  GroupedGemmArgs up;
  up.a = latent.data();
  up.a_rows = token_of_row;
  up.lda = l;
  // Where the warp-specialized tile pays, the launcher stages the gathered rows here first.
  up.a_staging = gathered_.data();
  const bool gated = is_gated(config_.activation);
  up.b = experts_.up.data();
  up.b2 = gated ? experts_.gate.data() : nullptr;
  up.b_group_stride = inter_ * l;
  if (experts_.packed())
    use_packed(experts_.packed_up, gated ? &experts_.packed_gate : nullptr, up);
  up.c = hidden_.data();
  up.ldc = inter_;
  up.n = inter_;
  up.k = l;
  up.first = first;
  up.groups = static_cast<int>(experts);
  up.max_rows = grouped_rows(count, experts);
  up.max_groups = std::min(experts, count);
  up.dtype = dtype_;
  up.out = GroupedOut::activation;
  up.activation = &config_;
  if (auto why = grouped_gemm_unsupported(up)) throw Error("experts' up GEMM: " + *why);
  check(launch_grouped_gemm(up, stream), "launch_grouped_gemm(up)");

  GroupedGemmArgs down = up;
  down.a = hidden_.data();
  down.a_rows = nullptr;
  down.lda = inter_;
  down.b = experts_.down.data();
  down.b2 = nullptr;
  if (experts_.packed()) use_packed(experts_.packed_down, nullptr, down);
  down.c = slot_out_.data();
  down.ldc = l;
  down.n = l;
  down.k = inter_;
  down.out = GroupedOut::f32;
  down.activation = nullptr;
  if (auto why = grouped_gemm_unsupported(down)) throw Error("experts' down GEMM: " + *why);
  check(launch_grouped_gemm(down, stream), "launch_grouped_gemm(down)");

  const auto* weights = reinterpret_cast<const float*>(ids + count);
  check(launch_combine(static_cast<const float*>(slot_out_.data()), row_of_slot, weights,
                       routed.data, tokens, config_.router.top_k, l, dtype_, stream),
        "launch_combine");
}

}  // namespace lmoe::cuda

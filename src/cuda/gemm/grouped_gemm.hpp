// The grouped GEMM with device-resident group sizes (kernel: grouped_gemm.cuh): one launch
// computes, for every group g with rows first[g] … first[g + 1],
//
//   C[rows of g, N] = A[rows of g, K] · B_gᵀ   (bf16 or f16 operands, fp32 accumulation),
//
// with C in fp32, rounded once to the operands' dtype, or (the experts' up projection) through the
// activation: round(act(A · B2_gᵀ, A · B_gᵀ)) with B2 the gate weights (act of the up product alone
// for relu2). B and B2 may be MXFP4 (e2m1 codes and E8M0 scales, Mxfp4Tensor's layout), dequantized
// in the kernel's main loop: the same bits as the dense weights Mxfp4Tensor::dequantize gives on
// the same tile (wgmma_ws, whose TMA loads bf16 rows, runs wgmma_m256's packed kernel). The host
// never reads `first`, so
// the call can be captured in a CUDA graph; it needs
// only a bound on the rows (max_rows ≥ first[groups]) and on the groups that hold rows.
// cuBLAS(Lt) 13.0 has no grouped GEMM whose sizes stay on the device (cublasGemmGroupedBatchedEx
// takes them in host arrays), hence this kernel. Host code only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>
#include <string>

#include "lmoe/dims.hpp"
#include "lmoe/dtype.hpp"

namespace lmoe::cuda {

enum class GroupedOut { f32, rounded, activation };

// The block tile's rows; automatic picks by the average rows per group (max_rows / max_groups):
// m16 for decode (≤ 16 rows per expert: the weights dominate), m64, m128 for large batches.
// m128_wide: 128 rows × twice m128's columns (warp tiles of 64 × 64: more MMAs per shared byte,
// more registers); only when asked for, until measurements say where it wins.
// wgmma: 128 rows × 128 weight rows on Hopper's warpgroup MMA (grouped_gemm_wgmma.cuh); compute
// capability 9.0 only; only when asked for.
// wgmma_m256: 256 rows (an expert's weights streamed once for up to 256 rows); compute 9.0 only.
// automatic picks it there from kGroupedWgmmaMinRows rows per group when rows are gathered.
// wgmma_ws: wgmma_m256's block as a warp-specialized kernel (grouped_gemm_wgmma_ws.cuh): a
// producer warpgroup loads the weights by TMA and the rows by cp.async into a ring of stages that
// two consumer warpgroups multiply, mbarriers between them; compute 9.0 only; automatic picks it
// there from kGroupedWgmmaMinRows rows per group when A is read in place (no a_rows) or when the
// caller gives a_staging for gathered rows (they are then copied there first and read in place).
// Weights the tensor map cannot address (K, lda or the group stride not a multiple of 8 elements,
// 16-byte copies impossible) run wgmma_m256's kernel instead (the same bits).
enum class GroupedTile { automatic, m16, m64, m128, m128_wide, wgmma, wgmma_m256, wgmma_ws };

// "automatic", "m16", "m64", "m128", "m128_wide", "wgmma", "wgmma_m256", "wgmma_ws".
const char* grouped_tile_name(GroupedTile tile);

// The average rows per group from which automatic picks a wgmma tile on compute 9.0: wgmma_ws
// where A is read in place (a_rows null) or staged (a_staging), wgmma_m256 where rows are gathered
// without a staging buffer. At Kimi-K3's experts the wgmma tiles win from 73 rows per expert on
// and m64 wins at 18 (docs/perf.md, "the routed experts' grouped GEMM"); between them nothing is
// measured, so the threshold sits at m64's tile height.
inline constexpr std::int64_t kGroupedWgmmaMinRows = 64;

// Why `tile` cannot run on a device of compute capability `compute_capability` (10·major + minor,
// 0: no device), nullopt when it can; automatic and the mma.sync tiles run everywhere.
std::optional<std::string> grouped_tile_unsupported(GroupedTile tile, int compute_capability);

struct GroupedGemmArgs {
  const void* a = nullptr;  // [*, lda]: row r of the grouped space is A's row a_rows[r]
  const std::int32_t* a_rows = nullptr;  // [max_rows] device, or null: row r is A's row r
  std::int64_t lda = 0;
  // [max_rows, k] scratch in `dtype`, or null. With a_rows and the tile wgmma_ws, the launcher
  // first copies the gathered rows (those below first[groups]) here, one pass, so that the tile's
  // producer loads them by TMA (its cp.async of 256 gathered rows falls behind the consumers:
  // docs/perf.md); the product and its bits are the same.
  void* a_staging = nullptr;
  const void* b = nullptr;   // [groups, N, K] row-major, group stride b_group_stride elements
  const void* b2 = nullptr;  // gate weights, same layout (GroupedOut::activation, gated), or null
  std::int64_t b_group_stride = 0;
  // MXFP4 weights in place of b and b2 (then null): b_blocks [groups, N, K/2] bytes, byte j of a
  // row holding the e2m1 codes of columns 2j (low nibble) and 2j + 1 (high nibble), and b_scales
  // [groups, N, K/32] E8M0 bytes, one per 32 columns of a row; a weight is e2m1 · 2^(scale − 127).
  // b2_blocks and b2_scales: the gate's, or null. K a multiple of 32, blocks 16-byte and scales
  // 4-byte aligned, group strides in bytes (blocks' a multiple of 16); wgmma_ws runs wgmma_m256.
  const std::uint8_t* b_blocks = nullptr;
  const std::uint8_t* b_scales = nullptr;
  const std::uint8_t* b2_blocks = nullptr;
  const std::uint8_t* b2_scales = nullptr;
  std::int64_t blocks_group_stride = 0;
  std::int64_t scales_group_stride = 0;
  void* c = nullptr;  // [max_rows, ldc] in fp32 (GroupedOut::f32) or `dtype`
  std::int64_t ldc = 0;
  std::int64_t n = 0, k = 0;
  const std::int32_t* first = nullptr;  // [groups + 1] device, non-decreasing from first[0] = 0
  int groups = 0;
  std::int64_t max_rows = 0;    // ≥ first[groups]
  std::int64_t max_groups = 0;  // ≥ the groups with at least one row (sizes the grid)
  DType dtype = DType::bf16;
  GroupedOut out = GroupedOut::f32;
  const LayerConfig* activation = nullptr;  // its activation, for GroupedOut::activation
  GroupedTile tile = GroupedTile::automatic;
};

// Why the kernel cannot run `args` (nullopt when it can): the dtype, K's row pitch (K even; 16-byte
// copies need K and lda multiples of 8, else 8- or 4-byte ones), the group count, a gate without
// a gated activation, a tile the current device cannot run (wgmma tiles off compute 9.0), MXFP4
// weights with K not a multiple of 32, misaligned, or beside dense ones. Names the argument and
// the expected value.
std::optional<std::string> grouped_gemm_unsupported(const GroupedGemmArgs& args);

// The tile `automatic` resolves to for these args on the current device, or on a device of
// compute capability `compute_capability` (10·major + minor; a pure function, for tests). MXFP4
// weights take the mma.sync tile of their rows per group (m16, m64, m128) on every device.
GroupedTile grouped_gemm_tile(const GroupedGemmArgs& args);
GroupedTile grouped_gemm_tile(const GroupedGemmArgs& args, int compute_capability);

// Whether `args` carries MXFP4 weights (b_blocks) instead of dense ones.
inline bool grouped_weights_packed(const GroupedGemmArgs& args) { return args.b_blocks != nullptr; }

// Loads every kernel of `dtype` on the current device and sets its shared-memory size, so that no
// later launch loads a module (a lazy load can wait for the GPU's running kernels — peers that
// spin on this rank, docs/p2p.md). Launches do it themselves too; this only moves it earlier.
cudaError_t prepare_grouped_gemm(DType dtype);

// Enqueues the GEMM on `stream`; cudaErrorInvalidValue where grouped_gemm_unsupported says why.
cudaError_t launch_grouped_gemm(const GroupedGemmArgs& args, cudaStream_t stream);

}  // namespace lmoe::cuda

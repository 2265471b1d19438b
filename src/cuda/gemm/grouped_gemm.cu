#include "cuda/gemm/grouped_gemm.cuh"
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/gemm/grouped_gemm_wgmma.cuh"
#include "cuda/gemm/grouped_gemm_wgmma_ws.cuh"
#include "cuda/layer/layer_kernels.hpp"

#include <algorithm>
#include <type_traits>

#include "cuda/runtime/cuda_device_info.hpp"
#include "cuda/runtime/tensor_map.hpp"

namespace lmoe::cuda {

namespace {

// The mma.sync tiles' shapes per (tile, gated, packed): gated blocks hold up and gate rows, so they
// take half the columns (the same shared bytes and accumulators per thread). m16 keeps 6 stages in
// flight: at decode the weights are nearly all of a stage, and bytes in flight set the pace; with
// MXFP4 weights (packed) 12, as a packed stage carries about a quarter of the weight bytes (the
// stages then take 62 KB, as the dense m16's 6 take 60).
template <bool kGated, bool kPacked>
using M16 = GroupedShape<16, kGated ? 32 : 64, 1, 4, kPacked ? 12 : 6, kGated, kPacked>;
template <bool kGated, bool kPacked>
using M64 = GroupedShape<64, kGated ? 64 : 128, 2, 4, 4, kGated, kPacked>;
template <bool kGated, bool kPacked>
using M128 = GroupedShape<128, kGated ? 64 : 128, 2, 4, 4, kGated, kPacked>;
template <bool kGated, bool kPacked>
using M128Wide = GroupedShape<128, kGated ? 128 : 256, 2, 4, 4, kGated, kPacked>;
using Wgmma = GroupedWgmmaShape<128, 5, false>;
using WgmmaGated = GroupedWgmmaShape<128, 5, true>;
using WgmmaM256 = GroupedWgmmaShape<256, 4, false>;
using WgmmaM256Gated = GroupedWgmmaShape<256, 4, true>;
// MXFP4 weights: a packed stage is 8 KiB smaller, so the same stages fit beside the two B tiles.
template <bool kGated>
using WgmmaPacked = GroupedWgmmaShape<128, 5, kGated, true>;
template <bool kGated>
using WgmmaM256Packed = GroupedWgmmaShape<256, 4, kGated, true>;
using WgmmaWs = GroupedWgmmaWsShape<false>;
using WgmmaWsGated = GroupedWgmmaWsShape<true>;

template <class Shape>
struct IsWgmmaShape : std::false_type {};
template <int kRowsM, int kStages, bool kGated, bool kPacked>
struct IsWgmmaShape<GroupedWgmmaShape<kRowsM, kStages, kGated, kPacked>> : std::true_type {};

// The kernel of a (dtype, shape): the wgmma shapes have their own.
template <class Shape>
struct IsWgmmaWsShape : std::false_type {};
template <bool kGated>
struct IsWgmmaWsShape<GroupedWgmmaWsShape<kGated>> : std::true_type {};

template <typename T, class Shape>
constexpr auto kernel_of() {
  if constexpr (IsWgmmaWsShape<Shape>::value) {
    return grouped_gemm_wgmma_ws_kernel<T, Shape>;
  } else if constexpr (IsWgmmaShape<Shape>::value) {
    return grouped_gemm_wgmma_kernel<T, Shape>;
  } else {
    return grouped_gemm_kernel<T, Shape>;
  }
}

bool has_gate(const GroupedGemmArgs& args) {
  return args.b2 != nullptr || args.b2_blocks != nullptr;
}

bool gated_call(const GroupedGemmArgs& args) {
  return args.out == GroupedOut::activation && has_gate(args);
}

bool wgmma_tile(GroupedTile tile) {
  return tile == GroupedTile::wgmma || tile == GroupedTile::wgmma_m256 ||
         tile == GroupedTile::wgmma_ws;
}

int copy_bytes_of(const GroupedGemmArgs& args) {
  const auto aligned = [&](std::int64_t elements) {
    const std::int64_t bytes = elements * 2;
    const auto address = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p); };
    return args.k % elements == 0 && args.lda % elements == 0 && address(args.a) % bytes == 0 &&
           address(args.b) % bytes == 0 && (args.b2 == nullptr || address(args.b2) % bytes == 0) &&
           args.b_group_stride % elements == 0;
  };
  if (aligned(8)) return 16;
  if (aligned(4)) return 8;
  if (aligned(2)) return 4;
  return 0;
}

template <typename T, class Shape>
cudaError_t prepare_shape() {
  return cudaFuncSetAttribute(kernel_of<T, Shape>(), cudaFuncAttributeMaxDynamicSharedMemorySize,
                              Shape::kSharedBytes);
}

template <typename T, bool kGated, bool kPacked>
cudaError_t prepare_mma_sync() {
  for (const cudaError_t status :
       {prepare_shape<T, M16<kGated, kPacked>>(), prepare_shape<T, M64<kGated, kPacked>>(),
        prepare_shape<T, M128<kGated, kPacked>>(), prepare_shape<T, M128Wide<kGated, kPacked>>()}) {
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

template <typename T>
cudaError_t prepare_typed() {
  for (const cudaError_t status :
       {prepare_mma_sync<T, false, false>(), prepare_mma_sync<T, true, false>(),
        prepare_mma_sync<T, false, true>(), prepare_mma_sync<T, true, true>()}) {
    if (status != cudaSuccess) return status;
  }
  // The wgmma kernels only where they can run (elsewhere their body is a trap).
  if (grouped_tile_unsupported(GroupedTile::wgmma, current_compute_capability()))
    return cudaSuccess;
  for (const cudaError_t status :
       {prepare_shape<T, Wgmma>(), prepare_shape<T, WgmmaGated>(), prepare_shape<T, WgmmaM256>(),
        prepare_shape<T, WgmmaM256Gated>(), prepare_shape<T, WgmmaWs>(),
        prepare_shape<T, WgmmaWsGated>(), prepare_shape<T, WgmmaPacked<false>>(),
        prepare_shape<T, WgmmaPacked<true>>(), prepare_shape<T, WgmmaM256Packed<false>>(),
        prepare_shape<T, WgmmaM256Packed<true>>()}) {
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

// The grid of a shape: (N tiles) × (a bound on the row tiles). Row tiles: Σ_g ceil(n_g / BM) ≤
// max_rows / BM + (groups holding rows), one partial tile each. False when it exceeds the limits.
template <class Shape>
bool grid_of(const GroupedGemmArgs& args, dim3& grid) {
  const std::int64_t row_tiles = (args.max_rows + Shape::kRowsM - 1) / Shape::kRowsM +
                                 std::min<std::int64_t>(args.max_groups, args.groups);
  const std::int64_t col_tiles = (args.n + Shape::kColsN - 1) / Shape::kColsN;
  if (row_tiles > 65535 || col_tiles > 0x7fffffff) return false;
  grid = dim3(static_cast<unsigned>(col_tiles), static_cast<unsigned>(row_tiles));
  return true;
}

template <typename T, class Shape>
cudaError_t launch_shape(const GroupedGemmArgs& args, const GroupedGemmParams& params,
                         cudaStream_t stream) {
  const auto kernel = kernel_of<T, Shape>();
  if (const cudaError_t status = prepare_shape<T, Shape>(); status != cudaSuccess) return status;
  dim3 grid;
  if (!grid_of<Shape>(args, grid)) return cudaErrorInvalidValue;
  kernel<<<grid, Shape::kThreads, Shape::kSharedBytes, stream>>>(params);
  return cudaGetLastError();
}

// Whether the weights can be read by the copy engine: a driver that encodes tensor maps, a row
// pitch and group stride of whole 16-byte units (16-byte copies everywhere: copy_bytes_of), groups
// that do not overlap, and coordinates that fit its 32-bit signed indices.
bool tensor_map_fits(const GroupedGemmArgs& args) {
  return tensor_maps_available() && copy_bytes_of(args) == 16 &&
         args.b_group_stride >= args.n * args.k && args.n <= 0x7fffffff && args.k <= 0x7fffffff;
}

template <typename T, class Shape>
cudaError_t launch_ws(const GroupedGemmArgs& args, const GroupedGemmParams& params,
                      cudaStream_t stream) {
  if (const cudaError_t status = prepare_shape<T, Shape>(); status != cudaSuccess) return status;
  dim3 grid;
  if (!grid_of<Shape>(args, grid)) return cudaErrorInvalidValue;
  // The weights [groups, N, K] (K contiguous) in boxes of 64 k × kBoxRows rows × 1 group.
  const auto weight_map = [&](const void* b, CUtensorMap& map) {
    return encode_grouped_rows_map(map, args.dtype, b, args.groups, args.n, args.k,
                                   args.b_group_stride, kGroupedTileK, Shape::kBoxRows);
  };
  CUtensorMap map_b{}, map_b2{};
  if (const cudaError_t status = weight_map(args.b, map_b); status != cudaSuccess) return status;
  // Ungated blocks never read b2's map: b's stands in.
  map_b2 = map_b;
  if constexpr (Shape::kGated) {
    if (const cudaError_t status = weight_map(args.b2, map_b2); status != cudaSuccess) {
      return status;
    }
  }
  // A by TMA where it is not gathered (its whole 64-row boxes: the kernel's header); the map's
  // rows are max_rows ([max_rows, K], pitch lda), at least one box of them.
  const bool a_by_tma = args.a_rows == nullptr && args.max_rows >= 64;
  CUtensorMap map_a = map_b;
  if (a_by_tma) {
    if (const cudaError_t status = encode_rows_map(map_a, args.dtype, args.a, args.max_rows, args.k,
                                                   args.lda, kGroupedTileK, 64);
        status != cudaSuccess) {
      return status;
    }
  }
  grouped_gemm_wgmma_ws_kernel<T, Shape><<<grid, Shape::kThreads, Shape::kSharedBytes, stream>>>(
      params, map_b, map_b2, map_a, a_by_tma);
  return cudaGetLastError();
}

// An mma.sync tile (m128 for any other), dense or MXFP4 weights.
template <typename T, bool kGated, bool kPacked>
cudaError_t launch_mma_sync(GroupedTile tile, const GroupedGemmArgs& args,
                            const GroupedGemmParams& params, cudaStream_t stream) {
  switch (tile) {
    case GroupedTile::m16: return launch_shape<T, M16<kGated, kPacked>>(args, params, stream);
    case GroupedTile::m64: return launch_shape<T, M64<kGated, kPacked>>(args, params, stream);
    case GroupedTile::m128_wide:
      return launch_shape<T, M128Wide<kGated, kPacked>>(args, params, stream);
    default: return launch_shape<T, M128<kGated, kPacked>>(args, params, stream);
  }
}

template <typename T, bool kPacked>
cudaError_t launch_mma_sync(GroupedTile tile, const GroupedGemmArgs& args,
                            const GroupedGemmParams& params, cudaStream_t stream) {
  return gated_call(args) ? launch_mma_sync<T, true, kPacked>(tile, args, params, stream)
                          : launch_mma_sync<T, false, kPacked>(tile, args, params, stream);
}

template <typename T>
cudaError_t launch_typed(const GroupedGemmArgs& args, const GroupedGemmParams& params,
                         cudaStream_t stream) {
  const GroupedTile tile = grouped_gemm_tile(args);
  const bool gated = gated_call(args);
  if (grouped_weights_packed(args)) {
    // MXFP4 weights: wgmma_ws loads B by TMA as bf16 rows, so its packed counterpart is
    // wgmma_m256's (the same rows per block, the same bits).
    switch (tile) {
      case GroupedTile::wgmma:
        return gated ? launch_shape<T, WgmmaPacked<true>>(args, params, stream)
                     : launch_shape<T, WgmmaPacked<false>>(args, params, stream);
      case GroupedTile::wgmma_m256:
      case GroupedTile::wgmma_ws:
        return gated ? launch_shape<T, WgmmaM256Packed<true>>(args, params, stream)
                     : launch_shape<T, WgmmaM256Packed<false>>(args, params, stream);
      default: return launch_mma_sync<T, true>(tile, args, params, stream);
    }
  }
  switch (tile) {
    case GroupedTile::wgmma:
      return gated ? launch_shape<T, WgmmaGated>(args, params, stream)
                   : launch_shape<T, Wgmma>(args, params, stream);
    case GroupedTile::wgmma_m256:
      return gated ? launch_shape<T, WgmmaM256Gated>(args, params, stream)
                   : launch_shape<T, WgmmaM256>(args, params, stream);
    case GroupedTile::wgmma_ws:
      // Weights the copy engine cannot address (K not a multiple of 8, odd strides, no encoder in
      // the driver): the wgmma_m256 kernel, the same rows per block and the same bits.
      if (!tensor_map_fits(args)) {
        return gated ? launch_shape<T, WgmmaM256Gated>(args, params, stream)
                     : launch_shape<T, WgmmaM256>(args, params, stream);
      }
      return gated ? launch_ws<T, WgmmaWsGated>(args, params, stream)
                   : launch_ws<T, WgmmaWs>(args, params, stream);
    default: return launch_mma_sync<T, false>(tile, args, params, stream);
  }
}

}  // namespace

const char* grouped_tile_name(GroupedTile tile) {
  switch (tile) {
    case GroupedTile::automatic: return "automatic";
    case GroupedTile::m16: return "m16";
    case GroupedTile::m64: return "m64";
    case GroupedTile::m128: return "m128";
    case GroupedTile::m128_wide: return "m128_wide";
    case GroupedTile::wgmma: return "wgmma";
    case GroupedTile::wgmma_m256: return "wgmma_m256";
    case GroupedTile::wgmma_ws: return "wgmma_ws";
  }
  return "?";
}

std::optional<std::string> grouped_tile_unsupported(GroupedTile tile, int compute_capability) {
  // wgmma is sm_90a's alone: sm_100a's tensor cores take tcgen05 instead.
  if (wgmma_tile(tile) && compute_capability != 90) {
    return "tile: " + std::string(grouped_tile_name(tile)) +
           " expected a compute capability 9.0 device (Hopper, sm_90a), got " +
           (compute_capability == 0 ? std::string("no device")
                                    : std::to_string(compute_capability / 10) + "." +
                                          std::to_string(compute_capability % 10));
  }
  return std::nullopt;
}

namespace {

// Why MXFP4 weights (b_blocks set) cannot run: dense ones beside them, missing scales, a gate not
// packed alike, K off the 32-column blocks, misaligned operands.
std::optional<std::string> packed_weights_unsupported(const GroupedGemmArgs& args) {
  if (args.b != nullptr || args.b2 != nullptr) {
    return std::string("b, b2: expected null with MXFP4 weights (b_blocks), got a dense one too");
  }
  if (args.b_scales == nullptr || (args.b2_blocks == nullptr) != (args.b2_scales == nullptr)) {
    return std::string("b_scales, b2_scales: expected the scales of every MXFP4 weight given");
  }
  if (args.k % 32 != 0) {
    return "k: expected a multiple of 32 with MXFP4 weights (32 columns share a scale), got " +
           std::to_string(args.k);
  }
  const auto address = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p); };
  if (address(args.b_blocks) % 16 != 0 || address(args.b2_blocks) % 16 != 0 ||
      args.blocks_group_stride % 16 != 0) {
    return "b_blocks, b2_blocks, blocks_group_stride: expected 16-byte aligned blocks and a "
           "stride of whole 16 bytes, got stride " +
           std::to_string(args.blocks_group_stride);
  }
  if (address(args.b_scales) % 4 != 0 || address(args.b2_scales) % 4 != 0) {
    return std::string("b_scales, b2_scales: expected 4-byte aligned scales");
  }
  return std::nullopt;
}

}  // namespace

std::optional<std::string> grouped_gemm_unsupported(const GroupedGemmArgs& args) {
  if (args.dtype != DType::bf16 && args.dtype != DType::f16) {
    return "dtype: expected bf16 or f16 (tensor-core operands), got " +
           std::string(dtype_name(args.dtype));
  }
  if (args.groups < 1 || args.groups > kGroupedMaxGroups) {
    return "groups: expected 1 … " + std::to_string(kGroupedMaxGroups) + ", got " +
           std::to_string(args.groups);
  }
  if (args.n < 0 || args.k < 1) {
    return "n, k: expected n ≥ 0 and k ≥ 1, got n=" + std::to_string(args.n) +
           " k=" + std::to_string(args.k);
  }
  if (args.max_rows < 0 || args.max_rows > 0x7fffffff || args.max_groups < 0) {
    return "max_rows: expected 0 … 2³¹ − 1 and max_groups ≥ 0, got " +
           std::to_string(args.max_rows) + " and " + std::to_string(args.max_groups);
  }
  if (args.lda < args.k || args.ldc < args.n) {
    return "lda, ldc: expected lda ≥ k = " + std::to_string(args.k) +
           " and ldc ≥ n = " + std::to_string(args.n);
  }
  const bool packed = grouped_weights_packed(args);
  if (args.first == nullptr || args.a == nullptr || (args.b == nullptr && !packed) ||
      args.c == nullptr) {
    return std::string("first, a, b, c: expected device pointers, got a null one");
  }
  if (packed) {
    if (auto why = packed_weights_unsupported(args)) return why;
  }
  if (args.out == GroupedOut::activation) {
    if (args.activation == nullptr)
      return std::string("activation: expected the layer config for GroupedOut::activation");
    if (is_gated(args.activation->activation) != has_gate(args)) {
      return std::string("b2: expected the gate weights exactly when the activation is gated (") +
             std::string(activation_name(args.activation->activation)) + ")";
    }
  } else if (has_gate(args)) {
    return std::string("b2: expected null unless out is GroupedOut::activation");
  }
  if (copy_bytes_of(args) == 0) {
    return "k: expected an even K, lda and weight stride with 4-byte aligned operands, got k=" +
           std::to_string(args.k) + " lda=" + std::to_string(args.lda);
  }
  // Only an explicit wgmma tile asks the device: automatic resolves to a tile the device runs.
  if (wgmma_tile(args.tile))
    return grouped_tile_unsupported(args.tile, current_compute_capability());
  return std::nullopt;
}

namespace {

// Average rows per group over the groups that can hold rows (the grid's own bound).
std::int64_t rows_per_group(const GroupedGemmArgs& args) {
  const std::int64_t groups =
      std::max<std::int64_t>(1, std::min<std::int64_t>(args.max_groups, args.groups));
  return (args.max_rows + groups - 1) / groups;
}

}  // namespace

GroupedTile grouped_gemm_tile(const GroupedGemmArgs& args, int compute_capability) {
  if (args.tile != GroupedTile::automatic) return args.tile;
  const std::int64_t rows = rows_per_group(args);
  if (rows <= 16) return GroupedTile::m16;
  if (rows >= kGroupedWgmmaMinRows &&
      !grouped_tile_unsupported(GroupedTile::wgmma_m256, compute_capability)) {
    // MXFP4 weights: wgmma_m256's packed kernel (wgmma_ws loads B as bf16 rows by TMA).
    if (grouped_weights_packed(args)) return GroupedTile::wgmma_m256;
    // Rows read in place (no a_rows: the experts' down call) or staged there first (a_staging):
    // the warp-specialized tile, whose producer loads them by TMA too. Gathered rows without
    // staging: the producer warpgroup's cp.async of 256 rows falls behind at ~146 rows per
    // expert, so wgmma_m256 (kGroupedWgmmaMinRows).
    return args.a_rows == nullptr || args.a_staging != nullptr ? GroupedTile::wgmma_ws
                                                               : GroupedTile::wgmma_m256;
  }
  if (rows <= 96) return GroupedTile::m64;
  return GroupedTile::m128;
}

GroupedTile grouped_gemm_tile(const GroupedGemmArgs& args) {
  // Only an average that could pick wgmma asks the device.
  const bool may_pick_wgmma =
      args.tile == GroupedTile::automatic && rows_per_group(args) >= kGroupedWgmmaMinRows;
  return grouped_gemm_tile(args, may_pick_wgmma ? current_compute_capability() : 0);
}

cudaError_t prepare_grouped_gemm(DType dtype) {
  switch (dtype) {
    case DType::bf16: return prepare_typed<__nv_bfloat16>();
    case DType::f16: return prepare_typed<__half>();
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_grouped_gemm(const GroupedGemmArgs& given, cudaStream_t stream) {
  if (grouped_gemm_unsupported(given)) return cudaErrorInvalidValue;
  if (given.max_rows == 0 || given.max_groups == 0 || given.n == 0) return cudaSuccess;
  GroupedGemmArgs args = given;
  if (args.a_rows != nullptr && args.a_staging != nullptr &&
      grouped_gemm_tile(args) == GroupedTile::wgmma_ws && tensor_map_fits(args)) {
    // Gathered rows staged for the warp-specialized tile (a_staging); rows past first[groups]
    // are neither copied nor read.
    if (const cudaError_t status =
            launch_gather_rows(args.a, args.lda, args.a_rows, args.a_staging, args.max_rows, args.k,
                               args.dtype, stream, args.first + args.groups);
        status != cudaSuccess) {
      return status;
    }
    args.a = args.a_staging;
    args.a_rows = nullptr;
    args.lda = args.k;
    args.tile = GroupedTile::wgmma_ws;
  }
  GroupedGemmParams params{};
  params.a = args.a;
  params.a_rows = args.a_rows;
  params.lda = args.lda;
  params.b = args.b;
  params.b2 = args.b2;
  params.b_group_stride = args.b_group_stride;
  params.b_blocks = args.b_blocks;
  params.b_scales = args.b_scales;
  params.b2_blocks = args.b2_blocks;
  params.b2_scales = args.b2_scales;
  params.blocks_group_stride = args.blocks_group_stride;
  params.scales_group_stride = args.scales_group_stride;
  params.c = args.c;
  params.ldc = args.ldc;
  params.n = args.n;
  params.k = args.k;
  params.first = args.first;
  params.groups = args.groups;
  params.out_mode = args.out == GroupedOut::f32       ? kGroupedOutF32
                    : args.out == GroupedOut::rounded ? kGroupedOutRounded
                                                      : kGroupedOutActivation;
  params.copy_bytes = copy_bytes_of(args);
  if (args.activation) params.act = activation_params_of(*args.activation);
  return args.dtype == DType::bf16 ? launch_typed<__nv_bfloat16>(args, params, stream)
                                   : launch_typed<__half>(args, params, stream);
}

}  // namespace lmoe::cuda

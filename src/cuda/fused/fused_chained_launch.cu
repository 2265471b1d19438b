#include "cuda/fused/fused_chained_launch.hpp"

#include <algorithm>

#include "cuda/fused/fused_chained.cuh"
#include "cuda/fused/fused_chained_exchange.cuh"
#include "cuda/runtime/launch_config.hpp"
#include "cuda/runtime/tensor_map.hpp"
#include "cuda/tail/launchers.hpp"

namespace lmoe::cuda {

namespace {

// The wgmma N serving calls of up to `tokens` rows.
int token_class(std::int64_t tokens) {
  return tokens <= 16 ? 16 : tokens <= 32 ? 32 : tokens <= 64 ? 64 : 128;
}

template <typename T, int kTileRows>
const void* up_kernel_of(int token_class) {
  switch (token_class) {
    case 16: return reinterpret_cast<const void*>(fused_chained_up_kernel<T, 16, kTileRows>);
    case 32: return reinterpret_cast<const void*>(fused_chained_up_kernel<T, 32, kTileRows>);
    case 64: return reinterpret_cast<const void*>(fused_chained_up_kernel<T, 64, kTileRows>);
    default: return reinterpret_cast<const void*>(fused_chained_up_kernel<T, 128, kTileRows>);
  }
}

const void* up_kernel(int token_class, int tile_rows, DType dtype) {
  if (dtype == DType::bf16) {
    return tile_rows == 64 ? up_kernel_of<__nv_bfloat16, 64>(token_class)
                           : up_kernel_of<__nv_bfloat16, 128>(token_class);
  }
  return tile_rows == 64 ? up_kernel_of<__half, 64>(token_class)
                         : up_kernel_of<__half, 128>(token_class);
}

template <int kTileRows>
int shared_bytes_of(int token_class) {
  switch (token_class) {
    case 16: return ChainedShape<16, kTileRows>::kSharedBytes;
    case 32: return ChainedShape<32, kTileRows>::kSharedBytes;
    case 64: return ChainedShape<64, kTileRows>::kSharedBytes;
    default: return ChainedShape<128, kTileRows>::kSharedBytes;
  }
}

int shared_bytes(int token_class, int tile_rows) {
  return tile_rows == 64 ? shared_bytes_of<64>(token_class) : shared_bytes_of<128>(token_class);
}

// The up-projection's launch: tiles × splits blocks of kChainedThreads, clusters of `splits` (what
// the plan asks the device about, and what launch_up launches).
LaunchConfig up_config(int tiles, int splits, int shared_bytes, cudaStream_t stream) {
  LaunchConfig config(dim3(static_cast<unsigned>(tiles * splits)), dim3(kChainedThreads),
                      static_cast<std::size_t>(shared_bytes), stream);
  config.cluster(static_cast<unsigned>(splits));
  return config;
}

// The plan for tiles of `tile_rows` rows: splits of K fill the SMs the tiles leave idle (K3 at
// tp 1 in tiles of 128: 56 tiles, 2 splits on 132 SMs; 896 rows in tiles of 64: 14 tiles, 8
// splits), in powers of two (a block finishes tile / splits rows of its tile) and at most one split
// per chunk of K; fewer where the device cannot hold every tile's cluster at once. Raises the
// kernels' shared-memory limit for every token class up to max_tokens' on this device.
const char* plan_tiles(int tile_rows, std::int64_t rows, int chunks, int sms, int limit,
                       std::int64_t max_tokens, DType dtype, FusedChainedPlan* plan) {
  FusedChainedPlan result;
  result.tile_rows = tile_rows;
  result.tiles = static_cast<int>((rows + tile_rows - 1) / tile_rows);
  const int most = std::min({kChainedMaxSplits, std::max(1, sms / result.tiles), chunks});
  result.splits = 1;
  while (result.splits * 2 <= most) result.splits *= 2;
  for (int shape : {16, 32, 64, 128}) {
    if (shape > token_class(max_tokens)) break;
    const void* kernel = up_kernel(shape, tile_rows, dtype);
    cudaFuncAttributes attributes{};
    if (cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess)
      return "the chained path could not query the device";
    const int bytes = shared_bytes(shape, tile_rows);
    if (bytes > limit - static_cast<int>(attributes.sharedSizeBytes))
      return "the chained path's stages do not fit in a block's shared memory";
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) !=
        cudaSuccess) {
      return "the chained path's shared memory could not be raised on this device";
    }
    // Fewer splits where the device cannot hold every tile's cluster at once (a cluster's blocks
    // share one GPC, one block of ~150–200 KB per SM).
    while (result.splits > 1) {
      LaunchConfig config = up_config(result.tiles, result.splits, bytes, nullptr);
      int clusters = 0;
      if (cudaOccupancyMaxActiveClusters(&clusters, kernel, config.get()) == cudaSuccess &&
          clusters >= result.tiles) {
        break;
      }
      (void)cudaGetLastError();  // a cluster size the device refuses: fewer splits
      result.splits /= 2;
    }
  }
  *plan = result;
  return nullptr;
}

}  // namespace

const char* fused_chained_plan(std::int64_t rows, std::int64_t l, std::int64_t max_tokens,
                               DType dtype, int tile_rows, FusedChainedPlan* plan) {
  if (dtype != DType::bf16 && dtype != DType::f16) return "the chained path runs bf16 and f16";
  if (max_tokens < 1 || max_tokens > kFusedChainedMaxTokens)
    return "the chained path takes 1 … 128 tokens";
  // l ≤ 16384: launch_rms_norm's register kernels, the ones that read T on the device.
  if (rows % 8 != 0 || rows < 8 || l % 8 != 0 || l < 8 || l > 16384)
    return "the chained path needs d % 8 == 0, l % 8 == 0 and l ≤ 16384";
  if (rows > 0x7fffffff) return "the chained path's copies address at most 2^31 rows";
  if (!tensor_maps_available()) return "the chained path needs a driver that encodes tensor maps";
  int device = 0, sms = 0, major = 0, minor = 0, limit = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess) {
    return "the chained path could not query the device";
  }
  if (major != 9 || minor != 0) return "the chained path runs on compute 9.0 only (wgmma)";
  const int chunks = static_cast<int>((l + kChainedTileK - 1) / kChainedTileK);
  if (tile_rows != 0) {
    if (tile_rows != 64 && tile_rows != 128) return "the chained path's tiles are 64 or 128 rows";
    return plan_tiles(tile_rows, rows, chunks, sms, limit, max_tokens, dtype, plan);
  }
  // The tile that puts more SMs to work (blocks = tiles × splits, at most one wave); at equal
  // blocks the one with fewer splits (less of the cluster's reduce-scatter), then 128.
  FusedChainedPlan wide, narrow;
  if (const char* reason = plan_tiles(128, rows, chunks, sms, limit, max_tokens, dtype, &wide))
    return reason;
  const int wide_blocks = wide.tiles * wide.splits;
  if (plan_tiles(64, rows, chunks, sms, limit, max_tokens, dtype, &narrow) == nullptr) {
    const int narrow_blocks = narrow.tiles * narrow.splits;
    if (narrow_blocks <= sms && (narrow_blocks > wide_blocks ||
                                 (narrow_blocks == wide_blocks && narrow.splits < wide.splits))) {
      *plan = narrow;
      return nullptr;
    }
  }
  *plan = wide;
  return nullptr;
}

cudaError_t fused_chained_maps(FusedChainedParams* params, DType dtype, const void* w_up,
                               const void* normed, std::int64_t capacity, int tile_rows) {
  if (const cudaError_t status = encode_rows_map(params->w_map, dtype, w_up, params->rows,
                                                 params->l, params->l, kChainedTileK, tile_rows);
      status != cudaSuccess) {
    return status;
  }
  for (int c = 0; c < kChainedTokenClasses; ++c) {
    if (const cudaError_t status = encode_rows_map(params->n_maps[c], dtype, normed, capacity,
                                                   params->l, params->l, kChainedTileK, 16 << c);
        status != cudaSuccess) {
      return status;
    }
  }
  return cudaSuccess;
}

namespace {

// The up-projection, allowed to start before the kernel ahead of it ends (it waits for N itself); a
// tile's splits form a cluster.
cudaError_t launch_up(const FusedChainedParams& p, std::int64_t max_tokens, DType dtype,
                      const FusedChainedPlan& plan, cudaStream_t stream) {
  const int shape = token_class(max_tokens);
  LaunchConfig config =
      up_config(plan.tiles, plan.splits, shared_bytes(shape, plan.tile_rows), stream);
  config.programmatic();
  FusedChainedParams params = p;
  params.tiles = plan.tiles;
  params.splits = plan.splits;
  void* up_args[] = {&params};
  return cudaLaunchKernelExC(config.get(), up_kernel(shape, plan.tile_rows, dtype), up_args);
}

bool launchable(std::int64_t max_tokens, DType dtype, const FusedChainedPlan& plan) {
  return max_tokens >= 1 && max_tokens <= kFusedChainedMaxTokens && plan.tiles >= 1 &&
         (plan.tile_rows == 64 || plan.tile_rows == 128) &&
         (dtype == DType::bf16 || dtype == DType::f16);
}

}  // namespace

cudaError_t launch_fused_chained(const FusedChainedParams& p, const void* routed,
                                 const float* gamma, float eps, void* normed,
                                 std::int64_t max_tokens, DType dtype, const FusedChainedPlan& plan,
                                 cudaStream_t stream) {
  if (!launchable(max_tokens, dtype, plan)) return cudaErrorInvalidValue;
  // 1. N (the bound's rows when T is on the device: the kernel reads T and skips the others),
  // launched programmatically: it may start before the stream's previous kernel ends (it waits for
  // it before reading anything) and lets the up-projection start at once, whose weights depend on
  // nothing. Behind a kernel that lets its dependents start early (e.g. the previous call's
  // up-projection) the weight stream then begins as soon as that kernel's blocks leave.
  if (const cudaError_t status =
          launch_rms_norm(routed, gamma, normed, p.tokens_device ? max_tokens : p.tokens, p.l, eps,
                          dtype, stream, p.tokens_device, /*programmatic=*/true);
      status != cudaSuccess) {
    return status;
  }
  // 2. The up-projection.
  return launch_up(p, max_tokens, dtype, plan, stream);
}

cudaError_t launch_fused_chained_ranks(const FusedTailParams& x, int exchange_grid,
                                       const FusedChainedParams& p, std::int64_t max_tokens,
                                       DType dtype, const FusedChainedPlan& plan,
                                       cudaStream_t stream) {
  if (!launchable(max_tokens, dtype, plan) || x.tp < 2 || exchange_grid < 1 ||
      max_tokens > x.cx_rows) {
    return cudaErrorInvalidValue;
  }
  const bool bf16 = dtype == DType::bf16;
  // 1. The exchange: N and the stripe's shared sum in this rank's workspace.
  FusedTailParams args = x;
  void* exchange_args[] = {&args};
  if (const cudaError_t status = cudaLaunchKernel(
          bf16 ? reinterpret_cast<const void*>(fused_chained_exchange_kernel<__nv_bfloat16>)
               : reinterpret_cast<const void*>(fused_chained_exchange_kernel<__half>),
          dim3(static_cast<unsigned>(exchange_grid)), dim3(kNormThreads), exchange_args,
          static_cast<std::size_t>(x.l) * 2, stream);  // a row of N being normalized
      status != cudaSuccess) {
    return status;
  }
  // 2. The up-projection of this rank's stripe, its vectors also sent to the peers.
  if (const cudaError_t status = launch_up(p, max_tokens, dtype, plan, stream);
      status != cudaSuccess) {
    return status;
  }
  // 3. The gather of the peers' stripes, allowed to start (and poll) while the up-projection runs.
  LaunchConfig config(dim3(static_cast<unsigned>(exchange_grid)), dim3(kNormThreads), 0, stream);
  void* gather_args[] = {&args};
  return cudaLaunchKernelExC(
      config.programmatic().get(),
      bf16 ? reinterpret_cast<const void*>(fused_chained_gather_kernel<__nv_bfloat16>)
           : reinterpret_cast<const void*>(fused_chained_gather_kernel<__half>),
      gather_args);
}

}  // namespace lmoe::cuda

#include "cuda/gemm/epilogue_gemm.hpp"

#include <array>
#include <atomic>
#include <climits>
#include <string>

#include "cuda/gemm/epilogue_gemm_launch.hpp"
#include "cuda/runtime/alignment.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/cuda_device_info.hpp"
#include "lmoe/error.hpp"

namespace lmoe::cuda {

namespace {

// The SM count of the current device, asked once per device (the persistent schedule launches one
// CTA per SM; asking at every launch would cost a driver call). Ranks on threads may ask at once.
int sm_count() {
  static std::array<std::atomic<int>, 64> counts{};
  int device = 0;
  LMOE_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 0 || device >= static_cast<int>(counts.size())) return 0;  // CUTLASS asks itself
  int count = counts[device].load(std::memory_order_relaxed);
  if (count == 0) {
    LMOE_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    counts[device].store(count, std::memory_order_relaxed);
  }
  return count;
}

// CTAs the shape needs with `tile`, in waves over the SMs, times the tile's area over its measured
// relative rate: the smallest wins.
double tile_cost(EpilogueTile tile, std::int64_t m, std::int64_t n, int sms) {
  std::int64_t bm = 128, bn = 128;
  double rate = 0.9;
  switch (tile) {
    case EpilogueTile::m64_n128: bm = 64, rate = 0.8; break;
    case EpilogueTile::m128_n256: bn = 256, rate = 1.0; break;
    default: break;
  }
  const std::int64_t tiles = ((m + bm - 1) / bm) * ((n + bn - 1) / bn);
  const std::int64_t waves = (tiles + sms - 1) / sms;
  return static_cast<double>(waves * bm * bn) / rate;
}

using Launch = std::optional<std::string> (*)(const EpilogueGemmArgs&, int, cudaStream_t);

#ifdef LMOE_EPILOGUE_GEMM_SM90
template <DType dtype, EpilogueAdd add>
Launch launch_for_tile(EpilogueTile tile) {
  switch (tile) {
    case EpilogueTile::m64_n128: return &launch_epilogue_gemm<dtype, add, EpilogueTile::m64_n128>;
    case EpilogueTile::m128_n128: return &launch_epilogue_gemm<dtype, add, EpilogueTile::m128_n128>;
    case EpilogueTile::m128_n256: return &launch_epilogue_gemm<dtype, add, EpilogueTile::m128_n256>;
    case EpilogueTile::automatic: break;
  }
  throw Error("epilogue GEMM: no kernel for an unresolved tile");
}

template <DType dtype>
Launch launch_for(EpilogueAdd add, EpilogueTile tile) {
  return add == EpilogueAdd::round_once
             ? launch_for_tile<dtype, EpilogueAdd::round_once>(tile)
             : launch_for_tile<dtype, EpilogueAdd::round_product_first>(tile);
}
#endif

}  // namespace

std::string_view epilogue_tile_name(EpilogueTile tile) {
  switch (tile) {
    case EpilogueTile::automatic: return "automatic";
    case EpilogueTile::m64_n128: return "m64_n128";
    case EpilogueTile::m128_n128: return "m128_n128";
    case EpilogueTile::m128_n256: return "m128_n256";
  }
  return "?";
}

EpilogueTile parse_epilogue_tile(std::string_view name) {
  std::string choices = "automatic";
  if (name == choices) return EpilogueTile::automatic;
  for (EpilogueTile tile : kEpilogueTiles) {
    if (epilogue_tile_name(tile) == name) return tile;
    choices += ", " + std::string(epilogue_tile_name(tile));
  }
  throw Error("unknown epilogue GEMM tile '" + std::string(name) + "' (" + choices + ")");
}

std::optional<std::string> epilogue_gemm_limit(const EpilogueGemmArgs& args) {
#ifndef LMOE_EPILOGUE_GEMM_SM90
  (void)args;
  return std::string(
      "the epilogue GEMM was not built (it needs sm_90a in CMAKE_CUDA_ARCHITECTURES)");
#else
  if (args.dtype == DType::f32) return std::string("f32 storage has no tensor-core epilogue GEMM");
  if (const int capability = current_compute_capability(); capability != 90) {
    return "the epilogue GEMM runs on compute capability 9.0 (Hopper); this GPU is " +
           std::to_string(capability / 10) + "." + std::to_string(capability % 10);
  }
  if (args.m < 0 || args.n <= 0 || args.k <= 0 || args.m > INT_MAX || args.n > INT_MAX ||
      args.k > INT_MAX) {
    return "epilogue GEMM: m, n, k = " + std::to_string(args.m) + ", " + std::to_string(args.n) +
           ", " + std::to_string(args.k) + " outside [0 or 1, 2^31)";
  }
  // TMA moves 16-byte-aligned rows: every row start and the contiguous extents N and K.
  constexpr std::int64_t kElements = 8;  // 16 bytes of bf16 or f16
  if (args.k % kElements != 0 || args.n % kElements != 0 || args.ldw % kElements != 0 ||
      args.ldc % kElements != 0 || args.ldd % kElements != 0) {
    return "epilogue GEMM: n, k and the row strides must be multiples of 8 elements (16 bytes); "
           "n = " +
           std::to_string(args.n) + ", k = " + std::to_string(args.k) +
           ", ldw = " + std::to_string(args.ldw) + ", ldc = " + std::to_string(args.ldc) +
           ", ldd = " + std::to_string(args.ldd);
  }
  if (args.ldw < args.k || args.ldc < args.n || args.ldd < args.n)
    return std::string("epilogue GEMM: a row stride is shorter than its row");
  if (!aligned16(args.a) || !aligned16(args.w) || !aligned16(args.c) || !aligned16(args.d))
    return std::string("epilogue GEMM: A, W, C and D must start 16-byte aligned");
  return std::nullopt;
#endif
}

EpilogueTile epilogue_tile_for(std::int64_t m, std::int64_t n) {
  return epilogue_tile_for(m, n, sm_count() > 0 ? sm_count() : 132);
}

EpilogueTile epilogue_tile_for(std::int64_t m, std::int64_t n, int sms) {
  EpilogueTile best = EpilogueTile::m64_n128;
  for (EpilogueTile tile : kEpilogueTiles) {
    if (tile_cost(tile, m, n, sms) < tile_cost(best, m, n, sms)) best = tile;
  }
  return best;
}

void run_epilogue_gemm(const EpilogueGemmArgs& args, cudaStream_t stream) {
  if (auto limit = epilogue_gemm_limit(args)) throw Error(*limit);
  if (args.m == 0) return;
#ifdef LMOE_EPILOGUE_GEMM_SM90
  const EpilogueTile tile =
      args.tile == EpilogueTile::automatic ? epilogue_tile_for(args.m, args.n) : args.tile;
  const Launch launch = args.dtype == DType::bf16 ? launch_for<DType::bf16>(args.add, tile)
                                                  : launch_for<DType::f16>(args.add, tile);
  if (auto refused = launch(args, sm_count(), stream)) {
    throw Error("epilogue GEMM (" + std::string(epilogue_tile_name(tile)) +
                ", m = " + std::to_string(args.m) + ", n = " + std::to_string(args.n) +
                ", k = " + std::to_string(args.k) + "): " + *refused);
  }
  LMOE_CUDA_CHECK(cudaGetLastError());
#endif
}

}  // namespace lmoe::cuda

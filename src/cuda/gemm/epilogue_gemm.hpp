// The up-projection GEMM with the tier's add in its epilogue (CUTLASS 3, Hopper TMA
// warp-specialized): D[M, N] = add(A[M, K] · W[N, K]ᵀ, C[M, N]), in one pass over C and D. A and W
// are K-contiguous in the storage dtype, accumulation is fp32, C and D are row-major with their own
// row strides (a column stripe of a wider matrix), and D may be C itself (in place).
//
// The add is the numerics contract's (../DESIGN.md §3, docs/numerics.md):
//   round_once           D = round(acc + C)          (column: the stripe accumulated into shared)
//   round_product_first  D = round(round(acc) + C)   (fused, overlap, token: U rounded, then added)
// with the sum in fp32 and round-to-nearest-even into bf16 or f16.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "lmoe/dtype.hpp"

namespace lmoe::cuda {

enum class EpilogueAdd : std::uint8_t { round_once, round_product_first };

// The CTA tile (and schedule) of a launch; automatic picks by the shape (epilogue_gemm.cpp).
enum class EpilogueTile : std::uint8_t {
  automatic,
  m64_n128,   // ping-pong warpgroups: decode and small T
  m128_n128,  // cooperative
  m128_n256,  // cooperative, a cluster of 2 along M: large T
};
inline constexpr EpilogueTile kEpilogueTiles[] = {EpilogueTile::m64_n128, EpilogueTile::m128_n128,
                                                  EpilogueTile::m128_n256};
std::string_view epilogue_tile_name(EpilogueTile tile);
EpilogueTile parse_epilogue_tile(std::string_view name);  // throws lmoe::Error naming the choices

struct EpilogueGemmArgs {
  const void* a = nullptr;  // [m, k], row stride k
  const void* w = nullptr;  // [n, k], row stride ldw
  std::int64_t ldw = 0;
  const void* c = nullptr;  // [m, n], row stride ldc
  std::int64_t ldc = 0;
  void* d = nullptr;  // [m, n], row stride ldd; may equal c
  std::int64_t ldd = 0;
  std::int64_t m = 0, n = 0, k = 0;
  DType dtype = DType::bf16;
  EpilogueAdd add = EpilogueAdd::round_product_first;
  EpilogueTile tile = EpilogueTile::automatic;
};

// Why these arguments cannot run on the current device (not a Hopper GPU, not built for sm_90a, f32
// storage, strides or addresses that TMA cannot take, sizes beyond int), or nullopt. The callers
// fall back to cuBLASLt and an add kernel where this declines.
std::optional<std::string> epilogue_gemm_limit(const EpilogueGemmArgs& args);

// The tile `automatic` resolves to for this shape on the current device, or on one of `sms` SMs
// (a pure function, for tests): the fewest waves of tile area, weighted by each tile's rate.
EpilogueTile epilogue_tile_for(std::int64_t m, std::int64_t n);
EpilogueTile epilogue_tile_for(std::int64_t m, std::int64_t n, int sms);

// Enqueues the GEMM on `stream` (no allocation, no synchronization; capturable). Throws
// lmoe::Error where epilogue_gemm_limit declines. m = 0 enqueues nothing.
void run_epilogue_gemm(const EpilogueGemmArgs& args, cudaStream_t stream);

}  // namespace lmoe::cuda

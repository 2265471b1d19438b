// The benchmark's inputs: a counter-based generator that the host and the device evaluate alike,
// so that a GPU rank fills its buffers on the device and the host regenerates exactly the same
// values for the contract check. Each value is k/64 with k ∈ [−128, 127]: at most 8 significant
// bits and magnitude <= 2, so it is exact in bf16, f16 and f32 and every dtype stores the same
// number. Included by .cu files, hence no standard-library calls.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define LMOE_BENCH_HOST_DEVICE __host__ __device__
#else
#define LMOE_BENCH_HOST_DEVICE
#endif

namespace lmoe::bench {

// SplitMix64's finalizer: a bijection of 64-bit words whose outputs look independent.
LMOE_BENCH_HOST_DEVICE inline std::uint64_t mix64(std::uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

// Element `index` of the stream `seed`.
LMOE_BENCH_HOST_DEVICE inline float value(std::uint64_t seed, std::uint64_t index) {
  const std::uint64_t bits = mix64(seed + (index + 1) * 0x9e3779b97f4a7c15ull);
  const int k = static_cast<int>(bits >> 56) - 128;
  return static_cast<float>(k) * 0.015625f;
}

// Element `index` of the collectives' check stream `seed`: an integer in [−8, 7]. A sum over up to
// 16 ranks, and every partial sum of it in any order, is then an integer of magnitude at most 128,
// which bf16, f16 and f32 all hold exactly: any correct reduction gives the same bits whatever its
// order and intermediate roundings (NCCL's too), so a collective's output is checked exactly, as
// nccl-tests does. One multiply a value (a Weyl sequence's top bits): the host checks every element
// of buffers of hundreds of megabytes.
LMOE_BENCH_HOST_DEVICE inline float collective_value(std::uint64_t seed, std::uint64_t index) {
  const std::uint64_t bits = (seed + index) * 0x9e3779b97f4a7c15ull;
  return static_cast<float>(static_cast<int>(bits >> 60) - 8);
}

// The stream of one rank's tensor (0: routed, 1: shared) for one (T, tier): a fresh stream per
// job, so an output left over from another job cannot match.
inline std::uint64_t input_seed(std::uint64_t seed, std::int64_t num_tokens, int tier, int rank,
                                int tensor) {
  std::uint64_t h = mix64(seed ^ 0x6c6d6f6562656e63ull);
  h = mix64(h ^ static_cast<std::uint64_t>(num_tokens));
  h = mix64(h ^ static_cast<std::uint64_t>(tier + 1));
  h = mix64(h ^ (static_cast<std::uint64_t>(rank + 1) << 8));
  return mix64(h ^ (static_cast<std::uint64_t>(tensor + 1) << 16));
}

}  // namespace lmoe::bench

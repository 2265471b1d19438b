// The benchmark's inputs: a counter-based generator that the host and the device evaluate alike,
// so that a GPU rank fills its buffers on the device and the host regenerates exactly the same
// values for the contract check. Each value is k/64 with k ∈ [−128, 127]: at most 8 significant
// bits and magnitude <= 2, so it is exact in bf16, f16 and f32 and every dtype stores the same
// number. Also the collectives' check values, and the crafted exact tail inputs that soaks of
// graph replays derive on the device from a replay counter. Included by .cu files, hence no
// standard-library calls.
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

// The stream of rank `rank`'s input for the check of one run from `seed`: element i of its send
// buffer is collective_value(collective_input_seed(seed, rank), i).
LMOE_BENCH_HOST_DEVICE inline std::uint64_t collective_input_seed(std::uint64_t seed, int rank) {
  return mix64(mix64(seed ^ 0x636f6c6c65637476ull) ^ static_cast<std::uint64_t>(rank + 1));
}

// Crafted exact tail inputs (as lmoe::make_exact_case builds them: the reduced latent ±2 in every
// element, rank partials and `shared` small integers), one element at a time from `seed`, so
// that a soak derives a fresh case on the device for every replay and the host rebuilds it for
// the contract check. Element `index` of the latent [T, l] (row-major) is 2 · its sign.
LMOE_BENCH_HOST_DEVICE inline int exact_latent_sign(std::uint64_t seed, std::int64_t index) {
  return (mix64(seed ^ 0x6c6174656e747369ull ^ static_cast<std::uint64_t>(index)) >> 63) ? 1 : -1;
}

// An integer in [−3, 3] of the stream (seed, what, rank) at `index`.
LMOE_BENCH_HOST_DEVICE inline int exact_small_integer(std::uint64_t seed, std::uint64_t what,
                                                      int rank, std::int64_t index) {
  const std::uint64_t stream = mix64(seed ^ what ^ (static_cast<std::uint64_t>(rank + 1) << 48));
  return static_cast<int>((mix64(stream + static_cast<std::uint64_t>(index)) >> 32) % 7) - 3;
}

// Rank `rank`'s partial of latent element `index`: small integers on ranks 0 … tp − 2, the last
// rank the rest, so that the rank sum is 2 · exact_latent_sign (every partial sum is an integer of
// magnitude <= 2 + 3 tp: exact in every dtype and order).
LMOE_BENCH_HOST_DEVICE inline int exact_latent_part(std::uint64_t seed, int tp, int rank,
                                                    std::int64_t index) {
  constexpr std::uint64_t kLatent = 0x726f757465647061ull;
  if (rank + 1 < tp) return exact_small_integer(seed, kLatent, rank, index);
  int rest = 2 * exact_latent_sign(seed, index);
  for (int r = 0; r + 1 < tp; ++r) rest -= exact_small_integer(seed, kLatent, r, index);
  return rest;
}

// Rank `rank`'s partial of element `index` of `shared` [T, d].
LMOE_BENCH_HOST_DEVICE inline int exact_shared_part(std::uint64_t seed, int rank,
                                                    std::int64_t index) {
  return exact_small_integer(seed, 0x7368617265647061ull, rank, index);
}

// The soak's seed of replay `replay` of a run from `seed`: a fresh stream every replay.
LMOE_BENCH_HOST_DEVICE inline std::uint64_t replay_seed(std::uint64_t seed, std::uint64_t replay) {
  return mix64(seed ^ mix64(replay + 0x7265706c6179ull));
}

// The T of replay `replay` of a soak from `seed` whose calls take up to `most` rows: in [1, most].
LMOE_BENCH_HOST_DEVICE inline int replay_tokens(std::uint64_t seed, std::uint64_t replay,
                                                int most) {
  return 1 + static_cast<int>((replay_seed(seed, replay) >> 33) % static_cast<std::uint64_t>(most));
}

// The stream of one rank's tensor (0: routed, 1: shared) at T: the same for every tier of a T,
// which share one load and are timed in turns (tail_bench.cpp); each check poisons the output
// first, so no tier's leftover output can pass for another's.
inline std::uint64_t input_seed(std::uint64_t seed, std::int64_t num_tokens, int rank, int tensor) {
  std::uint64_t h = mix64(seed ^ 0x6c6d6f6562656e63ull);
  h = mix64(h ^ static_cast<std::uint64_t>(num_tokens));
  h = mix64(h ^ (static_cast<std::uint64_t>(rank + 1) << 8));
  return mix64(h ^ (static_cast<std::uint64_t>(tensor + 1) << 16));
}

}  // namespace lmoe::bench

// Soaks of captured CUDA graphs whose inputs change on every replay with no host work: a replay
// counter in device memory that the graph advances itself, inputs the device derives from it
// (src/tools/bench_values.hpp), and device-side counts of the output elements that differ from
// what the host computes for the same replay. The host regenerates any replay's inputs from the
// counter's value for its own check. Host code only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "lmoe/dims.hpp"
#include "lmoe/dtype.hpp"

namespace lmoe::cuda {

// *replay += 1 (one thread): the last node of a soak's graph, after every node that read it.
cudaError_t launch_advance_replay(std::uint64_t* replay, cudaStream_t stream);

// Rank `rank`'s input of the collectives' check for replay *replay of a run from `seed`:
// dst[i] = bench::collective_value(bench::collective_input_seed(bench::replay_seed(seed, *replay),
// rank), i), for i < count (bench::count_wrong_elements checks it with that replay's seed).
cudaError_t launch_fill_replay_collective_values(void* dst, std::int64_t count, DType dtype,
                                                 std::uint64_t seed, int rank,
                                                 const std::uint64_t* replay, cudaStream_t stream);

// *wrong += the elements of an all_reduce's output `out` (count, dtype) over `ranks` ranks, each
// filled by launch_fill_replay_collective_values for the same replay, that differ bit for bit
// from the exact sum (small integers: exact in every dtype and order).
cudaError_t launch_count_wrong_replay_sums(const void* out, std::int64_t count, DType dtype,
                                           std::uint64_t seed, int ranks,
                                           const std::uint64_t* replay, unsigned long long* wrong,
                                           cudaStream_t stream);

// *tokens = bench::replay_tokens(seed, *replay, most): a call's T, in [1, most], for every rank
// alike (the same seed on every rank).
cudaError_t launch_pick_replay_tokens(std::int32_t* tokens, std::int32_t most, std::uint64_t seed,
                                      const std::uint64_t* replay, cudaStream_t stream);

// Rank `rank`'s crafted exact tail inputs of replay *replay of a run from `seed`, for all `rows`
// rows: routed [rows, l] = bench::exact_latent_part, shared [rows, d] = bench::exact_shared_part
// (seed bench::replay_seed(seed, *replay)).
cudaError_t launch_fill_replay_exact_tail(void* routed, void* shared, std::int64_t rows,
                                          TailDims dims, DType dtype, std::uint64_t seed, int rank,
                                          int tp, const std::uint64_t* replay, cudaStream_t stream);

// *wrong += the elements of out [rows, d] that differ bit for bit from the `fused` contract's
// result for those inputs, with T = *tokens: rows below T must hold
// round(round(N · w_upᵀ) + round(Σ_r shared_r)), where N = ±gamma (the latent is ±2 and eps 0,
// so the norm's rstd is 0.5 exactly) and every sum is exact; rows from T on must still hold the
// poison (every byte 0xff). w_up [d, l] in dtype and gamma [l] in fp32 (integers, as
// lmoe::make_exact_case makes them), on the device.
cudaError_t launch_count_wrong_replay_exact_tail(const void* out, const std::int32_t* tokens,
                                                 std::int64_t rows, TailDims dims, DType dtype,
                                                 const void* w_up, const float* gamma,
                                                 std::uint64_t seed, int tp,
                                                 const std::uint64_t* replay,
                                                 unsigned long long* wrong, cudaStream_t stream);

}  // namespace lmoe::cuda

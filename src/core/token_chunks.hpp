// How many chunks of rows the token tier pipelines a forward into (the CUDA executor: chunk c's
// norm, GEMM and add run while chunk c+1 is reduce-scattered). A pure rule, so that it is tested
// without a GPU. Host code.
#pragma once

#include <cstdint>

namespace lmoe {

inline constexpr int kMaxTokenChunks = 8;
// Without LMOE_TOKEN_CHUNKS: kDefaultTokenChunks from kDefaultTokenChunksFrom rows up, one below.
// Measured on two H200s (K3, tp 2, docs/perf.md "Token chunks"): two chunks are 7-17 % faster than
// one from T = 4096 to 32768 over NCCL, 5-11 % over p2p, 2 % slower at 2048; four are no faster
// than two there and slower below 16384 (each chunk's collectives and GEMM are smaller).
inline constexpr int kDefaultTokenChunks = 2;
inline constexpr std::int64_t kDefaultTokenChunksFrom = 4096;

// LMOE_TOKEN_CHUNKS read strictly: 1 … kMaxTokenChunks, or 0 when unset or empty (the built-in
// rule). Throws lmoe::Error naming the variable and the range for anything else.
int token_chunks_setting_from_environment();

// The chunks for `tokens` rows on `tp` ranks with `setting` (0: the built-in rule): one with a
// single rank (nothing to overlap), and never more than tokens / tp, so that every chunk gives every
// rank at least one row (at least one chunk).
std::int64_t token_chunk_count(std::int64_t tokens, int tp, int setting);

}  // namespace lmoe

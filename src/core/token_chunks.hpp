// How many chunks of rows the token tier pipelines a forward into (the CUDA executor: chunk c's
// norm, GEMM and add run while chunk c+1 is reduce-scattered). A pure rule, so that it is tested
// without a GPU. Host code.
#pragma once

#include <cstdint>

namespace lmoe {

inline constexpr int kMaxTokenChunks = 8;
// Without LMOE_TOKEN_CHUNKS: kDefaultTokenChunks from kDefaultTokenChunksFrom rows up, one below.
// Two chunks pay from T = 4096 and cost a little below; four are no faster than two (each chunk's
// collectives and GEMM are smaller): docs/perf.md, "Two H200s, tp 2, NCCL".
inline constexpr int kDefaultTokenChunks = 2;
inline constexpr std::int64_t kDefaultTokenChunksFrom = 4096;

// LMOE_TOKEN_CHUNKS read strictly: 1 … kMaxTokenChunks, or 0 when unset or empty (the built-in
// rule). Throws lmoe::Error naming the variable and the range for anything else.
int token_chunks_setting_from_environment();

// The chunks for `tokens` rows on `tp` ranks with `setting` (0: the built-in rule): one with a
// single rank (nothing to overlap), and never more than tokens / tp, so that every chunk gives
// every rank at least one row (at least one chunk).
std::int64_t token_chunk_count(std::int64_t tokens, int tp, int setting);

}  // namespace lmoe

// The fused tier's built-in breakpoints below eight ranks, from the kernels that can run (a pure
// function of their limits; LatentTail asks the backend for those), and the settings that turn its
// kernels off. docs/fused.md has the measurements behind each constant.
#pragma once

#include <optional>
#include <string>

#include "lmoe/backend.hpp"
#include "lmoe/tier_policy.hpp"

namespace lmoe {

// The built-in breakpoints for `backend` on `ranks` ranks. On cuda below kFusedDefaultMinRanks
// ranks, fused_max_tokens becomes the range where the fused kernels that can run measured faster
// than `overlap` (docs/fused.md, docs/perf.md): with one rank kFusedDefaultTp1ChainedTokens where
// the chained path runs, else kFusedDefaultTp1Tokens (the decode kernel alone); with two to seven,
// kFusedDefaultChainedTokens where the chained path runs, else kFusedDefaultDecodeTokens; 0 where
// only the general kernel could run (`decode_limit` says why). From kFusedDefaultMinRanks the
// reference system's 128 stays until eight GPUs measure it. Settings from a table, the
// environment or the caller are kept; explain() names the rule as the setting's origin.
inline constexpr int kFusedDefaultMinRanks = 8;
inline constexpr int kFusedDefaultTp1Tokens = 6;
inline constexpr int kFusedDefaultTp1ChainedTokens = 128;
inline constexpr int kFusedDefaultDecodeTokens = 16;
inline constexpr int kFusedDefaultChainedTokens = 64;
PolicyConfig with_rank_defaults(PolicyConfig policy, Backend backend, int ranks,
                                const std::optional<std::string>& decode_limit,
                                const std::optional<std::string>& chained_limit);

// Why the fused tier's decode kernel is turned off in this process (LMOE_FUSED_DECODE=0; read as a
// flag, anything but 1/0, true/false, yes/no, on/off is an error naming it); nullopt when it is on.
std::optional<std::string> fused_decode_turned_off();
// The same for the chained path (LMOE_FUSED_CHAINED=0: the decode and general kernels take its
// calls).
std::optional<std::string> fused_chained_turned_off();

}  // namespace lmoe

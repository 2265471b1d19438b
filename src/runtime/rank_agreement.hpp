// How ranks agree before they communicate: each rank describes its configuration or call in a
// fixed-size record, the records are all-gathered on the control path, and every rank raises the
// same error when one rank failed or two disagree (LatentTail, LatentMoELayer).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "lmoe/communicator.hpp"
#include "lmoe/tensor.hpp"
#include "lmoe/tier_policy.hpp"

namespace lmoe {

inline constexpr std::uint64_t kFnvOffsetBasis = 1469598103934665603ull;

std::uint64_t fnv1a(const void* data, std::size_t bytes, std::uint64_t hash = kFnvOffsetBasis);
// Hash of a matrix's elements (row by row, whatever its stride).
std::uint64_t checksum(ConstMatrixView view, std::uint64_t hash);

// What ranks exchange to agree before they communicate. The text holds a whole error message (a
// table refused for several fields runs to a few hundred characters), so that every rank reports
// it in full.
inline constexpr std::size_t kRankRecordText = 1024;
struct RankRecord {
  std::uint64_t config_hash = 0;
  std::int64_t num_tokens = 0;
  std::int32_t tier = -1;
  std::int32_t ok = 1;
  char text[kRankRecordText] = {};  // the error when !ok, else a description of the configuration
};

void set_text(RankRecord& record, const std::string& text);
std::vector<RankRecord> exchange(Communicator& comm, const RankRecord& mine);

// The same error on every rank: the first rank that failed, or the first disagreement (of
// config_hash: "ranks disagree on the <what>"; of T or tier: "ranks disagree on the call").
void throw_if_ranks_disagree(const std::vector<RankRecord>& all, const char* what);

// The tier policy's effective values as space-separated "name=value" words ("fused_max_tokens=128
// ... tier=auto ranges=none"), without where each came from: the same value from a table on one
// rank and from the environment on another is agreement.
std::string policy_values(const PolicyConfig& policy);

// Ranks whose policies differ would run different tiers for the same T (and capture different
// graph bodies), so construction exchanges policy_values and every rank throws, naming the
// settings that differ: "ranks' tier policies differ: rank 0 fused_max_tokens=128, rank 1
// fused_max_tokens=64". Returns when every rank's values are the same.
void agree_on_policy(Communicator& comm, const PolicyConfig& policy);

}  // namespace lmoe

#include "runtime/rank_agreement.hpp"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "lmoe/error.hpp"
#include "lmoe/tier.hpp"

namespace lmoe {

std::uint64_t fnv1a(const void* data, std::size_t bytes, std::uint64_t hash) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i) hash = (hash ^ p[i]) * 1099511628211ull;
  return hash;
}

std::uint64_t checksum(ConstMatrixView view, std::uint64_t hash) {
  const std::size_t row_bytes = static_cast<std::size_t>(view.cols) * view.element_size();
  for (std::int64_t row = 0; row < view.rows; ++row)
    hash = fnv1a(view.row_ptr(row), row_bytes, hash);
  return hash;
}

void set_text(RankRecord& record, const std::string& text) {
  std::memset(record.text, 0, sizeof(record.text));
  std::memcpy(record.text, text.data(), std::min(text.size(), sizeof(record.text) - 1));
}

std::vector<RankRecord> exchange(Communicator& comm, const RankRecord& mine) {
  std::vector<RankRecord> all(static_cast<std::size_t>(comm.size()));
  comm.control_all_gather(&mine, all.data(), sizeof(RankRecord));
  return all;
}

void throw_if_ranks_disagree(const std::vector<RankRecord>& all, const char* what) {
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (!all[r].ok) throw Error("rank " + std::to_string(r) + ": " + all[r].text);
  }
  for (std::size_t r = 1; r < all.size(); ++r) {
    if (all[r].config_hash != all[0].config_hash) {
      throw Error(std::string("ranks disagree on the ") + what + ": rank 0 has " + all[0].text +
                  "; rank " + std::to_string(r) + " has " + all[r].text);
    }
    if (all[r].num_tokens != all[0].num_tokens || all[r].tier != all[0].tier) {
      auto describe = [](const RankRecord& record) {
        return "T=" + std::to_string(record.num_tokens) + " tier=" +
               (record.tier < 0 ? std::string("none")
                                : std::string(tier_name(static_cast<TailTier>(record.tier))));
      };
      throw Error("ranks disagree on the call: rank 0 has " + describe(all[0]) + ", rank " +
                  std::to_string(r) + " has " + describe(all[r]));
    }
  }
}

namespace {

std::string tokens_text(const std::optional<std::int64_t>& tokens) {
  return tokens ? std::to_string(*tokens) : std::string("none");
}

std::vector<std::string> words(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> out;
  for (std::string word; in >> word;) out.push_back(word);
  return out;
}

}  // namespace

std::string policy_values(const PolicyConfig& policy) {
  std::string ranges;
  for (const TierRange& range : policy.ranges.value) {
    ranges += (ranges.empty() ? "" : ",") + std::string(tier_name(range.tier));
    if (range.max_tokens) ranges += "<=" + std::to_string(*range.max_tokens);
  }
  const std::optional<TailTier>& forced = policy.forced_tier.value;
  return "fused_max_tokens=" + std::to_string(policy.fused_max_tokens.value) +
         " overlap_max_tokens=" + std::to_string(policy.overlap_max_tokens.value) +
         " column_max_tokens=" + tokens_text(policy.column_max_tokens.value) +
         " overlap_disabled=" + (policy.overlap_disabled.value ? "true" : "false") +
         " tier=" + (forced ? std::string(tier_name(*forced)) : std::string("auto")) +
         " ranges=" + (ranges.empty() ? std::string("none") : ranges);
}

void agree_on_policy(Communicator& comm, const PolicyConfig& policy) {
  if (comm.size() < 2) return;
  const std::string values = policy_values(policy);
  RankRecord mine;
  mine.config_hash = fnv1a(values.data(), values.size());
  set_text(mine, values);
  const std::vector<RankRecord> all = exchange(comm, mine);
  for (std::size_t r = 1; r < all.size(); ++r) {
    if (all[r].config_hash == all[0].config_hash) continue;
    // Both lists hold the same names in the same order; name only the values that differ.
    const std::vector<std::string> first = words(all[0].text), other = words(all[r].text);
    std::string first_differs, other_differs;
    for (std::size_t i = 0; i < std::max(first.size(), other.size()); ++i) {
      const std::string a = i < first.size() ? first[i] : "", b = i < other.size() ? other[i] : "";
      if (a == b) continue;
      first_differs += " " + a;
      other_differs += " " + b;
    }
    throw Error("ranks' tier policies differ: rank 0" + first_differs + ", rank " +
                std::to_string(r) + other_differs);
  }
}

}  // namespace lmoe

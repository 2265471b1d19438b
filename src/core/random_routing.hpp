// Router-like expert ids for tests and benchmarks: each token's top_k experts distinct and drawn
// uniformly, as a router without preferences would pick them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace lmoe {

// [tokens · top_k] expert ids, token-major (slot t·k + j is token t's j-th expert), from
// std::mt19937(seed).
inline std::vector<std::int32_t> random_routing(std::int64_t tokens, std::int64_t experts,
                                                std::int64_t top_k, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::int32_t> all(static_cast<std::size_t>(experts)), ids;
  std::iota(all.begin(), all.end(), 0);
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    ids.insert(ids.end(), all.begin(), all.begin() + top_k);
  }
  return ids;
}

}  // namespace lmoe

// SplitMix64: a tiny, fast, seeded generator for filling large test and benchmark inputs (hundreds
// of MB in well under a second, where std::mt19937 with a distribution takes many seconds).
#pragma once

#include <cstdint>

namespace lmoe {

struct SplitMix64 {
  std::uint64_t state;

  std::uint64_t next() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1), 24 random bits: exact in fp32.
  float uniform() { return static_cast<float>(next() >> 40) * 0x1p-24f; }
};

}  // namespace lmoe

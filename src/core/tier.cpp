#include "lmoe/tier.hpp"

#include <string>

#include "lmoe/error.hpp"

namespace lmoe {

std::string_view tier_name(TailTier tier) {
  switch (tier) {
    case TailTier::fused: return "fused";
    case TailTier::overlap: return "overlap";
    case TailTier::column: return "column";
    case TailTier::token: return "token";
  }
  throw Error("invalid TailTier value " + std::to_string(static_cast<int>(tier)));
}

TailTier parse_tier(std::string_view name) {
  for (TailTier tier : kAllTiers) {
    if (tier_name(tier) == name) return tier;
  }
  throw Error("unknown tier '" + std::string(name) + "': expected fused, overlap, column or token");
}

std::optional<TailTier> parse_tier_or_auto(std::string_view name) {
  if (name == "auto") return std::nullopt;
  for (TailTier tier : kAllTiers) {
    if (tier_name(tier) == name) return tier;
  }
  throw Error("unknown tier '" + std::string(name) +
              "': expected auto, fused, overlap, column or token");
}

}  // namespace lmoe

// The tail's implementations ("tiers"); see DESIGN.md §2.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>

namespace lmoe {

enum class TailTier : std::uint8_t {
  fused,    // one-shot latent all-reduce + norm, stripe reduce-scatter of shared, striped up-proj,
            // all-gather
  overlap,  // all-reduce latent, norm, full-width up-proj while shared is all-reduced, add
  column,   // all-reduce latent, norm, up-proj of this rank's stripe accumulated into shared,
            // all-reduce
  token,    // reduce-scatter by token rows, norm + full-width up-proj of own rows, add, all-gather
};

inline constexpr std::array<TailTier, 4> kAllTiers = {TailTier::fused, TailTier::overlap,
                                                      TailTier::column, TailTier::token};

std::string_view tier_name(TailTier tier);
// Throws lmoe::Error listing the valid names.
TailTier parse_tier(std::string_view name);
// nullopt for "auto".
std::optional<TailTier> parse_tier_or_auto(std::string_view name);

}  // namespace lmoe

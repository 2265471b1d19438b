// What judging a policy on a measured grid (evaluate_policy) and fitting one to it (the tools'
// find_breakpoints and find_ranges) share.
#pragma once

#include <span>

#include "lmoe/tier_table.hpp"

namespace lmoe {

// lmoe::Error naming `who` unless the grid has points, its T rise strictly from 1 and every median
// that ran is finite and >= 0.
void validate_grid(std::span<const GridPoint> grid, const char* who);

// median(chosen) / median(fastest) − 1, finite even for a zero median.
double regret_of(const GridPoint& point, TailTier chosen, TailTier fastest);

}  // namespace lmoe

// The buckets of T that LatentTail::forward_device_tokens captures one conditional body for.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "lmoe/tail_options.hpp"

namespace lmoe {

// A tier for T, or none and why not.
using DeviceTokenChoice = std::pair<std::optional<TailTier>, std::string>;

// Buckets covering T = 1 … max_tokens, ascending: a new bucket starts after each power of two (so a
// bucket's rows are less than twice its smallest T) and wherever choose(T) changes tier, so every T
// of a bucket gets the tier chosen for the bucket's largest T. choose is asked once per T.
std::vector<DeviceTokenBucket> make_device_token_buckets(
    std::int64_t max_tokens, const std::function<DeviceTokenChoice(std::int64_t)>& choose);

}  // namespace lmoe

#include "core/device_token_buckets.hpp"

namespace lmoe {

std::vector<DeviceTokenBucket> make_device_token_buckets(
    std::int64_t max_tokens, const std::function<DeviceTokenChoice(std::int64_t)>& choose) {
  std::vector<DeviceTokenBucket> buckets;
  const auto power_of_two = [](std::int64_t n) { return n > 0 && (n & (n - 1)) == 0; };
  for (std::int64_t tokens = 1; tokens <= max_tokens; ++tokens) {
    DeviceTokenChoice choice = choose(tokens);
    if (buckets.empty() || choice.first != buckets.back().tier || power_of_two(tokens - 1)) {
      buckets.push_back(
          {tokens, tokens, choice.first, choice.first ? std::string() : std::move(choice.second)});
    } else {
      buckets.back().max_tokens = tokens;
    }
  }
  return buckets;
}

}  // namespace lmoe

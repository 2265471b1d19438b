#include "lmoe/fused_defaults.hpp"

#include <string>

#include "lmoe/settings.hpp"

namespace lmoe {

namespace {

// Why `what` is turned off by the flag `variable`; nullopt when it is unset or on.
std::optional<std::string> turned_off(const char* variable, const char* what) {
  if (setting_flag_if_set(variable).value_or(true)) return std::nullopt;
  return std::string(what) + " is turned off (" + variable + "=" + *setting_text(variable) + ")";
}

}  // namespace

std::optional<std::string> fused_decode_turned_off() {
  return turned_off("LMOE_FUSED_DECODE", "the decode kernel");
}

std::optional<std::string> fused_chained_turned_off() {
  return turned_off("LMOE_FUSED_CHAINED", "the chained path");
}

PolicyConfig with_rank_defaults(PolicyConfig policy, Backend backend, int ranks,
                                const std::optional<std::string>& decode_limit,
                                const std::optional<std::string>& chained_limit) {
  if (backend != Backend::cuda || ranks >= kFusedDefaultMinRanks ||
      policy.fused_max_tokens.source != SettingSource::built_in) {
    return policy;
  }
  const std::string where = "default for cuda at tp " + std::to_string(ranks);
  if (ranks == 1 && !chained_limit) {
    policy.fused_max_tokens = {
        kFusedDefaultTp1ChainedTokens, SettingSource::built_in,
        where +
            ": the chained path (every call of up to 128 rows with one rank, but those of up to "
            "4 where the decode kernel's pair instance runs) measured faster than overlap up to " +
            std::to_string(kFusedDefaultTp1ChainedTokens) + " tokens with cold weights"};
  } else if (ranks > 1 && !chained_limit) {
    policy.fused_max_tokens = {
        kFusedDefaultChainedTokens, SettingSource::built_in,
        where +
            ": the decode kernel and the chained path measured faster than overlap and "
            "column up to " +
            std::to_string(kFusedDefaultChainedTokens) +
            " tokens at tp 2 (one rank per GPU, cold weights)"};
  } else if (decode_limit) {
    policy.fused_max_tokens = {0, SettingSource::built_in,
                               where + " without the decode kernel (" + *decode_limit +
                                   "): fused measured slower than overlap"};
  } else if (ranks == 1) {
    policy.fused_max_tokens = {
        kFusedDefaultTp1Tokens, SettingSource::built_in,
        where + ": the decode kernel measured at least as fast as overlap up to " +
            std::to_string(kFusedDefaultTp1Tokens) + " tokens with cold weights"};
  } else {
    policy.fused_max_tokens = {kFusedDefaultDecodeTokens, SettingSource::built_in,
                               where + ": the decode kernel measured faster than overlap up to " +
                                   std::to_string(kFusedDefaultDecodeTokens) +
                                   " tokens at tp 2 (one rank per GPU, warm and cold weights)"};
  }
  return policy;
}

}  // namespace lmoe

// The environment variables that change how fast a tier runs but not what it computes: which fused
// kernel runs, how the token tier chunks its work, whether p2p ranks share a GPU, tracing, and
// NCCL's choice of algorithm. A sweep (`lmoe bench --json`) and a tier table record the ones that
// were set, since a measurement holds for the settings it was taken with; loading a table under
// other settings warns (match_tier_table).
#pragma once

#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace lmoe {

// Variable → value, for the variables of timing_setting_names() that were set (non-empty).
using TimingSettings = std::map<std::string, std::string>;

// The variables recorded, in a fixed order.
std::span<const char* const> timing_setting_names();

// This process's settings.
TimingSettings timing_settings_from_environment();

// "LMOE_FUSED_DECODE=1 NCCL_ALGO=Ring", or "" when none is set.
std::string timing_settings_text(const TimingSettings& settings);

// One entry per variable set differently in `a` and `b`: "LMOE_FUSED_DECODE is '1' in <a_name>,
// unset <b_name>" (b_name e.g. "here"), in name order.
std::vector<std::string> timing_settings_differences(const TimingSettings& a,
                                                     const TimingSettings& b,
                                                     std::string_view a_name,
                                                     std::string_view b_name);

}  // namespace lmoe

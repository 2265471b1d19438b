#include "lmoe/timing_settings.hpp"

#include <array>
#include <cstdlib>
#include <string_view>

#include "lmoe/settings.hpp"

namespace lmoe {

namespace {

// Why each is here (what it changes in a timed forward):
constexpr std::array<const char*, 17> kNames = {
    "LMOE_EPILOGUE_GEMM",              // whether the up-projection adds in its epilogue
    "LMOE_FUSED_CHAINED",              // which fused kernel runs for T <= 128 (docs/fused.md)
    "LMOE_FUSED_CHAINED_PACE_BURST",   // the chained path's first copies issued at once, if paced
    "LMOE_FUSED_CHAINED_PACE_NS",      // the pace of the chained path's first copies (0: at once)
    "LMOE_FUSED_CHAINED_TILE_ROWS",    // the chained path's tile of w_up (64 or 128 rows)
    "LMOE_FUSED_DECODE",               // which fused kernel runs at T <= 16 (docs/fused.md)
    "LMOE_FUSED_DECODE_EARLY_ITEMS",   // the decode kernel's weights asked for before its wait
    "LMOE_FUSED_DECODE_PAIR",          // the decode kernel's two blocks an SM for a narrow stripe
    "LMOE_FUSED_DECODE_PROGRAMMATIC",  // whether the decode kernel may start before the last ends
    "LMOE_FUSED_EXCHANGE_GRID",        // the chained path's exchange blocks with several ranks
    "LMOE_FUSED_TRACE",                // the fused kernels store a timestamp per block and point
    "LMOE_P2P_SHARED_GPU",             // p2p ranks may share a GPU (and its SMs, bandwidth and L2)
    "LMOE_TOKEN_CHUNKS",               // how the token tier pipelines its collectives
    "NCCL_ALGO",                       // NCCL's collective algorithm
    "NCCL_GRAPH_MIXING_SUPPORT",       // whether NCCL graphs may mix with other work
    "NCCL_NVLS_ENABLE",                // NVLink SHARP reductions
    "NCCL_PROTO",                      // NCCL's protocol (LL, LL128, Simple)
};

}  // namespace

std::span<const char* const> timing_setting_names() { return kNames; }

TimingSettings timing_settings_from_environment() {
  TimingSettings settings;
  for (const char* name : kNames) {
    // lmoe's own through the settings table; NCCL's are NCCL's.
    if (std::string_view(name).starts_with("LMOE_")) {
      if (auto value = setting_text(name)) settings[name] = *value;
    } else if (const char* value = std::getenv(name); value != nullptr && *value != '\0') {
      settings[name] = value;
    }
  }
  return settings;
}

std::string timing_settings_text(const TimingSettings& settings) {
  std::string text;
  for (const auto& [name, value] : settings) text += (text.empty() ? "" : " ") + name + "=" + value;
  return text;
}

std::vector<std::string> timing_settings_differences(const TimingSettings& a,
                                                     const TimingSettings& b,
                                                     std::string_view a_name,
                                                     std::string_view b_name) {
  const auto shown = [](const TimingSettings& settings, const std::string& name) {
    const auto found = settings.find(name);
    return found == settings.end() ? std::string("unset") : "'" + found->second + "'";
  };
  TimingSettings names = a;
  names.insert(b.begin(), b.end());
  std::vector<std::string> differences;
  for (const auto& [name, ignored] : names) {
    (void)ignored;
    const std::string in_a = shown(a, name), in_b = shown(b, name);
    if (in_a != in_b) {
      differences.push_back(name + " is " + in_a + " in " + std::string(a_name) + ", " + in_b +
                            " " + std::string(b_name));
    }
  }
  return differences;
}

}  // namespace lmoe

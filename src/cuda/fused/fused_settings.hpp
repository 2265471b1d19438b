// The fused tier's settings, read once from the settings table (lmoe/settings.hpp) where a
// FusedTail is built; tools and tests may set them directly instead. All but the two switches are
// for measurements (docs/fused.md).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace lmoe::cuda {

struct FusedSettings {
  // LMOE_FUSED_TRACE: every kernel stamps the time per block and point; printed on destruction.
  bool trace = false;
  // LMOE_FUSED_DECODE=0, LMOE_FUSED_CHAINED=0: why the kernel is turned off; nullopt when it is on.
  std::optional<std::string> decode_off;
  std::optional<std::string> chained_off;
  // LMOE_FUSED_DECODE_PROGRAMMATIC; nullopt: the default (on with one rank, off with several).
  std::optional<bool> decode_programmatic;
  bool decode_pair = true;      // LMOE_FUSED_DECODE_PAIR
  int decode_early_items = -1;  // LMOE_FUSED_DECODE_EARLY_ITEMS; < 0: the instance's default
  int chained_tile_rows = 0;    // LMOE_FUSED_CHAINED_TILE_ROWS: 64 or 128; 0: the plan's
  // LMOE_FUSED_EXCHANGE_GRID (several ranks); checked against what the GPU holds at construction.
  std::optional<std::int64_t> exchange_grid;
  std::optional<std::int64_t> chained_pace_ns;     // LMOE_FUSED_CHAINED_PACE_NS
  std::optional<std::int64_t> chained_pace_burst;  // LMOE_FUSED_CHAINED_PACE_BURST
  // How long a kernel of one rank waits for its own grid's blocks (LMOE_P2P_TIMEOUT_MS, as the p2p
  // group's waits); with several ranks, and with one over p2p, the group's timeout serves instead.
  std::chrono::milliseconds wait_timeout{10000};
};

// Every field from the environment, each checked against the table (an lmoe::Error naming the
// variable otherwise). The exchange grid is read with several ranks (`tp` > 1) only.
FusedSettings fused_settings_from_environment(int tp);

}  // namespace lmoe::cuda

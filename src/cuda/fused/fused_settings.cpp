#include "cuda/fused/fused_settings.hpp"

#include "cuda/comm/p2p_group.hpp"
#include "cuda/fused/fused_decode_launch.hpp"
#include "lmoe/error.hpp"
#include "lmoe/fused_defaults.hpp"
#include "lmoe/settings.hpp"

namespace lmoe::cuda {

FusedSettings fused_settings_from_environment(int tp) {
  static_assert(kFusedDecodeMaxEarlyItems == 64, "LMOE_FUSED_DECODE_EARLY_ITEMS's bound");
  FusedSettings settings;
  settings.trace = setting_present("LMOE_FUSED_TRACE");
  settings.decode_off = fused_decode_turned_off();
  settings.chained_off = fused_chained_turned_off();
  settings.decode_programmatic = setting_flag_if_set("LMOE_FUSED_DECODE_PROGRAMMATIC");
  settings.decode_pair = setting_flag_if_set("LMOE_FUSED_DECODE_PAIR").value_or(true);
  settings.decode_early_items =
      static_cast<int>(setting_int("LMOE_FUSED_DECODE_EARLY_ITEMS").value_or(-1));
  if (const auto asked = setting_int("LMOE_FUSED_CHAINED_TILE_ROWS")) {
    if (*asked != 64 && *asked != 128) {
      throw Error("LMOE_FUSED_CHAINED_TILE_ROWS: expected 64 or 128, got \"" +
                  std::to_string(*asked) + "\"");
    }
    settings.chained_tile_rows = static_cast<int>(*asked);
  }
  if (tp > 1) settings.exchange_grid = setting_int("LMOE_FUSED_EXCHANGE_GRID");
  settings.chained_pace_ns = setting_int("LMOE_FUSED_CHAINED_PACE_NS");
  settings.chained_pace_burst = setting_int("LMOE_FUSED_CHAINED_PACE_BURST");
  settings.wait_timeout = p2p_default_timeout();
  return settings;
}

}  // namespace lmoe::cuda

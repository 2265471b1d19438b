// Settings NCCL reads from the environment once per process, when the process creates its first
// communicator: changing the variable after that has no effect in this process. lmoe records the
// values it depends on at that moment, so that a check made later (a capability, a test) judges
// what NCCL actually uses, not what the environment says now. Host code; the two recording
// functions exist in NCCL builds only (src/comm/nccl_group.cpp).
#pragma once

#include <optional>
#include <string>

namespace lmoe {

// Called by the NCCL group before every communicator it creates; records the settings the first
// time.
void note_nccl_first_init();

// Why T read on the device cannot run a collective tier over NCCL with tp > 1, given
// NCCL_GRAPH_MIXING_SUPPORT as NCCL read it (nullopt: not known), or nullopt when it can: unless
// the variable was 0, NCCL makes every captured collective wait for its previous one through
// event nodes, and a CUDA graph conditional body cannot hold event nodes.
inline std::optional<std::string> nccl_device_tokens_refusal(
    const std::optional<std::string>& mixing_in_effect) {
  if (mixing_in_effect && *mixing_in_effect == "0") return std::nullopt;
  return "over NCCL with tp > 1, captured collectives carry event-wait nodes "
         "(NCCL_GRAPH_MIXING_SUPPORT=" +
         (mixing_in_effect ? *mixing_in_effect : std::string("unknown")) +
         " when this process created its first NCCL communicator), which a CUDA graph conditional "
         "body cannot "
         "hold; set NCCL_GRAPH_MIXING_SUPPORT=0 before the process's first NCCL communicator (NCCL "
         "reads it "
         "once per process)";
}

// NCCL_GRAPH_MIXING_SUPPORT as NCCL read it ("1" when it was unset: NCCL's default), or nullopt
// while this process has created no NCCL communicator (NCCL will read the environment then).
std::optional<std::string> nccl_graph_mixing_in_effect();

}  // namespace lmoe

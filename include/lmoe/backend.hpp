// The backends a tail or layer runs on. What each can run, and whether this build and machine have
// it, is the runtime's backend registry's to say (lmoe/backend_registry.hpp).
#pragma once

#include <cstdint>
#include <string_view>

namespace lmoe {

enum class Backend : std::uint8_t { cpu, cuda };
std::string_view backend_name(Backend backend);
// lmoe::Error naming the backends for an unknown name.
Backend parse_backend(std::string_view name);

}  // namespace lmoe

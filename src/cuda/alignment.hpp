// Pointer alignment checks for the launchers' vector paths (host code).
#pragma once

#include <cstdint>

namespace lmoe::cuda {

// Whether 16-byte vector loads and stores may start at p.
inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

}  // namespace lmoe::cuda

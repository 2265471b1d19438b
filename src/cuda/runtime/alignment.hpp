// Pointer alignment checks for the launchers' vector paths (host code).
#pragma once

#include <cstdint>

namespace lmoe::cuda {

// Whether 16-byte vector loads and stores may start at p.
inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// Whether a V (e.g. Vec4<T>: four stored elements) may be loaded or stored at p.
template <typename V>
inline bool aligned_for(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p) % alignof(V) == 0;
}

}  // namespace lmoe::cuda

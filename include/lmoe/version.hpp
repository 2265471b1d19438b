// The library's version, as tier tables and the `lmoe` tool record it (CMakeLists.txt's project
// version says the same).
#pragma once

namespace lmoe {

inline constexpr const char* kVersion = "0.1.0";

}  // namespace lmoe

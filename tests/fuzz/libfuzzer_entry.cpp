// The entry point of lmoe_fuzz_<target>, LMOE_FUZZ_TARGET naming the parser. With LMOE_FUZZ it is
// libFuzzer's (scripts/fuzz.sh): anything but lmoe::Error escaping, or a sanitizer report, is a
// crash it saves as a reproducer. Otherwise replay_main.cpp calls it on the files it is given.
#include <cstddef>
#include <cstdint>
#include <span>

#include "parser_targets.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const lmoe_fuzz::ParserTarget& target = lmoe_fuzz::parser_target(LMOE_FUZZ_TARGET);
  (void)target.parse(std::span(reinterpret_cast<const std::byte*>(data), size));
  return 0;
}

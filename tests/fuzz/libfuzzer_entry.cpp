// The entry point of one libFuzzer binary (scripts/fuzz.sh builds one per target with clang):
// LMOE_FUZZ_TARGET names the parser. Anything but lmoe::Error escaping, or a sanitizer report, is a
// crash that libFuzzer saves as a reproducer.
#include <cstddef>
#include <cstdint>
#include <span>

#include "parser_targets.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const lmoe_fuzz::ParserTarget& target = lmoe_fuzz::parser_target(LMOE_FUZZ_TARGET);
  (void)target.parse(std::span(reinterpret_cast<const std::byte*>(data), size));
  return 0;
}

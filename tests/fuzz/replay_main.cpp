// The main of a fuzz target's binary where libFuzzer is not linked (any compiler, every build): it
// runs the target once on each file named, so a crash file from scripts/fuzz.sh reproduces in an
// ordinary build, and CI runs every target on its seeds (ctest fuzz.seeds).
// Usage: lmoe_fuzz_<target> FILE...
#include <cstddef>
#include <cstdint>
#include <exception>
#include <iostream>
#include <string>

#include "core/text_file.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: " << argv[0] << " FILE...\n";
    return 2;
  }
  for (int i = 1; i < argc; ++i) {
    try {
      const std::string bytes = lmoe::read_text_file(argv[i], "fuzz input");
      LLVMFuzzerTestOneInput(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
    } catch (const std::exception& error) {
      std::cerr << argv[i] << ": " << error.what() << "\n";
      return 1;
    }
  }
  std::cout << argv[0] << ": " << argc - 1 << " input(s) kept the contract\n";
  return 0;
}

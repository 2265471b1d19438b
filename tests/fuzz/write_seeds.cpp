// lmoe_fuzz_seeds DATA_DIR OUT_DIR: writes each fuzz target's seeds (parser_seeds) as files,
// OUT_DIR/<target>/seed_<i>, the starting corpus of scripts/fuzz.sh.
#include <filesystem>
#include <fstream>
#include <iostream>

#include "lmoe/error.hpp"
#include "parser_targets.hpp"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: lmoe_fuzz_seeds DATA_DIR OUT_DIR\n";
    return 2;
  }
  try {
    for (const lmoe_fuzz::ParserTarget& target : lmoe_fuzz::parser_targets()) {
      const std::filesystem::path dir = std::filesystem::path(argv[2]) / target.name;
      std::filesystem::create_directories(dir);
      const auto seeds = lmoe_fuzz::parser_seeds(target, argv[1]);
      for (std::size_t i = 0; i < seeds.size(); ++i) {
        std::ofstream out(dir / ("seed_" + std::to_string(i)), std::ios::binary);
        out.write(reinterpret_cast<const char*>(seeds[i].data()),
                  static_cast<std::streamsize>(seeds[i].size()));
        if (!out)
          throw lmoe::Error("cannot write " + (dir / ("seed_" + std::to_string(i))).string());
      }
      std::cout << target.name << ": " << seeds.size() << " seeds in " << dir.string() << "\n";
    }
  } catch (const std::exception& error) {
    std::cerr << "lmoe_fuzz_seeds: " << error.what() << "\n";
    return 1;
  }
  return 0;
}

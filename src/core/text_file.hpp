// A whole file read as text, for the JSON files lmoe reads (recorded sweeps, tier tables).
#pragma once

#include <fstream>
#include <sstream>
#include <string>

#include "lmoe/error.hpp"

namespace lmoe {

// The file's bytes; lmoe::Error "cannot read the <what> '<path>'" when it cannot be opened or read.
inline std::string read_text_file(const std::string& path, const std::string& what) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw Error("cannot read the " + what + " '" + path + "'");
  std::ostringstream text;
  text << file.rdbuf();
  if (!file && !file.eof()) throw Error("reading the " + what + " '" + path + "' failed");
  return text.str();
}

}  // namespace lmoe

#include "core/env_flag.hpp"

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "lmoe/error.hpp"

namespace lmoe {

std::string ascii_lowercase(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return text;
}

bool parse_flag(const std::string& variable, const std::string& text) {
  const std::string value = ascii_lowercase(text);
  if (value == "1" || value == "true" || value == "yes" || value == "on") return true;
  if (value == "0" || value == "false" || value == "no" || value == "off") return false;
  throw Error(variable + "='" + text + "': expected 1, 0, true, false, yes, no, on or off");
}

bool env_flag(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return false;
  return parse_flag(name, value);
}

}  // namespace lmoe

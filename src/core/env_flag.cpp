#include "core/env_flag.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>

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

std::int64_t parse_integer(const std::string& variable, const std::string& text, std::int64_t min,
                           std::int64_t max, const std::string& what) {
  const char* begin = text.data();
  const char* end = begin + text.size();
  std::int64_t value = 0;
  const auto [stop, error] = std::from_chars(begin, end, value);
  // from_chars takes a leading '-', which no setting here means; out of range is an error too,
  // never a wrapped value.
  if (text.empty() || error != std::errc() || stop != end || text[0] == '-' || value < min ||
      value > max) {
    throw Error(variable + ": expected " + what + " in [" + std::to_string(min) + ", " +
                std::to_string(max) + "], got \"" + text + "\"");
  }
  return value;
}

}  // namespace lmoe

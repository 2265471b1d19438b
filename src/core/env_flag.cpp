#include "core/env_flag.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <cstring>

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

std::optional<bool> env_flag_if_set(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return parse_flag(name, value);
}

bool env_flag(const char* name) { return env_flag_if_set(name).value_or(false); }

std::optional<long long> env_integer(const char* name, long long min, long long max,
                                     const std::string& what) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return std::nullopt;
  const char* end = text + std::strlen(text);
  long long value = 0;
  const auto [stop, error] = std::from_chars(text, end, value);
  // from_chars takes a leading '-', which no setting here means.
  if (error != std::errc() || stop != end || *text == '-' || value < min || value > max) {
    throw Error(std::string(name) + ": expected " + what + " in [" + std::to_string(min) + ", " +
                std::to_string(max) + "], got \"" + text + "\"");
  }
  return value;
}

}  // namespace lmoe

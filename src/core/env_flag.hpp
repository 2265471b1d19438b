// The parsers of setting values, one way everywhere (lmoe/settings.hpp reads the environment
// through them): flags are 1/0, true/false, yes/no, on/off (any case); anything else is an
// lmoe::Error naming the variable, so a typo is never taken as "no".
#pragma once

#include <cstdint>
#include <string>

namespace lmoe {

std::string ascii_lowercase(std::string text);

// `text` as a flag; throws lmoe::Error naming `variable` when it is none of the accepted words.
bool parse_flag(const std::string& variable, const std::string& text);

// `text` as a whole number in [min, max] (digits only: no sign, blank or suffix); anything else is
// an lmoe::Error "VARIABLE: expected WHAT in [min, max], got "TEXT"".
std::int64_t parse_integer(const std::string& variable, const std::string& text, std::int64_t min,
                           std::int64_t max, const std::string& what);

}  // namespace lmoe

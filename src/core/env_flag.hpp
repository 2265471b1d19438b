// Yes/no settings from the environment, read one way everywhere: 1/0, true/false, yes/no, on/off
// (any case); anything else is an lmoe::Error naming the variable, so a typo is never taken as "no".
#pragma once

#include <optional>
#include <string>

namespace lmoe {

std::string ascii_lowercase(std::string text);

// `text` as a flag; throws lmoe::Error naming `variable` when it is none of the accepted words.
bool parse_flag(const std::string& variable, const std::string& text);

// The variable `name` of the process environment as a flag; unset or empty: nullopt (so that a
// setting whose default depends on other things can tell "not set" from "0").
std::optional<bool> env_flag_if_set(const char* name);

// The same with unset or empty read as false.
bool env_flag(const char* name);

// The variable `name` as a whole number in [min, max] (digits only: no sign, blank or suffix);
// unset or empty: nullopt; anything else is an lmoe::Error "NAME: expected WHAT in [min, max], got
// "TEXT"".
std::optional<long long> env_integer(const char* name, long long min, long long max,
                                     const std::string& what);

}  // namespace lmoe

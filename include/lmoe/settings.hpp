// Every LMOE_* environment variable lmoe reads, in one table: its name, type, range, default,
// meaning and where it applies. Each read goes through a function below, which checks the value
// against the table, so that a value out of range is an lmoe::Error naming the variable and the
// bound, and reading a name the table lacks is a programming error (it throws). `lmoe env` prints
// the table with the current values (docs/settings.md).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace lmoe {

// Reads a variable of the environment; nullopt when unset. Tests pass their own.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;
EnvLookup process_environment();

enum class SettingType {
  flag,          // 1/0, true/false, yes/no, on/off (any case); unset or empty: the default
  presence,      // on when set at all, whatever the value (diagnostics)
  integer,       // digits only, in [min, max]
  milliseconds,  // an integer count of milliseconds, in [min, max]
  nanoseconds,   // an integer count of nanoseconds, in [min, max]
  tokens,        // a token count in [min, max] (a tier breakpoint; "none" where `what` says so)
  choice,        // one of the words of `what` ("0 or 1")
  tier,          // auto, fused, overlap, column or token
  path,          // a file's path
};

std::string_view setting_type_name(SettingType type);

struct SettingSpec {
  const char* name;
  SettingType type;
  std::int64_t min = 0;  // numbers only: every number has both bounds
  std::int64_t max = 0;
  const char* what;      // what a value is, for messages: "a count of chunks", "0 or 1"
  const char* fallback;  // the default, in words
  const char* meaning;
  const char* applies;  // the layer, tier or command that reads it
};

// Every variable, in name order.
std::span<const SettingSpec> settings_table();

// The variable's row; nullptr when the table has no such name.
const SettingSpec* find_setting(std::string_view name);

// The row of a variable the code reads; throws lmoe::Error when the table lacks it.
const SettingSpec& setting_spec(std::string_view name);

// "[1, 8]", "1/0, true/false, yes/no, on/off", "a path", ...
std::string setting_range_text(const SettingSpec& spec);

// The variable's text; nullopt when unset or empty.
std::optional<std::string> setting_text(std::string_view name,
                                        const EnvLookup& env = process_environment());

// Whether the variable is set at all (even to ""), for presence settings.
bool setting_present(std::string_view name, const EnvLookup& env = process_environment());

// A flag (env_flag's words); nullopt when unset or empty, so that a setting whose default depends
// on other things can tell "not set" from "0". Otherwise "NAME='TEXT': expected 1, 0, true, ...".
std::optional<bool> setting_flag_if_set(std::string_view name,
                                        const EnvLookup& env = process_environment());
// The same with unset or empty read as false.
bool setting_flag(std::string_view name, const EnvLookup& env = process_environment());

// A number (integer, milliseconds or nanoseconds) in the table's [min, max]: digits only, no sign,
// blank or suffix; nullopt when unset or empty; else "NAME: expected WHAT in [min, max], got
// "TEXT"".
std::optional<std::int64_t> setting_int(std::string_view name,
                                        const EnvLookup& env = process_environment());

// A token count (tokens type), whole digits up to the table's max: "NAME='TEXT': expected a
// non-negative integer number of tokens" or "NAME='TEXT': the number is too large".
std::int64_t parse_setting_tokens(std::string_view name, const std::string& text);

// A choice: the text when it is one of the words of the table's `what`; nullopt when unset or
// empty; else "NAME='TEXT': expected WHAT".
std::optional<std::string> setting_choice(std::string_view name,
                                          const EnvLookup& env = process_environment());

// The known name closest to `name` (a typo's likely meaning): at most 3 edits away, or nullopt.
std::optional<std::string> closest_setting_name(std::string_view name);

// One warning per LMOE_* name in `names` that the table does not know, naming the closest known
// name where there is one: "LMOE_P2P_TIMEOUT is not a setting lmoe reads (did you mean
// LMOE_P2P_TIMEOUT_MS?)".
std::vector<std::string> unknown_setting_warnings(const std::vector<std::string>& names);

// The names of the LMOE_* variables of this process's environment, sorted.
std::vector<std::string> environment_lmoe_names();

}  // namespace lmoe

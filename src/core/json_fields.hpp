// Reading the fields of lmoe's JSON files (tier tables, recorded sweeps) with errors that name the
// field: every reader says where it is ("t.json: provenance", "b.json: records[17]") and these
// append the key and what was expected ("b.json: records[17].median_us: expected a finite number
// >= 0, got \"x\"").
#pragma once

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "lmoe/error.hpp"

namespace lmoe::json_fields {

using nlohmann::json;

// Where a key of the object at `where` is: "t.json: provenance" + "tp" → "t.json: provenance.tp". A
// file's top level is named with a trailing ": " ("b.json: ") and gives "b.json: tp".
inline std::string member(const std::string& where, const std::string& key) {
  return where.ends_with(": ") ? where + key : where + "." + key;
}

// `where` itself, in a message about the object there ("b.json: " → "b.json").
inline std::string named(const std::string& where) {
  return where.ends_with(": ") ? where.substr(0, where.size() - 2) : where;
}

// The key is taken by value (a view): a reference parameter bound to a temporary key would make
// GCC 13 warn that the returned reference may dangle (-Wdangling-reference), which it cannot.
inline const json& field(const json& object, std::string_view key, const std::string& where) {
  if (!object.is_object()) throw Error(named(where) + ": expected an object");
  const auto found = object.find(std::string(key));
  if (found == object.end()) throw Error(named(where) + ": missing \"" + std::string(key) + "\"");
  return *found;
}

inline std::string text_field(const json& object, const std::string& key,
                              const std::string& where) {
  const json& value = field(object, key, where);
  if (!value.is_string())
    throw Error(member(where, key) + ": expected a string, got " + value.dump());
  return value.get<std::string>();
}

// A string or null.
inline std::optional<std::string> optional_text(const json& object, const std::string& key,
                                                const std::string& where) {
  const json& value = field(object, key, where);
  if (value.is_null()) return std::nullopt;
  return text_field(object, key, where);
}

inline bool bool_field(const json& object, const std::string& key, const std::string& where) {
  const json& value = field(object, key, where);
  if (!value.is_boolean())
    throw Error(member(where, key) + ": expected true or false, got " + value.dump());
  return value.get<bool>();
}

inline std::int64_t integer_field(const json& object, const std::string& key,
                                  const std::string& where, std::int64_t min) {
  const json& value = field(object, key, where);
  if (!value.is_number_integer() ||
      (value.is_number_unsigned() && value.get<std::uint64_t>() > INT64_MAX) ||
      value.get<std::int64_t>() < min) {
    throw Error(member(where, key) + ": expected an integer >= " + std::to_string(min) + ", got " +
                value.dump());
  }
  return value.get<std::int64_t>();
}

inline int int_field(const json& object, const std::string& key, const std::string& where,
                     int min) {
  const std::int64_t value = integer_field(object, key, where, min);
  if (value > INT32_MAX) {
    throw Error(member(where, key) + ": expected at most " + std::to_string(INT32_MAX) + ", got " +
                std::to_string(value));
  }
  return static_cast<int>(value);
}

// A finite number >= 0 (times, bytes, bandwidths, error ratios).
inline double nonnegative_field(const json& object, const std::string& key,
                                const std::string& where) {
  const json& value = field(object, key, where);
  if (!value.is_number() || !std::isfinite(value.get<double>()) || value.get<double>() < 0) {
    throw Error(member(where, key) + ": expected a finite number >= 0, got " + value.dump());
  }
  return value.get<double>();
}

// An object of strings ({"LMOE_FUSED_DECODE": "1"}).
inline std::map<std::string, std::string> text_map_field(const json& object, const std::string& key,
                                                         const std::string& where) {
  const json& value = field(object, key, where);
  if (!value.is_object())
    throw Error(member(where, key) + ": expected an object of strings, got " + value.dump());
  std::map<std::string, std::string> map;
  for (const auto& [name, text] : value.items()) {
    if (!text.is_string())
      throw Error(member(member(where, key), name) + ": expected a string, got " + text.dump());
    map[name] = text.get<std::string>();
  }
  return map;
}

// The JSON text of a file named `origin`, which must hold an object.
inline json parse_object(const std::string& json_text, const std::string& origin) {
  json doc;
  try {
    doc = json::parse(json_text);
  } catch (const json::exception& error) {
    throw Error(origin + ": not valid JSON: " + error.what());
  }
  if (!doc.is_object()) throw Error(origin + ": expected a JSON object at the top level");
  return doc;
}

// `parse()` with its lmoe::Error prefixed by `where` (for parsers of names: tiers, dtypes, ...).
template <typename Parse>
auto parsed(const std::string& where, Parse parse) {
  try {
    return parse();
  } catch (const Error& error) {
    throw Error(where + ": " + error.message());
  }
}

}  // namespace lmoe::json_fields

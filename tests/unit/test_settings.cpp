// The table of LMOE_* settings (lmoe/settings.hpp): it lists exactly the variables the sources
// read, every number is bounded and a value past a bound is refused naming the variable and the
// bound, flags read the same words everywhere, and an unknown LMOE_* name is warned of with the
// closest known name.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "error_message.hpp"
#include "lmoe/error.hpp"
#include "lmoe/settings.hpp"

namespace {

using lmoe::SettingType;
using lmoe::testing::error_message_of;

lmoe::EnvLookup env_of(std::map<std::string, std::string> values) {
  return [values = std::move(values)](const std::string& name) -> std::optional<std::string> {
    const auto found = values.find(name);
    if (found == values.end()) return std::nullopt;
    return found->second;
  };
}

// Every source file of the library, the tool and the benchmarks, but the table itself.
std::vector<std::filesystem::path> source_files() {
  const std::filesystem::path root = LMOE_SOURCE_DIR;
  std::vector<std::filesystem::path> files;
  for (const char* dir : {"src", "apps", "benchmarks", "include"}) {
    for (const auto& entry : std::filesystem::recursive_directory_iterator(root / dir)) {
      const std::string ext = entry.path().extension().string();
      if (!entry.is_regular_file() ||
          (ext != ".cpp" && ext != ".hpp" && ext != ".cu" && ext != ".cuh" && ext != ".h")) {
        continue;
      }
      const std::string name = entry.path().filename().string();
      if (name == "settings.cpp" || name == "settings.hpp") continue;
      files.push_back(entry.path());
    }
  }
  return files;
}

std::string text_of(const std::filesystem::path& path) {
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

TEST(SettingsTable, ListsEveryVariableTheSourcesReadAndNoOther) {
  // A string literal that starts with a name ("LMOE_X" or "LMOE_X=..."): the variable is named in
  // code (read, or named in a message); exactly "LMOE_X": read.
  const std::regex named("\"(LMOE_[A-Z0-9_]*[A-Z0-9])");
  std::set<std::string> mentioned, read;
  std::vector<std::string> direct_reads;
  const auto files = source_files();
  ASSERT_GT(files.size(), 50u) << "the source tree was not found at " << LMOE_SOURCE_DIR;
  for (const auto& path : files) {
    const std::string text = text_of(path);
    for (auto it = std::sregex_iterator(text.begin(), text.end(), named);
         it != std::sregex_iterator(); ++it) {
      const std::string name = (*it)[1].str();
      mentioned.insert(name);
      const std::size_t end = static_cast<std::size_t>(it->position(1) + it->length(1));
      if (end < text.size() && text[end] == '"') read.insert(name);
    }
    if (text.find("getenv(\"LMOE_") != std::string::npos) direct_reads.push_back(path.string());
  }
  for (const std::string& name : mentioned) {
    EXPECT_NE(lmoe::find_setting(name), nullptr) << name << " is read but not in the table";
  }
  for (const lmoe::SettingSpec& spec : lmoe::settings_table()) {
    EXPECT_TRUE(read.count(spec.name)) << spec.name << " is in the table but never read";
  }
  EXPECT_THAT(direct_reads, ::testing::IsEmpty()) << "LMOE_* read around the table";
}

TEST(SettingsTable, IsSortedWithEveryFieldAndEveryNumberBounded) {
  const auto table = lmoe::settings_table();
  EXPECT_EQ(table.size(), 26u);
  for (std::size_t i = 0; i < table.size(); ++i) {
    const lmoe::SettingSpec& spec = table[i];
    SCOPED_TRACE(spec.name);
    if (i > 0) {
      EXPECT_LT(std::string(table[i - 1].name), std::string(spec.name));
    }
    EXPECT_TRUE(std::string(spec.name).starts_with("LMOE_"));
    EXPECT_FALSE(std::string(spec.fallback).empty());
    EXPECT_FALSE(std::string(spec.meaning).empty());
    EXPECT_FALSE(std::string(spec.applies).empty());
    EXPECT_FALSE(lmoe::setting_range_text(spec).empty());
    if (spec.type == SettingType::integer || spec.type == SettingType::milliseconds ||
        spec.type == SettingType::nanoseconds || spec.type == SettingType::tokens) {
      EXPECT_LT(spec.min, spec.max);
      EXPECT_GE(spec.min, 0);
      EXPECT_FALSE(std::string(spec.what).empty());
    }
  }
  EXPECT_EQ(lmoe::setting_range_text(lmoe::setting_spec("LMOE_TOKEN_CHUNKS")), "[1, 8]");
  EXPECT_EQ(lmoe::setting_range_text(lmoe::setting_spec("LMOE_P2P_TIMEOUT_MS")), "[1, 86400000]");
}

TEST(SettingsTable, ReadingANameOutsideTheTableOrAsAnotherTypeThrows) {
  EXPECT_EQ(error_message_of([] { lmoe::setting_text("LMOE_NOT_A_SETTING", env_of({})); }),
            "LMOE_NOT_A_SETTING is not in the settings table (lmoe/settings.hpp): add it there "
            "before reading it");
  EXPECT_EQ(error_message_of([] { lmoe::setting_flag("LMOE_NOT_A_SETTING", env_of({})); }),
            "LMOE_NOT_A_SETTING is not in the settings table (lmoe/settings.hpp): add it there "
            "before reading it");
  EXPECT_EQ(error_message_of([] { lmoe::setting_int("LMOE_P2P_SHARED_GPU", env_of({})); }),
            "LMOE_P2P_SHARED_GPU is a flag setting, read here as another type (a programming "
            "error)");
  EXPECT_EQ(lmoe::find_setting("LMOE_NOT_A_SETTING"), nullptr);
}

// A number past its bound is refused with the variable, the range and the text; one too large for
// 64 bits too (never wrapped).
TEST(SettingsNumbers, OutOfRangeIsRefusedNamingTheVariableAndTheBound) {
  for (const char* ms : {"1", "2500", "86400000"}) {
    EXPECT_EQ(lmoe::setting_int("LMOE_P2P_TIMEOUT_MS", env_of({{"LMOE_P2P_TIMEOUT_MS", ms}})),
              std::stoll(ms));
  }
  EXPECT_EQ(lmoe::setting_int("LMOE_P2P_TIMEOUT_MS", env_of({})), std::nullopt);
  EXPECT_EQ(lmoe::setting_int("LMOE_P2P_TIMEOUT_MS", env_of({{"LMOE_P2P_TIMEOUT_MS", ""}})),
            std::nullopt);
  for (const char* bad : {"1000000000000000000", "86400001", "99999999999999999999", "0", "-5",
                          "+5", " 5", "5ms", "ten"}) {
    EXPECT_EQ(error_message_of([&] {
                lmoe::setting_int("LMOE_P2P_TIMEOUT_MS", env_of({{"LMOE_P2P_TIMEOUT_MS", bad}}));
              }),
              std::string("LMOE_P2P_TIMEOUT_MS: expected a positive number of milliseconds in [1, "
                          "86400000], got \"") +
                  bad + "\"");
  }
  const std::map<std::string, std::pair<std::string, std::string>> edges = {
      {"LMOE_TOKEN_CHUNKS", {"9", "a count of chunks in [1, 8]"}},
      {"LMOE_FUSED_CHAINED_PACE_NS", {"100001", "nanoseconds in [0, 100000]"}},
      {"LMOE_FUSED_CHAINED_PACE_BURST", {"65", "a count of copies in [1, 64]"}},
      {"LMOE_FUSED_DECODE_EARLY_ITEMS", {"65", "a count of a warp's weight items in [0, 64]"}},
      {"LMOE_FUSED_EXCHANGE_GRID", {"65537", "a count of blocks on this GPU in [1, 65536]"}},
      {"LMOE_FUSED_CHAINED_TILE_ROWS", {"256", "64 or 128 in [64, 128]"}},
  };
  for (const auto& [name, edge] : edges) {
    const lmoe::SettingSpec& spec = lmoe::setting_spec(name);
    EXPECT_EQ(lmoe::setting_int(name, env_of({{name, std::to_string(spec.max)}})), spec.max);
    EXPECT_EQ(lmoe::setting_int(name, env_of({{name, std::to_string(spec.min)}})), spec.min);
    EXPECT_EQ(error_message_of([&] {
                lmoe::setting_int(name, env_of({{name, edge.first}}));
              }),
              name + ": expected " + edge.second + ", got \"" + edge.first + "\"");
  }
}

TEST(SettingsNumbers, TokenCountsStopAtTheLargest64BitValue) {
  EXPECT_EQ(lmoe::parse_setting_tokens("LMOE_FUSED_MAX_TOKENS", "9223372036854775807"),
            9223372036854775807LL);
  EXPECT_EQ(error_message_of(
                [] { lmoe::parse_setting_tokens("LMOE_FUSED_MAX_TOKENS", "9223372036854775808"); }),
            "LMOE_FUSED_MAX_TOKENS='9223372036854775808': the number is too large");
  EXPECT_EQ(error_message_of([] { lmoe::parse_setting_tokens("LMOE_OVERLAP_MAX_TOKENS", "-1"); }),
            "LMOE_OVERLAP_MAX_TOKENS='-1': expected a non-negative integer number of tokens");
}

// Every flag reads the same words, and a word that is none of them is an error naming the
// variable, not a quiet "no".
TEST(SettingsFlags, AcceptTheSameWordsEverywhereAndNameTheVariableOtherwise) {
  for (const lmoe::SettingSpec& spec : lmoe::settings_table()) {
    if (spec.type != SettingType::flag) continue;
    const std::string name = spec.name;
    SCOPED_TRACE(name);
    EXPECT_FALSE(lmoe::setting_flag(name, env_of({})));
    EXPECT_EQ(lmoe::setting_flag_if_set(name, env_of({})), std::nullopt);
    EXPECT_EQ(lmoe::setting_flag_if_set(name, env_of({{name, ""}})), std::nullopt);
    for (const char* yes : {"1", "true", "YES", "On"}) {
      EXPECT_EQ(lmoe::setting_flag_if_set(name, env_of({{name, yes}})), true) << yes;
    }
    for (const char* no : {"0", "false", "No", "OFF"}) {
      EXPECT_EQ(lmoe::setting_flag_if_set(name, env_of({{name, no}})), false) << no;
    }
    for (const char* bad : {"maybe", "2", "y", " 1"}) {
      EXPECT_EQ(error_message_of([&] {
                  lmoe::setting_flag(name, env_of({{name, bad}}));
                }),
                name + "='" + bad + "': expected 1, 0, true, false, yes, no, on or off");
    }
  }
}

TEST(SettingsOthers, PresenceChoiceAndText) {
  EXPECT_FALSE(lmoe::setting_present("LMOE_FUSED_TRACE", env_of({})));
  EXPECT_TRUE(lmoe::setting_present("LMOE_FUSED_TRACE", env_of({{"LMOE_FUSED_TRACE", ""}})));
  EXPECT_TRUE(lmoe::setting_present("LMOE_FUSED_TRACE", env_of({{"LMOE_FUSED_TRACE", "0"}})));
  const std::string fault = "LMOE_BENCH_INJECT_FAULT";
  EXPECT_EQ(lmoe::setting_choice(fault, env_of({})), std::nullopt);
  EXPECT_EQ(lmoe::setting_choice(fault, env_of({{fault, "1"}})), "1");
  EXPECT_EQ(lmoe::setting_choice(fault, env_of({{fault, "0"}})), "0");
  EXPECT_EQ(error_message_of([&] {
              lmoe::setting_choice(fault, env_of({{fault, "yes"}}));
            }),
            "LMOE_BENCH_INJECT_FAULT='yes': expected 0 or 1");
  EXPECT_EQ(error_message_of([&] {
              lmoe::setting_choice(fault, env_of({{fault, "or"}}));
            }),
            "LMOE_BENCH_INJECT_FAULT='or': expected 0 or 1");
  EXPECT_EQ(lmoe::setting_text("LMOE_TIER_TABLE", env_of({{"LMOE_TIER_TABLE", "t.json"}})),
            "t.json");
  EXPECT_EQ(lmoe::setting_text("LMOE_TIER_TABLE", env_of({{"LMOE_TIER_TABLE", ""}})), std::nullopt);
}

TEST(SettingsWarnings, UnknownNamesAreWarnedOfWithTheClosestKnownName) {
  EXPECT_EQ(lmoe::closest_setting_name("LMOE_P2P_TIMEOUT"), "LMOE_P2P_TIMEOUT_MS");
  EXPECT_EQ(lmoe::closest_setting_name("LMOE_FUSED_DECOD"), "LMOE_FUSED_DECODE");
  EXPECT_EQ(lmoe::closest_setting_name("LMOE_TEIR"), "LMOE_TIER");
  EXPECT_EQ(lmoe::closest_setting_name("LMOE_QQQQQQQQQQQQQQQQ"), std::nullopt);
  EXPECT_EQ(lmoe::unknown_setting_warnings(
                {"LMOE_TIER", "LMOE_P2P_TIMEOUT", "NCCL_ALGO", "LMOE_QQQQQQQQQQQQQQQQ"}),
            (std::vector<std::string>{
                "LMOE_P2P_TIMEOUT is not a setting lmoe reads (did you mean LMOE_P2P_TIMEOUT_MS?)",
                "LMOE_QQQQQQQQQQQQQQQQ is not a setting lmoe reads"}));
  setenv("LMOE_SETTINGS_TEST_NAME", "1", 1);
  EXPECT_THAT(lmoe::environment_lmoe_names(), ::testing::Contains("LMOE_SETTINGS_TEST_NAME"));
  unsetenv("LMOE_SETTINGS_TEST_NAME");
  EXPECT_THAT(lmoe::environment_lmoe_names(),
              ::testing::Not(::testing::Contains("LMOE_SETTINGS_TEST_NAME")));
}

}  // namespace

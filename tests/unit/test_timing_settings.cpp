// The timing settings a measurement records (lmoe/timing_settings.hpp): read from the environment
// (set and non-empty variables of the list only), shown as text, and compared.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "lmoe/timing_settings.hpp"

namespace {

TEST(TimingSettings, TheEnvironmentsSetVariablesOfTheListOnly) {
  for (const char* name : lmoe::timing_setting_names()) unsetenv(name);
  EXPECT_TRUE(lmoe::timing_settings_from_environment().empty());
  setenv("LMOE_FUSED_DECODE", "1", 1);
  setenv("NCCL_ALGO", "Ring", 1);
  setenv("NCCL_PROTO", "", 1);              // empty: not set
  setenv("LMOE_FUSED_MAX_TOKENS", "8", 1);  // a policy variable, not a timing setting
  const lmoe::TimingSettings settings = lmoe::timing_settings_from_environment();
  EXPECT_EQ(settings, (lmoe::TimingSettings{{"LMOE_FUSED_DECODE", "1"}, {"NCCL_ALGO", "Ring"}}));
  EXPECT_EQ(lmoe::timing_settings_text(settings), "LMOE_FUSED_DECODE=1 NCCL_ALGO=Ring");
  EXPECT_EQ(lmoe::timing_settings_text({}), "");
  for (const char* name : {"LMOE_FUSED_DECODE", "NCCL_ALGO", "NCCL_PROTO", "LMOE_FUSED_MAX_TOKENS"})
    unsetenv(name);
}

TEST(TimingSettings, DifferencesNameEachVariableWithBothValuesInNameOrder) {
  const lmoe::TimingSettings table{{"LMOE_FUSED_DECODE", "1"}, {"NCCL_ALGO", "Ring"}};
  const lmoe::TimingSettings here{{"NCCL_ALGO", "Tree"}, {"LMOE_TOKEN_CHUNKS", "2"}};
  EXPECT_EQ(lmoe::timing_settings_differences(table, here, "the table", "here"),
            (std::vector<std::string>{"LMOE_FUSED_DECODE is '1' in the table, unset here",
                                      "LMOE_TOKEN_CHUNKS is unset in the table, '2' here",
                                      "NCCL_ALGO is 'Ring' in the table, 'Tree' here"}));
  EXPECT_TRUE(lmoe::timing_settings_differences(table, table, "a", "b").empty());
}

}  // namespace

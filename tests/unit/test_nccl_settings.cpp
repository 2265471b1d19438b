// The refusal of T read on the device over NCCL (src/comm/nccl_settings.hpp): it follows the value
// NCCL read, not the environment, and names the variable, the value and what to do.
#include <gtest/gtest.h>

#include <optional>
#include <string>

#include "cuda/comm/nccl_settings.hpp"

TEST(NcclSettings, DeviceTokensRunOnlyWhenNcclReadGraphMixingZero) {
  EXPECT_FALSE(lmoe::nccl_device_tokens_refusal(std::string("0")).has_value());
  for (const std::optional<std::string>& read :
       {std::optional<std::string>("1"), std::optional<std::string>(),
        std::optional<std::string>("yes")}) {
    const std::optional<std::string> why = lmoe::nccl_device_tokens_refusal(read);
    ASSERT_TRUE(why.has_value());
    EXPECT_NE(why->find("NCCL_GRAPH_MIXING_SUPPORT=" + (read ? *read : std::string("unknown"))),
              std::string::npos)
        << *why;
    EXPECT_NE(why->find("once per process"), std::string::npos) << *why;
  }
}

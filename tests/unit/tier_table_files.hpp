// What the tier policy and tier tuning tests share: a fake environment, the running configuration
// of a table, and a fixture that writes tier tables into a directory of its own and removes it
// afterwards.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>

#include "lmoe/tier_policy.hpp"
#include "lmoe/tools/tier_tuning.hpp"

namespace lmoe_test {

inline lmoe::EnvLookup fake_env(std::map<std::string, std::string> values) {
  return [values = std::move(values)](const std::string& name) -> std::optional<std::string> {
    auto it = values.find(name);
    if (it == values.end()) return std::nullopt;
    return it->second;
  };
}

// The configuration a table was measured for, as a running process would report it.
inline lmoe::RunningConfig running_like(const lmoe::TableProvenance& p) {
  lmoe::RunningConfig running;
  running.backend = p.backend;
  running.gpu = p.gpu;
  running.driver_version = p.driver_version;
  running.nccl_version = p.nccl_version;
  running.tp = p.tp;
  running.dims = p.dims;
  running.dtype = p.dtype;
  running.comm = p.comm;
  running.lmoe_version = p.lmoe_version;
  running.settings = p.settings;
  return running;
}

class TierTableFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = std::filesystem::temp_directory_path() /
           ("lmoe_" + std::string(info->test_suite_name()) + "_" + std::to_string(::getpid()) +
            "_" + info->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string write(const std::string& name, const std::string& text) {
    const std::filesystem::path path = dir_ / name;
    std::ofstream(path, std::ios::binary) << text;
    return path.string();
  }

  std::filesystem::path dir_;
};

}  // namespace lmoe_test

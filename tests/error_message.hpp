// The message a call fails with, for tests that pin what lmoe says when it refuses something.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "lmoe/error.hpp"

namespace lmoe::testing {

// The message of the lmoe::Error that `call` throws; returning normally fails the test (and gives
// "<no error>"), another exception escapes.
template <typename Call>
std::string error_message_of(Call&& call) {
  try {
    std::forward<Call>(call)();
  } catch (const lmoe::Error& error) {
    return error.message();
  }
  ADD_FAILURE() << "no lmoe::Error thrown";
  return "<no error>";
}

}  // namespace lmoe::testing

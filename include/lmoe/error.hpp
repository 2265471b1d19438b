// lmoe::Error: the one exception type the library throws, with the place it came from.
#pragma once

#include <source_location>
#include <stdexcept>
#include <string>

namespace lmoe {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message,
                 std::source_location where = std::source_location::current());
  // The message without the "file:line: " prefix, for messages shown to users and pinned in tests.
  const std::string& message() const noexcept { return message_; }

 private:
  std::string message_;
};

}  // namespace lmoe

// LMOE_CHECK(cond, message-expression): throws lmoe::Error naming the file and line when cond
// fails.
#define LMOE_CHECK(cond, msg)                           \
  do {                                                  \
    if (!(cond)) throw ::lmoe::Error(std::string(msg)); \
  } while (0)

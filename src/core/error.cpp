#include "lmoe/error.hpp"

#include <string>

namespace lmoe {

namespace {
std::string with_place(const std::string& message, const std::source_location& where) {
  std::string file = where.file_name();
  // Keep the path from the project's own folders on so messages read the same on every machine.
  for (const char* root : {"/src/", "/apps/", "/include/", "/tests/"}) {
    if (auto pos = file.rfind(root); pos != std::string::npos) {
      file = file.substr(pos + 1);
      break;
    }
  }
  std::string text;
  text.reserve(file.size() + message.size() + 16);
  text.append(file).append(":").append(std::to_string(where.line())).append(": ").append(message);
  return text;
}
}  // namespace

Error::Error(const std::string& message, std::source_location where)
    : std::runtime_error(with_place(message, where)), message_(message) {}

}  // namespace lmoe

// The error a rank sees when the group it belongs to was aborted (by a peer, or a timeout).
#pragma once

#include <string>

#include "lmoe/error.hpp"

namespace lmoe {

class CommunicatorAborted : public Error {
 public:
  explicit CommunicatorAborted(const std::string& message,
                               std::source_location where = std::source_location::current())
      : Error(message, where) {}
};

}  // namespace lmoe

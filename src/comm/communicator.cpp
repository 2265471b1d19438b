#include "lmoe/communicator.hpp"

#include <cstring>
#include <string>
#include <vector>

#include "lmoe/error.hpp"

namespace lmoe {

void Communicator::control_all_gather(const void* send, void* recv, std::size_t bytes) {
  if (memory_space() != MemorySpace::host) {
    throw Error(std::string(backend_name()) +
                " communicator: control_all_gather needs a host path");
  }
  // Whole bytes as 1-byte elements would need a byte dtype; pad to 4-byte words instead.
  const std::size_t words = (bytes + 3) / 4;
  std::vector<float> mine(words, 0.0f), all(words * static_cast<std::size_t>(size()));
  std::memcpy(mine.data(), send, bytes);
  const std::vector<std::size_t> counts(static_cast<std::size_t>(size()), words);
  all_gather(mine.data(), all.data(), counts, DType::f32);
  for (int r = 0; r < size(); ++r) {
    std::memcpy(static_cast<std::byte*>(recv) + static_cast<std::size_t>(r) * bytes,
                all.data() + static_cast<std::size_t>(r) * words, bytes);
  }
}

}  // namespace lmoe

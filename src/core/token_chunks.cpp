#include "core/token_chunks.hpp"

#include <algorithm>

#include "lmoe/settings.hpp"

namespace lmoe {

int token_chunks_setting_from_environment() {
  const auto chunks = setting_int("LMOE_TOKEN_CHUNKS");
  return chunks ? static_cast<int>(*chunks) : 0;
}

std::int64_t token_chunk_count(std::int64_t tokens, int tp, int setting) {
  if (tp <= 1) return 1;
  const int wanted =
      setting != 0 ? setting : (tokens >= kDefaultTokenChunksFrom ? kDefaultTokenChunks : 1);
  return std::clamp<std::int64_t>(tokens / tp, 1, wanted);
}

}  // namespace lmoe

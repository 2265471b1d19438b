#include "core/token_chunks.hpp"

#include <algorithm>

#include "core/env_flag.hpp"

namespace lmoe {

int token_chunks_setting_from_environment() {
  const auto chunks = env_integer("LMOE_TOKEN_CHUNKS", 1, kMaxTokenChunks, "a count of chunks");
  return chunks ? static_cast<int>(*chunks) : 0;
}

std::int64_t token_chunk_count(std::int64_t tokens, int tp, int setting) {
  if (tp <= 1) return 1;
  const int wanted = setting != 0 ? setting : (tokens >= kDefaultTokenChunksFrom ? kDefaultTokenChunks : 1);
  return std::clamp<std::int64_t>(tokens / tp, 1, wanted);
}

}  // namespace lmoe

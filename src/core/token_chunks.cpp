#include "core/token_chunks.hpp"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "lmoe/error.hpp"

namespace lmoe {

int token_chunks_setting_from_environment() {
  const char* text = std::getenv("LMOE_TOKEN_CHUNKS");
  if (text == nullptr || *text == '\0') return 0;
  // Digits only: strtol alone would also take leading blanks and a sign.
  char* end = nullptr;
  const bool digit_first = *text >= '0' && *text <= '9';
  const long chunks = std::strtol(text, &end, 10);
  LMOE_CHECK(digit_first && *end == '\0' && chunks >= 1 && chunks <= kMaxTokenChunks,
             "LMOE_TOKEN_CHUNKS: expected a count of chunks in [1, " + std::to_string(kMaxTokenChunks) +
                 "], got \"" + text + "\"");
  return static_cast<int>(chunks);
}

std::int64_t token_chunk_count(std::int64_t tokens, int tp, int setting) {
  if (tp <= 1) return 1;
  const int wanted = setting != 0 ? setting : (tokens >= kDefaultTokenChunksFrom ? kDefaultTokenChunks : 1);
  return std::clamp<std::int64_t>(tokens / tp, 1, wanted);
}

}  // namespace lmoe

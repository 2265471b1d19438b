// The token tier's chunk rule (src/core/token_chunks.hpp): the built-in threshold ±1, the clamps
// (one rank, fewer rows per rank than chunks), an explicit setting, and LMOE_TOKEN_CHUNKS read
// strictly.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "core/token_chunks.hpp"
#include "lmoe/error.hpp"

using lmoe::token_chunk_count;

TEST(TokenChunks, TheBuiltInRuleSplitsInTwoFromItsThreshold) {
  constexpr std::int64_t from = lmoe::kDefaultTokenChunksFrom;
  EXPECT_EQ(from, 4096);
  EXPECT_EQ(token_chunk_count(from - 1, 2, 0), 1);
  EXPECT_EQ(token_chunk_count(from, 2, 0), lmoe::kDefaultTokenChunks);
  EXPECT_EQ(token_chunk_count(from + 1, 8, 0), lmoe::kDefaultTokenChunks);
  EXPECT_EQ(token_chunk_count(32768, 8, 0), lmoe::kDefaultTokenChunks);
  EXPECT_EQ(token_chunk_count(1, 2, 0), 1);
  EXPECT_EQ(token_chunk_count(0, 2, 0), 1);
}

TEST(TokenChunks, OneRankOrTooFewRowsPerRankClampTheCount) {
  EXPECT_EQ(token_chunk_count(8192, 1, 0), 1);  // nothing to overlap
  EXPECT_EQ(token_chunk_count(8192, 1, 8), 1);
  // Every chunk gives every rank a row: at most tokens / tp chunks, at least one.
  EXPECT_EQ(token_chunk_count(5, 2, 8), 2);
  EXPECT_EQ(token_chunk_count(16, 2, 8), 8);
  EXPECT_EQ(token_chunk_count(15, 2, 8), 7);
  EXPECT_EQ(token_chunk_count(3, 4, 8), 1);     // fewer rows than ranks: one chunk
  EXPECT_EQ(token_chunk_count(4096, 2, 1), 1);  // an explicit 1 turns the pipeline off
  EXPECT_EQ(token_chunk_count(100, 2, 3), 3);   // an explicit count applies below the threshold too
}

TEST(TokenChunks, TheVariableIsReadStrictlyAndNamedOnError) {
  unsetenv("LMOE_TOKEN_CHUNKS");
  EXPECT_EQ(lmoe::token_chunks_setting_from_environment(), 0);
  setenv("LMOE_TOKEN_CHUNKS", "", 1);
  EXPECT_EQ(lmoe::token_chunks_setting_from_environment(), 0);
  for (int c = 1; c <= lmoe::kMaxTokenChunks; ++c) {
    setenv("LMOE_TOKEN_CHUNKS", std::to_string(c).c_str(), 1);
    EXPECT_EQ(lmoe::token_chunks_setting_from_environment(), c);
  }
  for (const char* bad : {"0", "9", "-1", "+2", "two", "2x", " 2"}) {
    setenv("LMOE_TOKEN_CHUNKS", bad, 1);
    try {
      lmoe::token_chunks_setting_from_environment();
      ADD_FAILURE() << "LMOE_TOKEN_CHUNKS=" << bad << " was accepted";
    } catch (const lmoe::Error& e) {
      EXPECT_NE(
          std::string(e.what()).find("LMOE_TOKEN_CHUNKS: expected a count of chunks in [1, 8]"),
          std::string::npos)
          << e.what();
    }
  }
  unsetenv("LMOE_TOKEN_CHUNKS");
}

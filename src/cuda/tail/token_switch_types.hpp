// What the host sets up for the token switch (cuda/token_switch.hpp) and its selector kernel reads:
// plain, trivially copyable; host and device code.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace lmoe::cuda {

// The most buckets of T one switch holds: powers of two up to max_tokens and the policy's tier
// boundaries stay far below it.
inline constexpr int kMaxTokenBuckets = 64;

// What a replay could not run, in host-mapped memory: the host reads it after the work (the
// selector writes `tokens` first, then `code`).
enum TokenSwitchCode : std::int32_t {
  kTokenSwitchOk = 0,
  kTokenSwitchOutOfRange = 1,  // T < 0 or T > max_tokens: nothing ran
  kTokenSwitchNoTier = 2,      // T falls in a bucket no tier runs: nothing ran
};
struct TokenSwitchStatus {
  volatile std::int32_t code;
  volatile std::int32_t tokens;
};

struct TokenSwitchParams {
  const std::int32_t* tokens = nullptr;  // T, written by the caller before the work runs
  std::int32_t max_tokens = 0;
  int buckets = 0;
  // Bucket i holds T in (bucket_max[i-1], bucket_max[i]] (ascending); runs[i] = 0: no body work.
  std::int32_t bucket_max[kMaxTokenBuckets] = {};
  std::uint8_t runs[kMaxTokenBuckets] = {};
  cudaGraphConditionalHandle handle = 0;  // the switch node's condition: the body index to run
  TokenSwitchStatus* status = nullptr;    // host-mapped
};

// Launches one thread that reads *p.tokens and sets p.handle to the bucket's index (≥ p.buckets
// runs no body: T = 0, or a T it cannot run, which it records in *p.status). Only inside a capture
// that holds the conditional node of p.handle.
cudaError_t launch_token_select(const TokenSwitchParams& p, cudaStream_t stream);

}  // namespace lmoe::cuda

// The token switch's selector (cuda/token_switch_types.hpp): one thread reads T on the device and
// picks the conditional body of its bucket, so a graph captured once serves any T.
#include "cuda/tail/token_switch_types.hpp"

namespace lmoe::cuda {

namespace {

__global__ void token_select_kernel(TokenSwitchParams p) {
  const std::int32_t tokens = *p.tokens;
  unsigned int body = static_cast<unsigned int>(p.buckets);  // no body
  std::int32_t failure = kTokenSwitchOk;
  if (tokens < 0 || tokens > p.max_tokens) {
    failure = kTokenSwitchOutOfRange;
  } else if (tokens > 0) {
    int i = 0;
    while (i + 1 < p.buckets && tokens > p.bucket_max[i]) ++i;
    if (p.runs[i]) {
      body = static_cast<unsigned int>(i);
    } else {
      failure = kTokenSwitchNoTier;
    }
  }
  if (failure != kTokenSwitchOk) {
    // The host reads code only after the work it waits for, and then reads tokens.
    p.status->tokens = tokens;
    __threadfence_system();
    p.status->code = failure;
  }
  cudaGraphSetConditional(p.handle, body);
}

}  // namespace

cudaError_t launch_token_select(const TokenSwitchParams& p, cudaStream_t stream) {
  if (p.buckets < 1 || p.buckets > kMaxTokenBuckets || p.tokens == nullptr || p.status == nullptr) {
    return cudaErrorInvalidValue;
  }
  token_select_kernel<<<1, 1, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace lmoe::cuda

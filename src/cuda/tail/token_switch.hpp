// One CUDA graph for every T: inside a capture, a selector kernel reads T on the device and a
// SWITCH conditional node runs the body of T's bucket (docs/graphs.md). Host code only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>

#include "cuda/tail/token_switch_types.hpp"

namespace lmoe::cuda {

struct TokenSwitchBucket {
  std::int64_t max_tokens = 0;  // the bucket holds T in (previous bucket's max, max_tokens]
  bool runs = false;            // false: no tier runs these T (the body stays empty)
};

// Adds to the graph that `stream` is capturing: the selector, then a switch node with one body per
// bucket, and makes the stream's later captured work depend on the switch. Body i holds what
// capture_body(i, body_stream) issues on body_stream (which captures into it, thread-local mode;
// it must not be `stream` nor take part in another capture). Each body is checked for node types a
// conditional body cannot hold (event, host, allocation nodes): an lmoe::Error names the first one.
// The caller's capture is unusable after an error (end it and drop the graph).
void capture_token_switch(
    cudaStream_t stream, cudaStream_t body_stream, const std::int32_t* tokens_device,
    std::int64_t max_tokens, std::span<const TokenSwitchBucket> buckets, TokenSwitchStatus* status,
    const std::function<void(std::size_t bucket, cudaStream_t body_stream)>& capture_body);

// The first node of `graph` (child graphs included) that a conditional body cannot hold, by kind
// ("an event-wait node"); nullopt when every node may live in one.
std::optional<std::string> node_unfit_for_conditional_body(cudaGraph_t graph);

}  // namespace lmoe::cuda

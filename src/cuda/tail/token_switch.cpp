#include "cuda/tail/token_switch.hpp"

#include <vector>

#include "cuda/runtime/cuda_check.hpp"
#include "lmoe/error.hpp"

#if CUDART_VERSION < 12080
#error "the token switch needs CUDA 12.8 or later (SWITCH conditional nodes)"
#endif

namespace lmoe::cuda {

namespace {

// Conditional bodies may hold kernels, empty nodes, child graphs, memsets, memcopies and
// conditionals (cudaConditionalNodeParams, CUDA 12.8 – 13.0); anything else fails instantiation.
std::optional<std::string> unfit_kind(cudaGraphNodeType type) {
  switch (type) {
    case cudaGraphNodeTypeKernel:
    case cudaGraphNodeTypeMemcpy:
    case cudaGraphNodeTypeMemset:
    case cudaGraphNodeTypeGraph:
    case cudaGraphNodeTypeEmpty:
    case cudaGraphNodeTypeConditional: return std::nullopt;
    case cudaGraphNodeTypeHost: return "a host-function node";
    case cudaGraphNodeTypeWaitEvent: return "an event-wait node";
    case cudaGraphNodeTypeEventRecord: return "an event-record node";
    case cudaGraphNodeTypeExtSemaphoreSignal: return "an external-semaphore signal node";
    case cudaGraphNodeTypeExtSemaphoreWait: return "an external-semaphore wait node";
    case cudaGraphNodeTypeMemAlloc: return "a memory-allocation node";
    case cudaGraphNodeTypeMemFree: return "a memory-free node";
    default: return "a node of type " + std::to_string(static_cast<int>(type));
  }
}

// Ends body_stream's capture whatever happens inside it, so that a failure leaves no stream
// capturing.
class BodyCapture {
 public:
  BodyCapture(cudaStream_t body_stream, cudaGraph_t body) : stream_(body_stream) {
    LMOE_CUDA_CHECK(cudaStreamBeginCaptureToGraph(stream_, body, nullptr, nullptr, 0,
                                                  cudaStreamCaptureModeThreadLocal));
  }
  ~BodyCapture() {
    if (!stream_) return;
    cudaGraph_t ended = nullptr;
    cudaStreamEndCapture(stream_,
                         &ended);  // the body belongs to the switch node: nothing to destroy
    cudaGetLastError();
  }
  BodyCapture(const BodyCapture&) = delete;
  BodyCapture& operator=(const BodyCapture&) = delete;
  void end() {
    cudaGraph_t ended = nullptr;
    const cudaStream_t stream = stream_;
    stream_ = nullptr;
    LMOE_CUDA_CHECK(cudaStreamEndCapture(stream, &ended));
  }

 private:
  cudaStream_t stream_;
};

}  // namespace

std::optional<std::string> node_unfit_for_conditional_body(cudaGraph_t graph) {
  std::size_t count = 0;
  LMOE_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &count));
  std::vector<cudaGraphNode_t> nodes(count);
  if (count) LMOE_CUDA_CHECK(cudaGraphGetNodes(graph, nodes.data(), &count));
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type{};
    LMOE_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
    if (auto kind = unfit_kind(type)) return kind;
    if (type == cudaGraphNodeTypeGraph) {
      cudaGraph_t child = nullptr;
      LMOE_CUDA_CHECK(cudaGraphChildGraphNodeGetGraph(node, &child));
      if (auto kind = node_unfit_for_conditional_body(child)) return kind;
    }
  }
  return std::nullopt;
}

void capture_token_switch(cudaStream_t stream, cudaStream_t body_stream,
                          const std::int32_t* tokens_device, std::int64_t max_tokens,
                          std::span<const TokenSwitchBucket> buckets, TokenSwitchStatus* status,
                          const std::function<void(std::size_t, cudaStream_t)>& capture_body) {
  LMOE_CHECK(!buckets.empty() && buckets.size() <= static_cast<std::size_t>(kMaxTokenBuckets),
             "token switch: " + std::to_string(buckets.size()) + " buckets, expected 1 to " +
                 std::to_string(kMaxTokenBuckets));
  LMOE_CHECK(max_tokens > 0 && max_tokens <= INT32_MAX,
             "token switch: max_tokens=" + std::to_string(max_tokens) + ", expected 1 to 2^31-1");
  LMOE_CHECK(body_stream != stream,
             "token switch: the body stream must not be the capturing stream");
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaGraph_t graph = nullptr;
  LMOE_CUDA_CHECK(
      cudaStreamGetCaptureInfo(stream, &capture, nullptr, &graph, nullptr, nullptr, nullptr));
  LMOE_CHECK(capture == cudaStreamCaptureStatusActive, "token switch: the stream is not capturing");

  for (std::size_t i = 0; i < buckets.size(); ++i) {
    LMOE_CHECK(buckets[i].max_tokens >= 1 && buckets[i].max_tokens <= max_tokens &&
                   (i == 0 || buckets[i].max_tokens > buckets[i - 1].max_tokens),
               "token switch: bucket " + std::to_string(i) +
                   " ends at T=" + std::to_string(buckets[i].max_tokens) +
                   ", expected ascending ends in [1, max_tokens=" + std::to_string(max_tokens) +
                   "]");
  }
  LMOE_CHECK(
      buckets.back().max_tokens == max_tokens,
      "token switch: the last bucket ends at T=" + std::to_string(buckets.back().max_tokens) +
          ", expected max_tokens=" + std::to_string(max_tokens));

  // Every launch sets the condition (the selector always does); the default runs no body.
  const auto none = static_cast<unsigned int>(buckets.size());
  TokenSwitchParams params;
  LMOE_CUDA_CHECK(
      cudaGraphConditionalHandleCreate(&params.handle, graph, none, cudaGraphCondAssignDefault));
  params.tokens = tokens_device;
  params.max_tokens = static_cast<std::int32_t>(max_tokens);
  params.buckets = static_cast<int>(buckets.size());
  params.status = status;
  for (std::size_t i = 0; i < buckets.size(); ++i) {
    params.bucket_max[i] = static_cast<std::int32_t>(buckets[i].max_tokens);
    params.runs[i] = buckets[i].runs ? 1 : 0;
  }
  check(launch_token_select(params, stream), "launch_token_select");

  // The switch goes after the selector (the stream's current dependencies), by hand: stream capture
  // has no call that adds a conditional node.
  const cudaGraphNode_t* dependencies = nullptr;
  const cudaGraphEdgeData* edges = nullptr;
  std::size_t num_dependencies = 0;
  LMOE_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &capture, nullptr, &graph, &dependencies, &edges,
                                           &num_dependencies));
  cudaGraphNodeParams node_params{};
  node_params.type = cudaGraphNodeTypeConditional;
  node_params.conditional.handle = params.handle;
  node_params.conditional.type = cudaGraphCondTypeSwitch;
  node_params.conditional.size = none;
  cudaGraphNode_t node = nullptr;
  LMOE_CUDA_CHECK(
      cudaGraphAddNode(&node, graph, dependencies, edges, num_dependencies, &node_params));
  LMOE_CUDA_CHECK(cudaStreamUpdateCaptureDependencies(stream, &node, nullptr, 1,
                                                      cudaStreamSetCaptureDependencies));
  const cudaGraph_t* bodies = node_params.conditional.phGraph_out;

  for (std::size_t i = 0; i < buckets.size(); ++i) {
    if (!buckets[i].runs) {
      // The selector never picks it; one empty node, so that no body is a graph without nodes.
      cudaGraphNode_t empty = nullptr;
      LMOE_CUDA_CHECK(cudaGraphAddEmptyNode(&empty, bodies[i], nullptr, 0));
      continue;
    }
    BodyCapture body(body_stream, bodies[i]);
    capture_body(i, body_stream);
    body.end();
    if (auto unfit = node_unfit_for_conditional_body(bodies[i])) {
      throw Error("token switch: the body of bucket " + std::to_string(i) +
                  " (T <= " + std::to_string(buckets[i].max_tokens) + ") holds " + *unfit +
                  ", which a CUDA graph conditional body cannot hold");
    }
  }
}

}  // namespace lmoe::cuda

#include "lmoe/tools/layer_runner.hpp"

#include <algorithm>
#include <cstring>

#include "lmoe/comm_group.hpp"
#include "lmoe/error.hpp"

#ifdef LMOE_HAS_CUDA
#include "tools/cuda/cuda_layer_runner.hpp"
#endif

namespace lmoe {

std::vector<LayerInputRun> run_layer_on_threads(
    const LayerOptions& options_in, int tp, const std::function<LayerWeights(int rank)>& weights,
    std::span<const HostTensor> inputs, const LayerRunOptions& run) {
  LMOE_CHECK(tp >= 1, "tp: expected at least 1 rank, got " + std::to_string(tp));
  LMOE_CHECK(!run.graph || options_in.backend == Backend::cuda,
             "graph: CUDA graphs need the cuda backend, got " +
                 std::string(backend_name(options_in.backend)));
  LMOE_CHECK(!run.cold_l2 || run.graph,
             "cold_l2: evicting L2 applies to graph replays only (before eager forwards it would "
             "hide their launch gaps)");
  LayerOptions options = options_in;
  if (run.graph) {
    // Capture needs workspaces for every T at construction; a replay is held to the bits of an
    // eager forward on the same (device) path.
    for (const HostTensor& x : inputs) {
      options.max_tokens = std::max(options.max_tokens, x.shape().empty() ? 0 : x.shape()[0]);
    }
    options.device_experts = true;
  }
  std::vector<LayerInputRun> results(inputs.size());
  for (LayerInputRun& result : results) result.ranks.resize(static_cast<std::size_t>(tp));
  const LayerConfig& config = options.config;

  const auto run_rank = [&](int rank, Communicator& comm) {
#ifdef LMOE_HAS_CUDA
    // Rank 0's GPU before and after every rank has built its layer.
    const bool cuda = options.backend == Backend::cuda;
    std::int64_t in_use = 0;
    if (cuda) {
      comm.barrier();
      if (rank == 0) in_use = device_memory_in_use();
      comm.barrier();
    }
    LatentMoELayer layer(options, comm, weights(rank));
    if (cuda) {
      comm.barrier();
      if (rank == 0) {
        const std::int64_t grown = device_memory_in_use() - in_use;
        for (LayerInputRun& result : results) result.ranks.front().layer_device_bytes = grown;
      }
    }
#else
    LatentMoELayer layer(options, comm, weights(rank));
#endif
#ifdef LMOE_HAS_CUDA
    // Device inputs, the rank's own stream, results copied back: cuda/cuda_layer_runner.cpp.
    if (options.backend == Backend::cuda)
      return run_layer_rank_cuda(layer, comm, inputs, run, results);
#endif
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      const HostTensor& x = inputs[i];
      const std::int64_t tokens = x.shape().empty() ? 0 : x.shape()[0];
      LayerRankResult& mine = results[i].ranks[static_cast<std::size_t>(rank)];
      if (run.keep_partials) {
        mine.routed = HostTensor(options.dtype, {tokens, config.d_latent});
        mine.shared = HostTensor(options.dtype, {tokens, config.d_model});
        mine.routed.fill_bytes(std::byte{0xff});
        mine.shared.fill_bytes(std::byte{0xff});
        layer.forward_partials(x.matrix(), mine.routed.matrix(), mine.shared.matrix());
      }
      mine.y = HostTensor(options.dtype, {tokens, config.d_model});
      for (int warmup = 0; warmup < run.warmup; ++warmup)
        layer.forward(x.matrix(), mine.y.matrix(), run.tier);
      for (int repeat = 0; repeat < std::max(1, run.repeats); ++repeat) {
        mine.y.fill_bytes(std::byte{0xff});  // NaN in every dtype: an unwritten element cannot pass
        comm.barrier();
        mine.tier = layer.forward(x.matrix(), mine.y.matrix(), run.tier);
        mine.times.push_back(layer.last_times());
      }
      if (const Routing* routing = layer.last_routing()) mine.routing = *routing;
    }
  };
  run_comm_group(run.comm.empty() ? default_comm_backend(options.backend) : run.comm, tp, run_rank);

  for (LayerInputRun& result : results) {
    const HostTensor& first = result.ranks.front().y;
    for (const LayerRankResult& rank : result.ranks) {
      if (!same_bits(rank.y, first)) result.ranks_identical = false;
    }
  }
  return results;
}

}  // namespace lmoe

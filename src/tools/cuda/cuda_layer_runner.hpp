// The CUDA half of the layer runner (include/lmoe/layer_runner.hpp): a rank's inputs go to device
// buffers, the layer runs on the rank's own stream, and y (and the partials) come back to the host.
#pragma once

#include <span>
#include <vector>

#include "lmoe/tools/layer_runner.hpp"

namespace lmoe {

// Runs every input through `layer` (a cuda-backend layer of rank `rank`) as run_layer_on_threads
// does on the host, filling results[i].ranks[rank]; with run.graph, as graph replays.
void run_layer_rank_cuda(LatentMoELayer& layer, Communicator& comm,
                         std::span<const HostTensor> inputs, const LayerRunOptions& run,
                         std::vector<LayerInputRun>& results);

// The current device's memory in use (total − free, cudaMemGetInfo), every process's.
std::int64_t device_memory_in_use();

}  // namespace lmoe

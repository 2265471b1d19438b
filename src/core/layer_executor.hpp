// The interface between LatentMoELayer and a backend: everything before the tail, i.e. the router,
// the latent down-projection, the routed experts and the shared experts of one rank.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "lmoe/layer_options.hpp"
#include "lmoe/router.hpp"
#include "lmoe/tensor.hpp"

namespace lmoe {

class LayerExecutor {
 public:
  virtual ~LayerExecutor() = default;
  virtual std::string_view backend_name() const = 0;
  virtual MemorySpace memory_space() const = 0;
  // Inputs are validated by the caller. x [T, d] → this rank's partials: routed [T, l] (its slice
  // of every selected expert, weighted and summed) and shared [T, d]. Fills the router,
  // down_projection, experts and shared entries of `times`.
  virtual void run(ConstMatrixView x, MatrixView routed, MatrixView shared, LayerStageTimes& times,
                   StreamHandle stream) = 0;
  // The last run's routing in host memory, or nullptr where it stays on the device.
  virtual const Routing* host_routing() const { return nullptr; }

  // Why a forward of `tokens` tokens cannot run on `stream` now (e.g. it is being captured into a
  // CUDA graph and the workspaces would have to grow), or nullopt. Asked on every rank before the
  // ranks agree on the call, so that all fail together.
  virtual std::optional<std::string> cannot_run(std::int64_t /*tokens*/, StreamHandle) const {
    return std::nullopt;
  }
  // Buffers of at least `tokens` rows in memory_space() for the partials routed [T, l] and shared
  // [T, d] that forward() hands to the tail; nullopt: host tensors of the caller serve. May wait
  // for `stream` when they grow (where it cannot, e.g. under capture, the next cannot_run says so).
  virtual std::optional<std::pair<MatrixView, MatrixView>> partial_buffers(std::int64_t,
                                                                           StreamHandle) {
    return std::nullopt;
  }
  // Device backends time the tail like their own stages, with events on `stream` around it:
  // begin_tail returns false where the caller should time the tail on the host clock instead.
  virtual bool begin_tail(StreamHandle) { return false; }
  virtual void end_tail(StreamHandle) {}
  // Fills `times` from the last run (and tail) where run() could not: device backends measure with
  // events, known once the device has run them (this waits for them).
  virtual void finish_times(LayerStageTimes&) {}
  // Device backends: forwards captured while `on` also record their stage events as external
  // event nodes, which every replay of the graph records again.
  virtual void set_capture_stage_events(bool /*on*/) {}
  // The stage times of the latest replay of a graph captured with stage events (waits for its
  // events), or nullopt where no forward was captured so.
  virtual std::optional<LayerStageTimes> replay_stage_times() const { return std::nullopt; }
};

}  // namespace lmoe

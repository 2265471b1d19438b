#include "lmoe/comm_group.hpp"

#include <cstdlib>

#include "core/env_flag.hpp"
#include "lmoe/error.hpp"
#include "lmoe/threads_communicator.hpp"

#ifdef LMOE_HAS_CUDA
#include "cuda/cuda_tail_executor.hpp"
#include "lmoe/cuda_communicator.hpp"
#include "lmoe/p2p_communicator.hpp"
#endif
#ifdef LMOE_HAS_NCCL
#include "lmoe/nccl_communicator.hpp"
#endif

namespace lmoe {

namespace {

#ifdef LMOE_HAS_CUDA
bool p2p_shared_gpu_allowed() { return env_flag("LMOE_P2P_SHARED_GPU"); }
#endif

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
}

}  // namespace

std::vector<std::string> comm_backends(Backend backend) {
  switch (backend) {
    case Backend::cpu: return {"threads"};
    case Backend::cuda: {
      std::vector<std::string> names;
#ifdef LMOE_HAS_CUDA
      if (cuda_device_count() > 0) {
        names.push_back("cuda-threads");
        names.push_back("p2p");
      }
#endif
#ifdef LMOE_HAS_NCCL
      if (cuda_device_count() > 0) names.push_back("nccl");
#endif
      return names;
    }
  }
  return {};
}

std::vector<std::string> comm_backends(Backend backend, int num_ranks) {
  std::vector<std::string> names = comm_backends(backend);
  std::erase_if(names, [&](const std::string& name) { return comm_group_limit(name, num_ranks).has_value(); });
  return names;
}

std::optional<std::string> comm_group_limit(std::string_view comm_backend, int num_ranks) {
  (void)comm_backend;  // only GPU communicators have limits
  (void)num_ranks;
#ifdef LMOE_HAS_CUDA
  const int gpus = cuda_device_count();
  if (comm_backend == "nccl" && num_ranks > gpus) {
    return "nccl needs one GPU per rank (" + std::to_string(num_ranks) + " ranks, " + std::to_string(gpus) +
           " GPU(s) visible)";
  }
  if (comm_backend == "p2p" && num_ranks > gpus && !p2p_shared_gpu_allowed()) {
    return "p2p ranks would share a GPU (" + std::to_string(num_ranks) + " ranks, " + std::to_string(gpus) +
           " GPU(s)), where their rounds can stall (docs/p2p.md); set LMOE_P2P_SHARED_GPU=1 to run it anyway";
  }
#endif
  return std::nullopt;
}

ReductionOrder comm_reduction_order(std::string_view comm_backend) {
  return comm_backend == "nccl" ? ReductionOrder::unspecified : ReductionOrder::rank_order;
}

std::string default_comm_backend(Backend backend) {
  const std::vector<std::string> names = comm_backends(backend);
  LMOE_CHECK(!names.empty(), "no communicator can run the " + std::string(backend_name(backend)) +
                                 " backend here (no GPU, or a build without CUDA)");
  return names.front();
}

void run_comm_group(std::string_view comm_backend, int num_ranks,
                    const std::function<void(int, Communicator&)>& fn, std::chrono::milliseconds timeout) {
  if (comm_backend == "threads") return run_on_threads(num_ranks, fn, timeout);
#ifdef LMOE_HAS_CUDA
  if (comm_backend == "cuda-threads") {
    LMOE_CHECK(cuda_device_count() > 0, "comm backend 'cuda-threads' needs a CUDA GPU; none is visible");
    return run_on_cuda_threads(num_ranks, 0, fn, timeout);
  }
  if (comm_backend == "p2p") {
    LMOE_CHECK(cuda_device_count() > 0, "comm backend 'p2p' needs a CUDA GPU; none is visible");
    if (auto limit = comm_group_limit(comm_backend, num_ranks)) throw Error(*limit);
    // Its own device-side bound (P2pOptions::timeout) applies, not the host barrier's.
    return run_on_p2p_threads(num_ranks, fn);
  }
#endif
#ifdef LMOE_HAS_NCCL
  // One rank per GPU: make_nccl_thread_communicators says so when there are too few.
  if (comm_backend == "nccl") return run_on_nccl_threads(num_ranks, {}, fn, timeout);
#endif
  std::vector<std::string> known = comm_backends(Backend::cpu);
  for (const std::string& name : comm_backends(Backend::cuda)) known.push_back(name);
  throw Error("unknown or unavailable comm backend '" + std::string(comm_backend) + "'; available here: " +
              joined(known));
}

}  // namespace lmoe

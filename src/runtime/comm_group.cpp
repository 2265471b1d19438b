#include "lmoe/comm_group.hpp"

#include "lmoe/error.hpp"
#include "runtime/backend_registry.hpp"

namespace lmoe {

namespace {

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
}

}  // namespace

std::vector<std::string> comm_backends(Backend backend) {
  return backend_ops(backend).comm_backends();
}

std::vector<std::string> comm_backends(Backend backend, int num_ranks) {
  std::vector<std::string> names = comm_backends(backend);
  std::erase_if(names, [&](const std::string& name) {
    return comm_group_limit(name, num_ranks).has_value();
  });
  return names;
}

std::optional<std::string> comm_group_limit(std::string_view comm_backend, int num_ranks) {
  for (Backend backend : {Backend::cpu, Backend::cuda}) {
    if (auto limit = backend_ops(backend).comm_group_limit(comm_backend, num_ranks)) return limit;
  }
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
                    const std::function<void(int, Communicator&)>& fn,
                    std::chrono::milliseconds timeout) {
  for (Backend backend : {Backend::cpu, Backend::cuda}) {
    if (backend_ops(backend).run_comm_group(comm_backend, num_ranks, fn, timeout)) return;
  }
  std::vector<std::string> known = comm_backends(Backend::cpu);
  for (const std::string& name : comm_backends(Backend::cuda)) known.push_back(name);
  throw Error("unknown or unavailable comm backend '" + std::string(comm_backend) +
              "'; available here: " + joined(known));
}

}  // namespace lmoe

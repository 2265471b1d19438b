// A host Communicator whose collectives go through a torch.distributed process group (c10d), so
// that lmoe ranks are the group's ranks: blocks are all-gathered as bytes over the group and
// summed on the host in rank order (reduce_in_rank_order), which gives the same bits as the
// project's own host communicators, identically on every rank.
#pragma once

#include <memory>
#include <string>

#include "lmoe/communicator.hpp"

namespace lmoe::python {

// The process group registered under `group_name` (torch.distributed's group_name). Throws
// lmoe::Error when no group has that name.
std::shared_ptr<Communicator> make_c10d_communicator(const std::string& group_name);

}  // namespace lmoe::python

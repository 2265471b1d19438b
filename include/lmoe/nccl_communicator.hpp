// The `nccl` communicator: NCCL collectives on device buffers, one rank per GPU, either as threads
// of one process that drives several GPUs or as one process per GPU (started by mpirun or
// torchrun).
//
// Reductions are NCCL's: any order, each partial sum rounded to the storage dtype. Results are
// identical on every rank but not the contract's rank-order sum bit for bit; they are judged with
// ReductionOrder::unspecified (lmoe/reference.hpp, docs/numerics.md). Collectives run on the
// caller's stream and can be captured in a CUDA graph. No host wait is unbounded: NCCL runs
// nonblocking, and every wait polls its state against a deadline, then aborts the group and throws.
//
// Defined by builds with CUDA and NCCL; the declarations are the same in every build.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "lmoe/communicator.hpp"

namespace lmoe {

// The NCCL this process runs, as NCCL_VERSION_CODE encodes it (22809 for 2.28.9).
int nccl_runtime_version();

// One communicator per rank, rank r on devices[r] (default: device r), all created at once by this
// thread. Errors: a device listed twice or not visible, or more ranks than visible GPUs (NCCL
// cannot put two ranks on one GPU; use cuda-threads for that). `timeout` bounds every host wait
// (creation, barriers, the control path, destruction); past it the group is aborted.
std::vector<std::shared_ptr<Communicator>> make_nccl_thread_communicators(
    int num_ranks, std::span<const int> devices = {},
    std::chrono::milliseconds timeout = std::chrono::seconds(120));

// Runs fn(rank, communicator) on `num_ranks` threads, each made current on its rank's device, and
// joins them; on a rank's error the group is aborted and the first root-cause error is rethrown.
void run_on_nccl_threads(int num_ranks, std::span<const int> devices,
                         const std::function<void(int rank, Communicator& comm)>& fn,
                         std::chrono::milliseconds timeout = std::chrono::seconds(120));

// One process per GPU. Both makers leave the rank's GPU current on the calling thread.
struct NcclProcessOptions {
  // The GPU of this process. Default: LOCAL_RANK (environment bootstrap) or this process's index
  // among the processes of its node (MPI bootstrap).
  std::optional<int> device;
  // Bounds every host wait, as above; also how long ranks wait for the id file.
  std::chrono::milliseconds timeout = std::chrono::seconds(120);
};

// Rank and size from MPI_COMM_WORLD (MPI must be initialized: see MpiSession); rank 0's NCCL id is
// broadcast with MPI, and the host control path (barrier, control_all_gather) uses MPI. Every rank
// throws the same error when any rank cannot use its GPU. Throws in builds without MPI.
std::shared_ptr<Communicator> make_nccl_mpi_communicator(const NcclProcessOptions& options = {});

// Rank and size from RANK, WORLD_SIZE and LOCAL_RANK, as torchrun sets them. With more than one
// rank, LMOE_NCCL_ID_FILE names a file on a filesystem every rank sees: rank 0 writes its NCCL id
// there (atomically) and removes it once every rank has joined; the others wait for it up to the
// timeout. Use a fresh path per launch: a file left by a crashed launch of the same size cannot be
// told from a new one. The host control path goes through NCCL on a small device buffer.
std::shared_ptr<Communicator> make_nccl_env_communicator(const NcclProcessOptions& options = {});

}  // namespace lmoe

// The `p2p` communicator: lmoe's own collectives over a symmetric device workspace, for ranks that
// are host threads of one process, each on a GPU (several ranks may share one GPU; ranks on
// different GPUs reach each other through peer access), or processes of one node, one rank each
// (workspaces exchanged as CUDA IPC handles; docs/p2p.md, "Processes"). Every collective is one or
// more rounds of one small kernel per rank that stages its input into its workspace, signals its
// peers through device flags, waits for them with a bounded spin and reads their workspaces
// directly (docs/p2p.md). Reductions are the contract's rank-order fp32 sums, bit-identical on
// every rank and to the host communicators. No host work per call: the collectives can be captured
// in CUDA graphs.
//
// Ranks that share a GPU spin on each other, so while a collective is in flight no rank may make
// the GPU wait for all of its work (cudaFree, cudaDeviceSynchronize, graph instantiation, ...):
// such a call waits for a peer's round that waits for this rank. Put a barrier() between setup or
// teardown and collectives, give each stream some work before its first collective, keep the
// streams alive in the process fewer than CUDA_DEVICE_MAX_CONNECTIONS, and capture a forward only
// after an eager call of the same T (docs/p2p.md). With one GPU per rank these hazards do not
// arise.
//
// Defined by builds with the CUDA backend (lmoe_cuda); the declarations are the same in every
// build.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

#include "lmoe/communicator.hpp"

namespace lmoe {

struct P2pOptions {
  // devices[r] is rank r's GPU; empty: ranks spread round-robin over the visible GPUs (of the node,
  // for processes).
  std::vector<int> devices;
  // Bytes a rank stages per round, split evenly over the blocks (at least 256 per block; two
  // parities); larger collectives take several rounds. 0: the default (32 MiB).
  std::size_t round_bytes = 0;
  // Blocks per round kernel (1 … 32); 0: 32 when every rank has its own GPU, else 16 (ranks that
  // share a GPU spin on each other, so their kernels must all be resident at once).
  int blocks = 0;
  // How long a round waits for a peer before it fails, on the device; also the host barrier's
  // bound. A rank that times out aborts the group, so its peers fail at once. 0: the default,
  // 10 s, or LMOE_P2P_TIMEOUT_MS from the environment.
  std::chrono::milliseconds timeout{0};
};

// One communicator per rank. Throws lmoe::Error when a GPU cannot reach another's memory.
std::vector<std::shared_ptr<Communicator>> make_p2p_thread_communicators(
    int num_ranks, const P2pOptions& options = {});

// Runs fn(rank, communicator) on `num_ranks` threads (each made current on its rank's GPU) and
// joins them; on a rank's error the group is aborted and the first root-cause error is rethrown.
void run_on_p2p_threads(int num_ranks, const std::function<void(int rank, Communicator& comm)>& fn,
                        const P2pOptions& options = {});

// One rank per process, every process on one node (CUDA IPC). Collective over `bootstrap`, any
// communicator whose control_all_gather reaches every process (make_mpi_communicator() under
// mpirun): it gives rank and size and carries the setup's first two exchanges; from then on the
// group's own host path (POSIX shared memory) serves barrier() and control_all_gather(), bounded by
// the timeout, and the bootstrap may be destroyed. The GPU of this process: options.devices[rank]
// when devices is given (one entry per rank), else its index among the processes of its node,
// round-robin over the visible GPUs. Ranks on one GPU need LMOE_P2P_SHARED_GPU=1 on every rank.
// When any rank cannot join (another node, a GPU not visible, no peer access, an IPC call failing)
// every rank throws the same lmoe::Error, naming that rank. Destroying the communicator is
// collective too: every rank closes its peers' mappings before any frees its own memory.
std::shared_ptr<Communicator> make_p2p_process_communicator(Communicator& bootstrap,
                                                            const P2pOptions& options = {});

// make_p2p_process_communicator for processes started without MPI (torchrun and the like): rank
// and size from RANK and WORLD_SIZE; with more than one rank, LMOE_P2P_ID_FILE names a fresh path
// on this node where rank 0 writes the name of a shared-memory segment the others open (they wait
// for it up to max(timeout, 120 s)); rank 0 removes it once setup is over. The GPU: as above (on
// one node, a process's index among the processes of its node is its LOCAL_RANK under torchrun).
std::shared_ptr<Communicator> make_p2p_env_communicator(const P2pOptions& options = {});

// make_p2p_process_communicator bootstrapped by MPI_COMM_WORLD (MPI must be initialized: see
// MpiSession). Throws in builds without MPI.
std::shared_ptr<Communicator> make_p2p_mpi_communicator(const P2pOptions& options = {});

}  // namespace lmoe

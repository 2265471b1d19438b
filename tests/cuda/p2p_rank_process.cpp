// One rank of a p2p group of processes started the way torchrun starts them (RANK, WORLD_SIZE,
// LOCAL_RANK and LMOE_P2P_ID_FILE set by the launcher), for the test that kills one rank while
// its peers wait on it (test_p2p_killed_rank.cpp). It runs all_reduces of several rounds back to
// back until one fails, and says on stdout how many completed and the error it got; the rank told
// to die raises SIGKILL on itself before its collective number DIE_AT, or right after issuing it
// (its rounds then in flight). Destroying the communicator afterwards is collective and bounded
// by the timeout: the process must exit even though a peer never comes.
//
// Usage: lmoe_p2p_rank_process survive|die-before|die-during DIE_AT TIMEOUT_MS
// Exit status: 10 after an lmoe::Error (its message on the line "error: ..."), 0 when every
// collective completed, 11 after another exception, 12 when setup failed, 2 for bad arguments.
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>

#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "cuda/runtime/owned_stream.hpp"
#include "lmoe/communicator.hpp"
#include "lmoe/error.hpp"
#include "lmoe/p2p_communicator.hpp"

namespace {

enum class Role { survive, die_before, die_during };

constexpr int kCollectives = 1000;        // far more than a survivor completes once a peer is gone
constexpr std::size_t kElements = 32768;  // bf16: 64 KiB, 16 rounds of 4 KiB

// Runs the collectives, counting those that completed in `completed`; throws what failed.
void run_collectives(lmoe::Communicator& comm, Role role, int die_at, int& completed) {
  const lmoe::cuda::DeviceBuffer buffer(kElements * 2);
  const lmoe::cuda::OwnedStream stream;
  LMOE_CUDA_CHECK(cudaMemsetAsync(buffer.data(), 0, buffer.bytes(), stream.get()));  // first work
  LMOE_CUDA_CHECK(cudaDeviceSynchronize());
  comm.barrier();  // setup done everywhere before any rank spins
  for (int i = 0; i < kCollectives; ++i) {
    if (i == die_at && role == Role::die_before) ::raise(SIGKILL);
    comm.all_reduce(buffer.data(), buffer.data(), kElements, lmoe::DType::bf16, stream.get());
    if (i == die_at && role == Role::die_during) ::raise(SIGKILL);
    LMOE_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    ++completed;
  }
  comm.barrier();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s survive|die-before|die-during DIE_AT TIMEOUT_MS\n", argv[0]);
    return 2;
  }
  const std::string role_name = argv[1];
  const Role role = role_name == "die-before"   ? Role::die_before
                    : role_name == "die-during" ? Role::die_during
                                                : Role::survive;
  const int die_at = std::atoi(argv[2]);
  lmoe::P2pOptions options;
  options.timeout = std::chrono::milliseconds(std::atol(argv[3]));
  options.round_bytes = 4096;  // 4 blocks of 1 KiB: each collective takes 16 rounds
  options.blocks = 4;
  std::shared_ptr<lmoe::Communicator> comm;
  try {
    comm = lmoe::make_p2p_env_communicator(options);
  } catch (const std::exception& error) {
    std::printf("setup failed: %s\n", error.what());
    return 12;
  }
  int completed = 0, status = 0;
  try {
    run_collectives(*comm, role, die_at, completed);
  } catch (const lmoe::Error& error) {
    std::printf("error: %s\n", error.message().c_str());
    status = 10;
  } catch (const std::exception& error) {
    std::printf("other exception: %s\n", error.what());
    status = 11;
  }
  std::printf("collectives completed: %d\n", completed);
  std::fflush(stdout);
  comm.reset();
  std::printf("teardown: done\n");
  return status;
}

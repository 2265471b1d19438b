// The `p2p` communicator with one process per rank, under `mpirun -n N` (make_p2p_mpi_communicator,
// and make_p2p_env_communicator with the torchrun variables set from MPI's: workspaces exchanged as
// CUDA IPC handles, status and control in shared memory). The collectives
// bit for bit against the rank-order sum (one round and many rounds, unequal blocks, in place);
// every tier against the contract, crafted exact inputs bit for bit, results identical on every
// rank, eager and as a captured graph replayed; a stalled rank making every other rank fail within
// the timeout, an abort ending a peer's wait within a bound, ranks issuing different collectives
// failing alike, a bad input failing every rank alike, and setup refusing what it cannot do
// (ranks whose layouts differ, a device not visible). Skips (every rank) without a GPU, and when
// the processes of a node outnumber its GPUs unless LMOE_P2P_SHARED_GPU=1.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <thread>

#include "core/host_math.hpp"
#include "core/rank_order_reduce.hpp"
#include "cuda/gpu_test_support.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "cuda/tail/cuda_tail_executor.hpp"
#include "lmoe/error.hpp"
#include "lmoe/mpi_communicator.hpp"
#include "lmoe/p2p_communicator.hpp"
#include "lmoe/reference.hpp"
#include "lmoe/tools/tail_runner.hpp"
#include "mpi/mpi_gpu_test_support.hpp"

namespace {

using lmoe::DType;
using lmoe::TailTier;
using lmoe::cuda::DeviceBuffer;

const lmoe::TailDims kSmall{384, 192};  // d divisible by 8·tp (fused) for tp ∈ {1, 2, 3, 4, 6, 8}
std::string g_skip;                     // non-empty: why every test skips

class P2pProcesses : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!g_skip.empty()) GTEST_SKIP() << g_skip;
  }
};

// Setup bootstrapped by MPI (make_p2p_mpi_communicator) or by the torchrun variables and a launch
// record file (make_p2p_env_communicator; the variables are set from MPI's in main()).
enum class Bootstrap { mpi, env };
class P2pProcessesBootstrap : public P2pProcesses,
                              public ::testing::WithParamInterface<Bootstrap> {};

std::shared_ptr<lmoe::Communicator> make(Bootstrap bootstrap,
                                         const lmoe::P2pOptions& options = {}) {
  if (bootstrap == Bootstrap::mpi) return lmoe::make_p2p_mpi_communicator(options);
  // A fresh record path for every group, chosen by rank 0 (a record left by an earlier group would
  // name a segment that is gone).
  static int groups = 0;
  char path[256] = {};
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0)
    std::snprintf(path, sizeof(path), "/tmp/lmoe-p2p-id-%d-%d", static_cast<int>(::getpid()),
                  groups);
  ++groups;
  MPI_Bcast(path, sizeof(path), MPI_CHAR, 0, MPI_COMM_WORLD);
  setenv("LMOE_P2P_ID_FILE", path, 1);
  return lmoe::make_p2p_env_communicator(options);
}

using mpi_test::on_every_rank;

// What setup left behind on rank 0's side of the node: shared-memory segments it named and launch
// records (both carry rank 0's pid). Empty once setup has ended, whichever way.
std::vector<std::string> leftovers() {
  int pid = static_cast<int>(::getpid());
  MPI_Bcast(&pid, 1, MPI_INT, 0, MPI_COMM_WORLD);
  std::vector<std::string> found;
  for (const auto& [folder, prefix] :
       {std::pair{"/dev/shm", "lmoe-p2p-"}, std::pair{"/tmp", "lmoe-p2p-id-"}}) {
    std::error_code error;
    for (const auto& entry : std::filesystem::directory_iterator(folder, error)) {
      const std::string name = entry.path().filename().string();
      if (name.rfind(prefix + std::to_string(pid) + "-", 0) == 0)
        found.push_back(entry.path().string());
    }
  }
  return found;
}

int world_size() {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

// Random inputs (rounding depends on the order of the sum, so only the rank-order sum matches bit
// for bit), uneven blocks with one rank owning none, odd counts; with tiny rounds (4 blocks of 256
// bytes) every collective spans many rounds.
void check_collectives(Bootstrap bootstrap, const lmoe::P2pOptions& options) {
  auto comm = make(bootstrap, options);
  const int tp = comm->size(), rank = comm->rank();
  EXPECT_EQ(leftovers(), std::vector<std::string>{});  // names removed once every rank has opened
  EXPECT_EQ(comm->backend_name(), "p2p");
  EXPECT_TRUE(comm->graph_capturable());
  cudaStream_t stream = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (DType dtype : {DType::bf16, DType::f32}) {
    SCOPED_TRACE(std::string(lmoe::dtype_name(dtype)));
    const std::size_t esize = lmoe::dtype_size(dtype);
    std::vector<std::size_t> counts;
    for (int r = 0; r < tp; ++r)
      counts.push_back(r == 1 ? 0 : 1000 + 37 * static_cast<std::size_t>(r));
    std::size_t total = 0, first = 0;
    for (int r = 0; r < tp; ++r) {
      if (r < rank) first += counts[r];
      total += counts[r];
    }
    std::vector<std::vector<std::byte>> inputs;
    std::vector<const void*> pointers;
    for (int r = 0; r < tp; ++r)
      inputs.push_back(random_values(total, dtype, 77 + static_cast<std::uint64_t>(r)));
    for (const auto& input : inputs) pointers.push_back(input.data());
    std::vector<std::byte> expected(total * esize);
    lmoe::reduce_in_rank_order(pointers, expected.data(), total, dtype);

    const std::size_t mine = counts[static_cast<std::size_t>(rank)] * esize;
    const DeviceBuffer send(total * esize), reduced(total * esize),
        block(std::max<std::size_t>(mine, 16)), gathered(total * esize), in_place(total * esize);
    cuda_ok(cudaMemcpy(send.data(), inputs[rank].data(), total * esize, cudaMemcpyHostToDevice));
    cuda_ok(cudaMemsetAsync(reduced.data(), 0xff, total * esize, stream));
    cuda_ok(cudaMemsetAsync(gathered.data(), 0xff, total * esize, stream));
    cuda_ok(cudaMemsetAsync(in_place.data(), 0xff, total * esize, stream));
    // No allocation or synchronous copy while a peer spins (ranks may share a GPU): set up, then
    // meet.
    cuda_ok(cudaDeviceSynchronize());
    comm->barrier();
    comm->all_reduce(send.data(), reduced.data(), total, dtype, stream);
    comm->reduce_scatter(send.data(), block.data(), counts, dtype, stream);
    comm->all_gather(block.data(), gathered.data(), counts, dtype, stream);
    // In place: this rank's block of the output is the send buffer.
    cuda_ok(cudaMemcpyAsync(in_place.at(first * esize), block.data(), mine,
                            cudaMemcpyDeviceToDevice, stream));
    comm->all_gather(in_place.at(first * esize), in_place.data(), counts, dtype, stream);
    cuda_ok(cudaStreamSynchronize(stream));
    comm->barrier();
    std::vector<std::byte> got(total * esize), got_block(mine), got_gathered(total * esize),
        got_in_place(total * esize);
    cuda_ok(cudaMemcpy(got.data(), reduced.data(), got.size(), cudaMemcpyDeviceToHost));
    cuda_ok(cudaMemcpy(got_gathered.data(), gathered.data(), got.size(), cudaMemcpyDeviceToHost));
    cuda_ok(cudaMemcpy(got_in_place.data(), in_place.data(), got.size(), cudaMemcpyDeviceToHost));
    if (mine) cuda_ok(cudaMemcpy(got_block.data(), block.data(), mine, cudaMemcpyDeviceToHost));
    EXPECT_EQ(got, expected) << "all_reduce, rank " << rank;
    EXPECT_EQ(0, std::memcmp(got_block.data(), expected.data() + first * esize, mine))
        << "reduce_scatter, rank " << rank;
    EXPECT_EQ(got_gathered, expected) << "all_gather, rank " << rank;
    EXPECT_EQ(got_in_place, expected) << "all_gather in place, rank " << rank;
  }
  cuda_ok(cudaStreamDestroy(stream));
}

TEST_P(P2pProcessesBootstrap, CollectivesMatchTheRankOrderSumBitForBit) {
  check_collectives(GetParam(), {});
}

TEST_P(P2pProcessesBootstrap, CollectivesSpanningManyRoundsMatchTheRankOrderSumBitForBit) {
  lmoe::P2pOptions options;
  options.round_bytes = 1024;
  options.blocks = 4;
  check_collectives(GetParam(), options);
}

// Every tier (fused included: its kernel reads the peers' workspaces through their IPC mappings),
// eager and as a captured forward replayed twice with the inputs copied in again and the output
// poisoned before each replay.
TEST_F(P2pProcesses, EveryTierMeetsItsContractEagerAndCaptured) {
  auto comm = lmoe::make_p2p_mpi_communicator();
  const int tp = comm->size();
  for (std::int64_t tokens :
       {std::int64_t{1}, std::int64_t{tp + 1}, std::int64_t{129}, std::int64_t{300}}) {
    const lmoe::TailCase random = lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, tp, tokens,
                                                         42u + static_cast<std::uint64_t>(tokens));
    const lmoe::TailCase exact = lmoe::make_exact_case(kSmall, DType::bf16, tp, tokens,
                                                       9u + static_cast<std::uint64_t>(tokens));
    for (TailTier tier : lmoe::kAllTiers) {
      for (bool graph : {false, true}) {
        SCOPED_TRACE(std::string(lmoe::tier_name(tier)) + " T=" + std::to_string(tokens) +
                     (graph ? " graph" : " eager"));
        lmoe::RunOptions options;
        options.backend = lmoe::Backend::cuda;
        options.tier = tier;
        options.graph = graph;
        options.repeats = graph ? 2 : 1;
        // Declined on every rank (checked eagerly): token with fewer rows than ranks, fused above
        // its 256 rows.
        if ((tier == TailTier::token && tokens < tp) || (tier == TailTier::fused && tokens > 256)) {
          if (!graph) {
            EXPECT_THROW(lmoe::run_case_rank(random, *comm, options), lmoe::Error);
          }
          continue;
        }
        mpi_test::expect_contract(*comm, random, exact, options, lmoe::ReductionOrder::rank_order);
      }
    }
  }
}

// A rank that never issues the collective and stays away (busy elsewhere) past the timeout: its
// peers' rounds time out on the device, and every rank, the stalled one included (its barrier is
// aborted by the others), gets an error naming it. (Were the stalled rank to enter the barrier at
// once, its own host wait for the peer stuck in the collective would race the kernels' timeout,
// and either could report first.)
TEST_F(P2pProcesses, AStalledRankFailsEveryRankWithinTheTimeout) {
  if (world_size() < 2) GTEST_SKIP() << "needs 2 ranks";
  lmoe::P2pOptions options;
  options.timeout = std::chrono::milliseconds(500);
  auto comm = lmoe::make_p2p_mpi_communicator(options);
  const int stalled = comm->size() - 1;
  const DeviceBuffer buffer(4096 * 2);
  cuda_ok(cudaDeviceSynchronize());
  const auto start = std::chrono::steady_clock::now();
  std::string message;
  try {
    comm->barrier();
    if (comm->rank() != stalled) {
      comm->all_reduce(buffer.data(), buffer.data(), 4096, DType::bf16, cudaStreamPerThread);
    } else {
      std::this_thread::sleep_for(3 * options.timeout);
    }
    cuda_ok(cudaStreamSynchronize(cudaStreamPerThread));
    comm->barrier();
  } catch (const lmoe::Error& error) {
    message = error.message();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("[ p2p    ] rank %d: stalled rank detected after %.2f s: %s\n", comm->rank(), seconds,
              message.c_str());
  EXPECT_TRUE(
      on_every_rank(message.find("for rank " + std::to_string(stalled)) != std::string::npos))
      << "rank " << comm->rank() << ": " << message;
  EXPECT_THROW(comm->barrier(), lmoe::Error);  // the group stays failed
}

// A rank aborts while its peer's round spins with a long timeout: the abort, not the timeout, ends
// the wait, well within the timeout, and the peer's error says that the group was aborted while it
// waited; the aborting rank's next call fails too.
TEST_F(P2pProcesses, AnAbortEndsAPeersWait) {
  if (world_size() < 2) GTEST_SKIP() << "needs 2 ranks";
  lmoe::P2pOptions options;
  options.timeout = std::chrono::seconds(30);
  constexpr double kBoundSeconds = 10.0;  // the abort comes after 0.3 s; the timeout after 30
  auto comm = lmoe::make_p2p_mpi_communicator(options);
  const DeviceBuffer buffer(256 * 4);
  cuda_ok(cudaDeviceSynchronize());
  comm->barrier();
  const auto start = std::chrono::steady_clock::now();
  std::string message;
  bool ok = false;
  if (comm->rank() == 0) {
    try {
      comm->all_reduce(buffer.data(), buffer.data(), 256, DType::f32, cudaStreamPerThread);
      cuda_ok(cudaStreamSynchronize(cudaStreamPerThread));
      comm->barrier();
    } catch (const lmoe::Error& error) {
      message = error.message();
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // (LMOE_P2P_DIAGNOSE appends every rank's progress.)
    ok = message.rfind("barrier: p2p: the group was aborted while rank 0 was waiting", 0) == 0 &&
         seconds < kBoundSeconds;
    std::printf("[ p2p    ] rank 0: the wait ended after %.2f s: %s\n", seconds, message.c_str());
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    comm->abort("test abort");
    try {
      comm->barrier();
    } catch (const lmoe::Error& error) {
      message = error.message();
    }
    ok = message.find("aborted") != std::string::npos;
  }
  EXPECT_TRUE(on_every_rank(ok)) << "rank " << comm->rank() << ": " << message;
}

// Ranks that issue different collectives (another order here) fail, every one of them, with an
// error naming both ranks' collectives, instead of pairing rounds of two collectives.
TEST_F(P2pProcesses, RanksRunningDifferentCollectivesFailNamingBoth) {
  if (world_size() < 2) GTEST_SKIP() << "needs 2 ranks";
  auto comm = lmoe::make_p2p_mpi_communicator();
  const int tp = comm->size();
  const std::vector<std::size_t> counts(static_cast<std::size_t>(tp), 4096);
  const std::size_t total = 4096 * static_cast<std::size_t>(tp);
  const DeviceBuffer send(total * 2), recv(total * 2);
  cudaStream_t stream = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cuda_ok(cudaMemsetAsync(recv.data(), 0, total * 2, stream));  // the stream's first work
  cuda_ok(cudaDeviceSynchronize());
  comm->barrier();
  std::string message;
  try {
    // Rank 0: all_reduce, then all_gather; every other rank the reverse.
    for (int call = 0; call < 2; ++call) {
      if ((call == 0) == (comm->rank() == 0)) {
        comm->all_reduce(send.data(), recv.data(), total, DType::bf16, stream);
      } else {
        comm->all_gather(send.data(), recv.data(), counts, DType::bf16, stream);
      }
    }
    cuda_ok(cudaStreamSynchronize(stream));
    comm->barrier();
  } catch (const lmoe::Error& error) {
    message = error.message();
  }
  cuda_ok(cudaStreamDestroy(stream));
  const std::string all_reduce = "ran all_reduce of " + std::to_string(total) + " bf16 elements",
                    all_gather = "ran all_gather of " + std::to_string(total) + " bf16 elements";
  EXPECT_TRUE(
      on_every_rank(message.find(all_reduce) != std::string::npos &&
                    message.find(all_gather) != std::string::npos &&
                    message.find(" in the same round (round 1, block ") != std::string::npos))
      << "rank " << comm->rank() << ": " << message;
}

TEST_F(P2pProcesses, BadInputOnOneRankFailsEveryRankAlike) {
  auto comm = lmoe::make_p2p_mpi_communicator();
  EXPECT_EQ(
      mpi_test::bad_output_shape_error(*comm, kSmall),
      "rank " + std::to_string(comm->size() - 1) + ": out: expected shape [4, 384], got [3, 384]");
}

// Setup refuses, on every rank alike and naming the rank, a device that is not visible.
TEST_P(P2pProcessesBootstrap, ABadDeviceOnOneRankFailsSetupOnEveryRank) {
  const int size = world_size();
  lmoe::P2pOptions options;
  for (int r = 0; r < size; ++r) options.devices.push_back(r == size - 1 ? 1000 : 0);
  std::string message;
  try {
    make(GetParam(), options);
  } catch (const lmoe::Error& error) {
    message = error.message();
  }
  const int visible = lmoe::cuda_device_count();
  EXPECT_EQ(message, "p2p: rank " + std::to_string(size - 1) + ": device 1000 is not visible (" +
                         std::to_string(visible) + " GPUs)");
}

// Ranks whose options give different layouts (grids, regions, timeouts) are refused before any
// workspace is sized, on every rank alike, naming each field and every rank's value; so are options
// that give no layout on one rank.
TEST_P(P2pProcessesBootstrap, RanksWithDifferentLayoutsFailSetupOnEveryRankAlike) {
  const int size = world_size();
  if (size < 2) GTEST_SKIP() << "needs 2 ranks";
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const bool last = rank == size - 1;
  // The values of rank r in the message: "a on rank 0, a on rank 1 and b on rank 2".
  const auto every_rank = [&](const std::string& others, const std::string& last_rank) {
    std::string text;
    for (int r = 0; r < size; ++r) {
      text += r == 0 ? " " : (r + 1 == size ? " and " : ", ");
      text += (r == size - 1 ? last_rank : others) + " on rank " + std::to_string(r);
    }
    return text;
  };
  lmoe::P2pOptions options;
  options.timeout = std::chrono::milliseconds(10000);
  options.round_bytes = std::size_t{1} << 20;
  options.blocks = last ? 8 : 4;
  std::string message;
  try {
    make(GetParam(), options);
  } catch (const lmoe::Error& error) {
    message = error.message();
  }
  EXPECT_EQ(message, "p2p: ranks disagree on the group's layout: blocks is" + every_rank("4", "8") +
                         " (set P2pOptions::blocks alike on every rank); block_bytes is" +
                         every_rank("262144", "131072") +
                         " (round_bytes / blocks: set P2pOptions::round_bytes and blocks alike "
                         "on every rank)");
  EXPECT_TRUE(mpi_test::alike_on_every_rank(message)) << message;

  options.blocks = 4;
  options.timeout = std::chrono::milliseconds(last ? 2000 : 10000);
  message.clear();
  try {
    make(GetParam(), options);
  } catch (const lmoe::Error& error) {
    message = error.message();
  }
  EXPECT_EQ(message, "p2p: ranks disagree on the group's layout: timeout is" +
                         every_rank("10000 ms", "2000 ms") +
                         " (set P2pOptions::timeout, or LMOE_P2P_TIMEOUT_MS, alike on every rank)");
  EXPECT_TRUE(mpi_test::alike_on_every_rank(message)) << message;

  // Options that give no layout on one rank: every rank fails alike rather than waiting for it.
  options.timeout = std::chrono::milliseconds(10000);
  options.blocks = last ? 40 : 4;
  message.clear();
  try {
    make(GetParam(), options);
  } catch (const lmoe::Error& error) {
    message = error.message();
  }
  EXPECT_EQ(message,
            "p2p: rank " + std::to_string(size - 1) + ": blocks must be in [1, 32], got 40");
  EXPECT_TRUE(mpi_test::alike_on_every_rank(message)) << message;
  MPI_Barrier(MPI_COMM_WORLD);  // every rank's setup has ended
  EXPECT_EQ(leftovers(), std::vector<std::string>{});
}

INSTANTIATE_TEST_SUITE_P(Bootstrap, P2pProcessesBootstrap,
                         ::testing::Values(Bootstrap::mpi, Bootstrap::env), [](const auto& info) {
                           return info.param == Bootstrap::mpi ? "mpi" : "env";
                         });

// Where no GPU is visible, setup still runs its bootstrap and shared-memory steps and then fails on
// every rank with the same error, naming rank 0 (whose GPU lookup failed first).
class P2pProcessesWithoutGpu : public ::testing::TestWithParam<Bootstrap> {};

TEST_P(P2pProcessesWithoutGpu, SetupFailsOnEveryRankAlike) {
  if (lmoe::cuda_device_count() > 0)
    GTEST_SKIP() << "a GPU is visible (the fixture's tests run instead)";
  std::string message;
  try {
    make(GetParam());
  } catch (const lmoe::Error& error) {
    message = error.message();
  }
  EXPECT_EQ(message.rfind("p2p: rank 0: ", 0), 0u) << message;
  MPI_Barrier(MPI_COMM_WORLD);  // every rank's setup has ended
  EXPECT_EQ(leftovers(), std::vector<std::string>{});
  EXPECT_TRUE(mpi_test::alike_on_every_rank(message)) << message;
}

INSTANTIATE_TEST_SUITE_P(Bootstrap, P2pProcessesWithoutGpu,
                         ::testing::Values(Bootstrap::mpi, Bootstrap::env), [](const auto& info) {
                           return info.param == Bootstrap::mpi ? "mpi" : "env";
                         });

// Why this node cannot run the tests, agreed by every rank.
std::string reason_to_skip() {
  const int local_size = mpi_test::processes_on_this_node();
  const int visible = lmoe::cuda_device_count();
  const char* shared = std::getenv("LMOE_P2P_SHARED_GPU");
  const bool sharing_allowed = shared && std::string(shared) == "1";
  if (!on_every_rank(visible > 0)) return "no CUDA GPU";
  if (!on_every_rank(local_size <= visible || sharing_allowed)) {
    return std::to_string(local_size) + " processes on a node with " + std::to_string(visible) +
           " GPU(s): ranks would share a GPU (set LMOE_P2P_SHARED_GPU=1 to run them so)";
  }
  return {};
}

}  // namespace

int main(int argc, char** argv) {
  lmoe::MpiSession session(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  lmoe::cpu::set_blas_threads(1);
  g_skip = reason_to_skip();
  // The torchrun variables, from MPI's (for Bootstrap::env).
  setenv("RANK", std::to_string(session.rank()).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(session.size()).c_str(), 1);
  return mpi_test::run_all_tests(session.rank(), "test_p2p_mpi", g_skip);
}

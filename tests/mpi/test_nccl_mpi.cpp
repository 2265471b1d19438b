// The `nccl` communicator with one process per GPU, under `mpirun -n N`: bootstrapped by MPI
// (make_nccl_mpi_communicator) and by the torchrun variables with the id file
// (make_nccl_env_communicator, the variables set here from MPI's). For each: the collectives bit
// for bit on exact inputs with unequal blocks, every tier against the contract within the reordered
// bound and bit for bit on crafted exact inputs, results identical on every rank, and a bad input
// on one rank failing every rank alike. Skips (every rank) when the processes of a node outnumber
// its GPUs.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>

#include "core/host_math.hpp"
#include "core/rank_order_reduce.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "cuda/tail/cuda_tail_executor.hpp"
#include "lmoe/error.hpp"
#include "lmoe/mpi_communicator.hpp"
#include "lmoe/nccl_communicator.hpp"
#include "lmoe/reference.hpp"
#include "lmoe/tools/tail_runner.hpp"
#include "mpi/mpi_gpu_test_support.hpp"

namespace {

using lmoe::DType;
using lmoe::TailTier;

const lmoe::TailDims kSmall{384, 192};
std::string g_skip;  // non-empty: why every test skips

enum class Bootstrap { mpi, env };

class NcclProcesses : public ::testing::TestWithParam<Bootstrap> {
 protected:
  void SetUp() override {
    if (!g_skip.empty()) GTEST_SKIP() << g_skip;
  }
  static std::shared_ptr<lmoe::Communicator> make(Bootstrap bootstrap) {
    return bootstrap == Bootstrap::mpi ? lmoe::make_nccl_mpi_communicator()
                                       : lmoe::make_nccl_env_communicator();
  }
};

TEST_P(NcclProcesses, CollectivesOnExactInputsMatchTheRankOrderSum) {
  auto comm = make(GetParam());
  const int tp = comm->size(), rank = comm->rank();
  EXPECT_EQ(comm->backend_name(), "nccl");
  const std::size_t count = 4096 + 3;  // unequal blocks unless tp divides it
  for (DType dtype : {DType::bf16, DType::f32}) {
    SCOPED_TRACE(std::string(lmoe::dtype_name(dtype)));
    const std::size_t esize = lmoe::dtype_size(dtype);
    std::vector<std::vector<std::byte>> inputs(static_cast<std::size_t>(tp));
    std::vector<const void*> pointers;
    for (int r = 0; r < tp; ++r) {
      std::mt19937_64 rng(17u + static_cast<std::uint64_t>(r));
      std::uniform_int_distribution<int> small(-8, 8);
      inputs[r].resize(count * esize);
      for (std::size_t i = 0; i < count; ++i)
        lmoe::store_from_float(inputs[r].data(), i, dtype, small(rng) * 0.25f);
      pointers.push_back(inputs[r].data());
    }
    std::vector<std::byte> expected(count * esize);
    lmoe::reduce_in_rank_order(pointers, expected.data(), count, dtype);
    const auto offsets = lmoe::even_split_offsets(count, tp);
    std::vector<std::size_t> counts;
    for (int r = 0; r < tp; ++r) counts.push_back(offsets[r + 1] - offsets[r]);

    const lmoe::cuda::DeviceBuffer send(count * esize), recv(count * esize);
    ASSERT_EQ(cudaMemcpy(send.data(), inputs[rank].data(), send.bytes(), cudaMemcpyHostToDevice),
              cudaSuccess);
    std::vector<std::byte> got(count * esize);
    comm->all_reduce(send.data(), recv.data(), count, dtype, nullptr);
    ASSERT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(got.data(), recv.data(), got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(got, expected);

    comm->reduce_scatter(send.data(), recv.at(offsets[rank] * esize), counts, dtype, nullptr);
    comm->all_gather(recv.at(offsets[rank] * esize), recv.data(), counts, dtype,
                     nullptr);  // in place
    ASSERT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(got.data(), recv.data(), got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(got, expected);
  }
}

TEST_P(NcclProcesses, EveryTierMeetsItsContract) {
  auto comm = make(GetParam());
  const int tp = comm->size();
  for (std::int64_t tokens : {std::int64_t{1}, std::int64_t{tp + 1}, std::int64_t{300}}) {
    const lmoe::TailCase random = lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, tp, tokens,
                                                         42u + static_cast<std::uint64_t>(tokens));
    const lmoe::TailCase exact = lmoe::make_exact_case(kSmall, DType::bf16, tp, tokens,
                                                       9u + static_cast<std::uint64_t>(tokens));
    for (TailTier tier : lmoe::kAllTiers) {
      SCOPED_TRACE(std::string(lmoe::tier_name(tier)) + " T=" + std::to_string(tokens));
      lmoe::RunOptions options;
      options.backend = lmoe::Backend::cuda;
      options.tier = tier;
      // Declined on every rank: token with fewer rows than ranks; fused over NCCL with several
      // ranks (its kernel reads the peers' workspaces, which needs the p2p communicator).
      if ((tier == TailTier::token && tokens < tp) || (tier == TailTier::fused && tp > 1)) {
        EXPECT_THROW(lmoe::run_case_rank(random, *comm, options), lmoe::Error);
        continue;
      }
      mpi_test::expect_contract(*comm, random, exact, options, lmoe::ReductionOrder::unspecified);
    }
  }
}

TEST_P(NcclProcesses, BadInputOnOneRankFailsEveryRankAlike) {
  auto comm = make(GetParam());
  EXPECT_EQ(
      mpi_test::bad_output_shape_error(*comm, kSmall),
      "rank " + std::to_string(comm->size() - 1) + ": out: expected shape [4, 384], got [3, 384]");
}

INSTANTIATE_TEST_SUITE_P(Bootstrap, NcclProcesses,
                         ::testing::Values(Bootstrap::mpi, Bootstrap::env), [](const auto& info) {
                           return info.param == Bootstrap::mpi ? "mpi" : "env";
                         });

// Why this node cannot run the test (its processes outnumber its GPUs), agreed by every rank.
std::string reason_to_skip() {
  const int local_size = mpi_test::processes_on_this_node();
  const int visible = lmoe::cuda_device_count();
  if (mpi_test::on_every_rank(local_size <= visible)) return {};
  return "needs one GPU per process: " + std::to_string(local_size) + " processes on a node with " +
         std::to_string(visible) + " GPU(s) visible";
}

// The torchrun variables, from MPI's, and an id file path that rank 0 picks and tells the others.
void set_launch_environment() {
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm node = MPI_COMM_NULL;
  int local_rank = 0;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  MPI_Comm_rank(node, &local_rank);
  MPI_Comm_free(&node);
  char path[256] = {};
  if (rank == 0)
    std::snprintf(path, sizeof(path), "/tmp/lmoe-nccl-id-%d", static_cast<int>(::getpid()));
  MPI_Bcast(path, sizeof(path), MPI_CHAR, 0, MPI_COMM_WORLD);
  setenv("RANK", std::to_string(rank).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(size).c_str(), 1);
  setenv("LOCAL_RANK", std::to_string(local_rank).c_str(), 1);
  setenv("LMOE_NCCL_ID_FILE", path, 1);
}

}  // namespace

int main(int argc, char** argv) {
  lmoe::MpiSession session(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  lmoe::cpu::set_blas_threads(1);
  g_skip = reason_to_skip();
  set_launch_environment();
  return mpi_test::run_all_tests(session.rank(), "test_nccl_mpi", g_skip);
}

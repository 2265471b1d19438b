// What the MPI tests of the GPU communicators share (test_nccl_mpi.cpp, test_p2p_mpi.cpp): one
// report from rank 0, checks agreed by every rank, and the bad-input call whose error every rank
// must raise alike.
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/runtime/device_buffer.hpp"
#include "lmoe/communicator.hpp"
#include "lmoe/error.hpp"
#include "lmoe/latent_tail.hpp"
#include "lmoe/reference.hpp"
#include "lmoe/tools/tail_runner.hpp"

namespace mpi_test {

// True on every rank when `ok` holds on every rank (so that all ranks report alike).
inline bool on_every_rank(bool ok) {
  int mine = ok ? 1 : 0, all = 0;
  MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all == 1;
}

// True on every rank when every rank's `text` is the same (its first 511 bytes).
inline bool alike_on_every_rank(const std::string& text) {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::vector<char> mine(512, '\0'), all(512 * static_cast<std::size_t>(size));
  std::memcpy(mine.data(), text.data(), std::min<std::size_t>(text.size(), 511));
  MPI_Allgather(mine.data(), 512, MPI_CHAR, all.data(), 512, MPI_CHAR, MPI_COMM_WORLD);
  bool alike = true;
  for (int r = 1; r < size; ++r)
    alike =
        alike && std::memcmp(all.data(), all.data() + 512 * static_cast<std::size_t>(r), 512) == 0;
  return alike;
}

// How many processes of the job run on this node.
inline int processes_on_this_node() {
  MPI_Comm node = MPI_COMM_NULL;
  int rank = 0, local_size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  MPI_Comm_size(node, &local_size);
  MPI_Comm_free(&node);
  return local_size;
}

// Every rank's host bytes equal rank 0's (gathered over the communicator's host control path).
inline bool identical_on_all_ranks(lmoe::Communicator& comm, const lmoe::HostTensor& tensor) {
  std::vector<std::byte> all(tensor.nbytes() * static_cast<std::size_t>(comm.size()));
  comm.control_all_gather(tensor.data(), all.data(), tensor.nbytes());
  for (int r = 1; r < comm.size(); ++r) {
    if (std::memcmp(all.data(), all.data() + tensor.nbytes() * static_cast<std::size_t>(r),
                    tensor.nbytes()) != 0) {
      return false;
    }
  }
  return true;
}

// One tier on this rank's slice of two cases: the random one within the contract's bound (sums in
// `order`) and identical on every rank, the crafted exact one bit for bit.
inline void expect_contract(lmoe::Communicator& comm, const lmoe::TailCase& random,
                            const lmoe::TailCase& exact, const lmoe::RunOptions& options,
                            lmoe::ReductionOrder order) {
  const lmoe::TailTier tier = *options.tier;
  const lmoe::RankRun run = lmoe::run_case_rank(random, comm, options);
  EXPECT_EQ(run.tier, tier);
  const lmoe::Comparison cmp =
      lmoe::compare(run.y.matrix(), lmoe::reference_tail(random, lmoe::contract_of(tier), order),
                    lmoe::exact_tail(random));
  EXPECT_EQ(cmp.beyond_bound, 0) << "max err/bound " << cmp.max_error_over_bound;
  EXPECT_LE(cmp.normwise_error, cmp.normwise_tolerance);
  EXPECT_TRUE(identical_on_all_ranks(comm, run.y));

  const lmoe::RankRun exact_run = lmoe::run_case_rank(exact, comm, options);
  EXPECT_EQ(
      lmoe::compare(exact_run.y.matrix(), lmoe::reference_tail(exact, lmoe::contract_of(tier)),
                    lmoe::exact_tail(exact))
          .bit_mismatches,
      0);
}

// A forward whose output has one row too few on the last rank only: the error every rank gets
// (empty when none), expected to be "rank <tp-1>: out: expected shape [4, d], got [3, d]".
inline std::string bad_output_shape_error(lmoe::Communicator& comm, lmoe::TailDims dims) {
  const int tp = comm.size();
  const lmoe::TailCase c = lmoe::make_random_case(dims, 1e-5f, lmoe::DType::bf16, tp, 4, 1u);
  lmoe::TailOptions options;
  options.dims = c.dims;
  options.backend = lmoe::Backend::cuda;
  lmoe::LatentTail tail(options, comm, c.norm_weight.matrix(), c.up_proj_weight.matrix());
  const std::int64_t out_rows = comm.rank() == tp - 1 ? 3 : 4;
  const lmoe::cuda::DeviceBuffer routed(4 * dims.d_latent * 2), shared(4 * dims.d_model * 2),
      out(out_rows * dims.d_model * 2);
  try {
    tail.forward({routed.data(), lmoe::DType::bf16, 4, dims.d_latent, dims.d_latent,
                  lmoe::MemorySpace::device},
                 {shared.data(), lmoe::DType::bf16, 4, dims.d_model, dims.d_model,
                  lmoe::MemorySpace::device},
                 {out.data(), lmoe::DType::bf16, out_rows, dims.d_model, dims.d_model,
                  lmoe::MemorySpace::device});
  } catch (const lmoe::Error& error) {
    return error.message();
  }
  return {};
}

// Runs the tests with one report, from rank 0 (a failure on any rank still fails the run through
// its exit code); when `skip` is set and nothing failed, prints "<program>: skipped: <why>" (what
// ctest's SKIP_REGULAR_EXPRESSION looks for: a test that ran anyway and failed is not hidden).
inline int run_all_tests(int rank, const char* program, const std::string& skip) {
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int result = RUN_ALL_TESTS();
  const bool passed = on_every_rank(result == 0);
  if (!skip.empty() && passed && rank == 0) std::printf("%s: skipped: %s\n", program, skip.c_str());
  if (result != 0) std::fprintf(stderr, "rank %d: tests failed\n", rank);
  return result;
}

}  // namespace mpi_test

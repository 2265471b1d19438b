// The MPI communicator. MPI's own reductions choose their order, so reductions here move bytes
// with MPI (all-to-all, then all-gather) and add in rank order locally: a two-shot all-reduce
// whose result is bit-identical on every rank and follows the contract.
#include "lmoe/mpi_communicator.hpp"

#include <mpi.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "comm/mpi_check.hpp"
#include "core/rank_order_reduce.hpp"
#include "lmoe/error.hpp"

namespace lmoe {

namespace {

int as_int_bytes(std::size_t bytes, const char* operation) {
  if (bytes > static_cast<std::size_t>(INT_MAX)) {
    throw Error(std::string(operation) + ": a block of " + std::to_string(bytes) +
                " bytes exceeds MPI's int count limit");
  }
  return static_cast<int>(bytes);
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator() {
    check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &comm_), "MPI_Comm_dup");
    check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check_mpi(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check_mpi(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend_name() const override { return "mpi"; }
  MemorySpace memory_space() const override { return MemorySpace::host; }

  void all_reduce(const void* send, void* recv, std::size_t count, DType dtype,
                  StreamHandle) override {
    const auto offsets = even_split_offsets(count, size_);
    std::vector<std::size_t> counts(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r) counts[r] = offsets[r + 1] - offsets[r];
    std::vector<std::byte> mine(counts[rank_] * dtype_size(dtype));
    reduce_scatter(send, mine.data(), counts, dtype, nullptr);
    all_gather(mine.data(), recv, counts, dtype, nullptr);
  }

  void reduce_scatter(const void* send, void* recv, std::span<const std::size_t> counts,
                      DType dtype, StreamHandle) override {
    check_counts(counts, "reduce_scatter");
    const std::size_t esize = dtype_size(dtype);
    const std::size_t mine = counts[rank_] * esize;
    std::vector<int> send_bytes(size_), send_displs(size_), recv_bytes(size_), recv_displs(size_);
    std::size_t offset = 0;
    for (int r = 0; r < size_; ++r) {
      send_bytes[r] = as_int_bytes(counts[r] * esize, "reduce_scatter");
      send_displs[r] = as_int_bytes(offset, "reduce_scatter");
      offset += counts[r] * esize;
      recv_bytes[r] = as_int_bytes(mine, "reduce_scatter");
      recv_displs[r] = as_int_bytes(mine * static_cast<std::size_t>(r), "reduce_scatter");
    }
    // staging[r] holds rank r's contribution to this rank's block.
    std::vector<std::byte> staging(mine * static_cast<std::size_t>(size_));
    check_mpi(MPI_Alltoallv(send, send_bytes.data(), send_displs.data(), MPI_BYTE, staging.data(),
                            recv_bytes.data(), recv_displs.data(), MPI_BYTE, comm_),
              "MPI_Alltoallv");
    std::vector<const void*> inputs(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r) inputs[r] = staging.data() + mine * static_cast<std::size_t>(r);
    reduce_in_rank_order(inputs, recv, counts[rank_], dtype);
  }

  void all_gather(const void* send, void* recv, std::span<const std::size_t> counts, DType dtype,
                  StreamHandle) override {
    check_counts(counts, "all_gather");
    const std::size_t esize = dtype_size(dtype);
    std::vector<int> bytes(size_), displs(size_);
    std::size_t offset = 0;
    for (int r = 0; r < size_; ++r) {
      bytes[r] = as_int_bytes(counts[r] * esize, "all_gather");
      displs[r] = as_int_bytes(offset, "all_gather");
      offset += counts[r] * esize;
    }
    // MPI forbids overlapping send and receive buffers; an in-place gather sends a copy.
    const std::byte* send_bytes = static_cast<const std::byte*>(send);
    const std::byte* recv_begin = static_cast<const std::byte*>(recv);
    std::vector<std::byte> copy;
    if (send_bytes < recv_begin + offset && recv_begin < send_bytes + counts[rank_] * esize) {
      copy.assign(send_bytes, send_bytes + counts[rank_] * esize);
      send_bytes = copy.data();
    }
    check_mpi(MPI_Allgatherv(send_bytes, bytes[rank_], MPI_BYTE, recv, bytes.data(), displs.data(),
                             MPI_BYTE, comm_),
              "MPI_Allgatherv");
  }

  void barrier() override { check_mpi(MPI_Barrier(comm_), "MPI_Barrier"); }

  // MPI cannot wake peers blocked in a collective; aborting ends the whole job, which is the
  // only way to guarantee that no rank hangs.
  void abort(const std::string& why) override {
    std::fprintf(stderr, "lmoe: rank %d aborts the MPI job: %s\n", rank_, why.c_str());
    MPI_Abort(comm_, 1);
  }

 private:
  void check_counts(std::span<const std::size_t> counts, const char* operation) const {
    if (counts.size() != static_cast<std::size_t>(size_)) {
      throw Error(std::string(operation) + ": counts has " + std::to_string(counts.size()) +
                  " entries, expected one per rank (" + std::to_string(size_) + ")");
    }
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace

bool mpi_available() { return true; }

bool launched_by_mpi() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"}) {
    if (std::getenv(name) != nullptr) return true;
  }
  return false;
}

MpiSession::MpiSession(int* argc, char*** argv) {
  int initialized = 0;
  check_mpi(MPI_Initialized(&initialized), "MPI_Initialized");
  if (!initialized) {
    check_mpi(MPI_Init(argc, argv), "MPI_Init");
    owns_ = true;
  }
}

MpiSession::~MpiSession() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owns_ && !finalized) MPI_Finalize();
}

int MpiSession::rank() const {
  int rank = 0;
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
  return rank;
}

int MpiSession::size() const {
  int size = 0;
  check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &size), "MPI_Comm_size");
  return size;
}

std::shared_ptr<Communicator> make_mpi_communicator() {
  return std::make_shared<MpiCommunicator>();
}

}  // namespace lmoe

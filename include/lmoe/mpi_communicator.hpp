// The `mpi` communicator: one process per rank under mpirun (available when built with MPI).
#pragma once

#include <memory>

#include "lmoe/communicator.hpp"

namespace lmoe {

// True when lmoe was built with MPI support.
bool mpi_available();
// True when this process looks like it was started by mpirun (OMPI_/PMI_ variables present).
bool launched_by_mpi();

// Initializes MPI on construction (if nobody has) and finalizes it on destruction (if it did).
class MpiSession {
 public:
  MpiSession(int* argc, char*** argv);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  int rank() const;
  int size() const;

 private:
  [[maybe_unused]] bool owns_ = false;  // read only where MPI is built (mpi_communicator.cpp)
};

// A communicator over MPI_COMM_WORLD (duplicated). Requires an initialized MPI.
std::shared_ptr<Communicator> make_mpi_communicator();

}  // namespace lmoe

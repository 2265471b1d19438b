// Built when MPI is absent: the API exists and says clearly that MPI is not compiled in.
#include <cstdlib>

#include "lmoe/error.hpp"
#include "lmoe/mpi_communicator.hpp"

namespace lmoe {

namespace {
[[noreturn]] void unavailable() {
  throw Error(
      "this lmoe was built without MPI (install an MPI, e.g. Debian's libopenmpi-dev, and "
      "reconfigure with -DLMOE_WITH_MPI=ON)");
}
}  // namespace

bool mpi_available() { return false; }
bool launched_by_mpi() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr;
}
MpiSession::MpiSession(int*, char***) { unavailable(); }
MpiSession::~MpiSession() = default;
int MpiSession::rank() const { unavailable(); }
int MpiSession::size() const { unavailable(); }
std::shared_ptr<Communicator> make_mpi_communicator() { unavailable(); }

}  // namespace lmoe

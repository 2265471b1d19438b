#include "device_support.hpp"
#include "lmoe/error.hpp"

namespace lmoe::python {

StreamHandle current_stream(const at::Tensor& tensor) {
  LMOE_CHECK(!tensor.is_cuda(), "this build of lmoe's torch ops has no CUDA support");
  return nullptr;
}

std::shared_ptr<Communicator> make_device_communicator(Communicator&, int, const std::string&) {
  throw Error(
      "this build of lmoe's torch ops has no CUDA support (built without nvcc or CUDA torch)");
}

}  // namespace lmoe::python

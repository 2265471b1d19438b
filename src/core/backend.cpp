#include "lmoe/backend.hpp"

#include <string>

#include "lmoe/error.hpp"

namespace lmoe {

std::string_view backend_name(Backend backend) { return backend == Backend::cpu ? "cpu" : "cuda"; }

Backend parse_backend(std::string_view name) {
  if (name == "cpu") return Backend::cpu;
  if (name == "cuda") return Backend::cuda;
  throw Error("unknown backend '" + std::string(name) + "': expected cpu or cuda");
}

}  // namespace lmoe

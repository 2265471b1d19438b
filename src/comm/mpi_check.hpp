// Every MPI return code becomes an lmoe::Error naming the call and MPI's own message (builds with
// MPI).
#pragma once

#include <mpi.h>

#include <string>

#include "lmoe/error.hpp"

namespace lmoe {

inline void check_mpi(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw Error(std::string(call) +
              " failed: " + std::string(text, static_cast<std::size_t>(length)));
}

}  // namespace lmoe

# The torch the Python package builds against: the one installed for the Python that runs the build
# (scikit-build-core passes it as Python_EXECUTABLE). `-I` leaves out the paths pip's isolated build
# environment adds, so that `pip install .` finds the environment's own torch, not a second copy.
# Its C++ ABI flag applies to every target: the lmoe libraries are linked into the ops library and
# pass std::string to and from torch's code.
find_package(Python COMPONENTS Interpreter REQUIRED)
execute_process(
  COMMAND ${Python_EXECUTABLE} -I -c
    "import torch, torch.utils; print(torch.utils.cmake_prefix_path); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(torch.version.cuda or ''); print(torch.__version__)"
  OUTPUT_VARIABLE lmoe_torch_probe OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE lmoe_torch_status ERROR_VARIABLE lmoe_torch_error)
if(NOT lmoe_torch_status EQUAL 0)
  message(FATAL_ERROR "lmoe: the Python package builds against an installed torch, and "
                      "${Python_EXECUTABLE} cannot import one:\n${lmoe_torch_error}")
endif()
string(REPLACE "\n" ";" lmoe_torch_probe "${lmoe_torch_probe}")
list(GET lmoe_torch_probe 0 LMOE_TORCH_CMAKE_PREFIX)
list(GET lmoe_torch_probe 1 lmoe_torch_cxx11_abi)
list(GET lmoe_torch_probe 2 lmoe_torch_cuda)
list(GET lmoe_torch_probe 3 LMOE_TORCH_VERSION)
get_filename_component(LMOE_TORCH_ROOT "${LMOE_TORCH_CMAKE_PREFIX}/../.." ABSOLUTE)
add_compile_definitions(_GLIBCXX_USE_CXX11_ABI=${lmoe_torch_cxx11_abi})

# LMOE_PYTHON_CUDA: AUTO builds the CUDA backend and the ops' CUDA code where torch was built with
# CUDA and an nvcc of the same major version is found (torch's CUDA libraries and lmoe's must agree);
# ON requires a CUDA torch and nvcc; OFF builds for the CPU only.
set(LMOE_PYTHON_CUDA AUTO CACHE STRING "Python package: build with CUDA (AUTO, ON, OFF)")
set_property(CACHE LMOE_PYTHON_CUDA PROPERTY STRINGS AUTO ON OFF)
find_program(LMOE_NVCC nvcc PATHS /usr/local/cuda/bin)
set(lmoe_cuda_majors_agree OFF)
if(LMOE_NVCC AND lmoe_torch_cuda)
  execute_process(COMMAND ${LMOE_NVCC} --version OUTPUT_VARIABLE lmoe_nvcc_text)
  string(REGEX MATCH "release ([0-9]+)" _ "${lmoe_nvcc_text}")
  set(lmoe_nvcc_major "${CMAKE_MATCH_1}")
  string(REGEX MATCH "^[0-9]+" lmoe_torch_cuda_major "${lmoe_torch_cuda}")
  if(lmoe_nvcc_major STREQUAL lmoe_torch_cuda_major)
    set(lmoe_cuda_majors_agree ON)
  else()
    message(STATUS "lmoe: torch has CUDA ${lmoe_torch_cuda} and nvcc is release ${lmoe_nvcc_major}: "
                   "AUTO builds the CPU package")
  endif()
endif()
if(LMOE_PYTHON_CUDA STREQUAL "ON" OR (LMOE_PYTHON_CUDA STREQUAL "AUTO" AND lmoe_cuda_majors_agree))
  if(NOT lmoe_torch_cuda OR NOT LMOE_NVCC)
    message(FATAL_ERROR "lmoe: LMOE_PYTHON_CUDA=ON needs a CUDA build of torch and nvcc "
                        "(torch CUDA: '${lmoe_torch_cuda}', nvcc: '${LMOE_NVCC}')")
  endif()
  set(LMOE_WITH_CUDA ON CACHE BOOL "" FORCE)
  if(NOT CMAKE_CUDA_COMPILER)
    set(CMAKE_CUDA_COMPILER ${LMOE_NVCC})
  endif()
else()
  set(LMOE_WITH_CUDA OFF CACHE BOOL "" FORCE)
endif()
message(STATUS "lmoe: Python package against torch ${LMOE_TORCH_VERSION} at ${LMOE_TORCH_ROOT} "
               "(C++11 ABI ${lmoe_torch_cxx11_abi}; CUDA: ${LMOE_WITH_CUDA})")

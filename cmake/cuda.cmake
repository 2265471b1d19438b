# The CUDA backend: nvcc for the kernels, the CUDA runtime and cuBLASLt for the GEMMs.
# Included from the top-level CMakeLists.txt when LMOE_WITH_CUDA=ON.
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES "90a;100a")
endif()
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)

# The .cu files include project headers that use C++20 (std::bit_cast); nvcc 12+ accepts
# -std=c++20, but older CMake (3.25 here) does not know that flag for nvcc and refuses "CUDA20".
if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
endif()
set(CMAKE_CUDA_STANDARD 20)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
set(CMAKE_CUDA_EXTENSIONS OFF)
# Warnings for device code and for the host compiler behind nvcc.
add_compile_options("$<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>")
# Source lines in the device code's debug sections (nvcc -lineinfo), so that Nsight Compute's
# source counters name the lines that issue or stall (benchmarks/profile.sh turns it on for its
# profiles). The machine code is the same.
option(LMOE_CUDA_LINEINFO "Build the kernels with nvcc -lineinfo (for Nsight Compute)" OFF)
if(LMOE_CUDA_LINEINFO)
  add_compile_options("$<$<COMPILE_LANGUAGE:CUDA>:-lineinfo>")
endif()

# CUTLASS's headers (the epilogue GEMM), pinned.
include(${CMAKE_CURRENT_LIST_DIR}/cutlass.cmake)

# NCCL (optional: the cuda-threads communicator needs none) for the nccl communicator.
include(${CMAKE_CURRENT_LIST_DIR}/nccl.cmake)

# CUTLASS's headers for the up-projection GEMM whose epilogue adds the shared partial
# (src/cuda/gemm/epilogue_gemm*.cu). They come from the `nvidia-cutlass` wheel on PyPI (header-only
# use; `scripts/install-deps.sh --cutlass` installs it), found through the Python that has it, or
# from -DLMOE_CUTLASS_INCLUDE_DIR=<dir holding cutlass/ and cute/>. One version is pinned: CUTLASS's
# templates change between releases, and the kernels were measured with this one.
set(LMOE_CUTLASS_VERSION 4.2.0)
set(LMOE_CUTLASS_INCLUDE_DIR "" CACHE PATH "CUTLASS's include folder (empty: the nvidia-cutlass wheel's)")

if(NOT LMOE_CUTLASS_INCLUDE_DIR)
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(Python3_Interpreter_FOUND)
    execute_process(
      COMMAND ${Python3_EXECUTABLE} -c
        "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))"
      OUTPUT_VARIABLE lmoe_cutlass_probe OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE lmoe_cutlass_rc)
    if(lmoe_cutlass_rc EQUAL 0 AND EXISTS "${lmoe_cutlass_probe}/cutlass/version.h")
      set(LMOE_CUTLASS_INCLUDE_DIR "${lmoe_cutlass_probe}" CACHE PATH "" FORCE)
    endif()
  endif()
endif()
if(NOT EXISTS "${LMOE_CUTLASS_INCLUDE_DIR}/cutlass/version.h")
  message(FATAL_ERROR
    "lmoe: CUTLASS ${LMOE_CUTLASS_VERSION}'s headers not found (the CUDA backend's up-projection GEMM "
    "needs them). Install the wheel: `bash scripts/install-deps.sh --cutlass` (pip install --no-deps "
    "nvidia-cutlass==${LMOE_CUTLASS_VERSION}.0), or pass -DLMOE_CUTLASS_INCLUDE_DIR=<folder with cutlass/ and cute/>.")
endif()

file(STRINGS "${LMOE_CUTLASS_INCLUDE_DIR}/cutlass/version.h" lmoe_cutlass_lines
  REGEX "^#define CUTLASS_(MAJOR|MINOR|PATCH) [0-9]+")
foreach(part MAJOR MINOR PATCH)
  string(REGEX MATCH "CUTLASS_${part} ([0-9]+)" _ "${lmoe_cutlass_lines}")
  set(lmoe_cutlass_${part} ${CMAKE_MATCH_1})
endforeach()
set(lmoe_cutlass_found "${lmoe_cutlass_MAJOR}.${lmoe_cutlass_MINOR}.${lmoe_cutlass_PATCH}")
if(NOT lmoe_cutlass_found VERSION_EQUAL LMOE_CUTLASS_VERSION)
  message(FATAL_ERROR "lmoe: CUTLASS ${lmoe_cutlass_found} at ${LMOE_CUTLASS_INCLUDE_DIR}; lmoe pins ${LMOE_CUTLASS_VERSION} "
    "(pip install --no-deps nvidia-cutlass==${LMOE_CUTLASS_VERSION}.0)")
endif()
message(STATUS "lmoe: CUTLASS ${lmoe_cutlass_found} from ${LMOE_CUTLASS_INCLUDE_DIR}")

add_library(lmoe_cutlass INTERFACE)
target_include_directories(lmoe_cutlass SYSTEM INTERFACE "${LMOE_CUTLASS_INCLUDE_DIR}")

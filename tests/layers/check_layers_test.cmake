# cmake/check_layers.cmake on copies of this tree: it must accept the tree as it is, and reject each
# include against the rule and each backend switch in core, naming the file.
#   cmake -DLMOE_SOURCE_DIR=<tree> -DWORK_DIR=<scratch> -P tests/layers/check_layers_test.cmake
cmake_policy(VERSION 3.25)

function(copy_tree into)
  file(REMOVE_RECURSE ${into})
  file(MAKE_DIRECTORY ${into})
  file(COPY ${LMOE_SOURCE_DIR}/include ${LMOE_SOURCE_DIR}/src DESTINATION ${into})
endfunction()

# Runs the check on `tree`; sets `result` (the exit code) and `output` in the caller.
function(run_check tree)
  execute_process(
    COMMAND ${CMAKE_COMMAND} -DLMOE_SOURCE_DIR=${tree} -P ${LMOE_SOURCE_DIR}/cmake/check_layers.cmake
    RESULT_VARIABLE code ERROR_VARIABLE err OUTPUT_VARIABLE out)
  set(result ${code} PARENT_SCOPE)
  set(output "${out}${err}" PARENT_SCOPE)
endfunction()

set(tree ${WORK_DIR}/tree)
copy_tree(${tree})
run_check(${tree})
if(NOT result EQUAL 0)
  message(FATAL_ERROR "the check refused the tree as it is:\n${output}")
endif()

# Each case: the file to edit (relative to the tree), the line to add, and what the refusal must say.
set(cases
  "src/core/error.cpp|#include \"cuda/runtime/cuda_check.hpp\"|src/core/error.cpp (layer core) includes \"cuda/runtime/cuda_check.hpp\" of layer cuda"
  "src/core/tier_policy.cpp|#include \"lmoe/latent_tail.hpp\"|src/core/tier_policy.cpp (layer core) includes \"lmoe/latent_tail.hpp\" of layer runtime"
  "src/comm/communicator.cpp|#include \"cpu/cpu_tail_executor.hpp\"|src/comm/communicator.cpp (layer comm) includes \"cpu/cpu_tail_executor.hpp\" of layer cpu"
  "src/cuda/cuda_backend.cpp|#include \"runtime/backend_registry.hpp\"|src/cuda/cuda_backend.cpp (layer cuda) includes \"runtime/backend_registry.hpp\" of layer runtime"
  "src/runtime/latent_tail.cpp|#include \"lmoe/tools/tail_bench.hpp\"|src/runtime/latent_tail.cpp (layer runtime) includes \"lmoe/tools/tail_bench.hpp\" of layer tools"
  "include/lmoe/tensor.hpp|#include \"lmoe/comm_group.hpp\"|include/lmoe/tensor.hpp (layer core) includes \"lmoe/comm_group.hpp\" of layer runtime"
  "src/runtime/latent_tail.cpp|#ifdef LMOE_HAS_CUDA|src/runtime/latent_tail.cpp switches on the backend")
foreach(case IN LISTS cases)
  string(REPLACE "|" ";" parts "${case}")
  list(GET parts 0 file)
  list(GET parts 1 line)
  list(GET parts 2 expected)
  copy_tree(${tree})
  file(READ ${tree}/${file} text)
  file(WRITE ${tree}/${file} "${line}\n${text}")
  run_check(${tree})
  if(result EQUAL 0)
    message(FATAL_ERROR "the check accepted ${file} with: ${line}")
  endif()
  string(FIND "${output}" "${expected}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "the refusal of ${file} does not say: ${expected}\nit says:\n${output}")
  endif()
endforeach()
file(REMOVE_RECURSE ${tree})
list(LENGTH cases count)
message(STATUS "check_layers: the tree passes; ${count} wrong includes refused, each named")

# The CUDA backend's sources, added to lmoe_core (included from src/CMakeLists.txt).
target_sources(lmoe_core PRIVATE
  ${CMAKE_CURRENT_LIST_DIR}/launchers.cu
  ${CMAKE_CURRENT_LIST_DIR}/cublaslt_gemm.cpp
  ${CMAKE_CURRENT_LIST_DIR}/cuda_communicator.cpp
  ${CMAKE_CURRENT_LIST_DIR}/p2p_launch.cu
  ${CMAKE_CURRENT_LIST_DIR}/fused_tail.cpp
  ${CMAKE_CURRENT_LIST_DIR}/fused_tail_launch.cu
  ${CMAKE_CURRENT_LIST_DIR}/fused_decode_launch.cu
  ${CMAKE_CURRENT_LIST_DIR}/fused_chained_launch.cu
  ${CMAKE_CURRENT_LIST_DIR}/../comm/p2p_group.cpp
  ${CMAKE_CURRENT_LIST_DIR}/../comm/p2p_communicator.cpp
  ${CMAKE_CURRENT_LIST_DIR}/../comm/p2p_process.cpp
  ${CMAKE_CURRENT_LIST_DIR}/cuda_tail_executor.cpp
  ${CMAKE_CURRENT_LIST_DIR}/token_switch.cpp
  ${CMAKE_CURRENT_LIST_DIR}/token_switch_select.cu
  ${CMAKE_CURRENT_LIST_DIR}/cuda_tail_runner.cpp
  ${CMAKE_CURRENT_LIST_DIR}/cuda_tail_bench.cpp
  ${CMAKE_CURRENT_LIST_DIR}/cuda_device_info.cpp
  ${CMAKE_CURRENT_LIST_DIR}/bench_fill.cu
  ${CMAKE_CURRENT_LIST_DIR}/l2_evict.cu
  ${CMAKE_CURRENT_LIST_DIR}/layer_kernels.cu
  ${CMAKE_CURRENT_LIST_DIR}/grouped_gemm.cu
  ${CMAKE_CURRENT_LIST_DIR}/tensor_map.cpp
  ${CMAKE_CURRENT_LIST_DIR}/cuda_layer_executor.cpp
  ${CMAKE_CURRENT_LIST_DIR}/cuda_layer_runner.cpp
)
target_compile_definitions(lmoe_core PUBLIC LMOE_HAS_CUDA=1)
target_link_libraries(lmoe_core PUBLIC CUDA::cudart PRIVATE CUDA::cublasLt)

# The nccl communicator (cmake/nccl.cmake found NCCL).
if(LMOE_HAS_NCCL)
  target_sources(lmoe_core PRIVATE
    ${PROJECT_SOURCE_DIR}/src/comm/nccl_group.cpp
    ${PROJECT_SOURCE_DIR}/src/comm/nccl_communicator.cpp
  )
  target_compile_definitions(lmoe_core PUBLIC LMOE_HAS_NCCL=1)
  target_link_libraries(lmoe_core PRIVATE lmoe::nccl)
endif()

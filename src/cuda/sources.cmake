# lmoe_cuda: the CUDA backend (included from src/CMakeLists.txt with LMOE_WITH_CUDA), one folder per
# concern: runtime/ (checks, buffers, device info), comm/ (cuda-threads, NCCL, P2P), tail/ (the
# executor and its elementwise and norm kernels), fused/ (the fused tier), gemm/, layer/.
set(lmoe_cuda_dir ${CMAKE_CURRENT_LIST_DIR})
add_library(lmoe_cuda STATIC
  ${lmoe_cuda_dir}/cuda_backend.cpp
  ${lmoe_cuda_dir}/runtime/cuda_device_info.cpp
  ${lmoe_cuda_dir}/runtime/tensor_map.cpp
  ${lmoe_cuda_dir}/comm/cuda_communicator.cpp
  ${lmoe_cuda_dir}/comm/p2p_launch.cu
  ${lmoe_cuda_dir}/comm/p2p_group.cpp
  ${lmoe_cuda_dir}/comm/p2p_communicator.cpp
  ${lmoe_cuda_dir}/comm/p2p_process.cpp
  ${lmoe_cuda_dir}/tail/launchers.cu
  ${lmoe_cuda_dir}/tail/cuda_tail_executor.cpp
  ${lmoe_cuda_dir}/tail/token_switch.cpp
  ${lmoe_cuda_dir}/tail/token_switch_select.cu
  ${lmoe_cuda_dir}/fused/fused_tail.cpp
  ${lmoe_cuda_dir}/fused/fused_settings.cpp
  ${lmoe_cuda_dir}/fused/fused_trace.cpp
  ${lmoe_cuda_dir}/fused/fused_tail_launch.cu
  ${lmoe_cuda_dir}/fused/fused_decode_launch.cu
  ${lmoe_cuda_dir}/fused/fused_chained_launch.cu
  ${lmoe_cuda_dir}/gemm/cublaslt_gemm.cpp
  ${lmoe_cuda_dir}/gemm/epilogue_gemm.cpp
  ${lmoe_cuda_dir}/gemm/grouped_gemm.cu
  ${lmoe_cuda_dir}/layer/layer_kernels.cu
  ${lmoe_cuda_dir}/layer/layer_router.cpp
  ${lmoe_cuda_dir}/layer/layer_routed_experts.cpp
  ${lmoe_cuda_dir}/layer/layer_shared_experts.cpp
  ${lmoe_cuda_dir}/layer/cuda_layer_executor.cpp
)
target_compile_definitions(lmoe_cuda PUBLIC LMOE_HAS_CUDA=1)
target_link_libraries(lmoe_cuda PUBLIC lmoe_comm CUDA::cudart PRIVATE CUDA::cublasLt)

# The epilogue GEMM's CUTLASS kernels (cmake/cutlass.cmake): Hopper-only instructions, so they
# compile for sm_90a alone, and only where the build targets it; elsewhere epilogue_gemm_limit()
# declines and the tiers use cuBLASLt with an add kernel.
if("90a" IN_LIST CMAKE_CUDA_ARCHITECTURES)
  add_library(lmoe_cuda_epilogue_gemm OBJECT
    ${lmoe_cuda_dir}/gemm/epilogue_gemm_bf16_once.cu
    ${lmoe_cuda_dir}/gemm/epilogue_gemm_bf16_product_first.cu
    ${lmoe_cuda_dir}/gemm/epilogue_gemm_f16_once.cu
    ${lmoe_cuda_dir}/gemm/epilogue_gemm_f16_product_first.cu
  )
  set_target_properties(lmoe_cuda_epilogue_gemm PROPERTIES CUDA_ARCHITECTURES 90a)
  # CUTLASS's headers call constexpr host functions from device code.
  target_compile_options(lmoe_cuda_epilogue_gemm PRIVATE --expt-relaxed-constexpr)
  target_link_libraries(lmoe_cuda_epilogue_gemm PRIVATE lmoe_comm lmoe_cutlass CUDA::cudart)
  target_sources(lmoe_cuda PRIVATE $<TARGET_OBJECTS:lmoe_cuda_epilogue_gemm>)
  set_source_files_properties(${lmoe_cuda_dir}/gemm/epilogue_gemm.cpp PROPERTIES
    COMPILE_DEFINITIONS LMOE_EPILOGUE_GEMM_SM90=1)
endif()

# The nccl communicator (cmake/nccl.cmake found NCCL).
if(LMOE_HAS_NCCL)
  target_sources(lmoe_cuda PRIVATE
    ${lmoe_cuda_dir}/comm/nccl_group.cpp
    ${lmoe_cuda_dir}/comm/nccl_communicator.cpp
  )
  target_compile_definitions(lmoe_cuda PUBLIC LMOE_HAS_NCCL=1)
  target_link_libraries(lmoe_cuda PRIVATE lmoe::nccl)
endif()

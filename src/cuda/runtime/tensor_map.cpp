#include "cuda/runtime/tensor_map.hpp"

#include <cudaTypedefs.h>  // the driver entry point's type; the pointer comes through the runtime

namespace lmoe::cuda {

namespace {

// Looked up once; null when the driver has none.
PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 function = [] {
    void* found = nullptr;
    cudaDriverEntryPointQueryResult result{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &found, 12000, cudaEnableDefault,
                                         &result) != cudaSuccess ||
        result != cudaDriverEntryPointSuccess) {
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(found);
  }();
  return function;
}

}  // namespace

bool tensor_maps_available() { return encode_tiled() != nullptr; }

cudaError_t encode_tiled_map(CUtensorMap& map, DType dtype, const void* base, int rank,
                             const std::uint64_t* dims, const std::uint64_t* strides,
                             const std::uint32_t* box) {
  const PFN_cuTensorMapEncodeTiled_v12000 function = encode_tiled();
  if (function == nullptr) return cudaErrorNotSupported;
  if (dtype != DType::bf16 && dtype != DType::f16) return cudaErrorInvalidValue;
  if (rank < 2 || rank > 5) return cudaErrorInvalidValue;
  const CUtensorMapDataType type =
      dtype == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  cuuint64_t global_dims[5], global_strides[4];
  cuuint32_t box_dims[5], element_strides[5];
  for (int i = 0; i < rank; ++i) {
    global_dims[i] = dims[i];
    box_dims[i] = box[i];
    element_strides[i] = 1;
    if (i + 1 < rank) global_strides[i] = strides[i];
  }
  const CUresult status =
      function(&map, type, static_cast<cuuint32_t>(rank), const_cast<void*>(base), global_dims,
               global_strides, box_dims, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
               CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return status == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t encode_rows_map(CUtensorMap& map, DType dtype, const void* base, std::int64_t rows,
                            std::int64_t k, std::int64_t pitch, int box_k, int box_rows) {
  const std::uint64_t dims[2] = {static_cast<std::uint64_t>(k), static_cast<std::uint64_t>(rows)};
  const std::uint64_t strides[1] = {static_cast<std::uint64_t>(pitch) * 2};
  const std::uint32_t box[2] = {static_cast<std::uint32_t>(box_k),
                                static_cast<std::uint32_t>(box_rows)};
  return encode_tiled_map(map, dtype, base, 2, dims, strides, box);
}

cudaError_t encode_grouped_rows_map(CUtensorMap& map, DType dtype, const void* base,
                                    std::int64_t groups, std::int64_t rows, std::int64_t k,
                                    std::int64_t group_stride, int box_k, int box_rows) {
  const std::uint64_t dims[3] = {static_cast<std::uint64_t>(k), static_cast<std::uint64_t>(rows),
                                 static_cast<std::uint64_t>(groups)};
  const std::uint64_t strides[2] = {static_cast<std::uint64_t>(k) * 2,
                                    static_cast<std::uint64_t>(group_stride) * 2};
  const std::uint32_t box[3] = {static_cast<std::uint32_t>(box_k),
                                static_cast<std::uint32_t>(box_rows), 1};
  return encode_tiled_map(map, dtype, base, 3, dims, strides, box);
}

}  // namespace lmoe::cuda

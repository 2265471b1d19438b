// Tensor maps for the copy engine (TMA): cuTensorMapEncodeTiled reached through the runtime's
// driver entry point (nothing links libcuda), and the element type of a 16-bit dtype. Host code
// only.
#pragma once

#include <cuda.h>  // CUtensorMap and the enums (the types only)
#include <cuda_runtime_api.h>

#include <cstdint>

#include "lmoe/dtype.hpp"

namespace lmoe::cuda {

// Whether this driver encodes tensor maps.
bool tensor_maps_available();

// The map of a row-major matrix [rows, k] of a 16-bit dtype (bf16 or f16) at `base` (16-byte
// aligned), row pitch `pitch` elements (a multiple of 8), read in boxes of box_k × box_rows
// elements with the 128-byte swizzle (box_k · 2 = 128: the K-major layout wgmma's descriptors
// read). Elements outside the matrix arrive as zeros. cudaErrorNotSupported without an encoder,
// cudaErrorInvalidValue for what the encoder refuses.
cudaError_t encode_rows_map(CUtensorMap& map, DType dtype, const void* base, std::int64_t rows,
                            std::int64_t k, std::int64_t pitch, int box_k, int box_rows);

// Any tiled map of a 16-bit dtype with the 128-byte swizzle: `rank` (2 … 5) dimensions, dims[0]
// the innermost (contiguous); strides[i] the bytes between steps of dimension i + 1 (multiples of
// 16); box[i] elements of dimension i a copy moves (box[0] · 2 ≤ 128). The two forms below and
// the probes' other box shapes (benchmarks/tma_stream_probe.cu) are made with it.
cudaError_t encode_tiled_map(CUtensorMap& map, DType dtype, const void* base, int rank,
                             const std::uint64_t* dims, const std::uint64_t* strides,
                             const std::uint32_t* box);

// The same for a [groups, rows, k] tensor with `group_stride` elements between groups, boxes of
// box_k × box_rows × 1.
cudaError_t encode_grouped_rows_map(CUtensorMap& map, DType dtype, const void* base,
                                    std::int64_t groups, std::int64_t rows, std::int64_t k,
                                    std::int64_t group_stride, int box_k, int box_rows);

}  // namespace lmoe::cuda

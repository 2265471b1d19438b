#include "cuda/comm/p2p_launch.hpp"

#include "cuda/runtime/alignment.hpp"

#include <cstdint>

#include "cuda/comm/p2p_round.cuh"

namespace lmoe::cuda {

namespace {

// Whether every address the round touches as a vector is 16-byte aligned.
template <typename T>
bool vector_ok(const P2pDeviceHandle& h, const P2pRound& round) {
  constexpr std::int64_t kVec = Vec16<T>::kSize;
  if (!aligned16(round.send) || !aligned16(round.out) || h.block_bytes % 16 != 0) return false;
  if (round.op == P2pOp::reduce) return round.reduce_first % kVec == 0;
  if (round.op == P2pOp::reduce_scatter) {
    for (int r = 0; r < h.size; ++r) {
      if (round.piece_offset[r] % kVec != 0) return false;
    }
    return true;
  }
  for (int r = 0; r < h.size; ++r) {
    if (round.gather_offset[r] % kVec != 0) return false;
  }
  return true;
}

template <typename T>
cudaError_t launch_as(const P2pDeviceHandle& h, const P2pRound& round, int blocks,
                      cudaStream_t stream) {
  if (vector_ok<T>(h, round)) {
    p2p_round_kernel<T, true><<<blocks, kP2pThreads, 0, stream>>>(h, round);
  } else {
    p2p_round_kernel<T, false><<<blocks, kP2pThreads, 0, stream>>>(h, round);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t preload_p2p_kernels() {
  cudaFuncAttributes attributes;
  for (const void* kernel : {reinterpret_cast<const void*>(p2p_round_kernel<__nv_bfloat16, true>),
                             reinterpret_cast<const void*>(p2p_round_kernel<__nv_bfloat16, false>),
                             reinterpret_cast<const void*>(p2p_round_kernel<__half, true>),
                             reinterpret_cast<const void*>(p2p_round_kernel<__half, false>),
                             reinterpret_cast<const void*>(p2p_round_kernel<float, true>),
                             reinterpret_cast<const void*>(p2p_round_kernel<float, false>)}) {
    if (const cudaError_t status = cudaFuncGetAttributes(&attributes, kernel);
        status != cudaSuccess)
      return status;
  }
  return cudaSuccess;
}

cudaError_t launch_p2p_round(const P2pDeviceHandle& handle, const P2pRound& round, int blocks,
                             DType dtype, cudaStream_t stream) {
  if (blocks < 1 || blocks > kP2pMaxBlocks || handle.size < 1 || handle.size > kP2pMaxRanks) {
    return cudaErrorInvalidValue;
  }
  switch (dtype) {
    case DType::bf16: return launch_as<__nv_bfloat16>(handle, round, blocks, stream);
    case DType::f16: return launch_as<__half>(handle, round, blocks, stream);
    case DType::f32: return launch_as<float>(handle, round, blocks, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace lmoe::cuda

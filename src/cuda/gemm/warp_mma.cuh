// Warp-level tensor-core building blocks shared by the fused tail (fused_tail.cuh) and the grouped
// GEMM (grouped_gemm.cuh): cp.async copies into shared memory, a 128-byte-row XOR swizzle, ldmatrix
// and mma.sync m16n8k16 with bf16 or f16 operands and fp32 accumulation (sm_80 and later; the
// project builds sm_90a and sm_100a). Device code only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace lmoe::cuda {

// One tensor-core step: c[16 × 8] += a[16 × 16] · b[16 × 8] (fragments as the PTX ISA lays out
// mma.m16n8k16: a row-major, b column-major, i.e. 8 rows of a [N, K] weight with 16 consecutive k).
template <typename T>
__device__ inline void mma_m16n8k16(float (&c)[4], const std::uint32_t (&a)[4],
                                    const std::uint32_t (&b)[2]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    static_assert(std::is_same_v<T, __half>, "mma_m16n8k16: bf16 or f16 operands");
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// Byte offset of 16-byte chunk `chunk` (0..7) of a 128-byte shared-memory row: chunks are
// XOR-swizzled by the row so that the 8 rows one ldmatrix phase reads fall in different banks.
__device__ inline std::uint32_t swizzle128(int row, int chunk) {
  return static_cast<std::uint32_t>(row * 128 + ((chunk ^ (row & 7)) << 4));
}

// 16 bytes global → shared through L2 only (.cg: data other blocks of the same kernel wrote are
// seen, L1 is not coherent with them); zeros when !valid.
__device__ inline void cp_async16(std::uint32_t shared, const void* global, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared), "l"(global),
               "r"(valid ? 16 : 0)
               : "memory");
}
// 8 and 4 bytes (rows whose byte pitch is not a multiple of 16); cp.async has only .ca for them.
__device__ inline void cp_async8(std::uint32_t shared, const void* global, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(shared), "l"(global),
               "r"(valid ? 8 : 0)
               : "memory");
}
__device__ inline void cp_async4(std::uint32_t shared, const void* global, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(shared), "l"(global),
               "r"(valid ? 4 : 0)
               : "memory");
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kPending>
__device__ inline void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}
// The same with a count known only at run time, 0 … kMost (more waits for kMost): the instruction
// takes an immediate, so one of kMost + 1 is chosen.
template <int kMost, int kPending = 0>
__device__ inline void cp_async_wait_at_most(int pending) {
  if constexpr (kPending == kMost) {
    cp_async_wait<kMost>();
  } else if (pending <= kPending) {
    cp_async_wait<kPending>();
  } else {
    cp_async_wait_at_most<kMost, kPending + 1>(pending);
  }
}

__device__ inline void ldmatrix_x4(std::uint32_t (&r)[4], std::uint32_t shared) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared)
               : "memory");
}
__device__ inline void ldmatrix_x2(std::uint32_t (&r)[2], std::uint32_t shared) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(shared)
               : "memory");
}

}  // namespace lmoe::cuda

// Warpgroup tensor-core building blocks (wgmma, sm_90a only): the shared-memory matrix descriptor
// for 128-byte-swizzled, K-major tiles, the fences and the commit/wait of wgmma groups, and one
// m64nNk16 step (N = 16 … 128) with bf16 or f16 operands from shared memory and fp32 accumulators.
// Only the sm_90a pass emits the instructions (no other architecture has them: sm_100a's tensor
// cores speak tcgen05); elsewhere the helpers trap, and the host never launches a kernel that calls
// them on a device that is not compute 9.0 (grouped_gemm.cu). Device code only.
//
// The layout the descriptor describes (PTX ISA, "Shared Memory Matrix Layout", 128B swizzle,
// K-major): rows of 64 16-bit elements (128 bytes) hold consecutive k; 8 rows make a 1024-byte
// swizzle atom; the 16-byte chunk c of row r is stored at chunk c ^ (r % 8) of that row — the
// hardware applies this XOR to address bits [4, 6] with bits [7, 9], so atoms must be 1024-byte
// aligned. That is exactly swizzle128() of warp_mma.cuh. For a descriptor with start address S
// (atom-aligned plus 32·s bytes for the k16 step s of a 64-wide chunk), stride byte offset 1024 and
// the 128B mode, the instruction reads element (m, kk) of its 64 (or N) × 16 operand at
//   S + (m / 8)·1024 + (m % 8)·128 + 2·kk, then bits [4, 6] ^= bits [7, 9]
//   = atom + (m % 8)·128 + 16·((2s + kk / 8) ^ (m % 8)) + 2·(kk % 8),
// which is where the copy put row m's element k = 16s + kk (chunk k / 8 = 2s + kk / 8). The leading
// byte offset is not used by swizzled K-major layouts (one k16 step, 32 bytes, lies inside an
// atom's row); it is set to 1 as the ISA suggests for unused fields. The base offset stays 0:
// adding 32·s < 128 to an atom-aligned address leaves bits [7, 9] — the pattern's phase — at 0.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace lmoe::cuda {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LMOE_HAS_WGMMA 1
#else
#define LMOE_HAS_WGMMA 0
#endif

// Descriptor of a K-major operand tile at shared address `start` (see above).
__device__ inline std::uint64_t wgmma_descriptor_128b(std::uint32_t start) {
  constexpr std::uint64_t kLeadingByteOffset = 1;         // unused by this layout (16 bytes)
  constexpr std::uint64_t kStrideByteOffset = 1024 >> 4;  // from one 8-row atom to the next
  constexpr std::uint64_t kSwizzle128B = 1;               // bits 62-63: 1 = 128-byte swizzle
  return static_cast<std::uint64_t>((start & 0x3ffffu) >> 4) | (kLeadingByteOffset << 16) |
         (kStrideByteOffset << 32) | (kSwizzle128B << 62);
}

// Orders this warpgroup's earlier register accesses (accumulators) before the next wgmma.
__device__ inline void wgmma_fence() {
#if LMOE_HAS_WGMMA
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#else
  __trap();
#endif
}
__device__ inline void wgmma_commit() {
#if LMOE_HAS_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#else
  __trap();
#endif
}
// Waits until at most kPending of this warpgroup's committed wgmma groups are still running.
template <int kPending>
__device__ inline void wgmma_wait() {
#if LMOE_HAS_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
#else
  __trap();
#endif
}

// This thread's writes to shared memory (st.shared, cp.async: the generic proxy) made visible to
// the async proxy, through which wgmma reads its operands; a barrier must follow for other
// threads'.
__device__ inline void fence_proxy_async_shared() {
#if LMOE_HAS_WGMMA
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#else
  __trap();
#endif
}

// Keeps the compiler from moving accesses of an accumulator across the points where the wgmma
// pipeline owns it (between the issue and the wait, the registers belong to the tensor cores).
template <int kCount>
__device__ inline void wgmma_pin(float (&d)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// One wgmma m64nNk16 with scale-d = 1 (d += a·b: the accumulators start at zero, as mma.sync's
// do, so a product of −0 sums to +0 on both paths) and no negation or transpose (both operands
// K-major); one macro per N, whose operand list the instruction fixes.
#define LMOE_WGMMA_M64N16K16(TYPE)                                                          \
  asm volatile(                                                                             \
      "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %10, 0;\n"                        \
      "wgmma.mma_async.sync.aligned.m64n16k16.f32." TYPE "." TYPE                           \
      " {"                                                                                  \
      "%0, %1, %2, %3, %4, %5, %6, %7"                                                      \
      "}, %8, %9, accumulate, 1, 1, 0, 0;\n}\n"                                             \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), \
        "+f"(d[7])                                                                          \
      : "l"(desc_a), "l"(desc_b), "r"(1)                                                    \
      : "memory")

#define LMOE_WGMMA_M64N32K16(TYPE)                                                              \
  asm volatile(                                                                                 \
      "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %18, 0;\n"                            \
      "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE                               \
      " {"                                                                                      \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"                    \
      "}, %16, %17, accumulate, 1, 1, 0, 0;\n}\n"                                               \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),     \
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), \
        "+f"(d[14]), "+f"(d[15])                                                                \
      : "l"(desc_a), "l"(desc_b), "r"(1)                                                        \
      : "memory")

#define LMOE_WGMMA_M64N64K16(TYPE)                                                                 \
  asm volatile(                                                                                    \
      "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %34, 0;\n"                               \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE                                  \
      " {"                                                                                         \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                     \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"             \
      "}, %32, %33, accumulate, 1, 1, 0, 0;\n}\n"                                                  \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),        \
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),    \
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), \
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                                         \
      : "l"(desc_a), "l"(desc_b), "r"(1)                                                           \
      : "memory")

#define LMOE_WGMMA_M64N128K16(TYPE)                                                                \
  asm volatile(                                                                                    \
      "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %66, 0;\n"                               \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE                                 \
      " {"                                                                                         \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                     \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "           \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "           \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"             \
      "}, %64, %65, accumulate, 1, 1, 0, 0;\n}\n"                                                  \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),        \
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),    \
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), \
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), \
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), \
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), \
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), \
        "+f"(d[63])                                                                                \
      : "l"(desc_a), "l"(desc_b), "r"(1)                                                           \
      : "memory")

// d[64 × kN] += A[64 × 16] · B[kN × 16]ᵀ (both K-major in shared memory, through descriptors),
// asynchronously: the result is in `d` after wgmma_commit() and a wgmma_wait() that covers it.
// Accumulator fragment (PTX ISA, "wgmma .m64nNk16" D): thread t of the warpgroup holds d[4j + e]
// at row 16·(t / 32) + (t % 32) / 4 + 8·(e / 2), column 8j + 2·(t % 4) + e % 2.
template <typename T, int kN>
__device__ inline void wgmma_m64nk16(float (&d)[kN / 2], std::uint64_t desc_a,
                                     std::uint64_t desc_b) {
  static_assert(kN == 16 || kN == 32 || kN == 64 || kN == 128, "wgmma_m64nk16: N of 16 … 128");
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>,
                "wgmma_m64nk16: bf16 or f16 operands");
#if LMOE_HAS_WGMMA
#define LMOE_WGMMA_BY_TYPE(N)                       \
  if constexpr (std::is_same_v<T, __nv_bfloat16>) { \
    LMOE_WGMMA_M64N##N##K16("bf16");                \
  } else {                                          \
    LMOE_WGMMA_M64N##N##K16("f16");                 \
  }
  if constexpr (kN == 16) {
    LMOE_WGMMA_BY_TYPE(16)
  } else if constexpr (kN == 32) {
    LMOE_WGMMA_BY_TYPE(32)
  } else if constexpr (kN == 64) {
    LMOE_WGMMA_BY_TYPE(64)
  } else {
    LMOE_WGMMA_BY_TYPE(128)
  }
#undef LMOE_WGMMA_BY_TYPE
#else
  (void)d;
  (void)desc_a;
  (void)desc_b;
  __trap();
#endif
}

template <typename T>
__device__ inline void wgmma_m64n128k16(float (&d)[64], std::uint64_t desc_a,
                                        std::uint64_t desc_b) {
  wgmma_m64nk16<T, 128>(d, desc_a, desc_b);
}

#undef LMOE_WGMMA_M64N16K16
#undef LMOE_WGMMA_M64N32K16
#undef LMOE_WGMMA_M64N64K16
#undef LMOE_WGMMA_M64N128K16

}  // namespace lmoe::cuda

// Hopper's asynchronous building blocks for warp-specialized kernels (sm_90; setmaxnreg sm_90a):
// shared-memory mbarriers (a ring's full and empty pairs, init, arrive, arrive with an expected
// transaction count, wait on a phase's parity), the arrival of a thread's cp.async copies on an
// mbarrier, the bulk tensor copy (TMA) of a 2-D or 3-D box into shared memory completing on an
// mbarrier, the cluster barrier's two halves, and the register reallocation between warpgroups.
// Only the sm_90a pass emits them (LMOE_HAS_WGMMA, warpgroup_mma.cuh: the kernels that use them
// also issue wgmma); elsewhere they trap, and the host launches no kernel that calls them off
// compute 9.0. Also programmatic dependent launch (compute 9.0 and later; no-ops before). Device
// code only.
//
// An mbarrier (PTX ISA, "Parallel Synchronization and Communication Instructions: mbarrier")
// counts the arrivals still expected in its current phase and the transaction bytes still due;
// the phase completes when both reach zero, and the barrier moves to the next phase with the
// arrival count it was initialised with. A waiter names the parity of the phase it waits for: a
// fresh barrier is in phase 0, so waiting on parity 1 (the phase "before" it) returns at once —
// which lets a producer treat every stage as empty in its first round.
#pragma once

#include <cstdint>

#include "cuda/gemm/warpgroup_mma.cuh"

namespace lmoe::cuda {

// The full and empty mbarriers of a ring of kStages shared-memory stages (a producer fills stage s
// and arrives on full(s); the consumers release it through empty(s)). Declared __shared__ in the
// kernel; the accessors give the shared-memory addresses the mbarrier instructions take.
template <int kStages>
struct StageBarriers {
  alignas(8) std::uint64_t full_bars[kStages];
  alignas(8) std::uint64_t empty_bars[kStages];
  __device__ std::uint32_t full(int s) const {
    return static_cast<std::uint32_t>(__cvta_generic_to_shared(&full_bars[s]));
  }
  __device__ std::uint32_t empty(int s) const {
    return static_cast<std::uint32_t>(__cvta_generic_to_shared(&empty_bars[s]));
  }
};

// `count` arrivals per phase; thread 0 of the block calls it, then mbarrier_init_fence() and a
// barrier before any other thread or the copy engine touches the barrier.
__device__ inline void mbarrier_init([[maybe_unused]] std::uint32_t bar,
                                     [[maybe_unused]] std::uint32_t count) {
#if LMOE_HAS_WGMMA
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
#else
  __trap();
#endif
}

// Makes this thread's mbarrier_init()s visible to the async proxy (the copy engine completes
// transactions on the barriers through it).
__device__ inline void mbarrier_init_fence() {
#if LMOE_HAS_WGMMA
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#else
  __trap();
#endif
}

// The cluster's barrier in two halves (PTX barrier.cluster; every thread of every block of the
// cluster calls each, in turn, with the whole warp): arrive, then wait until every thread has
// arrived. A relaxed arrival orders nothing (e.g. at kernel start, so that a later wait proves
// every block of the cluster has started, before any touches another's shared memory); the
// release arrival with the acquiring wait makes the writes before it, shared memory of other
// blocks included, visible after the wait.
__device__ inline void cluster_arrive_relaxed() {
#if LMOE_HAS_WGMMA
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#else
  __trap();
#endif
}

__device__ inline void cluster_arrive_release() {
#if LMOE_HAS_WGMMA
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#else
  __trap();
#endif
}

__device__ inline void cluster_wait() {
#if LMOE_HAS_WGMMA
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
  __trap();
#endif
}

__device__ inline void mbarrier_arrive([[maybe_unused]] std::uint32_t bar) {
#if LMOE_HAS_WGMMA
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
#else
  __trap();
#endif
}

// One arrival, and `bytes` more transaction bytes due in the current phase (the copy engine's
// copies that complete on this barrier pay them off).
__device__ inline void mbarrier_arrive_expect_tx([[maybe_unused]] std::uint32_t bar,
                                                 [[maybe_unused]] std::uint32_t bytes) {
#if LMOE_HAS_WGMMA
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
#else
  __trap();
#endif
}

// Returns once the phase of parity `parity` has completed (try_wait suspends the thread for a
// while in hardware between polls, so the loop does not hammer shared memory).
__device__ inline void mbarrier_wait([[maybe_unused]] std::uint32_t bar,
                                     [[maybe_unused]] std::uint32_t parity) {
#if LMOE_HAS_WGMMA
  std::uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred ready;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 ready, [%1], %2;\n"
        "selp.u32 %0, 1, 0, ready;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (done == 0);
#else
  __trap();
#endif
}

// An arrival on `bar` once every cp.async this thread issued before it has landed. .noinc: the
// arrival is one of the barrier's initial count (the barrier counts the copying threads).
__device__ inline void cp_async_mbarrier_arrive_noinc([[maybe_unused]] std::uint32_t bar) {
#if LMOE_HAS_WGMMA
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
#else
  __trap();
#endif
}

// The box of `map` (a __grid_constant__ kernel parameter) at element coordinates (x, y, z), x the
// innermost, into shared memory at `dst` (the map's swizzle applied; 1024-byte aligned for the
// 128-byte swizzle), completing its bytes on `bar`. Elements outside the tensor arrive as zeros
// and still count as transaction bytes: every box pays the full box size.
__device__ inline void tma_load_3d([[maybe_unused]] std::uint32_t dst,
                                   [[maybe_unused]] const void* map,
                                   [[maybe_unused]] std::uint32_t bar, [[maybe_unused]] int x,
                                   [[maybe_unused]] int y, [[maybe_unused]] int z) {
#if LMOE_HAS_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(dst),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(x), "r"(y), "r"(z), "r"(bar)
      : "memory");
#else
  __trap();
#endif
}

// The 2-D form of tma_load_3d: the box of `map` at (x, y), x the innermost.
__device__ inline void tma_load_2d([[maybe_unused]] std::uint32_t dst,
                                   [[maybe_unused]] const void* map,
                                   [[maybe_unused]] std::uint32_t bar, [[maybe_unused]] int x,
                                   [[maybe_unused]] int y) {
#if LMOE_HAS_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
#else
  __trap();
#endif
}

// `bytes` contiguous bytes of global memory at `src` into shared memory at `dst` (both 16-byte
// aligned, bytes a multiple of 16) by the copy engine without a tensor map, completing on `bar`:
// one request for a whole run, where a box of a tensor map walks its rows.
__device__ inline void bulk_load([[maybe_unused]] std::uint32_t dst,
                                 [[maybe_unused]] const void* src,
                                 [[maybe_unused]] std::uint32_t bytes,
                                 [[maybe_unused]] std::uint32_t bar) {
#if LMOE_HAS_WGMMA
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(dst),
      "l"(reinterpret_cast<std::uint64_t>(src)), "r"(bytes), "r"(bar)
      : "memory");
#else
  __trap();
#endif
}

// Register reallocation between the warpgroups of a block launched with a register cap
// (__launch_bounds__(threads, 1)): the producer gives registers back (kIncrease false), the
// consumers take them. Every thread of the warpgroup executes it; kRegs a multiple of 8 in
// 24 … 256.
template <int kRegs, bool kIncrease>
__device__ inline void setmaxnreg() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg: 24 … 256, by 8");
#if LMOE_HAS_WGMMA
  if constexpr (kIncrease) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
  } else {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
  }
#else
  __trap();
#endif
}

// Programmatic dependent launch (compute 9.0 and later; no-ops before): a kernel calls
// pdl_launch_dependents() to let the next kernel of its stream, launched with the programmatic
// stream serialization attribute, start before it ends; that kernel calls pdl_wait() before it
// reads anything the first one writes (it returns once the first has ended and its writes are
// visible). Without the attribute the next kernel starts after the first as usual.
__device__ inline void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ inline void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Barrier `id` (1 … 15; 0 is __syncthreads') over `threads` threads of the block, whole warps: a
// subset of the warps synchronizes without the others.
__device__ inline void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace lmoe::cuda

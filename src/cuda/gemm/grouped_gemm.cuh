// A grouped GEMM whose group sizes live on the device: for each group g (an expert) with rows
// first[g] … first[g + 1] of A (and of C),
//
//   C[rows of g, N] = A[rows of g, K] · B_gᵀ,   B_g = b + g · b_group_stride, [N, K] row-major,
//
// bf16 or f16 operands, fp32 accumulation on tensor cores (mma.sync m16n8k16), written in fp32, or
// rounded once to the storage dtype, or through the experts' activation: with a second weight
// (the gate) the block multiplies both and writes round(act(gate, up)) — the formula of
// activation_kernel (layer_kernels.cuh) on the same fp32 accumulators, so fusing it changes no bit.
//
// One launch for every group; the host never reads the sizes. The grid is (N tiles) × (a bound
// on the row tiles of all groups): the block with linear id y·gridDim.x + x finds its tile, in
// the launch order of grouped_locate_block, by a prefix over the groups' tile counts (warp 0,
// from `first`), and exits when the id is past the last tile. A
// tile never spans two groups, so a block streams one expert's weights; m-tiles past the group's
// rows are neither loaded nor multiplied (decode: 8 rows per expert fill half an m16 tile).
//
// Each block streams its A rows and B rows through shared memory 64 k at a time (cp.async,
// kStages deep, 128-byte rows XOR-swizzled for ldmatrix), and its warps split the tile in a
// kWarpsM × kWarpsN grid. MXFP4 weights (kPacked shapes) stream packed and are dequantized into the
// same swizzled rows after each stage's wait (grouped_gemm_mxfp4.cuh): the same MMAs and bits.
// Summation order over K: the 64-wide chunks in order, within a chunk the four k16 steps in order,
// each an mma (whose internal order is the hardware's). Device code only.
#pragma once

#include <cstdint>

#include "cuda/gemm/grouped_gemm_mxfp4.cuh"
#include "cuda/gemm/warp_mma.cuh"
#include "cuda/layer/activation.cuh"
#include "cuda/runtime/dtype.cuh"

namespace lmoe::cuda {

// What the kernel reads, by value (host side: grouped_gemm.hpp).
struct GroupedGemmParams {
  const void* a;               // [rows, lda], or indexed through a_rows
  const std::int32_t* a_rows;  // null, or: row r of the grouped space reads A's row a_rows[r]
  std::int64_t lda;
  const void* b;   // [groups, N, K] (+ b_group_stride per group)
  const void* b2;  // the gate weights in the same layout (gated activation), or null
  std::int64_t b_group_stride;
  // MXFP4 weights instead of b and b2 (kPacked shapes): blocks [groups, N, K/2] and scales
  // [groups, N, K/32] bytes, group strides in bytes.
  const std::uint8_t* b_blocks;
  const std::uint8_t* b_scales;
  const std::uint8_t* b2_blocks;
  const std::uint8_t* b2_scales;
  std::int64_t blocks_group_stride, scales_group_stride;
  void* c;  // [rows, ldc]
  std::int64_t ldc;
  std::int64_t n, k;
  const std::int32_t* first;  // [groups + 1] device: group g owns rows first[g] … first[g + 1]
  int groups;
  int out_mode;    // kGroupedOut*
  int copy_bytes;  // 16, 8 or 4: the widest cp.async that K's row pitch allows
  ActivationParams act;
};

inline constexpr int kGroupedOutF32 = 0;
inline constexpr int kGroupedOutRounded = 1;
inline constexpr int kGroupedOutActivation = 2;
inline constexpr int kGroupedTileK = 64;           // 16-bit elements: one 128-byte shared row
inline constexpr int kGroupedMaxGroups = 32 * 32;  // warp 0's prefix: 32 groups per lane

// kPacked: B (and B2) are MXFP4. Each stage then holds A's rows and B's packed rows (Mxfp4Stage),
// and one dequantized B tile of 128-byte rows, shared by the stages, comes first.
template <int kBM, int kBN, int kWM, int kWN, int kStagesT, bool kGatedT, bool kPackedT = false>
struct GroupedShape {
  static constexpr int kRowsM = kBM;
  static constexpr int kColsN = kBN;
  static constexpr int kWarpsM = kWM;
  static constexpr int kWarpsN = kWN;
  static constexpr int kStages = kStagesT;
  static constexpr bool kGated = kGatedT;
  static constexpr bool kPacked = kPackedT;
  static constexpr int kThreads = kWM * kWN * 32;
  static constexpr int kBRows = kGated ? 2 * kBN : kBN;  // up rows, then gate rows
  static constexpr int kWarpRows = kBM / kWM;
  static constexpr int kWarpCols = kBN / kWN;
  static constexpr int kMTiles = kWarpRows / 16;
  static constexpr int kNTiles = kWarpCols / 8;
  static constexpr int kBTileBytes = kPacked ? kBRows * 128 : 0;
  static constexpr int kStageBytes =
      kBM * 128 + (kPacked ? kBRows * (kMxfp4ChunkBytes + kMxfp4ScaleBytes) : kBRows * 128);
  static constexpr int kSharedBytes = kBTileBytes + kStages * kStageBytes;
  static_assert(kWarpRows % 16 == 0 && kWarpCols % 8 == 0, "warp tile of whole mma tiles");
  // Stages start on 128-byte boundaries, where the swizzle keeps ldmatrix free of bank conflicts.
  static_assert(kBTileBytes % 128 == 0 && kStageBytes % 128 == 0, "128-byte aligned stages");
};

// 16 bytes of a shared row from `src` (elements k … k + 8 of a row whose K is a multiple of
// copy_bytes / 2): one cp.async, or 2 or 4 narrower ones; the parts at or past K are zeros.
// Parts that are not read still get a mapped address (`base`).
template <typename T>
__device__ inline void grouped_copy16(std::uint32_t shared, const T* src, const T* base,
                                      std::int64_t k, std::int64_t k_total, bool row_valid,
                                      int copy_bytes) {
  if (copy_bytes == 16) {
    const bool valid = row_valid && k < k_total;
    cp_async16(shared, valid ? src : base, valid);
  } else if (copy_bytes == 8) {
#pragma unroll
    for (int part = 0; part < 2; ++part) {
      const bool valid = row_valid && k + part * 4 < k_total;
      cp_async8(shared + part * 8, valid ? src + part * 4 : base, valid);
    }
  } else {
#pragma unroll
    for (int part = 0; part < 4; ++part) {
      const bool valid = row_valid && k + part * 2 < k_total;
      cp_async4(shared + part * 4, valid ? src + part * 2 : base, valid);
    }
  }
}

// What a block works on: its row tile's group (−1: none, the block exits), the tile's first row
// and its rows in the group, the group's weights and the block's first output column.
template <typename T>
struct GroupedBlockTile {
  int group, row0, rows_here;
  const std::int64_t* a_offset;  // shared: each tile row's element offset in A, or −1 past the end
  const T* b;
  const T* b2;
  Mxfp4Matrix b_packed, b2_packed;  // the group's MXFP4 weights (kPacked shapes)
  std::int64_t col0;
};

// Chunk c (k = 64c … 64c + 63) of the tile's first `a_rows_used` A rows and of its B rows (up rows,
// then gate rows) into a stage: A at `stage`, B kRowsM rows of 128 bytes further, each row's
// 16-byte chunks swizzled (swizzle128). All threads of the block call it; A rows past the group's
// end (offset −1), B rows past N and k at or past K are zeros.
template <typename T, class Shape>
__device__ inline void grouped_load_chunk(const GroupedGemmParams& p,
                                          const GroupedBlockTile<T>& tile, int a_rows_used, int c,
                                          std::uint32_t stage) {
  const int tid = static_cast<int>(threadIdx.x);
  const T* a = static_cast<const T*>(p.a);
  const std::int64_t k0 = static_cast<std::int64_t>(c) * kGroupedTileK;
  for (int i = tid; i < a_rows_used * 8; i += Shape::kThreads) {
    const int row = i >> 3, part = i & 7;
    const std::int64_t k = k0 + part * 8;
    const std::int64_t at = tile.a_offset[row];
    grouped_copy16(stage + swizzle128(row, part), a + (at < 0 ? 0 : at) + k, a, k, p.k, at >= 0,
                   p.copy_bytes);
  }
  const std::uint32_t b_stage = stage + Shape::kRowsM * 128;
  if constexpr (Shape::kPacked) {
    mxfp4_load_chunk<Shape>(tile.b_packed, tile.b2_packed, p.b_blocks, p.b_scales, tile.col0, p.n,
                            p.k, c, b_stage);
  } else {
    for (int i = tid; i < Shape::kBRows * 8; i += Shape::kThreads) {
      const int row = i >> 3, part = i & 7;
      const bool gate = Shape::kGated && row >= Shape::kColsN;
      const std::int64_t col = tile.col0 + (gate ? row - Shape::kColsN : row);
      const std::int64_t k = k0 + part * 8;
      const bool valid = col < p.n;
      const T* matrix = gate ? tile.b2 : tile.b;
      grouped_copy16(b_stage + swizzle128(row, part), matrix + (valid ? col * p.k + k : 0), matrix,
                     k, p.k, valid, p.copy_bytes);
    }
  }
}

// One output element from its fp32 accumulators (the gate's: 0 when the block has none), in the
// output mode's formula — the activation kernel's, so that fusing it changes no bit.
template <typename T>
__device__ inline void grouped_store(const GroupedGemmParams& p, std::int64_t at, float up,
                                     float gate) {
  if (p.out_mode == kGroupedOutF32) {
    static_cast<float*>(p.c)[at] = up;
  } else if (p.out_mode == kGroupedOutRounded) {
    static_cast<T*>(p.c)[at] = Storage<T>::store(up);
  } else {
    static_cast<T*>(p.c)[at] = Storage<T>::store(activate(p.act, gate, up));
  }
}

// Four consecutive output elements (at … at + 3) from their fp32 accumulators by one vector
// store: 16 bytes of fp32, or 8 of the storage dtype. The caller checks that `at` is a multiple of
// 4 and the output 16-byte aligned (grouped_store4_fits). Each element's formula is
// grouped_store's.
template <typename T>
__device__ inline void grouped_store4(const GroupedGemmParams& p, std::int64_t at, float4 up,
                                      float4 gate) {
  if (p.out_mode == kGroupedOutF32) {
    *reinterpret_cast<float4*>(static_cast<float*>(p.c) + at) = up;
    return;
  }
  const bool activation = p.out_mode == kGroupedOutActivation;
  Vec4<T> out;
  out.v[0] = Storage<T>::store(activation ? activate(p.act, gate.x, up.x) : up.x);
  out.v[1] = Storage<T>::store(activation ? activate(p.act, gate.y, up.y) : up.y);
  out.v[2] = Storage<T>::store(activation ? activate(p.act, gate.z, up.z) : up.z);
  out.v[3] = Storage<T>::store(activation ? activate(p.act, gate.w, up.w) : up.w);
  *reinterpret_cast<Vec4<T>*>(static_cast<T*>(p.c) + at) = out;
}

// Whether grouped_store4 may write rows of C: ldc a multiple of 4 elements and C 16-byte aligned
// (so every fourth element of a row is 8- or 16-byte aligned).
__device__ inline bool grouped_store4_fits(const GroupedGemmParams& p) {
  return p.ldc % 4 == 0 && reinterpret_cast<std::uintptr_t>(p.c) % 16 == 0;
}

struct GroupedTileSpan {
  int group, row0, row_end;  // the group, the tile's first row and the group's end (rows)
  std::int64_t col_tile;
};

// Row tiles per band of the launch order (grouped_locate_block).
inline constexpr int kGroupedBandRows = 8;

// Which tile block `id` of the grid computes (warp 0 calls it). The launch order runs group by
// group (an expert's blocks together), and inside a group band by band of up to kGroupedBandRows
// row tiles, row tile fastest, then the next column tile. So an expert's weights come from HBM
// once (a column tile of them serves all the band's row tiles while it is in L2) and the band's
// rows (A) stay in L2 across the column tiles. All column tiles of one row tile before the next
// would stream the weights once per row tile; bands across groups would split an expert over two
// bands about every other time, reading its weights twice (docs/layer.md).
//
// Lane i sums the blocks (row tiles × column tiles) of groups [i·per, (i + 1)·per), a warp scan
// gives each lane its first block, and the lane whose range holds `id` walks its groups and writes
// the tile to `span` (group −1: no group owns it; the grid is a bound).
template <int kRowsM>
__device__ inline void grouped_locate_block(const GroupedGemmParams& p, std::int64_t id,
                                            std::int64_t cols, int lane, GroupedTileSpan& span) {
  if (lane == 0) span.group = -1;
  const int per = (p.groups + 31) / 32;
  const int g0 = min(lane * per, p.groups), g1 = min(g0 + per, p.groups);
  std::int64_t blocks = 0;
  for (int g = g0; g < g1; ++g) blocks += (p.first[g + 1] - p.first[g] + kRowsM - 1) / kRowsM;
  blocks *= cols;
  std::int64_t inclusive = blocks;
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const std::int64_t other = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  __syncwarp();
  std::int64_t start = inclusive - blocks;
  if (id < start || id >= inclusive) return;
  for (int g = g0; g < g1; ++g) {
    const int first = p.first[g], rows = p.first[g + 1] - first;
    const std::int64_t tiles = (rows + kRowsM - 1) / kRowsM;
    if (id < start + tiles * cols) {
      const std::int64_t within = id - start;
      const std::int64_t band = within / (kGroupedBandRows * cols);
      const std::int64_t band_rows =
          min(static_cast<std::int64_t>(kGroupedBandRows), tiles - band * kGroupedBandRows);
      const std::int64_t in_band = within - band * kGroupedBandRows * cols;
      span.group = g;
      span.row0 =
          first + static_cast<int>((band * kGroupedBandRows + in_band % band_rows) * kRowsM);
      span.row_end = first + rows;
      span.col_tile = in_band / band_rows;
      return;
    }
    start += tiles * cols;
  }
}

// Finds the block's tile (warp 0) and, when a group owns it, the element offset in A of each of its
// rows (through the a_rows gather; −1 past the group's end), in shared memory. All threads of the
// block call it, once.
template <typename T, class Shape>
__device__ inline GroupedBlockTile<T> grouped_block_tile(const GroupedGemmParams& p) {
  __shared__ GroupedTileSpan span;
  __shared__ std::int64_t a_offset[Shape::kRowsM];
  const int tid = static_cast<int>(threadIdx.x);
  if (tid < 32) {
    const std::int64_t cols = gridDim.x;
    grouped_locate_block<Shape::kRowsM>(
        p, static_cast<std::int64_t>(blockIdx.y) * cols + blockIdx.x, cols, tid, span);
  }
  __syncthreads();
  GroupedBlockTile<T> tile{};
  tile.group = span.group;
  if (tile.group < 0) return tile;  // past the last tile of the last group: the grid is a bound
  tile.row0 = span.row0;
  tile.rows_here = min(span.row_end - tile.row0, Shape::kRowsM);
  for (int r = tid; r < Shape::kRowsM; r += Shape::kThreads) {
    const int row = tile.row0 + r;
    a_offset[r] = r < tile.rows_here ? (p.a_rows ? p.a_rows[row] : row) * p.lda : -1;
  }
  tile.a_offset = a_offset;
  if constexpr (Shape::kPacked) {
    tile.b_packed = {p.b_blocks + tile.group * p.blocks_group_stride,
                     p.b_scales + tile.group * p.scales_group_stride};
    if (Shape::kGated) {
      tile.b2_packed = {p.b2_blocks + tile.group * p.blocks_group_stride,
                        p.b2_scales + tile.group * p.scales_group_stride};
    }
  } else {
    tile.b = static_cast<const T*>(p.b) + tile.group * p.b_group_stride;
    tile.b2 = Shape::kGated ? static_cast<const T*>(p.b2) + tile.group * p.b_group_stride : nullptr;
  }
  tile.col0 = span.col_tile * Shape::kColsN;
  __syncthreads();
  return tile;
}

template <typename T, class Shape>
__global__ void __launch_bounds__(Shape::kThreads) grouped_gemm_kernel(GroupedGemmParams p) {
  extern __shared__ __align__(128) unsigned char grouped_smem[];
  const GroupedBlockTile<T> tile = grouped_block_tile<T, Shape>(p);
  if (tile.group < 0) return;
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32, lane = tid % 32;
  const int row0 = tile.row0, rows_here = tile.rows_here;
  const std::int64_t col0 = tile.col0;
  const int m_used = (rows_here + 15) / 16;  // m-tiles holding rows of the group
  // The dequantized B tile (kPacked shapes), then the stages.
  const std::uint32_t b_tile = static_cast<std::uint32_t>(__cvta_generic_to_shared(grouped_smem));
  const std::uint32_t smem = b_tile + Shape::kBTileBytes;
  const int chunks = static_cast<int>((p.k + kGroupedTileK - 1) / kGroupedTileK);

  auto load_chunk = [&](int c, std::uint32_t stage) {
    grouped_load_chunk<T, Shape>(p, tile, m_used * 16, c, stage);
  };

  const int wm = warp / Shape::kWarpsN, wn = warp % Shape::kWarpsN;
  constexpr int kMats = Shape::kGated ? 2 : 1;
  float acc[kMats][Shape::kMTiles][Shape::kNTiles][4] = {};

  // The first kStages - 1 chunks; chunk i ≥ kStages - 1 is committed by iteration i - kStages + 1,
  // and at most kStages - 2 groups come after it (empty groups keep the count uniform).
#pragma unroll
  for (int i = 0; i < Shape::kStages - 1; ++i) {
    if (i < chunks) load_chunk(i, smem + i * Shape::kStageBytes);
    cp_async_commit();
  }
  for (int i = 0; i < chunks; ++i) {
    cp_async_wait<Shape::kStages - 2>();
    __syncthreads();  // chunk i is in every thread's view; every warp is done with chunk i - 1
    const int next = i + Shape::kStages - 1;
    if (next < chunks) load_chunk(next, smem + (next % Shape::kStages) * Shape::kStageBytes);
    cp_async_commit();
    const std::uint32_t a_stage = smem + (i % Shape::kStages) * Shape::kStageBytes;
    std::uint32_t b_stage = a_stage + Shape::kRowsM * 128;
    if constexpr (Shape::kPacked) {
      const int packed =
          Shape::kBTileBytes + (i % Shape::kStages) * Shape::kStageBytes + Shape::kRowsM * 128;
      mxfp4_dequantize_chunk<T, Shape>(tile.b_packed, tile.b2_packed, col0, p.k, i,
                                       grouped_smem + packed, grouped_smem);
      __syncthreads();  // the tile is whole before any warp's ldmatrix reads it
      b_stage = b_tile;
    }
#pragma unroll
    for (int ks = 0; ks < kGroupedTileK / 16; ++ks) {
      std::uint32_t bf[kMats][Shape::kNTiles][2];
#pragma unroll
      for (int mat = 0; mat < kMats; ++mat) {
#pragma unroll
        for (int nt = 0; nt < Shape::kNTiles; ++nt) {
          const int row = mat * Shape::kColsN + wn * Shape::kWarpCols + nt * 8 + (lane & 7);
          ldmatrix_x2(bf[mat][nt], b_stage + swizzle128(row, 2 * ks + ((lane >> 3) & 1)));
        }
      }
#pragma unroll
      for (int mt = 0; mt < Shape::kMTiles; ++mt) {
        const int m_tile = wm * Shape::kMTiles + mt;
        if (m_tile >= m_used) continue;  // the same for the whole warp
        std::uint32_t af[4];
        ldmatrix_x4(af, a_stage + swizzle128(m_tile * 16 + (lane & 15), 2 * ks + (lane >> 4)));
#pragma unroll
        for (int mat = 0; mat < kMats; ++mat) {
#pragma unroll
          for (int nt = 0; nt < Shape::kNTiles; ++nt)
            mma_m16n8k16<T>(acc[mat][mt][nt], af, bf[mat][nt]);
        }
      }
    }
  }
  cp_async_wait<0>();

  // Fragment layout of m16n8: c[0], c[1] at (g, 2q), (g, 2q + 1); c[2], c[3] at row g + 8.
  const int g = lane / 4, q = lane % 4;
#pragma unroll
  for (int mt = 0; mt < Shape::kMTiles; ++mt) {
    const int m_tile = wm * Shape::kMTiles + mt;
    if (m_tile >= m_used) continue;
#pragma unroll
    for (int nt = 0; nt < Shape::kNTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = m_tile * 16 + g + (e >= 2 ? 8 : 0);
        const std::int64_t col = col0 + wn * Shape::kWarpCols + nt * 8 + 2 * q + (e & 1);
        if (r >= rows_here || col >= p.n) continue;
        const std::int64_t at = static_cast<std::int64_t>(row0 + r) * p.ldc + col;
        const float gate = Shape::kGated ? acc[kMats - 1][mt][nt][e] : 0.0f;
        grouped_store<T>(p, at, acc[0][mt][nt][e], gate);
      }
    }
  }
}

}  // namespace lmoe::cuda

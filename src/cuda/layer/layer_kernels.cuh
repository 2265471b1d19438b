// The layer's kernels before the tail: the router's selection, row gathers, the experts'
// activations and the weighted combine. Device code only; launchers in layer_kernels.cu.
//
// Every formula is the CPU executor's (src/cpu/cpu_layer_executor.cpp, src/core/router.cpp,
// src/core/expert_activation.hpp), written with explicit _rn intrinsics so that nvcc cannot fuse a
// product and a sum into an FMA the CPU does not have. exp and tanh are CUDA's (within 2 ulp of the
// C library's), the only difference the contract allows (docs/numerics.md, "The layer").
#pragma once

#include <cstdint>

#include <cub/block/block_scan.cuh>

#include "cuda/layer/activation.cuh"
#include "cuda/layer/layer_kernels.hpp"
#include "cuda/runtime/dtype.cuh"

namespace lmoe::cuda {

// What the router kernel needs of RouterConfig, by value.
struct RouterParams {
  int experts;
  int top_k;
  int n_group;
  int topk_group;
  bool softmax;
  bool has_bias;
  bool renormalize;
  float scale;
  int parts;  // each expert's logit is the sum of this many values (a split weight's GEMM outputs)
};

// The CPU router's ranking (src/core/router.cpp, ranks_before): larger first, equal values
// (+0 = −0) by lower index, NaN after every number. A strict total order on distinct indices.
__device__ inline bool ranks_before(float value_a, int index_a, float value_b, int index_b) {
  const bool nan_a = isnan(value_a);
  const bool nan_b = isnan(value_b);
  if (nan_a != nan_b) return nan_b;
  if (!nan_a && value_a != value_b) return value_a > value_b;
  return index_a < index_b;
}

// The route kernel's block: a whole number of warps, at most kRouteWarps.
inline constexpr int kRouteWarps = 8;

// One block per token. Shared memory: scores [E], biased [E], group scores [n_group], group
// eligibility [n_group], the selected ids [k], the candidates [E].
//
// Selection: an eligible expert's rank is the number of eligible experts that rank before it;
// those with rank < k are the k best, in order — exactly what the CPU's partial_sort under the same
// strict total order picks. Ranking every expert against all others puts E dependent shared-memory
// reads on the thread that holds the best one, so only candidates are ranked: τ is the k-th best
// of k or more distinct eligible experts (each warp's best few of its threads' bests), so at least
// k eligible experts rank at or before τ and the k best are among those (the candidates); and
// whatever ranks before a candidate is a candidate too, so a candidate's rank among candidates is
// its rank among all eligible experts. The candidates' order in shared memory depends on
// scheduling; their ranks, and so the result, do not.
__global__ void route_kernel(const float* __restrict__ logits, const float* __restrict__ bias,
                             RouterParams p, std::int32_t* __restrict__ ids,
                             float* __restrict__ weights) {
  extern __shared__ float router_smem[];
  float* scores = router_smem;
  float* biased = scores + p.experts;
  float* group_scores = biased + p.experts;
  int* group_ok = reinterpret_cast<int*>(group_scores + p.n_group);
  int* selected = group_ok + p.n_group;
  int* candidates = selected + p.top_k;
  __shared__ float softmax_max, softmax_sum;

  const std::int64_t token = blockIdx.x;
  const float* row = logits + token * p.experts * p.parts;
  const int tid = static_cast<int>(threadIdx.x), threads = static_cast<int>(blockDim.x);

  // The logits first (in `scores`): part 0, plus part 1, plus part 2, in that order.
  for (int e = tid; e < p.experts; e += threads) {
    float logit = row[e];
    for (int part = 1; part < p.parts; ++part) logit = __fadd_rn(logit, row[part * p.experts + e]);
    scores[e] = logit;
  }
  __syncthreads();
  if (!p.softmax) {
    for (int e = tid; e < p.experts; e += threads) scores[e] = sigmoid_rn(scores[e]);
  } else {
    // The max and the sum in id order, by one thread: the CPU's sequential order (and its
    // std::max, which keeps the first of equal values and skips NaN after the first element).
    if (tid == 0) {
      float max_logit = scores[0];
      for (int e = 1; e < p.experts; ++e) {
        max_logit = max_logit < scores[e] ? scores[e] : max_logit;
      }
      softmax_max = max_logit;
    }
    __syncthreads();
    for (int e = tid; e < p.experts; e += threads) {
      scores[e] = expf(__fsub_rn(scores[e], softmax_max));
    }
    __syncthreads();
    if (tid == 0) {
      float sum = 0.0f;
      for (int e = 0; e < p.experts; ++e) sum = __fadd_rn(sum, scores[e]);
      softmax_sum = sum;
    }
    __syncthreads();
    for (int e = tid; e < p.experts; e += threads) scores[e] = __fdiv_rn(scores[e], softmax_sum);
  }
  __syncthreads();
  for (int e = tid; e < p.experts; e += threads) {
    biased[e] = p.has_bias ? __fadd_rn(scores[e], bias[e]) : scores[e];
  }
  __syncthreads();

  const int group_size = p.experts / p.n_group;
  if (p.n_group > 1) {
    for (int g = tid; g < p.n_group; g += threads) {
      // The group's two best experts in ranking order, as the CPU scans them.
      int first = g * group_size, second = -1;
      for (int e = first + 1; e < (g + 1) * group_size; ++e) {
        if (ranks_before(biased[e], e, biased[first], first)) {
          second = first;
          first = e;
        } else if (second < 0 || ranks_before(biased[e], e, biased[second], second)) {
          second = e;
        }
      }
      float value = biased[first];
      if (p.has_bias && second >= 0) value = __fadd_rn(biased[first], biased[second]);
      group_scores[g] = value;
    }
    __syncthreads();
    for (int g = tid; g < p.n_group; g += threads) {
      int rank = 0;
      for (int other = 0; other < p.n_group; ++other) {
        if (ranks_before(group_scores[other], other, group_scores[g], g)) ++rank;
      }
      group_ok[g] = rank < p.topk_group;
    }
    __syncthreads();
  }

  const auto eligible = [&](int e) { return p.n_group <= 1 || group_ok[e / group_size] != 0; };
  const auto before = [&](int a, int b) { return ranks_before(biased[a], a, biased[b], b); };
  __shared__ int representatives[kRouteWarps * 32];
  __shared__ int threshold, candidate_count;
  // Each warp's best `per_warp` of its threads' best eligible experts, in warp rank order.
  const int lane = tid % 32, warp = tid / 32, warps = threads / 32;
  const int per_warp = min(32, (p.top_k + warps - 1) / warps);
  int best = -1;
  for (int e = tid; e < p.experts; e += threads) {
    if (eligible(e) && (best < 0 || before(e, best))) best = e;
  }
  int warp_rank = 0;
  for (int other = 0; other < 32; ++other) {
    const int rival = __shfl_sync(0xffffffffu, best, other);
    if (rival >= 0 && best >= 0 && before(rival, best)) ++warp_rank;
  }
  if (lane < per_warp) representatives[warp * per_warp + lane] = -1;
  if (tid == 0) {
    threshold = -1;
    candidate_count = 0;
  }
  __syncwarp();
  if (best >= 0 && warp_rank < per_warp) representatives[warp * per_warp + warp_rank] = best;
  __syncthreads();
  // τ: the representative with k − 1 representatives before it; none when they are fewer than k.
  for (int i = tid; i < warps * per_warp; i += threads) {
    const int e = representatives[i];
    if (e < 0) continue;
    int rank = 0;
    for (int j = 0; j < warps * per_warp && rank < p.top_k; ++j) {
      const int rival = representatives[j];
      if (rival >= 0 && before(rival, e)) ++rank;
    }
    if (rank == p.top_k - 1) threshold = e;
  }
  __syncthreads();
  const int tau = threshold;
  for (int e = tid; e < p.experts; e += threads) {
    if (eligible(e) && (tau < 0 || e == tau || before(e, tau))) {
      candidates[atomicAdd(&candidate_count, 1)] = e;
    }
  }
  __syncthreads();
  const int count = candidate_count;
  for (int i = tid; i < count; i += threads) {
    const int e = candidates[i];
    int rank = 0;
    for (int j = 0; j < count && rank < p.top_k; ++j) {
      if (before(candidates[j], e)) ++rank;
    }
    if (rank < p.top_k) selected[rank] = e;
  }
  __syncthreads();

  if (tid == 0) {
    std::int32_t* token_ids = ids + token * p.top_k;
    float* token_weights = weights + token * p.top_k;
    float sum = 0.0f;  // in rank order from +0, as the CPU
    for (int j = 0; j < p.top_k; ++j) {
      token_ids[j] = selected[j];
      sum = __fadd_rn(sum, scores[selected[j]]);
    }
    for (int j = 0; j < p.top_k; ++j) {
      float weight = scores[selected[j]];
      if (p.renormalize) weight = sum > 0.0f ? __fdiv_rn(weight, sum) : 0.0f;
      token_weights[j] = __fmul_rn(weight, p.scale);
    }
  }
}

template <typename T>
__global__ void to_float_kernel(const T* __restrict__ x, float* __restrict__ out,
                                std::int64_t count) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    out[i] = Storage<T>::load(x[i]);
  }
}

// V: the unit copied (16, 8, 4 or 2 bytes); pitches and cols in units of V.
template <typename V>
__global__ void gather_rows_kernel(const V* __restrict__ src, std::int64_t src_ld,
                                   const std::int32_t* __restrict__ rows, V* __restrict__ dst,
                                   std::int64_t count, std::int64_t cols,
                                   const std::int32_t* __restrict__ count_device) {
  if (count_device != nullptr) count = min(count, static_cast<std::int64_t>(*count_device));
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < count * cols; i += stride) {
    const std::int64_t row = i / cols, col = i - row * cols;
    dst[i] = src[static_cast<std::int64_t>(rows[row]) * src_ld + col];
  }
}

// out[i] = round(activation(gate[i], up[i])) for count elements (gate null: not gated).
// kVector: gate, up and out aligned to four elements, so a thread reads one float4 of each and
// stores four outputs at once; the elements past the last four are the scalar loop's.
template <typename T, bool kVector>
__global__ void activation_kernel(const float* __restrict__ gate, const float* __restrict__ up,
                                  T* __restrict__ out, std::int64_t count, ActivationParams p) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  std::int64_t scalar_begin = 0;
  if constexpr (kVector) {
    const std::int64_t quads = count / 4;
    for (std::int64_t i = first; i < quads; i += stride) {
      const float4 u = reinterpret_cast<const float4*>(up)[i];
      const float4 g = gate ? reinterpret_cast<const float4*>(gate)[i] : float4{};
      Vec4<T> result;
      result.v[0] = Storage<T>::store(activate(p, g.x, u.x));
      result.v[1] = Storage<T>::store(activate(p, g.y, u.y));
      result.v[2] = Storage<T>::store(activate(p, g.z, u.z));
      result.v[3] = Storage<T>::store(activate(p, g.w, u.w));
      reinterpret_cast<Vec4<T>*>(out)[i] = result;
    }
    scalar_begin = quads * 4;
  }
  for (std::int64_t i = scalar_begin + first; i < count; i += stride) {
    out[i] = Storage<T>::store(activate(p, gate ? gate[i] : 0.0f, up[i]));
  }
}

// routed[t, c] = round(Σ_j weights[t, j] · slot_out[slot_rows[t, j], c]) in slot order j = 0 …
// k − 1, products and sums rounded one by one (the CPU executor's loop). Four slots' rows are
// loaded before their products are summed, so a thread has four loads in flight instead of one
// (the sum's order does not change). kVector: cols a multiple of four and slot_out 16-byte
// aligned, so a thread reads one float4 per slot and stores four columns.
template <typename T, bool kVector>
__global__ void combine_kernel(const float* __restrict__ slot_out,
                               const std::int32_t* __restrict__ slot_rows,
                               const float* __restrict__ weights, T* __restrict__ routed,
                               std::int64_t num_tokens, std::int64_t top_k, std::int64_t cols) {
  constexpr int kWidth = kVector ? 4 : 1;  // columns per thread
  constexpr int kBatch = 4;                // slots loaded together
  const std::int64_t units = cols / kWidth;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < num_tokens * units; i += stride) {
    const std::int64_t token = i / units, col = (i - token * units) * kWidth;
    const std::int64_t first = token * top_k;
    float sum[kWidth] = {};
    for (std::int64_t j0 = 0; j0 < top_k; j0 += kBatch) {
      float value[kBatch][kWidth];
      float weight[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        if (j0 + b >= top_k) break;
        weight[b] = weights[first + j0 + b];
        const float* row = slot_out + static_cast<std::int64_t>(slot_rows[first + j0 + b]) * cols;
        if constexpr (kVector) {
          const float4 v = *reinterpret_cast<const float4*>(row + col);
          value[b][0] = v.x;
          value[b][1] = v.y;
          value[b][2] = v.z;
          value[b][3] = v.w;
        } else {
          value[b][0] = row[col];
        }
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        if (j0 + b >= top_k) break;
#pragma unroll
        for (int c = 0; c < kWidth; ++c) {
          const float product = __fmul_rn(weight[b], value[b][c]);
          sum[c] = j0 + b == 0 ? product : __fadd_rn(sum[c], product);
        }
      }
    }
    if constexpr (kVector) {
      Vec4<T> result;
#pragma unroll
      for (int c = 0; c < 4; ++c) result.v[c] = Storage<T>::store(sum[c]);
      *reinterpret_cast<Vec4<T>*>(routed + token * cols + col) = result;
    } else {
      routed[i] = Storage<T>::store(sum[0]);
    }
  }
}

// ---- the device path of the routed experts (docs/layer.md, "Capturable forwards") -------------

inline constexpr int kSortThreads = 1024;
inline constexpr int kSortWarps = kSortThreads / 32;
static_assert(kSortMaxExperts <= kSortThreads, "one expert per thread in the scan");

// The host path's counting sort (cuda_layer_executor.cpp, sort_slots) on the device, bit for bit:
// the slots s = t·k + j grouped by expert in slot order (tokens ascending within an expert), each
// expert's rows padded to a multiple of row_align with token 0; first [E + 1] the first grouped
// row of each expert (padded), row_of_slot [S] each slot's grouped row, token_of_row [first[E]]
// each grouped row's token. One block of 1024 threads; shared memory: per-warp counts [32][E]
// and first [E + 1].
//
// The slots are cut into 32 contiguous segments, one per warp, walked 32 at a time; lanes with
// the same expert find each other with __match_any_sync, so a lane's rank among them is the
// number of lower lanes in its match mask. Pass 1 counts each expert's slots per segment; a
// prefix over the segments (in segment order) and a block scan over the experts give every
// (segment, expert) its first row; pass 2 walks the segments again and places each slot. Every
// position depends only on the ids, never on scheduling. An id outside 0 … E − 1 (the router
// never writes one) is not placed: its slot reads grouped row 0.
__global__ void __launch_bounds__(kSortThreads)
    sort_slots_kernel(const std::int32_t* __restrict__ ids, std::int64_t slot_count, int experts,
                      int top_k, int row_align, std::int32_t* __restrict__ first,
                      std::int32_t* __restrict__ row_of_slot,
                      std::int32_t* __restrict__ token_of_row) {
  extern __shared__ int sort_smem[];
  int* warp_counts = sort_smem;  // [32][E]: counts, then each warp's first offset
  int* first_row = sort_smem + kSortWarps * experts;  // [E + 1]
  using Scan = cub::BlockScan<int, kSortThreads>;
  __shared__ typename Scan::TempStorage scan_storage;

  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  for (int i = tid; i < kSortWarps * experts; i += kSortThreads) warp_counts[i] = 0;
  __syncthreads();

  const std::int64_t begin = slot_count * warp / kSortWarps,
                     end = slot_count * (warp + 1) / kSortWarps;
  int* my_counts = warp_counts + warp * experts;
  const unsigned lower_lanes = (1u << lane) - 1u;
  for (std::int64_t base = begin; base < end; base += 32) {
    const std::int64_t s = base + lane;
    int e = s < end ? ids[s] : -1;
    if (e >= experts) e = -1;
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    if (e >= 0 && (peers & lower_lanes) == 0) my_counts[e] += __popc(peers);
    __syncwarp();
  }
  __syncthreads();

  int total = 0, padded = 0;
  if (tid < experts) {
    for (int w = 0; w < kSortWarps; ++w) {
      const int count = warp_counts[w * experts + tid];
      warp_counts[w * experts + tid] = total;  // the expert's rows before segment w's
      total += count;
    }
    padded = (total + row_align - 1) / row_align * row_align;
  }
  int start = 0, rows = 0;
  Scan(scan_storage).ExclusiveSum(padded, start, rows);
  if (tid < experts) {
    first_row[tid] = start;
    first[tid] = start;
    for (int r = start + total; r < start + padded; ++r) token_of_row[r] = 0;
  }
  if (tid == 0) {
    first_row[experts] = rows;
    first[experts] = rows;
  }
  __syncthreads();

  for (std::int64_t base = begin; base < end; base += 32) {
    const std::int64_t s = base + lane;
    int e = s < end ? ids[s] : -1;
    if (e >= experts) e = -1;
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    if (e >= 0) {
      const int row = first_row[e] + my_counts[e] + __popc(peers & lower_lanes);
      row_of_slot[s] = row;
      token_of_row[row] = static_cast<std::int32_t>(s / top_k);
    } else if (s < end) {
      row_of_slot[s] = 0;
    }
    __syncwarp();
    if (e >= 0 && (peers & lower_lanes) == 0) my_counts[e] += __popc(peers);
    __syncwarp();
  }
}

}  // namespace lmoe::cuda

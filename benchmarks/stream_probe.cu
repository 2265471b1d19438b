// lmoe_stream_probe: how fast can a block-tiled cp.async pipeline stream a weight matrix from HBM?
//
// The fused tail's stripe product (src/cuda/fused/fused_tail.cuh) streams w_up [d, l] through
// shared memory in tiles of `cols` weight rows × `seg` bytes of K per pipeline stage. At decode
// sizes that stream is the whole cost, and the fused kernel streams slower than a copy does
// (docs/fused.md). This program isolates the stream: the same cp.async ring with nothing else
// (no norm, no MMA, no epilogue), for several tile geometries, pipeline depths, blocks per SM and
// two ways of dealing the work out:
//
//   items    a block takes whole (tile, K split) items, grid-stride (the fused kernel today);
//   balanced every block takes an equal contiguous run of (tile, K segment) units, crossing tile
//            boundaries (stream-K), so no SM has more bytes to read than another.
//
// Against a plain vectorized read of the same bytes. Kernel time from CUDA events over
// back-to-back launches; prints a table and, with --json FILE, JSON. Asserts nothing.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "graph_timer.hpp"
#include "plain_read.cuh"

namespace {

constexpr int kThreads = 256;

__device__ inline void cp_async16(std::uint32_t shared, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared), "l"(global) : "memory");
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kPending>
__device__ inline void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

struct StreamParams {
  const std::byte* w = nullptr;  // [rows, row_bytes]
  std::int64_t rows = 0, row_bytes = 0;
  int cols = 0;             // weight rows per tile
  int seg = 0;              // bytes of a row per stage
  std::int64_t splits = 1;  // items mode: K splits per tile
  bool balanced = false;
  unsigned* sink = nullptr;
};

// Issues unit u (tile u / segs, segment u % segs) into `stage`.
__device__ inline void issue_unit(const StreamParams& p, std::int64_t tile, std::int64_t segment,
                                  std::uint32_t stage) {
  const int pieces_per_row = p.seg / 16;
  const int pieces = p.cols * pieces_per_row;
  for (int i = static_cast<int>(threadIdx.x); i < pieces; i += kThreads) {
    const int row = i / pieces_per_row, piece = i % pieces_per_row;
    const std::int64_t r = tile * p.cols + row;
    const std::byte* src = p.w + r * p.row_bytes + segment * p.seg + piece * 16;
    cp_async16(stage + static_cast<std::uint32_t>(i * 16), src);
  }
}

template <int kStages>
__global__ void __launch_bounds__(kThreads) stream_kernel(StreamParams p) {
  extern __shared__ __align__(128) std::byte ring[];
  const std::uint32_t smem = static_cast<std::uint32_t>(__cvta_generic_to_shared(ring));
  const std::uint32_t stage_bytes = static_cast<std::uint32_t>(p.cols * p.seg);
  const std::int64_t segs = p.row_bytes / p.seg;
  const std::int64_t tiles = p.rows / p.cols;
  // This block's units as (first, count) runs of consecutive units of one tile's K range.
  std::int64_t u0, u1;
  if (p.balanced) {
    const std::int64_t units = tiles * segs;
    u0 = blockIdx.x * units / gridDim.x;
    u1 = (blockIdx.x + 1) * units / gridDim.x;
  } else {
    u0 = 0;
    u1 = 0;
  }
  unsigned acc = 0;
  // One pipeline over all of this block's units (items mode: its items one after another).
  auto unit_at = [&](std::int64_t i, std::int64_t& tile, std::int64_t& segment) {
    if (p.balanced) {
      const std::int64_t u = u0 + i;
      tile = u / segs;
      segment = u % segs;
    } else {
      const std::int64_t per_item = segs / p.splits;
      const std::int64_t item = blockIdx.x + (i / per_item) * gridDim.x;
      tile = item / p.splits;
      segment = (item % p.splits) * per_item + i % per_item;
    }
  };
  std::int64_t n;
  if (p.balanced) {
    n = u1 - u0;
  } else {
    const std::int64_t items = tiles * p.splits;
    const std::int64_t mine =
        items > blockIdx.x ? (items - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    n = mine * (segs / p.splits);
  }
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < n) {
      std::int64_t tile, segment;
      unit_at(i, tile, segment);
      issue_unit(p, tile, segment, smem + i * stage_bytes);
    }
    cp_async_commit();
  }
  for (std::int64_t i = 0; i < n; ++i) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const std::int64_t next = i + kStages - 1;
    if (next < n) {
      std::int64_t tile, segment;
      unit_at(next, tile, segment);
      issue_unit(p, tile, segment, smem + static_cast<std::uint32_t>(next % kStages) * stage_bytes);
    }
    cp_async_commit();
    // Touch the landed stage (one word per thread) so the stream has a consumer.
    acc ^= reinterpret_cast<const unsigned*>(
        ring + (i % kStages) * stage_bytes)[threadIdx.x % (stage_bytes / 4)];
  }
  cp_async_wait<0>();
  if (acc == 0x9e3779b9u) *p.sink = acc;  // never true for these inputs; keeps the loads alive
}

// Register rings (the decode kernel's way, cuda/fused_decode.cuh): no shared memory; each thread
// keeps kDepth 16-byte loads in flight in registers and consumes the oldest before reloading its
// slot. Groups of 8 rows are dealt evenly over one block of 16 warps per SM.
//   rows8: lane (g, q) = (lane / 4, lane % 4) reads row g of the group, 16 bytes at 64 s + 16 q
//          of its warp's sixteenth of the row: one load instruction reads 64 bytes of 8 rows
//          (the mma fragment's layout);
//   lines: lane (r, j) = (lane / 8, lane % 8) reads row r of a quad, 16 bytes at 128 s + 16 j of
//          its warp's lines: one load instruction reads whole 128-byte lines of 4 rows.
// kCache: 0 ld.global.nc.L1::no_allocate.L2::128B (the decode kernel's), 1 ld.global (plain),
// 2 ld.global.cs.
constexpr int kRingThreads = 512;

template <int kCache>
__device__ inline uint4 ring_load(const std::byte* pointer) {
  uint4 v;
  if constexpr (kCache == 0) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(pointer));
  } else if constexpr (kCache == 1) {
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(pointer));
  } else {
    asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(pointer));
  }
  return v;
}

template <int kDepth, bool kLines, int kCache>
__global__ void __launch_bounds__(kRingThreads, 1)
    register_ring_kernel(const std::byte* w, std::int64_t rows, std::int64_t row_bytes,
                         unsigned* sink) {
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  constexpr int kWarps = kRingThreads / 32;
  const std::int64_t groups = rows / 8;
  const std::int64_t group_first = blockIdx.x * groups / gridDim.x;
  const std::int64_t block_rows = ((blockIdx.x + 1) * groups / gridDim.x - group_first) * 8;
  const std::byte* base = w + group_first * 8 * row_bytes;
  // Item i of this warp: (row block i / per_rows, piece i % per_rows).
  int per_rows, row_sets;
  std::int64_t row_stride;
  const std::byte* at;
  if constexpr (kLines) {
    const int lines = static_cast<int>(row_bytes / 128);
    const int first = warp * lines / kWarps;
    per_rows = (warp + 1) * lines / kWarps - first;
    row_sets = static_cast<int>(block_rows / 4);
    row_stride = 4 * row_bytes;
    at = base + (lane / 8) * row_bytes + first * 128 + (lane % 8) * 16;
  } else {
    const std::int64_t seg = row_bytes / kWarps;
    per_rows = static_cast<int>(seg / 64);
    row_sets = static_cast<int>(block_rows / 8);
    row_stride = 8 * row_bytes;
    at = base + (lane / 4) * row_bytes + warp * seg + (lane % 4) * 16;
  }
  constexpr int kPieceBytes = kLines ? 128 : 64;
  const int items = per_rows * row_sets;
  const std::int64_t jump = row_stride - static_cast<std::int64_t>(per_rows) * kPieceBytes;
  int piece = 0, left = items;
  const auto next = [&] {
    const uint4 v = ring_load<kCache>(at);
    at += kPieceBytes;
    if (++piece == per_rows) piece = 0, at += jump;
    --left;
    return v;
  };
  uint4 ring[kDepth];
#pragma unroll
  for (int k = 0; k < kDepth; ++k) {
    if (left > 0) ring[k] = next();
  }
  unsigned acc = 0;
  for (int b = 0; b < items; b += kDepth) {
#pragma unroll
    for (int k = 0; k < kDepth; ++k) {
      if (b + k < items) {
        acc ^= ring[k].x ^ ring[k].y ^ ring[k].z ^ ring[k].w;
        if (left > 0) ring[k] = next();
      }
    }
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

// The same rows8 walk through shared memory: each lane copies its 16 bytes with cp.async into a
// slot of its own (one commit group per item, kDepth in flight) and reads them back once landed,
// so no lane waits for another (the decode kernel's second version).
template <int kDepth>
__global__ void __launch_bounds__(kRingThreads, 1)
    lane_ring_kernel(const std::byte* w, std::int64_t rows, std::int64_t row_bytes,
                     unsigned* sink) {
  extern __shared__ __align__(16) std::byte lane_ring[];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  constexpr int kWarps = kRingThreads / 32;
  const std::int64_t groups = rows / 8;
  const std::int64_t group_first = blockIdx.x * groups / gridDim.x;
  const int row_sets = static_cast<int>((blockIdx.x + 1) * groups / gridDim.x - group_first);
  const std::int64_t seg = row_bytes / kWarps;
  const int per_rows = static_cast<int>(seg / 64);
  const std::byte* at =
      w + group_first * 8 * row_bytes + (lane / 4) * row_bytes + warp * seg + (lane % 4) * 16;
  const std::int64_t jump = 8 * row_bytes - static_cast<std::int64_t>(per_rows) * 64;
  const std::uint32_t slots = static_cast<std::uint32_t>(__cvta_generic_to_shared(lane_ring)) +
                              static_cast<std::uint32_t>((warp * kDepth * 32 + lane) * 16);
  const int items = per_rows * row_sets;
  int piece = 0, issued = 0;
  const auto issue = [&] {
    if (issued < items) {
      cp_async16(slots + static_cast<std::uint32_t>((issued % kDepth) * 512), at);
      at += 64;
      if (++piece == per_rows) piece = 0, at += jump;
    }
    ++issued;
    cp_async_commit();
  };
  for (int k = 0; k < kDepth - 1; ++k) issue();
  unsigned acc = 0;
  for (int i = 0; i < items; ++i) {
    issue();
    cp_async_wait<kDepth - 1>();
    const uint4 v = *reinterpret_cast<const uint4*>(
        lane_ring + ((warp * kDepth + i % kDepth) * 32 + lane) * 16);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  cp_async_wait<0>();
  if (acc == 0x9e3779b9u) *sink = acc;
}

template <int kDepth>
void launch_lane_ring(int grid, cudaStream_t stream, const std::byte* w, std::int64_t rows,
                      std::int64_t row_bytes, unsigned* sink) {
  const int smem = kRingThreads * kDepth * 16;
  LMOE_CUDA_CHECK(cudaFuncSetAttribute(lane_ring_kernel<kDepth>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  lane_ring_kernel<kDepth><<<grid, kRingThreads, smem, stream>>>(w, rows, row_bytes, sink);
  LMOE_CUDA_CHECK(cudaGetLastError());
}

struct RingConfig {
  const char* name;
  void (*kernel)(const std::byte*, std::int64_t, std::int64_t, unsigned*);
};

struct Config {
  std::string mode;  // items | balanced
  int cols, seg, stages, blocks_per_sm;
  std::int64_t splits;
};

template <int kStages>
cudaError_t launch_stream(const StreamParams& p, int grid, cudaStream_t stream) {
  const int smem = p.cols * p.seg * kStages;
  cudaError_t e = cudaFuncSetAttribute(stream_kernel<kStages>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  stream_kernel<kStages><<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch(const Config& c, const StreamParams& p, int grid, cudaStream_t stream) {
  switch (c.stages) {
    case 3: return launch_stream<3>(p, grid, stream);
    case 4: return launch_stream<4>(p, grid, stream);
    case 6: return launch_stream<6>(p, grid, stream);
    case 8: return launch_stream<8>(p, grid, stream);
    case 12: return launch_stream<12>(p, grid, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::int64_t rows = 7168, row_bytes = 3584 * 2;  // K3's w_up [d, l] in bf16
  const char* json = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc)
      json = argv[++i];
    else if (!std::strcmp(argv[i], "--rows") && i + 1 < argc)
      rows = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--row-bytes") && i + 1 < argc)
      row_bytes = std::atoll(argv[++i]);
    else {
      std::fprintf(stderr, "usage: lmoe_stream_probe [--rows R] [--row-bytes B] [--json FILE]\n");
      return 2;
    }
  }
  try {
    int device = 0, sms = 0;
    LMOE_CUDA_CHECK(cudaGetDevice(&device));
    LMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    const std::int64_t bytes = rows * row_bytes;
    lmoe::cuda::DeviceBuffer w(static_cast<std::size_t>(bytes)), sink(64);
    LMOE_CUDA_CHECK(cudaMemset(w.data(), 1, w.bytes()));
    cudaStream_t stream;
    LMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const int iters = 50;

    std::vector<std::pair<std::string, double>> results;
    const double read_us = lmoe::bench::back_to_back_us(
        [&](int) {
          lmoe::bench::plain_read_kernel<<<sms * 8, 256, 0, stream>>>(
              static_cast<const uint4*>(w.data()), bytes / 16, static_cast<unsigned*>(sink.data()));
        },
        stream, iters);
    std::printf("lmoe_stream_probe: %lld x %lld bytes (%.1f MB), %d SMs, %d iterations per row\n",
                static_cast<long long>(rows), static_cast<long long>(row_bytes), bytes / 1e6, sms,
                iters);
    std::printf("%-9s %5s %5s %6s %7s %6s %6s %9s %7s\n", "mode", "cols", "seg", "stages", "blk/SM",
                "splits", "grid", "us", "TB/s");
    std::printf("%-9s %5s %5s %6s %7s %6s %6d %9.2f %7.2f\n", "read", "-", "-", "-", "-", "-",
                sms * 8, read_us, bytes / read_us / 1e6);
    results.emplace_back("read", read_us);

    const std::vector<Config> configs = {
        {"items", 64, 128, 6, 2, 2},
        {"items", 64, 128, 6, 2, 7},
        {"balanced", 64, 128, 6, 2, 1},
        {"balanced", 64, 128, 12, 2, 1},
        {"balanced", 64, 128, 8, 3, 1},
        {"items", 64, 256, 6, 2, 2},
        {"balanced", 64, 256, 6, 2, 1},
        {"balanced", 32, 256, 8, 3, 1},
        {"balanced", 16, 512, 8, 3, 1},
        {"balanced", 8, 1024, 8, 3, 1},
        {"balanced", 64, 512, 3, 2, 1},
        {"balanced", 32, 512, 6, 2, 1},
        {"balanced", 16, 1024, 6, 2, 1},
        {"balanced", 64, 128, 4, 4, 1},
        {"balanced", 32, 256, 4, 6, 1},
        // Whole rows of K3's w_up (7168 bytes) per stage, as a GEMV would read them.
        {"balanced", 4, 7168, 3, 2, 1},
        {"balanced", 2, 7168, 6, 2, 1},
        {"balanced", 8, 7168, 3, 1, 1},
        {"balanced", 1, 7168, 12, 2, 1},
    };
    for (const Config& c : configs) {
      StreamParams p;
      p.w = static_cast<const std::byte*>(w.data());
      p.rows = rows;
      p.row_bytes = row_bytes;
      p.cols = c.cols;
      p.seg = c.seg;
      p.splits = c.splits;
      p.balanced = c.mode == "balanced";
      p.sink = static_cast<unsigned*>(sink.data());
      if (rows % c.cols != 0 || row_bytes % (c.seg * c.splits) != 0) continue;
      const int grid = sms * c.blocks_per_sm;
      const double us = lmoe::bench::back_to_back_us(
          [&](int) { LMOE_CUDA_CHECK(launch(c, p, grid, stream)); }, stream, iters);
      std::printf("%-9s %5d %5d %6d %7d %6lld %6d %9.2f %7.2f\n", c.mode.c_str(), c.cols, c.seg,
                  c.stages, c.blocks_per_sm, static_cast<long long>(c.splits), grid, us,
                  bytes / us / 1e6);
      results.emplace_back(c.mode + "_c" + std::to_string(c.cols) + "_s" + std::to_string(c.seg) +
                               "_st" + std::to_string(c.stages) + "_b" +
                               std::to_string(c.blocks_per_sm) + "_k" + std::to_string(c.splits),
                           us);
    }
    // Register rings: one block of 512 threads per SM (rows in whole groups of 8; the row's
    // sixteenths in whole 64-byte pieces for rows8, in whole 128-byte lines for lines).
    const RingConfig rings[] = {
        {"ring_rows8_nc_d16", register_ring_kernel<16, false, 0>},
        {"ring_rows8_plain_d16", register_ring_kernel<16, false, 1>},
        {"ring_rows8_cs_d16", register_ring_kernel<16, false, 2>},
        {"ring_rows8_nc_d8", register_ring_kernel<8, false, 0>},
        {"ring_lines_nc_d16", register_ring_kernel<16, true, 0>},
        {"ring_lines_plain_d16", register_ring_kernel<16, true, 1>},
        {"ring_lines_nc_d8", register_ring_kernel<8, true, 0>},
    };
    if (rows % 8 == 0 && row_bytes % (16 * 64) == 0) {
      for (const RingConfig& r : rings) {
        const double us = lmoe::bench::back_to_back_us(
            [&](int) {
              r.kernel<<<static_cast<int>(std::min<std::int64_t>(sms, rows / 8)), kRingThreads, 0,
                         stream>>>(static_cast<const std::byte*>(w.data()), rows, row_bytes,
                                   static_cast<unsigned*>(sink.data()));
              LMOE_CUDA_CHECK(cudaGetLastError());
            },
            stream, iters);
        std::printf("%-22s %6d %9.2f %7.2f\n", r.name, sms, us, bytes / us / 1e6);
        results.emplace_back(r.name, us);
      }
      const int grid = static_cast<int>(std::min<std::int64_t>(sms, rows / 8));
      const auto* wp = static_cast<const std::byte*>(w.data());
      auto* sp = static_cast<unsigned*>(sink.data());
      const std::pair<const char*, std::function<void()>> lane_rings[] = {
          {"lane_ring_d8", [&] { launch_lane_ring<8>(grid, stream, wp, rows, row_bytes, sp); }},
          {"lane_ring_d12", [&] { launch_lane_ring<12>(grid, stream, wp, rows, row_bytes, sp); }},
          {"lane_ring_d16", [&] { launch_lane_ring<16>(grid, stream, wp, rows, row_bytes, sp); }},
      };
      for (const auto& [name, body] : lane_rings) {
        const double us = lmoe::bench::back_to_back_us([&](int) { body(); }, stream, iters);
        std::printf("%-22s %6d %9.2f %7.2f\n", name, grid, us, bytes / us / 1e6);
        results.emplace_back(name, us);
      }
    }
    LMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    LMOE_CUDA_CHECK(cudaStreamDestroy(stream));
    if (json) {
      FILE* f = std::fopen(json, "w");
      if (!f) {
        std::fprintf(stderr, "lmoe_stream_probe: cannot write %s\n", json);
        return 1;
      }
      std::fprintf(f, "{\"bytes\": %lld, \"sms\": %d, \"results\": [",
                   static_cast<long long>(bytes), sms);
      for (std::size_t i = 0; i < results.size(); ++i) {
        std::fprintf(f, "%s{\"name\": \"%s\", \"us\": %.3f, \"tb_per_s\": %.4f}", i ? ", " : "",
                     results[i].first.c_str(), results[i].second, bytes / results[i].second / 1e6);
      }
      std::fprintf(f, "]}\n");
      std::fclose(f);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lmoe_stream_probe: %s\n", e.what());
    return 1;
  }
  return 0;
}

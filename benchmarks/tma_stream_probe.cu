// lmoe_tma_stream_probe: how fast the copy engine (TMA) streams w_up [d, l] from HBM, by the shape
// of its boxes.
//
// The chained up-projection (src/cuda/fused/fused_chained.cuh) copies w_up in boxes of 64 rows × 64
// elements of K (128 bytes of each row: the 128-byte swizzle's width, which wgmma reads) and
// streams at the rate of a plain read, where lmoe_stream_probe's cp.async rings reading 512 bytes
// or more of a row per stage stream faster (docs/fused.md). Whether the copy engine does the
// same depends on the order in which a box walks memory, so this program streams the
// same bytes in three box shapes, each 128-byte swizzled (a box's inner extent is 64 elements):
//
//   rows    2-D map (k, rows), box 64 × R rows: R rows' 128-byte pieces of one chunk of K (the
//           kernel's, R = 64);
//   runs    3-D map (64, chunks, rows) — w_up as [d][l / 64][64] —, box 64 × C chunks × R rows:
//           each row's C chunks are one contiguous run of 128·C bytes; in shared memory a row's C
//           chunks follow each other (not the layout wgmma reads for rows of A: the kernel would
//           have to take a box's lines as (row, chunk) pairs);
//   stack   3-D map (64, rows, chunks), box 64 × R rows × C chunks: C of the kernel's boxes in one
//           copy, each chunk's R rows together (wgmma's layout), the rows walked per chunk;
//   bulk    no map: a box's bytes read as one contiguous run (cp.async.bulk), as they would be from
//           a w_up stored pre-tiled, each box's image (the swizzled layout wgmma reads) in turn.
//
// One block per SM (or one per 64-row tile) with a ring of ~192 KB of stages: thread 0 issues the
// boxes (each completes on its stage's full mbarrier), thread 32 waits for each, reads a word and
// hands the stage back. The work, (row group, chunk group) units in row-major order, is split
// into equal contiguous runs over the blocks. Kernel time from CUDA events over back-to-back
// launches, each on the next of several copies of the matrix so that every launch reads from HBM
// (the copies together exceed L2 by 3×). Prints a table and, with --json FILE, JSON. Asserts
// nothing.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "cuda/runtime/hopper_async.cuh"
#include "cuda/runtime/tensor_map.hpp"
#include "graph_timer.hpp"
#include "plain_read.cuh"

namespace {

enum class BoxShape { kRows, kRuns, kStack, kBulk };

struct ProbeParams {
  BoxShape shape = BoxShape::kRows;
  int chunks_per_box = 1;  // C (rows: 1)
  int rows_per_box = 64;   // R
  int chunk_groups = 0;    // boxes along K per row group: l / 64 / C
  std::int64_t units = 0;  // row groups × chunk groups
  std::uint32_t box_bytes = 0;
  const char* base = nullptr;  // bulk: the matrix, read as contiguous boxes
  unsigned* sink = nullptr;
};

constexpr int kRingBytes = 192 * 1024;

template <int kStages>
__global__ void __launch_bounds__(64, 1)
    tma_stream_kernel(const __grid_constant__ CUtensorMap map, const ProbeParams p) {
  extern __shared__ __align__(1024) unsigned char ring[];
  __shared__ lmoe::cuda::StageBarriers<kStages> bars;
  using namespace lmoe::cuda;
  const int tid = static_cast<int>(threadIdx.x);
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(bars.full(s), 1);
      mbarrier_init(bars.empty(s), 1);
    }
    mbarrier_init_fence();
  }
  __syncthreads();
  const std::uint32_t base = static_cast<std::uint32_t>(__cvta_generic_to_shared(ring));
  const std::uint32_t stages = (base + 1023u) & ~1023u;
  const std::int64_t first = blockIdx.x * p.units / gridDim.x;
  const int units = static_cast<int>((blockIdx.x + 1) * p.units / gridDim.x - first);
  if (tid == 0) {
    for (int u = 0; u < units; ++u) {
      const int s = u % kStages;
      if (u >= kStages)
        mbarrier_wait(bars.empty(s), static_cast<std::uint32_t>(u / kStages - 1) & 1u);
      mbarrier_arrive_expect_tx(bars.full(s), p.box_bytes);
      const std::int64_t unit = first + u;
      const int row = static_cast<int>(unit / p.chunk_groups) * p.rows_per_box;
      const int chunk = static_cast<int>(unit % p.chunk_groups) * p.chunks_per_box;
      const std::uint32_t dst = stages + static_cast<std::uint32_t>(s) * p.box_bytes;
      switch (p.shape) {
        case BoxShape::kRows: tma_load_2d(dst, &map, bars.full(s), chunk * 64, row); break;
        case BoxShape::kRuns: tma_load_3d(dst, &map, bars.full(s), 0, chunk, row); break;
        case BoxShape::kStack: tma_load_3d(dst, &map, bars.full(s), 0, row, chunk); break;
        case BoxShape::kBulk:
          bulk_load(dst, p.base + unit * p.box_bytes, p.box_bytes, bars.full(s));
          break;
      }
    }
  } else if (tid == 32) {
    unsigned acc = 0;
    for (int u = 0; u < units; ++u) {
      const int s = u % kStages;
      mbarrier_wait(bars.full(s), static_cast<std::uint32_t>(u / kStages) & 1u);
      acc ^= *reinterpret_cast<volatile const unsigned*>(ring + (stages - base) + s * p.box_bytes);
      mbarrier_arrive(bars.empty(s));
    }
    if (acc == 0x9e3779b9u) *p.sink = acc;
  }
}

struct Config {
  BoxShape shape;
  int chunks_per_box, rows_per_box;
  int grid;  // 0: one block per SM
};

const char* shape_name(BoxShape s) {
  return s == BoxShape::kRows    ? "rows"
         : s == BoxShape::kRuns  ? "runs"
         : s == BoxShape::kStack ? "stack"
                                 : "bulk";
}

template <int kStages>
void launch(const CUtensorMap& map, const ProbeParams& p, int grid, cudaStream_t stream) {
  const int smem = kStages * static_cast<int>(p.box_bytes) + 1024;
  LMOE_CUDA_CHECK(cudaFuncSetAttribute(tma_stream_kernel<kStages>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  tma_stream_kernel<kStages><<<grid, 64, smem, stream>>>(map, p);
  LMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_ring(const CUtensorMap& map, const ProbeParams& p, int grid, cudaStream_t stream) {
  switch (kRingBytes / static_cast<int>(p.box_bytes)) {
    case 48: return launch<48>(map, p, grid, stream);
    case 24: return launch<24>(map, p, grid, stream);
    case 12: return launch<12>(map, p, grid, stream);
    case 6: return launch<6>(map, p, grid, stream);
    case 3: return launch<3>(map, p, grid, stream);
    default: throw std::runtime_error("lmoe_tma_stream_probe: no ring for this box size");
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"lmoe_tma_stream_probe: the copy engine's stream of w_up by box shape"};
  std::int64_t rows = 7168, k = 3584;  // K3's w_up [d, l]
  int iters = 50;
  std::string json;
  app.add_option("--rows", rows, "rows of w_up (K3: 7168; one rank's stripe at tp 8: 896)");
  app.add_option("--k", k, "elements of a row (a multiple of 512)");
  app.add_option("--iters", iters, "launches timed per configuration");
  app.add_option("--json", json, "write the results here");
  CLI11_PARSE(app, argc, argv);
  try {
    if (k % 512 != 0 || rows % 64 != 0)
      throw std::runtime_error("--k % 512 and --rows % 64 must be 0");
    int device = 0, sms = 0;
    LMOE_CUDA_CHECK(cudaGetDevice(&device));
    LMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    const std::int64_t bytes = rows * k * 2;
    const int copies = static_cast<int>(std::max<std::int64_t>(2, 150'000'000 / bytes + 1));
    std::vector<std::unique_ptr<lmoe::cuda::DeviceBuffer>> weights;
    for (int c = 0; c < copies; ++c) {
      weights.push_back(
          std::make_unique<lmoe::cuda::DeviceBuffer>(static_cast<std::size_t>(bytes)));
      LMOE_CUDA_CHECK(cudaMemset(weights.back()->data(), 1, weights.back()->bytes()));
    }
    lmoe::cuda::DeviceBuffer sink(64);
    cudaStream_t stream;
    LMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

    nlohmann::json results = nlohmann::json::array();
    std::printf(
        "lmoe_tma_stream_probe: %lld x %lld bf16 (%.1f MB), %d copies, %d SMs, %d launches each\n",
        static_cast<long long>(rows), static_cast<long long>(k), bytes / 1e6, copies, sms, iters);
    std::printf("%-6s %3s %4s %9s %6s %6s %9s %7s\n", "shape", "C", "R", "box bytes", "stages",
                "grid", "us", "TB/s");
    const auto report = [&](const std::string& name, int c, int r, int box, int stages, int grid,
                            double us) {
      std::printf("%-6s %3d %4d %9d %6d %6d %9.2f %7.2f\n", name.c_str(), c, r, box, stages, grid,
                  us, bytes / us / 1e6);
      results.push_back({{"shape", name},
                         {"chunks_per_box", c},
                         {"rows_per_box", r},
                         {"box_bytes", box},
                         {"stages", stages},
                         {"grid", grid},
                         {"us", us},
                         {"tb_per_s", bytes / us / 1e6}});
    };
    const double read_us = lmoe::bench::back_to_back_us(
        [&](int i) {
          lmoe::bench::plain_read_kernel<<<sms * 8, 256, 0, stream>>>(
              static_cast<const uint4*>(weights[i % copies]->data()), bytes / 16,
              static_cast<unsigned*>(sink.data()));
        },
        stream, iters);
    report("read", 0, 0, 0, 0, sms * 8, read_us);

    const int tiles = static_cast<int>(rows / 64);
    const std::vector<Config> configs = {
        {BoxShape::kRows, 1, 64, tiles},  {BoxShape::kRows, 1, 64, 0},
        {BoxShape::kRows, 1, 128, 0},     {BoxShape::kRows, 1, 32, 0},
        {BoxShape::kRuns, 2, 32, 0},      {BoxShape::kRuns, 4, 16, 0},
        {BoxShape::kRuns, 8, 8, 0},       {BoxShape::kRuns, 4, 32, 0},
        {BoxShape::kRuns, 8, 16, 0},      {BoxShape::kRuns, 4, 16, tiles},
        {BoxShape::kStack, 2, 64, 0},     {BoxShape::kStack, 4, 64, 0},
        {BoxShape::kStack, 4, 64, tiles}, {BoxShape::kStack, 8, 32, 0},
        {BoxShape::kBulk, 1, 64, tiles},  {BoxShape::kBulk, 1, 64, 0},
        {BoxShape::kBulk, 1, 32, 0},      {BoxShape::kBulk, 2, 64, 0},
        {BoxShape::kBulk, 4, 64, 0},      {BoxShape::kBulk, 4, 64, tiles},
    };
    const std::int64_t chunks = k / 64;
    for (const Config& c : configs) {
      if (rows % c.rows_per_box != 0) continue;  // whole boxes only
      ProbeParams p;
      p.shape = c.shape;
      p.chunks_per_box = c.chunks_per_box;
      p.rows_per_box = c.rows_per_box;
      p.chunk_groups = static_cast<int>(chunks / c.chunks_per_box);
      p.units = rows / c.rows_per_box * p.chunk_groups;
      p.box_bytes = static_cast<std::uint32_t>(64 * c.chunks_per_box * c.rows_per_box * 2);
      p.sink = static_cast<unsigned*>(sink.data());
      std::vector<CUtensorMap> maps(copies);
      for (int i = 0; i < copies; ++i) {
        const void* w = weights[i]->data();
        cudaError_t status;
        if (c.shape == BoxShape::kBulk) {
          status = cudaSuccess;  // no map: the box's bytes are one run (a pre-tiled w_up)
        } else if (c.shape == BoxShape::kRows) {
          status = lmoe::cuda::encode_rows_map(maps[i], lmoe::DType::bf16, w, rows, k, k, 64,
                                               c.rows_per_box);
        } else {
          const bool runs = c.shape == BoxShape::kRuns;
          const std::uint64_t dims[3] = {64, static_cast<std::uint64_t>(runs ? chunks : rows),
                                         static_cast<std::uint64_t>(runs ? rows : chunks)};
          const std::uint64_t strides[2] = {static_cast<std::uint64_t>(runs ? 128 : k * 2),
                                            static_cast<std::uint64_t>(runs ? k * 2 : 128)};
          const std::uint32_t box[3] = {
              64, static_cast<std::uint32_t>(runs ? c.chunks_per_box : c.rows_per_box),
              static_cast<std::uint32_t>(runs ? c.rows_per_box : c.chunks_per_box)};
          status =
              lmoe::cuda::encode_tiled_map(maps[i], lmoe::DType::bf16, w, 3, dims, strides, box);
        }
        if (status != cudaSuccess) {
          std::printf("%-6s %3d %4d: the driver refused the map (%s)\n", shape_name(c.shape),
                      c.chunks_per_box, c.rows_per_box, cudaGetErrorString(status));
          maps.clear();
          break;
        }
      }
      if (maps.empty()) continue;
      const int grid = c.grid > 0 ? c.grid : sms;
      const double us = lmoe::bench::back_to_back_us(
          [&](int i) {
            ProbeParams q = p;
            q.base = static_cast<const char*>(weights[i % copies]->data());
            launch_ring(maps[i % copies], q, grid, stream);
          },
          stream, iters);
      report(shape_name(c.shape), c.chunks_per_box, c.rows_per_box, static_cast<int>(p.box_bytes),
             kRingBytes / static_cast<int>(p.box_bytes), grid, us);
    }
    LMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    LMOE_CUDA_CHECK(cudaStreamDestroy(stream));
    if (!json.empty()) {
      std::ofstream out(json);
      out << nlohmann::json{{"rows", rows},     {"k", k},         {"bytes", bytes},    {"sms", sms},
                            {"copies", copies}, {"iters", iters}, {"results", results}}
                 .dump(2)
          << "\n";
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lmoe_tma_stream_probe: %s\n", e.what());
    return 1;
  }
  return 0;
}

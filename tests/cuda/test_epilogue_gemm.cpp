// The epilogue GEMM (cuda/gemm/epilogue_gemm.hpp) against the contract computed on the host: both
// adds, both dtypes, every tile, odd row counts, K not a multiple of the tile's, a stripe of a
// wider C in place and out of place, and replays of a captured graph with new C. Outputs are
// poisoned before each run and the elements the GEMM must not write are checked untouched. Skips
// without a Hopper GPU (the kernels are sm_90a), except the limits' messages, which need only a
// GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/gemm/epilogue_gemm.hpp"
#include "cuda/runtime/cuda_device_info.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "gpu_test_support.hpp"
#include "lmoe/dtype.hpp"

namespace {

using lmoe::DType;
using lmoe::cuda::EpilogueAdd;
using lmoe::cuda::EpilogueGemmArgs;
using lmoe::cuda::EpilogueTile;

#define SKIP_WITHOUT_HOPPER()                                                           \
  do {                                                                                  \
    SKIP_WITHOUT_GPU();                                                                 \
    EpilogueGemmArgs probe;                                                             \
    probe.m = 1, probe.n = 8, probe.k = 8, probe.ldw = 8, probe.ldc = 8, probe.ldd = 8; \
    lmoe::cuda::DeviceBuffer any(256);                                                  \
    probe.a = probe.w = probe.c = any.data();                                           \
    probe.d = any.data();                                                               \
    if (auto limit = lmoe::cuda::epilogue_gemm_limit(probe)) GTEST_SKIP() << *limit;    \
  } while (0)

// Host storage of `count` elements of `dtype` from float values (rounded to nearest even).
std::vector<std::byte> stored(const std::vector<float>& values, DType dtype) {
  std::vector<std::byte> bytes(values.size() * lmoe::dtype_size(dtype));
  for (std::size_t i = 0; i < values.size(); ++i)
    lmoe::store_from_float(bytes.data(), i, dtype, values[i]);
  return bytes;
}

float at(const std::vector<std::byte>& bytes, std::size_t i, DType dtype) {
  return lmoe::load_as_float(bytes.data(), i, dtype);
}

struct Problem {
  std::int64_t m, n, k, ldc;  // C and D: [m, n] inside rows of ldc elements, from column `first`
  std::int64_t first = 0;
};

// Runs one GEMM on fresh inputs and compares every element of D with the host's contract: exact
// integer A and W (the fp32 accumulator is exact in any order, so bits must match), C random.
// Elements outside the [m, n] window keep their poison (out of place) or their C (in place).
void check_against_host(DType dtype, EpilogueAdd add, EpilogueTile tile, const Problem& p,
                        bool in_place, std::uint64_t seed) {
  SCOPED_TRACE(std::string(lmoe::dtype_name(dtype)) +
               (add == EpilogueAdd::round_once ? " round_once" : " round_product_first") + " " +
               std::string(lmoe::cuda::epilogue_tile_name(tile)) + " m=" + std::to_string(p.m) +
               " n=" + std::to_string(p.n) + " k=" + std::to_string(p.k) +
               " ldc=" + std::to_string(p.ldc) + (in_place ? " in place" : ""));
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> small(-3, 3);
  std::normal_distribution<float> normal(0.0f, 8.0f);
  std::vector<float> a(static_cast<std::size_t>(p.m * p.k)), w(static_cast<std::size_t>(p.n * p.k)),
      c(static_cast<std::size_t>(p.m * p.ldc));
  for (float& v : a) v = static_cast<float>(small(rng));
  for (float& v : w) v = static_cast<float>(small(rng));
  for (float& v : c) v = normal(rng);
  const auto a_bytes = stored(a, dtype), w_bytes = stored(w, dtype), c_bytes = stored(c, dtype);

  const std::size_t esize = lmoe::dtype_size(dtype);
  lmoe::cuda::DeviceBuffer d_a(a_bytes.size()), d_w(w_bytes.size()), d_c(c_bytes.size()),
      d_d(c_bytes.size());
  cuda_ok(cudaMemcpy(d_a.data(), a_bytes.data(), a_bytes.size(), cudaMemcpyHostToDevice));
  cuda_ok(cudaMemcpy(d_w.data(), w_bytes.data(), w_bytes.size(), cudaMemcpyHostToDevice));
  cuda_ok(cudaMemcpy(d_c.data(), c_bytes.data(), c_bytes.size(), cudaMemcpyHostToDevice));
  cuda_ok(cudaMemset(d_d.data(), 0xff, d_d.bytes()));  // NaN poison

  EpilogueGemmArgs args;
  args.a = d_a.data();
  args.w = d_w.data();
  args.ldw = p.k;
  args.c = d_c.at(static_cast<std::size_t>(p.first) * esize);
  args.ldc = p.ldc;
  args.d = in_place ? const_cast<void*>(args.c) : d_d.at(static_cast<std::size_t>(p.first) * esize);
  args.ldd = p.ldc;
  args.m = p.m, args.n = p.n, args.k = p.k;
  args.dtype = dtype;
  args.add = add;
  args.tile = tile;
  lmoe::cuda::run_epilogue_gemm(args, cudaStreamPerThread);
  cuda_ok(cudaStreamSynchronize(cudaStreamPerThread));

  std::vector<std::byte> out(c_bytes.size());
  cuda_ok(cudaMemcpy(out.data(), in_place ? d_c.data() : d_d.data(), out.size(),
                     cudaMemcpyDeviceToHost));
  std::int64_t wrong = 0, untouched_wrong = 0;
  for (std::int64_t i = 0; i < p.m; ++i) {
    for (std::int64_t col = 0; col < p.ldc; ++col) {
      const std::size_t at_c = static_cast<std::size_t>(i * p.ldc + col);
      std::uint16_t got = 0;
      std::memcpy(&got, out.data() + at_c * esize, esize);
      const std::int64_t j = col - p.first;
      if (j < 0 || j >= p.n) {  // outside the window: unchanged
        std::uint16_t before = 0xffff;
        if (in_place) std::memcpy(&before, c_bytes.data() + at_c * esize, esize);
        untouched_wrong += got != before;
        continue;
      }
      float acc = 0.0f;  // exact: small integers
      for (std::int64_t kk = 0; kk < p.k; ++kk)
        acc +=
            a[static_cast<std::size_t>(i * p.k + kk)] * w[static_cast<std::size_t>(j * p.k + kk)];
      const float c_value = at(c_bytes, at_c, dtype);
      const float sum =
          add == EpilogueAdd::round_once ? acc + c_value : lmoe::round_to(dtype, acc) + c_value;
      std::vector<std::byte> expected(esize);
      lmoe::store_from_float(expected.data(), 0, dtype, sum);
      std::uint16_t want = 0;
      std::memcpy(&want, expected.data(), esize);
      if (got != want && wrong++ < 3) {
        ADD_FAILURE() << "D[" << i << ", " << j << "] = " << at(out, at_c, dtype) << ", want "
                      << lmoe::load_as_float(expected.data(), 0, dtype) << " (acc " << acc << ", C "
                      << c_value << ")";
      }
    }
  }
  EXPECT_EQ(wrong, 0);
  EXPECT_EQ(untouched_wrong, 0) << "elements outside D's window were written";
}

TEST(EpilogueGemm, EveryAddDtypeAndTileMatchesTheHostBitForBit) {
  SKIP_WITHOUT_HOPPER();
  std::uint64_t seed = 1;
  for (DType dtype : {DType::bf16, DType::f16}) {
    for (EpilogueAdd add : {EpilogueAdd::round_once, EpilogueAdd::round_product_first}) {
      for (EpilogueTile tile : lmoe::cuda::kEpilogueTiles) {
        // Rows: one, odd, a tile ±1; K: a tile's multiple and not; a stripe of a wider C.
        for (const Problem& p :
             {Problem{1, 128, 256, 128}, Problem{17, 96, 520, 96}, Problem{65, 264, 192, 264},
              Problem{129, 48, 384, 384, 96}, Problem{300, 256, 64, 512, 256}}) {
          for (bool in_place : {false, true})
            check_against_host(dtype, add, tile, p, in_place, ++seed);
        }
      }
    }
  }
}

TEST(EpilogueGemm, TheTwoAddsDifferWhereRoundingTheProductFirstMatters) {
  // A guard on the test above: with |acc| > 256 a bf16 round(acc) loses bits, so the two contracts
  // give different D for the same inputs; a kernel that applied one add for both would fail one.
  const float acc = 1001.0f, c = 1.5f;  // bf16 spacing 4 here: 1002.5 → 1004, 1000 + 1.5 → 1000
  EXPECT_NE(lmoe::round_to(DType::bf16, acc + c),
            lmoe::round_to(DType::bf16, lmoe::round_to(DType::bf16, acc) + c));
}

TEST(EpilogueGemm, AutomaticTileMatchesTheHostAtTheModelsStripe) {
  SKIP_WITHOUT_HOPPER();
  // K3's d_latent, a tp-8 stripe of d_model = 7168, T = 1 and 1000 rows (the automatic tile).
  for (std::int64_t m : {std::int64_t{1}, std::int64_t{1000}}) {
    check_against_host(DType::bf16, EpilogueAdd::round_once, EpilogueTile::automatic,
                       Problem{m, 896, 3584, 7168, 896 * 3}, true,
                       40u + static_cast<std::uint64_t>(m));
  }
}

TEST(EpilogueGemm, AGraphReplaysWithNewC) {
  SKIP_WITHOUT_HOPPER();
  const std::int64_t m = 33, n = 128, k = 256;
  const DType dtype = DType::bf16;
  std::vector<float> a(m * k, 1.0f), w(n * k, 0.0f);
  for (std::int64_t j = 0; j < n; ++j) w[static_cast<std::size_t>(j * k)] = static_cast<float>(j);
  const auto a_bytes = stored(a, dtype), w_bytes = stored(w, dtype);
  lmoe::cuda::DeviceBuffer d_a(a_bytes.size()), d_w(w_bytes.size()), d_c(m * n * 2), d_d(m * n * 2);
  cuda_ok(cudaMemcpy(d_a.data(), a_bytes.data(), a_bytes.size(), cudaMemcpyHostToDevice));
  cuda_ok(cudaMemcpy(d_w.data(), w_bytes.data(), w_bytes.size(), cudaMemcpyHostToDevice));
  EpilogueGemmArgs args;
  args.a = d_a.data(), args.w = d_w.data(), args.ldw = k;
  args.c = d_c.data(), args.ldc = n, args.d = d_d.data(), args.ldd = n;
  args.m = m, args.n = n, args.k = k, args.dtype = dtype;
  // Eager first (loads the kernel), then captured once and replayed with a new C each time:
  // D[i, j] = j + C[i, j], exact.
  lmoe::cuda::run_epilogue_gemm(args, cudaStreamPerThread);
  cudaStream_t stream = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  lmoe::cuda::run_epilogue_gemm(args, stream);
  cuda_ok(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  cuda_ok(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    std::vector<float> c(m * n);
    for (std::size_t i = 0; i < c.size(); ++i) c[i] = static_cast<float>((i + replay * 7) % 13);
    const auto c_bytes = stored(c, dtype);
    cuda_ok(cudaMemcpy(d_c.data(), c_bytes.data(), c_bytes.size(), cudaMemcpyHostToDevice));
    cuda_ok(cudaMemset(d_d.data(), 0xff, d_d.bytes()));
    cuda_ok(cudaGraphLaunch(exec, stream));
    cuda_ok(cudaStreamSynchronize(stream));
    std::vector<std::byte> out(c_bytes.size());
    cuda_ok(cudaMemcpy(out.data(), d_d.data(), out.size(), cudaMemcpyDeviceToHost));
    std::int64_t wrong = 0;
    for (std::int64_t i = 0; i < m; ++i) {
      for (std::int64_t j = 0; j < n; ++j) {
        const std::size_t e = static_cast<std::size_t>(i * n + j);
        wrong += at(out, e, dtype) != static_cast<float>(j) + c[e];
      }
    }
    EXPECT_EQ(wrong, 0) << "replay " << replay;
  }
  cuda_ok(cudaGraphExecDestroy(exec));
  cuda_ok(cudaGraphDestroy(graph));
  cuda_ok(cudaStreamDestroy(stream));
}

TEST(EpilogueGemm, DeclinesWhatTmaCannotTakeWithAReason) {
  SKIP_WITHOUT_GPU();
  lmoe::cuda::DeviceBuffer any(4096);
  EpilogueGemmArgs args;
  args.a = args.w = args.c = any.data();
  args.d = any.data();
  args.m = 4, args.n = 64, args.k = 64, args.ldw = 64, args.ldc = 64, args.ldd = 64;
  const auto limit = lmoe::cuda::epilogue_gemm_limit(args);
  if (limit) {  // not a Hopper GPU or not built for one: the reason says which
    EXPECT_TRUE(limit->find("9.0") != std::string::npos ||
                limit->find("sm_90a") != std::string::npos)
        << *limit;
    EXPECT_THROW(lmoe::cuda::run_epilogue_gemm(args, cudaStreamPerThread), lmoe::Error);
    return;
  }
  const auto refused = [&](EpilogueGemmArgs bad, const char* words) {
    const auto why = lmoe::cuda::epilogue_gemm_limit(bad);
    ASSERT_TRUE(why.has_value()) << words;
    EXPECT_NE(why->find(words), std::string::npos) << *why;
    EXPECT_THROW(lmoe::cuda::run_epilogue_gemm(bad, cudaStreamPerThread), lmoe::Error);
  };
  EpilogueGemmArgs f32 = args;
  f32.dtype = DType::f32;
  refused(f32, "f32");
  EpilogueGemmArgs odd_k = args;
  odd_k.k = 60, odd_k.ldw = 60;
  refused(odd_k, "multiples of 8");
  EpilogueGemmArgs misaligned = args;
  misaligned.c = any.at(2);
  refused(misaligned, "16-byte aligned");
  EpilogueGemmArgs short_stride = args;
  short_stride.ldd = 32;
  refused(short_stride, "row stride");
  EXPECT_THROW(lmoe::cuda::parse_epilogue_tile("m256"), lmoe::Error);
  EXPECT_EQ(lmoe::cuda::parse_epilogue_tile("m128_n256"), EpilogueTile::m128_n256);
}

// The automatic tile on an H100's 132 SMs, where the tiles were measured (docs/gemm.md): K3's tp-8
// stripe (896 columns) and the full width (7168) take the 256-wide tile, which measured fastest
// (or within 0.5 %) at 1024 and 8192 rows; a few rows keep the ping-pong 64-row tile.
TEST(EpilogueGemm, TheAutomaticTileIsTheFastestMeasuredOnTheTailsShapes) {
  using lmoe::cuda::epilogue_tile_for;
  EXPECT_EQ(epilogue_tile_for(8192, 896, 132), EpilogueTile::m128_n256);
  EXPECT_EQ(epilogue_tile_for(8192, 7168, 132), EpilogueTile::m128_n256);
  EXPECT_EQ(epilogue_tile_for(1024, 7168, 132), EpilogueTile::m128_n256);
  EXPECT_EQ(epilogue_tile_for(128, 7168, 132), EpilogueTile::m64_n128);
  EXPECT_EQ(epilogue_tile_for(16, 7168, 132), EpilogueTile::m64_n128);
}

}  // namespace

// The grouped GEMM with MXFP4 weights (GroupedGemmArgs::b_blocks): on every mma.sync tile, and on
// every wgmma tile where the GPU has them (compute 9.0), bf16 and f16, its output is bit for bit
// the dense grouped GEMM's on Mxfp4Tensor::dequantize's weights with the same tile — fp32, rounded,
// and through the gated (both weights packed) and plain activations — on ragged groups of 0, 1, 3,
// 17, 64 and 300 rows (read in place and gathered), K = 96 and 544 (32 · odd: the last chunk half
// empty, scales at odd byte addresses) and 3584 (Kimi-K3's latent), N not a multiple of any tile's
// columns; random codes (every code in both nibbles) and scales across their range, outputs
// poisoned before each run. Bad packed arguments are refused with their reason (host checks, no GPU
// needed); the GEMMs skip where no GPU is visible.
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/runtime/cuda_device_info.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "gpu_test_support.hpp"
#include "lmoe/dims.hpp"
#include "lmoe/layer_weights.hpp"
#include "lmoe/tensor.hpp"

namespace {

using lmoe::DType;
using lmoe::HostTensor;
using lmoe::Mxfp4Tensor;
using lmoe::cuda::DeviceBuffer;
using lmoe::cuda::GroupedGemmArgs;
using lmoe::cuda::GroupedOut;
using lmoe::cuda::GroupedTile;
using ::testing::HasSubstr;

DeviceBuffer upload(const void* data, std::size_t bytes) {
  DeviceBuffer buffer(bytes);
  if (bytes) cuda_ok(cudaMemcpy(buffer.data(), data, bytes, cudaMemcpyHostToDevice));
  return buffer;
}
template <typename T>
DeviceBuffer upload(const std::vector<T>& values) {
  return upload(values.data(), values.size() * sizeof(T));
}
DeviceBuffer upload(const HostTensor& tensor) { return upload(tensor.data(), tensor.nbytes()); }

// Random MXFP4 weights [groups, n, k]: random code bytes, the first 16 of each group's first row
// holding codes (j, 15 − j) so that every code sits in both nibbles; scales 2^lowest … 2^highest.
Mxfp4Tensor random_packed(std::int64_t groups, std::int64_t n, std::int64_t k, int lowest,
                          int highest, std::mt19937& rng) {
  Mxfp4Tensor packed({groups, n, k});
  for (auto& byte : packed.blocks) byte = static_cast<std::uint8_t>(rng() & 0xff);
  for (std::int64_t g = 0; g < groups; ++g) {
    if (n == 0) break;
    for (std::size_t j = 0; j < 16; ++j)
      packed.blocks[static_cast<std::size_t>(g * n * k / 2) + j] =
          static_cast<std::uint8_t>(j | ((15 - j) << 4));
  }
  std::uniform_int_distribution<int> exponent(lowest, highest);
  for (auto& scale : packed.scales) scale = static_cast<std::uint8_t>(127 + exponent(rng));
  return packed;
}

struct Weights {
  Mxfp4Tensor packed;
  HostTensor dense;  // packed.dequantize(dtype)
  DeviceBuffer blocks, scales, device_dense;
};

Weights make_weights(std::int64_t groups, std::int64_t n, std::int64_t k, DType dtype,
                     std::mt19937& rng) {
  // bf16 holds 2^-20 … 6 · 2^20 exactly; f16 rounds below 2^-24 (down to zero) and the products'
  // sums stay below its largest value.
  const bool bf16 = dtype == DType::bf16;
  Weights w;
  w.packed = random_packed(groups, n, k, bf16 ? -20 : -30, bf16 ? 20 : 4, rng);
  w.dense = w.packed.dequantize(dtype);
  w.blocks = upload(w.packed.blocks);
  w.scales = upload(w.packed.scales);
  w.device_dense = upload(w.dense);
  return w;
}

struct Case {
  std::vector<std::int32_t> first;   // [groups + 1]
  std::vector<std::int32_t> a_rows;  // empty: A read in place
  HostTensor a;                      // [a rows, k]
  std::int64_t n = 0, k = 0;
};

Case make_case(std::int64_t n, std::int64_t k, DType dtype, bool gather, std::mt19937& rng) {
  Case c;
  c.n = n;
  c.k = k;
  c.first = {0};
  for (const int rows : {0, 1, 3, 17, 64, 300, 0, 8}) c.first.push_back(c.first.back() + rows);
  const std::int64_t rows = c.first.back(), a_rows = gather ? rows / 2 + 3 : rows;
  if (gather) {
    std::uniform_int_distribution<std::int32_t> pick(0, static_cast<std::int32_t>(a_rows - 1));
    for (std::int64_t r = 0; r < rows; ++r) c.a_rows.push_back(pick(rng));
  }
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  c.a = HostTensor(dtype, {a_rows, k});
  for (std::int64_t i = 0; i < c.a.numel(); ++i) c.a.set(i, value(rng));
  return c;
}

// One launch's output bytes ([rows, n] in fp32 or `dtype`), poisoned before it; `up` and `gate`
// read packed or dense.
std::vector<std::uint8_t> run(const Case& c, DType dtype, const Weights& up, const Weights* gate,
                              bool packed, GroupedOut out, GroupedTile tile,
                              const lmoe::LayerConfig* act) {
  const DeviceBuffer a = upload(c.a), first = upload(c.first), a_rows = upload(c.a_rows);
  const std::int64_t rows = c.first.back();
  const std::size_t bytes = static_cast<std::size_t>(rows * c.n) *
                            lmoe::dtype_size(out == GroupedOut::f32 ? DType::f32 : dtype);
  const DeviceBuffer result(bytes);
  cuda_ok(cudaMemset(result.data(), 0xff, bytes));
  GroupedGemmArgs args;
  args.a = a.data();
  args.a_rows = c.a_rows.empty() ? nullptr : static_cast<const std::int32_t*>(a_rows.data());
  args.lda = c.k;
  if (packed) {
    args.b_blocks = static_cast<const std::uint8_t*>(up.blocks.data());
    args.b_scales = static_cast<const std::uint8_t*>(up.scales.data());
    if (gate) {
      args.b2_blocks = static_cast<const std::uint8_t*>(gate->blocks.data());
      args.b2_scales = static_cast<const std::uint8_t*>(gate->scales.data());
    }
    args.blocks_group_stride = c.n * c.k / 2;
    args.scales_group_stride = c.n * c.k / 32;
  } else {
    args.b = up.device_dense.data();
    args.b2 = gate ? gate->device_dense.data() : nullptr;
    args.b_group_stride = c.n * c.k;
  }
  args.c = result.data();
  args.ldc = c.n;
  args.n = c.n;
  args.k = c.k;
  args.first = static_cast<const std::int32_t*>(first.data());
  args.groups = static_cast<int>(c.first.size() - 1);
  args.max_rows = rows;
  args.max_groups = args.groups;
  args.dtype = dtype;
  args.out = out;
  args.activation = act;
  args.tile = tile;
  const auto why = lmoe::cuda::grouped_gemm_unsupported(args);
  EXPECT_FALSE(why.has_value()) << *why;
  cuda_ok(lmoe::cuda::launch_grouped_gemm(args, nullptr));
  cuda_ok(cudaDeviceSynchronize());
  std::vector<std::uint8_t> host(bytes);
  cuda_ok(cudaMemcpy(host.data(), result.data(), bytes, cudaMemcpyDeviceToHost));
  return host;
}

// How many of the output's elements (of `element` bytes) differ.
std::int64_t differing(const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b,
                       std::size_t element) {
  std::int64_t count = 0;
  for (std::size_t i = 0; i + element <= a.size() && i + element <= b.size(); i += element)
    count += std::memcmp(a.data() + i, b.data() + i, element) != 0;
  return count + (a.size() != b.size());
}

struct Shape {
  std::int64_t n, k;
};

class PackedGroupedGemm : public ::testing::TestWithParam<std::tuple<DType, Shape, bool>> {};

TEST_P(PackedGroupedGemm, GivesTheBitsOfTheDequantizedWeightsOnEveryTile) {
  SKIP_WITHOUT_GPU();
  const auto [dtype, shape, gather] = GetParam();
  std::mt19937 rng(static_cast<std::uint32_t>(shape.k * 7 + shape.n + (gather ? 1 : 0)));
  const Case c = make_case(shape.n, shape.k, dtype, gather, rng);
  const std::int64_t groups = static_cast<std::int64_t>(c.first.size() - 1);
  const Weights up = make_weights(groups, shape.n, shape.k, dtype, rng);
  const Weights gate = make_weights(groups, shape.n, shape.k, dtype, rng);
  lmoe::LayerConfig gated;
  gated.activation = lmoe::ExpertActivation::situ_glu;
  gated.activation_beta = 4.0f;
  gated.activation_linear_beta = 25.0f;
  lmoe::LayerConfig plain;
  plain.activation = lmoe::ExpertActivation::relu2;
  const std::size_t esize = lmoe::dtype_size(dtype);
  std::vector<GroupedTile> tiles{GroupedTile::m16, GroupedTile::m64, GroupedTile::m128,
                                 GroupedTile::m128_wide, GroupedTile::automatic};
  // The wgmma tiles where this GPU has them (wgmma_ws runs wgmma_m256's packed kernel).
  if (!lmoe::cuda::grouped_tile_unsupported(GroupedTile::wgmma,
                                            lmoe::cuda::current_compute_capability())) {
    tiles.insert(tiles.end(), {GroupedTile::wgmma, GroupedTile::wgmma_m256, GroupedTile::wgmma_ws});
  }
  for (const GroupedTile tile : tiles) {
    SCOPED_TRACE(std::string("tile ") + lmoe::cuda::grouped_tile_name(tile));
    const auto both = [&](GroupedOut out, const Weights* second, const lmoe::LayerConfig* act,
                          std::size_t element, const char* what) {
      const auto dense = run(c, dtype, up, second, false, out, tile, act);
      const auto packed = run(c, dtype, up, second, true, out, tile, act);
      EXPECT_EQ(differing(dense, packed, element), 0) << what << ": elements whose bits differ";
    };
    both(GroupedOut::f32, nullptr, nullptr, 4, "fp32");
    both(GroupedOut::rounded, nullptr, nullptr, esize, "rounded");
    both(GroupedOut::activation, &gate, &gated, esize, "gated activation");
    both(GroupedOut::activation, nullptr, &plain, esize, "relu2");
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, PackedGroupedGemm,
                         ::testing::Combine(::testing::Values(DType::bf16, DType::f16),
                                            ::testing::Values(Shape{200, 96}, Shape{72, 544},
                                                              Shape{130, 3584}),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           const Shape shape = std::get<1>(info.param);
                           return std::string(lmoe::dtype_name(std::get<0>(info.param))) + "_n" +
                                  std::to_string(shape.n) + "_k" + std::to_string(shape.k) +
                                  (std::get<2>(info.param) ? "_gather" : "");
                         });

// Packed arguments the host checks accept, on aligned host memory standing in for device pointers
// (never launched).
GroupedGemmArgs packed_args() {
  alignas(16) static std::uint8_t scratch[256];
  GroupedGemmArgs args;
  args.a = scratch;
  args.c = scratch;
  args.first = reinterpret_cast<const std::int32_t*>(scratch);
  args.b_blocks = args.b_scales = scratch;
  args.groups = 4;
  args.n = 16;
  args.k = 96;
  args.lda = 96;
  args.ldc = 16;
  args.max_rows = 8;
  args.max_groups = 4;
  args.blocks_group_stride = 16 * 96 / 2;
  args.scales_group_stride = 16 * 96 / 32;
  return args;
}

// Host checks only (refused before any CUDA call): runs without a GPU too.
TEST(PackedGroupedGemm, RefusesWhatItCannotRunWithTheReason) {
  alignas(16) static std::uint8_t other[64];
  const GroupedGemmArgs args = packed_args();
  ASSERT_FALSE(lmoe::cuda::grouped_gemm_unsupported(args).has_value());
  auto refused = [](const GroupedGemmArgs& bad) {
    EXPECT_EQ(lmoe::cuda::launch_grouped_gemm(bad, nullptr), cudaErrorInvalidValue);
    return lmoe::cuda::grouped_gemm_unsupported(bad).value_or("");
  };
  GroupedGemmArgs bad = args;
  bad.k = bad.lda = 80;  // a multiple of 16, not of 32
  EXPECT_THAT(refused(bad),
              HasSubstr("k: expected a multiple of 32 with MXFP4 weights (32 columns share a "
                        "scale), got 80"));
  bad = args;
  bad.b = other;
  EXPECT_THAT(refused(bad), HasSubstr("b, b2: expected null with MXFP4 weights (b_blocks)"));
  bad = args;
  bad.b_scales = nullptr;
  EXPECT_THAT(refused(bad), HasSubstr("b_scales, b2_scales: expected the scales"));
  bad = args;
  bad.out = GroupedOut::activation;
  lmoe::LayerConfig gated;
  gated.activation = lmoe::ExpertActivation::silu_glu;
  bad.activation = &gated;
  bad.b2_blocks = other;  // a gate without its scales
  EXPECT_THAT(refused(bad), HasSubstr("b_scales, b2_scales: expected the scales"));
  bad.b2_scales = other;
  EXPECT_FALSE(lmoe::cuda::grouped_gemm_unsupported(bad).has_value());
  bad.b2_blocks = bad.b2_scales = nullptr;  // gated activation, no gate
  EXPECT_THAT(refused(bad), HasSubstr("b2: expected the gate weights exactly when"));
  bad = args;
  bad.b_blocks = other + 8;
  EXPECT_THAT(refused(bad), HasSubstr("b_blocks, b2_blocks, blocks_group_stride: expected "
                                      "16-byte aligned blocks"));
  bad = args;
  bad.blocks_group_stride = 8;
  EXPECT_THAT(refused(bad), HasSubstr("a stride of whole 16 bytes, got stride 8"));
  bad = args;
  bad.b_scales = other + 2;
  EXPECT_THAT(refused(bad), HasSubstr("b_scales, b2_scales: expected 4-byte aligned scales"));
}

// automatic takes the dense weights' mma.sync tiles for packed ones and, on compute 9.0 from
// kGroupedWgmmaMinRows rows, wgmma_m256 where dense weights would take wgmma_ws (whose TMA loads
// bf16 rows): each bound ±1.
TEST(PackedGroupedGemm, AutomaticPicksTheDenseTileOrWgmmaM256) {
  GroupedGemmArgs args = packed_args();
  args.max_groups = 16;
  args.groups = 64;
  constexpr int kHopper = 90;
  const auto tile_for = [&](std::int64_t rows) {
    args.max_rows = rows;
    return lmoe::cuda::grouped_gemm_tile(args, kHopper);
  };
  constexpr std::int64_t kMin = lmoe::cuda::kGroupedWgmmaMinRows;
  EXPECT_EQ(tile_for(16 * 16), GroupedTile::m16);
  EXPECT_EQ(tile_for(16 * 16 + 1), GroupedTile::m64);
  EXPECT_EQ(tile_for(16 * (kMin - 1)), GroupedTile::m64);
  EXPECT_EQ(tile_for(16 * kMin), GroupedTile::wgmma_m256);
  EXPECT_EQ(tile_for(16 * 1000), GroupedTile::wgmma_m256);
  args.max_rows = 16 * 1000;
  EXPECT_EQ(lmoe::cuda::grouped_gemm_tile(args, 100), GroupedTile::m128);  // Blackwell: no wgmma
  EXPECT_EQ(lmoe::cuda::grouped_gemm_tile(args, 0), GroupedTile::m128);    // no device
  args.max_rows = 16 * 96;
  EXPECT_EQ(lmoe::cuda::grouped_gemm_tile(args, 100), GroupedTile::m64);
  args.max_rows = 16 * 96 + 1;
  EXPECT_EQ(lmoe::cuda::grouped_gemm_tile(args, 100), GroupedTile::m128);
  args.max_rows = 16 * 1000;
  args.b_blocks = nullptr;
  args.b = args.b_scales;  // dense: wgmma on compute 9.0
  EXPECT_EQ(lmoe::cuda::grouped_gemm_tile(args, kHopper), GroupedTile::wgmma_ws);
}

}  // namespace

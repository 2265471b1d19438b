// MXFP4 routed experts kept packed: the cpu backend, dequantizing each expert when a token needs
// it, gives the same bits as a layer loaded dequantized, and the layer reports the packed bytes.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <random>

#include "checkpoint_writer.hpp"
#include "lmoe/layer_weights.hpp"
#include "lmoe/tools/layer_runner.hpp"

namespace {

namespace fs = std::filesystem;
using lmoe::DType;
using lmoe::LayerConfig;

constexpr int kLayer = 1;

// The small preset's layer with Kimi-K3's activation (SiTU-GLU, β 4 and 25): its tanh bounds the
// hidden activations whatever the up and gate scales, so those can span E8M0's range (2^-127 …
// 2^113, beyond which a dot product of 192 such values could overflow fp32) and y stays finite;
// down's scales stop at 2^23 so that the tail's RMSNorm does not overflow either.
LayerConfig situ_config() {
  LayerConfig config = *lmoe::find_preset("small-mxfp4").layer;
  config.activation = lmoe::ExpertActivation::situ_glu;
  config.activation_beta = 4.0f;
  config.activation_linear_beta = 25.0f;
  return config;
}

// Random bytes (every nibble at both positions of a byte, many times over) and scales mostly near
// 2^0 with the extremes mixed in.
lmoe::testing::RawFile random_mxfp4_checkpoint(const LayerConfig& config,
                                               const lmoe::LayerTensorNames& names) {
  std::mt19937 generator(11);
  const lmoe::testing::RawFile dense = lmoe::testing::checkpoint_tensors(
      config, names, kLayer, lmoe::make_random_layer_weights(config, DType::bf16, 1, 0, 7));
  return lmoe::testing::with_mxfp4_experts(
      dense, config, names, kLayer,
      [&](const std::string& name, std::int64_t rows, std::int64_t cols) {
        const bool down = name.find(".down.") != std::string::npos;
        const std::vector<int> extremes = down
                                              ? std::vector<int>{0, 1, 60, 100, 127, 150}
                                              : std::vector<int>{0, 1, 60, 100, 127, 160, 200, 240};
        lmoe::testing::Mxfp4Blocks blocks = lmoe::testing::sized_mxfp4_blocks(rows, cols);
        for (auto& byte : blocks.packed) byte = std::byte(generator() & 0xff);
        for (auto& scale : blocks.scales) {
          const unsigned pick = generator() % 8;
          scale = std::byte(pick < 6 ? 120 + generator() % 15
                                     : extremes[generator() % extremes.size()]);
        }
        return blocks;
      });
}

TEST(PackedExperts, CpuLayerGivesTheBitsOfTheDequantizedLayer) {
  const fs::path dir = lmoe::testing::fresh_checkpoint_dir("lmoe_packed_");
  const LayerConfig config = situ_config();
  const lmoe::LayerTensorNames names = *lmoe::find_preset("small-mxfp4").tensor_names;
  lmoe::testing::write_checkpoint(dir, random_mxfp4_checkpoint(config, names));
  std::vector<lmoe::HostTensor> inputs;
  for (std::int64_t tokens : {1, 5, 64}) {
    inputs.push_back(lmoe::make_random_layer_input(config.d_model, tokens, DType::bf16,
                                                   static_cast<std::uint64_t>(tokens)));
  }
  lmoe::LayerOptions options;
  options.config = config;
  options.dtype = DType::bf16;
  options.backend = lmoe::Backend::cpu;
  lmoe::LayerRunOptions run;
  run.comm = "threads";
  run.keep_partials = true;
  for (int tp : {1, 2}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    std::vector<lmoe::LayerWeightBytes> packed_bytes(static_cast<std::size_t>(tp));
    const auto load = [&](bool keep_packed) {
      return [&, keep_packed](int rank) {
        lmoe::LayerWeights weights =
            lmoe::load_layer_weights(dir.string(), names, kLayer, config, DType::bf16, tp, rank,
                                     {.keep_experts_packed = keep_packed});
        EXPECT_EQ(weights.experts_packed(), keep_packed);
        if (keep_packed) {
          // No dequantized copy: the dense expert tensors are absent.
          EXPECT_EQ(weights.expert_up.nbytes() + weights.expert_gate.nbytes() +
                        weights.expert_down.nbytes(),
                    0u);
          packed_bytes[static_cast<std::size_t>(rank)] =
              lmoe::layer_weight_bytes(weights, DType::bf16);
        }
        return weights;
      };
    };
    const auto dense = lmoe::run_layer_on_threads(options, tp, load(false), inputs, run);
    const auto packed = lmoe::run_layer_on_threads(options, tp, load(true), inputs, run);
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      SCOPED_TRACE("T " + std::to_string(inputs[i].shape()[0]));
      for (int rank = 0; rank < tp; ++rank) {
        const lmoe::LayerRankResult& a = dense[i].ranks[static_cast<std::size_t>(rank)];
        const lmoe::LayerRankResult& b = packed[i].ranks[static_cast<std::size_t>(rank)];
        EXPECT_TRUE(same_bits(a.routed, b.routed)) << "routed, rank " << rank;
        EXPECT_TRUE(same_bits(a.shared, b.shared)) << "shared, rank " << rank;
        EXPECT_TRUE(same_bits(a.y, b.y)) << "y, rank " << rank;
        EXPECT_EQ(a.routing.expert_ids, b.routing.expert_ids);
        for (std::int64_t j = 0; j < b.y.numel(); ++j) ASSERT_TRUE(std::isfinite(b.y.get(j)));
      }
    }
    // Per rank: gate and up [E, I/tp, l], down [E, l, I/tp], each value half a byte and a scale
    // byte per 32 values.
    const std::int64_t values =
        3 * config.router.num_experts * (config.expert_intermediate / tp) * config.d_latent;
    for (const lmoe::LayerWeightBytes& bytes : packed_bytes) {
      EXPECT_TRUE(bytes.experts_packed);
      EXPECT_EQ(bytes.routed_experts, static_cast<std::size_t>(values / 2 + values / 32));
      EXPECT_EQ(bytes.routed_experts_mxfp4, bytes.routed_experts);
      EXPECT_EQ(bytes.routed_experts_dequantized, static_cast<std::size_t>(values * 2));
    }
  }
  fs::remove_all(dir);
}

}  // namespace

// MXFP4 routed experts kept packed: the cpu backend, dequantizing each expert when a token needs
// it, gives the same bits as a layer loaded dequantized, and the layer reports the packed bytes.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "checkpoint_writer.hpp"
#include "lmoe/layer_weights.hpp"
#include "lmoe/tools/layer_runner.hpp"
#include "packed_checkpoint.hpp"

namespace {

namespace fs = std::filesystem;
using lmoe::DType;
using lmoe::LayerConfig;

constexpr int kLayer = 1;

TEST(PackedExperts, CpuLayerGivesTheBitsOfTheDequantizedLayer) {
  const fs::path dir = lmoe::testing::write_random_mxfp4_checkpoint("lmoe_packed_", kLayer);
  const LayerConfig config = lmoe::testing::situ_mxfp4_config();
  const lmoe::LayerTensorNames names = *lmoe::find_preset("small-mxfp4").tensor_names;
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
    lmoe::testing::expect_same_layer_bits(dense, packed, tp);
    for (const lmoe::LayerInputRun& input : packed) {
      for (const lmoe::LayerRankResult& rank : input.ranks) {
        for (std::int64_t j = 0; j < rank.y.numel(); ++j) ASSERT_TRUE(std::isfinite(rank.y.get(j)));
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

// A small MXFP4 checkpoint whose packed experts span E8M0's range, for the tests that hold a layer
// loaded packed to the same layer loaded dequantized (the cpu backend's and the cuda backend's).
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "checkpoint_writer.hpp"
#include "lmoe/dims.hpp"
#include "lmoe/layer_weights.hpp"
#include "lmoe/tools/layer_runner.hpp"

namespace lmoe::testing {

// The small preset's layer with Kimi-K3's activation (SiTU-GLU, β 4 and 25): its tanh bounds the
// hidden activations whatever the up and gate scales, so those can span E8M0's range (2^-127 …
// 2^113, beyond which a dot product of 192 such values could overflow fp32) and y stays finite;
// down's scales stop at 2^23 so that the tail's RMSNorm does not overflow either.
inline LayerConfig situ_mxfp4_config() {
  LayerConfig config = *find_preset("small-mxfp4").layer;
  config.activation = ExpertActivation::situ_glu;
  config.activation_beta = 4.0f;
  config.activation_linear_beta = 25.0f;
  return config;
}

// Layer `layer` with random bytes (every nibble at both positions of a byte, many times over) and
// scales mostly near 2^0 with the extremes mixed in.
inline RawFile random_mxfp4_checkpoint(const LayerConfig& config, const LayerTensorNames& names,
                                       int layer) {
  std::mt19937 generator(11);
  const RawFile dense = checkpoint_tensors(config, names, layer,
                                           make_random_layer_weights(config, DType::bf16, 1, 0, 7));
  return with_mxfp4_experts(dense, config, names, layer,
                            [&](const std::string& name, std::int64_t rows, std::int64_t cols) {
                              const bool down = name.find(".down.") != std::string::npos;
                              const std::vector<int> extremes =
                                  down ? std::vector<int>{0, 1, 60, 100, 127, 150}
                                       : std::vector<int>{0, 1, 60, 100, 127, 160, 200, 240};
                              Mxfp4Blocks blocks = sized_mxfp4_blocks(rows, cols);
                              for (auto& byte : blocks.packed) byte = std::byte(generator() & 0xff);
                              for (auto& scale : blocks.scales) {
                                const unsigned pick = generator() % 8;
                                scale =
                                    std::byte(pick < 6 ? 120 + generator() % 15
                                                       : extremes[generator() % extremes.size()]);
                              }
                              return blocks;
                            });
}

// A fresh folder (fresh_checkpoint_dir(prefix)) holding situ_mxfp4_config()'s layer `layer` with
// random_mxfp4_checkpoint's experts, under the small-mxfp4 preset's names.
inline std::filesystem::path write_random_mxfp4_checkpoint(const std::string& prefix, int layer) {
  const std::filesystem::path dir = fresh_checkpoint_dir(prefix);
  write_checkpoint(dir, random_mxfp4_checkpoint(situ_mxfp4_config(),
                                                *find_preset("small-mxfp4").tensor_names, layer));
  return dir;
}

// Two runs of the same inputs at tp ranks gave every rank the same bits: partials, y and routing.
inline void expect_same_layer_bits(const std::vector<LayerInputRun>& expected,
                                   const std::vector<LayerInputRun>& actual, int tp) {
  ASSERT_EQ(expected.size(), actual.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    SCOPED_TRACE("input " + std::to_string(i));
    for (std::size_t rank = 0; rank < static_cast<std::size_t>(tp); ++rank) {
      const LayerRankResult& a = expected[i].ranks[rank];
      const LayerRankResult& b = actual[i].ranks[rank];
      EXPECT_TRUE(same_bits(a.routed, b.routed)) << "routed, rank " << rank;
      EXPECT_TRUE(same_bits(a.shared, b.shared)) << "shared, rank " << rank;
      EXPECT_TRUE(same_bits(a.y, b.y)) << "y, rank " << rank;
      EXPECT_EQ(a.routing.expert_ids, b.routing.expert_ids) << "rank " << rank;
    }
  }
}

}  // namespace lmoe::testing

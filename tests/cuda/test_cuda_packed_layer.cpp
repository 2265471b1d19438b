// MXFP4 routed experts kept packed on the cuda backend: they stay packed on the GPU, every forward
// takes the routed experts' device path, whose grouped GEMMs dequantize them in their main loop,
// and the layer gives the bits of the same checkpoint loaded dequantized on the device path
// (partials, y and routing, tp 1 and 2), eager and replayed from CUDA graphs; what building it
// takes on the GPU holds its weights as held; a layer the device path cannot run (f32) refuses
// packed experts when it is built, with the reason. Every test skips where no GPU is visible.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "error_message.hpp"
#include "gpu_test_support.hpp"
#include "lmoe/comm_group.hpp"
#include "lmoe/latent_moe_layer.hpp"
#include "lmoe/layer_weights.hpp"
#include "lmoe/tools/layer_runner.hpp"
#include "packed_checkpoint.hpp"

namespace {

namespace fs = std::filesystem;
using lmoe::DType;
using lmoe::LayerConfig;
using ::testing::HasSubstr;

constexpr int kLayer = 1;

// A random packed checkpoint (removed with the object), its layer's options on the cuda backend,
// and inputs of the given T.
struct PackedCheckpoint {
  explicit PackedCheckpoint(const std::string& prefix)
      : dir(lmoe::testing::write_random_mxfp4_checkpoint(prefix, kLayer)) {
    options.config = config;
    options.dtype = DType::bf16;
    options.backend = lmoe::Backend::cuda;
  }
  ~PackedCheckpoint() { fs::remove_all(dir); }

  // Rank r of tp's weights, the experts kept packed or dequantized at load.
  std::function<lmoe::LayerWeights(int)> weights(int tp, bool keep_packed) const {
    return [this, tp, keep_packed](int rank) {
      return lmoe::load_layer_weights(dir.string(), names, kLayer, config, DType::bf16, tp, rank,
                                      {.keep_experts_packed = keep_packed});
    };
  }
  std::vector<lmoe::HostTensor> inputs(std::initializer_list<std::int64_t> tokens,
                                       std::uint64_t seed) const {
    std::vector<lmoe::HostTensor> made;
    for (std::int64_t t : tokens) {
      made.push_back(lmoe::make_random_layer_input(config.d_model, t, DType::bf16,
                                                   seed + static_cast<std::uint64_t>(t)));
    }
    return made;
  }
  // The same layer dequantized, on the device path (its eager default is cuBLASLt's host path,
  // whose sums run in another order); the packed one takes the device path by itself.
  lmoe::LayerOptions dense_on_device() const {
    lmoe::LayerOptions device = options;
    device.device_experts = true;
    return device;
  }

  fs::path dir;
  LayerConfig config = lmoe::testing::situ_mxfp4_config();
  lmoe::LayerTensorNames names = *lmoe::find_preset("small-mxfp4").tensor_names;
  lmoe::LayerOptions options;
};

// T = 1 and 5 (m16 tiles), 64 and 300 (more rows per expert: m64 and m128 where 16 experts share
// them).
TEST(CudaPackedExperts, LayerGivesTheBitsOfTheDequantizedLayerOnTheDevicePath) {
  SKIP_WITHOUT_GPU();
  const PackedCheckpoint checkpoint("lmoe_cuda_packed_");
  const std::vector<lmoe::HostTensor> inputs = checkpoint.inputs({1, 5, 64, 300}, 0);
  lmoe::LayerRunOptions run;
  run.keep_partials = true;
  for (int tp : {1, 2}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    const auto dense = lmoe::run_layer_on_threads(checkpoint.dense_on_device(), tp,
                                                  checkpoint.weights(tp, false), inputs, run);
    const auto packed = lmoe::run_layer_on_threads(checkpoint.options, tp,
                                                   checkpoint.weights(tp, true), inputs, run);
    lmoe::testing::expect_same_layer_bits(dense, packed, tp);
    // What building the layers took on the GPU holds at least rank 0's weights, as held.
    const auto weights_on_device = [&](bool keep_packed) {
      return static_cast<std::int64_t>(
          lmoe::layer_weight_bytes(checkpoint.weights(tp, keep_packed)(0), DType::bf16).total());
    };
    EXPECT_GE(dense.front().ranks.front().layer_device_bytes, weights_on_device(false));
    EXPECT_GE(packed.front().ranks.front().layer_device_bytes, weights_on_device(true));
  }
}

// `lmoe layer --graph`'s runner with packed experts, T changing from input to input: every replay
// of a T's graph has the eager forward's bits, and those are the dequantized layer's on the device
// path (one p2p rank: the graph holds the whole forward, tail included).
TEST(CudaPackedExperts, GraphReplaysGiveTheBitsOfTheDequantizedLayer) {
  SKIP_WITHOUT_GPU();
  const PackedCheckpoint checkpoint("lmoe_cuda_packed_graph_");
  const std::vector<lmoe::HostTensor> inputs = checkpoint.inputs({5, 1, 300, 64}, 40);
  lmoe::LayerRunOptions graph;
  graph.comm = "p2p";
  graph.graph = true;
  graph.warmup = 1;
  graph.repeats = 2;
  const auto packed =
      lmoe::run_layer_on_threads(checkpoint.options, 1, checkpoint.weights(1, true), inputs, graph);
  lmoe::LayerRunOptions eager;
  eager.comm = "p2p";
  const auto dense = lmoe::run_layer_on_threads(checkpoint.dense_on_device(), 1,
                                                checkpoint.weights(1, false), inputs, eager);
  ASSERT_EQ(packed.size(), inputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    SCOPED_TRACE("input " + std::to_string(i));
    const lmoe::LayerRankResult& replayed = packed[i].ranks.front();
    EXPECT_TRUE(replayed.replay_matches_eager);
    EXPECT_EQ(replayed.replay_seconds.size(), 2u);
    EXPECT_TRUE(lmoe::same_bits(replayed.y, dense[i].ranks.front().y));
    EXPECT_EQ(replayed.routing.expert_ids, dense[i].ranks.front().routing.expert_ids);
  }
}

TEST(CudaPackedExperts, AnF32LayerRefusesThemWithTheReason) {
  SKIP_WITHOUT_GPU();
  const PackedCheckpoint checkpoint("lmoe_cuda_packed_f32_");
  lmoe::LayerOptions options = checkpoint.options;
  options.dtype = DType::f32;
  lmoe::run_comm_group("cuda-threads", 1, [&](int, lmoe::Communicator& comm) {
    const std::string message = lmoe::testing::error_message_of([&] {
      lmoe::LatentMoELayer layer(options, comm,
                                 lmoe::load_layer_weights(checkpoint.dir.string(), checkpoint.names,
                                                          kLayer, checkpoint.config, DType::f32, 1,
                                                          0, {.keep_experts_packed = true}));
    });
    EXPECT_THAT(message, HasSubstr("weights: MXFP4 experts kept packed run on the cuda layer's "
                                   "device path"));
    EXPECT_THAT(message, HasSubstr("dtype: the device path's grouped GEMM takes bf16 or f16, got "
                                   "f32; load them dequantized"));
  });
}

}  // namespace

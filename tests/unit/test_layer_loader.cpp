// Loading one layer from safetensors shards: every rank's slice equals the weights that were
// written (bf16, sharded over two files with an index), MXFP4 experts dequantize to the e2m1 ×
// E8M0 values, and a missing, mis-shaped or mis-typed tensor is an error that names it.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#include <grp.h>
#include <sys/wait.h>
#include <unistd.h>

#include "checkpoint_writer.hpp"
#include "lmoe/error.hpp"
#include "lmoe/layer_weights.hpp"

namespace {

namespace fs = std::filesystem;
using lmoe::DType;
using lmoe::HostTensor;
using lmoe::LayerConfig;
using ::testing::HasSubstr;

constexpr int kLayer = 5;

using lmoe::testing::Mxfp4Blocks;
using lmoe::testing::RawFile;
using lmoe::testing::write_checkpoint;
using lmoe::testing::write_raw;

std::string name_of(const std::string& pattern, std::int64_t expert = 0) {
  return lmoe::testing::tensor_name(pattern, kLayer, expert);
}

LayerConfig small_config() { return *lmoe::find_preset("small").layer; }
lmoe::LayerTensorNames small_names() { return *lmoe::find_preset("small").tensor_names; }

// The full (tp = 1) weights as checkpoint tensors by the small preset's names.
RawFile checkpoint_tensors(const LayerConfig& c, const lmoe::LayerWeights& w) {
  return lmoe::testing::checkpoint_tensors(c, small_names(), kLayer, w);
}

class LayerLoader : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = lmoe::testing::fresh_checkpoint_dir("lmoe_loader_"); }
  void TearDown() override { fs::remove_all(dir_); }

  // The small preset's bf16 tensors of one layer, as a checkpoint names them.
  static RawFile good_tensors() {
    const LayerConfig config = small_config();
    return checkpoint_tensors(config,
                              lmoe::make_random_layer_weights(config, DType::bf16, 1, 0, 3));
  }
  fs::path index_path() const { return dir_ / "model.safetensors.index.json"; }

  std::string load_error(const RawFile& tensors, int tp = 2) {
    write_checkpoint(dir_, tensors);
    return load_error_as_written(tp);
  }

  // The error of loading dir_ as it is now.
  std::string load_error_as_written(int tp = 2) {
    try {
      lmoe::load_layer_weights(dir_.string(), small_names(), kLayer, small_config(), DType::bf16,
                               tp, tp - 1);
    } catch (const lmoe::Error& error) {
      return error.message();
    }
    return "no error";
  }

  // The error of loading dir_ as a user whom file modes bind: root reads files of mode 000, so as
  // root a child process drops to nobody (uid and gid 65534, no other groups) and sends the message
  // back through a pipe; nullopt where it cannot. Any other user loads in this process.
  std::optional<std::string> load_error_unprivileged() {
    if (::geteuid() != 0) return load_error_as_written();
    int fds[2];
    if (::pipe(fds) != 0) return std::nullopt;
    const pid_t child = ::fork();
    if (child < 0) return std::nullopt;
    if (child == 0) {
      ::close(fds[0]);
      const bool dropped = ::setgroups(0, nullptr) == 0 && ::setgid(65534) == 0 &&
                           ::setuid(65534) == 0 && ::geteuid() != 0;
      const std::string message = dropped ? load_error_as_written() : std::string();
      const bool written =
          ::write(fds[1], message.data(), message.size()) == static_cast<ssize_t>(message.size());
      ::_exit(dropped && written ? 0 : 1);  // no test teardown in the child
    }
    ::close(fds[1]);
    std::string message;
    char buffer[4096];
    for (ssize_t n; (n = ::read(fds[0], buffer, sizeof(buffer))) > 0;) {
      message.append(buffer, static_cast<std::size_t>(n));
    }
    ::close(fds[0]);
    int status = 0;
    ::waitpid(child, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return std::nullopt;
    return message;
  }

  fs::path dir_;
};

TEST_F(LayerLoader, EveryRankGetsItsSliceOfTheWrittenWeights) {
  const LayerConfig config = small_config();
  const lmoe::LayerWeights full = lmoe::make_random_layer_weights(config, DType::bf16, 1, 0, 21);
  write_checkpoint(dir_, checkpoint_tensors(config, full));
  for (int tp : {1, 2, 4}) {
    for (int rank = 0; rank < tp; ++rank) {
      SCOPED_TRACE("tp " + std::to_string(tp) + " rank " + std::to_string(rank));
      const lmoe::LayerWeights loaded = lmoe::load_layer_weights(
          dir_.string(), small_names(), kLayer, config, DType::bf16, tp, rank);
      const lmoe::LayerWeights expected =
          lmoe::make_random_layer_weights(config, DType::bf16, tp, rank, 21);
      EXPECT_FALSE(lmoe::validate_layer_weights(config, DType::bf16, tp, loaded).has_value());
      for (const lmoe::WeightSlot& slot : lmoe::layer_weight_slots(config, DType::bf16, tp)) {
        EXPECT_TRUE(same_bits(loaded.*slot.member, expected.*slot.member)) << slot.name;
      }
    }
  }
  // Without an index the shards' headers say where each tensor is.
  fs::remove(dir_ / "model.safetensors.index.json");
  const lmoe::LayerWeights loaded =
      lmoe::load_layer_weights(dir_.string(), small_names(), kLayer, config, DType::bf16, 2, 1);
  EXPECT_TRUE(
      same_bits(loaded.expert_down,
                lmoe::make_random_layer_weights(config, DType::bf16, 2, 1, 21).expert_down));
  // Converted on load: f32 storage holds the same values.
  const lmoe::LayerWeights as_f32 =
      lmoe::load_layer_weights(dir_.string(), small_names(), kLayer, config, DType::f32, 2, 0);
  EXPECT_EQ(as_f32.latent_up.dtype(), DType::f32);
  EXPECT_EQ(as_f32.latent_up.get(77), full.latent_up.get(77));
}

// The full (tp = 1) weights as checkpoint tensors with every routed expert's matrices as MXFP4
// blocks from `blocks_of` (asked for each expert in order: gate, up, down).
RawFile mxfp4_checkpoint(const LayerConfig& config, const lmoe::LayerTensorNames& names,
                         const lmoe::testing::Mxfp4BlocksOf& blocks_of) {
  return lmoe::testing::with_mxfp4_experts(
      checkpoint_tensors(config, lmoe::make_random_layer_weights(config, DType::bf16, 1, 0, 3)),
      config, names, kLayer, blocks_of);
}

// e2m1 by its definition: sign, 2-bit exponent (bias 1), 1-bit mantissa; exponent 0 is subnormal.
double e2m1(unsigned nibble) {
  const unsigned exponent = (nibble >> 1) & 3u, mantissa = nibble & 1u;
  const double magnitude =
      exponent == 0 ? 0.5 * mantissa
                    : (1.0 + 0.5 * mantissa) * std::ldexp(1.0, static_cast<int>(exponent) - 1);
  return (nibble & 8u) ? -magnitude : magnitude;
}

TEST_F(LayerLoader, Mxfp4ExpertsDequantizeExactly) {
  const LayerConfig config = small_config();
  const std::int64_t l = config.d_latent, inter = config.expert_intermediate;
  lmoe::LayerTensorNames names = small_names();
  names.experts_mxfp4 = true;
  std::mt19937 generator(5);
  // Per expert and matrix: packed bytes and scales, kept to compute the expected values.
  std::map<std::string, Mxfp4Blocks> blocks;
  write_checkpoint(
      dir_, mxfp4_checkpoint(
                config, names, [&](const std::string& name, std::int64_t rows, std::int64_t cols) {
                  Mxfp4Blocks& b = blocks[name] = lmoe::testing::sized_mxfp4_blocks(rows, cols);
                  for (auto& byte : b.packed) byte = std::byte(generator());
                  for (auto& scale : b.scales) scale = std::byte(120 + generator() % 12);
                  return b;
                }));
  const int tp = 2, rank = 1;
  const std::int64_t inter_r = inter / tp;
  const lmoe::LayerWeights loaded =
      lmoe::load_layer_weights(dir_.string(), names, kLayer, config, DType::bf16, tp, rank);
  auto expected = [&](const std::string& name, std::int64_t cols, std::int64_t row,
                      std::int64_t col) {
    const auto& [packed, scales] = blocks.at(name);
    const auto byte =
        std::to_integer<unsigned>(packed[static_cast<std::size_t>((row * cols + col) / 2)]);
    const unsigned nibble = col % 2 == 0 ? byte & 0xfu : byte >> 4;
    const auto scale =
        std::to_integer<int>(scales[static_cast<std::size_t>(row * cols / 32 + col / 32)]);
    return e2m1(nibble) * std::ldexp(1.0, scale - 127);
  };
  for (std::int64_t e = 0; e < config.router.num_experts; e += 3) {
    for (std::int64_t i = 0; i < inter_r; ++i) {
      for (std::int64_t j = 0; j < l; ++j) {
        ASSERT_EQ(loaded.expert_up.get((e * inter_r + i) * l + j),
                  expected(name_of(names.expert_up, e), l, rank * inter_r + i, j));
        ASSERT_EQ(loaded.expert_gate.get((e * inter_r + i) * l + j),
                  expected(name_of(names.expert_gate, e), l, rank * inter_r + i, j));
        ASSERT_EQ(loaded.expert_down.get((e * l + j) * inter_r + i),
                  expected(name_of(names.expert_down, e), inter, j, rank * inter_r + i));
      }
    }
  }
  EXPECT_TRUE(std::isnan(lmoe::mxfp4_value(0x3, 0xff)));
  EXPECT_EQ(lmoe::mxfp4_value(0xf, 128), -12.0f);
  EXPECT_EQ(lmoe::mxfp4_value(0x1, 0), std::ldexp(0.5f, -127));
}

// Kept packed, each rank holds the checkpoint's bytes of its slice (rows of gate and up, whole
// blocks of every down row), and they dequantize to the bits a dequantizing load gives, for every
// byte value and scales from 2^-127 to the largest each dtype holds.
TEST_F(LayerLoader, Mxfp4ExpertsKeptPackedHoldTheirSliceOfTheCheckpointsBytes) {
  const LayerConfig config = small_config();
  const std::int64_t l = config.d_latent, inter = config.expert_intermediate;
  lmoe::LayerTensorNames names = small_names();
  names.experts_mxfp4 = true;
  for (const auto& [dtype, scale_range] :
       {std::pair{DType::bf16, std::vector<int>{0, 1, 2, 64, 100, 126, 127, 128, 160, 220, 252}},
        std::pair{DType::f32, std::vector<int>{0, 1, 30, 127, 200, 252}},
        // f16 rounds the smallest values (below 2^-24) and holds 6 · 2^13 at most.
        std::pair{DType::f16, std::vector<int>{0, 90, 100, 105, 112, 127, 135, 140}}}) {
    SCOPED_TRACE(std::string(lmoe::dtype_name(dtype)));
    std::map<std::string, Mxfp4Blocks> blocks;
    std::size_t next = 0;
    write_checkpoint(
        dir_, mxfp4_checkpoint(config, names,
                               [&](const std::string& name, std::int64_t rows, std::int64_t cols) {
                                 Mxfp4Blocks& b = blocks[name] =
                                     lmoe::testing::sized_mxfp4_blocks(rows, cols);
                                 for (auto& byte : b.packed) byte = std::byte(next++ * 7 % 256);
                                 for (auto& scale : b.scales)
                                   scale = std::byte(scale_range[next++ % scale_range.size()]);
                                 return b;
                               }));
    for (int tp : {1, 2}) {
      const std::int64_t inter_r = inter / tp;
      for (int rank = 0; rank < tp; ++rank) {
        SCOPED_TRACE("tp " + std::to_string(tp) + " rank " + std::to_string(rank));
        const lmoe::LayerWeights packed = lmoe::load_layer_weights(
            dir_.string(), names, kLayer, config, dtype, tp, rank, {.keep_experts_packed = true});
        const lmoe::LayerWeights dense =
            lmoe::load_layer_weights(dir_.string(), names, kLayer, config, dtype, tp, rank);
        ASSERT_TRUE(packed.experts_packed());
        EXPECT_FALSE(dense.experts_packed());
        EXPECT_FALSE(lmoe::validate_layer_weights(config, dtype, tp, packed).has_value());
        EXPECT_TRUE(packed.expert_up.shape().empty());
        EXPECT_EQ(packed.expert_down_mxfp4.shape,
                  (std::vector<std::int64_t>{config.router.num_experts, l, inter_r}));
        for (HostTensor lmoe::LayerWeights::*member :
             {&lmoe::LayerWeights::expert_gate, &lmoe::LayerWeights::expert_up,
              &lmoe::LayerWeights::expert_down}) {
          HostTensor scratch;
          EXPECT_TRUE(
              same_bits(lmoe::dense_expert_weight(packed, member, dtype, scratch), dense.*member));
        }
        // The bytes themselves: expert 3's up row 1 of this rank, and its down row 5.
        const auto& up = blocks.at(name_of(names.expert_up, 3));
        const auto& down = blocks.at(name_of(names.expert_down, 3));
        for (std::int64_t j = 0; j < l / 2; ++j) {
          ASSERT_EQ(packed.expert_up_mxfp4.blocks[(3 * inter_r + 1) * l / 2 + j],
                    std::to_integer<std::uint8_t>(up.packed[(rank * inter_r + 1) * l / 2 + j]));
        }
        for (std::int64_t j = 0; j < inter_r / 2; ++j) {
          ASSERT_EQ(
              packed.expert_down_mxfp4.blocks[(3 * l + 5) * inter_r / 2 + j],
              std::to_integer<std::uint8_t>(down.packed[(5 * inter + rank * inter_r) / 2 + j]));
        }
        for (std::int64_t j = 0; j < inter_r / 32; ++j) {
          ASSERT_EQ(
              packed.expert_down_mxfp4.scales[(3 * l + 5) * inter_r / 32 + j],
              std::to_integer<std::uint8_t>(down.scales[(5 * inter + rank * inter_r) / 32 + j]));
        }
        const lmoe::LayerWeightBytes bytes = lmoe::layer_weight_bytes(packed, dtype);
        const lmoe::LayerWeightBytes dense_bytes = lmoe::layer_weight_bytes(dense, dtype);
        const auto values = static_cast<std::size_t>(3 * config.router.num_experts * inter_r * l);
        EXPECT_EQ(bytes.routed_experts, values / 2 + values / 32);
        EXPECT_EQ(dense_bytes.routed_experts, values * lmoe::dtype_size(dtype));
        EXPECT_EQ(bytes.routed_experts_dequantized, dense_bytes.routed_experts);
        EXPECT_EQ(dense_bytes.routed_experts_mxfp4, bytes.routed_experts);
        EXPECT_EQ(bytes.other, dense_bytes.other);
      }
    }
  }
}

// Every routed expert as MXFP4 blocks: each packed byte 0x77 (e2m1 6 in both nibbles) and
// every scale 127 (2^0), so one edited byte decides whether a load passes.
RawFile mxfp4_checkpoint(const LayerConfig& config, const lmoe::LayerTensorNames& names) {
  return mxfp4_checkpoint(
      config, names, [](const std::string&, std::int64_t rows, std::int64_t cols) {
        return Mxfp4Blocks{std::vector<std::byte>(rows * (cols / 2), std::byte{0x77}),
                           std::vector<std::byte>(rows * (cols / 32), std::byte{127})};
      });
}

// Each way MXFP4 blocks can be wrong is refused with the tensor, and for a scale its row and
// block: a NaN scale or an overflowing product would otherwise reach the GEMMs as NaN or inf.
TEST_F(LayerLoader, BadMxfp4BlocksAndScalesAreNamed) {
  LayerConfig config = small_config();
  lmoe::LayerTensorNames names = small_names();
  names.experts_mxfp4 = true;
  const int tp = 2, rank = 1;
  const std::int64_t l = config.d_latent, inter_r = config.expert_intermediate / tp;
  const std::string gate = name_of(names.expert_gate, 0);
  // Every case fails alike whether the experts are dequantized or kept packed.
  const auto load_error_of = [&](const RawFile& tensors, DType dtype = DType::bf16) {
    write_checkpoint(dir_, tensors);
    std::string messages[2];
    for (bool keep_packed : {false, true}) {
      try {
        lmoe::load_layer_weights(dir_.string(), names, kLayer, config, dtype, tp, rank,
                                 {.keep_experts_packed = keep_packed});
        messages[keep_packed] = "no error";
      } catch (const lmoe::Error& error) {
        messages[keep_packed] = error.message();
      }
    }
    EXPECT_EQ(messages[0], messages[1]);
    return messages[0];
  };
  const RawFile good = mxfp4_checkpoint(config, names);
  EXPECT_EQ(load_error_of(good), "no error");

  RawFile not_u8 = good;
  not_u8[gate + "_packed"].dtype = "I8";
  EXPECT_THAT(load_error_of(not_u8),
              HasSubstr("tensor '" + gate + "_packed': dtype I8, expected U8 (MXFP4)"));

  RawFile block_shape = good;
  block_shape[gate + "_packed"].shape = {config.expert_intermediate, l};
  block_shape[gate + "_packed"].bytes.resize(
      static_cast<std::size_t>(config.expert_intermediate * l));
  EXPECT_THAT(load_error_of(block_shape),
              HasSubstr("tensor '" + gate + "_packed': shape [" +
                        std::to_string(config.expert_intermediate) + ", " + std::to_string(l) +
                        "], expected [" + std::to_string(config.expert_intermediate) + ", " +
                        std::to_string(l / 2) + "]"));

  RawFile scale_shape = good;
  scale_shape[gate + "_scale"].shape = {config.expert_intermediate / 2, l / 16};
  EXPECT_THAT(
      load_error_of(scale_shape),
      HasSubstr("tensor '" + gate + "_scale': shape [" +
                std::to_string(config.expert_intermediate / 2) + ", " + std::to_string(l / 16) +
                "], expected [" + std::to_string(config.expert_intermediate) + ", " +
                std::to_string(l / 32) + "]"));

  // Row 2 of this rank's slice, block 1 (columns 32 … 63).
  const std::size_t scale_at = static_cast<std::size_t>((rank * inter_r + 2) * (l / 32) + 1);
  RawFile nan_scale = good;
  nan_scale[gate + "_scale"].bytes[scale_at] = std::byte{255};
  EXPECT_THAT(load_error_of(nan_scale),
              HasSubstr("tensor '" + gate + "_scale': row " + std::to_string(rank * inter_r + 2) +
                        ", block 1 holds E8M0 255, which is NaN"));

  // 6 · 2^127 is beyond every storage dtype; 6 · 2^16 only beyond f16's.
  RawFile huge_scale = good;
  huge_scale[gate + "_scale"].bytes[scale_at] = std::byte{254};
  EXPECT_THAT(load_error_of(huge_scale),
              HasSubstr("tensor '" + gate + "_scale': row " + std::to_string(rank * inter_r + 2) +
                        ", block 1 holds E8M0 254 (2^127), whose product with the e2m1 value 6 "
                        "is beyond the range of bf16"));
  RawFile f16_only = good;
  f16_only[gate + "_scale"].bytes[scale_at] = std::byte{127 + 16};
  EXPECT_EQ(load_error_of(f16_only, DType::bf16), "no error");
  EXPECT_THAT(load_error_of(f16_only, DType::f16),
              HasSubstr("holds E8M0 143 (2^16), whose product with the e2m1 value 6 is beyond the "
                        "range of f16"));

  // A NaN scale in down's columns of the other rank is refused too (down is read whole).
  RawFile down_nan = good;
  const std::string down = name_of(names.expert_down, 7);
  down_nan[down + "_scale"].bytes[static_cast<std::size_t>(9 * (config.expert_intermediate / 32))] =
      std::byte{255};
  EXPECT_THAT(
      load_error_of(down_nan),
      HasSubstr("tensor '" + down + "_scale': row 9, block 0 holds E8M0 255, which is NaN"));

  // Kept packed, rank r's columns of down must be whole blocks: at tp 4 they are 16 of 32.
  write_checkpoint(dir_, good);
  try {
    lmoe::load_layer_weights(dir_.string(), names, kLayer, config, DType::bf16, 4, 1,
                             {.keep_experts_packed = true});
    ADD_FAILURE() << "no error";
  } catch (const lmoe::Error& error) {
    EXPECT_THAT(error.message(),
                HasSubstr("tensor '" + name_of(names.expert_down, 0) +
                          "': MXFP4 experts kept packed need each rank's slice of the "
                          "intermediate dim to be whole 32-column blocks of the down projection's "
                          "rows; I/tp = 64/4 = 16 is not a multiple of 32"));
  }
  EXPECT_NO_THROW(
      lmoe::load_layer_weights(dir_.string(), names, kLayer, config, DType::bf16, 4, 1));

  // A latent width that is not a multiple of 32 cannot be MXFP4 (blocks span 32 columns).
  config.d_latent = 208;
  EXPECT_THAT(
      load_error_of(mxfp4_checkpoint(config, names)),
      HasSubstr("tensor '" + gate + "': MXFP4 needs an input dimension divisible by 32, got 208"));
}

TEST_F(LayerLoader, BadTensorsAreNamed) {
  const LayerConfig config = small_config();
  const lmoe::LayerTensorNames names = small_names();
  const RawFile good =
      checkpoint_tensors(config, lmoe::make_random_layer_weights(config, DType::bf16, 1, 0, 3));

  RawFile missing = good;
  missing.erase(name_of(names.expert_up, 13));
  EXPECT_THAT(
      load_error(missing),
      HasSubstr("tensor 'layers.5.moe.experts.13.up.weight': not found in " + dir_.string()));

  RawFile misshaped = good;
  misshaped[name_of(names.latent_down)].shape = {96, 768};
  EXPECT_THAT(
      load_error(misshaped),
      HasSubstr("tensor 'layers.5.moe.latent_down.weight': shape [96, 768], expected [192, 384]"));

  RawFile mistyped = good;
  mistyped[name_of(names.latent_norm)] = {"U8", {384}, std::vector<std::byte>(384)};
  EXPECT_THAT(
      load_error(mistyped),
      HasSubstr("tensor 'layers.5.moe.latent_norm.weight': dtype U8, expected BF16, F16 or F32"));

  lmoe::LayerTensorNames mxfp4 = names;
  mxfp4.experts_mxfp4 = true;
  write_checkpoint(dir_, good);
  try {
    lmoe::load_layer_weights(dir_.string(), mxfp4, kLayer, config, DType::bf16, 1, 0);
    ADD_FAILURE() << "no error";
  } catch (const lmoe::Error& error) {
    EXPECT_THAT(error.message(),
                HasSubstr("tensor 'layers.5.moe.experts.0.gate.weight_packed': not found"));
  }

  try {
    lmoe::load_layer_weights((dir_ / "nowhere").string(), names, kLayer, config, DType::bf16, 1, 0);
    ADD_FAILURE() << "no error";
  } catch (const lmoe::Error& error) {
    EXPECT_THAT(error.message(), HasSubstr("nowhere: not a directory"));
  }
}

// A checkpoint whose index or directory is wrong is refused with the file named and what is wrong.
TEST_F(LayerLoader, BadIndexesAndDirectoriesAreNamed) {
  const RawFile good = good_tensors();
  const fs::path index = index_path();
  const auto rewrite_index = [&](const std::string& text) {
    write_checkpoint(dir_, good);
    std::ofstream(index, std::ios::trunc) << text;
  };

  rewrite_index("{\"weight_map\": {");
  EXPECT_THAT(load_error_as_written(), HasSubstr(index.string() + ": not valid JSON"));
  rewrite_index("{\"metadata\": {}}");
  EXPECT_THAT(load_error_as_written(),
              HasSubstr(index.string() + ": has no \"weight_map\" object"));
  rewrite_index("{\"weight_map\": [\"model-00001-of-00002.safetensors\"]}");
  EXPECT_THAT(load_error_as_written(),
              HasSubstr(index.string() + ": has no \"weight_map\" object"));
  rewrite_index("{\"weight_map\": {\"layers.5.moe.router.weight\": 1}}");
  EXPECT_THAT(
      load_error_as_written(),
      HasSubstr(index.string() +
                ": weight_map entry for tensor 'layers.5.moe.router.weight' is not a file name"));

  // Text from the file is capped in the message: a megabyte of a bad token, and a tensor name.
  rewrite_index("{\"weight_map\": " + std::string(1 << 20, 'x') + "}");
  EXPECT_THAT(load_error_as_written(), HasSubstr(index.string() + ": not valid JSON: '"));
  EXPECT_LT(load_error_as_written().size(), 500u);
  rewrite_index("{\"weight_map\": {\"" + std::string(1 << 20, 'n') + "\": 1}}");
  EXPECT_THAT(load_error_as_written(),
              HasSubstr("tensor '" + std::string(120, 'n') + "'... (1048576 bytes) is not a file"));
  EXPECT_LT(load_error_as_written().size(), 500u);

  // Every tensor mapped to the first shard, which holds only half of them.
  nlohmann::json wrong_shard = {{"weight_map", nlohmann::json::object()}};
  for (const auto& entry : good)
    wrong_shard["weight_map"][entry.first] = "model-00001-of-00002.safetensors";
  rewrite_index(wrong_shard.dump());
  EXPECT_THAT(
      load_error_as_written(),
      ::testing::MatchesRegex(
          ".*tensor 'layers\\.5\\..*': the index names .*model-00001-of-00002\\.safetensors, "
          "which does not hold it.*"));

  // A shard the index names is not there.
  write_checkpoint(dir_, good);
  fs::remove(dir_ / "model-00002-of-00002.safetensors");
  EXPECT_THAT(load_error_as_written(),
              HasSubstr("model-00002-of-00002.safetensors: cannot read safetensors file"));

  // No index and no shards.
  fs::remove_all(dir_);
  fs::create_directories(dir_);
  std::ofstream(dir_ / "config.json") << "{}";
  EXPECT_THAT(
      load_error_as_written(),
      HasSubstr(dir_.string() + ": no *.safetensors files and no model.safetensors.index.json"));
}

// An index entry may name only a file inside the checkpoint's folder: an absolute path, one that
// climbs out, or a symlink that leads out would let a checkpoint read any file the process can.
TEST_F(LayerLoader, IndexEntriesOutsideTheCheckpointAreRefused) {
  const RawFile good = good_tensors();
  const fs::path index = index_path();
  const std::string router = name_of(small_names().router_weight);
  const fs::path outside = dir_.string() + "_outside";
  fs::remove_all(outside);
  fs::create_directories(outside);
  write_raw(outside / "x.safetensors", good);
  const auto error_for = [&](const std::string& file) {
    write_checkpoint(dir_, good);
    nlohmann::json doc = nlohmann::json::parse(std::ifstream(index));
    doc["weight_map"][router] = file;
    std::ofstream(index, std::ios::trunc) << doc.dump();
    return load_error_as_written();
  };
  const std::string entry =
      index.string() + ": weight_map entry for tensor '" + router + "' names ";
  EXPECT_THAT(error_for((outside / "x.safetensors").string()),
              HasSubstr(entry + "'" + (outside / "x.safetensors").string() +
                        "', an absolute path (shards must lie in the checkpoint's folder)"));
  const std::string up = "../" + outside.filename().string() + "/x.safetensors";
  EXPECT_THAT(error_for(up),
              HasSubstr(entry + "'" + up + "', which leaves the checkpoint's folder"));
  const std::string down_and_up = "sub/../../" + outside.filename().string() + "/x.safetensors";
  EXPECT_THAT(error_for(down_and_up),
              HasSubstr(entry + "'" + down_and_up + "', which leaves the checkpoint's folder"));
  EXPECT_THAT(error_for(".."), HasSubstr(entry + "'..', which leaves the checkpoint's folder"));
  EXPECT_THAT(error_for(""), HasSubstr("tensor '" + router + "' is not a file name"));

  // A link inside the folder that leads out of it, to a file or to a folder.
  write_checkpoint(dir_, good);
  fs::create_symlink(outside / "x.safetensors", dir_ / "link.safetensors");
  fs::create_directory_symlink(outside, dir_ / "linked_dir");
  EXPECT_THAT(error_for("link.safetensors"),
              HasSubstr(entry + "'link.safetensors', which resolves to '" +
                        fs::weakly_canonical(outside / "x.safetensors").string() +
                        "', outside the checkpoint's folder"));
  EXPECT_THAT(error_for("linked_dir/x.safetensors"),
              HasSubstr(entry + "'linked_dir/x.safetensors', which resolves to"));

  // A link that stays inside, and a path through a subfolder that comes back, are fine.
  fs::create_directories(dir_ / "sub");
  fs::create_symlink(dir_ / "model-00001-of-00002.safetensors", dir_ / "inside.safetensors");
  write_checkpoint(dir_, good);
  nlohmann::json doc = nlohmann::json::parse(std::ifstream(index));
  for (auto& [name, file] : doc["weight_map"].items()) {
    if (file == "model-00001-of-00002.safetensors") file = "inside.safetensors";
    if (file == "model-00002-of-00002.safetensors")
      file = "sub/../model-00002-of-00002.safetensors";
  }
  std::ofstream(index, std::ios::trunc) << doc.dump();
  EXPECT_EQ(load_error_as_written(), "no error");
  fs::remove_all(outside);
}

// A folder where the index or a shard belongs is an error naming its path (this runs as root
// too, unlike the test of mode 000 below).
TEST_F(LayerLoader, AFolderWhereAFileBelongsIsNamed) {
  const RawFile good = good_tensors();
  const fs::path index = index_path();
  const fs::path shard = dir_ / "model-00002-of-00002.safetensors";

  write_checkpoint(dir_, good);
  fs::remove(index);
  fs::create_directory(index);
  EXPECT_THAT(load_error_as_written(),
              HasSubstr(index.string() + ": cannot read the checkpoint index: not a regular file"));
  fs::remove_all(index);
  write_checkpoint(dir_, good);
  fs::remove(shard);
  fs::create_directory(shard);
  EXPECT_THAT(load_error_as_written(),
              HasSubstr(shard.string() + ": cannot read safetensors file: not a regular file"));
}

// A file or folder that cannot be read for its permissions is an error naming its path. Mode 000
// does not stop root, so as root the loads run in a child process that has dropped to nobody.
TEST_F(LayerLoader, UnreadableFilesAreNamed) {
  const RawFile good = good_tensors();
  const fs::path index = index_path();
  const fs::path shard = dir_ / "model-00002-of-00002.safetensors";
  write_checkpoint(dir_, good);
  // Readable by anyone first: where that does not load (a parent folder closed to others), the
  // modes below could not be what fails.
  const fs::perms readable = fs::perms::owner_read | fs::perms::owner_write |
                             fs::perms::group_read | fs::perms::others_read;
  fs::permissions(
      dir_, readable | fs::perms::owner_exec | fs::perms::group_exec | fs::perms::others_exec);
  if (load_error_unprivileged() != "no error")
    GTEST_SKIP() << "no unprivileged process here loads the checkpoint when every mode allows it";
  fs::permissions(index, fs::perms::none);
  EXPECT_THAT(load_error_unprivileged().value_or(""),
              HasSubstr(index.string() + ": cannot read the checkpoint index: Permission denied"));
  fs::permissions(index, readable);
  fs::permissions(shard, fs::perms::none);
  EXPECT_THAT(load_error_unprivileged().value_or(""),
              HasSubstr(shard.string() + ": cannot open safetensors file: Permission denied"));
  fs::permissions(shard, readable);
  fs::remove(index);
  fs::permissions(dir_, fs::perms::none);
  EXPECT_THAT(
      load_error_unprivileged().value_or(""),
      HasSubstr("checkpoint directory " + dir_.string() + ": cannot list: Permission denied"));
  fs::permissions(dir_, fs::perms::owner_all);
}

}  // namespace

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
#include <random>

#include <unistd.h>

#include "lmoe/error.hpp"
#include "lmoe/layer_weights.hpp"

namespace {

namespace fs = std::filesystem;
using lmoe::DType;
using lmoe::HostTensor;
using lmoe::LayerConfig;
using ::testing::HasSubstr;

constexpr int kLayer = 5;

struct RawTensor {
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::vector<std::byte> bytes;
};
using RawFile = std::map<std::string, RawTensor>;

RawTensor raw(const HostTensor& tensor, std::vector<std::int64_t> shape) {
  RawTensor out{std::string(lmoe::safetensors_dtype_name(tensor.dtype())), std::move(shape), {}};
  out.bytes.assign(tensor.data(), tensor.data() + tensor.nbytes());
  return out;
}

// Any dtype, laid out in name order (written by hand: HostTensor has no U8).
void write_raw(const fs::path& path, const RawFile& tensors) {
  nlohmann::json header = nlohmann::json::object();
  std::uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    header[name] = {{"dtype", tensor.dtype},
                    {"shape", tensor.shape},
                    {"data_offsets", {offset, offset + tensor.bytes.size()}}};
    offset += tensor.bytes.size();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::ofstream out(path, std::ios::binary);
  const std::uint64_t length = text.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((length >> (8 * i)) & 0xff));
  out << text;
  for (const auto& entry : tensors)
    out.write(reinterpret_cast<const char*>(entry.second.bytes.data()), entry.second.bytes.size());
}

std::string name_of(std::string pattern, std::int64_t expert = 0) {
  for (auto [key, value] :
       {std::pair<std::string, std::int64_t>{"{layer}", kLayer}, {"{expert}", expert}}) {
    for (std::size_t at = pattern.find(key); at != std::string::npos; at = pattern.find(key)) {
      pattern.replace(at, key.size(), std::to_string(value));
    }
  }
  return pattern;
}

LayerConfig small_config() { return *lmoe::find_preset("small").layer; }
lmoe::LayerTensorNames small_names() { return *lmoe::find_preset("small").tensor_names; }

// The full (tp = 1) weights as checkpoint tensors by the small preset's names.
RawFile checkpoint_tensors(const LayerConfig& c, const lmoe::LayerWeights& w) {
  const lmoe::LayerTensorNames names = small_names();
  const std::int64_t d = c.d_model, l = c.d_latent, e_count = c.router.num_experts,
                     inter = c.expert_intermediate;
  const std::int64_t shared = c.shared_width();
  RawFile file;
  file[name_of(names.router_weight)] = raw(w.router_weight, {e_count, d});
  file[name_of(names.router_bias)] = raw(w.router_bias, {e_count});
  file[name_of(names.latent_down)] = raw(w.latent_down, {l, d});
  file[name_of(names.latent_norm)] = raw(w.latent_norm, {l});
  file[name_of(names.latent_up)] = raw(w.latent_up, {d, l});
  const std::size_t expert_bytes = static_cast<std::size_t>(inter * l * 2);
  for (std::int64_t e = 0; e < e_count; ++e) {
    auto slice = [&](const HostTensor& all, std::vector<std::int64_t> shape) {
      RawTensor out{"BF16", std::move(shape), {}};
      out.bytes.assign(all.data() + e * expert_bytes, all.data() + (e + 1) * expert_bytes);
      return out;
    };
    file[name_of(names.expert_gate, e)] = slice(w.expert_gate, {inter, l});
    file[name_of(names.expert_up, e)] = slice(w.expert_up, {inter, l});
    file[name_of(names.expert_down, e)] = slice(w.expert_down, {l, inter});
  }
  file[name_of(names.shared_gate)] = raw(w.shared_gate, {shared, d});
  file[name_of(names.shared_up)] = raw(w.shared_up, {shared, d});
  file[name_of(names.shared_down)] = raw(w.shared_down, {d, shared});
  return file;
}

// Writes the tensors as two shards and an index naming each tensor's shard.
void write_checkpoint(const fs::path& dir, const RawFile& tensors) {
  fs::create_directories(dir);
  RawFile shards[2];
  nlohmann::json index = {{"metadata", nlohmann::json::object()},
                          {"weight_map", nlohmann::json::object()}};
  int i = 0;
  for (const auto& [name, tensor] : tensors) {
    const int shard = (i++ % 2);
    shards[shard][name] = tensor;
    index["weight_map"][name] = "model-0000" + std::to_string(shard + 1) + "-of-00002.safetensors";
  }
  for (int shard = 0; shard < 2; ++shard) {
    write_raw(dir / ("model-0000" + std::to_string(shard + 1) + "-of-00002.safetensors"),
              shards[shard]);
  }
  std::ofstream(dir / "model.safetensors.index.json") << index.dump(1);
}

class LayerLoader : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("lmoe_loader_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
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

// One MXFP4 matrix [rows, cols]: packed e2m1 values, two a byte (low nibble first), and E8M0
// scales, one per 32 values along a row.
struct Mxfp4Blocks {
  std::vector<std::byte> packed;  // [rows, cols / 2]
  std::vector<std::byte> scales;  // [rows, cols / 32]
};
using Mxfp4BlocksOf =
    std::function<Mxfp4Blocks(const std::string& name, std::int64_t rows, std::int64_t cols)>;

// The full (tp = 1) weights as checkpoint tensors with every routed expert's matrices as MXFP4
// blocks from `blocks_of` (asked for each expert in order: gate, up, down).
RawFile mxfp4_checkpoint(const LayerConfig& config, const lmoe::LayerTensorNames& names,
                         const Mxfp4BlocksOf& blocks_of) {
  const std::int64_t l = config.d_latent, inter = config.expert_intermediate;
  RawFile tensors =
      checkpoint_tensors(config, lmoe::make_random_layer_weights(config, DType::bf16, 1, 0, 3));
  for (std::int64_t e = 0; e < config.router.num_experts; ++e) {
    for (const auto& [pattern, rows, cols] :
         {std::tuple{names.expert_gate, inter, l}, std::tuple{names.expert_up, inter, l},
          std::tuple{names.expert_down, l, inter}}) {
      const std::string name = name_of(pattern, e);
      Mxfp4Blocks blocks = blocks_of(name, rows, cols);
      tensors.erase(name);
      tensors[name + "_packed"] = {"U8", {rows, cols / 2}, std::move(blocks.packed)};
      tensors[name + "_scale"] = {"U8", {rows, cols / 32}, std::move(blocks.scales)};
    }
  }
  return tensors;
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
      dir_, mxfp4_checkpoint(config, names,
                             [&](const std::string& name, std::int64_t rows, std::int64_t cols) {
                               Mxfp4Blocks& b = blocks[name];
                               b.packed.resize(static_cast<std::size_t>(rows * (cols / 2)));
                               b.scales.resize(static_cast<std::size_t>(rows * (cols / 32)));
                               for (auto& byte : b.packed) byte = std::byte(generator());
                               for (auto& scale : b.scales)
                                 scale = std::byte(120 + generator() % 12);
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
  const auto load_error_of = [&](const RawFile& tensors, DType dtype = DType::bf16) {
    write_checkpoint(dir_, tensors);
    try {
      lmoe::load_layer_weights(dir_.string(), names, kLayer, config, dtype, tp, rank);
    } catch (const lmoe::Error& error) {
      return error.message();
    }
    return std::string("no error");
  };
  const RawFile good = mxfp4_checkpoint(config, names);
  EXPECT_EQ(load_error_of(good), "no error");

  RawFile not_u8 = good;
  not_u8[gate + "_packed"].dtype = "I8";
  EXPECT_THAT(load_error_of(not_u8),
              HasSubstr("tensor '" + gate + "_packed': dtype I8, expected U8 (MXFP4)"));

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
// does not stop root, so the test skips where the file stays readable.
TEST_F(LayerLoader, UnreadableFilesAreNamed) {
  const RawFile good = good_tensors();
  const fs::path index = index_path();
  const fs::path shard = dir_ / "model-00002-of-00002.safetensors";
  write_checkpoint(dir_, good);
  fs::permissions(index, fs::perms::none);
  if (::access(index.c_str(), R_OK) == 0) {
    fs::permissions(index, fs::perms::owner_read | fs::perms::owner_write);
    GTEST_SKIP() << "a file of mode 000 is still readable here (running as root)";
  }
  EXPECT_THAT(load_error_as_written(),
              HasSubstr(index.string() + ": cannot read the checkpoint index: Permission denied"));
  fs::permissions(index, fs::perms::owner_read | fs::perms::owner_write);
  fs::permissions(shard, fs::perms::none);
  EXPECT_THAT(load_error_as_written(),
              HasSubstr(shard.string() + ": cannot open safetensors file: Permission denied"));
  fs::permissions(shard, fs::perms::owner_read | fs::perms::owner_write);
  fs::remove(index);
  fs::permissions(dir_, fs::perms::none);
  EXPECT_THAT(load_error_as_written(), HasSubstr("checkpoint directory " + dir_.string() +
                                                 ": cannot list: Permission denied"));
  fs::permissions(dir_, fs::perms::owner_all);
}

}  // namespace

// Small safetensors checkpoints of one layer, written for the loader's tests: any dtype (U8 MXFP4
// blocks and scales too), sharded over two files with an index.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include <unistd.h>

#include "lmoe/dims.hpp"
#include "lmoe/layer_weights.hpp"

namespace lmoe::testing {

struct RawTensor {
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::vector<std::byte> bytes;
};
using RawFile = std::map<std::string, RawTensor>;

inline RawTensor raw(const HostTensor& tensor, std::vector<std::int64_t> shape) {
  RawTensor out{std::string(safetensors_dtype_name(tensor.dtype())), std::move(shape), {}};
  out.bytes.assign(tensor.data(), tensor.data() + tensor.nbytes());
  return out;
}

// Any dtype, laid out in name order (written by hand: HostTensor has no U8).
inline void write_raw(const std::filesystem::path& path, const RawFile& tensors) {
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

// An empty folder for the running test's checkpoint: the temp dir, `prefix`, the process and the
// test's name (removed first, in case an earlier run left it).
inline std::filesystem::path fresh_checkpoint_dir(const std::string& prefix) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() /
      (prefix + std::to_string(::getpid()) + "_" +
       ::testing::UnitTest::GetInstance()->current_test_info()->name());
  std::filesystem::remove_all(dir);
  return dir;
}

// A tensor name pattern with "{layer}" and "{expert}" filled in.
inline std::string tensor_name(std::string pattern, std::int64_t layer, std::int64_t expert = 0) {
  for (auto [key, value] :
       {std::pair<std::string, std::int64_t>{"{layer}", layer}, {"{expert}", expert}}) {
    for (std::size_t at = pattern.find(key); at != std::string::npos; at = pattern.find(key)) {
      pattern.replace(at, key.size(), std::to_string(value));
    }
  }
  return pattern;
}

// The full (tp = 1) bf16 weights of layer `layer` as checkpoint tensors by `names`.
inline RawFile checkpoint_tensors(const LayerConfig& c, const LayerTensorNames& names,
                                  std::int64_t layer, const LayerWeights& w) {
  const std::int64_t d = c.d_model, l = c.d_latent, e_count = c.router.num_experts,
                     inter = c.expert_intermediate;
  const std::int64_t shared = c.shared_width();
  auto name_of = [&](const std::string& pattern, std::int64_t expert = 0) {
    return tensor_name(pattern, layer, expert);
  };
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
inline void write_checkpoint(const std::filesystem::path& dir, const RawFile& tensors) {
  std::filesystem::create_directories(dir);
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

// One MXFP4 matrix [rows, cols]: packed e2m1 values, two a byte (low nibble first), and E8M0
// scales, one per 32 values along a row.
struct Mxfp4Blocks {
  std::vector<std::byte> packed;  // [rows, cols / 2]
  std::vector<std::byte> scales;  // [rows, cols / 32]
};
// Zeroed blocks and scales of a [rows, cols] matrix.
inline Mxfp4Blocks sized_mxfp4_blocks(std::int64_t rows, std::int64_t cols) {
  return {std::vector<std::byte>(static_cast<std::size_t>(rows * (cols / 2))),
          std::vector<std::byte>(static_cast<std::size_t>(rows * (cols / 32)))};
}
using Mxfp4BlocksOf =
    std::function<Mxfp4Blocks(const std::string& name, std::int64_t rows, std::int64_t cols)>;

// `dense` (the full tp = 1 checkpoint) with every routed expert's matrices replaced by MXFP4
// blocks from `blocks_of` (asked for each expert in order: gate, up, down).
inline RawFile with_mxfp4_experts(RawFile dense, const LayerConfig& config,
                                  const LayerTensorNames& names, std::int64_t layer,
                                  const Mxfp4BlocksOf& blocks_of) {
  const std::int64_t l = config.d_latent, inter = config.expert_intermediate;
  for (std::int64_t e = 0; e < config.router.num_experts; ++e) {
    for (const auto& [pattern, rows, cols] :
         {std::tuple{names.expert_gate, inter, l}, std::tuple{names.expert_up, inter, l},
          std::tuple{names.expert_down, l, inter}}) {
      const std::string name = tensor_name(pattern, layer, e);
      Mxfp4Blocks blocks = blocks_of(name, rows, cols);
      dense.erase(name);
      dense[name + "_packed"] = {"U8", {rows, cols / 2}, std::move(blocks.packed)};
      dense[name + "_scale"] = {"U8", {rows, cols / 32}, std::move(blocks.scales)};
    }
  }
  return dense;
}

}  // namespace lmoe::testing

// Loading one layer from a checkpoint's safetensors shards, sliced for one rank.
#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <system_error>

#include "core/checkpoint_index.hpp"
#include "core/quoted_text.hpp"
#include "lmoe/error.hpp"
#include "lmoe/layer_weights.hpp"
#include "lmoe/safetensors.hpp"

namespace lmoe {

float mxfp4_value(std::uint8_t nibble, std::uint8_t scale) {
  static constexpr std::array<float, 8> kMagnitudes = {0.0f, 0.5f, 1.0f, 1.5f,
                                                       2.0f, 3.0f, 4.0f, 6.0f};
  if (scale == 0xff) return std::numeric_limits<float>::quiet_NaN();
  const float magnitude = std::ldexp(kMagnitudes[nibble & 0x7u], static_cast<int>(scale) - 127);
  return (nibble & 0x8u) ? -magnitude : magnitude;
}

namespace {

std::string substitute(std::string name, std::string_view key, std::int64_t value) {
  const std::string text = std::to_string(value);
  for (std::size_t at = name.find(key); at != std::string::npos;
       at = name.find(key, at + text.size())) {
    name.replace(at, key.size(), text);
  }
  return name;
}

std::string quoted(const std::string& name) { return "tensor " + quoted_text(name); }

// The index's text; lmoe::Error naming it when it is not a regular file or cannot be read.
std::string read_index(const std::filesystem::path& index) {
  const std::string what = index.string() + ": cannot read the checkpoint index: ";
  std::error_code error;
  if (!std::filesystem::is_regular_file(index, error))
    throw Error(what + (error ? error.message() : std::string("not a regular file")));
  errno = 0;
  std::ifstream in(index, std::ios::binary);
  if (!in) throw Error(what + std::error_code(errno, std::generic_category()).message());
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw Error(what + "read failed");
  return text.str();
}

// Which file holds each tensor, and those files' headers (read once each).
class Checkpoint {
 public:
  explicit Checkpoint(std::string dir) : dir_(std::move(dir)) {
    namespace fs = std::filesystem;
    std::error_code error;
    if (!fs::is_directory(dir_, error))
      throw Error("checkpoint directory " + dir_ + ": not a directory");
    const fs::path index = fs::path(dir_) / "model.safetensors.index.json";
    if (fs::exists(fs::symlink_status(index, error))) {
      file_of_ = parse_checkpoint_index(read_index(index), index.string(), dir_);
      return;
    }
    fs::directory_iterator entries(dir_, error);
    if (error) throw Error("checkpoint directory " + dir_ + ": cannot list: " + error.message());
    for (const fs::directory_entry& entry : entries) {
      if (entry.path().extension() != ".safetensors") continue;
      const SafetensorsHeader& header = header_of(entry.path().string());
      for (const auto& tensor : header.tensors) file_of_[tensor.first] = header.path;
    }
    if (file_of_.empty())
      throw Error("checkpoint directory " + dir_ +
                  ": no *.safetensors files and no model.safetensors.index.json");
  }

  // The tensor's header entry and its file; throws naming the tensor when it is missing.
  std::pair<const SafetensorsTensorInfo*, const std::string*> find(const std::string& name) {
    const auto file = file_of_.find(name);
    if (file == file_of_.end()) throw Error(quoted(name) + ": not found in " + dir_);
    const SafetensorsHeader& header = header_of(file->second);
    const auto tensor = header.tensors.find(name);
    if (tensor == header.tensors.end()) {
      throw Error(quoted(name) + ": the index names " + file->second + ", which does not hold it");
    }
    return {&tensor->second, &header.path};
  }

 private:
  const SafetensorsHeader& header_of(const std::string& path) {
    auto& slot = headers_[path];
    if (!slot) slot = std::make_unique<SafetensorsHeader>(read_safetensors_header(path));
    return *slot;
  }

  std::string dir_;
  std::map<std::string, std::string> file_of_;
  std::map<std::string, std::unique_ptr<SafetensorsHeader>> headers_;
};

// An e2m1 value as text: "-6", "1.5".
std::string e2m1_text(std::uint8_t nibble) {
  std::ostringstream text;
  text << mxfp4_value(nibble, 127);
  return text.str();
}

struct Shape2 {
  std::int64_t rows, cols;
};

std::string shape_text(Shape2 shape, bool vector) {
  return vector ? shape_string(std::vector<std::int64_t>{shape.cols})
                : shape_string(std::vector<std::int64_t>{shape.rows, shape.cols});
}

void require_mxfp4_columns(const std::string& name, std::int64_t cols) {
  if (cols % 32 != 0) {
    throw Error(quoted(name) + ": MXFP4 needs an input dimension divisible by 32, got " +
                std::to_string(cols));
  }
}

// Rows of one MXFP4 weight as the checkpoint holds them.
struct Mxfp4Rows {
  std::vector<std::uint8_t> blocks;  // [count, C/2]
  std::vector<std::uint8_t> scales;  // [count, C/32]
  std::int64_t scales_per_row;       // C/32
};

// Reads rows [first, first + count) of a dense (BF16/F16/F32) or MXFP4 tensor of `shape` as fp32.
class Reader {
 public:
  explicit Reader(Checkpoint& checkpoint) : checkpoint_(checkpoint) {}

  // `storage` is the dtype the values are kept in: an MXFP4 value it cannot hold is refused.
  std::vector<float> rows(const std::string& name, Shape2 shape, bool vector, bool mxfp4,
                          std::int64_t first, std::int64_t count, DType storage) {
    return mxfp4 ? mxfp4_rows(name, shape, first, count, storage)
                 : dense_rows(name, shape, vector, first, count);
  }

  // Rows [first, first + count) of "<name>_packed": U8 [R, C/2], two e2m1 values a byte, the low
  // nibble the even column, and of "<name>_scale": U8 [R, C/32], one E8M0 scale per 32 columns;
  // refused where a value would not be finite in `storage`.
  Mxfp4Rows mxfp4_packed_rows(const std::string& name, Shape2 shape, std::int64_t first,
                              std::int64_t count, DType storage) {
    require_mxfp4_columns(name, shape.cols);
    Mxfp4Rows rows{u8_rows(name + "_packed", {shape.rows, shape.cols / 2}, first, count),
                   u8_rows(name + "_scale", {shape.rows, shape.cols / 32}, first, count),
                   shape.cols / 32};
    check_mxfp4(name + "_scale", rows, first, storage);
    return rows;
  }

 private:
  std::vector<float> dense_rows(const std::string& name, Shape2 shape, bool vector,
                                std::int64_t first, std::int64_t count) {
    const auto [info, path] = checkpoint_.find(name);
    DType dtype;
    try {
      dtype = parse_dtype(info->dtype);
    } catch (const Error&) {
      throw Error(quoted(name) + ": dtype " + info->dtype + ", expected BF16, F16 or F32");
    }
    const std::vector<std::int64_t> expected =
        vector ? std::vector<std::int64_t>{shape.cols}
               : std::vector<std::int64_t>{shape.rows, shape.cols};
    if (info->shape != expected) {
      throw Error(quoted(name) + ": shape " + shape_string(info->shape) + ", expected " +
                  shape_string(expected));
    }
    const std::size_t row_bytes = static_cast<std::size_t>(shape.cols) * dtype_size(dtype);
    std::vector<std::byte> bytes(row_bytes * static_cast<std::size_t>(count));
    read_safetensors_bytes(*path, info->offset + row_bytes * static_cast<std::uint64_t>(first),
                           bytes);
    std::vector<float> values(static_cast<std::size_t>(count * shape.cols));
    for (std::size_t i = 0; i < values.size(); ++i)
      values[i] = load_as_float(bytes.data(), i, dtype);
    return values;
  }

  // The same rows dequantized (each value exact in fp32: e2m1 · 2^(scale − 127)).
  std::vector<float> mxfp4_rows(const std::string& name, Shape2 shape, std::int64_t first,
                                std::int64_t count, DType storage) {
    const Mxfp4Rows rows = mxfp4_packed_rows(name, shape, first, count, storage);
    std::vector<float> values(static_cast<std::size_t>(count * shape.cols));
    for (std::size_t i = 0; i < values.size(); ++i) {
      const std::uint8_t byte = rows.blocks[i / 2];
      values[i] = mxfp4_value(i % 2 == 0 ? (byte & 0x0fu) : (byte >> 4), rows.scales[i / 32]);
    }
    return values;
  }

  // A NaN scale or a value the weights' dtype cannot hold would reach the GEMMs as NaN or inf and
  // spoil every token routed to the expert, so the checkpoint is refused instead. A block overflows
  // exactly when its largest e2m1 magnitude does (rounding is monotonic).
  static void check_mxfp4(const std::string& scale_name, const Mxfp4Rows& rows, std::int64_t first,
                          DType storage) {
    for (std::size_t b = 0; b < rows.scales.size(); ++b) {
      const std::uint8_t scale = rows.scales[b];
      std::uint8_t largest = 0;  // the first nibble of the block's largest magnitude
      for (std::size_t j = 0; j < 32; ++j) {
        const std::uint8_t byte = rows.blocks[b * 16 + j / 2];
        const std::uint8_t nibble = j % 2 == 0 ? (byte & 0x0fu) : (byte >> 4);
        if ((nibble & 0x7u) > (largest & 0x7u)) largest = nibble;
      }
      if (scale != 0xff && std::isfinite(round_to(storage, mxfp4_value(largest, scale)))) continue;
      const auto per_row = static_cast<std::size_t>(rows.scales_per_row);
      const std::string where = quoted(scale_name) + ": row " +
                                std::to_string(first + static_cast<std::int64_t>(b / per_row)) +
                                ", block " + std::to_string(b % per_row) + " holds E8M0 ";
      if (scale == 0xff) throw Error(where + "255, which is NaN");
      throw Error(where + std::to_string(scale) + " (2^" + std::to_string(scale - 127) +
                  "), whose product with the e2m1 value " + e2m1_text(largest) +
                  " is beyond the range of " + std::string(dtype_name(storage)));
    }
  }

  std::vector<std::uint8_t> u8_rows(const std::string& name, Shape2 shape, std::int64_t first,
                                    std::int64_t count) {
    const auto [info, path] = checkpoint_.find(name);
    if (info->dtype != "U8")
      throw Error(quoted(name) + ": dtype " + info->dtype + ", expected U8 (MXFP4)");
    if (info->shape != std::vector<std::int64_t>{shape.rows, shape.cols}) {
      throw Error(quoted(name) + ": shape " + shape_string(info->shape) + ", expected " +
                  shape_text(shape, false));
    }
    std::vector<std::uint8_t> bytes(static_cast<std::size_t>(count * shape.cols));
    read_safetensors_bytes(*path, info->offset + static_cast<std::uint64_t>(first * shape.cols),
                           std::as_writable_bytes(std::span(bytes)));
    return bytes;
  }

  Checkpoint& checkpoint_;
};

}  // namespace

LayerWeights load_layer_weights(const std::string& dir, const LayerTensorNames& names, int layer,
                                const LayerConfig& config, DType dtype, int tp, int rank,
                                const LayerLoadOptions& options) {
  if (auto error = validate_layer_config(config, tp)) throw Error("layer config: " + *error);
  LMOE_CHECK(rank >= 0 && rank < tp,
             "rank: expected 0 … " + std::to_string(tp - 1) + ", got " + std::to_string(rank));
  LMOE_CHECK(layer >= 0, "layer index: expected ≥ 0, got " + std::to_string(layer));
  const std::int64_t d = config.d_model, l = config.d_latent, experts = config.router.num_experts;
  const std::int64_t inter = config.expert_intermediate, inter_r = inter / tp;
  const std::int64_t shared = config.shared_width(), shared_r = shared / tp;
  auto name_of = [&](const std::string& pattern, const char* role, std::int64_t expert = 0) {
    if (pattern.empty())
      throw Error(std::string("the model's tensor table has no name for ") + role);
    return substitute(substitute(pattern, "{layer}", layer), "{expert}", expert);
  };
  const bool gated = is_gated(config.activation);
  const bool mxfp4 = names.experts_mxfp4;
  const bool packed = mxfp4 && options.keep_experts_packed;
  if (packed) {  // the checks a dequantizing load makes as it reads, before any packed is sized
    require_mxfp4_columns(name_of(gated ? names.expert_gate : names.expert_up, "expert_up"), l);
    require_mxfp4_columns(name_of(names.expert_down, "expert_down"), inter);
  }
  // Rank r keeps columns [r·I/tp, (r+1)·I/tp) of each down row; packed, those must be whole
  // blocks, since a block's 32 values share one scale.
  if (packed && inter_r % 32 != 0) {
    throw Error(quoted(name_of(names.expert_down, "expert_down")) +
                ": MXFP4 experts kept packed need each rank's slice of the intermediate dim to be "
                "whole 32-column blocks of the down projection's rows; I/tp = " +
                std::to_string(inter) + "/" + std::to_string(tp) + " = " + std::to_string(inter_r) +
                " is not a multiple of 32 (load them dequantized at this tp)");
  }

  Checkpoint checkpoint(dir);
  Reader reader(checkpoint);
  LayerWeights weights;
  for (const WeightSlot& slot : layer_weight_slots(config, dtype, tp)) {
    const bool expert = is_routed_expert_weight(slot.member);
    if (slot.shape.empty()) continue;
    if (expert && packed) {
      packed_expert_weight(weights, slot.member) = Mxfp4Tensor(slot.shape);
    } else {
      weights.*slot.member = HostTensor(slot.dtype, slot.shape);
    }
  }
  // Rows [first, first + count) of the checkpoint tensor into `out` starting at element `offset`.
  auto put_rows = [&](HostTensor& out, std::int64_t offset, const std::string& name, Shape2 shape,
                      bool vector, bool mxfp4, std::int64_t first, std::int64_t count) {
    const std::vector<float> values =
        reader.rows(name, shape, vector, mxfp4, first, count, out.dtype());
    for (std::size_t i = 0; i < values.size(); ++i)
      out.set(offset + static_cast<std::int64_t>(i), values[i]);
  };
  // Columns [first, first + count) of every row (the down projections' input-dimension slice).
  auto put_columns = [&](HostTensor& out, std::int64_t offset, const std::string& name,
                         Shape2 shape, bool mxfp4, std::int64_t first, std::int64_t count) {
    const std::vector<float> values =
        reader.rows(name, shape, false, mxfp4, 0, shape.rows, out.dtype());
    for (std::int64_t r = 0; r < shape.rows; ++r) {
      for (std::int64_t c = 0; c < count; ++c) {
        out.set(offset + r * count + c,
                values[static_cast<std::size_t>(r * shape.cols + first + c)]);
      }
    }
  };

  put_rows(weights.router_weight, 0, name_of(names.router_weight, "router_weight"), {experts, d},
           false, false, 0, experts);
  if (config.router.correction_bias) {
    put_rows(weights.router_bias, 0, name_of(names.router_bias, "router_bias"), {1, experts}, true,
             false, 0, 1);
  }
  put_rows(weights.latent_down, 0, name_of(names.latent_down, "latent_down"), {l, d}, false, false,
           0, l);
  if (config.latent_norm) {
    put_rows(weights.latent_norm, 0, name_of(names.latent_norm, "latent_norm"), {1, l}, true, false,
             0, 1);
  } else {
    // The model has no norm there (LatentMoELayer refuses such a config until the tail can skip
    // it).
    for (std::int64_t i = 0; i < l; ++i) weights.latent_norm.set(i, 1.0f);
  }
  put_rows(weights.latent_up, 0, name_of(names.latent_up, "latent_up"), {d, l}, false, false, 0, d);

  // Packed: the checkpoint's bytes of this rank's rows (gate, up) and of its blocks of each row
  // (down), validated as a dequantizing load validates them.
  auto put_packed_rows = [&](Mxfp4Tensor& out, std::int64_t matrix, const std::string& name) {
    const Mxfp4Rows rows =
        reader.mxfp4_packed_rows(name, {inter, l}, rank * inter_r, inter_r, dtype);
    std::copy(rows.blocks.begin(), rows.blocks.end(), out.blocks.begin() + matrix / 2);
    std::copy(rows.scales.begin(), rows.scales.end(), out.scales.begin() + matrix / 32);
  };
  auto put_packed_columns = [&](Mxfp4Tensor& out, std::int64_t matrix, const std::string& name) {
    const Mxfp4Rows rows = reader.mxfp4_packed_rows(name, {l, inter}, 0, l, dtype);
    for (std::int64_t r = 0; r < l; ++r) {
      std::copy_n(rows.blocks.begin() + (r * inter + rank * inter_r) / 2, inter_r / 2,
                  out.blocks.begin() + (matrix + r * inter_r) / 2);
      std::copy_n(rows.scales.begin() + (r * inter + rank * inter_r) / 32, inter_r / 32,
                  out.scales.begin() + (matrix + r * inter_r) / 32);
    }
  };
  for (std::int64_t e = 0; e < experts; ++e) {
    const std::int64_t matrix = e * inter_r * l;
    if (packed) {
      if (gated) {
        put_packed_rows(weights.expert_gate_mxfp4, matrix,
                        name_of(names.expert_gate, "expert_gate", e));
      }
      put_packed_rows(weights.expert_up_mxfp4, matrix, name_of(names.expert_up, "expert_up", e));
      put_packed_columns(weights.expert_down_mxfp4, matrix,
                         name_of(names.expert_down, "expert_down", e));
      continue;
    }
    if (gated) {
      put_rows(weights.expert_gate, matrix, name_of(names.expert_gate, "expert_gate", e),
               {inter, l}, false, mxfp4, rank * inter_r, inter_r);
    }
    put_rows(weights.expert_up, matrix, name_of(names.expert_up, "expert_up", e), {inter, l}, false,
             mxfp4, rank * inter_r, inter_r);
    put_columns(weights.expert_down, matrix, name_of(names.expert_down, "expert_down", e),
                {l, inter}, mxfp4, rank * inter_r, inter_r);
  }
  if (shared > 0) {
    if (gated) {
      put_rows(weights.shared_gate, 0, name_of(names.shared_gate, "shared_gate"), {shared, d},
               false, false, rank * shared_r, shared_r);
    }
    put_rows(weights.shared_up, 0, name_of(names.shared_up, "shared_up"), {shared, d}, false, false,
             rank * shared_r, shared_r);
    put_columns(weights.shared_down, 0, name_of(names.shared_down, "shared_down"), {d, shared},
                false, rank * shared_r, shared_r);
  }
  return weights;
}

}  // namespace lmoe

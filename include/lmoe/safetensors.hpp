// Reading and writing safetensors files (our own implementation; the header is JSON).
//
// Hardened against hostile or damaged files: every size and offset is checked before it is used,
// so a bad file gives lmoe::Error naming the file and the problem, never a crash or a huge
// allocation.
#pragma once

#include <cstddef>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "lmoe/tensor.hpp"

namespace lmoe {

struct SafetensorsFile {
  std::map<std::string, HostTensor> tensors;
  std::map<std::string, std::string> metadata;  // the header's "__metadata__" (string → string)
};

// The largest JSON header accepted (the format's own reference implementation uses 100 MB).
inline constexpr std::size_t kMaxSafetensorsHeaderBytes = 100u << 20;

// Parses a whole file held in memory; `source` names it in error messages.
SafetensorsFile parse_safetensors(std::span<const std::byte> file_bytes, std::string_view source);
SafetensorsFile read_safetensors(const std::string& path);

// One tensor as a file's header describes it, in any dtype the format defines.
struct SafetensorsTensorInfo {
  std::string dtype;  // as the header spells it: "BF16", "U8", ...
  std::vector<std::int64_t> shape;
  std::uint64_t offset = 0;  // file offset of its first byte
  std::uint64_t bytes = 0;
};
struct SafetensorsHeader {
  std::string path;
  std::map<std::string, SafetensorsTensorInfo> tensors;
  std::map<std::string, std::string> metadata;
};
// The header of a file (checked as read_safetensors checks it: sizes, offsets, no holes), without
// reading the data, for loaders that read only some tensors or some rows of them.
SafetensorsHeader read_safetensors_header(const std::string& path);
// The same checks on a whole file held in memory; `source` names it and is the result's path.
SafetensorsHeader parse_safetensors_header(std::span<const std::byte> file_bytes,
                                           std::string_view source);
// Reads out.size() bytes at file offset `offset`.
void read_safetensors_bytes(const std::string& path, std::uint64_t offset,
                            std::span<std::byte> out);

// Serializes tensors (sorted by name, 8-byte aligned header as the format recommends).
std::string serialize_safetensors(const std::map<std::string, HostTensor>& tensors,
                                  const std::map<std::string, std::string>& metadata = {});
// Writes atomically: a temporary file beside `path`, renamed on success.
void write_safetensors(const std::string& path, const std::map<std::string, HostTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace lmoe

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

// Serializes tensors (sorted by name, 8-byte aligned header as the format recommends).
std::string serialize_safetensors(const std::map<std::string, HostTensor>& tensors,
                                  const std::map<std::string, std::string>& metadata = {});
// Writes atomically: a temporary file beside `path`, renamed on success.
void write_safetensors(const std::string& path, const std::map<std::string, HostTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace lmoe

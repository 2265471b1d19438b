// lmoe's parsers of input from outside the process (files a user, an engine or another machine
// hands it), as fuzz targets. The contract each keeps for any bytes: return, or throw lmoe::Error
// naming what is wrong; never another exception, a crash or undefined behaviour. The sanitizers
// catch the last two; a target lets every exception but lmoe::Error escape, so the caller sees the
// first.
#pragma once

#include <cstddef>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace lmoe_fuzz {

using Bytes = std::vector<std::byte>;

struct ParserTarget {
  std::string_view name;  // "safetensors", "tier_table", ...
  std::string_view what;  // the function it feeds, for messages
  // true: accepted; false: refused with lmoe::Error; any other exception escapes.
  bool (*parse)(std::span<const std::byte> input);
  bool json;  // the input is JSON text (structural mutations apply)
};

// safetensors (parse_safetensors), safetensors_header (parse_safetensors_header),
// checkpoint_index (parse_checkpoint_index), tier_table (read_tier_table), tier_policy
// (apply_tier_table), bench_json (read_bench_json), machine_rates (parse_machine_rates).
std::span<const ParserTarget> parser_targets();
const ParserTarget& parser_target(std::string_view name);  // lmoe::Error for an unknown name

// Valid inputs of a target to start from: files lmoe writes or carries (the tier tables built into
// it, a recorded sweep from `data_dir` cut down to a few records, a small safetensors file).
std::vector<Bytes> parser_seeds(const ParserTarget& target, const std::filesystem::path& data_dir);

Bytes to_bytes(std::string_view text);

}  // namespace lmoe_fuzz

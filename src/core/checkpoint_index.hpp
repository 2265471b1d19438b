// A checkpoint's model.safetensors.index.json: which shard holds each tensor.
#pragma once

#include <map>
#include <string>
#include <string_view>

namespace lmoe {

// Tensor name → shard path (`dir`/entry) from the index's text. lmoe::Error naming `source` and
// the entry for text that is not JSON, no "weight_map" object, an entry that is not a file name,
// or one that leaves `dir`: absolute, climbing out with "..", or resolving (through symlinks)
// outside it. File-supplied text in a message is quoted and capped (core/quoted_text.hpp).
std::map<std::string, std::string> parse_checkpoint_index(std::string_view text,
                                                          const std::string& source,
                                                          const std::string& dir);

}  // namespace lmoe

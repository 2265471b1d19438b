// Text taken from a file, made safe to put in an error message.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <string_view>

namespace lmoe {

// Names and parser messages come from the file; a cap keeps a hostile one from flooding the text.
inline constexpr std::size_t kMaxQuotedChars = 120;

// `text` in single quotes, control bytes escaped, cut after kMaxQuotedChars with its full length.
inline std::string quoted_text(std::string_view text) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "'";
  const std::size_t shown = std::min(text.size(), kMaxQuotedChars);
  for (std::size_t i = 0; i < shown; ++i) {
    const auto byte = static_cast<unsigned char>(text[i]);
    if (byte < 0x20 || byte == 0x7f) {
      out += "\\x";
      out += kHex[byte >> 4];
      out += kHex[byte & 0xf];
    } else {
      out += static_cast<char>(byte);
    }
  }
  out += "'";
  if (shown < text.size()) out += "... (" + std::to_string(text.size()) + " bytes)";
  return out;
}

}  // namespace lmoe

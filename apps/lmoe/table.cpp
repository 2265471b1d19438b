#include "table.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace lmoe::cli {

void Table::print(std::ostream& out) const {
  std::vector<std::size_t> widths(headers_.size(), 0);
  for (std::size_t c = 0; c < headers_.size(); ++c) widths[c] = headers_[c].size();
  for (const auto& row : rows_) {
    for (std::size_t c = 0; c < row.size() && c < widths.size(); ++c) {
      widths[c] = std::max(widths[c], row[c].size());
    }
  }
  auto line = [&](const std::vector<std::string>& cells) {
    for (std::size_t c = 0; c < widths.size(); ++c) {
      const std::string cell = c < cells.size() ? cells[c] : "";
      out << (c ? "  " : "") << std::string(widths[c] - std::min(widths[c], cell.size()), ' ') << cell;
    }
    out << "\n";
  };
  line(headers_);
  for (const auto& row : rows_) line(row);
}

std::string format_number(double value, int precision) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  char text[64];
  if (value != 0 && (std::fabs(value) >= 1e5 || std::fabs(value) < 1e-2)) {
    std::snprintf(text, sizeof(text), "%.*e", std::max(0, precision - 1), value);
  } else {
    std::snprintf(text, sizeof(text), "%.*g", std::max(precision, 1) + 1, value);
  }
  return text;
}

}  // namespace lmoe::cli

#include "table.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace lmoe::cli {

void Table::print(std::ostream& out) const {
  std::vector<std::size_t> widths(headers_.size(), 0);
  for (std::size_t c = 0; c < headers_.size(); ++c) widths[c] = headers_[c].size();
  for (const Row& row : rows_) {
    for (std::size_t c = 0; c < row.cells.size() && c < widths.size(); ++c) {
      widths[c] = std::max(widths[c], row.cells[c].size());
    }
  }
  auto line = [&](const std::vector<std::string>& cells, const std::string& note) {
    // A note starts where the first empty cell would: cells up to there, then the text.
    const std::size_t columns =
        note.empty() ? widths.size() : std::min(cells.size(), widths.size());
    for (std::size_t c = 0; c < columns; ++c) {
      const std::string cell = c < cells.size() ? cells[c] : "";
      const std::string pad(widths[c] - std::min(widths[c], cell.size()), ' ');
      const bool left = c < left_.size() && left_[c];
      // A left-aligned last column needs no trailing padding.
      const bool last = c + 1 == columns && note.empty();
      out << (c ? "  " : "") << (left ? cell + (last ? "" : pad) : pad + cell);
    }
    if (!note.empty()) out << (columns ? "  " : "") << note;
    out << "\n";
  };
  line(headers_, {});
  for (const Row& row : rows_) line(row.cells, row.note);
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

// Plain-text tables for the terminal, in the style of nccl-tests: right-aligned numeric columns
// (text columns may be aligned left).
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace lmoe::cli {

class Table {
 public:
  explicit Table(std::vector<std::string> headers) : headers_(std::move(headers)) {}
  void add_row(std::vector<std::string> cells) { rows_.push_back({std::move(cells), {}}); }
  // A row whose `note` follows its cells as free text, not aligned and not widening any column
  // (e.g. why a tier was declined).
  void add_row(std::vector<std::string> cells, std::string note) {
    rows_.push_back({std::move(cells), std::move(note)});
  }
  // Text columns read better aligned left; numbers stay right-aligned.
  void align_left(std::vector<bool> columns) { left_ = std::move(columns); }
  void print(std::ostream& out) const;

 private:
  std::vector<std::string> headers_;
  std::vector<bool> left_;
  struct Row {
    std::vector<std::string> cells;
    std::string note;
  };
  std::vector<Row> rows_;
};

// "12.3", "1.23e+04", "-" for a negative value (not measured).
std::string format_number(double value, int precision = 3);

}  // namespace lmoe::cli

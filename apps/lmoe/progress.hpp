// Progress of a benchmark sweep on stderr (`lmoe bench`, `lmoe tune`), and the number formats
// their tables share.
#pragma once

#include <string>

#include "lmoe/tools/tail_bench.hpp"

namespace lmoe::cli {

// "12.3" with `decimals` digits after the point.
std::string fixed(double value, int decimals);
// "4.2 s", "35 s", "2.5 min"; "?" for a negative (unknown) duration.
std::string format_duration(double seconds);

// One line per job on stderr, "PREFIX: [time 3/40] comm T=64 tier  elapsed …, ETA …"; on a
// terminal each line replaces the last.
class ProgressPrinter {
 public:
  explicit ProgressPrinter(std::string prefix);
  ~ProgressPrinter();
  ProgressPrinter(const ProgressPrinter&) = delete;
  ProgressPrinter& operator=(const ProgressPrinter&) = delete;
  void operator()(const BenchProgress& progress);

 private:
  std::string prefix_;
  bool terminal_;
  bool printed_ = false;
};

}  // namespace lmoe::cli

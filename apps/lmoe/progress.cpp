#include "progress.hpp"

#include <unistd.h>

#include <cstdio>
#include <iostream>

namespace lmoe::cli {

std::string fixed(double value, int decimals) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.*f", decimals, value);
  return text;
}

std::string format_duration(double seconds) {
  if (seconds < 0) return "?";
  if (seconds < 90) return fixed(seconds, seconds < 10 ? 1 : 0) + " s";
  return fixed(seconds / 60, 1) + " min";
}

ProgressPrinter::ProgressPrinter(std::string prefix)
    : prefix_(std::move(prefix)), terminal_(isatty(STDERR_FILENO) != 0) {}

ProgressPrinter::~ProgressPrinter() {
  if (terminal_ && printed_) std::cerr << "\n";
}

void ProgressPrinter::operator()(const BenchProgress& progress) {
  const bool timing = progress.phase == BenchProgress::Phase::time;
  const std::string line =
      prefix_ + ": [" + (timing ? "time " : "check ") + std::to_string(progress.done + 1) + "/" +
      std::to_string(progress.total) + "] " + (timing ? progress.comm + " " : "") +
      "T=" + std::to_string(progress.tokens) + " " + std::string(tier_name(progress.tier)) +
      "  elapsed " + format_duration(progress.elapsed_seconds) + ", ETA " +
      format_duration(progress.eta_seconds);
  if (terminal_) {
    std::cerr << "\r" << line << "\033[K" << std::flush;
  } else {
    std::cerr << line << "\n";
  }
  printed_ = true;
}

}  // namespace lmoe::cli

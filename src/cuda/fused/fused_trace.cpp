// LMOE_FUSED_TRACE's report: when the blocks of each kernel's last call reached each point.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "cuda/fused/fused_tail.hpp"

namespace lmoe::cuda {

namespace {

// One kernel's points over its blocks: min / median / max µs after the earliest entry (point 0),
// on stderr; points no block reached (0) are left out. Then the global timer's value (ns) at the
// first entry and at the last stamp of any block, so that the traces of the tails of one graph
// (`lmoe bench --layers N`: each tail prints its own) line up: the gap between one tail's last
// stamp and the next tail's first entry is what passes between them.
void print_points(const char* title, const std::vector<std::uint64_t>& stamps, int grid, int points,
                  const char* const* names) {
  std::uint64_t origin = ~std::uint64_t{0}, last = 0;
  for (int b = 0; b < grid; ++b) {
    const std::uint64_t entry = stamps[static_cast<std::size_t>(b) * points];
    if (entry) origin = std::min(origin, entry);
    for (int point = 0; point < points; ++point)
      last = std::max(last, stamps[static_cast<std::size_t>(b) * points + point]);
  }
  if (origin == ~std::uint64_t{0}) return;  // the kernel did not run
  std::fprintf(stderr, "%s (us after the first entry: min / median / max over blocks)\n", title);
  for (int point = 0; point < points; ++point) {
    std::vector<double> at;
    for (int b = 0; b < grid; ++b) {
      const std::uint64_t stamp = stamps[static_cast<std::size_t>(b) * points + point];
      if (stamp >= origin && stamp != 0) at.push_back(static_cast<double>(stamp - origin) * 1e-3);
    }
    if (at.empty()) continue;
    std::sort(at.begin(), at.end());
    std::fprintf(stderr, "[ fused trace ] %-16s %8.2f %8.2f %8.2f\n", names[point], at.front(),
                 at[at.size() / 2], at.back());
  }
  std::fprintf(stderr, "[ fused trace ] global timer: first entry %llu ns, last stamp %llu ns\n",
               static_cast<unsigned long long>(origin), static_cast<unsigned long long>(last));
}

}  // namespace

// LMOE_FUSED_TRACE: when the blocks of the last call of each kernel reached each point, on stderr.
// Diagnostics only.
void FusedTail::print_trace() noexcept {
  if (cudaDeviceSynchronize() != cudaSuccess) return;
  const auto read = [](const DeviceBuffer& buffer) {
    std::vector<std::uint64_t> stamps(buffer.bytes() / sizeof(std::uint64_t));
    if (cudaMemcpy(stamps.data(), buffer.data(), buffer.bytes(), cudaMemcpyDeviceToHost) !=
        cudaSuccess)
      stamps.clear();
    return stamps;
  };
  if (trace_.bytes()) {
    static constexpr const char* kNames[kFusedTracePoints] = {
        "entry",      "epoch",           "staged", "inputs arrived", "normed", "rows done",
        "items done", "stripes arrived", "end"};
    const std::vector<std::uint64_t> stamps = read(trace_);
    const std::string title = "[ fused trace ] rank " + std::to_string(params_.rank) + ", grid " +
                              std::to_string(params_.grid) + ", splits " +
                              std::to_string(params_.splits) + ", last call";
    if (!stamps.empty())
      print_points(title.c_str(), stamps, params_.grid, kFusedTracePoints, kNames);
  }
  if (chained_trace_.bytes()) {
    static constexpr const char* kNames[kChainedTracePoints] = {
        "entry", "N ready", "multiplied", "partials in", "stored", "parked", "end"};
    const std::vector<std::uint64_t> stamps = read(chained_trace_);
    const int grid = chained_plan_.tiles * chained_plan_.splits;
    const std::string title =
        "[ fused trace ] rank " + std::to_string(params_.rank) + ", chained up-projection, grid " +
        std::to_string(grid) + " (tiles of " + std::to_string(chained_plan_.tile_rows) +
        " rows, splits " + std::to_string(chained_plan_.splits) + "), last call";
    if (!stamps.empty()) print_points(title.c_str(), stamps, grid, kChainedTracePoints, kNames);
  }
  if (exchange_trace_.bytes()) {
    // Both kernels' points from the exchange's first entry (the up-projection's trace above has
    // its own origin).
    static constexpr const char* kNames[kCxTracePoints] = {
        "entry",      "pushed",       "own rows", "shared sums",
        "other rows", "gather entry", "gathered", "closed"};
    const std::vector<std::uint64_t> stamps = read(exchange_trace_);
    const std::string title = "[ fused trace ] rank " + std::to_string(params_.rank) +
                              ", chained exchange and gather, grid " +
                              std::to_string(chained_exchange_grid_) + ", last call";
    if (!stamps.empty())
      print_points(title.c_str(), stamps, chained_exchange_grid_, kCxTracePoints, kNames);
  }
  if (decode_trace_.bytes()) {
    static constexpr const char* kNames[kDecodeTracePoints] = {
        "entry",    "released",        "inputs landed",
        "normed",   "items landed",    "warp 0 multiplied",
        "streamed", "partials stored", "end"};
    const std::vector<std::uint64_t> stamps = read(decode_trace_);
    const std::string title = "[ fused trace ] rank " + std::to_string(params_.rank) +
                              ", decode kernel, grid " + std::to_string(decode_plan_.grid) +
                              ", last call";
    if (!stamps.empty())
      print_points(title.c_str(), stamps, decode_plan_.grid, kDecodeTracePoints, kNames);
  }
}

}  // namespace lmoe::cuda

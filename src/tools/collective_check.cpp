#include "tools/collective_check.hpp"

#include <bit>
#include <numeric>
#include <vector>

#include "tools/bench_values.hpp"

namespace lmoe::bench {

std::string_view collective_op_name(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::all_reduce: return "all_reduce";
    case CollectiveOp::reduce_scatter: return "reduce_scatter";
    case CollectiveOp::all_gather: return "all_gather";
  }
  return "?";
}

std::size_t CollectiveShape::total() const {
  return std::accumulate(counts.begin(), counts.end(), std::size_t{0});
}

std::size_t CollectiveShape::first(int rank) const {
  return std::accumulate(counts.begin(), counts.begin() + rank, std::size_t{0});
}

std::size_t CollectiveShape::input_count(int rank) const {
  return op == CollectiveOp::all_gather ? counts[static_cast<std::size_t>(rank)] : total();
}

std::size_t CollectiveShape::output_count(int rank) const {
  return op == CollectiveOp::reduce_scatter ? counts[static_cast<std::size_t>(rank)] : total();
}

std::size_t CollectiveShape::in_place_send_offset(int rank) const {
  return op == CollectiveOp::all_gather ? first(rank) : 0;
}

std::size_t CollectiveShape::in_place_recv_offset(int rank) const {
  return op == CollectiveOp::reduce_scatter ? first(rank) : 0;
}

std::size_t count_wrong_elements(const CollectiveShape& shape, DType dtype, int rank,
                                 std::uint64_t seed, const void* output) {
  const int ranks = static_cast<int>(shape.counts.size());
  std::vector<std::uint64_t> seeds;
  for (int r = 0; r < ranks; ++r) seeds.push_back(collective_input_seed(seed, r));
  std::vector<std::size_t> starts(static_cast<std::size_t>(ranks) + 1, 0);  // of every block
  std::partial_sum(shape.counts.begin(), shape.counts.end(), starts.begin() + 1);
  const std::size_t first =
      shape.op == CollectiveOp::reduce_scatter ? starts[static_cast<std::size_t>(rank)] : 0;
  std::size_t wrong = 0;
  std::size_t owner = 0;  // all_gather: the rank whose block holds element i
  for (std::size_t i = 0; i < shape.output_count(rank); ++i) {
    float expected = 0.0f;
    if (shape.op == CollectiveOp::all_gather) {
      while (i >= starts[owner + 1]) ++owner;
      expected = collective_value(seeds[owner], i - starts[owner]);
    } else {
      for (int r = 0; r < ranks; ++r)
        expected += collective_value(seeds[static_cast<std::size_t>(r)], first + i);
    }
    // Exact small integers: the dtype's bits widened to fp32 are compared (−0, NaN: wrong).
    if (std::bit_cast<std::uint32_t>(load_as_float(output, i, dtype)) !=
        std::bit_cast<std::uint32_t>(expected)) {
      ++wrong;
    }
  }
  return wrong;
}

}  // namespace lmoe::bench

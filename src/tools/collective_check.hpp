// The collectives benchmark's check, as nccl-tests does it: every rank's input comes from its own
// stream of small integers (bench::collective_value), so the exact result of any collective is
// known element by element, and an output is checked bit for bit by counting the elements that
// differ from it (#wrong). Host code; the device fills inputs with launch_fill_collective_values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "lmoe/dtype.hpp"
#include "tools/bench_values.hpp"  // collective_value, collective_input_seed

namespace lmoe::bench {

enum class CollectiveOp { all_reduce, reduce_scatter, all_gather };

std::string_view collective_op_name(CollectiveOp op);

// A collective as every rank issues it: `counts[r]` is rank r's block (all_reduce: the buffer is
// the blocks together).
struct CollectiveShape {
  CollectiveOp op = CollectiveOp::all_reduce;
  std::span<const std::size_t> counts;

  std::size_t total() const;
  std::size_t first(int rank) const;         // where rank's block starts
  std::size_t input_count(int rank) const;   // elements of rank's send buffer
  std::size_t output_count(int rank) const;  // elements of rank's recv buffer
  // In place, as nccl-tests: send and recv lie in one buffer of total() elements, all_reduce's both
  // at its start, reduce_scatter's recv and all_gather's send at rank's block. Element offsets.
  std::size_t in_place_send_offset(int rank) const;
  std::size_t in_place_recv_offset(int rank) const;
};

// How many of the output_count(rank) elements of `output` (host memory, rank `rank`'s output of
// `shape` in `dtype`, every rank's input from `seed`) differ, bit for bit, from the exact result.
std::size_t count_wrong_elements(const CollectiveShape& shape, DType dtype, int rank,
                                 std::uint64_t seed, const void* output);

}  // namespace lmoe::bench

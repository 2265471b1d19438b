// Floors: the least time a tier of the tail can take on a machine, from what it must move and
// compute (DESIGN.md §2), so that a measurement reads as "x times the floor" (`lmoe bench`'s
// floor_us and x_floor columns; docs/bench.md).
//
// Per rank, with esize the dtype's bytes and s = d / tp:
//   comm   = tier_bus_bytes(tier, T, dims, dtype, tp) / link rate    (0 at tp = 1)
//   memory = (the w_up bytes its GEMM reads + T·(l + 2d)·esize) / memory rate
//            overlap and token read all of w_up (d·l), column and fused their stripe (s·l); every
//            rank reads its routed [T, l] and shared [T, d] partials and writes Y [T, d]
//   flops  = 2·rows·l·cols / GEMM rate: overlap T × d, column and fused T × s, token ⌈T/tp⌉ × d
//   floor  = max(comm, memory, flops)
// The floor assumes that the three overlap perfectly; no tier reaches it (the latent's all-reduce
// must end before the GEMM starts), so read it as a bound, not a prediction.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "lmoe/dims.hpp"
#include "lmoe/dtype.hpp"
#include "lmoe/latent_tail.hpp"
#include "lmoe/tier.hpp"

namespace lmoe {

struct BenchRecord;
struct BenchSweep;

// What one GPU does at best.
struct MachineRates {
  double link_gbps = 0;    // bytes it sends to its peers, 1e9 per second, one direction
  double memory_gbps = 0;  // bytes it reads or writes in its memory, 1e9 per second
  double gemm_tflops = 0;  // dense GEMM of the tail's dtype, 1e12 FLOP per second
};

// The rates lmoe knows for a GPU by its name (the CUDA device name) and the tail's dtype; nullopt
// for other GPUs and for f32 (no tensor-core rate measured here). "NVIDIA H200", bf16/f16: NVLink
// 450 GB/s per direction (18 links × 25 GB/s, specified); 4270 GB/s (a device-to-device copy) and
// 790 TFLOP/s (cuBLASLt bf16, the best of 700–790), both measured in this project (docs/perf.md).
std::optional<MachineRates> known_machine_rates(std::string_view gpu_name, DType dtype);

// "LINK_GBS,MEMORY_GBS,GEMM_TFLOPS", each a finite number > 0 (`lmoe bench --rates`); lmoe::Error
// naming what is wrong.
MachineRates parse_machine_rates(std::string_view text);
// "link 450 GB/s, memory 4270 GB/s, GEMM 790 TFLOP/s"
std::string machine_rates_text(const MachineRates& rates);

// The rates a command's floors use: `given` (the text of --rates) when not empty, else those lmoe
// knows for the GPU (nullopt: none, e.g. the cpu backend) and dtype. `text` says which, for the
// user: "link 450 GB/s, memory 4270 GB/s, GEMM 790 TFLOP/s (known for NVIDIA H200 bf16)", "…
// (--rates)", or "no rates known for the cpu backend (give --rates
// LINK_GBS,MEMORY_GBS,GEMM_TFLOPS)". lmoe::Error from parse_machine_rates for bad `given`.
struct FloorRates {
  std::optional<MachineRates> rates;
  std::string source;  // "--rates", "known for NVIDIA H200 bf16"; empty without rates
  std::string text;
};
FloorRates floor_rates(std::string_view given, const std::optional<std::string>& gpu_name,
                       DType dtype, Backend backend);

struct TierFloor {
  double comm_us = 0, memory_us = 0, flops_us = 0;
  double floor_us = 0;  // max of the three
};

// The floor of one tier at T (above; fused_two_shot: tier_bus_bytes'). tp >= 1, T >= 1;
// lmoe::Error otherwise or for rates <= 0.
TierFloor tier_floor(TailTier tier, std::int64_t num_tokens, TailDims dims, DType dtype, int tp,
                     const MachineRates& rates, bool fused_two_shot = false);

// The floor of a record of `sweep`, its comm part from the bytes the sweep counted for it (for
// fused, those of the exchange its kernel ran), or nullopt where it means nothing: a declined
// record, and ranks that share a GPU (comm cuda-threads with tp > 1, or more ranks than the
// sweep's GPUs), whose "links" are their GPU's memory and whose memory and GEMM rate they split.
std::optional<TierFloor> record_floor(const BenchSweep& sweep, const BenchRecord& record,
                                      const MachineRates& rates);

}  // namespace lmoe

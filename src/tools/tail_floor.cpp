// Floors of the tail's tiers on a machine (include/lmoe/tail_floor.hpp).
#include "lmoe/tools/tail_floor.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <vector>

#include "lmoe/error.hpp"
#include "lmoe/tools/tail_bench.hpp"

namespace lmoe {

namespace {

std::string number_text(double value) {
  char buffer[32];
  const auto [end, error] = std::to_chars(buffer, buffer + sizeof(buffer), value);
  return error == std::errc() ? std::string(buffer, end) : std::to_string(value);
}

void check_rates(const MachineRates& rates, const std::string& where) {
  for (const double rate : {rates.link_gbps, rates.memory_gbps, rates.gemm_tflops}) {
    if (!std::isfinite(rate) || rate <= 0) {
      throw Error(where + ": rates must be finite and > 0 (" + machine_rates_text(rates) + ")");
    }
  }
}

}  // namespace

std::optional<MachineRates> known_machine_rates(std::string_view gpu_name, DType dtype) {
  if (dtype == DType::f32) return std::nullopt;
  if (gpu_name == "NVIDIA H200") return MachineRates{450.0, 4270.0, 790.0};
  return std::nullopt;
}

MachineRates parse_machine_rates(std::string_view text) {
  const std::string what = "rates '" + std::string(text) + "'";
  std::vector<double> values;
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t comma = std::min(text.find(',', start), text.size());
    const std::string_view item = text.substr(start, comma - start);
    double value = 0;
    const auto [end, error] = std::from_chars(item.data(), item.data() + item.size(), value);
    if (item.empty() || error != std::errc() || end != item.data() + item.size()) {
      throw Error(what +
                  ": expected LINK_GBS,MEMORY_GBS,GEMM_TFLOPS (three numbers, e.g. "
                  "450,4270,790), got '" +
                  std::string(item) + "'");
    }
    values.push_back(value);
    start = comma + 1;
  }
  if (values.size() != 3) {
    throw Error(what + ": expected three numbers LINK_GBS,MEMORY_GBS,GEMM_TFLOPS, got " +
                std::to_string(values.size()));
  }
  const MachineRates rates{values[0], values[1], values[2]};
  check_rates(rates, what);
  return rates;
}

std::string machine_rates_text(const MachineRates& rates) {
  return "link " + number_text(rates.link_gbps) + " GB/s, memory " +
         number_text(rates.memory_gbps) + " GB/s, GEMM " + number_text(rates.gemm_tflops) +
         " TFLOP/s";
}

FloorRates floor_rates(std::string_view given, const std::optional<std::string>& gpu_name,
                       DType dtype, Backend backend) {
  FloorRates result;
  const std::string where = gpu_name ? *gpu_name + " " + std::string(dtype_name(dtype))
                                     : "the " + std::string(backend_name(backend)) + " backend";
  if (!given.empty()) {
    result.rates = parse_machine_rates(given);
    result.source = "--rates";
  } else if (gpu_name) {
    result.rates = known_machine_rates(*gpu_name, dtype);
    if (result.rates) result.source = "known for " + where;
  }
  result.text = result.rates ? machine_rates_text(*result.rates) + " (" + result.source + ")"
                             : "no rates known for " + where +
                                   " (give --rates LINK_GBS,MEMORY_GBS,GEMM_TFLOPS)";
  return result;
}

TierFloor tier_floor(TailTier tier, std::int64_t num_tokens, TailDims dims, DType dtype, int tp,
                     const MachineRates& rates, bool fused_two_shot) {
  LMOE_CHECK(tp >= 1, "tier_floor: expected tp >= 1, got " + std::to_string(tp));
  LMOE_CHECK(num_tokens >= 1, "tier_floor: expected T >= 1, got " + std::to_string(num_tokens));
  check_rates(rates, "tier_floor");
  const double esize = static_cast<double>(dtype_size(dtype));
  const double t = static_cast<double>(num_tokens), l = static_cast<double>(dims.d_latent),
               d = static_cast<double>(dims.d_model), stripe = d / tp;
  const bool full_width = tier == TailTier::overlap || tier == TailTier::token;
  const double weight_bytes = (full_width ? d : stripe) * l * esize;
  const double activation_bytes = t * (l + 2.0 * d) * esize;
  double rows = t, cols = stripe;
  if (tier == TailTier::overlap) cols = d;
  if (tier == TailTier::token) {
    rows = std::ceil(t / tp);
    cols = d;
  }
  TierFloor floor;
  floor.comm_us =
      tier_bus_bytes(tier, num_tokens, dims, dtype, tp, fused_two_shot) / (rates.link_gbps * 1e3);
  floor.memory_us = (weight_bytes + activation_bytes) / (rates.memory_gbps * 1e3);
  floor.flops_us = 2.0 * rows * l * cols / (rates.gemm_tflops * 1e6);
  floor.floor_us = std::max({floor.comm_us, floor.memory_us, floor.flops_us});
  return floor;
}

std::optional<TierFloor> record_floor(const BenchSweep& sweep, const BenchRecord& record,
                                      const MachineRates& rates) {
  if (record.declined) return std::nullopt;
  if (sweep.tp > 1) {
    // cuda-threads: every rank on one GPU; the others place rank r on GPU r % GPUs.
    const int gpus = sweep.gpu ? sweep.gpu->device_count : 0;
    if (record.comm == "cuda-threads" || sweep.tp > gpus) return std::nullopt;
  }
  // The bytes the sweep counted for the record (for fused: the exchange its kernel ran).
  TierFloor floor =
      tier_floor(record.tier, record.tokens, sweep.dims, sweep.dtype, sweep.tp, rates);
  if (record.bus_bytes > 0) {
    floor.comm_us = record.bus_bytes / (rates.link_gbps * 1e3);
    floor.floor_us = std::max({floor.comm_us, floor.memory_us, floor.flops_us});
  }
  return floor;
}

}  // namespace lmoe

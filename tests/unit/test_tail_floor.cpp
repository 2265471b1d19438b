// Floors of the tail's tiers (lmoe/tail_floor.hpp): the bytes and FLOPs of DESIGN.md §2 over a
// machine's rates, the rates lmoe knows and parses, and where a record's floor means nothing.
#include "lmoe/tools/tail_floor.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "lmoe/error.hpp"
#include "lmoe/tools/tail_bench.hpp"

namespace {

using lmoe::DType;
using lmoe::MachineRates;
using lmoe::TailTier;
using ::testing::HasSubstr;

const lmoe::TailDims kK3{7168, 3584};
const MachineRates kH200{450.0, 4270.0, 790.0};

// Microseconds of `bytes` at `gbps` and of `flops` at `tflops`, written out here.
double us_of_bytes(double bytes, double gbps) { return bytes / (gbps * 1e9) * 1e6; }
double us_of_flops(double flops, double tflops) { return flops / (tflops * 1e12) * 1e6; }

TEST(TierFloor, DecodeAtK3Tp8IsTheWeightsEachRankReads) {
  // T = 1: overlap reads all 51.4 MB of w_up, column and fused a stripe of 896 rows.
  const double w_full = 7168.0 * 3584 * 2, w_stripe = 896.0 * 3584 * 2;
  const double activations = 1.0 * (3584 + 2 * 7168) * 2;
  for (TailTier tier : lmoe::kAllTiers) {
    SCOPED_TRACE(std::string(lmoe::tier_name(tier)));
    const lmoe::TierFloor floor = lmoe::tier_floor(tier, 1, kK3, DType::bf16, 8, kH200);
    const bool full = tier == TailTier::overlap || tier == TailTier::token;
    EXPECT_NEAR(floor.memory_us, us_of_bytes((full ? w_full : w_stripe) + activations, 4270), 1e-9);
    EXPECT_NEAR(floor.comm_us, us_of_bytes(lmoe::tier_bus_bytes(tier, 1, kK3, DType::bf16, 8), 450),
                1e-12);
    EXPECT_DOUBLE_EQ(floor.floor_us, floor.memory_us);
  }
  // The numbers themselves: 12.04 µs for the whole weight, 1.51 for a stripe.
  EXPECT_NEAR(lmoe::tier_floor(TailTier::overlap, 1, kK3, DType::bf16, 8, kH200).floor_us, 12.0412,
              1e-4);
  EXPECT_NEAR(lmoe::tier_floor(TailTier::fused, 1, kK3, DType::bf16, 8, kH200).floor_us, 1.5125,
              1e-4);
  // overlap's two all-reduces: 2 · 7/8 · (3584 + 7168) · 2 bytes over 450 GB/s.
  EXPECT_NEAR(lmoe::tier_floor(TailTier::overlap, 1, kK3, DType::bf16, 8, kH200).comm_us,
              us_of_bytes(2.0 * 7 / 8 * 10752 * 2, 450), 1e-12);
}

TEST(TierFloor, PrefillAtK3IsTheGemmOrTheLinks) {
  const double t = 8192;
  // overlap: the full-width GEMM on every rank; column and fused: the stripe's; token: own rows.
  EXPECT_NEAR(lmoe::tier_floor(TailTier::overlap, 8192, kK3, DType::bf16, 8, kH200).flops_us,
              us_of_flops(2 * t * 3584 * 7168, 790), 1e-6);
  EXPECT_NEAR(lmoe::tier_floor(TailTier::column, 8192, kK3, DType::bf16, 8, kH200).flops_us,
              us_of_flops(2 * t * 3584 * 896, 790), 1e-6);
  EXPECT_NEAR(lmoe::tier_floor(TailTier::token, 8192, kK3, DType::bf16, 8, kH200).flops_us,
              us_of_flops(2 * 1024.0 * 3584 * 7168, 790), 1e-6);
  // token with T not a multiple of tp: the rank with the most rows, ⌈T/tp⌉.
  EXPECT_NEAR(lmoe::tier_floor(TailTier::token, 8193, kK3, DType::bf16, 8, kH200).flops_us,
              us_of_flops(2 * 1025.0 * 3584 * 7168, 790), 1e-6);
  // overlap at tp 2: 533 µs of GEMM against 391 µs of all-reduces, so the GEMM is the floor; at
  // tp 8 the all-reduces (685 µs) are, and column's stripe GEMM (67 µs) is far below them.
  const lmoe::TierFloor overlap2 =
      lmoe::tier_floor(TailTier::overlap, 8192, kK3, DType::bf16, 2, kH200);
  EXPECT_DOUBLE_EQ(overlap2.floor_us, overlap2.flops_us);
  EXPECT_NEAR(overlap2.comm_us, 391.468, 1e-3);
  const lmoe::TierFloor overlap8 =
      lmoe::tier_floor(TailTier::overlap, 8192, kK3, DType::bf16, 8, kH200);
  EXPECT_DOUBLE_EQ(overlap8.floor_us, overlap8.comm_us);
  EXPECT_NEAR(overlap8.comm_us, 685.070, 1e-3);
  const lmoe::TierFloor column =
      lmoe::tier_floor(TailTier::column, 8192, kK3, DType::bf16, 8, kH200);
  EXPECT_DOUBLE_EQ(column.floor_us, column.comm_us);
  EXPECT_NEAR(column.flops_us, 66.599, 1e-3);
}

TEST(TierFloor, OneRankSendsNothingAndBadArgumentsAreErrors) {
  for (TailTier tier : lmoe::kAllTiers) {
    const lmoe::TierFloor floor = lmoe::tier_floor(tier, 64, kK3, DType::f16, 1, kH200);
    EXPECT_EQ(floor.comm_us, 0.0);
    EXPECT_NEAR(floor.flops_us, us_of_flops(2 * 64.0 * 3584 * 7168, 790), 1e-9);
  }
  EXPECT_THROW(lmoe::tier_floor(TailTier::fused, 1, kK3, DType::bf16, 0, kH200), lmoe::Error);
  EXPECT_THROW(lmoe::tier_floor(TailTier::fused, 0, kK3, DType::bf16, 2, kH200), lmoe::Error);
  EXPECT_THROW(lmoe::tier_floor(TailTier::fused, 1, kK3, DType::bf16, 2, MachineRates{450, 0, 790}),
               lmoe::Error);
}

TEST(MachineRates, KnownForTheH200InBf16AndF16Only) {
  for (DType dtype : {DType::bf16, DType::f16}) {
    const auto rates = lmoe::known_machine_rates("NVIDIA H200", dtype);
    ASSERT_TRUE(rates.has_value());
    EXPECT_EQ(rates->link_gbps, 450.0);
    EXPECT_EQ(rates->memory_gbps, 4270.0);
    EXPECT_EQ(rates->gemm_tflops, 790.0);
  }
  EXPECT_FALSE(lmoe::known_machine_rates("NVIDIA H200", DType::f32).has_value());
  EXPECT_FALSE(lmoe::known_machine_rates("NVIDIA H100 80GB HBM3", DType::bf16).has_value());
  EXPECT_FALSE(lmoe::known_machine_rates("", DType::bf16).has_value());
}

TEST(MachineRates, ParsesThreePositiveNumbersAndNamesWhatIsWrong) {
  const MachineRates rates = lmoe::parse_machine_rates("450,4270.5,790");
  EXPECT_EQ(rates.link_gbps, 450.0);
  EXPECT_EQ(rates.memory_gbps, 4270.5);
  EXPECT_EQ(rates.gemm_tflops, 790.0);
  EXPECT_EQ(lmoe::machine_rates_text(rates), "link 450 GB/s, memory 4270.5 GB/s, GEMM 790 TFLOP/s");
  const auto error_of = [](const char* text) {
    try {
      lmoe::parse_machine_rates(text);
    } catch (const lmoe::Error& error) {
      return std::string(error.what());
    }
    return std::string("no error");
  };
  EXPECT_THAT(error_of("450,4270"),
              HasSubstr("expected three numbers LINK_GBS,MEMORY_GBS,GEMM_TFLOPS, got 2"));
  EXPECT_THAT(error_of("450,4270,790,1"), HasSubstr("got 4"));
  EXPECT_THAT(error_of("450,fast,790"), HasSubstr("got 'fast'"));
  EXPECT_THAT(error_of("450,4270,790,"), HasSubstr("got ''"));
  EXPECT_THAT(error_of(""), HasSubstr("got ''"));
  EXPECT_THAT(error_of("450,-1,790"), HasSubstr("rates must be finite and > 0"));
  EXPECT_THAT(error_of("450,0,790"), HasSubstr("rates '450,0,790'"));
}

TEST(MachineRates, FloorRatesAreGivenKnownOrSaidToBeMissing) {
  const lmoe::FloorRates given =
      lmoe::floor_rates("1,2,3", std::string("NVIDIA H200"), DType::bf16, lmoe::Backend::cuda);
  ASSERT_TRUE(given.rates.has_value());
  EXPECT_EQ(given.rates->memory_gbps, 2.0);  // --rates wins over what lmoe knows
  EXPECT_EQ(given.text, "link 1 GB/s, memory 2 GB/s, GEMM 3 TFLOP/s (--rates)");
  const lmoe::FloorRates known =
      lmoe::floor_rates("", std::string("NVIDIA H200"), DType::f16, lmoe::Backend::cuda);
  ASSERT_TRUE(known.rates.has_value());
  EXPECT_EQ(known.source, "known for NVIDIA H200 f16");
  EXPECT_EQ(known.text,
            "link 450 GB/s, memory 4270 GB/s, GEMM 790 TFLOP/s (known for NVIDIA H200 f16)");
  const lmoe::FloorRates f32 =
      lmoe::floor_rates("", std::string("NVIDIA H200"), DType::f32, lmoe::Backend::cuda);
  EXPECT_FALSE(f32.rates.has_value());
  EXPECT_EQ(f32.text,
            "no rates known for NVIDIA H200 f32 (give --rates LINK_GBS,MEMORY_GBS,GEMM_TFLOPS)");
  const lmoe::FloorRates cpu = lmoe::floor_rates("", std::nullopt, DType::bf16, lmoe::Backend::cpu);
  EXPECT_FALSE(cpu.rates.has_value());
  EXPECT_THAT(cpu.text, HasSubstr("no rates known for the cpu backend"));
  EXPECT_THROW(lmoe::floor_rates("1,2", std::nullopt, DType::bf16, lmoe::Backend::cpu),
               lmoe::Error);
}

// A K3 bf16 sweep on cuda with `tp` ranks on as many H200s.
lmoe::BenchSweep k3_h200_sweep(int tp) {
  lmoe::BenchSweep sweep;
  sweep.backend = lmoe::Backend::cuda;
  sweep.dims = kK3;
  sweep.dtype = DType::bf16;
  sweep.tp = tp;
  sweep.gpu = lmoe::BenchEnvironment::Gpu{"NVIDIA H200", "9.0", 13000, 13000, tp};
  return sweep;
}

TEST(RecordFloor, OnlyWhereEachRankHasItsOwnGpu) {
  lmoe::BenchSweep sweep = k3_h200_sweep(2);
  lmoe::BenchRecord record;
  record.tokens = 16;
  record.tier = TailTier::column;
  for (const char* comm : {"nccl", "p2p"}) {
    record.comm = comm;
    const auto floor = lmoe::record_floor(sweep, record, kH200);
    ASSERT_TRUE(floor.has_value()) << comm;
    EXPECT_DOUBLE_EQ(floor->floor_us,
                     lmoe::tier_floor(TailTier::column, 16, kK3, DType::bf16, 2, kH200).floor_us);
  }
  record.comm = "cuda-threads";  // every rank on one GPU
  EXPECT_FALSE(lmoe::record_floor(sweep, record, kH200).has_value());
  record.comm = "p2p";
  record.declined = "T above the workspace";
  EXPECT_FALSE(lmoe::record_floor(sweep, record, kH200).has_value());
  record.declined.reset();
  sweep.tp = 8;  // 8 ranks on 2 GPUs
  EXPECT_FALSE(lmoe::record_floor(sweep, record, kH200).has_value());
  sweep.tp = 1;  // one rank: any comm, no peers
  record.comm = "cuda-threads";
  EXPECT_TRUE(lmoe::record_floor(sweep, record, kH200).has_value());
  // The cpu backend's ranks are threads of one machine: a floor only for one rank.
  sweep.backend = lmoe::Backend::cpu;
  sweep.gpu.reset();
  record.comm = "threads";
  EXPECT_TRUE(lmoe::record_floor(sweep, record, kH200).has_value());
  sweep.tp = 2;
  EXPECT_FALSE(lmoe::record_floor(sweep, record, kH200).has_value());
}

// A record's links part is the bytes its sweep counted (for fused: the exchange its kernel ran, one
// shot or two), so that a fused record of the chained path at tp 8 is held to the two-shot floor.
TEST(RecordFloor, TakesTheBytesTheSweepCounted) {
  const lmoe::BenchSweep sweep = k3_h200_sweep(8);
  lmoe::BenchRecord record;
  record.tokens = 128;
  record.tier = TailTier::fused;
  record.comm = "p2p";
  const lmoe::TierFloor one_shot =
      lmoe::tier_floor(TailTier::fused, 128, kK3, DType::bf16, 8, kH200);
  const lmoe::TierFloor two_shot =
      lmoe::tier_floor(TailTier::fused, 128, kK3, DType::bf16, 8, kH200, true);
  // K3 tp 8, T = 128: 21.4 µs of links in one shot, 10.7 in two (docs/fused.md); both bound by
  // them.
  EXPECT_NEAR(one_shot.comm_us, 21.4, 0.05);
  EXPECT_NEAR(two_shot.comm_us, 10.7, 0.05);
  EXPECT_DOUBLE_EQ(two_shot.memory_us, one_shot.memory_us);
  record.bus_bytes = lmoe::tier_bus_bytes(TailTier::fused, 128, kK3, DType::bf16, 8, true);
  const auto floor = lmoe::record_floor(sweep, record, kH200);
  ASSERT_TRUE(floor.has_value());
  EXPECT_DOUBLE_EQ(floor->comm_us, two_shot.comm_us);
  EXPECT_DOUBLE_EQ(floor->floor_us, two_shot.floor_us);
  record.bus_bytes = 0;  // a sweep from before bus bytes were recorded: the formula's one shot
  EXPECT_DOUBLE_EQ(lmoe::record_floor(sweep, record, kH200)->floor_us, one_shot.floor_us);
}

// Only cuda with several ranks runs the chained path's two shots; nowhere in a build without CUDA.
TEST(FusedTwoShot, OnlyTheChainedPathWithSeveralRanks) {
  EXPECT_FALSE(lmoe::fused_runs_two_shot(lmoe::Backend::cpu, kK3, DType::bf16, 8, 64));
  EXPECT_FALSE(lmoe::fused_runs_two_shot(lmoe::Backend::cuda, kK3, DType::bf16, 1, 64));
  EXPECT_FALSE(lmoe::fused_runs_two_shot(lmoe::Backend::cuda, kK3, DType::bf16, 8, 129));
#ifndef LMOE_HAS_CUDA
  EXPECT_FALSE(lmoe::fused_runs_two_shot(lmoe::Backend::cuda, kK3, DType::bf16, 8, 64));
#endif
}

}  // namespace

// Parity of every CPU tier with the numerics contract (like ggml's test-backend-ops): every tier ×
// tp × T × dtype on fresh random inputs, within the contract's bound and fp64 tolerance; crafted
// inputs that are exact in any summation order, bit for bit; signed zeros and subnormals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>

#include "core/host_math.hpp"
#include "lmoe/error.hpp"
#include "lmoe/reference.hpp"
#include "lmoe/threads_communicator.hpp"
#include "lmoe/tools/tail_runner.hpp"

namespace {

using lmoe::DType;
using lmoe::TailTier;

const lmoe::TailDims kSmall{384, 192};  // divisible by 8·tp for tp ∈ {1, 2, 3, 4, 8}

// T = 0, 1, tp−1, tp, tp+1, odd sizes, the default thresholds ±1, and 300.
std::vector<std::int64_t> token_counts(int tp) {
  std::set<std::int64_t> tokens = {0, 1, 7, 127, 128, 129, 255, 256, 257, 300};
  for (std::int64_t t : {tp - 1, tp, tp + 1}) {
    if (t >= 0) tokens.insert(t);
  }
  return {tokens.begin(), tokens.end()};
}

lmoe::CaseRun run(const lmoe::TailCase& c, std::optional<TailTier> tier) {
  lmoe::RunOptions options;
  options.tier = tier;
  return lmoe::run_case_on_threads(c, options);
}

struct ParityParam {
  int tp;
  DType dtype;
};

class CpuTailParity : public ::testing::TestWithParam<ParityParam> {
 protected:
  static void SetUpTestSuite() { lmoe::cpu::set_blas_threads(1); }
};

TEST_P(CpuTailParity, EveryTierMeetsItsContractAndFp64) {
  const auto [tp, dtype] = GetParam();
  for (std::int64_t tokens : token_counts(tp)) {
    const std::uint64_t seed =
        1000u * static_cast<std::uint64_t>(tp) + static_cast<std::uint64_t>(tokens);
    const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, dtype, tp, tokens, seed);
    const std::vector<double> exact = lmoe::exact_tail(c);
    for (TailTier tier : lmoe::kAllTiers) {
      SCOPED_TRACE("tier " + std::string(lmoe::tier_name(tier)) + " T=" + std::to_string(tokens));
      if (tier == TailTier::token && tokens < tp && tokens > 0) {
        EXPECT_THROW(run(c, tier), lmoe::Error);
        continue;
      }
      const lmoe::CaseRun result = run(c, tier);
      EXPECT_TRUE(result.ranks_identical);
      if (tokens == 0) {
        EXPECT_FALSE(result.tier.has_value());
        continue;
      }
      ASSERT_EQ(result.tier, tier);
      const auto reference = lmoe::reference_tail(c, lmoe::contract_of(tier));
      const lmoe::Comparison cmp = lmoe::compare(result.ranks[0].y.matrix(), reference, exact);
      EXPECT_EQ(cmp.beyond_bound, 0) << "max err/bound " << cmp.max_error_over_bound;
      EXPECT_LE(cmp.normwise_error, cmp.normwise_tolerance);
    }
  }
}

TEST_P(CpuTailParity, CraftedExactInputsMatchBitForBit) {
  const auto [tp, dtype] = GetParam();
  for (std::int64_t tokens : {std::int64_t{1}, std::int64_t{tp}, std::int64_t{37}}) {
    const lmoe::TailCase c =
        lmoe::make_exact_case(kSmall, dtype, tp, tokens, 77u + static_cast<std::uint64_t>(tokens));
    for (TailTier tier : lmoe::kAllTiers) {
      if (tier == TailTier::token && tokens < tp) continue;
      SCOPED_TRACE("tier " + std::string(lmoe::tier_name(tier)) + " T=" + std::to_string(tokens));
      const lmoe::CaseRun result = run(c, tier);
      const auto reference = lmoe::reference_tail(c, lmoe::contract_of(tier));
      const lmoe::Comparison cmp =
          lmoe::compare(result.ranks[0].y.matrix(), reference, lmoe::exact_tail(c));
      EXPECT_EQ(cmp.bit_mismatches, 0);
    }
  }
}

TEST_P(CpuTailParity, AutoRunsThePolicyChoice) {
  const auto [tp, dtype] = GetParam();
  for (std::int64_t tokens :
       {std::int64_t{1}, std::int64_t{128}, std::int64_t{129}, std::int64_t{257}}) {
    const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, dtype, tp, tokens, 5u);
    const lmoe::CaseRun result = run(c, std::nullopt);
    const TailTier expected = tokens <= 128   ? TailTier::fused
                              : tokens <= 256 ? TailTier::overlap
                                              : TailTier::column;
    EXPECT_EQ(result.tier, expected) << "T=" << tokens;
  }
}

std::string name_of(const ::testing::TestParamInfo<ParityParam>& info) {
  return "tp" + std::to_string(info.param.tp) + "_" +
         std::string(lmoe::dtype_name(info.param.dtype));
}

std::vector<ParityParam> all_params() {
  std::vector<ParityParam> params;
  for (int tp : {1, 2, 3, 4, 8}) {
    for (DType dtype : {DType::bf16, DType::f16, DType::f32}) params.push_back({tp, dtype});
  }
  return params;
}

INSTANTIATE_TEST_SUITE_P(AllTpAndDtypes, CpuTailParity, ::testing::ValuesIn(all_params()), name_of);

// The output may be the shared buffer itself (in place), for every tier.
// latent_norm = false (Nemotron 3): N is the reduced latent itself. Every tier meets the contract
// (random inputs, also under the reordered-sum bound), crafted inputs match bit for bit, the flag
// changes the result (the cuda backend: tests/cuda/test_cuda_tail.cpp).
TEST(CpuTail, WithoutTheLatentNormEveryTierMeetsItsContract) {
  for (int tp : {1, 2, 4}) {
    for (DType dtype : {DType::bf16, DType::f32}) {
      for (std::int64_t tokens : {std::int64_t{1}, std::int64_t{7}, std::int64_t{64}}) {
        lmoe::TailCase c = lmoe::make_random_case(
            kSmall, 1e-5f, dtype, tp, tokens,
            31u * static_cast<std::uint64_t>(tokens) + static_cast<std::uint64_t>(tp));
        c.latent_norm = false;
        lmoe::TailCase exact_inputs = lmoe::make_exact_case(
            kSmall, dtype, tp, tokens, 5u + static_cast<std::uint64_t>(tokens));
        exact_inputs.latent_norm = false;
        const std::vector<double> exact = lmoe::exact_tail(c);
        for (TailTier tier : lmoe::kAllTiers) {
          if (tier == TailTier::token && tokens < tp) continue;
          SCOPED_TRACE("tp=" + std::to_string(tp) + " " + std::string(lmoe::dtype_name(dtype)) +
                       " T=" + std::to_string(tokens) + " " + std::string(lmoe::tier_name(tier)));
          const lmoe::CaseRun result = run(c, tier);
          EXPECT_TRUE(result.ranks_identical);
          for (auto order : {lmoe::ReductionOrder::rank_order, lmoe::ReductionOrder::unspecified}) {
            const lmoe::Comparison cmp =
                lmoe::compare(result.ranks[0].y.matrix(),
                              lmoe::reference_tail(c, lmoe::contract_of(tier), order), exact);
            EXPECT_EQ(cmp.beyond_bound, 0) << "max err/bound " << cmp.max_error_over_bound;
            EXPECT_LE(cmp.normwise_error, cmp.normwise_tolerance);
          }
          const lmoe::CaseRun crafted = run(exact_inputs, tier);
          const lmoe::Comparison crafted_cmp =
              lmoe::compare(crafted.ranks[0].y.matrix(),
                            lmoe::reference_tail(exact_inputs, lmoe::contract_of(tier)),
                            lmoe::exact_tail(exact_inputs));
          EXPECT_EQ(crafted_cmp.bit_mismatches, 0);
        }
        // The flag is not ignored: with the norm the same inputs give another result.
        lmoe::TailCase normed = c;
        normed.latent_norm = true;
        const lmoe::CaseRun with_norm = run(normed, TailTier::overlap);
        const lmoe::CaseRun without = run(c, TailTier::overlap);
        EXPECT_NE(0, std::memcmp(with_norm.ranks[0].y.data(), without.ranks[0].y.data(),
                                 without.ranks[0].y.nbytes()));
      }
    }
  }
}

TEST(CpuTail, OutputMayAliasShared) {
  const int tp = 4;
  const std::int64_t tokens = 9;
  const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, tp, tokens, 11u);
  const std::vector<double> exact = lmoe::exact_tail(c);
  for (TailTier tier : lmoe::kAllTiers) {
    SCOPED_TRACE(std::string(lmoe::tier_name(tier)));
    std::vector<lmoe::HostTensor> outputs(tp);
    lmoe::run_on_threads(tp, [&](int rank, lmoe::Communicator& comm) {
      lmoe::TailOptions options;
      options.dims = c.dims;
      options.dtype = c.dtype;
      options.rms_norm_eps = c.eps;
      lmoe::LatentTail tail(options, comm, c.norm_weight.matrix(), c.up_proj_weight.matrix());
      lmoe::HostTensor shared(c.dtype, {tokens, c.dims.d_model});
      std::memcpy(shared.data(), c.shared.slice_matrix(rank).data, shared.nbytes());
      tail.forward(c.routed.slice_matrix(rank), shared.matrix(), shared.matrix(), tier);
      outputs[rank] = std::move(shared);
    });
    const auto reference = lmoe::reference_tail(c, lmoe::contract_of(tier));
    for (int rank = 0; rank < tp; ++rank) {
      EXPECT_EQ(lmoe::compare(outputs[rank].matrix(), reference, exact).beyond_bound, 0)
          << "rank " << rank;
    }
  }
}

// −0 and subnormals are legal values: where the contract produces them, every tier must too.
TEST(CpuTail, SignedZerosAndSubnormalsPassBitForBit) {
  const int tp = 2;
  const std::int64_t tokens = 6;
  for (DType dtype : {DType::bf16, DType::f16, DType::f32}) {
    lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, dtype, tp, tokens, 3u);
    // A +0 latent with gamma = −1 and positive weights makes N = −0 (a norm output of −0 must
    // survive), U = +0 (the GEMM's accumulator starts at +0, docs/numerics.md), and shared carries
    // signed zeros and subnormals through the rank sums.
    const float tiny = dtype == DType::f16 ? 0x1p-24f : 0x1p-130f;
    for (std::int64_t i = 0; i < c.routed.numel(); ++i) c.routed.set(i, 0.0f);
    for (std::int64_t i = 0; i < c.norm_weight.numel(); ++i) c.norm_weight.set(i, -1.0f);
    for (std::int64_t i = 0; i < c.up_proj_weight.numel(); ++i) {
      c.up_proj_weight.set(i, std::fabs(c.up_proj_weight.get(i)) + 0.01f);
    }
    const std::int64_t per_rank = tokens * c.dims.d_model;
    for (std::int64_t i = 0; i < c.shared.numel(); ++i) {
      const float values[] = {-0.0f, 0.0f, tiny, -tiny, 3 * tiny};
      c.shared.set(i, values[(i % per_rank) % 5]);  // the same value on both ranks
    }
    const std::vector<double> exact = lmoe::exact_tail(c);
    for (TailTier tier : lmoe::kAllTiers) {
      SCOPED_TRACE(std::string(lmoe::tier_name(tier)) + " " + std::string(lmoe::dtype_name(dtype)));
      const lmoe::CaseRun result = run(c, tier);
      const auto reference = lmoe::reference_tail(c, lmoe::contract_of(tier));
      EXPECT_EQ(lmoe::compare(result.ranks[0].y.matrix(), reference, exact).bit_mismatches, 0);
      // Some outputs are subnormal, so the test does exercise them.
      bool saw_subnormal = false;
      for (std::int64_t i = 0; i < result.ranks[0].y.numel(); ++i) {
        const float v = result.ranks[0].y.get(i);
        saw_subnormal |= v != 0.0f && std::fabs(v) < (dtype == DType::f16 ? 0x1p-14f : 0x1p-126f);
      }
      EXPECT_TRUE(saw_subnormal);
    }
  }
}

// A wrong stripe or a missing rank must be caught by the comparison: the check can fail.
TEST(CpuTail, ComparisonCatchesAWrongResult) {
  const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, 2, 5, 8u);
  const lmoe::CaseRun result = run(c, TailTier::column);
  lmoe::HostTensor y = result.ranks[0].y;
  const auto reference = lmoe::reference_tail(c, lmoe::Contract::column);
  const std::vector<double> exact = lmoe::exact_tail(c);
  EXPECT_TRUE(lmoe::compare(y.matrix(), reference, exact).ok());
  y.set(17, y.get(17) + 0.25f);
  EXPECT_EQ(lmoe::compare(y.matrix(), reference, exact).beyond_bound, 1);
  y.fill_bytes(std::byte{0xff});
  EXPECT_FALSE(lmoe::compare(y.matrix(), reference, exact).ok());
}

}  // namespace

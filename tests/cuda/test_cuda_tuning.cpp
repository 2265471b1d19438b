// Tier tables on a GPU: the running configuration names this GPU, `tune` on the cuda backend writes
// a table that fits this machine and reads back equal, LatentTail accepts it, and refuses it once
// its GPU name or compute capability is another's; a table derived from a sweep recorded here fits
// here too. Every test skips without a GPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <regex>

#include "cuda/tail/cuda_tail_executor.hpp"
#include "gpu_test_support.hpp"
#include "lmoe/comm_group.hpp"
#include "lmoe/error.hpp"
#include "lmoe/reference.hpp"
#include "lmoe/tools/tier_tuning.hpp"

namespace {

using ::testing::HasSubstr;

const lmoe::TailDims kSmall{384, 192};

TEST(CudaTuning, RunningConfigNamesThisGpu) {
  SKIP_WITHOUT_GPU();
  const lmoe::RunningConfig running =
      lmoe::running_config(lmoe::Backend::cuda, 2, kSmall, lmoe::DType::bf16, "cuda-threads");
  ASSERT_TRUE(running.gpu);
  EXPECT_FALSE(running.gpu->name.empty());
  EXPECT_TRUE(std::regex_match(running.gpu->compute_capability, std::regex("[0-9]+\\.[0-9]+")))
      << running.gpu->compute_capability;
  EXPECT_GT(running.gpu->cuda_driver_version, 0);
  EXPECT_GT(running.gpu->cuda_runtime_version, 0);
  if (running.driver_version) {
    EXPECT_TRUE(std::regex_match(*running.driver_version, std::regex("[0-9][0-9.]*")))
        << *running.driver_version;
  }
}

// Builds one LatentTail per rank on the default comm with `table` in its policy.
void build_tails(const lmoe::TierTable& table, int tp) {
  const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, lmoe::DType::bf16, tp, 1, 3u);
  lmoe::run_comm_group(table.provenance.comm, tp, [&](int, lmoe::Communicator& comm) {
    lmoe::TailOptions options;
    options.dims = kSmall;
    options.backend = lmoe::Backend::cuda;
    // As loading the file does: the ranges, the breakpoints and the measured table.
    lmoe::apply_tier_table(options.policy, lmoe::write_tier_table(table), "table t.json");
    options.policy.table_path = "t.json";
    lmoe::LatentTail tail(options, comm, c.norm_weight.matrix(), c.up_proj_weight.matrix());
    EXPECT_TRUE(tail.table_warnings().empty());
  });
}

// A short sweep at small dims on 2 ranks of the default comm.
lmoe::BenchOptions small_sweep() {
  lmoe::BenchOptions options;
  options.backend = lmoe::Backend::cuda;
  options.dims = kSmall;
  options.tp = 2;
  options.tokens = {1, 8, 64};
  options.comms = {lmoe::default_comm_backend(lmoe::Backend::cuda)};
  options.warmup = 1;
  options.iters = 3;
  return options;
}

TEST(CudaTuning, TuneWritesATableThatFitsThisGpuAndNoOther) {
  SKIP_WITHOUT_GPU();
  const lmoe::TuneResult tuned = lmoe::tune_tiers(small_sweep(), "small");
  ASSERT_TRUE(tuned.ok());
  const lmoe::TierTable& table = tuned.table;
  ASSERT_TRUE(table.provenance.gpu);
  EXPECT_EQ(table.provenance.comm, lmoe::default_comm_backend(lmoe::Backend::cuda));
  EXPECT_EQ(table.grid.size(), 3u);
  for (const lmoe::GridPoint& point : table.grid) {
    for (lmoe::TailTier tier : lmoe::kAllTiers) {
      if (point[tier].ran()) {
        EXPECT_GT(point[tier].median_us, 0) << point.tokens;
      }
    }
  }
  // The ranges give every grid T its fastest tier.
  EXPECT_EQ(tuned.range_fit.total_regret, 0);
  EXPECT_LE(tuned.range_fit.total_regret, tuned.breakpoint_fit.total_regret);
  const lmoe::TierTable back = lmoe::read_tier_table(lmoe::write_tier_table(table), "t.json");
  EXPECT_EQ(back.provenance, table.provenance);
  EXPECT_EQ(back.ranges, table.ranges);
  EXPECT_EQ(back.breakpoints, table.breakpoints);

  build_tails(back, 2);

  lmoe::TierTable other = back;
  other.provenance.gpu->name = "Some Other GPU";
  try {
    build_tails(other, 2);
    FAIL() << "a table from another GPU was accepted";
  } catch (const lmoe::Error& error) {
    EXPECT_THAT(error.message(), HasSubstr("gpu.name is 'Some Other GPU' in the table, '" +
                                           table.provenance.gpu->name + "' here"));
  }
  other = back;
  other.provenance.gpu->compute_capability = "1.0";
  try {
    build_tails(other, 2);
    FAIL() << "a table from another compute capability was accepted";
  } catch (const lmoe::Error& error) {
    EXPECT_THAT(error.message(), HasSubstr("gpu.compute_capability is 1.0 in the table"));
  }
}

// A sweep recorded here (`lmoe bench --json`), read back and fitted (`lmoe tune --from-sweep`),
// gives a table that fits this machine with no warning: the recording names this GPU, its kernel
// driver, CUDA and NCCL versions as running_config does.
TEST(CudaTuning, ATableDerivedFromASweepRecordedHereFitsHere) {
  SKIP_WITHOUT_GPU();
  const lmoe::BenchOptions options = small_sweep();
  const lmoe::BenchSweep recorded =
      lmoe::read_bench_json(lmoe::write_bench_json(lmoe::bench_sweep_of(
                                options, "small", lmoe::bench_environment(lmoe::Backend::cuda),
                                lmoe::run_tail_bench(options))),
                            "sweep.json");
  ASSERT_TRUE(recorded.result.ok());
  const std::string& comm = options.comms.front();
  const lmoe::RunningConfig here =
      lmoe::running_config(lmoe::Backend::cuda, 2, kSmall, lmoe::DType::bf16, comm);
  const lmoe::RunningConfig there = lmoe::running_config_of(recorded, comm);
  EXPECT_EQ(there.gpu, here.gpu);
  EXPECT_EQ(there.driver_version, here.driver_version);
  EXPECT_EQ(there.nccl_version, here.nccl_version);
  EXPECT_EQ(there.lmoe_version, here.lmoe_version);

  const lmoe::TuneResult derived = lmoe::tune_from_sweep(recorded, std::nullopt, "sweep.json");
  ASSERT_TRUE(derived.table.provenance.derived_from);
  EXPECT_EQ(derived.range_fit.total_regret, 0);
  build_tails(lmoe::read_tier_table(lmoe::write_tier_table(derived.table), "t.json"), 2);
}

// A LatentTail whose configuration a table built into lmoe was measured for (this GPU's name and
// compute capability, the table's tp, dims, dtype and comm, a GPU per rank) takes that table's
// ranges, with nothing set; one given by the caller keeps it out. With fewer GPUs than ranks (p2p
// ranks sharing one, LMOE_P2P_SHARED_GPU) the table is kept out: it was measured with one rank per
// GPU. Skips where no built-in table fits this machine.
TEST(CudaTuning, ALatentTailTakesTheBuiltInTableMeasuredForItsConfiguration) {
  SKIP_WITHOUT_GPU();
  const lmoe::RunningConfig here =
      lmoe::running_config(lmoe::Backend::cuda, 1, kSmall, lmoe::DType::bf16, std::nullopt);
  int fitted = 0;
  for (const lmoe::ShippedTierTable& shipped : lmoe::shipped_tier_tables()) {
    const lmoe::TierTable table =
        lmoe::read_tier_table(std::string(shipped.json), std::string(shipped.name));
    const lmoe::TableProvenance& p = table.provenance;
    if (p.backend != lmoe::Backend::cuda || !p.gpu || p.gpu->name != here.gpu->name ||
        p.gpu->compute_capability != here.gpu->compute_capability ||
        lmoe::comm_group_limit(p.comm, p.tp)) {
      continue;
    }
    SCOPED_TRACE(std::string(shipped.name));
    ++fitted;
    int gpus = 0;
    ASSERT_EQ(cudaGetDeviceCount(&gpus), cudaSuccess);
    const bool shared_gpu = gpus < p.tp;  // the group places rank r on GPU r % gpus
    const lmoe::TailCase c = lmoe::make_random_case(p.dims, 1e-5f, p.dtype, p.tp, 1, 5u);
    lmoe::run_comm_group(p.comm, p.tp, [&](int, lmoe::Communicator& comm) {
      lmoe::TailOptions options;
      options.dims = p.dims;
      options.dtype = p.dtype;
      options.backend = lmoe::Backend::cuda;
      options.max_tokens = 64;
      {
        const lmoe::LatentTail tail(options, comm, c.norm_weight.matrix(),
                                    c.up_proj_weight.matrix());
        if (shared_gpu) {
          EXPECT_EQ(tail.options().policy.table, nullptr);
        } else {
          EXPECT_EQ(tail.options().policy.table_path, "shipped table " + std::string(shipped.name));
          EXPECT_EQ(tail.options().policy.ranges.value, table.ranges);
          EXPECT_THAT(tail.explain(32), HasSubstr(std::string(shipped.name)));
        }
      }
      options.policy.overlap_max_tokens = {8, lmoe::SettingSource::caller, "test"};
      const lmoe::LatentTail mine(options, comm, c.norm_weight.matrix(), c.up_proj_weight.matrix());
      EXPECT_EQ(mine.options().policy.table, nullptr);
      EXPECT_TRUE(mine.options().policy.ranges.value.empty());
    });
  }
  if (fitted == 0) GTEST_SKIP() << "no table built into lmoe was measured on a " << here.gpu->name;
}

}  // namespace

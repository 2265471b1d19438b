// The tail benchmark on a GPU: the device input generator against the host's, bit for bit, and a
// small sweep whose every checked record meets the contract. Every test skips without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "cuda/runtime/device_buffer.hpp"
#include "cuda/tail/cuda_tail_executor.hpp"
#include "gpu_test_support.hpp"
#include "lmoe/comm_group.hpp"
#include "lmoe/tools/tail_bench.hpp"
#include "tools/bench_rank.hpp"
#include "tools/cuda/bench_fill.hpp"
#include "tools/cuda/l2_evict.hpp"

namespace {

using lmoe::DType;
using lmoe::TailTier;

TEST(CudaBench, DeviceInputsEqualTheHostsBitForBit) {
  SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::bf16, DType::f16, DType::f32}) {
    SCOPED_TRACE(std::string(lmoe::dtype_name(dtype)));
    const std::size_t count = (1u << 20) + 3, bytes = count * lmoe::dtype_size(dtype);
    const lmoe::cuda::DeviceBuffer device(bytes);
    ASSERT_EQ(lmoe::cuda::launch_fill_bench_values(device.data(), static_cast<std::int64_t>(count),
                                                   dtype, 99, nullptr),
              cudaSuccess);
    std::vector<std::byte> from_device(bytes), from_host(bytes);
    ASSERT_EQ(cudaMemcpy(from_device.data(), device.data(), bytes, cudaMemcpyDeviceToHost),
              cudaSuccess);
    lmoe::fill_bench_values(from_host.data(), count, dtype, 99);
    EXPECT_EQ(std::memcmp(from_device.data(), from_host.data(), bytes), 0);
  }
}

// Small dims, 2 ranks sharing the GPU, every comm this machine lists.
lmoe::BenchOptions small_options(std::vector<std::int64_t> tokens) {
  lmoe::BenchOptions options;
  options.backend = lmoe::Backend::cuda;
  options.dims = {384, 192};
  options.tp = 2;
  options.tokens = std::move(tokens);
  options.warmup = 1;
  options.iters = 3;
  return options;
}

TEST(CudaBench, SweepMeetsTheContractOnEveryComm) {
  SKIP_WITHOUT_GPU();
  const lmoe::BenchOptions options = small_options({1, 3, 130});
  std::size_t progress_calls = 0;
  const lmoe::BenchResult result =
      lmoe::run_tail_bench(options, [&](const lmoe::BenchProgress&) { ++progress_calls; });
  for (const lmoe::BenchCommError& error : result.comm_errors)
    ADD_FAILURE() << error.comm << ": " << error.error;
  const std::size_t comms = lmoe::comm_backends(lmoe::Backend::cuda, options.tp).size();
  ASSERT_EQ(result.records.size(), comms * 3 * 4);
  EXPECT_GT(progress_calls, 0u);
  for (const lmoe::BenchRecord& record : result.records) {
    SCOPED_TRACE(record.comm + " T=" + std::to_string(record.tokens) + " " +
                 std::string(lmoe::tier_name(record.tier)));
    // Declined: token with T < tp; fused with tp > 1 over anything but p2p (its kernel reads the
    // peers' workspaces).
    if ((record.tokens == 1 && record.tier == TailTier::token) ||
        (record.tier == TailTier::fused && record.comm != "p2p")) {
      EXPECT_TRUE(record.declined.has_value());
      continue;
    }
    ASSERT_FALSE(record.declined.has_value()) << *record.declined;
    EXPECT_TRUE(record.checked);
    EXPECT_EQ(record.wrong(), 0);
    EXPECT_TRUE(record.ranks_identical);
    EXPECT_TRUE(record.ok());
    ASSERT_EQ(record.seconds.size(), 3u);
    EXPECT_GT(record.stats.median, 0);
    if (record.comm == "cuda-threads") {
      EXPECT_EQ(record.mode, lmoe::BenchMode::eager);  // it synchronizes on the host
    }
  }
}

TEST(CudaBench, AWrongElementIsCaughtOnTheGpuToo) {
  SKIP_WITHOUT_GPU();
  lmoe::BenchOptions options = small_options({4});
  options.tiers = {TailTier::column};
  options.comms = {lmoe::default_comm_backend(lmoe::Backend::cuda)};
  options.inject_fault = true;
  const lmoe::BenchResult result = lmoe::run_tail_bench(options);
  ASSERT_EQ(result.records.size(), 1u);
  EXPECT_GE(result.records[0].wrong(), 1);
  EXPECT_FALSE(result.ok());
}

TEST(CudaBench, TheL2EvictorReadsTwiceTheL2) {
  SKIP_WITHOUT_GPU();
  int device = 0, l2_bytes = 0;
  cuda_ok(cudaGetDevice(&device));
  cuda_ok(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
  cudaStream_t stream = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  {
    const lmoe::cuda::L2Evictor evictor(stream);
    EXPECT_EQ(evictor.bytes(),
              std::max(2 * static_cast<std::size_t>(l2_bytes), std::size_t{64} << 20));
    evictor.evict(stream);
    evictor.evict(stream);
    // Touching inputs: whole 16-byte vectors of an aligned buffer (a tail shorter than 16 bytes is
    // left out); a misaligned one is an error before anything is launched.
    const lmoe::cuda::DeviceBuffer inputs(1000);
    evictor.touch(inputs.data(), 1000, stream);
    evictor.touch(inputs.data(), 8, stream);
    try {
      evictor.touch(static_cast<const char*>(inputs.data()) + 8, 64, stream);
      ADD_FAILURE() << "a misaligned buffer was touched";
    } catch (const lmoe::Error& error) {
      EXPECT_NE(std::string(error.what()).find("16-byte aligned"), std::string::npos)
          << error.what();
    }
    cuda_ok(cudaStreamSynchronize(stream));
    cuda_ok(cudaGetLastError());
  }
  cuda_ok(cudaStreamDestroy(stream));
}

// Every record of a sweep that ran (3 timed iterations, no comm failed) checked and right; how many
// ran, and each one's mode (all must be `mode` when given).
std::size_t expect_ran_records_right(const lmoe::BenchResult& result,
                                     std::optional<lmoe::BenchMode> mode = std::nullopt) {
  for (const lmoe::BenchCommError& error : result.comm_errors)
    ADD_FAILURE() << error.comm << ": " << error.error;
  std::size_t ran = 0;
  for (const lmoe::BenchRecord& record : result.records) {
    SCOPED_TRACE("T=" + std::to_string(record.tokens) + " " +
                 std::string(lmoe::tier_name(record.tier)));
    if (record.declined) continue;
    ++ran;
    if (mode) {
      EXPECT_EQ(record.mode, *mode);
    }
    EXPECT_TRUE(record.checked);
    EXPECT_EQ(record.wrong(), 0);
    EXPECT_TRUE(record.ok());
    EXPECT_EQ(record.seconds.size(), 3u);
    EXPECT_GT(record.stats.median, 0);
  }
  return ran;
}

TEST(CudaBench, AColdL2SweepMeetsTheContract) {
  SKIP_WITHOUT_GPU();
  lmoe::BenchOptions options = small_options({1, 130});
  options.tp = 1;  // cold numbers are meant for one rank per GPU
  options.comms = {lmoe::default_comm_backend(lmoe::Backend::cuda)};
  options.cold_l2 = true;
  EXPECT_GE(expect_ran_records_right(lmoe::run_tail_bench(options)), 4u);
}

// Several layers' tails in one graph (each its own weights, workspaces and buffers): every tier,
// the fused tier's kernels (decode, chained, general) among them, in graph and device-tokens mode,
// at one rank and two on p2p; a layer whose output differed from the first's would be the one
// checked.
TEST(CudaBench, LayersInOneGraphMeetTheContract) {
  SKIP_WITHOUT_GPU();
  const ScopedEnv shared_gpu("LMOE_P2P_SHARED_GPU", "1");  // two ranks on a machine of one GPU
  for (const lmoe::BenchMode mode : {lmoe::BenchMode::graph, lmoe::BenchMode::device_tokens}) {
    for (const int tp : {1, 2}) {
      SCOPED_TRACE(std::string(lmoe::bench_mode_name(mode)) + " tp=" + std::to_string(tp));
      lmoe::BenchOptions options = small_options({1, 5, 17, 130});
      options.tp = tp;
      options.comms = {"p2p"};
      options.mode = mode;
      options.layers = 3;
      EXPECT_GE(expect_ran_records_right(lmoe::run_tail_bench(options), mode), 8u);
    }
  }
}

TEST(CudaBench, EnvironmentNamesTheGpu) {
  SKIP_WITHOUT_GPU();
  const lmoe::BenchEnvironment environment = lmoe::bench_environment(lmoe::Backend::cuda);
  ASSERT_TRUE(environment.gpu.has_value());
  EXPECT_FALSE(environment.gpu->name.empty());
  EXPECT_GT(environment.gpu->driver_version, 0);
  EXPECT_GT(environment.gpu->runtime_version, 0);
  EXPECT_NE(environment.gpu->compute_capability, "0.0");
}

}  // namespace

// What every GPU test file needs: a clean skip where no GPU is visible, CUDA calls checked, and
// random inputs for the collectives, scoped environment variables, and a check that failed
// constructions leak no memory.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <source_location>
#include <string>
#include <vector>

#include "cuda/tail/cuda_tail_executor.hpp"
#include "lmoe/communicator.hpp"
#include "lmoe/dtype.hpp"
#include "lmoe/error.hpp"
#include "lmoe/reference.hpp"

// Skips the test (with the reason) where no CUDA GPU is visible, as on the CI machine.
#define SKIP_WITHOUT_GPU()                                             \
  do {                                                                 \
    if (lmoe::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU"; \
  } while (0)

// Skips the test (with `why`) where fewer than `gpus` CUDA GPUs are visible, none included.
#define SKIP_WITH_FEWER_GPUS_THAN(gpus, why)                       \
  do {                                                             \
    if (lmoe::cuda_device_count() < (gpus)) GTEST_SKIP() << (why); \
  } while (0)

// Asserts a CUDA call succeeded, naming the caller's line: the failure is reported here.
inline void cuda_ok(cudaError_t status,
                    std::source_location where = std::source_location::current()) {
  ASSERT_EQ(status, cudaSuccess) << cudaGetErrorString(status) << " (" << where.file_name() << ":"
                                 << where.line() << ")";
}

// `count` normal values in `dtype`, from `seed`: sums of them round differently in another order,
// so only the rank-order sum matches bit for bit.
inline std::vector<std::byte> random_values(std::size_t count, lmoe::DType dtype,
                                            std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::byte> bytes(count * lmoe::dtype_size(dtype));
  for (std::size_t i = 0; i < count; ++i)
    lmoe::store_from_float(bytes.data(), i, dtype, normal(rng));
  return bytes;
}
// How many replays a soak runs: the test-only variable `variable` where it is set (a count, to
// lengthen or shorten the soak), else `default_replays`. Test knobs, not lmoe's settings.
inline long soak_replays(const char* variable, long default_replays) {
  const char* value = std::getenv(variable);
  return value ? std::atol(value) : default_replays;
}

// One rank's part of a soak of a captured graph (collective: every rank of `comm` calls it alike).
// `issue` enqueues one replay's work on `stream`: it runs once eagerly (every kernel's first launch
// comes before the capture), is then captured once, and the graph is replayed `replays` times back
// to back. `checkpoint` runs after the eager run, every `check_every` replays and after the last,
// with every rank stopped (its stream synchronized, the ranks met, and met again after it), so it
// may copy synchronously: while a peer on the same GPU spins in a collective, it could not.
inline void soak_captured_replays(lmoe::Communicator& comm, cudaStream_t stream, long replays,
                                  long check_every, const std::function<void()>& issue,
                                  const std::function<void()>& checkpoint) {
  const auto stop_and_check = [&] {
    cuda_ok(cudaStreamSynchronize(stream));
    comm.barrier();
    checkpoint();
    comm.barrier();
  };
  cuda_ok(cudaDeviceSynchronize());
  comm.barrier();
  issue();
  stop_and_check();
  cudaGraph_t captured = nullptr;
  cudaGraphExec_t exec = nullptr;
  cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  issue();
  cuda_ok(cudaStreamEndCapture(stream, &captured));
  comm.barrier();  // every capture has ended before any rank instantiates
  cuda_ok(cudaGraphInstantiate(&exec, captured, 0));
  cuda_ok(cudaGraphUpload(exec, stream));
  cuda_ok(cudaStreamSynchronize(stream));
  comm.barrier();
  for (long i = 1; i <= replays; ++i) {
    cuda_ok(cudaGraphLaunch(exec, stream));
    if (i % check_every == 0 || i == replays) {
      stop_and_check();
    } else if (i % 512 == 0) {
      cuda_ok(cudaStreamSynchronize(stream));  // a bounded queue
    }
  }
  cuda_ok(cudaGraphExecDestroy(exec));
  cuda_ok(cudaGraphDestroy(captured));
}

// An environment variable set (or, with a null value, unset) for one scope, then restored.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* previous = std::getenv(name)) previous_ = previous;
    if (value) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (previous_) {
      setenv(name_, previous_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> previous_;
};

// Every rank's output of `tier` on case `c` (one per rank) holds the same bits, and rank 0's meets
// the tier's contract against the reference.
inline void expect_ranks_alike_within_contract(const std::vector<lmoe::HostTensor>& outputs,
                                               const lmoe::TailCase& c, lmoe::TailTier tier) {
  for (std::size_t r = 1; r < outputs.size(); ++r) {
    EXPECT_EQ(0, std::memcmp(outputs[r].data(), outputs[0].data(), outputs[0].nbytes()))
        << "rank " << r;
  }
  const auto reference = lmoe::reference_tail(c, lmoe::contract_of(tier));
  const lmoe::Comparison cmp = lmoe::compare(outputs[0].matrix(), reference, lmoe::exact_tail(c));
  EXPECT_EQ(cmp.beyond_bound, 0) << "max err/bound " << cmp.max_error_over_bound;
  EXPECT_LE(cmp.normwise_error, cmp.normwise_tolerance);
}

// The process's resident memory in KiB (VmRSS of /proc/self/status): page-locked host memory the
// CUDA driver allocates is resident and counts there.
inline std::int64_t resident_kib() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  }
  ADD_FAILURE() << "no VmRSS line in /proc/self/status";
  return 0;
}

// Bytes of the current GPU's memory in use (by any process: the bound below allows for others).
inline std::int64_t device_bytes_in_use() {
  std::size_t free = 0, total = 0;
  EXPECT_EQ(cudaMemGetInfo(&free, &total), cudaSuccess);
  return static_cast<std::int64_t>(total - free);
}

// `attempt` must throw lmoe::Error after it allocated something (a constructor with bad
// arguments); run `times` times, it must leave the device's memory in use and the process's
// resident memory where they were after a few warm-up attempts (which fill the runtime's and the
// allocator's caches). A leaked page-locked allocation holds at least a page (4 KiB), so `times`
// leaks would add at least times · 4 KiB: the bound allows a quarter of that for the heap's noise.
// The device may gain one page of its allocator (2 MiB), for the runtime's own bookkeeping.
inline void expect_failed_attempts_leak_nothing(const std::string& what, int times,
                                                const std::function<void()>& attempt) {
  SCOPED_TRACE(what);
  int failures = 0;
  const auto attempt_once = [&] {
    try {
      attempt();
    } catch (const lmoe::Error&) {
      ++failures;
    }
    (void)cudaGetLastError();  // an allocation refused by the device leaves its error behind
  };
  for (int i = 0; i < 8; ++i) attempt_once();
  const std::int64_t resident_before = resident_kib(), device_before = device_bytes_in_use();
  for (int i = 0; i < times; ++i) attempt_once();
  const std::int64_t resident_growth = resident_kib() - resident_before;
  const std::int64_t device_growth = device_bytes_in_use() - device_before;
  EXPECT_EQ(failures, times + 8) << "every attempt must fail with an lmoe::Error";
  EXPECT_LT(resident_growth, std::int64_t{times}) << "KiB of resident memory gained over " << times
                                                  << " failed attempts (a leaked page-locked "
                                                     "allocation each would be at least "
                                                  << 4 * times << " KiB)";
  EXPECT_LE(device_growth, std::int64_t{2} << 20)
      << "bytes of device memory gained over " << times << " failed attempts";
}

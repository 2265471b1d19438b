// Shared by the fused tier's GPU tests (test_fused_tail.cpp, test_fused_decode.cpp,
// test_fused_chained.cpp): the dims they use, the fixture that lets p2p ranks share one GPU, a
// call through the runner checked against the CPU contract, one rank's FusedTail driven directly
// (FusedRank), the soak of graph replays with T and inputs changing on the device, and replays
// whose T on the device is past the bound or differs between the ranks.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/host_math.hpp"
#include "cuda/fused/fused_tail.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "cuda/tail/launchers.hpp"
#include "gpu_test_support.hpp"
#include "lmoe/comm_group.hpp"
#include "lmoe/error.hpp"
#include "lmoe/latent_tail.hpp"
#include "lmoe/p2p_communicator.hpp"
#include "lmoe/reference.hpp"
#include "lmoe/threads_communicator.hpp"
#include "lmoe/tools/tail_runner.hpp"
#include "tools/bench_values.hpp"

namespace lmoe_fused_test {

using lmoe::DType;
using lmoe::TailTier;
using lmoe::cuda::DeviceBuffer;

inline const lmoe::TailDims kSmall{
    384, 192};  // d % (8·tp) == 0 for tp ≤ 8 (stripes of 48 … 384 columns)
inline const lmoe::TailDims kK3{7168, 3584};
// Token counts on both sides of every bound of the fused paths (decode ≤ 16, chained ≤ 128,
// general ≤ 256) and of the token classes inside them.
inline const std::int64_t kTokensAroundPathBounds[] = {1, 2, 5, 8, 16, 33, 64, 65, 128, 129, 256};

// The current device's compute capability as 10 · major + minor (the chained path runs on 90 only).
inline int compute_capability() {
  int device = 0, major = 0, minor = 0;
  cuda_ok(cudaGetDevice(&device));
  cuda_ok(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  cuda_ok(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return 10 * major + minor;
}

// The fused kernel sizes its grid so that the blocks of every rank on a GPU are resident at once,
// which ranks spinning on each other need: these tests run p2p ranks on one GPU, opted in for the
// duration of each test only (the library keeps p2p on a shared GPU opt-in, docs/p2p.md, and the
// other tests of this binary see its default).
class ScopedSharedGpu : public ScopedEnv {
 public:
  ScopedSharedGpu() : ScopedEnv("LMOE_P2P_SHARED_GPU", "1") {}
};

class Fused : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { lmoe::cpu::set_blas_threads(4); }
  ScopedSharedGpu shared_gpu_;
};

inline lmoe::CaseRun run_fused(const lmoe::TailCase& c, bool graph = false) {
  lmoe::RunOptions options;
  options.backend = lmoe::Backend::cuda;
  options.comm = "p2p";  // with one rank: no peers, but capturable (cuda-threads is not)
  options.tier = TailTier::fused;
  options.graph = graph;
  options.repeats = graph ? 2 : 1;
  return lmoe::run_case_on_threads(c, options);
}

inline void expect_meets_contract(const lmoe::TailCase& c, const lmoe::CaseRun& result,
                                  double* worst) {
  EXPECT_TRUE(result.ranks_identical);
  ASSERT_EQ(result.tier, TailTier::fused);
  const auto reference = lmoe::reference_tail(c, lmoe::contract_of(TailTier::fused));
  const lmoe::Comparison cmp =
      lmoe::compare(result.ranks[0].y.matrix(), reference, lmoe::exact_tail(c));
  EXPECT_EQ(cmp.beyond_bound, 0) << "max err/bound " << cmp.max_error_over_bound;
  EXPECT_LE(cmp.normwise_error, cmp.normwise_tolerance);
  *worst = std::max(*worst, cmp.max_error_over_bound);
}

// Random inputs within the contract's bound and crafted inputs bit for bit, at one (dims, dtype,
// tp, T).
// A crafted case (lmoe::make_exact_case) through the fused tier: equal on every rank and bit for
// bit the contract's result.
inline void expect_crafted_inputs_match_bit_for_bit(const lmoe::TailCase& exact) {
  const lmoe::CaseRun exact_run = run_fused(exact);
  EXPECT_TRUE(exact_run.ranks_identical);
  const lmoe::Comparison cmp = lmoe::compare(
      exact_run.ranks[0].y.matrix(),
      lmoe::reference_tail(exact, lmoe::contract_of(TailTier::fused)), lmoe::exact_tail(exact));
  EXPECT_EQ(cmp.bit_mismatches, 0);
}

inline void expect_random_and_crafted_inputs_pass(lmoe::TailDims dims, DType dtype, int tp,
                                                  std::int64_t tokens, std::uint64_t seed,
                                                  double* worst) {
  const lmoe::TailCase random = lmoe::make_random_case(dims, 1e-5f, dtype, tp, tokens, seed);
  expect_meets_contract(random, run_fused(random), worst);
  expect_crafted_inputs_match_bit_for_bit(lmoe::make_exact_case(dims, dtype, tp, tokens, seed));
}

// Every rank's error (one per rank, by rank) names `what`.
inline void expect_every_rank_error(const std::vector<std::string>& errors,
                                    const std::string& what) {
  for (std::size_t r = 0; r < errors.size(); ++r)
    EXPECT_NE(errors[r].find(what), std::string::npos) << "rank " << r << ": " << errors[r];
}

// One rank's device state for calling FusedTail directly (below LatentTail: no agreement exchange,
// so a rank can be made to stall on purpose).
struct FusedRank {
  DeviceBuffer w, gamma, routed, shared, out;
  std::unique_ptr<lmoe::cuda::FusedTail> fused;

  FusedRank(lmoe::Communicator& comm, const lmoe::TailCase& c, std::int64_t max_tokens) {
    const int rank = comm.rank();
    // The rank's GPU first (the p2p thread group's placement, rank % GPUs, as run_on_p2p_threads
    // sets it): buffers on another GPU would make this rank's stream-ordered copies cross GPUs.
    int gpus = 0;
    cuda_ok(cudaGetDeviceCount(&gpus));
    cuda_ok(cudaSetDevice(rank % gpus));
    const std::int64_t d = c.dims.d_model, l = c.dims.d_latent, s = d / comm.size(),
                       t = c.num_tokens;
    const std::size_t esize = lmoe::dtype_size(c.dtype);
    w = DeviceBuffer(static_cast<std::size_t>(s * l) * esize);
    cuda_ok(cudaMemcpy(w.data(),
                       c.up_proj_weight.data() + static_cast<std::size_t>(rank * s * l) * esize,
                       w.bytes(), cudaMemcpyHostToDevice));
    std::vector<float> g(static_cast<std::size_t>(l));
    for (std::int64_t j = 0; j < l; ++j) g[static_cast<std::size_t>(j)] = c.norm_weight.get(j);
    gamma = DeviceBuffer(g.size() * sizeof(float));
    cuda_ok(cudaMemcpy(gamma.data(), g.data(), gamma.bytes(), cudaMemcpyHostToDevice));
    routed = DeviceBuffer(static_cast<std::size_t>(max_tokens * l) * esize);
    shared = DeviceBuffer(static_cast<std::size_t>(max_tokens * d) * esize);
    out = DeviceBuffer(static_cast<std::size_t>(max_tokens * d) * esize);
    cuda_ok(cudaMemcpy(routed.data(), c.routed.slice_matrix(rank).data,
                       static_cast<std::size_t>(t * l) * esize, cudaMemcpyHostToDevice));
    cuda_ok(cudaMemcpy(shared.data(), c.shared.slice_matrix(rank).data,
                       static_cast<std::size_t>(t * d) * esize, cudaMemcpyHostToDevice));
    fused = std::make_unique<lmoe::cuda::FusedTail>(
        comm, c.dims, c.dtype, c.latent_norm, c.eps, w.data(),
        static_cast<const float*>(gamma.data()), max_tokens);
  }
};

// Calls issued back to back on one stream (eager, or captured into one graph), each call's routed
// input the previous call's output (d == l), outputs poisoned with NaN; each step checked against
// the contract on the input it had. Kernels that may start before the stream's previous kernel
// ends (launched programmatically: the chained path's, the decode kernel's with one rank) must
// still read what the call before them wrote. One rank; `kernel`: the fused kernel the calls must
// take, where given.
inline void expect_each_call_reads_the_last_output(
    std::int64_t tokens, bool graph, std::uint64_t seed,
    std::optional<lmoe::cuda::FusedKernel> kernel = std::nullopt) {
  SCOPED_TRACE(std::string(graph ? "graph" : "eager") + " T=" + std::to_string(tokens));
  const lmoe::TailDims dims{384, 384};
  constexpr int kSteps = 4;
  const lmoe::TailCase c = lmoe::make_random_case(dims, 1e-5f, DType::bf16, 1, tokens, seed);
  const std::size_t bytes = static_cast<std::size_t>(tokens * dims.d_model) * 2;
  const auto comms = lmoe::make_p2p_thread_communicators(1, {});
  lmoe::run_on_rank_threads(comms, [&](int, lmoe::Communicator& comm) {
    FusedRank state(comm, c, tokens);
    if (kernel) {
      EXPECT_EQ(state.fused->kernel_for(tokens), *kernel);
    }
    std::vector<DeviceBuffer> outs;
    for (int k = 0; k < kSteps; ++k) {
      outs.emplace_back(bytes);
      cuda_ok(cudaMemset(outs.back().data(), 0xff, bytes));  // NaN: a read too early shows
    }
    cudaStream_t stream = nullptr;
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const auto issue = [&] {
      const void* input = state.routed.data();
      for (int k = 0; k < kSteps; ++k) {
        state.fused->run(input, state.shared.data(), outs[k].data(), tokens, stream);
        input = outs[k].data();
      }
    };
    if (graph) {
      cudaGraph_t captured = nullptr;
      cudaGraphExec_t exec = nullptr;
      cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      issue();
      cuda_ok(cudaStreamEndCapture(stream, &captured));
      cuda_ok(cudaGraphInstantiate(&exec, captured, 0));
      cuda_ok(cudaGraphLaunch(exec, stream));
      cuda_ok(cudaStreamSynchronize(stream));
      cuda_ok(cudaGraphExecDestroy(exec));
      cuda_ok(cudaGraphDestroy(captured));
    } else {
      issue();
    }
    cuda_ok(cudaStreamSynchronize(stream));
    cudaStreamDestroy(stream);
    lmoe::TailCase step = c;  // step k's inputs: routed = step k − 1's output
    for (int k = 0; k < kSteps; ++k) {
      SCOPED_TRACE("step " + std::to_string(k));
      lmoe::HostTensor y(DType::bf16, {tokens, dims.d_model});
      cuda_ok(cudaMemcpy(y.data(), outs[k].data(), bytes, cudaMemcpyDeviceToHost));
      const lmoe::Comparison cmp =
          lmoe::compare(y.matrix(), lmoe::reference_tail(step, lmoe::contract_of(TailTier::fused)),
                        lmoe::exact_tail(step));
      EXPECT_EQ(cmp.beyond_bound, 0) << "max err/bound " << cmp.max_error_over_bound;
      std::memcpy(step.routed.data(), y.data(), bytes);
    }
  });
}

// What constructing a FusedTail for `c` (bound max_tokens) on each of tp p2p ranks throws, by rank
// (empty where it did not).
inline std::vector<std::string> construction_errors(const lmoe::TailCase& c, int tp,
                                                    std::int64_t max_tokens) {
  std::vector<std::string> errors(static_cast<std::size_t>(tp));
  const auto comms = lmoe::make_p2p_thread_communicators(tp, {});
  lmoe::run_on_rank_threads(comms, [&](int rank, lmoe::Communicator& comm) {
    try {
      FusedRank state(comm, c, max_tokens);
    } catch (const lmoe::Error& error) {
      errors[static_cast<std::size_t>(rank)] = error.what();
    }
  });
  return errors;
}

// One fused call of up to max_tokens rows with T read from tokens_device, captured on `stream` into
// *graph and instantiated into *exec.
inline void capture_fused_call(FusedRank& state, std::int64_t max_tokens, const void* tokens_device,
                               cudaStream_t stream, cudaGraph_t* graph, cudaGraphExec_t* exec) {
  cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  state.fused->run(state.routed.data(), state.shared.data(), state.out.data(), max_tokens, stream,
                   static_cast<const std::int32_t*>(tokens_device));
  cuda_ok(cudaStreamEndCapture(stream, graph));
  cuda_ok(cudaGraphInstantiate(exec, *graph, 0));
}

inline const char* kernel_name(lmoe::cuda::FusedKernel kernel) {
  return kernel == lmoe::cuda::FusedKernel::decode    ? "decode"
         : kernel == lmoe::cuda::FusedKernel::chained ? "chained"
                                                      : "general";
}

// What one graph replay per rank did where T on the device is bad: each rank's error and output.
struct BadTokensReplay {
  std::vector<std::string> errors;  // by rank; "" where the rank raised none
  std::vector<std::vector<std::byte>>
      outputs;         // by rank: every row of its buffer, after the replay
  double seconds = 0;  // from rank 0's replay to its error: the failure's detection, not a timeout
};

// On tp p2p ranks (a 5 s timeout): one fused call of up to `bound` rows with T read on the device,
// captured into a graph over buffers of `rows` > bound rows (a case of `rows` tokens, so that the
// rows past the bound hold real inputs), replayed once with T = tokens[rank] written on each rank
// and the whole output poisoned (0xff, NaN); then every rank's next call, which raises what the
// replay recorded, before it launches anything. `kernel`: the kernel the bound must choose.
inline BadTokensReplay replay_with_bad_device_tokens(int tp, std::int64_t bound, std::int64_t rows,
                                                     const std::vector<std::int32_t>& tokens,
                                                     lmoe::cuda::FusedKernel kernel) {
  BadTokensReplay result;
  result.errors.resize(static_cast<std::size_t>(tp));
  result.outputs.resize(static_cast<std::size_t>(tp));
  const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, tp, rows,
                                                  700u + static_cast<std::uint64_t>(bound));
  const std::size_t out_bytes = static_cast<std::size_t>(rows * kSmall.d_model) * 2;
  lmoe::P2pOptions options;
  options.timeout = std::chrono::milliseconds(5000);
  const auto comms = lmoe::make_p2p_thread_communicators(tp, options);
  lmoe::run_on_rank_threads(comms, [&](int rank, lmoe::Communicator& comm) {
    FusedRank state(comm, c, rows);
    lmoe::cuda::FusedTail& fused = *state.fused;
    EXPECT_EQ(fused.kernel_for(bound), kernel)
        << fused.decode_limit().value_or("") << fused.chained_limit().value_or("");
    cudaStream_t stream = nullptr;
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    DeviceBuffer tokens_now(sizeof(std::int32_t));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    capture_fused_call(state, bound, tokens_now.data(), stream, &graph, &exec);
    cuda_ok(cudaGraphUpload(exec, stream));
    const std::int32_t mine = tokens[static_cast<std::size_t>(rank)];
    cuda_ok(cudaMemcpy(tokens_now.data(), &mine, sizeof(mine), cudaMemcpyHostToDevice));
    cuda_ok(cudaMemset(state.out.data(), 0xff, out_bytes));
    cuda_ok(cudaDeviceSynchronize());
    comm.barrier();  // every rank's graph is ready before any replays
    const auto start = std::chrono::steady_clock::now();
    cuda_ok(cudaGraphLaunch(exec, stream));
    cuda_ok(cudaStreamSynchronize(stream));
    try {
      fused.run(state.routed.data(), state.shared.data(), state.out.data(), bound, stream);
      cuda_ok(cudaStreamSynchronize(stream));
    } catch (const lmoe::Error& error) {
      result.errors[static_cast<std::size_t>(rank)] = error.message();
    }
    if (rank == 0) {
      result.seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    cuda_ok(cudaDeviceSynchronize());  // every kernel on this GPU has stopped (aborted or done)
    std::vector<std::byte>& out = result.outputs[static_cast<std::size_t>(rank)];
    out.resize(out_bytes);
    cuda_ok(cudaMemcpy(out.data(), state.out.data(), out_bytes, cudaMemcpyDeviceToHost));
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
  });
  return result;
}

// Bytes of `out` from byte `from` on that are not the poison (0xff): written where nothing may be.
inline std::size_t written_from(const std::vector<std::byte>& out, std::size_t from) {
  return static_cast<std::size_t>(
      std::count_if(out.begin() + static_cast<std::ptrdiff_t>(std::min(from, out.size())),
                    out.end(), [](std::byte b) { return b != std::byte{0xff}; }));
}

// A T on the device past the bound of the graph's call (bound + 1, and −1), read by `kernel`: the
// call writes no output anywhere (the rows past the bound hold real inputs a kernel that read
// them would compute), and the next call fails naming T and the bound, within the time an abort
// takes (a few ms), not the 5 s timeout: with one rank, with two both reading it, and with two
// where only rank 1 does (rank 0's call stops on the abort; only rows up to the bound may hold
// its writes).
inline void expect_device_tokens_past_the_bound_fail(lmoe::cuda::FusedKernel kernel,
                                                     std::int64_t bound) {
  const std::int64_t rows = bound + 16;
  const auto tokens_text = [](std::int32_t t) { return "T = " + std::to_string(t); };
  const std::string range = " from tokens_device, outside [0, " + std::to_string(bound) + "]";
  for (const std::int32_t bad : {static_cast<std::int32_t>(bound + 1), std::int32_t{-1}}) {
    for (const int tp : {1, 2}) {
      if (tp > 1 && lmoe::comm_group_limit("p2p", tp)) continue;
      SCOPED_TRACE(std::string(kernel_name(kernel)) + " tp=" + std::to_string(tp) +
                   " bound=" + std::to_string(bound) + " " + tokens_text(bad) + " on every rank");
      const BadTokensReplay every = replay_with_bad_device_tokens(
          tp, bound, rows, std::vector<std::int32_t>(tp, bad), kernel);
      expect_every_rank_error(every.errors, "rank 0 read " + tokens_text(bad) + range);
      for (int r = 0; r < tp; ++r) {
        EXPECT_EQ(written_from(every.outputs[static_cast<std::size_t>(r)], 0), 0u)
            << "bytes of rank " << r << "'s output written by a call that must run no rows";
      }
      EXPECT_LT(every.seconds, 2.5);
    }
    if (lmoe::comm_group_limit("p2p", 2)) continue;
    SCOPED_TRACE(std::string(kernel_name(kernel)) + " tp=2 bound=" + std::to_string(bound) + " " +
                 tokens_text(bad) + " on rank 1 only");
    const BadTokensReplay one = replay_with_bad_device_tokens(
        2, bound, rows, {static_cast<std::int32_t>(bound), bad}, kernel);
    expect_every_rank_error(one.errors, "rank 1 read " + tokens_text(bad) + range);
    const std::size_t row_bytes = static_cast<std::size_t>(kSmall.d_model) * 2;
    EXPECT_EQ(written_from(one.outputs[0], static_cast<std::size_t>(bound) * row_bytes), 0u)
        << "bytes of rank 0's output written past the bound";
    EXPECT_EQ(written_from(one.outputs[1], 0), 0u) << "bytes of rank 1's output written";
    EXPECT_LT(one.seconds, 2.5);
  }
}

// Two ranks whose graph replays read different T (tokens[0] on rank 0, tokens[1] on rank 1, both
// within the bound) in one call of `kernel`: every rank fails, naming both ranks' T, within the
// time an abort takes, not the 5 s timeout; nothing is written past the bound.
inline void expect_different_device_tokens_fail_every_rank(lmoe::cuda::FusedKernel kernel,
                                                           std::int64_t bound,
                                                           std::int32_t rank0_tokens,
                                                           std::int32_t rank1_tokens) {
  if (lmoe::comm_group_limit("p2p", 2)) GTEST_SKIP() << "p2p with 2 ranks cannot run here";
  SCOPED_TRACE(std::string(kernel_name(kernel)) + " bound=" + std::to_string(bound) +
               ": T = " + std::to_string(rank0_tokens) + " on rank 0, " +
               std::to_string(rank1_tokens) + " on rank 1");
  const BadTokensReplay replay =
      replay_with_bad_device_tokens(2, bound, bound + 16, {rank0_tokens, rank1_tokens}, kernel);
  // Each rank records the difference itself; the message is the first rank's record.
  const std::string from_rank0 = "rank 0 ran T = " + std::to_string(rank0_tokens) +
                                 " and rank 1 T = " + std::to_string(rank1_tokens) +
                                 " in the same fused call";
  const std::string from_rank1 = "rank 1 ran T = " + std::to_string(rank1_tokens) +
                                 " and rank 0 T = " + std::to_string(rank0_tokens) +
                                 " in the same fused call";
  for (std::size_t r = 0; r < replay.errors.size(); ++r) {
    const std::string& error = replay.errors[r];
    EXPECT_TRUE(error.find(from_rank0) != std::string::npos ||
                error.find(from_rank1) != std::string::npos)
        << "rank " << r << ": \"" << error << "\"";
    EXPECT_NE(error.find("every rank must run a call with the same T"), std::string::npos)
        << "rank " << r << ": " << error;
  }
  const std::size_t row_bytes = static_cast<std::size_t>(kSmall.d_model) * 2;
  for (std::size_t r = 0; r < replay.outputs.size(); ++r) {
    EXPECT_EQ(written_from(replay.outputs[r], static_cast<std::size_t>(bound) * row_bytes), 0u)
        << "bytes of rank " << r << "'s output written past the bound";
  }
  EXPECT_LT(replay.seconds, 2.5);
}

// The crafted exact case (lmoe::make_exact_case's construction) that a soak's graph derives on the
// device for replay `replay` of a run from `seed` (tools/cuda/replay_soak.hpp): T rows of every
// rank's partials from bench::exact_latent_part and bench::exact_shared_part, and the weights,
// gamma and eps of `weights`.
inline lmoe::TailCase exact_case_of_replay(const lmoe::TailCase& weights, std::uint64_t seed,
                                           std::uint64_t replay, std::int64_t tokens) {
  lmoe::TailCase c = weights;
  const std::int64_t l = c.dims.d_latent, d = c.dims.d_model;
  c.num_tokens = tokens;
  c.routed = lmoe::HostTensor(c.dtype, {c.tp, tokens, l});
  c.shared = lmoe::HostTensor(c.dtype, {c.tp, tokens, d});
  const std::uint64_t run = lmoe::bench::replay_seed(seed, replay);
  for (int r = 0; r < c.tp; ++r) {
    for (std::int64_t i = 0; i < tokens * l; ++i) {
      c.routed.set(r * tokens * l + i,
                   static_cast<float>(lmoe::bench::exact_latent_part(run, c.tp, r, i)));
    }
    for (std::int64_t i = 0; i < tokens * d; ++i)
      c.shared.set(r * tokens * d + i,
                   static_cast<float>(lmoe::bench::exact_shared_part(run, r, i)));
  }
  return c;
}

// Graph replays with T and inputs changing between replays and no host work in the call: the
// kernel reads T on the device. Each replay's output is compared on the device with the eager
// result of the same inputs (itself checked against the contract), so a stale parity, a row left
// over from a longer call or a race in the protocol shows up as a counted mismatch. `kernel`: the
// fused kernel every call must take (the bound decides it: the eager calls pass the graph's bound
// with T on the device too, so that they run the kernel the replays run).
inline void soak_graph_replays(int tp, std::int64_t max_tokens,
                               const std::vector<std::int64_t>& set_tokens,
                               lmoe::cuda::FusedKernel kernel) {
  const long replays = soak_replays("LMOE_FUSED_SOAK_REPLAYS", 100000);
  std::vector<lmoe::TailCase> cases;
  for (std::size_t k = 0; k < set_tokens.size(); ++k) {
    cases.push_back(
        lmoe::make_random_case(kSmall, 1e-5f, DType::bf16, tp, set_tokens[k], 500u + k));
  }
  // Every case uses the weights of the first (the graph holds one FusedTail per rank).
  for (std::size_t k = 1; k < cases.size(); ++k) {
    cases[k].norm_weight = cases[0].norm_weight;
    cases[k].up_proj_weight = cases[0].up_proj_weight;
  }
  std::vector<unsigned long long> mismatches(tp, ~0ull);
  std::vector<long> replayed(tp, 0);
  const auto comms = lmoe::make_p2p_thread_communicators(tp);
  lmoe::run_on_rank_threads(comms, [&](int rank, lmoe::Communicator& comm) {
    const std::size_t esize = 2;
    const std::int64_t d = kSmall.d_model, l = kSmall.d_latent;
    FusedRank state(comm, cases[0], max_tokens);
    EXPECT_EQ(state.fused->kernel_for(max_tokens), kernel)
        << state.fused->decode_limit().value_or("");
    // Per case, on the device: its inputs and the expected output (from an eager call below).
    std::vector<DeviceBuffer> routed, shared, expected;
    std::vector<std::int32_t> tokens_host;
    DeviceBuffer tokens_sets(set_tokens.size() * sizeof(std::int32_t)),
        tokens_now(sizeof(std::int32_t));
    for (std::size_t k = 0; k < cases.size(); ++k) {
      const std::int64_t t = set_tokens[k];
      routed.emplace_back(static_cast<std::size_t>(t * l) * esize);
      shared.emplace_back(static_cast<std::size_t>(t * d) * esize);
      expected.emplace_back(static_cast<std::size_t>(t * d) * esize);
      cuda_ok(cudaMemcpy(routed[k].data(), cases[k].routed.slice_matrix(rank).data,
                         routed[k].bytes(), cudaMemcpyHostToDevice));
      cuda_ok(cudaMemcpy(shared[k].data(), cases[k].shared.slice_matrix(rank).data,
                         shared[k].bytes(), cudaMemcpyHostToDevice));
      tokens_host.push_back(static_cast<std::int32_t>(t));
    }
    cuda_ok(cudaMemcpy(tokens_sets.data(), tokens_host.data(), tokens_sets.bytes(),
                       cudaMemcpyHostToDevice));
    DeviceBuffer counter(sizeof(unsigned long long));
    cuda_ok(cudaMemset(counter.data(), 0, counter.bytes()));
    cudaStream_t stream = nullptr;
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    auto load_case = [&](std::size_t k) {
      const std::int64_t t = set_tokens[k];
      cuda_ok(cudaMemcpyAsync(state.routed.data(), routed[k].data(), routed[k].bytes(),
                              cudaMemcpyDeviceToDevice, stream));
      cuda_ok(cudaMemcpyAsync(state.shared.data(), shared[k].data(), shared[k].bytes(),
                              cudaMemcpyDeviceToDevice, stream));
      cuda_ok(cudaMemcpyAsync(tokens_now.data(), static_cast<std::int32_t*>(tokens_sets.data()) + k,
                              sizeof(std::int32_t), cudaMemcpyDeviceToDevice, stream));
      cuda_ok(
          cudaMemsetAsync(state.out.data(), 0xff, static_cast<std::size_t>(t * d) * esize, stream));
    };
    // The graph: one fused call of up to max_tokens rows, T from tokens_now.
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    capture_fused_call(state, max_tokens, tokens_now.data(), stream, &graph, &exec);
    cuda_ok(cudaGraphUpload(exec, stream));
    cuda_ok(cudaDeviceSynchronize());
    comm.barrier();
    // Eager calls give the expected outputs (checked against the contract on rank 0's thread
    // below).
    for (std::size_t k = 0; k < cases.size(); ++k) {
      load_case(k);
      state.fused->run(state.routed.data(), state.shared.data(), state.out.data(), max_tokens,
                       stream, static_cast<const std::int32_t*>(tokens_now.data()));
      cuda_ok(cudaMemcpyAsync(expected[k].data(), state.out.data(), expected[k].bytes(),
                              cudaMemcpyDeviceToDevice, stream));
    }
    cuda_ok(cudaStreamSynchronize(stream));
    comm.barrier();
    std::mt19937 order(12345);  // the same sequence of cases on every rank
    for (long i = 0; i < replays; ++i) {
      const std::size_t k = order() % cases.size();
      load_case(k);
      cuda_ok(cudaGraphLaunch(exec, stream));
      cuda_ok(lmoe::cuda::launch_count_differences(
          state.out.data(), expected[k].data(), static_cast<std::int64_t>(expected[k].bytes()),
          static_cast<unsigned long long*>(counter.data()), stream));
      if (i % 4096 == 4095) cuda_ok(cudaStreamSynchronize(stream));  // bounded queue
      replayed[static_cast<std::size_t>(rank)] = i + 1;
    }
    cuda_ok(cudaStreamSynchronize(stream));
    comm.barrier();
    cuda_ok(cudaMemcpy(&mismatches[static_cast<std::size_t>(rank)], counter.data(),
                       sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    // The expected outputs themselves against the contract.
    for (std::size_t k = 0; k < cases.size(); ++k) {
      lmoe::HostTensor y(DType::bf16, {set_tokens[k], d});
      cuda_ok(
          cudaMemcpy(y.data(), expected[k].data(), expected[k].bytes(), cudaMemcpyDeviceToHost));
      const lmoe::Comparison cmp = lmoe::compare(
          y.matrix(), lmoe::reference_tail(cases[k], lmoe::contract_of(TailTier::fused)),
          lmoe::exact_tail(cases[k]));
      EXPECT_EQ(cmp.beyond_bound, 0) << "case " << k << " rank " << rank;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
  });
  unsigned long long total = 0;
  for (int r = 0; r < tp; ++r) {
    EXPECT_EQ(replayed[static_cast<std::size_t>(r)], replays);
    EXPECT_EQ(mismatches[static_cast<std::size_t>(r)], 0ull) << "rank " << r;
    total += mismatches[static_cast<std::size_t>(r)];
  }
  std::string tokens_list;
  for (std::int64_t t : set_tokens)
    tokens_list += (tokens_list.empty() ? "" : ", ") + std::to_string(t);
  std::printf(
      "[ fused  ] soak: %ld graph replays per rank, tp=%d (%s kernel), T in {%s}: %llu mismatched "
      "bytes\n",
      replays, tp, kernel_name(kernel), tokens_list.c_str(), total);
}

}  // namespace lmoe_fused_test

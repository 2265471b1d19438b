// One CUDA graph per tail, replayed with any T ≤ max_tokens (LatentTail::forward_device_tokens,
// docs/graphs.md): every tier × comm (p2p, nccl; cuda-threads cannot be captured) captured once,
// then replayed with T in a shuffled order on fresh inputs and poisoned outputs. Each replay is
// judged against the CPU contract, its rows < T bit for bit against an eager forward at its
// bucket's size and its whole output against the eager forward_device_tokens; rows from the
// bucket's end on must keep their poison. T = 0 runs nothing; T outside [0, max_tokens], or in a
// bucket no tier runs, runs nothing and is reported to the host. Every test skips where no GPU is
// visible.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "core/host_math.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "cuda/runtime/owned_stream.hpp"
#include "cuda/tail/launchers.hpp"
#include "gpu_test_support.hpp"
#include "lmoe/comm_group.hpp"
#include "lmoe/error.hpp"
#include "lmoe/latent_tail.hpp"
#include "lmoe/reference.hpp"
#include "lmoe/tools/tail_bench.hpp"
#ifdef LMOE_HAS_NCCL
#include "cuda/comm/nccl_settings.hpp"
#endif

namespace {

using lmoe::DType;
using lmoe::TailTier;
using lmoe::cuda::DeviceBuffer;

const lmoe::TailDims kSmall{384, 192};
constexpr std::int64_t kMaxTokens = 200;
constexpr DType kDtype = DType::bf16;
const std::vector<std::int64_t> kTokens = {1, 2, 5, 16, 17, 64, 127, 128, 129, kMaxTokens};

std::string tier_label(std::optional<TailTier> tier) {
  return tier ? std::string(lmoe::tier_name(*tier)) : "policy";
}

void capture_ok(cudaError_t status, cudaStream_t stream) {
  if (status == cudaSuccess) return;
  cudaGraph_t dropped = nullptr;
  cudaStreamEndCapture(stream, &dropped);
  if (dropped) cudaGraphDestroy(dropped);
  FAIL() << cudaGetErrorString(status);
}

// What one rank saw; the host judges it after every rank has finished.
struct RankResults {
  std::vector<lmoe::DeviceTokenBucket> buckets;
  std::vector<lmoe::HostTensor> replayed;  // per case: out [M, d] after the graph's replay
  std::vector<lmoe::HostTensor>
      eager_device;  // per case: out [M, d] after an eager forward_device_tokens
  std::vector<lmoe::HostTensor>
      eager_bucket;                        // per case: out [B, d] of forward at the bucket's size
  std::vector<std::string> eager_errors;   // per case: what the eager forward_device_tokens threw
  std::vector<std::string> replay_errors;  // per case: check_device_tokens after its replay
  std::string capture_error;
  unsigned long long soak_differences =
      0;  // bytes where a soak replay differed from its case's first replay
};

const lmoe::DeviceTokenBucket& bucket_of(const std::vector<lmoe::DeviceTokenBucket>& buckets,
                                         std::int64_t tokens) {
  return *std::find_if(buckets.begin(), buckets.end(),
                       [&](const auto& b) { return tokens <= b.max_tokens; });
}

// Every case's inputs staged on the device before any collective (a pageable copy while a peer
// spins can stall it, docs/p2p.md): per entry of `tokens`, rank `rank`'s routed and shared rows
// and T itself.
struct StagedInputs {
  std::vector<DeviceBuffer> routed, shared, tokens;
};

StagedInputs stage_inputs(const std::vector<lmoe::TailCase>& cases,
                          const std::vector<std::int64_t>& tokens, int rank) {
  const std::int64_t d = kSmall.d_model, l = kSmall.d_latent, M = kMaxTokens;
  const std::size_t esize = lmoe::dtype_size(kDtype);
  StagedInputs staged;
  std::vector<DeviceBuffer>& stage_routed = staged.routed;
  std::vector<DeviceBuffer>& stage_shared = staged.shared;
  std::vector<DeviceBuffer>& stage_tokens = staged.tokens;
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    const std::int64_t t = std::clamp<std::int64_t>(tokens[i], 0, M);
    stage_routed.emplace_back(static_cast<std::size_t>(std::max<std::int64_t>(t, 1) * l) * esize);
    stage_shared.emplace_back(static_cast<std::size_t>(std::max<std::int64_t>(t, 1) * d) * esize);
    stage_tokens.emplace_back(sizeof(std::int32_t));
    const auto value = static_cast<std::int32_t>(tokens[i]);
    cuda_ok(cudaMemcpy(stage_tokens.back().data(), &value, sizeof(value), cudaMemcpyHostToDevice));
    if (t > 0 && i < cases.size()) {
      cuda_ok(cudaMemcpy(stage_routed.back().data(), cases[i].routed.slice_matrix(rank).data,
                         static_cast<std::size_t>(t * l) * esize, cudaMemcpyHostToDevice));
      cuda_ok(cudaMemcpy(stage_shared.back().data(), cases[i].shared.slice_matrix(rank).data,
                         static_cast<std::size_t>(t * d) * esize, cudaMemcpyHostToDevice));
    }
  }
  return staged;
}

// forward_device_tokens captured into a graph on `stream`, uploaded; null with
// mine.capture_error set where the capture is refused.
cudaGraphExec_t capture_device_tokens(lmoe::LatentTail& tail, lmoe::ConstMatrixView routed_view,
                                      lmoe::MatrixView shared_view, lmoe::MatrixView out_view,
                                      const std::int32_t* tokens_ptr, std::optional<TailTier> tier,
                                      cudaStream_t stream, RankResults& mine) {
  cudaGraphExec_t exec = nullptr;
  {
    cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      tail.forward_device_tokens(routed_view, shared_view, out_view, tokens_ptr, tier, stream);
    } catch (const lmoe::Error& error) {
      cudaGraph_t dropped = nullptr;
      cudaStreamEndCapture(stream, &dropped);
      if (dropped) cudaGraphDestroy(dropped);
      cudaGetLastError();
      mine.capture_error = error.message();
      return nullptr;
    }
    cudaGraph_t graph = nullptr;
    capture_ok(cudaStreamEndCapture(stream, &graph), stream);
    const cudaError_t instantiated = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    cuda_ok(instantiated);
    cuda_ok(cudaGraphUpload(exec, stream));
  }
  return exec;
}

// Many replays, their T drawn at random (the same draws on every rank): a body's state must not
// leak into the next replay, whichever bucket ran before.
// Each replay is compared on the device with its case's first one: returns the bytes that differed.
unsigned long long soak_replays(cudaGraphExec_t exec, const std::vector<lmoe::TailCase>& cases,
                                const std::vector<std::int64_t>& tokens, const RankResults& mine,
                                int soak, const std::function<void(std::size_t)>& stage,
                                const DeviceBuffer& out, const std::vector<DeviceBuffer>& replayed,
                                cudaStream_t stream) {
  const std::int64_t M = kMaxTokens;
  std::vector<std::size_t> runnable;
  for (std::size_t i = 0; i < cases.size(); ++i) {
    if (tokens[i] >= 1 && tokens[i] <= M && mine.replay_errors[i].empty()) runnable.push_back(i);
  }
  const DeviceBuffer differences(sizeof(unsigned long long));
  cuda_ok(cudaMemset(differences.data(), 0, differences.bytes()));
  std::mt19937 draw(99);
  for (int k = 0; k < soak && !runnable.empty(); ++k) {
    const std::size_t i =
        runnable[std::uniform_int_distribution<std::size_t>(0, runnable.size() - 1)(draw)];
    stage(i);
    cuda_ok(cudaGraphLaunch(exec, stream));
    cuda_ok(lmoe::cuda::launch_count_differences(
        out.data(), replayed[i].data(), static_cast<std::int64_t>(out.bytes()),
        static_cast<unsigned long long*>(differences.data()), stream));
  }
  cuda_ok(cudaStreamSynchronize(stream));
  unsigned long long soak_differences = 0;
  cuda_ok(cudaMemcpy(&soak_differences, differences.data(), sizeof(unsigned long long),
                     cudaMemcpyDeviceToHost));
  return soak_differences;
}

// Captures forward_device_tokens once per rank and replays it for every T of `cases` (in order),
// then `soak` more times with cases drawn at random (each compared on the device with its first
// replay), then runs the eager references on the same inputs. `tokens` may hold T outside [0, M]:
// no case data.
std::vector<RankResults> run_device_tokens(const std::string& comm_name, int tp,
                                           std::optional<TailTier> tier,
                                           const std::vector<lmoe::TailCase>& cases,
                                           const std::vector<std::int64_t>& tokens, int soak) {
  const std::int64_t d = kSmall.d_model, l = kSmall.d_latent, M = kMaxTokens;
  const std::size_t esize = lmoe::dtype_size(kDtype);
  std::vector<RankResults> results(static_cast<std::size_t>(tp));
  lmoe::run_comm_group(comm_name, tp, [&](int rank, lmoe::Communicator& comm) {
    RankResults& mine = results[static_cast<std::size_t>(rank)];
    lmoe::TailOptions options;
    options.dims = kSmall;
    options.dtype = kDtype;
    options.rms_norm_eps = cases[0].eps;
    options.backend = lmoe::Backend::cuda;
    options.max_tokens = M;
    lmoe::LatentTail tail(options, comm, cases[0].norm_weight.matrix(),
                          cases[0].up_proj_weight.matrix());
    mine.buckets = tail.device_token_buckets(tier);

    const DeviceBuffer routed(static_cast<std::size_t>(M * l) * esize),
        shared(static_cast<std::size_t>(M * d) * esize),
        out(static_cast<std::size_t>(M * d) * esize), tokens_device(sizeof(std::int32_t));
    const lmoe::ConstMatrixView routed_view{
        routed.data(), kDtype, M, l, l, lmoe::MemorySpace::device};
    const lmoe::MatrixView shared_view{shared.data(), kDtype, M, d, d, lmoe::MemorySpace::device};
    const lmoe::MatrixView out_view{out.data(), kDtype, M, d, d, lmoe::MemorySpace::device};
    const lmoe::cuda::OwnedStream stream;

    const StagedInputs staged = stage_inputs(cases, tokens, rank);
    const std::vector<DeviceBuffer>& stage_routed = staged.routed;
    const std::vector<DeviceBuffer>& stage_shared = staged.shared;
    const std::vector<DeviceBuffer>& stage_tokens = staged.tokens;
    std::vector<DeviceBuffer> replayed, eager_device;
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      replayed.emplace_back(out.bytes());
      eager_device.emplace_back(out.bytes());
    }
    // Case i's inputs in rows < T, NaN (all bits set) in every other row, out poisoned, T in place.
    const auto stage = [&](std::size_t i) {
      const std::int64_t t = std::clamp<std::int64_t>(tokens[i], 0, M);
      cuda_ok(cudaMemsetAsync(routed.data(), 0xff, routed.bytes(), stream.get()));
      cuda_ok(cudaMemsetAsync(shared.data(), 0xff, shared.bytes(), stream.get()));
      cuda_ok(cudaMemsetAsync(out.data(), 0xff, out.bytes(), stream.get()));
      if (t > 0 && i < cases.size()) {
        cuda_ok(cudaMemcpyAsync(routed.data(), stage_routed[i].data(),
                                static_cast<std::size_t>(t * l) * esize, cudaMemcpyDeviceToDevice,
                                stream.get()));
        cuda_ok(cudaMemcpyAsync(shared.data(), stage_shared[i].data(),
                                static_cast<std::size_t>(t * d) * esize, cudaMemcpyDeviceToDevice,
                                stream.get()));
      }
      cuda_ok(cudaMemcpyAsync(tokens_device.data(), stage_tokens[i].data(), sizeof(std::int32_t),
                              cudaMemcpyDeviceToDevice, stream.get()));
      // Every rank's staging is done before any rank's collectives spin (docs/p2p.md).
      cuda_ok(cudaStreamSynchronize(stream.get()));
      comm.barrier();
    };
    const auto tokens_ptr = static_cast<const std::int32_t*>(tokens_device.data());

    // The eager call before capture (it runs every bucket's GEMMs once), at T = M on zeros.
    cuda_ok(cudaMemsetAsync(routed.data(), 0, routed.bytes(), stream.get()));
    cuda_ok(cudaMemsetAsync(shared.data(), 0, shared.bytes(), stream.get()));
    const auto max_value = static_cast<std::int32_t>(M);
    cuda_ok(
        cudaMemcpy(tokens_device.data(), &max_value, sizeof(max_value), cudaMemcpyHostToDevice));
    cuda_ok(cudaDeviceSynchronize());
    comm.barrier();
    try {
      tail.forward_device_tokens(routed_view, shared_view, out_view, tokens_ptr, tier,
                                 stream.get());
    } catch (const lmoe::Error& error) {
      mine.capture_error = error.message();  // every rank alike (the ranks agreed first)
      return;
    }
    cuda_ok(cudaStreamSynchronize(stream.get()));
    comm.barrier();

    const cudaGraphExec_t exec = capture_device_tokens(tail, routed_view, shared_view, out_view,
                                                       tokens_ptr, tier, stream.get(), mine);
    if (!exec) return;
    cuda_ok(cudaStreamSynchronize(stream.get()));
    comm.barrier();
    cuda_ok(cudaDeviceSynchronize());
    comm.barrier();

    mine.replay_errors.resize(tokens.size());
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      stage(i);
      cuda_ok(cudaGraphLaunch(exec, stream.get()));
      cuda_ok(cudaMemcpyAsync(replayed[i].data(), out.data(), out.bytes(), cudaMemcpyDeviceToDevice,
                              stream.get()));
      cuda_ok(cudaStreamSynchronize(stream.get()));
      try {
        tail.check_device_tokens();
      } catch (const lmoe::Error& error) {
        mine.replay_errors[i] = error.message();
      }
    }
    comm.barrier();

    mine.soak_differences =
        soak_replays(exec, cases, tokens, mine, soak, stage, out, replayed, stream.get());
    comm.barrier();

    // The eager references on the same inputs: forward_device_tokens (the whole output), and
    // forward at the bucket's size with its tier (rows < T).
    mine.eager_errors.resize(tokens.size());
    mine.eager_bucket.resize(tokens.size());
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      stage(i);
      try {
        tail.forward_device_tokens(routed_view, shared_view, out_view, tokens_ptr, tier,
                                   stream.get());
      } catch (const lmoe::Error& error) {
        mine.eager_errors[i] = error.message();
      }
      cuda_ok(cudaMemcpyAsync(eager_device[i].data(), out.data(), out.bytes(),
                              cudaMemcpyDeviceToDevice, stream.get()));
      cuda_ok(cudaStreamSynchronize(stream.get()));
      comm.barrier();
      const std::int64_t t = tokens[i];
      if (t < 1 || t > M) continue;
      const lmoe::DeviceTokenBucket& bucket = bucket_of(mine.buckets, t);
      if (!bucket.tier) continue;
      stage(i);
      const std::int64_t rows = bucket.max_tokens;
      lmoe::ConstMatrixView r = routed_view;
      lmoe::MatrixView s = shared_view, o = out_view;
      r.rows = s.rows = o.rows = rows;
      tail.forward(r, s, o, bucket.tier, stream.get());
      mine.eager_bucket[i] = lmoe::HostTensor(kDtype, {rows, d});
      cuda_ok(cudaMemcpyAsync(mine.eager_bucket[i].data(), out.data(),
                              mine.eager_bucket[i].nbytes(), cudaMemcpyDeviceToHost, stream.get()));
      cuda_ok(cudaStreamSynchronize(stream.get()));
      comm.barrier();
    }
    cuda_ok(cudaDeviceSynchronize());
    comm.barrier();
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      mine.replayed.emplace_back(kDtype, std::vector<std::int64_t>{M, d});
      mine.eager_device.emplace_back(kDtype, std::vector<std::int64_t>{M, d});
      cuda_ok(cudaMemcpy(mine.replayed.back().data(), replayed[i].data(), out.bytes(),
                         cudaMemcpyDeviceToHost));
      cuda_ok(cudaMemcpy(mine.eager_device.back().data(), eager_device[i].data(), out.bytes(),
                         cudaMemcpyDeviceToHost));
    }
    cuda_ok(cudaGraphExecDestroy(exec));
  });
  return results;
}

bool all_poison(const std::byte* bytes, std::size_t count) {
  return std::all_of(bytes, bytes + count, [](std::byte b) { return b == std::byte{0xff}; });
}

struct DeviceTokensParam {
  std::string comm;
  int tp;
  std::optional<TailTier> tier;  // nullopt: the policy's choice per bucket
};

void PrintTo(const DeviceTokensParam& param, std::ostream* os) {
  *os << param.comm << " tp=" << param.tp << " tier=" << tier_label(param.tier);
}

class DeviceTokens : public ::testing::TestWithParam<DeviceTokensParam> {
 protected:
  static void SetUpTestSuite() { lmoe::cpu::set_blas_threads(4); }
  // p2p ranks may share the GPU here (docs/p2p.md); NCCL leaves event nodes out of its captures,
  // which conditional bodies need (read when NCCL initializes: this test's own communicators).
  ScopedEnv shared_gpu_{"LMOE_P2P_SHARED_GPU", "1"};
  ScopedEnv nccl_mixing_{"NCCL_GRAPH_MIXING_SUPPORT", "0"};
};

TEST_P(DeviceTokens, OneGraphServesEveryT) {
  SKIP_WITHOUT_GPU();
  const auto& [comm, tp, tier] = GetParam();
  if (auto limit = lmoe::comm_group_limit(comm, tp)) GTEST_SKIP() << *limit;
#ifdef LMOE_HAS_NCCL
  // NCCL reads NCCL_GRAPH_MIXING_SUPPORT once per process: when an earlier test of this process
  // started NCCL with it at 1, the collective tiers are declined here (DeviceTokensNccl checks
  // that).
  if (const auto mixing = lmoe::nccl_graph_mixing_in_effect();
      comm == "nccl" && tp > 1 && mixing && *mixing != "0") {
    GTEST_SKIP() << "NCCL in this process read NCCL_GRAPH_MIXING_SUPPORT=" << *mixing
                 << " at its first communicator; run this test in a process of its own "
                    "(gpu_check's graphs stage)";
  }
#endif
  const std::int64_t d = kSmall.d_model, M = kMaxTokens;
  const std::size_t esize = lmoe::dtype_size(kDtype);

  // Cases in a shuffled order (the same on every rank), then T that run nothing.
  std::vector<std::int64_t> order = kTokens;
  std::shuffle(order.begin(), order.end(), std::mt19937(2026));
  std::vector<lmoe::TailCase> cases;
  for (std::int64_t t : order) {
    cases.push_back(lmoe::make_random_case(kSmall, 1e-5f, kDtype, tp, t,
                                           7000u + static_cast<std::uint64_t>(t)));
    cases.back().norm_weight = cases.front().norm_weight;  // one tail, one set of weights
    cases.back().up_proj_weight = cases.front().up_proj_weight;
  }
  std::vector<std::int64_t> tokens = order;
  for (std::int64_t t : {std::int64_t{0}, M + 1, std::int64_t{-1}}) tokens.push_back(t);

  const int soak =
      tier ? 0 : 100;  // the policy's graph (every tier in one) replayed 100 more times
  const std::vector<RankResults> ranks = run_device_tokens(comm, tp, tier, cases, tokens, soak);
  const RankResults& first = ranks[0];
  const auto& buckets = first.buckets;
  const bool none_runs = std::none_of(buckets.begin(), buckets.end(),
                                      [](const auto& b) { return b.tier.has_value(); });
  if (none_runs) {
    // e.g. fused over NCCL with tp > 1: refused on every rank with the reason, before any capture.
    for (const RankResults& r : ranks) {
      EXPECT_NE(r.capture_error.find("no tier can run any T"), std::string::npos)
          << r.capture_error;
    }
    return;
  }
  for (const RankResults& r : ranks) {
    ASSERT_EQ(r.capture_error, "") << "rank " << (&r - ranks.data());
    EXPECT_EQ(r.soak_differences, 0u)
        << "rank " << (&r - ranks.data()) << ": a soak replay differs from its first";
  }

  for (std::size_t i = 0; i < tokens.size(); ++i) {
    const std::int64_t t = tokens[i];
    SCOPED_TRACE(tier_label(tier) + " T=" + std::to_string(t));
    const std::size_t row_bytes = static_cast<std::size_t>(d) * esize;
    const std::optional<TailTier> ran =
        t >= 1 && t <= M ? bucket_of(buckets, t).tier : std::nullopt;
    if (!ran) {
      // Nothing ran: out keeps its poison on every rank; T outside [0, M] or without a tier is
      // reported to the host after the replay and thrown by the eager call; T = 0 is no error.
      for (const RankResults& r : ranks) {
        EXPECT_TRUE(all_poison(r.replayed[i].data(), r.replayed[i].nbytes()));
        EXPECT_TRUE(all_poison(r.eager_device[i].data(), r.eager_device[i].nbytes()));
        if (t == 0) {
          EXPECT_EQ(r.replay_errors[i], "");
          EXPECT_EQ(r.eager_errors[i], "");
        } else {
          EXPECT_NE(r.replay_errors[i].find("read T=" + std::to_string(t)), std::string::npos)
              << r.replay_errors[i];
          EXPECT_NE(r.replay_errors[i].find("it ran nothing"), std::string::npos)
              << r.replay_errors[i];
          EXPECT_NE(r.eager_errors[i].find("T=" + std::to_string(t)), std::string::npos)
              << r.eager_errors[i];
        }
      }
      if (t > M) {
        EXPECT_NE(first.replay_errors[i].find("outside [0, max_tokens=200]"), std::string::npos);
      }
      continue;
    }
    const std::int64_t rows = bucket_of(buckets, t).max_tokens;
    for (const RankResults& r : ranks) {
      const std::size_t rank = static_cast<std::size_t>(&r - ranks.data());
      EXPECT_EQ(r.replay_errors[i], "") << "rank " << rank;
      EXPECT_EQ(r.eager_errors[i], "") << "rank " << rank;
      // Rows < T: every rank alike, and the eager forward at the bucket's size bit for bit.
      EXPECT_EQ(0, std::memcmp(r.replayed[i].data(), first.replayed[i].data(),
                               static_cast<std::size_t>(t) * row_bytes))
          << "rank " << rank;
      EXPECT_EQ(0, std::memcmp(r.replayed[i].data(), r.eager_bucket[i].data(),
                               static_cast<std::size_t>(t) * row_bytes))
          << "rank " << rank << ": replay against forward at T=" << rows;
      // The eager forward_device_tokens does what the replay does, to the bit, in every row.
      EXPECT_EQ(0,
                std::memcmp(r.replayed[i].data(), r.eager_device[i].data(), r.replayed[i].nbytes()))
          << "rank " << rank << ": replay against the eager forward_device_tokens";
      // Rows from the bucket's end on are not touched.
      EXPECT_TRUE(all_poison(r.replayed[i].data() + static_cast<std::size_t>(rows) * row_bytes,
                             static_cast<std::size_t>(M - rows) * row_bytes))
          << "rank " << rank << ": rows >= " << rows << " were written";
    }
    const lmoe::TailCase& c = cases[i];
    const auto reference =
        lmoe::reference_tail(c, lmoe::contract_of(*ran), lmoe::comm_reduction_order(comm));
    lmoe::ConstMatrixView y = first.replayed[i].matrix();
    y.rows = t;
    const lmoe::Comparison cmp = lmoe::compare(y, reference, lmoe::exact_tail(c));
    EXPECT_EQ(cmp.beyond_bound, 0) << "max err/bound " << cmp.max_error_over_bound;
    EXPECT_LE(cmp.normwise_error, cmp.normwise_tolerance);
    if (tier) {
      EXPECT_EQ(*ran, *tier);
    }
  }
}

std::vector<DeviceTokensParam> device_tokens_params() {
  std::vector<DeviceTokensParam> params;
  for (const char* comm : {"p2p", "nccl"}) {
    for (int tp : {1, 2}) {
      for (std::optional<TailTier> tier :
           {std::optional<TailTier>{}, std::optional{TailTier::overlap},
            std::optional{TailTier::column}, std::optional{TailTier::token},
            std::optional{TailTier::fused}}) {
        params.push_back({comm, tp, tier});
      }
    }
  }
  return params;
}

INSTANTIATE_TEST_SUITE_P(CommTpTier, DeviceTokens, ::testing::ValuesIn(device_tokens_params()),
                         [](const auto& info) {
                           return info.param.comm + "_tp" + std::to_string(info.param.tp) + "_" +
                                  tier_label(info.param.tier);
                         });

// Over NCCL with tp > 1, the collective tiers run for T read on the device exactly when NCCL read
// NCCL_GRAPH_MIXING_SUPPORT=0 at the process's first communicator (else its captured collectives
// carry event nodes, which conditional bodies cannot hold, and every bucket is declined naming the
// variable). NCCL reads it once per process, so which case this run sees depends on the tests
// before it; both are checked against the value recorded (the refusal's text: NcclSettings, a CPU
// test).
#ifdef LMOE_HAS_NCCL
TEST(DeviceTokensNccl, TheCollectiveTiersFollowTheMixingSupportNcclRead) {
  SKIP_WITHOUT_GPU();
  if (auto limit = lmoe::comm_group_limit("nccl", 2)) GTEST_SKIP() << *limit;
  ScopedEnv zero("NCCL_GRAPH_MIXING_SUPPORT",
                 "0");  // what NCCL reads if this is its first start here
  const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, kDtype, 2, 4, 5u);
  std::vector<std::vector<lmoe::DeviceTokenBucket>> buckets(2);
  lmoe::run_comm_group("nccl", 2, [&](int rank, lmoe::Communicator& comm) {
    lmoe::TailOptions options;
    options.dims = kSmall;
    options.backend = lmoe::Backend::cuda;
    options.max_tokens = 16;
    lmoe::LatentTail tail(options, comm, c.norm_weight.matrix(), c.up_proj_weight.matrix());
    buckets[static_cast<std::size_t>(rank)] = tail.device_token_buckets(TailTier::overlap);
  });
  const std::optional<std::string> mixing = lmoe::nccl_graph_mixing_in_effect();
  ASSERT_TRUE(mixing.has_value())
      << "NCCL communicators were created, so the value NCCL read is recorded";
  std::printf("[ nccl   ] NCCL read NCCL_GRAPH_MIXING_SUPPORT=%s in this process\n",
              mixing->c_str());
  for (const auto& rank_buckets : buckets) {
    ASSERT_FALSE(rank_buckets.empty());
    for (const lmoe::DeviceTokenBucket& bucket : rank_buckets) {
      if (*mixing == "0") {
        EXPECT_TRUE(bucket.tier.has_value()) << bucket.reason;
      } else {
        EXPECT_FALSE(bucket.tier.has_value());
        EXPECT_NE(bucket.reason.find("NCCL_GRAPH_MIXING_SUPPORT=" + *mixing), std::string::npos)
            << bucket.reason;
      }
    }
  }
}
#endif

// The entry point's own refusals, on one rank: a tail without max_tokens, views of another row
// count, a null T, T beyond max_tokens read eagerly, and a capture of GEMM buckets before any eager
// call; and a capture of fused buckets, which needs none.
TEST(DeviceTokensRefusals, NameTheArgumentAndTheExpectedValue) {
  SKIP_WITHOUT_GPU();
  ScopedEnv shared_gpu("LMOE_P2P_SHARED_GPU", "1");
  const lmoe::TailCase c = lmoe::make_random_case(kSmall, 1e-5f, kDtype, 1, 4, 9u);
  lmoe::run_comm_group("p2p", 1, [&](int, lmoe::Communicator& comm) {
    const std::int64_t d = kSmall.d_model, l = kSmall.d_latent;
    const DeviceBuffer routed(static_cast<std::size_t>(16 * l) * 2),
        shared(static_cast<std::size_t>(16 * d) * 2), tokens(sizeof(std::int32_t));
    const lmoe::ConstMatrixView routed_view{
        routed.data(), kDtype, 16, l, l, lmoe::MemorySpace::device};
    const lmoe::MatrixView shared_view{shared.data(), kDtype, 16, d, d, lmoe::MemorySpace::device};
    const auto tokens_ptr = static_cast<const std::int32_t*>(tokens.data());
    const auto message = [&](lmoe::LatentTail& tail, lmoe::ConstMatrixView r, lmoe::MatrixView s,
                             const std::int32_t* t, cudaStream_t stream = nullptr,
                             std::optional<TailTier> tier = std::nullopt) -> std::string {
      try {
        tail.forward_device_tokens(r, s, s, t, tier, stream);
      } catch (const lmoe::Error& error) {
        return error.message();
      }
      return "";
    };
    lmoe::TailOptions options;
    options.dims = kSmall;
    options.backend = lmoe::Backend::cuda;
    {
      lmoe::LatentTail growing(options, comm, c.norm_weight.matrix(), c.up_proj_weight.matrix());
      EXPECT_EQ(
          message(growing, routed_view, shared_view, tokens_ptr),
          "forward_device_tokens needs TailOptions::max_tokens > 0 (the rows of its views), got 0");
    }
    options.max_tokens = 16;
    lmoe::LatentTail tail(options, comm, c.norm_weight.matrix(), c.up_proj_weight.matrix());
    EXPECT_EQ(message(tail, routed_view, shared_view, nullptr),
              "tokens_device: expected a device pointer to T (int32), got null");
    lmoe::ConstMatrixView short_routed = routed_view;
    lmoe::MatrixView short_shared = shared_view;
    short_routed.rows = short_shared.rows = 8;
    EXPECT_EQ(message(tail, short_routed, short_shared, tokens_ptr),
              "routed: expected max_tokens=16 rows (T is read on the device), got 8 rows");
    // T outside [0, 16] read eagerly: an error, nothing run.
    const std::int32_t too_many = 17;
    cuda_ok(cudaMemcpy(tokens.data(), &too_many, sizeof(too_many), cudaMemcpyHostToDevice));
    EXPECT_EQ(message(tail, routed_view, shared_view, tokens_ptr),
              "T=17 read from tokens_device is outside [0, max_tokens=16]");
    // A capture before any eager call cannot run the GEMMs' first launches: refused by name
    // (overlap forced; fused, below, has no GEMM).
    const lmoe::cuda::OwnedStream stream;
    cuda_ok(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
    const std::string captured =
        message(tail, routed_view, shared_view, tokens_ptr, stream.get(), TailTier::overlap);
    cudaGraph_t dropped = nullptr;
    cudaStreamEndCapture(stream.get(), &dropped);
    if (dropped) cudaGraphDestroy(dropped);
    cudaGetLastError();
    EXPECT_NE(captured.find("has not run outside capture"), std::string::npos) << captured;
    // Fused (no GEMM; forced, whatever the policy picks at tp 1) needs no eager call first:
    // captured, instantiated and replayed with T = 5 on zeros, rows < 5 come out zero and the fused
    // kernel (which reads T itself) leaves rows >= 5 as they were.
    cuda_ok(cudaMemset(routed.data(), 0, routed.bytes()));
    cuda_ok(cudaMemset(shared.data(), 0, shared.bytes()));
    const lmoe::cuda::DeviceBuffer out(shared.bytes());
    cuda_ok(cudaMemset(out.data(), 0xff, out.bytes()));
    const std::int32_t five = 5;
    cuda_ok(cudaMemcpy(tokens.data(), &five, sizeof(five), cudaMemcpyHostToDevice));
    const lmoe::MatrixView out_view{out.data(), kDtype, 16, d, d, lmoe::MemorySpace::device};
    cuda_ok(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
    std::string fused_captured;
    try {
      tail.forward_device_tokens(routed_view, shared_view, out_view, tokens_ptr, TailTier::fused,
                                 stream.get());
    } catch (const lmoe::Error& error) {
      fused_captured = error.message();
    }
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(stream.get(), &graph);
    ASSERT_EQ(fused_captured, "");
    cuda_ok(ended);
    cudaGraphExec_t exec = nullptr;
    const cudaError_t instantiated = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    cuda_ok(instantiated);
    cuda_ok(cudaGraphLaunch(exec, stream.get()));
    cuda_ok(cudaStreamSynchronize(stream.get()));
    cuda_ok(cudaGraphExecDestroy(exec));
    EXPECT_NO_THROW(tail.check_device_tokens());
    std::vector<std::uint16_t> y(static_cast<std::size_t>(16 * d));
    cuda_ok(cudaMemcpy(y.data(), out.data(), out.bytes(), cudaMemcpyDeviceToHost));
    for (std::size_t i = 0; i < y.size(); ++i) {
      if (i < static_cast<std::size_t>(5 * d)) {
        ASSERT_EQ(y[i] & 0x7fff, 0) << "element " << i << " of a row < T";
      } else {
        ASSERT_EQ(y[i], 0xffff) << "element " << i << " of a row >= T was written";
      }
    }
  });
}

// `lmoe bench --mode device-tokens`: each tier captured once and replayed for every T of the sweep,
// every checked output within the contract; with a fault injected the same sweep must fail.
TEST(DeviceTokensBench, OneGraphPerTierPassesTheCheckAtEveryT) {
  SKIP_WITHOUT_GPU();
  ScopedEnv shared_gpu("LMOE_P2P_SHARED_GPU", "1");
  for (int tp : {1, 2}) {
    if (lmoe::comm_group_limit("p2p", tp)) continue;
    SCOPED_TRACE("tp=" + std::to_string(tp));
    lmoe::BenchOptions options;
    options.backend = lmoe::Backend::cuda;
    options.dims = kSmall;
    options.dtype = kDtype;
    options.tp = tp;
    options.tokens = {1, 3, 17, 64, 129};
    options.comms = {"p2p"};
    options.warmup = 1;
    options.iters = 3;
    options.mode = lmoe::BenchMode::device_tokens;
    const lmoe::BenchResult result = lmoe::run_tail_bench(options);
    for (const lmoe::BenchCommError& error : result.comm_errors)
      ADD_FAILURE() << error.comm << ": " << error.error;
    int ran = 0;
    for (const lmoe::BenchRecord& record : result.records) {
      if (record.declined) continue;
      ++ran;
      EXPECT_EQ(record.mode, lmoe::BenchMode::device_tokens);
      EXPECT_TRUE(record.checked);
      EXPECT_TRUE(record.ok()) << lmoe::tier_name(record.tier) << " T=" << record.tokens;
    }
    EXPECT_EQ(ran, tp == 1 ? 20 : 19);  // 4 tiers × 5 T; token declines T = 1 < tp = 2
    EXPECT_TRUE(result.ok());
    options.inject_fault = true;
    EXPECT_FALSE(lmoe::run_tail_bench(options).ok());
  }
}

}  // namespace

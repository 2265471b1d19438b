// The P2P communicator's protocol: collectives cut into many rounds, signed zeros and subnormals,
// CUDA-graph replays back to back with changing inputs, ranks that disagree (on the layout, or on
// the collective a round belongs to), and failure (a stalled rank, two collectives at once, an
// abort) turning into errors instead of hangs. The collectives at the production layout are in
// test_p2p_collectives.cpp; tail parity over p2p is in test_cuda_tail.cpp.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "cuda/comm/p2p_group.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "cuda/tail/cuda_tail_executor.hpp"
#include "gpu_test_support.hpp"
#include "lmoe/comm_group.hpp"
#include "lmoe/error.hpp"
#include "lmoe/latent_tail.hpp"
#include "lmoe/p2p_communicator.hpp"
#include "lmoe/reference.hpp"
#include "lmoe/tools/tail_runner.hpp"
#include "p2p_test_support.hpp"
#include "tools/bench_values.hpp"
#include "tools/collective_check.hpp"
#include "tools/cuda/replay_soak.hpp"

namespace {

using lmoe::DType;
using lmoe::cuda::DeviceBuffer;
using p2p_test::Collective;
using p2p_test::host_sum;
using p2p_test::Op;
using p2p_test::RankCollective;
using p2p_test::Stream;

// Tiny rounds (1 KiB) cut every collective into many rounds, with uneven blocks and odd counts
// that leave partial vectors at the ends of rounds and blocks.
TEST(P2p, CollectivesSpanningManyRoundsMatchTheHostBitForBit) {
  SKIP_WITHOUT_GPU();
  SKIP_UNLESS_P2P_CAN_RUN(2);
  lmoe::P2pOptions options;
  options.round_bytes = 1024;  // 4 blocks of 256 bytes: 512 bf16 or 256 f32 elements per round
  options.blocks = 4;
  for (int tp : {2, 3, 5}) {
    if (lmoe::comm_group_limit("p2p", tp)) continue;
    for (DType dtype : {DType::bf16, DType::f32}) {
      const std::size_t esize = lmoe::dtype_size(dtype);
      SCOPED_TRACE("tp " + std::to_string(tp) + " " + std::string(lmoe::dtype_name(dtype)));
      // Uneven blocks: rank r owns 1000 + 37 r elements; one rank owns none.
      std::vector<std::size_t> counts;
      for (int r = 0; r < tp; ++r)
        counts.push_back(r == 1 ? 0 : 1000 + 37 * static_cast<std::size_t>(r));
      std::size_t total = 0;
      for (std::size_t c : counts) total += c;
      std::vector<std::vector<std::byte>> inputs;
      for (int r = 0; r < tp; ++r)
        inputs.push_back(random_values(total, dtype, 77 + static_cast<std::uint64_t>(r)));
      const std::vector<std::byte> expected = host_sum(inputs, total, dtype);

      std::vector<std::vector<std::byte>> reduced(tp), scattered(tp), gathered(tp);
      lmoe::run_on_p2p_threads(
          tp,
          [&](int rank, lmoe::Communicator& comm) {
            const Stream stream;
            const std::size_t mine = counts[rank] * esize;
            const DeviceBuffer send(total * esize), reduced_d(total * esize),
                block(std::max<std::size_t>(mine, 16)), gathered_d(total * esize);
            cuda_ok(cudaMemcpy(send.data(), inputs[rank].data(), total * esize,
                               cudaMemcpyHostToDevice));
            // Poisoned on the rank's own stream, which also gives the stream its first work before
            // any peer spins (a stream's first launch while peers spin stalled on an H200).
            cuda_ok(cudaMemsetAsync(reduced_d.data(), 0xff, total * esize, stream.get()));
            cuda_ok(cudaMemsetAsync(gathered_d.data(), 0xff, total * esize, stream.get()));
            // Ranks share the GPU and spin on each other: no allocation, synchronous copy or other
            // GPU-wide wait while a collective is in flight, hence the barriers around them.
            cuda_ok(cudaDeviceSynchronize());
            comm.barrier();
            comm.all_reduce(send.data(), reduced_d.data(), total, dtype, stream.get());
            comm.reduce_scatter(send.data(), block.data(), counts, dtype, stream.get());
            comm.all_gather(block.data(), gathered_d.data(), counts, dtype, stream.get());
            cuda_ok(cudaStreamSynchronize(stream.get()));
            comm.barrier();
            reduced[rank].resize(total * esize);
            gathered[rank].resize(total * esize);
            scattered[rank].resize(mine);
            cuda_ok(cudaMemcpy(reduced[rank].data(), reduced_d.data(), total * esize,
                               cudaMemcpyDeviceToHost));
            cuda_ok(cudaMemcpy(gathered[rank].data(), gathered_d.data(), total * esize,
                               cudaMemcpyDeviceToHost));
            if (mine)
              cuda_ok(
                  cudaMemcpy(scattered[rank].data(), block.data(), mine, cudaMemcpyDeviceToHost));
          },
          options);
      std::size_t first = 0;
      for (int r = 0; r < tp; ++r) {
        EXPECT_EQ(0, std::memcmp(reduced[r].data(), expected.data(), expected.size()))
            << "all_reduce rank " << r;
        EXPECT_EQ(0, std::memcmp(gathered[r].data(), expected.data(), expected.size()))
            << "all_gather rank " << r;
        EXPECT_EQ(0, std::memcmp(scattered[r].data(), expected.data() + first * esize,
                                 scattered[r].size()))
            << "reduce_scatter rank " << r;
        first += counts[r];
      }
    }
  }
}

// −0 + −0 = −0 only when the sum starts from rank 0's value; subnormals must survive (no flush).
TEST(P2p, KeepsNegativeZeroAndSubnormals) {
  SKIP_WITHOUT_GPU();
  const int tp = std::min(4, lmoe::cuda_device_count());
  SKIP_UNLESS_P2P_CAN_RUN(std::max(tp, 2));
  const std::size_t count = 64;
  std::vector<std::vector<std::byte>> inputs(tp);
  for (int r = 0; r < tp; ++r) {
    inputs[r].resize(count * 4);
    for (std::size_t i = 0; i < count; ++i) {
      const float value =
          i % 2 ? -0.0f : std::ldexp(1.0f, -140) * static_cast<float>(r + 1);  // subnormal
      lmoe::store_from_float(inputs[r].data(), i, DType::f32, value);
    }
  }
  const std::vector<std::byte> expected = host_sum(inputs, count, DType::f32);
  std::vector<std::vector<std::byte>> got(tp);
  lmoe::run_on_p2p_threads(tp, [&](int rank, lmoe::Communicator& comm) {
    const DeviceBuffer buffer(count * 4);
    cuda_ok(cudaMemcpy(buffer.data(), inputs[rank].data(), count * 4, cudaMemcpyHostToDevice));
    const Stream stream;
    cuda_ok(cudaDeviceSynchronize());
    comm.barrier();
    comm.all_reduce(buffer.data(), buffer.data(), count, DType::f32, stream.get());
    cuda_ok(cudaStreamSynchronize(stream.get()));
    comm.barrier();
    got[rank].resize(count * 4);
    cuda_ok(cudaMemcpy(got[rank].data(), buffer.data(), count * 4, cudaMemcpyDeviceToHost));
  });
  float first_odd = 1.0f;
  std::memcpy(&first_odd, expected.data() + 4, 4);
  ASSERT_TRUE(std::signbit(first_odd) && first_odd == 0.0f);  // the expectation itself is −0
  for (int r = 0; r < tp; ++r)
    EXPECT_EQ(0, std::memcmp(got[r].data(), expected.data(), expected.size())) << r;
}

// One capture, many replays back to back: every replay's inputs are staged on the device ahead of
// time and copied in on the stream, and every output copied out there, with no host work between
// replays, so that rounds of consecutive replays run one right after the other and the workspace's
// parities and epochs must stay straight across them. Four blocks, the last slice ending in a
// partial vector; every replay's output on every rank checked.
TEST(P2p, GraphReplaysWithNewInputsMatchTheHost) {
  SKIP_WITHOUT_GPU();
  const int tp = std::max(2, std::min(4, lmoe::cuda_device_count()));
  SKIP_UNLESS_P2P_CAN_RUN(tp);
  const Collective c{Op::all_reduce, DType::bf16, p2p_test::split_evenly(3 * 4096 + 1003, tp)};
  p2p_test::expect_runs_match_the_host(tp, {c}, true, 24, 1000u, {});
}

// A soak of one captured graph replayed back to back, whose inputs change on every replay with no
// host work: the graph fills them on the device from a replay counter it advances itself, runs an
// all_reduce out of place (bf16, two rounds, the second partial) and one in place (f16), and
// counts on the device every output element that differs from the exact sum (small integers:
// exact in every dtype and order), every replay. At checkpoints the ranks stop together and the
// outputs of the last replay are checked on the host as well (bench::count_wrong_elements, from
// the counter's value). LMOE_P2P_SOAK_REPLAYS sets the replays (100000 for the full soak).
TEST(P2p, GraphReplaysWithInputsDerivedFromAReplayCounterStayExact) {
  SKIP_WITHOUT_GPU();
  const int tp = 2;
  SKIP_UNLESS_P2P_CAN_RUN(tp);
  const long replays = soak_replays("LMOE_P2P_SOAK_REPLAYS", 20000);
  constexpr long kCheckEvery = 2500;
  constexpr std::uint64_t kSeed = 20261208;
  lmoe::P2pOptions options;
  options.round_bytes = 16 << 10;  // 4 blocks of 4 KiB: the bf16 all_reduce takes two rounds
  options.blocks = 4;
  struct Soaked {
    DType dtype;
    std::size_t count;
    bool in_place;
  };
  const std::vector<Soaked> soaked = {{DType::bf16, 3 * 4096 + 1003, false},
                                      {DType::f16, 1000, true}};
  // Per rank, at every checkpoint: the replay counter and each collective's output.
  struct Checkpoint {
    std::uint64_t counter = 0;
    std::vector<std::vector<std::byte>> outputs;
  };
  std::vector<std::vector<Checkpoint>> checkpoints(tp);
  std::vector<unsigned long long> wrong_on_device(tp, ~0ull);
  lmoe::run_on_p2p_threads(
      tp,
      [&](int rank, lmoe::Communicator& comm) {
        const Stream stream;
        const DeviceBuffer counter(sizeof(std::uint64_t)), wrong(sizeof(unsigned long long));
        std::vector<DeviceBuffer> send, recv;
        for (const Soaked& c : soaked) {
          const std::size_t bytes = c.count * lmoe::dtype_size(c.dtype);
          send.emplace_back(c.in_place ? 16 : bytes);
          recv.emplace_back(bytes);
        }
        cuda_ok(cudaMemsetAsync(counter.data(), 0, counter.bytes(), stream.get()));
        cuda_ok(cudaMemsetAsync(wrong.data(), 0, wrong.bytes(), stream.get()));
        auto* replay = static_cast<std::uint64_t*>(counter.data());
        const auto issue = [&] {
          for (std::size_t k = 0; k < soaked.size(); ++k) {
            const Soaked& c = soaked[k];
            const auto count = static_cast<std::int64_t>(c.count);
            void* input = c.in_place ? recv[k].data() : send[k].data();
            if (!c.in_place) {
              cuda_ok(cudaMemsetAsync(recv[k].data(), 0xff, recv[k].bytes(), stream.get()));
            }
            cuda_ok(lmoe::cuda::launch_fill_replay_collective_values(
                input, count, c.dtype, kSeed + k, rank, replay, stream.get()));
            comm.all_reduce(input, recv[k].data(), c.count, c.dtype, stream.get());
            cuda_ok(lmoe::cuda::launch_count_wrong_replay_sums(
                recv[k].data(), count, c.dtype, kSeed + k, tp, replay,
                static_cast<unsigned long long*>(wrong.data()), stream.get()));
          }
          cuda_ok(lmoe::cuda::launch_advance_replay(replay, stream.get()));
        };
        const auto copy_out = [&] {
          Checkpoint& taken = checkpoints[rank].emplace_back();
          cuda_ok(
              cudaMemcpy(&taken.counter, replay, sizeof(std::uint64_t), cudaMemcpyDeviceToHost));
          for (const DeviceBuffer& out : recv) {
            taken.outputs.emplace_back(out.bytes());
            cuda_ok(cudaMemcpy(taken.outputs.back().data(), out.data(), out.bytes(),
                               cudaMemcpyDeviceToHost));
          }
        };
        soak_captured_replays(comm, stream.get(), replays, kCheckEvery, issue, copy_out);
        cuda_ok(cudaMemcpy(&wrong_on_device[rank], wrong.data(), sizeof(unsigned long long),
                           cudaMemcpyDeviceToHost));
      },
      options);
  std::size_t wrong_on_host = 0;
  unsigned long long wrong_on_devices = 0;
  for (int r = 0; r < tp; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(wrong_on_device[r], 0ull) << "elements wrong over every replay";
    wrong_on_devices += wrong_on_device[r];
    ASSERT_FALSE(checkpoints[r].empty());
    // The eager call and every replay advanced the counter once.
    EXPECT_EQ(checkpoints[r].back().counter, static_cast<std::uint64_t>(replays) + 1);
    for (const Checkpoint& taken : checkpoints[r]) {
      const std::uint64_t last = taken.counter - 1;  // the replay whose outputs these are
      for (std::size_t k = 0; k < soaked.size(); ++k) {
        const std::vector<std::size_t> counts = p2p_test::split_evenly(soaked[k].count, tp);
        const std::size_t wrong = lmoe::bench::count_wrong_elements(
            {Op::all_reduce, counts}, soaked[k].dtype, r, lmoe::bench::replay_seed(kSeed + k, last),
            taken.outputs[k].data());
        EXPECT_EQ(wrong, 0u) << "collective " << k << ", replay " << last;
        wrong_on_host += wrong;
      }
    }
  }
  std::printf(
      "[ p2p    ] soak: %ld graph replays per rank, tp=%d, all_reduce bf16 (2 rounds) and f16 in "
      "place: %llu wrong elements on the device, %zu at %zu checkpoints on the host\n",
      replays, tp, wrong_on_devices, wrong_on_host, checkpoints[0].size());
}

// A rank that never issues the collective and stays away from every host wait past the timeout
// (busy elsewhere): its peers' rounds time out on the device, and every rank, the stalled one
// included once it returns, gets the stall's error naming it. (Were the stalled rank to wait in a
// host barrier at once instead, that barrier would time out at the same bound and abort the group,
// and the peers could report the abort instead of the stall.)
TEST(P2p, AStalledRankFailsItsPeersWithAnError) {
  SKIP_WITHOUT_GPU();
  lmoe::P2pOptions options;
  options.timeout = std::chrono::milliseconds(500);
  const int tp = 4, stalled = 3;
  std::vector<std::string> messages(tp);
  std::vector<double> seconds(tp, 0.0);
  lmoe::run_on_p2p_threads(
      tp,
      [&](int rank, lmoe::Communicator& comm) {
        const DeviceBuffer buffer(4096 * 2);
        cuda_ok(cudaDeviceSynchronize());
        comm.barrier();
        const auto start = std::chrono::steady_clock::now();
        try {
          if (rank != stalled) {
            comm.all_reduce(buffer.data(), buffer.data(), 4096, DType::bf16, cudaStreamPerThread);
            cuda_ok(cudaStreamSynchronize(cudaStreamPerThread));
          } else {
            std::this_thread::sleep_for(3 * options.timeout);
          }
          comm.barrier();
        } catch (const lmoe::Error& error) {
          messages[rank] = error.message();
        }
        seconds[rank] =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      },
      options);
  for (int r = 0; r < tp; ++r) {
    std::printf("[ p2p    ] rank %d failed after %.2f s: %s\n", r, seconds[r], messages[r].c_str());
    // 4096 elements are one block's work; the group's first round.
    EXPECT_NE(messages[r].find("waited more than 500 ms for rank 3 (round 1, block 0)"),
              std::string::npos)
        << "rank " << r << ": " << messages[r];
    if (r != stalled) {
      EXPECT_LT(seconds[r], 5.0) << "rank " << r << " was not failed in time";
    }
  }
}

// Two collectives of one rank on unordered streams at once: an error, not a corrupted result.
TEST(P2p, TwoCollectivesAtOnceOnOneWorkspaceAreAnError) {
  SKIP_WITHOUT_GPU();
  lmoe::P2pOptions options;
  options.timeout = std::chrono::milliseconds(2000);
  std::string message;
  try {
    lmoe::run_on_p2p_threads(
        2,
        [&](int rank, lmoe::Communicator& comm) {
          const DeviceBuffer a(1024 * 4), b(1024 * 4);
          comm.barrier();
          if (rank == 0) {
            const Stream first, second;
            comm.all_reduce(a.data(), a.data(), 1024, DType::f32, first.get());  // waits for rank 1
            comm.all_reduce(b.data(), b.data(), 1024, DType::f32, second.get());  // overlaps it
            cuda_ok(cudaStreamSynchronize(first.get()));
            cuda_ok(cudaStreamSynchronize(second.get()));
          } else {
            std::this_thread::sleep_for(std::chrono::milliseconds(300));
            comm.all_reduce(a.data(), a.data(), 1024, DType::f32, cudaStreamPerThread);
            cuda_ok(cudaStreamSynchronize(cudaStreamPerThread));
          }
          comm.barrier();
        },
        options);
  } catch (const lmoe::Error& error) {
    message = error.message();
  }
  EXPECT_NE(message.find("two collectives at the same time"), std::string::npos) << message;
}

// Two ranks that issue different collectives, or the same one with another size or dtype, pair
// their rounds no more: the round's tag (published with the arrival) differs, and every rank gets
// an error naming both ranks' collectives instead of a result mixed from two collectives.
TEST(P2p, RanksRunningDifferentCollectivesFailNamingBoth) {
  SKIP_WITHOUT_GPU();
  SKIP_UNLESS_P2P_CAN_RUN(2);
  struct Case {
    const char* what;
    std::vector<Collective> rank0, rank1;  // issued in this order
  };
  const std::vector<std::size_t> halves{4096, 4096};
  const std::vector<Case> cases = {
      {"another order",
       {{Op::all_reduce, DType::bf16, halves}, {Op::all_gather, DType::bf16, halves}},
       {{Op::all_gather, DType::bf16, halves}, {Op::all_reduce, DType::bf16, halves}}},
      {"another size",
       {{Op::all_reduce, DType::f32, halves}},
       {{Op::all_reduce, DType::f32, {4096, 4104}}}},
      {"another dtype",
       {{Op::reduce_scatter, DType::bf16, halves}},
       {{Op::reduce_scatter, DType::f16, halves}}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    std::vector<std::string> messages(2);
    lmoe::run_on_p2p_threads(2, [&](int rank, lmoe::Communicator& comm) {
      const Stream stream;
      std::vector<RankCollective> runs;
      for (const Collective& collective : rank == 0 ? c.rank0 : c.rank1)
        runs.emplace_back(collective, rank);
      cuda_ok(
          cudaMemsetAsync(runs.front().recv(), 0, 16, stream.get()));  // the stream's first work
      cuda_ok(cudaDeviceSynchronize());
      comm.barrier();
      try {
        for (const RankCollective& run : runs) run.issue(comm, stream.get());
        cuda_ok(cudaStreamSynchronize(stream.get()));
        comm.barrier();
      } catch (const lmoe::Error& error) {
        messages[rank] = error.message();
      }
    });
    // Either rank's record may be the one reported: each names itself first.
    const std::string first = c.rank0.front().name(), second = c.rank1.front().name();
    const std::string from_rank0 = "rank 0 ran " + first + " while rank 1 ran " + second,
                      from_rank1 = "rank 1 ran " + second + " while rank 0 ran " + first;
    for (int r = 0; r < 2; ++r) {
      const std::string& message = messages[r];
      EXPECT_TRUE(message.find(from_rank0) != std::string::npos ||
                  message.find(from_rank1) != std::string::npos)
          << "rank " << r << ": " << message;
      // Round 1: the group's first; the block is any that paired the two collectives.
      EXPECT_NE(message.find(" in the same round (round 1, block "), std::string::npos)
          << "rank " << r << ": " << message;
    }
  }
}

// Ranks of processes compute their layouts apart; what they disagree on is named with every rank's
// value (p2p_process.cpp compares them before sizing any workspace). No GPU needed.
TEST(P2pLayoutAgreement, ADisagreementNamesEachFieldAndEveryRanksValue) {
  lmoe::P2pOptions options;
  options.timeout = std::chrono::milliseconds(10000);
  const lmoe::P2pLayout defaults = lmoe::p2p_layout(options, false);
  EXPECT_EQ(defaults.blocks, 32);
  EXPECT_EQ(defaults.block_bytes, std::size_t{1} << 20);
  EXPECT_EQ(lmoe::p2p_layout_disagreement(std::vector{defaults, defaults, defaults}), "");

  const lmoe::P2pLayout shared_gpu = lmoe::p2p_layout(options, true);  // 16 blocks of 2 MiB
  EXPECT_EQ(lmoe::p2p_layout_disagreement(std::vector{defaults, shared_gpu}),
            "p2p: ranks disagree on the group's layout: blocks is 32 on rank 0 and 16 on rank 1 "
            "(set P2pOptions::blocks alike on every rank); block_bytes is 1048576 on rank 0 and "
            "2097152 on rank 1 (round_bytes / blocks: set P2pOptions::round_bytes and blocks alike "
            "on every rank)");

  options.timeout = std::chrono::milliseconds(500);
  const lmoe::P2pLayout short_timeout = lmoe::p2p_layout(options, false);
  EXPECT_EQ(lmoe::p2p_layout_disagreement(std::vector{defaults, defaults, short_timeout}),
            "p2p: ranks disagree on the group's layout: timeout is 10000 ms on rank 0, 10000 ms on "
            "rank 1 and 500 ms on rank 2 (set P2pOptions::timeout, or LMOE_P2P_TIMEOUT_MS, alike "
            "on every rank)");
}

// What a mismatch's message says a rank ran, from the round's tag: exact counts below 2^27, and
// a hash of larger ones that still tells two sizes apart. No GPU needed.
TEST(P2pLayoutAgreement, ARoundTagNamesItsCollective) {
  using lmoe::cuda::p2p_round_tag;
  using lmoe::cuda::P2pCollective;
  const auto f16 = static_cast<std::uint32_t>(DType::f16);
  EXPECT_EQ(lmoe::describe_p2p_collective(p2p_round_tag(P2pCollective::reduce_scatter, f16, 12345)),
            "reduce_scatter of 12345 f16 elements");
  const std::uint64_t exact = lmoe::cuda::kP2pTagExactCounts;
  EXPECT_EQ(lmoe::describe_p2p_collective(p2p_round_tag(P2pCollective::all_gather, f16, exact - 1)),
            "all_gather of " + std::to_string(exact - 1) + " f16 elements");
  EXPECT_EQ(lmoe::describe_p2p_collective(p2p_round_tag(P2pCollective::all_reduce, f16, exact)),
            "all_reduce of at least 134217728 f16 elements");
  EXPECT_NE(p2p_round_tag(P2pCollective::all_reduce, f16, exact),
            p2p_round_tag(P2pCollective::all_reduce, f16, exact + 8));
  EXPECT_NE(p2p_round_tag(P2pCollective::all_reduce, f16, 4096),
            p2p_round_tag(P2pCollective::all_gather, f16, 4096));
  EXPECT_NE(
      p2p_round_tag(P2pCollective::all_reduce, f16, 4096),
      p2p_round_tag(P2pCollective::all_reduce, static_cast<std::uint32_t>(DType::bf16), 4096));
  EXPECT_EQ(lmoe::describe_p2p_collective(0), "no collective");
}

// The host aborts the group while a peer's round is spinning: the round stops and reports it.
TEST(P2p, AbortStopsASpinningPeer) {
  SKIP_WITHOUT_GPU();
  lmoe::P2pOptions options;
  options.timeout = std::chrono::seconds(30);  // the abort, not the timeout, must end the wait
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::string> messages(2);
  const auto comms = lmoe::make_p2p_thread_communicators(2, options);
  std::thread spinner([&] {
    cudaSetDevice(0);
    try {
      const DeviceBuffer buffer(256 * 4);
      comms[0]->all_reduce(buffer.data(), buffer.data(), 256, DType::f32, cudaStreamPerThread);
      cuda_ok(cudaStreamSynchronize(cudaStreamPerThread));
      comms[0]->barrier();
    } catch (const lmoe::Error& error) {
      messages[0] = error.message();
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  comms[1]->abort("test abort");
  spinner.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 20.0) << "the spinning round did not see the abort";
  EXPECT_NE(messages[0].find("aborted"), std::string::npos) << messages[0];
}

// A forward captured once replays correctly with new inputs; capture is refused with a reason
// where it cannot work (no max_tokens; a host-synchronized communicator), and T above max_tokens
// is an input error.
TEST(P2pTail, CapturedForwardReplaysNewInputsAndCaptureLimitsAreErrors) {
  SKIP_WITHOUT_GPU();
  const lmoe::TailDims dims{384, 192};
  const int tp = std::max(2, std::min(4, lmoe::cuda_device_count()));
  SKIP_UNLESS_P2P_CAN_RUN(tp);
  const std::int64_t tokens = 33;
  std::vector<lmoe::TailCase> cases;
  for (std::uint64_t seed : {1u, 2u, 3u}) {
    cases.push_back(lmoe::make_random_case(dims, 1e-5f, DType::bf16, tp, tokens, seed));
    cases.back().norm_weight = cases.front().norm_weight;
    cases.back().up_proj_weight = cases.front().up_proj_weight;
  }
  for (lmoe::TailTier tier : {lmoe::TailTier::overlap, lmoe::TailTier::column,
                              lmoe::TailTier::token, lmoe::TailTier::fused}) {
    SCOPED_TRACE(std::string(lmoe::tier_name(tier)));
    std::vector<std::vector<lmoe::HostTensor>> outputs(cases.size(),
                                                       std::vector<lmoe::HostTensor>(tp));
    std::vector<std::string> refusals(tp), too_many(tp);
    lmoe::run_on_p2p_threads(tp, [&](int rank, lmoe::Communicator& comm) {
      lmoe::TailOptions options;
      options.dims = dims;
      options.backend = lmoe::Backend::cuda;
      const std::size_t routed_bytes = tokens * dims.d_latent * 2,
                        shared_bytes = tokens * dims.d_model * 2;
      const DeviceBuffer routed(routed_bytes + dims.d_latent * 2),
          shared(shared_bytes + dims.d_model * 2), out(shared_bytes + dims.d_model * 2);
      const lmoe::ConstMatrixView routed_view{routed.data(), DType::bf16,
                                              tokens,        dims.d_latent,
                                              dims.d_latent, lmoe::MemorySpace::device};
      const lmoe::MatrixView shared_view{shared.data(), DType::bf16,  tokens,
                                         dims.d_model,  dims.d_model, lmoe::MemorySpace::device};
      const lmoe::MatrixView out_view{out.data(),   DType::bf16,  tokens,
                                      dims.d_model, dims.d_model, lmoe::MemorySpace::device};
      const Stream stream;
      {  // growing workspaces cannot be captured
        lmoe::LatentTail growing(options, comm, cases[0].norm_weight.matrix(),
                                 cases[0].up_proj_weight.matrix());
        cuda_ok(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
        try {
          growing.forward(routed_view, shared_view, out_view, tier, stream.get());
        } catch (const lmoe::Error& error) {
          refusals[rank] = error.message();
        }
        cudaGraph_t discarded = nullptr;
        cudaStreamEndCapture(stream.get(), &discarded);
        if (discarded) cudaGraphDestroy(discarded);
        cudaGetLastError();
        // Freeing `growing` synchronizes the device, which would invalidate a capture a peer still
        // has open: every rank leaves its capture first.
        comm.barrier();
      }
      options.max_tokens = tokens;
      lmoe::LatentTail tail(options, comm, cases[0].norm_weight.matrix(),
                            cases[0].up_proj_weight.matrix());
      try {
        const lmoe::ConstMatrixView big_routed{routed.data(), DType::bf16,
                                               tokens + 1,    dims.d_latent,
                                               dims.d_latent, lmoe::MemorySpace::device};
        const lmoe::MatrixView big_shared{shared.data(), DType::bf16,  tokens + 1,
                                          dims.d_model,  dims.d_model, lmoe::MemorySpace::device};
        const lmoe::MatrixView big_out{out.data(),   DType::bf16,  tokens + 1,
                                       dims.d_model, dims.d_model, lmoe::MemorySpace::device};
        tail.forward(big_routed, big_shared, big_out, tier, stream.get());
      } catch (const lmoe::Error& error) {
        too_many[rank] = error.message();
      }
      // One eager call of this T before capturing it, as an engine warms up before capture: a
      // cuBLASLt kernel's first launch may load its module, which waits for the whole GPU and is
      // not allowed inside a capture (cudaErrorStreamCaptureUnsupported).
      tail.forward(routed_view, shared_view, out_view, tier, stream.get());
      cuda_ok(cudaStreamSynchronize(stream.get()));
      comm.barrier();
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      cuda_ok(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
      tail.forward(routed_view, shared_view, out_view, tier, stream.get());
      cuda_ok(cudaStreamEndCapture(stream.get(), &graph));
      cuda_ok(cudaGraphInstantiate(&exec, graph, 0));
      cuda_ok(cudaGraphUpload(exec, stream.get()));
      // The staging below allocates and synchronizes the device, which invalidates a capture that
      // a peer has not finished yet (its collective then fails): every rank ends its capture first.
      comm.barrier();
      // Every case's inputs reach the GPU before any rank replays: a rank's first copy from
      // pageable memory sets up staging buffers, and a rank doing setup work while its peers
      // already spin in a round can stall them past the timeout (docs/p2p.md).
      std::vector<DeviceBuffer> routed_in, shared_in;
      for (const lmoe::TailCase& c : cases) {
        routed_in.emplace_back(routed_bytes);
        shared_in.emplace_back(shared_bytes);
        cuda_ok(cudaMemcpy(routed_in.back().data(), c.routed.slice_matrix(rank).data, routed_bytes,
                           cudaMemcpyHostToDevice));
        cuda_ok(cudaMemcpy(shared_in.back().data(), c.shared.slice_matrix(rank).data, shared_bytes,
                           cudaMemcpyHostToDevice));
      }
      cuda_ok(cudaDeviceSynchronize());
      comm.barrier();
      for (std::size_t i = 0; i < cases.size(); ++i) {
        cuda_ok(cudaMemcpyAsync(routed.data(), routed_in[i].data(), routed_bytes,
                                cudaMemcpyDeviceToDevice, stream.get()));
        cuda_ok(cudaMemcpyAsync(shared.data(), shared_in[i].data(), shared_bytes,
                                cudaMemcpyDeviceToDevice, stream.get()));
        cuda_ok(cudaMemsetAsync(out.data(), 0xff, shared_bytes, stream.get()));
        cuda_ok(cudaGraphLaunch(exec, stream.get()));
        outputs[i][rank] = lmoe::HostTensor(DType::bf16, {tokens, dims.d_model});
        cuda_ok(cudaMemcpyAsync(outputs[i][rank].data(), out.data(), shared_bytes,
                                cudaMemcpyDeviceToHost, stream.get()));
        cuda_ok(cudaStreamSynchronize(stream.get()));
        comm.barrier();
      }
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
    });
    for (int r = 0; r < tp; ++r) {
      EXPECT_NE(refusals[r].find("max_tokens"), std::string::npos) << refusals[r];
      EXPECT_NE(too_many[r].find("at most max_tokens=33"), std::string::npos) << too_many[r];
    }
    for (std::size_t i = 0; i < cases.size(); ++i) {
      SCOPED_TRACE("inputs " + std::to_string(i));
      expect_ranks_alike_within_contract(outputs[i], cases[i], tier);
    }
  }
}

TEST(P2pTail, CaptureOverAHostSynchronizedCommunicatorIsRefused) {
  SKIP_WITHOUT_GPU();
  lmoe::RunOptions options;
  options.backend = lmoe::Backend::cuda;
  options.comm = "cuda-threads";
  options.graph = true;
  options.tier = lmoe::TailTier::overlap;
  const lmoe::TailCase c = lmoe::make_random_case({384, 192}, 1e-5f, DType::bf16, 2, 8, 5u);
  try {
    lmoe::run_case_on_threads(c, options);
    ADD_FAILURE() << "capture over cuda-threads did not fail";
  } catch (const lmoe::Error& error) {
    EXPECT_NE(std::string(error.message()).find("cannot be captured"), std::string::npos)
        << error.message();
  }
}

// A p2p group whose staging no GPU holds (4 TiB a round) fails at its workspace's allocation, after
// its status records and abort flag (page-locked, mapped) were allocated: 1000 such groups leak
// neither host nor device memory.
TEST(P2p, FailedGroupConstructionsLeakNoMemory) {
  SKIP_WITHOUT_GPU();
  lmoe::P2pOptions options;
  options.round_bytes = std::size_t{1} << 42;
  try {
    lmoe::make_p2p_thread_communicators(1, options);
    ADD_FAILURE() << "a group of 4 TiB rounds was built";
  } catch (const lmoe::Error& error) {
    EXPECT_NE(std::string(error.message()).find("cudaMalloc"), std::string::npos)
        << "the failure must come after the status records' allocation: " << error.message();
  }
  expect_failed_attempts_leak_nothing("a p2p thread group of one rank, 4 TiB rounds", 1000,
                                      [&] { lmoe::make_p2p_thread_communicators(1, options); });
}

}  // namespace

// LatentTail's input checks, run the way users run it: one LatentTail per rank on the `threads`
// communicator. Every bad input must raise lmoe::Error with a message that names the argument, on
// every rank, before any work — also when only one rank has it — and leave the outputs untouched.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/host_math.hpp"
#include "core/validation.hpp"
#include "lmoe/error.hpp"
#include "lmoe/latent_tail.hpp"
#include "lmoe/reference.hpp"
#include "lmoe/threads_communicator.hpp"

namespace {

using lmoe::Communicator;
using lmoe::ConstMatrixView;
using lmoe::DType;
using lmoe::HostTensor;
using lmoe::LatentTail;
using lmoe::MatrixView;
using lmoe::TailOptions;
using lmoe::TailTier;
using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr std::int64_t kDModel = 96;
constexpr std::int64_t kDLatent = 48;
constexpr std::byte kPoison{0x5a};
// Ranks wait at most this long for each other: a check that leaves a peer waiting fails the test
// quickly instead of hanging it.
constexpr std::chrono::milliseconds kTimeout{5000};

const std::string kOk = "<ok>";

TailOptions options(std::int64_t d_model = kDModel, std::int64_t d_latent = kDLatent,
                    DType dtype = DType::bf16) {
  TailOptions opts;
  opts.dims = {d_model, d_latent};
  opts.rms_norm_eps = 1e-5f;
  opts.dtype = dtype;
  opts.backend = lmoe::Backend::cpu;
  return opts;
}

void fill_random(HostTensor& tensor, std::uint32_t seed, float mean = 0.0f, float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(mean, stddev);
  for (std::int64_t i = 0; i < tensor.numel(); ++i) tensor.set(i, normal(rng));
}

// Replicated weights: the same seed gives the same bits on every rank.
struct Weights {
  HostTensor norm;  // [l]
  HostTensor up;    // [d, l]
  Weights(std::int64_t d_model = kDModel, std::int64_t d_latent = kDLatent,
          DType dtype = DType::bf16, std::uint32_t seed = 5)
      : norm(dtype, {d_latent}), up(dtype, {d_model, d_latent}) {
    fill_random(norm, seed, 1.0f, 0.1f);
    fill_random(up, seed + 1, 0.0f, 0.15f);
  }
};

// One rank's call tensors, freshly random, outputs poisoned.
struct Call {
  HostTensor routed;  // [T, l]
  HostTensor shared;  // [T, d]
  HostTensor out;     // [T, d]
  Call(std::int64_t tokens, int rank, std::int64_t d_model = kDModel,
       std::int64_t d_latent = kDLatent, DType dtype = DType::bf16)
      : routed(dtype, {tokens, d_latent}),
        shared(dtype, {tokens, d_model}),
        out(dtype, {tokens, d_model}) {
    fill_random(routed, 100 + static_cast<std::uint32_t>(rank));
    fill_random(shared, 200 + static_cast<std::uint32_t>(rank));
    out.fill_bytes(kPoison);
  }
};

bool all_bytes_are(const HostTensor& tensor, std::byte value) {
  for (std::byte b : tensor.bytes()) {
    if (b != value) return false;
  }
  return true;
}

// Runs fn on tp ranks and returns what each rank saw: kOk, or its lmoe::Error's message.
std::vector<std::string> per_rank_outcome(int tp,
                                          const std::function<void(int, Communicator&)>& fn) {
  std::vector<std::string> outcome(static_cast<std::size_t>(tp), "<did not run>");
  lmoe::cpu::set_blas_threads(1);
  lmoe::run_on_threads(
      tp,
      [&](int rank, Communicator& comm) {
        try {
          fn(rank, comm);
          outcome[rank] = kOk;
        } catch (const lmoe::Error& error) {
          outcome[rank] = error.message();
        }
      },
      kTimeout);
  return outcome;
}

// Every rank must report exactly `message`.
void expect_every_rank(const std::vector<std::string>& outcome, const std::string& message) {
  for (std::size_t r = 0; r < outcome.size(); ++r) {
    EXPECT_EQ(outcome[r], message) << "rank " << r;
  }
}

// A correctly built tail on every rank whose call is described by `make_views` (per rank); the
// outputs must stay poisoned on every rank when the call fails.
struct CallViews {
  ConstMatrixView routed;
  MatrixView shared;
  MatrixView out;
};
std::vector<std::string> call_outcome(
    int tp, std::int64_t tokens, const std::function<CallViews(int rank, Call& call)>& make_views,
    std::optional<TailTier> tier = std::nullopt, std::int64_t max_tokens = 0) {
  const Weights weights;
  return per_rank_outcome(tp, [&](int rank, Communicator& comm) {
    TailOptions opts = options();
    opts.max_tokens = max_tokens;
    LatentTail tail(opts, comm, weights.norm.matrix(), weights.up.matrix());
    Call call(tokens, rank);
    const CallViews views = make_views(rank, call);
    try {
      tail.forward(views.routed, views.shared, views.out, tier);
    } catch (const lmoe::Error&) {
      // "Raised before any launch": a failed call has written nothing.
      EXPECT_TRUE(all_bytes_are(call.out, kPoison))
          << "rank " << rank << " wrote out before failing";
      throw;
    }
  });
}

CallViews good_views(Call& call) {
  return {call.routed.matrix(), call.shared.matrix(), call.out.matrix()};
}

// ---------------------------------------------------------------------------------------------
// A correct call, for contrast: every check below differs from it in one thing.

TEST(LatentTailValidation, GoodInputsRunOnEveryRankAndMatchTheContract) {
  for (int tp : {1, 2, 3}) {
    const std::int64_t tokens = 5;
    const lmoe::TailCase c =
        lmoe::make_random_case({kDModel, kDLatent}, 1e-5f, DType::bf16, tp, tokens, 11);
    std::vector<HostTensor> outs(static_cast<std::size_t>(tp));
    std::vector<std::optional<TailTier>> ran(static_cast<std::size_t>(tp));
    const auto outcome = per_rank_outcome(tp, [&](int rank, Communicator& comm) {
      TailOptions opts = options();
      opts.rms_norm_eps = c.eps;
      LatentTail tail(opts, comm, c.norm_weight.matrix(), c.up_proj_weight.matrix());
      EXPECT_EQ(tail.tp_rank(), rank);
      EXPECT_EQ(tail.tp_size(), tp);
      HostTensor shared(DType::bf16, {tokens, kDModel});
      std::memcpy(shared.data(), c.shared.slice_matrix(rank).data, shared.nbytes());
      outs[rank] = HostTensor(DType::bf16, {tokens, kDModel});
      outs[rank].fill_bytes(kPoison);
      ran[rank] = tail.forward(c.routed.slice_matrix(rank), shared.matrix(), outs[rank].matrix());
    });
    expect_every_rank(outcome, kOk);
    ASSERT_TRUE(ran[0].has_value());
    EXPECT_EQ(*ran[0], TailTier::fused);  // T=5 <= 128
    const auto reference = lmoe::reference_tail(c, lmoe::contract_of(*ran[0]));
    for (int r = 0; r < tp; ++r) {
      EXPECT_EQ(ran[r], ran[0]);
      EXPECT_EQ(std::memcmp(outs[r].data(), reference.y.data(), reference.y.nbytes()), 0)
          << "tp=" << tp << " rank " << r;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The call's tensors, bad on every rank

TEST(LatentTailValidation, WrongDtypeOfEachTensor) {
  const std::int64_t t = 3;
  // Tensors of the right shape in another dtype stand in for each bf16 one in turn; the ranks may
  // share them because a call that fails validation writes nothing.
  HostTensor f16_routed(DType::f16, {t, kDLatent}), f32_model(DType::f32, {t, kDModel}),
      f16_model(DType::f16, {t, kDModel});
  expect_every_rank(
      call_outcome(2, t,
                   [&](int, Call& call) {
                     return CallViews{f16_routed.matrix(), call.shared.matrix(), call.out.matrix()};
                   }),
      "rank 0: routed: expected dtype bf16, got f16");
  expect_every_rank(
      call_outcome(2, t,
                   [&](int, Call& call) {
                     return CallViews{call.routed.matrix(), f32_model.matrix(), call.out.matrix()};
                   }),
      "rank 0: shared: expected dtype bf16, got f32");
  expect_every_rank(
      call_outcome(
          2, t,
          [&](int, Call& call) {
            return CallViews{call.routed.matrix(), call.shared.matrix(), f16_model.matrix()};
          }),
      "rank 0: out: expected dtype bf16, got f16");
}

TEST(LatentTailValidation, WrongShapesOfRoutedSharedAndOut) {
  const std::int64_t t = 3;
  // The good views with one of them given another (still contiguous) shape.
  const auto reshaped = [](auto CallViews::*which, std::int64_t rows, std::int64_t cols) {
    return [=](Call& c) {
      CallViews v = good_views(c);
      (v.*which).rows = rows;
      (v.*which).cols = cols;
      (v.*which).ld = cols;
      return v;
    };
  };
  struct Case {
    const char* what;
    std::function<CallViews(Call&)> views;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"routed one column short", reshaped(&CallViews::routed, t, kDLatent - 1),
       "rank 0: routed: expected shape [3, 48], got [3, 47]"},
      {"shared one column short", reshaped(&CallViews::shared, t, kDModel - 1),
       "rank 0: shared: expected shape [3, 96], got [3, 95]"},
      {"shared one row short", reshaped(&CallViews::shared, t - 1, kDModel),
       "rank 0: shared: expected shape [3, 96], got [2, 96]"},
      {"out one row short", reshaped(&CallViews::out, t - 1, kDModel),
       "rank 0: out: expected shape [3, 96], got [2, 96]"},
      {"out one column short", reshaped(&CallViews::out, t, kDModel - 1),
       "rank 0: out: expected shape [3, 96], got [3, 95]"},
      {"out given the latent width", reshaped(&CallViews::out, t, kDLatent),
       "rank 0: out: expected shape [3, 96], got [3, 48]"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    expect_every_rank(call_outcome(2, t, [&](int, Call& call) { return c.views(call); }),
                      c.message);
  }
}

TEST(LatentTailValidation, NonContiguousViews) {
  const std::int64_t t = 3;
  // Row strides one element wider than the row: views into a larger buffer.
  HostTensor wide_latent(DType::bf16, {t, kDLatent + 1}), wide_model(DType::bf16, {t, kDModel + 1});
  auto narrowed = [](HostTensor& wide, std::int64_t cols) {
    MatrixView view = wide.matrix();
    view.cols = cols;
    return view;
  };
  expect_every_rank(
      call_outcome(2, t,
                   [&](int, Call& call) {
                     return CallViews{narrowed(wide_latent, kDLatent), call.shared.matrix(),
                                      call.out.matrix()};
                   }),
      "rank 0: routed: expected a contiguous tensor (row stride 48), got row stride 49");
  expect_every_rank(
      call_outcome(2, t,
                   [&](int, Call& call) {
                     return CallViews{call.routed.matrix(), narrowed(wide_model, kDModel),
                                      call.out.matrix()};
                   }),
      "rank 0: shared: expected a contiguous tensor (row stride 96), got row stride 97");
  expect_every_rank(call_outcome(2, t,
                                 [&](int, Call& call) {
                                   return CallViews{call.routed.matrix(), call.shared.matrix(),
                                                    narrowed(wide_model, kDModel)};
                                 }),
                    "rank 0: out: expected a contiguous tensor (row stride 96), got row stride 97");
}

TEST(LatentTailValidation, SingleRowViewWithAWideStrideIsContiguous) {
  // ±1 on the contiguity rule: with one row the stride never matters.
  const auto outcome = call_outcome(2, 1, [&](int, Call& call) {
    auto views = good_views(call);
    views.routed.ld = kDLatent + 7;
    views.out.ld = kDModel + 3;
    return views;
  });
  expect_every_rank(outcome, kOk);
}

TEST(LatentTailValidation, NullDataAndDeviceMemory) {
  expect_every_rank(call_outcome(2, 3,
                                 [](int, Call& call) {
                                   auto views = good_views(call);
                                   views.routed.data = nullptr;
                                   return views;
                                 }),
                    "rank 0: routed: data is null");
  expect_every_rank(call_outcome(2, 3,
                                 [](int, Call& call) {
                                   auto views = good_views(call);
                                   views.shared.space = lmoe::MemorySpace::device;
                                   return views;
                                 }),
                    "rank 0: shared: expected host memory, got device memory");
}

TEST(LatentTailValidation, NegativeTokenCount) {
  expect_every_rank(call_outcome(2, 3,
                                 [](int, Call& call) {
                                   auto views = good_views(call);
                                   views.routed.rows = -1;
                                   views.shared.rows = -1;
                                   views.out.rows = -1;
                                   return views;
                                 }),
                    "rank 0: routed: expected a non-negative token count, got -1");
}

// ---------------------------------------------------------------------------------------------
// Aliasing

// One bf16 buffer holding routed at element 0 and out at element `out_offset`.
struct SharedStorage {
  HostTensor storage{DType::bf16, {1 << 12}};  // zero-filled: finite values for the calls that run
  ConstMatrixView routed(std::int64_t tokens) {
    return {storage.data(), DType::bf16, tokens, kDLatent, kDLatent, lmoe::MemorySpace::host};
  }
  MatrixView model_at(std::int64_t element, std::int64_t tokens) {
    return {storage.data() + element * 2, DType::bf16, tokens, kDModel, kDModel,
            lmoe::MemorySpace::host};
  }
};

// call_outcome on two ranks, each placing views in its own SharedStorage.
std::vector<std::string> storage_outcome(
    std::int64_t tokens, const std::function<CallViews(SharedStorage&, Call&)>& make_views) {
  std::vector<SharedStorage> storages(2);
  return call_outcome(2, tokens,
                      [&](int rank, Call& call) { return make_views(storages[rank], call); });
}

TEST(LatentTailValidation, OutMustNotOverlapRouted) {
  const std::int64_t t = 3;
  // out starts one element before routed ends: overlap. (At routed's end exactly: see below.)
  expect_every_rank(
      storage_outcome(
          t,
          [&](SharedStorage& s, Call& call) {
            return CallViews{s.routed(t), call.shared.matrix(), s.model_at(t * kDLatent - 1, t)};
          }),
      "rank 0: out: must not overlap routed");
  expect_every_rank(
      storage_outcome(
          t,
          [&](SharedStorage& s, Call& call) {
            return CallViews{s.routed(t), call.shared.matrix(), s.model_at(t * kDLatent, t)};
          }),
      kOk);
}

TEST(LatentTailValidation, RoutedMustNotOverlapShared) {
  const std::int64_t t = 3;
  expect_every_rank(
      storage_outcome(
          t,
          [&](SharedStorage& s, Call& call) {
            return CallViews{s.routed(t), s.model_at(t * kDLatent - 1, t), call.out.matrix()};
          }),
      "rank 0: routed: must not overlap shared");
}

TEST(LatentTailValidation, OutIsEitherSharedItselfOrApartFromIt) {
  const std::int64_t t = 3;
  expect_every_rank(
      storage_outcome(t,
                      [&](SharedStorage& s, Call& call) {
                        return CallViews{call.routed.matrix(), s.model_at(0, t), s.model_at(1, t)};
                      }),
      "rank 0: out: must be either the shared buffer itself or not overlap it");
  // out == shared is the documented in-place form.
  expect_every_rank(
      call_outcome(
          2, t,
          [](int, Call& call) {
            return CallViews{call.routed.matrix(), call.shared.matrix(), call.shared.matrix()};
          }),
      kOk);
}

// ---------------------------------------------------------------------------------------------
// The constructor

std::vector<std::string> construct_outcome(
    int tp, const std::function<TailOptions(int)>& make_options,
    const std::function<Weights(int)>& make_weights,
    const std::function<ConstMatrixView(int, const Weights&)>& norm_view = nullptr,
    const std::function<ConstMatrixView(int, const Weights&)>& up_view = nullptr) {
  return per_rank_outcome(tp, [&](int rank, Communicator& comm) {
    const Weights weights = make_weights(rank);
    const ConstMatrixView norm = norm_view ? norm_view(rank, weights) : weights.norm.matrix();
    const ConstMatrixView up = up_view ? up_view(rank, weights) : weights.up.matrix();
    LatentTail tail(make_options(rank), comm, norm, up);
  });
}

TEST(LatentTailValidation, DModelMustBePositive) {
  for (std::int64_t d_model : {std::int64_t{0}, std::int64_t{-96}}) {
    const std::string message = "d_model: expected a positive size, got " + std::to_string(d_model);
    // With one rank there is nobody to tell: the message comes without a rank.
    expect_every_rank(construct_outcome(
                          1, [&](int) { return options(d_model); }, [](int) { return Weights(); }),
                      message);
    expect_every_rank(construct_outcome(
                          2, [&](int) { return options(d_model); }, [](int) { return Weights(); }),
                      "rank 0: " + message);
  }
  // ±1: d_model = 1 is a valid size.
  expect_every_rank(construct_outcome(
                        2, [](int) { return options(1); }, [](int) { return Weights(1); }),
                    kOk);
}

TEST(LatentTailValidation, HandBuiltTierRangesAreCheckedLikeATablesOnEveryRank) {
  using lmoe::TierRange;
  auto with_ranges = [](std::vector<TierRange> ranges) {
    return [ranges](int) {
      TailOptions opts = options();
      opts.policy.ranges.value = ranges;
      return opts;
    };
  };
  const auto weights = [](int) { return Weights(); };
  expect_every_rank(construct_outcome(2,
                                      with_ranges({{64, TailTier::overlap},
                                                   {16, TailTier::column},
                                                   {std::nullopt, TailTier::token}}),
                                      weights),
                    "rank 0: policy.ranges[1].max_tokens: expected more than the previous piece's "
                    "64 (pieces rise in T), got 16");
  expect_every_rank(construct_outcome(2, with_ranges({{64, TailTier::overlap}}), weights),
                    "rank 0: policy.ranges[0].max_tokens: the last piece must be unbounded (null) "
                    "so that every T has a tier, got 64");
  expect_every_rank(construct_outcome(2,
                                      with_ranges({{45, TailTier::column},
                                                   {512, TailTier::overlap},
                                                   {std::nullopt, TailTier::token}}),
                                      weights),
                    kOk);
}

TEST(LatentTailValidation, DLatentMustBePositive) {
  expect_every_rank(construct_outcome(
                        2, [](int) { return options(kDModel, 0); }, [](int) { return Weights(); }),
                    "rank 0: d_latent: expected a positive size, got 0");
}

TEST(LatentTailValidation, EpsMustBeFiniteAndNonNegative) {
  auto with_eps = [](float eps) {
    return [eps](int) {
      TailOptions opts = options();
      opts.rms_norm_eps = eps;
      return opts;
    };
  };
  const auto weights = [](int) { return Weights(); };
  expect_every_rank(construct_outcome(2, with_eps(-1e-6f), weights),
                    "rank 0: rms_norm_eps: expected a finite value >= 0, got -0.000001");
  expect_every_rank(
      construct_outcome(2, with_eps(-std::numeric_limits<float>::denorm_min()), weights),
      "rank 0: rms_norm_eps: expected a finite value >= 0, got -0.000000");
  expect_every_rank(
      construct_outcome(2, with_eps(std::numeric_limits<float>::quiet_NaN()), weights),
      "rank 0: rms_norm_eps: expected a finite value >= 0, got nan");
  expect_every_rank(construct_outcome(2, with_eps(std::numeric_limits<float>::infinity()), weights),
                    "rank 0: rms_norm_eps: expected a finite value >= 0, got inf");
  // ±1: zero is allowed.
  expect_every_rank(construct_outcome(2, with_eps(0.0f), weights), kOk);
}

TEST(LatentTailValidation, UnavailableBackendFailsEveryRank) {
  if (lmoe::backend_available(lmoe::Backend::cuda))
    GTEST_SKIP() << "this machine can run the cuda backend";
  expect_every_rank(construct_outcome(
                        2,
                        [](int) {
                          TailOptions opts = options();
                          opts.backend = lmoe::Backend::cuda;
                          return opts;
                        },
                        [](int) { return Weights(); }),
                    "rank 0: backend cuda is not available in this build or on this machine");
}

TEST(LatentTailValidation, NormWeightShape) {
  const auto opts = [](int) { return options(); };
  expect_every_rank(construct_outcome(
                        2, opts, [](int) { return Weights(kDModel, kDLatent); },
                        [](int, const Weights& w) {
                          ConstMatrixView v = w.norm.matrix();
                          v.cols = kDLatent - 1;
                          v.ld = kDLatent - 1;
                          return v;
                        }),
                    "rank 0: norm_weight: expected shape [1, 48], got [1, 47]");
  expect_every_rank(
      construct_outcome(
          2, opts, [](int) { return Weights(); },
          [](int, const Weights& w) { return ConstMatrixView(w.up.matrix().row_block(0, 2)); }),
      "rank 0: norm_weight: expected shape [1, 48], got [2, 48]");
  // A column [l, 1] is accepted as the same vector.
  expect_every_rank(construct_outcome(
                        2, opts, [](int) { return Weights(); },
                        [](int, const Weights& w) {
                          ConstMatrixView v = w.norm.matrix();
                          v.rows = kDLatent;
                          v.cols = 1;
                          v.ld = 1;
                          return v;
                        }),
                    kOk);
  expect_every_rank(
      construct_outcome(2, opts, [](int) { return Weights(kDModel, kDLatent, DType::f16); }),
      "rank 0: norm_weight: expected dtype bf16, got f16");
}

TEST(LatentTailValidation, UpProjWeightShape) {
  const auto opts = [](int) { return options(); };
  auto up_rows_cols = [](std::int64_t rows, std::int64_t cols) {
    return [rows, cols](int, const Weights& w) {
      ConstMatrixView v = w.up.matrix();
      v.rows = rows;
      v.cols = cols;
      v.ld = cols;
      return v;
    };
  };
  const auto weights = [](int) { return Weights(); };
  expect_every_rank(
      construct_outcome(2, opts, weights, nullptr, up_rows_cols(kDModel, kDLatent - 1)),
      "rank 0: up_proj_weight: expected shape [96, 48], got [96, 47]");
  expect_every_rank(
      construct_outcome(2, opts, weights, nullptr, up_rows_cols(kDModel - 1, kDLatent)),
      "rank 0: up_proj_weight: expected shape [96, 48], got [95, 48]");
  // Transposed ([l, d] instead of [d, l]) is the mistake this check exists for.
  expect_every_rank(construct_outcome(2, opts, weights, nullptr, up_rows_cols(kDLatent, kDModel)),
                    "rank 0: up_proj_weight: expected shape [96, 48], got [48, 96]");
}

TEST(LatentTailValidation, OneRanksBadWeightFailsEveryRank) {
  expect_every_rank(construct_outcome(
                        3, [](int) { return options(); }, [](int) { return Weights(); }, nullptr,
                        [](int rank, const Weights& w) {
                          ConstMatrixView v = w.up.matrix();
                          if (rank == 2) v.rows = kDModel - 1;
                          return v;
                        }),
                    "rank 2: up_proj_weight: expected shape [96, 48], got [95, 48]");
}

TEST(LatentTailValidation, RanksWithDifferentEpsDisagreeOnTheConfiguration) {
  const auto outcome = construct_outcome(
      2,
      [](int rank) {
        TailOptions opts = options();
        opts.rms_norm_eps = rank == 1 ? 2e-5f : 1e-5f;
        return opts;
      },
      [](int) { return Weights(); });
  for (const std::string& message : outcome) {
    EXPECT_THAT(
        message,
        StartsWith("ranks disagree on the configuration: rank 0 has d_model=96 d_latent=48 "
                   "latent_norm=true eps=1e-05 dtype=bf16 backend=cpu max_tokens=0 weights="));
    EXPECT_THAT(message, HasSubstr("; rank 1 has d_model=96 d_latent=48 latent_norm=true eps=2e-05 "
                                   "dtype=bf16 backend=cpu"));
  }
  EXPECT_EQ(outcome[0], outcome[1]);
}

TEST(LatentTailValidation, RanksWithAndWithoutTheLatentNormDisagree) {
  const auto outcome = construct_outcome(
      2,
      [](int rank) {
        TailOptions opts = options();
        opts.latent_norm = rank == 0;
        return opts;
      },
      [](int) { return Weights(); });
  for (const std::string& message : outcome) {
    EXPECT_THAT(message, HasSubstr("rank 0 has d_model=96 d_latent=48 latent_norm=true"));
    EXPECT_THAT(message, HasSubstr("rank 1 has d_model=96 d_latent=48 latent_norm=false"));
  }
}

TEST(LatentTailValidation, RanksWithDifferentWeightsDisagreeOnTheConfiguration) {
  // One element of one weight differs on the last rank: replicated weights must be identical.
  auto nudged = [](bool norm) {
    return [norm](int rank) {
      Weights w;
      if (rank == 2) {
        HostTensor& t = norm ? w.norm : w.up;
        t.set(7, t.get(7) + 1.0f);
      }
      return w;
    };
  };
  for (bool norm : {true, false}) {
    const auto outcome = construct_outcome(
        3, [](int) { return options(); }, nudged(norm));
    for (const std::string& message : outcome) {
      EXPECT_THAT(message, StartsWith("ranks disagree on the configuration: rank 0 has ")) << norm;
      EXPECT_THAT(message, HasSubstr("; rank 2 has ")) << norm;
    }
    EXPECT_EQ(outcome[0], outcome[1]);
    EXPECT_EQ(outcome[0], outcome[2]);
  }
}

// Ranks whose tier policies differ would run different tiers for one T (and capture different
// graph bodies), so construction refuses them on every rank, naming the settings that differ.
TEST(LatentTailValidation, RanksWithDifferentTierPoliciesAreRefusedOnEveryRank) {
  const auto weights = [](int) { return Weights(); };
  const auto on_last_rank = [](int tp, std::function<void(lmoe::PolicyConfig&)> change) {
    return [tp, change](int rank) {
      TailOptions opts = options();
      if (rank == tp - 1) change(opts.policy);
      return opts;
    };
  };
  for (int tp : {2, 3}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    const std::string last = "rank " + std::to_string(tp - 1) + " ";
    expect_every_rank(construct_outcome(tp,
                                        on_last_rank(tp,
                                                     [](lmoe::PolicyConfig& policy) {
                                                       policy.fused_max_tokens.value = 64;
                                                     }),
                                        weights),
                      "ranks' tier policies differ: rank 0 fused_max_tokens=128, " + last +
                          "fused_max_tokens=64");
    expect_every_rank(construct_outcome(tp,
                                        on_last_rank(tp,
                                                     [](lmoe::PolicyConfig& policy) {
                                                       policy.forced_tier.value =
                                                           lmoe::TailTier::column;
                                                     }),
                                        weights),
                      "ranks' tier policies differ: rank 0 tier=auto, " + last + "tier=column");
    expect_every_rank(
        construct_outcome(tp,
                          on_last_rank(tp,
                                       [](lmoe::PolicyConfig& policy) {
                                         policy.overlap_disabled.value = true;
                                         policy.column_max_tokens.value = 4096;
                                       }),
                          weights),
        "ranks' tier policies differ: rank 0 column_max_tokens=none overlap_disabled=false, " +
            last + "column_max_tokens=4096 overlap_disabled=true");
    // A table read on one rank only.
    expect_every_rank(
        construct_outcome(
            tp,
            on_last_rank(tp,
                         [](lmoe::PolicyConfig& policy) {
                           lmoe::apply_tier_table(
                               policy,
                               R"({"format": "lmoe-tier-table", "version": 1, "breakpoints": )"
                               R"({"fused_max_tokens": 16, "overlap_max_tokens": 200, )"
                               R"("column_max_tokens": null}})",
                               "table t.json");
                         }),
            weights),
        "ranks' tier policies differ: rank 0 fused_max_tokens=128 overlap_max_tokens=256, " + last +
            "fused_max_tokens=16 overlap_max_tokens=200");
    expect_every_rank(
        construct_outcome(tp,
                          on_last_rank(tp,
                                       [](lmoe::PolicyConfig& policy) {
                                         policy.ranges.value = {
                                             {45, lmoe::TailTier::column},
                                             {std::nullopt, lmoe::TailTier::overlap}};
                                       }),
                          weights),
        "ranks' tier policies differ: rank 0 ranges=none, " + last + "ranges=column<=45,overlap");
    // The same values from another origin are agreement.
    expect_every_rank(construct_outcome(tp,
                                        on_last_rank(tp,
                                                     [](lmoe::PolicyConfig& policy) {
                                                       policy.fused_max_tokens = {
                                                           128, lmoe::SettingSource::environment,
                                                           "LMOE_FUSED_MAX_TOKENS=128"};
                                                     }),
                                        weights),
                      kOk);
  }
}

// ---------------------------------------------------------------------------------------------
// One rank differs in its call

TEST(LatentTailValidation, OneRankWithABadShapeFailsEveryRankWithItsMessage) {
  for (int tp : {2, 3, 4}) {
    for (int bad_rank = 0; bad_rank < tp; ++bad_rank) {
      const auto outcome = call_outcome(tp, 3, [&](int rank, Call& call) {
        auto views = good_views(call);
        if (rank == bad_rank) {
          views.routed.cols = kDLatent - 1;
          views.routed.ld = kDLatent - 1;
        }
        return views;
      });
      expect_every_rank(outcome, "rank " + std::to_string(bad_rank) +
                                     ": routed: expected shape [3, 48], got [3, 47]");
    }
  }
}

TEST(LatentTailValidation, TheLowestBadRankIsReported) {
  const auto outcome = call_outcome(4, 3, [](int rank, Call& call) {
    auto views = good_views(call);
    if (rank == 3) views.out.rows = 2;
    if (rank == 1) views.shared.rows = 1;
    return views;
  });
  expect_every_rank(outcome, "rank 1: shared: expected shape [3, 96], got [1, 96]");
}

// One rank's call: its T and the tier it forces (none: the policy's).
struct RankCall {
  std::int64_t tokens;
  std::optional<TailTier> tier = std::nullopt;
};

// Good tensors on every rank, each rank calling with what `call_of(rank)` says.
std::vector<std::string> calls_outcome(int tp, const std::function<RankCall(int rank)>& call_of) {
  const Weights weights;
  return per_rank_outcome(tp, [&](int rank, Communicator& comm) {
    LatentTail tail(options(), comm, weights.norm.matrix(), weights.up.matrix());
    const RankCall rank_call = call_of(rank);
    Call call(rank_call.tokens, rank);
    tail.forward(call.routed.matrix(), call.shared.matrix(), call.out.matrix(), rank_call.tier);
  });
}

TEST(LatentTailValidation, RanksWithDifferentTokenCountsDisagreeOnTheCall) {
  expect_every_rank(
      calls_outcome(2, [](int rank) { return RankCall{rank == 0 ? 3 : 4}; }),
      "ranks disagree on the call: rank 0 has T=3 tier=fused, rank 1 has T=4 tier=fused");
}

TEST(LatentTailValidation, ZeroTokensOnOneRankOnlyIsADisagreementNotNoWork) {
  // The rank with T = 0 must not return early while its peers wait for it in a collective.
  expect_every_rank(
      calls_outcome(3, [](int rank) { return RankCall{rank == 1 ? 0 : 3}; }),
      "ranks disagree on the call: rank 0 has T=3 tier=fused, rank 1 has T=0 tier=none");
}

TEST(LatentTailValidation, RanksForcingDifferentTiersDisagreeOnTheCall) {
  expect_every_rank(
      calls_outcome(
          2,
          [](int rank) {
            return RankCall{3, rank == 0 ? std::optional(TailTier::column) : std::nullopt};
          }),
      "ranks disagree on the call: rank 0 has T=3 tier=column, rank 1 has T=3 tier=fused");
}

TEST(LatentTailValidation, AFailedCallLeavesTheRanksInStep) {
  // After every rank threw, the next good call runs normally (no half-finished collective).
  const Weights weights;
  const auto outcome = per_rank_outcome(3, [&](int rank, Communicator& comm) {
    LatentTail tail(options(), comm, weights.norm.matrix(), weights.up.matrix());
    Call bad(3, rank);
    MatrixView short_out = bad.out.matrix();
    if (rank == 2) short_out.rows = 2;
    EXPECT_THROW(tail.forward(bad.routed.matrix(), bad.shared.matrix(), short_out), lmoe::Error);
    Call good(3, rank);
    EXPECT_EQ(tail.forward(good.routed.matrix(), good.shared.matrix(), good.out.matrix()),
              std::optional(TailTier::fused));
    EXPECT_FALSE(all_bytes_are(good.out, kPoison));
  });
  expect_every_rank(outcome, kOk);
}

// ---------------------------------------------------------------------------------------------
// T = 0, T < tp, d % tp

TEST(LatentTailValidation, ZeroTokensReturnsNothingAndTouchesNothing) {
  const Weights weights;
  for (int tp : {1, 2, 3}) {
    const auto outcome = per_rank_outcome(tp, [&](int rank, Communicator& comm) {
      LatentTail tail(options(), comm, weights.norm.matrix(), weights.up.matrix());
      // Zero-row views over poisoned storage: nothing behind them may be written.
      HostTensor storage(DType::bf16, {3, kDModel});
      storage.fill_bytes(kPoison);
      HostTensor routed_storage(DType::bf16, {3, kDLatent});
      fill_random(routed_storage, 9);
      MatrixView out = storage.matrix().row_block(0, 0);
      MatrixView shared = storage.matrix().row_block(1, 0);
      for (std::optional<TailTier> tier :
           {std::optional<TailTier>(), std::optional(TailTier::token)}) {
        EXPECT_EQ(
            tail.forward(as_const(routed_storage.matrix().row_block(0, 0)), shared, out, tier),
            std::nullopt)
            << "rank " << rank;
      }
      EXPECT_TRUE(all_bytes_are(storage, kPoison)) << "rank " << rank;
    });
    expect_every_rank(outcome, kOk);
  }
}

TEST(LatentTailValidation, ForcingTokenWithFewerTokensThanRanks) {
  const std::string message =
      "rank 0: tier token cannot run T=1: T=1 < tp=2 (the tier gives every rank at least one token "
      "row)";
  const auto outcome = call_outcome(
      2, 1, [](int, Call& call) { return good_views(call); }, TailTier::token);
  expect_every_rank(outcome, message);
  for (const std::string& got : outcome) EXPECT_THAT(got, HasSubstr("T=1 < tp=2"));
  // ±1: T = tp is enough.
  expect_every_rank(call_outcome(
                        2, 2, [](int, Call& call) { return good_views(call); }, TailTier::token),
                    kOk);
  // Left to the policy, T=1 does not pick token at all.
  expect_every_rank(call_outcome(2, 1, [](int, Call& call) { return good_views(call); }), kOk);
}

TEST(LatentTailValidation, StripedTiersDeclineAHiddenSizeNotDivisibleByTp) {
  const int tp = 4;
  const std::int64_t d_model = 90;  // 90 % 4 = 2
  const std::int64_t tokens = 5;
  const std::string why =
      "d_model=90 is not divisible by tp=4 (the tier splits the hidden size into tp stripes)";
  const lmoe::TailCase c =
      lmoe::make_random_case({d_model, kDLatent}, 1e-5f, DType::bf16, tp, tokens, 23);
  std::vector<HostTensor> outs(tp);
  std::vector<std::optional<TailTier>> ran(tp);
  std::vector<std::string> forced_column(tp), forced_fused(tp);
  const auto outcome = per_rank_outcome(tp, [&](int rank, Communicator& comm) {
    TailOptions opts = options(d_model);
    opts.rms_norm_eps = c.eps;
    LatentTail tail(opts, comm, c.norm_weight.matrix(), c.up_proj_weight.matrix());
    const lmoe::TierSupport support = tail.support(tokens);
    EXPECT_EQ(support.declined[static_cast<std::size_t>(TailTier::fused)], why);
    EXPECT_EQ(support.declined[static_cast<std::size_t>(TailTier::column)], why);
    EXPECT_EQ(support.declined[static_cast<std::size_t>(TailTier::overlap)], std::nullopt);
    EXPECT_EQ(support.declined[static_cast<std::size_t>(TailTier::token)], std::nullopt);
    EXPECT_EQ(tail.decide(tokens).tier, std::optional(TailTier::overlap));
    EXPECT_THAT(tail.explain(tokens), HasSubstr("fused    declined: " + why));
    // Large T prefers column, which is declined too: token takes over.
    EXPECT_EQ(tail.decide(1000).tier, std::optional(TailTier::token));

    HostTensor shared(DType::bf16, {tokens, d_model});
    std::memcpy(shared.data(), c.shared.slice_matrix(rank).data, shared.nbytes());
    HostTensor out(DType::bf16, {tokens, d_model});
    out.fill_bytes(kPoison);
    for (TailTier tier : {TailTier::column, TailTier::fused}) {
      try {
        tail.forward(c.routed.slice_matrix(rank), shared.matrix(), out.matrix(), tier);
        ADD_FAILURE() << "forced " << lmoe::tier_name(tier) << " ran with d % tp != 0";
      } catch (const lmoe::Error& error) {
        (tier == TailTier::column ? forced_column : forced_fused)[rank] = error.message();
      }
      EXPECT_TRUE(all_bytes_are(out, kPoison));
    }
    outs[rank] = HostTensor(DType::bf16, {tokens, d_model});
    outs[rank].fill_bytes(kPoison);
    ran[rank] = tail.forward(c.routed.slice_matrix(rank), shared.matrix(), outs[rank].matrix());
  });
  expect_every_rank(outcome, kOk);
  expect_every_rank(forced_column, "rank 0: tier column cannot run T=5: " + why);
  expect_every_rank(forced_fused, "rank 0: tier fused cannot run T=5: " + why);
  const auto reference = lmoe::reference_tail(c, lmoe::contract_of(TailTier::overlap));
  for (int r = 0; r < tp; ++r) {
    EXPECT_EQ(ran[r], std::optional(TailTier::overlap)) << "rank " << r;
    EXPECT_EQ(std::memcmp(outs[r].data(), reference.y.data(), reference.y.nbytes()), 0)
        << "rank " << r;
  }
}

TEST(LatentTailValidation, StripedTiersRunWhenTpDividesTheHiddenSize) {
  // ±1 around the divisibility rule: d = 92 = 4 · 23 is fine for the striped tiers.
  const Weights weights(92);
  for (TailTier tier : {TailTier::fused, TailTier::column}) {
    const auto outcome = per_rank_outcome(4, [&](int rank, Communicator& comm) {
      LatentTail tail(options(92), comm, weights.norm.matrix(), weights.up.matrix());
      EXPECT_EQ(tail.support(5).declined[static_cast<std::size_t>(tier)], std::nullopt);
      Call call(5, rank, 92);
      EXPECT_EQ(tail.forward(call.routed.matrix(), call.shared.matrix(), call.out.matrix(), tier),
                std::optional(tier));
    });
    expect_every_rank(outcome, kOk);
  }
}

// ---------------------------------------------------------------------------------------------
// The checks on their own (no communicator)

TEST(ValidationFunctions, GenericTierLimits) {
  lmoe::TailProblem problem{5, {96, 48}, DType::bf16, 4};
  EXPECT_EQ(lmoe::generic_tier_limit(TailTier::fused, problem), std::nullopt);
  EXPECT_EQ(lmoe::generic_tier_limit(TailTier::token, problem), std::nullopt);
  problem.num_tokens = 4;  // T = tp
  EXPECT_EQ(lmoe::generic_tier_limit(TailTier::token, problem), std::nullopt);
  problem.num_tokens = 3;  // T = tp − 1
  EXPECT_EQ(
      lmoe::generic_tier_limit(TailTier::token, problem),
      std::optional<std::string>("T=3 < tp=4 (the tier gives every rank at least one token row)"));
  problem.dims.d_model = 97;
  EXPECT_THAT(lmoe::generic_tier_limit(TailTier::column, problem).value_or(""),
              StartsWith("d_model=97 is not divisible by tp=4"));
  EXPECT_EQ(lmoe::generic_tier_limit(TailTier::overlap, problem), std::nullopt);
}

// max_tokens bounds T (±1 around it) and cannot be negative.
TEST(LatentTailValidation, MaxTokensBoundsTheCall) {
  const auto views = [](int, Call& call) { return good_views(call); };
  expect_every_rank(call_outcome(2, 5, views, std::nullopt, 5), kOk);
  expect_every_rank(call_outcome(2, 4, views, std::nullopt, 5), kOk);
  expect_every_rank(
      call_outcome(2, 6, views, std::nullopt, 5),
      "rank 0: routed: expected at most max_tokens=5 rows (set at construction), got 6 rows");
  expect_every_rank(
      construct_outcome(
          2,
          [](int) {
            TailOptions opts = options();
            opts.max_tokens = -1;
            return opts;
          },
          [](int) { return Weights(); }),
      "rank 0: max_tokens: expected 0 (grow on demand) or a positive token count, got -1");
}

}  // namespace

// The routed experts' device path, piece by piece: the device sort of the slots against the host
// counting sort (bit for bit, on crafted and random routings), the row gather (every copy width, a
// source pitch, a row count on the device), and the grouped GEMM against fp64 on
// ragged groups (0, 1, 7, 8, 9 and 300 rows; K and N not multiples of any tile), every tile shape
// bit-identical to the others (the wgmma tiles, compute 9.0 only, also on 63, 64, 65, 128, 129,
// 200 and 300 rows), the rounded and activation outputs bit-identical to rounding and to
// the activation kernel applied to its fp32 output, and bad arguments refused with their reason.
// Every test skips where no GPU is visible.
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/random_routing.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/layer/layer_kernels.hpp"
#include "cuda/runtime/cuda_device_info.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "gpu_test_support.hpp"
#include "lmoe/dims.hpp"
#include "lmoe/tensor.hpp"

namespace {

using lmoe::DType;
using lmoe::HostTensor;
using lmoe::cuda::DeviceBuffer;
using lmoe::cuda::GroupedGemmArgs;
using lmoe::cuda::GroupedOut;
using lmoe::cuda::GroupedTile;
using ::testing::HasSubstr;

constexpr std::int32_t kPoison = 0x7f7f7f7f;

template <typename T>
DeviceBuffer to_device(const std::vector<T>& values) {
  DeviceBuffer buffer(values.size() * sizeof(T));
  if (!values.empty()) {
    EXPECT_EQ(cudaMemcpy(buffer.data(), values.data(), buffer.bytes(), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  return buffer;
}
DeviceBuffer to_device(const HostTensor& tensor) {
  DeviceBuffer buffer(tensor.nbytes());
  EXPECT_EQ(cudaMemcpy(buffer.data(), tensor.data(), tensor.nbytes(), cudaMemcpyHostToDevice),
            cudaSuccess);
  return buffer;
}
template <typename T>
std::vector<T> to_host(const DeviceBuffer& buffer, std::size_t count) {
  std::vector<T> values(count);
  if (count) {
    EXPECT_EQ(cudaMemcpy(values.data(), buffer.data(), count * sizeof(T), cudaMemcpyDeviceToHost),
              cudaSuccess);
  }
  return values;
}

// ---- the sort
// ------------------------------------------------------------------------------------

struct SlotOrder {
  std::vector<std::int32_t> first;         // [E + 1]
  std::vector<std::int32_t> row_of_slot;   // [S]
  std::vector<std::int32_t> token_of_row;  // [first[E]] (host), [bound] (device)
};

// The executor's host counting sort (cuda_layer_executor.cpp, sort_slots), the reference.
SlotOrder host_sort(const std::vector<std::int32_t>& ids, std::int64_t experts, std::int64_t top_k,
                    std::int64_t align) {
  SlotOrder order;
  order.first.assign(static_cast<std::size_t>(experts + 1), 0);
  for (const std::int32_t e : ids) ++order.first[e + 1];
  for (std::int64_t e = 0; e < experts; ++e) {
    order.first[e + 1] = order.first[e] + static_cast<std::int32_t>(
                                              (order.first[e + 1] + align - 1) / align * align);
  }
  order.token_of_row.assign(static_cast<std::size_t>(order.first[experts]), 0);
  order.row_of_slot.resize(ids.size());
  std::vector<std::int32_t> next(order.first.begin(), order.first.end() - 1);
  for (std::size_t s = 0; s < ids.size(); ++s) {
    const std::int32_t row = next[ids[s]]++;
    order.token_of_row[row] = static_cast<std::int32_t>(s / top_k);
    order.row_of_slot[s] = row;
  }
  return order;
}

// The device sort with every output poisoned first; token_of_row holds the whole bound.
SlotOrder device_sort(const std::vector<std::int32_t>& ids, std::int64_t experts,
                      std::int64_t top_k, std::int64_t align) {
  const std::int64_t slots = static_cast<std::int64_t>(ids.size());
  const std::int64_t bound = slots + (align - 1) * std::min(experts, slots);
  const DeviceBuffer d_ids = to_device(ids);
  const DeviceBuffer first(sizeof(std::int32_t) * (experts + 1));
  const DeviceBuffer row_of_slot(sizeof(std::int32_t) * std::max<std::int64_t>(slots, 1));
  const DeviceBuffer token_of_row(sizeof(std::int32_t) * std::max<std::int64_t>(bound, 1));
  for (const DeviceBuffer* buffer : {&first, &row_of_slot, &token_of_row}) {
    EXPECT_EQ(cudaMemset(buffer->data(), 0x7f, buffer->bytes()), cudaSuccess);
  }
  EXPECT_EQ(
      lmoe::cuda::launch_sort_slots(static_cast<const std::int32_t*>(d_ids.data()), slots, experts,
                                    top_k, align, static_cast<std::int32_t*>(first.data()),
                                    static_cast<std::int32_t*>(row_of_slot.data()),
                                    static_cast<std::int32_t*>(token_of_row.data()), nullptr),
      cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  SlotOrder order;
  order.first = to_host<std::int32_t>(first, static_cast<std::size_t>(experts + 1));
  order.row_of_slot = to_host<std::int32_t>(row_of_slot, static_cast<std::size_t>(slots));
  order.token_of_row = to_host<std::int32_t>(token_of_row, static_cast<std::size_t>(bound));
  return order;
}

void expect_same_order(const std::vector<std::int32_t>& ids, std::int64_t experts,
                       std::int64_t top_k) {
  constexpr std::int64_t kAlign = 8;  // the executor's
  const SlotOrder want = host_sort(ids, experts, top_k, kAlign);
  const SlotOrder got = device_sort(ids, experts, top_k, kAlign);
  EXPECT_EQ(got.first, want.first);
  EXPECT_EQ(got.row_of_slot, want.row_of_slot);
  const std::size_t rows = static_cast<std::size_t>(want.first.back());
  ASSERT_GE(got.token_of_row.size(), rows);
  EXPECT_TRUE(
      std::equal(want.token_of_row.begin(), want.token_of_row.end(), got.token_of_row.begin()));
  // The bound's slack past first[E] is not written.
  for (std::size_t r = rows; r < got.token_of_row.size(); ++r)
    ASSERT_EQ(got.token_of_row[r], kPoison) << r;
}

TEST(DeviceSlotSort, MatchesTheHostSortOnCraftedRoutings) {
  SKIP_WITHOUT_GPU();
  {
    SCOPED_TRACE("most experts empty, T·k = 14 (not a multiple of 8)");
    std::vector<std::int32_t> ids;
    for (int t = 0; t < 7; ++t)
      ids.insert(ids.end(), {t % 2 == 0 ? 5 : 2, t % 3 == 0 ? 7 : 5 - 3 * (t % 2)});
    expect_same_order(ids, 8, 2);
  }
  {
    SCOPED_TRACE("one expert takes every slot");
    expect_same_order(std::vector<std::int32_t>(300, 11), 16, 1);
  }
  {
    SCOPED_TRACE("the same expert twice in a token, in descending expert order");
    std::vector<std::int32_t> ids;
    for (int t = 0; t < 45; ++t) ids.insert(ids.end(), {3, 3, 2, 1, 0});
    expect_same_order(ids, 4, 5);
  }
  {
    SCOPED_TRACE("the largest E, every expert once");
    std::vector<std::int32_t> ids(1024);
    std::iota(ids.rbegin(), ids.rend(), 0);
    expect_same_order(ids, 1024, 32);
  }
  {
    SCOPED_TRACE("no slots");
    expect_same_order({}, 8, 2);
  }
}

TEST(DeviceSlotSort, MatchesTheHostSortOnRandomRoutings) {
  SKIP_WITHOUT_GPU();
  for (const std::int64_t tokens : {1, 7, 64, 300, 8192}) {
    for (const auto& [experts, top_k] :
         {std::pair<std::int64_t, std::int64_t>{896, 16}, {64, 22}, {1024, 32}, {40, 3}}) {
      SCOPED_TRACE("T=" + std::to_string(tokens) + " E=" + std::to_string(experts) +
                   " k=" + std::to_string(top_k));
      expect_same_order(lmoe::random_routing(tokens, experts, top_k,
                                             static_cast<std::uint32_t>(tokens * 31 + experts)),
                        experts, top_k);
    }
  }
}

// Refused before any CUDA call: runs without a GPU too.
TEST(DeviceSlotSort, RefusesMoreExpertsThanOneBlockScans) {
  EXPECT_EQ(lmoe::cuda::launch_sort_slots(nullptr, 0, lmoe::cuda::kSortMaxExperts + 1, 1, 8,
                                          nullptr, nullptr, nullptr, nullptr),
            cudaErrorInvalidValue);
}

// ---- the row gather (the staging of gathered rows, and the host path's gather)
// -------------------

// Every copy width: rows of 24, 12, 6 and 3 bf16 from a source pitch 8 elements wider (48, 24, 12
// and 6 bytes per row, with a 64-, 40-, 28- and 22-byte pitch: 16-, 8-, 4- and 2-byte units); with
// a row count read on the device, the rows past it are left alone.
TEST(GatherRows, CopiesTheRowsAtEveryWidthUpToTheDeviceCount) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::int32_t> rows = {3, 0, 9, 9, 5, 1, 7};
  const std::int64_t count = static_cast<std::int64_t>(rows.size()), src_rows = 10;
  for (const std::int64_t cols : {24, 12, 6, 3}) {
    const std::int64_t src_ld = cols + 8;
    std::vector<std::uint16_t> src(static_cast<std::size_t>(src_rows * src_ld));
    for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::uint16_t>(i * 7 + 1);
    const DeviceBuffer d_src = to_device(src), d_rows = to_device(rows);
    for (const std::int32_t device_count : {-1, 5, 0}) {  // -1: no device count
      SCOPED_TRACE("cols " + std::to_string(cols) + ", device count " +
                   std::to_string(device_count));
      const DeviceBuffer d_count = to_device(std::vector<std::int32_t>{device_count});
      DeviceBuffer dst(static_cast<std::size_t>(count * cols) * sizeof(std::uint16_t));
      ASSERT_EQ(cudaMemset(dst.data(), 0xff, dst.bytes()), cudaSuccess);
      ASSERT_EQ(lmoe::cuda::launch_gather_rows(
                    d_src.data(), src_ld, static_cast<const std::int32_t*>(d_rows.data()),
                    dst.data(), count, cols, DType::bf16, nullptr,
                    device_count < 0 ? nullptr : static_cast<const std::int32_t*>(d_count.data())),
                cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<std::uint16_t> got =
          to_host<std::uint16_t>(dst, static_cast<std::size_t>(count * cols));
      const std::int64_t copied = device_count < 0 ? count : device_count;
      for (std::int64_t r = 0; r < count; ++r) {
        for (std::int64_t c = 0; c < cols; ++c) {
          const std::uint16_t want =
              r < copied ? src[static_cast<std::size_t>(rows[r] * src_ld + c)] : 0xffff;
          ASSERT_EQ(got[static_cast<std::size_t>(r * cols + c)], want)
              << "row " << r << " col " << c;
        }
      }
    }
  }
}

// Refused before any CUDA call: runs without a GPU too.
TEST(GatherRows, RefusesASourcePitchNarrowerThanTheRows) {
  EXPECT_EQ(
      lmoe::cuda::launch_gather_rows(nullptr, 7, nullptr, nullptr, 4, 8, DType::bf16, nullptr),
      cudaErrorInvalidValue);
  EXPECT_EQ(
      lmoe::cuda::launch_gather_rows(nullptr, 8, nullptr, nullptr, -1, 8, DType::bf16, nullptr),
      cudaErrorInvalidValue);
}

// ---- the grouped GEMM
// ----------------------------------------------------------------------------

constexpr double kUnit = 1.0 / (1 << 24);

struct Problem {
  std::vector<std::int32_t> first;   // [groups + 1]
  std::int64_t rows = 0;             // first[groups]
  std::int64_t a_rows_total = 0;     // rows of A (the gather's source has more than `rows`)
  std::vector<std::int32_t> a_rows;  // empty: identity
  HostTensor a, b, b2;               // [a_rows_total, k], [groups, n, k] (b2: the gate)
  std::int64_t n = 0, k = 0;
};

Problem make_problem(const std::vector<int>& group_rows, std::int64_t n, std::int64_t k,
                     DType dtype, bool gather, std::uint32_t seed) {
  Problem p;
  p.n = n;
  p.k = k;
  p.first.push_back(0);
  for (const int rows : group_rows) p.first.push_back(p.first.back() + rows);
  p.rows = p.first.back();
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  p.a_rows_total = gather ? p.rows / 2 + 3 : p.rows;
  if (gather) {
    std::uniform_int_distribution<std::int32_t> pick(0,
                                                     static_cast<std::int32_t>(p.a_rows_total - 1));
    for (std::int64_t r = 0; r < p.rows; ++r) p.a_rows.push_back(pick(rng));
  }
  const std::int64_t groups = static_cast<std::int64_t>(group_rows.size());
  p.a = HostTensor(dtype, {std::max<std::int64_t>(p.a_rows_total, 1), k});
  p.b = HostTensor(dtype, {groups, n, k});
  p.b2 = HostTensor(dtype, {groups, n, k});
  for (HostTensor* t : {&p.a, &p.b, &p.b2}) {
    for (std::int64_t i = 0; i < t->numel(); ++i) t->set(i, value(rng));
  }
  return p;
}

// C [rows, n] in fp32 (or `dtype`) from one launch; every byte poisoned before it, plus `slack`
// rows past the groups that must stay poisoned.
struct GemmRun {
  std::vector<float> c;  // as floats, [rows + slack, n]
  std::vector<std::uint8_t> raw;
};

constexpr std::int64_t kSlackRows = 5;

// staged: gathered rows go through a_staging ([rows + kSlackRows, k], poisoned; max_rows then
// bounds the rows above first[groups], as the layer's does), whose rows past the groups must stay
// poisoned.
GemmRun run_grouped(const Problem& p, DType dtype, GroupedOut out, GroupedTile tile,
                    const lmoe::LayerConfig* act, bool with_gate, bool staged = false) {
  const DeviceBuffer a = to_device(p.a), b = to_device(p.b), b2 = to_device(p.b2);
  const DeviceBuffer first = to_device(p.first);
  const DeviceBuffer a_rows = to_device(p.a_rows);
  const DType out_dtype = out == GroupedOut::f32 ? DType::f32 : dtype;
  const std::int64_t total_rows = p.rows + kSlackRows;
  const std::size_t out_bytes =
      static_cast<std::size_t>(total_rows * p.n) * lmoe::dtype_size(out_dtype);
  const DeviceBuffer c(out_bytes);
  EXPECT_EQ(cudaMemset(c.data(), 0xff, c.bytes()), cudaSuccess);

  GroupedGemmArgs args;
  args.a = a.data();
  args.a_rows = p.a_rows.empty() ? nullptr : static_cast<const std::int32_t*>(a_rows.data());
  args.lda = p.k;
  args.b = b.data();
  args.b2 = with_gate ? b2.data() : nullptr;
  args.b_group_stride = p.n * p.k;
  args.c = c.data();
  args.ldc = p.n;
  args.n = p.n;
  args.k = p.k;
  args.first = static_cast<const std::int32_t*>(first.data());
  args.groups = static_cast<int>(p.first.size() - 1);
  args.max_rows = p.rows;
  args.max_groups = args.groups;
  args.dtype = dtype;
  args.out = out;
  args.activation = act;
  args.tile = tile;
  const std::size_t staging_bytes =
      staged ? static_cast<std::size_t>(total_rows * p.k) * lmoe::dtype_size(dtype) : 0;
  const DeviceBuffer staging(std::max<std::size_t>(staging_bytes, 1));
  if (staged) {
    EXPECT_EQ(cudaMemset(staging.data(), 0xff, staging.bytes()), cudaSuccess);
    args.a_staging = staging.data();
    args.max_rows = total_rows;
  }
  const auto why = lmoe::cuda::grouped_gemm_unsupported(args);
  EXPECT_FALSE(why.has_value()) << *why;
  EXPECT_EQ(lmoe::cuda::launch_grouped_gemm(args, nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  if (staged) {
    // The staged rows are A's gathered rows; past first[groups] nothing was copied. Rows whose
    // K is not a whole number of 16-byte units cannot be read by TMA: nothing is staged at all.
    const std::vector<std::uint8_t> rows = to_host<std::uint8_t>(staging, staging_bytes);
    const std::size_t row_bytes = static_cast<std::size_t>(p.k) * lmoe::dtype_size(dtype);
    const auto* a_bytes = reinterpret_cast<const std::uint8_t*>(p.a.data());
    const std::int64_t staged_rows = p.k % 8 == 0 ? p.rows : 0;
    std::int64_t wrong_rows = 0, written_past = 0;
    for (std::int64_t r = 0; r < staged_rows; ++r) {
      wrong_rows += std::memcmp(rows.data() + r * row_bytes, a_bytes + p.a_rows[r] * row_bytes,
                                row_bytes) != 0;
    }
    for (std::size_t i = static_cast<std::size_t>(staged_rows) * row_bytes; i < rows.size(); ++i) {
      written_past += rows[i] != 0xff;
    }
    EXPECT_EQ(wrong_rows, 0) << "staged rows that are not A's gathered rows";
    EXPECT_EQ(written_past, 0) << "staging bytes past the staged rows that were written";
  }

  GemmRun run;
  run.raw = to_host<std::uint8_t>(c, out_bytes);
  HostTensor host(out_dtype, {total_rows, p.n});
  std::memcpy(host.data(), run.raw.data(), out_bytes);
  run.c.resize(static_cast<std::size_t>(total_rows * p.n));
  for (std::int64_t i = 0; i < host.numel(); ++i) run.c[i] = host.get(i);
  return run;
}

// Every element of the groups against fp64 within fp32 accumulation's bound; the slack rows still
// poisoned (NaN).
void expect_matches_fp64(const Problem& p, const GemmRun& run, const HostTensor& b,
                         double rounding) {
  std::int64_t bad = 0;
  for (std::size_t g = 0; g + 1 < p.first.size(); ++g) {
    for (std::int64_t r = p.first[g]; r < p.first[g + 1]; ++r) {
      const std::int64_t src = p.a_rows.empty() ? r : p.a_rows[r];
      for (std::int64_t col = 0; col < p.n; ++col) {
        double exact = 0, magnitude = 0;
        for (std::int64_t i = 0; i < p.k; ++i) {
          const double product = static_cast<double>(p.a.get(src * p.k + i)) *
                                 b.get((static_cast<std::int64_t>(g) * p.n + col) * p.k + i);
          exact += product;
          magnitude += std::abs(product);
        }
        const double got = run.c[r * p.n + col];
        const double accumulation = 2.0 * static_cast<double>(p.k + 2) * kUnit * magnitude;
        const double bound = accumulation + rounding * (std::abs(exact) + accumulation);
        if (!(std::abs(got - exact) <= bound) && ++bad <= 5) {
          ADD_FAILURE() << "group " << g << " row " << r << " col " << col << ": " << got << " vs "
                        << exact << " (bound " << bound << ")";
        }
      }
    }
  }
  EXPECT_EQ(bad, 0);
  for (std::int64_t i = p.rows * p.n; i < static_cast<std::int64_t>(run.c.size()); ++i) {
    ASSERT_TRUE(std::isnan(run.c[i])) << "slack element " << i << " was written";
  }
}

// The fused activation of each tile against the activation kernel applied to the fp32 products
// `up` and `gate` (the gate's from b2), bit for bit, for each activation; slack rows untouched.
void expect_activation_matches(const Problem& p, DType dtype, const GemmRun& up,
                               const GemmRun& gate, std::initializer_list<GroupedTile> tiles) {
  for (const lmoe::ExpertActivation activation :
       {lmoe::ExpertActivation::silu_glu, lmoe::ExpertActivation::situ_glu,
        lmoe::ExpertActivation::relu2}) {
    lmoe::LayerConfig config;
    config.activation = activation;
    config.activation_beta = 1.5f;
    config.activation_linear_beta = 3.0f;
    const bool gated = lmoe::is_gated(activation);
    const std::size_t count = static_cast<std::size_t>(p.rows * p.n);
    const DeviceBuffer up_in = to_device(std::vector<float>(up.c.begin(), up.c.begin() + count));
    const DeviceBuffer gate_in =
        to_device(std::vector<float>(gate.c.begin(), gate.c.begin() + count));
    const DeviceBuffer expected(count * lmoe::dtype_size(dtype));
    ASSERT_EQ(
        lmoe::cuda::launch_activation(static_cast<const float*>(gate_in.data()),
                                      static_cast<const float*>(up_in.data()), expected.data(),
                                      static_cast<std::int64_t>(count), config, dtype, nullptr),
        cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<std::uint8_t> want_bytes = to_host<std::uint8_t>(expected, expected.bytes());
    for (const GroupedTile tile : tiles) {
      SCOPED_TRACE(std::string(lmoe::activation_name(activation)) + " tile " +
                   lmoe::cuda::grouped_tile_name(tile));
      const GemmRun fused = run_grouped(p, dtype, GroupedOut::activation, tile, &config, gated);
      EXPECT_TRUE(std::equal(want_bytes.begin(), want_bytes.end(), fused.raw.begin()));
      for (std::int64_t i = p.rows * p.n; i < static_cast<std::int64_t>(fused.c.size()); ++i) {
        ASSERT_TRUE(std::isnan(fused.c[i])) << "slack element " << i << " was written";
      }
    }
  }
}

// The outputs computed from the fp32 products `f32` (of p.b): rounded once, by `rounded_tile`, the
// fp32 result rounded bit for bit (and so within fp64's bound plus one rounding); the activation,
// by each of `activation_tiles`, bit for bit the activation kernel on `f32` and the gate's
// products (from b2, by `gate_tile`).
void expect_epilogues_match(const Problem& p, DType dtype, const GemmRun& f32,
                            GroupedTile rounded_tile, GroupedTile gate_tile,
                            std::initializer_list<GroupedTile> activation_tiles) {
  const double unit = dtype == DType::bf16 ? 1.0 / 256 : 1.0 / 2048;  // the storage roundoff
  const GemmRun rounded = run_grouped(p, dtype, GroupedOut::rounded, rounded_tile, nullptr, false);
  expect_matches_fp64(p, rounded, p.b, unit);
  HostTensor want(dtype, {p.rows, p.n});
  for (std::int64_t i = 0; i < want.numel(); ++i) want.set(i, f32.c[i]);
  EXPECT_EQ(0, std::memcmp(want.data(), rounded.raw.data(), want.nbytes()));

  Problem gate_problem = p;
  std::swap(gate_problem.b, gate_problem.b2);
  const GemmRun gate_f32 =
      run_grouped(gate_problem, dtype, GroupedOut::f32, gate_tile, nullptr, false);
  expect_matches_fp64(gate_problem, gate_f32, gate_problem.b, 0.0);
  expect_activation_matches(p, dtype, f32, gate_f32, activation_tiles);
}

struct GemmShape {
  std::int64_t n, k;
};

class GroupedGemm : public ::testing::TestWithParam<std::tuple<DType, GemmShape, bool>> {};

TEST_P(GroupedGemm, MatchesFp64OnRaggedGroupsWithEveryTile) {
  SKIP_WITHOUT_GPU();
  const auto [dtype, shape, gather] = GetParam();
  const std::vector<int> group_rows = {0, 1, 7, 8, 9, 300, 0, 17};
  const Problem p = make_problem(group_rows, shape.n, shape.k, dtype, gather,
                                 7u + static_cast<std::uint32_t>(shape.k));

  const GemmRun reference =
      run_grouped(p, dtype, GroupedOut::f32, GroupedTile::m64, nullptr, false);
  expect_matches_fp64(p, reference, p.b, 0.0);
  // The tiles sum K in the same order: the same bits whatever the shape.
  for (const GroupedTile tile :
       {GroupedTile::m16, GroupedTile::m128, GroupedTile::m128_wide, GroupedTile::automatic}) {
    SCOPED_TRACE(std::string("tile ") + lmoe::cuda::grouped_tile_name(tile));
    const GemmRun run = run_grouped(p, dtype, GroupedOut::f32, tile, nullptr, false);
    EXPECT_EQ(run.raw, reference.raw);
  }

  expect_epilogues_match(
      p, dtype, reference, GroupedTile::automatic, GroupedTile::m128,
      {GroupedTile::m16, GroupedTile::m64, GroupedTile::m128, GroupedTile::m128_wide});
}

// Why the wgmma tiles cannot run on this GPU (printed by the skip), or nullopt.
std::optional<std::string> wgmma_unavailable() {
  return lmoe::cuda::grouped_tile_unsupported(GroupedTile::wgmma,
                                              lmoe::cuda::current_compute_capability());
}

// The wgmma tiles (compute 9.0 only) on groups around their warpgroups' 64 rows and their blocks'
// 128 and 256: empty, one row, 63, 64, 65, 128, 129, 200, and 300 (a partial second tile of each).
TEST_P(GroupedGemm, WgmmaTilesMatchFp64AndTheMmaSyncTiles) {
  SKIP_WITHOUT_GPU();
  if (const auto why = wgmma_unavailable()) GTEST_SKIP() << *why;
  const auto [dtype, shape, gather] = GetParam();
  const std::vector<int> group_rows = {0, 1, 63, 64, 65, 200, 0, 128, 129, 17, 300};
  const Problem p = make_problem(group_rows, shape.n, shape.k, dtype, gather,
                                 11u + static_cast<std::uint32_t>(shape.k));
  const GemmRun m64 = run_grouped(p, dtype, GroupedOut::f32, GroupedTile::m64, nullptr, false);
  // wgmma_ws: its own kernel where K is a multiple of 8 (k 200, 448: the tensor map's rows),
  // wgmma_m256's elsewhere.
  for (const GroupedTile tile :
       {GroupedTile::wgmma, GroupedTile::wgmma_m256, GroupedTile::wgmma_ws}) {
    SCOPED_TRACE(std::string("tile ") + lmoe::cuda::grouped_tile_name(tile));
    const GemmRun up = run_grouped(p, dtype, GroupedOut::f32, tile, nullptr, false);
    expect_matches_fp64(p, up, p.b, 0.0);
    // K in the same order as the mma.sync tiles (chunks, then k16 steps; within a step the tensor
    // cores'): the same bits, if Hopper's wgmma and mma.sync sum a k16 step alike.
    EXPECT_EQ(up.raw, m64.raw) << "wgmma's fp32 products differ in bits from mma.sync's (m64)";
    expect_epilogues_match(p, dtype, up, tile, tile, {tile});
  }
  if (gather) {
    // Gathered rows staged for wgmma_ws (its kernel where the tensor map fits, wgmma_m256's
    // elsewhere: then nothing is staged): the same bits; automatic takes the same path.
    for (const GroupedTile tile : {GroupedTile::wgmma_ws, GroupedTile::automatic}) {
      SCOPED_TRACE(std::string("staged, tile ") + lmoe::cuda::grouped_tile_name(tile));
      const GemmRun staged =
          run_grouped(p, dtype, GroupedOut::f32, tile, nullptr, false, /*staged=*/true);
      EXPECT_EQ(staged.raw, m64.raw);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GroupedGemm,
    ::testing::Combine(::testing::Values(DType::bf16, DType::f16),
                       // K: 16-byte rows, not a multiple of the 64-wide chunk; 8-byte rows; 4-byte
                       // rows. N: not a multiple of any tile's columns.
                       ::testing::Values(GemmShape{130, 200}, GemmShape{72, 100}, GemmShape{33, 50},
                                         GemmShape{256, 448}),
                       ::testing::Bool()),
    [](const auto& info) {
      const GemmShape shape = std::get<1>(info.param);
      return std::string(lmoe::dtype_name(std::get<0>(info.param))) + "_n" +
             std::to_string(shape.n) + "_k" + std::to_string(shape.k) +
             (std::get<2>(info.param) ? "_gather" : "");
    });

TEST(GroupedGemm, DecodeShapedGroupsMatchFp64) {
  SKIP_WITHOUT_GPU();
  // 16 active experts of 8 (padded) rows among 64, as a decode step at top-16 sees them.
  std::vector<int> rows(64, 0);
  for (int e = 0; e < 64; e += 4) rows[e] = 8;
  const Problem p = make_problem(rows, 384, 448, DType::bf16, true, 99);
  const GemmRun run =
      run_grouped(p, DType::bf16, GroupedOut::f32, GroupedTile::automatic, nullptr, false);
  expect_matches_fp64(p, run, p.b, 0.0);
}

// Arguments the host checks accept, on 16-byte aligned host memory standing in for device
// pointers (never launched).
GroupedGemmArgs host_checked_args() {
  alignas(16) static std::int32_t scratch[64];
  GroupedGemmArgs args;
  args.a = args.b = scratch;
  args.c = scratch;
  args.first = scratch;
  args.groups = 4;
  args.n = 16;
  args.k = 64;
  args.lda = 64;
  args.ldc = 16;
  args.max_rows = 8;
  args.max_groups = 4;
  args.b_group_stride = 16 * 64;
  return args;
}

// Host checks only (refused before any CUDA call): runs without a GPU too.
TEST(GroupedGemm, RefusesWhatItCannotRunWithTheReason) {
  alignas(16) static std::int32_t scratch[64];
  const GroupedGemmArgs args = host_checked_args();
  ASSERT_FALSE(lmoe::cuda::grouped_gemm_unsupported(args).has_value());

  auto refused = [&](GroupedGemmArgs bad) {
    const auto why = lmoe::cuda::grouped_gemm_unsupported(bad);
    EXPECT_EQ(lmoe::cuda::launch_grouped_gemm(bad, nullptr), cudaErrorInvalidValue);
    return why.value_or("");
  };
  GroupedGemmArgs bad = args;
  bad.dtype = DType::f32;
  EXPECT_THAT(refused(bad),
              HasSubstr("dtype: expected bf16 or f16 (tensor-core operands), got f32"));
  bad = args;
  bad.k = bad.lda = 63;
  EXPECT_THAT(refused(bad), HasSubstr("k: expected an even K"));
  bad = args;
  bad.groups = 1025;
  EXPECT_THAT(refused(bad), HasSubstr("groups: expected 1 … 1024, got 1025"));
  bad = args;
  bad.b2 = scratch;
  EXPECT_THAT(refused(bad), HasSubstr("b2: expected null"));
  bad = args;
  bad.out = GroupedOut::activation;
  EXPECT_THAT(refused(bad), HasSubstr("activation: expected the layer config"));
  lmoe::LayerConfig relu2;
  relu2.activation = lmoe::ExpertActivation::relu2;
  bad.activation = &relu2;
  bad.b2 = scratch;
  EXPECT_THAT(refused(bad),
              HasSubstr("b2: expected the gate weights exactly when the activation is gated"));
  bad = args;
  bad.k = bad.lda = 62;  // even: 4-byte copies serve
  EXPECT_FALSE(lmoe::cuda::grouped_gemm_unsupported(bad).has_value());
  bad.a = reinterpret_cast<const char*>(scratch) + 2;  // rows no longer 4-byte aligned
  EXPECT_THAT(refused(bad), HasSubstr("k: expected an even K"));
  bad = args;
  bad.lda = 63;
  EXPECT_THAT(refused(bad), HasSubstr("lda, ldc: expected lda ≥ k = 64"));
}

// The tile `automatic` picks, by the average rows per group that can hold rows: each bound ±1.
TEST(GroupedGemm, AutomaticTileFollowsTheRowsPerGroup) {
  GroupedGemmArgs args;
  args.groups = 64;
  args.max_groups = 16;
  constexpr int kBlackwell = 100, kHopper = 90;
  const auto tile_for = [&](std::int64_t rows, int capability) {
    args.max_rows = rows;
    return lmoe::cuda::grouped_gemm_tile(args, capability);
  };
  EXPECT_EQ(tile_for(16 * 16, kBlackwell), GroupedTile::m16);
  EXPECT_EQ(tile_for(16 * 16 + 1, kBlackwell), GroupedTile::m64);
  EXPECT_EQ(tile_for(16 * 96, kBlackwell), GroupedTile::m64);
  EXPECT_EQ(tile_for(16 * 96 + 1, kBlackwell), GroupedTile::m128);
  // Compute 9.0: a wgmma tile from kGroupedWgmmaMinRows rows per group (A read in place here:
  // wgmma_ws; gathered rows below), m64's range below it.
  constexpr std::int64_t kMin = lmoe::cuda::kGroupedWgmmaMinRows;
  EXPECT_EQ(kMin, 64);
  EXPECT_EQ(tile_for(16 * 16, kHopper), GroupedTile::m16);
  EXPECT_EQ(tile_for(16 * 16 + 1, kHopper), GroupedTile::m64);
  EXPECT_EQ(tile_for(16 * 73, kHopper), GroupedTile::wgmma_ws);
  EXPECT_EQ(tile_for(16 * (kMin - 1), kHopper), GroupedTile::m64);
  EXPECT_EQ(tile_for(16 * (kMin - 1) + 1, kHopper), GroupedTile::wgmma_ws);
  EXPECT_EQ(tile_for(16 * 96 + 1, 0), GroupedTile::m128);  // no device
  args.max_groups = 1000;  // more than the groups: the groups bound it
  args.max_rows = 64 * 16 + 1;
  EXPECT_EQ(lmoe::cuda::grouped_gemm_tile(args, kBlackwell), GroupedTile::m64);
  args.max_rows = 64 * (kMin - 1);
  EXPECT_EQ(lmoe::cuda::grouped_gemm_tile(args, kHopper), GroupedTile::m64);
  args.tile = GroupedTile::m128_wide;  // asked for: kept
  EXPECT_EQ(lmoe::cuda::grouped_gemm_tile(args, kHopper), GroupedTile::m128_wide);
  EXPECT_EQ(lmoe::cuda::grouped_gemm_tile(args), GroupedTile::m128_wide);
  EXPECT_STREQ(lmoe::cuda::grouped_tile_name(GroupedTile::m128_wide), "m128_wide");
  EXPECT_STREQ(lmoe::cuda::grouped_tile_name(GroupedTile::wgmma), "wgmma");
  EXPECT_STREQ(lmoe::cuda::grouped_tile_name(GroupedTile::wgmma_m256), "wgmma_m256");
  EXPECT_STREQ(lmoe::cuda::grouped_tile_name(GroupedTile::wgmma_ws), "wgmma_ws");
  // From kMin rows on Hopper: wgmma_ws where A is read in place, wgmma_m256 where rows are
  // gathered.
  args.tile = GroupedTile::automatic;
  args.max_groups = 16;
  EXPECT_EQ(tile_for(16 * 146, kHopper), GroupedTile::wgmma_ws);
  EXPECT_EQ(tile_for(16 * kMin, kHopper), GroupedTile::wgmma_ws);
  EXPECT_EQ(tile_for(16 * (kMin - 1), kHopper), GroupedTile::m64);
  EXPECT_EQ(tile_for(16 * 146, kBlackwell), GroupedTile::m128);
  const std::int32_t gather_rows[1] = {0};
  args.a_rows = gather_rows;  // only compared with null here
  EXPECT_EQ(tile_for(16 * 146, kHopper), GroupedTile::wgmma_m256);
  EXPECT_EQ(tile_for(16 * kMin, kHopper), GroupedTile::wgmma_m256);
  EXPECT_EQ(tile_for(16 * 16, kHopper), GroupedTile::m16);
  // Gathered rows with a staging buffer: staged, then wgmma_ws (from the same threshold).
  int staging = 0;
  args.a_staging = &staging;  // only compared with null here
  EXPECT_EQ(tile_for(16 * 146, kHopper), GroupedTile::wgmma_ws);
  EXPECT_EQ(tile_for(16 * kMin, kHopper), GroupedTile::wgmma_ws);
  EXPECT_EQ(tile_for(16 * (kMin - 1), kHopper), GroupedTile::m64);
  EXPECT_EQ(tile_for(16 * 146, kBlackwell), GroupedTile::m128);
}

// wgmma runs on compute 9.0 alone, and says so elsewhere; the mma.sync tiles run everywhere.
TEST(GroupedGemm, WgmmaTilesAreRefusedOffHopperWithTheReason) {
  EXPECT_FALSE(lmoe::cuda::grouped_tile_unsupported(GroupedTile::wgmma, 90).has_value());
  EXPECT_FALSE(lmoe::cuda::grouped_tile_unsupported(GroupedTile::wgmma_m256, 90).has_value());
  EXPECT_FALSE(lmoe::cuda::grouped_tile_unsupported(GroupedTile::wgmma_ws, 90).has_value());
  EXPECT_THAT(lmoe::cuda::grouped_tile_unsupported(GroupedTile::wgmma_ws, 100).value_or(""),
              HasSubstr("tile: wgmma_ws expected a compute capability 9.0 device (Hopper, "
                        "sm_90a), got 10.0"));
  EXPECT_THAT(lmoe::cuda::grouped_tile_unsupported(GroupedTile::wgmma, 100).value_or(""),
              HasSubstr("tile: wgmma expected a compute capability 9.0 device (Hopper, sm_90a), "
                        "got 10.0"));
  EXPECT_THAT(lmoe::cuda::grouped_tile_unsupported(GroupedTile::wgmma_m256, 89).value_or(""),
              HasSubstr("tile: wgmma_m256 expected a compute capability 9.0 device"));
  EXPECT_THAT(lmoe::cuda::grouped_tile_unsupported(GroupedTile::wgmma, 0).value_or(""),
              HasSubstr("got no device"));
  for (const int capability : {0, 89, 90, 100})
    EXPECT_FALSE(lmoe::cuda::grouped_tile_unsupported(GroupedTile::m128, capability).has_value());
  // Through the arguments: refused here exactly where this device is not compute 9.0.
  GroupedGemmArgs args = host_checked_args();
  args.tile = GroupedTile::wgmma;
  const int capability = lmoe::cuda::current_compute_capability();
  EXPECT_EQ(lmoe::cuda::grouped_gemm_unsupported(args),
            lmoe::cuda::grouped_tile_unsupported(GroupedTile::wgmma, capability))
      << "capability " << capability;
  if (capability != 90) {
    EXPECT_EQ(lmoe::cuda::launch_grouped_gemm(args, nullptr), cudaErrorInvalidValue);
  }
  args.tile = GroupedTile::wgmma_ws;
  EXPECT_EQ(lmoe::cuda::grouped_gemm_unsupported(args),
            lmoe::cuda::grouped_tile_unsupported(GroupedTile::wgmma_ws, capability))
      << "capability " << capability;
  if (capability != 90) {
    EXPECT_EQ(lmoe::cuda::launch_grouped_gemm(args, nullptr), cudaErrorInvalidValue);
  }
}

}  // namespace

// lmoe_grouped_gemm_bench: the routed experts' grouped GEMMs (src/cuda/gemm/grouped_gemm.hpp) at
// one model's expert dims / tp, against the GPU's two ceilings measured in the same run:
//
//   copy  device-to-device bandwidth (cudaMemcpyAsync; bytes read + written);
//   gemm  the bf16 rate of CublasLtGemm on an 8192³ product (%gemm: against the rate before the
//         rows; measured again after them and printed);
//   up    grouped up (and gate) GEMM with the activation: [T·k rows, l] → [T·k rows, I/tp];
//   down  grouped down GEMM, fp32 out: [T·k rows, I/tp] → [T·k rows, l];
//   loop  the host path's equivalent for comparison: one cuBLASLt GEMM per active expert (up, and
//         gate where gated, and down, fp32 out), the same rows.
//
// For each T, routings are drawn as the router makes them (top-k distinct experts per token,
// uniform); several routings rotate between launches so that the weights of one launch have left
// L2 when its routing comes round again. TFLOP/s counts the T·k real rows (not the padding);
// GB/s counts the active experts' weights plus the rows read and written once. Every operation
// is timed as a CUDA graph (graph_timer.hpp). A benchmark is a program, not a test: it prints a
// table (and --json FILE) and asserts nothing.
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/fast_random.hpp"
#include "core/random_routing.hpp"
#include "cuda/gemm/cublaslt_gemm.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/cuda_device_info.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "graph_timer.hpp"
#include "lmoe/dims.hpp"
#include "lmoe/error.hpp"

namespace {

using lmoe::DType;
using lmoe::bench::Timer;
using lmoe::bench::Timing;
using lmoe::cuda::DeviceBuffer;
using Json = nlohmann::json;

struct Settings : lmoe::bench::TimerSettings {
  std::string preset = "kimi-k3";
  int tp = 8;
  std::int64_t experts = 0;  // 0: the preset's
  std::vector<std::int64_t> tokens = {1, 16, 128, 1024, 8192};
  std::vector<std::string> tiles = {"automatic"};
  bool with_loop = true;
  bool staging = true;  // give the up call a staging buffer (wgmma_ws stages gathered rows there)
  std::string activation;  // empty: the preset's
  std::string json_path;
};

constexpr std::int64_t kRowAlign = 8;  // the executor's padding of each expert's rows

// A buffer of `elements` random bf16 values in [-1, 1) (never zeros, never NaN).
DeviceBuffer random_device(std::size_t elements, std::uint64_t seed) {
  std::vector<std::uint16_t> host(elements);
  lmoe::SplitMix64 random{seed};
  for (auto& value : host) {
    const float f = 2.0f * static_cast<float>(random.uniform()) - 1.0f;
    std::uint32_t bits = 0;
    std::memcpy(&bits, &f, 4);
    value = static_cast<std::uint16_t>(bits >> 16);
  }
  DeviceBuffer buffer(elements * 2);
  LMOE_CUDA_CHECK(cudaMemcpy(buffer.data(), host.data(), buffer.bytes(), cudaMemcpyHostToDevice));
  return buffer;
}

// One routing's grouped layout: first [E + 1] (padded), the real rows per expert, the tokens.
struct Grouping {
  std::vector<std::int32_t> first, token_of_row;
  std::int64_t active = 0;
};

Grouping draw_grouping(std::int64_t tokens, std::int64_t experts, std::int64_t top_k,
                       std::uint32_t seed) {
  const std::vector<std::int32_t> ids = lmoe::random_routing(tokens, experts, top_k, seed);
  Grouping g;
  std::vector<std::int64_t> counts(static_cast<std::size_t>(experts), 0);
  for (const std::int32_t e : ids) ++counts[e];
  g.first.push_back(0);
  for (std::int64_t e = 0; e < experts; ++e) {
    g.first.push_back(g.first.back() + static_cast<std::int32_t>((counts[e] + kRowAlign - 1) /
                                                                 kRowAlign * kRowAlign));
    g.active += counts[e] > 0;
  }
  g.token_of_row.assign(static_cast<std::size_t>(g.first.back()), 0);
  std::vector<std::int32_t> next(g.first.begin(), g.first.end() - 1);
  for (std::size_t s = 0; s < ids.size(); ++s)
    g.token_of_row[next[ids[s]]++] = static_cast<std::int32_t>(s / top_k);
  return g;
}

void print_header() {
  std::printf("%-14s %6s %7s %7s %10s %10s %10s %9s %7s %9s %7s\n", "op", "T", "rows", "experts",
              "median_us", "p10_us", "p90_us", "GB/s", "%copy", "TFLOP/s", "%gemm");
}

void print_row(const std::string& op, std::int64_t tokens, std::int64_t rows, std::int64_t experts,
               const Timing& t, double gbps, double pct_copy, double tflops, double pct_gemm) {
  std::printf("%-14s %6lld %7lld %7lld %10.2f %10.2f %10.2f %9.0f %7.1f %9.1f %7.1f\n", op.c_str(),
              static_cast<long long>(tokens), static_cast<long long>(rows),
              static_cast<long long>(experts), t.median_us, t.p10_us, t.p90_us, gbps, pct_copy,
              tflops, pct_gemm);
}

Json row_json(const std::string& op, std::int64_t tokens, const Timing& t, double gbps,
              double tflops) {
  return {{"op", op},           {"tokens", tokens},        {"median_us", t.median_us},
          {"p10_us", t.p10_us}, {"p90_us", t.p90_us},      {"GBps", gbps},
          {"TFLOPs", tflops},   {"ops_per_graph", t.inner}};
}

// What the bench runs: the preset's routed experts at tp (E may be overridden), the tiles to time.
struct Problem {
  lmoe::LayerConfig config;
  std::int64_t l = 0, inter = 0, experts = 0, top_k = 0;
  bool gated = false;
  std::vector<lmoe::cuda::GroupedTile> tiles;
};

Problem resolve_problem(const Settings& settings) {
  const lmoe::ModelPreset& preset = lmoe::find_preset(settings.preset);
  LMOE_CHECK(preset.layer.has_value(),
             "--preset: expected a preset with a layer, got " + settings.preset);
  Problem p;
  lmoe::LayerConfig& config = p.config = *preset.layer;
  if (!settings.activation.empty()) {
    bool known = false;
    for (const auto activation :
         {lmoe::ExpertActivation::silu_glu, lmoe::ExpertActivation::situ_glu,
          lmoe::ExpertActivation::relu2}) {
      if (settings.activation == lmoe::activation_name(activation)) {
        config.activation = activation;
        known = true;
      }
    }
    LMOE_CHECK(known,
               "--activation: expected silu_glu, situ_glu or relu2, got " + settings.activation);
  }
  LMOE_CHECK(settings.tp >= 1 && config.expert_intermediate % settings.tp == 0,
             "--tp: expected a divisor of expert_intermediate = " +
                 std::to_string(config.expert_intermediate));
  p.l = config.d_latent;
  p.inter = config.expert_intermediate / settings.tp;
  const std::int64_t experts = p.experts =
      settings.experts > 0 ? settings.experts : config.router.num_experts;
  const std::int64_t top_k = p.top_k = config.router.top_k;
  LMOE_CHECK(settings.experts >= 0 && experts >= top_k,
             "--experts: expected at least top_k = " + std::to_string(top_k) + " experts, got " +
                 std::to_string(settings.experts));
  p.gated = lmoe::is_gated(config.activation);
  for (const std::string& name : settings.tiles) {
    bool known = false;
    for (const auto tile :
         {lmoe::cuda::GroupedTile::automatic, lmoe::cuda::GroupedTile::m16,
          lmoe::cuda::GroupedTile::m64, lmoe::cuda::GroupedTile::m128,
          lmoe::cuda::GroupedTile::m128_wide, lmoe::cuda::GroupedTile::wgmma,
          lmoe::cuda::GroupedTile::wgmma_m256, lmoe::cuda::GroupedTile::wgmma_ws}) {
      if (name == lmoe::cuda::grouped_tile_name(tile)) {
        p.tiles.push_back(tile);
        known = true;
      }
    }
    LMOE_CHECK(
        known,
        "--tiles: expected automatic, m16, m64, m128, m128_wide, wgmma, wgmma_m256 or wgmma_ws, "
        "got " +
            name);
  }
  return p;
}

// One T's routings and operands. Enough routings that one launch's weights have left L2 before its
// routing comes back.
struct TokenData {
  std::int64_t tokens = 0, slots = 0, bound = 0;
  int sets = 0;
  std::vector<Grouping> groupings;
  std::vector<DeviceBuffer> firsts, tokens_of_rows;
  DeviceBuffer z, hidden, gathered, slot_out, up_acc, gate_acc;
  double active = 0;  // the mean of the routings' active experts
};

TokenData make_token_data(const Problem& p, std::int64_t tokens) {
  const std::int64_t l = p.l, inter = p.inter, experts = p.experts, top_k = p.top_k;
  TokenData d;
  d.tokens = tokens;
  const std::int64_t slots = d.slots = tokens * top_k;
  const std::int64_t bound = d.bound = slots + (kRowAlign - 1) * std::min(experts, slots);
  const int sets = d.sets = tokens <= 128 ? 8 : 2;
  std::vector<Grouping>& groupings = d.groupings;
  std::vector<DeviceBuffer>&firsts = d.firsts, &tokens_of_rows = d.tokens_of_rows;
  for (int s = 0; s < sets; ++s) {
    groupings.push_back(
        draw_grouping(tokens, experts, top_k, 1000u + static_cast<std::uint32_t>(s)));
    const Grouping& g = groupings.back();
    firsts.emplace_back(g.first.size() * 4);
    LMOE_CUDA_CHECK(cudaMemcpy(firsts.back().data(), g.first.data(), g.first.size() * 4,
                               cudaMemcpyHostToDevice));
    tokens_of_rows.emplace_back(std::max<std::size_t>(g.token_of_row.size(), 1) * 4);
    LMOE_CUDA_CHECK(cudaMemcpy(tokens_of_rows.back().data(), g.token_of_row.data(),
                               g.token_of_row.size() * 4, cudaMemcpyHostToDevice));
  }
  d.z = random_device(static_cast<std::size_t>(tokens * l), 6);
  d.hidden = random_device(static_cast<std::size_t>(bound * inter), 7);
  d.gathered = random_device(static_cast<std::size_t>(bound * l), 8);  // the host path's A
  d.slot_out = DeviceBuffer(static_cast<std::size_t>(bound * l) * 4);
  d.up_acc = DeviceBuffer(static_cast<std::size_t>(bound * inter) * 4);
  d.gate_acc = DeviceBuffer(static_cast<std::size_t>(bound * inter) * 4);
  for (const Grouping& g : groupings) d.active += static_cast<double>(g.active);
  d.active /= sets;
  return d;
}

// The GPU's two ceilings, measured in the same run: a device-to-device copy and a square bf16
// GEMM (timed again after the rows).
struct Ceilings {
  double copy_gbps = 0, gemm_tflops = 0;
};

// One row of the table and of the JSON: an operation's time at one T against the ceilings.
struct RowReport {
  const TokenData& data;
  const Ceilings& ceilings;
  Json& report;
  void operator()(const std::string& op, const Timing& t, double flops, double bytes) const {
    const double gbps = bytes / (t.median_us * 1e3), tflops = flops / (t.median_us * 1e6);
    print_row(op, data.tokens, data.slots, static_cast<std::int64_t>(data.active + 0.5), t, gbps,
              100.0 * gbps / ceilings.copy_gbps, tflops, 100.0 * tflops / ceilings.gemm_tflops);
    report["rows"].push_back(row_json(op, data.tokens, t, gbps, tflops));
  }
};

// The grouped GEMMs' arguments for one T, without the routing (first, a_rows: set per launch).
std::pair<lmoe::cuda::GroupedGemmArgs, lmoe::cuda::GroupedGemmArgs> grouped_args(
    const Settings& settings, const Problem& p, const TokenData& d, const DeviceBuffer& w_up,
    const DeviceBuffer& w_gate, const DeviceBuffer& w_down) {
  const std::int64_t l = p.l, inter = p.inter, experts = p.experts, slots = d.slots;
  const bool gated = p.gated;
  const DeviceBuffer &hidden = d.hidden, &gathered = d.gathered, &slot_out = d.slot_out;
  const std::int64_t bound = d.bound;
  const lmoe::LayerConfig& config = p.config;
  lmoe::cuda::GroupedGemmArgs up;
  up.lda = l;
  up.b = w_up.data();
  up.b2 = gated ? w_gate.data() : nullptr;
  up.b_group_stride = inter * l;
  up.c = hidden.data();
  up.ldc = inter;
  up.n = inter;
  up.k = l;
  up.groups = static_cast<int>(experts);
  up.max_rows = bound;
  up.max_groups = std::min(experts, slots);
  up.out = lmoe::cuda::GroupedOut::activation;
  up.activation = &config;
  // The layer's staging buffer for gathered rows (used where the tile is wgmma_ws).
  up.a_staging = settings.staging ? gathered.data() : nullptr;
  lmoe::cuda::GroupedGemmArgs down = up;
  down.a_staging = nullptr;
  down.a = hidden.data();
  down.lda = inter;
  down.b = w_down.data();
  down.b2 = nullptr;
  down.c = slot_out.data();
  down.ldc = l;
  down.n = l;
  down.k = inter;
  down.out = lmoe::cuda::GroupedOut::f32;
  down.activation = nullptr;
  return {up, down};
}

// Each tile's up and down calls at one T, every launch on the next of the T's routings.
void time_tiles(const Problem& p, const TokenData& d, const lmoe::cuda::GroupedGemmArgs& up_args,
                const lmoe::cuda::GroupedGemmArgs& down_args, const RowReport& report_row,
                double up_flops, double up_bytes, double down_flops, double down_bytes,
                Timer& timer, cudaStream_t stream) {
  const std::vector<lmoe::cuda::GroupedTile>& tiles = p.tiles;
  const std::vector<DeviceBuffer>&firsts = d.firsts, &tokens_of_rows = d.tokens_of_rows;
  const DeviceBuffer& z = d.z;
  const int sets = d.sets;
  lmoe::cuda::GroupedGemmArgs up = up_args, down = down_args;
  for (const lmoe::cuda::GroupedTile tile : tiles) {
    if (const auto why =
            lmoe::cuda::grouped_tile_unsupported(tile, lmoe::cuda::current_compute_capability())) {
      std::printf("# %s skipped: %s\n", lmoe::cuda::grouped_tile_name(tile), why->c_str());
      continue;
    }
    // The tile `automatic` resolves to is named in the row.
    up.tile = down.tile = tile;
    // The up call gathers its rows (a_rows, set per launch below), which `automatic` weighs.
    lmoe::cuda::GroupedGemmArgs up_gathered = up;
    up_gathered.a_rows = static_cast<const std::int32_t*>(tokens_of_rows[0].data());
    const lmoe::cuda::GroupedTile up_resolved = lmoe::cuda::grouped_gemm_tile(up_gathered);
    // Staged rows are timed with their copy (one launch of the gather inside the call).
    const std::string up_tile =
        std::string(up.a_staging && up_resolved == lmoe::cuda::GroupedTile::wgmma_ws ? "staged+"
                                                                                     : "") +
        lmoe::cuda::grouped_tile_name(up_resolved);
    const std::string down_tile =
        lmoe::cuda::grouped_tile_name(lmoe::cuda::grouped_gemm_tile(down));
    const Timing t_up = timer.time([&](int i) {
      lmoe::cuda::GroupedGemmArgs args = up;
      args.a = z.data();
      args.a_rows = static_cast<const std::int32_t*>(tokens_of_rows[i % sets].data());
      args.first = static_cast<const std::int32_t*>(firsts[i % sets].data());
      lmoe::cuda::check(lmoe::cuda::launch_grouped_gemm(args, stream), "launch_grouped_gemm(up)");
    });
    report_row("up:" + up_tile, t_up, up_flops, up_bytes);
    const Timing t_down = timer.time([&](int i) {
      lmoe::cuda::GroupedGemmArgs args = down;
      args.first = static_cast<const std::int32_t*>(firsts[i % sets].data());
      lmoe::cuda::check(lmoe::cuda::launch_grouped_gemm(args, stream), "launch_grouped_gemm(down)");
    });
    report_row("down:" + down_tile, t_down, down_flops, down_bytes);
  }
}

// The host path's equivalent at one T: per active expert, cuBLASLt on its padded rows.
void time_host_loop(const Problem& p, const TokenData& d, const DeviceBuffer& w_up,
                    const DeviceBuffer& w_gate, const DeviceBuffer& w_down,
                    const RowReport& report_row, double flops, double bytes,
                    lmoe::cuda::CublasLtGemm& gemm, Timer& timer, cudaStream_t stream) {
  const std::int64_t l = p.l, inter = p.inter, experts = p.experts;
  const std::size_t matrix = static_cast<std::size_t>(inter * l);
  const bool gated = p.gated;
  const std::vector<Grouping>& groupings = d.groupings;
  const DeviceBuffer &gathered = d.gathered, &hidden = d.hidden, &slot_out = d.slot_out;
  const DeviceBuffer &up_acc = d.up_acc, &gate_acc = d.gate_acc;
  const int sets = d.sets;
  // The host path: per active expert, cuBLASLt on its padded rows (A already gathered).
  const auto loop = [&](int i) {
    const Grouping& g = groupings[i % sets];
    for (std::int64_t e = 0; e < experts; ++e) {
      const std::int64_t first = g.first[e], rows = g.first[e + 1] - first;
      if (rows == 0) continue;
      const auto* a = static_cast<const std::byte*>(gathered.data()) + first * l * 2;
      gemm.run(a, static_cast<const std::byte*>(w_up.data()) + e * matrix * 2, l,
               static_cast<float*>(up_acc.data()) + first * inter, inter, rows, inter, l,
               DType::bf16, DType::f32, stream);
      if (gated) {
        gemm.run(a, static_cast<const std::byte*>(w_gate.data()) + e * matrix * 2, l,
                 static_cast<float*>(gate_acc.data()) + first * inter, inter, rows, inter, l,
                 DType::bf16, DType::f32, stream);
      }
      gemm.run(static_cast<const std::byte*>(hidden.data()) + first * inter * 2,
               static_cast<const std::byte*>(w_down.data()) + e * matrix * 2, inter,
               static_cast<float*>(slot_out.data()) + first * l, l, rows, l, inter, DType::bf16,
               DType::f32, stream);
    }
  };
  // Every routing's shapes once outside the capture: cuBLASLt plans them on first use.
  for (int s = 0; s < sets; ++s) loop(s);
  LMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  report_row("loop", timer.time(loop), flops, bytes);
}

int run(const Settings& settings) {
  const Problem problem = resolve_problem(settings);
  const lmoe::LayerConfig& config = problem.config;
  const std::int64_t l = problem.l, inter = problem.inter;
  const std::int64_t experts = problem.experts, top_k = problem.top_k;
  const bool gated = problem.gated;

  int device = 0;
  LMOE_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp props{};
  LMOE_CUDA_CHECK(cudaGetDeviceProperties(&props, device));
  std::printf(
      "# lmoe_grouped_gemm_bench: %s, %d SMs, L2 %d MiB\n# %s experts / tp=%d: E=%lld top-%lld, "
      "l=%lld, "
      "I/tp=%lld, %s, bf16; %d warm-up and %d timed graph launches per row\n",
      props.name, props.multiProcessorCount, props.l2CacheSize >> 20, settings.preset.c_str(),
      settings.tp, static_cast<long long>(experts), static_cast<long long>(top_k),
      static_cast<long long>(l), static_cast<long long>(inter),
      std::string(lmoe::activation_name(config.activation)).c_str(), settings.warmup,
      settings.repeats);

  cudaStream_t stream = nullptr;
  LMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Json report = {{"program", "lmoe_grouped_gemm_bench"},
                 {"gpu", props.name},
                 {"preset", settings.preset},
                 {"tp", settings.tp},
                 {"d_latent", l},
                 {"intermediate_per_rank", inter},
                 {"activation", std::string(lmoe::activation_name(config.activation))},
                 {"experts", experts},
                 {"top_k", top_k},
                 {"rows", Json::array()}};
  {
    Timer timer(settings, stream);
    lmoe::cuda::CublasLtGemm gemm;

    // The ceilings.
    const std::size_t copy_bytes = std::size_t{1} << 30;
    DeviceBuffer copy_src(copy_bytes), copy_dst(copy_bytes);
    LMOE_CUDA_CHECK(cudaMemset(copy_src.data(), 1, copy_bytes));
    const Timing copy = timer.time([&](int) {
      LMOE_CUDA_CHECK(cudaMemcpyAsync(copy_dst.data(), copy_src.data(), copy_bytes,
                                      cudaMemcpyDeviceToDevice, stream));
    });
    Ceilings ceilings;
    const double copy_gbps = ceilings.copy_gbps =
        2.0 * static_cast<double>(copy_bytes) / (copy.median_us * 1e3);
    const std::int64_t square = 8192;
    const DeviceBuffer ga = random_device(square * square, 1),
                       gb = random_device(square * square, 2);
    DeviceBuffer gc(static_cast<std::size_t>(square * square) * 2);
    const auto square_gemm = [&](int) {
      gemm.run(ga.data(), gb.data(), square, gc.data(), square, square, square, square, DType::bf16,
               DType::bf16, stream);
    };
    const auto tflops_of = [&](const Timing& timing) {
      return 2.0 * static_cast<double>(square * square) * square / (timing.median_us * 1e6);
    };
    const double gemm_tflops = ceilings.gemm_tflops = tflops_of(timer.time(square_gemm));
    std::printf("# copy %.0f GB/s; bf16 GEMM %lld³ %.1f TFLOP/s\n", copy_gbps,
                static_cast<long long>(square), gemm_tflops);
    report["copy_GBps"] = copy_gbps;
    report["gemm_TFLOPs"] = gemm_tflops;
    print_header();

    // Every expert's weights: [E, I/tp, l] up (and gate), [E, l, I/tp] down.
    const std::size_t matrix = static_cast<std::size_t>(inter * l);
    const DeviceBuffer w_up = random_device(matrix * experts, 3);
    const DeviceBuffer w_gate = gated ? random_device(matrix * experts, 4) : DeviceBuffer();
    const DeviceBuffer w_down = random_device(matrix * experts, 5);

    for (const std::int64_t tokens : settings.tokens) {
      const TokenData data = make_token_data(problem, tokens);
      const std::int64_t slots = data.slots;
      const double active = data.active;
      const auto [up, down] = grouped_args(settings, problem, data, w_up, w_gate, w_down);
      const double mats = gated ? 2.0 : 1.0;
      const double up_flops =
          2.0 * mats * static_cast<double>(slots) * static_cast<double>(inter * l);
      const double up_bytes = mats * active * static_cast<double>(matrix) * 2 +
                              static_cast<double>(slots) * static_cast<double>(l + inter) * 2;
      const double down_flops = 2.0 * static_cast<double>(slots) * static_cast<double>(inter * l);
      const double down_bytes = active * static_cast<double>(matrix) * 2 +
                                static_cast<double>(slots) * static_cast<double>(inter * 2 + l * 4);
      const RowReport report_row{data, ceilings, report};
      time_tiles(problem, data, up, down, report_row, up_flops, up_bytes, down_flops, down_bytes,
                 timer, stream);
      if (settings.with_loop) {
        time_host_loop(problem, data, w_up, w_gate, w_down, report_row, up_flops + down_flops,
                       up_bytes + down_bytes, gemm, timer, stream);
      }
    }
    // The rate again after the rows: it can vary between runs while the grouped calls' times do
    // not, so a reader can see which the percentages used (docs/perf.md).
    const double gemm_tflops_end = tflops_of(timer.time(square_gemm));
    std::printf("# bf16 GEMM %lld³ again after the rows: %.1f TFLOP/s\n",
                static_cast<long long>(square), gemm_tflops_end);
    report["gemm_TFLOPs_end"] = gemm_tflops_end;
  }
  LMOE_CUDA_CHECK(cudaStreamDestroy(stream));
  if (!settings.json_path.empty()) {
    std::ofstream(settings.json_path) << report.dump(2) << "\n";
    std::printf("# wrote %s\n", settings.json_path.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "lmoe_grouped_gemm_bench: the routed experts' grouped GEMMs against the GPU's ceilings"};
  Settings settings;
  app.add_option("--preset", settings.preset, "model preset whose expert dims to use");
  app.add_option("--tp", settings.tp, "tensor-parallel ranks (each holds I/tp of every expert)");
  app.add_option("--experts", settings.experts,
                 "routed experts (default: the preset's); e.g. --tp 1 --experts 112 is the layer's "
                 "shape on one GPU (lmoe layer --scale 1 --experts 112)");
  app.add_option("-t,--tokens", settings.tokens, "token counts")->delimiter(',');
  app.add_option("--repeats", settings.repeats, "timed graph launches per row (median, p10, p90)");
  app.add_option("--warmup", settings.warmup, "untimed graph launches per row");
  app.add_option("--tiles", settings.tiles,
                 "tiles to time: automatic, m16, m64, m128, m128_wide, wgmma, wgmma_m256, wgmma_ws "
                 "(compute 9.0)")
      ->delimiter(',');
  app.add_option("--activation", settings.activation,
                 "the experts' activation instead of the preset's: silu_glu, situ_glu (gated) or "
                 "relu2 (not gated: no gate matrix); the epilogue's cost is the difference");
  app.add_flag("!--no-loop", settings.with_loop, "skip the per-expert cuBLASLt loop");
  app.add_flag(
      "!--no-staging", settings.staging,
      "give the up call no staging buffer (wgmma_ws then loads gathered rows by cp.async)");
  app.add_option("--json", settings.json_path, "write the results as JSON");
  CLI11_PARSE(app, argc, argv);
  try {
    return run(settings);
  } catch (const std::exception& error) {
    std::cerr << "lmoe_grouped_gemm_bench: " << error.what() << "\n";
    return 1;
  }
}

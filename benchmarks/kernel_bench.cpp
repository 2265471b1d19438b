// lmoe_kernel_bench: the GPU's two ceilings and our kernels against them, measured in one run.
//
//   (a) device-to-device copy bandwidth (cudaMemcpyAsync; bytes read + written);
//   (b) our RMSNorm (launch_rms_norm), bytes read + written, as % of (a);
//   (c) the bf16 GEMM rate of our CublasLtGemm on a large square product;
//   (d) the tail's up-projections (column tier's stripe → bf16 and → f32, full width), as % of (c);
//   (e) the routed experts' grouped GEMM at decode, MXFP4 weights against bf16 ones: Kimi-K3's
//       experts (l, I/tp for tp 1 and 8, 16 active of 112), T = 1 and 16 rows per active expert;
//       GB/s counts the weight bytes streamed (as held: packed or bf16), as % of (a);
//   (f) the layer's router at Kimi-K3's and Nemotron 3 Super's routers, T = 1, 16, 128: its logits
//       GEMM, its selection kernel and the whole stage, against the fp32 weight's bytes at (a).
//
// Every operation is captured `inner` times into a CUDA graph, and the graph is timed with CUDA
// events after warm-up: one repetition = one graph launch, time per operation = its time / inner.
// Inputs are random (never zeros), and the norm rotates over enough buffer sets that its data do
// not sit in L2 between launches. A benchmark is a program, not a test: it prints a table (and
// --json FILE), checks the norm against the CPU bit for bit as information, and asserts nothing.
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "core/fast_random.hpp"
#include "core/host_math.hpp"
#include "core/router_weight_split.hpp"
#include "cuda/gemm/cublaslt_gemm.hpp"
#include "cuda/gemm/epilogue_gemm.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/layer/layer_kernels.hpp"
#include "cuda/layer/layer_router.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "cuda/tail/launchers.hpp"
#include "graph_timer.hpp"
#include "lmoe/dims.hpp"
#include "lmoe/error.hpp"
#include "lmoe/layer_weights.hpp"
#include "lmoe/tensor.hpp"

namespace {

using lmoe::DType;
using lmoe::cuda::DeviceBuffer;
using Json = nlohmann::json;

struct Settings : lmoe::bench::TimerSettings {
  double copy_mib = 1024;
  std::string json_path;
  // What runs after the copy (every row's reference): norm, gemm, epilogue, grouped, router.
  std::vector<std::string> sections{"norm", "gemm", "epilogue", "grouped", "router"};
  bool runs(const std::string& section) const {
    return std::find(sections.begin(), sections.end(), section) != sections.end();
  }
};

using lmoe::bench::Timer;
using lmoe::bench::Timing;

// A [rows, cols] tensor of values in [-1, 1), rounded to the dtype.
lmoe::HostTensor random_tensor(DType dtype, std::int64_t rows, std::int64_t cols,
                               std::uint64_t seed) {
  lmoe::HostTensor tensor(dtype, {rows, cols});
  lmoe::SplitMix64 random{seed};
  for (std::int64_t i = 0; i < tensor.numel(); ++i) tensor.set(i, 2.0f * random.uniform() - 1.0f);
  return tensor;
}

DeviceBuffer to_device(const lmoe::HostTensor& tensor) {
  DeviceBuffer buffer(tensor.nbytes());
  LMOE_CUDA_CHECK(
      cudaMemcpy(buffer.data(), tensor.data(), tensor.nbytes(), cudaMemcpyHostToDevice));
  return buffer;
}

Json timing_json(const Timing& t) {
  return {{"median_us", t.median_us},
          {"p10_us", t.p10_us},
          {"p90_us", t.p90_us},
          {"ops_per_graph", t.inner}};
}

void print_header() {
  std::printf("%-9s %-22s %-9s %10s %10s %10s %9s %7s %9s %7s  %s\n", "op", "shape", "dtype",
              "median_us", "p10_us", "p90_us", "GB/s", "%copy", "TFLOP/s", "%gemm", "check");
}

void print_row(const std::string& op, const std::string& shape, const std::string& dtype,
               const Timing& t, double gbps, double pct_copy, double tflops, double pct_gemm,
               const std::string& check) {
  auto number = [](double v, int precision) {
    if (v <= 0) return std::string("-");
    char text[32];
    std::snprintf(text, sizeof(text), "%.*f", precision, v);
    return std::string(text);
  };
  std::printf("%-9s %-22s %-9s %10.2f %10.2f %10.2f %9s %7s %9s %7s  %s\n", op.c_str(),
              shape.c_str(), dtype.c_str(), t.median_us, t.p10_us, t.p90_us,
              number(gbps, 0).c_str(), number(pct_copy, 1).c_str(), number(tflops, 1).c_str(),
              number(pct_gemm, 1).c_str(), check.c_str());
}

std::string utc_now() {
  const std::time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&now, &tm);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

std::string cuda_version_string(int version) {
  return std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10);
}

// The kernel module's version line (e.g. "... Kernel Module  580.159.04 ..."), where the driver
// exposes it; the CUDA driver API reports only the CUDA version it supports.
// The kernel module's version from a line like "NVRM version: NVIDIA UNIX Open Kernel Module for
// x86_64  580.159.04  Release Build ...": the first token after "Kernel Module" that starts with a
// digit and holds a dot.
std::string driver_module_version() {
  std::ifstream file("/proc/driver/nvidia/version");
  std::string line;
  if (!std::getline(file, line)) return "unknown";
  const auto at = line.find("Kernel Module");
  std::istringstream tokens(at == std::string::npos ? line : line.substr(at));
  for (std::string token; tokens >> token;) {
    if (std::isdigit(static_cast<unsigned char>(token[0])) && token.find('.') != std::string::npos)
      return token;
  }
  return "unknown";
}

// ---- (a) copy -----------------------------------------------------------------------------------

Json bench_copy(const Settings& settings, Timer& timer, cudaStream_t stream, double& copy_gbps) {
  const auto bytes = static_cast<std::size_t>(settings.copy_mib * 1024 * 1024);
  DeviceBuffer src(bytes), dst(bytes);
  // Random bytes: the copy does not care, but nothing here runs on untouched memory.
  std::vector<std::uint64_t> host(bytes / 8);
  lmoe::SplitMix64 random{1};
  for (auto& word : host) word = random.next();
  LMOE_CUDA_CHECK(cudaMemcpy(src.data(), host.data(), host.size() * 8, cudaMemcpyHostToDevice));
  const Timing t = timer.time([&](int) {
    LMOE_CUDA_CHECK(
        cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice, stream));
  });
  copy_gbps = 2.0 * static_cast<double>(bytes) / (t.median_us * 1e3);
  print_row("copy", std::to_string(bytes) + " B", "-", t, copy_gbps, 100.0, 0, 0, "");
  Json row = timing_json(t);
  row["bytes"] = bytes;
  row["bytes_moved"] = 2 * bytes;
  row["GBps"] = copy_gbps;
  return row;
}

// ---- (b) RMSNorm --------------------------------------------------------------------------------

struct NormCase {
  std::int64_t tokens, cols;
  DType dtype;
};

Json bench_norm(const NormCase& c, const cudaDeviceProp& props, Timer& timer, cudaStream_t stream,
                double copy_gbps) {
  const std::size_t esize = lmoe::dtype_size(c.dtype);
  const std::size_t tensor_bytes = static_cast<std::size_t>(c.tokens * c.cols) * esize;
  // x read once, out written once (gamma, 4·l bytes, stays in cache).
  const std::size_t moved = 2 * tensor_bytes;
  // Enough (x, out) sets that one launch's data left L2 before its set comes round again.
  const int sets = static_cast<int>(std::clamp<std::size_t>(
      (4 * static_cast<std::size_t>(props.l2CacheSize) + moved - 1) / moved, 1, 64));
  const lmoe::HostTensor x =
      random_tensor(c.dtype, c.tokens, c.cols, 17 + static_cast<std::uint64_t>(c.cols));
  lmoe::HostTensor gamma_host = random_tensor(DType::f32, 1, c.cols, 23);
  std::vector<float> gamma(static_cast<std::size_t>(c.cols));
  for (std::int64_t j = 0; j < c.cols; ++j)
    gamma[static_cast<std::size_t>(j)] = 1.0f + 0.1f * gamma_host.get(j);
  DeviceBuffer d_gamma(gamma.size() * sizeof(float));
  LMOE_CUDA_CHECK(
      cudaMemcpy(d_gamma.data(), gamma.data(), d_gamma.bytes(), cudaMemcpyHostToDevice));
  std::vector<DeviceBuffer> xs, outs;
  for (int s = 0; s < sets; ++s) {
    xs.push_back(to_device(x));
    outs.emplace_back(tensor_bytes);
    LMOE_CUDA_CHECK(cudaMemset(outs.back().data(), 0xff, tensor_bytes));
  }
  const float eps = 1e-5f;
  const Timing t = timer.time([&](int i) {
    const int s = i % sets;
    LMOE_CUDA_CHECK(
        lmoe::cuda::launch_rms_norm(xs[s].data(), static_cast<const float*>(d_gamma.data()),
                                    outs[s].data(), c.tokens, c.cols, eps, c.dtype, stream));
  });

  // Information, not an assertion: the timed kernel's output against the CPU contract.
  lmoe::HostTensor expected(c.dtype, {c.tokens, c.cols}), actual(c.dtype, {c.tokens, c.cols});
  lmoe::cpu::rms_norm(x.matrix(), gamma, eps, expected.matrix());
  LMOE_CUDA_CHECK(cudaMemcpy(actual.data(), outs[0].data(), tensor_bytes, cudaMemcpyDeviceToHost));
  std::int64_t mismatches = 0;
  for (std::size_t i = 0; i < tensor_bytes; i += esize) {
    mismatches += std::memcmp(expected.data() + i, actual.data() + i, esize) != 0;
  }
  const std::string check =
      mismatches == 0 ? "bits=cpu" : std::to_string(mismatches) + " differ from cpu";

  const double gbps = static_cast<double>(moved) / (t.median_us * 1e3);
  const std::string shape = "T=" + std::to_string(c.tokens) + " l=" + std::to_string(c.cols);
  const std::string dtype(lmoe::dtype_name(c.dtype));
  print_row("rms_norm", shape, dtype, t, gbps, 100.0 * gbps / copy_gbps, 0, 0, check);
  Json row = timing_json(t);
  row.update({{"tokens", c.tokens},
              {"d_latent", c.cols},
              {"dtype", dtype},
              {"bytes_moved", moved},
              {"buffer_sets", sets},
              {"GBps", gbps},
              {"pct_of_copy", 100.0 * gbps / copy_gbps},
              {"bit_mismatches_vs_cpu", mismatches}});
  return row;
}

// ---- (c, d) GEMM --------------------------------------------------------------------------------

struct GemmCase {
  std::string name;
  std::int64_t m, n, k;
  DType out_dtype;
};

Json bench_gemm(const GemmCase& c, lmoe::cuda::CublasLtGemm& gemm, Timer& timer,
                cudaStream_t stream, double square_tflops, double& tflops) {
  const DType dtype = DType::bf16;
  const DeviceBuffer a = to_device(random_tensor(dtype, c.m, c.k, 31));
  const DeviceBuffer w = to_device(random_tensor(dtype, c.n, c.k, 37));
  DeviceBuffer d(static_cast<std::size_t>(c.m * c.n) * lmoe::dtype_size(c.out_dtype));
  const Timing t = timer.time([&](int) {
    gemm.run(a.data(), w.data(), c.k, d.data(), c.n, c.m, c.n, c.k, dtype, c.out_dtype, stream);
  });
  const double flops =
      2.0 * static_cast<double>(c.m) * static_cast<double>(c.n) * static_cast<double>(c.k);
  tflops = flops / (t.median_us * 1e6);
  const double pct = square_tflops > 0 ? 100.0 * tflops / square_tflops : 100.0;
  const std::string shape =
      std::to_string(c.m) + "x" + std::to_string(c.n) + "x" + std::to_string(c.k);
  const std::string dtypes = "bf16>" + std::string(lmoe::dtype_name(c.out_dtype));
  print_row("gemm", shape, dtypes, t, 0, 0, tflops, pct, c.name);
  Json row = timing_json(t);
  row.update({{"name", c.name},
              {"m", c.m},
              {"n", c.n},
              {"k", c.k},
              {"dtype", "bf16"},
              {"out_dtype", std::string(lmoe::dtype_name(c.out_dtype))},
              {"flops", flops},
              {"TFLOPs", tflops},
              {"pct_of_square", pct}});
  return row;
}

// ---- the up-projection with its add: in the epilogue (each tile) and unfused
// ------------------------

struct EpilogueCase {
  std::string name;
  std::int64_t m, n, k, ld;  // C and D: [m, n] inside rows of ld elements (a stripe when n < ld)
  lmoe::cuda::EpilogueAdd add;
};

// One row per way: the epilogue GEMM with each tile and the automatic one, and the unfused path the
// tiers take without it (cuBLASLt's product, then the add kernel: bf16 U for round_product_first,
// the fp32 accumulator for round_once). Bytes: W, A, C and D once each.
Json bench_epilogue(const EpilogueCase& c, lmoe::cuda::CublasLtGemm& gemm, Timer& timer,
                    cudaStream_t stream, double square_tflops, double copy_gbps) {
  using lmoe::cuda::EpilogueAdd;
  using lmoe::cuda::EpilogueTile;
  const DType dtype = DType::bf16;
  const DeviceBuffer a = to_device(random_tensor(dtype, c.m, c.k, 41));
  const DeviceBuffer w = to_device(random_tensor(dtype, c.n, c.k, 43));
  const DeviceBuffer cbuf = to_device(random_tensor(dtype, c.m, c.ld, 47));
  DeviceBuffer d(cbuf.bytes()), scratch(static_cast<std::size_t>(c.m * c.n) * sizeof(float));
  const double flops = 2.0 * static_cast<double>(c.m * c.n * c.k);
  const double bytes = 2.0 * static_cast<double>(c.n * c.k + c.m * c.k + 2 * c.m * c.n);
  const std::string shape =
      std::to_string(c.m) + "x" + std::to_string(c.n) + "x" + std::to_string(c.k);
  const std::string add = c.add == EpilogueAdd::round_once ? "once" : "product";
  Json rows = Json::array();
  const auto record = [&](const std::string& way, const Timing& t) {
    const double tflops = flops / (t.median_us * 1e6), gbps = bytes / (t.median_us * 1e3);
    print_row("epilogue", shape, add, t, gbps, 100.0 * gbps / copy_gbps, tflops,
              square_tflops > 0 ? 100.0 * tflops / square_tflops : 0, c.name + ", " + way);
    Json row = timing_json(t);
    row.update({{"name", c.name},
                {"way", way},
                {"add", add},
                {"m", c.m},
                {"n", c.n},
                {"k", c.k},
                {"ld", c.ld},
                {"TFLOPs", tflops},
                {"GBps", gbps}});
    rows.push_back(row);
  };
  lmoe::cuda::EpilogueGemmArgs args{.a = a.data(),
                                    .w = w.data(),
                                    .ldw = c.k,
                                    .c = cbuf.data(),
                                    .ldc = c.ld,
                                    .d = d.data(),
                                    .ldd = c.ld,
                                    .m = c.m,
                                    .n = c.n,
                                    .k = c.k,
                                    .dtype = dtype,
                                    .add = c.add};
  std::vector<std::string> names;
  std::vector<std::function<void(int)>> ways;
  if (auto limit = lmoe::cuda::epilogue_gemm_limit(args)) {
    std::printf("# epilogue GEMM not measured: %s\n", limit->c_str());
  } else {
    std::vector<EpilogueTile> tiles{EpilogueTile::automatic};
    tiles.insert(tiles.end(), std::begin(lmoe::cuda::kEpilogueTiles),
                 std::end(lmoe::cuda::kEpilogueTiles));
    for (EpilogueTile tile : tiles) {
      names.push_back(tile == EpilogueTile::automatic
                          ? "automatic=" + std::string(lmoe::cuda::epilogue_tile_name(
                                               lmoe::cuda::epilogue_tile_for(c.m, c.n)))
                          : std::string(lmoe::cuda::epilogue_tile_name(tile)));
      lmoe::cuda::EpilogueGemmArgs way = args;
      way.tile = tile;
      ways.emplace_back([&, way](int) { lmoe::cuda::run_epilogue_gemm(way, stream); });
    }
  }
  names.emplace_back("unfused");
  ways.emplace_back([&](int) {
    if (c.add == EpilogueAdd::round_product_first) {
      gemm.run(a.data(), w.data(), c.k, d.data(), c.n, c.m, c.n, c.k, dtype, dtype, stream);
      LMOE_CUDA_CHECK(
          lmoe::cuda::launch_add(d.data(), cbuf.data(), d.data(), c.m * c.n, dtype, stream));
    } else {
      gemm.run(a.data(), w.data(), c.k, scratch.data(), c.n, c.m, c.n, c.k, dtype, DType::f32,
               stream);
      LMOE_CUDA_CHECK(lmoe::cuda::launch_accumulate_stripe(
          d.data(), c.ld, static_cast<const float*>(scratch.data()), c.m, c.n, dtype, stream));
    }
  });
  // In turns: the ways are compared with each other, so the clock's drift must not pick a winner.
  const std::vector<Timing> timings = timer.time_together(ways);
  for (std::size_t i = 0; i < ways.size(); ++i) record(names[i], timings[i]);
  return rows;
}

// ---- (e) the grouped GEMM with MXFP4 weights at decode ------------------------------------------

// `bytes` on the device holding `pattern` over and over (weights too large to draw on the host).
DeviceBuffer tiled_device(const std::vector<std::uint8_t>& pattern, std::size_t bytes) {
  DeviceBuffer buffer(bytes);
  for (std::size_t at = 0; at < bytes; at += pattern.size()) {
    LMOE_CUDA_CHECK(cudaMemcpy(buffer.at(at), pattern.data(), std::min(pattern.size(), bytes - at),
                               cudaMemcpyHostToDevice));
  }
  return buffer;
}

// One weight [E, N, K] of every expert, dense (bf16 in [-1, 1)) and MXFP4 (random codes, scales
// 2^-4 … 2^3), from 16 MiB patterns.
struct BenchWeight {
  DeviceBuffer dense, blocks, scales;
  BenchWeight(std::int64_t experts, std::int64_t n, std::int64_t k, std::uint64_t seed) {
    const std::size_t values = static_cast<std::size_t>(experts * n * k);
    lmoe::SplitMix64 random{seed};
    std::vector<std::uint8_t> pattern(std::size_t{16} << 20);
    const lmoe::HostTensor bf16 =
        random_tensor(DType::bf16, 1, static_cast<std::int64_t>(pattern.size() / 2), seed);
    std::memcpy(pattern.data(), bf16.data(), pattern.size());
    dense = tiled_device(pattern, values * 2);
    for (auto& byte : pattern) byte = static_cast<std::uint8_t>(random.next());
    blocks = tiled_device(pattern, values / 2);
    for (auto& byte : pattern) byte = static_cast<std::uint8_t>(123 + random.next() % 8);
    scales = tiled_device(pattern, values / 32);
  }
};

// `first` for `rows` rows in each of `active` experts of `experts`: those of set `set` of the
// `sets` that rotate (experts set, set + sets, …), so that a launch's weights have left L2 when its
// set comes round again.
std::vector<std::int32_t> decode_first(std::int64_t experts, int active, int set, int sets,
                                       std::int64_t rows) {
  std::vector<std::int32_t> first(static_cast<std::size_t>(experts + 1), 0);
  for (std::int64_t e = 0; e < experts; ++e) {
    const bool on = e % sets == set && e / sets < active;
    first[e + 1] = first[e] + static_cast<std::int32_t>(on ? rows : 0);
  }
  return first;
}

Json bench_packed_grouped(Timer& timer, cudaStream_t stream, double copy_gbps) {
  using lmoe::cuda::GroupedGemmArgs;
  using lmoe::cuda::GroupedOut;
  const lmoe::LayerConfig config = *lmoe::find_preset("kimi-k3").layer;
  const std::int64_t experts = 112, l = config.d_latent;
  const int active = 16, sets = static_cast<int>(experts / active);
  Json rows = Json::array();
  for (const int tp : {1, 8}) {
    const std::int64_t inter = config.expert_intermediate / tp;
    const BenchWeight up(experts, inter, l, 51), gate(experts, inter, l, 52),
        down(experts, l, inter, 53);
    for (const std::int64_t tokens : {1, 16}) {
      const std::int64_t total = active * tokens;  // the grouped rows: T per active expert
      std::vector<DeviceBuffer> firsts;
      for (int s = 0; s < sets; ++s) {
        const std::vector<std::int32_t> first = decode_first(experts, active, s, sets, tokens);
        firsts.emplace_back(first.size() * 4);
        LMOE_CUDA_CHECK(cudaMemcpy(firsts.back().data(), first.data(), first.size() * 4,
                                   cudaMemcpyHostToDevice));
      }
      std::vector<std::int32_t> token_of_row(static_cast<std::size_t>(total));
      for (std::int64_t r = 0; r < total; ++r)
        token_of_row[r] = static_cast<std::int32_t>(r % tokens);
      DeviceBuffer a_rows(token_of_row.size() * 4);
      LMOE_CUDA_CHECK(
          cudaMemcpy(a_rows.data(), token_of_row.data(), a_rows.bytes(), cudaMemcpyHostToDevice));
      const DeviceBuffer z = to_device(random_tensor(DType::bf16, tokens, l, 54));
      const DeviceBuffer hidden = to_device(random_tensor(DType::bf16, total, inter, 55));
      DeviceBuffer slot_out(static_cast<std::size_t>(total * l) * 4);

      for (const bool packed : {false, true}) {
        GroupedGemmArgs call;
        call.groups = static_cast<int>(experts);
        call.max_rows = total;
        call.max_groups = active;
        call.dtype = DType::bf16;
        const auto weight = [&](const BenchWeight& w, const BenchWeight* g, std::int64_t n,
                                std::int64_t k, GroupedGemmArgs& args) {
          args.n = n;
          args.k = k;
          if (packed) {
            args.b_blocks = static_cast<const std::uint8_t*>(w.blocks.data());
            args.b_scales = static_cast<const std::uint8_t*>(w.scales.data());
            args.b2_blocks = g ? static_cast<const std::uint8_t*>(g->blocks.data()) : nullptr;
            args.b2_scales = g ? static_cast<const std::uint8_t*>(g->scales.data()) : nullptr;
            args.blocks_group_stride = n * k / 2;
            args.scales_group_stride = n * k / 32;
          } else {
            args.b = w.dense.data();
            args.b2 = g ? g->dense.data() : nullptr;
            args.b_group_stride = n * k;
          }
        };
        GroupedGemmArgs up_call = call, down_call = call;
        weight(up, &gate, inter, l, up_call);
        up_call.a = z.data();
        up_call.a_rows = static_cast<const std::int32_t*>(a_rows.data());
        up_call.lda = l;
        up_call.c = hidden.data();
        up_call.ldc = inter;
        up_call.out = GroupedOut::activation;
        up_call.activation = &config;
        weight(down, nullptr, l, inter, down_call);
        down_call.a = hidden.data();
        down_call.lda = inter;
        down_call.c = slot_out.data();
        down_call.ldc = l;
        down_call.out = GroupedOut::f32;
        for (const auto& [name, args, matrices] :
             {std::tuple{"up", up_call, 2}, std::tuple{"down", down_call, 1}}) {
          GroupedGemmArgs checked = args;  // each launch sets `first` to its set's
          checked.first = static_cast<const std::int32_t*>(firsts[0].data());
          if (auto why = lmoe::cuda::grouped_gemm_unsupported(checked))
            throw lmoe::Error(std::string("grouped ") + name + ": " + *why);
          const Timing t = timer.time([&, &args = args](int i) {
            GroupedGemmArgs launch = args;
            launch.first = static_cast<const std::int32_t*>(firsts[i % sets].data());
            lmoe::cuda::check(lmoe::cuda::launch_grouped_gemm(launch, stream), "grouped GEMM");
          });
          const double values = static_cast<double>(matrices * active) *
                                static_cast<double>(inter) * static_cast<double>(l);
          const double weight_bytes = packed ? values * (0.5 + 1.0 / 32) : values * 2;
          const double gbps = weight_bytes / (t.median_us * 1e3);
          const std::string tile =
              lmoe::cuda::grouped_tile_name(lmoe::cuda::grouped_gemm_tile(checked));
          const std::string way = packed ? "mxfp4" : "bf16";
          const std::string shape =
              std::string(name) + " I=" + std::to_string(inter) + " T=" + std::to_string(tokens);
          print_row("grouped", shape, way, t, gbps, 100.0 * gbps / copy_gbps, 0, 0,
                    "16 of 112 experts, " + tile);
          Json row = timing_json(t);
          row.update({{"call", name},
                      {"weights", way},
                      {"tile", tile},
                      {"tp", tp},
                      {"d_latent", l},
                      {"intermediate_per_rank", inter},
                      {"experts", experts},
                      {"active_experts", active},
                      {"rows_per_expert", tokens},
                      {"weight_bytes", weight_bytes},
                      {"GBps", gbps},
                      {"pct_of_copy", 100.0 * gbps / copy_gbps}});
          rows.push_back(row);
        }
      }
    }
  }
  return rows;
}

// ---- (f) the router -----------------------------------------------------------------------------

// A bf16 layer's router stage at a preset's router, split into what runs: the logits GEMM over
// the weight's three bf16 parts, the selection kernel on its [T, 3E] logits, and the whole stage
// (LayerRouter::route as a captured forward runs it: no copy to the host). The floor is the fp32
// weight read once at the copy rate: what any router that reads the weight as shipped must move.
Json bench_router(const std::string& preset, std::int64_t tokens, lmoe::cuda::CublasLtGemm& gemm,
                  Timer& timer, cudaStream_t stream, double copy_gbps) {
  const lmoe::LayerConfig config = *lmoe::find_preset(preset).layer;
  const std::int64_t experts = config.router.num_experts, d = config.d_model;
  lmoe::LayerWeights weights;
  weights.router_weight = random_tensor(DType::f32, experts, d, 61);
  if (config.router.correction_bias) {
    weights.router_bias = lmoe::HostTensor(DType::f32, {experts});
    for (std::int64_t e = 0; e < experts; ++e) weights.router_bias.set(e, 0.01f * (e % 7));
  }
  const DeviceBuffer parts = to_device(lmoe::split_router_weight_bf16(weights.router_weight));
  const DeviceBuffer bias =
      config.router.correction_bias ? to_device(weights.router_bias) : DeviceBuffer();
  const DeviceBuffer x = to_device(random_tensor(DType::bf16, tokens, d, 62));
  DeviceBuffer logits(static_cast<std::size_t>(tokens * 3 * experts) * 4);
  DeviceBuffer routing(static_cast<std::size_t>(tokens * config.router.top_k) * 8);
  auto* ids = static_cast<std::int32_t*>(routing.data());
  auto* routing_weights = reinterpret_cast<float*>(ids + tokens * config.router.top_k);
  lmoe::cuda::LayerRouter router(config, DType::bf16, weights);
  router.reserve(tokens);
  const lmoe::ConstMatrixView view{x.data(), DType::bf16, tokens, d, d, lmoe::MemorySpace::device};
  const double floor_bytes = static_cast<double>(experts * d) * 4.0;
  const double floor_us = floor_bytes / (copy_gbps * 1e3);
  const std::function<void()> steps[] = {
      [&] {
        gemm.run(x.data(), parts.data(), d, logits.data(), 3 * experts, tokens, 3 * experts, d,
                 DType::bf16, DType::f32, stream);
      },
      [&] {
        lmoe::cuda::check(lmoe::cuda::launch_route(static_cast<const float*>(logits.data()),
                                                   static_cast<const float*>(bias.data()), tokens,
                                                   config.router, ids, routing_weights, stream, 3),
                          "launch_route");
      },
      [&] { router.route(view, true, gemm, stream); }};
  const char* names[] = {"logits", "select", "stage"};
  Json rows = Json::array();
  for (int i = 0; i < 3; ++i) {
    const Timing t = timer.time([&](int) { steps[i](); });
    const double gbps = i == 1 ? 0 : floor_bytes / (t.median_us * 1e3);
    char check[96];
    std::snprintf(check, sizeof(check), "E=%lld d=%lld k=%lld; fp32 weight floor %.2f us",
                  static_cast<long long>(experts), static_cast<long long>(d),
                  static_cast<long long>(config.router.top_k), floor_us);
    print_row("router", preset + " T=" + std::to_string(tokens), names[i], t, gbps,
              100.0 * gbps / copy_gbps, 0, 0, check);
    Json row = timing_json(t);
    row.update({{"preset", preset},
                {"tokens", tokens},
                {"step", names[i]},
                {"experts", experts},
                {"d_model", d},
                {"top_k", config.router.top_k},
                {"floor_us", floor_us}});
    rows.push_back(row);
  }
  return rows;
}

int run(const Settings& settings) {
  int device = 0;
  LMOE_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp props{};
  LMOE_CUDA_CHECK(cudaGetDeviceProperties(&props, device));
  int driver = 0, runtime = 0;
  LMOE_CUDA_CHECK(cudaDriverGetVersion(&driver));
  LMOE_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  const std::string date = utc_now(), module = driver_module_version();
  std::printf(
      "# lmoe_kernel_bench %s\n# %s, sm_%d%d, %d SMs, L2 %d MiB, %.0f GiB; driver %s (CUDA %s), "
      "runtime %s, "
      "cuBLASLt %zu\n# %d warm-up and %d timed graph launches per row; times are per operation\n",
      date.c_str(), props.name, props.major, props.minor, props.multiProcessorCount,
      props.l2CacheSize >> 20, static_cast<double>(props.totalGlobalMem) / (1 << 30),
      module.c_str(), cuda_version_string(driver).c_str(), cuda_version_string(runtime).c_str(),
      cublasLtGetVersion(), settings.warmup, settings.repeats);

  cudaStream_t stream = nullptr;
  LMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Json report = {
      {"program", "lmoe_kernel_bench"},
      {"date", date},
      {"gpu",
       {{"name", props.name},
        {"compute_capability", std::to_string(props.major) + "." + std::to_string(props.minor)},
        {"multiprocessors", props.multiProcessorCount},
        {"l2_bytes", props.l2CacheSize},
        {"memory_bytes", props.totalGlobalMem}}},
      {"driver_module_version", module},
      {"driver_cuda_version", cuda_version_string(driver)},
      {"runtime_cuda_version", cuda_version_string(runtime)},
      {"cublaslt_version", cublasLtGetVersion()},
      {"settings",
       {{"warmup", settings.warmup},
        {"repeats", settings.repeats},
        {"graph_target_us", settings.graph_target_us}}}};
  {
    Timer timer(settings, stream);
    print_header();
    double copy_gbps = 0;
    report["copy"] = bench_copy(settings, timer, stream, copy_gbps);

    const NormCase norms[] = {{1, 3584, DType::bf16},    {16, 3584, DType::bf16},
                              {128, 3584, DType::bf16},  {1024, 3584, DType::bf16},
                              {4096, 3584, DType::bf16}, {8192, 3584, DType::bf16},
                              {8192, 1024, DType::bf16}, {8192, 3584, DType::f32}};
    report["rms_norm"] = Json::array();
    if (settings.runs("norm")) {
      for (const NormCase& c : norms)
        report["rms_norm"].push_back(bench_norm(c, props, timer, stream, copy_gbps));
    }

    lmoe::cuda::CublasLtGemm gemm;
    const GemmCase gemms[] = {{"square", 8192, 8192, 8192, DType::bf16},
                              {"column stripe (tp=8)", 8192, 896, 3584, DType::bf16},
                              {"column stripe (tp=8)", 8192, 896, 3584, DType::f32},
                              {"full width", 8192, 7168, 3584, DType::bf16}};
    report["gemm"] = Json::array();
    double square_tflops = 0;
    for (const GemmCase& c : gemms) {
      // The square GEMM is the epilogue rows' reference rate.
      if (!settings.runs("gemm") && !(c.name == "square" && settings.runs("epilogue"))) continue;
      double tflops = 0;
      report["gemm"].push_back(bench_gemm(c, gemm, timer, stream, square_tflops, tflops));
      if (c.name == "square") square_tflops = tflops;
    }

    report["epilogue"] = Json::array();
    for (std::int64_t m : {1, 16, 128, 1024, 8192}) {
      if (!settings.runs("epilogue")) break;
      for (const EpilogueCase& c :
           {EpilogueCase{"full width", m, 7168, 3584, 7168,
                         lmoe::cuda::EpilogueAdd::round_product_first},
            EpilogueCase{"full width", m, 7168, 3584, 7168, lmoe::cuda::EpilogueAdd::round_once},
            EpilogueCase{"column stripe (tp=8)", m, 896, 3584, 7168,
                         lmoe::cuda::EpilogueAdd::round_once}}) {
        for (Json& row : bench_epilogue(c, gemm, timer, stream, square_tflops, copy_gbps))
          report["epilogue"].push_back(std::move(row));
      }
    }

    report["grouped_mxfp4"] =
        settings.runs("grouped") ? bench_packed_grouped(timer, stream, copy_gbps) : Json::array();

    report["router"] = Json::array();
    for (const char* preset : {"kimi-k3", "nemotron-3-super"}) {
      for (const std::int64_t tokens : {1, 16, 128}) {
        if (!settings.runs("router")) break;
        for (Json& row : bench_router(preset, tokens, gemm, timer, stream, copy_gbps))
          report["router"].push_back(std::move(row));
      }
    }
  }
  LMOE_CUDA_CHECK(cudaStreamDestroy(stream));

  if (!settings.json_path.empty()) {
    std::ofstream file(settings.json_path);
    if (!file) throw lmoe::Error("--json: cannot write '" + settings.json_path + "'");
    file << report.dump(2) << "\n";
    std::printf("# wrote %s\n", settings.json_path.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "lmoe_kernel_bench — copy bandwidth, RMSNorm and GEMM rates on this GPU (never asserts a "
      "time)"};
  Settings settings;
  app.add_option("--json", settings.json_path, "write the results as JSON to this file");
  app.add_option("--repeats", settings.repeats, "timed graph launches per row (median, p10, p90)")
      ->check(CLI::Range(20, 100000))
      ->capture_default_str();
  app.add_option("--warmup", settings.warmup, "untimed graph launches per row")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  app.add_option("--copy-mib", settings.copy_mib,
                 "bytes of the device-to-device copy, in MiB (>= 256)")
      ->check(CLI::Range(256.0, 65536.0))
      ->capture_default_str();
  app.add_option("--sections", settings.sections,
                 "what to measure after the copy bandwidth (comma-separated)")
      ->delimiter(',')
      ->check(CLI::IsMember({"norm", "gemm", "epilogue", "grouped", "router"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    return run(settings);
  } catch (const lmoe::Error& error) {
    std::cerr << "lmoe_kernel_bench: error: " << error.what() << "\n";
    return 1;
  }
}

// The options of a benchmark sweep that `lmoe bench` and `lmoe tune` share (backend, model dims,
// ranks, token counts, warm-up, iterations, cold L2, mode, seed), and their resolution into
// BenchOptions.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common.hpp"
#include "lmoe/tools/tail_bench.hpp"

namespace lmoe::cli {

struct SweepOptions {
  ModelOptions model;
  std::string backend = "auto";
  std::optional<int> ranks;
  std::vector<std::int64_t> tokens;
  std::optional<int> warmup;
  std::optional<int> iters;
  bool cold_l2 = false;
  int layers = 1;
  std::string mode = "auto";
  std::uint64_t seed = 2026;

  // `ranks_names`: "-n,--ranks" or with more aliases; `tokens_default` says the default grid in
  // --help. The model defaults to kimi-k3 on cuda and small on cpu.
  void add_to(CLI::App& app, const std::string& ranks_names, const std::string& tokens_default);

  struct Resolved {
    BenchOptions options;  // backend, dims, eps, dtype, tp, tokens, warm-up, iterations, cold_l2,
                           // layers, mode, seed
    std::string preset;    // the model's name
  };
  // Throws lmoe::Error naming the first bad option. `app` tells whether --preset was given.
  // Tokens left out are `default_tokens(backend)`.
  Resolved resolve(const CLI::App& app,
                   std::vector<std::int64_t> (*default_tokens)(Backend backend)) const;

  // The options of these that the command line gave ("-t/--tokens", "--iters", ...), in the order
  // they were added: what a command that takes its sweep from a recorded file must refuse.
  std::vector<std::string> given(const CLI::App& app) const;

 private:
  std::string ranks_flag_ = "-n/--ranks";
};

}  // namespace lmoe::cli

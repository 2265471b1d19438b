// The benchmark's rank on host memory (the cpu backend): buffers are HostTensors and a forward
// (every layer's tail) is timed with steady_clock between two barriers, so that it spans the
// slowest rank's work.
#include <chrono>
#include <cstring>
#include <utility>
#include <vector>

#include "lmoe/error.hpp"
#include "tools/bench_rank.hpp"
#include "tools/bench_values.hpp"

namespace lmoe {

void fill_bench_values(void* dst, std::size_t count, DType dtype, std::uint64_t seed) {
  for (std::size_t i = 0; i < count; ++i) store_from_float(dst, i, dtype, bench::value(seed, i));
}

HostTensor first_differing_output(std::vector<HostTensor> outputs) {
  LMOE_CHECK(!outputs.empty(), "bench: expected at least one layer's output, got none");
  for (HostTensor& output : outputs) {
    if (!same_bits(output, outputs[0])) return std::move(output);
  }
  return std::move(outputs[0]);
}

namespace {

class HostBenchRank final : public BenchRank {
 public:
  HostBenchRank(std::span<LatentTail* const> layers, Communicator& comm, std::int64_t max_tokens)
      : layers_(layers.begin(), layers.end()),
        comm_(comm),
        dims_(layers.front()->options().dims),
        dtype_(layers.front()->options().dtype),
        routed_(dtype_, {max_tokens, dims_.d_latent}),
        pristine_shared_(dtype_, {max_tokens, dims_.d_model}) {
    for (std::size_t i = 0; i < layers_.size(); ++i) {
      shared_.emplace_back(dtype_, std::vector<std::int64_t>{max_tokens, dims_.d_model});
      out_.emplace_back(dtype_, std::vector<std::int64_t>{max_tokens, dims_.d_model});
    }
  }

  void load_inputs(std::int64_t num_tokens, std::uint64_t routed_seed,
                   std::uint64_t shared_seed) override {
    LMOE_CHECK(num_tokens >= 1 && num_tokens <= routed_.shape()[0],
               "bench: T=" + std::to_string(num_tokens) + " outside the buffers' 1.." +
                   std::to_string(routed_.shape()[0]));
    comm_.barrier();
    tokens_ = num_tokens;
    fill_bench_values(routed_.data(), elements(dims_.d_latent), dtype_, routed_seed);
    fill_bench_values(pristine_shared_.data(), elements(dims_.d_model), dtype_, shared_seed);
    restore_and_poison();
    comm_.barrier();
  }

  void prepare(TailTier tier, BenchMode mode) override {
    LMOE_CHECK(mode == BenchMode::eager, "bench: the cpu backend has no graph mode");
    tier_ = tier;
  }

  void warm_up(int count) override {
    for (int i = 0; i < count; ++i) forward();
  }

  std::vector<double> time(int count) override {
    std::vector<double> seconds;
    for (int i = 0; i < count; ++i) {
      comm_.barrier();
      const auto start = std::chrono::steady_clock::now();
      forward();
      comm_.barrier();
      seconds.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    return seconds;
  }

  HostTensor checked_output() override {
    comm_.barrier();
    restore_and_poison();
    comm_.barrier();
    forward();
    std::vector<HostTensor> outputs;
    for (const HostTensor& out : out_) {
      HostTensor y(dtype_, {tokens_, dims_.d_model});
      std::memcpy(y.data(), out.data(), y.nbytes());
      outputs.push_back(std::move(y));
    }
    return first_differing_output(std::move(outputs));
  }

 private:
  std::size_t elements(std::int64_t cols) const { return static_cast<std::size_t>(tokens_ * cols); }

  void restore_and_poison() {
    const std::size_t bytes = elements(dims_.d_model) * dtype_size(dtype_);
    for (std::size_t i = 0; i < layers_.size(); ++i) {
      std::memcpy(shared_[i].data(), pristine_shared_.data(), bytes);
      std::memset(out_[i].data(), 0xff, bytes);
    }
  }

  void forward() {
    for (std::size_t i = 0; i < layers_.size(); ++i) {
      layers_[i]->forward(routed_.matrix().row_block(0, tokens_),
                          shared_[i].matrix().row_block(0, tokens_),
                          out_[i].matrix().row_block(0, tokens_), tier_);
    }
  }

  std::vector<LatentTail*> layers_;
  Communicator& comm_;
  TailDims dims_;
  DType dtype_;
  HostTensor routed_;           // [max T, l], every layer's input
  HostTensor pristine_shared_;  // [max T, d]: the loaded shared, to restore it
  std::vector<HostTensor>
      shared_;                   // per layer [max T, d]: the call's input, which column overwrites
  std::vector<HostTensor> out_;  // per layer [max T, d]
  std::int64_t tokens_ = 0;
  TailTier tier_ = TailTier::overlap;
};

}  // namespace

std::unique_ptr<BenchRank> make_host_bench_rank(std::span<LatentTail* const> layers,
                                                Communicator& comm, std::int64_t max_tokens) {
  LMOE_CHECK(!layers.empty(), "bench: expected at least one layer's tail, got none");
  return std::make_unique<HostBenchRank>(layers, comm, max_tokens);
}

}  // namespace lmoe

// The tiers on a GPU with the CPU executor's dataflow (src/cpu/cpu_tail_executor.cpp): a rank
// computes and writes only its own part, and every exchange goes through the communicator, on the
// caller's stream. The kernels are src/cuda/*.cuh; the GEMM is cuBLASLt.
#include "cuda/tail/cuda_tail_executor.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <set>
#include <utility>
#include <vector>

#include "core/token_chunks.hpp"
#include "cuda/comm/nccl_settings.hpp"
#include "cuda/comm/p2p_peer_access.hpp"
#include "cuda/fused/fused_tail.hpp"
#include "cuda/gemm/cublaslt_gemm.hpp"
#include "cuda/gemm/epilogue_gemm.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "cuda/runtime/mapped_host_buffer.hpp"
#include "cuda/runtime/rank_device.hpp"
#include "cuda/tail/launchers.hpp"
#include "cuda/tail/token_switch.hpp"
#include "lmoe/error.hpp"
#include "lmoe/settings.hpp"

namespace lmoe {

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error so later calls start clean
    return 0;
  }
  return count;
}

std::optional<std::string> cuda_tier_limit(TailTier tier, const TailProblem& problem) {
  const std::int64_t d = problem.dims.d_model, l = problem.dims.d_latent;
  if (tier == TailTier::fused) {
    if (auto limit = cuda::FusedTail::problem_limit(problem.dims, problem.dtype, problem.tp))
      return limit;
    if (problem.num_tokens > cuda::kFusedMaxTokens) {
      return "T=" + std::to_string(problem.num_tokens) + " > " +
             std::to_string(cuda::kFusedMaxTokens) + " (fused's workspace rows)";
    }
  }
  if (problem.tp > cuda::kMaxReduceInputs) {
    return "tp=" + std::to_string(problem.tp) + " > " + std::to_string(cuda::kMaxReduceInputs) +
           " (the same-GPU collectives reduce at most that many ranks in one launch)";
  }
  // Every row of a [T, d] or [T, l] tensor then starts 16-byte aligned, which the vectorized
  // kernels and cuBLASLt's fast paths need.
  if (d % 8 != 0 || l % 8 != 0) {
    return "d_model=" + std::to_string(d) + " and d_latent=" + std::to_string(l) +
           " must be multiples of 8 (16-byte aligned rows on the GPU)";
  }
  return std::nullopt;
}

namespace {

using cuda::check;
using cuda::DeviceBuffer;

// A stream that only captures (a conditional body's work): destroyed without a synchronize, which
// the parent capture in progress would not allow; it never ran anything.
class CaptureStream {
 public:
  CaptureStream() { LMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~CaptureStream() { cudaStreamDestroy(stream_); }
  CaptureStream(const CaptureStream&) = delete;
  CaptureStream& operator=(const CaptureStream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

class CudaTailExecutor final : public TailExecutor, public DeviceTokensRunner {
 public:
  CudaTailExecutor(Communicator& comm, TailDims dims, DType dtype, bool latent_norm, float eps,
                   ConstMatrixView norm_weight, ConstMatrixView up_proj_weight,
                   std::int64_t max_tokens)
      : comm_(comm),
        dims_(dims),
        dtype_(dtype),
        esize_(dtype_size(dtype)),
        latent_norm_(latent_norm),
        eps_(eps),
        fixed_capacity_(max_tokens > 0) {
    if (comm.memory_space() != MemorySpace::device) {
      throw Error(
          "the cuda backend needs a communicator of device buffers (cuda-threads, p2p, nccl), got "
          "'" +
          std::string(comm.backend_name()) + "'");
    }
    device_ = cuda::make_rank_device_current(comm);
    const std::int64_t d = dims_.d_model, l = dims_.d_latent;

    // gamma is kept in fp32: the norm multiplies by the exact fp32 value of the stored weight.
    std::vector<float> gamma(static_cast<std::size_t>(l));
    for (std::int64_t j = 0; j < l; ++j)
      gamma[j] = load_as_float(norm_weight.data, static_cast<std::size_t>(j), dtype);
    gamma_ = DeviceBuffer(gamma.size() * sizeof(float));
    // gamma goes up on the side stream, so that the stream has run work before its first
    // collective: a stream whose first work is a round can stall ranks that share a GPU
    // (docs/p2p.md, "A stream's first work"; `token`'s chunked body issues its rounds there).
    LMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&side_stream_, cudaStreamNonBlocking));
    LMOE_CUDA_CHECK(cudaMemcpyAsync(gamma_.data(), gamma.data(), gamma_.bytes(),
                                    cudaMemcpyHostToDevice, side_stream_));
    LMOE_CUDA_CHECK(cudaStreamSynchronize(side_stream_));

    w_up_ = DeviceBuffer(static_cast<std::size_t>(d * l) * esize_);  // [d, l], contiguous
    LMOE_CUDA_CHECK(cudaMemcpy2D(
        w_up_.data(), static_cast<std::size_t>(l) * esize_, up_proj_weight.data,
        static_cast<std::size_t>(up_proj_weight.ld) * esize_, static_cast<std::size_t>(l) * esize_,
        static_cast<std::size_t>(d), cudaMemcpyHostToDevice));

    LMOE_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
    LMOE_CUDA_CHECK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
    for (auto* events : {&scattered_, &added_}) {
      for (cudaEvent_t& event : *events)
        LMOE_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    }
    token_chunks_ = token_chunks_setting_from_environment();
    gemm_ = std::make_unique<cuda::CublasLtGemm>();
    // Whether this GPU and dtype take the add in the GEMM's epilogue; a call whose views TMA cannot
    // take still falls back (up_project_add).
    const cuda::EpilogueGemmArgs probe{.a = w_up_.data(),
                                       .w = w_up_.data(),
                                       .ldw = l,
                                       .c = w_up_.data(),
                                       .ldc = d,
                                       .d = w_up_.data(),
                                       .ldd = d,
                                       .m = 1,
                                       .n = d,
                                       .k = l,
                                       .dtype = dtype};
    // Unset: by size (fills_the_gpu); 1: at every size; 0: never.
    const std::optional<bool> epilogue_setting = setting_flag_if_set("LMOE_EPILOGUE_GEMM");
    epilogue_gemm_ = epilogue_setting.value_or(true) && !cuda::epilogue_gemm_limit(probe);
    epilogue_at_every_size_ = epilogue_setting.value_or(false);
    // Where replays with T read on the device record what they could not run, and where that T is
    // read back outside capture (a few bytes; mapped so the selector kernel writes it directly).
    token_mapped_ = cuda::MappedHostBuffer(sizeof(cuda::TokenSwitchStatus) + sizeof(std::int32_t));
    token_status_ = static_cast<cuda::TokenSwitchStatus*>(token_mapped_.data());
    tokens_read_back_ = reinterpret_cast<std::int32_t*>(token_status_ + 1);
    if (fixed_capacity_) allocate_workspaces(max_tokens);

    // Every p2p rank with peers: they spin on the device, on this GPU or another (warm_up_gemms).
    spinning_peers_ = comm.size() > 1 && dynamic_cast<const P2pPeerAccess*>(&comm) != nullptr;

    // The fused kernel, where this communicator and these dims allow it (collective with several
    // ranks: every rank reaches this point, and decides the same).
    fused_unavailable_ = cuda::FusedTail::unavailable(comm, dims, dtype);
    if (!fused_unavailable_) {
      // The fused tier's settings are read here, once, from the settings table.
      fused_ = std::make_unique<cuda::FusedTail>(
          comm, dims, dtype, latent_norm, eps, w_up_rows(comm.rank() * stripe_width()),
          static_cast<const float*>(gamma_.data()), max_tokens,
          cuda::fused_settings_from_environment(comm.size()));
    }
  }

  ~CudaTailExecutor() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(side_stream_);
    cudaEventDestroy(join_);
    for (auto* events : {&scattered_, &added_}) {
      for (cudaEvent_t event : *events) cudaEventDestroy(event);
    }
    cudaEventDestroy(fork_);
    cudaStreamDestroy(side_stream_);
  }

  std::string_view backend_name() const override { return "cuda"; }
  MemorySpace memory_space() const override { return MemorySpace::device; }

  std::optional<std::string> can_implement(TailTier tier,
                                           const TailProblem& problem) const override {
    if (auto limit = cuda_tier_limit(tier, problem)) return limit;
    if (tier == TailTier::fused) {
      if (fused_unavailable_) return fused_unavailable_;
      if (problem.num_tokens > fused_->capacity()) {
        return "T=" + std::to_string(problem.num_tokens) + " > " +
               std::to_string(fused_->capacity()) + " (fused's workspace rows, from max_tokens)";
      }
    }
    return std::nullopt;
  }

  std::optional<std::string> call_limit(TailTier tier, ConstMatrixView routed,
                                        ConstMatrixView shared,
                                        ConstMatrixView out) const override {
    if (tier != TailTier::fused)
      return std::nullopt;  // the other tiers' kernels fall back to scalar access
    return cuda::FusedTail::buffers_limit(routed.data, shared.data, out.data);
  }

  void run(TailTier tier, ConstMatrixView routed, MatrixView shared, MatrixView out,
           StreamHandle stream_handle) override {
    LMOE_CUDA_CHECK(cudaSetDevice(device_));
    const cudaStream_t stream = cuda::stream_or_default(stream_handle);
    const bool captured = capturing(stream);
    if (captured) check_capturable();
    if (tier != TailTier::fused) reserve(routed.rows, stream);  // fused has its own fixed workspace
    if (spinning_peers_ && !captured && tier != TailTier::fused &&
        warmed_.insert({tier, routed.rows}).second) {
      warm_up_gemms(tier, routed.rows, stream);
    }
    run_tier(tier, routed, shared, out, stream, side_stream_, nullptr);
  }

  // ---- T read on the device (DeviceTokensRunner; docs/graphs.md) ----

  std::optional<std::string> device_tokens_limit(TailTier tier) const override {
    // NCCL makes every captured collective wait for its previous one through event nodes unless
    // NCCL_GRAPH_MIXING_SUPPORT=0 (its default is 1); a conditional body cannot hold event nodes,
    // and instantiation would fail. With one rank no collective is issued. NCCL reads the variable
    // once per process, at its first communicator: judge what it read.
    if (comm_.backend_name() == "nccl" && comm_.size() > 1 && tier != TailTier::fused) {
#ifdef LMOE_HAS_NCCL
      return nccl_device_tokens_refusal(nccl_graph_mixing_in_effect());
#endif
    }
    return std::nullopt;
  }

  bool capturing(StreamHandle stream_handle) const override {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    LMOE_CUDA_CHECK(cudaStreamIsCapturing(cuda::stream_or_default(stream_handle), &capture));
    return capture != cudaStreamCaptureStatusNone;
  }

  std::int64_t read_device_tokens(const std::int32_t* tokens_device,
                                  StreamHandle stream_handle) override {
    LMOE_CUDA_CHECK(cudaSetDevice(device_));
    const cudaStream_t stream = cuda::stream_or_default(stream_handle);
    LMOE_CUDA_CHECK(cudaMemcpyAsync(tokens_read_back_, tokens_device, sizeof(std::int32_t),
                                    cudaMemcpyDeviceToHost, stream));
    LMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    return *tokens_read_back_;
  }

  void warm_up_buckets(const std::vector<DeviceTokenBucket>& buckets,
                       StreamHandle stream_handle) override {
    LMOE_CUDA_CHECK(cudaSetDevice(device_));
    const cudaStream_t stream = cuda::stream_or_default(stream_handle);
    LMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    LMOE_CUDA_CHECK(cudaStreamSynchronize(side_stream_));
    comm_.barrier();
    for (const DeviceTokenBucket& bucket : buckets) {
      if (!bucket.tier || *bucket.tier == TailTier::fused) continue;
      reserve(bucket.max_tokens, stream);
      if (warmed_.insert({*bucket.tier, bucket.max_tokens}).second)
        issue_gemms(*bucket.tier, bucket.max_tokens, stream);
    }
    LMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    comm_.barrier();
  }

  void run_bucket(TailTier tier, ConstMatrixView routed, MatrixView shared, MatrixView out,
                  const std::int32_t* tokens_device, StreamHandle stream_handle) override {
    LMOE_CUDA_CHECK(cudaSetDevice(device_));
    const cudaStream_t stream = cuda::stream_or_default(stream_handle);
    if (tier != TailTier::fused) reserve(routed.rows, stream);
    run_tier(tier, routed, shared, out, stream, side_stream_, tokens_device);
  }

  void capture_buckets(const std::vector<DeviceTokenBucket>& buckets, ConstMatrixView routed,
                       MatrixView shared, MatrixView out, const std::int32_t* tokens_device,
                       StreamHandle stream_handle) override {
    LMOE_CUDA_CHECK(cudaSetDevice(device_));
    const cudaStream_t stream = cuda::stream_or_default(stream_handle);
    check_capturable();
    // A GEMM shape's first launch may load a module, which fails a capture: every bucket's shapes
    // must have run once before (warm_up_buckets, from the first eager call).
    for (const DeviceTokenBucket& bucket : buckets) {
      if (bucket.tier && *bucket.tier != TailTier::fused &&
          !warmed_.contains({*bucket.tier, bucket.max_tokens})) {
        throw Error(
            "forward_device_tokens: bucket T in [" + std::to_string(bucket.min_tokens) + ", " +
            std::to_string(bucket.max_tokens) + "] (" + std::string(tier_name(*bucket.tier)) +
            ") has not run outside capture; call forward_device_tokens once before capturing it "
            "(that call runs every bucket's GEMMs once, which a capture cannot)");
      }
    }
    // The bodies are captured on streams of their own, alive only for the capture: the caller's
    // stream is capturing the parent graph, and the executor's side stream may be part of that
    // capture too (an earlier forward in it). No stream beyond the rank's usual ones stays alive
    // while collectives spin (docs/p2p.md: streams beyond the GPU's queues share one).
    const CaptureStream body_stream, body_side_stream;
    std::vector<cuda::TokenSwitchBucket> switch_buckets;
    for (const DeviceTokenBucket& bucket : buckets)
      switch_buckets.push_back({bucket.max_tokens, bucket.tier.has_value()});
    cuda::capture_token_switch(
        stream, body_stream.get(), tokens_device, routed.rows, switch_buckets, token_status_,
        [&](std::size_t i, cudaStream_t body) {
          const std::int64_t rows = buckets[i].max_tokens;
          run_tier(*buckets[i].tier, first_rows(routed, rows), first_rows(shared, rows),
                   first_rows(out, rows), body, body_side_stream.get(), tokens_device);
        });
  }

  std::optional<Failure> take_device_tokens_failure() override {
    const std::int32_t code = token_status_->code;
    if (code == cuda::kTokenSwitchOk) return std::nullopt;
    const Failure failure{code == cuda::kTokenSwitchOutOfRange, token_status_->tokens};
    token_status_->code = cuda::kTokenSwitchOk;
    return failure;
  }

 private:
  std::int64_t stripe_width() const { return dims_.d_model / comm_.size(); }
  std::size_t bytes(std::int64_t elements) const {
    return static_cast<std::size_t>(elements) * esize_;
  }
  const void* w_up_rows(std::int64_t first_row) const {
    return w_up_.at(bytes(first_row * dims_.d_latent));
  }
  static void* offset(void* base, std::size_t byte_offset) {
    return static_cast<std::byte*>(base) + byte_offset;
  }
  static const void* offset(const void* base, std::size_t byte_offset) {
    return static_cast<const std::byte*>(base) + byte_offset;
  }
  template <typename View>
  static View first_rows(View view, std::int64_t rows) {
    view.rows = rows;
    return view;
  }

  void check_capturable() const {
    LMOE_CHECK(fixed_capacity_,
               "capturing a forward in a CUDA graph needs TailOptions::max_tokens > 0 "
               "(workspaces allocated once, at construction)");
    LMOE_CHECK(comm_.graph_capturable(),
               "the '" + std::string(comm_.backend_name()) +
                   "' communicator synchronizes on the host and cannot be captured in a "
                   "CUDA graph; use p2p or nccl");
  }

  // `side` is the overlap tier's second stream: the executor's own, or inside a conditional body's
  // capture one that takes part in no other capture. tokens_device: T for the fused kernel to read.
  void run_tier(TailTier tier, ConstMatrixView routed, MatrixView shared, MatrixView out,
                cudaStream_t stream, cudaStream_t side, const std::int32_t* tokens_device) {
    switch (tier) {
      case TailTier::overlap: return run_overlap(routed, shared, out, stream, side);
      case TailTier::column: return run_column(routed, shared, out, stream);
      case TailTier::token: return run_token(routed, shared, out, stream, side);
      case TailTier::fused: return run_fused(routed, shared, out, stream, tokens_device);
    }
  }

  // Workspaces for up to `tokens` rows. Without max_tokens they grow on demand, which waits for the
  // stream's earlier work (the old buffers may still be in use); with it they never move.
  void reserve(std::int64_t tokens, cudaStream_t stream) {
    if (tokens <= capacity_) return;
    LMOE_CHECK(!fixed_capacity_, "T=" + std::to_string(tokens) + " exceeds max_tokens=" +
                                     std::to_string(capacity_) + " set at construction");
    LMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    LMOE_CUDA_CHECK(cudaStreamSynchronize(side_stream_));
    allocate_workspaces((tokens + 63) / 64 * 64);
  }

  void allocate_workspaces(std::int64_t rows) {
    latent_ = DeviceBuffer(bytes(rows * dims_.d_latent));
    normed_ = DeviceBuffer(bytes(rows * dims_.d_latent));
    up_ = DeviceBuffer(bytes(rows * dims_.d_model));
    shared_sum_ = DeviceBuffer(bytes(rows * dims_.d_model));
    capacity_ = rows;
    // The column tier's unfused path (stripe_accumulator).
    const std::int64_t unfused_rows = !epilogue_gemm_ ? rows
                                      : epilogue_at_every_size_
                                          ? 0
                                          : std::min(rows, unfused_stripe_rows());
    stripe_acc_ =
        DeviceBuffer(static_cast<std::size_t>(unfused_rows * stripe_width()) * sizeof(float));
  }

  // p2p ranks spin on each other: a cuBLASLt GEMM launched for the first time in a shape waits for
  // the GPU's running kernels, i.e. for a peer's round that waits for this rank (lmoe_spin_probe
  // shows it with ranks sharing the GPU, whatever CUDA_MODULE_LOADING says). With one GPU per rank
  // it happens too: one rank's first GEMM of a new shape holds back its part of a collective while
  // its peer spins in it, until the timeout. So the first call
  // of a (tier, T) runs its GEMMs once while no rank is inside a collective: every rank finishes
  // its earlier work and meets the others, runs the GEMMs on its own workspaces (the call itself
  // overwrites them), and meets them again. Every rank takes this path at the same call (same T and
  // tier on every rank), so the barriers match. Captured calls cannot do it: capture after an eager
  // call of the same T.
  void warm_up_gemms(TailTier tier, std::int64_t tokens, cudaStream_t stream) {
    LMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    LMOE_CUDA_CHECK(cudaStreamSynchronize(side_stream_));
    comm_.barrier();
    issue_gemms(tier, tokens, stream);
    LMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    comm_.barrier();
  }

  // The GEMMs of `tier` at T = tokens on this rank's workspaces (which the call overwrites anyway).
  void issue_gemms(TailTier tier, std::int64_t tokens, cudaStream_t stream) {
    const std::int64_t width = stripe_width();
    if (comm_.size() == 1 && tier == TailTier::token) tier = TailTier::overlap;  // one body
    switch (tier) {
      case TailTier::overlap:
        if (comm_.size() == 1) {
          up_project_add(tokens, w_up_.data(), dims_.d_model, shared_sum_.data(), dims_.d_model,
                         up_.data(), dims_.d_model, cuda::EpilogueAdd::round_product_first, stream);
        } else {
          up_project(normed_.data(), tokens, w_up_.data(), dims_.d_model, up_.data(), dims_.d_model,
                     dtype_, stream);
        }
        break;
      case TailTier::column:
        up_project_add(tokens, w_up_rows(comm_.rank() * width), width, up_.data(), dims_.d_model,
                       up_.data(), dims_.d_model, cuda::EpilogueAdd::round_once, stream);
        break;
      case TailTier::token: {
        // Every chunk's row count (chunks of T differ by one row at most: one or two shapes).
        for (const TokenChunk& chunk : token_chunks(tokens)) {
          const std::int64_t rows = chunk.split.rows(comm_.rank());
          up_project_add(rows, w_up_.data(), dims_.d_model, shared_sum_.data(), dims_.d_model,
                         up_.data(), dims_.d_model, cuda::EpilogueAdd::round_product_first, stream);
        }
        break;
      }
      case TailTier::fused: break;
    }
  }

  // Where round(Σ_r x_r) of `count` elements is: all-reduced into `dst`, or with one rank x itself
  // (a sum of one term is exact, so the contract needs no copy and no kernel).
  const void* reduced(const void* x, void* dst, std::int64_t count, cudaStream_t stream) {
    if (comm_.size() == 1) return x;
    comm_.all_reduce(x, dst, static_cast<std::size_t>(count), dtype_, stream);
    return dst;
  }

  // normed_ [T, l] = round(rmsnorm(round(Σ_r routed_r))): the latent all-reduce and norm.
  void all_reduce_and_norm(ConstMatrixView routed, cudaStream_t stream) {
    const std::int64_t tokens = routed.rows;
    norm(reduced(routed.data, latent_.data(), tokens * dims_.d_latent, stream), tokens, stream);
  }

  // normed_ [rows, l] = round(rmsnorm(latent rows)); without the latent norm, the latent rows
  // themselves (already rounded: N = round(Σ_r routed_r)).
  void norm(const void* latent, std::int64_t rows, cudaStream_t stream) {
    if (!latent_norm_) {
      if (rows > 0) {
        LMOE_CUDA_CHECK(cudaMemcpyAsync(normed_.data(), latent, bytes(rows * dims_.d_latent),
                                        cudaMemcpyDeviceToDevice, stream));
      }
      return;
    }
    check(cuda::launch_rms_norm(latent, static_cast<const float*>(gamma_.data()), normed_.data(),
                                rows, dims_.d_latent, eps_, dtype_, stream),
          "launch_rms_norm");
  }

  // dst [rows, width] (row stride ld) = N · w[width rows]ᵀ, in the storage dtype or (f32)
  // unrounded.
  void up_project(const void* normed, std::int64_t rows, const void* w, std::int64_t width,
                  void* dst, std::int64_t ld, DType out_dtype, cudaStream_t stream) {
    gemm_->run(normed, w, dims_.d_latent, dst, ld, rows, width, dims_.d_latent, dtype_, out_dtype,
               stream);
  }

  // d [rows, width] (row stride ldd) = add(N · w[width rows]ᵀ, c [rows, width] (row stride ldc)),
  // N = normed_'s first rows, with the contract's add: in the GEMM's epilogue, one pass over c and
  // d (cuda/gemm/epilogue_gemm.hpp), where this GPU and these views allow it. Otherwise cuBLASLt
  // writes the product and a kernel adds it: round_product_first through d itself (c may be d, or
  // any buffer but d), round_once through the fp32 stripe accumulator into c in place, then copied
  // to d.
  void up_project_add(std::int64_t rows, const void* w, std::int64_t width, const void* c,
                      std::int64_t ldc, void* d, std::int64_t ldd, cuda::EpilogueAdd add,
                      cudaStream_t stream) {
    if (rows == 0) return;
    const cuda::EpilogueGemmArgs args{.a = normed_.data(),
                                      .w = w,
                                      .ldw = dims_.d_latent,
                                      .c = c,
                                      .ldc = ldc,
                                      .d = d,
                                      .ldd = ldd,
                                      .m = rows,
                                      .n = width,
                                      .k = dims_.d_latent,
                                      .dtype = dtype_,
                                      .add = add};
    if (epilogue_gemm_ && (epilogue_at_every_size_ || fills_the_gpu(rows, width)) &&
        !cuda::epilogue_gemm_limit(args)) {
      cuda::run_epilogue_gemm(args, stream);
      return;
    }
    if (add == cuda::EpilogueAdd::round_product_first) {
      LMOE_CHECK(ldc == width && ldd == width,
                 "up_project_add: the unfused round(U) + C takes contiguous rows");
      void* product = c == d ? up_.data() : d;  // up_ holds [rows, d_model] ≥ rows · width
      up_project(normed_.data(), rows, w, width, product, width, dtype_, stream);
      check(cuda::launch_add(product, c, d, rows * width, dtype_, stream), "launch_add");
      return;
    }
    up_project(normed_.data(), rows, w, width, stripe_accumulator(rows, stream), width, DType::f32,
               stream);
    check(cuda::launch_accumulate_stripe(const_cast<void*>(c), ldc,
                                         static_cast<const float*>(stripe_acc_.data()), rows, width,
                                         dtype_, stream),
          "launch_accumulate_stripe");
    if (d != c) {
      LMOE_CUDA_CHECK(cudaMemcpy2DAsync(d, bytes(ldd), c, bytes(ldc), bytes(width),
                                        static_cast<std::size_t>(rows), cudaMemcpyDeviceToDevice,
                                        stream));
    }
  }

  // Whether the epilogue GEMM over [rows, width] launches enough CTAs (of its smallest tile, 64 ×
  // 128) to be worth it: below that cuBLASLt, which splits K, wins (the tp-8 stripe at T ≤ 128
  // measured 1.3–1.7× slower with the epilogue GEMM, docs/perf.md). Only narrow stripes fall below.
  static constexpr std::int64_t kEpilogueMinCtas = 32;
  static bool fills_the_gpu(std::int64_t rows, std::int64_t width) {
    return ((rows + 63) / 64) * ((width + 127) / 128) >= kEpilogueMinCtas;
  }
  // The most rows for which a stripe of this rank's width takes the unfused path by size.
  std::int64_t unfused_stripe_rows() const {
    const std::int64_t column_tiles = (stripe_width() + 127) / 128;
    return 64 * ((kEpilogueMinCtas - 1) / column_tiles);
  }

  // The fp32 [rows, s] accumulator of column's unfused path: sized at allocation for the rows that
  // take it by size (all of them without the epilogue GEMM), and otherwise allocated when a call
  // needs it (views TMA cannot take), which cannot happen inside a capture.
  float* stripe_accumulator(std::int64_t rows, cudaStream_t stream) {
    const std::size_t need = static_cast<std::size_t>(rows * stripe_width()) * sizeof(float);
    if (stripe_acc_.bytes() < need) {
      LMOE_CHECK(!capturing(stream),
                 "the column tier's unfused path needs its fp32 accumulator, which is allocated "
                 "on first use and cannot be inside a CUDA graph capture: run the same T once "
                 "before capturing it (or align the views to 16 bytes for the epilogue GEMM)");
      LMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
      stripe_acc_ =
          DeviceBuffer(static_cast<std::size_t>(capacity_ * stripe_width()) * sizeof(float));
    }
    return static_cast<float*>(stripe_acc_.data());
  }

  // overlap: Y = round(round(N · w_upᵀ) + round(Σ shared_r)), full width on every rank. The shared
  // all-reduce runs on the side stream while the main stream does the norm and GEMM. It starts only
  // after the latent all-reduce has finished: a communicator runs one collective at a time (the P2P
  // workspace holds one round in flight; NCCL serializes a communicator's operations).
  // With one rank there is nothing to overlap: the norm, then the GEMM adding `shared` in its
  // epilogue into `out`.
  void run_overlap(ConstMatrixView routed, MatrixView shared, MatrixView out, cudaStream_t stream,
                   cudaStream_t side) {
    const std::int64_t tokens = routed.rows;
    if (comm_.size() == 1) {
      norm(routed.data, tokens, stream);
      up_project_add(tokens, w_up_.data(), dims_.d_model, shared.data, dims_.d_model, out.data,
                     dims_.d_model, cuda::EpilogueAdd::round_product_first, stream);
      return;
    }
    const void* latent = reduced(routed.data, latent_.data(), tokens * dims_.d_latent, stream);
    LMOE_CUDA_CHECK(cudaEventRecord(fork_, stream));
    LMOE_CUDA_CHECK(cudaStreamWaitEvent(side, fork_, 0));
    const void* shared_sum = reduced(shared.data, shared_sum_.data(), tokens * dims_.d_model, side);
    norm(latent, tokens, stream);
    up_project(normed_.data(), tokens, w_up_.data(), dims_.d_model, up_.data(), dims_.d_model,
               dtype_, stream);
    LMOE_CUDA_CHECK(cudaEventRecord(join_, side));
    LMOE_CUDA_CHECK(cudaStreamWaitEvent(stream, join_, 0));
    check(
        cuda::launch_add(up_.data(), shared_sum, out.data, tokens * dims_.d_model, dtype_, stream),
        "launch_add");
  }

  // column: N · w_up[stripe]ᵀ is accumulated into this rank's stripe of its own shared partial in
  // place (fp32 accumulator + C, rounded once, in the GEMM's epilogue); the all-reduce sums the
  // ranks and stitches the stripes together. With one rank the stripe is the whole width and the
  // sum is the partial itself: the GEMM reads `shared` and writes `out` (shared stays as it was).
  void run_column(ConstMatrixView routed, MatrixView shared, MatrixView out, cudaStream_t stream) {
    const std::int64_t tokens = routed.rows;
    const std::int64_t width = stripe_width();
    const std::int64_t first = comm_.rank() * width;
    all_reduce_and_norm(routed, stream);
    if (comm_.size() == 1) {
      up_project_add(tokens, w_up_.data(), width, shared.data, dims_.d_model, out.data,
                     dims_.d_model, cuda::EpilogueAdd::round_once, stream);
      return;
    }
    void* stripe = offset(shared.data, bytes(first));
    up_project_add(tokens, w_up_rows(first), width, stripe, dims_.d_model, stripe, dims_.d_model,
                   cuda::EpilogueAdd::round_once, stream);
    comm_.all_reduce(shared.data, out.data, static_cast<std::size_t>(tokens * dims_.d_model),
                     dtype_, stream);
  }

  // token: each rank owns a contiguous block of token rows (sizes differ by at most one), receives
  // the reduced latent and shared rows, normalizes and up-projects only those; rows are
  // all-gathered.
  //
  // Pipelined over C chunks of rows (C = token_chunks(T): LMOE_TOKEN_CHUNKS, else 2 from T = 4096
  // up): each chunk's rows are split over the ranks as a whole T's are, so its reduce-scatters and
  // its all-gather are ordinary ones over a contiguous slice of the rows, and this rank's rows of
  // every chunk sit one after another in its workspaces. The collectives run on the side stream in
  // one order on every rank (a communicator runs one collective at a time):
  //   RS(0) | RS(1) AG(0) | RS(2) AG(1) | … | AG(C−1)      (RS: the latent's and shared's
  //   reduce-scatters)
  // while the main stream normalizes, up-projects and adds chunk c as soon as RS(c) is done: chunk
  // c's GEMM overlaps RS(c+1) and AG(c−1). Rows are computed exactly as without chunks (the
  // contract is per row; only the GEMMs' row counts change).
  struct TokenChunk {
    std::int64_t first_row;   // of T
    std::int64_t mine_first;  // this rank's first row of the chunk, in its own workspaces
    TokenRowSplit split;
  };

  // The chunks of a T (as many as asked for, or by the built-in rule, but every chunk at least one
  // row per rank).
  std::vector<TokenChunk> token_chunks(std::int64_t tokens) const {
    const int tp = comm_.size();
    const std::int64_t count = token_chunk_count(tokens, tp, token_chunks_);
    std::vector<TokenChunk> chunks;
    std::int64_t mine = 0;
    for (std::int64_t c = 0; c < count; ++c) {
      const std::int64_t t0 = c * tokens / count, t1 = (c + 1) * tokens / count;
      TokenChunk chunk{t0, mine, split_token_rows(t1 - t0, tp, dims_)};
      mine += chunk.split.rows(comm_.rank());
      chunks.push_back(std::move(chunk));
    }
    return chunks;
  }

  void run_token(ConstMatrixView routed, MatrixView shared, MatrixView out, cudaStream_t stream,
                 cudaStream_t side) {
    const std::int64_t l = dims_.d_latent, d = dims_.d_model;
    if (comm_.size() == 1) {  // the scatter and gather are the identity: overlap's one-rank body
      run_overlap(routed, shared, out, stream, side);
      return;
    }
    const std::vector<TokenChunk> chunks = token_chunks(routed.rows);
    const int rank = comm_.rank();
    if (chunks.size() == 1) {
      const TokenRowSplit& split = chunks[0].split;
      const std::int64_t my_rows = split.rows(rank);
      comm_.reduce_scatter(routed.data, latent_.data(), split.latent_counts, dtype_, stream);
      comm_.reduce_scatter(shared.data, shared_sum_.data(), split.model_counts, dtype_, stream);
      norm(latent_.data(), my_rows, stream);
      up_project_add(my_rows, w_up_.data(), d, shared_sum_.data(), d, up_.data(), d,
                     cuda::EpilogueAdd::round_product_first, stream);
      comm_.all_gather(up_.data(), out.data, split.model_counts, dtype_, stream);
      return;
    }
    LMOE_CUDA_CHECK(cudaEventRecord(fork_, stream));
    LMOE_CUDA_CHECK(cudaStreamWaitEvent(side, fork_, 0));
    const auto scatter = [&](std::size_t c) {
      const TokenChunk& chunk = chunks[c];
      comm_.reduce_scatter(offset(routed.data, bytes(chunk.first_row * l)),
                           offset(latent_.data(), bytes(chunk.mine_first * l)),
                           chunk.split.latent_counts, dtype_, side);
      comm_.reduce_scatter(offset(shared.data, bytes(chunk.first_row * d)),
                           offset(shared_sum_.data(), bytes(chunk.mine_first * d)),
                           chunk.split.model_counts, dtype_, side);
      LMOE_CUDA_CHECK(cudaEventRecord(scattered_[c], side));
    };
    const auto gather = [&](std::size_t c) {
      const TokenChunk& chunk = chunks[c];
      LMOE_CUDA_CHECK(cudaStreamWaitEvent(side, added_[c], 0));
      comm_.all_gather(offset(up_.data(), bytes(chunk.mine_first * d)),
                       offset(out.data, bytes(chunk.first_row * d)), chunk.split.model_counts,
                       dtype_, side);
    };
    scatter(0);
    for (std::size_t c = 0; c < chunks.size(); ++c) {
      if (c + 1 < chunks.size()) scatter(c + 1);
      const TokenChunk& chunk = chunks[c];
      const std::int64_t rows = chunk.split.rows(rank);
      void* up_rows = offset(up_.data(), bytes(chunk.mine_first * d));
      LMOE_CUDA_CHECK(cudaStreamWaitEvent(stream, scattered_[c], 0));
      // normed_ is reused from row 0: the main stream's next norm follows this GEMM.
      norm(offset(latent_.data(), bytes(chunk.mine_first * l)), rows, stream);
      up_project_add(rows, w_up_.data(), d, offset(shared_sum_.data(), bytes(chunk.mine_first * d)),
                     d, up_rows, d, cuda::EpilogueAdd::round_product_first, stream);
      LMOE_CUDA_CHECK(cudaEventRecord(added_[c], stream));
      gather(c);  // on the side stream after RS(c + 1): it waits for this chunk's rows, RS(c + 1)
                  // does not
    }
    LMOE_CUDA_CHECK(cudaEventRecord(join_, side));
    LMOE_CUDA_CHECK(cudaStreamWaitEvent(stream, join_, 0));
  }

  // fused: one kernel per rank (cuda/fused_tail.cuh); can_implement has declined where it cannot
  // run. With tokens_device the kernel reads T there (≤ the views' rows, which pick its shape).
  void run_fused(ConstMatrixView routed, MatrixView shared, MatrixView out, cudaStream_t stream,
                 const std::int32_t* tokens_device) {
    LMOE_CHECK(fused_ != nullptr,
               "fused cannot run here: " + fused_unavailable_.value_or("(no reason recorded)"));
    fused_->run(routed.data, shared.data, out.data, routed.rows, stream, tokens_device);
  }

  Communicator& comm_;
  TailDims dims_;
  DType dtype_;
  std::size_t esize_;
  bool latent_norm_;  // false: N is the reduced latent itself (no RMSNorm)
  float eps_;
  int device_ = 0;
  const bool fixed_capacity_;  // max_tokens was given: workspaces never move (capturable)
  DeviceBuffer gamma_;         // [l] fp32
  DeviceBuffer w_up_;          // [d, l] storage dtype
  std::unique_ptr<cuda::CublasLtGemm> gemm_;
  cudaStream_t side_stream_ = nullptr;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  // token, pipelined: chunk c's reduce-scatters done (side stream), its rows added (main stream).
  std::array<cudaEvent_t, kMaxTokenChunks> scattered_{}, added_{};
  int token_chunks_ = 0;       // LMOE_TOKEN_CHUNKS; 0: the built-in rule
  std::int64_t capacity_ = 0;  // rows the workspaces hold
  DeviceBuffer latent_;        // [T, l] reduced latent (rows of this rank for token)
  DeviceBuffer normed_;        // [T, l]
  DeviceBuffer up_;            // [T, d]: round(U)
  DeviceBuffer shared_sum_;    // [T, d] reduced shared
  DeviceBuffer stripe_acc_;    // [T, s] fp32: column's unrounded N · w_up[stripe]ᵀ, unfused only
  bool epilogue_gemm_ = false;  // the add in the up-projection's epilogue (LMOE_EPILOGUE_GEMM)
  bool epilogue_at_every_size_ = false;  // LMOE_EPILOGUE_GEMM=1: also below fills_the_gpu
  std::unique_ptr<cuda::FusedTail> fused_;
  std::optional<std::string> fused_unavailable_;
  bool spinning_peers_ = false;                         // p2p peers, which spin on the device
  std::set<std::pair<TailTier, std::int64_t>> warmed_;  // (tier, T) whose GEMMs have run once
  // forward_device_tokens: the replays' failure record (host-mapped) with the eager read-back of T.
  cuda::MappedHostBuffer token_mapped_;
  cuda::TokenSwitchStatus* token_status_ = nullptr;
  std::int32_t* tokens_read_back_ = nullptr;
};

}  // namespace

std::unique_ptr<TailExecutor> make_cuda_tail_executor(Communicator& comm, TailDims dims,
                                                      DType dtype, bool latent_norm, float eps,
                                                      ConstMatrixView norm_weight,
                                                      ConstMatrixView up_proj_weight,
                                                      std::int64_t max_tokens) {
  return std::make_unique<CudaTailExecutor>(comm, dims, dtype, latent_norm, eps, norm_weight,
                                            up_proj_weight, max_tokens);
}

}  // namespace lmoe

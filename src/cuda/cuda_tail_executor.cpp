// The tiers on a GPU with the CPU executor's dataflow (src/cpu/cpu_tail_executor.cpp): a rank
// computes and writes only its own part, and every exchange goes through the communicator, on the
// caller's stream. The kernels are src/cuda/*.cuh; the GEMM is cuBLASLt.
#include "cuda/cuda_tail_executor.hpp"

#include <cuda_runtime_api.h>

#include <vector>

#include "cuda/cublaslt_gemm.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/device_buffer.hpp"
#include "cuda/launchers.hpp"
#include "lmoe/error.hpp"

namespace lmoe {

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error so later calls start clean
    return 0;
  }
  return count;
}

std::optional<std::string> cuda_tier_limit(TailTier, const TailProblem& problem) {
  const std::int64_t d = problem.dims.d_model, l = problem.dims.d_latent;
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

class CudaTailExecutor final : public TailExecutor {
 public:
  CudaTailExecutor(Communicator& comm, TailDims dims, DType dtype, float eps, ConstMatrixView norm_weight,
                   ConstMatrixView up_proj_weight, std::int64_t max_tokens)
      : comm_(comm), dims_(dims), dtype_(dtype), esize_(dtype_size(dtype)), eps_(eps), fixed_capacity_(max_tokens > 0) {
    if (comm.memory_space() != MemorySpace::device) {
      throw Error("the cuda backend needs a communicator of device buffers (cuda-threads, p2p, nccl), got '" +
                  std::string(comm.backend_name()) + "'");
    }
    LMOE_CUDA_CHECK(cudaGetDevice(&device_));
    const std::int64_t d = dims_.d_model, l = dims_.d_latent;

    // gamma is kept in fp32: the norm multiplies by the exact fp32 value of the stored weight.
    std::vector<float> gamma(static_cast<std::size_t>(l));
    for (std::int64_t j = 0; j < l; ++j) gamma[j] = load_as_float(norm_weight.data, static_cast<std::size_t>(j), dtype);
    gamma_ = DeviceBuffer(gamma.size() * sizeof(float));
    LMOE_CUDA_CHECK(cudaMemcpy(gamma_.data(), gamma.data(), gamma_.bytes(), cudaMemcpyHostToDevice));

    w_up_ = DeviceBuffer(static_cast<std::size_t>(d * l) * esize_);  // [d, l], contiguous
    LMOE_CUDA_CHECK(cudaMemcpy2D(w_up_.data(), static_cast<std::size_t>(l) * esize_, up_proj_weight.data,
                                 static_cast<std::size_t>(up_proj_weight.ld) * esize_,
                                 static_cast<std::size_t>(l) * esize_, static_cast<std::size_t>(d),
                                 cudaMemcpyHostToDevice));

    LMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&side_stream_, cudaStreamNonBlocking));
    LMOE_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
    LMOE_CUDA_CHECK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
    gemm_ = std::make_unique<cuda::CublasLtGemm>();
    if (fixed_capacity_) allocate_workspaces(max_tokens);
  }

  ~CudaTailExecutor() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(side_stream_);
    cudaEventDestroy(join_);
    cudaEventDestroy(fork_);
    cudaStreamDestroy(side_stream_);
  }

  std::string_view backend_name() const override { return "cuda"; }
  MemorySpace memory_space() const override { return MemorySpace::device; }

  std::optional<std::string> can_implement(TailTier tier, const TailProblem& problem) const override {
    return cuda_tier_limit(tier, problem);
  }

  void run(TailTier tier, ConstMatrixView routed, MatrixView shared, MatrixView out,
           StreamHandle stream_handle) override {
    LMOE_CUDA_CHECK(cudaSetDevice(device_));
    const cudaStream_t stream = cuda::stream_or_default(stream_handle);
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    LMOE_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (capture != cudaStreamCaptureStatusNone) {
      LMOE_CHECK(fixed_capacity_, "capturing a forward in a CUDA graph needs TailOptions::max_tokens > 0 "
                                  "(workspaces allocated once, at construction)");
      LMOE_CHECK(comm_.graph_capturable(), "the '" + std::string(comm_.backend_name()) +
                                               "' communicator synchronizes on the host and cannot be captured in a "
                                               "CUDA graph; use p2p or nccl");
    }
    reserve(routed.rows, stream);
    switch (tier) {
      case TailTier::overlap: return run_overlap(routed, shared, out, stream);
      case TailTier::column: return run_column(routed, shared, out, stream);
      case TailTier::token: return run_token(routed, shared, out, stream);
      case TailTier::fused: return run_fused(routed, shared, out, stream);
    }
  }

 private:
  std::int64_t stripe_width() const { return dims_.d_model / comm_.size(); }
  std::size_t bytes(std::int64_t elements) const { return static_cast<std::size_t>(elements) * esize_; }
  const void* w_up_rows(std::int64_t first_row) const { return w_up_.at(bytes(first_row * dims_.d_latent)); }
  static void* offset(void* base, std::size_t byte_offset) { return static_cast<std::byte*>(base) + byte_offset; }

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
    up_ = DeviceBuffer(bytes(2 * rows * dims_.d_model));  // fused keeps two stripes, even at tp = 1
    shared_sum_ = DeviceBuffer(bytes(rows * dims_.d_model));
    stripe_acc_ = DeviceBuffer(static_cast<std::size_t>(rows * stripe_width()) * sizeof(float));
    capacity_ = rows;
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

  // normed_ [rows, l] = round(rmsnorm(latent rows)).
  void norm(const void* latent, std::int64_t rows, cudaStream_t stream) {
    check(cuda::launch_rms_norm(latent, static_cast<const float*>(gamma_.data()), normed_.data(), rows,
                                dims_.d_latent, eps_, dtype_, stream),
          "launch_rms_norm");
  }

  // dst [rows, width] (row stride ld) = N · w[width rows]ᵀ, in the storage dtype or (f32) unrounded.
  void up_project(const void* normed, std::int64_t rows, const void* w, std::int64_t width, void* dst,
                  std::int64_t ld, DType out_dtype, cudaStream_t stream) {
    gemm_->run(normed, w, dims_.d_latent, dst, ld, rows, width, dims_.d_latent, dtype_, out_dtype, stream);
  }

  // overlap: Y = round(round(N · w_upᵀ) + round(Σ shared_r)), full width on every rank. The shared
  // all-reduce runs on the side stream while the main stream does the norm and GEMM. It starts only
  // after the latent all-reduce has finished: a communicator runs one collective at a time (the P2P
  // workspace holds one round in flight; NCCL serializes a communicator's operations).
  void run_overlap(ConstMatrixView routed, MatrixView shared, MatrixView out, cudaStream_t stream) {
    const std::int64_t tokens = routed.rows;
    const void* latent = reduced(routed.data, latent_.data(), tokens * dims_.d_latent, stream);
    LMOE_CUDA_CHECK(cudaEventRecord(fork_, stream));
    LMOE_CUDA_CHECK(cudaStreamWaitEvent(side_stream_, fork_, 0));
    const void* shared_sum = reduced(shared.data, shared_sum_.data(), tokens * dims_.d_model, side_stream_);
    norm(latent, tokens, stream);
    up_project(normed_.data(), tokens, w_up_.data(), dims_.d_model, up_.data(), dims_.d_model, dtype_, stream);
    LMOE_CUDA_CHECK(cudaEventRecord(join_, side_stream_));
    LMOE_CUDA_CHECK(cudaStreamWaitEvent(stream, join_, 0));
    check(cuda::launch_add(up_.data(), shared_sum, out.data, tokens * dims_.d_model, dtype_, stream), "launch_add");
  }

  // column: N · w_up[stripe]ᵀ is accumulated into this rank's stripe of its own shared partial in place
  // (fp32 accumulator + C, rounded once); the all-reduce sums the ranks and stitches the stripes
  // together. The GEMM writes its fp32 accumulator and a small kernel adds it: cuBLASLt's beta = 1
  // epilogue on a bf16/f16 C does not round once (see cublaslt_gemm.hpp).
  void run_column(ConstMatrixView routed, MatrixView shared, MatrixView out, cudaStream_t stream) {
    const std::int64_t tokens = routed.rows;
    const std::int64_t width = stripe_width();
    const std::int64_t first = comm_.rank() * width;
    all_reduce_and_norm(routed, stream);
    up_project(normed_.data(), tokens, w_up_rows(first), width, stripe_acc_.data(), width, DType::f32, stream);
    check(cuda::launch_accumulate_stripe(offset(shared.data, bytes(first)), dims_.d_model,
                                         static_cast<const float*>(stripe_acc_.data()), tokens, width, dtype_, stream),
          "launch_accumulate_stripe");
    if (comm_.size() > 1) {
      comm_.all_reduce(shared.data, out.data, static_cast<std::size_t>(tokens * dims_.d_model), dtype_, stream);
    } else if (out.data != shared.data) {
      LMOE_CUDA_CHECK(cudaMemcpyAsync(out.data, shared.data, bytes(tokens * dims_.d_model), cudaMemcpyDeviceToDevice,
                                      stream));
    }
  }

  // token: each rank owns a contiguous block of token rows (sizes differ by at most one), receives
  // the reduced latent and shared rows, normalizes and up-projects only those; rows are all-gathered.
  void run_token(ConstMatrixView routed, MatrixView shared, MatrixView out, cudaStream_t stream) {
    const std::int64_t tokens = routed.rows;
    const TokenRowSplit split = split_token_rows(tokens, comm_.size(), dims_);
    const std::int64_t my_rows = split.rows(comm_.rank());
    const bool one_rank = comm_.size() == 1;  // the scatter and gather are the identity
    const void* latent = routed.data;
    const void* shared_sum = shared.data;
    if (!one_rank) {
      comm_.reduce_scatter(routed.data, latent_.data(), split.latent_counts, dtype_, stream);
      comm_.reduce_scatter(shared.data, shared_sum_.data(), split.model_counts, dtype_, stream);
      latent = latent_.data();
      shared_sum = shared_sum_.data();
    }
    norm(latent, my_rows, stream);
    up_project(normed_.data(), my_rows, w_up_.data(), dims_.d_model, up_.data(), dims_.d_model, dtype_, stream);
    void* rows_out = one_rank ? out.data : up_.data();
    check(cuda::launch_add(up_.data(), shared_sum, rows_out, my_rows * dims_.d_model, dtype_, stream), "launch_add");
    if (!one_rank) comm_.all_gather(up_.data(), out.data, split.model_counts, dtype_, stream);
  }

  // fused, as an unfused composition of the same pieces (the one-kernel decode path over a P2P
  // workspace is not built yet): latent all-reduce + norm; shared packed by column stripes
  // [tp][T][s] and reduce-scattered; own stripe up-projected and added; stripes all-gathered.
  // With one rank the stripe is the whole width and fused's contract is overlap's: overlap's
  // dataflow, which has no collectives at tp = 1. (A first one-launch kernel for this case, CUDA
  // cores with the normalized rows in shared memory, measured no faster at T = 1 and 4.4× slower at
  // T = 16 than this path on an H200, and was not kept: docs/perf.md.)
  void run_fused(ConstMatrixView routed, MatrixView shared, MatrixView out, cudaStream_t stream) {
    if (comm_.size() == 1) return run_overlap(routed, shared, out, stream);
    const std::int64_t tokens = routed.rows;
    const std::int64_t width = stripe_width();
    const int tp = comm_.size();
    const std::size_t row_bytes = bytes(dims_.d_model), stripe_bytes = bytes(width);
    all_reduce_and_norm(routed, stream);

    void* packed = shared_sum_.data();  // [tp][T][s]
    for (int r = 0; r < tp; ++r) {
      LMOE_CUDA_CHECK(cudaMemcpy2DAsync(offset(packed, bytes(r * tokens * width)), stripe_bytes,
                                        offset(shared.data, bytes(r * width)), row_bytes, stripe_bytes,
                                        static_cast<std::size_t>(tokens), cudaMemcpyDeviceToDevice, stream));
    }
    const std::vector<std::size_t> counts(static_cast<std::size_t>(tp), static_cast<std::size_t>(tokens * width));
    void* stripe = up_.data();                           // [T, s]
    void* stripe_up = offset(up_.data(), bytes(tokens * width));  // [T, s]
    comm_.reduce_scatter(packed, stripe, counts, dtype_, stream);
    up_project(normed_.data(), tokens, w_up_rows(comm_.rank() * width), width, stripe_up, width, dtype_, stream);
    check(cuda::launch_add(stripe_up, stripe, stripe, tokens * width, dtype_, stream), "launch_add");
    comm_.all_gather(stripe, packed, counts, dtype_, stream);
    for (int r = 0; r < tp; ++r) {
      LMOE_CUDA_CHECK(cudaMemcpy2DAsync(offset(out.data, bytes(r * width)), row_bytes,
                                        offset(packed, bytes(r * tokens * width)), stripe_bytes, stripe_bytes,
                                        static_cast<std::size_t>(tokens), cudaMemcpyDeviceToDevice, stream));
    }
  }

  Communicator& comm_;
  TailDims dims_;
  DType dtype_;
  std::size_t esize_;
  float eps_;
  int device_ = 0;
  const bool fixed_capacity_;  // max_tokens was given: workspaces never move (capturable)
  DeviceBuffer gamma_;  // [l] fp32
  DeviceBuffer w_up_;   // [d, l] storage dtype
  std::unique_ptr<cuda::CublasLtGemm> gemm_;
  cudaStream_t side_stream_ = nullptr;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  std::int64_t capacity_ = 0;  // rows the workspaces hold
  DeviceBuffer latent_;        // [T, l] reduced latent (rows of this rank for token)
  DeviceBuffer normed_;        // [T, l]
  DeviceBuffer up_;            // [2T, d]: round(U) in the first [T, d]; fused: two [T, s] stripes
  DeviceBuffer shared_sum_;    // [T, d] reduced shared; fused: the packed [tp][T][s] stripes
  DeviceBuffer stripe_acc_;    // [T, s] fp32: column's unrounded N · w_up[stripe]ᵀ
};

}  // namespace

std::unique_ptr<TailExecutor> make_cuda_tail_executor(Communicator& comm, TailDims dims, DType dtype, float eps,
                                                      ConstMatrixView norm_weight, ConstMatrixView up_proj_weight,
                                                      std::int64_t max_tokens) {
  return std::make_unique<CudaTailExecutor>(comm, dims, dtype, eps, norm_weight, up_proj_weight, max_tokens);
}

}  // namespace lmoe

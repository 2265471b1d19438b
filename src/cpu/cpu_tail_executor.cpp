#include "cpu/cpu_tail_executor.hpp"

#include <cstring>

#include <vector>

#include "core/host_math.hpp"
#include "lmoe/error.hpp"

namespace lmoe {

namespace {

// A contiguous host matrix for intermediates; T rows of `cols` storage-dtype elements.
struct Buffer {
  HostTensor tensor;
  Buffer(DType dtype, std::int64_t rows, std::int64_t cols) : tensor(dtype, {rows, cols}) {}
  MatrixView view() { return tensor.matrix(); }
  ConstMatrixView cview() const { return tensor.matrix(); }
  void* data() { return tensor.data(); }
};

class CpuTailExecutor final : public TailExecutor {
 public:
  CpuTailExecutor(Communicator& comm, TailDims dims, DType dtype, bool latent_norm, float eps,
                  ConstMatrixView norm_weight, ConstMatrixView up_proj_weight)
      : comm_(comm),
        dims_(dims),
        dtype_(dtype),
        latent_norm_(latent_norm),
        eps_(eps),
        gamma_(cpu::to_float(norm_weight)),
        w_up_(cpu::to_float(up_proj_weight)) {}

  std::string_view backend_name() const override { return "cpu"; }
  MemorySpace memory_space() const override { return MemorySpace::host; }

  // The CPU runs every tier the generic checks allow (no workspace or platform limits).
  std::optional<std::string> can_implement(TailTier, const TailProblem&) const override {
    return std::nullopt;
  }

  void run(TailTier tier, ConstMatrixView routed, MatrixView shared, MatrixView out,
           StreamHandle) override {
    switch (tier) {
      case TailTier::overlap: return run_overlap(routed, shared, out);
      case TailTier::column: return run_column(routed, shared, out);
      case TailTier::token: return run_token(routed, shared, out);
      case TailTier::fused: return run_fused(routed, shared, out);
    }
  }

 private:
  std::int64_t stripe_width() const { return dims_.d_model / comm_.size(); }
  const float* w_up_rows(std::int64_t first_row) const {
    return w_up_.data() + first_row * dims_.d_latent;
  }

  // normed [T, l] = round(rmsnorm(round(Σ_r routed_r))): the latent all-reduce and norm.
  Buffer all_reduce_and_norm(ConstMatrixView routed) {
    const std::int64_t tokens = routed.rows;
    Buffer latent(dtype_, tokens, dims_.d_latent);
    comm_.all_reduce(routed.data, latent.data(), static_cast<std::size_t>(tokens * dims_.d_latent),
                     dtype_);
    Buffer normed(dtype_, tokens, dims_.d_latent);
    normalize(latent.cview(), normed.view());
    return normed;
  }

  // overlap: Y = round(round(N · w_upᵀ) + round(Σ shared_r)), full width on every rank. (On a GPU
  // the shared all-reduce runs on a second stream during the GEMM; here it simply follows.)
  void run_overlap(ConstMatrixView routed, MatrixView shared, MatrixView out) {
    const std::int64_t tokens = routed.rows;
    Buffer normed = all_reduce_and_norm(routed);
    Buffer up(dtype_, tokens, dims_.d_model);
    cpu::up_project(normed.cview(), w_up_.data(), dims_.d_model, up.view(), false);
    Buffer shared_sum(dtype_, tokens, dims_.d_model);
    comm_.all_reduce(shared.data, shared_sum.data(),
                     static_cast<std::size_t>(tokens * dims_.d_model), dtype_);
    cpu::add(up.cview(), shared_sum.cview(), out);
  }

  // column: this rank accumulates N · w_up[stripe]ᵀ into its stripe of its own shared partial
  // (unrounded accumulator + C, rounded once), and the final all-reduce both sums the ranks and
  // stitches the stripes together.
  void run_column(ConstMatrixView routed, MatrixView shared, MatrixView out) {
    const std::int64_t tokens = routed.rows;
    const std::int64_t width = stripe_width();
    const std::int64_t first = comm_.rank() * width;
    Buffer normed = all_reduce_and_norm(routed);
    cpu::up_project(normed.cview(), w_up_rows(first), width, shared.col_block(first, width), true);
    comm_.all_reduce(shared.data, out.data, static_cast<std::size_t>(tokens * dims_.d_model),
                     dtype_);
  }

  // token: each rank owns a contiguous block of token rows (sizes differ by at most one); it
  // receives the reduced latent and shared rows, normalizes and up-projects only those, and the
  // finished rows are all-gathered.
  void run_token(ConstMatrixView routed, MatrixView shared, MatrixView out) {
    const std::int64_t tokens = routed.rows;
    const TokenRowSplit split = split_token_rows(tokens, comm_.size(), dims_);
    const std::int64_t my_rows = split.rows(comm_.rank());
    Buffer latent(dtype_, my_rows, dims_.d_latent);
    comm_.reduce_scatter(routed.data, latent.data(), split.latent_counts, dtype_);
    Buffer shared_rows(dtype_, my_rows, dims_.d_model);
    comm_.reduce_scatter(shared.data, shared_rows.data(), split.model_counts, dtype_);
    Buffer normed(dtype_, my_rows, dims_.d_latent);
    normalize(latent.cview(), normed.view());
    Buffer rows(dtype_, my_rows, dims_.d_model);
    cpu::up_project(normed.cview(), w_up_.data(), dims_.d_model, rows.view(), false);
    cpu::add(rows.cview(), shared_rows.cview(), rows.view());
    comm_.all_gather(rows.data(), out.data, split.model_counts, dtype_);
  }

  // fused: one-shot latent all-reduce + norm on every rank; the shared partials are
  // reduce-scattered by column stripes (packed [tp][T][s] here, where a GPU kernel reads its
  // peers' stripes in place); each rank up-projects and adds its stripe; stripes are all-gathered.
  void run_fused(ConstMatrixView routed, MatrixView shared, MatrixView out) {
    const std::int64_t tokens = routed.rows;
    const std::int64_t width = stripe_width();
    const int tp = comm_.size();
    Buffer normed = all_reduce_and_norm(routed);

    Buffer packed(dtype_, tp * tokens, width);  // [tp][T][s]
    for (int r = 0; r < tp; ++r) {
      cpu::copy(as_const(shared).col_block(r * width, width),
                packed.view().row_block(r * tokens, tokens));
    }
    const std::vector<std::size_t> counts(static_cast<std::size_t>(tp),
                                          static_cast<std::size_t>(tokens * width));
    Buffer stripe(dtype_, tokens, width);
    comm_.reduce_scatter(packed.data(), stripe.data(), counts, dtype_);

    Buffer up(dtype_, tokens, width);
    cpu::up_project(normed.cview(), w_up_rows(comm_.rank() * width), width, up.view(), false);
    cpu::add(up.cview(), stripe.cview(), stripe.view());

    comm_.all_gather(stripe.data(), packed.data(), counts, dtype_);
    for (int r = 0; r < tp; ++r) {
      cpu::copy(packed.cview().row_block(r * tokens, tokens), out.col_block(r * width, width));
    }
  }

  // normed = round(rmsnorm(latent)), or the latent itself without the norm.
  void normalize(ConstMatrixView latent, MatrixView normed) const {
    if (latent_norm_) {
      cpu::rms_norm(latent, gamma_, eps_, normed);
      return;
    }
    for (std::int64_t r = 0; r < latent.rows; ++r) {
      std::memcpy(static_cast<std::byte*>(normed.data) +
                      static_cast<std::size_t>(r * normed.ld) * dtype_size(dtype_),
                  static_cast<const std::byte*>(latent.data) +
                      static_cast<std::size_t>(r * latent.ld) * dtype_size(dtype_),
                  static_cast<std::size_t>(latent.cols) * dtype_size(dtype_));
    }
  }

  Communicator& comm_;
  TailDims dims_;
  DType dtype_;
  bool latent_norm_;
  float eps_;
  std::vector<float> gamma_;  // [l]
  std::vector<float> w_up_;   // [d, l], exact fp32 copy of the storage-dtype weight
};

}  // namespace

std::unique_ptr<TailExecutor> make_cpu_tail_executor(Communicator& comm, TailDims dims, DType dtype,
                                                     bool latent_norm, float eps,
                                                     ConstMatrixView norm_weight,
                                                     ConstMatrixView up_proj_weight) {
  return std::make_unique<CpuTailExecutor>(comm, dims, dtype, latent_norm, eps, norm_weight,
                                           up_proj_weight);
}

}  // namespace lmoe

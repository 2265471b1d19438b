// The epilogue GEMM's CUTLASS kernels (epilogue_gemm.hpp): the Hopper TMA warp-specialized
// mainloop from CUTLASS's collective builder, and an epilogue visitor tree that reads C through TMA
// and applies the contract's add to the fp32 accumulator before the one store of D.
// Included by the per-(dtype, add) instantiation files only: compiling it takes minutes.
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/epilogue/thread/activation.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/numeric_types.h>
#include <cute/tensor.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_compute_tma_warpspecialized.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_load_tma_warpspecialized.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "cuda/gemm/epilogue_gemm_launch.hpp"

namespace lmoe::cuda::epilogue_gemm_detail {

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;
constexpr auto kNearest = cutlass::FloatRoundStyle::round_to_nearest;

template <DType dtype>
struct Storage;
template <>
struct Storage<DType::bf16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct Storage<DType::f16> {
  using type = cutlass::half_t;
};

// D = round(acc + C): C converted to fp32 exactly, one fp32 add, one rounding.
template <class E>
using AddOnce = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::plus, E, float, kNearest>,
                                fusion::Sm90AccFetch, fusion::Sm90SrcFetch<E>>;
// D = round(round(acc) + C): the accumulator rounded to the storage dtype first (an identity node
// whose output type is E), then added in fp32 and rounded again.
template <class E>
using RoundedAcc =
    fusion::Sm90EVT<fusion::Sm90Compute<cutlass::epilogue::thread::Identity, E, float, kNearest>,
                    fusion::Sm90AccFetch>;
template <class E>
using AddRounded = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::plus, E, float, kNearest>,
                                   RoundedAcc<E>, fusion::Sm90SrcFetch<E>>;

template <class E, EpilogueAdd add>
using Fusion = std::conditional_t<add == EpilogueAdd::round_once, AddOnce<E>, AddRounded<E>>;

// Tile, cluster and schedules of each EpilogueTile.
template <EpilogueTile tile>
struct TileConfig;
template <>
struct TileConfig<EpilogueTile::m64_n128> {
  using Tile = Shape<_64, _128, _64>;
  using Cluster = Shape<_1, _1, _1>;
  using Mainloop = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized;
};
template <>
struct TileConfig<EpilogueTile::m128_n128> {
  using Tile = Shape<_128, _128, _64>;
  using Cluster = Shape<_1, _1, _1>;
  using Mainloop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
};
template <>
struct TileConfig<EpilogueTile::m128_n256> {
  using Tile = Shape<_128, _256, _64>;
  using Cluster = Shape<_2, _1, _1>;
  using Mainloop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
};

template <DType dtype, EpilogueAdd add, EpilogueTile tile>
struct Kernel {
  using E = typename Storage<dtype>::type;
  using Config = TileConfig<tile>;
  static constexpr int kAlignment = 16 / sizeof(E);  // 16-byte accesses (TMA)

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::Tile,
      typename Config::Cluster, cutlass::epilogue::collective::EpilogueTileAuto, float, float, E,
      cutlass::layout::RowMajor, kAlignment, E, cutlass::layout::RowMajor, kAlignment,
      typename Config::Epilogue, Fusion<E, add>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, E, cutlass::layout::RowMajor, kAlignment,
      E, cutlass::layout::ColumnMajor, kAlignment, float, typename Config::Tile,
      typename Config::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Config::Mainloop>::CollectiveOp;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>,
                                                          CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};

inline std::string status_text(const char* step, cutlass::Status status) {
  return std::string("CUTLASS ") + step + ": " + cutlassGetStatusString(status);
}

}  // namespace lmoe::cuda::epilogue_gemm_detail

namespace lmoe::cuda {

template <DType dtype, EpilogueAdd add, EpilogueTile tile>
std::optional<std::string> launch_epilogue_gemm(const EpilogueGemmArgs& args, int sm_count,
                                                cudaStream_t stream) {
  using namespace epilogue_gemm_detail;
  using K = Kernel<dtype, add, tile>;
  using Gemm = typename K::Gemm;
  using E = typename K::E;
  using GemmKernel = typename K::GemmKernel;

  const int m = static_cast<int>(args.m), n = static_cast<int>(args.n),
            k = static_cast<int>(args.k);
  // Row-major A [m, k] and D, C [m, n]; W [n, k] as the column-major B of a K × N operand. The
  // batch stride is unused (L = 1).
  typename GemmKernel::StrideA stride_a =
      make_stride(static_cast<int64_t>(args.k), _1{}, int64_t{0});
  typename GemmKernel::StrideB stride_b =
      make_stride(static_cast<int64_t>(args.ldw), _1{}, int64_t{0});
  typename GemmKernel::StrideC stride_c =
      make_stride(static_cast<int64_t>(args.ldc), _1{}, int64_t{0});
  typename GemmKernel::StrideD stride_d =
      make_stride(static_cast<int64_t>(args.ldd), _1{}, int64_t{0});

  typename Gemm::Arguments arguments{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {static_cast<const E*>(args.a), stride_a, static_cast<const E*>(args.w), stride_b},
      {{}, static_cast<const E*>(args.c), stride_c, static_cast<E*>(args.d), stride_d},
  };
  arguments.hw_info.sm_count = sm_count;
  cudaGetDevice(&arguments.hw_info.device_id);

  Gemm gemm;
  if (cutlass::Status status = gemm.can_implement(arguments); status != cutlass::Status::kSuccess)
    return status_text("can_implement", status);
  // The persistent data-parallel schedule needs no workspace; refuse rather than allocate.
  if (Gemm::get_workspace_size(arguments) != 0)
    return std::string("CUTLASS asked for a workspace, which this launch does not provide");
  if (cutlass::Status status = gemm.initialize(arguments, nullptr, stream);
      status != cutlass::Status::kSuccess)
    return status_text("initialize", status);
  if (cutlass::Status status = gemm.run(stream); status != cutlass::Status::kSuccess)
    return status_text("run", status);
  return std::nullopt;
}

}  // namespace lmoe::cuda

// One file per (dtype, add) instantiates its three tiles.
#define LMOE_EPILOGUE_GEMM_INSTANTIATE(dtype, add)                                   \
  template std::optional<std::string>                                                \
  lmoe::cuda::launch_epilogue_gemm<dtype, add, lmoe::cuda::EpilogueTile::m64_n128>(  \
      const lmoe::cuda::EpilogueGemmArgs&, int, cudaStream_t);                       \
  template std::optional<std::string>                                                \
  lmoe::cuda::launch_epilogue_gemm<dtype, add, lmoe::cuda::EpilogueTile::m128_n128>( \
      const lmoe::cuda::EpilogueGemmArgs&, int, cudaStream_t);                       \
  template std::optional<std::string>                                                \
  lmoe::cuda::launch_epilogue_gemm<dtype, add, lmoe::cuda::EpilogueTile::m128_n256>( \
      const lmoe::cuda::EpilogueGemmArgs&, int, cudaStream_t)

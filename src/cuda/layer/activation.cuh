// The experts' activations on the device, shared by the activation kernel (layer_kernels.cuh) and
// the grouped GEMM's epilogue (grouped_gemm.cuh), so that both compute the same bits. Explicit _rn
// intrinsics: nvcc may not fuse a product and a sum into an FMA the CPU does not have; exp and tanh
// are CUDA's (within 2 ulp of the C library's), the only difference the contract allows
// (docs/numerics.md, "The layer").
#pragma once

#include "lmoe/dims.hpp"

namespace lmoe::cuda {

__device__ inline float sigmoid_rn(float x) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x))); }

// What the activation kernel needs of LayerConfig, by value.
struct ActivationParams {
  int kind;  // ExpertActivation: 0 silu_glu, 1 situ_glu, 2 relu2
  float beta;
  float linear_beta;
};

inline ActivationParams activation_params_of(const LayerConfig& config) {
  ActivationParams params{};
  switch (config.activation) {
    case ExpertActivation::silu_glu: params.kind = 0; break;
    case ExpertActivation::situ_glu: params.kind = 1; break;
    case ExpertActivation::relu2: params.kind = 2; break;
  }
  params.beta = config.activation_beta;
  params.linear_beta = config.activation_linear_beta;
  return params;
}

__device__ inline float activate(const ActivationParams& p, float gate, float up) {
  switch (p.kind) {
    case 0: return __fmul_rn(__fmul_rn(gate, sigmoid_rn(gate)), up);
    case 1: {
      const float gated =
          __fmul_rn(__fmul_rn(p.beta, tanhf(__fdiv_rn(gate, p.beta))), sigmoid_rn(gate));
      return __fmul_rn(gated, __fmul_rn(p.linear_beta, tanhf(__fdiv_rn(up, p.linear_beta))));
    }
    default: {
      // std::max(up, 0.0f): keeps −0 and NaN, as the CPU does (fmaxf would not).
      const float positive = up < 0.0f ? 0.0f : up;
      return __fmul_rn(positive, positive);
    }
  }
}

}  // namespace lmoe::cuda

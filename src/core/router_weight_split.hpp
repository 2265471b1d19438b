// The router's fp32 weight as three bf16 matrices whose sum is the weight, so that a bf16 input's
// router GEMM runs on tensor cores with every product exact: x · W_gᵀ = x · Hᵀ + x · Mᵀ + x · Lᵀ,
// each product of two bf16 values exact in fp32, the sums accumulated in fp32 — the router
// contract's "fp32 GEMM, sums in an unspecified order" (docs/numerics.md, "The layer").
//
// For each w: H = w truncated to bf16 (its fp32 encoding's low 16 bits cleared), M = w − H
// truncated likewise, L = w − H − M; both differences are exact in fp32 (they only drop leading
// bits), M and L carry w's sign (or are 0), and for |w| ≥ 2⁻¹¹⁰ L keeps at most 8 significant
// bits, so H, M and L are bf16 values and H + M + L = w exactly. Below 2⁻¹¹⁰ (far below any
// router weight) L is rounded to bf16: an error under 2⁻¹³³. Truncation, not rounding: rounding the
// largest floats to bf16 would give infinity. Non-finite w go into H whole (M = L = 0). Host code
// only.
#pragma once

#include "lmoe/tensor.hpp"

namespace lmoe {

// weight [E, d] f32 → [3·E, d] bf16: rows 0 … E − 1 are H, E … 2E − 1 are M, 2E … 3E − 1 are L.
// Throws lmoe::Error unless the weight is a 2-D f32 tensor.
HostTensor split_router_weight_bf16(const HostTensor& weight);

}  // namespace lmoe

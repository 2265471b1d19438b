// The RMSNorm's canonical summation order of Σ_j x_j² (docs/numerics.md), one definition for the
// CPU (cpu::rms_norm) and CUDA (cuda/rms_norm.cuh) backends, so that they agree bit for bit:
// element j belongs to lane (j / kRmsNormChunk) mod kRmsNormLanes; each lane adds its own squares
// (each product rounded to fp32) in increasing j, starting from +0; the lane sums s[0 …
// kRmsNormLanes) are then combined by the halving tree s[i] += s[i + h] for i < h, h =
// kRmsNormLanes / 2, …, 2, 1, and the sum is s[0]. A chunk is one 16-byte vector of bf16/f16; the
// lanes are the threads of one 256-thread block. Plain constants: this header is also compiled by
// nvcc.
#pragma once

namespace lmoe {

inline constexpr int kRmsNormChunk = 8;
inline constexpr int kRmsNormLanes = 256;

}  // namespace lmoe

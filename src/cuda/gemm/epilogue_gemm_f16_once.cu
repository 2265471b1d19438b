// The epilogue GEMM's f16 kernels with D = round(acc + C) (epilogue_gemm.hpp).
#include "cuda/gemm/epilogue_gemm.cuh"

LMOE_EPILOGUE_GEMM_INSTANTIATE(lmoe::DType::f16, lmoe::cuda::EpilogueAdd::round_once);

// The epilogue GEMM's bf16 kernels with D = round(round(acc) + C) (epilogue_gemm.hpp).
#include "cuda/gemm/epilogue_gemm.cuh"

LMOE_EPILOGUE_GEMM_INSTANTIATE(lmoe::DType::bf16, lmoe::cuda::EpilogueAdd::round_product_first);

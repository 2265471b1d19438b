#include <algorithm>
#include <cstring>

#include "cuda/runtime/dtype.cuh"
#include "tools/bench_values.hpp"
#include "tools/cuda/replay_soak.hpp"

namespace lmoe::cuda {

namespace {

constexpr int kThreads = 256;

// Not timed, never spinning: a grid that covers `count` quickly is enough.
int blocks_for(std::int64_t count) {
  return static_cast<int>(std::clamp<std::int64_t>((count + kThreads - 1) / kThreads, 1, 1024));
}

// Calls f with a value of the storage type of `dtype` (its type picks the kernels' instances).
template <typename F>
cudaError_t with_storage(DType dtype, F&& f) {
  switch (dtype) {
    case DType::f32: return f(float{});
    case DType::f16: return f(__half{});
    case DType::bf16: return f(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

// The bits of a stored value widened to fp32, for comparisons that tell −0 from +0.
template <typename T>
__device__ unsigned widened_bits(T value) {
  return __float_as_uint(Storage<T>::load(value));
}

// Whether every byte of `value` is the poison 0xff (a row no call may write).
template <typename T>
__device__ bool is_poison(T value) {
  unsigned char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));
  for (unsigned char b : bytes) {
    if (b != 0xff) return false;
  }
  return true;
}

__global__ void advance_replay_kernel(std::uint64_t* replay) { *replay += 1; }

__global__ void pick_replay_tokens_kernel(std::int32_t* tokens, std::int32_t most,
                                          std::uint64_t seed, const std::uint64_t* replay) {
  *tokens = bench::replay_tokens(seed, *replay, most);
}

template <typename T>
__global__ void fill_replay_collective_kernel(T* dst, std::int64_t count, std::uint64_t seed,
                                              int rank, const std::uint64_t* replay) {
  const std::uint64_t stream =
      bench::collective_input_seed(bench::replay_seed(seed, *replay), rank);
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = Storage<T>::store(bench::collective_value(stream, static_cast<std::uint64_t>(i)));
  }
}

template <typename T>
__global__ void count_wrong_sums_kernel(const T* out, std::int64_t count, std::uint64_t seed,
                                        int ranks, const std::uint64_t* replay,
                                        unsigned long long* wrong) {
  const std::uint64_t run = bench::replay_seed(seed, *replay);
  unsigned long long wrong_here = 0;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    float expected = 0.0f;
    for (int r = 0; r < ranks; ++r) {
      const float value = bench::collective_value(bench::collective_input_seed(run, r),
                                                  static_cast<std::uint64_t>(i));
      expected = r == 0 ? value : expected + value;
    }
    wrong_here += widened_bits(out[i]) != __float_as_uint(expected);
  }
  if (wrong_here) atomicAdd(wrong, wrong_here);
}

template <typename T>
__global__ void fill_replay_exact_tail_kernel(T* routed, T* shared, std::int64_t rows,
                                              std::int64_t l, std::int64_t d, std::uint64_t seed,
                                              int rank, int tp, const std::uint64_t* replay) {
  const std::uint64_t run = bench::replay_seed(seed, *replay);
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (std::int64_t i = first; i < rows * l; i += stride)
    routed[i] = Storage<T>::store(static_cast<float>(bench::exact_latent_part(run, tp, rank, i)));
  for (std::int64_t i = first; i < rows * d; i += stride)
    shared[i] = Storage<T>::store(static_cast<float>(bench::exact_shared_part(run, rank, i)));
}

// One thread per output element: the contract's result of the exact inputs, where every sum is
// exact (|U| <= l · 4 · 3 < 2^24), so its order does not matter and only the two roundings of the
// contract remain.
template <typename T>
__global__ void count_wrong_exact_tail_kernel(const T* out, const std::int32_t* tokens,
                                              std::int64_t rows, std::int64_t l, std::int64_t d,
                                              const T* w_up, const float* gamma, std::uint64_t seed,
                                              int tp, const std::uint64_t* replay,
                                              unsigned long long* wrong) {
  const std::uint64_t run = bench::replay_seed(seed, *replay);
  const std::int64_t written_rows = *tokens;
  unsigned long long wrong_here = 0;
  for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       e < rows * d; e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t t = e / d, i = e % d;
    if (t >= written_rows) {
      wrong_here += !is_poison(out[e]);
      continue;
    }
    float u = 0.0f;
    for (std::int64_t j = 0; j < l; ++j) {
      const float n = static_cast<float>(bench::exact_latent_sign(run, t * l + j)) * gamma[j];
      u += n * Storage<T>::load(w_up[i * l + j]);
    }
    float shared_sum = 0.0f;
    for (int r = 0; r < tp; ++r) {
      const float part = static_cast<float>(bench::exact_shared_part(run, r, e));
      shared_sum = r == 0 ? part : shared_sum + part;
    }
    const float rounded_u = Storage<T>::load(Storage<T>::store(u));
    const float rounded_shared = Storage<T>::load(Storage<T>::store(shared_sum));
    const T expected = Storage<T>::store(__fadd_rn(rounded_u, rounded_shared));
    wrong_here += widened_bits(out[e]) != widened_bits(expected);
  }
  if (wrong_here) atomicAdd(wrong, wrong_here);
}

}  // namespace

cudaError_t launch_advance_replay(std::uint64_t* replay, cudaStream_t stream) {
  advance_replay_kernel<<<1, 1, 0, stream>>>(replay);
  return cudaGetLastError();
}

cudaError_t launch_fill_replay_collective_values(void* dst, std::int64_t count, DType dtype,
                                                 std::uint64_t seed, int rank,
                                                 const std::uint64_t* replay, cudaStream_t stream) {
  if (count <= 0) return count == 0 ? cudaSuccess : cudaErrorInvalidValue;
  return with_storage(dtype, [&](auto storage) {
    using T = decltype(storage);
    fill_replay_collective_kernel<T><<<blocks_for(count), kThreads, 0, stream>>>(
        static_cast<T*>(dst), count, seed, rank, replay);
    return cudaGetLastError();
  });
}

cudaError_t launch_count_wrong_replay_sums(const void* out, std::int64_t count, DType dtype,
                                           std::uint64_t seed, int ranks,
                                           const std::uint64_t* replay, unsigned long long* wrong,
                                           cudaStream_t stream) {
  if (count <= 0) return count == 0 ? cudaSuccess : cudaErrorInvalidValue;
  return with_storage(dtype, [&](auto storage) {
    using T = decltype(storage);
    count_wrong_sums_kernel<T><<<blocks_for(count), kThreads, 0, stream>>>(
        static_cast<const T*>(out), count, seed, ranks, replay, wrong);
    return cudaGetLastError();
  });
}

cudaError_t launch_pick_replay_tokens(std::int32_t* tokens, std::int32_t most, std::uint64_t seed,
                                      const std::uint64_t* replay, cudaStream_t stream) {
  if (most < 1) return cudaErrorInvalidValue;
  pick_replay_tokens_kernel<<<1, 1, 0, stream>>>(tokens, most, seed, replay);
  return cudaGetLastError();
}

cudaError_t launch_fill_replay_exact_tail(void* routed, void* shared, std::int64_t rows,
                                          TailDims dims, DType dtype, std::uint64_t seed, int rank,
                                          int tp, const std::uint64_t* replay,
                                          cudaStream_t stream) {
  if (rows <= 0) return rows == 0 ? cudaSuccess : cudaErrorInvalidValue;
  return with_storage(dtype, [&](auto storage) {
    using T = decltype(storage);
    fill_replay_exact_tail_kernel<T><<<blocks_for(rows * dims.d_model), kThreads, 0, stream>>>(
        static_cast<T*>(routed), static_cast<T*>(shared), rows, dims.d_latent, dims.d_model, seed,
        rank, tp, replay);
    return cudaGetLastError();
  });
}

cudaError_t launch_count_wrong_replay_exact_tail(const void* out, const std::int32_t* tokens,
                                                 std::int64_t rows, TailDims dims, DType dtype,
                                                 const void* w_up, const float* gamma,
                                                 std::uint64_t seed, int tp,
                                                 const std::uint64_t* replay,
                                                 unsigned long long* wrong, cudaStream_t stream) {
  if (rows <= 0) return rows == 0 ? cudaSuccess : cudaErrorInvalidValue;
  return with_storage(dtype, [&](auto storage) {
    using T = decltype(storage);
    count_wrong_exact_tail_kernel<T><<<blocks_for(rows * dims.d_model), kThreads, 0, stream>>>(
        static_cast<const T*>(out), tokens, rows, dims.d_latent, dims.d_model,
        static_cast<const T*>(w_up), gamma, seed, tp, replay, wrong);
    return cudaGetLastError();
  });
}

}  // namespace lmoe::cuda

// A kernel launch's configuration for cudaLaunchKernelEx / cudaLaunchKernelExC, with the launch
// attributes lmoe's kernels use: programmatic stream serialization (the kernel may start before the
// stream's previous kernel ends, once that kernel's blocks have all called griddepcontrol.
// launch_dependents or left; it calls griddepcontrol.wait before reading anything the previous
// kernel writes) and a cluster size. Host code only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace lmoe::cuda {

class LaunchConfig {
 public:
  LaunchConfig(dim3 grid, dim3 block, std::size_t shared_bytes, cudaStream_t stream) {
    config_.gridDim = grid;
    config_.blockDim = block;
    config_.dynamicSmemBytes = shared_bytes;
    config_.stream = stream;
  }

  LaunchConfig& programmatic(bool allowed = true) {
    if (!allowed) return *this;
    cudaLaunchAttribute& attribute = attributes_[count_++];
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    return *this;
  }

  LaunchConfig& cluster(unsigned blocks) {
    cudaLaunchAttribute& attribute = attributes_[count_++];
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = blocks;
    attribute.val.clusterDim.y = 1;
    attribute.val.clusterDim.z = 1;
    return *this;
  }

  // Valid while this object lives.
  const cudaLaunchConfig_t* get() {
    config_.attrs = attributes_;
    config_.numAttrs = count_;
    return &config_;
  }

 private:
  cudaLaunchConfig_t config_{};
  cudaLaunchAttribute attributes_[2] = {};
  unsigned count_ = 0;
};

}  // namespace lmoe::cuda

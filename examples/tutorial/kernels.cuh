#pragma once
// The kernels that several tutorial steps launch unchanged (docs/tutorial.md). A kernel that is
// part of one step's lesson (step 5's library kernels, step 6's accumulate) stays in that step.
// Each kernel is a grid-stride loop over n elements.

#include <cstddef>
#include <cstdint>

namespace tutorial {

/// p[i] = i % 1000 + batch: a value each step can recompute on the host to check its results.
inline __global__ void fill(std::uint32_t* p, std::size_t n, std::uint32_t batch) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    p[i] = static_cast<std::uint32_t>(i % 1000) + batch;
  }
}

/// out[i] = in[i]^2.
inline __global__ void square(const std::uint32_t* in, std::uint32_t* out, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    out[i] = in[i] * in[i];
  }
}

}  // namespace tutorial

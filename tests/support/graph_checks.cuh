#pragma once

// Helpers for the GPU tests of graphs: waiting for the reaper, overlapping ranges, and a device
// counter that kernels captured into a graph add their mismatches to, at every launch.

#include "gpu_kernels.cuh"
#include "gpu_support.hpp"

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <thread>

namespace streamalloc_test {

/// Polls `done` for up to 10 s: the driver runs user-object destructors asynchronously.
template <class F>
inline bool eventually(F done) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

/// A device counter of mismatched words that captured check kernels add to.
struct mismatch_counter {
  unsigned long long* d = nullptr;
  mismatch_counter() {
    SA_CUDA_REQUIRE(cudaMalloc(&d, sizeof *d));
    SA_CUDA_REQUIRE(cudaMemset(d, 0, sizeof *d));
  }
  ~mismatch_counter() { cudaFree(d); }
  unsigned long long read() const {
    unsigned long long h = ~0ULL;
    SA_CUDA_REQUIRE(cudaMemcpy(&h, d, sizeof h, cudaMemcpyDeviceToHost));
    return h;
  }
};

/// The two counters of a slow_check_fill_kernel (mismatches, words visited), made before it
/// starts: cudaMalloc may synchronize the device.
struct spin_counters {
  unsigned long long* d = nullptr;
  spin_counters() {
    SA_CUDA_REQUIRE(cudaMalloc(&d, 2 * sizeof *d));
    SA_CUDA_REQUIRE(cudaMemset(d, 0, 2 * sizeof *d));
    SA_CUDA_REQUIRE(cudaDeviceSynchronize());
  }
  ~spin_counters() { cudaFree(d); }
  unsigned long long read(int i) const {
    unsigned long long h[2] = {~0ULL, ~0ULL};
    SA_CUDA_REQUIRE(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
    return h[i];
  }
};

inline void fill_on(void* p, std::size_t bytes, std::uint32_t seed, cudaStream_t s) {
  fill_kernel<<<256, 256, 0, s>>>(static_cast<std::uint32_t*>(p), bytes / 4, seed);
}
inline void check_on(const void* p, std::size_t bytes, std::uint32_t seed, cudaStream_t s, const mismatch_counter& c) {
  check_kernel<<<256, 256, 0, s>>>(static_cast<const std::uint32_t*>(p), bytes / 4, seed, c.d);
}

}  // namespace streamalloc_test

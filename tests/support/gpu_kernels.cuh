#pragma once

// Kernels the GPU tests use to write and check memory: every word gets a value derived from
// its index and a seed, so a missed, shifted or stale write shows up as a mismatch.

#include <cuda_runtime.h>

#include <cstddef>
#include <algorithm>
#include <cstdint>

namespace streamalloc_test {

__host__ __device__ inline std::uint32_t pattern(std::size_t i, std::uint32_t seed) {
  std::uint64_t x = (static_cast<std::uint64_t>(i) + 1) * 0x9E3779B97F4A7C15ULL ^ seed;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 29;
  return static_cast<std::uint32_t>(x);
}

__global__ inline void fill_kernel(std::uint32_t* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    p[i] = pattern(i, seed);
  }
}

__global__ inline void check_kernel(const std::uint32_t* p, std::size_t n, std::uint32_t seed,
                                    unsigned long long* mismatches) {
  unsigned long long bad = 0;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    bad += p[i] != pattern(i, seed) ? 1 : 0;
  }
  if (bad != 0) atomicAdd(mismatches, bad);
}

__global__ inline void increment_kernel(std::uint32_t* p, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    p[i] += 1;
  }
}

inline void fill(void* p, std::size_t bytes, std::uint32_t seed, cudaStream_t s = nullptr) {
  fill_kernel<<<1024, 256, 0, s>>>(static_cast<std::uint32_t*>(p), bytes / 4, seed);
}

/// Counts the words of [p, p + bytes) that do not hold `seed`'s pattern; synchronizes.
/// Returns ~0ULL if a CUDA call failed.
inline unsigned long long mismatches(const void* p, std::size_t bytes, std::uint32_t seed) {
  unsigned long long* d = nullptr;
  unsigned long long h = ~0ULL;
  if (cudaMalloc(&d, sizeof *d) != cudaSuccess) return ~0ULL;
  if (cudaMemset(d, 0, sizeof *d) == cudaSuccess) {
    check_kernel<<<1024, 256>>>(static_cast<const std::uint32_t*>(p), bytes / 4, seed, d);
    if (cudaGetLastError() != cudaSuccess || cudaMemcpy(&h, d, sizeof h, cudaMemcpyDeviceToHost) != cudaSuccess) h = ~0ULL;
  }
  cudaFree(d);
  return h;
}

}  // namespace streamalloc_test

namespace streamalloc_test {

/// What slow_fill_kernel spins for to hold a stream: about 0.1 s on a 2 GHz part, long enough to notice.
inline constexpr long long busy_cycles = 200'000'000;

/// Spins for about `cycles` clock cycles, then fills: keeps a stream busy so a test can tell
/// reuse that waited for it from reuse that did not.
__global__ inline void slow_fill_kernel(std::uint32_t* p, std::size_t n, std::uint32_t seed, long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    p[i] = pattern(i, seed);
  }
}

/// Adds the number of words of [p, p + bytes) not holding `seed`'s pattern to *mismatches,
/// in stream order; no synchronization.
inline void check_async(const void* p, std::size_t bytes, std::uint32_t seed, unsigned long long* mismatches,
                        cudaStream_t s) {
  const unsigned blocks = static_cast<unsigned>(std::min<std::size_t>(256, (bytes / 4 + 255) / 256 + 1));
  check_kernel<<<blocks, 256, 0, s>>>(static_cast<const std::uint32_t*>(p), bytes / 4, seed, mismatches);
}
inline void fill_async(void* p, std::size_t bytes, std::uint32_t seed, cudaStream_t s) {
  const unsigned blocks = static_cast<unsigned>(std::min<std::size_t>(256, (bytes / 4 + 255) / 256 + 1));
  fill_kernel<<<blocks, 256, 0, s>>>(static_cast<std::uint32_t*>(p), bytes / 4, seed);
}

/// Counts the words of [p, p + bytes) not holding `seed`'s pattern, checked in the order of
/// stream `s` only (no device-wide synchronization, which would hide ordering bugs): the
/// counter is allocated, checked and read back on `s`. Returns ~0ULL if a CUDA call failed.
inline unsigned long long mismatches_on(const void* p, std::size_t bytes, std::uint32_t seed, cudaStream_t s) {
  unsigned long long* d = nullptr;
  unsigned long long h = ~0ULL;
  if (cudaMallocAsync(reinterpret_cast<void**>(&d), sizeof *d, s) != cudaSuccess) return ~0ULL;
  if (cudaMemsetAsync(d, 0, sizeof *d, s) == cudaSuccess) {
    check_async(p, bytes, seed, d, s);
    if (cudaGetLastError() != cudaSuccess || cudaMemcpyAsync(&h, d, sizeof h, cudaMemcpyDeviceToHost, s) != cudaSuccess ||
        cudaStreamSynchronize(s) != cudaSuccess) {
      h = ~0ULL;
    }
  }
  (void)cudaFreeAsync(d, s);
  return h;
}

}  // namespace streamalloc_test

namespace streamalloc_test {

/// The GPU's global nanosecond timer. Unlike clock64 it is one clock for every SM and does not
/// follow the SM clock rate, so a spin lasts as long on every part and at every boost state.
__device__ inline unsigned long long global_ns() {
  unsigned long long t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/// Holds its stream for about `spin_ns` nanoseconds, then checks that the `n` words at `p` still
/// hold `check_seed`'s pattern and overwrites them with `fill_seed`'s. counters[0] gets the words
/// that did not match, counters[1] the words visited (n once the kernel ran to the end).
///
/// For lifetime tests: memory handed to another stream while this kernel spins shows up here
/// (the other stream's writes came first), or in the other stream's data (this kernel's writes
/// came last); memory unmapped or remapped while it spins makes it fault.
__global__ inline void slow_check_fill_kernel(std::uint32_t* p, std::size_t n, std::uint32_t check_seed,
                                              std::uint32_t fill_seed, unsigned long long spin_ns,
                                              unsigned long long* counters) {
  const unsigned long long start = global_ns();
  while (global_ns() - start < spin_ns) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    __nanosleep(1000);  // leave the issue slots to kernels that do work meanwhile
#endif
  }
  unsigned long long bad = 0, seen = 0;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    bad += p[i] != pattern(i, check_seed) ? 1 : 0;
    p[i] = pattern(i, fill_seed);
    ++seen;
  }
  if (bad != 0) atomicAdd(&counters[0], bad);
  if (seen != 0) atomicAdd(&counters[1], seen);
}

}  // namespace streamalloc_test

#pragma once
// What the examples share: a check that a GPU is there (exit 77 otherwise, which CTest reports
// as skipped), fail-loudly helpers, and a main() wrapper that does both ends.

#include <streamalloc/driver.hpp>

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <exception>

namespace example {

inline constexpr int no_gpu = 77;

/// False (after saying why) when there is no usable GPU with virtual memory management.
inline bool have_gpu() {
  if (!streamalloc::driver_available()) {
    std::printf("no usable GPU, nothing to run (exit %d).\n  reason: %s\n", no_gpu,
                streamalloc::driver_problem().c_str());
    return false;
  }
  streamalloc::require_virtual_memory(0);
  return true;
}

/// Exits with a message when `ok` is false: examples double as tests.
inline void expect(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "FAILED: %s\n", what);
    std::exit(1);
  }
}

/// Exits with a message when a CUDA runtime call failed: a program that ignores errors teaches
/// ignoring them.
inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "FAILED: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

/// The body of main(): exit 77 without a GPU, else `run()`'s result, or 1 with a message if it
/// throws (streamalloc reports failures as exceptions). `int main() { return example::main_of(run); }`
template <typename F>
int main_of(F run) {
  if (!have_gpu()) return no_gpu;
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAILED: %s\n", e.what());
    return 1;
  }
}

}  // namespace example

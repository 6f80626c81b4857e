#pragma once

// Helpers for GPU tests: checked runtime calls and the child-process registry. Kernels live in
// gpu_kernels.cuh, which only .cu files include.

#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

// Every GPU test file is compiled into one translation unit (tests/CMakeLists.txt): what they
// share is defined here once, and a name at file scope, unnamed namespace or not, must not be
// used by two of them.
namespace streamalloc_test {

inline constexpr int skip_code = 77;
inline constexpr std::size_t MiB = std::size_t{1} << 20;

inline bool overlaps(const void* a, std::size_t an, const void* b, std::size_t bn) {
  const auto x = reinterpret_cast<std::uintptr_t>(a), y = reinterpret_cast<std::uintptr_t>(b);
  return x < y + bn && y < x + an;
}

/// REQUIREs that a runtime call succeeded, naming it and the error.
#define SA_CUDA_REQUIRE(call)                                                                      \
  do {                                                                                             \
    cudaError_t sa_err_ = (call);                                                                  \
    INFO(#call << " -> " << std::string(cudaGetErrorName(sa_err_)) << ": "                      \
             << std::string(cudaGetErrorString(sa_err_)));                                          \
    REQUIRE(sa_err_ == cudaSuccess);                                                               \
  } while (0)

using child_main = int (*)(int argc, char** argv);
std::map<std::string, child_main>& children();
extern const char* self_path;

/// Registers `fn` as `<binary> --child name ...`, at static initialization. All GPU test files
/// share one binary, so a name registered twice would start the wrong child: it stops the binary.
struct register_child {
  register_child(const char* name, child_main fn) {
    if (!children().emplace(name, fn).second) {
      std::fprintf(stderr, "two child entry points are named %s\n", name);
      std::abort();
    }
  }
};

}  // namespace streamalloc_test

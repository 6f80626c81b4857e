#pragma once

// Helpers for GPU tests: checked runtime calls and the child-process registry. Kernels live in
// gpu_kernels.cuh, which only .cu files include.

#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <map>
#include <string>

namespace streamalloc_test {

inline constexpr int skip_code = 77;

/// REQUIREs that a runtime call succeeded, naming it and the error.
#define SA_CUDA_REQUIRE(call)                                                                      \
  do {                                                                                             \
    cudaError_t sa_err_ = (call);                                                                  \
    INFO(#call << " -> " << cudaGetErrorName(sa_err_) << ": " << cudaGetErrorString(sa_err_));     \
    REQUIRE(sa_err_ == cudaSuccess);                                                               \
  } while (0)

using child_main = int (*)(int argc, char** argv);
std::map<std::string, child_main>& children();
extern const char* self_path;

/// Registers `fn` as `<binary> --child name ...`, at static initialization.
struct register_child {
  register_child(const char* name, child_main fn) { children()[name] = fn; }
};

}  // namespace streamalloc_test

#pragma once

// Compiler and platform checks shared by every streamalloc header.

#if __cplusplus < 202002L
#error "streamalloc needs C++20 (-std=c++20; with nvcc, -std=c++20 as well)"
#endif

#if !defined(__linux__)
// The VMM layer exports physical memory as POSIX file descriptors and loads libcuda.so.1 with
// dlopen; other systems need another loader and handle type, which nobody has written yet.
#error "streamalloc supports Linux only for now"
#endif

#include <cuda.h>

#if CUDA_VERSION < 12000
#error "streamalloc needs the headers of CUDA 12.0 or newer"
#endif

#if defined(__GNUC__) || defined(__clang__)
#define STREAMALLOC_COLD __attribute__((cold, noinline))
#else
#define STREAMALLOC_COLD
#endif

namespace streamalloc::detail {
/// False, but only once a template is instantiated: a static_assert on it fires only for the
/// misuse it explains (deleted-with-a-message members).
template <class...>
inline constexpr bool dependent_false_v = false;
}  // namespace streamalloc::detail

#pragma once
// What the examples share: a check that a GPU is there (exit 77 otherwise, which CTest reports
// as skipped) and a fail-loudly helper.

#include <streamalloc/driver.hpp>

#include <cstdio>
#include <cstdlib>

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

}  // namespace example

// main() of every GPU test binary.
//
// Without a usable GPU it prints why and exits 77, which CTest reports as skipped: a CI log
// then says "skipped", never "passed", for work that did not run. With STREAMALLOC_REQUIRE_GPU
// set (scripts/gpu-check.sh sets it) a missing GPU is a failure instead.
//
// `<binary> --child <name> args...` runs a registered child entry point instead of the tests:
// tests that need a second process (IPC) start their own binary that way.

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <streamalloc/driver.hpp>

#include "gpu_support.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace streamalloc_test {
std::map<std::string, child_main>& children() {
  static std::map<std::string, child_main> registry;
  return registry;
}
const char* self_path = nullptr;
}  // namespace streamalloc_test

int main(int argc, char** argv) {
  streamalloc_test::self_path = argv[0];
  if (argc >= 3 && std::strcmp(argv[1], "--child") == 0) {
    auto& registry = streamalloc_test::children();
    auto it = registry.find(argv[2]);
    if (it == registry.end()) {
      std::fprintf(stderr, "no child entry point named %s\n", argv[2]);
      return 2;
    }
    return it->second(argc - 3, argv + 3);
  }

  std::string why;
  if (!streamalloc::driver_available()) {
    why = streamalloc::driver_problem();
  } else if (streamalloc::device_count() == 0) {
    why = "the driver reports no CUDA device";
  }
  if (!why.empty()) {
    if (const char* required = std::getenv("STREAMALLOC_REQUIRE_GPU"); required && *required) {
      std::fprintf(stderr, "FAILED: STREAMALLOC_REQUIRE_GPU is set but no GPU can be used: %s\n",
                   why.c_str());
      return 1;
    }
    std::printf("SKIPPED: no usable GPU: %s\n", why.c_str());
    return streamalloc_test::skip_code;
  }

  doctest::Context context(argc, argv);
  return context.run();
}

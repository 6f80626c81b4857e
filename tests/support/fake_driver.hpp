#pragma once

// Reads the fake driver's counters (tests/fake_driver/fake_libcuda.cpp) from a test that runs
// with STREAMALLOC_LIBCUDA pointing at it.

#include <streamalloc/detail/driver/driver_loader.hpp>

#include <doctest/doctest.h>

#include <dlfcn.h>

#include <cstddef>
#include <cstdlib>

namespace streamalloc_test {

struct fake_counts {
  int reservations;
  int handles;
  int physicals;
  int mappings;
  std::size_t used_device0;
  int streams;
  int events;
};

inline void* fake_library() {
  (void)streamalloc::detail::driver();  // loads it, if nothing has yet
  const char* path = std::getenv("STREAMALLOC_LIBCUDA");
  REQUIRE(path != nullptr);
  void* lib = ::dlopen(path, RTLD_NOW | RTLD_NOLOAD);  // the copy streamalloc loaded
  REQUIRE(lib != nullptr);
  return lib;
}

inline fake_counts fake_live() {
  void* sym = ::dlsym(fake_library(), "fake_cuda_live");
  REQUIRE(sym != nullptr);
  return reinterpret_cast<fake_counts (*)()>(sym)();
}

inline int fake_lookups(const char* name) {
  void* sym = ::dlsym(fake_library(), "fake_cuda_lookups");
  REQUIRE(sym != nullptr);
  return reinterpret_cast<int (*)(const char*)>(sym)(name);
}

}  // namespace streamalloc_test

#include <streamalloc/streamalloc.hpp>

#include <cstdio>

int main() {
  static_assert(STREAMALLOC_VERSION >= 100);
  if (streamalloc::driver_available()) {
    std::printf("consumer: driver %d, %d device(s)\n", streamalloc::driver_version(),
                streamalloc::device_count());
  } else {
    std::printf("consumer: no driver (%s)\n", streamalloc::driver_problem().c_str());
  }
  return 0;
}

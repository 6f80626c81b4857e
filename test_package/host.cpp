// A host-only program: built by the host compiler alone, runs without a GPU.
#include <streamalloc/streamalloc.hpp>
#include <streamalloc/version.hpp>

#include <cstdio>

int main() {
  std::printf("streamalloc %d.%d.%d\n", STREAMALLOC_VERSION_MAJOR, STREAMALLOC_VERSION_MINOR, STREAMALLOC_VERSION_PATCH);
  if (!streamalloc::driver_available()) {
    std::printf("no usable GPU here (%s): nothing to allocate; the package works\n",
                streamalloc::driver_problem().c_str());
    return 0;
  }
  streamalloc::pool pool;
  streamalloc::stream s(0);
  void* p = pool.allocate(1 << 20, s);
  pool.deallocate(p, s);
  s.synchronize();
  std::printf("allocated and freed 1 MiB on the GPU\n");
  return 0;
}

#include <streamalloc/streamalloc.hpp>

#include <cuda/std/span>  // the toolkit's CCCL headers are on the path

#include <cstdio>

__global__ void touch(int* p) { *p = 1; }

int main() {
  int value = 0;
  cuda::std::span<int> s(&value, 1);
  std::printf("consumer (nvcc): streamalloc %d, driver available: %d, span %zu\n",
              STREAMALLOC_VERSION, streamalloc::driver_available() ? 1 : 0, s.size());
  return 0;
}

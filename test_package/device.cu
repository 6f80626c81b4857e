// A CUDA program: a kernel writes a stream_buffer from a streamalloc pool; without a GPU it says
// so and succeeds (the package, not the machine, is under test).
#include <streamalloc/pool.hpp>
#include <streamalloc/stream_buffer.hpp>

#include <cstdio>
#include <string>
#include <vector>

__global__ void iota(int* p, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] = i;
}

int main() {
  int devices = 0;
  if (!streamalloc::driver_available() || cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    const std::string why =
        streamalloc::driver_available() ? "the CUDA runtime sees no device" : streamalloc::driver_problem();
    std::printf("no usable GPU here (%s): the CUDA program built; skipping its device part\n", why.c_str());
    return 0;
  }
  streamalloc::stream s(0);
  streamalloc::stream_buffer<int> b(1000, s);
  iota<<<4, 256, 0, s.get()>>>(b.data(), 1000);
  std::vector<int> host(1000);
  b.copy_to(host);
  s.synchronize();
  for (int i = 0; i < 1000; ++i) {
    if (host[i] != i) {
      std::printf("element %d is %d\n", i, host[i]);
      return 1;
    }
  }
  std::puts("a kernel wrote a streamalloc buffer: read back correctly");
  return 0;
}

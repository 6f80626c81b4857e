// A buffer that grows while kernels keep appending to it: resize maps more physical memory
// behind the same addresses, so nothing is copied and pointers held by earlier work stay valid.
// Where the addresses behind it are taken, resize copies instead and says so.

#include <streamalloc/streamalloc.hpp>

#include "common.cuh"

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace {
__global__ void append(std::uint64_t* p, std::size_t from, std::size_t to) {
  for (std::size_t i = from + blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < to; i += std::size_t{gridDim.x} * blockDim.x) {
    p[i] = i * 3;
  }
}
}  // namespace

int main() {
  if (!example::have_gpu()) return example::no_gpu;
  streamalloc::pool pool;
  streamalloc::stream s(0);
  streamalloc::stream_buffer<std::uint64_t> log(1 << 17, s, streamalloc::device_resource(pool));  // 1 MiB
  append<<<64, 256, 0, s.get()>>>(log.data(), 0, log.size());
  const auto* first = log.data();
  int in_place = 0, moved = 0;
  const auto t = std::chrono::steady_clock::now();
  while (log.size_bytes() < (std::size_t{2} << 30)) {  // to 2 GiB, doubling
    const std::size_t old = log.size();
    (log.resize(2 * old) == streamalloc::growth::in_place ? in_place : moved) += 1;
    append<<<1024, 256, 0, s.get()>>>(log.data(), old, log.size());
  }
  (void)s.synchronize();
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
  std::printf("1 MiB -> %zu MiB in %d doublings: %d in place, %d moved, %.1f ms, address %s\n", log.size_bytes() >> 20,
              in_place + moved, in_place, moved, ms, log.data() == first ? "unchanged" : "changed");
  example::expect(moved == 0 && log.data() == first, "growth in place");

  // Spot-check the contents across every growth step.
  std::vector<std::uint64_t> host(log.size() / 4096);
  std::size_t wrong = 0;
  for (std::size_t k = 0; k < 4096; ++k) {
    std::uint64_t v = 0;
    const std::size_t i = k * (log.size() / 4096) + k;
    cudaMemcpyAsync(&v, log.data() + i, sizeof v, cudaMemcpyDeviceToHost, s.get());
    cudaStreamSynchronize(s.get());
    wrong += v != i * 3 ? 1 : 0;
  }
  example::expect(wrong == 0, "contents after growth");

  // When the addresses behind are taken, resize copies, and says so.
  streamalloc::stream_buffer<std::uint64_t> a(1 << 10, s, streamalloc::device_resource(pool));
  streamalloc::stream_buffer<std::uint64_t> blocker(1 << 10, s, streamalloc::device_resource(pool));
  const auto how = a.resize(1 << 20);
  std::printf("with a neighbour behind it: %s\n", how == streamalloc::growth::moved ? "moved (copied)" : "in place");
  example::expect(how == streamalloc::growth::moved, "fallback to copy");
  std::printf("growing_buffer OK\n");
  return 0;
}

// std::pmr containers on a host pool, from host code: streamalloc as any pmr-aware code's
// allocator. The same pool's memory then goes to a kernel without a copy (host pools are
// mapped for the device too).

#include <streamalloc/streamalloc.hpp>

#include "common.cuh"

#include <cuda_runtime.h>

#include <cstdio>
#include <map>
#include <memory_resource>
#include <numeric>
#include <string>
#include <vector>

namespace {
__global__ void add_one(int* p, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    p[i] += 1;
  }
}
}  // namespace

int main() {
  if (!example::have_gpu()) return example::no_gpu;
  if (!streamalloc::query_capabilities(0).host_numa_memory) {
    std::printf("device 0 cannot map host NUMA memory: nothing to show\n");
    return example::no_gpu;
  }
  const int node = std::max(0, streamalloc::query_capabilities(0).host_numa_id);
  streamalloc::pool host_pool({.location = streamalloc::memory_location::host_numa(node)});
  streamalloc::pmr_resource mr{streamalloc::host_resource(host_pool)};  // synchronous: for host code

  std::pmr::vector<int> v(&mr);
  for (int i = 0; i < 1'000'000; ++i) v.push_back(i);
  std::pmr::map<std::pmr::string, int> words(&mr);
  for (const char* w : {"stream", "ordered", "allocator", "stream"}) ++words[std::pmr::string(w, &mr)];
  std::printf("pmr vector of %zu ints and a map of %zu words, all in the host pool (%zu allocations live)\n", v.size(),
              words.size(), host_pool.statistics().live_allocations);
  example::expect(host_pool.owns(v.data()) && words.at(std::pmr::string("stream", &mr)) == 2, "pmr containers");

  // The vector's memory is device-accessible too: a kernel updates it in place.
  streamalloc::stream s(0);
  add_one<<<256, 256, 0, s.get()>>>(v.data(), v.size());
  (void)s.synchronize();
  const long long sum = std::accumulate(v.begin(), v.end(), 0LL);
  std::printf("after a kernel added one to each element: sum %lld\n", sum);
  example::expect(sum == 1'000'000LL * 999'999 / 2 + 1'000'000, "kernel on pmr memory");
  std::printf("pmr_host OK\n");
  return 0;
}

// streamalloc's quick start (the README's main demo): allocate on streams, run kernels, hand
// memory from one stream to another with ordering tokens, grow a buffer in place, print the
// pool's statistics, and time allocation against cudaMallocAsync.
//
// Without a usable GPU it says why and exits 77.

#include <streamalloc/streamalloc.hpp>

#include "common.cuh"

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

__global__ void iota(std::uint32_t* p, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    p[i] = static_cast<std::uint32_t>(i);
  }
}
__global__ void square(std::uint32_t* p, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    p[i] = p[i] * p[i];
  }
}

template <class F>
double ns_per(int n, F&& f) {
  const auto t = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) f();
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t).count() / n;
}

}  // namespace

int main() {
  if (!example::have_gpu()) return example::no_gpu;
  std::printf("streamalloc %d.%d.%d on %s (driver %d)\n", STREAMALLOC_VERSION_MAJOR, STREAMALLOC_VERSION_MINOR,
              STREAMALLOC_VERSION_PATCH, streamalloc::device_name(0).c_str(), streamalloc::driver_version());

  streamalloc::pool pool;  // device 0, default properties
  const streamalloc::device_resource mr(pool);
  streamalloc::stream producer(0), consumer(0);

  // 1. Allocate on the producer stream and fill it there: no host synchronization anywhere.
  constexpr std::size_t n = 1 << 24;
  streamalloc::stream_buffer<std::uint32_t> data(n, producer, mr);
  iota<<<256, 256, 0, producer.get()>>>(data.data(), n);

  // 2. Hand it to the consumer: the token proves the consumer runs after the fill.
  //    (data.set_stream(consumer) alone does not compile.)
  data.set_stream(consumer, streamalloc::order_after(consumer, producer));
  square<<<256, 256, 0, consumer.get()>>>(data.data(), n);

  // 3. Grow it in place on the consumer: same address, nothing copied.
  const std::uint32_t* before = data.data();
  const auto how = data.resize(4 * n);
  std::printf("resize 64 MiB -> 256 MiB: %s, address %s\n",
              how == streamalloc::growth::in_place ? "in place" : "moved", data.data() == before ? "unchanged" : "changed");
  example::expect(how == streamalloc::growth::in_place && data.data() == before, "growth in place");

  // 4. Read back the first part and check it.
  std::vector<std::uint32_t> host(n);
  data.copy_to(host);
  (void)consumer.synchronize();
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < n; ++i) wrong += host[i] != static_cast<std::uint32_t>(i) * static_cast<std::uint32_t>(i);
  std::printf("checked %zu squares written across two streams: %zu wrong\n", n, wrong);
  example::expect(wrong == 0, "contents");

  const auto st = pool.statistics();
  std::printf("pool: %zu MiB reserved (high %zu), %zu MiB used by %zu allocation(s), largest free block %zu MiB\n",
              st.reserved_current >> 20, st.reserved_high >> 20, st.used_current >> 20, st.live_allocations,
              st.largest_free_block >> 20);

  // 5. A short timing: allocate + free pairs on one stream, 64 KiB each.
  cudaMemPool_t driver_pool{};
  cudaDeviceGetDefaultMemPool(&driver_pool, 0);
  cudaStream_t raw = producer.get();
  void* q = nullptr;
  for (int i = 0; i < 1000; ++i) {  // warm both
    pool.deallocate(pool.allocate(65536, producer), producer);
    cudaMallocAsync(&q, 65536, raw);
    cudaFreeAsync(q, raw);
  }
  const double ours = ns_per(100000, [&] { pool.deallocate(pool.allocate(65536, producer), producer); });
  const double theirs = ns_per(100000, [&] {
    cudaMallocAsync(&q, 65536, raw);
    cudaFreeAsync(q, raw);
  });
  (void)producer.synchronize();
  std::printf("allocate+free, one stream: streamalloc %.0f ns, cudaMallocAsync %.0f ns (%.1fx)\n", ours, theirs,
              theirs / ours);
  std::printf("demo OK\n");
  return 0;
}

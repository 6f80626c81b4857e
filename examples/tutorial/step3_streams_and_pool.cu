// Tutorial step 3: streamalloc's own streams, events and a pool of the program's own. The
// pipeline of step 2, now with streamalloc::stream and streamalloc::event (so the pool sees
// every ordering the program makes) and a streamalloc::pool whose properties say what to keep
// and which cross-stream reuse to allow. The producer runs at most two batches ahead of the
// consumer (it waits for the consumer's event of two batches back), so memory the consumer
// freed comes back to the producer by following that event. The pipeline runs twice: with a
// release threshold that keeps memory, the second round takes nothing new from the device.
//
// Without a usable GPU it says why and exits 77.

#include <streamalloc/streamalloc.hpp>

#include "../common.cuh"
#include "kernels.cuh"

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

// The kernels the steps share (examples/tutorial/kernels.cuh).
using tutorial::fill;
using tutorial::square;

constexpr std::size_t n = std::size_t{1} << 21;
constexpr std::size_t bytes = n * sizeof(std::uint32_t);
constexpr int batches = 12;

// Batch b of round r fills with i % 1000 + b + 100 r, so each round's results differ.
std::uint32_t seed(int round, int batch) { return static_cast<std::uint32_t>(batch + 100 * round); }

std::size_t wrong_values(const std::vector<std::vector<std::uint32_t>>& results, int round) {
  std::size_t wrong = 0;
  for (int b = 0; b < batches; ++b) {
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint32_t v = static_cast<std::uint32_t>(i % 1000) + seed(round, b);
      wrong += results[b][i] != v * v ? 1 : 0;
    }
  }
  return wrong;
}

int run() {
  // The pool is declared first, so it outlives the streams and everything allocated on them.
  streamalloc::pool pool({
      .location = streamalloc::memory_location::device(0),
      .max_size = std::size_t{1} << 30,      // a budget: at most 1 GiB of device memory
      .release_threshold = SIZE_MAX,         // keep freed memory at synchronizations (the default, 0, keeps none)
      .reuse = {.follow_event_dependencies = true,  // reuse across streams ordered by events
                .opportunistic = false,             // not by timing: the same reuse on every run
                .internal_dependencies = true},     // at the budget, wait on a pending free rather than fail
  });
  streamalloc::stream producer(0), consumer(0);  // non-blocking streams on device 0, owned
  streamalloc::event filled;
  streamalloc::event consumed[2];  // recorded by the consumer after batch b, waited for before b + 2
  std::vector<std::vector<std::uint32_t>> results(batches, std::vector<std::uint32_t>(n));

  auto run_round = [&](int r) {
    for (int b = 0; b < batches; ++b) {
      // Back-pressure: the producer runs at most two batches ahead. Through streamalloc, the
      // wait also tells the pool that the producer is ordered after the consumer's frees of
      // batch b - 2: their memory is the producer's to reuse at once.
      if (b >= 2) producer.wait(consumed[b % 2]);
      auto* in = static_cast<std::uint32_t*>(pool.allocate(bytes, producer));
      fill<<<256, 256, 0, producer.get()>>>(in, n, seed(r, b));
      example::check_cuda(cudaGetLastError(), "fill");

      filled.record(producer);  // cudaEventRecord, and the pool learns of the record
      consumer.wait(filled);    // cudaStreamWaitEvent, and the pool learns of the wait

      auto* out = static_cast<std::uint32_t*>(pool.allocate(bytes, consumer));
      square<<<256, 256, 0, consumer.get()>>>(in, out, n);
      example::check_cuda(cudaGetLastError(), "square");
      example::check_cuda(cudaMemcpyAsync(results[b].data(), out, bytes, cudaMemcpyDeviceToHost, consumer.get()),
                          "cudaMemcpyAsync");
      pool.deallocate(in, consumer);
      pool.deallocate(out, consumer);
      consumed[b % 2].record(consumer);
    }
    (void)consumer.synchronize();  // results complete, and every free known to have run
  };

  run_round(0);
  const streamalloc::pool_statistics first = pool.statistics();
  example::expect(wrong_values(results, 0) == 0, "results of the first round");

  run_round(1);
  const streamalloc::pool_statistics second = pool.statistics();
  example::expect(wrong_values(results, 1) == 0, "results of the second round");

  std::printf("step 3 (streams, events, pool): %d batches of 2 x %zu MiB, twice; reserved high %zu MiB (without "
              "reuse: %zu MiB); the pool grew %zu time(s) in the first round, %zu in the second; %zu MiB kept\n",
              batches, bytes >> 20, second.reserved_high >> 20, 2 * batches * bytes >> 20, first.grows,
              second.grows - first.grows, second.reserved_current >> 20);
  example::expect(second.live_allocations == 0, "every allocation freed");
  example::expect(second.grows == first.grows, "the second round reuses the memory the first one kept");
  example::expect(second.reserved_high < std::size_t{batches} * 2 * bytes, "memory reused across batches");
  std::printf("step 3 OK\n");
  return 0;
}

}  // namespace

int main() { return example::main_of(run); }

// Tutorial step 6: a stream capture into a CUDA graph, with a workspace from the pool. One
// step of work (allocate a workspace, fill it, add it into a running total, free it) is
// captured once and launched many times. The workspace's allocation and free are captured
// too: the pool gives the graph memory of its own at a fixed address, held while the graph or
// an executable made from it lives, as the driver does for captured cudaMallocAsync.
// end_capture and graph_exec let the executable hold that memory itself, so it launches as
// fast as a graph without streamalloc memory.
//
// Without a usable GPU it says why and exits 77.

#include <streamalloc/streamalloc.hpp>

#include "../common.cuh"
#include "kernels.cuh"

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <thread>
#include <vector>

namespace {

using tutorial::fill;  // shared by the steps: examples/tutorial/kernels.cuh

__global__ void accumulate(std::uint32_t* total, const std::uint32_t* part, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    total[i] += part[i];
  }
}

constexpr std::size_t n = std::size_t{1} << 21;
constexpr std::size_t bytes = n * sizeof(std::uint32_t);
constexpr int launches = 20;

int run() {
  streamalloc::pool pool({.release_threshold = SIZE_MAX});
  streamalloc::stream s(0);
  streamalloc::stream_buffer<std::uint32_t> total(n, s, pool);  // an ordinary allocation, outside the graph
  total.fill_zero();

  // Everything enqueued on s from here to end_capture is recorded into a graph, not run.
  example::check_cuda(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  // The pool sees that s is being captured: this allocation belongs to the graph.
  auto* workspace = static_cast<std::uint32_t*>(pool.allocate(bytes, s));
  fill<<<256, 256, 0, s.get()>>>(workspace, n, 1);
  example::check_cuda(cudaGetLastError(), "fill");
  accumulate<<<256, 256, 0, s.get()>>>(total.data(), workspace, n);
  example::check_cuda(cudaGetLastError(), "accumulate");
  pool.deallocate(workspace, s);  // a captured free: each launch ends the workspace's life here
  streamalloc::captured_graph graph = streamalloc::end_capture(s);  // cudaStreamEndCapture, and the graph's memory

  // An executable that holds the graph's memory itself (no user objects to slow its launches).
  streamalloc::graph_exec exec(graph);
  graph.reset();  // optional: exec alone holds the memory now, so graphs launched into s may share it
  const streamalloc::pool_statistics during = pool.statistics();
  for (int i = 0; i < launches; ++i) exec.launch(s);  // each launch runs after the previous one on s

  const std::vector<std::uint32_t> host = total.to_host();  // copies on s (after the launches), synchronizes
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < n; ++i) {
    wrong += host[i] != static_cast<std::uint32_t>(launches) * (static_cast<std::uint32_t>(i % 1000) + 1) ? 1 : 0;
  }
  std::printf("step 6 (graph capture): %d launches of a captured graph with a %zu MiB workspace, %zu wrong values; "
              "graph memory held: %zu MiB in %zu block(s) of %zu graph(s); live allocations outside graphs: %zu\n",
              launches, bytes >> 20, wrong, during.graph_reserved_current >> 20, during.graph_allocations,
              during.graphs, during.live_allocations);
  example::expect(wrong == 0, "results");
  example::expect(pool.owns(workspace), "the workspace is pool memory");
  example::expect(during.live_allocations == 1, "the workspace is the graph's, not a live allocation (only total is)");

  // Destroying the executable does not wait for its launches: the graph's memory goes back to
  // the pool once the last launch has finished, seen by a thread of streamalloc's own. A
  // program need not wait for that; this one does, to show it happen (and so that a leak
  // checker run at exit finds nothing outstanding).
  exec.reset();
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (pool.statistics().graphs != 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const streamalloc::pool_statistics after = pool.statistics();
  std::printf("after the executable is gone: graph memory held %zu MiB, free in the pool %zu MiB\n",
              after.graph_reserved_current >> 20, after.free_clear >> 20);
  example::expect(after.graphs == 0 && after.graph_reserved_current == 0, "the graph's memory went back to the pool");
  std::printf("step 6 OK\n");
  return 0;
}

}  // namespace

int main() { return example::main_of(run); }

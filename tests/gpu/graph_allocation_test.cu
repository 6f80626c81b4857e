// Graph memory added by hand on the GPU: kernel nodes writing and checking graph allocations at
// every launch, reuse after a free node, host-time allocations clear of graph memory, the
// device's graph memory statistics and trim; and memory a graph adopted (allocated outside,
// freed inside) while a long kernel enqueued before the capture still uses it: never handed
// out before that kernel is known done, with no device-wide wait of streamalloc's own.

#include <streamalloc/captured_graph.hpp>
#include <streamalloc/graph_allocation.hpp>
#include <streamalloc/graph_exec.hpp>
#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include <doctest/doctest.h>

#include "gpu_kernels.cuh"
#include "gpu_support.hpp"
#include "graph_checks.cuh"

#include <cuda_runtime.h>

#include <cstdint>
#include <tuple>
#include <vector>

using namespace streamalloc;
using namespace streamalloc_test;

namespace {

/// Adds a kernel node running `k(args...)` on 256 x 256 threads after `deps`.
template <class... Params, class... Args>
cudaGraphNode_t kernel_node(const captured_graph& g, std::vector<cudaGraphNode_t> deps, void (*k)(Params...),
                            Args... args) {
  std::tuple<Params...> values(args...);
  void* pointers[sizeof...(Params)];
  std::apply([&](auto&... v) {
    int i = 0;
    ((pointers[i++] = &v), ...);
  }, values);
  cudaKernelNodeParams p{};
  p.func = reinterpret_cast<void*>(k);
  p.gridDim = dim3(256);
  p.blockDim = dim3(256);
  p.kernelParams = pointers;  // copied into the node
  cudaGraphNode_t n = nullptr;
  SA_CUDA_REQUIRE(cudaGraphAddKernelNode(&n, g.get(), deps.data(), deps.size(), &p));
  return n;
}

std::uint32_t* words(const graph_allocation& a) { return static_cast<std::uint32_t*>(a.get()); }

/// Allocates and writes `n` bytes on `other` eight times: never at `h`, which a long kernel uses.
void allocate_elsewhere(pool& p, stream& other, const void* h, std::size_t n) {
  for (int i = 0; i < 8; ++i) {
    void* x = p.allocate(n, other.ref());
    CHECK_FALSE(overlaps(x, n, h, n));
    fill_on(x, n, 3u, other.get());
    p.deallocate(x, other.ref());
  }
}

}  // namespace

TEST_SUITE("graph_allocation") {

TEST_CASE("kernel nodes write and check graph allocations at every launch; reuse after the free node") {
  pool p;
  stream s;
  mismatch_counter bad;
  constexpr std::size_t n = 8 * MiB;
  {
    captured_graph g = make_graph();
    graph_allocation a = add_allocation(g, p, n);
    const auto fa = kernel_node(g, {a.node()}, fill_kernel, words(a), n / 4, 11u);
    const auto ca = kernel_node(g, {fa}, check_kernel, static_cast<const std::uint32_t*>(a.get()), n / 4, 11u, bad.d);
    const cudaGraphNode_t fr = add_free(g, a, {&ca, 1});
    graph_allocation b = add_allocation(g, p, n, {&fr, 1});
    CHECK(b.get() == a.get());  // after the free node: the same memory
    const auto fb = kernel_node(g, {b.node()}, fill_kernel, words(b), n / 4, 22u);
    const auto cb = kernel_node(g, {fb}, check_kernel, static_cast<const std::uint32_t*>(b.get()), n / 4, 22u, bad.d);
    (void)add_free(g, b, {&cb, 1});
    graph_allocation out = add_allocation(g, p, MiB);  // left live by each launch
    (void)kernel_node(g, {out.node()}, fill_kernel, words(out), MiB / 4, 33u);
    CHECK_FALSE(overlaps(out.get(), MiB, a.get(), n));
    CHECK(graph_memory(0).reserved_current >= n + MiB);

    graph_exec e(g);
    for (int i = 0; i < 10; ++i) {
      e.launch(s.ref());
      void* h = p.allocate(n, s.ref());  // host time: never graph memory
      CHECK_FALSE(overlaps(h, n, a.get(), n));
      CHECK_FALSE(overlaps(h, n, out.get(), MiB));
      fill_on(h, n, 44u, s.get());
      check_on(out.get(), MiB, 33u, s.get(), bad);  // the launch's result, read after it
      p.deallocate(h, s.ref());
      p.deallocate(out.get(), s.ref());  // freed after the launch: the next makes it again
    }
    s.synchronize();
    CHECK(bad.read() == 0);
  }
  REQUIRE(eventually([&] { return p.statistics().graphs == 0; }));
}

TEST_CASE("the device's graph memory statistics, and trim once the graph is gone") {
  pool p({.release_threshold = SIZE_MAX});
  const graph_memory_statistics before = graph_memory(0);
  {
    captured_graph g = make_graph();
    graph_allocation a = add_allocation(g, p, 64 * MiB);
    (void)add_free(g, a, {});  // freed in the graph: free memory of the pool once the graph goes
    const graph_memory_statistics during = graph_memory(0);
    CHECK(during.reserved_current == before.reserved_current + 64 * MiB);
    CHECK(during.used_current == during.reserved_current);
    CHECK(during.graphs == before.graphs + 1);
    CHECK(during.reserved_high >= 64 * MiB);
  }
  REQUIRE(eventually([&] { return graph_memory(0).reserved_current == before.reserved_current; }));
  CHECK(p.statistics().reserved_current >= 64 * MiB);  // kept by the release threshold
  trim_graph_memory(0);
  CHECK(p.statistics().reserved_current == 0);
}

TEST_CASE("a captured workspace held by allocation_of keeps its contents once the graph and executable are gone") {
  pool p;
  stream s, other;
  constexpr std::size_t n = 8 * MiB;
  void* ws = nullptr;
  void* out = nullptr;
  {
    SA_CUDA_REQUIRE(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeGlobal));
    ws = p.allocate(n, s.ref());
    out = p.allocate(n, s.ref());
    fill_async(ws, n, 7u, s.get());
    fill_async(out, n, 9u, s.get());
    p.deallocate(ws, s.ref());  // a workspace: freed in the graph, last (nothing reuses it)
    captured_graph g = end_capture(s.ref());
    graph_allocation held = allocation_of(g, ws);
    std::vector<graph_allocation> outs = unfreed_allocations(g);
    REQUIRE(outs.size() == 1);
    CHECK(outs[0].get() == out);
    CHECK(outs[0].size() == n);
    {
      graph_exec e(g);
      e.launch(s.ref());
      s.synchronize();
      g.reset();
    }  // the graph and its executable are gone; `held` and `outs` hold the memory
    allocate_elsewhere(p, other, ws, n);
    CHECK(p.statistics().graphs == 1);
    CHECK(mismatches(ws, n, 7u) == 0);  // what the launch wrote, untouched
    CHECK(mismatches(out, n, 9u) == 0);
  }
  REQUIRE(eventually([&] { return p.statistics().graphs == 0; }));
  CHECK(p.find_allocation(out).has_value());  // left live by the graph: the pool's allocation now
  p.deallocate(out, s.ref());
  s.synchronize();
  other.synchronize();  // the allocations made elsewhere are known done too
  p.trim_to(0);
  CHECK(p.statistics().reserved_current == 0);
}

TEST_CASE("memory a never-launched graph adopted is not reused while work enqueued before the capture runs") {
  pool p;
  stream other;
  spin_counters c;
  constexpr std::size_t n = 8 * MiB;
  constexpr unsigned long long spin = 300'000'000;  // 300 ms
  SUBCASE("a raw stream: held until a device-wide synchronization") {
    cudaStream_t raw = nullptr;
    SA_CUDA_REQUIRE(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));
    void* h = p.allocate(n, stream_ref{raw});
    fill_on(h, n, 1u, raw);
    slow_check_fill_kernel<<<64, 256, 0, raw>>>(static_cast<std::uint32_t*>(h), n / 4, 1u, 2u, spin, c.d);
    SA_CUDA_REQUIRE(cudaStreamBeginCapture(raw, cudaStreamCaptureModeGlobal));
    p.deallocate(h, stream_ref{raw});  // the graph's now: a launch would free it
    { captured_graph g = end_capture(stream_ref{raw}); }  // gone, never launched
    REQUIRE(eventually([&] { return p.statistics().graph_allocations == 0; }));
    allocate_elsewhere(p, other, h, n);
    CHECK(p.statistics().free_pending >= n);  // awaiting proof that the kernel is done
    (void)synchronize_device(0);  // the proof the pool waited for: the memory is free now
    CHECK(c.read(0) == 0);        // the slow kernel's memory was never written by another
    CHECK(c.read(1) == n / 4);    // and it ran to the end
    p.trim_to(0);
    CHECK(p.statistics().reserved_current == 0);  // nothing held back
    SA_CUDA_REQUIRE(cudaStreamDestroy(raw));
  }
  SUBCASE("a streamalloc stream: back in that stream's order") {
    stream s;
    void* h = p.allocate(n, s.ref());
    fill_on(h, n, 1u, s.get());
    slow_check_fill_kernel<<<64, 256, 0, s.get()>>>(static_cast<std::uint32_t*>(h), n / 4, 1u, 2u, spin, c.d);
    SA_CUDA_REQUIRE(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeGlobal));
    p.deallocate(h, s.ref());
    { captured_graph g = end_capture(s.ref()); }
    REQUIRE(eventually([&] { return p.statistics().graph_allocations == 0; }));
    allocate_elsewhere(p, other, h, n);
    s.synchronize();  // s is known done: so is the adopted memory
    other.synchronize();
    CHECK(c.read(0) == 0);
    CHECK(c.read(1) == n / 4);
    p.trim_to(0);
    CHECK(p.statistics().reserved_current == 0);
  }
}

}  // TEST_SUITE

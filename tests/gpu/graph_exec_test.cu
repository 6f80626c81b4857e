// graph_exec on the GPU: launches as fast as a graph without streamalloc memory, holds the
// memory until its last launch has finished (destroyed while a long kernel runs, host-time
// allocations never get it meanwhile), refuses a relaunch over allocations the last launch left
// live, and runs a device-launched graph that relaunches itself over streamalloc graph memory.

#include <streamalloc/captured_graph.hpp>
#include <streamalloc/graph_exec.hpp>
#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include <doctest/doctest.h>

#include "gpu_kernels.cuh"
#include "gpu_support.hpp"
#include "graph_checks.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <vector>

using namespace streamalloc;
using namespace streamalloc_test;

namespace {

/// Writes x[i] = i * i + 1 for i = *count, counts, and relaunches its own graph from the device
/// (tail launch) until `n` values are written: each relaunch runs after the last has finished.
__global__ void tail_step(std::uint32_t* x, unsigned* count, unsigned n) {
  const unsigned i = *count;
  x[i] = i * i + 1;
  *count = i + 1;
  if (i + 1 < n) (void)cudaGraphLaunch(cudaGetCurrentGraphExec(), cudaStreamGraphTailLaunch);
}

/// Median host time of one launch, over 5 rounds of 40 launches back to back (us).
template <class Launch>
double launch_us(Launch launch, cudaStream_t s) {
  for (int i = 0; i < 5; ++i) launch();
  SA_CUDA_REQUIRE(cudaStreamSynchronize(s));
  std::vector<double> rounds;
  for (int r = 0; r < 5; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 40; ++i) launch();
    const auto t1 = std::chrono::steady_clock::now();
    SA_CUDA_REQUIRE(cudaStreamSynchronize(s));
    rounds.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / 40);
  }
  std::sort(rounds.begin(), rounds.end());
  return rounds[2];
}

}  // namespace

TEST_SUITE("graph_exec") {

TEST_CASE("a graph_exec launches a graph holding streamalloc memory as fast as one without") {
  pool p;
  stream s;
  mismatch_counter c;
  // 256 kernels over one captured allocation: the shape where a user object costs the most.
  SA_CUDA_REQUIRE(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeThreadLocal));
  void* x = p.allocate(64 * 1024, s.ref());
  fill_on(x, 64 * 1024, 5, s.get());
  for (int i = 0; i < 254; ++i) check_kernel<<<1, 32, 0, s.get()>>>(static_cast<const std::uint32_t*>(x), 32, 5, c.d);
  p.deallocate(x, s.ref());
  captured_graph g = end_capture(s.ref());

  cudaGraphExec_t raw = nullptr;  // holds the user object
  SA_CUDA_REQUIRE(cudaGraphInstantiateWithFlags(&raw, g.get(), 0));
  graph_exec held(g);
  CHECK(held.graph_memory_holds() == 1);
  const double raw_us = launch_us([&] { SA_CUDA_REQUIRE(cudaGraphLaunch(raw, s.get())); }, s.get());
  const double held_us = launch_us([&] { held.launch(s.ref()); }, s.get());
  MESSAGE("256 kernels, host time per launch: raw executable with the user object " << raw_us
                                                                                    << " us, graph_exec " << held_us
                                                                                    << " us");
  // Under compute-sanitizer every launch takes milliseconds whatever it holds: nothing to compare.
  if (raw_us < 2000) CHECK(held_us * 3 < raw_us);
  CHECK(c.read() == 0);
  SA_CUDA_REQUIRE(cudaGraphExecDestroy(raw));
  g.reset();
  held.reset();
  CHECK(eventually([&] { return p.statistics().graphs == 0; }));
}

TEST_CASE("destroyed while its launch runs: no host-time allocation gets the memory until the launch ends") {
  pool p;
  stream s, other;
  mismatch_counter c;
  constexpr std::size_t bytes = MiB;
  SA_CUDA_REQUIRE(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeGlobal));
  void* x = p.allocate(bytes, s.ref());
  slow_fill_kernel<<<64, 256, 0, s.get()>>>(static_cast<std::uint32_t*>(x), bytes / 4, 9, 400'000'000LL);
  check_on(x, bytes, 9, s.get(), c);
  p.deallocate(x, s.ref());
  captured_graph g = end_capture(s.ref());
  graph_exec e(g);
  g.reset();  // e alone holds the memory now
  cudaEvent_t done = nullptr;
  SA_CUDA_REQUIRE(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  e.launch(s.ref());
  SA_CUDA_REQUIRE(cudaEventRecord(done, s.get()));
  e.reset();  // at once, while the kernel spins

  std::vector<void*> taken;
  int while_running = 0;
  while (cudaEventQuery(done) == cudaErrorNotReady && taken.size() < 200) {
    void* q = p.allocate(bytes, other.ref());
    if (cudaEventQuery(done) == cudaErrorNotReady) {
      ++while_running;
      CHECK_FALSE(overlaps(q, bytes, x, bytes));
    }
    fill_on(q, bytes, 77, other.get());
    taken.push_back(q);
    p.deallocate(q, other.ref());  // back at once: the next one may be it again, never x
  }
  MESSAGE(while_running << " allocations made while the destroyed executable's launch ran");
  CHECK(while_running > 0);
  SA_CUDA_REQUIRE(cudaStreamSynchronize(s.get()));
  SA_CUDA_REQUIRE(cudaStreamSynchronize(other.get()));
  CHECK(c.read() == 0);
  CHECK(eventually([&] { return p.statistics().graphs == 0; }));
  CHECK(p.statistics().live_allocations == 0);
  SA_CUDA_REQUIRE(cudaEventDestroy(done));
}

TEST_CASE("relaunching over the last launch's live allocation is refused until it is freed, unless auto-freed") {
  pool p;
  stream s;
  constexpr std::size_t bytes = 256 * 1024;
  SA_CUDA_REQUIRE(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeThreadLocal));
  void* x = p.allocate(bytes, s.ref());
  fill_on(x, bytes, 31, s.get());
  captured_graph g = end_capture(s.ref());
  {
    graph_exec e(g);
    e.launch(s.ref());
    CHECK(mismatches_on(x, bytes, 31, s.get()) == 0);  // valid after the launch, on its stream
    CHECK_THROWS_WITH_AS(e.launch(s.ref()), doctest::Contains("still live since its last launch"), std::logic_error);
    fill_async(x, bytes, 32, s.get());  // the refused launch did not run: this survives
    CHECK(mismatches_on(x, bytes, 32, s.get()) == 0);
    p.deallocate(x, s.ref());
    e.launch(s.ref());  // makes it again, at the same address
    CHECK(mismatches_on(x, bytes, 31, s.get()) == 0);
    p.deallocate(x, s.ref());
  }
  {
    graph_exec auto_free(g, cudaGraphInstantiateFlagAutoFreeOnLaunch);
    for (int i = 0; i < 3; ++i) {
      fill_async(x, bytes, 40, s.get());
      auto_free.launch(s.ref());
      CHECK(mismatches_on(x, bytes, 31, s.get()) == 0);
    }
  }
  g.reset();
  CHECK(eventually([&] { return p.statistics().graphs == 0; }));
  CHECK(p.statistics().live_allocations == 1);  // the last launch's, never freed
  p.deallocate(x, s.ref());
}

TEST_CASE("a device-launched graph relaunches itself (tail launch) over streamalloc graph memory") {
  pool p;
  stream s;
  constexpr unsigned n = 64;
  unsigned* count = nullptr;
  SA_CUDA_REQUIRE(cudaMalloc(&count, sizeof *count));
  SA_CUDA_REQUIRE(cudaMemset(count, 0, sizeof *count));
  SA_CUDA_REQUIRE(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeThreadLocal));
  auto* x = static_cast<std::uint32_t*>(p.allocate(n * sizeof(std::uint32_t), s.ref()));
  tail_step<<<1, 1, 0, s.get()>>>(x, count, n);
  captured_graph g = end_capture(s.ref());
  graph_exec e(g, cudaGraphInstantiateFlagDeviceLaunch);  // the driver refuses its memory nodes here
  g.reset();
  e.upload(s.ref());
  e.launch(s.ref());
  std::vector<std::uint32_t> h(n, 0);
  unsigned hc = 0;
  SA_CUDA_REQUIRE(cudaMemcpyAsync(h.data(), x, n * sizeof(std::uint32_t), cudaMemcpyDeviceToHost, s.get()));
  SA_CUDA_REQUIRE(cudaMemcpyAsync(&hc, count, sizeof hc, cudaMemcpyDeviceToHost, s.get()));
  SA_CUDA_REQUIRE(cudaStreamSynchronize(s.get()));
  CHECK(hc == n);
  unsigned wrong = 0;
  for (unsigned i = 0; i < n; ++i) wrong += h[i] != i * i + 1 ? 1 : 0;
  CHECK(wrong == 0);
  p.deallocate(x, s.ref());
  e.reset();
  CHECK(eventually([&] { return p.statistics().graphs == 0; }));
  SA_CUDA_REQUIRE(cudaFree(count));
}

}  // TEST_SUITE

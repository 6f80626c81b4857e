// Allocations under stream capture: the graph holds its memory at fixed addresses for its life,
// host-time allocations never get it, the capture's own frees make it reusable inside the
// capture only, and the pool takes it back once the graph, every executable and their launches
// are gone. Each graph checks its own data with a kernel captured into it, at every launch.

#include <streamalloc/detail/pool/graph_reaper.hpp>
#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>
#include <streamalloc/stream_buffer.hpp>

#include <doctest/doctest.h>

#include "gpu_kernels.cuh"
#include "gpu_support.hpp"
#include "graph_checks.cuh"

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using namespace streamalloc;
using namespace streamalloc_test;

namespace {

struct graph_and_exec {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  void instantiate(unsigned long long flags = 0) { SA_CUDA_REQUIRE(cudaGraphInstantiateWithFlags(&exec, graph, flags)); }
  void destroy() {
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    if (graph != nullptr) cudaGraphDestroy(graph);
    exec = nullptr;
    graph = nullptr;
  }
  ~graph_and_exec() { destroy(); }
};

void end_capture(cudaStream_t s, graph_and_exec& g) { SA_CUDA_REQUIRE(cudaStreamEndCapture(s, &g.graph)); }

}  // namespace

TEST_SUITE("graph capture") {

TEST_CASE("allocate, write, free under capture: fixed addresses, in-graph reuse, host allocations never overlap") {
  for (const auto mode : {cudaStreamCaptureModeGlobal, cudaStreamCaptureModeThreadLocal, cudaStreamCaptureModeRelaxed}) {
    CAPTURE(static_cast<int>(mode));
    pool p;
    cudaStream_t raw = nullptr;  // a capture begun by code that never heard of streamalloc
    SA_CUDA_REQUIRE(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));
    stream other;
    mismatch_counter c;
    const std::size_t bytes = 4 * MiB;
    graph_and_exec g;
    SA_CUDA_REQUIRE(cudaStreamBeginCapture(raw, mode));
    void* x = p.allocate(bytes, stream_ref{raw});
    fill_on(x, bytes, 1, raw);
    check_on(x, bytes, 1, raw, c);
    p.deallocate(x, stream_ref{raw});
    void* y = p.allocate(bytes, stream_ref{raw});  // reuses x: ordered after its free, in the graph
    fill_on(y, bytes, 2, raw);
    check_on(y, bytes, 2, raw, c);
    p.deallocate(y, stream_ref{raw});
    end_capture(raw, g);
    CHECK(y == x);
    const pool_statistics held = p.statistics();
    CHECK(held.graphs == 1);
    CHECK(held.graph_allocations == 1);
    CHECK(held.graph_reserved_current >= bytes);
    CHECK(held.live_allocations == 0);
    g.instantiate();
    for (std::uint32_t launch = 0; launch < 5; ++launch) {
      // Host-time memory between launches: never the graph's, and left alone by its launches.
      void* h = p.allocate(bytes, other.ref());
      CHECK_FALSE(overlaps(h, bytes, x, bytes));
      fill_on(h, bytes, 100 + launch, other.get());
      SA_CUDA_REQUIRE(cudaStreamSynchronize(other.get()));
      SA_CUDA_REQUIRE(cudaGraphLaunch(g.exec, raw));
      SA_CUDA_REQUIRE(cudaStreamSynchronize(raw));
      CHECK(mismatches(h, bytes, 100 + launch) == 0);
      p.deallocate(h, other.ref());
    }
    CHECK(c.read() == 0);
    g.destroy();
    CHECK(eventually([&] { return p.statistics().graphs == 0; }));
    const pool_statistics after = p.statistics();
    CHECK(after.graph_reserved_current == 0);
    CHECK(after.graph_allocations == 0);
    // The graph's memory is the pool's again: a host-time allocation may now get it.
    void* again = p.allocate(bytes, other.ref());
    CHECK(again != nullptr);
    p.deallocate(again, other.ref());
    cudaStreamDestroy(raw);
  }
}

TEST_CASE("a free still pending on the stream before the capture is not reused inside it") {
  pool p;
  stream s, runner;
  mismatch_counter c;
  const std::size_t bytes = 16 * MiB;
  void* x = p.allocate(bytes, s.ref());
  // ~300 ms of work on s still using x when the graph runs on another stream.
  slow_fill_kernel<<<64, 256, 0, s.get()>>>(static_cast<std::uint32_t*>(x), bytes / 4, 7, 600'000'000LL);
  p.deallocate(x, s.ref());  // pending behind the kernel
  graph_and_exec g;
  SA_CUDA_REQUIRE(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeGlobal));
  void* y = p.allocate(bytes, s.ref());
  fill_on(y, bytes, 8, s.get());
  check_on(y, bytes, 8, s.get(), c);
  p.deallocate(y, s.ref());
  end_capture(s.get(), g);
  CHECK_FALSE(overlaps(x, bytes, y, bytes));
  g.instantiate();
  SA_CUDA_REQUIRE(cudaGraphLaunch(g.exec, runner.get()));  // not ordered after the slow kernel
  SA_CUDA_REQUIRE(cudaDeviceSynchronize());
  CHECK(c.read() == 0);
  CHECK(mismatches(x, bytes, 7) == 0);  // the slow kernel's writes are intact
}

TEST_CASE("a global-mode capture on one thread does not stop another thread's slow path, nor is it invalidated") {
  pool p;
  stream s;
  mismatch_counter c;
  graph_and_exec g;
  SA_CUDA_REQUIRE(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeGlobal));
  void* x = p.allocate(MiB, s.ref());
  fill_on(x, MiB, 3, s.get());
  void* other_block = nullptr;
  std::thread other([&] {
    SA_CUDA_REQUIRE(cudaSetDevice(0));
    stream mine;
    // New physical memory (the slow path maps it), frees learned complete by event queries,
    // memory unmapped: calls a global-mode capture forbids to threads in global mode, as this
    // one is. The test itself makes no such call here (it would be refused and invalidate the
    // capture); it checks the memory once the capture is over.
    for (int i = 0; i < 4; ++i) {
      void* big = p.allocate(96 * MiB, mine.ref());
      fill_on(big, 96 * MiB, 40 + i, mine.get());
      p.deallocate(big, mine.ref());
      p.trim_to(0);
    }
    void* kept = p.allocate(96 * MiB, mine.ref());
    fill_on(kept, 96 * MiB, 44, mine.get());
    other_block = kept;
  });
  other.join();
  check_on(x, MiB, 3, s.get(), c);
  p.deallocate(x, s.ref());
  end_capture(s.get(), g);  // fails if anything invalidated the capture
  g.instantiate();
  SA_CUDA_REQUIRE(cudaGraphLaunch(g.exec, s.get()));
  SA_CUDA_REQUIRE(cudaDeviceSynchronize());
  CHECK(c.read() == 0);
  CHECK(mismatches(other_block, 96 * MiB, 44) == 0);
  p.deallocate_sync(other_block);
}

TEST_CASE("two streams forked and joined in one capture: allocated on one, freed on the other") {
  pool p;
  stream s1, s2;
  mismatch_counter c;
  cudaEvent_t fork = nullptr, handoff = nullptr, join = nullptr;
  SA_CUDA_REQUIRE(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  SA_CUDA_REQUIRE(cudaEventCreateWithFlags(&handoff, cudaEventDisableTiming));
  SA_CUDA_REQUIRE(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  graph_and_exec g;
  SA_CUDA_REQUIRE(cudaStreamBeginCapture(s1.get(), cudaStreamCaptureModeGlobal));
  SA_CUDA_REQUIRE(cudaEventRecord(fork, s1.get()));
  SA_CUDA_REQUIRE(cudaStreamWaitEvent(s2.get(), fork));  // s2 joins the capture
  void* x = p.allocate(2 * MiB, s1.ref());
  void* z = p.allocate(MiB, s2.ref());  // allocated on the joined stream
  fill_on(x, 2 * MiB, 5, s1.get());
  fill_on(z, MiB, 6, s2.get());
  SA_CUDA_REQUIRE(cudaEventRecord(handoff, s1.get()));
  SA_CUDA_REQUIRE(cudaStreamWaitEvent(s2.get(), handoff));
  check_on(x, 2 * MiB, 5, s2.get(), c);
  check_on(z, MiB, 6, s2.get(), c);
  p.deallocate(x, s2.ref());  // freed on the other stream, after the event edge
  p.deallocate(z, s2.ref());
  SA_CUDA_REQUIRE(cudaEventRecord(join, s2.get()));
  SA_CUDA_REQUIRE(cudaStreamWaitEvent(s1.get(), join));
  end_capture(s1.get(), g);
  CHECK_FALSE(overlaps(x, 2 * MiB, z, MiB));
  CHECK(p.statistics().graph_allocations == 2);
  g.instantiate();
  for (int i = 0; i < 3; ++i) SA_CUDA_REQUIRE(cudaGraphLaunch(g.exec, s1.get()));
  SA_CUDA_REQUIRE(cudaStreamSynchronize(s1.get()));
  CHECK(c.read() == 0);
  cudaEventDestroy(fork);
  cudaEventDestroy(handoff);
  cudaEventDestroy(join);
}

TEST_CASE("an allocation left unfreed in the graph: valid after each launch, freed on a stream, live after the graph when never freed") {
  pool p;
  stream s;
  const std::size_t bytes = 2 * MiB;
  for (const bool auto_free : {false, true}) {
    CAPTURE(auto_free);
    graph_and_exec g;
    SA_CUDA_REQUIRE(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeGlobal));
    void* x = p.allocate(bytes, s.ref());
    fill_on(x, bytes, 11, s.get());
    end_capture(s.get(), g);
    g.instantiate(auto_free ? cudaGraphInstantiateFlagAutoFreeOnLaunch : 0);
    for (int launch = 0; launch < 3; ++launch) {
      SA_CUDA_REQUIRE(cudaGraphLaunch(g.exec, s.get()));
      SA_CUDA_REQUIRE(cudaStreamSynchronize(s.get()));
      CHECK(mismatches(x, bytes, 11) == 0);  // read after the launch, at the captured address
      if (!auto_free) p.deallocate(x, s.ref());  // freed outside the graph, in stream order
    }
    const std::size_t live_before = p.statistics().live_allocations;
    g.destroy();
    REQUIRE(eventually([&] { return p.statistics().graphs == 0; }));
    if (auto_free) {
      // Never freed: an ordinary live allocation now, as the driver's graph allocations are.
      CHECK(p.statistics().live_allocations == live_before + 1);
      CHECK(mismatches(x, bytes, 11) == 0);
      p.deallocate(x, s.ref());
      CHECK_THROWS_AS(p.deallocate(x, s.ref()), std::invalid_argument);
    } else {
      CHECK(p.statistics().live_allocations == live_before);
      CHECK_THROWS_AS(p.deallocate(x, s.ref()), std::invalid_argument);  // freed already
    }
  }
}

TEST_CASE("the executable outlives its graph, and the memory waits for both") {
  pool p;
  stream s;
  mismatch_counter c;
  graph_and_exec g;
  SA_CUDA_REQUIRE(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeGlobal));
  void* x = p.allocate(MiB, s.ref());
  fill_on(x, MiB, 21, s.get());
  check_on(x, MiB, 21, s.get(), c);
  p.deallocate(x, s.ref());
  end_capture(s.get(), g);
  g.instantiate();
  cudaGraphDestroy(g.graph);
  g.graph = nullptr;
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(p.statistics().graphs == 1);  // the executable still holds it
  for (int i = 0; i < 4; ++i) SA_CUDA_REQUIRE(cudaGraphLaunch(g.exec, s.get()));
  // Destroyed right after its launches, which are still queued: the release waits for them.
  cudaGraphExecDestroy(g.exec);
  g.exec = nullptr;
  SA_CUDA_REQUIRE(cudaStreamSynchronize(s.get()));
  CHECK(c.read() == 0);
  CHECK(eventually([&] { return p.statistics().graphs == 0; }));
}

TEST_CASE("two graphs launched at once into two streams never share memory") {
  pool p;
  stream a, b;
  mismatch_counter c;
  graph_and_exec ga, gb;
  void* xa = nullptr;
  void* xb = nullptr;
  for (int which = 0; which < 2; ++which) {
    stream& s = which == 0 ? a : b;
    graph_and_exec& g = which == 0 ? ga : gb;
    SA_CUDA_REQUIRE(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeGlobal));
    void* x = p.allocate(8 * MiB, s.ref());
    (which == 0 ? xa : xb) = x;
    fill_on(x, 8 * MiB, 30 + which, s.get());
    check_on(x, 8 * MiB, 30 + which, s.get(), c);
    p.deallocate(x, s.ref());
    end_capture(s.get(), g);
    g.instantiate();
  }
  CHECK_FALSE(overlaps(xa, 8 * MiB, xb, 8 * MiB));
  for (int i = 0; i < 20; ++i) {
    SA_CUDA_REQUIRE(cudaGraphLaunch(ga.exec, a.get()));
    SA_CUDA_REQUIRE(cudaGraphLaunch(gb.exec, b.get()));
  }
  SA_CUDA_REQUIRE(cudaDeviceSynchronize());
  CHECK(c.read() == 0);
}

TEST_CASE("a pool closed while its graph lives keeps the graph's memory mapped until the graph goes") {
  auto& reaper = detail::graph_reaper::instance();
  REQUIRE(eventually([&] { return reaper.outstanding() == 0; }));
  stream s;
  mismatch_counter c;
  graph_and_exec g;
  {
    pool p;
    SA_CUDA_REQUIRE(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeGlobal));
    void* x = p.allocate(4 * MiB, s.ref());
    fill_on(x, 4 * MiB, 50, s.get());
    check_on(x, 4 * MiB, 50, s.get(), c);
    p.deallocate(x, s.ref());
    end_capture(s.get(), g);
    g.instantiate();
    CHECK(reaper.outstanding() == 1);
  }  // the pool is destroyed: its graph still runs
  for (int i = 0; i < 3; ++i) SA_CUDA_REQUIRE(cudaGraphLaunch(g.exec, s.get()));
  SA_CUDA_REQUIRE(cudaStreamSynchronize(s.get()));
  CHECK(c.read() == 0);
  g.destroy();
  CHECK(eventually([&] { return reaper.outstanding() == 0; }));
}

TEST_CASE("memory allocated outside and freed inside a capture: the graph frees it, the pool waits for the graph") {
  pool p;
  stream s, before;
  const std::size_t bytes = MiB;
  void* h = p.allocate(bytes, before.ref());
  fill_on(h, bytes, 60, before.get());
  SA_CUDA_REQUIRE(cudaStreamSynchronize(before.get()));
  const std::size_t live = p.statistics().live_allocations;
  graph_and_exec g;
  SA_CUDA_REQUIRE(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeGlobal));
  p.deallocate(h, s.ref());
  end_capture(s.get(), g);
  CHECK(p.statistics().live_allocations == live - 1);
  CHECK(p.statistics().graph_allocations == 1);
  CHECK_THROWS_AS(p.deallocate(h, before.ref()), std::invalid_argument);  // the graph frees it
  g.instantiate();
  SA_CUDA_REQUIRE(cudaGraphLaunch(g.exec, s.get()));
  SA_CUDA_REQUIRE(cudaStreamSynchronize(s.get()));
  g.destroy();
  CHECK(eventually([&] { return p.statistics().graphs == 0; }));
  CHECK(p.statistics().graph_reserved_current == 0);
}

TEST_CASE("bad frees and bad streams under capture are refused, naming what was wrong") {
  pool p;
  stream s, t;
  graph_and_exec g1, g2;
  SA_CUDA_REQUIRE(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeGlobal));
  void* x = p.allocate(MiB, s.ref());
  p.deallocate(x, s.ref());
  CHECK_THROWS_WITH_AS(p.deallocate(x, s.ref()), doctest::Contains("double free"), std::invalid_argument);
  void* kept = p.allocate(2 * MiB, s.ref());  // another size: not x again
  end_capture(s.get(), g1);
  // Another capture may not free the first one's memory.
  SA_CUDA_REQUIRE(cudaStreamBeginCapture(t.get(), cudaStreamCaptureModeThreadLocal));
  CHECK_THROWS_WITH_AS(p.deallocate(kept, t.ref()), doctest::Contains("another graph"), std::invalid_argument);
  int local = 0;
  CHECK_THROWS_AS(p.deallocate(&local, t.ref()), std::invalid_argument);
  end_capture(t.get(), g2);
  // After the capture, memory the graph freed inside is not an allocation.
  CHECK_THROWS_WITH_AS(p.deallocate(x, s.ref()), doctest::Contains("freed inside"), std::invalid_argument);
  // The legacy default stream while a blocking stream captures: its work would join the
  // capture implicitly, which CUDA forbids; the pool refuses instead of handing out memory.
  // Nor is its id asked, which CUDA refuses too, invalidating the capture: the capture
  // question comes first, and the capture ends whole.
  stream blocking(0, stream_flags::blocking);
  SA_CUDA_REQUIRE(cudaStreamBeginCapture(blocking.get(), cudaStreamCaptureModeGlobal));
  CHECK_THROWS_WITH_AS((void)p.allocate(MiB, stream_ref::legacy_default()),
                       doctest::Contains("legacy default stream was used"), cuda_error);
  CHECK_THROWS_WITH_AS((void)stream_ref::legacy_default().resolved(),
                       doctest::Contains("legacy default stream was used"), cuda_error);
  std::string elsewhere = "not refused";  // from a thread with no context yet, as well
  std::thread([&] {
    try {
      (void)stream_ref::legacy_default().resolved();
    } catch (const std::exception& e) {  // any: one escaping the thread would end the process
      elsewhere = e.what();
    }
  }).join();
  INFO("the other thread's answer: ", elsewhere);
  CHECK(elsewhere.find("legacy default stream was used") != std::string::npos);
  cudaGraph_t ended = nullptr;
  CHECK(cudaStreamEndCapture(blocking.get(), &ended) == cudaSuccess);
  (void)cudaGetLastError();
  if (ended != nullptr) cudaGraphDestroy(ended);
  // A capture invalidated by an illegal call: the pool says so until the capture is ended.
  SA_CUDA_REQUIRE(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeGlobal));
  CHECK(cudaStreamSynchronize(s.get()) != cudaSuccess);
  (void)cudaGetLastError();
  CHECK_THROWS_WITH_AS((void)p.allocate(MiB, s.ref()), doctest::Contains("invalidated"), cuda_error);
  cudaGraph_t broken = nullptr;
  CHECK(cudaStreamEndCapture(s.get(), &broken) == cudaErrorStreamCaptureInvalidated);
  (void)cudaGetLastError();
  CHECK(broken == nullptr);
  // Growing and shrinking in place under capture change nothing.
  void* y = p.allocate(MiB, s.ref());
  SA_CUDA_REQUIRE(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeGlobal));
  CHECK(p.grow_in_place(y, 2 * MiB, s.ref()) == 0);
  CHECK(p.shrink_in_place(y, 1024, s.ref()) == MiB);
  graph_and_exec g3;
  end_capture(s.get(), g3);
  p.deallocate(y, s.ref());
}

TEST_CASE("stream_buffer and streamalloc::allocate under capture") {
  stream s;
  mismatch_counter c;
  graph_and_exec g;
  SA_CUDA_REQUIRE(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeGlobal));
  {
    stream_buffer<std::uint32_t> b(MiB / 4, s.ref());
    fill_on(b.data(), MiB, 70, s.get());
    check_on(b.data(), MiB, 70, s.get(), c);
    void* raw = streamalloc::allocate(MiB, s.ref());
    fill_on(raw, MiB, 71, s.get());
    check_on(raw, MiB, 71, s.get(), c);
    streamalloc::deallocate(raw, s.ref());
  }  // the buffer's free is captured too
  end_capture(s.get(), g);
  CHECK(current_pool(0).statistics().graphs >= 1);
  g.instantiate();
  for (int i = 0; i < 3; ++i) SA_CUDA_REQUIRE(cudaGraphLaunch(g.exec, s.get()));
  SA_CUDA_REQUIRE(cudaStreamSynchronize(s.get()));
  CHECK(c.read() == 0);
  // The default pool lives until the process exits: the graph's memory goes back to it on
  // streamalloc's thread, which an exit right after this case could outrun (compute-sanitizer
  // then counted the graph's piece as leaked, in one run of two).
  g.destroy();
  CHECK(eventually([] { return current_pool(0).statistics().graphs == 0; }));
}

}  // TEST_SUITE

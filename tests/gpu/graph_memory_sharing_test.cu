// Graphs launched through graph_exec share physical memory on the GPU: K graphs launched in
// turn into one stream hold about the largest one's memory; the same graphs launched into two
// streams at once never share a page (slow kernels check their data after others had time to
// write); a graph whose allocation outlives its launches keeps memory of its own; upload maps
// ahead.

#include <streamalloc/captured_graph.hpp>
#include <streamalloc/graph_exec.hpp>
#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include <doctest/doctest.h>

#include "gpu_kernels.cuh"
#include "gpu_support.hpp"
#include "graph_checks.cuh"

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

using namespace streamalloc;
using namespace streamalloc_test;

namespace {

constexpr std::size_t graph_bytes = 64 * MiB;

/// A graph that allocates `graph_bytes`, fills them with `seed`'s pattern, holds its stream for
/// `spin_ns` and then checks the pattern is still there (counting into `c`), and frees them: a
/// workspace. Any other graph writing the same memory meanwhile shows up in `c`.
graph_exec workspace_graph(pool& p, stream& s, std::uint32_t seed, unsigned long long spin_ns, const spin_counters& c) {
  SA_CUDA_REQUIRE(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeThreadLocal));
  void* x = p.allocate(graph_bytes, s.ref());
  fill_on(x, graph_bytes, seed, s.get());
  slow_check_fill_kernel<<<128, 256, 0, s.get()>>>(static_cast<std::uint32_t*>(x), graph_bytes / 4, seed, seed + 1,
                                                     spin_ns, c.d);
  p.deallocate(x, s.ref());
  captured_graph g = end_capture(s.ref());
  return graph_exec(g);  // the graph goes here: the executable alone holds the memory
}

/// Destroys the executables and waits until the pool has taken their memory back (on
/// streamalloc's thread, once their launches are done): nothing of it is left held.
void destroy_all(std::vector<graph_exec>& graphs, pool& p) {
  graphs.clear();
  CHECK(eventually([&] { return p.statistics().graphs == 0; }));
  CHECK(p.statistics().graph_reserved_current == 0);
}

/// Launches every graph in turn into `s`, `rounds` times, and waits.
void launch_in_turn(std::vector<graph_exec>& graphs, stream& s, int rounds) {
  for (int r = 0; r < rounds; ++r) {
    for (graph_exec& e : graphs) e.launch(s.ref());
  }
  s.synchronize();
}

}  // namespace

TEST_SUITE("graph memory sharing") {

TEST_CASE("K graphs launched in turn into one stream hold about the largest one's memory, data intact") {
  pool p;
  stream s;
  spin_counters c;
  constexpr int k = 4;
  std::vector<graph_exec> graphs;
  for (int i = 0; i < k; ++i) graphs.push_back(workspace_graph(p, s, 10u + i, 1'000'000, c));
  CHECK(p.statistics().graph_reserved_current >= k * graph_bytes);  // each its own, until launched
  // The captured graphs' user objects go on streamalloc's thread: a launch finding one still
  // there leaves that graph's memory where it is, the next moves it.
  REQUIRE(eventually([&] {
    launch_in_turn(graphs, s, 1);
    return p.statistics().graph_reserved_current <= graph_bytes + 2 * MiB;
  }));
  launch_in_turn(graphs, s, 3);
  const pool_statistics st = p.statistics();
  MESSAGE("graph memory for " << k << " graphs of 64 MiB in one stream: " << st.graph_reserved_current / MiB << " MiB");
  CHECK(st.graph_reserved_current >= graph_bytes);
  CHECK(st.reserved_current <= graph_bytes + 2 * MiB);  // the graphs' own memory went back
  CHECK(c.read(0) == 0);  // every launch found its data where it wrote it
  CHECK(c.read(1) % (graph_bytes / 4) == 0);
  CHECK(c.read(1) >= 4 * k * (graph_bytes / 4));
  destroy_all(graphs, p);
}

TEST_CASE("the same graphs launched into two streams at once never share a page") {
  pool p;
  stream s, t;
  spin_counters c;
  std::vector<graph_exec> graphs;
  // Long kernels: while one graph's kernel waits between its write and its check, the other
  // graph runs on the other stream and writes its own pattern; shared pages would show.
  for (int i = 0; i < 2; ++i) graphs.push_back(workspace_graph(p, s, 20u + i, 100'000'000, c));
  REQUIRE(eventually([&] {
    launch_in_turn(graphs, s, 1);
    return p.statistics().graph_reserved_current <= graph_bytes + 2 * MiB;  // sharing s's pages
  }));
  for (int r = 0; r < 3; ++r) {
    graphs[0].launch(s.ref());
    graphs[1].launch(t.ref());  // moves to t's pages (after its last launch, on s, is done)
  }
  s.synchronize();
  t.synchronize();
  CHECK(p.statistics().graph_reserved_current >= 2 * graph_bytes);  // one set of pages per stream
  CHECK(c.read(0) == 0);
  // Back into one stream: t's pages go once no graph maps them.
  launch_in_turn(graphs, s, 2);
  CHECK(p.statistics().graph_reserved_current <= graph_bytes + 2 * MiB);
  CHECK(c.read(0) == 0);
  CHECK(c.read(1) % (graph_bytes / 4) == 0);  // every launch's kernel ran to the end
  CHECK(c.read(1) >= (2 + 6 + 4) * (graph_bytes / 4));
  destroy_all(graphs, p);
}

TEST_CASE("a graph whose allocation outlives its launch keeps its own memory; others in its stream do not touch it") {
  pool p;
  stream s;
  spin_counters c;
  constexpr std::size_t n = 8 * MiB;
  SA_CUDA_REQUIRE(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeThreadLocal));
  void* kept = p.allocate(n, s.ref());
  fill_on(kept, n, 5u, s.get());
  graph_exec producer = [&] {
    captured_graph g = end_capture(s.ref());
    return graph_exec(g, cudaGraphInstantiateFlagAutoFreeOnLaunch);
  }();
  std::vector<graph_exec> others;
  others.push_back(workspace_graph(p, s, 30u, 1'000'000, c));
  for (int round = 0; round < 4; ++round) {
    producer.launch(s.ref());
    launch_in_turn(others, s, 1);
    CHECK(mismatches_on(kept, n, 5u, s.get()) == 0);  // the workspace graph never wrote it
  }
  CHECK(c.read(0) == 0);
  CHECK(p.statistics().graph_reserved_current >= n + graph_bytes);
  p.deallocate(kept, s.ref());  // freed after the last launch, as the rules say
  producer.reset();
  destroy_all(others, p);
  CHECK(p.statistics().live_allocations == 0);
}

TEST_CASE("upload maps ahead: after it, the graph's memory is the stream's shared pages") {
  pool p;
  stream s;
  spin_counters c;
  std::vector<graph_exec> graphs;
  for (int i = 0; i < 3; ++i) graphs.push_back(workspace_graph(p, s, 40u + i, 1'000'000, c));
  REQUIRE(eventually([&] {
    for (graph_exec& e : graphs) e.upload(s.ref());
    return p.statistics().graph_reserved_current <= graph_bytes + 2 * MiB;
  }));
  launch_in_turn(graphs, s, 2);
  CHECK(p.statistics().graph_reserved_current <= graph_bytes + 2 * MiB);  // the launches moved nothing
  CHECK(c.read(0) == 0);
  CHECK(c.read(1) == 6 * (graph_bytes / 4));
  destroy_all(graphs, p);
}

}  // TEST_SUITE

// Graph memory added by hand (graph_allocation.hpp) against the fake driver's graphs and nodes:
// allocation and free nodes, reuse only after a free the allocation depends on, the holds of
// graph_allocation, the device's graph memory statistics and trim, and the refusals. The GPU
// test (tests/gpu/graph_allocation_test.cu) runs kernels on the same graphs.

#include <streamalloc/graph_allocation.hpp>
#include <streamalloc/graph_exec.hpp>
#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include <doctest/doctest.h>

#include "fake_driver.hpp"

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <vector>

using namespace streamalloc;
namespace cu = streamalloc::detail::cu;
using streamalloc_test::MiB;
using streamalloc_test::reaper_idle;

namespace {
bool overlaps(const void* a, std::size_t an, const void* b, std::size_t bn) {
  const auto x = reinterpret_cast<std::uintptr_t>(a), y = reinterpret_cast<std::uintptr_t>(b);
  return x < y + bn && y < x + an;
}

CUgraphNode empty_node(captured_graph& g, std::span<const CUgraphNode> deps) {
  CUgraphNode n = nullptr;
  cu::cuGraphAddEmptyNode(&n, g.get(), deps.data(), deps.size());
  return n;
}
}  // namespace

TEST_SUITE("graph_allocation") {

TEST_CASE("memory freed by a free node is reused only by allocations that depend on it") {
  {
    pool p;
    captured_graph g = make_graph();
    graph_allocation x = add_allocation(g, p, MiB);
    REQUIRE(x);
    CHECK(x.size() == MiB);
    CHECK(x.graph() == g.get());
    const CUgraphNode xn = x.node();
    const CUgraphNode work = empty_node(g, {&xn, 1});  // stands for a kernel using x
    const CUgraphNode freed = add_free(g, x, {&work, 1});
    CHECK(g.graph_memory_holds() == 1);
    CHECK_THROWS_WITH_AS(add_free(g, x, {}), doctest::Contains("double free"), std::invalid_argument);

    graph_allocation unordered = add_allocation(g, p, MiB);  // not after the free
    CHECK_FALSE(overlaps(unordered.get(), MiB, x.get(), MiB));
    const CUgraphNode between = empty_node(g, {&freed, 1});
    graph_allocation later = add_allocation(g, p, MiB, {&between, 1});  // after it, through another node
    CHECK(later.get() == x.get());

    const graph_memory_statistics s = graph_memory(0);
    CHECK(s.graphs == 1);
    CHECK(s.reserved_current == 2 * MiB);  // x (reused by later) and unordered
    CHECK(s.used_current == s.reserved_current);
    CHECK(p.statistics().live_allocations == 0);  // graph memory is not live memory of the pool
  }
  REQUIRE(reaper_idle());  // nothing of this case is left for the reaper thread
}

TEST_CASE("host-time allocations stay clear of graph memory; a graph_allocation holds it past its graph") {
  {
    pool p;
    stream s;
    captured_graph g = make_graph();
    graph_allocation a = add_allocation(g, p, 4 * MiB);
    for (int i = 0; i < 16; ++i) {
      void* h = p.allocate(MiB, s.ref());
      CHECK_FALSE(overlaps(h, MiB, a.get(), 4 * MiB));
      p.deallocate(h, s.ref());
    }
    g.reset();  // the graph goes; `a` still holds the memory
    streamalloc_test::fake_quiesce();
    CHECK(graph_memory(0).reserved_current == 4 * MiB);
    CHECK(detail::graph_reaper::instance().outstanding() == 1);
    a.reset();
    REQUIRE(reaper_idle());
    CHECK(graph_memory(0).reserved_current == 0);
    CHECK(graph_memory(0).reserved_high == 4 * MiB);
    reset_graph_memory_high(0);
    CHECK(graph_memory(0).reserved_high == 0);
    // Never freed in the graph: an ordinary live allocation of the pool now, as a captured one.
    CHECK(p.statistics().live_allocations == 1);
  }
  REQUIRE(reaper_idle());  // nothing of this case is left for the reaper thread
}

TEST_CASE("an executable of a built graph: relaunch rules, and trim once it is gone") {
  {
    pool p({.release_threshold = SIZE_MAX});  // keeps free memory: only the trim gives it back
    stream s;
    void* kept = nullptr;
    {
      captured_graph g = make_graph();
      graph_allocation t = add_allocation(g, p, 8 * MiB);
      const CUgraphNode tn = t.node();
      (void)add_free(g, t, {&tn, 1});
      graph_allocation u = add_allocation(g, p, MiB);  // left live by each launch
      kept = u.get();
      graph_exec e(g);
      e.launch(s.ref());
      CHECK_THROWS_WITH_AS(e.launch(s.ref()), doctest::Contains("still live"), std::logic_error);
      p.deallocate(u.get(), s.ref());  // freed after the launch
      e.launch(s.ref());
      p.deallocate(u.get(), s.ref());
    }
    REQUIRE(reaper_idle());
    CHECK(graph_memory(0).graphs == 0);
    s.synchronize();
    const auto mapped = streamalloc_test::fake_live().mappings;
    trim_graph_memory(0);
    CHECK(streamalloc_test::fake_live().mappings < mapped);
    CHECK(p.statistics().reserved_current == 0);
    CHECK(p.find_allocation(kept) == std::nullopt);
  }
  REQUIRE(reaper_idle());  // nothing of this case is left for the reaper thread
}

TEST_CASE("memory allocated outside any graph, freed by a free node") {
  {
    pool p;
    stream s;
    void* h = p.allocate(MiB, s.ref());
    captured_graph g = make_graph();
    const CUgraphNode f = add_free(g, h, {});
    CHECK(f != nullptr);
    CHECK(p.statistics().live_allocations == 0);
    CHECK_THROWS_WITH_AS(p.deallocate(h, s.ref()), doctest::Contains("double free"), std::invalid_argument);
    graph_exec e(g);
    e.launch(s.ref());  // frees it
    g.reset();
    e.reset();
    REQUIRE(reaper_idle());
    s.synchronize();
    CHECK(p.statistics().graph_allocations == 0);
    CHECK(p.allocate(MiB, s.ref()) == h);  // launched and finished: free again
  }
  REQUIRE(reaper_idle());  // nothing of this case is left for the reaper thread
}

TEST_CASE("a capture's allocations as graph_allocations: found by address, outputs listed, held past the graph") {
  {
    pool p, q;
    stream s;
    void* outside = p.allocate(MiB, s.ref());
    cu::cuStreamBeginCapture(reinterpret_cast<CUstream>(s.get()), CU_STREAM_CAPTURE_MODE_GLOBAL);
    void* work = p.allocate(MiB, s.ref());
    void* out_p = p.allocate(2 * MiB + 100, s.ref());
    void* out_q = q.allocate(MiB, s.ref());
    p.deallocate(work, s.ref());     // freed in the graph: a workspace
    p.deallocate(outside, s.ref());  // allocated outside, freed by the graph: the pool's
    captured_graph g = end_capture(s.ref());

    graph_allocation w = allocation_of(g, work);
    CHECK(w.get() == work);
    CHECK(w.size() == MiB);
    CHECK(w.graph() == g.get());
    CHECK(w.node() == nullptr);
    CHECK(allocation_of(g, out_p).size() == 2 * MiB + 256);  // rounded to the 256-byte quantum
    CHECK_THROWS_WITH_AS((void)allocation_of(g, outside), doctest::Contains("not the start of an allocation"),
                         std::invalid_argument);
    CHECK_THROWS_AS((void)allocation_of(g, static_cast<char*>(out_p) + 256), std::invalid_argument);
    CHECK_THROWS_WITH_AS((void)allocation_of(captured_graph{}, work), doctest::Contains("empty"),
                         std::invalid_argument);
    captured_graph other = make_graph();
    graph_allocation theirs = add_allocation(other, p, MiB);
    CHECK_THROWS_AS((void)allocation_of(g, theirs.get()), std::invalid_argument);
    CHECK(allocation_of(other, theirs.get()).get() == theirs.get());  // made by hand: found too

    std::vector<graph_allocation> outs = unfreed_allocations(g);
    REQUIRE(outs.size() == 2);
    CHECK(outs[0].get() < outs[1].get());
    CHECK(((outs[0].get() == out_p && outs[1].get() == out_q) || (outs[0].get() == out_q && outs[1].get() == out_p)));
    CHECK(unfreed_allocations(other).size() == 1);

    // The owners hold the graph's memory of both pools once the graph is gone.
    g.reset();
    streamalloc_test::fake_quiesce();
    CHECK(p.statistics().graphs == 2);  // this graph's (held by w and outs) and other's
    CHECK(q.statistics().graphs == 1);
    w.reset();
    outs.clear();
    other.reset();
    theirs.reset();
    REQUIRE(reaper_idle());
    CHECK(p.statistics().graphs == 0);
    CHECK(q.statistics().graphs == 0);
    // Never freed in the graph: ordinary live allocations now, freed as any other.
    CHECK(p.find_allocation(out_p).has_value());
    p.deallocate(out_p, s.ref());
    q.deallocate(out_q, s.ref());
    CHECK(p.statistics().live_allocations == 1);  // theirs: left live by its graph, never freed
  }
  REQUIRE(reaper_idle());  // nothing of this case is left for the reaper thread
}

TEST_CASE("bad input is refused, naming what was wrong") {
  {
    pool p, q;
    captured_graph empty;
    CHECK_THROWS_WITH_AS((void)add_allocation(empty, p, MiB), doctest::Contains("empty"), std::invalid_argument);
    captured_graph g = make_graph();
    CHECK_THROWS_WITH_AS((void)add_allocation(g, p, 0), doctest::Contains("0 bytes"), std::invalid_argument);
    int on_host = 0;
    CHECK_THROWS_WITH_AS(add_free(g, &on_host, {}), doctest::Contains("not memory of a live streamalloc pool"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(add_free(g, nullptr, {}), doctest::Contains("null"), std::invalid_argument);
    captured_graph other = make_graph();
    graph_allocation theirs = add_allocation(other, q, MiB);
    CHECK_THROWS_WITH_AS(add_free(g, theirs, {}), doctest::Contains("another graph"), std::invalid_argument);
    // A dependency from another graph: the driver refuses the node, nothing is allocated.
    const CUgraphNode foreign = theirs.node();
    CHECK_THROWS_AS((void)add_allocation(g, p, MiB, {&foreign, 1}), cuda_error);
    CHECK(p.statistics().graph_allocations == 0);
    pool moved_from;
    pool taken(std::move(moved_from));
    CHECK_THROWS_AS((void)add_allocation(g, moved_from, MiB), pool_closed);
  }
  REQUIRE(reaper_idle());  // nothing of this case is left for the reaper thread
}

TEST_CASE("the wait at exit: a graph let go just before is taken back, one still held costs a short wait") {
  // What the process's exit handler does (graph_reaper::drain): without it, a program that
  // drops its last graph and returns from main exits while the reaper thread still unmaps the
  // graph's memory (compute-sanitizer counted such memory as leaked on the GPU).
  auto& reaper = detail::graph_reaper::instance();
  using clock = std::chrono::steady_clock;
  using std::chrono::milliseconds;
  {
    pool p;
    captured_graph g = make_graph();
    graph_allocation a = add_allocation(g, p, 4 * MiB);
    // Still held: the wait gives up once nothing has ended for `quiet`, well before `jobs`.
    const auto t0 = clock::now();
    CHECK_FALSE(reaper.drain({.jobs = milliseconds(5000), .quiet = milliseconds(30)}));
    const auto waited = clock::now() - t0;
    CHECK(waited >= milliseconds(30));
    CHECK(waited < milliseconds(2000));
    CHECK(reaper.outstanding() == 1);
    CHECK(graph_memory(0).reserved_current == 4 * MiB);
    // Let go: no fake_quiesce here, the user object's end comes from the driver's thread.
    a.reset();
    g.reset();
    CHECK(reaper.drain());
    CHECK(reaper.outstanding() == 0);
    CHECK(graph_memory(0).reserved_current == 0);
  }
  REQUIRE(reaper_idle());
}

}  // TEST_SUITE

// Peer devices of graph memory against the fake driver (three devices, device 2 nobody's
// peer): the access descriptors of a hand-built allocation (add_allocation's `access`), the
// pool's access that a captured allocation keeps (spec 003: an allocation node records the
// pool's access of capture time), what the driver holds on each mapping while the pool's own
// access changes and after the graph's memory moves onto a stream's shared pages, and the
// refusals. The GPU test (tests/gpu/peer_access_test.cu) runs kernels of the peer on it.

#include <streamalloc/access.hpp>
#include <streamalloc/captured_graph.hpp>
#include <streamalloc/graph_allocation.hpp>
#include <streamalloc/graph_exec.hpp>
#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include <doctest/doctest.h>

#include "fake_driver.hpp"

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <thread>

using namespace streamalloc;
namespace cu = streamalloc::detail::cu;
using streamalloc_test::fake_live;
using streamalloc_test::fake_mappings_with_access;
using streamalloc_test::MiB;
using streamalloc_test::reaper_idle;

namespace {

constexpr access_descriptor device1_rw{memory_location::device(1), access_flags::read_write};

/// Chunks of one granule, every free memory kept: what is mapped is what the test asks for.
pool_properties peers_pool() {
  pool_properties p;
  p.location = memory_location::device(0);
  p.chunk_size = 2 * MiB;
  p.release_threshold = SIZE_MAX;
  return p;
}

access_flags device_access(int device, const void* p, std::size_t offset = 0) {
  return get_access(memory_location::device(device), reinterpret_cast<CUdeviceptr>(p) + offset);
}

}  // namespace

TEST_SUITE("graph_peers") {

TEST_CASE("an allocation node's peers get read-write access to the graph's memory, whatever the pool's access") {
  pool p0(peers_pool());
  stream s0(0);
  void* host_time = p0.allocate(2 * MiB, s0);  // memory of the pool's timeline: no peers
  {
    captured_graph g = make_graph();
    graph_allocation a = add_allocation(g, p0, 3 * MiB, {}, {&device1_rw, 1});
    CHECK(device_access(1, a.get()) == access_flags::read_write);
    CHECK(device_access(1, a.get(), a.size() - 1) == access_flags::read_write);
    CHECK(device_access(0, a.get()) == access_flags::read_write);
    CHECK(device_access(2, a.get()) == access_flags::none);
    CHECK(device_access(1, host_time) == access_flags::none);
    CHECK(p0.access(memory_location::device(1)) == access_flags::none);  // the pool's own is unchanged

    // The pool grants device 1 and revokes it: the graph's memory keeps what its node asked.
    p0.set_access(memory_location::device(1), access_flags::read_write);
    CHECK(device_access(1, host_time) == access_flags::read_write);
    p0.set_access(memory_location::device(1), access_flags::read);
    CHECK(device_access(1, host_time) == access_flags::read);
    CHECK(device_access(1, a.get()) == access_flags::read_write);
    p0.set_access(memory_location::device(1), access_flags::none);
    CHECK(device_access(1, host_time) == access_flags::none);
    CHECK(device_access(1, a.get()) == access_flags::read_write);

    // A later allocation of the graph in a new piece has it too: the grant is the graph's.
    graph_allocation b = add_allocation(g, p0, 6 * MiB);
    CHECK(device_access(1, b.get()) == access_flags::read_write);
    CHECK(device_access(1, b.get(), b.size() - 1) == access_flags::read_write);
    CHECK(device_access(1, host_time) == access_flags::none);
  }
  REQUIRE(reaper_idle());
  CHECK(p0.statistics().graphs == 0);
  // The graph is gone: its pieces are the pool's free memory, and the pool's access governs
  // them again (they kept device 1's access until the pool changed it: more than asked, never less).
  p0.set_access(memory_location::device(1), access_flags::read_write);
  p0.set_access(memory_location::device(1), access_flags::none);
  CHECK(fake_mappings_with_access(1, CU_MEM_ACCESS_FLAGS_PROT_NONE) == fake_live().mappings);
  p0.deallocate(host_time, s0);
}

TEST_CASE("a captured allocation keeps the pool's access of capture time") {
  pool p0(peers_pool());
  stream s0(0);
  p0.set_access(memory_location::device(1), access_flags::read_write);
  cu::cuStreamBeginCapture(streamalloc_test::handle(s0), CU_STREAM_CAPTURE_MODE_GLOBAL);
  void* captured = p0.allocate(3 * MiB, s0);
  captured_graph g = end_capture(s0.ref());
  p0.set_access(memory_location::device(1), access_flags::none);
  CHECK(device_access(1, captured) == access_flags::read_write);
  // Captured now, the pool grants device 1 nothing: nor does the new graph.
  cu::cuStreamBeginCapture(streamalloc_test::handle(s0), CU_STREAM_CAPTURE_MODE_GLOBAL);
  void* later = p0.allocate(3 * MiB, s0);
  captured_graph h = end_capture(s0.ref());
  CHECK(device_access(1, later) == access_flags::none);
  CHECK(device_access(1, captured) == access_flags::read_write);
  g.reset();
  h.reset();
  REQUIRE(reaper_idle());
  // Left live by their graphs: ordinary allocations now, freed on the pool's stream.
  p0.deallocate(captured, s0);
  p0.deallocate(later, s0);
}

TEST_CASE("the graph's peers follow its memory onto a stream's shared pages") {
  pool p0(peers_pool());
  stream s0(0);
  captured_graph g = make_graph();
  graph_allocation a = add_allocation(g, p0, 4 * MiB, {}, {&device1_rw, 1});
  const CUgraphNode an = a.node();
  (void)add_free(g, a, {&an, 1});
  void* const addr = a.get();
  a.reset();
  graph_exec exec(g);
  g.reset();  // the executable alone holds the graph's memory: it may share pages
  const int maps_before = fake_live().mappings;
  // The graph's user object goes on streamalloc's thread: a launch finding it still there
  // leaves the memory where it is, a later one moves it, granule by granule onto the pages.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (fake_live().mappings == maps_before && std::chrono::steady_clock::now() < until) {
    exec.launch(s0.ref());
    (void)s0.synchronize();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  REQUIRE(fake_live().mappings == maps_before + 1);  // one 4 MiB mapping became two of 2 MiB
  CHECK(p0.statistics().graph_reserved_current == 4 * MiB);
  for (std::size_t at = 0; at < 4 * MiB; at += 2 * MiB) {
    CHECK(device_access(1, addr, at) == access_flags::read_write);
    CHECK(device_access(2, addr, at) == access_flags::none);
  }
  // The pool revokes a grant it never made: the graph's pages keep theirs.
  p0.set_access(memory_location::device(1), access_flags::read_write);
  p0.set_access(memory_location::device(1), access_flags::none);
  CHECK(device_access(1, addr) == access_flags::read_write);
  exec.reset();
  REQUIRE(reaper_idle());
  CHECK(p0.statistics().graphs == 0);
}

TEST_CASE("bad access descriptors are refused before the pool gives anything, naming what was wrong") {
  pool p0(peers_pool());
  {
    captured_graph g = make_graph();
    const access_descriptor host{memory_location::host(), access_flags::read_write};
    const access_descriptor read1{memory_location::device(1), access_flags::read};
    const access_descriptor none1{memory_location::device(1), access_flags::none};
    const access_descriptor not_peer{memory_location::device(2), access_flags::read_write};
    const access_descriptor missing{memory_location::device(7), access_flags::read_write};
    CHECK_THROWS_WITH_AS((void)add_allocation(g, p0, MiB, {}, {&host, 1}), doctest::Contains("are devices"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS((void)add_allocation(g, p0, MiB, {}, {&read1, 1}), doctest::Contains("read_write only"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS((void)add_allocation(g, p0, MiB, {}, {&none1, 1}), doctest::Contains("read_write only"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS((void)add_allocation(g, p0, MiB, {}, {&not_peer, 1}),
                         doctest::Contains("device 2 cannot access the memory of device 0"), not_supported);
    CHECK_THROWS_WITH_AS((void)add_allocation(g, p0, MiB, {}, {&missing, 1}), doctest::Contains("no device 7"),
                         std::invalid_argument);
    CHECK(g.graph_memory_holds() == 0);
    CHECK(p0.statistics().graph_reserved_current == 0);
    // The pool's own device may be named: it has access anyway, and nothing more is granted.
    const access_descriptor own{memory_location::device(0), access_flags::read_write};
    graph_allocation a = add_allocation(g, p0, MiB, {}, {&own, 1});
    CHECK(g.graph_memory_holds() == 1);
    CHECK(device_access(0, a.get()) == access_flags::read_write);
    CHECK(device_access(1, a.get()) == access_flags::none);
  }
  // The graph's memory goes back on the reaper's thread: waited for here, so that the process
  // never exits (the last test) while that thread still unmaps in the driver.
  REQUIRE(reaper_idle());
  CHECK(p0.statistics().graphs == 0);
}

}  // TEST_SUITE

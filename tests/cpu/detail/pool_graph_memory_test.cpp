// The pool core's graph memory on a simulated device: a graph's allocations in pieces of its
// own, and graphs launched into one stream sharing physical pages (pool_graph_memory.hpp).

#include <streamalloc/detail/core/pool_core.hpp>

#include <doctest/doctest.h>

#include "sim_backend.hpp"
#include "test_streams.hpp"

#include <cstdint>
#include <set>
#include <vector>

using namespace streamalloc::detail;
using streamalloc_test::sim_backend;
using streamalloc_test::sim_device;

namespace {
constexpr std::uint64_t MiB = 1ull << 20;
using core = pool_core<sim_backend>;
using test_support::make_stream;
using test_support::test_stream;

struct fixture {
  std::shared_ptr<sim_device> dev = std::make_shared<sim_device>();
  std::unique_ptr<core> pool;
  test_stream host = make_stream();
  test_stream s = make_stream();  // the stream every capture below is made on
  int waits = 0;                  // launches waited for before memory moved
  explicit fixture(core_options o = {}) {
    o.address_space = 64ull << 30;
    pool = std::make_unique<core>(sim_backend{dev}, o);
    host.record->mark_completed(~std::uint64_t{0} >> 1);
  }
  ~fixture() { pool->shutdown(); }

  /// A graph (capture `id`) allocating `bytes` in blocks of `block` and freeing them all, as a
  /// workspace; returns the blocks' addresses.
  std::vector<std::uint64_t> workspace_graph(std::uint64_t id, std::uint64_t bytes, std::uint64_t block = 8 * MiB) {
    std::vector<std::uint64_t> out;
    for (std::uint64_t at = 0; at < bytes; at += block) {
      out.push_back(pool->allocate_captured(block, id, s.record->id(), 0, [] {}));
    }
    for (auto p : out) free_in(id, p);
    return out;
  }
  void free_in(std::uint64_t id, std::uint64_t p) {
    const stream_key freer = s.key();
    pool->deallocate_captured(p, id, s.record->id(), host.key_without_handle(), &freer, [] {});
  }
  /// A launch of graph `id` into the stream with id `stream`, as graph_exec makes it.
  bool bind(std::uint64_t id, std::uint64_t stream, bool finished = true) {
    return pool->bind_graph_memory(id, stream, [&] {
      ++waits;
      return finished;
    });
  }
  /// The handle mapped under each granule of [p, p + n).
  std::vector<std::uint64_t> pages_under(std::uint64_t p, std::uint64_t n) const {
    std::vector<std::uint64_t> out;
    for (std::uint64_t at = p; at < p + n; at += dev->granularity) {
      const auto it = dev->mapped_handle.find(at);
      out.push_back(it == dev->mapped_handle.end() ? 0 : it->second);
    }
    return out;
  }
  std::uint64_t graph_bytes() { return pool->statistics().graph_reserved_current; }
  void release(std::uint64_t id) { pool->release_graph(id, host.key_without_handle()); }
};
}  // namespace

TEST_CASE("graphs launched into one stream share pages: K graphs hold the largest one's memory") {
  fixture f;
  const auto a = f.workspace_graph(1, 64 * MiB);
  const auto b = f.workspace_graph(2, 64 * MiB);
  const auto c = f.workspace_graph(3, 32 * MiB);
  CHECK(f.graph_bytes() == 160 * MiB);  // each with memory of its own, until launched
  const auto held_before = f.pool->statistics().reserved_current;
  f.bind(1, 100);
  f.bind(2, 100);
  f.bind(3, 100);
  CHECK(f.waits == 3);  // each waited for its last launch before its memory moved
  CHECK(f.graph_bytes() == 64 * MiB);
  CHECK(f.pool->statistics().reserved_current == held_before - 96 * MiB);
  // Granule i of each graph is the same page: the addresses differ, the memory does not.
  const auto pa = f.pages_under(a.front(), 64 * MiB);
  const auto pb = f.pages_under(b.front(), 64 * MiB);
  const auto pc = f.pages_under(c.front(), 32 * MiB);
  CHECK(pa == pb);
  CHECK(std::equal(pc.begin(), pc.end(), pa.begin()));
  CHECK(std::set<std::uint64_t>(pa.begin(), pa.end()).size() == pa.size());  // no page twice in a graph
  CHECK(std::count(pa.begin(), pa.end(), 0) == 0);
  CHECK(a.front() != b.front());
  // Launching into the same stream again: nothing to wait for, nothing mapped.
  const auto maps = f.dev->maps;
  f.bind(2, 100);
  CHECK(f.waits == 3);
  CHECK(f.dev->maps == maps);
  // The largest goes: the pages shrink to what the others map.
  f.release(1);
  CHECK(f.graph_bytes() == 64 * MiB);
  f.release(2);
  CHECK(f.graph_bytes() == 32 * MiB);
  CHECK(f.pages_under(c.front(), 32 * MiB) == pc);
  f.release(3);
  CHECK(f.graph_bytes() == 0);
  CHECK(f.pool->statistics().graphs == 0);
  for (auto p : a) CHECK_FALSE(f.dev->is_mapped(p, 8 * MiB));  // the pieces left the pool
  // The addresses are the pool's again, and it serves ordinary allocations as before.
  const auto h = f.pool->allocate(128 * MiB, f.s.key());
  CHECK(f.dev->is_mapped(h, 128 * MiB));
  f.pool->deallocate(h, f.s.key());
}

TEST_CASE("a graph launched into another stream moves to that stream's pages once its last launch is done") {
  fixture f;
  const auto a = f.workspace_graph(1, 16 * MiB);
  const auto b = f.workspace_graph(2, 16 * MiB);
  f.bind(1, 100);
  f.bind(2, 100);
  CHECK(f.pages_under(a.front(), 16 * MiB) == f.pages_under(b.front(), 16 * MiB));
  SUBCASE("moved") {
    f.bind(2, 200);
    CHECK(f.waits == 3);
    // Graphs that may now run at once never share a page.
    const auto pa = f.pages_under(a.front(), 16 * MiB), pb = f.pages_under(b.front(), 16 * MiB);
    for (auto page : pb) CHECK(std::find(pa.begin(), pa.end(), page) == pa.end());
    CHECK(f.graph_bytes() == 32 * MiB);
    f.bind(2, 100);  // back: the second stream's pages go, as no graph maps them
    CHECK(f.pages_under(a.front(), 16 * MiB) == f.pages_under(b.front(), 16 * MiB));
    CHECK(f.graph_bytes() == 16 * MiB);
  }
  SUBCASE("its last launch not known finished: it stays where it is") {
    const auto before = f.pages_under(b.front(), 16 * MiB);
    f.bind(2, 200, /*finished=*/false);
    CHECK(f.pages_under(b.front(), 16 * MiB) == before);
    CHECK(f.graph_bytes() == 16 * MiB);
  }
  f.release(1);
  f.release(2);
  CHECK(f.graph_bytes() == 0);
}

TEST_CASE("a graph whose allocations outlive a launch keeps memory of its own") {
  fixture f;
  const auto shared = f.workspace_graph(1, 16 * MiB);
  const auto kept = f.pool->allocate_captured(8 * MiB, 2, f.s.record->id(), 0, [] {});
  const auto freed = f.pool->allocate_captured(8 * MiB, 2, f.s.record->id(), 0, [] {});
  f.free_in(2, freed);
  f.bind(1, 100);
  const auto own = f.pages_under(kept, 16 * MiB);
  f.bind(2, 100);
  f.bind(2, 100);
  CHECK(f.pages_under(kept, 16 * MiB) == own);  // nothing moved, and it was asked only once
  CHECK(f.waits == 1);
  CHECK(f.graph_bytes() == 32 * MiB);
  // Its unfreed allocation becomes an ordinary live one when the graph goes, and the rest of
  // its memory the pool's free memory.
  f.release(2);
  CHECK(f.dev->is_mapped(kept, 8 * MiB));
  CHECK(f.pool->find_live(kept).has_value());
  f.pool->deallocate(kept, f.s.key());
  f.release(1);
  CHECK(f.graph_bytes() == 0);
  (void)shared;
}

TEST_CASE("a graph's allocations take a free chunk of the pool where it lies, and a piece at least as large as it has") {
  core_options o;
  o.chunk_size = 2 * MiB;
  o.own_chunk_for_large = false;
  fixture f(o);
  // 6 MiB of free pool memory, in whole chunks of 2 MiB.
  const auto p = f.pool->allocate(6 * MiB, f.s.key());
  f.pool->deallocate(p, f.host.key_without_handle());
  const auto creates = f.dev->creates;
  const auto maps = f.dev->maps;
  const auto g = f.pool->allocate_captured(MiB, 1, f.s.record->id(), 0, [] {});
  CHECK(f.dev->maps == maps);  // taken in place: no driver call
  CHECK(f.dev->creates == creates);
  CHECK(f.graph_bytes() == 2 * MiB);
  // The next piece is at least as large as what the graph has: few pieces for large graphs.
  const auto creates_now = f.dev->creates;
  (void)f.pool->allocate_captured(3 * MiB, 1, f.s.record->id(), 0, [] {});
  CHECK(f.graph_bytes() == 6 * MiB);  // the two other free chunks are too small for 3 MiB: new memory
  CHECK(f.dev->creates == creates_now + 1);
  // Host-time allocations never get the graph's memory.
  const auto h = f.pool->allocate(MiB, f.host.key_without_handle());
  CHECK((h + MiB <= g || g + MiB <= h));
  f.pool->deallocate(h, f.host.key_without_handle());
  f.release(1);
  CHECK(f.graph_bytes() == 0);
}

TEST_CASE("the device refuses to move a graph's memory and to put it back: the graph is lost, and says so") {
  // Moving a graph's memory unmaps it first; when mapping it at the new place is refused (the
  // device short of memory), it is mapped back where it was, and that may be refused too.
  // Then nothing is mapped under the graph's allocations: it must not run (the bind says so),
  // a later bind may map it, and its release must not unmap what is not mapped.
  fixture f;
  const auto a = f.workspace_graph(1, 16 * MiB);  // two pieces of 8 MiB, 8 granules
  const auto creates = f.dev->creates;
  auto refuse_from_fourth_map = [&] {
    f.dev->maps_before_refusal = 3;
    f.dev->refuse_maps = 1000;
  };
  auto nothing_mapped = [&] {
    for (auto page : f.pages_under(a.front(), 16 * MiB)) CHECK(page == 0);
  };
  SUBCASE("from its own memory") {
    refuse_from_fourth_map();
    CHECK_FALSE(f.bind(1, 100));
    nothing_mapped();
    CHECK(f.graph_bytes() == 0);  // its own memory and the stream's new pages went back
    CHECK(f.pool->statistics().reserved_current == 0);
    CHECK(f.dev->handles.empty());
    CHECK(f.dev->creates == creates + 8);  // the stream's eight pages, made and given back
    SUBCASE("bound again once the device has memory: mapped on the stream's pages") {
      f.dev->refuse_maps = 0;
      CHECK(f.bind(1, 100));
      for (auto page : f.pages_under(a.front(), 16 * MiB)) CHECK(page != 0);
      CHECK(f.graph_bytes() == 16 * MiB);
      CHECK(f.bind(1, 100));  // already there
    }
    SUBCASE("refused again: still lost") {
      f.dev->maps_before_refusal = 0;
      CHECK_FALSE(f.bind(1, 100));
      nothing_mapped();
      CHECK(f.graph_bytes() == 0);
      f.dev->refuse_maps = 0;
    }
    SUBCASE("an unknown stream: nothing moves, and the graph is still lost") {
      f.dev->refuse_maps = 0;
      CHECK_FALSE(f.bind(1, 0));
      nothing_mapped();
    }
  }
  SUBCASE("from another stream's pages") {
    CHECK(f.bind(1, 100));
    refuse_from_fourth_map();
    CHECK_FALSE(f.bind(1, 200));
    nothing_mapped();
    CHECK(f.graph_bytes() == 0);  // both streams' pages went back: no graph maps them
    f.dev->refuse_maps = 0;
  }
  f.dev->refuse_maps = 0;
  f.release(1);  // unmaps only what is mapped (the simulated device aborts on anything else)
  CHECK(f.graph_bytes() == 0);
  CHECK(f.pool->statistics().reserved_current == 0);
  CHECK(f.pool->addresses_consistent());
  const auto h = f.pool->allocate(128 * MiB, f.s.key());
  CHECK(f.dev->is_mapped(h, 128 * MiB));
  f.pool->deallocate(h, f.s.key());
}

TEST_CASE("putting a graph's memory back is refused part-way: what went back is unmapped again, nothing is lost") {
  // The move fails at its fourth mapping; putting back then succeeds for a while and is refused
  // at the `back`-th mapping: what it mapped again is unmapped, and every handle goes back.
  fixture f;
  const auto a = f.workspace_graph(1, 16 * MiB);  // two pieces of 8 MiB: 8 granules
  std::uint64_t calls = 0, back = 0;
  auto refuse_fourth_and_from_back = [&] {
    calls = 0;
    f.dev->refuse_map = [&] {
      ++calls;
      return calls == 4 || calls >= 4 + back;
    };
  };
  SUBCASE("from its own memory: the first piece goes back, the second is refused") {
    back = 2;  // the 5th mapping (piece 0) succeeds, the 6th (piece 1) is refused
    refuse_fourth_and_from_back();
    CHECK_FALSE(f.bind(1, 100));
    CHECK(calls == 6);
  }
  SUBCASE("from another stream's pages: five granules go back, the sixth is refused") {
    REQUIRE(f.bind(1, 100));
    back = 6;  // the 5th to 9th mappings (granules 0 to 4) succeed, the 10th is refused
    refuse_fourth_and_from_back();
    CHECK_FALSE(f.bind(1, 200));
    CHECK(calls == 10);
  }
  f.dev->refuse_map = nullptr;
  for (auto page : f.pages_under(a.front(), 16 * MiB)) CHECK(page == 0);
  CHECK(f.dev->mapped.empty());   // the pool held nothing else
  CHECK(f.dev->handles.empty());  // own memory and every stream's pages went back
  CHECK(f.graph_bytes() == 0);
  CHECK(f.pool->statistics().reserved_current == 0);
  CHECK(f.bind(1, 300));  // the device has memory again: mapped on that stream's pages
  for (auto page : f.pages_under(a.front(), 16 * MiB)) CHECK(page != 0);
  CHECK(f.graph_bytes() == 16 * MiB);
  f.release(1);
  CHECK(f.dev->handles.empty());
  CHECK(f.pool->addresses_consistent());
}

TEST_CASE("a pool's max_size holds while a graph's memory moves onto a stream's pages") {
  // The pages are made before the graph's own memory goes: a move that would take the pool
  // above its limit is not made, and the graph stays on its own memory, which is correct.
  core_options o;
  o.max_size = 24 * MiB;
  fixture f(o);
  const auto a = f.workspace_graph(1, 16 * MiB);
  const auto own = f.pages_under(a.front(), 16 * MiB);
  CHECK(f.bind(1, 100));  // 16 MiB held and 16 MiB of pages would be 32 MiB
  CHECK(f.pages_under(a.front(), 16 * MiB) == own);
  CHECK(f.graph_bytes() == 16 * MiB);
  CHECK(f.pool->statistics().reserved_high <= 24 * MiB);
  f.release(1);
  CHECK(f.graph_bytes() == 0);
}

TEST_CASE("with room under max_size, the same graph moves onto the pages") {
  core_options o;
  o.max_size = 32 * MiB;
  fixture f(o);
  const auto a = f.workspace_graph(1, 16 * MiB);
  const auto own = f.pages_under(a.front(), 16 * MiB);
  CHECK(f.bind(1, 100));
  CHECK(f.pages_under(a.front(), 16 * MiB) != own);
  CHECK(f.graph_bytes() == 16 * MiB);
  CHECK(f.pool->statistics().reserved_high == 32 * MiB);  // both, for the moment of the move
  f.release(1);
}

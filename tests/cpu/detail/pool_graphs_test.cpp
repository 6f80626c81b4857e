// The pool core's graphs section on a simulated device: what a capture's graph holds, in-graph
// reuse, host-time frees of graph memory, and what comes back when the graph is gone.

#include <streamalloc/detail/core/pool_core.hpp>

#include <doctest/doctest.h>

#include "sim_backend.hpp"
#include "test_streams.hpp"

#include <stdexcept>
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
  test_stream host = make_stream();  // the host pseudo-stream: its frees are complete when made
  int ties = 0;
  explicit fixture(core_options o = {}) {
    o.address_space = 64ull << 30;
    pool = std::make_unique<core>(sim_backend{dev}, o);
    host.record->mark_completed(~std::uint64_t{0} >> 1);
  }
  ~fixture() { pool->shutdown(); }

  std::uint64_t captured(std::uint64_t n, std::uint64_t capture, const test_stream& s) {
    return pool->allocate_captured(n, capture, s.record->id(), 0, [&] { ++ties; });
  }
  /// A free captured on `s`; `known`: the pool is given `s`'s record (a `stream`'s reference).
  void captured_free(std::uint64_t p, std::uint64_t capture, const test_stream& s, bool known = true) {
    const stream_key freer = s.key();
    pool->deallocate_captured(p, capture, s.record->id(), host.key_without_handle(), known ? &freer : nullptr,
                              [&] { ++ties; });
  }
  void release(std::uint64_t capture) { pool->release_graph(capture, host.key_without_handle()); }
};

bool overlaps(std::uint64_t a, std::uint64_t an, std::uint64_t b, std::uint64_t bn) { return a < b + bn && b < a + an; }
}  // namespace

TEST_CASE("a capture never gets memory freed on the stream and still pending; it is tied to its graph once") {
  fixture f;
  auto s = make_stream();
  const auto cached = f.pool->allocate(MiB, s.key());
  f.pool->deallocate(cached, s.key());  // in s's fast cache: s itself would reuse it at once
  const auto g = f.captured(MiB, 1, s);
  CHECK(g != cached);
  CHECK(f.ties == 1);
  const auto g2 = f.captured(4096, 1, s);
  CHECK(f.ties == 1);  // one segment per capture
  CHECK_FALSE(overlaps(g, MiB, g2, 4096));
  CHECK(f.pool->allocate(MiB, s.key()) == cached);  // the stream's own reuse is unchanged
  const auto st = f.pool->statistics();
  CHECK(st.graphs == 1);
  CHECK(st.graph_allocations == 2);
  CHECK(st.graph_reserved_current == 2 * MiB);  // one piece of the graph's own: both fit
  CHECK(st.live_allocations == 1);
  CHECK(st.used_current == MiB);
}

TEST_CASE("a free in the capture makes the block reusable by the capture on that stream only") {
  fixture f;
  auto s = make_stream(), t = make_stream();
  const auto a = f.captured(MiB, 7, s);
  f.captured_free(a, 7, s);
  CHECK(f.captured(MiB, 7, s) == a);  // after the free, on its stream
  f.captured_free(a, 7, s);
  CHECK(f.captured(MiB, 7, t) != a);  // another stream of the capture is not ordered after it
  CHECK(f.captured(MiB, 8, s) != a);  // nor is another capture
  CHECK(f.captured(16 * 256, 7, s) != a);  // far smaller: no waste of the larger block
  CHECK(f.captured(MiB, 7, s) == a);
}

TEST_CASE("host-time allocations never get a graph's memory while the graph lives") {
  fixture f;
  auto s = make_stream(), other = make_stream();
  std::vector<std::uint64_t> graph;
  for (int i = 0; i < 8; ++i) graph.push_back(f.captured(MiB, 3, s));
  for (auto g : graph) f.captured_free(g, 3, s);  // freed in the graph: still the graph's
  for (int i = 0; i < 64; ++i) {
    const auto h = f.pool->allocate(MiB, other.key());
    for (auto g : graph) CHECK_FALSE(overlaps(h, MiB, g, MiB));
    f.pool->deallocate(h, other.key());
    const auto sync = f.pool->allocate(MiB, f.host.key_without_handle());
    for (auto g : graph) CHECK_FALSE(overlaps(sync, MiB, g, MiB));
  }
  f.pool->trim_to(0);  // releasing free memory never takes the graph's
  for (auto g : graph) CHECK(f.dev->is_mapped(g, MiB));
  f.release(3);
  CHECK(f.pool->statistics().graphs == 0);
  CHECK(f.pool->statistics().graph_reserved_current == 0);
  CHECK(f.pool->statistics().graph_reserved_high == 8 * MiB);
}

TEST_CASE("when the graph goes: freed blocks come back, unfreed ones stay live, ones freed after a launch follow their stream") {
  core_options o;
  o.reuse = {false, false, false};  // no reuse across streams without proof
  fixture f(o);
  auto s = make_stream(), freer = make_stream(), stranger = make_stream();
  const auto freed = f.captured(MiB, 5, s);
  const auto unfreed = f.captured(2 * MiB, 5, s);
  const auto after = f.captured(4 * MiB, 5, s);
  f.captured_free(freed, 5, s);
  // Host-time frees after a launch: allowed once per launch; the graph keeps the block.
  f.pool->deallocate(after, freer.key());
  f.pool->deallocate(after, freer.key());
  CHECK(f.pool->statistics().graph_allocations == 3);
  const auto live_before = f.pool->statistics().live_allocations;
  f.release(5);
  CHECK(f.pool->statistics().live_allocations == live_before + 1);
  CHECK(f.pool->find_live(unfreed + 100) == std::optional(std::pair{unfreed, 2 * MiB}));
  f.pool->deallocate(unfreed, s.key());  // an ordinary free now
  CHECK_THROWS_AS(f.pool->deallocate(unfreed, s.key()), std::invalid_argument);
  // `after` is pending on `freer` (not clear): a stream with no proof does not get it.
  CHECK(f.pool->statistics().free_pending >= 4 * MiB);
  for (int i = 0; i < 4; ++i) CHECK_FALSE(overlaps(f.pool->allocate(MiB, stranger.key()), MiB, after, 4 * MiB));
}

TEST_CASE("memory allocated outside a capture and freed inside it becomes the graph's") {
  fixture f;
  auto s = make_stream(), t = make_stream();
  const auto h = f.pool->allocate(MiB, t.key());
  CHECK(f.pool->statistics().live_allocations == 1);
  f.captured_free(h, 9, s);
  CHECK(f.ties == 1);
  CHECK(f.pool->statistics().live_allocations == 0);
  CHECK(f.pool->statistics().graph_allocations == 1);
  CHECK_THROWS_WITH_AS(f.pool->deallocate(h, t.key()), doctest::Contains("double free"), std::invalid_argument);
  CHECK_THROWS_AS(f.captured_free(h, 9, s), std::invalid_argument);
  CHECK(f.pool->allocate(MiB, t.key()) != h);
  SUBCASE("a launched graph freed it: clear when the graph goes") {
    f.dev->busy.insert(s.native);  // whatever s still runs, the launch's free came after the uses
    f.pool->graph_launched(9);
    f.release(9);
    CHECK(f.pool->statistics().graph_allocations == 0);
    CHECK_FALSE(f.pool->frees_in_flight());  // nothing left counted on s
    CHECK(f.pool->allocate(MiB, t.key()) == h);
  }
  SUBCASE("never launched: work enqueued on the capturing stream before the capture may use it") {
    f.dev->busy.insert(s.native);  // that work has not run
    f.release(9);
    CHECK(f.pool->statistics().graph_allocations == 0);
    CHECK(f.pool->statistics().free_pending == MiB);  // pending on s, not clear
    CHECK(f.pool->frees_in_flight());                 // closing the pool would wait for the device
    CHECK(f.pool->allocate(MiB, t.key()) != h);
    f.dev->run(s.native);  // it ran: the event the pool recorded on s (the capture is over) passed
    CHECK_FALSE(f.pool->frees_in_flight());
    CHECK(f.pool->allocate(MiB, t.key()) == h);
  }
}

TEST_CASE("memory adopted on a stream the pool cannot name waits for a device-wide synchronization") {
  fixture f;
  auto s = make_stream(), t = make_stream();
  const auto h = f.pool->allocate(MiB, t.key());
  f.captured_free(h, 9, s, /*known=*/false);
  const auto syncs_before = ordering().device_syncs_begun(0);
  f.release(9);
  CHECK(f.pool->statistics().graph_allocations == 0);
  CHECK(f.pool->statistics().free_pending == MiB);
  CHECK(f.pool->frees_in_flight());
  f.pool->on_synchronize(0);  // no device-wide synchronization began since: still held
  CHECK(f.pool->allocate(MiB, t.key()) != h);
  // One that began before the release does not count either.
  ordering().end_device_sync(0, syncs_before);
  f.pool->on_synchronize(0);
  CHECK(f.pool->allocate(MiB, t.key()) != h);
  const auto sync = ordering().begin_device_sync(0);
  ordering().end_device_sync(0, sync);
  f.pool->on_synchronize(0);
  CHECK_FALSE(f.pool->frees_in_flight());
  CHECK(f.pool->allocate(MiB, t.key()) == h);
}

TEST_CASE("a stream retired while a graph holds a block it freed keeps its state until the graph goes") {
  fixture f;
  auto s = make_stream(), freer = make_stream();
  const auto g = f.captured(MiB, 6, s);
  f.pool->deallocate(g, freer.key());  // after a launch (not seen: a raw one), freed on `freer`
  f.pool->deallocate(g, freer.key());  // freed again after another raw launch: the newer free counts
  f.dev->busy.insert(freer.native);  // the work the free is ordered after has not run
  f.pool->on_retire(freer.record->id(), true);  // the stream's last moment: an event covers the free
  f.release(6);
  // Pending on the retired stream, whose state stayed for it: not clear yet.
  CHECK(f.pool->statistics().free_pending >= MiB);  // with the clear rest of its chunk
  f.dev->run(freer.native);
  f.pool->trim_to(0);  // polls that event
  CHECK(f.pool->statistics().free_pending == 0);
}

TEST_CASE("bad frees under capture change nothing and say what was wrong") {
  fixture f;
  auto s = make_stream();
  const auto a = f.captured(MiB, 1, s);
  const auto b = f.captured(MiB, 2, s);
  f.captured_free(a, 1, s);
  CHECK_THROWS_WITH_AS(f.captured_free(a, 1, s), doctest::Contains("double free"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(f.captured_free(b, 1, s), doctest::Contains("another graph"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(f.pool->deallocate(a, s.key()), doctest::Contains("freed inside"), std::invalid_argument);
  CHECK_THROWS_AS(f.captured_free(0x1000, 1, s), std::invalid_argument);
  CHECK_THROWS_AS(f.captured_free(b + 256, 2, s), std::invalid_argument);  // inside, not at the start
  CHECK(f.pool->statistics().graph_allocations == 2);
  f.captured_free(b, 2, s);  // still possible after the refusals
}

TEST_CASE("a tie that fails leaves no segment, and the next call ties again") {
  fixture f;
  auto s = make_stream();
  CHECK_THROWS_AS(f.pool->allocate_captured(MiB, 4, s.record->id(), 0, [] { throw std::runtime_error("no user object"); }),
                  std::runtime_error);
  CHECK(f.pool->statistics().graphs == 0);
  CHECK(f.pool->statistics().graph_allocations == 0);
  CHECK(f.dev->creates == 0);  // nothing was allocated before the tie
  f.captured(MiB, 4, s);
  CHECK(f.ties == 1);
  CHECK(f.pool->graphs_alive() == 1);
  f.release(4);
  f.release(4);  // a second release (a stale tie) does nothing
  CHECK(f.pool->graphs_alive() == 0);
}

// The pool's allocator on a simulated device: stream-ordered reuse and its policies, growth,
// defragmentation by remapping, release, statistics, bad frees; and randomized multi-stream
// sequences checked against an independent model of what each stream is ordered after.

#include <streamalloc/detail/core/pool_core.hpp>

#include <doctest/doctest.h>

#include "sim_backend.hpp"
#include "test_streams.hpp"

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <stdexcept>
#include <vector>

using namespace streamalloc::detail;
using streamalloc_test::sim_backend;
using streamalloc_test::sim_device;

namespace {
constexpr std::uint64_t MiB = 1ull << 20;
using core = pool_core<sim_backend>;

using test_support::make_stream;
using test_support::same_handle;
using test_support::test_stream;

struct fixture {
  std::shared_ptr<sim_device> dev = std::make_shared<sim_device>();
  std::unique_ptr<core> pool;
  explicit fixture(core_options o = {}) {
    if (o.address_space == 0) o.address_space = 64ull << 30;
    pool = std::make_unique<core>(sim_backend{dev}, o);
  }
  ~fixture() { pool->shutdown(); }
};

/// 2 MiB chunks, the granularity, and nothing released at synchronizations: the chunks a case
/// frees stay for defragmentation to move.
core_options movable_chunks() {
  core_options o;
  o.chunk_size = 2 * MiB;
  o.release_threshold = ~0ull;
  return o;
}

/// A host synchronization of stream s, as streamalloc's stream::synchronize does it.
void host_sync(sim_device& dev, test_stream s) {
  const auto epoch = s.record->begin_synchronize();
  dev.run(s.native);
  ordering().complete_stream(*s.record, epoch);
}
}  // namespace

TEST_CASE("allocations are 256-aligned, disjoint, inside mapped memory, and reused on their stream") {
  fixture f;
  auto s = make_stream();
  std::vector<std::pair<std::uint64_t, std::uint64_t>> got;
  for (std::uint64_t n : std::initializer_list<std::uint64_t>{1, 255, 256, 257, 4096, 3 * MiB, 100 * MiB}) {
    const auto p = f.pool->allocate(n, s.key());
    CHECK(p % 256 == 0);
    CHECK(f.dev->is_mapped(p, n));
    got.emplace_back(p, n);
  }
  std::sort(got.begin(), got.end());
  for (std::size_t i = 1; i < got.size(); ++i) CHECK(got[i - 1].first + got[i - 1].second <= got[i].first);

  // Same stream: freed then allocated again, the same block comes back, with no driver call.
  const auto p = f.pool->allocate(1000, s.key());
  f.pool->deallocate(p, s.key());
  const auto creates = f.dev->creates;
  CHECK(f.pool->allocate(1000, s.key()) == p);
  CHECK(f.dev->creates == creates);
}

TEST_CASE("another stream does not reuse a free it has no proof of") {
  core_options o;
  o.reuse = {false, false, false};
  fixture f(o);
  auto a = make_stream(), b = make_stream();
  const auto p = f.pool->allocate(4096, a.key());
  f.pool->deallocate(p, a.key());
  const auto q = f.pool->allocate(4096, b.key());
  CHECK(q != p);
  CHECK(f.pool->allocate(4096, a.key()) == p);  // a itself may
}

TEST_CASE("follow_event_dependencies: reuse once the stream waited on an event after the free") {
  for (bool policy : {true, false}) {
    CAPTURE(policy);
    core_options o;
    o.chunk_size = 2 * MiB;  // whole-chunk blocks: no other free memory b could take instead
    o.reuse = {policy, false, false};
    fixture f(o);
    auto a = make_stream(), b = make_stream();
    const auto p = f.pool->allocate(2 * MiB, a.key());
    f.dev->busy.insert(a.native);  // a kernel on a still uses it
    f.pool->deallocate(p, a.key());
    b.record->wait_for(a.record->capture());  // event on a after the free; b waits on it
    const auto q = f.pool->allocate(2 * MiB, b.key());
    CHECK((q == p) == policy);
  }
}

TEST_CASE("opportunistic: reuse once the free has executed on the device, never before") {
  for (bool policy : {true, false}) {
    CAPTURE(policy);
    core_options o;
    o.chunk_size = 2 * MiB;  // blocks fill whole chunks: no other free memory to prefer
    o.reuse = {false, policy, false};
    fixture f(o);
    auto a = make_stream(), b = make_stream();
    const auto p = f.pool->allocate(2 * MiB, a.key());
    f.dev->busy.insert(a.native);  // a kernel on a still uses it
    f.pool->deallocate(p, a.key());
    // b allocates: the pool records an event on a, which has not run yet, so it grows.
    const auto q1 = f.pool->allocate(2 * MiB, b.key());
    CHECK(q1 != p);
    f.dev->run(a.native);  // the device passes the free
    const auto q2 = f.pool->allocate(2 * MiB, b.key());
    CHECK((q2 == p) == policy);
  }
}

TEST_CASE("a raw stream destroyed with a pending free: its handle's next owner proves nothing") {
  core_options o;
  o.chunk_size = 2 * MiB;
  fixture f(o);
  auto a = make_stream(false);
  const auto p = f.pool->allocate(2 * MiB, a.key());
  f.dev->busy.insert(a.native);  // a kernel on a still uses p
  f.pool->deallocate(p, a.key());
  // a is destroyed; the next stream created gets its handle value, and is idle.
  auto b = same_handle(a);
  f.dev->busy.erase(b.native);
  auto c = make_stream();
  CHECK(f.pool->allocate(2 * MiB, b.key()) != p);
  CHECK(f.pool->allocate(2 * MiB, c.key()) != p);
  CHECK(f.pool->statistics().free_pending == 2 * MiB);
  // A device-wide synchronization covers every stream, destroyed ones included.
  f.dev->run_all();
  const auto points = ordering().begin_synchronize_all();
  ordering().complete_all(points);
  CHECK(f.pool->allocate(2 * MiB, c.key()) == p);
}

TEST_CASE("per-thread default streams: one thread's idle stream proves nothing of another's") {
  // Both threads pass the same handle value; each value names the calling thread's stream.
  core_options o;
  o.chunk_size = 2 * MiB;
  for (bool follow : {true, false}) {
    CAPTURE(follow);
    o.reuse = {follow, true, true};
    fixture f(o);
    auto thread_a = make_stream(false);
    const auto p = f.pool->allocate(2 * MiB, thread_a.key());
    f.dev->busy.insert(thread_a.native);  // thread a's kernel runs
    f.pool->deallocate(p, thread_a.key());
    auto thread_b = same_handle(thread_a);
    f.dev->busy.erase(thread_b.native);  // seen from thread b, "the" stream is idle
    CHECK(f.pool->allocate(2 * MiB, thread_b.key()) != p);
    CHECK(f.dev->waits.empty());  // no wait made through a handle naming another stream
  }
}

TEST_CASE("raw streams: frees are covered by an event recorded during the stream's own call") {
  core_options o;
  o.chunk_size = 2 * MiB;
  o.reuse = {false, true, false};
  fixture f(o);
  auto a = make_stream(false), b = make_stream();
  // Below the cover limit a free waits in the stream's cache, covered by no event.
  const std::uint64_t small = 64 * 1024;
  REQUIRE(small < f.pool->cover_limit());
  const auto p = f.pool->allocate(small, a.key());
  f.dev->busy.insert(a.native);
  const auto events_before = f.dev->live_events;
  f.pool->deallocate(p, a.key());
  CHECK(f.dev->live_events == events_before);
  CHECK(f.pool->allocate(small, b.key()) != p);  // b cannot ask a: a's handle is not in hand
  CHECK(f.dev->live_events == events_before);
  (void)f.pool->allocate(4 * MiB, a.key());  // a's own slow path records an event on a
  CHECK(f.dev->live_events == events_before + 1);
  // b takes the rest of p's chunk first; only when nothing else is free does the pool look
  // at what completed.
  const auto takes_p = [&](int tries) {
    for (int i = 0; i < tries; ++i) {
      if (f.pool->allocate(small, b.key()) == p) return true;
    }
    return false;
  };
  CHECK_FALSE(takes_p(40));  // not run yet
  f.dev->run(a.native);
  CHECK(takes_p(40));  // the event has completed: opportunistic
}

TEST_CASE("raw streams: a free past the cover limit records an event in its own call") {
  core_options o;
  o.chunk_size = 2 * MiB;
  o.reuse = {false, true, false};
  fixture f(o);
  auto a = make_stream(false), b = make_stream(), owned = make_stream(true);
  const std::uint64_t limit = f.pool->cover_limit();
  REQUIRE(limit == 2 * MiB);
  const auto p = f.pool->allocate(4 * MiB, a.key());
  const auto q = f.pool->allocate(4 * MiB, owned.key());
  f.dev->busy.insert(a.native);
  const auto events_before = f.dev->live_events;
  f.pool->deallocate(p, a.key());
  CHECK(f.dev->live_events == events_before + 1);  // were a destroyed now, the event still tells
  f.pool->deallocate(q, owned.key());              // a stream streamalloc owns needs none
  CHECK(f.dev->live_events == events_before + 1);
  CHECK(f.pool->allocate(4 * MiB, b.key()) != p);  // not run yet
  f.dev->run(a.native);
  CHECK(f.pool->allocate(4 * MiB, b.key()) == p);  // without a's handle: its event completed
  // Small frees add up: the one that takes a's uncovered bytes past the limit is covered.
  std::vector<std::uint64_t> smalls;
  for (int i = 0; i < 9; ++i) smalls.push_back(f.pool->allocate(256 * 1024, a.key()));
  const auto events_small = f.dev->live_events;
  for (int i = 0; i < 8; ++i) f.pool->deallocate(smalls[static_cast<std::size_t>(i)], a.key());
  CHECK(f.dev->live_events == events_small);  // 2 MiB: at the limit, not past it
  f.pool->deallocate(smalls[8], a.key());
  CHECK(f.dev->live_events == events_small + 1);
}

TEST_CASE("raw streams: a stream that only takes its fast path does not pile up events") {
  core_options o;
  o.chunk_size = 2 * MiB;
  fixture f(o);
  auto a = make_stream(false);
  const auto events_before = f.dev->live_events;
  const auto recorded_before = f.dev->next_event;
  for (int i = 0; i < 512 * 100; ++i) {
    f.pool->deallocate(f.pool->allocate(4096, a.key()), a.key());
    f.dev->run(a.native);  // the device keeps up
  }
  // About 100 events were recorded, one per 513 frees (the one past 2 MiB); each found the
  // one before it completed and gave it back.
  CHECK(f.dev->next_event - recorded_before >= 95);
  CHECK(f.dev->live_events <= events_before + 1);
}

TEST_CASE("raw streams: a free does not absorb clear memory beside it") {
  core_options o;
  o.chunk_size = 2 * MiB;
  o.reuse = {false, true, false};
  fixture f(o);
  auto a = make_stream(false), b = make_stream();
  const auto p = f.pool->allocate(4096, a.key());  // the rest of the chunk stays clear
  f.pool->deallocate(p, a.key());                   // below the cover limit: no event
  f.pool->on_retire(a.record->id(), /*handle_valid=*/false);  // a is found gone
  // All but p's 4 KiB is usable by b: were the clear rest absorbed into a's pending bins, the
  // pool would have to grow.
  const auto q = f.pool->allocate(2 * MiB - 4096, b.key());
  CHECK(f.pool->statistics().reserved_current == 2 * MiB);
  f.pool->deallocate(q, b.key());
}

TEST_CASE("raw streams: more than 64 of them, and every free is covered") {
  core_options o;
  o.chunk_size = 2 * MiB;
  fixture f(o);
  std::vector<test_stream> raw;
  for (int i = 0; i < 65; ++i) raw.push_back(make_stream(false));
  for (std::size_t i = 0; i < raw.size(); ++i) {
    f.pool->deallocate(f.pool->allocate(4096, raw[i].key()), raw[i].key());
    CHECK(f.pool->cover_limit() == (i < 64 ? 2 * MiB : 0));
  }
  const auto events_before = f.dev->live_events;
  f.pool->deallocate(f.pool->allocate(4096, raw[0].key()), raw[0].key());
  CHECK(f.dev->live_events == events_before + 1);
}

TEST_CASE("internal dependencies on a raw stream wait on an event recorded while it was in hand") {
  core_options o;
  o.max_size = 8 * MiB;
  o.chunk_size = 2 * MiB;
  o.reuse = {false, false, true};
  fixture f(o);
  auto a = make_stream(false), b = make_stream();
  const auto p = f.pool->allocate(6 * MiB, a.key());
  const auto q = f.pool->allocate(2 * MiB, a.key());
  f.pool->deallocate(p, a.key());  // past the cover limit: an event on a covers it
  f.pool->deallocate(q, a.key());  // at the limit: no event, and merged with p, p's free too
  // No event covers a's frees: b cannot wait on a through a's handle, so it fails.
  CHECK_THROWS_AS((void)f.pool->allocate(6 * MiB, b.key()), core_out_of_memory);
  CHECK(f.dev->waits.empty());
  // a's own slow path covers its frees with an event; now b may wait on that event.
  const auto small = f.pool->allocate(1 * MiB, a.key());
  const auto r = f.pool->allocate(6 * MiB, b.key());  // memory a freed (p, with q's rest)
  CHECK(r + 6 * MiB > p);
  CHECK(r < p + 6 * MiB);
  CHECK(f.pool->statistics().reserved_current == 8 * MiB);
  REQUIRE(f.dev->waits.size() == 1);
  CHECK(f.dev->waits[0] == std::pair<void*, void*>{b.native, a.native});
  f.pool->deallocate(small, a.key());
}

TEST_CASE("frees_in_flight: true until the device is known to have run every free") {
  core_options o;
  o.chunk_size = 2 * MiB;
  // A stream streamalloc owns; a raw one freeing past the cover limit; a raw one below it.
  for (const auto& [stable, bytes] : {std::pair<bool, std::uint64_t>{true, 4 * MiB}, {false, 4 * MiB}, {false, 4096}}) {
    CAPTURE(stable);
    CAPTURE(bytes);
    fixture f(o);
    auto a = make_stream(stable);
    const auto p = f.pool->allocate(bytes, a.key());
    CHECK_FALSE(f.pool->frees_in_flight());
    f.dev->busy.insert(a.native);
    f.pool->deallocate(p, a.key());  // into a's fast cache
    CHECK(f.pool->frees_in_flight());
    f.dev->run(a.native);
    // A stable stream is asked (an event, then the next look sees it done); a raw one cannot
    // be: an event recorded during its free tells, else only a host synchronization.
    (void)f.pool->frees_in_flight();
    const bool covered = stable || bytes > f.pool->cover_limit();
    CHECK(f.pool->frees_in_flight() == !covered);
    host_sync(*f.dev, a);
    CHECK_FALSE(f.pool->frees_in_flight());
  }
}

TEST_CASE("after a host synchronization any stream reuses, whatever the policies") {
  core_options o;
  o.reuse = {false, false, false};
  fixture f(o);
  auto a = make_stream(), b = make_stream();
  const auto p = f.pool->allocate(1 << 20, a.key());
  f.pool->deallocate(p, a.key());
  host_sync(*f.dev, a);
  CHECK(f.pool->allocate(1 << 20, b.key()) == p);
}

TEST_CASE("internal dependencies: at the limit, wait on the free instead of failing") {
  for (bool policy : {true, false}) {
    CAPTURE(policy);
    core_options o;
    o.max_size = 8 * MiB;
    o.chunk_size = 8 * MiB;
    o.reuse = {false, false, policy};
    fixture f(o);
    auto a = make_stream(), b = make_stream();
    const auto p = f.pool->allocate(8 * MiB, a.key());
    f.pool->deallocate(p, a.key());
    if (policy) {
      CHECK(f.pool->allocate(8 * MiB, b.key()) == p);
      REQUIRE(f.dev->waits.size() == 1);
      CHECK(f.dev->waits[0] == std::pair<void*, void*>{b.native, a.native});  // b waits on a
    } else {
      CHECK_THROWS_AS(f.pool->allocate(8 * MiB, b.key()), core_out_of_memory);
      CHECK(f.dev->waits.empty());
    }
  }
}

TEST_CASE("defragmentation: a request that fits only after remapping, without growing") {
  core_options o;
  o.chunk_size = 2 * MiB;  // the granularity: chunks small enough to move
  o.max_size = 8 * MiB;
  o.release_threshold = ~0ull;  // keep free memory at synchronization points
  fixture f(o);
  auto s = make_stream();
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 4; ++i) p.push_back(f.pool->allocate(2 * MiB, s.key()));
  CHECK(f.pool->statistics().reserved_current == 8 * MiB);
  f.pool->deallocate(p[0], s.key());
  f.pool->deallocate(p[2], s.key());
  host_sync(*f.dev, s);
  // 4 MiB are free, in two separate holes: no 4 MiB range, and the pool cannot grow.
  const auto q = f.pool->allocate(4 * MiB, s.key());
  CHECK(f.dev->is_mapped(q, 4 * MiB));
  const auto st = f.pool->statistics();
  CHECK(st.reserved_current == 8 * MiB);
  CHECK(st.remapped_chunks >= 1);  // one when the holes have room after them, two otherwise
  CHECK(st.reserved_high == 8 * MiB);
  // The live blocks kept their memory.
  CHECK(f.dev->is_mapped(p[1], 2 * MiB));
  CHECK(f.dev->is_mapped(p[3], 2 * MiB));
}

TEST_CASE("defragmentation and growth: free chunks remapped next to a new handle for what they lack") {
  for (const bool synchronized : {true, false}) {
    CAPTURE(synchronized);
    core_options o;
    o.chunk_size = 2 * MiB;
    o.release_threshold = ~0ull;
    fixture f(o);
    auto s = make_stream();
    std::vector<std::uint64_t> p;
    for (int i = 0; i < 4; ++i) p.push_back(f.pool->allocate(2 * MiB, s.key()));
    if (!synchronized) f.dev->busy.insert(s.native);  // s's work has not run: its frees neither
    f.pool->deallocate(p[0], s.key());
    f.pool->deallocate(p[2], s.key());
    if (synchronized) host_sync(*f.dev, s);
    // 6 MiB asked, 4 MiB free in two whole chunks, two holes between live blocks.
    auto other = make_stream();  // a stream without proof of s's order: only clear chunks help it
    const auto q = f.pool->allocate(6 * MiB, other.key());
    CHECK(f.dev->is_mapped(q, 6 * MiB));
    const auto st = f.pool->statistics();
    if (synchronized) {
      // The two free chunks moved next to a new 2 MiB handle: the pool grew by what they lacked.
      CHECK(st.reserved_current == 10 * MiB);
      CHECK(st.remapped_chunks == 2);
    } else {
      // Freed but not known complete: their memory may still be in use, so nothing moves.
      CHECK(st.reserved_current == 14 * MiB);
      CHECK(st.remapped_chunks == 0);
      CHECK(f.dev->is_mapped(p[0], 2 * MiB));
      CHECK(f.dev->is_mapped(p[2], 2 * MiB));
    }
    CHECK(f.dev->is_mapped(p[1], 2 * MiB));
    CHECK(f.dev->is_mapped(p[3], 2 * MiB));
    f.pool->deallocate(q, other.key());
    f.pool->deallocate(p[1], s.key());
    f.pool->deallocate(p[3], s.key());
    f.dev->run_all();
  }
}

TEST_CASE("a stream's own frees, not yet run, move as aliases: its large request remaps them without waiting") {
  fixture f(movable_chunks());
  auto s = make_stream(), other = make_stream();
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 4; ++i) p.push_back(f.pool->allocate(2 * MiB, s.key()));
  const std::uint64_t h0 = f.dev->mapped_handle.at(p[0]), h2 = f.dev->mapped_handle.at(p[2]);
  f.dev->busy.insert(s.native);  // a host running ahead: s's work, its frees included, has not run
  f.pool->deallocate(p[0], s.key());
  f.pool->deallocate(p[2], s.key());
  // Another stream may not have that memory: its request grows the pool.
  const auto before_other = f.pool->statistics().reserved_current;
  const auto elsewhere = f.pool->allocate(4 * MiB, other.key());
  CHECK(f.pool->statistics().reserved_current == before_other + 4 * MiB);
  CHECK(f.dev->mapped_handle.at(elsewhere) != h0);
  CHECK(f.dev->mapped_handle.at(elsewhere) != h2);
  // 6 MiB on s: its own 4 MiB of frees lie in two holes between live blocks, not yet run. The
  // two chunks are mapped again next to 2 MiB of new memory; their old addresses stay mapped.
  const auto before = f.pool->statistics().reserved_current;
  const auto q = f.pool->allocate(6 * MiB, s.key());
  const auto st = f.pool->statistics();
  CHECK(f.dev->host_waits == 0);
  CHECK(st.reserved_current == before + 2 * MiB);
  CHECK(st.remapped_chunks == 2);
  CHECK(f.dev->is_mapped(q, 6 * MiB));
  CHECK(f.dev->mapped_handle.at(q) == h0);
  CHECK(f.dev->mapped_handle.at(q + 2 * MiB) == h2);
  CHECK(f.dev->is_mapped(p[0], 2 * MiB));  // work before the frees may still use these
  CHECK(f.dev->is_mapped(p[2], 2 * MiB));
  CHECK(f.pool->frees_in_flight());
  // Once s has run and the pool learns it, the old addresses go.
  host_sync(*f.dev, s);
  f.pool->on_synchronize(s.record->id());
  CHECK_FALSE(f.dev->is_mapped(p[0], 2 * MiB));
  CHECK_FALSE(f.dev->is_mapped(p[2], 2 * MiB));
  CHECK(f.dev->is_mapped(q, 6 * MiB));
  CHECK(f.pool->statistics().reserved_current == before + 2 * MiB);
  for (const auto x : {q, p[1], p[3]}) f.pool->deallocate(x, s.key());
  f.pool->deallocate(elsewhere, other.key());
  host_sync(*f.dev, s);
  host_sync(*f.dev, other);
  f.pool->trim_to(0);
  CHECK(f.pool->statistics().reserved_current == 0);
  CHECK(f.dev->mapped.empty());
}

TEST_CASE("aliases still mapped at their old addresses are unmapped before a closing pool releases them") {
  fixture f(movable_chunks());
  auto s = make_stream();
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 4; ++i) p.push_back(f.pool->allocate(2 * MiB, s.key()));
  f.dev->busy.insert(s.native);
  f.pool->deallocate(p[0], s.key());
  f.pool->deallocate(p[2], s.key());
  const auto q = f.pool->allocate(4 * MiB, s.key());
  CHECK(f.pool->statistics().remapped_chunks == 2);
  CHECK(f.dev->is_mapped(p[0], 2 * MiB));
  f.dev->run_all();  // what a closing pool waits for (pool_state synchronizes the devices)
  (void)f.pool->shutdown();  // the simulated device aborts on releasing a handle still mapped
  CHECK(f.dev->mapped.empty());
  CHECK(f.dev->handles.empty());
  (void)q;
}

TEST_CASE("an alias of frees with different stamps stays mapped until the newest has run") {
  // One chunk holds two of s's frees kept apart by an event between them: A's, covered by the
  // event, and B's, newer. When the event completes, A's old addresses may still be read by
  // nothing, but B's may: the chunk's old mapping must wait for B's free, the newest.
  fixture f(movable_chunks());
  auto s = make_stream();
  const auto a = f.pool->allocate(1 * MiB, s.key());
  const auto b = f.pool->allocate(1 * MiB, s.key());
  const auto l = f.pool->allocate(2 * MiB, s.key());
  const auto x = f.pool->allocate(2 * MiB, s.key());
  const auto l2 = f.pool->allocate(2 * MiB, s.key());
  REQUIRE(b == a + 1 * MiB);  // a and b share the first chunk
  f.dev->busy.insert(s.native);
  f.pool->deallocate(x, s.key());
  f.pool->deallocate(a, s.key());
  (void)f.pool->frees_in_flight();  // an event on s covering the frees of a and x
  f.pool->deallocate(b, s.key());   // newer than the event
  f.dev->streams[s.native].completed = 0;
  const auto q = f.pool->allocate(4 * MiB, s.key());  // the chunks of a+b and of x, moved
  CHECK(f.pool->statistics().remapped_chunks == 2);
  f.dev->streams[s.native].completed = 1;  // the event has run; b's free has not
  f.pool->trim_to(~0ull);
  CHECK(f.dev->is_mapped(a, 2 * MiB));  // b's free may still run there
  for (const auto p : {q, l, l2}) f.pool->deallocate(p, s.key());
  host_sync(*f.dev, s);
  f.pool->trim_to(0);
  CHECK_FALSE(f.dev->is_mapped(a, 2 * MiB));
  CHECK(f.dev->mapped.empty());
}

TEST_CASE("no alias when the stream's frees leave a live block in every chunk: the pool grows") {
  fixture f(movable_chunks());
  auto s = make_stream();
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 8; ++i) p.push_back(f.pool->allocate(1 * MiB, s.key()));  // two per chunk
  f.dev->busy.insert(s.native);
  for (int i = 0; i < 8; i += 2) f.pool->deallocate(p[static_cast<std::size_t>(i)], s.key());
  const auto held = f.pool->statistics().reserved_current;
  const auto q = f.pool->allocate(4 * MiB, s.key());  // 4 MiB pending on s, in 1 MiB holes
  CHECK(f.pool->statistics().reserved_current == held + 4 * MiB);
  CHECK(f.pool->statistics().remapped_chunks == 0);
  for (int i = 0; i < 8; i += 2) CHECK(f.dev->is_mapped(p[static_cast<std::size_t>(i)], 1 * MiB));
  for (int i = 1; i < 8; i += 2) f.pool->deallocate(p[static_cast<std::size_t>(i)], s.key());
  f.pool->deallocate(q, s.key());
  f.dev->run_all();
}

/// With the history kept from the pool's start: the memory it says grew, less the memory it
/// says was released, is what the pool holds (a mapping refused or failed part-way included).
void check_history_balanced(fixture& f) {
  if (!f.pool->history().on()) return;
  const auto h = f.pool->history().read();
  REQUIRE(h.dropped == 0);
  std::int64_t held = 0;
  for (const auto& e : h.events) {
    if (e.op == history_op::grow) held += static_cast<std::int64_t>(e.bytes);
    if (e.op == history_op::release) held -= static_cast<std::int64_t>(e.bytes);
  }
  CHECK(held == static_cast<std::int64_t>(f.pool->statistics().reserved_current));
}

namespace {
/// Once every block is freed and every stream has run: the pool gives all memory back, and
/// each of its reservations is whole again (a request of a reservation's size lands at its
/// base, with no new reservation), and nothing else is free (with every reservation taken,
/// one more request finds no address there: a range given back twice, or while mapped, would
/// be handed out over a mapping, which the simulated device refuses as a misuse): nothing
/// mapped, held or addressed was lost or doubled on the way.
void check_nothing_lost(fixture& f, std::initializer_list<test_stream*> streams) {
  CHECK(f.pool->addresses_consistent());
  check_history_balanced(f);
  for (test_stream* s : streams) host_sync(*f.dev, *s);
  f.pool->trim_to(0);
  CHECK(f.pool->statistics().reserved_current == 0);
  CHECK(f.dev->mapped.empty());
  CHECK(f.dev->handles.empty());
  const auto reserved = f.pool->addresses_reserved();
  const auto reservations = f.pool->reservations();
  auto s = make_stream();
  std::vector<std::uint64_t> whole;
  for (const auto& [base, size] : reservations) {
    whole.push_back(f.pool->allocate(size, s.key()));
    CHECK(whole.back() == base);
  }
  CHECK(f.pool->addresses_reserved() == reserved);
  try {
    const auto extra = f.pool->allocate(f.pool->granularity(), s.key());
    for (const auto& [base, size] : reservations) CHECK((extra < base || extra >= base + size));
    f.pool->deallocate(extra, s.key());
  } catch (const core_out_of_memory&) {  // the address space is all reserved: as it should be
  }
  for (const auto q : whole) f.pool->deallocate(q, s.key());
  host_sync(*f.dev, s);
  f.pool->trim_to(0);
  CHECK(f.dev->mapped.empty());
  check_history_balanced(f);
}

/// The history, kept from the pool's start: every test below that refuses or fails a mapping.
void keep_history(fixture& f) { f.pool->history().keep(1 << 14); }
}  // namespace

TEST_CASE("a mapping refused while defragmenting: the request is served by growth, nothing lost") {
  fixture f(movable_chunks());
  keep_history(f);
  auto s = make_stream();
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 4; ++i) p.push_back(f.pool->allocate(2 * MiB, s.key()));
  f.pool->deallocate(p[0], s.key());
  f.pool->deallocate(p[2], s.key());
  host_sync(*f.dev, s);
  // Two clear chunks in two holes; the first one's new mapping is refused. Its memory goes back
  // to the device, and the other chunk moves next to 2 MiB of new memory instead.
  f.dev->refuse_maps = 1;
  const auto q = f.pool->allocate(4 * MiB, s.key());
  CHECK(f.dev->refuse_maps == 0);
  CHECK(f.dev->is_mapped(q, 4 * MiB));
  const auto st = f.pool->statistics();
  CHECK(st.remapped_chunks == 1);
  CHECK(st.reserved_current == 8 * MiB);
  CHECK(f.dev->handles.size() == 4);
  CHECK(f.dev->is_mapped(p[1], 2 * MiB));
  CHECK(f.dev->is_mapped(p[3], 2 * MiB));
  for (const auto x : {q, p[1], p[3]}) f.pool->deallocate(x, s.key());
  check_nothing_lost(f, {&s});
}

TEST_CASE("a mapping refused while moving a stream's own frees as aliases: they stay, the pool grows") {
  fixture f(movable_chunks());
  keep_history(f);
  auto s = make_stream();
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 4; ++i) p.push_back(f.pool->allocate(2 * MiB, s.key()));
  const std::uint64_t h0 = f.dev->mapped_handle.at(p[0]), h2 = f.dev->mapped_handle.at(p[2]);
  f.dev->busy.insert(s.native);  // s's frees have not run
  f.pool->deallocate(p[0], s.key());
  f.pool->deallocate(p[2], s.key());
  f.dev->refuse_maps = 1;
  const auto held = f.pool->statistics().reserved_current;
  const auto q = f.pool->allocate(6 * MiB, s.key());
  CHECK(f.dev->refuse_maps == 0);
  CHECK(f.dev->is_mapped(q, 6 * MiB));
  CHECK(f.pool->statistics().remapped_chunks == 0);
  CHECK(f.pool->statistics().reserved_current == held + 6 * MiB);
  for (std::uint64_t at = q; at < q + 6 * MiB; at += 2 * MiB) {
    CHECK(f.dev->mapped_handle.at(at) != h0);  // the refused alias left no second mapping
    CHECK(f.dev->mapped_handle.at(at) != h2);
  }
  CHECK(f.dev->is_mapped(p[0], 2 * MiB));  // s's frees may still run there
  CHECK(f.dev->is_mapped(p[2], 2 * MiB));
  f.dev->busy.erase(s.native);
  for (const auto x : {q, p[1], p[3]}) f.pool->deallocate(x, s.key());
  check_nothing_lost(f, {&s});
}

TEST_CASE("a refused mapping of the new memory beside moved chunks: the error reaches the caller, nothing lost") {
  fixture f(movable_chunks());
  keep_history(f);
  auto s = make_stream(), other = make_stream();
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 4; ++i) p.push_back(f.pool->allocate(2 * MiB, s.key()));
  f.pool->deallocate(p[0], s.key());
  f.pool->deallocate(p[2], s.key());
  host_sync(*f.dev, s);
  // 6 MiB: the two clear chunks move (refused: the first), then the new memory after them is
  // refused too. Growth fails as it would on its own: the driver's error is thrown.
  f.dev->refuse_maps = 2;
  CHECK_THROWS_AS((void)f.pool->allocate(6 * MiB, other.key()), std::runtime_error);
  CHECK(f.dev->refuse_maps == 0);
  CHECK(f.dev->is_mapped(p[1], 2 * MiB));
  CHECK(f.dev->is_mapped(p[3], 2 * MiB));
  // The pool still serves the request once the driver maps again.
  const auto q = f.pool->allocate(6 * MiB, other.key());
  CHECK(f.dev->is_mapped(q, 6 * MiB));
  f.pool->deallocate(q, other.key());
  for (const auto x : {p[1], p[3]}) f.pool->deallocate(x, s.key());
  check_nothing_lost(f, {&s, &other});
}

TEST_CASE("growth whose mapping is refused: the error reaches the caller, the unmapped chunks go back") {
  fixture f(movable_chunks());
  keep_history(f);
  auto s = make_stream();
  f.dev->refuse_maps = 1;  // a 6 MiB request grows by three 2 MiB chunks: the first is refused
  CHECK_THROWS_AS((void)f.pool->allocate(6 * MiB, s.key()), std::runtime_error);
  CHECK(f.dev->handles.empty());
  CHECK(f.pool->statistics().reserved_current == 0);
  const auto p = f.pool->allocate(6 * MiB, s.key());
  CHECK(f.dev->is_mapped(p, 6 * MiB));
  // grow_in_place says no, changing nothing, when the mapping behind the block is refused.
  f.dev->refuse_maps = 2;  // it tries twice: again after learning what completed
  CHECK(f.pool->grow_in_place(p, 10 * MiB, s.key()) == 0);
  CHECK(f.dev->refuse_maps == 0);
  CHECK(f.pool->statistics().reserved_current == 6 * MiB);
  CHECK(f.pool->grow_in_place(p, 10 * MiB, s.key()) == 10 * MiB);
  f.pool->deallocate(p, s.key());
  check_nothing_lost(f, {&s});
}

TEST_CASE("a mapping refused part-way: what was mapped stays, the rest goes back, nothing lost") {
  fixture f(movable_chunks());
  keep_history(f);
  auto s = make_stream(), other = make_stream();
  SUBCASE("growth: the second of three chunks refused") {
    f.dev->maps_before_refusal = 1;
    f.dev->refuse_maps = 1;
    CHECK_THROWS_AS((void)f.pool->allocate(6 * MiB, s.key()), std::runtime_error);
    CHECK(f.pool->addresses_consistent());
    CHECK(f.dev->handles.size() == 1);  // the first, mapped, is the pool's free memory
    CHECK(f.pool->statistics().reserved_current == 2 * MiB);
    const auto p = f.pool->allocate(6 * MiB, s.key());
    CHECK(f.dev->is_mapped(p, 6 * MiB));
    f.pool->deallocate(p, s.key());
    check_nothing_lost(f, {&s, &other});
    return;
  }
  // Six chunks, three of them free and clear, in three holes between live blocks.
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 6; ++i) p.push_back(f.pool->allocate(2 * MiB, s.key()));
  auto finish = [&](std::initializer_list<std::uint64_t> more) {
    CHECK(f.pool->addresses_consistent());
    for (int i : {1, 3, 5}) CHECK(f.dev->is_mapped(p[static_cast<std::size_t>(i)], 2 * MiB));
    f.dev->busy.clear();
    for (int i : {1, 3, 5}) f.pool->deallocate(p[static_cast<std::size_t>(i)], s.key());
    for (const auto x : more) f.pool->deallocate(x, s.key());
    check_nothing_lost(f, {&s, &other});
  };
  SUBCASE("defragmenting for 6 MiB: the second of three moves refused") {
    for (int i : {0, 2, 4}) f.pool->deallocate(p[static_cast<std::size_t>(i)], s.key());
    host_sync(*f.dev, s);
    f.dev->maps_before_refusal = 1;
    f.dev->refuse_maps = 1;
    const auto q = f.pool->allocate(6 * MiB, s.key());
    CHECK(f.dev->refuse_maps == 0);
    CHECK(f.dev->is_mapped(q, 6 * MiB));
    // The refused chunk went back to the device; the two others moved next to 2 MiB of new memory.
    CHECK(f.pool->statistics().reserved_current == 12 * MiB);
    CHECK(f.dev->handles.size() == 6);
    finish({q});
  }
  SUBCASE("defragmenting and growing for 8 MiB: the second move refused, so no new memory beside them") {
    for (int i : {0, 2, 4}) f.pool->deallocate(p[static_cast<std::size_t>(i)], s.key());
    host_sync(*f.dev, s);
    f.dev->maps_before_refusal = 1;
    f.dev->refuse_maps = 1;
    const auto creates = f.dev->creates;
    const auto q = f.pool->allocate(8 * MiB, other.key());
    CHECK(f.dev->refuse_maps == 0);
    CHECK(f.dev->is_mapped(q, 8 * MiB));
    // One chunk moved, one went back; growth extended the moved one by three new chunks.
    CHECK(f.pool->statistics().reserved_current == 16 * MiB);
    CHECK(f.dev->creates == creates + 1 + 3);  // the handle made for the rest, released unmapped
    f.pool->deallocate(q, other.key());
    host_sync(*f.dev, other);
    finish({});
  }
  SUBCASE("a clear chunk moved, then a stream's own pending one refused as an alias") {
    f.pool->deallocate(p[0], s.key());
    host_sync(*f.dev, s);
    f.dev->busy.insert(s.native);  // s's later frees have not run
    f.pool->deallocate(p[2], s.key());
    f.pool->deallocate(p[4], s.key());
    f.dev->maps_before_refusal = 1;
    f.dev->refuse_maps = 1;
    const auto q = f.pool->allocate(6 * MiB, s.key());
    CHECK(f.dev->refuse_maps == 0);
    CHECK(f.dev->is_mapped(q, 6 * MiB));
    CHECK(f.pool->statistics().remapped_chunks == 1);
    CHECK(f.dev->is_mapped(p[2], 2 * MiB));  // not moved: s's frees may still run there
    CHECK(f.dev->is_mapped(p[4], 2 * MiB));
    CHECK(f.dev->mapped.size() == 6 + 2);   // no alias: six chunks where they were or moved, two new
    finish({q});
  }
}

TEST_CASE("a map that fails for another reason than a shortage: the error reaches the caller, nothing lost") {
  // Only a refusal for lack of memory lets remapping and growth in place go on without the
  // mapping; a sticky error or a lost context must not be hidden until the next growth.
  fixture f(movable_chunks());
  keep_history(f);
  auto s = make_stream();
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 4; ++i) p.push_back(f.pool->allocate(2 * MiB, s.key()));
  const char* failed = "map: failed (simulated error, not a shortage)";
  auto fail_next_map = [&] {
    f.dev->fail_maps = true;
    f.dev->refuse_maps = 1;
  };
  SUBCASE("moving a clear chunk") {
    f.pool->deallocate(p[0], s.key());
    f.pool->deallocate(p[2], s.key());
    host_sync(*f.dev, s);
    fail_next_map();
    const auto creates = f.dev->creates;
    CHECK_THROWS_WITH_AS((void)f.pool->allocate(4 * MiB, s.key()), failed, std::runtime_error);
    CHECK(f.dev->creates == creates);  // not served by growth behind the error's back
    CHECK(f.pool->statistics().reserved_current == 6 * MiB);  // the chunk in the failed move went back
  }
  SUBCASE("moving a stream's own pending chunk as an alias") {
    f.dev->busy.insert(s.native);
    f.pool->deallocate(p[0], s.key());
    f.pool->deallocate(p[2], s.key());
    fail_next_map();
    const auto creates = f.dev->creates;
    CHECK_THROWS_WITH_AS((void)f.pool->allocate(4 * MiB, s.key()), failed, std::runtime_error);
    CHECK(f.dev->creates == creates);  // the alias failed, not growth
    CHECK(f.dev->is_mapped(p[0], 2 * MiB));  // nothing changed: s's frees may still run there
    CHECK(f.dev->is_mapped(p[2], 2 * MiB));
    CHECK(f.pool->statistics().reserved_current == 8 * MiB);
    f.dev->busy.clear();
  }
  SUBCASE("growing a block in place") {
    fail_next_map();
    CHECK_THROWS_WITH_AS((void)f.pool->grow_in_place(p[3], 4 * MiB, s.key()), failed, std::runtime_error);
    CHECK(f.pool->statistics().reserved_current == 8 * MiB);
    f.pool->deallocate(p[0], s.key());
    f.pool->deallocate(p[2], s.key());
  }
  f.dev->fail_maps = false;
  CHECK(f.dev->refuse_maps == 0);
  CHECK(f.pool->addresses_consistent());
  CHECK(f.dev->is_mapped(p[1], 2 * MiB));
  CHECK(f.dev->is_mapped(p[3], 2 * MiB));
  const auto q = f.pool->allocate(4 * MiB, s.key());  // served once the device maps again
  CHECK(f.dev->is_mapped(q, 4 * MiB));
  for (const auto x : {q, p[1], p[3]}) f.pool->deallocate(x, s.key());
  check_nothing_lost(f, {&s});
}

TEST_CASE("the limit and the device's memory end in core_out_of_memory, with the state named") {
  core_options o;
  o.max_size = 64 * MiB;
  fixture f(o);
  auto s = make_stream();
  (void)f.pool->allocate(60 * MiB, s.key());
  try {
    (void)f.pool->allocate(8 * MiB, s.key());
    FAIL("should not fit");
  } catch (const core_out_of_memory& e) {
    CHECK(e.requested == 8 * MiB);
    CHECK(e.reason.find("at most 67108864") != std::string::npos);
  }
  fixture g;
  g.dev->capacity = 128 * MiB;
  CHECK_THROWS_AS(g.pool->allocate(256 * MiB, s.key()), core_out_of_memory);
}

TEST_CASE("a large request is built from chunks: small blocks placed in its memory after its free pin one") {
  // A training step's logits (1,020 MiB here) are freed, the optimizer's first state lands at
  // the start of their memory and lives on, and the next step asks for the logits again.
  // With one handle of its own per large request, those few MiB pinned the whole 1,000 MiB
  // and the pool grew by another 1,020 MiB; built from 64 MiB chunks, it grows by one chunk.
  for (const bool own : {false, true}) {
    CAPTURE(own);
    core_options o;
    o.own_chunk_for_large = own;
    o.release_threshold = ~std::uint64_t{0};
    fixture f(o);
    auto s = make_stream();
    const auto logits = f.pool->allocate(1020 * MiB, s.key());
    CHECK(f.pool->statistics().chunks == (own ? 1u : 16u));  // 1,024 MiB in chunks
    f.pool->deallocate(logits, s.key());
    host_sync(*f.dev, s);
    const auto state = f.pool->allocate(9 * MiB, s.key());
    CHECK(state == logits);  // best fit: the freed memory's start
    const auto again = f.pool->allocate(1020 * MiB, s.key());
    CHECK(f.dev->is_mapped(again, 1020 * MiB));
    CHECK((again >= state + 9 * MiB || again + 1020 * MiB <= state));
    const auto held = f.pool->statistics().reserved_current;
    if (own) {
      CHECK(held == 2040 * MiB);
    } else {
      CHECK(held == 1088 * MiB);  // one more chunk, after the 1,015 MiB left free
      CHECK(again == state + 9 * MiB);
    }
    f.pool->deallocate(again, s.key());
    f.pool->deallocate(state, s.key());
  }
}

TEST_CASE("compact growth: a request no address run can hold fails at once, before any chunk is made") {
  core_options o;
  o.chunk_size = 2 * MiB;
  o.own_chunk_for_large = false;  // large requests built from chunks, as `compact` does
  fixture f(o);
  auto s = make_stream();
  // 2^60 bytes would be 2^39 chunks: listed one by one, that exhausted the host's memory.
  CHECK_THROWS_AS((void)f.pool->allocate(1ull << 60, s.key()), core_out_of_memory);
  CHECK(f.dev->physical_used == 0);
  CHECK(f.pool->statistics().reserved_current == 0);
}

TEST_CASE("compact growth: when releasing free chunks takes the tail it was sized for, it sizes afresh") {
  core_options o;
  o.chunk_size = 2 * MiB;
  o.own_chunk_for_large = false;
  o.release_threshold = ~std::uint64_t{0};  // free chunks stay until growth needs their memory
  fixture f(o);
  f.dev->capacity = 64 * MiB;
  auto s = make_stream();
  // One run: [x free 20 MiB][a live 2 MiB][t free 10 MiB, the run's tail].
  const auto x = f.pool->allocate(20 * MiB, s.key());
  const auto a = f.pool->allocate(2 * MiB, s.key());
  const auto t = f.pool->allocate(10 * MiB, s.key());
  REQUIRE(a == x + 20 * MiB);
  REQUIRE(t == a + 2 * MiB);
  f.pool->deallocate(x, s.key());
  f.pool->deallocate(t, s.key());
  host_sync(*f.dev, s);
  REQUIRE(f.dev->physical_used == 32 * MiB);
  // 50 MiB: extending the tail needs 40 MiB more, and the device has 32 MiB free, so the pool
  // gives back its free chunks (the tail among them). Then 50 MiB of fresh chunks fit.
  const auto p = f.pool->allocate(50 * MiB, s.key());
  CHECK(f.pool->find_live(p)->second == 50 * MiB);
  CHECK(f.dev->is_mapped(p, 50 * MiB));
  CHECK(f.dev->is_mapped(a, 2 * MiB));
  CHECK(f.dev->physical_used == 52 * MiB);
  f.pool->deallocate(p, s.key());
  f.pool->deallocate(a, s.key());
}

TEST_CASE("shrink_in_place: a size within 255 bytes of 2^64 leaves the block as it is") {
  fixture f;
  auto s = make_stream();
  const auto p = f.pool->allocate(4 * MiB, s.key());
  for (const std::uint64_t huge : {~std::uint64_t{0}, ~std::uint64_t{0} - 255, ~std::uint64_t{0} - 100}) {
    CAPTURE(huge);
    CHECK(f.pool->shrink_in_place(p, huge, s.key()) == 4 * MiB);
    CHECK(f.pool->find_live(p)->second == 4 * MiB);
  }
  CHECK(f.pool->statistics().used_current == 4 * MiB);
  f.pool->deallocate(p, s.key());
}

TEST_CASE("a free does not merge into a pending neighbour an event covers: that one turns clear when its event runs") {
  // A host running ahead of its GPU: the stream frees a, the pool covers that free with an
  // event, the stream frees b next to it. Merged, a would take b's stamp and stay pending until
  // b's free ran too; kept apart, it is clear (for every stream) once a's event has run.
  fixture f;
  auto s = make_stream(), t = make_stream();
  const auto x = f.pool->allocate(1 * MiB, s.key());  // live neighbours: a and b touch only each other
  const auto a = f.pool->allocate(1 * MiB, s.key());
  const auto b = f.pool->allocate(1 * MiB, s.key());
  const auto y = f.pool->allocate(1 * MiB, s.key());
  REQUIRE(b == a + 1 * MiB);
  f.dev->busy.insert(s.native);  // s's work has not run: asking the stream proves nothing
  f.pool->deallocate(a, s.key());
  // A request nothing free holds: every stream's frees are flushed and covered by an event.
  const auto big1 = f.pool->allocate(128 * MiB, t.key());
  const auto covering_a = f.dev->streams[s.native].enqueued;  // that event's place on s
  REQUIRE(covering_a > 0);
  f.pool->deallocate(b, s.key());
  const auto big2 = f.pool->allocate(128 * MiB, s.key());  // flushes b next to a; covers b
  REQUIRE(f.dev->streams[s.native].enqueued > covering_a);
  f.dev->streams[s.native].completed = covering_a;  // the device has run a's free, not b's
  const auto big3 = f.pool->allocate(128 * MiB, t.key());  // a look at the events
  const auto st = f.pool->statistics();
  CHECK(st.free_pending == 1 * MiB);  // b alone (merged with a: 2 MiB, none of it usable)
  // t reuses a in place: the best fit for 1 MiB among clear blocks is a's exact hole.
  CHECK(f.pool->allocate(1 * MiB, t.key()) == a);
  f.dev->run_all();
  for (const auto p : {x, y, big1, big2, big3}) f.pool->deallocate(p, s.key());
}

TEST_CASE("streams made, used and retired one after another: their states are reused, not kept") {
  fixture f;
  auto keep = make_stream();
  const auto held = f.pool->allocate(4096, keep.key());
  const auto before = f.pool->stream_states();
  CHECK(before.in_use == 1);
  std::vector<test_stream> running;  // retired while work on them still ran
  for (int i = 0; i < 3000; ++i) {
    auto s = make_stream();
    const auto p = f.pool->allocate(256 * (1 + i % 16), s.key());
    if (i % 10 == 0) f.dev->busy.insert(s.native);
    f.pool->deallocate(p, s.key());
    ordering().retire(s.record->id());  // as streamalloc's stream destructor does
    if (i % 10 == 0) running.push_back(s);
    if (running.size() == 5) {  // their work ends; the pool sees it through their last events
      for (auto& r : running) f.dev->run(r.native);
      running.clear();
    }
    // A retired stream still running holds its state; the rest give theirs back at once.
    CHECK(f.pool->stream_states().in_use <= before.in_use + 1 + running.size() + 5);
  }
  for (auto& r : running) f.dev->run(r.native);
  (void)f.pool->allocate(4096, keep.key());  // a slow-path look at the retired streams' events
  CHECK(f.pool->stream_states().in_use == before.in_use);
  CHECK(f.pool->stream_states().made <= before.made + 12);
  // The accounting of the recycled states is kept: only keep's two allocations are live.
  const auto st = f.pool->statistics();
  CHECK(st.live_allocations == 2);
  CHECK(st.used_current == 2 * 4096);
  f.pool->deallocate(held, keep.key());
}

TEST_CASE("releasing: trim and the release threshold give back whole free chunks only when complete") {
  core_options o;
  o.chunk_size = 2 * MiB;
  o.release_threshold = 0;
  fixture f(o);
  auto s = make_stream();
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 8; ++i) p.push_back(f.pool->allocate(2 * MiB, s.key()));
  for (int i = 0; i < 8; i += 2) f.pool->deallocate(p[i], s.key());
  // Not yet known complete: nothing may go back.
  f.pool->trim_to(0);
  CHECK(f.pool->statistics().reserved_current == 16 * MiB);
  // A synchronization point applies the release threshold (0): the four free chunks go.
  host_sync(*f.dev, s);
  CHECK(f.pool->statistics().reserved_current == 8 * MiB);
  CHECK(f.dev->physical_used == 8 * MiB);
  for (int i = 1; i < 8; i += 2) CHECK(f.dev->is_mapped(p[i], 2 * MiB));
}

TEST_CASE("trim: a busy stream's cached free beside clear chunks does not keep them from release") {
  fixture f(movable_chunks());
  auto s = make_stream();
  // Eight chunks freed and known complete (clear), then a small live block and the rest of
  // the ninth chunk, still in use.
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 8; ++i) p.push_back(f.pool->allocate(2 * MiB, s.key()));
  const auto small = f.pool->allocate(4096, s.key());
  const auto rest = f.pool->allocate(2 * MiB - 4096, s.key());
  REQUIRE(small == p[7] + 2 * MiB);
  for (auto x : p) f.pool->deallocate(x, s.key());
  host_sync(*f.dev, s);
  REQUIRE(f.pool->statistics().reserved_current == 18 * MiB);
  // A kernel on s still uses `small` when it is freed: the free sits in s's cache, right after
  // the clear chunks. The trim flushes it; absorbing the clear chunks into that pending free
  // would keep all 16 MiB until an event on s had run.
  f.dev->busy.insert(s.native);
  f.pool->deallocate(small, s.key());
  f.pool->trim_to(0);
  CHECK(f.pool->statistics().reserved_current == 2 * MiB);
  CHECK(f.dev->is_mapped(small, 2 * MiB));  // the chunk of the running free stays
  // And once the free has run, its chunk goes too.
  f.pool->deallocate(rest, s.key());
  host_sync(*f.dev, s);
  f.pool->trim_to(0);
  CHECK(f.pool->statistics().reserved_current == 0);
}

TEST_CASE("retiring: a busy stream's last cached free does not take the clear memory beside it") {
  core_options o = movable_chunks();
  o.reuse = {false, true, false};  // opportunistic only: no waiting on the retired stream's frees
  fixture f(o);
  auto s = make_stream();
  auto other = make_stream();
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 8; ++i) p.push_back(f.pool->allocate(2 * MiB, s.key()));
  const auto small = f.pool->allocate(4096, s.key());
  REQUIRE(small == p[7] + 2 * MiB);
  for (auto x : p) f.pool->deallocate(x, s.key());
  host_sync(*f.dev, s);  // 16 MiB clear, right before `small`
  // s is destroyed while a kernel on it still uses `small`: the free sits in its cache, and
  // the retirement flushes it. Absorbed into that pending free, the clear 16 MiB would wait
  // for s's last event; left apart, another stream takes them at once.
  f.dev->busy.insert(s.native);
  f.pool->deallocate(small, s.key());
  f.pool->on_retire(s.record->id(), /*handle_valid=*/true);
  const auto reserved = f.pool->statistics().reserved_current;
  const auto q = f.pool->allocate(16 * MiB, other.key());
  CHECK(q == p[0]);
  CHECK(f.pool->statistics().reserved_current == reserved);  // served without growing
  f.pool->deallocate(q, other.key());
  f.dev->run_all();
}

TEST_CASE("statistics follow what was allocated; high-water marks reset") {
  core_options o;
  o.chunk_size = 2 * MiB;
  fixture f(o);
  auto s = make_stream();
  const auto a = f.pool->allocate(1000, s.key());    // 1024 after rounding
  const auto b = f.pool->allocate(3 * MiB, s.key());
  auto st = f.pool->statistics();
  CHECK(st.used_current == 1024 + 3 * MiB);
  CHECK(st.live_allocations == 2);
  CHECK(st.reserved_current >= st.used_current);
  CHECK(st.reserved_current == f.dev->physical_used);
  f.pool->deallocate(b, s.key());
  st = f.pool->statistics();
  CHECK(st.used_current == 1024);
  CHECK(st.used_high == 1024 + 3 * MiB);
  CHECK(st.live_allocations == 1);
  f.pool->reset_high_water();
  CHECK(f.pool->statistics().used_high == 1024);
  f.pool->deallocate(a, s.key());
  CHECK(f.pool->statistics().used_current == 0);
}

TEST_CASE("bad frees throw invalid_argument and change nothing") {
  fixture f;
  auto s = make_stream();
  const auto p = f.pool->allocate(4096, s.key());
  const auto before = f.pool->statistics();
  CHECK_THROWS_AS(f.pool->deallocate(0x1000, s.key()), std::invalid_argument);   // foreign
  CHECK_THROWS_AS(f.pool->deallocate(p + 256, s.key()), std::invalid_argument);  // interior
  f.pool->deallocate(p, s.key());
  try {
    f.pool->deallocate(p, s.key());
    FAIL("double free should throw");
  } catch (const std::invalid_argument& e) {
    CHECK(std::string(e.what()).find("double free") != std::string::npos);
  }
  const auto after = f.pool->statistics();
  CHECK(after.used_current + 4096 == before.used_current);
  CHECK(after.live_allocations + 1 == before.live_allocations);
}

TEST_CASE("shutdown releases everything and reports what was never freed") {
  auto dev = std::make_shared<sim_device>();
  core_options o;
  o.address_space = 64ull << 30;
  core pool(sim_backend{dev}, o);
  auto s = make_stream();
  (void)pool.allocate(5 * MiB, s.key());
  const auto p = pool.allocate(1 * MiB, s.key());
  pool.deallocate(p, s.key());
  const auto [count, bytes] = pool.shutdown();
  CHECK(count == 1);
  CHECK(bytes == 5 * MiB);
  CHECK(dev->physical_used == 0);
  CHECK(dev->mapped.empty());
  CHECK(dev->live_events == 0);
}

// --- randomized ------------------------------------------------------------------------------

namespace {
// An independent model of stream order: per stream a count of operations; per stream a vector
// clock of what it was made to wait for (by the test, or by the pool's inserted waits); and
// what the device has completed. A reuse is legal when the new owner's stream is the freeing
// stream, or ordered after the free, or the free is known to have executed.
struct order_model {
  std::vector<std::uint64_t> ops;                  // per stream: operations enqueued
  std::vector<std::vector<std::uint64_t>> clock;   // clock[t][s]: t is after s's ops up to this
  std::vector<std::uint64_t> done;                 // per stream: ops executed on the device
  explicit order_model(std::size_t n) : ops(n, 0), clock(n, std::vector<std::uint64_t>(n, 0)), done(n, 0) {}
  std::uint64_t enqueue(std::size_t s) { return ++ops[s]; }
  void wait(std::size_t t, std::size_t s) {  // t waits for everything enqueued on s so far
    clock[t][s] = std::max(clock[t][s], ops[s]);
    for (std::size_t u = 0; u < ops.size(); ++u) clock[t][u] = std::max(clock[t][u], clock[s][u]);
  }
  bool legal(std::size_t t, std::size_t s, std::uint64_t free_op) const {
    return t == s || clock[t][s] >= free_op || done[s] >= free_op;
  }
};
}  // namespace

TEST_CASE("grow_in_place: takes the free memory after a block, then maps more behind it") {
  fixture f;
  auto s = make_stream();
  const auto p = f.pool->allocate(1 * MiB, s.key());
  const auto used = f.pool->statistics().used_current;
  // Inside the first 64 MiB chunk: no driver call.
  const auto creates = f.dev->creates;
  CHECK(f.pool->grow_in_place(p, 40 * MiB, s.key()) == 40 * MiB);
  CHECK(f.dev->creates == creates);
  CHECK(f.pool->statistics().used_current == used + 39 * MiB);
  // Past the chunk: new physical memory mapped right after it, the address unchanged.
  CHECK(f.pool->grow_in_place(p, 1000 * MiB, s.key()) == 1000 * MiB);
  CHECK(f.dev->creates > creates);
  CHECK(f.dev->is_mapped(p, 1000 * MiB));
  CHECK(f.pool->find_live(p) == std::pair{p, 1000 * MiB});
  // A smaller size changes nothing.
  CHECK(f.pool->grow_in_place(p, 10, s.key()) == 1000 * MiB);
  // The whole block goes back with one free, and is reused whole.
  f.pool->deallocate(p, s.key());
  CHECK(f.pool->statistics().used_current == used - 1 * MiB);
  CHECK(f.pool->allocate(1000 * MiB, s.key()) == p);
}

TEST_CASE("addresses are reserved as the pool grows, each mapping inside one reservation, up to the limit") {
  core_options o;
  o.address_space = 64ull << 30;
  fixture f(o);
  auto s = make_stream();
  CHECK(f.pool->reservations().size() == 1);
  CHECK(f.pool->addresses_reserved() == 8ull << 30);  // the first: 8 GiB
  std::vector<std::uint64_t> p;
  std::uint64_t bytes = 0;
  try {
    for (;;) {
      p.push_back(f.pool->allocate(3ull << 30, s.key()));  // each its own chunk, mapped inside one reservation
      bytes += 3ull << 30;
    }
  } catch (const core_out_of_memory&) {
  }
  // Reservations at least double what was reserved: a few cover the limit, never more.
  const auto list = f.pool->reservations();
  CHECK(list.size() >= 3);
  CHECK(list.size() <= 6);
  CHECK(f.pool->addresses_reserved() <= o.address_space);
  CHECK(bytes >= 30ull << 30);  // most of the 64 GiB hold 3 GiB pieces, fragmented by the steps
  for (auto q : p) {
    CHECK(f.dev->is_mapped(q, 3ull << 30));
    CHECK(f.pool->owns(q));
    CHECK(f.pool->owns(q + (3ull << 30) - 1));
  }
  CHECK_FALSE(f.pool->owns(list.back().first + list.back().second));
  CHECK(f.pool->refused_reservation() == 0);  // the limit stopped it, not the driver
  for (auto q : p) f.pool->deallocate(q, s.key());
}

TEST_CASE("the process's addresses running out ends growth with core_out_of_memory, the refusal kept") {
  fixture f;
  auto s = make_stream();
  f.dev->addresses_left = 4ull << 30;  // less than any further reservation
  CHECK_THROWS_AS((void)f.pool->allocate(10ull << 30, s.key()), core_out_of_memory);
  CHECK(f.pool->refused_reservation() >= 10ull << 30);
  CHECK(f.pool->reservations().size() == 1);
  // What fits in the first reservation still works.
  const auto q = f.pool->allocate(1ull << 30, s.key());
  CHECK(f.dev->is_mapped(q, 1ull << 30));
  f.pool->deallocate(q, s.key());
}

TEST_CASE("addresses held by aliases are named when a small address space runs out") {
  core_options o = movable_chunks();
  o.address_space = 16 * MiB;  // one reservation of eight chunks
  fixture f(o);
  auto s = make_stream();
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 4; ++i) p.push_back(f.pool->allocate(2 * MiB, s.key()));
  f.dev->busy.insert(s.native);  // s's frees have not run
  f.pool->deallocate(p[0], s.key());
  f.pool->deallocate(p[2], s.key());
  const auto q = f.pool->allocate(4 * MiB, s.key());  // the two chunks, moved: 12 MiB of addresses taken
  CHECK(f.pool->statistics().remapped_chunks == 2);
  try {
    (void)f.pool->allocate(6 * MiB, s.key());
    FAIL("6 MiB fit in the 4 MiB of addresses left");
  } catch (const core_out_of_memory& e) {
    CHECK(e.reason.find("4194304 bytes of addresses held by chunks moved before the frees in them ran") !=
          std::string::npos);
  }
  // Once s has run, the old addresses come back: 8 MiB of them, in three ranges.
  host_sync(*f.dev, s);
  f.pool->on_synchronize(s.record->id());
  std::vector<std::uint64_t> more;
  for (const std::uint64_t n : {4 * MiB, 2 * MiB, 2 * MiB}) {
    more.push_back(f.pool->allocate(n, s.key()));
    CHECK(f.dev->is_mapped(more.back(), n));
  }
  for (const auto x : {q, p[1], p[3], more[0], more[1], more[2]}) f.pool->deallocate(x, s.key());
  check_nothing_lost(f, {&s});
}

TEST_CASE("grow_in_place: large allocations with room_to_grow have room after them, so several grow in turn") {
  fixture f;
  auto s = make_stream();
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 8; ++i) p.push_back(f.pool->allocate(64 * MiB, s.key(), streamalloc::placement::room_to_grow));
  for (std::uint64_t size = 128 * MiB; size <= 1024 * MiB; size *= 2) {
    for (auto q : p) CHECK(f.pool->grow_in_place(q, size, s.key()) == size);
  }
  for (auto q : p) CHECK(f.dev->is_mapped(q, 1024 * MiB));
}

TEST_CASE("placement: packed large allocations sit next to each other, away from the chunks") {
  core_options o;
  o.own_chunk_for_large = true;  // each large request one handle of its own (not the default)
  fixture f(o);
  auto s = make_stream();
  const auto small = f.pool->allocate(1 * MiB, s.key());
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 4; ++i) p.push_back(f.pool->allocate(64 * MiB, s.key()));
  // Downward from the top of the addresses, each right before the one made before it.
  for (int i = 1; i < 4; ++i) CHECK(p[i] + 64 * MiB == p[i - 1]);
  CHECK(p[0] > small + 4ull * 1024 * MiB);  // the first reservation is 8 GiB
  // So the chunk run of small allocations still grows in place behind its end...
  CHECK(f.pool->grow_in_place(small, 512 * MiB, s.key()) == 512 * MiB);
  // ...while a packed allocation has its neighbour right after it.
  CHECK(f.pool->grow_in_place(p[1], 128 * MiB, s.key()) == 0);
  CHECK(f.pool->find_live(p[1]) == std::pair{p[1], 64 * MiB});
  // The topmost one ends its reservation: a new one reserved right after it gives it room.
  CHECK(f.pool->reservations().size() == 1);
  CHECK(f.pool->grow_in_place(p[0], 128 * MiB, s.key()) == 128 * MiB);
  CHECK(f.pool->reservations().size() == 2);
  CHECK(f.pool->reservations()[1].first == p[0] + 64 * MiB);
  CHECK(f.dev->is_mapped(p[0], 128 * MiB));
  CHECK(f.pool->find_live(p[0]) == std::pair{p[0], 128 * MiB});
  // Freed neighbours coalesce across their handles: 256 MiB in one block, no growth.
  for (auto q : p) f.pool->deallocate(q, s.key());
  const auto creates = f.dev->creates;
  const auto big = f.pool->allocate(256 * MiB, s.key());
  CHECK(f.dev->creates == creates);
  CHECK(big == p[3]);
}

TEST_CASE("shrink_in_place: the rest is freed on the stream, reusable there at once") {
  core_options o;
  o.reuse = {false, false, false};
  o.chunk_size = 8 * MiB;
  o.max_size = 8 * MiB;  // the shrunk block's chunk is all there is
  fixture f(o);
  auto a = make_stream(), b = make_stream();
  const auto p = f.pool->allocate(8 * MiB, a.key());
  const auto used = f.pool->statistics().used_current;
  CHECK(f.pool->shrink_in_place(p, 1000, a.key()) == 1024);
  CHECK(f.pool->find_live(p) == std::pair{p, std::uint64_t{1024}});
  CHECK(f.pool->statistics().used_current == used - (8 * MiB - 1024));
  CHECK(f.pool->shrink_in_place(p, 1 * MiB, a.key()) == 1024);  // never grows
  // The freed tail: pending on a, so b (no proof) does not get it, a does.
  f.dev->busy.insert(a.native);
  CHECK_THROWS_AS((void)f.pool->allocate(4 * MiB, b.key()), core_out_of_memory);
  const auto r = f.pool->allocate(4 * MiB, a.key());
  CHECK(r == p + 1024);
  // And the block grows back in place once the tail is free again.
  f.pool->deallocate(r, a.key());
  CHECK(f.pool->grow_in_place(p, 8 * MiB, a.key()) == 8 * MiB);
  CHECK_THROWS_AS(f.pool->shrink_in_place(p + 256, 256, a.key()), std::invalid_argument);
}

TEST_CASE("grow_in_place: a live block in the way, or another stream's unproven free, says no") {
  core_options o;
  o.reuse = {true, false, false};
  fixture f(o);
  auto a = make_stream(), b = make_stream();
  const auto p = f.pool->allocate(1 * MiB, a.key());
  const auto q = f.pool->allocate(1 * MiB, a.key());
  REQUIRE(q == p + 1 * MiB);
  CHECK(f.pool->grow_in_place(p, 2 * MiB, a.key()) == 0);  // q is live
  CHECK(f.pool->find_live(p) == std::pair{p, 1 * MiB});
  f.dev->busy.insert(b.native);
  f.pool->deallocate(q, b.key());  // freed on b, b still busy: a may not take it
  CHECK(f.pool->grow_in_place(p, 2 * MiB, a.key()) == 0);
  a.record->wait_for(b.record->capture());  // a now runs after the free
  CHECK(f.pool->grow_in_place(p, 2 * MiB, a.key()) == 2 * MiB);
  CHECK_THROWS_AS(f.pool->grow_in_place(p + 256, 4 * MiB, a.key()), std::invalid_argument);
}

TEST_CASE("grow_in_place: the limit says no and leaves the block as it was") {
  core_options o;
  o.max_size = 128 * MiB;
  fixture f(o);
  auto s = make_stream();
  const auto p = f.pool->allocate(1 * MiB, s.key());
  CHECK(f.pool->grow_in_place(p, 100 * MiB, s.key()) == 100 * MiB);
  CHECK(f.pool->grow_in_place(p, 200 * MiB, s.key()) == 0);
  CHECK(f.pool->find_live(p) == std::pair{p, 100 * MiB});
  CHECK(f.pool->statistics().reserved_current <= 128 * MiB);
}

TEST_CASE("a host-ordered pseudo-stream: its frees are reusable by every stream at once") {
  core_options o;
  o.reuse = {false, false, false};
  o.chunk_size = 2 * MiB;
  fixture f(o);
  stream_record& host = ordering().record(~std::uint64_t{0} - 7);
  host.mark_completed(~std::uint64_t{0} >> 1);
  const stream_key h{&host, nullptr};
  auto s = make_stream();
  const auto p = f.pool->allocate(2 * MiB, h);
  f.pool->deallocate(p, h);
  CHECK(f.pool->allocate(2 * MiB, s.key()) == p);  // no policy needed: the free is complete
  // And the host never takes a stream's pending free: it grows instead.
  f.dev->busy.insert(s.native);
  f.pool->deallocate(p, s.key());
  CHECK(f.pool->allocate(2 * MiB, h) != p);
}

TEST_CASE("randomized: no overlap, only legal reuse, every byte accounted for") {
  for (std::uint64_t seed = 1; seed <= 64; ++seed) {
    CAPTURE(seed);
    std::mt19937_64 rng(seed);
    core_options o;
    o.chunk_size = (seed % 2) ? 2 * MiB : 16 * MiB;
    o.max_size = (seed % 3 == 0) ? 256 * MiB : 0;
    o.reuse = {bool(rng() % 2), bool(rng() % 2), bool(rng() % 2)};
    o.own_chunk_for_large = seed % 4 != 1;  // some seeds build large requests from chunks
    fixture f(o);
    constexpr std::size_t streams = 4;
    std::vector<test_stream> st;
    for (std::size_t i = 0; i < streams; ++i) st.push_back(make_stream());
    order_model model(streams);
    std::size_t waits_seen = 0;

    struct live_alloc {
      std::uint64_t addr, size;
      std::size_t stream;
    };
    std::vector<live_alloc> live;
    // Freed ranges not yet known reusable by everyone: (addr, size, stream, op).
    struct freed {
      std::uint64_t addr, size;
      std::size_t stream;
      std::uint64_t op;
      std::uint64_t stamp;
    };
    std::vector<freed> history;

    // The pool's own inserted waits enter the model as they happen.
    auto learn_waits = [&] {
      while (waits_seen < f.dev->waits.size()) {
        auto [waiter, waited] = f.dev->waits[waits_seen++];
        std::size_t t = 0, s = 0;
        for (std::size_t i = 0; i < streams; ++i) {
          if (st[i].native == waiter) t = i;
          if (st[i].native == waited) s = i;
        }
        model.wait(t, s);
      }
    };
    for (int step = 0; step < 4000; ++step) {
      const auto r = rng() % 100;
      const std::size_t s = rng() % streams;
      if (r < 45 || live.empty()) {
        const std::uint64_t n = (rng() % 3 == 0) ? (rng() % (8 * MiB)) + 1 : (rng() % 65536) + 1;
        std::uint64_t p = 0;
        try {
          p = f.pool->allocate(n, st[s].key());
        } catch (const core_out_of_memory&) {
          REQUIRE(o.max_size != 0);  // only a limited pool may run out here
          learn_waits();
          continue;
        }
        learn_waits();
        const std::uint64_t size = (n + 255) / 256 * 256;
        REQUIRE(f.dev->is_mapped(p, size));
        for (const auto& l : live) REQUIRE((p + size <= l.addr || l.addr + l.size <= p));
        // Every earlier free this block overlaps must be legal for stream s to reuse.
        for (const auto& h : history) {
          if (p < h.addr + h.size && h.addr < p + size) {
            INFO("reuse of a block freed on stream " << h.stream << " by stream " << s);
            INFO("free op " << h.op << ", model done " << model.done[h.stream] << ", model clock "
                            << model.clock[s][h.stream] << ", ops " << model.ops[h.stream] << "; pool: completed "
                            << st[h.stream].record->completed() << " (stamp " << h.stamp << "), ordered_after "
                            << st[s].record->ordered_after(st[h.stream].record->id()) << ", step " << step);
            REQUIRE(model.legal(s, h.stream, h.op));
          }
        }
        live.push_back({p, size, s});
        model.enqueue(s);
        f.dev->busy.insert(st[s].native);  // work on s uses it
      } else if (r < 85) {
        const std::size_t i = rng() % live.size();
        const live_alloc a = live[i];
        live[i] = live.back();
        live.pop_back();
        // Frees happen on the allocating stream, or on another after waiting for it (the
        // stream-ordered contract for freeing elsewhere).
        std::size_t fs = a.stream;
        if (rng() % 4 == 0) {
          fs = s;
          model.wait(fs, a.stream);
          st[fs].record->wait_for(st[a.stream].record->capture());
          f.dev->busy.insert(st[fs].native);  // the wait is enqueued work
        }
        f.pool->deallocate(a.addr, st[fs].key());
        history.push_back({a.addr, a.size, fs, model.enqueue(fs), st[fs].record->stamp()});
        f.dev->busy.insert(st[fs].native);
      } else if (r < 92) {
        // An event on stream s, waited on by stream t, through streamalloc's handles.
        const std::size_t t = rng() % streams;
        if (t != s) {
          model.wait(t, s);
          st[t].record->wait_for(st[s].record->capture());
          f.dev->busy.insert(st[t].native);  // the wait is enqueued work
        }
      } else if (r < 96) {
        f.dev->run(st[s].native);  // the device catches up on s, unannounced
        model.done[s] = model.ops[s];
        // Having run past its waits, s proves the work it waited for ran too.
        for (std::size_t u = 0; u < streams; ++u) model.done[u] = std::max(model.done[u], model.clock[s][u]);
      } else {
        // A host synchronization of s.
        const auto epoch = st[s].record->begin_synchronize();
        f.dev->run(st[s].native);
        model.done[s] = model.ops[s];
        for (std::size_t u = 0; u < streams; ++u) model.done[u] = std::max(model.done[u], model.clock[s][u]);
        ordering().complete_stream(*st[s].record, epoch);
      }
    }
    // Accounting: live bytes as the test counts them; physical memory as the device counts it.
    std::uint64_t live_bytes = 0;
    for (const auto& l : live) live_bytes += l.size;
    auto stats = f.pool->statistics();
    CHECK(stats.live_allocations == live.size());
    CHECK(stats.used_current >= live_bytes);  // fast-cache reuse may hand out a slightly larger block
    CHECK(stats.used_current <= live_bytes + live_bytes / 8 + live.size() * 256);
    CHECK(stats.reserved_current == f.dev->physical_used);
    CHECK(stats.reserved_current == stats.used_current + stats.free_clear + stats.free_pending);
    if (o.max_size != 0) CHECK(stats.reserved_high <= o.max_size);
    // Free everything, let the device finish, release: nothing remains.
    for (const auto& l : live) f.pool->deallocate(l.addr, st[l.stream].key());
    for (auto& x : st) host_sync(*f.dev, x);
    f.pool->trim_to(0);
    stats = f.pool->statistics();
    CHECK(stats.used_current == 0);
    CHECK(stats.reserved_current == 0);
    CHECK(f.dev->physical_used == 0);
  }
}

// The pool's allocator on a simulated device: stream-ordered reuse and its policies (events,
// raw and per-thread streams, internal dependencies, host synchronizations), statistics, bad
// frees, shutdown. Defragmentation, growth and the randomized sequences have files of their own.

#include "pool_core_support.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

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

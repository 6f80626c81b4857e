// The per-stream states of a pool: one state per stream record id, found again from any thread
// (and never from a destroyed table's thread-local cache), handed back when a retired stream is
// drained and reused for the next stream; and the lock-free live accounting summed over them,
// exact across recycling.

#include <streamalloc/detail/core/stream_table.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <future>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <vector>

using namespace streamalloc::detail;

namespace {

// The table only stores events (in each state's queue), so any type serves.
using table = stream_table<std::uint64_t>;
using state = table::state;

struct test_stream {
  stream_record* record;
  void* native;
  [[nodiscard]] std::uint64_t id() const { return record->id(); }
  [[nodiscard]] stream_key key() const { return {record, native}; }
};

/// A stream with an id no other test uses: ids never come back, as CUDA's never do.
test_stream make_stream() {
  static std::uint64_t next = 1ull << 48;
  static char handles[4096];
  const std::uint64_t id = ++next;
  return {&ordering().record(id), &handles[id % 4096]};
}

}  // namespace

TEST_CASE("one state per stream: found again by id, made once, another stream gets its own") {
  std::mutex pool_lock;
  table t;
  CHECK(t.in_use() == 0);
  CHECK(t.made() == 0);
  auto a = make_stream(), b = make_stream();
  CHECK(t.find(a.id()) == nullptr);  // lookups never make a state

  state& sa = t.state_for(a.key(), pool_lock);
  CHECK(&t.state_for(a.key(), pool_lock) == &sa);
  CHECK(t.made() == 1);
  CHECK(sa.record.get() == a.record);
  CHECK(sa.native == a.native);

  state& sb = t.state_for(b.key(), pool_lock);
  CHECK(&sb != &sa);
  CHECK(t.in_use() == 2);
  CHECK(t.made() == 2);
  CHECK(t.find(a.id()) == &sa);
  CHECK(t.find(b.id()) == &sb);
  CHECK(t.find(a.id() + 1000000) == nullptr);

  // More streams than a thread's cache of recent states holds, visited round robin: the ones
  // that fell out of the cache are found through the table, never made twice.
  std::vector<test_stream> many;
  std::vector<state*> first;
  for (int i = 0; i < 7; ++i) {
    many.push_back(make_stream());
    first.push_back(&t.state_for(many.back().key(), pool_lock));
  }
  for (int round = 0; round < 3; ++round) {
    for (std::size_t i = 0; i < many.size(); ++i) CHECK(&t.state_for(many[i].key(), pool_lock) == first[i]);
  }
  CHECK(t.made() == 9);
  CHECK(std::set<state*>(first.begin(), first.end()).size() == first.size());
}

TEST_CASE("another thread finds the same state for a stream") {
  std::mutex pool_lock;
  table t;
  auto s = make_stream();
  state& here = t.state_for(s.key(), pool_lock);
  state* there = nullptr;
  std::thread([&] { there = &t.state_for(s.key(), pool_lock); }).join();
  CHECK(there == &here);
  CHECK(t.made() == 1);

  // And the other way round: made on another thread first, found here.
  auto u = make_stream();
  std::thread([&] { there = &t.state_for(u.key(), pool_lock); }).join();
  CHECK(&t.state_for(u.key(), pool_lock) == there);
  CHECK(t.made() == 2);
}

TEST_CASE("a thread's recent states are found without the pool lock") {
  std::mutex pool_lock;
  table t;
  auto s = make_stream();
  std::promise<state*> first, second;
  std::promise<void> go;
  std::thread worker([&, go_now = go.get_future()]() mutable {
    first.set_value(&t.state_for(s.key(), pool_lock));
    go_now.wait();
    second.set_value(&t.state_for(s.key(), pool_lock));
  });
  state* const made = first.get_future().get();
  auto found = second.get_future();
  std::future_status status;
  {
    // Held while the worker looks the stream up again: a lookup that took it would wait here.
    std::lock_guard held(pool_lock);
    go.set_value();
    status = found.wait_for(std::chrono::seconds(5));
  }
  worker.join();
  CHECK(status == std::future_status::ready);
  CHECK(found.get() == made);
}

TEST_CASE("a table made where a destroyed one was does not find the old one's states") {
  std::mutex pool_lock;
  std::optional<table> t;
  auto s = make_stream();
  t.emplace();
  const table* const where = &*t;
  (void)t->state_for(s.key(), pool_lock);  // now in this thread's cache of recent states
  t.reset();
  t.emplace();
  REQUIRE(&*t == where);  // the same address: only the table's serial tells them apart
  CHECK(t->made() == 0);
  state& fresh = t->state_for(s.key(), pool_lock);
  // The old state may have been freed and its memory given to the new one, so its address
  // proves nothing: the new table must have made the state itself.
  CHECK(t->made() == 1);
  CHECK(t->in_use() == 1);
  CHECK(t->find(s.id()) == &fresh);
  CHECK(fresh.record.get() == s.record);
}

// The state a table leaves on a stream's record is what a thread using thousands of streams in
// turn finds (its cache of recent states holds four): no lock, no lookup. Two tables using one
// stream each find their own; a state taken back for another stream is no longer found there.
TEST_CASE("the state left on a stream's record: found without the lock, per table, gone when recycled") {
  std::mutex pool_lock;
  table t, u;
  std::vector<test_stream> many;
  std::vector<state*> made;
  for (int i = 0; i < 64; ++i) {
    many.push_back(make_stream());
    made.push_back(&t.state_for(many.back().key(), pool_lock));
  }
  // Far past a thread's cache of recent states: another thread finds every one while the pool
  // lock is held here, so none of its lookups took the lock.
  std::future<bool> all_found;
  std::future_status status;
  {
    std::lock_guard held(pool_lock);
    all_found = std::async(std::launch::async, [&] {
      bool ok = true;
      for (int i = 0; i < 64; ++i) ok = ok && &t.state_for(many[i].key(), pool_lock) == made[i];
      return ok;
    });
    status = all_found.wait_for(std::chrono::seconds(5));
  }
  REQUIRE(status == std::future_status::ready);
  CHECK(all_found.get());
  CHECK(many[0].record->hint_for(0) == nullptr);  // no table has serial 0
  // A second table on the same stream: its own state, and each finds its own again.
  const test_stream& s = many[0];
  state& in_u = u.state_for(s.key(), pool_lock);
  CHECK(&in_u != made[0]);
  CHECK(&t.state_for(s.key(), pool_lock) == made[0]);
  CHECK(&u.state_for(s.key(), pool_lock) == &in_u);
  CHECK(u.made() == 1);

  // Recycled: the record no longer leads to the state, which now serves another stream.
  const test_stream& gone = many[1];
  (void)t.state_for(gone.key(), pool_lock);  // the record's slot holds t's state now
  t.retire(gone.id());
  t.recycle_retired([](state&) { return true; });
  auto next = make_stream();
  CHECK(&t.state_for(next.key(), pool_lock) == made[1]);
  for (std::uint64_t serial = 0; serial < 1000; ++serial) {
    CHECK(gone.record->hint_for(serial) == nullptr);
  }
}

TEST_CASE("accounting: sums over streams are what was allocated; the peak follows and resets") {
  std::mutex pool_lock;
  table t;
  auto a = make_stream(), b = make_stream(), c = make_stream();
  state& sa = t.state_for(a.key(), pool_lock);
  state& sb = t.state_for(b.key(), pool_lock);
  state& sc = t.state_for(c.key(), pool_lock);
  CHECK(t.used_now() == 0);
  CHECK(t.live_count_now() == 0);
  CHECK(t.used_high() == 0);

  t.account_allocate(sa, 1000);
  t.account_allocate(sa, 24);
  t.account_allocate(sb, 4096);
  t.account_allocate(sc, 256);
  CHECK(t.used_now() == 1000 + 24 + 4096 + 256);
  CHECK(t.live_count_now() == 4);
  CHECK(sa.live_bytes.load() == 1024);
  CHECK(sa.live_count.load() == 2);
  CHECK(t.used_high() == 5376);  // c's allocation was a peak of its own: the sum was taken

  t.account_free(sb, 4096);
  CHECK(t.used_now() == 1280);
  CHECK(t.live_count_now() == 3);
  CHECK(t.used_high() == 5376);  // a peak stays after the bytes go

  // Resizing in place changes the bytes, not the count.
  t.account_bytes(sa, 512);
  CHECK(t.used_now() == 1792);
  t.account_bytes(sa, -1024);
  CHECK(t.used_now() == 768);
  CHECK(t.live_count_now() == 3);

  t.account_allocate(sc, 100);  // below the peak
  CHECK(t.used_high() == 5376);

  t.reset_high_water();
  CHECK(t.used_high() == t.used_now());
  CHECK(t.used_high() == 868);
  // The reset also lowered each stream's own peak: growing past what is live now is a new
  // pool peak at once (with the old per-stream peaks kept, a's 1,536 would have hidden it).
  t.account_bytes(sa, 10);
  CHECK(t.used_high() == 878);

  // note_used only ever raises the peak.
  t.note_used(100);
  CHECK(t.used_high() == 878);
  t.note_used(9000);
  CHECK(t.used_high() == 9000);
}

TEST_CASE("a peak made of several streams' moments is caught by noting what is used now") {
  std::mutex pool_lock;
  table t;
  auto a = make_stream(), b = make_stream();
  state& sa = t.state_for(a.key(), pool_lock);
  state& sb = t.state_for(b.key(), pool_lock);
  t.account_allocate(sa, 100);
  t.account_free(sa, 100);
  t.account_allocate(sb, 50);
  t.account_allocate(sa, 100);  // 150 live, but a only came back to its own earlier peak
  CHECK(t.used_now() == 150);
  // account_bytes sums the streams only at a stream's own new peak, so it may have missed
  // this one; the pool's statistics note what is used now before reading the peak.
  CHECK(t.used_high() <= 150);
  t.note_used(t.used_now());
  CHECK(t.used_high() == 150);
}

TEST_CASE("a sum seen below zero (a free counted before its allocation) reads as nothing live") {
  std::mutex pool_lock;
  table t;
  auto a = make_stream(), b = make_stream();
  state& sa = t.state_for(a.key(), pool_lock);
  state& sb = t.state_for(b.key(), pool_lock);
  t.account_free(sb, 4096);
  CHECK(t.used_now() == 0);
  CHECK(t.live_count_now() == 0);
  t.account_allocate(sa, 4096 + 300);
  CHECK(t.used_now() == 300);
  CHECK(t.live_count_now() == 0);
}

TEST_CASE("threads accounting on their own streams: the sums are exact once they are done") {
  std::mutex pool_lock;
  table t;
  constexpr int threads = 4, per = 5000;
  constexpr std::uint64_t size = 256;
  std::vector<test_stream> streams;
  for (int k = 0; k < threads; ++k) streams.push_back(make_stream());
  std::vector<std::thread> ts;
  for (int k = 0; k < threads; ++k) {
    ts.emplace_back([&, k] {
      state& st = t.state_for(streams[k].key(), pool_lock);
      for (int i = 0; i < per; ++i) t.account_allocate(st, size);
      for (int i = 0; i < per / 2; ++i) t.account_free(st, size);
    });
  }
  for (auto& x : ts) x.join();
  CHECK(t.made() == threads);
  CHECK(t.used_now() == threads * (per - per / 2) * size);
  CHECK(t.live_count_now() == threads * (per - per / 2));
  // Each stream's own top (per * size) was summed with the others' non-negative shares, and no
  // sum can exceed everything ever allocated.
  CHECK(t.used_high() >= per * size);
  CHECK(t.used_high() <= threads * per * size);
}

TEST_CASE("for_each visits every state in use once; any_of stops at the first true") {
  std::mutex pool_lock;
  table t;
  int calls = 0;
  CHECK_FALSE(t.any_of([&](state&) { return ++calls, true; }));
  CHECK(calls == 0);
  t.for_each([&](state&) { ++calls; });
  CHECK(calls == 0);

  std::vector<test_stream> streams;
  std::set<state*> made;
  for (int i = 0; i < 5; ++i) {
    streams.push_back(make_stream());
    made.insert(&t.state_for(streams.back().key(), pool_lock));
  }
  std::multiset<state*> visited;
  t.for_each([&](state& st) { visited.insert(&st); });
  CHECK(visited == std::multiset<state*>(made.begin(), made.end()));

  calls = 0;
  CHECK(t.any_of([&](state&) { return ++calls, true; }));
  CHECK(calls == 1);

  calls = 0;
  CHECK_FALSE(t.any_of([&](state&) { return ++calls, false; }));
  CHECK(calls == 5);

  // True for one state only: found, and nothing visited after it.
  state* const target = t.find(streams[2].id());
  std::vector<state*> seen;
  CHECK(t.any_of([&](state& st) {
    seen.push_back(&st);
    return &st == target;
  }));
  REQUIRE_FALSE(seen.empty());
  CHECK(seen.back() == target);
  CHECK(std::count(seen.begin(), seen.end(), target) == 1);

  // A retired stream's state is still visited until it is recycled.
  state* const retired = t.find(streams[0].id());
  t.retire(streams[0].id());
  visited.clear();
  t.for_each([&](state& st) { visited.insert(&st); });
  CHECK(visited.size() == 5);
  t.recycle_retired([](state&) { return true; });
  visited.clear();
  t.for_each([&](state& st) { visited.insert(&st); });
  CHECK(visited.size() == 4);
  CHECK(visited.count(retired) == 0);
  for (std::size_t i = 1; i < streams.size(); ++i) CHECK(visited.count(t.find(streams[i].id())) == 1);
}

TEST_CASE("a retired stream's state stays until drained, then serves the next new stream") {
  std::mutex pool_lock;
  table t;
  auto a = make_stream(), keep = make_stream();
  state& sa = t.state_for(a.key(), pool_lock);
  (void)t.state_for(keep.key(), pool_lock);
  // What the pool left in the state; reuse must start the next stream clean.
  sa.cache_bytes = 4096;
  sa.last_event_epoch = 7;
  sa.newest_stamp = 9;
  sa.peak_seen.store(12345);
  CHECK_FALSE(t.has_retiring());

  t.retire(a.id());
  CHECK(t.has_retiring());
  CHECK(t.in_use() == 2);  // retiring alone takes nothing back

  // Not drained: the state stays, found as before, and is asked again next time.
  std::vector<state*> asked;
  t.recycle_retired([&](state& st) {
    asked.push_back(&st);
    return false;
  });
  CHECK(asked == std::vector<state*>{&sa});  // only the retired stream's state is asked
  CHECK(t.in_use() == 2);
  CHECK(t.find(a.id()) == &sa);
  CHECK(t.has_retiring());

  asked.clear();
  t.recycle_retired([&](state& st) {
    asked.push_back(&st);
    return true;
  });
  CHECK(asked == std::vector<state*>{&sa});
  CHECK(t.in_use() == 1);
  CHECK(t.made() == 2);
  CHECK(t.find(a.id()) == nullptr);
  CHECK_FALSE(t.has_retiring());
  CHECK(sa.record.get() == nullptr);  // the table lets go of the stream's record

  // Nothing retiring: the callback is not called.
  asked.clear();
  t.recycle_retired([&](state& st) {
    asked.push_back(&st);
    return true;
  });
  CHECK(asked.empty());

  auto b = make_stream();
  state& sb = t.state_for(b.key(), pool_lock);
  CHECK(&sb == &sa);  // reused, not made
  CHECK(t.made() == 2);
  CHECK(t.in_use() == 2);
  CHECK(t.find(b.id()) == &sa);
  CHECK(sb.record.get() == b.record);
  CHECK(sb.native == b.native);
  CHECK(sb.cache_bytes == 0);
  CHECK(sb.last_event_epoch == 0);
  CHECK(sb.newest_stamp == 0);
  CHECK(sb.peak_seen.load() == 0);
  CHECK(sb.live_bytes.load() == 0);
  CHECK(sb.live_count.load() == 0);
}

TEST_CASE("recycling lets the stream's record go: a retired stream's record is dropped") {
  std::mutex pool_lock;
  table t;
  auto a = make_stream();
  const std::uint64_t id = a.id();
  (void)t.state_for(a.key(), pool_lock);
  ordering().retire(id);  // the stream is destroyed; the table's state still holds its record
  CHECK(ordering().find(id) != nullptr);
  t.retire(id);
  t.recycle_retired([](state&) { return true; });
  CHECK(ordering().find(id) == nullptr);
}

TEST_CASE("retiring an id twice, or one the table never saw, takes back at most one state") {
  std::mutex pool_lock;
  table t;
  auto a = make_stream();
  (void)t.state_for(a.key(), pool_lock);
  int asked = 0;
  t.retire(a.id());
  t.retire(a.id());
  t.retire(a.id() + 1000000);  // never seen here: dropped without asking
  t.recycle_retired([&](state&) { return ++asked, true; });
  CHECK(asked == 1);
  CHECK_FALSE(t.has_retiring());
  CHECK(t.in_use() == 0);
  // One spare state: the first new stream reuses it, the second needs a state of its own. Had
  // it been handed back twice, both would share it.
  auto b = make_stream(), c = make_stream();
  state& sb = t.state_for(b.key(), pool_lock);
  state& sc = t.state_for(c.key(), pool_lock);
  CHECK(&sb != &sc);
  CHECK(t.made() == 2);
}

TEST_CASE("recycling a state with bytes still live keeps the sums exact") {
  std::mutex pool_lock;
  table t;
  auto a = make_stream(), b = make_stream();
  state& sa = t.state_for(a.key(), pool_lock);
  state& sb = t.state_for(b.key(), pool_lock);
  t.account_allocate(sa, 200);
  t.account_allocate(sa, 100);
  t.account_allocate(sb, 100);
  CHECK(t.used_high() == 400);

  // a is destroyed while two of its allocations are still live (freed later, elsewhere).
  t.retire(a.id());
  t.recycle_retired([](state&) { return true; });
  CHECK(sa.live_bytes.load() == 0);  // its share moved to the table's folded totals
  CHECK(t.used_now() == 400);
  CHECK(t.live_count_now() == 3);

  auto c = make_stream();
  state& sc = t.state_for(c.key(), pool_lock);
  REQUIRE(&sc == &sa);  // a's state, reset for c
  t.account_allocate(sc, 50);
  CHECK(t.used_now() == 450);
  CHECK(t.live_count_now() == 4);
  CHECK(t.used_high() == 450);  // c's first bytes are a peak of its own: the sum was taken

  // a's allocations are freed through another state; the sums stay exact (c's share may go
  // negative, the folded share makes up for it).
  t.account_free(sc, 200);
  t.account_free(sb, 100);
  CHECK(t.used_now() == 150);
  CHECK(t.live_count_now() == 2);
  t.account_free(sc, 50);
  t.account_free(sb, 100);
  CHECK(t.used_now() == 0);
  CHECK(t.live_count_now() == 0);
  CHECK(t.used_high() == 450);

  t.reset_high_water();
  CHECK(t.used_high() == 0);
}

TEST_CASE("streams made and retired all day: as many states as were ever in use at once") {
  std::mutex pool_lock;
  table t;
  const std::size_t records_before = ordering().census().records;
  std::mt19937 rng(12345);
  std::vector<test_stream> live;
  std::size_t most_at_once = 0, streams_seen = 0;
  for (int round = 0; round < 300; ++round) {
    const std::size_t want = 1 + rng() % 6;
    while (live.size() < want) {
      live.push_back(make_stream());
      ++streams_seen;
      state& st = t.state_for(live.back().key(), pool_lock);
      t.account_allocate(st, 256);  // each stream leaves an allocation behind
      most_at_once = std::max(most_at_once, t.in_use());
    }
    // Some streams are destroyed; their states come back at once (nothing pending).
    const std::size_t retire = rng() % (live.size() + 1);
    for (std::size_t i = 0; i < retire; ++i) {
      const std::size_t at = rng() % live.size();
      const std::uint64_t id = live[at].id();
      ordering().retire(id);
      t.retire(id);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(at));
    }
    t.recycle_retired([](state&) { return true; });
    CHECK(t.in_use() == live.size());
  }
  for (const auto& s : live) {
    ordering().retire(s.id());
    t.retire(s.id());
  }
  t.recycle_retired([](state&) { return true; });
  CHECK(t.in_use() == 0);
  CHECK(streams_seen > 300);
  // A new state is made only when none is spare, i.e. when every state is in use.
  CHECK(t.made() == most_at_once);
  CHECK(t.made() <= 6);
  CHECK(t.used_now() == streams_seen * 256);  // every allocation left behind is still counted
  CHECK(t.live_count_now() == streams_seen);
  CHECK(ordering().census().records == records_before);  // no record kept for a gone stream
}

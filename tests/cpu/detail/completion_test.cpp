// How a pool learns that frees have run: which stream handle it may use when (handle_now),
// which pending blocks settle moves out and from what proof (the record, an idle stream, the
// pool's events), when events are recorded (one per look, never without a usable handle), how
// one stream is made to wait for another's frees, and how events are given back. On the
// simulated device, through a backend that counts what the tracker asked of it.

#include <streamalloc/detail/core/completion.hpp>

#include <doctest/doctest.h>

#include "sim_backend.hpp"
#include "test_streams.hpp"

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <set>
#include <utility>
#include <vector>

using namespace streamalloc::detail;
using streamalloc_test::sim_backend;
using streamalloc_test::sim_device;

namespace {

/// The simulated backend, counting the calls whose number is the tracker's contract ("one
/// event per look", "a wait, or the host's synchronize"): the device's state alone cannot tell
/// one event from two that the device has already passed, nor a synchronize from a run.
struct counting_backend : sim_backend {
  explicit counting_backend(std::shared_ptr<sim_device> d) : sim_backend{std::move(d)} {}

  int records = 0, idles = 0, waits = 0, synchronizes = 0, destroys = 0;
  void* captured = nullptr;  ///< the handle of a stream being captured, if any
  bool capturing(const stream_key& k) noexcept { return k.native == captured; }
  /// A stream whose capture another thread begins while the next event is recorded on it.
  void* capture_begins_on_record = nullptr;
  int lost = 0;  ///< events destroyed after a record that may have gone into a capture
  bool lost_to_capture(const stream_key& k, event& e) noexcept {
    if (!capturing(k)) return false;
    ++lost;
    sim_backend::destroy(e);
    return true;
  }
  /// ('s' synchronize | 'd' destroy, event) in call order: drop_events must wait before it destroys.
  std::vector<std::pair<char, event>> log;

  event record(const stream_key& k) {
    ++records;
    if (k.native == capture_begins_on_record) captured = k.native;
    return sim_backend::record(k);
  }
  bool idle(const stream_key& k) {
    ++idles;
    return sim_backend::idle(k);
  }
  void wait(const stream_key& k, event& e) {
    ++waits;
    sim_backend::wait(k, e);
  }
  void synchronize(event& e) noexcept {
    ++synchronizes;
    log.emplace_back('s', e);
    sim_backend::synchronize(e);
  }
  void destroy(event& e) noexcept {
    ++destroys;
    log.emplace_back('d', e);
    sim_backend::destroy(e);
  }
};
static_assert(pool_backend<counting_backend>);

using tracker = completion_tracker<counting_backend>;
using state = tracker::state;

using test_support::make_stream;
using test_support::same_handle;
using test_support::test_stream;

struct fixture {
  std::shared_ptr<sim_device> dev = std::make_shared<sim_device>();
  counting_backend backend{dev};
  tracker completion{backend};
  std::deque<block> blocks;  // a deque: blocks stay where they are while more are made
  std::uint64_t next_addr = 0x10000000;

  /// A block freed on `st`'s stream now, put in its pending bins as pool_core's free_pending
  /// does (stamped with the stream's epoch, newest_stamp raised).
  block* free_on(state& st, std::uint64_t size = 4096) {
    block& b = blocks.emplace_back();
    b.addr = next_addr;
    next_addr += size + 4096;  // not adjacent: the bins never see neighbours anyway
    b.size = size;
    b.stream = st.record->id();
    b.stamp = st.record->stamp();
    b.state = block_state::pending;
    st.newest_stamp = std::max(st.newest_stamp, b.stamp);
    st.pending.insert(&b);
    return &b;
  }
  /// The simulated device's stream behind `native` has run its first `n` enqueued operations.
  void run_to(void* native, std::uint64_t n) { dev->streams[native].completed = n; }
};

std::set<block*> as_set(const std::vector<block*>& v) { return {v.begin(), v.end()}; }

}  // namespace

TEST_CASE("handle_now: a stable handle always; a raw one only to a call on that very stream; none while captured") {
  fixture f;
  auto stable = make_stream(true), raw = make_stream(false), other = make_stream(true);
  state st_stable(stable.key()), st_raw(raw.key());

  // Stable: the state's own handle, whoever calls, even a call that was given no handle.
  CHECK(f.completion.handle_now(st_stable, stream_key{}) == stable.native);
  CHECK(f.completion.handle_now(st_stable, other.key()) == stable.native);

  // Raw: the handle the state was first seen with may name another stream by now.
  CHECK(f.completion.handle_now(st_raw, stream_key{}) == nullptr);
  CHECK(f.completion.handle_now(st_raw, other.key()) == nullptr);
  // Another stream behind the same handle value is still another stream.
  CHECK(f.completion.handle_now(st_raw, same_handle(raw).key()) == nullptr);
  // The call in progress is on this stream: the handle it was given, not the remembered one.
  test_stream again = raw;
  static char moved;
  again.native = &moved;  // the per-thread default stream's handle as another thread sees it
  CHECK(f.completion.handle_now(st_raw, again.key()) == &moved);
  CHECK(f.completion.handle_now(st_raw, raw.key_without_handle()) == nullptr);

  // A stable stream that retired: its handle may already belong to a new stream.
  auto retiring = make_stream(true);
  state st_retiring(retiring.key());
  retiring.record->mark_retired();
  CHECK(f.completion.handle_now(st_retiring, stream_key{}) == nullptr);
  CHECK(f.completion.handle_now(st_retiring, other.key()) == nullptr);

  // A stream being captured into a graph runs nothing now: not queried, not recorded on.
  f.backend.captured = stable.native;
  CHECK(f.completion.handle_now(st_stable, stream_key{}) == nullptr);
  f.backend.captured = &moved;
  CHECK(f.completion.handle_now(st_raw, again.key()) == nullptr);
  f.backend.captured = nullptr;
  CHECK(f.completion.handle_now(st_stable, stream_key{}) == stable.native);
}

TEST_CASE("settle without queries: only blocks stamped at or before the record's completion move") {
  fixture f;
  auto s = make_stream(true);
  state st(s.key());
  std::vector<block*> ready;

  block* early = f.free_on(st);
  block* early2 = f.free_on(st, 8192);
  const std::uint64_t point = s.record->begin_synchronize();  // a host sync starts here
  block* late = f.free_on(st);
  REQUIRE(early->stamp <= point);
  REQUIRE(late->stamp > point);

  // Nothing known complete yet: nothing moves, and the device is not asked.
  f.completion.settle(st, /*query_events=*/false, s.key(), ready);
  CHECK(ready.empty());
  CHECK(st.pending.count() == 3);

  s.record->mark_completed(point);
  f.completion.settle(st, /*query_events=*/false, s.key(), ready);
  CHECK(as_set(ready) == std::set<block*>{early, early2});
  CHECK(st.pending.count() == 1);
  CHECK(early->bins == nullptr);
  CHECK(late->bins == &st.pending);
  // Without queries the tracker learns nothing itself, even with a usable handle.
  CHECK(f.backend.idles == 0);
  CHECK(f.backend.records == 0);
  CHECK(st.events.empty());

  // Appends: what a caller already collected stays.
  s.record->mark_completed(late->stamp);
  f.completion.settle(st, /*query_events=*/false, s.key(), ready);
  CHECK(ready.size() == 3);
  CHECK(ready.back() == late);
  CHECK(st.pending.empty());
}

TEST_CASE("settle on an idle stream: one query completes every free made before it, no event") {
  for (bool stable : {true, false}) {
    CAPTURE(stable);
    fixture f;
    auto s = make_stream(stable);
    auto before = make_stream(true);
    state st(s.key());
    std::vector<block*> ready;
    block* a = f.free_on(st);
    block* b = f.free_on(st, 1 << 20);
    // s was ordered after `before` (an event wait): s having run all its work, so has `before`
    // up to the point waited for.
    const clock_snapshot waited = before.record->capture();
    s.record->wait_for(waited);

    // A raw stream's handle is usable only during a call on it: the call in progress is.
    f.completion.settle(st, /*query_events=*/true, s.key(), ready);
    CHECK(f.backend.idles == 1);
    CHECK(as_set(ready) == std::set<block*>{a, b});
    CHECK(st.pending.empty());
    CHECK(s.record->completed() >= b->stamp);
    CHECK(before.record->completed() >= waited.epoch);
    // The idle stream proved everything: an event would only have cost a record.
    CHECK(f.backend.records == 0);
    CHECK(st.events.empty());
    // ... up to the question and not after it: a free made now is not complete.
    CHECK(s.record->stamp() > s.record->completed());
  }
}

TEST_CASE("settle asks nothing about a stream whose handle it may not use now") {
  fixture f;
  auto raw = make_stream(false), caller = make_stream(true);
  state st(raw.key());
  std::vector<block*> ready;
  f.free_on(st);
  // The remembered handle of an idle (per the sim) raw stream, asked about from another
  // stream's call, or from a call on the same handle value that is another stream now.
  for (const stream_key& k : {stream_key{}, caller.key(), same_handle(raw).key(), raw.key_without_handle()}) {
    f.completion.settle(st, /*query_events=*/true, k, ready);
  }
  CHECK(f.backend.idles == 0);
  CHECK(f.backend.records == 0);
  CHECK(ready.empty());
  CHECK(st.pending.count() == 1);
}

TEST_CASE("settle on a busy stream: one event covering the newest free, polled until passed") {
  fixture f;
  auto s = make_stream(true);
  state st(s.key());
  std::vector<block*> ready;
  f.dev->busy.insert(s.native);  // a kernel on s still uses what was freed

  block* a = f.free_on(st);
  block* b = f.free_on(st, 8192);
  f.completion.settle(st, /*query_events=*/true, stream_key{}, ready);
  // Asked from another stream's call, the stream is not asked whether it is idle (that would
  // invalidate a capture its owner began meanwhile): an event covers its frees.
  CHECK(f.backend.idles == 0);
  CHECK(ready.empty());
  // One event for both frees, not one per free, and it covers the newest.
  CHECK(f.backend.records == 1);
  REQUIRE(st.events.size() == 1);
  const std::uint64_t first_epoch = st.events.back().epoch;
  CHECK(first_epoch >= b->stamp);
  CHECK(st.last_event_epoch == first_epoch);
  CHECK(f.dev->events.at(st.events.back().ev).stream == s.native);

  // Another look with no new free: the event already covers them all.
  f.completion.settle(st, /*query_events=*/true, stream_key{}, ready);
  CHECK(f.backend.records == 1);
  CHECK(st.events.size() == 1);
  CHECK(ready.empty());

  // A free after the event: the next look covers it with a second event.
  block* c = f.free_on(st);
  CHECK(c->stamp > first_epoch);
  f.completion.settle(st, /*query_events=*/true, stream_key{}, ready);
  CHECK(f.backend.records == 2);
  REQUIRE(st.events.size() == 2);
  CHECK(st.events.back().epoch >= c->stamp);
  CHECK(ready.empty());

  // The device passes the first event only (the stream stays busy, so the idle query proves
  // nothing and the events are the only proof): a and b move, c waits for the second event.
  f.run_to(s.native, 1);
  f.completion.settle(st, /*query_events=*/true, stream_key{}, ready);
  CHECK(s.record->completed() == first_epoch);
  CHECK(as_set(ready) == std::set<block*>{a, b});
  CHECK(st.pending.count() == 1);
  CHECK(st.events.size() == 1);
  CHECK(f.backend.destroys == 1);
  CHECK(f.dev->live_events == 1);
  CHECK(f.backend.records == 2);  // c is covered already

  f.run_to(s.native, 2);
  f.completion.settle(st, /*query_events=*/true, stream_key{}, ready);
  CHECK(ready.size() == 3);
  CHECK(ready.back() == c);
  CHECK(st.pending.empty());
  CHECK(st.events.empty());
  CHECK(f.dev->live_events == 0);
  CHECK(f.backend.records == 2);
}

TEST_CASE("settle polls a raw stream's events even when its handle may not be used") {
  fixture f;
  auto raw = make_stream(false), other = make_stream(true);
  state st(raw.key());
  std::vector<block*> ready;
  f.dev->busy.insert(raw.native);
  block* a = f.free_on(st);
  f.completion.cover(st, raw.key());  // during a call on raw: the one chance to record
  REQUIRE(st.events.size() == 1);

  f.completion.settle(st, /*query_events=*/true, other.key(), ready);
  CHECK(ready.empty());  // not passed yet

  f.dev->run(raw.native);
  f.completion.settle(st, /*query_events=*/true, other.key(), ready);
  CHECK(ready == std::vector<block*>{a});
  CHECK(st.events.empty());
  CHECK(f.dev->live_events == 0);
  CHECK(f.backend.idles == 0);  // never asked about the remembered handle
  CHECK(f.backend.records == 1);
}

TEST_CASE("cover: an event only for frees newer than the last event and not known complete") {
  fixture f;
  auto s = make_stream(false);
  state st(s.key());

  // Nothing pending: nothing to cover.
  f.completion.cover(st, s.key());
  CHECK(f.backend.records == 0);

  block* a = f.free_on(st);
  // A call given no handle (synchronous) cannot record, whatever is pending.
  f.completion.cover(st, s.key_without_handle());
  CHECK(f.backend.records == 0);
  CHECK(st.events.empty());

  f.completion.cover(st, s.key());
  CHECK(f.backend.records == 1);
  REQUIRE(st.events.size() == 1);
  CHECK(st.events.back().epoch >= a->stamp);
  CHECK(st.last_event_epoch == st.events.back().epoch);
  // Recorded on the handle of the call in progress.
  CHECK(f.dev->events.at(st.events.back().ev).stream == s.native);

  // Already covered.
  f.completion.cover(st, s.key());
  CHECK(f.backend.records == 1);

  // A newer free: covered by a new event.
  block* b = f.free_on(st);
  f.completion.cover(st, s.key());
  CHECK(f.backend.records == 2);
  REQUIRE(st.events.size() == 2);
  CHECK(st.events.back().epoch >= b->stamp);

  // A newer free already known complete (a host synchronization): no event is worth it.
  f.free_on(st);
  s.record->mark_completed(s.record->begin_synchronize());
  f.completion.cover(st, s.key());
  CHECK(f.backend.records == 2);
  CHECK(st.events.size() == 2);
}

TEST_CASE("latest_cover: a new event where the handle may be used, else the newest recorded") {
  SUBCASE("stable handle: records now, each time") {
    fixture f;
    auto s = make_stream(true);
    state st(s.key());
    block* a = f.free_on(st);
    const std::uint64_t e1 = f.completion.latest_cover(st);
    CHECK(e1 >= a->stamp);
    CHECK(f.backend.records == 1);
    REQUIRE(st.events.size() == 1);
    CHECK(st.events.back().epoch == e1);
    CHECK(st.last_event_epoch == e1);
    CHECK(f.dev->events.at(st.events.back().ev).stream == s.native);
    // Whatever the frees since the last one: the newest point of the stream is what a waiter
    // gets ordered after.
    const std::uint64_t e2 = f.completion.latest_cover(st);
    CHECK(e2 > e1);
    CHECK(f.backend.records == 2);
    CHECK(st.events.back().epoch == e2);
    CHECK(st.last_event_epoch == e2);
  }
  SUBCASE("raw handle: never records; the newest event recorded while in hand, else 0") {
    fixture f;
    auto s = make_stream(false);
    state st(s.key());
    f.free_on(st);
    CHECK(f.completion.latest_cover(st) == 0);
    CHECK(f.backend.records == 0);

    f.completion.cover(st, s.key());
    f.free_on(st);
    f.completion.cover(st, s.key());
    REQUIRE(st.events.size() == 2);
    CHECK(f.completion.latest_cover(st) == st.events.back().epoch);
    CHECK(f.completion.latest_cover(st) > st.events.front().epoch);
    CHECK(f.backend.records == 2);
  }
}

TEST_CASE("an event recorded while another thread begins capturing the stream covers nothing") {
  fixture f;
  auto s = make_stream(true);
  state st(s.key());
  f.free_on(st);
  const std::uint64_t first = f.completion.latest_cover(st);  // a real one
  REQUIRE(first != 0);
  f.free_on(st);
  f.backend.capture_begins_on_record = s.native;
  // The stream was not capturing when asked; it is after the record: the record may be a node
  // of the capture. No event joins the list, so no waiter is made to join that capture, and
  // the newest real event is what a waiter may still be ordered after.
  CHECK(f.completion.latest_cover(st) == first);
  CHECK(f.backend.records == 2);
  CHECK(f.backend.lost == 1);
  REQUIRE(st.events.size() == 1);
  CHECK(st.last_event_epoch == first);
  // The same through cover, on the stream's own call.
  f.backend.captured = nullptr;
  f.free_on(st);
  f.completion.cover(st, s.key());
  CHECK(f.backend.lost == 2);
  CHECK(st.events.size() == 1);
  // Once the capture is over, events cover again.
  f.backend.capture_begins_on_record = nullptr;
  f.backend.captured = nullptr;
  f.completion.cover(st, s.key());
  CHECK(st.events.size() == 2);
  CHECK(st.last_event_epoch > first);
}

TEST_CASE("wait_for_latest: a stream wait (or the host's) on the newest event, and the registry learns it") {
  SUBCASE("waiter with a handle: a stream wait") {
    fixture f;
    auto freer = make_stream(true), waiter = make_stream(true);
    state st(freer.key()), wst(waiter.key());
    f.dev->busy.insert(freer.native);
    block* a = f.free_on(st);
    const std::uint64_t epoch = f.completion.latest_cover(st);
    REQUIRE(epoch >= a->stamp);
    CHECK(waiter.record->ordered_after(freer.record->id()) == 0);

    f.completion.wait_for_latest(wst, waiter.key(), st, epoch);
    CHECK(f.backend.waits == 1);
    CHECK(f.backend.synchronizes == 0);
    REQUIRE(f.dev->waits.size() == 1);
    CHECK(f.dev->waits.back() == std::make_pair(waiter.native, freer.native));
    CHECK(waiter.record->ordered_after(freer.record->id()) == epoch);
    // The frees are ordered before the waiter's work, not complete: nothing is claimed of them.
    CHECK(freer.record->completed() < a->stamp);
    CHECK(ordering().reusable(freer.record->id(), a->stamp, *waiter.record, /*follow_events=*/true));
    CHECK_FALSE(ordering().reusable(freer.record->id(), a->stamp, *waiter.record, /*follow_events=*/false));
  }
  SUBCASE("waiter without a handle (a synchronous call): the host waits") {
    fixture f;
    auto freer = make_stream(false), waiter = make_stream(true);
    state st(freer.key()), wst(waiter.key());
    f.dev->busy.insert(freer.native);
    f.free_on(st);
    f.completion.cover(st, freer.key());  // while freer was in hand
    const std::uint64_t epoch = f.completion.latest_cover(st);
    REQUIRE(epoch != 0);
    const auto ev = st.events.back().ev;
    CHECK_FALSE(f.backend.done(st.events.back().ev));

    f.completion.wait_for_latest(wst, waiter.key_without_handle(), st, epoch);
    CHECK(f.backend.synchronizes == 1);
    CHECK(f.backend.waits == 0);
    CHECK(f.dev->waits.empty());
    REQUIRE(f.backend.log.size() == 1);
    CHECK(f.backend.log.back() == std::make_pair('s', ev));
    CHECK(f.backend.done(st.events.back().ev));  // the host waited for exactly that event
    CHECK(waiter.record->ordered_after(freer.record->id()) == epoch);
  }
}

TEST_CASE("drop_events: every event given back, done or not; with wait, each waited for first") {
  for (bool wait : {false, true}) {
    CAPTURE(wait);
    fixture f;
    auto s = make_stream(true);
    state st(s.key());
    f.dev->busy.insert(s.native);
    f.free_on(st);
    f.completion.cover(st, s.key());
    f.free_on(st);
    f.completion.cover(st, s.key());
    f.free_on(st);
    f.completion.cover(st, s.key());
    REQUIRE(st.events.size() == 3);
    f.run_to(s.native, 1);  // one done, two not
    std::vector<std::uint64_t> evs;
    for (const auto& pe : st.events) evs.push_back(pe.ev);

    f.completion.drop_events(st, wait);
    CHECK(st.events.empty());
    CHECK(f.dev->live_events == 0);
    CHECK(f.dev->events.empty());
    CHECK(f.backend.destroys == 3);
    CHECK(f.backend.synchronizes == (wait ? 3 : 0));
    std::vector<std::pair<char, std::uint64_t>> expected;
    for (auto e : evs) {
      if (wait) expected.emplace_back('s', e);
      expected.emplace_back('d', e);
    }
    CHECK(f.backend.log == expected);
    // Waiting is the host's: without it the device was left where it was.
    CHECK(f.dev->streams[s.native].completed == (wait ? 3u : 1u));
    // Giving events back proves nothing about the frees.
    CHECK(s.record->completed() == 0);
  }
}

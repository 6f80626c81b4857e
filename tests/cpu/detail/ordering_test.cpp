#include <streamalloc/detail/core/ordering.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <thread>
#include <vector>

using namespace streamalloc::detail;

namespace {
std::uint64_t fresh_id() {
  static std::uint64_t next = 1ull << 50;
  return ++next;
}
}  // namespace

TEST_CASE("a free before an event record is ordered before every stream that waits on it") {
  auto& reg = ordering();
  stream_record& a = reg.record(fresh_id());
  stream_record& b = reg.record(fresh_id());
  stream_record& c = reg.record(fresh_id());

  const auto f1 = a.stamp();                 // a free on a
  CHECK_FALSE(reg.reusable(a.id(), f1, b, true));
  const clock_snapshot e = a.capture();      // an event recorded on a after it
  const auto f2 = a.stamp();                 // a free after the event
  b.wait_for(e);
  CHECK(reg.reusable(a.id(), f1, b, true));
  CHECK_FALSE(reg.reusable(a.id(), f1, b, false));  // policy off: waits do not count
  CHECK_FALSE(reg.reusable(a.id(), f2, b, true));   // the later free is not covered

  // Transitive: c waits on an event of b recorded after b waited on a.
  const clock_snapshot e2 = b.capture();
  c.wait_for(e2);
  CHECK(reg.reusable(a.id(), f1, c, true));
  CHECK_FALSE(reg.reusable(a.id(), f2, c, true));
}

TEST_CASE("a host synchronization makes earlier frees reusable by anyone, later ones not") {
  auto& reg = ordering();
  stream_record& a = reg.record(fresh_id());
  stream_record& b = reg.record(fresh_id());
  const auto before = a.stamp();
  const auto sync = a.begin_synchronize();
  const auto after = a.stamp();
  reg.complete_stream(a, sync);
  CHECK(reg.reusable(a.id(), before, b, false));
  CHECK_FALSE(reg.reusable(a.id(), after, b, false));
}

TEST_CASE("completing a stream completes what it was ordered after") {
  auto& reg = ordering();
  stream_record& a = reg.record(fresh_id());
  stream_record& b = reg.record(fresh_id());
  stream_record& c = reg.record(fresh_id());
  const auto f = a.stamp();
  b.wait_for(a.capture());
  reg.complete_stream(b, b.begin_synchronize());
  CHECK(reg.reusable(a.id(), f, c, false));

  // And a completed event completes its stream up to the record.
  const auto g = c.stamp();
  const clock_snapshot e = c.capture();
  CHECK_FALSE(reg.reusable(c.id(), g, a, false));
  reg.complete(e);
  CHECK(reg.reusable(c.id(), g, a, false));
}

TEST_CASE("a stream's own frees are always reusable by it") {
  auto& reg = ordering();
  stream_record& a = reg.record(fresh_id());
  CHECK(reg.reusable(a.id(), a.stamp(), a, false));
}

TEST_CASE("retiring a stream marks its record, and only its record") {
  ordering_registry reg;
  const std::uint64_t id = 0xABCDEF01, other = 0xABCDEF02;
  CHECK_FALSE(reg.record(id).retired());
  reg.retire(id);
  CHECK(reg.record(id).retired());
  CHECK_FALSE(reg.record(other).retired());
}

// A clock remembers the streams of its most recent waits, at most 2 * max_clock_entries of
// them: forgetting only loses orderings (less reuse), never claims one that did not happen.
// Checked against an exact, unbounded model of the same waits.
TEST_CASE("clocks stay bounded in a ring of 300 streams, remember the latest waits, and claim nothing false") {
  auto& reg = ordering();
  constexpr int n = 300;
  std::vector<stream_record*> r;
  for (int i = 0; i < n; ++i) r.push_back(&reg.record(fresh_id()));
  std::vector<std::map<std::uint64_t, std::uint64_t>> truth(n);  // stream -> epoch ordered after
  std::size_t largest = 0;
  for (int round = 0; round < 4 * n; ++round) {
    const int i = round % n, j = (i + 1) % n;
    const clock_snapshot point = r[i]->capture();
    r[j]->wait_for(point);
    // The model: j is ordered after point, and after everything i was ordered after.
    auto& t = truth[j];
    t[r[i]->id()] = std::max(t[r[i]->id()], point.epoch);
    for (const auto& [s, e] : truth[i]) {
      if (s != r[j]->id()) t[s] = std::max(t[s], e);
    }
    CHECK(r[j]->ordered_after(r[i]->id()) == t[r[i]->id()]);  // the wait just made is known
    for (const auto& [s, e] : r[j]->clock()) {
      CHECK(e <= t[s]);  // no ordering the model does not have
    }
    largest = std::max(largest, r[j]->clock().size());
  }
  CHECK(largest <= 2 * stream_record::max_clock_entries);
  CHECK(largest > stream_record::max_clock_entries);  // the ring did fill clocks up
}

// A retired stream's record is dropped once nothing holds it; later records start their epochs
// above its, so a clock entry or token still naming it never matches a stamp made afterwards.
TEST_CASE("a retired record goes when its last holder lets go; later records start above its epochs") {
  auto& reg = ordering();
  const std::uint64_t id = fresh_id();
  std::uint64_t last_epoch = 0;
  {
    record_ref held(reg.record(id));
    for (int i = 0; i < 100; ++i) (void)held->capture();
    last_epoch = held->current_epoch();
    const record_ref second = held;  // a pool's state, say
    reg.retire(id);
    CHECK(reg.find(id) == second.get());  // retired, but held twice
    held.reset();
    CHECK(reg.find(id) == second.get());  // still held once
  }
  CHECK(reg.find(id) == nullptr);
  // A completion naming the gone stream neither fails nor brings it back.
  reg.complete(clock_snapshot{id, last_epoch, {}});
  CHECK(reg.find(id) == nullptr);
  stream_record& later = reg.record(fresh_id());
  CHECK(later.current_epoch() > last_epoch);
  CHECK(later.stamp() > last_epoch);
}

TEST_CASE("a record not retired stays without holders; one retired with none goes at once") {
  auto& reg = ordering();
  const std::uint64_t kept = fresh_id(), gone = fresh_id();
  { const record_ref r(reg.record(kept)); }
  CHECK(reg.find(kept) != nullptr);  // a raw stream's: nothing says it was destroyed
  (void)reg.record(gone);
  reg.retire(gone);
  CHECK(reg.find(gone) == nullptr);
}

TEST_CASE("a device-wide synchronization holds the records it covers while a stream retires") {
  auto& reg = ordering();
  const std::uint64_t id = fresh_id();
  (void)reg.record(id);
  const auto before = reg.census().records;
  {
    auto points = reg.begin_synchronize_all();
    reg.retire(id);
    CHECK(reg.find(id) != nullptr);  // held by `points`
    reg.complete_all(points);
  }
  CHECK(reg.find(id) == nullptr);
  CHECK(reg.census().records == before - 1);
}

TEST_CASE("a listener being removed is never called after remove_listener returns") {
  // A pool removes itself as it is destroyed, while another thread may be telling every pool of
  // a synchronization. Told from a copy of the list, a pool destroyed meanwhile was called
  // after it was gone. Here the call in progress waits (up to a second) for the removal to
  // return: it must not, until the call is over.
  struct slow_listener final : completion_listener {
    std::atomic<bool> entered{false};
    std::atomic<bool> removed{false};
    std::atomic<bool> called_after_removal{false};
    void on_synchronize(std::uint64_t stream) noexcept override {
      if (stream != 7) return;  // other tests' synchronizations: not this one
      entered = true;
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
      while (!removed && std::chrono::steady_clock::now() < until) std::this_thread::yield();
      if (removed) called_after_removal = true;
    }
    void on_retire(std::uint64_t, bool) noexcept override {}
  };
  slow_listener l;
  auto& reg = ordering();
  reg.add_listener(&l);
  std::thread teller([&] { reg.notify(7); });
  while (!l.entered) std::this_thread::yield();
  reg.remove_listener(&l);  // waits for the call in progress
  l.removed = true;
  teller.join();
  CHECK_FALSE(l.called_after_removal);
}

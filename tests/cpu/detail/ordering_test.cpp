#include <streamalloc/detail/ordering.hpp>

#include <doctest/doctest.h>

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

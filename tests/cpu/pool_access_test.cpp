// The ordering a pool needs when streams of more than one device use its memory, against the
// fake driver (tests/fake_driver), run with three devices of which device 2 is nobody's peer:
// device-wide synchronizations counted per pool (synchronization domains).

#include <streamalloc/pool.hpp>

#include <doctest/doctest.h>

#include <cstdint>

using namespace streamalloc;

TEST_SUITE("pool_access") {

TEST_CASE("synchronization domains: a pool's memory that other devices use needs their synchronizations too") {
  auto& o = detail::ordering();
  // Devices 40 to 42 of the registry, which no other test touches.
  const int a = o.open_sync_domain(40), b = o.open_sync_domain(40);
  CHECK(a >= 64);
  CHECK(a != b);
  CHECK(a % 64 == 40);
  o.add_domain_user(a, 41);  // a's memory is used by device 41's streams; b's is not
  CHECK(o.domain_users(a) == std::uint64_t{1} << 41);
  CHECK(o.domain_users(b) == 0);
  const std::uint64_t mark = o.device_syncs_begun(a);
  CHECK(o.device_syncs_begun(b) == mark);  // one sequence for devices and domains
  CHECK(o.device_syncs_begun(41) == mark);
  const auto s41 = o.begin_device_sync(41);
  o.end_device_sync(41, s41);
  CHECK(o.device_syncs_done(41) > mark);       // the peer's own work: its own synchronization
  CHECK_FALSE(o.device_syncs_done(a) > mark);  // not the memory's device's
  CHECK_FALSE(o.device_syncs_done(b) > mark);
  const auto s40 = o.begin_device_sync(40);
  o.end_device_sync(40, s40);
  CHECK(o.device_syncs_done(a) > mark);
  CHECK(o.device_syncs_done(b) > mark);  // another pool of the device: its device's alone
  // One begun before the mark does not count.
  const auto early = o.begin_device_sync(42);
  const int c = o.open_sync_domain(42);
  const std::uint64_t mark42 = o.device_syncs_begun(c);
  o.end_device_sync(42, early);
  CHECK_FALSE(o.device_syncs_done(c) > mark42);
  const auto late = o.begin_device_sync(42);
  o.end_device_sync(42, late);
  CHECK(o.device_syncs_done(c) > mark42);
  // Closed domains' ids come back without their users; a device is never its own user.
  o.close_sync_domain(a);
  const int again = o.open_sync_domain(40);
  CHECK(again == a);
  CHECK(o.domain_users(again) == 0);
  o.add_domain_user(again, 40);
  CHECK(o.domain_users(again) == 0);
  for (int d : {again, b, c}) o.close_sync_domain(d);
}

}  // TEST_SUITE

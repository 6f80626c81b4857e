// The ordering a pool needs when streams of more than one device use its memory, against the
// fake driver (tests/fake_driver), run with three devices of which device 2 is nobody's peer:
// device-wide synchronizations counted per pool (synchronization domains), and each device's
// legacy default stream reached in that device's context.

#include <streamalloc/detail/driver/driver_api.hpp>
#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include <doctest/doctest.h>

#include "fake_driver.hpp"

#include <cstdint>
#include <thread>

using namespace streamalloc;
namespace cu = streamalloc::detail::cu;
using streamalloc_test::fake_legacy_stream_calls;

namespace {
constexpr std::size_t MiB = std::size_t{1} << 20;

/// Chunks of one granule, every free memory kept, no reuse across streams: what is mapped is
/// exactly what the test asks for.
pool_properties small_chunks(memory_location where = memory_location::device(0)) {
  pool_properties p;
  p.location = where;
  p.chunk_size = 2 * MiB;
  p.release_threshold = SIZE_MAX;
  p.reuse = {false, false, false};
  return p;
}
}  // namespace

TEST_SUITE("pool_access") {

TEST_CASE("another device's legacy default stream is reached in that device's context, from any thread") {
  // A pool of device 1 (with peer access, a pool of device 0 too) used on the legacy stream by a
  // thread with device 1 current: that handle names device 1's legacy stream there.
  pool p1(small_chunks(memory_location::device(1)));
  std::thread([&] {
    cu::cuCtxSetCurrent(detail::primary_context(1));
    void* x = p1.allocate(MiB, stream_ref::legacy_default());
    p1.deallocate(x, stream_ref::legacy_default());
  }).join();
  // The pool learns whether that free ran from this thread, with device 0 current: asking the
  // legacy handle here would reach device 0's legacy stream and take its idleness for device 1's.
  cu::cuCtxSetCurrent(detail::primary_context(0));
  const long long on0 = fake_legacy_stream_calls(0), on1 = fake_legacy_stream_calls(1);
  const pool_close_report r = p1.close();  // asks whether any free may still run
  CHECK(r.live_allocations == 0);
  CHECK(fake_legacy_stream_calls(1) > on1);
  CHECK(fake_legacy_stream_calls(0) == on0);
}

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

// Peer access to a pool's memory (pool::set_access, pool::access) against the fake driver
// (tests/fake_driver), run with three devices of which device 2 is nobody's peer: what is
// refused and when, the access the driver holds on every mapping the pool makes (before and
// after a grant, through growth, defragmentation, grow_in_place and graphs), the streams of
// devices with and without access, and the ordering a peer device's work needs (its events,
// its legacy stream, device-wide synchronizations). The GPU test (tests/gpu/peer_access_test.cu)
// checks the same on two real GPUs with kernels.

#include <streamalloc/detail/driver/driver_api.hpp>
#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>
#include <streamalloc/stream_buffer.hpp>

#include <doctest/doctest.h>

#include "fake_driver.hpp"

#include <atomic>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using namespace streamalloc;
namespace cu = streamalloc::detail::cu;
using streamalloc_test::fake_legacy_stream_calls;
using streamalloc_test::fake_live;
using streamalloc_test::fake_mappings_with_access;
using streamalloc_test::fake_set_access_calls;
using streamalloc_test::message_of;
using streamalloc_test::MiB;
using streamalloc_test::reaper_idle;

namespace {
constexpr unsigned long long none_flags = CU_MEM_ACCESS_FLAGS_PROT_NONE;
constexpr unsigned long long read_flags = CU_MEM_ACCESS_FLAGS_PROT_READ;
constexpr unsigned long long rw_flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;

/// Every mapping the fake driver holds gives `device` the access `flags` (the test's pools are
/// the only mappings alive).
bool all_mappings(int device, unsigned long long flags) {
  const int mapped = fake_live().mappings;
  return mapped > 0 && fake_mappings_with_access(device, flags) == mapped;
}

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

/// A raw stream of `device`, made without streamalloc (its handle is not known to stay valid).
CUstream raw_stream(int device) {
  const detail::scoped_context on_device(detail::primary_context(device));
  CUstream s = nullptr;
  cu::cuStreamCreateWithPriority(&s, CU_STREAM_NON_BLOCKING, 0);
  return s;
}

}  // namespace

TEST_SUITE("pool_access") {

TEST_CASE("a device that is not a peer is refused at once, naming both devices, even on an empty pool") {
  pool p0(small_chunks());
  const long long calls = fake_set_access_calls();
  // The driver would accept this grant on a pool without memory and fail the next allocation.
  CHECK_THROWS_WITH_AS(p0.set_access(memory_location::device(2), access_flags::read_write),
                       doctest::Contains("streamalloc::pool::set_access: device 2 cannot access the memory of device 0"),
                       not_supported);
  CHECK_THROWS_WITH_AS(p0.set_access(memory_location::device(2), access_flags::read),
                       doctest::Contains("cuDeviceCanAccessPeer(2, 0) is 0"), not_supported);
  CHECK(p0.access(memory_location::device(2)) == access_flags::none);
  stream s0(0);
  void* x = p0.allocate(MiB, s0);  // the pool is as it was: it allocates, and grants device 2 nothing
  CHECK(all_mappings(0, rw_flags));
  CHECK(fake_mappings_with_access(2, none_flags) == fake_live().mappings);
  // With memory mapped, the same; and a list with one bad device changes nothing at all.
  CHECK_THROWS_AS(p0.set_access({{memory_location::device(1), access_flags::read_write},
                                 {memory_location::device(2), access_flags::read_write}}),
                  not_supported);
  CHECK(p0.access(memory_location::device(1)) == access_flags::none);
  CHECK(fake_mappings_with_access(1, none_flags) == fake_live().mappings);
  CHECK(fake_set_access_calls() == calls + 1);  // the one mapping's own grant, nothing since
  // The other way round: device 2's memory is closed to device 0.
  pool p2(small_chunks(memory_location::device(2)));
  CHECK_THROWS_WITH_AS(p2.set_access(memory_location::device(0), access_flags::read_write),
                       doctest::Contains("device 0 cannot access the memory of device 2"), not_supported);
  // Revoking needs no capability: device 2 has nothing, and keeps nothing (no driver call).
  const long long before_revoke = fake_set_access_calls();
  p0.set_access(memory_location::device(2), access_flags::none);
  CHECK(p0.access(memory_location::device(2)) == access_flags::none);
  CHECK(fake_set_access_calls() == before_revoke);
  p0.deallocate(x, s0);
}

TEST_CASE("bad grants are refused with std::invalid_argument, changing nothing") {
  pool p0(small_chunks());
  CHECK_THROWS_WITH_AS(p0.set_access(memory_location::device(5), access_flags::read_write),
                       doctest::Contains("there is no device 5"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(p0.set_access(memory_location::host_numa(0), access_flags::read_write),
                       doctest::Contains("the host cannot be given access"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(p0.set_access({{memory_location::device(1), access_flags::read},
                                      {memory_location::device(1), access_flags::read_write}}),
                       doctest::Contains("device 1 is named twice"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(
      p0.set_access(memory_location::device(1), static_cast<access_flags>(7)),
      doctest::Contains("is none of none, read, read_write"), std::invalid_argument);
  CHECK(p0.access(memory_location::device(1)) == access_flags::none);
  CHECK(p0.access(memory_location::host_numa(0)) == access_flags::none);
  p0.close();
  CHECK_THROWS_AS(p0.set_access(memory_location::device(1), access_flags::read), pool_closed);
  CHECK_THROWS_AS((void)p0.access(memory_location::device(1)), pool_closed);
}

TEST_CASE("the resident device's access can be neither removed nor reduced") {
  pool p0(small_chunks());
  stream s0(0);
  void* x = p0.allocate(MiB, s0);
  for (access_flags f : {access_flags::none, access_flags::read}) {
    CHECK_THROWS_WITH_AS(p0.set_access(memory_location::device(0), f),
                         doctest::Contains("device 0's access to this pool's memory cannot be removed or reduced"),
                         std::invalid_argument);
  }
  p0.set_access(memory_location::device(0), access_flags::read_write);  // what it has: nothing to do
  CHECK(p0.access(memory_location::device(0)) == access_flags::read_write);
  CHECK(all_mappings(0, rw_flags));
  p0.deallocate(x, s0);
}

TEST_CASE("a grant on an empty pool covers the memory mapped afterwards") {
  pool p0(small_chunks());
  const long long calls = fake_set_access_calls();
  p0.set_access(memory_location::device(1), access_flags::read_write);
  CHECK(fake_set_access_calls() == calls);  // nothing mapped: nothing to ask the driver
  CHECK(p0.access(memory_location::device(1)) == access_flags::read_write);
  CHECK(p0.access(memory_location::device(0)) == access_flags::read_write);
  CHECK(p0.access(memory_location::device(2)) == access_flags::none);
  CHECK(p0.statistics().reserved_current == 0);
  stream s0(0);
  void* x = p0.allocate(3 * MiB, s0);
  void* y = p0.allocate(2 * MiB, s0);
  CHECK(fake_live().mappings == 3);  // x's two chunks, and one for y
  CHECK(all_mappings(0, rw_flags));
  CHECK(all_mappings(1, rw_flags));
  CHECK(fake_mappings_with_access(2, none_flags) == 3);
  p0.deallocate(y, s0);
  p0.deallocate(x, s0);
}

TEST_CASE("a grant covers the chunks mapped before it, and those growth and defragmentation map after it") {
  pool_properties props = small_chunks();
  props.max_size = 8 * MiB;
  pool p0(props);
  stream s0(0);
  std::vector<void*> x;
  for (int i = 0; i < 4; ++i) x.push_back(p0.allocate(2 * MiB, s0));
  REQUIRE(fake_live().mappings == 4);
  const long long calls = fake_set_access_calls();
  p0.set_access(memory_location::device(1), access_flags::read);
  CHECK(fake_set_access_calls() == calls + 4);  // one call per mapping, the new location only
  CHECK(all_mappings(1, read_flags));
  p0.set_access(memory_location::device(1), access_flags::read);  // what it has: no driver call
  CHECK(fake_set_access_calls() == calls + 4);
  CHECK(all_mappings(0, rw_flags));
  // Two holes of 2 MiB; 4 MiB fits only once they are remapped next to each other.
  p0.deallocate(x[0], s0);
  p0.deallocate(x[2], s0);
  (void)s0.synchronize();
  void* y = p0.allocate(4 * MiB, s0);
  CHECK(p0.statistics().remapped_chunks >= 1);
  CHECK(p0.statistics().reserved_current == 8 * MiB);
  CHECK(all_mappings(1, read_flags));
  // Read-only upgraded to read-write over everything.
  p0.set_access(memory_location::device(1), access_flags::read_write);
  CHECK(all_mappings(1, rw_flags));
  p0.deallocate(y, s0);
  p0.deallocate(x[1], s0);
  p0.deallocate(x[3], s0);
}

TEST_CASE("a grant covers the memory grow_in_place maps behind an allocation, and graphs' own memory") {
  pool p0(pool_properties{.location = memory_location::device(0), .release_threshold = SIZE_MAX});
  p0.set_access(memory_location::device(1), access_flags::read_write);
  stream s0(0);
  void* x = p0.allocate(64 * MiB, s0, placement::room_to_grow);
  const int before = fake_live().mappings;
  CHECK(p0.grow_in_place(x, 96 * MiB, s0) >= 96 * MiB);
  CHECK(fake_live().mappings > before);  // new memory mapped behind it
  CHECK(all_mappings(1, rw_flags));
  // An allocation under capture gets memory of the graph's own, mapped for it.
  stream s1(1);
  const auto mapped = fake_live().mappings;
  cu::cuStreamBeginCapture(reinterpret_cast<CUstream>(s1.get()), CU_STREAM_CAPTURE_MODE_GLOBAL);
  void* g = p0.allocate(200 * MiB, s1);  // a stream of device 1, which has access
  CUgraph graph = nullptr;
  cu::cuStreamEndCapture(reinterpret_cast<CUstream>(s1.get()), &graph);
  CHECK(g != nullptr);
  CHECK(fake_live().mappings > mapped);
  CHECK(all_mappings(1, rw_flags));
  cu::cuGraphDestroy(graph);
  REQUIRE(reaper_idle());
  p0.deallocate(g, s1);  // left live by the graph, freed by device 1's stream
  p0.deallocate(x, s0);
}

TEST_CASE("revoking a peer's access applies to the memory mapped now and to what is mapped later") {
  pool p0(small_chunks());
  stream s0(0), s1(1);
  p0.set_access(memory_location::device(1), access_flags::read_write);
  void* x = p0.allocate(4 * MiB, s0);
  CHECK(all_mappings(1, rw_flags));
  p0.set_access(memory_location::device(1), access_flags::none);
  CHECK(p0.access(memory_location::device(1)) == access_flags::none);
  CHECK(fake_mappings_with_access(1, none_flags) == fake_live().mappings);
  void* y = p0.allocate(4 * MiB, s0);  // grows: the new chunks are closed to device 1 too
  CHECK(fake_live().mappings == 4);     // two 2 MiB chunks each
  CHECK(fake_mappings_with_access(1, none_flags) == 4);
  CHECK(all_mappings(0, rw_flags));
  // Its streams are refused again, with the message of a device that never had access.
  CHECK_THROWS_WITH_AS((void)p0.allocate(MiB, s1), doctest::Contains("the stream belongs to device 1"),
                       std::invalid_argument);
  p0.deallocate(x, s0);
  p0.deallocate(y, s0);
}

TEST_CASE("streams of a device with access allocate and free; those of a device without are refused") {
  pool p0(small_chunks());
  stream s0(0), s1(1), s2(2);
  const std::string refusal = message_of([&] { (void)p0.allocate(MiB, s1); });
  CHECK(refusal.find("streamalloc::pool::allocate: the stream belongs to device 1, but this pool's memory (device 0) "
                     "is for device 0") != std::string::npos);
  CHECK(refusal.find("set_access") != std::string::npos);  // says how to give it access
  p0.set_access(memory_location::device(1), access_flags::read);  // read-only access is access too
  void* a = p0.allocate(MiB, s1);
  REQUIRE(a != nullptr);
  CHECK(p0.owns(a));
  CHECK(find_pool(a) == std::optional<pool_ref>(pool_ref(p0)));
  CHECK(p0.statistics().live_allocations == 1);
  CHECK(p0.grow_in_place(a, 2 * MiB, s1) == 2 * MiB);
  CHECK(p0.shrink_in_place(a, MiB, s1) == MiB);
  p0.deallocate(a, s1);
  // Memory changes hands between the two devices' streams, each free on the other.
  void* b = p0.allocate(MiB, s0);
  void* c = p0.allocate(MiB, s1);
  (void)s0.synchronize();
  (void)s1.synchronize();
  p0.deallocate(b, s1);
  p0.deallocate(c, s0);
  CHECK(p0.statistics().live_allocations == 0);
  // A pool_ref and the free function take the same path.
  pool_ref r = p0;
  void* d = r.allocate(MiB, s1);
  streamalloc::deallocate(d, s1);
  // Device 2 has no access: refused as before, the pool unchanged.
  CHECK_THROWS_WITH_AS((void)p0.allocate(MiB, s2), doctest::Contains("the stream belongs to device 2"),
                       std::invalid_argument);
  void* e = p0.allocate(MiB, s0);
  CHECK_THROWS_WITH_AS(p0.deallocate(e, s2), doctest::Contains("device 2 has none"), std::invalid_argument);
  CHECK(p0.statistics().live_allocations == 1);
  p0.deallocate(e, s0);
  // pool::synchronize now covers device 1's work too (its frees are this pool's).
  const host_order h = p0.synchronize();
  CHECK(h.device() == 0);
}

TEST_CASE("a stream_buffer moves to and is freed on streams of a device with access; others are refused") {
  pool p0(small_chunks());
  stream s0(0), s1(1), s2(2);
  stream_buffer<float> x(1024, s0, p0);
  // Before the grant, device 1's stream cannot take the buffer: refused, the buffer unchanged.
  CHECK_THROWS_WITH_AS(x.set_stream(s1, order_after(s1, s0)),
                       doctest::Contains("stream_buffer::set_stream: the stream belongs to device 1, which cannot use "
                                         "the buffer's memory"),
                       std::invalid_argument);
  CHECK(x.stream() == stream_ref(s0));
  p0.set_access(memory_location::device(1), access_flags::read_write);
  x.set_stream(s1, order_after(s1, s0));
  CHECK(x.stream() == stream_ref(s1));
  // Device 2 has none: neither set_stream nor free_on takes its stream.
  CHECK_THROWS_WITH_AS(x.set_stream(s2, order_after(s2, s1)), doctest::Contains("grant device 2 access first"),
                       std::invalid_argument);
  stream_buffer<float> y(1024, s1, p0);  // allocated by device 1's stream
  CHECK(p0.statistics().live_allocations == 2);
  CHECK_THROWS_WITH_AS(std::move(y).free_on(s2, order_after(s2, s1)),
                       doctest::Contains("stream_buffer::free_on: the stream belongs to device 2"), std::invalid_argument);
  std::move(y).free_on(s0, order_after(s0, s1));  // freed by device 0's stream
  std::move(x).free_on(s0, order_after(s0, s1));
  CHECK(p0.statistics().live_allocations == 0);
  (void)p0.synchronize();
}

TEST_CASE("host pools grant several devices; the host and the pool's own device keep read-write") {
  pool h(small_chunks(memory_location::host_numa(0)));
  CHECK(h.access(memory_location::host_numa(0)) == access_flags::read_write);
  CHECK(h.access(memory_location::device(0)) == access_flags::read_write);
  CHECK(h.access(memory_location::device(1)) == access_flags::none);
  h.set_access({{memory_location::device(1), access_flags::read_write}, {memory_location::device(2), access_flags::read}});
  stream s1(1), s2(2);
  void* x = h.allocate(MiB, s1);
  void* y = h.allocate(MiB, s2);
  CHECK(all_mappings(1, rw_flags));
  CHECK(all_mappings(2, read_flags));
  CHECK(all_mappings(0, rw_flags));
  CHECK(all_mappings(-1, rw_flags));  // the host's
  CHECK_THROWS_WITH_AS(h.set_access(memory_location::host_numa(0), access_flags::read),
                       doctest::Contains("the host's access to this pool's memory"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(h.set_access(memory_location::device(0), access_flags::none),
                       doctest::Contains("the pool was made for it"), std::invalid_argument);
  h.deallocate(x, s2);
  h.deallocate(y, s1);
}

TEST_CASE("a peer's raw stream gets events of its own context") {
  pool p0(small_chunks());
  p0.set_access(memory_location::device(1), access_flags::read_write);
  cu::cuCtxSetCurrent(detail::primary_context(0));
  // A raw stream's handle is used only during calls given it: the pool covers its frees with
  // an event recorded then, which the fake (as the driver) refuses unless the event belongs to
  // the stream's context, device 1's here, while device 0's is current.
  CUstream raw = raw_stream(1);
  const int events = fake_live().events;
  void* x = p0.allocate(MiB, stream_ref{raw});
  p0.deallocate(x, stream_ref{raw});
  void* y = p0.allocate(3 * MiB, stream_ref{raw});  // the slow path: one event covers x's free
  CHECK(fake_live().events > events);
  p0.deallocate(y, stream_ref{raw});
  p0.close();
  cu::cuStreamDestroy(raw);
}

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

TEST_CASE("access changes while other threads allocate, free and grow") {
  pool p0(small_chunks());
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] {
      stream s(t == 2 ? 1 : 0);
      std::vector<void*> held;
      for (int i = 0; !stop.load(); ++i) {
        try {
          held.push_back(p0.allocate((1 + (i * 7 + t) % 5) * MiB, s));
        } catch (const std::invalid_argument&) {  // device 1 while it has no access
        }
        if (held.size() > 6) {
          try {
            p0.deallocate(held.front(), s);
            held.erase(held.begin());
          } catch (const std::invalid_argument&) {  // device 1 while it has no access: kept
          }
        }
        if (i % 16 == 0) p0.trim_to(0);  // unmaps, so growth maps again
      }
      for (void* p : held) p0.deallocate(p, s);
    });
  }
  for (int i = 0; i < 200; ++i) {
    p0.set_access(memory_location::device(1), i % 3 == 0 ? access_flags::none
                                              : i % 3 == 1 ? access_flags::read
                                                           : access_flags::read_write);
  }
  p0.set_access(memory_location::device(1), access_flags::read_write);
  stop = true;
  for (auto& t : threads) t.join();
  // Whatever raced, every mapping holds the last grant.
  stream s0(0);
  void* x = p0.allocate(MiB, s0);
  CHECK(all_mappings(1, rw_flags));
  CHECK(all_mappings(0, rw_flags));
  p0.deallocate(x, s0);
}

TEST_CASE("memory a peer's stream may still use waits for a synchronization of that device too") {
  pool p0(small_chunks());
  p0.set_access(memory_location::device(1), access_flags::read_write);
  stream s0(0);
  void* x = p0.allocate(MiB, s0);
  // A raw stream of device 1 captures the free: the graph adopts x, and the pool cannot tell
  // which stream freed it (CUDA does not identify a capturing stream), so once the graph is
  // gone (never launched) only device-wide synchronizations prove the work before it done.
  CUstream raw = raw_stream(1);
  cu::cuStreamBeginCapture(raw, CU_STREAM_CAPTURE_MODE_GLOBAL);
  p0.deallocate(x, stream_ref{raw});
  CUgraph graph = nullptr;
  cu::cuStreamEndCapture(raw, &graph);
  cu::cuGraphDestroy(graph);
  REQUIRE(reaper_idle());
  CHECK(p0.statistics().free_pending == MiB);
  // Device 0's synchronization alone does not cover device 1's work.
  (void)synchronize_device(0);
  CHECK(p0.statistics().free_pending == MiB);
  (void)synchronize_device(1);
  CHECK(p0.statistics().free_pending == 0);
  cu::cuStreamDestroy(raw);
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

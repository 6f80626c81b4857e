// The pool core out of host memory: the host heap fails from the k-th allocation a request
// makes (its blocks, index entries, address ranges, the table of live blocks) on, for each k in
// turn, while the simulated device's own bookkeeping never does. After each failure the pool
// must be whole: free addresses consistent with what is mapped, no mapping outside the address
// chain (which would poison later defragmentation), and every byte of device memory back once
// all is freed. A binary of its own: failing_new.hpp replaces the global operator new.

#include <streamalloc/detail/core/pool_core.hpp>

#include <doctest/doctest.h>

#include "failing_new.hpp"
#include "host_memory_backend.hpp"
#include "sim_backend.hpp"
#include "test_streams.hpp"

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <string>
#include <vector>

namespace {

using test_support::allocations_until_failure;
using test_support::check_all_given_back;
// Requests after which the pool reported addresses it could not give back.
int requests_that_dropped_addresses = 0;

using namespace streamalloc::detail;
using streamalloc_test::sim_backend;
using streamalloc_test::sim_device;
using test_support::device_backend;
using test_support::host_sync;
using test_support::make_stream;
using test_support::test_stream;
using core = pool_core<device_backend>;

constexpr std::uint64_t MiB = 1ull << 20;

/// What the request under test finds: six 2 MiB chunks in use, three of them freed so that
/// defragmentation has chunks to move.
enum class scene {
  clear_holes,      ///< freed and known complete: moved by remapping
  pending_holes,    ///< freed on the stream, not run: moved as aliases
  holes_and_growth, ///< freed and complete, but too few: moved, and new memory beside them
  grow_in_place,    ///< none freed: the last block grows into new memory after it
  fresh_growth,     ///< none freed: new chunks
};

const char* name_of(scene s) {
  switch (s) {
    case scene::clear_holes: return "defragmenting clear chunks";
    case scene::pending_holes: return "moving a stream's own pending chunks as aliases";
    case scene::holes_and_growth: return "defragmenting and growing";
    case scene::grow_in_place: return "growing a block in place";
    case scene::fresh_growth: return "growing by new chunks";
  }
  return "?";
}

/// Runs the request with host allocations failing from the k-th on; true if it failed. Checks
/// that the pool is whole afterwards and that every byte and every address comes back.
/// `small_blocks` live 256-byte blocks are made first, so that the pool's block records and
/// address index fill up and must grow during the request.
bool request_with_failure(scene sc, int k, int small_blocks = 0) {
  core_options o;
  o.chunk_size = 2 * MiB;
  o.release_threshold = ~0ull;
  o.address_space = 64ull << 30;
  auto dev = std::make_shared<sim_device>();
  auto pool = std::make_unique<core>(device_backend{sim_backend{dev}}, o);
  auto s = make_stream();
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 6; ++i) p.push_back(pool->allocate(2 * MiB, s.key()));
  std::vector<std::uint64_t> small;
  for (int i = 0; i < small_blocks; ++i) small.push_back(pool->allocate(256, s.key()));
  const bool holes = sc == scene::clear_holes || sc == scene::pending_holes || sc == scene::holes_and_growth;
  if (sc == scene::pending_holes) dev->busy.insert(s.native);
  if (holes) {
    for (int i : {0, 2, 4}) pool->deallocate(p[static_cast<std::size_t>(i)], s.key());
  }
  if (sc != scene::pending_holes) host_sync(*dev, s);
  auto other = make_stream();
  std::uint64_t got = 0;
  bool failed = false;
  allocations_until_failure = k;
  try {
    switch (sc) {
      case scene::clear_holes:
      case scene::pending_holes: got = pool->allocate(6 * MiB, s.key()); break;
      case scene::holes_and_growth: got = pool->allocate(8 * MiB, other.key()); break;
      case scene::grow_in_place: (void)pool->grow_in_place(p[5], 8 * MiB, s.key()); break;
      case scene::fresh_growth: got = pool->allocate(6 * MiB, other.key()); break;
    }
  } catch (const std::bad_alloc&) {
    failed = true;
  }
  allocations_until_failure = -1;
  CHECK(pool->addresses_consistent());
  dev->busy.clear();
  // The pool still serves a request, and everything comes back once all is freed.
  const std::uint64_t again = pool->allocate(6 * MiB, other.key());
  CHECK(dev->is_mapped(again, 6 * MiB));
  pool->deallocate(again, other.key());
  if (got != 0) pool->deallocate(got, sc == scene::holes_and_growth || sc == scene::fresh_growth ? other.key() : s.key());
  for (int i : {1, 3, 5}) pool->deallocate(p[static_cast<std::size_t>(i)], s.key());
  for (const std::uint64_t x : small) pool->deallocate(x, s.key());
  if (!holes) {
    for (int i : {0, 2, 4}) pool->deallocate(p[static_cast<std::size_t>(i)], s.key());
  }
  host_sync(*dev, s);
  host_sync(*dev, other);
  pool->trim_to(0);
  CHECK(pool->statistics().reserved_current == 0);
  CHECK(pool->statistics().used_current == 0);
  CHECK(dev->mapped.empty());
  CHECK(dev->handles.empty());
  CHECK(pool->addresses_consistent());
  // Every address is free again (nothing is mapped), but for those the pool says it had no
  // host memory to give back (when allocations fail from the k-th on, even the request's own
  // unmapping, which may not throw, cannot).
  CHECK(pool->addresses_free() + pool->addresses_dropped() == pool->addresses_reserved());
  if (pool->addresses_dropped() != 0) ++requests_that_dropped_addresses;
  pool->shutdown();
  return failed;
}

}  // namespace

TEST_CASE("out of host memory at any step of a request: the error reaches the caller, nothing is lost") {
  for (scene sc : {scene::clear_holes, scene::pending_holes, scene::holes_and_growth, scene::grow_in_place,
                   scene::fresh_growth}) {
    CAPTURE(std::string(name_of(sc)));
    int k = 0;
    for (; k < 1000; ++k) {
      CAPTURE(k);
      if (!request_with_failure(sc, k)) break;
    }
    CHECK(k < 1000);  // the request succeeds once enough allocations do
    MESSAGE(std::string(name_of(sc)) << ": " << k << " host allocations failed in turn");
  }
  MESSAGE(requests_that_dropped_addresses << " failed requests left addresses unused, as the pool reported");
}

TEST_CASE("out of host memory while the pool's block records and index must grow: nothing is lost") {
  // Block records come in slabs of 1024 and index nodes in batches: with about a thousand
  // blocks live, one of the requests below needs a new slab or node in the middle of moving
  // chunks. Every count in the range is tried, each with every failing allocation.
  int failures = 0;
  for (const scene sc : {scene::clear_holes, scene::pending_holes}) {
    for (int blocks = 1000; blocks < 1030; ++blocks) {
      CAPTURE(std::string(name_of(sc)));
      CAPTURE(blocks);
      int k = 0;
      for (; k < 1000 && request_with_failure(sc, k, blocks); ++k) {
      }
      CHECK(k < 1000);
      failures += k;
    }
  }
  MESSAGE(failures << " failed requests, all whole afterwards");
}

TEST_CASE("out of host memory on the fast path: the cached block stays cached, and is taken next time") {
  // The fast path hands a block freed on the stream back to it and enters it in the table of
  // live blocks, which grows now and then: that growth fails here, at each size it happens.
  auto dev = std::make_shared<sim_device>();
  core_options o;
  o.address_space = 64ull << 30;
  o.release_threshold = ~0ull;  // freed blocks are cached on their stream
  core pool(device_backend{sim_backend{dev}}, o);
  auto s = make_stream();
  std::vector<std::uint64_t> live;
  int failures = 0;
  for (int i = 0; i < 100000; ++i) {  // about 100 per shard of the table: each grows
    const std::uint64_t x = pool.allocate(256, s.key());
    pool.deallocate(x, s.key());  // cached on s
    allocations_until_failure = 0;
    std::uint64_t y = 0;
    try {
      y = pool.allocate(256, s.key());
    } catch (const std::bad_alloc&) {
      ++failures;
    }
    allocations_until_failure = -1;
    if (y == 0) {
      CHECK(pool.statistics().used_current == live.size() * 256);
      y = pool.allocate(256, s.key());
      CHECK(y == x);  // still cached: taken again
    }
    live.push_back(y);
  }
  CHECK(failures > 0);
  MESSAGE(failures << " growths of the live table failed");
  for (const std::uint64_t y : live) pool.deallocate(y, s.key());
  host_sync(*dev, s);
  pool.trim_to(0);
  CHECK(pool.statistics().used_current == 0);
  CHECK(dev->handles.empty());
  pool.shutdown();
}

TEST_CASE("out of host memory when the pool hears a stream was synchronized: its frees are not lost") {
  // The frees cached on a stream join its pending bins (which needs no host memory), and the
  // pool then looks for those known complete; out of host memory there, a block taken out of
  // the pending bins before the list of ready ones could grow was in no bins at all, and its
  // memory neither reused nor released for the rest of the pool's life.
  auto dev = std::make_shared<sim_device>();
  core_options o;
  o.address_space = 64ull << 30;
  o.release_threshold = ~0ull;  // freed blocks are cached on their stream
  core pool(device_backend{sim_backend{dev}}, o);
  auto s = make_stream();
  std::vector<std::uint64_t> blocks;
  for (int i = 0; i < 8; ++i) blocks.push_back(pool.allocate(256 << 10, s.key()));
  for (const std::uint64_t x : blocks) pool.deallocate(x, s.key());
  REQUIRE(pool.statistics().reserved_current > 0);
  pool.set_release_threshold(0);
  const auto epoch = s.record->begin_synchronize();
  dev->run(s.native);
  ordering().complete_stream_quietly(*s.record, epoch);  // the pool has not heard yet
  allocations_until_failure = 0;
  pool.on_synchronize(s.record->id());  // as the registry tells it, every host allocation refused
  allocations_until_failure = -1;
  // Whatever it could not do waits, and nothing is lost: every byte held is free, and goes
  // back to the device when asked.
  const auto st = pool.statistics();
  CHECK(st.used_current == 0);
  CHECK(st.free_clear + st.free_pending == st.reserved_current);
  CHECK(st.largest_free_block == st.reserved_current);  // the frees merged with the rest of the chunk
  pool.trim_to(0);
  CHECK(pool.statistics().reserved_current == 0);
  CHECK(dev->handles.empty());
  pool.shutdown();
}

TEST_CASE("out of host memory while splitting a free block: it stays free, whole") {
  // Each small allocation splits the free rest of a chunk; every 1024th needs a new slab of
  // block records. With the host out of memory then, the free block must go back to its bins.
  auto dev = std::make_shared<sim_device>();
  core_options o;
  o.address_space = 64ull << 30;
  core pool(device_backend{sim_backend{dev}}, o);
  auto s = make_stream();
  std::vector<std::uint64_t> live;
  int failures = 0;
  for (int i = 0; i < 5000; ++i) {
    allocations_until_failure = 0;
    std::uint64_t p = 0;
    try {
      p = pool.allocate(256, s.key());
    } catch (const std::bad_alloc&) {
      ++failures;
    }
    allocations_until_failure = -1;
    if (p == 0) p = pool.allocate(256, s.key());
    live.push_back(p);
  }
  CHECK(failures > 0);
  MESSAGE(failures << " allocations failed");
  CHECK(pool.statistics().used_current == live.size() * 256);
  for (const std::uint64_t p : live) pool.deallocate(p, s.key());
  check_all_given_back(pool, *dev, s);
  CHECK(pool.addresses_consistent());
  pool.shutdown();
}

TEST_CASE("out of host memory while a gone graph's shared pieces leave the pool: it goes on, nothing is lost") {
  // A graph whose allocations all die in each launch, launched into a stream, runs on that
  // stream's shared pages; when the graph goes, its pieces leave the address chain, in a call
  // that may not fail. A piece taken from the middle of the pool's mapped memory splits that
  // run of addresses in two, which once needed a map entry: out of host memory, the process
  // ended (std::terminate from a noexcept function).
  core_options o;
  o.chunk_size = 2 * MiB;
  o.own_chunk_for_large = false;
  o.release_threshold = ~0ull;
  o.address_space = 64ull << 30;
  auto dev = std::make_shared<sim_device>();
  auto pool = std::make_unique<core>(device_backend{sim_backend{dev}}, o);
  auto host = make_stream();
  host.record->mark_completed(~std::uint64_t{0} >> 1);
  auto s = make_stream();
  // Three chunks in one run; the middle one freed and known complete.
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 3; ++i) p.push_back(pool->allocate(2 * MiB, s.key()));
  pool->deallocate(p[1], s.key());
  host_sync(*dev, s);
  const auto creates = dev->creates;
  // Graph 1 allocates 1 MiB (in the free chunk, where it lies) and frees it.
  const std::uint64_t g = pool->allocate_captured(MiB, 1, s.record->id(), 0, [] {});
  CHECK(dev->creates == creates);  // the middle chunk, taken in place
  CHECK(g >= p[1]);
  CHECK(g < p[1] + 2 * MiB);
  const stream_key freer = s.key();
  pool->deallocate_captured(g, 1, s.record->id(), host.key_without_handle(), &freer, [] {});
  // Launched into stream 100: its piece now runs on that stream's pages.
  CHECK(pool->bind_graph_memory(1, 100, [] { return true; }));
  CHECK(dev->creates > creates);  // the stream's shared page
  allocations_until_failure = 0;
  pool->release_graph(1, host.key_without_handle());  // must not end the process
  allocations_until_failure = -1;
  CHECK(pool->statistics().graph_reserved_current == 0);
  CHECK(pool->addresses_consistent());
  CHECK(!dev->is_mapped(p[1], 2 * MiB));  // the piece left the pool with its graph
  // The pool still serves requests around the hole, and everything comes back.
  const std::uint64_t again = pool->allocate(6 * MiB, s.key());
  CHECK(dev->is_mapped(again, 6 * MiB));
  pool->deallocate(again, s.key());
  pool->deallocate(p[0], s.key());
  pool->deallocate(p[2], s.key());
  host_sync(*dev, s);
  pool->trim_to(0);
  CHECK(pool->statistics().reserved_current == 0);
  CHECK(dev->mapped.empty());
  CHECK(dev->handles.empty());
  CHECK(pool->addresses_free() + pool->addresses_dropped() == pool->addresses_reserved());
  pool->shutdown();
}

// The pool core out of host memory on its less common paths: frees on raw streams, captured
// allocations and frees, graphs moved onto a stream's pages, new address reservations and
// streams retiring. Each failure either reaches the caller having changed nothing, or is
// absorbed where the call cannot fail (a free already made, a destructor); either way nothing
// is lost: every block can still be freed, and every byte goes back to the device.
// A binary of its own: failing_new.hpp replaces the global operator new.

#include <streamalloc/detail/core/pool_core.hpp>

#include <doctest/doctest.h>

#include "failing_new.hpp"
#include "host_memory_backend.hpp"
#include "sim_backend.hpp"
#include "test_streams.hpp"

#include <cstdint>
#include <map>
#include <memory>
#include <new>
#include <stdexcept>
#include <vector>

namespace {

using namespace streamalloc::detail;
using streamalloc_test::sim_backend;
using streamalloc_test::sim_device;
using test_support::allocations_until_failure;
using test_support::check_all_given_back;
using test_support::device_backend;
using test_support::host_sync;
using test_support::make_stream;
using core = pool_core<device_backend>;

constexpr std::uint64_t MiB = 1ull << 20;

core_options kept_options() {
  core_options o;
  o.address_space = 64ull << 30;
  o.release_threshold = ~0ull;
  return o;
}

/// Frees `p` on `s`; false when the pool says it is not a live block.
bool freeable(core& pool, std::uint64_t p, const streamalloc::detail::stream_key& s) {
  try {
    pool.deallocate(p, s);
    return true;
  } catch (const std::invalid_argument&) {
    return false;
  }
}

}  // namespace

TEST_CASE("a free on a raw stream is made, and says so, when the event covering it cannot be kept") {
  // A raw stream's frees get an event every 2 MiB (the only proof that they ran, should the
  // stream be destroyed unseen). Out of host memory for that event's entry, deallocate threw
  // after the free was made: a caller retrying freed the block twice.
  auto dev = std::make_shared<sim_device>();
  core pool(device_backend{sim_backend{dev}}, kept_options());
  auto s = make_stream(/*stable=*/false);
  for (int i = 0; i < 100; ++i) {  // the event list's storage grows now and then: each time refused
    const std::uint64_t p = pool.allocate(4 * MiB, s.key());
    {
      const test_support::refusing_allocations refused;
      CHECK_NOTHROW(pool.deallocate(p, s.key()));
    }
    CHECK(pool.statistics().used_current == 0);
    CHECK_FALSE(freeable(pool, p, s.key()));  // it is free: a second free is refused
  }
  check_all_given_back(pool, *dev, s);
  pool.shutdown();
}

TEST_CASE("a captured allocation refused for lack of host memory leaves its block with the graph") {
  // The block is cut from the graph's spare memory, then entered in the graph's list: refused
  // there, it goes back to the spares, which need room for it even when the cut left their
  // count unchanged (a second refusal, a smaller request).
  core_options o = kept_options();
  o.chunk_size = 2 * MiB;
  auto dev = std::make_shared<sim_device>();
  core pool(device_backend{sim_backend{dev}}, o);
  auto host = make_stream();
  host.record->mark_completed(~std::uint64_t{0} >> 1);
  auto s = make_stream();
  const std::uint64_t token = s.record->id();
  const std::uint64_t a = pool.allocate_captured(4096, 7, token, 0, [] {});
  int refused = 0;
  for (const std::uint64_t n : {4096u, 1024u}) {
    allocations_until_failure = 0;
    try {
      (void)pool.allocate_captured(n, 7, token, 0, [] {});
    } catch (const std::bad_alloc&) {
      ++refused;
    }
    allocations_until_failure = -1;
  }
  CHECK(refused == 2);
  pool.release_graph(7, host.key_without_handle());
  CHECK(freeable(pool, a, s.key()));  // never freed in the graph: live, the host's now
  check_all_given_back(pool, *dev, s);
  pool.shutdown();
}

TEST_CASE("a captured free of host memory refused for lack of host memory leaves the block live") {
  // The block leaves the table of live blocks before the graph's segment is made; refused
  // there, it goes back, which may not need the table to grow (its shard here is one insert
  // short of growing: the entry freed by the erase is reused).
  auto dev = std::make_shared<sim_device>();
  core pool(device_backend{sim_backend{dev}}, kept_options());
  auto host = make_stream();
  auto s = make_stream();
  pool.deallocate(pool.allocate(256, host.key()), host.key());  // the host's state exists
  auto shard_of = [](std::uint64_t p) { return static_cast<std::size_t>(((p >> 8) * 0x9E3779B97F4A7C15ULL) >> 54); };
  std::vector<std::uint64_t> live;
  std::vector<int> per_shard(1024, 0);
  std::uint64_t victim = 0;
  // As live_table shards and grows its tables (its first has 64 slots, grown at the 49th
  // entry): kept in step with it, or this case no longer reaches the growth it is about.
  while (victim == 0) {
    live.push_back(pool.allocate(256, s.key()));
    if (++per_shard[shard_of(live.back())] == 48) victim = live.back();
  }
  {
    const test_support::refusing_allocations refused;
    CHECK_THROWS_AS(pool.deallocate_captured(victim, 9, s.record->id(), host.key_without_handle(), nullptr, [] {}),
                    std::bad_alloc);
  }
  for (const std::uint64_t p : live) CHECK(freeable(pool, p, s.key()));
  host_sync(*dev, s);
  host_sync(*dev, host);
  pool.trim_to(0);
  CHECK(pool.statistics().reserved_current == 0);
  pool.shutdown();
}

TEST_CASE("a graph's memory refused a move onto a stream's pages for lack of host memory keeps no pages") {
  for (int k = 0; k < 8; ++k) {  // the k-th host allocation of the move refused
    CAPTURE(k);
    core_options o = kept_options();
    o.chunk_size = 2 * MiB;
    o.own_chunk_for_large = false;
    auto dev = std::make_shared<sim_device>();
    core pool(device_backend{sim_backend{dev}}, o);
    auto host = make_stream();
    host.record->mark_completed(~std::uint64_t{0} >> 1);
    auto s = make_stream();
    const std::uint64_t g = pool.allocate_captured(MiB, 1, s.record->id(), 0, [] {});
    const stream_key freer = s.key();
    pool.deallocate_captured(g, 1, s.record->id(), host.key_without_handle(), &freer, [] {});
    allocations_until_failure = k;
    (void)pool.bind_graph_memory(1, 100, [] { return true; });
    allocations_until_failure = -1;
    pool.release_graph(1, host.key_without_handle());
    check_all_given_back(pool, *dev, s);
    pool.shutdown();
  }
}

TEST_CASE("every address a pool hands out is in the directory, even when its reservation met a lack of host memory") {
  // The pool's hook (the process's directory of pools, which finds a pointer's pool) hears of a
  // reservation before the pool uses it; before, a refusal after the pool took the addresses
  // left them in use and unknown to the directory.
  for (int k = 0; k < 30; ++k) {
    CAPTURE(k);
    std::map<std::uint64_t, std::uint64_t> directory;  // base -> end, as the directory keeps them
    core_options o = kept_options();
    o.address_space = 1ull << 40;
    o.on_reserve = [&](std::uint64_t base, std::uint64_t size) { directory[base] = base + size; };
    auto dev = std::make_shared<sim_device>();
    core pool(device_backend{sim_backend{dev}}, o);
    auto s = make_stream();
    pool.deallocate(pool.allocate(256, s.key()), s.key());
    allocations_until_failure = k;
    std::uint64_t p = 0;
    try {
      p = pool.allocate(16ull << 30, s.key());  // beyond the first reservation
    } catch (const std::bad_alloc&) {
    }
    allocations_until_failure = -1;
    if (p == 0) p = pool.allocate(16ull << 30, s.key());
    const auto in = directory.upper_bound(p);
    CHECK((in != directory.begin() && p < std::prev(in)->second));
    for (const auto& [base, size] : pool.reservations()) CHECK(directory.count(base) == 1);
    pool.deallocate(p, s.key());
    host_sync(*dev, s);
    pool.shutdown();
  }
}

TEST_CASE("a stream retiring out of host memory: the pools hear of it, and nothing is thrown") {
  // Streams retire from destructors, which may not throw (stream's ended the process there),
  // and a pool not told would keep using the stream's handle after it is gone.
  auto dev = std::make_shared<sim_device>();
  core pool(device_backend{sim_backend{dev}}, kept_options());
  auto s = make_stream();
  pool.deallocate(pool.allocate(4096, s.key()), s.key());  // cached on s
  {
    const test_support::refusing_allocations refused;
    CHECK_NOTHROW(ordering().retire(s.record->id()));
  }
  CHECK(s.record->retired());
  // What the pool could not do then waits for proof, and nothing is lost.
  check_all_given_back(pool, *dev, s);
  pool.shutdown();
}

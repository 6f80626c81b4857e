#pragma once

// What the pool core's tests share (pool_core_test.cpp, pool_core_remap_test.cpp,
// pool_core_growth_test.cpp, pool_core_randomized_test.cpp): a pool on a simulated device, and
// the checks several files make. Those files are compiled as one translation unit
// (tests/CMakeLists.txt), so what they share is defined here once, inline, and a name at file
// scope, unnamed namespace or not, must not be defined by two of them.

#include <streamalloc/detail/core/pool_core.hpp>

#include <doctest/doctest.h>

#include "sim_backend.hpp"
#include "test_streams.hpp"

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <vector>

using namespace streamalloc::detail;
using streamalloc_test::sim_backend;
using streamalloc_test::sim_device;

namespace pool_core_testing {
inline constexpr std::uint64_t MiB = 1ull << 20;
using core = pool_core<sim_backend>;

using test_support::make_stream;
using test_support::same_handle;
using test_support::test_stream;

struct fixture {
  std::shared_ptr<sim_device> dev = std::make_shared<sim_device>();
  std::unique_ptr<core> pool;
  explicit fixture(core_options o = {}) {
    if (o.address_space == 0) o.address_space = 64ull << 30;
    pool = std::make_unique<core>(sim_backend{dev}, o);
  }
  ~fixture() { pool->shutdown(); }
};

/// 2 MiB chunks, the granularity, and nothing released at synchronizations: the chunks a case
/// frees stay for defragmentation to move.
inline core_options movable_chunks() {
  core_options o;
  o.chunk_size = 2 * MiB;
  o.release_threshold = ~0ull;
  return o;
}

/// A host synchronization of stream s, as streamalloc's stream::synchronize does it.
inline void host_sync(sim_device& dev, test_stream s) {
  const auto epoch = s.record->begin_synchronize();
  dev.run(s.native);
  ordering().complete_stream(*s.record, epoch);
}

/// With the history kept from the pool's start: the memory it says grew, less the memory it
/// says was released, is what the pool holds (a mapping refused or failed part-way included).
inline void check_history_balanced(fixture& f) {
  if (!f.pool->history().on()) return;
  const auto h = f.pool->history().read();
  REQUIRE(h.dropped == 0);
  std::int64_t held = 0;
  for (const auto& e : h.events) {
    if (e.op == history_op::grow) held += static_cast<std::int64_t>(e.bytes);
    if (e.op == history_op::release) held -= static_cast<std::int64_t>(e.bytes);
  }
  CHECK(held == static_cast<std::int64_t>(f.pool->statistics().reserved_current));
}

/// Once every block is freed and every stream has run: the pool gives all memory back, and
/// each of its reservations is whole again (a request of a reservation's size lands at its
/// base, with no new reservation), and nothing else is free (with every reservation taken,
/// one more request finds no address there: a range given back twice, or while mapped, would
/// be handed out over a mapping, which the simulated device refuses as a misuse): nothing
/// mapped, held or addressed was lost or doubled on the way.
inline void check_nothing_lost(fixture& f, std::initializer_list<test_stream*> streams) {
  CHECK(f.pool->addresses_consistent());
  check_history_balanced(f);
  for (test_stream* s : streams) host_sync(*f.dev, *s);
  f.pool->trim_to(0);
  CHECK(f.pool->statistics().reserved_current == 0);
  CHECK(f.dev->mapped.empty());
  CHECK(f.dev->handles.empty());
  const auto reserved = f.pool->addresses_reserved();
  const auto reservations = f.pool->reservations();
  auto s = make_stream();
  std::vector<std::uint64_t> whole;
  for (const auto& [base, size] : reservations) {
    whole.push_back(f.pool->allocate(size, s.key()));
    CHECK(whole.back() == base);
  }
  CHECK(f.pool->addresses_reserved() == reserved);
  try {
    const auto extra = f.pool->allocate(f.pool->granularity(), s.key());
    for (const auto& [base, size] : reservations) CHECK((extra < base || extra >= base + size));
    f.pool->deallocate(extra, s.key());
  } catch (const core_out_of_memory&) {  // the address space is all reserved: as it should be
  }
  for (const auto q : whole) f.pool->deallocate(q, s.key());
  host_sync(*f.dev, s);
  f.pool->trim_to(0);
  CHECK(f.dev->mapped.empty());
  check_history_balanced(f);
}
}  // namespace pool_core_testing

using namespace pool_core_testing;

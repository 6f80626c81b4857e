// A pool's addresses and physical chunks on the simulated device: reservations made as needed
// (the first at construction, each later one at least doubling what is reserved, up to the
// limit), refusals recorded, and mapping, unmapping and releasing chunks keeping the counters,
// the free addresses and the device's own bookkeeping in step.

#include <streamalloc/detail/core/chunk_space.hpp>

#include <doctest/doctest.h>

#include "sim_backend.hpp"

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

using namespace streamalloc::detail;
using streamalloc_test::sim_backend;
using streamalloc_test::sim_device;

namespace {

constexpr std::uint64_t MiB = 1ull << 20;
constexpr std::uint64_t GiB = 1ull << 30;
using space = chunk_space<sim_backend>;
using reservation = std::pair<std::uint64_t, std::uint64_t>;

/// The simulated device, a backend on it, and the reservations the space reported.
struct fixture {
  std::shared_ptr<sim_device> dev = std::make_shared<sim_device>();
  sim_backend backend{dev};
  std::vector<reservation> told;
  space::reserve_hook hook() {
    return [this](std::uint64_t base, std::uint64_t size) { told.emplace_back(base, size); };
  }
};

/// Physical memory of `bytes` from the device, as the pool core makes it before mapping.
space::chunk make_chunk(sim_backend& b, std::uint64_t bytes) {
  space::chunk c{bytes, 0};
  REQUIRE(b.create(bytes, c.h) == CUDA_SUCCESS);
  return c;
}

}  // namespace

TEST_CASE("the first reservation is made at construction and owns exactly its addresses") {
  fixture f;
  const std::uint64_t first_va = f.dev->next_va;
  space s(f.backend, 64 * MiB, 64 * GiB, f.hook());
  // 16 chunks of 64 MiB are less than 8 GiB: the first reservation is 8 GiB.
  const std::vector<reservation> want{{first_va, 8 * GiB}};
  CHECK(s.reservations() == want);
  CHECK(f.told == want);  // the hook hears of it too
  CHECK(f.dev->reserved.size() == 1);
  CHECK(s.base() == first_va);
  CHECK(s.reserved_addresses() == 8 * GiB);
  CHECK(s.limit() == 64 * GiB);
  CHECK(s.granularity() == f.dev->granularity);
  CHECK(s.owns(first_va));
  CHECK(s.owns(first_va + 8 * GiB - 1));
  CHECK_FALSE(s.owns(first_va + 8 * GiB));
  CHECK_FALSE(s.owns(first_va - 1));
  CHECK_FALSE(s.owns(0));
  // All of it is free, nothing is mapped or held.
  CHECK(s.free_addresses().largest() == 8 * GiB);
  CHECK(s.chunks().empty());
  CHECK(s.held() == 0);
  CHECK(s.held_high() == 0);
  CHECK(s.held_seen() == 0);
  CHECK(s.grows() == 0);
  CHECK(s.remapped() == 0);
  CHECK(s.refused_reservation() == 0);
  CHECK(f.dev->maps == 0);
}

TEST_CASE("the first reservation's size: 16 chunks when they are large, the limit when smaller") {
  SUBCASE("1 GiB chunks: 16 GiB") {
    fixture f;
    space s(f.backend, 1 * GiB, 64 * GiB, {});  // no hook: nothing to tell
    CHECK(s.reserved_addresses() == 16 * GiB);
  }
  SUBCASE("a chunk size off the granularity rounds the reservation up") {
    fixture f;
    space s(f.backend, 1 * GiB + 1, 64 * GiB, {});
    CHECK(s.reserved_addresses() == 16 * GiB + f.dev->granularity);
  }
  SUBCASE("a limit below 8 GiB, off the granularity: the limit, rounded up, in one") {
    fixture f;
    space s(f.backend, 64 * MiB, 1 * GiB + 1, f.hook());
    CHECK(s.limit() == 1 * GiB + f.dev->granularity);
    CHECK(s.reserved_addresses() == s.limit());
    CHECK(f.told.size() == 1);
    CHECK_FALSE(s.reserve_more(f.dev->granularity));  // nothing left under the limit
    CHECK(s.refused_reservation() == 0);               // the limit is not a refusal
  }
}

TEST_CASE("a pool whose first addresses cannot be had fails when made") {
  fixture f;
  f.dev->addresses_left = 4 * GiB;  // less than the first reservation's 8 GiB
  CHECK_THROWS_AS(space(f.backend, 64 * MiB, 64 * GiB, f.hook()), std::runtime_error);
  CHECK(f.told.empty());
  CHECK(f.dev->reserved.empty());
}

TEST_CASE("reserve_more: each reservation at least doubles what is reserved, up to the limit") {
  fixture f;
  space s(f.backend, 64 * MiB, 64 * GiB, f.hook());
  const std::uint64_t g = f.dev->granularity;
  // A small need still gets as much as the pool has reserved: 8, then 16, then 32 GiB.
  CHECK(s.reserve_more(g));
  CHECK(s.reserve_more(g));
  CHECK(s.reserve_more(g));
  const auto list = s.reservations();
  REQUIRE(list.size() == 4);
  std::uint64_t before = 0;
  for (const auto& [base, size] : list) {
    CHECK(size >= before);
    before += size;
    CHECK(s.owns(base));
    CHECK(s.owns(base + size - 1));
  }
  CHECK(list[1].second == 8 * GiB);
  CHECK(list[2].second == 16 * GiB);
  CHECK(list[3].second == 32 * GiB);
  CHECK(s.reserved_addresses() == 64 * GiB);
  CHECK(f.told == list);
  CHECK(f.dev->reserved.size() == 4);
  // Each reservation's addresses are free to take.
  CHECK(s.free_addresses().largest() == 32 * GiB);

  // The limit is reached: no more, and that is not the driver refusing.
  CHECK_FALSE(s.reserve_more(g));
  CHECK(s.reservations().size() == 4);
  CHECK(f.dev->reserved.size() == 4);
  CHECK(s.refused_reservation() == 0);
}

TEST_CASE("reserve_more: a large need gets its own size; the last one is cut to the limit") {
  fixture f;
  space s(f.backend, 64 * MiB, 30 * GiB, {});
  CHECK(s.reserve_more(12 * GiB));  // more than the 8 GiB reserved: 12 GiB
  CHECK(s.reservations().back().second == 12 * GiB);
  CHECK(s.reserved_addresses() == 20 * GiB);
  CHECK_FALSE(s.reserve_more(10 * GiB + f.dev->granularity));  // more than the limit leaves
  CHECK(s.reserved_addresses() == 20 * GiB);
  CHECK(s.reserve_more(f.dev->granularity));  // would double, but only 10 GiB are left
  CHECK(s.reservations().back().second == 10 * GiB);
  CHECK(s.reserved_addresses() == 30 * GiB);
  CHECK(s.refused_reservation() == 0);
}

TEST_CASE("a reservation the driver refuses is recorded with its size") {
  fixture f;
  space s(f.backend, 64 * MiB, 64 * GiB, f.hook());
  f.dev->addresses_left = 1 * GiB;  // the process's addresses run out
  CHECK_FALSE(s.reserve_more(f.dev->granularity));
  CHECK(s.refused_reservation() == 8 * GiB);  // what it asked for: as much as it had
  CHECK(s.reservations().size() == 1);
  CHECK(f.told.size() == 1);
  // take_or_reserve finds no free range of 9 GiB and no more addresses: nothing.
  CHECK_FALSE(s.take_or_reserve(9 * GiB).has_value());
  CHECK(s.refused_reservation() == 9 * GiB);
  // Addresses the pool has are still taken without asking the driver.
  CHECK(s.take_or_reserve(8 * GiB) == s.base());
}

TEST_CASE("reserve_more at an address: placed there, and a refusal there is no shortage") {
  fixture f;
  space s(f.backend, 64 * MiB, 64 * GiB, {});
  const std::uint64_t end = s.base() + 8 * GiB;
  const std::uint64_t g = f.dev->granularity;

  // Where the first reservation is: the driver cannot place it there.
  CHECK_FALSE(s.reserve_more(g, s.base() + 4 * GiB));
  CHECK(s.refused_reservation() == 0);
  CHECK(s.reservations().size() == 1);

  // Right after it: placed there, adjacent.
  CHECK(s.reserve_more(g, end));
  REQUIRE(s.reservations().size() == 2);
  CHECK(s.reservations()[1] == reservation{end, 8 * GiB});
  CHECK(s.owns(end));
  // A mapping must lie within one reservation: free ranges of adjacent reservations stay apart.
  CHECK_FALSE(s.free_addresses().has_room(end - g, 2 * g));
  CHECK(s.free_addresses().largest() == 8 * GiB);
}

TEST_CASE("take_or_reserve takes free addresses, and reserves more only when none fit") {
  fixture f;
  space s(f.backend, 64 * MiB, 16 * GiB, f.hook());
  const std::uint64_t g = f.dev->granularity;
  CHECK(s.take_or_reserve(8 * GiB) == s.base());  // all of the first reservation
  CHECK(f.told.size() == 1);

  const auto second = s.take_or_reserve(g);  // nothing free: a second reservation
  REQUIRE(second.has_value());
  REQUIRE(f.told.size() == 2);
  CHECK(*second == f.told[1].first);
  CHECK(f.told[1].second == 8 * GiB);

  CHECK(s.take_or_reserve(g) == *second + g);  // from what is left there, no new reservation
  CHECK(f.told.size() == 2);

  // 8 GiB no longer fit anywhere, and the limit is reached.
  CHECK_FALSE(s.take_or_reserve(8 * GiB).has_value());
  CHECK(f.told.size() == 2);
  CHECK(s.refused_reservation() == 0);
}

TEST_CASE("map, unmap and release keep the chunks, the held bytes and the device in step") {
  fixture f;
  space s(f.backend, 4 * MiB, 64 * GiB, {});
  constexpr std::uint64_t chunk_bytes = 4 * MiB;

  // One growth of three chunks.
  std::vector<std::uint64_t> vas;
  std::vector<space::handle> handles;
  for (int i = 0; i < 3; ++i) {
    const auto va = s.free_addresses().take(chunk_bytes);
    REQUIRE(va.has_value());
    space::chunk c = make_chunk(f.backend, chunk_bytes);
    handles.push_back(c.h);
    s.map(*va, c);
    vas.push_back(*va);
  }
  s.note_growth(3 * chunk_bytes);
  CHECK(s.grows() == 1);
  CHECK(s.held() == 3 * chunk_bytes);
  CHECK(s.held_high() == 3 * chunk_bytes);
  CHECK(s.held_seen() == 3 * chunk_bytes);
  CHECK(f.dev->maps == 3);
  REQUIRE(s.chunks().size() == 3);
  for (int i = 0; i < 3; ++i) {
    const auto& c = s.chunks().at(vas[i]);
    CHECK(c.size == chunk_bytes);
    CHECK(c.h == handles[i]);
    CHECK(f.dev->is_mapped(vas[i], chunk_bytes));
  }

  // Unmapped: the addresses are free again, the memory still held (to map elsewhere).
  const space::chunk moved = s.unmap(vas[1]);
  CHECK(moved.size == chunk_bytes);
  CHECK(moved.h == handles[1]);
  CHECK(f.dev->unmaps == 1);
  CHECK_FALSE(f.dev->is_mapped(vas[1], chunk_bytes));
  CHECK(s.chunks().size() == 2);
  CHECK(s.chunks().count(vas[1]) == 0);
  CHECK(s.free_addresses().has_room(vas[1], chunk_bytes));
  CHECK(s.held() == 3 * chunk_bytes);
  CHECK(f.dev->releases == 0);

  // Remapped elsewhere (defragmentation): counted apart from growth.
  const auto far = s.free_addresses().take_top(chunk_bytes);
  REQUIRE(far.has_value());
  s.map(*far, moved);
  s.note_remap();
  CHECK(s.remapped() == 1);
  CHECK(s.grows() == 1);
  CHECK(f.dev->maps == 4);
  CHECK(s.chunks().at(*far).h == handles[1]);
  CHECK(s.held() == 3 * chunk_bytes);

  // Released: no longer held; the peak stays until reset.
  s.release(s.unmap(vas[0]));
  CHECK(f.dev->unmaps == 2);
  CHECK(f.dev->releases == 1);
  CHECK(f.dev->handles.count(handles[0]) == 0);
  CHECK(s.held() == 2 * chunk_bytes);
  CHECK(s.held_seen() == 2 * chunk_bytes);
  CHECK(s.held_high() == 3 * chunk_bytes);
  s.reset_high();
  CHECK(s.held_high() == 2 * chunk_bytes);

  // Another growth raises the peak from there.
  const auto va = s.free_addresses().take(chunk_bytes);
  REQUIRE(va.has_value());
  s.map(*va, make_chunk(f.backend, chunk_bytes));
  s.note_growth(chunk_bytes);
  CHECK(s.grows() == 2);
  CHECK(s.held() == 3 * chunk_bytes);
  CHECK(s.held_high() == 3 * chunk_bytes);
  CHECK(s.chunks().size() == 3);
}

TEST_CASE("release_all unmaps and releases every chunk; the addresses stay reserved") {
  fixture f;
  space s(f.backend, 2 * MiB, 64 * GiB, {});
  const std::uint64_t g = f.dev->granularity;

  SUBCASE("with nothing mapped, nothing is called") {
    s.release_all();
    CHECK(f.dev->unmaps == 0);
    CHECK(f.dev->releases == 0);
  }
  SUBCASE("chunks in two reservations") {
    for (int i = 0; i < 4; ++i) {
      const auto va = s.free_addresses().take(g);
      REQUIRE(va.has_value());
      s.map(*va, make_chunk(f.backend, g));
    }
    REQUIRE(s.reserve_more(g));
    const std::uint64_t second = s.reservations()[1].first;
    REQUIRE(s.free_addresses().take_at(2 * g, second) == second);
    s.map(second, make_chunk(f.backend, 2 * g));
    s.note_growth(6 * g);
    REQUIRE(f.dev->mapped.size() == 5);

    s.release_all();
    CHECK(s.chunks().empty());
    CHECK(f.dev->mapped.empty());
    CHECK(f.dev->handles.empty());
    CHECK(f.dev->physical_used == 0);
    CHECK(f.dev->unmaps == 5);
    CHECK(f.dev->releases == 5);
    CHECK(s.held() == 0);
    CHECK(s.held_seen() == 0);
    CHECK(s.held_high() == 6 * g);
    // Reserved still, and every address free again, each reservation whole.
    CHECK(f.dev->reserved.size() == 2);
    CHECK(s.reserved_addresses() == 16 * GiB);
    CHECK(s.owns(second));
    CHECK(s.free_addresses().has_room(s.base(), 8 * GiB));
    CHECK(s.free_addresses().has_room(second, 8 * GiB));
  }
}

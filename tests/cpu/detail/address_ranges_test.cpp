// A pool's address space: the reservations it makes (their sizes, and which addresses they
// own) and the unmapped ranges inside them that growth, remapping and release take and give
// back. Hand-made cases with exact results, then random sequences checked against a model that
// keeps the free addresses granule by granule.

#include <streamalloc/detail/core/address_ranges.hpp>

#include <doctest/doctest.h>

#include "failing_new.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <map>
#include <new>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

using streamalloc::detail::address_ranges;
using streamalloc::detail::reservation_list;

using test_support::allocations_until_failure;


// A failed take prints the address it gave, or "nothing", instead of doctest's "{?}".
namespace doctest {
template <>
struct StringMaker<std::optional<std::uint64_t>> {
  static String convert(const std::optional<std::uint64_t>& v) {
    return v ? String(("0x" + to_hex(*v)).c_str()) : String("nothing");
  }
  static std::string to_hex(std::uint64_t x) {
    static constexpr char digits[] = "0123456789abcdef";
    std::string s;
    do {
      s.insert(s.begin(), digits[x % 16]);
      x /= 16;
    } while (x != 0);
    return s;
  }
};
}  // namespace doctest

namespace {

constexpr std::uint64_t gib = std::uint64_t{1} << 30;
// The driver's usual minimum granularity: the pool's reservations, mappings and so every range
// are multiples of it.
constexpr std::uint64_t granule = std::uint64_t{2} << 20;
// High enough that addresses below the first reservation exist, and a multiple of every
// alignment used here.
constexpr std::uint64_t base = std::uint64_t{1} << 40;
constexpr std::optional<std::uint64_t> nothing = std::nullopt;

}  // namespace

// --- reservation_list ----------------------------------------------------------------------

TEST_CASE("an empty reservation list owns nothing") {
  const reservation_list list;
  CHECK(list.count() == 0);
  CHECK(list.reserved() == 0);
  CHECK(list.list().empty());
  CHECK_FALSE(list.owns(0));
  CHECK_FALSE(list.owns(base));
  CHECK_FALSE(list.owns(std::numeric_limits<std::uint64_t>::max()));
}

TEST_CASE("next_size: the first reservation is `first`, the need when larger, the limit when smaller") {
  const reservation_list list;
  CHECK(list.next_size(0, 1024 * gib, 8 * gib) == 8 * gib);
  CHECK(list.next_size(1 * gib, 1024 * gib, 8 * gib) == 8 * gib);
  CHECK(list.next_size(12 * gib, 1024 * gib, 8 * gib) == 12 * gib);
  // A limit smaller than `first`: the whole limit.
  CHECK(list.next_size(0, 4 * gib, 8 * gib) == 4 * gib);
  CHECK(list.next_size(3 * gib, 4 * gib, 8 * gib) == 4 * gib);
  CHECK(list.next_size(0, 8 * gib, 8 * gib) == 8 * gib);
  // A need of exactly the limit fits; one byte more, or any need under a limit of 0, does not.
  CHECK(list.next_size(1024 * gib, 1024 * gib, 8 * gib) == 1024 * gib);
  CHECK(list.next_size(1024 * gib + 1, 1024 * gib, 8 * gib) == 0);
  CHECK(list.next_size(0, 0, 8 * gib) == 0);
  CHECK(list.next_size(1, 0, 8 * gib) == 0);
}

TEST_CASE("next_size: a later reservation is at least all before it, the need and `first`, capped by the limit") {
  reservation_list list;
  list.add(base, 8 * gib);
  CHECK(list.reserved() == 8 * gib);
  CHECK(list.next_size(0, 1024 * gib, 8 * gib) == 8 * gib);
  CHECK(list.next_size(1 * gib, 1024 * gib, 8 * gib) == 8 * gib);
  CHECK(list.next_size(20 * gib, 1024 * gib, 8 * gib) == 20 * gib);
  CHECK(list.next_size(0, 1024 * gib, 32 * gib) == 32 * gib);  // never less than `first`
  // 4 GiB left under the limit: all of it, whatever the doubling would ask, if the need fits.
  CHECK(list.next_size(0, 12 * gib, 8 * gib) == 4 * gib);
  CHECK(list.next_size(4 * gib, 12 * gib, 8 * gib) == 4 * gib);
  CHECK(list.next_size(4 * gib + 1, 12 * gib, 8 * gib) == 0);
  // At the limit, or past it (a limit lowered below what is reserved): none.
  CHECK(list.next_size(0, 8 * gib, 8 * gib) == 0);
  CHECK(list.next_size(0, 6 * gib, 8 * gib) == 0);

  list.add(base + 16 * gib, 8 * gib);
  CHECK(list.reserved() == 16 * gib);
  CHECK(list.next_size(0, 1024 * gib, 8 * gib) == 16 * gib);
}

TEST_CASE("next_size: growing by it doubles the reservations until they meet the limit exactly") {
  reservation_list list;
  std::vector<std::uint64_t> sizes;
  std::uint64_t at = base;
  while (const std::uint64_t size = list.next_size(0, 1024 * gib, 8 * gib)) {
    CHECK(size >= list.reserved());  // at least all before it together
    list.add(at, size);
    sizes.push_back(size);
    at += size + granule;
    REQUIRE(sizes.size() <= reservation_list::max_count);
  }
  const std::vector<std::uint64_t> want = {8 * gib, 8 * gib, 16 * gib, 32 * gib, 64 * gib, 128 * gib, 256 * gib, 512 * gib};
  CHECK(sizes == want);
  CHECK(list.reserved() == 1024 * gib);
  CHECK(list.count() == want.size());
  CHECK(list.next_size(0, 1024 * gib, 8 * gib) == 0);
  // Raising the limit lets it go on, doubling again.
  CHECK(list.next_size(0, 4096 * gib, 8 * gib) == 1024 * gib);
}

TEST_CASE("next_size: none once max_count reservations are made, however much the limit leaves") {
  reservation_list list;
  constexpr std::uint64_t no_limit = std::numeric_limits<std::uint64_t>::max();
  // From 1 byte, doubling: 1, 1, 2, 4, ... 2^62; 64 of them hold 2^63 bytes.
  std::uint64_t at = 1;
  while (const std::uint64_t size = list.next_size(0, no_limit, 1)) {
    list.add(at, size);
    at += size;
    REQUIRE(list.count() <= reservation_list::max_count);
  }
  CHECK(list.count() == reservation_list::max_count);
  CHECK(list.reserved() == std::uint64_t{1} << 63);
  CHECK(list.next_size(1, no_limit, 1) == 0);
  // The largest of them, at its boundaries (sizes past 2^62 do not overflow owns).
  const auto all = list.list();
  REQUIRE(all.size() == reservation_list::max_count);
  CHECK(all.back() == std::pair{(std::uint64_t{1} << 62) + 1, std::uint64_t{1} << 62});
  CHECK(list.owns(std::uint64_t{1} << 63));
  CHECK_FALSE(list.owns((std::uint64_t{1} << 63) + 1));
  CHECK(list.owns(1));
  CHECK_FALSE(list.owns(0));
}

TEST_CASE("owns: the first and last byte of each reservation, not the byte before or after") {
  reservation_list list;
  list.add(base, 8 * gib);
  list.add(base + 16 * gib, 4 * gib);
  list.add(base + 20 * gib, 4 * gib);  // adjacent to the one before
  list.add(base - 2 * gib, 1 * gib);   // below all the others
  CHECK(list.count() == 4);
  CHECK(list.reserved() == 17 * gib);
  CHECK(list.first_base() == base);  // the first made, not the lowest
  const std::vector<std::pair<std::uint64_t, std::uint64_t>> want = {
      {base, 8 * gib}, {base + 16 * gib, 4 * gib}, {base + 20 * gib, 4 * gib}, {base - 2 * gib, 1 * gib}};
  CHECK(list.list() == want);  // in the order made

  for (const auto& [b, size] : want) {
    CAPTURE(b);
    CHECK(list.owns(b));
    CHECK(list.owns(b + size / 2));
    CHECK(list.owns(b + size - 1));
  }
  CHECK_FALSE(list.owns(base - 1));
  CHECK_FALSE(list.owns(base + 8 * gib));
  CHECK_FALSE(list.owns(base + 16 * gib - 1));
  CHECK(list.owns(base + 20 * gib));  // the end of one is the start of the next
  CHECK_FALSE(list.owns(base + 24 * gib));
  CHECK_FALSE(list.owns(base - 2 * gib - 1));
  CHECK_FALSE(list.owns(base - 1 * gib));
  CHECK_FALSE(list.owns(0));
  CHECK_FALSE(list.owns(std::numeric_limits<std::uint64_t>::max()));
}

// --- address_ranges ------------------------------------------------------------------------

TEST_CASE("no reservation: no room, nothing to take") {
  address_ranges r;
  CHECK(r.largest() == 0);
  CHECK_FALSE(r.has_room(base, granule));
  CHECK_FALSE(r.has_room(0, 1));
  CHECK(r.take(granule) == nothing);
  CHECK(r.take(granule, base) == nothing);
  CHECK(r.take_at(granule, base) == nothing);
  CHECK(r.take_top(granule) == nothing);
  CHECK(r.take_spaced(granule, granule) == nothing);
}

TEST_CASE("a new reservation is one free range, taken first fit from its start") {
  address_ranges r;
  r.add_reservation(base, 16 * granule);
  CHECK(r.largest() == 16 * granule);
  CHECK(r.has_room(base, 16 * granule));
  CHECK(r.has_room(base + 15 * granule, granule));
  CHECK(r.has_room(base + 1, 16 * granule - 1));  // byte-exact, not only on granules
  CHECK_FALSE(r.has_room(base, 16 * granule + 1));
  CHECK_FALSE(r.has_room(base - 1, 1));
  CHECK_FALSE(r.has_room(base + 16 * granule, 1));

  CHECK(r.take(4 * granule) == base);
  CHECK(r.take(4 * granule) == base + 4 * granule);
  CHECK(r.largest() == 8 * granule);
  CHECK_FALSE(r.has_room(base, granule));
  CHECK_FALSE(r.has_room(base + 8 * granule - 1, 1));
  CHECK(r.has_room(base + 8 * granule, 8 * granule));
  CHECK(r.take(9 * granule) == nothing);  // too large: nothing changes
  CHECK(r.largest() == 8 * granule);
  CHECK(r.take(8 * granule) == base + 8 * granule);  // exactly the rest
  CHECK(r.largest() == 0);
  CHECK_FALSE(r.has_room(base + 15 * granule, 1));
  CHECK(r.take(1) == nothing);
}

TEST_CASE("take_at: exactly the range asked for, or nothing and no change") {
  address_ranges r;
  r.add_reservation(base, 16 * granule);
  // From the middle: the range splits in two.
  CHECK(r.take_at(2 * granule, base + 6 * granule) == base + 6 * granule);
  CHECK(r.has_room(base, 6 * granule));
  CHECK_FALSE(r.has_room(base, 6 * granule + 1));
  CHECK_FALSE(r.has_room(base + 6 * granule, 1));
  CHECK_FALSE(r.has_room(base + 8 * granule - 1, 1));
  CHECK(r.has_room(base + 8 * granule, 8 * granule));
  CHECK(r.largest() == 8 * granule);

  // One granule more than the hole holds, starting taken, or outside every reservation.
  CHECK(r.take_at(7 * granule, base) == nothing);
  CHECK(r.take_at(granule, base + 6 * granule) == nothing);
  CHECK(r.take_at(granule, base + 7 * granule + 1) == nothing);
  CHECK(r.take_at(granule, base - granule) == nothing);
  CHECK(r.take_at(granule, base + 16 * granule) == nothing);
  CHECK(r.take_at(9 * granule, base + 8 * granule) == nothing);
  CHECK(r.has_room(base, 6 * granule));
  CHECK(r.has_room(base + 8 * granule, 8 * granule));

  // Exactly filling the hole before: nothing is left of it.
  CHECK(r.take_at(6 * granule, base) == base);
  CHECK_FALSE(r.has_room(base, 1));
  CHECK(r.take(granule) == base + 8 * granule);  // first fit now skips it
  // From the end of a range: its start stays.
  CHECK(r.take_at(granule, base + 15 * granule) == base + 15 * granule);
  CHECK(r.has_room(base + 9 * granule, 6 * granule));
  CHECK_FALSE(r.has_room(base + 9 * granule, 6 * granule + 1));
  CHECK(r.largest() == 6 * granule);
}

TEST_CASE("take: right at `after` when the request fits there, else first fit") {
  address_ranges r;
  r.add_reservation(base, 16 * granule);
  REQUIRE(r.take_at(4 * granule, base + 4 * granule));  // free: [0, 4) and [8, 16) granules
  CHECK(r.take(2 * granule, base + 10 * granule) == base + 10 * granule);
  // `after` taken, or too little room there: the first range that holds it.
  CHECK(r.take(2 * granule, base + 5 * granule) == base);
  CHECK(r.take(3 * granule, base + 8 * granule) == base + 12 * granule);
  CHECK(r.take(granule, base + 100 * granule) == base + 2 * granule);  // outside: first fit
  CHECK(r.take(granule, 0) == base + 3 * granule);                     // 0: no preference
  // Free now: [8, 10) and [15, 16).
  CHECK(r.take(granule, base + 15 * granule) == base + 15 * granule);
  CHECK(r.take(3 * granule, base + 8 * granule) == nothing);
  CHECK(r.take(2 * granule, base + 9 * granule) == base + 8 * granule);
  CHECK(r.largest() == 0);
}

TEST_CASE("give_back joins the range given back with free ranges on either side") {
  address_ranges r;
  r.add_reservation(base, 16 * granule);
  REQUIRE(r.take(4 * granule) == base);
  REQUIRE(r.take(4 * granule) == base + 4 * granule);
  REQUIRE(r.take(4 * granule) == base + 8 * granule);
  // Free: [12, 16). Given back apart from it: a range of its own.
  r.give_back(base, 4 * granule);
  CHECK(r.has_room(base, 4 * granule));
  CHECK_FALSE(r.has_room(base, 4 * granule + 1));
  CHECK(r.largest() == 4 * granule);
  // Joined with the range after it.
  r.give_back(base + 8 * granule, 4 * granule);
  CHECK(r.has_room(base + 8 * granule, 8 * granule));
  CHECK(r.largest() == 8 * granule);
  // Filling the hole between two ranges: one range again, the whole reservation.
  r.give_back(base + 4 * granule, 4 * granule);
  CHECK(r.has_room(base, 16 * granule));
  CHECK(r.largest() == 16 * granule);
  CHECK(r.take(16 * granule) == base);

  // Given back a granule at a time, in an order that joins with the range before, then after.
  for (std::uint64_t i : {0, 1, 2, 5, 4, 3}) r.give_back(base + i * granule, granule);
  CHECK(r.has_room(base, 6 * granule));
  CHECK_FALSE(r.has_room(base, 6 * granule + 1));
  CHECK(r.largest() == 6 * granule);
  // The end of the reservation, then the part between: one range to the end.
  r.give_back(base + 15 * granule, granule);
  CHECK(r.largest() == 6 * granule);
  r.give_back(base + 6 * granule, 9 * granule);
  CHECK(r.has_room(base, 16 * granule));
  CHECK(r.largest() == 16 * granule);
}

TEST_CASE("give_back needs host memory only for a range that joins none, and throws having changed nothing") {
  // The pool gives addresses back on failure paths and while unmapping, where it may not
  // throw: joining a neighbour must never need memory, and a failure must lose no other range.
  address_ranges r;
  r.add_reservation(base, 16 * granule);
  for (std::uint64_t i = 0; i < 4; ++i) REQUIRE(r.take(4 * granule) == base + i * 4 * granule);
  r.give_back(base + 12 * granule, 4 * granule);  // free: [12, 16)
  allocations_until_failure = 0;
  CHECK_THROWS_AS(r.give_back(base, 2 * granule), std::bad_alloc);  // a range of its own
  CHECK(r.largest() == 4 * granule);
  CHECK(r.has_room(base + 12 * granule, 4 * granule));
  CHECK_FALSE(r.has_room(base, granule));
  r.give_back(base + 10 * granule, 2 * granule);  // joins the range after it
  CHECK(r.has_room(base + 10 * granule, 6 * granule));
  allocations_until_failure = -1;
  r.give_back(base, 2 * granule);
  allocations_until_failure = 0;
  r.give_back(base + 2 * granule, 2 * granule);  // joins the range before it
  CHECK(r.has_room(base, 4 * granule));
  r.give_back(base + 4 * granule, 6 * granule);  // fills the hole between two ranges
  allocations_until_failure = -1;
  CHECK(r.has_room(base, 16 * granule));
  CHECK(r.largest() == 16 * granule);
  CHECK(r.take(16 * granule) == base);
}

TEST_CASE("ranges of adjacent reservations never join, yet each is used whole") {
  address_ranges r;
  const std::uint64_t second = base + 4 * granule;
  r.add_reservation(base, 4 * granule);
  r.add_reservation(second, 4 * granule);
  CHECK(r.largest() == 4 * granule);
  CHECK(r.has_room(base, 4 * granule));
  CHECK_FALSE(r.has_room(base, 4 * granule + 1));
  CHECK_FALSE(r.has_room(base + 3 * granule, 2 * granule));
  CHECK(r.take(5 * granule) == nothing);
  CHECK(r.take_at(2 * granule, base + 3 * granule) == nothing);
  CHECK(r.take_top(5 * granule) == nothing);
  CHECK(r.take_spaced(granule, granule, 5) == nothing);  // 8 granules in all, 4 in the largest

  CHECK(r.take(4 * granule) == base);
  CHECK(r.take(4 * granule) == second);
  CHECK(r.largest() == 0);
  // The last granule of the first and the first of the second, given back in either order:
  // still apart, whether the other is the range after or the range before.
  r.give_back(second, granule);
  r.give_back(base + 3 * granule, granule);
  CHECK(r.largest() == granule);
  CHECK_FALSE(r.has_room(base + 3 * granule, 2 * granule));
  CHECK(r.take_at(granule, base + 3 * granule) == base + 3 * granule);
  CHECK(r.take_at(granule, second) == second);
  r.give_back(base + 3 * granule, granule);
  r.give_back(second, granule);
  CHECK(r.largest() == granule);
  CHECK_FALSE(r.has_room(base + 3 * granule, 2 * granule));
  // The rest of each, in the other order: two whole ranges, never one.
  r.give_back(second + granule, 3 * granule);
  r.give_back(base, 3 * granule);
  CHECK(r.largest() == 4 * granule);
  CHECK(r.has_room(base, 4 * granule));
  CHECK(r.has_room(second, 4 * granule));
  CHECK_FALSE(r.has_room(base, 4 * granule + 1));
  CHECK_FALSE(r.has_room(base + granule, 4 * granule));
}

TEST_CASE("a run at the end of a reservation continues into one made right after it, as extend does") {
  // extend: no room after a run that ends a reservation, nor owned there, so the pool reserves
  // at that address and maps the rest of the growth there.
  address_ranges r;
  reservation_list list;
  r.add_reservation(base, 8 * granule);
  list.add(base, 8 * granule);
  REQUIRE(r.take(8 * granule) == base);
  const std::uint64_t end = base + 8 * granule;
  CHECK_FALSE(r.has_room(end, granule));
  CHECK_FALSE(list.owns(end));
  r.add_reservation(end, 16 * granule);
  list.add(end, 16 * granule);
  CHECK(list.owns(end));
  CHECK(r.has_room(end, 16 * granule));
  CHECK(r.take_at(3 * granule, end) == end);
  CHECK(r.largest() == 13 * granule);
}

TEST_CASE("take_top: the top of the highest range that holds the request") {
  address_ranges r;
  r.add_reservation(base, 16 * granule);
  r.add_reservation(base + 32 * granule, 4 * granule);
  // Runs placed one after another are adjacent, going down.
  CHECK(r.take_top(granule) == base + 35 * granule);
  CHECK(r.take_top(2 * granule) == base + 33 * granule);
  CHECK(r.take_top(2 * granule) == base + 14 * granule);  // one granule left above: too small
  CHECK(r.take_top(granule) == base + 32 * granule);      // the granule left above
  CHECK(r.take_top(14 * granule) == base);                // exactly the rest
  CHECK(r.largest() == 0);
  CHECK(r.take_top(granule) == nothing);
  r.give_back(base + 4 * granule, 2 * granule);
  r.give_back(base + 10 * granule, granule);
  CHECK(r.take_top(2 * granule) == base + 4 * granule);
}

TEST_CASE("take_spaced: the middle of the largest range, on a multiple of align, if spread times it fits") {
  address_ranges r;
  r.add_reservation(base, 16 * granule);
  r.add_reservation(base + 32 * granule, 8 * granule);
  // Largest range: 16 granules; (16 - 2) / 2 = 7 granules in, 7 free after it.
  CHECK(r.take_spaced(2 * granule, granule) == base + 7 * granule);
  CHECK(r.has_room(base, 7 * granule));
  CHECK(r.has_room(base + 9 * granule, 7 * granule));
  r.give_back(base + 7 * granule, 2 * granule);
  // On a multiple of align: 7 granules rounded down to 4.
  CHECK(r.take_spaced(2 * granule, 4 * granule) == base + 4 * granule);
  r.give_back(base + 4 * granule, 2 * granule);
  // The default spread (2): half the largest range fits, one granule more does not.
  CHECK(r.take_spaced(9 * granule, granule) == nothing);
  CHECK(r.take_spaced(8 * granule, granule) == base + 4 * granule);
  r.give_back(base + 4 * granule, 8 * granule);
  // A spread of 4: a quarter. Spreads below 2 count as 2.
  CHECK(r.take_spaced(5 * granule, granule, 4) == nothing);
  CHECK(r.take_spaced(9 * granule, granule, 0) == nothing);
  CHECK(r.take_spaced(9 * granule, granule, 1) == nothing);
  CHECK(r.take_spaced(4 * granule, granule, 4) == base + 6 * granule);
  CHECK(r.largest() == 8 * granule);
  // Ranges of 6, 6 and 8 granules: the 8 of the second reservation.
  CHECK(r.take_spaced(granule, granule, 8) == base + 35 * granule);
  CHECK(r.has_room(base + 32 * granule, 3 * granule));
  CHECK(r.has_room(base + 36 * granule, 4 * granule));
  // Ranges of 6, 6, 3 and 4: the lower of the two largest.
  CHECK(r.take_spaced(2 * granule, 2 * granule, 3) == base + 2 * granule);
  CHECK(r.has_room(base, 2 * granule));
  CHECK(r.has_room(base + 4 * granule, 2 * granule));
  CHECK(r.largest() == 6 * granule);
}

// In the pool every range starts on a granule and align is the granularity; a larger align,
// over a range that does not start on one, still gives a multiple of it (rounded up into the
// range when rounding down would leave it), or nothing when no multiple leaves room.
TEST_CASE("take_spaced: the address is a multiple of align even when the range's start is not") {
  address_ranges r;
  r.add_reservation(base + granule, 16 * granule);
  const auto at = r.take_spaced(granule, 4 * granule);
  REQUIRE(at.has_value());
  CHECK(*at >= base + granule);
  CHECK(*at + granule <= base + 17 * granule);
  CHECK(*at % (4 * granule) == 0);
  CHECK(*at == base + 8 * granule);  // the middle (base + 8.5 granules) rounded down
  // A range of 3 granules from base + 1 holds no 4-granule multiple with a granule after it.
  address_ranges small;
  small.add_reservation(base + 5 * granule, 2 * granule);
  CHECK_FALSE(small.take_spaced(granule, 8 * granule, 2).has_value());
  CHECK(small.largest() == 2 * granule);  // nothing was taken
}

// --- random sequences against a model ------------------------------------------------------

namespace {

/// What address_ranges should hold, granule by granule: the free granules, the reservations,
/// and the pieces taken (each inside one reservation, given back in parts as chunks are).
struct model {
  std::map<std::uint64_t, std::uint64_t> reservations;  // base -> bytes
  std::set<std::uint64_t> free;                          // granule addresses
  std::map<std::uint64_t, std::uint64_t> taken;          // at -> bytes

  /// The maximal free ranges: runs of free granules, cut at each reservation's start.
  [[nodiscard]] std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges() const {
    std::vector<std::pair<std::uint64_t, std::uint64_t>> out;  // start, end
    for (std::uint64_t g : free) {
      if (!out.empty() && out.back().second == g && !reservations.contains(g)) {
        out.back().second += granule;
      } else {
        out.emplace_back(g, g + granule);
      }
    }
    return out;
  }
  [[nodiscard]] bool owns(std::uint64_t p) const {
    auto it = reservations.upper_bound(p);
    if (it == reservations.begin()) return false;
    --it;
    return p < it->first + it->second;
  }
  [[nodiscard]] std::uint64_t reserved() const {
    std::uint64_t n = 0;
    for (const auto& [b, size] : reservations) n += size;
    return n;
  }

  // What each take should answer, from the ranges.
  [[nodiscard]] std::optional<std::uint64_t> take_at(std::uint64_t bytes, std::uint64_t at) const {
    for (const auto& [s, e] : ranges()) {
      if (s <= at && at < e) return at + bytes <= e ? std::optional{at} : nothing;
    }
    return nothing;
  }
  [[nodiscard]] std::optional<std::uint64_t> take(std::uint64_t bytes, std::uint64_t after) const {
    if (after != 0) {
      if (auto at = take_at(bytes, after)) return at;
    }
    for (const auto& [s, e] : ranges()) {
      if (e - s >= bytes) return s;
    }
    return nothing;
  }
  [[nodiscard]] std::optional<std::uint64_t> take_top(std::uint64_t bytes) const {
    const auto rs = ranges();
    for (auto it = rs.rbegin(); it != rs.rend(); ++it) {
      if (it->second - it->first >= bytes) return it->second - bytes;
    }
    return nothing;
  }
  [[nodiscard]] std::optional<std::uint64_t> take_spaced(std::uint64_t bytes, std::uint64_t align,
                                                         std::uint64_t spread) const {
    std::uint64_t s = 0, len = 0;
    for (const auto& [rs, re] : ranges()) {
      if (re - rs > len) {  // strictly: the lowest of equally large ones
        s = rs;
        len = re - rs;
      }
    }
    if (len < bytes * std::max<std::uint64_t>(spread, 2)) return nothing;
    // The middle rounded down to a multiple of align, or up into the range; nothing if no
    // multiple leaves room.
    std::uint64_t at = (s + (len - bytes) / 2) / align * align;
    if (at < s) at += align;
    if (at + bytes > s + len) return nothing;
    return at;
  }
};

/// A random size in granules, mostly small, now and then large.
std::uint64_t random_bytes(std::mt19937_64& rng) {
  return (rng() % 4 == 0 ? rng() % 24 + 1 : rng() % 4 + 1) * granule;
}

/// Every granule of every reservation and one either side, and every free range end to end,
/// against the model; CHECKs only on a mismatch so that agreeing queries do not flood doctest's
/// counters. Returns whether all agreed.
bool agrees(const address_ranges& r, const reservation_list& list, const model& m) {
  bool ok = true;
  auto expect = [&](bool got, bool want, const char* what, std::uint64_t at, std::uint64_t bytes) {
    if (got == want) return;
    ok = false;
    CAPTURE(what);
    CAPTURE(at);
    CAPTURE(bytes);
    CHECK(got == want);
  };
  for (const auto& [b, size] : m.reservations) {
    for (std::uint64_t g = b - granule; g < b + size + granule; g += granule) {
      const bool free = m.free.contains(g);
      expect(r.has_room(g, granule), free, "has_room(granule)", g, granule);
      expect(r.has_room(g + 1, granule - 1), free, "has_room(inside a granule)", g + 1, granule - 1);
      expect(list.owns(g), m.owns(g), "owns", g, 0);
      expect(list.owns(g + granule - 1), m.owns(g), "owns(last byte)", g + granule - 1, 0);
    }
  }
  // Each range whole, and not one byte longer: a range cut short or joined with the next
  // (across a reservation's start) shows here.
  std::uint64_t largest = 0, free_bytes = 0;
  for (const auto& [s, e] : m.ranges()) {
    expect(r.has_room(s, e - s), true, "has_room(range)", s, e - s);
    expect(r.has_room(s, e - s + 1), false, "has_room(range + 1)", s, e - s + 1);
    largest = std::max(largest, e - s);
    free_bytes += e - s;
  }
  if (r.largest() != largest) {
    ok = false;
    CHECK(r.largest() == largest);
  }
  // Free and taken bytes make up the reservations; the model's own bookkeeping, which the
  // checks above rest on.
  std::uint64_t taken_bytes = 0;
  for (const auto& [at, bytes] : m.taken) taken_bytes += bytes;
  if (free_bytes + taken_bytes != m.reserved() || m.reserved() != list.reserved() ||
      m.reservations.size() != list.count()) {
    ok = false;
    CHECK(free_bytes + taken_bytes == m.reserved());
    CHECK(list.reserved() == m.reserved());
    CHECK(list.count() == m.reservations.size());
  }
  return ok;
}

}  // namespace

TEST_CASE("random takes and give-backs agree with a granule-by-granule model") {
  std::uint64_t operations_checked = 0, takes_done = 0, takes_refused = 0, give_backs = 0;
  for (std::uint64_t seed : {1, 2, 3, 4, 5, 6}) {
    CAPTURE(seed);
    std::mt19937_64 rng(seed);
    address_ranges r;
    reservation_list list;
    model m;
    std::uint64_t low = base, high = base;  // the reservations lie within [low, high)

    auto reserve = [&](std::uint64_t at, std::uint64_t bytes) {
      r.add_reservation(at, bytes);
      list.add(at, bytes);
      m.reservations.emplace(at, bytes);
      for (std::uint64_t g = at; g < at + bytes; g += granule) m.free.insert(g);
      low = std::min(low, at);
      high = std::max(high, at + bytes);
    };
    reserve(base, 32 * granule);

    // An address in or near the reservations, on a granule.
    auto random_address = [&] { return low - 2 * granule + rng() % ((high - low) / granule + 4) * granule; };

    constexpr int operations = 4000;
    for (int op = 0; op < operations; ++op) {
      // Phases of 500 operations that mostly take, then mostly give back: the reservations
      // run full (takes refused) and empty out again (ranges joining) many times.
      const bool filling = op / 500 % 2 == 0;
      const unsigned what = static_cast<unsigned>(rng() % 100);
      CAPTURE(op);
      CAPTURE(what);
      if (what < 3 && m.reservations.size() < 12) {
        // Right after the highest (so their ranges meet), a few granules above it, or below
        // the lowest.
        const std::uint64_t bytes = (rng() % 40 + 1) * granule;
        const unsigned where = static_cast<unsigned>(rng() % 3);
        const std::uint64_t at = where == 0   ? high
                                 : where == 1 ? high + (rng() % 4 + 1) * granule
                                              : low - bytes - rng() % 2 * granule;
        reserve(at, bytes);
      } else if (what < (filling ? 75u : 35u)) {
        // A take of one of the four kinds, checked against the model's answer.
        const std::uint64_t bytes = random_bytes(rng);
        std::optional<std::uint64_t> got, want;
        const unsigned kind = static_cast<unsigned>(rng() % 4);
        if (kind == 0) {
          // `after`: none, the end of a piece (a run's tail, as the pool passes), or anywhere.
          std::uint64_t after = 0;
          const unsigned pick = static_cast<unsigned>(rng() % 3);
          if (pick == 1 && !m.taken.empty()) {
            auto it = std::next(m.taken.begin(), static_cast<std::ptrdiff_t>(rng() % m.taken.size()));
            after = it->first + it->second;
          } else if (pick == 2) {
            after = random_address();
          }
          CAPTURE(after);
          want = m.take(bytes, after);
          got = r.take(bytes, after);
        } else if (kind == 1) {
          const std::uint64_t at = random_address();
          CAPTURE(at);
          want = m.take_at(bytes, at);
          got = r.take_at(bytes, at);
        } else if (kind == 2) {
          want = m.take_top(bytes);
          got = r.take_top(bytes);
        } else {
          const std::uint64_t align = granule << (rng() % 3);
          const std::uint64_t spread = rng() % 5;
          CAPTURE(align);
          CAPTURE(spread);
          want = m.take_spaced(bytes, align, spread);
          got = r.take_spaced(bytes, align, spread);
          if (got) CHECK(*got % align == 0);
        }
        CAPTURE(kind);
        CAPTURE(bytes);
        REQUIRE(got == want);
        if (got) {
          // All of it was free, and in one reservation: no overlap with a piece taken before.
          std::uint64_t was_free = 0;
          for (std::uint64_t g = *got; g < *got + bytes; g += granule) was_free += m.free.erase(g);
          REQUIRE(was_free * granule == bytes);
          auto in = std::prev(m.reservations.upper_bound(*got));
          REQUIRE(*got + bytes <= in->first + in->second);
          m.taken.emplace(*got, bytes);
          ++takes_done;
        } else {
          ++takes_refused;
        }
      } else if (!m.taken.empty()) {
        // A piece given back whole, or a part of it (its first, last or a middle chunk), as
        // the pool gives back a run chunk by chunk.
        auto it = std::next(m.taken.begin(), static_cast<std::ptrdiff_t>(rng() % m.taken.size()));
        const std::uint64_t at = it->first, n = it->second / granule;
        const std::uint64_t from = rng() % 2 == 0 ? 0 : rng() % n;
        const std::uint64_t to = rng() % 2 == 0 ? n : from + 1 + rng() % (n - from);
        m.taken.erase(it);
        if (from > 0) m.taken.emplace(at, from * granule);
        if (to < n) m.taken.emplace(at + to * granule, (n - to) * granule);
        for (std::uint64_t i = from; i < to; ++i) m.free.insert(at + i * granule);
        CAPTURE(at + from * granule);
        CAPTURE((to - from) * granule);
        r.give_back(at + from * granule, (to - from) * granule);
        ++give_backs;
      }
      REQUIRE(agrees(r, list, m));
      ++operations_checked;
    }
  }
  // The sequences did what they were for: many of each, and full enough that takes failed.
  CHECK(operations_checked == 6 * 4000);
  CHECK(takes_done > 5000);
  CHECK(takes_refused > 500);
  CHECK(give_backs > 5000);
}

// fresh_blocks, the hash table where a pool's lately made blocks wait for its address index:
// every operation against a std::map, through growth, collisions, erases that shift probe runs
// back, drains in address order and drains cut short by an exception.

#include <streamalloc/detail/core/fresh_blocks.hpp>

#include <doctest/doctest.h>

#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <stdexcept>
#include <vector>

using streamalloc::detail::block;
using streamalloc::detail::fresh_blocks;

namespace {

// Blocks to point at: the table only stores the pointers.
std::vector<std::unique_ptr<block>> make_blocks(std::size_t n) {
  std::vector<std::unique_ptr<block>> v;
  for (std::size_t i = 0; i < n; ++i) v.push_back(std::make_unique<block>());
  return v;
}

void check_matches(const fresh_blocks& t, const std::map<std::uint64_t, block*>& want) {
  REQUIRE(t.size() == want.size());
  CHECK(t.empty() == want.empty());
  for (const auto& [addr, b] : want) CHECK(t.find(addr) == b);
}

}  // namespace

TEST_CASE("fresh_blocks: inserts, finds, assigns and erases agree with a map, through growth and collisions") {
  std::mt19937_64 rng(3);
  auto blocks = make_blocks(64);
  fresh_blocks t;
  std::map<std::uint64_t, block*> want;
  CHECK(t.find(0x1000) == nullptr);
  CHECK_FALSE(t.erase(0x1000));
  // Addresses from a narrow range, so that many share a home slot, and some far apart.
  auto address = [&] {
    return rng() % 4 == 0 ? (rng() % (1ull << 40)) / 256 * 256 : 0x7f0000000000ull + (rng() % 4096) * 256;
  };
  for (int step = 0; step < 200000; ++step) {
    const std::uint64_t a = address();
    block* b = blocks[rng() % blocks.size()].get();
    switch (rng() % 4) {
      case 0:
      case 1:
        if (want.count(a) == 0 && !t.full()) {
          t.insert(a, b);
          want[a] = b;
        }
        break;
      case 2: {
        const bool present = want.count(a) != 0;
        CHECK(t.assign(a, b) == present);
        if (present) want[a] = b;
        break;
      }
      default: {
        // Mostly erase what is there, or the table would only fill.
        std::uint64_t victim = a;
        if (!want.empty() && rng() % 4 != 0) victim = std::next(want.begin(), static_cast<long>(rng() % want.size()))->first;
        CHECK(t.erase(victim) == (want.erase(victim) != 0));
        break;
      }
    }
    if (step % 1000 == 0) check_matches(t, want);
  }
  check_matches(t, want);
}

TEST_CASE("fresh_blocks: full at max_entries; at_or_before finds the greatest address at or below") {
  auto blocks = make_blocks(fresh_blocks::max_entries);
  fresh_blocks t;
  std::map<std::uint64_t, block*> want;
  for (std::size_t i = 0; i < fresh_blocks::max_entries; ++i) {
    REQUIRE_FALSE(t.full());
    const std::uint64_t a = 0x100000 + i * 7 * 256;  // gaps between them
    t.insert(a, blocks[i].get());
    want[a] = blocks[i].get();
  }
  CHECK(t.full());
  check_matches(t, want);
  for (std::uint64_t probe : {0x0ull, 0xfffffull, 0x100000ull, 0x100001ull, 0x100000ull + 7 * 256 * 500 + 5,
                              0x100000ull + 7 * 256 * 5000}) {
    auto it = want.upper_bound(probe);
    block* expected = it == want.begin() ? nullptr : std::prev(it)->second;
    CHECK(t.at_or_before(probe) == expected);
  }
}

TEST_CASE("fresh_blocks: drain hands every entry over in address order and empties the table") {
  std::mt19937_64 rng(5);
  auto blocks = make_blocks(fresh_blocks::max_entries);
  fresh_blocks t;
  std::map<std::uint64_t, block*> want;
  for (std::size_t i = 0; i < 700; ++i) {
    const std::uint64_t a = (rng() % (1ull << 30)) * 256;
    if (want.count(a) != 0) continue;
    t.insert(a, blocks[i].get());
    want[a] = blocks[i].get();
  }
  std::vector<std::pair<std::uint64_t, block*>> got;
  t.drain([&](std::uint64_t a, block* b) { got.emplace_back(a, b); });
  CHECK(got == std::vector<std::pair<std::uint64_t, block*>>(want.begin(), want.end()));
  CHECK(t.empty());
  CHECK(t.find(want.begin()->first) == nullptr);
  // And it works again after giving its slots back.
  t.insert(0x4000, blocks[0].get());
  CHECK(t.find(0x4000) == blocks[0].get());
}

TEST_CASE("fresh_blocks: a drain cut short by an exception keeps the entry that threw and those after it") {
  auto blocks = make_blocks(100);
  fresh_blocks t;
  std::map<std::uint64_t, block*> want;
  for (std::size_t i = 0; i < 100; ++i) {
    const std::uint64_t a = 0x200000 + ((i * 37) % 100) * 256;  // inserted out of order
    t.insert(a, blocks[i].get());
    want[a] = blocks[i].get();
  }
  std::size_t handed = 0;
  CHECK_THROWS_AS(t.drain([&](std::uint64_t, block*) {
    if (handed == 40) throw std::runtime_error("no room");
    ++handed;
  }),
                  std::runtime_error);
  // The first 40 in address order went; the 41st, which threw, and the rest are still there.
  auto keep_from = std::next(want.begin(), 40);
  want.erase(want.begin(), keep_from);
  check_matches(t, want);
  std::vector<std::uint64_t> rest;
  t.drain([&](std::uint64_t a, block*) { rest.push_back(a); });
  CHECK(rest.size() == 60);
  CHECK(rest.front() == want.begin()->first);
  CHECK(t.empty());
}

#include <streamalloc/detail/core/address_index.hpp>

#include <doctest/doctest.h>

#include "failing_new.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <map>
#include <new>
#include <random>
#include <utility>
#include <vector>

using test_support::allocations_until_failure;

namespace {

struct item {
  std::uint64_t key;
};
using index = streamalloc::detail::address_index<item>;
using model = std::map<std::uint64_t, item*>;

// Values are never dereferenced: a distinct fake pointer per key and version lets a check see
// whether assign replaced a value.
item* value_for(std::uint64_t key, unsigned version = 0) {
  return reinterpret_cast<item*>(static_cast<std::uintptr_t>(key / 256 * 4 + version + 1) * alignof(item));
}

item* model_at_or_before(const model& m, std::uint64_t key) {
  auto it = m.upper_bound(key);
  return it == m.begin() ? nullptr : std::prev(it)->second;
}
item* model_before(const model& m, std::uint64_t key) {
  auto it = m.lower_bound(key);
  return it == m.begin() ? nullptr : std::prev(it)->second;
}
item* model_find(const model& m, std::uint64_t key) {
  auto it = m.find(key);
  return it == m.end() ? nullptr : it->second;
}

// Every query at `key` and around it against the model; CHECKs only on a mismatch, so that
// millions of agreeing queries do not flood doctest's counters.
void check_queries(const index& ix, const model& m, std::uint64_t key) {
  for (std::uint64_t k : {key - 1, key, key + 1, key + 255, key + 256}) {
    if (ix.find(k) != model_find(m, k)) CHECK(ix.find(k) == model_find(m, k));
    if (ix.at_or_before(k) != model_at_or_before(m, k)) CHECK(ix.at_or_before(k) == model_at_or_before(m, k));
    if (ix.before(k) != model_before(m, k)) CHECK(ix.before(k) == model_before(m, k));
  }
}

void check_whole(const index& ix, const model& m) {
  REQUIRE(ix.check_invariants());
  REQUIRE(ix.size() == m.size());
  CHECK(ix.empty() == m.empty());
}

}  // namespace

TEST_CASE("an empty index answers null") {
  index ix;
  CHECK(ix.empty());
  CHECK(ix.size() == 0);
  CHECK(ix.check_invariants());
  for (std::uint64_t k : {std::uint64_t{0}, std::uint64_t{256}, ~std::uint64_t{0}}) {
    CHECK(ix.find(k) == nullptr);
    CHECK(ix.at_or_before(k) == nullptr);
    CHECK(ix.before(k) == nullptr);
  }
  ix.clear();
  CHECK(ix.empty());
}

TEST_CASE("edge keys: 0, the top of the address space, exact and between keys") {
  const std::uint64_t top = ~std::uint64_t{0} - 255;  // the greatest multiple of 256
  index ix;
  ix.insert(0, value_for(0));
  ix.insert(top, value_for(top));
  ix.insert(4096, value_for(4096));
  CHECK(ix.check_invariants());
  CHECK(ix.size() == 3);

  CHECK(ix.find(0) == value_for(0));
  CHECK(ix.at_or_before(0) == value_for(0));
  CHECK(ix.before(0) == nullptr);
  CHECK(ix.before(1) == value_for(0));

  CHECK(ix.find(4096) == value_for(4096));
  CHECK(ix.find(4095) == nullptr);
  CHECK(ix.at_or_before(4095) == value_for(0));
  CHECK(ix.at_or_before(4096) == value_for(4096));
  CHECK(ix.before(4096) == value_for(0));
  CHECK(ix.before(4097) == value_for(4096));

  CHECK(ix.find(top) == value_for(top));
  CHECK(ix.at_or_before(top - 1) == value_for(4096));
  CHECK(ix.at_or_before(top) == value_for(top));
  CHECK(ix.at_or_before(~std::uint64_t{0}) == value_for(top));
  CHECK(ix.before(top) == value_for(4096));
  CHECK(ix.before(~std::uint64_t{0}) == value_for(top));
  CHECK(ix.find(~std::uint64_t{0}) == nullptr);

  ix.assign(top, value_for(top, 1));
  CHECK(ix.find(top) == value_for(top, 1));
  CHECK(ix.size() == 3);
  ix.assign(512, value_for(512));  // assign of an absent key inserts
  CHECK(ix.size() == 4);
  CHECK(ix.before(4096) == value_for(512));

  ix.erase(0);
  CHECK(ix.at_or_before(256) == nullptr);
  CHECK(ix.before(512) == nullptr);
  ix.erase(top);
  CHECK(ix.at_or_before(~std::uint64_t{0}) == value_for(4096));
  ix.erase(512);
  ix.erase(4096);
  CHECK(ix.empty());
  CHECK(ix.check_invariants());
  CHECK(ix.at_or_before(~std::uint64_t{0}) == nullptr);
}

TEST_CASE("sequential patterns") {
  constexpr std::uint64_t n = 20000;
  auto key = [](std::uint64_t i) { return (i + 1) * 256; };
  auto fill = [&](index& ix, model& m, bool ascending) {
    for (std::uint64_t j = 0; j < n; ++j) {
      const std::uint64_t i = ascending ? j : n - 1 - j;
      ix.insert(key(i), value_for(key(i)));
      m[key(i)] = value_for(key(i));
      if (j % 997 == 0) REQUIRE(ix.check_invariants());
    }
    check_whole(ix, m);
  };
  auto check_all = [&](const index& ix, const model& m) {
    check_whole(ix, m);
    for (std::uint64_t i = 0; i <= n; i += 7) check_queries(ix, m, key(i));
  };

  SUBCASE("ascending inserts, erased from the front") {
    index ix;
    model m;
    fill(ix, m, true);
    check_all(ix, m);
    for (std::uint64_t i = 0; i < n; ++i) {
      ix.erase(key(i));
      m.erase(key(i));
      if (i % 1009 == 0) check_all(ix, m);
    }
    check_whole(ix, m);
  }
  SUBCASE("descending inserts, erased from the back") {
    index ix;
    model m;
    fill(ix, m, false);
    check_all(ix, m);
    for (std::uint64_t i = n; i-- > 0;) {
      ix.erase(key(i));
      m.erase(key(i));
      if (i % 1009 == 0) check_all(ix, m);
    }
    check_whole(ix, m);
  }
  SUBCASE("every other entry erased, then the rest") {
    index ix;
    model m;
    fill(ix, m, true);
    for (std::uint64_t i = 0; i < n; i += 2) {
      ix.erase(key(i));
      m.erase(key(i));
    }
    check_all(ix, m);
    for (std::uint64_t i = 1; i < n; i += 2) {
      CHECK(ix.before(key(i)) == (i >= 3 ? value_for(key(i - 2)) : nullptr));
      CHECK(ix.at_or_before(key(i) + 256) == value_for(key(i)));
    }
    for (std::uint64_t i = 1; i < n; i += 2) {
      ix.erase(key(i));
      m.erase(key(i));
    }
    check_whole(ix, m);
  }
}

// How a pool's index is used: blocks split off one free block one after another (each key
// just above the last, which the index inserts into its last leaf without a descent), with
// merges erasing keys here and there, and splits landing between old keys. The remembered
// leaf must never take a key its parents' separators put in another leaf.
TEST_CASE("keys inserted just above the last, between erases and inserts elsewhere, agree with std::map") {
  index ix;
  model m;
  std::mt19937_64 rng(7);
  std::uint64_t next = 1 << 20;
  for (int step = 0; step < 200000; ++step) {
    const unsigned what = rng() % 16;
    if (what < 10 || m.empty()) {  // the next block split off the free tail
      next += 256 * (1 + rng() % 16);
      ix.insert(next, value_for(next));
      m[next] = value_for(next);
    } else if (what < 14) {  // a merge: some block's key goes
      auto it = m.lower_bound(rng() % (next + 1));
      if (it == m.end()) it = m.begin();
      ix.erase(it->first);
      m.erase(it);
    } else {  // a split inside an older free block: a key between existing ones
      const std::uint64_t k = (rng() % (next / 256 + 1)) * 256 + 128;
      if (m.count(k) == 0) {
        ix.insert(k, value_for(k));
        m[k] = value_for(k);
      }
    }
    if (step % 4999 == 0) REQUIRE(ix.check_invariants());
    const std::uint64_t probe = rng() % (next + 512);
    if (ix.at_or_before(probe) != model_at_or_before(m, probe)) FAIL("at_or_before ", probe);
    if (ix.find(next) != model_find(m, next)) FAIL("find ", next);
  }
  CHECK(ix.size() == m.size());
  CHECK(ix.check_invariants());
}

TEST_CASE("the same keys erased and inserted again and again, and keys beside them, agree with std::map") {
  // A pool splits and merges its free blocks at the same addresses step after step: the same
  // keys go and come back, with a neighbour now and then.
  index ix;
  model m;
  std::mt19937_64 rng(11);
  for (int step = 0; step < 300000; ++step) {
    std::uint64_t k = (rng() % 2000) * 4096;
    if (rng() % 8 == 0) k += 256 * (1 + rng() % 3);  // now and then a split at another offset
    if (m.erase(k) != 0) {
      ix.erase(k);
    } else {
      ix.insert(k, value_for(k, step % 3));
      m[k] = value_for(k, step % 3);
    }
    const std::uint64_t probe = rng() % (2001 * 4096);
    if (ix.at_or_before(probe) != model_at_or_before(m, probe)) FAIL("at_or_before ", probe);
    if (ix.find(k) != model_find(m, k)) FAIL("find ", k);
    if (step % 9999 == 0) check_whole(ix, m);
  }
  check_whole(ix, m);
  // Emptied in key order: leaves empty one after another and merge from the left.
  for (auto it = m.begin(); it != m.end();) {
    ix.erase(it->first);
    it = m.erase(it);
    const std::uint64_t probe = rng() % (2001 * 4096);
    if (ix.at_or_before(probe) != model_at_or_before(m, probe)) FAIL("at_or_before ", probe);
  }
  check_whole(ix, m);
  CHECK(ix.empty());
}

TEST_CASE("random operations agree with std::map, dense and sparse keys") {
  for (std::uint64_t seed : {1, 2, 3, 4}) {
    CAPTURE(seed);
    std::mt19937_64 rng(seed);
    index ix;
    model m;
    std::vector<std::uint64_t> keys;  // those in m, for erasing one at random
    // Dense: 4,000 slots, so erases, reinserts and neighbours collide often. Sparse: keys all
    // over the address space, up to the top.
    const std::uint64_t slots = seed % 2 == 0 ? 4000 : (std::uint64_t{1} << 56);
    auto random_key = [&] { return rng() % slots * 256; };
    constexpr int operations = 50000;
    for (int op = 0; op < operations; ++op) {
      const unsigned what = static_cast<unsigned>(rng() % 10);
      // Grow during the first half, shrink during the second, so both splits and merges run.
      const bool growing = op < operations / 2;
      if (what < (growing ? 4u : 2u)) {
        const std::uint64_t k = random_key();
        if (m.emplace(k, value_for(k)).second) {
          ix.insert(k, value_for(k));
          keys.push_back(k);
        }
      } else if (what < 5) {
        const std::uint64_t k = rng() % 2 == 0 && !keys.empty() ? keys[rng() % keys.size()] : random_key();
        const unsigned version = static_cast<unsigned>(rng() % 3);
        if (m.find(k) == m.end()) keys.push_back(k);
        m[k] = value_for(k, version);
        ix.assign(k, value_for(k, version));
      } else if (what < (growing ? 7u : 8u) && !keys.empty()) {
        const std::size_t i = rng() % keys.size();
        ix.erase(keys[i]);
        m.erase(keys[i]);
        std::swap(keys[i], keys.back());
        keys.pop_back();
      } else {
        check_queries(ix, m, !keys.empty() && rng() % 2 == 0 ? keys[rng() % keys.size()] : random_key());
      }
      if (ix.size() != m.size()) REQUIRE(ix.size() == m.size());
      if (op % 5000 == 0) check_whole(ix, m);
    }
    check_whole(ix, m);
  }
}

TEST_CASE("grows to 100,000 entries, shrinks to 10 in random order, grows again") {
  std::mt19937_64 rng(99);
  index ix;
  model m;
  std::vector<std::uint64_t> keys;
  auto grow = [&](std::size_t to) {
    while (m.size() < to) {
      const std::uint64_t k = rng() % (std::uint64_t{1} << 30) * 256;
      if (!m.emplace(k, value_for(k)).second) continue;
      ix.insert(k, value_for(k));
      keys.push_back(k);
      if (m.size() % 20000 == 0) check_whole(ix, m);
    }
    check_whole(ix, m);
  };
  grow(100000);
  std::shuffle(keys.begin(), keys.end(), rng);
  while (keys.size() > 10) {
    ix.erase(keys.back());
    m.erase(keys.back());
    keys.pop_back();
    if (keys.size() % 97 == 0) check_queries(ix, m, keys[rng() % keys.size()]);
    if (keys.size() % 4999 == 0) check_queries(ix, m, rng() % (std::uint64_t{1} << 30) * 256);
    if (keys.size() % 10000 == 0 || keys.size() < 100) check_whole(ix, m);
  }
  check_whole(ix, m);
  for (std::uint64_t k : keys) check_queries(ix, m, k);
  grow(30000);
  for (int i = 0; i < 2000; ++i) check_queries(ix, m, keys[rng() % keys.size()]);

  index moved = std::move(ix);
  check_whole(moved, m);
  CHECK(ix.empty());  // NOLINT(bugprone-use-after-move): a moved-from index is empty
  moved.clear();
  CHECK(moved.empty());
  CHECK(moved.find(keys[0]) == nullptr);
  CHECK(moved.check_invariants());
}

TEST_CASE("an insert whose allocation fails leaves the index as it was") {
  std::mt19937_64 rng(5);
  index ix;
  model m;
  int failures = 0;
  for (int i = 0; i < 30000; ++i) {
    const std::uint64_t k = rng() % (std::uint64_t{1} << 30) * 256;
    if (m.contains(k)) continue;
    // A split needs a leaf, and an inner node per full level above: fail the first, second or
    // third of them (inserts that need none are not affected).
    bool inserted = true;
    allocations_until_failure = static_cast<int>(rng() % 3);
    try {
      ix.insert(k, value_for(k));
    } catch (const std::bad_alloc&) {
      inserted = false;
    }
    allocations_until_failure = -1;
    if (inserted) {
      m.emplace(k, value_for(k));
    } else {
      ++failures;
      CHECK(ix.find(k) == nullptr);
    }
    if (ix.size() != m.size()) REQUIRE(ix.size() == m.size());
    if (i % 3000 == 0) check_whole(ix, m);
  }
  CHECK(failures > 100);
  check_whole(ix, m);
  std::size_t n = 0;
  for (const auto& [key, value] : m) {
    if (n++ % 37 == 0) check_queries(ix, m, key);
  }
}

TEST_CASE("after reserve_insert, an insert needs no host memory, whatever it splits") {
  // The pool takes what an insert may need before it changes anything it cannot undo (a free
  // block's start moved up, block_chain::give_front): the insert then may not fail.
  std::mt19937_64 rng(11);
  index ix;
  model m;
  for (int i = 0; i < 40000; ++i) {  // some 1,000 leaf splits, and inner ones above them
    const std::uint64_t k = (i % 4 == 0 ? rng() % (std::uint64_t{1} << 30) : std::uint64_t(i) << 12) * 256;
    if (m.contains(k)) continue;
    ix.reserve_insert();
    {
      const test_support::refusing_allocations refused;
      CHECK_NOTHROW(ix.insert(k, value_for(k)));
    }
    m.emplace(k, value_for(k));
    if (i % 5000 == 0) check_whole(ix, m);
  }
  check_whole(ix, m);
}

#include <streamalloc/detail/core/free_bins.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <random>
#include <vector>

using streamalloc::detail::block;
using streamalloc::detail::free_bins;

namespace {
// When set, the bins' groups of list heads cannot be made, as when host memory runs out.
bool refuse_groups = false;
}  // namespace

// The bins make their groups with the nothrow array new; a test refuses them through this.
// Every array new and delete is replaced together, so each pair matches (the address
// sanitizer checks that what the system's new[] made is not given to free).
[[gnu::noinline]] void* operator new[](std::size_t bytes, const std::nothrow_t&) noexcept {
  if (refuse_groups) return nullptr;
  return std::malloc(bytes == 0 ? 1 : bytes);
}
[[gnu::noinline]] void* operator new[](std::size_t bytes) {
  if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
  throw std::bad_alloc();
}
[[gnu::noinline]] void operator delete[](void* p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

TEST_CASE("bins cover sizes in order, each bin a narrow range") {
  unsigned last = 0;
  for (std::uint64_t s = 256; s < (std::uint64_t{1} << 40); s += s / 7 + 256) {
    const unsigned b = free_bins::bin_of(s);
    CHECK(b >= last);  // monotone
    last = b;
    CHECK(free_bins::bin_floor(b) <= s);
    if (b + 1 < free_bins::bin_count) CHECK(s < free_bins::bin_floor(b + 1));
    // Above 16 KiB a bin spans at most 1/32 of its floor.
    if (s >= (16u << 10) && b + 1 < free_bins::bin_count) {
      CHECK(free_bins::bin_floor(b + 1) - free_bins::bin_floor(b) <= free_bins::bin_floor(b) / 32);
    }
  }
  CHECK(free_bins::bin_of(256) == 1);
  CHECK(free_bins::bin_of(16 << 10) == free_bins::linear_bins);
}

TEST_CASE("find returns a large enough block, close to the best fit; remove unlinks") {
  std::mt19937_64 rng(7);
  std::vector<block> blocks(2000);
  free_bins bins;
  for (auto& b : blocks) {
    b.size = (rng() % (64ull << 20) / 256 + 1) * 256;
    bins.insert(&b);
  }
  CHECK(bins.count() == blocks.size());
  for (int i = 0; i < 500; ++i) {
    const std::uint64_t n = (rng() % (32ull << 20) / 256 + 1) * 256;
    block* got = bins.find(n, [](block*) { return true; });
    std::uint64_t best = ~0ull;
    for (auto& b : blocks) {
      if (b.bins == &bins && b.size >= n) best = std::min(best, b.size);
    }
    if (best == ~0ull) {
      CHECK(got == nullptr);
      continue;
    }
    REQUIRE(got != nullptr);
    CHECK(got->size >= n);
    // Good fit: within one bin (1/32) of the best, plus the bin the request falls in.
    CHECK(got->size <= best + best / 16 + (16u << 10));
    bins.remove(got);
    CHECK(got->bins == nullptr);
  }
  std::uint64_t total = 0;
  for (auto& b : blocks) {
    if (b.bins == &bins) total += b.size;
  }
  CHECK(bins.bytes() == total);
}

TEST_CASE("find honours the predicate and the largest block is reported") {
  std::vector<block> blocks(10);
  free_bins bins;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    blocks[i].size = (i + 1) << 20;
    blocks[i].stamp = i;
    bins.insert(&blocks[i]);
  }
  CHECK(bins.largest() == (10u << 20));
  block* b = bins.find(1u << 20, [](block* x) { return x->stamp >= 5; });
  REQUIRE(b != nullptr);
  CHECK(b->stamp >= 5);
  CHECK(bins.find(11u << 20, [](block*) { return true; }) == nullptr);
  bins.remove(&blocks[9]);
  CHECK(bins.largest() == (9u << 20));
}

TEST_CASE("a bin whose heads cannot be made keeps its blocks in the overflow, found and walked as others") {
  std::vector<block> blocks(6);
  free_bins bins;
  blocks[0].size = 1u << 10;  // its group is made while memory lasts
  bins.insert(&blocks[0]);
  refuse_groups = true;
  for (std::size_t i = 1; i < blocks.size(); ++i) {
    blocks[i].size = std::uint64_t{i + 1} << 20;  // groups never made: all go to the overflow
    bins.insert(&blocks[i]);
  }
  blocks[1].stamp = 7;
  bins.remove(&blocks[0]);
  blocks[0].size = 2u << 10;  // same group as before: no new memory needed
  bins.insert(&blocks[0]);
  refuse_groups = false;
  CHECK(bins.overflow_count() == 5);
  CHECK(bins.count() == 6);
  CHECK(bins.bytes() == (2u << 10) + ((2u + 3 + 4 + 5 + 6) << 20));
  CHECK(bins.largest() == (6u << 20));
  // The overflow's best fit, within the predicate and the bin limit.
  block* b = bins.find(3u << 20, [](block*) { return true; });
  REQUIRE(b != nullptr);
  CHECK(b->size == (3u << 20));
  CHECK(bins.find((3u << 20) + 256, [](block*) { return true; }, free_bins::bin_of(4u << 20) - 1) == nullptr);
  CHECK(bins.find((3u << 20) + 256, [](block*) { return true; })->size == (4u << 20));
  CHECK(bins.find(1u << 20, [](block* x) { return x->stamp == 7; }) == &blocks[1]);
  CHECK(bins.find(2u << 10, [](block*) { return true; }) == &blocks[0]);
  // first() goes in for_each's order: the smallest bin, then the overflow; the pool empties a
  // stream's cache with it.
  std::vector<block*> walk_order, first_order;
  bins.for_each([&](block* x) { walk_order.push_back(x); });
  CHECK(bins.first() == &blocks[0]);
  while (block* x = bins.first()) {
    first_order.push_back(x);
    bins.remove(x);
  }
  CHECK(first_order == walk_order);
  CHECK(first_order.size() == 6);
  CHECK(bins.empty());
  CHECK(bins.first() == nullptr);
  CHECK(bins.overflow_count() == 0);
  CHECK(bins.largest() == 0);
}

#pragma once

// The floor under a coalescing free at L live blocks: the least any allocator that merges freed
// blocks with free neighbours must do, with nothing else. Each free looks its pointer up in an
// open-addressing table of L entries, marks the record, and reads both address neighbours'
// records to see whether they are free. Records are a cache line each and were made in address
// order, as the pool's blocks are. Timed over the same random order as the pool's frees, this
// says how much of the pool's growth from 1,000 to 1,000,000 live blocks is the memory
// hierarchy (lookups and records that no longer fit in the caches) rather than the pool.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace bench {

/// ns per free over `order` (indices into L = order.size() blocks of 256-byte-aligned
/// addresses); the sum of the neighbours seen free goes to `sink`, so nothing is optimized away.
inline double free_floor_ns(const std::vector<std::size_t>& order, std::uint64_t& sink) {
  struct alignas(64) record {
    std::uint64_t addr;
    record* prev;
    record* next;
    bool free;
  };
  struct slot {
    std::uint64_t addr;
    record* r;
  };
  const std::size_t n = order.size();
  std::vector<record> records(n);
  std::size_t slots = 64;
  while (slots < n * 2) slots *= 2;  // at most half full, as the pool's table
  std::vector<slot> table(slots, slot{0, nullptr});
  auto home = [&](std::uint64_t a) {
    return static_cast<std::size_t>(((a >> 8) * 0x9E3779B97F4A7C15ULL) >> 20) & (slots - 1);
  };
  for (std::size_t i = 0; i < n; ++i) {
    record& r = records[i];
    r = {0x7f0000000000ULL + i * 4096, i > 0 ? &records[i - 1] : nullptr, i + 1 < n ? &records[i + 1] : nullptr, false};
    std::size_t h = home(r.addr);
    while (table[h].r != nullptr) h = (h + 1) & (slots - 1);
    table[h] = {r.addr, &r};
  }
  std::vector<std::uint64_t> addrs(n);
  for (std::size_t i = 0; i < n; ++i) addrs[i] = records[order[i]].addr;
  std::uint64_t seen = 0;
  const auto t = std::chrono::steady_clock::now();
  for (std::uint64_t a : addrs) {
    std::size_t h = home(a);
    while (table[h].addr != a) h = (h + 1) & (slots - 1);
    record* r = table[h].r;
    table[h].addr = 1;  // a tombstone
    r->free = true;
    seen += (r->prev != nullptr && r->prev->free) + (r->next != nullptr && r->next->free);
  }
  const double ns = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count() * 1e9 / double(n);
  sink += seen;
  return ns;
}

}  // namespace bench

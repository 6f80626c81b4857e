#pragma once

// The checks against the model: of each block handed out, of the state after every step, of the
// pool's answers to queries, of an out-of-memory answer, and of the close, where everything must
// go back to the device.

#include "harness.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <optional>
#include <utility>
#include <vector>

namespace pool_core_fuzz {

/// Is an out-of-memory answer to a request of n bytes acceptable? Not when the pool has no
/// limit, the device has room, and the addresses have a free range much larger than needed.
inline void harness::check_out_of_memory(std::uint64_t n, const core_out_of_memory& e) {
  const auto& o = pool_->options();
  if (o.max_size != 0) return;
  const std::uint64_t chunk = o.chunk_size;
  const std::uint64_t need = round_up(n, chunk) + chunk;
  if (dev_->capacity - dev_->physical_used < need + chunk) return;
  // The largest unmapped range inside one reservation, or the addresses the pool may still
  // reserve (in one piece, as the driver here always can).
  std::uint64_t largest = 0, reserved = 0;
  for (const auto& [base, size] : pool_->reservations()) {
    reserved += size;
    std::uint64_t at = base;
    const std::uint64_t end = base + size;
    for (auto it = dev_->mapped.lower_bound(base); it != dev_->mapped.end() && it->first < end; ++it) {
      largest = std::max(largest, it->first - at);
      at = it->first + it->second;
    }
    largest = std::max(largest, end - at);
  }
  if (pool_->reservations().size() < reservation_list::max_count) {
    largest = std::max(largest, pool_->address_space() - std::min(reserved, pool_->address_space()));
  }
  if (largest < 2 * need + chunk) return;
  fail("out of memory for %llu bytes with no limit, %llu bytes free on the device and %llu free addresses in one "
       "range: %s",
       ull(n), ull(dev_->capacity - dev_->physical_used), ull(largest), e.reason.c_str());
}

/// [from, p + size) was just handed to stream t as (part of) the block at p.
inline void harness::check_handed(std::uint64_t p, std::uint64_t size, std::uint64_t from, std::size_t t,
                                  const char* what) {
  if (p % 256 != 0) fail("%s: %#llx is not 256-aligned", what, ull(p));
  if (!pool_->owns(p) || !pool_->owns(p + size - 1))
    fail("%s: [%#llx, +%llu) is outside the pool's addresses", what, ull(p), ull(size));
  if (!dev_->is_mapped(p, size)) fail("%s: [%#llx, +%llu) is not mapped", what, ull(p), ull(size));
  for (const auto& [a, l] : live_) {
    if (a != p && overlaps(p, size, l.addr, l.size))
      fail("%s: [%#llx, +%llu) overlaps the live block [%#llx, +%llu) of stream %zu", what, ull(p), ull(size),
           ull(l.addr), ull(l.size), l.owner);
  }
  for (const freed& f : history_) {
    if (overlaps(from, p + size - from, f.addr, f.size) && !legal(t, f.stream, f.op)) {
      const model_stream& s = streams_[f.stream];
      fail("%s: [%#llx, +%llu) handed to stream %zu while the free of [%#llx, +%llu) on stream %zu (op %llu) is "
           "neither executed (%llu of %llu ops ran) nor ordered before it (it is after op %llu); pool: completed "
           "%llu, ordered_after %llu",
           what, ull(from), ull(p + size - from), t, ull(f.addr), ull(f.size), f.stream, ull(f.op), ull(s.done),
           ull(s.ops), ull(streams_[t].after[f.stream]), ull(s.record->completed()),
           ull(streams_[t].record->ordered_after(s.record->id())));
    }
  }
}

inline void harness::check_state() {
  const pool_statistics st = pool_->statistics();
  std::uint64_t bytes = 0;
  for (const auto& [a, l] : live_) {
    bytes += l.size;
    if (!dev_->is_mapped(l.addr, l.size))
      fail("the live block [%#llx, +%llu) of stream %zu is no longer mapped", ull(l.addr), ull(l.size), l.owner);
  }
  if (st.used_current != bytes || st.live_allocations != live_.size())
    fail("statistics say %llu bytes in %llu live allocations; the model has %llu in %zu", ull(st.used_current),
         ull(st.live_allocations), ull(bytes), live_.size());
  if (st.reserved_current != dev_->physical_used)
    fail("statistics say %llu bytes reserved; the device holds %llu", ull(st.reserved_current),
         ull(dev_->physical_used));
  if (st.reserved_current != st.used_current + st.free_clear + st.free_pending)
    fail("reserved %llu != used %llu + free %llu + pending %llu", ull(st.reserved_current), ull(st.used_current),
         ull(st.free_clear), ull(st.free_pending));
  if (!pool_->addresses_consistent()) fail("a free address range overlaps another, or a mapped chunk");
  if (pool_->options().max_size != 0 && st.reserved_high > pool_->options().max_size)
    fail("reserved reached %llu, above the limit %llu", ull(st.reserved_high), ull(pool_->options().max_size));
  // Frees known executed can never make a reuse illegal again.
  std::erase_if(history_, [&](const freed& f) { return streams_[f.stream].done >= f.op; });
}

/// frees_in_flight() said false: every unexecuted free must lie under live blocks (reused).
inline void harness::check_nothing_in_flight() {
  for (const freed& f : history_) {
    if (streams_[f.stream].done >= f.op) continue;
    std::uint64_t covered = 0;
    for (const auto& [a, l] : live_) {
      if (overlaps(f.addr, f.size, l.addr, l.size))
        covered += std::min(f.addr + f.size, l.addr + l.size) - std::max(f.addr, l.addr);
    }
    if (covered < f.size)
      fail("frees_in_flight() is false while the free of [%#llx, +%llu) on stream %zu (op %llu, %llu ran) may "
           "still run on free memory",
           ull(f.addr), ull(f.size), f.stream, ull(f.op), ull(streams_[f.stream].done));
  }
}

inline void harness::query() {
  const std::uint8_t b = in_.byte();
  if (b % 3 == 0) {
    const bool r = pool_->frees_in_flight();
    TRACE("frees_in_flight() -> %d", r);
    if (!r) check_nothing_in_flight();
  } else if (b % 3 == 1) {
    std::uint64_t p = pool_->base() + in_.bytes(5) % pool_->address_space();
    if (!live_.empty() && (b & 4)) {
      const live_block& l = std::next(live_.begin(), static_cast<std::ptrdiff_t>(in_.byte() % live_.size()))->second;
      p = l.addr + in_.bytes(4) % l.size;
    }
    std::optional<std::pair<std::uint64_t, std::uint64_t>> want;
    auto it = live_.upper_bound(p);
    if (it != live_.begin() && p < std::prev(it)->second.addr + std::prev(it)->second.size)
      want = std::pair{std::prev(it)->second.addr, std::prev(it)->second.size};
    TRACE("find_live(%#llx)", ull(p));
    if (pool_->find_live(p) != want) fail("find_live(%#llx) disagrees with the live blocks", ull(p));
  } else {
    TRACE("reset_high_water()");
    pool_->reset_high_water();
    const pool_statistics st = pool_->statistics();
    if (st.used_high != st.used_current || st.reserved_high != st.reserved_current)
      fail("after reset_high_water, high-water marks %llu / %llu, current %llu / %llu", ull(st.used_high),
           ull(st.reserved_high), ull(st.used_current), ull(st.reserved_current));
  }
}

/// As pool::close: waits for the device when frees may be in flight or blocks are live,
/// then shuts the core down; everything must go back.
inline void harness::finish() {
  const bool in_flight = pool_->frees_in_flight();
  TRACE("close: frees_in_flight() -> %d, %zu live", in_flight, live_.size());
  if (!in_flight) check_nothing_in_flight();
  if (in_flight || !live_.empty()) device_synchronize();
  std::uint64_t bytes = 0;
  for (const auto& [a, l] : live_) bytes += l.size;
  shutting_down_ = true;
  const auto [count, leaked] = pool_->shutdown();
  if (count != live_.size() || leaked != bytes)
    fail("shutdown reports %llu live allocations of %llu bytes; the model has %zu of %llu", ull(count), ull(leaked),
         live_.size(), ull(bytes));
  if (dev_->physical_used != 0 || !dev_->mapped.empty() || dev_->live_events != 0 || !events_.empty())
    fail("after shutdown the device holds %llu bytes, %zu mappings, %llu events", ull(dev_->physical_used),
         dev_->mapped.size(), ull(dev_->live_events));
  pool_.reset();
}

}  // namespace pool_core_fuzz

#pragma once

// A pool's virtual addresses: the reservations it has made (as it needed them, up to a
// limit), and their unmapped parts as ranges: where growth, defragmentation and grow_in_place
// map new physical memory, and where released memory's addresses go back. Kept apart from the
// allocator's blocks, which only ever cover mapped memory.

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

namespace streamalloc::detail {

/// The reservations of one pool. Added under the pool's lock; `owns` reads them without it.
class reservation_list {
 public:
  /// Each reservation is at least as large as all before it together (see next_size), so 64
  /// cover far more than any address space.
  static constexpr std::size_t max_count = 64;

  /// The size of the next reservation for a growth of `need` bytes, when `reserved` bytes are
  /// reserved already and at most `limit` may be: 0 when none may be made. The first is
  /// `first` (or the limit); each later one at least doubles what the pool holds, so a pool
  /// makes few of them, and wastes at most half of its addresses to steps.
  [[nodiscard]] std::uint64_t next_size(std::uint64_t need, std::uint64_t limit, std::uint64_t first) const noexcept {
    if (count() == max_count || reserved_ >= limit || need > limit - reserved_) return 0;
    return std::min(limit - reserved_, std::max({need, reserved_, first}));
  }

  void add(std::uint64_t base, std::uint64_t size) noexcept {
    const std::size_t n = count_.load(std::memory_order_relaxed);
    list_[n].first.store(base, std::memory_order_relaxed);
    list_[n].second.store(size, std::memory_order_relaxed);
    count_.store(n + 1, std::memory_order_release);  // published whole
    reserved_ += size;
  }

  /// Is `p` inside one of the reservations?
  [[nodiscard]] bool owns(std::uint64_t p) const noexcept {
    const std::size_t n = count_.load(std::memory_order_acquire);
    for (std::size_t i = 0; i < n; ++i) {
      if (p - list_[i].first.load(std::memory_order_relaxed) < list_[i].second.load(std::memory_order_relaxed)) {
        return true;
      }
    }
    return false;
  }

  [[nodiscard]] std::size_t count() const noexcept { return count_.load(std::memory_order_acquire); }
  [[nodiscard]] std::uint64_t reserved() const noexcept { return reserved_; }  ///< under the pool's lock
  [[nodiscard]] std::uint64_t first_base() const noexcept { return list_[0].first.load(std::memory_order_relaxed); }
  /// Every reservation: (base, size).
  [[nodiscard]] std::vector<std::pair<std::uint64_t, std::uint64_t>> list() const {
    std::vector<std::pair<std::uint64_t, std::uint64_t>> out;
    for (std::size_t i = 0; i < count(); ++i) {
      out.emplace_back(list_[i].first.load(std::memory_order_relaxed), list_[i].second.load(std::memory_order_relaxed));
    }
    return out;
  }

 private:
  std::array<std::pair<std::atomic<std::uint64_t>, std::atomic<std::uint64_t>>, max_count> list_{};
  std::atomic<std::size_t> count_{0};
  std::uint64_t reserved_ = 0;
};

class address_ranges {
 public:
  /// A new reservation, all unmapped. Its ranges are never joined with another reservation's,
  /// even an adjacent one: a mapping must lie within one reservation. (A run of mappings may
  /// still go on from one reservation into the next, chunk by chunk.)
  void add_reservation(std::uint64_t at, std::uint64_t bytes) {
    const auto [start, made] = starts_.insert(at);
    try {
      free_.emplace(at, bytes);
    } catch (...) {  // out of host memory: as before
      if (made) starts_.erase(start);
      throw;
    }
  }

  /// [at, at + bytes) is unmapped again; joined with the ranges on either side in the same
  /// reservation. Needs host memory only when it joins neither: out of it, it throws having
  /// changed nothing.
  void give_back(std::uint64_t at, std::uint64_t bytes) {
    const auto next = free_.lower_bound(at);
    const bool join_next = next != free_.end() && next->first == at + bytes && !starts_.contains(at + bytes);
    if (next != free_.begin() && !starts_.contains(at)) {
      const auto prev = std::prev(next);
      if (prev->first + prev->second == at) {
        prev->second += bytes;
        if (join_next) {
          prev->second += next->second;
          free_.erase(next);
        }
        return;
      }
    }
    if (join_next) {  // the range after it, moved down to start at `at`: its node is reused
      auto node = free_.extract(next);
      node.key() = at;
      node.mapped() += bytes;
      free_.insert(std::move(node));
      return;
    }
    free_.emplace(at, bytes);
  }
  /// give_back where no exception may leave (destructors, failure paths): out of host memory,
  /// the range stays unused, reserved but never mapped again.
  void give_back_or_drop(std::uint64_t at, std::uint64_t bytes) noexcept {
    try {
      give_back(at, bytes);
    } catch (...) {
      dropped_ += bytes;
    }
  }
  /// Bytes of addresses give_back_or_drop could not give back.
  [[nodiscard]] std::uint64_t dropped() const noexcept { return dropped_; }

  /// Are [at, at + bytes) all unmapped?
  [[nodiscard]] bool has_room(std::uint64_t at, std::uint64_t bytes) const {
    auto it = containing(at);
    return it != free_.end() && it->first + it->second >= at + bytes;
  }

  /// [at, at + bytes), only if all of it is unmapped.
  std::optional<std::uint64_t> take_at(std::uint64_t bytes, std::uint64_t at) {
    auto it = containing(at);
    if (it == free_.end() || it->first + it->second < at + bytes) return std::nullopt;
    carve(it, at, bytes);
    return at;
  }

  /// First fit of `bytes`, preferring right after `after` when that is free.
  std::optional<std::uint64_t> take(std::uint64_t bytes, std::uint64_t after = 0) {
    if (after != 0) {
      if (auto at = take_at(bytes, after)) return at;
    }
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second >= bytes) {
        const std::uint64_t at = it->first;
        carve(it, at, bytes);
        return at;
      }
    }
    return std::nullopt;
  }

  /// The top of the highest range that holds `bytes`: large runs placed there one after
  /// another are adjacent, and share GPU page tables.
  std::optional<std::uint64_t> take_top(std::uint64_t bytes) {
    for (auto it = free_.rbegin(); it != free_.rend(); ++it) {
      if (it->second >= bytes) {
        const std::uint64_t at = it->first + it->second - bytes;
        carve(std::prev(it.base()), at, bytes);
        return at;
      }
    }
    return std::nullopt;
  }

  /// For a run that may want to grow in place (grow_in_place maps memory right after a run):
  /// the middle of the largest range, on a multiple of `align`, so that each such run has
  /// about half of a free range after it, rather than the next run. Nothing when no range
  /// holds `spread` times `bytes` (at least twice).
  std::optional<std::uint64_t> take_spaced(std::uint64_t bytes, std::uint64_t align, std::uint64_t spread = 2) {
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (best == free_.end() || it->second > best->second) best = it;
    }
    if (best == free_.end() || best->second / std::max<std::uint64_t>(spread, 2) < bytes) return std::nullopt;
    // The middle, rounded down to a multiple of align; up, when that falls below the range.
    std::uint64_t at = (best->first + (best->second - bytes) / 2) / align * align;
    if (at < best->first) at += align;
    if (at + bytes > best->first + best->second) return std::nullopt;  // no multiple of align fits
    carve(best, at, bytes);
    return at;
  }

  /// The longest range.
  /// The free ranges, start -> size (for checks).
  [[nodiscard]] const std::map<std::uint64_t, std::uint64_t>& ranges() const noexcept { return free_; }
  [[nodiscard]] std::uint64_t largest() const noexcept {
    std::uint64_t l = 0;
    for (const auto& [start, size] : free_) l = std::max(l, size);
    return l;
  }

 private:
  using iterator = std::map<std::uint64_t, std::uint64_t>::const_iterator;

  /// The range holding address `at`, or end().
  iterator containing(std::uint64_t at) const {
    auto it = free_.upper_bound(at);
    if (it == free_.begin()) return free_.end();
    --it;
    return it->first <= at && at < it->first + it->second ? it : free_.end();
  }

  // At most one new node, made before anything changes: out of host memory, the free ranges
  // are as they were.
  void carve(iterator found, std::uint64_t at, std::uint64_t bytes) {
    const auto it = free_.erase(found, found);  // the same node, writable
    const std::uint64_t start = it->first, end = it->first + it->second;
    if (at > start && at + bytes < end) {  // a range before and one after: a node for the latter
      free_.emplace_hint(std::next(it), at + bytes, end - at - bytes);
      it->second = at - start;
    } else if (at > start) {  // only before: the node shrinks
      it->second = at - start;
    } else if (at + bytes < end) {  // only after: the node moves up
      auto node = free_.extract(it);
      node.key() = at + bytes;
      node.mapped() = end - at - bytes;
      free_.insert(std::move(node));
    } else {
      free_.erase(it);
    }
  }

  std::map<std::uint64_t, std::uint64_t> free_;  // start -> size
  std::uint64_t dropped_ = 0;
  std::set<std::uint64_t> starts_;                // of the reservations: ranges never join across
};

}  // namespace streamalloc::detail

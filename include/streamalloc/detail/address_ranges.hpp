#pragma once

// The unmapped addresses of a pool's reservation, as ranges: where growth, defragmentation and
// grow_in_place map new physical memory, and where released memory's addresses go back. Kept
// apart from the allocator's blocks, which only ever cover mapped memory.

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>
#include <optional>

namespace streamalloc::detail {

class address_ranges {
 public:
  /// [at, at + bytes) is unmapped again; joined with the ranges on either side.
  void give_back(std::uint64_t at, std::uint64_t bytes) {
    auto next = free_.lower_bound(at);
    if (next != free_.end() && next->first == at + bytes) {
      bytes += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == at) {
        prev->second += bytes;
        return;
      }
    }
    free_.emplace(at, bytes);
  }

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
  /// holds twice `bytes`.
  std::optional<std::uint64_t> take_spaced(std::uint64_t bytes, std::uint64_t align) {
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (best == free_.end() || it->second > best->second) best = it;
    }
    if (best == free_.end() || best->second < 2 * bytes) return std::nullopt;
    const std::uint64_t at = best->first + (best->second - bytes) / 2 / align * align;
    carve(best, at, bytes);
    return at;
  }

  /// The longest range.
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

  void carve(iterator it, std::uint64_t at, std::uint64_t bytes) {
    const std::uint64_t start = it->first, size = it->second;
    free_.erase(it);
    if (at > start) free_.emplace(start, at - start);
    if (at + bytes < start + size) free_.emplace(at + bytes, start + size - at - bytes);
  }

  std::map<std::uint64_t, std::uint64_t> free_;  // start -> size
};

}  // namespace streamalloc::detail

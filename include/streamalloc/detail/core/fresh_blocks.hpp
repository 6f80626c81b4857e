#pragma once

// Blocks the chain has made that its address index has not taken in yet (block_chain.hpp).
// A request that splits a free block makes one, and the free that merges the two again a few
// microseconds later removes it: in a training step's warm passes that pair is most of what
// the B+tree did, a quarter of the pool's time on the CPU model. Kept here by start address,
// such a block costs a hash insert and a hash erase; the index takes in what is left when
// this fills up, or when someone asks it where an address is (rare: growth, remapping, a
// pointer that is not a block's start).
//
// Open addressing with linear probing and backward-shift deletion. No memory until first use;
// the table grows by doubling to a fixed cap, at most 32 KiB, and a drain gives back all but
// its first kilobyte (a table emptied by merges keeps its slots for the next blocks).

#include <streamalloc/detail/core/block.hpp>

#include <algorithm>
#include <bit>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <new>

namespace streamalloc::detail {

class fresh_blocks {
 public:
  /// The most entries held; at half the table's slots, so probes stay short.
  static constexpr std::size_t max_entries = 1024;

  fresh_blocks() = default;
  fresh_blocks(const fresh_blocks&) = delete;
  fresh_blocks& operator=(const fresh_blocks&) = delete;
  ~fresh_blocks() { delete[] slots_; }

  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }
  [[nodiscard]] bool full() const noexcept { return size_ == max_entries; }

  /// Adds `b` under `addr`, which must be absent and not full(). Throws std::bad_alloc when
  /// the table must grow and cannot, having changed nothing.
  void insert(std::uint64_t addr, block* b) {
    assert(size_ < max_entries && "fresh_blocks::insert: the table is full");
    if ((size_ + 1) * 2 > capacity_) grow();
    std::size_t i = home(addr);
    while (slots_[i].addr != empty_slot) i = (i + 1) & (capacity_ - 1);
    slots_[i] = {addr, b};
    ++size_;
    lowest_ = addr < lowest_ ? addr : lowest_;
    highest_ = addr > highest_ ? addr : highest_;
  }
  /// The block under `addr`; null if absent.
  [[nodiscard]] block* find(std::uint64_t addr) const noexcept {
    const slot* s = locate(addr);
    return s != nullptr ? s->b : nullptr;
  }
  /// Gives `addr` a new block if present. False if absent.
  bool assign(std::uint64_t addr, block* b) noexcept {
    slot* s = const_cast<slot*>(locate(addr));
    if (s == nullptr) return false;
    s->b = b;
    return true;
  }
  /// Removes `addr`. False if absent.
  bool erase(std::uint64_t addr) noexcept {
    slot* s = const_cast<slot*>(locate(addr));
    if (s == nullptr) return false;
    // Backward shift: later entries of the probe run move up into the hole, so that no
    // lookup stops early at it and no tombstones pile up.
    std::size_t hole = static_cast<std::size_t>(s - slots_);
    for (std::size_t j = (hole + 1) & (capacity_ - 1); slots_[j].addr != empty_slot; j = (j + 1) & (capacity_ - 1)) {
      const std::size_t h = home(slots_[j].addr);
      // j's entry may fill the hole if its home is not in (hole, j], cyclically.
      if (((j - h) & (capacity_ - 1)) >= ((j - hole) & (capacity_ - 1))) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole].addr = empty_slot;
    if (--size_ == 0) {
      lowest_ = empty_slot;
      highest_ = 0;
    }
    return true;
  }

  /// Hands every entry to `take(addr, block)`, in address order (the index takes in a run of
  /// ascending addresses at its cheapest: one leaf after another, no descent), removing each
  /// once `take` returns; an entry whose `take` throws stays, with those not reached yet, and
  /// the exception propagates. Gives the table back once empty, if it had grown past its first
  /// size.
  template <class Take>
  [[gnu::noinline]] void drain(Take&& take) {  // not inlined: its 16 KiB stay out of callers' frames
    slot order[max_entries];  // 16 KiB of stack: the table may not be sorted in place
    std::size_t n = 0;
    for (std::size_t i = 0; i < capacity_; ++i) {
      if (slots_[i].addr != empty_slot) order[n++] = slots_[i];
    }
    std::sort(order, order + n, [](const slot& a, const slot& b) { return a.addr < b.addr; });
    std::size_t taken = 0;
    try {
      for (; taken < n; ++taken) take(order[taken].addr, order[taken].b);
    } catch (...) {  // the entries taken go; this one and the rest stay
      for (std::size_t i = 0; i < taken; ++i) erase(order[i].addr);
      throw;
    }
    size_ = 0;
    lowest_ = empty_slot;
    highest_ = 0;
    if (capacity_ > first_capacity) {
      delete[] slots_;
      slots_ = nullptr;
      capacity_ = 0;
    } else {
      for (std::size_t i = 0; i < capacity_; ++i) slots_[i].addr = empty_slot;
    }
  }

  /// The entry with the greatest address at or below `addr`; null if none (a scan: for
  /// lookups the index could not take these entries in for, out of host memory).
  [[nodiscard]] block* at_or_before(std::uint64_t addr) const noexcept {
    const slot* best = nullptr;
    for (std::size_t i = 0; i < capacity_; ++i) {
      const slot& s = slots_[i];
      if (s.addr != empty_slot && s.addr <= addr && (best == nullptr || s.addr > best->addr)) best = &s;
    }
    return best != nullptr ? best->b : nullptr;
  }

 private:
  struct slot {
    std::uint64_t addr;
    block* b;
  };
  // Blocks start at multiples of 256: never at this.
  static constexpr std::uint64_t empty_slot = ~std::uint64_t{0};
  static constexpr std::size_t first_capacity = 64;

  [[nodiscard]] std::size_t home(std::uint64_t addr) const noexcept {
    // Fibonacci hashing of the 256-byte unit: nearby blocks land in different slots.
    return static_cast<std::size_t>(((addr >> 8) * 0x9e3779b97f4a7c15ull) >> (64 - std::countr_zero(capacity_)));
  }
  [[nodiscard]] const slot* locate(std::uint64_t addr) const noexcept {
    // Most lookups are of blocks made long ago: the range of the table's addresses turns them
    // away without touching its slots, which a free among many blocks would find cold.
    if (size_ == 0 || addr < lowest_ || addr > highest_) return nullptr;
    for (std::size_t i = home(addr);; i = (i + 1) & (capacity_ - 1)) {
      if (slots_[i].addr == addr) return &slots_[i];
      if (slots_[i].addr == empty_slot) return nullptr;
    }
  }
  void grow() {
    const std::size_t capacity = capacity_ == 0 ? first_capacity : capacity_ * 2;
    slot* slots = new slot[capacity];
    for (std::size_t i = 0; i < capacity; ++i) slots[i].addr = empty_slot;
    slot* old = slots_;
    const std::size_t old_capacity = capacity_;
    slots_ = slots;
    capacity_ = capacity;
    for (std::size_t i = 0; i < old_capacity; ++i) {
      if (old[i].addr == empty_slot) continue;
      std::size_t j = home(old[i].addr);
      while (slots_[j].addr != empty_slot) j = (j + 1) & (capacity_ - 1);
      slots_[j] = old[i];
    }
    delete[] old;
  }

  slot* slots_ = nullptr;
  std::size_t capacity_ = 0;  // a power of two, or 0
  std::size_t size_ = 0;
  // Every entry's address is within [lowest_, highest_]: not narrowed by erases, reset when the
  // table empties. A few long-lived entries spread over the pool make it let most lookups
  // through; the table is then in use, and its slots in the cache.
  std::uint64_t lowest_ = empty_slot, highest_ = 0;
};

}  // namespace streamalloc::detail

#pragma once

// Live allocations by address: what deallocate looks up, and what tells a foreign or double
// free from a good one. Sharded by address (1024 shards), each shard an open-addressing table
// behind its own spin lock, so threads freeing different blocks rarely meet.

#include <streamalloc/detail/core/block.hpp>

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace streamalloc::detail {

/// A test-and-test-and-set lock for critical sections of a few dozen instructions.
class spin_lock {
 public:
  void lock() noexcept {
    for (unsigned spins = 0;; ++spins) {
      if (!locked_.exchange(true, std::memory_order_acquire)) return;
      while (locked_.load(std::memory_order_relaxed)) {
        if (++spins > 64) std::this_thread::yield();
      }
    }
  }
  bool try_lock() noexcept { return !locked_.exchange(true, std::memory_order_acquire); }
  void unlock() noexcept { locked_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> locked_{false};
};

class live_table {
 public:
  live_table() : shards_(shard_count) {}

  void insert(std::uint64_t addr, block* b) {
    shard& s = shard_of(addr);
    std::lock_guard lock(s.lock);
    if ((s.used + s.tombstones + 1) * 4 > s.slots.size() * 3) s.grow();
    s.put(addr, b);
  }

  /// Puts back the entry `erase` just took, needing no host memory: the table is never grown,
  /// as erasing left a free slot on `addr`'s probe path (or before it).
  void restore(std::uint64_t addr, block* b) noexcept {
    shard& s = shard_of(addr);
    std::lock_guard lock(s.lock);
    s.put(addr, b);
  }

  /// Starts fetching the slot `addr` would take, for an insert a little later: among many live
  /// blocks the slot is a cache miss, which then overlaps the caller's work in between.
  /// Reads the shard's table without its lock: a table growing meanwhile makes a useless
  /// fetch, never a wrong insert (a prefetch of any address is harmless).
  void prefetch(std::uint64_t addr) noexcept {
    const shard& s = shard_of(addr);
    const std::uintptr_t base = s.seen_base.load(std::memory_order_relaxed);
    const std::size_t mask = s.seen_mask.load(std::memory_order_relaxed);
    if (base != 0) __builtin_prefetch(reinterpret_cast<const void*>(base + (hash(addr) & mask) * sizeof(slot)), 1);
  }

  /// Removes and returns the block at `addr`; null if no live block starts there.
  block* erase(std::uint64_t addr) noexcept {
    shard& s = shard_of(addr);
    std::lock_guard lock(s.lock);
    if (s.slots.empty()) return nullptr;
    for (std::size_t i = s.home(addr);; i = (i + 1) & (s.slots.size() - 1)) {
      slot& e = s.slots[i];
      if (e.addr == addr) {
        block* b = e.b;
        e.addr = tombstone;
        e.b = nullptr;
        --s.used;
        ++s.tombstones;
        return b;
      }
      if (e.addr == empty) return nullptr;
    }
  }

  [[nodiscard]] block* find(std::uint64_t addr) noexcept {
    shard& s = shard_of(addr);
    std::lock_guard lock(s.lock);
    if (s.slots.empty()) return nullptr;
    for (std::size_t i = s.home(addr);; i = (i + 1) & (s.slots.size() - 1)) {
      const slot& e = s.slots[i];
      if (e.addr == addr) return e.b;
      if (e.addr == empty) return nullptr;
    }
  }

  template <class Fn>
  void for_each(Fn&& fn) {
    for (shard& s : shards_) {
      std::lock_guard lock(s.lock);
      for (const slot& e : s.slots) {
        if (e.addr != empty && e.addr != tombstone) fn(e.b);
      }
    }
  }

  [[nodiscard]] std::size_t size() noexcept {
    std::size_t n = 0;
    for (shard& s : shards_) {
      std::lock_guard lock(s.lock);
      n += s.used;
    }
    return n;
  }

 private:
  static constexpr std::uint64_t empty = 0;
  static constexpr std::uint64_t tombstone = 1;  // addresses are 256-aligned, never 1
  // Threads that each reuse one block meet in a shard only if their blocks hash together:
  // with 1024 shards, 8 such threads share one about 3% of the time (64 shards: 37%). A shard
  // that is never used costs one cache line; its slots are allocated on first insert.
  static constexpr std::size_t shard_count = 1024;

  struct slot {
    std::uint64_t addr = empty;
    block* b = nullptr;
  };

  static std::size_t hash(std::uint64_t addr) noexcept {
    return static_cast<std::size_t>((addr >> 8) * 0x9E3779B97F4A7C15ULL >> 20);
  }

  struct alignas(64) shard {
    spin_lock lock;
    std::vector<slot> slots;
    std::size_t used = 0;
    std::size_t tombstones = 0;
    // The table's place and size as of its last growth, for prefetch, which takes no lock.
    std::atomic<std::uintptr_t> seen_base{0};
    std::atomic<std::size_t> seen_mask{0};

    [[nodiscard]] std::size_t home(std::uint64_t addr) const noexcept { return hash(addr) & (slots.size() - 1); }
    void put(std::uint64_t addr, block* b) noexcept {
      for (std::size_t i = home(addr);; i = (i + 1) & (slots.size() - 1)) {
        slot& e = slots[i];
        if (e.addr == empty || e.addr == tombstone) {
          if (e.addr == tombstone) --tombstones;
          e.addr = addr;
          e.b = b;
          ++used;
          return;
        }
      }
    }
    void grow() {
      const std::size_t n = slots.empty() ? 64 : (used * 4 > slots.size() ? slots.size() * 2 : slots.size());
      std::vector<slot> old(n, slot{});  // out of host memory: the table is as it was
      slots.swap(old);
      seen_base.store(reinterpret_cast<std::uintptr_t>(slots.data()), std::memory_order_relaxed);
      seen_mask.store(n - 1, std::memory_order_relaxed);
      used = 0;
      tombstones = 0;
      for (const slot& e : old) {
        if (e.addr != empty && e.addr != tombstone) put(e.addr, e.b);
      }
    }
  };

  // Fibonacci hashing of the 256-byte-aligned address: blocks a power of two apart (threads'
  // blocks at k * 4 KiB, say) spread over all shards instead of a few.
  shard& shard_of(std::uint64_t addr) noexcept {
    return shards_[static_cast<std::size_t>(((addr >> 8) * 0x9E3779B97F4A7C15ULL) >> 54)];
  }

  std::vector<shard> shards_;
};

}  // namespace streamalloc::detail

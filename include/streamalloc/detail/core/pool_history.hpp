#pragma once

// A pool's recent history: the last N allocations, frees, growths, releases and remaps, with
// the time and the stream, for snapshots (pool::snapshot) and the plots made from them. Off by
// default: then the pool's paths pay one relaxed load of a flag each. On, every event takes a
// clock reading and claims a slot of a ring with one atomic add (no lock: a mutex here made
// eight threads queue on it, 50 times slower than one; docs/observability.md has the numbers).
// The oldest events are overwritten once the ring is full, and counted as dropped.
//
// Each slot carries the number of the event written into it, stored last (release); a reader
// takes a slot's fields only when that number reads the same before and after them, so a slot
// being rewritten by a racing writer is skipped rather than read half old, half new. The fields
// are relaxed atomics for the same reason. A ring is never freed while the pool lives: keep()
// with a larger capacity installs a new one and keeps the old for writers still on it. Events
// noted while keep() runs may be lost.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace streamalloc::detail {

enum class history_op : std::uint8_t { allocate, free, grow, release, remap };

inline const char* history_op_name(history_op op) noexcept {
  switch (op) {
    case history_op::allocate: return "allocate";
    case history_op::free: return "free";
    case history_op::grow: return "grow";
    case history_op::release: return "release";
    case history_op::remap: return "remap";
  }
  return "?";
}

struct history_event {
  std::uint64_t time_ns = 0;  ///< since the history was switched on (steady clock)
  std::uint64_t stream = 0;   ///< the stream's id (streamalloc's, not the handle); 0: none
  std::uint64_t address = 0;
  std::uint64_t bytes = 0;
  history_op op = history_op::allocate;
};

class pool_history {
 public:
  [[nodiscard]] bool on() const noexcept { return on_.load(std::memory_order_relaxed); }
  /// On now, or ever before: blocks allocated then carry their time, and a block allocated
  /// again must have it cleared. Until then an allocation checks this one flag, as `on()`.
  [[nodiscard]] bool ever_on() const noexcept { return ever_on_.load(std::memory_order_relaxed); }

  /// Keeps the last `capacity` events from now on (0: switches it off and forgets them).
  void keep(std::size_t capacity) {
    std::lock_guard lock(keep_mutex_);
    on_.store(false, std::memory_order_relaxed);
    ring* r = ring_.load(std::memory_order_acquire);
    if (capacity != 0 && (r == nullptr || r->capacity < capacity)) {
      rings_.push_back(std::make_unique<ring>(capacity));
      r = rings_.back().get();
    }
    if (r != nullptr) {
      r->used.store(std::min(capacity, r->capacity), std::memory_order_relaxed);
      for (std::size_t i = 0; i < r->capacity; ++i) r->slots[i].number.store(0, std::memory_order_relaxed);
      r->next.store(0, std::memory_order_relaxed);
      r->start_ns.store(now_ns(), std::memory_order_relaxed);
    }
    ring_.store(r, std::memory_order_release);
    if (capacity != 0) ever_on_.store(true, std::memory_order_relaxed);
    on_.store(capacity != 0, std::memory_order_release);
  }

  /// The steady clock in nanoseconds: the times of events, and of blocks' allocations.
  static std::int64_t now_ns() noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  /// Records an event; returns the steady clock's time it was given (now_ns), 0 if the
  /// history was switched off meanwhile.
  std::uint64_t note(history_op op, std::uint64_t stream, std::uint64_t address, std::uint64_t bytes) noexcept {
    ring* r = ring_.load(std::memory_order_acquire);
    const std::size_t used = r != nullptr ? r->used.load(std::memory_order_relaxed) : 0;
    if (used == 0) return 0;
    const std::int64_t now = now_ns();
    const std::int64_t t = now - r->start_ns.load(std::memory_order_relaxed);
    const std::uint64_t n = r->next.fetch_add(1, std::memory_order_relaxed);
    slot& s = r->slots[n % used];
    // Marked as being written before any field changes (the acquire half of the exchange
    // keeps the stores below after it); no fences: ThreadSanitizer does not model them.
    (void)s.number.exchange(0, std::memory_order_acq_rel);
    s.time_ns.store(static_cast<std::uint64_t>(std::max<std::int64_t>(t, 0)), std::memory_order_relaxed);
    s.stream.store(stream, std::memory_order_relaxed);
    s.address.store(address, std::memory_order_relaxed);
    s.bytes.store(bytes, std::memory_order_relaxed);
    s.op.store(op, std::memory_order_relaxed);
    s.number.store(n + 1, std::memory_order_release);
    return static_cast<std::uint64_t>(std::max<std::int64_t>(now, 1));
  }

  /// The events kept, oldest first, and how many were dropped before them (or skipped while
  /// being rewritten).
  struct contents {
    std::vector<history_event> events;
    std::uint64_t dropped = 0;
    std::size_t capacity = 0;
  };
  [[nodiscard]] contents read() const {
    contents c;
    if (!on()) return c;
    const ring* r = ring_.load(std::memory_order_acquire);
    const std::size_t used = r != nullptr ? r->used.load(std::memory_order_relaxed) : 0;
    if (used == 0) return c;
    c.capacity = used;
    const std::uint64_t total = r->next.load(std::memory_order_acquire);
    const std::uint64_t first = total > used ? total - used : 0;
    c.events.reserve(static_cast<std::size_t>(total - first));
    for (std::uint64_t n = first; n < total; ++n) {
      const slot& s = r->slots[n % used];
      if (s.number.load(std::memory_order_acquire) != n + 1) continue;  // not written yet, or rewritten
      // Acquire loads: the second look at the number cannot move before them.
      history_event e{s.time_ns.load(std::memory_order_acquire), s.stream.load(std::memory_order_acquire),
                      s.address.load(std::memory_order_acquire), s.bytes.load(std::memory_order_acquire),
                      s.op.load(std::memory_order_acquire)};
      if (s.number.load(std::memory_order_relaxed) != n + 1) continue;
      c.events.push_back(e);
    }
    c.dropped = total - c.events.size();
    return c;
  }

 private:
  struct slot {
    std::atomic<std::uint64_t> number{0};  // the event's number + 1; 0: being written or empty
    std::atomic<std::uint64_t> time_ns{0}, stream{0}, address{0}, bytes{0};
    std::atomic<history_op> op{history_op::allocate};
  };
  struct ring {
    explicit ring(std::size_t n) : capacity(n), slots(std::make_unique<slot[]>(n)) {}
    std::size_t capacity;
    std::atomic<std::size_t> used{0};  // capacity or less: what keep() asked for
    std::unique_ptr<slot[]> slots;
    alignas(64) std::atomic<std::uint64_t> next{0};
    std::atomic<std::int64_t> start_ns{0};
  };

  std::atomic<bool> on_{false};
  std::atomic<bool> ever_on_{false};
  std::atomic<ring*> ring_{nullptr};
  std::mutex keep_mutex_;
  std::vector<std::unique_ptr<ring>> rings_;  // every ring made, freed with the pool
};

}  // namespace streamalloc::detail

#pragma once

// The pool's allocator, free of CUDA: it runs against a Backend that provides physical memory
// and device events, so the whole algorithm is exercised on the CPU by tests with a simulated
// backend (tests/cpu/detail/pool_core_test.cpp), and on the GPU through the VMM backend (pool.hpp).
//
// Where free blocks live:
//   a stream's fast cache   blocks freed on that stream, reusable by it at once; whole blocks
//                           only, no coalescing, guarded by the stream's own lock: the
//                           allocation fast path takes no pool-wide lock and calls no driver
//   a stream's pending bins blocks freed on that stream and coalesced: reusable by that stream,
//                           by others once ordered after the free or once it completed
//   the clear bins          blocks every stream may reuse
// Structural changes (split, merge, growth, remapping, release) happen under the pool lock.
//
// The backend: physical memory, addresses and events (the `pool_backend` concept in
// pool_backend.hpp, with what each member must do).
//
// Stream handles: a state keeps the handle it was first seen with, but uses it on its own
// (to record an event, or to ask whether the stream is idle) only when the stream's record says
// the handle stays valid (a stream streamalloc owns, until it retires; the legacy default
// stream). Any other handle is used only during a call that was given it, on the calling
// thread: a raw stream may have been destroyed since and its value handed to a new stream, and
// the per-thread default stream's handle names the calling thread's stream. Reusing on stream B
// memory freed on such a stream A therefore needs proof learned while A was in hand (an event
// the pool recorded on A during one of A's calls, a host synchronization, an event wait).

#include <streamalloc/detail/core/address_index.hpp>
#include <streamalloc/detail/core/address_ranges.hpp>
#include <streamalloc/detail/core/block.hpp>
#include <streamalloc/detail/core/block_chain.hpp>
#include <streamalloc/detail/core/free_bins.hpp>
#include <streamalloc/detail/core/live_table.hpp>
#include <streamalloc/detail/core/ordering.hpp>
#include <streamalloc/detail/core/pool_backend.hpp>
#include <streamalloc/placement.hpp>
#include <streamalloc/pool_statistics.hpp>
#include <streamalloc/reuse_policy.hpp>

#include <cuda.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace streamalloc::detail {

struct core_options {
  std::uint64_t max_size = 0;           ///< 0: no limit but the device's memory
  std::uint64_t release_threshold = 0;  ///< free bytes kept at synchronization points
  std::uint64_t chunk_size = 0;         ///< physical memory is created in chunks of this
  bool own_chunk_for_large = true;      ///< a request >= chunk_size gets one chunk of its size
  std::uint64_t address_space = 0;      ///< the most virtual addresses reserved, as needed
  /// Told of each reservation the pool makes (base, size), under its lock.
  std::function<void(std::uint64_t, std::uint64_t)> on_reserve;
  reuse_policy reuse;
};

/// Thrown by the core when memory cannot be found; pool.hpp turns it into out_of_memory.
struct core_out_of_memory {
  std::uint64_t requested = 0;
  std::string reason;
};

template <pool_backend Backend>
class pool_core final : public completion_listener {
 public:
  using handle = typename Backend::handle;
  using event = typename Backend::event;

  pool_core(Backend backend, core_options o) : backend_(std::move(backend)), options_(o) {
    granularity_ = backend_.granularity();
    if (options_.chunk_size == 0) options_.chunk_size = 64ull << 20;
    options_.chunk_size = round_up(options_.chunk_size, granularity_);
    if (options_.max_size != 0) options_.max_size = round_up(options_.max_size, granularity_);
    va_limit_ = round_up(options_.address_space, granularity_);
    // The first reservation up front: a pool whose addresses cannot be had fails when made.
    const std::uint64_t first = reservations_.next_size(0, va_limit_, first_reservation());
    add_reservation(backend_.reserve(first), first);
    serial_ = next_serial().fetch_add(1, std::memory_order_relaxed) + 1;
    ordering().add_listener(this);
  }

  pool_core(const pool_core&) = delete;
  pool_core& operator=(const pool_core&) = delete;

  ~pool_core() { ordering().remove_listener(this); }

  /// Tears the pool down: waits for the frees still pending on the device, then releases all
  /// physical memory. Returns the live allocations that were never freed (count, bytes).
  std::pair<std::uint64_t, std::uint64_t> shutdown() noexcept {
    std::lock_guard lock(mutex_);
    std::uint64_t count = 0, bytes = 0;
    live_.for_each([&](block* b) {
      ++count;
      bytes += b->size;
    });
    for (auto& [id, st] : states_) {
      for (auto& pe : st->events) {
        backend_.synchronize(pe.ev);
        backend_.destroy(pe.ev);
      }
      st->events.clear();
    }
    for (auto& [va, c] : chunks_) {
      backend_.unmap(va, c.size);
      backend_.release(c.h);
    }
    chunks_.clear();
    reserved_ = 0;
    return {count, bytes};
  }

  [[nodiscard]] std::uint64_t granularity() const noexcept { return granularity_; }
  [[nodiscard]] const core_options& options() const noexcept { return options_; }
  /// The first reservation's base.
  [[nodiscard]] std::uint64_t base() const noexcept { return reservations_.first_base(); }
  /// The most addresses the pool reserves.
  [[nodiscard]] std::uint64_t address_space() const noexcept { return va_limit_; }
  /// Addresses reserved so far, and the reservations (base, size).
  [[nodiscard]] std::uint64_t addresses_reserved() {
    std::lock_guard lock(mutex_);
    return reservations_.reserved();
  }
  [[nodiscard]] std::vector<std::pair<std::uint64_t, std::uint64_t>> reservations() const {
    return reservations_.list();
  }
  /// The size of the last reservation the driver refused (the process's addresses ran out); 0:
  /// none was.
  [[nodiscard]] std::uint64_t refused_reservation() {
    std::lock_guard lock(mutex_);
    return refused_reservation_;
  }
  [[nodiscard]] bool owns(std::uint64_t p) const noexcept { return reservations_.owns(p); }
  Backend& backend() noexcept { return backend_; }

  void set_release_threshold(std::uint64_t t) {
    std::lock_guard lock(mutex_);
    options_.release_threshold = t;
  }
  void set_reuse(reuse_policy r) {
    std::lock_guard lock(mutex_);
    options_.reuse = r;
  }

  // --- allocation --------------------------------------------------------------------------

  /// Rounds `bytes` to the pool's quantum (256) and returns a block's address, ordered on `s`.
  /// Throws core_out_of_memory when nothing can be found.
  /// `where`: the addresses of a request that gets a chunk of its own (see `placement`).
  std::uint64_t allocate(std::uint64_t bytes, stream_key s, placement where = placement::packed) {
    const std::uint64_t n = round_up(bytes == 0 ? 1 : bytes, free_bins::quantum);
    stream_state& st = state_for(s);
    st.lock.lock();
    // A block freed on this stream, of n's own bin or the next (at most 1/16 larger).
    block* b = st.cache.find(n, [](block*) { return true; }, free_bins::bin_of(n) + 1, 8);
    if (b == nullptr) {
      st.lock.unlock();
      return allocate_slow(n, st, s, where);
    }
    st.cache.remove(b);
    st.cache_bytes -= b->size;
    set_state(b, block_state::live);
    account_allocate(st, b->size);
    st.lock.unlock();
    live_.insert(b->addr, b);
    return b->addr;
  }

  /// Ends the lifetime of the block at `p` in the order of stream `s`.
  /// Throws std::invalid_argument, changing nothing, for a pointer that is not a live block.
  void deallocate(std::uint64_t p, stream_key s) {
    // The stream's state first: making it (the first free on a new stream) may fail for lack of
    // host memory, and must then leave the block live, as a refused free does.
    stream_state& st = state_for(s);
    block* b = live_.erase(p);
    if (b == nullptr) [[unlikely]] {
      throw std::invalid_argument(explain_bad_free(p));
    }
    const std::uint64_t stamp = st.record->stamp();
    b->stream = st.record->id();
    b->stamp = stamp;
    {
      std::lock_guard lock(st.lock);
      account_free(st, b->size);
      if (st.cache.count() < max_cached_blocks && st.cache_bytes + b->size <= cache_limit()) {
        set_state(b, block_state::cached);
        st.cache.insert(b);
        st.cache_bytes += b->size;
        return;
      }
    }
    std::lock_guard lock(mutex_);
    free_pending(b, st);
  }

  /// Makes the live allocation at `p` at least `bytes` long without moving it, in the order
  /// of stream `s`: takes the free memory right after it that `s` may use, and maps new
  /// physical memory past the end of its mapped run when the addresses there are unused.
  /// Returns the new size, or 0 (changing nothing) when something is in the way.
  /// Throws std::invalid_argument for a pointer that is not a live block.
  std::uint64_t grow_in_place(std::uint64_t p, std::uint64_t bytes, stream_key s) {
    const std::uint64_t n = round_up(bytes == 0 ? 1 : bytes, free_bins::quantum);
    stream_state& st = state_for(s);
    block* b = live_block(p, "grow_in_place");
    std::lock_guard lock(mutex_);
    const std::uint64_t old = b->size;
    if (n <= old) return old;
    flush_cache(st);  // this stream's cached neighbours coalesce first
    bool extended = extend(b, n, st);
    if (!extended) {
      // Other streams' cached frees, and whatever completed since the pool last looked.
      for (auto& [id, other] : states_) flush_cache(*other);
      settle_all(options_.reuse.opportunistic, s);
      extended = extend(b, n, st);
    }
    if (!extended) return 0;
    account_bytes(st, static_cast<std::int64_t>(b->size - old));
    return b->size;
  }

  /// Makes the live allocation at `p` `bytes` long (rounded up to 256, at least 256) without
  /// moving it: the rest is freed in the order of stream `s` (reusable by `s` at once, by
  /// others once ordered after). Returns the new size.
  /// Throws std::invalid_argument for a pointer that is not a live block.
  std::uint64_t shrink_in_place(std::uint64_t p, std::uint64_t bytes, stream_key s) {
    stream_state& st = state_for(s);
    block* b = live_block(p, "shrink_in_place");
    std::lock_guard lock(mutex_);
    const std::uint64_t old = b->size;
    // Compared before rounding: rounding a size within 255 of 2^64 up would wrap to 0.
    if (bytes >= old) return old;
    const std::uint64_t n = round_up(bytes == 0 ? 1 : bytes, free_bins::quantum);
    if (n >= old) return old;
    block* tail = split(b, n);
    tail->stream = st.record->id();
    tail->stamp = st.record->stamp();
    free_pending(tail, st);
    account_bytes(st, -static_cast<std::int64_t>(old - n));
    return n;
  }

  // --- queries -----------------------------------------------------------------------------

  pool_statistics statistics() {
    std::lock_guard lock(mutex_);
    pool_statistics s;
    s.reserved_current = reserved_;
    s.reserved_high = reserved_high_;
    std::int64_t used = folded_bytes_.load(std::memory_order_relaxed);
    std::int64_t count = folded_count_.load(std::memory_order_relaxed);
    for (auto& [id, st] : states_) {
      used += st->live_bytes.load(std::memory_order_relaxed);
      count += st->live_count.load(std::memory_order_relaxed);
    }
    s.used_current = static_cast<std::uint64_t>(std::max<std::int64_t>(used, 0));
    note_used(s.used_current);
    s.used_high = used_high_.load(std::memory_order_relaxed);
    s.live_allocations = static_cast<std::uint64_t>(std::max<std::int64_t>(count, 0));
    s.free_clear = clear_.bytes();
    s.largest_free_block = clear_.largest();
    for (auto& [id, st] : states_) {
      std::lock_guard sl(st->lock);
      s.free_pending += st->pending.bytes() + st->cache_bytes;
      s.largest_free_block = std::max({s.largest_free_block, st->pending.largest(), st->cache.largest()});
    }
    s.chunks = chunks_.size();
    s.remapped_chunks = remapped_;
    s.grows = grows_;
    return s;
  }

  void reset_high_water() {
    std::lock_guard lock(mutex_);
    reserved_high_ = reserved_;
    std::int64_t used = folded_bytes_.load(std::memory_order_relaxed);
    for (auto& [id, st] : states_) {
      used += st->live_bytes.load(std::memory_order_relaxed);
      st->peak_seen.store(st->live_bytes.load(std::memory_order_relaxed), std::memory_order_relaxed);
    }
    used_high_.store(static_cast<std::uint64_t>(std::max<std::int64_t>(used, 0)), std::memory_order_relaxed);
  }

  /// What the pool holds per stream: states of streams in use (retired ones whose frees are
  /// still pending included), and states made in all (each in use or kept for reuse).
  struct stream_state_counts {
    std::size_t in_use = 0, made = 0;
  };
  stream_state_counts stream_states() {
    std::lock_guard lock(mutex_);
    return {states_.size(), state_store_.size()};
  }

  /// The live block starting at or containing `p`, if any: (start, size).
  std::optional<std::pair<std::uint64_t, std::uint64_t>> find_live(std::uint64_t p) {
    if (block* b = live_.find(p)) return std::pair{b->addr, b->size};
    std::lock_guard lock(mutex_);
    block* b = chain_.at_or_before(p);
    if (b == nullptr) return std::nullopt;
    if (p < b->addr + b->size && state_of(b) == block_state::live) return std::pair{b->addr, b->size};
    return std::nullopt;
  }

  // --- physical memory -----------------------------------------------------------------------

  /// True while a free may still be running on the device: a cached or pending block whose free
  /// is not known to have executed. Closing a pool waits for the device while this is true.
  bool frees_in_flight() {
    std::lock_guard lock(mutex_);
    bool in_flight = false;
    for (auto& [id, st] : states_) {
      flush_cache(*st);
      settle(*st, /*query_events=*/true, stream_key{});
      in_flight = in_flight || !st->pending.empty();
    }
    return in_flight;
  }

  /// Releases free physical memory until at most `keep` bytes of it remain (whole chunks only,
  /// and only memory whose frees are known to have completed).
  void trim_to(std::uint64_t keep) {
    std::lock_guard lock(mutex_);
    settle_all(/*query_events=*/true, stream_key{});
    release_free_chunks(keep);
  }

  /// The stream is going away. The last moment its handle may be used: its cached frees join
  /// its pending bins, and one query says whether it is idle (then they are complete, and its
  /// state is free for another stream at once); if not, one last event covers them. Nothing is
  /// recorded on it afterwards.
  void on_retire(std::uint64_t stream) noexcept override {
    std::lock_guard lock(mutex_);
    auto it = states_.find(stream);
    if (it == states_.end()) return;
    stream_state& st = *it->second;
    try {
      flush_cache(st);
      if (st.native != nullptr) settle(st, /*query_events=*/true, stream_key{st.record.get(), st.native});
    } catch (...) {
      // No event: the stream's pending frees wait for a device-wide synchronization.
    }
    st.native = nullptr;
    try {
      retiring_.push_back(stream);
      recycle_retired();
    } catch (...) {
      // Out of host memory: the state stays with the pool, which is always safe.
    }
  }

  /// Called by the ordering registry after a host synchronization (or device-wide one).
  void on_synchronize(std::uint64_t stream) noexcept override {
    try {
      std::lock_guard lock(mutex_);
      if (stream == 0) {  // every stream
        for (auto& [id, st] : states_) flush_cache(*st);
        settle_all(false, stream_key{});
      } else if (auto it = states_.find(stream); it != states_.end()) {
        flush_cache(*it->second);
        settle(*it->second, false, stream_key{});
      }
      release_free_chunks(options_.release_threshold);
    } catch (...) {
      // Only bad_alloc can get here; memory stays cached, which is always safe.
    }
  }

 private:
  static constexpr std::size_t max_cached_blocks = 4096;
  /// A room_to_grow allocation is placed in the middle of free addresses this many times its
  /// size, reserved for it if need be: half of them are its room to grow in place.
  static constexpr std::uint64_t room_spread = 16;

  struct pending_event {
    event ev;
    std::uint64_t epoch;  ///< frees stamped <= epoch precede the event
  };

  struct alignas(128) stream_state {
    explicit stream_state(stream_key k) : record(k.record), native(k.native) {}
    /// Made ready for another stream: only ever called on an emptied, retired stream's state.
    void reuse(stream_key k) noexcept {
      record = record_ref(k.record);
      native = k.native;
      cache_bytes = 0;
      last_event_epoch = 0;
      newest_stamp = 0;
      live_bytes.store(0, std::memory_order_relaxed);
      live_count.store(0, std::memory_order_relaxed);
      peak_seen.store(0, std::memory_order_relaxed);
    }
    stream_state* next_made = nullptr;  // the list of every state, set once
    spin_lock lock;
    record_ref record;  // held: the record stays while the pool keeps state for its stream
    void* native;
    free_bins cache;  // under lock
    std::uint64_t cache_bytes = 0;
    free_bins pending;                 // under the pool lock
    std::deque<pending_event> events;  // under the pool lock
    std::uint64_t last_event_epoch = 0;
    std::uint64_t newest_stamp = 0;    // of the frees moved into pending, under the pool lock
    std::atomic<std::int64_t> live_bytes{0};
    std::atomic<std::int64_t> live_count{0};
    // Read and written on the fast path (under `lock`) and on the slow path (under the pool
    // lock, by another thread perhaps): relaxed atomic, the value is only a threshold.
    std::atomic<std::int64_t> peak_seen{0};
  };

  struct chunk {
    std::uint64_t size;
    handle h;
  };

  static std::uint64_t round_up(std::uint64_t v, std::uint64_t to) { return (v + to - 1) / to * to; }
  static std::atomic<std::uint64_t>& next_serial() {
    static std::atomic<std::uint64_t> s{0};
    return s;
  }
  static block_state state_of(block* b) noexcept {
    return std::atomic_ref<block_state>(b->state).load(std::memory_order_acquire);
  }
  static void set_state(block* b, block_state s) noexcept {
    std::atomic_ref<block_state>(b->state).store(s, std::memory_order_release);
  }

  std::uint64_t cache_limit() const noexcept {
    return std::max<std::uint64_t>(256ull << 20, reserved_seen_.load(std::memory_order_relaxed) / 4);
  }

  // --- per-stream state ----------------------------------------------------------------------

  stream_state& state_for(stream_key s) {
    const std::uint64_t id = s.record->id();
    struct tls_entry {
      std::uint64_t pool = 0, stream = 0;
      stream_state* state = nullptr;
    };
    thread_local std::array<tls_entry, 4> recent{};
    for (auto& e : recent) {
      if (e.pool == serial_ && e.stream == id) return *e.state;
    }
    stream_state* st;
    {
      std::lock_guard lock(mutex_);
      auto& slot = states_[id];
      if (slot == nullptr) slot = make_state(s);
      st = slot;
    }
    std::rotate(recent.rbegin(), recent.rbegin() + 1, recent.rend());
    recent[0] = {serial_, id, st};
    return *st;
  }

  void account_allocate(stream_state& st, std::uint64_t size) noexcept {
    st.live_count.fetch_add(1, std::memory_order_relaxed);
    account_bytes(st, static_cast<std::int64_t>(size));
  }
  void account_bytes(stream_state& st, std::int64_t size) noexcept {
    const auto v = st.live_bytes.fetch_add(size, std::memory_order_relaxed) + size;
    // A new peak for this stream may be a new peak for the pool: sum every stream then. Exact
    // when one stream allocates at a time; otherwise a peak made of several streams' moments
    // is seen when one of them reaches a peak of its own.
    if (v > st.peak_seen.load(std::memory_order_relaxed)) {
      st.peak_seen.store(v, std::memory_order_relaxed);
      std::int64_t sum = folded_bytes_.load(std::memory_order_relaxed);
      for (stream_state* other = states_head_.load(std::memory_order_acquire); other != nullptr;
           other = other->next_made) {
        sum += other->live_bytes.load(std::memory_order_relaxed);
      }
      note_used(static_cast<std::uint64_t>(std::max<std::int64_t>(sum, 0)));
    }
  }
  void account_free(stream_state& st, std::uint64_t size) noexcept {
    st.live_bytes.fetch_sub(static_cast<std::int64_t>(size), std::memory_order_relaxed);
    st.live_count.fetch_sub(1, std::memory_order_relaxed);
  }
  void note_used(std::uint64_t v) noexcept {
    std::uint64_t h = used_high_.load(std::memory_order_relaxed);
    while (v > h && !used_high_.compare_exchange_weak(h, v, std::memory_order_relaxed)) {
    }
  }
  /// A state for a stream the pool has not seen (or no longer holds): a retired stream's,
  /// emptied and reset, when there is one. So the pool holds as many states as streams were
  /// ever in use at once, not one for every stream ever seen, and the list walked without the
  /// lock (by the peak accounting above) only grows when that number does.
  stream_state* make_state(stream_key s) {
    if (!spare_states_.empty()) {
      stream_state* st = spare_states_.back();
      spare_states_.pop_back();
      st->reuse(s);
      return st;
    }
    state_store_.push_back(std::make_unique<stream_state>(s));
    stream_state* st = state_store_.back().get();
    st->next_made = states_head_.load(std::memory_order_relaxed);
    states_head_.store(st, std::memory_order_release);  // readers see it whole
    return st;
  }

  /// Retired streams whose frees have all been settled give their states back for reuse:
  /// nothing refers to them any more (their blocks are elsewhere, and a retired stream's id
  /// never comes back, so no thread's cache of recent states can match it). Their share of
  /// the live accounting moves to the pool's folded totals, so the sums stay exact.
  void recycle_retired() {
    std::erase_if(retiring_, [&](std::uint64_t id) {
      auto it = states_.find(id);
      if (it == states_.end()) return true;
      stream_state& st = *it->second;
      settle(st, /*query_events=*/true, stream_key{});  // polls its last event; the handle is gone
      if (!st.pending.empty() || st.cache_bytes != 0 || !st.cache.empty()) return false;
      for (auto& pe : st.events) backend_.destroy(pe.ev);  // done or not: nothing waits on them
      st.events.clear();
      // Zeroed first: a lock-free reader summing meanwhile misses the share (a peak seen
      // later) rather than counting it twice (a peak that never was).
      folded_bytes_.fetch_add(st.live_bytes.exchange(0, std::memory_order_relaxed), std::memory_order_relaxed);
      folded_count_.fetch_add(st.live_count.exchange(0, std::memory_order_relaxed), std::memory_order_relaxed);
      spare_states_.push_back(&st);
      st.record.reset();  // the last holder perhaps: the stream's record goes
      states_.erase(it);
      return true;
    });
  }

  // --- the slow path -------------------------------------------------------------------------

  std::uint64_t allocate_slow(std::uint64_t n, stream_state& st, stream_key s, placement where) {
    std::lock_guard lock(mutex_);
    if (!retiring_.empty()) recycle_retired();
    flush_cache(st);
    if (!st.record->handle_stable()) cover_pending(st, s);
    block* b = find_usable(n, st);
    if (b == nullptr) {
      // Others' cached frees, and whatever completed since we last looked.
      // Including this stream's own pending frees: once known complete they may be remapped.
      for (auto& [id, other] : states_) flush_cache(*other);
      settle_all(options_.reuse.opportunistic, s);
      b = find_usable(n, st);
    }
    if (b == nullptr) b = join_adjacent(n, st);
    if (b == nullptr) b = defragment(n, st);
    if (b == nullptr) b = grow(n, st, where);
    if (b == nullptr && options_.reuse.internal_dependencies) b = wait_for_pending(n, st, s);
    if (b == nullptr) {
      // Every source has been tried: free blocks usable now, completions learned just now,
      // adjacent runs, remapping, growth, and (if allowed) waiting on other streams' frees.
      // What remains free is pending on streams this one has no proof of.
      core_out_of_memory e;
      e.requested = n;
      e.reason = describe_state();
      throw e;
    }
    take(b, n);
    set_state(b, block_state::live);
    account_allocate(st, b->size);
    live_.insert(b->addr, b);
    return b->addr;
  }

  /// Best fit among the blocks `st` may use: clear ones, its own, and others' it is ordered
  /// after.
  block* find_usable(std::uint64_t n, stream_state& st) {
    block* best = clear_.find(n, [](block*) { return true; });
    if (block* mine = st.pending.find(n, [](block*) { return true; })) {
      if (best == nullptr || mine->size < best->size) best = mine;
    }
    if (options_.reuse.follow_event_dependencies) {
      for (auto& [id, other] : states_) {
        if (other == &st || other->pending.empty()) continue;
        const std::uint64_t after = st.record->ordered_after(id);
        const std::uint64_t done = other->record->completed();
        const std::uint64_t limit = std::max(after, done);
        if (limit == 0) continue;
        if (block* b = other->pending.find(n, [limit](block* x) { return x->stamp <= limit; })) {
          if (best == nullptr || b->size < best->size) best = b;
        }
      }
    }
    return best;
  }

  /// Free blocks `st` may use but that sit in different bins (clear ones, and pending ones of
  /// `st`) do not coalesce with each other. When nothing else fits, find the smallest run of
  /// adjacent such blocks that holds `n` bytes and merge it into `st`'s pending bins (it is
  /// about to be used by `st`). Null when no run is large enough.
  block* join_adjacent(std::uint64_t n, stream_state& st) {
    auto usable = [&](block* x) {
      if (x == nullptr) return false;
      const block_state s = state_of(x);
      return (s == block_state::clear && x->bins == &clear_) || (s == block_state::pending && x->bins == &st.pending);
    };
    block* best_start = nullptr;
    std::uint64_t best_size = 0;
    auto consider = [&](block* b) {
      if (usable(b->prev_addr)) return;  // not the start of a run
      std::uint64_t total = 0;
      int parts = 0;
      for (block* x = b; usable(x); x = x->next_addr) {
        total += x->size;
        ++parts;
      }
      if (parts > 1 && total >= n && (best_start == nullptr || total < best_size)) {
        best_start = b;
        best_size = total;
      }
    };
    clear_.for_each(consider);
    st.pending.for_each(consider);
    if (best_start == nullptr) return nullptr;
    // Re-inserting the run's first block as a free of `st` merges the rest of the run into it
    // (the same merge a free makes), and the whole run lands in `st`'s pending bins.
    best_start->bins->remove(best_start);
    return free_pending(best_start, st);
  }

  /// Takes `n` bytes from the front of free block `b` (split if larger), removing it from its
  /// bins. The remainder stays where `b` was, with its tag.
  void take(block* b, std::uint64_t n) {
    free_bins* bins = b->bins;
    bins->remove(b);
    if (b->size - n >= free_bins::quantum) {
      block* rest = split(b, n);
      rest->stream = b->stream;
      rest->stamp = b->stamp;
      rest->state = b->state;
      bins->insert(rest);
    }
  }

  /// Cuts `b` after its first `n` bytes; returns the rest as a block of its own, in no bins.
  block* split(block* b, std::uint64_t n) { return chain_.split(b, n); }

  /// The live block starting at `p`; throws std::invalid_argument saying what `p` is instead.
  block* live_block(std::uint64_t p, const char* what) {
    block* b = live_.find(p);
    if (b == nullptr) [[unlikely]] {
      throw std::invalid_argument(explain_bad_free(p, what));
    }
    return b;
  }

  /// Moves a stream's fast cache into its pending bins, coalescing.
  void flush_cache(stream_state& st) {
    std::vector<block*> blocks;
    {
      std::lock_guard lock(st.lock);
      if (st.cache.empty()) return;
      blocks.reserve(st.cache.count());
      st.cache.for_each([&](block* b) {
        st.cache.remove(b);
        blocks.push_back(b);
      });
      st.cache_bytes = 0;
    }
    for (block* b : blocks) free_pending(b, st);
  }

  /// Puts a freed block into its stream's pending bins, merging it with free neighbours that
  /// are pending on the same stream or clear (a clear neighbour is absorbed: usable by this
  /// stream at once, by others once this free is known complete). Returns the merged block.
  block* free_pending(block* b, stream_state& st) {
    st.newest_stamp = std::max(st.newest_stamp, b->stamp);
    set_state(b, block_state::pending);
    b = merge_neighbours(b, &st.pending, &clear_);
    b->stream = st.record->id();
    set_state(b, block_state::pending);  // the survivor may have been a clear neighbour
    st.pending.insert(b);
    return b;
  }

  /// Merges `b` (in no bins) with its free address neighbours that sit in `bins` or `also`.
  /// The survivor takes `b`'s stream and the newest stamp. Returns it, not yet inserted.
  block* merge_neighbours(block* b, free_bins* bins, free_bins* also = nullptr) {
    // The state is read first: a cached or live neighbour may change concurrently (the fast
    // path), but never into pending or clear, which only happens under the pool lock.
    auto mergeable = [&](block* x) {
      if (x == nullptr) return false;
      const block_state s = state_of(x);
      return (s == block_state::pending || s == block_state::clear) && (x->bins == bins || (also != nullptr && x->bins == also));
    };
    while (mergeable(b->prev_addr)) {
      block* p = b->prev_addr;
      p->bins->remove(p);
      p->stream = b->stream;
      p->size += b->size;
      p->stamp = std::max(p->stamp, b->stamp);
      unlink(b);
      b = p;
    }
    while (mergeable(b->next_addr)) {
      block* x = b->next_addr;
      x->bins->remove(x);
      b->size += x->size;
      b->stamp = std::max(b->stamp, x->stamp);
      unlink(x);
    }
    return b;
  }

  /// Removes `x` from the address chain (it has been absorbed by its predecessor).
  void unlink(block* x) { chain_.unlink(x); }

  /// The handle through which the pool may reach `st`'s stream now: its own when the stream's
  /// record says it stays valid, else the caller's when the caller is that stream (given in this
  /// call, on this thread), else none (see "Stream handles" at the top).
  static void* handle_now(const stream_state& st, const stream_key& caller) noexcept {
    if (st.native != nullptr && st.record->handle_stable()) return st.native;
    if (caller.record == st.record.get()) return caller.native;
    return nullptr;
  }

  /// Moves a stream's pending blocks whose frees are known complete to the clear bins.
  /// With `query_events`, asks the device about the pool's own events on the stream first,
  /// and about the stream itself where its handle may be used now (`caller`: the stream of the
  /// call in progress, if any).
  void settle(stream_state& st, bool query_events, const stream_key& caller) {
    void* const native = query_events ? handle_now(st, caller) : nullptr;
    if (native != nullptr && !st.pending.empty() && st.newest_stamp > st.record->completed()) {
      // An idle stream has executed everything enqueued before the question, frees included:
      // the cheapest proof there is (one query), and complete, where an event only covers the
      // frees made before it was recorded.
      const std::uint64_t point = st.record->begin_synchronize();
      if (backend_.idle({st.record.get(), native})) ordering().complete_stream_quietly(*st.record, point);
    }
    if (query_events) {
      // Record an event covering the frees made since the last one, so a later look can tell.
      // One event per stream per look, not one per free.
      if (native != nullptr && !st.pending.empty() && st.newest_stamp > st.last_event_epoch &&
          st.newest_stamp > st.record->completed()) {
        stream_key k{st.record.get(), native};
        clock_snapshot point = st.record->capture();
        st.events.push_back({backend_.record(k), point.epoch});
        st.last_event_epoch = point.epoch;
      }
      while (!st.events.empty() && backend_.done(st.events.front().ev)) {
        st.record->mark_completed(st.events.front().epoch);
        backend_.destroy(st.events.front().ev);
        st.events.pop_front();
      }
    }
    const std::uint64_t done = st.record->completed();
    if (done == 0 || st.pending.empty()) return;
    std::vector<block*> ready;
    st.pending.for_each([&](block* b) {
      if (b->stamp <= done) {
        st.pending.remove(b);
        ready.push_back(b);
      }
    });
    // Merging may absorb a later block of `ready` into an earlier one's neighbour chain only
    // once that later block is clear, i.e. after its own turn here, so none is used recycled.
    for (block* b : ready) make_clear(b);
  }

  /// Records an event on `s` (the stream of the call in progress, whose state is `st`) covering
  /// its pending frees not yet covered by one. For a stream whose handle the pool may not use
  /// later (raw, per-thread) this is the only way other streams ever learn that those frees ran
  /// without a host synchronization. At most one event per slow-path call.
  void cover_pending(stream_state& st, const stream_key& s) {
    if (s.native == nullptr || st.pending.empty() || st.newest_stamp <= st.last_event_epoch ||
        st.newest_stamp <= st.record->completed()) {
      return;
    }
    clock_snapshot point = st.record->capture();
    st.events.push_back({backend_.record(s), point.epoch});
    st.last_event_epoch = point.epoch;
  }

  void make_clear(block* b) {
    set_state(b, block_state::clear);
    b->stream = 0;
    b->stamp = 0;
    b = merge_neighbours(b, &clear_);
    clear_.insert(b);
  }

  void settle_all(bool query_events, const stream_key& caller) {
    for (auto& [id, st] : states_) settle(*st, query_events, caller);
    if (!retiring_.empty()) recycle_retired();
  }

  // --- growth, defragmentation, release --------------------------------------------------------


  /// The free block `st` may use that ends a mapped run and has room after it for what a
  /// request of `n` bytes lacks (rounded up to `unit`), the largest such: growing or remapping
  /// there extends it instead of starting a new run. Null if none.
  block* extendable_tail(stream_state& st, std::uint64_t n, std::uint64_t unit) {
    block* best = nullptr;
    for (auto& [start, end] : chain_.runs()) {
      block* last = chain_.before(end);
      if (last == nullptr) continue;
      const block_state ls = state_of(last);
      if (ls != block_state::clear && ls != block_state::pending) continue;
      if (last->bins != &clear_ && last->bins != &st.pending) continue;
      if (!va_free_.has_room(end, round_up(n - std::min(n, last->size), unit))) continue;
      if (best == nullptr || last->size > best->size) best = last;
    }
    return best;
  }

  /// Maps `c` at `va` and puts it in the address chain as a free block of `bins`, merged with a
  /// free neighbour before it.
  block* place_chunk(std::uint64_t va, chunk c, free_bins* bins, stream_state* st) {
    backend_.map(va, c.size, c.h);
    const std::uint64_t size = c.size;
    chunks_.emplace(va, std::move(c));
    block* b = chain_.place(va, size);
    if (bins == &clear_) {
      set_state(b, block_state::clear);
    } else {
      set_state(b, block_state::pending);
      b->stream = st->record->id();
      b->stamp = 0;  // fresh memory: ordered before everything
    }
    b = merge_neighbours(b, bins);
    bins->insert(b);
    return b;
  }

  /// Grows the pool for a request of `n` bytes on `st`. Null when the limit or the device
  /// says no. `again`: this is the one retry after free chunks were released (below).
  block* grow(std::uint64_t n, stream_state& st, placement where, bool again = false) {
    const bool own = n >= options_.chunk_size && options_.own_chunk_for_large;
    // One handle of its own for a large request: copies over it run at full speed. Otherwise
    // chunks, extending the free block at the end of a mapped run when there is one.
    // Without a tail to extend, the new memory must hold the whole request.
    block* tail = own ? nullptr : extendable_tail(st, n, options_.chunk_size);
    const std::uint64_t have = tail != nullptr ? tail->size : 0;
    const std::uint64_t need = round_up(n - std::min(n, have), granularity_);
    const bool one_piece =
        own || (options_.max_size != 0 && reserved_ + round_up(need, options_.chunk_size) > options_.max_size);
    // own: one handle; a piece under the limit: one smaller handle; otherwise whole chunks.
    const std::uint64_t total = own ? round_up(n, granularity_)
                                : one_piece ? need
                                            : round_up(std::max<std::uint64_t>(need, 1), options_.chunk_size);
    if (options_.max_size != 0 && reserved_ + total > options_.max_size) return nullptr;
    // Refused before any handle is made (or listed): more than the largest run of free addresses
    // can never be mapped together, however much memory the device has.
    if (total > va_free_.largest() && !reserve_more(total)) return nullptr;
    std::vector<std::uint64_t> sizes;
    if (one_piece) {
      sizes.push_back(total);
    } else {
      sizes.assign(total / options_.chunk_size, options_.chunk_size);
    }
    std::vector<handle> handles(sizes.size());
    bool released = false;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      // Out of device memory: give back the whole free chunks this pool caches, then retry.
      CUresult r = backend_.create(sizes[i], handles[i]);
      if (r != CUDA_SUCCESS && release_free_chunks(0) != 0) {
        released = true;
        r = backend_.create(sizes[i], handles[i]);
      }
      if (r != CUDA_SUCCESS) {
        for (std::size_t j = 0; j < i; ++j) backend_.release(handles[j]);
        return nullptr;
      }
    }
    // Releasing free chunks above may have taken the tail with them, or shrunk it.
    if (tail != nullptr) {
      tail = extendable_tail(st, n, options_.chunk_size);
      if (tail != nullptr && tail->size + total < n) tail = nullptr;
    }
    std::optional<std::uint64_t> va;
    // Right after the tail or not at all: a tail chosen again above had its room checked for
    // its own size, which may be less than `total`.
    if (tail != nullptr) va = va_free_.take_at(total, tail->addr + tail->size);
    if (!va && total < n) {  // away from the tail, too little to hold the request
      for (auto& h : handles) backend_.release(h);
      // The release took the tail this growth was sized for, and freed device memory: sized
      // afresh, without that tail, the request may now fit.
      return released && !again ? grow(n, st, where, true) : nullptr;
    }
    // A large request starts a run of its own: with room to grow in place after it, or next
    // to the other large runs, at the top of the addresses (chunk runs grow at the bottom),
    // where the GPU page tables are already built.
    if (!va && own && where == placement::room_to_grow) {
      // Room of at least `room_spread / 2` times its size after it: reserved for it, when the
      // free addresses are short of that, else as much as there is.
      va = va_free_.take_spaced(total, granularity_, room_spread);
      if (!va && total <= va_limit_ / room_spread && reserve_more(room_spread * total)) {
        va = va_free_.take_spaced(total, granularity_, room_spread);
      }
      if (!va) va = va_free_.take_spaced(total, granularity_);
    } else if (!va && own) {
      va = va_free_.take_top(total);
    }
    if (!va) va = va_free_.take(total);
    if (!va) {
      for (auto& h : handles) backend_.release(h);
      return nullptr;
    }
    note_growth(total);
    free_bins* bins = (tail != nullptr && tail->bins == &st.pending) ? &st.pending : &clear_;
    std::uint64_t at = *va;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      place_chunk(at, chunk{sizes[i], std::move(handles[i])}, bins, &st);
      at += sizes[i];
    }
    return find_usable(n, st);
  }


  // --- addresses -------------------------------------------------------------------------------

  /// The first reservation: 8 GiB (128 default chunks), or 16 chunks when they are larger;
  /// small enough that thousands of pools fit in a process's address space (the rest is
  /// reserved as the pool grows).
  std::uint64_t first_reservation() const noexcept {
    return round_up(std::max<std::uint64_t>(8ull << 30, 16 * options_.chunk_size), granularity_);
  }

  void add_reservation(std::uint64_t base, std::uint64_t size) {
    va_free_.add_reservation(base, size);
    reservations_.add(base, size);
    if (options_.on_reserve) options_.on_reserve(base, size);
  }

  /// Reserves addresses for a mapping of `bytes` (at `at`, when not 0), within the pool's limit.
  /// False when the limit, the reservations' count, or the driver refuses.
  bool reserve_more(std::uint64_t bytes, std::uint64_t at = 0) {
    const std::uint64_t size = reservations_.next_size(bytes, va_limit_, first_reservation());
    if (size == 0) return false;
    const std::uint64_t base = backend_.try_reserve(size, at);
    if (base == 0) {
      if (at == 0) refused_reservation_ = size;
      return false;
    }
    add_reservation(base, size);
    return true;
  }

  /// `bytes` more physical memory are held.
  void note_growth(std::uint64_t bytes) noexcept {
    reserved_ += bytes;
    reserved_high_ = std::max(reserved_high_, reserved_);
    reserved_seen_.store(reserved_, std::memory_order_relaxed);
    ++grows_;
  }

  /// Extends live block `b` to `n` bytes with the free blocks after it that `st` may use,
  /// mapping new physical memory at the end of its run if they fall short. False, changing
  /// nothing, when a block in the way is live or not usable, or the addresses after the run
  /// are taken, or the pool is at its limit or the device out of memory.
  bool extend(block* b, std::uint64_t n, stream_state& st) {
    auto usable = [&](block* x) {
      if (x == nullptr) return false;
      const block_state xs = state_of(x);
      if (xs == block_state::clear) return x->bins == &clear_;
      if (xs != block_state::pending) return false;
      if (x->bins == &st.pending) return true;
      if (!options_.reuse.follow_event_dependencies) return false;
      auto it = states_.find(x->stream);
      if (it == states_.end() || x->bins != &it->second->pending) return false;
      const std::uint64_t limit = std::max(st.record->ordered_after(x->stream), it->second->record->completed());
      return x->stamp <= limit;
    };
    std::uint64_t have = b->size;
    block* last = b;
    while (have < n && usable(last->next_addr)) {
      last = last->next_addr;
      have += last->size;
    }
    if (have < n) {
      if (last->next_addr != nullptr) return false;  // a live or unusable block in the way
      const std::uint64_t end = last->addr + last->size;
      const std::uint64_t bytes = round_up(n - have, granularity_);
      if (options_.max_size != 0 && reserved_ + bytes > options_.max_size) return false;
      // Past the end of a reservation, a new one placed right there continues the run.
      if (!va_free_.has_room(end, bytes) && (reservations_.owns(end) || !reserve_more(bytes, end))) return false;
      handle h{};
      // No retry after releasing cached chunks here: the free blocks after `b` may be among them.
      if (backend_.create(bytes, h) != CUDA_SUCCESS) return false;
      (void)va_free_.take_at(bytes, end);  // room was checked under the same lock
      note_growth(bytes);
      place_chunk(end, chunk{bytes, std::move(h)}, &clear_, &st);
    }
    // Absorb the blocks after `b`, splitting the last one.
    while (b->size < n) {
      block* x = b->next_addr;
      free_bins* bins = x->bins;
      bins->remove(x);
      const std::uint64_t want = n - b->size;
      if (x->size <= want) {
        b->size += x->size;
        unlink(x);
      } else {
        chain_.give_front(x, want);
        bins->insert(x);
        b->size += want;
      }
    }
    return true;
  }

  struct free_chunk {
    std::uint64_t va, size;
    std::uint64_t block_size;  ///< of the free block holding it
  };

  /// The chunks lying wholly inside clear free blocks (only memory known to be unused may be
  /// unmapped: remapping memory a kernel still reads would fault).
  std::vector<free_chunk> free_chunks() {
    std::vector<free_chunk> out;
    for (auto& [va, c] : chunks_) {
      block* b = chain_.at_or_before(va);
      if (state_of(b) == block_state::clear && b->addr <= va && b->addr + b->size >= va + c.size) {
        out.push_back({va, c.size, b->size});
      }
    }
    return out;
  }

  /// Cuts [va, va + size) out of the clear block holding it and out of the address chain.
  void cut_out(std::uint64_t va, std::uint64_t size) {
    block* b = chain_.at_or_before(va);
    clear_.remove(b);
    const auto [before, after] = chain_.cut(b, va, size);
    for (block* piece : {before, after}) {
      if (piece == nullptr) continue;
      set_state(piece, block_state::clear);
      clear_.insert(piece);
    }
  }

  /// Defragments: when the clear memory in whole free chunks would hold `n` bytes, remaps those
  /// chunks next to each other (after the largest extendable free block if there is one).
  block* defragment(std::uint64_t n, stream_state& st) {
    auto movable = free_chunks();
    std::uint64_t total = 0;
    for (auto& m : movable) total += m.size;
    block* tail = extendable_tail(st, n, granularity_);  // only if the chunks fit after it
    const std::uint64_t have = tail != nullptr ? tail->size : 0;
    if (total + have < n) return nullptr;
    // Take chunks out of the smallest free blocks first, so the large free blocks stay whole
    // for large requests (this matters more to fragmentation than the number of remaps).
    std::sort(movable.begin(), movable.end(), [](const free_chunk& a, const free_chunk& b) {
      return a.block_size != b.block_size ? a.block_size < b.block_size : a.va < b.va;
    });
    std::vector<std::pair<std::uint64_t, std::uint64_t>> picked;
    std::uint64_t got = have;
    for (auto& m : movable) {
      if (got >= n) break;
      // Chunks under the tail block stay: moving them would shrink what they are to extend.
      if (tail != nullptr && m.va < tail->addr + tail->size && tail->addr < m.va + m.size) continue;
      picked.emplace_back(m.va, m.size);
      got += m.size;
    }
    if (got < n) {
      tail = nullptr;  // without the tail: from scratch
      picked.clear();
      got = 0;
      for (auto& m : movable) {
        if (got >= n) break;
        picked.emplace_back(m.va, m.size);
        got += m.size;
      }
      if (got < n) return nullptr;
    }
    std::uint64_t bytes = 0;
    for (auto& m : picked) bytes += m.second;
    std::optional<std::uint64_t> at;
    const std::uint64_t tail_end = tail != nullptr ? tail->addr + tail->size : 0;
    if (tail != nullptr) at = va_free_.take_at(bytes, tail_end);
    if (!at && tail != nullptr && bytes < n) return nullptr;  // would not hold the request alone
    if (!at) {
      at = va_free_.take(bytes);
      if (!at && reserve_more(bytes)) at = va_free_.take(bytes);
      if (!at) return nullptr;
    }
    std::uint64_t dst = *at;
    for (auto& [va, size] : picked) {
      cut_out(va, size);
      auto node = chunks_.extract(va);
      backend_.unmap(va, size);
      va_free_.give_back(va, size);
      place_chunk(dst, std::move(node.mapped()), &clear_, &st);
      dst += size;
      ++remapped_;
    }
    return find_usable(n, st);
  }

  /// Releases whole free chunks, highest address first, until free memory is at most `keep`.
  /// Returns the bytes released.
  std::uint64_t release_free_chunks(std::uint64_t keep) {
    std::uint64_t free_bytes = clear_.bytes();
    for (auto& [id, st] : states_) free_bytes += st->pending.bytes();
    if (free_bytes <= keep) return 0;
    auto movable = free_chunks();
    std::uint64_t released = 0;
    for (auto it = movable.rbegin(); it != movable.rend() && free_bytes > keep; ++it) {
      const std::uint64_t va = it->va, size = it->size;
      cut_out(va, size);
      auto node = chunks_.extract(va);
      backend_.unmap(va, size);
      backend_.release(node.mapped().h);
      va_free_.give_back(va, size);
      reserved_ -= size;
      free_bytes -= size;
      released += size;
    }
    reserved_seen_.store(reserved_, std::memory_order_relaxed);
    return released;
  }

  /// Internal dependencies: make `s` wait for another stream's frees, so their blocks become
  /// usable. Tries streams in turn; each costs an event record and a stream wait.
  block* wait_for_pending(std::uint64_t n, stream_state& st, stream_key s) {
    for (auto& [id, other] : states_) {
      if (other == &st || other->pending.empty()) continue;
      if (other->pending.largest() < n) continue;
      std::uint64_t limit = 0;
      if (void* native = handle_now(*other, stream_key{})) {
        stream_key k{other->record.get(), native};
        clock_snapshot point = other->record->capture();
        event ev = backend_.record(k);
        other->events.push_back({ev, point.epoch});
        other->last_event_epoch = std::max(other->last_event_epoch, point.epoch);
        limit = point.epoch;
      } else if (!other->events.empty()) {
        // A stream whose handle may not be used now (raw, per-thread): the newest event the
        // pool recorded on it while it was in hand covers the frees made before it.
        limit = other->events.back().epoch;
      } else {
        continue;
      }
      if (other->pending.largest() < n) continue;
      block* b = other->pending.find(n, [limit](block* x) { return x->stamp <= limit; });
      if (b == nullptr) continue;
      event& ev = other->events.back().ev;
      if (s.native != nullptr) {
        backend_.wait(s, ev);
      } else {
        backend_.synchronize(ev);  // a synchronous allocation: the host waits instead
      }
      // Recorded whatever the policies: it is a real ordering.
      st.record->wait_for(clock_snapshot{other->record->id(), limit, {}});
      return b;
    }
    return nullptr;
  }

  std::string describe_state() {
    std::uint64_t pending = 0;
    for (auto& [id, st] : states_) pending += st->pending.bytes();
    std::string m = "reserved " + std::to_string(reserved_) + " bytes";
    if (options_.max_size != 0) m += " of at most " + std::to_string(options_.max_size);
    m += ", free " + std::to_string(clear_.bytes()) + " (largest block " + std::to_string(clear_.largest()) +
         "), awaiting stream order " + std::to_string(pending);
    return m;
  }

  std::string explain_bad_free(std::uint64_t p, const char* what = "deallocate") {
    const std::string who = std::string("streamalloc::pool::") + what + ": ";
    char buf[32];
    std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(p));
    if (!owns(p)) return who + buf + " was not allocated from this pool";
    std::lock_guard lock(mutex_);
    if (block* b = chain_.at_or_before(p)) {
      if (p < b->addr + b->size) {
        if (state_of(b) == block_state::live) {
          return who + buf +
                 " points inside an allocation, not at its start";
        }
        if (b->addr == p) {
          return who + buf + " is already free (double free)";
        }
      }
    }
    return who + buf +
           " is not a live allocation of this pool (freed already, or never returned by allocate)";
  }

  Backend backend_;
  core_options options_;
  std::uint64_t granularity_ = 0;
  std::uint64_t va_limit_ = 0;
  reservation_list reservations_;
  std::uint64_t refused_reservation_ = 0;
  std::uint64_t serial_ = 0;

  std::mutex mutex_;  // the pool lock
  free_bins clear_;
  block_chain chain_;                                  // every block, live or free, by address
  std::map<std::uint64_t, chunk> chunks_;             // mapped physical memory by address
  address_ranges va_free_;                             // unmapped addresses of the reservations
  std::unordered_map<std::uint64_t, stream_state*> states_;  // the streams in use, by id
  std::vector<std::unique_ptr<stream_state>> state_store_;    // every state made, owned
  std::atomic<stream_state*> states_head_{nullptr};           // the same, for lock-free walks
  std::vector<stream_state*> spare_states_;                   // retired and empty: for new streams
  std::vector<std::uint64_t> retiring_;                       // retired, frees still pending
  std::atomic<std::int64_t> folded_bytes_{0}, folded_count_{0};  // recycled states' accounting
  std::uint64_t reserved_ = 0, reserved_high_ = 0;
  std::atomic<std::uint64_t> reserved_seen_{0};
  std::atomic<std::uint64_t> used_high_{0};
  std::uint64_t remapped_ = 0, grows_ = 0;

  live_table live_;
};

}  // namespace streamalloc::detail

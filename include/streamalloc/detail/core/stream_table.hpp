#pragma once

// What a pool keeps for each stream it serves, and the live accounting summed over them.
//
// A stream's state holds its fast cache of freed blocks, its pending bins (freed, coalesced,
// not yet known complete), the events the pool recorded on it, and its share of the live
// bytes. The table finds a stream's state by the stream's record id, makes one on first use,
// and takes back the state of a stream that is destroyed (retired) once its frees have all
// settled, for the next new stream: so a pool holds as many states as streams were ever in use
// at once, not one for every stream a process ever made.
//
// Locking: the table lives under the pool lock, except where a member says otherwise. The
// accounting is lock-free (relaxed atomics per stream); the pool's peak is exact when one
// stream allocates at a time, and seen when one of several streams reaches a peak of its own.

#include <streamalloc/detail/core/free_bins.hpp>
#include <streamalloc/detail/core/live_table.hpp>
#include <streamalloc/detail/core/ordering.hpp>
#include <streamalloc/detail/core/pool_backend.hpp>  // stream_key

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace streamalloc::detail {

/// An event the pool recorded on a stream: frees stamped at or before `epoch` precede it.
template <class Event>
struct pending_event {
  Event ev;
  std::uint64_t epoch;
};

template <class Event>
struct alignas(128) stream_state {
  explicit stream_state(stream_key k) : record(k.record), native(k.native) {}
  /// Made ready for another stream: only ever called on an emptied, retired stream's state.
  void reuse(stream_key k) noexcept {
    record = record_ref(k.record);
    native = k.native;
    cache_bytes = 0;
    last_event_epoch = 0;
    newest_stamp = 0;
    pending_floor = 0;
    held_frees = 0;
    aliases = 0;
    covered_in_look = 0;
    uncovered_bytes.store(0, std::memory_order_relaxed);
    live_bytes.store(0, std::memory_order_relaxed);
    live_count.store(0, std::memory_order_relaxed);
    peak_seen.store(0, std::memory_order_relaxed);
  }
  stream_state* next_made = nullptr;  // the list of every state, set once
  spin_lock lock;
  record_ref record;  // held: the record stays while the pool keeps state for its stream
  void* native;       // the handle it was first seen with (see pool_core.hpp on using it)
  free_bins cache;    // under lock
  std::uint64_t cache_bytes = 0;
  free_bins pending;                         // under the pool lock
  std::deque<pending_event<Event>> events;  // under the pool lock
  std::uint64_t last_event_epoch = 0;
  std::uint64_t newest_stamp = 0;  // of the frees moved into pending, under the pool lock
  /// No block in `pending` has a stamp below this (a bound, set as blocks come in, reset when
  /// they come into empty bins; under the pool lock): another stream ordered only up to an
  /// earlier point has nothing to find there, and skips the search.
  std::uint64_t pending_floor = 0;
  /// Frees made on this stream of blocks still held elsewhere, by a graph (pool_graphs.hpp) or
  /// by another process that imported them (pool_exports.hpp): not in the pending bins yet,
  /// but their stamps need covering as theirs do, and the state must stay until the holder
  /// gives them back. Under the pool lock.
  std::uint32_t held_frees = 0;
  /// Chunks moved elsewhere while frees on this stream still cover their old addresses, which
  /// stay mapped until those frees are known complete (pool_remap.hpp). Under the pool lock.
  std::uint32_t aliases = 0;
  /// The look (completion_tracker::begin_look) that last covered this stream's frees with an
  /// event instead of asking whether the stream was idle. Under the pool lock.
  std::uint64_t covered_in_look = 0;
  /// Frees on this stream not yet known complete, or whose completion is still to be learned.
  [[nodiscard]] bool has_frees() const noexcept { return !pending.empty() || held_frees != 0 || aliases != 0; }
  /// Bytes freed on this stream since the pool last recorded an event on it: for a stream
  /// whose handle the pool may not use later, what would wait for a device-wide
  /// synchronization if the stream were destroyed now (pool_core.hpp, deallocate). Relaxed:
  /// only compared with a limit.
  std::atomic<std::uint64_t> uncovered_bytes{0};
  /// Counted in the table's states of streams whose handles it may not keep (raw, per-thread).
  bool counted_unkept = false;
  std::atomic<std::int64_t> live_bytes{0};
  std::atomic<std::int64_t> live_count{0};
  // Read and written on the fast path (under `lock`) and on the slow path (under the pool
  // lock, by another thread perhaps): relaxed atomic, the value is only a threshold.
  std::atomic<std::int64_t> peak_seen{0};
};

template <class Event>
class stream_table {
 public:
  using state = stream_state<Event>;

  stream_table() : serial_(next_serial().fetch_add(1, std::memory_order_relaxed) + 1) {}
  stream_table(const stream_table&) = delete;
  stream_table& operator=(const stream_table&) = delete;

  /// `s`'s state, made on first use. Called without the pool lock: a thread's last few states
  /// are found without any lock; otherwise `pool_lock` is taken to look up or make one.
  /// Throws std::bad_alloc when a state cannot be made.
  state& state_for(stream_key s, std::mutex& pool_lock) {
    // The state this table left on the stream's record: no lock, no lookup, and no cache line
    // beyond the record's, which the call reads anyway. A thread that uses thousands of
    // streams in turn (a ring, a server) finds its state here, where a per-thread cache of the
    // last few would miss.
    if (void* hint = s.record->hint_for(serial_)) return *static_cast<state*>(hint);
    const std::uint64_t id = s.record->id();
    struct tls_entry {
      std::uint64_t table = 0, stream = 0;
      state* st = nullptr;
    };
    // Keyed by the table's serial, not its address: a table made where a destroyed one was
    // must not find the old one's states.
    thread_local std::array<tls_entry, 4> recent{};
    for (auto& e : recent) {
      if (e.table == serial_ && e.stream == id) return *e.st;
    }
    state* st;
    {
      std::lock_guard lock(pool_lock);
      auto [it, inserted] = in_use_.try_emplace(id, nullptr);
      if (inserted) {
        try {
          it->second = make_state(s);
        } catch (...) {
          in_use_.erase(it);  // no null entry left behind for the walks to meet
          throw;
        }
      }
      st = it->second;
      s.record->set_hint(serial_, st);
    }
    std::rotate(recent.rbegin(), recent.rbegin() + 1, recent.rend());
    recent[0] = {serial_, id, st};
    return *st;
  }

  /// The state of the stream with record id `id`, if the table holds one.
  [[nodiscard]] state* find(std::uint64_t id) const {
    auto it = in_use_.find(id);
    return it == in_use_.end() ? nullptr : it->second;
  }
  /// Calls fn(state&) for each state in use (retired ones with frees pending included).
  template <class Fn>
  void for_each(Fn&& fn) {
    for (auto& [id, st] : in_use_) fn(*st);
  }
  /// Calls fn(state&) for each state in use until it returns true; says whether one did.
  template <class Fn>
  bool any_of(Fn&& fn) {
    for (auto& [id, st] : in_use_) {
      if (fn(*st)) return true;
    }
    return false;
  }

  /// How many bytes a stream whose handle the pool may not keep (raw, per-thread) may free
  /// before the pool records an event on it, covering them. CUDA cannot tell the pool that
  /// such a stream was destroyed, so what it freed after the pool's last event on it could
  /// only be proven complete by a device-wide synchronization. While the pool holds states
  /// for at most 64 such streams (those in use, and those found destroyed whose last frees
  /// still wait), an event per 2 MiB freed (per 512 frees of 4 KiB: with eight threads each
  /// on its own raw stream the driver's event records contend, and one per 64 frees cost 150
  /// ns a pair on an H100); beyond that, an event at every free, about 200 ns. So at most 64
  /// destroyed streams' last frees, 128 MiB, ever wait for a device-wide synchronization,
  /// however many streams come and go. Read on the fast path without the pool lock.
  [[nodiscard]] std::uint64_t cover_limit() const noexcept { return cover_limit_.load(std::memory_order_relaxed); }
  [[nodiscard]] static constexpr std::uint64_t cover_limit_for(std::uint64_t unkept_streams) noexcept {
    return unkept_streams <= 64 ? 2ull << 20 : 0;
  }

  /// States in use, and states made in all (each in use or kept for reuse).
  [[nodiscard]] std::size_t in_use() const noexcept { return in_use_.size(); }
  /// States in use whose streams' handles the pool may not keep.
  [[nodiscard]] std::size_t unkept_in_use() const noexcept { return unkept_; }
  [[nodiscard]] std::size_t made() const noexcept { return store_.size(); }

  /// The stream with record id `id` is gone: its state is taken back by the next
  /// recycle_retired that finds it drained. May throw std::bad_alloc (then the state simply
  /// stays, which is always safe).
  void retire(std::uint64_t id) { retiring_.push_back(id); }
  [[nodiscard]] bool has_retiring() const noexcept { return !retiring_.empty(); }

  /// Takes back the states of retired streams for which `drained(state&)` says nothing is left
  /// (it settles them and gives back their events first). Nothing refers to such a state any
  /// more: its blocks are elsewhere, and a retired stream's id never comes back, so no thread's
  /// cache of recent states can match it. Its share of the live accounting moves to the
  /// table's folded totals, so the sums stay exact.
  template <class Drained>
  void recycle_retired(Drained&& drained) {
    std::erase_if(retiring_, [&](std::uint64_t id) {
      auto it = in_use_.find(id);
      if (it == in_use_.end()) return true;
      state& st = *it->second;
      if (!drained(st)) return false;
      // Zeroed first: a lock-free reader summing meanwhile misses the share (a peak seen
      // later) rather than counting it twice (a peak that never was).
      folded_bytes_.fetch_add(st.live_bytes.exchange(0, std::memory_order_relaxed), std::memory_order_relaxed);
      folded_count_.fetch_add(st.live_count.exchange(0, std::memory_order_relaxed), std::memory_order_relaxed);
      spare_.push_back(&st);
      count_unkept(st, false);
      st.record->set_hint(serial_, nullptr);  // the state will serve another stream
      st.record.reset();  // the last holder perhaps: the stream's record goes
      in_use_.erase(it);
      return true;
    });
  }

  // --- accounting (lock-free) ------------------------------------------------------------------

  void account_allocate(state& st, std::uint64_t size) noexcept {
    st.live_count.fetch_add(1, std::memory_order_relaxed);
    account_bytes(st, static_cast<std::int64_t>(size));
  }
  void account_bytes(state& st, std::int64_t size) noexcept {
    const auto v = st.live_bytes.fetch_add(size, std::memory_order_relaxed) + size;
    // A new peak for this stream may be a new peak for the pool: sum every stream then.
    if (v > st.peak_seen.load(std::memory_order_relaxed)) {
      st.peak_seen.store(v, std::memory_order_relaxed);
      note_used(used_now());
    }
  }
  /// An allocation that no stream's state holds (its state could not be made for lack of host
  /// memory): counted with the recycled states' shares, where a free on any stream balances it.
  void account_allocate_unheld(std::uint64_t size) noexcept {
    folded_count_.fetch_add(1, std::memory_order_relaxed);
    folded_bytes_.fetch_add(static_cast<std::int64_t>(size), std::memory_order_relaxed);
    note_used(used_now());
  }
  void account_free(state& st, std::uint64_t size) noexcept {
    st.live_bytes.fetch_sub(static_cast<std::int64_t>(size), std::memory_order_relaxed);
    st.live_count.fetch_sub(1, std::memory_order_relaxed);
  }

  /// Live bytes and allocations now, over every state (recycled ones' shares folded in).
  [[nodiscard]] std::uint64_t used_now() const noexcept {
    std::int64_t sum = folded_bytes_.load(std::memory_order_relaxed);
    for (const state* s = head_.load(std::memory_order_acquire); s != nullptr; s = s->next_made) {
      sum += s->live_bytes.load(std::memory_order_relaxed);
    }
    return static_cast<std::uint64_t>(std::max<std::int64_t>(sum, 0));
  }
  [[nodiscard]] std::uint64_t live_count_now() const noexcept {
    std::int64_t sum = folded_count_.load(std::memory_order_relaxed);
    for (const state* s = head_.load(std::memory_order_acquire); s != nullptr; s = s->next_made) {
      sum += s->live_count.load(std::memory_order_relaxed);
    }
    return static_cast<std::uint64_t>(std::max<std::int64_t>(sum, 0));
  }
  /// The most live bytes seen since the table was made or the peak reset.
  [[nodiscard]] std::uint64_t used_high() const noexcept { return used_high_.load(std::memory_order_relaxed); }
  void note_used(std::uint64_t v) noexcept {
    std::uint64_t h = used_high_.load(std::memory_order_relaxed);
    while (v > h && !used_high_.compare_exchange_weak(h, v, std::memory_order_relaxed)) {
    }
  }
  /// The peak becomes what is live now. Under the pool lock.
  void reset_high_water() noexcept {
    for (state* s = head_.load(std::memory_order_acquire); s != nullptr; s = s->next_made) {
      s->peak_seen.store(s->live_bytes.load(std::memory_order_relaxed), std::memory_order_relaxed);
    }
    used_high_.store(used_now(), std::memory_order_relaxed);
  }

 private:
  static std::atomic<std::uint64_t>& next_serial() {
    static std::atomic<std::uint64_t> s{0};
    return s;
  }

  /// A state for a stream the table does not hold: a retired stream's, emptied and reset,
  /// when there is one. So the list walked without the lock (by the accounting above) only
  /// grows when the number of streams in use at once does.
  state* make_state(stream_key s) {
    state* st = nullptr;
    if (!spare_.empty()) {
      st = spare_.back();
      spare_.pop_back();
      st->reuse(s);
    } else {
      store_.push_back(std::make_unique<state>(s));
      st = store_.back().get();
      st->next_made = head_.load(std::memory_order_relaxed);
      head_.store(st, std::memory_order_release);  // readers see it whole
    }
    // A stream streamalloc owns says so before any pool meets it (stream.hpp).
    count_unkept(*st, !s.record->handle_stable());
    return st;
  }

  /// Counts `st` among the states of streams whose handles the pool may not keep, or stops.
  void count_unkept(state& st, bool unkept) noexcept {
    if (st.counted_unkept == unkept) return;
    st.counted_unkept = unkept;
    unkept_ = unkept ? unkept_ + 1 : unkept_ - 1;
    cover_limit_.store(cover_limit_for(unkept_), std::memory_order_relaxed);
  }

  std::uint64_t serial_;
  std::unordered_map<std::uint64_t, state*> in_use_;  // the streams in use, by record id
  std::vector<std::unique_ptr<state>> store_;         // every state made, owned
  std::atomic<state*> head_{nullptr};                 // the same, for lock-free walks
  std::vector<state*> spare_;                         // retired and drained: for new streams
  std::vector<std::uint64_t> retiring_;               // retired, frees still pending
  std::size_t unkept_ = 0;                            // states with counted_unkept
  std::atomic<std::uint64_t> cover_limit_{cover_limit_for(0)};
  std::atomic<std::int64_t> folded_bytes_{0}, folded_count_{0};  // recycled states' accounting
  std::atomic<std::uint64_t> used_high_{0};
};

}  // namespace streamalloc::detail

#pragma once

// The pool core's request paths: allocate and deallocate, as every call of the pool reaches
// them. The fast path takes a block freed on the caller's stream from that stream's cache (or
// puts one there) under the stream's own lock, with no pool-wide lock and no driver call;
// whatever else a request needs goes through allocate_slow, under the pool lock, to the
// sources in pool_sources.hpp. Members of pool_core (pool_core.hpp), defined here to keep each
// file to one job; included at the end of pool_core.hpp, never on its own.

#include <streamalloc/detail/core/pool_core.hpp>

#include <cstdint>
#include <mutex>

namespace streamalloc::detail {

/// The fast path: a block freed on this stream, of n's own bin or the next, if its cache has
/// one; else the slow path.
template <pool_backend Backend>
inline std::uint64_t pool_core<Backend>::allocate(std::uint64_t bytes, stream_key s, placement where) {
  const std::uint64_t n = round_up(bytes == 0 ? 1 : bytes, free_bins::quantum);
  state& st = streams_.state_for(s, mutex_);
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
  streams_.account_allocate(st, b->size);
  st.lock.unlock();
  if (history_.ever_on()) [[unlikely]] note_allocation(b, st);
  try {
    live_.insert(b->addr, b);
  } catch (...) {  // out of host memory: back to the cache it came from
    if (history_.on()) [[unlikely]] history_.note(history_op::free, st.record->id(), b->addr, b->size);
    std::lock_guard lock(st.lock);
    streams_.account_free(st, b->size);
    set_state(b, block_state::cached);
    st.cache.insert(b);
    st.cache_bytes += b->size;
    throw;
  }
  return b->addr;
}

/// A freed block goes to its stream's cache while the cache has room, else to the stream's
/// pending bins (pool_free_blocks.hpp); a raw stream's frees are covered by an event every
/// cover_limit() bytes.
template <pool_backend Backend>
inline void pool_core<Backend>::deallocate(std::uint64_t p, stream_key s) {
  // The stream's state first: making it (the first free on a new stream) may fail for lack of
  // host memory, and must then leave the block live, as a refused free does.
  state& st = streams_.state_for(s, mutex_);
  if (exported_.load(std::memory_order_acquire)) [[unlikely]] return deallocate_exported(p, st);
  block* b = live_.erase(p);
  if (b == nullptr) [[unlikely]] {
    if (free_graph_block(p, st)) return;
    {
      std::lock_guard lock(mutex_);  // a gone graph's live block the table had no room for
      b = take_unindexed(p);
    }
    if (b == nullptr) throw std::invalid_argument(explain_bad_free(p));
  }
  const std::uint64_t stamp = st.record->stamp();
  const std::uint64_t size = b->size;
  if (history_.on()) [[unlikely]] history_.note(history_op::free, st.record->id(), p, size);
  b->stream = st.record->id();
  b->stamp = stamp;
  bool cached = false;
  {
    std::lock_guard lock(st.lock);
    streams_.account_free(st, size);
    if (st.cache.count() < max_cached_blocks && st.cache_bytes + size <= cache_limit()) {
      set_state(b, block_state::cached);
      st.cache.insert(b);
      st.cache_bytes += size;
      cached = true;
    }
  }
  if (!cached) {
    std::lock_guard lock(mutex_);
    free_pending(b, st);
  }
  // A raw or per-thread stream may be destroyed right after this call without the pool
  // hearing of it, and its handle given to another stream: only an event recorded now, while
  // the handle is in hand, can ever prove these frees complete short of a device-wide
  // synchronization. One event per stream_table::cover_limit() bytes freed bounds what a
  // destroyed stream leaves waiting (a `stream`'s last event is recorded as it is destroyed).
  if (s.native != nullptr && !st.record->handle_stable()) {
    if (st.uncovered_bytes.fetch_add(size, std::memory_order_relaxed) + size > streams_.cover_limit()) {
      // The free is made: an error now (out of host memory, or the driver refusing the event)
      // would tell the caller it was not, and a retry would be a double free. Without the
      // event the bytes stay uncovered, and the next free tries again; a stream destroyed
      // meanwhile leaves them to a device-wide synchronization.
      try {
        const capture_guard relaxed(backend_);
        std::lock_guard lock(mutex_);
        completion_.record_on(st, s);
      } catch (...) {
      }
    }
  }
}

/// The slow path: the stream's cache flushed into its pending bins, one event on a raw stream,
/// then the first source with a block (find_memory).
template <pool_backend Backend>
std::uint64_t pool_core<Backend>::allocate_slow(std::uint64_t n, state& st, stream_key s, placement where) {
  const capture_guard relaxed(backend_);
  std::unique_lock lock(mutex_);
  if (streams_.has_retiring()) recycle_retired();
  if (unindexed_ != nullptr) [[unlikely]] reindex_unindexed();
  flush_cache(st, clear_neighbours::absorb);
  if (!st.record->handle_stable()) completion_.cover(st, s);  // at most one event per slow call
  block* b = find_memory(n, st, s, where, options_.reuse.internal_dependencies);
  live_.prefetch(b->addr);
  take(b, n);
  set_state(b, block_state::live);
  streams_.account_allocate(st, b->size);
  if (history_.ever_on()) [[unlikely]] note_allocation(b, st);
  try {
    live_.insert(b->addr, b);
  } catch (...) {  // out of host memory: freed on `st` again, though nothing used it
    if (history_.on()) [[unlikely]] history_.note(history_op::free, st.record->id(), b->addr, b->size);
    streams_.account_free(st, b->size);
    b->stream = st.record->id();
    b->stamp = st.record->stamp();
    free_pending(b, st);
    throw;
  }
  return b->addr;
}

}  // namespace streamalloc::detail

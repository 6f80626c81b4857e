#pragma once

// The pool core's free blocks on their way back: a freed block goes to its stream's fast cache,
// from there into the stream's pending bins (coalesced with its free neighbours), and into the
// clear bins once its free is known complete; a request takes its bytes from the front of one.
// Members of pool_core (pool_core.hpp), defined here to keep each file to one job; included at
// the end of pool_core.hpp, never on its own.

#include <streamalloc/detail/core/pool_core.hpp>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <vector>

namespace streamalloc::detail {

template <pool_backend Backend>
void pool_core<Backend>::take(block* b, std::uint64_t n) {
  free_bins* bins = b->bins;
  bins->remove(b);
  if (b->size - n >= free_bins::quantum) {
    block* rest = nullptr;
    try {
      rest = split(b, n);
    } catch (...) {  // out of host memory: the block stays free, whole
      bins->insert(b);
      throw;
    }
    rest->stream = b->stream;
    rest->stamp = b->stamp;
    rest->state = b->state;
    bins->insert(rest);
  }
}

template <pool_backend Backend>
void pool_core<Backend>::flush_cache(state& st, clear_neighbours clear) {
  // One block at a time, in the cache's order (smallest first): a cached neighbour of the block
  // moving is merged with nothing until its own turn, as when the cache was emptied at once,
  // and the move needs no host memory (nearly every slow request flushes, most with a block or
  // two, which a list of them allocated and freed each time).
  for (;;) {
    block* b = nullptr;
    {
      std::lock_guard lock(st.lock);
      b = st.cache.first();
      if (b == nullptr) return;
      st.cache.remove(b);
      st.cache_bytes -= b->size;
    }
    free_pending(b, st, /*for_use=*/false, clear);
  }
}

template <pool_backend Backend>
block* pool_core<Backend>::free_pending(block* b, state& st, bool for_use, clear_neighbours clear) {
  st.newest_stamp = std::max(st.newest_stamp, b->stamp);
  set_state(b, block_state::pending);
  // Clear neighbours are absorbed only for a stream whose handle the pool keeps, which it can
  // ask when it needs the memory. A raw or per-thread stream is often destroyed right after
  // its last free: absorbed memory (the rest of a chunk, often) would wait for an event on it
  // (on the H100, raw streams each freeing 8 MiB behind a kernel grew the pool by a 64 MiB
  // chunk every two streams), or, uncovered, for a device-wide synchronization.
  // (`for_use`: the merged run is about to be allocated by the stream, and waits for nothing.)
  // Nor for a cached free flushed by a trim, a snapshot or a retirement (`clear` is leave):
  // the pool asks a `stream` whether it is idle only during its own calls, so clear memory
  // absorbed into a busy stream's free then would wait for an event on it, and a trim would
  // not release it (a 4 KiB free beside clear chunks kept all of them from trim_to(0)). Left
  // apart, the block merges with them once its own free is known complete (make_clear).
  // Another stream's request flushes with absorb (see find_memory).
  const bool absorb = for_use || (clear == clear_neighbours::absorb && st.record->handle_stable());
  // Of such a stream, a pending neighbour whose free an event already covers stays a block of
  // its own: merged, it would take this free's newer stamp, and other streams, defragmentation
  // and release could use it only once this free is known complete too. A host running ahead
  // of its GPU frees on and on, and its stream's pending memory would merge into blocks never
  // known complete while the next step needs it (the mixture of experts' side stream grew the
  // pool every step; docs/deep-learning.md). The stream itself still uses them: join_adjacent
  // joins a run when a request needs one. A raw stream's events are learned only during its
  // own calls, so its frees keep merging (kept apart, its blocks fragment: 1.27 instead of
  // 1.09 on the MoE steps trace).
  const std::uint64_t kept_apart = !for_use && st.record->handle_stable() ? st.last_event_epoch : 0;
  b = merge_neighbours(b, &st.pending, absorb ? &clear_ : nullptr, kept_apart);
  b->stream = st.record->id();
  set_state(b, block_state::pending);  // the survivor may have been a clear neighbour
  st.pending_floor = st.pending.empty() ? b->stamp : std::min(st.pending_floor, b->stamp);
  st.pending.insert(b);
  return b;
}

template <pool_backend Backend>
block* pool_core<Backend>::merge_neighbours(block* b, free_bins* bins, free_bins* also, std::uint64_t kept_apart) {
  // The state is read first: a cached or live neighbour may change concurrently (the fast
  // path), but never into pending or clear, which only happens under the pool lock.
  auto mergeable = [&](block* x) {
    if (x == nullptr) return false;
    const block_state s = state_of(x);
    if (kept_apart != 0 && s == block_state::pending && x->bins == bins && x->stamp <= kept_apart) return false;
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

template <pool_backend Backend>
void pool_core<Backend>::settle(state& st, bool query_events, const stream_key& caller) {
  std::vector<block*> ready;
  completion_.settle(st, query_events, caller, ready);
  // Merging may absorb a later block of `ready` into an earlier one's neighbour chain only
  // once that later block is clear, i.e. after its own turn here, so none is used recycled.
  for (block* b : ready) make_clear(b);
  unmap_aliases(st);
}

template <pool_backend Backend>
void pool_core<Backend>::make_clear(block* b) {
  set_state(b, block_state::clear);
  b->stream = 0;
  b->stamp = 0;
  b = merge_neighbours(b, &clear_);
  clear_.insert(b);
}

template <pool_backend Backend>
void pool_core<Backend>::settle_all(bool query_events, const stream_key& caller) {
  streams_.for_each([&](state& st) { settle(st, query_events, caller); });
  if (streams_.has_retiring()) recycle_retired();
}

template <pool_backend Backend>
void pool_core<Backend>::settle_everything(bool query_events, const stream_key& caller, clear_neighbours clear) {
  streams_.for_each([&](state& st) { flush_cache(st, clear); });
  completion_.begin_look();
  settle_all(query_events, caller);
}

}  // namespace streamalloc::detail

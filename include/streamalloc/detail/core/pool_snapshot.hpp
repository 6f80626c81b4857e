#pragma once

// The pool core's snapshot: what a pool holds at one moment, for pool::snapshot (which turns it
// into JSON, detail/pool/snapshot_json.hpp). Member of pool_core (pool_core.hpp), defined here
// to keep each file to one job; included at the end of pool_core.hpp, never on its own.
//
// Taken under the pool lock, after every stream's cache of recent frees is flushed into its
// pending bins (as the pool's slow paths do: it changes no block's reusability), so that every
// free block is in bins the pool lock guards and the walk sees one consistent state. Live
// blocks may be freed on the fast path meanwhile (into an emptied cache); the snapshot then
// shows them live, as they were when it began.

#include <streamalloc/detail/core/pool_core.hpp>

#include <mutex>
#include <vector>

namespace streamalloc::detail {

template <pool_backend Backend>
core_snapshot pool_core<Backend>::snapshot() {
  core_snapshot s;
  s.history = history_.read();
  const capture_guard relaxed(backend_);
  std::lock_guard lock(mutex_);
  s.now = static_cast<std::uint64_t>(pool_history::now_ns());
  streams_.for_each([&](state& st) { flush_cache(st, clear_neighbours::leave); });
  s.reservations = space_.reservations();
  for (const auto& [va, c] : space_.chunks()) s.chunks.emplace_back(va, c.size);
  s.granularity = space_.granularity();
  s.chunk_size = options_.chunk_size;
  s.max_size = options_.max_size;
  s.largest_free = clear_.largest();
  for (const auto& [start, end] : chain_.runs()) {
    for (block* b = chain_.starting_at(start); b != nullptr; b = b->next_addr) {
      core_snapshot::block_view v;
      v.address = b->addr;
      v.bytes = b->size;
      v.state = state_of(b);
      if (v.state == block_state::pending || v.state == block_state::imported ||
          (v.state == block_state::graph && b->use == graph_use::freed_after)) {
        v.stream = b->stream;  // the stream whose free it waits on
        v.stamp = b->stamp;
      }
      if (v.state == block_state::graph) v.use = b->use;
      if (v.state == block_state::live) v.since = since_of(b);
      s.blocks.push_back(v);
    }
  }
  streams_.for_each([&](state& st) {
    core_snapshot::stream_view v;
    v.id = st.record->id();
    v.handle = reinterpret_cast<std::uint64_t>(st.native);
    v.device = st.record->device();
    v.live_bytes = st.live_bytes.load(std::memory_order_relaxed);
    v.live_allocations = st.live_count.load(std::memory_order_relaxed);
    v.pending_bytes = st.pending.bytes();
    v.held_frees = st.held_frees;
    v.newest_free_stamp = st.newest_stamp;
    v.completed_stamp = st.record->completed();
    v.events_in_flight = st.events.size();
    s.streams.push_back(v);
  });
  s.graphs = graphs_.segments();
  s.graph_blocks = graphs_.blocks();
  return s;
}

}  // namespace streamalloc::detail

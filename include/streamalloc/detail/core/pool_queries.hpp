#pragma once

// The pool core's queries and words: its statistics, its state in words for out_of_memory, and
// why a free was refused. Members of pool_core (pool_core.hpp), defined here to keep each file
// to one job; included at the end of pool_core.hpp, never on its own.

#include <streamalloc/detail/core/pool_core.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace streamalloc::detail {

template <pool_backend Backend>
pool_statistics pool_core<Backend>::statistics() {
  std::lock_guard lock(mutex_);
  pool_statistics s;
  s.reserved_current = space_.held();
  s.reserved_high = space_.held_high();
  s.used_current = streams_.used_now();
  streams_.note_used(s.used_current);
  s.used_high = streams_.used_high();
  s.live_allocations = streams_.live_count_now();
  s.free_clear = clear_.bytes();
  s.largest_free_block = clear_.largest();
  streams_.for_each([&](state& st) {
    std::lock_guard sl(st.lock);
    s.free_pending += st.pending.bytes() + st.cache_bytes;
    s.largest_free_block = std::max({s.largest_free_block, st.pending.largest(), st.cache.largest()});
  });
  for (const auto& [b, since] : awaiting_device_idle_) s.free_pending += b->size;  // awaiting proof too
  for (const block* b = awaiting_unlisted_; b != nullptr; b = b->next_free) s.free_pending += b->size;
  s.free_pending += imported_held_;  // awaiting other processes' releases
  s.chunks = space_.chunks().size();
  s.remapped_chunks = space_.remapped();
  s.grows = space_.grows();
  s.graph_reserved_current = graphs_.bytes();
  s.graph_reserved_high = graphs_.high();
  s.graph_allocations = graphs_.blocks();
  s.graphs = graphs_.segments();
  return s;
}

/// The pool's state in words, for out_of_memory: what it holds, what is live, what is free
/// now and the largest such block, and the frees still waiting on their streams, the
/// largest few named by stream (an allocation on one of those streams, or on a stream
/// ordered after them, or a synchronization, makes them usable).
template <pool_backend Backend>
std::string pool_core<Backend>::describe_state() {
  std::uint64_t pending = 0;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> by_stream;  // (bytes, stream id)
  streams_.for_each([&](state& st) {
    std::lock_guard sl(st.lock);  // a fast-path free may refill the cache meanwhile
    const std::uint64_t b = st.pending.bytes() + st.cache_bytes;
    pending += b;
    if (b != 0) by_stream.emplace_back(b, st.record->id());
  });
  std::string m = "reserved " + std::to_string(space_.held()) + " bytes";
  if (options_.max_size != 0) m += " of at most " + std::to_string(options_.max_size) + " (max_size)";
  m += ", live " + std::to_string(streams_.used_now()) + ", free " + std::to_string(clear_.bytes()) +
       " (largest block " + std::to_string(clear_.largest()) + "), freed but awaiting stream order " +
       std::to_string(pending);
  if (!by_stream.empty()) {
    std::sort(by_stream.begin(), by_stream.end(), std::greater<>());
    m += " (";
    for (std::size_t i = 0; i < by_stream.size() && i < 4; ++i) {
      m += (i == 0 ? "" : ", ") + std::to_string(by_stream[i].first) + " on stream " + std::to_string(by_stream[i].second);
    }
    if (by_stream.size() > 4) m += ", and " + std::to_string(by_stream.size() - 4) + " more streams";
    m += ")";
  }
  // Addresses a pool with a small address_space may run short of: the old places of chunks a
  // stream's frees moved from, kept mapped until those frees have run.
  std::uint64_t aliased = 0;
  for (const auto& a : space_.aliases()) aliased += a.size;
  if (aliased != 0) {
    m += ", " + std::to_string(aliased) + " bytes of addresses held by chunks moved before the frees in them ran";
  }
  if (const std::uint64_t dropped = space_.free_addresses().dropped(); dropped != 0) {
    m += ", " + std::to_string(dropped) + " bytes of addresses left unused when the host had no memory to give them back";
  }
  return m;
}

template <pool_backend Backend>
std::string pool_core<Backend>::explain_bad_free(std::uint64_t p, const char* what) {
  const std::string who = pointer_subject(p, what);
  if (!owns(p)) return who + " was not allocated from this pool";
  std::lock_guard lock(mutex_);
  if (block* b = chain_.at_or_before(p)) {
    if (p < b->addr + b->size) {
      const block_state bs = state_of(b);
      if (bs == block_state::live || (bs == block_state::graph && b->addr != p)) {
        return who + " points inside an allocation, not at its start";
      }
      if (b->addr == p) {
        return who + " is already free (double free)";
      }
    }
  }
  return who +
         " is not a live allocation of this pool (freed already, or never returned by allocate)";
}

}  // namespace streamalloc::detail

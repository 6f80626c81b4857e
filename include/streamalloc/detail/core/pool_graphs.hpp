#pragma once

// The pool core's graphs section: allocations and frees captured into graphs, host-time frees
// of graph memory, and taking a graph's memory back when it is gone. What a graph holds and
// why is told in graph_segments.hpp. Included at the end of pool_core.hpp.

#include <streamalloc/detail/core/pool_core.hpp>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace streamalloc::detail {

template <pool_backend Backend>
template <class Tie>
graph_segment& pool_core<Backend>::segment_for(std::uint64_t capture, Tie& tie) {
  if (graph_segment* seg = graphs_.find(capture)) return *seg;
  graph_segment& made = graphs_.add(capture);
  try {
    tie();
  } catch (...) {
    (void)graphs_.take(capture);  // empty: holds nothing yet
    throw;
  }
  return made;
}

template <pool_backend Backend>
template <class After, class Tie>
std::uint64_t pool_core<Backend>::allocate_for_graph(std::uint64_t bytes, std::uint64_t capture, std::uint64_t peers,
                                                     After&& after, Tie&& tie) {
  const std::uint64_t n = round_up(bytes == 0 ? 1 : bytes, free_bins::quantum);
  const capture_guard relaxed(backend_);
  std::lock_guard lock(mutex_);
  graph_segment* seg = &segment_for(capture, tie);
  // Peers go to all of the graph's memory: any block of it may serve any of its allocations
  // (reuse below, spare blocks), and a piece is one mapping's worth at least. More access
  // than asked for, which the driver's graph memory may have too (spec 003).
  if ((peers & ~seg->peers) != 0) grant_graph_peers(*seg, peers);
  if (block* again = seg->reuse(after, n)) {
    again->use = graph_use::live;
    ++seg->live;
    return again->addr;
  }
  // Memory of the graph's own (pool_graph_memory.hpp): no host-time allocation ever gets it
  // while the graph lives, and no pending free is under it (the graph's launches are not
  // ordered after any). The segment stays when nothing is found: its graph still releases it.
  seg->spare.reserve(seg->spare.size() + 1);  // for the block's return below, if it must
  block* b = graph_memory_for(*seg, n);
  try {
    graphs_.hold(*seg, b);
  } catch (...) {
    seg->spare.push_back(b);  // room: reserved above, or by the piece graph_memory_for added
    throw;
  }
  b->use = graph_use::live;
  ++seg->live;
  return b->addr;
}

template <pool_backend Backend>
template <class Tie>
void pool_core<Backend>::deallocate_captured(std::uint64_t p, std::uint64_t capture, std::uint64_t s,
                                             stream_key host, const stream_key* freer, Tie&& tie) {
  // The capturing stream's state when its record is known (for memory allocated outside the
  // capture: see the adoption below); else the host's, for the live accounting (any will do).
  const bool known_freer = freer != nullptr;
  state& st = streams_.state_for(known_freer ? *freer : host, mutex_);
  const capture_guard relaxed(backend_);
  std::string refused;
  {
    std::lock_guard lock(mutex_);
    if (block* g = graphs_.at(p)) {
      graph_segment& owner = graph_segments::owner_of(g);
      if (owner.capture != capture) {
        refused = " was allocated in the capture of another graph; a free inside a capture may only free memory "
                  "of that capture or memory allocated outside any capture (free it outside, after the launches "
                  "that use it)";
      } else if (g->use != graph_use::live) {
        refused = " was already freed in this capture (double free)";
      } else {
        owner.freed.emplace_back(s, g);
        g->use = graph_use::freed;
        --owner.live;
        return;
      }
    } else if (const block* held = live_.find(p); held != nullptr && held->imports != 0) {
      refused = " is imported by another process: a graph may not take over its free (the importer's release "
                "would race the graph's launches); free it outside the capture";
    } else if (block* b = live_.erase(p)) {
      // Memory of the host's timeline, freed by the graph: a launch frees it. Work enqueued on
      // the capturing stream before the capture began may use it (the graph's launches are not
      // ordered after that work); if no launch ever runs, the pool takes it back in that
      // stream's order, so the free is stamped with the stream's clock as a free made now
      // would be (the pool records nothing on the stream before the capture ends). When the
      // stream's record is not known (a raw handle: CUDA does not identify a capturing
      // stream), only a device-wide synchronization proves that work done (release_graph).
      try {
        graphs_.hold(segment_for(capture, tie), b);
      } catch (...) {
        live_.restore(p, b);
        throw;
      }
      streams_.account_free(st, b->size);
      graphs_.note_held(b->size);
      set_state(b, block_state::graph);
      b->use = graph_use::adopted;
      if (known_freer) {
        hold_free(b, st);
      } else {
        b->stream = 0;
      }
      return;
    }
  }
  if (refused.empty()) throw std::invalid_argument(explain_bad_free(p));
  throw std::invalid_argument(pointer_subject(p, "deallocate") + refused);
}

template <pool_backend Backend>
bool pool_core<Backend>::free_graph_block(std::uint64_t p, state& st) {
  std::unique_lock lock(mutex_);
  block* g = graphs_.at(p);
  if (g == nullptr) return false;
  if (g->use == graph_use::freed || g->use == graph_use::adopted) {
    lock.unlock();
    throw std::invalid_argument(pointer_subject(p, "deallocate") +
                                " was freed inside the captured graph that holds it: after a launch it is not an "
                                "allocation any more (double free)");
  }
  // Live after a launch; freed now, on this stream. The graph keeps the block (its next launch
  // allocates it again, at the same address); this free orders its return when the graph goes.
  // Freed already: launches made with a raw cudaGraphLaunch are not seen, so this may be the
  // free after another launch; the newer free orders the return.
  graph_segment& owner = graph_segments::owner_of(g);
  if (g->use == graph_use::freed_after) {
    (void)drop_held_free(g);
  } else {
    --owner.live;
    ++owner.freed_after;
  }
  g->use = graph_use::freed_after;
  hold_free(g, st);
  return true;
}

template <pool_backend Backend>
void pool_core<Backend>::hold_free(block* b, state& st) noexcept {
  b->stream = st.record->id();
  b->stamp = st.record->stamp();
  st.newest_stamp = std::max(st.newest_stamp, b->stamp);
  ++st.held_frees;
}

template <pool_backend Backend>
auto pool_core<Backend>::drop_held_free(block* b) noexcept -> state* {
  state* st = b->stream != 0 ? streams_.find(b->stream) : nullptr;
  if (st != nullptr) --st->held_frees;  // found: held_frees kept it in the table
  return st;
}

template <pool_backend Backend>
std::string pool_core<Backend>::graph_launch_refusal(std::uint64_t capture, bool auto_free) {
  std::lock_guard lock(mutex_);
  const graph_segment* seg = graphs_.find(capture);
  if (seg == nullptr) return {};
  if (seg->launched && !auto_free && seg->live != 0) {
    // The driver refuses this too: the launch would make at the same address an allocation
    // that still holds the last launch's results, which work after that launch may still read.
    std::size_t unfreed = 0;
    std::uint64_t first = 0;
    for (const block* b : seg->blocks) {
      if (b->use != graph_use::live) continue;
      if (unfreed++ == 0 || b->addr < first) first = b->addr;
    }
    if (unfreed != 0) {
      return std::to_string(unfreed) + " allocation(s) the graph made and did not free (the lowest at " +
             hex(first) + ") are still live since its last launch: free them after the launch (a stream-ordered "
             "deallocate on a stream ordered after it), or instantiate with cudaGraphInstantiateFlagAutoFreeOnLaunch";
    }
  }
  return {};
}

template <pool_backend Backend>
std::uint64_t pool_core<Backend>::graph_block_size(std::uint64_t capture, std::uint64_t p) {
  std::lock_guard lock(mutex_);
  block* b = graphs_.at(p);
  if (b == nullptr || graph_segments::owner_of(b).capture != capture) return 0;
  return b->use == graph_use::adopted ? 0 : b->size;  // spare blocks are never in the index
}

template <pool_backend Backend>
std::vector<std::pair<std::uint64_t, std::uint64_t>> pool_core<Backend>::graph_unfreed(std::uint64_t capture) {
  std::vector<std::pair<std::uint64_t, std::uint64_t>> out;
  std::lock_guard lock(mutex_);
  const graph_segment* seg = graphs_.find(capture);
  if (seg == nullptr) return out;
  out.reserve(seg->live + seg->freed_after);
  for (const block* b : seg->blocks) {
    if (b->use == graph_use::live || b->use == graph_use::freed_after) out.emplace_back(b->addr, b->size);
  }
  std::sort(out.begin(), out.end());
  return out;
}

template <pool_backend Backend>
void pool_core<Backend>::graph_launched(std::uint64_t capture) noexcept {
  std::lock_guard lock(mutex_);
  graph_segment* seg = graphs_.find(capture);
  if (seg == nullptr) return;
  if (seg->freed_after != 0) {
    for (block* b : seg->blocks) {
      if (b->use != graph_use::freed_after) continue;
      (void)drop_held_free(b);  // the launch makes it again: that free is void
      b->use = graph_use::live;
    }
    seg->live += seg->freed_after;
    seg->freed_after = 0;
  }
  seg->launched = true;
}

template <pool_backend Backend>
void pool_core<Backend>::release_graph(std::uint64_t capture, stream_key host) noexcept {
  state* hst = nullptr;
  try {
    hst = &streams_.state_for(host, mutex_);
  } catch (...) {  // out of host memory: the blocks that stay live are counted without a state
  }
  const capture_guard relaxed(backend_);
  std::lock_guard lock(mutex_);
  if (unindexed_ != nullptr) [[unlikely]] reindex_unindexed();
  const std::unique_ptr<graph_segment> seg = graphs_.take(capture);
  if (seg == nullptr) return;
  // Merging below may absorb a block of this segment handled earlier into a later one's
  // neighbour, never one still to come: those are in state graph until their turn.
  const bool shared = seg->bound_to != 0 || seg->lost;  // pieces on a stream's pages, or on none
  for (block* b : seg->blocks) {
    if (b->use == graph_use::adopted) graphs_.note_released(b->size);
    if (shared && b->use != graph_use::adopted) continue;  // on shared pages: dropped below
    b->owner = nullptr;
    if (b->use == graph_use::live) {
      // Valid after the last launch and never freed: an ordinary live allocation from now on,
      // as the driver's graph allocations outlive their graph.
      set_state(b, block_state::live);
      try {
        live_.insert(b->addr, b);
      } catch (...) {  // out of host memory: listed apart, where deallocate finds it
        b->next_free = unindexed_;
        unindexed_ = b;
      }
      if (hst != nullptr) streams_.account_allocate(*hst, b->size);
      else streams_.account_allocate_unheld(b->size);
      continue;
    }
    if (b->use == graph_use::adopted && seg->launched) {
      // A launch freed it and has finished: by the free's contract, every use is ordered
      // before it.
      (void)drop_held_free(b);
      make_clear(b);
      continue;
    }
    if (b->use == graph_use::freed_after || b->use == graph_use::adopted) {
      if (state* freer = drop_held_free(b)) {
        free_pending(b, *freer);  // in that stream's order, with the stamp of its free
        continue;
      }
      // An adoption on a stream the pool could not identify: until a device-wide
      // synchronization, work enqueued before the capture may still use it.
      await_device_idle(b);
      continue;
    }
    make_clear(b);
  }
  // The graph's own memory: shared pages are the stream's, the pieces leave the pool; pieces
  // with their own memory become the pool's free memory (what the graph left live stays live).
  forget_graph_peers(*seg);
  if (shared) {
    drop_shared_pieces(*seg);
  } else {
    graphs_.note_released(seg->piece_bytes);
    for (block* b : seg->spare) {
      b->owner = nullptr;
      make_clear(b);
    }
  }
  if (streams_.has_retiring()) {
    try {
      recycle_retired();  // a retired stream's state may have been kept for this graph's frees
    } catch (...) {
    }
  }
}

template <pool_backend Backend>
void pool_core<Backend>::clear_after_device_idle() noexcept {
  const std::uint64_t done = ordering().device_syncs_done(options_.device);
  std::erase_if(awaiting_device_idle_, [&](const std::pair<block*, std::uint64_t>& a) {
    if (done <= a.second) return false;
    make_clear(a.first);
    return true;
  });
  unlink_where(awaiting_unlisted_, [&](block* b) {
    if (done <= b->stamp) return false;
    b->stamp = 0;
    make_clear(b);
    return true;
  });
}

template <pool_backend Backend>
void pool_core<Backend>::await_device_idle(block* b) noexcept {
  const std::uint64_t since = ordering().device_syncs_begun(options_.device);
  try {
    awaiting_device_idle_.emplace_back(b, since);
  } catch (...) {  // out of host memory: listed through the block itself
    b->stamp = since;
    b->next_free = awaiting_unlisted_;
    awaiting_unlisted_ = b;
  }
}

template <pool_backend Backend>
void pool_core<Backend>::reindex_unindexed() noexcept {
  unlink_where(unindexed_, [&](block* b) {
    try {
      live_.insert(b->addr, b);
      return true;
    } catch (...) {  // still no host memory: left for the next look
      return false;
    }
  });
}

template <pool_backend Backend>
block* pool_core<Backend>::take_unindexed(std::uint64_t p) noexcept {
  block* found = nullptr;
  unlink_where(unindexed_, [&](block* b) {
    if (b->addr != p) return false;
    found = b;
    return true;
  });
  return found;
}

}  // namespace streamalloc::detail

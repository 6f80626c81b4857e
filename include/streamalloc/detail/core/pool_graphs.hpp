#pragma once

// The pool core's graphs section: allocations and frees captured into graphs, host-time frees
// of graph memory, and taking a graph's memory back when it is gone. What a graph holds and
// why is told in graph_segments.hpp. Included at the end of pool_core.hpp.

#include <streamalloc/detail/core/pool_core.hpp>

#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

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
template <class Tie>
std::uint64_t pool_core<Backend>::allocate_captured(std::uint64_t bytes, std::uint64_t capture, std::uint64_t s,
                                                    stream_key host, placement where, Tie&& tie) {
  const std::uint64_t n = round_up(bytes == 0 ? 1 : bytes, free_bins::quantum);
  state& hst = streams_.state_for(host, mutex_);
  const capture_guard relaxed(backend_);
  std::lock_guard lock(mutex_);
  graph_segment* seg = &segment_for(capture, tie);
  if (block* again = seg->reuse(s, n)) {
    again->use = graph_use::live;
    return again->addr;
  }
  // Memory no work may still be using, now or at any later launch: clear blocks, the host
  // pseudo-stream's (complete when freed), others' frees known complete, or new memory. Never
  // a pending free: the graph's launches are not ordered after it. The segment stays when
  // nothing is found: its graph still releases it.
  flush_cache(hst);
  block* b = find_memory(n, hst, host, where, /*may_wait=*/false);
  take(b, n);
  try {
    graphs_.hold(*seg, b);
  } catch (...) {
    make_clear(b);  // every source above is memory no work uses
    throw;
  }
  set_state(b, block_state::graph);
  b->use = graph_use::live;
  return b->addr;
}

template <pool_backend Backend>
template <class Tie>
void pool_core<Backend>::deallocate_captured(std::uint64_t p, std::uint64_t capture, std::uint64_t s,
                                             stream_key host, Tie&& tie) {
  state& st = streams_.state_for(host, mutex_);  // the live accounting's: any state will do
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
        return;
      }
    } else if (block* b = live_.erase(p)) {
      // Memory of the host's timeline, freed by the graph: the graph's launches free it.
      try {
        graphs_.hold(segment_for(capture, tie), b);
      } catch (...) {
        live_.insert(p, b);
        throw;
      }
      streams_.account_free(st, b->size);
      set_state(b, block_state::graph);
      b->use = graph_use::adopted;
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
  g->use = graph_use::freed_after;
  g->stream = st.record->id();
  g->stamp = st.record->stamp();
  return true;
}

template <pool_backend Backend>
bool pool_core<Backend>::graph_adopted_memory(std::uint64_t capture) {
  std::lock_guard lock(mutex_);
  const graph_segment* seg = graphs_.find(capture);
  if (seg == nullptr) return false;
  for (const block* b : seg->blocks) {
    if (b->use == graph_use::adopted) return true;
  }
  return false;
}

template <pool_backend Backend>
std::string pool_core<Backend>::graph_launching(std::uint64_t capture, bool auto_free) {
  std::lock_guard lock(mutex_);
  graph_segment* seg = graphs_.find(capture);
  if (seg == nullptr) return {};
  if (seg->launched && !auto_free) {
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
  for (block* b : seg->blocks) {
    if (b->use == graph_use::freed_after) b->use = graph_use::live;
  }
  seg->launched = true;
  return {};
}

template <pool_backend Backend>
void pool_core<Backend>::release_graph(std::uint64_t capture, stream_key host) noexcept {
  state* hst = nullptr;
  try {
    hst = &streams_.state_for(host, mutex_);
  } catch (...) {  // out of host memory: the blocks that stay live are not accounted
  }
  const capture_guard relaxed(backend_);
  std::lock_guard lock(mutex_);
  const std::unique_ptr<graph_segment> seg = graphs_.take(capture);
  if (seg == nullptr) return;
  // Merging below may absorb a block of this segment handled earlier into a later one's
  // neighbour, never one still to come: those are in state graph until their turn.
  for (block* b : seg->blocks) {
    b->owner = nullptr;
    if (b->use == graph_use::live) {
      // Valid after the last launch and never freed: an ordinary live allocation from now on,
      // as the driver's graph allocations outlive their graph.
      set_state(b, block_state::live);
      try {
        live_.insert(b->addr, b);
      } catch (...) {
        continue;  // out of host memory: unreachable, held until the pool closes
      }
      if (hst != nullptr) streams_.account_allocate(*hst, b->size);
      continue;
    }
    if (b->use == graph_use::freed_after) {
      if (state* freer = streams_.find(b->stream)) {
        free_pending(b, *freer);  // in that stream's order, with the stamp of its free
        continue;
      }
      // Its stream's state went back to the table: only once all its frees were complete.
    }
    make_clear(b);
  }
}

}  // namespace streamalloc::detail

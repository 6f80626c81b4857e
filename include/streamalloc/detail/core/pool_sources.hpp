#pragma once

// The pool core's sources section: where a request that the stream's fast cache cannot serve
// is served from, in order (free blocks the stream may use, completions learned now, adjacent
// free blocks joined, whole free chunks remapped, those chunks remapped next to new memory for
// the rest, growth, waiting on another stream's frees).
// Included at the end of pool_core.hpp.

#include <streamalloc/detail/core/pool_core.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>

namespace streamalloc::detail {

/// A free block of at least `n` bytes that `st` may use, still in its bins, from the first
/// source that has one. Throws core_out_of_memory when none has.
/// `may_wait`: waiting on another stream's frees (internal dependencies) is a source.
template <pool_backend Backend>
block* pool_core<Backend>::find_memory(std::uint64_t n, state& st, stream_key s, placement where, bool may_wait) {
  block* b = find_usable(n, st);
  if (b == nullptr) {
    // Others' cached frees, and whatever completed since we last looked.
    // Including this stream's own pending frees: once known complete they may be remapped.
    // Others' cached frees absorb clear neighbours as their own frees would: measured on the
    // CPU model, leaving them apart here held more on the mixture of experts with a device
    // behind the host (1.074 to 1.129 at a lag of 300 operations, streams as PyTorch's).
    settle_everything(options_.reuse.opportunistic, s, clear_neighbours::absorb);
    b = find_usable(n, st);
  }
  if (b == nullptr) b = join_adjacent(n, st);
  if (b == nullptr) poll_fresh_covers(&st, [&] { return (b = find_usable(n, st)) != nullptr; });
  if (b == nullptr) b = defragment(n, st);
  if (b == nullptr) b = defragment_and_grow(n, st);
  if (b == nullptr) b = grow(n, st, where);
  if (b == nullptr && may_wait) b = wait_for_pending(n, st, s);
  if (b == nullptr) {
    // Every source has been tried: free blocks usable now, completions learned just now,
    // adjacent runs, remapping (alone or with growth), growth, and (if allowed) waiting on other
    // streams' frees.
    // What remains free is pending on streams this one has no proof of.
    core_out_of_memory e;
    e.requested = n;
    e.reason = describe_state();
    throw e;
  }
  return b;
}

/// Internal dependencies: `s` waits for another stream's frees, so their blocks become usable.
/// Tries streams in turn; each costs an event record and a stream wait.
template <pool_backend Backend>
block* pool_core<Backend>::wait_for_pending(std::uint64_t n, state& st, stream_key s) {
  block* found = nullptr;
  streams_.any_of([&](state& other) {
    if (&other == &st || other.pending.empty() || other.pending.largest() < n) return false;
    const std::uint64_t limit = completion_.latest_cover(other);
    if (limit == 0) return false;
    found = other.pending.find(n, [limit](block* x) { return x->stamp <= limit; });
    if (found == nullptr) return false;
    completion_.wait_for_latest(st, s, other, limit);
    return true;
  });
  return found;
}

/// Another thread's `stream` is not asked whether it is idle (that would invalidate a capture
/// begun on it meanwhile: completion.hpp); its frees are covered by an event instead, which an
/// idle stream passes a few microseconds later. Where the alternative costs more (growing the
/// pool or moving chunks, some 50 us a handle; failing to grow in place; trimming less), poll
/// those events for at most `fresh_cover_poll`, settling each that completes, until `enough()`
/// says so: an idle stream's memory is then there as its idle answer made it. A busy stream
/// costs the caller that much more. Streams other than `skip` covered in the current look only.
template <pool_backend Backend>
template <class Enough>
void pool_core<Backend>::poll_fresh_covers(const state* skip, Enough&& enough) {
  const std::uint64_t look = completion_.current_look();
  const auto until = std::chrono::steady_clock::now() + fresh_cover_poll;
  for (;;) {
    bool settled = false, waiting = false;
    streams_.for_each([&](state& other) {
      if (&other == skip || other.covered_in_look != look) return;
      const std::uint64_t before = other.record->completed();
      completion_.reap(other);
      if (other.record->completed() > before) {
        settle(other, /*query_events=*/false, stream_key{});
        settled = true;
      }
      // Until its newest event (the one this look recorded) has passed.
      if (!other.events.empty()) waiting = true;
    });
    // `enough` may call the driver (growth in place): only when something new is free.
    if (settled && enough()) return;
    if (!waiting || std::chrono::steady_clock::now() >= until) return;
  }
}

/// Best fit among the blocks `st` may use: clear ones, its own, and others' it is ordered
/// after.
template <pool_backend Backend>
block* pool_core<Backend>::find_usable(std::uint64_t n, state& st) {
  block* best = clear_.find(n, [](block*) { return true; });
  if (block* mine = st.pending.find(n, [](block*) { return true; })) {
    if (best == nullptr || mine->size < best->size) best = mine;
  }
  if (options_.reuse.follow_event_dependencies) {
    streams_.for_each([&](state& other) {
      if (&other == &st || other.pending.empty()) return;
      const std::uint64_t after = st.record->ordered_after(other.record->id());
      const std::uint64_t done = other.record->completed();
      const std::uint64_t limit = std::max(after, done);
      if (limit == 0 || limit < other.pending_floor) return;  // every block there is newer
      if (block* b = other.pending.find(n, [limit](block* x) { return x->stamp <= limit; })) {
        if (best == nullptr || b->size < best->size) best = b;
      }
    });
  }
  return best;
}

/// Free blocks `st` may use but that sit in different bins (clear ones, and pending ones of
/// `st`) do not coalesce with each other. When nothing else fits, find the smallest run of
/// adjacent such blocks that holds `n` bytes and merge it into `st`'s pending bins (it is
/// about to be used by `st`). Null when no run is large enough.
template <pool_backend Backend>
block* pool_core<Backend>::join_adjacent(std::uint64_t n, state& st) {
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
  return free_pending(best_start, st, /*for_use=*/true);
}

}  // namespace streamalloc::detail

#pragma once

// The pool core's completions section: what the pool does when it learns that work has run or
// that a stream is gone (a host or device-wide synchronization, a stream retired, a trim, the
// question a closing pool asks). Included at the end of pool_core.hpp.

#include <streamalloc/detail/core/pool_core.hpp>

#include <cstdint>
#include <mutex>

namespace streamalloc::detail {

/// True while a free may still be running on the device: a cached or pending block whose free
/// is not known to have executed. Closing a pool waits for the device while this is true.
template <pool_backend Backend>
bool pool_core<Backend>::frees_in_flight() {
  const capture_guard relaxed(backend_);
  std::lock_guard lock(mutex_);
  bool in_flight = false;
  streams_.for_each([&](state& st) {
    flush_cache(st, clear_neighbours::leave);
    settle(st, /*query_events=*/true, stream_key{});
    in_flight = in_flight || st.has_frees();
  });
  in_flight = in_flight || !awaiting_device_idle_.empty() || awaiting_unlisted_ != nullptr;
  return in_flight;
}

/// Releases free physical memory until at most `keep` bytes of it remain (whole chunks only,
/// and only memory whose frees are known to have completed).
template <pool_backend Backend>
void pool_core<Backend>::trim_to(std::uint64_t keep) {
  const capture_guard relaxed(backend_);
  std::lock_guard lock(mutex_);
  // Frees still in the streams' caches first: known complete, their chunks may go too.
  // Cached frees left apart from clear chunks: a busy stream's 4 KiB free would otherwise take
  // them into its pending block, out of the trim's reach until an event on it has run.
  settle_everything(/*query_events=*/true, stream_key{}, clear_neighbours::leave);
  poll_fresh_covers(nullptr, [] { return false; });  // idle streams' frees, covered just now
  release_free_chunks(keep);
}

/// The stream is going away. The last moment its handle may be used (`handle_valid`): its
/// cached frees join its pending bins, and one query says whether it is idle (then they are
/// complete, and its state is free for another stream at once); if not, one last event
/// covers them. Nothing is recorded on it afterwards. A raw stream found destroyed after the
/// fact (its handle names another stream now) is not touched: its frees wait for the events
/// recorded while it was in hand (see deallocate), or a device-wide synchronization.
template <pool_backend Backend>
void pool_core<Backend>::on_retire(std::uint64_t stream, bool handle_valid) noexcept {
  const capture_guard relaxed(backend_);
  std::lock_guard lock(mutex_);
  state* found = streams_.find(stream);
  if (found == nullptr) return;
  state& st = *found;
  try {
    flush_cache(st, clear_neighbours::leave);
    if (handle_valid && st.native != nullptr) {
      settle(st, /*query_events=*/true, stream_key{st.record.get(), st.native});
    }
  } catch (...) {
    // No event: the stream's pending frees wait for a device-wide synchronization.
  }
  st.native = nullptr;
  try {
    streams_.retire(stream);
    recycle_retired();
  } catch (...) {
    // Out of host memory: the state stays with the pool, which is always safe.
  }
}

/// Called by the ordering registry after a host synchronization (or device-wide one).
template <pool_backend Backend>
void pool_core<Backend>::on_synchronize(std::uint64_t stream) noexcept {
  const capture_guard relaxed(backend_);
  try {
    std::lock_guard lock(mutex_);
    // The frees cached before the synchronization are complete now: absorbing clear neighbours
    // costs nothing (they turn clear together just below) and keeps the free memory in one
    // block even when settling is cut short, out of host memory.
    if (stream == 0) {  // every stream
      streams_.for_each([&](state& st) { flush_cache(st, clear_neighbours::absorb); });
      settle_all(false, stream_key{});
      clear_after_device_idle();
      // Retired streams whose last frees only this could prove complete (raw streams found
      // destroyed, threads that ended) give back their states and records now.
      if (streams_.has_retiring()) recycle_retired();
    } else if (state* st = streams_.find(stream)) {
      flush_cache(*st, clear_neighbours::absorb);
      settle(*st, false, stream_key{});
    }
    release_free_chunks(options_.release_threshold);
  } catch (...) {
    // Only bad_alloc can get here; memory stays cached, which is always safe.
  }
}

/// Settles retired streams' states and hands those with nothing left back to the table.
template <pool_backend Backend>
void pool_core<Backend>::recycle_retired() {
  streams_.recycle_retired([&](state& st) {
    settle(st, /*query_events=*/true, stream_key{});  // polls its last event; the handle is gone
    if (st.has_frees() || st.cache_bytes != 0 || !st.cache.empty()) return false;
    completion_.drop_events(st, /*wait=*/false);
    return true;
  });
}

}  // namespace streamalloc::detail

#pragma once

// The pool core's part in IPC (the transport is detail/ipc/): allocations exported to other
// processes and imported there. The driver leaves it undefined what happens when the exporter
// frees memory an importer still maps; here, while another process holds an import of a block,
// the memory under it is neither reused, nor released, nor remapped:
// - a free by this process (deallocate) keeps the block out of every bin, in state `imported`,
//   stamped with its stream's clock like any free; when the last import is released (or its
//   importer exits), it joins that stream's pending bins, in the order of that free;
// - chunks are only released or remapped when wholly free (pool_growth.hpp), which a block in
//   state `live` or `imported` never is;
// - a shrink is refused, and a capture may not take over the free.
// Descriptors carry the block's export serial: a block freed and allocated again at the same
// address has a new one (or none), so an old descriptor is refused instead of mapping memory
// that now belongs to someone else.
//
// Once a pool has exported a block, every free takes the pool lock (exported_ below): the
// lock-free cache path could otherwise hand out a block an import is being granted for.

#include <streamalloc/detail/core/pool_core.hpp>

namespace streamalloc::detail {

template <pool_backend Backend>
auto pool_core<Backend>::export_block(std::uint64_t p) -> exported_block {
  std::unique_lock lock(mutex_);
  block* b = live_.find(p);
  if (b == nullptr) {
    lock.unlock();
    throw std::invalid_argument(explain_bad_free(p, "export_pointer"));
  }
  if (b->export_serial == 0) b->export_serial = ++export_serials_;
  exported_.store(true, std::memory_order_release);
  return {b->export_serial, b->size};
}

template <pool_backend Backend>
block* pool_core<Backend>::import_block(std::uint64_t p, std::uint64_t serial, std::uint64_t bytes) {
  std::lock_guard lock(mutex_);
  block* b = live_.find(p);
  if (b == nullptr || b->export_serial != serial) {
    throw std::invalid_argument(
        "the descriptor names " + hex(p) +
        ", which is not the allocation it was exported for any more: it was freed (or shrunk) by the exporting "
        "process since (a stale descriptor)");
  }
  if (bytes == 0 || bytes > b->size) {
    throw std::invalid_argument("the descriptor of " + hex(p) + " says " + std::to_string(bytes) +
                                " bytes, the allocation has " + std::to_string(b->size) + " (a forged descriptor)");
  }
  ++b->imports;
  return b;
}

template <pool_backend Backend>
void pool_core<Backend>::release_import(block* b) noexcept {
  const capture_guard relaxed(backend_);
  std::lock_guard lock(mutex_);
  if (--b->imports != 0 || state_of(b) != block_state::imported) return;
  // Freed here while imported: it goes back now, in the order of that free.
  imported_held_ -= b->size;
  if (state* freer = drop_held_free(b)) {
    free_pending(b, *freer);
    return;
  }
  // The freeing stream's state is gone (it cannot be while held_frees counts the free, but a
  // free on an unknown stream would land here): a device-wide synchronization proves it done.
  await_device_idle(b);
}

template <pool_backend Backend>
void pool_core<Backend>::deallocate_exported(std::uint64_t p, state& st) {
  std::unique_lock lock(mutex_);
  block* b = live_.erase(p);
  if (b == nullptr) [[unlikely]] b = take_unindexed(p);
  if (b == nullptr) [[unlikely]] {
    lock.unlock();
    if (free_graph_block(p, st)) return;
    throw std::invalid_argument(explain_bad_free(p));
  }
  b->export_serial = 0;  // its descriptors are stale from here
  {
    std::lock_guard sl(st.lock);
    streams_.account_free(st, b->size);
  }
  if (b->imports != 0) {
    set_state(b, block_state::imported);
    hold_free(b, st);
    imported_held_ += b->size;
    return;
  }
  b->stream = st.record->id();
  b->stamp = st.record->stamp();
  free_pending(b, st);
}

template <pool_backend Backend>
template <class F>
void pool_core<Backend>::for_each_piece(const block* b, std::uint64_t bytes, F&& f) {
  std::lock_guard lock(mutex_);
  const std::uint64_t end = b->addr + bytes;
  const auto& chunks = space_.chunks();
  auto it = chunks.upper_bound(b->addr);
  if (it != chunks.begin()) --it;  // the chunk holding the start
  for (; it != chunks.end() && it->first < end; ++it) {
    const std::uint64_t from = std::max(b->addr, it->first);
    const std::uint64_t to = std::min(end, it->first + it->second.size);
    if (from < to) f(it->first, it->second, from - it->first, to - from);
  }
}

}  // namespace streamalloc::detail

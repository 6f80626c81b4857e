#pragma once

// The pool core's growth and release: how a request that no free block can serve gets new
// memory (extend the free block that ends a mapped run, create new chunks, reserve more
// addresses; moving chunks that are already there is pool_remap.hpp's), how a live block grows
// in place, and how free chunks go back to the device. Members of pool_core (pool_core.hpp), defined
// here to keep each file to one job; included at the end of pool_core.hpp, never on its own.

#include <streamalloc/detail/core/pool_core.hpp>

namespace streamalloc::detail {

/// The free block `st` may use that ends a mapped run and has room after it for what a
/// request of `n` bytes lacks (rounded up to `unit`), the largest such: growing or remapping
/// there extends it instead of starting a new run. Null if none.
template <pool_backend Backend>
block* pool_core<Backend>::extendable_tail(state& st, std::uint64_t n, std::uint64_t unit) {
  block* best = nullptr;
  for (auto& [start, end] : chain_.runs()) {
    block* last = chain_.before(end);
    if (last == nullptr) continue;
    const block_state ls = state_of(last);
    if (ls != block_state::clear && ls != block_state::pending) continue;
    if (last->bins != &clear_ && last->bins != &st.pending) continue;
    if (!space_.free_addresses().has_room(end, round_up(n - std::min(n, last->size), unit))) continue;
    if (best == nullptr || last->size > best->size) best = last;
  }
  return best;
}

/// Puts the chunk just mapped at [va, va + size) in the address chain (pool_core.hpp).
template <pool_backend Backend>
block* pool_core<Backend>::place_mapped(std::uint64_t va, std::uint64_t size, free_bins* bins, state* st) {
  block* b = nullptr;
  try {
    b = chain_.place(va, size);  // the one step that needs host memory; nothing changed if it fails
  } catch (...) {
    space_.release(space_.unmap(va));
    throw;
  }
  if (bins == &clear_) {
    set_state(b, block_state::clear);
  } else {
    set_state(b, block_state::pending);
    b->stream = st->record->id();
    b->stamp = 0;  // fresh memory: ordered before everything
  }
  b = merge_neighbours(b, bins);
  bins->insert(b);
  return b;
}

/// Grows the pool for a request of `n` bytes on `st`. Null when the limit or the device
/// says no. `again`: this is the one retry after free chunks were released (below).
template <pool_backend Backend>
block* pool_core<Backend>::grow(std::uint64_t n, state& st, placement where, bool again) {
  const bool own = n >= options_.chunk_size &&
                   (options_.own_chunk_for_large || (where == placement::room_to_grow && options_.own_chunk_to_grow));
  // One handle of its own for a large request that asks for it. Otherwise chunks, extending
  // the free block at the end of a mapped run when there is one: a large request built from
  // 64 MiB chunks copies within 2% of cudaMalloc memory's speed (docs/vmm-bandwidth.md), and
  // once freed, a long-lived small block placed in its memory pins one chunk instead of all.
  // Without a tail to extend, the new memory must hold the whole request.
  block* tail = own ? nullptr : extendable_tail(st, n, options_.chunk_size);
  const std::uint64_t have = tail != nullptr ? tail->size : 0;
  const std::uint64_t need = round_up(n - std::min(n, have), space_.granularity());
  const bool one_piece =
      own || (options_.max_size != 0 && space_.held() + round_up(need, options_.chunk_size) > options_.max_size);
  // own: one handle; a piece under the limit: one smaller handle; otherwise whole chunks.
  const std::uint64_t total = own ? round_up(n, space_.granularity())
                              : one_piece ? need
                                          : round_up(std::max<std::uint64_t>(need, 1), options_.chunk_size);
  if (options_.max_size != 0 && space_.held() + total > options_.max_size) return nullptr;
  // Refused before any handle is made (or listed): more than the largest run of free addresses
  // can never be mapped together, however much memory the device has.
  if (total > space_.free_addresses().largest() && !space_.reserve_more(total)) return nullptr;
  std::vector<std::uint64_t> sizes;
  if (one_piece) {
    sizes.push_back(total);
  } else {
    sizes.assign(total / options_.chunk_size, options_.chunk_size);
  }
  std::vector<handle> handles(sizes.size());
  bool released = false;
  std::size_t made = 0;
  auto release_made = [&] {
    for (std::size_t j = 0; j < made; ++j) backend_.release(handles[j]);
    made = 0;
  };
  std::optional<std::uint64_t> va;
  // Out of host memory (releasing free chunks, taking addresses), the handles made go back.
  try {
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      // Out of device memory: give back the whole free chunks this pool caches, then retry.
      CUresult r = backend_.create(sizes[i], handles[i]);
      if (r != CUDA_SUCCESS && release_free_chunks(0) != 0) {
        released = true;
        r = backend_.create(sizes[i], handles[i]);
      }
      if (r != CUDA_SUCCESS) {
        release_made();
        return nullptr;
      }
      ++made;
    }
    // Releasing free chunks above may have taken the tail with them, or shrunk it.
    if (tail != nullptr) {
      tail = extendable_tail(st, n, options_.chunk_size);
      if (tail != nullptr && tail->size + total < n) tail = nullptr;
    }
    // Right after the tail or not at all: a tail chosen again above had its room checked for
    // its own size, which may be less than `total`.
    if (tail != nullptr) va = space_.free_addresses().take_at(total, tail->addr + tail->size);
    if (!va && total < n) {  // away from the tail, too little to hold the request
      release_made();
      // The release took the tail this growth was sized for, and freed device memory: sized
      // afresh, without that tail, the request may now fit.
      return released && !again ? grow(n, st, where, true) : nullptr;
    }
    // A large request starts a run of its own: with room to grow in place after it, or next
    // to the other large runs, at the top of the addresses (chunk runs grow at the bottom),
    // where the GPU page tables are already built.
    if (!va && own && where == placement::room_to_grow) {
      // Room of at least `room_spread / 2` times its size after it: reserved for it, when the
      // free addresses are short of that, else as much as there is.
      va = space_.free_addresses().take_spaced(total, space_.granularity(), room_spread);
      if (!va && total <= space_.limit() / room_spread && space_.reserve_more(room_spread * total)) {
        va = space_.free_addresses().take_spaced(total, space_.granularity(), room_spread);
      }
      if (!va) va = space_.free_addresses().take_spaced(total, space_.granularity());
    } else if (!va && own) {
      va = space_.free_addresses().take_top(total);
    }
    if (!va) va = space_.free_addresses().take(total);
    if (!va) {
      release_made();
      return nullptr;
    }
  } catch (...) {  // (a retry above that throws has released its own)
    release_made();
    throw;
  }
  space_.note_growth(total);
  if (history_.on()) [[unlikely]] history_.note(history_op::grow, st.record->id(), *va, total);
  free_bins* bins = (tail != nullptr && tail->bins == &st.pending) ? &st.pending : &clear_;
  std::uint64_t at = *va;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    bool mapped = false;
    try {
      space_.map(at, chunk{sizes[i], std::move(handles[i])});  // refused: this one goes back
      mapped = true;
      place_mapped(at, sizes[i], bins, &st);  // out of host memory: this one goes back
    } catch (...) {
      // The chunks placed so far stay as free memory; the rest go back to the device, and
      // their addresses to the free ranges (a chunk placement failed on gave its own back).
      // The caller hears the driver's error, or the host's.
      for (std::size_t j = i + 1; j < sizes.size(); ++j) space_.release(chunk{sizes[j], std::move(handles[j])});
      give_back_unmapped(mapped ? at + sizes[i] : at, *va + total);
      if (history_.on()) [[unlikely]] history_.note(history_op::release, 0, at, *va + total - at);
      throw;
    }
    at += sizes[i];
  }
  return find_usable(n, st);
}

/// A live block grown in place (pool_core.hpp says what it promises): extended over the free
/// memory after it, or new memory mapped past its run's end (extend, below).
template <pool_backend Backend>
std::uint64_t pool_core<Backend>::grow_in_place(std::uint64_t p, std::uint64_t bytes, stream_key s) {
  const std::uint64_t n = round_up(bytes == 0 ? 1 : bytes, free_bins::quantum);
  state& st = streams_.state_for(s, mutex_);
  block* b = live_block(p, "grow_in_place");
  const capture_guard relaxed(backend_);
  std::lock_guard lock(mutex_);
  const std::uint64_t old = b->size;
  if (n <= old) return old;
  flush_cache(st, clear_neighbours::absorb);  // this stream's cached neighbours coalesce first
  bool extended = extend(b, n, st);
  if (!extended) {
    // Other streams' cached frees, and whatever completed since the pool last looked.
    settle_everything(options_.reuse.opportunistic, s, clear_neighbours::absorb);
    extended = extend(b, n, st);
    if (!extended) poll_fresh_covers(&st, [&] { return extended = extend(b, n, st); });
  }
  if (!extended) return 0;
  streams_.account_bytes(st, static_cast<std::int64_t>(b->size - old));
  return b->size;
}

/// A live block shrunk in place (pool_core.hpp): its tail freed in `s`'s order.
template <pool_backend Backend>
std::uint64_t pool_core<Backend>::shrink_in_place(std::uint64_t p, std::uint64_t bytes, stream_key s) {
  state& st = streams_.state_for(s, mutex_);
  block* b = live_block(p, "shrink_in_place");
  std::lock_guard lock(mutex_);
  const std::uint64_t old = b->size;
  // Compared before rounding: rounding a size within 255 of 2^64 up would wrap to 0.
  if (bytes >= old) return old;
  const std::uint64_t n = round_up(bytes == 0 ? 1 : bytes, free_bins::quantum);
  if (n >= old) return old;
  if (b->imports != 0) return old;  // another process maps the tail (pool_exports.hpp)
  b->export_serial = 0;            // descriptors of the old size are stale
  block* tail = split(b, n);
  tail->stream = st.record->id();
  tail->stamp = st.record->stamp();
  free_pending(tail, st);
  streams_.account_bytes(st, -static_cast<std::int64_t>(old - n));
  return n;
}

/// Extends live block `b` to `n` bytes with the free blocks after it that `st` may use,
/// mapping new physical memory at the end of its run if they fall short. False, changing
/// nothing, when a block in the way is live or not usable, or the addresses after the run
/// are taken, or the pool is at its limit, or the device is out of memory or refuses the mapping.
template <pool_backend Backend>
bool pool_core<Backend>::extend(block* b, std::uint64_t n, state& st) {
  auto usable = [&](block* x) {
    if (x == nullptr) return false;
    const block_state xs = state_of(x);
    if (xs == block_state::clear) return x->bins == &clear_;
    if (xs != block_state::pending) return false;
    if (x->bins == &st.pending) return true;
    if (!options_.reuse.follow_event_dependencies) return false;
    const state* owner = streams_.find(x->stream);
    if (owner == nullptr || x->bins != &owner->pending) return false;
    const std::uint64_t limit = std::max(st.record->ordered_after(x->stream), owner->record->completed());
    return x->stamp <= limit;
  };
  std::uint64_t have = b->size;
  block* last = b;
  while (have < n && usable(last->next_addr)) {
    last = last->next_addr;
    have += last->size;
  }
  if (have < n) {
    if (last->next_addr != nullptr) return false;  // a live or unusable block in the way
    const std::uint64_t end = last->addr + last->size;
    const std::uint64_t bytes = round_up(n - have, space_.granularity());
    if (options_.max_size != 0 && space_.held() + bytes > options_.max_size) return false;
    // Past the end of a reservation, a new one placed right there continues the run.
    if (!space_.free_addresses().has_room(end, bytes) && (space_.owns(end) || !space_.reserve_more(bytes, end))) return false;
    // The addresses first (room was checked under the same lock; out of host memory, nothing
    // has changed), then the memory.
    if (!space_.free_addresses().take_at(bytes, end)) return false;
    handle h{};
    // No retry after releasing cached chunks here: the free blocks after `b` may be among them.
    if (backend_.create(bytes, h) != CUDA_SUCCESS) {
      give_back_unmapped(end, end + bytes);
      return false;
    }
    space_.note_growth(bytes);
    try {
      space_.map(end, chunk{bytes, std::move(h)});  // refused: the memory goes back to the device
    } catch (const std::exception& e) {
      give_back_unmapped(end, end + bytes);
      if (!Backend::refused(e)) throw;
      return false;  // as when the device is out of memory
    } catch (...) {
      give_back_unmapped(end, end + bytes);
      throw;
    }
    if (history_.on()) [[unlikely]] history_.note(history_op::grow, st.record->id(), end, bytes);
    try {
      place_mapped(end, bytes, &clear_, &st);
    } catch (...) {  // out of host memory: the memory went back
      if (history_.on()) [[unlikely]] history_.note(history_op::release, 0, end, bytes);
      throw;
    }
  }
  // Absorb the blocks after `b`, splitting the last one. The split's index entry is made room
  // for first: failing halfway, the block in hand would be in no bins and `b` larger than its
  // caller knows. (Out of host memory here, new memory just mapped stays in the pool, free.)
  chain_.reserve_give_front();
  while (b->size < n) {
    block* x = b->next_addr;
    free_bins* bins = x->bins;
    bins->remove(x);
    const std::uint64_t want = n - b->size;
    if (x->size <= want) {
      b->size += x->size;
      unlink(x);
    } else {
      chain_.give_front(x, want);
      bins->insert(x);
      b->size += want;
    }
  }
  return true;
}

/// Releases whole free chunks, highest address first, until free memory is at most `keep`.
/// Returns the bytes released.
template <pool_backend Backend>
std::uint64_t pool_core<Backend>::release_free_chunks(std::uint64_t keep) {
  std::uint64_t free_bytes = clear_.bytes();
  streams_.for_each([&](state& st) { free_bytes += st.pending.bytes(); });
  if (free_bytes <= keep) return 0;
  auto movable = free_chunks();
  std::uint64_t released = 0;
  for (auto it = movable.rbegin(); it != movable.rend() && free_bytes > keep; ++it) {
    const std::uint64_t va = it->va, size = it->size;
    cut_out(va, size);
    space_.release(space_.unmap(va));
    if (history_.on()) [[unlikely]] history_.note(history_op::release, 0, va, size);
    free_bytes -= size;
    released += size;
  }
  return released;
}

}  // namespace streamalloc::detail

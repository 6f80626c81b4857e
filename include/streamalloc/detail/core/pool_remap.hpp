#pragma once

// The pool core's defragmentation: which whole chunks of free memory may move, and moving them
// next to each other so a large request finds one range. A chunk of clear memory is unmapped
// and mapped again at its new place. A chunk of the asking stream's own frees, not yet known
// complete, cannot be unmapped (work before those frees may still use it), but that stream may
// use its memory at once: the chunk is mapped at its new place too, and its old mapping stays
// until the frees are known complete (an alias). So a stream reuses its own frees without the
// host waiting, wherever they lie. Members of pool_core (pool_core.hpp), defined here to keep
// each file to one job; included at the end of pool_core.hpp, never on its own.

#include <streamalloc/detail/core/pool_core.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <vector>

namespace streamalloc::detail {

/// The chunks wholly covered by free blocks that may be moved. Without `own`: clear blocks
/// only (only memory known to be unused may be unmapped: remapping memory a kernel still reads
/// would fault). With `own`: also those wholly covered by clear blocks and `own`'s pending
/// ones, which move as aliases (their stamp: the newest of those frees). A chunk still mapped
/// at an earlier place never moves.
template <pool_backend Backend>
auto pool_core<Backend>::free_chunks(const state* own) -> std::vector<free_chunk> {
  std::vector<free_chunk> out;
  const bool may_alias = own != nullptr && !exported_.load(std::memory_order_relaxed);
  for (auto& [va, c] : space_.chunks()) {
    if (c.aliases != 0) continue;
    block* b = chain_.at_or_before(va);
    if (b == nullptr) continue;  // never: the chunk is mapped, so a block covers its start
    const std::uint64_t end = va + c.size;
    std::uint64_t stamp = 0;
    bool free = true;
    for (block* x = b; x != nullptr && x->addr < end; x = x->next_addr) {
      const block_state s = state_of(x);
      if (s == block_state::clear && x->bins == &clear_) continue;
      if (may_alias && s == block_state::pending && x->bins == &own->pending) {
        stamp = std::max<std::uint64_t>(stamp, std::max<std::uint64_t>(x->stamp, 1));
        continue;
      }
      free = false;
      break;
    }
    if (free) out.push_back({va, c.size, b->size, stamp});
  }
  return out;
}

/// Cuts [va, va + size) out of the free blocks covering it (clear, or pending of one stream)
/// and out of the address chain; what lies outside the range stays as it was.
template <pool_backend Backend>
void pool_core<Backend>::cut_out(std::uint64_t va, std::uint64_t size) {
  struct kind {
    block_state state;
    free_bins* bins;
    std::uint64_t stream, stamp;
  };
  auto kind_of = [](block* x) { return kind{state_of(x), x->bins, x->stream, x->stamp}; };
  // The range is mapped, so blocks cover it; a gap would mean the chain is corrupt.
  auto covering = [](block* x) {
    if (x == nullptr) [[unlikely]] throw std::logic_error("streamalloc: a chunk's addresses are not covered by blocks");
    return x;
  };
  block* b = covering(chain_.at_or_before(va));
  block* end = b;
  while (end->addr + end->size < va + size) end = covering(end->next_addr);
  // What needs host memory first: out of it, nothing has changed.
  const auto pieces = chain_.prepare_cut(b, end, va, size);
  const kind first = kind_of(b);
  kind last = first;
  b->bins->remove(b);
  while (b->addr + b->size < va + size) {  // the range spans several blocks: one of them all
    block* x = b->next_addr;
    last = kind_of(x);
    x->bins->remove(x);
    b->size += x->size;
    unlink(x);
  }
  const auto [before, after] = chain_.finish_cut(b, pieces);
  auto restore = [&](block* piece, const kind& k) {
    if (piece == nullptr) return;
    set_state(piece, k.state);
    piece->stream = k.stream;
    piece->stamp = k.stamp;
    k.bins->insert(piece);
  };
  restore(before, first);
  restore(after, last);
}

/// Moves whole free chunks to consecutive addresses from `dst`: clear ones are remapped and
/// join into clear free memory; `st`'s own pending ones are mapped there as aliases and join
/// its pending memory. `dst` moves past each chunk as soon as it is mapped there, so whatever
/// happens, the addresses from `dst` on are unused. False when the driver refused a mapping.
template <pool_backend Backend>
bool pool_core<Backend>::remap_to(std::uint64_t& dst, const std::vector<free_chunk>& chunks, state& st) {
  // The driver may refuse a mapping (cuMemMap and cuMemSetAccess need memory of their own, and
  // defragmentation runs when the device is nearly full): the move stops there, and the request
  // goes on to its next source with what did move. Only a refusal (Backend::refused) is taken
  // so; any other failure (a sticky error, the pool's own bug, the host's shortage) propagates,
  // and the callers give back the addresses from `dst` on.
  for (const free_chunk& m : chunks) {
    const std::uint64_t at = dst;
    if (m.stamp == 0) {
      cut_out(m.va, m.size);  // out of host memory: nothing has changed
      try {
        space_.map(at, space_.unmap(m.va));  // refused: the memory goes back to the device
      } catch (const std::exception& e) {
        if (history_.on()) [[unlikely]] history_.note(history_op::release, 0, m.va, m.size);
        if (!Backend::refused(e)) throw;
        return false;
      }
      dst += m.size;
      try {
        place_mapped(at, m.size, &clear_, &st);  // out of host memory: the memory goes back
      } catch (...) {  // (its move was not noted: the history last saw it at m.va)
        if (history_.on()) [[unlikely]] history_.note(history_op::release, 0, m.va, m.size);
        throw;
      }
    } else {
      // Host memory first, so that nothing fails once the chunk is mapped twice.
      const auto slot = chain_.prepare_place(at, m.size);
      try {
        space_.map_alias(m.va, at, &st, m.stamp);  // refused: nothing has changed
      } catch (const std::exception& e) {
        chain_.abandon_place(slot);
        if (!Backend::refused(e)) throw;
        return false;
      }
      try {
        cut_out(m.va, m.size);
      } catch (...) {  // out of host memory: the alias is undone
        space_.undo_alias(at);
        chain_.abandon_place(slot);
        throw;
      }
      dst += m.size;
      ++st.aliases;
      block* b = chain_.finish_place(slot);
      set_state(b, block_state::pending);
      b->stream = st.record->id();
      b->stamp = m.stamp;  // ordered after the frees its memory came from
      b = merge_neighbours(b, &st.pending);
      st.pending_floor = st.pending.empty() ? b->stamp : std::min(st.pending_floor, b->stamp);
      st.pending.insert(b);
    }
    if (history_.on()) [[unlikely]] history_.note(history_op::remap, st.record->id(), at, m.size);
    space_.note_remap();
  }
  return true;
}

/// Gives back [from, to), addresses taken for chunks that were not mapped there.
template <pool_backend Backend>
void pool_core<Backend>::give_back_unmapped(std::uint64_t from, std::uint64_t to) noexcept {
  if (from != to) space_.free_addresses().give_back_or_drop(from, to - from);
}

/// The earlier mappings of chunks moved as `st`'s aliases whose frees are now known complete:
/// unmapped, their addresses free again.
template <pool_backend Backend>
void pool_core<Backend>::unmap_aliases(state& st) noexcept {
  if (st.aliases == 0) return;
  const std::uint64_t done = st.record->completed();
  st.aliases -= static_cast<std::uint32_t>(
      space_.unmap_aliases([&](void* owner, std::uint64_t stamp) { return owner == &st && stamp <= done; }));
}

/// After moving chunks for a request of `n` bytes on `st`: the block that serves it, in one
/// bin or, where clear chunks and `st`'s aliased ones lie next to each other, joined from both.
template <pool_backend Backend>
block* pool_core<Backend>::usable_after_remap(std::uint64_t n, state& st) {
  block* b = find_usable(n, st);
  return b != nullptr ? b : join_adjacent(n, st);
}

/// Defragments: when the memory in whole free chunks would hold `n` bytes, remaps those chunks
/// next to each other (after the largest extendable free block if there is one).
template <pool_backend Backend>
block* pool_core<Backend>::defragment(std::uint64_t n, state& st) {
  auto movable = free_chunks(&st);
  std::uint64_t total = 0;
  for (auto& m : movable) total += m.size;
  block* tail = extendable_tail(st, n, space_.granularity());  // only if the chunks fit after it
  const std::uint64_t have = tail != nullptr ? tail->size : 0;
  if (total + have < n) return nullptr;
  // Clear chunks before aliased ones (an alias holds its old addresses for a while), then out
  // of the smallest free blocks first, so the large free blocks stay whole for large requests
  // (this matters more to fragmentation than the number of remaps).
  std::sort(movable.begin(), movable.end(), [](const free_chunk& a, const free_chunk& b) {
    if ((a.stamp != 0) != (b.stamp != 0)) return a.stamp == 0;
    return a.block_size != b.block_size ? a.block_size < b.block_size : a.va < b.va;
  });
  std::vector<free_chunk> picked;
  std::uint64_t got = have;
  for (auto& m : movable) {
    if (got >= n) break;
    // Chunks under the tail block stay: moving them would shrink what they are to extend.
    if (tail != nullptr && m.va < tail->addr + tail->size && tail->addr < m.va + m.size) continue;
    picked.push_back(m);
    got += m.size;
  }
  if (got < n) {
    tail = nullptr;  // without the tail: from scratch
    picked.clear();
    got = 0;
    for (auto& m : movable) {
      if (got >= n) break;
      picked.push_back(m);
      got += m.size;
    }
    if (got < n) return nullptr;
  }
  std::uint64_t bytes = 0;
  for (auto& m : picked) bytes += m.size;
  std::optional<std::uint64_t> at;
  const std::uint64_t tail_end = tail != nullptr ? tail->addr + tail->size : 0;
  if (tail != nullptr) at = space_.free_addresses().take_at(bytes, tail_end);
  if (!at && tail != nullptr && bytes < n) return nullptr;  // would not hold the request alone
  if (!at) {
    at = space_.take_or_reserve(bytes);
    if (!at) return nullptr;
  }
  std::uint64_t end = *at;
  try {
    (void)remap_to(end, picked, st);  // refused part-way: the request goes on with what moved
  } catch (...) {
    give_back_unmapped(end, *at + bytes);
    throw;
  }
  give_back_unmapped(end, *at + bytes);
  return usable_after_remap(n, st);
}

template <pool_backend Backend>
block* pool_core<Backend>::defragment_and_grow(std::uint64_t n, state& st) {
  auto movable = free_chunks(&st);
  std::uint64_t total = 0;
  for (auto& m : movable) total += m.size;
  // Worth its remaps only when the free chunks spare a good part of the growth.
  if (total == 0 || total >= n || total < std::max(options_.chunk_size, n / 4)) return nullptr;
  // A request that growth would serve by extending a free tail: that grows by less.
  const bool own = n >= options_.chunk_size && options_.own_chunk_for_large;
  if (!own) {
    if (block* tail = extendable_tail(st, n, options_.chunk_size); tail != nullptr && tail->size >= total) return nullptr;
  }
  const std::uint64_t need = round_up(n - total, space_.granularity());
  if (options_.max_size != 0 && space_.held() + need > options_.max_size) return nullptr;
  handle h{};
  if (backend_.create(need, h) != CUDA_SUCCESS) return nullptr;
  std::optional<std::uint64_t> at;
  try {
    at = space_.take_or_reserve(total + need);
  } catch (...) {  // out of host memory
    backend_.release(h);
    throw;
  }
  if (!at) {
    backend_.release(h);
    return nullptr;
  }
  const std::uint64_t end = *at + total + need;
  std::uint64_t dst = *at;
  bool moved = false;
  try {
    moved = remap_to(dst, movable, st);
  } catch (...) {
    backend_.release(h);
    give_back_unmapped(dst, end);
    throw;
  }
  if (!moved) {  // a mapping refused: what the new memory was sized for did not all move
    backend_.release(h);
    give_back_unmapped(dst, end);
    return usable_after_remap(n, st);
  }
  space_.note_growth(need);
  try {
    space_.map(dst, chunk{need, std::move(h)});  // refused: the memory goes back to the device
  } catch (...) {
    give_back_unmapped(dst, end);
    throw;
  }
  if (history_.on()) [[unlikely]] history_.note(history_op::grow, st.record->id(), dst, need);
  try {
    place_mapped(dst, need, &clear_, &st);
  } catch (...) {  // out of host memory: the memory went back
    if (history_.on()) [[unlikely]] history_.note(history_op::release, 0, dst, need);
    throw;
  }
  return usable_after_remap(n, st);
}

}  // namespace streamalloc::detail

#pragma once

// The pool core's graph memory: where a graph's allocations live, and how graphs launched into
// one stream share physical memory. Members of pool_core (pool_core.hpp), defined here to keep
// each file to one job; included at the end of pool_core.hpp, never on its own.
//
// A graph's allocations come from pieces of its own (graph_segments.hpp): whole chunks of the
// pool, a free chunk taken where it lies when one fits (no driver call), else new memory, each
// piece at least as large as the graph's pieces so far (few pieces). While the graph, a clone
// or an executable the driver instantiated from it lives, anything may launch it, at any time,
// on any stream: the pieces keep physical memory of their own.
//
// Once one `graph_exec` is all that holds the graph (the front knows: graph_ties.hpp) and
// nothing the graph allocates outlives a launch (graph_segment::frees_all), its pieces hold
// nothing between launches. Launches into one stream run one after the other, so every such
// graph launched into stream S may use the same physical memory: S's shared pages, page i
// mapped under granule i of each graph's pieces. K graphs launched in turn into one stream then
// hold what the largest needs, not the sum, as the driver's graph memory does. Mapping a page
// at one more graph's addresses is safe while another graph runs on it: the new graph's work
// runs after that graph's, in S's order. Moving a graph (its own memory to shared pages, or one
// stream's pages to another's) unmaps what its last launch used, so the caller waits for that
// launch first (spec: the driver's remap runs after the graph's previous launch too); launching
// into the same stream again costs one comparison. Pages never serve two streams, so graphs
// that may run at once never share memory.

#include <streamalloc/detail/core/pool_core.hpp>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace streamalloc::detail {

template <pool_backend Backend>
block* pool_core<Backend>::graph_memory_for(graph_segment& seg, std::uint64_t n) {
  auto best_fit = [&] {
    auto best = seg.spare.end();
    for (auto it = seg.spare.begin(); it != seg.spare.end(); ++it) {
      if ((*it)->size >= n && (best == seg.spare.end() || (*it)->size < (*best)->size)) best = it;
    }
    return best;
  };
  auto best = best_fit();
  if (best == seg.spare.end()) {
    add_graph_piece(seg, n);
    best = best_fit();
  }
  block* b = *best;
  if (b->size - n >= free_bins::quantum) {
    block* rest = split(b, n);  // the one step that may throw, before anything changes
    set_state(rest, block_state::graph);
    rest->use = graph_use::spare;
    rest->owner = &seg;
    *best = rest;
  } else {
    *best = seg.spare.back();
    seg.spare.pop_back();
  }
  return b;
}

template <pool_backend Backend>
void pool_core<Backend>::add_graph_piece(graph_segment& seg, std::uint64_t n) {
  const std::uint64_t need = round_up(n, space_.granularity());
  const std::uint64_t want = round_up(std::max(n, seg.piece_bytes), space_.granularity());
  seg.pieces.reserve(seg.pieces.size() + 1);
  seg.run_spares.reserve(seg.run_spares.size() + 1);
  auto run_spare = block_chain::spare_run();
  seg.spare.reserve(seg.spare.size() + 2);  // the piece, and a block given back after a failure
  // A whole free chunk of the pool, taken where it lies, not much larger than wanted; frees
  // known complete count (a new piece is rare: learning them is worth it here).
  streams_.for_each([&](state& st) { flush_cache(st, clear_neighbours::leave); });
  settle_all(/*query_events=*/false, stream_key{});
  std::optional<free_chunk> found;
  for (const free_chunk& m : free_chunks()) {
    if (m.size < need || m.size > 2 * want) continue;
    if (!found || m.size < found->size) found = m;
  }
  std::uint64_t va = 0, size = 0;
  if (found) {
    va = found->va;
    size = found->size;
    cut_out(va, size);
  } else {
    auto refuse = [&](const char* why) {
      core_out_of_memory e;
      e.requested = n;
      e.reason = std::string(why) + "; " + describe_state();
      throw e;
    };
    size = options_.max_size != 0 && space_.held() + want > options_.max_size ? need : want;
    if (options_.max_size != 0 && space_.held() + size > options_.max_size) {
      refuse("a graph's allocations need memory of the graph's own, beyond the pool's max_size");
    }
    handle h{};
    CUresult r = backend_.create(size, h);
    if (r != CUDA_SUCCESS && release_free_chunks(0) != 0) r = backend_.create(size, h);
    if (r != CUDA_SUCCESS && size > need) r = backend_.create(size = need, h);
    if (r != CUDA_SUCCESS) refuse("the device has no memory for a piece of the graph's own memory");
    const std::optional<std::uint64_t> at = space_.take_or_reserve(size);
    if (!at) {
      backend_.release(h);
      refuse("no virtual addresses left for the graph's memory");
    }
    va = *at;
    space_.note_growth(size);
    if (history_.on()) [[unlikely]] history_.note(history_op::grow, 0, va, size);
    try {
      space_.map(va, chunk{size, std::move(h)});  // releases the memory when it fails
    } catch (...) {
      space_.free_addresses().give_back_or_drop(va, size);
      if (history_.on()) [[unlikely]] history_.note(history_op::release, 0, va, size);
      throw;
    }
  }
  block* b = nullptr;
  try {
    b = chain_.place(va, size);
  } catch (...) {  // out of host memory: the chunk (new, or found clear) goes back to the device
    space_.release(space_.unmap(va));
    if (history_.on()) [[unlikely]] history_.note(history_op::release, 0, va, size);
    throw;
  }
  set_state(b, block_state::graph);
  b->use = graph_use::spare;
  b->owner = &seg;
  seg.pieces.emplace_back(va, size);
  seg.run_spares.push_back(std::move(run_spare));
  seg.piece_bytes += size;
  seg.spare.push_back(b);
  graphs_.note_held(size);
  // Last: when the driver refuses, the piece is the graph's spare memory, as if it had none.
  if constexpr (backend_with_peers<Backend>) {
    if (seg.peers != 0) backend_.grant_peers(va, size, seg.peers);
  }
}

template <pool_backend Backend>
void pool_core<Backend>::grant_graph_peers(graph_segment& seg, std::uint64_t peers) {
  if constexpr (backend_with_peers<Backend>) {
    for (const auto& [va, size] : seg.pieces) backend_.grant_peers(va, size, seg.peers | peers);
    seg.peers |= peers;
  } else {
    (void)seg;
    (void)peers;  // a backend without peers: the devices have no access to give
  }
}

template <pool_backend Backend>
void pool_core<Backend>::forget_graph_peers(const graph_segment& seg) noexcept {
  if constexpr (backend_with_peers<Backend>) {
    if (seg.peers == 0) return;
    for (const auto& [va, size] : seg.pieces) backend_.forget_peers(va);
  } else {
    (void)seg;
  }
}

template <pool_backend Backend>
template <class Wait>
bool pool_core<Backend>::bind_graph_memory(std::uint64_t capture, std::uint64_t stream, Wait&& wait_previous) noexcept {
  // The segment to move, or null; `lost` says whether its memory is lost now. One lookup per
  // lock: a launch into the stream the graph is on already asks nothing more.
  bool lost = false;
  auto must_move = [&]() -> graph_segment* {
    graph_segment* seg = graphs_.find(capture);
    lost = seg != nullptr && seg->lost;
    if (stream == 0) return nullptr;  // the stream is not known: nothing moves
    if (seg == nullptr || seg->pieces.empty() || seg->bound_to == stream || seg->keeps_own) return nullptr;
    // Once only a graph_exec holds the graph (the caller's promise), what it frees is fixed.
    if (!seg->frees_all()) {
      seg->keeps_own = true;
      return nullptr;
    }
    return seg;
  };
  {
    std::lock_guard lock(mutex_);
    if (must_move() == nullptr) return !lost;
  }
  if (!wait_previous()) return !lost;  // not known finished: its memory stays where it is
  const capture_guard relaxed(backend_);
  std::lock_guard lock(mutex_);
  if (graph_segment* seg = must_move()) {
    try {
      rebind(*seg, stream);
    } catch (...) {  // no memory for the pages: the graph keeps what it has (unless it is lost)
    }
    lost = seg->lost;
  }
  return !lost;
}

template <pool_backend Backend>
auto pool_core<Backend>::pages_of(std::uint64_t stream) noexcept -> shared_pages* {
  for (shared_pages& p : shared_pages_) {
    if (p.stream == stream) return &p;
  }
  return nullptr;
}

template <pool_backend Backend>
template <class F>
void pool_core<Backend>::for_each_granule(const graph_segment& seg, F&& f) {
  const std::uint64_t g = space_.granularity();
  std::size_t i = 0;
  for (const auto& [va, size] : seg.pieces) {
    for (std::uint64_t at = va; at < va + size; at += g) f(at, i++);
  }
}

template <pool_backend Backend>
void pool_core<Backend>::rebind(graph_segment& seg, std::uint64_t stream) {
  const std::uint64_t g = space_.granularity();
  const std::size_t count = seg.piece_bytes / g;
  // The pool's max_size holds during the move too: the graph's own memory goes only once the
  // pages are mapped. Above it, the graph stays on what it has.
  const std::size_t have = pages_of(stream) != nullptr ? pages_of(stream)->pages.size() : 0;
  if (options_.max_size != 0 && count > have && space_.held() + (count - have) * g > options_.max_size) return;
  // What the graph's own memory needs to leave it, taken before any page is made: out of host
  // memory later, pages would stay made for no graph.
  std::vector<chunk> own;
  own.reserve(seg.pieces.size());
  if (pages_of(stream) == nullptr) shared_pages_.push_back(shared_pages{stream, {}, 0});
  shared_pages* to = pages_of(stream);
  try {
    to->pages.reserve(count);
  } catch (...) {  // out of host memory: an entry no graph is bound to does not stay
    fit_pages(stream);
    throw;
  }
  while (to->pages.size() < count) {
    handle h{};
    CUresult r = backend_.create(g, h);
    if (r != CUDA_SUCCESS && release_free_chunks(0) != 0) r = backend_.create(g, h);
    if (r != CUDA_SUCCESS) {
      fit_pages(stream);
      return;
    }
    to->pages.push_back(std::move(h));
    space_.note_held(g);
    graphs_.note_held(g);
  }
  // Off what is mapped now (kept, to map again if the new mapping fails), onto the pages.
  shared_pages* from = seg.bound_to != 0 ? pages_of(seg.bound_to) : nullptr;
  if (seg.lost) {
    // Nothing is mapped under its pieces (put_back): the pages go under them now.
  } else if (from == nullptr) {
    for (const auto& [va, size] : seg.pieces) own.push_back(space_.unmap_in_place(va));
  } else {
    for_each_granule(seg, [&](std::uint64_t va, std::size_t) { backend_.unmap(va, g); });
  }
  std::size_t mapped = 0;
  try {
    for_each_granule(seg, [&](std::uint64_t va, std::size_t i) {
      backend_.map(va, g, to->pages[i]);
      ++mapped;
    });
  } catch (...) {
    for_each_granule(seg, [&](std::uint64_t va, std::size_t i) {
      if (i < mapped) backend_.unmap(va, g);
    });
    if (!seg.lost) put_back(seg, from, own);
    fit_pages(stream);
    throw;
  }
  const std::uint64_t left = seg.bound_to;
  seg.bound_to = stream;
  seg.lost = false;
  ++to->bound;
  if (from == nullptr) {
    for (chunk& c : own) {
      graphs_.note_released(c.size);
      space_.release(std::move(c));
    }
  } else {
    --from->bound;
    fit_pages(left);
  }
}

template <pool_backend Backend>
void pool_core<Backend>::put_back(graph_segment& seg, shared_pages* from, std::vector<chunk>& own) noexcept {
  const std::uint64_t g = space_.granularity();
  std::size_t back = 0;  // pieces (own memory) or granules (another stream's pages) mapped again
  try {
    if (from == nullptr) {
      for (; back < own.size(); ++back) space_.map(seg.pieces[back].first, std::move(own[back]));
    } else {
      for_each_granule(seg, [&](std::uint64_t va, std::size_t i) {
        backend_.map(va, g, from->pages[i]);
        back = i + 1;
      });
    }
    return;
  } catch (...) {  // refused (or out of host memory): the graph is left with no memory at all
  }
  if (from == nullptr) {
    // own[back] went back to the device with its failed mapping; those before it are mapped
    // again and those after it are still held: all go back, as the graph cannot use them.
    for (std::size_t k = 0; k < own.size(); ++k) {
      const auto [va, size] = seg.pieces[k];
      if (k < back) own[k] = space_.unmap_in_place(va);
      if (k != back) space_.release(std::move(own[k]));
      graphs_.note_released(size);
      if (history_.on()) [[unlikely]] history_.note(history_op::release, 0, va, size);
    }
  } else {
    for_each_granule(seg, [&](std::uint64_t va, std::size_t i) {
      if (i < back) backend_.unmap(va, g);
    });
    --from->bound;
  }
  const std::uint64_t left = seg.bound_to;
  seg.bound_to = 0;
  seg.lost = true;
  fit_pages(left);
}

template <pool_backend Backend>
void pool_core<Backend>::fit_pages(std::uint64_t stream) noexcept {
  shared_pages* p = pages_of(stream);
  if (p == nullptr) return;
  std::size_t keep = 0;
  graphs_.for_each([&](const graph_segment& seg) {
    if (seg.bound_to == stream) keep = std::max<std::size_t>(keep, seg.piece_bytes / space_.granularity());
  });
  while (p->pages.size() > keep) {  // mapped by no graph
    graphs_.note_released(space_.granularity());
    space_.release(chunk{space_.granularity(), std::move(p->pages.back())});
    p->pages.pop_back();
  }
  if (p->bound == 0) {
    *p = std::move(shared_pages_.back());
    shared_pages_.pop_back();
  }
}

template <pool_backend Backend>
void pool_core<Backend>::drop_shared_pieces(graph_segment& seg) noexcept {
  const std::uint64_t g = space_.granularity();
  if (!seg.lost) for_each_granule(seg, [&](std::uint64_t va, std::size_t) { backend_.unmap(va, g); });
  for (std::size_t i = 0; i < seg.pieces.size(); ++i) {
    const auto [va, size] = seg.pieces[i];
    // Its blocks, all the graph's and none live (frees_all), become one, then leave the chain:
    // with the run entry made with the piece, nothing here needs host memory.
    block* b = chain_.starting_at(va);
    while (b->size < size) {
      block* x = b->next_addr;
      b->size += x->size;
      unlink(x);
    }
    chain_.cut_whole(b, seg.run_spares[i]);
    space_.free_addresses().give_back_or_drop(va, size);  // out of host memory: counted, unused
  }
  if (shared_pages* p = pages_of(seg.bound_to)) --p->bound;
  const std::uint64_t stream = seg.bound_to;
  seg.bound_to = 0;
  seg.pieces.clear();
  seg.run_spares.clear();
  seg.spare.clear();
  fit_pages(stream);
}

template <pool_backend Backend>
void pool_core<Backend>::release_all_pages() noexcept {
  graphs_.for_each([&](const graph_segment& seg) {
    if (seg.bound_to == 0) return;
    for_each_granule(seg, [&](std::uint64_t va, std::size_t) { backend_.unmap(va, space_.granularity()); });
  });
  for (shared_pages& p : shared_pages_) {
    for (handle& h : p.pages) space_.release(chunk{space_.granularity(), std::move(h)});
  }
  shared_pages_.clear();
}

}  // namespace streamalloc::detail

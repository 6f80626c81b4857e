#pragma once

// What graphs made by stream capture hold of a pool.
//
// Work captured into a graph does not run when it is captured: it runs at each launch of the
// graph, later, possibly on another stream and many times. So an allocation made on a capturing
// stream cannot be a block handed out in host time and put back by the captured free, as on an
// ordinary stream: it would be handed out again while the graph still uses it at every launch.
// Instead the capture's graph holds the block (a "segment" per capture) for as long as the
// graph, or any executable or clone made from it, lives: the block's address is fixed for the
// graph's life and no host-time allocation gets it. A free captured in the same capture on the
// same stream makes the block reusable by allocations captured after it on that stream (the
// captured work after the free is ordered after everything before it on that stream, which
// includes every use the free is ordered after). When the graph is gone and the device has
// finished its launches, the pool takes the blocks back (pool_core::release_graph).
//
// The graph's allocations come from memory of its own: whole chunks of the pool (its
// "pieces"), never shared with host-time allocations, so that the physical memory under its
// addresses can be changed. Once only `graph_exec`s launch the graph and it frees everything it
// allocates, its pieces are mapped onto pages shared by the graphs launched into the same
// stream (pool_graph_memory.hpp says when and why that is safe).
//
// Which capture a call belongs to, and tying a segment's life to its graph (CUDA user objects),
// is the front's business (detail/pool/); this part is free of CUDA. Not thread-safe: the
// pool's lock guards it.

#include <streamalloc/detail/core/block.hpp>
#include <streamalloc/detail/core/block_chain.hpp>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

namespace streamalloc::detail {

/// The blocks one capture's graph holds.
struct graph_segment {
  std::uint64_t capture = 0;   ///< the capture's id, unique in the process (cuStreamGetCaptureInfo)
  std::vector<block*> blocks;  ///< every block the graph holds, in any graph_use
  /// Blocks freed in the graph, each with the token of its free: the stream a captured free
  /// was captured on, or the free node of a graph built by hand (the caller's).
  std::vector<std::pair<std::uint64_t, block*>> freed;
  /// Set by the first launch made through `graph_exec` (pool_core::graph_launched).
  bool launched = false;
  /// Blocks in use `live` and `freed_after`: what a launch checks, without walking `blocks`.
  std::size_t live = 0, freed_after = 0;
  /// The graph's own memory: whole chunks (address, size), in the order they were taken. Their
  /// blocks are the graph's, allocated (in `blocks`) or not yet (`spare`).
  std::vector<std::pair<std::uint64_t, std::uint64_t>> pieces;
  std::uint64_t piece_bytes = 0;
  /// One run entry made with each piece: dropping a piece from the middle of a mapped run
  /// splits the run, and the drop (when the graph is gone) may not fail for host memory.
  std::vector<block_chain::run_node> run_spares;
  std::vector<block*> spare;
  /// 0: the pieces' own physical memory is mapped under them; otherwise the id of the stream
  /// whose shared pages are (pool_graph_memory.hpp).
  std::uint64_t bound_to = 0;
  /// Found not to free all it allocates once only a graph_exec held it: never shared.
  bool keeps_own = false;
  /// Its memory could not be moved, nor put back where it was: the device refused mappings
  /// both ways (pool_core::rebind). Nothing is mapped under its pieces, so it must not run;
  /// binding it to a stream again maps that stream's pages under them.
  bool lost = false;
  /// Devices given read-write access to the pieces beyond the pool's own access, for the
  /// graph's life (bit d: device d): what its allocations asked for (pool_core::grant_graph_peers).
  std::uint64_t peers = 0;

  /// Does nothing the graph allocates outlive a launch? Then nothing in its pieces is valid
  /// between launches, and their physical memory may be another graph's in between.
  [[nodiscard]] bool frees_all() const noexcept { return live == 0 && freed_after == 0; }

  /// The smallest block freed in the graph by a free `after(token)` says the allocation comes
  /// after, that holds `n` bytes without wasting more than as much again; taken off the freed
  /// list. Null if none.
  template <class After>
  block* reuse(After&& after, std::uint64_t n) {
    auto best = freed.end();
    for (auto it = freed.begin(); it != freed.end(); ++it) {
      const std::uint64_t size = it->second->size;
      if (size < n || size / 2 > n || !after(it->first)) continue;
      if (best == freed.end() || size < best->second->size) best = it;
    }
    if (best == freed.end()) return nullptr;
    block* b = best->second;
    *best = freed.back();
    freed.pop_back();
    return b;
  }
};

/// Every segment of a pool, by capture id, and its graph blocks by address.
class graph_segments {
 public:
  [[nodiscard]] graph_segment* find(std::uint64_t capture) const noexcept {
    const auto it = by_capture_.find(capture);
    return it == by_capture_.end() ? nullptr : it->second.get();
  }
  graph_segment& add(std::uint64_t capture) {
    auto seg = std::make_unique<graph_segment>();
    seg->capture = capture;
    return *by_capture_.emplace(capture, std::move(seg)).first->second;
  }
  /// Removes the segment of `capture` (null if there is none) and forgets its blocks.
  std::unique_ptr<graph_segment> take(std::uint64_t capture) noexcept {
    const auto it = by_capture_.find(capture);
    if (it == by_capture_.end()) return nullptr;
    std::unique_ptr<graph_segment> seg = std::move(it->second);
    by_capture_.erase(it);
    for (block* b : seg->blocks) by_address_.erase(b->addr);
    return seg;
  }

  /// Gives `b` (in state graph, in no bins) to `seg`.
  void hold(graph_segment& seg, block* b) {
    seg.blocks.reserve(seg.blocks.size() + 1);
    by_address_.emplace(b->addr, b);  // the one step that may throw, before anything changes
    seg.blocks.push_back(b);
    b->owner = &seg;
  }

  /// The graph block starting at `addr`; null if none.
  [[nodiscard]] block* at(std::uint64_t addr) const noexcept {
    const auto it = by_address_.find(addr);
    return it == by_address_.end() ? nullptr : it->second;
  }
  static graph_segment& owner_of(block* b) noexcept { return *static_cast<graph_segment*>(b->owner); }

  [[nodiscard]] std::size_t segments() const noexcept { return by_capture_.size(); }
  [[nodiscard]] std::size_t blocks() const noexcept { return by_address_.size(); }
  /// Bytes graphs hold now, and the most they held since the pool was made or the peak reset:
  /// counted by the pool core (the pieces' own memory, shared pages, adopted blocks).
  [[nodiscard]] std::uint64_t bytes() const noexcept { return bytes_; }
  void note_held(std::uint64_t n) noexcept {
    bytes_ += n;
    high_ = std::max(high_, bytes_);
  }
  void note_released(std::uint64_t n) noexcept { bytes_ -= n; }
  /// Calls `f(segment&)` for every segment, in no order.
  template <class F>
  void for_each(F&& f) const {
    for (const auto& [capture, seg] : by_capture_) f(*seg);
  }
  [[nodiscard]] std::uint64_t high() const noexcept { return high_; }
  void reset_high() noexcept { high_ = bytes_; }

 private:
  std::unordered_map<std::uint64_t, std::unique_ptr<graph_segment>> by_capture_;
  std::unordered_map<std::uint64_t, block*> by_address_;
  std::uint64_t bytes_ = 0, high_ = 0;
};

}  // namespace streamalloc::detail

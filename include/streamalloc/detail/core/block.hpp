#pragma once

// A block: a range of the pool's mapped addresses, live or free. Blocks are recycled through
// the pool's own list, so the allocation paths never call the system allocator for them.

#include <cstdint>
#include <memory>
#include <vector>

namespace streamalloc::detail {

class free_bins;

enum class block_state : std::uint8_t {
  live,     ///< handed out, in the live table
  cached,   ///< freed, in its stream's fast cache (not coalesced)
  pending,  ///< freed, in its stream's pending bins: reusable by that stream, others need proof
  clear,    ///< freed and known complete: reusable by every stream
  graph,    ///< held by a graph made by stream capture (graph_segments.hpp), in no bins
  imported, ///< freed here while other processes still import it (pool_exports.hpp), in no bins
};

/// What a graph's block is to the graph and to the host (meaningful in state `graph` only).
enum class graph_use : std::uint8_t {
  live,         ///< allocated in the capture, not freed there: valid after each launch
  freed,        ///< freed in the capture: reusable by later allocations captured on that stream
  freed_after,  ///< live after a launch, then freed on a stream (block::stream, block::stamp)
  adopted,      ///< allocated outside the capture and freed inside it: the graph frees it
  spare,        ///< the graph's own memory no allocation of it has used yet
};

// Aligned to cache lines (two of them): the fast path writes a block's state and links, and
// blocks made one after another (each thread's first block, say) would otherwise share lines
// between threads.
struct alignas(64) block {
  std::uint64_t addr = 0;
  std::uint64_t size = 0;
  // Address neighbours within one contiguous mapped run; null at the run's ends.
  block* prev_addr = nullptr;
  block* next_addr = nullptr;
  // Links in the bin list that holds the block while it is free.
  block* prev_free = nullptr;
  block* next_free = nullptr;
  free_bins* bins = nullptr;  ///< the bins that hold it, while free
  std::uint64_t stream = 0;   ///< stream it was freed on (0: none, for clear blocks)
  std::uint64_t stamp = 0;    ///< the free's stamp on that stream
  std::uint32_t bin = 0;
  block_state state = block_state::clear;
  graph_use use = graph_use::live;  ///< in state `graph`: what the graph does with it
  void* owner = nullptr;            ///< in state `graph`: the graph_segment holding it
  // Exports to other processes (pool_exports.hpp), under the pool lock: the serial its
  // descriptors carry (0: never exported since allocated), and the imports not yet released.
  std::uint64_t export_serial = 0;
  std::uint32_t imports = 0;
  /// When it was allocated, if the pool's history was on then (pool_history::now_ns; else 0):
  /// the age a snapshot shows of a live block. Fits the block's two cache lines.
  std::uint64_t since = 0;
};
static_assert(sizeof(block) == 128, "a block is two cache lines");

/// Owns block records; hands out recycled ones. Not thread-safe: used under the pool's lock.
class block_arena {
 public:
  block* make(std::uint64_t addr, std::uint64_t size) {
    block* b;
    if (spare_ != nullptr) {
      b = spare_;
      spare_ = b->next_free;
      // Recycled records come back in the order their blocks were freed, scattered over the
      // slabs: fetch the next one now, so the next make does not wait for it.
      if (spare_ != nullptr) __builtin_prefetch(spare_, 1);
      *b = block{};
    } else {
      if (next_ == per_slab) {
        slabs_.push_back(std::make_unique<block[]>(per_slab));
        next_ = 0;
      }
      b = &slabs_.back()[next_++];
    }
    b->addr = addr;
    b->size = size;
    return b;
  }
  /// Keeps `b` for the next make. Never fails: merges call it after changing the chain.
  void recycle(block* b) noexcept {
    b->next_free = spare_;  // a recycled block is in no bins: its link is free to use
    spare_ = b;
  }

 private:
  static constexpr std::size_t per_slab = 1024;
  std::vector<std::unique_ptr<block[]>> slabs_;
  std::size_t next_ = per_slab;
  block* spare_ = nullptr;  // recycled blocks, linked through next_free
};

}  // namespace streamalloc::detail

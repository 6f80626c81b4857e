#pragma once

/// @file
/// @brief `pool_statistics`: what a pool holds and hands out. The pool and its core share this
/// one type.

#include <cstddef>

namespace streamalloc {

/// A pool's statistics. "Current" values are exact; see `used_high` for concurrency.
struct pool_statistics {
  std::size_t reserved_current = 0;  ///< physical memory the pool holds
  std::size_t reserved_high = 0;     ///< its high-water mark since creation or reset
  std::size_t used_current = 0;      ///< bytes of live allocations (rounded to 256)
  /// High-water mark of used_current. Exact when one stream allocates at a time; with several
  /// streams allocating at once, a peak is caught whenever one of them reaches a peak of its
  /// own, so a combined peak between those moments can be missed.
  std::size_t used_high = 0;
  /// Allocations handed out and not freed.
  std::size_t live_allocations = 0;
  std::size_t free_clear = 0;        ///< free bytes every stream may reuse now
  std::size_t free_pending = 0;      ///< free bytes awaiting proof of stream order
  /// The largest free block: the largest allocation that could be served without growing
  /// (by the stream that freed it, if it is still pending).
  std::size_t largest_free_block = 0;
  std::size_t chunks = 0;            ///< physical allocations mapped
  std::size_t remapped_chunks = 0;   ///< chunks moved to defragment, since creation
  std::size_t grows = 0;             ///< times the pool mapped new physical memory, since creation
  // Graphs made by stream capture (docs/graphs.md). Their memory is part of reserved_current,
  // not of used_current, free_clear or free_pending: a graph holds it for the graph's life.
  std::size_t graph_reserved_current = 0;  ///< bytes held by graphs alive
  std::size_t graph_reserved_high = 0;     ///< its high-water mark since creation or reset
  std::size_t graph_allocations = 0;       ///< blocks held by graphs alive
  std::size_t graphs = 0;                  ///< graphs alive that hold memory of the pool
};

}  // namespace streamalloc

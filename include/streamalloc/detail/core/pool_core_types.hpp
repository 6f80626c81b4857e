#pragma once

// What the pool core takes from its caller and gives back: its options, a snapshot of what it
// holds, the out-of-memory it throws, and the start of its messages about a pointer. Kept apart
// from the core itself (pool_core.hpp), which the front (pool.hpp) fills these from and into.

#include <streamalloc/detail/core/block.hpp>
#include <streamalloc/detail/core/pool_history.hpp>
#include <streamalloc/reuse_policy.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace streamalloc::detail {

struct core_options {
  std::uint64_t max_size = 0;           ///< 0: no limit but the device's memory
  std::uint64_t release_threshold = 0;  ///< free bytes kept at synchronization points
  std::uint64_t chunk_size = 0;         ///< physical memory is created in chunks of this
  /// A request >= chunk_size gets one chunk of its own size; otherwise it is built from chunks
  /// (so a few long-lived blocks placed in its memory after its free pin one chunk, not all).
  bool own_chunk_for_large = false;
  /// Such a request asking for room to grow (placement::room_to_grow) gets one chunk of its own
  /// size amid unused addresses, whatever own_chunk_for_large says.
  bool own_chunk_to_grow = true;
  std::uint64_t address_space = 0;      ///< the most virtual addresses reserved, as needed
  /// Told of each reservation the pool makes (base, size), under its lock.
  std::function<void(std::uint64_t, std::uint64_t)> on_reserve;
  reuse_policy reuse;
  int device = 0;  ///< the device whose synchronizations complete the pool's work (ordering.hpp)
};

/// "0x7f..", an address for messages.
inline std::string hex(std::uint64_t p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(p));
  return buf;
}

/// "streamalloc::pool::<what>: 0x7f..", the start of a message about pointer `p`.
inline std::string pointer_subject(std::uint64_t p, const char* what) {
  return std::string("streamalloc::pool::") + what + ": " + hex(p);
}

/// What a pool holds at one moment (pool_core::snapshot, pool_snapshot.hpp).
struct core_snapshot {
  struct block_view {
    std::uint64_t address = 0, bytes = 0;
    block_state state = block_state::clear;
    graph_use use = graph_use::live;  ///< in state graph
    std::uint64_t stream = 0;         ///< pending: the stream whose free it waits on
    std::uint64_t stamp = 0;          ///< that free's stamp on the stream
    std::uint64_t since = 0;          ///< live, allocated while the history was on: when (pool_history::now_ns)
  };
  struct stream_view {
    std::uint64_t id = 0, handle = 0;
    int device = 0;
    std::int64_t live_bytes = 0, live_allocations = 0;
    std::uint64_t pending_bytes = 0, held_frees = 0, newest_free_stamp = 0, completed_stamp = 0;
    std::size_t events_in_flight = 0;
  };
  std::vector<std::pair<std::uint64_t, std::uint64_t>> reservations, chunks;  ///< (address, bytes)
  std::vector<block_view> blocks;                                            ///< by address
  std::vector<stream_view> streams;
  std::uint64_t granularity = 0, chunk_size = 0, max_size = 0, largest_free = 0;
  std::uint64_t now = 0;  ///< pool_history::now_ns when the snapshot was taken, for ages
  std::size_t graphs = 0, graph_blocks = 0;
  pool_history::contents history;
};

/// Thrown by the core when memory cannot be found; pool.hpp turns it into out_of_memory.
struct core_out_of_memory {
  std::uint64_t requested = 0;
  std::string reason;
};

}  // namespace streamalloc::detail

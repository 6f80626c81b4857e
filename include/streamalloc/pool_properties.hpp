#pragma once

/// @file
/// @brief What a pool is made with (`pool_properties`), and the errors and reports particular
/// to pools.

#include <streamalloc/memory_location.hpp>
#include <streamalloc/pool_statistics.hpp>
#include <streamalloc/reuse_policy.hpp>
#include <streamalloc/shareable_handle.hpp>

#include <cstddef>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>

namespace streamalloc {

/// A pool's properties, validated when the pool is made.
struct pool_properties {
  /// Where the memory lives: a device, or a host NUMA node (readable and writable by the host).
  memory_location location = memory_location::device(0);
  /// The most physical memory the pool may hold; 0 for no limit but the device's. The pool
  /// holds whole granules of physical memory, so a size off the allocation granularity is
  /// rounded down to it (3 MiB with a 2 MiB granularity holds at most 2 MiB), and
  /// `pool::properties().max_size` gives the rounded value. Below one granule, or above 2^50
  /// bytes, it is refused.
  std::size_t max_size = 0;
  /// Free physical memory the pool keeps at synchronization points; the rest goes back to the
  /// driver. 0 (the default, as for cudaMemPool_t) keeps nothing; SIZE_MAX keeps everything.
  std::size_t release_threshold = 0;
  /// Which free memory a stream may reuse without waiting (reuse_policy.hpp).
  reuse_policy reuse{};
  /// Physical memory is created in chunks of this size (a multiple of the allocation
  /// granularity); a larger request is built from whole chunks mapped next to each other, so
  /// that the few long-lived blocks later placed in its memory once it is freed pin a chunk,
  /// not all of it (a request that asks for room to grow in place, as `stream_buffer` does,
  /// gets one physical allocation of its own size instead). 0: 64 MiB, the smallest size at
  /// which `cudaMemcpy` over the memory runs within 2% of cudaMalloc memory
  /// (docs/vmm-bandwidth.md), and with which the pool grows as fast as the driver's.
  std::size_t chunk_size = 0;
  /// Stay compact under fragmentation: chunks of the allocation granularity (2 MiB; or
  /// `chunk_size` if set), every large request built from them (those asking for room to grow
  /// too), so single chunks can be remapped to defragment. On a fragmenting workload the pool
  /// then holds about 1.08 times the live bytes instead of about 1.25 (docs/pool.md), at a
  /// cost: growth makes one physical allocation per 2 MiB (about 30 us each, against about
  /// 50 us per 64 MiB), and one large `cudaMemcpy` over an allocation spread over many chunks
  /// runs slower (docs/vmm-bandwidth.md).
  bool compact = false;
  /// Handle types the pool's memory can be exported as (kept for IPC).
  shareable_handle_type handle_types = shareable_handle_type::none;
  /// The most virtual addresses the pool reserves; 0: four times the maximum size, or four
  /// times the memory of the location (at most 2^50 bytes). Defragmentation and growth in
  /// place need addresses beyond the physical memory, and the pool never grows past them: each
  /// growth maps a chunk (`chunk_size`) or a large request whole into unmapped addresses. They
  /// are reserved as needed: 8 GiB (or 16 chunks, or all of them if less) when the pool is
  /// made, then each time at least as much again as the pool holds, so thousands of pools fit
  /// in a process. Above 2^50 bytes it is refused (no device's address space is that large).
  std::size_t address_space = 0;
};

/**
 * @brief An allocation failed: the pool is at its maximum size, or the device is out of
 * memory. `what()` gives the requested size and the pool's state.
 */
class out_of_memory : public std::bad_alloc {
 public:
  /// `requested` bytes could not be allocated; `message` says why and what the pool holds.
  out_of_memory(std::size_t requested, std::string message)
      : requested_(requested), message_(std::move(message)) {}
  /// The requested size, why it failed and the pool's state.
  [[nodiscard]] const char* what() const noexcept override { return message_.c_str(); }
  /// The bytes that were asked for.
  [[nodiscard]] std::size_t requested() const noexcept { return requested_; }

 private:
  std::size_t requested_;
  std::string message_;
};

/**
 * @brief A pool was used after `close()`: its memory and addresses are gone. `what()` names
 * the member that was called.
 */
class pool_closed : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};


/// What was left when a pool was closed.
struct pool_close_report {
  /// Allocations still live at the close (their memory went with the pool).
  std::size_t live_allocations = 0;
  /// Their bytes.
  std::size_t live_bytes = 0;
};

}  // namespace streamalloc

#pragma once

/// @file
/// @brief `placement`: where a pool puts the addresses of a large allocation.

namespace streamalloc {

/**
 * @brief Where a pool puts an allocation of at least its chunk size (64 MiB by default) when
 * it grows for it; smaller requests live in chunks and are not affected.
 *
 * Mapping memory into a gigabyte of addresses that holds nothing yet makes the driver build
 * GPU page tables for it: about 25 us more per allocation (bench_vmm_costs: 128 handles of
 * 64 MiB take 7.7 ms packed, 11.7 ms each in the middle of unused addresses).
 */
enum class placement {
  /// With the pool's other memory (a request of a chunk or more built from chunks, extending
  /// a free run's end when it can): the pool grows fastest and holds least. `grow_in_place`
  /// usually finds the addresses after it taken.
  packed,
  /// In the middle of the largest unused range of addresses, so that `grow_in_place` can
  /// extend it many times over (what `stream_buffer` asks for).
  room_to_grow,
};

}  // namespace streamalloc

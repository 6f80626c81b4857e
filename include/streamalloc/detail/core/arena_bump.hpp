#pragma once

// The device side of `device_arena` (streamalloc/device_arena.hpp): bump allocation from a
// region with an atomic offset, shared by the lanes of a warp that ask at once. Device code
// only: a host compiler sees nothing here. No CUDA API call is made; this is the arena's
// bookkeeping, as the rest of core/ is the pool's.
//
// Why not spec/002's sketch (`old = atomicAdd(offset, n); if (old + n > capacity) fail`):
// every failing caller adds its size, so the offset grows without bound once the region is
// full: 16,384 failing requests of 2^50 bytes wrap a 64-bit offset to a small value, and
// the next callers are handed memory that is in use. Rolling a failed add back
// (atomicSub) does not help: between the add and the sub, a later caller sees the inflated
// offset; once some rollbacks but not others have landed, the offset can drop below the end
// of a range already handed out, and the same bytes go to two callers.
//
// What is done instead, and why it is correct:
//  1. A request is checked alone first: bytes or alignment above the capacity, or an
//     alignment that is not a power of two, fail without touching the offset. So every
//     request that reaches the offset needs at most `capacity` bytes.
//  2. The lanes asking at once (per counter) form a group: the group's first lane adds the
//     group's bytes with one atomicAdd, and each lane takes its range after the lower lanes'.
//     No load comes first: on a counter every warp of the GPU hits, a load costs what the add
//     costs (measured: a load before the add halved the rate).
//  3. A lane succeeds when its range ends within the capacity at the offset the add returned.
//     Until the offset first exceeds the capacity it only grows, so the ranges of successful
//     lanes come from disjoint adds and never overlap.
//  4. A group whose add ends past the capacity clamps the offset: atomicMin(offset, capacity
//     + 1). That never brings it back to the capacity or below, so nothing is handed out twice,
//     and every later request fails: the first request that does not fit closes the arena
//     until it is reset (what was left of the tail is given up).
//  5. Bound: past the capacity, the offset is at most `capacity + 1` plus the adds of groups
//     between their add and their clamp: at most one add in flight per thread, each of at most
//     `capacity` bytes. With the capacity at most 2^40 (the owner checks) and fewer than 2^22
//     resident threads on any GPU, the offset stays below 2^63: it cannot wrap, for any number
//     of failing callers.
//
// Alignment without a compare-and-swap loop: every size is rounded up to 16 bytes, so every
// offset is a multiple of 16 and the region's base is aligned to 256; an alignment above 16
// is bought with `alignment - 16` bytes of padding in the lane's range.

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)

#include <cuda/atomic>

namespace streamalloc::detail {

/// Sizes are rounded up to this, so offsets are multiples of it and alignments up to it are
/// free.
inline constexpr std::uint64_t bump_granule = 16;

/// The calling lane's index in its warp.
__device__ inline unsigned lane_id() {
  unsigned lane;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
  return lane;
}

/// What a lane needs from the region for `bytes` at `alignment`, or 0 when the request
/// cannot be served by any region of `capacity` bytes (checked alone: nothing is added for it).
__device__ inline std::uint64_t bump_need(std::uint64_t bytes, std::uint64_t alignment, std::uint64_t capacity) {
  if (bytes == 0 || bytes > capacity || alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > capacity) {
    return 0;
  }
  const std::uint64_t need =
      ((bytes + bump_granule - 1) & ~(bump_granule - 1)) + (alignment > bump_granule ? alignment - bump_granule : 0);
  return need <= capacity ? need : 0;
}

/// One lane's answer: the memory (nullptr if none) and whether that is a failure (a request of
/// zero bytes gets nullptr and is no failure).
struct bump_result {
  void* pointer;
  bool failed;
};

/// The lanes of the calling warp that call with the same `key` now (the lanes asking at once
/// on one counter). Usually every active lane uses one counter: a shuffle and a vote tell, and
/// only lanes on several counters pay for a match.
__device__ inline unsigned group_of(unsigned active, unsigned long long key) {
  const int first = __ffs(static_cast<int>(active)) - 1;
  const unsigned long long first_key = __shfl_sync(active, key, first);
  const unsigned same = __ballot_sync(active, key == first_key);
  return same == active ? active : __match_any_sync(active, key);
}

/// This lane's start in its group's range (the needs of the group's lower lanes) and the
/// group's total.
__device__ inline void group_scan(unsigned group, unsigned lane, int leader, std::uint64_t need,
                                  std::uint64_t& start, std::uint64_t& total) {
  const unsigned below = group & ((1u << lane) - 1u);
  const std::uint64_t leader_need = __shfl_sync(group, static_cast<unsigned long long>(need), leader);
  if (__all_sync(group, need == leader_need)) {  // one size: no scan
    start = static_cast<std::uint64_t>(__popc(below)) * need;
    total = static_cast<std::uint64_t>(__popc(group)) * need;
    return;
  }
  if (group == 0xffffffffu && __all_sync(group, need < (std::uint64_t{1} << 26))) {
    // The whole warp, sizes differing: an inclusive scan in 32 bits (32 needs below 2^26
    // sum below 2^31), five shuffles.
    unsigned v = static_cast<unsigned>(need);
    for (int d = 1; d < 32; d <<= 1) {
      const unsigned up = __shfl_up_sync(group, v, static_cast<unsigned>(d));
      if (static_cast<int>(lane) >= d) v += up;
    }
    start = v - need;
    total = __shfl_sync(group, v, 31);
    return;
  }
  // Any other group: each lane sums what its lower lanes need.
  start = 0;
  total = 0;
  for (unsigned m = group; m != 0; m &= m - 1) {
    const int j = __ffs(static_cast<int>(m)) - 1;
    const std::uint64_t v = __shfl_sync(group, static_cast<unsigned long long>(need), j);
    total += v;
    if (static_cast<unsigned>(j) < lane) start += v;
  }
}

/**
 * Allocates `bytes` at `alignment` from [base, base + capacity) with the offset at `*offset`,
 * for every lane that calls at once; lanes of one warp on the same counter share one atomic
 * add. `Scope` is the scope of the counter's users: device for an arena in global memory,
 * block for a block's sub-arena in shared memory. `failures`, when not null, gets the number
 * of failing lanes of the group added (one atomic per group that had any).
 */
template <cuda::thread_scope Scope>
__device__ inline bump_result bump_allocate(std::byte* base, std::uint64_t capacity, unsigned long long* offset,
                                            std::uint64_t bytes, std::uint64_t alignment,
                                            unsigned long long* failures) {
  const std::uint64_t need = bump_need(bytes, alignment, capacity);
  const bool asks = bytes != 0;

  const unsigned group = group_of(__activemask(), reinterpret_cast<unsigned long long>(offset));
  const unsigned lane = lane_id();
  const int leader = __ffs(static_cast<int>(group)) - 1;
  std::uint64_t start = 0;
  std::uint64_t total = 0;
  group_scan(group, lane, leader, need, start, total);
  const std::uint64_t end = start + need;

  cuda::atomic_ref<unsigned long long, Scope> counter(*offset);
  unsigned long long old = 0;
  if (total != 0 && static_cast<int>(lane) == leader) {
    old = counter.fetch_add(total, cuda::memory_order_relaxed);
    // Past the end: close the arena, bounded (point 4 above).
    if (old > capacity || total > capacity - old) counter.fetch_min(capacity + 1, cuda::memory_order_relaxed);
  }
  old = __shfl_sync(group, old, leader);
  const bool got = need != 0 && old <= capacity && end <= capacity - old;
  const bool failed = asks && !got;
  if (failures != nullptr) {
    const unsigned failing = __ballot_sync(group, failed);
    if (failing != 0 && static_cast<int>(lane) == leader) {
      cuda::atomic_ref<unsigned long long, Scope>(*failures).fetch_add(static_cast<unsigned long long>(__popc(failing)),
                                                                       cuda::memory_order_relaxed);
    }
  }
  if (!got) return {nullptr, failed};
  // [base + old + start, base + old + end) is this lane's; its start is 16-aligned, and the
  // padding in `need` covers rounding it up to the alignment.
  const std::uintptr_t a = alignment > bump_granule ? alignment : bump_granule;
  const std::uintptr_t p = (reinterpret_cast<std::uintptr_t>(base + old + start) + a - 1) & ~(a - 1);
  return {reinterpret_cast<void*>(p), false};
}

/// The offset as the host reports it: the bytes handed out (the capacity once closed).
/// Read with an atomic: a plain load of shared memory that other warps change by atomics is
/// what racecheck reports.
template <cuda::thread_scope Scope>
__device__ inline std::uint64_t bump_used(unsigned long long* offset, std::uint64_t capacity) {
  const unsigned long long o =
      cuda::atomic_ref<unsigned long long, Scope>(*offset).fetch_or(0ULL, cuda::memory_order_relaxed);
  return o < capacity ? o : capacity;
}

}  // namespace streamalloc::detail

#endif  // __CUDACC__

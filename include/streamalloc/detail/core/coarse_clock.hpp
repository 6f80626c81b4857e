#pragma once

// The time a block was allocated, for the ages a snapshot shows of live blocks. Read on every
// allocation, so it must cost next to nothing: the kernel's coarse monotonic
// clock, which the vDSO answers from a value the timer interrupt keeps (a few nanoseconds, no
// system call), at the timer's resolution (1 to 4 ms on Linux; clock_getres says). An age in
// a snapshot is for telling a block held for seconds or minutes from a fresh one, which that
// resolution does; the history (pool_history.hpp) has exact times.

#include <time.h>

#include <cstdint>

namespace streamalloc::detail {

/// Nanoseconds of CLOCK_MONOTONIC_COARSE (0 if the clock cannot be read).
inline std::uint64_t coarse_now_ns() noexcept {
  timespec t{};
  if (::clock_gettime(CLOCK_MONOTONIC_COARSE, &t) != 0) return 0;
  return static_cast<std::uint64_t>(t.tv_sec) * 1000000000u + static_cast<std::uint64_t>(t.tv_nsec);
}

/// Its resolution in nanoseconds (0 if unknown), which a snapshot reports beside the ages.
inline std::uint64_t coarse_resolution_ns() noexcept {
  timespec t{};
  if (::clock_getres(CLOCK_MONOTONIC_COARSE, &t) != 0) return 0;
  return static_cast<std::uint64_t>(t.tv_sec) * 1000000000u + static_cast<std::uint64_t>(t.tv_nsec);
}

}  // namespace streamalloc::detail

#pragma once

// What every part of the pool core's fuzzer uses (pool_core_fuzz.cpp includes the parts, one
// translation unit): the bounds of the model, failure and trace reporting, and the reader the
// input is decoded through.
//
// The parts are headers of one translation unit, so what they define is `inline` in a namespace
// of their own, as tests/cpu/detail/pool_core_support.hpp does for the core's tests.

#include <streamalloc/detail/core/pool_core.hpp>

#include "sim_backend.hpp"

#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>

namespace pool_core_fuzz {

using namespace streamalloc::detail;
using streamalloc::pool_statistics;
using streamalloc::reuse_policy;
using streamalloc_test::sim_backend;
using streamalloc_test::sim_device;

inline constexpr std::uint64_t KiB = 1ull << 10, MiB = 1ull << 20, GiB = 1ull << 30;
// The host pseudo-stream included. More than a clock keeps (2 * max_clock_entries): ordering
// knowledge is forgotten under the model's eyes.
inline constexpr std::size_t max_streams = 40;
inline constexpr std::size_t host = 0;  // its index
inline constexpr std::size_t none = ~std::size_t{0};
// pool.hpp refuses larger sizes before the core: allocate throws out_of_memory, grow_in_place
// returns 0. shrink_in_place passes any size on.
inline constexpr std::uint64_t pool_front_limit = 1ull << 62;
inline void* const per_thread_handle = reinterpret_cast<void*>(0x2);  // CU_STREAM_PER_THREAD

inline bool trace_on = false;
inline const char* input_name = nullptr;  // the replayed file, for messages
inline std::size_t step_now = 0;

[[noreturn]] __attribute__((format(printf, 1, 2))) inline void fail(const char* fmt, ...) {
  std::fprintf(stderr, "pool_core_fuzz: step %zu: ", step_now);
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "\n");
  if (input_name != nullptr) std::fprintf(stderr, "pool_core_fuzz: input %s\n", input_name);
  std::fprintf(stderr, "pool_core_fuzz: STREAMALLOC_FUZZ_TRACE=1 prints the operations up to here\n");
  std::fflush(stderr);
  __builtin_trap();
}

#define TRACE(...)                                     \
  do {                                                 \
    if (trace_on) {                                    \
      std::fprintf(stderr, "[%4zu] ", step_now);       \
      std::fprintf(stderr, __VA_ARGS__);               \
      std::fprintf(stderr, "\n");                      \
    }                                                  \
  } while (0)

using ull = unsigned long long;

inline std::uint64_t round_up(std::uint64_t v, std::uint64_t to) { return (v + to - 1) / to * to; }

/// The input, read front to back; zeros once it is used up.
class reader {
 public:
  reader(const std::uint8_t* p, std::size_t n) : p_(p), n_(n) {}
  [[nodiscard]] bool more() const { return i_ < n_; }
  std::uint8_t byte() { return i_ < n_ ? p_[i_++] : 0; }
  std::uint64_t bytes(int k) {
    std::uint64_t v = 0;
    for (int j = 0; j < k; ++j) v = v << 8 | byte();
    return v;
  }

 private:
  const std::uint8_t* p_;
  std::size_t n_;
  std::size_t i_ = 0;
};

}  // namespace pool_core_fuzz

#pragma once

// A global operator new that fails on request, for tests that check that running out of host
// memory changes nothing (or loses nothing). Include it in exactly one file of a test binary:
// it replaces the program's operator new and delete.

#include <cstddef>
#include <cstdlib>
#include <new>

namespace test_support {
/// How many more allocations succeed before every later one throws std::bad_alloc; negative:
/// all succeed. Set only around the calls under test.
inline int allocations_until_failure = -1;
/// While set on a thread, its allocations neither fail nor count (a simulated device's own
/// bookkeeping, say, which is the test's and not the code's under test).
inline thread_local bool allocations_exempt = false;

/// Refuses every allocation from the `k`-th on while it lives (k = 0: all of them), and lets
/// them all succeed again when it goes, even when a failed check throws meanwhile (doctest's
/// own report allocates: left refusing, every later case of the binary would fail too).
struct refusing_allocations {
  explicit refusing_allocations(int k = 0) noexcept { allocations_until_failure = k; }
  ~refusing_allocations() { allocations_until_failure = -1; }
  refusing_allocations(const refusing_allocations&) = delete;
  refusing_allocations& operator=(const refusing_allocations&) = delete;
};
}  // namespace test_support

// Out of line: inlined, GCC 12 at -O2 takes the malloc/free pair for a mismatched new/delete.
[[gnu::noinline]] void* operator new(std::size_t bytes) {
  using test_support::allocations_until_failure;
  if (!test_support::allocations_exempt) {
    if (allocations_until_failure == 0) throw std::bad_alloc();
    if (allocations_until_failure > 0) --allocations_until_failure;
  }
  if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
  throw std::bad_alloc();
}
[[gnu::noinline]] void operator delete(void* p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void* p, std::size_t) noexcept { std::free(p); }
// Every other form that pairs with those, so that whatever the code under test uses (a
// `new (std::nothrow)` among them) allocates and frees through the same malloc and free: a
// sanitizer's own forms would otherwise allocate what these free (AddressSanitizer's
// alloc-dealloc-mismatch). The aligned forms are left to the library: they pair among themselves.
[[gnu::noinline]] void* operator new(std::size_t bytes, const std::nothrow_t&) noexcept {
  try {
    return ::operator new(bytes);
  } catch (...) {
    return nullptr;
  }
}
[[gnu::noinline]] void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
[[gnu::noinline]] void* operator new[](std::size_t bytes) { return ::operator new(bytes); }
[[gnu::noinline]] void* operator new[](std::size_t bytes, const std::nothrow_t& tag) noexcept {
  return ::operator new(bytes, tag);
}
[[gnu::noinline]] void operator delete[](void* p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }

#pragma once

// Streams for the CPU tests of the pool core's parts: an ordering record of its own and a fake
// handle, no CUDA. Ids start far above any a real stream gets in a test process.

#include <streamalloc/detail/core/ordering.hpp>
#include <streamalloc/detail/core/pool_backend.hpp>

#include <cstdint>

namespace test_support {

struct test_stream {
  streamalloc::detail::stream_record* record;
  void* native;
  [[nodiscard]] streamalloc::detail::stream_key key() const { return {record, native}; }
  /// The key of a call on this stream that was given no handle (a synchronous call).
  [[nodiscard]] streamalloc::detail::stream_key key_without_handle() const { return {record, nullptr}; }
};

/// A stream whose handle stays valid (a streamalloc `stream`), or with `stable == false` a raw
/// handle the pool may use only during a call given it.
inline test_stream make_stream(bool stable = true) {
  static std::uint64_t next = 1ull << 52;
  static char handles[4096];
  const std::uint64_t id = ++next;
  streamalloc::detail::stream_record& r = streamalloc::detail::ordering().record(id);
  if (stable) r.mark_handle_stable();
  return {&r, &handles[id % 4096]};
}

/// Another stream behind the same handle value: a raw stream created after `old` was destroyed
/// (CUDA hands the value out again), or the per-thread default stream of another thread.
inline test_stream same_handle(const test_stream& old) {
  test_stream s = make_stream(false);
  s.native = old.native;
  return s;
}

}  // namespace test_support

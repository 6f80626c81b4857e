#pragma once

/// @file
/// The definitions of the functions `streamalloc/c_api.h` declares. Include it in exactly one
/// translation unit of a shared library, as CMake's `streamalloc::c` target does (its source
/// is that one line); the rest of the program uses `c_api.h`.
///
/// Each function serves the device's current pool (`streamalloc::current_pool(device)`), so a
/// C++ part of the same program that calls `set_current_pool` decides what PyTorch or CuPy
/// allocate from. Errors become a status and a thread's last error, except in
/// `streamalloc_torch_malloc`, which lets the exception through for PyTorch to report.

#include <streamalloc/c_api.h>
#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>
#include <streamalloc/version.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

namespace streamalloc::detail {

/// The calling thread's last error, as `streamalloc_last_error` returns it.
inline std::string& c_last_error() {
  thread_local std::string message;
  return message;
}

/// Runs `f`; an exception becomes the thread's last error and `failed` is returned.
template <class F, class R>
R c_guarded(const char* function, R failed, F&& f) noexcept {
  try {
    return f();
  } catch (const std::exception& e) {
    try {
      c_last_error() = std::string(function) + ": " + e.what();
    } catch (...) {
      // Out of host memory for the message: the status still says it failed.
    }
  } catch (...) {
    try {
      c_last_error() = std::string(function) + ": an unknown exception";
    } catch (...) {
    }
  }
  return failed;
}

/// The stream a C caller means by `s`. A default stream's handle names the stream of the
/// context current on the calling thread; on a thread that has none, the pool's first driver
/// call about the stream is refused for want of one, and `device`'s primary context is made
/// current then (default_stream_device), as a CUDA runtime call there would. Not asked ahead
/// of every call: in a PyTorch step that question alone cost more than the allocation.
inline stream_ref c_stream(streamalloc_stream s) { return stream_ref(reinterpret_cast<cudaStream_t>(s)); }

inline pool_ref c_pool(int device) {
  // current_pool checks the ordinal against what streamalloc handles; a device the driver
  // does not have is refused when its pool is made.
  return current_pool(device);
}

/// Allocates from `device`'s current pool on `s`.
inline void* c_allocate(size_t size, int device, streamalloc_stream s) {
  const default_stream_device_scope scope(device);
  return c_pool(device).allocate(size, c_stream(s));
}

/// Frees `p` on `s`. When `device` has no pool set current (PyTorch's and CuPy's case), its
/// default pool is asked first whether its reserved ranges hold `p`: a check without a lock,
/// safe because a default pool is never destroyed. Otherwise, or when it does not hold `p`,
/// whichever pool does is found in the process's directory of pools, under its lock: a pool
/// set current may be closed or destroyed by another thread meanwhile, and the directory is
/// the safe way to it. A pointer no pool holds is refused there.
inline void c_deallocate(void* p, int device, streamalloc_stream s) {
  const default_stream_device_scope scope(device);
  if (pool* d = current_default_pool(device); d != nullptr && d->owns(p)) {
    d->deallocate(p, c_stream(s));
    return;
  }
  streamalloc::deallocate(p, c_stream(s));
}

/// The current pool's snapshot (pool::snapshot: properties, statistics, blocks, streams and,
/// when kept, history).
inline std::string c_snapshot(int device) { return c_pool(device).snapshot(); }

}  // namespace streamalloc::detail

extern "C" {

STREAMALLOC_C_EXPORT int streamalloc_version(void) { return STREAMALLOC_VERSION; }

STREAMALLOC_C_EXPORT void* streamalloc_malloc(size_t size, int device, streamalloc_stream stream) {
  using namespace streamalloc::detail;
  return c_guarded("streamalloc_malloc", static_cast<void*>(nullptr),
                   [&] { return c_allocate(size, device, stream); });
}

STREAMALLOC_C_EXPORT void* streamalloc_torch_malloc(size_t size, int device, streamalloc_stream stream) {
  using namespace streamalloc::detail;
  return c_allocate(size, device, stream);
}

STREAMALLOC_C_EXPORT void streamalloc_free(void* ptr, size_t /*size*/, int device, streamalloc_stream stream) {
  using namespace streamalloc::detail;
  if (ptr == nullptr) return;
  const int ok = c_guarded("streamalloc_free", 0, [&] {
    c_deallocate(ptr, device, stream);
    return 1;
  });
  // A free has nobody to return a status to (PyTorch ignores it): a bad one is a bug the
  // user must hear of, and the memory it names was left as it was.
  if (ok == 0) std::fprintf(stderr, "streamalloc: %s\n", c_last_error().c_str());
}

STREAMALLOC_C_EXPORT int streamalloc_get_statistics(int device, streamalloc_statistics* out, size_t out_size) {
  using namespace streamalloc::detail;
  return c_guarded("streamalloc_get_statistics", -1, [&] {
    if (out == nullptr) throw std::invalid_argument("a null pointer to the statistics");
    const streamalloc::pool_statistics s = c_pool(device).statistics();
    const streamalloc_statistics all{s.reserved_current,       s.reserved_high,       s.used_current,
                                     s.used_high,              s.live_allocations,    s.free_clear,
                                     s.free_pending,           s.largest_free_block,  s.chunks,
                                     s.remapped_chunks,        s.grows,               s.graph_reserved_current,
                                     s.graph_reserved_high,    s.graph_allocations,   s.graphs};
    std::memcpy(out, &all, std::min(out_size, sizeof all));
    return 0;
  });
}

STREAMALLOC_C_EXPORT int streamalloc_reset_peaks(int device) {
  using namespace streamalloc::detail;
  return c_guarded("streamalloc_reset_peaks", -1, [&] {
    c_pool(device).reset_high_water();
    return 0;
  });
}

STREAMALLOC_C_EXPORT int streamalloc_synchronize(int device) {
  using namespace streamalloc::detail;
  return c_guarded("streamalloc_synchronize", -1, [&] {
    (void)streamalloc::synchronize_device(device);
    return 0;
  });
}

STREAMALLOC_C_EXPORT int streamalloc_trim(int device, size_t keep) {
  using namespace streamalloc::detail;
  return c_guarded("streamalloc_trim", -1, [&] {
    c_pool(device).trim_to(keep);
    return 0;
  });
}

STREAMALLOC_C_EXPORT int streamalloc_set_release_threshold(int device, size_t bytes) {
  using namespace streamalloc::detail;
  return c_guarded("streamalloc_set_release_threshold", -1, [&] {
    c_pool(device).set_release_threshold(bytes);
    return 0;
  });
}

STREAMALLOC_C_EXPORT int streamalloc_set_reuse_policy(int device, int follow_event_dependencies, int opportunistic,
                                                      int internal_dependencies) {
  using namespace streamalloc::detail;
  return c_guarded("streamalloc_set_reuse_policy", -1, [&] {
    c_pool(device).set_reuse_policy({follow_event_dependencies != 0, opportunistic != 0, internal_dependencies != 0});
    return 0;
  });
}

STREAMALLOC_C_EXPORT long long streamalloc_snapshot(int device, char* buffer, size_t capacity) {
  using namespace streamalloc::detail;
  return c_guarded("streamalloc_snapshot", -1LL, [&] {
    const std::string doc = c_snapshot(device);
    if (buffer != nullptr && doc.size() < capacity) std::memcpy(buffer, doc.c_str(), doc.size() + 1);
    return static_cast<long long>(doc.size());
  });
}

STREAMALLOC_C_EXPORT int streamalloc_keep_history(int device, size_t events) {
  using namespace streamalloc::detail;
  return c_guarded("streamalloc_keep_history", -1, [&] {
    c_pool(device).keep_history(events);
    return 0;
  });
}

STREAMALLOC_C_EXPORT const char* streamalloc_last_error(void) { return streamalloc::detail::c_last_error().c_str(); }

}  // extern "C"

#pragma once

/// @file
/// @brief `stream_ref`: a non-owning view of a CUDA stream.
///
/// Only the handle for now; the pool issue adds the owning `stream` and the event handles
/// through which the pool learns of stream ordering.

#include <streamalloc/detail/config.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>

namespace streamalloc {

/**
 * @brief A non-owning, trivially copyable reference to a CUDA stream.
 *
 * Made explicitly from a `cudaStream_t`. An integer or `nullptr` is rejected at compile time:
 * `stream_ref(0)` reads like "stream 0" but would silently mean the legacy default stream; say
 * `stream_ref::legacy_default()` or `stream_ref::per_thread_default()` instead.
 * @code
 * cudaStream_t s;
 * cudaStreamCreate(&s);
 * streamalloc::stream_ref ref{s};
 * cudaStream_t back = ref.get();
 * @endcode
 */
class stream_ref {
 public:
  /// Views `stream`.
  constexpr explicit stream_ref(cudaStream_t stream) noexcept : stream_(stream) {}
  /// Rejected: an integer is not a stream. Use `legacy_default()` for stream 0.
  stream_ref(int) = delete;
  /// Rejected: say `legacy_default()` or `per_thread_default()`.
  stream_ref(std::nullptr_t) = delete;

  /// The legacy default stream (handle 0), which synchronizes with other blocking streams.
  [[nodiscard]] static stream_ref legacy_default() noexcept { return stream_ref(cudaStreamLegacy); }
  /// The calling thread's default stream.
  [[nodiscard]] static stream_ref per_thread_default() noexcept {
    return stream_ref(cudaStreamPerThread);
  }

  /// The underlying handle.
  [[nodiscard]] constexpr cudaStream_t get() const noexcept { return stream_; }
  /// Explicit conversion back to the CUDA handle.
  constexpr explicit operator cudaStream_t() const noexcept { return stream_; }

  friend constexpr bool operator==(stream_ref, stream_ref) noexcept = default;

 private:
  cudaStream_t stream_;
};

}  // namespace streamalloc

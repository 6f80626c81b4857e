#pragma once

/// @file
/// @brief `reuse_policy`: which memory freed on one stream a pool may hand to another without
/// a host synchronization. The pool and its core share this one type.

namespace streamalloc {

/**
 * @brief Which cross-stream reuse a pool may make without a host synchronization. A block
 * freed on a stream is always reusable at once by that stream, and by every stream once the
 * host has synchronized with it (or with an event recorded after the free).
 */
struct reuse_policy {
  /// Reuse on stream B memory freed on A when B waited, through streamalloc's `stream_ref::wait`,
  /// on an event recorded on A after the free (directly or through other streams).
  bool follow_event_dependencies = true;
  /// Reuse memory whose free the device has already executed (found by querying an event the
  /// pool records on the freeing stream). Makes reuse depend on timing, so run-to-run
  /// allocation patterns can differ.
  bool opportunistic = true;
  /// When the pool cannot grow (at its maximum size, or out of device memory), make the
  /// allocating stream wait on a pending free instead of failing. Can serialize streams.
  bool internal_dependencies = true;
};

}  // namespace streamalloc

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
  /// Before growing the pool for a request of a chunk or more, wait on the host for the
  /// allocating stream's own earlier frees to run, when they hold at least half the request:
  /// once known complete, their memory can be remapped into one range instead of new memory
  /// being mapped. A host running ahead of its GPU frees memory the GPU has not reached, and
  /// a large request then finds it fragmented and unproven: a training loop's large
  /// activations made the pool grow step after step (docs/deep-learning.md). Blocks the
  /// calling thread, not the GPU or other threads, until the stream catches up to the call
  /// (spinning, as cudaEventSynchronize does): never turn it on for a stream whose queued work
  /// waits on something the allocating thread does later (a flag it sets, a collective whose
  /// peers wait for it), or the wait never ends. Off by default until its cost is measured on a
  /// GPU.
  bool wait_before_growing = false;
};

}  // namespace streamalloc
